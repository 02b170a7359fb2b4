"""Choose triattention-dedup's redundancy weight on calibration text only.

`triattention-dedup` subtracts a z-scored key-redundancy term from TriAttention's z-scored score (with the 32
newest tokens kept). Its weight is chosen here by teacher-forced KL(full || compressed), averaged over budgets,
on a model's own calibration text: the reasoning it sampled on the MATH-500 rows reserved for calibration,
which every benchmark excludes. Weight 0 is `triattention-recent`. Writes the sweep to runs/tuning/ (--ship:
src/trikv/data/calibration/triattention-dedup-weight.json; the default in policies/tri_dedup.py cites it).

    python scripts/tune_dedup_weight.py [--model qwen2.5-coder-1.5b] [--tokens 2048] [--budgets 128,256]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from calibration_task import ROOT, calibration_task, calibration_text, measure_kl, sweep_option


SHIPPED = ROOT / "src/trikv/data/calibration/triattention-dedup-weight.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--budgets", default="128,256")
    parser.add_argument("--divide-length", type=int, default=128)
    parser.add_argument("--weights", default="0,0.25,0.5,1,2")
    parser.add_argument("--out", help="where to write the sweep (default runs/tuning/ plus the shipped file's name)")
    parser.add_argument("--ship", action="store_true", help="write the sweep trikv ships (the method's default cites it)")
    args = parser.parse_args()
    if args.ship and args.out:
        parser.error("give either --out or --ship")
    out = SHIPPED if args.ship else Path(args.out or Path("runs") / "tuning" / SHIPPED.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    model, stats, ids, task = calibration_task(args.tokens, args.prompt, args.model)
    budgets = [int(b) for b in args.budgets.split(",")]
    started = time.perf_counter()

    def measure(method: str, **options) -> dict:
        return measure_kl(model, stats, task, method, budgets, args.divide_length, **options)

    references = {}
    for name in ("triattention", "rkv"):
        references[name] = measure(name)
        print(f"{name}: mean KL {references[name]['mean_kl']:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
    sweep, best = sweep_option(measure, "triattention-dedup", "redundancy_weight", args.weights)
    record = {
        "command": f"python scripts/tune_dedup_weight.py --model {args.model} --tokens {args.tokens} "
                   f"--budgets {args.budgets} --divide-length {args.divide_length} --weights {args.weights}",
        "text": f"{calibration_text(args.model).name}, first {ids.shape[1]} tokens (prompt {args.prompt}); "
                f"the shipped {args.model} statistics' calibration text",
        "budgets": budgets, "divide_length": args.divide_length, "dtype": "float32",
        **references, "sweep": sweep,
        "best": best,
        "seconds": time.perf_counter() - started,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["best"]))


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("TRIKV_THREADS", "1")))
    main()
