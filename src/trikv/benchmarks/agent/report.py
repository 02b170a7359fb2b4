"""docs/agent.md from the cells of `trikv bench agent`: who completes the session under the memory limit, what
each method holds, how its answers compare with the truth and with uncapped full attention, by distance.

Intervals are 95% bootstrap intervals over sessions (a session is the unit that varies: its files and questions);
a share is a ratio of sums over the resampled sessions. Nothing on the page is typed by hand: every figure is
computed here from the cells, and each row names the command that produced it. The page opens with the shared
header (`report_pages.page_header`); where vLLM cells are present, its box judges session reuse's two targets
(`reuse_targets`).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..quality.intervals import percentile_interval, resample_weights
from ..report_pages import command_line, format_commit, page_header

TITLE = "An agent session past a memory limit"

DISTANCES = ((0, 0, "0 (the chunk just read)"), (1, 2, "1-2"), (3, 5, "3-5"), (6, 10**6, "6+"))
BACKEND_ORDER = ("transformers", "mlx", "vllm", "vllm-stateless")
REFERENCE, NO_CONTEXT = "full-unlimited", "no-context"  # the two runs that are not methods under the limit


def bounded_methods(methods) -> list[str]:
    """The methods that ran under the limit with a bounded cache (full attention, the reference and the no-context
    control aside)."""
    return [m for m in methods if m not in ("full", REFERENCE, NO_CONTEXT)]


def load_cells(folder: Path) -> dict:
    """{backend: {method: {seed: result}}} of every cell in folder/cells (named backend-method-seed)."""
    runs: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted((folder / "cells").glob("*.json")):
        cell = json.loads(path.read_text())
        backend = max((b for b in BACKEND_ORDER if path.stem.startswith(b + "-")), key=len)
        method, seed = path.stem[len(backend) + 1:].rsplit("-", 1)
        runs[backend][method][int(seed)] = cell["result"] | {"settings": cell["settings"]}
    return runs


def share_with_interval(hits: list[float], totals: list[float]) -> tuple[float, list[float]]:
    """sum(hits) / sum(totals) over sessions, with its bootstrap interval over sessions."""
    hits_array, totals_array = np.asarray(hits, float), np.asarray(totals, float)
    if totals_array.sum() == 0:
        return math.nan, [math.nan, math.nan]
    point = hits_array.sum() / totals_array.sum()
    weights = resample_weights(len(hits_array))
    with np.errstate(invalid="ignore", divide="ignore"):
        samples = (weights @ hits_array) / (weights @ totals_array)
    return float(point), percentile_interval(samples)


def _pct(point: float, interval: list[float]) -> str:
    if math.isnan(point):
        return "-"
    return f"{100 * point:.0f}% [{100 * interval[0]:.0f}, {100 * interval[1]:.0f}]"


def _seconds(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f} s"


def _times(value: float) -> str:
    return "-" if math.isnan(value) else f"x{value:.2f}"


def summarise(cells: dict, no_context: dict | None = None) -> dict:
    """Per method: sessions, completed, failures, answered, accuracy and agreement (with intervals), by distance;
    with the no-context control's cells, also the accuracy on the questions the control gets wrong (what the files
    had to tell)."""
    seeds = sorted(cells)
    records = {seed: cells[seed]["records"] for seed in seeds}
    from_context = (math.nan, [math.nan, math.nan])
    if no_context is not None and all(seed in no_context for seed in seeds):
        unknown = {seed: [not r["right"] for r in no_context[seed]["records"]] for seed in seeds}
        from_context = share_with_interval(
            [sum(r["right"] for r, u in zip(records[s], unknown[s]) if u) for s in seeds],
            [sum(u for _, u in zip(records[s], unknown[s])) for s in seeds])
    right = [sum(r["right"] for r in records[s]) for s in seeds]
    answered = [len(records[s]) for s in seeds]
    agrees = [sum(bool(r["agrees"]) for r in records[s] if r["agrees"] is not None) for s in seeds]
    compared = [sum(r["agrees"] is not None for r in records[s]) for s in seeds]
    by_distance = {}
    for low, high, label in DISTANCES:
        hits = [sum(r["right"] for r in records[s] if low <= r["distance"] <= high) for s in seeds]
        total = [sum(low <= r["distance"] <= high for r in records[s]) for s in seeds]
        by_distance[label] = share_with_interval(hits, total) + (sum(total),)
    failures = [cells[s]["error"] for s in seeds if cells[s]["error"]]
    last_ttfts = [records[s][-1]["ttft"] for s in seeds if records[s] and records[s][-1]["ttft"]]
    peaks = [r["peak_bytes"] for s in seeds for r in records[s]]
    ttft = [r["ttft"] for s in seeds for r in records[s] if r["ttft"] is not None]
    # vLLM: prompt tokens computed over a whole session, as a multiple of the conversation's final length
    computed = [sum(r["prompt_tokens"] - r["cached_tokens"] for r in records[s]) / records[s][-1]["tokens"]
                for s in seeds if records[s] and all(r.get("prompt_tokens") is not None for r in records[s])]
    return {
        "prefill_computed": float(np.median(computed)) if computed else math.nan,
        "sessions": len(seeds), "completed": len(seeds) - len(failures), "failures": failures,
        "answered": sum(answered), "accuracy": share_with_interval(right, answered), "from_context": from_context,
        "agreement": share_with_interval(agrees, compared), "by_distance": by_distance,
        "peak_bytes": max(peaks) if peaks else 0, "ttft_median": float(np.median(ttft)) if ttft else math.nan,
        "ttft_last": float(np.median(last_ttfts)) if last_ttfts else math.nan,
    }


def paired_difference(cells_a: dict, cells_b: dict) -> tuple[float, list[float], int]:
    """Accuracy of a minus accuracy of b on the questions both answered (same sessions, same messages), with its
    95% bootstrap interval over those questions (each question drawn with both answers: the pairs resampled)."""
    differences = []
    for seed in sorted(set(cells_a) & set(cells_b)):
        for record_a, record_b in zip(cells_a[seed]["records"], cells_b[seed]["records"]):
            differences.append(float(record_a["right"]) - float(record_b["right"]))
    if not differences:
        return math.nan, [math.nan, math.nan], 0
    values = np.asarray(differences)
    weights = resample_weights(len(values))
    return float(values.mean()), percentile_interval(weights @ values / len(values)), len(values)


def _points(point: float, interval: list[float]) -> str:
    """A difference of shares in percentage points with its interval."""
    if math.isnan(point):
        return "-"
    return f"{100 * point:+.1f} [{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"


def _longest(runs: dict) -> int:
    """Tokens of the longest conversation the reference run completed."""
    reference = runs.get("transformers", {}).get("full-unlimited", {})
    return max((cell["records"][-1]["tokens"] for cell in reference.values() if cell["records"]), default=0)


def _mlx_blas_sentence(all_runs: list[dict]) -> str:
    """Which BLAS the MLX cells' float32 products ran on (their times depend on it), as the cells record it."""
    names = sorted({cell.get("settings", {}).get("blas") or "an unrecorded BLAS" for runs in all_runs
                    for cells in runs.get("mlx", {}).values() for cell in cells.values()})
    if not names:
        return ""
    return (f" MLX's matrix products ran on {', '.join(f'`{n}`' for n in names)} (mlx's Linux CPU wheel bundles "
            "the reference BLAS; an optimised one preloaded with `LD_PRELOAD` changes the times, not the rule).")


