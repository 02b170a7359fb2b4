"""Reconstruction of each head's distance preference from its Q/K centres (the paper's Figure 3).

Under concentration the mean logit at Q-K distance D is the trigonometric series
    logit(D) = scale * sum_f |E q_f| |E k_f| cos(w_f D + phi_f),   phi_f = arg E q_f - arg E k_f,
i.e. scale * Re sum_f E[q_f] conj(E[k_f]) e^{i w_f D}; `scale` is the model's logit factor times the squared
RoPE attention scaling, so the prediction is in the same units as the measured q_post . k_post.
Its agreement with the real mean logit is the Pearson r over log-spaced distances, per head.
"""

from __future__ import annotations

import torch

from .concentration import expand_kv

R_BINS = (-1.0, 0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def predicted_logits(q_mean: torch.Tensor, k_mean: torch.Tensor, omega: torch.Tensor, distances: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """q_mean [..., F], k_mean [..., F] complex, omega [F] -> predicted logit [..., nd] at `distances`."""
    coefficient = q_mean * k_mean.conj()  # [..., F]  = |Eq||Ek| e^{i phi}
    phase = torch.polar(torch.ones(len(distances), omega.numel(), dtype=torch.float64), distances.double()[:, None] * omega.double()[None, :])
    return scale * (coefficient.to(torch.complex128) @ phase.T).real  # [..., nd]


def predicted_for_model(q_mean: torch.Tensor, k_mean: torch.Tensor, shape, distances: torch.Tensor) -> torch.Tensor:
    """[L, Hq, nd] predicted curves, each layer with its own frequencies and scale."""
    k_rep = expand_kv(k_mean, shape.group_size)
    rows = []
    for layer in range(shape.num_layers):
        geometry = shape.geometries[layer]
        scale = shape.scaling[layer] * geometry.attention_scaling**2
        rows.append(predicted_logits(q_mean[layer], k_rep[layer], geometry.omega, distances, scale))
    return torch.stack(rows)


def pearson(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Pearson r along the last dim, ignoring positions where `mask` is False or either value is nan.
    nan where fewer than 3 points remain or one side is constant."""
    valid = torch.isfinite(a) & torch.isfinite(b)
    if mask is not None:
        valid = valid & mask
    w = valid.double()
    n = w.sum(-1)
    a0 = torch.where(valid, a.double(), 0.0)
    b0 = torch.where(valid, b.double(), 0.0)
    ma = a0.sum(-1, keepdim=True) / n.clamp_min(1)[..., None]
    mb = b0.sum(-1, keepdim=True) / n.clamp_min(1)[..., None]
    da, db = (a0 - ma) * w, (b0 - mb) * w
    cov = (da * db).sum(-1)
    va, vb = (da * da).sum(-1), (db * db).sum(-1)
    tiny = 1e-24
    ok = (n >= 3) & (va > tiny * (a0 * a0).sum(-1).clamp_min(1e-300)) & (vb > tiny * (b0 * b0).sum(-1).clamp_min(1e-300))
    r = cov / (va * vb).sqrt().clamp_min(1e-300)
    return torch.where(ok, r.clamp(-1, 1), torch.full_like(r, float("nan")))


def distance_mask(shape, distances: torch.Tensor, pair_counts: torch.Tensor) -> torch.Tensor:
    """[L, nd]: distances each layer really attends over (inside its sliding window) and that were measured."""
    mask = pair_counts > 0
    for layer, window in enumerate(shape.sliding_windows):
        if window:
            mask[layer] &= distances < window
    return mask


def correlation_summary(r: torch.Tensor) -> dict:
    flat = r.flatten()
    finite = flat[torch.isfinite(flat)]
    edges = torch.tensor(R_BINS, dtype=torch.float64)
    hist = [int(((finite >= lo) & ((finite < hi) | (hi == 1.0))).sum()) for lo, hi in zip(edges[:-1], edges[1:])]
    if finite.numel() == 0:
        return {"heads": int(flat.numel()), "heads_with_r": 0, "mean_r": float("nan"), "median_r": float("nan"),
                "share_r_gt_0.5": float("nan"), "share_r_0.6_0.9": float("nan"), "share_r_gt_0.7": float("nan"),
                "histogram_edges": list(R_BINS), "histogram_counts": hist}
    return {
        "heads": int(flat.numel()),
        "heads_with_r": int(finite.numel()),
        "mean_r": float(finite.mean()),
        "median_r": float(finite.median()),
        "share_r_gt_0.5": float((finite > 0.5).double().mean()),
        "share_r_0.6_0.9": float(((finite >= 0.6) & (finite <= 0.9)).double().mean()),
        "share_r_gt_0.7": float((finite > 0.7).double().mean()),
        "histogram_edges": list(R_BINS),
        "histogram_counts": hist,
    }
