"""The PNG plots of one run: one per task (each figure against the budget, a line or a bar per method), what
each method holds right after its rounds, and attention recall layer by layer.
"""

from __future__ import annotations

import math
from pathlib import Path

from .cells import recall_horizon_labels, run_budgets, run_methods, table_cell


def _series(record, table, getter):
    """Per method: (values, intervals) over the run's budgets; a getter returns a value or (value, [low, high])."""
    budgets = [int(b) for b in run_budgets(record)]
    lines = {}
    for method in run_methods(record):
        values, intervals = [], []
        for budget in budgets:
            cell = table_cell(table, method, str(budget))
            got = getter(cell) if cell else float("nan")
            value, interval = got if isinstance(got, tuple) else (got, None)
            values.append(value)
            intervals.append(interval)
        lines[method] = (values, intervals)
    return budgets, lines


def _errors(values, intervals):
    """[2, n] distances below / above each value (0 where a point has no interval), or None without any."""
    if not any(intervals):
        return None
    low = [v - i[0] if i else 0.0 for v, i in zip(values, intervals)]
    high = [i[1] - v if i else 0.0 for v, i in zip(values, intervals)]
    return [[max(0.0, x) for x in low], [max(0.0, x) for x in high]]


def _panel(ax, budgets, lines, ylabel, title, logy=False):
    if len(budgets) == 1:  # one budget: a bar per method with its interval reads better than points on one tick
        names = list(lines)
        values = [lines[m][0][0] for m in names]
        errors = _errors(values, [lines[m][1][0] for m in names])
        colors = ["black" if m == "full" else f"C{i % 10}" for i, m in enumerate(names)]
        ax.barh(names, values, xerr=errors, color=colors, alpha=0.8, capsize=3)  # linear: full attention's 0 shows
        ax.invert_yaxis()
        ax.set_xlabel(f"{ylabel} (95% interval)" if errors else ylabel)
        ax.set_title(f"{title}, budget {budgets[0]}", fontsize=10)
        ax.grid(alpha=0.3, axis="x")
        return
    for method, (values, intervals) in lines.items():
        style = dict(linestyle="--", color="black") if method == "full" else dict(marker="o")
        errors = _errors(values, intervals)
        if errors:
            ax.errorbar(budgets, values, yerr=errors, label=method, capsize=3, **style)
        else:
            ax.plot(budgets, values, label=method, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets)
    ax.set_xticklabels([str(b) for b in budgets])
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("budget (KV entries per layer and head)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)


def _with_interval(cell: dict, figure: str, part: str = "compressed"):
    """(value, interval) of a fidelity figure where compression acts (runs from before it: every position)."""
    if "compressed" not in cell:
        return cell.get(figure, float("nan"))
    value = cell["compressed"].get(figure, float("nan"))
    return value, cell.get("ci", {}).get(part, {}).get(figure)


def plot_run(record: dict, out: Path) -> list[Path]:
    """One PNG per task (metric vs budget, one line per method); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = record["results"]
    written = []
    panels = []
    if "fidelity" in results:
        table = results["fidelity"]["methods"]
        panels.append(("fidelity", [
            (table, lambda c: _with_interval(c, "top1_agreement"), "top-1 agreement", "Top-1 agreement with full attention", False),
            (table, lambda c: _with_interval(c, "kl"), "KL(full || method)", "Mean KL divergence", True),
            (table, lambda c: _with_interval(c, "perplexity_ratio") if "compressed" in c else c["perplexity"],
             "perplexity ratio" if any("compressed" in c for v in table.values() for c in v.values() if c) else "perplexity",
             "Perplexity (ratio to full)", False),
        ]))
    if "recall" in results:
        table = results["recall"]["methods"]
        specs = [(table, lambda c: (c["recall"], c.get("ci", {}).get("recall")), "recall", "Attention recall (all queries)", False)]
        for label in recall_horizon_labels(record):
            specs.append((table, lambda c, h=label: (c["by_horizon"].get(h, {}).get("recall", float("nan")),
                                                     c.get("ci", {}).get("by_horizon", {}).get(h)) if c.get("by_horizon") else float("nan"),
                          "recall", f"Recall, keys judged {label} tokens ago", False))
        panels.append(("recall", specs))
    if "dfs" in results:
        for task in ("dfs-tf", "dfs-gen"):
            if task in results["dfs"]:
                table = results["dfs"][task]
                metrics = [("node", "node exact"), ("stack", "stack exact"), ("visited", "visited exact"), ("all", "all three")]
                if task == "dfs-tf":
                    metrics += [("node_tokens", "node: greedy token share"), ("stack_tokens", "stack: greedy token share"),
                                ("visited_tokens", "visited: greedy token share")]
                panels.append((task, [(table, lambda c, m=m: c.get(m, float("nan")), "accuracy", f"DFS {task[4:]}: {label}", False)
                                      for m, label in metrics]))
    if "needle" in results:
        table = results["needle"]["methods"]
        panels.append(("needle", [(table, lambda c: c["accuracy"], "accuracy", "Passkey retrieval accuracy", False),
                                  (table, lambda c: c["needle_in_cache"], "share", "Share of heads holding the key", False)]))
    if "math" in results:
        specs = []
        for dataset in results["math"]["meta"]["datasets"]:
            if dataset in results["math"]:
                specs.append((results["math"][dataset], lambda c: (c["pass@1"], c.get("ci", {}).get("pass@1")), "pass@1",
                              f"{dataset} pass@1", False))
        if specs:
            panels.append(("math", specs))
    if "recall" in results:
        path = _plot_recall_by_layer(record, Path(out), plt)
        if path is not None:
            written.append(path)
    if "fidelity" in results:
        path = _plot_composition(record, Path(out), plt)
        if path is not None:
            written.append(path)
    for name, specs in panels:
        cols = min(3, len(specs))
        rows = math.ceil(len(specs) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
        for ax, (table, getter, ylabel, title, logy) in zip(axes.flat, specs):
            budgets, lines = _series(record, table, getter)
            _panel(ax, budgets, lines, ylabel, title, logy)
        for ax in list(axes.flat)[len(specs):]:
            ax.axis("off")
        if len(run_budgets(record)) > 1:  # one budget: bars labelled by method
            axes.flat[0].legend(fontsize=8)
        fig.suptitle(f"{record['model']['name']}: {name}", fontsize=11)
        fig.tight_layout()
        path = Path(out) / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _plot_composition(record: dict, out: Path, plt) -> Path | None:
    """composition.png: what each method holds right after its rounds (prompt, repeated text, by age), one stacked
    bar per method, one panel per budget; beside it the recall of each key kind."""
    from ..fidelity import COMPOSITION

    table = record["results"]["fidelity"]["methods"]
    budgets = [b for b in run_budgets(record) if any((table_cell(table, m, b) or {}).get("kept_composition") for m in run_methods(record))]
    if not budgets:
        return None
    recall = record["results"].get("recall", {}).get("methods", {})
    kinds = ("prompt", "repeated", "other")
    fig, axes = plt.subplots(len(budgets), 2, figsize=(11, 3.9 * len(budgets)), squeeze=False)
    for row, budget in zip(axes, budgets):
        methods = [m for m in run_methods(record) if m != "full" and (table_cell(table, m, budget) or {}).get("kept_composition")]
        bottom = [0.0] * len(methods)
        for name in COMPOSITION:
            values = [table_cell(table, m, budget)["kept_composition"][name] for m in methods]
            row[0].barh(methods, values, left=bottom, label=name)
            bottom = [a + b for a, b in zip(bottom, values)]
        row[0].set_xlim(0, 1)
        row[0].set_xlabel("share of the held entries after a round")
        row[0].set_title(f"what each method holds, budget {budget}", fontsize=10)
        row[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(COMPOSITION))
        width = 0.8 / len(kinds)
        for i, kind in enumerate(kinds):
            values = [((table_cell(recall, m, budget) or {}).get("by_kind", {}).get(kind) or {}).get("recall", float("nan")) for m in methods]
            row[1].barh([j + i * width for j in range(len(methods))], values, height=width, label=kind)
        row[1].set_yticks([j + width for j in range(len(methods))])
        row[1].set_yticklabels(methods)
        row[1].set_xlabel("recall of the key kind (keys already judged)")
        row[1].set_title(f"recall by key kind, budget {budget}", fontsize=10)
        row[1].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(kinds))
        row[1].grid(alpha=0.3, axis="x")
    fig.suptitle(f"{record['model']['name']}: what the methods keep", fontsize=11)
    fig.tight_layout()
    path = out / "composition.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_recall_by_layer(record: dict, out: Path, plt) -> Path | None:
    """recall-layers.png: attention recall of every layer (mean over its query heads), one panel per budget,
    one line per method and the oracle: where in depth each method loses the attention mass."""
    table = record["results"]["recall"]["methods"]
    methods = [m for m in run_methods(record) if m != "full"] + (["oracle"] if "oracle" in table else [])
    budgets = [b for b in run_budgets(record) if any((table_cell(table, m, b) or {}).get("recall_per_layer") for m in methods)]
    if not budgets:
        return None
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.6 * len(budgets), 3.6), squeeze=False)
    for ax, budget in zip(axes.flat, budgets):
        for method in methods:
            cell = table_cell(table, method, budget) or {}
            per_layer = cell.get("recall_per_layer")
            if per_layer:
                style = dict(linestyle="--", color="black") if method == "oracle" else dict(marker=".")
                ax.plot(range(len(per_layer)), per_layer, label=method, **style)
        ax.set_xlabel("layer")
        ax.set_ylabel("recall (mean over heads)")
        ax.set_title(f"budget {budget}", fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{record['model']['name']}: attention recall by layer", fontsize=11)
    fig.tight_layout()
    path = out / "recall-layers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
