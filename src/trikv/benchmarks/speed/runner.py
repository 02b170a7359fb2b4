"""The speed grid (groups decoding in lockstep) and the long real generation of `--memory-run`."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ...compat import cache_kwargs
from ..report_pages import repository_commit
from .machine import current_rss, kv_bytes_per_token, measure_bandwidth, peak_rss, release_free_memory, weight_bytes_per_step
from .filling import Filler, make_seed, seed_text_ids
from .decode import DecodeRun, RunResult, _needs_stats
from .peers import run_llama_cpp
from .engines import compare_engines
from .report import plot_memory, write_outputs
from .config import SpeedConfig, _label, _log, _short, check_methods_and_engines




def _load(config: SpeedConfig):
    from ... import load_model

    model, tokenizer = load_model(config.model)
    return model, tokenizer


def _load_stats(config: SpeedConfig, model):
    from ...calibration import load_stats

    if not any(_needs_stats(m) for m in config.methods if m != "full"):
        return None
    return load_stats(config.stats or config.model, model)


def run_speed(config: SpeedConfig, model=None, tokenizer=None, stats=None) -> dict:
    """Run the grid; returns the JSON-able record (also written to `config.out` with CSV, PNG and table)."""

    check_methods_and_engines(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    if model is None:
        model, tokenizer = _load(config)
    if stats is None:
        stats = _load_stats(config, model)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    _log(f"[speed] measuring memory bandwidth ({torch.get_num_threads()} threads) ...", config)
    bandwidth = measure_bandwidth(config.bandwidth_mb)
    bandwidth["per_group"] = []
    weight_bytes = weight_bytes_per_step(model)
    kv_token = kv_bytes_per_token(model)
    _log(f"[speed] bandwidth {bandwidth['gbps']} GB/s; weights read per step {weight_bytes / 1e6:.1f} MB; "
         f"KV {kv_token / 1e3:.1f} kB per cached token", config)
    from ...lean import stock_layout_copy

    # the lean engine re-points the model's weights to its faster layout; transformers runs get the layout it loads
    stock = stock_layout_copy(model) if "transformers" in config.engines else None
    seed = make_seed(model, tokenizer, config.seed_tokens)
    filler = Filler(model, seed)
    first_token = seed.token_ids[-1]
    results: list[RunResult] = []
    skipped: list[str] = []
    methods = [m for m in config.methods if m != "full"]
    include_full = "full" in config.methods
    steps_total = config.steps + config.warmup
    for batch in config.batch_sizes:
        for context in config.contexts:
            for engine in config.engines:
                spreads = {"on": [True], "off": [False], "both": [True, False]}[config.spread]
                specs = ([("full", None, True)] if include_full else []) + [
                    (m, b, sp) for m in methods for b in config.budgets for sp in spreads]
                runs: list[DecodeRun] = []
                release_free_memory()
                baseline_rss = current_rss()
                group_gb = 0.0  # KV the group's caches hold during decoding (they all live at once)
                for method, budget, spread in specs:
                    if method == "full":
                        steady = transient = context + steps_total
                    else:
                        steady = min(context + steps_total, budget + config.divide_length)
                        transient = min(context + steps_total, budget + config.divide_length + config.fill_chunk)
                    needed = group_gb + batch * transient * kv_token / 1e9
                    if needed > config.max_kv_gb:
                        skipped.append(f"{engine} {_label({'method': method, 'budget': budget, 'spread': spread})} "
                                       f"batch={batch} ctx={context}: KV of the group would reach {needed:.1f} GB > "
                                       f"--max-kv-gb {config.max_kv_gb}")
                        _log(f"[speed] skip: {skipped[-1]}", config)
                        continue
                    group_gb += batch * steady * kv_token / 1e9
                    _log(f"[speed] fill {engine} {method} B={budget} batch={batch} ctx={context}", config)
                    runs.append(DecodeRun(stock if engine == "transformers" else model, engine, method, budget, batch, context,
                                          filler, config.divide_length, stats, config.fill_chunk, first_token,
                                          steps_total, spread=spread))
                if not runs:
                    continue
                rss_peak = current_rss()
                group_bandwidth = measure_bandwidth(config.bandwidth_mb, repeats=3)["gbps"]  # the machine now
                bandwidth["per_group"].append({"engine": engine, "batch": batch, "context": context, "gbps": group_bandwidth})
                for step in range(steps_total):
                    order = runs[step % len(runs):] + runs[: step % len(runs)]  # rotate who goes first
                    for run in order:
                        run.step(record=step >= config.warmup)
                    rss_peak = max(rss_peak, current_rss())
                group = [run.result(weight_bytes, kv_token, max(group_bandwidth, bandwidth["gbps"]), rss_peak) for run in runs]
                for r in group:
                    r.rss_group_start_mb = baseline_rss / 2**20
                _fill_ratios(group)
                for r in group:
                    _log(f"[speed]   {_short(r)}", config)
                results.extend(group)
                (out / "speed.partial.json").write_text(json.dumps({"results": [asdict(r) for r in results], "skipped": skipped,
                                                                    "bandwidth": bandwidth}, indent=1))
                del runs
                release_free_memory()
                _log(f"[speed] RSS {baseline_rss / 2**20:.0f} -> peak {rss_peak / 2**20:.0f} MiB", config)
    engine_check = None
    if config.engine_check and set(config.engines) >= {"lean", "transformers"}:
        engine_check = compare_engines(model, filler, first_token, stats, config, weight_bytes, kv_token, bandwidth["gbps"], stock)
    peer = run_llama_cpp(config, model, seed, filler, results, weight_bytes, bandwidth["gbps"])
    record = {
        "command": config.command,
        "commit": repository_commit(),
        "config": asdict(config),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "bandwidth": bandwidth, "cpu_count": os.cpu_count()},
        "model": {"name": config.model, "weight_bytes_per_step": weight_bytes, "kv_bytes_per_token": kv_token,
                  "dtype": str(next(model.parameters()).dtype)},
        "fill": f"real prefill of {config.seed_tokens} tokens tiled to the context, keys re-rotated to their positions; "
                f"bounded caches filled in chunks of {config.fill_chunk}, prompt not protected",
        "results": [asdict(r) for r in results],
        "skipped": skipped,
        "engine_check": engine_check,
        "llama_cpp": peer,
        "process_peak_rss_mb": peak_rss() / 2**20,
    }
    write_outputs(record, out)
    return record


def _fill_ratios(group: list[RunResult]) -> None:
    full = next((r for r in group if r.method == "full"), None)
    for r in group:
        if full is None or r is full:
            if r is full:
                r.speedup_vs_full, r.bound_speedup_vs_full, r.efficiency_vs_bound = 1.0, 1.0, 1.0
            continue
        r.speedup_vs_full = full.ms_mean / r.ms_mean if r.ms_mean else None
        r.bound_speedup_vs_full = full.bound_ms / r.bound_ms if r.bound_ms else None
        if r.speedup_vs_full and r.bound_speedup_vs_full:
            r.efficiency_vs_bound = r.speedup_vs_full / r.bound_speedup_vs_full


@torch.no_grad()
def memory_run(model, tokenizer, stats, method: str, budget: int, tokens: int, divide_length: int, out: Path,
               engine: str = "lean", every: int = 64, progress: bool = True, command: str = "") -> dict:
    """Generate `tokens` real tokens (greedy, no EOS stop, batch 1) and sample RSS and KV entries over time."""
    from ...cache import make_cache
    from ...lean import LeanEngine

    options = {"stats": stats} if _needs_stats(method) else {}
    cache = make_cache(model, method, budget=None if method == "full" else budget, divide_length=divide_length, **options)
    ids = seed_text_ids(tokenizer, model.config.vocab_size, 64)
    device = next(model.parameters()).device
    engine_ = LeanEngine.for_model(model) if engine == "lean" else None
    x = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device)[None]
    samples = []
    started = time.perf_counter()
    max_entries = 0
    for step in range(tokens):
        if engine_ is not None:
            logits = engine_.forward(x, cache, position_ids=positions)[:, -1]
        else:
            logits = model(input_ids=x, position_ids=positions, **cache_kwargs(model, cache), logits_to_keep=1).logits[:, -1]
        x = logits.argmax(-1, keepdim=True)
        positions = positions[:, -1:] + 1
        max_entries = max(max_entries, cache.entries())
        if step % every == 0 or step == tokens - 1:
            samples.append({"tokens": len(ids) + step + 1, "rss_mb": current_rss() / 2**20, "entries": cache.entries(),
                            "kv_bytes": cache.memory_bytes(), "seconds": time.perf_counter() - started})
            if progress and step % (every * 16) == 0:
                print(f"[speed] memory run {method}: {samples[-1]['tokens']} tokens, RSS {samples[-1]['rss_mb']:.0f} MiB, "
                      f"{samples[-1]['entries']} entries", file=sys.stderr, flush=True)
    record = {"command": command, "commit": repository_commit(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "kv_bytes_per_token": kv_bytes_per_token(model),  # what full attention holds per token, for the page
              "method": method, "budget": budget, "divide_length": divide_length, "engine": engine, "tokens": tokens,
              "max_entries_per_layer_head": max_entries, "limit": budget + divide_length, "rounds": cache.rounds,
              "samples": samples, "seconds": time.perf_counter() - started}
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(record, indent=1))
    try:
        plot_memory(record, out / "memory.png")
    except ImportError:
        pass
    return record
