"""Attention functions that honour a trikv cache's per-slot validity.

After eviction, rows of a batch (and, for some policies, heads) hold different numbers of live entries
in the same physical buffer; dead slots carry position -1. transformers' stock masks only know the
logical 2D padding mask, so trikv registers two attention implementations, `trikv_sdpa` and
`trikv_eager`. When the cache marks a forward as its own (`trikv_active` in the attention kwargs) they
build the mask from slot validity and causality; otherwise they are exactly the stock `sdpa` / `eager`
functions with the stock masks, so a model switched to them behaves as before with any other cache.

How the cache's per-layer state reaches the attention function: transformers 5.24 and later hand
`Cache.update` the attention kwargs dict (`kwargs=`), which the cache fills. Earlier releases call
`update(key, value, layer_idx)` only; the cache then parks the state with `park_attention_state`, keyed by
the key tensor it returns, and the attention function of the same layer (which receives that very tensor)
takes it back. A parked state that no attention function took is an error (`unclaimed_attention_state`).
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .architectures import UnsupportedModelError

IMPLEMENTATIONS = {"sdpa": "trikv_sdpa", "eager": "trikv_eager"}

_parked = threading.local()


def park_attention_state(key: torch.Tensor, state: dict) -> None:
    """Leave the cache's attention state for the attention call that receives `key` (the tensor update returned)."""
    _parked.entry = (key, state)


def _take_parked(key: torch.Tensor) -> dict:
    entry = getattr(_parked, "entry", None)
    if entry is None or entry[0] is not key:
        return {}
    _parked.entry = None
    return entry[1]


def unclaimed_attention_state() -> bool:
    """True (and forgets it) when a parked state was never taken: the layer attended without trikv's masks."""
    entry = getattr(_parked, "entry", None)
    _parked.entry = None
    return entry is not None


