"""The lean engine (trikv.lean) is the transformers forward, faster; the fast round helpers are exact."""

from __future__ import annotations

import pytest
import torch

import trikv
from trikv.fast import FastTriScorer, compact_slots_, gather_slots
from trikv.fast.rounds import AHEAD_MIN_SLICE
from trikv.geometry import RopeGeometry
from trikv.lean import LeanEngine, stock_layout_copy
from trikv.scoring import TriScorer, offset_values

from helpers import tiny_model
from stats_fixtures import tiny_stats
from trikv.compat import cache_kwargs


pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
ATOL = 2e-4  # fp32 logits of the tiny models are ~10-40; the engines differ only in summation order


class _Tokenizer:
    pad_token_id = 0
    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _both(model, prompts, **options):
    tokenizer = _Tokenizer()
    options = dict(max_new_tokens=32, min_new_tokens=32, return_logits=True, **options)
    hf = trikv.generate(model, tokenizer, prompts, engine="transformers", **options)
    lean = trikv.generate(model, tokenizer, prompts, engine="lean", **options)
    return hf, lean


@pytest.mark.parametrize("family", FAMILIES)
def test_lean_equals_transformers_with_eviction_and_left_padding(family):
    model = tiny_model(family)
    torch.manual_seed(3)
    prompts = [torch.randint(1, 96, (n,)).tolist() for n in (29, 11, 20)]
    hf, lean = _both(model, prompts, method="triattention", stats=tiny_stats(model), budget=24, divide_length=8)
    assert hf.cache.rounds >= 4 and lean.cache.rounds == hf.cache.rounds
    assert lean.tokens == hf.tokens
    torch.testing.assert_close(torch.stack(lean.logits), torch.stack(hf.logits), rtol=0, atol=ATOL)
    # the same slots survived in every layer / row / head
    assert torch.equal(lean.cache.visible_positions(), hf.cache.visible_positions())


