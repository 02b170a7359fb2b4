"""The engine check: trikv's lean engine vs the transformers forward, identical greedy tokens."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from .filling import Filler
from .decode import DecodeRun
from .config import SpeedConfig, _log


class WeightFloor:
    """Only the weight GEMMs of one decode step (same shapes and fused weights as the lean engine): the floor
    any engine pays on this machine right now, measured in lockstep with the real steps."""

    def __init__(self, model, batch: int = 1, layout: str = "lean"):
        """layout "lean": the lean engine's fused, transposed weights; "stock": the model's own [out, in] weights."""
        from ...architectures import decoder
        from ...lean import LeanEngine

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
        from ...lean import _linear

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
    from ...lean import stock_layout_copy

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
