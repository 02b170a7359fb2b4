"""trikv's MLX caches (trikv.mlx) on MLX's CPU build, against the torch path.

- kept sets: for the same keys, the MLX scorer and selection keep exactly the entries the torch policy and
  `selection.top_entries` keep, for every method the MLX caches offer;
- eviction = masking in MLX: the bounded cache's logits equal full attention with the evicted entries masked
  (decode and chunked prefill, where the stored length differs from the RoPE offset);
- tiny models with the same weights in transformers and MLX: the same greedy tokens with trikv caches;
- memory bounded over a generation of several budgets, unquantised and 8 / 4-bit;
- RoPE read from the mlx model (both layouts, linear / llama3 / yarn scaling);
- refusals with their messages.
Skipped where MLX is not installed, unless TRIKV_REQUIRE_MLX=1 (scripts/test.sh sets it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("TRIKV_REQUIRE_MLX") == "1":
    import mlx.core as mx  # noqa: F401  (fail loudly where MLX must be present)
    import mlx_lm  # noqa: F401
else:
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402
from mlx_lm.utils import load_model as mlx_load_model  # noqa: E402

import trikv  # noqa: E402
import trikv.mlx  # noqa: E402
from helpers import tiny_model  # noqa: E402
from stats_fixtures import tiny_stats  # noqa: E402
from trikv.architectures import UnsupportedModelError, model_shape  # noqa: E402
from trikv.calibration import StatsFileError  # noqa: E402
from trikv.geometry import RopeGeometry  # noqa: E402
from trikv.mlx.model import read_rope, rope_overrides  # noqa: E402
from trikv.mlx.scoring import kept_indices  # noqa: E402
from trikv.policies import ScoringContext, key_only_methods, make_policy  # noqa: E402
from trikv.selection import protected_entries, top_entries  # noqa: E402

pytestmark = [pytest.mark.mlx, pytest.mark.usefixtures("one_thread")]
METHODS = key_only_methods()


def to_mlx(folder: Path, **overrides):
    """The mlx-lm model of a transformers folder (same weights), with the RoPE of its config."""
    config = json.loads((folder / "config.json").read_text())
    model, _ = mlx_load_model(folder, model_config=rope_overrides(config) | overrides)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama in transformers, the same weights in MLX, and statistics calibrated on it (saved to a file)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", num_hidden_layers=2)
    model.save_pretrained(folder)
    stats = tiny_stats(model)
    stats_file = folder / "stats.safetensors"
    stats.save(stats_file)
    return model, to_mlx(folder), stats, str(stats_file)


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    """A tiny llama with head_dim 32 (one quantisation group of 32 per entry) in MLX, and its statistics file."""
    folder = tmp_path_factory.mktemp("tiny-llama-32")
    model = tiny_model("llama", num_hidden_layers=2, hidden_size=128)
    model.save_pretrained(folder)
    tiny_stats(model).save(folder / "stats.safetensors")
    return to_mlx(folder), str(folder / "stats.safetensors")


def method_options(method: str, stats_file: str) -> dict:
    return {"stats": stats_file} if trikv.METHODS[method].needs_stats else {}


# ---- kept sets: MLX scorer + selection == torch policy + top_entries, same keys ----------------------------------
def random_round(seed: int, shape, n: int = 40, prompt: int = 6, t: int = 90):
    """Keys [L, 1, Hkv, N, D] and the increasing positions of N entries out of t tokens per (layer, KV head), the
    prompt's first `prompt` positions among them (a cache after earlier rounds)."""
    generator = np.random.default_rng(seed)
    L, h, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
    keys = generator.standard_normal((L, 1, h, n, D)).astype(np.float32)
    keys *= generator.uniform(0.5, 2.0, (L, 1, h, n, 1)).astype(np.float32)  # norms differ (Knorm, S_norm)
    positions = np.empty((L, 1, h, n), dtype=np.int64)
    for index in np.ndindex(L, 1, h):
        rest = generator.choice(np.arange(prompt, t), n - prompt, replace=False)
        positions[index] = np.sort(np.concatenate([np.arange(prompt), rest]))
    return keys, positions


