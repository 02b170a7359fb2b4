"""Tables, CSV rows and plots of quality results; `trikv bench report DIR...` -> one Markdown page.

Every figure in the page comes from a `results.json` (the page is generated, never typed by hand). Plots
are PNG files written beside the Markdown page (`<page stem>_files/`), one per task and run folder.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ...selection import prompt_fits
from ..report_pages import Target, command_line, embed_plot, format_commit, page_header


# ---- table helpers -------------------------------------------------------------------------------------
def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if abs(value) >= 1000:
            return f"{value:.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        return f"{value:.{digits}f}"
    return str(value)


def render(headers: list[str], rows: list[list], markdown: bool) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) if not isinstance(c, str) else c for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _budgets(record: dict) -> list[str]:
    return [str(b) for b in record["config"]["budgets"]]


def _methods(record: dict) -> list[str]:
    return list(record["config"]["methods"])


def _cell(table: dict, method: str, budget: str):
    values = table.get(method, {})
    return values.get("full") if method == "full" else values.get(budget)


def _grid(record, table, getter, methods=None) -> tuple[list[str], list[list]]:
    budgets = _budgets(record)
    rows = []
    for method in methods or _methods(record):
        row = [method]
        for budget in budgets:
            cell = _cell(table, method, budget)
            row.append(getter(cell) if cell is not None else None)
        rows.append(row)
    return ["method \\ budget"] + budgets, rows


# the recall row of the selection that keeps, at each of triattention's rounds, the keys the later queries attend
ORACLE_LABEL = "future-attention"
ORACLE_NOTE = (f"`{ORACLE_LABEL}`: at each of triattention's rounds, keeps the B held keys that all later queries attend "
               "most (in-sample, triattention's schedule; not an upper bound at every horizon)")


def _interval(value, interval, digits: int) -> str:
    """`value [low, high]`, or the value alone where no interval was computed."""
    if value is None:
        return "–"
    if not interval or any(v is None or (isinstance(v, float) and math.isnan(v)) for v in interval):
        return _fmt(value, digits)
    return f"{_fmt(value, digits)} [{_fmt(interval[0], digits)}, {_fmt(interval[1], digits)}]"


def _difference(comparison: dict | None, digits: int, scale: float = 1.0) -> str:
    """`+d [+low, +high]` of a paired difference, or – ."""
    if not comparison:
        return "–"
    low, high = comparison["ci"]
    if math.isnan(low):
        return f"{scale * comparison['difference']:+.{digits}f}"
    return f"{scale * comparison['difference']:+.{digits}f} [{scale * low:+.{digits}f}, {scale * high:+.{digits}f}]"


def _text_note(record: dict) -> str:
    meta = record["results"]["fidelity"]["meta"]
    names = meta["texts"]
    if meta.get("traces"):
        lengths = meta.get("prompt_lengths") or []
        prompts = f", prompts {min(lengths)}-{max(lengths)} tokens" if lengths else ""
        validity = meta.get("trace_validity") or {}
        valid = [name for name, figures in validity.items() if figures and figures["valid"]]
        attempts = [figures["attempts"] for name, figures in validity.items() if name in names and figures]
        glued = (f"; each trace is the model's sampled answers to one problem, {min(attempts)}-{max(attempts)} of them "
                 "glued with a blank line until 2,048 tokens" if attempts else "")
        fed = (f" (the {len(valid)} of {len(validity)} shipped that pass the validity rule)" if validity else
               " (written before the validity rule: not assessed)")
        return (f"{len(names)} {meta['traces']} reasoning traces of the model{fed} x {meta['trace_tokens']} tokens after "
                f"each one's own prompt ({meta.get('trace_frame', 'chat template')}){prompts}{glued}")
    protected = "" if record["config"].get("protect_prompt", True) else " (not protected)"
    return (f"{len(names)} texts x {meta['tokens_per_text']} tokens ({', '.join(names)}), prompt {meta['prompt_tokens']} "
            f"tokens{protected}")


FIDELITY_FIGURES = (("top-1 agreement with full attention", "top1_agreement", 3),
                    ("mean KL(full || method), nats", "kl", 4),
                    ("perplexity ratio (method / full attention) of the true next token", "perplexity_ratio", 3))


def _fidelity_sections(record: dict, markdown: bool) -> list[tuple[str, str]]:
    table = record["results"]["fidelity"]["methods"]
    note = _text_note(record)
    out = []
    cells = [c for values in table.values() for c in values.values() if c]
    if not all("compressed" in c for c in cells):  # runs from before the compressed-position figures
        for title, key, digits in (("top-1 agreement with full attention", "top1_agreement", 3),
                                   ("mean KL(full || method), nats", "kl", 4), ("perplexity of the true next token", "perplexity", 2)):
            headers, rows = _grid(record, table, lambda c, k=key: c[k])
            out.append((f"Fidelity: {title} ({note}; every position, also those before the first round)",
                        render(headers, rows, markdown)))
        return out
    for title, key, digits in FIDELITY_FIGURES:
        headers, rows = _grid(record, table, lambda c, k=key, d=digits: _interval(
            c["compressed"].get(k), c.get("ci", {}).get("compressed", {}).get(k), d))
        out.append((f"Fidelity where compression acts: {title} [95% bootstrap interval over texts] ({note}; only the "
                    "positions after each text's first compression round)", render(headers, rows, markdown)))
    share = _compressed_share(record, table)
    if share:
        room = record.get("config", {}).get("min_decode_room", 32)
        out.append(("Fidelity: share of the scored positions that come after the first compression round, and the "
                    f"texts whose prompt was protected (prompt + {room} slots <= budget, the same for every method)",
                    render(["budget", "compressed positions / all", "prompt protected"], share, markdown)))
    for title, key, digits in FIDELITY_FIGURES[:2]:
        headers, rows = _grid(record, table, lambda c, k=key, d=digits: _difference(
            c.get("vs_triattention", {}).get("compressed", {}).get(k), d),
            [m for m in _methods(record) if m not in ("full", "triattention")])
        if any(cell != "–" for row in rows for cell in row[1:]):
            better = "higher" if key == "top1_agreement" else "lower"
            out.append((f"Fidelity where compression acts: {title}, each method minus triattention, paired over texts "
                        f"[95% interval] ({better} is better for the method)", render(headers, rows, markdown)))
    def every_position(cell: dict) -> str:
        intervals = cell.get("ci", {}).get("all", {})
        ratio = cell.get("perplexity_ratio", cell["perplexity"] / cell["perplexity_full"])
        return (f"{_interval(cell['top1_agreement'], intervals.get('top1_agreement'), 3)} / "
                f"{_interval(cell['kl'], intervals.get('kl'), 4)} / {_interval(ratio, intervals.get('perplexity_ratio'), 3)}")

    headers, rows = _grid(record, table, every_position)
    out.append((f"Fidelity over every position (also those before the first round, where every method equals full "
                f"attention): top-1 / KL / perplexity ratio [95% bootstrap interval over texts] ({note})",
                render(headers, rows, markdown)))
    return out


def _compressed_share(record: dict, table: dict) -> list[list]:
    """Per budget: the scored positions after the first round, and the texts whose prompt was protected (one
    rule for every method, so one figure per budget)."""
    prompts = record["results"]["fidelity"]["meta"].get("prompt_lengths") or []
    config = record.get("config", {})
    rows = []
    for budget in _budgets(record):
        cell = next((_cell(table, m, budget) for m in _methods(record) if m != "full" and _cell(table, m, budget)), None)
        if cell and cell.get("positions"):
            protected = "–"
            if prompts and budget.isdigit():
                fits = prompt_fits(torch.tensor(prompts), int(budget), config.get("min_decode_room", 32))
                count = int(fits.sum()) if config.get("protect_prompt", True) else 0
                protected = f"{count} / {len(prompts)}"
            rows.append([budget, f"{cell['compressed']['positions']} / {cell['positions']} "
                                 f"({100 * cell['compressed']['positions'] / cell['positions']:.0f}%)", protected])
    return rows


def _recall_sections(record: dict, markdown: bool) -> list[tuple[str, str]]:
    table = record["results"]["recall"]["methods"]
    out = []
    methods = _methods(record) + (["oracle"] if "oracle" in table else [])
    label_of = lambda m: ORACLE_LABEL if m == "oracle" else m
    headers, rows = _grid(record, table, lambda c: _interval(c["recall"], c.get("ci", {}).get("recall"), 3)
                          + f" (min head {_fmt(c['recall_min_head'])})", methods)
    for row in rows:
        row[0] = label_of(row[0])
    out.append(("Attention recall: share of full attention's mass on the keys a method holds, mean over (layer, head) "
                "[95% bootstrap interval over texts] (minimum head); " + ORACLE_NOTE, render(headers, rows, markdown)))
    labels = _horizon_labels(record)
    for budget in _budgets(record):
        rows = []
        for method in methods:
            cell = _cell(table, method, budget)
            if method == "full" or cell is None:
                continue
            rows.append([label_of(method)] + [_interval(cell["by_horizon"].get(h, {}).get("recall"),
                                                        cell.get("ci", {}).get("by_horizon", {}).get(h), 3) for h in labels])
        mass = _horizon_mass(table, budget, labels)
        rows.append(["(share of mass)"] + [_fmt(m) for m in mass])
        out.append((f"Attention recall by horizon (tokens since the key was first judged), budget {budget} "
                    "[95% bootstrap interval over texts]", render(["method"] + labels, rows, markdown)))
        paired_rows = []
        for method in _methods(record):
            cell = _cell(table, method, budget)
            if method in ("full", "triattention") or cell is None or "vs_triattention" not in cell:
                continue
            comparison = cell["vs_triattention"]
            paired_rows.append([method, _difference(comparison["recall"], 3)]
                               + [_difference(comparison["by_horizon"].get(h), 3) for h in labels])
        if paired_rows:
            out.append((f"Attention recall, each method minus triattention, paired over texts [95% interval], budget "
                        f"{budget} (higher is better for the method)", render(["method", "all"] + labels, paired_rows, markdown)))
    kinds = [k for k in ("prompt", "repeated", "other")
             if any(k in (c or {}).get("by_kind", {}) for v in table.values() for c in v.values())]
    if kinds:
        for budget in _budgets(record):
            rows = []
            for method in methods:
                cell = _cell(table, method, budget)
                if method == "full" or cell is None or not cell.get("by_kind"):
                    continue
                intervals = cell.get("ci", {}).get("by_kind", {})
                rows.append([label_of(method)] + [_interval(cell["by_kind"].get(k, {}).get("recall"), intervals.get(k), 3)
                                                  for k in kinds])
            shares = next((c["by_kind"] for m in methods if m != "full" for c in [_cell(table, m, budget)] if c and c.get("by_kind")), {})
            rows.append(["(share of mass)"] + [_fmt(shares.get(k, {}).get("mass_share")) for k in kinds])
            out.append((f"Attention recall by key kind, budget {budget} [95% bootstrap interval over texts] (keys already "
                        "judged by a round; prompt, repeated = part of an 8-token run the text already holds, other)",
                        render(["method"] + kinds, rows, markdown)))
    return out


def _composition_sections(record: dict, markdown: bool) -> list[tuple[str, str]]:
    from .fidelity import COMPOSITION

    table = record["results"]["fidelity"]["methods"]
    out = []
    for budget in _budgets(record):
        rows = []
        for method in _methods(record):
            cell = _cell(table, method, budget)
            if method != "full" and cell and cell.get("kept_composition"):
                intervals = cell.get("composition_ci", {})
                rows.append([method] + [_interval(cell["kept_composition"][name], intervals.get(name), 3) for name in COMPOSITION])
        if rows:
            out.append((f"What each method holds right after a round, budget {budget} (share of the held entries, all "
                        "rounds, layers and KV heads [95% bootstrap interval over texts]): prompt, repeated text, else by age",
                        render(["method", *COMPOSITION], rows, markdown)))
    return out


def _validity_sections(record: dict, markdown: bool) -> list[tuple[str, str]]:
    """The validity figures of the traces the run fed, as the run recorded them, and each trace's verdict under the
    current rule where the shipped file holds it (a run judged under the earlier rule says so)."""
    from .traces import load_traces
    from .validity import judged_by_this_rule

    meta = record["results"].get("fidelity", {}).get("meta", {})
    validity = meta.get("trace_validity")
    if not validity:
        return []
    try:
        shipped = {trace.name: trace.validity for trace in load_traces(record["config"]["model"], record["config"]["traces"])}
    except (FileNotFoundError, ValueError, KeyError):
        shipped = {}
    current = lambda name: ("yes" if shipped[name]["valid"] else "**no**") if judged_by_this_rule(shipped.get(name)) else "–"  # noqa: E731
    earlier = any(figures and not judged_by_this_rule(figures) for figures in validity.values())
    rows = []
    for name, figures in validity.items():
        if not figures:
            continue
        masked = figures.get("masked_compression")
        rows.append([name, figures["tokens"], figures["attempts"], figures["rejected"], _fmt(figures["compression"]),
                     _fmt(masked) if masked is not None else "–",
                     f"{100 * figures['repeat_share']:.1f}%" + (" (tokens)" if not judged_by_this_rule(figures) else ""),
                     "yes" if figures["valid"] else "**no**", current(name), "yes" if name in meta["texts"] else "no"])
    title = ("Reasoning traces the run fed: validity as the run recorded it"
             + (" (under the earlier rule: zlib ratio of the text as written >= 0.12, longest repeated token run <= 10%; "
                "digits not masked)" if earlier else "") + ", and under the current rule (the shipped file's verdict)")
    return [(title, render(["trace", "tokens", "answers glued", "rejected as loops", "zlib ratio", "masked zlib ratio",
                            "longest repeat", "valid (as recorded)", "valid (current rule)", "fed"], rows, markdown))]


# ---- sections --------------------------------------------------------------------------------------------
def sections(record: dict, markdown: bool) -> list[tuple[str, str]]:
    """[(title, table text)] for every task in a run."""
    results = record["results"]
    out = []
    if "fidelity" in results:
        out += _validity_sections(record, markdown) + _fidelity_sections(record, markdown) + _composition_sections(record, markdown)
    if "recall" in results:
        out += _recall_sections(record, markdown)
    if "fidelity" in results and "recall" in results:
        findings = diagnosis(record)
        if findings:
            out.append(("Diagnosis: what the recall and fidelity tables above show (each line computed from them)",
                        "\n".join(f"- {line}" for line in findings)))
    if "dfs" in results:
        dfs = results["dfs"]
        for task, title in (("dfs-tf", "teacher-forced"), ("dfs-gen", "generative")):
            if task not in dfs:
                continue
            table = dfs[task]
            if task == "dfs-tf":  # runs from before the choice existed used the plain prompt
                title += f", {record['config'].get('dfs_prompt', 'plain')} prompt"
            headers, rows = _grid(record, table, lambda c: f"{_fmt(c['node'], 2)}/{_fmt(c['stack'], 2)}/{_fmt(c['visited'], 2)}/{_fmt(c['all'], 2)}")
            n_items = next(iter(next(iter(table.values())).values()))["items"]
            out.append((f"DFS state query ({title}, {n_items} queries): node / stack exact / visited exact / all three",
                        render(headers, rows, markdown)))
            token_level = "stack_tokens" in next(iter(next(iter(table.values())).values()))
            if token_level:
                headers, rows = _grid(record, table, lambda c: f"{_fmt(c['node_tokens'], 2)}/{_fmt(c['stack_tokens'], 2)}/{_fmt(c['visited_tokens'], 2)}")
                out.append((f"DFS ({title}): share of answer tokens that are the greedy choice, node / stack / visited",
                            render(headers, rows, markdown)))
            ks = [str(k) for k in record["config"]["dfs_ks"]]
            # exact accuracy by k for both modes; teacher-forced runs add the greedy token share by k
            for metric, what in [("", "exact accuracy")] + ([("_tokens", "greedy token share")] if token_level else []):
                for budget in _budgets(record):
                    rows = []
                    for method in _methods(record):
                        cell = _cell(table, method, budget)
                        if cell is None:
                            continue
                        rows.append([method] + [
                            f"{_fmt(cell['by_k'][k]['stack' + metric], 2)}/{_fmt(cell['by_k'][k]['visited' + metric], 2)}"
                            if k in cell["by_k"] else "–" for k in ks])
                    out.append((f"DFS ({title}) stack / visited {what} by step k, budget {budget}",
                                render(["method"] + [f"k={k}" for k in ks], rows, markdown)))
    if "needle" in results:
        table = results["needle"]["methods"]
        meta = results["needle"]["meta"]
        headers, rows = _grid(record, table, lambda c: f"{_fmt(c['accuracy'], 2)} ({_fmt(c['needle_in_cache'], 2)})")
        out.append((f"Passkey retrieval accuracy (share of layer/heads still holding the key), lengths {meta['lengths']}, "
                    f"depths {meta['depths']}", render(headers, rows, markdown)))
        depths = [f"{d:g}" for d in meta["depths"]]
        for budget in _budgets(record):
            rows = []
            for method in _methods(record):
                cell = _cell(table, method, budget)
                if cell is not None:
                    rows.append([method] + [_fmt(cell["by_depth"].get(d, {}).get("accuracy"), 2) for d in depths])
            out.append((f"Passkey accuracy by needle depth, budget {budget}", render(["method"] + [f"depth {d}" for d in depths], rows, markdown)))
    if "prefill" in results:
        out += _prefill_sections(record, markdown)
    if "math" in results:
        math_results = results["math"]
        for dataset in math_results["meta"]["datasets"]:
            table = math_results.get(dataset, {})
            headers, rows = _grid(record, table, lambda c: f"{_interval(c['pass@1'], c.get('ci', {}).get('pass@1'), 3)} "
                                                           f"({c['mean_tokens']:.0f} tok)")
            n = next(iter(next(iter(table.values())).values()))["problems"] if table else 0
            excluded = math_results["meta"].get("excluded_rows", {}).get(dataset) or []
            held_out = (f", rows {excluded[0]}-{excluded[-1]} excluded: the shipped statistics were calibrated on them"
                        if excluded else "")
            meta = math_results["meta"]
            temperature = meta.get("temperature", 0.6)
            decoding = f"T {temperature:g}, top-p {meta.get('top_p', 0.95):g}" if temperature > 0 else "greedy"
            batching = (f", {meta['problems_per_batch']} problems per batch" if meta.get("problems_per_batch", 1) > 1 else "")
            chosen = [i for i in meta.get("problems") or [] if i.rpartition("-")[0] == dataset]
            selection = f" chosen by id: {_id_ranges(chosen)};" if chosen else ""
            out.append((f"Math {dataset}: pass@1 [95% bootstrap interval over problems] ({n} problems,{selection} "
                        f"{meta['samples']} samples, {decoding}, {meta['max_new_tokens']} new tokens, "
                        f"{meta.get('engine', 'transformers')} engine, {meta.get('dtype', 'float32')}{batching}{held_out})",
                        render(headers, rows, markdown)))
            protection = _grid(record, table, lambda c: _fmt(c.get("prompt_protected"), 2),
                               [m for m in _methods(record) if m != "full"])
            if any(cell not in ("–", None) for row in protection[1] for cell in row[1:]):
                out.append((f"Math {dataset}: share of answers whose prompt was protected (one rule for every method: "
                            f"prompt + {meta.get('min_decode_room', 32)} slots <= budget)", render(*protection, markdown)))
            caps = {cap for methods in table.values() for cell in methods.values() for cap in cell.get("answers_by_cap", {})}
            if len(caps) > 1:
                headers, rows = _grid(record, table, lambda c: ", ".join(
                    f"{n} @ {cap}" for cap, n in sorted(c.get("answers_by_cap", {}).items(), key=lambda item: int(item[0]))))
                out.append((f"Math {dataset}: answers by the token cap they were generated under (n @ cap; the token "
                            f"cap was raised in place: a greedy answer that ended before a lower cap is kept, one that "
                            f"reached it was generated again with {meta['max_new_tokens']} tokens, in a new batch)",
                            render(headers, rows, markdown)))
            paired = _math_paired(record, table)
            if paired:
                out.append((f"Math {dataset}: each method against full attention on the same problems (points; +/-: "
                            "problems it solves that full does not / full solves that it does not; p: two-sided exact "
                            "sign test on the problems where they differ)",
                            render(["budget", "method", "pass@1", "vs full", "+/- vs full", "p", "it minus triattention [95% interval]"],
                                   paired, markdown)))
            against = _math_variants_against_baselines(record, table)
            if against:
                out.append((f"Math {dataset}: each TriAttention variant against each baseline on the same problems "
                            "(points [95% paired bootstrap interval over problems]; +/-: problems only the variant / only "
                            "the baseline solves; p: exact sign test)",
                            render(["budget", "variant", "baseline", "points", "+/-", "p"], against, markdown)))
    return out


def _prefill_sections(record: dict, markdown: bool) -> list[tuple[str, str]]:
    """The continuation's fidelity after a long prompt compacted while it was prefilled, against the same prompt
    prefilled whole and compacted after; the paired difference and what its interval says."""
    prefill = record["results"]["prefill"]
    meta = prefill["meta"]
    rows = []
    for budget in _budgets(record):
        for method in _methods(record):
            during, after = _cell(prefill["during"], method, budget), _cell(prefill["after"], method, budget)
            difference = (prefill["during_minus_after"].get(method) or {}).get(budget)
            if during is None or after is None or difference is None:
                continue
            kl = difference["kl"]
            low, high = kl["ci"]
            reading = ("compaction during the prefill costs fidelity" if low > 0 else
                       "compaction during the prefill is closer to full attention" if high < 0 else "no difference shown")
            rows.append([budget, method, _interval(during["kl"], (during.get("ci") or {}).get("all", {}).get("kl"), 4),
                         _interval(after["kl"], (after.get("ci") or {}).get("all", {}).get("kl"), 4),
                         _difference(kl, 4), f"{_fmt(during['top1_agreement'], 3)} / {_fmt(after['top1_agreement'], 3)}",
                         f"{during['peak_entries']} / {after['peak_entries']}", reading])
    title = (f"Compaction while prefilling against compaction after it: {len(meta['windows'])} windows of "
             f"{meta['prompt_tokens']:,} prompt + {meta['continuation_tokens']:,} teacher-forced tokens; the prompt "
             f"prefilled in chunks of {meta['prefill_chunk']} with a round whenever the cache reaches budget + "
             "divide_length (during), or in one forward and compacted at the first decode step (after); KL(full || "
             "method) over the continuation [95% bootstrap over windows], the paired difference during minus after")
    return [(title, render(["budget", "method", "KL during", "KL after", "during - after [95% paired]",
                            "top-1 agreement during / after", "peak entries during / after", "reading"], rows, markdown))]


def _id_ranges(problem_ids: list[str]) -> str:
    """Problem ids with runs of consecutive rows written as ranges: math500-300..math500-399, aime25-2."""
    parts: list[list[str]] = []
    for problem_id in problem_ids:
        dataset, _, row = problem_id.rpartition("-")
        previous = parts[-1][-1].rpartition("-") if parts else ("", "", "")
        if parts and previous[0] == dataset and row.isdigit() and previous[2].isdigit() and int(row) == int(previous[2]) + 1:
            parts[-1].append(problem_id)
        else:
            parts.append([problem_id])
    return ", ".join(run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}" for run in parts)


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the probability, if both methods were equally good, of a split of the problems
    they disagree on at least this uneven (McNemar's exact test when each problem is scored 0 or 1)."""
    disagreements = wins + losses
    if disagreements == 0:
        return 1.0
    tail = sum(math.comb(disagreements, k) for k in range(min(wins, losses) + 1)) / 2 ** disagreements
    return min(1.0, 2 * tail)


