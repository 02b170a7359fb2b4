"""The cache is exact: no eviction = plain transformers; eviction = masking; batches = rows alone."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import trikv
from trikv.policies import REGISTRY

from helpers import VisibleLog, masked_reference_logits, tiny_model
from stats_fixtures import tiny_stats
from trikv.compat import cache_kwargs

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gpt_oss"]


def _generate(model, input_ids, cache, **kwargs):
    torch.manual_seed(1234)
    return model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        **cache_kwargs(model, cache),
        max_new_tokens=24,
        min_new_tokens=24,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
        **kwargs,
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampling", [False, True])
def test_no_eviction_matches_dynamic_cache(family, sampling):
    model = tiny_model(family)
    input_ids = torch.randint(1, 96, (1, 40))
    options = dict(do_sample=True, top_k=20, temperature=0.8) if sampling else dict(do_sample=False)
    reference = _generate(model, input_ids, DynamicCache(config=model.config), **options)
    cache = trikv.make_cache(model, "triattention", budget=512, stats=tiny_stats(model))
    ours = _generate(model, input_ids, cache, **options)
    assert torch.equal(reference.sequences, ours.sequences)
    for ref_logits, our_logits in zip(reference.logits, ours.logits):
        torch.testing.assert_close(our_logits, ref_logits, rtol=0, atol=1e-5)
    assert cache.rounds == 0 and cache.get_seq_length() == 40 + 23


@pytest.mark.parametrize("method", ["triattention", "streaming", "full"])
def test_generate_helper_matches_transformers(method):
    model = tiny_model("llama")
    tokenizer = _ByteTokenizer()
    prompt = list(range(5, 45))
    options = {"stats": tiny_stats(model)} if REGISTRY[method].needs_stats else {}
    if method != "full":  # full attention takes no budget
        options["budget"] = 1000
    ours = trikv.generate(model, tokenizer, [prompt], method=method, max_new_tokens=20, min_new_tokens=20, return_logits=True, **options)
    reference = _generate(model, torch.tensor([prompt]), DynamicCache(config=model.config))
    assert ours.tokens[0] == reference.sequences[0, 40:].tolist()[: len(ours.tokens[0])]
    torch.testing.assert_close(torch.stack(ours.logits)[:, 0], torch.stack(reference.logits)[:20, 0], rtol=0, atol=1e-5)


class _ByteTokenizer:
    """Minimal tokenizer stand-in for tiny models (ids in, ids out)."""

    pad_token_id = 0
    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_eviction_equals_masking(family, attn):
    model = tiny_model(family, attn=attn)
    tokenizer = _ByteTokenizer()
    prompt = torch.randint(1, 96, (1, 30)).tolist()
    log = VisibleLog(model)
    try:
        result = trikv.generate(
            model, tokenizer, prompt, method="triattention", stats=tiny_stats(model), budget=48, divide_length=16,
            max_new_tokens=90, min_new_tokens=90, return_logits=True,
        )
    finally:
        log.close()
    cache = result.cache
    assert cache.rounds >= 4, "the test must exercise several compression rounds"
    generated = torch.tensor(result.tokens)
    reference = masked_reference_logits(model, torch.tensor(prompt), torch.ones(1, 30, dtype=torch.long), generated, log.visible)
    ours = torch.stack(result.logits)
    torch.testing.assert_close(ours, reference, rtol=0, atol=2e-4)
    # and eviction really changed something: full attention differs
    full = trikv.generate(model, tokenizer, prompt, method="full", max_new_tokens=90, min_new_tokens=90, return_logits=True)
    assert (torch.stack(full.logits) - ours).abs().max() > 1e-3


@pytest.mark.parametrize("family,attn", [("llama", "eager"), ("llama", "sdpa"), ("gemma3_text", "sdpa"), ("gpt_oss", "eager")])
def test_left_padded_batch_equals_rows_alone(family, attn):
    """Rows of a left-padded batch generate as they would alone (hybrid models: their sliding layers, padded
    through transformers' own masks, too)."""
    model = tiny_model(family, attn=attn)
    tokenizer = _ByteTokenizer()
    prompts = [torch.randint(1, 96, (n,)).tolist() for n in (37, 12, 25)]
    stats = tiny_stats(model)
    options = dict(method="triattention", stats=stats, budget=40, divide_length=8, max_new_tokens=60, min_new_tokens=60, return_logits=True)
    batch = trikv.generate(model, tokenizer, prompts, **options)
    assert batch.cache.rounds >= 3
    for row, prompt in enumerate(prompts):
        alone = trikv.generate(model, tokenizer, [prompt], **options)
        assert batch.tokens[row] == alone.tokens[0]
        torch.testing.assert_close(torch.stack(batch.logits)[:, row], torch.stack(alone.logits)[:, 0], rtol=0, atol=2e-4)


# the statistics path, the query-window path and the newest-query path (knorm is left out: a token repeated at
# two positions has two keys of equal norm, an exact tie that padding breaks differently in a batch)
ROW_INDEPENDENT = {"triattention-dedup": {"recent_window": 6}, "rkv": {}, "tova": {}}


@pytest.mark.parametrize("method", ROW_INDEPENDENT)
def test_rows_scored_only_when_due_equal_rows_alone(method):
    """Rows of a batch reach the trigger at different steps and are then scored alone; each row must keep
    the entries and emit the tokens it does when generated by itself."""
    model = tiny_model("qwen2", attn="eager")
    tokenizer = _ByteTokenizer()
    prompts = [torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 12, 25)]
    options = dict(ROW_INDEPENDENT[method], **({"stats": tiny_stats(model)} if REGISTRY[method].needs_stats else {}))
    cache = trikv.make_cache(model, method, budget=40, divide_length=8, **options)
    scored_rows = []
    score = cache.policy.score
    cache.policy.score = lambda context: scored_rows.append(context.positions.shape[1]) or score(context)
    batch = trikv.generate(model, tokenizer, prompts, cache=cache, max_new_tokens=48, min_new_tokens=48)
    assert cache.rounds >= 3 and min(scored_rows) < len(prompts)  # some rounds scored a subset of the rows
    for row, prompt in enumerate(prompts):
        alone = trikv.make_cache(model, method, budget=40, divide_length=8, **options)
        tokens = trikv.generate(model, tokenizer, [prompt], cache=alone, max_new_tokens=48, min_new_tokens=48).tokens[0]
        assert batch.tokens[row] == tokens, (method, row)
        kept = batch.cache.visible_positions()[:, row]
        mine = alone.visible_positions()[:, 0]
        for layer in range(kept.shape[0]):
            for head in range(kept.shape[1]):
                assert sorted(p for p in kept[layer, head].tolist() if p >= 0) == sorted(p for p in mine[layer, head].tolist() if p >= 0)


