"""A self-contained check of trikv on one accelerator: `python -m trikv.benchmarks.gpu_check --device cuda`.

It needs torch (with CUDA on a GPU) and transformers only: no vLLM, no model download. Three parts:

1. the vLLM page codec on device tensors in each of vLLM 0.32's six KV cache layouts: tokens written through a
   slow reference of the attention backend's KV write are gathered and compacted bitwise;
2. compaction rounds of the serving path (scorer and mover, `trikv.vllm.compactor.Compactor`) at the shapes of
   an 8B model (32 layers, 8 KV heads, head_dim 128, bf16): 64 requests due at B + beta = 2,176 entries, and the
   first rounds of 32K-, 64K- and 128K-token prompts. For each: the chunk plan and its planned bytes, the peak
   memory measured above what was allocated before, against `round_workspace_bytes`, the wall time, and, from
   the same round run on the meta device (shapes without data, CUDA's code path), the host-device
   synchronisations it asks for (values read back, copies that wait) and a GPU time estimate from its kernels;
3. trikv's transformers cache and lean engine on a small random model: exact with no eviction, and the lean
   engine's tokens equal the transformers path's under eviction.

`--small` runs the same parts at toy shapes (what the test suite does on CPU). `--host-fit` runs the 8B rounds
within a host's memory: the requests' block tables point into a cache of at most `--host-cache-bytes` (blocks
shared between requests), so a round reads, scores and moves as many entries, in as many chunks, as over
private blocks, while 64 x 2,176 entries of an 8B model's KV (18 GB) need not fit. Prints one JSON report;
`--page PATH` also writes the round figures into that Markdown page (between its gpu-check markers);
`--from-report REPORT.json --page PATH` writes those of a saved report without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..architectures import config_shape
from ..calibration import QueryStats
from ..fast import accelerate
from ..geometry import RopeGeometry
from ..policies import make_policy
from ..settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH
from ..vllm.compactor import DEFAULT_ROUND_WORKSPACE_BYTES, CompactionOp, Compactor
from ..vllm.pages import PageCodec

# vLLM 0.32's KVCacheLayout: the memory order of the logical axes [L, B, H, N, C] (C = keys then values)
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
# a GPU time estimate for a round's kernels: each takes at least a launch, at most its bytes at HBM bandwidth
LAUNCH_SECONDS = 5e-6
H200_BYTES_PER_SECOND = 4.8e12
PAGE_BEGIN, PAGE_END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"


def layout_views(order: tuple[int, ...], layers: int, blocks: int, heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """Each layer's [blocks, H, N, 2D] view of one allocation in the layout's memory order, as vLLM's allocator
    makes them."""
    logical = (layers, blocks, heads, block_size, 2 * head_dim)
    strides, step = [0] * 5, 1
    for axis in reversed(order):
        strides[axis] = step
        step *= logical[axis]
    view = torch.zeros(step, dtype=dtype, device=device).as_strided(logical, strides)
    return [view[layer] for layer in range(layers)]


def reference_write(keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """A slow reference of a backend's KV write: token i's [Hkv, D] key and value at slot slots[i]."""
    block_size, dim = cache.shape[2], keys.shape[-1]
    blocks, offsets = slots // block_size, slots % block_size
    cache[blocks, :, offsets, :dim] = keys
    cache[blocks, :, offsets, dim:] = values


def check_page_codec(device: str, dtype: torch.dtype, heads: int = 8, head_dim: int = 128, block_size: int = 16) -> dict:
    """Every layout: write, gather, compact a random subset, read back; True where all bytes match."""
    results = {}
    for name, order in LAYOUTS.items():
        views = layout_views(order, 3, 12, heads, block_size, head_dim, dtype, device)
        cache = views[1]
        codec = PageCodec.learn(reference_write, cache, heads, block_size, head_dim)
        table = torch.tensor([[7, 2, 9, 4]], device=device)
        length = 4 * block_size - 5
        keys = torch.randn(length, heads, head_dim, device=device).to(dtype)
        values = torch.randn(length, heads, head_dim, device=device).to(dtype)
        slots = table[0, torch.arange(length, device=device) // block_size] * block_size + torch.arange(length, device=device) % block_size
        reference_write(keys, values, cache, slots)
        gathered_keys, gathered_values = codec.gather(cache, table)
        read_ok = (torch.equal(gathered_keys[0, :, :length], keys.transpose(0, 1))
                   and torch.equal(gathered_values[0, :, :length], values.transpose(0, 1)))
        kept = torch.stack([torch.randperm(length, device=device)[: length // 2].sort().values for _ in range(heads)])[None]
        codec.move(cache, table, kept)
        after_keys, after_values = codec.gather(cache, table)
        expected_keys = keys.transpose(0, 1).gather(1, kept[0, :, :, None].expand(-1, -1, head_dim))
        expected_values = values.transpose(0, 1).gather(1, kept[0, :, :, None].expand(-1, -1, head_dim))
        moved_ok = torch.equal(after_keys[0, :, : length // 2], expected_keys) and torch.equal(after_values[0, :, : length // 2], expected_values)
        results[name] = {"bitwise": bool(read_ok and moved_ok), "row_index": codec.locate(table, cache).keys.along == "dim"}
    return results


def cpu_transient_bytes(action) -> int:
    """Most bytes held at once by CPU tensors allocated inside `action`, less what it leaves allocated, from the
    allocator records of torch's profiler."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        action()
    with tempfile.NamedTemporaryFile(suffix=".json") as handle:
        prof.export_chrome_trace(handle.name)
        with open(handle.name) as trace:
            events = [e for e in json.load(trace)["traceEvents"] if e.get("name") == "[memory]"]
    totals = [e["args"]["Total Allocated"] for e in sorted(events, key=lambda e: e["ts"])]
    return max(totals, default=0) - (totals[-1] if totals else 0)


