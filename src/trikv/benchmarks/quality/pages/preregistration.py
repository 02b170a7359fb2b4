"""The pre-registered held-out tests on the page: each test as registered, its registered cells, its outcome
computed from the runs by the test's own rule (`registered_targets` for the page header), and how
`triattention-dedup`, the first registration's candidate, came about.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...report_pages import Target
from .cells import table_cell
from .verdicts import paired_counts, sign_test


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

    from ..intervals import percentile_interval, resample_weights

    differences = np.asarray(differences, dtype=np.float64)
    low, high = percentile_interval(resample_weights(len(differences)) @ differences / len(differences))
    reading = ("superior" if low > 0 else "non-inferior" if low > -margin else
               "inferior" if inferior and high < -margin else "inconclusive")
    return float(differences.mean()), low, high, reading


def _answers(named_records: dict, run: str, dataset: str, method: str, budget: str) -> dict | None:
    cell = table_cell((named_records.get(run) or {}).get("results", {}).get("math", {}).get(dataset, {}), method, budget)
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
    from ..provenance import one_invocation

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
            cell = table_cell(table, method, budget)
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
    cell, other = table_cell(table, candidate, budget), table_cell(table, baseline, budget)
    if not cell or not other or "by_problem" not in cell or "by_problem" not in other:
        quoted = quoted_outcome(replaced_page, preregistration["run"])
        lines.append(f"Outcome, quoted from [{Path(replaced_page).name}]({Path(replaced_page).name}) (the answers of "
                     f"`{candidate}` and `{baseline}` it was computed from are not on this page, so it is not recomputed "
                     f"here): {quoted}" if quoted else "Outcome: not run yet.")
        return lines
    gained, lost, better, worse = paired_counts(cell, other)
    shared = [problem for problem in cell["by_problem"] if problem in other["by_problem"]]
    ours = sum(cell["by_problem"][q] for q in shared) / len(shared)
    theirs = sum(other["by_problem"][q] for q in shared) / len(shared)
    registered = preregistration.get("problems")
    # paired 95% bootstrap interval of the difference, resampling problems (both methods on the same resamples)
    import numpy as np

    from ..intervals import percentile_interval, resample_weights

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
    ran = sorted(method for method in table if table_cell(table, method, budget))
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
