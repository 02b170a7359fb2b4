"""Time one serving-path compaction round (`trikv.vllm.compactor.Compactor.run`) in three page arrangements,
side by side in one process: rows (FlashAttention-style pages: a (head, slot)'s D elements consecutive), keys
transposed per page exactly as vLLM's CPU backend stores fp32 keys (moved as whole slot runs), and keys tiled in
pairs of dimensions, a tiling like the one it uses for bf16 keys on AMX machines (addressed per element).
Shapes of the bundled SmolLM2 (30 layers, 3 KV heads, head_dim 64) with its statistics; no vLLM needed.

    python scripts/measure_round_pages.py [--requests 1] [--budget 256] [--slack 64] [--rounds 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

import trikv
from trikv.architectures import config_shape
from trikv.benchmarks.gpu_check import reference_write
from trikv.fast import accelerate
from trikv.geometry import RopeGeometry
from trikv.models import load_model
from trikv.policies import make_policy
from trikv.vllm.compactor import CompactionOp, Compactor
from trikv.vllm.pages import PageCodec


def head_pages(store):
    """A KV write into a [blocks, H, N, 2D] cache whose per-head page is N x D keys (arranged by `store`) then
    N x D values as [N, D], the way vLLM's CPU backend views a page."""
    def write(keys, values, cache, slots):
        N, D = cache.shape[2], keys.shape[-1]
        pages = cache.view(cache.shape[0], cache.shape[1], 2, N * D)  # [blocks, H, keys | values, N x D]
        blocks, offsets = slots // N, slots % N
        store(pages[:, :, 0], blocks, offsets, keys, N, D)
        pages[:, :, 1].view(cache.shape[0], cache.shape[1], N, D)[blocks, :, offsets] = values
    return write


def transposed(region, blocks, offsets, keys, N, D):  # keys [D, N] per head
    region.view(*region.shape[:2], D, N)[blocks, :, :, offsets] = keys


def tiled(region, blocks, offsets, keys, N, D):  # keys [D / 2, N, 2] per head
    region.view(*region.shape[:2], D // 2, N, 2)[blocks, :, :, offsets] = keys.view(-1, keys.shape[1], D // 2, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1, help="requests due in the round")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--slack", type=int, default=64, help="entries past the budget when a round is due")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model("smollm2-135m")
    shape = config_shape(model.config)
    L, H, D, N = shape.num_layers, shape.num_kv_heads, shape.head_dim, 32
    policy = make_policy("triattention", stats=trikv.load_stats("smollm2-135m"))
    policy.bind_geometry(RopeGeometry.from_config(model.config), shape)
    accelerate(policy)
    length = args.budget + args.slack
    blocks = -(-length // N)
    print(f"one round of {args.requests} request(s): {length} -> {args.budget} entries per (layer, KV head), "
          f"{L} layers x {H} KV heads x head_dim {D}, fp32, {args.threads} thread(s)")
    for name, write in (("rows (FlashAttention layouts)", reference_write),
                        ("keys transposed (vLLM CPU, fp32)", head_pages(transposed)),
                        ("keys tiled in pairs (like vLLM CPU bf16 on AMX)", head_pages(tiled))):
        caches = [torch.randn(blocks * args.requests + 1, H, N, 2 * D) for _ in range(L)]
        codec = PageCodec.learn(write, caches[0], H, N, D)
        located = codec.locate(torch.zeros(1, 1, dtype=torch.long), caches[0])
        compactor = Compactor(policy, True, 32)
        block_ids = {f"r{r}": list(range(1 + r * blocks, 1 + (r + 1) * blocks)) for r in range(args.requests)}
        seconds = []
        for step in range(args.rounds + 3):
            rounds = [CompactionOp(request, position=length + 64 * step, length=length, budget=args.budget,
                                   prompt_length=64, kept_blocks=-(-args.budget // N), freed_blocks=0, free_blocks=0,
                                   held_blocks=0) for request in block_ids]
            started = time.perf_counter()
            compactor.run(rounds, caches, [codec] * L, block_ids)
            seconds.append(time.perf_counter() - started)
        mean = sum(seconds[3:]) / args.rounds
        print(f"  {name:<48} keys by {located.keys.along:<8} values by {located.values.along:<8} "
              f"{mean * 1000:6.1f} ms per round")


if __name__ == "__main__":
    main()