_aten = torch.ops.aten
_READS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default, _aten.nonzero.default,
          _aten.masked_select.default, _aten.unique_consecutive.default, _aten._unique2.default,
          _aten.unique_dim.default}
_COPIES = {_aten._to_copy.default, _aten.copy_.default}
_ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.lift_fresh.default}
_INDEXED = {_aten.index.Tensor, _aten.gather.default, _aten.index_select.default}
_INDEXED_WRITES = {_aten.index_put_.default, _aten._index_put_impl_.default, _aten.index_put.default}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class RoundTrace(TorchDispatchMode):
    """What torch operations ask of the device, run on the meta device (shapes without data, with CUDA's copy
    semantics): `reads` of device values by the host (item, bool, equal, nonzero, copies back: each one a stall
    on a GPU), `blocking_copies` from the host (copies that wait for the device), `async_copies` from the host
    (queued: no stall), and per kernel (every other non-view operation) the bytes it reads and writes, for a
    GPU time estimate: sum over kernels of max(one launch, bytes / HBM bandwidth)."""

    def __init__(self):
        super().__init__()
        self.reads = self.blocking_copies = self.async_copies = self.kernels = self.bytes = 0
        self.estimate_seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        crossing = False
        if func in _READS:
            self.reads += 1
        elif func in _COPIES:
            source = args[1] if func is _aten.copy_.default else args[0]
            target = torch.device(args[0].device if func is _aten.copy_.default else kwargs.get("device") or source.device)
            blocking = not (kwargs.get("non_blocking") or (func is _aten.copy_.default and len(args) > 2 and args[2]))
            crossing = (source.device.type == "cpu") != (target.type == "cpu")
            if crossing and target.type == "cpu":
                self.reads += 1  # a device value copied back to the host
            elif crossing and blocking:
                self.blocking_copies += 1
            elif crossing:
                self.async_copies += 1
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if func.is_view or func in _ALLOCATIONS or func in _READS or crossing:
            return out
        if func in _INDEXED:  # the gathered part of the source, not the whole source
            moved = 2 * _bytes(outputs) + _bytes(inputs[1:])
        elif func in _INDEXED_WRITES:
            moved = 2 * _bytes(inputs[2:]) + _bytes(inputs[1:2])
        else:
            moved = _bytes(inputs) + _bytes(outputs)
        self.kernels += 1
        self.bytes += moved
        self.estimate_seconds += max(LAUNCH_SECONDS, moved / H200_BYTES_PER_SECOND)
        return out

    @property
    def syncs(self) -> int:
        return self.reads + self.blocking_copies


