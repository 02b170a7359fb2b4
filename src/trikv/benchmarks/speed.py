"""`trikv bench speed`: decode throughput, latency and memory vs context length, methods and budgets.

What is measured, per (engine, method, budget, batch size, context length):
  decode tokens/s, time per token p50 / p99 / max, the share of decode time spent in compression rounds
  (scoring + selection + compaction, `CompressedCache.scoring_seconds`, plus per-step observation for
  policies that have one), KV-cache bytes (final and peak over the measured steps), the process RSS, and
  the speed-up over full attention of the same engine, batch and context, measured side by side: the
  configurations of one (engine, batch, context) group decode in lockstep, one step each in turn, so
  machine noise hits them alike.

Next to every speed-up the memory-bound bound is printed: on a machine that streams B bytes/s, a decode
step cannot take less than (weight bytes + KV bytes read) / B; the bound on the speed-up of a bounded
cache over full attention is the ratio of these times. B is measured at the start of the run and again
before each group (best of a streaming reduction and a large fp32 GEMV, best over repeats; the bound uses
the higher of the two probes, so it is the most optimistic time this machine allows).

How the context is filled: decode speed does not depend on what the cached keys say, so instead of
generating C tokens the cache is filled directly: a real prefill of `seed_tokens` (default 512) tokens of a
shipped English text gives the model's own post-RoPE keys and values; they are tiled to C positions, each
key re-rotated to its true position (band f multiplied by e^{i w_f (p - p_src)}), row r of a batch starting
the tiling at a different offset. Bounded caches are filled in chunks, so their rounds run as the
context grows (the cache never holds more than budget + slack + one chunk); full attention gets one
preallocated buffer. The prompt is not protected (the filled context stands for generated text). Every
measured step is then a real model forward on the model's own greedy token.

Engines: "lean" (trikv's plain-PyTorch decoder, `trikv.lean`) and "transformers" (the model's own forward;
full attention there is transformers' DynamicCache). llama.cpp (`llama-cpp-python`, optional) decodes the
bundled GGUF at the same context lengths with its full cache, batch 1, in the same run.
"""

from __future__ import annotations

import csv
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from ..compat import cache_kwargs

DEFAULT_CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768]
DEFAULT_BUDGETS = [256, 512, 1024, 2048]


