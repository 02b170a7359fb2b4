"""Streaming measurement over one text: pre-RoPE band sums (for centres and concentration) and the real mean
attention logit at a set of Q-K distances.

Nothing of a long text is kept: each chunk's q/k update float64 running sums and are dropped. For every
distance d in the set, the real logit sum is  sum_t scale * q_post(t) . k_post(t - d)  over the chunk;
all lags come at once from one zero-padded FFT cross-correlation per chunk (vectorised over heads and
dimensions, O(n log n) instead of one pass per distance). Optionally a bounded number of single queries per
chunk keep their whole logit-vs-distance curve, for the harder per-query reconstruction figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..qk_capture import capture_qk
from .capture import AnalysisShape


def log_distances(max_distance: int, num: int = 32) -> torch.Tensor:
    """About `num` distinct integer Q-K distances, log-spaced from 1 to `max_distance` (inclusive)."""
    if max_distance < 1:
        raise ValueError("max_distance must be at least 1")
    values = np.unique(np.round(np.geomspace(1, max_distance, num=max(2, num))).astype(np.int64))
    return torch.from_numpy(values)


@dataclass
class TextStats:
    """Finished statistics of one text. Complex tensors complex128, others float64."""

    q_mean: torch.Tensor  # [L, Hq, F] E[q_f]
    q_abs_mean: torch.Tensor  # [L, Hq, F] E|q_f|
    k_mean: torch.Tensor  # [L, Hkv, F]
    k_abs_mean: torch.Tensor  # [L, Hkv, F]
    distances: torch.Tensor  # [nd] long
    real_logits: torch.Tensor  # [L, Hq, nd] mean scaled q_post.k_post at each distance (nan: not measured)
    pair_counts: torch.Tensor  # [L, nd] number of (t, t-d) pairs averaged
    tokens: int
    query_logits: torch.Tensor | None = None  # [L, Hq, nq, nd] logits of sampled single queries (nan: d > t)


class TextAccumulator:
    """Running float64 sums for one text; feed it with `add` (the `capture_qk` callback signature)."""

    def __init__(self, shape: AnalysisShape, distances: torch.Tensor, query_quota: int = 0):
        L, H, Hkv, F = shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.num_bands
        self.shape = shape
        self.distances = distances.to(torch.long)
        nd = self.distances.numel()
        self.q_sum = torch.zeros(L, H, F, dtype=torch.complex128)
        self.q_abs_sum = torch.zeros(L, H, F, dtype=torch.float64)
        self.k_sum = torch.zeros(L, Hkv, F, dtype=torch.complex128)
        self.k_abs_sum = torch.zeros(L, Hkv, F, dtype=torch.float64)
        self.vector_count = torch.zeros(L, dtype=torch.float64)
        self.logit_sum = torch.zeros(L, H, nd, dtype=torch.float64)
        self.pair_count = torch.zeros(L, nd, dtype=torch.float64)
        self.query_quota = int(query_quota)  # single queries kept per chunk (batch row 0)
        self.query_logits: list[list[torch.Tensor]] = [[] for _ in range(L)]

    @torch.no_grad()
    def add(self, layer: int, q_pre: torch.Tensor, k_pre: torch.Tensor, q_post: torch.Tensor, k_post: torch.Tensor) -> None:
        geometry = self.shape.geometries[layer]
        q_bands = geometry.to_complex(q_pre.detach().double().cpu())  # [b, H, n, F]
        k_bands = geometry.to_complex(k_pre.detach().double().cpu())  # [b, Hkv, n, F]
        self.q_sum[layer] += q_bands.sum(dim=(0, 2))
        self.q_abs_sum[layer] += q_bands.abs().sum(dim=(0, 2))
        self.k_sum[layer] += k_bands.sum(dim=(0, 2))
        self.k_abs_sum[layer] += k_bands.abs().sum(dim=(0, 2))
        b, H, n, D = q_post.shape
        self.vector_count[layer] += b * n
        q = q_post.detach().double().cpu()
        k = k_post.detach().double().cpu()
        scale = self.shape.scaling[layer]
        # sum_t q(t) . k(t - d) for every lag d at once: cross-correlation along t via zero-padded FFTs
        lags = lag_dot_sums(q, k)  # [H, n]
        use = self.distances < n
        self.logit_sum[layer][:, use] += scale * lags[:, self.distances[use]]
        self.pair_count[layer][use] += b * (n - self.distances[use]).double()
        if self.query_quota:
            self._sample_queries(layer, q, k, scale)

    def _sample_queries(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
        """Keep the logit of a few single queries at every distance (bounded: `query_quota` per chunk)."""
        b, H, n, D = q.shape
        Hkv = k.shape[1]
        d_max = int(self.distances.max())
        first = min(d_max, n - 1)
        positions = torch.unique(torch.linspace(first, n - 1, steps=min(self.query_quota, n - first)).round().long())
        keys = positions[:, None] - self.distances[None, :]  # [nt, nd]
        valid = keys >= 0
        gathered = k[0][:, keys.clamp_min(0)]  # [Hkv, nt, nd, D]
        logits = torch.einsum("kgtd,ktjd->kgtj", q[0][:, positions].reshape(Hkv, H // Hkv, -1, D), gathered)
        logits = (scale * logits).reshape(H, -1, keys.shape[1]).masked_fill(~valid, float("nan"))
        self.query_logits[layer].append(logits)  # [H, nt, nd]

    def finish(self) -> TextStats:
        count = self.vector_count.clamp_min(1)[:, None, None]
        pairs = self.pair_count[:, None, :]
        real = torch.where(pairs > 0, self.logit_sum / pairs.clamp_min(1), torch.full_like(self.logit_sum, float("nan")))
        return TextStats(
            q_mean=self.q_sum / count,
            q_abs_mean=self.q_abs_sum / count,
            k_mean=self.k_sum / count,
            k_abs_mean=self.k_abs_sum / count,
            distances=self.distances.clone(),
            real_logits=real,
            pair_counts=self.pair_count.clone(),
            tokens=int(self.vector_count.max().item()),
            query_logits=torch.stack([torch.cat(rows, dim=1) for rows in self.query_logits]) if all(self.query_logits) else None,
        )


def lag_dot_sums(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [b, H, n, D], k [b, Hkv, n, D] -> [H, n]: entry (h, d) = sum_b sum_{t>=d} q_h(t) . k_{h//G}(t - d)."""
    b, H, n, D = q.shape
    Hkv = k.shape[1]
    size = 1 << (2 * n - 1).bit_length()  # zero padding >= 2n - 1 makes the circular correlation linear
    qf = torch.fft.rfft(q.transpose(-1, -2), n=size)  # [b, H, D, f]
    kf = torch.fft.rfft(k.transpose(-1, -2), n=size)  # [b, Hkv, D, f]
    spectrum = torch.einsum("bkgdf,bkdf->kgf", qf.reshape(b, Hkv, H // Hkv, D, -1), kf.conj())
    return torch.fft.irfft(spectrum, n=size)[..., :n].reshape(H, n)


def make_chunks(token_ids: list[int], chunk_tokens: int, bos_token_id: int | None) -> list[torch.Tensor]:
    """Split a token stream into model-sized chunks; later chunks start with BOS again when the text did."""
    if chunk_tokens < 2:
        raise ValueError("chunk_tokens must be at least 2")
    restart = bos_token_id is not None and len(token_ids) > 0 and token_ids[0] == bos_token_id
    chunks, start = [], 0
    while start < len(token_ids):
        if start == 0 or not restart:
            piece = token_ids[start : start + chunk_tokens]
            start += len(piece)
        else:
            piece = [bos_token_id] + token_ids[start : start + chunk_tokens - 1]
            start += len(piece) - 1
        chunks.append(torch.tensor(piece, dtype=torch.long))
    return chunks


@torch.no_grad()
def measure_chunks(model, shape: AnalysisShape, chunks: list[torch.Tensor], distances: torch.Tensor, bar=None, query_samples: int = 0) -> TextStats:
    """Run `chunks` (independent forwards) through the model and return the text's statistics;
    `query_samples` single queries (spread over the chunks) also keep their own logit curves."""
    # single queries come from chunks long enough to see every distance (all chunks if none is)
    longest = int(distances.max())
    hosts = [i for i, c in enumerate(chunks) if c.numel() > longest] or list(range(len(chunks)))
    quota = -(-query_samples // len(hosts)) if query_samples else 0
    accumulator = TextAccumulator(shape, distances, quota)
    device = next(model.parameters()).device
    with capture_qk(model, accumulator.add):
        for i, chunk in enumerate(chunks):
            accumulator.query_quota = quota if i in hosts else 0
            model(input_ids=chunk[None].to(device), use_cache=False, logits_to_keep=1)  # queries only: no vocabulary-wide logits
            if bar is not None:
                bar.update(int(chunk.numel()))
    return accumulator.finish()


@torch.no_grad()
def sample_head_vectors(model, shape: AnalysisShape, chunk: torch.Tensor, layer: int, head: int, bands: list[int], max_points: int = 256) -> dict:
    """Pre- and post-RoPE q (query head `head`) and k (its KV head) of `layer` in `bands`, for a bounded,
    evenly spaced sample of the positions of one chunk. Returns lists ready for JSON."""
    kv_head = head // shape.group_size
    geometry = shape.geometries[layer]
    kept: dict[str, torch.Tensor] = {}

    def grab(layer_idx, q_pre, k_pre, q_post, k_post):
        if layer_idx != layer:
            return
        for name, tensor, h in (("q_pre", q_pre, head), ("k_pre", k_pre, kv_head), ("q_post", q_post, head), ("k_post", k_post, kv_head)):
            kept[name] = geometry.to_complex(tensor[0, h].detach().double().cpu())[:, bands]  # [n, len(bands)]

    device = next(model.parameters()).device
    with capture_qk(model, grab):
        model(input_ids=chunk[None].to(device), use_cache=False, logits_to_keep=1)  # queries only: no vocabulary-wide logits
    n = kept["q_pre"].shape[0]
    positions = torch.unique(torch.linspace(0, n - 1, steps=min(n, max_points)).round().long())
    out = {"positions": positions.tolist(), "bands": list(bands)}
    for name, value in kept.items():
        picked = value[positions]  # [m, nb]
        out[name] = [[[round(float(z.real), 5), round(float(z.imag), 5)] for z in picked[:, i]] for i in range(len(bands))]
    return out
