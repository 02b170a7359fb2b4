"""Power of a pre-registered paired accuracy test, computed before the run.

A problem's paired outcome is +1 (only the candidate solves it), -1 (only the baseline does) or 0; the discordant
share (problems where the two differ) comes from an earlier run. For each true difference delta, simulated runs of
`n` problems are read exactly as the registration reads the real one: the paired 95% percentile bootstrap
interval over problems (`trikv.benchmarks.quality.intervals`, 2,000 resamples) -> superior (lower bound > 0),
non-inferior (lower bound > -margin) or inconclusive.

    python scripts/preregistration_power.py --n 130 --discordant 0.19 --margin 0.03
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from trikv.benchmarks.quality.intervals import RESAMPLES, percentile_interval, resample_weights


def reading(differences: np.ndarray, weights: np.ndarray, margin: float) -> str:
    low = percentile_interval(weights @ differences / len(differences))[0]
    return "superior" if low > 0 else "non-inferior" if low > -margin else "inconclusive"


def power(n: int, discordant: float, delta: float, margin: float, runs: int, seed: int = 1) -> dict[str, float]:
    if abs(delta) > discordant:
        raise ValueError(f"a difference of {delta} needs at least that share of discordant problems ({discordant})")
    rng = np.random.default_rng(seed)
    weights = resample_weights(n, RESAMPLES, seed=0)  # the registered resamples
    plus, minus = (discordant + delta) / 2, (discordant - delta) / 2
    counts = {"superior": 0, "non-inferior": 0, "inconclusive": 0}
    for _ in range(runs):
        draw = rng.random(n)
        differences = np.where(draw < plus, 1.0, np.where(draw < plus + minus, -1.0, 0.0))
        counts[reading(differences, weights, margin)] += 1
    return {name: count / runs for name, count in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, required=True, help="problems in the registered run")
    parser.add_argument("--discordant", type=float, required=True, help="share of problems the two methods answer differently")
    parser.add_argument("--margin", type=float, default=0.03, help="non-inferiority margin (accuracy, 0.03 = 3 points)")
    parser.add_argument("--deltas", default="-0.05,0,0.03,0.05,0.10", help="true differences to evaluate")
    parser.add_argument("--runs", type=int, default=1000, help="simulated runs per difference")
    args = parser.parse_args()
    half_width = 1.96 * np.sqrt(args.discordant / args.n)
    print(json.dumps({"n": args.n, "discordant": args.discordant, "margin": args.margin,
                      "approximate_interval_half_width": round(float(half_width), 4),
                      "readings_by_true_difference": {d: power(args.n, args.discordant, float(d), args.margin, args.runs)
                                                      for d in args.deltas.split(",")}}, indent=2))


if __name__ == "__main__":
    main()
