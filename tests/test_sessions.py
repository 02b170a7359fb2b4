"""Session reuse's kept states (`trikv.vllm.sessions`): the cut rule, the lookup and the store, without vLLM.

Expected continuations are computed here from the rule's definition (which slots hold which positions), never from
the store's own bookkeeping.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from trikv.vllm.sessions import INDEX_TOKENS, KeptState, SessionStore, common_prefix, cut

BLOCK = 16


def state(state_id="a", n=260, round_at=200, kept=64, prompt=40, protected=True, budget=64, owner=(0, None),
          tokens=None, first_block=0):
    """A kept state over tokens 0..n-1 (or `tokens`) whose last round ran at `round_at` keeping `kept` entries."""
    tokens = np.arange(n, dtype=np.int64) if tokens is None else np.asarray(tokens, dtype=np.int64)
    physical = kept + len(tokens) - round_at
    blocks = [SimpleNamespace(block_id=first_block + index) for index in range(-(-physical // BLOCK))]
    return KeptState(state_id=state_id, tokens=tokens, blocks=blocks, offset=round_at - kept, round_at=round_at, kept=kept,
                     prompt_length=prompt, prompt_protected=protected, budget=budget, owner=owner)


def slots_positions(s: KeptState, protected_positions: int) -> list[list[int]]:
    """What each slot may hold, by the state's definition: slots [0, P) positions 0..P-1 when the prompt is protected
    (every head), slots [P, kept) some positions in [P, round_at) (per head), slots [kept, physical) round_at..n-1."""
    slots = []
    for slot in range(s.physical):
        if slot < protected_positions:
            slots.append([slot])
        elif slot < s.kept:
            slots.append(list(range(protected_positions, s.round_at)))
        else:
            slots.append([s.round_at + slot - s.kept])
    return slots


@pytest.mark.parametrize("d", [260, 259, 230, 201, 200, 199, 150, 41, 40, 39, 5])
def test_a_cut_keeps_slots_whose_every_possible_position_is_below_d(d):
    """The continuation keeps the longest run of leading slots that hold positions below d in every (layer, KV
    head); after the last round that is the state the run held at d (offset unchanged, the kept entries move with
    it); before it, the protected prompt's slots alone (a fresh request: offset 0, its own prompt protected)."""
    s = state()
    found = cut(s, d)
    possible = slots_positions(s, s.prompt_length)
    safe = 0
    while safe < len(possible) and max(possible[safe]) < d:
        safe += 1
    if d >= s.round_at:
        # every slot below the cut is a token the run read before d, in order: the run's state at d
        assert found.physical == safe == s.kept + d - s.round_at
        assert found.reused == d and found.offset == s.offset and found.moves_positions
        assert found.prompt_length == s.prompt_length  # the conversation's first prompt stays protected
    else:
        assert found.physical == found.reused == safe == min(d, s.prompt_length)
        assert found.offset == 0 and not found.moves_positions and found.prompt_length is None
    assert found.full == (d == s.length)


def test_without_a_protected_prompt_a_cut_before_the_last_round_reuses_nothing():
    s = state(protected=False, prompt=300)
    assert cut(s, 150) is None  # d inside the compacted region: no slot is below d in every head for sure
    assert cut(s, 230).physical == 94  # after the round: the tail cut


def test_a_state_never_compacted_is_cut_anywhere():
    s = state(n=90, round_at=0, kept=0, prompt=90, protected=False)
    found = cut(s, 57)
    assert (found.physical, found.offset, found.moves_positions, found.reused) == (57, 0, False, 57)
    assert found.prompt_length is None  # the cut is inside the first prompt: the request protects its own
    assert cut(s, 0) is None


def test_common_prefix():
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([], dtype=np.int64), np.array([1])) == 0


