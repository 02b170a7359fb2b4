"""The rules behind the quality evidence: one prompt-protection rule for every method, fidelity counted where
compression acts, bootstrap intervals, reasoning traces, and a report whose sentences come from the data."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import tiny_model
from stats_fixtures import tiny_stats

import trikv
from trikv.benchmarks.quality import intervals
from trikv.benchmarks.quality.fidelity import FidelitySuite, FidelityTask
from trikv.cache import make_cache
from trikv.policies import REGISTRY

pytestmark = pytest.mark.usefixtures("one_thread")


class _Tok:
    pad_token_id, eos_token_id, chat_template = 0, None, None

    def decode(self, ids, skip_special_tokens=True):
        return ""


# ---- one protection rule ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["triattention-recent", "h2o", "snapkv", "rkv", "streaming"])
def test_methods_with_different_windows_protect_the_same_prompt(method):
    """A 16-token prompt at budget 24 with 4 slots of decode room is protected for every method, whatever its
    recent window (triattention: none; h2o: half the budget; snapkv / triattention-recent: a window that no
    longer fits beside the prompt): after every round each (layer, KV head) still holds the whole prompt, and
    no more than the budget. (Under the earlier rule prompt + window + room had to fit, so these methods
    dropped prompt tokens while triattention kept them.)"""
    model = tiny_model(seed=3)
    stats = tiny_stats(model)
    prompt_length, budget = 16, 24
    prompt = torch.randint(1, 96, (prompt_length,), generator=torch.Generator().manual_seed(7)).tolist()
    kept = {}
    for name in (method, "triattention"):
        options = {"stats": stats} if REGISTRY[name].needs_stats else {}
        # windows that no longer fit beside the prompt (16 + 12 + 4 > 24): the old rule gave the prompt up
        options |= {"triattention-recent": {"recent_window": 12}, "snapkv": {"window_size": 12},
                    "rkv": {"window_size": 12}}.get(name, {})
        cache = make_cache(model, name, budget=budget, divide_length=8, min_decode_room=4, **options)
        seen = []
        original = cache.compress

        def compress(cache=cache, original=original, seen=seen):
            rounds = cache.rounds
            original()
            if cache.rounds > rounds:
                positions = cache.visible_positions()[:, 0]  # [L, Hkv, P]
                seen.append([[sorted(p for p in head.tolist() if p >= 0) for head in layer] for layer in positions])

        cache.compress = compress
        trikv.generate(model, _Tok(), [prompt], cache=cache, max_new_tokens=40, min_new_tokens=40)
        assert len(seen) >= 3
        for snapshot in seen:
            for layer in snapshot:
                for head in layer:
                    assert set(range(prompt_length)) <= set(head), (name, head)
                    assert len(head) == budget
        assert bool(cache.prompt_protected().all())
        kept[name] = seen
    assert len(kept[method]) == len(kept["triattention"])


def test_the_window_lives_in_what_the_protected_prompt_leaves():
    from trikv.selection import protected_entries

    positions = torch.arange(30).view(1, 1, 1, 30)
    t = torch.tensor([30])
    # prompt 16 of budget 24: a window of 12 shrinks to the 8 slots the prompt leaves
    protected = protected_entries(positions, t, torch.tensor([16]), 24, 12, 4)
    assert protected[0, 0, 0].nonzero().flatten().tolist() == list(range(16)) + list(range(22, 30))
    # a prompt that does not fit competes; the whole window is protected
    protected = protected_entries(positions, t, torch.tensor([22]), 24, 12, 4)
    assert protected[0, 0, 0].nonzero().flatten().tolist() == list(range(18, 30))


# ---- fidelity where compression acts ------------------------------------------------------------------------
def test_compressed_positions_start_at_the_first_round():
    """Streaming at budget 16 + slack 16 after an 8-token prompt: the first round runs before the forward that
    starts at token 32, so positions 32.. are the compressed ones; before them nothing was evicted and the
    method equals full attention (KL 0), so the all-position sums exceed the compressed ones by nothing but
    the position count."""
    model = tiny_model()
    ids = torch.randint(1, 96, (2, 120), generator=torch.Generator().manual_seed(3))
    task = FidelityTask(model, ids, prompt_length=8, max_chunk=32, recall_stride=2, horizons=(32,))
    task.run_reference()
    metrics, log = task.run_method(make_cache(model, "streaming", budget=16, divide_length=16))
    assert log["round_times"][0] == metrics["first_round"] == 32
    per_text = metrics["per_text"]
    assert per_text["compressed"]["n"] == [120 - 1 - 32] * 2
    assert per_text["all"]["n"] == [120 - 1 - 8] * 2
    for row in range(2):
        assert per_text["all"]["kl"][row] - per_text["compressed"]["kl"][row] == pytest.approx(0.0, abs=1e-4)
        assert per_text["all"]["agree"][row] - per_text["compressed"]["agree"][row] == 32 - 8
    assert metrics["compressed"]["kl"] > metrics["kl"]  # the same KL over fewer positions
    assert metrics["compressed"]["positions"] == 2 * (120 - 1 - 32)


def test_a_suite_of_texts_with_their_own_prompts_equals_each_text_alone():
    """Texts of different prompt lengths are fed in their own batches; per-text figures equal each text run
    alone, and the pooled recall equals the one computed from the merged per-text sums."""
    model = tiny_model()
    generator = torch.Generator().manual_seed(5)
    texts = [torch.randint(1, 96, (n,), generator=generator).tolist() for n in (100, 110, 100)]
    prompts = [6, 12, 6]
    suite = FidelitySuite(model, texts, prompts, max_chunk=32, recall_stride=2, horizons=(32,))
    assert len(suite.batches) == 2
    suite.run_reference()
    metrics, log = suite.run_method(lambda: make_cache(model, "streaming", budget=16, divide_length=8))
    recall = suite.recall({"x": log})["x"]
    for row, (text, prompt) in enumerate(zip(texts, prompts)):
        alone = FidelityTask(model, torch.tensor([text]), prompt, max_chunk=32, recall_stride=2, horizons=(32,))
        alone.run_reference()
        single, single_log = alone.run_method(make_cache(model, "streaming", budget=16, divide_length=8))
        assert metrics["first_round"][row] == single["first_round"]
        for part in ("all", "compressed"):
            for name in ("n", "agree", "kl", "nll"):
                assert metrics["per_text"][part][name][row] == pytest.approx(single["per_text"][part][name][0], rel=1e-4, abs=1e-5)
        single_recall = alone.recall({"x": single_log})["x"]
        assert torch.allclose(recall["rows"]["kept"][row], single_recall["rows"]["kept"][0], atol=1e-6)


# ---- bootstrap intervals --------------------------------------------------------------------------------
def test_bootstrap_interval_of_a_mean_matches_the_normal_approximation():
    """For 400 coin flips with p = 0.3 the percentile interval of the mean is close to p +- 1.96 sqrt(p(1-p)/n);
    identical units give a zero-width interval; the same data and seed give the same interval."""
    scores = np.array([1.0] * 120 + [0.0] * 280)
    weights = intervals.resample_weights(len(scores), 4000, seed=1)
    assert (weights.sum(1) == len(scores)).all()
    low, high = intervals.percentile_interval(weights @ scores / len(scores))
    half = 1.96 * math.sqrt(0.3 * 0.7 / 400)
    assert low == pytest.approx(0.3 - half, abs=0.006) and high == pytest.approx(0.3 + half, abs=0.006)
    assert intervals.percentile_interval(weights @ np.full(400, 0.25) / 400) == pytest.approx([0.25, 0.25])
    again = intervals.resample_weights(len(scores), 4000, seed=1)
    assert intervals.percentile_interval(again @ scores / 400) == [low, high]


def test_paired_math_differences_cancel_what_problems_share():
    """Two methods that differ on one problem out of 50: the paired interval of the difference is narrow and
    contains the difference; a method against itself has [0, 0]."""
    base = {f"p{i}": float(i % 2) for i in range(50)}
    better = dict(base, p0=1.0)
    table = {"triattention": {"128": {"pass@1": 0.5, "by_problem": base}},
             "rkv": {"128": {"pass@1": 0.52, "by_problem": better}},
             "snapkv": {"128": {"pass@1": 0.5, "by_problem": dict(base)}}}
    intervals.add_math_intervals(table, seed=0)
    rkv = table["rkv"]["128"]["vs_triattention"]["pass@1"]
    assert rkv["difference"] == pytest.approx(0.02)
    assert 0.0 <= rkv["ci"][0] <= 0.02 <= rkv["ci"][1] <= 0.06 + 1e-9
    assert table["snapkv"]["128"]["vs_triattention"]["pass@1"]["ci"] == [0.0, 0.0]
    low, high = table["triattention"]["128"]["ci"]["pass@1"]
    assert low < 0.5 < high


def test_fidelity_intervals_are_ratios_of_resampled_sums():
    per_text = {"n": [100, 100, 100], "agree": [90, 95, 100], "kl": [1.0, 2.0, 3.0], "nll": [200, 210, 220],
                "nll_full": [200, 200, 200]}
    weights = np.array([[3, 0, 0], [0, 0, 3], [1, 1, 1]], dtype=np.float64)
    figures = intervals.fidelity_resamples(per_text, weights)
    assert figures["top1_agreement"].tolist() == pytest.approx([0.90, 1.00, 0.95])
    assert figures["kl"].tolist() == pytest.approx([0.01, 0.03, 0.02])
    assert figures["perplexity_ratio"].tolist() == pytest.approx([1.0, math.exp(0.2), math.exp(0.1)])


# ---- the report says what the data say --------------------------------------------------------------------
def _record(kl_rkv: float):
    """A one-budget fidelity run in which rkv's KL minus triattention's is `kl_rkv` with a tight interval."""
    def cell(kl, diff=None):
        out = {"kl": kl, "top1_agreement": 0.9, "perplexity": 2.0, "perplexity_full": 1.9, "positions": 100,
               "compressed": {"kl": kl, "top1_agreement": 0.9, "perplexity_ratio": 1.05, "positions": 80}}
        if diff is not None:
            out["vs_triattention"] = {"compressed": {"kl": {"difference": diff, "ci": [diff - 0.001, diff + 0.001]},
                                                     "top1_agreement": {"difference": 0.0, "ci": [-0.01, 0.01]}}}
        return out

    return {"model": {"name": "tiny"}, "config": {"budgets": [128], "methods": ["full", "triattention", "rkv"]},
            "results": {"fidelity": {"meta": {"texts": list("abcdefgh"), "tokens_per_text": 100, "prompt_tokens": 8},
                                     "methods": {"full": {"full": cell(0.0)}, "triattention": {"128": cell(0.05)},
                                                 "rkv": {"128": cell(0.05 + kl_rkv, kl_rkv)}}}}}


def test_opposite_data_give_opposite_sentences():
    from trikv.benchmarks.quality.pages.summary import summary_lines

    worse = summary_lines([("run", _record(+0.02))])
    better = summary_lines([("run", _record(-0.02))])
    # the headline, the run's verdicts, TriAttention's rank, then the count against chance
    assert len(worse) == len(better) == 4
    assert worse[0] == ("Headline, TriAttention against the 1 published baseline (`rkv`) on KL where compression acts: on "
                        "tiny (B=128) it leads 1, ties 0 and trails 0, ranks 1st of 2 methods. In all it leads 1, ties 0 "
                        "and trails 0 of these 1 comparisons.")
    assert "leads 0, ties 0 and trails 1, ranks 2nd of 2 methods" in better[0]
    assert "TriAttention leads `rkv` +0.0200" in worse[1] and "trails" not in worse[1]
    assert "TriAttention trails `rkv` -0.0200" in better[1] and "leads" not in better[1]
    assert "no method has lower KL" in worse[2] and "lower KL: `rkv` 0.0300" in better[2]
    tied = summary_lines([("run", _record(0.0))])
    assert "TriAttention ties `rkv`" in tied[1]


def test_summary_counts_its_verdicts_and_draws_none_from_few_texts_or_an_invalid_trace_set():
    from trikv.benchmarks.quality.pages.summary import summary_lines
    from trikv.benchmarks.quality.pages.verdicts import MIN_VERDICT_UNITS

    lines = summary_lines([("one", _record(+0.02)), ("two", _record(-0.02)), ("three", _record(0.0))])
    assert lines[0].endswith("In all it leads 1, ties 1 and trails 1 of these 3 comparisons.")
    assert lines[-1].startswith("Chance: were every published baseline equal to TriAttention, about 5% of the 3 headline "
                                "comparisons (0.2) would still show a lead or a trail")
    few = _record(+0.02)
    few["results"]["fidelity"]["meta"]["texts"] = ["a", "b", "c"]
    assert summary_lines([("few", few)]) == [f"`few` (tiny), KL where compression acts: no verdict from 3 texts "
                                              f"(at least {MIN_VERDICT_UNITS} needed)."]
    loops = _record(+0.02)
    figures = lambda valid: {"valid": valid, "attempts": 1}  # noqa: E731
    loops["results"]["fidelity"]["meta"]["trace_validity"] = {f"t{i}": figures(i < 11) for i in range(16)}  # 11 / 16 < 75%
    (line,) = summary_lines([("loops", loops)])
    assert "left out of the summary, only 11 of its 16 traces pass the validity rule" in line
    loops["results"]["fidelity"]["meta"]["trace_validity"] = {f"t{i}": figures(i < 12) for i in range(16)}
    assert "TriAttention leads `rkv`" in summary_lines([("loops", loops)])[1]


def test_summary_sets_each_models_standing_beside_what_differs_between_the_models():
    from trikv.benchmarks.quality.pages.summary import summary_lines

    def model(name, kl_rkv, concentration, parameters):
        record = _record(kl_rkv)
        record["model"] = {"name": name, "parameters": parameters}
        record["results"]["recall"] = {"meta": {"concentration_per_layer": concentration}, "methods": {}}
        return record

    lines = summary_lines([("weak", model("weak", -0.02, [0.50, 0.60], 135e6)),
                           ("strong", model("strong", +0.02, [0.80, 0.90], 1.5e9))])
    (line,) = [line for line in lines if line.startswith("Where TriAttention stands")]
    # best standing first, whatever the order of the runs; each model's figures are its own
    assert line.index("strong (B=128, 1500M parameters): ranks 1st of 2, leads 1 and trails 0 of 1") < line.index(
        "weak (B=128, 135M parameters): ranks 2nd of 2, leads 0 and trails 1 of 1")
    assert "mean query concentration 0.85 (0.80-0.90)" in line and "mean query concentration 0.55 (0.50-0.60)" in line
    assert "These conditions vary together across 2 models, so the runs cannot tell which" in line
    assert "alike" not in line
    alike = summary_lines([("weak", model("weak", -0.02, [0.60, 0.62], 135e6)),
                           ("strong", model("strong", +0.02, [0.62, 0.64], 1.5e9))])
    (line,) = [line for line in alike if line.startswith("Where TriAttention stands")]
    assert "differs by 0.02 at most between the models, so by that measure they are alike" in line
    assert "The other conditions vary together" in line
    # one model: nothing to set side by side
    assert not any(line.startswith("Where") for line in summary_lines([("weak", model("weak", -0.02, [0.5], 1e8))]))


# ---- trace validity -----------------------------------------------------------------------------------------
def _longest_repeat_slow(ids):
    """Every pair of start positions, extended while equal (quadratic, independent of the suffix array)."""
    best = 0
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            k = 0
            while j + k < len(ids) and ids[i + k] == ids[j + k]:
                k += 1
            best = max(best, k)
    return best


def test_longest_repeat_equals_a_pairwise_reference():
    from trikv.benchmarks.quality.validity import longest_repeat

    generator = np.random.default_rng(0)
    for trial in range(40):
        n = int(generator.integers(0, 60))
        ids = generator.integers(0, 1 + trial % 5, n).tolist()  # small vocabularies repeat often
        assert longest_repeat(ids) == _longest_repeat_slow(ids), ids
    loop = [7, 8, 9] * 50  # a loop of period 3 repeats all but its first period
    assert longest_repeat(loop) == len(loop) - 3


def test_trace_validity_rule_separates_loops_from_reasoning():
    from trikv.benchmarks.quality import validity

    generator = np.random.default_rng(1)
    words = ["step", "so", "the", "sum", "is", "we", "get", "x", "=", "2", "3", "then", "hence", "add", "both", "sides"]
    prose = " ".join(str(generator.choice(words)) + str(generator.integers(0, 50)) for _ in range(700))
    prose_ids = [hash(word) % 1000 for word in prose.split()]
    sane = validity.trace_validity(prose, prose_ids, attempts=2, min_tokens=600)
    assert sane.valid and sane.masked_compression >= validity.MIN_MASKED_COMPRESSION and sane.repeat_share <= validity.MAX_REPEAT_SHARE
    loop_text = "The answer is \\boxed{}. " * 300
    loop_ids = [1, 2, 3, 4, 5] * 300
    looped = validity.trace_validity(loop_text, loop_ids, attempts=1)
    assert not looped.valid and looped.compression < 0.05 and looped.repeat_share > 0.99
    assert not validity.trace_validity(prose, prose_ids, attempts=2, min_tokens=2048).valid  # too short
    assert validity.attempt_is_loop(loop_text[:200], loop_ids[:300], trace_tokens=2048)  # 295-token repeat > 10%
    assert not validity.attempt_is_loop(prose, prose_ids, trace_tokens=2048)
    assert validity.set_is_usable([sane] * 12 + [looped] * 4) and not validity.set_is_usable([sane] * 11 + [looped] * 5)


def test_generation_stops_rows_the_halting_rule_flags():
    """`halt_rows` ends a row at the check step as EOS would; the other rows go on, their tokens unchanged."""
    model = tiny_model(seed=5)
    tokenizer = _Tok()
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    plain = trikv.generate(model, tokenizer, prompts, method="full", max_new_tokens=150, seed=0)
    halted = trikv.generate(model, tokenizer, prompts, method="full", max_new_tokens=150, seed=0,
                            halt_rows=lambda generated: [True, False])
    assert halted.tokens[0] == plain.tokens[0][:64] and halted.tokens[1] == plain.tokens[1]


def test_composition_and_recall_by_kind_carry_intervals():
    table = {"rkv": {"128": {"kept_composition": {"prompt": 0.5, "age<128": 0.5},
                             "kept_composition_per_text": {"prompt": [10.0, 30.0, 20.0], "age<128": [30.0, 10.0, 20.0]}}}}
    intervals.add_composition_intervals(table)
    low, high = table["rkv"]["128"]["composition_ci"]["prompt"]
    assert low < 0.5 < high and 0.25 <= low and high <= 0.75  # each text's prompt share is 0.25, 0.75 or 0.5
    rows = {"kept": np.ones((3, 1, 1)), "mass": np.ones((3, 1, 1)), "queries": np.ones(3),
            "h_kept": np.ones((3, 1, 1, 1)), "h_mass": np.ones((3, 1, 1, 1)),
            "k_kept": np.array([[[[0.2, 0.0, 0.0]]], [[[0.6, 0.0, 0.0]]], [[[0.4, 0.0, 0.0]]]]),
            "k_mass": np.array([[[[1.0, 0.0, 0.0]]]] * 3)}
    weights = np.array([[3, 0, 0], [0, 3, 0], [1, 1, 1]], dtype=np.float64)
    samples = intervals.recall_resamples(rows, weights, ["0-128"])
    assert samples["kind:prompt"].tolist() == pytest.approx([0.2, 0.6, 0.4])
    assert np.isnan(samples["kind:repeated"]).all()


def test_fidelity_page_counts_the_protected_prompts_per_budget():
    from trikv.benchmarks.quality.pages.tables import sections

    record = _record(0.0)
    record["config"].update(budgets=[128, 256], min_decode_room=32)
    # 96 + 32 <= 128 fits; 97 does not; at 256 all but 250 fit
    record["results"]["fidelity"]["meta"].update(prompt_lengths=[40, 96, 97, 250], traces="evaluation", trace_tokens=64,
                                                 texts=["a", "b", "c", "d"])
    for values in record["results"]["fidelity"]["methods"].values():
        values.setdefault("256", values.get("128"))
    page = dict(sections(record, markdown=True))
    (table,) = [text for title, text in page.items() if "prompt was protected" in title]
    assert "| 128 | 80 / 100 (80%) | 2 / 4 |" in table and "| 256 | 80 / 100 (80%) | 3 / 4 |" in table, table
    record["config"]["protect_prompt"] = False
    (table,) = [text for title, text in dict(sections(record, markdown=True)).items() if "prompt was protected" in title]
    assert "| 128 | 80 / 100 (80%) | 0 / 4 |" in table, table


def test_preregistered_outcome_is_computed_from_the_run():
    from trikv.benchmarks.quality.pages.preregistration import preregistration_lines

    registration = {"candidate": "triattention", "baseline": "rkv", "budget": 128, "dataset": "math500", "run": "held",
                    "registered": "2026-12-03", "hypothesis": "h", "rationale": "r", "command": "c"}

    def record(candidate_scores):
        scores = lambda values: {f"p{i}": v for i, v in enumerate(values)}
        cells = {"triattention": scores(candidate_scores), "rkv": scores([1.0, 0.0, 1.0, 0.0])}
        return {"config": {"budgets": [128], "methods": list(cells)},
                "results": {"math": {"meta": {"datasets": ["math500"]}, "math500": {
                    method: {"128": {"pass@1": sum(s.values()) / 4, "problems": 4, "by_problem": s}} for method, s in cells.items()}}}}

    assert preregistration_lines(registration, [])[-1] == "Outcome: not run yet."
    met = preregistration_lines(registration, [("held", record([1.0, 1.0, 1.0, 0.0]))])[-2]
    # one problem of four gained: +25 points, its paired bootstrap over problems [0, +75] (P(3+ of 4 draws) = 5.1%)
    assert "is **met** (the interval spans 0" in met and "+25.0 points [95% paired bootstrap +0.0, +75.0]" in met, met
    assert "is **not met**" in preregistration_lines(registration, [("held", record([0.0, 0.0, 1.0, 0.0]))])[-2]
    assert preregistration_lines(registration, [("held", record([0.0, 0.0, 1.0, 0.0]))])[-1] == "Methods run on these problems: `rkv`, `triattention`."
    # an interim result (fewer problems answered than registered) states no outcome
    interim = preregistration_lines({**registration, "problems": 5}, [("held", record([1.0, 1.0, 1.0, 0.0]))])[-1]
    assert interim.startswith("Interim, no outcome yet") and "met" not in interim and "on 4 problems" in interim


def test_second_registration_is_read_by_its_rule_and_pooled_with_the_first():
    import json
    from pathlib import Path

    from trikv.benchmarks.quality.pages.preregistration import paired_reading, preregistration_lines, registered_problems, registered_tests

    tests = registered_tests(json.loads((Path(__file__).parents[1] / "docs" / "preregistration.json").read_text()))
    second = next(test for test in tests if test.get("reading"))
    assert second["primary"] == {"candidate": "triattention", "baseline": "rkv"}
    problems = registered_problems(second)
    assert len(problems) == second["problems"] == 130 and problems[0] == "math500-137" and problems[-1] == "math500-499"
    # the reading: independent of the report's wording, from the bootstrap bound alone
    assert paired_reading([1.0] * 20 + [0.0] * 110, 0.03)[3] == "superior"
    assert paired_reading([1.0] * 3 + [-1.0] * 2 + [0.0] * 125, 0.03)[3] == "non-inferior"
    assert paired_reading([1.0] * 10 + [-1.0] * 12 + [0.0] * 108, 0.03)[3] == "inconclusive"
    # a loss: the whole interval below -3 points reads "inferior" (the registered reading, without its addendum, could
    # only call it inconclusive)
    loss = [-1.0] * 20 + [0.0] * 110
    difference, low, high, reading = paired_reading(loss, 0.03)
    assert reading == "inferior" and high < -0.03 and difference == pytest.approx(-20 / 130)
    assert paired_reading(loss, 0.03, inferior=False)[3] == "inconclusive"
    assert second["reading_addendum"]["inferior"] == "upper bound < -margin"

    def record(run_problems, triattention, rkv):
        cells = {"triattention": dict(zip(run_problems, triattention)), "rkv": dict(zip(run_problems, rkv))}
        return {"results": {"math": {"math500": {m: {"128": {"by_problem": s}} for m, s in cells.items()}}}}

    empty = preregistration_lines(second, [])
    assert "Primary, B=128: `triattention` - `rkv`: no outcome yet (not run: `triattention`, `rkv`)." in empty
    assert any("inferior if the upper bound < -3 points" in line for line in empty)
    half = record(problems[:65], [1.0] * 65, [0.0] * 65)
    assert any("interim, no outcome yet (65 of 130" in line for line in preregistration_lines(second, [(second["run"], half)]))
    # 26 more problems solved by triattention only: +20 points, the interval far above 0
    win = record(problems, [1.0] * 26 + [0.0] * 104, [0.0] * 130)
    first = next(test for test in tests if test.get("id") == second["pooled_with"]["test"])
    old = [f"math500-{i}" for i in range(300, 400)]
    lines = preregistration_lines(second, [(second["run"], win), (first["run"], record(old, [0.0] * 100, [1.0] * 100))], [first])
    primary = next(line for line in lines if line.startswith("Primary, B=128"))
    assert "+20.0 points" in primary and "**superior**" in primary, primary
    pooled = next(line for line in lines if line.strip().startswith("Pooled"))
    assert "230 problems" in pooled and "-32.2 points" in pooled and "inferior" in pooled, pooled
    # the first test's answers absent: the pooled figure says it was not computed, and why
    lines = preregistration_lines(second, [(second["run"], win)], [first])
    pooled = next(line for line in lines if line.strip().startswith("Pooled"))
    assert "not computed" in pooled and f"`{first['run']}`" in pooled, pooled


def test_an_outcome_whose_run_folder_is_gone_is_quoted_from_the_replaced_page(tmp_path):
    from trikv.benchmarks.quality.pages.preregistration import preregistration_lines

    registration = {"candidate": "triattention", "baseline": "rkv", "budget": 128, "dataset": "math500", "run": "held",
                    "registered": "2026-12-03", "hypothesis": "h", "rationale": "r", "command": "c"}
    page = tmp_path / "old.md"
    page.write_text("# t\n\n## Other test\n\n- Run: `other`: `c`\n- Outcome: wrong one.\n\n"
                    "## Pre-registered held-out test\n\n- Run: `held`: `c`\n- Outcome: 0.250 vs 0.230, **met**.\n")
    assert preregistration_lines(registration, [], replaced_page=page)[-1] == (
        "Outcome, quoted from [old.md](old.md) (the answers of `triattention` and `rkv` it was computed from are not on "
        "this page, so it is not recomputed here): 0.250 vs 0.230, **met**.")
    # the run is on the page again, but without the candidate's answers: still the quoted outcome
    rerun = {"results": {"math": {"math500": {"rkv": {"128": {"pass@1": 0.5, "by_problem": {"p0": 1.0, "p1": 0.0}}}}}}}
    assert "quoted from [old.md]" in preregistration_lines(registration, [("held", rerun)], replaced_page=page)[-1]
    # a page that never printed this run's outcome quotes nothing
    assert preregistration_lines({**registration, "run": "absent"}, [], replaced_page=page)[-1] == "Outcome: not run yet."


# ---- reasoning traces ---------------------------------------------------------------------------------------
def test_traces_refuse_unknown_splits_and_models(tmp_path, monkeypatch):
    from trikv.benchmarks.quality import traces

    with pytest.raises(ValueError, match="trace split must be one of evaluation, design"):
        traces.load_traces("smollm2-135m", "test")
    monkeypatch.setattr(traces, "TRACES_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="no reasoning traces ship for model 'tiny'"):
        traces.load_traces("tiny", "evaluation")
    row = {"name": "math500-400", "split": "design", "prompt": "p", "text": "t", "tokens": 3, "seeds": [0], "source": "s"}
    (tmp_path / "tiny.jsonl").write_text(json.dumps(row) + "\n")
    assert [t.name for t in traces.load_traces("tiny", "design")] == ["math500-400"]
    with pytest.raises(ValueError, match="holds no evaluation traces"):
        traces.load_traces("tiny", "evaluation")


class _CharTokenizer:
    """One id per character; EOS is id 0 (no character)."""

    eos_token_id, chat_template = 0, "instruct"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


def test_redo_invalid_keeps_valid_traces_and_writes_the_others_from_fresh_seeds(tmp_path, monkeypatch):
    """`--redo-invalid`: a valid shipped trace is kept byte for byte and never sampled again; an invalid one is
    written again from seeds after every seed the split used (its old seeds recorded as rejected), and the new
    trace carries validity figures that pass the rule."""
    import random
    from types import SimpleNamespace

    import trikv.generation
    import trikv.models
    import trikv.sanity
    from trikv.benchmarks.quality import traces
    from trikv.benchmarks.quality.validity import trace_validity

    def reasoning(rng, length):  # high-entropy text: no long repeat, compresses poorly
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz  ") for _ in range(length))

    tokenizer = _CharTokenizer()
    monkeypatch.setattr(traces, "TRACES_DIR", tmp_path)
    monkeypatch.setitem(traces.COUNTS, "tiny", {"evaluation": 3, "design": 0})
    monkeypatch.setattr(trikv.models, "load_model", lambda name, dtype=None: (None, tokenizer))
    monkeypatch.setattr(trikv.sanity, "check_model_answers", lambda *args: None)
    calls = []

    def fake_generate(model, tok, prompts, method, max_new_tokens, seed, **kwargs):
        calls.append((list(prompts), seed))
        rng = random.Random(seed)
        return SimpleNamespace(tokens=[[ord(c) for c in reasoning(rng, max_new_tokens)] for _ in prompts])

    monkeypatch.setattr(trikv.generation, "generate", fake_generate)
    valid_text = reasoning(random.Random(99), 300)
    loop_text = "ab" * 150
    rows = []
    for name, text, seeds, rejected in [("math500-400", valid_text, [0], []), ("math500-401", loop_text, [0, 1], [2]),
                                        ("math500-408", loop_text, [0], [])]:
        figures = trace_validity(text, [ord(c) for c in text], attempts=len(seeds), min_tokens=200).as_dict()
        rows.append({"name": name, "split": "evaluation", "prompt": f"prompt {name}", "text": text, "tokens": len(text),
                     "seeds": seeds, "source": "shipped", "rejected_seeds": rejected, "validity": figures})
    assert [row["validity"]["valid"] for row in rows] == [True, False, False]
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    out = tmp_path / "out.jsonl"
    written = traces.write_traces("tiny", "evaluation", min_tokens=200, redo_invalid=True, out=out, log=lambda *a: None)
    assert [call[1] for call in calls] == [3]  # one batch, the first seed after 0, 1, 2
    from trikv.benchmarks.quality.math_task import load_problems

    redone = load_problems("math500", ids=["math500-401", "math500-408"])
    assert calls[0][0] == [problem["prompt"] for problem in redone]
    saved = [json.loads(line) for line in out.read_text().splitlines()]
    assert saved[0] == rows[0]
    for row, old_seeds in zip(saved[1:], ([0, 1, 2], [0])):
        assert row["seeds"] == [3] and row["rejected_seeds"] == old_seeds
        assert row["validity"]["valid"] and row["text"] != loop_text
    assert [trace.valid for trace in written] == [True, True, True]
    with pytest.raises(ValueError, match="either extend or redo_invalid"):
        traces.write_traces("tiny", "evaluation", min_tokens=200, redo_invalid=True, extend=True, out=out)


def test_trace_problems_avoid_every_row_used_elsewhere():
    """Evaluation and design traces never come from math evaluation rows 0-99, the calibration rows or the
    held-out rows 300-399, and the two splits share no problem."""
    from trikv.benchmarks.quality import traces
    from trikv.benchmarks.quality.math_task import reserved_rows

    used = set(traces.EVALUATION_PROBLEMS) | set(traces.DESIGN_PROBLEMS)
    assert not set(traces.EVALUATION_PROBLEMS) & set(traces.DESIGN_PROBLEMS)
    for problem in used:
        dataset, _, row = problem.rpartition("-")
        if dataset == "math500":
            assert 100 <= int(row) < 250 or 400 <= int(row) < 500, problem
            assert int(row) not in reserved_rows("math500")


def test_a_folder_from_the_earlier_protection_rule_is_refused(tmp_path):
    """Units computed when a method's window counted against the prompt are not mixed with new ones; a folder
    written under the current rule resumes."""
    from trikv.benchmarks.quality.runner import PROTECTION_RULE, QualityRun, config_from_preset

    config = config_from_preset("quick", tasks=["math"], methods=["full", "snapkv"], budgets=[64])
    QualityRun(config, tmp_path, progress=False, log=lambda *a: None)  # writes config.json under the current rule
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["protection_rule"] == PROTECTION_RULE
    (tmp_path / "units" / "fidelity__snapkv__64.json").write_text("{}")
    QualityRun(config, tmp_path, progress=False, log=lambda *a: None)  # same rule: resumes
    del saved["protection_rule"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="earlier prompt-protection rule"):
        QualityRun(config, tmp_path, progress=False, log=lambda *a: None)
    QualityRun(config, tmp_path, fresh=True, progress=False, log=lambda *a: None)  # --fresh starts over


def test_trace_settings_are_checked():
    from trikv.benchmarks.quality.runner import config_from_preset

    with pytest.raises(ValueError, match="traces must be one of evaluation, design, got 'held'"):
        config_from_preset("quick", traces="held")
    with pytest.raises(ValueError, match="trace_tokens must be at least 2"):
        config_from_preset("quick", traces="design", trace_tokens=1)
    config = config_from_preset("quick", tasks=["fidelity"], traces="design")
    assert config.texts == []  # the traces replace the default human texts


def test_recall_with_attention_sinks_divides_by_the_keys_mass():
    """GPT-OSS: the reference attention of the recall instruments has the sink in its softmax denominator, as the
    model does; a head's recall is the kept share of the mass its keys get (keeping everything gives exactly 1)."""
    model = tiny_model("gpt_oss", seed=1)
    ids = torch.randint(1, 96, (1, 120), generator=torch.Generator().manual_seed(2))
    task = FidelityTask(model, ids, prompt_length=8, max_chunk=32, recall_stride=2, horizons=(32,))
    reference = task.run_reference()
    assert reference.layers == [1, 3] and reference.sinks.shape == (2, 4)
    _, everything = task.run_method(make_cache(model, "streaming", budget=4096))
    assert task.recall({"all": everything})["all"]["recall"] == 1.0
    _, log = task.run_method(make_cache(model, "streaming", budget=16, divide_length=8))
    result = task.recall({"x": log})["x"]
    layer, head = 1, 1  # the second global layer (model layer 3), query head 1 (its sink logit is the largest)
    kv = head // 2
    sink = float(model.model.layers[3].self_attn.sinks.detach()[head])
    kept = mass = 0.0
    for qi, t in enumerate(reference.query_index.tolist()):
        logits = (reference.keys[layer][0, kv, : t + 1] @ reference.queries[layer][0, head, qi]) * reference.scaling
        probs = torch.softmax(torch.cat([logits, torch.tensor([sink])]), -1)[:-1].double()
        visible = (t < log["evict_time"][layer, 0, kv, : t + 1].long()).double()
        kept += float((probs * visible).sum())
        mass += float(probs.sum())
    assert mass < len(reference.query_index) - 1  # the sink takes a real share
    assert result["recall_per_head"][layer][head] == pytest.approx(kept / mass, abs=1e-4)


