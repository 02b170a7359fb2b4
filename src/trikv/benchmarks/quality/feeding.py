"""Teacher-forced feeding of known tokens through a trikv cache, in as few forwards as the schedule allows.

Under a round-based schedule the cache only changes in the decoder's pre-hook, before a forward, when it
holds budget + divide_length live entries. Feeding the next tokens in one forward, cut so that no forward
crosses that threshold, therefore sees exactly the caches that one-token steps would see, and gives the
same logits (up to float summation order). The plan:

* the prompt goes in one forward (as `generate()` prefills a prompt that fits the slack), or in the cache's
  prefill chunks with rounds between them (`prompt_chunks=True`: how trikv prefills a longer prompt);
* every later forward holds at most `room` tokens, room = budget + divide_length - (live entries after the
  pre-hook's round, if one is due), and at most `max_chunk`;
* after the prompt the cache is told it is decoding, so the later chunks are not counted as prompt.

Policies that change their state with every decode token but do not observe multi-token forwards
(`observes and not observe_prefill`, e.g. LazyEviction, RaaS) are fed one token per forward.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ...cache import CompressedCache
from ...compat import cache_kwargs


def needs_single_steps(cache) -> bool:
    """True when chunked feeding would not reproduce one-token decoding for this cache's policy."""
    if not isinstance(cache, CompressedCache):
        return False
    policy = cache.policy
    if getattr(policy, "teacher_forcing_chunks", None) is not None:  # an explicit declaration wins
        return not policy.teacher_forcing_chunks
    return bool(getattr(policy, "observes", False)) and not bool(getattr(policy, "observe_prefill", False))


def _live(cache: CompressedCache) -> int:
    return cache.schedule.live_before_due(cache.length)


def room(cache, max_chunk: int) -> int:
    """Tokens the next forward may hold without crossing a compression threshold."""
    if not isinstance(cache, CompressedCache) or cache.budget is None or cache.batch_size < 0:
        return max_chunk
    if needs_single_steps(cache):
        return 1
    live = _live(cache)
    threshold = cache.budget + cache.divide_length
    if live >= threshold:  # the pre-hook will compress to the budget first
        live = cache.budget
    return max(1, min(max_chunk, threshold - live))


@dataclass
class FeedLog:
    """What happened during feeding: the forwards' spans, and when compression rounds ran."""

    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) token index of every forward
    round_times: list[int] = field(default_factory=list)  # logical index (tokens seen) at each round
    evict_time: torch.Tensor | None = None  # [L, b, Hkv, T] int: first token index whose forward no longer saw key j


