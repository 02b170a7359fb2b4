"""Run vLLM engines for the tests, outside the test process: `python vllm_scenario.py SPEC.json RESULT.json [...]`.

The pairs of arguments run one after the other in this interpreter, each on an engine built afresh (importing
vLLM once saves ~7 s per engine); an engine that fails writes {"error": its traceback} and the next one runs.
The test process stays free of vLLM. SPEC: {"model", "dtype",
"trikv": settings for trikv.vllm.engine_args or null (plain vLLM), "engine": extra vllm.LLM arguments, "env":
environment variables, "in_process": engine core and worker inside this interpreter (default; false runs
vLLM's usual separate processes, which tensor parallelism needs), "batches": [{"prompts": [token id lists],
"max_tokens", "min_tokens", optional "extra_args": [one SamplingParams.extra_args per prompt], "eos": true (stop at the
end-of-sequence token), "n" (SamplingParams.n; n > 1 samples at temperature 1, seed 0), "cache_salt" (every prompt's), a prompt may be {"after": [batch,
request], "output_tokens", "then"} (`_resolve_prompt`: a conversation's next turn), optional "lora": a LoRA
adapter's folder (every request of the batch runs with it), optional "structured": StructuredOutputsParams
arguments (e.g. {"regex": ...}) for every request of the batch, optional "abort":
{"after_steps", "requests": [indices]}: those requests are aborted, optional "arrivals": [the step at which each
request is added], "priorities": [vLLM priority per request], "max_tokens" a list (one per request); any of these
steps the engine by hand, "max_steps" (default 5000) then bounds the steps: a stalled engine fails the run;
"frontend_checks": false sends the batch through `LLM.generate` without trikv's front-end checks (what reaches the
engine is then the engine's to refuse); "resumable": true adds each prompt as a streaming-input session, straight
to the engine}], "probe": true (in-process) records, at every step with rounds, what the runner's persistent
buffers hold (`vllm_probe.py`), "schedule_records": true (in-process, trikv) records every step's schedule, "kv_scales": {"k", "v"} (in-process) sets
every attention layer's fp8 KV scales before the first batch, "metrics": true records after every batch vLLM's own
prefix-cache counters (`LLM.get_metrics`, cumulative; needs "engine": {"disable_log_stats": false}) and, with trikv, the
rounds run so far, "cache_guard":
true (in-process, trikv) checks at every round what prefix caching must never see (`_guard_cache`), "alone": true
runs the engine in an interpreter of its own, "spec_decoding": true (in-process) sums vLLM's speculative-decoding statistics over the run (`_count_spec_decoding`), "record_keys": a path (in-process, trikv) where the keys
the full-attention layers hand vLLM's KV write are saved, by request, layer and position}.
RESULT: per batch the prompt, generated token ids, finish and stop reasons, cached (not computed) prompt tokens of
every request, with trikv in process session reuse's figures after the batch (`trikv.vllm.session_stats`) (with
"schedule_records", the batch's steps: {request id: [first token computed, tokens scheduled, full-attention blocks
it holds for the step, its offset (logical - physical tokens) for the step]} per step), then every rank's round
records and statistics (in-process: the pool's free blocks at the end and each KV cache group's page bytes, block
size and layers; with "probe": the probe's findings).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback


def main(pairs: list[tuple[str, str]]) -> None:
    specs = []
    for spec_path, _ in pairs:
        with open(spec_path) as handle:
            specs.append(json.load(handle))
    if len(specs) > 1 and not all(spec.get("in_process", True) and not spec.get("env") and not spec.get("alone")
                                  for spec in specs):
        raise SystemExit("only in-process engines without their own environment share an interpreter")
    os.environ.update({key: str(value) for key, value in specs[0].get("env", {}).items()})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if specs[0].get("in_process", True):  # engine core and worker in this process: starts in seconds; the plugin code is the same
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for spec, (_, result_path) in zip(specs, pairs):
        started = time.perf_counter()
        try:
            result = run(spec)
            result["seconds"] = time.perf_counter() - started  # the whole run: start-up, batches, shut-down
        except Exception:
            result = {"error": traceback.format_exc()}
            print(result["error"], file=sys.stderr, flush=True)
            if len(specs) > 1:  # an engine that failed half-built must not leave its distributed state to the next
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                gc.collect()
                cleanup_dist_env_and_memory()
        with open(result_path, "w") as handle:
            json.dump(result, handle)


def run(spec: dict) -> dict:
    import trikv.vllm
    from trikv.benchmarks.serving_engine import shut_down
    from trikv.models import resolve_model_path
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    in_process = spec.get("in_process", True)
    extra = trikv.vllm.engine_args(**spec["trikv"]) if spec.get("trikv") else {}
    engine = {"dtype": spec.get("dtype", "float32"), "enforce_eager": True, "max_model_len": 2048, "block_size": 32,
              **({"distributed_executor_backend": "uni"} if in_process else {}), **spec.get("engine", {})}
    started = time.perf_counter()
    llm = LLM(resolve_model_path(spec["model"]), **engine, **extra)
    result = {"startup_seconds": time.perf_counter() - started, "batches": []}
    if spec.get("probe"):
        import vllm_probe

        llm.collective_rpc(vllm_probe.install)
    if spec.get("kv_scales"):
        import vllm_probe

        llm.collective_rpc(vllm_probe.set_kv_scales, args=(spec["kv_scales"]["k"], spec["kv_scales"]["v"]))
    if spec.get("record_keys"):
        import vllm_probe

        llm.collective_rpc(vllm_probe.record_keys)
    steps = _record_schedules(llm) if spec.get("schedule_records") else None
    drafts = _count_spec_decoding(llm) if spec.get("spec_decoding") else None
    guard = _guard_cache(llm) if spec.get("cache_guard") else None
    for batch in spec["batches"]:
        batch = {**batch, "prompts": [_resolve_prompt(prompt, result["batches"]) for prompt in batch["prompts"]]}
        eos = batch.get("eos", False)  # stop at the end-of-sequence token (trikv.Session's rule) instead of ignoring it
        sampled = {"temperature": 1.0, "seed": 0} if batch.get("n", 1) > 1 else {"temperature": 0.0}  # vLLM: n > 1 samples
        params = [SamplingParams(max_tokens=count, min_tokens=0 if eos else batch.get("min_tokens", count), ignore_eos=not eos,
                                 n=batch.get("n", 1), **sampled)
                  for count in (batch["max_tokens"] if isinstance(batch["max_tokens"], list) else [batch["max_tokens"]] * len(batch["prompts"]))]
        for request_params, extra_args in zip(params, batch.get("extra_args", [])):  # a request's own trikv budget
            request_params.extra_args = extra_args
        if batch.get("structured"):  # vLLM's structured output (a grammar over the generated text)
            from vllm.sampling_params import StructuredOutputsParams

            for request_params in params:
                request_params.structured_outputs = StructuredOutputsParams(**batch["structured"])
        lora = None
        if batch.get("lora"):
            from vllm.lora.request import LoRARequest

            lora = LoRARequest("adapter", 1, batch["lora"])
        started = time.perf_counter()
        if batch.get("resumable"):
            requests = _resumable_by_hand(llm, batch, params, TokensPrompt)
        elif {"abort", "arrivals", "priorities"} & set(batch) or isinstance(batch["max_tokens"], list):
            requests = _step_by_hand(llm, batch, params, TokensPrompt)
        else:
            salt = {"cache_salt": batch["cache_salt"]} if batch.get("cache_salt") else {}
            with _frontend_checks(batch.get("frontend_checks", True)):
                outputs = llm.generate([TokensPrompt(prompt_token_ids=ids, **salt) for ids in batch["prompts"]], params,
                                       use_tqdm=False, lora_request=lora)
            requests = [{"request_id": out.request_id, "prompt": list(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids),
                         "finish_reason": out.outputs[0].finish_reason, "stop_reason": out.outputs[0].stop_reason,
                         "cached_tokens": out.num_cached_tokens, "choices": [list(choice.token_ids) for choice in out.outputs]}
                        for out in outputs]
        result["batches"].append({"seconds": time.perf_counter() - started, "requests": requests})
        if spec.get("metrics"):
            result["batches"][-1]["metrics"] = _prefix_cache_counters(llm)
            if extra:  # the rounds run so far: the batch's rounds are those recorded since the batch before
                result["batches"][-1]["metrics"]["rounds"] = llm.collective_rpc("trikv_stats")[0]["rounds"]
        if extra and (extra["additional_config"]["trikv"].get("session_reuse", True)) and in_process:
            result["batches"][-1]["sessions"] = trikv.vllm.session_stats(llm)
        if steps is not None:  # request ids restart with every batch: each keeps its own steps
            result["batches"][-1]["schedule"] = list(steps)
            steps.clear()
    if in_process:  # every block back in the pool once all requests ended (finished, aborted or preempted)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        result["free_blocks_at_end"] = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        result["kv_groups"] = [{"page_size_bytes": group.kv_cache_spec.page_size_bytes, "block_size": group.kv_cache_spec.block_size,
                                "layers": len(group.layer_names)} for group in scheduler.kv_cache_config.kv_cache_groups]
    if spec.get("probe"):
        import vllm_probe

        result["probe"] = llm.collective_rpc(vllm_probe.findings)
    if drafts is not None:
        result["spec_decoding"] = drafts
    if guard is not None:
        result["cache_guard"] = guard
    if spec.get("record_keys"):
        import vllm_probe

        result["keys_written"] = llm.collective_rpc(vllm_probe.keys_written, args=(spec["record_keys"],))[0]
    if extra:
        result["rounds"] = llm.collective_rpc("trikv_rounds")  # one list per rank
        result["stats"] = llm.collective_rpc("trikv_stats")
    shut_down(llm, in_process)  # the next engine may be built in this interpreter
    return result


def _resolve_prompt(prompt, batches: list[dict]) -> list[int]:
    """A prompt's token ids: a list as it is, or {"after": [batch, request], "output_tokens": k, "then": ids}: that
    earlier request's prompt and its first k generated tokens (all when k is absent or null), then `then` (a
    conversation's next turn, as a client re-sends it)."""
    if isinstance(prompt, list):
        return prompt
    earlier = batches[prompt["after"][0]]["requests"][prompt["after"][1]]
    tokens = earlier["tokens"] if prompt.get("output_tokens") is None else earlier["tokens"][: prompt["output_tokens"]]
    return list(earlier["prompt"]) + list(tokens) + list(prompt.get("then", []))


