"""Project results page from saved analyses: `python -m trikv.analysis.docs RUN/analysis.json ... --out docs/analysis.md`.

Every number on the page is read from the JSON files (nothing typed by hand); a few plots of each run are
copied next to the page so it renders on its own. With `--keep DIR` each run is first copied to DIR (its figures
without the per-band vectors and curves, and the plots the page shows) and the page is rendered from the copies,
so a repository can regenerate it without the run folders. The page opens with the shared header
(`trikv.benchmarks.report_pages.page_header`): what was measured, the main figure, and per model whether
TriAttention's premise holds by the verdict's thresholds.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from ..benchmarks.report_pages import command_line, page_header
from ..models import REGISTRY
from .report import PAPER, _num, _pct, summary_lines, verdict

DEFAULT_TITLE = "Q/K concentration analysis of the bundled models"

NOTES = [
    "## How to read these numbers",
    "",
    "- The mean-logit r correlates the series with the logit averaged over every query position; averaging removes "
    "most token-to-token variation, so wherever the centres carry the mean it comes out near 1. The per-query r "
    "correlates the same series with single queries' own logit curves (a sample of queries per text that see every "
    "distance; the count is in each model's verdict) and is the closer analogue of the paper's Figure 3 (mean > 0.5, mass at 0.6-0.9).",
    "- Sliding-window layers (Gemma3) are judged only at distances inside their window; each layer uses its own RoPE "
    "frequencies (local base 10,000, global base 1,000,000 for Gemma3).",
    "- The weights are the 4-bit GGUF packages dequantised to float32, not the original bf16 checkpoints; the texts "
    "are short (about 2-3K tokens each, distances up to 1,024), far less than the paper's calibration sets.",
    "- Wall times were measured on a 2-core CPU; they show the order of magnitude only.",
    "",
]

PLOTS_FOR_DOCS = ("concentration_heatmap", "reconstruction_hist", "reconstruction_examples", "scatter_pre_post")
# what a kept run leaves out: per text, the per-band vectors and per-distance curves the plots were drawn from (the
# bulk of an analysis.json, megabytes for a 1.5B model); the chosen head's scatter points
UNKEPT = {"concentration": ("q_R", "k_R", "contribution", "q_abs_mean", "k_abs_mean", "q_mean_re", "q_mean_im",
                            "k_mean_re", "k_mean_im"),
          "reconstruction": ("predicted", "real", "valid", "pair_counts")}
UNKEPT_HEAD = ("scatter",)


def _premise_target(result: dict) -> tuple[str, bool]:
    """The verdict's premise check as a target: met where it holds (strong concentration and mean r >= 0.5)."""
    return (f"premise holds on {result['meta']['model_name']} (>= 80% of query heads R > 0.9 weighted, mean r >= 0.5)",
            result["verdict"]["premise"] == "holds")


def _header(results: list[tuple[Path, dict]], command: str, title: str, kept: list[str]) -> list[str]:
    """The page's header: the models measured, their share of concentrated heads and reconstruction r (averages over
    each run's texts, as in the overview), and the premise per model. `kept`: models whose sections an update kept
    from the earlier page; the box does not cover them, and says so."""
    names = [result["meta"]["model_name"] for _, result in results]
    tokens = sum(text["tokens"] for _, result in results for text in result["texts"].values())
    dtypes = ", ".join(sorted({result["meta"].get("dtype", "float32") for _, result in results}))
    measured = (f"pre-RoPE Q/K concentration, reconstruction of distance preferences and stability across texts of "
                f"{', '.join(names)} ({tokens:,} tokens in all, {dtypes} on CPU)")
    if kept:
        measured += f"; the sections of {', '.join(kept)} were kept from the earlier page and are not in this box"
    averages = [(name, _averages(result)) for name, (_, result) in zip(names, results)]
    r_values = [a["r"] for _, a in averages]
    shares = ", ".join(f"{name} {_pct(a['q_w']['share_gt_0.9'])}" for name, a in averages)
    figure = (f"query heads with R > 0.9 (band-weighted): {shares}; r (mean logit) {_num(min(r_values), 2)}"
              + (f"-{_num(max(r_values), 2)}" if len(r_values) > 1 else ""))
    return page_header(title, command, measured, figure, [_premise_target(result) for _, result in results],
                       [result["meta"].get("commit") for _, result in results])


def _averages(result: dict) -> dict:
    """Concentration and reconstruction figures averaged over a run's texts."""
    texts = result["texts"].values()
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    keys = ("share_gt_0.9", "share_gt_0.95", "mean")
    return {"q_w": {k: mean([t["concentration"]["summary"]["q_weighted"][k] for t in texts]) for k in keys},
            "q_p": {k: mean([t["concentration"]["summary"]["q_plain"][k] for t in texts]) for k in keys},
            "r": mean([t["reconstruction"]["summary"]["mean_r"] for t in texts])}


