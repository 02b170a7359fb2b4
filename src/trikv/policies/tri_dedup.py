"""TriAttention minus key redundancy: the statistics' ranking with R-KV's near-duplicate penalty (trikv's own)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import zscore
from .base import ScoringContext
from .rkv import mean_similarity
from .triattention import TriAttention


@dataclass
class TriAttentionDedup(TriAttention):
    """TriAttention's score with a penalty on keys that resemble the other cached keys, and a recent window.

    Why: a small model reasoning at length repeats itself. TriAttention ranks every key on its own, so the
    copies of a repeated line score alike and crowd the budget, while R-KV, which ranks mostly by redundancy,
    keeps one copy and room for everything else; a statistics-based ranking needs the same protection.
    Rule: z_tri = TriAttention's score (z-scored per query head, max over the group, z-scored again over the
    candidates); z_red = the z-score over the candidates of each key's mean cosine similarity to the other
    live keys of its (layer, KV head), the newest near-duplicate (similarity > threshold) of each key
    exempted, as R-KV's redundancy before its softmax (so the newest copy of a group is the one kept);
    score = z_tri - redundancy_weight * z_red; the `recent_window` newest tokens are kept.
    Defaults: redundancy_weight 0.5, similarity_threshold 0.5 (R-KV's), recent_window 32 (as
    `triattention-recent`, which is this rule with redundancy_weight 0); the rest as `triattention`. The weight
    was chosen by scripts/tune_dedup_weight.py (lowest teacher-forced KL at B = 128 and 256 over 0-2) on
    Qwen2.5-Coder-1.5B's own reasoning on the MATH-500 calibration rows, which no benchmark evaluates; the
    sweep is in data/calibration/triattention-dedup-weight.json.
    Cost per round: TriAttention's scoring plus an N x N key similarity per (layer, KV head), O(Hkv·N²·D);
    keys only, so it also runs inside vLLM.
    """

    name = "triattention-dedup"
    rule = "z-scored TriAttention score - 0.5 x z-scored key redundancy (R-KV's mean cosine similarity); + 32 recent"
    paper = "trikv's own variant of TriAttention with R-KV's redundancy term (not in a paper)"
    redundancy_weight: float = 0.5
    similarity_threshold: float = 0.5
    recent_window: int = 32

    def __post_init__(self):
        if self.redundancy_weight < 0.0:
            raise ValueError(f"redundancy_weight must be >= 0, got {self.redundancy_weight}")
        if not -1.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(f"similarity_threshold is a cosine similarity in [-1, 1], got {self.similarity_threshold}")

    def round_bytes_per_entry(self, head_dim: int, group: int, entries: int) -> int:
        # plus one row of the N x N similarity (float32 values and recency, boolean masks)
        return super().round_bytes_per_entry(head_dim, group, entries) + 16 * entries

    def score(self, context: ScoringContext) -> torch.Tensor:
        tri = super().score(context)  # [L, b, Hkv, N]
        if self.normalize:
            tri = zscore(tri, context.candidates)  # max over the group shifts the scale; back to unit spread
        if self.redundancy_weight == 0.0:
            return tri
        similar = mean_similarity(context.keys, context.positions, self.similarity_threshold)  # [L, b, Hkv, N]
        return tri - self.redundancy_weight * zscore(similar, context.candidates)
