"""A bounded KV cache for transformers' `generate()` and plain forward loops: the transformers adapter.

`CompressedCache` is a transformers `Cache` that keeps its keys and values in a store (`trikv.stores`: one
buffer for all layers, or per-layer packed regions), runs the round schedule (`schedule.py`) and asks the
policy which entries to keep.

Schedule: entries are appended in place; when a row reaches budget + divide_length entries per (layer, KV
head), the policy scores all layers at once and the cache keeps the top `budget` per (layer, row, KV head),
in original order. The round runs in a forward pre-hook of the decoder, before transformers builds the
attention mask, so the mask sizes it reads (`get_mask_sizes`) are already those of the compressed cache.
Positions stay logical: `get_seq_length()` counts every token seen, and RoPE uses it.

Hybrid models (Gemma-3, GPT-OSS): the store and the policy cover the full-attention layers only
(`ModelShape.cached_layers`); each sliding-window layer keeps transformers' own `DynamicSlidingWindowLayer`
(its window, nothing scored), and its forwards use the stock attention and masks.

Batches: each row follows its own schedule, exactly as if it were generated alone: a row is compressed
when *its* live entries reach budget + divide_length. Rows share the physical length (the largest live
count), so a row compressed earlier than the others holds dead slots (position -1) until the others
catch up; left-padding slots are dead from the start. Attention masks dead slots through trikv's
attention functions (`attention.py`), which the cache switches the model to.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .architectures import ModelShape, UnsupportedModelError, attention_sinks, decoder, model_shape
from .attention import park_attention_state, unclaimed_attention_state, use_trikv_attention
from .compat import cache_argument
from .policies import Policy, ScoringContext
from .policies.base import CompactionContext, ObservationContext
from .query_capture import QueryWindow, install_query_tap, take_query, want_queries
from .fast import accelerate, spread_step
from .schedule import RoundSchedule
from .selection import prompt_fits, protected_entries, top_entries
from .settings import (DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH, DEFAULT_MIN_DECODE_ROOM, DEFAULT_PREFILL_CHUNK_SIZE, CacheSettings,
                       check_prefill_chunk_size, check_recent_window, is_default, peak_entries_bound)
from .stores import PackedStore, UniformStore
from .validation import integer

log = logging.getLogger(__name__)


class _LayerView(CacheLayerMixin):
    """Per-layer face of CompressedCache, for the parts of transformers that iterate `cache.layers`."""

    is_sliding = False
    supports_early_init = False

    def __init__(self, parent: "CompressedCache", layer_idx: int):
        super().__init__()
        self.parent, self.layer_idx = parent, layer_idx

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.parent.update(key_states, value_states, self.layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.parent.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.parent.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def reset(self):
        pass

    def reorder_cache(self, beam_idx):
        pass

    @property
    def keys(self):
        return self.parent.stored_keys(self.layer_idx)

    @keys.setter
    def keys(self, value):
        pass

    @property
    def values(self):
        return self.parent.stored_values(self.layer_idx)

    @values.setter
    def values(self, value):
        pass


class CompressedCache(Cache):
    """KV cache that keeps at most `budget` (+ `divide_length` slack) entries per (layer, row, KV head).

    Args:
        model: the transformers causal LM this cache serves (validated; a pre-hook is attached once).
        policy: a `Policy` instance or a registered method name (`trikv methods` lists them).
        budget: entries per (layer, KV head) right after a compression round. `None` = never evict.
        divide_length: slack beta; a round runs when the cache reaches budget + divide_length (default 128).
        protect_prompt: keep prompt tokens out of the competition (default True) as long as they leave at
            least `min_decode_room` slots for generated tokens; otherwise the prompt competes too.
        min_decode_room: slots of the budget reserved for generated tokens when the prompt is protected.
        prefill_chunk_size: the most tokens one forward should add (default 512). `trikv.generate` feeds a prompt
            that would take the cache past budget + divide_length in chunks of this size, a round running between
            chunks whenever the cache reaches budget + divide_length, so the cache never holds more than
            budget + divide_length + prefill_chunk_size entries per (layer, row, KV head). `model.generate` does
            the same with no further argument: a bounded cache sets the model's
            `generation_config.prefill_chunk_size` to its own (unless the user set one; `chunk_model_generate`).
            A longer forward on a bounded cache runs (it holds all its tokens at once) and warns once.
        layout: "uniform" (one physical length for every layer and head, `stores.UniformStore`) or "packed"
            (per-(layer, head) lengths, `stores.PackedStore`); default: packed for policies with per-layer /
            per-head budgets (PyramidKV, Ada-KV), uniform otherwise.
        policy_options: options forwarded to the policy when `policy` is a name.

    A cache holds one conversation, for the model it was made for. transformers' `generate()` treats the
    tokens a cache already holds as the prefix of its input: pass a new cache (or call `reset()`) for every
    unrelated `model.generate(...)`; `trikv.generate` refuses a cache that holds tokens. Buffers grow with the
    sequence, up to budget + divide_length slots, so a huge budget costs nothing until it is used.
    """

    is_compileable = False

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy | str = "triattention",
        budget: int | None = DEFAULT_BUDGET,
        divide_length: int = DEFAULT_DIVIDE_LENGTH,
        protect_prompt: bool = True,
        min_decode_room: int = DEFAULT_MIN_DECODE_ROOM,
        layout: str | None = None,
        prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE,
        **policy_options,
    ):
        if layout not in (None, "uniform", "packed"):
            raise ValueError(f"layout must be 'uniform' or 'packed', got {layout!r}")
        self.shape: ModelShape = model_shape(model)
        # model layer -> its index in the store (bounded layers); the other layers slide
        self.store_index = {layer: index for index, layer in enumerate(self.shape.cached_layers)}
        self.settings: CacheSettings | None = None  # None for a policy instance (it need not be registered)
        if isinstance(policy, str):  # validated as every backend validates its settings
            stats = policy_options.pop("stats", None)
            self.settings = CacheSettings(policy, budget, divide_length, protect_prompt, min_decode_room, stats, policy_options,
                                          prefill_chunk_size)
            policy = self.settings.make_policy(self.settings.stats)
            budget = self.settings.budget
        elif policy_options:
            raise ValueError(f"policy options {sorted(policy_options)} given with a policy instance")
        self.policy = policy
        if policy.compacts and attention_sinks(model) is not None:
            raise UnsupportedModelError(
                f"{policy.name} fits values and log-biases to the model's softmax, which on this model also holds "
                "attention sinks (GPT-OSS); attention matching with sinks is not implemented: use an eviction method"
            )
        if not policy.evicts:
            if budget is not None and not is_default(budget):
                raise ValueError(f"method {policy.name!r} keeps every entry and takes no budget (got budget={budget!r})")
            budget = None
        budget = None if budget is None else integer("budget", budget)
        explicit_slack = not is_default(divide_length)
        divide_length = integer("divide_length", divide_length)
        min_decode_room = integer("min_decode_room", min_decode_room, minimum=0)
        scheduled = policy.configure(budget, divide_length)  # a method's paper schedule may set its own slack
        if explicit_slack and budget is not None and scheduled != divide_length:
            raise ValueError(
                f"{policy.name} runs its paper's schedule (a round every {scheduled} tokens) and ignores "
                f"divide_length={divide_length}; pass schedule='shared' (or use its '-shared' registry entry) for "
                "rounds at budget + divide_length, or leave divide_length out"
            )
        divide_length = scheduled
        check_recent_window(policy.name, policy.recent_window, budget)
        self.budget = budget
        self.divide_length = divide_length
        self.schedule = RoundSchedule(budget, divide_length)
        self.protect_prompt = protect_prompt
        self.min_decode_room = min_decode_room
        self.prefill_chunk_size = check_prefill_chunk_size(prefill_chunk_size)
        if budget is not None:
            chunk_model_generate(model, self.prefill_chunk_size)
        self.store = self._make_store(layout)
        self.layout = self.store.layout
        policy.bind(model, self.shape)
        accelerate(policy)  # the fast TriAttention scorer (same scores, no per-element index copies)
        # post-RoPE queries of the last `policy.query_window` tokens, for attention scores
        self.query_window = QueryWindow(policy.query_window, len(self.store_index)) if policy.query_window > 0 else None
        if self.query_window is not None:
            install_query_tap(model)
        super().__init__(layers=self._make_layers())
        attach(model)
        self._decoder = weakref.ref(decoder(model))  # the model this cache was made for
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self._reset_state()

    def _make_layers(self) -> list:
        """transformers' per-layer view: trikv's bounded layers, and a stock sliding-window layer for each
        sliding layer of a hybrid model."""
        from transformers.cache_utils import DynamicSlidingWindowLayer

        return [_LayerView(self, layer) if layer in self.store_index else DynamicSlidingWindowLayer(self.shape.sliding_window)
                for layer in range(self.shape.num_layers)]

    def sliding_layers(self) -> list:
        """The stock sliding-window layers of a hybrid model (empty otherwise)."""
        return [layer for index, layer in enumerate(self.layers) if index not in self.store_index]

    def _make_store(self, layout: str | None):
        shape, policy = self.shape, self.policy
        num_layers = len(self.store_index)
        slot_state = policy.observes or policy.compacts or type(policy).after_round is not Policy.after_round
        if layout is None:  # per-layer / per-head budgets store only the entries each (layer, head) keeps
            layout = "packed" if self.budget is not None and policy.variable_budgets and not slot_state else "uniform"
        if layout == "uniform":
            return UniformStore(num_layers, shape.num_kv_heads, shape.head_dim, with_biases=policy.compacts)
        if self.budget is None:
            raise ValueError("the packed layout is for evicting caches; give a budget")
        if slot_state:
            raise ValueError(
                f"{policy.name} keeps per-slot state (observe / after_round / compact), which the packed layout "
                "does not carry; use layout='uniform'"
            )
        return PackedStore(num_layers, shape.num_kv_heads, shape.head_dim, self.divide_length)

    # ---- state --------------------------------------------------------------------------------
    def _reset_state(self) -> None:
        self.store.reset()
        self.seen = 0  # logical tokens processed, padding included (the mask's column count)
        self.pad_lengths: torch.Tensor | None = None  # [b]
        self.prompt_length = 0  # logical tokens before the first single-token step
        self.decoding = False
        self.rounds = 0
        self.scoring_seconds = 0.0
        self.compaction_seconds = 0.0  # time in policy.compact (included in scoring_seconds)
        self.observe_seconds = 0.0  # time in per-step policy statistics (H2O, LazyEviction, ...)
        self._prompt_dropped_logged = False
        self._warned_positions = False
        self._warned_long_forward = False
        self._next_forward_tokens = 1  # tokens of the forward about to run (the buffers keep room for them)
        self.pending_tokens: torch.Tensor | None = None  # [b] sampled last by trikv.generate, not yet fed (continue_cache)
        self.pending_at = -1  # `seen` when pending_tokens was recorded (another feed makes it stale)
        self._forward_announced = False  # before_forward ran for the forward now writing to the cache
        self._observe_pending = False  # the last forward was one token: observe it before the next one
        self.tokens: torch.Tensor | None = None  # [b, >= seen] long: token id by logical index (needs_tokens)
        self.schedule.reset()
        if getattr(self, "query_window", None) is not None:
            self.query_window.reset()
        self.policy.reset()
        if getattr(self, "layers", None):
            self.layers = self._make_layers()  # fresh sliding-window layers

    def reset(self):
        """Forget every token: the cache can serve a new, unrelated generation."""
        self._reset_state()

    def check_model(self, base: torch.nn.Module) -> None:
        """Refuse a decoder other than the one of the model this cache was made for (its shape, statistics and
        hooks belong to that model)."""
        if self._decoder() is not base:
            raise ValueError(
                "this trikv cache was made for another model; make one cache per model "
                "(trikv.make_cache(model, ...) with the model you run)"
            )

    # ---- sizes (the store's) ------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Entries per (layer, row, KV head) the schedule counts (uniform: the physical length P)."""
        return self.store.length

    @property
    def capacity(self) -> int:
        return self.store.capacity

    @property
    def batch_size(self) -> int:
        return self.store.batch_size

    @property
    def device(self) -> torch.device | None:
        return self.store.device

    @property
    def peak_length(self) -> int:
        return self.store.peak_length

    def stored_keys(self, layer: int) -> torch.Tensor | None:
        """Keys of one bounded model layer as attention sees them: [b, Hkv, P, D] (uniform), [b, 1, S, D]
        (packed); None before the first forward."""
        return self.store.stored_keys(self.store_index[layer])

    def stored_values(self, layer: int) -> torch.Tensor | None:
        return self.store.stored_values(self.store_index[layer])

    def visible_positions(self) -> torch.Tensor:
        """[L, b, Hkv, P] long: RoPE position of every stored entry per (layer, row, KV head), -1 = dead slot."""
        return self.store.visible_positions()

    def live_counts(self) -> torch.Tensor:
        """[b] live entries per row (mean over layers and KV heads: they differ only with variable budgets)."""
        return self.store.live_counts()

    def entries(self) -> int:
        """Entries per (layer, row, KV head) (packed: mean over layers and heads)."""
        return self.store.entries()

    def sliding_bytes(self) -> int:
        """Bytes of K/V the sliding-window layers of a hybrid model hold (each at most its window)."""
        return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.sliding_layers()
                   if getattr(layer, "is_initialized", False))

    def memory_bytes(self) -> int:
        """Bytes of K/V that are live (entries x layers x rows x heads x head_dim x 2 x element size), the
        sliding-window layers of a hybrid model included."""
        return self.store.memory_bytes() + self.sliding_bytes()

    def peak_memory_bytes(self) -> int:
        """Largest `memory_bytes()` so far (a sliding layer only grows, up to its window)."""
        return self.store.peak_memory_bytes() + self.sliding_bytes()

    def allocated_bytes(self) -> int:
        """Bytes the K/V buffers occupy, spare slots included."""
        return self.store.allocated_bytes() + self.sliding_bytes()

    def _target_capacity(self, query_length: int = 1) -> int | None:
        """Slots per (layer, row, KV head) the buffers keep before a forward of `query_length` tokens: what the next
        round needs, plus a prefill chunk's tokens past the trigger when the forward is a chunk (None: unbounded,
        the buffers double). A chunked prefill's rounds then compact in place; the first decode round shrinks the
        buffers back."""
        if self.budget is None:
            return None
        chunk_room = query_length - 1 if query_length > 1 and self.length > 0 else 0  # a later chunk of a prefill
        return self.schedule.capacity() + chunk_room

    def reserve(self, entries: int, batch: int, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        """Preallocate `entries` slots per (layer, row, KV head), e.g. prompt + max_new_tokens for full attention,
        whose buffers otherwise double as they fill. Before the first forward (with its batch size), or to grow."""
        self.store.reserve(entries, batch, dtype, device, self._target_capacity())

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if layer_idx not in self.store_index:  # a sliding layer sizes its own window
            return self.layers[layer_idx].get_mask_sizes(query_length)
        # stored slots map to mask columns [seen - P, seen), new tokens to [seen, seen + q)
        return self.length + query_length, self.seen - self.length

    # ---- the forward pre-hook -----------------------------------------------------------------
    def before_forward(self, query_length: int, attention_mask: torch.Tensor | None) -> None:
        """Record padding on the first forward; run a compression round when one is due."""
        self._forward_announced = True
        if self.seen == 0:
            self._read_padding(attention_mask)
        elif not self.decoding and self.pad_lengths is not None and int(self.pad_lengths.max()) == self.seen:
            self._extend_padding(attention_mask)  # a chunked prefill: a row all padding so far may pad on
        if query_length == 1 and self.seen > 0:
            self.decoding = True
        self._check_forward_length(query_length)
        if self.query_window is not None:
            want_queries(True)
            if self._observe_pending:
                self._observe_last_token()
        self._next_forward_tokens = query_length
        if self.schedule.due(self.length):
            self.compress()
        if query_length == 1 and self.decoding and self.budget is not None:  # score ahead, spread
            started = time.perf_counter()
            spread_step(self)
            self.scoring_seconds += time.perf_counter() - started

    @property
    def peak_bound(self) -> int | None:
        """The most entries per (layer, row, KV head) the cache holds when no forward adds more than
        `prefill_chunk_size` tokens: budget + divide_length + prefill_chunk_size (None: unbounded)."""
        return None if self.budget is None else peak_entries_bound(self.budget, self.divide_length, self.prefill_chunk_size)

    def chunk_bounds(self, new_tokens: int) -> list[tuple[int, int]]:
        """[start, stop) of each forward that feeds `new_tokens` tokens after what the cache holds: one forward
        when no round can fall due inside it, otherwise chunks of `prefill_chunk_size` (a round runs before any
        chunk that finds the cache at budget + divide_length). No chunk is a single token (it would be taken
        for a decode step): a last chunk of one token takes one from the chunk before it."""
        if self.budget is None or self.length + new_tokens <= self.budget + self.divide_length or new_tokens <= self.prefill_chunk_size:
            return [(0, new_tokens)]
        starts = list(range(0, new_tokens, self.prefill_chunk_size))
        if new_tokens - starts[-1] == 1:
            starts[-1] -= 1
        return list(zip(starts, starts[1:] + [new_tokens]))

    def _check_forward_length(self, query_length: int) -> None:
        """Warn once when one forward takes a bounded cache past its bound (a long prompt fed whole)."""
        if self.budget is None or self._warned_long_forward or query_length <= self.prefill_chunk_size:
            return
        if self.length + query_length <= self.peak_bound:
            return
        self._warned_long_forward = True
        warnings.warn(
            f"a forward of {query_length} tokens on a trikv cache bounded at budget {self.budget} + divide_length "
            f"{self.divide_length} holds all of them at once ({self.length + query_length} entries per (layer, KV head), "
            f"over the bound of {self.peak_bound} that chunks of prefill_chunk_size={self.prefill_chunk_size} keep): "
            f"feed long prompts in chunks, e.g. model.generate(..., prefill_chunk_size={self.prefill_chunk_size}) or "
            "trikv.generate, which chunks them itself",
            stacklevel=3,
        )

    def _extend_padding(self, attention_mask: torch.Tensor | None) -> None:
        """A later prompt chunk's mask (past + current columns) continues the left padding of rows that were all
        padding in the chunks before it."""
        if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[1] <= self.seen:
            return
        mask = attention_mask.bool()
        pads = (~mask).long().cumprod(-1).sum(-1).to(self.pad_lengths.device)
        if bool((mask.long().sum(-1) != mask.shape[-1] - pads).any()):
            raise ValueError("trikv caches need left padding (padding_side='left'): found padding after real tokens")
        if bool(((pads != self.pad_lengths) & (self.pad_lengths < self.seen)).any()):
            raise ValueError("the attention mask of a prompt chunk disagrees with the padding of the chunks before it")
        self.pad_lengths = pads
        self._max_pad = int(pads.max())
        if self.schedule.base is None:  # no round yet: the earliest-due row is the least padded
            self.schedule.start(pads)

    def _read_padding(self, attention_mask: torch.Tensor | None) -> None:
        if attention_mask is None or attention_mask.dim() != 2:
            self.pad_lengths = None
            return
        mask = attention_mask.bool()
        pads = (~mask).long().cumprod(-1).sum(-1)  # leading zeros per row
        if bool((mask.long().sum(-1) != mask.shape[-1] - pads).any()):
            raise ValueError("trikv caches need left padding (padding_side='left'): found padding after real tokens")
        self.pad_lengths = pads
        self._max_pad = int(pads.max())
        self.schedule.start(pads)

    # ---- update: append in place ------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [b, Hkv, q, D] post-RoPE
        if layer_idx == 0:
            self._begin_forward(key_states)
        index = self.store_index.get(layer_idx)
        if index is None:  # a sliding layer of a hybrid model: transformers' own window, stock attention
            if self.query_window is not None:
                take_query()  # its query is not recorded
            return self.layers[layer_idx].update(key_states, value_states)
        stored_keys, stored_values, state = self.store.append(index, key_states, value_states)
        if self.query_window is not None:
            self._record_queries(index, key_states.shape[-2], stored_keys.shape[-2])
        attention_kwargs = kwargs.get("kwargs")
        if attention_kwargs is not None:  # read by trikv_sdpa / trikv_eager / the lean engine
            attention_kwargs.update(state)
        else:  # transformers < 5.24 passes no kwargs dict to update()
            park_attention_state(stored_keys, state)
        return stored_keys, stored_values

    def _begin_forward(self, key_states: torch.Tensor) -> None:
        b, _, q, _ = key_states.shape
        if not self._forward_announced:  # only the model this cache was made for runs its pre-hook
            raise ValueError(
                "this trikv cache was made for another model (its forward pre-hook did not run); make one cache "
                "per model (trikv.make_cache(model, ...) with the model you run)"
            )
        self._forward_announced = False
        if self.schedule.due(self.length):
            raise RuntimeError(
                "a compression round is due but the trikv pre-hook did not run; "
                "use the cache with the model it was created for"
            )
        self._new_positions = self._new_token_positions(b, q, key_states.device)  # [b, q]
        writes_padding = self.pad_lengths is not None and self.seen < self._max_pad
        self.store.begin(self._new_positions, key_states.dtype, key_states.device, self._target_capacity(q), writes_padding)
        if not self.decoding and q >= 1:
            self.prompt_length = self.seen + q
        self.seen += q
        if self.max_positions and self.seen > self.max_positions and not self._warned_positions:
            log.warning("the sequence passed %d tokens, the model's trained positions (max_position_embeddings); "
                        "its outputs past that point are not what it was trained for", self.max_positions)
            self._warned_positions = True

    def _new_token_positions(self, batch: int, q: int, device) -> torch.Tensor:
        """[b, q] RoPE positions of the q tokens about to be appended: logical index minus the row's padding, -1 on pads."""
        logical = torch.arange(self.seen, self.seen + q, device=device)
        positions = logical[None, :] - self._pads(batch, device)[:, None]
        return positions.masked_fill(positions < 0, -1)

    def _pads(self, batch: int, device) -> torch.Tensor:
        if self.pad_lengths is None:
            return torch.zeros(batch, dtype=torch.long, device=device)
        return self.pad_lengths.to(device)

    # ---- compression round --------------------------------------------------------------------
    def current_positions(self) -> torch.Tensor:
        """[b] tokens seen by each row, padding excluded (the RoPE position of the next token)."""
        return self.seen - self._pads(self.batch_size, self.device)

    def prompt_protected(self) -> torch.Tensor | None:
        """[b] bool: rows whose prompt is kept out of the competition (the same rule for every method: prompt +
        min_decode_room <= budget); None before the first forward or for a cache that never evicts."""
        if self.budget is None or self.batch_size < 0:
            return None
        prompt_real = self.prompt_length - self._pads(self.batch_size, self.device)  # [b]
        return prompt_fits(prompt_real, self.budget, self.min_decode_room) & (self.protect_prompt and self.prompt_length > 0)

    def _protected(self, positions: torch.Tensor) -> torch.Tensor:
        """[L, b, Hkv, N] bool: prompt tokens (while protection holds) and the recent window."""
        t = self.current_positions()  # [b]
        prompt_real = self.prompt_length - self._pads(t.shape[0], t.device)  # [b]
        protect_prompt = self.protect_prompt and self.prompt_length > 0
        if protect_prompt and not self._prompt_dropped_logged and not bool(self.prompt_protected().all()):
            log.warning(
                "the prompt (%s tokens so far: a long prompt is counted chunk by chunk) leaves fewer than %d of the %d "
                "budget slots for generated tokens: the prompt competes for the budget too",
                prompt_real.tolist(), self.min_decode_room, self.budget,
            )
            self._prompt_dropped_logged = True
        return protected_entries(positions, t, prompt_real, self.budget, self.policy.recent_window, self.min_decode_room,
                                 protect_prompt)

    @torch.no_grad()
    def compress(self) -> None:
        """Compress every row whose live entries reached budget + divide_length to the top-`budget` (the buffers
        keep room for the forward about to run: a prefill chunk's tokens, or one).

        The policy scores every layer at once on the store's view; kept entries stay in original order. Rows not
        yet due keep everything; in the uniform layout the physical length becomes the largest live count, so
        due rows carry dead slots until the others are compressed too.
        """
        started = time.perf_counter()
        budget = self.budget
        live = self.live_counts()  # [b]
        due, base = self.schedule.rows_due(live)  # [b]
        if not bool(due.any()):
            return
        view = self.store.scoring_view()
        dead = view.positions < 0
        row_due = due[None, :, None, None]
        protected = self._protected(view.positions) & ~dead
        context = ScoringContext(
            keys=view.keys,
            values=view.values,
            positions=view.positions,
            candidates=~(dead | protected) & row_due,
            current_position=self.current_positions(),
            budget=budget,
            queries=None if self.query_window is None else self.query_window.queries,
            query_positions=None if self.query_window is None else self.query_window.positions,
            protected=protected,
            biases=view.biases,
            tokens=self._position_tokens(),
        )
        scores = self._score_due_rows(context, due)  # [L, b, Hkv, N]
        scores = scores.masked_fill(protected, float("inf")).masked_fill(dead, float("-inf"))
        counts = self.policy.allocate(scores, context) if self.policy.variable_budgets else None
        keep = torch.where(row_due, top_entries(scores, budget, counts) & ~dead, ~dead)  # rows not due keep all live entries

        L, _, h = keep.shape[:3]
        live_after = keep.sum(dim=(0, 2, 3)) // (L * h)  # [b] mean live entries per (layer, head)
        self.schedule.after_round(due, base, live_after, int(keep.sum(-1).max()))
        values = biases = None
        if self.policy.compacts:  # the policy may rewrite kept values and give entries log-biases
            compaction_started = time.perf_counter()
            result = self.policy.compact(CompactionContext(scoring=context, keep=keep))
            if result is not None:
                values, biases = result.values, result.biases
            self.compaction_seconds += time.perf_counter() - compaction_started
        order = self.store.retain(keep, self._target_capacity(self._next_forward_tokens), values=values, biases=biases)
        if order is not None:
            self.policy.after_round(order)  # per-slot policy state follows the kept slots
        self.rounds += 1
        self.scoring_seconds += time.perf_counter() - started

    @property
    def scores_due_rows_only(self) -> bool:
        """A round scores only the rows that are due (the policy's rows score independently)."""
        policy = self.policy
        return policy.scores_rows_independently and not (policy.observes or policy.compacts or policy.variable_budgets)

    def _score_due_rows(self, context: ScoringContext, due: torch.Tensor) -> torch.Tensor:
        """The policy's scores [L, b, Hkv, N] (float32); rows not due get 0 (they keep every live entry).

        Rows of a batch reach the trigger at different steps (prompts differ in length), so scoring every
        row whenever one is due would repeat the work up to once per row; policies whose rows score
        independently are given the due rows only.
        """
        policy = self.policy
        rows = due.nonzero().squeeze(1)
        if not self.scores_due_rows_only or rows.numel() == due.numel():
            return policy.score(context).float()
        L, b, Hkv, N = context.positions.shape
        scores = torch.zeros(L, b, Hkv, N, dtype=torch.float32, device=context.positions.device)
        return scores.index_copy_(1, rows, policy.score(context.rows(rows)).float())

    # ---- generate() plumbing ---------------------------------------------------------------------
    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, max_length: int) -> None:
        if max_length < 0 or max_length < self.seen:
            raise NotImplementedError("a compressed cache cannot be cropped (evicted entries are gone)")

    def _select_rows(self, index: torch.Tensor) -> None:
        if self.batch_size < 0:
            return
        index = index.to(self.device)
        self.store.select_rows(index)
        for layer in self.sliding_layers():
            if getattr(layer, "is_initialized", False):
                layer.reorder_cache(index)
        if self.tokens is not None:
            self.tokens = self.tokens.index_select(0, index.to(self.tokens.device))
        if self.pad_lengths is not None:
            self.pad_lengths = self.pad_lengths.to(index.device).index_select(0, index)
            self._max_pad = int(self.pad_lengths.max())
        if self.query_window is not None:
            self.query_window.select_rows(index)
        self.policy.select_rows(index)
        self.schedule.select_rows(index)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor):
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int):
        if self.batch_size > 0:
            self._select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    def __repr__(self):
        return (
            f"CompressedCache(policy={self.policy.name}, budget={self.budget}, divide_length={self.divide_length}, "
            f"layout={self.layout}, entries={self.length}, seen={self.seen}, rounds={self.rounds})"
        )

    # ---- recent queries and per-step observation --------------------------------------
    @torch.no_grad()
    def _record_queries(self, layer_idx: int, q: int, end: int) -> None:
        """Keep this forward's post-RoPE queries of its q tokens (the tap parked them) and let the policy observe
        prefill; `end` = slots the queries attend."""
        query = take_query()
        if query is None:
            raise RuntimeError(
                f"{self.policy.name} needs the model's queries but trikv's rotary tap saw none; "
                "use the cache with the model it was created for"
            )
        new_positions = self._new_positions  # [b, q]
        self.query_window.record(layer_idx, query, new_positions, self.seen - q)
        if not self.policy.observes:
            return
        if q == 1:
            self._observe_pending = True  # observed for all layers at once before the next forward
        elif self.policy.observe_prefill:  # observing policies run on the uniform store
            started = time.perf_counter()
            store = self.store
            self.policy.observe(
                ObservationContext(
                    layers=slice(layer_idx, layer_idx + 1),
                    queries=query[None],
                    query_positions=new_positions,
                    keys=store.keys[layer_idx : layer_idx + 1, :, :, :end],
                    values=store.values[layer_idx : layer_idx + 1, :, :, :end],
                    positions=store.positions[:, :, :, :end],
                )
            )
            self.observe_seconds += time.perf_counter() - started

    @torch.no_grad()
    def _observe_last_token(self) -> None:
        started = time.perf_counter()
        self._observe_pending = False
        queries, query_positions = self.query_window.latest(1, self.seen)
        view = self.store.scoring_view()
        self.policy.observe(
            ObservationContext(
                layers=slice(None),
                queries=queries,
                query_positions=query_positions,
                keys=view.keys,
                values=view.values,
                positions=view.positions,
            )
        )
        self.observe_seconds += time.perf_counter() - started

    # ---- token ids (policies that segment on them) -----------------------------------------------
    def record_tokens(self, input_ids: torch.Tensor | None, query_length: int) -> None:
        """Remember the token ids of the forward about to run (logical indices seen .. seen + q)."""
        if input_ids is None or input_ids.dim() != 2:
            input_ids = None
        b = input_ids.shape[0] if input_ids is not None else (self.batch_size if self.batch_size > 0 else 1)
        end = self.seen + query_length
        if self.tokens is None or self.tokens.shape[0] != b or self.tokens.shape[1] < end:
            grown = torch.full((b, max(end, 2 * (0 if self.tokens is None else self.tokens.shape[1]), 256)), -1, dtype=torch.long,
                               device=input_ids.device if input_ids is not None else "cpu")
            if self.tokens is not None and self.tokens.shape[0] == b:
                grown[:, : self.seen] = self.tokens[:, : self.seen].to(grown.device)
            self.tokens = grown
        self.tokens[:, self.seen : end] = -1 if input_ids is None else input_ids.to(self.tokens.device)

    def _position_tokens(self) -> torch.Tensor | None:
        """[b, seen] token id at each RoPE position of every row (-1 past the row's length or unknown)."""
        if self.tokens is None:
            return None
        b = self.tokens.shape[0]
        pads = self._pads(b, self.tokens.device)
        index = torch.arange(self.seen, device=self.tokens.device)[None, :] + pads[:, None]
        inside = index < self.seen
        return self.tokens.gather(1, index.clamp_max(max(self.seen - 1, 0))).masked_fill(~inside, -1)