def validity_mask(query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean mask [b, Hq, q, K] (or broadcastable): causal among the q new tokens (the last q slots) and valid slots.

    valid: [b, Hkv, K] bool, or None when every slot is live. Returns None for a single query with all slots live.
    """
    b, num_heads, q, _ = query.shape
    K = key.shape[2]
    if q == 1 and valid is None:
        return None
    device = query.device
    causal = torch.arange(K, device=device)[None, :] <= (K - q + torch.arange(q, device=device))[:, None]  # [q, K]
    if valid is None:
        return causal[None, None]
    num_kv_heads = valid.shape[1]
    # a query always sees its own slot: padding queries then stay finite instead of attending to nothing
    own_slot = torch.arange(K, device=device)[None, :] == (K - q + torch.arange(q, device=device))[:, None]
    allowed = (valid[:, :, None, :] & causal) | own_slot  # [b, Hkv, q, K]
    group = num_heads // num_kv_heads
    return allowed[:, :, None].expand(b, num_kv_heads, group, q, K).reshape(b, num_heads, q, K)


def bias_mask(query: torch.Tensor, allowed: torch.Tensor | None, bias: torch.Tensor) -> torch.Tensor:
    """Additive float mask [b, Hq, q|1, K]: each key's log-bias (bias [b, Hkv, K], expanded to the G query
    heads of its KV head), and the dtype's minimum where `allowed` (validity_mask) is False.

    attention-matching policies store a bias per entry; new tokens carry 0.
    """
    group = query.shape[1] // bias.shape[1]
    per_key = bias.to(query.dtype).repeat_interleave(group, dim=1)[:, :, None, :]  # [b, Hq, 1, K]
    if allowed is None:
        return per_key
    return torch.where(allowed, per_key, torch.finfo(query.dtype).min)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots, scaling: float) -> torch.Tensor:
    """Attention over a packed cache region (PyramidKV / Ada-KV store only what each head keeps).

    query [b, Hq, q, D]; key / value [b, 1, S, D]: the slots of every KV head of one layer in one axis;
    slots = (slot_positions [b, S], slot_heads [b, S], query_positions [b, q], num_kv_heads, slot_bias
    [b, S, Hkv]: 0 on each KV head's live slots, the dtype's minimum elsewhere). A query head sees the live
    slots of its own KV head up to its own position: one multi-query matmul over the region (every slot is
    read once; the logits against other heads' slots are computed and masked, Hkv x the FLOPs of a per-head
    layout). Decoding (q = 1) adds the cache's slot_bias (no mask is built per step); several queries build
    the causal mask from positions. Returns [b, q, Hq, D] like transformers' attention functions.
    """
    slot_positions, slot_heads, query_positions, num_kv_heads, slot_bias = slots
    b, Hq, q, D = query.shape
    if q == 1:
        keys, values, S = key[:, 0], value[:, 0], key.shape[2]  # [b, S, D]
        logits = torch.matmul(keys, (query.reshape(b, Hq, D) * scaling).transpose(-1, -2)).transpose(-1, -2)  # [b, Hq, S]
        logits = logits.view(b, num_kv_heads, Hq // num_kv_heads, S) + slot_bias.transpose(1, 2)[:, :, None, :]
        probs = torch.softmax(logits, dim=-1).view(b, Hq, S)
        return torch.matmul(probs, values).view(b, 1, Hq, D)
    head_of_query = torch.arange(Hq, device=query.device) // (Hq // num_kv_heads)  # [Hq]
    same_head = slot_heads[:, None, None, :] == head_of_query[None, :, None, None]  # [b, Hq, 1, S]
    key_position = slot_positions[:, None, None, :]  # [b, 1, 1, S]
    query_position = query_positions[:, None, :, None]  # [b, 1, q, 1]
    # a padding query (position -1) sees its head's slots: finite output that no real token ever reads
    visible = ((key_position >= 0) & (key_position <= query_position)) | (query_position < 0)
    allowed = (same_head & visible).reshape(b, 1, Hq * q, -1)
    out = F.scaled_dot_product_attention(query.reshape(b, 1, Hq * q, D), key, value, attn_mask=allowed, scale=scaling)
    return out.view(b, Hq, q, D).transpose(1, 2)


def _with_parked(key, trikv_active, trikv_valid, trikv_bias, trikv_packed):
    if trikv_active or trikv_packed is not None:
        return trikv_active, trikv_valid, trikv_bias, trikv_packed
    parked = _take_parked(key)
    return (parked.get("trikv_active", False), parked.get("trikv_valid"), parked.get("trikv_bias"), parked.get("trikv_packed"))


def trikv_sdpa(module, query, key, value, attention_mask, trikv_active=False, trikv_valid=None, trikv_bias=None, trikv_packed=None, **kwargs):
    trikv_active, trikv_valid, trikv_bias, trikv_packed = _with_parked(key, trikv_active, trikv_valid, trikv_bias, trikv_packed)
    if trikv_packed is not None:
        return packed_attention(query, key, value, trikv_packed, kwargs.get("scaling") or module.scaling).contiguous(), None
    if trikv_active:
        attention_mask = validity_mask(query, key, trikv_valid)
        if trikv_bias is not None:  # per-key log-biases
            attention_mask = bias_mask(query, attention_mask, trikv_bias)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def trikv_eager(module, query, key, value, attention_mask, trikv_active=False, trikv_valid=None, trikv_bias=None, trikv_packed=None, **kwargs):
    trikv_active, trikv_valid, trikv_bias, trikv_packed = _with_parked(key, trikv_active, trikv_valid, trikv_bias, trikv_packed)
    if trikv_packed is not None:  # the packed layout has one attention function (masked SDPA)
        return packed_attention(query, key, value, trikv_packed, kwargs.get("scaling") or module.scaling).contiguous(), None
    if trikv_active:
        allowed = validity_mask(query, key, trikv_valid)
        attention_mask = None
        if trikv_bias is not None:  # per-key log-biases
            attention_mask = bias_mask(query, allowed, trikv_bias)
        elif allowed is not None:
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            attention_mask = torch.where(allowed, zero, torch.finfo(query.dtype).min)
    eager_forward = sys.modules[type(module).__module__].eager_attention_forward
    return eager_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("trikv_sdpa", trikv_sdpa)
AttentionInterface.register("trikv_eager", trikv_eager)
AttentionMaskInterface.register("trikv_sdpa", sdpa_mask)
AttentionMaskInterface.register("trikv_eager", eager_mask)


def use_trikv_attention(model: torch.nn.Module) -> None:
    """Switch `model` to the trikv twin of its attention implementation (idempotent)."""
    current = model.config._attn_implementation
    if current in IMPLEMENTATIONS.values():
        return
    if current not in IMPLEMENTATIONS:
        raise UnsupportedModelError(
            f"attention implementation {current!r} is not supported by trikv caches; "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )
    model.set_attn_implementation(IMPLEMENTATIONS[current])
