"""`trikv bench agent`: the consumer-GPU agent case at this machine's scale, and `trikv bench agent-report`.

A scripted coding-agent session (tool results: chunks of real source files, each with a checkable question about
it and one about a chunk read earlier) grows its context past a memory limit. Full attention fails at some
message (its error is recorded); each bounded method completes. Every (backend, method, session) is a cell saved
on its own with a fingerprint of what produced it (the session's text, the model, the settings, trikv's version
and commit): a later invocation reuses a cell only when its fingerprint matches and says what it reused. The
backends run where they are installed: transformers and vLLM in one environment, MLX in another, all writing
into the same folder; `agent-report` reads them all.

The reference answers are uncapped full attention's on the transformers path (greedy decoding, the same
weights): each backend's answers are compared with the true answers and with those.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from .. import register_bench

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
# the control (random eviction) and a recent-window TriAttention beside the flagship on every backend
DEFAULT_METHODS = {"transformers": ("triattention", "triattention-recent", "rkv", "snapkv", "h2o", "streaming", "random"),
                   "mlx": ("triattention", "triattention-recent", "streaming", "random"),
                   "vllm": ("triattention", "triattention-recent", "streaming", "random"),
                   "vllm-stateless": ("triattention", "streaming")}
# vLLM with session reuse (trikv's default: each message continues the cache the previous one left) and without it
# (every message prefills the whole conversation again); full attention is plain vLLM, run once, under "vllm"
VLLM_BACKENDS = {"vllm": True, "vllm-stateless": False}
REFERENCE = "full-unlimited"
NO_CONTEXT = "no-context"  # every question alone, without the tool results (what the model knows from training)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="bundled name or path (a model with >= 16K trained positions)")
    parser.add_argument("--backends", default="transformers",
                        help="comma-separated: transformers, mlx, vllm (session reuse on), vllm-stateless (off)")
    parser.add_argument("--methods", help="comma-separated bounded methods (default: per backend, "
                        + "; ".join(f"{b}: {','.join(m)}" for b, m in DEFAULT_METHODS.items()) + ")")
    parser.add_argument("--sessions", type=int, default=6, help="sessions (seeds 0 .. n-1)")
    parser.add_argument("--steps", type=int, default=10, help="tool results per session (two questions each after the first)")
    parser.add_argument("--chunk-tokens", type=int, default=400, help="tokens per tool result (whole lines)")
    parser.add_argument("--budget", type=int, default=1024, help="KV entries per (layer, KV head) after a round")
    parser.add_argument("--limit-tokens", type=int, default=2048,
                        help="the memory limit, in tokens of full attention's KV: a KV byte cap on transformers and "
                             "MLX, the KV pool on vLLM (rounded to its blocks)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer (greedy)")
    parser.add_argument("--port", type=int, default=8931, help="vLLM server port")
    parser.add_argument("--out", default="runs/agent", help="output folder (cells, agent.json)")
    parser.add_argument("--reuse-other-code", action="store_true",
                        help="reuse finished cells made from the same sessions and settings by another commit of trikv "
                             "(each cell keeps its own commit, which the page lists)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=main)


def _fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def code_version() -> dict:
    """trikv's version and the git commit of its source (with a mark when the tree has uncommitted changes)."""
    import trikv

    root = Path(__file__).resolve().parents[4]
    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=root, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        if commit and dirty:
            commit += "+changes"
    except OSError:
        pass
    return {"trikv": trikv.__version__, "commit": commit}


class Cells:
    """The folder of cells: out/cells/<backend>-<method>-<seed>.json, each {fingerprint, settings, result}."""

    def __init__(self, out: Path, reuse_other_code: bool = False):
        self.folder = out / "cells"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.reused: list[str] = []
        # with reuse_other_code, a cell made from the same session and settings by another commit is reused too
        # (named in `reused_other_code` with its commit); its own settings keep saying which code made it
        self.reuse_other_code = reuse_other_code
        self.reused_other_code: dict[str, str | None] = {}

    def path(self, backend: str, method: str, seed: int) -> Path:
        return self.folder / f"{backend}-{method}-{seed}.json"

    def get(self, backend: str, method: str, seed: int, parts: dict) -> dict | None:
        """The finished cell made from `parts` (session, settings and code version, as `_fingerprint` hashes
        them), or None."""
        path = self.path(backend, method, seed)
        if not path.exists():
            return None
        cell = json.loads(path.read_text())
        if cell.get("fingerprint") != _fingerprint(parts):
            version = cell.get("settings", {}).get("version")
            if not (self.reuse_other_code and version is not None
                    and cell.get("fingerprint") == _fingerprint({**parts, "version": version})):
                return None
            self.reused_other_code[path.name] = version.get("commit")
        self.reused.append(path.name)
        return cell["result"]

    def put(self, backend: str, method: str, seed: int, fingerprint: str, settings: dict, result: dict) -> None:
        self.path(backend, method, seed).write_text(json.dumps({"fingerprint": fingerprint, "settings": settings,
                                                                "result": result}, indent=2))


