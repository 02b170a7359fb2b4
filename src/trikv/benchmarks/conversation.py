"""`trikv bench conversation`: a chat client's conversation against vLLM, turn by turn, with and without session
reuse, beside plain vLLM with prefix caching; and `trikv bench conversation-report`, its page.

The client is the `openai` package's chat API, as a user's would be: every turn appends a user message of real text
(about `--turn-tokens` tokens of the bundled prose, code and math texts) and re-sends the whole conversation; the
reply (greedy, `--reply-tokens` at most) is appended in turn. Each turn records its time to first token (streamed),
the prompt's tokens and those vLLM did not compute (`prompt_tokens_details.cached_tokens`).

Engines, one server at a time on the same pool: `reuse` (`trikv serve`: session reuse, trikv's default), `stateless`
(`trikv serve --no-session-reuse`: each turn prefills the whole conversation again, compacting between chunks) and
`full-prefix-caching` (plain vLLM, full attention, automatic prefix caching: each turn hits the blocks the last one
cached). `--concurrent N` runs N conversations at once instead (one thread each), on a pool of `--pool-requests`
bounded requests: kept states must then give way to running requests, and the run records the throughput, every
turn's time to first token and the engine's session figures (`GET /trikv/stats`).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

from . import register_bench

ENGINES = ("reuse", "stateless", "full-prefix-caching")
SYSTEM = "You are a helpful assistant. Answer briefly."


def user_messages(tokenizer, conversation: int, turns: int, turn_tokens: int) -> list[str]:
    """`turns` messages of about `turn_tokens` tokens of real text each, from an offset that depends on `conversation`
    (whole lines of the bundled prose, code and math texts, in turn)."""
    from ..analysis.texts import default_texts

    lines = [line for text in default_texts().values() for line in text.splitlines() if line.strip()]
    start = (conversation * 131) % len(lines)
    messages, current, size = [], [], 0
    index = start
    while len(messages) < turns:
        line = lines[index % len(lines)]
        index += 1
        current.append(line)
        size += len(tokenizer(line, add_special_tokens=False)["input_ids"]) + 1
        if size >= turn_tokens:
            messages.append("Read this:\n" + "\n".join(current))
            current, size = [], 0
    return messages


def chat(base_url: str, messages: list[str], reply_tokens: int, extra_body: dict | None = None) -> list[dict]:
    """One conversation through the `openai` client: per turn the time to first token, prompt and cached tokens, the
    reply's tokens and the turn's seconds."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)
    history = [{"role": "system", "content": SYSTEM}]
    records = []
    for message in messages:
        history.append({"role": "user", "content": message})
        started = time.perf_counter()
        ttft, pieces, usage = None, [], None
        stream = client.chat.completions.create(model="model", messages=history, max_tokens=reply_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}, extra_body=extra_body)
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - started
                pieces.append(chunk.choices[0].delta.content)
        seconds = time.perf_counter() - started
        history.append({"role": "assistant", "content": "".join(pieces)})
        details = getattr(usage, "prompt_tokens_details", None)
        records.append({"ttft": ttft if ttft is not None else seconds, "seconds": seconds,
                        "prompt_tokens": usage.prompt_tokens, "cached_tokens": getattr(details, "cached_tokens", None) or 0,
                        "reply_tokens": usage.completion_tokens})
    return records


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="bundled name or path")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated: {', '.join(ENGINES)}")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=400, help="tokens of each user message (about)")
    parser.add_argument("--reply-tokens", type=int, default=32, help="the most tokens of each reply (greedy)")
    parser.add_argument("--conversations", type=int, default=3, help="conversations per engine, each on other text")
    parser.add_argument("--concurrent", type=int, default=0,
                        help="run this many conversations at once (0: one after the other)")
    parser.add_argument("--pool-requests", type=int, default=0,
                        help="the KV pool in bounded requests at their bound (0: one full conversation fits)")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--port", type=int, default=8941)
    parser.add_argument("--out", default="runs/conversation", help="output folder (one JSON per engine)")
    parser.set_defaults(func=main)