def _overview_row(result: dict) -> str:
    meta = result["meta"]
    texts = result["texts"].values()
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    averages = _averages(result)
    q_w, q_p, r = averages["q_w"], averages["q_p"], averages["r"]
    per_query = [t["reconstruction"].get("per_query_summary", {}).get("mean_r") for t in texts]
    per_query = mean(per_query) if all(v is not None for v in per_query) else None
    pairs = result["stability"]["pairs"]
    corr = min((p["q_head_R_weighted"]["corr"] for p in pairs), default=None)
    diff = max((p["q_head_R_weighted"]["mean_abs_diff"] for p in pairs), default=None)
    tokens = sum(t["tokens"] for t in texts)
    return (
        f"| {meta['model_name']} | {meta['num_layers']}x{meta['num_heads']} | {tokens} "
        f"| {_pct(q_w['share_gt_0.9'])} / {_pct(q_p['share_gt_0.9'])} | {_pct(q_w['share_gt_0.95'])} / {_pct(q_p['share_gt_0.95'])} "
        f"| {_num(q_w['mean'])} / {_num(q_p['mean'])} | {_num(r, 2)} | {_num(per_query, 2)} "
        f"| {_num(corr, 3)} | {_num(diff, 4)} | {meta['wall_s']:.0f} s |"
    )


def kept_fields(result: dict) -> dict:
    """What a run kept beside the page holds: every field of its analysis.json but the per-band vectors, per-distance
    curves and scatter points (`UNKEPT`, `UNKEPT_HEAD`). The page reads none of them (its plots are kept as images),
    and per head the figures stay (R, top bands, reconstruction r), so the page renders from the kept copy as from the
    run."""
    kept = dict(result)
    kept["texts"] = {name: {part: ({key: value for key, value in figures.items() if key not in UNKEPT[part]}
                                   if part in UNKEPT else figures) for part, figures in text.items()}
                     for name, text in result["texts"].items()}
    if "head" in result:
        kept["head"] = {key: value for key, value in result["head"].items() if key not in UNKEPT_HEAD}
    return kept


def keep_runs(json_paths: list[str | Path], folder: str | Path) -> list[Path]:
    """Copy each run into `folder/<model>/`: its analysis.json as `kept_fields` gives it and the plots the page shows.
    Returns the kept analysis.json files sorted by path, the order `folder/*/analysis.json` lists them in (a later run
    of a model given twice replaces the earlier one)."""
    kept = []
    for path in map(Path, json_paths):
        result = json.loads(path.read_text())
        target = Path(folder) / result["meta"]["model_name"].replace("/", "_")
        target.mkdir(parents=True, exist_ok=True)
        for key in PLOTS_FOR_DOCS:
            file = result.get("plots", {}).get(key)
            if file and (path.parent / file).is_file():
                shutil.copyfile(path.parent / file, target / file)
        (target / "analysis.json").write_text(json.dumps(kept_fields(result), allow_nan=False))
        kept.append(target / "analysis.json")
    return sorted(set(kept))


