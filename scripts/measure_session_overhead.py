"""What session reuse costs when no conversation continues: unrelated requests on one engine with it on and off.

    python scripts/measure_session_overhead.py [--requests 24] [--tokens 64] [--repeats 3]

One offline vLLM engine per setting (SmolLM2-135M, fp32, TriAttention B=64, slack 32, so every request is compacted
and kept when it finishes), in this interpreter one after the other; each run sends `--requests` prompts of real
text that share nothing (no state is ever continued: every request looks one up and misses, and every finished one
is kept until the pool needs its blocks), generating `--tokens` tokens each. The runs alternate on/off `--repeats`
times; it prints each run's output tokens per second, the medians and their ratio, and the session figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import trikv.vllm
    from trikv.analysis.texts import default_texts
    from trikv.benchmarks.serving_engine import shut_down
    from trikv.models import resolve_model_path
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    path = resolve_model_path("smollm2-135m")
    engines = {}
    for reuse in (True, False):
        extra = trikv.vllm.engine_args(method="triattention", budget=64, divide_length=32, stats="smollm2-135m",
                                       session_reuse=reuse)
        engines[reuse] = LLM(path, dtype="float32", enforce_eager=True, max_model_len=2048, block_size=32,
                             distributed_executor_backend="uni", num_gpu_blocks_override=200, **extra)
    tokenizer = engines[True].get_tokenizer()
    ids = [token for text in default_texts().values() for token in tokenizer(text)["input_ids"]]
    params = SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    rates = {True: [], False: []}
    for repeat in range(args.repeats):
        for reuse in (True, False):
            first = repeat * 5000 + (0 if reuse else 2500)  # another text every run: no kept state ever matches
            starts = [(first + index * 97) % (len(ids) - 48) for index in range(args.requests)]
            prompts = [TokensPrompt(prompt_token_ids=ids[start : start + 48]) for start in starts]
            started = time.perf_counter()
            engines[reuse].generate(prompts, params, use_tqdm=False)
            rate = args.requests * args.tokens / (time.perf_counter() - started)
            rates[reuse].append(rate)
            print(f"run {repeat}, session reuse {'on ' if reuse else 'off'}: {rate:.1f} output tokens/s", flush=True)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"median: on {on:.1f}, off {off:.1f} output tokens/s (on / off = {on / off:.3f})")
    print(f"session figures (on): {trikv.vllm.session_stats(engines[True])}")
    for engine in engines.values():
        shut_down(engine, True)


if __name__ == "__main__":
    main()