# ---------------------------------------------------------------------------------------------------------
# machine facts
# ---------------------------------------------------------------------------------------------------------
def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> dict:
    """Memory read bandwidth in GB/s: a streaming sum and an fp32 GEMV (what a decode step does), best of n."""
    n = megabytes * 2**20 // 4
    data = torch.ones(n)
    rows = 4096
    matrix = data[: (n // rows) * rows].view(rows, -1)
    vector = torch.ones(1, rows)

    def best(fn, nbytes):
        fn()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return nbytes / min(times) / 1e9

    read = best(lambda: data.sum(), data.nbytes)
    gemv = best(lambda: vector @ matrix, matrix.nbytes)  # x @ W with W [in, out] row-major: the lean engine's layout
    return {"read_gbps": round(read, 2), "gemv_gbps": round(gemv, 2), "gbps": round(max(read, gemv), 2), "megabytes": megabytes}


def current_rss() -> int:
    """Resident set size of this process in bytes (Linux /proc; psutil or ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc malloc_trim), so the next group's RSS starts from what is live."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss() -> int:
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads: every matrix once, the embedding one row (a tied lm_head reads it whole)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total -= embed.numel() * embed.element_size()
    if head.data_ptr() == embed.data_ptr():
        total += head.numel() * head.element_size()
    return total


def kv_bytes_per_token(model, dtype=None) -> int:
    """K + V bytes of one cached token over all layers and KV heads (per batch row)."""
    from ..architectures import model_shape

    shape = model_shape(model)
    element = torch.finfo(dtype or next(model.parameters()).dtype).bits // 8
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * element


# ---------------------------------------------------------------------------------------------------------
# filling a cache with C tokens of the model's own keys
# ---------------------------------------------------------------------------------------------------------
@dataclass
class SeedKV:
    keys: list[torch.Tensor]  # per layer [Hkv, S, D] post-RoPE at positions 0..S-1
    values: list[torch.Tensor]
    token_ids: list[int]  # the seed tokens (the first decode input is taken from them)
    queries: list[torch.Tensor] | None = None  # per layer [Hq, S, D] post-RoPE (for policies that read queries)

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]


def seed_text_ids(tokenizer, vocab_size: int, length: int) -> list[int]:
    """`length` token ids of a shipped English text (random ids when there is no tokenizer)."""
    if tokenizer is not None:
        text_dir = Path(__file__).resolve().parents[1] / "data" / "analysis_texts"
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(text_dir.glob("*.txt")))
        ids = tokenizer(text)["input_ids"]
        while len(ids) < length:
            ids = ids + ids
        return list(ids[:length])
    generator = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab_size, (length,), generator=generator).tolist()


@torch.no_grad()
def make_seed(model, tokenizer=None, length: int = 512) -> SeedKV:
    """A real prefill of `length` tokens: the model's own post-RoPE keys and values of every layer."""
    from transformers import DynamicCache

    from ..qk_capture import capture_pre_rope
    from ..geometry import RopeGeometry

    ids = seed_text_ids(tokenizer, model.config.vocab_size, length)
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    pre_rope: dict[int, torch.Tensor] = {}
    with capture_pre_rope(model, lambda layer, q, k: pre_rope.__setitem__(layer, q[0].detach().clone())):
        model(input_ids=torch.tensor([ids], device=device), **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    keys = [layer.keys[0].clone() for layer in cache.layers]
    values = [layer.values[0].clone() for layer in cache.layers]
    geometry = RopeGeometry.from_model(model)
    positions = torch.arange(length, device=device)
    queries = [geometry.rotate(pre_rope[layer], positions) for layer in range(len(keys))]
    return SeedKV(keys, values, ids, queries)


class Filler:
    """Tiles a seed to any positions, re-rotating each key from its seed position to its true one."""

    def __init__(self, model, seed: SeedKV):
        from ..geometry import RopeGeometry

        self.seed = seed
        self.geometry = RopeGeometry.from_model(model)

    def _rotated(self, seed: torch.Tensor, source: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """seed [H, S, D] post-RoPE rows `source`, rotated from their seed positions to `positions`."""
        x = seed.index_select(1, source).float()
        device = x.device
        delta = (positions - source).double().cpu()
        angle = delta[:, None] * self.geometry.omega[None, :]  # [count, F]
        cos, sin = angle.cos().float().to(device), angle.sin().float().to(device)
        ri, ii = self.geometry.real_index.to(device), self.geometry.imag_index.to(device)
        xr, xi = x.index_select(-1, ri), x.index_select(-1, ii)
        out = torch.empty_like(x)
        out[..., ri] = xr * cos - xi * sin
        out[..., ii] = xr * sin + xi * cos
        return out.to(seed.dtype)

    def block(self, layer: int, start: int, count: int, batch: int, with_queries: bool = False):
        """Keys and values [batch, Hkv, count, D] for positions start .. start+count-1 of `layer`
        (and queries [batch, Hq, count, D] when asked)."""
        seed_k, seed_v = self.seed.keys[layer], self.seed.values[layer]
        S = seed_k.shape[1]
        positions = torch.arange(start, start + count, device=seed_k.device)
        keys, values, queries = [], [], []
        for row in range(batch):
            source = (positions + 97 * row) % S
            keys.append(self._rotated(seed_k, source, positions))
            values.append(seed_v.index_select(1, source))
            if with_queries:
                queries.append(self._rotated(self.seed.queries[layer], source, positions))
        if with_queries:
            return torch.stack(keys), torch.stack(values), torch.stack(queries)
        return torch.stack(keys), torch.stack(values)


def fill_cache(cache, filler: Filler, context: int, batch: int, chunk: int | None = None) -> None:
    """Append `context` tokens of tiled seed keys/values to a trikv CompressedCache or a DynamicCache,
    through the caches' public update path (a bounded cache compresses between chunks as it fills)."""
    from ..cache import CompressedCache

    from ..query_capture import _Tap, want_queries

    num_layers = len(filler.seed.keys)
    compressed = isinstance(cache, CompressedCache)
    wants_queries = compressed and cache.query_window is not None  # policies that score with live queries
    if chunk is None:
        chunk = context
    start = 0
    try:
        while start < context:
            count = min(chunk, context - start)
            if compressed:
                cache.before_forward(count, None)
            for layer in range(num_layers):
                if wants_queries:
                    k, v, _Tap.query = filler.block(layer, start, count, batch, with_queries=True)
                else:
                    k, v = filler.block(layer, start, count, batch)
                cache.update(k, v, layer)
            start += count
    finally:
        if wants_queries:
            want_queries(False)
    if compressed and cache.budget is not None and cache.length - getattr(cache, "_excess_slots", 0) >= cache.budget + cache.divide_length:
        cache.compress()  # the round the next forward would run: do it now, so a filled cache holds ~budget entries


# ---------------------------------------------------------------------------------------------------------
# one configuration's decode state
# ---------------------------------------------------------------------------------------------------------
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

        from ..cache import make_cache
        from ..fast import FastTriScorer

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
            from ..lean import LeanEngine

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
    from ..generation import cache_entries

    return cache_entries(cache)


def _needs_stats(method: str) -> bool:
    from ..policies import REGISTRY

    return REGISTRY[method].needs_stats


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an ascending list (numpy's default rule)."""
    if not sorted_values:
        return 0.0
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


# ---------------------------------------------------------------------------------------------------------
# llama.cpp (optional peer)
# ---------------------------------------------------------------------------------------------------------
def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class LlamaCppResult:
    context: int
    steps: int
    tokens_per_second: float
    ms_p50: float
    ms_p99: float
    ms_max: float
    ms_mean: float
    bound_ms: float
    bound_fraction: float
    weight_bytes: int
    kv_bytes: int
    n_threads: int
    step_ms: list[float] = field(default_factory=list)


class LlamaCppPeer:
    """The same model's GGUF in llama.cpp, full KV cache (f16), batch 1, one context grown in place."""

    def __init__(self, gguf_path: str, max_context: int, n_threads: int, seed_ids: list[int]):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=max_context, n_threads=n_threads,
                                   n_threads_batch=n_threads, n_batch=512, verbose=False)
        self.n_threads = n_threads
        self.n_vocab = self.llm.n_vocab()
        self.gguf_bytes = Path(gguf_path).stat().st_size
        self.seed_ids = seed_ids
        self.filled = 0
        import numpy

        self._np = numpy

    def _ids(self, start: int, end: int) -> list[int]:
        S = len(self.seed_ids)
        return [self.seed_ids[i % S] for i in range(start, end)]

    def fill_to(self, context: int) -> None:
        """Evaluate prompt tokens up to `context` (earlier contexts are kept; decode steps are removed)."""
        self.llm.n_tokens = self.filled  # drops the decode steps of the previous context (eval removes them from the KV)
        self.llm.eval(self._ids(self.filled, context))
        self.filled = context

    def next_token(self) -> int:
        logits = self._np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return int(logits.argmax())

    def step(self) -> float:
        token = self.next_token()
        started = time.perf_counter()
        self.llm.eval([token])
        return time.perf_counter() - started

    def kv_bytes(self, tokens: int, model) -> int:
        return kv_bytes_per_token(model, torch.float16) * tokens

    def close(self) -> None:
        try:
            self.llm.close()
        except AttributeError:
            pass


# ---------------------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------------------
@dataclass
class SpeedConfig:
    model: str = "smollm2-135m"
    contexts: list[int] = field(default_factory=lambda: list(DEFAULT_CONTEXTS))
    methods: list[str] = field(default_factory=lambda: ["full", "triattention"])
    budgets: list[int] = field(default_factory=lambda: list(DEFAULT_BUDGETS))
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4])
    engines: list[str] = field(default_factory=lambda: ["lean"])
    steps: int = 256
    warmup: int = 4
    divide_length: int = 128
    seed_tokens: int = 512
    fill_chunk: int = 1024
    threads: int | None = None
    stats: str | None = None
    llama_cpp: bool = True
    llama_cpp_threads: int | None = None
    engine_check: bool = True  # lean vs transformers, identical greedy tokens, at the context nearest 2K
    engine_check_steps: int = 48
    max_kv_gb: float = 8.0  # skip (and say so) configurations whose KV cache would exceed this
    out: str = "bench-speed"
    progress: bool = True
    bandwidth_mb: int = 512  # size of the bandwidth probe
    spread: str = "on"  # TriAttention scores ahead between rounds (trikv.fast): on, off (all scoring at the round) or both
    command: str = ""  # the command line that started the run (recorded in speed.json)


def _log(message: str, config: SpeedConfig) -> None:
    if config.progress:
        print(message, file=sys.stderr, flush=True)


def _load(config: SpeedConfig):
    from .. import load_model

    model, tokenizer = load_model(config.model)
    return model, tokenizer


def _load_stats(config: SpeedConfig, model):
    from ..calibration import load_stats

    if not any(_needs_stats(m) for m in config.methods if m != "full"):
        return None
    return load_stats(config.stats or config.model, model)


def run_speed(config: SpeedConfig, model=None, tokenizer=None, stats=None) -> dict:
    """Run the grid; returns the JSON-able record (also written to `config.out` with CSV, PNG and table)."""
    from ..policies import REGISTRY

    for method in config.methods:
        if method not in REGISTRY:
            raise ValueError(f"unknown method {method!r}; available: {', '.join(REGISTRY)}")
    for engine in config.engines:
        if engine not in ("lean", "transformers"):
            raise ValueError(f"unknown engine {engine!r}; expected lean or transformers")
    if config.threads:
        torch.set_num_threads(config.threads)
    if model is None:
        model, tokenizer = _load(config)
    if stats is None:
        stats = _load_stats(config, model)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    _log(f"[speed] measuring memory bandwidth ({torch.get_num_threads()} threads) ...", config)
    bandwidth = measure_bandwidth(config.bandwidth_mb)
    bandwidth["per_group"] = []
    weight_bytes = weight_bytes_per_step(model)
    kv_token = kv_bytes_per_token(model)
    _log(f"[speed] bandwidth {bandwidth['gbps']} GB/s; weights read per step {weight_bytes / 1e6:.1f} MB; "
         f"KV {kv_token / 1e3:.1f} kB per cached token", config)
    from ..lean import stock_layout_copy

    # the lean engine re-points the model's weights to its faster layout; transformers runs get the layout it loads
    stock = stock_layout_copy(model) if "transformers" in config.engines else None
    seed = make_seed(model, tokenizer, config.seed_tokens)
    filler = Filler(model, seed)
    first_token = seed.token_ids[-1]
    results: list[RunResult] = []
    skipped: list[str] = []
    methods = [m for m in config.methods if m != "full"]
    include_full = "full" in config.methods
    steps_total = config.steps + config.warmup
    for batch in config.batch_sizes:
        for context in config.contexts:
            for engine in config.engines:
                spreads = {"on": [True], "off": [False], "both": [True, False]}[config.spread]
                specs = ([("full", None, True)] if include_full else []) + [
                    (m, b, sp) for m in methods for b in config.budgets for sp in spreads]
                runs: list[DecodeRun] = []
                release_free_memory()
                baseline_rss = current_rss()
                group_gb = 0.0  # KV the group's caches hold during decoding (they all live at once)
                for method, budget, spread in specs:
                    if method == "full":
                        steady = transient = context + steps_total
                    else:
                        steady = min(context + steps_total, budget + config.divide_length)
                        transient = min(context + steps_total, budget + config.divide_length + config.fill_chunk)
                    needed = group_gb + batch * transient * kv_token / 1e9
                    if needed > config.max_kv_gb:
                        skipped.append(f"{engine} {_label({'method': method, 'budget': budget, 'spread': spread})} "
                                       f"batch={batch} ctx={context}: KV of the group would reach {needed:.1f} GB > "
                                       f"--max-kv-gb {config.max_kv_gb}")
                        _log(f"[speed] skip: {skipped[-1]}", config)
                        continue
                    group_gb += batch * steady * kv_token / 1e9
                    _log(f"[speed] fill {engine} {method} B={budget} batch={batch} ctx={context}", config)
                    runs.append(DecodeRun(stock if engine == "transformers" else model, engine, method, budget, batch, context,
                                          filler, config.divide_length, stats, config.fill_chunk, first_token,
                                          steps_total, spread=spread))
                if not runs:
                    continue
                rss_peak = current_rss()
                group_bandwidth = measure_bandwidth(config.bandwidth_mb, repeats=3)["gbps"]  # the machine now
                bandwidth["per_group"].append({"engine": engine, "batch": batch, "context": context, "gbps": group_bandwidth})
                for step in range(steps_total):
                    order = runs[step % len(runs):] + runs[: step % len(runs)]  # rotate who goes first
                    for run in order:
                        run.step(record=step >= config.warmup)
                    rss_peak = max(rss_peak, current_rss())
                group = [run.result(weight_bytes, kv_token, max(group_bandwidth, bandwidth["gbps"]), rss_peak) for run in runs]
                for r in group:
                    r.rss_group_start_mb = baseline_rss / 2**20
                _fill_ratios(group)
                for r in group:
                    _log(f"[speed]   {_short(r)}", config)
                results.extend(group)
                (out / "speed.partial.json").write_text(json.dumps({"results": [asdict(r) for r in results], "skipped": skipped,
                                                                    "bandwidth": bandwidth}, indent=1))
                del runs
                release_free_memory()
                _log(f"[speed] RSS {baseline_rss / 2**20:.0f} -> peak {rss_peak / 2**20:.0f} MiB", config)
    engine_check = None
    if config.engine_check and set(config.engines) >= {"lean", "transformers"}:
        engine_check = compare_engines(model, filler, first_token, stats, config, weight_bytes, kv_token, bandwidth["gbps"], stock)
    peer = run_llama_cpp(config, model, seed, filler, results, weight_bytes, bandwidth["gbps"])
    record = {
        "command": config.command,
        "config": asdict(config),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "bandwidth": bandwidth, "cpu_count": os.cpu_count()},
        "model": {"name": config.model, "weight_bytes_per_step": weight_bytes, "kv_bytes_per_token": kv_token,
                  "dtype": str(next(model.parameters()).dtype)},
        "fill": f"real prefill of {config.seed_tokens} tokens tiled to the context, keys re-rotated to their positions; "
                f"bounded caches filled in chunks of {config.fill_chunk}, prompt not protected",
        "results": [asdict(r) for r in results],
        "skipped": skipped,
        "engine_check": engine_check,
        "llama_cpp": peer,
        "process_peak_rss_mb": peak_rss() / 2**20,
    }
    write_outputs(record, out)
    return record


def _fill_ratios(group: list[RunResult]) -> None:
    full = next((r for r in group if r.method == "full"), None)
    for r in group:
        if full is None or r is full:
            if r is full:
                r.speedup_vs_full, r.bound_speedup_vs_full, r.efficiency_vs_bound = 1.0, 1.0, 1.0
            continue
        r.speedup_vs_full = full.ms_mean / r.ms_mean if r.ms_mean else None
        r.bound_speedup_vs_full = full.bound_ms / r.bound_ms if r.bound_ms else None
        if r.speedup_vs_full and r.bound_speedup_vs_full:
            r.efficiency_vs_bound = r.speedup_vs_full / r.bound_speedup_vs_full


def _label(r) -> str:
    """'full', 'triattention B=2048', 'triattention B=2048 (no spread)' for a RunResult or its dict."""
    get = r.get if isinstance(r, dict) else lambda k: getattr(r, k)
    if get("method") == "full":
        return "full"
    return f"{get('method')} B={get('budget')}" + (" (no spread)" if get("spread") is False else "")


def _short(r: RunResult) -> str:
    label = _label(r)
    ratio = "" if r.speedup_vs_full is None else f" x{r.speedup_vs_full:.2f} vs full (bound x{r.bound_speedup_vs_full:.2f})"
    return (f"{r.engine:12s} b={r.batch} ctx={r.context:6d} {label:24s} {r.tokens_per_second:8.1f} tok/s "
            f"p50 {r.ms_p50:7.1f} ms p99/p50 {r.p99_over_p50:4.2f} score {100 * r.scoring_share:4.1f}%{ratio}")


# ---------------------------------------------------------------------------------------------------------
# lean vs transformers, identical tokens
# ---------------------------------------------------------------------------------------------------------
class WeightFloor:
    """Only the weight GEMMs of one decode step (same shapes and fused weights as the lean engine): the floor
    any engine pays on this machine right now, measured in lockstep with the real steps."""

    def __init__(self, model, batch: int = 1, layout: str = "lean"):
        """layout "lean": the lean engine's fused, transposed weights; "stock": the model's own [out, in] weights."""
        from ..architectures import decoder
        from ..lean import LeanEngine

        self.layout = layout
        if layout == "lean":
            engine = LeanEngine.for_model(model)
            self.gemms = [(layer.qkv_wt, layer.o_wt, layer.gate_up_wt, layer.down_wt) for layer in engine.layers]
            self.head = engine.lm_head_wt
        else:
            self.gemms = []
            for layer in decoder(model).layers:
                attn, mlp = layer.self_attn, layer.mlp
                self.gemms.append(tuple(m.weight.detach() for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                                    mlp.gate_proj, mlp.up_proj, mlp.down_proj)))
            self.head = model.lm_head.weight.detach()
        hidden = model.config.hidden_size
        dtype, device = self.head.dtype, self.head.device
        self.x = torch.randn(batch, hidden, dtype=dtype, device=device)
        self.inputs = {}  # input width -> activation
        self.batch = batch
        self.step_seconds: list[float] = []

    def _input(self, width: int) -> torch.Tensor:
        if width not in self.inputs:
            self.inputs[width] = torch.randn(self.batch, width, dtype=self.x.dtype, device=self.x.device)
        return self.inputs[width]

    @torch.no_grad()
    def step(self, record: bool = True) -> None:
        from ..lean import _linear

        started = time.perf_counter()
        if self.layout == "lean":
            for weights in self.gemms:
                for w in weights:  # [in, out], through the lean engine's GEMV (split over threads)
                    _linear(self._input(w.shape[0]), w, None)
            _linear(self.x, self.head, None)
        else:
            for weights in self.gemms:
                for w in weights:  # [out, in], as transformers' nn.Linear calls it
                    torch.nn.functional.linear(self._input(w.shape[1]), w)
            torch.nn.functional.linear(self.x, self.head)
        if record:
            self.step_seconds.append(time.perf_counter() - started)


