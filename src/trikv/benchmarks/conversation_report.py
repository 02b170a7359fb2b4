"""`trikv bench conversation-report`: docs/sessions.md from the runs of `trikv bench conversation`.

Per turn, each engine's time to first token (median over the conversations, with their range) and the prompt tokens
it computed; how the time grows with the conversation (turns 7-8 against turns 2-3); the prefill a whole
conversation cost; and, for a run with several conversations at once, the throughput, every turn's time to first
token and what session reuse kept, continued and dropped. Every figure is computed here from the run files; the
targets the page checks are computed too.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from . import register_bench
from .report_pages import command_line, format_commit, page_header

TITLE = "A conversation on vLLM: session reuse"
ORDER = ("reuse", "stateless", "full-prefix-caching")
LABELS = {"reuse": "TriAttention, session reuse", "stateless": "TriAttention, stateless",
          "full-prefix-caching": "full attention + prefix caching"}


def load_runs(folder: Path) -> dict[str, dict]:
    runs = {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
    if not runs:
        raise ValueError(f"{folder} holds no runs: run `trikv bench conversation --out {folder}` first")
    return {engine: runs[engine] for engine in ORDER if engine in runs}


def turn_ttfts(run: dict) -> list[list[float]]:
    """[turn][conversation] time to first token."""
    return [[conversation[turn]["ttft"] for conversation in run["conversations"]] for turn in range(run["turns"])]


def growth(run: dict) -> float:
    """Median time to first token of turns 7-8 over that of turns 2-3 (the last two over the second and third)."""
    ttfts = turn_ttfts(run)
    late = [value for turn in ttfts[-2:] for value in turn]
    early = [value for turn in ttfts[1:3] for value in turn]
    return statistics.median(late) / statistics.median(early)


def computed_share(run: dict) -> list[float]:
    """Per conversation: prompt tokens computed over the whole conversation, as a multiple of its final length."""
    shares = []
    for conversation in run["conversations"]:
        computed = sum(turn["prompt_tokens"] - turn["cached_tokens"] for turn in conversation)
        length = conversation[-1]["prompt_tokens"] + conversation[-1]["reply_tokens"]
        shares.append(computed / length)
    return shares


def _range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def _commit(run: dict) -> str | None:
    commit = (run.get("version") or {}).get("commit")
    return None if not commit else format_commit(commit.removesuffix("+changes"), commit.endswith("+changes"))


def targets(runs: dict) -> list:
    """The page's checks: every turn's median time to first token with reuse at most full attention + prefix
    caching's; turns 7-8 at most twice turns 2-3 with reuse; at most 1.5x the conversation computed in prefill."""
    checks = []
    if "reuse" in runs and "full-prefix-caching" in runs:
        reuse, full = turn_ttfts(runs["reuse"]), turn_ttfts(runs["full-prefix-caching"])
        checks.append(("every turn's median TTFT with session reuse <= full attention + prefix caching's",
                       all(statistics.median(a) <= statistics.median(b) for a, b in zip(reuse, full))))
    if "reuse" in runs:
        checks.append(("TTFT of turns 7-8 <= 2x turns 2-3 with session reuse", growth(runs["reuse"]) <= 2))
        checks.append(("prefill computed <= 1.5x the conversation with session reuse",
                       max(computed_share(runs["reuse"])) <= 1.5))
    return checks


def write_page(folders: list[Path], out: Path) -> Path:
    figures = out.parent / (out.stem + "_files")
    figures.mkdir(parents=True, exist_ok=True)
    settings = [(folder, load_runs(folder)) for folder in folders]
    sequential = [(folder, runs) for folder, runs in settings if not next(iter(runs.values()))["concurrent"]]
    concurrent = [(folder, runs) for folder, runs in settings if next(iter(runs.values()))["concurrent"]]
    if not sequential:
        raise ValueError("conversation-report needs a run with one conversation at a time (no --concurrent)")
    main_runs = sequential[0][1]
    first = next(iter(main_runs.values()))
    checks = targets(main_runs)
    figure = "; ".join(f"{LABELS[engine]}: last turn {statistics.median(turn_ttfts(run)[-1]):.2f} s, turns 7-8 / 2-3 "
                       f"x{growth(run):.2f}" for engine, run in main_runs.items())
    measured = (f"time to first token of each turn of a chat ({first['turns']} turns of ~{first['turn_tokens']} tokens "
                f"through the openai client), {first['model']}, TriAttention B={first['budget']} with and without "
                "session reuse, and plain vLLM with full attention and prefix caching")
    commits = [_commit(run) for _, runs in settings for run in runs.values()]
    lines = [*page_header(TITLE, command_line("trikv", "bench", "conversation-report", *folders, "--out", out), measured,
                          figure, checks, commits),
             "A chat client (the `openai` package's chat API) re-sends its whole conversation every turn. With session "
             "reuse the server finds the bounded cache the last turn left (keyed by the token ids it covers) and "
             "prefills only the new message; stateless, it prefills the whole conversation again, compacting between "
             "chunks; plain vLLM with prefix caching hits the blocks of the conversation it cached, while they fit. "
             "This machine: 2 CPU cores, fp32, one server at a time.", ""]
    for folder, runs in sequential:
        lines += _sequential_lines(folder, runs, figures)
    for folder, runs in concurrent:
        lines += _concurrent_lines(folder, runs)
    out.write_text("\n".join(lines))
    return out


