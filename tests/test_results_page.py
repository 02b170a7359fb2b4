"""The results page's provenance, registered-cell, summary and concentration sections say what the data say."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trikv.benchmarks.quality import concentration, intervals, provenance, traces, validity
from trikv.benchmarks.quality.texts import texts_sha256


# ---- provenance ---------------------------------------------------------------------------------------------
def _trace_row(name, text, valid=True, compression=0.2):
    return {"name": name, "split": "evaluation", "prompt": f"p {name}", "text": text, "tokens": 2100, "seeds": [0],
            "source": "s", "validity": {"tokens": 2100, "compression": compression, "longest_repeat": 10, "repeat_share": 0.01,
                                        "attempts": 1, "rejected": 0, "valid": valid, "masked_compression": 0.2,
                                        "template_share": 0.0, "rule": validity.RULE,
                                        "line_variety": 1.0}}


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    monkeypatch.setattr(traces, "TRACES_DIR", tmp_path)
    rows = [_trace_row("math500-400", "one"), _trace_row("math500-401", "two"), _trace_row("math500-408", "loop", valid=False)]
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def _fidelity_record(fed, wall=600.0, compute=600.0, fingerprint=None):
    meta = {"texts": [row["name"] for row in fed], "traces": "evaluation",
            "trace_validity": {row["name"]: row["validity"] for row in fed}}
    record = {"config": {"model": "tiny", "traces": "evaluation", "texts": [], "budgets": [128], "methods": ["full"]},
              "model": {"name": "tiny"}, "environment": {"threads": 1, "device": "cpu"}, "wall_seconds": wall,
              "compute_seconds": compute, "command": "trikv bench quality --model tiny --out runs/x",
              "results": {"fidelity": {"meta": meta, "methods": {}}}}
    if fingerprint is not None:
        record["fingerprint"] = fingerprint
        record["cells"] = {"fidelity/full/None": {"status": "computed", "fingerprint": fingerprint}}
    return record


def _fingerprint(texts_sha):
    return {"code_sha256": "c" * 64, "commit": {"commit": "a" * 40, "modified": []}, "threads": 2, "dtype": "float32",
            "device": "cpu", "torch": "2.13", "transformers": "5.19", "model_sha256": "m" * 64, "stats_sha256": None,
            "inputs": {"fidelity": {"inputs_sha256": "i" * 64, "texts_sha256": texts_sha}}}


def test_a_run_is_current_only_when_it_fed_the_shipped_texts(shipped):
    fed_now = [traces.Trace(**row).as_text() for row in shipped[:2]]
    current = provenance.run_provenance(_fidelity_record(shipped[:2], fingerprint=_fingerprint(texts_sha256(fed_now))))
    assert current.status == provenance.CURRENT and current.usable and not current.reasons
    assert any("commit `aaaaaaaaaa`, no uncommitted change" in line and "2 thread(s)" in line for line in current.lines)
    other = provenance.run_provenance(_fidelity_record(shipped[:2], fingerprint=_fingerprint("0" * 64)))
    assert other.status == provenance.SUPERSEDED and "not the ones that ship now" in other.reasons[0]
    assert len(other.reasons) == 1 and "--redo-invalid" not in provenance.rerun_line("x", _fidelity_record(shipped[:2]), other)
    # a run that fed a trace the shipped file now judges a loop (the rule changed since): named, and its rerun line
    # says to write that trace again first, with the set's own sampling
    loop_fed = _fidelity_record(shipped, fingerprint=_fingerprint("0" * 64))
    judged_again = provenance.run_provenance(loop_fed)
    assert judged_again.reasons == ["the texts it fed are not the ones that ship now",
                                    "1 of the 3 traces it fed fails the current validity rule (math500-408)"]
    assert judged_again.tag() == ("superseded: the texts it fed are not the ones that ship now; 1 of the 3 traces it fed "
                                  "fails the current validity rule (math500-408); rerun pending")
    line = provenance.rerun_line("x", loop_fed, judged_again)
    assert ("First write the traces that fail the rule again: `python -m trikv.benchmarks.quality.traces --model tiny "
            "--split evaluation --redo-invalid --ship` with the set's own sampling (not recorded) and dtype. Rerun: "
            "`trikv bench quality --model tiny --out runs/x --fresh`") in line


def test_a_run_without_fingerprint_is_unrecorded_at_best(shipped):
    consistent = provenance.run_provenance(_fidelity_record(shipped[:2]))
    assert consistent.status == provenance.UNRECORDED and consistent.checked and consistent.usable
    assert "carry the token count and zlib ratio of the shipped ones" in consistent.lines[-1]
    # it fed the loop the current rule rejects, and reused cells of earlier invocations
    stale = provenance.run_provenance(_fidelity_record(shipped, wall=300.0, compute=900.0))
    assert stale.status == provenance.SUPERSEDED and not stale.usable
    assert stale.reasons == ["1 of the 3 traces it fed fails the current validity rule (math500-408)",
                             "it reused cells computed by earlier invocations whose inputs were not recorded"]
    assert "thread count it records (1) is that invocation's, not the cells'" in " ".join(stale.lines)
    # a trace written again since the run (same name, other text): its recorded figures differ
    rewritten = [shipped[0], {**shipped[1], "validity": {**shipped[1]["validity"], "compression": 0.3}}]
    changed = provenance.run_provenance(_fidelity_record(rewritten))
    assert changed.status == provenance.SUPERSEDED and "1 of the traces it fed differs from the shipped ones (math500-401)" in changed.reasons[0]
    assert "--fresh" in provenance.rerun_line("x", _fidelity_record(rewritten), changed)


def test_the_fed_trace_table_gives_the_shipped_verdict_only_for_the_trace_the_run_fed(shipped):
    """The run fed math500-401 and math500-408 as they were; 401 was written again since (other figures) and 408 still
    ships as fed: the table's "current rule" column judges 408 by the shipped file and says 401 was written again."""
    from trikv.benchmarks.quality.pages.tables import _validity_sections

    fed = [shipped[0], {**shipped[1], "validity": {**shipped[1]["validity"], "compression": 0.3}}, shipped[2]]
    ((title, table),) = _validity_sections(_fidelity_record(fed), markdown=True)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines() if line.startswith("| math500")}
    assert rows["math500-400"][-2] == "yes" and rows["math500-408"][-2] == "**no**"
    assert rows["math500-401"][-2] == "– (written again since)"
    assert "where it still ships the trace the run fed" in title


