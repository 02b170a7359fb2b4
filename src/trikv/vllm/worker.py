"""The worker half of trikv inside vLLM: compacts the KV of due requests and runs attention on it.

`TriKVWorker` is vLLM's worker for the platform (CPU or CUDA) with its model runner switched to
`BoundedKVRunner`, which, for every step:
1. forgets the requests that finished or were preempted, then runs the step's rounds (`Compactor`): keys
   and values of the due requests are read from their blocks, scored, and the kept `budget` per (layer,
   KV head) written back into the first blocks; the runner's block lists are cut to the blocks the
   scheduler kept (with prefix caching, those of the first blocks another request may read are first copied
   into fresh blocks the scheduler gave, which take their place: `_trikv_copy_on_write`);
2. builds the inputs as vLLM does, then, for the full-attention KV cache group only, subtracts each request's
   offset from the slot of every new token and from its sequence length in that group's attention metadata:
   attention and KV writes use the compacted length, RoPE keeps the logical positions. A hybrid model's
   sliding-window groups keep vLLM's logical lengths and slots (their window's blocks).
Only vLLM's V1 model runner is supported (the CPU build always runs it; on CUDA trikv's engine arguments set
VLLM_USE_V2_MODEL_RUNNER=0).

CUDA graphs: the slot mapping, block table and positions the step's kernels read are vLLM's persistent buffers,
rewritten in place (the block table's stale ids past a compacted request's kept blocks are cleared); the
compacted sequence lengths live in attention metadata built for the step, which attention reads only when it
runs outside graphs. So PIECEWISE graphs (attention and KV writes between the captured pieces) are safe and FULL
graphs are not: a mode with FULL graphs is refused when the runner has resolved it (`support.graph_mode_problem`).
Memory: the runner reports the full-attention layers' KV spec as `BoundedFullAttentionSpec` (`capacity.py`), so
vLLM's start-up check sizes the pool for one request at trikv's bound rather than at max_model_len; on
accelerators vLLM's KV pool is reduced by the rounds' workspace and by every running request's kept positions
(int32 per kept entry), and a `round_workspace_bytes` below the floor of a round at that bound (the most entries
a round ever sees) is refused at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from vllm.platforms import current_platform

from ..architectures import config_shape
from ..calibration import load_stats
from ..fast import accelerate
from ..geometry import RopeGeometry
from .capacity import BoundedFullAttentionSpec, bounded_kv_cache_specs, request_bound
from .compactor import Compactor, StepPlan, request_state_bytes, upload
from .pages import PageCodec
from .settings import BoundedKVSettings, SettingsError
from .support import UnsupportedEngineError, check_model, fp8_format, graph_mode_problem, speculation_problem

log = logging.getLogger(__name__)

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker


class BoundedKVRunner:
    """Mixin over vLLM's V1 `GPUModelRunner` (and the CPU runner derived from it)."""

    trikv_compactor: Compactor | None = None
    _trikv_offsets: dict[str, int] = {}

    def trikv_bind(self, compactor: Compactor) -> None:
        self.trikv_compactor = compactor
        self._trikv_offsets = {}

    def trikv_learn_pages(self, layers: tuple[int, ...], num_kv_heads: int, head_dim: int) -> None:
        """Find the full-attention KV cache group, check that it holds exactly the model's full-attention
        `layers`, and learn the page layout of their KV tensors (after the KV cache is allocated)."""
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        groups = self.kv_cache_config.kv_cache_groups
        kinds = [type(group.kv_cache_spec).__name__ for group in groups]
        full = [index for index, group in enumerate(groups)
                if type(group.kv_cache_spec) in (FullAttentionSpec, BoundedFullAttentionSpec)]
        sliding = [index for index, group in enumerate(groups) if isinstance(group.kv_cache_spec, SlidingWindowSpec)]
        if len(full) != 1 or len(full) + len(sliding) != len(groups):
            raise RuntimeError(f"trikv bounds one full-attention KV cache group and leaves sliding-window groups to vLLM; "
                               f"this model's groups are {kinds}")
        self._trikv_group = full[0]
        spec = groups[self._trikv_group].kv_cache_spec
        # a backend that needs blocks smaller than the KV cache manager's (FlashInfer off Blackwell at --block-size
        # 128) gets layer views of kernel blocks: [blocks x k, ...], kernel block j of block b at b x stride + j
        kernel_sizes = {getattr(attn_group, "kernel_block_size", None) for attn_group in self.attn_groups[self._trikv_group]}
        if len(kernel_sizes) > 1:
            raise RuntimeError(f"the full-attention KV cache group's attention backends need different kernel blocks "
                               f"{sorted(kernel_sizes, key=str)}; trikv reads one page arrangement per group")
        kernel = kernel_sizes.pop()
        page_block = kernel or spec.block_size
        per_block = spec.block_size // page_block
        stride = next((getattr(g, "kernel_block_stride", 0) for g in self.attn_groups[self._trikv_group]), 0) or per_block
        self._trikv_kernel_blocks = (per_block, stride)
        names = sorted(groups[self._trikv_group].layer_names, key=extract_layer_index)
        found = tuple(extract_layer_index(name) for name in names)
        if found != tuple(layers):
            raise RuntimeError(f"vLLM's full-attention KV cache group holds layers {list(found)}, the model config's "
                               f"full-attention layers are {list(layers)}")
        context = self.compilation_config.static_forward_context
        quantised = fp8_format(self.cache_config.cache_dtype)
        self._trikv_caches = []
        self._trikv_codecs = []
        self._trikv_key_scales = []  # fp8 caches: each layer's key scale, read at every round (vLLM may set it late)
        learnt: dict = {}
        for layer_index, name in zip(found, names):
            layer = context[name]
            cache = layer.kv_cache
            if cache.data_ptr() != self.kv_caches[layer_index].data_ptr() or cache.shape != self.kv_caches[layer_index].shape:
                raise RuntimeError("the attention kernel's KV blocks differ from the scheduler's blocks; trikv needs them equal")
            key = (tuple(cache.shape[1:]), cache.stride(), cache.dtype, getattr(layer, "isa", None))
            if key not in learnt:

                def write(keys, values, scratch, slots, layer=layer if quantised is None else _UnitScales(layer)):
                    layer.impl.do_kv_cache_update(layer, keys, values, scratch, slots)

                try:
                    learnt[key] = PageCodec.learn(write, cache, num_kv_heads, page_block, head_dim, quantised,
                                                  self.model_config.dtype)
                except RuntimeError as error:
                    layout = getattr(self.cache_config, "kv_cache_layout", None) or "the backend's own"
                    raise RuntimeError(
                        f"{error} (KV cache layout {layout}, attention backend {type(layer.impl).__name__}); "
                        "choose another layout with VLLM_KV_CACHE_LAYOUT (e.g. LBHNC) or another attention backend"
                    ) from None
            self._trikv_caches.append(cache)
            self._trikv_codecs.append(learnt[key])
            self._trikv_key_scales.append(layer._k_scale if quantised is not None else None)
        for attn_group in self.attn_groups[self._trikv_group]:
            _physical_metadata(attn_group, self)

    def get_kv_cache_spec(self):
        """vLLM's specs, the full-attention layers' counted at trikv's bound (`capacity.BoundedFullAttentionSpec`)."""
        return bounded_kv_cache_specs(super().get_kv_cache_spec())

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        if self.trikv_compactor is not None:
            self._trikv_before_step(scheduler_output, getattr(scheduler_output, "trikv", None))
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._trikv_row_offsets = None  # a later dummy batch (idle data-parallel rank) must not inherit them

    def _trikv_before_step(self, scheduler_output, plan: StepPlan | None) -> None:
        compactor = self.trikv_compactor
        sessions = plan.sessions if plan is not None else None
        if sessions is not None:  # a finished request whose state is kept keeps its positions
            compactor.apply_sessions(sessions, before_rounds=True)
        for request_id in set(scheduler_output.preempted_req_ids or ()) | set(scheduler_output.finished_req_ids or ()):
            compactor.forget(request_id)
        self._trikv_offsets = plan.offsets if plan is not None else {}
        self._trikv_row_offsets = None
        if plan is None:
            return
        compactor.note_step(plan.running, plan.preemptions, plan.request_blocks)
        if plan.rounds:
            self._trikv_rounds(plan.rounds)
        if sessions is not None:  # after the rounds: a state dropped or taken in this step may have had its round
            compactor.apply_sessions(sessions, before_rounds=False)

    def _trikv_rounds(self, rounds) -> None:
        group = self._trikv_group
        self._trikv_copy_on_write(rounds)
        block_ids = {op.request_id: list(op.block_ids) if op.block_ids is not None  # a kept state's round: its own
                     else self.requests[op.request_id].block_ids[group] for op in rounds}
        per_block, stride = getattr(self, "_trikv_kernel_blocks", (1, 1))
        if per_block > 1:
            block_ids = {request_id: kernel_block_ids(ids, per_block, stride) for request_id, ids in block_ids.items()}
        self.trikv_compactor.run(rounds, self._trikv_caches, self._trikv_codecs, block_ids, self._trikv_key_scales)
        for op in rounds:
            if op.block_ids is not None:  # a kept state's round: no running request to cut
                continue
            state = self.requests[op.request_id]
            del state.block_ids[group][op.kept_blocks :]
            row = self.input_batch.req_id_to_index.get(op.request_id)
            if row is not None:  # the row rewritten whole: no stale block id past the kept ones
                self.input_batch.block_table.clear_row(row)
                self.input_batch.block_table.add_row(state.block_ids, row)

    def _trikv_copy_on_write(self, rounds) -> None:
        """Before the step's rounds: copy every block a round would write that another request may read (the
        scheduler's `CompactionOp.copies`: shared or cached) into the fresh block the scheduler gave the request, and
        put the copy in its place in the request's block list, so the round reads and writes the copy and the original
        keeps the contents its hash names. All copies run before any round: a round of this step may read an original
        (never a fresh block: the scheduler takes them before it returns any block to the pool)."""
        from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
        from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

        copies = []
        for op in rounds:
            if op.copies:
                ids = self.requests[op.request_id].block_ids[self._trikv_group]
                replaced = dict(op.copies)
                ids[:] = [replaced.get(block, block) for block in ids]
                copies += [KVCacheBlockCopy(src_block_id=old, dst_block_id=new) for old, new in op.copies]
        if copies:  # vLLM's own block copy (its prefix-cache copy-on-write), over the full-attention layers
            copy_kv_cache_blocks_inplace(self._trikv_caches, self.kv_cache_config.num_blocks, copies)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if self._trikv_offsets:
            self._trikv_shift(scheduler_output.total_num_scheduled_tokens)
        return result

    def _build_attention_metadata(self, *args, **kwargs):
        """vLLM's, with the step's microbatch slices at hand for the full-attention group's metadata wrapper
        (`_physical_metadata`): vLLM passes them to this method alone (keyword `ubatch_slices`)."""
        self._trikv_ubatch_slices = kwargs.get("ubatch_slices")
        try:
            return super()._build_attention_metadata(*args, **kwargs)
        finally:
            self._trikv_ubatch_slices = None

    def _trikv_shift(self, total_tokens: int) -> None:
        """KV slots of the new tokens of compacted requests in physical terms, in the full-attention group's block
        table (positions stay logical); the sequence lengths follow in that group's metadata (`_physical_metadata`)."""
        num_reqs = self.input_batch.num_reqs
        offsets = torch.tensor([self._trikv_offsets.get(rid, 0) for rid in self.input_batch.req_ids[:num_reqs]], dtype=torch.int64)
        if not bool(offsets.any()):
            return
        self._trikv_row_offsets = offsets
        token_offsets = upload(offsets, self.positions.device)[self.req_indices.gpu[:total_tokens].long()]  # [tokens]
        physical = self.positions[:total_tokens] - token_offsets
        # written in place into the group's persistent slot-mapping buffer (what the KV writes read)
        self.input_batch.block_table[self._trikv_group].compute_slot_mapping(
            num_reqs, self.query_start_loc.gpu[: num_reqs + 1], physical)

    def _on_request_state_removed(self, req_id, req_state) -> None:
        if self.trikv_compactor is not None:
            self.trikv_compactor.forget(req_id)
        super()._on_request_state_removed(req_id, req_state)