def _command(backend: str, config: dict, methods: list[str] | None = None) -> str:
    """The command that makes a backend's cells (`methods`: the bounded methods it ran, named in the command)."""
    venv = ".venv-upper/bin/" if backend == "mlx" else ".venv/bin/"  # MLX and vLLM live in two environments
    chosen = f" --methods {','.join(methods)}" if methods else ""
    return (f"`{venv}trikv bench agent --backends {backend}{chosen} --model {config['model']} --budget {config['budget']} "
            f"--limit-tokens {config['limit_tokens']} --sessions {config['sessions']} --steps {config['steps']} "
            f"--chunk-tokens {config['chunk_tokens']} --out {{folder}}`")


def _recorded_commit(config: dict) -> str | None:
    """The commit `code_version()` recorded ('abc1234', or 'abc1234+changes' from a tree with uncommitted changes)."""
    commit = (config.get("version") or {}).get("commit")
    return None if not commit else format_commit(commit.removesuffix("+changes"), commit.endswith("+changes"))


def _cell_commits(runs: dict) -> list[str | None]:
    """The distinct commits a setting's cells record (each cell keeps the commit that computed it: cells reused from
    another commit with `--reuse-other-code` keep theirs), in the order of the backends and methods."""
    commits = [_recorded_commit(cell.get("settings", {})) for backend in BACKEND_ORDER for cells in runs.get(backend, {}).values()
               for cell in cells.values()]
    return list(dict.fromkeys(commits))


