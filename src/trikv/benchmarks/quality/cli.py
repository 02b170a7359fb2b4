"""`trikv bench quality` and `trikv bench report`: argument parsing and entry points."""

from __future__ import annotations

import argparse
import sys
import time

from .. import register_bench


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_quality_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="quick", help="quick (default: all tasks but math, < 20 min on 2 CPU cores) or full")
    parser.add_argument("--task", type=_names, default=None, help="comma list of fidelity,dfs,needle,math,prefill or 'all' (default: the preset's)")
    parser.add_argument("--model", default=None, help="bundled name, local folder or hub id (default smollm2-135m)")
    parser.add_argument("--stats", default=None, help="TriAttention statistics file (default: the model's bundled stats)")
    parser.add_argument("--methods", type=_names, default=None, help="comma list of registered methods (`trikv methods`)")
    parser.add_argument("--budgets", type=_ints, default=None, help="comma list of budgets, e.g. 64,128,256,512")
    parser.add_argument("--divide-length", type=int, default=None, help="slack beta: compress at budget + beta (default 128)")
    parser.add_argument("--no-protect-prompt", dest="protect_prompt", action="store_false", default=None,
                        help="let the prompt's entries compete for the budget like any other (default: protected)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default="bench-quality", help="result folder (resumes a run with the same settings; other --methods or --budgets extend it, reusing its finished cells)")
    parser.add_argument("--fresh", action="store_true", help="recompute every unit instead of resuming")
    parser.add_argument("--reuse-unrecorded", action="store_true",
                        help="also reuse finished cells written before cells recorded a fingerprint (the results mark "
                             "them); cells whose fingerprint differs from this run's are never reused")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 when the machine is busy, else torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="model dtype (default float32; bfloat16 decodes ~1.7x faster on CPUs with AMX)")
    group = parser.add_argument_group("fidelity / recall")
    group.add_argument("--texts", type=_names, default=None, help="shipped text names (see trikv/benchmarks/quality/data/README.md)")
    group.add_argument("--text-file", action="append", default=None, metavar="FILE",
                       help="your own UTF-8 text (repeatable); alone it replaces the shipped texts, with --texts it adds to them")
    group.add_argument("--text-tokens", type=int, default=None, help="tokens per text")
    group.add_argument("--traces", default=None, choices=["evaluation", "design"],
                       help="the model's own reasoning traces (shipped per bundled model), each behind its chat prompt; "
                            "alone they replace the shipped texts")
    group.add_argument("--trace-tokens", type=int, default=None, help="tokens of each trace after its prompt (default 2048)")
    group.add_argument("--recall-stride", type=int, default=None, help="measure recall on every n-th query")
    group.add_argument("--horizons", type=_ints, default=None, help="horizon bucket edges, e.g. 128,1024,4096")
    group = parser.add_argument_group("prefill (compaction while prefilling against compaction after it)")
    group.add_argument("--prefill-prompt-tokens", type=int, default=None,
                       help="prompt of each window, cut from the texts (default 1536; longer than budget + divide_length)")
    group.add_argument("--prefill-continuation-tokens", type=int, default=None,
                       help="teacher-forced tokens after each prompt, where KL is measured (default 512)")
    group.add_argument("--prefill-chunk", type=int, default=None, help="prefill chunk size (default 512)")
    group = parser.add_argument_group("DFS state query")
    group.add_argument("--dfs-mode", default=None, choices=["teacher-forced", "generative", "both"])
    group.add_argument("--dfs-graphs", type=int, default=None)
    group.add_argument("--dfs-prompt", default=None, choices=["chat", "plain"],
                       help="teacher-forced framing: chat (graph, trace and question in a user turn of the model's chat "
                            "template, the answer in the assistant's; the default) or plain text ending in 'Answer:'")
    group.add_argument("--dfs-ks", type=_ints, default=None, help="steps k to query, e.g. 4,8,16,32")
    group.add_argument("--dfs-nodes", type=_ints, default=None, metavar="MIN,MAX",
                       help="graph sizes drawn from MIN..MAX nodes (default 10,30)")
    group = parser.add_argument_group("needle")
    group.add_argument("--needle-lengths", type=_ints, default=None)
    group.add_argument("--needle-depths", type=_floats, default=None, help="0..1, e.g. 0,0.25,0.5,0.75,1")
    group = parser.add_argument_group("math")
    group.add_argument("--math-datasets", type=_names, default=None, help="math500,aime24,aime25")
    group.add_argument("--limit", type=int, default=None, help="first N problems of each dataset (a larger N in the same --out answers only the new problems)")
    group.add_argument("--problems", type=_names, default=None, metavar="ID,ID",
                       help="answer only these problems, by DATASET-ROW id (e.g. math500-7,math500-15), instead of --limit")
    group.add_argument("--samples", type=int, default=None, help="samples per problem (pass@1 = their mean)")
    group.add_argument("--max-new-tokens", type=int, default=None)
    group.add_argument("--math-engine", default=None, choices=["lean", "transformers"],
                       help="decode loop of the math generations (default lean: same tokens, faster)")
    group.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0.6; 0 = greedy)")
    group.add_argument("--math-batch", type=int, default=None,
                       help="problems per generation batch (default 1; more rows per decode step = more throughput)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=quality_main)


def _node_range(values: list[int] | None) -> tuple[int | None, int | None]:
    if values is None:
        return None, None
    if len(values) != 2 or not 3 <= values[0] <= values[1]:
        raise ValueError(f"--dfs-nodes takes MIN,MAX with 3 <= MIN <= MAX, got {values}")
    return values[0], values[1]


def config_from_args(args):
    from .runner import TASKS, config_from_preset

    tasks = args.task
    if tasks == ["all"]:
        tasks = list(TASKS)
    return config_from_preset(
        args.preset, tasks=tasks, model=args.model, stats=args.stats, methods=args.methods, budgets=args.budgets,
        divide_length=args.divide_length, protect_prompt=args.protect_prompt, seed=args.seed, texts=[] if args.text_file and args.texts is None else args.texts,
        text_files=args.text_file, text_tokens=args.text_tokens, traces=args.traces, trace_tokens=args.trace_tokens,
        recall_stride=args.recall_stride, horizons=args.horizons, dfs_mode=args.dfs_mode, dfs_graphs=args.dfs_graphs,
        dfs_ks=args.dfs_ks, dfs_prompt=args.dfs_prompt, dfs_min_nodes=_node_range(args.dfs_nodes)[0], dfs_max_nodes=_node_range(args.dfs_nodes)[1], needle_lengths=args.needle_lengths, needle_depths=args.needle_depths,
        math_datasets=args.math_datasets, math_limit=args.limit, math_problems=args.problems, math_samples=args.samples,
        math_max_new_tokens=args.max_new_tokens, math_engine=args.math_engine, math_temperature=args.temperature,
        math_batch=args.math_batch, dtype=args.dtype, prefill_prompt_tokens=args.prefill_prompt_tokens,
        prefill_continuation_tokens=args.prefill_continuation_tokens, prefill_chunk=args.prefill_chunk,
    )


def quality_main(args) -> int:
    import torch

    from ...threads import apply_threads
    from .runner import run_quality

    apply_threads(args.threads, args.device)
    config = config_from_args(args)
    model = tokenizer = None
    if args.device != "cpu":
        from ...models import load_model

        model, tokenizer = load_model(config.model, device=args.device, dtype=getattr(torch, config.dtype))
    started = time.perf_counter()
    record = run_quality(config, args.out, model=model, tokenizer=tokenizer, fresh=args.fresh, progress=not args.no_progress,
                         reuse_unrecorded=args.reuse_unrecorded)
    from .pages.tables import text_tables

    print(text_tables(record))
    print(f"results in {args.out}/ (results.json, results.csv, *.png); {time.perf_counter() - started:.0f} s")
    return 0


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folders", nargs="+", metavar="DIR", help="result folders of `trikv bench quality`")
    parser.add_argument("--out", default="docs/results.md", help="Markdown file to write (default docs/results.md)")
    parser.add_argument("--title", default="trikv quality benchmarks")
    parser.add_argument("--preregistration", default=None, metavar="JSON",
                        help="a pre-registered test (candidate, baseline, budget, dataset, run, hypothesis): rendered with "
                             "its outcome computed from the named run")
    parser.add_argument("--earlier", default=None, metavar="PAGE", help="a page of earlier runs to link from the header")
    parser.add_argument("--replaces", default=None, metavar="PAGE",
                        help="the page this one replaces (its run folders gone), linked from the header")
    parser.set_defaults(func=report_main)


def report_main(args) -> int:
    from .report import write_report

    path = write_report(args.folders, args.out, args.title, preregistration=args.preregistration, earlier=args.earlier,
                        replaces=args.replaces)
    print(f"wrote {path}")
    return 0


register_bench("quality", add_quality_arguments, "fidelity, attention recall, DFS state query, needle and math vs budget")
register_bench("report", add_report_arguments, "render quality result folders into one Markdown page")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m trikv.benchmarks.quality.cli")
    add_quality_arguments(parser)
    sys.exit(parser.parse_args().func(parser.parse_args()))
