"""Generation through mlx-lm with a trikv cache (or mlx-lm's full cache), with the figures `trikv generate` and
`trikv demo` print: tokens, decode speed, K/V bytes (final and peak), rounds and scoring time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH
from .cache import LayerCache


@dataclass
class MlxGenerationResult:
    """What `trikv.generate` reports, for one or more prompts generated one after the other through mlx-lm."""

    tokens: list[list[int]]
    texts: list[str]
    prompt_lengths: list[int]
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    final_cache_bytes: int = 0
    peak_cache_bytes: int = 0
    final_entries: int = 0
    peak_entries: int = 0
    compression_rounds: int = 0
    scoring_seconds: float = 0.0
    caches: list = field(default_factory=list)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


def held_bytes(cache: list) -> tuple[int, int]:
    """(K/V bytes held, entries per (layer, KV head)) of a trikv prompt cache or mlx-lm's own caches."""
    if cache and isinstance(cache[0], LayerCache):
        bounded = cache[0].bounded
        return bounded.memory_bytes(), bounded.length
    total = 0
    for layer in cache:
        for part in (layer.keys, layer.values):
            if part is None:
                continue
            for array in (part if isinstance(part, (tuple, list)) else (part,)):
                total += array.nbytes * layer.offset // max(array.shape[2], 1)
    return total, (cache[0].offset if cache else 0)


def suppress_tokens(token_ids: list[int], until: int, prompt_length: int):
    """An mlx-lm logits processor that forbids `token_ids` (end of sequence) for the first `until` new tokens."""
    import mlx.core as mx

    def processor(tokens, logits):
        if len(tokens) - prompt_length < until and token_ids:
            logits[..., token_ids] = -mx.inf
        return logits

    return processor


def generate(model, tokenizer, prompts, method: str = "triattention", budget: int | None = DEFAULT_BUDGET,
             divide_length: int = DEFAULT_DIVIDE_LENGTH, stats=None, max_new_tokens: int = 256, min_new_tokens: int = 0,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = 0,
             chat: bool = True, kv_bits: int | None = None, progress: bool = False, **options) -> MlxGenerationResult:
    """Generate for each prompt (a string or a list of token ids) with `method` ("full": mlx-lm's own cache) through
    `mlx_lm.stream_generate`; greedy unless `do_sample` (mlx-lm's sampler: temperature, top-p, top-k). A long prompt
    is fed in chunks of the cache's `prefill_chunk_size` (an option, default 512) with rounds between them."""
    import mlx.core as mx

    from .model import require_mlx_lm

    mlx_lm = require_mlx_lm()
    from mlx_lm.sample_utils import make_sampler

    from .prompt_cache import make_prompt_cache, prefill_step_size

    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp=temperature if do_sample else 0.0, top_p=top_p if do_sample else 0.0,
                           top_k=top_k if do_sample else 0)
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    result = MlxGenerationResult([], [], [])
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = (tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
                   if chat and getattr(tokenizer, "chat_template", None) else tokenizer.encode(prompt))
        else:
            ids = list(prompt)
        cache = make_prompt_cache(model, method, budget=budget if method != "full" else DEFAULT_BUDGET,
                                  divide_length=divide_length, stats=stats, kv_bits=kv_bits, **options)
        processors = [suppress_tokens(eos, min_new_tokens, len(ids))] if min_new_tokens else None
        tokens, peak_bytes, peak_entries = [], 0, 0
        decode_started = None
        # a long prompt in chunks of the cache's prefill chunk size (mlx-lm's own caches too: one rule for all)
        for response in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=max_new_tokens, sampler=sampler,
                                               logits_processors=processors, prompt_cache=cache,
                                               prefill_step_size=prefill_step_size(cache)):
            if decode_started is None:  # the first token ends the prefill
                decode_started = time.perf_counter()
            tokens.append(response.token)
            held, entries = held_bytes(cache)
            peak_bytes, peak_entries = max(peak_bytes, held), max(peak_entries, entries)
            if progress and len(tokens) % 64 == 0:
                print(f"[trikv mlx] {method}: {len(tokens)} tokens", flush=True)
        if decode_started is not None and len(tokens) > 1:
            result.decode_seconds += time.perf_counter() - decode_started
            result.decode_tokens += len(tokens) - 1
        final_bytes, final_entries = held_bytes(cache)
        if cache and isinstance(cache[0], LayerCache):  # the prefill's chunks peak between the tokens seen here
            bounded = cache[0].bounded
            peak_entries = max(peak_entries, bounded.peak_length)
            peak_bytes = max(peak_bytes, bounded.peak_length * final_bytes // max(final_entries, 1))
        result.tokens.append(tokens)
        result.texts.append(tokenizer.decode([t for t in tokens if t not in eos]))
        result.prompt_lengths.append(len(ids))
        result.final_cache_bytes, result.final_entries = final_bytes, final_entries
        result.peak_cache_bytes = max(result.peak_cache_bytes, peak_bytes)
        result.peak_entries = max(result.peak_entries, peak_entries)
        if cache and isinstance(cache[0], LayerCache):
            result.compression_rounds += cache[0].bounded.rounds
            result.scoring_seconds += cache[0].bounded.round_seconds
        result.caches.append(cache)
    return result
