"""Reading and writing the keys and values of whole requests in a vLLM paged KV cache.

A layer's KV cache is a tensor whose first axis is the block; inside a block, the arrangement of the
(KV head, slot, dimension) elements of keys and values depends on the attention backend, the dtype and even
the CPU's instruction set (vLLM's CPU backend stores fp32 keys transposed per page, bf16 pages VNNI-tiled
on AMX machines). `PageCodec` does not assume any of it: it learns the arrangement by writing coded
tokens through the backend's own KV write (`impl.do_kv_cache_update`) into a one-block scratch copy and
reading back where every code landed. It then gathers and scatters keys and values (each on its own) by rows of
consecutive elements: one index per (head, slot) where its D elements are consecutive (every FlashAttention-style
page, the CPU backend's values), one per (head, dimension, block) where a page stores that dimension of its N slots
consecutively (the CPU backend's fp32 keys, transposed per page), one per element otherwise.

The learnt offsets are logical (element order of one block of the layer's view). vLLM 0.32 views every layer's
cache as [blocks, H, N, C] over one shared allocation in one of six `KVCacheLayout`s (LBNHC, LBHNC, BLNHC,
BLHNC, BHLNC, LHBNC): in most of them a layer's view is not contiguous (heads and slots swapped inside a page,
or the other layers' pages between two blocks). Every element is therefore addressed through the view's own
strides, on the storage it shares with the other layers: nothing assumes a contiguous layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

_DIGIT = 16  # codes stay small integers, exact in every float dtype a KV cache uses (bf16: up to 256)
_FP8_DIGIT = 8  # fp8 e5m2 holds the integers up to 8 exactly (e4m3 up to 16)


@dataclass
class PageCodec:
    """Offsets of every key and value element inside one flattened block page.

    key_offsets / value_offsets: [Hkv, N, D] long, the index in `page.flatten()` of key/value dimension d of
    slot n of KV head h (N = block size).

    quantised: for an fp8 KV cache (vLLM's `kv_cache_dtype` fp8, fp8_e4m3, fp8_e5m2: uint8 pages), the fp8 format
    its bytes hold; None for a cache of plain floats. A quantised entry is its bytes and the layer's scale (one per
    layer and tensor, or one per KV head: `layer._k_scale`): rounds move the bytes as they are, never out of their
    head (the scales stay the layer's), and score keys read back as bytes x scale (`read_keys`), what attention
    reads.
    """

    key_offsets: torch.Tensor
    value_offsets: torch.Tensor
    block_size: int
    quantised: torch.dtype | None = None
    _plans: dict = field(default_factory=dict, repr=False, compare=False)  # (shape, strides, device) -> RowPlan

    @property
    def num_heads(self) -> int:
        return self.key_offsets.shape[0]

    @property
    def head_dim(self) -> int:
        return self.key_offsets.shape[2]

    @classmethod
    def learn(cls, write, kv_cache: torch.Tensor, num_heads: int, block_size: int, head_dim: int,
              quantised: torch.dtype | None = None, key_dtype: torch.dtype | None = None) -> "PageCodec":
        """Learn the page arrangement of `kv_cache` ([num_blocks, ...]); `write(key, value, scratch, slot_mapping)`
        must store key/value [n, Hkv, D] (dtype `key_dtype`, default the cache's) at the slots of a one-block scratch
        cache shaped like `kv_cache`. For an fp8 cache `quantised` is its format: `write` quantises with scales of 1,
        so the small integer codes written land exactly, and the bytes read back are decoded in that format."""
        base = _DIGIT if quantised is None else _FP8_DIGIT
        key_dtype = kv_cache.dtype if key_dtype is None else key_dtype
        scratch = kv_cache[:1].clone()
        page_elements = scratch[0].numel()
        slots = torch.arange(block_size, device=kv_cache.device)
        index = {  # the quantity each code spells, as [N, Hkv, D] (token, head, dimension)
            "slot": slots[:, None, None].expand(block_size, num_heads, head_dim),
            "head": torch.arange(num_heads, device=kv_cache.device)[None, :, None].expand(block_size, num_heads, head_dim),
            "dim": torch.arange(head_dim, device=kv_cache.device)[None, None, :].expand(block_size, num_heads, head_dim),
        }
        digits = max(1, math.ceil(math.log(max(block_size, num_heads, head_dim), base)))
        decoded = {}
        for part in ("key", "value"):
            found = {}
            for quantity, values in index.items():
                total = torch.zeros(page_elements, dtype=torch.long, device=kv_cache.device)
                present = None
                for digit in range(digits):
                    code = (values // base**digit) % base + 1  # 1..base; 0 marks elements not written
                    coded = code.to(key_dtype)
                    zero = torch.zeros_like(coded)
                    scratch.zero_()
                    write(coded if part == "key" else zero, zero if part == "key" else coded, scratch, slots)
                    page = scratch[0].flatten()
                    page = (page if quantised is None else page.view(quantised)).float().round().long()
                    present = page > 0 if present is None else present & (page > 0)
                    total += (page - 1).clamp_min(0) * base**digit
                found[quantity] = total
            decoded[part] = (present, found)
        offsets = {}
        for part, (present, found) in decoded.items():
            elements = present.nonzero().flatten()
            if elements.numel() != block_size * num_heads * head_dim:
                raise RuntimeError(
                    f"cannot read this vLLM KV cache layout: a {part} page holds {elements.numel()} coded elements, "
                    f"expected {block_size * num_heads * head_dim} ({num_heads} heads x {block_size} slots x {head_dim} dims)"
                )
            table = torch.full((num_heads, block_size, head_dim), -1, dtype=torch.long, device=kv_cache.device)
            table[found["head"][elements], found["slot"][elements], found["dim"][elements]] = elements
            if bool((table < 0).any()):
                raise RuntimeError(f"cannot read this vLLM KV cache layout: two {part} elements share one page offset")
            offsets[part] = table
        codec = cls(offsets["key"], offsets["value"], block_size, quantised)
        codec.plan(kv_cache)  # worked out here, at start-up, so that rounds read nothing back from the device
        return codec

    def plan(self, kv_cache: torch.Tensor) -> "RowPlan":
        """How the keys and values of any blocks of a layer view shaped like `kv_cache` are addressed (widest rows
        of consecutive elements; see `Rows`). It depends on the page arrangement and the view's strides alone, so
        it is worked out once per stride set (reading the learnt offsets on the host) and reused by every round."""
        key = (tuple(kv_cache.shape[1:]), tuple(kv_cache.stride()), kv_cache.device)
        plans = self._plans
        if key not in plans:
            plans[key] = RowPlan(*(_row_layout(_strided(offsets, kv_cache), kv_cache.stride(0))
                                   for offsets in (self.key_offsets, self.value_offsets)))
        return plans[key]

    def to(self, device) -> "PageCodec":
        """This codec for caches of the same arrangement on `device`: the offsets and the plans worked out so far
        move along (a plan is read on the host once; its copy on another device needs no reading)."""
        moved = PageCodec(self.key_offsets.to(device), self.value_offsets.to(device), self.block_size, self.quantised)
        for (shape, stride, _), plan in self._plans.items():
            moved._plans[(shape, stride, moved.key_offsets.device)] = RowPlan(
                *(replace(layout, firsts=layout.firsts.to(device)) for layout in (plan.keys, plan.values)))
        return moved

    def locate(self, block_table: torch.Tensor, kv_cache: torch.Tensor, heads: slice = slice(None)) -> "Located":
        """Where the keys and values of the blocks `block_table` [R, nb] (KV heads `heads`) lie in the cache's
        storage, the same for every layer whose view has the shape and strides of `kv_cache`. Device arithmetic
        only: nothing is read back to the host once `plan` is known."""
        plan = self.plan(kv_cache)
        starts = (block_table.to(self.key_offsets.device) * kv_cache.stride(0))[:, :, None, None]  # [R, nb, 1, 1]
        return Located(plan.keys.rows(starts, heads), plan.values.rows(starts, heads))

    def gather(self, kv_cache: torch.Tensor, block_table: torch.Tensor, located=None, keys_only: bool = False):
        """Keys and values of `block_table` [R, nb] (block ids, row per request) -> two [R, Hkv, nb * N, D]
        (or the keys alone). `located`: `locate(...)` of these blocks (maybe of some heads only), when the caller
        already has it."""
        located = located if located is not None else self.locate(block_table, kv_cache)
        keys = located.keys.gather(kv_cache)
        return keys if keys_only else (keys, located.values.gather(kv_cache))

    def read_keys(self, kv_cache: torch.Tensor, located: "Located", scale: torch.Tensor | None = None) -> torch.Tensor:
        """The keys of `located` blocks as a round scores them: [R, h, nb * N, D] in the cache's dtype, or, for an
        fp8 cache, its bytes decoded in their format (float32) times the layer's key scale (`scale`, a device
        tensor: nothing is read back), which is what attention reads: one scale for the layer, or one per KV head
        of `located` ([h]: a checkpoint whose KV scales are per attention head, compressed-tensors' "attn_head")."""
        keys = located.keys.gather(kv_cache)
        if self.quantised is None:
            return keys
        keys = keys.view(self.quantised).to(torch.float32)
        if scale is None:
            return keys
        scale = scale.to(torch.float32)
        return keys * (scale.view(1, -1, 1, 1) if scale.numel() > 1 else scale)

    def key_bytes(self, kv_cache: torch.Tensor) -> int:
        """Bytes per key element a round holds while it scores: the cache's element, plus its float32 decoding for
        an fp8 cache."""
        return kv_cache.element_size() + (4 if self.quantised is not None else 0)

    def move(self, kv_cache: torch.Tensor, block_table: torch.Tensor, order: torch.Tensor, located=None) -> None:
        """In place: slot i of every request and KV head takes the key and value of slot order[r, h, i]
        (order [R, h, n], within the request's blocks `block_table` [R, nb], for the h heads `located` covers);
        slots past n are untouched."""
        located = located if located is not None else self.locate(block_table, kv_cache)
        located.keys.move(kv_cache, order)
        located.values.move(kv_cache, order)


@dataclass
class Rows:
    """Storage indices of the keys (or values) of a set of blocks [R, nb], as rows of `width` consecutive elements
    starting `residue` elements into the storage, along one of three axes:

    - "dim": a row is one (head, slot)'s D elements; index [R, h, nb N];
    - "slot": a row is one block's N slots of one (head, dimension); index [R, h, D, nb];
    - "element": single elements (width 1); index [R, h, nb N, D]
    (h: the KV heads located, all of them or a slice).
    """

    index: torch.Tensor
    along: str
    width: int
    residue: int = 0

    def view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The storage as the index addresses it: non-overlapping [rows, width] rows (flat elements at width 1)."""
        flat = _storage(kv_cache)
        if self.width == 1:
            return flat
        rows = (flat.numel() - self.residue) // self.width
        return flat[self.residue :].as_strided((rows, self.width), (self.width, 1))

    def gather(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """[R, h, nb N, D] (a transposed view along "slot")."""
        rows = self.view(kv_cache)[self.index]
        return rows.flatten(-2).transpose(-1, -2) if self.along == "slot" else rows  # [R, H, D, nb, N] -> [R, H, nb N, D]

    def move(self, kv_cache: torch.Tensor, order: torch.Tensor) -> None:
        """In place: slot i of every (request, head) takes slot order[r, h, i] (order [R, h, n])."""
        view, n = self.view(kv_cache), order.shape[-1]
        if self.along == "dim":
            view[self.index[:, :, :n]] = view[self.index.gather(2, order)]  # the right side is read whole first
        elif self.along == "element":
            rows = order[..., None].expand(*order.shape, self.index.shape[-1])
            view[self.index[:, :, :n]] = view[self.index.gather(2, rows)]
        else:  # whole pages in, the slots rearranged in a dense copy, the first pages that changed written back
            R, H, D, nb = self.index.shape
            pages = view[self.index]  # [R, H, D, nb, N]
            slots = pages.flatten(-2)  # [R, H, D, nb N]
            slots[..., :n] = slots.gather(3, order[:, :, None, :].expand(R, H, D, n))
            touched = -(-n // self.width)
            view[self.index[..., :touched]] = slots.view(R, H, D, nb, self.width)[..., :touched, :]


@dataclass
class Located:
    """Storage indices of a set of blocks' keys and values (see `PageCodec.locate`)."""

    keys: Rows
    values: Rows


@dataclass
class RowLayout:
    """How one part (keys or values) of a layer view is addressed: rows of `width` consecutive storage elements
    starting `residue` elements into the storage, along "dim", "slot" or "element" (see `Rows`). `firsts`: the
    first row index of every row of one block, relative to the block's first element: [H, N] along "dim" (one
    row per (head, slot)), [H, D] along "slot" (one per (head, dimension)), [H, N, D] per element."""

    along: str
    width: int
    residue: int
    firsts: torch.Tensor

    def rows(self, starts: torch.Tensor, heads: slice) -> Rows:
        """The rows of blocks whose first storage elements are `starts` [R, nb, 1, 1], heads `heads` only."""
        firsts = self.firsts[heads]
        R, nb = starts.shape[:2]
        if self.along == "dim":  # [R, nb, h, N] -> [R, h, nb N]
            index = ((starts + firsts[None, None]) // self.width).permute(0, 2, 1, 3).reshape(R, firsts.shape[0], -1)
        elif self.along == "slot":  # [R, nb, h, D] -> [R, h, D, nb]
            index = ((starts + firsts[None, None]) // self.width).permute(0, 2, 3, 1)
        else:  # [R, nb, h, N, D] -> [R, h, nb N, D]
            H, N, D = firsts.shape
            index = (starts[..., None] + firsts[None, None]).permute(0, 2, 1, 3, 4).reshape(R, H, nb * N, D)
        return Rows(index, self.along, self.width, self.residue)

    @property
    def index_bytes_per_slot(self) -> int:
        """Bytes of storage index per (request, head, slot) of this part: one int64 per row."""
        if self.along == "dim":
            return 8
        if self.along == "slot":
            return -(-8 * self.firsts.shape[-1] // self.width)
        return 8 * self.firsts.shape[-1]


@dataclass
class RowPlan:
    """The `RowLayout` of a layer view's keys and of its values."""

    keys: RowLayout
    values: RowLayout

    @property
    def index_bytes_per_slot(self) -> int:
        return self.keys.index_bytes_per_slot + self.values.index_bytes_per_slot


def _row_layout(in_page: torch.Tensor, block_stride: int) -> RowLayout:
    """The widest rows that address one part: `in_page` [H, N, D] storage offsets from a block's first element.
    Reads the offsets on the host (run once per stride set, at start-up)."""
    N, D = in_page.shape[1:]
    for along, width, firsts, steps in (("dim", D, in_page[..., 0], torch.arange(D)),
                                        ("slot", N, in_page[:, 0, :], torch.arange(N)[:, None])):
        expanded = firsts[..., None] if along == "dim" else firsts[:, None, :]
        residue = int(firsts.flatten()[0]) % width
        if (torch.equal(in_page, expanded + steps.to(in_page.device)) and block_stride % width == 0
                and bool((firsts % width == residue).all())):
            return RowLayout(along, width, residue, firsts - residue)
    return RowLayout("element", 1, 0, in_page)


def _strided(offsets: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """Logical element offsets inside one block (`kv_cache[0]` in row-major order) -> storage offsets from the
    block's first element, through the view's strides."""
    shape, strides = kv_cache.shape[1:], kv_cache.stride()[1:]
    remaining, storage = offsets.clone(), torch.zeros_like(offsets)
    for size, stride in zip(reversed(shape), reversed(strides)):
        storage += (remaining % size) * stride
        remaining //= size
    return storage


def _storage(kv_cache: torch.Tensor) -> torch.Tensor:
    """A flat view (no copy) of the cache's storage from its first element: every layer view over a shared
    allocation, whatever its strides, is addressed as storage offset + block * stride(0) + in-page offset."""
    if any(stride < 0 for stride in kv_cache.stride()):
        raise RuntimeError(f"cannot address a KV cache with negative strides {kv_cache.stride()}")
    elements = kv_cache.untyped_storage().nbytes() // kv_cache.element_size() - kv_cache.storage_offset()
    return kv_cache.as_strided((elements,), (1,), kv_cache.storage_offset())