def kernel_block_ids(block_ids: list[int], per_block: int, stride: int) -> list[int]:
    """The kernel blocks of KV cache blocks `block_ids`, in order, where the attention backend splits each block
    into `per_block` kernel blocks (vLLM's `AttentionGroup.map_to_kernel_block_table`: kernel block j of block b is
    b x stride + j); the tokens of block b's slot o are at kernel block b x stride + o // kernel size, as vLLM's KV
    write places them."""
    return [block * stride + part for block in block_ids for part in range(per_block)]


def _physical_metadata(attn_group, runner) -> None:
    """Wrap the metadata building of an attention group of the full-attention KV cache group: a compacted
    request's sequence length there is its physical entry count (logical - offset); the other groups build
    theirs from vLLM's logical lengths.

    With microbatching (`--enable-dbo`, `ubatch_size > 1`) vLLM builds each microbatch's metadata from a slice of
    the step's (`split_attn_metadata`): its row i is the step's row `request_slice.start + i`, so the offsets are
    taken from there (`_microbatch_first_row`), not from the step's first row.

    vLLM's `_build_attention_metadata` caches the metadata it built under (KV spec, builder type), with no
    microbatch index, and hands a builder that `supports_update_block_table` (FlashAttention's) the cached one with
    another block table instead of building again: microbatch 1 would get microbatch 0's sequence lengths without
    passing through this wrapper. So this group's builders do not take that shortcut (each builds its own metadata
    through the wrapper; the shortcut only saves a build for another group of the same spec, which trikv's one
    full-attention group never has)."""
    build = attn_group.build_metadata
    for builder in getattr(attn_group, "metadata_builders", ()):
        builder.supports_update_block_table = False  # an instance attribute, as vLLM's own Mamba builders set it

    def build_physical(common_attn_metadata, ubatch_idx: int = 0, *args, **kwargs):
        offsets = getattr(runner, "_trikv_row_offsets", None)
        if offsets is not None:
            rows = common_attn_metadata.num_reqs
            first = _microbatch_first_row(runner, ubatch_idx)
            shift = torch.zeros(rows, dtype=torch.int64)  # padded rows past the step's requests: no offset
            mine = offsets[first : first + rows]
            shift[: len(mine)] = mine
            seq_lens = common_attn_metadata.seq_lens - upload(shift, common_attn_metadata.seq_lens.device).to(
                common_attn_metadata.seq_lens.dtype)
            upper = common_attn_metadata.seq_lens_cpu_upper_bound
            if upper is not None:
                upper = upper - shift.to(upper.dtype)
            common_attn_metadata = replace(common_attn_metadata, seq_lens=seq_lens, seq_lens_cpu_upper_bound=upper,
                                           max_seq_len=int(upper.max()) if upper is not None else int(seq_lens.max()))
        return build(common_attn_metadata, ubatch_idx, *args, **kwargs)

    attn_group.build_metadata = build_physical


