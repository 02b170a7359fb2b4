"""SnapKV (Li et al. 2024), decode-time port: pooled attention of an observation window of recent queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_scores import ObservationWindowPolicy, pool1d, window_probabilities
from .base import ScoringContext

GROUP_RULES = {"max_logit": "max_logit", "mean_prob": "mean"}


def window_importance(
    context: ScoringContext,
    scaling: float,
    window: int,
    kernel_size: int,
    pooling: str,
    group_aggregation: str,
    softmax_scope: str,
) -> torch.Tensor:
    """[L, b, Hkv, N]: pooled mean attention of the window queries on each key (SnapKV / R-KV importance).

    softmax_scope "non_window": each query's softmax runs over the keys older than the window (R-KV and
    TriAttention's port: softmax(attn[..., -w:, :-w])); "all": over every key it can see (official SnapKV,
    causal inside the window).
    """
    if group_aggregation not in GROUP_RULES:
        raise ValueError(f"group_aggregation must be one of {sorted(GROUP_RULES)}, got {group_aggregation!r}")
    if softmax_scope not in ("non_window", "all"):
        raise ValueError(f"softmax_scope must be 'non_window' or 'all', got {softmax_scope!r}")
    positions = context.positions
    key_mask = positions >= 0
    if softmax_scope == "non_window":
        window_start = context.current_position - window  # [b]
        key_mask = key_mask & (positions < window_start[None, :, None, None])
    queries_seen = (context.query_positions >= 0).sum(-1).clamp_min(1).float()  # [b]
    importance = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
    for layers, probs in window_probabilities(
        context.queries, context.query_positions, context.keys, positions, scaling, key_mask, GROUP_RULES[group_aggregation]
    ):
        importance[layers] = probs.sum(3) / queries_seen[None, :, None, None]  # mean over the window queries
    return pool1d(importance, kernel_size, pooling, positions)


@dataclass
class SnapKV(ObservationWindowPolicy):
    """Keep the keys the last `window_size` queries attend to most (smoothed over neighbours) + the window.

    Rule: score_j = pool_k( mean over the w window queries of a_{t,j} ); keep the top (B - w) plus the w
    window tokens. GQA: `max_logit` (max over the G query heads of the logits, then one softmax), as R-KV
    and TriAttention's decode port; `mean_prob` averages the group's probabilities (kvpress).
    Defaults: the decode-time port that R-KV and TriAttention report as SnapKV: w = 8, kernel 7, max
    pooling, max_logit, softmax over the non-window keys, re-applied every `divide_length` (128) tokens.
    The official prefill SnapKV uses w = 32 and a causal softmax over all keys (`softmax_scope="all"`).
    Source: FasterDecoding/SnapKV; Zefan-Cai/R-KV `snapkv.py`; reference/baselines.md section 2.3.
    Cost per round: O(Hq·w·N·D) logits for all layers (chunked), pooling, a top-k; nothing per step
    except recording the query of each token (ring of w queries per layer).
    """

    name = "snapkv"
    rule = "pooled attention of the last 8 queries (observation window) + the window tokens"
    kernel_size: int = 7
    pooling: str = "max"
    group_aggregation: str = "max_logit"
    softmax_scope: str = "non_window"

    def importance(self, context: ScoringContext) -> torch.Tensor:
        self._require_queries(context)
        return window_importance(
            context, self.scaling, self.window_size, self.kernel_size, self.pooling, self.group_aggregation, self.softmax_scope
        )