@pytest.mark.parametrize("method", METHODS)
def test_kept_sets_equal_the_torch_path(tiny, method):
    model, mlx_model, stats, stats_file = tiny
    shape = model_shape(model)
    budget, prompt, t = 48, 6, 160  # above the 32-token window of triattention-recent / -dedup
    options = {"recent_window": 4} if method == "knorm" else {}
    cache = trikv.mlx.make_prompt_cache(mlx_model, method, budget=budget, divide_length=8,
                                        **method_options(method, stats_file), **options)
    scorer = trikv.mlx.bounded_cache(cache).scorer
    policy = make_policy(method, **({"stats": stats} if trikv.METHODS[method].needs_stats else {}), **options)
    policy.bind(model, shape)
    for seed in range(3):
        keys, positions = random_round(seed, shape, n=80, prompt=prompt, t=t)
        positions_t = torch.from_numpy(positions)
        current, prompt_lengths = torch.tensor([t]), torch.tensor([prompt])
        protected = protected_entries(positions_t, current, prompt_lengths, budget, policy.recent_window, 4)
        context = ScoringContext(keys=torch.from_numpy(keys), values=None, positions=positions_t, candidates=~protected,
                                 current_position=current, budget=budget, protected=protected)
        expected = top_entries(policy.score(context).float().masked_fill(protected, float("inf")), budget)
        assert int(protected.sum(-1).max()) < budget  # the selection chooses among candidates too
        mlx_protected = mx.array(protected.numpy())
        scores = scorer.score(mx.array(keys), mx.array(positions.astype(np.int32)), ~mlx_protected, np.array([t]), budget)
        kept = np.array(kept_indices(mx.where(mlx_protected, mx.inf, scores), budget))
        got = np.zeros(expected.shape, dtype=bool)
        np.put_along_axis(got, kept, True, axis=-1)
        assert (got == expected.numpy()).all(), f"{method}: seed {seed}, {(got != expected.numpy()).sum()} entries differ"


