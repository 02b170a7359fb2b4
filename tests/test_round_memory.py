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
         "a long prompt among short ones": [BUDGET + SLACK] * 6 + [1500],
         "a long prompt split by KV head": [BUDGET + SLACK] * 2 + [3000]}


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
    if mix == "a long prompt split by KV head":  # one layer of the 3,000-token prompt is over the cap
        assert capped[0].plan(1, layers, 2, 3008, 16, 4, 16, cap).heads == 1
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


# one layer of the 1,500-token prompt needs ~0.7 MB: its cap lets one layer in, not all three; one layer of the
# 3,000-token prompt needs ~1.4 MB: its cap lets one KV head in, not two
CAPS = {"1 due": 96 * 1024, "8 due": 96 * 1024, "32 due": 96 * 1024, "a long prompt among short ones": 1024 * 1024,
        "a long prompt split by KV head": 1024 * 1024}


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


def test_gpu_check_runs_at_toy_shapes_on_cpu(tmp_path):
    """`scripts/gpu_check.sh` (here `--small --device cpu`): every layout bitwise, the rounds under their cap without
    a host-device synchronisation, the transformers cache exact without eviction and the lean engine equal to it
    under eviction; `--page` writes the round figures into a page's gpu-check block, leaving the rest alone."""
    from trikv.benchmarks.gpu_check import PAGE_BEGIN, PAGE_END, main

    page, again = tmp_path / "page.md", tmp_path / "again.md"
    for path in (page, again):
        path.write_text(f"# before\n\n{PAGE_BEGIN}\nold figures\n{PAGE_END}\n\nafter\n")
    report = main(["--device", "cpu", "--small", "--workspace", str(512 * 1024), "--page", str(page),
                   "--out", str(tmp_path / "report.json")])
    assert set(report["page_codec"]) == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    assert all(r["bitwise"] and r["row_index"] for r in report["page_codec"].values())
    assert set(report["rounds"]) == {"due-8", "first-600"}
    for name, r in report["rounds"].items():
        assert r["within_cap"] and r["transient_bytes"] <= r["round_workspace_bytes"], name
        assert r["planned_peak_bytes"] <= r["round_workspace_bytes"] and r["chunks"] > 1, name
        assert r["syncs_per_round"] == 0 and r["host_to_device_copies"] == 1 and r["seconds"] > 0, name
    assert report["transformers"]["no_eviction_equals_transformers"]
    assert report["transformers"]["lean_equals_transformers_under_eviction"]
    assert report["passed"]
    text = page.read_text()
    assert text.startswith("# before") and text.endswith("after\n") and "old figures" not in text
    assert "scripts/gpu_check.sh --device cpu --small --workspace 524288" in text and "| 8 due at 48 entries |" in text
    main(["--from-report", str(tmp_path / "report.json"), "--page", str(again)])  # the page again, from the saved report
    assert again.read_text() == text


# ---- 8B shapes: 32 layers, 8 KV heads, head_dim 128, bf16 (Llama-3-8B) --------------------------------------
CAP = 256 * 2**20  # the default round_workspace_bytes
ROUNDS_8B = {"64 due at 2,176": (64, 2176), "first round of 32K": (1, 32768), "first round of 64K": (1, 65536),
             "first round of 128K": (1, 131072)}


def _compactor_8b(cap: int = CAP):
    from trikv.benchmarks.gpu_check import model_config, serving_policy

    return Compactor(serving_policy(model_config(small=False)), True, 32, round_workspace_bytes=cap)