def main(args) -> int:
    import sys

    from ..validation import integer
    from .agent.backends import Server
    from .agent.cli import code_version

    for name in ("turns", "turn_tokens", "reply_tokens", "conversations", "budget"):
        integer(f"--{name.replace('_', '-')}", getattr(args, name))
    engines = [engine.strip() for engine in args.engines.split(",") if engine.strip()]
    unknown = [engine for engine in engines if engine not in ENGINES]
    if unknown or not engines:
        sys.exit(f"trikv bench conversation: unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    if args.concurrent < 0 or args.pool_requests < 0:
        sys.exit("trikv bench conversation: --concurrent and --pool-requests must be >= 0")
    try:
        import openai  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as error:
        sys.exit(f"trikv bench conversation needs vLLM and the openai client ({error.name} is missing): "
                 "bash scripts/setup.sh --with-vllm")
    from transformers import AutoTokenizer

    from ..models import resolve_model_path
    from ..settings import DEFAULT_DIVIDE_LENGTH, DEFAULT_PREFILL_CHUNK_SIZE

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    from transformers import AutoConfig

    trained = AutoConfig.from_pretrained(path).max_position_embeddings
    conversations = [user_messages(tokenizer, index, args.turns, args.turn_tokens) for index in range(args.conversations)]
    block = 128  # vLLM's CPU build allocates KV in 128-token blocks
    bound = args.budget + int(DEFAULT_DIVIDE_LENGTH) + DEFAULT_PREFILL_CHUNK_SIZE
    longest = 64 + args.turns * (args.turn_tokens * 3 // 2 + args.reply_tokens)  # generous: a whole conversation
    usable = (args.pool_requests * -(-bound // block)) if args.pool_requests else max(-(-longest // block), -(-bound // block))
    version = code_version()
    for engine in engines:
        method = "full" if engine == "full-prefix-caching" else "triattention"
        settings = None if method == "full" else {"session_reuse": engine == "reuse"}
        extra = ["--enable-prefix-caching" if method == "full" else "--no-enable-prefix-caching"]
        print(f"[trikv bench conversation] {engine}: {len(conversations)} conversations of {args.turns} turns, pool "
              f"{usable} blocks of {block}" + (f", {args.concurrent} at once" if args.concurrent else ""), flush=True)
        with Server(args.model, method, args.budget, usable + 1, min(trained, usable * block if method == "full" else trained), args.port,
                    out / f"{engine}.log", stats=args.model if method != "full" else None, extra=extra, settings=settings,
                    max_num_seqs=max(4, args.concurrent)) as server:
            base = f"http://127.0.0.1:{server.port}/v1"
            # a warm-up turn (a server's first request pays its one-off costs), opted out of session reuse
            chat(base, ["Say hello."], 4, extra_body={"vllm_xargs": {"trikv_session": "off"}})
            started = time.perf_counter()
            if args.concurrent:
                runs = _at_once(base, conversations, args.concurrent, args.reply_tokens)
            else:
                runs = [chat(base, messages, args.reply_tokens) for messages in conversations]
            wall = time.perf_counter() - started
            stats = server.trikv_stats()[0] if method != "full" else None
        result = {"engine": engine, "model": args.model, "budget": args.budget, "turns": args.turns,
                  "turn_tokens": args.turn_tokens, "reply_tokens": args.reply_tokens, "concurrent": args.concurrent,
                  "pool_blocks": usable, "block": block, "bound": bound, "version": version, "command": _command(args),
                  "date": time.strftime("%Y-%m-%d"), "wall_seconds": wall, "conversations": runs,
                  "sessions": stats["sessions"] if stats else None}
        (out / f"{engine}.json").write_text(json.dumps(result, indent=2))
        medians = [statistics.median(run[turn]["ttft"] for run in runs) for turn in range(args.turns)]
        print(f"[trikv bench conversation] {engine}: median time to first token per turn "
              + ", ".join(f"{value:.2f}" for value in medians) + f" s; {wall:.0f} s in all", flush=True)
    print(f"[trikv bench conversation] render with: trikv bench conversation-report {out} --out docs/sessions.md")
    return 0


def _at_once(base: str, conversations: list[list[str]], concurrent: int, reply_tokens: int) -> list[list[dict]]:
    """`concurrent` conversations at once, one thread each, over the conversations in turn (repeated as needed)."""
    runs: list = [None] * concurrent
    errors: list = []

    def run(slot: int) -> None:
        try:
            runs[slot] = chat(base, conversations[slot % len(conversations)], reply_tokens)
        except Exception as error:  # noqa: BLE001 - reported below, with the slot
            errors.append(f"conversation {slot}: {error}")

    threads = [threading.Thread(target=run, args=(slot,)) for slot in range(concurrent)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return runs


def _command(args) -> str:
    from .report_pages import command_line

    parts = ["trikv", "bench", "conversation", "--model", args.model, "--engines", args.engines, "--turns", args.turns,
             "--turn-tokens", args.turn_tokens, "--reply-tokens", args.reply_tokens, "--conversations",
             args.conversations, "--budget", args.budget]
    if args.concurrent:
        parts += ["--concurrent", args.concurrent]
    if args.pool_requests:
        parts += ["--pool-requests", args.pool_requests]
    return command_line(*parts, "--out", args.out)


register_bench("conversation", add_arguments, help="a chat client's conversation on vLLM turn by turn: session reuse, "
               "stateless and plain vLLM with prefix caching (docs/sessions.md)")
