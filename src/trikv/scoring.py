"""TriAttention scoring math, vectorised over layers, batch rows, heads and keys.

For a cached post-RoPE key k (bands k_f) and the current position t, per query head with statistics
mu_f = E[q_f], A_f = E|q_f|:

    S_trig = mean_{o in D} Re sum_f mu_f conj(k_f) e^{i w_f (t + o)} / s
           = Re sum_f [mu_f e^{i w_f t} c_f] conj(k_f) / s,        c_f = mean_o e^{i w_f o}
    S_norm = sum_f (A_f - |mu_f|) |k_f| / s                        (= sum_f (1 - R_f) A_f |k_f|)

The key's own position cancels because the cached key already carries its rotation e^{i w_f p}. Folding
the offsets into c_f makes S_trig one matrix product: in the key's own dimension layout the bracket is a
real [D] weight vector per (layer, row, query head), so S_trig = keys @ W.
"""

from __future__ import annotations

import copy

import torch

from .geometry import RopeGeometry


def offset_values(max_offset: int = 65536, spacing: str = "geometric", count: int | None = None) -> torch.Tensor:
    """Future offsets D: geometric 1, 2, 4, ..., max_offset (17 by default) or `count` linearly spaced."""
    if max_offset < 1:
        raise ValueError(f"max_offset must be >= 1, got {max_offset}")
    if spacing == "geometric":
        values = [2**i for i in range(0, max_offset.bit_length()) if 2**i <= max_offset]
        return torch.tensor(values, dtype=torch.float64)
    if spacing == "linear":
        count = count or max_offset.bit_length()
        return torch.linspace(1.0, float(max_offset), count, dtype=torch.float64).round()
    raise ValueError(f"unknown offset spacing {spacing!r}; expected 'geometric' or 'linear'")


