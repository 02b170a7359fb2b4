"""What a store gives the cache: the view of all layers a round scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StoreView:
    """Every layer's stored entries as policies score them, [L, b, Hkv, N] per (layer, row, KV head).

    The uniform store hands out views of its buffers; the packed store unpacks its regions into fresh tensors.
    """

    keys: torch.Tensor  # [L, b, Hkv, N, D] post-RoPE
    values: torch.Tensor  # [L, b, Hkv, N, D]
    positions: torch.Tensor  # [L, b, Hkv, N] long RoPE positions, -1 = dead slot
    biases: torch.Tensor | None  # [L, b, Hkv, N] float32 log-biases (compacting policies), else None
