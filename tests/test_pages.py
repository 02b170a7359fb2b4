"""The page codec addresses a layer's KV blocks through the view's own strides, in every KV cache layout vLLM 0.32
can hand a layer (no vLLM needed: the caches are built here as vLLM's allocator builds them)."""

from __future__ import annotations

import pytest
import torch

from trikv.vllm.pages import PageCodec

from paged import LAYOUTS, write, write_tiled, write_transposed
from paged import layer_views as paged_layer_views

LAYERS, BLOCKS, HEADS, BLOCK, DIM = 3, 7, 2, 16, 8


def layer_views(order: tuple[int, ...], dtype=torch.float32):
    return paged_layer_views(order, LAYERS, BLOCKS, HEADS, BLOCK, DIM, dtype)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("pages", ["rows", "transposed keys", "tiled keys"])
def test_every_layout_is_read_and_compacted_bitwise(layout, pages):
    """A request's tokens written through the reference into out-of-order blocks of layer 1 are gathered exactly;
    moving a kept subset to the front leaves exactly those (position, key, value) in slots 0.. and every other
    layer's bytes untouched; addressed by rows of a (head, slot)'s D elements where a page stores them so, by rows of
    a block's N slots of one (head, dimension) where keys are transposed, per element where they are tiled."""
    kv_write = {"rows": write, "transposed keys": write_transposed, "tiled keys": write_tiled}[pages]
    views = layer_views(LAYOUTS[layout])
    torch.manual_seed(0)
    for view in views:  # other layers hold their own data: none of it may change
        view.copy_(torch.randn(view.shape))
    cache = views[1]
    assert layout == "LBHNC" or not cache.is_contiguous()  # the non-contiguous views that used to be refused
    codec = PageCodec.learn(kv_write, cache, HEADS, BLOCK, DIM)
    located = codec.locate(torch.tensor([[0]]), cache)
    key_rows = {"rows": "dim", "transposed keys": "slot", "tiled keys": "element"}[pages]
    assert (located.keys.along, located.values.along) == (key_rows, "dim")
    table = torch.tensor([[5, 1, 3]])
    length = 3 * BLOCK - 3
    keys, values = torch.randn(length, HEADS, DIM), torch.randn(length, HEADS, DIM)
    slots = table[0, torch.arange(length) // BLOCK] * BLOCK + torch.arange(length) % BLOCK
    kv_write(keys, values, cache, slots)
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
    # slots past the kept ones keep their bytes (the last page written back whole must not change them)
    assert torch.equal(after_keys[0, :, 20:length], keys[20:].transpose(0, 1))
    assert torch.equal(after_values[0, :, 20:length], values[20:].transpose(0, 1))
    for layer, before in zip((0, 2), others):
        assert torch.equal(views[layer], before)


def test_a_layout_the_codec_cannot_read_is_refused_with_a_message():
    """A write that stores every token in one place (no distinct offset per element) is refused at learning time,
    which runs at engine start-up."""
    views = layer_views(LAYOUTS["LBNHC"])

    def broken(keys, values, cache, slots):
        cache[0, :, 0, :DIM] = keys[0]

    with pytest.raises(RuntimeError, match="cannot read this vLLM KV cache layout"):
        PageCodec.learn(broken, views[0], HEADS, BLOCK, DIM)