def test_dedup_history_is_computed_from_its_weight_sweep(tmp_path):
    from trikv.benchmarks.quality.pages.preregistration import dedup_history_lines

    lines = dedup_history_lines()
    assert "tuned by `python scripts/tune_dedup_weight.py" in lines[0] and "R-KV's 0.0251" in lines[0]
    assert "R-KV beat every weight tried: 0, 0.25, 0.5, 1, 2" in lines[0] and "rows 0-99 had been seen" in lines[1]
    sweep = {"command": "c", "text": "t", "best": {"redundancy_weight": 1.0, "mean_kl": 0.01},
             "rkv": {"mean_kl": 0.02}, "sweep": [{"redundancy_weight": 1.0, "mean_kl": 0.01}]}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    assert "beat every weight" not in dedup_history_lines(tmp_path / "sweep.json")[0]


def test_scope_is_computed_from_the_runs_and_names_withdrawn_figures():
    from trikv.benchmarks.quality.pages.summary import scope_lines

    record = _record(0.0)
    record["model"] = {"name": "gemma3-270m", "dtype": "torch.float32", "parameters": 268_000_000}
    record["environment"] = {"device": "cpu", "threads": 2}
    math_run = {"model": {"name": "qwen2.5-coder-1.5b", "dtype": "torch.bfloat16"}, "environment": {"device": "cpu", "threads": 2},
                "config": {"budgets": [128, 256]}, "results": {"math": {"meta": {"max_new_tokens": 1024, "temperature": 0}}}}
    lines = scope_lines([("a", record), ("b", math_run)])
    assert lines[0].startswith("Models: `gemma3-270m` (268M parameters): Gemma-3-270M base model; `qwen2.5-coder-1.5b`")
    assert "None is a reasoning-trained model" in lines[0]
    assert lines[1] == "Hardware: cpu only (2 threads); dtypes bfloat16, float32."
    assert "greedy, up to 1,024 new tokens, budgets 128, 256" in lines[2]
    assert "bash scripts/bench_paper_setting.sh" in lines[3]
    assert lines[4].startswith("Withdrawn (gemma3-270m): every Gemma-3 figure made before 2026-12-04")


