"""Run one vLLM engine for the tests, in its own process: `python vllm_scenario.py SPEC.json RESULT.json`.

Each engine runs in a fresh interpreter, which keeps the test process free of vLLM. SPEC: {"model", "dtype",
"trikv": settings for trikv.vllm.engine_args or null (plain vLLM), "engine": extra vllm.LLM arguments, "env":
environment variables, "in_process": engine core and worker inside this interpreter (default; false runs
vLLM's usual separate processes, which tensor parallelism needs), "batches": [{"prompts": [token id lists],
"max_tokens", "min_tokens"}]}. RESULT: per batch the prompt and generated token ids of every request, then
every rank's round records and statistics.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as handle:
        spec = json.load(handle)
    os.environ.update({key: str(value) for key, value in spec.get("env", {}).items()})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    in_process = spec.get("in_process", True)
    if in_process:  # engine core and worker in this process: starts in seconds; the plugin code is the same
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import trikv.vllm
    from trikv.models import resolve_model_path
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = trikv.vllm.engine_args(**spec["trikv"]) if spec.get("trikv") else {}
    engine = {"dtype": spec.get("dtype", "float32"), "enforce_eager": True, "max_model_len": 2048, "block_size": 32,
              **({"distributed_executor_backend": "uni"} if in_process else {}), **spec.get("engine", {})}
    started = time.perf_counter()
    llm = LLM(resolve_model_path(spec["model"]), **engine, **extra)
    result = {"startup_seconds": time.perf_counter() - started, "batches": []}
    for batch in spec["batches"]:
        params = SamplingParams(max_tokens=batch["max_tokens"], min_tokens=batch.get("min_tokens", batch["max_tokens"]),
                                temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch["prompts"]], params, use_tqdm=False)
        result["batches"].append({
            "seconds": time.perf_counter() - started,
            "requests": [{"request_id": out.request_id, "prompt": list(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids)}
                         for out in outputs],
        })
    if extra:
        result["rounds"] = llm.collective_rpc("trikv_rounds")  # one list per rank
        result["stats"] = llm.collective_rpc("trikv_stats")
    with open(result_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
