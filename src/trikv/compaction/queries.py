"""Reference queries for attention matching: the selector window (TAM) or calibrated statistics (hybrid)."""

from __future__ import annotations

import numpy as np
import torch

from ..geometry import RopeGeometry


def window_queries(queries: torch.Tensor, query_positions: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool the G query heads of each KV head: [L, b, Hq, w, D] -> ([L, b, Hkv, G·w, D], mask [1, b, 1, G·w]).

    Slots of the ring that are empty or padding (position -1) are masked out.
    """
    L, b, Hq, w, D = queries.shape
    G = Hq // num_kv_heads
    pooled = queries.reshape(L, b, num_kv_heads, G * w, D)
    mask = (query_positions >= 0).repeat(1, G)  # [b, G*w], head-major like the pooled axis
    return pooled, mask[None, :, None, :]


def von_mises_kappa(R: np.ndarray, newton_steps: int = 8) -> np.ndarray:
    """Concentration kappa whose von Mises mean resultant length A1(kappa) = I1/I0 equals R.

    Banerjee et al. (2005)'s approximation, refined by Newton steps on A1(kappa) = R
    (A1' = 1 - A1/kappa - A1²). R is clipped to [0, 0.999].
    """
    R = np.clip(np.asarray(R, dtype=np.float64), 0.0, 0.999)
    kappa = torch.from_numpy(R * (2.0 - R * R) / (1.0 - R * R))
    target = torch.from_numpy(R)
    for _ in range(newton_steps):
        a1 = torch.special.i1e(kappa) / torch.special.i0e(kappa)
        slope = 1.0 - a1 / kappa.clamp_min(1e-12) - a1 * a1
        kappa = torch.where(kappa > 1e-8, (kappa - (a1 - target) / slope.clamp_min(1e-12)).clamp_min(0.0), kappa)
    return kappa.numpy()


class StatsQuerySampler:
    """Synthetic post-RoPE queries drawn from calibrated pre-RoPE query statistics.

    For every layer, query head and frequency band f the calibration gives mu_f = E[q_f] and A_f = E|q_f|.
    A sample has magnitude A_f and phase arg(mu_f) + phi, phi ~ von Mises(0, kappa(R_f)) with
    R_f = |mu_f| / A_f, so its expectation is mu_f (kappa solved to float precision); bands are drawn
    independently. Each sample is then rotated to the future positions t + o for TriAttention's offsets
    o (the same geometric set), with RoPE's attention scaling, giving per KV head G·|offsets|·samples
    queries. The pre-RoPE draws are made once (seeded), so rounds differ only by the rotation.
    """

    def __init__(self, q_mean: torch.Tensor, q_abs_mean: torch.Tensor, geometry: RopeGeometry, num_kv_heads: int,
                 offsets: torch.Tensor, samples: int = 4, seed: int = 0, include_mean: bool = False):
        if samples < 1 and not include_mean:
            raise ValueError("need at least one sample per offset (or include_mean)")
        self.geometry = geometry
        self.num_kv_heads = num_kv_heads
        self.offsets = offsets.double().cpu()
        mu = q_mean.to(torch.complex128).cpu().numpy()  # [L, Hq, F]
        A = q_abs_mean.double().cpu().numpy()
        R = np.abs(mu) / np.maximum(A, 1e-30)
        kappa = von_mises_kappa(R)
        rng = np.random.default_rng(seed)
        draws = []
        if include_mean:
            draws.append(mu[:, :, None, :])
        if samples > 0:
            phase = rng.vonmises(0.0, np.broadcast_to(kappa[:, :, None, :], (*kappa.shape[:2], samples, kappa.shape[2])))
            draws.append(A[:, :, None, :] * np.exp(1j * (np.angle(mu)[:, :, None, :] + phase)))
        self.pre_rope = torch.from_numpy(np.concatenate(draws, axis=2))  # [L, Hq, S, F] complex128

    @property
    def per_kv_head(self) -> int:
        L, Hq, S, _ = self.pre_rope.shape
        return (Hq // self.num_kv_heads) * self.offsets.numel() * S

    def queries(self, t: torch.Tensor, dtype=torch.float32, device=None) -> torch.Tensor:
        """Post-RoPE queries at positions t[b] + offsets: [L, b, Hkv, G·O·S, D]."""
        L, Hq, S, F = self.pre_rope.shape
        omega = self.geometry.omega.double()
        pos = t.double().cpu()[:, None] + self.offsets[None, :]  # [b, O]
        angle = pos[..., None] * omega  # [b, O, F]
        rotation = torch.polar(torch.ones_like(angle), angle) * self.geometry.attention_scaling
        bands = self.pre_rope[:, None, :, None, :, :] * rotation[None, :, None, :, None, :]  # [L, b, Hq, O, S, F]
        b, O = pos.shape
        out = torch.zeros(L, b, Hq, O, S, self.geometry.head_dim, dtype=torch.float64)
        out[..., self.geometry.real_index] = bands.real
        out[..., self.geometry.imag_index] = bands.imag
        out = out.reshape(L, b, self.num_kv_heads, (Hq // self.num_kv_heads) * O * S, self.geometry.head_dim)
        return out.to(dtype=dtype, device=device)
