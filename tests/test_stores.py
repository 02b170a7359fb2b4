"""The two stores hold the same entries: whatever is appended and retained, the uniform and the packed layout
give policies the same live (position, key, value) per (layer, row, KV head), for every layer at once."""

import torch

from trikv.stores import PackedStore, UniformStore

L, B, H, D = 3, 2, 2, 4


def _live(view):
    """Per (layer, row, head): the live entries as (position, key, value) rows, in position order."""
    out = {}
    for l in range(L):
        for b in range(B):
            for h in range(H):
                positions = view.positions[l, b, h]
                live = positions >= 0
                order = positions[live].argsort()
                out[l, b, h] = (positions[live][order], view.keys[l, b, h][live][order], view.values[l, b, h][live][order])
    return out


def _append(stores, generator, new_positions):
    q = new_positions.shape[1]
    for store in stores:
        store.begin(new_positions, torch.float32, "cpu", target=16, writes_padding=bool((new_positions < 0).any()))
    for layer in range(L):
        keys = torch.randn(B, H, q, D, generator=generator)
        values = torch.randn(B, H, q, D, generator=generator)
        for store in stores:
            store.append(layer, keys, values)


def test_uniform_and_packed_stores_hold_the_same_entries():
    generator = torch.Generator().manual_seed(0)
    uniform, packed = UniformStore(L, H, D), PackedStore(L, H, D, divide_length=4)
    stores = (uniform, packed)
    # a prompt of 10 slots, row 1 left-padded by 3
    prompt = torch.arange(10)[None].repeat(B, 1) - torch.tensor([[0], [3]])
    _append(stores, generator, prompt.masked_fill(prompt < 0, -1))
    seen = 10
    for round_index in range(3):
        for _ in range(5):  # decode steps
            _append(stores, generator, torch.tensor([[seen], [seen - 3]]))
            seen += 1
        views = [store.scoring_view() for store in stores]
        live = [_live(view) for view in views]
        assert live[0].keys() == live[1].keys()
        for key in live[0]:
            for a, b in zip(live[0][key], live[1][key]):
                assert torch.equal(a, b), (round_index, key)
        # the same choice on both views, by position (not by slot), with different counts per head (a variable budget)
        chosen = {key: set(p.tolist()) for key, (p, _, _) in live[0].items()}
        chosen = {key: {p for p in positions if (p * 7 + key[0] + key[2] + round_index) % 3 != 0} for key, positions in chosen.items()}
        for store, view in zip(stores, views):
            mask = torch.zeros(view.positions.shape, dtype=torch.bool)
            for (l, b, h), positions in chosen.items():
                mask[l, b, h] = torch.isin(view.positions[l, b, h], torch.tensor(sorted(positions), dtype=torch.long))
            store.retain(mask & (view.positions >= 0), capacity=16)
        for store in stores:
            after = _live(store.scoring_view())
            assert {key: set(p.tolist()) for key, (p, _, _) in after.items()} == chosen
    assert packed.memory_bytes() < uniform.memory_bytes()  # per-head counts differ: the packed store holds no fillers
