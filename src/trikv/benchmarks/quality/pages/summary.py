"""The page's opening sections: the summary of TriAttention against the published baselines over every run
(`summarise_runs`), where it stands model by model beside what differs between the models, and the scope (what
the runs measured and what they did not).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cells import protected_mask, run_budgets, run_methods
from .trace_sets import trace_sampling, trace_set_left_out
from .verdicts import (HEADLINE, MATH, MIN_VERDICT_UNITS, SECONDARY, headline_differences, holm_survivors, kl_ranking,
                       method_role, resampled_units, sign_flip_p, verdict_groups)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def model_factors(record: dict) -> dict:
    """What the run records, or the statistics it used ship, about the conditions TriAttention scored under:
    {"parameters", "concentration": (mean, low, high) over the scored layers, "scored_layers", "num_layers",
    "calibration_tokens", "sampling"}; a field is absent where nothing records it (statistics other than the
    shipped file say nothing here)."""
    from ..provenance import stats_match

    factors: dict = {}
    if record.get("model", {}).get("parameters"):
        factors["parameters"] = record["model"]["parameters"]
    concentration = ((record["results"].get("recall") or {}).get("meta") or {}).get("concentration_per_layer")
    if concentration:
        factors["concentration"] = (sum(concentration) / len(concentration), min(concentration), max(concentration))
    if stats_match(record):
        from ....calibration import QueryStats, bundled_stats_path

        stats = QueryStats.load(bundled_stats_path(record["config"]["model"]))
        factors["num_layers"], factors["scored_layers"] = stats.metadata["num_layers"], len(stats.layers)
        if stats.metadata.get("token_count"):
            factors["calibration_tokens"] = stats.metadata["token_count"]
    sampling = trace_sampling(record)
    if sampling:
        factors["sampling"] = sampling
    return factors


def protected_prompts(record: dict, budget) -> tuple[int, int] | None:
    """(texts whose prompt the cache protected at `budget`, texts) of a fidelity run; None where it records no
    prompt lengths."""
    mask = protected_mask(record, budget)
    return None if mask is None else (int(mask[0].sum()), len(mask[1]))


def model_factor_line(standings: list[dict]) -> str | None:
    """One sentence per model of TriAttention's headline standing beside what differs between the models (size,
    query concentration of the layers it scores, how many layers compress at all, protected prompts, calibration
    tokens, trace sampling), best standing first; None with fewer than two models. With a handful of models these differ
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
        protected = protected_prompts(standing["record"], standing["budget"])
        if protected:
            facts.append(f"the prompt protected on {protected[0]} of its {protected[1]} texts (a protected prompt takes "
                         "its slots of the budget from every method alike)")
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
    differ; the controls (`random`: what any eviction at the same budget gives), apart; TriAttention's own variants
    and ablations, apart; the secondary metric (attention recall); math. Runs on
    a model's invalid trace set and comparisons over fewer than `MIN_VERDICT_UNITS` texts or problems give no
    verdict; the last line sets the headline comparisons against what chance alone would give."""
    provenance = provenance or {}
    tag = lambda name: f" [{provenance[name].tag()}]" if name in provenance and provenance[name].status != "current" else ""  # noqa: E731
    task, what, get, higher, digits, scale = HEADLINE
    headline, details, variants, controls, secondary, math_lines, notes = [], [], [], [], [], [], []
    standings: list[dict] = []  # TriAttention's headline standing per (run, budget), for `model_factor_line`
    counts = {"leads": 0, "trails": 0, "ties": 0}
    usable_counts = {"leads": 0, "trails": 0, "ties": 0}  # on runs whose inputs stand for what ships now
    published: list[str] = []
    family: list[tuple[float, float, int]] = []  # (p-value, summed KL difference, texts) of every headline comparison
    for name, record in named_records:
        results = record["results"]
        left_out = trace_set_left_out(record)
        if left_out:
            notes.append(f"`{name}` ({record['model']['name']}): left out of the summary, {left_out}.")
            continue
        model = record["model"]["name"]
        if task in results:
            units = resampled_units(record, task, None)
            if units < MIN_VERDICT_UNITS:
                notes.append(f"`{name}` ({model}), {what}: no verdict from {units} texts (at least {MIN_VERDICT_UNITS} needed).")
            else:
                table = results[task]["methods"]
                for budget in run_budgets(record):
                    groups = verdict_groups(record, table, budget, get, higher, digits, scale, ("published",))
                    if not any(groups.values()):
                        continue
                    published += [m for m in run_methods(record) if method_role(m) == "published" and m not in published]
                    for verdict in counts:
                        counts[verdict] += len(groups[verdict])
                        if name not in provenance or provenance[name].usable:
                            usable_counts[verdict] += len(groups[verdict])
                    for method in run_methods(record):
                        differences = (headline_differences(record, budget, method)
                                       if method_role(method) == "published" else None)
                        if differences:
                            family.append((sign_flip_p(differences), sum(differences), len(differences)))
                    ranking = kl_ranking(record, budget)
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
                    own = verdict_groups(record, table, budget, get, higher, digits, scale, ("variant", "baseline ablation"))
                    if any(own.values()):
                        parts = [f"{verdict} {', '.join(items)}" for verdict, items in own.items() if items]
                        variants.append(f"`{name}` ({model}), B={budget}, {what}: TriAttention " + "; ".join(parts) + ".")
                    against_controls = verdict_groups(record, table, budget, get, higher, digits, scale, ("control",))
                    if any(against_controls.values()):
                        parts = [f"{verdict} {', '.join(items)}" for verdict, items in against_controls.items() if items]
                        controls.append(f"`{name}` ({model}), B={budget}, {what}: TriAttention " + "; ".join(parts) + f"{tag(name)}.")
        for task2, what2, get2, higher2, digits2, scale2 in (SECONDARY,):
            if task2 not in results or resampled_units(record, task2, None) < MIN_VERDICT_UNITS:
                continue
            for budget in run_budgets(record):
                groups = verdict_groups(record, results[task2]["methods"], budget, get2, higher2, digits2, scale2,
                                   ("published", "control", "variant", "baseline ablation"))
                if any(groups.values()):
                    parts = [f"{verdict} {', '.join(items)}" for verdict, items in groups.items() if items]
                    secondary.append(f"`{name}` ({model}), B={budget}, {what2} (method minus triattention [95% interval], "
                                     "higher is better for the method): TriAttention " + "; ".join(parts) + f"{tag(name)}.")
        if "math" in results:
            _, what3, get3, higher3, digits3, scale3 = MATH
            for dataset in results["math"]["meta"]["datasets"]:
                if dataset not in results["math"]:
                    continue
                units = resampled_units(record, "math", dataset)
                if units < MIN_VERDICT_UNITS:
                    notes.append(f"`{name}` ({model}), {what3}: no verdict from {units} problems (at least {MIN_VERDICT_UNITS} needed).")
                    continue
                for budget in run_budgets(record):
                    groups = verdict_groups(record, results["math"][dataset], budget, get3, higher3, digits3, scale3,
                                       ("published", "control", "variant", "baseline ablation"))
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
                     + "." + _holm_sentence(family))
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
    lines += [f"Controls (what any eviction at the same budget gives; not baselines, not in the headline): {line}"
              for line in controls]
    lines += [f"TriAttention's own variants and ablations (not baselines): {line}" for line in variants]
    lines += [f"Secondary metric: {line}" for line in secondary]
    lines += math_lines + notes
    if total:
        lines.append(f"Chance: were every published baseline equal to TriAttention, about 5% of the {total} headline "
                     f"comparisons ({0.05 * total:.1f}) would still show a lead or a trail; the comparisons share texts, so "
                     "they are not independent.")
    return RunsSummary(lines, counts, usable_counts, published, what)


def _holm_sentence(family: list[tuple[float, float, int]]) -> str:
    """The headline counts again under Holm's rule over every headline comparison (family-wise 5%), and the
    comparisons too few texts keep from ever passing it."""
    if not family:
        return ""
    survives = holm_survivors([p for p, _, _ in family])
    leads = sum(kept and difference > 0 for kept, (_, difference, _) in zip(survives, family))
    trails = sum(kept and difference < 0 for kept, (_, difference, _) in zip(survives, family))
    sentence = (f" Holding the family-wise error of these {len(family)} comparisons at 5% (Holm's step-down rule on "
                f"paired sign-flip tests over texts) instead: it leads {leads}, trails {trails} and ties "
                f"{len(family) - leads - trails}")
    first = 0.05 / len(family)
    short = sorted({texts for _, _, texts in family if 2.0 / 2**texts > first})
    if short:
        counted = sum(texts in short for _, _, texts in family)
        sentence += (f"; {counted} of them rest on {' or '.join(map(str, short))} texts, whose smallest possible p-value "
                     f"({', '.join(f'{2.0 / 2**t:.4f}' for t in short)}) is above Holm's first threshold ({first:.4f}), so "
                     "they cannot pass it however large the difference")
    return sentence + "."


def scope_lines(named_records: list[tuple[str, dict]]) -> list[str]:
    """What the page's runs measured and what they did not, computed from the runs (models, devices, dtypes, tasks)."""
    from ....models import REGISTRY

    models = sorted({record["model"]["name"] for _, record in named_records})
    described = []
    for name in models:
        entry = REGISTRY.get(name)
        size = next((record["model"]["parameters"] for _, record in named_records
                     if record["model"]["name"] == name and record["model"].get("parameters")), None)
        described.append(f"`{name}`" + (f" ({size / 1e6:.0f}M parameters)" if size else "")
                         + (f": {entry.description.split(' (')[0]}" if entry else ""))
    from ..provenance import one_invocation

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
