"""Post-RoPE queries for baselines that score with attention (H2O, SnapKV, R-KV, TOVA, ...).

The model keeps computing attention with its own fast kernel (SDPA); trikv never switches it to eager to
read probabilities. Instead the model's `apply_rotary_pos_emb` is wrapped once per modeling module: while a
trikv cache that wants queries is running a forward, the wrapper parks the rotated query of the current
attention call, and the cache's `update()` (called right after the rotation, in the same attention call)
takes it and writes the last `w` tokens' queries into a preallocated ring buffer [L, b, Hq, w, D].
Policies then compute q·Kᵀ for that window only. Outside trikv forwards the wrapper only forwards the call.

Cost: one reference assignment per layer per forward, plus a [b, Hq, min(q, w), D] copy into the ring.
Memory: L·b·Hq·w·D elements in the model dtype (SmolLM2-135M, w = 8, fp32: 0.55 MB); it is reported by
`QueryWindow.nbytes`.
"""

from __future__ import annotations

import torch

from .architectures import modeling_module

_TAP_MARK = "_trikv_query_tap"


class _Tap:
    wanted = False  # a trikv cache that records queries is inside a forward
    query: torch.Tensor | None = None  # the rotated query of the attention call in progress


def want_queries(flag: bool) -> None:
    """Start (True) or stop (False) parking rotated queries for the cache whose forward is running."""
    _Tap.wanted = flag
    if not flag:
        _Tap.query = None


def take_query() -> torch.Tensor | None:
    """The rotated query of the current attention call, once (None if the tap did not see one)."""
    query, _Tap.query = _Tap.query, None
    return query


def install_query_tap(model: torch.nn.Module) -> None:
    """Wrap the model's modeling-module `apply_rotary_pos_emb` (once; the wrapper is permanent and cheap)."""
    module = modeling_module(model)
    current = module.apply_rotary_pos_emb
    if getattr(current, _TAP_MARK, False):
        return

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        q_embed, k_embed = current(q, k, cos, sin, *args, **kwargs)
        if _Tap.wanted:
            _Tap.query = q_embed
        return q_embed, k_embed

    setattr(apply_rotary_pos_emb, _TAP_MARK, True)
    apply_rotary_pos_emb.__wrapped__ = current
    module.apply_rotary_pos_emb = apply_rotary_pos_emb


class QueryWindow:
    """Ring buffer of the post-RoPE queries of the last `size` tokens, for every layer.

    Slot of the token with logical index i (padding included) is i % size, so one forward writes the same
    slots in every layer and row. `positions[b, s]` is the RoPE position of the query in slot s of row b
    (-1: empty, or a padding token).
    """

    def __init__(self, size: int, num_layers: int):
        if size < 1:
            raise ValueError(f"query window must be >= 1, got {size}")
        self.size, self.num_layers = size, num_layers
        self.queries: torch.Tensor | None = None  # [L, b, Hq, w, D]
        self.positions: torch.Tensor | None = None  # [b, w] long

    @property
    def nbytes(self) -> int:
        return 0 if self.queries is None else self.queries.nbytes + self.positions.nbytes

    def record(self, layer: int, query: torch.Tensor, positions: torch.Tensor, first_index: int) -> None:
        """query [b, Hq, q, D] of tokens with logical indices first_index.., positions [b, q] (RoPE, -1 pads)."""
        b, heads, q, d = query.shape
        if self.queries is None or self.queries.shape[1] != b:
            self.queries = query.new_zeros(self.num_layers, b, heads, self.size, d)
            self.positions = torch.full((b, self.size), -1, dtype=torch.long, device=query.device)
        if q == 1:  # decoding: one slot, plain copies
            slot = first_index % self.size
            self.queries[layer, :, :, slot] = query[:, :, 0]
            if layer == 0:
                self.positions[:, slot] = positions[:, 0]
            return
        keep = min(q, self.size)
        slots = torch.arange(first_index + q - keep, first_index + q, device=query.device) % self.size
        self.queries[layer].index_copy_(2, slots, query[:, :, q - keep :])
        if layer == 0:
            self.positions.index_copy_(1, slots, positions[:, q - keep :])

    def latest(self, count: int, next_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [L, b, Hq, count, D] and positions [b, count] of the last `count` tokens (count <= size)."""
        slots = torch.arange(next_index - count, next_index, device=self.queries.device) % self.size
        if count == 1:
            s = int(slots[0])
            return self.queries[:, :, :, s : s + 1], self.positions[:, s : s + 1]
        return self.queries.index_select(3, slots), self.positions.index_select(1, slots)

    def select_rows(self, index: torch.Tensor) -> None:
        if self.queries is not None:
            index = index.to(self.queries.device)
            self.queries = self.queries.index_select(1, index)
            self.positions = self.positions.index_select(0, index)

    def reset(self) -> None:
        self.queries = self.positions = None
