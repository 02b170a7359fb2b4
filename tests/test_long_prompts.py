"""Bounded at every moment on the transformers path: prompts far longer than the budget are prefilled in chunks
with a round between chunks, so no forward finds the cache holding more than budget + divide_length + one chunk
entries; the chunked prefill is exactly masking (the masked full-attention replay of the same chunks gives the same
logits); `model.generate(prefill_chunk_size=...)` holds the same bound and a long unchunked forward warns with the
fix; a conversation continues on the same cache (`continue_cache=True`) exactly as full attention over the whole
conversation when nothing is evicted, and as its masked replay when entries are evicted.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

import trikv
from trikv.compat import cache_kwargs

from helpers import VisibleLog, masked_reference_forwards, masked_reference_logits, tiny_model
from stats_fixtures import tiny_stats

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET, SLACK, CHUNK = 24, 8, 16


class _Tok:
    pad_token_id, eos_token_id, chat_template = 0, None, None

    def decode(self, ids, skip_special_tokens=True):
        return ""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1 + (ord(c) % 90) for c in text]}


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _entry_bytes(model) -> int:
    """K+V bytes of one entry per (layer, KV head) over every layer and KV head of a tiny fp32 model."""
    shape = trikv.architectures.model_shape(model)
    return 2 * len(shape.cached_layers) * shape.num_kv_heads * shape.head_dim * 4


@pytest.mark.parametrize("engine", ["transformers", "lean"])
def test_a_prompt_ten_times_the_budget_never_takes_the_cache_past_the_bound(engine):
    model = tiny_model("llama")
    prompt = _prompt(10 * BUDGET)
    held = []  # entries per (layer, KV head) right after every forward's keys are in
    log = VisibleLog(model) if engine == "transformers" else None
    cache = trikv.make_cache(model, "triattention", budget=BUDGET, divide_length=SLACK, prefill_chunk_size=CHUNK,
                             stats=tiny_stats(model))
    update = cache.update

    def counting_update(key_states, value_states, layer_idx, *args, **kwargs):
        out = update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == 0:
            held.append(cache.length)
        return out

    cache.update = counting_update
    try:
        result = trikv.generate(model, _Tok(), [prompt], cache=cache, max_new_tokens=40, min_new_tokens=40, engine=engine)
    finally:
        if log is not None:
            log.close()
    bound = BUDGET + SLACK + CHUNK
    assert cache.peak_bound == bound
    prefill_forwards = -(-len(prompt) // CHUNK)
    assert len(held) == prefill_forwards + 39  # the prompt in chunks of CHUNK, then one token per step
    assert max(held) <= bound and max(held) > BUDGET + SLACK  # a chunk past the trigger, never past the bound
    assert result.peak_entries == max(held) == cache.peak_length
    assert result.peak_cache_bytes == max(held) * _entry_bytes(model)
    assert result.compression_rounds >= len(prompt) // (CHUNK + SLACK)
    full = trikv.generate(model, _Tok(), [prompt], method="full", max_new_tokens=40, min_new_tokens=40, engine=engine)
    assert full.peak_entries == len(prompt) + 39
    # after the prompt the buffers shrink back to what decoding needs
    assert cache.capacity == BUDGET + SLACK


@pytest.mark.parametrize("engine", ["transformers", "lean"])
def test_a_chunked_prefill_is_masking_in_a_padded_batch(engine):
    """Each row's prompt in chunks (the batch's rows padded on the left), rounds between chunks and while decoding:
    every forward's logits equal full attention masked to the entries the cache held."""
    model = tiny_model("qwen2", attn="eager")
    prompts = [_prompt(150, seed=1), _prompt(97, seed=2)]
    log = VisibleLog(model) if engine == "transformers" else _LeanVisibleLog()
    cache = trikv.make_cache(model, "triattention", budget=BUDGET, divide_length=SLACK, prefill_chunk_size=CHUNK,
                             stats=tiny_stats(model))
    if engine == "lean":
        log.watch(cache)
    try:
        result = trikv.generate(model, _Tok(), prompts, cache=cache, max_new_tokens=30, min_new_tokens=30,
                                return_logits=True, engine=engine)
    finally:
        log.close()
    assert result.compression_rounds > 5
    width = 150
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = (torch.arange(width)[None, :] >= torch.tensor([0, width - 97])[:, None]).long()
    chunks = [(start, min(start + CHUNK, width)) for start in range(0, width, CHUNK)]
    assert len(log.visible) == len(chunks) + 29
    reference = masked_reference_logits(model, input_ids, attention_mask, torch.tensor(result.tokens), log.visible, chunks)
    torch.testing.assert_close(torch.stack(result.logits), reference, rtol=0, atol=2e-4)


