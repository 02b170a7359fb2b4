"""`trikv bench speed` end to end on a tiny model, and the pieces its numbers rest on."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from trikv.benchmarks import speed
from trikv.cache import make_cache

from helpers import tiny_model
from stats_fixtures import tiny_stats


pytestmark = pytest.mark.usefixtures("one_thread")


def test_speed_bench_end_to_end(tmp_path, monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(speed.peers, "llama_cpp_available", lambda: False)  # the peer is optional: a clear note instead
    config = speed.SpeedConfig(
        model="tiny-llama", contexts=[64, 160], methods=["full", "triattention"], budgets=[16], batch_sizes=[2],
        engines=["lean", "transformers"], steps=16, warmup=2, divide_length=8, seed_tokens=24, fill_chunk=48,
        engine_check_steps=8, spread="both", bandwidth_mb=8, out=str(tmp_path / "speed"), progress=False,
    )
    record = speed.run_speed(config, model=model, tokenizer=None, stats=tiny_stats(model))
    results = record["results"]
    assert len(results) == 2 * 2 * (1 + 2)  # contexts x engines x (full + budget x spread on/off)
    for r in results:
        assert r["steps"] == 16 and r["tokens_per_second"] > 0 and r["ms_p50"] <= r["ms_p99"] <= r["ms_max"]
        assert r["bound_ms"] > 0 and r["speedup_vs_full"] is not None
        if r["method"] == "full":
            assert r["entries_final"] == r["context"] + 18 and r["speedup_vs_full"] == 1.0
        else:  # bounded: never more than budget + slack entries, rounds ran during the measured steps
            assert r["entries_peak"] <= r["budget"] + 8 and r["round_steps"] >= 2 and r["scoring_share"] > 0
            assert r["bound_speedup_vs_full"] > 1.0
            assert r["kv_bytes_peak"] == r["batch"] * r["entries_peak"] * speed.kv_bytes_per_token(model)
    check = record["engine_check"]
    assert check["context"] == 160 and all(m["identical_greedy_tokens"] for m in check["methods"].values())
    assert "not installed" in record["llama_cpp"]["skipped"]
    out = tmp_path / "speed"
    assert json.loads((out / "speed.json").read_text())["results"][0]["engine"] == "lean"
    rows = list(csv.DictReader((out / "speed.csv").open()))
    assert len(rows) == len(results) and {"tokens_per_second", "bound_ms", "speedup_vs_full"} <= set(rows[0])
    assert (out / "speed.png").stat().st_size > 1000
    table = (out / "speed.txt").read_text()
    assert "triattention B=16 (no spread)" in table and "identical greedy tokens: True" in table

    # the Markdown page: the run's own table, and targets evaluated from its numbers
    from trikv.benchmarks.speed_report import targets, write_speed_report

    memory = speed.memory_run(model, None, tiny_stats(model), "triattention", 16, 40, 8, tmp_path / "memory", every=10, progress=False)
    page = write_speed_report([out, tmp_path / "memory"], tmp_path / "speed.md").read_text()
    assert "| target | measured | status |" in page and "## Memory run `memory`" in page
    assert f"most entries per (layer, KV head) at any step: **{memory['max_entries_per_layer_head']}**" in page
    engine_rows = {row[0]: row for row in targets(record) if row[0].startswith("lean >= x2")}
    assert len(engine_rows) == 2
    for method, measured in record["engine_check"]["methods"].items():  # the status follows the recorded numbers
        label = next(label for label in engine_rows if label.endswith(f"({method})"))
        expected = measured["speedup"] >= 2.0 and measured["identical_greedy_tokens"]
        assert engine_rows[label][2] == expected
        assert f"x{measured['speedup']:.2f}" in engine_rows[label][1]
    # and a record in which the lean engine is slow fails the target
    slow = json.loads(json.dumps(record))
    for measured in slow["engine_check"]["methods"].values():
        measured["speedup"] = 1.5
    assert all(not row[2] for row in targets(slow) if row[0].startswith("lean >= x2"))
    assert (tmp_path / "speed_files").is_dir() and "speed.png" in page
    with pytest.raises(FileNotFoundError, match="no speed.json, whole.json or memory.json"):
        write_speed_report([tmp_path], tmp_path / "bad.md")


def test_fill_rotates_tiled_keys_to_their_positions():
    """A tiled key must equal the model's key of the same token at its true position (pure rotation)."""
    model = tiny_model("qwen2")
    seed = speed.make_seed(model, None, 16)
    filler = speed.Filler(model, seed)
    keys, values = filler.block(layer=1, start=40, count=8, batch=1)
    # position 40 holds seed slot 40 % 16 = 8 rotated by 32 positions: rotate the seed key by hand
    from trikv.geometry import RopeGeometry

    geometry = RopeGeometry.from_model(model)
    source = seed.keys[1][:, 8:9]  # [Hkv, 1, D], rotated at position 8
    rotated = geometry.rotate(source, torch.tensor([32]))  # rotating by 32 more (rotate() applies the scaling once more)
    expected = rotated / geometry.attention_scaling
    torch.testing.assert_close(keys[0, :, 0:1], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(values[0, :, 0], seed.values[1][:, 8])
    assert not torch.allclose(keys[0, :, 0], seed.keys[1][:, 8])  # the rotation really happened


def test_fill_keeps_bounded_caches_small_and_full_caches_preallocated():
    model = tiny_model("llama")
    filler = speed.Filler(model, speed.make_seed(model, None, 24))
    bounded = make_cache(model, "triattention", budget=16, divide_length=8, stats=tiny_stats(model), protect_prompt=False)
    speed.fill_cache(bounded, filler, context=200, batch=2, chunk=20)
    assert bounded.rounds >= 5 and bounded.capacity <= 16 + 8 + 20 and bounded.get_seq_length() == 200
    full = make_cache(model, "full", budget=None)
    full.reserve(300, 2)
    speed.fill_cache(full, filler, context=200, batch=2)
    assert full.capacity == 300 and full.entries() == 200


def test_memory_run_records_rss_and_bounded_entries(tmp_path):
    model = tiny_model("llama")
    record = speed.memory_run(model, None, tiny_stats(model), "triattention", 16, 150, 8, tmp_path, every=10, progress=False)
    assert record["max_entries_per_layer_head"] <= max(16 + 8, 64)  # the 64-token prompt once, then B..B+beta
    assert record["samples"][-1]["entries"] <= 16 + 8 and record["rounds"] >= 10
    assert all(s["rss_mb"] > 0 for s in record["samples"]) and (tmp_path / "memory.png").exists()


def test_percentile_and_bandwidth_probe():
    assert speed.decode._percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert abs(speed.decode._percentile(list(map(float, range(101))), 99) - 99.0) < 1e-9
    probe = speed.measure_bandwidth(8, repeats=2)
    assert probe["gbps"] > 0.05 and probe["gbps"] == max(probe["read_gbps"], probe["gemv_gbps"])


def test_fill_feeds_queries_to_policies_that_score_with_them():
    model = tiny_model("llama")
    seed = speed.make_seed(model, None, 16)
    assert seed.queries[0].shape == (model.config.num_attention_heads, 16, 16)
    cache = make_cache(model, "snapkv-decode", budget=16, divide_length=8, protect_prompt=False)
    speed.fill_cache(cache, speed.Filler(model, seed), context=100, batch=1, chunk=20)
    assert cache.rounds >= 2 and cache.query_window.queries.abs().sum() > 0


def test_speed_bench_runs_packed_layout_methods(tmp_path, monkeypatch):
    """PyramidKV / Ada-KV (packed caches) fill and decode in the bench; their bytes are those of the budget."""
    model = tiny_model("llama")
    monkeypatch.setattr(speed.peers, "llama_cpp_available", lambda: False)
    config = speed.SpeedConfig(
        model="tiny-llama", contexts=[96], methods=["full", "adakv", "pyramidkv", "snapkv-decode"], budgets=[16], batch_sizes=[1],
        engines=["lean"], steps=24, warmup=2, divide_length=8, seed_tokens=24, fill_chunk=32, engine_check=False,
        bandwidth_mb=8, out=str(tmp_path / "speed"), progress=False,
    )
    results = {r["method"]: r for r in speed.run_speed(config, model=model, tokenizer=None, stats=None)["results"]}
    assert set(results) == {"full", "adakv", "pyramidkv", "snapkv-decode"}
    for method in ("adakv", "pyramidkv"):
        assert results[method]["round_steps"] >= 2 and results[method]["tokens_per_second"] > 0
        assert results[method]["kv_bytes_peak"] <= results["snapkv-decode"]["kv_bytes_peak"]


@pytest.mark.real_model
def test_seed_text_comes_from_the_shipped_texts_and_reaches_any_length(real_model):
    """The speed benchmark's seed is the shipped English text through the model's tokenizer, repeated to the
    length asked for (a missing text folder once made it loop forever on an empty encoding)."""
    from trikv.analysis.texts import default_texts
    from trikv.benchmarks.speed.filling import seed_text_ids

    _, tokenizer = real_model
    text_ids = tokenizer("\n\n".join(default_texts().values()), add_special_tokens=False)["input_ids"]
    for length in (10, 3 * len(text_ids) + 7):
        ids = seed_text_ids(tokenizer, tokenizer.vocab_size, length)
        assert len(ids) == length and ids[: min(length, 500)] == text_ids[: min(length, 500)]
    assert ids[len(text_ids) : len(text_ids) + 50] == text_ids[:50]  # the text starts again after itself


def test_an_empty_seed_text_is_an_error_not_a_loop(monkeypatch):
    from trikv.benchmarks.speed import filling

    class Silent:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": []}

    with pytest.raises(ValueError, match="encode to no tokens"):
        filling.seed_text_ids(Silent(), 100, 64)


def test_a_target_row_names_the_compute_floor_when_the_run_measured_it():
    """Full attention at a context of B tokens is the fastest a B-entry cache can step; the row says what share of
    the speed-up that floor allows was reached (full's time / the floor's time), from the record's own numbers."""
    from trikv.benchmarks.speed_report import targets

    def cell(method, context, budget, ms, bound_ms, speedup=None, bound_speedup=None):
        return {"engine": "lean", "batch": 8, "context": context, "method": method, "budget": budget, "ms_p50": ms,
                "bound_ms": bound_ms, "speedup_vs_full": speedup, "bound_speedup_vs_full": bound_speedup,
                "efficiency_vs_bound": None if speedup is None else speedup / bound_speedup, "scoring_share": 0.01,
                "p99_over_p50": 1.1, "spread": True}

    record = {"results": [cell("full", 256, None, 70.0, 15.0), cell("full", 16384, None, 560.0, 160.0),
                          cell("triattention", 16384, 256, 80.0, 16.0, speedup=7.0, bound_speedup=10.0)]}
    row = next(r for r in targets(record) if "16K, triattention B=256" in r[0])
    assert row[2] is False  # the target is the memory bound's; the floor only explains the gap
    assert "x7.00 vs bound x10.00 (70%)" in row[1]
    assert "256-token context takes 70.0 ms" in row[1] and "at most x8.00 is attainable: 88% of it" in row[1]
    record["results"] = record["results"][1:]  # no floor measured: nothing claimed
    assert "attainable" not in next(r for r in targets(record) if "B=256" in r[0])[1]


class _Tokenizer:
    pad_token_id = 0
    eos_token_id = 5
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("engine", ["lean", "transformers"])
@pytest.mark.parametrize("sampled", [False, True])
def test_interleaved_decodings_give_what_generate_gives(engine, sampled):
    """Decoded in turns, each generation makes the tokens trikv.generate makes alone (left padding, EOS, sampling
    from its own seeded random state) with the same rounds and memory figures."""
    import trikv
    from trikv.benchmarks.speed.paired import Decoding, interleave

    model = tiny_model("llama")
    stats = tiny_stats(model)
    torch.manual_seed(3)
    prompts = [torch.randint(6, 96, (n,)).tolist() for n in (29, 11)]
    common = dict(max_new_tokens=60, min_new_tokens=10, do_sample=sampled, temperature=0.7, top_p=0.9, seed=4, engine=engine)
    bounded = dict(method="triattention", stats=stats, budget=16, divide_length=8)
    decodings = [Decoding(model, _Tokenizer(), prompts, method="full", **common),
                 Decoding(model, _Tokenizer(), prompts, **bounded, **common)]
    torch.manual_seed(123)  # the global random state is not what they draw from
    interleave(decodings, block=3)
    for decoding, options in zip(decodings, ({"method": "full"}, bounded)):
        alone = trikv.generate(model, _Tokenizer(), prompts, **options, **common)
        ours = decoding.result()
        assert ours.tokens == alone.tokens and ours.texts == alone.texts and ours.steps == alone.steps
        assert (ours.compression_rounds, ours.peak_entries, ours.peak_cache_bytes) == (
            alone.compression_rounds, alone.peak_entries, alone.peak_cache_bytes)
        assert len(decoding.step_seconds) == len(decoding.contexts) == ours.steps - 1
        assert decoding.contexts[0] == 29 + 1 and decoding.contexts[-1] == 29 + ours.steps - 1
    assert decodings[1].cache.rounds >= 3 and sum(decodings[1].round_seconds) > 0
    assert sum(decodings[0].round_seconds) == 0


def test_paired_ratio_and_break_even_from_known_step_times():
    """The ratio of totals over the steps both runs made, an interval that holds it and narrows as load that hits
    both runs alike is shared; the break-even context where a growing reference crosses a flat bounded cost."""
    from trikv.benchmarks.speed.paired import break_even_context, paired_blocks, paired_ratio

    generator = torch.Generator().manual_seed(0)
    load = 1 + torch.rand(400, generator=generator)  # machine noise, the same for both runs of a block
    reference = (0.030 * load).tolist()
    other = (0.025 * load).tolist()
    ratio, low, high = paired_ratio(reference, other)
    assert ratio == pytest.approx(1.2) and low == pytest.approx(1.2) and high == pytest.approx(1.2)
    other_noisy = (0.025 * (1 + torch.rand(400, generator=generator))).tolist()  # load that hit one run only
    ratio, low, high = paired_ratio(reference, other_noisy)
    assert low < ratio < high and high - low > 0.02
    assert paired_blocks(reference, other[:17], block=8).shape == (3, 2)  # decode steps 1..17: turns 0, 1, 2
    # full attention grows by 10 us per token from 20 ms at context 0; the bounded cache costs 25 ms a step after
    # its first round (step 100): full costs more from context 500 on
    contexts = list(range(100, 1100))
    full = [0.020 + 1e-5 * c for c in contexts]
    bounded = [0.020 + 1e-5 * c if step < 100 else 0.025 for step, c in enumerate(contexts)]
    assert break_even_context(contexts, full, bounded, bounded_from=100) == pytest.approx(500, rel=0.02)
    flat = [0.03] * 1000  # no growth with the context: faster everywhere after the round, or not resolved
    assert break_even_context(contexts, flat, bounded, bounded_from=100) == contexts[100]
    assert break_even_context(contexts, [0.025] * 1000, bounded, bounded_from=100) is None
    assert break_even_context(contexts, full, bounded, bounded_from=990) is None  # too few blocks after the round


def test_whole_generation_rows_and_their_target(tmp_path):
    """`--whole-generation`: per batch and N, full attention and each bounded cache decoded interleaved from a real
    prompt; speed-ups with intervals, the same without the rounds, and the target checked from those numbers."""
    from trikv.benchmarks.speed.whole import run_whole_generation, whole_targets
    from trikv.benchmarks.speed_report import write_speed_report

    model = tiny_model("llama")
    config = speed.SpeedConfig(
        model="tiny-llama", methods=["full", "triattention"], budgets=[16, 96], batch_sizes=[1, 2], engines=["lean"],
        divide_length=8, out=str(tmp_path / "whole"), progress=False, whole_generation=[24, 72], prompt_tokens=12,
    )
    record = run_whole_generation(config, model, None, tiny_stats(model))
    results = record["results"]
    assert len(results) == 2 * 2 * 3  # batches x N x (full + two budgets)
    for r in results:
        assert r["tokens_per_second"] > 0 and len(r["step_ms"]) == r["new_tokens"] - 1
        if r["method"] == "full":
            assert r["entries_final"] == 12 + r["new_tokens"] - 1 and r["rounds"] == 0
            continue
        assert r["speedup_low"] <= r["speedup_vs_full"] <= r["speedup_high"]
        assert r["speedup_without_rounds"] >= r["speedup_vs_full"] and r["round_seconds"] > 0  # scoring ahead at least
        if r["budget"] == 16:  # a round every 8 tokens from 24 entries on
            assert r["rounds"] >= (12 + r["new_tokens"] - 24) // 8 and r["entries_peak"] <= 16 + 8
            assert r["first_round_context"] == 24 + 1  # the step that finds 24 entries attends to 25
        else:  # never reaches 96 + 8 entries: no round, the same entries as full attention
            assert r["rounds"] == 0 and r["first_round_context"] is None
    rows = whole_targets(record)
    assert len(rows) == 2 * 2 * 2 and all(row[2] == (_high(record, row) >= 1.0) for row in rows)
    slow = json.loads(json.dumps(record))  # a bounded path slower than full beyond its rounds fails its row
    for r in slow["results"]:
        if r["method"] != "full":
            r["speedup_without_rounds"], r["without_rounds_low"], r["without_rounds_high"] = 0.9, 0.85, 0.95
    assert not any(row[2] for row in whole_targets(slow))
    page = write_speed_report([tmp_path / "whole"], tmp_path / "speed.md").read_text()
    assert "## Whole generations `whole`" in page
    assert sum(line.startswith("| bounded >= full beyond its round cost") for line in page.splitlines()) == 8
    assert "N=72, triattention B=16" in page and (tmp_path / "whole" / "whole.png").stat().st_size > 1000


def _high(record: dict, row) -> float:
    r = next(r for r in record["results"] if r["method"] != "full" and
             row[0].endswith(f"batch {r['batch']}, N={r['new_tokens']}, triattention B={r['budget']}"))
    return r["without_rounds_high"]


# ---- the page's header, from run files built here (no model) ---------------------------------------------------
def _speed_row(method, context, budget, ms, speedup=None, bound_speedup=None, p99_over_p50=1.2):
    return {"engine": "lean", "method": method, "budget": budget, "spread": None if budget is None else True, "batch": 1,
            "context": context, "tokens_per_second": 1000 / ms, "ms_p50": ms, "ms_p99": ms * p99_over_p50,
            "ms_max": ms * 2, "p99_over_p50": p99_over_p50, "scoring_share": 0.0 if budget is None else 0.01,
            "kv_bytes_final": 2**20, "kv_bytes_peak": 2**20, "rss_peak_mb": 900.0, "bound_ms": ms / 2, "bound_fraction": 0.5,
            "speedup_vs_full": speedup if budget is not None else 1.0, "bound_speedup_vs_full": bound_speedup,
            "efficiency_vs_bound": None if speedup is None or bound_speedup is None else speedup / bound_speedup}


def _speed_record(p99_over_p50=1.2, commit="abc1234"):
    return {"command": "trikv bench speed --out runs/speed/main", "commit": commit,
            "machine": {"torch": "2.13", "threads": 2, "bandwidth": {"gbps": 30.0}},
            "model": {"name": "tiny", "dtype": "torch.float32", "weight_bytes_per_step": 5e8, "kv_bytes_per_token": 46080},
            "fill": "tiled", "process_peak_rss_mb": 1000.0, "skipped": [],
            "results": [_speed_row("full", 1024, None, 40.0), _speed_row("triattention", 1024, 256, 35.0, 1.14, 1.1),
                        _speed_row("full", 4096, None, 56.0),
                        _speed_row("triattention", 4096, 256, 35.0, 1.60, 1.3, p99_over_p50=p99_over_p50)]}


def _memory_record(max_entries=280, per_token=None):
    samples = [{"tokens": t, "rss_mb": 800.0 + t / 100, "entries": min(t - 1, 280), "kv_bytes": min(t - 1, 280) * 46080,
                "seconds": t / 30} for t in (65, 1025, 2049, 4001)]
    record = {"command": "trikv bench speed --memory-run 4000", "threads": 2, "method": "triattention", "budget": 256,
              "divide_length": 24, "engine": "lean", "tokens": 4000, "max_entries_per_layer_head": max_entries,
              "limit": 280, "rounds": 150, "samples": samples, "seconds": 120.0}
    return record | ({"kv_bytes_per_token": per_token} if per_token else {})


def _write_runs(root, speed_record, memory_record):
    for name, file, record in (("main", "speed.json", speed_record), ("memory", "memory.json", memory_record)):
        (root / name).mkdir(exist_ok=True)
        (root / name / file).write_text(json.dumps(record))
    return [root / "main", root / "memory"]


def test_speed_page_opens_with_its_title_commit_line_and_headline_box(tmp_path):
    """Title, 'Generated by ... on DATE from commit ...' and a box whose figure and 'not met' list follow the run
    files: a run whose tail latency or memory goes past its target is named there."""
    import re

    from trikv.benchmarks.speed_report import write_speed_report

    folders = _write_runs(tmp_path, _speed_record(), _memory_record())
    page = write_speed_report(folders, tmp_path / "speed.md", title="Speed of tiny").read_text().splitlines()
    assert page[0] == "# Speed of tiny"
    assert re.fullmatch(r"Generated by `trikv bench speed-report \S+/main \S+/memory --out \S+/speed\.md --title "
                        r"'Speed of tiny'` on \d{4}-\d\d-\d\d from commit abc1234, as the run files record \(1 of 2 runs "
                        r"record none\); do not edit by hand\.", page[2]), page[2]
    measured, figure, checked = page[4:7]
    assert measured.startswith("> - measured: decode speed of tiny at 1,024-4,096 tokens of context, batch 1: full, "
                               "triattention B=256; memory over one 4,000-token generation")
    assert figure == ("> - main figure: triattention B=256 decodes x1.60 as fast as full attention at 4,096 tokens of "
                      "context (batch 1, lean engine)")
    assert checked == "> - targets: 2 met, 0 not met"
    assert page[7] == ""
    # the memory run's plot is drawn from memory.json, full attention beside the bounded cache
    assert "![memory](speed_files/1_memory_memory.png)" in page
    assert (tmp_path / "speed_files" / "1_memory_memory.png").stat().st_size > 1000
    assert any("where full attention would hold 175.8 MiB (46,080 bytes per token, computed" in line for line in page)
    # the same runs with a slow tail and a memory run past its limit: both named as not met
    _write_runs(tmp_path, _speed_record(p99_over_p50=2.5), _memory_record(max_entries=300))
    page = write_speed_report(folders, tmp_path / "speed.md").read_text().splitlines()
    assert page[0] == "# trikv speed and memory"
    assert page[6] == ("> - targets: 0 met, 2 not met: `main`: p99 / p50 time per token <= 2; "
                       "`memory`: most entries per (layer, KV head) <= B + beta = 280")
    # no run records a commit: the repository's HEAD stands in, and the line says so
    _write_runs(tmp_path, _speed_record(commit=None), _memory_record())
    page = write_speed_report(folders, tmp_path / "speed.md").read_text().splitlines()
    assert re.search(r"from (commit \w+( \(with uncommitted changes\))?, the repository's HEAD when the page was generated: "
                     r"the run files record no commit|an unknown commit); do not edit by hand\.$", page[2]), page[2]


def test_memory_plot_shows_full_attention_beside_the_bounded_cache(tmp_path, monkeypatch):
    """Full attention's line is tokens x K/V bytes per token: the recorded figure where the run has one, else
    bytes / entries of the first sample (and the legend says it was computed)."""
    import matplotlib.figure

    from trikv.benchmarks.speed.report import memory_bytes_per_token, plot_memory

    drawn = []  # {label: y values} of each figure's lines, instead of a file

    def savefig(figure, path, **kwargs):
        drawn.append({line.get_label(): line.get_ydata() for line in figure.axes[0].get_lines()})

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    for record, per_token, note in ((_memory_record(), 46080, "computed"), (_memory_record(per_token=50000), 50000, "recorded")):
        assert memory_bytes_per_token(record)[0] == per_token
        plot_memory(record, tmp_path / "memory.png")
        full = next(label for label in drawn[-1] if label.startswith("full attention"))
        assert note in full and f"{per_token:,} bytes" in full
        tokens = [s["tokens"] for s in record["samples"]]
        assert list(drawn[-1][full]) == pytest.approx([t * per_token / 2**20 for t in tokens])
        assert any(label.startswith("triattention B=256") for label in drawn[-1])


def test_an_unknown_method_or_engine_is_refused_before_a_model_loads_in_every_mode(monkeypatch, capsys):
    """The grid, --whole-generation and --memory-run refuse an unknown method or engine with the known names, before
    any model loads (the CLI's own entry point, in this process: a model load fails the test)."""
    import trikv
    from trikv.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(trikv, "load_model", no_model)
    for mode in ([], ["--whole-generation", "48"], ["--memory-run", "48"]):
        for bad, message in ((["--methods", "full,magic"], "unknown method 'magic'; available: full, triattention"),
                             (["--engines", "turbo"], "unknown engine 'turbo'; expected lean or transformers")):
            code = main(["bench", "speed", *mode, *bad, "--out", "unused"])
            stderr = capsys.readouterr().err
            assert code != 0 and message in stderr, (mode, bad, stderr[-500:])
