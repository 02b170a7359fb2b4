"""95% bootstrap intervals over texts (fidelity, attention recall) and problems (math accuracy).

The unit of resampling is what varies between repetitions of an experiment: a trace or text, a math problem.
A resample draws the units with replacement; a figure is recomputed from the resampled units' sums exactly as
the headline figure is computed from all of them (pooled ratios stay ratios of sums), and the interval is the
2.5th-97.5th percentile of the resampled figures. Paired differences against TriAttention use the same
resamples for both methods, so what the units share (a hard trace, an easy problem) cancels. Resamples are
drawn from a fixed seed: the same data give the same intervals.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

RESAMPLES = 2000
REFERENCE_METHOD = "triattention"


def resample_weights(units: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """[resamples, units] how often each unit is drawn in each resample (each row sums to `units`)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(units, np.full(units, 1.0 / units), size=resamples).astype(np.float64)


def percentile_interval(values: np.ndarray, level: float = 0.95) -> list[float]:
    """[low, high] of the resampled figures (NaN resamples, e.g. an empty horizon bucket, are left out)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return [math.nan, math.nan]
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return [float(low), float(high)]


def paired(point: float, reference_point: float, samples: np.ndarray, reference_samples: np.ndarray) -> dict:
    """The difference `point - reference_point` with its interval from paired resamples."""
    return {"difference": point - reference_point, "ci": percentile_interval(samples - reference_samples)}


# ---- fidelity -------------------------------------------------------------------------------------------
FIDELITY_FIGURES = ("top1_agreement", "kl", "perplexity_ratio")


def fidelity_resamples(per_text: dict, weights: np.ndarray) -> dict[str, np.ndarray]:
    """The pooled figures of every resample, from per-text sums {"n", "agree", "kl", "nll", "nll_full"}."""
    sums = {name: weights @ np.asarray(values, dtype=np.float64) for name, values in per_text.items()}
    n = np.maximum(sums["n"], 1.0)
    with np.errstate(over="ignore"):
        ratio = np.exp((sums["nll"] - sums["nll_full"]) / n)
    return {"top1_agreement": sums["agree"] / n, "kl": sums["kl"] / n, "perplexity_ratio": ratio}


def add_fidelity_intervals(table: dict, seed: int = 0, resamples: int = RESAMPLES) -> None:
    """In place, for every cell {method: {budget: cell}} with per-text sums: `ci` (interval of each figure, over
    all positions and over the compressed ones) and `vs_triattention` (paired differences at the same budget)."""
    cells = [(method, budget, cell) for method, values in table.items() for budget, cell in values.items()
             if cell and "per_text" in cell]
    if not cells:
        return
    units = len(cells[0][2]["per_text"]["all"]["n"])
    weights = resample_weights(units, resamples, seed)
    samples = {}
    for method, budget, cell in cells:
        samples[(method, budget)] = {part: fidelity_resamples(cell["per_text"][part], weights) for part in ("all", "compressed")}
        cell["ci"] = {part: {figure: percentile_interval(values) for figure, values in figures.items()}
                      for part, figures in samples[(method, budget)].items()}
    for method, budget, cell in cells:
        reference = table.get(REFERENCE_METHOD, {}).get(budget)
        if method in ("full", REFERENCE_METHOD) or reference is None or (REFERENCE_METHOD, budget) not in samples:
            continue
        cell["vs_triattention"] = {
            part: {figure: paired(_point(cell, part, figure), _point(reference, part, figure),
                                  samples[(method, budget)][part][figure], samples[(REFERENCE_METHOD, budget)][part][figure])
                   for figure in FIDELITY_FIGURES}
            for part in ("all", "compressed")
        }


def paired_fidelity_difference(cell: dict, other: dict, seed: int = 0, resamples: int = RESAMPLES,
                               part: str = "all") -> dict:
    """`cell` minus `other` (two runs over the same texts) for every fidelity figure, with the interval of paired
    resamples over texts: {figure: {"difference", "ci"}}."""
    units = len(cell["per_text"][part]["n"])
    if len(other["per_text"][part]["n"]) != units:
        raise ValueError("paired fidelity figures need the same texts in both cells")
    weights = resample_weights(units, resamples, seed)
    ours, theirs = fidelity_resamples(cell["per_text"][part], weights), fidelity_resamples(other["per_text"][part], weights)
    return {figure: paired(_point(cell, part, figure), _point(other, part, figure), ours[figure], theirs[figure])
            for figure in FIDELITY_FIGURES}


def _point(cell: dict, part: str, figure: str) -> float:
    source = cell["compressed"] if part == "compressed" else cell
    return source[figure]


# ---- attention recall -------------------------------------------------------------------------------------
def recall_resamples(rows: dict, weights: np.ndarray, labels: list[str]) -> dict[str, np.ndarray]:
    """Recall (overall and per horizon label) of every resample, from per-text sums (see `empty_recall_rows`)."""
    kept = np.asarray(rows["kept"], dtype=np.float64)  # [b, L, Hq]
    b = kept.shape[0]
    mass = weights @ np.asarray(rows["mass"], dtype=np.float64).reshape(b, -1)  # [R, L*Hq]
    per_head = (weights @ kept.reshape(b, -1)) / np.maximum(mass, 1e-30)  # [R, L*Hq]
    out = {"recall": per_head.mean(-1), "by_layer": per_head.reshape(len(weights), *kept.shape[1:]).mean(-1)}  # [R, L]
    h_kept = np.asarray(rows["h_kept"], dtype=np.float64)
    h_mass = np.asarray(rows["h_mass"], dtype=np.float64)
    for i, label in enumerate(labels):
        mass = weights @ h_mass[..., i].reshape(b, -1)  # [R, L*Hq]
        kept_mass = weights @ h_kept[..., i].reshape(b, -1)
        valid = mass > 1e-9
        share = np.where(valid, kept_mass / np.where(valid, mass, 1.0), np.nan)
        out[label] = np.nanmean(share, axis=-1)  # a resample with no mass in the bucket gives NaN (left out)
    if "k_mass" in rows:  # by key kind (prompt, repeated, other), as `fidelity.recall_summary` pools them
        from .fidelity import KEY_KINDS

        k_kept = np.asarray(rows["k_kept"], dtype=np.float64)
        k_mass = np.asarray(rows["k_mass"], dtype=np.float64)
        for i, kind in enumerate(KEY_KINDS):
            mass = weights @ k_mass[..., i].reshape(b, -1)
            kept_mass = weights @ k_kept[..., i].reshape(b, -1)
            valid = mass > 1e-9
            share = np.where(valid, kept_mass / np.where(valid, mass, 1.0), np.nan)
            with warnings.catch_warnings():  # a kind absent from every head of a resample gives NaN (left out)
                warnings.simplefilter("ignore", RuntimeWarning)
                out[f"kind:{kind}"] = np.nanmean(share, axis=-1)
    return out


def add_recall_intervals(table: dict, rows_by_cell: dict, horizons, seed: int = 0, resamples: int = RESAMPLES) -> None:
    """In place: `ci` {"recall", "by_horizon": {label}} and `vs_triattention` (paired differences) for every
    recall cell whose per-text sums are in `rows_by_cell` {(method, budget): rows or None}."""
    import warnings

    from .fidelity import horizon_labels

    labels = horizon_labels(tuple(horizons))
    present = {key: rows for key, rows in rows_by_cell.items() if rows is not None and key[0] != "full"}
    if not present:
        return
    units = int(np.asarray(next(iter(present.values()))["queries"]).shape[0])
    weights = resample_weights(units, resamples, seed)
    samples = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # resamples without mass in a bucket give NaN, left out
        for (method, budget), rows in present.items():
            cell = table.get(method, {}).get(str(budget))
            if cell is None:
                continue
            samples[(method, str(budget))] = recall_resamples(rows, weights, labels)
            values = samples[(method, str(budget))]
            cell["ci"] = {"recall": percentile_interval(values["recall"]),
                          "by_horizon": {label: percentile_interval(values[label]) for label in labels
                                         if label in cell.get("by_horizon", {})},
                          "by_kind": {kind: percentile_interval(values[f"kind:{kind}"]) for kind in cell.get("by_kind", {})
                                      if f"kind:{kind}" in values},
                          "by_layer": [percentile_interval(layer) for layer in values["by_layer"].T]}
    for (method, budget), values in samples.items():
        reference = samples.get((REFERENCE_METHOD, budget))
        cell, reference_cell = table[method][budget], table.get(REFERENCE_METHOD, {}).get(budget)
        if method == REFERENCE_METHOD or reference is None or reference_cell is None:
            continue
        comparison = {"recall": paired(cell["recall"], reference_cell["recall"], values["recall"], reference["recall"]),
                      "by_horizon": {}}
        for label in labels:
            if label in cell.get("by_horizon", {}) and label in reference_cell.get("by_horizon", {}):
                comparison["by_horizon"][label] = paired(cell["by_horizon"][label]["recall"],
                                                         reference_cell["by_horizon"][label]["recall"],
                                                         values[label], reference[label])
        if cell.get("recall_per_layer") and reference_cell.get("recall_per_layer"):
            # per layer (mean over its query heads), paired over the same resampled texts
            comparison["by_layer"] = [paired(mine, theirs, values["by_layer"][:, layer], reference["by_layer"][:, layer])
                                      for layer, (mine, theirs) in enumerate(zip(cell["recall_per_layer"],
                                                                                  reference_cell["recall_per_layer"]))]
        cell["vs_triattention"] = comparison


# ---- what a method holds ----------------------------------------------------------------------------------
def add_composition_intervals(table: dict, seed: int = 0, resamples: int = RESAMPLES) -> None:
    """In place: `composition_ci` {kind: [low, high]} for every fidelity cell with per-text held-entry counts
    (`kept_composition_per_text`): each kind's share of all held entries, pooled over resampled texts."""
    for values in table.values():
        for cell in values.values():
            per_text = (cell or {}).get("kept_composition_per_text")
            if not per_text:
                continue
            counts = {name: np.asarray(v, dtype=np.float64) for name, v in per_text.items()}
            weights = resample_weights(len(next(iter(counts.values()))), resamples, seed)
            totals = sum(weights @ v for v in counts.values())
            with np.errstate(invalid="ignore", divide="ignore"):
                cell["composition_ci"] = {name: percentile_interval(weights @ v / totals) for name, v in counts.items()}