# ---- registered cells -----------------------------------------------------------------------------------------
def test_every_registered_cell_is_listed_as_run_or_not_run_with_its_cost():
    from trikv.benchmarks.quality.pages.preregistration import registered_cell_lines

    test = {"dataset": "math500", "rows": [[0, 3]], "methods": ["full", "triattention", "rkv"], "budget": 128,
            "secondary_budget": 256, "secondary_budget_note": "after B = 128"}
    problems = [f"math500-{i}" for i in range(4)]
    answers = {problem: 1.0 for problem in problems}
    fingerprint = {"commit": {"commit": "b" * 40}, "threads": 2, "dtype": "bfloat16"}
    record = {"results": {"math": {"math500": {"triattention": {"128": {"by_problem": answers}},
                                               "rkv": {"128": {"by_problem": dict(list(answers.items())[:2])}}}}},
              "cells": {"math-math500/triattention/128": {"status": "computed", "fingerprint": fingerprint}},
              "unit_seconds": {"math-math500/triattention/128": 240.0}, "environment": {"threads": 1},
              "wall_seconds": 250.0, "compute_seconds": 240.0}
    lines = registered_cell_lines(test, record)
    assert lines[1] == "  `full`: not run (compute: about 4 min at the pace of this run's finished cells (60 s per problem))"
    assert lines[2] == "  `triattention` B=128: run, 4 problems (commit `bbbbbbbbbb`, 2 thread(s), bfloat16)"
    assert lines[3] == "  `rkv` B=128: interim, 2 of 4 problems answered"
    assert lines[4].startswith("  `triattention` B=256: not run (after B = 128; about 4 min")
    assert lines[-1] == "  Missing: 3 cells, about 0.2 h of compute at that pace."
    # answers written before cells recorded a fingerprint say so
    del record["cells"]
    lines = registered_cell_lines(test, record)
    assert "  `triattention` B=128: run, 4 problems (commit and thread count not recorded)" in lines
    assert "were not recorded" in lines[-1]


