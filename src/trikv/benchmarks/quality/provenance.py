"""Whether a run on the results page was produced from what trikv ships now, and what is still to run.

A run made since cells record a fingerprint (`runner.UnitStore`) is *current* when the texts it fed are the ones
that ship now (`texts.texts_sha256` of the shipped human texts and of the traces the validity rule lets through),
its statistics are the shipped ones and every cell recorded a fingerprint. A run made before (no fingerprint) is
*unrecorded* at best: its code commit and the thread count and text of each cell were not kept, and the page says
so; it is told apart from a *superseded* one by what it did record: a fidelity run computed in one invocation
whose fed traces carry the same token count and zlib ratio (to the last digit) as the shipped ones, and the same
statistics. Anything else (other texts, traces the current rule rejects, cells reused from earlier invocations
whose inputs were not recorded, other statistics) supersedes it: its tables stay on the page, labelled, and its
rerun is listed with the compute it took.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .hashing import file_sha256

CURRENT, UNRECORDED, SUPERSEDED = "current", "unrecorded", "superseded"


@dataclass
class Provenance:
    status: str
    lines: list[str] = field(default_factory=list)  # what the page says about the run's fingerprint
    reasons: list[str] = field(default_factory=list)  # why it is not current
    checked: bool = False  # whether its inputs could be set against the shipped ones

    @property
    def usable(self) -> bool:
        """Whether its figures stand for what ships now (current, or unrecorded but consistent with it)."""
        return self.status != SUPERSEDED

    def tag(self) -> str:
        if self.status == CURRENT:
            return "fingerprint matches the shipped inputs"
        if self.status == UNRECORDED:
            return ("fingerprint not recorded, its recorded inputs consistent with the shipped ones" if self.checked
                    else "fingerprint not recorded")
        return f"superseded: {'; '.join(self.reasons)}; rerun pending"


def shipped_fidelity_inputs(record: dict) -> dict | None:
    """What a fidelity run with this configuration would feed now: {"texts_sha256", "traces": {name: Trace fed},
    "all_traces": {name: Trace}}; None when the run read its own text files (their content is not kept here)."""
    from .texts import load_texts, texts_sha256
    from .traces import load_traces

    config = record["config"]
    if config.get("text_files"):
        return None
    shipped = {text.name: text for text in load_texts()}
    human = [shipped[name] for name in config.get("texts") or [] if name in shipped]
    every, fed = {}, {}
    if config.get("traces"):
        try:
            every = {trace.name: trace for trace in load_traces(config["model"], config["traces"])}
        except (FileNotFoundError, ValueError):
            return None
        fed = {name: trace for name, trace in every.items() if trace.valid or trace.validity is None}
    return {"texts_sha256": texts_sha256(human + [trace.as_text() for trace in fed.values()]), "traces": fed,
            "all_traces": every}


def stats_match(record: dict) -> bool | None:
    """Whether the run's statistics file is the one trikv ships for its model (None: not a shipped file, or none)."""
    recorded = (record.get("stats") or {}).get("sha256")
    if not recorded or record["config"].get("stats"):
        return None
    try:
        from ...calibration import bundled_stats_path

        path = bundled_stats_path(record["config"]["model"])
    except Exception:  # a model without shipped statistics
        return None
    return Path(path).is_file() and file_sha256(path) == recorded


def one_invocation(record: dict) -> bool:
    """Whether the invocation that wrote results.json computed every cell (its wall time covers their compute)."""
    wall = record.get("wall_seconds")
    if wall is None:  # a record without timings says nothing to the contrary
        return True
    return record.get("compute_seconds", wall) <= wall + 3.0


def _code_line(fingerprint: dict) -> str:
    commit = fingerprint.get("commit")
    if commit:
        modified = commit.get("modified") or []
        where = (f"commit `{commit['commit'][:10]}`" + (f" plus uncommitted changes to {', '.join(f'`{m}`' for m in modified)}"
                                                           if modified else ", no uncommitted change to it"))
    else:
        where = "no git commit"
    return f"code sha256 `{fingerprint['code_sha256'][:12]}` ({where})"


