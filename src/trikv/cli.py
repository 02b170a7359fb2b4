"""`trikv` command line: calibrate, generate, chat, demo, methods, analyze, bench, vllm-args and serve (vLLM)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .settings import (DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH, DEFAULT_PREFILL_CHUNK_SIZE, DEMO_SAMPLING,  # numbers only
                       RECOMMENDED_CALIBRATION_TOKENS)
from .threads import add_threads_argument, apply_threads


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="compute pre-RoPE query statistics of a model from a text file")
    add_model_arguments(p)
    p.add_argument("--text-file", required=True, help="plain-text file to calibrate on")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--text-tokens", type=int, default=RECOMMENDED_CALIBRATION_TOKENS,
                   help=f"use at most this many tokens of the text (default {RECOMMENDED_CALIBRATION_TOKENS:,}: the length "
                        "docs/calibration.md measures as enough on every model it ran; more does no harm)")
    p.add_argument("--chunk-tokens", type=int, default=2048, help="tokens per forward pass (default 2048)")
    p.add_argument("--source", help="description of the text stored in the metadata (default: the file name)")
    p.add_argument("--all-layers", action="store_true",
                   help="cover every layer (for analysis); by default a hybrid model's statistics cover the "
                        "full-attention layers its cache bounds")
    p.add_argument("--skip-sanity-check", action="store_true",
                   help="calibrate even if the model does not answer a known prompt sanely (checked by default)")
    add_threads_argument(p)
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    import torch

    from .calibration import calibrate
    from .prompts import document_ids
    from .validation import integer

    integer("--text-tokens", args.text_tokens)
    integer("--chunk-tokens", args.chunk_tokens, minimum=2)
    apply_threads(args.threads, args.device)
    text_path = Path(args.text_file)
    if not text_path.is_file():
        sys.exit(f"trikv calibrate: no such text file: {text_path}")
    out = Path(args.out)
    if out.is_dir():  # checked before the calibration runs, not after
        sys.exit(f"trikv calibrate: --out {out} is a directory; give a file name such as {out / 'stats.safetensors'}")
    if not out.parent.exists():
        sys.exit(f"trikv calibrate: the folder of --out {out} does not exist")
    text = text_path.read_text(encoding="utf-8")
    if not text.strip():
        sys.exit(f"trikv calibrate: {text_path} is empty")
    model, tokenizer = load_command_model(args)
    if not args.skip_sanity_check:
        from .sanity import ModelSanityError, check_model_answers

        try:
            check_model_answers(model, tokenizer, args.model)
        except ModelSanityError as error:
            sys.exit(f"trikv calibrate: {error} (--skip-sanity-check to calibrate anyway)")
    ids = torch.tensor(document_ids(tokenizer, text)[: args.text_tokens])
    if ids.numel() < RECOMMENDED_CALIBRATION_TOKENS:
        print(f"trikv calibrate: warning: calibrating on {ids.numel():,} tokens, fewer than the "
              f"{RECOMMENDED_CALIBRATION_TOKENS:,} that were enough on every model measured (docs/calibration.md): "
              "the statistics may depend on which text this was", file=sys.stderr)
    started = time.perf_counter()
    stats = calibrate(model, ids, source=args.source or text_path.name, chunk_tokens=args.chunk_tokens, model_name=args.model,
                      all_layers=args.all_layers)
    elapsed = time.perf_counter() - started
    stats.save(args.out)
    summary = stats.summary()
    covered = "" if len(stats.layers) == model.config.num_hidden_layers else f" (layers {stats.layers}: the ones the cache bounds)"
    print(f"calibrated {args.model} on {summary['tokens']} tokens in {elapsed:.1f} s -> {args.out}{covered}")
    print(
        f"concentration over {summary['heads']} (layer, query head) pairs: mean R = {summary['mean_R']:.3f}, "
        f"R > 0.9: {summary['share_R_gt_0.9']:.1%}, R > 0.95: {summary['share_R_gt_0.95']:.1%}"
    )
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a bounded KV cache")
    add_model_arguments(p)
    p.add_argument("--prompt", help="prompt text (or use --prompt-file)")
    p.add_argument("--prompt-file", help="file with one prompt, or a .jsonl of {'prompt': ...} rows for a batch")
    p.add_argument("--method", default="triattention", help="eviction method (`trikv methods` lists them)")
    p.add_argument("--budget", type=int, default=None,
                   help=f"KV entries per (layer, KV head) after a round (default {int(DEFAULT_BUDGET)})")
    p.add_argument("--divide-length", type=int, default=None,
                   help=f"slack beta: compress at budget + beta (default {int(DEFAULT_DIVIDE_LENGTH)})")
    p.add_argument("--prefill-chunk-size", type=int, default=DEFAULT_PREFILL_CHUNK_SIZE,
                   help="a long prompt is prefilled in chunks of this many tokens, with rounds between them")
    p.add_argument("--stats", help="calibration statistics (default: the bundled stats of --model)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="the longest answer")
    p.add_argument("--min-new-tokens", type=int, default=0, help="end-of-sequence is forbidden before this many tokens")
    add_sampling_arguments(p, temperature=0.0)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print a JSON record instead of text")
    p.add_argument("--engine", default="auto", choices=["auto", "transformers", "lean", "mlx"],
                   help="model forward: auto (trikv's lean decoder where it runs the model, transformers' forward for "
                        "hybrid models), transformers, lean (same tokens, faster) or mlx-lm with trikv's MLX cache "
                        "(pip install 'trikv[mlx]')")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], help="--engine mlx: store the kept K/V quantised to 8 or 4 bits")
    add_threads_argument(p)
    p.set_defaults(func=cmd_generate)


def add_model_arguments(parser, default: str = "smollm2-135m") -> None:
    """--model, --device and --dtype, under the same names and defaults in every command that loads a model."""
    parser.add_argument("--model", default=default, help="bundled name, local model folder or hub id")
    parser.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda (the torch engines)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the model weights' dtype (the torch engines; statistics are accumulated in float64)")


def load_command_model(args):
    """(model, tokenizer) as --model, --device and --dtype say."""
    import torch

    from .models import load_model

    return load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)


def add_sampling_arguments(parser, temperature: float, top_p: float = 0.95, seed: int = 0) -> None:
    """--temperature (0 = greedy), --top-p, --top-k and --seed, under the same names in every command that decodes."""
    parser.add_argument("--temperature", type=float, default=temperature,
                        help="sampling temperature; 0 decodes greedily (the paper samples at 0.6)")
    parser.add_argument("--top-p", type=float, default=top_p, help="with --temperature > 0: nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature > 0: keep the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=seed, help="random seed of the sampling")


def check_sampling(args) -> bool:
    """True when the arguments ask to sample (temperature > 0), after checking the sampling numbers."""
    from .validation import integer, positive, probability

    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.temperature == 0:
        return False
    positive("--temperature", args.temperature)
    probability("--top-p", args.top_p)
    integer("--top-k", args.top_k, minimum=0)
    return True


def resolve_engine(engine: str, model) -> str:
    """`auto`: the lean engine where it runs the model (llama, qwen2, qwen3, mistral), transformers' forward else."""
    if engine != "auto":
        return engine
    from .architectures import model_shape
    from .lean import LEAN_FAMILIES

    shape = model_shape(model)
    return "lean" if shape.model_type in LEAN_FAMILIES and not shape.is_hybrid else "transformers"


