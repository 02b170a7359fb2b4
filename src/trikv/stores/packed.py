"""Packed layout: layers and heads that keep different numbers of entries, stored without padding.

PyramidKV gives deeper layers fewer entries, Ada-KV gives the heads of a layer different shares of the
layer's Hkv x budget. In the uniform layout every (layer, head) has the same physical length, so such
policies would keep dead slots. Here each layer owns a *region*: one axis of slots shared by all its KV
heads, each slot tagged with its KV head and RoPE position.

    region_keys[l]      [b, capacity_l, D]  keys of every head of layer l, in one axis
    region_positions[l] [b, capacity_l]     RoPE position of each slot, -1 = dead
    region_heads[l]     [b, capacity_l]     KV head of each slot (int8)
    region_bias[l]      [b, capacity_l, Hkv] 0 where the slot is a live entry of that KV head, else the dtype's
                                             minimum: the decode attention mask, kept up to date as slots change

A forward appends one slot per (token, KV head) at the end of each region. Attention reads a region as a
single multi-query head and masks other heads' slots (`attention.packed_attention`). For a round the store
unpacks every layer into the [L, b, Hkv, N] view policies score (N = the most entries any head holds), and
`retain` rewrites every region as its kept slots, head-major and in position order, followed by room for the
slots the next tokens add. So after a round a region holds exactly what its heads keep, and the allocation is
that plus the slack: L x Hkv x (budget + divide_length) slots in all, the same as a uniform cache, however
the policy spreads them.
"""

from __future__ import annotations

import math

import torch

from .base import StoreView