def model_config(small: bool):
    """A Llama-3-8B-shaped config (llama3 RoPE scaling), or a toy one."""
    from transformers import LlamaConfig

    if small:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                       rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def synthetic_stats(config, seed: int = 0) -> QueryStats:
    """Random query statistics of the config's shape (scores are timed and measured, not judged)."""
    shape = config_shape(config)
    generator = torch.Generator().manual_seed(seed)
    L, Hq, F = shape.num_layers, shape.num_heads, shape.head_dim // 2
    q_mean = torch.complex(torch.randn(L, Hq, F, generator=generator, dtype=torch.float64),
                           torch.randn(L, Hq, F, generator=generator, dtype=torch.float64))
    return QueryStats(q_mean, q_mean.abs() * (1 + torch.rand(L, Hq, F, generator=generator, dtype=torch.float64)))


def serving_policy(config):
    """TriAttention with synthetic statistics of `config`, bound as the vLLM worker binds it."""
    shape = config_shape(config)
    policy = make_policy("triattention", stats=synthetic_stats(config))
    policy.bind_geometry(RopeGeometry.from_config(config), shape)
    accelerate(policy)
    return policy


@dataclass
class RoundCase:
    """One round to check: requests due with these entry counts, compacted to `budget`."""

    name: str
    lengths: list[int]
    budget: int
    prompt_length: int = 64


@dataclass
class PagedRound:
    """A round's inputs on one device: every layer's cache view, their codecs, the requests' blocks and rounds."""

    caches: list[torch.Tensor]
    codecs: list[PageCodec]
    block_ids: dict[str, list[int]]
    rounds: list[CompactionOp]
    physical_blocks: int  # blocks behind the block tables (fewer than they name when blocks are shared)