# ---- summary --------------------------------------------------------------------------------------------------
def _cell(kl, diff=None):
    out = {"kl": kl, "top1_agreement": 0.9, "perplexity": 2.0, "perplexity_full": 1.9, "positions": 100,
           "compressed": {"kl": kl, "top1_agreement": 0.9, "perplexity_ratio": 1.05, "positions": 80}}
    if diff is not None:
        out["vs_triattention"] = {"compressed": {"kl": {"difference": diff, "ci": [diff - 0.001, diff + 0.001]}}}
    return out


def test_summary_opens_on_the_published_baselines_and_keeps_variants_apart():
    from trikv.benchmarks.quality.pages.summary import summary_lines
    from trikv.benchmarks.quality.pages.verdicts import method_role

    assert [method_role(m) for m in ("full", "triattention", "triattention-dedup", "rkv-importance-only", "streaming",
                                     "random", "triattention-trig-only")] == [
        "reference", "triattention", "variant", "baseline ablation", "published", "control", "variant"]
    methods = ["full", "triattention", "triattention-shared-layers", "streaming", "rkv", "random"]
    record = {"model": {"name": "tiny"}, "config": {"budgets": [128], "methods": methods},
              "results": {"fidelity": {"meta": {"texts": list("abcdefgh")}, "methods": {
                  "full": {"full": _cell(0.0)}, "triattention": {"128": _cell(0.20)},
                  "triattention-shared-layers": {"128": _cell(0.25, +0.05)},  # its own weakened ablation: not a win
                  "streaming": {"128": _cell(0.15, -0.05)}, "rkv": {"128": _cell(0.18, -0.02)},
                  "random": {"128": _cell(0.40, +0.20)}}}}}  # the control: never a baseline TriAttention "leads"
    lines = summary_lines([("run", record)])
    assert lines[0].startswith("Headline, TriAttention against the 2 published baselines (`streaming`, `rkv`) on KL where "
                               "compression acts: on tiny (B=128) it leads 0, ties 0 and trails 2, ranks 3rd of 5 methods")
    assert ("lower KL: `streaming` 0.1500, `rkv` 0.1800; higher: `triattention-shared-layers`, `random`; 2 of the 2 "
            "published baselines rank above it.") in lines[2]
    variants = next(line for line in lines if line.startswith("TriAttention's own variants and ablations"))
    assert "leads `triattention-shared-layers`" in variants
    assert "shared-layers" not in lines[0] and "shared-layers" not in lines[1]
    controls = next(line for line in lines if line.startswith("Controls (what any eviction at the same budget gives"))
    assert "TriAttention leads `random` +0.2000 [+0.1990, +0.2010]" in controls
    assert "random" not in lines[0] and "random" not in lines[1] and "random" not in variants


# ---- per-layer intervals and the concentration figure ------------------------------------------------------
def test_recall_intervals_per_layer_are_paired_over_texts():
    layers, heads, texts = 3, 2, 6
    rng = np.random.default_rng(0)
    mass = np.ones((texts, layers, heads))
    ours = rng.uniform(0.6, 0.7, (texts, layers, heads))
    theirs = ours.copy()
    theirs[:, 0] -= 0.1  # layer 0: the other method recalls 0.1 less on every text; layers 1-2 equal

    def rows(kept):
        from trikv.benchmarks.quality.fidelity import horizon_labels

        buckets = len(horizon_labels((128,)))
        return {"kept": kept, "mass": mass, "queries": np.ones(texts), "h_kept": np.stack([kept] * buckets, -1),
                "h_mass": np.stack([mass] * buckets, -1)}

    def cell(kept):
        per_layer = (kept.sum(0) / mass.sum(0)).mean(-1)
        return {"recall": float(per_layer.mean()), "recall_per_layer": per_layer.tolist(), "by_horizon": {}}

    table = {"triattention": {"128": cell(ours)}, "rkv": {"128": cell(theirs)}}
    intervals.add_recall_intervals(table, {("triattention", 128): rows(ours), ("rkv", 128): rows(theirs)}, horizons=[128])
    by_layer = table["rkv"]["128"]["vs_triattention"]["by_layer"]
    assert by_layer[0]["difference"] == pytest.approx(-0.1) and by_layer[0]["ci"] == pytest.approx([-0.1, -0.1])
    assert by_layer[1]["ci"] == pytest.approx([0.0, 0.0])
    assert len(table["rkv"]["128"]["ci"]["by_layer"]) == layers