def write_docs(json_paths: list[str | Path], out: str | Path, title: str = DEFAULT_TITLE, update: bool = False) -> Path:
    """Write the page for these runs; with `update`, replace or add only their models in the existing page (the
    header is regenerated for this invocation's runs and names the models whose sections it kept)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    assets = out.with_suffix("")  # docs/analysis.md -> docs/analysis/
    results = []
    for path in json_paths:
        path = Path(path)
        result = json.loads(path.read_text())
        result["verdict"] = verdict(result)
        results.append((path, result))
    command = command_line("python", "-m", "trikv.analysis.docs", *json_paths, "--out", out,
                           *(["--title", title] if title != DEFAULT_TITLE else []), *(["--update"] if update else []))
    names = {result["meta"]["model_name"] for _, result in results}
    earlier = _split(out.read_text())[1] if update and out.exists() else {}
    kept = [name for name in _overview_rows(earlier.get("Overview", [])) if name not in names]
    lines = [
        *_header(results, command, title, kept),
        "Each run's `analysis.json` is read as it is. Each run streams the shipped texts (code, math, prose; see "
        "`src/trikv/data/analysis_texts/README.md`) through the model in float32 on CPU.",
        "",
        "## Overview",
        "",
        "Averages over the texts of each run. R: Mean Resultant Length per head, weighted by band contribution "
        "C_f = E|q_f| E|k_f| (w) or plain mean over bands. r (mean logit): Pearson r between the trigonometric series "
        "from the centres and the real mean logit over log-spaced distances; r (per query): the same against single "
        "queries' own logit curves. Stability: worst pair of texts.",
        "",
        "| model | layers x heads | tokens (all texts) | R>0.9 (w / plain) | R>0.95 (w / plain) | mean R (w / plain) | r (mean logit) | r (per query) | stability: corr of R | stability: mean abs dR | wall time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[_overview_row(result) for _, result in results],
        "",
        f"For comparison, {PAPER}.",
        "",
        *NOTES,
    ]
    for path, result in results:
        meta = result["meta"]
        name = meta["model_name"]
        target = assets / name.replace("/", "_")
        target.mkdir(parents=True, exist_ok=True)
        v = result["verdict"]
        token_counts = ", ".join(f"{k} {t['tokens']} tokens" for k, t in meta["texts"].items())
        entry = REGISTRY.get(name)
        lines += [
            f"## {name}",
            "",
            *([f"Withdrawn: {entry.withdrawn}.", ""] if entry is not None and entry.withdrawn else []),
            f"{meta['model_type']}, {meta['num_layers']} layers x {meta['num_heads']} query heads ({meta['num_kv_heads']} KV heads), "
            f"head_dim {meta['head_dim']}; RoPE: "
            + "; ".join(f"{kind}: omega {info['omega_max']:.3g} .. {info['omega_min_nonzero']:.3g}" for kind, info in meta["rope"].items())
            + (f"; sliding windows {sorted({w for w in meta['sliding_windows'] if w})} on "
               f"{sum(1 for w in meta['sliding_windows'] if w)} of {meta['num_layers']} layers" if any(meta["sliding_windows"]) else "")
            + ".",
            "",
            f"Command: `{meta.get('command') or 'run_analysis(...)'}` - wall time {meta['wall_s']:.0f} s "
            f"(texts: {token_counts}; chunks of {meta['chunk_tokens']}, "
            f"distances 1..{meta['distances'][-1]}).",
            "",
            f"**{v['overall']}**",
            "",
            f"- {v['concentration']}",
            f"- {v['reconstruction']}",
            f"- {v['stability']}",
            "",
            *summary_lines(result),
        ]
        for key in PLOTS_FOR_DOCS:
            file = result.get("plots", {}).get(key)
            if file and (path.parent / file).is_file():
                shutil.copyfile(path.parent / file, target / file)
                lines += [f"![{key.replace('_', ' ')}]({assets.name}/{target.name}/{file})", ""]
    text = "\n".join(lines)
    if update and out.exists():
        text = merge_pages(out.read_text(), text)
    out.write_text(text)
    return out


def _split(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """A page -> (lines before the first '## ' section, {section title: its lines, title line included})."""
    head, sections, current = [], {}, None
    for line in text.split("\n"):
        if line.startswith("## "):
            current = line[3:].strip()
            sections[current] = []
        (head if current is None else sections[current]).append(line)
    return head, sections


def _overview_rows(section: list[str]) -> dict[str, str]:
    """Model name -> its row of the overview table."""
    rows = {}
    for line in section:
        cells = [cell.strip() for cell in line.strip("|").split("|")] if line.startswith("| ") else []
        if cells and cells[0] not in ("model",) and not set(cells[0]) <= set("-"):
            rows[cells[0]] = line
    return rows


def merge_pages(old: str, new: str) -> str:
    """The page `old` with the models of `new` replaced (overview row and section) or added: regenerating one
    model's analysis leaves the sections of the models not rerun as they were generated. The head (title,
    generated line, headline box, introduction) is `new`'s: it says how this page was made."""
    _, old_sections = _split(old)
    new_head, new_sections = _split(new)
    rows = _overview_rows(old_sections.get("Overview", []))
    rows.update(_overview_rows(new_sections.get("Overview", [])))
    overview, placed = [], False
    for line in new_sections["Overview"]:
        if line.startswith("| ") and line.split("|")[1].strip() in rows:
            if not placed:
                overview += list(rows.values())
                placed = True
            continue
        overview.append(line)
    merged = dict(old_sections)
    merged["Overview"] = overview
    for title, section in new_sections.items():
        if title != "Overview":
            merged[title] = section
    return "\n".join(new_head + [line for section in merged.values() for line in section])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trikv.analysis.docs", description=__doc__)
    parser.add_argument("json", nargs="+", help="analysis.json files of `trikv analyze` runs")
    parser.add_argument("--out", default="docs/analysis.md", help="Markdown page to write (plots go to a folder of the same name)")
    parser.add_argument("--title", default=DEFAULT_TITLE, help=f"the page's title (default: {DEFAULT_TITLE})")
    parser.add_argument("--update", action="store_true",
                        help="replace or add only these runs' models in the existing page, keeping the other models' sections")
    parser.add_argument("--keep", metavar="DIR",
                        help="first copy each run to DIR/<model>/ (its analysis.json without the per-band vectors and "
                             "curves, and the plots the page shows), then render the page from those copies: its command "
                             "names them, so the page can be regenerated from DIR (e.g. docs/runs/analysis)")
    args = parser.parse_args(argv)
    paths = keep_runs(args.json, args.keep) if args.keep else args.json
    print(write_docs(paths, args.out, args.title, update=args.update))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
