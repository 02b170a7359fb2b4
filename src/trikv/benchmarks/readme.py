"""`trikv bench readme`: the README's figures, rendered from the run files kept in docs/runs/ (never typed by hand).

The README holds marked blocks, `<!-- trikv:NAME -->` ... `<!-- /trikv:NAME -->`; this module renders each one from
run files and writes them in place (`--check` only compares, for the test that keeps the README true):

- `saves`: what a bounded cache saves, measured on this machine: KV memory and decode speed at long contexts
  (`trikv bench speed` runs), a chat's last turn on vLLM (`trikv bench conversation` runs), the agent session under a
  memory limit (`trikv bench agent` cells);
- `plot`: the picture beside it, K/V bytes against tokens for full attention and TriAttention
  (docs/readme_files/kv_memory.png, from the memory run and the speed rows);
- `choose`: which method and budget to start with, from the method registry and the results page's runs.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path

from . import register_bench

ROOT = Path(__file__).resolve().parents[3]
RUNS = ROOT / "docs" / "runs"
BLOCK = re.compile(r"(<!-- trikv:(\w+) -->\n)(.*?)(<!-- /trikv:\2 -->)", re.S)


def _speed_rows(name: str) -> tuple[dict, list[dict]]:
    record = json.loads((RUNS / "speed" / name / "speed.json").read_text())
    return record, record["results"]


def _row(rows: list[dict], method: str, batch: int, context: int, budget: int | None = None) -> dict:
    found = [r for r in rows if r["method"] == method and r["batch"] == batch and r["context"] == context
             and (budget is None or r["budget"] == budget) and r["engine"] == "lean"]
    if not found:
        raise ValueError(f"no {method} row at batch {batch}, context {context} in the speed runs")
    return found[0]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f} MiB" if nbytes >= 10 * 2**20 else f"{nbytes / 2**20:,.1f} MiB"


def _context_note(record: dict) -> str:
    """How a speed run made its contexts, as a row says it: decoding only, over a prefill's KV tiled to the context."""
    tiled = re.search(r"prefill of (\d+) tokens tiled", record.get("fill", ""))
    return f" (decoding; the context's KV: a {int(tiled.group(1)):,}-token prefill tiled)" if tiled else " (decoding)"


def saves_block() -> str:
    """The table of what trikv saves, from the speed runs and the agent cells."""
    lines = ["| measured on this machine (2 CPU cores, fp32) | full attention | TriAttention | from |",
             "|---|---|---|---|"]
    record, rows = _speed_rows("b8_floor")
    model = record["model"]["name"]
    context = max(r["context"] for r in rows if r["method"] == "full")
    full = _row(rows, "full", 8, context)
    budget = min(r["budget"] for r in rows if r["method"] == "triattention" and r["context"] == context)
    tri = _row(rows, "triattention", 8, context, budget)
    made = _context_note(record)
    lines.append(f"| KV cache, {model}, 8 sequences at {context:,} tokens{made} | {_mib(full['kv_bytes_peak'])} | "
                 f"{_mib(tri['kv_bytes_peak'])} (B={budget}) | [speed.md](docs/speed.md) |")
    lines.append(f"| decode speed there | {full['tokens_per_second']:.1f} tokens/s | {tri['tokens_per_second']:.1f} "
                 f"tokens/s (x{tri['tokens_per_second'] / full['tokens_per_second']:.1f}) | [speed.md](docs/speed.md) |")
    record, rows = _speed_rows("main")
    context = max(r["context"] for r in rows if r["method"] == "full" and r["batch"] == 1)
    full = _row(rows, "full", 1, context)
    budget = min(r["budget"] for r in rows if r["method"] == "triattention" and r["context"] == context and r["batch"] == 1)
    tri = _row(rows, "triattention", 1, context, budget)
    lines.append(f"| one sequence at {context:,} tokens{_context_note(record)}: KV, decode speed | {_mib(full['kv_bytes_peak'])}, "
                 f"{full['tokens_per_second']:.1f} tokens/s | {_mib(tri['kv_bytes_peak'])}, {tri['tokens_per_second']:.1f} "
                 f"tokens/s (x{tri['tokens_per_second'] / full['tokens_per_second']:.2f}, B={budget}) | "
                 "[speed.md](docs/speed.md) |")
    lines += _conversation_rows()
    lines += _agent_rows()
    return "\n".join(lines) + "\n"


