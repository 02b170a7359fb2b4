"""Compaction rounds over paged KV: the worker half of trikv inside vLLM, independent of vLLM's classes.

A request due for a round holds `length` physical entries per (layer, KV head) in its blocks: slots
[0, kept) are the entries its previous round kept (their RoPE positions remembered here), slots
[kept, length) the tokens computed since, at positions `position - length + slot`. A round scores every
entry of the due requests (in chunks of requests, layers and KV heads whose transient memory stays under a
cap), keeps the top `budget` per (layer, KV head) under exactly the rule of trikv's transformers caches (same
policy, protection and top-B), and writes the kept keys and values, in original order, into slots
[0, budget) of the request's first blocks.

A round never waits for the device: what it needs from the host (positions, prompt lengths, block ids of the
due requests) goes up in one copy that does not block, and nothing is read back (the kept positions stay on the
device, int32), so the host queues a round's chunks and the step's forward behind them without a stall.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..policies import Policy, ScoringContext
from ..selection import protected_entries
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
    # copy-on-write (prefix caching): (original, copy) block ids of the request's first blocks that another request
    # may read; the worker copies each original into its copy, which replaces it in the request's blocks, before the
    # round, so the round never writes into a cached or shared block
    copies: tuple[tuple[int, int], ...] = ()
    # a kept state's round (no running request: `request_id` names the state): the blocks it reads, in order
    block_ids: tuple[int, ...] | None = None


@dataclass
class SessionChanges:
    """Kept states the workers hear of with a step: kept since the last step (their kept positions stay when the
    request finishes), dropped (forgotten), and taken by a new request (request id -> state id: the state's kept
    positions become the request's)."""

    kept: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    adopted: dict[str, str] = field(default_factory=dict)


@dataclass
class StepPlan:
    """What the scheduler tells the workers for one step: the rounds to run before the forward, and the
    offset (logical - physical length) of every request that has been compacted."""

    rounds: list[CompactionOp] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)
    running: int = 0  # requests running after this step was scheduled
    preemptions: int = 0  # preemptions since the engine started
    request_blocks: int = 0  # the most full-attention blocks one bounded request holds for this step's forward
    sessions: SessionChanges | None = None  # session reuse's changes since the last step


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


_POSITION = 4  # bytes of a kept position in the per-request state (int32: positions stay below 2**31)
_HEADER = 4  # host columns uploaded per due request before its block ids: t, prompt length, length, offset


def request_state_bytes(layers: int, heads: int, budget: int) -> int:
    """Device bytes a compacted request keeps between rounds: the RoPE position of each kept entry."""
    return layers * heads * budget * _POSITION


@dataclass(frozen=True)
class ChunkPlan:
    """How a group of requests with the same block count is cut: `requests` x `layers` x `heads` per chunk."""

    requests: int
    layers: int
    heads: int
    bytes: int  # planned transient bytes of one such chunk


