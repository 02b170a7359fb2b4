"""The serving page states what the recorded numbers compute (no vLLM needed: a record is built here)."""

from __future__ import annotations

import pytest

from trikv.benchmarks.serving_report import _bound_lines


def record(p50: float, p99: float, rounds: int, seconds: float) -> dict:
    run = {"method": "triattention", "budget": 256, "concurrency": 16, "mode": "offline",
           "output_tokens_per_second": 200.0, "tpot_seconds": {"p50": p50, "p99": p99},
           "peak_kv_blocks": 160, "preemptions_in_window": 0, "trikv": {"rounds": rounds, "seconds": seconds}}
    return {"runs": [run], "pool_blocks": 257}


@pytest.mark.parametrize("p50, p99, rounds, seconds, expected", [
    (0.080, 0.100, 200, 2.5, "TPOT p99 / p50 = 1.25; 200 compaction rounds since the engine started, 12.5 ms each"),
    (0.050, 0.200, 10, 0.5, "TPOT p99 / p50 = 4.00; 10 compaction rounds since the engine started, 50.0 ms each"),
])
def test_bound_lines_state_the_latency_ratio_and_the_rounds_cost(p50, p99, rounds, seconds, expected):
    (line,) = _bound_lines(record(p50, p99, rounds, seconds))
    assert expected in line


def test_bound_lines_of_full_attention_name_no_rounds():
    run = record(0.08, 0.09, 0, 0.0)
    (line,) = _bound_lines(run)
    assert "TPOT p99 / p50 = 1.12" in line and "compaction rounds" not in line


def test_full_attention_capacity_is_where_the_pre_aged_prompts_fill_the_pool():
    """8,192-token requests, a pool of 4 of them: the engine's own pre-aged prompts of 9 slots fit, of 10 do not."""
    from trikv.benchmarks.serving import full_attention_capacity
    from trikv.benchmarks.serving_engine import _prompts

    class Tokenizer:
        def __call__(self, text):
            return {"input_ids": list(range(len(text)))}

    pool = 4 * 8192
    capacity = full_attention_capacity(8192, 32, pool)
    sizes = {n: sum(map(len, _prompts({"length": 8192, "concurrency": n, "short_prompt": 32}, Tokenizer())))
             for n in (capacity, capacity + 1)}
    assert sizes[capacity] <= pool < sizes[capacity + 1]
    assert capacity == 9


def test_max_batch_stops_full_attention_where_its_requests_fill_the_pool(tmp_path, monkeypatch):
    """Full attention climbs only to its capacity whatever its measured gain; a bounded engine climbs on."""
    import argparse

    from trikv.benchmarks import serving

    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    args = parser.parse_args(["--length", "8192", "--concurrency", "4,8,16,32", "--methods", "full,triattention",
                              "--budgets", "512", "--max-batch"])
    ran = []

    def run_one(spec, out, label, reuse=False):
        ran.append(label)
        return {"output_tokens_per_second": 10.0 * spec["concurrency"], "tpot_seconds": {"p50": 0.1, "p99": 0.12},
                "preemptions_in_window": 0, "warmup_seconds": 1.0, "window_seconds": 1.0,
                "trikv": {"rounds": 1, "seconds": 0.1} if spec.get("trikv") else None}

    monkeypatch.setattr(serving, "run_one", run_one)
    runs, summary = serving.max_batch(args, serving._configurations(args), "offline", tmp_path)
    assert [r["concurrency"] for r in runs if r["method"] == "full"] == [4, 8]
    assert [r["concurrency"] for r in runs if r["method"] == "triattention"] == [4, 8, 16, 32]
    full = next(entry for entry in summary if entry["method"] == "full")
    assert full["best_concurrency"] == 8 and "fill the pool at 9 slots" in full["stopped"]