def folded_offset_constant(omega: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """c_f = mean_o e^{i w_f o}: [F] complex128."""
    angle = omega.double()[None, :] * offsets.double()[:, None]  # [O, F]
    return torch.polar(torch.ones_like(angle), angle).mean(0)


class TriScorer:
    """Per-query-head TriAttention scores for all layers at once.

    Built once per cache from the statistics; `score(keys, t)` is then two batched matmuls per round.
    """

    def __init__(
        self,
        q_mean: torch.Tensor,  # [L, Hq, F] complex
        q_abs_mean: torch.Tensor,  # [L, Hq, F]
        geometry: RopeGeometry,
        num_kv_heads: int,
        offsets: torch.Tensor,
        use_trig: bool = True,
        use_norm: bool = True,
        weighted_norm: bool = True,
        offset_aggregation: str = "mean",
    ):
        if offset_aggregation not in ("mean", "max"):
            raise ValueError(f"offset_aggregation must be 'mean' or 'max', got {offset_aggregation!r}")
        if not (use_trig or use_norm):
            raise ValueError("at least one of the trigonometric and norm terms must be enabled")
        self.geometry = geometry
        self.num_layers, self.num_heads, self.num_bands = q_mean.shape
        self.num_kv_heads = num_kv_heads
        self.group = self.num_heads // num_kv_heads
        self.offsets = offsets.double()
        self.use_trig, self.use_norm = use_trig, use_norm
        self.offset_aggregation = offset_aggregation
        scale = geometry.attention_scaling
        self.q_mean = q_mean.to(torch.complex128) / scale  # the 1/s undoes RoPE's scaling of cached keys
        norm_weight = q_abs_mean.double() - q_mean.abs() if weighted_norm else q_abs_mean.double()
        # [L, Hkv, F, G]: weights of |k_f| for the G query heads of each KV head
        self.norm_weight = (norm_weight / scale).view(self.num_layers, num_kv_heads, self.group, -1).transpose(-1, -2)
        self.fold = folded_offset_constant(geometry.omega, self.offsets)  # [F]
        self._device_cache: dict = {}

    def for_layers(self, layers: slice) -> "TriScorer":
        """The scorer of the layers `layers` alone (views of this one's per-layer weights)."""
        part = copy.copy(self)
        part.q_mean, part.norm_weight = self.q_mean[layers], self.norm_weight[layers]
        part.num_layers = part.q_mean.shape[0]
        part._device_cache = {}
        return part

    def for_heads(self, heads: slice) -> "TriScorer":
        """The scorer of the KV heads `heads` alone (views of this one's per-head weights: their query heads)."""
        start, stop, _ = heads.indices(self.num_kv_heads)
        part = copy.copy(self)
        part.q_mean = self.q_mean[:, start * self.group : stop * self.group]
        part.norm_weight = self.norm_weight[:, start:stop]
        part.num_heads, part.num_kv_heads = part.q_mean.shape[1], stop - start
        part._device_cache = {}
        return part

    def _on(self, device, dtype):
        key = (device, dtype)
        if key not in self._device_cache:
            self._device_cache[key] = tuple(x.to(device, non_blocking=_async_copy(device)) for x in (
                self.norm_weight.to(dtype), self.geometry.real_index, self.geometry.imag_index))
        return self._device_cache[key]

    def _rotation_terms(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_mean [L, Hq, F] complex128, omega [F] and the folded offsets c_f [F] on `device`."""
        key = (device, "rotation")
        if key not in self._device_cache:
            self._device_cache[key] = tuple(x.to(device, non_blocking=_async_copy(device))
                                            for x in (self.q_mean, self.geometry.omega, self.fold))
        return self._device_cache[key]

    def _trig_weights(self, t: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
        """[L, b, Hq, F] complex: mu_f e^{i w_f t} (times c_f, or e^{i w_f o} for one offset o). Computed in
        float64 where t lives when that device has float64 (CPU, CUDA: no round trip to the host), else on the host."""
        device = t.device if t.device.type in ("cpu", "cuda", "meta") else torch.device("cpu")
        q_mean, omega, fold = self._rotation_terms(device)
        angle = t.to(device=device, dtype=torch.float64)[:, None] * omega[None, :]  # [b, F]
        rotation = torch.polar(torch.ones_like(angle), angle)
        rotation = rotation * (fold if offsets is None else torch.polar(torch.ones_like(omega), omega * offsets))
        return q_mean[:, None] * rotation[None, :, None, :]

    def score(self, keys: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """keys [L, b, Hkv, N, D] post-RoPE of every layer, t [b] current positions
        -> scores [L, b, Hkv, G, N] (float32)."""
        L, b, Hkv, N, D = keys.shape
        keys = keys.float()
        norm_weight, real_index, imag_index = self._on(keys.device, torch.float32)
        score = keys.new_zeros(L, b, Hkv, N, self.group)
        if self.use_norm:
            k_real, k_imag = keys.index_select(-1, real_index), keys.index_select(-1, imag_index)
            magnitude = torch.sqrt(k_real * k_real + k_imag * k_imag)  # [L, b, Hkv, N, F]
            score += magnitude @ norm_weight[:, None]  # [L, b, Hkv, N, G]
        if self.use_trig:
            if self.offset_aggregation == "mean":
                score += keys @ self._dense_weights(self._trig_weights(t, None), keys)
            else:  # max over offsets of (S_trig(o) + S_norm), S_norm being offset-independent
                per_offset = torch.stack(
                    [keys @ self._dense_weights(self._trig_weights(t, o), keys) for o in self.offsets]
                )
                score += per_offset.amax(0)
        return score.transpose(-1, -2)

    def _dense_weights(self, coefficient: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Complex [L, b, Hq, F] -> real [L, b, Hkv, D, G] in the key layout, so that keys @ W = Re(coef conj(k))."""
        L, b, _, F = coefficient.shape
        _, real_index, imag_index = self._on(coefficient.device, torch.float64)
        weights = torch.zeros(L, b, self.num_heads, self.geometry.head_dim, dtype=torch.float64, device=coefficient.device)
        weights[..., real_index] = coefficient.real
        weights[..., imag_index] = coefficient.imag
        weights = weights.view(L, b, self.num_kv_heads, self.group, -1).transpose(-1, -2)
        # float32 whatever the keys' dtype: bf16 / fp16 weights would score half-precision models with ~3 digits
        return weights.to(device=keys.device, dtype=torch.float32, non_blocking=_async_copy(keys.device))


def _async_copy(device: torch.device) -> bool:
    """Host-to-device copies to a CUDA device need not wait for the device: CUDA stages a pageable source before
    the call returns, so the copy neither stalls the stream nor reads a host tensor freed after it. (The meta
    device stands in for CUDA where trikv counts what a round asks of the device.)"""
    return torch.device(device).type in ("cuda", "meta")


def zscore(scores: torch.Tensor, candidates: torch.Tensor, min_std: float = 1e-6) -> torch.Tensor:
    """Standardise `scores` [..., N] over the candidate entries of the last axis (population std, clamped)."""
    weight = candidates.to(scores.dtype)
    count = weight.sum(-1, keepdim=True).clamp_min(1.0)
    mean = (scores * weight).sum(-1, keepdim=True) / count
    var = (((scores - mean) ** 2) * weight).sum(-1, keepdim=True) / count
    return (scores - mean) / var.sqrt().clamp_min(min_std)
