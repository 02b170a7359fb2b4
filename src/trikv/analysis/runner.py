"""`run_analysis`: stream texts through a model, compute every figure, write JSON + PNG plots + report."""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path

import torch

from .. import __version__
from ..architectures import shape_metadata
from ..benchmarks.report_pages import repository_commit
from .capture import AnalysisShape, analysis_shape
from .concentration import concentration, concentration_summary, distribution_summary
from .measure import TextStats, log_distances, make_chunks, measure_chunks, sample_head_vectors
from .reconstruction import correlation_summary, distance_mask, pearson, predicted_for_model
from .stability import compare_texts

RESULT_FORMAT = "trikv-analysis/1"


def to_jsonable(value, digits: int = 6):
    """Tensors -> nested lists rounded to `digits` significant digits; nan/inf -> None."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_complex():
            raise TypeError("split complex tensors into real/imag parts before saving")
        if value.dtype in (torch.bool,):
            return value.tolist()
        if not value.is_floating_point():
            return value.tolist()
        return to_jsonable(value.double().tolist(), digits)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: to_jsonable(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v, digits) for v in value]
    return value


def parse_head(head) -> tuple[int, int] | None:
    """None, (layer, head), or a string "L,H" / "L.H" / "L:H"."""
    if head is None:
        return None
    if isinstance(head, str):
        for sep in (",", ".", ":", "/"):
            if sep in head:
                layer, h = head.split(sep, 1)
                return int(layer), int(h)
        raise ValueError(f"head must look like LAYER,HEAD (e.g. 12,3); got {head!r}")
    layer, h = head
    return int(layer), int(h)


def _text_result(shape: AnalysisShape, stats: TextStats, distances: torch.Tensor) -> tuple[dict, dict, torch.Tensor]:
    figures = concentration(stats.q_mean, stats.q_abs_mean, stats.k_mean, stats.k_abs_mean)
    predicted = predicted_for_model(stats.q_mean, stats.k_mean, shape, distances)
    valid = distance_mask(shape, distances, stats.pair_counts)  # [L, nd]
    r = pearson(predicted, stats.real_logits, valid[:, None, :])
    reconstruction_extra = {}
    if stats.query_logits is not None:
        # the harder figure: each sampled single query's own logit curve against the prediction, r averaged over queries
        per_query = pearson(predicted[:, :, None, :], stats.query_logits, valid[:, None, None, :])  # [L, H, nq]
        per_query_r = torch.nanmean(per_query, dim=-1)
        reconstruction_extra = {
            "per_query_summary": correlation_summary(per_query_r),
            "per_query_r": per_query_r,
            "queries_per_head": int(stats.query_logits.shape[2]),
        }
    by_layer_type = {}
    kinds = list(dict.fromkeys(shape.layer_types))
    if len(kinds) > 1:  # hybrid models: global and sliding layers side by side
        for kind in kinds:
            rows = torch.tensor([i for i, k in enumerate(shape.layer_types) if k == kind])
            by_layer_type[kind] = {
                "layers": rows.tolist(),
                "q_weighted": distribution_summary(figures["q_head_R_weighted"][rows]),
                "q_plain": distribution_summary(figures["q_head_R_plain"][rows]),
                "k_weighted": distribution_summary(figures["k_head_R_weighted"][rows]),
                "reconstruction": correlation_summary(r[rows]),
                **({"per_query": correlation_summary(reconstruction_extra["per_query_r"][rows])} if reconstruction_extra else {}),
            }
    result = {
        "tokens": stats.tokens,
        "by_layer_type": by_layer_type,
        "concentration": {
            "summary": concentration_summary(figures),
            **{k: v for k, v in figures.items()},
            "q_abs_mean": stats.q_abs_mean,
            "k_abs_mean": stats.k_abs_mean,
            "q_mean_re": stats.q_mean.real,
            "q_mean_im": stats.q_mean.imag,
            "k_mean_re": stats.k_mean.real,
            "k_mean_im": stats.k_mean.imag,
        },
        "reconstruction": {
            "summary": correlation_summary(r),
            "pearson_r": r,
            "predicted": predicted,
            "real": stats.real_logits,
            "valid": valid,
            "pair_counts": stats.pair_counts,
            **reconstruction_extra,
        },
    }
    return result, figures, r


def _choose_head(figures: dict, r: torch.Tensor) -> tuple[int, int, str]:
    """Best-reconstructed head among the better-concentrated half (weighted R >= median)."""
    weighted = figures["q_head_R_weighted"]
    eligible = (weighted >= weighted.median()) & torch.isfinite(r)
    if not eligible.any():
        flat = int(weighted.flatten().argmax())
        return flat // weighted.shape[1], flat % weighted.shape[1], "the most concentrated head"
    score = torch.where(eligible, r, torch.full_like(r, -2.0))
    flat = int(score.flatten().argmax())
    return flat // r.shape[1], flat % r.shape[1], "best reconstruction among the more concentrated half of the heads"


def _examples(r: torch.Tensor, chosen: tuple[int, int]) -> list[dict]:
    flat = r.flatten()
    order = [int(i) for i in torch.argsort(torch.where(torch.isfinite(flat), flat, torch.full_like(flat, -2.0)), descending=True)]
    order = [i for i in order if math.isfinite(float(flat[i]))]
    H = r.shape[1]
    picks = [("chosen head", chosen[0] * H + chosen[1])]
    if order:
        n = len(order)
        for label, q in (("best", 0.0), ("75th pct", 0.25), ("median", 0.5), ("25th pct", 0.75), ("worst", 1.0)):
            picks.append((label, order[min(n - 1, round(q * (n - 1)))]))
    seen, out = set(), []
    for label, index in picks:
        if index in seen:
            continue
        seen.add(index)
        value = float(flat[index])
        out.append({"label": label, "layer": index // H, "head": index % H, "r": value if math.isfinite(value) else float("nan")})
    return out


def _rope_summary(shape: AnalysisShape) -> dict:
    out = {}
    for kind, geometry in zip(shape.layer_types, shape.geometries):
        if kind in out:
            continue
        rotating = geometry.omega[geometry.omega > 0]
        out[kind] = {
            "omega_max": float(geometry.omega.max()),
            "omega_min_nonzero": float(rotating.min()) if rotating.numel() else 0.0,
            "attention_scaling": geometry.attention_scaling,
            "checksum": geometry.checksum(),
        }
    return out


@torch.no_grad()
def run_analysis(
    model,
    tokenizer,
    texts: dict[str, str],
    out_dir,
    head=None,
    max_tokens: int = 4096,
    progress: bool = True,
    chunk_tokens: int = 2048,
    num_distances: int = 32,
    scatter_tokens: int = 1024,
    scatter_points: int = 256,
    query_samples: int = 128,
    model_name: str | None = None,
    plots: bool = True,
    command: str | None = None,
) -> dict:
    """Analyse `model`'s Q/K concentration and distance preferences on `texts` ({name: text}).

    Each text (its first `max_tokens` tokens) streams through the model in independent chunks of
    `chunk_tokens`; per (layer, head, band) centres and concentration, per head the real mean logit at
    log-spaced distances up to half a chunk and its reconstruction from the centres, and agreement between
    texts; `query_samples` single queries per text also give a per-query reconstruction r. Writes
    `analysis.json`, PNG plots and `report.md` into `out_dir`; returns the JSON dict.
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    if not texts:
        raise ValueError("run_analysis needs at least one text")
    shape = analysis_shape(model)
    was_training = model.training
    model.eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bos = getattr(tokenizer, "bos_token_id", None)

    chunks_by_text: dict[str, list[torch.Tensor]] = {}
    text_meta = {}
    for name, text in texts.items():
        ids = tokenizer(text, add_special_tokens=True)["input_ids"][:max_tokens]
        if len(ids) < 2:
            raise ValueError(f"text {name!r} has fewer than 2 tokens")
        chunks_by_text[name] = make_chunks(list(ids), chunk_tokens, bos)
        text_meta[name] = {"chars": len(text), "tokens": len(ids), "chunks": len(chunks_by_text[name])}
    longest = min(max(int(c.numel()) for c in chunks) for chunks in chunks_by_text.values())
    distances = log_distances(max(1, longest // 2), num_distances)

    stats: dict[str, TextStats] = {}
    total = sum(m["tokens"] + m["chunks"] for m in text_meta.values())
    with tqdm(total=total, desc="analysing", unit="tok", disable=not progress) as bar:
        for name, chunks in chunks_by_text.items():
            bar.set_postfix_str(name)
            t0 = time.perf_counter()
            stats[name] = measure_chunks(model, shape, chunks, distances, bar, query_samples)
            text_meta[name]["wall_s"] = time.perf_counter() - t0

    result_texts, figures, rs = {}, {}, {}
    for name, s in stats.items():
        result_texts[name], figures[name], rs[name] = _text_result(shape, s, distances)

    reference = next(iter(texts))
    chosen = parse_head(head)
    if chosen is None:
        layer, h, why = _choose_head(figures[reference], rs[reference])
    else:
        layer, h = chosen
        if not (0 <= layer < shape.num_layers and 0 <= h < shape.num_heads):
            raise ValueError(f"head {chosen} out of range: {shape.num_layers} layers x {shape.num_heads} heads")
        why = "chosen by the user"
    bands = [int(b) for b in figures[reference]["top_bands"][layer, h]]
    # for contrast, the strongest band that turns at least once over the sampled positions (shows RoPE's arcs)
    span = min(scatter_tokens, max(int(c[0].numel()) for c in chunks_by_text.values())) - 1
    turning = (shape.geometries[layer].omega * span >= 2 * math.pi).nonzero().flatten().tolist()
    turning = [f for f in turning if f not in bands]
    contribution = figures[reference]["contribution"][layer, h]
    contrast = max(turning, key=lambda f: float(contribution[f])) if turning else None
    sample_bands = bands + ([contrast] if contrast is not None else [])
    scatter = {
        name: sample_head_vectors(model, shape, chunks[0][:scatter_tokens], layer, h, sample_bands, scatter_points)
        for name, chunks in chunks_by_text.items()
    }

    def cross(source: str, target: str) -> torch.Tensor:
        """Per-head r of the curve predicted from `source`'s centres against `target`'s real curve."""
        predicted = predicted_for_model(stats[source].q_mean, stats[source].k_mean, shape, distances)
        mask = distance_mask(shape, distances, stats[target].pair_counts)[:, None, :]
        return pearson(predicted, stats[target].real_logits, mask)

    pairs = []
    for a, b in itertools.combinations(stats, 2):
        pairs.append({"a": a, "b": b, **compare_texts(figures[a], figures[b], cross(a, b), cross(b, a), rs[a], rs[b])})

    if was_training:
        model.train()
    config = model.config
    result = {
        "format": RESULT_FORMAT,
        "meta": {
            "model_name": model_name or getattr(model, "trikv_name", None) or getattr(config, "_name_or_path", "?") or "?",
            **shape_metadata(shape),
            "layer_types": shape.layer_types,
            "sliding_windows": shape.sliding_windows,
            "logit_scaling": shape.scaling,
            "rope": _rope_summary(shape),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "max_tokens": max_tokens,
            "chunk_tokens": chunk_tokens,
            "distances": distances.tolist(),
            "texts": text_meta,
            "trikv_version": __version__,
            "command": command,
            "commit": repository_commit(),
        },
        "reference_text": reference,
        "texts": result_texts,
        "head": {"layer": layer, "head": h, "kv_head": h // shape.group_size, "bands": bands, "contrast_band": contrast, "why": why, "scatter": scatter},
        "examples": _examples(rs[reference], (layer, h)),
        "stability": {"pairs": pairs},
    }
    result = to_jsonable(result)
    from .report import verdict, write_report

    result["verdict"] = verdict(result)
    result["meta"]["wall_s"] = round(time.perf_counter() - start, 2)
    plot_files = {}
    if plots:
        from .plots import draw_all

        plot_files = draw_all(result, out_dir)
    result["plots"] = plot_files
    result["meta"]["wall_s"] = round(time.perf_counter() - start, 2)
    (out_dir / "analysis.json").write_text(json.dumps(result, allow_nan=False))
    if plots:
        write_report(result, plot_files, out_dir)
    return result
