"""Multi-turn chat on vLLM with a bounded (trikv) cache, with vLLM's prefix caching on and off: each turn's prompt is
the conversation so far (a shared system prompt, the earlier messages and replies) and a new message. Prints, per
turn, the prompt's length, the tokens vLLM's own prefix-cache counters report hit and the time to first token, and
checks that both engines emit the same tokens (a bounded request's hit ends on its prefill-chunk grid below
budget + divide_length, so its rounds and tokens do not depend on the cache).

    python scripts/measure_prefix_caching.py [--sessions 2] [--turns 6] [--budget 256] [--out prefix_caching.json]

Runs in-process on the CPU build as on CUDA (pass --allow-untested-platform there); one engine after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def conversation_texts(tokenizer, sessions: int, turns: int, system_tokens: int, message_tokens: int) -> tuple[list[int], list[list[list[int]]]]:
    """A system prompt and, per session, `turns` messages: token ids cut from trikv's bundled texts."""
    import trikv

    folder = Path(trikv.__file__).parent / "data" / "analysis_texts"
    ids = [t for name in ("prose", "code", "math", "prose") for t in tokenizer((folder / f"{name}.txt").read_text())["input_ids"]]
    system, rest = ids[:system_tokens], ids[system_tokens:]
    messages = [[rest[(s * turns + t) * message_tokens : (s * turns + t + 1) * message_tokens] for t in range(turns)]
                for s in range(sessions)]
    return system, messages


def run_engine(args, caching: bool, system: list[int], messages: list[list[list[int]]]) -> dict:
    import trikv.vllm
    from trikv.benchmarks.serving_engine import shut_down
    from trikv.models import resolve_model_path
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = {} if args.method == "full" else {
        "method": args.method, "budget": args.budget, "divide_length": args.divide_length,
        "prefill_chunk_size": args.chunk, "stats": args.stats, "allow_untested_platform": args.allow_untested_platform}
    extra = trikv.vllm.engine_args(**settings, prefix_caching=caching) if settings else {"enable_prefix_caching": caching}
    llm = LLM(resolve_model_path(args.model), dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
              block_size=32, disable_log_stats=False, distributed_executor_backend="uni", **extra)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=args.reply_tokens, min_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)

    def counters() -> tuple[float, float]:
        found = {"vllm:prefix_cache_queries": 0.0, "vllm:prefix_cache_hits": 0.0}
        for metric in llm.get_metrics():
            if metric.name in found:
                found[metric.name] += metric.value
        return found["vllm:prefix_cache_queries"], found["vllm:prefix_cache_hits"]

    # warm-up: one short request (first forwards pay one-off costs)
    llm.generate([TokensPrompt(prompt_token_ids=system[:64])], SamplingParams(max_tokens=4), use_tqdm=False)
    turns, serial = [], 0
    for session, session_messages in enumerate(messages):
        history = list(system)
        for turn, message in enumerate(session_messages):
            prompt = history + message
            queries, hits = counters()
            serial += 1
            request_id = f"s{session}-t{turn}-{serial}"
            started = time.perf_counter()
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
            first, tokens = None, []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.outputs and out.outputs[0].token_ids and first is None:
                        first = time.perf_counter() - started
                    tokens = list(out.outputs[0].token_ids)
            after_queries, after_hits = counters()
            turns.append({"session": session, "turn": turn, "prompt_tokens": len(prompt), "hit_tokens": int(after_hits - hits),
                          "queried_tokens": int(after_queries - queries), "ttft_seconds": first, "tokens": tokens})
            history = prompt + tokens
    stats = llm.collective_rpc("trikv_stats")[0] if settings else {}
    shut_down(llm, True)
    return {"prefix_caching": caching, "turns": turns, "rounds": stats.get("rounds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--stats", default="smollm2-135m")
    parser.add_argument("--method", default="triattention", help="a trikv method, or 'full' (plain vLLM)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--divide-length", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=128, help="prefill_chunk_size")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=240)
    parser.add_argument("--message-tokens", type=int, default=100)
    parser.add_argument("--reply-tokens", type=int, default=40)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--allow-untested-platform", action="store_true")
    parser.add_argument("--out", help="write the per-turn figures here (JSON)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import trikv

    _, tokenizer = trikv.load_model(args.model)
    system, messages = conversation_texts(tokenizer, args.sessions, args.turns, args.system_tokens, args.message_tokens)
    runs = [run_engine(args, caching, system, messages) for caching in (False, True)]
    off, on = runs
    print(f"{args.method} B={args.budget} divide_length={args.divide_length} chunk={args.chunk} ({args.dtype}); "
          f"rounds: off {off['rounds']}, on {on['rounds']}")
    print("session turn prompt | hit (on) | TTFT off (s) | TTFT on (s) | same tokens")
    for a, b in zip(off["turns"], on["turns"]):
        print(f"{a['session']:7d} {a['turn']:4d} {a['prompt_tokens']:6d} | {b['hit_tokens']:8d} | {a['ttft_seconds']:12.3f} | "
              f"{b['ttft_seconds']:11.3f} | {a['tokens'] == b['tokens']}")
    for run in runs:
        queried = sum(t["queried_tokens"] for t in run["turns"])
        hit = sum(t["hit_tokens"] for t in run["turns"])
        ttft = sum(t["ttft_seconds"] for t in run["turns"]) / len(run["turns"])
        print(f"prefix caching {'on ' if run['prefix_caching'] else 'off'}: hit rate {hit / max(queried, 1):.1%} "
              f"({hit} of {queried} prompt tokens), mean TTFT {ttft:.3f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
