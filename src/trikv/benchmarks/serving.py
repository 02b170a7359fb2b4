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

`--kv-cache-dtype auto,fp8` runs every method at each KV cache dtype (vLLM's `kv_cache_dtype`: auto is the model's
dtype, fp8 one byte per element). The pool rule is the same number of BYTES for every KV dtype
(`pool_blocks`): `--pool-requests` full-length requests counted at the model's dtype, so an fp8 pool of a bfloat16
model has twice the blocks (four times at float32), and each engine's KV bytes per request are recorded beside
what they should be: a bounded request holds at most budget + divide_length entries (`kv_layout`).
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
# vLLM's kv_cache_dtype values trikv's engines read, and the bytes of one KV element in each (auto: the model's dtype)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
MODEL_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
POOL_RULE = ("the KV pool is the same number of bytes for every KV cache dtype: --pool-requests full-length requests "
             "at the model's dtype, so a KV dtype of fewer bytes per element gets proportionally more blocks")


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
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="comma-separated vLLM KV cache dtypes, each method runs at each: auto (the model's dtype), fp8, "
                             "fp8_e4m3, fp8_e5m2 (default auto). The pool is the same number of bytes at every KV dtype: "
                             "an fp8 pool of a bfloat16 model has twice the blocks of --pool-requests")
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


def kv_cache_dtypes(value: str) -> list[str]:
    """The KV cache dtypes of a `--kv-cache-dtype` comma list, in order, each once; a ValueError naming the ones
    vLLM's trikv engines do not read (or an empty list)."""
    dtypes = list(dict.fromkeys(d.strip() for d in value.split(",") if d.strip()))
    unknown = [d for d in dtypes if d not in KV_CACHE_DTYPES]
    if unknown or not dtypes:
        raise ValueError(f"--kv-cache-dtype takes a comma-separated list of {', '.join(KV_CACHE_DTYPES)}; got {value!r}"
                         + (f" ({', '.join(map(repr, unknown))} unknown)" if unknown else ""))
    return dtypes


def kv_element_bytes(dtype: str, kv_cache_dtype: str) -> int:
    """Bytes of one KV element: the model's dtype (`dtype`) at auto, one byte at any fp8 format."""
    return MODEL_DTYPE_BYTES[dtype] if kv_cache_dtype == "auto" else 1


def pool_blocks(args, kv_cache_dtype: str) -> int:
    """The KV pool in blocks at `kv_cache_dtype`, vLLM's null block included. The rule (POOL_RULE): the pool holds
    the bytes of `--pool-requests` requests of `--length` tokens at the model's dtype, whatever the KV dtype; a KV
    dtype whose elements are k times smaller gets k times the blocks (a bfloat16 model's fp8 pool: twice)."""
    per_request = math.ceil(args.length / args.block_size)
    scale = MODEL_DTYPE_BYTES[args.dtype] // kv_element_bytes(args.dtype, kv_cache_dtype)
    return args.pool_requests * per_request * scale + 1