def test_reuse_reads_back_a_run_with_the_same_settings_only(tmp_path, monkeypatch):
    from trikv.benchmarks import serving, serving_engine

    calls = []
    monkeypatch.setattr(serving_engine, "run", lambda spec: calls.append(spec) or {"tokens": len(calls)})
    spec = {"concurrency": 8, "length": 8192, "in_process": True, "port": 8101, "log": "a.log"}
    assert serving.run_one(spec, tmp_path, "full-n8-offline") == {"tokens": 1}
    moved = {**spec, "port": 9000, "log": "b.log"}  # another port and log: the same measurement
    assert serving.run_one(moved, tmp_path, "full-n8-offline", reuse=True) == {"tokens": 1, "reused": True}
    assert len(calls) == 1
    assert serving.run_one(moved, tmp_path, "full-n8-offline") == {"tokens": 2}  # without reuse: measured again
    changed = {**spec, "length": 4096}
    assert serving.run_one(changed, tmp_path, "full-n8-offline", reuse=True) == {"tokens": 3} and len(calls) == 3


def _serve_args(*argv: str):
    import argparse

    from trikv.benchmarks import serving

    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_length_past_the_trained_positions_is_refused_unless_asked_for(tmp_path):
    import json

    from trikv.benchmarks import serving
    from trikv.benchmarks.serving_engine import _engine_kwargs

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    with pytest.raises(ValueError, match=r"--length 8192 is past .*trained positions \(4096\); pass --beyond-trained-context"):
        serving.check_length(_serve_args("--model", str(tmp_path), "--length", "8192"))
    assert serving.check_length(_serve_args("--model", str(tmp_path), "--length", "4096")) == 4096
    args = _serve_args("--model", str(tmp_path), "--length", "8192", "--beyond-trained-context")
    assert serving.check_length(args) == 4096
    spec = serving._spec(args, {"method": "full", "budget": None, "concurrency": 4}, "offline", tmp_path, 0)
    kwargs = _engine_kwargs(spec)
    assert kwargs["hf_overrides"] == {"max_position_embeddings": 8192} and kwargs["max_model_len"] == 8192
    plain = serving._spec(_serve_args("--model", str(tmp_path), "--length", "4096"),
                          {"method": "full", "budget": None, "concurrency": 4}, "offline", tmp_path, 0)
    assert "hf_overrides" not in _engine_kwargs(plain)


@pytest.mark.parametrize("length, ratio, status", [(16384, 3.2, True), (16384, 2.9, False), (8192, 5.0, None)])
def test_max_batch_target_is_judged_at_16k_only(length, ratio, status):
    from trikv.benchmarks.serving_report import target_rows

    record = {"settings": {"length": length, "pool_requests": 4}, "runs": [],
              "max_batch": [{"method": "full", "budget": None, "best_vs_full_best": None},
                            {"method": "triattention", "budget": 512, "best_vs_full_best": ratio}]}
    (row,) = target_rows(record)
    assert row[1] == f"x{ratio:.2f}" and row[2] is status


def test_max_batch_best_is_never_a_preempting_rung(tmp_path, monkeypatch):
    """The top rung preempts yet measures more tokens/s: the best stays at the largest batch the pool holds."""
    from trikv.benchmarks import serving

    args = _serve_args("--length", "8192", "--concurrency", "16,32,64", "--methods", "triattention", "--budgets", "512",
                       "--max-batch")
    floors = []

    def run_one(spec, out, label, reuse=False):
        if label.startswith("floor"):
            floors.append(spec["concurrency"])
        tokens = {16: 100.0, 32: 150.0, 64: 160.0}[spec["concurrency"]]
        return {"output_tokens_per_second": tokens, "tpot_seconds": {"p50": 0.1, "p99": 0.12},
                "preemptions_in_window": 4 if spec["concurrency"] == 64 and not label.startswith("floor") else 0,
                "warmup_seconds": 1.0, "window_seconds": 1.0, "trikv": None}

    monkeypatch.setattr(serving, "run_one", run_one)
    runs, (entry,) = serving.max_batch(args, serving._configurations(args), "offline", tmp_path)
    assert [r["concurrency"] for r in runs] == [16, 32, 64]
    assert entry["best_concurrency"] == 32 and entry["tokens_per_second"] == 150.0
    assert entry["stopped"] == "the pool preempts at 64" and floors == [32]