def paged_round(config, case: RoundCase, device: str, dtype: torch.dtype, block_size: int = 16,
                max_cache_bytes: int | None = None, seed: int = 0) -> PagedRound:
    """Caches in layout LBNHC holding `case`'s requests (random keys and values): each request in blocks of its
    own, or, with `max_cache_bytes`, block tables over at most that many bytes of cache (blocks shared)."""
    shape = config_shape(config)
    L, H, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
    blocks_per = [-(-length // block_size) for length in case.lengths]
    page_bytes = L * H * block_size * 2 * D * torch.empty(0, dtype=dtype).element_size()
    physical = sum(blocks_per) if max_cache_bytes is None else max(1, min(sum(blocks_per), max_cache_bytes // page_bytes))
    caches = layout_views(LAYOUTS["LBNHC"], L, physical + 1, H, block_size, D, dtype, device)  # + the null block
    if device != "meta":
        generator = torch.Generator(device=device).manual_seed(seed)
        for cache in caches:
            cache.copy_(torch.randn(cache.shape, generator=generator, device=device).to(dtype))
    learn_on = "cpu" if device == "meta" else device  # a layout is learnt by writing codes: on a device with data
    scratch = caches if learn_on == device else layout_views(LAYOUTS["LBNHC"], L, 2, H, block_size, D, dtype, learn_on)
    codec = PageCodec.learn(reference_write, scratch[0], H, block_size, D)
    codec = codec if learn_on == device else codec.to(device)
    block_ids, rounds, counter = {}, [], 0
    for index, (length, count) in enumerate(zip(case.lengths, blocks_per)):
        request = f"request-{index}"
        block_ids[request] = [1 + (counter + j) % physical for j in range(count)]
        counter += count
        rounds.append(CompactionOp(request, position=length, length=length, budget=case.budget, prompt_length=case.prompt_length,
                                   kept_blocks=-(-case.budget // block_size), freed_blocks=0, free_blocks=0, held_blocks=0))
    return PagedRound(caches, [codec] * L, block_ids, rounds, physical)


def round_cases(small: bool) -> list[RoundCase]:
    if small:
        return [RoundCase("due-8", [48] * 8, 32, prompt_length=12), RoundCase("first-600", [600], 32, prompt_length=600)]
    budget = int(DEFAULT_BUDGET)
    return [RoundCase("due-64", [budget + int(DEFAULT_DIVIDE_LENGTH)] * 64, budget)] + [
        RoundCase(f"first-{length // 1024}K", [length], budget, prompt_length=length) for length in (32768, 65536, 131072)]


def trace_round(config, case: RoundCase, workspace: int, dtype: torch.dtype) -> dict:
    """`case`'s round run twice on the meta device (the second with the scorer's device copies made): what each
    asks of the device, and a GPU time estimate of the second."""
    policy = serving_policy(config)
    compactor = Compactor(policy, True, 32, round_workspace_bytes=workspace)
    paged = paged_round(config, case, "meta", dtype)
    counts = []
    for _ in range(2):
        compactor.kept_positions.clear()
        with RoundTrace() as trace:
            compactor.run(paged.rounds, paged.caches, paged.codecs, paged.block_ids)
        counts.append(trace)
    cold, warm = counts
    return {"syncs_per_round": warm.syncs, "syncs_first_round": cold.syncs, "host_to_device_copies": warm.async_copies,
            "host_to_device_copies_first_round": cold.async_copies, "kernels": warm.kernels,
            "gpu_estimate_seconds": round(warm.estimate_seconds, 4), "gpu_estimate_bytes": warm.bytes}


def check_round(device: str, dtype: torch.dtype, small: bool, workspace: int, case: RoundCase,
                max_cache_bytes: int | None = None, timed: bool = True) -> dict:
    """One round of `case`: its chunk plan and planned peak, the peak measured above what was allocated before
    (CUDA allocator, or the CPU allocator records of torch's profiler), the cap, the wall time (a separate
    unprofiled run when `timed`), and the meta-device trace (`trace_round`)."""
    config = model_config(small)
    shape = config_shape(config)
    L, H, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
    block_size = 16

    def fresh():
        return Compactor(serving_policy(config), True, 32, round_workspace_bytes=workspace)

    paged = paged_round(config, case, device, dtype, block_size, max_cache_bytes)
    compactor = fresh()
    index_bytes = paged.codecs[0].plan(paged.caches[0]).index_bytes_per_slot
    slots = max(-(-length // block_size) for length in case.lengths) * block_size
    plan = compactor.plan(len(case.lengths), L, H, slots, D, paged.caches[0].element_size(), index_bytes)
    upload_bytes = len(case.lengths) * (4 + slots // block_size) * 8

    def run(target: Compactor):
        target.run(paged.rounds, paged.caches, paged.codecs, paged.block_ids)

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run(compactor)
        torch.cuda.synchronize()
        transient = torch.cuda.max_memory_allocated() - before
    else:
        transient = cpu_transient_bytes(lambda: run(compactor))
    seconds = None
    if timed:
        timed_compactor = fresh()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        run(timed_compactor)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = round(time.perf_counter() - started, 3)
    cache_bytes = sum(cache.numel() for cache in paged.caches) * paged.caches[0].element_size()
    return {"layers": L, "kv_heads": H, "head_dim": D, "dtype": str(dtype), "requests_due": len(case.lengths),
            "entries": max(case.lengths), "budget": case.budget,
            "chunk": {"requests": plan.requests, "layers": plan.layers, "kv_heads": plan.heads},
            "planned_peak_bytes": plan.bytes + upload_bytes, "transient_bytes": int(transient),
            "round_workspace_bytes": workspace, "within_cap": bool(transient <= workspace and plan.bytes + upload_bytes <= workspace),
            "chunks": compactor.chunks, "seconds": seconds, "cache_bytes": cache_bytes,
            "blocks_named": sum(len(ids) for ids in paged.block_ids.values()), "blocks_behind": paged.physical_blocks,
            **trace_round(config, case, workspace, dtype)}


def check_transformers(device: str, small: bool) -> dict:
    """A small random llama in float32: trikv's cache with no eviction generates transformers' DynamicCache tokens;
    under eviction the lean engine generates the transformers path's tokens."""
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    from ..cache import make_cache
    from ..calibration import calibrate
    from ..compat import cache_kwargs
    from ..lean import lean_forward

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(4.0)  # spread logits: greedy tokens then do not hang on float noise
    stats = calibrate(model, torch.randint(1, 512, (1024,)).to(device), source="random tokens (gpu check)", progress=False)
    prompt = torch.randint(1, 512, (1, 48), device=device)
    new_tokens = 64 if small else 256

    def greedy(cache, lean: bool) -> list[int]:
        ids, out = prompt, []
        with torch.no_grad():
            for _ in range(new_tokens):
                logits = lean_forward(model, ids, cache) if lean else model(ids, **cache_kwargs(model, cache)).logits
                ids = logits[:, -1:].argmax(-1)
                out.append(int(ids))
        return out

    reference = greedy(DynamicCache(), lean=False)
    unevicted = greedy(make_cache(model, "triattention", budget=4096, stats=stats), lean=False)
    evicted = greedy(make_cache(model, "triattention", budget=32, divide_length=16, stats=stats), lean=False)
    lean = greedy(make_cache(model, "triattention", budget=32, divide_length=16, stats=stats), lean=True)
    return {"no_eviction_equals_transformers": unevicted == reference,
            "lean_equals_transformers_under_eviction": lean == evicted,
            "evicted_tokens_agreeing_with_full": sum(a == b for a, b in zip(evicted, reference)), "new_tokens": new_tokens}


def render_rounds(report: dict) -> str:
    """The Markdown block of a report's round figures (what `--page` writes between the markers)."""
    rounds = report["rounds"]
    first = next(iter(rounds.values()))
    host = f"CPU ({report['cpu_cores']} cores)" if report["device"] == "cpu" else report["device"]
    kernels = sorted(r["kernels"] for r in rounds.values())
    lines = [PAGE_BEGIN, "",
             f"Generated by `{report['command']}` on {host}, torch {report['torch']}: {first['layers']} layers, "
             f"{first['kv_heads']} KV heads, head_dim {first['head_dim']}, {first['dtype'].replace('torch.', '')}, "
             f"TriAttention with B = {first['budget']}, `round_workspace_bytes` = {first['round_workspace_bytes']:,}.", "",
             "| round | chunk (requests x layers x KV heads) | chunks | planned peak | measured peak | cap held | "
             "syncs per round | measured time | GPU estimate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rounds.items():
        what = (f"{r['requests_due']} due at {r['entries']:,} entries" if r["requests_due"] > 1
                else f"first round of a {r['entries']:,}-token prompt")
        chunk = r["chunk"]
        seconds = "-" if r["seconds"] is None else f"{r['seconds']:.2f} s"
        lines.append(f"| {what} | {chunk['requests']} x {chunk['layers']} x {chunk['kv_heads']} | {r['chunks']} | "
                     f"{r['planned_peak_bytes'] / 2**20:.1f} MiB | {r['transient_bytes'] / 2**20:.1f} MiB | "
                     f"{'yes' if r['within_cap'] else 'NO'} | {r['syncs_per_round']} | {seconds} | "
                     f"{r['gpu_estimate_seconds'] * 1000:.1f} ms |")
    shared = [r for r in rounds.values() if r["blocks_behind"] < r["blocks_named"]]
    lines += ["",
              f"Measured time and peak: one round on this {host}, peak memory above what was allocated before it. "
              f"GPU estimate (not a measurement): the same round replayed on the meta device, each of its "
              f"{kernels[0]:,} to {kernels[-1]:,} kernels counted at max({LAUNCH_SECONDS * 1e6:.0f} µs launch, bytes it "
              f"reads and writes / {H200_BYTES_PER_SECOND / 1e12:.1f} TB/s, H200 HBM). Syncs per round: values the host "
              "reads back from the device plus host-to-device copies that wait for it (the round's one upload of "
              "positions and block ids is queued, not waited for). The plan is what CUDA allocates; on CPU the scorer "
              "works one layer at a time, so a round whose chunks hold many layers peaks below its plan there."]
    if shared:
        lines.append(f"Host fit: the block tables name up to {max(r['blocks_named'] for r in shared):,} blocks per round "
                     f"over at most {max(r['cache_bytes'] for r in shared) / 2**30:.1f} GiB of cache (blocks shared "
                     "between requests): a round reads, scores and moves as many entries in as many chunks as over "
                     "private blocks.")
    lines += ["", PAGE_END]
    return "\n".join(lines)


def write_page(path: str, block: str) -> None:
    """Replace the text between the gpu-check markers of `path` with `block`."""
    with open(path) as handle:
        text = handle.read()
    if PAGE_BEGIN not in text or PAGE_END not in text:
        raise SystemExit(f"{path} has no {PAGE_BEGIN} ... {PAGE_END} block to write the round figures into")
    head, rest = text.split(PAGE_BEGIN, 1)
    tail = rest.split(PAGE_END, 1)[1]
    with open(path, "w") as handle:
        handle.write(head + block + tail)


def _round_flags(args) -> list[str]:
    """The flags that decide a report's round figures (for the command a page names)."""
    flags = ["--device", args.device] + (["--small"] if args.small else []) + (["--host-fit"] if args.host_fit else [])
    if args.workspace != DEFAULT_ROUND_WORKSPACE_BYTES:
        flags += ["--workspace", str(args.workspace)]
    if args.host_fit and args.host_cache_bytes != 2 * 2**30:
        flags += ["--host-cache-bytes", str(args.host_cache_bytes)]
    return flags + (["--rounds", args.rounds] if args.rounds else [])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="toy shapes (CPU tests)")
    parser.add_argument("--workspace", type=int, default=DEFAULT_ROUND_WORKSPACE_BYTES, help="round_workspace_bytes")
    parser.add_argument("--host-fit", action="store_true",
                        help="8B rounds over at most --host-cache-bytes of cache (block tables share blocks)")
    parser.add_argument("--host-cache-bytes", type=int, default=2 * 2**30, help="cache size with --host-fit (default 2 GiB)")
    parser.add_argument("--rounds", help="comma-separated round names to run (default all: due-64, first-32K, first-64K, first-128K)")
    parser.add_argument("--skip-transformers", action="store_true", help="skip part 3")
    parser.add_argument("--out", help="also write the JSON report here")
    parser.add_argument("--page", help="write the round figures into this Markdown page (between its gpu-check markers)")
    parser.add_argument("--from-report", metavar="REPORT.json",
                        help="run nothing: write the round figures of a saved report (--out) into --page")
    args = parser.parse_args(argv)
    if args.from_report:
        if not args.page:
            parser.error("--from-report needs --page")
        with open(args.from_report) as handle:
            report = json.load(handle)
        write_page(args.page, render_rounds(report))
        return report
    dtype = torch.bfloat16
    started = time.perf_counter()
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "torch": torch.__version__,
              "cpu_cores": os.cpu_count(), "command": shlex.join(["scripts/gpu_check.sh", *_round_flags(args)])}
    report["page_codec"] = check_page_codec(args.device, dtype, *((2, 16) if args.small else ()))
    cases = round_cases(args.small)
    if args.rounds:
        wanted = args.rounds.split(",")
        unknown = sorted(set(wanted) - {case.name for case in cases})
        if unknown:
            raise SystemExit(f"unknown round(s) {unknown}; rounds: {', '.join(case.name for case in cases)}")
        cases = [case for case in cases if case.name in wanted]
    report["rounds"] = {}
    for case in cases:
        report["rounds"][case.name] = check_round(args.device, dtype, args.small, args.workspace, case,
                                                  args.host_cache_bytes if args.host_fit else None)
        print(f"[gpu-check] round {case.name}: {json.dumps(report['rounds'][case.name])}", file=sys.stderr, flush=True)
    if not args.skip_transformers:
        report["transformers"] = check_transformers(args.device, args.small)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["passed"] = (all(r["bitwise"] for r in report["page_codec"].values())
                        and all(r["within_cap"] and r["syncs_per_round"] == 0 for r in report["rounds"].values())
                        and all(v for k, v in report.get("transformers", {}).items() if isinstance(v, bool)))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    if args.page:
        write_page(args.page, render_rounds(report))
    return report


if __name__ == "__main__":
    raise SystemExit(0 if main()["passed"] else 1)
