"""Bad input fails loudly, naming the problem; nothing falls back silently."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file, save_file

import trikv
from trikv.architectures import UnsupportedModelError
from trikv.calibration import StatsFileError, calibrate

from helpers import tiny_model
from stats_fixtures import tiny_stats
from trikv.compat import cache_kwargs


def _saved_stats(tmp_path, model, name="stats.safetensors"):
    stats = calibrate(model, torch.randint(1, 96, (64,)), source="test", progress=False)
    path = tmp_path / name
    stats.save(path)
    return path


def test_stats_by_path_or_name_are_loaded_and_checked_against_the_model(tmp_path):
    """`stats=` takes a `QueryStats`, a file or a bundled name, everywhere a cache is made (the settings' error
    message says so): a path gives the same cache as the loaded statistics, and a file of another model is refused at
    make_cache, not later."""
    model = tiny_model("llama")
    path = _saved_stats(tmp_path, model)
    ids = torch.randint(1, 96, (1, 80), generator=torch.Generator().manual_seed(0))
    logits = []
    for given in (path, str(path), trikv.load_stats(path)):
        cache = trikv.make_cache(model, "triattention", stats=given, budget=24, divide_length=8)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            logits.append(model(ids[:, -1:], past_key_values=cache, use_cache=True).logits)
        assert cache.rounds > 0
    assert all(torch.equal(logits[0], other) for other in logits[1:])
    (tmp_path / "other").mkdir()
    other = _saved_stats(tmp_path / "other", tiny_model("llama", num_hidden_layers=2))
    with pytest.raises(StatsFileError, match="num_layers is 2 in the stats"):
        trikv.make_cache(model, "triattention", stats=str(other), budget=24, divide_length=8)
    with pytest.raises(StatsFileError, match="no statistics file at 'no-such-model' and no bundled stats"):
        trikv.make_cache(model, "triattention", stats="no-such-model", budget=24, divide_length=8)


def test_stats_for_another_layer_count(tmp_path):
    path = _saved_stats(tmp_path, tiny_model("llama", num_hidden_layers=2))
    with pytest.raises(StatsFileError, match="num_layers is 2 in the stats .* but 3 in the model"):
        trikv.load_stats(path, tiny_model("llama"))


def test_stats_for_another_architecture(tmp_path):
    path = _saved_stats(tmp_path, tiny_model("qwen2"))
    with pytest.raises(StatsFileError, match="model_type is 'qwen2'"):
        trikv.load_stats(path, tiny_model("llama"))


def test_stats_for_other_weights_of_the_same_shape(tmp_path):
    path = _saved_stats(tmp_path, tiny_model("llama", seed=1))
    with pytest.raises(StatsFileError, match="different weights"):
        trikv.load_stats(path, tiny_model("llama", seed=2))


def test_stats_with_other_rope(tmp_path):
    path = _saved_stats(tmp_path, tiny_model("llama"))
    other = tiny_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with pytest.raises(StatsFileError, match="rope_checksum"):
        trikv.load_stats(path, other)


def test_truncated_stats_file(tmp_path):
    path = _saved_stats(tmp_path, tiny_model("llama"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(StatsFileError, match="corrupt or truncated"):
        trikv.load_stats(path)


def test_garbage_stats_file(tmp_path):
    path = tmp_path / "noise.safetensors"
    path.write_bytes(b"\x00\x01not a safetensors file at all")
    with pytest.raises(StatsFileError, match="corrupt or truncated"):
        trikv.load_stats(path)


def test_stats_file_without_metadata(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"q_mean_real": torch.zeros(2, 2, 2)}, str(path))
    with pytest.raises(StatsFileError, match="no trikv metadata"):
        trikv.load_stats(path)


def test_stats_file_with_wrong_tensor_shape(tmp_path):
    path = _saved_stats(tmp_path, tiny_model("llama"))
    tensors = load_file(str(path))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors["q_abs_mean"] = tensors["q_abs_mean"][:, :2].contiguous()
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(StatsFileError, match="q_abs_mean has shape"):
        trikv.load_stats(path)


def test_missing_stats_path():
    with pytest.raises(StatsFileError, match="no statistics file"):
        trikv.load_stats("/nonexistent/stats.safetensors")


def test_triattention_without_stats():
    with pytest.raises(ValueError, match="needs calibration statistics"):
        trikv.make_cache(tiny_model("llama"), "triattention", budget=64)


@pytest.mark.parametrize("budget", [0, -5, 2.5])
def test_non_positive_budget(budget):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        trikv.TriAttentionCache(model, tiny_stats(model), budget=budget)


def test_budget_smaller_than_protected_window():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="not larger than the protected recent window"):
        trikv.TriAttentionCache(model, tiny_stats(model), budget=32, recent_window=64)


def test_unsupported_architecture():
    from transformers import AutoModelForCausalLM, GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'gpt2'"):
        trikv.make_cache(model, "streaming", budget=16)


def test_model_without_rope():
    model = tiny_model("llama")
    del model.model.rotary_emb
    with pytest.raises(UnsupportedModelError, match="no rotary embedding"):
        trikv.make_cache(model, "streaming", budget=16)


def test_hybrid_models_refuse_what_they_cannot_do(tmp_path):
    """The lean engine and attention matching refuse hybrid / sink models with a message; so do statistics of
    a non-hybrid model on a hybrid one, and a model whose every layer slides."""
    import trikv
    from trikv.calibration import calibrate
    from trikv.lean import LeanEngine

    gemma = tiny_model("gemma3_text")
    with pytest.raises(UnsupportedModelError, match="hybrid sliding/global model: use engine='transformers'"):
        LeanEngine(gemma)
    oss = tiny_model("gpt_oss")
    with pytest.raises(UnsupportedModelError, match="attention matching with sinks is not implemented"):
        trikv.make_cache(oss, "tam-shared", budget=64, tokenizer=None)
    stats = calibrate(tiny_model("llama", num_hidden_layers=4), torch.randint(1, 96, (64,)), source="t", progress=False)
    with pytest.raises(StatsFileError, match="do not match the model"):
        stats.check_matches(gemma)
    with pytest.raises(UnsupportedModelError, match="no full-attention layer"):
        trikv.make_cache(tiny_model("gemma3_text", layer_types=["sliding_attention"] * 4), "streaming", budget=16)


def test_sliding_window_model_is_refused():
    model = tiny_model("mistral", sliding_window=64)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        trikv.make_cache(model, "streaming", budget=16)


def test_unsupported_attention_implementation():
    model = tiny_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(UnsupportedModelError, match="flex_attention"):
        trikv.make_cache(model, "streaming", budget=16)


def test_unknown_method_and_option():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        trikv.make_cache(model, "magic", budget=16)
    with pytest.raises(ValueError, match="has no option"):
        trikv.make_cache(model, "streaming", budget=16, banana=3)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'not-a-model'"):
        trikv.load_model("not-a-model")


def test_right_padding_is_refused():
    model = tiny_model("llama")
    cache = trikv.make_cache(model, "streaming", budget=16)
    with pytest.raises(ValueError, match="left padding"):
        model(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]), **cache_kwargs(model, cache))


def test_prompt_too_long_for_protection_competes_and_warns(caplog):
    model = tiny_model("llama")
    cache = trikv.TriAttentionCache(model, tiny_stats(model), budget=24, divide_length=8)

    class Tok:
        pad_token_id, eos_token_id, chat_template = 0, None, None

        def decode(self, ids, skip_special_tokens=True):
            return ""

    with caplog.at_level("WARNING"):
        trikv.generate(model, Tok(), [list(range(1, 41))], cache=cache, max_new_tokens=30, min_new_tokens=30)
    assert "competes for the budget" in caplog.text
    assert sum("competes" in r.message for r in caplog.records) == 1  # said once
    kept = cache.store.positions[:, 0, :, : cache.length]
    assert bool((kept >= 40).any())  # generated tokens survive: the prompt did not crowd them out


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_dynamic_rope_is_refused(rope_type):
    """Frequencies that change with the sequence length would no longer match the cached keys."""
    parameters = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        half = 8  # head_dim 16 / 2
        parameters |= {"short_factor": [1.0] * half, "long_factor": [2.0] * half, "original_max_position_embeddings": 1024}
    model = tiny_model("llama", rope_parameters=parameters)
    with pytest.raises(UnsupportedModelError, match=f"RoPE type '{rope_type}' changes its frequencies"):
        trikv.make_cache(model, "triattention", budget=16, stats=tiny_stats(tiny_model("llama")))
    with pytest.raises(UnsupportedModelError, match="changes its frequencies"):
        calibrate(model, torch.randint(1, 96, (32,)), source="test", progress=False)


def test_a_forward_that_ignores_the_cache_is_refused():
    """Before transformers 5.24 the cache keyword is `past_key_values`: a model given `cache=` runs without the
    trikv cache, and trikv says so. From 5.24 on, `past_key_values=` is a deprecated alias that still works."""
    from trikv.compat import cache_argument

    model = tiny_model("llama")
    ids = torch.ones(1, 4, dtype=torch.long)
    cache = trikv.make_cache(model, "streaming", budget=16)
    if cache_argument(model) == "past_key_values":
        with pytest.raises(RuntimeError, match="without writing to the trikv cache .* takes the cache as `past_key_values=`"):
            model(input_ids=ids, cache=cache)
    else:
        reference = trikv.make_cache(model, "streaming", budget=16)
        torch.testing.assert_close(model(input_ids=ids, past_key_values=cache).logits, model(input_ids=ids, cache=reference).logits)
        assert cache.seen == reference.seen == 4


# ---- settings that used to be ignored or to fail late ------------------------------------------------
def test_full_attention_refuses_a_budget_it_would_ignore():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="'full' keeps every entry and takes no budget"):
        trikv.make_cache(model, "full", budget=512)
    with pytest.raises(ValueError, match="'full' keeps every entry and takes no budget"):
        trikv.generate(model, _Tok(), [[1, 2, 3]], method="full", budget=512, max_new_tokens=2)
    assert trikv.make_cache(model, "full").budget is None


@pytest.mark.parametrize("name,value", [("budget", True), ("budget", 64.0), ("divide_length", 16.0), ("budget", -1), ("divide_length", 0)])
def test_non_integer_settings_are_refused_where_given(name, value):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=f"{name} must be an integer"):
        trikv.make_cache(model, "streaming", **{"budget": 64, name: value})


def test_numpy_integers_are_accepted():
    import numpy

    cache = trikv.make_cache(tiny_model("llama"), "streaming", budget=numpy.int64(64), divide_length=numpy.int32(16))
    assert cache.budget == 64 and cache.divide_length == 16 and type(cache.budget) is int


class _Tok:
    pad_token_id, eos_token_id, chat_template = 0, None, None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_generate_with_a_cache_refuses_settings_the_cache_already_fixes():
    model = tiny_model("llama")
    cache = trikv.make_cache(model, "streaming", budget=32)
    for given in ({"budget": 64}, {"method": "knorm"}, {"divide_length": 8}, {"stats": tiny_stats(model)}, {"sinks": 2}):
        with pytest.raises(ValueError, match="given together with cache"):
            trikv.generate(model, _Tok(), [[1, 2, 3]], cache=cache, max_new_tokens=2, **given)


def test_a_cache_holding_a_conversation_is_not_silently_continued():
    model = tiny_model("llama")
    cache = trikv.make_cache(model, "streaming", budget=32)
    first = trikv.generate(model, _Tok(), [[5, 6, 7, 8]], cache=cache, max_new_tokens=6, min_new_tokens=6)
    with pytest.raises(ValueError, match=r"already holds \d+ tokens .* cache.reset\(\)"):
        trikv.generate(model, _Tok(), [[9, 10, 11]], cache=cache, max_new_tokens=6)
    cache.reset()
    again = trikv.generate(model, _Tok(), [[5, 6, 7, 8]], cache=cache, max_new_tokens=6, min_new_tokens=6)
    assert again.tokens == first.tokens


def test_sampling_settings_out_of_range_are_refused():
    model = tiny_model("llama")
    for options, message in ((dict(max_new_tokens=-5), "max_new_tokens must be an integer >= 1"),
                             (dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\]"),
                             (dict(do_sample=True, temperature=0.0), "temperature must be > 0")):
        with pytest.raises(ValueError, match=message):
            trikv.generate(model, _Tok(), [[1, 2]], method="streaming", budget=16, **options)


def test_a_cache_made_for_another_model_is_refused():
    first, second = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    cache = trikv.make_cache(first, "streaming", budget=16)
    with pytest.raises(ValueError, match="made for another model"):
        second(input_ids=torch.ones(1, 4, dtype=torch.long), **cache_kwargs(second, cache))


def test_a_prompt_past_the_trained_positions_warns(caplog):
    model = tiny_model("llama", max_position_embeddings=48)
    with caplog.at_level("WARNING"):
        trikv.generate(model, _Tok(), [list(range(1, 41))], method="streaming", budget=16, max_new_tokens=12, min_new_tokens=12)
    assert sum("trained positions" in r.message for r in caplog.records) == 1


def test_calibrating_on_a_few_tokens_warns(caplog):
    with caplog.at_level("WARNING"):
        calibrate(tiny_model("llama"), torch.randint(1, 96, (11,)), source="test", progress=False)
    assert "calibrating on 11 tokens only" in caplog.text


def test_tam_without_a_tokenizer_and_tam_with_an_ignored_slack_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        trikv.make_cache(model, "tam", budget=64)
    with pytest.raises(ValueError, match="paper's schedule .* ignores divide_length=32"):
        trikv.make_cache(model, "tam", budget=64, divide_length=32, boundary_ids=(3,))
    assert trikv.make_cache(model, "tam-shared", budget=64, divide_length=32, boundary_ids=(3,)).divide_length == 32


# ---- statistics that cannot be trusted -------------------------------------------------------------
def _rewrite_stats(path, tensors=None, metadata=None):
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["trikv"])
    data = load_file(str(path))
    if tensors:
        data.update(tensors(data))
    if metadata:
        meta = metadata(meta)
    save_file(data, str(path), metadata={"trikv": json.dumps(meta)})


def test_stats_missing_shape_metadata_are_refused(tmp_path):
    path = _saved_stats(tmp_path, tiny_model("llama"))
    _rewrite_stats(path, metadata=lambda meta: {k: v for k, v in meta.items() if k != "num_layers"})
    with pytest.raises(StatsFileError, match=r"metadata lacks \['num_layers'\]"):
        trikv.load_stats(path)


@pytest.mark.parametrize("kind", ["zeros", "negative", "mean_above_abs"])
def test_statistics_no_calibration_produces_are_refused(tmp_path, kind):
    path = _saved_stats(tmp_path, tiny_model("llama"))
    changes = {
        "zeros": lambda d: {name: torch.zeros_like(t) for name, t in d.items()},
        "negative": lambda d: {"q_abs_mean": -d["q_abs_mean"]},
        "mean_above_abs": lambda d: {"q_mean_real": d["q_abs_mean"] * 2},
    }
    _rewrite_stats(path, tensors=changes[kind])
    with pytest.raises(StatsFileError, match="no calibration produces|negative E|every statistic is zero"):
        trikv.load_stats(path)


def test_stats_without_a_weight_signature_warn(tmp_path, caplog):
    model = tiny_model("llama")
    path = _saved_stats(tmp_path, model)
    _rewrite_stats(path, metadata=lambda meta: {k: v for k, v in meta.items() if k != "weight_signature"})
    with caplog.at_level("WARNING"):
        trikv.load_stats(path, model)
    assert "carry no weight signature" in caplog.text


# ---- the command line: checked before any model loads ------------------------------------------------
def _cli(capsys, *argv):
    from trikv.cli import main

    with pytest.raises(SystemExit) as raised:
        status = main(list(argv))
        raise SystemExit(status)
    return raised.value.code, capsys.readouterr().err + str(raised.value.code)


def test_cli_refuses_bad_input_with_a_message(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("some calibration text")
    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"prompt": "one"}\n{"question": "two"}\n')
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text("{}")  # a model folder the user has, with no statistics
    cases = [
        (["calibrate", "--text-file", str(text), "--out", str(tmp_path)], "is a directory"),
        (["calibrate", "--text-file", str(text), "--out", str(tmp_path / "s.safetensors"), "--text-tokens", "-5"], "--text-tokens must be an integer >= 1"),
        (["generate", "--prompt", ""], "the prompt is empty"),
        (["generate", "--prompt-file", str(rows)], f"{rows}:2: each row needs a \"prompt\" string"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "-5"], "--max-new-tokens must be an integer >= 1"),
        (["generate", "--prompt", "hi", "--temperature", "0.6", "--top-p", "1.5"], r"--top-p must be in (0, 1]"),
        (["generate", "--prompt", "hi", "--model", str(tmp_path / "my-model")], "has no bundled ones: pass --stats"),
        (["generate", "--prompt", "hi", "--method", "streaming", "--model", str(tmp_path / "nothing")], "no model folder at"),
        (["generate", "--prompt", "hi", "--model", str(tmp_path / "nothing")], "no model folder at"),
        # a mistyped bundled name: an unknown model (with the closest names), not a model without statistics
        (["generate", "--prompt", "hi", "--model", "smollm3-135m"], "unknown model 'smollm3-135m' (did you mean 'smollm2-135m'?)"),
        (["chat", "--model", "smollm3-135m"], "unknown model 'smollm3-135m' (did you mean 'smollm2-135m'?)"),
        # a mistyped option: the subcommand's own usage, and the option it has that is closest
        (["generate", "--budjet", "64"], "usage: trikv generate"),
        (["generate", "--budjet", "64"], "unrecognized arguments: --budjet 64; --budjet (did you mean --budget?)"),
        (["bench", "agent", "--sesions", "2"], "usage: trikv bench agent"),
        (["bench", "agent", "--sesions", "2"], "(did you mean --sessions?)"),
    ]
    for argv, message in cases:
        code, output = _cli(capsys, *argv)
        assert code != 0 and message in output, (argv, output)


def test_triattention_window_settings_are_checked():
    model = tiny_model("qwen2")
    stats = tiny_stats(model)
    with pytest.raises(ValueError, match="window_weight must lie in"):
        trikv.make_cache(model, "triattention-window", budget=64, stats=stats, window_weight=1.5)
    with pytest.raises(ValueError, match="must cover the window"):
        trikv.make_cache(model, "triattention-window", budget=64, stats=stats, window_size=16, recent_window=8)
    with pytest.raises(ValueError, match="needs calibration statistics"):
        trikv.make_cache(model, "triattention-window", budget=64)
    cache = trikv.make_cache(model, "triattention-window", budget=64, stats=stats, window_size=16)
    assert cache.policy.recent_window == 16 and cache.query_window is not None


def test_triattention_dedup_settings_are_checked():
    model = tiny_model("qwen2")
    stats = tiny_stats(model)
    with pytest.raises(ValueError, match="redundancy_weight must be >= 0"):
        trikv.make_cache(model, "triattention-dedup", budget=64, stats=stats, redundancy_weight=-0.5)
    with pytest.raises(ValueError, match=r"cosine similarity in \[-1, 1\]"):
        trikv.make_cache(model, "triattention-dedup", budget=64, stats=stats, similarity_threshold=2.0)
    with pytest.raises(ValueError, match="needs calibration statistics"):
        trikv.make_cache(model, "triattention-dedup", budget=64)
