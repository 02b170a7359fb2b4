"""Ada-KV (Feng et al. 2024) with SnapKV scores, decode-time port: head-wise adaptive budgets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ScoringContext
from .snapkv import SnapKV


def descending_rank(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Rank of every element along `dim` in descending order (0 = largest)."""
    order = scores.argsort(dim=dim, descending=True)
    rank = torch.empty_like(order)
    index = torch.arange(scores.shape[dim], device=scores.device)
    shape = [1] * scores.dim()
    shape[dim] = -1
    rank.scatter_(dim, order, index.view(shape).expand_as(order))
    return rank


def adaptive_head_budgets(scores: torch.Tensor, budget: int, floor: float) -> torch.Tensor:
    """Per-(layer, row, KV head) entries to keep, [L, b, Hkv]; each (layer, row) sums to Hkv x budget.

    scores [L, b, Hkv, N]: +inf protected, -inf dead, finite = candidates. Every head keeps its protected
    entries and its top floor(floor * (budget - protected)) candidates (the safeguard); the rest of the
    layer's Hkv x budget slots go to the best remaining candidates of the layer, whatever their head.
    """
    L, b, Hkv, N = scores.shape
    protected = torch.isposinf(scores)
    candidates = torch.isfinite(scores)
    n_protected = protected.sum(-1)  # [L, b, Hkv]
    available = (budget - n_protected).clamp_min(0)
    guaranteed = torch.floor(floor * available.double()).long()
    masked = scores.masked_fill(~candidates, float("-inf"))
    floor_pick = candidates & (descending_rank(masked) < guaranteed[..., None])
    remaining = available.sum(-1) - floor_pick.sum(dim=(-1, -2))  # [L, b]
    rest = masked.masked_fill(floor_pick, float("-inf")).reshape(L, b, Hkv * N)
    global_pick = (descending_rank(rest) < remaining[..., None]) & torch.isfinite(rest)
    chosen = floor_pick.sum(-1) + global_pick.view(L, b, Hkv, N).sum(-1)
    return n_protected + chosen


@dataclass
class AdaKV(SnapKV):
    """SnapKV scores, but the heads of a layer share the layer's Hkv x budget slots adaptively.

    Rule: per layer and row, every KV head keeps its protected entries and its top floor·(B - protected)
    candidates; the remaining slots of the layer (Hkv x B in total) go to the highest SnapKV scores of the
    layer across heads, so heads with concentrated attention give slots to heads with diffuse attention.
    Per-head budgets sum to the layer's Hkv x B exactly. Defaults: floor (alpha safeguard) = 0.2
    (KVCache-Factory `--floor 0.2`, kvpress `alpha_safeguard=0.20`; the official README example uses 0.5);
    SnapKV decode port scores (w = 8, kernel 7, max pooling, max_logit); the shared trigger.
    Source: FFY0/AdaKV; kvpress `AdaKVPress`
    Memory: the cache uses the packed layout for this policy (stores/packed.py; the official code's var-len
    flash-attention layout in plain PyTorch): every head stores exactly its entries, so right after a round
    a layer holds Hkv x B entries, as for uniform SnapKV. Attention over a packed layer reads every slot once.
    Cost: SnapKV's, plus two sorts over Hkv·N per layer and row per round.
    """

    name = "adakv"
    rule = "SnapKV scores, layer-global top-(Hkv x B) across heads with a 20% per-head floor (Ada-KV)"
    paper = 'Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference (arXiv 2407.11550)'
    floor: float = 0.2
    # SnapKV's decode-time port (KVCache-Factory's defaults), not the official prefill defaults
    window_size: int = 8
    kernel_size: int = 7
    pooling: str = "max"
    group_aggregation: str = "max_logit"
    softmax_scope: str = "non_window"

    variable_budgets = True
    rank_heads_jointly = True  # the heads of a layer compete on the same scale

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")

    def allocate(self, scores: torch.Tensor, context: ScoringContext) -> torch.Tensor:
        return adaptive_head_budgets(scores, context.budget, self.floor)
