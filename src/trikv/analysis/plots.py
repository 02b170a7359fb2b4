"""PNG figures of an analysis, drawn from its JSON result (so they can be redrawn from a saved file).

Matplotlib runs on the Agg backend; every function writes one file and returns its name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _arr(x) -> np.ndarray:
    return np.array(x, dtype=float)


COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def concentration_heatmap(result: dict, out_dir: Path) -> str:
    plt = _plt()
    ref = result["texts"][result["reference_text"]]["concentration"]
    panels = [("Q, plain mean over bands", ref["q_head_R_plain"]), ("Q, weighted by C_f", ref["q_head_R_weighted"]), ("K (per KV head), weighted", ref["k_head_R_weighted"])]
    L = len(ref["q_head_R_plain"])
    fig, axes = plt.subplots(1, 3, figsize=(13, max(3.5, 0.22 * L + 1.5)), gridspec_kw={"width_ratios": [3, 3, 1.4]}, layout="constrained")
    for ax, (title, values) in zip(axes, panels):
        image = ax.imshow(_arr(values), aspect="auto", vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    fig.colorbar(image, ax=axes, shrink=0.9, label="Mean Resultant Length R")
    fig.suptitle(f"Q/K concentration per head - {result['meta']['model_name']} ({result['reference_text']})")
    name = "concentration_heatmap.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def concentration_histogram(result: dict, out_dir: Path) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    bins = np.linspace(0, 1, 41)
    for ax, key, title in ((axes[0], "q_head_R_plain", "per-head R, plain mean over bands"), (axes[1], "q_head_R_weighted", "per-head R, weighted by C_f")):
        for i, (text, data) in enumerate(result["texts"].items()):
            values = _arr(data["concentration"][key]).ravel()
            ax.hist(values, bins=bins, histtype="step", linewidth=1.6, color=COLORS[i % len(COLORS)], label=f"{text} (mean {np.nanmean(values):.3f})")
        for threshold in (0.9, 0.95):
            ax.axvline(threshold, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"Q {title}", fontsize=10)
        ax.set_xlabel("R")
        ax.set_ylabel("heads")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    name = "concentration_hist.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def band_contribution(result: dict, out_dir: Path) -> str:
    plt = _plt()
    head = result["head"]
    ref = result["texts"][result["reference_text"]]["concentration"]
    C = _arr(ref["contribution"][head["layer"]][head["head"]])
    R = _arr(ref["q_R"][head["layer"]][head["head"]])
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    ax = axes[0]
    bands = np.arange(len(C))
    ax.bar(bands, C / C.sum(), color="tab:blue", alpha=0.7, label="C_f share")
    for b in head["bands"]:
        ax.bar([b], [C[b] / C.sum()], color="tab:red")
    ax.set_xlabel("frequency band f (0 = fastest rotation)")
    ax.set_ylabel("share of sum C_f")
    twin = ax.twinx()
    twin.plot(bands, R, color="black", marker=".", linewidth=1, label="R_f (Q)")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("R_f")
    ax.set_title(f"layer {head['layer']} head {head['head']}: band contributions (red: top-2) and concentration", fontsize=10)
    share = _arr(ref["top2_share"]).ravel()
    axes[1].hist(share, bins=np.linspace(0, 1, 26), color="tab:blue", alpha=0.8)
    axes[1].set_xlabel("share of sum C_f held by the top-2 bands")
    axes[1].set_ylabel("heads")
    axes[1].set_title(f"dominance of the top-2 bands (mean {np.mean(share):.2f})", fontsize=10)
    fig.tight_layout()
    name = "band_contribution.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def scatter_pre_post(result: dict, out_dir: Path) -> str:
    """Figure 2A/2B: q and k of one head in its dominant bands, pre-RoPE (clusters) and post-RoPE (arcs)."""
    plt = _plt()
    head = result["head"]
    bands = list(head["bands"]) + ([head["contrast_band"]] if head.get("contrast_band") is not None else [])
    fig, axes = plt.subplots(len(bands), 2, figsize=(10, 4.4 * len(bands)), squeeze=False)
    for row, band in enumerate(bands):
        for col, stage in enumerate(("pre", "post")):
            ax = axes[row][col]
            for i, (text, sample) in enumerate(head["scatter"].items()):
                color = COLORS[i % len(COLORS)]
                q = _arr(sample[f"q_{stage}"][row])
                k = _arr(sample[f"k_{stage}"][row])
                ax.scatter(q[:, 0], q[:, 1], s=7, color=color, alpha=0.55, marker="o", label=f"Q {text}")
                ax.scatter(k[:, 0], k[:, 1], s=9, color=color, alpha=0.55, marker="x", label=f"K {text}")
            ax.axhline(0, color="grey", linewidth=0.5)
            ax.axvline(0, color="grey", linewidth=0.5)
            ax.set_aspect("equal", adjustable="datalim")
            ax.set_xlabel("Re")
            ax.set_ylabel("Im")
            which = "pre-RoPE (A)" if stage == "pre" else "post-RoPE (B)"
            kind = f"dominant band {band}" if row < len(head["bands"]) else f"band {band} (fast, for contrast)"
            ax.set_title(f"{which}, {kind}", fontsize=10)
            if row == 0 and col == 0:
                ax.legend(fontsize=7, markerscale=1.5)
    fig.suptitle(f"layer {head['layer']} head {head['head']} (KV head {head['kv_head']}): Q (o) and K (x), "
                 f"{len(next(iter(head['scatter'].values()))['positions'])} positions per text")
    fig.tight_layout()
    name = "scatter_pre_post.png"
    fig.savefig(out_dir / name, dpi=80)
    plt.close(fig)
    return name


def reconstruction_histogram(result: dict, out_dir: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bins = np.linspace(-1, 1, 41)
    for i, (text, data) in enumerate(result["texts"].items()):
        r = _arr(data["reconstruction"]["pearson_r"]).ravel()
        r = r[np.isfinite(r)]
        ax.hist(r, bins=bins, histtype="step", linewidth=1.6, color=COLORS[i % len(COLORS)], label=f"{text}: mean logit (mean r {r.mean():.2f})")
        if data["reconstruction"].get("per_query_r") is not None:
            pq = _arr(data["reconstruction"]["per_query_r"]).ravel()
            pq = pq[np.isfinite(pq)]
            ax.hist(pq, bins=bins, histtype="step", linestyle="--", linewidth=1.2, color=COLORS[i % len(COLORS)], label=f"{text}: single queries (mean r {pq.mean():.2f})")
    ax.axvspan(0.6, 0.9, color="grey", alpha=0.12, label="paper: mass at 0.6-0.9")
    ax.axvline(0.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("Pearson r (predicted vs real mean logit over log-spaced distances)")
    ax.set_ylabel("heads")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("reconstruction of distance preferences from Q/K centres", fontsize=10)
    fig.tight_layout()
    name = "reconstruction_hist.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def reconstruction_examples(result: dict, out_dir: Path) -> str:
    plt = _plt()
    ref = result["texts"][result["reference_text"]]["reconstruction"]
    distances = _arr(result["meta"]["distances"])
    examples = result["examples"]
    cols = 3
    rows = (len(examples) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(13, 3.3 * rows), squeeze=False)
    for ax, example in zip(axes.ravel(), examples):
        layer, head = example["layer"], example["head"]
        valid = np.array(ref["valid"][layer], dtype=bool)
        real = _arr(ref["real"][layer][head])
        pred = _arr(ref["predicted"][layer][head])
        ax.plot(distances[valid], real[valid], "o-", color="black", markersize=3, linewidth=1.2, label="real mean logit")
        ax.plot(distances[valid], pred[valid], "s--", color="tab:red", markersize=3, linewidth=1.2, label="trig. series from centres")
        ax.set_xscale("log")
        ax.set_title(f"{example['label']}: L{layer} H{head}, r = {example['r']:.2f}", fontsize=9)
        ax.set_xlabel("Q-K distance")
    for ax in axes.ravel()[len(examples):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"distance preference curves ({result['reference_text']})")
    fig.tight_layout()
    name = "reconstruction_examples.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def stability_scatter(result: dict, out_dir: Path) -> str | None:
    plt = _plt()
    pairs = result["stability"]["pairs"]
    if not pairs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
    for i, pair in enumerate(pairs):
        a, b = result["texts"][pair["a"]], result["texts"][pair["b"]]
        color = COLORS[i % len(COLORS)]
        ra = _arr(a["concentration"]["q_head_R_weighted"]).ravel()
        rb = _arr(b["concentration"]["q_head_R_weighted"]).ravel()
        axes[0].scatter(ra, rb, s=8, alpha=0.6, color=color, label=f"{pair['a']} vs {pair['b']}")
        pa = _arr(a["reconstruction"]["pearson_r"]).ravel()
        pb = _arr(b["reconstruction"]["pearson_r"]).ravel()
        axes[1].scatter(pa, pb, s=8, alpha=0.6, color=color, label=f"{pair['a']} vs {pair['b']}")
    axes[0].plot([0, 1], [0, 1], color="grey", linewidth=0.8)
    axes[0].set_xlabel("per-head weighted R, text A")
    axes[0].set_ylabel("text B")
    axes[0].set_title("concentration across texts", fontsize=10)
    axes[1].plot([-1, 1], [-1, 1], color="grey", linewidth=0.8)
    axes[1].set_xlabel("per-head reconstruction r, text A")
    axes[1].set_ylabel("text B")
    axes[1].set_title("reconstruction across texts", fontsize=10)
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    name = "stability.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def draw_all(result: dict, out_dir: str | Path) -> dict[str, str]:
    """Draw every figure into `out_dir`; returns {figure key: file name}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "concentration_heatmap": concentration_heatmap(result, out_dir),
        "concentration_hist": concentration_histogram(result, out_dir),
        "band_contribution": band_contribution(result, out_dir),
        "scatter_pre_post": scatter_pre_post(result, out_dir),
        "reconstruction_hist": reconstruction_histogram(result, out_dir),
        "reconstruction_examples": reconstruction_examples(result, out_dir),
    }
    stability = stability_scatter(result, out_dir)
    if stability:
        files["stability"] = stability
    return files
