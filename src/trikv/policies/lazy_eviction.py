"""LazyEviction (Zhang et al. 2025): keep tokens whose attention recurs, judged by their recurrence interval."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_scores import SlotState, SlotStatePolicy, window_probabilities
from .base import ObservationContext, ScoringContext


def recurrence_importance(t: torch.Tensor, last: torch.Tensor, interval: torch.Tensor) -> torch.Tensor:
    """I = 2σ(−(1 + (t − last)/(MRI + 1e−5))) + [MRI > 0]·2σ(−(MRI − 1)), with 2σ(−x) = 2/(1 + eˣ)."""
    since = (t - last) / (interval + 1e-5)
    recency = 2.0 * torch.sigmoid(-(1.0 + since))
    bonus = torch.where(interval > 0, 2.0 * torch.sigmoid(-(interval - 1.0)), torch.zeros_like(interval))
    return recency + bonus


@dataclass
class LazyEviction(SlotStatePolicy):
    """Keep tokens that keep coming back: recently re-attended relative to their own recurrence interval.

    Rule: every decode step t, a cached token j is "hit" when its attention a_{t,j} >= alpha; a hit sets
    MRI_j = max(MRI_j, t − last_j) (Maximum Recurrence Interval) and last_j = t. A new token starts with
    last = its position − 1, MRI = 0. At a round, I_j = 2σ(−(1 + (t − last_j)/(MRI_j + 1e−5))) +
    [MRI_j > 0]·2σ(−(MRI_j − 1)); keep the top (B − W) by I plus the last W tokens.
    GQA: a token is hit for a KV head when any of its G query heads gives it >= alpha (the official code
    repeats KV to the query heads, which multiplies memory by G; this rule needs no copy).
    Defaults: alpha = 1e-4, W = 128 (the official argparse default; its scripts use 101 / 175 / 363 for
    GSM8K / MATH / AIME), the shared trigger. `schedule="paper"` evicts every W steps (cache C + W).
    The prompt's statistics start at the first decode step (the official code does not track prefill).
    Source: WeianMao/triattention@e7a0eb1 `LazyEviction/model/kv_utils.py`
    Cost: per step one attention row per query head for all layers and two O(L·Hkv·N) updates; per round
    an O(N) score and a top-k. Memory: two fp32 numbers per cached entry.
    """

    name = "lazyeviction"
    rule = "recurrence score from last hit and max recurrence interval (alpha 1e-4) + last W=128 tokens"
    paper = 'Zhang et al., LazyEviction (arXiv 2506.15969)'
    alpha: float = 1e-4
    window: int = 128
    schedule: str = "shared"

    query_window = 1
    observes = True

    def __post_init__(self):
        self.state = SlotState()

    @property
    def recent_window(self) -> int:
        return self.window

    def configure(self, budget: int | None, divide_length: int) -> int:
        return self._scheduled(divide_length, self.window)

    def _cover(self, positions: torch.Tensor) -> None:
        self.state.cover(
            positions,
            {
                "last": lambda p: p.float() - 1.0,
                "interval": lambda p: torch.zeros(p.shape, dtype=torch.float32, device=p.device),
            },
        )

    def observe(self, context: ObservationContext) -> None:
        self._cover(context.positions)
        last = self.state["last"][context.layers]
        interval = self.state["interval"][context.layers]
        key_positions = context.positions[context.layers]
        for i in range(context.queries.shape[3]):  # one query per decode step (prefill is not observed)
            query_positions = context.query_positions[:, i : i + 1]
            t = query_positions.float()[None, :, None, :]  # [1, b, 1, 1]
            for layers, probs in window_probabilities(
                context.queries[:, :, :, i : i + 1], query_positions, context.keys, key_positions, self.scaling, group="none",
                sinks=None if self.sinks is None else self.sinks[context.layers],
            ):
                hit = probs[:, :, :, :, 0].amax(3) >= self.alpha  # [l, b, Hkv, N]
                gap = t - last[layers]
                interval[layers] = torch.where(hit, torch.maximum(interval[layers], gap), interval[layers])
                last[layers] = torch.where(hit, t.expand_as(gap), last[layers])

    def importance(self, context: ScoringContext) -> torch.Tensor:
        self._cover(context.positions)
        t = (context.current_position - 1).float()[None, :, None, None]
        return recurrence_importance(t, self.state["last"], self.state["interval"])
