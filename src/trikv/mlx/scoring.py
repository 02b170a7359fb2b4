"""Round scoring in MLX for the methods that score stored keys only, and the top-B selection.

The rules are the torch policies' (`trikv.policies`): a scorer is built from the very policy object the registry
makes (its options and presets), and TriAttention's per-model constants (mu e^{..} / s, the norm weights
(A - |mu|) / s, the folded offsets c_f) are those `trikv.scoring.TriScorer` computes once from the statistics.
A round then runs in MLX alone: the per-round trigonometric weights are a [L, b, Hq, D] NumPy product, the
scores two batched MLX matmuls over every layer and head, the z-score, the GQA max and the selection MLX ops.

Shapes: keys [L, b, Hkv, N, D] post-RoPE, positions [L, b, Hkv, N] int32, candidates [L, b, Hkv, N] bool (the
entries that compete: not protected), t [b] the current position (tokens seen) of each row.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..policies import KnormPress, RandomEviction, StreamingLLM, TriAttention
from ..policies.random_eviction import head_key, random_scores
from ..policies.tri_dedup import TriAttentionDedup


def zscore(scores: mx.array, candidates: mx.array, min_std: float = 1e-6) -> mx.array:
    """`trikv.scoring.zscore`: standardise [..., N] over the candidate entries (population std, clamped)."""
    weight = candidates.astype(scores.dtype)
    count = mx.maximum(weight.sum(-1, keepdims=True), 1.0)
    mean = (scores * weight).sum(-1, keepdims=True) / count
    var = (mx.square(scores - mean) * weight).sum(-1, keepdims=True) / count
    return (scores - mean) / mx.maximum(mx.sqrt(var), min_std)


class TriAttentionScorer:
    """TriAttention and its ablations (trig-only, norm-only, unweighted norm, linear / max offsets, shared layers,
    union) and triattention-recent / -dedup, from a bound torch policy's `TriScorer` constants."""

    def __init__(self, policy: TriAttention):
        scorer = policy.scorer  # trikv.scoring.TriScorer, built by policy.bind_geometry
        self.policy = policy
        geometry = scorer.geometry
        self.omega = geometry.omega.numpy()  # [F] float64
        self.real_index = mx.array(geometry.real_index.numpy().astype(np.int32))
        self.imag_index = mx.array(geometry.imag_index.numpy().astype(np.int32))
        self.real_np, self.imag_np = geometry.real_index.numpy(), geometry.imag_index.numpy()
        self.head_dim = geometry.head_dim
        self.q_mean = scorer.q_mean.numpy()  # [L, Hq, F] complex128, already / s
        self.norm_weight = mx.array(scorer.norm_weight.numpy().astype(np.float32))  # [L, Hkv, F, G]
        self.fold = scorer.fold.numpy()  # [F] complex128
        self.offsets = scorer.offsets.numpy()  # [O]
        self.num_kv_heads, self.group = scorer.num_kv_heads, scorer.group
        self.use_trig, self.use_norm = scorer.use_trig, scorer.use_norm
        self.offset_aggregation = scorer.offset_aggregation

    def _dense_weights(self, t: np.ndarray, offset: float | None) -> mx.array:
        """[L, b, Hkv, D, G] float32 so that keys @ W = Re(mu e^{i w t} c conj(k)) / s per query head."""
        angle = t.astype(np.float64)[:, None] * self.omega[None, :]  # [b, F]
        rotation = np.exp(1j * angle) * (self.fold if offset is None else np.exp(1j * self.omega * offset))
        coefficient = self.q_mean[:, None] * rotation[None, :, None, :]  # [L, b, Hq, F]
        L, b, Hq, _ = coefficient.shape
        dense = np.zeros((L, b, Hq, self.head_dim))
        dense[..., self.real_np] = coefficient.real
        dense[..., self.imag_np] = coefficient.imag
        dense = dense.reshape(L, b, self.num_kv_heads, self.group, self.head_dim).transpose(0, 1, 2, 4, 3)
        return mx.array(dense.astype(np.float32))

    def per_query_head(self, keys: mx.array, t: np.ndarray) -> mx.array:
        """[L, b, Hkv, G, N] float32 scores of every query head."""
        L, b, Hkv, N, D = keys.shape
        keys = keys.astype(mx.float32)
        score = mx.zeros((L, b, Hkv, N, self.group), dtype=mx.float32)
        if self.use_norm:
            real, imag = mx.take(keys, self.real_index, axis=-1), mx.take(keys, self.imag_index, axis=-1)
            score = score + mx.sqrt(real * real + imag * imag) @ self.norm_weight[:, None]  # [L, b, Hkv, N, G]
        if self.use_trig:
            if self.offset_aggregation == "mean":
                score = score + keys @ self._dense_weights(t, None)
            else:  # max over offsets of S_trig(o) (S_norm does not depend on the offset)
                per_offset = mx.stack([keys @ self._dense_weights(t, float(o)) for o in self.offsets])
                score = score + per_offset.max(0)
        return score.transpose(0, 1, 2, 4, 3)

    def score(self, keys: mx.array, positions: mx.array, candidates: mx.array, t: np.ndarray, budget: int) -> mx.array:
        policy = self.policy
        per_head = self.per_query_head(keys, t)
        if policy.normalize:
            per_head = zscore(per_head, candidates[:, :, :, None, :])
        if policy.union_selection:
            scores = _union_scores(per_head, candidates, budget)
        else:
            scores = per_head.max(3) if policy.group_aggregation == "max" else per_head.mean(3)
            if policy.shared_across_layers:
                scores = mx.broadcast_to(scores.mean(0, keepdims=True), scores.shape)
        if isinstance(policy, TriAttentionDedup):
            if policy.normalize:
                scores = zscore(scores, candidates)
            if policy.redundancy_weight != 0.0:
                similar = mean_similarity(keys, positions, policy.similarity_threshold)
                scores = scores - policy.redundancy_weight * zscore(similar, candidates)
        return scores


