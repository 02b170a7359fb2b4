"""RoPE geometry matches each family's own rotary module; calibration captures the exact pre-RoPE query."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from trikv.architectures import attention_modules, model_shape
from trikv.calibration import QueryStats, calibrate
from trikv.qk_capture import capture_pre_rope
from trikv.geometry import RopeGeometry

from helpers import tiny_model

ROPE_CASES = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("mistral", {}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256}}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
]


@pytest.mark.parametrize("family,overrides", ROPE_CASES)
def test_geometry_rotation_equals_model_rope(family, overrides):
    model = tiny_model(family, **overrides)
    geometry = RopeGeometry.from_model(model)
    rotary = model.model.rotary_emb
    modeling = sys.modules[type(attention_modules(model)[0]).__module__]
    positions = torch.tensor([[0, 1, 7, 100, 1000, 3000]])
    x = torch.randn(1, 2, 6, geometry.head_dim)
    cos, sin = rotary(x, positions)
    expected, _ = modeling.apply_rotary_pos_emb(x, x, cos, sin)
    ours = geometry.rotate(x, positions[0])
    # HF evaluates the angles in float32 (about 1e-4 absolute at position 3000); ours are float64
    torch.testing.assert_close(ours, expected, rtol=0, atol=3e-4)
    if "yarn" in str(overrides):
        assert geometry.attention_scaling != 1.0  # the mscale is really read from the model


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_hybrid_geometry_is_the_global_layers_own_rope(family):
    """Gemma-3 rotates its global layers with their own base (1,000,000; sliding layers 10,000); GPT-OSS uses
    YaRN with an attention scaling and its own `_apply_rotary_emb` (halves): the geometry trikv scores with
    is exactly the rotation the model applies in its full-attention layers."""
    model = tiny_model(family)
    geometry = RopeGeometry.from_model(model)
    rotary = model.model.rotary_emb
    modeling = sys.modules[type(attention_modules(model)[0]).__module__]
    positions = torch.tensor([[0, 1, 7, 100, 1000, 3000]])
    x = torch.randn(1, 2, 6, geometry.head_dim)
    if family == "gemma3_text":
        cos, sin = rotary(x, positions, "full_attention")
        local = RopeGeometry.from_model(model, layer_type="sliding_attention")
        assert float(local.omega[1]) > float(geometry.omega[1])  # the local base is smaller: faster bands
    else:
        cos, sin = rotary(x, positions)
        assert geometry.attention_scaling == pytest.approx(rotary.attention_scaling) and geometry.attention_scaling > 1.0
    expected, _ = modeling.apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(geometry.rotate(x, positions[0]), expected, rtol=0, atol=3e-4)
    # serving engines hold the config only: the same geometry from it
    assert RopeGeometry.from_config(model.config).checksum() == geometry.checksum()


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_hybrid_calibration_covers_the_global_layers_and_says_so(family, tmp_path):
    """Statistics of a hybrid model cover its full-attention layers (the ones a cache bounds), or every layer for
    analysis; the file records which, and a file that misses a bounded layer is refused by name."""
    model = tiny_model(family)
    ids = torch.randint(1, 96, (200,), generator=torch.Generator().manual_seed(0))
    stats = calibrate(model, ids, source="test", chunk_tokens=100, progress=False)
    assert stats.layers == [1, 3] and stats.q_mean.shape[0] == 2
    assert stats.metadata["layer_types"] == list(model.config.layer_types)
    everything = calibrate(model, ids, source="test", chunk_tokens=100, progress=False, all_layers=True)
    assert everything.layers == [0, 1, 2, 3]
    torch.testing.assert_close(everything.rows([1, 3])[0], stats.q_mean)  # the same sums, row for row
    collected = []
    with capture_pre_rope(model, lambda layer, q, k: collected.append((layer, q.clone()))):
        for chunk in ids.split(100):
            model(input_ids=chunk[None])
    layer3 = torch.cat([q for layer, q in collected if layer == 3], dim=2)
    bands = RopeGeometry.from_model(model).to_complex(layer3.double())[0]
    torch.testing.assert_close(stats.q_mean[1], bands.mean(1))
    path = tmp_path / "stats.safetensors"
    stats.save(path)
    QueryStats.load(path).check_matches(model)
    umask = os.umask(0o022)  # a statistics file gets the user's usual permissions, not safetensors' private 0600
    try:
        stats.save(path)
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644
    partial = QueryStats(stats.q_mean[:1], stats.q_abs_mean[:1], metadata=dict(stats.metadata, layers=[1]))
    partial.save(path)
    with pytest.raises(ValueError, match=r"cover layers \[1\] but the model's cache bounds layers \[1, 3\] \(missing \[3\]\)"):
        QueryStats.load(path).check_matches(model)


def test_interleaved_layout_pairs_adjacent_dimensions():
    geometry = RopeGeometry.build(torch.tensor([1.0, 0.1]), head_dim=4, layout="interleaved")
    x = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    rotated = geometry.rotate(x, torch.tensor([1]))
    # band 0 = (x0, x1) rotated by 1 rad, band 1 = (x2, x3) rotated by 0.1 rad
    torch.testing.assert_close(rotated[0, :2], torch.tensor([torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))]))
    torch.testing.assert_close(rotated[0, 2:], torch.tensor([-torch.sin(torch.tensor(0.1)), torch.cos(torch.tensor(0.1))]))
    with pytest.raises(ValueError, match="layout"):
        RopeGeometry.build(torch.tensor([1.0]), 2, layout="diagonal")


def test_partial_rotary_bands_do_not_rotate():
    geometry = RopeGeometry.build(torch.tensor([1.0, 0.5]), head_dim=8, layout="half")
    assert geometry.omega.tolist() == [1.0, 0.5, 0.0, 0.0]
    x = torch.randn(1, 8)
    rotated = geometry.rotate(x, torch.tensor([5]))
    torch.testing.assert_close(rotated[0, 4:], x[0, 4:])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gpt_oss"])
def test_capture_sees_exact_pre_rope_query(family):
    """The captured q equals q_proj (+bias) (+q_norm for Qwen3) of the attention input, before rotation."""
    model = tiny_model(family)
    attn = attention_modules(model)[1]
    inputs = {}

    def remember_input(module, args, kwargs):
        inputs.setdefault("h", kwargs.get("hidden_states", args[0] if args else None))

    handle = attn.register_forward_pre_hook(remember_input, with_kwargs=True)
    captured = {}
    try:
        with capture_pre_rope(model, lambda layer, q, k: captured.setdefault(layer, (q.clone(), k.clone()))):
            model(input_ids=torch.randint(1, 96, (1, 9)))
    finally:
        handle.remove()
    hidden = inputs["h"]
    shape = (1, 9, -1, attn.head_dim)
    expected_q = attn.q_proj(hidden).view(shape)
    if hasattr(attn, "q_norm"):
        expected_q = attn.q_norm(expected_q)
    torch.testing.assert_close(captured[1][0], expected_q.transpose(1, 2))
    assert sorted(captured) == list(range(model.config.num_hidden_layers))
    if family in ("qwen3", "gemma3_text"):
        unnormed = attn.q_proj(hidden).view(shape).transpose(1, 2)
        assert (captured[1][0] - unnormed).abs().max() > 1e-3  # q_norm really matters


def test_streaming_accumulator_equals_batch_means():
    model = tiny_model("llama")
    geometry = RopeGeometry.from_model(model)
    ids = torch.randint(1, 96, (300,))
    stats = calibrate(model, ids, source="test", chunk_tokens=64, progress=False)
    collected = []
    with capture_pre_rope(model, lambda layer, q, k: collected.append((layer, q.clone()))):
        for chunk in ids.split(64):
            model(input_ids=chunk[None])
    layer0 = torch.cat([q for layer, q in collected if layer == 0], dim=2)  # [1, Hq, 300, D]
    bands = geometry.to_complex(layer0.double())[0]  # [Hq, 300, F]
    torch.testing.assert_close(stats.q_mean[0], bands.mean(1))
    torch.testing.assert_close(stats.q_abs_mean[0], bands.abs().mean(1))
    assert stats.metadata["token_count"] == 300
    assert ((stats.concentration >= 0) & (stats.concentration <= 1 + 1e-9)).all()


def test_stats_round_trip(tmp_path):
    model = tiny_model("qwen3")
    stats = calibrate(model, torch.randint(1, 96, (100,)), source="unit test", progress=False)
    path = tmp_path / "stats.safetensors"
    stats.save(path)
    loaded = QueryStats.load(path)
    torch.testing.assert_close(loaded.q_mean, stats.q_mean.to(torch.complex64).to(torch.complex128))
    assert loaded.metadata["calibration_source"] == "unit test"
    assert loaded.metadata["model_type"] == "qwen3"
    loaded.check_matches(model)
    summary = loaded.summary()
    assert summary["heads"] == model.config.num_hidden_layers * model.config.num_attention_heads
    assert 0.0 <= summary["share_R_gt_0.95"] <= summary["share_R_gt_0.9"] <= 1.0


def test_model_shape_of_families():
    shape = model_shape(tiny_model("qwen3"))
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.layout) == (3, 4, 2, 16, "half")


# the shapes the registry states for each model with shipped statistics (layers, query heads, KV heads, head_dim)
SHIPPED = {"smollm2-135m": (30, 9, 3, 64), "qwen2.5-coder-0.5b": (24, 14, 2, 64), "qwen2.5-coder-1.5b": (28, 12, 2, 128)}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_statistics_fit_their_model_and_exclude_their_calibration_rows(name):
    """Each shipped stats file loads offline, has its model's shape, and was calibrated on the model's own MATH-500
    traces whose rows every math evaluation skips (so no benchmark scores the text the statistics came from)."""
    import json

    from trikv.benchmarks.quality.math_task import CALIBRATION_DIR, load_problems, reserved_rows
    from trikv.calibration import bundled_stats_path

    stats = QueryStats.load(bundled_stats_path(name))
    layers, heads, kv_heads, head_dim = SHIPPED[name]
    meta = stats.metadata
    assert (meta["num_layers"], meta["num_heads"], meta["num_kv_heads"], meta["head_dim"]) == SHIPPED[name]
    assert stats.q_mean.shape == (layers, heads, head_dim // 2) and meta["model_name"] == name
    provenance = json.loads((CALIBRATION_DIR / f"{name}-math500-traces.json").read_text())
    assert provenance["model"] == name and provenance["tokens"] >= 4000
    first, last = provenance["math500_rows"]
    assert f"rows {first}-{last}" in meta["calibration_source"] or f"{first}-{last}" in provenance["problems"]
    assert set(range(first, last + 1)) <= reserved_rows("math500")
    evaluated = {int(p["id"].split("-")[1]) for p in load_problems("math500")}
    assert not evaluated & set(range(first, last + 1))
