"""Attention matching, TAM, PAM, selector-window eviction and the TriAttention + AM hybrid (issue 5).

Covers: the biased attention path (eager and SDPA, against explicit references), the cache's bias
plumbing (zero bias = plain eviction, nonzero bias = a replay that adds the same bias per logical key),
exactness when nothing is evicted, the mass identity after a real compaction round, the solvers (bounds,
optimality, bad numerical cases), segmentation and allocation on hand-worked examples, pivots, and the
hybrid's selection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache
from transformers.modeling_utils import AttentionInterface

import trikv
from trikv.attention import trikv_eager, trikv_sdpa
from trikv.cache import CompressedCache, decoder
from trikv.compaction.matching import MatchConfig, match_heads
from trikv.compaction.queries import StatsQuerySampler
from trikv.compaction.segments import (
    BoundaryTokens,
    allocate,
    boundary_flags,
    merge_short,
    ranks_within_groups,
    segment_ids,
)
from trikv.compaction.selection import attention_key_scores, highest_attention_keys, omp_keys
from trikv.compaction.solvers import box_lsq, ridge_lambda, ridge_solve
from trikv.geometry import RopeGeometry
from trikv.policies import REGISTRY, make_policy
from trikv.policies.base import Compaction, CompactionContext, Policy, ScoringContext
from trikv.policies.tam import TAM

from helpers import masked_reference_logits, tiny_model
from stats_fixtures import tiny_stats
from trikv.compat import cache_kwargs

SMALL_TAM = dict(interval=16, selector_window=8, protected_tail=4)


pytestmark = pytest.mark.usefixtures("one_thread")


_MODELS: dict = {}


def _model(attn: str = "sdpa"):
    """One tiny llama per attention implementation for this module (its calibration is then reused)."""
    if attn not in _MODELS:
        _MODELS[attn] = tiny_model("llama", attn=attn)
    return _MODELS[attn]


def _generate(model, input_ids, cache, attention_mask=None, new_tokens=40):
    return model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids) if attention_mask is None else attention_mask,
        **cache_kwargs(model, cache),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
    )


# ---------------------------------------------------------------------------------------------------
# the biased attention functions


from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402,F401 (trikv_eager looks it up here)


class _Module(torch.nn.Module):
    """Stand-in for an attention module (what the stock functions read from it)."""

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False


def _reference_attention(query, key, value, bias, valid, scaling):
    """softmax(q kᵀ s + bias, causal on the last q slots, valid slots (+ own slot)) v in float64."""
    b, Hq, q, D = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    G = Hq // Hkv
    k = key.double().repeat_interleave(G, 1)
    v = value.double().repeat_interleave(G, 1)
    logits = query.double() @ k.transpose(-1, -2) * scaling + bias.double().repeat_interleave(G, 1)[:, :, None, :]
    slot = torch.arange(K)
    causal = slot[None, :] <= (K - q + torch.arange(q))[:, None]
    allowed = causal[None, None] & valid.repeat_interleave(G, 1)[:, :, None, :]
    allowed |= slot[None, :] == (K - q + torch.arange(q))[:, None]
    logits = logits.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(logits, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("function", [trikv_sdpa, trikv_eager])
@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("with_dead_slots", [False, True])
def test_biased_attention_equals_reference(function, q, with_dead_slots):
    torch.manual_seed(0)
    b, Hq, Hkv, K, D = 2, 4, 2, 12, 8
    query, key, value = torch.randn(b, Hq, q, D), torch.randn(b, Hkv, K, D), torch.randn(b, Hkv, K, D)
    bias = torch.randn(b, Hkv, K) * 2
    valid = torch.ones(b, Hkv, K, dtype=torch.bool)
    if with_dead_slots:
        valid[0, 1, :3] = False
        valid[1, 0, 5] = False
    module = _Module(Hq // Hkv)
    scaling = D**-0.5
    out, _ = function(module, query, key, value, None, scaling=scaling, dropout=0.0, trikv_active=True,
                      trikv_valid=valid if with_dead_slots else None, trikv_bias=bias)
    reference = _reference_attention(query, key, value, bias, valid, scaling)
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-5)
    # the bias is really applied
    unbiased = _reference_attention(query, key, value, torch.zeros_like(bias), valid, scaling)
    assert (unbiased - reference).abs().max() > 1e-2
    # and a zero bias gives the unbiased path
    plain, _ = function(module, query, key, value, None, scaling=scaling, dropout=0.0, trikv_active=True,
                        trikv_valid=valid if with_dead_slots else None, trikv_bias=None)
    zero, _ = function(module, query, key, value, None, scaling=scaling, dropout=0.0, trikv_active=True,
                       trikv_valid=valid if with_dead_slots else None, trikv_bias=torch.zeros_like(bias))
    torch.testing.assert_close(zero, plain, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# the cache's bias plumbing, through whole models


@dataclass
class _SinBias(Policy):
    """Test policy: a deterministic per-head selection; kept entries get beta = 0.5 sin(0.37 pos + head + layer)."""

    name = "test-sin-bias"
    compacts = True
    zero: bool = False  # return beta = 0 and the original values instead

    def score(self, context: ScoringContext) -> torch.Tensor:
        L, b, H, N = context.positions.shape
        layer = torch.arange(L)[:, None, None, None]
        head = torch.arange(H)[None, None, :, None]
        return torch.sin(context.positions.float() * 1.3 + layer + 2 * head)

    def compact(self, context):
        sc = context.scoring
        L, b, H, N = sc.positions.shape
        layer = torch.arange(L)[:, None, None, None]
        head = torch.arange(H)[None, None, :, None]
        beta = 0.5 * torch.sin(0.37 * sc.positions.float() + head + layer)
        if self.zero:
            return Compaction(values=sc.values.clone(), biases=torch.zeros_like(beta))
        return Compaction(biases=torch.where(context.keep, beta, sc.biases))


class _BiasLog:
    def __init__(self, model):
        self.visible, self.biases = [], []
        self.handle = decoder(model).register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, CompressedCache):
            self.visible.append(cache.visible_positions().clone())
            self.biases.append(cache.store.biases[:, :, :, : cache.length].clone())

    def close(self):
        self.handle.remove()


_BIAS_STATE: dict = {}


def _biased_masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    allowed, bias = _BIAS_STATE["allowed"][module.layer_idx], _BIAS_STATE["bias"][module.layer_idx]
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    logits = (query @ key.transpose(-1, -2)) * scaling + bias.repeat_interleave(group, dim=1)
    logits = logits.masked_fill(~allowed.repeat_interleave(group, dim=1), torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits.float(), dim=-1).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register("trikv_test_biased", _biased_masked_attention)


@torch.no_grad()
def _biased_reference_logits(model, input_ids, attention_mask, generated, visible, biases):
    """Full attention over a DynamicCache, only the logged entries allowed, each with its logged bias."""
    b, prompt_len = input_ids.shape
    pads = (attention_mask == 0).long().sum(-1)
    cache = DynamicCache(config=model.config)
    outputs, seen, mask2d = [], 0, attention_mask.clone()
    previous = model.config._attn_implementation
    model.set_attn_implementation("trikv_test_biased")
    try:
        for step, (positions, bias) in enumerate(zip(visible, biases)):
            tokens = input_ids if step == 0 else generated[:, step - 1 : step]
            if step:
                mask2d = torch.cat([mask2d, mask2d.new_ones(b, 1)], dim=-1)
            q = tokens.shape[1]
            total = seen + q
            logical = torch.where(positions >= 0, positions + pads[None, :, None, None], torch.full_like(positions, -1))
            L, _, Hkv, _ = positions.shape
            # dead slots scatter into a spare column (a shared index 0 would race with a real entry there)
            index = torch.where(logical >= 0, logical, torch.full_like(logical, total))
            allowed = torch.zeros(L, b, Hkv, total + 1, dtype=torch.bool).scatter_(3, index, logical >= 0)[..., :total]
            per_key = torch.zeros(L, b, Hkv, total + 1).scatter_(3, index, bias)[..., :total]
            causal = torch.arange(total)[None, :] <= torch.arange(seen, total)[:, None]
            _BIAS_STATE["allowed"] = allowed[:, :, :, None, :] & causal[None, None, None]
            _BIAS_STATE["bias"] = per_key[:, :, :, None, :]
            position_ids = (mask2d.cumsum(-1) - 1).masked_fill(mask2d == 0, 0)[:, seen:total]
            out = model(input_ids=tokens, position_ids=position_ids, **cache_kwargs(model, cache), use_cache=True)
            outputs.append(out.logits[:, -1].float())
            seen = total
    finally:
        model.set_attn_implementation(previous)
    return torch.stack(outputs)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_biased_cache_equals_replay_with_per_key_bias(attn):
    model = _model(attn)
    torch.manual_seed(3)
    input_ids = torch.randint(1, 96, (2, 20))
    input_ids[1, :6] = 0
    attention_mask = (input_ids != 0).long()
    log = _BiasLog(model)
    try:
        cache = CompressedCache(model, _SinBias(), budget=24, divide_length=8)
        out = _generate(model, input_ids, cache, attention_mask, new_tokens=36)
    finally:
        log.close()
    assert cache.rounds >= 3 and cache.store.has_bias
    generated = out.sequences[:, 20:]
    ours = torch.stack(out.logits)
    reference = _biased_reference_logits(model, input_ids, attention_mask, generated, log.visible, log.biases)
    torch.testing.assert_close(ours, reference, rtol=0, atol=2e-4)
    unbiased = masked_reference_logits(model, input_ids, attention_mask, generated, log.visible)
    assert (unbiased - ours).abs().max() > 1e-3, "the biases must change the outputs"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_zero_bias_and_original_values_equal_plain_eviction(attn):
    model = _model(attn)
    torch.manual_seed(4)
    input_ids = torch.randint(1, 96, (1, 24))
    selection_only = _SinBias(zero=True)
    selection_only.compacts = False  # the same selection without any compaction: plain eviction, no biases
    evict = CompressedCache(model, selection_only, budget=24, divide_length=8)
    plain = _generate(model, input_ids, evict)
    assert evict.store.biases is None and evict.rounds >= 3
    zero = CompressedCache(model, _SinBias(zero=True), budget=24, divide_length=8)
    compacted = _generate(model, input_ids, zero)
    assert zero.store.biases is not None and zero.rounds == evict.rounds
    assert torch.equal(torch.stack(plain.logits), torch.stack(compacted.logits))
    # the attention path with an explicit all-zero bias tensor (forced) agrees too
    forced = CompressedCache(model, _SinBias(zero=True), budget=24, divide_length=8)
    original = forced.compress

    def compress_and_publish():
        original()
        forced.store.has_bias = True

    forced.compress = compress_and_publish
    published = _generate(model, input_ids, forced)
    torch.testing.assert_close(torch.stack(published.logits), torch.stack(plain.logits), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# exactness and real compaction rounds


@pytest.mark.parametrize("method", ["tam", "pam", "selector-window", "tri-am"])
def test_budget_above_length_reproduces_outputs_exactly(method):
    model = _model()
    torch.manual_seed(5)
    input_ids = torch.randint(1, 96, (1, 30))
    reference = _generate(model, input_ids, DynamicCache(config=model.config))
    options = {"stats": tiny_stats(model)} if REGISTRY[method].needs_stats else dict(SMALL_TAM, boundary_ids=(3,))
    cache = trikv.make_cache(model, method, budget=200, **options)
    ours = _generate(model, input_ids, cache)
    assert torch.equal(reference.sequences, ours.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(reference.logits), rtol=0, atol=1e-5)
    assert cache.rounds == 0 and not cache.store.has_bias


def test_a_round_that_evicts_nothing_returns_the_entries_unchanged():
    torch.manual_seed(6)
    H, n, N, D = 3, 10, 15, 8
    q, k, v = torch.randn(H, n, D), torch.randn(H, N, D), torch.randn(H, N, D)
    b = torch.randn(H, N) * 0.3
    region = torch.ones(H, N, dtype=torch.bool)
    nb, nv, _ = match_heads(q, torch.ones(H, n, dtype=torch.bool), k, v, b, region, region, torch.zeros_like(region), 0.35, MatchConfig())
    assert torch.equal(nb, b) and torch.equal(nv, v)


def test_the_fit_with_every_key_kept_reproduces_the_attention():
    """The fit itself (not the early return of a round that evicts nothing): asked to fit biases and values
    with every key of the region kept, it gives back the attention outputs of the original entries."""
    from trikv.compaction.matching import _match_block

    torch.manual_seed(7)
    H, n, N, D = 2, 24, 12, 8
    q, k, v = torch.randn(H, n, D), torch.randn(H, N, D), torch.randn(H, N, D)
    b = torch.randn(H, N) * 0.3
    everything = torch.ones(H, N, dtype=torch.bool)
    scaling = 0.35
    fitted_b, fitted_v, diagnostics = _match_block(q, torch.ones(H, n, dtype=torch.bool), k, v, b, everything, everything,
                                                   torch.zeros_like(everything), everything, scaling, MatchConfig())

    def outputs(biases, values):
        weights = torch.softmax(q @ k.transpose(1, 2) * scaling + biases[:, None, :], -1)
        return weights @ values

    torch.testing.assert_close(outputs(fitted_b, fitted_v), outputs(b, v), rtol=0, atol=2e-3)
    assert bool((diagnostics["mass_error"] < 1e-3).all())


class _Recorder:
    """Wraps a policy's compact() to keep what the round saw."""

    def __init__(self, policy):
        self.rounds = []
        inner = policy.compact

        def compact(context):
            # the context holds views of the cache's buffers, which the round then overwrites: copy them
            sc = context.scoring
            copied = CompactionContext(
                scoring=ScoringContext(**{name: getattr(sc, name).clone() if isinstance(getattr(sc, name), torch.Tensor) else getattr(sc, name)
                                          for name in sc.__dataclass_fields__}),
                keep=context.keep.clone(),
            )
            round_state = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in policy._round.items()}
            result = inner(context)
            self.rounds.append((copied, round_state, result))
            return result

        policy.compact = compact


