"""`python -m trikv.benchmarks.mlx --out runs/mlx --page docs/mlx.md`: decode speed of mlx-lm's full cache vs trikv's
bounded MLX cache at several contexts, memory with 8- / 4-bit KV, agreement with the torch path; writes
`OUT/mlx.json` and the Markdown page (`page.py`). Defaults: the bundled SmolLM2, contexts 4K-16K, B=1024.
`--from-run RUN/mlx.json --page PAGE` renders the page from a run's file instead (no MLX needed), so a page can be
regenerated from a run kept in the repository.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

from ...settings import DEFAULT_DIVIDE_LENGTH


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trikv.benchmarks.mlx", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="bundled name or model folder (default smollm2-135m)")
    parser.add_argument("--contexts", type=_ints, default=[4096, 8192, 16384], help="comma list (default 4096,8192,16384)")
    parser.add_argument("--budget", type=int, default=1024, help="trikv's budget in the speed runs (default 1024)")
    parser.add_argument("--divide-length", type=int, default=int(DEFAULT_DIVIDE_LENGTH))
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps before the timed ones")
    parser.add_argument("--quantised-speed", action="store_true", help="also time the 8- and 4-bit bounded caches")
    parser.add_argument("--agreement-budget", type=int, default=96)
    parser.add_argument("--agreement-divide-length", type=int, default=32)
    parser.add_argument("--agreement-tokens", type=int, default=160, help="greedy tokens per prompt (agreement, quantised)")
    parser.add_argument("--kept-sets-tokens", type=int, default=512, help="tokens of the text whose keys one round scores")
    parser.add_argument("--out", default="runs/mlx")
    parser.add_argument("--page", help="write the Markdown page here (e.g. docs/mlx.md)")
    parser.add_argument("--from-run", metavar="FILE",
                        help="render --page from this run's mlx.json (e.g. docs/runs/mlx/mlx.json) instead of running; "
                             "the page's header names this command, its body the run's")
    args = parser.parse_args(argv)
    if args.from_run and not args.page:
        parser.error("--from-run renders a page: give --page")
    if args.budget + args.divide_length >= min(args.contexts):
        parser.error("--budget + --divide-length must be below every context (a bounded cache must be compacting)")
    if args.warmup >= args.divide_length:
        parser.error("--warmup must be below --divide-length (the timed window holds the round)")
    return args


def _gflops() -> float:
    import mlx.core as mx

    a, w = mx.random.normal((1024, 576)), mx.random.normal((1536, 576))
    mx.eval(a, w, a @ w.T)
    started = time.perf_counter()
    mx.eval(a @ w.T)
    return 2 * 1024 * 576 * 1536 / (time.perf_counter() - started) / 1e9


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {__import__('os').cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def log(message: str) -> None:
    print(f"[mlx bench] {message}", file=sys.stderr, flush=True)


def _command(argv) -> str:
    """This invocation as a shell command."""
    return "python -m trikv.benchmarks.mlx " + shlex.join(argv if argv is not None else sys.argv[1:])


def main(argv=None) -> int:
    args = parse(argv)
    if args.from_run:
        from trikv.benchmarks.mlx import page

        record = json.loads(Path(args.from_run).read_text())
        Path(args.page).parent.mkdir(parents=True, exist_ok=True)
        Path(args.page).write_text(page.render(record, command=_command(argv)))
        log(f"wrote {args.page} from {args.from_run}")
        return 0
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache as full_prompt_cache

    import trikv
    import trikv.mlx
    from trikv.benchmarks.mlx import fidelity, page, speed
    from trikv.benchmarks.report_pages import repository_commit

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"loading {args.model} (mlx and transformers)")
    model, tokenizer = trikv.mlx.load(args.model)
    torch_model, torch_tokenizer = trikv.load_model(args.model)
    stats = args.model  # bundled statistics of the bundled model
    attention = model.layers[0].self_attn
    dtype = attention.q_proj.weight.dtype
    meta = {
        "command": _command(argv),
        "machine": platform.node() and "this machine", "cpu": _cpu(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
        "date": time.strftime("%Y-%m-%d"), "commit": repository_commit(),
        "model": args.model, "dtype": str(dtype).replace("mlx.core.", ""),
        "weight_bytes": sum(v.nbytes for _, v in tree_flatten(model.parameters())), "layers": len(model.layers),
        "kv_heads": attention.n_kv_heads, "head_dim": attention.head_dim, "kv_element_bytes": dtype.size,
        "budget": args.budget, "divide_length": args.divide_length, "steps": args.divide_length, "warmup": args.warmup,
        "bound_contexts": sorted(set(args.contexts) | {32768}), "bandwidth_gbps": speed.measure_bandwidth(), "gflops": _gflops(),
    }
    rows, memory_rows = [], {}
    caches = {"full": lambda: full_prompt_cache(model),
              f"trikv B={args.budget}": lambda: trikv.mlx.make_prompt_cache(model, budget=args.budget, divide_length=args.divide_length, stats=stats)}
    quantised = {f"trikv B={args.budget} {bits}-bit": (lambda bits=bits: trikv.mlx.make_prompt_cache(
        model, budget=args.budget, divide_length=args.divide_length, stats=stats, kv_bits=bits)) for bits in (8, 4)}
    for context in args.contexts:
        timed = caches | (quantised if args.quantised_speed else {})
        for label, make in timed.items():
            row = speed.measure(model, make, label, context, args.divide_length, args.warmup)
            rows.append(row.as_dict())
            log(f"ctx {context:6d} {label:24s} {row.tokens_per_second:7.2f} tok/s  p50 {row.ms_p50:7.1f} ms  "
                f"rounds {row.rounds}  scoring {100 * row.scoring_share:4.1f}%  K/V {row.kv_bytes / 2**20:.1f} MB")
        memory = [r["kv_bytes"] for r in rows if r["context"] == context]
        if not args.quantised_speed:  # memory of the quantised caches: filled, not timed
            for make in quantised.values():
                cache = make()
                speed.fill(model, cache, context)
                memory.append(trikv.mlx.bounded_cache(cache).memory_bytes())
        memory_rows[context] = memory
    labels = list(caches) + list(quantised)
    log("kept sets vs the torch path")
    text_ids = fidelity.seed_ids(torch_tokenizer, args.kept_sets_tokens)
    kept = fidelity.kept_set_equality(torch_model, model, stats, text_ids, min(256, args.kept_sets_tokens // 2))
    log(f"  {sum(r['differ'] for r in kept.values())} entries differ over {len(kept)} methods")
    log("greedy token agreement vs trikv.generate (transformers)")
    agreement = fidelity.token_agreement(torch_model, torch_tokenizer, model, tokenizer, stats, args.agreement_budget,
                                         args.agreement_divide_length, args.agreement_tokens)
    for row in agreement:
        log(f"  {row['agree']} of {row['compared']} tokens agree ({row['prompt'][:40]})")
    log("quantised and bounded")
    quantised_record = fidelity.quantised_fidelity(model, tokenizer, stats, args.agreement_budget, args.agreement_divide_length,
                                                   args.agreement_tokens)
    record = {"meta": meta, "speed": rows, "memory": {"labels": labels, "rows": memory_rows}, "kept_sets": kept,
              "kept_sets_tokens": len(text_ids), "kept_sets_budget": min(256, args.kept_sets_tokens // 2),
              "agreement": agreement, "agreement_budget": args.agreement_budget,
              "agreement_divide_length": args.agreement_divide_length, "quantised": quantised_record}
    (out / "mlx.json").write_text(json.dumps(record, indent=1))
    log(f"wrote {out / 'mlx.json'}")
    if args.page:
        Path(args.page).parent.mkdir(parents=True, exist_ok=True)
        Path(args.page).write_text(page.render(record))
        log(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
