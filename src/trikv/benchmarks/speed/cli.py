"""`trikv bench speed` arguments and entry point."""

from __future__ import annotations

import sys
from pathlib import Path

from .config import DEFAULT_BUDGETS, DEFAULT_CONTEXTS, SpeedConfig
from ...settings import DEFAULT_DIVIDE_LENGTH, DEFAULT_PREFILL_CHUNK_SIZE


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_speed_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="bundled name, local folder or hub id")
    parser.add_argument("--stats", default=None, help="TriAttention statistics (default: the model's bundled stats)")
    parser.add_argument("--contexts", type=_ints, default=DEFAULT_CONTEXTS, help="comma list (default 1024,...,32768)")
    parser.add_argument("--methods", type=_names, default=["full", "triattention"], help="comma list; 'full' is the reference")
    parser.add_argument("--budgets", type=_ints, default=DEFAULT_BUDGETS, help="comma list (default 256,512,1024,2048)")
    parser.add_argument("--batch-sizes", type=_ints, default=[1, 4], help="comma list (default 1,4)")
    parser.add_argument("--engines", type=_names, default=["lean"], help="lean and/or transformers (default lean)")
    parser.add_argument("--steps", type=int, default=256, help="measured decode steps per configuration")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured steps first (the fill's last round runs here)")
    parser.add_argument("--divide-length", type=int, default=int(DEFAULT_DIVIDE_LENGTH), help="slack beta")
    parser.add_argument("--seed-tokens", type=int, default=512, help="length of the real prefill that is tiled")
    parser.add_argument("--fill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK_SIZE,
                        help="bounded caches are filled in chunks of this size (default: the caches' prefill chunk, "
                             "as trikv.generate feeds a long prompt)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--max-kv-gb", type=float, default=8.0, help="skip configurations whose KV cache exceeds this")
    parser.add_argument("--spread", default="on", choices=["on", "off", "both"],
                        help="TriAttention scoring ahead between rounds (default on; 'both' runs each budget twice)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp peer")
    parser.add_argument("--llama-cpp-threads", type=int, default=None, help="default: the torch thread count")
    parser.add_argument("--no-engine-check", action="store_true",
                        help="skip the lean-vs-transformers check (runs when both engines are selected)")
    parser.add_argument("--engine-check-steps", type=int, default=48)
    parser.add_argument("--memory-run", type=int, default=0, metavar="TOKENS",
                        help="instead of the grid: generate TOKENS real tokens with the first method and budget, "
                             "sampling RSS and KV entries (memory.json / memory.png)")
    parser.add_argument("--whole-generation", type=_ints, default=[], metavar="N,...",
                        help="instead of the grid: decode a real prompt to prompt + N tokens for each N, full attention and "
                             "each bounded configuration interleaved, rounds included; speed-ups with 95%% intervals, "
                             "checked against the round cost (whole.json / whole.txt / whole.png)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of --whole-generation (default 64)")
    parser.add_argument("--out", default="bench-speed", help="output folder (speed.json, speed.csv, speed.png, speed.txt)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=speed_main)


def speed_main(args) -> int:
    import torch

    from .config import check_methods_and_engines
    from .runner import _load, _load_stats, memory_run, run_speed

    config = SpeedConfig(
        model=args.model, contexts=args.contexts, methods=args.methods, budgets=args.budgets,
        batch_sizes=args.batch_sizes, engines=args.engines, steps=args.steps, warmup=args.warmup,
        divide_length=args.divide_length, seed_tokens=args.seed_tokens, fill_chunk=args.fill_chunk,
        threads=args.threads, stats=args.stats, llama_cpp=not args.no_llama_cpp,
        llama_cpp_threads=args.llama_cpp_threads, engine_check=not args.no_engine_check,
        engine_check_steps=args.engine_check_steps, max_kv_gb=args.max_kv_gb, out=args.out, spread=args.spread,
        progress=not args.no_progress, command="trikv " + " ".join(sys.argv[1:]),
        whole_generation=args.whole_generation, prompt_tokens=args.prompt_tokens,
    )
    check_methods_and_engines(config)  # before a model is loaded, in every mode
    if args.whole_generation and args.memory_run:
        raise SystemExit("--whole-generation and --memory-run are separate runs: give one of them")
    if args.memory_run:
        if config.threads:
            torch.set_num_threads(config.threads)
        model, tokenizer = _load(config)
        stats = _load_stats(config, model)
        method = next((m for m in config.methods if m != "full"), "full")
        record = memory_run(model, tokenizer, stats, method, config.budgets[0], args.memory_run, config.divide_length,
                            Path(config.out), engine=config.engines[0], progress=config.progress, command=config.command)
        print(f"{method} B={record['budget']}: {record['tokens']} tokens, at most {record['max_entries_per_layer_head']} "
              f"entries per (layer, KV head) (limit {record['limit']}), RSS {record['samples'][0]['rss_mb']:.0f} -> "
              f"{record['samples'][-1]['rss_mb']:.0f} MiB, {record['rounds']} rounds")
        return 0
    if args.whole_generation:
        from .whole import run_whole_generation

        if config.threads:
            torch.set_num_threads(config.threads)
        model, tokenizer = _load(config)
        run_whole_generation(config, model, tokenizer, _load_stats(config, model))
        return 0
    run_speed(config)
    return 0


try:  # `trikv bench speed`
    from .. import register_bench

    register_bench("speed", add_speed_arguments, "decode throughput, latency and memory vs context, method and budget")
except ImportError:  # pragma: no cover
    pass
