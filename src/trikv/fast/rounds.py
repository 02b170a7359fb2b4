"""Fast pieces of a compression round (see `trikv.fast`)."""

from __future__ import annotations

import torch

from ..scoring import TriScorer


def gather_slots(buffer: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """buffer [L, b, H, C, *rest] (contiguous), order [L, b, H, P] slot indices -> [L, b, H, P, *rest].

    Same result as `buffer[:, :, :, :N].gather(3, order[..., None].expand(..., D))`, as one index_select of
    whole rows of the flattened buffer (a memcpy per kept entry).
    """
    L, b, H, C = buffer.shape[:4]
    rest = buffer.shape[4:]
    if not buffer.is_contiguous():
        buffer = buffer.contiguous()
    base = torch.arange(L * b * H, device=order.device).view(L, b, H, 1) * C
    flat = (order + base).reshape(-1)
    return buffer.reshape(L * b * H * C, *rest).index_select(0, flat).view(*order.shape, *rest)


class FastTriScorer(TriScorer):
    """`TriScorer` with a faster `score` (same math; results equal up to float rounding)."""

    @classmethod
    def from_scorer(cls, scorer: TriScorer) -> "FastTriScorer":
        fast = cls.__new__(cls)
        fast.__dict__.update(scorer.__dict__)
        fast._device_cache = {}
        geometry = scorer.geometry
        F = geometry.num_bands
        real, imag = geometry.real_index.tolist(), geometry.imag_index.tolist()
        if real == list(range(F)) and imag == list(range(F, 2 * F)):
            fast._band_view = "half"  # [.., D] -> [.., 2, F]: dim -2 is (real, imag)
        elif real == list(range(0, 2 * F, 2)) and imag == list(range(1, 2 * F, 2)):
            fast._band_view = "interleaved"  # [.., D] -> [.., F, 2]
        else:
            fast._band_view = None  # partial rotary etc.: permute into the half layout first
            fast._permutation = torch.cat([geometry.real_index, geometry.imag_index])
        return fast

    def _magnitude(self, keys: torch.Tensor) -> torch.Tensor:
        """|k_f| per band: [..., N, D] -> [..., N, F] (hypot of strided views: no index copy)."""
        F = self.num_bands
        if self._band_view == "half":
            return torch.hypot(keys[..., :F], keys[..., F:])
        if self._band_view == "interleaved":
            return torch.hypot(keys[..., 0::2], keys[..., 1::2])
        permutation = self._permutation.to(keys.device)
        return torch.hypot(keys[..., permutation[:F]], keys[..., permutation[F:]])

    def score(self, keys: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.offset_aggregation != "mean":
            return super().score(keys, t)
        L, b, Hkv, N, D = keys.shape
        keys = keys.float()
        G = self.group
        score = None
        if self.use_trig:
            weights = self._dense_weights(self._trig_weights(t, None), keys)  # [L, b, Hkv, D, G]
            score = torch.matmul(weights.transpose(-1, -2), keys.transpose(-1, -2))  # [L, b, Hkv, G, N]
        if self.use_norm:
            norm_weight = self._on(keys.device, torch.float32)[0]  # [L, Hkv, F, G]
            magnitude = self._magnitude(keys)  # [L, b, Hkv, N, F]
            norm_t = norm_weight.transpose(-1, -2)[:, None].expand(L, b, Hkv, G, -1)  # [L, b, Hkv, G, F]
            if score is None:
                score = torch.matmul(norm_t, magnitude.transpose(-1, -2))
            else:
                flat = score.view(L * b * Hkv, G, N)
                torch.baddbmm(
                    flat, norm_t.reshape(L * b * Hkv, G, -1), magnitude.reshape(L * b * Hkv, N, -1).transpose(-1, -2), out=flat
                )
        return score


def accelerate(policy) -> None:
    """Give a bound TriAttention policy the fast scorer (no-op for other policies or when already fast)."""
    scorer = getattr(policy, "scorer", None)
    if type(scorer) is TriScorer:
        policy.scorer = FastTriScorer.from_scorer(scorer)
