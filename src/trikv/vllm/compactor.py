"""Compaction rounds over paged KV: the worker half of trikv inside vLLM, independent of vLLM's classes.

A request due for a round holds `length` physical entries per (layer, KV head) in its blocks: slots
[0, kept) are the entries its previous round kept (their RoPE positions remembered here), slots
[kept, length) the tokens computed since, at positions `position - length + slot`. A round scores every
entry of the due requests (in chunks of requests and layers whose transient memory stays under a cap), keeps
the top `budget` per (layer, KV head) under exactly the rule of trikv's transformers caches (same policy,
protection and top-B), and writes the kept keys and values, in original order, into slots [0, budget) of the
request's first blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..policies import Policy, ScoringContext
from ..selection import prompt_fits, protected_entries
from ..settings import DEFAULT_ROUND_WORKSPACE_BYTES
from .pages import PageCodec

log = logging.getLogger(__name__)


@dataclass
class CompactionOp:
    """One request's round, decided by the scheduler and carried to the workers on the scheduler output."""

    request_id: str
    position: int  # logical tokens computed = the round's current position t
    length: int  # physical entries before the round
    budget: int  # entries kept per (layer, KV head)
    prompt_length: int
    kept_blocks: int  # blocks the request holds after the round
    freed_blocks: int  # blocks returned to the pool by this round
    free_blocks: int  # the block pool's free blocks right after the request's tail was returned
    held_blocks: int  # blocks held by all running requests at that moment


@dataclass
class StepPlan:
    """What the scheduler tells the workers for one step: the rounds to run before the forward, and the
    offset (logical - physical length) of every request that has been compacted."""

    rounds: list[CompactionOp] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)
    running: int = 0  # requests running after this step was scheduled
    preemptions: int = 0  # preemptions since the engine started


@dataclass
class RoundRecord:
    """What one round kept, for tests and reports (kept_positions only when recording is on)."""

    request_id: str
    position: int
    length: int
    kept_blocks: int
    freed_blocks: int
    free_blocks: int
    held_blocks: int
    kept_positions: torch.Tensor | None = None  # [L, Hkv, budget] long


