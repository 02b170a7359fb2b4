"""Paged KV caches built on CPU as vLLM 0.32's allocator builds them, and a slow reference of a KV write."""

from __future__ import annotations

import torch

from trikv.benchmarks.gpu_check import LAYOUTS, reference_write  # noqa: F401  (the layouts and the reference write)
from trikv.benchmarks.gpu_check import layout_views as _layout_views


def layer_views(order: tuple[int, ...], layers: int, blocks: int, heads: int, block: int, dim: int,
                dtype=torch.float32) -> list[torch.Tensor]:
    """Each layer's [B, H, N, 2D] view of one CPU allocation in the layout's memory order."""
    return _layout_views(order, layers, blocks, heads, block, dim, dtype, "cpu")


write = reference_write


def _write_head_pages(keys_region, keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor,
                      slots: torch.Tensor) -> None:
    """vLLM's CPU backend views a block's [H, N, 2D] page as [H, 2N, D]: per head, its first N x D elements (in
    the page's logical order) hold the keys, the next N x D the values as [N, D]. `keys_region(region, offset,
    key)` stores one token's [D] key into a head's [N x D] key elements."""
    block_size, dim = cache.shape[2], keys.shape[-1]
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        for head in range(cache.shape[1]):
            page = cache[block, head].reshape(-1).clone()  # [N x 2D] in logical order
            keys_region(page[: block_size * dim], offset, keys[i, head])
            page[block_size * dim :].view(block_size, dim)[offset] = values[i, head]
            cache[block, head] = page.view(block_size, 2 * dim)


def write_transposed(keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """A KV write that stores each page's keys transposed ([D, N] per head, as vLLM's CPU backend does for fp32):
    a (head, slot)'s key elements are not consecutive in memory, a (head, dimension)'s slots are."""
    block_size, dim = cache.shape[2], keys.shape[-1]

    def store(region, offset, key):
        region.view(dim, block_size)[:, offset] = key

    _write_head_pages(store, keys, values, cache, slots)


def write_tiled(keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """A KV write that tiles each page's keys in pairs of dimensions ([D / 2, N, 2] per head, a tiling like the one
    vLLM's CPU backend uses for bf16 keys on AMX machines): neither a (head, slot)'s dimensions nor a (head,
    dimension)'s slots are consecutive."""
    block_size, dim = cache.shape[2], keys.shape[-1]

    def store(region, offset, key):
        region.view(dim // 2, block_size, 2)[:, offset, :] = key.view(dim // 2, 2)

    _write_head_pages(store, keys, values, cache, slots)
