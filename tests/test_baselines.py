"""Baselines (issue 3): every method on the same cache, exact when nothing is evicted, exact masking when
something is, and each rule checked on a small hand-built case whose answer is known."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import trikv
from trikv.architectures import ModelShape
from trikv.policies import REGISTRY, describe_methods, list_methods_table, make_policy
from trikv.policies.adakv import adaptive_head_budgets
from trikv.policies.attention_scores import grouped_logits, window_probabilities
from trikv.policies.base import ObservationContext, ScoringContext
from trikv.policies.lazy_eviction import recurrence_importance
from trikv.policies.pyramidkv import pyramid_budgets
from trikv.policies.rkv import mean_similarity

from helpers import VisibleLog, masked_reference_logits, tiny_model
from trikv.compat import cache_kwargs

BASELINES = ["streaming", "h2o", "snapkv", "snapkv-decode", "pyramidkv", "adakv", "tova", "knorm", "rkv", "lazyeviction", "raas", "rpc", "vatp"]
# small windows so that a budget of 40 leaves room for selection in the tiny-model runs
SMALL = {"lazyeviction": dict(window=8), "rpc": dict(selector_window=8)}


pytestmark = pytest.mark.usefixtures("one_thread")


class _ByteTokenizer:
    pad_token_id = 0
    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


# ---------------------------------------------------------------------------------------------------
# registry


def test_registry_has_every_baseline_and_keeps_existing_entries():
    for name in BASELINES + ["full", "triattention", "triattention-trig-only", "triattention-norm-only"]:
        assert name in REGISTRY
    rows = dict(describe_methods())
    assert set(BASELINES) <= set(rows) and all(rows[name] for name in BASELINES)
    table = list_methods_table()
    assert all(name in table for name in BASELINES)
    with pytest.raises(ValueError, match="no option"):
        make_policy("rkv", lambda_=0.3)


def test_the_methods_page_is_the_registry_and_credits_each_rule_to_its_source():
    """docs/guides/methods.md is `trikv methods --markdown` as committed; a variant with trikv's own addition (a
    recent window the paper does not use) is not credited to the paper, the ablations are "variants", and the
    random control is listed as running on every backend."""
    from pathlib import Path

    from trikv.policies import methods_markdown

    page = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "methods.md").read_text()
    assert page == methods_markdown(), "docs/guides/methods.md is stale: run `trikv methods --markdown > docs/guides/methods.md`"
    rows = {line.split("|")[1].strip(" `"): line.split("|")[3].strip() for line in page.splitlines() if line.startswith("| `")}
    assert rows["triattention"].startswith("Mao et al.")
    assert rows["triattention-recent"].startswith("trikv's own variant") and "no recent window" in rows["triattention-recent"]
    assert rows["triattention-trig-only"] == "variant of Mao et al.'s method"
    assert rows["random"].startswith("trikv's control") and "| `random` |" in page and "transformers, vLLM, MLX |" in \
        next(line for line in page.splitlines() if line.startswith("| `random` |"))


def test_make_cache_by_name():
    model = tiny_model("llama")
    for name in BASELINES:
        cache = trikv.make_cache(model, name, budget=64, **SMALL.get(name, {}))
        assert cache.policy.name == name and cache.budget == 64


def test_paper_schedules():
    model = tiny_model("llama")
    assert trikv.make_cache(model, "tova", budget=64, schedule="paper").divide_length == 1
    assert trikv.make_cache(model, "h2o", budget=64, schedule="paper").divide_length == 1
    assert trikv.make_cache(model, "lazyeviction", budget=64, window=16, schedule="paper").divide_length == 16
    assert trikv.make_cache(model, "rpc", budget=64, selector_window=8, interval=256, schedule="paper").divide_length == 256
    assert trikv.make_cache(model, "tova", budget=64).divide_length == 128
    with pytest.raises(ValueError, match="schedule"):
        trikv.make_cache(model, "tova", budget=64, schedule="weekly")


# ---------------------------------------------------------------------------------------------------
# exactness on tiny models

_REFERENCE: dict = {}


def _reference(attn):
    """Plain transformers generate with DynamicCache (computed once per attention implementation)."""
    if attn not in _REFERENCE:
        model = tiny_model("llama", attn=attn)
        prompt = torch.randint(1, 96, (1, 36), generator=torch.Generator().manual_seed(3))
        out = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), **cache_kwargs(model, DynamicCache(config=model.config)),
            max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0,
        )
        _REFERENCE[attn] = (model, prompt, out)
    return _REFERENCE[attn]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("method", BASELINES)
def test_no_eviction_matches_dynamic_cache(method, attn):
    model, prompt, reference = _reference(attn)
    cache = trikv.make_cache(model, method, budget=512, **SMALL.get(method, {}))
    ours = model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), **cache_kwargs(model, cache),
        max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0,
    )
    assert cache.rounds == 0
    assert torch.equal(ours.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(reference.logits), rtol=0, atol=1e-5)


_MASKING_MODELS: dict = {}


@pytest.mark.parametrize("method", BASELINES)
def test_eviction_equals_masking(method):
    """Generation with eviction == full attention with exactly the evicted (position, layer, head) masked."""
    attn = "sdpa" if method in ("pyramidkv", "adakv", "h2o", "rkv") else "eager"
    if attn not in _MASKING_MODELS:
        _MASKING_MODELS[attn] = tiny_model("llama", attn=attn)
    model = _MASKING_MODELS[attn]
    prompt = torch.randint(1, 96, (1, 24), generator=torch.Generator().manual_seed(5)).tolist()
    log = VisibleLog(model)
    try:
        result = trikv.generate(
            model, _ByteTokenizer(), prompt, method=method, budget=40, divide_length=12,
            max_new_tokens=70, min_new_tokens=70, return_logits=True, protect_prompt=False, **SMALL.get(method, {}),
        )
    finally:
        log.close()
    cache = result.cache
    assert cache.rounds >= 3
    live = (cache.visible_positions() >= 0).sum(-1)  # [L, b, Hkv]
    if method in ("pyramidkv", "adakv"):  # the same total, redistributed over layers / heads
        assert (live.float().mean(dim=(0, 2)) <= cache.budget + cache.divide_length).all()
    else:
        assert (live <= cache.budget + cache.divide_length).all()
    reference = masked_reference_logits(model, torch.tensor(prompt), torch.ones(1, 24, dtype=torch.long), torch.tensor(result.tokens), log.visible)
    torch.testing.assert_close(torch.stack(result.logits), reference, rtol=0, atol=2e-4)


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("method", ["snapkv", "h2o", "rkv", "tova"])
def test_attention_baselines_on_hybrid_models_equal_masking(family, method):
    """Attention-scored baselines on the hybrid families (GPT-OSS with sinks in every softmax they compute):
    eviction in the global layers == full attention with exactly those entries masked."""
    model = tiny_model(family, attn="eager", seed=4)
    prompt = torch.randint(1, 96, (1, 24), generator=torch.Generator().manual_seed(5)).tolist()
    log = VisibleLog(model)
    try:
        result = trikv.generate(model, _ByteTokenizer(), prompt, method=method, budget=40, divide_length=12,
                                max_new_tokens=60, min_new_tokens=60, return_logits=True, **SMALL.get(method, {}))
    finally:
        log.close()
    assert result.cache.rounds >= 3
    assert result.cache.visible_positions().shape[0] == 2  # the two global layers of four
    assert (result.cache.policy.sinks is not None) == (family == "gpt_oss")
    reference = masked_reference_logits(model, torch.tensor(prompt), torch.ones(1, 24, dtype=torch.long), torch.tensor(result.tokens), log.visible)
    torch.testing.assert_close(torch.stack(result.logits), reference, rtol=0, atol=2e-4)


@pytest.mark.parametrize("method", ["h2o", "adakv", "pyramidkv", "rkv", "tova"])
def test_left_padded_batch_equals_rows_alone(method):
    model = tiny_model("llama", attn="sdpa", seed=1)
    prompts = [torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (26, 9)]
    options = dict(method=method, budget=32, divide_length=8, max_new_tokens=40, min_new_tokens=40, return_logits=True, **SMALL.get(method, {}))
    batch = trikv.generate(model, _ByteTokenizer(), prompts, **options)
    assert batch.cache.rounds >= 3
    for row, prompt in enumerate(prompts):
        alone = trikv.generate(model, _ByteTokenizer(), [prompt], **options)
        assert batch.tokens[row] == alone.tokens[0]
        torch.testing.assert_close(torch.stack(batch.logits)[:, row], torch.stack(alone.logits)[:, 0], rtol=0, atol=2e-4)


def test_memory_after_rounds():
    """Uniform methods hold exactly `budget` entries per (layer, head) after a round; PyramidKV / Ada-KV
    redistribute the same total (per layer for Ada-KV, over layers for PyramidKV) and, in the packed layout,
    store exactly what they keep."""
    model = tiny_model("llama")
    budget = 40
    for method in ("snapkv", "adakv", "pyramidkv", "h2o"):
        cache = trikv.make_cache(model, method, budget=budget, divide_length=16, protect_prompt=False)
        after = []
        original = cache.compress

        memory = []

        def compress(original=original, cache=cache, after=after, memory=memory):
            original()
            after.append((cache.visible_positions() >= 0).sum(-1).clone())  # [L, b, Hkv]
            memory.append(cache.memory_bytes())

        cache.compress = compress
        trikv.generate(model, _ByteTokenizer(), [list(range(1, 31))], cache=cache, max_new_tokens=120, min_new_tokens=120)
        assert len(after) >= 5
        L, _, Hkv = after[0].shape
        for live in after:
            if method in ("snapkv", "h2o"):
                assert (live == budget).all()
            elif method == "adakv":
                assert (live.sum(-1) == Hkv * budget).all()
                assert live.max() > budget  # heads really differ
            else:
                assert (live.sum(dim=(0, 2)) <= L * Hkv * budget).all()
        if method == "pyramidkv":
            last = after[-1][:, 0, 0]
            assert (last.sum() == L * budget) and bool((last[:-1] >= last[1:]).all()) and last[0] > last[-1]
        if method in ("snapkv", "h2o"):
            assert cache.memory_bytes() == 2 * L * Hkv * cache.length * 16 * 4
        else:  # packed layout: the bytes right after a round are exactly the entries kept, nothing padded
            assert cache.layout == "packed"
            assert memory[-1] == int(after[-1].sum()) * 2 * 16 * 4
            assert (torch.tensor(memory) <= L * Hkv * budget * 2 * 16 * 4).all()


# ---------------------------------------------------------------------------------------------------
# the query capture


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_captured_queries_reproduce_the_models_attention(family):
    """Window probabilities from the recorded post-RoPE queries == the eager model's attention weights (GPT-OSS:
    its attention sinks in the denominator, so the keys' weights sum to less than 1; only its global layers)."""
    model = tiny_model(family, attn="eager")
    cache = trikv.make_cache(model, "snapkv", budget=512, window_size=4)
    sinks = cache.policy.sinks
    ids = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(model, cache), output_attentions=True)
        step = model(input_ids=torch.tensor([[7]]), **cache_kwargs(model, cache), output_attentions=True)
    window = cache.query_window
    assert window.positions.sort().values.tolist() == [[17, 18, 19, 20]]
    n = cache.length
    queries, qpos = window.latest(2, cache.seen)  # the last prompt token and the decode token
    shape = cache.shape
    assert (sinks is not None) == (family == "gpt_oss")
    for layers, probs in window_probabilities(queries, qpos, cache.store.keys[:, :, :, :n], cache.store.positions[:, :, :, :n],
                                              model.model.layers[0].self_attn.scaling, group="none", sinks=sinks):
        for row, layer in enumerate(shape.cached_layers):
            expected_prompt = out.attentions[layer][0, :, -1, :]  # [Hq, 20]
            expected_step = step.attentions[layer][0, :, 0, :]  # [Hq, 21]
            got = probs[row, 0].reshape(shape.num_heads, 2, n)  # [Hkv, G, 2, N] -> [Hq, 2, N]
            if sinks is not None:
                assert float(got[:, 1, :].sum(-1).min()) < 0.9  # the sink takes a real share of some head
            torch.testing.assert_close(got[:, 0, :20], expected_prompt, rtol=0, atol=1e-5)
            torch.testing.assert_close(got[:, 1, :], expected_step, rtol=0, atol=1e-5)


