"""Kept conversation states: a finished request's bounded KV cache, kept so that the next turn continues from it.

An agent or a chat client re-sends its whole conversation with every message. Without this, vLLM prefills it
again each time (in chunks, compacted between them), and prefix caching cannot help once a request was compacted
(its blocks hold kept entries, never hashed). With session reuse, when a bounded request finishes its compacted
KV is kept, keyed by the exact token ids it covers (prompt and output, up to the last token computed); a new
request whose prompt agrees with a kept state over its first `d` tokens starts from that state and prefills only
the rest, under the usual chunk-and-round rule. No client change is needed.

What a kept state is. A state covers tokens T[0, n). Its slots [0, kept) hold the entries its last round kept
(a round at logical length r, keeping `kept` entries per (layer, KV head), whose RoPE positions the worker keeps),
and slots [kept, physical) hold the tokens r .. n-1 in order (offset = n - physical = r - kept). A state that was
never compacted has r = kept = offset = 0.

The cut at d (the new prompt's first d tokens are T[0, d), with d < the new prompt's length, so that at least one
token is computed for the first logits):
- d >= r: the state cut to kept + (d - r) slots, with the same kept entries and offset. This is exactly the state
  the bounded run held once it had read T[0, d): its last round (at r <= d) came before those tokens and none ran
  after it, so the request continues from a state the same run passed through. A full hit (d = n) is the case
  where the new prompt extends the whole kept sequence.
- d < r: the kept entries were chosen at r, from tokens the new prompt does not have, and a paged cache cannot cut
  each (layer, KV head) at its own length. What stays valid is the first prompt when every round protected it
  (prompt + min_decode_room <= budget): a round keeps protected entries and keeps entries in position order, so
  slots [0, P) of every (layer, KV head) hold positions 0 .. P-1, the KV an uncompacted prefill of those tokens
  computes. The state is cut to min(d, P) slots and the request runs as a fresh request with that prefix hit
  (its own prompt protected, no kept positions). Without a protected prompt there is nothing to reuse: a miss.

The protected prompt of a continued request is its conversation's first prompt (the prompt of the request that
started the chain of states), as `trikv.Session` protects the first turn's prompt on the transformers path; a cut
inside that prompt starts the conversation anew with the request's own prompt.

Lookup: states are indexed by their budget, their owner (LoRA adapter and cache salt: a state is never read by a
request another adapter or tenant sends) and their first `INDEX_TOKENS` token ids; a prompt shorter than that, or
a state covering fewer tokens, is never matched. Among the candidates the longest reuse wins (the most recent on
a tie).

Memory: a kept state's blocks go back to vLLM's block pool as reclaimable (`BlockPool.unpin_blocks`): they count
as free, so kept states never hold up admission or cause a preemption, and the pool hands them out, last, when it
runs out of other free blocks; the moment one of a state's blocks is handed out the whole state is dropped
(`on_reuse`). At most `capacity` states are kept (least recently kept or used dropped first), which bounds the
device memory the workers hold for their kept positions.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

INDEX_TOKENS = 16  # a state is found by its first 16 token ids (and its budget and owner)
RECENT_PARTIAL_HITS = 64  # the last partial hits' (reused, covered) token counts kept for the stats


@dataclass
class KeptState:
    """One finished request's KV, kept for the next turn of its conversation (see the module's docstring)."""

    state_id: str  # the request that produced it: the workers keep its kept positions under this id
    tokens: np.ndarray  # [n] int64: the token ids its KV covers
    blocks: list  # vLLM's KV blocks of the full-attention group, covering slots [0, physical)
    offset: int  # logical - physical entries
    round_at: int  # logical length at its last round (0: never compacted)
    kept: int  # slots holding its last round's kept entries (0: never compacted)
    prompt_length: int  # the protected prompt of its conversation
    prompt_protected: bool  # whether its rounds protected that prompt
    budget: int
    owner: tuple  # (LoRA adapter id, cache salt)
    due: bool = False  # it reached budget + divide_length: compacted before it can be continued

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def physical(self) -> int:
        return self.length - self.offset

    @property
    def compacted(self) -> bool:
        return self.kept > 0


@dataclass(frozen=True)
class Continuation:
    """How a new request starts from a kept state."""

    state: KeptState
    reused: int  # d: logical tokens of the new prompt the request does not compute
    physical: int  # slots of the state the request keeps
    offset: int  # the request's logical - physical entries
    prompt_length: int | None  # the protected prompt it inherits (None: its own)
    moves_positions: bool  # the workers' kept positions of the state become the request's

    @property
    def full(self) -> bool:
        return self.reused == self.state.length


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading token ids `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def cut(state: KeptState, agreed: int) -> Continuation | None:
    """The continuation of a prompt that agrees with `state` over its first `agreed` tokens (already capped below the
    prompt's length), or None where nothing of the state can be reused (the module's docstring gives the rule)."""
    d = min(agreed, state.length)
    if d >= state.round_at:
        physical = state.kept + d - state.round_at
        if physical <= 0:
            return None
        inherits = state.prompt_length if d >= state.prompt_length else None
        return Continuation(state, d, physical, state.offset, inherits, state.compacted)
    if not state.prompt_protected:
        return None
    physical = min(d, state.prompt_length)
    if physical <= 0:
        return None
    return Continuation(state, physical, physical, 0, None, False)


@dataclass
class SessionCounters:
    """What `GET /trikv/stats` reports under "sessions"."""

    kept: int = 0  # states kept so far (finished requests whose KV was kept)
    hits: int = 0  # requests that continued a whole kept state (the new prompt extends all it covers)
    partial_hits: int = 0  # requests that continued part of a state (the prompt diverges from it at d)
    misses: int = 0  # requests that could take a state and found none
    reused_tokens: int = 0  # prompt tokens not computed thanks to hits
    computed_tokens: int = 0  # prompt tokens computed by requests that looked for a state
    drops: dict = field(default_factory=lambda: {"reclaimed": 0, "capacity": 0, "reset": 0})
    recent_partial_hits: deque = field(default_factory=lambda: deque(maxlen=RECENT_PARTIAL_HITS))  # (d, n)


class SessionStore:
    """The kept states of one engine, least recently kept or used first (the scheduler's; vLLM-agnostic: blocks
    are opaque objects with a `block_id`)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.states: OrderedDict[str, KeptState] = OrderedDict()
        self._index: dict[tuple, list[str]] = {}
        self._block_owner: dict[int, str] = {}
        self.counters = SessionCounters()
        # since the workers last heard: states kept, dropped, and taken by a request (request id -> state id)
        self.kept_since: list[str] = []
        self.dropped_since: list[str] = []
        self.adopted_since: dict[str, str] = {}

    @staticmethod
    def _key(budget: int, owner: tuple, tokens: np.ndarray) -> tuple:
        return (budget, owner, tokens[:INDEX_TOKENS].tobytes())

    @property
    def blocks(self) -> int:
        return sum(len(state.blocks) for state in self.states.values())

    def keep(self, state: KeptState) -> bool:
        """Keep `state` (dropping the least recently used one past `capacity`); False for a state too short to be
        found again (its blocks are then the caller's to free)."""
        if state.length < INDEX_TOKENS or not state.blocks:
            return False
        while len(self.states) >= self.capacity:
            self.drop(next(iter(self.states)), "capacity")
        self.states[state.state_id] = state
        self._index.setdefault(self._key(state.budget, state.owner, state.tokens), []).append(state.state_id)
        for block in state.blocks:
            self._block_owner[block.block_id] = state.state_id
        self.kept_since.append(state.state_id)
        self.counters.kept += 1
        return True

    def find(self, prompt: np.ndarray, budget: int, owner: tuple) -> Continuation | None:
        """The longest continuation of `prompt` (a new request's token ids) from a kept state of the same budget and
        owner; None if there is none. The prompt's last token is always computed (its logits are the first output)."""
        if len(prompt) <= INDEX_TOKENS:
            return None
        best = None
        limit = prompt[: len(prompt) - 1]
        for state_id in reversed(self._index.get(self._key(budget, owner, prompt), ())):
            found = cut(self.states[state_id], common_prefix(self.states[state_id].tokens, limit))
            if found is not None and (best is None or found.reused > best.reused):
                best = found
        return best

    def take(self, continuation: Continuation, request_id: str, computed: int) -> None:
        """A request starts from `continuation`: its state leaves the store (its blocks are the request's now);
        `computed` is the prompt tokens the request computes."""
        state = continuation.state
        self._forget(state)
        if continuation.moves_positions:
            self.adopted_since[request_id] = state.state_id
        else:
            self.dropped_since.append(state.state_id)
        counters = self.counters
        if continuation.full:
            counters.hits += 1
        else:
            counters.partial_hits += 1
            counters.recent_partial_hits.append((continuation.reused, state.length))
        counters.reused_tokens += continuation.reused
        counters.computed_tokens += computed

    def missed(self, computed: int) -> None:
        self.counters.misses += 1
        self.counters.computed_tokens += computed

    def drop(self, state_id: str, reason: str) -> KeptState | None:
        """Forget a state (its blocks stay where they are: reclaimable in vLLM's pool)."""
        state = self.states.get(state_id)
        if state is None:
            return None
        self._forget(state)
        self.dropped_since.append(state_id)
        self.counters.drops[reason] += 1
        return state

    def on_reuse(self, block) -> None:
        """vLLM's pool handed out `block` (or reset its cache): the state that read it is gone."""
        state_id = self._block_owner.get(block.block_id)
        if state_id is not None:
            self.drop(state_id, "reclaimed")

    def release_blocks(self, state: KeptState, blocks: list) -> None:
        """`blocks` no longer belong to `state`: vLLM handing them out does not drop it."""
        for block in blocks:
            if self._block_owner.get(block.block_id) == state.state_id:
                del self._block_owner[block.block_id]

    def claim_blocks(self, state: KeptState, blocks: list) -> None:
        """`blocks` belong to `state` again (undoes `release_blocks`)."""
        for block in blocks:
            self._block_owner[block.block_id] = state.state_id

    def owns(self, block) -> bool:
        return block.block_id in self._block_owner

    def _forget(self, state: KeptState) -> None:
        del self.states[state.state_id]
        key = self._key(state.budget, state.owner, state.tokens)
        ids = self._index[key]
        ids.remove(state.state_id)
        if not ids:
            del self._index[key]
        self.release_blocks(state, state.blocks)

    def take_changes(self) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]:
        """(kept, dropped, adopted) since the last call, for the workers."""
        changes = tuple(self.kept_since), tuple(self.dropped_since), dict(self.adopted_since)
        self.kept_since.clear()
        self.dropped_since.clear()
        self.adopted_since.clear()
        return changes

    def stats(self) -> dict:
        counters = self.counters
        return {"kept_now": len(self.states), "kept_blocks": self.blocks, "capacity": self.capacity,
                "kept": counters.kept, "hits": counters.hits, "partial_hits": counters.partial_hits,
                "misses": counters.misses, "reused_tokens": counters.reused_tokens,
                "computed_tokens": counters.computed_tokens, "drops": dict(counters.drops),
                "recent_partial_hits": [{"reused": d, "covered": n} for d, n in counters.recent_partial_hits]}
