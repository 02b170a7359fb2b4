"""The teacher-forced fidelity task that the tuning scripts choose defaults on.

It reads a model's own calibration text (the MATH-500 traces its shipped statistics come from, sampled on rows
that every benchmark excludes), so a default tuned on it is not tuned on the evaluation.
"""

from __future__ import annotations

from pathlib import Path

import torch

import trikv
from trikv.benchmarks.quality.fidelity import FidelityTask
from trikv.policies import REGISTRY

ROOT = Path(__file__).resolve().parents[1]


def calibration_text(model_name: str) -> Path:
    return ROOT / f"src/trikv/data/calibration/{model_name}-math500-traces.txt"


TEXT = calibration_text("smollm2-135m")


def calibration_task(tokens: int, prompt: int, model_name: str = "smollm2-135m"):
    """(model, stats, ids [1, tokens], task with its full-attention reference already run), float32."""
    torch.manual_seed(0)
    model, tokenizer = trikv.load_model(model_name)
    stats = trikv.load_stats(model_name, model)
    text = calibration_text(model_name).read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    task = FidelityTask(model, ids, prompt_length=prompt, max_chunk=128, recall_stride=8)
    task.run_reference(recall=False)
    return model, stats, ids, task


def measure_kl(model, stats, task, method: str, budgets: list[int], divide_length: int, **options) -> dict:
    """Teacher-forced KL(full || method) and top-1 agreement at each budget, and the KL averaged over budgets."""
    rows = {}
    for budget in budgets:
        extra = {"stats": stats} if REGISTRY[method].needs_stats else {}
        cache = trikv.make_cache(model, method, budget=budget, divide_length=divide_length, **extra, **options)
        metrics, _ = task.run_method(cache)
        rows[str(budget)] = {"kl": metrics["kl"], "top1_agreement": metrics["top1_agreement"]}
    return {"by_budget": rows, "mean_kl": sum(row["kl"] for row in rows.values()) / len(rows)}


def sweep_option(measure, method: str, option: str, weights: str) -> tuple[list[dict], dict]:
    """measure(method, **{option: w}) for each comma-separated weight; (the sweep, the entry of lowest mean KL)."""
    sweep = []
    for weight in [float(w) for w in weights.split(",")]:
        result = measure(method, **{option: weight})
        sweep.append({option: weight, **result})
        print(f"{option} {weight:g}: mean KL {result['mean_kl']:.4f}", flush=True)
    best = min(sweep, key=lambda row: row["mean_kl"])
    return sweep, {option: best[option], "mean_kl": best["mean_kl"]}
