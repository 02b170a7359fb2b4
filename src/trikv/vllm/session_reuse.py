"""The scheduler's half of session reuse: keep a finished request's compacted KV, and start a new request from it.

`SessionReuse` is mixed into `TriKVScheduler` (`scheduler.py`); the kept states, their lookup and the cut rule are
`sessions.py`'s. The hooks, in the order a conversation meets them:

1. A bounded request finishes (`_free_request_blocks`): when it can be kept, its blocks that hold its physical
   entries are kept in a `KeptState` and go back to vLLM's pool as reclaimable (`BlockPool.unpin_blocks`), its other
   blocks are freed. It covers the tokens computed but the last (as without speculation: a step of n-gram drafts can
   leave the last one computed). Not kept: full-attention requests, requests that opted out
   (`extra_args["trikv_session"] = "off"`), multimodal or embedding prompts, refused requests (finish_reason
   "error"), and, with prefix caching on, a request never compacted that is due for its first round (that round
   would write blocks the prefix cache holds; the cache keeps them instead). A kept state that reached budget +
   divide_length is compacted at the next step, before any request can continue it (`_session_round`), as
   `trikv.Session` compacts a due cache before its next turn's first forward.

   With prefix caching on, a state never compacted holds blocks the prefix cache holds too (hashed, maybe read by
   other requests): nothing writes them. A continuation's next tokens never go into one (its cut is aligned down
   to a block boundary where the block at the cut is hashed), a round copies them first (as for any request), and
   a round that must write one in place for want of free blocks drops the state first
   (`TriKVScheduler._private_kept_blocks`).
2. A request is admitted (`_get_local_prefix_cache_hit`, vLLM's prefix lookup): the longest continuation of its
   token ids from a kept state with its budget and owner (`SessionStore.find`), taken over vLLM's own prefix hit
   when it reuses more tokens. It is reported to vLLM as computed tokens; the request's offset is set so that
   vLLM's counts of its blocks and its prefill chunks are physical.
3. Its blocks are allocated (`allocate_slots`): the state's blocks up to its cut are attached to the request (as
   vLLM attaches a prefix hit's), then vLLM allocates the rest; if the pool cannot hold them the request waits and
   the state stays kept, intact. Once attached the state leaves the store; the workers move its kept positions to
   the request (`StepPlan.sessions`).

A preempted request recomputes its history from scratch, as a stateless one (its blocks are freed, not kept:
they are what the preemption needed). A request aborted mid-turn (a client that disconnected) is kept like a
finished one, up to the tokens it computed: the client's retry of the same conversation continues it.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from .compactor import CompactionOp
from .sessions import INDEX_TOKENS, Continuation, KeptState, SessionStore

log = init_logger(f"vllm.{__name__}")
ENGINE_UTILITY = "trikv_session_stats"  # vLLM's engine core answers it (`install_engine_utility`)

KEPT_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED)


class SessionReuse:
    """Session reuse for `TriKVScheduler` (the attributes it reads are the scheduler's: `trikv`, `trikv_offsets`,
    `_trikv_manager`, `_trikv_block`, `_budget_of`, `kv_cache_manager`, `cache_config`)."""

    trikv_sessions: SessionStore | None = None

    def _init_sessions(self, max_num_seqs: int) -> None:
        settings = self.trikv
        self._trikv_prompts: dict[str, int] = {}  # request -> protected prompt (a continued conversation's first)
        self._trikv_last_round: dict[str, tuple[int, int]] = {}  # request -> (logical length, budget) at its last round
        self._trikv_pending: dict[str, Continuation] = {}  # waiting request -> the continuation it is admitted with
        self._trikv_token_arrays: dict[str, np.ndarray] = {}  # waiting request -> its token ids, looked up once
        install_engine_utility()
        if not settings.session_reuse:
            return
        if len(self.kv_cache_manager.coordinator.single_type_managers) > 1:
            log.info("trikv: session reuse is off on this hybrid model: a kept state would need its sliding-window "
                     "groups' blocks too, which trikv leaves to vLLM")
            return
        self.trikv_sessions = SessionStore(settings.kept_sessions(max_num_seqs))
        self.kv_cache_manager.allocate_slots = self._attach_continuations(self.kv_cache_manager.allocate_slots)

    # ---- 1. keeping ---------------------------------------------------------------------------------------------
    def _free_request_blocks(self, request):
        if not self._keep_state(request):
            super()._free_request_blocks(request)

    def _takes_part(self, request) -> bool:
        """Whether `request` may take and keep a state: bounded, token prompt, not opted out."""
        if self.trikv_sessions is None or request.sampling_params is None or self._budget_of(request) is None:
            return False
        if request.mm_features or request.prompt_embeds is not None:
            return False
        return self.trikv.request_session(request.sampling_params.extra_args)

    def _keep_state(self, request) -> bool:
        """Keep a finished request's KV as a state (its blocks reclaimable); False where its blocks are the caller's
        to free."""
        if (request.status not in KEPT_STATUSES or not self._takes_part(request)
                or not self._request_blocks_can_be_freed(request)):
            return False
        request_id = request.request_id
        compacted = request_id in self.trikv_offsets
        # the last token is never covered, as without speculation (a step of drafts can leave it computed)
        computed = min(request.num_computed_tokens, request.num_tokens - 1)
        offset = self.trikv_offsets.get(request_id, 0)
        physical = computed - offset
        if computed < INDEX_TOKENS or physical <= 0:
            return False
        budget = self._budget_of(request)
        if not compacted and physical >= self.trikv.round_trigger(budget) and self.cache_config.enable_prefix_caching:
            return False  # its first round would write blocks vLLM's prefix cache holds: the cache keeps them instead
        round_at, kept = self._trikv_last_round.get(request_id, (0, 0)) if compacted else (0, 0)
        prompt_length = self._trikv_prompts.get(request_id, request.num_prompt_tokens)
        settings = self.trikv
        state = KeptState(
            state_id=request_id,
            tokens=np.asarray(request.all_token_ids[:computed], dtype=np.int64),
            blocks=[],
            offset=offset,
            round_at=round_at,
            kept=kept,
            prompt_length=prompt_length,
            prompt_protected=settings.protect_prompt and prompt_length + settings.min_decode_room <= budget,
            budget=budget,
            owner=_owner(request),
            due=physical >= settings.round_trigger(budget),
        )
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        needed = -(-physical // self._trikv_block)
        state.blocks = blocks[:needed]
        pool = self.kv_cache_manager.block_pool
        pool.free_blocks(reversed(blocks[needed:]))  # slots past the last computed token (drafts, lookahead)
        if not self.trikv_sessions.keep(state):
            pool.free_blocks(reversed(state.blocks))
            return True
        pool.unpin_blocks(state.blocks, self.trikv_sessions.on_reuse)
        return True

    # ---- 2. finding --------------------------------------------------------------------------------------------
    def _session_hit(self, request, blocks, hit, boundary, diverged):
        """vLLM's (limited) prefix hit for a waiting request, or a kept state's continuation where that reuses
        more; the request's offset follows the choice."""
        request_id = request.request_id
        found = self._find_continuation(request)
        if found is None or found.reused <= hit:
            self._trikv_pending.pop(request_id, None)
            self.trikv_offsets.pop(request_id, None)  # a waiting request holds no compacted cache
            return blocks, hit, boundary, diverged
        self._trikv_pending[request_id] = found
        if found.moves_positions:
            self.trikv_offsets[request_id] = found.offset
        else:
            self.trikv_offsets.pop(request_id, None)
        return self.kv_cache_manager.empty_kv_cache_blocks, found.reused, 0, False

    def _find_continuation(self, request) -> Continuation | None:
        if not self._takes_part(request) or request.skip_reading_prefix_cache:
            return None
        tokens = self._trikv_token_arrays.get(request.request_id)
        if tokens is None:
            tokens = np.asarray(request.all_token_ids[:], dtype=np.int64)
            self._trikv_token_arrays[request.request_id] = tokens
        found = self.trikv_sessions.find(tokens, self._budget_of(request), _owner(request))
        if found is None or found.moves_positions or found.physical % self._trikv_block == 0:
            return found
        # uncompacted slots (a state never compacted, or a protected prompt's): the block the request's next tokens
        # go into must be its own to write; one vLLM's prefix cache holds (hashed) is left whole to the cache
        if _hashed(found.state.blocks[found.physical // self._trikv_block]):
            aligned = found.physical - found.physical % self._trikv_block
            if aligned == 0:
                return None
            return replace(found, reused=found.reused - (found.physical - aligned), physical=aligned)
        return found

    # ---- 3. attaching ------------------------------------------------------------------------------------------
    def _attach_continuations(self, allocate):
        """Wrap the KV cache manager's `allocate_slots`: a request admitted with a continuation gets the state's
        blocks up to its cut before vLLM counts and allocates the rest (the request waits, the state intact, when
        they do not fit); every other admission of a request that could take a state counts as a miss."""

        @functools.wraps(allocate)
        def allocate_slots(request, num_new_tokens, *args, **kwargs):
            admitted = request.num_computed_tokens == 0
            found = self._trikv_pending.get(request.request_id) if admitted else None
            if found is None:
                result = allocate(request, num_new_tokens, *args, **kwargs)
                if result is not None and admitted and self._takes_part(request) and len(request.all_token_ids) > INDEX_TOKENS:
                    self.trikv_sessions.missed(request.num_tokens - kwargs.get("num_new_computed_tokens", 0))
                    self._trikv_token_arrays.pop(request.request_id, None)
                return result
            if self.trikv_sessions.states.get(found.state.state_id) is not found.state:
                return None  # its state was dropped since the lookup: the request waits and looks again next step
            head, tail = self._attach(request.request_id, found)
            result = allocate(request, num_new_tokens, *args, **kwargs)
            if result is None:
                self._detach(request.request_id, found, head, tail)
                return None
            self._adopt(request, found)
            return result

        return allocate_slots

    def _attach(self, request_id: str, found: Continuation) -> tuple[list, list]:
        """Give the request the state's blocks up to its cut (out of the pool's free queue, held by the request);
        the blocks past the cut stop belonging to the state, so that vLLM handing them out now does not drop it."""
        state = found.state
        needed = -(-found.physical // self._trikv_block)
        head, tail = state.blocks[:needed], state.blocks[needed:]
        self.trikv_sessions.release_blocks(state, tail)
        self.kv_cache_manager.block_pool.touch(head)
        manager = self._trikv_manager
        assert not manager.req_to_blocks.get(request_id), "a waiting request holds no blocks"
        manager.req_to_blocks[request_id].extend(head)
        # a continued compacted cache is never hashed; uncompacted slots (exactly the first tokens' KV) are hashed as
        # vLLM hashes any request's blocks, after the state's blocks the prefix cache holds already
        hashed = next((index for index, block in enumerate(head) if not _hashed(block)), len(head))
        manager.num_cached_block[request_id] = len(head) if found.moves_positions else hashed
        return head, tail

    def _detach(self, request_id: str, found: Continuation, head: list, tail: list) -> None:
        """Undo `_attach` (the pool could not hold the rest): the state keeps its blocks, reclaimable again."""
        manager = self._trikv_manager
        manager.req_to_blocks.pop(request_id, None)
        manager.num_cached_block.pop(request_id, None)
        self.kv_cache_manager.block_pool.unpin_blocks(head, self.trikv_sessions.on_reuse)
        self.trikv_sessions.claim_blocks(found.state, tail)  # nothing was allocated: they are all still free

    def _adopt(self, request, found: Continuation) -> None:
        request_id = request.request_id
        self.trikv_sessions.take(found, request_id, request.num_tokens - found.reused)
        self._trikv_pending.pop(request_id, None)
        self._trikv_token_arrays.pop(request_id, None)
        if found.moves_positions:
            self._trikv_last_round[request_id] = (found.state.round_at, found.state.kept)
        if found.prompt_length is not None:
            self._trikv_prompts[request_id] = found.prompt_length

    # ---- a due state's round -------------------------------------------------------------------------------------
    def _pin_due_states(self) -> list[KeptState]:
        """Take every due state's blocks out of the pool's free queue for this step's rounds (none of them may be a
        fresh block another round copies into)."""
        if self.trikv_sessions is None:
            return []
        due = [state for state in self.trikv_sessions.states.values() if state.due]
        for state in due:
            self.kv_cache_manager.block_pool.touch(state.blocks)
        return due

    def _session_round(self, state: KeptState, held_blocks: int) -> CompactionOp:
        """Compact a kept state that reached budget + divide_length (its blocks pinned by `_pin_due_states`): its
        first ceil(budget / block_size) blocks stay the state's, reclaimable again, the rest go back to the pool."""
        pool = self.kv_cache_manager.block_pool
        store = self.trikv_sessions
        kept_blocks = -(-state.budget // self._trikv_block)
        block_ids = tuple(block.block_id for block in state.blocks)
        head, tail = state.blocks[:kept_blocks], state.blocks[kept_blocks:]
        store.release_blocks(state, tail)
        pool.free_blocks(reversed(tail))
        pool.unpin_blocks(head, store.on_reuse)
        op = CompactionOp(request_id=state.state_id, position=state.length, length=state.physical, budget=state.budget,
                          prompt_length=state.prompt_length, kept_blocks=len(head), freed_blocks=len(tail),
                          free_blocks=pool.get_num_free_blocks(), held_blocks=held_blocks, block_ids=block_ids)
        state.blocks = head
        state.round_at, state.kept, state.offset, state.due = state.length, state.budget, state.length - state.budget, False
        return op

    # ---- bookkeeping ----------------------------------------------------------------------------------------------
    def _forget_request(self, request_id: str) -> None:
        for table in (self._trikv_prompts, self._trikv_last_round, self._trikv_pending, self._trikv_token_arrays):
            table.pop(request_id, None)

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        """vLLM's, and every kept state is dropped (the weights may have changed)."""
        if self.trikv_sessions is not None:
            for state_id in list(self.trikv_sessions.states):
                self.trikv_sessions.drop(state_id, "reset")
        return super().reset_prefix_cache(*args, **kwargs)

    def trikv_session_stats(self) -> dict:
        """What session reuse did so far (`SessionStore.stats`), or {"enabled": False}."""
        if self.trikv_sessions is None:
            return {"enabled": False}
        return {"enabled": True, **self.trikv_sessions.stats()}


def install_engine_utility() -> None:
    """Give vLLM's `EngineCore` a utility method `trikv_session_stats` (the scheduler's `trikv_session_stats`): an
    engine client calls it by name (`call_utility`, `call_utility_async`), as it calls vLLM's own utilities, so the
    front end reads the scheduler's figures, which live in the engine core's process."""
    from vllm.v1.engine.core import EngineCore

    def trikv_session_stats(core) -> dict:
        stats = getattr(core.scheduler, "trikv_session_stats", None)
        return stats() if stats is not None else {"enabled": False}

    if not hasattr(EngineCore, ENGINE_UTILITY):
        setattr(EngineCore, ENGINE_UTILITY, trikv_session_stats)


def _hashed(block) -> bool:
    """Whether vLLM's prefix cache holds `block` (a hash names its contents)."""
    return block.block_hash is not None


def _owner(request) -> tuple:
    """Who may read a request's kept state: requests with its LoRA adapter and its cache salt."""
    lora = request.lora_request.lora_int_id if request.lora_request is not None else 0
    return (lora, request.cache_salt)