def _recall_record(concentration_per_layer, leads, by_layer=False):
    heads = 4
    ours = [[0.8] * heads for _ in leads]
    theirs = [[0.8 - lead + (0.002 if h % 2 else -0.002) for h in range(heads)] for lead in leads]
    cell = lambda per_head: {"recall": 0.8, "recall_per_layer": [float(np.mean(r)) for r in per_head],  # noqa: E731
                             "recall_per_head": per_head}
    methods = {"triattention": {"128": cell(ours)}, "rkv": {"128": cell(theirs)}, "snapkv": {"128": cell(theirs)}}
    if by_layer:
        for name in ("rkv", "snapkv"):
            methods[name]["128"]["vs_triattention"] = {"by_layer": [{"difference": -lead, "ci": [-lead - 0.01, -lead + 0.01]}
                                                                    for lead in leads]}
    return {"model": {"name": "tiny"}, "config": {"budgets": [128]},
            "results": {"recall": {"meta": {"concentration_per_layer": concentration_per_layer}, "methods": methods}}}


def test_a_concentration_threshold_is_named_only_where_the_data_separate():
    separated = _recall_record([0.4, 0.45, 0.5, 0.7, 0.8, 0.9], [-0.05, -0.04, -0.03, 0.03, 0.04, 0.05])
    lines = concentration.concentration_lines([("run", separated)], {"run": True}, ["tiny"])
    assert "Threshold against `rkv`: the 3 layers where TriAttention loses all lie below concentration 0.60" in " ".join(lines)
    assert concentration.threshold_visible(lines)
    assert any("over the layer's query heads" in line for line in lines)
    mixed = _recall_record([0.4, 0.45, 0.5, 0.7, 0.8, 0.9], [0.03, -0.04, 0.04, -0.03, 0.05, 0.03], by_layer=True)
    lines = concentration.concentration_lines([("run", mixed)], {"run": True}, ["tiny", "other"])
    assert not concentration.threshold_visible(lines)
    assert any(line.startswith("Threshold against `rkv`: none visible.") for line in lines)
    assert any("over resampled texts (paired)" in line for line in lines)
    assert any("other ships traces but has no run on this page" in line for line in lines)
    assert any("Per-layer fidelity does not exist" in line for line in lines)
    points = concentration.layer_points(mixed, "rkv", "128")
    assert [p["lead"] for p in points] == pytest.approx([0.03, -0.04, 0.04, -0.03, 0.05, 0.03])
    assert points[1]["high"] == pytest.approx(-0.03) and points[1]["over"] == "texts"


def test_traces_near_a_threshold_are_named(tmp_path, monkeypatch):
    from trikv.benchmarks.quality.pages.trace_sets import near_threshold_traces
    from trikv.benchmarks.quality.validity import MAX_REPEAT_SHARE, MIN_MASKED_COMPRESSION

    monkeypatch.setattr(traces, "TRACES_DIR", tmp_path)
    rows = [_trace_row("math500-400", "a"), _trace_row("math500-401", "b"), _trace_row("math500-408", "c", valid=False)]
    rows[1]["validity"] |= {"masked_compression": MIN_MASKED_COMPRESSION * 1.05}
    rows[2]["validity"] |= {"repeat_share": MAX_REPEAT_SHARE * 0.95}  # not valid: not named
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert near_threshold_traces() == [f"tiny evaluation math500-401 (masked zlib ratio {MIN_MASKED_COMPRESSION * 1.05:.3f} "
                                       f"against >= {MIN_MASKED_COMPRESSION})"]


