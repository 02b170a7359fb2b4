"""The calibration-length benchmark: slice statistics equal calibrating on the slice alone, kept-set agreement
against a direct count, the "enough" rule, the run and its page end to end, and calibrate's default following the
committed runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_model
from trikv.benchmarks import calibration_length as cl
from trikv.benchmarks.calibration_length_report import KL_TOLERANCE, enough_tokens, recommended_tokens

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def test_slice_statistics_equal_calibrating_on_the_slice_alone(monkeypatch):
    """One pass keeps per-block sums; the statistics of blocks 1..2 equal `calibrate` on those 2,048 tokens read in
    chunks of 1,024 (what `trikv calibrate --chunk-tokens 1024` does)."""
    from trikv.calibration import calibrate

    model = tiny_model("llama")
    ids = torch.randint(1, 96, (4 * cl.BLOCK_TOKENS + 100,), generator=torch.Generator().manual_seed(0))
    sums = cl.BlockSums(model, ids, progress=False)
    assert sums.blocks == 4  # the 100 tokens past the last whole block are not read
    part = sums.stats(model, 1, 2, source="slice")
    alone = calibrate(model, ids[cl.BLOCK_TOKENS : 3 * cl.BLOCK_TOKENS], source="slice", chunk_tokens=cl.BLOCK_TOKENS,
                      progress=False)
    torch.testing.assert_close(part.q_mean, alone.q_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(part.q_abs_mean, alone.q_abs_mean, rtol=1e-12, atol=1e-12)
    assert part.metadata["token_count"] == 2 * cl.BLOCK_TOKENS
    part.check_matches(model)  # a cache accepts them as the model's statistics
    with pytest.raises(ValueError, match="outside the text's 4 blocks"):
        sums.stats(model, 3, 2, source="slice")


def _direct_agreement(evict_a, evict_b, rounds):
    """The same figure counted entry by entry: after each round t, key j is held when j < t and it was not evicted at
    or before t."""
    L, b, H, T = evict_a.shape
    per_text = []
    for row in range(b):
        shares = []
        for t in rounds:
            for layer in range(L):
                for head in range(H):
                    held_a = {j for j in range(T) if j < t and int(evict_a[layer, row, head, j]) > t}
                    held_b = {j for j in range(T) if j < t and int(evict_b[layer, row, head, j]) > t}
                    shares.append(len(held_a & held_b) / max(len(held_a), 1))
        per_text.append(sum(shares) / len(shares))
    return per_text


def test_kept_agreement_counts_the_entries_both_runs_held():
    generator = torch.Generator().manual_seed(3)
    T, rounds = 40, [12, 20, 28, 36]
    logs = []
    for _ in range(2):
        evict = torch.full((2, 3, 2, T), T, dtype=torch.int32)  # [L, b, Hkv, T]
        # each round evicts a random subset of the keys still held
        for t in rounds:
            held = (torch.arange(T) < t) & (evict == T)
            drop = held & (torch.rand(evict.shape, generator=generator) < 0.3)
            evict[drop] = t
        logs.append({"batches": [{"evict_time": evict, "round_times": rounds}]})
    got = cl.kept_agreement(logs[0], logs[1])
    expected = _direct_agreement(logs[0]["batches"][0]["evict_time"], logs[1]["batches"][0]["evict_time"], rounds)
    assert got == pytest.approx(expected, abs=1e-12) and len(got) == 3
    assert all(0.3 < value < 1.0 for value in got)  # random evictions: far from either extreme
    assert cl.kept_agreement(logs[0], logs[0]) == pytest.approx([1.0] * 3)
    other = {"batches": [{"evict_time": logs[1]["batches"][0]["evict_time"], "round_times": rounds[:-1]}]}
    with pytest.raises(RuntimeError, match="different compression schedules"):
        cl.kept_agreement(logs[0], other)


def _run(kls: dict[int, list[float]]) -> dict:
    return {"model": "m", "cells": [{"tokens": tokens, "slice": index, "kl": kl} for tokens, values in kls.items()
                                    for index, kl in enumerate(values)]}


def test_enough_is_the_smallest_length_whose_every_slice_stays_within_tolerance_from_there_on():
    longest = [0.100, 0.102]
    limit = 0.101 * (1 + KL_TOLERANCE)
    run = _run({1024: [0.2, 0.12], 2048: [0.104, limit + 0.001], 5120: [0.103, 0.105], 51200: longest})
    assert enough_tokens(run) == 5120  # 2,048 has one slice past the limit
    run = _run({1024: [0.104], 2048: [limit + 0.001], 5120: [0.103], 51200: longest})
    assert enough_tokens(run) == 5120  # a good 1,024 below a bad 2,048 does not count
    run = _run({1024: [0.101, 0.1], 51200: longest})
    assert enough_tokens(run) == 1024
    assert enough_tokens(_run({51200: longest})) is None
    assert recommended_tokens([_run({1024: [0.101], 51200: longest}), _run({1024: [0.3], 2048: [0.1], 51200: longest})]) == 2048


@pytest.mark.extended  # a benchmark pipeline end to end
@pytest.mark.real_model
def test_calibration_length_run_and_page(tmp_path):
    """`trikv bench calibration-length` at a toy size on the bundled model (two lengths, two slices each, one trace),
    then its page: the page's figures are the run file's."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "trikv", "bench", "calibration-length", "--model", "smollm2-135m",
                           "--tokens", "1024,2048", "--slices", "2", "--traces", "1", "--trace-tokens", "128",
                           "--budget", "192", "--divide-length", "32", "--threads", "1", "--no-progress", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    run = json.loads((out / "calibration.json").read_text())
    assert [(cell["tokens"], cell["slice"]) for cell in run["cells"]] == [(1024, 0), (1024, 1), (2048, 0), (2048, 1)]
    assert all(cell["rounds"] > 0 and cell["kl"] > 0 for cell in run["cells"])
    assert run["cells"][0]["text_tokens"] == [0, 1024] and run["cells"][3]["text_tokens"] == [2048, 4096]
    kls = {cell["kl"] for cell in run["cells"]}
    assert len(kls) == 4  # different statistics, different fidelity
    assert set(run["kept_agreement"]) == {"1024", "2048"} and all(0 < v[0] <= 1 for v in run["kept_agreement"].values())
    assert set(run["references"]) == {"streaming", "shipped"}
    excluded = set(run["calibration_text"]["excluded_rows"])
    assert "math500-400" in excluded and "math500-100" in excluded
    page = tmp_path / "calibration.md"
    done = subprocess.run([sys.executable, "-m", "trikv", "bench", "calibration-length-report", str(out), "--out", str(page)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    text = page.read_text()
    for cell in run["cells"]:
        assert f"{cell['kl']:.4f}" in text or f"{cell['kl']:.4f}]" in text
    assert f"{run['references']['streaming']['kl']:.4f}" in text
    assert (tmp_path / "calibration_files" / "calibration_length.png").stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "trikv", "bench", "calibration-length", "--tokens", "1000", "--out",
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--tokens must be positive multiples of 1024, got [1000]" in bad.stderr



def test_the_calibrate_default_is_the_length_the_committed_runs_find_enough(tmp_path):
    """`trikv calibrate --text-tokens` defaults to the length docs/calibration.md recommends (computed from the
    committed runs, two models at least), and a shorter text is calibrated with a warning that says so."""
    from trikv.benchmarks.calibration_length_report import load_runs
    from trikv.cli import build_parser
    from trikv.settings import RECOMMENDED_CALIBRATION_TOKENS

    runs = load_runs(sorted(path for path in (ROOT / "docs" / "runs" / "calibration").iterdir() if path.is_dir()))
    assert len({run["model"] for run in runs}) >= 2
    assert RECOMMENDED_CALIBRATION_TOKENS == recommended_tokens(runs)
    args = build_parser().parse_args(["calibrate", "--text-file", "t.txt", "--out", "s.safetensors"])
    assert args.text_tokens == RECOMMENDED_CALIBRATION_TOKENS
    page = (ROOT / "docs" / "calibration.md").read_text()
    assert f"{RECOMMENDED_CALIBRATION_TOKENS:,}" in page
    text = tmp_path / "short.txt"
    text.write_text("The lamp was lit at dusk and put out by dawn. " * 40)
    done = subprocess.run([sys.executable, "-m", "trikv", "calibrate", "--model", "smollm2-135m", "--text-file", str(text),
                           "--out", str(tmp_path / "s.safetensors"), "--skip-sanity-check", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (f"fewer than the {RECOMMENDED_CALIBRATION_TOKENS:,} that were enough on every model measured "
            "(docs/calibration.md)") in done.stderr