def read_prompt_file(path: Path) -> list[str]:
    """One prompt (a text file) or a batch (.jsonl rows with a "prompt" string); a bad row names its line."""
    if not path.is_file():
        sys.exit(f"trikv generate: no such prompt file: {path}")
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8")]
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            sys.exit(f"trikv generate: {path}:{number}: not valid JSON ({error.msg})")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            sys.exit(f"trikv generate: {path}:{number}: each row needs a \"prompt\" string")
        prompts.append(row["prompt"])
    if not prompts:
        sys.exit(f"trikv generate: {path} holds no prompts")
    return prompts


def cmd_generate(args) -> int:
    from .calibration import load_stats
    from .generation import generate
    from .models import REGISTRY as MODELS
    from .models import check_model_name
    from .policies import REGISTRY
    from .validation import integer

    if (args.prompt is None) == (args.prompt_file is None):
        sys.exit("trikv generate: give exactly one of --prompt and --prompt-file")
    if args.prompt_file:
        prompts = read_prompt_file(Path(args.prompt_file))
    else:
        prompts = [args.prompt]
    if args.engine != "mlx":
        apply_threads(args.threads)
    if not all(prompt.strip() for prompt in prompts):
        sys.exit("trikv generate: the prompt is empty")
    if args.method not in REGISTRY:
        sys.exit(f"trikv generate: unknown method {args.method!r}; available: {', '.join(REGISTRY)}")
    # every number is checked before the model loads
    integer("--max-new-tokens", args.max_new_tokens)
    integer("--min-new-tokens", args.min_new_tokens, minimum=0)
    integer("--prefill-chunk-size", args.prefill_chunk_size, minimum=2)
    sample = check_sampling(args)
    for name, value in (("--budget", args.budget), ("--divide-length", args.divide_length)):
        if value is not None:
            integer(name, value)
    needs_stats = REGISTRY[args.method].needs_stats
    check_model_name(args.model)  # a mistyped name is an unknown model, not a model without statistics
    if needs_stats and args.stats is None and args.model not in MODELS:
        sys.exit(f"trikv generate: method {args.method!r} needs calibration statistics and {args.model!r} has no "
                 "bundled ones: pass --stats FILE (make one with `trikv calibrate --model ... --text-file ... --out FILE`)")
    if args.engine == "mlx":
        return _generate_mlx(args, prompts, needs_stats, sample)
    if args.kv_bits is not None:
        sys.exit("trikv generate: --kv-bits is for --engine mlx")
    model, tokenizer = load_command_model(args)
    options = {}
    if args.budget is not None:
        options["budget"] = args.budget
    if REGISTRY[args.method].policy_class.evicts:
        options["prefill_chunk_size"] = args.prefill_chunk_size
    if needs_stats:
        options["stats"] = load_stats(args.stats or args.model, model)
    result = generate(
        model, tokenizer, prompts, method=args.method, divide_length=args.divide_length,
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, do_sample=sample,
        temperature=args.temperature if sample else 1.0, top_p=args.top_p if sample else 1.0, top_k=args.top_k,
        seed=args.seed, chat=not args.no_chat, progress=True, engine=resolve_engine(args.engine, model), **options,
    )
    cache = result.cache
    record = {
        "method": args.method, "budget": getattr(cache, "budget", None), "divide_length": getattr(cache, "divide_length", None),
        "peak_entries": result.peak_entries, "texts": result.texts,
        "decode_tokens_per_second": result.decode_tokens_per_second, "peak_cache_bytes": result.peak_cache_bytes,
        "final_cache_bytes": result.final_cache_bytes, "compression_rounds": result.compression_rounds,
    }
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        for text in result.texts:
            print(text)
            print()
        print(
            f"[{args.method}] {result.decode_tokens_per_second:.1f} tok/s, KV peak {result.peak_cache_bytes / 2**20:.2f} MiB, "
            f"final {result.final_cache_bytes / 2**20:.2f} MiB, {result.compression_rounds} rounds"
        )
    return 0


