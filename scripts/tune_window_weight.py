"""Choose triattention-window's blend weight on calibration text only.

`triattention-window` blends TriAttention's z-scored score with the z-scored log attention of the last 32
queries. Its weight is chosen here by teacher-forced KL(full || compressed), averaged over budgets, on the
bundled model's own calibration text (the MATH-500 traces its statistics come from), which no benchmark
evaluates. Writes the sweep to runs/tuning/ (--ship: src/trikv/data/calibration/triattention-window-weight.json;
the default in policies/tri_window.py cites it).

    python scripts/tune_window_weight.py [--tokens 2048] [--budgets 64,128,256]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from calibration_task import ROOT, TEXT, calibration_task, measure_kl, sweep_option


SHIPPED = ROOT / "src/trikv/data/calibration/triattention-window-weight.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--budgets", default="64,128,256")
    parser.add_argument("--divide-length", type=int, default=128)
    parser.add_argument("--weights", default="0,0.125,0.25,0.5,0.75,1")
    parser.add_argument("--out", help="where to write the sweep (default runs/tuning/ plus the shipped file's name)")
    parser.add_argument("--ship", action="store_true", help="write the sweep trikv ships (the method's default cites it)")
    args = parser.parse_args()
    if args.ship and args.out:
        parser.error("give either --out or --ship")
    out = SHIPPED if args.ship else Path(args.out or Path("runs") / "tuning" / SHIPPED.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    model, stats, ids, task = calibration_task(args.tokens, args.prompt)
    budgets = [int(b) for b in args.budgets.split(",")]
    started = time.perf_counter()

    def measure(method: str, **options) -> dict:
        return measure_kl(model, stats, task, method, budgets, args.divide_length, **options)

    baseline = measure("triattention")
    sweep, best = sweep_option(measure, "triattention-window", "window_weight", args.weights)
    record = {
        "command": f"python scripts/tune_window_weight.py --tokens {args.tokens} --budgets {args.budgets} "
                   f"--divide-length {args.divide_length} --weights {args.weights}",
        "text": f"{TEXT.name}, first {ids.shape[1]} tokens (prompt {args.prompt}); the bundled statistics' calibration text",
        "budgets": budgets, "divide_length": args.divide_length,
        "triattention": baseline, "sweep": sweep, "best": best,
        "seconds": time.perf_counter() - started,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["best"]))


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("TRIKV_THREADS", "1")))
    main()