def _union_scores(per_head: mx.array, candidates: mx.array, budget: int) -> mx.array:
    """`TriAttention._union_scores`: every query head nominates its top-B; one ranking for all layers and heads."""
    L, b, Hkv, G, N = per_head.shape
    masked = mx.where(candidates[:, :, :, None, :], per_head, -mx.inf)
    by_row = masked.transpose(1, 0, 2, 3, 4).reshape(b, L * Hkv * G, N)
    k = min(budget, N)
    top = mx.argpartition(-by_row, kth=k - 1, axis=-1)[..., :k]
    nominated = mx.put_along_axis(mx.zeros(by_row.shape, dtype=mx.bool_), top, mx.array(True), axis=-1)
    combined = by_row.max(1)  # [b, N]
    in_union = nominated.any(1) & mx.isfinite(combined)
    rank = mx.argsort(mx.argsort(-combined, axis=-1), axis=-1)  # 0 = best
    ranking = mx.where(in_union, 2 * N - rank, N - rank).astype(mx.float32)
    ranking = mx.where(mx.isfinite(combined), ranking, -mx.inf)
    return mx.broadcast_to(ranking[None, :, None, :], (L, b, Hkv, N))


def mean_similarity(keys: mx.array, positions: mx.array, threshold: float, limit: int = 1 << 23) -> mx.array:
    """`trikv.policies.rkv.mean_similarity` in MLX: each key's mean cosine similarity to the other live keys of its
    (layer, row, KV head), the newest near-duplicate (> threshold) of each row exempted; a few layers at a time."""
    L, b, Hkv, N, D = keys.shape
    step = max(1, limit // max(b * Hkv * N * N, 1))
    eye = mx.eye(N, dtype=mx.bool_)
    columns = mx.arange(N)
    parts = []
    for start in range(0, L, step):
        k = keys[start:start + step].astype(mx.float32)
        position = positions[start:start + step]
        live = position >= 0
        unit = k / (mx.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
        similarity = unit @ unit.swapaxes(-1, -2)  # [l, b, Hkv, N, N]
        pair = live[..., :, None] & live[..., None, :] & ~eye
        similarity = similarity * pair
        near = similarity > threshold
        recency = mx.where(near, position[..., None, :].astype(mx.float32), -1.0)
        newest = mx.argmax(recency, axis=-1, keepdims=True)  # [l, b, Hkv, N, 1]
        zero = (columns == newest) & near.any(-1, keepdims=True)
        similarity = mx.where(zero, 0.0, similarity)
        rows = mx.maximum(live.sum(-1, keepdims=True), 1)
        parts.append(similarity.sum(-2) / rows)
    return mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


class StreamingScorer:
    """StreamingLLM: the sinks (positions < sinks) first, then the newest tokens."""

    def __init__(self, policy: StreamingLLM):
        self.policy = policy

    def score(self, keys, positions, candidates, t, budget) -> mx.array:
        return mx.where(positions < self.policy.sinks, mx.inf, positions.astype(mx.float32))


class KnormScorer:
    """KnormPress: the keys with the smallest L2 norm."""

    def __init__(self, policy: KnormPress):
        self.policy = policy

    def score(self, keys, positions, candidates, t, budget) -> mx.array:
        return -mx.linalg.norm(keys.astype(mx.float32), axis=-1)


class RandomScorer:
    """Random eviction: the keyed permutation of positions of `trikv.policies.random_eviction`, in NumPy (the same
    integers as the torch path)."""

    def __init__(self, policy: RandomEviction):
        self.policy = policy

    def score(self, keys, positions, candidates, t, budget) -> mx.array:
        L, _, Hkv, _ = positions.shape
        heads = np.array([[head_key(self.policy.seed, layer, head) for head in range(Hkv)] for layer in range(L)],
                         dtype=np.int64)[:, None, :, None]
        return mx.array(random_scores(np.maximum(np.array(positions, dtype=np.int64), 0), heads).astype(np.float32))


def make_scorer(policy):
    """The MLX scorer of a bound key-only policy (TriAttention's family, StreamingLLM, KnormPress)."""
    if isinstance(policy, TriAttention):
        return TriAttentionScorer(policy)
    if isinstance(policy, StreamingLLM):
        return StreamingScorer(policy)
    if isinstance(policy, KnormPress):
        return KnormScorer(policy)
    if isinstance(policy, RandomEviction):
        return RandomScorer(policy)
    raise ValueError(f"method {policy.name!r} has no MLX scorer")


def kept_indices(scores: mx.array, budget: int) -> mx.array:
    """[L, b, Hkv, B] int32: slot indices of the `budget` highest scores of every (layer, row, KV head), in slot
    order (protected entries score +inf). The same set as `trikv.selection.top_entries` up to exact ties."""
    N = scores.shape[-1]
    if budget >= N:
        return mx.broadcast_to(mx.arange(N, dtype=mx.int32), scores.shape)
    top = mx.argpartition(-scores, kth=budget - 1, axis=-1)[..., :budget]
    return mx.sort(top, axis=-1).astype(mx.int32)
