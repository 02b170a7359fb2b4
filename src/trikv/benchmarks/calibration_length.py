"""`trikv bench calibration-length`: how much text TriAttention's calibration needs, measured.

The model is calibrated on disjoint slices of one long text (MATH-500 problems with their worked solutions, leaving
out the problems the reasoning traces below answer) at several lengths, a few slices per length. TriAttention then
runs with each slice's statistics over the model's own reasoning traces, teacher-forced, at one budget and schedule
for every slice, and two things are compared:

- fidelity against full attention over the compressed positions: KL(full || bounded) of the next-token distribution
  and top-1 agreement, pooled over the traces;
- kept-set agreement between two calibrations of the same length from disjoint text: after every compression round,
  the share of one's held entries the other holds too, averaged over layers, KV heads, rounds and traces (every
  pair of slices of that length). 1.0 means the text a calibration happened to see no longer changes what is kept.

StreamingLLM at the same budget (no statistics) and the model's shipped statistics run beside as reference points.
One pass over the text serves every slice: the query sums are kept per block of `BLOCK_TOKENS` tokens (each block
one forward, as `trikv calibrate --chunk-tokens 1024` reads a text), and a slice's statistics are its blocks' sums.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import register_bench

if TYPE_CHECKING:  # torch loads inside the functions: `trikv --help` stays instant
    import torch

BLOCK_TOKENS = 1024
DEFAULT_SIZES = (1, 2, 5, 10, 20, 50)  # in blocks of 1,024 tokens: 1K ... 50K
FORMAT = "trikv-calibration-length/1"


def pool_rows(exclude: set[str]) -> list[dict]:
    """The MATH-500 rows of the calibration text, in file order: every row whose id (`math500-N`) is not excluded."""
    path = Path(__file__).resolve().parents[1] / "data" / "datasets" / "math500.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [row for index, row in enumerate(rows) if f"math500-{index}" not in exclude]


def pool_text(exclude: set[str]) -> str:
    return "\n\n".join(f"Problem: {row['problem'].strip()}\n\nSolution: {row['solution'].strip()}"
                       for row in pool_rows(exclude))


class BlockSums:
    """Query sums of every block of `BLOCK_TOKENS` tokens of a text, from one forward per block."""

    def __init__(self, model, token_ids: torch.Tensor, progress: bool = True):
        import torch
        from tqdm.auto import tqdm

        from ..architectures import model_shape
        from ..calibration import StatsAccumulator
        from ..geometry import RopeGeometry
        from ..qk_capture import capture_pre_rope

        shape = model_shape(model)
        geometry = RopeGeometry.from_model(model)
        self.layers = list(shape.cached_layers)
        blocks = token_ids.numel() // BLOCK_TOKENS
        if blocks == 0:
            raise ValueError(f"the calibration text holds {token_ids.numel()} tokens, fewer than one block of {BLOCK_TOKENS}")
        device = next(model.parameters()).device
        sums_q, sums_abs = [], []
        with torch.no_grad():
            for block in tqdm(range(blocks), desc="calibrating blocks", unit="block", disable=not progress):
                accumulator = StatsAccumulator(shape, geometry, self.layers)
                chunk = token_ids[block * BLOCK_TOKENS : (block + 1) * BLOCK_TOKENS]
                with capture_pre_rope(model, accumulator.add):
                    model(input_ids=chunk[None].to(device), use_cache=False, logits_to_keep=1)
                sums_q.append(accumulator.q_sum)
                sums_abs.append(accumulator.q_abs_sum)
        self.q_sum = torch.stack(sums_q)  # [blocks, L, Hq, F] complex128
        self.q_abs_sum = torch.stack(sums_abs)  # [blocks, L, Hq, F] float64

    @property
    def blocks(self) -> int:
        return self.q_sum.shape[0]

    def stats(self, model, first: int, count: int, source: str):
        """QueryStats of blocks first .. first + count - 1 (what calibrating on those tokens alone gives)."""
        from ..calibration import QueryStats, stats_metadata

        if first < 0 or first + count > self.blocks:
            raise ValueError(f"blocks {first}..{first + count - 1} are outside the text's {self.blocks} blocks")
        tokens = count * BLOCK_TOKENS
        metadata = stats_metadata(model, tokens, source, layers=self.layers)
        return QueryStats(q_mean=self.q_sum[first : first + count].sum(0) / tokens,
                          q_abs_mean=self.q_abs_sum[first : first + count].sum(0) / tokens, metadata=metadata)


def held_after_rounds(evict_time: torch.Tensor, round_times: list[int]) -> torch.Tensor:
    """[R, L, b, Hkv, T] bool: the entries a cache held right after each compression round, from its eviction log
    (evict_time [L, b, Hkv, T]: the first token index whose forward no longer saw key j; T = never)."""
    import torch

    T = evict_time.shape[-1]
    times = torch.tensor(round_times, dtype=evict_time.dtype).view(-1, 1, 1, 1, 1)  # [R, 1, 1, 1, 1]
    keys = torch.arange(T, dtype=evict_time.dtype)
    return (keys < times) & (evict_time[None] > times)


def kept_agreement(log_a: dict, log_b: dict) -> list[float]:
    """Per text: the mean over rounds, layers and KV heads of |held_a & held_b| / |held_a|, for two runs of one
    schedule (`FidelitySuite.run_method` logs). Raises where the schedules differ (then the sets are not comparable)."""
    per_text = []
    for batch_a, batch_b in zip(log_a["batches"], log_b["batches"], strict=True):
        if list(batch_a["round_times"]) != list(batch_b["round_times"]):
            raise RuntimeError("two runs compared for kept-set agreement ran different compression schedules")
        if not batch_a["round_times"]:
            raise RuntimeError("a text reached no compression round: lower --budget or raise --trace-tokens")
        held_a = held_after_rounds(batch_a["evict_time"], batch_a["round_times"])
        held_b = held_after_rounds(batch_b["evict_time"], batch_b["round_times"])
        shared = (held_a & held_b).sum(-1).double() / held_a.sum(-1).clamp_min(1).double()  # [R, L, b, Hkv]
        per_text += shared.mean(dim=(0, 1, 3)).tolist()  # one value per row (text) of the batch
    return per_text


def trace_texts(model_name: str, tokenizer, trace_tokens: int, count: int) -> tuple[list[str], list[list[int]], list[int]]:
    """(names, token ids, prompt lengths) of the model's first `count` valid evaluation traces, each cut to its own
    chat prompt + `trace_tokens` tokens of its text."""
    import dataclasses

    from .quality.texts import text_token_ids
    from .quality.traces import load_traces

    traces = [trace.as_text() for trace in load_traces(model_name, "evaluation", valid_only=True)][:count]
    names, ids, prompts = [], [], []
    for trace in traces:
        prompt = len(text_token_ids(dataclasses.replace(trace, text=""), tokenizer))
        tokens = text_token_ids(trace, tokenizer)
        if len(tokens) - prompt < trace_tokens:
            raise ValueError(f"trace {trace.name} holds {len(tokens) - prompt} tokens after its prompt, fewer than "
                             f"--trace-tokens {trace_tokens}")
        names.append(trace.name)
        ids.append(tokens[: prompt + trace_tokens])
        prompts.append(prompt)
    return names, ids, prompts


def _summary(metrics: dict) -> dict:
    compressed = metrics["compressed"]
    per_text = metrics["per_text"]["compressed"]
    kl_per_text = [kl / max(n, 1) for kl, n in zip(per_text["kl"], per_text["n"])]
    return {"kl": compressed["kl"], "top1_agreement": compressed["top1_agreement"],
            "perplexity_ratio": compressed["perplexity_ratio"], "positions": compressed["positions"],
            "kl_per_text": kl_per_text, "rounds": metrics["rounds"]}


def measure(model, tokenizer, model_name: str, sizes: list[int], slices: int, budget: int, divide_length: int,
            trace_tokens: int, traces: int, out: Path, progress: bool = True, log=print, command: str | None = None) -> dict:
    """Run every cell and write `out/calibration.json`; returns what it wrote."""
    import torch
    from tqdm.auto import tqdm

    from ..cache import make_cache
    from ..calibration import load_stats
    from ..models import REGISTRY
    from ..prompts import document_ids
    from .quality.fidelity import FidelitySuite
    from .quality.traces import DESIGN_PROBLEMS, EVALUATION_PROBLEMS

    from .agent.cli import code_version

    code = code_version()  # the code that runs now (a commit made while it runs must not be recorded as its)
    exclude = set(EVALUATION_PROBLEMS) | set(DESIGN_PROBLEMS)
    pool = torch.tensor(document_ids(tokenizer, pool_text(exclude)))
    names, ids, prompts = trace_texts(model_name, tokenizer, trace_tokens, traces)
    too_long = [name for name, prompt in zip(names, prompts) if prompt >= budget]
    if too_long:
        raise ValueError(f"--budget {budget} does not hold the prompts of traces {too_long}: raise it")
    fitting = [size for size in sizes if size * BLOCK_TOKENS <= pool.numel()]
    if len(fitting) < len(sizes):
        log(f"[calibration-length] the text holds {pool.numel()} tokens: sizes above it are skipped "
            f"({[size * BLOCK_TOKENS for size in sizes if size not in fitting]})")
    started = time.perf_counter()
    sums = BlockSums(model, pool[: max(fitting) * BLOCK_TOKENS * slices], progress=progress)
    calibration_seconds = time.perf_counter() - started
    suite = FidelitySuite(model, ids, prompts, max_chunk=128)
    suite.run_reference(recall=False)

    def run(stats, method: str = "triattention") -> tuple[dict, dict]:
        options = {"stats": stats} if method == "triattention" else {}
        return suite.run_method(lambda: make_cache(model, method, budget=budget, divide_length=divide_length,
                                                   protect_prompt=True, **options))

    plan = [(size, index) for size in fitting for index in range(min(slices, sums.blocks // size))]
    cells, agreement = [], {}
    bar = tqdm(total=len(plan) + 2, desc="fidelity runs", unit="run", disable=not progress)
    for size in fitting:
        logs = []
        for index in range(min(slices, sums.blocks // size)):
            stats = sums.stats(model, index * size, size, source=f"calibration-length slice {index} of {size} blocks")
            metrics, run_log = run(stats)
            logs.append(run_log)
            cells.append({"tokens": size * BLOCK_TOKENS, "slice": index,
                          "text_tokens": [index * size * BLOCK_TOKENS, (index + 1) * size * BLOCK_TOKENS],
                          **_summary(metrics)})
            bar.update(1)
            log(f"[calibration-length] {size * BLOCK_TOKENS:>6} tokens, slice {index}: KL {cells[-1]['kl']:.4f}, "
                f"top-1 agreement {cells[-1]['top1_agreement']:.4f}")
        pairs = [kept_agreement(logs[a], logs[b]) for a in range(len(logs)) for b in range(a + 1, len(logs))]
        agreement[str(size * BLOCK_TOKENS)] = [sum(values) / len(values) for values in pairs]
    references = {}
    metrics, _ = run(None, "streaming")
    references["streaming"] = _summary(metrics)
    bar.update(1)
    if model_name in REGISTRY:
        shipped = load_stats(model_name, model)
        metrics, _ = run(shipped)
        references["shipped"] = {**_summary(metrics), "tokens": int(shipped.metadata.get("token_count", 0)),
                                 "source": shipped.metadata.get("calibration_source")}
    bar.update(1)
    bar.close()
    result = {
        "format": FORMAT, "command": command, "model": model_name, "budget": budget, "divide_length": divide_length,
        "block_tokens": BLOCK_TOKENS, "slices": slices,
        "calibration_text": {"source": "MATH-500 problems and worked solutions (MIT), in file order, without the rows "
                                       "the reasoning traces answer", "tokens": int(pool.numel()),
                             "excluded_rows": sorted(exclude)},
        "traces": {"names": names, "trace_tokens": trace_tokens, "prompt_lengths": prompts},
        "cells": cells, "kept_agreement": agreement, "references": references,
        "calibration_seconds": calibration_seconds, "code": code,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(result, indent=1))
    return result


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="a bundled model (its reasoning traces are the texts)")
    parser.add_argument("--tokens", default=",".join(str(size * BLOCK_TOKENS) for size in DEFAULT_SIZES),
                        help=f"calibration lengths, multiples of {BLOCK_TOKENS} tokens")
    parser.add_argument("--slices", type=int, default=4, help="disjoint slices of the text per length (at most)")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--divide-length", type=int, default=64)
    parser.add_argument("--trace-tokens", type=int, default=2048, help="tokens of each trace after its prompt")
    parser.add_argument("--traces", type=int, default=16, help="reasoning traces fed (the model's evaluation traces)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", required=True, help="folder for calibration.json")
    parser.set_defaults(func=main)


def main(args) -> int:
    from ..models import REGISTRY, load_model
    from ..sanity import check_model_answers
    from ..threads import apply_threads
    from ..validation import integer

    for name in ("slices", "budget", "divide_length", "trace_tokens", "traces"):
        integer(f"--{name.replace('_', '-')}", getattr(args, name))
    try:
        tokens = [int(word) for word in args.tokens.split(",") if word.strip()]
    except ValueError:
        raise ValueError(f"--tokens takes comma-separated token counts, got {args.tokens!r}") from None
    uneven = [count for count in tokens if count <= 0 or count % BLOCK_TOKENS]
    if uneven or not tokens:
        raise ValueError(f"--tokens must be positive multiples of {BLOCK_TOKENS}, got {uneven or args.tokens!r}")
    if args.model not in REGISTRY:
        raise ValueError(f"--model must be a bundled model (its reasoning traces ship with trikv): {', '.join(REGISTRY)}")
    apply_threads(args.threads, "cpu")
    model, tokenizer = load_model(args.model)
    check_model_answers(model, tokenizer, args.model)
    result = measure(model, tokenizer, args.model, sorted({count // BLOCK_TOKENS for count in tokens}), args.slices,
                     args.budget, args.divide_length, args.trace_tokens, args.traces, Path(args.out),
                     progress=not args.no_progress, command=_command())
    print(f"[calibration-length] {len(result['cells'])} calibrations of {args.model} -> {Path(args.out) / 'calibration.json'}; "
          f"render with: trikv bench calibration-length-report {args.out}")
    return 0


def _command() -> str | None:
    """The command as it was typed (`trikv bench calibration-length ...`), None when called otherwise."""
    import shlex
    import sys

    words = sys.argv[1:]
    return shlex.join(["trikv", *words]) if words[:2] == ["bench", "calibration-length"] else None


register_bench("calibration-length", add_arguments,
               help="how much text calibration needs: fidelity and kept-set agreement against calibration tokens")

