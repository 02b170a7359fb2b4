"""`trikv bench serve`: throughput of vLLM serving long generations, full attention vs trikv's bounded cache.

Every configuration (method, budget, concurrency) runs in a fresh engine process with the same fixed KV
pool (`--pool-requests` full-attention requests of `--length` tokens) and the same protocol
(`serving_engine.py`: N concurrent long generations, pre-aged first requests, replaced as they finish, a
steady-state window). Results: `serving.json` in `--out` (every run, plus the ratios against full attention
at the same concurrency), a table on stdout, `throughput.png`; `trikv bench serve-report` turns run folders
into `docs/serving.md`.

`--max-batch` measures as the TriAttention paper reports throughput, "at maximum batch size": each engine climbs
the `--concurrency` ladder at the same pool until its output tokens/s gains less than `--min-gain` or the pool
preempts, and engines are compared at their own best. Beside each best, a floor run (full attention with
`--floor-length`-token requests at that concurrency: attention costs almost nothing) shows how close the engine
is to what the machine does per token, and the rounds' share of the run's time is reported.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

from . import register_bench
from ..settings import DEFAULT_DIVIDE_LENGTH
from .report_pages import repository_commit

TARGET_RATIO = 2.5  # output tokens/s of B=512 over full attention at 32 concurrent 8K generations


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--length", type=int, default=8192, help="tokens per request, prompt included (default 8192)")
    parser.add_argument("--pool-requests", type=int, default=4, help="the KV pool holds this many full-length requests (default 4)")
    parser.add_argument("--concurrency", default="32", help="comma-separated request slots (default 32)")
    parser.add_argument("--methods", default="full,triattention", help="comma-separated: full and methods vLLM runs")
    parser.add_argument("--budgets", default="512", help="comma-separated budgets for the bounded methods (default 512)")
    parser.add_argument("--divide-length", type=int, default=int(DEFAULT_DIVIDE_LENGTH))
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--stagger", type=int,
                        help="bounded runs: the first prompts' lengths spread over this many tokens, so that their rounds do "
                             "not fall due on one step (default: --divide-length; 0 aligns every request's rounds)")
    parser.add_argument("--max-rounds-per-step", type=int,
                        help="bounded runs: trikv's max_rounds_per_step (at most this many rounds start per step; default trikv's: "
                             "max(4, ceil(2 x concurrency / divide_length)); the concurrency itself lets every due round run)")
    parser.add_argument("--window", type=float, default=150.0, help="seconds measured in steady state (default 150)")
    parser.add_argument("--warmup-max", type=float, default=600.0, help="longest warm-up before the window (default 600 s)")
    parser.add_argument("--settle", type=float, default=30.0,
                        help="full attention: seconds between the pool first filling and the window (default 30)")
    parser.add_argument("--modes", default="offline", help="comma-separated: offline (vllm.LLM) and/or http (`trikv serve`)")
    parser.add_argument("--url", help="--modes http: drive the server already answering at this URL (a `trikv serve` started with "
                                      "this command's settings: one method, budget and concurrency) instead of starting one")
    parser.add_argument("--in-process", action="store_true",
                        help="offline runs: vLLM's engine core and worker inside this process, one run after another "
                             "(starts in seconds; the default runs each in its own processes, as vLLM is deployed)")
    parser.add_argument("--max-batch", action="store_true",
                        help="the paper's protocol: every engine climbs the --concurrency ladder (e.g. 8,16,32,64,128) until its "
                             "output tokens/s gains less than --min-gain or its pool preempts (full attention also stops where its "
                             "pre-aged requests fill the pool: beyond, the others only queue), and is compared at its own best; "
                             "a short-context floor run (full attention, --floor-length-token requests) at each engine's best "
                             "concurrency shows what this machine does per token when attention costs almost nothing")
    parser.add_argument("--min-gain", type=float, default=0.03, help="--max-batch: smallest relative gain that keeps climbing (default 0.03)")
    parser.add_argument("--floor-length", type=int, default=512, help="--max-batch: request length of the floor runs (default 512)")
    parser.add_argument("--reuse", action="store_true",
                        help="read back the runs already in --out whose settings are the same (port and log aside) "
                             "instead of measuring them again")
    parser.add_argument("--beyond-trained-context", action="store_true",
                        help="allow --length past the model's trained positions (max_position_embeddings is raised to it): "
                             "the text generated past them is not meaningful, its cost is that of a real generation of "
                             "that length; the report says so")
    parser.add_argument("--out", default="runs/serve", help="output folder (default runs/serve)")
    parser.set_defaults(func=main)


def trained_positions(model: str) -> int | None:
    """The model's `max_position_embeddings` (from its config.json), or None where the config has none."""
    from ..models import resolve_model_path

    folder = Path(resolve_model_path(model))
    if not (folder / "config.json").is_file():
        return None  # a hub id: vLLM reads and checks its config itself
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    return config.get("max_position_embeddings")