def test_interleaved_rope_and_scaled_ropes_are_read_from_the_mlx_model(tmp_path, tiny):
    model, _, stats, _ = tiny
    shape = model_shape(model)
    cases = {
        "default": {}, "linear": {"rope_type": "linear", "factor": 2.0},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    }
    for name, scaling in cases.items():
        folder = tmp_path / name
        torch_model = tiny_model("llama", num_hidden_layers=2, rope_parameters={"rope_theta": 10000.0, **(scaling or {"rope_type": "default"})})
        torch_model.save_pretrained(folder)
        rope = read_rope(to_mlx(folder), shape.head_dim)
        geometry = RopeGeometry.from_model(torch_model)
        assert np.allclose(rope.omega, geometry.omega.numpy(), rtol=1e-5), name
        assert rope.attention_scaling == pytest.approx(geometry.attention_scaling, rel=1e-5), name
        assert rope.layout == "half"
    # interleaved pairs (rope_traditional): the scorer reads keys in that layout; same kept sets as the torch scorer
    folder = tmp_path / "default"
    traditional = to_mlx(folder, rope_traditional=True)
    rope = read_rope(traditional, shape.head_dim)
    assert rope.layout == "interleaved" and list(rope.real_index[:3]) == [0, 2, 4]
    cache = trikv.mlx.make_prompt_cache(traditional, budget=24, divide_length=8, stats=stats)
    scorer = trikv.mlx.bounded_cache(cache).scorer
    policy = make_policy("triattention", stats=stats)
    policy.bind_geometry(RopeGeometry.build(RopeGeometry.from_model(model).omega[: shape.head_dim // 2], shape.head_dim,
                                            "interleaved"), shape)
    keys, positions = random_round(5, shape)
    candidates = torch.ones(positions.shape, dtype=torch.bool)
    context = ScoringContext(keys=torch.from_numpy(keys), values=None, positions=torch.from_numpy(positions),
                             candidates=candidates, current_position=torch.tensor([90]), budget=24)
    expected = top_entries(policy.score(context).float(), 24)
    kept = np.array(kept_indices(scorer.score(mx.array(keys), mx.array(positions.astype(np.int32)),
                                              mx.array(candidates.numpy()), np.array([90]), 24), 24))
    got = np.zeros(expected.shape, dtype=bool)
    np.put_along_axis(got, kept, True, axis=-1)
    assert (got == expected.numpy()).all()


# ---- eviction = masking, decode and chunked prefill ------------------------------------------------------------
def masked_attention_class(attention_class):
    """An attention that ignores the model's mask and applies `self.visible` ([b, Hkv, S] bool per stored key)."""

    class Masked(attention_class):
        def __call__(self, x, mask=None, cache=None):
            b, q, _ = x.shape
            visible = self.visible  # [b, Hkv, S]
            S = visible.shape[-1]
            causal = mx.arange(S - q, S)[:, None] >= mx.arange(S)[None]  # [q, S]
            per_query_head = mx.repeat(visible, self.n_heads // self.n_kv_heads, axis=1)  # [b, Hq, S]
            return super().__call__(x, mask=per_query_head[:, :, None, :] & causal, cache=cache)

    return Masked


def run_bounded(model, tokens, chunks, cache):
    """Feed `tokens` in forwards of the given sizes; per forward, the logits of its last token and the positions the
    cache held before it."""
    records, start = [], 0
    for size in chunks:
        before = trikv.mlx.bounded_cache(cache)
        held = None if before.length == 0 else np.array(before.positions())
        logits = model(mx.array(tokens[start:start + size])[None], cache=cache)[0, -1]
        records.append((held, np.array(logits.astype(mx.float32))))
        start += size
    return records


def reference_logits(model, tokens, chunks, records):
    """The same forwards through mlx-lm's full KVCache, each layer seeing only the entries the bounded cache held."""
    attentions = [layer.self_attn for layer in model.layers]
    original = type(attentions[0])
    masked = masked_attention_class(original)
    caches = [KVCache() for _ in attentions]
    out, start = [], 0
    try:
        for attention in attentions:
            attention.__class__ = masked
        for size, (held, _) in zip(chunks, records):
            end = start + size
            for layer, attention in enumerate(attentions):
                visible = np.zeros((1, attention.n_kv_heads, end), dtype=bool)
                visible[..., start:end] = True  # this forward's tokens
                if held is not None:
                    np.put_along_axis(visible, held[layer], True, axis=-1)
                attention.visible = mx.array(visible)
            logits = model(mx.array(tokens[start:end])[None], cache=caches)[0, -1]
            out.append(np.array(logits.astype(mx.float32)))
            start = end
    finally:
        for attention in attentions:
            attention.__class__ = original
    return out


@pytest.mark.parametrize("method", ["triattention", "streaming"])
def test_eviction_equals_masking_in_decode_and_chunked_prefill(tiny, method):
    model, mlx_model, _, stats_file = tiny
    tokens = [int(t) for t in np.random.default_rng(3).integers(1, 90, 100)]
    chunks = [20, 7, 13] + [1] * 60  # a chunked prompt that triggers rounds between chunks, then decoding
    cache = trikv.mlx.make_prompt_cache(mlx_model, method, budget=16, divide_length=4, **method_options(method, stats_file))
    records = run_bounded(mlx_model, tokens, chunks, cache)
    bounded = trikv.mlx.bounded_cache(cache)
    assert bounded.rounds >= 10 and bounded.offset == sum(chunks) and bounded.length <= 20
    expected = reference_logits(mlx_model, tokens, chunks, records)
    for step, ((_, got), want) in enumerate(zip(records, expected)):
        assert np.allclose(got, want, atol=2e-4, rtol=1e-4), f"forward {step}: {np.abs(got - want).max()}"


# ---- same greedy tokens as the transformers path -------------------------------------------------------------------
def agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("method", ["triattention", "triattention-dedup", "streaming", "knorm"])
def test_greedy_tokens_match_the_transformers_cache(tiny, method):
    model, mlx_model, stats, stats_file = tiny
    prompt = [5, 17, 3, 44, 9, 61, 2, 30]
    window = {"recent_window": 8} if method == "triattention-dedup" else {}
    options = ({"stats": stats} if trikv.METHODS[method].needs_stats else {}) | window
    torch_cache = trikv.make_cache(model, method, budget=24, divide_length=6, **options)
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False, min_new_tokens=60,
                                   **trikv.compat.cache_kwargs(model, torch_cache))[0, len(prompt):].tolist()
    cache = trikv.mlx.make_prompt_cache(mlx_model, method, budget=24, divide_length=6, **method_options(method, stats_file),
                                        **window)
    got = [token for token, _ in zip((t for t, _ in generate_step(mx.array(prompt), mlx_model, prompt_cache=cache,
                                                                  max_tokens=60)), range(60))]
    assert torch_cache.rounds >= 5 and trikv.mlx.bounded_cache(cache).rounds == torch_cache.rounds
    assert agreement(got, reference) == 60, (got, reference)


# ---- long prompts and conversations: bounded at every moment --------------------------------------------------
def mlx_greedy(mlx_model, cache, prompt, max_tokens, chunk):
    """mlx-lm's generate_step with `prefill_step_size=chunk` (the prompt but its last token in chunks, then one token
    per forward, each sampled token fed before it is yielded); the greedy tokens."""
    steps = generate_step(mx.array(prompt), mlx_model, prompt_cache=cache, max_tokens=max_tokens, prefill_step_size=chunk)
    return [int(token) for token, _ in zip((t for t, _ in steps), range(max_tokens))]


@torch.no_grad()
def torch_greedy(model, cache, prompt, max_tokens, chunk):
    """The same forwards as `mlx_greedy` through the transformers model and a trikv cache."""
    kwargs = trikv.compat.cache_kwargs(model, cache)
    rest = list(prompt)
    while len(rest) > 1:
        size = min(chunk, len(rest) - 1)
        model(input_ids=torch.tensor([rest[:size]]), **kwargs)
        rest = rest[size:]
    tokens = []
    for _ in range(max_tokens):
        token = int(model(input_ids=torch.tensor([rest]), **kwargs).logits[0, -1].argmax())
        tokens.append(token)
        rest = [token]
    model(input_ids=torch.tensor([rest]), **kwargs)  # mlx-lm feeds every token it yields
    return tokens


def test_a_prompt_ten_times_the_budget_never_takes_the_mlx_cache_past_the_bound(tiny):
    _, mlx_model, _, stats_file = tiny
    budget, slack, chunk = 16, 4, 12
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 90, 10 * budget)]
    cache = trikv.mlx.make_prompt_cache(mlx_model, budget=budget, divide_length=slack, prefill_chunk_size=chunk,
                                        stats=stats_file)
    assert trikv.mlx.prefill_step_size(cache) == chunk
    bounded = trikv.mlx.bounded_cache(cache)
    mlx_greedy(mlx_model, cache, prompt, 30, trikv.mlx.prefill_step_size(cache))
    assert bounded.peak_bound == budget + slack + chunk and bounded.peak_length <= bounded.peak_bound
    assert bounded.rounds >= len(prompt) // chunk - 2 and bounded.offset == len(prompt) + 30
    unchunked = trikv.mlx.make_prompt_cache(mlx_model, budget=budget, divide_length=slack, prefill_chunk_size=chunk,
                                            stats=stats_file)
    with pytest.warns(UserWarning, match=r"a forward of 159 tokens .* pass prefill_step_size=12 to mlx-lm"):
        mlx_greedy(mlx_model, unchunked, prompt, 3, 2048)  # mlx-lm's default step: the whole prompt at once
    assert trikv.mlx.bounded_cache(unchunked).peak_length == len(prompt) - 1