def test_left_padded_batch_masking_reference():
    model = tiny_model("qwen2", attn="eager")
    tokenizer = _ByteTokenizer()
    prompts = [torch.randint(1, 96, (n,)).tolist() for n in (33, 9)]
    log = VisibleLog(model)
    try:
        result = trikv.generate(model, tokenizer, prompts, method="triattention", stats=tiny_stats(model), budget=32, divide_length=8, max_new_tokens=50, min_new_tokens=50, return_logits=True)
    finally:
        log.close()
    input_ids = torch.tensor([[0] * (33 - len(p)) + p for p in prompts])
    attention_mask = (torch.arange(33)[None, :] >= torch.tensor([0, 24])[:, None]).long()
    reference = masked_reference_logits(model, input_ids, attention_mask, torch.tensor(result.tokens), log.visible)
    torch.testing.assert_close(torch.stack(result.logits), reference, rtol=0, atol=2e-4)


def test_chunked_prefill_compresses_as_cache_fills():
    model = tiny_model("llama", attn="eager")
    stats = tiny_stats(model)
    prompt = torch.randint(1, 96, (1, 200))
    cache = trikv.make_cache(model, "triattention", budget=48, divide_length=16, stats=stats, protect_prompt=False)
    log = VisibleLog(model)
    logits = []
    try:
        with torch.no_grad():
            for start in range(0, 200, 50):
                chunk = prompt[:, start : start + 50]
                positions = torch.arange(start, start + 50)[None]
                logits.append(model(input_ids=chunk, position_ids=positions, **cache_kwargs(model, cache)).logits[:, -1])
    finally:
        log.close()
    assert cache.rounds == 2 and cache.length == 48 + 50 and cache.get_seq_length() == 200
    # the same chunks through masked full attention
    from helpers import _STATE, attention_implementation

    reference_cache = DynamicCache(config=model.config)
    for index, (start, visible) in enumerate(zip(range(0, 200, 50), log.visible)):
        total = start + 50
        allowed = torch.zeros(visible.shape[0], 1, visible.shape[2], total, dtype=torch.bool)
        allowed.scatter_(3, visible, True)
        causal = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]
        _STATE["allowed"] = allowed[:, :, :, None, :] & causal
        with attention_implementation(model, "trikv_test_masked"), torch.no_grad():
            out = model(input_ids=prompt[:, start:total], position_ids=torch.arange(start, total)[None], **cache_kwargs(model, reference_cache))
        torch.testing.assert_close(logits[index], out.logits[:, -1], rtol=0, atol=2e-4)