def _paired(cell: dict, other: dict) -> tuple[float, float, int, int]:
    """(gained, lost, problems better, problems worse) of `cell` against `other` on the problems both answered."""
    shared = [problem for problem in cell["by_problem"] if problem in other["by_problem"]]
    differences = [cell["by_problem"][q] - other["by_problem"][q] for q in shared]
    gained = sum(max(0.0, d) for d in differences)
    lost = sum(max(0.0, -d) for d in differences)
    return gained, lost, sum(d > 0 for d in differences), sum(d < 0 for d in differences)


def _math_paired(record: dict, table: dict) -> list[list]:
    """Rows [budget, method, pass@1, points vs full, gained/lost problems vs full, sign-test p, triattention's lead]
    for every compressed cell whose records carry per-problem scores (paired: same problems, so the +/- counts are
    exact)."""
    full = _cell(table, "full", "")
    if full is None or "by_problem" not in full:
        return []
    rows = []
    for budget in _budgets(record):
        tri = _cell(table, "triattention", budget)
        for method in _methods(record):
            cell = _cell(table, method, budget)
            if method == "full" or cell is None or "by_problem" not in cell:
                continue
            gained, lost, better, worse = _paired(cell, full)
            lead = ("" if tri is None or method == "triattention" else
                    _difference(cell.get("vs_triattention", {}).get("pass@1"), 1, scale=100)
                    if "vs_triattention" in cell else f"{100 * (cell['pass@1'] - tri['pass@1']):+.1f}")
            rows.append([budget, method, cell["pass@1"], f"{100 * (cell['pass@1'] - full['pass@1']):+.1f}",
                         f"+{gained:g} / -{lost:g}", f"{sign_test(better, worse):.2f}", lead])
    return rows