def run_provenance(record: dict) -> Provenance:
    """The run's fingerprint as the page states it, and whether its figures stand for the shipped inputs."""
    fingerprint = record.get("fingerprint")
    results = record["results"]
    lines, reasons = [], []
    unrecorded = checked = False
    stats = stats_match(record)
    if stats is False:
        reasons.append("its statistics are not the ones that ship now")
    shipped = shipped_fidelity_inputs(record) if "fidelity" in results else None
    if fingerprint:
        cells = record.get("cells") or {}
        counts: dict[str, int] = {}
        for cell in cells.values():
            counts[cell["status"]] = counts.get(cell["status"], 0) + 1
        lines.append(f"fingerprint: {_code_line(fingerprint)}; {fingerprint['threads']} thread(s), {fingerprint['dtype']} on "
                     f"{fingerprint['device']}, torch {fingerprint['torch']}, transformers {fingerprint['transformers']}; "
                     f"model parameters `{fingerprint['model_sha256'][:12]}`, statistics "
                     f"`{(fingerprint.get('stats_sha256') or 'none')[:12]}`; cells: "
                     + ", ".join(f"{count} {status}" for status, count in sorted(counts.items())))
        if any(cell["status"] == "reused, fingerprint not recorded" or (cell.get("fingerprint") or {}).get("includes_unrecorded")
               for cell in cells.values()):
            unrecorded = True
            lines.append("some of its cells were written before cells recorded a fingerprint (reused with "
                         "`--reuse-unrecorded`): their code commit, thread count and inputs were not kept")
        if shipped is not None:
            fed = (fingerprint.get("inputs") or {}).get("fidelity", {}).get("texts_sha256")
            checked = True
            if fed == shipped["texts_sha256"]:
                lines.append(f"the texts it fed are the ones that ship now (sha256 `{fed[:12]}`)")
            else:
                reasons.append("the texts it fed are not the ones that ship now")
                rejected = _rejected_now(results, shipped)
                if rejected:  # the shipped files judge some of the fed traces again: say which
                    reasons.append(rejected)
    else:
        unrecorded = True
        lines.append("fingerprint: not recorded (made before cells recorded one): the code commit, and the thread count "
                     "and inputs of each cell, were not kept")
        reused = not one_invocation(record)
        if reused:
            compute, wall = record.get("compute_seconds", 0) / 60, record["wall_seconds"] / 60
            lines.append(f"the invocation that wrote results.json computed {wall:.1f} of its {compute:.1f} min: the thread "
                         f"count it records ({record['environment']['threads']}) is that invocation's, not the cells'")
        if shipped is not None and shipped["all_traces"]:
            validity = results["fidelity"]["meta"].get("trace_validity") or {}
            fed = [name for name in results["fidelity"]["meta"]["texts"] if name in validity]
            rejected = _rejected_now(results, shipped)
            if rejected:
                reasons.append(rejected)
            missing = [name for name in shipped["traces"] if name not in fed]
            if missing:
                reasons.append(f"it did not feed {len(missing)} trace(s) that ship now ({', '.join(missing)})")
            differing = [name for name in fed if name in shipped["traces"] and not same_trace_figures(validity[name], shipped["traces"][name].validity)]
            if differing:
                reasons.append(f"{len(differing)} of the traces it fed {'differs' if len(differing) == 1 else 'differ'} from "
                               f"the shipped ones ({', '.join(differing)})")
            checked = not (rejected or missing or differing)
            if checked:
                lines.append(f"the {len(fed)} traces it fed carry the token count and zlib ratio of the shipped ones to the "
                             "last digit: consistent with the same text, not proof of it")
        if reused and "fidelity" in results:  # after what the inputs say: whatever they say, these cells cannot be told
            reasons.append("it reused cells computed by earlier invocations whose inputs were not recorded")
    if stats:
        lines.append("its statistics are the shipped file (sha256 equal)")
    status = SUPERSEDED if reasons else UNRECORDED if unrecorded else CURRENT
    return Provenance(status, lines, reasons, checked)


def _rejected_now(results: dict, shipped: dict) -> str | None:
    """'k of the n traces it fed fail the current validity rule (names)', or None when every fed trace passes it."""
    validity = results["fidelity"]["meta"].get("trace_validity") or {}
    fed = [name for name in results["fidelity"]["meta"]["texts"] if name in validity]
    rejected = [name for name in fed if name in shipped["all_traces"] and name not in shipped["traces"]]
    if not rejected:
        return None
    return (f"{len(rejected)} of the {len(fed)} traces it fed {'fails' if len(rejected) == 1 else 'fail'} the current "
            f"validity rule ({', '.join(rejected)})")


def _set_sampling(model: str, split: str) -> str:
    """How a shipped trace set was sampled, as the page labels it ('T 1.0, top-p 0.95, top-k 64')."""
    from .traces import load_traces, sampling_label

    labels = sorted({sampling_label(trace.sampling_settings()) for trace in load_traces(model, split)})
    return " / ".join(labels)


def same_trace_figures(recorded: dict | None, shipped: dict | None) -> bool:
    """Whether a trace's recorded validity figures are the shipped trace's: the same token count and zlib ratio (a
    trace written again under the same name has other figures)."""
    shipped = shipped or {}
    return bool(recorded) and recorded.get("tokens") == shipped.get("tokens") and abs(
        recorded.get("compression", -1) - shipped.get("compression", -2)) < 1e-12


def rerun_line(name: str, record: dict, provenance: Provenance) -> str | None:
    """What to run for a run that is not current, with the compute it took, or None."""
    if provenance.status == CURRENT or not record.get("command") or "math" in record["results"]:
        return None
    minutes = record.get("compute_seconds", record["wall_seconds"]) / 60
    why = "; ".join(provenance.reasons) if provenance.reasons else "to record its fingerprint"
    first = ""
    config = record.get("config", {})
    if config.get("traces") and any("fail the current validity rule" in reason or "fails the current validity rule" in reason
                                    for reason in provenance.reasons):
        # the traces the rule rejects are written again first (fresh seeds, the set's own sampling), so that the rerun
        # feeds the whole set rather than what is left of it
        first = (f"First write the traces that fail the rule again: `python -m trikv.benchmarks.quality.traces --model "
                 f"{config['model']} --split {config['traces']} --redo-invalid --ship` with the set's own sampling "
                 f"({_set_sampling(config['model'], config['traces'])}) and dtype. ")
    return (f"`{name}` ({record['model']['name']}): {provenance.status} ({why}). {first}Rerun: `{record['command']} --fresh` "
            f"(its cells took {minutes:.0f} min of compute at {record['environment']['threads']} thread(s) on "
            f"{record['environment']['device']})")