def test_a_chunked_prefill_and_a_second_turn_keep_the_transformers_paths_tokens(tiny):
    """A long first turn (rounds between its chunks) and a second turn on the same prompt cache, mlx-lm's chat
    pattern: each turn's ids through generate_step with the same prompt_cache. The greedy tokens of both turns equal
    those of the transformers model fed the same forwards through a trikv cache, rounds included."""
    model, mlx_model, stats, stats_file = tiny
    rng = np.random.default_rng(6)
    turns = [[int(t) for t in rng.integers(1, 90, n)] for n in (90, 35)]
    cache = trikv.mlx.make_prompt_cache(mlx_model, budget=16, divide_length=4, prefill_chunk_size=10, stats=stats_file)
    torch_cache = trikv.make_cache(model, "triattention", budget=16, divide_length=4, prefill_chunk_size=10, stats=stats)
    for turn in turns:
        got = mlx_greedy(mlx_model, cache, turn, 25, 10)
        want = torch_greedy(model, torch_cache, turn, 25, 10)
        assert agreement(got, want) == 25, (got, want)
    bounded = trikv.mlx.bounded_cache(cache)
    assert bounded.rounds == torch_cache.rounds >= 15 and bounded.peak_length <= bounded.peak_bound
    assert bounded.offset == torch_cache.get_seq_length() == 90 + 25 + 35 + 25


def test_a_conversation_equals_mlx_lms_own_cache_when_nothing_is_evicted(tiny):
    _, mlx_model, _, stats_file = tiny
    rng = np.random.default_rng(7)
    turns = [[int(t) for t in rng.integers(1, 90, n)] for n in (40, 25, 30)]
    bounded = trikv.mlx.make_prompt_cache(mlx_model, budget=1024, stats=stats_file, prefill_chunk_size=16)
    full = [KVCache() for _ in mlx_model.layers]
    for turn in turns:
        assert mlx_greedy(mlx_model, bounded, turn, 12, 16) == mlx_greedy(mlx_model, full, turn, 12, 16)
    assert trikv.mlx.bounded_cache(bounded).rounds == 0 and trikv.mlx.bounded_cache(bounded).offset == full[0].offset


