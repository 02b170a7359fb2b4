"""A plain decode loop around any trikv cache: batches with left padding, greedy or sampled.

It does what `model.generate(..., cache=cache)` does (`past_key_values=` before transformers 5.24; same position ids, masks and sampling warpers, so
the same tokens for the same seed) and also times every step and tracks the cache's memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .cache import CompressedCache, make_cache
from .compat import cache_kwargs
from .heap import release_free_heap
from .prompts import prompt_ids
from .settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH
from .validation import integer, positive, probability

HEAP_RELEASE_STEPS = 32  # decode steps between handing freed heap pages back to the OS (trikv.heap)


def cache_bytes(cache) -> int:
    """Live K/V bytes of a trikv cache or a transformers DynamicCache."""
    if isinstance(cache, CompressedCache):
        return cache.memory_bytes()
    total = 0
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "keys", None) is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


def cache_entries(cache) -> int:
    """Physical entries per (layer, row, KV head) of the layers that grow with the sequence (a hybrid model's
    full-attention layers; its sliding layers hold at most their window)."""
    if isinstance(cache, CompressedCache):
        return cache.entries()
    layers = [layer for layer in getattr(cache, "layers", []) if not getattr(layer, "is_sliding", False)]
    layer = layers[0] if layers else None
    return 0 if layer is None or getattr(layer, "keys", None) is None else layer.keys.shape[-2]


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per row (prompt excluded, stops at EOS)
    texts: list[str]
    prompt_lengths: list[int]
    prefill_seconds: float
    decode_seconds: float
    steps: int
    step_seconds: list[float] = field(default_factory=list)
    final_cache_bytes: int = 0
    peak_cache_bytes: int = 0
    final_entries: int = 0
    peak_entries: int = 0
    compression_rounds: int = 0
    scoring_seconds: float = 0.0
    logits: list[torch.Tensor] | None = None  # per step [b, vocab] (return_logits=True)
    cache: object = None

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens (all rows) per second of decoding."""
        rows = len(self.tokens)
        return rows * max(self.steps - 1, 0) / self.decode_seconds if self.decode_seconds > 0 else 0.0


HALT_CHECK_STEPS = 64


def encode_prompts(tokenizer, prompts, chat: bool = True) -> dict:
    """Tokenise prompts (strings, or lists of ids) into a left-padded batch."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    if isinstance(prompts[0], str):
        ids = [prompt_ids(tokenizer, p, chat) for p in prompts]
    else:
        ids = [list(p) for p in prompts]
    if any(len(row) == 0 for row in ids):
        raise ValueError("a prompt encodes to zero tokens")
    width = max(len(row) for row in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in ids])
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids])
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class Sampler:
    """The next token of every row from its logits, as `model.generate()` picks it: greedy (argmax), or sampled from
    the softmax after transformers' warpers (temperature, then top-k, then top-p; one `torch.multinomial` draw).
    End-of-sequence tokens are forbidden for the first `min_new_tokens` steps; finished rows get `pad_id`."""

    def __init__(self, do_sample: bool, temperature: float, top_k: int, top_p: float, min_new_tokens: int,
                 eos_ids: list[int], pad_id: int):
        self.do_sample, self.min_new_tokens, self.eos_ids, self.pad_id = do_sample, min_new_tokens, eos_ids, pad_id
        self.warpers = LogitsProcessorList()
        if do_sample:
            if temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(temperature))
            if top_k:
                self.warpers.append(TopKLogitsWarper(top_k))
            if top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, logits: torch.Tensor, sequence: torch.Tensor, step: int, finished: torch.Tensor) -> torch.Tensor:
        """logits [b, vocab] float32, sequence [b, t] (prompt + tokens so far) -> tokens [b]."""
        scores = logits.clone()
        if step < self.min_new_tokens and self.eos_ids:
            scores[:, self.eos_ids] = float("-inf")
        if self.do_sample:
            scores = self.warpers(sequence, scores)
            token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            token = scores.argmax(-1)
        return torch.where(finished, torch.full_like(token, self.pad_id), token)


def model_forward(model, cache, lean=None):
    """forward(input_ids [b, q], positions [b, q], attention_mask [b, t]) -> logits [b, vocab] float32 of the last
    position: the lean engine's forward, or the model's own with the cache keyword the installed transformers takes.
    All-ones masks are dropped, as `generate()` drops them."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = None if bool(attention_mask.all()) else attention_mask
        if lean is not None:
            return lean.forward(input_ids, cache, position_ids=positions, attention_mask=mask)[:, -1, :].float()
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **cache_kwargs(model, cache), logits_to_keep=1)
        return out.logits[:, -1, :].float()

    return forward