class _LeanVisibleLog:
    """The lean engine runs no transformers hooks: record the visible positions after every forward's update."""

    def __init__(self):
        self.visible = []

    def watch(self, cache):
        update = cache.update
        last_layer = max(cache.store_index)

        def logging_update(key_states, value_states, layer_idx, *args, **kwargs):
            out = update(key_states, value_states, layer_idx, *args, **kwargs)
            if layer_idx == last_layer:
                self.visible.append(cache.visible_positions().clone())
            return out

        cache.update = logging_update

    def close(self):
        pass


def test_chunk_bounds_never_leave_a_single_token_chunk():
    model = tiny_model("llama")
    cache = trikv.make_cache(model, "streaming", budget=BUDGET, divide_length=SLACK, prefill_chunk_size=CHUNK)
    assert cache.chunk_bounds(BUDGET + SLACK) == [(0, BUDGET + SLACK)]  # no round can fall due inside it
    assert cache.chunk_bounds(2 * CHUNK + 1) == [(0, CHUNK), (CHUNK, 2 * CHUNK - 1), (2 * CHUNK - 1, 2 * CHUNK + 1)]
    assert cache.chunk_bounds(3 * CHUNK) == [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, 3 * CHUNK)]
    with pytest.raises(ValueError, match="prefill_chunk_size must be an integer >= 2, got 1"):
        trikv.make_cache(model, "streaming", budget=BUDGET, prefill_chunk_size=1)
    full = trikv.make_cache(model, "full")
    assert full.chunk_bounds(10_000) == [(0, 10_000)] and full.peak_bound is None


def test_model_generate_with_the_cache_alone_holds_the_bound_and_a_long_forward_warns():
    """model.generate with the cache and nothing else prefills in the cache's chunks (a bounded cache sets the model's
    generation_config.prefill_chunk_size), so its peak stays within the bound; a user's own prefill_chunk_size is
    left alone; a forward longer than a chunk, outside generate, runs and warns."""
    model = tiny_model("llama")
    stats = tiny_stats(model)
    prompt = torch.tensor([_prompt(10 * BUDGET)])
    cache = trikv.make_cache(model, "triattention", budget=BUDGET, divide_length=SLACK, prefill_chunk_size=CHUNK, stats=stats)
    assert model.generation_config.prefill_chunk_size == CHUNK
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the chunked prefill does not warn
        model.generate(prompt, attention_mask=torch.ones_like(prompt), **cache_kwargs(model, cache), max_new_tokens=20,
                       min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert cache.rounds > 5 and cache.peak_length <= cache.peak_bound
    larger = trikv.make_cache(model, "streaming", budget=BUDGET, divide_length=SLACK, prefill_chunk_size=2 * CHUNK)
    assert model.generation_config.prefill_chunk_size == 2 * CHUNK  # follows the latest cache trikv set it for
    model.generation_config.prefill_chunk_size = 24  # the user's own: kept
    trikv.make_cache(model, "streaming", budget=BUDGET, divide_length=SLACK, prefill_chunk_size=CHUNK)
    assert model.generation_config.prefill_chunk_size == 24
    model.generation_config.prefill_chunk_size = None
    whole = trikv.make_cache(model, "triattention", budget=BUDGET, divide_length=SLACK, prefill_chunk_size=CHUNK, stats=stats)
    with pytest.warns(UserWarning, match=r"a forward of 240 tokens .* prefill_chunk_size=16\) or trikv.generate"):
        with torch.no_grad():
            model(input_ids=prompt, **cache_kwargs(model, whole))
    assert whole.peak_length == 10 * BUDGET and larger.prefill_chunk_size == 2 * CHUNK


def test_a_continued_conversation_equals_full_attention_when_nothing_is_evicted():
    model = tiny_model("llama", attn="eager")
    cache = trikv.make_cache(model, "triattention", budget=2048, stats=tiny_stats(model))
    first = trikv.generate(model, _Tok(), [_prompt(30)], cache=cache, max_new_tokens=12, min_new_tokens=12, return_logits=True)
    second = trikv.generate(model, _Tok(), [_prompt(20, seed=5)], cache=cache, continue_cache=True, max_new_tokens=12,
                            min_new_tokens=12, return_logits=True)
    # the conversation as one sequence through transformers' DynamicCache
    sequence = _prompt(30) + first.tokens[0] + _prompt(20, seed=5) + second.tokens[0][:-1]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sequence]), **cache_kwargs(model, DynamicCache(config=model.config))).logits[0]
    start = 30 + 12 + 20 - 1  # the second turn's first sampled token
    torch.testing.assert_close(torch.stack(second.logits)[:, 0], logits[start:], rtol=0, atol=2e-4)
    assert cache.get_seq_length() == len(sequence) and second.prompt_lengths == [21]  # the pending token + 20


