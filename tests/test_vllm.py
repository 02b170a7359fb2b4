"""trikv inside vLLM (CPU build), on the bundled SmolLM2: same selection and tokens as the transformers path.

The engines run outside the test process (`vllm_scenario.py`): the single-rank scenarios the selected tests
name (`@pytest.mark.engines`) run once, one after the other in one interpreter, and tensor parallelism in its own
processes; the transformers side runs here, replaying each request through trikv's transformers cache
(`vllm_engines.py`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trikv

if os.environ.get("TRIKV_REQUIRE_VLLM") == "1":
    import vllm  # the test command installs it: a missing vLLM must fail, not skip
else:
    vllm = pytest.importorskip("vllm")

pytestmark = [pytest.mark.real_model, pytest.mark.vllm]

from vllm_engines import (BLOCK, BUDGET, SLACK, _all_steps, _prefill_chunks, _rounds_of, _steps_of,
                          _trikv_settings, engine_run, feed_keys, module_engine_runs, replay, run_engines, scenario)

NEW_TOKENS = 160
QUERY_FREE = ("streaming", "knorm", "triattention-dedup")  # methods checked against the transformers path's selection
POOL = 200  # KV blocks of the fp32 engine (vLLM's null block included)


@pytest.fixture(scope="module")
def engine_runs(request, engines_dir, prompts) -> dict[str, dict]:
    """Every scenario the selected tests of this module name, run once."""
    return module_engine_runs(request, engines_dir, prompts)


@pytest.fixture(scope="module")
def tokenizer(real_model):
    return real_model[1]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Three prompts of different lengths; the last is longer than budget + slack (its first round follows the
    prefill, and it is too long to be protected)."""
    text = (Path(trikv.__file__).parent / "data" / "analysis_texts" / "prose.txt").read_text()
    ids = tokenizer(text)["input_ids"]
    return [ids[:12], ids[100:140], ids[300:420]]


@pytest.fixture(scope="module")
def long_ids(tokenizer):
    """About 9,700 tokens of real text: the bundled prose, code and math texts, then the prose again."""
    folder = Path(trikv.__file__).parent / "data" / "analysis_texts"
    texts = [(folder / f"{name}.txt").read_text() for name in ("prose", "code", "math", "prose")]
    return [token for text in texts for token in tokenizer(text)["input_ids"]]


@pytest.fixture(scope="module")
def engines_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")



OWN_BUDGET = 48  # a request's own budget (extra_args), below the server's


CHUNK = 200  # the fp32 engine's prefill_chunk_size: longer than its first batch's prompts
LONG_FP32_PROMPT = 600  # a fresh prompt prefilled in chunks of CHUNK, compacted between them


REFUSED_CHOICES = {"must be an integer number of KV entries": {"trikv_budget": True},
                   "unknown trikv request setting(s) ['trikv_budgett']": {"trikv_budgett": 40},
                   "outside this server's limits [16, 64]": {"trikv_budget": 8}}


@scenario("fp32")
def _fp32(request, prompts):
    """The prompts at the server's budget; then, in a second batch, the longest prompt twice: once with its own
    budget, once with full attention (both chosen through `extra_args`); then malformed choices sent past trikv's
    front-end checks beside a well-formed one, and a streaming-input session added to the engine directly (the
    engine's own refusals); last, a fresh prompt of LONG_FP32_PROMPT tokens, prefilled in chunks of CHUNK with rounds
    between them. The probe records the runner's persistent buffers at every step with rounds, and every step's
    schedule."""
    own_choices = [{"trikv_budget": OWN_BUDGET}, {"trikv_budget": "full"}]
    refused = list(REFUSED_CHOICES.values()) + [{"trikv_budget": 32}]
    long_prompt = request.getfixturevalue("long_ids")[2500 : 2500 + LONG_FP32_PROMPT]
    return {"dtype": "float32", "trikv": _trikv_settings(allow_full_requests=True, prefill_chunk_size=CHUNK),
            "engine": {"num_gpu_blocks_override": POOL}, "probe": True, "schedule_records": True,
            "batches": [{"prompts": prompts, "max_tokens": NEW_TOKENS},
                        {"prompts": [prompts[2], prompts[2]], "max_tokens": 60, "extra_args": own_choices},
                        {"prompts": [prompts[1]] * len(refused), "max_tokens": 8, "extra_args": refused, "frontend_checks": False},
                        {"prompts": [prompts[1]], "max_tokens": 8, "resumable": True},
                        {"prompts": [long_prompt], "max_tokens": 8}]}


@pytest.fixture(scope="module")
def fp32_run(engine_runs):
    return engine_run(engine_runs, "fp32")


@pytest.mark.engines("fp32")
def test_eviction_keeps_what_transformers_keeps_fp32(real_model, fp32_run):
    model, _ = real_model
    stats = trikv.load_stats("smollm2-135m", model)
    for request in fp32_run["batches"][0]["requests"]:
        rounds = _rounds_of(fp32_run, request["request_id"])
        assert len(rounds) >= 3
        report = replay(model, "triattention", request, rounds, tie=1e-3, stats=stats)
        print(f"request {request['request_id']}: {report['rounds']} rounds, {report['tied_heads']} of {report['heads']} "
              f"(layer, head) sets differ by float ties (max {report['max_tie']:.2e} std)")
        # no tie and every teacher-forced token equal: trikv's transformers path, generating freely with this
        # budget, keeps these very sets and emits these very tokens
        assert report["tied_heads"] == 0
        assert report["predictions"] == request["tokens"]