def _figure(config: dict, runs: dict) -> str:
    """The first setting's outcome on its first backend: who completes the session under the limit, and how the
    bounded method that completes most answers against uncapped full attention."""
    backend = next(b for b in BACKEND_ORDER if b in runs)
    summaries = {method: summarise(cells) for method, cells in runs[backend].items()}
    where = f"{config['model']}, limit {config['limit_tokens']:,} tokens ({backend})"
    bounded = bounded_methods(summaries)
    if not bounded:
        return f"{where}: no bounded method ran"
    best = max(bounded, key=lambda m: (summaries[m]["completed"], summaries[m]["accuracy"][0]))
    parts = [f"{'full attention' if method == 'full' else method} completes {summaries[method]['completed']}/"
             f"{summaries[method]['sessions']} sessions" for method in ("full", best) if method in summaries]
    share = lambda summary: "-" if math.isnan(summary["accuracy"][0]) else f"{100 * summary['accuracy'][0]:.0f}%"  # noqa: E731
    answers = f"{share(summaries[best])} of its answers right"
    if "full-unlimited" in summaries:
        answers += f" (uncapped full attention: {share(summaries['full-unlimited'])})"
    return f"{where}: " + ", ".join(parts) + f", {answers}"


# session reuse on vLLM against the transformers session (same method, same sessions): what reuse must reach
REUSE_TTFT_FACTOR = 2.0  # the last message's time to first token, at most this multiple of the transformers session's
REUSE_PREFILL_FACTOR = 1.5  # prompt tokens computed over a session, at most this multiple of the conversation's length


def reuse_comparison(runs: dict, method: str = "triattention") -> list[dict]:
    """Per session run by `method` on the transformers path and on vLLM (with reuse, and stateless where run): the last
    message's time to first token on each, and the prompt tokens vLLM computed over the session as a multiple of the
    conversation's final length."""
    ours = runs.get("transformers", {}).get(method, {})
    rows = []
    for seed in sorted(runs.get("vllm", {}).get(method, {})):
        reuse = runs["vllm"][method][seed]["records"]
        if seed not in ours or not reuse or not ours[seed]["records"]:
            continue
        stateless = runs.get("vllm-stateless", {}).get(method, {}).get(seed, {}).get("records") or []
        computed = lambda records: (sum(r["prompt_tokens"] - r["cached_tokens"] for r in records)  # noqa: E731
                                    / records[-1]["tokens"])
        rows.append({"seed": seed, "transformers_last": ours[seed]["records"][-1]["ttft"], "reuse_last": reuse[-1]["ttft"],
                     "stateless_last": stateless[-1]["ttft"] if stateless else math.nan,
                     "reuse_prefill": computed(reuse), "stateless_prefill": computed(stateless) if stateless else math.nan})
    return rows