def test_find_takes_the_longest_continuation_of_the_same_budget_and_owner():
    store = SessionStore(capacity=8)
    long = state("long", n=260)
    short = state("short", n=230, first_block=100)
    other_budget = state("b32", n=260, budget=32, first_block=200)
    other_owner = state("salted", n=260, owner=(0, "tenant"), first_block=300)
    for s in (short, long, other_budget, other_owner):
        assert store.keep(s)
    prompt = np.concatenate([np.arange(260), [9999, 9998]])
    found = store.find(prompt, 64, (0, None))
    assert found.state is long and found.full and found.physical == long.physical
    assert store.find(prompt, 32, (0, None)).state is other_budget
    assert store.find(prompt, 64, (0, "tenant")).state is other_owner
    assert store.find(prompt, 48, (0, None)) is None  # no state of that budget
    # the prompt's last token is always computed: a prompt equal to a kept sequence reuses all but its last token
    found = store.find(np.arange(260), 64, (0, None))
    assert found.reused == 259 and not found.full
    # a prompt that diverges at 215 (after short's and long's last round at 200): the longer agreement wins
    diverged = np.concatenate([np.arange(215), [7, 7, 7]])
    found = store.find(diverged, 64, (0, None))
    assert found.reused == 215 and found.physical == 64 + 15
    # too short to be indexed, or a different start: nothing
    assert store.find(np.arange(INDEX_TOKENS), 64, (0, None)) is None
    assert store.find(np.arange(1, 300), 64, (0, None)) is None


def test_the_store_drops_the_oldest_state_past_its_capacity_and_a_state_whose_block_is_reused():
    store = SessionStore(capacity=2)
    a, b, c = state("a"), state("b", first_block=100), state("c", first_block=200)
    store.keep(a)
    store.keep(b)
    store.keep(c)
    assert list(store.states) == ["b", "c"] and store.counters.drops["capacity"] == 1
    store.on_reuse(SimpleNamespace(block_id=205))  # vLLM's pool handed out one of c's blocks
    assert list(store.states) == ["b"] and store.counters.drops["reclaimed"] == 1
    store.on_reuse(SimpleNamespace(block_id=3))  # a's (dropped already): nothing
    assert list(store.states) == ["b"]
    store.release_blocks(b, b.blocks[2:])  # blocks past a cut: their reuse no longer concerns b
    store.on_reuse(b.blocks[3])
    assert list(store.states) == ["b"]
    store.claim_blocks(b, b.blocks[2:])
    store.on_reuse(b.blocks[3])
    assert not store.states and store.blocks == 0
    kept, dropped, adopted = store.take_changes()
    assert kept == ("a", "b", "c") and dropped == ("a", "c", "b") and adopted == {}
    assert store.take_changes() == ((), (), {})


def test_taking_a_state_counts_hits_and_tells_the_workers():
    store = SessionStore(capacity=4)
    a, b = state("a"), state("b", n=100, round_at=0, kept=0, first_block=100, tokens=np.arange(1000, 1100))
    store.keep(a)
    store.keep(b)
    store.take_changes()
    full = store.find(np.arange(300), 64, (0, None))
    store.take(full, "r1", computed=40)
    partial = store.find(np.concatenate([np.arange(1000, 1050), [5, 5]]), 64, (0, None))
    store.take(partial, "r2", computed=2)
    store.missed(computed=500)
    stats = store.stats()
    assert (stats["hits"], stats["partial_hits"], stats["misses"]) == (1, 1, 1)
    assert stats["reused_tokens"] == 260 + 50 and stats["computed_tokens"] == 542
    assert stats["recent_partial_hits"] == [{"reused": 50, "covered": 100}]
    assert stats["kept_now"] == 0
    kept, dropped, adopted = store.take_changes()
    # a's kept positions move to r1; b was never compacted: its cut holds positions 0..49 in order, nothing moves
    assert adopted == {"r1": "a"} and dropped == ("b",)


def test_a_state_too_short_to_be_found_is_not_kept():
    store = SessionStore(capacity=4)
    assert not store.keep(state("tiny", n=INDEX_TOKENS - 1, round_at=0, kept=0))
    with pytest.raises(ValueError, match="capacity"):
        SessionStore(capacity=0)
