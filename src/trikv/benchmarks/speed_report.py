"""`trikv bench speed-report`: a Markdown page from `trikv bench speed` folders, with the targets checked.

Each folder holds a `speed.json` (the grid, the engine check, llama.cpp), a `memory.json` (a long real
generation, `--memory-run`) or a `whole.json` (whole generations, bounded vs full attention interleaved,
`--whole-generation`). The targets are evaluated from the numbers in those files, nothing is typed in; the
page opens with the shared header (`report_pages.page_header`): what was measured, the first run's main
figure, and every target of every run, met or not.
"""

from __future__ import annotations

import json
from pathlib import Path

from .report_pages import command_line, embed_plot, page_header

TARGET_EFFICIENCY = 0.75  # achieved speed-up / memory-bound speed-up at 16K and 32K
TARGET_SCORING_SHARE = 0.05  # scoring + selection share of decode time at B = 2048
TARGET_P99_OVER_P50 = 2.0
TARGET_ENGINE_SPEEDUP = 2.0  # lean vs transformers at 2K
DEFAULT_TITLE = "trikv speed and memory"
RUN_FILES = ("speed.json", "whole.json", "memory.json")  # what a run folder holds, in the order they are looked for


def _status(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "**not met**")


def targets(record: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) rows for one speed.json record; cells that the run did not measure are skipped."""
    rows: list[tuple[str, str, bool | None]] = []
    results = [r for r in record["results"] if r["engine"] == "lean" or len({x["engine"] for x in record["results"]}) == 1]
    for batch in sorted({r["batch"] for r in results}):
        for context in (16384, 32768):
            cells = [r for r in results if r["batch"] == batch and r["context"] == context and r["budget"] is not None
                     and r.get("efficiency_vs_bound") is not None and r.get("spread") in (None, True)]
            for r in sorted(cells, key=lambda r: r["budget"]):
                measured = f"x{r['speedup_vs_full']:.2f} vs bound x{r['bound_speedup_vs_full']:.2f} ({r['efficiency_vs_bound']:.0%})"
                floor = _compute_floor(results, r)
                if floor is not None:
                    attainable = r["speedup_vs_full"] * r["ms_p50"] / floor["ms_p50"]  # full's time / the floor's
                    measured += (f"; full attention at a {floor['context']}-token context takes {floor['ms_p50']:.1f} ms a step "
                                 f"(bound {floor['bound_ms']:.1f} ms), so at most x{attainable:.2f} is attainable: "
                                 f"{r['speedup_vs_full'] / attainable:.0%} of it")
                rows.append((
                    f"speed-up >= {TARGET_EFFICIENCY:.0%} of bound, batch {batch}, {context // 1024}K, {r['method']} B={r['budget']}",
                    measured, r["efficiency_vs_bound"] >= TARGET_EFFICIENCY,
                ))
            missing = [r for r in results if r["batch"] == batch and r["context"] == context and r["budget"] is not None
                       and r.get("efficiency_vs_bound") is None]
            if missing and not cells:
                rows.append((f"speed-up vs bound, batch {batch}, {context // 1024}K",
                             "full attention not measured (skipped: " + "; ".join(s for s in record.get("skipped", [])
                                                                          if f"batch={batch} ctx={context}" in s) + ")", None))
    big = [r for r in results if r["budget"] == 2048]
    if big:
        worst = max(big, key=lambda r: r["scoring_share"])
        rows.append((f"scoring + selection <= {TARGET_SCORING_SHARE:.0%} of decode time at B=2048",
                     f"max {worst['scoring_share']:.2%} (batch {worst['batch']}, {worst['context']} tokens)",
                     worst["scoring_share"] <= TARGET_SCORING_SHARE))
    bounded = [r for r in results if r["budget"] is not None]
    if bounded:
        worst = max(bounded, key=lambda r: r["p99_over_p50"])
        rows.append((f"p99 / p50 time per token <= {TARGET_P99_OVER_P50:g}",
                     f"max {worst['p99_over_p50']:.2f} ({_label(worst)}, batch {worst['batch']}, {worst['context']} tokens)",
                     worst["p99_over_p50"] <= TARGET_P99_OVER_P50))
    check = record.get("engine_check")
    if check:
        for method, row in check["methods"].items():
            rows.append((f"lean >= x{TARGET_ENGINE_SPEEDUP:g} vs transformers at {check['context']} tokens, identical greedy tokens ({method})",
                         f"x{row['speedup']:.2f}, identical tokens: {row['identical_greedy_tokens']}",
                         row["speedup"] >= TARGET_ENGINE_SPEEDUP and row["identical_greedy_tokens"]))
    return rows


def _compute_floor(results: list[dict], r: dict) -> dict | None:
    """Full attention at a context of the cell's budget, same batch and engine: the time of a step that reads the
    weights and B entries. Where it is well above its own memory bound (small fp32 GEMMs at batch 8 on one thread are
    compute-bound), no cache of B entries can step faster, whatever the bandwidth says."""
    return next((x for x in results if x["method"] == "full" and x["batch"] == r["batch"] and x["engine"] == r["engine"]
                 and x["context"] == r["budget"]), None)


def _label(r: dict) -> str:
    return r["method"] if r["budget"] is None else f"{r['method']} B={r['budget']}"


def _command(config: dict) -> str:
    parts = ["trikv bench speed", f"--model {config['model']}"]
    for key, flag in (("contexts", "--contexts"), ("methods", "--methods"), ("budgets", "--budgets"),
                      ("batch_sizes", "--batch-sizes"), ("engines", "--engines")):
        parts.append(f"{flag} {','.join(map(str, config[key]))}")
    if config.get("threads"):
        parts.append(f"--threads {config['threads']}")
    if config.get("spread", "on") != "on":
        parts.append(f"--spread {config['spread']}")
    if config.get("max_kv_gb") is not None:
        parts.append(f"--max-kv-gb {config['max_kv_gb']:g}")
    if not config.get("llama_cpp", True):
        parts.append("--no-llama-cpp")
    parts.append(f"--out {config['out']}")
    return " ".join(parts)


def _memory_section(record: dict) -> list[str]:
    from .speed.report import memory_bytes_per_token

    samples = record["samples"]
    first = next((s for s in samples if s["tokens"] >= 1024), samples[0])
    rss = [s["rss_mb"] for s in samples if s["tokens"] >= first["tokens"]]
    rounds = record.get("rounds")
    per_token, source = memory_bytes_per_token(record)
    lines = [
        f"- {record['method']} B={record['budget']}, divide_length {record['divide_length']}, {record['engine']} engine: "
        f"{record['tokens']:,} generated tokens (greedy, no EOS stop) in {record['seconds'] / 60:.1f} min, {rounds} rounds",
        f"- most entries per (layer, KV head) at any step: **{record['max_entries_per_layer_head']}** "
        f"(limit B + beta = {record['limit']}) - "
        + ("within the limit" if _memory_within_limit(record) else "**over the limit**"),
        f"- process RSS from token {first['tokens']:,} on: {min(rss):.0f} - {max(rss):.0f} MiB "
        f"(first sample {samples[0]['rss_mb']:.0f} MiB at token {samples[0]['tokens']}, last {samples[-1]['rss_mb']:.0f} MiB "
        f"at token {samples[-1]['tokens']:,}); live KV at the end {samples[-1]['kv_bytes'] / 2**20:.1f} MiB, where full "
        f"attention would hold {samples[-1]['tokens'] * per_token / 2**20:.1f} MiB ({per_token:,.0f} bytes per token, {source})",
    ]
    if record.get("command"):
        lines.append(f"- command: `{record['command']}`")
    return lines


def _memory_within_limit(record: dict) -> bool:
    return record["max_entries_per_layer_head"] <= record["limit"]


def _whole_section(name: str, record: dict) -> list[str]:
    """A `--whole-generation` run: what it measures, the target per row, its table."""
    from .speed.whole import format_whole_table, whole_targets

    lines = [f"## Whole generations `{name}`", "", f"- command: `{record.get('command') or '(not recorded)'}`",
             f"- torch {record['machine'].get('torch', '?')}, {record['machine']['threads']} thread(s); "
             f"process peak RSS {record['process_peak_rss_mb']:.0f} MiB; {record['seconds'] / 60:.1f} min", "",
             "Each group decodes a prompt to prompt + N tokens (rounds included) with full attention and each bounded",
             "cache interleaved. Speed-up: full attention's decode time over the bounded cache's, with a 95% bootstrap",
             "interval over the paired blocks of steps; *without rounds*: the bounded cache's time minus the time it",
             "spent in rounds (scoring, selection, compaction, scoring ahead). The target is met when that ratio's",
             "interval reaches 1: the bounded cache costs no more per step than full attention beyond its rounds.",
             "*Pays from*: the context from which a full-attention step costs more than a bounded one, rounds",
             "included (a line fitted to the paired per-block ratios after the first round).", ""]
    rows = whole_targets(record)
    if rows:
        lines += ["| target | measured | status |", "|---|---|---|"]
        lines += [f"| {t} | {m} | {_status(ok)} |" for t, m, ok in rows]
        lines.append("")
    lines += ["```", format_whole_table(record), "```", ""]
    return lines


def _load(folder: Path) -> tuple[str, dict]:
    """(the run file's name, its record) of a run folder."""
    for file in RUN_FILES:
        if (folder / file).is_file():
            return file, json.loads((folder / file).read_text())
    raise FileNotFoundError(f"no speed.json, whole.json or memory.json in {folder}")


def _run_targets(file: str, record: dict) -> list[tuple[str, bool | None]]:
    """(target, met) of every target the page checks for one run."""
    if file == "speed.json":
        return [(target, ok) for target, _, ok in targets(record)]
    if file == "whole.json":
        from .speed.whole import whole_targets

        return [(target, ok) for target, _, ok in whole_targets(record)]
    return [(f"most entries per (layer, KV head) <= B + beta = {record['limit']}", _memory_within_limit(record))]


def _measured(file: str, record: dict) -> str:
    """What one run measured, in a few words."""
    from .speed.config import _label as run_label

    if file == "memory.json":
        return f"memory over one {record['tokens']:,}-token generation ({record['method']} B={record['budget']})"
    results = record["results"]
    batches = "/".join(map(str, sorted({r["batch"] for r in results})))
    methods = ", ".join(dict.fromkeys(run_label(r) for r in results))
    if file == "whole.json":
        lengths = "/".join(f"{n:,}" for n in sorted({r["new_tokens"] for r in results}))
        return f"whole {lengths}-token generations of {record['model']['name']}, batch {batches}: {methods}"
    contexts = sorted({r["context"] for r in results})
    return (f"decode speed of {record['model']['name']} at {contexts[0]:,}-{contexts[-1]:,} tokens of context, "
            f"batch {batches}: {methods}")


def _figure(file: str, record: dict) -> str | None:
    """One run's main figure: the bounded cache's best speed-up over full attention at the longest context (or
    generation), or, for a memory run, its live K/V at the end against full attention's."""
    from .speed.config import _label as run_label
    from .speed.report import memory_bytes_per_token

    if file == "memory.json":
        last = record["samples"][-1]
        full = last["tokens"] * memory_bytes_per_token(record)[0]
        return (f"{record['method']} B={record['budget']} holds {last['kv_bytes'] / 2**20:.1f} MiB of K/V after "
                f"{last['tokens']:,} tokens where full attention holds {full / 2**20:.1f} MiB, "
                f"x{full / max(last['kv_bytes'], 1):.1f} less")
    length = "new_tokens" if file == "whole.json" else "context"
    bounded = [r for r in record["results"] if r["budget"] is not None and r.get("speedup_vs_full") is not None]
    if not bounded:
        return None
    longest = max(r[length] for r in bounded)
    best = max((r for r in bounded if r[length] == longest), key=lambda r: r["speedup_vs_full"])
    where = f"over a whole {longest:,}-token generation" if file == "whole.json" else f"at {longest:,} tokens of context"
    return (f"{run_label(best)} decodes x{best['speedup_vs_full']:.2f} as fast as full attention {where} "
            f"(batch {best['batch']}, {best['engine']} engine)")


def _header(runs: list[tuple[str, str, dict]], command: str, title: str) -> list[str]:
    """The page's header: what every run measured, the first run's main figure, every run's targets."""
    several = len(runs) > 1
    measured = "; ".join(_measured(file, record) for _, file, record in runs)
    figure = next((f for f in (_figure(file, record) for _, file, record in runs) if f), "no bounded cache was timed")
    checked = [(f"`{name}`: {target}" if several else target, ok)
               for name, file, record in runs for target, ok in _run_targets(file, record)]
    return page_header(title, command, measured, figure, checked, [record.get("commit") for _, _, record in runs])


def write_speed_report(folders: list[str | Path], out: str | Path, title: str = DEFAULT_TITLE) -> Path:
    """The page for these run folders, in their order: the header, then one section per run with its targets."""
    out = Path(out)
    assets = out.parent / f"{out.stem}_files"
    assets.mkdir(parents=True, exist_ok=True)
    from .speed.engines import ENGINE_BLOCK
    from .speed.paired import INTERLEAVE_BLOCK

    runs = [(Path(folder).resolve().name, *_load(Path(folder))) for folder in folders]
    command = command_line("trikv", "bench", "speed-report", *folders, "--out", out,
                           *(["--title", title] if title != DEFAULT_TITLE else []))
    lines = _header(runs, command, title) + [
        "Each run folder's `speed.json`, `whole.json` or `memory.json` is read as it is. Speed-ups are measured side by",
        "side in one process (the runs of a group alternate step by step, the two engines of the engine check in",
        f"blocks of {ENGINE_BLOCK} steps, the runs of a whole generation in blocks of {INTERLEAVE_BLOCK}); `bound` is the",
        "memory-bound speed-up, (weights + KV read) / bandwidth, with the bandwidth measured on this machine during",
        "the run.", ""]
    for index, (folder, (name, file, record)) in enumerate(zip(folders, runs)):
        folder = Path(folder)
        if file == "speed.json":
            lines += [f"## Run `{name}`", "", f"- command: `{record.get('command') or _command(record['config'])}`",
                      f"- torch {record['machine'].get('torch', '?')}, {record['machine']['threads']} thread(s); "
                      f"process peak RSS {record['process_peak_rss_mb']:.0f} MiB", ""]
            rows = targets(record)
            if rows:
                lines += ["| target | measured | status |", "|---|---|---|"]
                lines += [f"| {t} | {m} | {_status(ok)} |" for t, m, ok in rows]
                lines.append("")
            from .speed.report import format_table

            lines += ["```", format_table(record), "```", ""]
            png = folder / "speed.png"
        elif file == "whole.json":
            lines += _whole_section(name, record)
            png = folder / "whole.png"
        else:
            lines += [f"## Memory run `{name}`", ""] + _memory_section(record) + [""]
            lines += _memory_plot(record, folder, assets, f"{index}_{name}")
            continue
        if png.is_file():
            lines += embed_plot(png, assets, f"{index}_{name}", name)
    out.write_text("\n".join(lines))
    return out


def _memory_plot(record: dict, folder: Path, assets: Path, prefix: str) -> list[str]:
    """The memory run's plot, drawn here from its memory.json so that a run made before the plot showed full
    attention shows it too (the folder's own memory.png where matplotlib is missing); the lines that show it."""
    from .speed.report import plot_memory

    target = assets / f"{prefix}_memory.png"
    try:
        plot_memory(record, target)
    except ImportError:
        png = folder / "memory.png"
        return embed_plot(png, assets, prefix, folder.resolve().name) if png.is_file() else []
    return [f"![{folder.resolve().name}]({assets.name}/{target.name})", ""]


def add_arguments(parser) -> None:
    parser.add_argument("folders", nargs="+",
                        help="`trikv bench speed` output folders (speed.json, whole.json or memory.json)")
    parser.add_argument("--out", default="docs/speed.md")
    parser.add_argument("--title", default=DEFAULT_TITLE)
    parser.set_defaults(func=main)


def main(args) -> int:
    path = write_speed_report(args.folders, args.out, args.title)
    print(f"wrote {path}")
    return 0


def _register() -> None:
    from . import register_bench

    register_bench("speed-report", add_arguments, "render `trikv bench speed` folders into one Markdown page, targets checked")


_register()
