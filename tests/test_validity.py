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
    assert derived["human_min_line_variety"] == pytest.approx(validity.HUMAN_MIN_LINE_VARIETY, abs=5e-5)
    assert derived["min_line_variety"] == validity.MIN_LINE_VARIETY
    assert validity.MIN_LINE_VARIETY == round(validity.LINE_VARIETY_FACTOR * derived["human_min_line_variety"], 3)
    # the anchors are extremes over every window, so every human window passes with the factor's margin
    for name, start, window in validity.human_windows():
        compression, _, share = validity.masked_figures(window)
        assert compression >= 2 * validity.MIN_MASKED_COMPRESSION - 1e-3 and share <= validity.MAX_REPEAT_SHARE / 2 + 1e-3
        assert validity.line_variety(window) >= 2 * validity.MIN_LINE_VARIETY - 1e-3


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
    assert not short.valid and short.as_dict()["rule"] == validity.RULE
    assert validity.judged_by_this_rule(short.as_dict())
    assert not validity.judged_by_this_rule({"tokens": 2048, "compression": 0.2, "valid": True})


def _slow_line_variety(text: str, window: int) -> float:
    """Every window of `window` non-blank lines, each line reduced by hand: digits to one 0, `$` removed, spaces
    collapsed; the least share of distinct lines."""
    import re

    lines = [" ".join(re.sub(r"[0-9]+", "0", line).replace("$", " ").split()) for line in text.split("\n")]
    lines = [line for line in lines if line]
    if len(lines) < window:
        return 1.0
    return min(len(set(lines[i : i + window])) for i in range(len(lines) - window + 1)) / window


def test_line_variety_equals_a_direct_count_over_every_window():
    assert validity.line_template("  $$187_b^2 +  60_b$$ ") == "0_b^0 + 0_b"
    human = next(window for name, _, window in validity.human_windows() if name == "math-solutions")
    loop = "\n\n".join(f"${x}=${i % 3}$" if i % 2 else f"$${x}={i}$$" for i, x in enumerate("xyxxyyxyxy" * 5))
    for text in (human, human[:2000] + "\n" + loop + "\n" + human[2000:4000], loop, "one line\ntwo lines"):
        for window in (5, 40):
            assert validity.line_variety(text, window) == pytest.approx(_slow_line_variety(text, window)), (window, text[:80])
    assert validity.line_variety("one line\ntwo lines") == 1.0  # too few lines to judge


# loops of short lines (their lines differ in digits, `$` delimiters and blank lines) that the masked rule passed:
# the shipped traces a review named, kept as the files held them when that rule judged them valid
SHORT_LINE_LOOPS = [json.loads(line) for line in (Path(__file__).parent / "data" / "short_line_loops.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("loop", SHORT_LINE_LOOPS, ids=[f"{row['model']}-{row['name']}" for row in SHORT_LINE_LOOPS])
def test_loops_of_short_lines_the_masked_rule_passed_fail_this_one(loop):
    assert loop["masked_rule"]["valid"] and loop["masked_rule"]["rule"] == "masked"
    compression, _, share = validity.masked_figures(loop["text"])
    assert compression >= validity.MIN_MASKED_COMPRESSION and share <= validity.MAX_REPEAT_SHARE  # the masked rule's pass
    figures = validity.trace_validity(loop["text"], [], attempts=1, tokens=loop["tokens"], min_tokens=2048)
    assert figures.line_variety < validity.MIN_LINE_VARIETY and not figures.valid


def test_an_attempt_that_loops_in_short_lines_is_rejected_while_writing():
    human = next(window for name, _, window in validity.human_windows() if name == "math-solutions")
    reasoning = human[:3000]
    loop = "\n\n".join(f"$x={i % 7}$" if i % 3 else f"$$y={i}$$" for i in range(60))
    assert validity.line_variety(reasoning + "\n" + loop) < validity.MIN_LINE_VARIETY
    ids = list(range(900))
    assert validity.attempt_is_loop(reasoning + "\n" + loop, ids, trace_tokens=2048)
    assert not validity.attempt_is_loop(human, ids, trace_tokens=2048)