def test_h2o_accumulates_every_query_of_prefill_and_decode():
    model = tiny_model("llama", attn="eager")
    cache = trikv.make_cache(model, "h2o", budget=512)
    ids = torch.randint(1, 96, (1, 15), generator=torch.Generator().manual_seed(4))
    G = cache.shape.group_size
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(model, cache), output_attentions=True)
        expected = torch.stack([a[0].sum(1) for a in out.attentions])  # [L, Hq, 15] summed over queries
        expected = torch.nn.functional.pad(expected, (0, 3))
        for token in (5, 6, 7):
            step = model(input_ids=torch.tensor([[token]]), **cache_kwargs(model, cache), output_attentions=True)
            if token != 7:  # the last step is observed before the next forward
                expected += torch.nn.functional.pad(torch.stack([a[0, :, 0] for a in step.attentions]), (0, 18 - step.attentions[0].shape[-1]))
    accumulated = cache.policy.state["attention"]  # [L, 1, Hkv, 17]: the 18th token is not observed yet
    L, Hq = expected.shape[:2]
    grouped = expected.view(L, Hq // G, G, 18).sum(2)
    assert accumulated.shape[-1] == 17
    torch.testing.assert_close(accumulated[:, 0], grouped[..., :17], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# rules on hand-built contexts


def _bound(policy, heads=1, kv_heads=1, layers=1, head_dim=8):
    policy.shape = ModelShape("llama", layers, heads, kv_heads, head_dim, "half")
    policy.scaling = 1.0
    return policy


def _context(keys, budget, values=None, positions=None, protected=None, queries=None, query_positions=None, current=None):
    L, b, H, N, D = keys.shape
    if positions is None:
        positions = torch.arange(N).expand(L, b, H, N).clone()
    if protected is None:
        protected = torch.zeros(L, b, H, N, dtype=torch.bool)
    if current is None:
        current = positions.amax(dim=(0, 2, 3)) + 1
    return ScoringContext(
        keys=keys,
        values=torch.ones_like(keys) if values is None else values,
        positions=positions,
        candidates=~protected & (positions >= 0),
        current_position=current,
        budget=budget,
        queries=queries,
        query_positions=query_positions,
        protected=protected,
    )


def _kept(policy, context):
    """The cache's selection rule: protected in, dead out, top-budget (or the policy's per-head budgets)."""
    scores = policy.score(context).float()
    scores = scores.masked_fill(context.protected, float("inf")).masked_fill(context.positions < 0, float("-inf"))
    counts = policy.allocate(scores, context) if policy.variable_budgets else None
    if counts is None:
        counts = torch.full(scores.shape[:3], context.budget)
    result = {}
    for index in torch.cartesian_prod(*[torch.arange(n) for n in scores.shape[:3]]):
        l, b, h = index.tolist()
        top = scores[l, b, h].topk(int(counts[l, b, h])).indices
        result[(l, b, h)] = sorted(context.positions[l, b, h, top].tolist())
    return result


def _one_hot_keys(n, d=None, heads=1, scale=1.0):
    d = d or n
    keys = torch.zeros(1, 1, heads, n, d)
    keys[..., torch.arange(n), torch.arange(n) % d] = scale
    return keys


def _query(*targets, d, scale=30.0):
    q = torch.zeros(d)
    for t in targets:
        q[t] = scale
    return q


def test_streaming_keeps_sinks_and_most_recent():
    policy = make_policy("streaming")
    context = _context(torch.randn(1, 1, 2, 20, 8), budget=10)
    assert all(kept == [0, 1, 2, 3, 14, 15, 16, 17, 18, 19] for kept in _kept(policy, context).values())


def _observe(policy, keys, query_vectors, query_position):
    """One decode observation: query_vectors [Hq, D] at `query_position` over all `keys` [1, 1, Hkv, N, D]."""
    N = keys.shape[3]
    policy.observe(
        ObservationContext(
            layers=slice(None),
            queries=query_vectors[None, None, :, None, :],
            query_positions=torch.tensor([[query_position]]),
            keys=keys,
            values=torch.ones_like(keys),
            positions=torch.arange(N).expand(1, 1, keys.shape[2], N).clone(),
        )
    )


def test_h2o_keeps_the_largest_accumulated_attention_and_follows_rounds():
    policy = _bound(make_policy("h2o", recent_tokens=0), heads=2)
    policy.configure(3, 128)
    keys = _one_hot_keys(8)
    for position, target in ((8, 3), (9, 5), (10, 7), (11, 3)):
        _observe(policy, keys, torch.stack([_query(target, d=8), _query(target, d=8)]), position)
    context = _context(keys, budget=3)
    assert _kept(policy, context)[(0, 0, 0)] == [3, 5, 7]
    scores = policy.importance(context)[0, 0, 0]
    assert scores[3] > scores[5] > scores[1] and scores[3] == pytest.approx(4.0, abs=1e-3)  # 2 steps x 2 heads
    # a round keeps slots 3, 5, 7: the accumulated attention moves with them
    policy.after_round(torch.tensor([3, 5, 7]).view(1, 1, 1, 3))
    assert policy.state["attention"][0, 0, 0].tolist() == pytest.approx([4.0, 2.0, 2.0], abs=1e-3)


def test_h2o_protects_a_recent_window_of_half_the_budget():
    policy = make_policy("h2o")
    policy.configure(64, 128)
    assert policy.recent_window == 32


def test_tova_keeps_what_the_newest_query_attends_to_one_selection_per_layer():
    policy = _bound(make_policy("tova"), heads=2, kv_heads=2)
    keys = torch.cat([_one_hot_keys(8), _one_hot_keys(8).flip(3)], dim=2)  # two KV heads, different keys
    queries = torch.stack([_query(6, d=8), torch.zeros(8)])[None, None, :, None, :]  # head 0 looks at key 6
    context = _context(keys, budget=1, queries=queries, query_positions=torch.tensor([[8]]))
    kept = _kept(policy, context)
    assert kept[(0, 0, 0)] == [6] and kept[(0, 0, 1)] == [6]  # layer-wise: the same slot in both heads


def test_snapkv_keeps_what_the_observation_window_attends_to_plus_the_window():
    keys = _one_hot_keys(16)
    window_queries = torch.stack([_query(4, d=16), _query(4, 9, d=16)])  # the last two tokens (14, 15)
    queries = window_queries[None, None, None]  # [1, 1, Hq=1, w=2, D]
    query_positions = torch.tensor([[14, 15]])
    protected = torch.zeros(1, 1, 1, 16, dtype=torch.bool)
    protected[..., 14:] = True  # the window (the cache protects it)
    policy = _bound(make_policy("snapkv-decode", window_size=2, kernel_size=1))
    context = _context(keys, budget=4, protected=protected, queries=queries, query_positions=query_positions)
    assert _kept(policy, context)[(0, 0, 0)] == [4, 9, 14, 15]
    # max pooling (kernel 3) lets the neighbours of the hot key share its score
    policy = _bound(make_policy("snapkv-decode", window_size=2, kernel_size=3))
    context = _context(keys, budget=5, protected=protected, queries=queries, query_positions=query_positions)
    assert _kept(policy, context)[(0, 0, 0)] == [3, 4, 5, 14, 15]
    assert policy.recent_window == policy.query_window == 2


def test_pyramid_budgets_shrink_with_depth_and_keep_the_total():
    budgets = pyramid_budgets(torch.tensor([248, 248]), torch.tensor([1000, 300]), torch.tensor([8, 8]), 30, 20)
    deep = budgets[:, 0]
    assert deep.sum() == 30 * 248 and deep[0] > deep[-1] and bool((deep[:-1] >= deep[1:]).all())
    assert deep[0] == 484 and deep[-1] == 12  # KVCache-Factory: 2a - a//beta ... a//beta
    assert (budgets[:, 1] == 248).all()  # fewer than 2a tokens seen: uniform (KVCache-Factory's fallback)
    policy = _bound(make_policy("pyramidkv", window_size=1, kernel_size=1), layers=4)
    scores = torch.randn(4, 1, 2, 300)
    scores[..., -1] = float("inf")  # the window token
    context = _context(torch.zeros(4, 1, 2, 300, 8), budget=40, current=torch.tensor([1000]))
    counts = policy.allocate(scores, context)
    assert counts.sum() == 4 * 2 * 40 and bool((counts[:-1, 0, 0] > counts[1:, 0, 0]).all())


def test_adakv_head_budgets_sum_to_the_layer_total_and_follow_concentration():
    scores = torch.full((1, 1, 2, 12), 0.05)
    scores[0, 0, 0, 0] = 0.9  # head 0: one key holds everything
    scores[0, 0, 0, 1:] = 0.001
    scores[..., 11] = float("inf")  # protected window token in both heads
    counts = adaptive_head_budgets(scores, budget=5, floor=0.2)
    assert counts.sum() == 2 * 5
    assert counts[0, 0, 1] > counts[0, 0, 0] >= 1 + int(0.2 * 4)  # the diffuse head gets the slots; floor holds
    policy = _bound(make_policy("adakv", window_size=1, kernel_size=1), heads=2, kv_heads=2)
    keys = torch.cat([_one_hot_keys(12), _one_hot_keys(12)], dim=2)
    queries = torch.stack([_query(3, d=12), _query(*range(6), d=12, scale=0.0)])[None, None, :, None, :]
    protected = torch.zeros(1, 1, 2, 12, dtype=torch.bool)
    protected[..., 11] = True
    context = _context(keys, budget=4, protected=protected, queries=queries, query_positions=torch.tensor([[11]]))
    kept = _kept(policy, context)
    assert len(kept[(0, 0, 0)]) + len(kept[(0, 0, 1)]) == 8 and len(kept[(0, 0, 1)]) > 4 and 3 in kept[(0, 0, 0)]


def test_knorm_keeps_the_lowest_norm_keys():
    keys = torch.zeros(1, 1, 1, 5, 4)
    keys[..., 0] = torch.tensor([5.0, 1.0, 3.0, 2.0, 4.0])
    assert _kept(make_policy("knorm"), _context(keys, budget=2))[(0, 0, 0)] == [1, 3]


def test_rkv_drops_the_oldest_of_identical_keys():
    keys = _one_hot_keys(10, d=16)
    copy = torch.zeros(16)
    copy[12] = 1.0
    for position in (2, 5, 8):
        keys[0, 0, 0, position] = copy
    protected = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    protected[..., 9] = True
    queries = torch.zeros(1, 1, 1, 1, 16)  # uniform attention: redundancy alone decides
    policy = _bound(make_policy("rkv", window_size=1))
    context = _context(keys, budget=9, protected=protected, queries=queries, query_positions=torch.tensor([[9]]))
    assert _kept(policy, context)[(0, 0, 0)] == [0, 1, 3, 4, 5, 6, 7, 8, 9]  # position 2, the oldest copy, goes
    # with λ = 1 R-KV is the pooled window attention alone (SnapKV's importance)
    attentive = torch.zeros(1, 1, 1, 1, 16)
    attentive[..., 1] = 30.0
    rkv = _bound(make_policy("rkv", window_size=1, mix_lambda=1.0, kernel_size=1))
    snap = _bound(make_policy("snapkv", window_size=1, kernel_size=1))
    context = _context(keys, budget=3, protected=protected, queries=attentive, query_positions=torch.tensor([[9]]))
    torch.testing.assert_close(rkv.importance(context), snap.importance(context))


def test_rkv_importance_only_is_snapkv_decode():
    """R-KV without its redundancy term (λ = 1) is SnapKV's decode-time port (w = 8, kernel 7, max pooling): over a
    generation with rounds both keep the same entries and emit the same tokens; R-KV with its redundancy term does
    not keep that set (so the comparison can tell rules apart)."""
    model = tiny_model("qwen2", seed=3)
    prompt = torch.randint(1, 96, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = {method: trikv.generate(model, _ByteTokenizer(), [prompt], method=method, budget=32, divide_length=8,
                                   max_new_tokens=60, min_new_tokens=60)
            for method in ("rkv-importance-only", "snapkv-decode", "rkv")}
    kept = {method: run.cache.visible_positions() for method, run in runs.items()}
    assert runs["snapkv-decode"].cache.rounds >= 5
    assert torch.equal(kept["rkv-importance-only"], kept["snapkv-decode"])
    assert runs["rkv-importance-only"].tokens == runs["snapkv-decode"].tokens
    assert not torch.equal(kept["rkv"], kept["snapkv-decode"])


def test_mean_similarity_exempts_the_newest_copy_of_each_row():
    keys = _one_hot_keys(10, d=16)  # orthogonal keys: similarity 0 ...
    copy = torch.zeros(16)
    copy[12] = 1.0
    for position in (2, 5, 8):  # ... except three copies
        keys[0, 0, 0, position] = copy
    positions = torch.arange(10).expand(1, 1, 1, 10).clone()
    # row 2 drops 8 (its newest copy) and counts 5; row 5 drops 8, counts 2; row 8 drops 5, counts 2
    expected = torch.zeros(10)
    expected[2], expected[5] = 2 / 10, 1 / 10
    torch.testing.assert_close(mean_similarity(keys, positions, 0.5)[0, 0, 0], expected)
    positions[..., 9] = -1  # a dead slot neither counts as a row nor as a column
    expected = expected * 10 / 9
    torch.testing.assert_close(mean_similarity(keys, positions, 0.5)[0, 0, 0], expected)
    # threshold 1.0: no key is a near-duplicate (> 1), nothing exempted: every copy sees the two others
    torch.testing.assert_close(mean_similarity(keys, positions, 1.0)[0, 0, 0, [2, 5, 8]], torch.full((3,), 2 / 9))


def test_lazyeviction_tracks_recurrence_and_prefers_recurring_tokens():
    policy = _bound(make_policy("lazyeviction", alpha=0.3, window=1))
    keys = _one_hot_keys(8)
    _observe(policy, keys, _query(3, 5, d=8)[None], 10)  # keys 3 and 5 hit at step 10
    _observe(policy, keys, _query(3, d=8)[None], 12)
    _observe(policy, keys, _query(3, d=8)[None], 14)
    last, interval = policy.state["last"][0, 0, 0], policy.state["interval"][0, 0, 0]
    assert last[3] == 14 and interval[3] == 10 - 2  # first gap from creation (last = position - 1)
    assert last[5] == 10 and interval[5] == 10 - 4
    assert last[1] == 0 and interval[1] == 0  # never hit: created at 1, last = 0
    context = _context(keys, budget=2, current=torch.tensor([15]))
    assert _kept(policy, context)[(0, 0, 0)] == [3, 5]
    value = recurrence_importance(torch.tensor(14.0), torch.tensor(14.0), torch.tensor(8.0))
    assert value == pytest.approx(2 / (1 + torch.e) + 2 / (1 + torch.e**7), rel=1e-5)


def test_raas_evicts_the_least_recently_used_with_ties_to_the_older():
    policy = _bound(make_policy("raas", alpha=0.3))
    keys = _one_hot_keys(8)
    _observe(policy, keys, _query(1, d=8)[None], 10)
    _observe(policy, keys, _query(2, 4, d=8)[None], 11)  # 2 and 4 refreshed at the same step
    context = _context(keys, budget=3)
    assert _kept(policy, context)[(0, 0, 0)] == [1, 2, 4]
    assert _kept(policy, _context(keys, budget=2))[(0, 0, 0)] == [2, 4]
    scores = policy.score(_context(keys, budget=1))[0, 0, 0]
    assert scores[4] > scores[2] > scores[1] > scores[7] > scores[6]  # tie at step 11 -> the newer wins


def test_rpc_scores_the_region_only_with_one_selection_per_layer():
    policy = _bound(make_policy("rpc", selector_window=2, kernel_size=1), heads=2, kv_heads=2)
    keys = torch.cat([_one_hot_keys(12), _one_hot_keys(12)], dim=2)
    protected = torch.zeros(1, 1, 2, 12, dtype=torch.bool)
    protected[..., :2] = True  # a protected prompt
    protected[..., 10:] = True  # the selector tokens
    selectors = torch.stack([_query(5, d=12), _query(5, 6, d=12)])  # the two selector queries (head 0 only)
    queries = torch.stack([selectors, selectors * 0])[None, None]  # [1, 1, Hq=2, w=2, D]
    context = _context(keys, budget=5, protected=protected, queries=queries, query_positions=torch.tensor([[10, 11]]))
    kept = _kept(policy, context)
    assert kept[(0, 0, 0)] == kept[(0, 0, 1)] == [0, 1, 5, 10, 11]
    scores = policy.importance(context)
    # the protected prompt does not take part in the softmax: attending to it changes nothing in the region
    to_prompt = torch.stack([_query(5, 0, d=12), _query(5, 6, 0, d=12)])
    context2 = _context(keys, budget=5, protected=protected, queries=torch.stack([to_prompt, selectors * 0])[None, None], query_positions=torch.tensor([[10, 11]]))
    torch.testing.assert_close(policy.importance(context2)[..., 2:10], scores[..., 2:10])


def test_vatp_weights_attention_by_value_norm_and_keeps_sinks():
    policy = _bound(make_policy("vatp", recent_tokens=0, sink_tokens=1))
    policy.configure(2, 128)
    keys = _one_hot_keys(6)
    _observe(policy, keys, _query(2, 4, d=6)[None], 6)  # keys 2 and 4 get the same attention
    values = torch.ones(1, 1, 1, 6, 6)
    values[0, 0, 0, 4] *= 3.0  # but 4 carries the larger value
    context = _context(keys, budget=2, values=values)
    assert _kept(policy, context)[(0, 0, 0)] == [0, 4]  # sink 0 (no attention at all) + the larger value
    h2o = _bound(make_policy("h2o", recent_tokens=0))
    _observe(h2o, keys, _query(2, 4, d=6)[None], 6)
    torch.testing.assert_close(policy.importance(context)[..., 1:], h2o.importance(context)[..., 1:] * 6.0 * torch.tensor([1.0, 1, 1, 3, 1]))


def test_grouped_logits_match_repeat_kv():
    queries = torch.randn(2, 1, 6, 3, 8)
    keys = torch.randn(2, 1, 2, 10, 8)
    logits = grouped_logits(queries, keys, 0.5)  # [L, b, Hkv, G, w, N]
    repeated = keys.repeat_interleave(3, dim=2)
    expected = (queries @ repeated.transpose(-1, -2)) * 0.5  # [L, b, Hq, w, N]
    torch.testing.assert_close(logits.reshape(2, 1, 6, 3, 10), expected)


def test_ties_go_to_the_newer_token_whatever_the_slot_layout():
    """Pooled attention has plateaus; the selection must not depend on where dead slots sit."""
    policy = _bound(make_policy("snapkv", window_size=1, kernel_size=1))
    keys = torch.zeros(1, 1, 1, 10, 8)  # every key identical: uniform attention, all scores tie
    protected = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    protected[..., 9] = True
    queries = torch.ones(1, 1, 1, 1, 8)
    context = _context(keys, budget=4, protected=protected, queries=queries, query_positions=torch.tensor([[9]]))
    assert _kept(policy, context)[(0, 0, 0)] == [6, 7, 8, 9]
    # the same tokens with dead slots in between (position -1) keep the same selection
    positions = torch.tensor([[[[0, -1, 1, 2, -1, 3, 4, 5, 6, -1, 7, 8, 9]]]])
    keys = torch.zeros(1, 1, 1, 13, 8)
    protected = positions == 9
    context = _context(keys, budget=4, positions=positions, protected=protected, queries=queries, query_positions=torch.tensor([[9]]))
    assert _kept(policy, context)[(0, 0, 0)] == [6, 7, 8, 9]


# ---------------------------------------------------------------------------------------------------
# the packed layout (PyramidKV / Ada-KV store per-(layer, head) lengths without dead slots)


def _kept_sets(cache):
    positions = cache.visible_positions()  # [L, b, Hkv, N]
    return [[sorted(p for p in head.tolist() if p >= 0) for head in row] for layer in positions for row in layer]


@pytest.mark.parametrize("method", ["adakv", "pyramidkv"])
def test_packed_layout_equals_uniform_layout_and_saves_memory(method):
    """Same selections, tokens and logits as the uniform layout (which keeps dead slots), less memory."""
    model = tiny_model("qwen2", attn="sdpa", seed=3)
    # a prompt longer than budget + slack (compressed in the prompt's first round) next to a short one
    prompts = [torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (100, 7)]
    options = dict(method=method, budget=24, divide_length=6, max_new_tokens=50, min_new_tokens=50, return_logits=True)
    uniform = trikv.generate(model, _ByteTokenizer(), prompts, layout="uniform", **options)
    packed = trikv.generate(model, _ByteTokenizer(), prompts, **options)
    assert packed.cache.layout == "packed" and type(packed.cache.store).__name__ == "PackedStore"
    assert uniform.cache.layout == "uniform"
    assert packed.cache.rounds == uniform.cache.rounds >= 4
    assert _kept_sets(packed.cache) == _kept_sets(uniform.cache)
    assert packed.tokens == uniform.tokens
    torch.testing.assert_close(torch.stack(packed.logits), torch.stack(uniform.logits), rtol=0, atol=1e-5)
    assert packed.cache.memory_bytes() < uniform.cache.memory_bytes()
    assert packed.peak_cache_bytes <= uniform.peak_cache_bytes  # the long prompt sets both peaks
    # the regions hold at most the uniform allocation of a cache that keeps `budget` everywhere, plus per slot
    # its head tag (1 byte) and its decode mask entries (Hkv x 4 bytes), against 2 x head_dim x 4 bytes of K/V
    snap = trikv.generate(model, _ByteTokenizer(), prompts, **{**options, "method": "snapkv-decode"})
    Hkv, D = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    assert packed.cache.allocated_bytes() <= snap.cache.allocated_bytes() * (1 + (1 + 4 * Hkv) / (2 * D * 4))


@pytest.mark.parametrize("method", ["triattention", "triattention-shared-layers"])
def test_triattention_on_the_packed_layout_scores_each_layer_with_its_own_statistics(method):
    """Both stores give the policy every layer at once: the packed layout keeps exactly the uniform layout's
    sets, with each layer's own statistics (it once used layer 0's for every layer), and a selection shared
    across layers works on both."""
    from stats_fixtures import tiny_stats

    model = tiny_model("qwen2", attn="sdpa", seed=3, num_hidden_layers=4)
    stats = tiny_stats(model)
    prompts = [torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (60, 9)]
    options = dict(method=method, stats=stats, budget=24, divide_length=6, max_new_tokens=40, min_new_tokens=40)
    uniform = trikv.generate(model, _ByteTokenizer(), prompts, layout="uniform", **options)
    packed = trikv.generate(model, _ByteTokenizer(), prompts, layout="packed", **options)
    assert packed.cache.layout == "packed" and packed.cache.rounds == uniform.cache.rounds >= 4
    kept = _kept_sets(packed.cache)
    assert kept == _kept_sets(uniform.cache)
    assert packed.tokens == uniform.tokens
    layers_agree = all(kept[row::2] == kept[row::2][:1] * len(kept[row::2]) for row in range(2))  # 2 rows per layer
    assert layers_agree == (method == "triattention-shared-layers")  # shared: every layer keeps the same tokens


@pytest.mark.parametrize("method", ["adakv", "pyramidkv"])
def test_packed_layout_on_the_lean_engine_and_with_eager_attention(method):
    model = tiny_model("qwen3", attn="eager", seed=4)
    prompt = [torch.randint(1, 96, (20,), generator=torch.Generator().manual_seed(1)).tolist()]
    options = dict(method=method, budget=24, divide_length=8, max_new_tokens=40, min_new_tokens=40, return_logits=True)
    hf = trikv.generate(model, _ByteTokenizer(), prompt, **options)
    lean = trikv.generate(model, _ByteTokenizer(), prompt, engine="lean", **options)
    uniform = trikv.generate(model, _ByteTokenizer(), prompt, layout="uniform", **options)
    assert hf.cache.layout == lean.cache.layout == "packed" and hf.cache.rounds >= 3
    assert hf.tokens == lean.tokens == uniform.tokens
    torch.testing.assert_close(torch.stack(lean.logits), torch.stack(hf.logits), rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.stack(hf.logits), torch.stack(uniform.logits), rtol=0, atol=1e-5)


def test_packed_layout_bad_input():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="layout must be 'uniform' or 'packed'"):
        trikv.make_cache(model, "adakv", budget=32, layout="diagonal")
    with pytest.raises(ValueError, match="per-slot state"):
        trikv.make_cache(model, "h2o", budget=32, layout="packed")
    with pytest.raises(ValueError, match="give a budget"):
        trikv.make_cache(model, "full", budget=None, layout="packed")
    assert trikv.make_cache(model, "snapkv-decode", budget=32, layout="packed").layout == "packed"
    assert trikv.make_cache(model, "adakv", budget=32).layout == "packed"


def test_packed_layout_follows_beam_search_reordering():
    model = tiny_model("llama", attn="sdpa", seed=3)
    ids = torch.randint(1, 96, (1, 30), generator=torch.Generator().manual_seed(1))
    outputs = {}
    for layout in ("uniform", "packed"):
        cache = trikv.make_cache(model, "adakv", budget=24, divide_length=6, layout=layout, protect_prompt=False)
        outputs[layout] = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), max_new_tokens=30,
                                         num_beams=2, do_sample=False, pad_token_id=0)
        assert cache.rounds >= 4 and cache.layout == layout
    assert torch.equal(outputs["packed"], outputs["uniform"])



