"""`trikv bench speed-report`: a Markdown page from `trikv bench speed` folders, with the issue's targets checked.

Each folder holds a `speed.json` (the grid, the engine check, llama.cpp), a `memory.json` (a long real
generation, `--memory-run`) or a `whole.json` (whole generations, bounded vs full attention interleaved,
`--whole-generation`). The targets are evaluated from the numbers in those files, nothing is typed in.
"""

from __future__ import annotations

import json
from pathlib import Path

from .report_pages import embed_plot

TARGET_EFFICIENCY = 0.75  # achieved speed-up / memory-bound speed-up at 16K and 32K
TARGET_SCORING_SHARE = 0.05  # scoring + selection share of decode time at B = 2048
TARGET_P99_OVER_P50 = 2.0
TARGET_ENGINE_SPEEDUP = 2.0  # lean vs transformers at 2K


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
    samples = record["samples"]
    first = next((s for s in samples if s["tokens"] >= 1024), samples[0])
    rss = [s["rss_mb"] for s in samples if s["tokens"] >= first["tokens"]]
    rounds = record.get("rounds")
    lines = [
        f"- {record['method']} B={record['budget']}, divide_length {record['divide_length']}, {record['engine']} engine: "
        f"{record['tokens']:,} generated tokens (greedy, no EOS stop) in {record['seconds'] / 60:.1f} min, {rounds} rounds",
        f"- most entries per (layer, KV head) at any step: **{record['max_entries_per_layer_head']}** "
        f"(limit B + beta = {record['limit']}) - "
        + ("within the limit" if record["max_entries_per_layer_head"] <= record["limit"] else "**over the limit**"),
        f"- process RSS from token {first['tokens']:,} on: {min(rss):.0f} - {max(rss):.0f} MiB "
        f"(first sample {samples[0]['rss_mb']:.0f} MiB at token {samples[0]['tokens']}, last {samples[-1]['rss_mb']:.0f} MiB "
        f"at token {samples[-1]['tokens']:,}); live KV at the end {samples[-1]['kv_bytes'] / 2**20:.1f} MiB",
    ]
    if record.get("command"):
        lines.append(f"- command: `{record['command']}`")
    return lines


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


def write_speed_report(folders: list[str | Path], out: str | Path, title: str = "trikv speed and memory") -> Path:
    out = Path(out)
    assets = out.parent / f"{out.stem}_files"
    assets.mkdir(parents=True, exist_ok=True)
    from .speed.engines import ENGINE_BLOCK
    from .speed.paired import INTERLEAVE_BLOCK

    lines = [f"# {title}", "",
             "Generated by `trikv bench speed-report` from the `speed.json` / `whole.json` / `memory.json` of each run",
             "folder; do not edit by hand. Speed-ups are measured side by side in one process (the runs of a group",
             f"alternate step by step, the two engines of the engine check in blocks of {ENGINE_BLOCK} steps, the runs of",
             f"a whole generation in blocks of {INTERLEAVE_BLOCK}); `bound` is the memory-bound speed-up, (weights + KV",
             "read) / bandwidth, with the bandwidth measured on this machine during the run.", ""]
    for index, folder in enumerate(folders):
        folder = Path(folder)
        name = folder.resolve().name
        if (folder / "speed.json").is_file():
            record = json.loads((folder / "speed.json").read_text())
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
        elif (folder / "whole.json").is_file():
            record = json.loads((folder / "whole.json").read_text())
            lines += _whole_section(name, record)
            png = folder / "whole.png"
        elif (folder / "memory.json").is_file():
            record = json.loads((folder / "memory.json").read_text())
            lines += [f"## Memory run `{name}`", ""] + _memory_section(record) + [""]
            png = folder / "memory.png"
        else:
            raise FileNotFoundError(f"no speed.json, whole.json or memory.json in {folder}")
        if png.is_file():
            lines += embed_plot(png, assets, f"{index}_{name}", name)
    out.write_text("\n".join(lines))
    return out


def add_arguments(parser) -> None:
    parser.add_argument("folders", nargs="+",
                        help="`trikv bench speed` output folders (speed.json, whole.json or memory.json)")
    parser.add_argument("--out", default="docs/speed.md")
    parser.add_argument("--title", default="trikv speed and memory")
    parser.set_defaults(func=main)


def main(args) -> int:
    path = write_speed_report(args.folders, args.out, args.title)
    print(f"wrote {path}")
    return 0


def _register() -> None:
    from . import register_bench

    register_bench("speed-report", add_arguments, "render `trikv bench speed` folders into one Markdown page, targets checked")


_register()
