"""One agent session through one backend and method: the answers, and per message the KV held and the time to
first token.

- transformers: `trikv.Session` (the lean engine for the families it runs): every message is appended to the
  cache that holds the conversation. Full attention keeps everything.
- MLX: mlx-lm's chat pattern, one prompt cache for the whole conversation, each message's ids through
  `mlx_lm.stream_generate` (prefill_step_size = the cache's prefill chunk).
- vLLM: `trikv serve` (vLLM's OpenAI server with trikv's flags; plain `vllm serve` for full attention) driven by
  the `openai` client's chat API as an agent calls it: every message sends the whole conversation. With session
  reuse (trikv's default) the server continues the bounded cache the previous message left and prefills only the
  new tokens; stateless (`--no-session-reuse`, the "vllm-stateless" backend) it prefills the whole conversation
  again, compacting between chunks. Each message records the prompt's tokens and those vLLM did not compute.

The no-context control (`run_no_context`) asks every question alone, without the tool results, on full attention:
the share of questions the model answers from training.

Memory limit: on vLLM the KV pool itself (`num_gpu_blocks_override`): a conversation longer than full attention's
pool is refused with vLLM's own 400 error. On transformers and MLX the harness enforces a KV byte cap: after
every forward (transformers) or every message's prefill (MLX) the bytes the cache holds are compared with the cap,
and a message that takes them past it fails as an out-of-memory would, ending the session there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from .tasks import SYSTEM_MESSAGE, AgentSession


class KVCapExceeded(RuntimeError):
    """The cache would hold more K/V bytes than the cap (the memory limit the session runs under)."""


def _record(message, answer: str, reference: str | None, **figures) -> dict:
    return {"step": message.step, "distance": message.distance, "kind": message.question.kind,
            "subject": message.question.subject, "expected": list(message.question.expected),
            "answer": answer, "right": message.question.is_right(answer),
            "agrees": None if reference is None else normalise(answer) == normalise(reference), **figures}


def normalise(answer: str) -> str:
    """An answer compared with full attention's: its first line, without spaces, quotes, backticks or a final dot."""
    first = answer.strip().splitlines()[0] if answer.strip() else ""
    return "".join(ch for ch in first if ch not in " \t'\"`").rstrip(".").lower()


# ---- transformers -----------------------------------------------------------------------------------------------
def run_transformers(model, tokenizer, session: AgentSession, method: str, budget: int | None, cap_bytes: int | None,
                     stats=None, max_new_tokens: int = 32, references: list[str] | None = None, engine: str = "lean",
                     progress=None) -> dict:
    """The session on one trikv cache (full attention: a trikv cache that keeps everything, on the same engine)."""
    import trikv

    options = {"stats": stats} if stats is not None else {}
    if method != "full":
        options["budget"] = budget
    conversation = trikv.Session(model, tokenizer, method=method, system=SYSTEM_MESSAGE, engine=engine, **options)
    cache = conversation.cache
    if cap_bytes is not None:
        _cap_after_every_forward(cache, cap_bytes)
    records, error = [], None
    for index, message in enumerate(session.messages):
        try:
            result = conversation.send(message.text, max_new_tokens=max_new_tokens)
        except KVCapExceeded as exceeded:
            error = {"message": index, "step": message.step, "tokens": cache.get_seq_length(), "error": str(exceeded)}
            break
        turn = conversation.turns[-1]
        records.append(_record(message, turn.reply, None if references is None else references[index],
                               held_bytes=turn.held_bytes, peak_bytes=_turn_peak(cache, turn), tokens=turn.tokens_seen,
                               ttft=turn.seconds_to_first_token, rounds=turn.rounds))
        del result
        if progress is not None:
            progress()
    return {"records": records, "error": error}