@pytest.mark.parametrize("name", sorted(ROUNDS_8B))
def test_rounds_at_8b_shapes_are_planned_under_the_cap(name):
    """The planned peak of every round at 8B shapes (64 requests due at B + beta, first rounds of 32K, 64K and 128K
    prompts) is under the default 256 MiB: requests, layers and, past one layer, KV heads per chunk. One layer of a
    32K-token prompt alone plans ~297 MB (over the cap), so prompts that long are cut by KV head."""
    due, entries = ROUNDS_8B[name]
    compactor = _compactor_8b()
    index_bytes = 16  # layout LBNHC: one int64 per (head, slot) row of keys and one of values
    plan = compactor.plan(due, 32, 8, entries, 128, 2, index_bytes)
    upload = due * (4 + entries // 16) * 8
    print(f"{name}: chunk {plan.requests} x {plan.layers} x {plan.heads}, planned {plan.bytes + upload:,} bytes")
    assert plan.bytes + upload <= CAP
    if entries >= 32768:
        assert compactor.chunk_bytes(1, 1, 8, entries, 128, 2, index_bytes) > CAP and plan.layers == 1 and plan.heads < 8
    floor = compactor.floor_bytes(32, 8, entries, 128, 2, index_bytes)
    assert floor == compactor.chunk_bytes(1, 1, 1, entries, 128, 2, index_bytes) <= CAP


@pytest.mark.parametrize("entries", [32768, 65536, 131072])
def test_first_rounds_at_8b_shapes_stay_under_the_cap_measured(entries):
    """The first round of a long prompt at 8B shapes, run on CPU: its peak transient memory (CPU allocator records)
    stays under the default 256 MiB, with the chunks the plan gives. One layer (the round's chunks are at most one
    layer, so more layers only repeat them) over block tables that share 64 MiB of cache keeps the test small."""
    from trikv.benchmarks.gpu_check import RoundCase, model_config, paged_round, serving_policy

    config = model_config(small=False)
    config.num_hidden_layers = 1
    case = RoundCase("first", [entries], 2048, prompt_length=entries)
    paged = paged_round(config, case, "cpu", torch.bfloat16, max_cache_bytes=64 * 2**20)
    compactor = Compactor(serving_policy(config), True, 32, round_workspace_bytes=CAP)
    transient = cpu_transient_bytes(lambda: compactor.run(paged.rounds, paged.caches, paged.codecs, paged.block_ids))
    print(f"first round of {entries}: {transient:,} transient bytes in {compactor.chunks} chunks")
    assert transient <= CAP
    plan = compactor.plan(1, 1, 8, entries, 128, 2, 16)
    assert compactor.chunks == -(-8 // plan.heads) and plan.heads < 8
    kept = compactor.kept_positions["request-0"]
    assert kept.dtype == torch.int32 and kept.shape == (1, 8, 2048)


def test_a_workspace_below_the_rounds_floor_is_refused_at_start_up():
    """The worker refuses, before serving, a round_workspace_bytes that one (layer, KV head) of a max_model_len-token
    round would exceed, naming the size to set; at or above the floor it starts."""
    from trikv.vllm.settings import SettingsError
    from trikv.vllm.worker import check_round_floor

    layout = layer_views(LAYOUTS["LBNHC"], 1, 2, 8, 16, 128, torch.bfloat16)
    codec = PageCodec.learn(write, layout[0], 8, 16, 128)
    compactor = _compactor_8b()
    floor = compactor.floor_bytes(32, 8, 131072, 128, 2, 16)
    check_round_floor(compactor, layout[0], codec, 32, 131072)  # 128K fits the default cap one KV head at a time
    small = _compactor_8b(cap=floor - 1)
    with pytest.raises(SettingsError, match=f"raise round_workspace_bytes to at least {floor:,}"):
        check_round_floor(small, layout[0], codec, 32, 131072)
    check_round_floor(_compactor_8b(cap=floor), layout[0], codec, 32, 131072)


def test_the_kept_positions_of_running_requests_are_counted_in_the_reservation():
    """What a compacted request keeps on the device between rounds is its kept positions, int32: 2 MiB per request at
    8B shapes and B = 2048; the worker takes the workspace plus max_num_seqs of them off vLLM's KV pool, and as many
    again for the states session reuse keeps (max_kept_sessions when set; none with reuse off)."""
    from types import SimpleNamespace

    from trikv.benchmarks.gpu_check import model_config
    from trikv.vllm.compactor import request_state_bytes
    from trikv.vllm.settings import BoundedKVSettings
    from trikv.vllm.worker import trikv_reserved_bytes

    assert request_state_bytes(32, 8, 2048) == 2 * 2**20
    settings = BoundedKVSettings(method="streaming", budget=2048, max_request_budget=4096)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=model_config(small=False)),
                                  scheduler_config=SimpleNamespace(max_num_seqs=256))
    state = request_state_bytes(32, 4, 4096)
    assert trikv_reserved_bytes(settings, vllm_config, kv_heads=4) == CAP + (256 + 256) * state
    kept_16 = BoundedKVSettings(method="streaming", budget=2048, max_request_budget=4096, max_kept_sessions=16)
    assert trikv_reserved_bytes(kept_16, vllm_config, kv_heads=4) == CAP + (256 + 16) * state
    no_reuse = BoundedKVSettings(method="streaming", budget=2048, max_request_budget=4096, session_reuse=False)
    assert trikv_reserved_bytes(no_reuse, vllm_config, kv_heads=4) == CAP + 256 * state


def test_the_worker_takes_the_reservation_off_the_pool_on_accelerators_only(monkeypatch):
    """`TriKVWorker.determine_available_memory` on an accelerator: vLLM's measured KV space less the workspace and
    256 requests' and 256 kept sessions' positions at 8B shapes (2 MiB each at B = 2048); on CPU (vLLM's KV space is a fixed setting
    there) vLLM's figure as it is. vLLM's own profiling is stubbed to a known figure and the platform switched, so
    the accelerator branch runs on this machine."""
    from types import SimpleNamespace

    from trikv.benchmarks.gpu_check import model_config
    from trikv.vllm import worker as worker_module
    from trikv.vllm.settings import BoundedKVSettings

    measured = 40 * 2**30
    monkeypatch.setattr(worker_module._PlatformWorker, "determine_available_memory", lambda self: measured)
    monkeypatch.setattr(worker_module, "_tp", lambda: (0, 1))
    worker = worker_module.TriKVWorker.__new__(worker_module.TriKVWorker)
    worker.trikv = BoundedKVSettings(method="streaming", budget=2048)
    worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=model_config(small=False)),
                                         scheduler_config=SimpleNamespace(max_num_seqs=256))
    for is_cpu, expected in ((False, measured - CAP - 512 * 2 * 2**20), (True, measured)):
        monkeypatch.setattr(worker_module, "current_platform", SimpleNamespace(is_cpu=lambda is_cpu=is_cpu: is_cpu))
        assert worker.determine_available_memory() == expected
