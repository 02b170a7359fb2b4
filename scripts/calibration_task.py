"""The teacher-forced fidelity task that the tuning scripts choose defaults on.

It reads the bundled model's own calibration text (the MATH-500 traces its statistics come from), which no
benchmark evaluates, so a default tuned on it is not tuned on the evaluation.
"""

from __future__ import annotations

from pathlib import Path

import torch

import trikv
from trikv.benchmarks.quality.fidelity import FidelityTask

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "src/trikv/data/calibration/smollm2-135m-math500-traces.txt"


def calibration_task(tokens: int, prompt: int):
    """(model, stats, ids [1, tokens], task with its full-attention reference already run)."""
    torch.manual_seed(0)
    model, tokenizer = trikv.load_model("smollm2-135m")
    stats = trikv.load_stats("smollm2-135m", model)
    ids = tokenizer(TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, :tokens]
    task = FidelityTask(model, ids, prompt_length=prompt, max_chunk=128, recall_stride=8)
    task.run_reference(recall=False)
    return model, stats, ids, task
