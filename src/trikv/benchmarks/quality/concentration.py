"""How low can query concentration go before TriAttention loses to attention-based methods? The runs' own data.

TriAttention ranks keys from calibrated query statistics; where a head's queries are concentrated (mean R of its
bands near 1) the statistics stand for every query, where they are spread they stand for none in particular, and a
method that reads the recent queries' attention (R-KV, SnapKV) should then do better. The page plots, per model and
layer, TriAttention's paired lead over such a method against the layer's query concentration (the mean R of the
shipped statistics over the layer's query heads and bands).

What the shipped results hold: fidelity (KL, top-1 agreement) is measured on the model's output, one figure per
position for the whole model, so no per-layer fidelity exists; attention recall (the share of full attention's mass
on the keys a method holds) is measured per (layer, query head). The lead is therefore recall's, the secondary
metric. Its interval is over texts where the run kept per-layer resamples (`vs_triattention.by_layer`), else over
the layer's query heads (a paired bootstrap of the per-head differences: how consistently the lead holds across the
layer's heads, not how it would vary on other texts).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .pages.verdicts import interval_verdict

BASELINES = ("rkv", "snapkv")  # attention-based methods: they rank keys by the recent queries' attention
REFERENCE = "triattention"


def layer_points(record: dict, baseline: str, budget: str) -> list[dict]:
    """[{layer, concentration, lead, low, high, over}] of TriAttention's recall minus `baseline`'s per layer, or []
    where the run lacks either method, the layer recalls or the concentration per layer."""
    recall = record["results"].get("recall")
    if not recall:
        return []
    concentration = (recall.get("meta") or {}).get("concentration_per_layer")
    ours = (recall["methods"].get(REFERENCE) or {}).get(budget)
    theirs = (recall["methods"].get(baseline) or {}).get(budget)
    if not concentration or not ours or not theirs or not ours.get("recall_per_layer") or not theirs.get("recall_per_layer"):
        return []
    if len(concentration) != len(ours["recall_per_layer"]):
        return []
    by_layer = (theirs.get("vs_triattention") or {}).get("by_layer")
    points = []
    for layer, value in enumerate(concentration):
        lead = ours["recall_per_layer"][layer] - theirs["recall_per_layer"][layer]
        if by_layer:  # (baseline - triattention) over resampled texts: the lead's interval is its mirror
            low, high = -by_layer[layer]["ci"][1], -by_layer[layer]["ci"][0]
            over = "texts"
        else:
            low, high = _head_interval(ours["recall_per_head"][layer], theirs["recall_per_head"][layer])
            over = "heads"
        points.append({"layer": layer, "concentration": float(value), "lead": float(lead), "low": low, "high": high,
                       "over": over})
    return points


def _head_interval(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    """95% paired bootstrap interval of the mean per-head difference over the layer's query heads."""
    from .intervals import percentile_interval, resample_weights

    differences = np.asarray(ours, dtype=np.float64) - np.asarray(theirs, dtype=np.float64)
    low, high = percentile_interval(resample_weights(len(differences)) @ differences / len(differences))
    return low, high


def _rank_correlation(a: list[float], b: list[float]) -> float:
    if len(a) < 3:
        return math.nan
    ranks = [np.argsort(np.argsort(values)).astype(np.float64) for values in (a, b)]
    if ranks[0].std() == 0 or ranks[1].std() == 0:
        return math.nan
    return float(np.corrcoef(*ranks)[0, 1])


MIN_LAYERS = 8  # fewer layers give a rank correlation of a handful of possible values: no reading from it


def collect(named_records: list[tuple[str, dict]], usable: dict[str, bool]) -> dict:
    """{baseline: [(run name, model, usable, points)]} for every run with per-layer recall of both methods."""
    out: dict[str, list] = {baseline: [] for baseline in BASELINES}
    for name, record in named_records:
        for budget in [str(b) for b in record["config"].get("budgets", [])]:
            for baseline in BASELINES:
                points = layer_points(record, baseline, budget)
                if points:
                    out[baseline].append((name, record["model"]["name"], usable.get(name, True), budget, points))
    return out


def _kl_verdict(record: dict, baseline: str, budget: str) -> str | None:
    cell = (record["results"].get("fidelity", {}).get("methods", {}).get(baseline) or {}).get(budget) or {}
    comparison = (cell.get("vs_triattention") or {}).get("compressed", {}).get("kl")
    return interval_verdict(comparison, higher_is_better=False)


