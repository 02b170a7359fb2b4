"""`trikv bench serve-report`: a Markdown page (docs/serving*.md) from `trikv bench serve` folders.

The target is evaluated from the recorded numbers: at a pool that fits `pool_requests` full-attention
requests, the bounded method at B=512 and 32 concurrent requests reaches TARGET_RATIO x the output
throughput of full attention at the same concurrency. Nothing is typed in. The page opens with the shared
header (`report_pages.page_header`); its title, unless given, is derived from the runs (methods, concurrency,
request length, model, mode), so pages of different runs do not share one.
"""

from __future__ import annotations

import json
from pathlib import Path

from .report_pages import command_line, embed_plot, page_header
from .serving import TARGET_RATIO, engine_name, format_kv_bytes, format_max_batch, format_table, kv_dtype_name

MAX_BATCH_TARGET_RATIO = 3.0  # bounded engine's best output tokens/s over full attention's best, both at max batch
MAX_BATCH_TARGET_LENGTH = 16384  # tokens per request where that target is judged (the paper decodes 16K)


def _seconds(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def target_rows(record: dict) -> list[tuple[str, str, bool | None]]:
    rows = []
    settings = record["settings"]
    for run in [] if record.get("max_batch") else record["runs"]:  # the fixed-slot target of the fixed-slot protocol
        if run["budget"] != 512 or run["concurrency"] != 32:
            continue
        ratio = run.get("throughput_vs_full")
        rows.append((
            f"{engine_name(run)}, 32 concurrent {settings['length']}-token generations, pool = {settings['pool_requests']} "
            f"full requests ({run['mode']}): >= {TARGET_RATIO}x full attention's output tokens/s",
            "full attention not measured" if ratio is None else f"x{ratio:.2f}",
            None if ratio is None else ratio >= TARGET_RATIO,
        ))
    for entry in record.get("max_batch") or []:
        ratio = entry.get("best_vs_full_best")
        if entry["budget"] is None:
            continue
        judged = settings["length"] == MAX_BATCH_TARGET_LENGTH  # the target is set at 16K-token generations
        rows.append((
            f"{engine_name(entry)} at its best concurrency vs full attention at its best"
            + ("" if entry.get("kv_cache_dtype", "auto") == "auto" else " (same KV dtype)") + ", "
            f"{settings['length']}-token generations, pool = {settings['pool_requests']} full requests: "
            f">= {MAX_BATCH_TARGET_RATIO}x at {MAX_BATCH_TARGET_LENGTH} tokens"
            + ("" if judged else f" (reported at {settings['length']}, judged at {MAX_BATCH_TARGET_LENGTH} only)"),
            "full attention not measured" if ratio is None else f"x{ratio:.2f}",
            None if ratio is None or not judged else ratio >= MAX_BATCH_TARGET_RATIO,
        ))
    return rows


def _latency_note(run: dict) -> str:
    """TPOT p99 / p50, and the compaction rounds' count and mean time (since the engine started, warm-up
    included), where the run has them."""
    tpot = run["tpot_seconds"]
    note = "" if not tpot.get("p99") else f"; TPOT p99 / p50 = {tpot['p99'] / tpot['p50']:.2f}"
    rounds = (run.get("trikv") or {}).get("rounds") or 0
    if rounds:
        note += (f"; {rounds} compaction rounds since the engine started, "
                 f"{run['trikv']['seconds'] / rounds * 1000:.1f} ms each on average")
    return note


def _bound_lines(record: dict) -> list[str]:
    """What bounds each run: KV entries read per decode step against what the window achieved."""
    lines = []
    for run in record["runs"]:
        tpot = run["tpot_seconds"]["p50"]
        if tpot is None:
            continue
        lines.append(f"- {engine_name(run)}, "
                     f"{run['concurrency']} slots ({run['mode']}): {run['output_tokens_per_second']:.1f} tok/s; "
                     f"a request advances every {tpot * 1000:.0f} ms (p50), so about "
                     f"{run['output_tokens_per_second'] * tpot:.1f} requests decode per step on average; "
                     f"peak KV {run.get('peak_kv_blocks', '?')} of {run.get('pool_blocks', record['pool_blocks']) - 1} blocks, "
                     f"{int(run.get('preemptions_in_window') or 0)} preemptions in the window"
                     + _latency_note(run)
                     + (f"; the warm-up reached its cap ({run['warmup_seconds']:.0f} s) before "
                        + ("every first request was compacted (the pool could not admit them all at once)"
                           if run["budget"] is not None else "the pool had been full for the settle time")
                        if run.get("warmup_capped") else ""))
    def key(run: dict) -> tuple:
        return run["concurrency"], run["mode"], run.get("kv_cache_dtype", "auto")

    full = {key(run): run for run in record["runs"] if run["budget"] is None}
    for run in record["runs"]:
        reference = full.get(key(run))
        if run["budget"] is None or reference is None or None in (run["tpot_seconds"]["p50"], reference["tpot_seconds"]["p50"]):
            continue
        decoding = reference["output_tokens_per_second"] * reference["tpot_seconds"]["p50"]
        lines.append(f"- {engine_name(run)} vs full, {run['concurrency']} slots ({run['mode']}): about "
                     f"{run['output_tokens_per_second'] * run['tpot_seconds']['p50']:.1f} requests decode per step against full "
                     f"attention's {decoding:.1f} (its pool holds that many of its spread-age requests), "
                     f"x{run['output_tokens_per_second'] * run['tpot_seconds']['p50'] / decoding:.2f}; the step time does the rest "
                     f"({run['tpot_seconds']['p50'] * 1000:.0f} vs {reference['tpot_seconds']['p50'] * 1000:.0f} ms p50). With every "
                     f"slot busy the concurrency share cannot pass {run['concurrency']} / {decoding:.1f} = "
                     f"x{run['concurrency'] / decoding:.2f}: on this CPU a step costs more with a larger batch, so beyond that "
                     "only a cheaper step (shorter attention) adds throughput")
    return lines


def _pool_lines(record: dict) -> list[str]:
    """Where the runs used more than one KV cache dtype: the pool rule and each dtype's pool (blocks and the bytes of
    a block); nothing for a run at auto only (or recorded before the option)."""
    pools = record.get("pool_blocks_by_kv_dtype") or {}
    if list(pools) in ([], ["auto"]):
        return []
    layouts = record.get("kv_layout") or {}
    dtype = record["settings"]["dtype"]
    parts = []
    for kv_cache_dtype, blocks in pools.items():
        layout = layouts.get(kv_cache_dtype)
        size = "" if layout is None else (f" of {layout['block_bytes']:,} bytes ({layout['entry_bytes']:,} bytes per token: "
                                          f"{layout['element_bytes']} per element)")
        parts.append(f"{dtype if kv_cache_dtype == 'auto' else kv_cache_dtype} KV {blocks - 1} blocks{size}")
    total = f"{record['pool_bytes'] / 2**20:,.0f} MiB at every KV dtype" if record.get("pool_bytes") else "the same bytes at every KV dtype"
    return [f"- KV pool: {total}: " + "; ".join(parts) + f". The rule: {record.get('pool_rule', 'the same bytes at every KV dtype')}.", ""]


def _load(folder: Path) -> dict:
    path = folder / "serving.json"
    if not path.is_file():
        raise FileNotFoundError(f"no serving.json in {folder}")
    return json.loads(path.read_text())


def _numbers(values) -> str:
    """8 / 16 / 32 -> '8-32' from three on, '8/16' for two, '8' for one (thousands separated)."""
    values = sorted(set(values))
    if len(values) > 2:
        return f"{values[0]:,}-{values[-1]:,}"
    return "/".join(f"{value:,}" for value in values)


def default_title(records: list[dict]) -> str:
    """The page's title from its runs: the methods, the concurrency (fixed, or each engine's best where the runs
    climb to their own best), the KV cache dtypes (unless every run is at auto), the request length, the models and
    the modes."""
    runs = [run for record in records for run in record["runs"]]
    budgets: dict[str, set] = {}
    for run in runs:
        budgets.setdefault(run["method"], set()).add(run["budget"])
    methods = " vs ".join("full attention" if method == "full" else f"{method} B={'/'.join(map(str, sorted(b)))}"
                          for method, b in sorted(budgets.items(), key=lambda item: (item[0] != "full", item[0])))
    fixed = [run["concurrency"] for record in records if not record.get("max_batch") for run in record["runs"]]
    where = " and ".join(([f"{_numbers(fixed)} concurrent"] if fixed else [])
                         + (["each one's best concurrency"] if any(record.get("max_batch") for record in records) else []))
    lengths = _numbers(record["settings"]["length"] for record in records)
    models = ", ".join(sorted({record["settings"]["model"] for record in records}))
    modes = ", ".join(sorted({run["mode"] for run in runs}))
    dtypes = list(dict.fromkeys(kv_dtype_name(record, run) if run.get("kv_cache_dtype", "auto") != "auto"
                                else "auto" for record in records for run in record["runs"]))
    named = [" / ".join(sorted({record["settings"]["dtype"] for record in records})) if d == "auto" else d for d in dtypes]
    kv = "" if dtypes == ["auto"] else f", KV cache {' and '.join(named)}"
    return f"trikv inside vLLM: {methods} at {where}{kv}, {lengths}-token requests ({models}, {modes})"


def _label(run: dict) -> str:
    return engine_name(run)


def _figure(named: list[tuple[str, dict]]) -> str:
    """The main figure: the bounded engine's best throughput over full attention's (at each one's best
    concurrency, else at the same concurrency); where full attention was not measured, the fastest run's
    output tokens/s and its time per output token. Where engines ran at a KV cache dtype other than auto, the
    ratio is against full attention at the same KV dtype, and each such engine's best over its best at auto
    follows."""
    best_batch = [(entry["best_vs_full_best"], name, record, entry) for name, record in named
                  for entry in record.get("max_batch") or [] if entry.get("best_vs_full_best") is not None]
    if best_batch:
        ratio, name, record, entry = max(best_batch, key=lambda item: item[0])
        dtype = entry.get("kv_cache_dtype", "auto")
        by_dtype = [f"{_label(other)} x{other['best_vs_auto_best']:.2f}" for other in record["max_batch"]
                    if other.get("best_vs_auto_best") is not None]
        return (f"{_label(entry)} at its best concurrency ({entry['best_concurrency']}) serves x{ratio:.2f} full "
                f"attention's best output tokens/s{'' if dtype == 'auto' else ' at ' + dtype} "
                f"({record['settings']['length']:,}-token requests, `{name}`)"
                + (f"; each engine's best over its best at {record['settings']['dtype']} KV: {', '.join(by_dtype)}"
                   if by_dtype else ""))
    fixed = [(run["throughput_vs_full"], name, record, run) for name, record in named
             for run in record["runs"] if run.get("throughput_vs_full") is not None and run["budget"] is not None]
    if fixed:
        ratio, name, record, run = max(fixed, key=lambda item: item[0])
        return (f"{_label(run)} at {run['concurrency']} concurrent serves x{ratio:.2f} full attention's output tokens/s "
                f"at the same concurrency ({record['settings']['length']:,}-token requests, {run['mode']}, `{name}`)")
    name, record, run = max(((name, record, run) for name, record in named for run in record["runs"]),
                            key=lambda item: item[2]["output_tokens_per_second"])
    tpot = run["tpot_seconds"]
    latency = (f", time per output token p50 {_seconds(tpot['p50'])} / p99 {_seconds(tpot['p99'])}"
               if tpot.get("p50") is not None else "")
    return (f"{_label(run)} at {run['concurrency']} concurrent: {run['output_tokens_per_second']:.1f} output tokens/s"
            f"{latency} (`{name}`, the fastest run; full attention not measured)")


def _header(named: list[tuple[str, dict]], command: str, title: str) -> list[str]:
    records = [record for _, record in named]
    pools = _numbers(record["settings"]["pool_requests"] for record in records)
    runs = sum(len(record["runs"]) for record in records)
    measured = (f"output tokens/s, TTFT and TPOT of vLLM engines ({_numbers(r['machine']['cpus'] for r in records)} CPU "
                f"cores) serving concurrent greedy generations from a KV pool of {pools} full-length requests: {runs} "
                f"run{'s' if runs != 1 else ''} in {len(named)} folder{'s' if len(named) != 1 else ''}")
    checked = [(f"`{name}`: {target}" if len(named) > 1 else target, ok)
               for name, record in named for target, _, ok in target_rows(record)]
    return page_header(title, command, measured, _figure(named), checked, [record.get("commit") for record in records])


def _check_title_is_new(title: str, out: Path) -> None:
    """Two pages never share a title: a page beside `out` (another Markdown file in its folder) that opens with the
    same title is an error that asks for `--title`."""
    for page in sorted(out.parent.glob("*.md")):
        if page.resolve() == out.resolve():
            continue
        with page.open(encoding="utf-8") as handle:
            first = handle.readline().rstrip("\n")
        if first == f"# {title}":
            raise ValueError(f"{page} already has the title {title!r}: give this page its own with --title")


def write_serving_report(folders: list[str | Path], out: str | Path, title: str | None = None) -> Path:
    """The page for these run folders: the header (title derived from the runs unless given), then one section
    per folder with its target, table and what bounds its runs."""
    out = Path(out)
    assets = out.parent / f"{out.stem}_files"
    assets.mkdir(parents=True, exist_ok=True)
    named = [(Path(folder).resolve().name, _load(Path(folder))) for folder in folders]
    command = command_line("trikv", "bench", "serve-report", *folders, "--out", out, *(["--title", title] if title else []))
    heading = title or default_title([record for _, record in named])
    _check_title_is_new(heading, out)
    lines = _header(named, command, heading) + [
        "Each row is one vLLM engine (vLLM's CPU build on this machine) with the same fixed KV pool, serving N",
        "concurrent greedy generations of `length` tokens each; a finished request is replaced at once. The window opens",
        "in each engine's steady regime. With trikv, a request's cost stops depending on its age once compacted: the",
        "first requests start short and the window opens when all of them have been compacted. Full attention's",
        "steady state has ages spread over [0, length) and the pool full: slot i's first request carries a",
        "prompt of i/N x length tokens (a request that has run that long) and the window opens `settle` seconds",
        "after the pool first fills. TTFT counts requests whose first token falls in the window; TPOT is the",
        "time between consecutive tokens of a request. See `trikv/benchmarks/serving_engine.py`.", ""]
    for index, (folder, (name, record)) in enumerate(zip(folders, named)):
        folder = Path(folder)
        settings = record["settings"]
        lines += [f"## Run `{name}`", "",
                  f"- command: `{record.get('command') or 'trikv bench serve'}`",
                  f"- model {settings['model']} ({settings['dtype']}), {settings['length']}-token requests, KV pool "
                  f"{record['pool_blocks'] - 1} blocks of {settings['block_size']} tokens = {settings['pool_requests']} "
                  f"full-length requests; window {settings['window']:.0f} s; {record['machine']['cpus']} CPU cores; "
                  + (f"{record['elapsed_seconds'] / 60:.1f} min in the last invocation, {record['reused_runs']} of "
                     "the runs read back from an earlier one with the same settings (`--reuse`)" if record.get("reused_runs")
                     else f"{record['elapsed_seconds'] / 60:.1f} min in all"), ""]
        trained = record.get("trained_positions")
        if trained and settings["length"] > trained:
            lines += [f"- {settings['model']} was trained on {trained} positions and these requests run to "
                      f"{settings['length']} (`--beyond-trained-context`): the text past {trained} positions is not "
                      "meaningful; what is measured, the cost of a generation of that length, is.", ""]
        lines += _pool_lines(record)
        rows = target_rows(record)
        if rows:
            lines += ["| target | measured | status |", "|---|---|---|"]
            lines += [f"| {t} | {m} | {'n/a' if ok is None else ('met' if ok else '**not met**')} |" for t, m, ok in rows]
            lines.append("")
        lines += ["```", format_table(record), "```", ""]
        if record.get("max_batch"):
            lines += ["Each engine at the concurrency where its own output throughput peaks (it climbs the slot ladder until "
                      f"the gain falls under {settings.get('min_gain', 0.03):.0%} or its pool preempts; a preempting rung is never "
                      "its best); `floor`: full attention "
                      f"with {settings.get('floor_length', 512)}-token requests at that concurrency, what this machine does "
                      "per token when attention costs almost nothing; `compaction`: the rounds' time over the run's time.",
                      "", "```", format_max_batch(record), "```", ""]
        kv_bytes = format_kv_bytes(record)
        if kv_bytes:
            lines += ["KV bytes per request (MiB, keys and values of every layer). `stated`: what a request holds by the "
                      "rule, budget + divide_length entries for a bounded engine (its length for full attention) times the "
                      "bytes of an entry at its KV dtype; `max blocks` / `held`: the most blocks one bounded request held "
                      "in the run (trikv's `max_request_blocks`, counted in whole blocks) and their bytes; `peak/slot`: "
                      "the pool's peak blocks over the slots, times the block's bytes.", "", "```", kv_bytes, "```", ""]
        lines += ["What bounds the runs:", ""] + _bound_lines(record) + [""]
        png = folder / "throughput.png"
        if png.is_file():
            lines += embed_plot(png, assets, f"{index}_{name}", name)
    out.write_text("\n".join(lines))
    return out


def add_arguments(parser) -> None:
    parser.add_argument("folders", nargs="+", help="`trikv bench serve` output folders (serving.json)")
    parser.add_argument("--out", default="docs/serving.md")
    parser.add_argument("--title", default=None,
                        help="the page's title (default: derived from the runs' methods, concurrency, request length, "
                             "model and mode)")
    parser.set_defaults(func=main)


def main(args) -> int:
    try:
        path = write_serving_report(args.folders, args.out, args.title)
    except ValueError as error:  # a title another page has: say so without a traceback
        raise SystemExit(f"trikv bench serve-report: {error}") from None
    print(f"wrote {path}")
    return 0


def _register() -> None:
    from . import register_bench

    register_bench("serve-report", add_arguments, "render `trikv bench serve` folders into docs/serving.md, target checked")


_register()
