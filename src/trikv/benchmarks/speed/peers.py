"""llama.cpp (llama-cpp-python, optional) decoding the same GGUF at the same contexts, in the same run."""

from __future__ import annotations

import importlib.util
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .machine import kv_bytes_per_token
from .filling import SeedKV
from .decode import _percentile
from .config import SpeedConfig, _label, _log


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


def run_llama_cpp(config: SpeedConfig, model, seed: SeedKV, filler, results, weight_bytes, bandwidth) -> dict:
    if not config.llama_cpp:
        return {"skipped": "disabled (--no-llama-cpp)"}
    if not llama_cpp_available():
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python) - peer comparison skipped"}
    from ...models import REGISTRY

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
