"""The tables of one run, section by section (fidelity, attention recall, what the methods hold, trace validity,
DFS, passkey, prefill, math): Markdown for the page, plain text for the terminal (`text_tables`), and the run's
figures as CSV rows (`csv_rows`).
"""

from __future__ import annotations

import math

from ....policies.h2o import H2O
from .cells import (ORACLE_LABEL, ORACLE_NOTE, budget_grid, format_difference, format_interval, format_value,
                    protected_mask, recall_horizon_labels, render, run_budgets, run_methods, table_cell)
from .verdicts import diagnosis, paired_counts, sign_test


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
            headers, rows = budget_grid(record, table, lambda c, k=key: c[k])
            out.append((f"Fidelity: {title} ({note}; every position, also those before the first round)",
                        render(headers, rows, markdown)))
        return out
    for title, key, digits in FIDELITY_FIGURES:
        headers, rows = budget_grid(record, table, lambda c, k=key, d=digits: format_interval(
            c["compressed"].get(k), c.get("ci", {}).get("compressed", {}).get(k), d))
        out.append((f"Fidelity where compression acts: {title} [95% bootstrap interval over texts] ({note}; only the "
                    "positions after each text's first compression round)", render(headers, rows, markdown)))
    share = _compressed_share(record, table)
    if share:
        room = record.get("config", {}).get("min_decode_room", 32)
        h2o = "h2o" in run_methods(record)
        out.append(("Fidelity: share of the scored positions that come after the first compression round, and the "
                    f"texts whose prompt was protected (prompt + {room} slots <= budget, the same for every method)"
                    + ("; `h2o` without heavy hitters: the texts whose protected prompt leaves no slot beside H2O's recent "
                       "window (prompt >= budget - window, the window half the budget), where H2O keeps exactly "
                       "StreamingLLM's entries (prompt + recent tokens) and is not H2O as its paper defines it" if h2o else ""),
                    render(["budget", "compressed positions / all", "prompt protected", *(["h2o without heavy hitters"] if h2o else [])],
                           [row if h2o else row[:3] for row in share], markdown)))
    for title, key, digits in FIDELITY_FIGURES[:2]:
        headers, rows = budget_grid(record, table, lambda c, k=key, d=digits: format_difference(
            c.get("vs_triattention", {}).get("compressed", {}).get(k), d),
            [m for m in run_methods(record) if m not in ("full", "triattention")])
        if any(cell != "–" for row in rows for cell in row[1:]):
            better = "higher" if key == "top1_agreement" else "lower"
            out.append((f"Fidelity where compression acts: {title}, each method minus triattention, paired over texts "
                        f"[95% interval] ({better} is better for the method)", render(headers, rows, markdown)))
    def every_position(cell: dict) -> str:
        intervals = cell.get("ci", {}).get("all", {})
        ratio = cell.get("perplexity_ratio", cell["perplexity"] / cell["perplexity_full"])
        return (f"{format_interval(cell['top1_agreement'], intervals.get('top1_agreement'), 3)} / "
                f"{format_interval(cell['kl'], intervals.get('kl'), 4)} / {format_interval(ratio, intervals.get('perplexity_ratio'), 3)}")

    headers, rows = budget_grid(record, table, every_position)
    out.append((f"Fidelity over every position (also those before the first round, where every method equals full "
                f"attention): top-1 / KL / perplexity ratio [95% bootstrap interval over texts] ({note})",
                render(headers, rows, markdown)))
    return out


def _compressed_share(record: dict, table: dict) -> list[list]:
    """Per budget: the scored positions after the first round, and the texts whose prompt was protected (one
    rule for every method, so one figure per budget)."""
    rows = []
    for budget in run_budgets(record):
        cell = next((table_cell(table, m, budget) for m in run_methods(record) if m != "full" and table_cell(table, m, budget)), None)
        if cell and cell.get("positions"):
            protected = heavyless = "–"
            prompts = protected_mask(record, budget)
            if prompts is not None:
                fits, lengths = prompts
                protected = f"{int(fits.sum())} / {len(lengths)}"
                # H2O's window is half the budget: a protected prompt at least the other half leaves no heavy hitter
                no_heavy = fits & (lengths >= int(budget) - int(H2O.recent_ratio * int(budget)))
                heavyless = f"{int(no_heavy.sum())} / {len(lengths)}"
            rows.append([budget, f"{cell['compressed']['positions']} / {cell['positions']} "
                                 f"({100 * cell['compressed']['positions'] / cell['positions']:.0f}%)", protected,
                         heavyless])
    return rows