def _conversation_rows() -> list[str]:
    """A chat's last turn on vLLM: time to first token with session reuse, stateless, and full attention with prefix
    caching (`trikv bench conversation` runs)."""
    from .conversation_report import load_runs, turn_ttfts

    folder = RUNS / "conversation" / "main"
    if not folder.is_dir():
        return []
    runs = load_runs(folder)
    if not {"reuse", "stateless", "full-prefix-caching"} <= set(runs):
        return []
    last = {engine: statistics.median(turn_ttfts(run)[-1]) for engine, run in runs.items()}
    first = runs["reuse"]
    return [f"| a chat on vLLM ({first['model']}), time to first token at turn {first['turns']} of ~{first['turn_tokens']} "
            f"tokens each | {last['full-prefix-caching']:.2f} s (with prefix caching) | {last['reuse']:.2f} s with session "
            f"reuse (stateless: {last['stateless']:.2f} s; B={first['budget']}) | [sessions.md](docs/sessions.md) |"]


def _agent_rows() -> list[str]:
    """Per backend: full attention's outcome under the limit, TriAttention's and the best bounded method's accuracy
    with their paired difference. Cells made by a tree with uncommitted changes feed no row (the page labels them)."""
    from .agent.report import REFERENCE, bounded_methods, load_cells, paired_difference, reuse_comparison, summarise

    def dirty(cell: dict) -> bool:  # made by a tree with uncommitted changes
        return str(cell["settings"]["version"].get("commit") or "").endswith("+changes")

    folder = RUNS / "agent"
    config = json.loads((folder / "agent.json").read_text())["config"]
    runs = load_cells(folder)
    out = []
    for backend in ("transformers", "vllm", "mlx"):
        methods = runs.get(backend, {})
        if "full" not in methods or "triattention" not in methods:
            continue
        summaries = {method: summarise(cells) for method, cells in methods.items()}
        best = max(bounded_methods(summaries), key=lambda m: (summaries[m]["completed"], summaries[m]["accuracy"][0]))
        used = [methods["full"], methods["triattention"], methods[best], runs.get("transformers", {}).get(REFERENCE, {})]
        if any(dirty(cell) for cells in used for cell in cells.values()):
            continue
        full, tri = summaries["full"], summaries["triattention"]
        failure = min(full["failures"], key=lambda f: f["message"]) if full["failures"] else None
        fails = (f"fails at message {failure['message'] + 1} of {2 * config['steps'] - 1}" if failure
                 else f"completes {full['completed']}/{full['sessions']}")
        right = f"TriAttention {100 * tri['accuracy'][0]:.0f}% answers right"
        others = [m for m in bounded_methods(summaries) if m != "triattention"]
        if best == "triattention" and others:  # then the runner-up, so that a tie shows as one
            other = max(others, key=lambda m: (summaries[m]["completed"], summaries[m]["accuracy"][0]))
            point, interval, _ = paired_difference(methods["triattention"], methods[other])
            right += (f", the best bounded method here (next: {other} {100 * summaries[other]['accuracy'][0]:.0f}%; "
                      f"TriAttention − {other}: {100 * point:+.1f} [{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}] "
                      "points, paired over questions)")
        elif best != "triattention":
            point, interval, _ = paired_difference(methods["triattention"], methods[best])
            right += (f"; best bounded: {best} {100 * summaries[best]['accuracy'][0]:.0f}% (TriAttention − {best}: "
                      f"{100 * point:+.1f} [{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}] points, paired over questions)")
        if REFERENCE in runs.get("transformers", {}):
            right += f"; full attention without a limit: {100 * summarise(runs['transformers'][REFERENCE])['accuracy'][0]:.0f}%"
        reuse = reuse_comparison(runs) if backend == "vllm" else []
        compared = [runs.get("transformers", {}).get("triattention", {}), runs.get("vllm-stateless", {}).get("triattention", {})]
        if any(dirty(cell) for cells in compared for cell in cells.values()):
            reuse = []
        if reuse:  # what session reuse buys on vLLM: the last message's time to first token, median over sessions
            median = lambda key: statistics.median(r[key] for r in reuse)  # noqa: E731
            stateless = [r["stateless_last"] for r in reuse if not math.isnan(r["stateless_last"])]
            stateless_right = (summarise(runs["vllm-stateless"]["triattention"])["accuracy"][0] if stateless else math.nan)
            right += (f"; last message's time to first token {median('reuse_last'):.2f} s with session reuse"
                      + (f" (stateless: {statistics.median(stateless):.2f} s, {100 * stateless_right:.0f}% answers right)"
                         if stateless else "")
                      + f", {median('transformers_last'):.2f} s on the transformers path")
        out.append(f"| coding-agent session ({config['model']}, {backend}) past a {config['limit_tokens']:,}-token KV limit "
                   f"| {fails} | completes {tri['completed']}/{tri['sessions']} sessions; {right} | [agent.md](docs/agent.md) |")
    return out


