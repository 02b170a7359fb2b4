"""Facts about this machine a speed run needs: memory bandwidth, RSS, bytes read per decode step."""

from __future__ import annotations

import gc
import os
import sys
import time

import torch


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
    from ...heap import release_free_heap

    gc.collect()
    release_free_heap()


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
    from ...architectures import model_shape

    shape = model_shape(model)
    element = torch.finfo(dtype or next(model.parameters()).dtype).bits // 8
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * element