def concentration_lines(named_records: list[tuple[str, dict]], usable: dict[str, bool], shipped_models: list[str]) -> list[str]:
    """What the figure's data support and do not, each sentence computed from them."""
    data = collect(named_records, usable)
    records = dict(named_records)
    lines = []
    per_layer_fidelity = any(key.endswith("per_layer") for _, record in named_records
                             for values in record["results"].get("fidelity", {}).get("methods", {}).values()
                             for cell in values.values() if cell for key in cell)
    if not per_layer_fidelity:
        lines.append("Per-layer fidelity does not exist in these results: KL and top-1 agreement are measured on the model's "
                     "output, one figure per position for all layers together. The lead plotted is attention recall's "
                     "(share of full attention's mass on the keys a method holds), measured per layer and query head: the "
                     "secondary metric, which need not rank methods as KL does (each run's diagnosis).")
    runs = {(name, model) for entries in data.values() for name, model, *_ in entries}
    if not runs:
        return lines + ["No run on this page holds per-layer recall of TriAttention and R-KV or SnapKV: no figure."]
    models = sorted({model for _, model in runs})
    layers = {model: max(len(points) for entries in data.values() for name, m, _, _, points in entries if m == model)
              for model in models}
    absent = [model for model in shipped_models if model not in models]
    lines.append(f"Data: {sum(layers.values())} layers of {len(models)} models ("
                 + ", ".join(f"{model} {count}" for model, count in layers.items()) + ")"
                 + (f"; {', '.join(absent)} ships traces but has no run on this page, so it is not in the figure" if absent else "")
                 + ". Each point is one layer of one model: a layer's query heads share one statistics-based scoring rule, "
                 "and the layers of one model are not independent of each other.")
    over = sorted({point["over"] for entries in data.values() for *_, points in entries for point in points})
    lines.append("Intervals: 95%, over " + " and ".join({"texts": "resampled texts (paired)",
                                                         "heads": "the layer's query heads (paired per head; these runs kept "
                                                                  "no per-layer resamples of texts, so the interval says how "
                                                                  "consistently the lead holds across the layer's heads, not "
                                                                  "how it would vary on other texts)"}[o] for o in over) + ".")
    all_values = [point["concentration"] for entries in data.values() for *_, points in entries for point in points]
    lines.append(f"Range: the layers' concentration spans {min(all_values):.2f}-{max(all_values):.2f}; below "
                 f"{min(all_values):.2f} no layer of these models was measured, so the data say nothing there.")
    for baseline, entries in data.items():
        for name, model, is_usable, budget, points in entries:
            above = [p for p in points if p["low"] > 0]
            below = [p for p in points if p["high"] < 0]
            rho = _rank_correlation([p["concentration"] for p in points], [p["lead"] for p in points])
            reading = (f"rank correlation of lead with concentration {rho:+.2f}" if len(points) >= MIN_LAYERS and not math.isnan(rho)
                       else f"no rank correlation read from {len(points)} layers (at least {MIN_LAYERS} needed)")
            kl = _kl_verdict(records[name], baseline, budget)
            kl_text = f"; on KL where compression acts TriAttention {kl} `{baseline}` on this run" if kl else ""
            lowest = min(points, key=lambda p: p["concentration"])
            lines.append(f"`{baseline}`, {model} (B={budget}{'' if is_usable else ', superseded run'}): TriAttention's recall "
                         f"lead is above 0 (whole interval) in {len(above)} of {len(points)} layers, below 0 in {len(below)}"
                         + (f" (layers {', '.join(str(p['layer']) for p in below)}, concentration "
                            + ", ".join(format(p["concentration"], ".2f") for p in below) + ")" if below else "")
                         + f"; mean lead {np.mean([p['lead'] for p in points]):+.3f}; at its least concentrated layer "
                           f"({lowest['layer']}, {lowest['concentration']:.2f}) {lowest['lead']:+.3f} "
                           f"[{lowest['low']:+.3f}, {lowest['high']:+.3f}]; {reading}{kl_text}.")
    for baseline, entries in data.items():
        points = [p for *_, is_usable, _, pts in entries for p in pts]
        below = [p for p in points if p["high"] < 0]
        above = [p for p in points if p["low"] > 0]
        if len(below) < 2:
            lines.append(f"Threshold against `{baseline}`: none visible. TriAttention's recall falls wholly below "
                         f"`{baseline}`'s in {len(below)} of {len(points)} layers, too few to place a concentration below "
                         "which it loses.")
        elif above and max(p["concentration"] for p in below) < min(p["concentration"] for p in above):
            cut = (max(p["concentration"] for p in below) + min(p["concentration"] for p in above)) / 2
            lines.append(f"Threshold against `{baseline}`: the {len(below)} layers where TriAttention loses all lie below "
                         f"concentration {cut:.2f}, the {len(above)} where it leads all above it.")
        else:
            overlap = [p for p in above if p["concentration"] <= max(q["concentration"] for q in below)]
            lines.append(f"Threshold against `{baseline}`: none visible. The {len(below)} layers where TriAttention loses "
                         f"lie at concentration {min(p['concentration'] for p in below):.2f}-"
                         f"{max(p['concentration'] for p in below):.2f}, and {len(overlap)} layers where it leads lie at "
                         "or below the highest of them.")
    return lines


def threshold_visible(lines: list[str]) -> bool:
    return any(line.startswith("Threshold against") and "none visible" not in line for line in lines)


def plot(named_records: list[tuple[str, dict]], usable: dict[str, bool], path: Path) -> Path | None:
    """concentration-lead.png: one panel per baseline, one point per (model, layer) with its interval; hollow markers
    for runs whose inputs are not the shipped ones."""
    data = collect(named_records, usable)
    if not any(data.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({model for entries in data.values() for _, model, *_ in entries})
    colours = {model: plt.cm.tab10(index) for index, model in enumerate(models)}
    fig, axes = plt.subplots(1, len(BASELINES), figsize=(5.2 * len(BASELINES), 4.2), squeeze=False, sharey=True)
    for ax, baseline in zip(axes.flat, BASELINES):
        for name, model, is_usable, budget, points in data[baseline]:
            x = [p["concentration"] for p in points]
            y = [p["lead"] for p in points]
            error = [[p["lead"] - p["low"] for p in points], [p["high"] - p["lead"] for p in points]]
            colour = colours[model]
            ax.errorbar(x, y, yerr=error, fmt="o", markersize=4, capsize=1.5, elinewidth=0.8, color=colour,
                        markerfacecolor=colour if is_usable else "white",
                        label=f"{model} B={budget}" + ("" if is_usable else " (superseded run)"))
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel("layer's query concentration (mean R of the statistics)")
        ax.set_title(f"TriAttention recall minus {baseline}", fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].set_ylabel("recall lead per layer [95% interval]")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("TriAttention's per-layer recall lead over attention-based methods against query concentration", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