def plot_block(write: bool = True) -> str:
    """The KV-against-tokens picture (written to docs/readme_files/ unless `write` is False) and its Markdown line."""
    path = ROOT / "docs" / "readme_files" / "kv_memory.png"
    line = f"![K/V bytes against tokens]({path.relative_to(ROOT)})\n"
    if not write:
        return line
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = json.loads((RUNS / "speed" / "memory" / "memory.json").read_text())
    record, rows = _speed_rows("main")
    per_token = record["model"]["kv_bytes_per_token"]
    samples = memory["samples"]
    tokens = [s["tokens"] for s in samples]
    fig, axis = plt.subplots(figsize=(7.5, 3.2))
    axis.plot(tokens, [t * per_token / 2**20 for t in tokens], color="black", lw=1.5,
              label=f"full attention ({per_token:,} bytes per token)")
    measured = sorted((r["entries_peak"], r["kv_bytes_peak"]) for r in rows if r["method"] == "full" and r["batch"] == 1)
    axis.plot([e for e, _ in measured], [b / 2**20 for _, b in measured], "o", color="black", ms=4,
              label="full attention, measured")
    axis.plot(tokens, [s["kv_bytes"] / 2**20 for s in samples], color="tab:blue", lw=1.5,
              label=f"TriAttention, B={memory['budget']} (measured over one generation)")
    axis.set_xlabel("tokens generated")
    axis.set_ylabel("K/V held (MiB)")
    axis.set_title(f"{record['model']['name']}: the KV cache of one {max(tokens):,}-token generation")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return line


def choose_block() -> str:
    """Which method and budget to start with: from the registry (what each needs, where it runs) and the results
    page's runs (TriAttention against the published baselines on the headline metric)."""
    from ..settings import DEFAULT_DIVIDE_LENGTH, DEFAULT_PREFILL_CHUNK_SIZE
    from .quality.pages.summary import summary_lines
    from .quality.provenance import run_provenance
    from .quality.report import load_run

    from ..policies import REGISTRY, key_only_methods

    # the methods that run on every backend and need no statistics (TriAttention's ablations aside)
    everywhere = [m for m in key_only_methods() if not REGISTRY[m].needs_stats and not m.startswith("triattention")]
    named = [(folder.name, load_run(folder)) for folder in sorted(RUNS.iterdir())
             if (folder / "results.json").is_file() and json.loads((folder / "results.json").read_text()).get("benchmark") == "quality"]
    # the page's own provenance: a run whose inputs are no longer the shipped ones is tagged as the page tags it
    headline = summary_lines(named, {name: run_provenance(record) for name, record in named})[0] if named else None
    budgets = sorted({budget for _, record in named for budget in record.get("config", {}).get("budgets", ())})
    slack, chunk = int(DEFAULT_DIVIDE_LENGTH), DEFAULT_PREFILL_CHUNK_SIZE
    measured = (f"; the results page measures B = {' and '.join(f'{b:,}' for b in budgets)}" if budgets else "")
    lines = [
        f"- **Method**: `triattention` needs calibrated statistics (shipped for every bundled model; `trikv calibrate` "
        f"for yours) and runs on transformers, vLLM and MLX; the other methods that run everywhere need none: "
        f"{', '.join(f'`{m}`' for m in everywhere)}. The attention-based baselines (`snapkv`, `rkv`, `h2o`, ...) run "
        "on transformers only.",
        f"- **Budget**: a request holds at most B + {slack} + {chunk} entries per (layer, KV head) (budget, slack, one "
        f"prefill chunk): pick the largest B whose bound fits your memory{measured}.",
    ]
    if headline:
        lines.append(f"- **What the results say** ([results.md](docs/results.md)): {headline}")
    return "\n".join(lines) + "\n"


RENDERERS = {"saves": saves_block, "plot": plot_block, "choose": choose_block}


def render_readme(text: str, write_files: bool = True) -> str:
    """The README with every marked block rendered again (`write_files`: the plot's PNG too)."""
    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in RENDERERS:
            raise ValueError(f"unknown README block {name!r}; known: {', '.join(RENDERERS)}")
        block = RENDERERS[name](write_files) if name == "plot" else RENDERERS[name]()
        return match.group(1) + block + match.group(4)

    return BLOCK.sub(replace, text)


def main(args) -> int:
    readme = Path(args.readme)
    text = readme.read_text()
    rendered = render_readme(text, write_files=not args.check)
    if args.check:
        if rendered != text:
            print(f"{readme}: its figures differ from the run files in docs/runs; run `trikv bench readme`",
                  file=sys.stderr)
            return 1
        print(f"{readme}: every figure is what the run files give")
        return 0
    readme.write_text(rendered)
    print(f"rendered the figures of {readme} from docs/runs")
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--readme", default=str(ROOT / "README.md"), help="the README to render into")
    parser.add_argument("--check", action="store_true", help="only compare (exit 1 when the README is out of date)")
    parser.set_defaults(func=main)


register_bench("readme", add_arguments, help="render the README's figures from the run files in docs/runs")
