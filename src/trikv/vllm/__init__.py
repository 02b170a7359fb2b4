"""trikv inside vLLM: a bounded KV cache per request in the serving engine.

Offline:

    from vllm import LLM
    import trikv.vllm
    llm = LLM(model_path, **trikv.vllm.engine_args(method="triattention", budget=512, stats="smollm2-135m"))

Server: `vllm serve MODEL $(trikv vllm-args --method triattention --budget 512 --stats smollm2-135m)`, or
`trikv serve`, which starts `vllm serve` with those flags and trikv's defaults (the bundled model and its
statistics).

Everything goes through vLLM's own extension points: a scheduler class (`scheduler_cls`), a worker class
(`worker_cls`) and the settings in `additional_config["trikv"]`. Without them vLLM runs untouched. A bounded
request holds at most budget + divide_length + one prefill chunk of KV whatever its length (long prompts are
prefilled in chunks of `prefill_chunk_size`, compacted between them), so the KV pool need only hold that much
per request: an engine whose pool is smaller than max_model_len starts and serves prompts up to max_model_len
(`capacity.py`). Methods:
`trikv.vllm.serving_methods()` (TriAttention and its ablations, StreamingLLM, Knorm). Supported vLLM:
`SUPPORTED_VLLM`; see `support.py` for the features that are refused.

A request may choose its own budget, or full attention, within the server's limits (`max_request_budget`,
`allow_full_requests`): `SamplingParams(extra_args={"trikv_budget": 512})`, or over HTTP
`extra_body={"vllm_xargs": {"trikv_budget": 512}}` (`"full"` for full attention); a value outside the limits,
beam search and streaming-input sessions get HTTP 400 with the reason (`frontend.py`), and the engine refuses
what reaches it another way (`scheduler.py`).

On CUDA the engine arguments also select what a compacted cache needs: vLLM's V1 model runner
(`VLLM_USE_V2_MODEL_RUNNER=0` in this process's environment, which vLLM's engine processes inherit) and
PIECEWISE CUDA graphs (attention outside the graphs); `support.py` refuses the rest at start-up.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex

from ..settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH, DEFAULT_METHOD, DEFAULT_MIN_DECODE_ROOM, DEFAULT_PREFILL_CHUNK_SIZE

# public name -> submodule, imported on first use: `import trikv.vllm` (and the `trikv` command's parser) stays
# light; vLLM and torch load when an engine is configured
_EXPORTS = {
    "serving_methods": "settings", "BoundedKVSettings": "settings", "SettingsError": "settings",
    "RequestSettingsError": "settings", "REQUEST_BUDGET_KEY": "settings", "MIN_BUDGET": "settings",
    "CONFIG_KEY": "settings", "UnsupportedEngineError": "support", "SUPPORTED_VLLM": "support",
    "check_vllm_version": "support", "check_model": "support", "REQUEST_SESSION_KEY": "settings",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value

SCHEDULER_CLASS = "trikv.vllm.scheduler.TriKVScheduler"
WORKER_CLASS = "trikv.vllm.worker.TriKVWorker"


def engine_args(
    method: str = DEFAULT_METHOD,
    budget: int = int(DEFAULT_BUDGET),
    divide_length: int = int(DEFAULT_DIVIDE_LENGTH),
    stats: str | None = None,
    protect_prompt: bool = True,
    min_decode_room: int = DEFAULT_MIN_DECODE_ROOM,
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE,
    model: str | None = None,
    compilation_config: dict | None = None,
    prefix_caching: bool = False,
    **options,
) -> dict:
    """Keyword arguments for `vllm.LLM(...)` / `vllm.EngineArgs(...)` that bound every request's KV cache.

    method / budget / divide_length / stats / protect_prompt / min_decode_room / prefill_chunk_size: as in trikv's
    transformers caches (`stats`: bundled name or path, for methods that need statistics; a request whose prefill
    would take it past budget + divide_length is prefilled at most `prefill_chunk_size` tokens per step, compacted
    between chunks, so it never holds more than budget + divide_length + prefill_chunk_size entries and vLLM's
    pool need only hold that much per request, not max_model_len). `model`: when given, the
    model's config is checked here, before vLLM starts (family, statistics' shape and RoPE). Other keyword
    arguments are method options (e.g. `recent_window=8`) or the trikv settings `allow_untested_platform`,
    `record_rounds`, `round_workspace_bytes`, `max_request_budget`, `allow_full_requests`,
    `max_rounds_per_step`, `session_reuse` (default True: a conversation's next turn continues the bounded cache its
    last turn left, `sessions.py`) and `max_kept_sessions`. `method="full"` returns no arguments: plain vLLM.

    `prefix_caching`: vLLM's automatic prefix caching (off unless asked: with a bounded cache a request reuses at
    most the cached prefix below budget + divide_length, on its prefill-chunk grid, while every request's first
    round then copies its first blocks out of the cache; see `scheduler.py`).

    Besides trikv's scheduler, worker and settings, the arguments turn off async scheduling, set prefix caching
    as asked, and set `compilation_config={"cudagraph_mode": "PIECEWISE"}` (merged into `compilation_config` when given: on
    CUDA attention then runs outside graphs, so it reads each step's compacted lengths; the CPU build runs no
    graphs). They also set `VLLM_USE_V2_MODEL_RUNNER=0` in this process's environment (inherited by vLLM's engine
    processes: the V2 runner is vLLM 0.32's CUDA default, and trikv runs on V1); a value selecting V2 is refused.
    """
    from . import frontend
    from .settings import CONFIG_KEY, BoundedKVSettings
    from .support import CUDAGRAPH_MODE, check_model, check_vllm_version

    check_vllm_version()
    if method == "full":
        return {}
    frontend.register()  # the request checks in this process (`LLM`), where vLLM's plugin entry points are not loaded
    select_v1_runner()
    settings_only = ("allow_untested_platform", "record_rounds", "round_workspace_bytes", "max_request_budget", "allow_full_requests",
                     "max_rounds_per_step", "session_reuse", "max_kept_sessions")
    extra = {name: options.pop(name) for name in settings_only if name in options}
    settings = BoundedKVSettings(method=method, budget=budget, divide_length=divide_length, stats=stats,
                                 protect_prompt=protect_prompt, min_decode_room=min_decode_room,
                                 prefill_chunk_size=prefill_chunk_size, options=options, **extra)
    if model is not None:
        from transformers import AutoConfig

        from ..models import resolve_model_path

        path = resolve_model_path(model)
        check_model(AutoConfig.from_pretrained(path), settings, path)
    elif settings.needs_stats:
        from ..calibration import load_stats

        load_stats(settings.stats)  # the file exists and is a trikv statistics file
    return {
        "scheduler_cls": SCHEDULER_CLASS,
        "worker_cls": WORKER_CLASS,
        "enable_prefix_caching": bool(prefix_caching),
        "async_scheduling": False,
        "compilation_config": {"cudagraph_mode": CUDAGRAPH_MODE, **(compilation_config or {})},
        "additional_config": {CONFIG_KEY: settings.to_config()},
    }


def select_v1_runner() -> None:
    """Set `VLLM_USE_V2_MODEL_RUNNER=0` in this process's environment (vLLM's engine processes inherit it);
    refuse a value that selects the V2 runner."""
    from .support import V2_RUNNER_ENV, UnsupportedEngineError

    value = os.environ.get(V2_RUNNER_ENV)
    if value is not None and value.strip() != "0":
        raise UnsupportedEngineError(f"{V2_RUNNER_ENV}={value} selects vLLM's V2 model runner, which trikv does not "
                                     f"support: unset it or set {V2_RUNNER_ENV}=0")
    os.environ[V2_RUNNER_ENV] = "0"


def session_stats(llm) -> dict:
    """What session reuse did so far in the engine of `llm` (`vllm.LLM`): states kept, their blocks, hits, partial
    hits (with the tokens reused), misses and drops (`SessionStore.stats`). Over HTTP: `GET /trikv/stats`."""
    from .session_reuse import ENGINE_UTILITY

    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)  # in-process engine core
    if core is not None:
        return getattr(core, ENGINE_UTILITY)()
    return client.call_utility(ENGINE_UTILITY)


def serve_flags(**settings) -> list[str]:
    """The `vllm serve` command-line flags equivalent to `engine_args(**settings)` (the V1 runner is chosen by
    the environment: run `vllm serve` with VLLM_USE_V2_MODEL_RUNNER=0, as `trikv serve` does)."""
    args = engine_args(**settings)
    if not args:
        return []
    return [
        "--scheduler-cls", args["scheduler_cls"],
        "--worker-cls", args["worker_cls"],
        "--enable-prefix-caching" if args["enable_prefix_caching"] else "--no-enable-prefix-caching",
        "--no-async-scheduling",
        "--compilation-config", json.dumps(args["compilation_config"], sort_keys=True),
        "--additional-config", json.dumps(args["additional_config"], sort_keys=True),
    ]


def serve_flags_text(**settings) -> str:
    return shlex.join(serve_flags(**settings))


__all__ = [
    "engine_args",
    "select_v1_runner",
    "serve_flags",
    "serve_flags_text",
    "session_stats",
    "serving_methods",
    "BoundedKVSettings",
    "SettingsError",
    "RequestSettingsError",
    "REQUEST_BUDGET_KEY",
    "MIN_BUDGET",
    "UnsupportedEngineError",
    "SUPPORTED_VLLM",
    "check_vllm_version",
]