def main(args) -> int:
    from ...validation import integer

    for name in ("sessions", "steps", "chunk_tokens", "budget", "limit_tokens", "max_new_tokens"):
        integer(f"--{name.replace('_', '-')}", getattr(args, name))
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in DEFAULT_METHODS]
    if unknown or not backends:
        sys.exit(f"trikv bench agent: unknown backend(s) {unknown}; choose from {', '.join(DEFAULT_METHODS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from ...models import load_model
    from .tasks import make_session

    model, tokenizer = load_model(args.model)
    trained = getattr(model.config, "max_position_embeddings", 0)
    if trained < 16384:
        sys.exit(f"trikv bench agent: {args.model} has {trained} trained positions; the agent case needs >= 16,384")
    sessions = [make_session(seed, tokenizer, steps=args.steps, chunk_tokens=args.chunk_tokens) for seed in range(args.sessions)]
    cells = Cells(out, reuse_other_code=args.reuse_other_code)
    version = code_version()
    common = {"model": args.model, "budget": args.budget, "limit_tokens": args.limit_tokens,
              "max_new_tokens": args.max_new_tokens, "version": version}
    (out / "sessions.json").write_text(json.dumps([s.to_json() for s in sessions], indent=2))
    per_token = _kv_bytes_per_token(model)
    cap_bytes = args.limit_tokens * per_token
    print(f"[trikv bench agent] {args.model}: {len(sessions)} sessions of {args.steps} tool results "
          f"({sum(len(s.messages) for s in sessions)} questions); memory limit {args.limit_tokens} tokens of KV "
          f"({cap_bytes / 2**20:.1f} MiB); budget {args.budget}", flush=True)
    references = _references(model, tokenizer, sessions, cells, common, args)
    _no_context(model, tokenizer, sessions, cells, common, args)
    for backend in backends:
        methods = ["full", *(args.methods.split(",") if args.methods else DEFAULT_METHODS[backend])]
        if backend == "transformers":
            _run_transformers(model, tokenizer, sessions, methods, references, cells, common, cap_bytes, args)
        elif backend == "mlx":
            _run_mlx(sessions, methods, references, cells, common, cap_bytes, args)
        else:
            _run_vllm(backend, sessions, methods[1:] if backend == "vllm-stateless" else methods, references, cells,
                      common, per_token, args)
    if cells.reused:
        print(f"[trikv bench agent] reused {len(cells.reused)} finished cells whose fingerprints match: "
              f"{', '.join(sorted(cells.reused))}", flush=True)
    if cells.reused_other_code:
        by_commit: dict = {}
        for name, commit in sorted(cells.reused_other_code.items()):
            by_commit.setdefault(commit, []).append(name)
        print("[trikv bench agent] --reuse-other-code: " + "; ".join(
            f"{len(names)} cells made by commit {commit} (same sessions and settings)" for commit, names in by_commit.items()),
            flush=True)
    summary = {"config": {**common, "sessions": args.sessions, "steps": args.steps, "chunk_tokens": args.chunk_tokens,
                          "kv_bytes_per_token": per_token, "cap_bytes": cap_bytes}}
    (out / "agent.json").write_text(json.dumps(summary, indent=2))
    print(f"[trikv bench agent] cells in {cells.folder}; render with: trikv bench agent-report {out}", flush=True)
    return 0


def _kv_bytes_per_token(model) -> int:
    from ...session import full_attention_bytes

    return full_attention_bytes(model, 1)


def _bar(total: int, label: str, args):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, unit="msg", disable=args.no_progress)


def _cell(backend: str, method: str, session, settings: dict, cells: Cells, compute) -> dict:
    parts = {"backend": backend, "method": method, "session": session.to_json(), **settings}
    fingerprint = _fingerprint(parts)
    cached = cells.get(backend, method, session.seed, parts)
    if cached is not None:
        return cached
    started = time.perf_counter()
    result = compute()
    result["seconds"] = time.perf_counter() - started
    cells.put(backend, method, session.seed, fingerprint, settings, result)
    return result


def _references(model, tokenizer, sessions, cells: Cells, common: dict, args) -> dict[int, list[str]]:
    """Uncapped full attention's answers on the transformers path, per session."""
    from .backends import run_transformers

    answers = {}
    for session in sessions:
        with _bar(len(session.messages), f"reference (full, no limit) s{session.seed}", args) as bar:
            result = _cell("transformers", REFERENCE, session, common, cells,
                           lambda: run_transformers(model, tokenizer, session, "full", None, None,
                                                    max_new_tokens=args.max_new_tokens, progress=bar.update))
        answers[session.seed] = [record["answer"] for record in result["records"]]
    return answers


def _no_context(model, tokenizer, sessions, cells: Cells, common: dict, args) -> None:
    """The no-context control's cells (transformers, full attention, each question alone)."""
    from .backends import run_no_context

    for session in sessions:
        with _bar(len(session.messages), f"no context s{session.seed}", args) as bar:
            _cell("transformers", NO_CONTEXT, session, common, cells,
                  lambda: run_no_context(model, tokenizer, session, max_new_tokens=args.max_new_tokens,
                                         progress=bar.update))