@pytest.mark.engines("fp32")
def test_a_long_prompt_is_compacted_between_its_chunks_as_the_transformers_path_does(real_model, fp32_run):
    """A fresh prompt of 600 tokens on an engine with prefill_chunk_size 200 (B = 64, slack 32, blocks of 32):
    vLLM prefills it 200 tokens a step, runs a round before every chunk that finds it at budget + slack, and holds
    at most ceil((B + 200) / 32) blocks, within the bound ceil((B + slack + 200) / 32); no request of the run is
    ever given more than 200 prefill tokens in one step, and the engine's statistics report the same peak. Replayed
    through trikv's transformers cache in vLLM's own chunks, every round keeps the same set and every teacher-forced
    token is vLLM's."""
    model, _ = real_model
    (request,) = fp32_run["batches"][4]["requests"]
    prompt_length = len(request["prompt"])
    steps = _steps_of(fp32_run, 4, request["request_id"])
    chunks = _prefill_chunks(steps, prompt_length)
    assert [stop - start for start, stop in chunks] == [CHUNK] * (LONG_FP32_PROMPT // CHUNK)
    assert all(count <= CHUNK for _, count, _, _ in _all_steps(fp32_run))
    rounds = _rounds_of(fp32_run, request["request_id"])
    between = [r for r in rounds if r["position"] < prompt_length]
    # every chunk takes the request past budget + slack, so a round runs before each chunk after the first, over
    # the chunk before it and what the round before kept
    assert [r["position"] for r in between] == [start for start, _ in chunks[1:]]
    assert [r["length"] for r in between] == [CHUNK] + [BUDGET + CHUNK] * (len(chunks) - 2)
    peak = max(held for _, _, held, _ in steps)
    assert peak == math.ceil((BUDGET + CHUNK) / BLOCK) <= math.ceil((BUDGET + SLACK + CHUNK) / BLOCK)
    assert fp32_run["stats"][0]["max_request_blocks"] == peak  # the longest request of the run holds the most
    report = replay(model, "triattention", request, rounds, tie=1e-3, stats=trikv.load_stats("smollm2-135m", model), chunks=chunks)
    print(f"chunked prefill: {len(between)} rounds between {len(chunks)} chunks, {report['rounds']} rounds in all, "
          f"{report['tied_heads']} of {report['heads']} (layer, head) sets differ by float ties; peak {peak} blocks")
    assert report["tied_heads"] == 0 and report["predictions"] == request["tokens"]


@pytest.mark.engines("fp32")
def test_memory_after_each_round(fp32_run):
    first_batch = {r["request_id"] for r in fp32_run["batches"][0]["requests"]}
    rounds = [r for r in fp32_run["rounds"][0] if r["request_id"].split("-")[0] in first_batch]
    assert rounds
    limit = math.ceil((BUDGET + SLACK) / BLOCK)
    for record in rounds:
        assert record["kept_blocks"] == math.ceil(BUDGET / BLOCK) <= limit
        assert record["freed_blocks"] == math.ceil(record["length"] / BLOCK) - record["kept_blocks"]
        assert len(record["kept_positions"][0][0]) == BUDGET
        # every block is either held by a running request or free again: what a round drops is returned
        assert record["free_blocks"] + record["held_blocks"] == POOL - 1
    # the pool's free count moves with what rounds return: every round of a request returns its tail
    first = [r for r in rounds if r["length"] > BUDGET + SLACK]
    assert first, "no request had a prompt longer than budget + slack"
    assert all(r["freed_blocks"] >= 2 for r in first)


@pytest.mark.engines("fp32")
def test_compaction_steps_leave_graph_safe_buffers(fp32_run):
    """At every step that ran rounds, the buffers a CUDA graph reads (vLLM's persistent block table and slot mapping,
    the very ones handed to attention) hold the compacted state: each compacted request's row lists exactly its
    blocks, is zero where its given-back blocks were (no stale id), on the host and in the device copy, and each new
    token's slot is the physical slot of its position less the offset. (The compacted sequence lengths are in
    per-step metadata, which only eager attention reads: FULL graph modes are refused, see
    test_vllm_cuda_contracts.py.)"""
    steps = fp32_run["probe"][0]
    checked = [request for step in steps for request in step["requests"]]
    assert len(steps) >= 3 and checked, "no step with rounds was probed"
    assert any(request["offset"] > 0 for request in checked)
    for request in checked:
        assert request["lists_its_blocks"] and request["device_copy_committed"], request
        assert request["stale_ids_cleared"], request
        assert request["slots_physical"], request
    assert all(step["metadata"] == {"slot_mapping_is_buffer": True, "block_table_is_buffer": True} for step in steps)


@pytest.mark.engines("fp32")
def test_the_engine_refuses_what_skips_the_front_end(fp32_run):
    """`LLM.generate` without trikv's front-end checks (as from a front end without its plugin): a boolean budget, a
    misspelt trikv key and a budget under the minimum each finish at once with finish_reason "error" and the reason as
    stop_reason, without a token; the well-formed request beside them is served; a streaming-input session added
    straight to the engine is refused the same way. The engine keeps serving (the batches after ran)."""
    *refused, served = fp32_run["batches"][2]["requests"]
    for request, reason in zip(refused, REFUSED_CHOICES):
        assert request["finish_reason"] == "error" and request["tokens"] == [], request
        assert request["stop_reason"].startswith("trikv: ") and reason in request["stop_reason"], request
    assert served["finish_reason"] == "length" and len(served["tokens"]) == 8
    (stream,) = fp32_run["batches"][3]["requests"]
    assert stream["finish_reason"] == "error" and "streaming-input sessions are not supported" in stream["stop_reason"]
    assert not [r for r in fp32_run["rounds"][0] if r["request_id"].split("-")[0] in {x["request_id"] for x in refused}]


@scenario("plain")
def _plain(request, prompts):
    return {"dtype": "float32", "trikv": None, "batches": [{"prompts": prompts, "max_tokens": 60}]}


@scenario("large-budget")
def _large_budget(request, prompts):
    return {"dtype": "float32", "trikv": {**_trikv_settings(), "budget": 4096}, "batches": [{"prompts": prompts, "max_tokens": 60}]}


@pytest.fixture(scope="module")
def untouched_runs(engine_runs):
    return engine_run(engine_runs, "plain"), engine_run(engine_runs, "large-budget")


@pytest.mark.engines("fp32", "plain", "large-budget")
def test_requests_choose_their_own_budget_or_full_attention(real_model, fp32_run, untouched_runs):
    """A request with `extra_args={"trikv_budget": 48}` keeps 48 entries per (layer, KV head) - the set the
    transformers path keeps at B = 48 - and holds the blocks of 48; one with "full" is never compacted and emits
    plain vLLM's tokens."""
    model, _ = real_model
    own, full = fp32_run["batches"][1]["requests"]
    rounds = _rounds_of(fp32_run, own["request_id"])
    assert len(rounds) >= 2 and all(len(r["kept_positions"][0][0]) == OWN_BUDGET for r in rounds)
    assert all(r["kept_blocks"] == math.ceil(OWN_BUDGET / BLOCK) for r in rounds)
    assert rounds[1]["length"] == OWN_BUDGET + SLACK  # its own trigger: budget + slack
    report = replay(model, "triattention", own, rounds, tie=1e-3, stats=trikv.load_stats("smollm2-135m", model), budget=OWN_BUDGET)
    assert report["tied_heads"] == 0 and report["predictions"] == own["tokens"]
    assert _rounds_of(fp32_run, full["request_id"]) == []
    plain, _ = untouched_runs
    assert full["tokens"] == plain["batches"][0]["requests"][2]["tokens"]


@pytest.mark.engines("plain", "large-budget")
def test_budget_above_every_request_equals_plain_vllm(untouched_runs):
    plain, bounded = untouched_runs
    assert [r["tokens"] for r in bounded["batches"][0]["requests"]] == [r["tokens"] for r in plain["batches"][0]["requests"]]
    assert bounded["rounds"] == [[]]
    assert bounded["stats"][0]["rounds"] == 0


for _method in QUERY_FREE:
    scenario(_method)(lambda request, prompts, method=_method: {
        "dtype": "float32", "trikv": _trikv_settings(method), "batches": [{"prompts": prompts[1:], "max_tokens": 80}]})


@pytest.mark.parametrize("method", [  # one in every run (the query-free rule's most involved), the others with --full
    pytest.param(method, marks=[pytest.mark.engines(method)] + ([] if method == "triattention-dedup" else [pytest.mark.extended]))
    for method in QUERY_FREE])
def test_query_free_methods_keep_what_transformers_keeps(real_model, engine_runs, method):
    model, _ = real_model
    stats = trikv.load_stats("smollm2-135m", model) if method.startswith("triattention") else None
    run = engine_run(engine_runs, method)
    for request in run["batches"][0]["requests"]:
        rounds = _rounds_of(run, request["request_id"])
        assert rounds
        report = replay(model, method, request, rounds, tie=1e-3, stats=stats)
        assert report["predictions"] == request["tokens"]


LORA_RANK, LORA_ALPHA = 8, 16
LORA_MODULES = ("k_proj", "v_proj", "o_proj")  # not q_proj: TriAttention's statistics describe the base queries
STRUCTURED = r"[a-z ]+"  # lowercase letters and spaces: a grammar every step constrains


@pytest.fixture(scope="module")
def lora_adapter(real_model, engines_dir):
    """A LoRA adapter for SmolLM2 in PEFT's format (rank 8 on the key, value and output projections, random weights large
    enough to change the greedy tokens) and the model with it merged: W + alpha / r B A."""
    import copy

    from safetensors.torch import save_file

    model, _ = real_model
    folder = engines_dir / "lora"
    folder.mkdir(exist_ok=True)
    generator = torch.Generator().manual_seed(5)
    merged = copy.deepcopy(model)
    weights = {}
    for index, layer in enumerate(merged.model.layers):
        for name in LORA_MODULES:
            projection = getattr(layer.self_attn, name)
            a = torch.randn(LORA_RANK, projection.in_features, generator=generator) * 0.05
            b = torch.randn(projection.out_features, LORA_RANK, generator=generator) * 0.05
            prefix = f"base_model.model.model.layers.{index}.self_attn.{name}"
            weights[f"{prefix}.lora_A.weight"], weights[f"{prefix}.lora_B.weight"] = a, b
            with torch.no_grad():
                projection.weight += LORA_ALPHA / LORA_RANK * b @ a
    save_file(weights, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": LORA_ALPHA,
        "target_modules": list(LORA_MODULES), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": "smollm2-135m"}))
    return folder, merged


@scenario("lora-structured")
def _lora_structured(request, prompts):
    folder, _ = request.getfixturevalue("lora_adapter")
    return {"dtype": "float32", "trikv": _trikv_settings(),
            "engine": {"enable_lora": True, "max_lora_rank": LORA_RANK, "max_loras": 1},
            "batches": [{"prompts": [prompts[2]], "max_tokens": 80, "lora": str(folder)},
                        {"prompts": [prompts[1]], "max_tokens": 100, "structured": {"regex": STRUCTURED}}]}


@pytest.mark.extended  # vLLM features beside the bounded cache beyond the core ones
@pytest.mark.engines("lora-structured", "fp32")
def test_lora_and_structured_output_run_with_the_bounded_cache(real_model, tokenizer, lora_adapter, engine_runs, fp32_run):
    """A request with a LoRA adapter on a bounded engine: its rounds keep what trikv's transformers cache keeps on the
    model with the adapter merged, and its greedy tokens are that model's (the adapter changes them: they are not the
    base model's); a request under a grammar (structured output, regex [a-z ]+): its text matches the grammar and
    its rounds keep what the transformers path keeps on its tokens (the grammar shapes the tokens, not the cache)."""
    import re

    _, merged = lora_adapter
    stats = trikv.load_stats("smollm2-135m", real_model[0])
    run = engine_run(engine_runs, "lora-structured")
    (adapted,) = run["batches"][0]["requests"]
    rounds = _rounds_of(run, adapted["request_id"])
    assert len(rounds) >= 2
    report = replay(merged, "triattention", adapted, rounds, tie=1e-3, stats=stats)
    disagree = [i for i, (a, b) in enumerate(zip(report["predictions"], adapted["tokens"])) if a != b]
    print(f"LoRA: {report['rounds']} rounds, {report['tied_heads']} of {report['heads']} (layer, head) sets differ by float "
          f"ties; teacher-forced tokens that differ {disagree}, top-2 margins {[report['margins'][i] for i in disagree]}")
    assert all(report["margins"][i] <= 1e-3 for i in disagree)  # vLLM adds B A x to W x, the merged model has (W + BA) x
    base = fp32_run["batches"][0]["requests"][2]
    assert base["prompt"] == adapted["prompt"] and base["tokens"][:80] != adapted["tokens"]
    (structured,) = run["batches"][1]["requests"]
    text = tokenizer.decode(structured["tokens"])
    assert len(structured["tokens"]) == 100 and re.fullmatch(STRUCTURED, text), text
    rounds = _rounds_of(run, structured["request_id"])
    assert len(rounds) >= 2
    replay(real_model[0], "triattention", structured, rounds, tie=1e-3, stats=stats)


@scenario("bf16")
def _bf16(request, prompts):
    return {"dtype": "bfloat16", "trikv": _trikv_settings(), "batches": [{"prompts": prompts[1:], "max_tokens": 110}]}


@pytest.mark.engines("bf16")
def test_bf16_pages_and_selection(real_model, engine_runs):
    """bf16 on this machine uses vLLM's AMX page layout (read exactly: test_page_codec_reads_and_writes_vllm_cpu_pages).
    vLLM's and transformers' bf16 forwards round differently, so scores near the cut-off swap often; every swap
    must be within half a standard deviation of the cut-off (a wrong key layout puts kept entries whole standard
    deviations away), and teacher-forced tokens may differ only where the transformers logits tie within bf16's
    resolution."""
    model, _ = real_model
    bf16_model = trikv.load_model("smollm2-135m", dtype=torch.bfloat16)[0]
    stats = trikv.load_stats("smollm2-135m", bf16_model)
    run = engine_run(engine_runs, "bf16")
    for request in run["batches"][0]["requests"]:
        rounds = _rounds_of(run, request["request_id"])
        assert len(rounds) >= 2
        report = replay(bf16_model, "triattention", request, rounds, tie=0.5, stats=stats)
        print(f"bf16 request {request['request_id']}: {report['tied_heads']} of {report['heads']} (layer, head) sets "
              f"differ by ties (max {report['max_tie']:.3f} std)")
        # bf16 logits of this size are multiples of 1/16 - 1/8: a different argmax must be a tie or one step from it
        disagree = [i for i, (a, b) in enumerate(zip(report["predictions"], request["tokens"])) if a != b]
        print(f"bf16 request {request['request_id']}: {len(disagree)} of {len(request['tokens'])} teacher-forced tokens "
              f"differ, top-2 logit margins {[report['margins'][i] for i in disagree]}")
        assert all(report["margins"][i] <= 0.25 for i in disagree), [report["margins"][i] for i in disagree]


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    """Tiny Gemma-3 and GPT-OSS checkpoints (sliding windows of 48 tokens around full-attention layers; GPT-OSS with
    attention sinks and YaRN) that vLLM's CPU build serves, with TriAttention statistics of their global layers.
    (With a window of 8, below the block size, vLLM's CPU attention and transformers already part ways without
    trikv, at the 11th generated token of a 12-token prompt.)"""
    from helpers import tiny_model
    from trikv.calibration import calibrate

    folder = tmp_path_factory.mktemp("hybrid")
    models = {}
    for family in ("gemma3_text", "gpt_oss"):
        extra = {"query_pre_attn_scalar": 32} if family == "gemma3_text" else {}
        model = tiny_model(family, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           vocab_size=256, intermediate_size=256, sliding_window=48, **extra)
        model.save_pretrained(folder / family)
        ids = torch.randint(1, 256, (512,), generator=torch.Generator().manual_seed(3))
        stats = calibrate(model, ids, source="random tokens (test)", chunk_tokens=128, progress=False)
        stats.save(folder / f"{family}.safetensors")
        models[family] = (model, stats, folder)
    return models


def _hybrid(family: str):
    def build(request, prompts):
        folder = request.getfixturevalue("hybrid_models")[family][2]
        generator = torch.Generator().manual_seed(11)
        own_prompts = [torch.randint(1, 256, (n,), generator=generator).tolist() for n in (12, 40, 120)]
        return {"model": str(folder / family), "dtype": "float32",
                "trikv": {"method": "triattention", "budget": BUDGET, "divide_length": SLACK, "record_rounds": True,
                          "stats": str(folder / f"{family}.safetensors")},
                "engine": {"skip_tokenizer_init": True, "num_gpu_blocks_override": POOL},
                "batches": [{"prompts": own_prompts, "max_tokens": NEW_TOKENS}]}
    return build


for _family in ("gemma3_text", "gpt_oss"):
    scenario(f"hybrid-{_family}")(_hybrid(_family))


@pytest.mark.parametrize("family", [pytest.param(family, marks=pytest.mark.engines(f"hybrid-{family}"))
                                    for family in ("gemma3_text", "gpt_oss")])
def test_hybrid_models_bound_their_global_layers_as_the_transformers_path_does(engine_runs, hybrid_models, family):
    """vLLM runs a hybrid model with one full-attention KV cache group and sliding-window groups; trikv compacts
    the full-attention group only (the sliding groups keep vLLM's window, here 48 tokens in blocks of 32): every
    round keeps what trikv's transformers cache keeps in the global layers, the greedy tokens are the
    transformers path's, and every block is back in the pool at the end."""
    model, stats, _ = hybrid_models[family]
    run = engine_run(engine_runs, f"hybrid-{family}")
    assert run["free_blocks_at_end"] == POOL - 1
    for request in run["batches"][0]["requests"]:
        rounds = _rounds_of(run, request["request_id"])
        assert len(rounds) >= 3
        assert all(len(r["kept_positions"]) == 2 for r in rounds)  # the two global layers of four
        # GPT-OSS's YaRN rotation and expert routing round differently in vLLM and transformers: its keys differ in
        # the last bits, so entries within 2% of a standard deviation of the cut-off may swap (a wrong page layout or
        # layer mapping puts kept entries whole standard deviations away)
        report = replay(model, "triattention", request, rounds, tie=1e-3 if family == "gemma3_text" else 0.02, stats=stats)
        print(f"{family} request {request['request_id']}: {report['rounds']} rounds, {report['tied_heads']} of {report['heads']} "
              f"(layer, head) sets differ by float ties (max {report['max_tie']:.2e} std)")
        disagree = [i for i, (a, b) in enumerate(zip(report["predictions"], request["tokens"])) if a != b]
        print(f"{family} request {request['request_id']}: teacher-forced tokens that differ: {disagree}, top-2 margins "
              f"{[report['margins'][i] for i in disagree]}")
        if family == "gemma3_text":
            assert report["tied_heads"] == 0 and not disagree
        else:  # only float ties may swap
            assert all(report["margins"][i] <= 0.05 for i in disagree)


@pytest.fixture(scope="module")
def gemma3():
    """The bundled Gemma-3-270M and its tokenizer, loaded once for the scenario's prompts and the replay."""
    return trikv.load_model("gemma3-270m")


@scenario("gemma3-270m")
def _gemma3(request, prompts):
    from trikv.prompts import leading_ids

    tokenizer = request.getfixturevalue("gemma3")[1]
    ids = tokenizer((Path(trikv.__file__).parent / "data" / "analysis_texts" / "prose.txt").read_text())["input_ids"]
    bos = leading_ids(tokenizer)  # Gemma-3 is broken without its BOS: every prompt starts with it
    assert bos and ids[: len(bos)] == bos
    return {"model": "gemma3-270m", "dtype": "float32",
            "trikv": {"method": "triattention", "budget": BUDGET, "divide_length": SLACK, "record_rounds": True, "stats": "gemma3-270m"},
            # the pool holds 200 blocks over all KV cache groups: enough for a 512-token request, not for 2,048
            "engine": {"num_gpu_blocks_override": POOL, "max_model_len": 512, "skip_tokenizer_init": True},
            "batches": [{"prompts": [ids[:12], bos + ids[100:160]], "max_tokens": 120}]}


@pytest.mark.extended  # another real model (tiny Gemma-3 and GPT-OSS hybrids run in every run)
@pytest.mark.engines("gemma3-270m")
def test_real_gemma3_bounds_its_global_layers_as_the_transformers_path_does(engine_runs, gemma3):
    """The bundled Gemma-3-270M (3 global layers among 15 sliding ones) with its shipped statistics: vLLM's rounds
    keep what trikv's transformers cache keeps, and the greedy tokens are the transformers path's."""
    model, _ = gemma3
    stats = trikv.load_stats("gemma3-270m", model)
    run = engine_run(engine_runs, "gemma3-270m")
    assert run["free_blocks_at_end"] == POOL - 1
    for request in run["batches"][0]["requests"]:
        rounds = _rounds_of(run, request["request_id"])
        assert len(rounds) >= 2 and all(len(r["kept_positions"]) == 3 for r in rounds)
        report = replay(model, "triattention", request, rounds, tie=1e-3, stats=stats)
        assert report["tied_heads"] == 0
        disagree = [i for i, (a, b) in enumerate(zip(report["predictions"], request["tokens"])) if a != b]
        print(f"gemma3-270m request {request['request_id']}: {report['rounds']} rounds; teacher-forced tokens that "
              f"differ: {disagree}, top-2 margins {[report['margins'][i] for i in disagree]}")
        # vLLM's Gemma-3 kernels and transformers' differ in float order: only near-ties (top-2 logits within
        # 0.05, e.g. one at 0.032 before any round) may swap; every round's kept set is equal (checked above)
        assert len(disagree) <= 2 and all(report["margins"][i] <= 0.05 for i in disagree)


@scenario("concurrency")
def _concurrency(request, prompts):
    length, prompt_length, budget = 320, 24, 32
    pool = 2 * (length // BLOCK) + 1  # + vLLM's null block
    text_ids = prompts[2] + prompts[1]
    requests = [(text_ids[i:] + text_ids[:i])[:prompt_length] for i in range(8)]
    # every due round in its step (a limit of max_num_seqs): a request then never holds more than its two blocks
    return {"dtype": "float32", "trikv": {**_trikv_settings(record_rounds=False), "budget": budget, "divide_length": 32,
                                          "max_rounds_per_step": 16},
            "engine": {"num_gpu_blocks_override": pool, "max_model_len": length, "max_num_seqs": 16},
            "batches": [{"prompts": requests, "max_tokens": length - prompt_length}]}


@pytest.mark.engines("concurrency")
def test_bounded_requests_fit_four_times_more(engine_runs):
    """A pool that holds k = 2 full-attention requests of 320 tokens runs 4k = 8 bounded requests at once
    (B = 32, beta = 32: a request never holds more than 2 blocks of 32), without preemption."""
    run = engine_run(engine_runs, "concurrency")
    stats = run["stats"][0]
    assert stats["max_running"] == 8
    assert stats["preemptions"] == 0
    assert stats["rounds"] >= 8 * 8
    new_tokens = run["spec"]["batches"][0]["max_tokens"]
    assert all(len(r["tokens"]) == new_tokens for r in run["batches"][0]["requests"])


LONG_CONTEXT, LONG_PROMPT, LONG_NEW_TOKENS = 8192, 8000, 64  # SmolLM2's trained length
LONG_BUDGET, LONG_POOL, LONG_BLOCK = 256, 16, 128  # the CPU build's blocks of 128: a pool of 2,048 tokens, 1,920 usable
FULL_REFUSED, FULL_CAPPED = 2000, 1890  # full-attention prompts: one that cannot fit the pool, one that can


@scenario("long-context")
def _long_context(request, prompts):
    """An engine whose pool (16 blocks of 128) is a quarter of max_model_len (8192), with trikv's defaults besides the
    budget (divide_length 128, prefill_chunk_size 512) and the model's own dtype: an 8,000-token prompt, then two
    full-attention requests sent past the front end's checks, one whose prompt does not fit the pool and one whose
    output would outgrow it."""
    ids = request.getfixturevalue("long_ids")
    full = [{"trikv_budget": "full"}] * 2
    return {"dtype": "auto",
            "trikv": {"method": "triattention", "budget": LONG_BUDGET, "stats": "smollm2-135m", "allow_full_requests": True,
                      "record_rounds": True},
            "engine": {"num_gpu_blocks_override": LONG_POOL, "gpu_memory_utilization": 0.5, "max_model_len": LONG_CONTEXT,
                       "block_size": None},
            "schedule_records": True,
            "batches": [{"prompts": [ids[:LONG_PROMPT]], "max_tokens": LONG_NEW_TOKENS},
                        {"prompts": [ids[:FULL_REFUSED], ids[:FULL_CAPPED]], "max_tokens": 64, "extra_args": full,
                         "frontend_checks": False}]}


@pytest.mark.engines("long-context")
def test_long_prompt_on_a_pool_smaller_than_max_model_len(engine_runs):
    """The engine starts with a pool of 2,048 tokens for max_model_len 8192 (plain vLLM refuses it:
    test_a_pool_smaller_than_max_model_len_starts_with_trikv_only) and answers an 8,000-token prompt with its 64
    tokens: the prompt is prefilled 512 tokens a step with a round before every chunk, so the request's blocks
    follow the rule step by step (budget after a round, plus the chunk) and never pass ceil((256 + 128 + 512) / 128)
    = 7; the engine's statistics report the same peak and every block is back at the end. A full-attention request
    whose prompt and first token need more than the pool's 15 usable blocks finishes at once with the reason; one
    whose output would outgrow the pool stops where it is full, with finish_reason "length"."""
    from trikv.settings import DEFAULT_DIVIDE_LENGTH, DEFAULT_PREFILL_CHUNK_SIZE

    slack, chunk = int(DEFAULT_DIVIDE_LENGTH), DEFAULT_PREFILL_CHUNK_SIZE
    run = engine_run(engine_runs, "long-context")
    (request,) = run["batches"][0]["requests"]
    assert request["finish_reason"] == "length" and len(request["tokens"]) == LONG_NEW_TOKENS
    steps = _steps_of(run, 0, request["request_id"])
    chunks = _prefill_chunks(steps, LONG_PROMPT)
    assert [stop - start for start, stop in chunks] == [chunk] * (LONG_PROMPT // chunk) + [LONG_PROMPT % chunk]
    expected, length = [], 0  # the rule, step by step: a round first when the request is at budget + slack
    for start, stop in chunks:
        length = (LONG_BUDGET if length >= LONG_BUDGET + slack else length) + stop - start
        expected.append(math.ceil(length / LONG_BLOCK))
    held = [blocks for start, _, blocks, _ in steps if start < LONG_PROMPT]
    assert held == expected
    bound = math.ceil((LONG_BUDGET + slack + chunk) / LONG_BLOCK)
    assert max(blocks for _, _, blocks, _ in steps) == max(expected) <= bound == 7
    assert run["stats"][0]["max_request_blocks"] == max(expected)
    rounds = _rounds_of(run, request["request_id"])
    assert [r["position"] for r in rounds] == [start for start, _ in chunks[1:]] + [LONG_PROMPT]
    assert all(r["length"] <= LONG_BUDGET + slack + chunk for r in rounds)
    assert run["free_blocks_at_end"] == LONG_POOL - 1
    refused, capped = run["batches"][1]["requests"]
    usable_tokens = (LONG_POOL - 1) * LONG_BLOCK
    assert refused["finish_reason"] == "error" and refused["tokens"] == []
    assert (f"of {FULL_REFUSED} prompt tokens does not fit this server's KV pool, which holds at most {usable_tokens} tokens"
            in refused["stop_reason"])
    assert capped["finish_reason"] == "length" and len(capped["tokens"]) == usable_tokens - FULL_CAPPED
    print(f"8,000-token prompt on a pool of {LONG_POOL} blocks: {run['batches'][0]['seconds']:.1f} s "
          f"({len(rounds)} rounds, peak {max(expected)} blocks of the bound {bound}); engine start {run['startup_seconds']:.1f} s")


SPREAD_BUDGET, SPREAD_REQUESTS, SPREAD_NEW_TOKENS = 32, 8, 120  # three rounds each: at 64 entries, then every 32 tokens


@scenario("spread")
def _spread(request, prompts):
    text_ids = prompts[2] + prompts[1]
    requests = [(text_ids[i:] + text_ids[:i])[:24] for i in range(SPREAD_REQUESTS)]
    return {"dtype": "float32",
            "trikv": {**_trikv_settings(), "budget": SPREAD_BUDGET, "divide_length": SLACK},  # trikv's default limit
            "engine": {"max_model_len": 320, "max_num_seqs": SPREAD_REQUESTS},
            "batches": [{"prompts": requests, "max_tokens": SPREAD_NEW_TOKENS}]}


@pytest.mark.engines("spread")
def test_rounds_due_together_are_spread_over_steps(engine_runs):
    """Eight requests with prompts of one length fall due on the same step; with trikv's default limit (4 rounds a
    step: twice the average rate of 8 requests due every 32 tokens is 1) at most four rounds start per step (their
    positions say when: the requests advance together), the others decode a few tokens more within one extra block,
    and everything completes with every block back."""
    budget, limit = SPREAD_BUDGET, max(4, math.ceil(2 * SPREAD_REQUESTS / SLACK))
    assert limit == 4
    run = engine_run(engine_runs, "spread")
    rounds = run["rounds"][0]
    assert all(len(r["tokens"]) == SPREAD_NEW_TOKENS for r in run["batches"][0]["requests"])
    by_position: dict[int, int] = {}
    for record in rounds:
        by_position[record["position"]] = by_position.get(record["position"], 0) + 1
        assert budget + SLACK <= record["length"] < budget + SLACK + BLOCK  # waited within one extra block
    assert max(by_position.values()) == limit, by_position
    firsts = {r["request_id"]: r["position"] for r in reversed(rounds)}
    assert len(set(firsts.values())) >= 2  # the first rounds, all due at one step, started over two steps


STRESS_POOL, STRESS_NEW_TOKENS, STRESS_STEP_TOKENS = 10, 120, 64


@scenario("stress")
def _stress(request, prompts):
    text_ids = prompts[2] + prompts[1] + prompts[0]
    requests = [(text_ids[i * 7 :] + text_ids[: i * 7])[: 20 if i < 6 else 150] for i in range(8)]
    # every due round in its step (a limit of max_num_seqs): decoding rounds at budget + slack, as the replay expects
    return {"dtype": "float32", "trikv": _trikv_settings(max_rounds_per_step=8),
            "engine": {"num_gpu_blocks_override": STRESS_POOL, "max_model_len": 288, "max_num_seqs": 8,
                       "enable_chunked_prefill": True, "max_num_batched_tokens": STRESS_STEP_TOKENS},
            "schedule_records": True,
            # the second batch's step tells the workers which requests of the first one ended
            "batches": [{"prompts": requests, "max_tokens": STRESS_NEW_TOKENS, "abort": {"after_steps": 30, "requests": [1, 4]}},
                        {"prompts": [requests[0][:5]], "max_tokens": 2}]}


@pytest.mark.engines("stress")
def test_chunked_prefill_preemption_and_abort_keep_working(real_model, engine_runs):
    """Six short prompts that outgrow a small pool as they decode (vLLM preempts and recomputes), two prompts longer
    than budget + slack prefilled in chunks of at most 64 tokens (the engine's token budget per step, shared) with
    rounds between them, and two requests aborted mid-generation: every other request ends with all its tokens; no
    request ever holds more blocks than budget + slack + one chunk; a chunked prefill never preempted keeps what the
    transformers path keeps for vLLM's chunks and emits its tokens; a request resumed after a preemption is
    compacted afresh from its recomputed entries; every block is back in the pool at the end."""
    model, _ = real_model
    pool, new_tokens = STRESS_POOL, STRESS_NEW_TOKENS
    bound = BUDGET + SLACK + STRESS_STEP_TOKENS
    run = engine_run(engine_runs, "stress")
    assert run["stats"][0]["preemptions"] > 0, "the pool was large enough: nothing was preempted"
    # no per-request state outlives its request (finished, aborted or preempted): a long-running server stays bounded
    assert run["stats"][0]["compacted_running"] == [] and run["stats"][0]["compacted_requests"] >= 6
    assert run["free_blocks_at_end"] == pool - 1  # finished, aborted and preempted requests returned every block
    assert 0 < run["stats"][0]["max_request_blocks"] <= math.ceil(bound / BLOCK)
    stats = trikv.load_stats("smollm2-135m", model)
    replayed, resumed = [], []
    assert all(held <= math.ceil(bound / BLOCK) for _, _, held, _ in _all_steps(run))
    for index, request in enumerate(run["batches"][0]["requests"]):
        steps = _steps_of(run, 0, request["request_id"])
        if request["aborted"]:
            assert 0 < len(request["tokens"] or []) < new_tokens, "abort after 30 steps: mid-generation"
            continue
        assert len(request["tokens"]) == new_tokens
        rounds = _rounds_of(run, request["request_id"])
        assert rounds and all(len(r["kept_positions"][0][0]) == BUDGET and r["length"] < bound for r in rounds)
        # the first round of a request, and of its recompute after a preemption (a step that starts over), compacts
        # all it has computed so far: the offset of the step after it is that history less the budget
        restarts = [i for i in range(1, len(steps)) if steps[i][0] < steps[i - 1][0] + steps[i - 1][1]]
        for first, end in zip([0, *restarts], [*restarts, len(steps)]):
            compacted = [(start, offset) for start, _, _, offset in steps[first:end] if offset > 0]
            assert not compacted or compacted[0][1] == compacted[0][0] - BUDGET, steps[first:end]
        if restarts:
            resumed.append(index)
            continue
        prompt_length = len(request["prompt"])
        # decoding, every round at budget + slack; while prefilling, before chunks and after the last one
        assert all(r["length"] == BUDGET + SLACK for r in rounds if r["position"] > prompt_length)
        if prompt_length > BUDGET + SLACK:  # the chunked prefills: replayed through the transformers path in vLLM's chunks
            chunks = _prefill_chunks(steps, prompt_length)
            assert len(chunks) > 2 and [r["position"] for r in rounds if r["position"] < prompt_length]
            report = replay(model, "triattention", request, rounds, tie=1e-3, stats=stats, chunks=chunks)
            assert report["predictions"] == request["tokens"]
            replayed.append(index)
    print(f"stress: replayed {replayed}, resumed after a preemption {resumed}, {run['stats'][0]['preemptions']} preemptions")
    assert replayed, "no chunked prefill was replayed"


PREEMPTION_BUDGET, PREEMPTION_CHUNK, PREEMPTION_POOL = 32, 32, 11  # 10 usable blocks = max_model_len 320
PREEMPTION_NEW_TOKENS = [200, 60, 70, 80, 90, 100, 30, 30]


@scenario("preemption")
def _preemption(request, prompts):
    text_ids = prompts[2] + prompts[1] + prompts[0]
    requests = [(text_ids[i * 13 :] + text_ids[: i * 13])[:20] for i in range(8)]
    return {"dtype": "float32", "trikv": {**_trikv_settings(), "budget": PREEMPTION_BUDGET, "divide_length": SLACK},
            "engine": {"num_gpu_blocks_override": PREEMPTION_POOL, "max_model_len": 320, "max_num_seqs": 8,
                       "enable_chunked_prefill": True, "max_num_batched_tokens": PREEMPTION_CHUNK, "scheduling_policy": "priority"},
            "batches": [{"prompts": requests, "max_tokens": PREEMPTION_NEW_TOKENS, "arrivals": [0] + [110] * 5 + [140] * 2,
                         "priorities": [1] + [0] * 5 + [2] * 2, "max_steps": 2000},
                        {"prompts": requests[:1], "max_tokens": PREEMPTION_NEW_TOKENS[:1]}]}  # A alone: never preempted


@pytest.mark.engines("preemption")
def test_preempted_request_recomputes_within_its_bound_without_holding_others(engine_runs):
    """Request A (low priority) decodes alone; five requests arrive at step 110 and outgrow the 10-block pool, so
    vLLM preempts A at > 4x its budget; two more (lower priority than A) arrive at step 140. A's recompute is a
    chunked prefill compacted between chunks: it never holds more than budget + slack + one chunk entries, it is
    readmitted while the others still run (not once its whole history fits), everything completes and every block
    returns. Its tokens equal an unpreempted run's until the others arrive; the agreement after is reported."""
    budget, chunk, pool, new_tokens = PREEMPTION_BUDGET, PREEMPTION_CHUNK, PREEMPTION_POOL, PREEMPTION_NEW_TOKENS
    run = engine_run(engine_runs, "preemption")
    requests = run["spec"]["batches"][0]["prompts"]
    assert run["stats"][0]["preemptions"] >= 1
    first, alone = run["batches"][0]["requests"], run["batches"][1]["requests"][0]
    assert [len(r["tokens"]) for r in first] == new_tokens
    assert run["free_blocks_at_end"] == pool - 1
    rounds = _rounds_of(run, first[0]["request_id"])
    resumed = next(i for i in range(1, len(rounds)) if rounds[i]["position"] < rounds[i - 1]["position"])
    preempted_after = rounds[resumed - 1]["position"]
    assert preempted_after >= 4 * budget
    bound = budget + SLACK + chunk
    assert all(r["length"] <= bound for r in rounds[resumed:]), [r["length"] for r in rounds[resumed:]]
    assert rounds[resumed]["held_blocks"] > rounds[resumed]["kept_blocks"]  # readmitted beside running requests
    steps = first[0]["token_steps"]  # the steps at which A produced a token: the longest pause is its preemption
    pause = max(range(1, len(steps)), key=lambda i: steps[i] - steps[i - 1])
    last_other = max(step for r in first[1:6] for step in r["token_steps"])
    assert steps[pause] < last_other, "A waited until the pool had room for its whole history"
    unpreempted = alone["tokens"]
    before = 110 - 5  # tokens A produced alone in both runs
    assert first[0]["tokens"][:before] == unpreempted[:before]
    after = slice(pause, None)  # the tokens A produced after its recompute
    agree = sum(a == b for a, b in zip(first[0]["tokens"][after], unpreempted[after])) / len(unpreempted[after])
    print(f"preempted at {len(requests[0]) + pause} tokens; recompute rounds {[r['length'] for r in rounds[resumed:resumed + 4]]}...; "
          f"tokens after the preemption equal to the unpreempted run's: {agree:.0%}")


# ---- speculative decoding (n-gram drafts) beside the bounded cache ----------------------------------------------
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _ngram_spec(prompts, speculative: bool) -> dict:
    """The server's budget (64, slack 32) on a prompt that repeats itself (the middle prompt twice: 80 tokens, under
    budget + slack, so its rounds fall due while it decodes, at 96 tokens and every 32 after) and on the short prompt,
    with or without n-gram drafts of 4 tokens."""
    engine = {"speculative_config": NGRAM, "disable_log_stats": False} if speculative else {}
    # the n-gram proposer imports numba, after which vLLM's CPU kernel overrides fail to register for any later engine
    # of the interpreter (its dispatcher scans every loaded module): the speculating engine runs in its own
    return {"dtype": "float32", "trikv": _trikv_settings(), "engine": engine, "schedule_records": True,
            "probe": speculative, "spec_decoding": speculative, "alone": speculative,
            "batches": [{"prompts": [prompts[1] * 2, prompts[0]], "max_tokens": NEW_TOKENS}]}


@scenario("ngram")
def _ngram(request, prompts):
    return _ngram_spec(prompts, speculative=True)


@scenario("ngram-off")
def _ngram_off(request, prompts):
    return _ngram_spec(prompts, speculative=False)


@pytest.mark.engines("ngram", "ngram-off")
def test_ngram_speculation_gives_the_tokens_and_rounds_of_the_bounded_engine_without_it(engine_runs):
    """At temperature 0, n-gram speculation (4 draft tokens a step) beside TriAttention gives every request the tokens,
    rounds (positions, lengths) and kept positions of the same bounded engine without it, while vLLM accepts drafts
    (its own statistics: acceptance > 0). A step with draft tokens never takes a request past budget + slack (its
    round falls due where it would without drafts), no request holds more blocks than without speculation, the draft
    tokens' KV slots are physical (the probe, at every step with rounds) and every block is back at the end."""
    spec_run, plain_run = engine_run(engine_runs, "ngram"), engine_run(engine_runs, "ngram-off")
    drafts = spec_run["spec_decoding"]
    rate = drafts["accepted_tokens"] / max(1, drafts["draft_tokens"])
    print(f"n-gram speculation: {drafts['drafts']} drafts, {drafts['draft_tokens']} draft tokens, "
          f"{drafts['accepted_tokens']} accepted (acceptance rate {rate:.1%})")
    assert drafts["draft_tokens"] > 0 and drafts["accepted_tokens"] > 0
    speculated = spec_run["batches"][0]["requests"]
    for request, plain in zip(speculated, plain_run["batches"][0]["requests"]):
        assert request["prompt"] == plain["prompt"] and len(request["tokens"]) == NEW_TOKENS
        assert request["tokens"] == plain["tokens"]
        rounds, plain_rounds = _rounds_of(spec_run, request["request_id"]), _rounds_of(plain_run, plain["request_id"])
        assert len(rounds) >= 3
        assert [(r["position"], r["length"]) for r in rounds] == [(r["position"], r["length"]) for r in plain_rounds]
        assert [r["kept_positions"] for r in rounds] == [r["kept_positions"] for r in plain_rounds]
        prompt_length = len(request["prompt"])
        steps = _steps_of(spec_run, 0, request["request_id"])
        decoding = [(start - offset, count) for start, count, _, offset in steps if start >= prompt_length]
        assert any(count > 1 for _, count in decoding)  # drafts were verified
        assert all(length + count <= BUDGET + SLACK for length, count in decoding)
        held = max(blocks for _, _, blocks, _ in steps)
        assert held <= max(blocks for _, _, blocks, _ in _steps_of(plain_run, 0, plain["request_id"]))
    # after a round a request verifies drafts on a compacted cache: their slots are physical (the probe)
    findings = [found for step in spec_run["probe"][0] for found in step["requests"]]
    assert findings and all(found["slots_physical"] and found["lists_its_blocks"] for found in findings)
    assert any(count > 1 and offset > 0 for request in speculated
               for _, count, _, offset in _steps_of(spec_run, 0, request["request_id"]))
    assert spec_run["free_blocks_at_end"] == plain_run["free_blocks_at_end"]


def _speculating_scheduler(num_speculative_tokens: int, **trikv):
    """trikv's scheduler for SmolLM2 with n-gram speculation, on a pool of 64 blocks of 32 (no model: a test steps it
    by hand, as vLLM's engine core does)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from trikv.vllm import engine_args
    from trikv.vllm.scheduler import TriKVScheduler

    speculation = {**NGRAM, "num_speculative_tokens": num_speculative_tokens}
    config = _engine_config(**engine_args(method="streaming", **trikv), speculative_config=speculation)
    config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)]
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return TriKVScheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK)


def test_rejected_drafts_roll_the_physical_length_back_and_rounds_see_verified_tokens_only():
    """trikv's scheduler stepped by hand as vLLM's engine core steps it, with 8 n-gram draft tokens a step, some
    accepted and some rejected (the runner's output is made up: no model runs), on eight requests that advance
    together and fall due on the same steps (at most one round a step, so seven wait). At every step: a request's
    first scheduled token is its verified length (the rejected drafts were rolled back, also in the physical length
    the worker writes at: logical - offset) and it holds a slot for every token of the step, drafts included; a
    round is planned at the request's verified length, over its verified entries only (length = verified - offset),
    at budget + slack or, having waited, within one block past it; a step with drafts ends at budget + slack at the
    latest; a request whose round waits decodes one token, without drafts; no request holds more blocks than its
    bound (budget + slack + one block: chunks of 16 here). Every block is back at the end."""
    import math

    from vllm import SamplingParams
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request

    from trikv.vllm.capacity import request_bound

    k, budget, slack = 8, 64, 32
    trigger = budget + slack
    scheduler = _speculating_scheduler(k, budget=budget, divide_length=slack, prefill_chunk_size=16, max_rounds_per_step=1)
    bound_blocks = math.ceil(request_bound(scheduler.trikv, budget, BLOCK, scheduler.vllm_config) / BLOCK)
    assert bound_blocks == math.ceil((trigger + BLOCK) / BLOCK)  # drafts add nothing to the bound
    for index in range(8):
        scheduler.add_request(Request(f"r{index}", list(range(10 + index, 50 + index)),
                                      SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.0), None))
    verified = {f"r{index}": 0 for index in range(8)}  # tokens whose KV is written and verified
    accepted_per_step = [8, 8, 8, 0, 8, 2, 8, 8, 1, 8, 3]  # the same for every request: they stay together
    steps = waited = rejected = 0
    round_lengths = []
    while scheduler.get_num_unfinished_requests():
        steps += 1
        assert steps < 1000
        offsets_before = dict(scheduler.trikv_offsets)
        output = scheduler.schedule()
        for op in output.trikv.rounds:
            if op.block_ids is not None:  # a finished request's kept state due for its round (session reuse)
                assert op.position < verified[op.request_id] + k and op.length >= trigger
                continue
            assert op.position == verified[op.request_id]  # no draft token counted
            assert op.length == verified[op.request_id] - offsets_before.get(op.request_id, 0)
            assert trigger <= op.length < trigger + BLOCK
            round_lengths.append(op.length)
        ids, sampled = [], []
        for request_id, count in output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            offset = scheduler.trikv_offsets.get(request_id, 0)
            assert output.trikv.offsets.get(request_id, 0) == offset  # what the worker maps positions with
            start = request.num_computed_tokens - count  # vLLM counted the step's tokens when it planned it
            assert start == verified[request_id]
            drafts = output.scheduled_spec_decode_tokens.get(request_id, [])
            held = len(scheduler._trikv_manager.req_to_blocks[request_id])
            assert start - offset + count <= held * BLOCK  # a physical slot for every token, drafts included
            assert held <= bound_blocks
            if drafts:
                assert start - offset + count <= trigger
            if start - offset >= trigger:  # its round waits
                assert count == 1 and not drafts
                waited += 1
            ids.append(request_id)
            if start + count < request.num_tokens:  # a prefill chunk: nothing sampled
                sampled.append([])
                verified[request_id] += count
                continue
            accepted = min(len(drafts), accepted_per_step[steps % len(accepted_per_step)])
            rejected += len(drafts) - accepted
            sampled.append([5] * accepted + [9])
            verified[request_id] = start + count - len(drafts) + accepted
        scheduler.update_from_output(output, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                               sampled_token_ids=sampled))
        running = [r for r in ids if r in scheduler.requests and not scheduler.requests[r].is_finished()]
        for request_id in running:  # the rejected drafts were taken off: logical and physical lengths roll back
            assert scheduler.requests[request_id].num_computed_tokens == verified[request_id]
        scheduler.update_draft_token_ids(DraftTokenIds(running, [[5] * k for _ in running]))
    print(f"{steps} steps, {len(round_lengths)} rounds at lengths {sorted(set(round_lengths))}, {rejected} draft tokens "
          f"rejected, {waited} steps of a waiting round")
    assert rejected > 0 and waited > 0 and trigger in round_lengths and max(round_lengths) > trigger
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_a_round_never_keeps_rejected_draft_entries():
    """Rejected draft tokens leave their KV in the slots past the request's verified entries (vLLM does not clear
    them; the next step writes over them). A round over a request's verified length (the first, and one after an
    earlier round: offset 30) keeps entries of verified positions only, whatever the stale entries hold (tiny or huge
    keys, which a key-norm or recency rule would favour were they counted): the same kept positions, and the cache's
    first `budget` slots hold exactly the kept positions' keys."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from trikv.vllm.compactor import CompactionOp, Compactor
    from trikv.vllm.pages import PageCodec
    from trikv.vllm.settings import BoundedKVSettings

    layers, heads, block_size, head_dim, budget = 2, 3, 32, 64, 40
    isa = _get_attn_isa(torch.float32, block_size, head_dim)
    table = [4, 1, 3]  # the request's blocks

    def write(keys, values, cache, slots):
        view = cache.view(cache.shape[0], heads, 2 * block_size, head_dim)
        key_cache, value_cache = view.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots.long(), isa)

    def run(method: str, stale_scale: float):
        torch.manual_seed(0)
        caches = [torch.zeros(6, heads, block_size, 2 * head_dim) for _ in range(layers)]
        codecs = [PageCodec.learn(write, cache, heads, block_size, head_dim) for cache in caches]
        policy = BoundedKVSettings(method=method, budget=budget).make_policy()
        compactor = Compactor(policy, protect_prompt=False, min_decode_room=0)
        written = {}  # (layer, position) -> its key [Hkv, D]

        def put(positions: range, first_slot: int, scale: float = 1.0):
            slots = torch.tensor([table[s // block_size] * block_size + s % block_size
                                  for s in range(first_slot, first_slot + len(positions))])
            for layer, cache in enumerate(caches):
                keys = torch.randn(len(positions), heads, head_dim) * scale
                write(keys, torch.randn_like(keys), cache, slots)
                written.update({(layer, p): key for p, key in zip(positions, keys)})

        def compact(position: int, length: int):
            op = CompactionOp("r", position=position, length=length, budget=budget, prompt_length=8, kept_blocks=2,
                              freed_blocks=1, free_blocks=0, held_blocks=2)
            compactor.run([op], caches, codecs, {"r": table})
            return compactor.kept_positions["r"].clone()

        put(range(70), 0)  # 70 verified tokens, then 8 rejected drafts at positions 70..77, slots 70..77
        put(range(70, 78), 70, stale_scale)
        first = compact(70, 70)
        put(range(70, 100), 40)  # offset 30: 30 more verified at slots 40..69, then 6 rejected drafts
        put(range(100, 106), 70, stale_scale)
        second = compact(100, 70)
        stored = [codec.gather(cache, torch.tensor([table]))[0][0, :, :budget] for codec, cache in zip(codecs, caches)]
        assert int(first.max()) < 70 and int(second.max()) < 100
        for layer in range(layers):
            for head in range(heads):
                expected = torch.stack([written[layer, int(p)][head] for p in second[layer, head]])
                assert torch.equal(stored[layer][head], expected)
        return first, second

    for method in ("streaming", "knorm"):
        tiny, huge = run(method, 1e-3), run(method, 1e3)
        assert all(torch.equal(a, b) for a, b in zip(tiny, huge))


def test_speculative_methods_with_a_kv_cache_of_their_own_are_refused():
    """N-gram drafts run beside the bounded cache (test_ngram_speculation_...); a draft model (and any drafter with
    a KV cache of its own: EAGLE, MTP) is refused at start-up with the reason, as are untested methods and a number
    of draft tokens that varies with the batch size."""
    from types import SimpleNamespace

    from trikv.models import resolve_model_path
    from trikv.vllm import UnsupportedEngineError, engine_args
    from trikv.vllm.settings import BoundedKVSettings
    from trikv.vllm.support import check_engine_config, speculation_problem

    args = engine_args(method="streaming", budget=64)
    settings = BoundedKVSettings.from_config(args["additional_config"])
    check_engine_config(_engine_config(**args, speculative_config=NGRAM), settings)
    draft_model = _engine_config(**args, speculative_config={"model": resolve_model_path("smollm2-135m"), "num_speculative_tokens": 2})
    with pytest.raises(UnsupportedEngineError, match=r"method 'draft_model' is not supported \(its drafter keeps a KV cache "
                                                     r"of its own, which would stay unbounded"):
        check_engine_config(draft_model, settings)

    def config(method, own_kv=False, per_batch=None):
        return SimpleNamespace(method=method, uses_draft_kv_cache=lambda: own_kv, num_speculative_tokens_per_batch_size=per_batch)

    assert "its drafter keeps a KV cache of its own" in speculation_problem(config("eagle3", own_kv=True))
    assert "it is not tested with a bounded cache" in speculation_problem(config("suffix"))
    assert "num_speculative_tokens_per_batch_size" in speculation_problem(config("ngram", per_batch=[(1, 8, 4)]))
    assert speculation_problem(config("ngram")) is None and speculation_problem(None) is None

    # the workers start before the scheduler and learn pages from KV cache groups the drafter's layers join: the
    # worker refuses it first, with the same reason (not a crash while learning pages)
    from trikv.vllm.worker import TriKVWorker

    worker = TriKVWorker.__new__(TriKVWorker)
    worker.vllm_config = draft_model
    with pytest.raises(UnsupportedEngineError, match=r"method 'draft_model' is not supported \(its drafter keeps a KV cache"):
        worker.init_device()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_codec_reads_and_writes_vllm_cpu_pages(dtype):
    """The codec against vLLM's own CPU KV write (fp32: `vec` pages, keys transposed; bf16 on AMX: VNNI tiles):
    gathering returns exactly the written keys/values, and moving kept entries to the front writes exactly what
    vLLM writes for them."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from trikv.vllm.pages import PageCodec

    blocks, heads, block_size, head_dim = 6, 3, 32, 64
    isa = _get_attn_isa(dtype, block_size, head_dim)

    def write(keys, values, cache, slots):
        view = cache.view(cache.shape[0], heads, 2 * block_size, head_dim)
        key_cache, value_cache = view.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots.long(), isa)

    torch.manual_seed(0)
    cache = torch.zeros(blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    codec = PageCodec.learn(write, cache, heads, block_size, head_dim)
    table = torch.tensor([[4, 1, 3]])  # one request's blocks, out of order
    length = 3 * block_size - 5
    keys = torch.randn(length, heads, head_dim).to(dtype)
    values = torch.randn(length, heads, head_dim).to(dtype)
    slots = (table[0, torch.arange(length) // block_size] * block_size + torch.arange(length) % block_size)
    write(keys, values, cache, slots)
    got_keys, got_values = codec.gather(cache, table)
    assert torch.equal(got_keys[0, :, :length], keys.transpose(0, 1))
    assert torch.equal(got_values[0, :, :length], values.transpose(0, 1))

    # moving kept entries to the front writes exactly what vLLM writes for those entries at those slots
    order = torch.stack([torch.randperm(length)[:40].sort().values for _ in range(heads)])[None]  # [1, Hkv, 40]
    kept_keys = keys.transpose(0, 1).gather(1, order[0, :, :, None].expand(heads, 40, head_dim))  # [Hkv, 40, D]
    kept_values = values.transpose(0, 1).gather(1, order[0, :, :, None].expand(heads, 40, head_dim))
    by_vllm = cache.clone()
    write(kept_keys.transpose(0, 1).contiguous(), kept_values.transpose(0, 1).contiguous(), by_vllm, slots[:40])
    codec.move(cache, table, order)
    assert torch.equal(cache, by_vllm)


FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fp8_like_vllm_cpu(x: torch.Tensor, scale: float, fmt: torch.dtype) -> torch.Tensor:
    """x / scale in the fp8 format `fmt` as vLLM's CPU KV write stores it: rounded toward zero (torch's conversion
    rounds to nearest; where that went away from zero, the code one step nearer zero: fp8 codes are sign and
    magnitude, the magnitude monotonic in the code)."""
    nearest = (x.float() / scale).to(fmt)
    away = nearest.float().abs() > (x.float() / scale).abs()
    return (nearest.view(torch.uint8).int() - away.int()).to(torch.uint8).view(fmt)


# vLLM's CPU build stores an fp8 KV cache only on x86 with AVX-512 or AMX (`cpu_attn._get_attn_isa`): elsewhere it
# refuses it (NotImplementedError), so there is no fp8 page to read; the tests say why they skip
FP8_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
needs_fp8_cpu = pytest.mark.skipif(not FP8_CPU, reason="vLLM's CPU build stores an fp8 KV cache on x86 with AVX-512 or "
                                                       "AMX only, and this CPU has neither")


@needs_fp8_cpu
@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8_FORMATS))
def test_page_codec_reads_fp8_pages_with_their_scales(kv_cache_dtype):
    """An fp8 KV cache through vLLM's own CPU KV write (uint8 pages, keys and values divided by the layer's scales,
    0.7 and 1.9 here, rounded toward zero): the codec learns the page with scales of 1, gathers exactly the bytes an
    independent model of that write gives, reads keys back as bytes x 0.7 (what attention reads), moves kept
    entries bytewise to where vLLM writes them; a round (Knorm, no protection) keeps the 40 keys of lowest norm of
    those dequantised keys, with their bytes, per KV head."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from trikv.policies import make_policy
    from trikv.vllm.compactor import CompactionOp, Compactor
    from trikv.vllm.pages import PageCodec

    fmt, k_scale, v_scale = FP8_FORMATS[kv_cache_dtype], 0.7, 1.9
    blocks, heads, block_size, head_dim = 6, 3, 32, 64
    isa = _get_attn_isa(torch.float32, block_size, head_dim, kv_cache_dtype)

    def write(keys, values, cache, slots, scales=(1.0, 1.0)):
        view = cache.view(cache.shape[0], heads, 2 * block_size, head_dim)
        key_cache, value_cache = view.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots.long(), isa, k_scale=scales[0],
                                       v_scale=scales[1], kv_cache_dtype=kv_cache_dtype)

    torch.manual_seed(0)
    cache = torch.zeros(blocks, heads, block_size, 2 * head_dim, dtype=torch.uint8)
    codec = PageCodec.learn(write, cache, heads, block_size, head_dim, fmt, torch.float32)
    assert codec.quantised == fmt and codec.key_bytes(cache) == 1 + 4
    table = torch.tensor([[4, 1, 3]])
    length = 3 * block_size - 5
    keys = torch.randn(length, heads, head_dim) * torch.rand(length, heads, 1) * 6
    values = torch.randn(length, heads, head_dim)
    slots = table[0, torch.arange(length) // block_size] * block_size + torch.arange(length) % block_size
    write(keys, values, cache, slots, (k_scale, v_scale))
    stored_keys = fp8_like_vllm_cpu(keys, k_scale, fmt).transpose(0, 1)  # [Hkv, n, D]
    stored_values = fp8_like_vllm_cpu(values, v_scale, fmt).transpose(0, 1)
    got_keys, got_values = codec.gather(cache, table)
    assert torch.equal(got_keys[0, :, :length], stored_keys.view(torch.uint8))
    assert torch.equal(got_values[0, :, :length], stored_values.view(torch.uint8))
    dequantised = stored_keys.float() * k_scale
    read = codec.read_keys(cache, codec.locate(table, cache), torch.tensor(k_scale))
    assert read.dtype == torch.float32 and torch.equal(read[0, :, :length], dequantised)

    before = cache.clone()
    compactor = Compactor(make_policy("knorm"), protect_prompt=False, min_decode_room=0, record=True)
    op = CompactionOp("r", position=length, length=length, budget=40, prompt_length=4, kept_blocks=2, freed_blocks=1,
                      free_blocks=0, held_blocks=0)
    compactor.run([op], [cache], [codec], {"r": table[0].tolist()}, [torch.tensor(k_scale)])
    expected = dequantised.norm(dim=-1).topk(40, largest=False).indices.sort().values  # [Hkv, 40]
    assert torch.equal(compactor.kept_positions["r"][0].long(), expected)
    by_vllm = before.clone()
    for head in range(heads):  # what vLLM writes for the kept entries at slots [0, 40), head by head
        kept = expected[head]
        head_cache = before.clone()
        write(keys[kept].contiguous(), values[kept].contiguous(), head_cache, slots[:40], (k_scale, v_scale))
        by_vllm[:, head] = head_cache[:, head]
    assert torch.equal(cache[table[0, :2]], by_vllm[table[0, :2]])


FP8_SCALES = {"k": 1.5, "v": 0.8}  # a quantised checkpoint's per-layer KV scales (not 1: they must be applied)


def _fp8(request, prompts, kv_cache_dtype: str) -> dict:
    keys_path = request.getfixturevalue("engines_dir") / f"{kv_cache_dtype}.keys.pt"
    return {"dtype": "float32", "trikv": _trikv_settings(), "engine": {"kv_cache_dtype": kv_cache_dtype, "num_gpu_blocks_override": POOL},
            "kv_scales": FP8_SCALES, "record_keys": str(keys_path), "batches": [{"prompts": prompts[1:], "max_tokens": 110}]}


for _kv_cache_dtype in ("fp8", "fp8_e5m2"):
    scenario(_kv_cache_dtype)(lambda request, prompts, kv_cache_dtype=_kv_cache_dtype: _fp8(request, prompts, kv_cache_dtype))


@needs_fp8_cpu
@pytest.mark.parametrize("kv_cache_dtype", [  # e5m2, fp8's second format: with --full (`extended`)
    pytest.param(name, marks=([pytest.mark.engines(name)] if FP8_CPU else []) + ([pytest.mark.extended] if name == "fp8_e5m2" else []))
    for name in ("fp8", "fp8_e5m2")])
def test_fp8_kv_cache_keeps_what_transformers_keeps_on_the_same_dequantised_keys(real_model, engine_runs, kv_cache_dtype):
    """A bounded engine with an fp8 KV cache (per-layer scales 1.5 for keys, 0.8 for values). The keys its layers hand
    vLLM's KV write are recorded, quantised and dequantised as that write stores them (modelled on its own: rounding
    toward zero, bitwise equal to the kernel in test_page_codec_reads_fp8_pages_with_their_scales) and fed to trikv's
    transformers cache in vLLM's steps: every round keeps the set the transformers path keeps on those dequantised
    keys. (Its tokens are not compared with a transformers forward: a last-bit difference between vLLM's and
    transformers' kernels moves a value across an fp8 rounding boundary now and then, and the layers after it
    amplify the step.) A decoding request then holds budget + divide_length entries of one byte per element: a block
    of the fp8 pool is a quarter of the fp32 pool's, and the run's largest request held the blocks of its 120-token
    prompt (prefilled whole: it is below budget + divide_length + one chunk)."""
    model, _ = real_model
    stats = trikv.load_stats("smollm2-135m", model)
    run = engine_run(engine_runs, kv_cache_dtype)
    written = torch.load(run["keys_written"])
    fmt, scale = FP8_FORMATS[kv_cache_dtype], FP8_SCALES["k"]
    for request in run["batches"][0]["requests"]:
        rounds = _rounds_of(run, request["request_id"])
        assert len(rounds) >= 2
        (request_id,) = [rid for rid in written if rid.split("-")[0] == request["request_id"]]
        keys = {}
        for layer, (positions, raw) in written[request_id].items():
            assert positions.tolist() == list(range(len(positions)))  # every position once, in order
            keys[layer] = fp8_like_vllm_cpu(raw, scale, fmt).float() * scale
        report = feed_keys(model, "triattention", request, rounds, keys, tie=1e-3, stats=stats)
        print(f"{kv_cache_dtype} request {request['request_id']}: {report['rounds']} rounds, {report['tied_heads']} of "
              f"{report['heads']} (layer, head) sets differ by float ties (max {report['max_tie']:.2e} std)")
        assert report["tied_heads"] == 0
    (group,) = run["kv_groups"]
    config = model.config
    entry_bytes = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 2  # K and V, one layer
    assert group["page_size_bytes"] == group["block_size"] * entry_bytes  # a layer's block: one byte per element
    blocks = run["stats"][0]["max_request_blocks"]
    longest = max(len(r["prompt"]) for r in run["batches"][0]["requests"])  # 120 tokens, prefilled whole
    assert blocks == math.ceil(max(BUDGET + SLACK, longest) / group["block_size"])
    held = blocks * group["page_size_bytes"] * group["layers"]
    print(f"{kv_cache_dtype}: a request holds at most {blocks} blocks = {held:,} bytes of KV over {group['layers']} layers "
          f"({(BUDGET + SLACK) * entry_bytes * group['layers']:,} bytes for its {BUDGET + SLACK} entries; fp32: four times as many)")
    assert run["free_blocks_at_end"] == POOL - 1


@pytest.mark.extended  # three worker processes
@pytest.mark.engines("fp32")
def test_tensor_parallel_3_equals_tp_1(engines_dir, prompts, fp32_run):
    """TP=3 on SmolLM2 (3 KV heads: one per rank, scored with the statistics of its 3 query heads), the longest prompt
    (its first round right after the prefill, then one every 32 tokens): the same tokens as TP=1 (the first 40 of the
    fp32 run) and, on every rank, the same kept set as TP=1's head at every round."""
    new_tokens = 40
    run = engine_run(run_engines(engines_dir, {"tp3": {
        "dtype": "float32", "trikv": _trikv_settings(),
        "engine": {"tensor_parallel_size": 3, "skip_tokenizer_init": True}, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1|1"},
        "in_process": False, "batches": [{"prompts": prompts[2:], "max_tokens": new_tokens}],
    }}), "tp3")
    single_requests = fp32_run["batches"][0]["requests"][2:]
    assert [r["tokens"] for r in run["batches"][0]["requests"]] == [r["tokens"][:new_tokens] for r in single_requests]
    assert len(run["rounds"]) == 3
    for mine, single_request in zip(run["batches"][0]["requests"], single_requests):
        end = len(single_request["prompt"]) + new_tokens
        single = [r for r in _rounds_of(fp32_run, single_request["request_id"]) if r["position"] < end]
        assert len(single) >= 2
        for rank in range(3):
            ranked = _rounds_of(run, mine["request_id"], rank)
            assert [r["position"] for r in ranked] == [r["position"] for r in single]
            for record, reference in zip(ranked, single):
                assert torch.equal(torch.tensor(record["kept_positions"])[:, 0], torch.tensor(reference["kept_positions"])[:, rank])


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.extended  # a server process (the README's openai snippet starts `trikv serve` and talks to it in every run)
def test_http_server_streams_a_chat_completion_with_the_bounded_cache(tmp_path):
    """`trikv serve` streams a chat completion with the bounded cache; over the official `openai` client a request
    chooses its own budget within the server's limits, and a budget outside them and beam search get HTTP 400 with
    the reason. The server's pool (48 blocks of 32) is smaller than its max_model_len (2048): a full-attention request
    whose prompt the pool cannot hold gets HTTP 400 with the reason, a shorter one is served, GET /trikv/stats reports
    the most blocks a bounded request held (within its bound); a short soak leaves no per-request state; `trikv bench
    serve --modes http --url` measures this server and `trikv bench serve-report` renders its run."""
    import urllib.request

    import openai

    from trikv.benchmarks.serving_engine import stop_server, wait_ready

    port = _free_port()
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "trikv.cli", "serve", "--budget", str(BUDGET), "--divide-length", str(SLACK), "--port", str(port),
               "--max-request-budget", "96", "--allow-full-requests",
               "--", "--dtype", "float32", "--max-model-len", "2048", "--block-size", str(BLOCK), "--enforce-eager",
               "--num-gpu-blocks-override", "48"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
                                  start_new_session=True)
    try:
        wait_ready(server, port, log_path, timeout=300)
        body = {"model": "smollm2-135m", "stream": True, "max_tokens": 120, "min_tokens": 120, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        chunks = []
        with urllib.request.urlopen(request, timeout=300) as response:
            for line in response:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    if delta.get("content"):
                        chunks.append(delta["content"])
        assert len(chunks) > 50 and "".join(chunks).strip()
        assert f"-> {BUDGET} entries per KV head" in log_path.read_text()

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        chat = dict(model="smollm2-135m", max_tokens=100, temperature=0,
                    messages=[{"role": "user", "content": "Describe the sea at night."}])
        answer = client.chat.completions.create(**chat, extra_body={"min_tokens": 100, "vllm_xargs": {"trikv_budget": 40}})
        assert answer.usage.completion_tokens == 100
        assert "-> 40 entries per KV head" in log_path.read_text()  # its own budget, below the server's
        refusals = {"outside this server's limits [16, 96]": {"vllm_xargs": {"trikv_budget": 500}},
                    "must be an integer number of KV entries": {"vllm_xargs": {"trikv_budget": "lots"}},
                    "beam search is not supported": {"use_beam_search": True, "n": 2},
                    # JSON true (which vLLM's request model would take as 1), a misspelt key, a budget under the
                    # minimum, trikv settings beside vllm_xargs instead of inside it
                    "or 'full', got true": {"vllm_xargs": {"trikv_budget": True}},
                    "unknown trikv request setting(s) ['trikv_budgett']": {"vllm_xargs": {"trikv_budgett": 40}},
                    "limits [16, 96] (at least 16": {"vllm_xargs": {"trikv_budget": 8}},
                    "['trikv'] is not a request field: trikv's request settings go inside vllm_xargs": {"trikv": {"budget": 40}},
                    "['trikv_budget'] is not a request field": {"trikv_budget": 40},
                    'trikv_session must be "on" or "off", got true': {"vllm_xargs": {"trikv_session": True}},
                    "trikv_session must be \"on\" or \"off\", got 'maybe'": {"vllm_xargs": {"trikv_session": "maybe"}}}
        for reason, extra_body in refusals.items():
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(**chat, extra_body=extra_body)
            assert refused.value.status_code == 400 and reason in str(refused.value), str(refused.value)
        # full attention holds its whole sequence: 47 usable blocks of 32 hold 1,504 tokens of one request
        full = {"vllm_xargs": {"trikv_budget": "full"}}
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="smollm2-135m", prompt=list(range(1000, 2600)), max_tokens=5, extra_body=full)
        assert refused.value.status_code == 400, str(refused.value)
        assert ("of 1600 prompt tokens does not fit this server's KV pool, which holds at most 1504 tokens"
                in str(refused.value)), str(refused.value)
        assert client.completions.create(model="smollm2-135m", prompt=list(range(1000, 1500)), max_tokens=5,
                                         extra_body=full).usage.completion_tokens <= 5
        assert server.poll() is None  # refusals leave the server serving
        assert client.chat.completions.create(**{**chat, "max_tokens": 5}).usage.completion_tokens <= 5
        # a conversation's second turn, re-sent whole as a chat client does, continues the kept state of its first
        conversation = [{"role": "user", "content": "Describe the sea at night."}]
        first = client.chat.completions.create(model="smollm2-135m", messages=conversation, max_tokens=20, temperature=0)
        conversation += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And in the morning?"}]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/trikv/stats", timeout=30) as response:
            (before,) = json.loads(response.read())
        client.chat.completions.create(model="smollm2-135m", messages=conversation, max_tokens=5, temperature=0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/trikv/stats", timeout=30) as response:
            (stats,) = json.loads(response.read())
        assert 0 < stats["max_request_blocks"] <= math.ceil((96 + SLACK + 512) / BLOCK)  # at the largest request budget
        sessions = stats["sessions"]
        assert sessions["enabled"] and sessions["hits"] + sessions["partial_hits"] == \
            before["sessions"]["hits"] + before["sessions"]["partial_hits"] + 1
        assert sessions["kept_now"] >= 1 and sessions["kept_blocks"] >= 1

        # `trikv bench soak` in short against this server: mixed prompt and output lengths, a third of the requests
        # closed by the client mid-stream; afterwards GET /trikv/stats shows no per-request state left, every other
        # request got all its tokens and the server still answers (the 2,000-request run is a benchmark)
        out = tmp_path / "soak"
        done = subprocess.run([sys.executable, "-m", "trikv.cli", "bench", "soak", "--requests", "12", "--concurrency", "6",
                               "--abort-share", "0.3", "--sample-every", "3", "--max-new-tokens", "60",
                               "--url", f"http://127.0.0.1:{port}", "--server-pid", str(server.pid), "--out", str(out),
                               "--no-progress"], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        soak = json.loads((out / "soak.json").read_text())
        assert soak["errors"] == 0 and soak["incomplete"] == 0 and soak["server_alive_at_end"]
        assert soak["aborted"] > 0 and soak["compacted_requests"] > 0
        assert soak["compacted_running_at_end"] == []
        assert len(soak["samples"]) >= 4 and all(sample["rss_bytes"] > 0 for sample in soak["samples"])
        assert (out / "soak.png").exists()

        # `trikv bench serve --modes http` against this server (its settings: budget 64, slack 32, blocks of 32), then
        # `trikv bench serve-report` of that run
        bench = tmp_path / "http"
        done = subprocess.run([sys.executable, "-m", "trikv", "bench", "serve", *SMALL_BENCH, "--methods", "triattention",
                               "--modes", "http", "--concurrency", "4", "--url", f"http://127.0.0.1:{port}", "--out", str(bench)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        (run,) = json.loads((bench / "serving.json").read_text())["runs"]
        assert run["mode"] == "http" and run["output_tokens"] > 0 and run["tpot_seconds"]["p50"] > 0
        page = tmp_path / "serving.md"
        done = subprocess.run([sys.executable, "-m", "trikv", "bench", "serve-report", str(bench), "--out", str(page)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "## Run `http`" in page.read_text() and "triattention-B64-n4" in page.read_text()
    finally:
        stop_server(server)
    assert "trikv: request" in log_path.read_text() and "compacted at" in log_path.read_text()


# ---- bad configuration: refused at start-up, with a message that names the problem ----------------------
def _engine_config(**overrides):
    from vllm import EngineArgs

    from trikv.models import resolve_model_path

    return EngineArgs(model=resolve_model_path("smollm2-135m"), enforce_eager=True, max_model_len=1024, block_size=BLOCK,
                      **overrides).create_engine_config()


def test_bad_settings_are_refused_with_their_name():
    from trikv.vllm import SettingsError, engine_args

    with pytest.raises(SettingsError, match="unknown method 'nope'"):
        engine_args(method="nope")
    with pytest.raises(SettingsError, match="needs observed queries"):
        engine_args(method="snapkv")
    with pytest.raises(SettingsError, match="needs observed queries"):  # the window term reads recent queries
        engine_args(method="triattention-window", stats="smollm2-135m")
    with pytest.raises(SettingsError, match="needs calibration statistics"):
        engine_args(method="triattention")
    with pytest.raises(SettingsError, match="budget must be a positive integer"):
        engine_args(method="streaming", budget=0)
    with pytest.raises(SettingsError, match="has no option"):
        engine_args(method="streaming", sinks_count=3)
    with pytest.raises(ValueError, match="no statistics file"):
        engine_args(method="triattention", stats="/nonexistent/stats.safetensors")


def test_request_budget_limits_and_refusals():
    """A request's own budget: the server's by default, its own within [window + 1, max_request_budget], "full" only
    where allowed; streaming-input sessions and beam search are refused in vLLM's frontend with the reason."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import BeamSearchParams
    from vllm.v1.engine.input_processor import InputProcessor

    from trikv.vllm import BoundedKVSettings, RequestSettingsError, SettingsError, engine_args
    from trikv.vllm.frontend import check_request

    recent = dict(method="triattention-recent", stats="smollm2-135m", budget=64)  # a 32-token recent window
    settings = BoundedKVSettings(**recent, max_request_budget=128)
    assert settings.request_budget(None) == settings.request_budget({}) == 64
    assert settings.request_budget({"trikv_budget": 33}) == 33 and settings.request_budget({"trikv_budget": 128}) == 128
    for choice, reason in [(32, r"outside this server's limits \[33, 128\]"), (129, "outside"), ("full", "allow_full_requests"),
                           (True, "must be an integer"), (64.0, "must be an integer"), ("64", "must be an integer")]:
        with pytest.raises(RequestSettingsError, match=reason):
            settings.request_budget({"trikv_budget": choice})
    assert BoundedKVSettings(method="knorm", budget=64, allow_full_requests=True).request_budget({"trikv_budget": "full"}) is None
    with pytest.raises(RequestSettingsError, match=r"\[16, 64\].*at most budget"):
        BoundedKVSettings(method="knorm", budget=64).request_budget({"trikv_budget": 65})
    for bad, reason in [({"max_request_budget": 0}, "max_request_budget must be a positive integer"),
                        ({"max_request_budget": 32}, "max_request_budget 32 is not larger than the protected recent window"),
                        ({"allow_full_requests": "yes"}, "allow_full_requests must be true or false")]:
        with pytest.raises(SettingsError, match=reason):
            BoundedKVSettings(**recent, **bad)
    with pytest.raises(VLLMValidationError, match="streaming-input sessions are not supported"):
        check_request(settings, SamplingParams(), resumable=True)

    # through vLLM's own InputProcessor, as the API server runs it
    processor = InputProcessor(_engine_config(**engine_args(method="knorm", budget=64)))
    prompt = {"type": "token", "prompt_token_ids": [1, 2, 3]}
    assert processor.process_inputs("ok", prompt, SamplingParams(max_tokens=4, extra_args={"trikv_budget": 32}), ("generate",))
    with pytest.raises(VLLMValidationError, match="outside this server's limits"):
        processor.process_inputs("big", prompt, SamplingParams(max_tokens=4, extra_args={"trikv_budget": 65}), ("generate",))
    with pytest.raises(VLLMValidationError, match="does not run requests with full attention"):
        processor.process_inputs("full", prompt, SamplingParams(max_tokens=4, extra_args={"trikv_budget": "full"}), ("generate",))
    with pytest.raises(VLLMValidationError, match="streaming-input sessions"):
        processor.process_inputs("stream", prompt, SamplingParams(max_tokens=4), ("generate",), resumable=True)
    with pytest.raises(VLLMValidationError, match="beam search is not supported"):
        processor.resolve_watermarking(BeamSearchParams(beam_width=2, max_tokens=4))
    plain = InputProcessor(_engine_config())  # an engine without trikv settings is not affected
    assert plain.process_inputs("plain", prompt, SamplingParams(max_tokens=4, extra_args={"trikv_budget": 10**6}), ("generate",))
    plain.resolve_watermarking(BeamSearchParams(beam_width=2, max_tokens=4))


def test_a_pool_smaller_than_max_model_len_starts_with_trikv_only():
    """vLLM's start-up check (`get_kv_cache_configs`, on the specs the workers report) for SmolLM2's 30 layers, a pool
    of 16 blocks of 128 and max_model_len 8192: plain vLLM refuses it with its own message; the specs trikv's worker
    reports (`bounded_kv_cache_specs`) count one request at trikv's bound, budget 256 + divide_length 128 + prefill
    chunk 512 = 896 tokens = 7 blocks, so the same pool is accepted. The spec survives vLLM's grouping (one group,
    its class kept) and pickling (how it reaches the engine core), an engine without trikv settings keeps vLLM's own
    count, and other kinds of spec are left as they are."""
    import pickle

    from vllm import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from trikv.models import resolve_model_path
    from trikv.vllm import engine_args
    from trikv.vllm.capacity import BoundedFullAttentionSpec, bounded_kv_cache_specs

    def config(**extra):
        built = EngineArgs(model=resolve_model_path("smollm2-135m"), max_model_len=8192, num_gpu_blocks_override=16,
                           gpu_memory_utilization=0.5, enforce_eager=True, block_size=128, **extra).create_engine_config()
        built.cache_config.kv_cache_layout = "LBNHC"  # the engine core resolves it from its workers' backends
        return built

    spec = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    specs = {f"model.layers.{index}.self_attn.attn": spec for index in range(30)}
    plain = config()
    with pytest.raises(ValueError, match=r"To serve at least one request with the model's max seq len \(8192\)"):
        get_kv_cache_configs(plain, [specs], [2**30])
    bounded_config = config(**engine_args(method="triattention", budget=256, stats="smollm2-135m"))
    bounded = bounded_kv_cache_specs(specs)
    (kv_config,) = get_kv_cache_configs(bounded_config, [bounded], [2**30])
    (group,) = kv_config.kv_cache_groups
    assert kv_config.num_blocks == 16 and len(group.layer_names) == 30
    assert type(group.kv_cache_spec) is BoundedFullAttentionSpec
    assert group.kv_cache_spec.max_memory_usage_bytes(bounded_config) == 7 * spec.page_size_bytes
    assert group.kv_cache_spec.max_memory_usage_bytes(plain) == 8192 // 128 * spec.page_size_bytes
    one = bounded["model.layers.0.self_attn.attn"]
    again = pickle.loads(pickle.dumps(one))
    assert type(again) is BoundedFullAttentionSpec and again == one and again != spec
    sliding = SlidingWindowSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=512)
    assert bounded_kv_cache_specs({"sliding": sliding})["sliding"] is sliding


def test_a_request_bound_counts_budget_slack_and_one_chunk():
    """The bound every part of the engine reads: budget + divide_length + one prefill chunk (vLLM's own per-step token
    cap where smaller), or one block where a block is larger (a decoding request whose round waits for the step's
    limit grows within one more block), at most max_model_len; prefill_chunk_size is validated with the other cache
    settings and reaches vLLM's configuration."""
    from types import SimpleNamespace

    from trikv.settings import DEFAULT_PREFILL_CHUNK_SIZE
    from trikv.vllm import BoundedKVSettings, SettingsError, engine_args
    from trikv.vllm.capacity import request_bound

    settings = BoundedKVSettings(method="streaming", budget=64, divide_length=32, prefill_chunk_size=200, max_request_budget=96)
    assert settings.peak_entries(64, 32, 4096) == 296 and settings.peak_entries(48, 32, 100) == 180
    # the scheduler compacts at the trigger the bound starts from
    assert settings.round_trigger(48) == 80 and settings.peak_entries(48, 32, 4096) == settings.round_trigger(48) + 200
    assert settings.largest_request_budget == 96
    late = BoundedKVSettings(method="streaming", budget=64, divide_length=32, prefill_chunk_size=200, max_rounds_per_step=2)
    assert late.peak_entries(64, 32, 4096) == 296  # a chunk of 200 is larger than the block of 32 a round may wait
    assert late.peak_entries(64, 256, 4096) == 64 + 32 + 256 and settings.peak_entries(64, 32, 20) == 64 + 32 + 32

    def vllm_config(max_model_len, batched, scheduled=None):
        return SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len),
                               scheduler_config=SimpleNamespace(max_num_batched_tokens=batched, max_num_scheduled_tokens=scheduled))

    assert request_bound(settings, 64, 32, vllm_config(8192, 2048)) == 296
    assert request_bound(settings, 64, 32, vllm_config(8192, 2048, scheduled=64)) == 160
    assert request_bound(settings, 64, 32, vllm_config(256, 2048)) == 256
    assert BoundedKVSettings(method="streaming", budget=64).prefill_chunk_size == DEFAULT_PREFILL_CHUNK_SIZE == 512
    for bad in (1, 0, True, 2.5, "512"):
        with pytest.raises(SettingsError, match=f"prefill_chunk_size must be an integer >= 2, got {bad!r}"):
            BoundedKVSettings(method="streaming", budget=64, prefill_chunk_size=bad)
    with pytest.raises(SettingsError, match="prefill_chunk_size must be an integer >= 2, got 1"):
        engine_args(method="streaming", budget=64, prefill_chunk_size=1)
    args = engine_args(method="streaming", budget=64, prefill_chunk_size=256)
    assert args["additional_config"]["trikv"]["prefill_chunk_size"] == 256


def test_rounds_per_step_default_and_which_rounds_wait():
    """trikv's default limit on the rounds one step starts: 4 (a round at 8B-model shapes costs about a quarter of a
    decode step), raised to twice the average rate at which max_num_seqs requests fall due (every divide_length
    tokens); an explicit max_rounds_per_step wins. Past the limit the longest due requests go first, and a request
    that is still prefilling or would need a block past budget + divide_length + one block never waits."""
    from types import SimpleNamespace

    from trikv.vllm import BoundedKVSettings
    from trikv.vllm.scheduler import TriKVScheduler

    assert BoundedKVSettings(method="streaming", budget=64).rounds_per_step(256) == 4  # divide_length 128
    assert BoundedKVSettings(method="streaming", budget=64, divide_length=32).rounds_per_step(256) == 16
    assert BoundedKVSettings(method="streaming", budget=64, divide_length=32).rounds_per_step(8) == 4
    assert BoundedKVSettings(method="streaming", budget=64, max_rounds_per_step=2).rounds_per_step(256) == 2
    settings = BoundedKVSettings(method="streaming", budget=64, divide_length=32)
    scheduler = SimpleNamespace(trikv=settings, _trikv_block=32, _trikv_rounds_per_step=2)

    def request(name, computed, total):
        return SimpleNamespace(request_id=name, num_computed_tokens=computed, num_tokens=total)

    due = [(request("decoding-96", 200, 201), 64, 96), (request("decoding-100", 204, 205), 64, 100),
           (request("decoding-127", 300, 301), 64, 127), (request("decoding-128", 301, 302), 64, 128),
           (request("prefilling-96", 96, 600), 64, 96), (request("decoding-97", 201, 202), 64, 97)]
    chosen = [item[0].request_id for item in TriKVScheduler._spread(scheduler, due)]
    # must: the prefill and the one at trigger + block (128 = 64 + 32 + 32); then the longest that can wait, up to 2
    assert chosen == ["decoding-128", "prefilling-96"]
    scheduler._trikv_rounds_per_step = 4
    chosen = [item[0].request_id for item in TriKVScheduler._spread(scheduler, due)]
    assert chosen == ["decoding-128", "prefilling-96", "decoding-127", "decoding-100"]
    scheduler._trikv_rounds_per_step = 6
    assert TriKVScheduler._spread(scheduler, due) == due


def test_trikv_serve_and_vllm_args_take_the_prefill_chunk_size(capsys):
    import argparse

    from trikv.vllm import SettingsError
    from trikv.vllm.cli import add_vllm_commands

    parser = argparse.ArgumentParser()
    add_vllm_commands(parser.add_subparsers())
    args = parser.parse_args(["vllm-args", "--method", "streaming", "--budget", "64", "--prefill-chunk-size", "256"])
    assert args.func(args) == 0
    assert '"prefill_chunk_size": 256' in capsys.readouterr().out
    args = parser.parse_args(["serve", "--budget", "64", "--prefill-chunk-size", "128", "--dry-run"])
    assert args.func(args) == 0
    assert '"prefill_chunk_size": 128' in capsys.readouterr().out
    args = parser.parse_args(["vllm-args", "--method", "streaming", "--budget", "64", "--prefill-chunk-size", "1"])
    with pytest.raises(SettingsError, match="prefill_chunk_size must be an integer >= 2, got 1"):
        args.func(args)


def test_a_full_attention_request_the_pool_cannot_hold_is_refused_in_the_front_end():
    """Through vLLM's own InputProcessor, as the API server runs it, once the engine reported its pool (5 blocks of
    32, one kept back by vLLM: 128 tokens): a full-attention request whose prompt and first token need more is
    refused with the reason (HTTP 400), one that fits passes, and bounded requests of any length within
    max_model_len pass (they never hold more than their bound); before the pool is known nothing is refused."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    from trikv.vllm import engine_args

    processor = InputProcessor(_engine_config(**engine_args(method="knorm", budget=64, allow_full_requests=True)))
    full = SamplingParams(max_tokens=4, extra_args={"trikv_budget": "full"})

    def prompt(length):
        return {"type": "token", "prompt_token_ids": list(range(1, length + 1))}

    assert processor.process_inputs("unknown pool", prompt(500), full, ("generate",))
    processor.vllm_config.cache_config.num_gpu_blocks = 5
    assert processor.process_inputs("fits", prompt(127), full, ("generate",))
    with pytest.raises(VLLMValidationError, match="of 128 prompt tokens does not fit this server's KV pool, which holds at "
                                                  "most 128 tokens") as refused:
        processor.process_inputs("too long", prompt(128), full, ("generate",))
    assert "shorten the prompt to at most 127 tokens" in str(refused.value)
    assert processor.process_inputs("bounded", prompt(1000), SamplingParams(max_tokens=4), ("generate",))


def test_served_methods_declare_row_independent_scores(monkeypatch):
    """A round scores every request due in a step together, so a method whose scores mix requests is not served."""
    import trikv.vllm.settings as settings
    from trikv.policies import REGISTRY, PolicyEntry, StreamingLLM

    class Coupled(StreamingLLM):
        scores_rows_independently = False

    monkeypatch.setattr(settings, "REGISTRY", {**REGISTRY, "coupled": PolicyEntry("coupled", Coupled)})
    assert "streaming" in settings.serving_methods() and "coupled" not in settings.serving_methods()


def test_unsupported_vllm_version_is_refused():
    from trikv.vllm import SUPPORTED_VLLM, UnsupportedEngineError, check_vllm_version

    assert check_vllm_version() == vllm.__version__
    with pytest.raises(UnsupportedEngineError, match=f"vLLM 0.31.0 is not supported by trikv; supported: vllm{SUPPORTED_VLLM}"):
        check_vllm_version("0.31.0")
    with pytest.raises(UnsupportedEngineError, match="0.33.1"):
        check_vllm_version("0.33.1")


def test_prefix_caching_and_other_features_are_refused():
    """What a bounded cache cannot run beside is refused at start-up with the reason (prefix caching, once refused, is
    accepted: trikv's arguments leave it off unless asked): KV caches with
    scales per token (fp8 with one scale per layer is read), pipeline and context parallelism, KV connectors
    (speculative decoding other than n-gram drafts: test_speculative_methods_with_a_kv_cache_of_their_own_are_refused)."""
    import re

    from trikv.vllm import UnsupportedEngineError, engine_args
    from trikv.vllm.settings import BoundedKVSettings
    from trikv.vllm.support import check_engine_config

    args = engine_args(method="streaming", budget=64)
    settings = BoundedKVSettings.from_config(args["additional_config"])
    check_engine_config(_engine_config(**args), settings)  # the arguments trikv gives are accepted
    assert args["enable_prefix_caching"] is False and engine_args(method="streaming", prefix_caching=True)["enable_prefix_caching"]
    check_engine_config(_engine_config(**{**args, "enable_prefix_caching": True}), settings)  # runs beside a bounded cache
    for fp8 in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # one scale per layer: read (test_fp8_kv_cache_keeps_what_...)
        check_engine_config(_engine_config(**{**args, "kv_cache_dtype": fp8}), settings)
    with pytest.raises(UnsupportedEngineError, match="KV cache dtype 'fp8_per_token_head': trikv compacts the model's own"):
        check_engine_config(_engine_config(**{**args, "kv_cache_dtype": "fp8_per_token_head"}), settings)
    refusals = {"pipeline parallelism (2 stages) is not supported": ("parallel_config", "pipeline_parallel_size"),
                "context parallelism is not supported": ("parallel_config", "decode_context_parallel_size"),
                "KV connectors (disaggregated prefill, offloading) are not supported": ("kv_transfer_config", None)}
    for reason, (part, field) in refusals.items():  # set on a built configuration: this machine cannot build all of them
        config = _engine_config(**args)
        if field is None:
            setattr(config, part, object())
        else:
            setattr(getattr(config, part), field, 2)
        with pytest.raises(UnsupportedEngineError, match=re.escape(reason)):
            check_engine_config(config, settings)


def _tiny_llama_stats(folder: Path) -> Path:
    from helpers import tiny_model

    from trikv.calibration import calibrate

    path = folder / "tiny.safetensors"
    if not path.exists():
        calibrate(tiny_model("llama"), torch.randint(1, 90, (64,)), source="random", progress=False).save(path)
    return path


@scenario("stats-of-another-model")
def _stats_of_another_model(request, prompts):
    stats_path = _tiny_llama_stats(request.getfixturevalue("engines_dir"))
    return {"dtype": "float32", "trikv": {"method": "triattention", "budget": 64, "stats": str(stats_path)}, "batches": []}


@pytest.mark.engines("stats-of-another-model")
def test_stats_of_another_model_are_refused(engines_dir, engine_runs):
    """Statistics calibrated on another model (here a tiny random Llama) stop the engine at start-up."""
    from trikv.vllm import engine_args

    with pytest.raises(ValueError, match="do not match the model: num_layers is 3 in the stats"):
        engine_args(method="triattention", stats=str(_tiny_llama_stats(engines_dir)), model="smollm2-135m")
    # the same file given to vLLM directly: the engine refuses to start and says why
    assert "do not match the model: num_layers is 3 in the stats" in engine_runs["stats-of-another-model"]["error"]


# `trikv bench serve` at a toy size (its runs over HTTP drive the server of test_http_server_streams_...)
# the bounded engine's warm-up ends once its first requests are compacted (seconds on an idle machine); its cap
# only binds on a busy one, where 6 s ended it before any round and nothing below could be checked
SMALL_BENCH = ["--length", "192", "--pool-requests", "3", "--budgets", "64", "--divide-length", "32",
               "--window", "3", "--warmup-max", "60", "--settle", "1"]


@pytest.mark.extended  # a benchmark pipeline end to end
def test_serving_benchmark_runs_offline_and_renders_its_page(tmp_path):
    """`trikv bench serve` end to end at a toy size: offline full attention vs the bounded cache at one KV pool in
    max-batch mode (each engine climbs the slot ladder 2, 4 and is compared at its own best, beside a short-context
    floor run), then `trikv bench serve-report`. (Its HTTP mode runs in
    test_http_server_streams_a_chat_completion_with_the_bounded_cache, against that test's server; the server an
    HTTP run starts itself is checked here: vLLM's own `serve` parser takes its command.)"""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from trikv.benchmarks.serving import _spec, add_arguments
    from trikv.benchmarks.serving_engine import server_command

    done = subprocess.run([sys.executable, "-m", "trikv", "bench", "serve", *SMALL_BENCH, "--methods", "full,triattention",
                           "--modes", "offline", "--in-process", "--concurrency", "2,4", "--max-batch", "--floor-length", "96",
                           "--out", str(tmp_path / "offline")],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import argparse

    bench = argparse.ArgumentParser()
    add_arguments(bench)
    args = bench.parse_args([*SMALL_BENCH, "--methods", "triattention", "--modes", "http", "--concurrency", "4", "--out", "x"])
    command = server_command(_spec(args, {"method": "triattention", "budget": 64, "concurrency": 4}, "http", tmp_path, 8100))
    assert command[1:5] == ["-m", "trikv.vllm.launch", "serve", command[4]]
    served = make_arg_parser(FlexibleArgumentParser()).parse_args(command[5:])
    assert (served.max_num_seqs, served.num_gpu_blocks_override, served.max_model_len, served.block_size) == (4, 19, 192, 32)
    assert json.loads(served.additional_config["trikv"] if isinstance(served.additional_config["trikv"], str) else
                      json.dumps(served.additional_config["trikv"]))["budget"] == 64
    offline = json.loads((tmp_path / "offline" / "serving.json").read_text())
    # full attention's warm-up ends at a full pool, or after the prefills where its slots fit the pool (n = 2 here)
    assert not any(r["warmup_capped"] for r in offline["runs"] if r["method"] == "full")
    for run in offline["runs"]:
        assert run["output_tokens"] > 0 and run["output_tokens_per_second"] > 0 and run["tpot_seconds"]["p50"] > 0
    best = {entry["method"]: entry for entry in offline["max_batch"]}
    assert set(best) == {"full", "triattention"}
    for method, entry in best.items():  # the best is the fastest rung the engine ran without preempting
        climbed = [r for r in offline["runs"] if r["method"] == method]
        sustained = [r for r in climbed if not r.get("preemptions_in_window")] or climbed[:1]
        assert climbed[0]["concurrency"] == 2 and entry["tokens_per_second"] == max(r["output_tokens_per_second"] for r in sustained)
        assert entry["floor_tokens_per_second"] > 0 and entry["stopped"]
    assert best["triattention"]["best_vs_full_best"] == pytest.approx(best["triattention"]["tokens_per_second"] / best["full"]["tokens_per_second"])
    bounded = [r for r in offline["runs"] if r["method"] == "triattention"]
    assert any(r["trikv"]["rounds"] > 0 for r in bounded)  # the bounded engine compacted
    # the best rung's compaction share is its own rounds' time: zero where its window ended before any round (a
    # timed window on a busy machine may), positive otherwise
    best_run = next(r for r in bounded if r["concurrency"] == best["triattention"]["best_concurrency"])
    assert (best["triattention"]["compaction_share"] > 0) == (best_run["trikv"]["seconds"] > 0)
    assert (tmp_path / "offline" / "throughput.png").stat().st_size > 1000
    page = tmp_path / "serving.md"
    done = subprocess.run([sys.executable, "-m", "trikv", "bench", "serve-report", str(tmp_path / "offline"), "--out", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert "## Run `offline`" in text and "triattention-B64-n4" in text and ".png" in text
    assert "max batch: each engine at its own best concurrency" in text


# prefix caching beside the bounded cache: B = 256 with prefill chunks of 128 (blocks of 32), so a hit ends on the
# chunk grid below budget + slack: at most 256 tokens of a long prompt, the whole cached prefix of a short one
PC_BUDGET, PC_CHUNK, PC_PREFIX, PC_NEW, PC_SHORT = 256, 128, 1000, 48, 200


def _prefix_caching_batches(long_ids: list[int]) -> list[dict]:
    """A (a 1,000-token prefix and its own end), then B (the same prefix, another end), then A again; a short prompt
    S (under budget + slack) decoded past several rounds, then S again; last two requests on the prefix together
    (they share its cached blocks while both run)."""
    prefix = long_ids[4000 : 4000 + PC_PREFIX]
    a, b = prefix + long_ids[6000:6024], prefix + long_ids[7000:7024]
    short = long_ids[8000 : 8000 + PC_SHORT]
    both = [prefix + long_ids[7200:7216], prefix + long_ids[7400:7416]]
    # S again opts out of session reuse (which would continue S's kept state, its protected prompt's 199 slots): what
    # is tested here is the prefix cache's hit on S's cached blocks (session reuse beside prefix caching:
    # test_vllm_sessions.py)
    return [{"prompts": [a], "max_tokens": PC_NEW}, {"prompts": [b], "max_tokens": PC_NEW}, {"prompts": [a], "max_tokens": PC_NEW},
            {"prompts": [short], "max_tokens": 120},
            {"prompts": [short], "max_tokens": 120, "extra_args": [{"trikv_session": "off"}]},
            {"prompts": both, "max_tokens": PC_NEW}]


def _prefix_caching_spec(request, caching: bool) -> dict:
    settings = {**_trikv_settings(prefill_chunk_size=PC_CHUNK), "budget": PC_BUDGET, "prefix_caching": caching}
    return {"dtype": "float32", "trikv": settings, "engine": {"num_gpu_blocks_override": POOL, "disable_log_stats": False},
            "schedule_records": True, "metrics": True, "cache_guard": caching,
            "batches": _prefix_caching_batches(request.getfixturevalue("long_ids"))}


@scenario("prefix-caching")
def _prefix_caching(request, prompts):
    return _prefix_caching_spec(request, caching=True)


@scenario("prefix-caching-off")
def _prefix_caching_off(request, prompts):
    return _prefix_caching_spec(request, caching=False)


def _first_computed(result: dict, batch: int, request_id: str) -> int:
    """The first token vLLM computed for the request: its prefix-cache hit (0 without one)."""
    return _steps_of(result, batch, request_id)[0][0]


@pytest.fixture(scope="module")
def prefix_caching_run(engine_runs):
    return engine_run(engine_runs, "prefix-caching")


def _hits(result: dict) -> list[int]:
    """Tokens vLLM's own prefix-cache counters report hit in each batch."""
    totals = [0] + [batch["metrics"]["hits"] for batch in result["batches"]]
    return [int(b - a) for a, b in zip(totals, totals[1:])]


@pytest.mark.engines("prefix-caching")
def test_prefix_cache_hits_beside_the_bounded_cache_and_tokens_equal_the_transformers_path(real_model, prefix_caching_run):
    """With prefix caching on (B = 256, slack 32, prefill chunks of 128), B (A's 1,000-token prefix, another end,
    sent once A finished) hits the blocks A cached, as vLLM's own prefix-cache counters show: 256 tokens, where the
    hit ends on B's prefill-chunk grid below budget + slack, so B is prefilled in the chunks and compacted at the
    rounds it has without the hit. A (no hit) and B (the hit, then vLLM's chunks), replayed through trikv's
    transformers cache, keep the same set at every round and every teacher-forced token is vLLM's."""
    model, _ = real_model
    run = prefix_caching_run
    stats = trikv.load_stats("smollm2-135m", model)
    hits = _hits(run)
    print(f"prefix-cache hits per batch (tokens): {hits}")
    assert hits[0] == 0 and hits[1] == PC_BUDGET and hits[2] == PC_BUDGET
    for batch in (0, 1):
        (request,) = run["batches"][batch]["requests"]
        steps = _steps_of(run, batch, request["request_id"])
        hit = steps[0][0]
        assert hit == (0 if batch == 0 else PC_BUDGET)
        prompt_length = len(request["prompt"])
        chunks = [(start, start + count) for start, count, _, _ in steps if start < prompt_length]
        assert all(stop - start == PC_CHUNK for start, stop in chunks[:-1])
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])) and chunks[-1][1] == prompt_length
        assert max(held for _, _, held, _ in steps) <= math.ceil((PC_BUDGET + SLACK + PC_CHUNK) / BLOCK)  # within the bound
        rounds = _batch_rounds(run, batch, request["request_id"])
        assert len([r for r in rounds if r["position"] < prompt_length]) >= 4 and len(rounds) >= 6
        report = replay(model, "triattention", request, rounds, tie=1e-3, stats=stats, budget=PC_BUDGET,
                        chunks=([(0, hit)] if hit else []) + chunks)
        print(f"batch {batch}: hit {hit} tokens, {len(chunks)} chunks, {report['rounds']} rounds, {report['tied_heads']} "
              f"of {report['heads']} (layer, head) sets differ by float ties")
        assert report["tied_heads"] == 0 and report["predictions"] == request["tokens"]


def _batch_rounds(result: dict, batch: int, request_id: str) -> list[dict]:
    """The rounds of a request of batch `batch` (request ids restart with every batch; the scenario counts the rounds
    run after each batch)."""
    counts = [0] + [b["metrics"]["rounds"] for b in result["batches"]]
    records = result["rounds"][0][counts[batch] : counts[batch + 1]]
    return [r for r in records if r["request_id"].split("-")[0] == request_id.split("-")[0]]


@pytest.mark.engines("prefix-caching")
def test_a_compacted_request_never_changes_what_later_requests_read_from_the_cache(prefix_caching_run):
    """Requests that read blocks of the prefix cache a compacted request came from emit what the first reader did:
    A again (hitting A's own blocks, which A's rounds never wrote) keeps A's sets at every round, bit for bit, and
    emits A's tokens; S again (a short prompt: its whole cached prefix, 192 tokens, hit after S's round copied them)
    emits S's tokens; the two requests that share the cached prefix while both run hit it. At every round of the
    run, checked from the block pool and the KV pages (`vllm_scenario._guard_cache`): every block the round wrote
    was its request's alone and uncached (the cached and shared ones were copied first), the bytes of every cached
    block it read were the same after it, and no compacted request ever held a cached block."""
    run = prefix_caching_run
    hits = _hits(run)
    assert hits[3] == 0 and hits[4] == (PC_SHORT - 1) // BLOCK * BLOCK and hits[5] == 2 * PC_BUDGET, hits
    for batch, batch_run in enumerate(run["batches"]):
        for request in batch_run["requests"]:
            assert _first_computed(run, batch, request["request_id"]) == (0 if batch in (0, 3) else
                                                                           hits[batch] // len(batch_run["requests"]))
    # A again reads A's blocks, computed in the very chunks A again would compute: the same rounds, bit for bit
    a_first, a_again = (_batch_rounds(run, batch, run["batches"][batch]["requests"][0]["request_id"]) for batch in (0, 2))
    assert [r["kept_positions"] for r in a_first] == [r["kept_positions"] for r in a_again] and a_first
    assert run["batches"][2]["requests"][0]["tokens"] == run["batches"][0]["requests"][0]["tokens"]
    assert run["batches"][4]["requests"][0]["tokens"] == run["batches"][3]["requests"][0]["tokens"]
    guard = run["cache_guard"]
    print(f"cache guard: {guard['rounds']} rounds, {guard['copies']} blocks copied, {guard['cached_blocks_read']} cached "
          f"blocks read")
    assert guard["rounds"] == len(run["rounds"][0]) and guard["copies"] > 0 and guard["cached_blocks_read"] > 0
    assert guard["written_shared_or_cached"] == [] and guard["cached_bytes_changed"] == [] and guard["cached_after_round"] == []
    assert run["free_blocks_at_end"] == POOL - 1


@pytest.mark.extended  # a second engine run of the same requests; the run's own checks above run in every run
@pytest.mark.engines("prefix-caching", "prefix-caching-off")
def test_prefix_caching_changes_no_token_and_no_kept_set(engine_runs, prefix_caching_run):
    """Every request of the prefix-caching run emits the tokens and keeps, at every round, the sets it does on an
    engine without prefix caching, hit or not (A again, S again, the two requests sharing the cached prefix)."""
    run, plain = prefix_caching_run, engine_run(engine_runs, "prefix-caching-off")
    assert _hits(plain) == [0] * len(run["batches"])
    for batch, (mine, theirs) in enumerate(zip(run["batches"], plain["batches"])):
        for request, reference in zip(mine["requests"], theirs["requests"]):
            assert request["tokens"] == reference["tokens"], f"batch {batch}"
    # the same rounds; their kept sets equal but where a hit's shorter forward moved a score by a float tie
    def positions(result: dict) -> list[tuple[str, int]]:  # the engine adds a random suffix to each request id
        return [(r["request_id"].split("-")[0], r["position"]) for r in result["rounds"][0]]

    assert positions(run) == positions(plain)
    sets = [(a == b).all(-1).flatten() for a, b in ((torch.tensor(x["kept_positions"]), torch.tensor(y["kept_positions"]))
                                                    for x, y in zip(run["rounds"][0], plain["rounds"][0]))]
    same = float(torch.cat(sets).float().mean())
    print(f"kept (layer, head) sets equal to the engine without prefix caching: {same:.4%}")
    assert same >= 0.99
    assert plain["free_blocks_at_end"] == POOL - 1


@scenario("prefix-caching-preemption")
def _prefix_caching_preemption(request, prompts):
    """The preemption scenario with prefix caching on: a preempted compacted request is recomputed from its history
    and may hit the blocks it cached before its first round."""
    spec = _preemption(request, prompts)
    spec["trikv"] = {**spec["trikv"], "prefix_caching": True}
    spec["engine"] = {**spec["engine"], "disable_log_stats": False}
    return {**spec, "metrics": True, "cache_guard": True}


@pytest.mark.extended  # two features each tested alone in every run, together
@pytest.mark.engines("prefix-caching-preemption")
def test_a_preempted_request_recomputes_beside_the_prefix_cache(engine_runs):
    """Preemption with prefix caching on: A is preempted after its rounds and recomputed from its whole history (a
    hit on what is still cached of it from before its first round, on its chunk grid, where the small pool has not
    evicted it: reported); every request completes with all its
    tokens, every block returns to the pool, and the cache guard finds no block a round wrote that another request
    may read, no cached block whose bytes a round changed and no compacted request holding a cached block."""
    run = engine_run(engine_runs, "prefix-caching-preemption")
    first = run["batches"][0]["requests"]
    assert run["stats"][0]["preemptions"] >= 1
    assert [len(r["tokens"]) for r in first] == PREEMPTION_NEW_TOKENS
    assert run["free_blocks_at_end"] == PREEMPTION_POOL - 1
    guard = run["cache_guard"]
    print(f"preemption with prefix caching: hits per batch {_hits(run)}; guard: {guard['rounds']} rounds, "
          f"{guard['copies']} blocks copied")
    assert guard["copies"] > 0
    assert guard["written_shared_or_cached"] == [] and guard["cached_bytes_changed"] == [] and guard["cached_after_round"] == []


def test_a_round_copies_the_blocks_others_may_read_and_never_caches_a_compacted_request():
    """The scheduler's two guards on vLLM's own block pool, without an engine. A round of a request holding 5 blocks
    (B = 64, slack 32, blocks of 32: it keeps 2) whose first block is cached and shared and whose second is cached:
    both are replaced by fresh blocks (the round's copies), and go back to the pool with their hashes, the tail
    too; with one free block only the shared one is copied and the other loses its hash before it is written; with
    none the round waits. A compacted request's blocks are never cached (the manager's cache_blocks does nothing)."""
    from types import SimpleNamespace

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from trikv.vllm.scheduler import TriKVScheduler, never_cache_compacted
    from trikv.vllm.settings import BoundedKVSettings

    def engine(free_after: int):
        pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK)
        blocks = pool.get_new_blocks(5)
        for index in (0, 1, 3):
            pool._insert_block_hash(make_block_hash_with_group_id(bytes([index]) * 32, 0), blocks[index], BLOCK)
        pool.touch(blocks[:1])  # another request holds the first block too
        pool.get_new_blocks(pool.get_num_free_blocks() - free_after)  # other requests hold the rest
        scheduler = TriKVScheduler.__new__(TriKVScheduler)
        request = SimpleNamespace(request_id="r", num_computed_tokens=5 * BLOCK, num_tokens=5 * BLOCK + 1,
                                  num_prompt_tokens=5 * BLOCK, sampling_params=None)
        scheduler.__dict__.update(
            trikv=BoundedKVSettings(method="streaming", budget=64, divide_length=SLACK), trikv_offsets={}, trikv_rounds=0,
            trikv_blocks_freed=0, _trikv_announced=set(), _trikv_budgets={}, _trikv_block=BLOCK, _trikv_rounds_per_step=4,
            _trikv_last_round={}, _trikv_prompts={},
            running=[request], kv_cache_manager=SimpleNamespace(block_pool=pool),
            _trikv_manager=SimpleNamespace(req_to_blocks={"r": list(blocks)}))
        return scheduler, pool, blocks

    scheduler, pool, blocks = engine(free_after=2)
    (op,) = scheduler._start_rounds()
    kept = scheduler._trikv_manager.req_to_blocks["r"]
    assert [old for old, _ in op.copies] == [blocks[0].block_id, blocks[1].block_id]
    assert [new for _, new in op.copies] == [block.block_id for block in kept] and op.kept_blocks == 2
    assert all(pool.is_block_writable(block) for block in kept)  # the round writes blocks only it holds, uncached
    assert blocks[0].ref_cnt == 1 and blocks[1].ref_cnt == 0 and blocks[3].ref_cnt == 0  # the originals returned
    assert all(blocks[index].block_hash is not None for index in (0, 1, 3))  # still cached, contents untouched

    scheduler, pool, blocks = engine(free_after=1)
    (op,) = scheduler._start_rounds()
    kept = scheduler._trikv_manager.req_to_blocks["r"]
    assert [old for old, _ in op.copies] == [blocks[0].block_id] and kept[1] is blocks[1]
    assert blocks[1].block_hash is None and all(pool.is_block_writable(block) for block in kept)

    scheduler, pool, blocks = engine(free_after=0)
    assert scheduler._start_rounds() == [] and scheduler._trikv_manager.req_to_blocks["r"] == blocks
    assert "r" not in scheduler.trikv_offsets

    calls = []
    manager = SimpleNamespace(cache_blocks=lambda request, num_tokens, **kwargs: calls.append((request.request_id, num_tokens)))
    compacted = {}
    never_cache_compacted(manager, compacted)
    manager.cache_blocks(SimpleNamespace(request_id="r"), 64, replay_boundaries=())
    compacted["r"] = 100
    manager.cache_blocks(SimpleNamespace(request_id="r"), 200, replay_boundaries=())
    assert calls == [("r", 64)]


def test_a_bounded_request_hits_the_prefix_cache_on_its_chunk_grid_below_its_round():
    """The longest prefix-cache hit a bounded request takes (B = 256, slack 32, chunks of 128, blocks of 32): a
    prefill under budget + slack takes vLLM's whole hit; a longer one a hit on its chunk grid below 288 tokens."""
    from types import SimpleNamespace

    from trikv.vllm.scheduler import TriKVScheduler
    from trikv.vllm.settings import BoundedKVSettings

    scheduler = TriKVScheduler.__new__(TriKVScheduler)
    scheduler.__dict__.update(trikv=BoundedKVSettings(method="streaming", budget=PC_BUDGET, divide_length=SLACK),
                              _trikv_chunk=PC_CHUNK, _trikv_block=BLOCK)
    limit = scheduler._prefix_hit_limit
    assert limit(SimpleNamespace(num_tokens=288), PC_BUDGET, 256) == 256  # no round inside this prefill
    assert limit(SimpleNamespace(num_tokens=200), PC_BUDGET, 192) == 192
    assert limit(SimpleNamespace(num_tokens=1024), PC_BUDGET, 992) == 256
    assert limit(SimpleNamespace(num_tokens=1024), PC_BUDGET, 224) == 128
    assert limit(SimpleNamespace(num_tokens=1024), PC_BUDGET, 96) == 0


def test_the_worker_copies_a_rounds_cached_blocks_before_it_and_follows_the_copies():
    """The worker's half of copy-on-write: before the step's rounds, each (original, copy) pair of a round is copied
    in every full-attention layer with vLLM's own block copy, and the copy takes the original's place in the
    request's block list (what the round reads and writes, and the block table after it); other blocks stay."""
    from types import SimpleNamespace

    from trikv.vllm.compactor import CompactionOp
    from trikv.vllm.worker import BoundedKVRunner

    caches = [torch.randn(10, 3, BLOCK, 16) for _ in range(2)]  # [blocks, KV heads, slots, 2 x head_dim] (vLLM's CPU pages)
    before = [cache.clone() for cache in caches]
    runner = SimpleNamespace(_trikv_group=0, _trikv_caches=caches, kv_cache_config=SimpleNamespace(num_blocks=10),
                             requests={"r": SimpleNamespace(block_ids=([1, 2, 3, 4],)),
                                       "s": SimpleNamespace(block_ids=([5, 6],))})
    op = CompactionOp(request_id="r", position=160, length=160, budget=64, prompt_length=10, kept_blocks=2,
                      freed_blocks=2, free_blocks=0, held_blocks=4, copies=((1, 7), (2, 8)))
    plain = CompactionOp(request_id="s", position=96, length=96, budget=32, prompt_length=10, kept_blocks=1,
                         freed_blocks=1, free_blocks=0, held_blocks=4)
    BoundedKVRunner._trikv_copy_on_write(runner, [op, plain])
    assert runner.requests["r"].block_ids[0] == [7, 8, 3, 4] and runner.requests["s"].block_ids[0] == [5, 6]
    for cache, old in zip(caches, before):
        assert torch.equal(cache[7], old[1]) and torch.equal(cache[8], old[2])
        assert torch.equal(cache[:7], old[:7]) and torch.equal(cache[9], old[9])  # the originals and every other block untouched