def prefill_chunks(cache, new_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) of each prefill forward for `new_tokens` tokens: a bounded trikv cache's chunks
    (`CompressedCache.chunk_bounds`), one forward for any other cache."""
    if isinstance(cache, CompressedCache):
        return cache.chunk_bounds(new_tokens)
    return [(0, new_tokens)]


def prefill(forward, sampler: Sampler, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
            sequence: torch.Tensor, finished: torch.Tensor,
            chunks: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's forwards and the first token: (tokens [b], logits [b, vocab]).

    input_ids / positions [b, n] are the new tokens, attention_mask [b, held + n] covers what the cache already
    holds too; `chunks` ([start, stop) per forward, default one forward) feed a long prompt a chunk at a time, so
    a bounded cache runs its rounds between chunks."""
    held = attention_mask.shape[1] - input_ids.shape[1]
    for start, stop in chunks or [(0, input_ids.shape[1])]:
        logits = forward(input_ids[:, start:stop], positions[:, start:stop], attention_mask[:, : held + stop])
    return sampler(logits, sequence, 0, finished), logits


def decode_one_token(forward, sampler: Sampler, token: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                     sequence: torch.Tensor, finished: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: the last tokens [b] at `positions` [b, 1] -> (next tokens [b], their logits [b, vocab])."""
    logits = forward(token[:, None], positions, attention_mask)
    return sampler(logits, sequence, step, finished), logits


def remember_pending(cache, token: torch.Tensor) -> None:
    """Note on the cache the tokens [b] sampled last and never fed, with the length they follow: a continuation
    (`continue_cache=True`) feeds them first."""
    cache.pending_tokens = token.detach().clone()
    cache.pending_at = cache.get_seq_length()


def continuation_batch(cache, tokenizer, prompts) -> dict:
    """The one-row batch that continues the conversation `cache` holds: the token sampled last (if this module
    sampled it and nothing was fed since), then the prompt's ids (text encoded as it is, no chat template)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if len(prompts) != 1:
        raise ValueError(f"continuing a conversation takes one prompt, got {len(prompts)}: the cache holds one "
                         "conversation (a batch's rows would each need their own history)")
    if getattr(cache, "batch_size", 1) > 1:
        raise ValueError(f"this cache holds a batch of {cache.batch_size} rows; continue_cache=True continues a "
                         "one-row conversation")
    prompt = prompts[0]
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
    pending = getattr(cache, "pending_tokens", None)
    if pending is not None and getattr(cache, "pending_at", -1) == cache.get_seq_length():
        ids = [int(pending[0])] + ids
    if not ids:
        raise ValueError("the continuation encodes to zero tokens")
    return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts,
    method: str | None = None,
    budget: int | None = DEFAULT_BUDGET,
    stats=None,
    cache=None,
    max_new_tokens: int = 256,
    min_new_tokens: int = 0,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = 0,
    chat: bool = True,
    divide_length: int | None = None,
    return_logits: bool = False,
    progress: bool = False,
    engine: str = "transformers",
    halt_rows=None,
    continue_cache: bool = False,
    **method_options,
) -> GenerationResult:
    """Generate for one prompt or a batch with `method` (default "triattention"; "full" uses transformers'
    DynamicCache), or with a `cache` you made (then `method`, `budget`, `divide_length`, `stats` and method
    options come from it and must not be given again).

    Long prompts: a bounded trikv cache is fed a prompt that would take it past budget + divide_length in chunks
    of its `prefill_chunk_size` (default 512), with a round between chunks whenever it reaches budget +
    divide_length, so it never holds more than budget + divide_length + one chunk entries per (layer, KV head).

    A cache holds one conversation. A cache that already holds tokens is refused (call `cache.reset()` to reuse it)
    unless `continue_cache=True`: the prompt (one row, its text encoded without a chat template, or token ids) is
    then appended to the conversation the cache holds, at the next logical positions, after the token this
    function sampled last and never fed (the end of the previous reply); the earlier kept entries stay.
    `trikv.Session` runs a chat that way, with the model's chat template.

    engine: "transformers" (the model's own forward) or "lean" (trikv's plain-PyTorch decoder for llama /
    qwen2 / qwen3 / mistral, `trikv.lean`; same tokens, less fixed cost per step; full attention then uses
    a preallocated trikv cache instead of DynamicCache).

    halt_rows: optional `f(generated) -> [rows] bool`, called every `HALT_CHECK_STEPS` steps with the tokens written
    so far ([rows, steps] long); a row it flags stops there, as if it had written EOS (e.g. a trace writer
    giving up on an answer that loops).
    """
    if engine not in ("transformers", "lean"):
        raise ValueError(f"unknown engine {engine!r}; expected 'transformers' or 'lean'")
    from tqdm.auto import tqdm

    max_new_tokens = integer("max_new_tokens", max_new_tokens)
    min_new_tokens = integer("min_new_tokens", min_new_tokens, minimum=0)
    top_k = integer("top_k", top_k, minimum=0)
    if do_sample:
        temperature, top_p = positive("temperature", temperature), probability("top_p", top_p)
    if cache is not None:
        given = [name for name, value, default in (("method", method, None), ("budget", budget, DEFAULT_BUDGET),
                                                  ("divide_length", divide_length, None), ("stats", stats, None))
                 if value is not default] + sorted(method_options)
        if given:
            raise ValueError(f"{', '.join(given)} given together with cache=...: the cache already fixes them "
                             "(make the cache with them, or leave cache out)")
        if getattr(cache, "get_seq_length", lambda: 0)() > 0 and not continue_cache:
            raise ValueError(f"the cache already holds {cache.get_seq_length()} tokens of an earlier generation; "
                             "call cache.reset() (or make a new cache) to generate from a new prompt, or pass "
                             "continue_cache=True to append this prompt to the conversation it holds (trikv.Session)")
        method = getattr(getattr(cache, "policy", None), "name", "cache")
    elif continue_cache:
        raise ValueError("continue_cache=True needs cache=..., the cache that holds the conversation to continue")
    method = "triattention" if method is None else method
    divide_length = DEFAULT_DIVIDE_LENGTH if divide_length is None else divide_length
    device = next(model.parameters()).device
    held = cache.get_seq_length() if continue_cache else 0
    if held:
        batch = continuation_batch(cache, tokenizer, prompts)
    else:
        batch = encode_prompts(tokenizer, prompts, chat)
    input_ids = batch["input_ids"].to(device)
    attention_mask = batch["attention_mask"].to(device)
    if cache is None:
        if method == "full" and engine == "transformers":
            if budget is not None and budget is not DEFAULT_BUDGET:
                raise ValueError(f"method 'full' keeps every entry and takes no budget (got budget={budget!r})")
            cache = DynamicCache(config=model.config)
        else:
            if stats is not None:
                method_options["stats"] = stats
            cache = make_cache(model, method, budget=budget, divide_length=divide_length, **method_options)
    lean = None
    if engine == "lean":
        from .lean import LeanEngine

        lean = LeanEngine.for_model(model)
        if isinstance(cache, CompressedCache) and cache.budget is None and cache.batch_size < 0:  # full: no doubling
            cache.reserve(input_ids.shape[1] + max_new_tokens, input_ids.shape[0], next(model.parameters()).dtype, device)
    if seed is not None:
        torch.manual_seed(seed)
    eos_ids = tokenizer.eos_token_id
    eos_ids = [] if eos_ids is None else ([eos_ids] if isinstance(eos_ids, int) else list(eos_ids))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    sampler = Sampler(do_sample, temperature, top_k, top_p, min_new_tokens, eos_ids, pad_id)
    forward = model_forward(model, cache, lean)

    rows = input_ids.shape[0]
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0) + held
    attention_mask = torch.cat([attention_mask.new_ones(rows, held), attention_mask], dim=-1)
    sequence = input_ids
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    halted_at: dict[int, int] = {}  # row -> tokens it wrote before `halt_rows` stopped it
    generated: list[torch.Tensor] = []
    step_seconds: list[float] = []
    all_logits: list[torch.Tensor] = []
    peak_bytes = peak_entries = 0
    positions = position_ids
    bar = tqdm(total=max_new_tokens, desc=f"generate[{method}]", unit="tok", disable=not progress)
    prefill_seconds = 0.0
    token = None
    for step in range(max_new_tokens):
        started = time.perf_counter()
        if step == 0:
            token, logits = prefill(forward, sampler, input_ids, positions, attention_mask, sequence, finished,
                                    prefill_chunks(cache, input_ids.shape[1]))
        else:
            token, logits = decode_one_token(forward, sampler, token, positions, attention_mask, sequence, finished, step)
        if return_logits:
            all_logits.append(logits.cpu())
        elapsed = time.perf_counter() - started
        if step == 0:
            prefill_seconds = elapsed
        else:
            step_seconds.append(elapsed)
        generated.append(token)
        sequence = torch.cat([sequence, token[:, None]], dim=-1)
        if eos_ids:
            finished |= torch.isin(token, torch.tensor(eos_ids, device=device))
        if halt_rows is not None and (step + 1) % HALT_CHECK_STEPS == 0:
            halted = torch.as_tensor(halt_rows(torch.stack(generated, dim=1)), dtype=torch.bool, device=device) & ~finished
            halted_at.update({row: step + 1 for row in halted.nonzero().flatten().tolist()})
            finished |= halted
        peak_bytes = max(peak_bytes, cache_bytes(cache))
        peak_entries = max(peak_entries, cache_entries(cache))
        bar.update(1)
        if (step + 1) % HEAP_RELEASE_STEPS == 0:  # outside the timed step: freed growing buffers would pile up
            release_free_heap()
        if bool(finished.all()):
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], dim=-1)
        positions = positions[:, -1:] + 1
    bar.close()
    remember_pending(cache, token)

    tokens = torch.stack(generated, dim=1).tolist()
    trimmed = []
    for index, row in enumerate(tokens):
        cut = halted_at.get(index, next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row)))
        trimmed.append(row[:cut])
    if isinstance(cache, CompressedCache):
        peak_bytes = max(peak_bytes, cache.peak_memory_bytes())
        peak_entries = max(peak_entries, cache.peak_length)
    return GenerationResult(
        tokens=trimmed,
        texts=[tokenizer.decode(row, skip_special_tokens=True) for row in trimmed],
        prompt_lengths=batch["attention_mask"].sum(-1).tolist(),
        prefill_seconds=prefill_seconds,
        decode_seconds=sum(step_seconds),
        steps=len(generated),
        step_seconds=step_seconds,
        final_cache_bytes=cache_bytes(cache),
        peak_cache_bytes=peak_bytes,
        final_entries=cache_entries(cache),
        peak_entries=peak_entries,
        compression_rounds=getattr(cache, "rounds", 0),
        scoring_seconds=getattr(cache, "scoring_seconds", 0.0),
        logits=all_logits if return_logits else None,
        cache=cache,
    )
