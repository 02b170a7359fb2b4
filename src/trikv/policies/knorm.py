"""KnormPress (Devoto et al. 2024): keep the keys with the smallest L2 norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, ScoringContext


@dataclass
class KnormPress(Policy):
    """Keep the keys with the lowest L2 norm (low-norm keys draw high attention, per the paper).

    Rule: score_j = -||k_j||_2 per KV head (RoPE is a rotation, so the post-RoPE norm is the pre-RoPE one);
    query-free and compatible with any attention kernel. Defaults: kvpress `KnormPress` (no window, every
    layer compressed) on the shared trigger. KVCache-Factory's option of leaving layers 0-1 uncompressed is
    not offered (a bounded cache cannot keep whole layers unbounded); `recent_window` protects the newest
    tokens if wanted (e.g. 8). Source: NVIDIA/kvpress `knorm_press.py`.
    Cost per round: O(N·D) per (layer, KV head), a top-k; nothing per step.
    """

    name = "knorm"
    rule = "keep the keys with the smallest L2 norm"
    paper = 'Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression, EMNLP 2024 (arXiv 2406.11430)'
    scores_rows_independently = True
    scores_layers_independently = True
    scores_heads_independently = True
    recent_window: int = 0

    def score(self, context: ScoringContext) -> torch.Tensor:
        return -torch.linalg.vector_norm(context.keys, dim=-1, dtype=torch.float32)
