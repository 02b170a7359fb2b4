"""`trikv bench report DIR...`: quality run folders -> one Markdown page, assembled from the sections in `pages/`.

Every figure in the page comes from a `results.json` (the page is generated, never typed by hand). Plots
are PNG files written beside the Markdown page (`<page stem>_files/`), one per task and run folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..report_pages import command_line, embed_plot, format_commit, page_header
from .pages.cells import ORACLE_LABEL
from .pages.preregistration import (dedup_history_lines, preregistration_lines, registered_cell_lines, registered_targets,
                                    registered_tests)
from .pages.summary import RunsSummary, scope_lines, summarise_runs
from .pages.tables import sections
from .pages.trace_sets import near_threshold_traces, shipped_trace_validity, trace_sampling


def load_run(folder: str | Path) -> dict:
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"no results.json in {folder}")
    record = json.loads(path.read_text())
    if record.get("benchmark") != "quality":
        raise ValueError(f"{path} is not a quality benchmark result (benchmark={record.get('benchmark')!r})")
    return record


def _rules(methods: list[str]) -> list[tuple[str, str]]:
    """(method, the rule its registry entry states) for the methods of a run."""
    from ...policies import describe_methods

    rules = dict(describe_methods())
    return [(method, rules.get(method, "not registered in this trikv")) for method in methods]


def _time_line(record: dict) -> str:
    """Compute time over every unit, and this invocation's wall time where earlier invocations did part of it."""
    wall_minutes = record["wall_seconds"] / 60
    compute_minutes = record.get("compute_seconds", record["wall_seconds"]) / 60
    if compute_minutes <= wall_minutes + 0.05:
        return f"wall time {wall_minutes:.1f} min (compute over all units {compute_minutes:.1f} min)"
    return (f"compute over all units {compute_minutes:.1f} min (this invocation's wall time {wall_minutes:.1f} min; "
            "it reused units that earlier invocations computed)")


def recorded_commits(record: dict) -> list[str]:
    """The distinct commits a run's fingerprints record (the run's own, then its cells'), as the pages print them."""
    fingerprints = [record.get("fingerprint")] + [cell.get("fingerprint") for cell in (record.get("cells") or {}).values()]
    commits = [format_commit(f["commit"]["commit"], bool(f["commit"].get("modified")))
               for f in fingerprints if f and f.get("commit")]
    return list(dict.fromkeys(commits))


def _measured(named: list[tuple[str, dict]]) -> str:
    """What the runs measured, in one line: tasks, models, methods and budgets."""
    tasks = sorted({task for _, record in named for task in record["results"]})
    models = sorted({record["model"]["name"] for _, record in named})
    methods = {method for _, record in named for method in record["config"]["methods"] if method != "full"}
    budgets = sorted({int(budget) for _, record in named for budget in record["config"]["budgets"]})
    return (f"{', '.join(tasks)} of {len(methods)} KV-cache method{'s' if len(methods) != 1 else ''} against full "
            f"attention on {', '.join(models)}, budget{'s' if len(budgets) != 1 else ''} "
            f"{', '.join(map(str, budgets))} ({len(named)} run{'s' if len(named) != 1 else ''})")


def _figure(summary: RunsSummary) -> str:
    """The headline tally: how TriAttention fares against the published baselines over every run."""
    counts, usable = summary.counts, summary.usable_counts
    total = sum(counts.values())
    if not total:
        return f"no headline comparison ({summary.metric} against the published baselines) on these runs"
    return (f"TriAttention against the {len(summary.published)} published baselines on {summary.metric}: it leads "
            f"{counts['leads']}, ties {counts['ties']} and trails {counts['trails']} of {total} comparisons"
            + (f" (on the runs not superseded: leads {usable['leads']}, ties {usable['ties']}, trails {usable['trails']})"
               if usable != counts else ""))


def _concentration_section(named: list[tuple[str, dict]], provenance: dict, assets: Path) -> list[str]:
    """The figure of TriAttention's per-layer lead against query concentration, and what its data support."""
    from . import concentration
    from .traces import TRACES_DIR

    usable = {name: state.usable for name, state in provenance.items()}
    shipped_models = sorted(path.stem for path in TRACES_DIR.glob("*.jsonl"))
    found = concentration.concentration_lines(named, usable, shipped_models)
    path = concentration.plot(named, usable, assets / "concentration-lead.png")
    if not found:
        return []
    lines = ["## Query concentration against TriAttention's lead", "",
             "How low can query concentration go before TriAttention loses to attention-based methods? Each point is one",
             "layer of one model: TriAttention's recall minus R-KV's (left) or SnapKV's (right) at that layer, against the",
             "layer's query concentration (mean R of the shipped statistics over its heads and frequency bands).", ""]
    if path is not None:
        lines += [f"![concentration against lead]({assets.name}/{path.name})", ""]
    lines += [f"- {line}" for line in found]
    if concentration.threshold_visible(found):
        lines.append("- A threshold is visible above: a variant that scores the heads below it by another rule would test it.")
    else:
        lines.append("- With no threshold visible, no variant that scores low-concentration heads by another rule was added: "
                     "these layers give it no concentration to switch at. Telling would need less concentrated layers than "
                     "these models have" + (", and per-layer intervals over texts (runs made from now on keep them)."
                                            if any("per head" in line for line in found) else "."))
    lines.append("")
    return lines


