"""TOVA, Token Omission Via Attention (Oren et al. 2024): keep what the current query attends to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_scores import QueryAttentionPolicy, window_probabilities
from .base import ScoringContext


@dataclass
class TOVA(QueryAttentionPolicy):
    """Keep the entries with the highest attention from the newest query, averaged over all heads of a layer.

    Rule: a_j = mean over the Hq query heads of the layer of softmax(q_t·k_j / sqrt(d)) for the last token
    t; one selection per layer, shared by its KV heads (the official code's layer-wise rule; it is
    GQA-agnostic and needs no repeat_kv). No window, no sinks: only the budget.
    Defaults: the shared trigger (a round every `divide_length` tokens scores with the newest query);
    `schedule="paper"` evicts at every decode step (one-in/one-out, TOVA's own schedule; every round
    re-gathers the cache). Source: schwartz-lab-NLP/TOVA `tova_cache.py`
    Cost per round: one q·Kᵀ row per query head for all layers, a mean and a top-k; per step: recording
    the newest query (one per layer).
    """

    name = "tova"
    rule = "attention of the newest query averaged over all heads of the layer (layer-wise top-B)"
    paper = 'Oren et al., Transformers are Multi-State RNNs (arXiv 2401.06104)'
    scores_rows_independently = True
    schedule: str = "shared"

    query_window = 1

    def configure(self, budget: int | None, divide_length: int) -> int:
        return self._scheduled(divide_length, 1)

    def importance(self, context: ScoringContext) -> torch.Tensor:
        self._require_queries(context)
        L, b, Hkv, N = context.positions.shape
        newest = context.query_positions.argmax(-1)  # [b] slot of the newest query
        slot = newest[None, :, None, None, None].expand(L, b, context.queries.shape[2], 1, context.queries.shape[-1])
        queries = context.queries.gather(3, slot)  # [L, b, Hq, 1, D]
        query_positions = context.query_positions.gather(1, newest[:, None])  # [b, 1]
        scores = torch.zeros(L, b, N, dtype=torch.float32, device=context.positions.device)
        for layers, probs in window_probabilities(queries, query_positions, context.keys, context.positions, self.scaling, group="none",
                                                     sinks=self.sinks):
            scores[layers] = probs[:, :, :, :, 0].mean(dim=(2, 3))  # over all Hq heads of the layer
        return scores[:, :, None, :].expand(L, b, Hkv, N)
