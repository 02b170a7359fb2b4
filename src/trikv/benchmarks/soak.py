"""`trikv bench soak`: many requests through `trikv serve`; nothing may accumulate.

Starts `trikv serve` (the bundled model by default) and keeps `--concurrency` streamed completions in flight
until `--requests` have been sent: prompts of real text with lengths drawn from [short, long], output lengths
drawn from [1, --max-new-tokens] (most past budget + divide_length, so they are compacted), and a share
`--abort-share` closed by the client after a few tokens (vLLM aborts them). After every `--sample-every`
finished requests it records the server's resident memory (all its processes) and `GET /trikv/stats`. At
the end, with no request in flight, the compactor must hold no per-request state (`compacted_running` empty
on every rank), every request must have ended as asked (all its tokens, or aborted), and the server must still
answer. Results: `soak.json` (every sample, the verdicts) and `soak.png` (RSS and requests compacted against
requests served) in `--out`.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import register_bench


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="triattention", help="a method vLLM runs, or full (plain vLLM: the control)")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--divide-length", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2000, help="requests to send (default 2000)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="largest output length drawn")
    parser.add_argument("--prompt-lengths", default="8,160", help="shortest,longest prompt in tokens (default 8,160)")
    parser.add_argument("--abort-share", type=float, default=0.1, help="share of requests closed by the client (default 0.1)")
    parser.add_argument("--sample-every", type=int, default=100, help="finished requests between samples (default 100)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--url", help="soak a running `trikv serve` at this address (e.g. http://127.0.0.1:8000) instead of "
                                      "starting one; its memory is read only with --server-pid")
    parser.add_argument("--server-pid", type=int, help="with --url: the server's process-group leader, for its RSS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/soak", help="output folder (default runs/soak)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=main)


def server_rss_bytes(pid: int) -> int:
    """Resident memory of the process group led by `pid` (the server, its engine core and workers)."""
    listing = subprocess.run(["ps", "-o", "rss=", "-g", str(pid)], capture_output=True, text=True).stdout
    return sum(int(value) for value in listing.split()) * 1024


def _get_json(url: str):
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


def _start_server(args, longest: int, log_path: Path):
    import os

    from .serving_engine import stop_server, wait_ready

    command = [sys.executable, "-m", "trikv.cli", "serve", "--model", args.model, "--method", args.method,
               "--budget", str(args.budget), "--divide-length", str(args.divide_length), "--port", str(args.port), "--",
               "--dtype", "float32", "--max-model-len", str(longest + args.max_new_tokens + 8), "--block-size", "32",
               "--enforce-eager", "--max-num-seqs", str(args.concurrency)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.pop("VLLM_PLUGINS", None)  # `trikv serve` names its stats endpoint
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_ready(server, args.port, log_path)
    except BaseException:
        stop_server(server)
        raise
    return server


def run_soak(args) -> dict:
    import urllib.request

    from transformers import AutoTokenizer
    from tqdm import tqdm

    from ..models import resolve_model_path
    from .serving_engine import _text_ids, stop_server

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shortest, longest = (int(value) for value in args.prompt_lengths.split(","))
    if args.url:
        server, base = None, args.url.rstrip("/")
    else:
        server, base = _start_server(args, longest, out / "server.log"), f"http://127.0.0.1:{args.port}"
    pid = server.pid if server is not None else args.server_pid
    try:
        stats_url = f"{base}/trikv/stats"
        bounded = args.method != "full"
        served_model = _get_json(f"{base}/v1/models")["data"][0]["id"]
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
        source = _text_ids(tokenizer, 8192)
        rng = random.Random(args.seed)
        plan = []
        for index in range(args.requests):
            size = rng.randint(shortest, longest)
            start = rng.randrange(len(source) - size)
            abort_after = rng.randint(1, 8) if rng.random() < args.abort_share else None
            plan.append((source[start : start + size], rng.randint(1, args.max_new_tokens), abort_after))

        outcomes: list[dict | None] = [None] * len(plan)
        samples = []
        lock = threading.Lock()
        next_index = [0]
        finished = [0]
        progress = tqdm(total=len(plan), desc="soak", unit="req", disable=args.no_progress)
        started = time.perf_counter()

        def sample() -> None:
            stats = _get_json(stats_url) if bounded else None  # full attention (the control): plain vLLM, no trikv stats
            samples.append({"requests_done": finished[0], "seconds": time.perf_counter() - started,
                            "rss_bytes": server_rss_bytes(pid) if pid else None,
                            "compacted_requests": sum(rank["compacted_requests"] for rank in stats) if stats else None,
                            "compacted_running": max(len(rank["compacted_running"]) for rank in stats) if stats else None,
                            "rounds": stats[0]["rounds"] if stats else None})

        def one(index: int) -> dict:
            prompt, max_tokens, abort_after = plan[index]
            # usage in every chunk: vLLM merges the outputs of several steps into one chunk when the client reads
            # slower than the engine decodes (a busy machine), so chunks are not tokens
            body = {"model": served_model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            tokens = 0
            with urllib.request.urlopen(request, timeout=3600) as response:
                for line in response:
                    line = line.decode().strip()
                    if line.startswith("data: ") and line != "data: [DONE]":
                        usage = json.loads(line[len("data: "):]).get("usage")
                        tokens = usage["completion_tokens"] if usage else tokens
                        if abort_after is not None and tokens >= abort_after:
                            break  # closing the stream aborts the request in vLLM
            return {"prompt_tokens": len(prompt), "asked": max_tokens, "received": tokens, "aborted": abort_after is not None}

        def worker() -> None:
            while True:
                with lock:
                    index = next_index[0]
                    if index >= len(plan):
                        return
                    next_index[0] += 1
                try:
                    outcome = one(index)
                except OSError as error:
                    outcome = {"error": repr(error)}
                with lock:
                    outcomes[index] = outcome
                    finished[0] += 1
                    progress.update(1)
                    due = finished[0] % args.sample_every == 0
                if due:
                    sample()

        sample()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        progress.close()
        time.sleep(2)  # the last aborts reach the engine core
        # a final step lets the workers learn which requests ended: one short request, then the stats
        one_more = urllib.request.Request(f"{base}/v1/completions", headers={"Content-Type": "application/json"},
                                          data=json.dumps({"model": served_model, "prompt": [1, 2, 3], "max_tokens": 1}).encode())
        urllib.request.urlopen(one_more, timeout=300).read()
        sample()
        final = _get_json(stats_url) if bounded else []
        alive = server.poll() is None if server is not None else bool(_get_json(f"{base}/v1/models")["data"])
    finally:
        if server is not None:
            stop_server(server)
    errors = [o for o in outcomes if o is None or "error" in o]
    wrong = [o for o in outcomes if o and "error" not in o and not o["aborted"] and o["received"] != o["asked"]]
    rss = [s["rss_bytes"] for s in samples[1:] if s["rss_bytes"] is not None]  # after start-up
    half = len(rss) // 2
    result = {
        "settings": {key: value for key, value in vars(args).items() if key != "func"},
        "command": "trikv bench soak " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "soak"] else None,
        "seconds": time.perf_counter() - started,
        "requests": len(plan),
        "aborted": sum(1 for o in outcomes if o and o.get("aborted")),
        "errors": len(errors),
        "incomplete": len(wrong),
        "compacted_requests": sum(rank["compacted_requests"] for rank in final),
        "compacted_running_at_end": sorted({rid for rank in final for rid in rank["compacted_running"]}),
        "server_alive_at_end": alive,
        # flat: the mean RSS of the second half of the run against the first half's
        "rss_growth": (sum(rss[half:]) / max(1, len(rss) - half)) / (sum(rss[:half]) / half) - 1 if half else None,
        "samples": samples,
    }
    return result


def main(args) -> int:
    result = run_soak(args)
    out = Path(args.out)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "soak.png")
    rss = [s["rss_bytes"] / 2**20 for s in result["samples"][1:] if s["rss_bytes"] is not None]
    memory = (f"server RSS {rss[0]:.0f} -> {rss[-1]:.0f} MiB (second half vs first: {result['rss_growth']:+.1%})"
              if rss and result["rss_growth"] is not None else "server RSS not read")
    print(f"{result['requests']} requests ({result['aborted']} aborted by the client) in {result['seconds']:.0f} s; "
          f"{result['compacted_requests']} compacted; errors {result['errors']}, incomplete {result['incomplete']}; "
          f"compacted state left at the end: {len(result['compacted_running_at_end'])} requests; {memory}")
    ok = (not result["errors"] and not result["incomplete"] and not result["compacted_running_at_end"]
          and result["server_alive_at_end"])
    return 0 if ok else 1


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    figure, left = plt.subplots(figsize=(6.4, 3.6))
    measured = [s for s in samples if s["rss_bytes"] is not None]
    left.plot([s["requests_done"] for s in measured], [s["rss_bytes"] / 2**20 for s in measured], marker="o",
              color="tab:blue", label="server RSS (MiB)")
    left.set_xlabel("requests finished")
    left.set_ylabel("server RSS, all processes (MiB)")
    left.set_ylim(bottom=0)
    right = left.twinx()
    held = [(s["requests_done"], s["compacted_running"]) for s in samples if s["compacted_running"] is not None]
    right.plot([d for d, _ in held], [h for _, h in held], marker=".", color="tab:orange", label="requests with compacted state held")
    right.set_ylabel("compacted state held (requests)")
    right.set_ylim(bottom=0)
    settings = result["settings"]
    left.set_title(f"soak: {settings['model']}, {settings['method']} B={settings['budget']}, "
                   f"{settings['concurrency']} in flight, {settings['abort_share']:.0%} aborted", fontsize=9)
    left.grid(alpha=0.3)
    figure.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


register_bench("soak", add_arguments, "many requests through `trikv serve`: compactor state and server memory must stay flat")
