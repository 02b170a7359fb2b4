"""`trikv analyze`: argument parsing and the command's entry point."""

from __future__ import annotations

import argparse
import shlex
import sys

from ..threads import add_threads_argument, apply_threads


def add_analyze_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ..models import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"bundled name, local folder or hub id (default {DEFAULT_MODEL})")
    parser.add_argument("--text-file", action="append", default=None, metavar="FILE",
                        help="text file to analyse; repeat for several (default: the shipped prose, code and math texts)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder for analysis.json, the PNG plots and report.md")
    parser.add_argument("--head", default=None, metavar="LAYER,HEAD", help="head shown in the scatter plots (default: chosen automatically)")
    parser.add_argument("--text-tokens", type=int, default=4096, help="tokens used from each text")
    parser.add_argument("--chunk-tokens", type=int, default=2048, help="tokens per forward pass; distances reach half of this (default 2048)")
    parser.add_argument("--distances", type=int, default=32, help="number of log-spaced Q-K distances (default 32)")
    parser.add_argument("--query-samples", type=int, default=128, help="single queries per text for the per-query reconstruction r (default 128)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype (default float32)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_threads_argument(parser)
    parser.add_argument("--skip-sanity-check", action="store_true",
                        help="analyse even if the model does not answer a known prompt sanely (checked by default)")
    return parser


def load_for_analysis(name_or_path: str, dtype: "torch.dtype | None" = None, device: str = "cpu"):
    """Like `trikv.load_model`, but accepts every family the analysis can read (e.g. Gemma3's sliding layers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import resolve_model_path
    from .capture import analysis_shape

    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, attn_implementation="sdpa")
    model.to(device).eval()
    analysis_shape(model)
    model.trikv_name = name_or_path
    return model, tokenizer


def analyze_main(args: argparse.Namespace) -> int:
    from ..architectures import UnsupportedModelError
    from ..sanity import ModelSanityError, check_model_answers
    from .runner import run_analysis
    from .texts import default_texts, load_text_files

    try:
        texts = load_text_files(args.text_file) if args.text_file else default_texts()
        import torch

        apply_threads(args.threads, args.device)
        model, tokenizer = load_for_analysis(args.model, getattr(torch, args.dtype), args.device)
        if not args.skip_sanity_check:
            check_model_answers(model, tokenizer, args.model)
    except (FileNotFoundError, ValueError, UnsupportedModelError, ModelSanityError) as error:
        print(f"trikv analyze: error: {error}", file=sys.stderr)
        return 2
    command = "trikv analyze " + " ".join(shlex.quote(a) for a in (getattr(args, "argv", None) or sys.argv[1:]) if a != "analyze")
    result = run_analysis(
        model,
        tokenizer,
        texts,
        args.out,
        head=args.head,
        max_tokens=args.text_tokens,
        progress=not args.no_progress,
        chunk_tokens=args.chunk_tokens,
        num_distances=args.distances,
        query_samples=args.query_samples,
        model_name=args.model,
        command=command,
    )
    verdict = result["verdict"]
    print(verdict["overall"])
    for key in ("concentration", "reconstruction", "stability"):
        print(f"- {verdict[key]}")
    print(f"wrote {args.out}/analysis.json, {len(result['plots'])} plots and {args.out}/report.md ({result['meta']['wall_s']:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: `python -m trikv.analysis --model M --out DIR`."""
    parser = add_analyze_arguments(argparse.ArgumentParser(prog="trikv analyze", description=__doc__))
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    return analyze_main(args)
