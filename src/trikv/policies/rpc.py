"""RPC, Reasoning Path Compression (Song et al. 2025): periodic selection by a window of recent queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_scores import QueryAttentionPolicy, pool1d, window_probabilities
from .base import ScoringContext


@dataclass
class RPC(QueryAttentionPolicy):
    """Keep the reasoning tokens the last R queries attend to most, smoothed; the prompt and R newest stay.

    Rule: over the competing region (everything but the protected prompt and the R selector tokens), each
    of the R selector queries' softmax runs over the region only; sum over the R queries; average over all
    Hq heads of the layer (`aggregation="all"`, one selection per layer) or over the G heads of each KV
    head ("group"); average-pool with kernel 7; keep the top entries, sorted by position.
    Defaults: R = 32, kernel 7, avg pooling, aggregation "all" (RPC's `set_rpc_config`). RPC compresses
    every P = 1024 generated tokens to a ratio (P/c kept per interval, c = 4), so its cache grows; here it
    keeps the shared fixed budget (for comparisons at a fixed budget) on the shared
    trigger; `schedule="paper"` runs a round every `interval` = P tokens (cache between B and B + P).
    Source: jiwonsong-dev/ReasoningPathCompression `rpc/rpc_utils.py`
    Cost per round: O(Hq·R·N·D) for all layers (chunked), pooling, a top-k; per step: recording the query.
    """

    name = "rpc"
    rule = "summed attention of the last 32 queries over the reasoning region, all-head mean, avg-pool 7"
    paper = 'Song et al., Reasoning Path Compression, NeurIPS 2025 (arXiv 2505.13866)'
    selector_window: int = 32
    kernel_size: int = 7
    pooling: str = "avg"
    aggregation: str = "all"
    interval: int = 1024
    schedule: str = "shared"

    def __post_init__(self):
        if self.aggregation not in ("all", "group"):
            raise ValueError(f"aggregation must be 'all' or 'group', got {self.aggregation!r}")
        if self.selector_window < 1:
            raise ValueError(f"selector_window must be >= 1, got {self.selector_window}")

    @property
    def query_window(self) -> int:
        return self.selector_window

    @property
    def recent_window(self) -> int:
        return self.selector_window

    def configure(self, budget: int | None, divide_length: int) -> int:
        return self._scheduled(divide_length, self.interval)

    def importance(self, context: ScoringContext) -> torch.Tensor:
        self._require_queries(context)
        L, b, Hkv, N = context.positions.shape
        region = context.candidates
        scores = torch.zeros(L, b, Hkv, N, dtype=torch.float32, device=context.positions.device)
        for layers, probs in window_probabilities(
            context.queries, context.query_positions, context.keys, context.positions, self.scaling, region, group="none",
            sinks=self.sinks,
        ):
            summed = probs.sum(4)  # over the R selector queries: [l, b, Hkv, G, N]
            if self.aggregation == "all":
                scores[layers] = summed.mean(dim=(2, 3))[:, :, None, :]
            else:
                scores[layers] = summed.mean(3)
        return pool1d(scores, self.kernel_size, self.pooling, context.positions)