ENGINE_BLOCK = 8  # steps an engine decodes back to back in the engine check


def compare_engines(model, filler: Filler, first_token: int, stats, config: SpeedConfig, weight_bytes: int,
                    kv_token: int, bandwidth: float, stock=None) -> dict:
    """Lean and transformers engines decode in lockstep from identical caches (context nearest 2K, batch 1,
    each method of the run at its largest budget): greedy tokens must be identical; time per token ratio.
    The transformers engine runs on a copy of the model in the layout transformers loads (`stock`); the
    weight GEMMs alone (`WeightFloor`, in both layouts) run in the same lockstep: the floor of each engine."""
    from ..lean import stock_layout_copy

    stock = stock if stock is not None else stock_layout_copy(model)
    context = min(config.contexts, key=lambda c: abs(c - 2048))
    methods = ["full"] + [m for m in config.methods if m != "full"][:1]
    budget = max(config.budgets)
    report = {"context": context, "batch": 1, "steps": config.engine_check_steps, "methods": {}}
    for method in methods:
        runs = [DecodeRun(m, engine, method, budget, 1, context, filler, config.divide_length, stats,
                          config.fill_chunk, first_token, config.engine_check_steps + config.warmup)
                for m, engine in ((model, "lean"), (stock, "transformers"))]
        floor, stock_floor = WeightFloor(model, layout="lean"), WeightFloor(stock, layout="stock")
        runs += [floor, stock_floor]
        # full attention: the lean engine on a trikv full cache, transformers on its DynamicCache (trikv.generate's choice).
        # Runs alternate in blocks of ENGINE_BLOCK steps (order reversed every block): each engine decodes back to
        # back as in real use, and load changes reach every run alike.
        total = config.engine_check_steps + config.warmup
        for block_start in range(0, total, ENGINE_BLOCK):
            for run in (runs if (block_start // ENGINE_BLOCK) % 2 else runs[::-1]):
                for step in range(block_start, min(total, block_start + ENGINE_BLOCK)):
                    run.step(record=step >= config.warmup)
        lean, hf = (r.result(weight_bytes, kv_token, bandwidth, 0) for r in runs[:2])
        floor_ms = statistics.fmean(floor.step_seconds) * 1e3
        stock_floor_ms = statistics.fmean(stock_floor.step_seconds) * 1e3
        same = all(torch.equal(a, b) for a, b in zip(runs[0].generated, runs[1].generated))
        report["methods"][method] = {
            "budget": None if method == "full" else budget,
            "lean_ms_p50": lean.ms_p50, "transformers_ms_p50": hf.ms_p50,
            "lean_ms_mean": lean.ms_mean, "transformers_ms_mean": hf.ms_mean,
            "speedup": hf.ms_mean / lean.ms_mean if lean.ms_mean else None,
            "speedup_p50": hf.ms_p50 / lean.ms_p50 if lean.ms_p50 else None,
            "identical_greedy_tokens": same, "bound_ms": lean.bound_ms, "weight_gemm_floor_ms": floor_ms,
            "stock_weight_gemm_floor_ms": stock_floor_ms,
            "lean_overhead_ms": lean.ms_mean - floor_ms, "transformers_overhead_ms": hf.ms_mean - stock_floor_ms,
        }
        _log(f"[speed] engines at ctx={context} {method}: lean {lean.ms_mean:.1f} ms, transformers {hf.ms_mean:.1f} ms "
             f"-> x{report['methods'][method]['speedup']:.2f}, identical greedy tokens: {same}; weight GEMMs alone "
             f"{floor_ms:.1f} ms (lean layout) / {stock_floor_ms:.1f} ms (transformers layout)", config)
        del runs
        gc.collect()
    return report


# ---------------------------------------------------------------------------------------------------------
# llama.cpp in the same run
# ---------------------------------------------------------------------------------------------------------
def run_llama_cpp(config: SpeedConfig, model, seed: SeedKV, filler, results, weight_bytes, bandwidth) -> dict:
    if not config.llama_cpp:
        return {"skipped": "disabled (--no-llama-cpp)"}
    if not llama_cpp_available():
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python) - peer comparison skipped"}
    from ..models import REGISTRY

    if config.model not in REGISTRY:
        return {"skipped": f"{config.model} is not a bundled model with a GGUF file"}
    gguf = REGISTRY[config.model].locate_gguf()
    threads = config.llama_cpp_threads or torch.get_num_threads()
    contexts = sorted(config.contexts)
    peer = LlamaCppPeer(gguf, contexts[-1] + config.steps + config.warmup + 8, threads, seed.token_ids)
    rows = []
    try:
        for context in contexts:
            _log(f"[speed] llama.cpp: prefill to {context} tokens ...", config)
            started = time.perf_counter()
            peer.fill_to(context)
            prefill_seconds = time.perf_counter() - started
            times = []
            for step in range(config.steps + config.warmup):
                elapsed = peer.step()
                if step >= config.warmup:
                    times.append(elapsed)
            ms = sorted(t * 1e3 for t in times)
            kv = peer.kv_bytes(context + config.steps // 2, model)
            bound_ms = (peer.gguf_bytes + kv) / (bandwidth * 1e9) * 1e3
            mean_ms = statistics.fmean(ms)
            row = asdict(LlamaCppResult(
                context=context, steps=len(ms), tokens_per_second=1e3 / mean_ms, ms_p50=_percentile(ms, 50),
                ms_p99=_percentile(ms, 99), ms_max=ms[-1], ms_mean=mean_ms, bound_ms=bound_ms,
                bound_fraction=bound_ms / mean_ms, weight_bytes=peer.gguf_bytes, kv_bytes=kv, n_threads=threads,
                step_ms=[round(t, 3) for t in ms],
            ))
            row["prefill_seconds"] = prefill_seconds
            # ratios against trikv at batch 1, same context
            for r in results:
                if r.batch == 1 and r.context == context:
                    name = r.engine + ":" + _label(r).replace(" B=", "@")
                    row.setdefault("trikv_over_llama_cpp_tokens_per_second", {})[name] = r.tokens_per_second / row["tokens_per_second"]
            _log(f"[speed] llama.cpp ctx={context}: {row['tokens_per_second']:.1f} tok/s, p50 {row['ms_p50']:.1f} ms", config)
            rows.append(row)
    finally:
        peer.close()
    return {"gguf": str(gguf), "gguf_bytes": peer.gguf_bytes, "kv_cache_type": "f16", "batch": 1, "n_threads": threads,
            "note": "llama.cpp reads Q4_1 weights (~4.5 bits) and an f16 KV cache; trikv reads fp32 weights and KV. "
                    "Compare each against its own memory-bound bound.",
            "results": rows}


# ---------------------------------------------------------------------------------------------------------
# outputs
# ---------------------------------------------------------------------------------------------------------
CSV_FIELDS = [
    "engine", "method", "budget", "spread", "batch", "context", "steps", "tokens_per_second", "ms_p50", "ms_p99", "ms_max",
    "ms_mean", "p99_over_p50", "round_steps", "ms_round_step_mean", "scoring_share", "kv_bytes_final", "kv_bytes_peak",
    "kv_bytes_allocated", "entries_final", "entries_peak", "bound_ms", "bound_fraction", "rss_group_start_mb", "rss_peak_mb",
    "speedup_vs_full", "bound_speedup_vs_full", "efficiency_vs_bound",
]


def write_outputs(record: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps(record, indent=1))
    with (out / "speed.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS + ["source"], extrasaction="ignore")
        writer.writeheader()
        for row in record["results"]:
            writer.writerow({**row, "source": "trikv"})
        for row in (record.get("llama_cpp") or {}).get("results", []):
            writer.writerow({"engine": "llama.cpp", "method": "full", "batch": 1, "source": "llama.cpp", **{
                k: v for k, v in row.items() if k in CSV_FIELDS}})
    table = format_table(record)
    (out / "speed.txt").write_text(table + "\n")
    print(table)
    try:
        plot(record, out / "speed.png")
    except ImportError:
        print("(matplotlib is not installed: no PNG; pip install matplotlib)")


def format_table(record: dict) -> str:
    bw = record["machine"]["bandwidth"]["gbps"]
    model = record["model"]
    lines = [
        f"trikv bench speed - {model['name']} ({model['dtype']}), {record['machine']['threads']} threads, "
        f"bandwidth {bw} GB/s, weights {model['weight_bytes_per_step'] / 1e6:.0f} MB/step, "
        f"KV {model['kv_bytes_per_token'] / 1e3:.1f} kB/token",
        f"fill: {record['fill']}",
        "",
        f"{'engine':12s} {'b':>2s} {'context':>7s} {'method':24s} {'tok/s':>8s} {'p50 ms':>7s} {'p99 ms':>7s} {'max ms':>7s} "
        f"{'p99/p50':>7s} {'score%':>6s} {'KV MiB fin/peak':>16s} {'RSS MiB':>8s} {'bound ms':>8s} {'%bw':>5s} "
        f"{'xfull':>6s} {'bound':>6s} {'eff':>5s}",
    ]
    for r in record["results"]:
        label = _label(r)
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(
            f"{r['engine']:12s} {r['batch']:2d} {r['context']:7d} {label:24s} {r['tokens_per_second']:8.1f} "
            f"{r['ms_p50']:7.1f} {r['ms_p99']:7.1f} {r['ms_max']:7.1f} {r['p99_over_p50']:7.2f} "
            f"{100 * r['scoring_share']:6.2f} {r['kv_bytes_final'] / 2**20:7.1f}/{r['kv_bytes_peak'] / 2**20:<8.1f} "
            f"{r['rss_peak_mb']:8.0f} {r['bound_ms']:8.1f} {100 * r['bound_fraction']:5.0f} "
            f"{fmt(r['speedup_vs_full'], '6.2f')} {fmt(r['bound_speedup_vs_full'], '6.2f')} {fmt(r['efficiency_vs_bound'], '5.2f')}"
        )
    if record.get("skipped"):
        lines += ["", "skipped:"] + [f"  {s}" for s in record["skipped"]]
    check = record.get("engine_check")
    if check:
        lines += ["", f"lean vs transformers engine at context {check['context']}, batch 1, {check['steps']} steps:"]
        for method, row in check["methods"].items():
            lines.append(f"  {method:24s} mean: lean {row['lean_ms_mean']:.1f} ms, transformers {row['transformers_ms_mean']:.1f} ms "
                         f"-> x{row['speedup']:.2f} (p50: x{row['speedup_p50']:.2f}); identical greedy tokens: {row['identical_greedy_tokens']}; "
                         f"bound {row['bound_ms']:.1f} ms; weight GEMMs alone: lean layout {row['weight_gemm_floor_ms']:.1f} ms, "
                         f"transformers layout {row['stock_weight_gemm_floor_ms']:.1f} ms (time above them: lean "
                         f"{row['lean_overhead_ms']:.1f} ms, transformers {row['transformers_overhead_ms']:.1f} ms)")
    peer = record.get("llama_cpp") or {}
    if peer.get("skipped"):
        lines += ["", f"llama.cpp: {peer['skipped']}"]
    elif peer.get("results"):
        lines += ["", f"llama.cpp ({Path(peer['gguf']).name}, {peer['gguf_bytes'] / 1e6:.0f} MB, KV {peer['kv_cache_type']}, "
                      f"batch 1, {peer['n_threads']} threads): {peer['note']}"]
        lines.append(f"  {'context':>7s} {'tok/s':>8s} {'p50 ms':>7s} {'p99 ms':>7s} {'bound ms':>8s} {'%bw':>5s}  trikv tok/s / llama.cpp tok/s")
        for row in peer["results"]:
            ratios = ", ".join(f"{k} {v:.2f}" for k, v in (row.get("trikv_over_llama_cpp_tokens_per_second") or {}).items())
            lines.append(f"  {row['context']:7d} {row['tokens_per_second']:8.1f} {row['ms_p50']:7.1f} {row['ms_p99']:7.1f} "
                         f"{row['bound_ms']:8.1f} {100 * row['bound_fraction']:5.0f}  {ratios}")
    lines.append(f"\nprocess peak RSS {record['process_peak_rss_mb']:.0f} MiB")
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in record["results"]})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        lines: dict[str, list] = {}
        for r in record["results"]:
            if r["batch"] != batch:
                continue
            label = f"{r['engine']}: " + _label(r)
            lines.setdefault(label, []).append((r["context"], r["tokens_per_second"]))
        for label, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                    linestyle="--" if "full" in label else "-")
        peer = (record.get("llama_cpp") or {}).get("results") or []
        if batch == 1 and peer:
            ax.plot([r["context"] for r in peer], [r["tokens_per_second"] for r in peer], marker="s", color="black",
                    label="llama.cpp (Q4_1, f16 KV)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("decode tokens/s (all rows)")
        ax.set_title(f"{record['model']['name']}, batch {batch}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# memory over a long real generation
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def memory_run(model, tokenizer, stats, method: str, budget: int, tokens: int, divide_length: int, out: Path,
               engine: str = "lean", every: int = 64, progress: bool = True, command: str = "") -> dict:
    """Generate `tokens` real tokens (greedy, no EOS stop, batch 1) and sample RSS and KV entries over time."""
    from ..cache import make_cache
    from ..lean import LeanEngine

    options = {"stats": stats} if _needs_stats(method) else {}
    cache = make_cache(model, method, budget=None if method == "full" else budget, divide_length=divide_length, **options)
    ids = seed_text_ids(tokenizer, model.config.vocab_size, 64)
    device = next(model.parameters()).device
    engine_ = LeanEngine.for_model(model) if engine == "lean" else None
    x = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device)[None]
    samples = []
    started = time.perf_counter()
    max_entries = 0
    for step in range(tokens):
        if engine_ is not None:
            logits = engine_.forward(x, cache, position_ids=positions)[:, -1]
        else:
            logits = model(input_ids=x, position_ids=positions, **cache_kwargs(model, cache), logits_to_keep=1).logits[:, -1]
        x = logits.argmax(-1, keepdim=True)
        positions = positions[:, -1:] + 1
        max_entries = max(max_entries, cache.entries())
        if step % every == 0 or step == tokens - 1:
            samples.append({"tokens": len(ids) + step + 1, "rss_mb": current_rss() / 2**20, "entries": cache.entries(),
                            "kv_bytes": cache.memory_bytes(), "seconds": time.perf_counter() - started})
            if progress and step % (every * 16) == 0:
                print(f"[speed] memory run {method}: {samples[-1]['tokens']} tokens, RSS {samples[-1]['rss_mb']:.0f} MiB, "
                      f"{samples[-1]['entries']} entries", file=sys.stderr, flush=True)
    record = {"command": command, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "method": method, "budget": budget, "divide_length": divide_length, "engine": engine, "tokens": tokens,
              "max_entries_per_layer_head": max_entries, "limit": budget + divide_length, "rounds": cache.rounds,
              "samples": samples, "seconds": time.perf_counter() - started}
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(record, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([s["tokens"] for s in samples], [s["rss_mb"] for s in samples], label="process RSS (MiB)")
        ax.plot([s["tokens"] for s in samples], [s["kv_bytes"] / 2**20 for s in samples], label="live KV (MiB)")
        ax.set_xlabel("tokens processed")
        ax.set_ylabel("MiB")
        ax.set_title(f"{method} B={budget}: memory over a {tokens}-token generation")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "memory.png", dpi=120)
        plt.close(fig)
    except ImportError:
        pass
    return record


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_speed_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="bundled name, local folder or hub id")
    parser.add_argument("--stats", default=None, help="TriAttention statistics (default: the model's bundled stats)")
    parser.add_argument("--contexts", type=_ints, default=DEFAULT_CONTEXTS, help="comma list (default 1024,...,32768)")
    parser.add_argument("--methods", type=_names, default=["full", "triattention"], help="comma list; 'full' is the reference")
    parser.add_argument("--budgets", type=_ints, default=DEFAULT_BUDGETS, help="comma list (default 256,512,1024,2048)")
    parser.add_argument("--batch-sizes", type=_ints, default=[1, 4], help="comma list (default 1,4)")
    parser.add_argument("--engines", type=_names, default=["lean"], help="lean and/or transformers (default lean)")
    parser.add_argument("--steps", type=int, default=256, help="measured decode steps per configuration")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured steps first (the fill's last round runs here)")
    parser.add_argument("--divide-length", type=int, default=128, help="slack beta")
    parser.add_argument("--seed-tokens", type=int, default=512, help="length of the real prefill that is tiled")
    parser.add_argument("--fill-chunk", type=int, default=1024, help="bounded caches are filled in chunks of this size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--max-kv-gb", type=float, default=8.0, help="skip configurations whose KV cache exceeds this")
    parser.add_argument("--spread", default="on", choices=["on", "off", "both"],
                        help="TriAttention scoring ahead between rounds (default on; 'both' runs each budget twice)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp peer")
    parser.add_argument("--llama-cpp-threads", type=int, default=None, help="default: the torch thread count")
    parser.add_argument("--no-engine-check", action="store_true",
                        help="skip the lean-vs-transformers check (runs when both engines are selected)")
    parser.add_argument("--engine-check-steps", type=int, default=48)
    parser.add_argument("--memory-run", type=int, default=0, metavar="TOKENS",
                        help="instead of the grid: generate TOKENS real tokens with the first method and budget, "
                             "sampling RSS and KV entries (memory.json / memory.png)")
    parser.add_argument("--out", default="bench-speed", help="output folder (speed.json, speed.csv, speed.png, speed.txt)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=speed_main)


def speed_main(args) -> int:
    config = SpeedConfig(
        model=args.model, contexts=args.contexts, methods=args.methods, budgets=args.budgets,
        batch_sizes=args.batch_sizes, engines=args.engines, steps=args.steps, warmup=args.warmup,
        divide_length=args.divide_length, seed_tokens=args.seed_tokens, fill_chunk=args.fill_chunk,
        threads=args.threads, stats=args.stats, llama_cpp=not args.no_llama_cpp,
        llama_cpp_threads=args.llama_cpp_threads, engine_check=not args.no_engine_check,
        engine_check_steps=args.engine_check_steps, max_kv_gb=args.max_kv_gb, out=args.out, spread=args.spread,
        progress=not args.no_progress, command="trikv " + " ".join(sys.argv[1:]),
    )
    if args.memory_run:
        if config.threads:
            torch.set_num_threads(config.threads)
        model, tokenizer = _load(config)
        stats = _load_stats(config, model)
        method = next((m for m in config.methods if m != "full"), "full")
        record = memory_run(model, tokenizer, stats, method, config.budgets[0], args.memory_run, config.divide_length,
                            Path(config.out), engine=config.engines[0], progress=config.progress, command=config.command)
        print(f"{method} B={record['budget']}: {record['tokens']} tokens, at most {record['max_entries_per_layer_head']} "
              f"entries per (layer, KV head) (limit {record['limit']}), RSS {record['samples'][0]['rss_mb']:.0f} -> "
              f"{record['samples'][-1]['rss_mb']:.0f} MiB, {record['rounds']} rounds")
        return 0
    run_speed(config)
    return 0


try:  # `trikv bench speed`
    from . import register_bench

    register_bench("speed", add_speed_arguments, "decode throughput, latency and memory vs context, method and budget")
except ImportError:  # pragma: no cover
    pass