def _post_forward_hook(module, args, kwargs, output):
    want_queries(False)  # stop parking queries outside trikv forwards
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, CompressedCache) and unclaimed_attention_state():
        raise RuntimeError(
            "an attention layer ran without trikv's attention function, so it ignored the cache's dead slots and "
            "biases; keep the model on the attention implementation the cache set (trikv_sdpa / trikv_eager)"
        )
    if isinstance(cache, CompressedCache) and cache.seen == getattr(module, "_trikv_seen_before", None):
        import transformers

        raise RuntimeError(
            "the model ran a forward without writing to the trikv cache it was given (the attention layers never "
            f"called cache.update), so its output did not use the cache; transformers {transformers.__version__} "
            f"takes the cache as `{cache_argument(module)}=` (`**trikv.compat.cache_kwargs(model, cache)` picks it)"
        )
    return None


_CHUNKS_SET: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # generation config -> the chunk trikv set


def chunk_model_generate(model: torch.nn.Module, chunk: int) -> None:
    """Make `model.generate()` prefill in chunks of `chunk` tokens (transformers' `generation_config.
    prefill_chunk_size`), so that passing a bounded trikv cache to it is enough to bound a long prompt. A value the
    user set is left alone; one trikv set follows the latest cache made for the model. transformers splits the
    prompt from its start; a last chunk of one token then counts as the first decode step (the prompt protected is
    the tokens before it)."""
    config = getattr(model, "generation_config", None)
    if config is None or not hasattr(config, "prefill_chunk_size"):
        return
    if config.prefill_chunk_size is None or config.prefill_chunk_size == _CHUNKS_SET.get(config):
        config.prefill_chunk_size = chunk
        _CHUNKS_SET[config] = chunk


