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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[L, b, Hkv, N]: pooled mean attention of the window queries on each key (SnapKV / R-KV importance).

    softmax_scope "non_window": each query's softmax runs over the keys older than the window (R-KV and
    TriAttention's port: softmax(attn[..., -w:, :-w])); "all": over every key it can see (official SnapKV,
    causal inside the window). Either way the window keys' own columns are dropped before pooling (they
    are kept anyway), so they never leak into the scores of the kernel // 2 tokens before the window.
    """
    if group_aggregation not in GROUP_RULES:
        raise ValueError(f"group_aggregation must be one of {sorted(GROUP_RULES)}, got {group_aggregation!r}")
    if softmax_scope not in ("non_window", "all"):
        raise ValueError(f"softmax_scope must be 'non_window' or 'all', got {softmax_scope!r}")
    positions = context.positions
    key_mask = positions >= 0
    window_start = context.current_position - window  # [b]
    before_window = positions < window_start[None, :, None, None]
    if softmax_scope == "non_window":
        key_mask = key_mask & before_window
    queries_seen = (context.query_positions >= 0).sum(-1).clamp_min(1).float()  # [b]
    importance = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
    for layers, probs in window_probabilities(
        context.queries, context.query_positions, context.keys, positions, scaling, key_mask, GROUP_RULES[group_aggregation],
        sinks=sinks,
    ):
        importance[layers] = probs.sum(3) / queries_seen[None, :, None, None]  # mean over the window queries
    # pooling runs over the non-window keys only (the window's columns act as the zero padding at the end)
    pooled_positions = positions.masked_fill(~before_window, -1)
    return pool1d(importance.masked_fill(~before_window, 0.0), kernel_size, pooling, pooled_positions)


@dataclass
class SnapKV(ObservationWindowPolicy):
    """SnapKV as its authors (and kvpress) implement it, re-applied on the shared trigger.

    Rule: the last `window_size` queries attend over every key they can see (causal inside the window); the
    window's own columns are dropped; each key's score is its attention summed over the window queries,
    averaged over the G query heads of its KV head (kvpress' GQA rule), smoothed by average pooling
    (kernel 5, zero padding); keep the top (B - w) per (layer, KV head) plus the w window tokens.
    Defaults: the official repository's w = 32, kernel 5, average pooling. `snapkv-decode` is the
    decode-time port that the R-KV and TriAttention papers report as "SnapKV" (w = 8, kernel 7, max pooling,
    max over the group's logits, softmax over the non-window keys only).
    Source: FasterDecoding/SnapKV `snapkv_utils.py`; NVIDIA/kvpress `snapkv_press.py`; Zefan-Cai/R-KV `snapkv.py`.
    Cost per round: O(Hq·w·N·D) logits for all layers (chunked), pooling, a top-k; nothing per step
    except recording the query of each token (ring of w queries per layer).
    """

    name = "snapkv"
    rule = "official SnapKV: pooled (avg, k=5) attention of the last 32 queries, group mean, + the window"
    paper = 'Li et al., SnapKV: LLM Knows What You are Looking for Before Generation, NeurIPS 2024 (arXiv 2404.14469)'
    window_size: int = 32
    kernel_size: int = 5
    pooling: str = "avg"
    group_aggregation: str = "mean_prob"
    softmax_scope: str = "all"

    def importance(self, context: ScoringContext) -> torch.Tensor:
        self._require_queries(context)
        return window_importance(
            context, self.scaling, self.window_size, self.kernel_size, self.pooling, self.group_aggregation, self.softmax_scope,
            sinks=self.sinks,
        )


# the decode-time port of SnapKV in R-KV's and TriAttention's code (their "SnapKV" baseline)
DECODE_PORT = dict(window_size=8, kernel_size=7, pooling="max", group_aggregation="max_logit", softmax_scope="non_window")
