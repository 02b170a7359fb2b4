"""Write a model's calibration text: its own reasoning traces on MATH-500 problems.

The paper calibrates on full-attention reasoning traces; we do the same with a model, on MATH-500 problems 250-297
(the evaluation tasks use other texts), sampled at T=0.6, top-p 0.95, seed 0. An instruct model answers through its
chat template, a base model continues a plain completion prompt (`trikv.prompts.math_prompt`); the model must
answer a known prompt sanely first (`trikv.sanity`).

Usage: python scripts/make_calibration_text.py [--model smollm2-135m] [--out FILE | --ship] [--device cuda --dtype bfloat16]
Default output: runs/calibration/<model>-math500-traces.txt. `--ship` writes the file trikv ships instead
(src/trikv/data/calibration/<model>-math500-traces.txt), whose rows every math evaluation then skips; the rows used
are written to the provenance file (.json) beside the text.
"""

import argparse
import json
from importlib.resources import files
from pathlib import Path

import torch

import trikv
from trikv.prompts import document_ids, is_instruct, math_prompt
from trikv.sanity import check_model_answers

ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--first", type=int, default=250)
    parser.add_argument("--count", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=640)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", default="lean", help="transformers or lean (same tokens, faster on CPU)")
    parser.add_argument("--out", help="output text file (default runs/calibration/<model>-math500-traces.txt)")
    parser.add_argument("--ship", action="store_true",
                        help="write the shipped calibration text in src/trikv/data/calibration (replaces the tracked file)")
    parser.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    name = f"{Path(args.model).name.lower()}-math500-traces.txt"
    if args.ship and args.out:
        parser.error("give either --out or --ship")
    out = Path(args.out) if args.out else (ROOT / "src/trikv/data/calibration" if args.ship else Path("runs/calibration")) / name
    rows = [json.loads(line) for line in (files("trikv") / "data/datasets/math500.jsonl").read_text().splitlines()]
    problems = [rows[i]["problem"] for i in range(args.first, args.first + args.count)]
    model, tokenizer = trikv.load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    check_model_answers(model, tokenizer, args.model)
    traces = []
    for start in range(0, len(problems), args.batch):
        batch = problems[start : start + args.batch]
        prompts = [math_prompt(tokenizer, p, f"Solve this problem step by step.\n\n{p}") for p in batch]
        result = trikv.generate(model, tokenizer, prompts, method="full", max_new_tokens=args.new_tokens,
                                do_sample=True, temperature=0.6, top_p=0.95, seed=args.seed + start, progress=True,
                                engine=args.engine)
        traces += [f"Problem: {p}\n\nSolution: {t.strip()}" for p, t in zip(batch, result.texts)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n\n".join(traces) + "\n", encoding="utf-8")
    provenance = {
        "model": args.model,
        "problems": f"MATH-500 rows {args.first}-{args.first + args.count - 1} (MIT)",
        "math500_rows": [args.first, args.first + args.count - 1],  # reserved: math evaluation skips them
        "sampling": {"temperature": 0.6, "top_p": 0.95, "seed": args.seed, "max_new_tokens": args.new_tokens},
        "generated_with": f"trikv.generate(method='full', engine={args.engine!r}), "
                          + ("chat template" if is_instruct(tokenizer) else "plain completion prompt (base model, BOS first)"),
        "tokens": len(document_ids(tokenizer, out.read_text())),
    }
    out.with_suffix(".json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance, indent=2))


if __name__ == "__main__":
    torch.set_num_threads(int(__import__("os").environ.get("TRIKV_THREADS", "2")))
    main()