def _add_chat(sub) -> None:
    p = sub.add_parser(
        "chat", help="an interactive chat on one bounded KV cache, showing the KV it holds after each turn",
        description="Chat with a model on one bounded KV cache: each line you type is the next user message, "
                    "appended to what the cache holds (nothing is re-read); after each reply the K/V held is printed "
                    "beside what full attention would hold. /reset starts over, /quit (or end of input) ends.",
        epilog="example: trikv chat --budget 512   (or: printf 'Hi\nWhat did I say?\n' | trikv chat)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--method", default="triattention", help="eviction method (`trikv methods` lists them)")
    p.add_argument("--budget", type=int, default=int(DEFAULT_BUDGET), help="KV entries per (layer, KV head) after a round")
    p.add_argument("--divide-length", type=int, default=int(DEFAULT_DIVIDE_LENGTH), help="slack beta: a round at budget + beta")
    p.add_argument("--prefill-chunk-size", type=int, default=DEFAULT_PREFILL_CHUNK_SIZE,
                   help="a long message is prefilled in chunks of this many tokens, with rounds between them")
    p.add_argument("--stats", help="calibration statistics (default: the bundled stats of --model)")
    p.add_argument("--system", help="system message (models with a chat template)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply")
    add_sampling_arguments(p, temperature=0.0)
    p.add_argument("--engine", default="auto", choices=["auto", "transformers", "lean", "mlx"],
                   help="model forward: auto (the lean decoder where it runs the model), transformers, lean, or mlx "
                        "(mlx-lm with trikv's MLX cache: one prompt cache for the conversation)")
    add_threads_argument(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from .calibration import load_stats
    from .models import REGISTRY as MODELS
    from .models import check_model_name
    from .policies import REGISTRY
    from .session import Session, full_attention_bytes
    from .validation import integer

    if args.method not in REGISTRY:
        sys.exit(f"trikv chat: unknown method {args.method!r}; available: {', '.join(REGISTRY)}")
    integer("--max-new-tokens", args.max_new_tokens)
    integer("--budget", args.budget)
    integer("--divide-length", args.divide_length)
    integer("--prefill-chunk-size", args.prefill_chunk_size, minimum=2)
    sample = check_sampling(args)
    needs_stats = REGISTRY[args.method].needs_stats
    check_model_name(args.model)  # a mistyped name is an unknown model, not a model without statistics
    if needs_stats and args.stats is None and args.model not in MODELS:
        sys.exit(f"trikv chat: method {args.method!r} needs calibration statistics and {args.model!r} has no bundled "
                 "ones: pass --stats FILE (make one with `trikv calibrate --model ... --text-file ... --out FILE`)")
    apply_threads(args.threads)
    evicts = REGISTRY[args.method].policy_class.evicts
    if args.engine == "mlx":
        _torch_options_refused(args, "chat")
        mlx_backend = _import_mlx("chat")
        if args.method != "full" and args.method not in mlx_backend.methods():
            sys.exit(f"trikv chat: method {args.method!r} has no MLX cache; --engine mlx runs full, "
                     f"{', '.join(mlx_backend.methods())}")
        model, tokenizer = mlx_backend.load(args.model)
        options = {"stats": args.stats or args.model} if needs_stats else {}
        if evicts:
            options.update(budget=args.budget, divide_length=args.divide_length, prefill_chunk_size=args.prefill_chunk_size)
        session = mlx_backend.Session(model, tokenizer, method=args.method, system=args.system, **options)
        full_bytes = session.full_attention_bytes
        sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k) if sample else {}
        if sample and args.seed is not None:
            import mlx.core as mx

            mx.random.seed(args.seed)
    else:
        model, tokenizer = load_command_model(args)
        options = {"stats": load_stats(args.stats or args.model, model)} if needs_stats else {}
        if evicts:
            options.update(budget=args.budget, divide_length=args.divide_length, prefill_chunk_size=args.prefill_chunk_size)
        session = Session(model, tokenizer, method=args.method, system=args.system,
                          engine=resolve_engine(args.engine, model), **options)
        full_bytes = lambda tokens: full_attention_bytes(model, tokens)  # noqa: E731
        sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        seed=args.seed) if sample else {}
    interactive = sys.stdin.isatty()
    bound = getattr(session.cache, "peak_bound", None) if args.engine != "mlx" else (
        None if session.bounded is None else args.budget + args.divide_length + args.prefill_chunk_size)
    print(f"[trikv chat] {args.model}, {args.method}"
          + (f", budget {args.budget} + {args.divide_length} (at most {bound} entries per (layer, KV head))" if bound else "")
          + ". /reset starts over, /quit ends.", flush=True)
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            break
        message = line.strip()
        if not message:
            continue
        if message == "/reset":
            session.reset()
            print("[trikv chat] the conversation starts over (empty cache)", flush=True)
            continue
        session.send(message, max_new_tokens=args.max_new_tokens, **sampling)
        turn = session.turns[-1]
        print(f"assistant> {turn.reply.strip()}", flush=True)
        full = full_bytes(turn.tokens_seen)
        print(f"[KV held: {turn.held_entries} entries per (layer, KV head), {turn.held_bytes / 2**20:.2f} MiB "
              f"(full attention: {full / 2**20:.2f} MiB for {turn.tokens_seen} tokens); peak this turn "
              f"{turn.peak_bytes / 2**20:.2f} MiB; {turn.rounds} rounds so far; first token in "
              f"{turn.seconds_to_first_token:.2f} s]", flush=True)
    return 0