def test_a_continued_conversation_with_rounds_is_masking():
    model = tiny_model("qwen2", attn="eager")
    cache = trikv.make_cache(model, "triattention", budget=BUDGET, divide_length=SLACK, prefill_chunk_size=CHUNK,
                             stats=tiny_stats(model))
    log = VisibleLog(model)
    turns = []
    try:
        for turn, length in enumerate((70, 45, 3)):
            turns.append(trikv.generate(model, _Tok(), [_prompt(length, seed=turn)], cache=cache, continue_cache=turn > 0,
                                        max_new_tokens=15, min_new_tokens=15, return_logits=True))
    finally:
        log.close()
    forwards, expected = [], []
    pending = []
    for turn, (length, result) in enumerate(zip((70, 45, 3), turns)):
        ids = pending + _prompt(length, seed=turn)
        starts = [start for start, _ in _bounds(ids, forwards, cache)]
        for start, stop in _bounds(ids, forwards, cache):
            forwards.append(torch.tensor([ids[start:stop]]))
        assert starts
        expected.append(len(forwards) - 1)
        for token in result.tokens[0][:-1]:
            forwards.append(torch.tensor([[token]]))
            expected.append(len(forwards) - 1)
        pending = result.tokens[0][-1:]
    assert len(forwards) == len(log.visible)
    reference = masked_reference_forwards(model, forwards, log.visible)
    ours = torch.cat([torch.stack(result.logits) for result in turns])
    torch.testing.assert_close(ours, reference[expected], rtol=0, atol=2e-4)
    assert cache.rounds > 4 and cache.peak_length <= cache.peak_bound


def _bounds(ids, forwards, cache):
    """The chunks trikv.generate feeds `ids` in, from the length the cache held before them (recomputed here from
    the forwards so far: the rule is budget + divide_length crossed => chunks of prefill_chunk_size)."""
    held_before = _held_after(forwards, cache)
    n = len(ids)
    if held_before + n <= BUDGET + SLACK or n <= CHUNK:
        return [(0, n)]
    starts = list(range(0, n, CHUNK))
    if n - starts[-1] == 1:
        starts[-1] -= 1
    return list(zip(starts, starts[1:] + [n]))


def _held_after(forwards, cache):
    """Entries the cache held after `forwards`, replaying the schedule: a round before any forward that finds
    budget + divide_length entries brings them back to the budget."""
    held = 0
    for tokens in forwards:
        if held >= BUDGET + SLACK:
            held = BUDGET
        held += tokens.shape[1]
    return held


def test_continuing_is_refused_without_a_cache_and_for_a_batch():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"continue_cache=True needs cache=\.\.\., the cache that holds the conversation"):
        trikv.generate(model, _Tok(), [[1, 2, 3]], method="streaming", budget=BUDGET, continue_cache=True)
    cache = trikv.make_cache(model, "streaming", budget=BUDGET)
    trikv.generate(model, _Tok(), [[1, 2, 3], [4, 5]], cache=cache, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"cache already holds 5 tokens .* or pass continue_cache=True"):
        trikv.generate(model, _Tok(), [[1, 2]], cache=cache, max_new_tokens=3)
    with pytest.raises(ValueError, match="continuing a conversation takes one prompt, got 2"):
        trikv.generate(model, _Tok(), [[1, 2], [3]], cache=cache, continue_cache=True)
    with pytest.raises(ValueError, match="this cache holds a batch of 2 rows; continue_cache=True continues a one-row"):
        trikv.generate(model, _Tok(), [[1, 2]], cache=cache, continue_cache=True)