# ---- memory: bounded, quantised ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_memory_stays_bounded_and_quantised_memory_is_budget_times_bits(tiny32, bits):
    model, _ = tiny32
    budget, slack = 20, 5
    cache = trikv.mlx.make_prompt_cache(model, "streaming", budget=budget, divide_length=slack, kv_bits=bits,
                                        kv_group_size=32)
    bounded = trikv.mlx.bounded_cache(cache)
    lengths = []
    for _, _ in zip(generate_step(mx.array([3, 4, 5]), model, prompt_cache=cache, max_tokens=150), range(150)):
        lengths.append(bounded.length)
    assert bounded.offset == 3 + 150 and max(lengths) <= budget + slack and bounded.rounds >= 20
    assert bounded.peak_length <= budget + slack
    head_dim, rows, heads, layers = 32, 1, 2, 2
    entry = 2 * head_dim * 4 if bits is None else 2 * (head_dim * bits // 8 + 2 * 4)  # K+V; scale + bias per group (fp32)
    assert bounded.memory_bytes() == layers * rows * heads * bounded.length * entry
    assert bounded.allocated_bytes() == layers * rows * heads * (budget + slack) * entry
    if bits is not None:
        assert all(layer.bits == bits and layer.group_size == 32 for layer in cache)


def test_mlx_lm_kv_bits_quantises_a_trikv_cache_with_its_kept_sets(tiny32):
    mlx_model, stats_file = tiny32
    prompt = mx.array([5, 17, 3, 44, 9, 61, 2, 30])
    plain = trikv.mlx.make_prompt_cache(mlx_model, budget=24, divide_length=6, stats=stats_file)
    quantised = trikv.mlx.make_prompt_cache(mlx_model, budget=24, divide_length=6, stats=stats_file)
    list(zip(generate_step(prompt, mlx_model, prompt_cache=plain, max_tokens=40), range(40)))
    steps = generate_step(prompt, mlx_model, prompt_cache=quantised, max_tokens=40, kv_bits=8, kv_group_size=32,
                          quantized_kv_start=20)
    list(zip(steps, range(40)))
    assert all(isinstance(layer, trikv.mlx.QuantizedLayerCache) for layer in quantised)  # mlx-lm switched every layer
    a, b = trikv.mlx.bounded_cache(plain), trikv.mlx.bounded_cache(quantised)
    assert b.quantization == (32, 8) and a.rounds == b.rounds >= 1
    assert (np.array(a.kept_positions) == np.array(b.kept_positions)).mean() > 0.9  # 8-bit keys barely move the ranking


# ---- trim, save, batch -------------------------------------------------------------------------------------
def test_trim_is_exact_after_the_last_round_and_refused_before_it(tiny):
    _, mlx_model, _, stats_file = tiny
    tokens = list(range(3, 40))
    cache = trikv.mlx.make_prompt_cache(mlx_model, budget=16, divide_length=8, stats=stats_file)
    mlx_model(mx.array(tokens[:30])[None], cache=cache)  # 30 > 24: a round, 16 kept
    bounded = trikv.mlx.bounded_cache(cache)
    assert bounded.rounds == 1 and bounded.length == 16
    mlx_model(mx.array(tokens[30:35])[None], cache=cache)
    with_extra = np.array(mlx_model(mx.array([7])[None], cache=cache)[0, -1])
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    assert can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 1) == 1
    assert bounded.offset == 35 and bounded.length == 21
    again = np.array(mlx_model(mx.array([7])[None], cache=cache)[0, -1])
    assert np.array_equal(with_extra, again)
    with pytest.raises(ValueError, match="a compression round ran 6 tokens ago"):
        trim_prompt_cache(cache, 10)