class Feeder:
    """Feeds known tokens [b, n] through `model` with `cache`, returning the logits wanted.

    `track_evictions=T` records, for every key position j < T, the first query index whose forward no
    longer had j in the cache (T = never evicted within the text): the basis of attention recall.
    """

    def __init__(self, model, cache, max_chunk: int = 256, track_evictions: int | None = None):
        self.model, self.cache, self.max_chunk = model, cache, max_chunk
        self.seen = 0
        self.log = FeedLog()
        self.track = track_evictions
        self._rounds_before = 0

    @torch.no_grad()
    def feed(
        self,
        input_ids: torch.Tensor,
        want_logits: bool | slice = True,
        attention_mask: torch.Tensor | None = None,
        prompt: bool = False,
        on_logits=None,
        prompt_chunks: bool = False,
    ) -> torch.Tensor | None:
        """Feed input_ids [b, n] (appended after what was fed before). `prompt=True`: the prompt, in one forward, or
        with `prompt_chunks` in the forwards `CompressedCache.chunk_bounds` gives (chunks of its prefill_chunk_size
        with a round before any chunk that finds the cache at budget + divide_length).

        want_logits: True (every position), False (none), or a slice of positions of this call.
        on_logits(start, logits): called per forward with the logits [b, c, V] of tokens start.. (absolute
        index), instead of collecting them (saves memory on long texts).
        Returns the collected logits [b, n', V] (float32) or None.
        """
        device = next(self.model.parameters()).device
        input_ids = input_ids.to(device)
        b, n = input_ids.shape
        wanted = _wanted_range(want_logits, n)
        collected = []
        offset = 0
        chunks = None
        if prompt and prompt_chunks and isinstance(self.cache, CompressedCache):
            chunks = [stop - start for start, stop in self.cache.chunk_bounds(n)]
        while offset < n:
            if chunks:
                count = chunks.pop(0)
            elif prompt:
                count = n
            else:
                count = min(n - offset, room(self.cache, self.max_chunk))
            start, end = self.seen, self.seen + count
            positions = torch.arange(start, end, device=device)[None].expand(b, count)
            keep = None
            if wanted is not None:
                lo, hi = max(wanted[0], offset), min(wanted[1], offset + count)
                keep = (lo, hi) if hi > lo else None
            logits_to_keep = 1 if keep is None else (offset + count - keep[0])
            rounds_before = getattr(self.cache, "rounds", 0)
            out = self.model(
                input_ids=input_ids[:, offset : offset + count],
                position_ids=positions,
                attention_mask=attention_mask,
                **cache_kwargs(self.model, self.cache),
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
            if isinstance(self.cache, CompressedCache):
                if not self.cache.decoding and not chunks:
                    self.cache.decoding = True  # later forwards are decode steps, not prompt
                if self.cache.rounds != rounds_before:
                    self.log.round_times.append(start)
                if not prompt:  # a prompt's forward holds up to one chunk past the trigger
                    self._check_threshold()
                if self.track is not None:
                    self._track(start, end)
            self.log.spans.append((start, end))
            if keep is not None:
                logits = out.logits[:, : keep[1] - keep[0]].float()
                if on_logits is not None:
                    on_logits(start + (keep[0] - offset), logits)
                else:
                    collected.append(logits.cpu())
            self.seen = end
            offset += count
            prompt = bool(chunks)
        if on_logits is not None or not collected:
            return None
        return torch.cat(collected, dim=1)

    def _check_threshold(self) -> None:
        cache = self.cache
        if cache.budget is not None and _live(cache) > cache.budget + cache.divide_length and cache.rounds > 0:
            raise RuntimeError("teacher-forced feeding overshot the compression threshold (schedule changed?)")

    def _track(self, start: int, end: int) -> None:
        cache = self.cache
        positions = cache.visible_positions()  # [L, b, Hkv, P]
        L, b, H, _ = positions.shape
        if self.log.evict_time is None:
            self.log.evict_time = torch.full((L, b, H, self.track), self.track, dtype=torch.int32)
            self._present = torch.zeros(L, b, H, self.track, dtype=torch.bool)
        present = torch.zeros(L, b, H, self.track + 1, dtype=torch.bool)
        index = positions.clamp(min=-1, max=self.track - 1)
        index = torch.where(index < 0, torch.full_like(index, self.track), index).cpu()
        present.scatter_(3, index, True)
        present = present[..., : self.track]
        # keys that were present before this forward and are gone now were evicted at its start
        gone = self._present & ~present
        self.log.evict_time[gone & (self.log.evict_time == self.track)] = start
        self._present = present

    def fork(self) -> "Feeder":
        """An independent copy (cache and policy state included) to try a continuation on."""
        twin = Feeder.__new__(Feeder)
        twin.model, twin.max_chunk, twin.seen, twin.track = self.model, self.max_chunk, self.seen, None
        twin.cache = clone_cache(self.cache)
        twin.log = FeedLog(list(self.log.spans), list(self.log.round_times))
        twin._rounds_before = 0
        return twin


def clone_cache(cache):
    """Deep copy of a trikv CompressedCache or a transformers cache (tensors copied)."""
    return copy.deepcopy(cache)


def _wanted_range(want_logits, n: int) -> tuple[int, int] | None:
    if want_logits is True:
        return (0, n)
    if want_logits is False or want_logits is None:
        return None
    start, stop, _ = want_logits.indices(n)
    return (start, stop) if stop > start else None