class Compactor:
    """Runs the rounds of one worker (one tensor-parallel rank: its own KV heads).

    A round's transient memory is capped by `round_workspace_bytes`: requests due in one step are grouped by
    their block count (so none is padded to a longer one's length), and each group is scored and moved in
    chunks planned with `chunk_bytes` (keys in the cache's dtype, their positions and masks, the storage
    indices, and what the policy's `score` allocates per entry): all layers of as many requests as fit, else
    one request a few layers at a time, else one layer a few KV heads at a time (for policies that score
    layers, or heads, on their own). Every chunk keeps exactly what one pass over all of them would keep. The
    floor is one (layer, KV head) of one request (`floor_bytes`): the worker refuses at start-up a cap below
    the floor of a request at trikv's bound (no round sees more entries), so no round exceeds it.
    """

    def __init__(self, policy: Policy, protect_prompt: bool, min_decode_room: int, record: bool = False,
                 round_workspace_bytes: int = DEFAULT_ROUND_WORKSPACE_BYTES):
        self.policy = policy
        self.protect_prompt = protect_prompt
        self.min_decode_room = min_decode_room
        self.round_workspace_bytes = round_workspace_bytes
        # request (or kept state) -> [L, Hkv, kept] int32 positions of slots [0, kept), on the cache's device
        self.kept_positions: dict[str, torch.Tensor] = {}
        self.kept_states: set[str] = set()  # finished requests whose state is kept: their positions stay
        self.record = record
        self.records: list[RoundRecord] = []
        self.rounds = 0
        self.seconds = 0.0
        self.chunks = 0  # (requests x layers x heads) pieces scored, at least one per round
        self.max_running = 0
        self.max_request_blocks = 0  # the most full-attention blocks one bounded request held in any step
        self.preemptions = 0
        self.compacted_requests = 0  # first rounds run (a count; a request compacted again after a preemption counts again)
        self._warned_prompt = False
        self._part_policies: dict[tuple[int, int, int, int], Policy] = {}

    def note_step(self, running: int, preemptions: int, request_blocks: int = 0) -> None:
        self.max_running = max(self.max_running, running)
        self.max_request_blocks = max(self.max_request_blocks, request_blocks)
        self.preemptions = preemptions

    def forget(self, request_id: str) -> None:
        """A request ended or was preempted: its kept positions go, unless its state is kept."""
        if request_id not in self.kept_states:
            self.kept_positions.pop(request_id, None)

    def apply_sessions(self, changes: SessionChanges, before_rounds: bool) -> None:
        """Session reuse's changes: the kept states before the step's rounds (a kept state's round runs among
        them), the dropped and adopted ones after."""
        if before_rounds:
            self.kept_states.update(changes.kept)
            return
        for state_id in changes.dropped:
            self.kept_states.discard(state_id)
            self.kept_positions.pop(state_id, None)
        for request_id, state_id in changes.adopted.items():
            self.kept_states.discard(state_id)
            positions = self.kept_positions.pop(state_id, None)
            if positions is None:
                raise RuntimeError(f"request {request_id} continues kept state {state_id}, whose kept positions this "
                                   "worker does not hold")
            self.kept_positions[request_id] = positions

    # ---- the memory plan ------------------------------------------------------------------------------
    def chunk_bytes(self, requests: int, layers: int, heads: int, slots: int, head_dim: int, element_size: int,
                    index_bytes: int) -> int:
        """Planned transient bytes of scoring and moving `requests` x `layers` x `heads` with `slots` slots per
        (layer, KV head): per entry, the gathered key (`element_size` bytes per dimension: the cache's element, and
        for an fp8 cache its float32 decoding too, `PageCodec.key_bytes`), position (int64), masks and score (~12
        bytes), the kept order (int64) and the policy's own workspace (`round_bytes_per_entry`); per (request,
        head, slot), shared by the layers, `index_bytes` of key and value storage indices
        (`RowPlan.index_bytes_per_slot`: one int64 per row of consecutive elements)."""
        per_entry = self._entry_bytes(slots, head_dim, element_size)
        return requests * heads * slots * (layers * per_entry + index_bytes)

    def _entry_bytes(self, slots: int, head_dim: int, element_size: int) -> int:
        group = getattr(getattr(self.policy, "scorer", None), "group", 1)
        return head_dim * element_size + 8 + 12 + 8 + self.policy.round_bytes_per_entry(head_dim, group, slots)

    def plan(self, requests: int, layers: int, heads: int, slots: int, head_dim: int, element_size: int,
             index_bytes: int, cap: int | None = None) -> ChunkPlan:
        """The chunk of a group of `requests` with `slots` slots each: all layers and heads of as many requests as
        fit `cap` (default `round_workspace_bytes`), else one request with as many layers as fit, else one layer
        (all of them for policies that share a selection across layers) with as many KV heads as fit; never less
        than the floor (one (layer, KV head), or what the policy cannot split)."""
        cap = self.round_workspace_bytes if cap is None else cap

        def size(r: int, l: int, h: int) -> int:
            return self.chunk_bytes(r, l, h, slots, head_dim, element_size, index_bytes)

        whole = size(1, layers, heads)
        if whole <= cap:
            count = max(1, min(requests, cap // whole))
            return ChunkPlan(count, layers, heads, size(count, layers, heads))
        per_layers = layers
        if self.policy.scores_layers_independently:
            room = cap // (heads * slots) - index_bytes
            per_layers = max(1, min(layers, room // self._entry_bytes(slots, head_dim, element_size)))
            if size(1, per_layers, heads) <= cap:
                return ChunkPlan(1, per_layers, heads, size(1, per_layers, heads))
        per_heads = heads
        if self.policy.scores_heads_independently:
            per_heads = max(1, min(heads, cap // size(1, per_layers, 1)))
        return ChunkPlan(1, per_layers, per_heads, size(1, per_layers, per_heads))

    def floor_bytes(self, layers: int, heads: int, slots: int, head_dim: int, element_size: int, index_bytes: int) -> int:
        """Transient bytes of the smallest chunk a request of `slots` slots can be scored in: one (layer, KV head)
        when the policy scores layers and heads on their own, else what it cannot split."""
        return self.plan(1, layers, heads, slots, head_dim, element_size, index_bytes, cap=0).bytes

    def _policy_for(self, layers: slice, heads: slice, total_layers: int, total_heads: int) -> Policy:
        key = (layers.start, layers.stop, heads.start, heads.stop)
        if key == (0, total_layers, 0, total_heads):
            return self.policy
        if key not in self._part_policies:
            part = self.policy if (layers.start, layers.stop) == (0, total_layers) else self.policy.for_layers(layers)
            self._part_policies[key] = part if (heads.start, heads.stop) == (0, total_heads) else part.for_heads(heads)
        return self._part_policies[key]

    # ---- a round ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(
        self,
        rounds: list[CompactionOp],
        kv_caches: list[torch.Tensor],
        codecs: list[PageCodec],
        block_ids: dict[str, list[int]],
        key_scales: list[torch.Tensor | None] | None = None,
    ) -> None:
        """Compact every request of `rounds` in place; `block_ids` are each request's blocks before the round, as the
        layer views address them (the pages `codecs` learnt); `key_scales`: for an fp8 cache, each layer's key scale
        (a device tensor), by which its keys are read."""
        if not rounds:
            return
        started = time.perf_counter()
        block_size = codecs[0].block_size
        device = kv_caches[0].device
        L, H = len(kv_caches), codecs[0].num_heads
        if self.protect_prompt and not self._warned_prompt and any(
                op.prompt_length + self.min_decode_room > op.budget for op in rounds):
            log.warning("a prompt leaves fewer than %d of its budget slots for generated tokens: it competes for "
                        "the budget too", self.min_decode_room)
            self._warned_prompt = True
        for op in rounds:
            previous = self.kept_positions.get(op.request_id)
            if previous is not None and previous.shape[-1] > op.length:
                raise RuntimeError(f"request {op.request_id}: {previous.shape[-1]} kept entries but only {op.length} stored")
        # requests with their own budgets keep different counts: one group per (blocks, budget); in a group, the
        # requests compacted before come first (their kept positions fill a leading run of rows)
        groups: dict[tuple[int, int], list[CompactionOp]] = {}
        for op in rounds:
            groups.setdefault((-(-op.length // block_size), op.budget), []).append(op)
        ordered: list[CompactionOp] = []
        spans = []
        for (blocks, budget), group in groups.items():
            group.sort(key=lambda op: op.request_id not in self.kept_positions)
            spans.append((blocks, budget, len(ordered), group))
            ordered += group
        widest = max(blocks for blocks, _, _, _ in spans)
        rows = [[op.position, op.prompt_length, op.length, op.position - op.length,
                 *block_ids[op.request_id][:widest], *[0] * (widest - min(widest, len(block_ids[op.request_id])))]
                for op in ordered]
        host = torch.tensor(rows, dtype=torch.long)  # [R, 4 + widest]
        header = upload(host, device)  # the round's one host-to-device copy
        cap = self.round_workspace_bytes - host.numel() * host.element_size()
        index_bytes = codecs[0].plan(kv_caches[0]).index_bytes_per_slot
        scales = list(key_scales) if key_scales is not None else [None] * L
        for blocks, budget, first, group in spans:
            chunk = self.plan(len(group), L, H, blocks * block_size, codecs[0].head_dim, codecs[0].key_bytes(kv_caches[0]),
                              index_bytes, cap)
            kept = [self.kept_positions.get(op.request_id) for op in group]
            kept = [k if k is not None else torch.empty(L, H, budget, dtype=torch.int32, device=device) for k in kept]
            for start in range(0, len(group), chunk.requests):
                stop = min(len(group), start + chunk.requests)
                for layer in range(0, L, chunk.layers):
                    for head in range(0, H, chunk.heads):
                        self._compact(group[start:stop], header[first + start : first + stop], blocks, budget,
                                      slice(layer, min(L, layer + chunk.layers)), slice(head, min(H, head + chunk.heads)),
                                      kv_caches, codecs, kept[start:stop], scales)
            for op, positions in zip(group, kept):
                if op.request_id not in self.kept_positions:
                    self.compacted_requests += 1
                self.kept_positions[op.request_id] = positions
                if self.record:
                    self.records.append(RoundRecord(op.request_id, op.position, op.length, op.kept_blocks, op.freed_blocks,
                                                    op.free_blocks, op.held_blocks, positions.long().cpu()))
        self.rounds += len(rounds)
        self.seconds += time.perf_counter() - started

    def _compact(self, rounds: list[CompactionOp], header: torch.Tensor, blocks: int, budget: int, layers: slice,
                 heads: slice, kv_caches: list[torch.Tensor], codecs: list[PageCodec], kept: list[torch.Tensor],
                 scales: list[torch.Tensor | None]) -> None:
        """One chunk: requests `rounds` (their uploaded `header` rows [r, 4 + widest]) with `blocks` blocks each,
        layers `layers`, KV heads `heads`; their kept positions go to `kept` ([L, Hkv, budget] int32 each); `scales`:
        each layer's key scale for an fp8 cache."""
        block_size = codecs[0].block_size
        device = kv_caches[0].device
        N = blocks * block_size
        l, r, h = layers.stop - layers.start, len(rounds), heads.stop - heads.start
        t, prompt, length, offset = header[:, 0], header[:, 1], header[:, 2], header[:, 3]  # [r] each
        table = header[:, _HEADER : _HEADER + blocks]  # [r, blocks]
        slots = torch.arange(N, device=device)
        logical = (slots[None, :] + offset[:, None]).masked_fill(slots[None, :] >= length[:, None], -1)  # [r, N]
        positions = logical[None, :, None, :].expand(l, r, h, N).clone()  # [l, r, h, N]
        previous = [self.kept_positions[op.request_id][layers, heads] for op in rounds if op.request_id in self.kept_positions]
        if previous:  # slots [0, kept) hold what the request's previous round kept
            positions[:, : len(previous), :, : previous[0].shape[-1]] = torch.stack(previous, dim=1)
        del logical, previous
        located: dict[tuple, object] = {}  # one index per page layout, shared by the layers that have it

        def where(codec: PageCodec, cache: torch.Tensor):
            key = (id(codec), cache.stride())
            if key not in located:
                located[key] = codec.locate(table, cache, heads)
            return located[key]

        dead = positions < 0
        protected = protected_entries(positions, t, prompt, budget, self.policy.recent_window, self.min_decode_room,
                                      self.protect_prompt) & ~dead
        keys = torch.stack([codec.read_keys(cache, where(codec, cache), _heads_scale(scale, heads))
                            for codec, cache, scale in zip(codecs[layers], kv_caches[layers], scales[layers])])  # [l, r, h, N, D]
        context = ScoringContext(
            keys=keys,
            values=None,  # the methods served inside vLLM score keys only
            positions=positions,
            candidates=~(dead | protected),
            current_position=t,
            budget=budget,
            protected=protected,
        )
        scores = self._policy_for(layers, heads, len(kv_caches), codecs[0].num_heads).score(context).float()  # [l, r, h, N]
        self.chunks += 1
        del keys, context
        scores = scores.masked_fill(protected, float("inf")).masked_fill(dead, float("-inf"))
        order = scores.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values  # [l, r, h, budget]
        del scores, dead, protected
        chosen = positions.gather(3, order)  # [l, r, h, budget]
        del positions
        for row, state in enumerate(kept):
            state[layers, heads] = chosen[:, row]
        for index, (codec, cache) in enumerate(zip(codecs[layers], kv_caches[layers])):
            codec.move(cache, table, order[index], where(codec, cache))  # kept entries into slots [0, budget)


def _heads_scale(scale: torch.Tensor | None, heads: slice) -> torch.Tensor | None:
    """A layer's key scale for the KV heads `heads` of a chunk: the layer's one scale, or its per-head scales [Hkv]
    (this rank's KV heads) cut to the chunk's."""
    if scale is None or scale.numel() == 1:
        return scale
    return scale.flatten()[heads]


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` without waiting for the device: on CUDA from pinned (page-locked) memory, so the copy is
    queued on the stream ahead of the kernels that read it (from pageable memory CUDA copies through a staging
    buffer and the host waits); on CPU the tensor itself."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
