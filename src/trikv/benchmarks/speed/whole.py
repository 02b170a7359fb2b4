"""`trikv bench speed --whole-generation N,...`: whole generations, prompt to prompt + N, bounded vs full attention.

The grid (`runner.run_speed`) times steps at a filled context; a user pays for a whole generation: the steps
before the first round (the bounded cache then holds what full attention holds), every round, and the steps
after, at contexts that grow from the prompt's. Here each (engine, batch, N) group decodes a real prompt of
`prompt_tokens` tokens of the shipped English text (row r of a batch starting r * 97 tokens further) to
prompt + N tokens, greedy, no EOS stop, with full attention and every bounded configuration, interleaved in blocks
of `paired.INTERLEAVE_BLOCK` steps (the order rotated every block), through `paired.Decoding` (trikv.generate's
loop). Per bounded configuration:

- speed-up = full attention's decode time / the bounded cache's, rounds included, with a 95% bootstrap interval
  over the paired blocks;
- the same without the rounds: the bounded cache's time minus what it spent in them (`round_seconds`: scoring,
  selection, compaction and scoring ahead, the cache's own clock). The target: a bounded cache is never slower
  than full attention beyond its measured round cost, i.e. this ratio's interval reaches 1 or above;
- the context from which a full-attention step costs more than a bounded one, rounds included
  (`paired.break_even_context`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...generation import cache_entries
from .config import SpeedConfig, _label, _log, check_methods_and_engines
from .decode import _needs_stats, _percentile
from .paired import (INTERLEAVE_BLOCK, Decoding, break_even_context, first_round_step, interleave, paired_blocks,
                     paired_ratio)

TARGET_NOT_SLOWER = 1.0  # full attention's time / (bounded time - its rounds): the interval must reach this


@dataclass
class WholeResult:
    engine: str
    method: str
    budget: int | None
    spread: bool | None
    batch: int
    new_tokens: int
    prompt_tokens: int
    decode_seconds: float
    tokens_per_second: float
    ms_p50: float
    ms_p99: float
    rounds: int
    round_seconds: float  # the cache's time in rounds (scoring, selection, compaction, scoring ahead)
    round_share: float
    kv_bytes_peak: int
    entries_peak: int
    entries_final: int
    speedup_vs_full: float | None = None  # full's decode time / this one's, rounds included
    speedup_low: float | None = None
    speedup_high: float | None = None
    speedup_without_rounds: float | None = None  # full's decode time / (this one's - its round time)
    without_rounds_low: float | None = None
    without_rounds_high: float | None = None
    blocks: int = 0
    first_round_context: int | None = None
    break_even_context: float | None = None
    step_ms: list[float] = field(default_factory=list)


def prompt_rows(tokenizer, vocab_size: int, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` token ids of the shipped text, row r starting r * 97 tokens in."""
    from .filling import seed_text_ids

    ids = seed_text_ids(tokenizer, vocab_size, length + 97 * batch)
    return [ids[97 * row: 97 * row + length] for row in range(batch)]


def _decoding(model, prompts, method: str, budget: int | None, spread: bool, config: SpeedConfig, stats, engine: str,
              new_tokens: int) -> Decoding:
    from ...fast import FastTriScorer

    options = {"stats": stats} if method != "full" and _needs_stats(method) else {}
    decoding = Decoding(model, None, prompts, method=method, budget=None if method == "full" else budget,
                        divide_length=config.divide_length, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        engine=engine, **options)
    scorer = getattr(getattr(decoding.cache, "policy", None), "scorer", None)
    decoding.spread = spread if isinstance(scorer, FastTriScorer) else None
    if decoding.spread is not None:
        scorer.spread = spread
    return decoding


def _result(decoding: Decoding, engine: str, method: str, budget: int | None, batch: int, new_tokens: int,
            prompt_tokens: int, kv_token: int) -> WholeResult:
    times = decoding.step_seconds
    ms = sorted(t * 1e3 for t in times)
    total = sum(times)
    rounds_seconds = sum(decoding.round_seconds)
    peak_entries = max(decoding.peak_entries, getattr(decoding.cache, "peak_length", 0))
    return WholeResult(
        engine=engine, method=method, budget=budget if method != "full" else None, spread=decoding.spread, batch=batch,
        new_tokens=new_tokens, prompt_tokens=prompt_tokens, decode_seconds=total,
        tokens_per_second=batch * len(times) / total if total else 0.0,
        ms_p50=_percentile(ms, 50), ms_p99=_percentile(ms, 99), rounds=getattr(decoding.cache, "rounds", 0),
        round_seconds=rounds_seconds, round_share=rounds_seconds / total if total else 0.0,
        kv_bytes_peak=batch * peak_entries * kv_token, entries_peak=peak_entries,
        entries_final=cache_entries(decoding.cache), step_ms=[round(t * 1e3, 3) for t in times],
    )


