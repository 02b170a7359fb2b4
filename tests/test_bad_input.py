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
    with pytest.raises(ValueError, match="budget must be a positive integer"):
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
    kept = cache.positions[:, 0, :, : cache.length]
    assert bool((kept >= 40).any())  # generated tokens survive: the prompt did not crowd them out
