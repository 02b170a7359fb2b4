"""`trikv bench calibration-length-report`: docs/calibration.md from `trikv bench calibration-length` runs.

The page answers "how much text does calibration need": per model, fidelity (KL against full attention) and kept-set
agreement between independent calibrations at each length, with the spread over the disjoint slices tried, and the
smallest length that is enough by the rule below. The rule is computed here, never typed: a length is enough when
every slice of it, and of every longer length measured, gives a KL within `KL_TOLERANCE` of the longest length's
mean. The recommendation is the largest of the models' answers; trikv's calibration default is that number (a test
checks it against the committed runs).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from . import register_bench
from .report_pages import command_line, page_header

TITLE = "How much text calibration needs"
KL_TOLERANCE = 0.05  # a slice's KL may exceed the longest calibrations' mean KL by 5%


def load_runs(folders: list[Path]) -> list[dict]:
    runs = []
    for folder in folders:
        path = Path(folder) / "calibration.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: run `trikv bench calibration-length --out {folder}` first")
        runs.append(json.loads(path.read_text()))
    return runs


def by_length(run: dict) -> dict[int, list[dict]]:
    """{calibration tokens: the slices' cells}, shortest first."""
    lengths: dict[int, list[dict]] = {}
    for cell in run["cells"]:
        lengths.setdefault(cell["tokens"], []).append(cell)
    return dict(sorted(lengths.items()))


def enough_tokens(run: dict) -> int | None:
    """The smallest calibration length whose every slice, and every slice of every longer length, has a KL within
    KL_TOLERANCE of the longest length's mean KL (None when no length but the longest was measured)."""
    lengths = by_length(run)
    if len(lengths) < 2:
        return None
    longest = statistics.mean(cell["kl"] for cell in lengths[max(lengths)])
    limit = longest * (1 + KL_TOLERANCE)
    answer = max(lengths)
    for tokens in sorted(lengths, reverse=True):
        if max(cell["kl"] for cell in lengths[tokens]) > limit:
            break
        answer = tokens
    return answer


def recommended_tokens(runs: list[dict]) -> int | None:
    """The calibration length enough for every model measured (the largest of their answers)."""
    answers = [enough_tokens(run) for run in runs]
    return None if not answers or any(answer is None for answer in answers) else max(answers)


def _k(tokens: int) -> str:
    return f"{tokens / 1024:g}K"


def write_page(folders: list[Path], out: Path) -> Path:
    runs = load_runs(folders)
    figures = out.parent / (out.stem + "_files")
    figures.mkdir(parents=True, exist_ok=True)
    answers = {run["model"]: enough_tokens(run) for run in runs}
    recommended = recommended_tokens(runs)
    checks = [(f"{model}: a calibration length short of the longest is enough", answer is not None and answer < max(by_length(run)))
              for (model, answer), run in zip(answers.items(), runs)]
    figure = "; ".join(f"{model}: {_k(answer)} tokens enough" if answer else f"{model}: not judged"
                       for model, answer in answers.items())
    if recommended:
        figure += f"; recommended (every model): {_k(recommended)} tokens"
    first = runs[0]
    measured = (f"TriAttention's fidelity (KL against full attention, top-1 agreement) and the kept-set agreement of "
                f"independent calibrations, against calibration tokens ({', '.join(_k(t) for t in by_length(first))}), "
                f"on {', '.join(run['model'] for run in runs)}, B={first['budget']}, the models' own reasoning traces")
    commits = [run["code"].get("commit") for run in runs]
    lines = [*page_header(TITLE, command_line("trikv", "bench", "calibration-length-report", *folders, "--out", out),
                          measured, figure, checks, commits),
             "Each model is calibrated on disjoint slices of one text (MATH-500 problems and their worked solutions, "
             "without the problems the traces answer) at each length. TriAttention then runs teacher-forced over the "
             "model's own reasoning traces with each slice's statistics, at one budget and schedule for all of them. "
             "KL and top-1 agreement are against full attention over the positions after the first compression round, "
             "pooled over the traces; kept-set agreement is, for two slices of one length, the share of one's held "
             "entries the other holds too after every round (mean over layers, KV heads, rounds and traces), over every "
             "pair of slices. Brackets give the range over the slices (pairs). StreamingLLM (no statistics) and the "
             "model's shipped statistics (its own reasoning on other problems) run at the same budget for reference.",
             "",
             f"**Rule**: a length is enough when every slice of it, and of every longer length measured, has a KL within "
             f"{KL_TOLERANCE:.0%} of the longest length's mean KL. The recommendation is the largest model's answer: "
             + (f"**{recommended:,} tokens**, the default of `trikv calibrate --text-tokens`." if recommended
                else "not judged (a model has one length only)."), ""]
    lines += [f"![KL and kept-set agreement against calibration tokens]({figures.name}/calibration_length.png)", ""]
    for run in runs:
        lines += _model_lines(run)
    _plot(runs, figures / "calibration_length.png")
    out.write_text("\n".join(lines))
    return out


def _range(values: list[float], digits: int = 4) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def _model_lines(run: dict) -> list[str]:
    lengths = by_length(run)
    answer = enough_tokens(run)
    traces = run["traces"]
    lines = [f"## {run['model']}", "",
             f"{len(traces['names'])} reasoning traces of {traces['trace_tokens']} tokens after their prompts; "
             f"budget {run['budget']}, divide length {run['divide_length']}, {run['dtype']}; calibration text "
             f"{run['calibration_text']['tokens']:,} tokens; every block of {run['block_tokens']:,} tokens calibrated "
             f"in {run['calibration_seconds']:.0f} s. Enough: **{_k(answer) if answer else 'not judged'}**."
             + (f" Run: `{run['command']}`." if run.get("command") else ""), "",
             "| calibration tokens | slices | KL (compressed positions) | top-1 agreement | kept-set agreement (pairs) |",
             "|---|---|---|---|---|"]
    for tokens, cells in lengths.items():
        pairs = run["kept_agreement"].get(str(tokens), [])
        lines.append(f"| {tokens:,} | {len(cells)} | {_range([c['kl'] for c in cells])} | "
                     f"{_range([c['top1_agreement'] for c in cells])} | "
                     f"{_range(pairs, 3) + f' ({len(pairs)})' if pairs else 'one slice: no pair'} |")
    for name, reference in run["references"].items():
        label = {"streaming": "StreamingLLM (no statistics)",
                 "shipped": f"shipped statistics ({reference.get('tokens', 0):,} tokens of the model's reasoning)"}[name]
        lines.append(f"| {label} | | {reference['kl']:.4f} | {reference['top1_agreement']:.4f} | |")
    lines.append("")
    return lines


def _plot(runs: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, run in enumerate(runs):
        color = f"C{index}"
        lengths = by_length(run)
        xs = list(lengths)
        means = [statistics.mean(c["kl"] for c in cells) for cells in lengths.values()]
        left.plot(xs, means, "-o", color=color, label=f"{run['model']}: TriAttention, mean over slices")
        for tokens, cells in lengths.items():
            left.scatter([tokens] * len(cells), [c["kl"] for c in cells], color=color, s=12, alpha=0.5)
        for name, style in (("streaming", ":"), ("shipped", "--")):
            if name in run["references"]:
                left.axhline(run["references"][name]["kl"], color=color, linestyle=style, linewidth=1,
                             label=f"{run['model']}: {'StreamingLLM' if name == 'streaming' else 'shipped statistics'}")
        pairs = [(int(tokens), values) for tokens, values in run["kept_agreement"].items() if values]
        pairs.sort()
        if pairs:
            mean = [statistics.mean(values) for _, values in pairs]
            low = [m - min(values) for m, (_, values) in zip(mean, pairs)]
            high = [max(values) - m for m, (_, values) in zip(mean, pairs)]
            right.errorbar([t for t, _ in pairs], mean, yerr=[low, high], fmt="-o", color=color, capsize=3,
                           label=run["model"])
    for axis in (left, right):
        axis.set_xscale("log")
        axis.set_xlabel("calibration tokens")
        axis.grid(alpha=0.3)
    left.set_ylabel(f"KL(full || bounded), B={runs[0]['budget']}")
    left.set_title("fidelity (dots: slices)")
    left.legend(fontsize=7)
    right.set_ylabel("kept-set agreement between disjoint calibrations")
    right.set_title("kept sets (bars: range over pairs)")
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def add_arguments(parser) -> None:
    parser.add_argument("folders", nargs="+", help="folders written by `trikv bench calibration-length` (one per model)")
    parser.add_argument("--out", default="docs/calibration.md")
    parser.set_defaults(func=main)


def main(args) -> int:
    path = write_page([Path(folder) for folder in args.folders], Path(args.out))
    print(f"wrote {path}")
    return 0


register_bench("calibration-length-report", add_arguments,
               help="render docs/calibration.md from `trikv bench calibration-length` runs")