def _compare(full: Decoding, bounded: Decoding, row: WholeResult) -> None:
    """Fill `row`'s paired figures against full attention."""
    row.speedup_vs_full, row.speedup_low, row.speedup_high = paired_ratio(full.step_seconds, bounded.step_seconds)
    without = [max(step - rounds, 0.0) for step, rounds in zip(bounded.step_seconds, bounded.round_seconds)]
    row.speedup_without_rounds, row.without_rounds_low, row.without_rounds_high = paired_ratio(full.step_seconds, without)
    row.blocks = len(paired_blocks(full.step_seconds, bounded.step_seconds))
    first = first_round_step(bounded)
    if first is not None:
        row.first_round_context = bounded.contexts[first]
        row.break_even_context = break_even_context(full.contexts, full.step_seconds, bounded.step_seconds, first)


@torch.no_grad()
def run_whole_generation(config: SpeedConfig, model, tokenizer, stats) -> dict:
    """Every (engine, batch, N) group of `config.whole_generation`; returns the record written to whole.json."""
    from ...lean import stock_layout_copy
    from ..report_pages import repository_commit
    from .machine import kv_bytes_per_token, peak_rss, release_free_memory

    check_methods_and_engines(config)
    if "full" not in config.methods:
        raise ValueError("--whole-generation compares each bounded cache with full attention: include 'full' in --methods")
    if any(n < 1 for n in config.whole_generation) or config.prompt_tokens < 1:
        raise ValueError("--whole-generation lengths and --prompt-tokens must be positive")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    kv_token = kv_bytes_per_token(model)
    stock = stock_layout_copy(model) if "transformers" in config.engines else None
    spreads = {"on": [True], "off": [False], "both": [True, False]}[config.spread]
    bounded_specs = [(m, b, s) for m in config.methods if m != "full" for b in config.budgets for s in spreads]
    results: list[WholeResult] = []
    skipped: list[str] = []
    started = time.perf_counter()
    for batch in config.batch_sizes:
        prompts = prompt_rows(tokenizer, model.config.vocab_size, batch, config.prompt_tokens)
        for new_tokens in config.whole_generation:
            for engine in config.engines:
                full_gb = batch * (config.prompt_tokens + new_tokens) * kv_token / 1e9
                if full_gb > config.max_kv_gb:
                    skipped.append(f"{engine} batch={batch} N={new_tokens}: full attention's KV would reach "
                                   f"{full_gb:.1f} GB > --max-kv-gb {config.max_kv_gb}")
                    _log(f"[speed] skip: {skipped[-1]}", config)
                    continue
                runner = stock if engine == "transformers" else model
                release_free_memory()
                full = _decoding(runner, prompts, "full", None, True, config, stats, engine, new_tokens)
                bounded = [_decoding(runner, prompts, m, b, s, config, stats, engine, new_tokens) for m, b, s in bounded_specs]
                _log(f"[speed] whole generation {engine} batch={batch}: {config.prompt_tokens} + {new_tokens} tokens, "
                     f"full + {len(bounded)} bounded, interleaved", config)
                interleave([full] + bounded)
                reference = _result(full, engine, "full", None, batch, new_tokens, config.prompt_tokens, kv_token)
                reference.speedup_vs_full = reference.speedup_without_rounds = 1.0
                group = [reference]
                for decoding, (method, budget, _) in zip(bounded, bounded_specs):
                    row = _result(decoding, engine, method, budget, batch, new_tokens, config.prompt_tokens, kv_token)
                    _compare(full, decoding, row)
                    group.append(row)
                for row in group:
                    _log(f"[speed]   {_line(asdict(row))}", config)
                results.extend(group)
                del full, bounded
    record = {
        "command": config.command, "commit": repository_commit(), "config": asdict(config),
        "machine": {"threads": torch.get_num_threads(), "torch": torch.__version__},
        "model": {"name": config.model, "kv_bytes_per_token": kv_token, "dtype": str(next(model.parameters()).dtype)},
        "prompt": f"{config.prompt_tokens} tokens of the shipped English text per row (row r starts r * 97 tokens in); "
                  "greedy, no EOS stop",
        "block_steps": INTERLEAVE_BLOCK, "results": [asdict(r) for r in results], "skipped": skipped,
        "seconds": time.perf_counter() - started, "process_peak_rss_mb": peak_rss() / 2**20,
    }
    (out / "whole.json").write_text(json.dumps(record, indent=1))
    table = format_whole_table(record)
    (out / "whole.txt").write_text(table + "\n")
    print(table)
    try:
        plot_whole(record, out / "whole.png")
    except ImportError:
        print("(matplotlib is not installed: no PNG; pip install matplotlib)")
    return record


