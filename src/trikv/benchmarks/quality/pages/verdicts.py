"""How the page judges TriAttention against another method, and the statistics it reads the runs with.

A verdict comes from the 95% interval of a paired difference (method minus triattention): TriAttention *leads*
where the whole interval favours it, *trails* where it favours the method, *ties* otherwise, and no verdict comes
from fewer than `MIN_VERDICT_UNITS` texts or problems. Beside it: each method's role on the page (`method_role`),
the exact sign test and the paired counts of per-problem scores, rank correlation, and the per-run diagnosis
computed from the recall and fidelity tables.
"""

from __future__ import annotations

import math

from .cells import ORACLE_LABEL, format_difference, recall_horizon_labels, run_budgets, run_methods, table_cell


def interval_verdict(comparison: dict | None, higher_is_better: bool) -> str | None:
    """'leads' / 'trails' / 'ties' for TriAttention against a method, from the interval of (method - triattention):
    TriAttention leads when the whole interval favours it, trails when the whole interval favours the method."""
    if not comparison:
        return None
    low, high = comparison["ci"]
    if math.isnan(low) or math.isnan(high):
        return None
    method_better = low > 0 if higher_is_better else high < 0
    method_worse = high < 0 if higher_is_better else low > 0
    return "trails" if method_better else "leads" if method_worse else "ties"


MIN_VERDICT_UNITS = 8  # a percentile bootstrap over fewer texts or problems says little: no verdict from it


def resampled_units(record: dict, task: str, dataset: str | None) -> int:
    """Texts (fidelity, recall) or problems (math) the run's paired intervals resample."""
    results = record["results"]
    if task == "math":
        table = results["math"].get(dataset, {})
        return max((cell.get("problems", 0) for values in table.values() for cell in values.values() if cell), default=0)
    return len(results[task]["meta"].get("texts", []))


def method_role(method: str) -> str:
    """What a method is on the page: "reference" (full attention), "triattention", "control" (a policy that marks
    itself a control, `random`: what any eviction at the same budget gives, never counted as a baseline), "variant"
    (TriAttention's ablations and trikv's own variants: `triattention-*`, `tri-am*`), "baseline ablation" (a registry
    entry whose rule calls itself an ablation of another method) or "published" (a baseline as its paper defines it,
    run on the shared cache, trigger and prompt protection)."""
    from ....policies import REGISTRY

    if method == "full":
        return "reference"
    if method == "triattention":
        return "triattention"
    entry = REGISTRY.get(method)
    if entry is not None and entry.policy_class.control:
        return "control"
    if method.startswith(("triattention-", "tri-am")):
        return "variant"
    if entry is not None and "ablation" in entry.note.split(":")[0].lower():
        return "baseline ablation"
    return "published"


def sign_flip_p(differences: list[float]) -> float:
    """Two-sided p-value of a paired sign-flip (permutation) test of the summed differences: the share of the
    2^n sign patterns whose |sum| is at least the observed one (every pattern for n <= 16, else 2^16 drawn ones,
    seeded). Units are the texts, each paired across the two methods."""
    import numpy as np

    values = np.asarray(differences, dtype=np.float64)
    n = values.size
    if n == 0:
        return math.nan
    if n <= 16:
        patterns = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) * 2.0 - 1.0  # [2^n, n]
    else:
        patterns = np.random.default_rng(0).choice([-1.0, 1.0], size=(2**16, n))
    observed = abs(values.sum())
    return float(np.mean(np.abs(patterns @ values) >= observed - 1e-12 * max(observed, 1.0)))