def kv_layout(model: str, dtype: str, kv_cache_dtype: str, block_size: int) -> dict:
    """What one token's KV weighs in this model at `kv_cache_dtype`, from its config: `entry_bytes` (keys and values
    of every layer), `block_bytes` (a block of `block_size` tokens over every layer)."""
    from transformers import AutoConfig

    from ..architectures import config_shape
    from ..models import resolve_model_path

    shape = config_shape(AutoConfig.from_pretrained(resolve_model_path(model)))
    entry = 2 * len(shape.cached_layers) * shape.num_kv_heads * shape.head_dim * kv_element_bytes(dtype, kv_cache_dtype)
    return {"layers": len(shape.cached_layers), "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "element_bytes": kv_element_bytes(dtype, kv_cache_dtype), "entry_bytes": entry, "block_bytes": entry * block_size}


def _configurations(args) -> list[dict]:
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    configs = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        for kv_cache_dtype in kv_cache_dtypes(args.kv_cache_dtype):
            for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
                for budget in ([None] if method == "full" else budgets):
                    configs.append({"method": method, "budget": budget, "kv_cache_dtype": kv_cache_dtype,
                                    "concurrency": concurrency})
    return configs


def _spec(args, config: dict, mode: str, out: Path, port: int) -> dict:
    kv_cache_dtype = config.get("kv_cache_dtype", "auto")
    spec = {
        "model": args.model, "dtype": args.dtype, "block_size": args.block_size, "length": args.length,
        "concurrency": config["concurrency"], "pool_blocks": pool_blocks(args, kv_cache_dtype), "max_batched_tokens": 2048,
        "short_prompt": 32, "stagger": args.divide_length if args.stagger is None else args.stagger, "settle": args.settle,
        "warmup_max": args.warmup_max, "window": args.window, "mode": mode, "port": port,
        "log": str(out / f"{_label(config)}-{mode}.server.log"), "in_process": args.in_process and mode == "offline",
    }
    if kv_cache_dtype != "auto":  # absent at auto, so runs recorded before the option are read back by --reuse
        spec["kv_cache_dtype"] = kv_cache_dtype
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
    """A run's name: method, budget, KV cache dtype (none at auto) and concurrency, e.g. triattention-B512-fp8-n16."""
    name = config["method"] if config["budget"] is None else f"{config['method']}-B{config['budget']}"
    return f"{name}{_dtype_suffix(config)}-n{config['concurrency']}"


def _dtype_suffix(config: dict) -> str:
    """'-fp8' for a run at an fp8 KV cache, '' at auto (a run recorded before the option is at auto)."""
    kv_cache_dtype = config.get("kv_cache_dtype", "auto")
    return "" if kv_cache_dtype == "auto" else f"-{kv_cache_dtype}"


def engine_name(entry: dict) -> str:
    """An engine as the tables name it: 'full', 'triattention B=512', with its KV dtype unless auto
    ('triattention B=512 fp8')."""
    name = entry["method"] if entry["budget"] is None else f"{entry['method']} B={entry['budget']}"
    kv_cache_dtype = entry.get("kv_cache_dtype", "auto")
    return name if kv_cache_dtype == "auto" else f"{name} {kv_cache_dtype}"


def request_kv_bytes(run: dict, layout: dict, length: int, divide_length: int) -> dict:
    """A run's KV bytes per request. Stated: a bounded request holds at most budget + divide_length entries between
    rounds (`entry_bytes` each; a full-attention request its `length`). Measured: the most blocks one bounded
    request held (trikv's `max_request_blocks`) and the pool's peak blocks over the slots, times the block's bytes
    (the engine's own where it reported them, else `layout`'s)."""
    block_bytes = (run.get("kv_pool") or {}).get("block_bytes") or layout["block_bytes"]
    entries = length if run["budget"] is None else run["budget"] + divide_length
    most = (run.get("trikv") or {}).get("max_request_blocks")
    peak = run.get("peak_kv_blocks")
    return {"stated_entries": entries, "stated_bytes": entries * layout["entry_bytes"],
            "block_bytes": block_bytes,
            "max_request_blocks": most, "max_request_bytes": None if most is None else most * block_bytes,
            "mean_bytes_at_peak": None if peak is None else peak * block_bytes / run["concurrency"]}


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

    dtypes = kv_cache_dtypes(args.kv_cache_dtype)  # a bad value is refused before vLLM or the model loads
    check_vllm_version()
    trained = check_length(args)
    layouts = {kv_cache_dtype: kv_layout(args.model, args.dtype, kv_cache_dtype, args.block_size)
               for kv_cache_dtype in dict.fromkeys(["auto", *dtypes])}
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
            spec = _spec(args, config, mode, out, 8100 + index)
            result = run_one(spec, out, label, args.reuse)
            runs.append(_run_record(config, mode, spec, result))
            print(f"    {result['output_tokens_per_second']:.1f} output tok/s over {result['window_seconds']:.0f} s "
                  f"(warm-up {result['warmup_seconds']:.0f} s)", flush=True)
    _add_ratios(runs)
    for run in runs:
        run["kv_bytes"] = request_kv_bytes(run, layouts[run.get("kv_cache_dtype", "auto")], args.length, args.divide_length)
    for entry in summary if args.max_batch else []:
        best = next(run for run in runs if _engine(run) == _engine(entry) and run["concurrency"] == entry["best_concurrency"])
        entry["kv_bytes"] = best["kv_bytes"]
    record = {
        "command": "trikv bench serve " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "serve"] else None,
        "commit": repository_commit(),
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "pool_blocks": pool_blocks(args, "auto"),  # at the model's dtype; each run records its own (`pool_blocks`)
        "pool_rule": POOL_RULE,
        "pool_bytes": (pool_blocks(args, "auto") - 1) * layouts["auto"]["block_bytes"],
        "pool_blocks_by_kv_dtype": {kv_cache_dtype: pool_blocks(args, kv_cache_dtype) for kv_cache_dtype in dtypes},
        "kv_layout": {kv_cache_dtype: layouts[kv_cache_dtype] for kv_cache_dtype in dtypes},
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
    print(format_kv_bytes(record))
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


def _run_record(config: dict, mode: str, spec: dict, result: dict) -> dict:
    """One run as serving.json lists it: its configuration, mode and pool (`pool_blocks`), and what it measured."""
    return {**config, "mode": mode, "pool_blocks": spec["pool_blocks"], **{k: v for k, v in result.items() if k != "spec"}}


def _engine(entry: dict) -> tuple:
    """The engine a run or max-batch entry belongs to: method, budget and KV cache dtype (auto where not recorded)."""
    return entry["method"], entry["budget"], entry.get("kv_cache_dtype", "auto")


def max_batch(args, configs: list[dict], mode: str, out: Path) -> tuple[list[dict], list[dict]]:
    """Every engine (method, budget, KV cache dtype) at the concurrency where its own throughput peaks among the
    rungs its pool holds without preempting (its first rung if every rung preempts), and a short-context floor run
    (at the engine's KV dtype) at that concurrency; the ratio of each bounded engine's best to full attention's best
    at the same KV dtype, and of each engine's best at another KV dtype to its best at auto. Full attention climbs no
    higher than `full_attention_capacity` of its pool (its first rung always runs)."""
    ladder = sorted({config["concurrency"] for config in configs})
    engines = list(dict.fromkeys(_engine(config) for config in configs))
    runs, summary, floors = [], [], {}
    port = 8100
    short = _spec(args, configs[0], mode, out, 0)["short_prompt"]
    for method, budget, kv_cache_dtype in engines:
        best, stopped = None, f"top of the ladder ({ladder[-1]})"
        rungs = ladder
        if method == "full":
            capacity = full_attention_capacity(args.length, short, (pool_blocks(args, kv_cache_dtype) - 1) * args.block_size)
            rungs = [c for c in ladder if c <= capacity] or ladder[:1]
            if len(rungs) < len(ladder):
                stopped = (f"its pre-aged requests fill the pool at {capacity} slots (more would only queue: "
                           f"rung {ladder[len(rungs)]} not run)")
        for concurrency in rungs:
            config = {"method": method, "budget": budget, "kv_cache_dtype": kv_cache_dtype, "concurrency": concurrency}
            label = f"{_label(config)}-{mode}"
            print(f"[max-batch] {label} ...", flush=True)
            port += 1
            spec = _spec(args, config, mode, out, port)
            run = _run_record(config, mode, spec, run_one(spec, out, label, args.reuse))
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
        # one floor run per concurrency and KV dtype, shared by the engines that peak there
        floor_key = (best["concurrency"], kv_cache_dtype)
        if floor_key not in floors:
            floor_config = {"method": "full", "budget": None, "kv_cache_dtype": kv_cache_dtype, "concurrency": best["concurrency"]}
            floor_spec = _spec(args, floor_config, mode, out, port + 1000)
            floor_label = f"floor{_dtype_suffix(floor_config)}-n{best['concurrency']}-{mode}"
            # short requests in a pool sized for long ones never fill it: the floor's warm-up is `settle` seconds
            floor_spec.update(length=args.floor_length, warmup_max=min(args.warmup_max, args.settle),
                              log=str(out / f"{floor_label}.server.log"))
            print(f"[max-batch] floor: full attention, {args.floor_length}-token requests, {best['concurrency']} slots"
                  f"{'' if kv_cache_dtype == 'auto' else ', KV ' + kv_cache_dtype} ...", flush=True)
            floors[floor_key] = run_one(floor_spec, out, floor_label, args.reuse)
        floor = floors[floor_key]
        trikv = best.get("trikv") or {}
        elapsed = (best.get("warmup_seconds") or 0) + (best.get("window_seconds") or 0)
        summary.append({
            "method": method, "budget": budget, "kv_cache_dtype": kv_cache_dtype, "pool_blocks": best["pool_blocks"],
            "best_concurrency": best["concurrency"], "tokens_per_second": best["output_tokens_per_second"], "stopped": stopped,
            "tpot_p50": best["tpot_seconds"]["p50"], "tpot_p99": best["tpot_seconds"]["p99"],
            "peak_kv_blocks": best.get("peak_kv_blocks"),
            "floor_tokens_per_second": floor["output_tokens_per_second"],
            "share_of_floor": best["output_tokens_per_second"] / floor["output_tokens_per_second"] if floor["output_tokens_per_second"] else None,
            # compaction time over the whole run (warm-up and window) against its length: an upper estimate of its share
            "compaction_share": trikv["seconds"] / elapsed if trikv and elapsed else None,
        })
    for entry in summary:
        full = next((other for other in summary if other["method"] == "full"
                     and other["kv_cache_dtype"] == entry["kv_cache_dtype"]), None)
        entry["best_vs_full_best"] = (entry["tokens_per_second"] / full["tokens_per_second"]
                                      if full and full["tokens_per_second"] and entry is not full else None)
        at_auto = next((other for other in summary if _engine(other) == (entry["method"], entry["budget"], "auto")), None)
        entry["best_vs_auto_best"] = (entry["tokens_per_second"] / at_auto["tokens_per_second"]
                                      if at_auto and at_auto["tokens_per_second"] and entry is not at_auto else None)
    _add_ratios(runs)
    return runs, summary


def _several_kv_dtypes(entries: list[dict]) -> bool:
    """Whether the tables need the KV dtype columns: the entries ran at more than one KV dtype, or at one not auto."""
    return len({entry.get("kv_cache_dtype", "auto") for entry in entries}) > 1 or any(
        entry.get("kv_cache_dtype", "auto") != "auto" for entry in entries)


def format_max_batch(record: dict) -> str:
    """Each engine at its best concurrency; `x auto` (where a KV dtype other than auto ran): its best over the same
    method's best at auto."""
    dtypes = _several_kv_dtypes(record["max_batch"])
    header = (f"{'engine':<26} {'best n':>6} {'tok/s':>7} {'x full best':>11} " + (f"{'x auto':>7} " if dtypes else "")
              + f"{'floor tok/s':>11} {'of floor':>8} {'TPOT p99/p50':>12} {'compaction':>10}  stopped")
    lines = ["max batch: each engine at its own best concurrency"
             + (" (x full best: against full attention at the same KV dtype)" if dtypes else ""), header, "-" * len(header)]
    for entry in record["max_batch"]:
        ratio = "-" if entry["best_vs_full_best"] is None else f"x{entry['best_vs_full_best']:.2f}"
        at_auto = "-" if entry.get("best_vs_auto_best") is None else f"x{entry['best_vs_auto_best']:.2f}"
        share = "-" if entry["share_of_floor"] is None else f"{entry['share_of_floor']:.0%}"
        spread = "-" if not entry["tpot_p50"] else f"{entry['tpot_p99'] / entry['tpot_p50']:.2f}"
        compaction = "-" if entry["compaction_share"] is None else f"{entry['compaction_share']:.1%}"
        lines.append(f"{engine_name(entry):<26} {entry['best_concurrency']:>6} {entry['tokens_per_second']:>7.1f} {ratio:>11} "
                     + (f"{at_auto:>7} " if dtypes else "")
                     + f"{entry['floor_tokens_per_second']:>11.1f} {share:>8} {spread:>12} {compaction:>10}  {entry['stopped']}")
    return "\n".join(lines)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def format_kv_bytes(record: dict) -> str:
    """KV bytes per request of every run that records them (MiB over every layer, keys and values): stated (a
    bounded request's budget + divide_length entries, a full-attention request's length, times the bytes of an
    entry at its KV dtype), the most one bounded request held (trikv's `max_request_blocks` x the block's bytes),
    and the pool's peak blocks over the slots; '' where no run records them."""
    runs = [run for run in record["runs"] if run.get("kv_bytes")]
    if not runs:
        return ""
    header = (f"{'run':<30} {'KV dtype':<9} {'B/entry':>7} {'entries':>7} {'stated MiB':>10} {'max blocks':>10} "
              f"{'held MiB':>8} {'peak/slot MiB':>13}")
    lines = ["KV bytes per request", header, "-" * len(header)]
    for run in runs:
        kv = run["kv_bytes"]
        entry_bytes = kv["stated_bytes"] // kv["stated_entries"]
        most = "-" if kv["max_request_blocks"] is None else str(kv["max_request_blocks"])
        lines.append(f"{_label(run):<30} {kv_dtype_name(record, run):<9} {entry_bytes:>7,} {kv['stated_entries']:>7,} "
                     f"{_mib(kv['stated_bytes']):>10} {most:>10} {_mib(kv['max_request_bytes']):>8} "
                     f"{_mib(kv['mean_bytes_at_peak']):>13}")
    return "\n".join(lines)


def kv_dtype_name(record: dict, run: dict) -> str:
    """A run's KV cache dtype as the tables print it: the model's dtype at auto (bfloat16), else vLLM's name (fp8)."""
    kv_cache_dtype = run.get("kv_cache_dtype", "auto")
    return record["settings"]["dtype"] if kv_cache_dtype == "auto" else kv_cache_dtype


def _add_ratios(runs: list[dict]) -> None:
    """Each run's output tokens/s over full attention's at the same concurrency, mode and KV cache dtype."""
    for run in runs:
        full = next((r for r in runs if r["method"] == "full" and r["concurrency"] == run["concurrency"] and r["mode"] == run["mode"]
                     and r.get("kv_cache_dtype", "auto") == run.get("kv_cache_dtype", "auto")), None)
        run["throughput_vs_full"] = None if full is None or not full["output_tokens_per_second"] else (
            run["output_tokens_per_second"] / full["output_tokens_per_second"])


def _machine() -> dict:
    import os
    import platform

    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform()}