def _math_variants_against_baselines(record: dict, table: dict) -> list[list]:
    """Rows [budget, TriAttention variant, baseline, points [95% paired interval], +/- problems, sign-test p]: every
    method of the TriAttention family against every other compressed method, problem by problem."""
    from .intervals import paired_accuracy_interval

    methods = [m for m in _methods(record) if m != "full"]
    variants = [m for m in methods if m.startswith("triattention")]
    baselines = [m for m in methods if not m.startswith("triattention")]
    rows = []
    for budget in _budgets(record):
        for variant in variants:
            cell = _cell(table, variant, budget)
            for baseline in baselines:
                other = _cell(table, baseline, budget)
                if cell is None or other is None or "by_problem" not in cell or "by_problem" not in other:
                    continue
                gained, lost, better, worse = _paired(cell, other)
                interval = paired_accuracy_interval(cell, other)
                points = f"{100 * (cell['pass@1'] - other['pass@1']):+.1f}"
                if interval and not math.isnan(interval[0]):
                    points += f" [{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"
                rows.append([budget, variant, baseline, points, f"+{gained:g} / -{lost:g}", f"{sign_test(better, worse):.2f}"])
    return rows


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def _spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    mean = (n - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    var = sum((x - mean) ** 2 for x in ra)
    return cov / var if var else float("nan")


def _kl(cell: dict) -> float:
    """KL where compression acts (runs from before that figure: over every position)."""
    return cell["compressed"]["kl"] if "compressed" in cell else cell["kl"]


def _top1(cell: dict) -> float:
    return cell["compressed"]["top1_agreement"] if "compressed" in cell else cell["top1_agreement"]


def diagnosis(record: dict, method: str = "triattention") -> list[str]:
    """Findings, each computed from the run's own figures: does ranking by recall rank methods as KL does, where
    (by horizon and layer) `method` loses the attention mass the future-attention selection keeps, and what a
    protected recent window and the window-attention term change. Lines only for what the run measured; no
    sentence is printed that the figures do not compute."""
    fidelity, recall = record["results"]["fidelity"]["methods"], record["results"]["recall"]["methods"]
    labels = _horizon_labels(record)
    selection = f"`{ORACLE_LABEL}`"
    lines = []
    for budget in _budgets(record):
        rows = [(m, _cell(fidelity, m, budget), _cell(recall, m, budget)) for m in _methods(record) if m != "full"]
        rows = [(m, f, r) for m, f, r in rows if f and r]
        if len(rows) >= 3:
            rho = _spearman([r["recall"] for _, _, r in rows], [-_kl(f) for _, f, _ in rows])
            best_recall = max(rows, key=lambda row: row[2]["recall"])[0]
            best_kl = min(rows, key=lambda row: _kl(row[1]))[0]
            lines.append(f"B={budget}: rank correlation of recall with -KL over {len(rows)} methods {rho:+.2f}; "
                         f"highest recall `{best_recall}`, lowest KL `{best_kl}`.")
        own, oracle = _cell(recall, method, budget), _cell(recall, "oracle", budget)
        if own and oracle and own.get("by_horizon") and oracle.get("by_horizon"):
            missing = {}
            for label in labels:
                mine, best = own["by_horizon"].get(label), oracle["by_horizon"].get(label)
                if mine and best:
                    missing[label] = max(0.0, best["recall"] - mine["recall"]) * mine["mass_share"]
            total = sum(missing.values())
            if total > 0:
                worst = max(missing, key=missing.get)
                lines.append(f"B={budget}: `{method}` recall {own['recall']:.3f} vs {selection} {oracle['recall']:.3f}; "
                             f"{100 * missing[worst] / total:.0f}% of the mass it misses against that selection (weighted "
                             f"by each horizon's share of attention) is at horizon {worst}: "
                             + ", ".join(f"{label} {100 * value / total:.0f}%" for label, value in missing.items()) + ".")
        if oracle and oracle.get("by_horizon"):
            above = []
            for label in labels:
                best = oracle["by_horizon"].get(label)
                if not best:
                    continue
                recalls = [(m, r.get("by_horizon", {}).get(label, {}).get("recall", 0.0)) for m, _, r in rows]
                # compared as printed (3 decimals), so no method is called "above" an equal-looking figure
                leaders = [(m, value) for m, value in recalls if round(value, 3) > round(best["recall"], 3)]
                if leaders:
                    leaders.sort(key=lambda item: -item[1])
                    above.append(f"{label} ({ORACLE_LABEL} {best['recall']:.3f}): "
                                 + ", ".join(f"`{m}` {value:.3f}" for m, value in leaders))
            if above:
                lines.append(f"B={budget}: methods above {selection} at a horizon (it ranks keys by the attention of all "
                             "later queries, not of one horizon's): " + "; ".join(above) + ".")
        if own and oracle and own.get("recall_per_layer") and oracle.get("recall_per_layer"):
            gaps = [b - a for a, b in zip(own["recall_per_layer"], oracle["recall_per_layer"])]
            worst_layer = max(range(len(gaps)), key=gaps.__getitem__)
            lowest = min(range(len(gaps)), key=lambda i: oracle["recall_per_layer"][i])
            lines.append(f"B={budget}: `{method}`'s largest gap to {selection} is at layer {worst_layer} "
                         f"({own['recall_per_layer'][worst_layer]:.3f} vs {oracle['recall_per_layer'][worst_layer]:.3f}); "
                         f"{selection}'s own lowest layer is {lowest} ({oracle['recall_per_layer'][lowest]:.3f}).")
        concentration = record["results"]["recall"].get("meta", {}).get("concentration_per_layer")
        if own and own.get("recall_per_layer") and concentration and len(concentration) == len(own["recall_per_layer"]):
            for other, _, other_recall in rows:
                if other == method or other_recall["recall"] <= own["recall"] or not other_recall.get("recall_per_layer"):
                    continue
                gap = [a - b for a, b in zip(other_recall["recall_per_layer"], own["recall_per_layer"])]
                rho = _spearman(gap, concentration)
                if math.isnan(rho):
                    continue
                if len(gap) < MIN_VERDICT_UNITS:  # a rank correlation over 3 layers is +/-1 or +/-0.5 by construction
                    reading = f"no reading from {len(gap)} layers (at least {MIN_VERDICT_UNITS} needed)"
                else:
                    reading = (f"the lead is larger where concentration is {'lower' if rho < 0 else 'higher'}"
                               if abs(rho) >= 0.3 else "no clear relation (|rank correlation| < 0.3)")
                lines.append(f"B={budget}: `{other}` recalls more than `{method}` ({other_recall['recall']:.3f} vs "
                             f"{own['recall']:.3f}); across {len(gap)} layers its lead against the layer's query "
                             f"concentration (mean R of the statistics): rank correlation {rho:+.2f}, {reading}.")
        for variant, base, what in ((f"{method}-recent", method, "protecting the most recent tokens"),
                                    (f"{method}-window", f"{method}-recent", "adding the window-attention term")):
            a, b = _cell(fidelity, base, budget), _cell(fidelity, variant, budget)
            if a and b:
                lines.append(f"B={budget}: {what} (`{base}` -> `{variant}`): KL {_kl(a):.4f} -> {_kl(b):.4f}, "
                             f"top-1 {_top1(a):.3f} -> {_top1(b):.3f}.")
    return lines


def _horizon_labels(record: dict) -> list[str]:
    from .fidelity import horizon_labels

    labels = horizon_labels(tuple(record["config"]["horizons"]))
    table = record["results"]["recall"]["methods"]
    present = set()
    for values in table.values():
        for cell in values.values():
            if cell:
                present |= set(cell.get("by_horizon", {}))
    return [label for label in labels if label in present]


def _horizon_mass(table, budget, labels) -> list:
    for method, values in table.items():
        cell = values.get(budget)
        if method != "full" and cell:
            return [cell["by_horizon"].get(h, {}).get("mass_share") for h in labels]
    return [None] * len(labels)


def text_tables(record: dict) -> str:
    parts = []
    for title, table in sections(record, markdown=False):
        parts.append(f"== {title}\n{table}\n")
    return "\n".join(parts)


# ---- CSV -------------------------------------------------------------------------------------------------
def csv_rows(record: dict) -> list[tuple]:
    rows = []
    results = record["results"]

    def emit(task, method, budget, metric, group, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            rows.append((task, method, budget, metric, group, value))

    for task in ("fidelity", "recall", "needle"):
        for method, values in results.get(task, {}).get("methods", {}).items():
            for budget, cell in values.items():
                if not cell:
                    continue
                for metric, value in cell.items():
                    emit(task, method, budget, metric, "", value)
                for group_key in ("by_horizon", "by_depth", "by_length", "by_position"):
                    for group, sub in cell.get(group_key, {}).items():
                        for metric, value in sub.items():
                            emit(task, method, budget, metric, f"{group_key[3:]}={group}", value)
    for task, table in results.get("dfs", {}).items():
        if task == "meta":
            continue
        for method, values in table.items():
            for budget, cell in values.items():
                for metric, value in cell.items():
                    emit(task, method, budget, metric, "", value)
                for k, sub in cell["by_k"].items():
                    for metric, value in sub.items():
                        emit(task, method, budget, metric, f"k={k}", value)
    for dataset, table in results.get("math", {}).items():
        if dataset == "meta":
            continue
        for method, values in table.items():
            for budget, cell in values.items():
                emit(f"math-{dataset}", method, budget, "pass@1", "", cell["pass@1"])
    return rows


# ---- plots -----------------------------------------------------------------------------------------------
def _series(record, table, getter):
    """Per method: (values, intervals) over the run's budgets; a getter returns a value or (value, [low, high])."""
    budgets = [int(b) for b in _budgets(record)]
    lines = {}
    for method in _methods(record):
        values, intervals = [], []
        for budget in budgets:
            cell = _cell(table, method, str(budget))
            got = getter(cell) if cell else float("nan")
            value, interval = got if isinstance(got, tuple) else (got, None)
            values.append(value)
            intervals.append(interval)
        lines[method] = (values, intervals)
    return budgets, lines


def _errors(values, intervals):
    """[2, n] distances below / above each value (0 where a point has no interval), or None without any."""
    if not any(intervals):
        return None
    low = [v - i[0] if i else 0.0 for v, i in zip(values, intervals)]
    high = [i[1] - v if i else 0.0 for v, i in zip(values, intervals)]
    return [[max(0.0, x) for x in low], [max(0.0, x) for x in high]]


def _panel(ax, budgets, lines, ylabel, title, logy=False):
    if len(budgets) == 1:  # one budget: a bar per method with its interval reads better than points on one tick
        names = list(lines)
        values = [lines[m][0][0] for m in names]
        errors = _errors(values, [lines[m][1][0] for m in names])
        colors = ["black" if m == "full" else f"C{i % 10}" for i, m in enumerate(names)]
        ax.barh(names, values, xerr=errors, color=colors, alpha=0.8, capsize=3)  # linear: full attention's 0 shows
        ax.invert_yaxis()
        ax.set_xlabel(f"{ylabel} (95% interval)" if errors else ylabel)
        ax.set_title(f"{title}, budget {budgets[0]}", fontsize=10)
        ax.grid(alpha=0.3, axis="x")
        return
    for method, (values, intervals) in lines.items():
        style = dict(linestyle="--", color="black") if method == "full" else dict(marker="o")
        errors = _errors(values, intervals)
        if errors:
            ax.errorbar(budgets, values, yerr=errors, label=method, capsize=3, **style)
        else:
            ax.plot(budgets, values, label=method, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets)
    ax.set_xticklabels([str(b) for b in budgets])
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("budget (KV entries per layer and head)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)


def _with_interval(cell: dict, figure: str, part: str = "compressed"):
    """(value, interval) of a fidelity figure where compression acts (runs from before it: every position)."""
    if "compressed" not in cell:
        return cell.get(figure, float("nan"))
    value = cell["compressed"].get(figure, float("nan"))
    return value, cell.get("ci", {}).get(part, {}).get(figure)


def plot_run(record: dict, out: Path) -> list[Path]:
    """One PNG per task (metric vs budget, one line per method); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = record["results"]
    written = []
    panels = []
    if "fidelity" in results:
        table = results["fidelity"]["methods"]
        panels.append(("fidelity", [
            (table, lambda c: _with_interval(c, "top1_agreement"), "top-1 agreement", "Top-1 agreement with full attention", False),
            (table, lambda c: _with_interval(c, "kl"), "KL(full || method)", "Mean KL divergence", True),
            (table, lambda c: _with_interval(c, "perplexity_ratio") if "compressed" in c else c["perplexity"],
             "perplexity ratio" if any("compressed" in c for v in table.values() for c in v.values() if c) else "perplexity",
             "Perplexity (ratio to full)", False),
        ]))
    if "recall" in results:
        table = results["recall"]["methods"]
        specs = [(table, lambda c: (c["recall"], c.get("ci", {}).get("recall")), "recall", "Attention recall (all queries)", False)]
        for label in _horizon_labels(record):
            specs.append((table, lambda c, h=label: (c["by_horizon"].get(h, {}).get("recall", float("nan")),
                                                     c.get("ci", {}).get("by_horizon", {}).get(h)) if c.get("by_horizon") else float("nan"),
                          "recall", f"Recall, keys judged {label} tokens ago", False))
        panels.append(("recall", specs))
    if "dfs" in results:
        for task in ("dfs-tf", "dfs-gen"):
            if task in results["dfs"]:
                table = results["dfs"][task]
                metrics = [("node", "node exact"), ("stack", "stack exact"), ("visited", "visited exact"), ("all", "all three")]
                if task == "dfs-tf":
                    metrics += [("node_tokens", "node: greedy token share"), ("stack_tokens", "stack: greedy token share"),
                                ("visited_tokens", "visited: greedy token share")]
                panels.append((task, [(table, lambda c, m=m: c.get(m, float("nan")), "accuracy", f"DFS {task[4:]}: {label}", False)
                                      for m, label in metrics]))
    if "needle" in results:
        table = results["needle"]["methods"]
        panels.append(("needle", [(table, lambda c: c["accuracy"], "accuracy", "Passkey retrieval accuracy", False),
                                  (table, lambda c: c["needle_in_cache"], "share", "Share of heads holding the key", False)]))
    if "math" in results:
        specs = []
        for dataset in results["math"]["meta"]["datasets"]:
            if dataset in results["math"]:
                specs.append((results["math"][dataset], lambda c: (c["pass@1"], c.get("ci", {}).get("pass@1")), "pass@1",
                              f"{dataset} pass@1", False))
        if specs:
            panels.append(("math", specs))
    if "recall" in results:
        path = _plot_recall_by_layer(record, Path(out), plt)
        if path is not None:
            written.append(path)
    if "fidelity" in results:
        path = _plot_composition(record, Path(out), plt)
        if path is not None:
            written.append(path)
    for name, specs in panels:
        cols = min(3, len(specs))
        rows = math.ceil(len(specs) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
        for ax, (table, getter, ylabel, title, logy) in zip(axes.flat, specs):
            budgets, lines = _series(record, table, getter)
            _panel(ax, budgets, lines, ylabel, title, logy)
        for ax in list(axes.flat)[len(specs):]:
            ax.axis("off")
        if len(_budgets(record)) > 1:  # one budget: bars labelled by method
            axes.flat[0].legend(fontsize=8)
        fig.suptitle(f"{record['model']['name']}: {name}", fontsize=11)
        fig.tight_layout()
        path = Path(out) / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _plot_composition(record: dict, out: Path, plt) -> Path | None:
    """composition.png: what each method holds right after its rounds (prompt, repeated text, by age), one stacked
    bar per method, one panel per budget; beside it the recall of each key kind."""
    from .fidelity import COMPOSITION

    table = record["results"]["fidelity"]["methods"]
    budgets = [b for b in _budgets(record) if any((_cell(table, m, b) or {}).get("kept_composition") for m in _methods(record))]
    if not budgets:
        return None
    recall = record["results"].get("recall", {}).get("methods", {})
    kinds = ("prompt", "repeated", "other")
    fig, axes = plt.subplots(len(budgets), 2, figsize=(11, 3.9 * len(budgets)), squeeze=False)
    for row, budget in zip(axes, budgets):
        methods = [m for m in _methods(record) if m != "full" and (_cell(table, m, budget) or {}).get("kept_composition")]
        bottom = [0.0] * len(methods)
        for name in COMPOSITION:
            values = [_cell(table, m, budget)["kept_composition"][name] for m in methods]
            row[0].barh(methods, values, left=bottom, label=name)
            bottom = [a + b for a, b in zip(bottom, values)]
        row[0].set_xlim(0, 1)
        row[0].set_xlabel("share of the held entries after a round")
        row[0].set_title(f"what each method holds, budget {budget}", fontsize=10)
        row[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(COMPOSITION))
        width = 0.8 / len(kinds)
        for i, kind in enumerate(kinds):
            values = [((_cell(recall, m, budget) or {}).get("by_kind", {}).get(kind) or {}).get("recall", float("nan")) for m in methods]
            row[1].barh([j + i * width for j in range(len(methods))], values, height=width, label=kind)
        row[1].set_yticks([j + width for j in range(len(methods))])
        row[1].set_yticklabels(methods)
        row[1].set_xlabel("recall of the key kind (keys already judged)")
        row[1].set_title(f"recall by key kind, budget {budget}", fontsize=10)
        row[1].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(kinds))
        row[1].grid(alpha=0.3, axis="x")
    fig.suptitle(f"{record['model']['name']}: what the methods keep", fontsize=11)
    fig.tight_layout()
    path = out / "composition.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_recall_by_layer(record: dict, out: Path, plt) -> Path | None:
    """recall-layers.png: attention recall of every layer (mean over its query heads), one panel per budget,
    one line per method and the oracle: where in depth each method loses the attention mass."""
    table = record["results"]["recall"]["methods"]
    methods = [m for m in _methods(record) if m != "full"] + (["oracle"] if "oracle" in table else [])
    budgets = [b for b in _budgets(record) if any((_cell(table, m, b) or {}).get("recall_per_layer") for m in methods)]
    if not budgets:
        return None
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.6 * len(budgets), 3.6), squeeze=False)
    for ax, budget in zip(axes.flat, budgets):
        for method in methods:
            cell = _cell(table, method, budget) or {}
            per_layer = cell.get("recall_per_layer")
            if per_layer:
                style = dict(linestyle="--", color="black") if method == "oracle" else dict(marker=".")
                ax.plot(range(len(per_layer)), per_layer, label=method, **style)
        ax.set_xlabel("layer")
        ax.set_ylabel("recall (mean over heads)")
        ax.set_title(f"budget {budget}", fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{record['model']['name']}: attention recall by layer", fontsize=11)
    fig.tight_layout()
    path = out / "recall-layers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the Markdown page -------------------------------------------------------------------------------
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


def _verdict(comparison: dict | None, higher_is_better: bool) -> str | None:
    """'leads' / 'trails' / 'ties' for TriAttention against a method, from the interval of (method - triattention):
    TriAttention leads when the whole interval favours it, trails when the whole interval favours the method."""
    if not comparison:
        return None
    low, high = comparison["ci"]
    if math.isnan(low) or math.isnan(high):
        return None
    method_better = low > 0 if higher_is_better else high < 0
    method_worse = high < 0 if higher_is_better else low > 0
    return "trails" if method_better else "leads" if method_worse else "ties"


MIN_VERDICT_UNITS = 8  # a percentile bootstrap over fewer texts or problems says little: no verdict from it


def _units(record: dict, task: str, dataset: str | None) -> int:
    """Texts (fidelity, recall) or problems (math) the run's paired intervals resample."""
    results = record["results"]
    if task == "math":
        table = results["math"].get(dataset, {})
        return max((cell.get("problems", 0) for values in table.values() for cell in values.values() if cell), default=0)
    return len(results[task]["meta"].get("texts", []))


def trace_set_left_out(record: dict) -> str | None:
    """Why a run on reasoning traces stays out of the summary (its model wrote too few valid traces), or None."""
    from .validity import MIN_VALID_SHARE

    validity = record["results"].get("fidelity", {}).get("meta", {}).get("trace_validity")
    if not validity:
        return None
    valid = sum(1 for figures in validity.values() if figures and figures["valid"])
    if valid >= MIN_VALID_SHARE * len(validity):
        return None
    return (f"only {valid} of its {len(validity)} traces pass the validity rule (at least {MIN_VALID_SHARE:.0%} needed): "
            "the model cannot write valid reasoning traces under the rule, so its figures are shown below but enter no verdict")


def method_role(method: str) -> str:
    """What a method is on the page: "reference" (full attention), "triattention", "variant" (TriAttention's
    ablations and trikv's own variants: `triattention-*`, `tri-am*`), "baseline ablation" (a registry entry whose rule
    calls itself an ablation of another method) or "published" (a baseline as its paper defines it, run on the
    shared cache, trigger and prompt protection)."""
    from ...policies import REGISTRY

    if method == "full":
        return "reference"
    if method == "triattention":
        return "triattention"
    if method.startswith(("triattention-", "tri-am")):
        return "variant"
    entry = REGISTRY.get(method)
    if entry is not None and "ablation" in entry.note.split(":")[0].lower():
        return "baseline ablation"
    return "published"


HEADLINE = ("fidelity", "KL where compression acts", lambda c: c.get("vs_triattention", {}).get("compressed", {}).get("kl"), False, 4, 1.0)
SECONDARY = ("recall", "attention recall", lambda c: (c.get("vs_triattention") or {}).get("recall"), True, 3, 1.0)
MATH = ("math", "pass@1", lambda c: (c.get("vs_triattention") or {}).get("pass@1"), True, 1, 100.0)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _verdicts(record: dict, table: dict, budget: str, get, higher: bool, digits: int, scale: float,
              roles: tuple[str, ...]) -> dict[str, list[str]]:
    """{"leads"|"trails"|"ties": ["`m` +d [low, high]"]} of TriAttention against the run's methods of `roles`."""
    groups: dict[str, list[str]] = {"leads": [], "trails": [], "ties": []}
    for method in _methods(record):
        if method_role(method) not in roles:
            continue
        cell = _cell(table, method, budget)
        comparison = get(cell) if cell else None
        verdict = _verdict(comparison, higher)
        if verdict:
            groups[verdict].append(f"`{method}` {_difference(comparison, digits, scale)}")
    return groups


def _kl_ranking(record: dict, budget: str) -> list[tuple[str, float]]:
    """(method, KL where compression acts) of every compressing method of the run at `budget`, lowest first."""
    table = record["results"]["fidelity"]["methods"]
    rows = [(m, _kl(_cell(table, m, budget))) for m in _methods(record) if m != "full" and _cell(table, m, budget)]
    return sorted(rows, key=lambda row: row[1])


def trace_sampling(record: dict) -> str | None:
    """How the traces a run fed were sampled, read from the shipped trace file ('T 0.6, top-p 0.95', ...)."""
    from .traces import load_traces, sampling_label

    config = record.get("config", {})
    if not config.get("traces"):
        return None
    try:
        traces = load_traces(config["model"], config["traces"])
    except (FileNotFoundError, ValueError):
        return None
    labels = sorted({sampling_label(trace.sampling_settings()) for trace in traces})
    return " / ".join(labels)


def model_factors(record: dict) -> dict:
    """What the run records, or the statistics it used ship, about the conditions TriAttention scored under:
    {"parameters", "concentration": (mean, low, high) over the scored layers, "scored_layers", "num_layers",
    "calibration_tokens", "sampling"}; a field is absent where nothing records it (statistics other than the
    shipped file say nothing here)."""
    from .provenance import stats_match

    factors: dict = {}
    if record.get("model", {}).get("parameters"):
        factors["parameters"] = record["model"]["parameters"]
    concentration = ((record["results"].get("recall") or {}).get("meta") or {}).get("concentration_per_layer")
    if concentration:
        factors["concentration"] = (sum(concentration) / len(concentration), min(concentration), max(concentration))
    if stats_match(record):
        from ...calibration import QueryStats, bundled_stats_path

        stats = QueryStats.load(bundled_stats_path(record["config"]["model"]))
        factors["num_layers"], factors["scored_layers"] = stats.metadata["num_layers"], len(stats.layers)
        if stats.metadata.get("token_count"):
            factors["calibration_tokens"] = stats.metadata["token_count"]
    sampling = trace_sampling(record)
    if sampling:
        factors["sampling"] = sampling
    return factors


def model_factor_line(standings: list[dict]) -> str | None:
    """One sentence per model of TriAttention's headline standing beside what differs between the models (size,
    query concentration of the layers it scores, how many layers compress at all, calibration tokens, trace
    sampling), best standing first; None with fewer than two models. With a handful of models these differ
    together, and the sentence says so: it describes, it does not attribute."""
    if len({standing["model"] for standing in standings}) < 2:
        return None
    parts, means = [], {}
    for standing in sorted(standings, key=lambda s: (s["trails"] - s["leads"], s["rank"] or 0)):
        factors = model_factors(standing["record"])
        if "concentration" in factors:
            means[standing["model"]] = factors["concentration"][0]
        facts = [(f"ranks {_ordinal(standing['rank'])} of {standing['of']}, " if standing["rank"] else "")
                 + f"leads {standing['leads']} and trails {standing['trails']} of {standing['compared']} published baselines"]
        if "num_layers" in factors:
            scored, total = factors["scored_layers"], factors["num_layers"]
            facts.append(f"compresses {scored} of its {total} layers" + (
                f" (the other {total - scored} are sliding-window layers that every method leaves to their own window, "
                f"so the methods differ in {scored} layers only)" if scored < total else ""))
        if "concentration" in factors:
            mean, low, high = factors["concentration"]
            facts.append(f"mean query concentration {mean:.2f} ({low:.2f}-{high:.2f}) over the layers TriAttention scores")
        if "calibration_tokens" in factors:
            facts.append(f"statistics from {factors['calibration_tokens']:,} calibration tokens")
        if "sampling" in factors:
            facts.append(f"traces sampled at {factors['sampling']}")
        size = f", {factors['parameters'] / 1e6:.0f}M parameters" if "parameters" in factors else ""
        parts.append(f"{standing['model']} (B={standing['budget']}{size}): " + "; ".join(facts) + standing["tag"])
    models = len({standing["model"] for standing in standings})
    alike = ""
    if len(means) > 1 and max(means.values()) - min(means.values()) < 0.05:
        alike = (f" The scored layers' mean query concentration differs by {max(means.values()) - min(means.values()):.2f} "
                 "at most between the models, so by that measure they are alike and it does not separate their standings.")
    others = "The other" if alike else "These"
    return ("Where TriAttention stands, model by model, beside what differs between the models: " + ". ".join(parts)
            + "." + alike + f" {others} conditions vary together across {models} models, so the runs cannot tell which "
            "of them, if any, accounts for a difference in standing; the figure under \"Query concentration against "
            "TriAttention's lead\" reads concentration alone, layer by layer within each model.")


@dataclass
class RunsSummary:
    """The summary's lines and the tally of its headline: TriAttention against the published baselines."""

    lines: list[str]
    counts: dict[str, int]  # leads / ties / trails over every headline comparison
    usable_counts: dict[str, int]  # the same on the runs whose inputs stand for what ships now
    published: list[str]  # the published baselines compared
    metric: str  # the headline metric, in words


def summary_lines(named_records: list[tuple[str, dict]], provenance: dict | None = None) -> list[str]:
    """The lines of `summarise_runs`."""
    return summarise_runs(named_records, provenance).lines


def summarise_runs(named_records: list[tuple[str, dict]], provenance: dict | None = None) -> RunsSummary:
    """The page's opening summary, computed from the paired intervals of every run. TriAttention *leads* a method
    when the whole 95% interval of (method minus triattention) favours it, *trails* when it favours the method.

    The first line is the headline: TriAttention against the published baselines on KL where compression acts,
    per run, with its rank among every method of the run (`provenance` tags runs whose inputs are not the shipped
    ones). Then each run's verdicts and who ranks above TriAttention; how each run's traces were sampled where they
    differ; TriAttention's own variants and ablations, apart; the secondary metric (attention recall); math. Runs on
    a model's invalid trace set and comparisons over fewer than `MIN_VERDICT_UNITS` texts or problems give no
    verdict; the last line sets the headline comparisons against what chance alone would give."""
    provenance = provenance or {}
    tag = lambda name: f" [{provenance[name].tag()}]" if name in provenance and provenance[name].status != "current" else ""  # noqa: E731
    task, what, get, higher, digits, scale = HEADLINE
    headline, details, variants, secondary, math_lines, notes = [], [], [], [], [], []
    standings: list[dict] = []  # TriAttention's headline standing per (run, budget), for `model_factor_line`
    counts = {"leads": 0, "trails": 0, "ties": 0}
    usable_counts = {"leads": 0, "trails": 0, "ties": 0}  # on runs whose inputs stand for what ships now
    published: list[str] = []
    for name, record in named_records:
        results = record["results"]
        left_out = trace_set_left_out(record)
        if left_out:
            notes.append(f"`{name}` ({record['model']['name']}): left out of the summary, {left_out}.")
            continue
        model = record["model"]["name"]
        if task in results:
            units = _units(record, task, None)
            if units < MIN_VERDICT_UNITS:
                notes.append(f"`{name}` ({model}), {what}: no verdict from {units} texts (at least {MIN_VERDICT_UNITS} needed).")
            else:
                table = results[task]["methods"]
                for budget in _budgets(record):
                    groups = _verdicts(record, table, budget, get, higher, digits, scale, ("published",))
                    if not any(groups.values()):
                        continue
                    published += [m for m in _methods(record) if method_role(m) == "published" and m not in published]
                    for verdict in counts:
                        counts[verdict] += len(groups[verdict])
                        if name not in provenance or provenance[name].usable:
                            usable_counts[verdict] += len(groups[verdict])
                    ranking = _kl_ranking(record, budget)
                    rank = next(i for i, (m, _) in enumerate(ranking, 1) if m == "triattention") if any(
                        m == "triattention" for m, _ in ranking) else None
                    where = f" ranks {_ordinal(rank)} of {len(ranking)} methods" if rank else ""
                    standings.append({"record": record, "model": model, "budget": budget, "rank": rank, "of": len(ranking),
                                      "trails": len(groups["trails"]), "leads": len(groups["leads"]),
                                      "compared": sum(len(items) for items in groups.values()), "tag": tag(name)})
                    headline.append(f"on {model} (B={budget}) it leads {len(groups['leads'])}, ties {len(groups['ties'])} and "
                                    f"trails {len(groups['trails'])}{',' if where else ''}{where}{tag(name)}")
                    parts = [f"{verdict} {', '.join(items)}" for verdict, items in groups.items() if items]
                    details.append(f"`{name}` ({model}), B={budget}, {what}, published baselines (method minus "
                                   "triattention [95% interval]): TriAttention " + "; ".join(parts) + ".")
                    if rank:
                        ahead = ranking[: rank - 1]
                        behind = ranking[rank:]
                        details.append(f"`{name}` ({model}), B={budget}: TriAttention ranks {_ordinal(rank)} of {len(ranking)} "
                                       f"methods on {what} ({ranking[rank - 1][1]:.4f}); "
                                       + (f"lower KL: {', '.join(f'`{m}` {v:.4f}' for m, v in ahead)}" if ahead else "no method has lower KL")
                                       + (f"; higher: {', '.join(f'`{m}`' for m, _ in behind)}" if behind else "; no method has higher KL")
                                       + f"; {sum(method_role(m) == 'published' for m, _ in ahead)} of the "
                                       f"{sum(method_role(m) == 'published' for m, _ in ranking)} published baselines rank "
                                       f"above it{tag(name)}.")
                    own = _verdicts(record, table, budget, get, higher, digits, scale, ("variant", "baseline ablation"))
                    if any(own.values()):
                        parts = [f"{verdict} {', '.join(items)}" for verdict, items in own.items() if items]
                        variants.append(f"`{name}` ({model}), B={budget}, {what}: TriAttention " + "; ".join(parts) + ".")
        for task2, what2, get2, higher2, digits2, scale2 in (SECONDARY,):
            if task2 not in results or _units(record, task2, None) < MIN_VERDICT_UNITS:
                continue
            for budget in _budgets(record):
                groups = _verdicts(record, results[task2]["methods"], budget, get2, higher2, digits2, scale2,
                                   ("published", "variant", "baseline ablation"))
                if any(groups.values()):
                    parts = [f"{verdict} {', '.join(items)}" for verdict, items in groups.items() if items]
                    secondary.append(f"`{name}` ({model}), B={budget}, {what2} (method minus triattention [95% interval], "
                                     "higher is better for the method): TriAttention " + "; ".join(parts) + f"{tag(name)}.")
        if "math" in results:
            _, what3, get3, higher3, digits3, scale3 = MATH
            for dataset in results["math"]["meta"]["datasets"]:
                if dataset not in results["math"]:
                    continue
                units = _units(record, "math", dataset)
                if units < MIN_VERDICT_UNITS:
                    notes.append(f"`{name}` ({model}), {what3}: no verdict from {units} problems (at least {MIN_VERDICT_UNITS} needed).")
                    continue
                for budget in _budgets(record):
                    groups = _verdicts(record, results["math"][dataset], budget, get3, higher3, digits3, scale3,
                                       ("published", "variant", "baseline ablation"))
                    if any(groups.values()):
                        parts = [f"{verdict} {', '.join(items)}" for verdict, items in groups.items() if items]
                        math_lines.append(f"`{name}` ({model}), B={budget}, {dataset} {what3} (method minus triattention "
                                          "[95% interval]): TriAttention " + "; ".join(parts) + f"{tag(name)}.")
    lines = []
    total = sum(counts.values())
    if headline:
        lines.append(f"Headline, TriAttention against the {len(published)} published baseline{'' if len(published) == 1 else 's'} ("
                     + ", ".join(f"`{m}`" for m in published) + f") on {what}: " + "; ".join(headline)
                     + f". In all it leads {counts['leads']}, ties {counts['ties']} and trails {counts['trails']} of these "
                     f"{total} comparisons"
                     + (f"; on the runs not superseded alone (their inputs, recorded or told by their recorded figures, "
                        f"are the shipped ones) it leads {usable_counts['leads']}, ties {usable_counts['ties']} and trails "
                        f"{usable_counts['trails']}" if usable_counts != counts else "")
                     + ".")
    lines += details
    sampling = {}
    for name, record in named_records:
        label = trace_sampling(record)
        if label:
            sampling.setdefault(label, []).append(record["model"]["name"])
    if len(sampling) > 1:
        lines.append("The traces were not all sampled alike: " + "; ".join(
            f"{', '.join(sorted(set(models)))} at {label}" for label, models in sampling.items()) + ".")
    standing = model_factor_line(standings)
    if standing:
        lines.append(standing)
    lines += [f"TriAttention's own variants and ablations (not baselines): {line}" for line in variants]
    lines += [f"Secondary metric: {line}" for line in secondary]
    lines += math_lines + notes
    if total:
        lines.append(f"Chance: were every published baseline equal to TriAttention, about 5% of the {total} headline "
                     f"comparisons ({0.05 * total:.1f}) would still show a lead or a trail; the comparisons share texts, so "
                     "they are not independent.")
    return RunsSummary(lines, counts, usable_counts, published, what)


def scope_lines(named_records: list[tuple[str, dict]]) -> list[str]:
    """What the page's runs measured and what they did not, computed from the runs (models, devices, dtypes, tasks)."""
    from ...models import REGISTRY

    models = sorted({record["model"]["name"] for _, record in named_records})
    described = []
    for name in models:
        entry = REGISTRY.get(name)
        size = next((record["model"]["parameters"] for _, record in named_records
                     if record["model"]["name"] == name and record["model"].get("parameters")), None)
        described.append(f"`{name}`" + (f" ({size / 1e6:.0f}M parameters)" if size else "")
                         + (f": {entry.description.split(' (')[0]}" if entry else ""))
    from .provenance import one_invocation

    devices = sorted({record["environment"]["device"] for _, record in named_records})
    # the threads that computed the cells: the fingerprint's, or results.json's where one invocation computed them all
    threads = sorted({(record.get("fingerprint") or {}).get("threads") or record["environment"]["threads"]
                      for _, record in named_records if record.get("fingerprint") or one_invocation(record)})
    unknown = [name for name, record in named_records if not record.get("fingerprint") and not one_invocation(record)]
    dtypes = sorted({record["model"].get("dtype", "torch.float32").removeprefix("torch.") for _, record in named_records})
    tasks = sorted({task for _, record in named_records for task in record["results"]})
    math_runs = [record for _, record in named_records if "math" in record["results"]]
    free = ""
    if math_runs:
        budgets = sorted({int(b) for record in math_runs for b in record["config"]["budgets"]})
        tokens = sorted({record["results"]["math"]["meta"]["max_new_tokens"] for record in math_runs})
        greedy = all(record["results"]["math"]["meta"].get("temperature", 0.6) == 0 for record in math_runs)
        free = (f"; only the math runs generate freely ({'greedy' if greedy else 'sampled'}, up to "
                f"{', '.join(f'{t:,}' for t in tokens)} new tokens, budgets {', '.join(map(str, budgets))})")
    lines = [f"Models: {'; '.join(described)}. None is a reasoning-trained model (the paper measures DeepSeek-R1 "
             "distills and Qwen3 with thinking): their reasoning traces are instruct models' (a base model's) sampled "
             "answers to math problems, far shorter and less structured than a reasoning model's 30K-token thoughts.",
             f"Hardware: {', '.join(devices)} only ({'/'.join(map(str, threads))} thread{'' if threads == [1] else 's'}"
             + (f"; not recorded for {', '.join(f'`{n}`' for n in unknown)}, whose cells earlier invocations computed"
                if unknown else "") + f"); dtypes {', '.join(dtypes)}.",
             f"Tasks: {', '.join(tasks)}. Fidelity and attention recall are teacher-forced: a fixed text (each model's "
             f"own traces) is fed through every method's cache, so a method's mistakes do not compound as in free "
             f"generation{free}."]
    sampling = {}
    for _, record in named_records:
        label = trace_sampling(record)
        if label:
            sampling.setdefault(label, set()).add(record["model"]["name"])
    if sampling:
        lines.append("Trace sampling (full attention, each model's own traces): " + "; ".join(
            f"{', '.join(sorted(models))}: {label}" for label, models in sampling.items()) + ".")
    lines.append("Not run here: the paper's setting (a reasoning model, AIME 2024 + 2025, 8 samples per problem, up to "
                 "32K new tokens, B = 2,048), which needs a GPU: `bash scripts/bench_paper_setting.sh [MODEL]` runs it "
                 "(calibration text, statistics, the accuracy run and its page) as one resumable command.")
    for name in models:
        entry = REGISTRY.get(name)
        if entry is not None and entry.withdrawn:
            lines.append(f"Withdrawn ({name}): {entry.withdrawn}.")
    return lines


def shipped_trace_validity(markdown: bool = True) -> str | None:
    """Validity of every trace set trikv ships (one row per model and split), computed from the files' own
    `validity` figures, so a set a page runs no fidelity on still shows whether it could enter the headline: the
    ranges of the rule's figures (masked zlib ratio, longest masked repeat), the line-template share reported beside
    them, the traces that fail, and how the set was sampled."""
    from .traces import SPLITS, TRACES_DIR, load_traces, sampling_label
    from .validity import Validity, judged_by_this_rule, set_is_usable

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
    from .traces import SPLITS, TRACES_DIR, load_traces
    from .validity import MAX_REPEAT_SHARE, MIN_MASKED_COMPRESSION, judged_by_this_rule

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


def dedup_history_lines(sweep_path: str | Path | None = None) -> list[str]:
    """How `triattention-dedup` came about, computed from its shipped weight sweep (so the page cannot tell it
    otherwise): what it was tuned on, what R-KV scored there, when it became the first registration's candidate."""
    from importlib.resources import files

    path = Path(sweep_path) if sweep_path else Path(str(files("trikv") / "data" / "calibration" / "triattention-dedup-weight.json"))
    sweep = json.loads(path.read_text())
    best, rkv = sweep["best"], sweep["rkv"]["mean_kl"]
    beaten = all(rkv < entry["mean_kl"] for entry in sweep["sweep"])
    weights = ", ".join(f"{entry['redundancy_weight']:g}" for entry in sweep["sweep"])
    return [f"`triattention-dedup` is trikv's own variant, not a published method. Its redundancy weight "
            f"{best['redundancy_weight']:g} was tuned by `{sweep['command']}` on {sweep['text']}: mean KL "
            f"{best['mean_kl']:.4f} at the chosen weight against R-KV's {rkv:.4f} on the same text"
            + (f" (R-KV beat every weight tried: {weights})" if beaten else "") + ".",
            "It became the first registration's candidate after its results on MATH-500 rows 0-99 had been seen "
            "(`docs/results-earlier.md`); the second registration tests TriAttention itself against R-KV."]


def registered_tests(preregistration: dict) -> list[dict]:
    """The tests of a registration file: `{"tests": [...]}`, or one test as its own object."""
    return list(preregistration["tests"]) if "tests" in preregistration else [preregistration]


def registered_problems(test: dict) -> list[str] | None:
    """Problem ids a test was registered on (`rows`: inclusive [first, last] ranges), or None when it gives a count only."""
    if "rows" not in test:
        return None
    return [f"{test['dataset']}-{row}" for first, last in test["rows"] for row in range(first, last + 1)]


def paired_reading(differences, margin: float, inferior: bool = True) -> tuple[float, float, float, str]:
    """(difference, low, high, reading) of per-problem paired differences (candidate - baseline, each in [-1, 1]):
    the mean with its paired 95% percentile bootstrap interval over problems (`intervals`: 2,000 resamples, seed 0),
    read as superior (low > 0), non-inferior (low > -margin), inferior (the whole interval below the margin:
    high < -margin; `inferior=False` leaves it out, as the registered reading did) or inconclusive."""
    import numpy as np

    from .intervals import percentile_interval, resample_weights

    differences = np.asarray(differences, dtype=np.float64)
    low, high = percentile_interval(resample_weights(len(differences)) @ differences / len(differences))
    reading = ("superior" if low > 0 else "non-inferior" if low > -margin else
               "inferior" if inferior and high < -margin else "inconclusive")
    return float(differences.mean()), low, high, reading


def _answers(named_records: dict, run: str, dataset: str, method: str, budget: str) -> dict | None:
    cell = _cell((named_records.get(run) or {}).get("results", {}).get("math", {}).get(dataset, {}), method, budget)
    return cell["by_problem"] if cell and "by_problem" in cell else None


def quoted_outcome(page: str | Path | None, run: str) -> str | None:
    """The outcome line a replaced page printed for the registered test run in folder `run`, or None: the section
    of `page` that names the run and its `- Outcome:` line."""
    if not page or not Path(page).is_file():
        return None
    for section in Path(page).read_text(encoding="utf-8").split("\n## ")[1:]:
        if f"Run: `{run}`" not in section:
            continue
        for line in section.splitlines():
            if line.startswith("- Outcome:") and "not run yet" not in line:
                return line.removeprefix("- Outcome:").strip()
    return None


def preregistration_lines(preregistration: dict, named_records: list[tuple[str, dict]],
                          earlier_tests: list[dict] = (), replaced_page: str | Path | None = None) -> list[str]:
    """One registered test as registered, and its outcome computed from the named run (or 'not run yet'; where the
    run folder is not on the page but `replaced_page` printed its outcome, that line, quoted and labelled so).

    A test with a `reading` is judged by it (`paired_reading`) for its primary and secondary comparisons, at its
    budget and, where the run has it, its secondary budget; its `pooled` figure adds the problems of the earlier
    test it names. A test without one (the first registration) keeps its own rule: the candidate's point estimate
    >= the baseline's."""
    if "reading" not in preregistration:
        return _first_registration_lines(preregistration, named_records, replaced_page)
    test, records = preregistration, dict(named_records)
    problems = registered_problems(test)
    margin = float(test["reading"]["margin"])
    addendum = test.get("reading_addendum") or {}
    inferior = "inferior" in addendum or "inferior" in test["reading"]
    lines = [f"`{test['id']}`, registered {test['registered']} (commit before any run on its rows): {test['problems']} "
             f"problems, {test['dataset']} rows " + ", ".join(f"{a}-{b}" for a, b in test["rows"])
             + f" ({test['why_these_rows']}); {test['setting']}; methods {', '.join(f'`{m}`' for m in test['methods'])}.",
             f"Endpoint: {test['endpoint']}. Reading: superior if the lower bound > 0, non-inferior if it is > -{100 * margin:g} "
             + (f"points, inferior if the upper bound < -{100 * margin:g} points, otherwise inconclusive." if inferior
                else "points, otherwise inconclusive.")]
    if addendum:
        lines.append(f"Reading addendum, {addendum['added']}: {addendum['note']}")
    lines += [f"Power, stated before the run (`{test['power']['command']}`): {test['power']['plain_statement']}",
              f"Run: `{test['run']}`: `{test['command']}`"]
    lines += registered_cell_lines(test, records.get(test["run"]))
    comparisons = [("primary", test["primary"])] + [("secondary", pair) for pair in test.get("secondary", [])]
    budgets = [("", str(test["budget"]))]
    if test.get("secondary_budget") is not None:
        budgets.append(("secondary budget, ", str(test["secondary_budget"])))
    earlier = {t.get("id"): t for t in earlier_tests}
    for budget_label, budget in budgets:
        for role, pair in comparisons:
            candidate, baseline = pair["candidate"], pair["baseline"]
            label = f"{budget_label}{role}, B={budget}: `{candidate}` - `{baseline}`"
            label = label[0].upper() + label[1:]
            ours = _answers(records, test["run"], test["dataset"], candidate, budget)
            theirs = _answers(records, test["run"], test["dataset"], baseline, budget)
            if ours is None or theirs is None:
                missing = [m for m, answers in ((candidate, ours), (baseline, theirs)) if answers is None]
                lines.append(f"{label}: no outcome yet (not run: {', '.join(f'`{m}`' for m in missing)}).")
                continue
            shared = [q for q in problems if q in ours and q in theirs]
            if len(shared) < len(problems):
                lines.append(f"{label}: interim, no outcome yet ({len(shared)} of {len(problems)} problems answered by both).")
                continue
            difference, low, high, reading = paired_reading([ours[q] - theirs[q] for q in shared], margin, inferior)
            better = sum(ours[q] > theirs[q] for q in shared)
            worse = sum(ours[q] < theirs[q] for q in shared)
            accuracy = lambda answers: sum(answers[q] for q in shared) / len(shared)
            lines.append(f"{label}: {accuracy(ours):.3f} vs {accuracy(theirs):.3f} on {len(shared)} problems, "
                         f"{100 * difference:+.1f} points [95% paired bootstrap {100 * low:+.1f}, {100 * high:+.1f}] "
                         f"(+{better} / -{worse} problems, sign test p {sign_test(better, worse):.2f}): **{reading}** "
                         + ("by the reading's addendum." if reading == "inferior" else "by the registered reading."))
            pooled_test = earlier.get((test.get("pooled_with") or {}).get("test"))
            if pooled_test is not None and str(pooled_test["budget"]) == budget:
                old_ours = _answers(records, pooled_test["run"], pooled_test["dataset"], candidate, budget)
                old_theirs = _answers(records, pooled_test["run"], pooled_test["dataset"], baseline, budget)
                if old_ours is not None and old_theirs is not None:
                    old = [q for q in old_ours if q in old_theirs]
                    pooled = [ours[q] - theirs[q] for q in shared] + [old_ours[q] - old_theirs[q] for q in old]
                    difference, low, high, reading = paired_reading(pooled, margin, inferior)
                    lines.append(f"  Pooled with `{pooled_test['id']}` ({len(pooled)} problems; not the registered outcome: "
                                 f"those rows were seen before this registration): {100 * difference:+.1f} points "
                                 f"[{100 * low:+.1f}, {100 * high:+.1f}], {reading}.")
                else:
                    lines.append(f"  Pooled with `{pooled_test['id']}`: not computed: the per-problem answers of "
                                 f"`{candidate}` and `{baseline}` on its rows (run `{pooled_test['run']}`) are not on this page.")
    return lines


def registered_cell_lines(test: dict, record: dict | None) -> list[str]:
    """Every cell the test registered (its methods at its budget and secondary budget): run (with the commit and
    thread count that produced it, where recorded), interim, or not run with the reason and the compute it needs
    at the pace of the run's finished cells."""
    from .provenance import one_invocation

    problems = registered_problems(test) or []
    dataset = test["dataset"]
    budgets = [str(test["budget"])] + ([str(test["secondary_budget"])] if test.get("secondary_budget") is not None else [])
    table = (record or {}).get("results", {}).get("math", {}).get(dataset, {})
    cells = (record or {}).get("cells") or {}
    seconds = [value for key, value in ((record or {}).get("unit_seconds") or {}).items() if key.startswith(f"math-{dataset}/")]
    per_cell = sum(seconds) / len(seconds) / 60 if seconds else None
    lines = [f"Registered cells ({', '.join(f'`{m}`' for m in test['methods'])} at B = {' and '.join(budgets)}; full attention "
             "does not depend on the budget, so it has one cell):"]
    unrecorded, missing = [], []
    for budget in budgets:
        for method in test["methods"]:
            if method == "full" and budget != budgets[0]:
                continue
            label = f"`{method}`" + ("" if method == "full" else f" B={budget}")
            cell = _cell(table, method, budget)
            answers = cell.get("by_problem") if cell else None
            if answers and all(problem in answers for problem in problems):
                fingerprint = (cells.get(f"math-{dataset}/{method}/{None if method == 'full' else budget}") or {}).get("fingerprint")
                if fingerprint:
                    commit = (fingerprint.get("commit") or {}).get("commit", "no git commit")[:10]
                    lines.append(f"  {label}: run, {len(problems)} problems (commit `{commit}`, {fingerprint['threads']} "
                                 f"thread(s), {fingerprint['dtype']})")
                else:
                    unrecorded.append(label)
                    lines.append(f"  {label}: run, {len(problems)} problems (commit and thread count not recorded)")
                continue
            if answers:
                lines.append(f"  {label}: interim, {sum(problem in answers for problem in problems)} of {len(problems)} "
                             "problems answered")
                continue
            missing.append(label)
            pace = (f"about {per_cell:.0f} min at the pace of this run's finished cells ({60 * per_cell / len(problems):.0f} s "
                    "per problem)") if per_cell and problems else "no finished cell to time it by"
            if budget == budgets[0]:
                lines.append(f"  {label}: not run (compute: {pace})")
            else:
                lines.append(f"  {label}: not run ({test.get('secondary_budget_note', 'secondary budget')}; {pace})")
    if missing and per_cell:
        lines.append(f"  Missing: {len(missing)} cells, about {len(missing) * per_cell / 60:.1f} h of compute at that pace.")
    if unrecorded and record is not None and "environment" in record:
        note = (f"the {record['environment']['threads']} thread(s) results.json names is the thread count of the "
                f"invocation that collected the cells, which computed {record['wall_seconds'] / 60:.1f} of their "
                f"{record.get('compute_seconds', 0) / 60:.1f} min" if not one_invocation(record) else
                f"results.json names {record['environment']['threads']} thread(s) for the invocation that computed them")
        lines.append(f"  The commit and thread count that produced {', '.join(unrecorded)} were not recorded (the cells "
                     f"were written before cells recorded a fingerprint); {note}.")
    elif unrecorded:
        lines.append(f"  The commit and thread count that produced {', '.join(unrecorded)} were not recorded.")
    return lines


def _first_registration_lines(preregistration: dict, named_records: list[tuple[str, dict]],
                              replaced_page: str | Path | None = None) -> list[str]:
    """The first registration's own rule: the candidate's pass@1 >= the baseline's on the registered problems."""
    candidate, baseline = preregistration["candidate"], preregistration["baseline"]
    budget, dataset = str(preregistration["budget"]), preregistration["dataset"]
    lines = [f"Registered {preregistration['registered']} (commit before the run): {preregistration['hypothesis']}",
             f"Candidate: `{candidate}`. Why this one: {preregistration['rationale']}",
             f"Run: `{preregistration['run']}`: `{preregistration['command']}`"]
    if preregistration.get("correction"):
        lines.insert(2, f"Correction: {preregistration['correction']}")
    record = dict(named_records).get(preregistration["run"])
    table = (record or {}).get("results", {}).get("math", {}).get(dataset, {})
    cell, other = _cell(table, candidate, budget), _cell(table, baseline, budget)
    if not cell or not other or "by_problem" not in cell or "by_problem" not in other:
        quoted = quoted_outcome(replaced_page, preregistration["run"])
        lines.append(f"Outcome, quoted from [{Path(replaced_page).name}]({Path(replaced_page).name}) (the answers of "
                     f"`{candidate}` and `{baseline}` it was computed from are not on this page, so it is not recomputed "
                     f"here): {quoted}" if quoted else "Outcome: not run yet.")
        return lines
    gained, lost, better, worse = _paired(cell, other)
    shared = [problem for problem in cell["by_problem"] if problem in other["by_problem"]]
    ours = sum(cell["by_problem"][q] for q in shared) / len(shared)
    theirs = sum(other["by_problem"][q] for q in shared) / len(shared)
    registered = preregistration.get("problems")
    # paired 95% bootstrap interval of the difference, resampling problems (both methods on the same resamples)
    import numpy as np

    from .intervals import percentile_interval, resample_weights

    differences = np.array([cell["by_problem"][q] - other["by_problem"][q] for q in shared], dtype=np.float64)
    low, high = percentile_interval(resample_weights(len(shared)) @ differences / len(shared))
    figures = (f"`{candidate}` {ours:.3f} vs `{baseline}` {theirs:.3f} on {len(shared)} problems "
               f"({100 * (ours - theirs):+.1f} points [95% paired bootstrap {100 * low:+.1f}, {100 * high:+.1f}]; "
               f"+{gained:g} / -{lost:g} problems, two-sided sign test p {sign_test(better, worse):.2f})")
    if registered is not None and len(shared) < registered:  # judged only on the registered problems, all of them
        lines.append(f"Interim, no outcome yet: {figures}; the test is judged when both have answered all {registered}.")
        return lines
    separated = ("the interval spans 0: the two are not distinguishable on these problems" if low <= 0 <= high
                 else "the interval excludes 0")
    lines.append(f"Outcome: {figures}: the pre-registered hypothesis is " + ("**met**" if ours >= theirs else "**not met**")
                 + f" ({separated}).")
    ran = sorted(method for method in table if _cell(table, method, budget))
    lines.append(f"Methods run on these problems: {', '.join(f'`{m}`' for m in ran)}.")
    return lines


def registered_targets(tests: list[dict], named_records: list[tuple[str, dict]]) -> list[Target]:
    """(what each registered test checks, met) with the outcome computed from the runs on the page, by the test's
    own rule: the first registration's `candidate >= baseline` on pass@1; a test with a `reading`, per comparison and
    budget, met when it reads superior or non-inferior, not met when inferior. Outcomes the page cannot compute
    (not run, interim, answers not on the page) and inconclusive readings are not judged (None)."""
    records = dict(named_records)
    targets: list[Target] = []
    for index, test in enumerate(tests):
        name = f"`{test.get('id', index + 1)}`"
        if "reading" not in test:
            candidate, baseline, budget = test["candidate"], test["baseline"], str(test["budget"])
            ours = _answers(records, test["run"], test["dataset"], candidate, budget)
            theirs = _answers(records, test["run"], test["dataset"], baseline, budget)
            met = None
            if ours is not None and theirs is not None:
                shared = [q for q in ours if q in theirs]
                registered = test.get("problems")
                if shared and (registered is None or len(shared) >= int(registered)):
                    met = sum(ours[q] for q in shared) >= sum(theirs[q] for q in shared)
            targets.append((f"{name}: `{candidate}` pass@1 >= `{baseline}`'s at B={budget}", met))
            continue
        problems = registered_problems(test) or []
        margin = float(test["reading"]["margin"])
        inferior = "inferior" in (test.get("reading_addendum") or {}) or "inferior" in test["reading"]
        budgets = [str(test["budget"])] + ([str(test["secondary_budget"])] if test.get("secondary_budget") is not None else [])
        for budget in budgets:
            for pair in [test["primary"], *test.get("secondary", [])]:
                candidate, baseline = pair["candidate"], pair["baseline"]
                ours = _answers(records, test["run"], test["dataset"], candidate, budget)
                theirs = _answers(records, test["run"], test["dataset"], baseline, budget)
                met = None
                if ours is not None and theirs is not None and problems and all(q in ours and q in theirs for q in problems):
                    reading = paired_reading([ours[q] - theirs[q] for q in problems], margin, inferior)[3]
                    met = True if reading in ("superior", "non-inferior") else False if reading == "inferior" else None
                targets.append((f"{name}: `{candidate}` at least non-inferior to `{baseline}` at B={budget}", met))
    return targets


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
                  "(`validity.derive_thresholds`, pinned by a test); the rule was committed before any trace set was "
                  "judged under it. Computed from the shipped trace files (`src/trikv/benchmarks/quality/data/traces/`); "
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
