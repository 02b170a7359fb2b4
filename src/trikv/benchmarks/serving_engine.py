"""One `trikv bench serve` measurement: one vLLM engine, N concurrent long generations, a steady-state window.

Run as `python -m trikv.benchmarks.serving_engine SPEC.json RESULT.json` (a fresh interpreter per engine: vLLM
starts its own processes and holds its KV pool until the interpreter exits).

Protocol: N request slots; every request generates until its total length reaches `length` tokens (greedy,
no EOS stop); a finished request is replaced at once by a new one with a short prompt of real text. Output
tokens, time to first token and time per output token are counted in a window of `window` seconds that
opens once the engine is in its steady regime:
- a bounded cache (trikv): a request's per-step cost stops depending on its age once it has been compacted,
  so the first requests start short (staggered by up to `stagger` prompt tokens, so that the rounds of
  different requests do not fall on the same step) and the window opens when every first request has been
  compacted at least once;
- full attention: its steady state has the requests' ages spread evenly over [0, length) and the KV pool full,
  which takes tens of minutes of generation to reach; instead slot i's first request carries a prompt of
  i / N x length tokens of real text (a request that has already run that long), the pool fills during their
  prefill, and the window opens `settle` seconds after the pool is first 95% full (or vLLM first preempts); where
  the N requests fit the pool at their full length (it never fills), `settle` seconds after their prefills.
`warmup_max` caps the warm-up either way. Driven offline (`vllm.LLM`'s engine, stepped here) or over HTTP
(`trikv serve`, streamed completions; same prompts, same rules).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path


def _text_ids(tokenizer, minimum: int) -> list[int]:
    """At least `minimum` token ids of real text (trikv's analysis texts: prose, code, math, repeated)."""
    from ..analysis.texts import default_texts

    ids: list[int] = []
    texts = list(default_texts().values())
    while len(ids) < minimum:
        for text in texts:
            ids += tokenizer(text)["input_ids"]
    return ids


def pre_aged_prompt(slot: int, slots: int, length: int, short: int) -> int:
    """Full attention: the first prompt's length of slot `slot` of `slots` (a request that has run slot / slots of
    its `length` tokens)."""
    return max(short, slot * (length - 2 * short) // slots)


def _prompts(spec: dict, tokenizer) -> list[list[int]]:
    """The first prompt of every slot: pre-aged for full attention, short and staggered for a bounded cache."""
    length, slots, short = spec["length"], spec["concurrency"], spec["short_prompt"]
    source = _text_ids(tokenizer, length + 997 * slots)
    first = []
    for slot in range(slots):
        if spec.get("trikv"):
            size = short + slot * spec["stagger"] // slots
        else:
            size = pre_aged_prompt(slot, slots, length, short)
        start = (slot * 997) % (len(source) - size)
        first.append(source[start : start + size])
    return first


def _short_prompt(spec: dict, source: list[int], index: int) -> list[int]:
    start = (index * 389) % (len(source) - spec["short_prompt"])
    return source[start : start + spec["short_prompt"]]


class Tracker:
    """Timestamps of every request's tokens; the window's statistics."""

    def __init__(self):
        self.added: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = {}
        self.window: tuple[float, float] | None = None

    def add(self, request_id: str) -> None:
        self.added[request_id] = time.perf_counter()
        self.token_times[request_id] = []

    def tokens(self, request_id: str, count: int, when: float) -> None:
        if count <= 0:
            return
        self.first_token.setdefault(request_id, when)
        self.token_times[request_id] += [when] * count

    def summary(self) -> dict:
        import numpy as np

        start, end = self.window
        in_window = sum(sum(1 for t in times if start <= t < end) for times in self.token_times.values())
        ttft = [self.first_token[r] - self.added[r] for r in self.first_token if start <= self.first_token[r] < end]
        gaps = []
        for times in self.token_times.values():
            distinct = sorted(set(times))
            gaps += [b - a for a, b in zip(distinct, distinct[1:]) if start <= a and b < end]

        def quantiles(values):
            if not values:
                return {"p50": None, "p99": None, "count": 0}
            return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)), "count": len(values)}

        return {
            "window_seconds": end - start,
            "output_tokens": in_window,
            "output_tokens_per_second": in_window / (end - start),
            "ttft_seconds": quantiles(ttft),
            "tpot_seconds": quantiles(gaps),
        }


def _engine_kwargs(spec: dict) -> dict:
    import trikv.vllm

    extra = trikv.vllm.engine_args(**spec["trikv"]) if spec.get("trikv") else {}
    if spec.get("max_position_embeddings"):  # --beyond-trained-context
        extra["hf_overrides"] = {"max_position_embeddings": spec["max_position_embeddings"]}
    return {
        "dtype": spec["dtype"], "kv_cache_dtype": spec.get("kv_cache_dtype", "auto"), "enforce_eager": True,
        "block_size": spec["block_size"], "max_model_len": spec["length"],
        "num_gpu_blocks_override": spec["pool_blocks"], "max_num_seqs": spec["concurrency"],
        "max_num_batched_tokens": spec["max_batched_tokens"], "disable_log_stats": False, **extra,
    }