DEFAULT_TITLE = "trikv quality benchmarks"


def write_report(folders: list[str | Path], out: str | Path, title: str = DEFAULT_TITLE,
                 preregistration: str | Path | None = None, earlier: str | None = None,
                 replaces: str | None = None) -> Path:
    """Render every run folder into one Markdown page (tables + plots copied beside it), opened by a summary
    computed from the paired intervals and, with `preregistration` (a JSON file), the pre-registered test.
    `replaces`: the page this one replaces, linked from the header as kept for reference."""
    out = Path(out)
    assets = out.parent / f"{out.stem}_files"
    assets.mkdir(parents=True, exist_ok=True)
    from .provenance import rerun_line, run_provenance

    named = [(Path(folder).resolve().name, load_run(folder)) for folder in folders]
    provenance = {name: run_provenance(record) for name, record in named}
    runs_summary = summarise_runs(named, provenance)
    tests = registered_tests(json.loads(Path(preregistration).read_text())) if preregistration else []
    command = command_line("trikv", "bench", "report", *folders, "--out", out,
                           *(["--title", title] if title != DEFAULT_TITLE else []),
                           *(["--preregistration", preregistration] if preregistration else []),
                           *(["--earlier", earlier] if earlier else []), *(["--replaces", replaces] if replaces else []))
    lines = page_header(title, command, _measured(named), _figure(runs_summary), registered_targets(tests, named),
                        [recorded_commits(record) for _, record in named])
    lines += ["Each run folder's `results.json` is read as it is.",
              "Teacher-forced tasks feed the known text through each method's cache in schedule-sized chunks",
              "(identical logits to one-token decoding); `full` is full attention. Every method runs on the same",
              "schedule, budget accounting and dtype, and protects the prompt under one rule (prompt + "
              f"{'/'.join(sorted({str(r['config'].get('min_decode_room', 32)) for _, r in named})) or 32} slots <=",
              "budget, whatever the method's recent window, which then lives in what the prompt leaves); a method",
              "that ranks by its last queries (SnapKV) sees the text at the round, not a question at the prompt's end.",
              "Fidelity's headline figures count only the positions after each text's first compression round",
              "(before it every method equals full attention). Intervals are 95% percentile bootstraps over texts or",
              f"problems; `{ORACLE_LABEL}` is the selection that keeps, at each of triattention's rounds, the keys all",
              "later queries attend most (in-sample, on triattention's schedule; not an upper bound at every horizon).",
              "Math runs name the decode engine that produced them.", ""]
    lines += ["## Scope: what was and was not measured", ""] + [f"- {line}" for line in scope_lines(named)] + [""]
    if earlier:
        lines += [f"Runs made before these rules (a method's recent window counted against the prompt; no intervals) "
                  f"are in [{Path(earlier).name}]({Path(earlier).name}).", ""]
    summary = runs_summary.lines
    if summary:
        lines += ["## Summary: TriAttention against the published baselines", "",
                  "Computed from the paired intervals in the tables below: TriAttention *leads* a method when the whole",
                  "95% interval of (method minus triattention) favours TriAttention, *trails* when it favours the method,",
                  "*ties* otherwise. The headline metric is KL(full || method) where compression acts; the published",
                  "baselines are the methods run as their papers define them; TriAttention's own variants and ablations",
                  "and the secondary metric (attention recall) follow, apart.", ""] + [f"- {line}" for line in summary] + [""]
    pending = [line for line in (rerun_line(name, record, provenance[name]) for name, record in named) if line]
    if preregistration:
        for test in registered_tests(json.loads(Path(preregistration).read_text())):
            if "reading" not in test:
                continue
            cells = registered_cell_lines(test, dict(named).get(test["run"]))
            missing = [line.strip() for line in cells if "not run" in line and line.startswith("  ")]
            total = next((line.strip() for line in cells if line.strip().startswith("Missing:")), None)
            if missing:
                pending.append(f"`{test['id']}` (run `{test['run']}`): " + "; ".join(missing) + (f". {total}" if total else "")
                               + f" Command: `{test['command']}`.")
    if pending:
        lines += ["## Pending: runs and cells this page still lacks", "",
                  "Runs whose fingerprint is not that of the shipped inputs, and registered cells not run, with the compute",
                  "they took or need (measured on this machine: 2 CPU cores).", ""] + [f"- {line}" for line in pending] + [""]
    validity_table = shipped_trace_validity()
    if validity_table:
        from .validity import RULE_TEXT

        lines += ["## Reasoning traces: validity of every shipped set", "",
                  f"Rule: {RULE_TEXT}. The thresholds are derived from the human texts alone "
                  "(`validity.derive_thresholds`, pinned by a test), never from traces; which figures the rule "
                  "tests was chosen after loops had been seen among the traces (`validity.py` says which and how). "
                  "Computed from the shipped trace files (`src/trikv/benchmarks/quality/data/traces/`); "
                  "each run below repeats the figures of the traces it fed.", "", validity_table, ""]
        near = near_threshold_traces()
        if near:
            lines += [f"Valid traces within 10% of a threshold (the verdict hangs on a small difference): {'; '.join(near)}.", ""]
    if replaces:
        lines += [f"This page replaces [{Path(replaces).name}]({Path(replaces).name}), kept for reference: its run folders "
                  "are gone, so it cannot be regenerated, and its figures made before the rules above (trace validity, "
                  "the withdrawals listed in the scope) stand only where those rules leave them valid.", ""]
    if any("triattention-dedup" in record["config"]["methods"] for _, record in named):
        lines += ["## How `triattention-dedup` came about", ""] + [f"- {line}" for line in dedup_history_lines()] + [""]
    if preregistration:
        tests = registered_tests(json.loads(Path(preregistration).read_text()))
        for index, test in enumerate(tests):
            heading = f"## Pre-registered held-out test `{test.get('id', index + 1)}`" if len(tests) > 1 else "## Pre-registered held-out test"
            lines += [heading, ""] + [f"- {line}" if not line.startswith("  ") else f"  -{line[1:]}"
                                      for line in preregistration_lines(test, named, tests[:index], replaces)] + [""]
    lines += _concentration_section(named, provenance, assets)
    for index, (folder, (name, record)) in enumerate(zip(folders, named)):
        config = record["config"]
        state = provenance[name]
        heading = {"current": "", "unrecorded": " (fingerprint not recorded)", "superseded": " (superseded: rerun pending)"}
        lines += [f"## {record['model']['name']}: run `{name}`{heading[state.status]}", ""]
        if state.reasons:
            lines += [f"**Not the shipped inputs**: {'; '.join(state.reasons)}. Its tables are kept for reference and "
                      "stand for the inputs it fed, not for what ships now.", ""]
        lines += [f"- {line}" for line in state.lines]
        sampling = trace_sampling(record)
        if sampling:
            lines.append(f"- traces sampled (full attention) at {sampling}")
        lines += [
            f"- model: `{record['model']['name']}` ({record['model'].get('dtype', 'torch.float32').removeprefix('torch.')}, "
            f"parameters sha256 `{record['model']['sha256_parameters'][:16]}`), "
            f"stats: {('`' + Path(record['stats']['path']).name + '` sha256 `' + record['stats']['sha256'][:16] + '`') if record.get('stats') and record['stats'].get('sha256') else 'n/a'}",
            f"- trikv {record['trikv_version']}, torch {record['environment']['torch']}, transformers "
            f"{record['environment']['transformers']}, {record['environment']['threads']} thread(s) on {record['environment']['device']}"
            + ("" if record.get("fingerprint") else " (results.json: the invocation that wrote it)"),
            f"- methods: {', '.join(config['methods'])}; budgets: {', '.join(map(str, config['budgets']))}; "
            f"divide_length {config['divide_length']}; seed {config['seed']}; {_time_line(record)}",
        ]
        if record.get("command"):
            lines.append(f"- command: `{record['command']}`")
        lines += ["- rules (`trikv methods`):"] + [f"  - `{method}`: {rule}" for method, rule in _rules(config["methods"])]
        lines.append("")
        for title_text, table in sections(record, markdown=True):
            lines += [f"### {title_text}", "", table, ""]
        for png in sorted(Path(folder).glob("*.png")):
            lines += embed_plot(png, assets, f"{index}_{name}", f"{name} {png.stem}")
    out.write_text("\n".join(lines))
    return out