def _mass(queries, keys, biases, scaling):
    return torch.exp(queries.double() @ keys.double().transpose(-1, -2) * scaling + biases.double()[..., None, :]).sum(-1)


def test_mass_identity_after_a_tam_round():
    model = _model()
    torch.manual_seed(7)
    input_ids = torch.randint(1, 96, (1, 24))
    policy = make_policy("tam", boundary_ids=(3, 5, 11), min_segment=4, beta_min=-8.0, beta_max=8.0,
                         beta_ridge=1e-9, value_ridge=1e-9, nnls_iters=200, **SMALL_TAM)
    cache = CompressedCache(model, policy, budget=40, protect_prompt=False)
    recorder = _Recorder(policy)
    # exactly one round (at 56 entries: 36 kept of 52 compactable, 16 probes), then one more token
    _generate(model, input_ids, cache, new_tokens=34)
    assert cache.rounds == 1 and cache.store.has_bias
    context, state, result = recorder.rounds[0]
    sc = context.scoring
    scaling = policy.scaling
    queries, qmask = state["queries"], state["query_mask"]  # [L, b, Hkv, n, D], [1, b, 1, n]
    assert bool(qmask.all()) and queries.shape[3] == 8 * 2
    region = sc.candidates & (sc.positions >= 0)
    L, b, Hkv = region.shape[:3]
    worst, worst_evict = 0.0, 0.0
    for l in range(L):
        for h in range(Hkv):
            reg = region[l, 0, h]
            before = _mass(queries[l, 0, h], sc.keys[l, 0, h][reg], sc.biases[l, 0, h][reg], scaling)
            # after: the cache's own entries whose positions came from the region
            live = cache.store.positions[l, 0, h, : cache.length]
            from_region = torch.isin(live, sc.positions[l, 0, h][reg])
            after = _mass(queries[l, 0, h], cache.store.keys[l, 0, h, : cache.length][from_region],
                          cache.store.biases[l, 0, h, : cache.length][from_region], scaling)
            evicted = _mass(queries[l, 0, h], cache.store.keys[l, 0, h, : cache.length][from_region],
                            torch.zeros(int(from_region.sum())), scaling)
            assert int(from_region.sum()) == int((context.keep & region)[l, 0, h].sum()) < int(reg.sum())
            worst = max(worst, float(((after - before) / before).abs().max()))
            worst_evict = max(worst_evict, float(((evicted - before) / before).abs().max()))
    assert worst < 1e-3, worst
    assert worst_evict > 0.05, "eviction alone must miss mass, or the test proves nothing"
    assert policy.last_round["output_error"] < policy.last_round["output_error_direct"]
    assert cache.length == 40 + 1  # the budget after the round, plus the token decoded since