# ---- the page's header ----------------------------------------------------------------------------------------
def _math_run(ours: dict, theirs: dict, commit=None) -> dict:
    """A math run of `triattention` and `rkv` at B=128 with these per-problem scores (no model needed)."""
    def cell(by_problem):
        return {"pass@1": sum(by_problem.values()) / len(by_problem), "mean_tokens": 300.0, "problems": len(by_problem),
                "by_problem": by_problem}

    record = {"benchmark": "quality", "command": "trikv bench quality --task math --out runs/quality/held",
              "config": {"methods": ["triattention", "rkv"], "budgets": [128], "divide_length": 128, "seed": 0},
              "model": {"name": "tiny", "sha256_parameters": "p" * 64}, "trikv_version": "0.1",
              "environment": {"torch": "2.13", "transformers": "5.19", "threads": 1, "device": "cpu"},
              "wall_seconds": 600.0, "compute_seconds": 600.0,
              "results": {"math": {"meta": {"datasets": ["math500"], "samples": 1, "max_new_tokens": 64, "temperature": 0},
                                   "math500": {"triattention": {"128": cell(ours)}, "rkv": {"128": cell(theirs)}}}}}
    if commit:
        record["fingerprint"] = _fingerprint("t" * 64) | {"commit": {"commit": commit, "modified": ["src/trikv/x.py"]}}
    return record


def test_results_page_opens_with_its_title_commit_line_and_headline_box(tmp_path):
    """The title, 'Generated by ... from commit ...', and a box whose 'not met' list follows the registered test's
    outcome computed from the run: superior reads met, inferior not met."""
    import re

    from trikv.benchmarks.quality.report import write_report

    problems = [f"math500-{i}" for i in range(40)]
    registration = {"tests": [{"id": "held", "registered": "2026-12-01", "dataset": "math500", "rows": [[0, 39]],
                               "problems": "40", "why_these_rows": "unseen", "setting": "greedy",
                               "methods": ["triattention", "rkv"], "budget": "128",
                               "primary": {"candidate": "triattention", "baseline": "rkv"},
                               "endpoint": "paired difference in pass@1",
                               "reading": {"margin": 0.03}, "reading_addendum": {"added": "2026-12-02", "inferior": "u < -m",
                                                                                 "note": "n"},
                               "power": {"command": "p", "plain_statement": "s"}, "run": "held", "command": "c"}]}
    (tmp_path / "registration.json").write_text(json.dumps(registration))

    def page(ours: float, theirs: float) -> list[str]:
        run = tmp_path / "held"
        run.mkdir(exist_ok=True)
        record = _math_run({q: ours for q in problems}, {q: theirs for q in problems}, commit="f" * 40)
        (run / "results.json").write_text(json.dumps(record))
        out = write_report([run], tmp_path / "results.md", title="Quality of tiny",
                           preregistration=tmp_path / "registration.json")
        return out.read_text().splitlines()

    lines = page(1.0, 0.0)
    assert lines[0] == "# Quality of tiny"
    assert re.fullmatch(r"Generated by `trikv bench report \S+/held --out \S+/results\.md --title 'Quality of tiny' "
                        r"--preregistration \S+/registration\.json` on \d{4}-\d\d-\d\d from commit fffffff \(with uncommitted "
                        r"changes\), as the run files record; do not edit by hand\.", lines[2]), lines[2]
    assert lines[4] == "> - measured: math of 2 KV-cache methods against full attention on tiny, budget 128 (1 run)"
    assert lines[5].startswith("> - main figure: no headline comparison (KL where compression acts")
    assert lines[6] == "> - targets: 1 met, 0 not met"
    assert page(0.0, 1.0)[6] == "> - targets: 0 met, 1 not met: `held`: `triattention` at least non-inferior to `rkv` at B=128"
