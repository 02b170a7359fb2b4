"""Calibration statistics for tiny test models (random tokens, a few hundred of them)."""

from __future__ import annotations

import torch

from trikv.calibration import calibrate

_CACHE: dict = {}


def tiny_stats(model, tokens: int = 256):
    key = id(model)
    if key not in _CACHE:
        generator = torch.Generator().manual_seed(7)
        ids = torch.randint(1, model.config.vocab_size, (tokens,), generator=generator)
        _CACHE[key] = (model, calibrate(model, ids, source="random tokens (test)", chunk_tokens=128, progress=False))
    return _CACHE[key][1]
