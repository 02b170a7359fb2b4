"""Q/K concentration: the Mean Resultant Length R_f = |E[x_f]| / E|x_f| per (layer, head, band), its per-head
summaries, and the band contributions C_f = E|q_f| * E|k_f| that say which bands carry the attention logit.

Per-head R is given two ways: the plain mean over bands, and the mean weighted by C_f (what matters for
the logit: a band that contributes nothing cannot spoil the trigonometric series however dispersed it is).
"""

from __future__ import annotations

import torch

THRESHOLDS = (0.9, 0.95)


def mean_resultant_length(mean: torch.Tensor, abs_mean: torch.Tensor) -> torch.Tensor:
    """R = |mean| / abs_mean elementwise; 0 where a band never fired (abs_mean == 0)."""
    return torch.where(abs_mean > 0, mean.abs() / abs_mean.clamp_min(1e-300), torch.zeros_like(abs_mean))


def expand_kv(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[L, Hkv, F] -> [L, Hq, F]: each query head gets its KV head's row."""
    return x.repeat_interleave(group_size, dim=1)


def band_contribution(q_abs_mean: torch.Tensor, k_abs_mean: torch.Tensor) -> torch.Tensor:
    """C_f = E|q_f| * E|k_f| per query head, [L, Hq, F] (keys of the query head's KV head)."""
    group = q_abs_mean.shape[1] // k_abs_mean.shape[1]
    return q_abs_mean * expand_kv(k_abs_mean, group)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim weighted by `weights` (plain mean where all weights are 0)."""
    total = weights.sum(-1)
    weighted = (values * weights).sum(-1) / total.clamp_min(1e-300)
    return torch.where(total > 0, weighted, values.mean(-1))


def top_bands(contribution: torch.Tensor, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices [.., k] of the k largest C_f per head, and the share of sum_f C_f they hold [..]."""
    k = min(k, contribution.shape[-1])
    values, indices = contribution.topk(k, dim=-1)
    share = values.sum(-1) / contribution.sum(-1).clamp_min(1e-300)
    return indices, share


def distribution_summary(values: torch.Tensor) -> dict:
    """Mean, median and the shares above the paper's thresholds, of per-head values."""
    flat = values.flatten().double()
    flat = flat[torch.isfinite(flat)]
    if flat.numel() == 0:
        return {"heads": 0, "mean": float("nan"), "median": float("nan"), "min": float("nan"), **{f"share_gt_{t}": float("nan") for t in THRESHOLDS}}
    return {
        "heads": int(flat.numel()),
        "mean": float(flat.mean()),
        "median": float(flat.median()),
        "min": float(flat.min()),
        **{f"share_gt_{t}": float((flat > t).double().mean()) for t in THRESHOLDS},
    }


def concentration(q_mean, q_abs_mean, k_mean, k_abs_mean) -> dict:
    """All concentration figures of one text as tensors (see the module doc)."""
    group = q_mean.shape[1] // k_mean.shape[1]
    q_R = mean_resultant_length(q_mean, q_abs_mean)  # [L, H, F]
    k_R = mean_resultant_length(k_mean, k_abs_mean)  # [L, Hkv, F]
    C = band_contribution(q_abs_mean, k_abs_mean)  # [L, H, F]
    # keys: weight each KV head's band by the contribution summed over the query heads that read it
    L, H, F = C.shape
    C_kv = C.reshape(L, H // group, group, F).sum(2)
    top, top_share = top_bands(C, 2)
    return {
        "q_R": q_R,
        "k_R": k_R,
        "contribution": C,
        "q_head_R_plain": q_R.mean(-1),
        "q_head_R_weighted": weighted_mean(q_R, C),
        "k_head_R_plain": k_R.mean(-1),
        "k_head_R_weighted": weighted_mean(k_R, C_kv),
        "top_bands": top,
        "top2_share": top_share,
    }


def concentration_summary(figures: dict) -> dict:
    return {
        "q_plain": distribution_summary(figures["q_head_R_plain"]),
        "q_weighted": distribution_summary(figures["q_head_R_weighted"]),
        "k_plain": distribution_summary(figures["k_head_R_plain"]),
        "k_weighted": distribution_summary(figures["k_head_R_weighted"]),
        "top2_share_mean": float(figures["top2_share"].mean()),
    }
