"""The page codec addresses a layer's KV blocks through the view's own strides, in every KV cache layout vLLM 0.32
can hand a layer (no vLLM needed: the caches are built here as vLLM's allocator builds them)."""

from __future__ import annotations

import pytest
import torch

from trikv.vllm.pages import PageCodec

# vLLM 0.32's KVCacheLayout: the physical (memory) order of the logical axes [L, B, H, N, C]
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LAYERS, BLOCKS, HEADS, BLOCK, DIM = 3, 7, 2, 16, 8


def layer_views(order: tuple[int, ...], dtype=torch.float32) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One allocation viewed as [L, B, H, N, C] (C = keys then values) with the layout's memory order, and each
    layer's [B, H, N, C] view (vLLM's `create_kv_cache_views`)."""
    logical = (LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM)
    strides = [0] * 5
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= logical[axis]
    raw = torch.zeros(step, dtype=dtype)
    view = raw.as_strided(logical, strides)
    return raw, [view[layer] for layer in range(LAYERS)]


def write(keys, values, cache, slots):
    """The slow reference of an attention backend's KV write: token i at slot slots[i] (block, offset)."""
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK)
        cache[block, :, offset, :DIM] = keys[i]
        cache[block, :, offset, DIM:] = values[i]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_is_read_and_compacted_bitwise(layout):
    """A request's tokens written through the reference into out-of-order blocks of layer 1 are gathered exactly;
    moving a kept subset to the front leaves exactly those (position, key, value) in slots 0.. and every other
    layer's bytes untouched."""
    raw, views = layer_views(LAYOUTS[layout])
    torch.manual_seed(0)
    raw.copy_(torch.randn(raw.shape))  # other layers hold their own data: none of it may change
    cache = views[1]
    assert layout == "LBHNC" or not cache.is_contiguous()  # the non-contiguous views that used to be refused
    codec = PageCodec.learn(write, cache, HEADS, BLOCK, DIM)
    table = torch.tensor([[5, 1, 3]])
    length = 3 * BLOCK - 3
    keys, values = torch.randn(length, HEADS, DIM), torch.randn(length, HEADS, DIM)
    slots = table[0, torch.arange(length) // BLOCK] * BLOCK + torch.arange(length) % BLOCK
    write(keys, values, cache, slots)
    others = [views[layer].clone() for layer in (0, 2)]
    got_keys, got_values = codec.gather(cache, table)
    assert torch.equal(got_keys[0, :, :length], keys.transpose(0, 1))
    assert torch.equal(got_values[0, :, :length], values.transpose(0, 1))

    kept = torch.stack([torch.randperm(length)[:20].sort().values for _ in range(HEADS)])[None]  # [1, Hkv, 20]
    codec.move(cache, table, kept)
    after_keys, after_values = codec.gather(cache, table)
    for head in range(HEADS):
        for slot, position in enumerate(kept[0, head].tolist()):  # the expected set, from the written tokens
            assert torch.equal(after_keys[0, head, slot], keys[position, head])
            assert torch.equal(after_values[0, head, slot], values[position, head])
    for layer, before in zip((0, 2), others):
        assert torch.equal(views[layer], before)


def test_a_layout_the_codec_cannot_read_is_refused_with_a_message():
    """A write that stores every token in one place (no distinct offset per element) is refused at learning time,
    which runs at engine start-up."""
    _, views = layer_views(LAYOUTS["LBNHC"])

    def broken(keys, values, cache, slots):
        cache[0, :, 0, :DIM] = keys[0]

    with pytest.raises(RuntimeError, match="cannot read this vLLM KV cache layout"):
        PageCodec.learn(broken, views[0], HEADS, BLOCK, DIM)