def test_tam_round_keeps_budget_pivots_and_fits_values():
    model = _model()
    torch.manual_seed(8)
    input_ids = torch.randint(1, 96, (1, 24))
    # c = 1.5: the tiny random model's attention is too flat for c = 3 to find pivots
    policy = make_policy("tam", boundary_ids=(3, 5, 11), min_segment=4, pivot_multiplier=1.5, **SMALL_TAM)
    recorder = _Recorder(policy)
    cache = CompressedCache(model, policy, budget=28, protect_prompt=False)
    _generate(model, input_ids, cache, new_tokens=39)
    assert cache.rounds == 2
    assert all(bool(state["pivots"].any()) for _, state, _ in recorder.rounds)
    for context, state, result in recorder.rounds:
        live_kept = (context.keep).sum(-1)
        assert int(live_kept.max()) == int(live_kept.min()) == 28  # fixed budget per (layer, row, KV head)
        assert bool((context.keep | ~state["pivots"]).all()), "pivots are never dropped"
        region = context.scoring.candidates
        fitted = context.keep & region & ~state["pivots"]
        # pivots keep value and bias; fitted entries got new values
        pivots = state["pivots"] & context.keep
        assert torch.equal(result.values[pivots], context.scoring.values[pivots])
        assert torch.equal(result.biases[pivots], context.scoring.biases[pivots])
        assert not torch.equal(result.values[fitted], context.scoring.values[fitted])
        assert torch.isfinite(result.biases).all() and torch.isfinite(result.values).all()
        assert float(result.biases[fitted].min()) >= -3.0 - 1e-5 and float(result.biases[fitted].max()) <= 3.0 + 1e-5
    assert cache.memory_bytes() == 2 * 3 * 1 * 2 * cache.length * 16 * 4 + 3 * 1 * 2 * cache.length * 4


