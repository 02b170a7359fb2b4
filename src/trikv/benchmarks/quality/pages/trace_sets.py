"""What the page says about the reasoning-trace sets: the validity of every shipped set, the valid traces near
a threshold of the rule, the runs left out of the summary because their model's set fails the rule, and how a
run's traces were sampled.
"""

from __future__ import annotations

from .cells import render


def trace_set_left_out(record: dict) -> str | None:
    """Why a run on reasoning traces stays out of the summary (its model wrote too few valid traces), or None."""
    from ..validity import MIN_VALID_SHARE

    validity = record["results"].get("fidelity", {}).get("meta", {}).get("trace_validity")
    if not validity:
        return None
    valid = sum(1 for figures in validity.values() if figures and figures["valid"])
    if valid >= MIN_VALID_SHARE * len(validity):
        return None
    return (f"only {valid} of its {len(validity)} traces pass the validity rule (at least {MIN_VALID_SHARE:.0%} needed): "
            "the model cannot write valid reasoning traces under the rule, so its figures are shown below but enter no verdict")


def trace_sampling(record: dict) -> str | None:
    """How the traces a run fed were sampled, read from the shipped trace file ('T 0.6, top-p 0.95', ...)."""
    from ..traces import load_traces, sampling_label

    config = record.get("config", {})
    if not config.get("traces"):
        return None
    try:
        traces = load_traces(config["model"], config["traces"])
    except (FileNotFoundError, ValueError):
        return None
    labels = sorted({sampling_label(trace.sampling_settings()) for trace in traces})
    return " / ".join(labels)


def shipped_trace_validity(markdown: bool = True) -> str | None:
    """Validity of every trace set trikv ships (one row per model and split), computed from the files' own
    `validity` figures, so a set a page runs no fidelity on still shows whether it could enter the headline: the
    ranges of the rule's figures (masked zlib ratio, longest masked repeat), the line-template share reported beside
    them, the traces that fail, and how the set was sampled."""
    from ..traces import SPLITS, TRACES_DIR, load_traces, sampling_label
    from ..validity import Validity, judged_by_this_rule, set_is_usable

    rows = []
    span = lambda values, form: f"{form(min(values))}-{form(max(values))}" if values else "n/a"  # noqa: E731
    for path in sorted(TRACES_DIR.glob("*.jsonl")):
        for split in SPLITS:
            try:
                traces = load_traces(path.stem, split)
            except ValueError:  # the model ships no traces in this split
                continue
            figures = [trace.validity for trace in traces if trace.validity]
            sampling = " / ".join(sorted({sampling_label(trace.sampling_settings()) for trace in traces}))
            if not figures:
                rows.append([path.stem, split, f"?/{len(traces)}", "n/a", "n/a", "n/a", "–", "n/a", "n/a", sampling,
                             "no (written before the rule)"])
                continue
            valid = sum(1 for f in figures if f["valid"])
            usable = len(figures) == len(traces) and set_is_usable([Validity(**f) for f in figures])
            judged = all(judged_by_this_rule(f) for f in figures)
            masked = [f["masked_compression"] for f in figures if f.get("masked_compression") is not None]
            templates = [100 * f["template_share"] for f in figures if f.get("template_share") is not None]
            repeat = [100 * f["repeat_share"] for f in figures]
            failing = [trace.name for trace in traces if not trace.valid]
            rows.append([path.stem, split, f"{valid}/{len(traces)}" + ("" if judged else " (earlier rule)"),
                         span(masked, lambda v: f"{v:.3f}"), span(repeat, lambda v: f"{v:.1f}%"),
                         span(templates, lambda v: f"{v:.0f}%"), ", ".join(failing) or "–",
                         sum(f["attempts"] for f in figures), sum(f["rejected"] for f in figures), sampling,
                         ("yes" if usable and judged else "**no**") if split == "evaluation" else "design only (never in a headline)"])
    if not rows:
        return None
    return render(["model", "split", "valid", "masked zlib ratio", "longest masked repeat",
                   "repeated line templates (not in the rule)", "not valid", "answers glued", "rejected as loops",
                   "sampling", "enters the headline"], rows, markdown)


def near_threshold_traces(margin: float = 0.1) -> list[str]:
    """Valid shipped traces whose figures lie within `margin` (relative) of a threshold of the current rule: where
    the rule's verdict hangs on a small difference, named so a reader can look at them."""
    from ..traces import SPLITS, TRACES_DIR, load_traces
    from ..validity import MAX_REPEAT_SHARE, MIN_MASKED_COMPRESSION, judged_by_this_rule

    near = []
    for path in sorted(TRACES_DIR.glob("*.jsonl")):
        for split in SPLITS:
            try:
                traces = load_traces(path.stem, split)
            except ValueError:
                continue
            for trace in traces:
                figures = trace.validity
                if not trace.valid or not judged_by_this_rule(figures):
                    continue
                if figures["masked_compression"] < (1 + margin) * MIN_MASKED_COMPRESSION:
                    near.append(f"{path.stem} {split} {trace.name} (masked zlib ratio {figures['masked_compression']:.3f} "
                                f"against >= {MIN_MASKED_COMPRESSION})")
                if figures["repeat_share"] > (1 - margin) * MAX_REPEAT_SHARE:
                    near.append(f"{path.stem} {split} {trace.name} (longest masked repeat {figures['repeat_share']:.1%} "
                                f"against <= {MAX_REPEAT_SHARE:.1%})")
    return near
