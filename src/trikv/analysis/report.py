"""The verdict in plain words, and the Markdown report that embeds the plots."""

from __future__ import annotations

from pathlib import Path

from .stability import stability_verdict

PAPER = "paper (Qwen3-8B): 90.8% of heads R > 0.90, 84.7% R > 0.95; reconstruction mean r > 0.5, mass at 0.6-0.9"


def _pct(x: float) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def _num(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or x != x else f"{x:.{digits}f}"


def verdict(result: dict) -> dict:
    """Plain-words statements about concentration, reconstruction and stability (reference text)."""
    ref = result["texts"][result["reference_text"]]
    conc = ref["concentration"]["summary"]
    w, p = conc["q_weighted"], conc["q_plain"]
    share = w["share_gt_0.9"]
    level = "strong" if share >= 0.8 else "moderate" if share >= 0.3 or w["mean"] >= 0.8 else "weak"
    concentration = (
        f"Q/K concentration is {level}: {_pct(w['share_gt_0.9'])} of query heads have R > 0.9 and "
        f"{_pct(w['share_gt_0.95'])} have R > 0.95 when bands are weighted by their contribution to the logit "
        f"(plain mean over bands: {_pct(p['share_gt_0.9'])} and {_pct(p['share_gt_0.95'])}); mean R is "
        f"{_num(w['mean'])} weighted, {_num(p['mean'])} plain; keys: mean weighted R {_num(conc['k_weighted']['mean'])}."
    )
    rec = ref["reconstruction"]["summary"]
    mean_r = rec["mean_r"]
    quality = "well" if mean_r >= 0.5 else "partly" if mean_r >= 0.3 else "poorly"
    reconstruction = (
        f"The trigonometric series built from the Q/K centres predicts each head's distance preference {quality}: "
        f"mean Pearson r = {_num(mean_r, 2)} (median {_num(rec['median_r'], 2)}) against the real mean logit; "
        f"{_pct(rec['share_r_gt_0.5'])} of heads have r > 0.5 and {_pct(rec['share_r_0.6_0.9'])} lie in 0.6-0.9."
    )
    per_query = ref["reconstruction"].get("per_query_summary")
    if per_query:
        reconstruction += (
            f" Against single queries (each query's own logit curve, r averaged over {ref['reconstruction']['queries_per_head']} "
            f"queries per head) the mean r is {_num(per_query['mean_r'], 2)}, {_pct(per_query['share_r_gt_0.5'])} of heads above 0.5 "
            f"and {_pct(per_query['share_r_0.6_0.9'])} in 0.6-0.9."
        )
    pairs = result["stability"]["pairs"]
    if pairs:
        worst = max(pairs, key=lambda q: q["q_head_R_weighted"]["mean_abs_diff"])
        cross = min(min(q["cross_mean_r_a_to_b"], q["cross_mean_r_b_to_a"]) for q in pairs)
        stability = (
            f"Across texts ({', '.join(result['texts'])}): {stability_verdict(worst)}. Per-head weighted R "
            f"correlates {_num(min(q['q_head_R_weighted']['corr'] for q in pairs), 3)} or better between texts, with mean |dR| at "
            f"most {_num(worst['q_head_R_weighted']['mean_abs_diff'], 3)} ({worst['a']} vs {worst['b']}); centres from one text "
            f"predict another's distance curves with mean r of at least {_num(cross, 2)}."
        )
    else:
        stability = "Only one text was analysed, so stability across calibration data was not measured."
    holds = level == "strong" and mean_r >= 0.5
    partly = level != "weak" or mean_r >= 0.3
    overall = (
        "TriAttention's premise holds for this model: pre-RoPE queries and keys sit near fixed centres and those centres predict which distances each head prefers."
        if holds
        else "TriAttention's premise holds only in part for this model; expect the norm term (1 - R) to carry more of the scoring."
        if partly
        else "TriAttention's premise does not hold for this model: its pre-RoPE vectors are not concentrated enough to predict attention from centres."
    )
    premise = "holds" if holds else "holds in part" if partly else "does not hold"
    return {"overall": overall, "concentration": concentration, "reconstruction": reconstruction, "stability": stability,
            "premise": premise}


def _summary_table(result: dict) -> list[str]:
    lines = [
        "| text | tokens | Q R>0.9 (w / plain) | Q R>0.95 (w / plain) | mean Q R (w / plain) | mean K R (w) | top-2 band share | mean r | median r | r in 0.6-0.9 | per-query mean r | per-query r in 0.6-0.9 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, data in result["texts"].items():
        c = data["concentration"]["summary"]
        r = data["reconstruction"]["summary"]
        pq = data["reconstruction"].get("per_query_summary") or {}
        lines.append(
            f"| {name} | {data['tokens']} | {_pct(c['q_weighted']['share_gt_0.9'])} / {_pct(c['q_plain']['share_gt_0.9'])} "
            f"| {_pct(c['q_weighted']['share_gt_0.95'])} / {_pct(c['q_plain']['share_gt_0.95'])} "
            f"| {_num(c['q_weighted']['mean'])} / {_num(c['q_plain']['mean'])} | {_num(c['k_weighted']['mean'])} "
            f"| {_pct(c['top2_share_mean'])} | {_num(r['mean_r'], 2)} | {_num(r['median_r'], 2)} | {_pct(r['share_r_0.6_0.9'])} "
            f"| {_num(pq.get('mean_r'), 2)} | {_pct(pq.get('share_r_0.6_0.9'))} |"
        )
    return lines


def _stability_table(result: dict) -> list[str]:
    pairs = result["stability"]["pairs"]
    if not pairs:
        return []
    lines = [
        "| A vs B | corr of weighted R | mean abs dR (w) | corr of plain R | mean abs dR (plain) | same top band | corr of r | r: own A / own B | r: A->B / B->A |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for q in pairs:
        lines.append(
            f"| {q['a']} vs {q['b']} | {_num(q['q_head_R_weighted']['corr'])} | {_num(q['q_head_R_weighted']['mean_abs_diff'], 4)} "
            f"| {_num(q['q_head_R_plain']['corr'])} | {_num(q['q_head_R_plain']['mean_abs_diff'], 4)} | {_pct(q['same_top1_band'])} "
            f"| {_num(q['reconstruction_r_corr'], 2)} | {_num(q['own_mean_r_a'], 2)} / {_num(q['own_mean_r_b'], 2)} "
            f"| {_num(q['cross_mean_r_a_to_b'], 2)} / {_num(q['cross_mean_r_b_to_a'], 2)} |"
        )
    return lines


def _layer_type_table(result: dict) -> list[str]:
    """Hybrid models: concentration and reconstruction of the full-attention and sliding-window layers apart."""
    rows = [(name, kind, figures) for name, data in result["texts"].items() for kind, figures in data.get("by_layer_type", {}).items()]
    if not rows:
        return []
    lines = [
        "| text | layer type | layers | Q R>0.9 (w / plain) | mean Q R (w / plain) | mean K R (w) | mean r | r > 0.5 | per-query mean r |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, kind, f in rows:
        lines.append(
            f"| {name} | {kind} | {len(f['layers'])} | {_pct(f['q_weighted']['share_gt_0.9'])} / {_pct(f['q_plain']['share_gt_0.9'])} "
            f"| {_num(f['q_weighted']['mean'])} / {_num(f['q_plain']['mean'])} | {_num(f['k_weighted']['mean'])} "
            f"| {_num(f['reconstruction']['mean_r'], 2)} | {_pct(f['reconstruction']['share_r_gt_0.5'])} "
            f"| {_num((f.get('per_query') or {}).get('mean_r'), 2)} |"
        )
    return lines


def summary_lines(result: dict) -> list[str]:
    """The tables shared by the per-run report and the project docs."""
    by_type = _layer_type_table(result)
    return ["**Per text**", "", *_summary_table(result), "",
            *(["**Full-attention vs sliding-window layers** (sliding layers judged at distances inside their window)", "",
               *by_type, ""] if by_type else []),
            *(["**Stability across texts**", "", *_stability_table(result), ""] if result["stability"]["pairs"] else [])]


def write_report(result: dict, plots: dict[str, str], out_dir: str | Path) -> Path:
    meta = result["meta"]
    v = result["verdict"]
    head = result["head"]
    sliding = sum(1 for w in meta["sliding_windows"] if w)
    texts = ", ".join(f"{name} ({data['tokens']} tokens)" for name, data in result["texts"].items())
    lines = [
        f"# Q/K concentration analysis: {meta['model_name']}",
        "",
        f"{meta['model_type']}, {meta['num_layers']} layers x {meta['num_heads']} query heads ({meta['num_kv_heads']} KV heads), "
        f"head_dim {meta['head_dim']}, {meta['layout']} band layout"
        + (f"; {sliding} sliding-window layers (their reconstruction uses distances inside the window only)" if sliding else "")
        + f". Texts: {texts}; "
        f"chunks of {meta['chunk_tokens']} tokens; {len(meta['distances'])} log-spaced distances 1..{meta['distances'][-1]}. "
        f"Wall time {meta['wall_s']:.1f} s.",
        "",
        "## Verdict",
        "",
        f"**{v['overall']}**",
        "",
        f"- {v['concentration']}",
        f"- {v['reconstruction']}",
        f"- {v['stability']}",
        "",
        f"For comparison, {PAPER}. R is the Mean Resultant Length |E q_f| / E|q_f| per band; per head it is averaged over "
        "bands either plainly or weighted by the band contribution C_f = E|q_f| E|k_f|.",
        "",
        "## Numbers",
        "",
        *summary_lines(result),
        "## 1. Concentration",
        "",
        f"![concentration heatmap]({plots['concentration_heatmap']})",
        "",
        f"![concentration histogram]({plots['concentration_hist']})",
        "",
        "## 2. Dominant bands",
        "",
        f"Head shown: layer {head['layer']}, head {head['head']} ({head['why']}); dominant bands {head['bands']} by C_f. "
        "Pre-RoPE (left), Q and K of every text sit in clusters around their centres; after RoPE (right) each vector "
        "is rotated by its position, so a band spreads along an arc as far as it turns over the sampled positions "
        "(dominant bands are often slow and barely turn; the last row is a fast band for contrast).",
        "",
        f"![band contributions]({plots['band_contribution']})",
        "",
        f"![pre- vs post-RoPE scatter]({plots['scatter_pre_post']})",
        "",
        "## 3. Reconstruction of distance preferences",
        "",
        "Predicted: logit(D) = scale * sum_f |E q_f| |E k_f| cos(w_f D + phi_f) from the centres of the same text; "
        "real: mean of the model's own scaled post-RoPE q(t) . k(t - D) over all t of every chunk. Averaging over t "
        "removes most token-to-token variation, so this r is an upper view; the per-query r (dashed) correlates the "
        "prediction with single queries' own logit curves and is the harder test.",
        "",
        f"![reconstruction histogram]({plots['reconstruction_hist']})",
        "",
        f"![example curves]({plots['reconstruction_examples']})",
        "",
    ]
    if "stability" in plots:
        lines += ["## 4. Stability across texts", "", f"![stability]({plots['stability']})", ""]
    lines += ["All numbers are in `analysis.json` in this folder.", ""]
    path = Path(out_dir) / "report.md"
    path.write_text("\n".join(lines))
    return path


def rerender(out_dir: str | Path) -> Path:
    """Recompute the verdict, redraw the plots and rewrite report.md from a saved `analysis.json`."""
    import json

    from .plots import draw_all

    out_dir = Path(out_dir)
    path = out_dir / "analysis.json"
    result = json.loads(path.read_text())
    result["verdict"] = verdict(result)
    result["plots"] = draw_all(result, out_dir)
    path.write_text(json.dumps(result, allow_nan=False))
    return write_report(result, result["plots"], out_dir)


if __name__ == "__main__":  # python -m trikv.analysis.report RUN_DIR ...
    import sys

    for folder in sys.argv[1:]:
        print(rerender(folder))
