"""Choose the TriAttention + attention-matching hybrid's ridge coefficients on calibration text only.

The hybrid (`tri-am`) fits biases and values against queries drawn from the calibration statistics; its two
ridge coefficients are chosen here by teacher-forced KL(full || compressed) on the bundled model's own
calibration text (the MATH-500 traces its statistics come from), which no benchmark evaluates. Writes the
sweep to runs/tuning/ (--ship: src/trikv/data/calibration/tri-am-ridge.json; the defaults in policies/hybrid.py cite it).

    python scripts/tune_hybrid_ridge.py [--tokens 1024] [--budget 128]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from calibration_task import ROOT, TEXT, calibration_task

import trikv

SHIPPED = ROOT / "src/trikv/data/calibration/tri-am-ridge.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--divide-length", type=int, default=64)
    parser.add_argument("--ridges", default="0.001,0.01,0.1,1.0")
    parser.add_argument("--out", help="where to write the sweep (default runs/tuning/ plus the shipped file's name)")
    parser.add_argument("--ship", action="store_true", help="write the sweep trikv ships (the method's default cites it)")
    args = parser.parse_args()
    if args.ship and args.out:
        parser.error("give either --out or --ship")
    out = SHIPPED if args.ship else Path(args.out or Path("runs") / "tuning" / SHIPPED.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    model, stats, ids, task = calibration_task(args.tokens, args.prompt)
    common = dict(budget=args.budget, divide_length=args.divide_length, stats=stats)
    started = time.perf_counter()
    baseline, _ = task.run_method(trikv.make_cache(model, "triattention", **common))
    sweep = []
    ridges = [float(r) for r in args.ridges.split(",")]
    for beta_ridge, value_ridge in itertools.product(ridges, ridges):
        metrics, _ = task.run_method(trikv.make_cache(model, "tri-am", beta_ridge=beta_ridge, value_ridge=value_ridge, **common))
        sweep.append({"beta_ridge": beta_ridge, "value_ridge": value_ridge, "kl": metrics["kl"], "top1_agreement": metrics["top1_agreement"]})
        print(f"beta_ridge {beta_ridge:g} value_ridge {value_ridge:g}: KL {metrics['kl']:.4f} top-1 {metrics['top1_agreement']:.4f}", flush=True)
    best = min(sweep, key=lambda row: row["kl"])
    record = {
        "command": f"python scripts/tune_hybrid_ridge.py --tokens {args.tokens} --budget {args.budget} --divide-length {args.divide_length} --ridges {args.ridges}",
        "text": f"{TEXT.name}, first {ids.shape[1]} tokens (prompt {args.prompt}); the bundled statistics' calibration text",
        "budget": args.budget, "divide_length": args.divide_length,
        "triattention": {"kl": baseline["kl"], "top1_agreement": baseline["top1_agreement"]},
        "sweep": sweep, "best": best, "seconds": time.perf_counter() - started,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"best: beta_ridge {best['beta_ridge']:g}, value_ridge {best['value_ridge']:g} (KL {best['kl']:.4f}; "
          f"TriAttention alone {baseline['kl']:.4f}) -> {out}")


if __name__ == "__main__":
    main()