# ---- math accuracy ----------------------------------------------------------------------------------------
def add_math_intervals(table: dict, seed: int = 0, resamples: int = RESAMPLES) -> None:
    """In place: `ci` of pass@1 (over problems) and `vs_triattention` (paired over the problems both answered)
    for every cell {method: {budget: summary}} that holds per-problem scores (`by_problem`)."""
    cells = [(method, budget, cell) for method, values in table.items() for budget, cell in values.items()
             if cell and cell.get("by_problem")]
    for method, budget, cell in cells:
        scores = np.array(list(cell["by_problem"].values()), dtype=np.float64)
        weights = resample_weights(len(scores), resamples, seed)
        cell["ci"] = {"pass@1": percentile_interval(weights @ scores / len(scores))}
    for method, budget, cell in cells:
        reference = table.get(REFERENCE_METHOD, {}).get(budget)
        if method in ("full", REFERENCE_METHOD) or not reference or not reference.get("by_problem"):
            continue
        shared = [problem for problem in cell["by_problem"] if problem in reference["by_problem"]]
        if not shared:
            continue
        mine = np.array([cell["by_problem"][p] for p in shared], dtype=np.float64)
        theirs = np.array([reference["by_problem"][p] for p in shared], dtype=np.float64)
        weights = resample_weights(len(shared), resamples, seed)
        cell["vs_triattention"] = {"pass@1": paired(float(mine.mean()), float(theirs.mean()), weights @ mine / len(shared),
                                                    weights @ theirs / len(shared)), "problems": len(shared)}


def paired_accuracy_interval(cell: dict, other: dict, seed: int = 0, resamples: int = RESAMPLES) -> list[float] | None:
    """95% paired bootstrap interval of pass@1(cell) - pass@1(other) over the problems both answered."""
    shared = [problem for problem in cell.get("by_problem", {}) if problem in other.get("by_problem", {})]
    if not shared:
        return None
    differences = np.array([cell["by_problem"][p] - other["by_problem"][p] for p in shared], dtype=np.float64)
    return percentile_interval(resample_weights(len(shared), resamples, seed) @ differences / len(shared))
