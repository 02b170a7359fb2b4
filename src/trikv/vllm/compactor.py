"""Compaction rounds over paged KV: the worker half of trikv inside vLLM, independent of vLLM's classes.

A request due for a round holds `length` physical entries per (layer, KV head) in its blocks: slots
[0, kept) are the entries its previous round kept (their RoPE positions remembered here), slots
[kept, length) the tokens computed since, at positions `position - length + slot`. A round scores every
entry of all due requests at once (one batch, all layers), keeps the top `budget` per (layer, KV head)
under exactly the rule of trikv's transformers caches (same policy, protection and top-B), and writes the
kept keys and values, in original order, into slots [0, budget) of the request's first blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..policies import Policy, ScoringContext
from ..selection import prompt_fits, protected_entries
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
    """Runs the rounds of one worker (one tensor-parallel rank: its own KV heads)."""

    def __init__(self, policy: Policy, protect_prompt: bool, min_decode_room: int, record: bool = False):
        self.policy = policy
        self.protect_prompt = protect_prompt
        self.min_decode_room = min_decode_room
        self.kept_positions: dict[str, torch.Tensor] = {}  # request -> [L, Hkv, kept] positions of slots [0, kept)
        self.record = record
        self.records: list[RoundRecord] = []
        self.rounds = 0
        self.seconds = 0.0
        self.max_running = 0
        self.preemptions = 0
        self.compacted_requests = 0  # first rounds run (a count; a request compacted again after a preemption counts again)
        self._warned_prompt = False

    def note_step(self, running: int, preemptions: int) -> None:
        self.max_running = max(self.max_running, running)
        self.preemptions = preemptions

    def forget(self, request_id: str) -> None:
        self.kept_positions.pop(request_id, None)

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
        budget = rounds[0].budget
        block_size = codecs[0].block_size
        device = kv_caches[0].device
        R = len(rounds)
        blocks_needed = max(-(-op.length // block_size) for op in rounds)
        table = torch.zeros(R, blocks_needed, dtype=torch.long)  # padding rows read block 0 (masked as dead)
        for row, op in enumerate(rounds):
            ids = block_ids[op.request_id][: -(-op.length // block_size)]
            table[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        table = table.to(device)
        N = blocks_needed * block_size

        located: dict[int, tuple] = {}  # one element index per page layout, shared by the layers that have it

        def where(codec: PageCodec, cache: torch.Tensor) -> tuple:
            if id(codec) not in located:
                located[id(codec)] = codec.locate(table, cache)
            return located[id(codec)]

        keys = torch.stack([codec.gather(cache, table, where(codec, cache), keys_only=True)
                            for codec, cache in zip(codecs, kv_caches)])  # [L, R, Hkv, N, D]
        L, _, H = keys.shape[:3]
        positions = self._positions(rounds, L, H, N, device)  # [L, R, Hkv, N]
        dead = positions < 0
        t = torch.tensor([op.position for op in rounds], device=device)
        prompt = torch.tensor([op.prompt_length for op in rounds], device=device)
        window = self.policy.recent_window
        if self.protect_prompt and not self._warned_prompt and not bool(prompt_fits(prompt, budget, self.min_decode_room).all()):
            log.warning("a prompt leaves fewer than %d of the %d budget slots for generated tokens: it competes for the budget too",
                        self.min_decode_room, budget)
            self._warned_prompt = True
        protected = protected_entries(positions, t, prompt, budget, window, self.min_decode_room, self.protect_prompt) & ~dead
        context = ScoringContext(
            keys=keys,
            values=None,  # the methods served inside vLLM score keys only
            positions=positions,
            candidates=~(dead | protected),
            current_position=t,
            budget=budget,
            protected=protected,
        )
        scores = self.policy.score(context).float()  # [L, R, Hkv, N]
        scores = scores.masked_fill(protected, float("inf")).masked_fill(dead, float("-inf"))
        order = scores.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values  # [L, R, Hkv, budget]
        kept_positions = positions.gather(3, order)
        for layer, (codec, cache) in enumerate(zip(codecs, kv_caches)):
            codec.move(cache, table, order[layer], where(codec, cache))  # kept entries into slots [0, budget)
        for row, op in enumerate(rounds):
            if op.request_id not in self.kept_positions:
                self.compacted_requests += 1
            self.kept_positions[op.request_id] = kept_positions[:, row].clone()
            if self.record:
                self.records.append(RoundRecord(op.request_id, op.position, op.length, op.kept_blocks, op.freed_blocks,
                                                op.free_blocks, op.held_blocks, kept_positions[:, row].cpu().clone()))
        self.rounds += R
        self.seconds += time.perf_counter() - started

    def _positions(self, rounds: list[CompactionOp], L: int, H: int, N: int, device) -> torch.Tensor:
        """[L, R, Hkv, N] RoPE position of every gathered slot (-1 past a request's length)."""
        positions = torch.full((L, len(rounds), H, N), -1, dtype=torch.long, device=device)
        slots = torch.arange(N, device=device)
        for row, op in enumerate(rounds):
            offset = op.position - op.length  # logical - physical before the round
            previous = self.kept_positions.get(op.request_id)
            kept = 0 if previous is None else previous.shape[-1]
            if kept > op.length:
                raise RuntimeError(f"request {op.request_id}: {kept} kept entries but only {op.length} stored")
            positions[:, row, :, kept : op.length] = (slots[kept : op.length] + offset)[None, None]
            if previous is not None:
                positions[:, row, :, :kept] = previous
        return positions