@pytest.mark.parametrize("threads", [2, 3])
def test_split_k_gemv_with_several_threads(threads):
    """With T > 1 threads decode GEMVs are split along the input axis (T partial products): same tokens,
    logits within float rounding; input sizes T does not divide take the plain GEMV."""
    from trikv.lean import _linear

    torch.set_num_threads(threads)
    x, w, bias, residual = torch.randn(2, 48), torch.randn(48, 20), torch.randn(20), torch.randn(2, 20)
    torch.testing.assert_close(_linear(x, w, bias, residual), residual + x @ w + bias, rtol=0, atol=1e-5)
    torch.testing.assert_close(_linear(x[:, :47], w[:47], None), x[:, :47] @ w[:47], rtol=0, atol=1e-5)
    model = tiny_model("qwen2")
    torch.manual_seed(6)
    prompts = [torch.randint(1, 96, (n,)).tolist() for n in (21, 8)]
    hf, lean = _both(model, prompts, method="triattention", stats=tiny_stats(model), budget=24, divide_length=8)
    assert lean.tokens == hf.tokens
    torch.testing.assert_close(torch.stack(lean.logits), torch.stack(hf.logits), rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_lean_equals_transformers_without_eviction(family):
    """Full attention: the lean engine on a trikv cache vs transformers on its own DynamicCache."""
    model = tiny_model(family)
    torch.manual_seed(4)
    prompts = [torch.randint(1, 96, (n,)).tolist() for n in (25, 9)]
    hf, lean = _both(model, prompts, method="full")
    assert type(hf.cache).__name__ == "DynamicCache" and lean.cache.rounds == 0
    assert lean.tokens == hf.tokens
    torch.testing.assert_close(torch.stack(lean.logits), torch.stack(hf.logits), rtol=0, atol=ATOL)


@pytest.mark.parametrize("method, options", [
    ("snapkv-decode", {}), ("h2o", {}), ("tam", dict(schedule="shared", segmentation="none", nnls_iters=4)),
])
def test_lean_serves_policies_with_queries_observation_and_biases(method, options):
    """Policies that read live queries (query tap), observe every step, or add per-key biases (compaction)."""
    model = tiny_model("llama")
    torch.manual_seed(5)
    prompts = [torch.randint(1, 96, (n,)).tolist() for n in (30, 14)]
    hf, lean = _both(model, prompts, method=method, budget=24, divide_length=8, **options)
    assert hf.cache.rounds >= 3
    if method == "tam":
        assert lean.cache.store.has_bias  # the per-key log-biases really reached attention
    assert lean.tokens == hf.tokens
    torch.testing.assert_close(torch.stack(lean.logits), torch.stack(hf.logits), rtol=0, atol=ATOL)


def test_lean_chunked_prefill_and_weight_sharing():
    """Prompt chunks (several tokens into a non-empty cache) and the fused weights staying in sync."""
    model = tiny_model("qwen2", attn="eager")
    stats = tiny_stats(model)
    prompt = torch.randint(1, 96, (1, 120))
    engine = LeanEngine.for_model(model, share_weights=True)
    # shared weights: the model's own q/k/v and gate/up weights live inside the fused, transposed tensors (no copy)
    layer = model.model.layers[0]
    fused = engine.layers[0].qkv_wt  # [in, q + k + v]
    assert layer.self_attn.k_proj.weight.data_ptr() == fused[:, layer.self_attn.q_proj.out_features :].data_ptr()
    assert torch.equal(layer.self_attn.k_proj.weight, fused[:, 64:96].t())
    caches = [trikv.make_cache(model, "triattention", budget=32, divide_length=8, stats=stats, protect_prompt=False) for _ in range(2)]
    with torch.no_grad():
        for start in range(0, 120, 30):
            chunk, positions = prompt[:, start : start + 30], torch.arange(start, start + 30)[None]
            ours = engine(chunk, caches[0], position_ids=positions, logits_to_keep=0)
            ref = model(input_ids=chunk, position_ids=positions, **cache_kwargs(model, caches[1])).logits
            torch.testing.assert_close(ours, ref, rtol=0, atol=ATOL)
    assert caches[0].rounds == caches[1].rounds >= 2
    stock = stock_layout_copy(model)  # the layout transformers loads, same values
    assert all(p.is_contiguous() for p in stock.parameters()) and not model.model.layers[0].mlp.up_proj.weight.is_contiguous()
    torch.testing.assert_close(stock.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight, rtol=0, atol=0)
    # replacing a parameter rebuilds the engine (the fingerprint changes)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight * 1.5)
    assert LeanEngine.for_model(model, share_weights=True) is not engine


def test_memory_stays_within_budget_plus_slack_over_many_rounds():
    model = tiny_model("llama")
    budget, slack = 16, 8
    engine = LeanEngine.for_model(model)
    cache = trikv.make_cache(model, "triattention", stats=tiny_stats(model), budget=budget, divide_length=slack)
    tokens = torch.arange(1, 41)[None]
    positions = torch.arange(40)[None]
    entries = []
    with torch.no_grad():
        for _ in range(300):
            tokens = engine(tokens, cache, position_ids=positions)[:, -1].argmax(-1, keepdim=True)
            positions = positions[:, -1:] + 1
            entries.append(cache.entries())
            assert cache.capacity <= max(budget + slack, 40)
    assert cache.rounds >= 30
    assert max(entries[1:]) == budget + slack and min(entries[1:]) == budget + 1  # oscillates between B and B + beta
    assert cache.capacity == budget + slack  # the buffers shrank after the prompt and never grew again
    per_entry = 2 * cache.shape.num_layers * cache.shape.num_kv_heads * cache.shape.head_dim * 4
    assert cache.memory_bytes() <= (budget + slack) * per_entry
    assert cache.get_seq_length() == 40 + 299


def test_release_free_heap_returns_the_pages_of_freed_blocks():
    """Blocks freed between live ones stay resident (glibc keeps them for reuse) until release_free_heap."""
    from trikv.heap import release_free_heap

    def resident() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    if not release_free_heap():
        pytest.skip("no glibc malloc_trim here")
    blocks = [torch.ones(16 * 1024) for _ in range(2000)]  # 64 KiB each: heap blocks, below the mmap threshold
    del blocks[::2]  # ~62 MiB of holes between live blocks
    before = resident()
    assert release_free_heap()
    assert before - resident() > 31 * 2**20


def test_generation_releases_the_free_heap_every_few_steps(monkeypatch):
    """A long generation hands freed pages back every HEAP_RELEASE_STEPS decode steps, on both engines."""
    import trikv.generation as generation

    monkeypatch.setattr(generation, "HEAP_RELEASE_STEPS", 4)
    model = tiny_model("llama")
    for engine in ("transformers", "lean"):
        calls = []
        monkeypatch.setattr(generation, "release_free_heap", lambda: calls.append(1) or True)
        result = trikv.generate(model, _Tokenizer(), [[5, 6, 7]], method="full", max_new_tokens=10, min_new_tokens=10,
                                engine=engine)
        assert result.steps == 10 and len(calls) == 2  # after steps 4 and 8


def test_scoring_ahead_is_used_and_changes_nothing():
    model = tiny_model("llama")
    stats = tiny_stats(model)
    calls = []
    original = FastTriScorer._usable_ahead

    def spy(self, keys, t):
        done = original(self, keys, t)
        calls.append((done, keys.shape[3]))
        return done

    runs = {}
    FastTriScorer._usable_ahead = spy
    try:
        for spread in (True, False):
            cache = trikv.make_cache(model, "triattention", budget=24, divide_length=16, stats=stats)
            assert isinstance(cache.policy.scorer, FastTriScorer)
            cache.policy.scorer.spread = spread
            calls.clear()
            runs[spread] = trikv.generate(model, _Tokenizer(), [list(range(3, 33))], cache=cache, max_new_tokens=120,
                                          min_new_tokens=120, return_logits=True, engine="lean")
            runs[spread].calls = list(calls)
    finally:
        FastTriScorer._usable_ahead = original
    on, off = runs[True], runs[False]
    assert on.tokens == off.tokens
    torch.testing.assert_close(torch.stack(on.logits), torch.stack(off.logits), rtol=0, atol=0)
    decode_rounds = [(done, n) for done, n in on.calls if n == 24 + 16]
    # at round time only what arrived since the last slice is left (slices of AHEAD_MIN_SLICE slots at the least)
    assert len(decode_rounds) >= 5 and all(n - AHEAD_MIN_SLICE < done < n for done, n in decode_rounds)
    assert all(done == 0 for done, _ in off.calls)


def test_scoring_ahead_only_where_the_rows_are_due_together():
    """Rows of different prompt lengths are due at different steps and each round scores its due rows alone,
    so scoring the whole batch ahead would be wasted; rows due together are scored ahead."""
    model = tiny_model("llama")
    stats = tiny_stats(model)
    ahead_calls = []
    original = FastTriScorer.ahead

    def spy(self, *args):
        ahead_calls.append(1)
        return original(self, *args)

    FastTriScorer.ahead = spy
    try:
        for lengths, together in (((30, 30), True), ((30, 21), False)):
            ahead_calls.clear()
            cache = trikv.make_cache(model, "triattention", budget=24, divide_length=16, stats=stats)
            prompts = [list(range(3, 3 + n)) for n in lengths]
            trikv.generate(model, _Tokenizer(), prompts, cache=cache, max_new_tokens=60, min_new_tokens=60, engine="lean")
            assert cache.rounds >= 3
            assert cache.schedule.aligned is together
            assert bool(ahead_calls) is together
    finally:
        FastTriScorer.ahead = original


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_fast_scorer_matches_reference_scorer(layout):
    torch.manual_seed(0)
    L, Hq, Hkv, D = 3, 6, 2, 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D))
    geometry = RopeGeometry.build(inv_freq, D, layout)
    q_mean = torch.complex(torch.randn(L, Hq, D // 2), torch.randn(L, Hq, D // 2)).to(torch.complex128)
    q_abs = q_mean.abs() + torch.rand(L, Hq, D // 2).double()
    reference = TriScorer(q_mean, q_abs, geometry, Hkv, offset_values())
    fast = FastTriScorer.from_scorer(reference)
    keys = torch.randn(L, 2, Hkv, 300, D) * 2
    t = torch.tensor([700, 1234])
    expected = reference.score(keys, t)
    torch.testing.assert_close(fast.score(keys, t), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fast.score(keys[:, :, :, :40], t), expected[..., :40], rtol=1e-5, atol=1e-4)  # small-n path
    for option in (dict(use_trig=False), dict(use_norm=False)):
        ref = TriScorer(q_mean, q_abs, geometry, Hkv, offset_values(), **option)
        torch.testing.assert_close(FastTriScorer.from_scorer(ref).score(keys, t), ref.score(keys, t), rtol=1e-5, atol=1e-4)


def test_slot_compaction_helpers_match_gather():
    torch.manual_seed(1)
    buffer = torch.randn(4, 2, 3, 50, 8)
    order = torch.rand(4, 2, 3, 45).topk(30, dim=-1).indices.sort(-1).values
    expected = buffer[:, :, :, :45].gather(3, order[..., None].expand(*order.shape, 8))
    assert torch.equal(gather_slots(buffer, order), expected)
    in_place = buffer.clone()
    compact_slots_(in_place, order)
    assert torch.equal(in_place[:, :, :, :30], expected)
    assert torch.equal(in_place[:, :, :, 30:], buffer[:, :, :, 30:])  # the tail is left alone


def test_lean_engine_leaves_the_model_as_it_found_it(tmp_path):
    """Building the engine copies the weights: the model's parameters keep their storage and layout, and
    `save_pretrained` still works."""
    from trikv.lean import LeanEngine

    model = tiny_model("qwen2")
    before = {name: (param.data_ptr(), param.is_contiguous(), param.detach().clone()) for name, param in model.named_parameters()}
    LeanEngine.for_model(model)
    for name, param in model.named_parameters():
        pointer, contiguous, values = before[name]
        assert param.data_ptr() == pointer and param.is_contiguous() == contiguous, name
        assert torch.equal(param.detach(), values), name
    model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").is_file()


def test_lean_engine_called_directly_skips_left_padding_in_positions():
    """Without position_ids, a left-padded row gets the RoPE positions of its own tokens, as in transformers."""
    from trikv.lean import LeanEngine

    model = tiny_model("llama")
    prompt = torch.randint(1, 96, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    padded = torch.tensor([[0] * 5 + prompt, list(range(1, 18))])
    mask = torch.ones_like(padded)
    mask[0, :5] = 0
    cache = trikv.make_cache(model, "streaming", budget=64)
    lean_logits = LeanEngine.for_model(model)(padded, cache, attention_mask=mask, logits_to_keep=1)[0, -1]
    alone = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(lean_logits, alone, rtol=0, atol=ATOL)
