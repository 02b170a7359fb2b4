"""Paged KV caches built on CPU as vLLM 0.32's allocator builds them, and a slow reference of a KV write."""

from __future__ import annotations

import torch

# vLLM 0.32's KVCacheLayout: the physical (memory) order of the logical axes [L, B, H, N, C]
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layer_views(order: tuple[int, ...], layers: int, blocks: int, heads: int, block: int, dim: int,
                dtype=torch.float32) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One allocation viewed as [L, B, H, N, C] (C = keys then values) with the layout's memory order, and each
    layer's [B, H, N, C] view (vLLM's `create_kv_cache_views`)."""
    logical = (layers, blocks, heads, block, 2 * dim)
    strides = [0] * 5
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= logical[axis]
    raw = torch.zeros(step, dtype=dtype)
    view = raw.as_strided(logical, strides)
    return raw, [view[layer] for layer in range(layers)]


def write(keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The slow reference of an attention backend's KV write: token i ([Hkv, D] key and value) at slot
    slots[i] (block, offset) of a [B, H, N, 2D] layer view."""
    block_size, dim = cache.shape[2], keys.shape[-1]
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        cache[block, :, offset, :dim] = keys[i]
        cache[block, :, offset, dim:] = values[i]


def write_transposed(keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """A KV write that stores each page's keys transposed ([D, N] per head, as vLLM's CPU backend does for fp32):
    a (head, slot)'s key elements are not consecutive in memory."""
    block_size, dim = cache.shape[2], keys.shape[-1]
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        page = cache[block, :, :, :dim].reshape(cache.shape[1], dim, block_size)  # keys: [H, D, N] in the page
        page[:, :, offset] = keys[i]
        cache[block, :, :, :dim] = page.reshape(cache.shape[1], block_size, dim)
        cache[block, :, offset, dim:] = values[i]
