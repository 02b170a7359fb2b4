"""RaaS, Reasoning-Aware Attention Sparsity (Hu et al. 2025), our re-implementation: LRU timestamps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_scores import SlotState, SlotStatePolicy, window_probabilities
from .base import ObservationContext, ScoringContext


@dataclass
class RaaS(SlotStatePolicy):
    """Keep the prompt and the decode tokens most recently used by attention (least-recently-used eviction).

    Rule: each cached token carries a timestamp, its position when created; whenever a decode query gives
    it attention >= alpha (any of the G query heads of its KV head) the timestamp becomes that step. Evict
    the oldest timestamps, ties broken by older position. The prompt is kept (the cache's prompt protection;
    if the prompt leaves no room it competes like any token, as for every method).
    Defaults: alpha = 1e-4, token granularity, per KV head, the shared trigger; `schedule="paper"` evicts
    at every decode step. The paper's threshold rule, its default and its page size were not found in any
    source: they are trikv's choice, and results must be labelled "RaaS (our
    re-implementation)". The page-based variant is not implemented.
    Source: arXiv 2502.11147 (no public code)
    Cost: per step one attention row per query head for all layers and an O(L·Hkv·N) update; per round two
    sorts over N. Memory: one fp32 timestamp per cached entry.
    """

    name = "raas"
    rule = "LRU: timestamp refreshed when a decode query gives >= 1e-4 attention; prompt kept (re-implementation)"
    paper = 'Hu et al., Efficient Long-Decoding Inference with Reasoning-Aware Attention Sparsity, ACL Findings 2025 (arXiv 2502.11147)'
    alpha: float = 1e-4
    schedule: str = "shared"

    query_window = 1
    observes = True

    def __post_init__(self):
        self.state = SlotState()

    def configure(self, budget: int | None, divide_length: int) -> int:
        return self._scheduled(divide_length, 1)

    def _cover(self, positions: torch.Tensor) -> None:
        self.state.cover(positions, {"stamp": lambda p: p.float()})

    def observe(self, context: ObservationContext) -> None:
        self._cover(context.positions)
        stamp = self.state["stamp"][context.layers]
        key_positions = context.positions[context.layers]
        for i in range(context.queries.shape[3]):
            query_positions = context.query_positions[:, i : i + 1]
            t = query_positions.float()[None, :, None, :]
            for layers, probs in window_probabilities(
                context.queries[:, :, :, i : i + 1], query_positions, context.keys, key_positions, self.scaling, group="none",
                sinks=None if self.sinks is None else self.sinks[context.layers],
            ):
                hit = probs[:, :, :, :, 0].amax(3) >= self.alpha
                stamp[layers] = torch.where(hit, t.expand_as(stamp[layers]), stamp[layers])

    def importance(self, context: ScoringContext) -> torch.Tensor:
        self._cover(context.positions)
        return self.state["stamp"].clone()  # `score` ranks it; equal stamps: the older token goes first
