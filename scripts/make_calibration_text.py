"""Write the calibration text of the bundled model: its own reasoning traces on MATH-500 problems.

The paper calibrates on full-attention reasoning traces; we do the same with the bundled model, on
MATH-500 problems 250-297 (the evaluation tasks use other texts), sampled at T=0.6, top-p 0.95, seed 0.
Usage: python scripts/make_calibration_text.py [--model smollm2-135m] [--out src/trikv/data/calibration/...]
       [--device cuda --dtype bfloat16]
The rows used are written to the provenance file and skipped by every math evaluation.
"""

import argparse
import json
from importlib.resources import files
from pathlib import Path

import torch

import trikv


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--first", type=int, default=250)
    parser.add_argument("--count", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=640)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", default="lean", help="transformers or lean (same tokens, faster on CPU)")
    parser.add_argument("--out", default="src/trikv/data/calibration/smollm2-135m-math500-traces.txt")
    parser.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    rows = [json.loads(line) for line in (files("trikv") / "data/datasets/math500.jsonl").read_text().splitlines()]
    problems = [rows[i]["problem"] for i in range(args.first, args.first + args.count)]
    model, tokenizer = trikv.load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    traces = []
    for start in range(0, len(problems), args.batch):
        batch = problems[start : start + args.batch]
        prompts = [f"Solve this problem step by step.\n\n{p}" for p in batch]
        result = trikv.generate(model, tokenizer, prompts, method="full", max_new_tokens=args.new_tokens,
                                do_sample=True, temperature=0.6, top_p=0.95, seed=args.seed + start, progress=True,
                                engine=args.engine)
        traces += [f"Problem: {p}\n\nSolution: {t.strip()}" for p, t in zip(batch, result.texts)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n\n".join(traces) + "\n", encoding="utf-8")
    provenance = {
        "model": args.model,
        "problems": f"MATH-500 rows {args.first}-{args.first + args.count - 1} (MIT)",
        "math500_rows": [args.first, args.first + args.count - 1],  # reserved: math evaluation skips them
        "sampling": {"temperature": 0.6, "top_p": 0.95, "seed": args.seed, "max_new_tokens": args.new_tokens},
        "generated_with": f"trikv.generate(method='full', engine={args.engine!r}), "
                          + ("chat template" if getattr(tokenizer, "chat_template", None) else "plain prompt (no chat template)"),
        "tokens": len(tokenizer(out.read_text()).input_ids),
    }
    out.with_suffix(".json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance, indent=2))


if __name__ == "__main__":
    torch.set_num_threads(int(__import__("os").environ.get("TRIKV_THREADS", "2")))
    main()