def run_no_context(model, tokenizer, session: AgentSession, max_new_tokens: int = 32, engine: str = "lean",
                   progress=None) -> dict:
    """The no-context control: every question of the session asked alone (the system message and the question, no
    tool result before it, a fresh conversation each), full attention, greedy. What it gets right the model knows
    from training, not from the files it read."""
    import trikv

    from .tasks import no_context_messages

    records = []
    for message, question in zip(session.messages, no_context_messages(session)):
        conversation = trikv.Session(model, tokenizer, method="full", system=SYSTEM_MESSAGE, engine=engine)
        conversation.send(question, max_new_tokens=max_new_tokens)
        turn = conversation.turns[-1]
        records.append(_record(message, turn.reply, None, held_bytes=turn.held_bytes, peak_bytes=turn.held_bytes,
                               tokens=None, ttft=None, rounds=0))
        if progress is not None:
            progress()
    return {"records": records, "error": None}


def _turn_peak(cache, turn) -> int:
    """The most K/V bytes held during the message (the cache's peak since the last reading)."""
    peak = getattr(cache, "_agent_peak", turn.peak_bytes)
    cache._agent_peak = 0
    return max(peak, turn.held_bytes)


def _cap_after_every_forward(cache, cap_bytes: int) -> None:
    """Raise `KVCapExceeded` as soon as a forward leaves the cache holding more than `cap_bytes`; note the peak."""
    update = cache.update
    last = max(cache.store_index)
    cache._agent_peak = 0

    def capped_update(key_states, value_states, layer_idx, *args, **kwargs):
        out = update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == last:
            held = cache.memory_bytes()
            cache._agent_peak = max(cache._agent_peak, held)
            if held > cap_bytes:
                raise KVCapExceeded(f"the KV cache would hold {held / 2**20:.2f} MiB after this forward "
                                    f"({cache.get_seq_length()} tokens), over the {cap_bytes / 2**20:.2f} MiB limit")
        return out

    cache.update = capped_update


# ---- MLX --------------------------------------------------------------------------------------------------------
def run_mlx(model, tokenizer, session: AgentSession, method: str, budget: int | None, cap_bytes: int | None,
            stats=None, max_new_tokens: int = 32, references: list[str] | None = None, progress=None) -> dict:
    """The session through mlx-lm with one prompt cache (`trikv.mlx.Session`: trikv's bounded MLX cache, or mlx-lm's
    own for "full"); the KV cap is checked once each message is prefilled."""
    import trikv.mlx
    from trikv.mlx.generation import held_bytes

    options = {"stats": stats} if stats is not None else {}
    if method != "full":
        options["budget"] = budget
    conversation = trikv.mlx.Session(model, tokenizer, method, system=SYSTEM_MESSAGE, **options)

    def check_cap(tokens: int) -> None:
        held, _ = held_bytes(conversation.cache)
        bounded = conversation.bounded
        peak = held if bounded is None else bounded.peak_length * held // max(bounded.length, 1)
        if cap_bytes is not None and peak > cap_bytes:
            raise KVCapExceeded(f"the KV cache would hold {peak / 2**20:.2f} MiB after this message's prefill "
                                f"({tokens} tokens), over the {cap_bytes / 2**20:.2f} MiB limit")

    records, error = [], None
    for index, message in enumerate(session.messages):
        try:
            turn = conversation.send(message.text, max_new_tokens=max_new_tokens, after_prefill=check_cap)
        except KVCapExceeded as exceeded:
            error = {"message": index, "step": message.step, "tokens": conversation.tokens_seen, "error": str(exceeded)}
            break
        records.append(_record(message, turn.reply, None if references is None else references[index],
                               held_bytes=turn.held_bytes, peak_bytes=turn.peak_bytes, tokens=turn.tokens_seen,
                               ttft=turn.seconds_to_first_token, rounds=turn.rounds))
        if progress is not None:
            progress()
    return {"records": records, "error": error}