def check_length(args) -> int | None:
    """Refuse a --length past the model's trained positions unless --beyond-trained-context says to go on."""
    trained = trained_positions(args.model)
    if trained is not None and args.length > trained and not args.beyond_trained_context:
        raise ValueError(
            f"--length {args.length} is past {args.model}'s trained positions ({trained}); pass "
            "--beyond-trained-context to measure anyway (throughput only: the text past "
            f"{trained} positions is not meaningful)")
    return trained


def _configurations(args) -> list[dict]:
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    configs = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
            for budget in ([None] if method == "full" else budgets):
                configs.append({"method": method, "budget": budget, "concurrency": concurrency})
    return configs


def _spec(args, config: dict, mode: str, out: Path, port: int) -> dict:
    pool_blocks = args.pool_requests * math.ceil(args.length / args.block_size) + 1  # + vLLM's null block
    spec = {
        "model": args.model, "dtype": args.dtype, "block_size": args.block_size, "length": args.length,
        "concurrency": config["concurrency"], "pool_blocks": pool_blocks, "max_batched_tokens": 2048, "short_prompt": 32,
        "stagger": args.divide_length if args.stagger is None else args.stagger, "settle": args.settle,
        "warmup_max": args.warmup_max, "window": args.window, "mode": mode, "port": port,
        "log": str(out / f"{_label(config)}-{mode}.server.log"), "in_process": args.in_process and mode == "offline",
    }
    if mode == "http" and args.url:
        spec["url"] = args.url
    if args.beyond_trained_context:
        spec["max_position_embeddings"] = args.length
    if config["method"] != "full":
        trikv = {"method": config["method"], "budget": config["budget"], "divide_length": args.divide_length}
        if args.max_rounds_per_step is not None:
            trikv["max_rounds_per_step"] = args.max_rounds_per_step
        from ..policies import REGISTRY

        if REGISTRY[config["method"]].needs_stats:
            trikv["stats"] = args.model
        spec["trikv"] = trikv
    return spec


def _label(config: dict) -> str:
    name = config["method"] if config["budget"] is None else f"{config['method']}-B{config['budget']}"
    return f"{name}-n{config['concurrency']}"


def run_one(spec: dict, out: Path, label: str, reuse: bool = False) -> dict:
    """One engine's measurement (`serving_engine`); with `reuse`, the result already in `out` for the same spec
    (port and log path aside) is read back instead."""
    spec_path, result_path = out / f"{label}.spec.json", out / f"{label}.json"
    if reuse and spec_path.is_file() and result_path.is_file():
        def settings(run_spec: dict) -> dict:  # what the measurement depends on
            return {k: v for k, v in run_spec.items() if k not in ("port", "log")}

        if settings(json.loads(spec_path.read_text())) == settings(spec):
            print(f"    {label}: reusing {result_path}", flush=True)
            return {**json.loads(result_path.read_text()), "reused": True}
    spec_path.write_text(json.dumps(spec, indent=2))
    if spec["in_process"]:  # engine core and worker in this interpreter, one run after another (vLLM imported once)
        from .serving_engine import run

        result = run(spec)
        result_path.write_text(json.dumps(result, indent=2))
        return result
    log_path = out / f"{label}.log"
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, "-m", "trikv.benchmarks.serving_engine", str(spec_path), str(result_path)],
                              stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"serving run {label} failed (log: {log_path}):\n{tail}")
    return json.loads(result_path.read_text())


def main(args) -> int:
    from ..vllm import check_vllm_version

    check_vllm_version()
    trained = check_length(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = _configurations(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"offline", "http"}:
        raise ValueError(f"--modes takes offline and/or http, got {args.modes!r}")
    if args.url and (modes != ["http"] or len(configs) != 1 or args.max_batch):
        raise ValueError("--url drives one running server: --modes http and one method, budget and concurrency, without --max-batch")
    runs = []
    started = time.perf_counter()
    if args.max_batch:
        runs, summary = max_batch(args, configs, modes[0], out)
    for index, config in enumerate([] if args.max_batch else configs):
        for mode in modes:
            label = f"{_label(config)}-{mode}"
            print(f"[{index + 1}/{len(configs)}] {label} ...", flush=True)
            result = run_one(_spec(args, config, mode, out, 8100 + index), out, label, args.reuse)
            runs.append({**config, "mode": mode, **{k: v for k, v in result.items() if k != "spec"}})
            print(f"    {result['output_tokens_per_second']:.1f} output tok/s over {result['window_seconds']:.0f} s "
                  f"(warm-up {result['warmup_seconds']:.0f} s)", flush=True)
    _add_ratios(runs)
    record = {
        "command": "trikv bench serve " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "serve"] else None,
        "commit": repository_commit(),
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "pool_blocks": _spec(args, configs[0], "offline", out, 0)["pool_blocks"],
        "trained_positions": trained,
        "runs": runs,
        "elapsed_seconds": time.perf_counter() - started,
        "reused_runs": sum(1 for run in runs if run.get("reused")),
        "machine": _machine(),
    }
    if args.max_batch:
        record["max_batch"] = summary
    (out / "serving.json").write_text(json.dumps(record, indent=2))
    print(format_table(record))
    if args.max_batch:
        print(format_max_batch(record))
    plot(record, out / "throughput.png")
    return 0