def _metric(metrics, name: str) -> float | None:
    for metric in metrics:
        if metric.name == name:
            return float(getattr(metric, "value", 0) or 0)
    return None


def run_offline(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from ..models import resolve_model_path

    started = time.perf_counter()
    extra = {"distributed_executor_backend": "uni"} if spec.get("in_process") else {}
    llm = LLM(resolve_model_path(spec["model"]), **_engine_kwargs(spec), **extra)
    startup = time.perf_counter() - started
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    first = _prompts(spec, tokenizer)
    source = _text_ids(tokenizer, 4096)
    tracker = Tracker()
    counter = 0

    def submit(prompt: list[int]) -> None:
        nonlocal counter
        request_id = f"r{counter}"
        counter += 1
        params = SamplingParams(max_tokens=spec["length"] - len(prompt), temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        tracker.add(request_id)
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)

    for prompt in first:
        submit(prompt)
    initial = {f"r{i}" for i in range(len(first))}
    finished: set[str] = set()
    pool_full_since = None
    # N requests of `length` that fit the pool together never fill it (nor are preempted): full attention is in its
    # steady regime once their prefills are done, and waiting for a full pool would only run out `warmup_max`
    never_full = spec["concurrency"] * -(-spec["length"] // spec["block_size"]) <= spec["pool_blocks"] - 1
    warm_start = time.perf_counter()
    window_start = window_end = None
    peak_usage = 0.0
    preemptions_at_start = None
    steps = 0
    while True:
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            tracker.tokens(out.request_id, len(out.outputs[0].token_ids), now)
            if out.finished:
                finished.add(out.request_id)
                submit(_short_prompt(spec, source, counter))
        if steps % 20 == 0:
            metrics = engine.get_metrics()
            peak_usage = max(peak_usage, _metric(metrics, "vllm:kv_cache_usage_perc") or 0.0)
        if window_start is None and steps % 20 == 0:
            if spec.get("trikv"):  # every first request compacted (or already done)
                ready = initial <= _compacted(llm) | finished
            else:  # the pool has been full for `settle` seconds
                full = (_metric(metrics, "vllm:num_preemptions") or 0) > 0 or (_metric(metrics, "vllm:kv_cache_usage_perc") or 0) > 0.95
                if never_full and initial <= set(tracker.first_token):  # every first request prefilled: as full as it gets
                    full = True
                if full and pool_full_since is None:
                    pool_full_since = now
                ready = pool_full_since is not None and now - pool_full_since >= spec["settle"]
            if ready or now - warm_start > spec["warmup_max"]:
                window_start = now
                window_end = now + spec["window"]
                tracker.window = (window_start, window_end)
                preemptions_at_start = _metric(engine.get_metrics(), "vllm:num_preemptions") or 0.0
        elif window_start is not None and now >= window_end:
            break
    metrics = engine.get_metrics()
    result = tracker.summary()
    result.update({
        "startup_seconds": startup,
        "warmup_seconds": window_start - warm_start,
        "warmup_capped": window_start - warm_start > spec["warmup_max"],
        "preemptions_in_window": (_metric(metrics, "vllm:num_preemptions") or 0.0) - preemptions_at_start,
        "peak_kv_usage": peak_usage,
        "peak_kv_blocks": round(peak_usage * (spec["pool_blocks"] - 1)),
        "requests_started": counter,
    })
    if spec.get("trikv"):
        result["trikv"] = llm.collective_rpc("trikv_stats")[0]
    pool = kv_pool(llm)
    if pool is not None:
        result["kv_pool"] = pool
    engine.abort_request(list(tracker.added))
    shut_down(llm, spec.get("in_process", False))
    return result


def kv_pool(llm) -> dict | None:
    """The KV pool as the engine allocated it: its blocks, its bytes (every layer's KV tensors) and the bytes of one
    block over every layer (page size x layers of each KV cache group); None where the engine core runs in another
    process (its scheduler is not reachable from here)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
    if config is None:
        return None
    return {"num_blocks": config.num_blocks, "pool_bytes": sum(tensor.size for tensor in config.kv_cache_tensors),
            "block_bytes": sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names) for group in config.kv_cache_groups),
            "cache_dtype": str(llm.llm_engine.vllm_config.cache_config.cache_dtype)}


def shut_down(llm, in_process: bool) -> None:
    """Free the engine (its KV pool and, in-process, its distributed state): the next run may be built in this
    interpreter."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if in_process:
        cleanup_dist_env_and_memory()


def _compacted(llm) -> set[str]:
    """Ids (as the driver gave them) of the running requests trikv holds compacted (finished ones are dropped)."""
    return {request_id.split("-")[0] for request_id in llm.collective_rpc("trikv_stats")[0]["compacted_running"]}


def server_command(spec: dict) -> list[str]:
    """The `trikv serve` (vLLM OpenAI server) command of an http run: the run's pool, block size, length,
    concurrency and trikv settings."""
    import trikv.vllm

    from ..models import resolve_model_path

    args = [sys.executable, "-m", "trikv.vllm.launch", "serve", resolve_model_path(spec["model"]), "--port", str(spec["port"]),
            "--served-model-name", "model", "--dtype", spec["dtype"], "--enforce-eager", "--block-size", str(spec["block_size"]),
            "--max-model-len", str(spec["length"]), "--num-gpu-blocks-override", str(spec["pool_blocks"]),
            "--max-num-seqs", str(spec["concurrency"]), "--max-num-batched-tokens", str(spec["max_batched_tokens"]),
            "--kv-cache-dtype", spec.get("kv_cache_dtype", "auto")]
    if spec.get("trikv"):
        args += trikv.vllm.serve_flags(**spec["trikv"])
    return args


def run_http(spec: dict) -> dict:
    """The same protocol against `trikv serve` (vLLM's OpenAI-compatible server), streamed completions: a server
    started for the run (`server_command`), or the one answering at `spec["url"]`."""
    import subprocess
    import urllib.request

    from transformers import AutoTokenizer

    from ..models import resolve_model_path

    log_path = Path(spec["log"])
    started = time.perf_counter()
    server = None
    if spec.get("url"):
        base = spec["url"].rstrip("/")
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:  # the name it serves the model by
            model_name = json.loads(response.read())["data"][0]["id"]
    else:
        base, model_name = f"http://127.0.0.1:{spec['port']}", "model"
        with open(log_path, "w") as log:
            server = subprocess.Popen(server_command(spec), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if server is not None:
            wait_ready(server, spec["port"], log_path, timeout=spec.get("warmup_max", 600) + 600)
        startup = time.perf_counter() - started
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(spec["model"]))
        first = _prompts(spec, tokenizer)
        source = _text_ids(tokenizer, 4096)
        tracker = Tracker()
        stop = threading.Event()
        lock = threading.Lock()
        counter = [0]

        def stream(prompt: list[int]) -> None:
            with lock:
                request_id = f"r{counter[0]}"
                counter[0] += 1
                tracker.add(request_id)
            body = {"model": model_name, "prompt": prompt, "max_tokens": spec["length"] - len(prompt), "temperature": 0,
                    "ignore_eos": True, "stream": True}
            request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=3600) as response:
                for line in response:
                    if stop.is_set():
                        return
                    line = line.decode().strip()
                    if line.startswith("data: ") and line != "data: [DONE]":
                        with lock:
                            tracker.tokens(request_id, 1, time.perf_counter())

        def slot(index: int) -> None:
            prompt = first[index]
            while not stop.is_set():
                try:
                    stream(prompt)
                except OSError:
                    return
                prompt = _short_prompt(spec, source, index + counter[0])

        threads = [threading.Thread(target=slot, args=(i,), daemon=True) for i in range(len(first))]
        warm_start = time.perf_counter()
        for thread in threads:
            thread.start()
        while True:
            time.sleep(1)
            with lock:
                ready = all(f"r{i}" in tracker.first_token for i in range(len(first)))
            if ready or time.perf_counter() - warm_start > spec["warmup_max"]:
                break
        window_start = time.perf_counter()
        tracker.window = (window_start, window_start + spec["window"])
        time.sleep(spec["window"])
        stop.set()
        # every stream ends at its next token (the server still generates), closing its connection: a server
        # stopped with streams open waits for them to close, and they wait for tokens it no longer makes
        for thread in threads:
            thread.join(timeout=30)
        with lock:
            result = tracker.summary()
        result.update({"startup_seconds": startup, "warmup_seconds": window_start - warm_start, "requests_started": counter[0]})
        return result
    finally:
        if server is not None:
            stop_server(server)


def wait_ready(server, port: int, log_path: Path, timeout: float = 600) -> None:
    """Wait until the server started in `server` (a Popen) answers /health; its log's tail if it exits or times out."""
    import urllib.request

    deadline = time.time() + timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"server exited:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            if time.time() > deadline:
                raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{log_path.read_text()[-4000:]}") from None
            time.sleep(2)


def stop_server(server) -> None:
    """Stop a server started in its own process group (`start_new_session=True`) and every process it started."""
    import signal
    import subprocess

    if server.poll() is not None:
        return  # it exited by itself: no group is left to signal
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def run(spec: dict) -> dict:
    """One run in this interpreter: offline in-process runs may follow each other here (each engine is shut down
    before the next is built)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if spec.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = run_http(spec) if spec.get("mode") == "http" else run_offline(spec)
    return {"spec": spec, **result}


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    Path(result_path).write_text(json.dumps(run(spec), indent=2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
