"""One configuration's decode state: a cache filled to a context, stepped and timed."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from ...compat import cache_kwargs
from .filling import Filler, fill_cache


@dataclass
class RunResult:
    engine: str
    method: str
    budget: int | None
    batch: int
    context: int
    steps: int
    tokens_per_second: float
    ms_p50: float
    ms_p99: float
    ms_max: float
    ms_mean: float
    p99_over_p50: float
    round_steps: int  # measured steps that ran a compression round
    ms_round_step_mean: float | None
    scoring_share: float  # (rounds + per-step observation) / decode time
    kv_bytes_final: int
    kv_bytes_peak: int
    kv_bytes_allocated: int
    entries_final: int
    entries_peak: int
    entries_mean: float
    bound_ms: float  # memory-bound time per token: (weights + KV read) / bandwidth
    bound_fraction: float  # bound_ms / measured mean ms (share of the machine's bandwidth achieved)
    rss_peak_mb: float  # process RSS peak while this run's group decoded (every cache of the group is alive)
    rss_group_start_mb: float = 0.0  # process RSS before the group's caches were built
    spread: bool | None = None  # TriAttention scoring ahead on/off (None: not applicable)
    speedup_vs_full: float | None = None
    bound_speedup_vs_full: float | None = None
    efficiency_vs_bound: float | None = None  # speedup / bound speed-up
    note: str = ""
    step_ms: list[float] = field(default_factory=list)


class DecodeRun:
    """A filled cache plus the decode loop of one configuration, advanced one step at a time."""

    def __init__(self, model, engine: str, method: str, budget: int | None, batch: int, context: int, filler: Filler,
                 divide_length: int, stats, fill_chunk: int, first_token: int, steps_total: int, spread: bool = True):
        from transformers import DynamicCache

        from ...cache import make_cache
        from ...fast import FastTriScorer

        self.model, self.engine, self.method, self.budget = model, engine, method, budget
        self.batch, self.context = batch, context
        device = next(model.parameters()).device
        self.spread = None
        if method == "full" and engine == "transformers":
            self.cache = DynamicCache(config=model.config)
            fill_cache(self.cache, filler, context, batch)
        else:
            options = {"stats": stats} if _needs_stats(method) else {}
            self.cache = make_cache(model, method, budget=None if method == "full" else budget,
                                    divide_length=divide_length, protect_prompt=False, **options)
            scorer = getattr(self.cache.policy, "scorer", None)
            self.spread = spread if isinstance(scorer, FastTriScorer) else None
            if self.spread is not None:
                scorer.spread = spread
            if method == "full":
                self.cache.reserve(context + steps_total, batch, next(model.parameters()).dtype, device)
                fill_cache(self.cache, filler, context, batch)
            else:
                fill_cache(self.cache, filler, context, batch, chunk=fill_chunk)
        if engine == "lean":
            from ...lean import LeanEngine

            self.lean = LeanEngine.for_model(model)
        self.tokens = torch.full((batch,), first_token, dtype=torch.long, device=device)
        self.position = context
        self.step_seconds: list[float] = []
        self.round_flags: list[bool] = []
        self.entries: list[int] = []
        self.scoring_seconds = 0.0
        self.generated: list[torch.Tensor] = []
        self.device = device

    def _overhead_seconds(self) -> float:
        return getattr(self.cache, "scoring_seconds", 0.0) + getattr(self.cache, "observe_seconds", 0.0)

    @torch.no_grad()
    def step(self, record: bool = True) -> None:
        positions = torch.full((self.batch, 1), self.position, dtype=torch.long, device=self.device)
        rounds_before = getattr(self.cache, "rounds", 0)
        overhead_before = self._overhead_seconds()
        started = time.perf_counter()
        if self.engine == "lean":
            logits = self.lean.forward(self.tokens[:, None], self.cache, position_ids=positions)[:, -1]
        else:
            logits = self.model(input_ids=self.tokens[:, None], position_ids=positions, **cache_kwargs(self.model, self.cache), logits_to_keep=1).logits[:, -1]
        self.tokens = logits.argmax(-1)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        self.position += 1
        if record:
            self.step_seconds.append(elapsed)
            self.round_flags.append(getattr(self.cache, "rounds", 0) != rounds_before)
            self.scoring_seconds += self._overhead_seconds() - overhead_before
            self.entries.append(_entries(self.cache))
            self.generated.append(self.tokens.clone())

    def result(self, weight_bytes: int, kv_token_bytes: int, bandwidth_gbps: float, rss_peak: int) -> RunResult:
        times = self.step_seconds
        ms = sorted(t * 1e3 for t in times)
        total = sum(times)
        p50 = _percentile(ms, 50)
        p99 = _percentile(ms, 99)
        round_ms = [t * 1e3 for t, flag in zip(times, self.round_flags) if flag]
        mean_entries = statistics.fmean(self.entries) if self.entries else 0.0
        bound_ms = (weight_bytes + self.batch * mean_entries * kv_token_bytes) / (bandwidth_gbps * 1e9) * 1e3
        allocated = self.cache.allocated_bytes() if hasattr(self.cache, "allocated_bytes") else self.batch * max(self.entries or [0]) * kv_token_bytes
        return RunResult(
            engine=self.engine, method=self.method, budget=self.budget if self.method != "full" else None, spread=self.spread,
            batch=self.batch, context=self.context, steps=len(times),
            tokens_per_second=self.batch * len(times) / total if total else 0.0,
            ms_p50=p50, ms_p99=p99, ms_max=ms[-1] if ms else 0.0, ms_mean=statistics.fmean(ms) if ms else 0.0,
            p99_over_p50=p99 / p50 if p50 else 0.0,
            round_steps=len(round_ms), ms_round_step_mean=statistics.fmean(round_ms) if round_ms else None,
            scoring_share=self.scoring_seconds / total if total else 0.0,
            kv_bytes_final=self.batch * (self.entries[-1] if self.entries else 0) * kv_token_bytes,
            kv_bytes_peak=self.batch * max(self.entries or [0]) * kv_token_bytes,
            kv_bytes_allocated=int(allocated),
            entries_final=self.entries[-1] if self.entries else 0, entries_peak=max(self.entries or [0]),
            entries_mean=mean_entries, bound_ms=bound_ms,
            bound_fraction=bound_ms / statistics.fmean(ms) if ms else 0.0,
            rss_peak_mb=rss_peak / 2**20, step_ms=[round(t * 1e3, 3) for t in times],
        )


def _entries(cache) -> int:
    from ...generation import cache_entries

    return cache_entries(cache)


def _needs_stats(method: str) -> bool:
    from ...policies import REGISTRY

    return REGISTRY[method].needs_stats


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an ascending list (numpy's default rule)."""
    if not sorted_values:
        return 0.0
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)
