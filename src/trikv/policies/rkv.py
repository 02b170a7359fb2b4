"""R-KV (Cai et al. 2025): importance minus redundancy, for long chains of thought."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_scores import ObservationWindowPolicy, layer_chunks, masked_softmax
from .base import ScoringContext
from .snapkv import window_importance


def mean_similarity(keys: torch.Tensor, positions: torch.Tensor, threshold: float) -> torch.Tensor:
    """[L, b, Hkv, N] each key's mean cosine similarity to the other live keys of its (layer, row, KV head).

    S = cosine similarity with a zero diagonal, over live keys only; in every row i the entry of the most
    recent key j with S_ij > threshold is zeroed, which leaves the newest copy of a group of near-duplicates
    the least redundant; the result is mean_i S_ij. Where a row has no near-duplicate nothing is zeroed (the
    R-KV reference zeroes column 0 there, an artefact we drop). Dead slots get 0.
    Memory: the N x N similarity of a layer chunk at a time.
    """
    L, b, Hkv, N, D = keys.shape
    result = torch.zeros(L, b, Hkv, N, dtype=torch.float32, device=keys.device)
    eye = torch.eye(N, dtype=torch.bool, device=keys.device)
    for layers in layer_chunks(L, b * Hkv * N * N, limit=1 << 23):
        k = keys[layers].float()
        pos = positions[layers]
        live = pos >= 0
        unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
        similarity = unit @ unit.transpose(-1, -2)  # [l, b, Hkv, N, N]
        pair = live[..., :, None] & live[..., None, :] & ~eye
        similarity = similarity * pair
        near = similarity > threshold
        recency = torch.where(near, pos[..., None, :].float(), -1.0)  # positions are exact in fp32 below 2^24
        newest = recency.argmax(-1, keepdim=True)  # [l, b, Hkv, N, 1] most recent near-duplicate of each row
        del recency
        has_near = near.any(-1, keepdim=True)
        zero = torch.zeros_like(similarity, dtype=torch.bool).scatter_(-1, newest, has_near)
        similarity = similarity.masked_fill(zero, 0.0)
        rows = live.sum(-1, keepdim=True).clamp_min(1)  # [l, b, Hkv, 1]
        result[layers] = similarity.sum(-2) / rows
    return result


def redundancy(keys: torch.Tensor, positions: torch.Tensor, threshold: float) -> torch.Tensor:
    """[L, b, Hkv, N] R-KV redundancy: softmax over the live keys of their `mean_similarity`."""
    return masked_softmax(mean_similarity(keys, positions, threshold), positions >= 0)


@dataclass
class RKV(ObservationWindowPolicy):
    """Keep keys that the recent queries need and that are not near-copies of newer keys.

    Rule: Z_j = λ·I_j − (1 − λ)·r_j with I = SnapKV-style importance (the last w queries, max over the G
    query heads of the logits, softmax over the non-window keys, mean over the window, max-pool kernel 7)
    and r = redundancy (softmax of the mean cosine similarity to the other keys of the KV head, the newest
    near-duplicate (> threshold) of each key exempted). Keep the top (B − w) plus the w window tokens;
    kept entries stay in original order (the reference keeps top-k order, which makes its next pooling run
    over score-neighbours; we sort, as recommended).
    Defaults: λ = 0.1, w = 8, kernel 7, threshold 0.5 (paper and TriAttention's port; R-KV's run_math uses
    λ = 0.07), every `divide_length` = 128 tokens (R-KV's buffer). Source: Zefan-Cai/R-KV
    `rkv/compression/r1_kv.py`, `rkv/utils.py`
    Cost per round: importance O(Hq·w·N·D); redundancy O(Hkv·N²·D) compute and an N x N similarity per
    (layer chunk, KV head): this term dominates at large budgets.
    """

    name = "rkv"
    rule = "λ·pooled window attention − (1−λ)·key redundancy (λ=0.1, window 8, kernel 7, threshold 0.5)"
    paper = 'Cai et al., R-KV: Redundancy-aware KV Cache Compression for Reasoning Models (arXiv 2505.24133)'
    mix_lambda: float = 0.1
    kernel_size: int = 7
    similarity_threshold: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda must be in [0, 1], got {self.mix_lambda}")

    def importance(self, context: ScoringContext) -> torch.Tensor:
        self._require_queries(context)
        importance = window_importance(context, self.scaling, self.window_size, self.kernel_size, "max", "max_logit", "non_window",
                                       sinks=self.sinks)
        redundant = redundancy(context.keys, context.positions, self.similarity_threshold)
        return self.mix_lambda * importance - (1.0 - self.mix_lambda) * redundant