def test_memory_bounds_every_round():
    model = tiny_model("llama")
    stats = tiny_stats(model)
    budget, beta = 40, 16
    cache = trikv.make_cache(model, "triattention", budget=budget, divide_length=beta, stats=stats)
    lengths_after_round = []
    original = cache.compress

    def compress():
        original()
        lengths_after_round.append((cache.length, cache.memory_bytes()))

    cache.compress = compress
    tokenizer = _ByteTokenizer()
    log = VisibleLog(model)
    try:
        trikv.generate(model, tokenizer, [list(range(1, 30))], cache=cache, max_new_tokens=150, min_new_tokens=150)
    finally:
        log.close()
    per_entry = 2 * 3 * 1 * 2 * 16 * 4  # K+V x layers x rows x kv heads x head_dim x fp32
    assert len(lengths_after_round) >= 5
    assert all(length == budget and nbytes == budget * per_entry for length, nbytes in lengths_after_round)
    assert max(v.shape[-1] for v in log.visible) == budget + beta
    assert cache.peak_length == budget + beta
    assert cache.capacity == budget + beta  # preallocated once, never reallocated


def test_rows_keep_their_own_selection():
    model = tiny_model("llama")
    tokenizer = _ByteTokenizer()
    prompts = [torch.randint(1, 96, (20,)).tolist() for _ in range(2)]
    result = trikv.generate(model, tokenizer, prompts, method="triattention", stats=tiny_stats(model), budget=24, divide_length=8, max_new_tokens=40, min_new_tokens=40)
    positions = result.cache.store.positions[:, :, :, : result.cache.length]
    assert not torch.equal(positions[:, 0], positions[:, 1])
    # live entries are in ascending original order in every (layer, row, head)
    for row in positions.flatten(0, 2):
        live = row[row >= 0]
        assert bool((live[1:] > live[:-1]).all())


def test_model_generate_padded_batch_equals_decode_loop():
    """transformers' generate() (its own masks, positions and pads) and trikv.generate agree on a padded batch."""
    model = tiny_model("llama", attn="eager")
    tokenizer = _ByteTokenizer()
    prompts = [torch.randint(1, 96, (n,)).tolist() for n in (30, 11)]
    stats = tiny_stats(model)
    ours = trikv.generate(model, tokenizer, prompts, method="triattention", stats=stats, budget=32, divide_length=8, max_new_tokens=50, min_new_tokens=50)
    input_ids = torch.tensor([[0] * (30 - len(p)) + p for p in prompts])
    attention_mask = (input_ids != 0).long()
    attention_mask[0] = 1
    cache = trikv.make_cache(model, "triattention", budget=32, divide_length=8, stats=stats)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(model, cache), max_new_tokens=50, min_new_tokens=50, do_sample=False, pad_token_id=0)
    assert cache.rounds >= 3
    assert out[:, 30:].tolist() == ours.tokens