def test_hybrid_keeps_triattentions_selection_and_fits():
    model = _model()
    stats = tiny_stats(model)
    torch.manual_seed(9)
    input_ids = torch.randint(1, 96, (1, 24))
    kept = {}
    for method in ("triattention", "tri-am"):
        cache = trikv.make_cache(model, method, budget=28, divide_length=8, stats=stats, protect_prompt=False)
        _generate(model, input_ids, cache, new_tokens=14)  # one round at 36 entries, then one more token
        assert cache.rounds == 1
        kept[method] = cache.visible_positions().clone()
        if method == "tri-am":
            assert cache.store.has_bias
            diag = cache.policy.last_round
            assert diag["probes"] == 2 * 17 * 4
            assert diag["mass_error"] < diag["mass_error_evict"]
            assert diag["output_error"] < diag["output_error_direct"]
    assert torch.equal(kept["triattention"], kept["tri-am"])


def test_stats_sampler_mean_matches_calibration():
    model = _model()
    stats = tiny_stats(model)
    geometry = RopeGeometry.from_model(model)
    sampler = StatsQuerySampler(stats.q_mean, stats.q_abs_mean, geometry, 2, torch.tensor([0.0]), samples=4000, seed=1)
    drawn = sampler.pre_rope  # [L, Hq, S, F]
    torch.testing.assert_close(drawn.mean(2), stats.q_mean.to(drawn.dtype), atol=0.07 * float(stats.q_abs_mean.max()), rtol=0)
    torch.testing.assert_close(drawn.abs().mean(2), stats.q_abs_mean.double(), atol=1e-9, rtol=1e-9)
    # rotated queries: position 0 is the pre-RoPE draw itself (times the attention scaling)
    post = sampler.queries(torch.tensor([0]))  # [L, 1, Hkv, G*1*S, D]
    first = geometry.to_complex(post[0, 0, 0, :1].double())[0]
    torch.testing.assert_close(first, drawn[0, 0, 0] * geometry.attention_scaling, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------
# solvers


@pytest.mark.parametrize("shape", [(30, 10), (10, 40), (40, 120)])
@pytest.mark.parametrize("ridge", [1e-3, 1e-9])
def test_box_lsq_respects_bounds_and_is_optimal(shape, ridge):
    """Bounds hold and the KKT conditions of the (ridge) box-constrained problem are met: a certificate of optimality."""
    torch.manual_seed(10)
    n, t = shape
    A = torch.rand(4, n, t) ** 3
    truth = torch.rand(4, t) * 4 - 1.5  # outside the box in places
    b = (A @ truth[..., None])[..., 0]
    lo, hi = 0.1, 2.0
    prior = torch.ones(4, t)
    w = box_lsq(A, b, lo, hi, prior=prior, ridge=ridge, iters=200).double()
    assert float(w.min()) >= lo - 1e-6 and float(w.max()) <= hi + 1e-6
    lam = ridge_lambda(A, ridge)[:, None]
    grad = (A.double().transpose(1, 2) @ (A.double() @ w[..., None] - b.double()[..., None]))[..., 0] + lam * (w - prior.double())
    at_lo, at_hi = w <= lo + 1e-6, w >= hi - 1e-6
    free = ~(at_lo | at_hi)
    scale = float((A.double().transpose(1, 2).abs() @ b.double().abs()[..., None]).max())
    assert float(grad[free].abs().max() if free.any() else 0.0) < 1e-6 * scale
    assert float(grad[at_lo].min() if at_lo.any() else 0.0) > -1e-6 * scale
    assert float(grad[at_hi].max() if at_hi.any() else 0.0) < 1e-6 * scale
    assert bool(at_lo.any() and at_hi.any()), "both bounds must bind somewhere, or the test proves little"
    # the box matters: the unconstrained ridge solution leaves it
    unconstrained = ridge_solve(A, b[..., None], prior[..., None], ridge)[..., 0]
    assert float(unconstrained.min()) < lo or float(unconstrained.max()) > hi


def test_nnls_default_bounds_are_nonnegative():
    torch.manual_seed(11)
    A = torch.rand(2, 20, 6)
    b = -torch.rand(2, 20)  # best unconstrained solution is negative
    w = box_lsq(A, b, 0.0, float("inf"), prior=torch.zeros(2, 6), ridge=1e-8)
    assert float(w.min()) >= 0.0 and bool(torch.isfinite(w).all())


def test_ridge_solve_primal_and_dual_agree():
    torch.manual_seed(12)
    for n, t in [(6, 20), (20, 6)]:
        A, b, x0 = torch.rand(3, n, t), torch.randn(3, n, 2), torch.randn(3, t, 2)  # nonnegative, as attention weights
        x = ridge_solve(A, b, x0, 0.1).double()
        lam = ridge_lambda(A, 0.1)
        torch.testing.assert_close(lam, 0.1 * torch.linalg.matrix_norm(A.double(), ord=2) ** 2, rtol=1e-4, atol=0)
        direct = x0.double() + torch.linalg.solve(A.double().transpose(1, 2) @ A.double() + lam[:, None, None] * torch.eye(t),
                                                  A.double().transpose(1, 2) @ (b.double() - A.double() @ x0.double()))
        torch.testing.assert_close(x, direct, atol=2e-3, rtol=2e-3)


def test_bad_numerical_cases_stay_finite():
    torch.manual_seed(13)
    H, n, N, D = 4, 6, 12, 8
    q = torch.randn(H, n, D)
    k = torch.randn(H, N, D)
    k[0] = k[0, :1].expand(N, D)  # rank one: every key the same
    q[1] = 0.0  # all-zero queries: uniform attention
    k[2] = 0.0  # all-zero keys
    k[3] = k[3] * 300  # huge logits
    v = torch.randn(H, N, D)
    region = torch.ones(H, N, dtype=torch.bool)
    kept = torch.zeros(H, N, dtype=torch.bool)
    kept[:, ::3] = True
    for ridge in (0.0, 1e-3):
        config = MatchConfig(beta_ridge=ridge, value_ridge=ridge)
        nb, nv, diag = match_heads(q, torch.ones(H, n, dtype=torch.bool), k, v, torch.zeros(H, N), region, kept,
                                   torch.zeros_like(kept), 0.35, config)
        assert bool(torch.isfinite(nb).all()) and bool(torch.isfinite(nv).all())
        assert float(nb[kept].min()) >= -3 - 1e-5 and float(nb[kept].max()) <= 3 + 1e-5
    # identical keys / zero queries: every kept key stands for 3 tokens, mass is matched exactly
    assert torch.allclose(nb[1][kept[1]], torch.full((4,), math.log(3.0)), atol=1e-3)
    # no valid query: nothing changes
    nb, nv, _ = match_heads(q, torch.zeros(H, n, dtype=torch.bool), k, v, torch.zeros(H, N), region, kept,
                            torch.zeros_like(kept), 0.35, MatchConfig())
    assert torch.equal(nv, v) and bool((nb == 0).all())
    # degenerate systems in the solvers themselves
    zero = torch.zeros(2, 5, 4)
    assert bool(torch.isfinite(box_lsq(zero, torch.ones(2, 5), 0.5, 2.0)).all())
    assert bool(torch.isfinite(ridge_solve(zero, torch.ones(2, 5, 1), torch.zeros(2, 4, 1), 0.0)).all())
    dup = torch.rand(1, 8, 1).expand(1, 8, 6).contiguous()
    w = box_lsq(dup, torch.ones(1, 8), 0.0, 10.0, ridge=0.0)
    assert bool(torch.isfinite(w).all())


def test_highest_attention_and_omp_selection():
    torch.manual_seed(14)
    attn = torch.softmax(torch.randn(2, 5, 9), -1)
    scores = attention_key_scores(attn, "rms")
    torch.testing.assert_close(scores, attn.pow(2).mean(1).sqrt())
    candidates = torch.ones(2, 9, dtype=torch.bool)
    candidates[:, 0] = False
    chosen = highest_attention_keys(scores, candidates, torch.tensor([3, 0]))
    assert chosen[0].sum() == 3 and chosen[1].sum() == 0 and not chosen[:, 0].any()
    expected = scores[0].masked_fill(~candidates[0], -1).topk(3).indices
    assert set(torch.nonzero(chosen[0]).flatten().tolist()) == set(expected.tolist())
    # OMP recovers the exact support of a sparse positive mass combination (near-orthogonal columns)
    E = torch.eye(30)[:, :12][None] + 0.05 * torch.rand(1, 30, 12)
    target = E[0, :, [2, 7, 9]] @ torch.tensor([1.0, 2.0, 0.5])
    sel, weights = omp_keys(E, target[None], torch.ones(1, 12, dtype=torch.bool), torch.tensor([3]), lower=0.0, upper=10.0)
    assert torch.nonzero(sel[0]).flatten().tolist() == [2, 7, 9]
    torch.testing.assert_close(weights[0, [2, 7, 9]], torch.tensor([1.0, 2.0, 0.5]), atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------
# segmentation and allocation (hand-worked)


def test_double_newline_boundaries_on_token_ids():
    # 9 = ".\n\n" (fused), 7 = "\n", 8 = "\n-": "\n" then "\n..." is a split double newline
    boundaries = BoundaryTokens(full=frozenset({9}), ends=frozenset({7}), starts=frozenset({7, 8}))
    ids = torch.tensor([1, 2, 9, 3, 7, 7, 4, 7, 5, 7, 8, 6])
    assert boundary_flags(ids, boundaries).nonzero().flatten().tolist() == [2, 5, 10]
    assert segment_ids(ids, boundaries, min_length=1).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3]
    # min length 3: [3, 3, 5, 1] -> the last (short) one joins the previous
    assert segment_ids(ids, boundaries, min_length=3).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    assert not BoundaryTokens() and BoundaryTokens.from_ids([9])


def test_merge_short_segments():
    assert merge_short([10, 40, 5, 3, 50, 20], 32) == [58, 70]  # the first joins the next; short ones join the previous
    assert merge_short([40, 33, 31], 32) == [40, 64]
    assert merge_short([5, 6], 32) == [11]
    assert merge_short([32, 32], 32) == [32, 32]


def test_allocation_hand_worked():
    # s = sqrt(w n) = (7.071, 3.873, 1.414); shares 20 s / 12.358 = (11.44, 6.27, 2.29); floors 19; +1 to seg 0
    assert allocate([0.5, 0.3, 0.2], [100, 50, 10], 20).tolist() == [12, 6, 2]
    # capped by the segment size, the excess water-filled to the other segment
    assert allocate([0.9, 0.1], [5, 100], 20).tolist() == [5, 15]
    # t_i >= 1: shares (10, 0, 0) -> (10, 1, 1) -> two slots taken back from the over-allocated first
    assert allocate([1.0, 0.0, 0.0], [50, 50, 50], 10).tolist() == [8, 1, 1]
    # fewer slots than segments: the most important segments first
    assert allocate([0.1, 0.5, 0.4], [10, 10, 10], 2).tolist() == [0, 1, 1]
    # all-zero attention: fall back to the sizes
    assert allocate([0.0, 0.0], [30, 10], 8).tolist() == [6, 2]
    # capacity (non-pivotal entries) below the size; empty segments get nothing
    assert allocate([0.5, 0.5, 0.3], [10, 10, 0], 12, capacity=[2, 10, 0]).tolist() == [2, 10, 0]
    for seed in range(30):
        rng = torch.Generator().manual_seed(seed)
        m = int(torch.randint(1, 8, (1,), generator=rng))
        w = torch.rand(m, generator=rng).tolist()
        n = torch.randint(0, 20, (m,), generator=rng).tolist()
        total = int(torch.randint(0, sum(n) + 1, (1,), generator=rng)) if sum(n) else 0
        t = allocate(w, n, total)
        assert int(t.sum()) == total and all(0 <= a <= b for a, b in zip(t.tolist(), n))
        if total >= sum(1 for x in n if x > 0):
            assert all(a >= 1 for a, b in zip(t.tolist(), n) if b > 0)


def test_ranks_within_segments():
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.9, 0.2, 0.4]])
    groups = torch.tensor([[0, 0, 1, 1, 1, 0]])
    valid = torch.tensor([[True, True, True, True, True, False]])
    ranks = ranks_within_groups(scores, groups, valid)
    assert ranks[0, :5].tolist() == [1, 0, 1, 0, 2] and ranks[0, 5] > 100


