"""Stability across calibration texts: do two different texts give the same per-head statistics?

For a pair of texts (A, B): correlation over heads of per-head R (plain and weighted) and mean |R_A - R_B|,
agreement of the dominant band, and cross reconstruction: the centres measured on A predict the real
logit curve measured on B (and vice versa). If these match the in-sample figures, calibration data
barely matters for this model (the paper's Appendix H claim).
"""

from __future__ import annotations

import torch

from .reconstruction import pearson


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(pearson(a.flatten()[None], b.flatten()[None])[0])


def compare_texts(fig_a: dict, fig_b: dict, cross_r_ab: torch.Tensor, cross_r_ba: torch.Tensor, own_r_a: torch.Tensor, own_r_b: torch.Tensor) -> dict:
    """Agreement figures between two texts' concentration figures and reconstruction correlations."""
    out = {}
    for key in ("q_head_R_plain", "q_head_R_weighted", "k_head_R_plain"):
        a, b = fig_a[key].flatten(), fig_b[key].flatten()
        diff = (a - b).abs()
        out[key] = {
            "corr": _corr(a, b),
            "mean_abs_diff": float(diff.mean()),
            "max_abs_diff": float(diff.max()),
            "mean_a": float(a.mean()),
            "mean_b": float(b.mean()),
        }
    out["band_R_corr"] = _corr(fig_a["q_R"], fig_b["q_R"])
    out["same_top1_band"] = float((fig_a["top_bands"][..., 0] == fig_b["top_bands"][..., 0]).double().mean())
    out["reconstruction_r_corr"] = _corr(own_r_a, own_r_b)
    out["cross_mean_r_a_to_b"] = float(torch.nanmean(cross_r_ab))
    out["cross_mean_r_b_to_a"] = float(torch.nanmean(cross_r_ba))
    out["own_mean_r_a"] = float(torch.nanmean(own_r_a))
    out["own_mean_r_b"] = float(torch.nanmean(own_r_b))
    return out


def stability_verdict(pair: dict) -> str:
    """Plain-words judgement of one comparison."""
    w = pair["q_head_R_weighted"]
    small = w["mean_abs_diff"] < 0.03
    # centres from A judged on B's curves against B's own centres, and vice versa
    loss = max(pair["own_mean_r_b"] - pair["cross_mean_r_a_to_b"], pair["own_mean_r_a"] - pair["cross_mean_r_b_to_a"])
    transfers = loss <= 0.05
    if small and transfers:
        return "calibration data barely matters: per-head concentration is nearly identical and centres from one text predict the other as well as its own"
    if small:
        return "per-head concentration is nearly identical, but centres from one text predict the other's distance curve somewhat worse than its own"
    if transfers:
        return "per-head concentration shifts noticeably between texts, yet the centres still transfer for reconstruction"
    return "calibration data matters for this model: per-head concentration and reconstruction change between texts"