def _count_spec_decoding(llm) -> dict:
    """Sum, over the engine's steps, vLLM's own speculative-decoding statistics (the `SpecDecodingStats` its scheduler
    attaches to each step's output: drafts, draft tokens proposed, draft tokens accepted). Needs log stats on
    ("engine": {"disable_log_stats": false})."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    update, totals = scheduler.update_from_output, {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}

    def counted(*args, **kwargs):
        outputs = update(*args, **kwargs)
        for batch in outputs.values():
            stats = getattr(getattr(batch, "scheduler_stats", None), "spec_decoding_stats", None)
            if stats is not None:
                totals["drafts"] += stats.num_drafts
                totals["draft_tokens"] += stats.num_draft_tokens
                totals["accepted_tokens"] += stats.num_accepted_tokens
        return outputs

    scheduler.update_from_output = counted
    return totals


def _record_schedules(llm) -> list[dict]:
    """Record, at every step the scheduler plans, each scheduled request's chunk ([first token computed, tokens
    scheduled]), the blocks of the full-attention group it holds for that step and its offset, read from the
    scheduler's own bookkeeping once the step is planned (vLLM has then counted the step's tokens as computed)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, steps = scheduler.schedule, []

    def recorded(*args, **kwargs):
        output = schedule(*args, **kwargs)
        blocks = scheduler._trikv_manager.req_to_blocks
        steps.append({request_id: [scheduler.requests[request_id].num_computed_tokens - count, count,
                                   len(blocks.get(request_id, ())), scheduler.trikv_offsets.get(request_id, 0)]
                      for request_id, count in output.num_scheduled_tokens.items()})
        return output

    scheduler.schedule = recorded
    return steps


