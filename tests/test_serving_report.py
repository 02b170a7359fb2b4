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