# ---- vLLM ---------------------------------------------------------------------------------------------------------
class Server:
    """`trikv serve` (or plain vLLM for full attention) in its own process group, on a fixed KV pool."""

    def __init__(self, model: str, method: str, budget: int | None, pool_blocks: int, max_model_len: int, port: int,
                 log_path: Path, stats: str | None = None, dtype: str = "float32", extra: list[str] | None = None,
                 settings: dict | None = None, max_num_seqs: int = 4):
        from trikv.models import resolve_model_path

        self.port, self.log_path = port, log_path
        args = [sys.executable, "-m", "trikv.vllm.launch", "serve", resolve_model_path(model), "--port", str(port),
                "--served-model-name", "model", "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
                "--num-gpu-blocks-override", str(pool_blocks), "--max-num-seqs", str(max_num_seqs),
                "--enable-prompt-tokens-details", *(extra or [])]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        if method != "full":
            import trikv.vllm
            from trikv.vllm.endpoint import plugins_setting

            args += trikv.vllm.serve_flags(method=method, budget=budget, stats=stats, model=model, **(settings or {}))
            env["VLLM_PLUGINS"] = plugins_setting()
        self.command = args
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def __enter__(self):
        from ..serving_engine import wait_ready

        try:
            wait_ready(self.process, self.port, self.log_path, timeout=900)
        except RuntimeError:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        from ..serving_engine import stop_server

        if self.process.poll() is None:
            stop_server(self.process)

    def trikv_stats(self) -> list[dict]:
        """`GET /trikv/stats`: one dict per rank (rounds, kept states, and the engine's "sessions" figures)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/trikv/stats", timeout=30) as response:
            return json.loads(response.read())

    def kv_usage(self) -> float:
        """vLLM's own gauge of the KV pool in use (0-1), from its Prometheus metrics."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("vllm:kv_cache_usage_perc"):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0


def run_vllm(server: Server, session: AgentSession, pool_bytes: int, max_new_tokens: int = 32,
             references: list[str] | None = None, progress=None) -> dict:
    """The session through the server's chat API (the whole conversation every message, streamed for the time to first
    token), with the KV pool's use sampled every 50 ms while each message runs."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=3600)
    messages = [{"role": "system", "content": SYSTEM_MESSAGE}]
    records, error = [], None
    for index, message in enumerate(session.messages):
        messages.append({"role": "user", "content": message.text})
        peak = [0.0]
        done = threading.Event()

        def sample():
            while not done.is_set():
                try:
                    peak[0] = max(peak[0], server.kv_usage())
                except OSError:
                    pass
                done.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.perf_counter()
        ttft, pieces, usage = None, [], None
        try:
            stream = client.chat.completions.create(model="model", messages=messages, max_tokens=max_new_tokens,
                                                    temperature=0, stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    pieces.append(chunk.choices[0].delta.content)
        except openai.BadRequestError as refused:
            error = {"message": index, "step": message.step, "error": _short(str(refused))}
        finally:
            done.set()
            sampler.join()
        if error is not None:
            break
        reply = "".join(pieces)
        messages.append({"role": "assistant", "content": reply})
        held = server.kv_usage()
        records.append(_record(message, reply, None if references is None else references[index],
                               held_bytes=int(held * pool_bytes), peak_bytes=int(max(peak[0], held) * pool_bytes),
                               tokens=None if usage is None else usage.prompt_tokens + usage.completion_tokens,
                               ttft=ttft if ttft is not None else time.perf_counter() - started, rounds=None,
                               **_prompt_usage(usage)))
        if progress is not None:
            progress()
    return {"records": records, "error": error}


def _prompt_usage(usage) -> dict:
    """The prompt's tokens and those vLLM did not compute (a prefix-cache hit or a continued kept state: vLLM's
    `prompt_tokens_details.cached_tokens`, with `--enable-prompt-tokens-details`)."""
    if usage is None:
        return {"prompt_tokens": None, "cached_tokens": None}
    details = getattr(usage, "prompt_tokens_details", None)
    return {"prompt_tokens": usage.prompt_tokens, "cached_tokens": getattr(details, "cached_tokens", None) or 0}


def _short(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