def format_table(record: dict) -> str:
    """Every run: its name, KV cache dtype, throughput, latency, preemptions and peak KV blocks of its pool."""
    header = (f"{'run':<30} {'mode':<7} {'KV dtype':<9} {'tok/s':>7} {'x full':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9} {'TPOT p99':>9} {'preempt':>7} {'peak blocks':>11} {'of pool':>7}")
    lines = [header, "-" * len(header)]
    for run in record["runs"]:
        def seconds(value):
            return "-" if value is None else f"{value:.3f}"

        ratio = "-" if run.get("throughput_vs_full") is None else f"{run['throughput_vs_full']:.2f}"
        preempt = run.get("preemptions_in_window")
        pool = run.get("pool_blocks", record["pool_blocks"]) - 1  # vLLM's null block is never used
        lines.append(
            f"{_label(run):<30} {run['mode']:<7} {kv_dtype_name(record, run):<9} {run['output_tokens_per_second']:>7.1f} {ratio:>7} "
            f"{seconds(run['ttft_seconds']['p50']):>9} {seconds(run['ttft_seconds']['p99']):>9} "
            f"{seconds(run['tpot_seconds']['p50']):>9} {seconds(run['tpot_seconds']['p99']):>9} "
            f"{'-' if preempt is None else int(preempt):>7} {run.get('peak_kv_blocks', '-'):>11} {pool:>7}"
        )
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    series: dict[str, list[tuple[int, float]]] = {}
    for run in record["runs"]:
        name = f"{engine_name(run)} ({run['mode']})"
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