def _torch_options_refused(args, command: str) -> None:
    """--device and --dtype choose the torch engines' placement: mlx-lm runs its checkpoint on MLX's device."""
    if args.device != "cpu" or args.dtype != "float32":
        sys.exit(f"trikv {command}: --device and --dtype are for the torch engines; --engine mlx runs the model in its "
                 "checkpoint's dtype on MLX's device")


def _import_mlx(command: str):
    """trikv.mlx, or exit with how to install MLX."""
    try:
        import trikv.mlx as mlx_backend
        from trikv.mlx.model import require_mlx_lm

        require_mlx_lm()
    except ImportError as error:
        if error.name == "mlx_lm" and "Python" in str(error):
            sys.exit(f"trikv {command}: --engine mlx: {error}")
        sys.exit(f"trikv {command}: --engine mlx needs MLX and mlx-lm ({error.name} is missing): pip install 'trikv[mlx]'")
    return mlx_backend


def _generate_mlx(args, prompts: list[str], needs_stats: bool, sample: bool) -> int:
    _torch_options_refused(args, "generate")
    mlx_backend = _import_mlx("generate")
    from .mlx.generation import generate as mlx_generate

    if args.method != "full" and args.method not in mlx_backend.methods():
        sys.exit(f"trikv generate: method {args.method!r} has no MLX cache; --engine mlx runs full, "
                 f"{', '.join(mlx_backend.methods())}")
    model, tokenizer = mlx_backend.load(args.model)
    options = {"budget": args.budget} if args.budget is not None else {}
    if args.divide_length is not None:
        options["divide_length"] = args.divide_length
    if needs_stats:
        options["stats"] = args.stats or args.model
    result = mlx_generate(model, tokenizer, prompts, method=args.method, max_new_tokens=args.max_new_tokens,
                          min_new_tokens=args.min_new_tokens, do_sample=sample, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, chat=not args.no_chat, kv_bits=args.kv_bits,
                          progress=True, **options)
    bounded = result.caches[0][0].bounded if args.method != "full" else None
    record = {
        "method": args.method, "engine": "mlx", "budget": getattr(bounded, "budget", None),
        "divide_length": getattr(bounded, "divide_length", None), "kv_bits": args.kv_bits,
        "peak_entries": result.peak_entries, "texts": result.texts,
        "decode_tokens_per_second": result.decode_tokens_per_second, "peak_cache_bytes": result.peak_cache_bytes,
        "final_cache_bytes": result.final_cache_bytes, "compression_rounds": result.compression_rounds,
    }
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        for text in result.texts:
            print(text)
            print()
        print(f"[trikv] mlx {args.method}: {result.decode_tokens_per_second:.1f} tok/s, peak K/V "
              f"{result.peak_cache_bytes / 2**20:.2f} MiB, {result.compression_rounds} compression rounds", file=sys.stderr)
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="full attention vs TriAttention on the bundled model, side by side")
    add_model_arguments(p)
    p.add_argument("--stats", help="calibration statistics (default: the bundled stats of --model)")
    p.add_argument("--budget", type=int, default=256, help="TriAttention's KV entries per (layer, KV head) after a round")
    p.add_argument("--divide-length", type=int, default=int(DEFAULT_DIVIDE_LENGTH), help="slack beta: a round at budget + beta")
    p.add_argument("--prefill-chunk-size", type=int, default=DEFAULT_PREFILL_CHUNK_SIZE,
                   help="a long prompt is prefilled in chunks of this many tokens, with rounds between them")
    p.add_argument("--max-new-tokens", type=int, default=1500, help="tokens each run generates")
    p.add_argument("--compare-first", type=int, default=None, help="agreement is measured on the first N tokens (default: all)")
    p.add_argument("--prompt", help="override the default prompt")
    p.add_argument("--engine", default="auto", choices=["auto", "lean", "transformers", "mlx"],
                   help="decode loop for both runs: trikv's lean engine, the transformers model forward, mlx-lm with "
                        "trikv's MLX cache (full attention: mlx-lm's KVCache), or auto (the lean engine where it runs "
                        "the model, transformers for hybrid models; the default)")
    temperature, top_p, seed = DEMO_SAMPLING
    add_sampling_arguments(p, temperature=temperature, top_p=top_p, seed=seed)
    for action in p._actions:  # the demo's own default, and why
        if action.dest == "temperature":
            action.help = (f"sampling temperature; 0 decodes greedily. The demo samples at {temperature} by default: held "
                           "to 1,500 tokens at lower temperatures the bundled 135M model falls into loops")
    add_threads_argument(p)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from .demo import DEFAULT_PROMPT, run_demo
    from .validation import integer

    if args.engine == "mlx":
        _torch_options_refused(args, "demo")
        _import_mlx("demo")
    else:
        apply_threads(args.threads)
    integer("--prefill-chunk-size", args.prefill_chunk_size, minimum=2)
    sample = check_sampling(args)
    run_demo(args.model, args.stats, args.budget, args.divide_length, args.max_new_tokens, args.prompt or DEFAULT_PROMPT,
             args.compare_first, engine=args.engine, temperature=args.temperature if sample else None, top_p=args.top_p,
             seed=args.seed, top_k=args.top_k, device=args.device, dtype=args.dtype,
             prefill_chunk_size=args.prefill_chunk_size)
    return 0


