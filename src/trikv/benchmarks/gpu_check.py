"""A self-contained check of trikv on one accelerator: `python -m trikv.benchmarks.gpu_check --device cuda`.

It needs torch (with CUDA on a GPU) and transformers only: no vLLM, no model download. Three parts:

1. the vLLM page codec on device tensors in each of vLLM 0.32's six KV cache layouts: tokens written through a
   slow reference of the attention backend's KV write are gathered and compacted bitwise;
2. one compaction round of the serving path (scorer and mover, `trikv.vllm.compactor.Compactor`) at the shapes
   of an 8B model (32 layers, 8 KV heads, head_dim 128, bf16): 64 requests due at B + beta = 2,176 entries and one
   32K-token prompt's first round, with its time and peak memory against `round_workspace_bytes`;
3. trikv's transformers cache and lean engine on a small random model: exact with no eviction, and the lean
   engine's tokens equal the transformers path's under eviction.

`--small` runs the same parts at toy shapes (what the test suite does on CPU). Prints one JSON report.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ..architectures import config_shape
from ..fast import accelerate
from ..geometry import RopeGeometry
from ..policies import make_policy
from ..settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH
from ..calibration import QueryStats
from ..vllm.compactor import DEFAULT_ROUND_WORKSPACE_BYTES, CompactionOp, Compactor
from ..vllm.pages import PageCodec

# vLLM 0.32's KVCacheLayout: the memory order of the logical axes [L, B, H, N, C] (C = keys then values)
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


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


def check_round(device: str, dtype: torch.dtype, small: bool, workspace: int, requests_due: int, long_prompt: int,
                budget: int, divide_length: int, block_size: int = 16) -> dict:
    """One round over `requests_due` requests at budget + divide_length entries and one `long_prompt`-token first
    round, in layout LBNHC: wall time, peak memory above what was allocated before, the cap."""
    config = model_config(small)
    shape = config_shape(config)
    policy = make_policy("triattention", stats=synthetic_stats(config))
    policy.bind_geometry(RopeGeometry.from_config(config), shape)
    accelerate(policy)
    trigger = budget + divide_length
    lengths = [trigger] * requests_due + [long_prompt]
    blocks_per = [-(-length // block_size) for length in lengths]
    caches = layout_views(LAYOUTS["LBNHC"], shape.num_layers, sum(blocks_per) + 1, shape.num_kv_heads, block_size,
                          shape.head_dim, dtype, device)
    generator = torch.Generator(device=device).manual_seed(0)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator, device=device).to(dtype))
    codec = PageCodec.learn(reference_write, caches[0], shape.num_kv_heads, block_size, shape.head_dim)
    block_ids, rounds, first = {}, [], 1
    for index, (length, count) in enumerate(zip(lengths, blocks_per)):
        request = f"request-{index}"
        block_ids[request] = list(range(first, first + count))
        first += count
        rounds.append(CompactionOp(request, position=length, length=length, budget=budget, prompt_length=64,
                                   kept_blocks=-(-budget // block_size), freed_blocks=0, free_blocks=0, held_blocks=0))
    compactor = Compactor(policy, True, 32, round_workspace_bytes=workspace)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        compactor.run(rounds, caches, [codec] * shape.num_layers, block_ids)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        transient = torch.cuda.max_memory_allocated() - before
    else:
        started = time.perf_counter()
        transient = cpu_transient_bytes(lambda: compactor.run(rounds, caches, [codec] * shape.num_layers, block_ids))
        seconds = time.perf_counter() - started
    cache_bytes = sum(cache.numel() for cache in caches) * caches[0].element_size()
    return {"layers": shape.num_layers, "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "dtype": str(dtype),
            "requests_due": requests_due, "long_prompt": long_prompt, "budget": budget, "seconds": round(seconds, 4),
            "transient_bytes": int(transient), "round_workspace_bytes": workspace,
            "within_cap": bool(transient <= workspace), "chunks": compactor.chunks, "cache_bytes": cache_bytes}


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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="toy shapes (CPU tests)")
    parser.add_argument("--workspace", type=int, default=DEFAULT_ROUND_WORKSPACE_BYTES, help="round_workspace_bytes")
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16
    started = time.perf_counter()
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "torch": torch.__version__}
    report["page_codec"] = check_page_codec(args.device, dtype, *((2, 16) if args.small else ()))
    if args.small:
        report["round"] = check_round(args.device, dtype, True, args.workspace, requests_due=8, long_prompt=600,
                                      budget=32, divide_length=16)
    else:
        report["round"] = check_round(args.device, dtype, False, args.workspace, requests_due=64, long_prompt=32768,
                                      budget=int(DEFAULT_BUDGET), divide_length=int(DEFAULT_DIVIDE_LENGTH))
    report["transformers"] = check_transformers(args.device, args.small)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["passed"] = (all(r["bitwise"] for r in report["page_codec"].values()) and report["round"]["within_cap"]
                        and all(v for k, v in report["transformers"].items() if isinstance(v, bool)))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return report


if __name__ == "__main__":
    raise SystemExit(0 if main()["passed"] else 1)
