"""The scheduler half of trikv inside vLLM: decides the rounds and returns the freed blocks to the pool.

Before vLLM schedules a step, every running bounded request whose physical KV length reached budget +
divide_length is shrunk to its first ceil(budget / block_size) blocks; the tail blocks go back to vLLM's block
pool at once, so this very step can give them to other requests. The request's offset (logical tokens -
physical entries) grows by what was dropped. Everything vLLM tracks stays logical (token ids, positions, stop
checks, max_model_len); only the block allocation of the full-attention KV cache group sees the physical length,
through wrappers around that group's manager. A hybrid model's sliding-window groups (Gemma-3, GPT-OSS) stay
vLLM's own: logical lengths, their window's blocks. The rounds and offsets travel to the workers as the `trikv`
attribute of the step's `SchedulerOutput`; the workers compact the KV before the step's forward.

Prefill: the rule of trikv's transformers and MLX caches. A bounded request whose prefill would take it past
budget + divide_length gets at most `prefill_chunk_size` tokens per step (or vLLM's own per-step cap, when
smaller), and the rounds above run between its chunks whenever it reaches budget + divide_length; a shorter
prefill runs as vLLM schedules it and is compacted after it, if due. So no bounded request ever holds more than
`request_bound` entries (budget + divide_length + one chunk, or one block where a block is larger), whatever its
prompt's length: it is admitted for that many blocks, not its whole prompt, and the KV spec vLLM checks its pool
with at start-up counts a request at that bound (`capacity.py`), so a pool smaller than max_model_len serves
prompts up to max_model_len. Engines without chunked prefill are refused at start-up (`check_engine_config`).

Round waves: requests that fall due on the same step (a batch started together) would all be compacted in it, a
step as long as many decode steps. At most `BoundedKVSettings.rounds_per_step` rounds start per step (default 4,
from the cost of a round at 8B-model shapes: about a quarter of a decode step each); a decoding request past the
limit decodes on, a token a step, until the step that would give it a block past budget + divide_length + one
block, and is compacted then whatever the limit; a request still prefilling never waits.

Speculative decoding (n-gram drafts): vLLM schedules a request's k draft tokens as extra tokens of its step,
writes their KV, and once the step is verified takes the rejected ones off `num_computed_tokens`. Every count here
stays logical, so the physical length (logical - offset, the offset unchanged by a step) rolls back with it: the
next step's tokens are written from that physical slot on, over the rejected drafts' stale entries, and the blocks
vLLM allocated for them stay the request's until a round returns them. Rounds are planned before a step, after the
previous step's rejections were taken off, so a round sees the verified tokens only (slots below
num_computed_tokens - offset); a stale entry past them is neither scored nor kept. A step's draft tokens are cut
so that it ends at budget + divide_length at the latest (`_reserve_prefill_lookahead`), and dropped while the
request's round waits (it decodes one token a step, as without drafts): a round falls due at the very length it
would without speculation (same rounds, so at temperature 0 the same tokens), and no step holds more entries than
without it, so the bound is unchanged (n-gram drafts keep no KV of their own: vLLM reserves no lookahead slots).

Preemption: vLLM drops a preempted request's blocks and later recomputes its whole history (prompt and output so
far) as a prefill, under the same rule: a request preempted at 30K tokens is readmitted for its bound, not for
30K tokens of free blocks, and does not hold up the requests queued behind it. Its cache after the recompute is a
new selection over the recomputed history (rounds at chunk boundaries rather than every divide_length tokens), so
its later tokens can differ from an unpreempted run's.

Prefix caching (vLLM's automatic prefix caching, `enable_prefix_caching`): a block another request may read is
never written. A round writes its request's first ceil(budget / block_size) blocks; each of them that is cached
(hashed: a later prompt may hit it) or shared (ref_cnt > 1: another request holds it) is replaced by a fresh block
from the pool, into which the worker copies it before the round (`_private_kept_blocks`, `CompactionOp.copies`);
the original goes back to vLLM's pool through its free path with its contents and hash untouched. Fresh blocks are
taken for all of a step's rounds before any block is returned, so none is a block a round of the step still reads.
A compacted request's blocks are never cached again (`never_cache_compacted`: after a round they hold kept entries,
not the KV of the tokens a hash names), so a request's blocks are cached only up to its first round, as they fill,
and after a preemption again up to the first round of its recompute. A bounded request's hit is cut to end before
budget + divide_length and, when its prefill runs in chunks, on its chunk grid (`_prefix_hit_limit`): its chunks
and rounds, hence its tokens, are those it has without the hit, and it never holds more than its bound.

Requests the engine cannot serve as asked are refused here too, not only in vLLM's front end (a `vllm serve`
without trikv's plugin, an `LLM` whose requests skip the input processor): a malformed or out-of-range
`trikv_budget`, an unknown `trikv*` key, a streaming-input session, a full-attention request whose prompt does not
fit the pool. A refused request never runs: it finishes at once with finish_reason "error" and the reason as its
stop_reason, and the engine keeps serving. A full-attention request's output stops where the pool is full
(finish_reason "length"), as plain vLLM stops every request at max_model_len: its max_tokens is lowered to fit.
"""

