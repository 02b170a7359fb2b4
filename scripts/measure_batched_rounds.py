"""Side by side: a batch of MATH-500 prompts (different lengths) generated with rounds that score only the
rows that are due, and with rounds that score the whole batch each time one row is due (the former rule).

Prompts of different lengths make the rows reach the trigger at different steps, so the former rule scored
the batch up to once per row per round. Both settings must emit the same tokens; the script prints the wall
time and the cache's scoring seconds of each, run one after the other in one process.

    python scripts/measure_batched_rounds.py [--model qwen2.5-coder-0.5b] [--rows 16] [--budget 128]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import trikv
from trikv.benchmarks.quality.math_task import load_problems
from trikv.policies import REGISTRY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--methods", default="triattention,triattention-dedup,rkv")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    model, tokenizer = trikv.load_model(args.model, dtype=getattr(torch, args.dtype))
    stats = trikv.load_stats(args.model, model)
    prompts = [problem["prompt"] for problem in load_problems("math500", args.rows)]
    # warm-up: the first generation of a process pays one-off allocations and kernel selection
    trikv.generate(model, tokenizer, prompts, method="full", max_new_tokens=16, do_sample=False, engine="lean")
    results = []
    for method in args.methods.split(","):
        runs = {}
        for due_rows_only in (True, False):
            cache = trikv.make_cache(model, method, budget=args.budget, **({"stats": stats} if REGISTRY[method].needs_stats else {}))
            cache.policy.scores_rows_independently = due_rows_only  # False: the former whole-batch rule
            started = time.perf_counter()
            result = trikv.generate(model, tokenizer, prompts, cache=cache, max_new_tokens=args.new_tokens,
                                    min_new_tokens=args.new_tokens, do_sample=False, chat=True, engine="lean")
            runs[due_rows_only] = {"seconds": time.perf_counter() - started, "scoring_seconds": cache.scoring_seconds,
                                   "rounds": cache.rounds, "tokens": result.tokens}
        same = runs[True]["tokens"] == runs[False]["tokens"]
        row = {"method": method, "same_tokens": same, "rounds_due_rows": runs[True]["rounds"],
               "rounds_whole_batch": runs[False]["rounds"]}
        for key, label in ((True, "due_rows"), (False, "whole_batch")):
            row[f"seconds_{label}"] = round(runs[key]["seconds"], 1)
            row[f"scoring_seconds_{label}"] = round(runs[key]["scoring_seconds"], 1)
        row["speedup"] = round(runs[False]["seconds"] / runs[True]["seconds"], 2)
        results.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"command": "python scripts/measure_batched_rounds.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("TRIKV_THREADS", "2")))
    main()
