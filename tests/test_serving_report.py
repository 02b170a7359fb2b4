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


# ---- KV cache dtypes: the same pool bytes at every dtype, run names, the page's rows -----------------------------
def test_the_pool_is_the_same_bytes_at_every_kv_cache_dtype(tmp_path):
    """A bfloat16 model's fp8 pool has twice the blocks of its auto pool (a float32 model's four times), and a block
    weighs half (a quarter): the pool's bytes are the same; the spec and the engine's arguments carry the dtype."""
    from trikv.benchmarks import serving
    from trikv.benchmarks.serving_engine import _engine_kwargs

    args = _serve_args("--dtype", "bfloat16", "--length", "4096", "--pool-requests", "4", "--kv-cache-dtype", "auto,fp8")
    assert serving.pool_blocks(args, "auto") == 4 * 128 + 1 and serving.pool_blocks(args, "fp8") == 2 * 4 * 128 + 1
    layouts = {d: serving.kv_layout("smollm2-135m", "bfloat16", d, 32) for d in ("auto", "fp8")}
    assert layouts["fp8"]["element_bytes"] == 1 and layouts["auto"]["entry_bytes"] == 2 * layouts["fp8"]["entry_bytes"]
    assert ((serving.pool_blocks(args, "auto") - 1) * layouts["auto"]["block_bytes"]
            == (serving.pool_blocks(args, "fp8") - 1) * layouts["fp8"]["block_bytes"])
    # SmolLM2-135M: 30 layers, 3 KV heads of 64: keys and values of a token at one byte per element
    assert layouts["fp8"]["entry_bytes"] == 2 * 30 * 3 * 64
    wide = _serve_args("--dtype", "float32", "--length", "4096", "--pool-requests", "4")
    assert serving.pool_blocks(wide, "fp8_e5m2") - 1 == 4 * (serving.pool_blocks(wide, "auto") - 1)
    config = {"method": "triattention", "budget": 512, "kv_cache_dtype": "fp8", "concurrency": 16}
    spec = serving._spec(args, config, "offline", tmp_path, 0)
    assert spec["pool_blocks"] == 1025 and spec["kv_cache_dtype"] == "fp8" and _engine_kwargs(spec)["kv_cache_dtype"] == "fp8"
    plain = serving._spec(args, {**config, "kv_cache_dtype": "auto"}, "offline", tmp_path, 0)
    assert "kv_cache_dtype" not in plain and _engine_kwargs(plain)["kv_cache_dtype"] == "auto"


def test_each_method_runs_at_each_kv_cache_dtype_under_its_own_name():
    from trikv.benchmarks import serving

    args = _serve_args("--concurrency", "16", "--methods", "full,triattention", "--kv-cache-dtype", "auto,fp8")
    assert [serving._label(config) for config in serving._configurations(args)] == [
        "full-n16", "triattention-B512-n16", "full-fp8-n16", "triattention-B512-fp8-n16"]
    assert serving._label({"method": "full", "budget": None, "concurrency": 8}) == "full-n8"  # a run recorded before


@pytest.mark.parametrize("value, unknown", [("auto,fp16", "'fp16'"), ("fp8,int8", "'int8'"), (",", None)])
def test_a_bad_kv_cache_dtype_is_refused_before_any_engine(value, unknown, capsys):
    from trikv.benchmarks import serving
    from trikv.cli import main

    with pytest.raises(ValueError, match="--kv-cache-dtype takes a comma-separated list of auto, fp8, fp8_e4m3, fp8_e5m2"):
        serving.kv_cache_dtypes(value)
    assert main(["bench", "serve", "--kv-cache-dtype", value, "--out", "/nonexistent/never-written"]) == 2
    error = capsys.readouterr().err
    assert f"trikv bench: error: --kv-cache-dtype takes a comma-separated list of auto, fp8, fp8_e4m3, fp8_e5m2; got {value!r}" in error
    if unknown:
        assert f"({unknown} unknown)" in error


