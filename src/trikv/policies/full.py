"""Full attention: nothing is ever evicted (the reference every method is compared with)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Policy, ScoringContext


@dataclass
class FullAttention(Policy):
    """Keep every token. The cache grows like transformers' DynamicCache; `budget` is ignored."""

    name = "full"
    rule = "keep everything (no eviction)"
    evicts = False

    def score(self, context: ScoringContext):
        raise RuntimeError("full attention never scores")
