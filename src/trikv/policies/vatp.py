"""VATP, Value-Aware Token Pruning (Guo et al. 2024): H2O's accumulated attention times the value norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ScoringContext
from .h2o import H2O


@dataclass
class VATP(H2O):
    """Keep the entries with the largest ||v_j||_1 x accumulated attention, the first sinks and the newest.

    Rule: I_j = ||v_j||_1 · sum_t a_{t,j} (the H2O accumulator, GQA: the group's probabilities summed per
    KV head; the value norm is per KV head); the first `sink_tokens` tokens are always kept (their values
    are tiny, so the product would evict them); heavy + recent eviction as H2O.
    Defaults: sink_tokens = 20 (the repo's `--sink_len 20`), heavy = recent = half the budget (the repo
    sets recent_ratio = heavy_ratio), the shared trigger; `schedule="paper"` evicts every step.
    Source: guozhiyu/vatp `utils_hh/modify_llama.py`
    Cost: H2O's, plus an O(N·D) value norm per round.
    """

    name = "vatp"
    rule = "value L1 norm x accumulated attention (H2O) + 20 sink tokens + recent window"
    paper = 'Guo, Kamigaito, Watanabe, Attention Score is not All You Need for Token Importance Indicator in KV Cache Reduction: Value Also Matters, EMNLP 2024'
    sink_tokens: int = 20

    def importance(self, context: ScoringContext) -> torch.Tensor:
        accumulated = super().importance(context)
        value_norm = torch.linalg.vector_norm(context.values, ord=1, dim=-1, dtype=torch.float32)
        scores = accumulated * value_norm
        sinks = (context.positions >= 0) & (context.positions < self.sink_tokens)
        return scores.masked_fill(sinks, float("inf"))