class PackedStore:
    """Per-layer regions of (token, KV head) slots (see module doc)."""

    layout = "packed"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, divide_length: int):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.divide_length = divide_length  # tokens of room a full region grows by
        self.reset()

    def reset(self) -> None:
        self.region_keys: list[torch.Tensor] = []  # per layer [b, capacity_l, D]
        self.region_values: list[torch.Tensor] = []
        self.region_positions: list[torch.Tensor] = []  # per layer [b, capacity_l] long, -1 = dead
        self.region_heads: list[torch.Tensor] = []  # per layer [b, capacity_l] int8
        self.region_bias: list[torch.Tensor] = []  # per layer [b, capacity_l, Hkv], model dtype
        self.region_length: list[int] = []  # used slots per layer (the same for every row)
        self.length = 0  # entries per (layer, row, head) the schedule counts: the most any head holds
        self.peak_length = 0
        self.peak_bytes = 0
        self._head_pattern: torch.Tensor | None = None  # [Hkv * q] KV head of the slots one forward appends
        self._unpacking = None  # (per-layer slot index, width) of the last scoring view

    # ---- sizes --------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.region_keys[0].shape[0] if self.region_keys else -1

    @property
    def device(self) -> torch.device | None:
        return self.region_keys[0].device if self.region_keys else None

    @property
    def capacity(self) -> int:
        """Slots allocated, summed over layers, per row and KV head (mean)."""
        return sum(k.shape[1] for k in self.region_keys) // (self.num_layers * self.num_kv_heads)

    def _slot_bytes(self) -> int:
        """K + V bytes of one slot of one row."""
        return 2 * self.head_dim * self.region_keys[0].element_size()

    def memory_bytes(self) -> int:
        """Bytes of K/V in used slots (after a round: exactly the entries each head keeps)."""
        if not self.region_keys:
            return 0
        return sum(self.region_length) * self.batch_size * self._slot_bytes()

    def allocated_bytes(self) -> int:
        """Bytes the regions occupy, spare slots and per-slot position / head tags included."""
        return sum(t.nbytes for group in self._regions() for t in group)

    def peak_memory_bytes(self) -> int:
        return max(self.peak_bytes, self.memory_bytes())

    def entries(self) -> int:
        """Used slots per (layer, row, KV head), averaged over layers and heads (rounded up)."""
        if not self.region_keys:
            return 0
        return math.ceil(sum(self.region_length) / (self.num_layers * self.num_kv_heads))

    def stored_keys(self, layer: int) -> torch.Tensor | None:
        """[b, 1, S, D]: layer's region (slots of every KV head; `region_heads` tells which)."""
        return self.region_keys[layer][:, None, : self.region_length[layer]] if self.region_keys else None

    def stored_values(self, layer: int) -> torch.Tensor | None:
        return self.region_values[layer][:, None, : self.region_length[layer]] if self.region_keys else None

    def live_counts(self) -> torch.Tensor:
        L, h = self.num_layers, self.num_kv_heads
        live = sum((p[:, :n] >= 0).sum(-1) for p, n in zip(self.region_positions, self.region_length))
        return live // (L * h)

    def visible_positions(self) -> torch.Tensor:
        """[L, b, Hkv, N] positions per (layer, row, KV head) in slot order, -1 past a head's entries."""
        slot_index, width = self._unpack_plan()
        return torch.stack([self._unpack(l, self.region_positions[l], slot_index[l], width, -1) for l in range(self.num_layers)])

    def scoring_view(self) -> StoreView:
        """Every layer unpacked to [L, b, Hkv, N(, D)] (N = the most entries any head holds); `retain` maps a
        selection on this view back to the regions."""
        slot_index, width = self._unpacking = self._unpack_plan()
        layers = range(self.num_layers)
        return StoreView(
            keys=torch.stack([self._unpack(l, self.region_keys[l], slot_index[l], width, 0) for l in layers]),
            values=torch.stack([self._unpack(l, self.region_values[l], slot_index[l], width, 0) for l in layers]),
            positions=torch.stack([self._unpack(l, self.region_positions[l], slot_index[l], width, -1) for l in layers]),
            biases=None,
        )

    # ---- storage ----------------------------------------------------------------------------------
    def _regions(self) -> list[list[torch.Tensor]]:
        return [self.region_keys, self.region_values, self.region_positions, self.region_heads, self.region_bias]

    def _fills(self) -> tuple:
        """Value of an unused slot in each of `_regions()`."""
        return (0, 0, -1, 0, torch.finfo(self.region_keys[0].dtype).min)

    def _allocate(self, batch: int, dtype, device, slots: int) -> None:
        L, d, h = self.num_layers, self.head_dim, self.num_kv_heads
        self.region_keys = [torch.zeros(batch, slots, d, dtype=dtype, device=device) for _ in range(L)]
        self.region_values = [torch.zeros(batch, slots, d, dtype=dtype, device=device) for _ in range(L)]
        self.region_positions = [torch.full((batch, slots), -1, dtype=torch.long, device=device) for _ in range(L)]
        self.region_heads = [torch.zeros(batch, slots, dtype=torch.int8, device=device) for _ in range(L)]
        self.region_bias = [torch.full((batch, slots, h), torch.finfo(dtype).min, dtype=dtype, device=device) for _ in range(L)]
        self.region_length = [0] * L

    def _slot_bias(self, heads: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[b, n, Hkv]: 0 where slot n is a live entry of that KV head, the dtype's minimum elsewhere."""
        dtype = self.region_keys[0].dtype
        own = (heads[..., None] == torch.arange(self.num_kv_heads, device=heads.device)) & (positions >= 0)[..., None]
        return torch.zeros((), dtype=dtype, device=heads.device).masked_fill(~own, torch.finfo(dtype).min)

    def _resize_region(self, layer: int, slots: int) -> None:
        """Reallocate one layer's region to `slots` slots, keeping its used ones."""
        n = self.region_length[layer]
        for group, fill in zip(self._regions(), self._fills()):
            old = group[layer]
            new = old.new_full((old.shape[0], slots, *old.shape[2:]), fill)
            new[:, :n] = old[:, :n]
            group[layer] = new

    def reserve(self, entries: int, batch: int, dtype: torch.dtype, device, target: int | None) -> None:
        slots = entries * self.num_kv_heads
        if not self.region_keys:
            self._allocate(batch, dtype, device, slots)
        for layer, keys in enumerate(self.region_keys):
            if keys.shape[1] < slots:
                self._resize_region(layer, slots)

    def select_rows(self, index: torch.Tensor) -> None:
        for group in self._regions():
            group[:] = [t.index_select(0, index) for t in group]

    # ---- a forward ----------------------------------------------------------------------------------
    def begin(self, new_positions: torch.Tensor, dtype, device, target: int | None, writes_padding: bool) -> None:
        """Prepare the slots of the q tokens of a forward (new_positions [b, q], -1 on padding), one per KV head."""
        b, q = new_positions.shape
        h = self.num_kv_heads
        if not self.region_keys:
            self._allocate(b, dtype, device, h * max(q, target or q))
        self._new_slot_positions = new_positions.repeat_interleave(h, dim=1)  # [b, q*h], token-major
        if self._head_pattern is None or self._head_pattern.numel() != q * h:
            self._head_pattern = torch.arange(h, device=device).repeat(q)
        self._new_slot_bias = self._slot_bias(self._head_pattern[None].expand(b, -1), self._new_slot_positions)  # [b, q*h, Hkv]
        self._new_positions = new_positions
        self.length += q

    def append(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write one layer's keys/values [b, Hkv, q, D], one slot per (token, head), token-major; returns the region
        as one multi-query head [b, 1, S, D] and the state packed attention reads."""
        b, h, q, d = key_states.shape
        start = self.region_length[layer]
        end = start + q * h
        if end > self.region_keys[layer].shape[1]:  # rows not yet due, or a prompt chunk past the slack
            self._resize_region(layer, max(end, start + h * self.divide_length))
        self.region_keys[layer][:, start:end] = key_states.transpose(1, 2).reshape(b, q * h, d)
        self.region_values[layer][:, start:end] = value_states.transpose(1, 2).reshape(b, q * h, d)
        self.region_positions[layer][:, start:end] = self._new_slot_positions
        self.region_heads[layer][:, start:end] = self._head_pattern
        self.region_bias[layer][:, start:end] = self._new_slot_bias
        self.region_length[layer] = end
        if layer == self.num_layers - 1:
            self.peak_bytes = max(self.peak_bytes, self.memory_bytes())
            self.peak_length = max(self.peak_length, self.entries())  # mean used slots per (layer, head)
        state = {
            "trikv_active": True,
            "trikv_packed": (
                self.region_positions[layer][:, :end], self.region_heads[layer][:, :end], self._new_positions, h,
                self.region_bias[layer][:, :end],
            ),
        }
        return self.region_keys[layer][:, None, :end], self.region_values[layer][:, None, :end], state

    # ---- unpacking: a region as the [b, Hkv, n] view policies score --------------------------------
    def _unpack_plan(self) -> tuple[list[torch.Tensor], int]:
        """Per layer the index of every used slot inside its head (-1 = dead), and the view's width (the most
        entries any head holds)."""
        slot_index, counts = zip(*(self._head_slots(layer) for layer in range(self.num_layers)))
        return list(slot_index), max(1, max(int(c.max()) for c in counts))

    def _head_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank of every used slot inside its KV head (slot order = position order in a head; dead slots -> -1)
        and live entries per head [b, Hkv]."""
        n, h = self.region_length[layer], self.num_kv_heads
        heads = self.region_heads[layer][:, :n].long()
        live = self.region_positions[layer][:, :n] >= 0
        one_hot = (heads[..., None] == torch.arange(h, device=heads.device)) & live[..., None]  # [b, n, Hkv]
        rank = one_hot.cumsum(1).gather(2, heads[..., None]).squeeze(-1) - 1
        return torch.where(live, rank, -1), one_hot.sum(1)

    def _flat_index(self, layer: int, slot_index: torch.Tensor, width: int) -> torch.Tensor:
        """[b, n] position of each used slot in the flat [Hkv * width] per-head view; dead slots -> Hkv * width
        (a spill column past the view)."""
        heads = self.region_heads[layer][:, : self.region_length[layer]].long()
        return torch.where(slot_index >= 0, heads * width + slot_index, self.num_kv_heads * width)

    def _unpack(self, layer: int, slot_values: torch.Tensor, slot_index: torch.Tensor, width: int, fill) -> torch.Tensor:
        """[b, n(, D)] per-slot values of one region -> [b, Hkv, width(, D)] (fill where a head has no entry)."""
        n, h = self.region_length[layer], self.num_kv_heads
        b = slot_values.shape[0]
        flat = self._flat_index(layer, slot_index, width)
        tail = slot_values.shape[2:]
        out = slot_values.new_full((b, h * width + 1, *tail), fill)
        index = flat.view(b, n, *([1] * len(tail))).expand(b, n, *tail)
        out.scatter_(1, index, slot_values[:, :n])
        return out[:, : h * width].view(b, h, width, *tail)

    # ---- a round ------------------------------------------------------------------------------------
    def retain(self, keep: torch.Tensor, capacity: int, values: torch.Tensor | None = None,
               biases: torch.Tensor | None = None) -> None:
        """Keep what `keep` [L, b, Hkv, N] (on the last `scoring_view`) marks; every region is rewritten as its
        kept slots (head-major, position order) + room for the tokens until `capacity` entries per head."""
        if values is not None or biases is not None:
            raise ValueError("the packed layout stores no rewritten values or biases (compacting policies)")
        slot_index, width = self._unpacking
        new_length = int(keep.sum(-1).max())
        for layer in range(self.num_layers):
            self._repack(layer, keep[layer], slot_index[layer], width, max(capacity - new_length, 0))
        self.length = new_length
        self._unpacking = None

    def _repack(self, layer: int, keep: torch.Tensor, slot_index: torch.Tensor, width: int, room: int) -> None:
        n, h = self.region_length[layer], self.num_kv_heads
        flat = self._flat_index(layer, slot_index, width)
        b = flat.shape[0]
        kept = torch.cat([keep.reshape(b, h * width), keep.new_zeros(b, 1)], 1).gather(1, flat)  # [b, n]
        kept_count = int(kept.sum(-1).max())
        order_key = torch.where(kept, flat, h * width + 1 + torch.arange(n, device=flat.device))  # kept first, in head order
        order = order_key.argsort(dim=1)[:, :kept_count]  # [b, kept_count]
        valid = kept.gather(1, order)
        capacity = kept_count + h * room
        for group, fill in zip(self._regions(), self._fills()):
            old = group[layer]
            new = old.new_full((b, capacity, *old.shape[2:]), fill)
            gather_index = order.view(b, kept_count, *([1] * (old.dim() - 2))).expand(b, kept_count, *old.shape[2:])
            new[:, :kept_count] = old.gather(1, gather_index)
            group[layer] = new
        self.region_positions[layer][:, :kept_count].masked_fill_(~valid, -1)  # rows that keep fewer: dead tail
        self.region_bias[layer][:, :kept_count].masked_fill_(~valid[..., None], torch.finfo(self.region_bias[layer].dtype).min)
        self.region_length[layer] = kept_count
