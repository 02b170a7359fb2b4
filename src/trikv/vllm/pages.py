"""Reading and writing the keys and values of whole requests in a vLLM paged KV cache.

A layer's KV cache is a tensor whose first axis is the block; inside a block, the arrangement of the
(KV head, slot, dimension) elements of keys and values depends on the attention backend, the dtype and even
the CPU's instruction set (vLLM's CPU backend stores fp32 keys transposed per page, bf16 pages VNNI-tiled
on AMX machines). `PageCodec` does not assume any of it: it learns the arrangement by writing coded
tokens through the backend's own KV write (`impl.do_kv_cache_update`) into a one-block scratch copy and
reading back where every code landed. It then gathers and scatters whole pages with one index per element.
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

    def gather(self, kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `block_table` [R, nb] (block ids, row per request) -> two [R, Hkv, nb * N, D]."""
        R, nb = block_table.shape
        H, N, D = self.key_offsets.shape
        pages = _pages(kv_cache).index_select(0, block_table.flatten())  # [R nb, page]
        keys = pages[:, self.key_offsets.flatten()].view(R, nb, H, N, D)
        values = pages[:, self.value_offsets.flatten()].view(R, nb, H, N, D)
        return (keys.permute(0, 2, 1, 3, 4).reshape(R, H, nb * N, D), values.permute(0, 2, 1, 3, 4).reshape(R, H, nb * N, D))

    def scatter(self, kv_cache: torch.Tensor, block_table: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [R, Hkv, n, D] into slots [0, n) of the blocks `block_table` [R, kb] (kb N >= n).

        The other slots of the last block keep what they held (vLLM overwrites them before it reads them).
        """
        R, kb = block_table.shape
        H, N, D = self.key_offsets.shape
        n = keys.shape[2]
        if n > kb * N:
            raise ValueError(f"{n} entries do not fit in {kb} blocks of {N} slots")
        flat_blocks = block_table.flatten()
        pages = _pages(kv_cache).index_select(0, flat_blocks).view(R, -1)  # [R, kb page]
        page_elements = pages.shape[1] // kb
        slot = torch.arange(kb * N, device=keys.device).view(kb, 1, N, 1).expand(kb, H, N, D)
        written = slot < n  # [kb, H, N, D]
        block_start = (torch.arange(kb, device=keys.device) * page_elements).view(kb, 1, 1, 1)
        for offsets, entries in ((self.key_offsets, keys), (self.value_offsets, values)):
            index = (block_start + offsets[None])[written]  # [kb H N D][written]: offsets into a request's pages
            padded = torch.nn.functional.pad(entries.to(pages.dtype), (0, 0, 0, kb * N - n))  # [R, H, kb N, D]
            source = padded.view(R, H, kb, N, D).permute(0, 2, 1, 3, 4)[:, written]  # [R, written]
            pages[:, index] = source
        kv_cache[flat_blocks] = pages.view(R * kb, *kv_cache.shape[1:])


def _pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, page elements] (a view when the cache is contiguous)."""
    return kv_cache.reshape(kv_cache.shape[0], -1)