def _microbatch_first_row(runner, ubatch_idx: int) -> int:
    """The step's row of the first request of microbatch `ubatch_idx` (0 without microbatching): the start of its
    request slice, as vLLM's `split_attn_metadata` cut it (a request split across two microbatches is the first
    row of the second one too)."""
    slices = getattr(runner, "_trikv_ubatch_slices", None)
    if not slices:
        return 0
    return slices[ubatch_idx].request_slice.start


class _UnitScales:
    """An attention layer as its KV write sees it, with key and value scales of 1 (every attribute else the layer's
    own): the codes `PageCodec.learn` writes through a quantising KV write then land exactly in the fp8 format,
    whatever scales the layer has (vLLM's CPU kernel rounds toward zero: 3 / 0.7 x 0.7 need not come back as 3)."""

    def __init__(self, layer):
        self._layer = layer
        self._k_scale = self._v_scale = torch.ones_like(layer._k_scale)
        self._k_scale_float = self._v_scale_float = 1.0
        self._k_scale_cpu = self._v_scale_cpu = torch.ones((), dtype=torch.float32)

    def __getattr__(self, name):
        return getattr(self._layer, name)


_RUNNER_CLASSES: dict[type, type] = {}


def bounded_runner_class(runner_class: type) -> type:
    if runner_class not in _RUNNER_CLASSES:
        _RUNNER_CLASSES[runner_class] = type(f"BoundedKV{runner_class.__name__}", (BoundedKVRunner, runner_class), {})
    return _RUNNER_CLASSES[runner_class]