def full_attention_capacity(length: int, short: int, pool_tokens: int) -> int:
    """The most slots whose pre-aged first prompts (ages spread over [0, length)) fit the KV pool together. With
    more, vLLM admits only the youngest of them and the others queue: a window then measures a young, cheap batch
    that a long run does not keep (its running requests' ages stay spread while the pool bounds their number), so
    full attention's max-batch ladder stops there."""
    from .serving_engine import pre_aged_prompt

    slots = 1
    while sum(pre_aged_prompt(slot, slots + 1, length, short) for slot in range(slots + 1)) <= pool_tokens:
        slots += 1
    return slots


def max_batch(args, configs: list[dict], mode: str, out: Path) -> tuple[list[dict], list[dict]]:
    """Every engine (method, budget) at the concurrency where its own throughput peaks among the rungs its pool
    holds without preempting (its first rung if every rung preempts), and a short-context floor run at that
    concurrency; the ratio of each bounded engine's best to full attention's best. Full attention
    climbs no higher than `full_attention_capacity` (its first rung always runs)."""
    ladder = sorted({config["concurrency"] for config in configs})
    engines = list(dict.fromkeys((config["method"], config["budget"]) for config in configs))
    runs, summary, floors = [], [], {}
    port = 8100
    first = _spec(args, configs[0], mode, out, 0)
    capacity = full_attention_capacity(args.length, first["short_prompt"], (first["pool_blocks"] - 1) * args.block_size)
    for method, budget in engines:
        best, stopped = None, f"top of the ladder ({ladder[-1]})"
        rungs = ladder
        if method == "full":
            rungs = [c for c in ladder if c <= capacity] or ladder[:1]
            if len(rungs) < len(ladder):
                stopped = (f"its pre-aged requests fill the pool at {capacity} slots (more would only queue: "
                           f"rung {ladder[len(rungs)]} not run)")
        for concurrency in rungs:
            config = {"method": method, "budget": budget, "concurrency": concurrency}
            label = f"{_label(config)}-{mode}"
            print(f"[max-batch] {label} ...", flush=True)
            port += 1
            result = run_one(_spec(args, config, mode, out, port), out, label, args.reuse)
            run = {**config, "mode": mode, **{k: v for k, v in result.items() if k != "spec"}}
            runs.append(run)
            print(f"    {run['output_tokens_per_second']:.1f} output tok/s, {int(run.get('preemptions_in_window') or 0)} preemptions",
                  flush=True)
            if run.get("preemptions_in_window"):
                # past the largest batch the pool holds: a preempting rung is not a batch size the engine sustains
                stopped = f"the pool preempts at {concurrency}"
                best = best or run
                break
            gained = best is None or run["output_tokens_per_second"] >= best["output_tokens_per_second"] * (1 + args.min_gain)
            if best is None or run["output_tokens_per_second"] > best["output_tokens_per_second"]:
                best = run
            if not gained:
                stopped = f"throughput stopped rising at {concurrency} (< +{args.min_gain:.0%})"
                break
        if best["concurrency"] not in floors:  # one floor run per concurrency, shared by the engines that peak there
            floor_config = {"method": "full", "budget": None, "concurrency": best["concurrency"]}
            floor_spec = _spec(args, floor_config, mode, out, port + 1000)
            # short requests in a pool sized for long ones never fill it: the floor's warm-up is `settle` seconds
            floor_spec.update(length=args.floor_length, warmup_max=min(args.warmup_max, args.settle),
                              log=str(out / f"floor-n{best['concurrency']}-{mode}.server.log"))
            print(f"[max-batch] floor: full attention, {args.floor_length}-token requests, {best['concurrency']} slots ...", flush=True)
            floors[best["concurrency"]] = run_one(floor_spec, out, f"floor-n{best['concurrency']}-{mode}", args.reuse)
        floor = floors[best["concurrency"]]
        trikv = best.get("trikv") or {}
        elapsed = (best.get("warmup_seconds") or 0) + (best.get("window_seconds") or 0)
        summary.append({
            "method": method, "budget": budget, "best_concurrency": best["concurrency"],
            "tokens_per_second": best["output_tokens_per_second"], "stopped": stopped,
            "tpot_p50": best["tpot_seconds"]["p50"], "tpot_p99": best["tpot_seconds"]["p99"],
            "floor_tokens_per_second": floor["output_tokens_per_second"],
            "share_of_floor": best["output_tokens_per_second"] / floor["output_tokens_per_second"] if floor["output_tokens_per_second"] else None,
            # compaction time over the whole run (warm-up and window) against its length: an upper estimate of its share
            "compaction_share": trikv["seconds"] / elapsed if trikv and elapsed else None,
        })
    full = next((entry for entry in summary if entry["method"] == "full"), None)
    for entry in summary:
        entry["best_vs_full_best"] = (entry["tokens_per_second"] / full["tokens_per_second"]
                                      if full and full["tokens_per_second"] and entry is not full else None)
    _add_ratios(runs)
    return runs, summary