def test_bound_lines_say_when_the_warm_up_was_capped():
    capped = record(0.08, 0.1, 10, 0.5)
    capped["runs"][0].update(warmup_capped=True, warmup_seconds=901.0)
    (line,) = _bound_lines(capped)
    assert "the warm-up reached its cap (901 s) before every first request was compacted" in line
    (line,) = _bound_lines(record(0.08, 0.1, 10, 0.5))
    assert "warm-up" not in line


# ---- the page's header, from serving.json files built here ------------------------------------------------------
def _serving_run(method, budget, tokens_per_second, ratio=None, concurrency=32):
    return {"method": method, "budget": budget, "concurrency": concurrency, "mode": "offline",
            "output_tokens_per_second": tokens_per_second, "throughput_vs_full": ratio,
            "ttft_seconds": {"p50": 1.0, "p99": 2.0}, "tpot_seconds": {"p50": 0.1, "p99": 0.15},
            "peak_kv_blocks": 1000, "preemptions_in_window": 0, "trikv": None}


def _serving_record(ratio: float, length=8192, commit=None) -> dict:
    return {"command": "trikv bench serve --out runs/serve/main", "commit": commit,
            "settings": {"model": "smollm2-135m", "dtype": "float32", "length": length, "pool_requests": 4,
                         "block_size": 32, "window": 150.0},
            "pool_blocks": 1025, "machine": {"cpus": 2}, "elapsed_seconds": 600.0, "trained_positions": 8192,
            "runs": [_serving_run("full", None, 100.0, 1.0), _serving_run("triattention", 512, 100.0 * ratio, ratio)]}


def _serving_folder(root, name, record):
    import json

    (root / name).mkdir(exist_ok=True)
    (root / name / "serving.json").write_text(json.dumps(record))
    return root / name


def test_serving_page_opens_with_its_own_title_commit_line_and_headline_box(tmp_path):
    """Title derived from the runs (or given), 'Generated by ... on DATE from commit ...', and a box whose figure
    and 'not met' list follow serving.json: the B=512 run below 2.5x full attention is named as not met."""
    import re

    from trikv.benchmarks.serving_report import write_serving_report

    docs = tmp_path / "docs"
    docs.mkdir()
    folder = _serving_folder(tmp_path, "main", _serving_record(3.0, commit="1234abc"))
    page = write_serving_report([folder], docs / "serving.md").read_text().splitlines()
    assert page[0] == ("# trikv inside vLLM: full attention vs triattention B=512 at 32 concurrent, 8,192-token requests "
                       "(smollm2-135m, offline)")
    assert re.fullmatch(r"Generated by `trikv bench serve-report \S+/main --out \S+/serving\.md` on \d{4}-\d\d-\d\d from "
                        r"commit 1234abc, as the run files record; do not edit by hand\.", page[2]), page[2]
    assert page[4].startswith("> - measured: output tokens/s, TTFT and TPOT of vLLM engines (2 CPU cores)")
    assert page[5] == ("> - main figure: triattention B=512 at 32 concurrent serves x3.00 full attention's output tokens/s "
                       "at the same concurrency (8,192-token requests, offline, `main`)")
    assert page[6] == "> - targets: 1 met, 0 not met"
    _serving_folder(tmp_path, "main", _serving_record(2.0, commit="1234abc"))
    page = write_serving_report([folder], docs / "serving.md").read_text().splitlines()
    assert page[6].startswith("> - targets: 0 met, 1 not met: triattention B=512, 32 concurrent 8192-token generations")
    # another page of other runs gets another title; one that would repeat a page's title is refused
    other = _serving_folder(tmp_path, "short", _serving_record(3.0, length=2048))
    page = write_serving_report([other], docs / "serving-short.md").read_text().splitlines()
    assert page[0].endswith("at 32 concurrent, 2,048-token requests (smollm2-135m, offline)")
    with pytest.raises(ValueError, match="already has the title"):
        write_serving_report([folder], docs / "serving-again.md")
    assert write_serving_report([folder], docs / "serving-again.md", title="Again").read_text().startswith("# Again\n")
