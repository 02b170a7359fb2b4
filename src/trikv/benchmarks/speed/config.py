"""What a speed run measures (`SpeedConfig`), its log line and its labels."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...settings import DEFAULT_DIVIDE_LENGTH, DEFAULT_PREFILL_CHUNK_SIZE

if TYPE_CHECKING:
    from .decode import RunResult

DEFAULT_CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768]
DEFAULT_BUDGETS = [256, 512, 1024, 2048]


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
    divide_length: int = int(DEFAULT_DIVIDE_LENGTH)
    seed_tokens: int = 512
    fill_chunk: int = DEFAULT_PREFILL_CHUNK_SIZE  # a longer forward on a bounded cache would exceed its bound (and warn)
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
    whole_generation: list[int] = field(default_factory=list)  # new tokens per whole generation (instead of the grid)
    prompt_tokens: int = 64  # the whole generations' prompt length


def _log(message: str, config: SpeedConfig) -> None:
    if config.progress:
        print(message, file=sys.stderr, flush=True)


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


def check_methods_and_engines(config: "SpeedConfig") -> None:
    """Refuse an unknown method or engine, naming the known ones."""
    from ...policies import REGISTRY

    for method in config.methods:
        if method not in REGISTRY:
            raise ValueError(f"unknown method {method!r}; available: {', '.join(REGISTRY)}")
    for engine in config.engines:
        if engine not in ("lean", "transformers"):
            raise ValueError(f"unknown engine {engine!r}; expected lean or transformers")