def test_tam_selection_pivots_segments_and_budget():
    """TAM.score on a hand-built context: pivots kept, sum of allocations = target, every segment >= 1."""
    torch.manual_seed(15)
    L, b, Hkv, G, w, N, D = 1, 1, 1, 2, 4, 40, 8
    policy = TAM(segmentation="fixed", fixed_segment=10, protected_tail=0, selector_window=w, fit_beta=False, fit_values=False)
    policy.scaling = 1.0
    queries = torch.randn(L, b, Hkv * G, w, D)
    keys = torch.randn(L, b, Hkv, N, D) * 0.3
    keys[0, 0, 0, 13] = queries[0, 0].mean((0, 1)) * 6  # strongly attended: a pivot in segment 1
    keys[0, 0, 0, 14] = queries[0, 0].mean((0, 1)) * 6
    positions = torch.arange(N).view(1, 1, 1, N)
    protected = positions >= 36  # the last 4 entries are protected
    context = ScoringContext(
        keys=keys, values=torch.randn_like(keys), positions=positions, candidates=~protected,
        current_position=torch.tensor([N]), budget=14, queries=queries, query_positions=torch.arange(N - w, N)[None],
        protected=protected, biases=torch.zeros(L, b, Hkv, N),
    )
    scores = policy.score(context)
    chosen = (scores >= 2)[0, 0, 0]
    pivots = policy._round["pivots"][0, 0, 0]
    assert pivots[13] and pivots[14] and bool((chosen | ~pivots).all())
    assert int(chosen.sum()) == 14 - 4  # budget minus the protected entries
    segments = positions[0, 0, 0] // 10
    for s in range(4):
        assert int((chosen & (segments == s) & ~protected[0, 0, 0]).sum()) >= 1