def _run_transformers(model, tokenizer, sessions, methods, references, cells, common, cap_bytes, args) -> None:
    from ...calibration import load_stats
    from ...policies import REGISTRY
    from .backends import run_transformers

    stats = None
    for method in methods:
        needs = REGISTRY[method].needs_stats
        if needs and stats is None:
            stats = load_stats(args.model, model)
        for session in sessions:
            with _bar(len(session.messages), f"transformers {method} s{session.seed}", args) as bar:
                _cell("transformers", method, session, common, cells,
                      lambda: run_transformers(model, tokenizer, session, method, args.budget, cap_bytes,
                                               stats=stats if needs else None, max_new_tokens=args.max_new_tokens,
                                               references=references[session.seed], progress=bar.update))


def _run_mlx(sessions, methods, references, cells, common, cap_bytes, args) -> None:
    try:
        import trikv.mlx
    except ImportError as error:
        sys.exit(f"trikv bench agent: --backends mlx needs MLX and mlx-lm ({error.name} is missing): pip install 'trikv[mlx]'")
    from .backends import run_mlx

    from trikv.mlx.blas import blas_library, is_reference_blas

    # float32 as on the transformers and vLLM paths: one dtype for every backend the page compares
    model, tokenizer = trikv.mlx.load(args.model, dtype="float32")
    blas = blas_library()
    if is_reference_blas(blas):
        print(f"[trikv bench agent] MLX's matrix products run on the reference BLAS its wheel bundles ({blas}), "
              "about 25x slower than an optimised one: pip install mkl and start with "
              "LD_PRELOAD=<venv>/lib/libmkl_rt.so.3 (the times depend on it; answers only through rounding)", flush=True)
    settings = {**common, "dtype": "float32", "blas": blas}
    for method in methods:
        stats = args.model if method != "full" and trikv.METHODS[method].needs_stats else None
        for session in sessions:
            with _bar(len(session.messages), f"mlx {method} s{session.seed}", args) as bar:
                _cell("mlx", method, session, settings, cells,
                      lambda: run_mlx(model, tokenizer, session, method, args.budget, cap_bytes, stats=stats,
                                      max_new_tokens=args.max_new_tokens, references=references[session.seed],
                                      progress=bar.update))


def _run_vllm(backend, sessions, methods, references, cells, common, per_token, args) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        sys.exit("trikv bench agent: --backends vllm needs vLLM: bash scripts/setup.sh --with-vllm")
    import trikv
    from .backends import Server, run_vllm

    block = 128  # vLLM's CPU build allocates KV in 128-token blocks
    usable = -(-args.limit_tokens // block)
    pool_blocks = usable + 1  # vLLM keeps one null block
    pool_bytes = usable * block * per_token
    out = Path(args.out)
    reuse = VLLM_BACKENDS[backend]
    for method in methods:
        settings = {**common, "pool_blocks": pool_blocks, "block": block}
        if method != "full":
            settings["session_reuse"] = reuse
        todo = [s for s in sessions if cells.get(backend, method, s.seed, ({"backend": backend, "method": method,
                                                                            "session": s.to_json(), **settings})) is None]
        if not todo:
            continue
        # full attention: vLLM sizes max_model_len to its pool (it refuses a longer one); bounded: the trained length
        max_model_len = usable * block if method == "full" else 32768
        stats = args.model if method != "full" and trikv.METHODS[method].needs_stats else None
        with Server(args.model, method, args.budget, pool_blocks, max_model_len, args.port, out / f"{backend}-{method}.log",
                    stats=stats, extra=["--no-enable-prefix-caching"],
                    settings=None if method == "full" else {"session_reuse": reuse}) as server:
            for session in todo:
                with _bar(len(session.messages), f"{backend} {method} s{session.seed}", args) as bar:
                    _cell(backend, method, session, settings, cells,
                          lambda: run_vllm(server, session, pool_bytes, max_new_tokens=args.max_new_tokens,
                                           references=references[session.seed], progress=bar.update))


def add_report_arguments(parser) -> None:
    parser.add_argument("folders", nargs="+", help="--out folders of `trikv bench agent` (one section each)")
    parser.add_argument("--out", default="docs/agent.md", help="the page to write (a folder of plots beside it)")
    parser.set_defaults(func=report_main)


def report_main(args) -> int:
    from .report import write_report

    path = write_report([Path(folder) for folder in args.folders], Path(args.out))
    print(f"[trikv bench agent-report] wrote {path}")
    return 0


register_bench("agent", add_arguments, help="an agent session past a memory limit: full attention vs bounded methods "
               "on transformers, MLX and vLLM (docs/agent.md)")
register_bench("agent-report", add_report_arguments, help="render docs/agent.md from `trikv bench agent` runs")