def reuse_targets(rows: list[dict]) -> list[tuple[str, bool | None]]:
    """The two targets of session reuse, judged on every session (None where no session ran on both paths)."""
    ttft = (f"vLLM session reuse: last-message TTFT <= {REUSE_TTFT_FACTOR:g}x the transformers session's, every session")
    prefill = f"vLLM session reuse: prompt tokens computed <= {REUSE_PREFILL_FACTOR:g}x the conversation, every session"
    if not rows:
        return [(ttft, None), (prefill, None)]
    return [(ttft, all(r["reuse_last"] <= REUSE_TTFT_FACTOR * r["transformers_last"] for r in rows)),
            (prefill, all(r["reuse_prefill"] <= REUSE_PREFILL_FACTOR for r in rows))]


def _reuse_lines(runs: dict) -> list[str]:
    """The session-reuse table: TriAttention's last message and prefill work per session, transformers against vLLM
    with reuse and stateless."""
    rows = reuse_comparison(runs)
    if not rows:
        return []
    lines = ["", "### Session reuse on vLLM against the transformers session", "",
             f"TriAttention, session by session: the last message's time to first token on the transformers path "
             f"(`trikv.Session`, one cache for the conversation), on vLLM with session reuse and stateless, and the "
             f"prompt tokens vLLM computed over the session as a multiple of the conversation's final length. Targets: "
             f"reuse's last message within {REUSE_TTFT_FACTOR:g}x of the transformers session's, and at most "
             f"{REUSE_PREFILL_FACTOR:g}x the conversation computed.", "",
             "| session | TTFT last, transformers | TTFT last, vLLM reuse | (ratio) | TTFT last, vLLM stateless | "
             "computed / conversation, reuse | computed / conversation, stateless |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {_seconds(r['transformers_last'])} | {_seconds(r['reuse_last'])} | "
                     f"{_times(r['reuse_last'] / r['transformers_last'])} | {_seconds(r['stateless_last'])} | "
                     f"{_times(r['reuse_prefill'])} | {_times(r['stateless_prefill'])} |")
    lines += ["", "; ".join(f"{name}: {'met' if ok else 'not met' if ok is False else 'not judged'}"
                            for name, ok in reuse_targets(rows)) + "."]
    reuse, session = runs["vllm"]["triattention"], runs["transformers"]["triattention"]
    same = [record_a.get("answer") == record_b.get("answer") for seed in sorted(set(reuse) & set(session))
            for record_a, record_b in zip(reuse[seed]["records"], session[seed]["records"])]
    lines += ["", f"Answers: with reuse, vLLM gives the transformers session's answer, word for word, on {sum(same)} of "
              f"{len(same)} questions."]
    stateless = runs.get("vllm-stateless", {}).get("triattention")
    if stateless:
        point, interval, count = paired_difference(reuse, stateless)
        lines[-1] += (f" Reuse minus stateless, answers right: {_points(point, interval)} points over {count} questions "
                      "(paired, 95% interval). Stateless, every message compacts the whole conversation afresh (its "
                      "rounds fall at other positions, and every entry of the conversation competes again), so an entry "
                      "an earlier message's rounds evicted can be kept again; with reuse, as in the transformers "
                      "session, an evicted entry stays evicted. The difference is what the extra prefill buys, at the "
                      "time to first token above.")
    return lines