def _prefix_cache_counters(llm) -> dict:
    """vLLM's own prefix-cache counters so far (tokens looked up, tokens hit), from its Prometheus metrics."""
    counters = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}
    found = {"queries": 0, "hits": 0}
    for metric in llm.get_metrics():
        if metric.name in counters:
            found[counters[metric.name]] += metric.value
    return found


def _guard_cache(llm) -> dict:
    """Check, at every round of an in-process trikv engine with prefix caching, the rule prefix caching relies on,
    from the scheduler's block pool and the worker's KV pages: every block a round writes (the first kept_blocks of
    the request's blocks once the worker has applied the round's copies) is held by that request alone and uncached,
    and the bytes of every cached block a round reads are the same after the round (a hit returns what its hash
    names); after every step is planned, no compacted request holds a cached block (its blocks are never hashed
    after its first round). Returns the counts and the violations found."""
    import hashlib

    import torch

    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    runner = core.model_executor.driver_worker.worker.model_runner
    pool = scheduler.kv_cache_manager.block_pool
    report = {"rounds": 0, "copies": 0, "cached_blocks_read": 0, "written_shared_or_cached": [], "cached_bytes_changed": [],
              "cached_after_round": []}

    def cached(block_id: int) -> bool:
        block = pool.blocks[block_id]
        return block.block_hash is not None or block_id in pool.cached_block_hashes_by_block

    def fingerprint(block_id: int) -> str:
        pages = b"".join(cache[block_id].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                         for cache in runner._trikv_caches)
        return hashlib.sha1(pages).hexdigest()

    group = runner._trikv_group
    before_step = runner._trikv_before_step

    def guarded_before_step(scheduler_output, plan):
        rounds = list(plan.rounds) if plan is not None else []
        before = {}
        for op in rounds:  # the request's blocks before the round (and before its copies)
            before.update({block_id: fingerprint(block_id) for block_id in runner.requests[op.request_id].block_ids[group]
                           if cached(block_id)})
        before_step(scheduler_output, plan)
        for op in rounds:
            report["rounds"] += 1
            report["copies"] += len(op.copies)
            for block_id in runner.requests[op.request_id].block_ids[group][: op.kept_blocks]:  # what the round wrote
                if not pool.is_block_writable(pool.blocks[block_id]) or cached(block_id):
                    report["written_shared_or_cached"].append([op.request_id, block_id])
        report["cached_blocks_read"] += len(before)
        report["cached_bytes_changed"] += [block_id for block_id, print_ in before.items()
                                           if cached(block_id) and fingerprint(block_id) != print_]

    runner._trikv_before_step = guarded_before_step
    schedule = scheduler.schedule

    def guarded_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        for request_id in scheduler.trikv_offsets:
            report["cached_after_round"] += [[request_id, block.block_id]
                                             for block in scheduler._trikv_manager.req_to_blocks.get(request_id, ())
                                             if cached(block.block_id)]
        return output

    scheduler.schedule = guarded_schedule
    return report


