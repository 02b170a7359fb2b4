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
