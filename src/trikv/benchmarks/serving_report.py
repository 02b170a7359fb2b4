"""`trikv bench serve-report`: a Markdown page (docs/serving.md) from `trikv bench serve` folders.

The target is evaluated from the recorded numbers: at a pool that fits `pool_requests` full-attention
requests, the bounded method at B=512 and 32 concurrent requests reaches TARGET_RATIO x the output
throughput of full attention at the same concurrency. Nothing is typed in.
"""

from __future__ import annotations

import json
from pathlib import Path

from .report_pages import embed_plot
from .serving import TARGET_RATIO, format_max_batch, format_table

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
            f"{run['method']} B=512, 32 concurrent {settings['length']}-token generations, pool = {settings['pool_requests']} "
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
            f"{entry['method']} B={entry['budget']} at its best concurrency vs full attention at its best, "
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
        lines.append(f"- {run['method'] if run['budget'] is None else run['method'] + ' B=' + str(run['budget'])}, "
                     f"{run['concurrency']} slots ({run['mode']}): {run['output_tokens_per_second']:.1f} tok/s; "
                     f"a request advances every {tpot * 1000:.0f} ms (p50), so about "
                     f"{run['output_tokens_per_second'] * tpot:.1f} requests decode per step on average; "
                     f"peak KV {run.get('peak_kv_blocks', '?')} of {record['pool_blocks'] - 1} blocks, "
                     f"{int(run.get('preemptions_in_window') or 0)} preemptions in the window"
                     + _latency_note(run)
                     + (f"; the warm-up reached its cap ({run['warmup_seconds']:.0f} s) before "
                        + ("every first request was compacted (the pool could not admit them all at once)"
                           if run["budget"] is not None else "the pool had been full for the settle time")
                        if run.get("warmup_capped") else ""))
    full = {(run["concurrency"], run["mode"]): run for run in record["runs"] if run["budget"] is None}
    for run in record["runs"]:
        reference = full.get((run["concurrency"], run["mode"]))
        if run["budget"] is None or reference is None or None in (run["tpot_seconds"]["p50"], reference["tpot_seconds"]["p50"]):
            continue
        decoding = reference["output_tokens_per_second"] * reference["tpot_seconds"]["p50"]
        lines.append(f"- {run['method']} B={run['budget']} vs full, {run['concurrency']} slots ({run['mode']}): about "
                     f"{run['output_tokens_per_second'] * run['tpot_seconds']['p50']:.1f} requests decode per step against full "
                     f"attention's {decoding:.1f} (its pool holds that many of its spread-age requests), "
                     f"x{run['output_tokens_per_second'] * run['tpot_seconds']['p50'] / decoding:.2f}; the step time does the rest "
                     f"({run['tpot_seconds']['p50'] * 1000:.0f} vs {reference['tpot_seconds']['p50'] * 1000:.0f} ms p50). With every "
                     f"slot busy the concurrency share cannot pass {run['concurrency']} / {decoding:.1f} = "
                     f"x{run['concurrency'] / decoding:.2f}: on this CPU a step costs more with a larger batch, so beyond that "
                     "only a cheaper step (shorter attention) adds throughput")
    return lines


def write_serving_report(folders: list[str | Path], out: str | Path) -> Path:
    out = Path(out)
    assets = out.parent / f"{out.stem}_files"
    assets.mkdir(parents=True, exist_ok=True)
    lines = ["# trikv inside vLLM: serving throughput", "",
             "Generated by `trikv bench serve-report` from `trikv bench serve` folders; do not edit by hand. Each row",
             "is one vLLM engine (vLLM's CPU build on this machine) with the same fixed KV pool, serving N concurrent",
             "greedy generations of `length` tokens each; a finished request is replaced at once. The window opens in",
             "each engine's steady regime. With trikv, a request's cost stops depending on its age once compacted: the",
             "first requests start short and the window opens when all of them have been compacted. Full attention's",
             "steady state has ages spread over [0, length) and the pool full: slot i's first request carries a",
             "prompt of i/N x length tokens (a request that has run that long) and the window opens `settle` seconds",
             "after the pool first fills. TTFT counts requests whose first token falls in the window; TPOT is the",
             "time between consecutive tokens of a request. See `trikv/benchmarks/serving_engine.py`.", ""]
    for index, folder in enumerate(folders):
        folder = Path(folder)
        path = folder / "serving.json"
        if not path.is_file():
            raise FileNotFoundError(f"no serving.json in {folder}")
        record = json.loads(path.read_text())
        name = folder.resolve().name
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
        lines += ["What bounds the runs:", ""] + _bound_lines(record) + [""]
        png = folder / "throughput.png"
        if png.is_file():
            lines += embed_plot(png, assets, f"{index}_{name}", name)
    out.write_text("\n".join(lines))
    return out


def add_arguments(parser) -> None:
    parser.add_argument("folders", nargs="+", help="`trikv bench serve` output folders (serving.json)")
    parser.add_argument("--out", default="docs/serving.md")
    parser.set_defaults(func=main)


def main(args) -> int:
    print(f"wrote {write_serving_report(args.folders, args.out)}")
    return 0


def _register() -> None:
    from . import register_bench

    register_bench("serve-report", add_arguments, "render `trikv bench serve` folders into docs/serving.md, target checked")


_register()
