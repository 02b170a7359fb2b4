"""Decode speed, compression overhead and KV memory of every method, side by side, in one run.

    python scripts/bench_methods.py                      # bundled SmolLM2-135M, budget 256, 2048 new tokens
    python scripts/bench_methods.py --tokens 1024 --methods full,snapkv,rkv --json out.json

For each method: decode tokens/s, the share of decode time spent in compression rounds
(`cache.scoring_seconds`) and in per-step statistics (`cache.observe_seconds`: H2O, VATP, LazyEviction,
RaaS), the number of rounds, and the K/V bytes right after the last round: `used` is what the cache's
slots hold (`memory_bytes()`), `live` counts only live entries, `alloc` is what its buffers occupy
(`allocated_bytes()`: spare slots for the next `divide_length` tokens and per-slot positions included).
PyramidKV and Ada-KV use the packed layout (packed.py), so their used bytes equal their live bytes.
TriAttention runs when the model's bundled statistics exist.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import trikv
from trikv.cache import CompressedCache
from trikv.calibration import StatsFileError, bundled_stats_path

METHODS = ["full", "triattention", "streaming", "h2o", "snapkv", "pyramidkv", "adakv", "tova", "knorm", "rkv", "lazyeviction", "raas", "rpc", "vatp"]
PROMPT = (
    "Solve step by step, checking every step: a sequence starts 3, 7, 15, 31, ... where each term is twice the "
    "previous plus one. Find the 12th term, the sum of the first 12 terms, and prove your formula by induction."
)


def run(model, tokenizer, method: str, budget: int, tokens: int, stats, engine: str = "transformers") -> dict:
    options = {"stats": stats} if method.startswith("triattention") else {}
    cache = None
    after_round: list[tuple[int, int]] = []
    if method != "full":
        cache = trikv.make_cache(model, method, budget=budget, **options)
        original = cache.compress

        def compress():
            rounds = cache.rounds
            original()
            if cache.rounds > rounds:
                after_round.append((cache.memory_bytes(), _live_bytes(cache), cache.allocated_bytes()))

        cache.compress = compress
    started = time.perf_counter()
    result = trikv.generate(model, tokenizer, PROMPT, method=method, budget=budget, cache=cache, max_new_tokens=tokens,
                            min_new_tokens=tokens, engine=engine)
    wall = time.perf_counter() - started
    row = {
        "method": method,
        "decode_tok_s": result.decode_tokens_per_second,
        "decode_s": result.decode_seconds,
        "prefill_s": result.prefill_seconds,
        "wall_s": wall,
        "steps": result.steps,
        "rounds": result.compression_rounds,
        "scoring_s": result.scoring_seconds,
        "observe_s": getattr(result.cache, "observe_seconds", 0.0),
        "final_bytes": result.final_cache_bytes,
        "peak_entries": result.peak_entries,
    }
    if isinstance(result.cache, CompressedCache):
        row["layout"] = result.cache.layout
        row["physical_bytes_after_round"], row["live_bytes_after_round"], row["allocated_bytes_after_round"] = (
            after_round[-1] if after_round else (result.final_cache_bytes, _live_bytes(result.cache), result.cache.allocated_bytes()))
        row["query_window_bytes"] = 0 if result.cache.query_window is None else result.cache.query_window.nbytes
    else:
        row["physical_bytes_after_round"] = row["live_bytes_after_round"] = row["allocated_bytes_after_round"] = result.final_cache_bytes
        row["query_window_bytes"] = 0
        row["layout"] = "dynamic"
    return row


def _live_bytes(cache: CompressedCache) -> int:
    if cache.batch_size < 0:
        return 0
    live = int((cache.visible_positions() >= 0).sum())
    keys = cache.stored_keys(0)
    return 2 * live * keys.shape[-1] * keys.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--engine", default="transformers", choices=["transformers", "lean"])
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = trikv.load_model(args.model)
    stats = None
    if bundled_stats_path(args.model).exists():
        try:
            stats = trikv.load_stats(args.model, model)
        except StatsFileError as error:
            print(f"[bench] bundled stats unusable: {error}")
    rows = []
    for method in args.methods.split(","):
        if method.startswith("triattention") and stats is None:
            print(f"[bench] skipping {method}: no bundled statistics for {args.model}")
            continue
        row = run(model, tokenizer, method, args.budget, args.tokens, stats, args.engine)
        rows.append(row)
        print(f"[bench] {method}: {row['decode_tok_s']:.1f} tok/s, {row['rounds']} rounds, {row['wall_s']:.0f} s", flush=True)
    print()
    print(f"model {args.model}, budget {args.budget}, {args.tokens} new tokens (min = max), greedy, fp32, "
          f"{torch.get_num_threads()} threads, {args.engine} engine")
    header = (f"{'method':<13} {'layout':<8} {'tok/s':>7} {'rounds':>6} {'scoring %':>9} {'observe %':>9} {'KV MiB used':>11} "
              f"{'KV MiB live':>11} {'MiB alloc':>9} {'qwin KiB':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        decode = max(row["decode_s"], 1e-9)
        print(
            f"{row['method']:<13} {row['layout']:<8} {row['decode_tok_s']:>7.1f} {row['rounds']:>6} {100 * row['scoring_s'] / decode:>9.1f} "
            f"{100 * row['observe_s'] / decode:>9.1f} {row['physical_bytes_after_round'] / 2**20:>11.2f} "
            f"{row['live_bytes_after_round'] / 2**20:>11.2f} {row['allocated_bytes_after_round'] / 2**20:>9.2f} "
            f"{row['query_window_bytes'] / 2**10:>8.0f}"
        )
    print("KV MiB: K+V after the last compression round (full: at the end); used = slots in use (memory_bytes),")
    print("live = live entries only, alloc = buffers incl. spare slots for the next divide_length tokens and per-slot tags.")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model, "budget": args.budget, "tokens": args.tokens, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
