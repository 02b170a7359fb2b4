"""PyramidKV (Cai et al. 2024), decode-time port: SnapKV scores with budgets that shrink with depth."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ScoringContext
from .snapkv import SnapKV


def pyramid_budgets(available: torch.Tensor, seen: torch.Tensor, protected: torch.Tensor, num_layers: int, beta: int) -> torch.Tensor:
    """Per-layer budgets for the competing entries, [L, b] long, summing exactly to L * available per row.

    available [b]: budget minus protected entries (KVCache-Factory's C - w); seen [b]: tokens seen (its
    q_len); protected [b]. KVCache-Factory's rule: min = a // beta, max = 2a - min, clipped to the tokens
    there are; linear from max (layer 0) to min (last layer); below 2a tokens every layer gets a. The
    integer step of the original overshoots the total by up to L²/2 entries; here the linear budgets are
    rounded by largest remainder so that the total is exactly L * a (memory-fair with uniform methods).
    """
    a = available.double()
    minimum = torch.div(available, beta, rounding_mode="floor").double()
    maximum = 2 * a - minimum
    room = (seen - protected).double()
    clip = maximum >= room
    maximum = torch.where(clip, room, maximum)
    minimum = torch.where(clip, 2 * a - maximum, minimum)
    if num_layers == 1:
        exact = a[None, :]
    else:
        depth = torch.arange(num_layers, dtype=torch.float64, device=available.device)[:, None] / (num_layers - 1)
        exact = maximum[None, :] - depth * (maximum - minimum)[None, :]  # [L, b]
    uniform = (seen < 2 * available)[None, :]
    exact = torch.where(uniform, a[None, :].expand_as(exact), exact).clamp_min(0)
    return largest_remainder(exact, num_layers * available)


def largest_remainder(exact: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Round exact shares [K, b] (summing to about total [b]) to integers that sum to `total` exactly."""
    base = exact.floor()
    missing = (total.double() - base.sum(0)).long()  # [b], may be negative after clamping
    fraction = exact - base
    rank = torch.empty_like(fraction, dtype=torch.long)
    order = fraction.argsort(0, descending=True)
    rank.scatter_(0, order, torch.arange(exact.shape[0], device=exact.device)[:, None].expand_as(order))
    bonus = (rank < missing.clamp_min(0)[None, :]).long()
    result = base.long() + bonus
    # negative `missing` (shares clamped at 0 made the sum too large) is taken from the largest shares
    excess = (-missing).clamp_min(0)
    if bool((excess > 0).any()):
        big = result.argsort(0, descending=True)
        rank_big = torch.empty_like(rank)
        rank_big.scatter_(0, big, torch.arange(exact.shape[0], device=exact.device)[:, None].expand_as(big))
        result = result - (rank_big < excess[None, :]).long()
    return result


@dataclass
class PyramidKV(SnapKV):
    """SnapKV scores, but deeper layers keep fewer entries (a linear pyramid); the total stays L x budget.

    Rule: per row, with a = budget - protected entries (window + protected prompt), layer l keeps its
    protected entries plus b_l competing ones, b_l linear from 2a - a/beta (layer 0) down to a/beta (last
    layer), clipped to the tokens seen; sum_l b_l = L·a exactly. Rows with fewer than 2a tokens seen use a
    in every layer (KVCache-Factory's fallback). Inside a layer each KV head keeps its top b_l SnapKV scores.
    A layer whose budget exceeds what it holds (budgets grow with the tokens seen during the first rounds)
    keeps everything; its unused budget is not lent to other layers.
    Defaults: beta = 20 (KVCache-Factory, kvpress), SnapKV decode port (w = 8, kernel 7, max pooling,
    max_logit), the shared trigger. Source: Zefan-Cai/KVCache-Factory `pyramidkv_utils.py`; kvpress
    `PyramidKVPress`
    Memory: the cache uses the packed layout for this policy (stores/packed.py): each layer stores exactly the
    entries it keeps, so right after a round the K/V bytes are L x Hkv x budget entries, as for uniform
    SnapKV (`layout="uniform"` gives the dead-slot layout instead, for comparisons).
    Cost: SnapKV's, plus O(L·b) for the budgets.
    """

    name = "pyramidkv"
    rule = "SnapKV scores with layer budgets decreasing linearly with depth (same total)"
    paper = 'Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling (arXiv 2406.02069)'
    beta: int = 20
    # SnapKV's decode-time port (KVCache-Factory's defaults), not the official prefill defaults
    window_size: int = 8
    kernel_size: int = 7
    pooling: str = "max"
    group_aggregation: str = "max_logit"
    softmax_scope: str = "non_window"

    variable_budgets = True

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def allocate(self, scores: torch.Tensor, context: ScoringContext) -> torch.Tensor:
        L, b, Hkv, _ = scores.shape
        protected = torch.isposinf(scores).sum(-1)  # [L, b, Hkv]
        protected_row = protected.amax(dim=(0, 2))  # [b] (the same protected tokens in every layer and head)
        available = (context.budget - protected_row).clamp_min(0)
        budgets = pyramid_budgets(available, context.current_position, protected_row, L, self.beta)  # [L, b]
        return protected + budgets[:, :, None]