from __future__ import annotations

import functools
import math

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus

from .capacity import full_request_refusal, max_step_tokens, request_bound
from .compactor import CompactionOp, SessionChanges, StepPlan
from .session_reuse import SessionReuse
from .settings import BoundedKVSettings, RequestSettingsError
from .support import check_engine_config

log = init_logger(f"vllm.{__name__}")  # printed with vLLM's own log lines


def full_attention_manager(managers):
    """The block manager of the one full-attention KV cache group (the other groups must slide)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager

    full = [m for m in managers if type(m) is FullAttentionManager]
    others = [type(m).__name__ for m in managers if type(m) is not FullAttentionManager and not isinstance(m, SlidingWindowManager)]
    if len(full) != 1 or others:
        kinds = [type(m).__name__ for m in managers]
        raise RuntimeError(f"trikv bounds one full-attention KV cache group and leaves sliding-window groups to vLLM; "
                           f"this model's groups are {kinds}")
    return full[0]


def count_physical(manager, offsets: dict[str, int], admission_cap=lambda request_id: None) -> None:
    """Make `manager` (the full-attention group) count a compacted request's physical entries: every token count
    it is given is logical, so its offset (logical - physical) is taken off. At admission (vLLM asks whether a
    waiting request's whole sequence fits) a bounded request counts at most `admission_cap(request_id)` entries:
    what it will ever hold."""
    count = manager.get_num_blocks_to_allocate
    allocate = manager.allocate_new_blocks

    @functools.wraps(count)
    def count_blocks(request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_local_computed_tokens,
                     num_tokens_main_model, *args, **kwargs):
        offset = offsets.get(request_id, 0)
        cap = admission_cap(request_id) if kwargs.get("apply_admission_cap") else None
        if cap is not None and num_tokens - offset > cap:
            num_tokens_main_model -= num_tokens - offset - cap
            num_tokens = cap + offset
        return count(request_id, num_tokens - offset, new_computed_blocks, max(0, total_computed_tokens - offset),
                     max(0, num_local_computed_tokens - offset), num_tokens_main_model - offset, *args, **kwargs)

    @functools.wraps(allocate)
    def allocate_blocks(request_id, num_tokens, num_tokens_main_model, *args, **kwargs):
        offset = offsets.get(request_id, 0)
        return allocate(request_id, num_tokens - offset, num_tokens_main_model - offset, *args, **kwargs)

    manager.get_num_blocks_to_allocate = count_blocks
    manager.allocate_new_blocks = allocate_blocks


def never_cache_compacted(manager, compacted) -> None:
    """Make `manager` (the full-attention group) cache (hash) no block of a request in `compacted` (its id is a key
    there from its first round until it finishes or is preempted): after a round its blocks hold the kept entries of
    the whole history, not the KV of the tokens their positions name, so a hash of those tokens would let another
    request hit KV that is not theirs. Before its first round a request's blocks hold exactly the KV of its tokens
    and are cached as vLLM caches any request's (full blocks, as they fill)."""
    cache = manager.cache_blocks

    @functools.wraps(cache)
    def cache_blocks(request, *args, **kwargs):
        if request.request_id in compacted:
            return None
        return cache(request, *args, **kwargs)

    manager.cache_blocks = cache_blocks


class TriKVScheduler(SessionReuse, Scheduler):
    """vLLM's scheduler with a bounded KV cache per request (settings in `additional_config["trikv"]`), and session
    reuse (`session_reuse.py`)."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.trikv = BoundedKVSettings.from_config(vllm_config.additional_config)
        check_engine_config(vllm_config, self.trikv)
        self.trikv_offsets: dict[str, int] = {}  # request -> logical - physical entries
        self.trikv_rounds = 0
        self.trikv_blocks_freed = 0
        self.trikv_preemptions = 0
        self._trikv_announced: set[str] = set()  # requests whose first round was logged
        self._trikv_budgets: dict[str, int | None] = {}  # request -> its budget (None: full attention)
        self._trikv_refused: list[tuple[object, str]] = []  # (request, reason) refused since the last step
        self._trikv_manager = full_attention_manager(self.kv_cache_manager.coordinator.single_type_managers)
        self._trikv_block = self._trikv_manager.block_size
        self._trikv_bounds: dict[int, int] = {}  # budget -> request_bound
        self._trikv_chunk = self.trikv.prefill_step_tokens(max_step_tokens(vllm_config))  # tokens per prefill step
        self._trikv_rounds_per_step = self.trikv.rounds_per_step(vllm_config.scheduler_config.max_num_seqs)
        # the most tokens one full-attention request can hold in this pool (prompt and output)
        self._trikv_full_capacity = self._largest_request_fitting(self.kv_cache_manager.block_pool.num_gpu_blocks - 1)
        self._trikv_round_waits: set[str] = set()  # requests due whose round did not start this step
        count_physical(self._trikv_manager, self.trikv_offsets, self._admission_cap)
        never_cache_compacted(self._trikv_manager, self.trikv_offsets)  # prefix caching: only uncompacted KV is hashed
        self._init_sessions(vllm_config.scheduler_config.max_num_seqs)
        self._announce_capacity()

    def schedule(self, *args, **kwargs):
        rounds = self._start_rounds()
        output = super().schedule(*args, **kwargs)
        preempted = set(output.preempted_req_ids or ())
        blocks = self._trikv_manager.req_to_blocks
        plan = StepPlan(
            rounds=[op for op in rounds if op.request_id not in preempted],
            offsets={rid: offset for rid, offset in self.trikv_offsets.items() if rid in output.num_scheduled_tokens},
            running=len(self.running),
            preemptions=self.trikv_preemptions,
            request_blocks=max((len(blocks.get(r.request_id, ())) for r in self.running if self._budget_of(r) is not None),
                               default=0),
            sessions=SessionChanges(*self.trikv_sessions.take_changes()) if self.trikv_sessions is not None else None,
        )
        output.trikv = plan
        return output

    def add_request(self, request) -> None:
        reason = self._refusal(request)
        if reason is not None:
            log.error("trikv: request %s refused: %s", request.request_id, reason)
            self._trikv_refused.append((request, reason))
            return
        fresh = request.sampling_params is not None and request.request_id not in self.requests
        if fresh and self._budget_of(request) is None:
            # full attention holds its whole sequence: its output stops where the pool is full ("length"), as
            # plain vLLM's stops at max_model_len, instead of outgrowing the pool and waiting for blocks forever
            request.max_tokens = min(request.max_tokens, self._trikv_full_capacity - request.num_prompt_tokens)
        super().add_request(request)

    def _refusal(self, request) -> str | None:
        """Why this engine cannot serve `request` as asked (None when it can): the checks of trikv's front end,
        for requests that reached the engine without passing them."""
        if getattr(request, "resumable", False) and request.request_id not in self.requests:
            return ("streaming-input sessions are not supported with a bounded KV cache: the prompt would grow after "
                    "the request's cache was compacted")
        if request.sampling_params is None:
            return None
        try:
            budget = self.trikv.request_budget(request.sampling_params.extra_args)
        except RequestSettingsError as error:
            return str(error)
        if budget is None:
            return full_request_refusal(request.num_prompt_tokens, self._trikv_full_capacity)
        return None

    def get_num_unfinished_requests(self) -> int:
        return super().get_num_unfinished_requests() + len(self._trikv_refused)  # their error output is still due

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request, reason in self._trikv_refused:
            batch = outputs.setdefault(request.client_index, EngineCoreOutputs())
            batch.outputs = [*batch.outputs, EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                                              stop_reason=f"trikv: {reason}")]
            batch.finished_requests = {*(batch.finished_requests or ()), request.request_id}
        self._trikv_refused.clear()
        return outputs

    def _budget_of(self, request) -> int | None:
        """The request's budget (its own `trikv_budget` or the server's), None for full attention (a request whose
        choice is malformed never gets here: `add_request` refuses it)."""
        if request.request_id not in self._trikv_budgets:
            extra_args = request.sampling_params.extra_args if request.sampling_params else None
            self._trikv_budgets[request.request_id] = self.trikv.request_budget(extra_args)
        return self._trikv_budgets[request.request_id]

    def _start_rounds(self) -> list[CompactionOp]:
        """Shrink every running request that is due and return its round."""
        settings = self.trikv
        pool = self.kv_cache_manager.block_pool
        held = {request.request_id: len(self._trikv_manager.req_to_blocks.get(request.request_id, ())) for request in self.running}
        rounds = []
        due = []  # (request, budget, physical length)
        for request in self.running:  # prefilling or decoding: a long prefill is compacted between its chunks
            budget = self._budget_of(request)
            # verified tokens only: vLLM took the previous step's rejected draft tokens off num_computed_tokens
            # before this step is planned, and their stale entries past `length` are neither scored nor kept
            length = request.num_computed_tokens - self.trikv_offsets.get(request.request_id, 0)
            if budget is not None and length >= settings.round_trigger(budget):
                due.append((request, budget, length))
        chosen = self._spread(due)
        self._trikv_round_waits = {request.request_id for request, _, _ in due}
        due_states = self._pin_due_states()  # kept states due for their round (session reuse)
        # copy-on-write for every round of the step before any block goes back to the pool, so that no fresh block
        # is one a round of this step still reads
        private = {request.request_id: self._private_kept_blocks(request.request_id, -(-budget // self._trikv_block))
                   for request, budget, _ in chosen}
        for request, budget, length in chosen:
            copies = private[request.request_id]
            if copies is None:
                log.warning("trikv: request %s waits for its round: its first blocks are shared with another request "
                            "and the pool has no free block to copy them to", request.request_id)
                continue
            self._trikv_round_waits.discard(request.request_id)
            computed = request.num_computed_tokens
            kept_blocks = -(-budget // self._trikv_block)
            blocks = self._trikv_manager.req_to_blocks[request.request_id]
            tail = blocks[kept_blocks:]
            del blocks[kept_blocks:]
            released = []
            for index, fresh in copies:  # the round writes into the copy; the original keeps its contents and hash
                released.append(blocks[index])
                blocks[index] = fresh
            pool.free_blocks([*reversed(tail), *reversed(released)])  # vLLM's order: the prefix's blocks evicted last
            held[request.request_id] = len(blocks)
            self.trikv_offsets[request.request_id] = computed - budget
            self._trikv_last_round[request.request_id] = (computed, budget)
            self.trikv_rounds += 1
            self.trikv_blocks_freed += len(tail)
            if request.request_id not in self._trikv_announced:
                self._trikv_announced.add(request.request_id)
                log.info("trikv: request %s compacted at %d tokens (%d -> %d entries per KV head, %d blocks returned, %d free)",
                         request.request_id, computed, length, budget, len(tail), pool.get_num_free_blocks())
            rounds.append(
                CompactionOp(
                    request_id=request.request_id,
                    position=computed,
                    length=length,
                    budget=budget,
                    prompt_length=self._trikv_prompts.get(request.request_id, request.num_prompt_tokens),
                    kept_blocks=len(blocks),
                    freed_blocks=len(tail),
                    copies=tuple((old.block_id, fresh.block_id) for old, (_, fresh) in zip(released, copies)),
                    free_blocks=pool.get_num_free_blocks(),
                    held_blocks=sum(held.values()),
                )
            )
        for state in due_states:
            rounds.append(self._session_round(state, sum(held.values())))
            self.trikv_rounds += 1
        return rounds

    def _private_kept_blocks(self, request_id: str, kept: int) -> list | None:
        """Copy-on-write for a round of `request_id`, which writes its kept entries into its first `kept` blocks:
        [(index, fresh block)] for each of them another request may read, a block shared with a running request
        (ref_cnt > 1) or cached (a hash a later request's prompt may hit). The round writes into the fresh block (the
        worker copies the original into it first), and the original goes back to the pool untouched, still cached:
        a hit never returns a block whose contents differ from what its hash names. A block held by this request
        alone and not cached is written in place, as without prefix caching (the only kind there is then).

        Fresh blocks come from the pool's free blocks; where there are too few, a cached block held by this request
        alone loses its hash (`BlockPool._maybe_evict_cached_block`, as vLLM evicts a cached block it reuses) and is
        written in place. None (no round this step) when even the shared blocks cannot all be copied."""
        pool = self.kv_cache_manager.block_pool
        blocks = self._trikv_manager.req_to_blocks[request_id][:kept]
        readable = [index for index, block in enumerate(blocks)
                    if not pool.is_block_writable(block) or block.block_id in pool.cached_block_hashes_by_block]
        if not readable:
            return []
        free = pool.get_num_free_blocks()
        shared = [index for index in readable if blocks[index].ref_cnt > 1]
        if len(shared) > free:
            return None
        copied = sorted(shared + [index for index in readable if blocks[index].ref_cnt <= 1][: free - len(shared)])
        for index in set(readable) - set(copied):
            if self.trikv_sessions is not None:
                self.trikv_sessions.on_reuse(blocks[index])  # a kept state reading it is gone: it is written in place
            pool._maybe_evict_cached_block(blocks[index])
        return list(zip(copied, pool.get_new_blocks(len(copied))))

    def _get_local_prefix_cache_hit(self, request):
        """vLLM's prefix-cache hit for a waiting request, limited for a bounded one (`_prefix_hit_limit`), or a kept
        state's continuation where that reuses more (`SessionReuse._session_hit`)."""
        return self._session_hit(request, *self._limited_prefix_hit(request))

    def _limited_prefix_hit(self, request):
        blocks, hit, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        budget = self._budget_of(request) if hit else None
        if budget is None:
            return blocks, hit, boundary, diverged
        limit = self._prefix_hit_limit(request, budget, hit)
        if limit >= hit:
            return blocks, hit, boundary, diverged
        if limit == 0 or len(self.kv_cache_manager.coordinator.single_type_managers) > 1:
            # a sliding-window group's hit holds its window's blocks at the hit's end: no shorter hit is cut from it
            return self.kv_cache_manager.empty_kv_cache_blocks, 0, 0, False
        return self.kv_cache_manager.truncate_computed_blocks(blocks, limit), limit, 0, diverged

    def _prefix_hit_limit(self, request, budget: int, hit: int) -> int:
        """The longest prefix-cache hit (tokens) a bounded request takes, at most `hit`. A prefill that fits under
        budget + divide_length runs as vLLM schedules it (no round falls due inside it): the whole hit. A longer one
        runs in chunks of `prefill_chunk_size` from token 0 with rounds between them: the hit ends on that grid and
        before budget + divide_length (a block boundary too), so the request's chunks and rounds are those it has
        without the hit (its tokens do not depend on what the cache held) and it never holds more than its bound."""
        trigger = self.trikv.round_trigger(budget)
        if request.num_tokens <= trigger:
            return hit
        grid = math.lcm(self._trikv_chunk, self._trikv_block)
        return min(hit, trigger - 1) // grid * grid

    def _spread(self, due: list) -> list:
        """The due requests compacted in this step: all of them when they are at most the step's limit
        (`BoundedKVSettings.rounds_per_step`), else that many (the longest first) plus every request that cannot
        wait: one still prefilling (its next chunk would land on top of an uncompacted cache) and one that would
        need a block past budget + divide_length + one block. The others decode a few more tokens first (one a
        step: a waiting request's draft tokens are dropped, `_reserve_prefill_lookahead`), so rounds that fall due
        together do not all land on one step."""
        if len(due) <= self._trikv_rounds_per_step:
            return due
        due = sorted(due, key=lambda item: -item[2])
        waits = [request.num_tokens - request.num_computed_tokens <= 1
                 and length < self.trikv.round_trigger(budget) + self._trikv_block for request, budget, length in due]
        must = [item for item, can_wait in zip(due, waits) if not can_wait]
        rest = [item for item, can_wait in zip(due, waits) if can_wait]
        return must + rest[: max(0, self._trikv_rounds_per_step - len(must))]

    def _bound(self, budget: int) -> int:
        """The most entries a request bounded at `budget` holds (`capacity.request_bound`)."""
        if budget not in self._trikv_bounds:
            self._trikv_bounds[budget] = request_bound(self.trikv, budget, self._trikv_block, self.vllm_config)
        return self._trikv_bounds[budget]

    def _admission_cap(self, request_id: str) -> int | None:
        """Entries a waiting bounded request is admitted for: its bound (None for full attention: its sequence)."""
        request = self.requests.get(request_id)
        budget = None if request is None else self._budget_of(request)
        return None if budget is None else self._bound(budget)

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's last cap on a request's new tokens in a step, applied to running and waiting requests alike just
        before their blocks are allocated; trikv caps there the prefill of a bounded request whose remaining
        prefill would take it past budget + divide_length to one chunk (`BoundedKVSettings.prefill_step_tokens`),
        so a round can run before the next one. A prefill that fits under budget + divide_length runs as vLLM
        schedules it (no round can fall due inside it), as on the transformers path.

        A decoding request's draft tokens (speculative decoding) are cut so that its step ends at budget +
        divide_length at the latest, and dropped while its round waits (`_spread`): its round falls due at the
        length it would without drafts, and no step holds more entries than one without them."""
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        budget = self._budget_of(request)
        if budget is None or num_new_tokens <= 1:
            return num_new_tokens
        physical = num_computed_tokens - self.trikv_offsets.get(request.request_id, 0)
        trigger = self.trikv.round_trigger(budget)
        known = request.num_tokens - num_computed_tokens  # the tokens the request has, draft tokens not counted
        if num_new_tokens > known and request.status == RequestStatus.RUNNING:
            # the rest are draft tokens (a waiting request's are placeholders vLLM pads a batch with and needs whole;
            # it is admitted below its trigger)
            return max(known, min(num_new_tokens, trigger - physical))
        if physical + known <= trigger:
            return num_new_tokens
        if request.request_id in self._trikv_round_waits:
            return 0  # its round waits for a block to copy into: a chunk now would land on an uncompacted cache
        step = min(num_new_tokens, self._trikv_chunk)
        if step == self._trikv_chunk and known - step == 1 and step > 1:
            return step - 1  # no last chunk of one token (the transformers path's `chunk_bounds`)
        return step

    def _blocks_for(self, full_tokens: int, tokens: int) -> int:
        """Blocks a fresh request needs over every KV cache group when the full-attention group holds `full_tokens`
        entries of its `tokens` (the sliding-window groups count as vLLM's admission counts them: their window)."""
        managers = self.kv_cache_manager.coordinator.single_type_managers
        blocks = -(-full_tokens // self._trikv_block)
        for manager in managers:
            if manager is not self._trikv_manager:
                blocks += manager.get_num_blocks_to_allocate("trikv-capacity", tokens, [], 0, 0, tokens,
                                                             apply_admission_cap=True)
        return blocks

    def _largest_request_fitting(self, blocks: int) -> int:
        """The most tokens one full-attention request holds in `blocks` blocks (beyond max_model_len where the pool
        is larger: vLLM stops requests at max_model_len itself)."""
        low, high = 0, blocks * self._trikv_block
        while low < high:  # blocks needed grow with the tokens held
            middle = (low + high + 1) // 2
            if self._blocks_for(middle, middle) <= blocks:
                low = middle
            else:
                high = middle - 1
        return low

    def _announce_capacity(self) -> None:
        """Say what the pool holds: vLLM's own start-up lines ("KV cache size", "Maximum concurrency") count one
        request at the bound of trikv's KV spec, not at max_model_len, and would mislead."""
        usable = self.kv_cache_manager.block_pool.num_gpu_blocks - 1
        budget = self.trikv.largest_request_budget
        bound = self._bound(budget)
        per_request = self._blocks_for(bound, self.max_model_len)
        full = (f"; a full-attention request holds at most {min(self._trikv_full_capacity, self.max_model_len):,} tokens "
                "(prompt and output)" if self.trikv.allow_full_requests else "")
        log.info("trikv: a bounded request (budget up to %d) holds at most %d KV entries per layer and KV head, whatever its "
                 "length (budget + divide_length %d + the larger of a prefill chunk %d and a block %d, at most max_model_len "
                 "%d): %d blocks of the pool's %d usable ones, so the pool holds %d such requests at once%s; at most %d "
                 "rounds start per step. vLLM's 'KV cache size' and 'Maximum concurrency' lines count requests at this "
                 "bound, not at max_model_len",
                 budget, bound, self.trikv.divide_length, self._trikv_chunk, self._trikv_block, self.max_model_len,
                 per_request, usable, usable // per_request, full, self._trikv_rounds_per_step)

    def finish_requests(self, request_ids, finished_status):
        """vLLM's, and an abort of a refused request drops its pending error output (the client stopped waiting)."""
        if request_ids is not None and not isinstance(request_ids, str):
            request_ids = list(request_ids)  # read twice
        if request_ids is None:
            self._trikv_refused.clear()
        elif self._trikv_refused:
            gone = {request_ids} if isinstance(request_ids, str) else set(request_ids)
            self._trikv_refused = [(r, why) for r, why in self._trikv_refused if r.request_id not in gone]
        return super().finish_requests(request_ids, finished_status)

    def _preempt_request(self, request, *args, **kwargs):
        super()._preempt_request(request, *args, **kwargs)
        self.trikv_offsets.pop(request.request_id, None)  # recomputed from scratch on resume
        self._forget_request(request.request_id)
        self.trikv_preemptions += 1

    def _free_request(self, request, *args, **kwargs):
        result = super()._free_request(request, *args, **kwargs)  # keeps its state first, where it can be kept
        self.trikv_offsets.pop(request.request_id, None)
        self._trikv_announced.discard(request.request_id)
        self._trikv_budgets.pop(request.request_id, None)
        self._forget_request(request.request_id)
        return result
