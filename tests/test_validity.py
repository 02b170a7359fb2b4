"""The trace validity rule: thresholds derived from human-written text alone, and counting loops rejected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trikv.benchmarks.quality import validity

# traces the earlier rule (zlib >= 0.12 and the longest token repeat <= 10%, digits as written) let through:
# lines repeated with a number that counts up, kept as the shipped trace files held them
LOOPS = [json.loads(line) for line in (Path(__file__).parent / "data" / "counting_loops.jsonl").read_text().splitlines()]


def test_thresholds_are_derived_from_the_shipped_human_texts():
    """The constants are what `derive_thresholds` computes from the three real texts: half the masked zlib ratio
    of the most compressible 6,000-character window, twice the longest repeat share of the most repetitive one."""
    derived = validity.derive_thresholds()
    assert derived["windows"] == 35
    assert derived["human_min_masked_compression"] == pytest.approx(validity.HUMAN_MIN_MASKED_COMPRESSION, abs=5e-5)
    assert derived["human_max_repeat_share"] == pytest.approx(validity.HUMAN_MAX_REPEAT_SHARE, abs=5e-5)
    assert derived["min_masked_compression"] == validity.MIN_MASKED_COMPRESSION
    assert derived["max_repeat_share"] == validity.MAX_REPEAT_SHARE
    assert validity.MIN_MASKED_COMPRESSION == round(validity.COMPRESSION_FACTOR * derived["human_min_masked_compression"], 3)
    assert validity.MAX_REPEAT_SHARE == round(validity.REPEAT_FACTOR * derived["human_max_repeat_share"], 3)
    # the anchors are extremes over every window, so every human window passes with the factor's margin
    for name, start, window in validity.human_windows():
        compression, _, share = validity.masked_figures(window)
        assert compression >= 2 * validity.MIN_MASKED_COMPRESSION - 1e-3 and share <= validity.MAX_REPEAT_SHARE / 2 + 1e-3


def test_derivation_follows_the_human_text_it_is_given():
    """Other human text gives other thresholds: the derivation reads the text, it does not restate numbers."""
    prose = ("The committee met on a wet Tuesday and argued, at length and without notes, about the budget for the "
             "orchard, the cost of ladders, whether pears keep better than apples, and who would drive the van. ") * 80
    derived = validity.derive_thresholds({"repetitive": prose})
    assert derived["human_max_repeat_share"] > 0.9 and derived["max_repeat_share"] > 1.8
    assert derived["min_masked_compression"] < validity.MIN_MASKED_COMPRESSION / 2


@pytest.mark.parametrize("loop", LOOPS, ids=[f"{row['model']}-{row['name']}" for row in LOOPS])
def test_counting_loops_the_earlier_rule_passed_fail_this_one(loop):
    earlier = loop["earlier_rule"]
    assert earlier["valid"] and earlier["compression"] >= 0.12 and earlier["repeat_share_tokens"] <= 0.10
    figures = validity.trace_validity(loop["text"], [], attempts=1, tokens=loop["tokens"], min_tokens=2048)
    assert not figures.valid
    assert (figures.masked_compression < validity.MIN_MASKED_COMPRESSION
            or figures.repeat_share > validity.MAX_REPEAT_SHARE), figures


def test_masking_the_digits_is_what_exposes_a_counting_loop():
    """144 numbered copies of one line inside reasoning: unmasked, every line differs and no long run repeats;
    masked, the copies are one run repeated."""
    reasoning = LOOPS[0]["text"][:1500]
    loop = "\n\n".join(f"Step {i}: You can provide both." for i in range(1, 145))
    text = reasoning + "\n\n" + loop
    unmasked_share = validity.longest_text_repeat(text) / len(text)
    assert unmasked_share < validity.MAX_REPEAT_SHARE
    figures = validity.trace_validity(text, [], attempts=1, tokens=2048, min_tokens=2048)
    assert not figures.valid and figures.repeat_share > 0.5 and figures.template_share > 0.5
    assert validity.attempt_is_loop(text, list(range(2048)), trace_tokens=2048)
    # the same reasoning with varied text in place of the loop passes
    human = next(window for name, _, window in validity.human_windows() if name == "math-solutions")
    varied = validity.trace_validity(reasoning + "\n\n" + human[: len(loop)], [], attempts=1, tokens=2048, min_tokens=2048)
    assert varied.valid, varied
    assert not validity.attempt_is_loop(reasoning + "\n\n" + human[: len(loop)], list(range(2048)), trace_tokens=2048)


def test_a_short_trace_is_not_valid_and_old_figures_are_told_apart():
    human = validity.human_windows()[0][2]
    assert validity.trace_validity(human, [], attempts=1, tokens=2048, min_tokens=2048).valid
    short = validity.trace_validity(human, [], attempts=1, tokens=2000, min_tokens=2048)
    assert not short.valid and short.as_dict()["rule"] == "masked"
    assert validity.judged_by_this_rule(short.as_dict())
    assert not validity.judged_by_this_rule({"tokens": 2048, "compression": 0.2, "valid": True})