def _sequential_lines(folder: Path, runs: dict, figures: Path) -> list[str]:
    first = next(iter(runs.values()))
    conversations = len(first["conversations"])
    lines = [f"## {first['turns']} turns, one conversation at a time (`{folder.name}`)", "",
             f"{conversations} conversations per engine (each on other text), replies of at most {first['reply_tokens']} "
             f"tokens, a pool of {first['pool_blocks']} blocks of {first['block']} tokens (a whole conversation fits "
             f"full attention). Time to first token in seconds: median over the conversations [min, max]; prompt "
             "tokens and tokens computed: medians.", "",
             "| turn | prompt tokens | " + " | ".join(f"{LABELS[e]}: TTFT | computed" for e in runs) + " |",
             "|---|---|" + "---|---|" * len(runs)]
    for turn in range(first["turns"]):
        prompt = statistics.median(c[turn]["prompt_tokens"] for c in first["conversations"])
        cells = []
        for run in runs.values():
            ttfts = [c[turn]["ttft"] for c in run["conversations"]]
            computed = statistics.median(c[turn]["prompt_tokens"] - c[turn]["cached_tokens"] for c in run["conversations"])
            cells.append(f"{_range(ttfts)} | {computed:,.0f}")
        lines.append(f"| {turn + 1} | {prompt:,.0f} | " + " | ".join(cells) + " |")
    lines += ["", "| engine | TTFT turns 7-8 / turns 2-3 | prompt tokens computed per conversation / its length |",
              "|---|---|---|"]
    for engine, run in runs.items():
        shares = computed_share(run)
        lines.append(f"| {LABELS[engine]} | x{growth(run):.2f} | {statistics.median(shares):.2f} "
                     f"[{min(shares):.2f}, {max(shares):.2f}] |")
    reuse = runs.get("reuse", {}).get("sessions")
    if reuse:
        lines += ["", f"Session reuse's own figures at the end (`GET /trikv/stats`): {reuse['hits']} whole hits, "
                  f"{reuse['partial_hits']} partial, {reuse['misses']} misses (every conversation's first turn), "
                  f"{sum(reuse['drops'].values())} kept states dropped."]
    plot = _plot(runs, figures, folder.name)
    lines += ["", f"![time to first token per turn]({figures.name}/{plot.name})", "",
              "Median time to first token per turn; the band spans the conversations.", "", "Command:", "",
              f"`{first['command']}`", ""]
    return lines


def _concurrent_lines(folder: Path, runs: dict) -> list[str]:
    import numpy as np

    first = next(iter(runs.values()))
    lines = [f"## {first['concurrent']} conversations at once on a pool of {first['pool_blocks']} blocks "
             f"(`{folder.name}`)", "",
             f"The pool holds {first['pool_blocks'] * first['block'] // first['bound']} bounded requests at their bound "
             f"({first['bound']} entries: budget + 128 + a prefill chunk of 512), so kept states must give way to "
             "running requests. Time to first token over every turn of every conversation.", "",
             "| engine | output tokens/s | TTFT median | TTFT p90 | last turns' TTFT median | later turns that continued a "
             "kept state | whole hits | partial | misses | kept states dropped |", "|---|---|---|---|---|---|---|---|---|---|"]
    for engine, run in runs.items():
        turns = [turn for conversation in run["conversations"] for turn in conversation]
        ttft = [turn["ttft"] for turn in turns]
        last = [conversation[-1]["ttft"] for conversation in run["conversations"]]
        output = sum(turn["reply_tokens"] for turn in turns) / run["wall_seconds"]
        sessions = run.get("sessions") or {}
        drops = sessions.get("drops", {})
        later = len(turns) - len(run["conversations"])  # every turn but each conversation's first
        continued = (f"{sessions['hits'] + sessions['partial_hits']}/{later} "
                     f"({100 * (sessions['hits'] + sessions['partial_hits']) / later:.0f}%)" if "hits" in sessions else "-")
        lines.append(f"| {LABELS[engine]} | {output:.1f} | {statistics.median(ttft):.2f} s | "
                     f"{float(np.percentile(ttft, 90)):.2f} s | {statistics.median(last):.2f} s | {continued} | "
                     f"{sessions.get('hits', '-')} | {sessions.get('partial_hits', '-')} | {sessions.get('misses', '-')} | "
                     + (", ".join(f"{count} {reason}" for reason, count in drops.items()) if drops else "-") + " |")
    lines += ["", "Command:", "", f"`{first['command']}`", ""]
    return lines


def _plot(runs: dict, figures: Path, prefix: str) -> Path:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6.4, 4.0))
    for engine, run in runs.items():
        ttfts = turn_ttfts(run)
        turns = np.arange(1, len(ttfts) + 1)
        axis.plot(turns, [statistics.median(t) for t in ttfts], marker="o", label=LABELS[engine])
        axis.fill_between(turns, [min(t) for t in ttfts], [max(t) for t in ttfts], alpha=0.2)
    axis.set_xlabel("turn")
    axis.set_ylabel("time to first token (s)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    path = figures / f"{prefix}_ttft_per_turn.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(parser) -> None:
    parser.add_argument("folders", nargs="+", help="--out folders of `trikv bench conversation`")
    parser.add_argument("--out", default="docs/sessions.md", help="the page to write (a folder of plots beside it)")
    parser.set_defaults(func=main)


def main(args) -> int:
    path = write_page([Path(folder) for folder in args.folders], Path(args.out))
    print(f"[trikv bench conversation-report] wrote {path}")
    return 0


register_bench("conversation-report", add_arguments, help="render docs/sessions.md from `trikv bench conversation` runs")