def test_max_batch_climbs_each_engine_at_each_kv_cache_dtype(tmp_path, monkeypatch):
    """Full attention's fp8 pool (twice the blocks) holds more pre-aged requests, so it climbs further; every engine
    is compared with full attention at its own KV dtype and with itself at auto; floors run at each engine's KV dtype."""
    from trikv.benchmarks import serving

    args = _serve_args("--dtype", "bfloat16", "--length", "8192", "--concurrency", "8,16,32", "--methods", "full,triattention",
                       "--kv-cache-dtype", "auto,fp8", "--max-batch")
    labels = []

    def run_one(spec, out, label, reuse=False):
        labels.append(label)
        fp8 = spec.get("kv_cache_dtype") == "fp8"
        tokens = spec["concurrency"] * (10.0 if spec.get("trikv") else 5.0) * (1.5 if fp8 else 1.0)
        return {"output_tokens_per_second": tokens, "tpot_seconds": {"p50": 0.1, "p99": 0.12}, "preemptions_in_window": 0,
                "warmup_seconds": 1.0, "window_seconds": 1.0, "peak_kv_blocks": 100,
                "trikv": {"rounds": 1, "seconds": 0.1, "max_request_blocks": 20} if spec.get("trikv") else None}

    monkeypatch.setattr(serving, "run_one", run_one)
    runs, summary = serving.max_batch(args, serving._configurations(args), "offline", tmp_path)
    assert [label for label in labels if label.startswith("full")] == ["full-n8-offline", "full-fp8-n8-offline", "full-fp8-n16-offline"]
    assert "triattention-B512-fp8-n32-offline" in labels and "floor-fp8-n32-offline" in labels and "floor-n32-offline" in labels
    by_engine = {serving.engine_name(entry): entry for entry in summary}
    assert set(by_engine) == {"full", "triattention B=512", "full fp8", "triattention B=512 fp8"}
    assert by_engine["full fp8"]["best_concurrency"] == 16 and by_engine["full fp8"]["pool_blocks"] == 2 * 4 * 256 + 1
    assert by_engine["triattention B=512 fp8"]["best_vs_full_best"] == pytest.approx(320 * 1.5 / (80 * 1.5))  # same KV dtype
    assert by_engine["triattention B=512 fp8"]["best_vs_auto_best"] == pytest.approx(1.5)
    assert by_engine["full fp8"]["best_vs_auto_best"] == pytest.approx(120 / 40)
    assert by_engine["full"]["best_vs_auto_best"] is None
    fp8_run = next(run for run in runs if serving._label(run) == "triattention-B512-fp8-n32")
    layout = serving.kv_layout("smollm2-135m", "bfloat16", "fp8", 32)
    kv = serving.request_kv_bytes(fp8_run, layout, 8192, 128)
    assert kv["stated_entries"] == 512 + 128 and kv["stated_bytes"] == 640 * 2 * 30 * 3 * 64
    assert kv["max_request_bytes"] == 20 * 32 * 2 * 30 * 3 * 64 and kv["mean_bytes_at_peak"] == 100 * 32 * 2 * 30 * 3 * 64 / 32