def holm_survivors(p_values: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down rule: which of the comparisons stay significant with the family-wise error held at
    `alpha` (the k-th smallest p-value is compared with alpha / (m - k); the first that fails stops the rest)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    survives = [False] * len(p_values)
    for rank, index in enumerate(order):
        if not p_values[index] <= alpha / (len(p_values) - rank):
            break
        survives[index] = True
    return survives


def headline_differences(record: dict, budget: str, method: str) -> list[float] | None:
    """Per text, the method's summed KL minus TriAttention's over the positions where compression acts (the same
    positions for both), or None where the run keeps no per-text figures."""
    table = record["results"]["fidelity"]["methods"]
    cell, reference = table_cell(table, method, budget), table_cell(table, "triattention", budget)
    try:
        ours, theirs = reference["per_text"]["compressed"]["kl"], cell["per_text"]["compressed"]["kl"]
    except (KeyError, TypeError):
        return None
    return [a - b for a, b in zip(theirs, ours, strict=True)]


HEADLINE = ("fidelity", "KL where compression acts", lambda c: c.get("vs_triattention", {}).get("compressed", {}).get("kl"), False, 4, 1.0)
SECONDARY = ("recall", "attention recall", lambda c: (c.get("vs_triattention") or {}).get("recall"), True, 3, 1.0)
MATH = ("math", "pass@1", lambda c: (c.get("vs_triattention") or {}).get("pass@1"), True, 1, 100.0)


def verdict_groups(record: dict, table: dict, budget: str, get, higher: bool, digits: int, scale: float,
              roles: tuple[str, ...]) -> dict[str, list[str]]:
    """{"leads"|"trails"|"ties": ["`m` +d [low, high]"]} of TriAttention against the run's methods of `roles`."""
    groups: dict[str, list[str]] = {"leads": [], "trails": [], "ties": []}
    for method in run_methods(record):
        if method_role(method) not in roles:
            continue
        cell = table_cell(table, method, budget)
        comparison = get(cell) if cell else None
        verdict = interval_verdict(comparison, higher)
        if verdict:
            groups[verdict].append(f"`{method}` {format_difference(comparison, digits, scale)}")
    return groups


def kl_ranking(record: dict, budget: str) -> list[tuple[str, float]]:
    """(method, KL where compression acts) of every compressing method of the run at `budget`, lowest first."""
    table = record["results"]["fidelity"]["methods"]
    rows = [(m, _kl(table_cell(table, m, budget))) for m in run_methods(record) if m != "full" and table_cell(table, m, budget)]
    return sorted(rows, key=lambda row: row[1])


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the probability, if both methods were equally good, of a split of the problems
    they disagree on at least this uneven (McNemar's exact test when each problem is scored 0 or 1)."""
    disagreements = wins + losses
    if disagreements == 0:
        return 1.0
    tail = sum(math.comb(disagreements, k) for k in range(min(wins, losses) + 1)) / 2 ** disagreements
    return min(1.0, 2 * tail)


def paired_counts(cell: dict, other: dict) -> tuple[float, float, int, int]:
    """(gained, lost, problems better, problems worse) of `cell` against `other` on the problems both answered."""
    shared = [problem for problem in cell["by_problem"] if problem in other["by_problem"]]
    differences = [cell["by_problem"][q] - other["by_problem"][q] for q in shared]
    gained = sum(max(0.0, d) for d in differences)
    lost = sum(max(0.0, -d) for d in differences)
    return gained, lost, sum(d > 0 for d in differences), sum(d < 0 for d in differences)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def _spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    mean = (n - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    var = sum((x - mean) ** 2 for x in ra)
    return cov / var if var else float("nan")


def _kl(cell: dict) -> float:
    """KL where compression acts (runs from before that figure: over every position)."""
    return cell["compressed"]["kl"] if "compressed" in cell else cell["kl"]


def _top1(cell: dict) -> float:
    return cell["compressed"]["top1_agreement"] if "compressed" in cell else cell["top1_agreement"]


def diagnosis(record: dict, method: str = "triattention") -> list[str]:
    """Findings, each computed from the run's own figures: does ranking by recall rank methods as KL does, where
    (by horizon and layer) `method` loses the attention mass the future-attention selection keeps, and what a
    protected recent window and the window-attention term change. Lines only for what the run measured; no
    sentence is printed that the figures do not compute."""
    fidelity, recall = record["results"]["fidelity"]["methods"], record["results"]["recall"]["methods"]
    labels = recall_horizon_labels(record)
    selection = f"`{ORACLE_LABEL}`"
    lines = []
    for budget in run_budgets(record):
        rows = [(m, table_cell(fidelity, m, budget), table_cell(recall, m, budget)) for m in run_methods(record) if m != "full"]
        rows = [(m, f, r) for m, f, r in rows if f and r]
        if len(rows) >= 3:
            rho = _spearman([r["recall"] for _, _, r in rows], [-_kl(f) for _, f, _ in rows])
            best_recall = max(rows, key=lambda row: row[2]["recall"])[0]
            best_kl = min(rows, key=lambda row: _kl(row[1]))[0]
            lines.append(f"B={budget}: rank correlation of recall with -KL over {len(rows)} methods {rho:+.2f}; "
                         f"highest recall `{best_recall}`, lowest KL `{best_kl}`.")
        own, oracle = table_cell(recall, method, budget), table_cell(recall, "oracle", budget)
        if own and oracle and own.get("by_horizon") and oracle.get("by_horizon"):
            missing = {}
            for label in labels:
                mine, best = own["by_horizon"].get(label), oracle["by_horizon"].get(label)
                if mine and best:
                    missing[label] = max(0.0, best["recall"] - mine["recall"]) * mine["mass_share"]
            total = sum(missing.values())
            if total > 0:
                worst = max(missing, key=missing.get)
                lines.append(f"B={budget}: `{method}` recall {own['recall']:.3f} vs {selection} {oracle['recall']:.3f}; "
                             f"{100 * missing[worst] / total:.0f}% of the mass it misses against that selection (weighted "
                             f"by each horizon's share of attention) is at horizon {worst}: "
                             + ", ".join(f"{label} {100 * value / total:.0f}%" for label, value in missing.items()) + ".")
        if oracle and oracle.get("by_horizon"):
            above = []
            for label in labels:
                best = oracle["by_horizon"].get(label)
                if not best:
                    continue
                recalls = [(m, r.get("by_horizon", {}).get(label, {}).get("recall", 0.0)) for m, _, r in rows]
                # compared as printed (3 decimals), so no method is called "above" an equal-looking figure
                leaders = [(m, value) for m, value in recalls if round(value, 3) > round(best["recall"], 3)]
                if leaders:
                    leaders.sort(key=lambda item: -item[1])
                    above.append(f"{label} ({ORACLE_LABEL} {best['recall']:.3f}): "
                                 + ", ".join(f"`{m}` {value:.3f}" for m, value in leaders))
            if above:
                lines.append(f"B={budget}: methods above {selection} at a horizon (it ranks keys by the attention of all "
                             "later queries, not of one horizon's): " + "; ".join(above) + ".")
        if own and oracle and own.get("recall_per_layer") and oracle.get("recall_per_layer"):
            gaps = [b - a for a, b in zip(own["recall_per_layer"], oracle["recall_per_layer"])]
            worst_layer = max(range(len(gaps)), key=gaps.__getitem__)
            lowest = min(range(len(gaps)), key=lambda i: oracle["recall_per_layer"][i])
            lines.append(f"B={budget}: `{method}`'s largest gap to {selection} is at layer {worst_layer} "
                         f"({own['recall_per_layer'][worst_layer]:.3f} vs {oracle['recall_per_layer'][worst_layer]:.3f}); "
                         f"{selection}'s own lowest layer is {lowest} ({oracle['recall_per_layer'][lowest]:.3f}).")
        concentration = record["results"]["recall"].get("meta", {}).get("concentration_per_layer")
        if own and own.get("recall_per_layer") and concentration and len(concentration) == len(own["recall_per_layer"]):
            for other, _, other_recall in rows:
                if other == method or other_recall["recall"] <= own["recall"] or not other_recall.get("recall_per_layer"):
                    continue
                gap = [a - b for a, b in zip(other_recall["recall_per_layer"], own["recall_per_layer"])]
                rho = _spearman(gap, concentration)
                if math.isnan(rho):
                    continue
                if len(gap) < MIN_VERDICT_UNITS:  # a rank correlation over 3 layers is +/-1 or +/-0.5 by construction
                    reading = f"no reading from {len(gap)} layers (at least {MIN_VERDICT_UNITS} needed)"
                else:
                    reading = (f"the lead is larger where concentration is {'lower' if rho < 0 else 'higher'}"
                               if abs(rho) >= 0.3 else "no clear relation (|rank correlation| < 0.3)")
                lines.append(f"B={budget}: `{other}` recalls more than `{method}` ({other_recall['recall']:.3f} vs "
                             f"{own['recall']:.3f}); across {len(gap)} layers its lead against the layer's query "
                             f"concentration (mean R of the statistics): rank correlation {rho:+.2f}, {reading}.")
        for variant, base, what in ((f"{method}-recent", method, "protecting the most recent tokens"),
                                    (f"{method}-window", f"{method}-recent", "adding the window-attention term")):
            a, b = table_cell(fidelity, base, budget), table_cell(fidelity, variant, budget)
            if a and b:
                lines.append(f"B={budget}: {what} (`{base}` -> `{variant}`): KL {_kl(a):.4f} -> {_kl(b):.4f}, "
                             f"top-1 {_top1(a):.3f} -> {_top1(b):.3f}.")
    return lines