def test_cache_records_token_ids_by_position_with_padding():
    model = _model()
    input_ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]])
    attention_mask = (torch.arange(8)[None, :] >= torch.tensor([3, 0])[:, None]).long()
    policy = make_policy("tam", boundary_ids=(4,), **SMALL_TAM)
    cache = CompressedCache(model, policy, budget=200)
    out = _generate(model, input_ids, cache, attention_mask, new_tokens=5)
    tokens = cache._position_tokens()
    seq = out.sequences
    assert tokens[0, :9].tolist() == seq[0, 3:12].tolist() and tokens[0, 9:].tolist() == [-1] * 3
    assert tokens[1, :12].tolist() == seq[1, :12].tolist()


def test_registry_and_options():
    for name in ("tam", "pam", "selector-window", "tri-am", "tri-am-recent", "tam-omp", "tam-alloc-only", "tam-pivots-only"):
        assert name in REGISTRY
    assert make_policy("pam").pivot_multiplier == 0 and make_policy("pam").segmentation == "none"
    assert not make_policy("selector-window").compacts and make_policy("tam").compacts
    assert make_policy("tam").configure(1024, 128) == 1024 and make_policy("tam", schedule="shared").configure(1024, 128) == 128
    with pytest.raises(ValueError):
        make_policy("tam", segmentation="words")
    with pytest.raises(ValueError):
        make_policy("tam", target_ratio=1.5)
    with pytest.raises(ValueError):
        MatchConfig(beta_min=2.0, beta_max=1.0)


def test_tam_periodic_ratio_target_and_omp_run():
    model = _model()
    torch.manual_seed(16)
    input_ids = torch.randint(1, 96, (1, 24))
    cache = trikv.make_cache(model, "tam-omp", budget=24, boundary_ids=(3,), protect_prompt=False, **SMALL_TAM)
    out = _generate(model, input_ids, cache, new_tokens=40)
    assert cache.rounds >= 2 and torch.isfinite(torch.stack(out.logits)).all()
    ratio = trikv.make_cache(model, "tam", budget=24, target_ratio=0.5, boundary_ids=(3,), protect_prompt=False, **SMALL_TAM)
    _generate(model, input_ids, ratio, new_tokens=18)  # one round at 40 entries: 4 protected + ceil(36 / 2)
    assert ratio.rounds == 1
    assert int((ratio.store.positions[:, :, :, : ratio.length] >= 0).sum(-1).max()) == 4 + 18 + 1
