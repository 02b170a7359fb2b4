"""Admission on a pool that holds two bounds: bounded requests arriving one after another, then requests sharing a
cached prefix on the same full pool. vLLM admits a waiting bounded request for its bound (not its prompt), counted
against the blocks free at that step; these tests look for the case where that over-admits: requests admitted while
the running ones sit just after a round (holding least), which then grow back to their bound and force vLLM to
preempt one (a preempted bounded request recomputes its whole history). Counted with vLLM's own preemption counter,
and at every step of the run from the scheduler's own bookkeeping: no request ever holds more blocks than its
bound, no request restarts, every request ends with all its tokens and every block returns to the pool.
"""

from __future__ import annotations

import math
import os

import pytest

if os.environ.get("TRIKV_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (the test command installs it: a missing vLLM must fail, not skip)
else:
    pytest.importorskip("vllm")

from vllm_engines import (BLOCK, BUDGET, SLACK, _steps_of, _trikv_settings, engine_run,  # noqa: E402
                          bundled_text_ids, module_engine_runs, scenario)

pytestmark = [pytest.mark.vllm]

STEP_TOKENS = 32  # the engine's token budget per step: the prefill chunk of a request past its trigger
BOUND_BLOCKS = math.ceil((BUDGET + SLACK + STEP_TOKENS) / BLOCK)  # 4 blocks: budget + slack + one chunk
POOL = 2 * BOUND_BLOCKS + 1  # two requests at their bound, and vLLM's null block
PROMPT, NEW_TOKENS, SHARED = 150, 60, 96  # prompts past budget + slack (chunked, with rounds); a 3-block shared prefix
ARRIVALS = [0, 6, 12, 18]


@pytest.fixture(scope="module")
def engines_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-admission")


@pytest.fixture(scope="module")
def text_ids(real_model):
    return bundled_text_ids(real_model[1])


@pytest.fixture(scope="module")
def engine_runs(request, engines_dir) -> dict[str, dict]:
    return module_engine_runs(request, engines_dir, None)


@scenario("admission")
def _admission(request, prompts):
    ids = request.getfixturevalue("text_ids")
    staggered = [ids[1000 + 400 * i : 1000 + 400 * i + PROMPT] for i in range(len(ARRIVALS))]
    prefix = ids[4000 : 4000 + SHARED]
    shared = [prefix + ids[5000 + 100 * i : 5000 + 100 * i + PROMPT - SHARED] for i in range(len(ARRIVALS))]
    return {"dtype": "float32", "trikv": {**_trikv_settings(), "prefix_caching": True},
            "engine": {"num_gpu_blocks_override": POOL, "max_model_len": (POOL - 1) * BLOCK, "max_num_seqs": 8,
                       "enable_chunked_prefill": True, "max_num_batched_tokens": STEP_TOKENS, "disable_log_stats": False},
            "schedule_records": True, "metrics": True,
            "batches": [{"prompts": staggered, "max_tokens": [NEW_TOKENS] * len(ARRIVALS), "arrivals": ARRIVALS},
                        {"prompts": shared, "max_tokens": [NEW_TOKENS] * len(ARRIVALS), "arrivals": ARRIVALS}]}


@pytest.mark.extended  # a full pool's engine run; CI keeps the bound and preemption's recompute (test_vllm.py's stress)
@pytest.mark.engines("admission")
def test_staggered_arrivals_on_a_pool_of_two_bounds_are_never_over_admitted(engine_runs):
    """Four bounded requests arrive six steps apart on a pool that holds two at their bound, first with prompts of
    their own, then with a cached 96-token prefix in common (prefix caching on, the pool full): vLLM preempts no
    request; the pool was contended (requests waited for admission, two ran at once); every step of every request
    holds at most its bound; the shared prefix was hit; all requests end with their tokens and every block returns."""
    run = engine_run(engine_runs, "admission")
    assert run["stats"][0]["preemptions"] == 0, f"{run['stats'][0]['preemptions']} preemptions on a pool of two bounds"
    for batch in (0, 1):
        schedule = run["batches"][batch]["schedule"]
        requests = run["batches"][batch]["requests"]
        assert all(len(r["tokens"]) == NEW_TOKENS for r in requests)
        held = [chunk[2] for step in schedule for chunk in step.values()]
        assert max(held) <= BOUND_BLOCKS, f"batch {batch}: a request held {max(held)} blocks, its bound is {BOUND_BLOCKS}"
        running = [len(step) for step in schedule]
        assert max(running) >= 2, "never two requests at once: the pool was not shared"
        first_step = [next(i for i, step in enumerate(schedule) if any(rid.split("-")[0] == r["request_id"] for rid in step))
                      for r in requests]
        waited = [first - arrival for first, arrival in zip(first_step, ARRIVALS)]
        assert max(waited) > 0, f"no request waited for admission (first steps {first_step}): the pool was not full"
        for request in requests:  # a request's chunks follow each other: no step restarted it (a preemption would)
            steps = _steps_of(run, batch, request["request_id"])
            assert all(b[0] == a[0] + a[1] for a, b in zip(steps, steps[1:]))
        print(f"batch {batch}: steps waited for admission {waited}, most running at once {max(running)}, "
              f"most blocks held {max(held)} of {BOUND_BLOCKS}")
    hits = run["batches"][1]["metrics"]["hits"] - run["batches"][0]["metrics"]["hits"]
    assert hits > 0, "the shared prefix was never hit"
    assert run["free_blocks_at_end"] == POOL - 1
