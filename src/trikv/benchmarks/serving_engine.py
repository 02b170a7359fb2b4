"""One `trikv bench serve` measurement: one vLLM engine, N concurrent long generations, a steady-state window.

Run as `python -m trikv.benchmarks.serving_engine SPEC.json RESULT.json` (a fresh interpreter per engine: vLLM
starts its own processes and holds its KV pool until the interpreter exits).

Protocol (the same for every method):
- N request slots; every request generates until its total length reaches `length` tokens (greedy, no EOS
  stop); a finished request is replaced at once by a new one. Prompts are short real text; the first
  request of slot i gets `i * stagger / N` more prompt tokens, so that trikv's rounds (every divide_length
  tokens) do not all fall on the same step.
- Warm-up, then a window of `window` seconds in which output tokens, time to first token and time per
  output token are counted. The window opens when the engine is in its steady regime: with trikv, once every
  first request has been compacted at least once; for full attention, once the KV pool is full (vLLM
  preempts, or the pool is 95% used). Full attention's requests are then about pool / N tokens long, shorter
  than in its true steady state (up to `length`), which can only flatter full attention. `warmup_max` caps it.
Driven either offline (`vllm.LLM`'s engine, stepped here) or over HTTP (`trikv serve`, streamed completions).
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


def _prompts(spec: dict, tokenizer) -> list[list[int]]:
    """The first prompt of every slot: short, staggered by up to `stagger` tokens."""
    slots = spec["concurrency"]
    source = _text_ids(tokenizer, 4096)
    first = []
    for slot in range(slots):
        size = spec["short_prompt"] + slot * spec["stagger"] // slots
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
    return {
        "dtype": spec["dtype"], "enforce_eager": True, "block_size": spec["block_size"], "max_model_len": spec["length"],
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
    llm = LLM(resolve_model_path(spec["model"]), **_engine_kwargs(spec))
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
            else:  # the pool is full
                ready = (_metric(metrics, "vllm:num_preemptions") or 0) > 0 or (_metric(metrics, "vllm:kv_cache_usage_perc") or 0) > 0.95
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
    engine.abort_request(list(tracker.added))
    return result


def _compacted(llm) -> set[str]:
    """Ids (as the driver gave them) of the requests trikv has compacted at least once."""
    return {request_id.split("-")[0] for request_id in llm.collective_rpc("trikv_stats")[0]["compacted"]}


def run_http(spec: dict) -> dict:
    """The same protocol against `trikv serve` (vLLM's OpenAI-compatible server), streamed completions."""
    import subprocess
    import urllib.request

    from transformers import AutoTokenizer

    from ..models import resolve_model_path

    port = spec["port"]
    args = [sys.executable, "-m", "trikv.vllm.launch", "serve", resolve_model_path(spec["model"]), "--port", str(port),
            "--served-model-name", "model"]
    for key, value in _engine_kwargs(spec).items():
        if key in ("disable_log_stats",) or value is False and key != "enable_prefix_caching":
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    log_path = Path(spec["log"])
    started = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"server exited: {log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(2)
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
            body = {"model": "model", "prompt": prompt, "max_tokens": spec["length"] - len(prompt), "temperature": 0,
                    "ignore_eos": True, "stream": True}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
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
        with lock:
            result = tracker.summary()
        result.update({"startup_seconds": startup, "warmup_seconds": window_start - warm_start, "requests_started": counter[0]})
        return result
    finally:  # the server and every process it started
        import signal

        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = run_http(spec) if spec.get("mode") == "http" else run_offline(spec)
    Path(result_path).write_text(json.dumps({"spec": spec, **result}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