def test_saving_and_batching_are_refused_with_the_reason(tiny, tmp_path):
    _, mlx_model, _, stats_file = tiny
    from mlx_lm.models.cache import save_prompt_cache

    cache = trikv.mlx.make_prompt_cache(mlx_model, budget=16, divide_length=8, stats=stats_file)
    list(zip(generate_step(mx.array([4, 5, 6]), mlx_model, prompt_cache=cache, max_tokens=4), range(4)))
    with pytest.raises(ValueError, match="mlx_lm.save_prompt_cache / load_prompt_cache rebuild mlx-lm's own"):
        save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    with pytest.raises(ValueError, match="one sequence at a time"):
        type(cache[0]).merge([cache[0], cache[0]])


# ---- refusals -------------------------------------------------------------------------------------------------
def test_refusals_name_the_problem(tiny, tmp_path):
    model, mlx_model, stats, stats_file = tiny
    with pytest.raises(ValueError, match="'h2o' needs observed queries .* MLX caches run: triattention"):
        trikv.mlx.make_prompt_cache(mlx_model, "h2o", budget=16)
    with pytest.raises(ValueError, match="needs calibration statistics"):
        trikv.mlx.make_prompt_cache(mlx_model, "triattention", budget=16)
    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        trikv.mlx.make_prompt_cache(mlx_model, "streaming", budget=0)
    with pytest.raises(ValueError, match="kv_group_size must be 32, 64 or 128 and divide the head dimension 16"):
        trikv.mlx.make_prompt_cache(mlx_model, "streaming", budget=16, kv_bits=4, kv_group_size=32)
    # statistics of another model: same shape, other weights
    other = tmp_path / "other"
    tiny_model("llama", num_hidden_layers=2, seed=1).save_pretrained(other)
    with pytest.raises(StatsFileError, match="calibrated on different weights"):
        trikv.mlx.make_prompt_cache(to_mlx(other), budget=16, stats=stats_file)
    with pytest.raises(StatsFileError, match="num_layers is 30 in the stats"):
        trikv.mlx.make_prompt_cache(mlx_model, budget=16, stats="smollm2-135m")
    # a hybrid model (sliding-window layers next to full ones)
    hybrid = tmp_path / "gemma3"
    tiny_model("gemma3_text").save_pretrained(hybrid)
    with pytest.raises(UnsupportedModelError, match="mixes sliding-window and full-attention layers"):
        trikv.mlx.make_prompt_cache(to_mlx(hybrid), "streaming", budget=16)
    # a model without RoPE, and one whose RoPE changes with the sequence length
    attention = mlx_model.layers[1].self_attn
    rope = attention.rope
    try:
        del attention.rope
        with pytest.raises(UnsupportedModelError, match="layer 1 applies no rotary embedding"):
            trikv.mlx.make_prompt_cache(mlx_model, "streaming", budget=16)
        from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

        attention.rope = DynamicNTKScalingRoPE(16, 4096, False, 10000.0, 2.0)
        with pytest.raises(UnsupportedModelError, match="changes its frequencies with the sequence length"):
            trikv.mlx.make_prompt_cache(mlx_model, "streaming", budget=16)
    finally:
        attention.rope = rope


