"""A compaction round inside vLLM stays under its memory cap (`round_workspace_bytes`) whatever the number of
requests due or their lengths, and chunking never changes what is kept (no vLLM needed: paged caches are built
here as vLLM's allocator builds them)."""

from __future__ import annotations

import pytest
import torch

from trikv.architectures import config_shape
from trikv.fast import accelerate
from trikv.geometry import RopeGeometry
from trikv.policies import make_policy
from trikv.benchmarks.gpu_check import cpu_transient_bytes
from trikv.vllm.compactor import CompactionOp, Compactor
from trikv.vllm.pages import PageCodec

from helpers import tiny_model
from paged import LAYOUTS, layer_views, write
from stats_fixtures import tiny_stats

BUDGET, SLACK, BLOCK, BLOCKS = 32, 16, 16, 800
UNCAPPED = 1 << 40


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama")
    return model, tiny_stats(model)


def make_policy_for(name: str, tiny):
    model, stats = tiny
    policy = make_policy(name, **({"stats": stats} if name.startswith("triattention") else {}))
    if hasattr(policy, "bind_geometry"):
        policy.bind_geometry(RopeGeometry.from_config(model.config), config_shape(model.config))
        accelerate(policy)  # as the vLLM worker does
    return policy


def paged_requests(tiny, lengths: list[int], seed: int = 0):
    """Caches of every layer (layout LBNHC, non-contiguous views) holding one request per length, in scattered
    blocks, written through the reference KV write; the keys and values written, and each request's round."""
    model, _ = tiny
    shape = config_shape(model.config)
    L, H, D = len(shape.cached_layers), shape.num_kv_heads, shape.head_dim
    caches = layer_views(LAYOUTS["LBNHC"], L, BLOCKS, H, BLOCK, D)
    codec = PageCodec.learn(write, caches[0], H, BLOCK, D)
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(BLOCKS, generator=generator).tolist()
    block_ids, written, rounds = {}, {}, []
    for index, length in enumerate(lengths):
        request = f"r{index}"
        blocks = [free.pop() for _ in range(-(-length // BLOCK))]
        block_ids[request] = blocks
        slots = torch.tensor(blocks)[torch.arange(length) // BLOCK] * BLOCK + torch.arange(length) % BLOCK
        keys = torch.randn(L, length, H, D, generator=generator) * torch.rand(L, length, H, 1, generator=generator)
        values = torch.randn(L, length, H, D, generator=generator)
        for layer in range(L):
            write(keys[layer], values[layer], caches[layer], slots)
        written[request] = (keys, values)
        rounds.append(CompactionOp(request, position=length, length=length, budget=BUDGET, prompt_length=4,
                                   kept_blocks=-(-BUDGET // BLOCK), freed_blocks=0, free_blocks=0, held_blocks=0))
    return caches, [codec] * L, block_ids, written, rounds


def run_round(policy, tiny, lengths, cap, protect_prompt=True):
    caches, codecs, block_ids, written, rounds = paged_requests(tiny, lengths)
    compactor = Compactor(policy, protect_prompt, min_decode_room=8, round_workspace_bytes=cap)
    compactor.run(rounds, caches, codecs, block_ids)
    return compactor, caches, codecs, block_ids, written


MIXES = {"1 due": [BUDGET + SLACK], "8 due": [BUDGET + SLACK] * 8, "32 due": [BUDGET + SLACK] * 32,
         "a long prompt among short ones": [BUDGET + SLACK] * 6 + [1500]}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("method", ["triattention", "streaming"])
def test_chunking_keeps_what_one_pass_keeps(tiny, method, mix):
    """Under a cap that forces chunks of requests and, for the long prompt, of layers, every request keeps the
    entries (positions, keys, values) one uncapped pass keeps, slot for slot."""
    policy = make_policy_for(method, tiny)
    cap = 96 * 1024
    capped = run_round(policy, tiny, MIXES[mix], cap)
    whole = run_round(policy, tiny, MIXES[mix], UNCAPPED)
    layers = len(capped[1])
    if mix != "1 due":
        assert capped[0].chunks > whole[0].chunks, "the cap did not split this round"
    for request in capped[0].kept_positions:
        assert torch.equal(capped[0].kept_positions[request], whole[0].kept_positions[request])
        table = torch.tensor([capped[3][request]])
        for layer in range(layers):
            got = capped[2][layer].gather(capped[1][layer], table)
            expected = whole[2][layer].gather(whole[1][layer], table)
            assert torch.equal(got[0][..., :BUDGET, :], expected[0][..., :BUDGET, :])
            assert torch.equal(got[1][..., :BUDGET, :], expected[1][..., :BUDGET, :])


def test_chunked_knorm_keeps_the_lowest_norm_keys(tiny):
    """Knorm without protection, chunked: slots [0, B) of every (layer, KV head) hold exactly the B written keys of
    lowest norm, in position order, with their values (expected set from the written tensors alone)."""
    policy = make_policy_for("knorm", tiny)
    lengths = [BUDGET + SLACK] * 5 + [700]
    compactor, caches, codecs, block_ids, written = run_round(policy, tiny, lengths, 64 * 1024, protect_prompt=False)
    for request, (keys, values) in written.items():
        table = torch.tensor([block_ids[request]])
        for layer in range(len(caches)):
            got_keys, got_values = codecs[layer].gather(caches[layer], table)
            for head in range(keys.shape[2]):
                norms = keys[layer, :, head].norm(dim=-1)
                expected = norms.topk(BUDGET, largest=False).indices.sort().values
                assert torch.equal(got_keys[0, head, :BUDGET], keys[layer, expected, head])
                assert torch.equal(got_values[0, head, :BUDGET], values[layer, expected, head])


# one layer of the 1,500-token prompt needs ~0.7 MB: its cap lets one layer in, not all three
CAPS = {"1 due": 96 * 1024, "8 due": 96 * 1024, "32 due": 96 * 1024, "a long prompt among short ones": 1024 * 1024}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_round_stays_under_its_memory_cap(tiny, mix):
    """Peak transient memory of one round (CPU allocator records) stays under `round_workspace_bytes` for 1, 8 and
    32 requests due in one step and for a 1,500-token prompt's first round among short ones; uncapped, the larger
    rounds exceed it (so the cap is what holds them)."""
    policy = make_policy_for("triattention", tiny)
    cap = CAPS[mix]
    caches, codecs, block_ids, _, rounds = paged_requests(tiny, MIXES[mix])
    capped = Compactor(policy, True, 8, round_workspace_bytes=cap)
    transient = cpu_transient_bytes(lambda: capped.run(rounds, caches, codecs, block_ids))
    assert transient <= cap, f"{mix}: {transient} transient bytes over the cap of {cap}"
    if mix != "1 due":
        caches, codecs, block_ids, _, rounds = paged_requests(tiny, MIXES[mix])
        uncapped = Compactor(policy, True, 8, round_workspace_bytes=UNCAPPED)
        assert cpu_transient_bytes(lambda: uncapped.run(rounds, caches, codecs, block_ids)) > cap


def test_gpu_check_runs_at_toy_shapes_on_cpu(capsys):
    """`scripts/gpu_check.sh` (here `--small --device cpu`): every layout bitwise, the round under its cap,
    the transformers cache exact without eviction and the lean engine equal to it under eviction."""
    from trikv.benchmarks.gpu_check import main

    report = main(["--device", "cpu", "--small", "--workspace", str(512 * 1024)])
    assert set(report["page_codec"]) == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    assert all(r["bitwise"] and r["row_index"] for r in report["page_codec"].values())
    assert report["round"]["within_cap"] and report["round"]["chunks"] > 1
    assert report["transformers"]["no_eviction_equals_transformers"]
    assert report["transformers"]["lean_equals_transformers_under_eviction"]
    assert report["passed"]
