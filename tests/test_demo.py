"""`trikv demo`: both runs decoded interleaved, the speed ratio with its interval, where the bound pays, and texts
that are not loops by the project's validity rule."""

from __future__ import annotations

import math

import pytest

import trikv
from trikv.benchmarks.quality.validity import COMPRESSION_MIN_TOKENS, trace_validity
from trikv.demo import (DEFAULT_PROMPT, SpeedComparison, agreement_note, compare, default_sampling)

from helpers import tiny_model
from stats_fixtures import tiny_stats

pytestmark = pytest.mark.usefixtures("one_thread")

DEMO_TEST_TOKENS = 512  # the validity rule's least length (a sampled text's prefix does not depend on its length)


class _CharTokenizer:
    """Characters in, ids out, for the tiny models (ids 6..95; 5 is EOS)."""

    pad_token_id = 0
    eos_token_id = 5
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [6 + ord(c) % 90 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i % 90) for i in ids)


def test_demo_runs_interleaved_and_samples_what_generate_samples():
    """Interleaving changes nothing either run samples: each text is what trikv.generate gives alone; the ratio is
    the two runs' decode times over the same steps, inside its interval, and every line the demo promises is there."""
    model = tiny_model("llama")
    stats = tiny_stats(model)
    tokenizer = _CharTokenizer()
    sampling = {"temperature": 0.6, "top_p": 0.95, "seed": 3}
    result = compare(model, tokenizer, stats, budget=24, divide_length=8, new_tokens=160, prompt="a short prompt",
                     progress=False, sampling=sampling)
    common = dict(max_new_tokens=160, min_new_tokens=160, do_sample=True, engine="lean", **sampling)
    alone_full = trikv.generate(model, tokenizer, "a short prompt", method="full", **common)
    alone_tri = trikv.generate(model, tokenizer, "a short prompt", method="triattention", stats=stats, budget=24,
                               divide_length=8, **common)
    assert result.full.tokens == alone_full.tokens and result.tri.tokens == alone_tri.tokens
    assert result.tri.compression_rounds == alone_tri.compression_rounds >= 10
    speed = result.speed
    assert speed.ratio == pytest.approx(result.full.decode_seconds / result.tri.decode_seconds)
    assert speed.low <= speed.ratio <= speed.high and speed.blocks == 159 // 8 + 1  # decode steps 1..159
    table = result.table
    for row in ("KV entries / (layer, head), final", "KV entries / (layer, head), peak", "KV cache bytes, final",
                "KV cache bytes, peak", "decode tokens/s", "compression rounds", "time in scoring + selection",
                "wall time", "agreement, first 160 tokens", "text (validity rule)"):
        assert row in table
    assert f"decode speed ratio {speed.ratio:.2f}x (TriAttention / full; 95% interval {speed.low:.2f}-{speed.high:.2f}" in table
    assert "agreement after the first divergence is not expected" in table
    assert f"too short for the rule (< {COMPRESSION_MIN_TOKENS} tokens)" in table  # the rule judges long texts only
    assert speed.first_round_context is not None and ("the bound pays" in table or "not resolved" in table)


def test_greedy_demo_says_what_its_agreement_means():
    model = tiny_model("llama")
    result = compare(model, _CharTokenizer(), tiny_stats(model), budget=24, divide_length=8, new_tokens=48,
                     prompt="a short prompt", progress=False, sampling=None, engine="transformers")
    assert "greedy: the texts agree for" in result.table
    greedy = trikv.generate(model, _CharTokenizer(), "a short prompt", method="full", max_new_tokens=48, min_new_tokens=48)
    assert result.full.tokens == greedy.tokens


def test_speed_lines_follow_the_measured_figures():
    """The ratio line carries the interval (or says why there is none); the break-even line says whether the bound
    pays from its first round, from a later context, or is not resolved, from the numbers it is given."""
    paired = SpeedComparison(1.07, 1.04, 1.10, blocks=188, block_steps=8, break_even=700.4, first_round_context=385)
    assert "1.07x (TriAttention / full; 95% interval 1.04-1.10 over 188 paired blocks of 8 steps" in paired.line()
    assert "from a context of ~700 tokens (its first round at 385)" in paired.break_even_line(256, 128)
    early = SpeedComparison(1.07, 1.0, 1.1, break_even=300.0, first_round_context=385)
    assert "from its first round on (at a context of 385 tokens)" in early.break_even_line(256, 128)
    assert "300" not in early.break_even_line(256, 128)  # an extrapolation below the first round is not a context
    assert "not resolved" in SpeedComparison(0.99, 0.9, 1.1, first_round_context=385).break_even_line(256, 128)
    assert "never ran a round" in SpeedComparison(1.0).break_even_line(256, 128)
    sequential = SpeedComparison(0.95, interleaved=False, note="one after the other")
    assert "interval" not in sequential.line() and "one after the other" in sequential.line()
    assert math.isnan(sequential.low)
    assert "not expected" in agreement_note(default_sampling(), 12, 100) and "for 12 tokens" in agreement_note(None, 12, 100)
    assert "identical over the 100 tokens" in agreement_note(default_sampling(), 100, 100)


@pytest.mark.extended  # 512 sampled tokens twice; the README's demo command runs in every run
@pytest.mark.real_model
def test_the_default_demo_texts_are_not_loops(real_model):
    """The demo's prompt and sampling (what `bash scripts/demo.sh` runs) give two texts that pass the project's
    validity rule (digits masked, zlib ratio, longest repeat); the bound runs its rounds meanwhile."""
    model, tokenizer = real_model
    stats = trikv.load_stats("smollm2-135m", model)
    result = compare(model, tokenizer, stats, new_tokens=DEMO_TEST_TOKENS, prompt=DEFAULT_PROMPT, progress=False,
                     sampling=default_sampling())
    assert result.tri.compression_rounds >= 2
    for run in (result.full, result.tri):
        text, ids = run.texts[0], run.tokens[0]
        assert len(ids) == DEMO_TEST_TOKENS
        validity = trace_validity(text, ids, attempts=1)
        assert validity.valid, (validity, text[-400:])
    assert "not a loop" in result.table and "a LOOP" not in result.table
