"""`trikv vllm-args` (the `vllm serve` flags for a bounded cache) and `trikv serve` (vllm serve with them)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from ..settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH, DEFAULT_METHOD, DEFAULT_PREFILL_CHUNK_SIZE


def _add_settings(parser, default_model: str | None) -> None:
    parser.add_argument("--method", default=DEFAULT_METHOD, help="eviction method (`trikv vllm-args --list` lists those vLLM runs)")
    parser.add_argument("--budget", type=int, default=int(DEFAULT_BUDGET),
                        help=f"KV entries per (layer, KV head) after a round (default {int(DEFAULT_BUDGET)})")
    parser.add_argument("--divide-length", type=int, default=int(DEFAULT_DIVIDE_LENGTH),
                        help=f"slack beta: compact at budget + beta (default {int(DEFAULT_DIVIDE_LENGTH)})")
    parser.add_argument("--prefill-chunk-size", type=int, default=DEFAULT_PREFILL_CHUNK_SIZE,
                        help="tokens per prefill step of a prompt longer than budget + divide-length, compacted between "
                             "chunks: a request never holds more than budget + divide-length + this "
                             f"(default {DEFAULT_PREFILL_CHUNK_SIZE})")
    parser.add_argument("--stats", help="statistics: bundled name or path (default: the bundled stats of --model)")
    parser.add_argument("--no-protect-prompt", action="store_true", help="let prompt tokens compete for the budget")
    parser.add_argument("--max-request-budget", type=int,
                        help="largest budget a request may choose with vllm_xargs trikv_budget (default: --budget)")
    parser.add_argument("--allow-full-requests", action="store_true",
                        help='let a request choose full attention (vllm_xargs {"trikv_budget": "full"})')
    parser.add_argument("--max-rounds-per-step", type=int,
                        help="start at most this many compaction rounds per step; decoding requests past it wait up to one block "
                             "(default: max(4, ceil(2 max_num_seqs / divide_length)): four rounds cost about one decode "
                             "step at 8B-model shapes)")
    parser.add_argument("--no-session-reuse", action="store_true",
                        help="prefill every request whole: do not keep a finished request's bounded KV for the next turn of "
                             "its conversation (default: kept, reclaimable, and continued by a prompt that extends it)")
    parser.add_argument("--max-kept-sessions", type=int,
                        help="the most finished requests' states kept at once (default: vLLM's max_num_seqs)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="method option, e.g. recent_window=8 (JSON values; repeatable)")
    parser.add_argument("--model", default=default_model,
                        help="model to check the settings against (bundled name or path)" if default_model is None
                        else "bundled name, local path or hub id (default smollm2-135m)")


def _settings(args) -> dict:
    import json

    from ..policies import REGISTRY

    options = {}
    for item in args.option:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--option takes NAME=VALUE, got {item!r}")
        try:
            options[name] = json.loads(value)
        except json.JSONDecodeError:
            options[name] = value
    stats = args.stats
    if stats is None and args.method in REGISTRY and REGISTRY[args.method].needs_stats:
        stats = args.model
        if stats is None:
            raise ValueError(f"method {args.method!r} needs --stats (a bundled name or a `trikv calibrate` file) or --model")
    limits = {"max_request_budget": args.max_request_budget} if args.max_request_budget is not None else {}
    if args.allow_full_requests:
        limits["allow_full_requests"] = True
    if args.max_rounds_per_step is not None:
        limits["max_rounds_per_step"] = args.max_rounds_per_step
    if args.no_session_reuse:
        limits["session_reuse"] = False
    if args.max_kept_sessions is not None:
        limits["max_kept_sessions"] = args.max_kept_sessions
    return dict(method=args.method, budget=args.budget, divide_length=args.divide_length, stats=stats,
                protect_prompt=not args.no_protect_prompt, prefill_chunk_size=args.prefill_chunk_size, model=args.model,
                **limits, **options)


def add_vllm_commands(sub) -> None:
    p = sub.add_parser("vllm-args", help="print the `vllm serve` flags that bound every request's KV cache")
    _add_settings(p, default_model=None)
    p.add_argument("--list", action="store_true", help="list the methods that run inside vLLM and exit")
    p.set_defaults(func=cmd_vllm_args)

    p = sub.add_parser("serve", help="start `vllm serve` with a bounded KV cache (OpenAI-compatible HTTP server)")
    _add_settings(p, default_model="smollm2-135m")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dry-run", action="store_true", help="print the vllm serve command instead of running it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="further `vllm serve` arguments, after `--`")
    p.set_defaults(func=cmd_serve)


def cmd_vllm_args(args) -> int:
    from . import serve_flags, serving_methods
    from .support import V2_RUNNER_ENV

    if args.list:
        print("\n".join(serving_methods()))
        return 0
    print(shlex.join(serve_flags(**_settings(args))))
    # on stderr, so that `vllm serve MODEL $(trikv vllm-args ...)` takes the flags alone
    print(f"# on CUDA run vllm serve with {V2_RUNNER_ENV}=0 in its environment (trikv runs on vLLM's V1 model runner; "
          "trikv serve sets it)", file=sys.stderr)
    return 0


def serve_command(args) -> list[str]:
    from ..models import REGISTRY, resolve_model_path
    from . import serve_flags

    settings = _settings(args)
    path = resolve_model_path(args.model)
    command = [sys.executable, "-m", "trikv.vllm.launch", "serve", path, "--host", args.host, "--port", str(args.port)]
    if args.model in REGISTRY:
        command += ["--served-model-name", args.model]
    extra = list(args.vllm_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return command + serve_flags(**settings) + extra


def cmd_serve(args) -> int:
    from .support import V2_RUNNER_ENV

    command = serve_command(args)  # engine_args has set VLLM_USE_V2_MODEL_RUNNER=0 here: vLLM inherits it
    shown = f"{V2_RUNNER_ENV}={os.environ[V2_RUNNER_ENV]} {shlex.join(command)}"
    if args.dry_run:
        print(shown)
        return 0
    print(f"[trikv] {shown}", flush=True)
    print("[trikv] starting vLLM's OpenAI server: loading the model and allocating the KV pool take a minute or two "
          "on a CPU; vLLM logs 'Application startup complete' when it answers", flush=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if "VLLM_PLUGINS" not in os.environ:  # serve GET /trikv/stats too (vLLM loads named endpoint plugins only)
        from .endpoint import plugins_setting

        os.environ["VLLM_PLUGINS"] = plugins_setting()
    os.execv(command[0], command)  # vLLM replaces this process: signals (Ctrl-C, SIGTERM) reach it directly
