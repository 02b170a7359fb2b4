"""Time one compaction round on a long trace: `python -m trikv.benchmarks.compaction_timing [--tokens 4096] [--methods ...]`.

The paper's Table 2 setting: a ~4K-token reasoning trace is compacted once to a ratio (0.1) of its entries.
Here the trace ("trace-60", a reasoning trace of the bundled model, from the quality benchmark's texts, or
"math-solutions" while the traces are not shipped) is
prefilled into a cache whose round fires right after the prefill (budget + slack = trace length, prompt not
protected), then one decode step runs the round. Reports the round's wall time split into scoring /
selection and fitting (policy.compact), per method, on this machine.
"""

from __future__ import annotations

import argparse
import time

import torch
from ..compat import cache_kwargs


def time_round(model, tokenizer, method: str, tokens: int = 4096, ratio: float = 0.1, stats=None, threads: int | None = None,
               **options) -> dict:
    from .quality.texts import load_texts, text_token_ids
    from ..cache import make_cache
    from ..policies import REGISTRY

    texts = {t.name: t for t in load_texts()}
    name = "trace-60" if "trace-60" in texts else "math-solutions"  # a reasoning trace when shipped
    ids = text_token_ids(texts[name], tokenizer)[:tokens]
    if len(ids) < tokens:
        raise ValueError(f"trace has only {len(ids)} tokens")
    slack = 1024
    budget = tokens - slack
    if REGISTRY[method].needs_stats:
        options["stats"] = stats
    if method.startswith(("tam", "pam", "selector-window")):
        options.setdefault("target_ratio", ratio)  # compact the region to `ratio` of its entries (one shot)
        options.setdefault("schedule", "shared")
        keep = None
    else:  # fixed-budget methods: the same number of entries kept as the ratio would give
        keep = max(1, int(round(ratio * tokens)))
        budget, slack = keep, tokens - keep
    cache = make_cache(model, method, budget=budget, divide_length=slack, protect_prompt=False, **options)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        started = time.perf_counter()
        out = model(input_ids=input_ids, **cache_kwargs(model, cache), use_cache=True)
        prefill = time.perf_counter() - started
        next_token = out.logits[:, -1:].argmax(-1)
        cache.decoding = True
        started = time.perf_counter()
        model(input_ids=next_token, **cache_kwargs(model, cache), use_cache=True)
        step = time.perf_counter() - started
    assert cache.rounds == 1, f"expected one round, got {cache.rounds}"
    live = int((cache.visible_positions() >= 0).sum(-1).max())
    return {
        "method": method,
        "text": name,
        "tokens": tokens,
        "entries_after": live,
        "prefill_s": prefill,
        "round_s": cache.scoring_seconds,
        "fit_s": cache.compaction_seconds,
        "select_s": cache.scoring_seconds - cache.compaction_seconds,
        "decode_step_s": step,
        "threads": torch.get_num_threads(),
        "diagnostics": getattr(cache.policy, "last_round", {}),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--methods", default="selector-window,pam,tam,triattention,tri-am")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .. import load_model, load_stats

    model, tokenizer = load_model(args.model)
    stats = load_stats(args.model, model)
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        r = time_round(model, tokenizer, method, args.tokens, args.ratio, stats=stats)
        diag = r.pop("diagnostics")
        print(f"{method:>16}: round {r['round_s']:.2f} s (selection {r['select_s']:.2f} s, fit {r['fit_s']:.2f} s), "
              f"{r['entries_after']} entries kept of {r['tokens']} ({r['text']}), prefill {r['prefill_s']:.1f} s, threads {r['threads']}")
        if diag:
            print("                  " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in diag.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
