"""Generations decoded side by side: `Decoding` is `trikv.generate`'s loop one step at a time, `interleave`
advances several of them in turn, and `paired_ratio` / `break_even_context` read their paired step times.

Why: two generations run one after the other meet different machines. A background job that starts halfway
makes the second look slower; on a shared machine that alone moves a speed ratio by tens of percent. Decoded in
alternating blocks of a few steps (the order rotated every block), they meet the same load within a block of
each other. A block keeps each run's own caches warm for several steps, as in real use, where one generation
runs alone; step by step alternation would make every step start cold.

`Decoding` gives the tokens `trikv.generate` gives for the same arguments: the same cache, prefill chunks,
sampler and seed. Each decoding keeps its own random state (swapped in around its steps, outside the timed
part), so interleaving changes nothing it samples.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import torch

from ...cache import CompressedCache, make_cache
from ...generation import (
    HEAP_RELEASE_STEPS, GenerationResult, Sampler, cache_bytes, cache_entries, decode_one_token, encode_prompts,
    model_forward, prefill, prefill_chunks, remember_pending,
)
from ...heap import release_free_heap
from ...settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH
from ...validation import integer, positive, probability

INTERLEAVE_BLOCK = 8  # steps a generation decodes back to back before the next one takes its turn
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # the interval is a fixed function of the measured times


class _RandomState:
    """The global torch random state one generation draws from, kept aside while the others run."""

    def __init__(self, seed: int, device: torch.device):
        self.cuda = device if device.type == "cuda" else None
        with torch.random.fork_rng(devices=[self.cuda] if self.cuda is not None else []):
            torch.manual_seed(seed)  # what trikv.generate does before its first step
            self.cpu_state = torch.get_rng_state()
            self.cuda_state = torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None
        self._outside = None

    def enter(self) -> None:
        self._outside = (torch.get_rng_state(), torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None)
        torch.set_rng_state(self.cpu_state)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda_state, self.cuda)

    def leave(self) -> None:
        self.cpu_state = torch.get_rng_state()
        torch.set_rng_state(self._outside[0])
        if self.cuda is not None:
            self.cuda_state = torch.cuda.get_rng_state(self.cuda)
            torch.cuda.set_rng_state(self._outside[1], self.cuda)


class Decoding:
    """One generation (one prompt or a batch) advanced a step at a time: `step()` until `done`, then `result()`.

    The arguments are `trikv.generate`'s (a cache is always made here; `tokenizer=None` takes prompts as token ids
    and decodes no text). Besides the `GenerationResult`, it records per decode step its context (`contexts`: the
    logical tokens it attends to, the new one included, of the longest row: what a full cache then holds) and the
    time the cache spent in rounds during the step (`round_seconds`: scoring, selection, compaction and scoring
    ahead, the cache's own `scoring_seconds` clock; the step's time includes it).
    """

    def __init__(self, model, tokenizer, prompts, method: str | None = None, budget: int | None = DEFAULT_BUDGET,
                 stats=None, max_new_tokens: int = 256, min_new_tokens: int = 0, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = 0, chat: bool = True,
                 divide_length: int | None = None, engine: str = "lean", **method_options):
        from transformers import DynamicCache

        if engine not in ("transformers", "lean"):
            raise ValueError(f"unknown engine {engine!r}; expected 'transformers' or 'lean'")
        self.max_new_tokens = integer("max_new_tokens", max_new_tokens)
        min_new_tokens = integer("min_new_tokens", min_new_tokens, minimum=0)
        top_k = integer("top_k", top_k, minimum=0)
        if do_sample:
            temperature, top_p = positive("temperature", temperature), probability("top_p", top_p)
        self.method = "triattention" if method is None else method
        divide_length = DEFAULT_DIVIDE_LENGTH if divide_length is None else divide_length
        self.tokenizer = tokenizer
        tokens = tokenizer if tokenizer is not None else SimpleNamespace(pad_token_id=0, eos_token_id=None)
        device = next(model.parameters()).device
        batch = encode_prompts(tokens, prompts, chat)
        self.prompt_lengths = batch["attention_mask"].sum(-1).tolist()
        input_ids = batch["input_ids"].to(device)
        attention_mask = batch["attention_mask"].to(device)
        if self.method == "full" and engine == "transformers":
            if budget is not None and budget is not DEFAULT_BUDGET:
                raise ValueError(f"method 'full' keeps every entry and takes no budget (got budget={budget!r})")
            self.cache = DynamicCache(config=model.config)
        else:
            if stats is not None:
                method_options["stats"] = stats
            self.cache = make_cache(model, self.method, budget=budget, divide_length=divide_length, **method_options)
        lean = None
        if engine == "lean":
            from ...lean import LeanEngine

            lean = LeanEngine.for_model(model)
            if isinstance(self.cache, CompressedCache) and self.cache.budget is None:  # full: one allocation
                self.cache.reserve(input_ids.shape[1] + self.max_new_tokens, input_ids.shape[0],
                                   next(model.parameters()).dtype, device)
        self.random = _RandomState(seed, device) if do_sample and seed is not None else None
        eos = tokens.eos_token_id
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad_id = tokens.pad_token_id if tokens.pad_token_id is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.sampler = Sampler(do_sample, temperature, top_k, top_p, min_new_tokens, self.eos_ids, pad_id)
        self.forward = model_forward(model, self.cache, lean)
        self.device = device
        self.input_ids = input_ids
        self.rows = input_ids.shape[0]
        self.positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        self.attention_mask = attention_mask
        self.sequence = input_ids
        self.finished = torch.zeros(self.rows, dtype=torch.bool, device=device)
        self.eos_tensor = torch.tensor(self.eos_ids, device=device) if self.eos_ids else None
        self.generated: list[torch.Tensor] = []
        self.token: torch.Tensor | None = None
        self.prefill_seconds = 0.0
        self.step_seconds: list[float] = []  # decode steps (the prefill excluded), as GenerationResult has them
        self.round_seconds: list[float] = []  # of each decode step, the part the cache spent in rounds
        self.contexts: list[int] = []  # tokens each decode step attends to, the new one included
        self.rounds_after: list[int] = []  # the cache's round count after each decode step
        self.prefill_rounds = 0
        self.peak_bytes = self.peak_entries = 0
        self.busy_seconds = 0.0  # everything step() did for this generation (its wall time when interleaved)
        self.done = False

    def _rounds_clock(self) -> float:
        return getattr(self.cache, "scoring_seconds", 0.0)

    @torch.no_grad()
    def step(self) -> None:
        """The next step: the prefill first, then one token per row."""
        if self.done:
            raise RuntimeError("this generation is done")
        entered = time.perf_counter()
        step = len(self.generated)
        if self.random is not None:
            self.random.enter()
        clock_before = self._rounds_clock()
        context = self.attention_mask.shape[1]
        started = time.perf_counter()
        if step == 0:
            token, _ = prefill(self.forward, self.sampler, self.input_ids, self.positions, self.attention_mask,
                               self.sequence, self.finished, prefill_chunks(self.cache, self.input_ids.shape[1]))
        else:
            token, _ = decode_one_token(self.forward, self.sampler, self.token, self.positions, self.attention_mask,
                                        self.sequence, self.finished, step)
        elapsed = time.perf_counter() - started
        if self.random is not None:
            self.random.leave()
        rounds = getattr(self.cache, "rounds", 0)
        if step == 0:
            self.prefill_seconds = elapsed
            self.prefill_rounds = rounds
        else:
            self.step_seconds.append(elapsed)
            self.round_seconds.append(self._rounds_clock() - clock_before)
            self.contexts.append(context)
            self.rounds_after.append(rounds)
        self.token = token
        self.generated.append(token)
        self.sequence = torch.cat([self.sequence, token[:, None]], dim=-1)
        if self.eos_tensor is not None:
            self.finished |= torch.isin(token, self.eos_tensor)
        self.peak_bytes = max(self.peak_bytes, cache_bytes(self.cache))
        self.peak_entries = max(self.peak_entries, cache_entries(self.cache))
        if (step + 1) % HEAP_RELEASE_STEPS == 0:  # outside the timed step, as trikv.generate does it
            release_free_heap()
        if bool(self.finished.all()) or len(self.generated) == self.max_new_tokens:
            self.done = True
            remember_pending(self.cache, token)
        else:
            self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(self.rows, 1)], dim=-1)
            self.positions = self.positions[:, -1:] + 1
        self.busy_seconds += time.perf_counter() - entered

    def result(self) -> GenerationResult:
        """What `trikv.generate` returns for this generation (call when `done`)."""
        tokens = torch.stack(self.generated, dim=1).tolist()
        trimmed = [row[: next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), len(row))] for row in tokens]
        peak_bytes, peak_entries = self.peak_bytes, self.peak_entries
        if isinstance(self.cache, CompressedCache):
            peak_bytes = max(peak_bytes, self.cache.peak_memory_bytes())
            peak_entries = max(peak_entries, self.cache.peak_length)
        texts = ([self.tokenizer.decode(row, skip_special_tokens=True) for row in trimmed] if self.tokenizer is not None
                 else ["" for _ in trimmed])
        return GenerationResult(
            tokens=trimmed, texts=texts, prompt_lengths=self.prompt_lengths, prefill_seconds=self.prefill_seconds,
            decode_seconds=sum(self.step_seconds), steps=len(self.generated), step_seconds=list(self.step_seconds),
            final_cache_bytes=cache_bytes(self.cache), peak_cache_bytes=peak_bytes,
            final_entries=cache_entries(self.cache), peak_entries=peak_entries,
            compression_rounds=getattr(self.cache, "rounds", 0), scoring_seconds=self._rounds_clock(), cache=self.cache,
        )


def interleave(decodings: list[Decoding], block: int = INTERLEAVE_BLOCK, on_block=None) -> None:
    """Advance every decoding to its end, `block` steps each in turn; the order rotates by one every block (for two:
    A B, B A, A B, ...), so neither always runs first. `on_block(steps)` is called after each round of turns."""
    if block < 1:
        raise ValueError(f"block must be a positive number of steps, got {block}")
    turn = 0
    while not all(d.done for d in decodings):
        shift = turn % len(decodings)
        done_before = sum(len(d.generated) for d in decodings)
        for decoding in decodings[shift:] + decodings[:shift]:
            for _ in range(block):
                if decoding.done:
                    break
                decoding.step()
        if on_block is not None:
            on_block(sum(len(d.generated) for d in decodings) - done_before)
        turn += 1


def paired_blocks(reference: list[float], other: list[float], block: int = INTERLEAVE_BLOCK) -> torch.Tensor:
    """[blocks, 2] seconds of the decode steps both runs made, summed per turn of `interleave` (decode step s, the
    prefill being step 0, falls in turn s // block)."""
    steps = min(len(reference), len(other))
    times = torch.tensor([reference[:steps], other[:steps]], dtype=torch.float64).T  # [steps, 2]
    turns = (torch.arange(steps) + 1) // block
    sums = torch.zeros(int(turns[-1]) + 1 if steps else 0, 2, dtype=torch.float64)
    return sums.index_add_(0, turns, times) if steps else sums


def paired_ratio(reference: list[float], other: list[float], block: int = INTERLEAVE_BLOCK, level: float = 0.95,
                 resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """(ratio, low, high): the reference run's decode time over the other's, on the steps both made (the other's
    speed-up when both decoded as many tokens), with a percentile bootstrap interval over paired blocks (the
    blocks are resampled with both runs' times together, so load that hit both cancels)."""
    blocks = paired_blocks(reference, other, block)
    if len(blocks) == 0 or float(blocks[:, 1].sum()) <= 0:
        return math.nan, math.nan, math.nan
    ratio = float(blocks[:, 0].sum() / blocks[:, 1].sum())
    if len(blocks) < 2:
        return ratio, math.nan, math.nan
    generator = torch.Generator().manual_seed(BOOTSTRAP_SEED)
    picks = torch.randint(len(blocks), (resamples, len(blocks)), generator=generator)
    sums = blocks[picks].sum(1)  # [resamples, 2]
    ratios = sums[:, 0] / sums[:, 1]
    tail = (1 - level) / 2
    low, high = torch.quantile(ratios, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return ratio, low, high


def break_even_context(contexts: list[int], reference: list[float], bounded: list[float], bounded_from: int,
                       block: int = INTERLEAVE_BLOCK) -> float | None:
    """The context from which a step of the reference (full attention) costs more than a step of the bounded cache,
    rounds included, from two interleaved runs: per paired block from the bounded cache's first round on (decode
    step `bounded_from`), the ratio reference time / bounded time is fitted as a + b * context (least squares) and
    solved for 1. The bounded cache's step costs about the same at every context after its first round and the
    reference's grows with its entries, so the ratio grows along a line; a ratio, unlike either time, does not
    drift with the machine's load. Rounds stay in the blocks they fell in, so the fit spreads their cost.

    Where the ratio does not grow with the context by more than twice the slope's standard error, the line is flat
    within the noise and places no crossing: if the ratios after the first round are above 1 by more than twice
    their standard error, the bound pays from its first round (its context is returned), otherwise None. None too
    when fewer than 3 blocks follow the first round."""
    steps = min(len(contexts), len(reference), len(bounded))
    blocks = paired_blocks(reference[:steps], bounded[:steps], block)
    turns = (torch.arange(steps) + 1) // block
    first_turn = int(turns[bounded_from]) + 1 if bounded_from < steps else len(blocks)  # whole blocks after it
    if len(blocks) - first_turn < 3:
        return None
    counts = torch.bincount(turns, minlength=len(blocks)).double()
    mean_context = torch.zeros(len(blocks), dtype=torch.float64).index_add_(
        0, turns, torch.tensor(contexts[:steps], dtype=torch.float64)) / counts.clamp_min(1)
    x = mean_context[first_turn:]
    y = blocks[first_turn:, 0] / blocks[first_turn:, 1]
    spread = ((x - x.mean()) ** 2).sum()
    if float(spread) <= 0:
        return None
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / spread)
    intercept = float(y.mean()) - slope * float(x.mean())
    residual = y - (intercept + slope * x)
    standard_error = math.sqrt(float((residual ** 2).sum()) / max(len(x) - 2, 1) / float(spread))
    if slope <= 2 * standard_error or slope * float(x.max() - x.min()) < 1e-6:
        mean_error = float(y.std()) / math.sqrt(len(y))
        return float(contexts[bounded_from]) if float(y.mean()) - 2 * mean_error > 1 else None
    return (1.0 - intercept) / slope


def first_round_step(decoding: Decoding) -> int | None:
    """Index (into the decode steps) of the first decode step in which the cache ran a round (None: none did)."""
    return next((index for index, rounds in enumerate(decoding.rounds_after) if rounds > decoding.prefill_rounds), None)
