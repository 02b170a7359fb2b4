"""Packed layout: a bounded cache whose layers and heads keep different numbers of entries.

PyramidKV gives deeper layers fewer entries, Ada-KV gives the heads of a layer different shares of the
layer's Hkv x budget. In the uniform layout (cache.py) every (layer, head) has the same physical length,
so such policies would keep dead slots. Here each layer owns a *region*: one axis of slots shared by all
its KV heads, each slot tagged with its KV head and RoPE position.

    region_keys[l]      [b, capacity_l, D]  keys of every head of layer l, in one axis
    region_positions[l] [b, capacity_l]     RoPE position of each slot, -1 = dead
    region_heads[l]     [b, capacity_l]     KV head of each slot (int8)
    region_bias[l]      [b, capacity_l, Hkv] 0 where the slot is a live entry of that KV head, else the dtype's
                                             minimum: the decode attention mask, kept up to date as slots change

A forward appends one slot per (token, KV head) at the end of each region. Attention reads a region as a
single multi-query head and masks other heads' slots (`attention.packed_attention`). A round unpacks one
layer at a time to the [b, Hkv, n, D] view policies score, selects across all layers (the policy's
`allocate`), and rewrites every region as its kept slots, head-major and in position order, followed by
room for the slots the next `divide_length` tokens add. So after a round a region holds exactly what its
heads keep, and the allocation is that plus the slack: L x Hkv x (budget + divide_length) slots in all,
the same as a uniform cache, however the policy spreads them.

Schedule, prompt protection, batches and logical positions are those of CompressedCache.
"""

from __future__ import annotations

import math
import time

import torch

from .attention import park_attention_state
from .cache import DEFAULT_BUDGET, CompressedCache, _top_counts
from .policies import Policy, ScoringContext


