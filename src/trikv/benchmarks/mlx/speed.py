"""Decode speed of mlx-lm's full `KVCache` against trikv's bounded MLX cache, side by side in one run.

Each (context, cache) pair is filled with `context` tokens of keys and values (random, in the model's dtype,
through the cache's own `update_and_fetch` in chunks of 2,048, so a bounded cache runs its rounds as a chunked
prefill does), then decodes greedily through the real model. A bounded cache leaves the fill holding `budget`
entries, so `divide_length` decode steps after `warmup` ones contain exactly one round: the scoring share is the
steady state's. Memory: the K/V bytes each cache holds (live entries) and allocates.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

FILL_CHUNK = 2048


@dataclass
class SpeedRow:
    context: int
    cache: str  # "full" | "trikv B=... (8-bit)"
    tokens_per_second: float
    ms_p50: float
    ms_p99: float
    scoring_share: float  # time in rounds / decode time (0 for full)
    rounds: int
    kv_bytes: int  # live K/V bytes after the decode
    kv_allocated_bytes: int
    entries: int  # entries per (layer, KV head) after the decode

    def as_dict(self) -> dict:
        return asdict(self)


def fill(model, cache: list, context: int, seed: int = 0) -> None:
    """Append `context` tokens of random keys / values to every layer of `cache` (one chunk of every layer at a time,
    as a forward would)."""
    attention = model.layers[0].self_attn
    heads, head_dim = attention.n_kv_heads, attention.head_dim
    dtype = model.layers[0].self_attn.q_proj.weight.dtype if not hasattr(attention.q_proj, "scales") else mx.float16
    key = mx.random.key(seed)
    for start in range(0, context, FILL_CHUNK):
        n = min(FILL_CHUNK, context - start)
        for layer in cache:
            key, k_key, v_key = mx.random.split(key, 3)
            keys = mx.random.normal((1, heads, n, head_dim), key=k_key).astype(dtype)
            values = mx.random.normal((1, heads, n, head_dim), key=v_key).astype(dtype)
            layer.update_and_fetch(keys, values)
        mx.eval([layer.keys for layer in cache])


def decode(model, cache: list, steps: int, warmup: int, token: int = 1) -> np.ndarray:
    """Seconds of each of `steps` greedy decode steps after `warmup` untimed ones."""
    y = mx.array([[token]])
    times = []
    for step in range(warmup + steps):
        started = time.perf_counter()
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1, keepdims=True)
        mx.eval(y)
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return np.array(times)


def full_cache_bytes(cache: list) -> tuple[int, int, int]:
    """(live bytes, allocated bytes, entries) of mlx-lm KVCaches (or QuantizedKVCaches)."""
    live = allocated = 0
    for layer in cache:
        allocated += layer.nbytes
        keys, values = layer.keys, layer.values
        parts = (keys if isinstance(keys, (tuple, list)) else [keys]) + (values if isinstance(values, (tuple, list)) else [values])
        live += sum(part.nbytes * layer.offset // part.shape[2] for part in parts)
    return live, allocated, cache[0].offset


def measure(model, make_cache, label: str, context: int, steps: int, warmup: int) -> SpeedRow:
    """Fill a fresh cache to `context` tokens and time `steps` decode steps."""
    import trikv.mlx

    cache = make_cache()
    fill(model, cache, context)
    bounded = trikv.mlx.bounded_cache(cache) if isinstance(cache[0], trikv.mlx.LayerCache) else None
    rounds_before = bounded.rounds if bounded else 0
    seconds_before = bounded.round_seconds if bounded else 0.0
    times = decode(model, cache, steps, warmup)
    # the rounds that fell in the timed window (the warm-up steps hold none: they are fewer than divide_length)
    round_seconds = bounded.round_seconds - seconds_before if bounded else 0.0
    if bounded:
        live, allocated, entries = bounded.memory_bytes(), bounded.allocated_bytes(), bounded.length
    else:
        live, allocated, entries = full_cache_bytes(cache)
    return SpeedRow(context, label, float(len(times) / times.sum()), float(np.median(times) * 1e3),
                    float(np.percentile(times, 99) * 1e3), float(round_seconds / times.sum()),
                    (bounded.rounds - rounds_before) if bounded else 0, int(live), int(allocated), int(entries))


def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Memory read bandwidth of MLX on this machine in GB/s: a streaming sum, best of `repeats`."""
    data = mx.ones((megabytes * 2**20 // 4,), dtype=mx.float32)
    mx.eval(data)
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        mx.eval(data.sum())
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best / 1e9