@pytest.mark.parametrize("method", [name for name in REGISTRY if name.startswith("triattention")])
def test_every_triattention_variant_is_exact_masking(method):
    model = tiny_model("llama", attn="eager")
    tokenizer = _ByteTokenizer()
    prompts = [torch.randint(1, 96, (n,)).tolist() for n in (24, 10)]
    log = VisibleLog(model)
    try:
        # the windowed variants get a window that leaves room for selection inside the budget of 28
        window = {"triattention-window": {"window_size": 6}, "triattention-recent": {"recent_window": 6},
                  "triattention-dedup": {"recent_window": 6}}.get(method, {})
        result = trikv.generate(model, tokenizer, prompts, method=method, stats=tiny_stats(model), budget=28, divide_length=8,
                                max_new_tokens=40, min_new_tokens=40, return_logits=True, **window)
    finally:
        log.close()
    assert result.cache.rounds >= 3
    input_ids = torch.tensor([[0] * (24 - len(p)) + p for p in prompts])
    attention_mask = (torch.arange(24)[None, :] >= torch.tensor([0, 14])[:, None]).long()
    reference = masked_reference_logits(model, input_ids, attention_mask, torch.tensor(result.tokens), log.visible)
    torch.testing.assert_close(torch.stack(result.logits), reference, rtol=0, atol=2e-4)
    live = (result.cache.store.positions[:, :, :, : result.cache.length] >= 0).sum(-1)
    assert int(live.max()) <= 28 + 8


@pytest.mark.parametrize("prompt_lengths", [(11,), (30, 11)])
def test_batch_in_which_every_row_is_padded_compresses_like_rows_alone(prompt_lengths):
    """Every row left-padded (pad_to_multiple_of, or a single padded row): each row is compressed when its own
    entries reach budget + slack, as if generated alone (it used to never compress and then fail)."""
    model = tiny_model("llama", attn="eager")
    stats = tiny_stats(model)
    prompts = [torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in prompt_lengths]
    width = 40  # every row padded to 40
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = (input_ids != 0).long()
    cache = trikv.make_cache(model, "triattention", budget=24, divide_length=8, stats=stats)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(model, cache), max_new_tokens=50,
                         min_new_tokens=50, do_sample=False, pad_token_id=0)
    assert cache.rounds >= 4
    for row, prompt in enumerate(prompts):
        alone = trikv.make_cache(model, "triattention", budget=24, divide_length=8, stats=stats)
        single = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                **cache_kwargs(model, alone), max_new_tokens=50, min_new_tokens=50, do_sample=False, pad_token_id=0)
        assert out[row, width:].tolist() == single[0, len(prompt):].tolist()
        kept = sorted(p for p in cache.visible_positions()[0, row, 0].tolist() if p >= 0)
        assert kept == sorted(alone.visible_positions()[0, 0, 0].tolist())


def test_a_huge_budget_costs_nothing_until_used():
    """Buffers grow with the sequence: a short answer with a budget of a million allocates what full attention
    does, not a million slots; once the cache reaches budget + slack it keeps that single allocation."""
    import os

    def rss_bytes() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    model = tiny_model("llama")
    tokenizer = _ByteTokenizer()
    prompt = [list(range(1, 9))]
    rss_before = rss_bytes()
    huge = trikv.generate(model, tokenizer, prompt, method="streaming", budget=1_000_000, max_new_tokens=8, min_new_tokens=8)
    grown = rss_bytes() - rss_before  # the cache is alive here: one million slots would be ~800 MB
    from trikv.stores import INITIAL_SLOTS

    assert huge.cache.capacity == INITIAL_SLOTS  # a full-attention cache of this model starts with as many
    assert grown < 100 * 2**20
    bounded = trikv.make_cache(model, "streaming", budget=300, divide_length=50)
    trikv.generate(model, tokenizer, prompt, cache=bounded, max_new_tokens=500, min_new_tokens=500)
    assert bounded.rounds >= 3 and bounded.capacity == 350


def test_model_generate_with_past_key_values_alone_keeps_a_3000_token_prompt_under_the_bound():
    """What a user writes first: `model.generate(**inputs, past_key_values=cache, max_new_tokens=...)` (on
    transformers 5.24 a deprecated alias of `cache=`, still honoured): a 3,000-token prompt is prefilled in the
    cache's chunks, so the cache never holds more than budget + divide_length + one chunk, on both ends of the
    supported transformers range."""
    import warnings

    model = tiny_model("llama")
    cache = trikv.make_cache(model, "triattention", budget=64, divide_length=32, prefill_chunk_size=128, stats=tiny_stats(model))
    prompt = torch.randint(1, 90, (1, 3000), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24: past_key_values is now called cache
        output = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                                max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert output.shape[1] == 3016 and cache.get_seq_length() == 3015
    assert cache.rounds >= 20 and cache.peak_length <= cache.peak_bound == 64 + 32 + 128
