"""StreamingLLM (Xiao et al. 2023): attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, ScoringContext


@dataclass
class StreamingLLM(Policy):
    """Keep the first `sinks` tokens of each row and the most recent ones.

    Rule: score = position, sinks = +inf, so the top-B are the sinks plus the B - sinks newest tokens.
    Defaults: 4 sinks (the paper's). Cost: O(N) per round, no attention needed. Keys keep their original
    rotation (no position shifting), as in decode-time ports (R-KV's, kvpress').
    """

    name = "streaming"
    rule = "keep 4 attention-sink tokens + the most recent tokens"
    paper = 'Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024 (arXiv 2309.17453)'
    scores_rows_independently = True
    scores_layers_independently = True
    scores_heads_independently = True
    sinks: int = 4

    def score(self, context: ScoringContext) -> torch.Tensor:
        positions = context.positions.float()
        return torch.where(context.positions < self.sinks, torch.full_like(positions, float("inf")), positions)