def format_max_batch(record: dict) -> str:
    header = (f"{'engine':<22} {'best n':>6} {'tok/s':>7} {'x full best':>11} {'floor tok/s':>11} {'of floor':>8} "
              f"{'TPOT p99/p50':>12} {'compaction':>10}  stopped")
    lines = ["max batch: each engine at its own best concurrency", header, "-" * len(header)]
    for entry in record["max_batch"]:
        name = entry["method"] if entry["budget"] is None else f"{entry['method']} B={entry['budget']}"
        ratio = "-" if entry["best_vs_full_best"] is None else f"x{entry['best_vs_full_best']:.2f}"
        share = "-" if entry["share_of_floor"] is None else f"{entry['share_of_floor']:.0%}"
        spread = "-" if not entry["tpot_p50"] else f"{entry['tpot_p99'] / entry['tpot_p50']:.2f}"
        compaction = "-" if entry["compaction_share"] is None else f"{entry['compaction_share']:.1%}"
        lines.append(f"{name:<22} {entry['best_concurrency']:>6} {entry['tokens_per_second']:>7.1f} {ratio:>11} "
                     f"{entry['floor_tokens_per_second']:>11.1f} {share:>8} {spread:>12} {compaction:>10}  {entry['stopped']}")
    return "\n".join(lines)


def _add_ratios(runs: list[dict]) -> None:
    for run in runs:
        full = next((r for r in runs if r["method"] == "full" and r["concurrency"] == run["concurrency"] and r["mode"] == run["mode"]), None)
        run["throughput_vs_full"] = None if full is None or not full["output_tokens_per_second"] else (
            run["output_tokens_per_second"] / full["output_tokens_per_second"])


def _machine() -> dict:
    import os
    import platform

    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform()}


def format_table(record: dict) -> str:
    header = f"{'run':<28} {'mode':<7} {'tok/s':>7} {'x full':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'preempt':>7} {'peak blocks':>11}"
    lines = [header, "-" * len(header)]
    for run in record["runs"]:
        def seconds(value):
            return "-" if value is None else f"{value:.3f}"

        ratio = "-" if run.get("throughput_vs_full") is None else f"{run['throughput_vs_full']:.2f}"
        preempt = run.get("preemptions_in_window")
        lines.append(
            f"{_label(run):<28} {run['mode']:<7} {run['output_tokens_per_second']:>7.1f} {ratio:>7} "
            f"{seconds(run['ttft_seconds']['p50']):>9} {seconds(run['ttft_seconds']['p99']):>9} "
            f"{seconds(run['tpot_seconds']['p50']):>9} {seconds(run['tpot_seconds']['p99']):>9} "
            f"{'-' if preempt is None else int(preempt):>7} {run.get('peak_kv_blocks', '-'):>11}"
        )
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    series: dict[str, list[tuple[int, float]]] = {}
    for run in record["runs"]:
        name = (run["method"] if run["budget"] is None else f"{run['method']} B={run['budget']}") + f" ({run['mode']})"
        series.setdefault(name, []).append((run["concurrency"], run["output_tokens_per_second"]))
    for name, points in series.items():
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    settings = record["settings"]
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("output tokens / s (steady state)")
    axis.set_title(f"{settings['model']}, {settings['length']}-token generations, pool = {settings['pool_requests']} full requests", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


register_bench("serve", add_arguments, "vLLM serving throughput: full attention vs bounded KV at a fixed KV pool")