def _recall_sections(record: dict, markdown: bool) -> list[tuple[str, str]]:
    table = record["results"]["recall"]["methods"]
    out = []
    methods = run_methods(record) + (["oracle"] if "oracle" in table else [])
    label_of = lambda m: ORACLE_LABEL if m == "oracle" else m
    headers, rows = budget_grid(record, table, lambda c: format_interval(c["recall"], c.get("ci", {}).get("recall"), 3)
                          + f" (min head {format_value(c['recall_min_head'])})", methods)
    for row in rows:
        row[0] = label_of(row[0])
    out.append(("Attention recall: share of full attention's mass on the keys a method holds, mean over (layer, head) "
                "[95% bootstrap interval over texts] (minimum head); " + ORACLE_NOTE, render(headers, rows, markdown)))
    labels = recall_horizon_labels(record)
    for budget in run_budgets(record):
        rows = []
        for method in methods:
            cell = table_cell(table, method, budget)
            if method == "full" or cell is None:
                continue
            rows.append([label_of(method)] + [format_interval(cell["by_horizon"].get(h, {}).get("recall"),
                                                        cell.get("ci", {}).get("by_horizon", {}).get(h), 3) for h in labels])
        mass = _horizon_mass(table, budget, labels)
        rows.append(["(share of mass)"] + [format_value(m) for m in mass])
        out.append((f"Attention recall by horizon (tokens since the key was first judged), budget {budget} "
                    "[95% bootstrap interval over texts]", render(["method"] + labels, rows, markdown)))
        paired_rows = []
        for method in run_methods(record):
            cell = table_cell(table, method, budget)
            if method in ("full", "triattention") or cell is None or "vs_triattention" not in cell:
                continue
            comparison = cell["vs_triattention"]
            paired_rows.append([method, format_difference(comparison["recall"], 3)]
                               + [format_difference(comparison["by_horizon"].get(h), 3) for h in labels])
        if paired_rows:
            out.append((f"Attention recall, each method minus triattention, paired over texts [95% interval], budget "
                        f"{budget} (higher is better for the method)", render(["method", "all"] + labels, paired_rows, markdown)))
    kinds = [k for k in ("prompt", "repeated", "other")
             if any(k in (c or {}).get("by_kind", {}) for v in table.values() for c in v.values())]
    if kinds:
        for budget in run_budgets(record):
            rows = []
            for method in methods:
                cell = table_cell(table, method, budget)
                if method == "full" or cell is None or not cell.get("by_kind"):
                    continue
                intervals = cell.get("ci", {}).get("by_kind", {})
                rows.append([label_of(method)] + [format_interval(cell["by_kind"].get(k, {}).get("recall"), intervals.get(k), 3)
                                                  for k in kinds])
            shares = next((c["by_kind"] for m in methods if m != "full" for c in [table_cell(table, m, budget)] if c and c.get("by_kind")), {})
            rows.append(["(share of mass)"] + [format_value(shares.get(k, {}).get("mass_share")) for k in kinds])
            out.append((f"Attention recall by key kind, budget {budget} [95% bootstrap interval over texts] (keys already "
                        "judged by a round; prompt, repeated = part of an 8-token run the text already holds, other)",
                        render(["method"] + kinds, rows, markdown)))
    return out


def _horizon_mass(table, budget, labels) -> list:
    for method, values in table.items():
        cell = values.get(budget)
        if method != "full" and cell:
            return [cell["by_horizon"].get(h, {}).get("mass_share") for h in labels]
    return [None] * len(labels)


def _composition_sections(record: dict, markdown: bool) -> list[tuple[str, str]]:
    from ..fidelity import COMPOSITION

    table = record["results"]["fidelity"]["methods"]
    out = []
    for budget in run_budgets(record):
        rows = []
        for method in run_methods(record):
            cell = table_cell(table, method, budget)
            if method != "full" and cell and cell.get("kept_composition"):
                intervals = cell.get("composition_ci", {})
                rows.append([method] + [format_interval(cell["kept_composition"][name], intervals.get(name), 3) for name in COMPOSITION])
        if rows:
            out.append((f"What each method holds right after a round, budget {budget} (share of the held entries, all "
                        "rounds, layers and KV heads [95% bootstrap interval over texts]): prompt, repeated text, else by age",
                        render(["method", *COMPOSITION], rows, markdown)))
    return out