class TriKVWorker(_PlatformWorker):
    """vLLM's worker for this platform with a bounded KV cache per request (settings in
    `additional_config["trikv"]`; without them it behaves exactly as vLLM's own worker)."""

    def init_device(self):
        self.trikv = BoundedKVSettings.from_config(self.vllm_config.additional_config)
        if self.trikv is not None:  # workers start before the scheduler: refuse bad settings before loading weights
            check_model(self.vllm_config.model_config.hf_config, self.trikv, self.vllm_config.model_config.model)
            # a drafter's layers join the KV cache groups the pages are learnt from: refuse it here, with its reason
            if (speculation := speculation_problem(self.vllm_config.speculative_config)) is not None:
                raise UnsupportedEngineError(f"trikv cannot run with this vLLM configuration: {speculation}")
        super().init_device()
        if self.trikv is None:
            return
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if not isinstance(self.model_runner, GPUModelRunner):
            raise RuntimeError(
                f"trikv supports vLLM's V1 model runner, not {type(self.model_runner).__module__}."
                f"{type(self.model_runner).__name__}; "
                "set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        self.model_runner.__class__ = bounded_runner_class(type(self.model_runner))

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        if getattr(self, "trikv", None) is not None:
            self.model_runner.trikv_bind(self._trikv_compactor())

    def determine_available_memory(self) -> int:
        """vLLM's KV pool size less what trikv holds on accelerators, so that the memory profile stays true: the
        rounds' workspace and the kept positions of up to `max_num_seqs` compacted requests (on CPU the KV space
        is a fixed setting and rounds use ordinary host memory)."""
        available = super().determine_available_memory()
        if getattr(self, "trikv", None) is None or current_platform.is_cpu():
            return available
        reserved = trikv_reserved_bytes(self.trikv, self.vllm_config)
        log.info("trikv: %.0f MiB of the KV pool reserved for compaction rounds (round_workspace_bytes %.0f MiB) and the "
                 "kept positions of %d requests", reserved / 2**20, self.trikv.round_workspace_bytes / 2**20,
                 self.vllm_config.scheduler_config.max_num_seqs)
        return max(0, available - reserved)

    def initialize_from_config(self, *args, **kwargs):
        super().initialize_from_config(*args, **kwargs)
        if getattr(self, "trikv", None) is not None:
            problem = graph_mode_problem(self.vllm_config.compilation_config)  # as the model runner resolved it
            if problem is not None:
                raise UnsupportedEngineError(f"trikv cannot run with this vLLM configuration: {problem}")
            shape = config_shape(self.vllm_config.model_config.hf_config)
            kv_heads = local_kv_heads(shape.num_kv_heads, *_tp())
            self.model_runner.trikv_learn_pages(shape.cached_layers, len(kv_heads), shape.head_dim)
            runner = self.model_runner
            codec = runner._trikv_codecs[0]
            block = codec.block_size * runner._trikv_kernel_blocks[0]  # the KV cache manager's block
            entries = request_bound(self.trikv, self.trikv.largest_request_budget, block, self.vllm_config)
            check_round_floor(runner.trikv_compactor, runner._trikv_caches[0], codec, len(shape.cached_layers), entries)

    def _trikv_compactor(self) -> Compactor:
        settings = self.trikv
        hf_config = self.vllm_config.model_config.hf_config
        shape = config_shape(hf_config)
        rank, world = _tp()
        kv_heads = local_kv_heads(shape.num_kv_heads, rank, world)
        local_shape = replace(shape, num_heads=len(kv_heads) * shape.group_size, num_kv_heads=len(kv_heads))
        stats = load_stats(settings.stats) if settings.needs_stats else None
        policy = settings.make_policy(stats)
        if hasattr(policy, "bind_geometry"):
            query_heads = torch.cat([torch.arange(g * shape.group_size, (g + 1) * shape.group_size) for g in kv_heads])
            policy.bind_geometry(RopeGeometry.from_config(hf_config), local_shape, query_heads)
            accelerate(policy)  # the same scores without per-element index copies
        return Compactor(policy, settings.protect_prompt, settings.min_decode_room, record=settings.record_rounds,
                         round_workspace_bytes=settings.round_workspace_bytes)

    # ---- reports, through `LLM.collective_rpc` --------------------------------------------------------
    def trikv_rounds(self, clear: bool = False) -> list:
        """Every round this worker ran since the last clear (kept positions only with `record_rounds`)."""
        compactor = getattr(self.model_runner, "trikv_compactor", None)
        if compactor is None:
            return []
        records = list(compactor.records)
        if clear:
            compactor.records.clear()
        # plain lists: collective_rpc's serialiser does not carry tensors inside dicts
        return [{**vars(record), "kept_positions": None if record.kept_positions is None else record.kept_positions.tolist()}
                for record in records]

    def trikv_stats(self) -> dict:
        """Rounds and time spent compacting on this worker; the most requests running at once, the most
        full-attention KV blocks one bounded request held in a step (`max_request_blocks`: at most its bound's) and
        the preemptions so far, as the scheduler reported them; how many requests were compacted, the ids of
        those running now with a compacted cache (finished and aborted requests are dropped, so the map stays
        bounded), and how many kept states (session reuse) this worker holds kept positions for."""
        compactor = getattr(self.model_runner, "trikv_compactor", None)
        if compactor is None:
            return {}
        return {"rounds": compactor.rounds, "seconds": compactor.seconds, "max_running": compactor.max_running,
                "max_request_blocks": compactor.max_request_blocks, "preemptions": compactor.preemptions,
                "compacted_requests": compactor.compacted_requests,
                "compacted_running": sorted(set(compactor.kept_positions) - compactor.kept_states),
                "kept_states": len(compactor.kept_states)}


def trikv_reserved_bytes(settings: BoundedKVSettings, vllm_config, kv_heads: int | None = None) -> int:
    """Accelerator bytes trikv holds beside vLLM's KV pool on one worker (`kv_heads`: its KV heads, default this
    tensor-parallel rank's): the rounds' workspace, and the kept positions of `max_num_seqs` compacted requests and
    of the kept states (session reuse) at the largest budget a request may have."""
    shape = config_shape(vllm_config.model_config.hf_config)
    heads = kv_heads if kv_heads is not None else len(local_kv_heads(shape.num_kv_heads, *_tp()))
    budget = max(settings.budget, settings.max_request_budget or 0)
    state = request_state_bytes(len(shape.cached_layers), heads, budget)
    states = vllm_config.scheduler_config.max_num_seqs + settings.kept_sessions(vllm_config.scheduler_config.max_num_seqs)
    return settings.round_workspace_bytes + states * state


def check_round_floor(compactor: Compactor, cache: torch.Tensor, codec: PageCodec, layers: int, entries: int) -> None:
    """Refuse a round workspace smaller than the smallest chunk a round over `entries` entries per (layer, KV head)
    needs (the worker passes trikv's bound at the largest request budget: no round sees more)."""
    slots = -(-entries // codec.block_size) * codec.block_size
    floor = compactor.floor_bytes(layers, codec.num_heads, slots, codec.head_dim, codec.key_bytes(cache),
                                  codec.plan(cache).index_bytes_per_slot)
    if floor > compactor.round_workspace_bytes:
        raise SettingsError(
            f"round_workspace_bytes {compactor.round_workspace_bytes:,} is below what one compaction round of a request "
            f"holding {entries} entries needs at the least ({floor:,} bytes: one chunk of what "
            f"{type(compactor.policy).__name__} cannot split further, over {slots} slots): raise round_workspace_bytes "
            f"to at least {floor:,} or lower the bound (budget, divide_length, prefill_chunk_size)")


def local_kv_heads(num_kv_heads: int, rank: int, world: int) -> list[int]:
    """Global indices of the KV heads tensor-parallel rank `rank` of `world` holds (vLLM's QKVParallelLinear:
    contiguous slices while world <= heads, else each head replicated on world / heads ranks)."""
    if world <= num_kv_heads:
        if num_kv_heads % world:
            raise ValueError(f"{num_kv_heads} KV heads do not divide over {world} tensor-parallel ranks")
        per_rank = num_kv_heads // world
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank // (world // num_kv_heads)]


def _tp() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