def _snapkv_reference(keys, positions, queries, query_positions, t, scaling, budget, rule):
    """SnapKV's kept positions for one (layer, row) written from the published code, one head and query at a time.

    keys [Hkv, N, D] with positions [Hkv, N] (-1 = dead), window queries [Hq, w, D] at query_positions [w].
    rule "official" (FasterDecoding/SnapKV, kvpress): softmax over every visible key, causal in the window,
    window columns dropped, summed over the window queries, averaged over the query heads of a KV head,
    average pooling with zero padding. rule "decode" (R-KV / TriAttention's port): the max over the group of
    the logits, softmax over the non-window keys only, max pooling. Top (B - w) + the window, newest first on ties.
    """
    Hkv, Hq, w = keys.shape[0], queries.shape[0], queries.shape[1]
    G = Hq // Hkv
    kernel, pool = (5, torch.nn.functional.avg_pool1d) if rule == "official" else (7, torch.nn.functional.max_pool1d)
    kept = {}
    for g in range(Hkv):
        live = [(int(p), n) for n, p in enumerate(positions[g].tolist()) if p >= 0]
        live.sort()
        pos = torch.tensor([p for p, _ in live])
        k = keys[g, [n for _, n in live]].double()  # [N', D] in position order
        outside = pos < t - w  # the candidates (the window is kept anyway)
        head_scores = []
        for h in range(g * G, (g + 1) * G):
            per_query = []
            for i in range(w):
                qp = int(query_positions[i])
                if qp < 0:
                    continue
                logits = (queries[h, i].double() @ k.T) * scaling
                visible = (pos <= qp) if rule == "official" else outside
                probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
                per_query.append(probs)
            head_scores.append(torch.stack(per_query))  # [w', N']
        if rule == "official":
            score = torch.stack([hs.sum(0) for hs in head_scores]).mean(0)
        else:  # one softmax of the group's max logit per query
            per_query = []
            for i in range(w):
                qp = int(query_positions[i])
                if qp < 0:
                    continue
                logits = torch.stack([(queries[h, i].double() @ k.T) * scaling for h in range(g * G, (g + 1) * G)]).amax(0)
                per_query.append(torch.softmax(logits.masked_fill(~outside, float("-inf")), -1))
            score = torch.stack(per_query).sum(0)
        score = score[outside]  # window columns dropped before pooling
        pooled = pool(score[None, None].float(), kernel, stride=1, padding=kernel // 2)[0, 0]
        candidates = pos[outside]
        ranked = sorted(range(len(candidates)), key=lambda j: (float(pooled[j]), int(candidates[j])), reverse=True)
        chosen = {int(candidates[j]) for j in ranked[: budget - w]}
        kept[g] = sorted(chosen | set(pos[~outside].tolist()))
    return kept


@pytest.mark.parametrize("method,rule,budget", [("snapkv", "official", 64), ("snapkv-decode", "decode", 40)])
def test_snapkv_keeps_what_a_slow_reference_of_its_published_rule_keeps(method, rule, budget):
    """Every round's kept set per (layer, KV head), recomputed from the cache's keys and window queries by a
    direct implementation of the published code (not from the cache's bookkeeping)."""
    model = tiny_model("qwen2", attn="sdpa", seed=5)
    cache = trikv.make_cache(model, method, budget=budget, divide_length=16, protect_prompt=False)
    checked = []
    original = cache.compress

    def compress():
        n = cache.length
        keys, positions = cache.store.keys[:, 0, :, :n].clone(), cache.store.positions[:, 0, :, :n].clone()
        window = cache.query_window
        queries, query_positions = window.queries[:, 0].clone(), window.positions[0].clone()
        t = int(cache.current_positions()[0])
        rounds = cache.rounds
        original()
        if cache.rounds == rounds:
            return
        after = cache.visible_positions()[:, 0]
        for layer in range(keys.shape[0]):
            expected = _snapkv_reference(keys[layer], positions[layer], queries[layer], query_positions, t,
                                         cache.policy.scaling, budget, rule)
            for g, kept in expected.items():
                assert sorted(p for p in after[layer, g].tolist() if p >= 0) == kept, (t, layer, g)
        checked.append(t)

    cache.compress = compress
    prompt = torch.randint(1, 96, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    trikv.generate(model, _ByteTokenizer(), [prompt], cache=cache, max_new_tokens=110, min_new_tokens=110)
    assert len(checked) >= 4