class Compactor:
    """Runs the rounds of one worker (one tensor-parallel rank: its own KV heads).

    A round's transient memory is capped by `round_workspace_bytes`: requests due in one step are grouped by
    their block count (so none is padded to a longer one's length), and each group is scored and moved in
    chunks of requests and layers planned with `chunk_bytes` (keys in the cache's dtype, their positions and
    masks, the storage indices, and what the policy's `score` allocates per entry). Every chunk keeps exactly
    what one pass over all of them would keep: the methods served score each (layer, request) on its own.
    The floor is one layer of one request: a request whose single layer needs more than the cap is still
    compacted, one layer at a time.
    """

    def __init__(self, policy: Policy, protect_prompt: bool, min_decode_room: int, record: bool = False,
                 round_workspace_bytes: int = DEFAULT_ROUND_WORKSPACE_BYTES):
        self.policy = policy
        self.protect_prompt = protect_prompt
        self.min_decode_room = min_decode_room
        self.round_workspace_bytes = round_workspace_bytes
        self.kept_positions: dict[str, torch.Tensor] = {}  # request -> [L, Hkv, kept] positions of slots [0, kept)
        self.record = record
        self.records: list[RoundRecord] = []
        self.rounds = 0
        self.seconds = 0.0
        self.chunks = 0  # (requests x layers) pieces scored, at least one per round
        self.max_running = 0
        self.preemptions = 0
        self.compacted_requests = 0  # first rounds run (a count; a request compacted again after a preemption counts again)
        self._warned_prompt = False
        self._layer_policies: dict[tuple[int, int], Policy] = {}

    def note_step(self, running: int, preemptions: int) -> None:
        self.max_running = max(self.max_running, running)
        self.preemptions = preemptions

    def forget(self, request_id: str) -> None:
        self.kept_positions.pop(request_id, None)

    def chunk_bytes(self, requests: int, layers: int, heads: int, slots: int, head_dim: int, element_size: int,
                    index_bytes: int) -> int:
        """Planned transient bytes of scoring and moving `requests` x `layers` with `slots` slots per (layer, KV
        head): per entry, the gathered key (cache dtype), position (int64), masks and score (~12 bytes), the
        kept order (int64) and the policy's own workspace (`round_bytes_per_entry`); per (request, head, slot),
        shared by the layers, `index_bytes` of key and value storage indices (`Located.index_bytes_per_slot`: one
        int64 per row of consecutive elements)."""
        per_entry = self._entry_bytes(slots, head_dim, element_size)
        return requests * heads * slots * (layers * per_entry + index_bytes)

    def _entry_bytes(self, slots: int, head_dim: int, element_size: int) -> int:
        group = getattr(getattr(self.policy, "scorer", None), "group", 1)
        return head_dim * element_size + 8 + 12 + 8 + self.policy.round_bytes_per_entry(head_dim, group, slots)

    def _plan(self, requests: int, layers: int, heads: int, slots: int, head_dim: int, element_size: int,
              index_bytes: int) -> tuple[int, int]:
        """(requests, layers) per chunk: all layers of as many requests as fit the cap, else one request a few
        layers at a time (all layers when the policy shares its selection across layers)."""
        cap = self.round_workspace_bytes
        whole = self.chunk_bytes(1, layers, heads, slots, head_dim, element_size, index_bytes)
        if whole <= cap or not self.policy.scores_layers_independently:
            return max(1, min(requests, cap // whole)), layers
        room = cap // (heads * slots) - index_bytes
        return 1, max(1, min(layers, room // self._entry_bytes(slots, head_dim, element_size)))

    def _policy_for(self, layers: slice, total: int) -> Policy:
        if (layers.start, layers.stop) == (0, total):
            return self.policy
        key = (layers.start, layers.stop)
        if key not in self._layer_policies:
            self._layer_policies[key] = self.policy.for_layers(layers)
        return self._layer_policies[key]

    @torch.no_grad()
    def run(
        self,
        rounds: list[CompactionOp],
        kv_caches: list[torch.Tensor],
        codecs: list[PageCodec],
        block_ids: dict[str, list[int]],
    ) -> None:
        """Compact every request of `rounds` in place; `block_ids` are each request's blocks before the round."""
        if not rounds:
            return
        started = time.perf_counter()
        block_size = codecs[0].block_size
        if self.protect_prompt and not self._warned_prompt:
            prompt = torch.tensor([op.prompt_length for op in rounds])
            budgets = torch.tensor([op.budget for op in rounds])
            if not bool(prompt_fits(prompt, budgets, self.min_decode_room).all()):
                log.warning("a prompt leaves fewer than %d of its budget slots for generated tokens: it competes for "
                            "the budget too", self.min_decode_room)
                self._warned_prompt = True
        # requests with their own budgets keep different counts: one group per (blocks, budget)
        by_blocks: dict[tuple[int, int], list[CompactionOp]] = {}
        for op in rounds:
            by_blocks.setdefault((-(-op.length // block_size), op.budget), []).append(op)
        for (blocks, _), group in by_blocks.items():
            probe = codecs[0].locate(torch.zeros(1, 1, dtype=torch.long), kv_caches[0])
            per_request, per_layers = self._plan(len(group), len(kv_caches), codecs[0].num_heads, blocks * block_size,
                                                 codecs[0].head_dim, kv_caches[0].element_size(),
                                                 probe.index_bytes_per_slot)
            for first in range(0, len(group), per_request):
                self._compact(group[first : first + per_request], blocks, per_layers, kv_caches, codecs, block_ids)
        self.rounds += len(rounds)
        self.seconds += time.perf_counter() - started

    def _compact(self, rounds: list[CompactionOp], blocks: int, per_layers: int, kv_caches: list[torch.Tensor],
                 codecs: list[PageCodec], block_ids: dict[str, list[int]]) -> None:
        """One chunk of requests with `blocks` blocks each, `per_layers` layers at a time."""
        budget = rounds[0].budget
        block_size = codecs[0].block_size
        device = kv_caches[0].device
        L, H = len(kv_caches), codecs[0].num_heads
        table = torch.tensor([block_ids[op.request_id][:blocks] for op in rounds], dtype=torch.long, device=device)
        N = blocks * block_size
        located: dict[int, object] = {}  # one index per page layout, shared by the layers that have it

        def where(codec: PageCodec, cache: torch.Tensor):
            if id(codec) not in located:
                located[id(codec)] = codec.locate(table, cache)
            return located[id(codec)]

        t = torch.tensor([op.position for op in rounds], device=device)
        prompt = torch.tensor([op.prompt_length for op in rounds], device=device)
        window = self.policy.recent_window
        kept_positions = torch.empty(L, len(rounds), H, budget, dtype=torch.long, device=device)
        for first in range(0, L, per_layers):
            layers = slice(first, min(L, first + per_layers))
            positions = self._positions(rounds, layers, H, N, device)  # [l, R, Hkv, N]
            dead = positions < 0
            protected = protected_entries(positions, t, prompt, budget, window, self.min_decode_room,
                                          self.protect_prompt) & ~dead
            keys = torch.stack([codec.gather(cache, table, where(codec, cache), keys_only=True)
                                for codec, cache in zip(codecs[layers], kv_caches[layers])])  # [l, R, Hkv, N, D]
            context = ScoringContext(
                keys=keys,
                values=None,  # the methods served inside vLLM score keys only
                positions=positions,
                candidates=~(dead | protected),
                current_position=t,
                budget=budget,
                protected=protected,
            )
            scores = self._policy_for(layers, L).score(context).float()  # [l, R, Hkv, N]
            self.chunks += 1
            del keys, context
            scores = scores.masked_fill(protected, float("inf")).masked_fill(dead, float("-inf"))
            order = scores.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values  # [l, R, Hkv, budget]
            del scores, dead, protected
            kept_positions[layers] = positions.gather(3, order)
            del positions
            for index, (codec, cache) in enumerate(zip(codecs[layers], kv_caches[layers])):
                codec.move(cache, table, order[index], where(codec, cache))  # kept entries into slots [0, budget)
        for row, op in enumerate(rounds):
            if op.request_id not in self.kept_positions:
                self.compacted_requests += 1
            self.kept_positions[op.request_id] = kept_positions[:, row].clone()
            if self.record:
                self.records.append(RoundRecord(op.request_id, op.position, op.length, op.kept_blocks, op.freed_blocks,
                                                op.free_blocks, op.held_blocks, kept_positions[:, row].cpu().clone()))

    def _positions(self, rounds: list[CompactionOp], layers: slice, H: int, N: int, device) -> torch.Tensor:
        """[l, R, Hkv, N] RoPE position of every gathered slot of `layers` (-1 past a request's length)."""
        L = layers.stop - layers.start
        positions = torch.full((L, len(rounds), H, N), -1, dtype=torch.long, device=device)
        slots = torch.arange(N, device=device)
        for row, op in enumerate(rounds):
            offset = op.position - op.length  # logical - physical before the round
            previous = self.kept_positions.get(op.request_id)
            previous = None if previous is None else previous[layers]
            kept = 0 if previous is None else previous.shape[-1]
            if kept > op.length:
                raise RuntimeError(f"request {op.request_id}: {kept} kept entries but only {op.length} stored")
            positions[:, row, :, kept : op.length] = (slots[kept : op.length] + offset)[None, None]
            if previous is not None:
                positions[:, row, :, :kept] = previous
        return positions
