"""Reading and writing the keys and values of whole requests in a vLLM paged KV cache.

A layer's KV cache is a tensor whose first axis is the block; inside a block, the arrangement of the
(KV head, slot, dimension) elements of keys and values depends on the attention backend, the dtype and even
the CPU's instruction set (vLLM's CPU backend stores fp32 keys transposed per page, bf16 pages VNNI-tiled
on AMX machines). `PageCodec` does not assume any of it: it learns the arrangement by writing coded
tokens through the backend's own KV write (`impl.do_kv_cache_update`) into a one-block scratch copy and
reading back where every code landed. It then gathers and scatters whole pages: one index per row of D elements where a (head, slot)'s
elements are consecutive in memory, one per element otherwise.

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
        every layer whose view has the shape and strides of `kv_cache`. Where a (head, slot)'s D elements are
        consecutive in memory (every FlashAttention-style layout), one index per row of D elements: [R, Hkv, nb N]
        rows of a [rows, D] view; otherwise (pages with keys transposed or tiled, as vLLM's CPU backend stores
        them) one index per element: [R, Hkv, nb N, D]."""
        R, nb = block_table.shape
        H, N, D = self.key_offsets.shape
        starts = (block_table.to(self.key_offsets.device) * kv_cache.stride(0)).view(R, nb, 1, 1, 1)
        in_page = [_strided(offsets, kv_cache) for offsets in (self.key_offsets, self.value_offsets)]  # [H, N, D] each
        first = torch.cat([offsets[..., 0].flatten() for offsets in in_page])
        residue = int(first[0]) % D
        contiguous = all(torch.equal(offsets, offsets[..., :1] + torch.arange(D, device=offsets.device)) for offsets in in_page)
        if contiguous and kv_cache.stride(0) % D == 0 and bool((first % D == residue).all()):
            return Located(*(  # row numbers in the [rows, D] view that starts `residue` elements into the storage
                ((starts[..., 0] + offsets[None, None, ..., 0] - residue) // D).permute(0, 2, 1, 3).reshape(R, H, nb * N)
                for offsets in in_page), row_width=D, residue=residue)
        return Located(*(
            (starts + offsets[None, None]).permute(0, 2, 1, 3, 4).reshape(R, H, nb * N, D) for offsets in in_page
        ))

    def gather(self, kv_cache: torch.Tensor, block_table: torch.Tensor, located=None, keys_only: bool = False):
        """Keys and values of `block_table` [R, nb] (block ids, row per request) -> two [R, Hkv, nb * N, D]
        (or the keys alone). `located`: `locate(...)` of these blocks, when the caller already has it."""
        located = located if located is not None else self.locate(block_table, kv_cache)
        flat = located.view(kv_cache)
        keys = flat[located.keys]
        return keys if keys_only else (keys, flat[located.values])

    def move(self, kv_cache: torch.Tensor, block_table: torch.Tensor, order: torch.Tensor, located=None) -> None:
        """In place: slot i of every request and KV head takes the key and value of slot order[r, h, i]
        (order [R, Hkv, n], within the request's blocks `block_table` [R, nb]); slots past n are untouched."""
        located = located if located is not None else self.locate(block_table, kv_cache)
        flat = located.view(kv_cache)
        n = order.shape[-1]
        for index in (located.keys, located.values):
            rows = order if located.row_width > 1 else order[..., None].expand(*order.shape, index.shape[-1])
            flat[index[:, :, :n]] = flat[index.gather(2, rows)]  # the right side is read whole before the write


@dataclass
class Located:
    """Storage indices of a set of blocks' keys and values (see `PageCodec.locate`): rows of `row_width`
    consecutive elements starting `residue` elements into the storage, or single elements (row_width 1)."""

    keys: torch.Tensor
    values: torch.Tensor
    row_width: int = 1
    residue: int = 0

    def view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The storage as the indices address it: flat elements, or non-overlapping [rows, row_width] rows."""
        flat = _storage(kv_cache)
        if self.row_width == 1:
            return flat
        rows = (flat.numel() - self.residue) // self.row_width
        return flat[self.residue :].as_strided((rows, self.row_width), (self.row_width, 1))

    @property
    def index_bytes(self) -> int:
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()


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
