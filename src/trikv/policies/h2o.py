"""H2O, Heavy-Hitter Oracle (Zhang et al. 2023): accumulated attention plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_scores import SlotState, SlotStatePolicy, query_chunks, window_probabilities
from .base import ObservationContext, ScoringContext


@dataclass
class H2O(SlotStatePolicy):
    """Keep the keys with the largest attention accumulated over every query so far, plus the newest tokens.

    Rule: A_j = sum over every query t that attended key j (all prompt queries, then one per decode step)
    of a_{t,j}; the G query heads of a KV head add their probabilities (GQA without repeat_kv; the
    official code repeats KV and selects per query head, which costs G times the memory). Keep the top
    entries by A_j among the non-recent ones plus the `recent` newest tokens. Scores of evicted tokens are
    dropped; a new token starts with the attention it gets from its own query.
    Defaults: heavy = recent = half of the budget (the official scripts use heavy_ratio = recent_ratio);
    the shared trigger (a round every `divide_length` tokens). `schedule="paper"` evicts every decode
    step instead (the official one-in/one-out cache; each round then re-gathers the cache).
    Source: FMInference/H2O `H2OKVCache_LayerWise`
    Cost: per decode step one q·Kᵀ row per query head for all layers at once ([L, b, Hkv, G, N]) and an
    O(L·Hkv·N) accumulate; the prompt is accumulated once at prefill, in query chunks; per round a top-k.
    Memory: one fp32 accumulator per cached entry, and the last query per layer.
    """

    name = "h2o"
    rule = "accumulated attention of all past queries (heavy hitters) + recent window (half the budget each)"
    paper = 'Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models, NeurIPS 2023 (arXiv 2306.14048)'
    recent_ratio: float = 0.5
    recent_tokens: int | None = None  # overrides recent_ratio when given
    schedule: str = "shared"

    query_window = 1
    observes = True
    observe_prefill = True

    def __post_init__(self):
        if not 0.0 <= self.recent_ratio < 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1), got {self.recent_ratio}")
        self._recent = 0
        self.state = SlotState()

    @property
    def recent_window(self) -> int:
        return self._recent

    def configure(self, budget: int | None, divide_length: int) -> int:
        if budget is None:
            self._recent = 0
        else:
            self._recent = self.recent_tokens if self.recent_tokens is not None else int(self.recent_ratio * budget)
        return self._scheduled(divide_length, 1)

    def _cover(self, positions: torch.Tensor) -> None:
        self.state.cover(positions, {"attention": lambda p: torch.zeros(p.shape, dtype=torch.float32, device=p.device)})

    def observe(self, context: ObservationContext) -> None:
        self._cover(context.positions)
        accumulated = self.state["attention"][context.layers]  # view
        key_positions = context.positions[context.layers]
        b, Hq, n = context.queries.shape[1], context.queries.shape[2], context.queries.shape[3]
        N = context.keys.shape[3]
        for part in query_chunks(n, context.queries.shape[0] * b * Hq * N):
            queries = context.queries[:, :, :, part]
            for layers, probs in window_probabilities(
                queries, context.query_positions[:, part], context.keys, key_positions, self.scaling, group="sum",
                sinks=None if self.sinks is None else self.sinks[context.layers],
            ):
                accumulated[layers] += probs.sum(3)

    def importance(self, context: ScoringContext) -> torch.Tensor:
        self._cover(context.positions)
        return self.state["attention"].clone()