def write_report(folders: list[Path] | Path, out: Path) -> Path:
    """The page: the case and the rules once, then one section per run folder (a setting: model, limit, budget,
    sessions), each with who completes, the answers by distance, the KV held per message and its commands."""
    folders = [folders] if isinstance(folders, Path) else list(folders)
    figures = out.parent / (out.stem + "_files")
    figures.mkdir(parents=True, exist_ok=True)
    settings = []
    for folder in folders:
        runs = load_cells(folder)
        if not runs:
            raise ValueError(f"{folder} holds no cells: run `trikv bench agent --out {folder}` first")
        settings.append((folder, json.loads((folder / "agent.json").read_text())["config"],
                         json.loads((folder / "sessions.json").read_text()), runs))
    versions = sorted({config["version"]["trikv"] for _, config, _, _ in settings})
    python = settings[0][2][0]["sources"].get("python", "")
    measured = ("an agent session (tool results of source files, questions about them) past a KV memory limit: "
                + "; ".join(f"{config['model']} on {', '.join(b for b in BACKEND_ORDER if b in runs)}, "
                            f"limit {config['limit_tokens']:,} tokens, budget {config['budget']}, {config['sessions']} "
                            f"session{'s' if config['sessions'] != 1 else ''}" for _, config, _, runs in settings))
    lines = [
        *page_header(TITLE, command_line("trikv", "bench", "agent-report", *folders, "--out", out), measured,
                     _figure(settings[0][1], settings[0][3]),
                     reuse_targets(reuse_comparison(settings[0][3])) if "vllm" in settings[0][3] else [],
                     [_cell_commits(runs) for _, _, _, runs in settings]),
        "From the cells in " + ", ".join(f"`{folder}`" for folder, _, _, _ in settings) + f" (trikv {', '.join(versions)}). "
        "This machine: 2 CPU cores, models in fp32, greedy answers." + _mlx_blas_sentence([runs for *_, runs in settings]),
        "",
        "**The case.** A coding agent reads a code base through a tool: every step is a tool result, a chunk of a real "
        f"source file (the Python {python} standard library, one chunk per file, files drawn per session), with a "
        "question about that chunk, then a question about a chunk read earlier. Every answer is checkable: parameter "
        "names or assigned literals read from the file by Python's parser, judged strictly (the exact set of names; "
        "the literal's value). No question asks a fact an earlier question of the session asked, so a recall cannot "
        "be echoed from an earlier answer. The no-context control asks every question alone, without the files: "
        "what it gets right the model knows from training. The conversation grows past a memory "
        "limit: on vLLM the KV pool itself (vLLM refuses a longer conversation with a 400 error); on transformers and "
        "MLX the harness compares the bytes the cache holds after every forward (MLX: after every message's prefill) "
        "with the limit and ends the session at the first message that passes it, as an out-of-memory would. Bounded "
        "methods run at a budget whose bound (budget + divide_length 128 + one prefill chunk of 512) fits the limit.",
        "",
        "**Reference answers**: uncapped full attention on the transformers path (the same weights, greedy); `agrees` "
        "= the same first line of answer. On vLLM every message sends the whole conversation again (the `openai` "
        "client's chat API). `vllm`: trikv's session reuse (its default) continues the bounded cache the previous "
        "message left and prefills only the new tokens; `vllm-stateless` (`--no-session-reuse`) prefills the whole "
        "conversation again, in chunks with rounds between them, so its time to first token grows with the "
        "conversation. Prefix caching is off for every vLLM engine, full attention's included (the same rule for "
        "all). Intervals are 95% bootstrap intervals over sessions.",
        "",
    ]
    for index, (folder, config, sessions, runs) in enumerate(settings):
        lines += _setting_lines(folder, config, sessions, runs, figures, f"{index}_" if len(settings) > 1 else "", out)
    out.write_text("\n".join(lines))
    return out