def test_a_transformers_5_folder_keeps_its_rope_base():
    """mlx-lm 0.32 reads `rope_theta` at the top of config.json; transformers 5 writes it in `rope_parameters`."""
    config = {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    assert rope_overrides(config) == {"rope_theta": 100000.0}
    scaled = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    assert rope_overrides(scaled) == {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert rope_overrides({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e4}}) == {}


# ---- the bundled model -------------------------------------------------------------------------------------------
@pytest.mark.real_model
def test_smollm2_greedy_through_mlx_lm_agrees_with_the_transformers_path(real_model):
    """SmolLM2 greedy through mlx_lm.generate with a trikv cache vs trikv.generate (transformers): the same tokens
    until the first near-tie (where float32 rounding of two backends may pick either)."""
    import mlx_lm

    model, tokenizer = real_model
    mlx_model, mlx_tokenizer = trikv.mlx.load("smollm2-135m")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Prove that sqrt(2) is irrational."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    new_tokens, settings = 64, dict(budget=48, divide_length=8)
    stats = trikv.load_stats("smollm2-135m", model)
    reference = trikv.generate(model, tokenizer, [prompt], stats=stats, max_new_tokens=new_tokens, return_logits=True,
                               **settings)
    cache = trikv.mlx.make_prompt_cache(mlx_model, stats="smollm2-135m", **settings)
    got = [response.token for response in mlx_lm.stream_generate(mlx_model, mlx_tokenizer, prompt, max_tokens=new_tokens,
                                                                 prompt_cache=cache)]
    want = reference.tokens[0]  # both stop at the end-of-turn token
    same = agreement(got, want)
    bounded = trikv.mlx.bounded_cache(cache)
    assert len(want) == new_tokens and bounded.rounds >= 3 and bounded.peak_length <= 56
    if same < min(len(got), len(want)):  # a divergence must sit on a near-tie of the transformers logits
        top2 = reference.logits[same][0].topk(2).values
        assert float(top2[0] - top2[1]) < 0.05, f"diverged at token {same} with a margin of {float(top2[0] - top2[1]):.3f}"
    print(f"SmolLM2 greedy, B=48: {same} of {len(want)} tokens agree")


# ---- the speed benchmark's pieces and the CLI ---------------------------------------------------------------------
def test_speed_rows_hold_one_round_in_their_window_and_the_bound_is_the_byte_ratio(tiny):
    from mlx_lm.models.cache import make_prompt_cache as full_cache

    from trikv.benchmarks.mlx import page, speed

    _, mlx_model, _, stats_file = tiny
    full = speed.measure(mlx_model, lambda: full_cache(mlx_model), "full", 200, steps=8, warmup=1)
    bounded = speed.measure(mlx_model, lambda: trikv.mlx.make_prompt_cache(mlx_model, budget=32, divide_length=8, stats=stats_file),
                            "trikv B=32", 200, steps=8, warmup=1)
    assert full.rounds == 0 and full.entries == 200 + 9 and full.kv_bytes == 2 * 2 * 2 * 16 * 4 * (200 + 9)
    # the fill ends on a round (32 kept); the round at 32 + 8 falls in the timed window; the last step appends one
    assert bounded.rounds == 1 and bounded.entries == 32 + 1 and 0 < bounded.scoring_share < 1
    assert bounded.kv_bytes == 2 * 2 * 2 * 16 * 4 * 33  # layers x (K, V) x KV heads x head_dim x fp32 x entries
    per_token = page.kv_bytes_per_token(2, 2, 16, 4)
    assert per_token == 512 and page.bound(1000, per_token, 200, None, 8) == 1000 + 512 * 200
    assert page.bound(1000, per_token, 200, 32, 8) == 1000 + 512 * 36


@pytest.mark.real_model
def test_cli_generates_with_the_mlx_engine(capsys):
    from trikv.cli import main

    assert main(["generate", "--engine", "mlx", "--prompt", "Say hello.", "--max-new-tokens", "6", "--min-new-tokens", "6",
                 "--budget", "40", "--divide-length", "8", "--kv-bits", "8", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["engine"] == "mlx" and record["budget"] == 40 and record["kv_bits"] == 8
    assert record["texts"][0].strip() and 0 < record["peak_cache_bytes"]
    with pytest.raises(SystemExit, match="method 'h2o' has no MLX cache"):
        main(["generate", "--engine", "mlx", "--prompt", "hi", "--method", "h2o"])


def test_an_mlx_session_continues_one_prompt_cache_as_trikv_session_does(real_model):
    """`trikv.mlx.Session` (mlx-lm's chat pattern on one trikv prompt cache) and `trikv.Session` (transformers) over
    the same three messages, B = 48, slack 8: each turn feeds only what the chat template adds after the last reply
    (the same token stream on both: transformers feeds the reply's last token with the next turn, mlx-lm as it
    yields it), the cache keeps growing logically while holding at most its bound, and the greedy replies agree
    until a near-tie of the transformers logits."""
    model, tokenizer = real_model
    mlx_model, mlx_tokenizer = trikv.mlx.load("smollm2-135m")
    settings = dict(budget=48, divide_length=8, stats="smollm2-135m")
    mine = trikv.mlx.Session(mlx_model, mlx_tokenizer, **settings)
    theirs = trikv.Session(model, tokenizer, **settings)
    messages = ["Name three prime numbers.", "And three more?", "Which of them is the largest?"]
    for index, message in enumerate(messages):
        fed_mine, fed_theirs = mine.next_ids(message), theirs.next_ids(message)
        before = mine.tokens_seen
        turn = mine.send(message, max_new_tokens=24)
        reference = theirs.send(message, max_new_tokens=24, return_logits=True)
        assert fed_mine == fed_theirs, f"turn {index}: different ids fed"
        assert mine.tokens_seen == before + len(fed_mine) + turn.reply_tokens  # one cache, nothing read again
        assert mine.bounded.peak_length <= 48 + 8 + 512
        same = agreement(mine.reply_ids, reference.tokens[0])
        if mine.reply_ids != reference.tokens[0]:
            top2 = reference.logits[same][0].topk(2).values
            assert float(top2[0] - top2[1]) < 0.05, f"turn {index} diverged at token {same}"
            break  # past a near-tie the two conversations differ
        assert mine.tokens_seen == theirs.tokens_seen + 1  # mlx-lm has fed the reply's last token already
    assert mine.bounded.rounds >= 3


def test_cli_chats_with_the_mlx_engine(monkeypatch, capsys):
    """`trikv chat --engine mlx`: the same lines as on the transformers path, one prompt cache for the conversation."""
    import io

    from trikv.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("Name three prime numbers.\nAnd three more?\n"))
    assert main(["chat", "--engine", "mlx", "--budget", "32", "--divide-length", "16", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 2 and out.count("[KV held: ") == 2 and "rounds so far" in out
    with pytest.raises(SystemExit, match="method 'h2o' has no MLX cache"):
        main(["chat", "--engine", "mlx", "--method", "h2o"])


class _Version(tuple):
    major = property(lambda self: self[0])
    minor = property(lambda self: self[1])


def test_a_missing_mlx_lm_is_named_with_its_python_requirement(monkeypatch, capsys):
    """mlx-lm needs Python >= 3.11 and `trikv[mlx]` skips it on 3.10: the MLX path says so instead of a bare
    "No module named 'mlx_lm'", in Python and on the command line."""
    import sys

    from trikv.cli import main
    from trikv.mlx.model import require_mlx_lm

    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # `import mlx_lm` fails as where it is not installed
    monkeypatch.setattr(sys, "version_info", _Version((3, 10, 14, "final", 0)))
    with pytest.raises(ImportError, match=r"needs mlx-lm, which needs Python >= 3.11 \(this is Python 3.10\)"):
        require_mlx_lm()
    with pytest.raises(ImportError, match="needs mlx-lm"):
        trikv.mlx.load("smollm2-135m")
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--engine", "mlx", "--prompt", "hi", "--max-new-tokens", "4"])
    assert "which needs Python >= 3.11 (this is Python 3.10)" in str(exited.value.code)
    monkeypatch.setattr(sys, "version_info", _Version((3, 12, 1, "final", 0)))
    with pytest.raises(ImportError, match=r'needs mlx-lm: pip install "trikv\[mlx\]"'):
        require_mlx_lm()


@pytest.mark.real_model
def test_load_casts_to_the_dtype_asked_and_names_a_bad_one():
    """`trikv.mlx.load(dtype=...)` casts every floating weight; None keeps the checkpoint's; a bad name is refused
    before anything loads."""
    from mlx.utils import tree_flatten

    kept, _ = trikv.mlx.load("smollm2-135m")
    cast, _ = trikv.mlx.load("smollm2-135m", dtype="float16")
    kept_dtypes = {value.dtype for _, value in tree_flatten(kept.parameters())}
    assert {value.dtype for _, value in tree_flatten(cast.parameters())} == {mx.float16} != kept_dtypes
    with pytest.raises(ValueError, match=r"dtype must be one of float32, bfloat16, float16 or None, got 'fp64'"):
        trikv.mlx.load("smollm2-135m", dtype="fp64")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mapped libraries (Linux)")
def test_the_blas_named_is_mapped_here_and_exports_the_product_mlx_calls():
    """`blas_library()` names a library this process has mapped and that exports `cblas_sgemm`; with nothing
    preloaded, that is the reference BLAS mlx-cpu's wheel bundles. A library preloaded ahead of it (MKL, where it is
    installed) is named instead."""
    import ctypes
    import subprocess
    import sys

    from trikv.mlx.blas import blas_library, is_reference_blas

    name = blas_library()
    assert name is not None
    mapped = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
    path = next(p for p in mapped if os.path.basename(p) == name)
    assert ctypes.CDLL(path).cblas_sgemm
    preloaded = os.environ.get("LD_PRELOAD", "")
    assert is_reference_blas(name) == (not preloaded)
    mkl = Path(sys.prefix) / "lib" / "libmkl_rt.so.3"
    if mkl.exists() and not preloaded:
        probe = "from trikv.mlx.blas import blas_library; print(blas_library())"
        got = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, LD_PRELOAD=str(mkl)),
                             capture_output=True, text=True, check=True).stdout.strip()
        assert got == "libmkl_rt.so.3"
