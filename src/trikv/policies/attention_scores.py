"""Shared pieces of the attention-based baselines: q·Kᵀ for a few recent queries, GQA without copies.

Every function works on all layers at once ([L, b, H, ...] tensors) and never expands KV heads to query
heads (`repeat_kv`): the G query heads of a KV head are folded into the query axis of one matmul, so the
only extra memory is the [L, b, Hq, w, N] logits of the w window queries (chunked over layers when large).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from ..architectures import ModelShape, attention_modules, attention_sinks
from .base import Policy

# logits of at most this many elements are materialised at once (chunks of layers / queries)
MAX_ELEMENTS = 1 << 24


def attention_scaling(model: torch.nn.Module, head_dim: int) -> float:
    """The softmax scale the model's attention uses (`module.scaling`; 1/sqrt(head_dim) otherwise)."""
    module = attention_modules(model)[0]
    return float(getattr(module, "scaling", head_dim**-0.5))


def layer_chunks(num_layers: int, elements_per_layer: int, limit: int = MAX_ELEMENTS) -> Iterator[slice]:
    """Slices of layers whose intermediate tensors stay under `limit` elements (at least one layer each)."""
    step = max(1, limit // max(1, elements_per_layer))
    for start in range(0, num_layers, step):
        yield slice(start, min(num_layers, start + step))


def grouped_logits(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scaled logits per query head: queries [L, b, Hq, w, D], keys [L, b, Hkv, N, D] -> [L, b, Hkv, G, w, N] fp32.

    The G heads of a group share the KV head's keys through one matmul of [G*w, D] x [D, N] (no repeat_kv).
    """
    L, b, Hq, w, D = queries.shape
    Hkv, N = keys.shape[2], keys.shape[3]
    G = Hq // Hkv
    q = queries.reshape(L, b, Hkv, G * w, D).to(keys.dtype)
    logits = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling
    return logits.view(L, b, Hkv, G, w, N)


def visibility(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[L, b, Hkv, 1, w, N] bool: key is live (position >= 0), query is real, and key position <= query position."""
    q = query_positions[None, :, None, None, :, None]  # [1, b, 1, 1, w, 1]
    k = key_positions[:, :, :, None, None, :]  # [L, b, Hkv, 1, 1, N]
    return (k >= 0) & (q >= 0) & (k <= q)


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last axis restricted to `mask`; exactly 0 off the mask and on fully masked rows.

    sink: a logit (broadcastable to logits[..., :1]) added to the denominator and dropped, as GPT-OSS's
    attention sinks are: the probabilities of the keys then sum to less than 1."""
    logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    if sink is None:
        return torch.softmax(logits, dim=-1) * mask
    sink = sink.to(logits.dtype).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1] * mask


def group_sinks(sinks: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor | None:
    """Sink logits [l, Hq] as [l, 1, Hkv, G, 1, 1], to broadcast against grouped logits."""
    if sinks is None:
        return None
    l, Hq = sinks.shape
    return sinks.view(l, 1, num_kv_heads, Hq // num_kv_heads, 1, 1)


def window_probabilities(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    key_mask: torch.Tensor | None = None,
    group: str = "sum",
    sinks: torch.Tensor | None = None,
) -> Iterator[tuple[slice, torch.Tensor]]:
    """Attention probabilities of the window queries over the cached keys, per layer chunk.

    Each query's softmax runs over the keys it can see (live, causal) and, when given, inside `key_mask`
    [L, b, Hkv, N]. `group` decides how the G query heads of a KV head are combined:
      "none"      -> [l, b, Hkv, G, w, N] per query head;
      "sum"/"mean"-> probabilities summed / averaged over the group, [l, b, Hkv, w, N];
      "max_logit" -> one softmax of the max over the group of the logits (R-KV, TriAttention's SnapKV port).
    `sinks` [L, Hq]: the model's attention-sink logits (GPT-OSS), added to every softmax denominator ("max_logit"
    takes the group's largest sink, as it takes the group's largest logit).
    Yields (layer slice, probabilities); queries and keys of padding/empty slots give zero rows.
    """
    L, b, Hq, w, D = queries.shape
    Hkv, N = keys.shape[2], keys.shape[3]
    for layers in layer_chunks(L, b * Hq * w * N):
        logits = grouped_logits(queries[layers], keys[layers], scaling)
        mask = visibility(query_positions, key_positions[layers])
        if key_mask is not None:
            mask = mask & key_mask[layers][:, :, :, None, None, :]
        sink = group_sinks(None if sinks is None else sinks[layers].to(logits.device), Hkv)  # [l, 1, Hkv, G, 1, 1]
        if group == "max_logit":
            masked = logits.masked_fill(~mask, torch.finfo(logits.dtype).min).amax(3)
            probs = masked_softmax(masked, mask.squeeze(3), None if sink is None else sink.amax(3))
        else:
            probs = masked_softmax(logits, mask, sink)
            if group == "sum":
                probs = probs.sum(3)
            elif group == "mean":
                probs = probs.mean(3)
            elif group != "none":
                raise ValueError(f"unknown group aggregation {group!r}")
        yield layers, probs


def pool1d(scores: torch.Tensor, kernel_size: int, mode: str = "max", positions: torch.Tensor | None = None) -> torch.Tensor:
    """Smooth scores [..., N] over neighbouring tokens (stride 1, same length), as SnapKV / R-KV / RPC do.

    With `positions` [..., N] the neighbours are the live entries (position >= 0) in position order, so dead
    slots that variable budgets or batch schedules leave in the buffer never sit between two tokens; dead
    entries act like the zero padding at the ends. Without it, neighbours are physical slots.
    """
    if kernel_size <= 1:
        return scores
    if kernel_size % 2 == 0:
        raise ValueError(f"pooling kernel must be odd, got {kernel_size}")
    if positions is not None:
        live = positions >= 0
        order = torch.where(live, positions, positions.new_full((), torch.iinfo(positions.dtype).max)).argsort(-1)
        ordered = scores.gather(-1, order).masked_fill(~live.gather(-1, order), 0.0)
        pooled = pool1d(ordered, kernel_size, mode)
        return torch.empty_like(pooled).scatter_(-1, order, pooled)
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    if mode == "max":
        pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    elif mode == "avg":
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        raise ValueError(f"pooling must be 'max' or 'avg', got {mode!r}")
    return pooled.reshape(shape)


def query_chunks(num_queries: int, elements_per_query: int, limit: int = MAX_ELEMENTS) -> Iterator[slice]:
    """Slices of queries whose logits stay under `limit` elements (prefill observation of long prompts)."""
    step = max(1, limit // max(1, elements_per_query))
    for start in range(0, num_queries, step):
        yield slice(start, min(num_queries, start + step))


def tie_broken_ranks(scores: torch.Tensor, positions: torch.Tensor, joint_dims: int = 1) -> torch.Tensor:
    """Ranks (float, 0 = lowest) over the last `joint_dims` axes; equal scores rank the newer token higher.

    Pooled attention has plateaus and far keys get exactly zero probability, so ties are common; ranking
    them by position makes the selection independent of the physical slot layout (dead slots, batch
    schedules) and of top-k's tie order. Exact in fp32 below 2^24 entries.
    """
    shape = scores.shape
    flat_scores, flat_positions = scores.flatten(-joint_dims), positions.flatten(-joint_dims)
    order = flat_positions.argsort(dim=-1, stable=True)
    order = order.gather(-1, flat_scores.gather(-1, order).argsort(dim=-1, stable=True))
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks.float().view(shape)


class QueryAttentionPolicy(Policy):
    """Base of the baselines that score with the attention of recent queries (declare `query_window`).

    Subclasses implement `importance(context)` (the method's own score); `score` returns its ranks with
    ties broken towards the newer token, over each (layer, row, KV head), or over the whole layer when
    `rank_heads_jointly` (scores compared across heads, Ada-KV).
    """

    rank_heads_jointly = False
    sinks = None  # [L, Hq] attention-sink logits of the bounded layers (GPT-OSS), set by `bind`

    def importance(self, context) -> torch.Tensor:
        raise NotImplementedError

    def score(self, context) -> torch.Tensor:
        raw = self.importance(context).float()
        return tie_broken_ranks(raw, context.positions, 2 if self.rank_heads_jointly else 1)

    def bind(self, model: torch.nn.Module, shape: ModelShape) -> None:
        self.shape = shape
        self.scaling = attention_scaling(model, shape.head_dim)
        # GPT-OSS's attention sinks of the bounded layers: in every softmax denominator the method computes
        self.sinks = attention_sinks(model, shape.cached_layers)

    def _scheduled(self, divide_length: int, paper_divide_length: int) -> int:
        """The slack of the chosen schedule: "shared" (the cache's, the default) or "paper"."""
        schedule = getattr(self, "schedule", "shared")
        if schedule == "shared":
            return divide_length
        if schedule == "paper":
            return paper_divide_length
        raise ValueError(f"{self.name}: schedule must be 'shared' or 'paper', got {schedule!r}")

    def _require_queries(self, context) -> None:
        if context.queries is None or context.query_positions is None:
            raise RuntimeError(
                f"{self.name} scores with recent queries but the cache recorded none; "
                "use it through trikv.make_cache / CompressedCache"
            )


class SlotStatePolicy(QueryAttentionPolicy):
    """A query-attention policy whose per-slot statistics (`self.state`, a SlotState set up by the subclass)
    follow the cache's slots through rounds, batch-row selections and resets (H2O, LazyEviction, RaaS)."""

    def after_round(self, order: torch.Tensor) -> None:
        self.state.follow(order)

    def select_rows(self, index: torch.Tensor) -> None:
        self.state.select_rows(index)

    def reset(self) -> None:
        self.state.reset()


@dataclass
class ObservationWindowPolicy(QueryAttentionPolicy):
    """A policy scored by the attention of the last `window_size` queries, whose tokens it also protects
    (SnapKV, R-KV and the methods built on them)."""

    scores_rows_independently = True

    window_size: int = 8

    def __post_init__(self):
        if self.window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {self.window_size}")

    @property
    def query_window(self) -> int:
        return self.window_size

    @property
    def recent_window(self) -> int:
        return self.window_size


class SlotState:
    """Per-slot statistics [L, b, Hkv, S] that follow the cache's slots (appends, rounds, row selection).

    Buffers are preallocated and grow geometrically, so a bounded cache stops reallocating after its first
    round. `cover(positions, inits)` extends every named buffer over the slots appended since the last call
    (new slots get `inits[name](their positions)`); `state[name]` is the live view [L, b, Hkv, N];
    `follow(order)` applies a round's slot map.
    """

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.length = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name][..., : self.length]

    def cover(self, positions: torch.Tensor, inits: dict) -> None:
        """Extend the state over every slot of `positions` [L, b, Hkv, N]."""
        N = positions.shape[-1]
        if self.buffers and next(iter(self.buffers.values())).shape[:3] != positions.shape[:3]:
            raise RuntimeError("policy state does not match the cache's layers / rows / heads")
        if N <= self.length and self.buffers:
            return
        have = self.length if self.buffers else 0
        new_positions = positions[..., have:N]
        for name, init in inits.items():
            fresh = init(new_positions)
            buffer = self.buffers.get(name)
            if buffer is None or buffer.shape[-1] < N:
                grown = fresh.new_zeros(*positions.shape[:3], max(N, 2 * have, 64))
                if buffer is not None:
                    grown[..., :have] = buffer[..., :have]
                buffer = self.buffers[name] = grown
            buffer[..., have:N] = fresh
        self.length = N

    def follow(self, order: torch.Tensor) -> None:
        """New slot i takes old slot order[..., i]; the state must cover every old slot."""
        if not self.buffers:
            return
        if bool((order >= self.length).any()):
            raise RuntimeError("policy state is behind the cache (slots were never scored or observed)")
        P = order.shape[-1]
        for name, buffer in self.buffers.items():
            kept = buffer[..., : self.length].gather(-1, order)
            if buffer.shape[-1] < P:
                buffer = self.buffers[name] = kept.new_zeros(*kept.shape[:3], P)
            buffer[..., :P] = kept
        self.length = P

    def select_rows(self, index: torch.Tensor) -> None:
        for name, buffer in self.buffers.items():
            self.buffers[name] = buffer.index_select(1, index.to(buffer.device))

    def reset(self) -> None:
        self.buffers.clear()
        self.length = 0