def _step_by_hand(llm, batch: dict, params: list, TokensPrompt) -> list[dict]:
    """Drive the engine step by step: add each request at its arrival step with its priority, abort
    `batch["abort"]["requests"]` (indices) after `batch["abort"]["after_steps"]` steps; an aborted request reports the
    tokens it had streamed (None if none). Each request also reports the steps at which it produced tokens."""
    engine = llm.llm_engine
    count = len(batch["prompts"])
    ids = [str(index) for index in range(count)]  # vLLM appends "-<suffix>" to each
    arrivals = batch.get("arrivals", [0] * count)
    priorities = batch.get("priorities", [0] * count)
    abort = batch.get("abort", {"after_steps": -1, "requests": []})
    aborted = {ids[index] for index in abort["requests"]}
    latest, token_steps, steps = {}, {request_id: [] for request_id in ids}, 0
    while steps == 0 or engine.has_unfinished_requests() or steps <= max(arrivals):
        for index in range(count):
            if arrivals[index] == steps:
                salt = {"cache_salt": batch["cache_salt"]} if batch.get("cache_salt") else {}
                engine.add_request(ids[index], TokensPrompt(prompt_token_ids=batch["prompts"][index], **salt), params[index],
                                   priority=priorities[index])
        for out in engine.step():
            if len(out.outputs[0].token_ids) > len(latest.get(out.request_id, [])):
                token_steps[out.request_id].append(steps)
            latest[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == abort["after_steps"]:
            engine.abort_request(sorted(aborted))
        if steps > batch.get("max_steps", 5000):
            raise RuntimeError(f"the engine did not finish in {steps} steps (stalled)")
    return [{"request_id": request_id, "prompt": prompt, "tokens": latest.get(request_id), "aborted": request_id in aborted,
             "token_steps": token_steps[request_id]}
            for request_id, prompt in zip(ids, batch["prompts"])]


class _frontend_checks:
    """With `enabled` False, vLLM's own `InputProcessor.process_inputs` (trikv's front-end checks unwrapped) for the
    duration of the block: the requests reach the engine as from a front end without trikv's plugin."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        from vllm.v1.engine.input_processor import InputProcessor

        self.checked = InputProcessor.process_inputs
        if not self.enabled:
            InputProcessor.process_inputs = self.checked.__wrapped__

    def __exit__(self, *exc):
        from vllm.v1.engine.input_processor import InputProcessor

        InputProcessor.process_inputs = self.checked


def _resumable_by_hand(llm, batch: dict, params: list, TokensPrompt, steps: int = 50) -> list[dict]:
    """Each prompt as a streaming-input session (`resumable`), built by vLLM's own input processor and added to the
    engine directly; step until each has a finish reason (at most `steps`), then abort what is left."""
    engine = llm.llm_engine
    processor = engine.input_processor
    ids, finished = [f"stream-{index}" for index in range(len(batch["prompts"]))], {}
    for request_id, prompt, request_params in zip(ids, batch["prompts"], params):
        core = type(processor).process_inputs.__wrapped__(processor, request_id, TokensPrompt(prompt_token_ids=prompt),
                                                          request_params, engine.get_supported_tasks(), resumable=True)
        engine.add_request(request_id, core, request_params)
    for _ in range(steps):
        for out in engine.step():
            if out.outputs and out.outputs[0].finish_reason is not None:
                finished[out.request_id] = {"tokens": list(out.outputs[0].token_ids), "finish_reason": out.outputs[0].finish_reason,
                                            "stop_reason": out.outputs[0].stop_reason}
        if len(finished) == len(ids):
            break
    engine.abort_request(ids)
    return [{"request_id": request_id, "prompt": prompt, **finished.get(request_id, {"tokens": None, "finish_reason": None})}
            for request_id, prompt in zip(ids, batch["prompts"])]


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if not arguments or len(arguments) % 2:
        raise SystemExit("usage: vllm_scenario.py SPEC.json RESULT.json [SPEC.json RESULT.json ...]")
    main(list(zip(arguments[::2], arguments[1::2])))
