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
from dataclasses import dataclass

import torch

_DIGIT = 16  # codes stay small integers, exact in every float dtype a KV cache uses


@dataclass
class PageCodec:
    """Offsets of every key and value element inside one flattened block page.

    key_offsets / value_offsets: [Hkv, N, D] long, the index in `page.flatten()` of key/value dimension d of
    slot n of KV head h (N = block size).
    """

    key_offsets: torch.Tensor
    value_offsets: torch.Tensor
    block_size: int

    @property
    def num_heads(self) -> int:
        return self.key_offsets.shape[0]

    @property
    def head_dim(self) -> int:
        return self.key_offsets.shape[2]

    @classmethod
    def learn(cls, write, kv_cache: torch.Tensor, num_heads: int, block_size: int, head_dim: int) -> "PageCodec":
        """Learn the page arrangement of `kv_cache` ([num_blocks, ...]); `write(key, value, scratch, slot_mapping)`
        must store key/value [n, Hkv, D] at the slots of a one-block scratch cache shaped like `kv_cache`."""
        scratch = kv_cache[:1].clone()
        page_elements = scratch[0].numel()
        slots = torch.arange(block_size, device=kv_cache.device)
        index = {  # the quantity each code spells, as [N, Hkv, D] (token, head, dimension)
            "slot": slots[:, None, None].expand(block_size, num_heads, head_dim),
            "head": torch.arange(num_heads, device=kv_cache.device)[None, :, None].expand(block_size, num_heads, head_dim),
            "dim": torch.arange(head_dim, device=kv_cache.device)[None, None, :].expand(block_size, num_heads, head_dim),
        }
        digits = max(1, math.ceil(math.log(max(block_size, num_heads, head_dim), _DIGIT)))
        decoded = {}
        for part in ("key", "value"):
            found = {}
            for quantity, values in index.items():
                total = torch.zeros(page_elements, dtype=torch.long, device=kv_cache.device)
                present = None
                for digit in range(digits):
                    code = (values // _DIGIT**digit) % _DIGIT + 1  # 1..16; 0 marks elements not written
                    coded = code.to(kv_cache.dtype)
                    zero = torch.zeros_like(coded)
                    scratch.zero_()
                    write(coded if part == "key" else zero, zero if part == "key" else coded, scratch, slots)
                    page = scratch[0].flatten().float().round().long()
                    present = page > 0 if present is None else present & (page > 0)
                    total += (page - 1).clamp_min(0) * _DIGIT**digit
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
        return cls(offsets["key"], offsets["value"], block_size)

    def locate(self, block_table: torch.Tensor, kv_cache: torch.Tensor) -> "Located":
        """Where the keys and values of the blocks `block_table` [R, nb] lie in the cache's storage, the same for
        every layer whose view has the shape and strides of `kv_cache` (see `Rows` for the three ways)."""
        starts = (block_table.to(self.key_offsets.device) * kv_cache.stride(0))[:, :, None, None]  # [R, nb, 1, 1]
        return Located(*(_rows(_strided(offsets, kv_cache), starts, kv_cache.stride(0))
                         for offsets in (self.key_offsets, self.value_offsets)))

    def gather(self, kv_cache: torch.Tensor, block_table: torch.Tensor, located=None, keys_only: bool = False):
        """Keys and values of `block_table` [R, nb] (block ids, row per request) -> two [R, Hkv, nb * N, D]
        (or the keys alone). `located`: `locate(...)` of these blocks, when the caller already has it."""
        located = located if located is not None else self.locate(block_table, kv_cache)
        keys = located.keys.gather(kv_cache)
        return keys if keys_only else (keys, located.values.gather(kv_cache))

    def move(self, kv_cache: torch.Tensor, block_table: torch.Tensor, order: torch.Tensor, located=None) -> None:
        """In place: slot i of every request and KV head takes the key and value of slot order[r, h, i]
        (order [R, Hkv, n], within the request's blocks `block_table` [R, nb]); slots past n are untouched."""
        located = located if located is not None else self.locate(block_table, kv_cache)
        located.keys.move(kv_cache, order)
        located.values.move(kv_cache, order)


@dataclass
class Rows:
    """Storage indices of the keys (or values) of a set of blocks [R, nb], as rows of `width` consecutive elements
    starting `residue` elements into the storage, along one of three axes:

    - "dim": a row is one (head, slot)'s D elements; index [R, Hkv, nb N];
    - "slot": a row is one block's N slots of one (head, dimension); index [R, Hkv, D, nb];
    - "element": single elements (width 1); index [R, Hkv, nb N, D].
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
        """[R, Hkv, nb N, D] (a transposed view along "slot")."""
        rows = self.view(kv_cache)[self.index]
        return rows.flatten(-2).transpose(-1, -2) if self.along == "slot" else rows  # [R, H, D, nb, N] -> [R, H, nb N, D]

    def move(self, kv_cache: torch.Tensor, order: torch.Tensor) -> None:
        """In place: slot i of every (request, head) takes slot order[r, h, i] (order [R, Hkv, n])."""
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

    @property
    def index_bytes_per_slot(self) -> int:
        """Bytes of index per (request, head, slot) of one part."""
        per_row = self.index.element_size()
        return {"dim": per_row, "element": per_row * self.index.shape[-1]}.get(
            self.along, -(-per_row * self.index.shape[2] // max(1, self.width)))


@dataclass
class Located:
    """Storage indices of a set of blocks' keys and values (see `PageCodec.locate`)."""

    keys: Rows
    values: Rows

    @property
    def index_bytes_per_slot(self) -> int:
        return self.keys.index_bytes_per_slot + self.values.index_bytes_per_slot


def _rows(in_page: torch.Tensor, starts: torch.Tensor, block_stride: int) -> Rows:
    """The widest rows that address one part: `in_page` [H, N, D] storage offsets from a block's first element,
    `starts` [R, nb, 1, 1] the blocks' first elements."""
    H, N, D = in_page.shape
    R, nb = starts.shape[:2]
    for along, width, firsts, steps in (("dim", D, in_page[..., :1], torch.arange(D)),
                                        ("slot", N, in_page[:, :1, :], torch.arange(N)[:, None])):
        residue = int(firsts.flatten()[0]) % width
        if (torch.equal(in_page, firsts + steps.to(in_page.device)) and block_stride % width == 0
                and bool((firsts % width == residue).all())):
            if along == "dim":  # [R, nb, H, N] -> [R, H, nb N]
                index = ((starts + firsts[None, None, ..., 0] - residue) // width).permute(0, 2, 1, 3).reshape(R, H, nb * N)
            else:  # [R, nb, H, D] -> [R, H, D, nb]
                index = ((starts + firsts[None, None, :, 0, :] - residue) // width).permute(0, 2, 3, 1)
            return Rows(index, along, width, residue)
    index = (starts[..., None] + in_page[None, None]).permute(0, 2, 1, 3, 4).reshape(R, H, nb * N, D)
    return Rows(index, "element", 1)


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