def _interval(value, low, high) -> str:
    if value is None:
        return "-"
    if low is None or high is None or low != low or high != high:  # NaN: too few blocks for an interval
        return f"x{value:.2f}"
    return f"x{value:.2f} [{low:.2f}, {high:.2f}]"


def _line(r: dict) -> str:
    label = _label(r)
    extra = ""
    if r["method"] != "full":
        extra = (f" {_interval(r['speedup_vs_full'], r['speedup_low'], r['speedup_high'])} vs full, without rounds "
                 f"{_interval(r['speedup_without_rounds'], r['without_rounds_low'], r['without_rounds_high'])}; "
                 f"{r['rounds']} rounds {100 * r['round_share']:.1f}%")
    return f"{r['engine']:12s} b={r['batch']} N={r['new_tokens']:5d} {label:24s} {r['tokens_per_second']:8.1f} tok/s{extra}"


def format_whole_table(record: dict) -> str:
    """The whole-generation rows as a fixed-width table (whole.txt, and the page's code block)."""
    lines = [f"trikv bench speed --whole-generation - {record['model']['name']} ({record['model']['dtype']}), "
             f"{record['machine']['threads']} threads; prompt: {record['prompt']}; runs of a group decoded interleaved "
             f"in blocks of {record['block_steps']} steps", "",
             f"{'engine':12s} {'b':>2s} {'N':>5s} {'method':24s} {'tok/s':>8s} {'p50 ms':>7s} {'p99 ms':>7s} {'rounds':>6s} "
             f"{'round%':>6s} {'KV MiB peak':>11s} {'speed-up vs full [95%]':>24s} {'without rounds [95%]':>22s} "
             f"{'pays from':>9s}"]
    for r in record["results"]:
        pays = "-" if r.get("break_even_context") is None else f"{r['break_even_context']:.0f}"
        full = r["method"] == "full"
        lines.append(
            f"{r['engine']:12s} {r['batch']:2d} {r['new_tokens']:5d} {_label(r):24s} {r['tokens_per_second']:8.1f} "
            f"{r['ms_p50']:7.1f} {r['ms_p99']:7.1f} {r['rounds']:6d} {100 * r['round_share']:6.2f} "
            f"{r['kv_bytes_peak'] / 2**20:11.1f} "
            f"{'-' if full else _interval(r['speedup_vs_full'], r['speedup_low'], r['speedup_high']):>24s} "
            f"{'-' if full else _interval(r['speedup_without_rounds'], r['without_rounds_low'], r['without_rounds_high']):>22s} "
            f"{pays:>9s}")
    if record.get("skipped"):
        lines += ["", "skipped:"] + [f"  {s}" for s in record["skipped"]]
    return "\n".join(lines)


def whole_targets(record: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) per bounded row: not slower than full attention beyond its measured round cost, i.e.
    full attention's time / (the bounded time - its round time) has a 95% interval that reaches `TARGET_NOT_SLOWER`
    (its point estimate below it is within the measurement's noise)."""
    rows = []
    for r in record["results"]:
        if r["method"] == "full" or r.get("speedup_without_rounds") is None:
            continue
        high = r.get("without_rounds_high")
        met = (high if high == high and high is not None else r["speedup_without_rounds"]) >= TARGET_NOT_SLOWER
        measured = (f"without rounds {_interval(r['speedup_without_rounds'], r['without_rounds_low'], r['without_rounds_high'])}; "
                    f"with them {_interval(r['speedup_vs_full'], r['speedup_low'], r['speedup_high'])} "
                    f"({r['rounds']} rounds, {r['round_seconds']:.2f} s = {r['round_share']:.1%} of its decode time)")
        rows.append((f"bounded >= full beyond its round cost, {r['engine']} batch {r['batch']}, N={r['new_tokens']}, "
                     f"{_label(r)}", measured, met))
    return rows


def plot_whole(record: dict, path: Path) -> None:
    """Per batch size: time per step against the context for the longest N of each configuration (block means)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in record["results"]})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    block = max(1, record.get("block_steps", INTERLEAVE_BLOCK))
    for ax, batch in zip(axes[0], batches):
        rows = [r for r in record["results"] if r["batch"] == batch]
        longest = max(r["new_tokens"] for r in rows)
        for r in rows:
            if r["new_tokens"] != longest or not r["step_ms"]:
                continue
            means = [statistics.fmean(r["step_ms"][i: i + 4 * block]) for i in range(0, len(r["step_ms"]), 4 * block)]
            contexts = [r["prompt_tokens"] + 1 + i for i in range(0, len(r["step_ms"]), 4 * block)]
            ax.plot(contexts, means, label=f"{r['engine']}: {_label(r)}", linestyle="--" if r["method"] == "full" else "-")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"ms per step (mean of {4 * block} steps)")
        ax.set_title(f"{record['model']['name']}, batch {batch}, {longest} new tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
