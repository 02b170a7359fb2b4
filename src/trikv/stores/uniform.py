"""Uniform layout: one buffer for all layers, every (layer, row, KV head) with the same physical length.

    keys, values [L, b, Hkv, capacity, D]   post-RoPE keys and values
    positions    [L, b, Hkv, capacity]      RoPE position of every slot, -1 = dead (padding, evicted filler)
    biases       [L, b, Hkv, capacity]      float32 log-bias per slot (only for compacting policies)

All layers, rows and heads hold the same number of slots P (`length`), so transformers' stock masks stay
valid, but each (layer, row, KV head) keeps its own tokens. A row that keeps fewer entries than P (padding,
a row compressed before the others) holds dead slots, which trikv's attention functions mask.

Buffers start small and double as the sequence grows, up to the capacity the schedule asks for (budget +
divide_length for a bounded cache), the single allocation the store then keeps: a round compacts the kept
slots in place, layer by layer.
"""

from __future__ import annotations

import torch

from ..fast import compact_slots_, gather_slots
from .base import StoreView

INITIAL_SLOTS = 256  # slots per (layer, row, KV head) allocated at the first forward; buffers double from there


class UniformStore:
    """Keys and values of all layers in one [L, b, Hkv, capacity, D] buffer (see module doc)."""

    layout = "uniform"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, with_biases: bool = False):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.with_biases = with_biases  # a compacting policy rewrites values and gives entries log-biases
        self.reset()

    def reset(self) -> None:
        self.keys: torch.Tensor | None = None  # [L, b, Hkv, capacity, D]
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [L, b, Hkv, capacity] long, -1 = dead
        self.biases: torch.Tensor | None = None  # [L, b, Hkv, capacity] float32
        self.length = 0  # physical slots P per (layer, row, head)
        self.peak_length = 0
        self.write_at = 0  # first slot of the forward being written
        self.has_dead_slots = False  # some stored slot is dead (attention must mask)
        self.has_bias = False  # some live slot carries a nonzero bias (attention must add them)
        self._dead_state = None

    # ---- sizes --------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]

    @property
    def batch_size(self) -> int:
        return -1 if self.keys is None else self.keys.shape[1]

    @property
    def device(self) -> torch.device | None:
        return None if self.keys is None else self.keys.device

    def entries(self) -> int:
        return self.length

    def memory_bytes(self) -> int:
        """Bytes of live slots: entries x layers x rows x heads x head_dim x 2 x element size (+ biases)."""
        if self.keys is None:
            return 0
        L, b, h, _, d = self.keys.shape
        bias_bytes = 0 if self.biases is None else L * b * h * self.length * self.biases.element_size()
        return 2 * L * b * h * self.length * d * self.keys.element_size() + bias_bytes

    def peak_memory_bytes(self) -> int:
        return self.memory_bytes() * self.peak_length // max(self.length, 1)  # every slot costs the same

    def allocated_bytes(self) -> int:
        if self.keys is None:
            return 0
        bias_bytes = 0 if self.biases is None else self.biases.nbytes
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes + bias_bytes

    def stored_keys(self, layer: int) -> torch.Tensor | None:
        return None if self.keys is None else self.keys[layer, :, :, : self.length]

    def stored_values(self, layer: int) -> torch.Tensor | None:
        return None if self.values is None else self.values[layer, :, :, : self.length]

    def visible_positions(self) -> torch.Tensor:
        return self.positions[:, :, :, : self.length]

    def live_counts(self) -> torch.Tensor:
        L, _, h = self.positions.shape[:3]
        return (self.positions[:, :, :, : self.length] >= 0).sum(dim=(0, 2, 3)) // (L * h)

    def scoring_view(self) -> StoreView:
        n = self.length
        return StoreView(
            keys=self.keys[:, :, :, :n],
            values=self.values[:, :, :, :n],
            positions=self.positions[:, :, :, :n],
            biases=None if self.biases is None else self.biases[:, :, :, :n],
        )

    # ---- allocation ---------------------------------------------------------------------------------
    def _allocate(self, batch: int, dtype, device, capacity: int) -> None:
        L, h, d = self.num_layers, self.num_kv_heads, self.head_dim
        self.keys = torch.zeros(L, batch, h, capacity, d, dtype=dtype, device=device)
        self.values = torch.zeros(L, batch, h, capacity, d, dtype=dtype, device=device)
        self.positions = torch.full((L, batch, h, capacity), -1, dtype=torch.long, device=device)
        if self.with_biases:
            self.biases = torch.zeros(L, batch, h, capacity, dtype=torch.float32, device=device)

    def _grow(self, needed: int, target: int | None) -> None:
        """Double (never below `needed`); a bounded store stops at `target`, the single allocation it then keeps
        (a long prompt chunk may exceed it until the first round)."""
        capacity = max(needed, 2 * self.capacity)
        if target is not None:
            capacity = max(needed, min(capacity, target))
        old = (self.keys, self.values, self.positions, self.biases)
        self._allocate(self.keys.shape[1], self.keys.dtype, self.keys.device, capacity)
        n = self.length
        for new, previous in zip((self.keys, self.values, self.positions, self.biases), old):
            if previous is not None:
                new[:, :, :, :n] = previous[:, :, :, :n]

    def reserve(self, entries: int, batch: int, dtype: torch.dtype, device, target: int | None) -> None:
        if self.keys is None:
            self._allocate(batch, dtype, device, max(entries, target or 0))
        elif entries > self.capacity:
            self._grow(entries, target)

    # ---- a forward --------------------------------------------------------------------------------
    def begin(self, new_positions: torch.Tensor, dtype, device, target: int | None, writes_padding: bool) -> None:
        """Make room for the q tokens of a forward (new_positions [b, q], -1 on padding) in every layer."""
        b, q = new_positions.shape
        if self.keys is None:  # start small: a huge budget costs nothing until the sequence needs it
            self._allocate(b, dtype, device, max(q, min(target or INITIAL_SLOTS, INITIAL_SLOTS)))
        elif self.length + q > self.capacity:
            self._grow(self.length + q, target)
        self.positions[:, :, :, self.length : self.length + q] = new_positions[None, :, None, :]
        if self.biases is not None:  # new tokens carry no bias
            self.biases[:, :, :, self.length : self.length + q] = 0
        self.write_at = self.length
        self.length += q
        self.peak_length = max(self.peak_length, self.length)
        self.has_dead_slots = self._dead_slots_after_append(q, writes_padding)

    def _dead_slots_after_append(self, q: int, writes_padding: bool) -> bool:
        """Scan the positions only after a structural change (a round, new buffers, row selection): plain
        appends add dead slots only while padding is written (no host-device sync per decode step)."""
        state = (id(self.positions), self.length - q)
        if self._dead_state == state:
            dead = self.has_dead_slots or writes_padding
        else:
            dead = bool((self.positions[:, :, :, : self.length] < 0).any())
        self._dead_state = (id(self.positions), self.length)
        return dead

    def append(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write one layer's keys/values [b, Hkv, q, D]; returns the layer's stored keys and values and the state
        trikv's attention reads (dead-slot mask, biases)."""
        q = key_states.shape[-2]
        start, end = self.write_at, self.write_at + q
        self.keys[layer, :, :, start:end] = key_states
        self.values[layer, :, :, start:end] = value_states
        state = {
            "trikv_active": True,
            "trikv_valid": self.positions[layer, :, :, :end] >= 0 if self.has_dead_slots else None,
            "trikv_bias": self.biases[layer, :, :, :end] if self.has_bias else None,
        }
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end], state

    # ---- a round ----------------------------------------------------------------------------------
    def kept_order(self, keep: torch.Tensor) -> torch.Tensor:
        """[L, b, Hkv, P'] slot indices of the kept entries of every (layer, row, head) in original order, P' =
        the largest kept count; heads that keep fewer are padded with (dead) fillers."""
        new_length = int(keep.sum(-1).max())
        if bool((keep.sum(-1) == new_length).all()):  # no fillers: the kept slots in order, no sort
            return keep.nonzero()[:, -1].view(*keep.shape[:3], new_length)
        # top new_length of "keep" picks exactly the kept entries plus dead fillers; sorted = original order
        return keep.float().topk(new_length, dim=-1, sorted=False).indices.sort(dim=-1).values

    def retain(self, keep: torch.Tensor, capacity: int, values: torch.Tensor | None = None,
               biases: torch.Tensor | None = None) -> torch.Tensor:
        """Keep what `keep` [L, b, Hkv, N] marks, in original order, in buffers of `capacity` slots; `values`
        [L, b, Hkv, N, D] / `biases` [L, b, Hkv, N] replace the stored ones first (a compacting policy's rewrite).
        Returns the kept slots' old indices [L, b, Hkv, P'] (per-slot policy state follows them)."""
        order = self.kept_order(keep)
        new_length = order.shape[-1]
        kept = keep.gather(3, order)
        kept_positions = self.positions[:, :, :, : keep.shape[-1]].gather(3, order).masked_fill(~kept, -1)
        in_place = values is None and self.biases is None and self.capacity == capacity
        if in_place:  # no cache-sized allocation per round
            compact_slots_(self.keys, order)
            compact_slots_(self.values, order)
        else:
            kept_keys = gather_slots(self.keys, order)
            kept_values = gather_slots(self.values if values is None else values.to(self.values.dtype).contiguous(), order)
        kept_biases = None
        if self.biases is not None:
            source = self.biases[:, :, :, : keep.shape[-1]] if biases is None else biases.float()
            kept_biases = source.gather(3, order).masked_fill(~kept, 0.0)
        if self.capacity != capacity:  # shrink once after a long prompt
            self._allocate(self.keys.shape[1], self.keys.dtype, self.keys.device, capacity)
        if not in_place:
            self.keys[:, :, :, :new_length] = kept_keys
            self.values[:, :, :, :new_length] = kept_values
        self.positions[:, :, :, :new_length] = kept_positions
        if self.biases is not None:
            self.biases[:, :, :, :new_length] = kept_biases
            self.biases[:, :, :, new_length:] = 0
            self.has_bias = bool(kept_biases.ne(0).any())
        self.length = new_length
        self._dead_state = None  # rescan for dead slots at the next forward
        return order

    def select_rows(self, index: torch.Tensor) -> None:
        if self.keys is None:
            return
        self.keys = self.keys.index_select(1, index)
        self.values = self.values.index_select(1, index)
        self.positions = self.positions.index_select(1, index)
        if self.biases is not None:
            self.biases = self.biases.index_select(1, index)
        self._dead_state = None