def test_page_lists_every_shipped_trace_set_with_its_headline_verdict(tmp_path, monkeypatch):
    from trikv.benchmarks.quality import traces, validity
    from trikv.benchmarks.quality.pages.trace_sets import shipped_trace_validity

    monkeypatch.setattr(traces, "TRACES_DIR", tmp_path)

    def row(name, split, valid, compression, repeat_share, attempts=2, rejected=0, rule=validity.RULE, source="s", sampling=None):
        figures = {"tokens": 2048, "compression": compression + 0.05, "longest_repeat": int(6000 * repeat_share),
                   "repeat_share": repeat_share, "attempts": attempts, "rejected": rejected, "valid": valid}
        if rule:  # figures of the current rule; files judged under the earlier one lack them
            figures |= {"masked_compression": compression, "template_share": repeat_share / 2, "rule": rule}
        return json.dumps({"name": name, "split": split, "prompt": "p", "text": "t", "tokens": 2048, "seeds": [0],
                           "source": source, "validity": figures} | ({"sampling": sampling} if sampling else {}))

    # 3 of 4 valid (75%: enters), 2 of 3 valid (67%: does not), a design set (never in a headline), a set judged under
    # the earlier rule (never in a headline until judged again)
    sampled = {"temperature": 0.6, "top_p": 0.95, "top_k": 0}
    (tmp_path / "a-model.jsonl").write_text("\n".join(
        [row(f"math500-{i}", "evaluation", i != 3, 0.2 if i != 3 else 0.05, 0.02 if i != 3 else 0.5, rejected=i,
             sampling=sampled) for i in range(4)] + [row("math500-9", "design", False, 0.1, 0.3, sampling=sampled)]) + "\n")
    (tmp_path / "b-model.jsonl").write_text("\n".join(
        row(f"math500-{i}", "evaluation", i < 2, 0.25, 0.04 if i < 2 else 0.2, attempts=1,
            source="b-model with full attention, T 1.0, top-p 0.95, top-k 64, seeds [0]") for i in range(3)) + "\n")
    (tmp_path / "c-model.jsonl").write_text("\n".join(
        row(f"math500-{i}", "evaluation", True, 0.25, 0.04, rule=None) for i in range(4)) + "\n")
    lines = shipped_trace_validity().splitlines()
    assert lines[2] == ("| a-model | evaluation | 3/4 | 0.050-0.200 | 2.0%-50.0% | 1%-25% | math500-3 | 8 | 6 | "
                        "T 0.6, top-p 0.95 | yes |")
    assert lines[3] == ("| a-model | design | 0/1 | 0.100-0.100 | 30.0%-30.0% | 15%-15% | math500-9 | 2 | 0 | T 0.6, top-p 0.95 | "
                        "design only (never in a headline) |")
    assert lines[4] == ("| b-model | evaluation | 2/3 | 0.250-0.250 | 4.0%-20.0% | 2%-10% | math500-2 | 3 | 0 | "
                        "T 1.0, top-p 0.95, top-k 64 | **no** |")
    assert lines[5] == ("| c-model | evaluation | 4/4 (earlier rule) | n/a | 4.0%-4.0% | n/a | – | 8 | 0 | not recorded | "
                        "**no** |")
    for path in tmp_path.glob("*.jsonl"):
        path.unlink()
    assert shipped_trace_validity() is None