def _validity_sections(record: dict, markdown: bool) -> list[tuple[str, str]]:
    """The validity figures of the traces the run fed, as the run recorded them, and each trace's verdict under the
    current rule where the shipped file holds it (a run judged under an earlier rule says which)."""
    from ..provenance import same_trace_figures
    from ..traces import load_traces
    from ..validity import EARLIER_RULES, judged_by_this_rule

    meta = record["results"].get("fidelity", {}).get("meta", {})
    validity = meta.get("trace_validity")
    if not validity:
        return []
    try:
        shipped = {trace.name: trace.validity for trace in load_traces(record["config"]["model"], record["config"]["traces"])}
    except (FileNotFoundError, ValueError, KeyError):
        shipped = {}
    def current(name: str, fed: dict) -> str:
        now = shipped.get(name)
        if now and not same_trace_figures(fed, now):
            return "– (written again since)"
        return ("yes" if now["valid"] else "**no**") if judged_by_this_rule(now) else "–"
    earlier = sorted({figures.get("rule") for figures in validity.values() if figures and not judged_by_this_rule(figures)},
                     key=str)
    rows = []
    for name, figures in validity.items():
        if not figures:
            continue
        masked = figures.get("masked_compression")
        rows.append([name, figures["tokens"], figures["attempts"], figures["rejected"], format_value(figures["compression"]),
                     format_value(masked) if masked is not None else "–",
                     f"{100 * figures['repeat_share']:.1f}%" + (" (tokens)" if figures.get("rule") is None else ""),
                     "yes" if figures["valid"] else "**no**", current(name, figures), "yes" if name in meta["texts"] else "no"])
    title = ("Reasoning traces the run fed: validity as the run recorded it"
             + "".join(f" (under an earlier rule: {EARLIER_RULES.get(rule, rule)})" for rule in earlier)
             + ", and under the current rule (the shipped file's verdict, where it still ships the trace the run fed)")
    return [(title, render(["trace", "tokens", "answers glued", "rejected as loops", "zlib ratio", "masked zlib ratio",
                            "longest repeat", "valid (as recorded)", "valid (current rule)", "fed"], rows, markdown))]


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
            headers, rows = budget_grid(record, table, lambda c: f"{format_value(c['node'], 2)}/{format_value(c['stack'], 2)}/{format_value(c['visited'], 2)}/{format_value(c['all'], 2)}")
            n_items = next(iter(next(iter(table.values())).values()))["items"]
            out.append((f"DFS state query ({title}, {n_items} queries): node / stack exact / visited exact / all three",
                        render(headers, rows, markdown)))
            token_level = "stack_tokens" in next(iter(next(iter(table.values())).values()))
            if token_level:
                headers, rows = budget_grid(record, table, lambda c: f"{format_value(c['node_tokens'], 2)}/{format_value(c['stack_tokens'], 2)}/{format_value(c['visited_tokens'], 2)}")
                out.append((f"DFS ({title}): share of answer tokens that are the greedy choice, node / stack / visited",
                            render(headers, rows, markdown)))
            ks = [str(k) for k in record["config"]["dfs_ks"]]
            # exact accuracy by k for both modes; teacher-forced runs add the greedy token share by k
            for metric, what in [("", "exact accuracy")] + ([("_tokens", "greedy token share")] if token_level else []):
                for budget in run_budgets(record):
                    rows = []
                    for method in run_methods(record):
                        cell = table_cell(table, method, budget)
                        if cell is None:
                            continue
                        rows.append([method] + [
                            f"{format_value(cell['by_k'][k]['stack' + metric], 2)}/{format_value(cell['by_k'][k]['visited' + metric], 2)}"
                            if k in cell["by_k"] else "–" for k in ks])
                    out.append((f"DFS ({title}) stack / visited {what} by step k, budget {budget}",
                                render(["method"] + [f"k={k}" for k in ks], rows, markdown)))
    if "needle" in results:
        table = results["needle"]["methods"]
        meta = results["needle"]["meta"]
        headers, rows = budget_grid(record, table, lambda c: f"{format_value(c['accuracy'], 2)} ({format_value(c['needle_in_cache'], 2)})")
        out.append((f"Passkey retrieval accuracy (share of layer/heads still holding the key), lengths {meta['lengths']}, "
                    f"depths {meta['depths']}", render(headers, rows, markdown)))
        depths = [f"{d:g}" for d in meta["depths"]]
        for budget in run_budgets(record):
            rows = []
            for method in run_methods(record):
                cell = table_cell(table, method, budget)
                if cell is not None:
                    rows.append([method] + [format_value(cell["by_depth"].get(d, {}).get("accuracy"), 2) for d in depths])
            out.append((f"Passkey accuracy by needle depth, budget {budget}", render(["method"] + [f"depth {d}" for d in depths], rows, markdown)))
    if "prefill" in results:
        out += _prefill_sections(record, markdown)
    if "math" in results:
        math_results = results["math"]
        for dataset in math_results["meta"]["datasets"]:
            table = math_results.get(dataset, {})
            headers, rows = budget_grid(record, table, lambda c: f"{format_interval(c['pass@1'], c.get('ci', {}).get('pass@1'), 3)} "
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
            protection = budget_grid(record, table, lambda c: format_value(c.get("prompt_protected"), 2),
                               [m for m in run_methods(record) if m != "full"])
            if any(cell not in ("–", None) for row in protection[1] for cell in row[1:]):
                out.append((f"Math {dataset}: share of answers whose prompt was protected (one rule for every method: "
                            f"prompt + {meta.get('min_decode_room', 32)} slots <= budget)", render(*protection, markdown)))
            caps = {cap for methods in table.values() for cell in methods.values() for cap in cell.get("answers_by_cap", {})}
            if len(caps) > 1:
                headers, rows = budget_grid(record, table, lambda c: ", ".join(
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
    for budget in run_budgets(record):
        for method in run_methods(record):
            during, after = table_cell(prefill["during"], method, budget), table_cell(prefill["after"], method, budget)
            difference = (prefill["during_minus_after"].get(method) or {}).get(budget)
            if during is None or after is None or difference is None:
                continue
            kl = difference["kl"]
            low, high = kl["ci"]
            reading = ("compaction during the prefill costs fidelity" if low > 0 else
                       "compaction during the prefill is closer to full attention" if high < 0 else "no difference shown")
            rows.append([budget, method, format_interval(during["kl"], (during.get("ci") or {}).get("all", {}).get("kl"), 4),
                         format_interval(after["kl"], (after.get("ci") or {}).get("all", {}).get("kl"), 4),
                         format_difference(kl, 4), f"{format_value(during['top1_agreement'], 3)} / {format_value(after['top1_agreement'], 3)}",
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


def _math_paired(record: dict, table: dict) -> list[list]:
    """Rows [budget, method, pass@1, points vs full, gained/lost problems vs full, sign-test p, triattention's lead]
    for every compressed cell whose records carry per-problem scores (paired: same problems, so the +/- counts are
    exact)."""
    full = table_cell(table, "full", "")
    if full is None or "by_problem" not in full:
        return []
    rows = []
    for budget in run_budgets(record):
        tri = table_cell(table, "triattention", budget)
        for method in run_methods(record):
            cell = table_cell(table, method, budget)
            if method == "full" or cell is None or "by_problem" not in cell:
                continue
            gained, lost, better, worse = paired_counts(cell, full)
            lead = ("" if tri is None or method == "triattention" else
                    format_difference(cell.get("vs_triattention", {}).get("pass@1"), 1, scale=100)
                    if "vs_triattention" in cell else f"{100 * (cell['pass@1'] - tri['pass@1']):+.1f}")
            rows.append([budget, method, cell["pass@1"], f"{100 * (cell['pass@1'] - full['pass@1']):+.1f}",
                         f"+{gained:g} / -{lost:g}", f"{sign_test(better, worse):.2f}", lead])
    return rows


def _math_variants_against_baselines(record: dict, table: dict) -> list[list]:
    """Rows [budget, TriAttention variant, baseline, points [95% paired interval], +/- problems, sign-test p]: every
    method of the TriAttention family against every other compressed method, problem by problem."""
    from ..intervals import paired_accuracy_interval

    methods = [m for m in run_methods(record) if m != "full"]
    variants = [m for m in methods if m.startswith("triattention")]
    baselines = [m for m in methods if not m.startswith("triattention")]
    rows = []
    for budget in run_budgets(record):
        for variant in variants:
            cell = table_cell(table, variant, budget)
            for baseline in baselines:
                other = table_cell(table, baseline, budget)
                if cell is None or other is None or "by_problem" not in cell or "by_problem" not in other:
                    continue
                gained, lost, better, worse = paired_counts(cell, other)
                interval = paired_accuracy_interval(cell, other)
                points = f"{100 * (cell['pass@1'] - other['pass@1']):+.1f}"
                if interval and not math.isnan(interval[0]):
                    points += f" [{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"
                rows.append([budget, variant, baseline, points, f"+{gained:g} / -{lost:g}", f"{sign_test(better, worse):.2f}"])
    return rows


def text_tables(record: dict) -> str:
    parts = []
    for title, table in sections(record, markdown=False):
        parts.append(f"== {title}\n{table}\n")
    return "\n".join(parts)


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
