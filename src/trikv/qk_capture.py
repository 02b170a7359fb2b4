"""q and k where they enter the rotation, for every layer: the one tap calibration, analysis and benchmarks share.

`capture_qk` temporarily wraps the modeling module's `apply_rotary_pos_emb` and hands over the exact
pre-RoPE vectors (after q_norm / k_norm and biases) and the model's own rotated output; a forward pre-hook on
each attention module tells the wrapper which layer is running.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from .architectures import attention_modules, modeling_module

QKCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@contextlib.contextmanager
def capture_qk(model: torch.nn.Module, on_vectors: QKCallback) -> Iterator[None]:
    """Call `on_vectors(layer, q_pre, k_pre, q_post, k_post)` for every layer; q: [b, Hq, n, D], k: [b, Hkv, n, D]."""
    module = modeling_module(model)
    original = module.apply_rotary_pos_emb
    current_layer = [-1]

    def rotary_hook(q, k, cos, sin, *args, **kwargs):
        q_post, k_post = original(q, k, cos, sin, *args, **kwargs)
        on_vectors(current_layer[0], q, k, q_post, k_post)
        return q_post, k_post

    def pre_hook(layer_idx):
        def hook(module, args):
            current_layer[0] = layer_idx

        return hook

    handles = [attn.register_forward_pre_hook(pre_hook(i)) for i, attn in enumerate(attention_modules(model))]
    module.apply_rotary_pos_emb = rotary_hook
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = original
        for handle in handles:
            handle.remove()


def capture_pre_rope(model: torch.nn.Module, on_vectors: Callable[[int, torch.Tensor, torch.Tensor], None]):
    """`on_vectors(layer, q, k)` with the pre-RoPE q [b, Hq, n, D] and k [b, Hkv, n, D] of every layer."""
    return capture_qk(model, lambda layer, q, k, q_post, k_post: on_vectors(layer, q, k))


def capture_post_rope(model: torch.nn.Module, on_vectors: Callable[[int, torch.Tensor, torch.Tensor], None]):
    """`on_vectors(layer, q, k)` with the post-RoPE q and k of every layer (what attention sees)."""
    return capture_qk(model, lambda layer, q, k, q_post, k_post: on_vectors(layer, q_post, k_post))