class PackedCache(CompressedCache):
    """CompressedCache with per-(layer, row, KV head) lengths stored without padding (see module doc).

    `trikv.make_cache` / `CompressedCache(...)` return one for policies with `variable_budgets`
    (PyramidKV, Ada-KV). Policies that keep per-slot state or observe every step are not supported here.
    """

    layout = "packed"

    def __init__(self, model, policy="adakv", budget: int | None = DEFAULT_BUDGET, divide_length: int = 128, **options):
        super().__init__(model, policy, budget=budget, divide_length=divide_length, **options)
        if self.budget is None:
            raise ValueError("the packed layout is for evicting caches; give a budget")
        if self.policy.observes or self.policy.compacts or type(self.policy).after_round is not Policy.after_round:
            raise ValueError(
                f"{self.policy.name} keeps per-slot state (observe / after_round / compact), which the packed layout "
                "does not carry; use the uniform CompressedCache layout"
            )

    def _reset_state(self) -> None:
        super()._reset_state()
        self.region_keys: list[torch.Tensor] = []  # per layer [b, capacity_l, D]
        self.region_values: list[torch.Tensor] = []
        self.region_positions: list[torch.Tensor] = []  # per layer [b, capacity_l] long, -1 = dead
        self.region_heads: list[torch.Tensor] = []  # per layer [b, capacity_l] int8
        self.region_bias: list[torch.Tensor] = []  # per layer [b, capacity_l, Hkv], model dtype
        self.region_length: list[int] = []  # used slots per layer (the same for every row)
        self.peak_bytes = 0
        self._head_pattern: torch.Tensor | None = None  # [Hkv * q] KV head of the slots one forward appends

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.region_keys[0].shape[0] if self.region_keys else -1

    @property
    def device(self) -> torch.device | None:
        return self.region_keys[0].device if self.region_keys else None

    @property
    def capacity(self) -> int:
        """Slots allocated, summed over layers, per row and KV head (mean)."""
        return sum(k.shape[1] for k in self.region_keys) // (self.shape.num_layers * self.shape.num_kv_heads)

    def _slot_bytes(self) -> int:
        """K + V bytes of one slot of one row."""
        return 2 * self.shape.head_dim * self.region_keys[0].element_size()

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
        return math.ceil(sum(self.region_length) / (self.shape.num_layers * self.shape.num_kv_heads)) if self.region_keys else 0

    def stored_keys(self, layer: int) -> torch.Tensor | None:
        """[b, 1, S, D]: layer's region (slots of every KV head; `region_heads` tells which)."""
        return self.region_keys[layer][:, None, : self.region_length[layer]] if self.region_keys else None

    def stored_values(self, layer: int) -> torch.Tensor | None:
        return self.region_values[layer][:, None, : self.region_length[layer]] if self.region_keys else None

    def live_counts(self) -> torch.Tensor:
        L, h = self.shape.num_layers, self.shape.num_kv_heads
        live = sum((p[:, :n] >= 0).sum(-1) for p, n in zip(self.region_positions, self.region_length))
        return live // (L * h)

    def visible_positions(self) -> torch.Tensor:
        """[L, b, Hkv, N] positions per (layer, row, KV head) in slot order, -1 past a head's entries."""
        slot_index, counts = zip(*(self._head_slots(l) for l in range(self.shape.num_layers)))
        width = max(1, max(int(c.max()) for c in counts))
        return torch.stack([self._unpack(l, self.region_positions[l], slot_index[l], width, -1) for l in range(self.shape.num_layers)])

    # ---- storage ----------------------------------------------------------------------------------
    def _regions(self) -> list[list[torch.Tensor]]:
        return [self.region_keys, self.region_values, self.region_positions, self.region_heads, self.region_bias]

    def _fills(self) -> tuple:
        """Value of an unused slot in each of `_regions()`."""
        return (0, 0, -1, 0, torch.finfo(self.region_keys[0].dtype).min)

    def _allocate_regions(self, batch: int, dtype, device, slots: int) -> None:
        L, d, h = self.shape.num_layers, self.shape.head_dim, self.shape.num_kv_heads
        self.region_keys = [torch.zeros(batch, slots, d, dtype=dtype, device=device) for _ in range(L)]
        self.region_values = [torch.zeros(batch, slots, d, dtype=dtype, device=device) for _ in range(L)]
        self.region_positions = [torch.full((batch, slots), -1, dtype=torch.long, device=device) for _ in range(L)]
        self.region_heads = [torch.zeros(batch, slots, dtype=torch.int8, device=device) for _ in range(L)]
        self.region_bias = [torch.full((batch, slots, h), torch.finfo(dtype).min, dtype=dtype, device=device) for _ in range(L)]
        self.region_length = [0] * L

    def _slot_bias(self, heads: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[b, n, Hkv]: 0 where slot n is a live entry of that KV head, the dtype's minimum elsewhere."""
        dtype = self.region_keys[0].dtype
        own = (heads[..., None] == torch.arange(self.shape.num_kv_heads, device=heads.device)) & (positions >= 0)[..., None]
        return torch.zeros((), dtype=dtype, device=heads.device).masked_fill(~own, torch.finfo(dtype).min)

    def _resize_region(self, layer: int, slots: int) -> None:
        """Reallocate one layer's region to `slots` slots, keeping its used ones."""
        n = self.region_length[layer]
        for group, fill in zip(self._regions(), self._fills()):
            old = group[layer]
            new = old.new_full((old.shape[0], slots, *old.shape[2:]), fill)
            new[:, :n] = old[:, :n]
            group[layer] = new

    def reserve(self, entries: int, batch: int, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        slots = entries * self.shape.num_kv_heads
        if not self.region_keys:
            self._allocate_regions(batch, dtype, device, slots)
        for layer, keys in enumerate(self.region_keys):
            if keys.shape[1] < slots:
                self._resize_region(layer, slots)

    def _select_stored_rows(self, index: torch.Tensor) -> None:
        for group in self._regions():
            group[:] = [t.index_select(0, index) for t in group]

    # ---- forward ----------------------------------------------------------------------------------
    def _begin_forward(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, q, d = key_states.shape
        self._claim_forward()
        self._refuse_missed_round()
        if not self.region_keys:
            self._allocate_regions(b, key_states.dtype, key_states.device, h * max(q, self._target_capacity()))
        self._new_positions = self._new_token_positions(b, q, key_states.device)  # [b, q]
        self._new_slot_positions = self._new_positions.repeat_interleave(h, dim=1)  # [b, q*h], token-major
        if self._head_pattern is None or self._head_pattern.numel() != q * h:
            self._head_pattern = torch.arange(h, device=key_states.device).repeat(q)
        self._new_slot_bias = self._slot_bias(self._head_pattern[None].expand(b, -1), self._new_slot_positions)  # [b, q*h, Hkv]
        if not self.decoding and q >= 1:
            self.prompt_length = self.seen + q
        self.length += q
        self.seen += q

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [b, Hkv, q, D] post-RoPE -> one slot per (token, head), token-major
        b, h, q, d = key_states.shape
        if layer_idx == 0:
            self._begin_forward(key_states, value_states)
        start = self.region_length[layer_idx]
        end = start + q * h
        if end > self.region_keys[layer_idx].shape[1]:  # rows not yet due, or a prompt chunk past the slack
            self._resize_region(layer_idx, max(end, start + h * self.divide_length))
        self.region_keys[layer_idx][:, start:end] = key_states.transpose(1, 2).reshape(b, q * h, d)
        self.region_values[layer_idx][:, start:end] = value_states.transpose(1, 2).reshape(b, q * h, d)
        self.region_positions[layer_idx][:, start:end] = self._new_slot_positions
        self.region_heads[layer_idx][:, start:end] = self._head_pattern
        self.region_bias[layer_idx][:, start:end] = self._new_slot_bias
        self.region_length[layer_idx] = end
        if self.query_window is not None:
            self._record_queries(layer_idx, q, end)
        if layer_idx == self.shape.num_layers - 1:
            self.peak_bytes = max(self.peak_bytes, self.memory_bytes())
            self.peak_length = max(self.peak_length, self.entries())  # mean used slots per (layer, head)
        state = {
            "trikv_active": True,
            "trikv_packed": (
                self.region_positions[layer_idx][:, :end], self.region_heads[layer_idx][:, :end], self._new_positions, h,
                self.region_bias[layer_idx][:, :end],
            ),
        }
        stored_keys, stored_values = self.region_keys[layer_idx][:, None, :end], self.region_values[layer_idx][:, None, :end]
        attention_kwargs = kwargs.get("kwargs")
        if attention_kwargs is not None:  # read by trikv_sdpa / trikv_eager / the lean engine (packed_attention)
            attention_kwargs.update(state)
        else:  # transformers < 5.24 passes no kwargs dict to update()
            park_attention_state(stored_keys, state)
        return stored_keys, stored_values

    # ---- unpacking: a region as the [b, Hkv, n] view policies score --------------------------------
    def _head_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index of every used slot in the flat [Hkv * width] per-head view (head * width + rank inside the
        head; dead slots -> -1 until a width is chosen) and live entries per head [b, Hkv]."""
        n, h = self.region_length[layer], self.shape.num_kv_heads
        heads = self.region_heads[layer][:, :n].long()
        live = self.region_positions[layer][:, :n] >= 0
        one_hot = (heads[..., None] == torch.arange(h, device=heads.device)) & live[..., None]  # [b, n, Hkv]
        rank = one_hot.cumsum(1).gather(2, heads[..., None]).squeeze(-1) - 1  # slot order = position order in a head
        return torch.where(live, rank, -1), one_hot.sum(1)

    def _flat_index(self, layer: int, slot_index: torch.Tensor, width: int) -> torch.Tensor:
        """[b, n] position of each used slot in the flat [Hkv * width] per-head view; dead slots -> Hkv * width
        (a spill column past the view)."""
        heads = self.region_heads[layer][:, : self.region_length[layer]].long()
        return torch.where(slot_index >= 0, heads * width + slot_index, self.shape.num_kv_heads * width)

    def _unpack(self, layer: int, slot_values: torch.Tensor, slot_index: torch.Tensor, width: int, fill) -> torch.Tensor:
        """[b, n(, D)] per-slot values of one region -> [b, Hkv, width(, D)] (fill where a head has no entry)."""
        n, h = self.region_length[layer], self.shape.num_kv_heads
        b = slot_values.shape[0]
        flat = self._flat_index(layer, slot_index, width)
        tail = slot_values.shape[2:]
        out = slot_values.new_full((b, h * width + 1, *tail), fill)
        index = flat.view(b, n, *([1] * len(tail))).expand(b, n, *tail)
        out.scatter_(1, index, slot_values[:, :n])
        return out[:, : h * width].view(b, h, width, *tail)

    # ---- compression round ------------------------------------------------------------------------
    @torch.no_grad()
    def compress(self) -> None:
        """Score layer by layer on the unpacked view, select across layers, rewrite every region packed."""
        started = time.perf_counter()
        L, h, budget = self.shape.num_layers, self.shape.num_kv_heads, self.budget
        head_slots = [self._head_slots(layer) for layer in range(L)]
        width = max(1, max(int(counts.max()) for _, counts in head_slots))
        positions = torch.stack([self._unpack(l, self.region_positions[l], head_slots[l][0], width, -1) for l in range(L)])  # [L, b, Hkv, N]
        dead = positions < 0
        live = (~dead).sum(dim=(0, 2, 3)) // (L * h)  # [b]
        due, base = self.schedule.rows_due(live)  # [b]
        if not bool(due.any()):
            return
        row_due = due[None, :, None, None]
        protected = self._protected(positions) & ~dead
        candidates = ~(dead | protected) & row_due
        current = self.current_positions()
        queries = None if self.query_window is None else self.query_window.queries
        scores = torch.empty(positions.shape, dtype=torch.float32, device=positions.device)
        for layer in range(L):  # one layer's [b, Hkv, N, D] view at a time: the round's extra memory is one layer
            index = head_slots[layer][0]
            one = slice(layer, layer + 1)
            context = ScoringContext(
                keys=self._unpack(layer, self.region_keys[layer], index, width, 0)[None],
                values=self._unpack(layer, self.region_values[layer], index, width, 0)[None],
                positions=positions[one],
                candidates=candidates[one],
                current_position=current,
                budget=budget,
                queries=None if queries is None else queries[one],
                query_positions=None if queries is None else self.query_window.positions,
                protected=protected[one],
                layers=one,
            )
            scores[layer] = self.policy.score(context)[0].float()
        scores = scores.masked_fill(protected, float("inf")).masked_fill(dead, float("-inf"))
        # allocation sees every layer's scores (PyramidKV spreads over layers, Ada-KV over the heads of a layer)
        summary = ScoringContext(keys=None, values=None, positions=positions, candidates=candidates, current_position=current,
                                 budget=budget, protected=protected)
        counts = self.policy.allocate(scores, summary)
        if counts is None:
            counts = torch.full(scores.shape[:3], budget, dtype=torch.long, device=scores.device)
        keep = torch.where(row_due, _top_counts(scores, counts) & ~dead, ~dead)  # [L, b, Hkv, N]

        live_after = keep.sum(dim=(0, 2, 3)) // (L * h)  # [b] mean live entries per (layer, head)
        new_length = int(keep.sum(-1).max())
        self.schedule.after_round(due, base, live_after, new_length)
        gap = self.schedule.steps_until_due(new_length)  # tokens until some row is due: room each region needs
        self.length = new_length
        for layer in range(L):
            self._repack(layer, keep[layer], head_slots[layer][0], width, gap)
        self.rounds += 1
        self.scoring_seconds += time.perf_counter() - started

    def _repack(self, layer: int, keep: torch.Tensor, slot_index: torch.Tensor, width: int, gap: int) -> None:
        """Rewrite one region as its kept slots (head-major, position order) + room for `gap` tokens."""
        n, h = self.region_length[layer], self.shape.num_kv_heads
        flat = self._flat_index(layer, slot_index, width)
        b = flat.shape[0]
        kept = torch.cat([keep.reshape(b, h * width), keep.new_zeros(b, 1)], 1).gather(1, flat)  # [b, n]
        kept_count = int(kept.sum(-1).max())
        order_key = torch.where(kept, flat, h * width + 1 + torch.arange(n, device=flat.device))  # kept first, in head order
        order = order_key.argsort(dim=1)[:, :kept_count]  # [b, kept_count]
        valid = kept.gather(1, order)
        capacity = kept_count + h * gap
        for group, fill in zip(self._regions(), self._fills()):
            old = group[layer]
            new = old.new_full((b, capacity, *old.shape[2:]), fill)
            gather_index = order.view(b, kept_count, *([1] * (old.dim() - 2))).expand(b, kept_count, *old.shape[2:])
            new[:, :kept_count] = old.gather(1, gather_index)
            group[layer] = new
        self.region_positions[layer][:, :kept_count].masked_fill_(~valid, -1)  # rows that keep fewer: dead tail
        self.region_bias[layer][:, :kept_count].masked_fill_(~valid[..., None], torch.finfo(self.region_bias[layer].dtype).min)
        self.region_length[layer] = kept_count
