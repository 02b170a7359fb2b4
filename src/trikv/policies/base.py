"""What every eviction policy sees and returns.

A policy scores the cached entries of all layers at once; the cache then keeps the top `budget` entries
per (layer, row, KV head), after forcing padding out and protected entries (prompt, recent window) in.
Higher score = more worth keeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..architectures import ModelShape


@dataclass
class ScoringContext:
    keys: torch.Tensor  # [L, b, Hkv, N, D] post-RoPE, as attention sees them
    values: torch.Tensor  # [L, b, Hkv, N, D]
    positions: torch.Tensor  # [L, b, Hkv, N] long: RoPE position of each entry, -1 for padding
    candidates: torch.Tensor  # [L, b, Hkv, N] bool: entries that compete (not padding, not protected)
    current_position: torch.Tensor  # [b] long: tokens seen so far by each row (= next RoPE position)
    budget: int


class Policy:
    """Base class. Subclasses set `name`, `rule` and implement `score`."""

    name: ClassVar[str] = "base"
    rule: ClassVar[str] = ""
    evicts: ClassVar[bool] = True
    recent_window: int = 0  # most recent tokens that are never evicted

    def bind(self, model: torch.nn.Module, shape: ModelShape) -> None:
        """Called once by the cache; validate against the model and precompute what scoring needs."""

    def score(self, context: ScoringContext) -> torch.Tensor:
        """Return scores [L, b, Hkv, N]; only candidate entries matter."""
        raise NotImplementedError