def _add_methods(sub) -> None:
    p = sub.add_parser("methods", help="list the eviction methods and their rules",
                       epilog="example: trikv methods --markdown > docs/guides/methods.md")
    p.add_argument("--markdown", action="store_true",
                   help="a Markdown page: each method's rule, publication, statistics needed, backends that run it")
    p.set_defaults(func=cmd_methods)


def cmd_methods(args) -> int:
    from .policies import REGISTRY, methods_markdown

    if args.markdown:
        print(methods_markdown(), end="")
        return 0
    width = max(len(name) for name in REGISTRY)
    for name, entry in REGISTRY.items():
        print(f"{name.ljust(width)}  {entry.rule}")
    return 0


# ----  -------------------------------------------------------------------------------
def _add_analyze(sub) -> None:
    from .analysis.cli import add_analyze_arguments, analyze_main

    p = sub.add_parser("analyze", help="Q/K concentration and distance preferences of a model: JSON, plots, report")
    add_analyze_arguments(p)
    p.set_defaults(func=analyze_main)


# one example per command, shown at the end of its --help
EXAMPLES = {
    "calibrate": "trikv calibrate --model smollm2-135m --text-file my_text.txt --out stats.safetensors",
    "generate": 'trikv generate --prompt "Prove that sqrt(2) is irrational." --budget 64 --divide-length 32 '
                "--max-new-tokens 200",
    "chat": "printf 'Name three primes.\\nAnd three more?\\n' | trikv chat --budget 64 --divide-length 32",
    "demo": "trikv demo --budget 256 --max-new-tokens 1500",
    "methods": "trikv methods --markdown > docs/guides/methods.md",
    "analyze": "trikv analyze --model smollm2-135m --out runs/analysis",
    "vllm-args": "trikv vllm-args --method triattention --budget 2048 --stats smollm2-135m",
    "serve": "trikv serve --budget 2048 --allow-full-requests",
    "bench": "trikv bench quality --task fidelity --budgets 128,256 --out runs/quality",
    "bench quality": "trikv bench quality --task fidelity --budgets 128,256 --out runs/quality",
    "bench report": "trikv bench report runs/quality --out docs/results.md",
    "bench speed": "trikv bench speed --contexts 1024,2048,4096 --budgets 256,1024 --out runs/speed/main",
    "bench speed-report": "trikv bench speed-report runs/speed/main --out docs/speed.md",
    "bench serve": "trikv bench serve --out runs/serve",
    "bench serve-report": "trikv bench serve-report runs/serve --out docs/serving.md",
    "bench soak": "trikv bench soak --requests 2000 --url http://127.0.0.1:8000",
    "bench agent": "trikv bench agent --backends transformers,vllm --out runs/agent",
    "bench agent-report": "trikv bench agent-report runs/agent --out docs/agent.md",
    "bench conversation": "trikv bench conversation --turns 8 --turn-tokens 400 --out runs/conversation/main",
    "bench conversation-report": "trikv bench conversation-report runs/conversation/main --out docs/sessions.md",
    "bench calibration-length": "trikv bench calibration-length --model smollm2-135m --out runs/calibration/smollm2-135m",
    "bench calibration-length-report": "trikv bench calibration-length-report runs/calibration/smollm2-135m --out docs/calibration.md",
    "bench readme": "trikv bench readme --check",
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's default in its help, unless the help already states one; the epilog kept as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default is not None and action.default is not argparse.SUPPRESS and action.default is not False
                and action.option_strings and "default" not in text and action.nargs != 0):
            text += " (default: %(default)s)"
        return text

    def _fill_text(self, text, width, indent):
        if text.startswith("example:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _command_tree(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every command and subcommand, the root included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _command_tree(sub, path + (name,))
    yield path, parser


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="trikv", description="Bounded KV caches for long reasoning (TriAttention and baselines)")
    parser.add_argument("--version", action="version", version=f"trikv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_calibrate(sub)
    _add_generate(sub)
    _add_chat(sub)
    _add_demo(sub)
    _add_methods(sub)
    _add_analyze(sub)
    from .vllm.cli import add_vllm_commands

    add_vllm_commands(sub)
    # `trikv bench ...`: a subcommand group that benchmark modules extend (see trikv/benchmarks/__init__.py)
    from .benchmarks import add_bench_parser

    add_bench_parser(sub)
    for path, command in _command_tree(parser):
        command.formatter_class = DefaultsHelpFormatter
        example = EXAMPLES.get(" ".join(path))
        if example and not command.epilog:
            command.epilog = f"example: {example}"
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown_options(parser, args, unknown)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:  # clear one-line errors for bad input
        print(f"trikv {args.command}: error: {error}", file=sys.stderr)
        return 2


def _refuse_unknown_options(parser: argparse.ArgumentParser, args, unknown: list[str]) -> None:
    """Exit with the usage of the subcommand that was given options it does not know (not the top-level usage),
    naming the closest option it has for each."""
    import difflib

    path = tuple(word for word in (getattr(args, "command", None), getattr(args, "bench_command", None)) if word)
    command = dict(_command_tree(parser)).get(path, parser)
    known = [flag for action in command._actions for flag in action.option_strings]
    hints = []
    for word in unknown:
        close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6) if word.startswith("-") else []
        if close:
            hints.append(f"{word} (did you mean {close[0]}?)")
    message = f"unrecognized arguments: {' '.join(unknown)}"
    command.error(message + (f"; {'; '.join(hints)}" if hints else ""))


if __name__ == "__main__":
    sys.exit(main())