def test_serving_page_names_the_kv_dtype_of_every_row(tmp_path):
    """A max-batch record at auto and fp8: the run table has a KV dtype column, the max-batch table an engine
    `triattention B=512 fp8` and its `x auto`, the pool rule and the KV bytes per request are stated."""
    from trikv.benchmarks import serving
    from trikv.benchmarks.serving_report import write_serving_report

    record = _serving_record(3.0)
    record["settings"].update(dtype="bfloat16", kv_cache_dtype="auto,fp8")
    layouts = {d: serving.kv_layout("smollm2-135m", "bfloat16", d, 32) for d in ("auto", "fp8")}
    fp8 = [{**run, "kv_cache_dtype": "fp8", "pool_blocks": 2049, "output_tokens_per_second": 1.2 * run["output_tokens_per_second"]}
           for run in record["runs"]]
    record["runs"] += fp8
    for run in record["runs"]:
        run["trikv"] = {"rounds": 10, "seconds": 0.5, "max_request_blocks": 20} if run["budget"] else None
        run["kv_bytes"] = serving.request_kv_bytes(run, layouts[run.get("kv_cache_dtype", "auto")], 8192, 128)
    record.update(pool_rule=serving.POOL_RULE, pool_bytes=1024 * layouts["auto"]["block_bytes"],
                  pool_blocks_by_kv_dtype={"auto": 1025, "fp8": 2049}, kv_layout=layouts)
    record["max_batch"] = [
        {"method": m, "budget": b, "kv_cache_dtype": d, "best_concurrency": 32, "tokens_per_second": t, "stopped": "top",
         "tpot_p50": 0.1, "tpot_p99": 0.15, "floor_tokens_per_second": 400.0, "share_of_floor": t / 400,
         "compaction_share": 0.02 if b else None, "best_vs_full_best": None if b is None else 3.0,
         "best_vs_auto_best": None if d == "auto" else 1.2}
        for d in ("auto", "fp8") for m, b, t in (("full", None, 100.0 * (1.2 if d == "fp8" else 1)),
                                                  ("triattention", 512, 300.0 * (1.2 if d == "fp8" else 1)))]
    folder = _serving_folder(tmp_path, "fp8", record)
    page = write_serving_report([folder], tmp_path / "docs" / "serving.md").read_text()
    assert page.splitlines()[0].endswith("each one's best concurrency, KV cache bfloat16 and fp8, 8,192-token requests "
                                          "(smollm2-135m, offline)")
    assert "each engine's best over its best at bfloat16 KV: full fp8 x1.20, triattention B=512 fp8 x1.20" in page
    assert "The rule: the KV pool is the same number of bytes for every KV cache dtype" in page
    assert "- KV pool: 720 MiB at every KV dtype: bfloat16 KV 1024 blocks of 737,280 bytes (23,040 bytes per token: 2 per element); fp8 KV 2048 blocks" in page
    table = page.split("```")[1].strip("\n").splitlines()
    assert "KV dtype" in table[0]
    assert table[2].split()[:3] == ["full-n32", "offline", "bfloat16"]
    assert table[4].split()[:3] == ["full-fp8-n32", "offline", "fp8"] and table[4].split()[-1] == "2048"
    assert "triattention B=512 fp8" in page and "x auto" in page
    (line,) = [line for line in page.splitlines() if line.startswith("triattention-B512-fp8-n32")
               and "fp8" in line.split()[1]]
    # 640 entries x 11,520 bytes = 7.03 MiB stated; 20 blocks x 32 x 11,520 = 7.03 MiB held; 1000 blocks over 32 slots
    assert line.split()[1:] == ["fp8", "11,520", "640", "7.03", "20", "7.03", "10.99"]
    assert "triattention B=512 fp8 at its best concurrency vs full attention at its best (same KV dtype)" in page


def test_the_committed_max_batch_page_is_what_its_kept_run_gives(tmp_path):
    """docs/serving-max-batch.md is rendered from the run kept in docs/runs/serve/max-batch-fp8: rendered again from
    there with its own title, every line but the one naming the command and date is the committed page's; the run
    holds what the page states (the same pool bytes at bfloat16 and fp8, a bounded fp8 request at 640 one-byte
    entries)."""
    import json
    from pathlib import Path

    from trikv.benchmarks.serving_report import write_serving_report

    root = Path(__file__).resolve().parents[1]
    committed = (root / "docs" / "serving-max-batch.md").read_text().splitlines()
    title = committed[0].removeprefix("# ")
    assert committed[2].startswith("Generated by `trikv bench serve-report docs/runs/serve/max-batch-fp8 --out "
                                   "docs/serving-max-batch.md --title ")
    page = write_serving_report([root / "docs" / "runs" / "serve" / "max-batch-fp8"], tmp_path / "serving-max-batch.md",
                                title).read_text().splitlines()
    assert len(page) == len(committed)
    stale = [(mine, theirs) for index, (mine, theirs) in enumerate(zip(page, committed)) if index != 2 and mine != theirs]
    assert not stale, f"docs/serving-max-batch.md differs from what its kept run gives; first difference: {stale[:1]}"
    record = json.loads((root / "docs" / "runs" / "serve" / "max-batch-fp8" / "serving.json").read_text())
    pools = {run["kv_cache_dtype"]: run["kv_pool"] for run in record["runs"]}
    assert pools["fp8"]["num_blocks"] - 1 == 2 * (pools["auto"]["num_blocks"] - 1)
    assert pools["fp8"]["block_bytes"] * 2 == pools["auto"]["block_bytes"]
    bounded = [run for run in record["runs"] if run["kv_cache_dtype"] == "fp8" and run["budget"] == 512]
    assert all(run["kv_bytes"]["stated_bytes"] == 640 * pools["fp8"]["block_bytes"] // 32 for run in bounded)