def _setting_lines(folder: Path, config: dict, sessions: list, runs: dict, figures: Path, prefix: str, out: Path) -> list[str]:
    per_token = config["kv_bytes_per_token"]
    cap = config["cap_bytes"]
    mib = 2**20
    lines = [
        f"## {config['model']}: memory limit {config['limit_tokens']:,} tokens, budget {config['budget']} (`{folder.name}`)",
        "",
        f"{config['sessions']} sessions of {config['steps']} steps of about {config['chunk_tokens']} tokens "
        f"({sum(len(s['messages']) for s in sessions)} questions, answers of at most {config['max_new_tokens']} "
        f"tokens); a conversation ends at {_longest(runs):,} tokens. The limit: {config['limit_tokens']:,} tokens of "
        f"full attention's KV ({cap / mib:.1f} MiB at {per_token:,} bytes per token). Bounded methods hold at most "
        f"{config['budget'] + 128 + 512:,} tokens' entries (budget {config['budget']} + 128 + 512).",
        "",
        "### Who completes the session",
        "",
        "| backend | method | sessions completed | full attention's failure | peak KV | answers right (vs truth) "
        "| right where no context fails | agrees with uncapped full | median TTFT | TTFT, last message "
        "| prompt tokens computed / conversation |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summaries: dict = {}
    no_context = runs.get("transformers", {}).get(NO_CONTEXT)
    for backend in [b for b in BACKEND_ORDER if b in runs]:
        for method in sorted(runs[backend], key=lambda m: (m != NO_CONTEXT, m != REFERENCE, m != "full", m)):
            summary = summaries.setdefault(backend, {})[method] = summarise(runs[backend][method], no_context)
            failure = "-"
            if summary["failures"]:
                first = min(summary["failures"], key=lambda f: f["message"])
                failure = (f"at message {first['message'] + 1} (step {first['step'] + 1})"
                           + (f", {first['tokens']:,} tokens" if first.get("tokens") else "") + f": {first['error']}")
            accuracy, agreement = summary["accuracy"], summary["agreement"]
            label = {REFERENCE: "full, no limit (reference)",
                     NO_CONTEXT: "no context (each question alone, full attention)"}.get(method, method)
            own = method in (REFERENCE, NO_CONTEXT)
            lines.append(
                f"| {backend} | {label} | {summary['completed']}/{summary['sessions']} | {failure} | "
                f"{summary['peak_bytes'] / mib:.1f} MiB | {_pct(*accuracy)} of {summary['answered']} | "
                f"{_pct(*summary['from_context']) if method != NO_CONTEXT else '-'} | "
                f"{_pct(*agreement) if not own else '-'} | {_seconds(summary['ttft_median'])} | "
                f"{_seconds(summary['ttft_last'])} | "
                f"{_times(summary['prefill_computed'])} |")
    lines += ["", "Accuracy counts the questions a run answered (a failed session answers none after its failure). "
              "A right answer is the exact set of parameter names or the literal's value (the strict judge of "
              "`trikv.benchmarks.agent.tasks`). `right where no context fails`: the accuracy on the questions the "
              "no-context control (every question asked alone, without the files) gets wrong, which only what the run "
              "read can answer." + ("" if no_context else " (No no-context cells in this folder: the column is empty.)"),
              *_paired_lines(runs),
              *_reuse_lines(runs),
              "", "### Answers by distance", "",
              "Share of right answers by how many chunks were read after the one asked about, [95% bootstrap interval "
              "over sessions], (questions).", "",
              "| backend | method | " + " | ".join(label for _, _, label in DISTANCES) + " |",
              "|---|---|" + "---|" * len(DISTANCES)]
    for backend, methods in summaries.items():
        for method, summary in methods.items():
            cells = [f"{_pct(p, ci)} ({n})" for p, ci, n in summary["by_distance"].values()]
            lines.append(f"| {backend} | {method} | " + " | ".join(cells) + " |")
    ttft_path = _plot_ttft(runs, figures, prefix)
    lines += ["", "### Time to first token as the conversation grows", "",
              f"![time to first token per message]({figures.name}/{ttft_path.name})", "",
              "Each message's time to first token against the tokens of the conversation so far, session by session "
              "(bounded methods and full attention; the reference run aside). On vLLM with session reuse a message "
              "prefills only its own tokens on top of the cache the previous message left; stateless, it prefills the "
              "whole conversation again. The table's last column is the prompt tokens vLLM computed over a whole "
              "session (`prompt_tokens - cached_tokens` per message) over the conversation's final length.", ""]
    plot_path = _plot(runs, summaries, config, figures, prefix)
    lines += ["", "### KV held per message", "", f"![KV bytes per message]({figures.name}/{plot_path.name})", "",
              "The most K/V bytes each message held (its prefill included), session by session, against the tokens "
              "of the conversation so far; full attention stops where the limit ends it (x). vLLM's figure is its own "
              "KV pool gauge sampled every 50 ms while the message runs (whole blocks of 128 tokens).",
              "", "### Commands", ""]
    for backend in summaries:
        methods = [m for m in bounded_methods(summaries[backend]) if m != "full"]
        lines.append(f"- {backend}: {_command(backend, config, methods).format(folder=folder)}")
    lines += [""]
    return lines


def _paired_lines(runs: dict) -> list[str]:
    """TriAttention against every other bounded method of the same backend, paired over questions."""
    rows = []
    for backend in [b for b in BACKEND_ORDER if b in runs]:
        methods = runs[backend]
        if "triattention" not in methods:
            continue
        for other in bounded_methods(methods):
            if other != "triattention":
                point, interval, count = paired_difference(methods["triattention"], methods[other])
                rows.append(f"| {backend} | triattention − {other} | {_points(point, interval)} | {count} |")
    if not rows:
        return []
    return ["", "### TriAttention against each bounded method, paired", "",
            "Accuracy of TriAttention minus the other method's, in percentage points, on the questions both answered "
            "(the same messages of the same sessions), with a 95% bootstrap interval over those questions (each drawn "
            "with both answers). An interval that holds 0 is no difference this run can tell; the rows are several "
            "comparisons, so one interval in twenty misses by chance.", "",
            "| backend | difference | points [95% interval] | questions |", "|---|---|---|---|", *rows]


def _plot_ttft(runs: dict, figures: Path, prefix: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = [b for b in BACKEND_ORDER if b in runs]
    fig, axes = plt.subplots(1, len(backends), figsize=(4.6 * len(backends), 3.8), squeeze=False, sharey=True)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours: dict = {}
    for axis, backend in zip(axes[0], backends):
        for method, cells in runs[backend].items():
            if method in (REFERENCE, NO_CONTEXT):
                continue
            colour = colours.setdefault(method, "black" if method == "full" else palette[len(colours) % len(palette)])
            for index, seed in enumerate(sorted(cells)):
                records = [r for r in cells[seed]["records"] if r["tokens"] is not None and r["ttft"] is not None]
                axis.plot([r["tokens"] for r in records], [r["ttft"] for r in records], "-", color=colour, alpha=0.7,
                          lw=1.1, label=method if index == 0 else None)
        axis.set_title(backend)
        axis.set_xlabel("tokens in the conversation")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel("time to first token (s)")
    fig.tight_layout()
    path = figures / f"{prefix}ttft_per_message.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot(runs: dict, summaries: dict, config: dict, figures: Path, prefix: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(summaries)
    fig, axes = plt.subplots(1, len(backends), figsize=(5.2 * len(backends), 4.2), squeeze=False)
    colours = {}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, backend in zip(axes[0], backends):
        for method, cells in runs[backend].items():
            if method == NO_CONTEXT:
                continue
            colour = colours.setdefault(method, "black" if method.startswith("full") else palette[len(colours) % len(palette)])
            style = ":" if method == "full-unlimited" else "-"
            for index, seed in enumerate(sorted(cells)):
                records = cells[seed]["records"]
                x = [r["tokens"] if r["tokens"] is not None else i for i, r in enumerate(records)]
                y = [r["peak_bytes"] / 2**20 for r in records]
                axis.plot(x, y, style, color=colour, alpha=0.8, lw=1.2,
                          label=("full, no limit" if method == "full-unlimited" else method) if index == 0 else None)
                if cells[seed]["error"] and x:
                    axis.plot(x[-1], y[-1], "x", color=colour, ms=8)
        axis.axhline(config["cap_bytes"] / 2**20, color="red", lw=1, ls="--", label="memory limit")
        axis.set_title(backend)
        axis.set_xlabel("tokens in the conversation")
        axis.set_ylabel("peak K/V held in the message (MiB)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    path = figures / f"{prefix}kv_per_message.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