def _pre_forward_hook(module, args, kwargs):
    given = [kwargs.get(name) for name in ("cache", "past_key_values")]
    if all(value is not None for value in given) and given[0] is not given[1] and any(
            isinstance(value, CompressedCache) for value in given):
        from .compat import cache_argument

        raise TypeError(
            f"this transformers takes the KV cache as `{cache_argument(module)}=`: a trikv cache passed under the other "
            "name would be ignored (the model runs on a cache of its own, unbounded); pass it with "
            "`**trikv.compat.cache_kwargs(model, cache)`")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, CompressedCache):
        cache.check_model(module)
        module._trikv_seen_before = cache.seen
        unclaimed_attention_state()  # forget a state parked by a direct update() call outside any forward
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None and args:
            tokens = args[0]
        cache.before_forward(tokens.shape[1], kwargs.get("attention_mask"))
        if cache.policy.needs_tokens:  # TAM segments on token ids
            cache.record_tokens(kwargs.get("input_ids"), tokens.shape[1])
    return None


def attach(model: torch.nn.Module) -> None:
    """Install (once per model) the decoder pre-hook that lets trikv caches compress before masks are built."""
    use_trikv_attention(model)
    base = decoder(model)
    if not getattr(base, "_trikv_query_hooked", False):
        base.register_forward_hook(_post_forward_hook, with_kwargs=True)
        base._trikv_query_hooked = True
    if not getattr(base, "_trikv_hooked", False):
        base.register_forward_pre_hook(_pre_forward_hook, with_kwargs=True)
        base._trikv_hooked = True


def TriAttentionCache(model: torch.nn.Module, stats, budget: int = DEFAULT_BUDGET, divide_length: int = DEFAULT_DIVIDE_LENGTH,
                      **options) -> CompressedCache:
    """A CompressedCache with the TriAttention policy. `options` go to the cache or the policy."""
    cache_options = {k: options.pop(k) for k in ("protect_prompt", "min_decode_room", "prefill_chunk_size") if k in options}
    return CompressedCache(model, "triattention", budget=budget, divide_length=divide_length, stats=stats, **cache_options, **options)


def make_cache(model: torch.nn.Module, method: str = "triattention", budget: int | None = DEFAULT_BUDGET,
               divide_length: int = DEFAULT_DIVIDE_LENGTH, **options) -> CompressedCache:
    """A CompressedCache for any registered method (`trikv methods`)."""
    cache_options = {k: options.pop(k) for k in ("protect_prompt", "min_decode_room", "layout", "prefill_chunk_size") if k in options}
    return CompressedCache(model, method, budget=budget, divide_length=divide_length, **cache_options, **options)
