"""A bounded KV cache for transformers' `generate()` and plain forward loops.

Layout: one preallocated buffer for all layers, keys/values [L, b, Hkv, capacity, D] plus the RoPE
position of every slot [L, b, Hkv, capacity]. All layers, rows and heads hold the same number of
physical entries P (so transformers' stock masks stay valid), but each (layer, row, KV head) keeps its
own tokens.

Schedule: entries are appended in place; when P reaches budget + divide_length the
policy scores all layers at once and the cache keeps the top `budget` per (layer, row, KV head), in
original order. The round runs in a forward pre-hook of the decoder, before transformers builds the
attention mask, so the mask sizes it reads (`get_mask_sizes`) are already those of the compressed
cache. Positions stay logical: `get_seq_length()` counts every token seen, and RoPE uses it.

Batches: each row follows its own schedule, exactly as if it were generated alone: a row is compressed
when *its* live entries reach budget + divide_length. Rows share the physical length (the largest live
count), so a row compressed earlier than the others holds dead slots (position -1) until the others
catch up; left-padding slots are dead from the start. Attention masks dead slots through trikv's
attention functions (`attention.py`), which the cache switches the model to.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .architectures import ModelShape, decoder, model_shape
from .attention import park_attention_state, unclaimed_attention_state, use_trikv_attention
from .compat import cache_argument
from .policies import Policy, ScoringContext, make_policy
from .policies.base import CompactionContext, ObservationContext
from .query_capture import QueryWindow, install_query_tap, take_query, want_queries
from .fast import accelerate, compact_slots_, gather_slots, spread_step
from .schedule import RoundSchedule
from .selection import prompt_fits, protected_entries
from .validation import integer

log = logging.getLogger(__name__)


class _Default(int):
    """A default setting, distinguishable from the same number given explicitly, so that a method can refuse a
    setting it would otherwise silently ignore (`full` and a budget, a paper schedule and divide_length)."""

    def __repr__(self) -> str:
        return f"{int(self)} (default)"


DEFAULT_BUDGET = _Default(2048)
DEFAULT_DIVIDE_LENGTH = _Default(128)
INITIAL_SLOTS = 256  # slots per (layer, row, KV head) allocated at the first forward; buffers double from there


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
        layout: "uniform" (one physical length for every layer and head) or "packed" (per-(layer, head)
            lengths, packed.py); default: packed for policies with per-layer / per-head budgets
            (PyramidKV, Ada-KV), uniform otherwise.
        policy_options: options forwarded to the policy when `policy` is a name.

    A cache holds one conversation, for the model it was made for. transformers' `generate()` treats the
    tokens a cache already holds as the prefix of its input: pass a new cache (or call `reset()`) for every
    unrelated `model.generate(...)`; `trikv.generate` refuses a cache that holds tokens. Buffers grow with the
    sequence, up to budget + divide_length slots, so a huge budget costs nothing until it is used.
    """

    is_compileable = False
    layout = "uniform"

    def __new__(cls, model=None, policy="triattention", budget=DEFAULT_BUDGET, *args, layout: str | None = None, **kwargs):
        # per-layer / per-head budgets (PyramidKV, Ada-KV) get the packed layout, which
        # stores only the entries each (layer, head) keeps; see packed.py
        if layout not in (None, "uniform", "packed"):
            raise ValueError(f"layout must be 'uniform' or 'packed', got {layout!r}")
        if cls is CompressedCache and (layout == "packed" or (layout is None and budget is not None and _variable_budgets(policy))):
            from .packed import PackedCache

            cls = PackedCache
        return super().__new__(cls)

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy | str = "triattention",
        budget: int | None = DEFAULT_BUDGET,
        divide_length: int = DEFAULT_DIVIDE_LENGTH,
        protect_prompt: bool = True,
        min_decode_room: int = 32,
        layout: str | None = None,
        **policy_options,
    ):
        self.shape: ModelShape = model_shape(model)
        if isinstance(policy, str):
            policy = make_policy(policy, **policy_options)
        elif policy_options:
            raise ValueError(f"policy options {sorted(policy_options)} given with a policy instance")
        self.policy = policy
        if not policy.evicts:
            if budget is not None and budget is not DEFAULT_BUDGET:
                raise ValueError(f"method {policy.name!r} keeps every entry and takes no budget (got budget={budget!r})")
            budget = None
        budget = None if budget is None else integer("budget", budget)
        explicit_slack = divide_length is not DEFAULT_DIVIDE_LENGTH
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
        if budget is not None:
            if policy.recent_window >= budget:
                raise ValueError(
                    f"budget {budget} is not larger than the protected recent window of {policy.name} "
                    f"({policy.recent_window} tokens); raise the budget or shrink the window"
                )
        self.budget = budget
        self.divide_length = divide_length
        self.schedule = RoundSchedule(budget, divide_length)
        self.protect_prompt = protect_prompt
        self.min_decode_room = min_decode_room
        policy.bind(model, self.shape)
        accelerate(policy)  # the fast TriAttention scorer (same scores, no per-element index copies)
        # post-RoPE queries of the last `policy.query_window` tokens, for attention scores
        self.query_window = QueryWindow(policy.query_window, self.shape.num_layers) if policy.query_window > 0 else None
        if self.query_window is not None:
            install_query_tap(model)
        super().__init__(layers=[_LayerView(self, i) for i in range(self.shape.num_layers)])
        attach(model)
        self._decoder = weakref.ref(decoder(model))  # the model this cache was made for
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self._reset_state()

    # ---- state --------------------------------------------------------------------------------
    def _reset_state(self) -> None:
        self.keys: torch.Tensor | None = None  # [L, b, Hkv, capacity, D]
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [L, b, Hkv, capacity] long, -1 = padding
        self.length = 0  # physical entries P per (layer, row, head)
        self.seen = 0  # logical tokens processed, padding included (the mask's column count)
        self.pad_lengths: torch.Tensor | None = None  # [b]
        self.prompt_length = 0  # logical tokens before the first single-token step
        self.decoding = False
        self.rounds = 0
        self.peak_length = 0
        self.scoring_seconds = 0.0
        self._prompt_dropped_logged = False
        self._warned_positions = False
        self._forward_announced = False  # before_forward ran for the forward now writing to the cache
        self._write_at = 0
        self._has_dead_slots = False
        self.schedule.reset()
        self._observe_pending = False  # the last forward was one token: observe it before the next one
        self.observe_seconds = 0.0  # time in per-step policy statistics (H2O, LazyEviction, ...)
        if getattr(self, "query_window", None) is not None:
            self.query_window.reset()

        self.biases: torch.Tensor | None = None  # [L, b, Hkv, capacity] float32 log-biases (compacting policies)
        self._has_bias = False  # some live entry carries a nonzero bias (published to attention)
        self.tokens: torch.Tensor | None = None  # [b, >= seen] long: token id by logical index (needs_tokens)
        self.compaction_seconds = 0.0  # time in policy.compact (included in scoring_seconds)
        self.policy.reset()

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

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]

    @property
    def batch_size(self) -> int:
        return -1 if self.keys is None else self.keys.shape[1]

    @property
    def device(self) -> torch.device | None:
        return None if self.keys is None else self.keys.device

    def stored_keys(self, layer: int) -> torch.Tensor | None:
        """[b, Hkv, P, D] keys of one layer as attention sees them (None before the first forward)."""
        return None if self.keys is None else self.keys[layer, :, :, : self.length]

    def stored_values(self, layer: int) -> torch.Tensor | None:
        return None if self.values is None else self.values[layer, :, :, : self.length]

    def visible_positions(self) -> torch.Tensor:
        """[L, b, Hkv, P] long: RoPE position of every stored entry per (layer, row, KV head), -1 = dead slot."""
        return self.positions[:, :, :, : self.length]

    def peak_memory_bytes(self) -> int:
        """Largest `memory_bytes()` so far (every stored slot costs the same, so it follows the peak length)."""
        return self.memory_bytes() * self.peak_length // max(self.length, 1)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # stored slots map to mask columns [seen - P, seen), new tokens to [seen, seen + q)
        return self.length + query_length, self.seen - self.length

    def entries(self) -> int:
        """Physical entries per (layer, row, KV head)."""
        return self.length

    def memory_bytes(self) -> int:
        """Bytes of K/V that are live (entries x layers x rows x heads x head_dim x 2 x element size)."""
        if self.keys is None:
            return 0
        L, b, h, _, d = self.keys.shape
        bias_bytes = 0 if self.biases is None else L * b * h * self.length * self.biases.element_size()
        return 2 * L * b * h * self.length * d * self.keys.element_size() + bias_bytes

    def allocated_bytes(self) -> int:
        """Bytes the K/V buffers occupy, spare slots included."""
        if self.keys is None:
            return 0
        bias_bytes = 0 if self.biases is None else self.biases.nbytes
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes + bias_bytes

    # ---- the forward pre-hook -----------------------------------------------------------------
    def before_forward(self, query_length: int, attention_mask: torch.Tensor | None) -> None:
        """Record padding on the first forward; run a compression round when one is due."""
        self._forward_announced = True
        if self.seen == 0:
            self._read_padding(attention_mask)
        if query_length == 1 and self.seen > 0:
            self.decoding = True
        if self.query_window is not None:
            want_queries(True)
            if self._observe_pending:
                self._observe_last_token()
        if self.schedule.due(self.length):
            self.compress()
        if query_length == 1 and self.decoding and self.budget is not None:  # score ahead, spread
            started = time.perf_counter()
            spread_step(self)
            self.scoring_seconds += time.perf_counter() - started

    def _read_padding(self, attention_mask: torch.Tensor | None) -> None:
        if attention_mask is None or attention_mask.dim() != 2:
            self.pad_lengths = None
            return
        mask = attention_mask.bool()
        pads = (~mask).long().cumprod(-1).sum(-1)  # leading zeros per row
        if bool((mask.long().sum(-1) != mask.shape[-1] - pads).any()):
            raise ValueError("trikv caches need left padding (padding_side='left'): found padding after real tokens")
        self.pad_lengths = pads
        self.schedule.start(pads)

    # ---- update: append in place ------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [b, Hkv, q, D] post-RoPE
        q = key_states.shape[-2]
        if layer_idx == 0:
            self._begin_forward(key_states, value_states)
        start = self._write_at
        self.keys[layer_idx, :, :, start : start + q] = key_states
        self.values[layer_idx, :, :, start : start + q] = value_states
        end = start + q
        if self.query_window is not None:
            self._record_queries(layer_idx, q, end)
        attention_kwargs = kwargs.get("kwargs")
        stored_keys, stored_values = self.keys[layer_idx, :, :, :end], self.values[layer_idx, :, :, :end]
        state = {
            "trikv_active": True,
            "trikv_valid": self.positions[layer_idx, :, :, :end] >= 0 if self._has_dead_slots else None,
            # per-entry log-biases, only once some entry carries one
            "trikv_bias": self.biases[layer_idx, :, :, :end] if self._has_bias else None,
        }
        if attention_kwargs is not None:  # read by trikv_sdpa / trikv_eager
            attention_kwargs.update(state)
        else:  # transformers < 5.24 passes no kwargs dict to update()
            park_attention_state(stored_keys, state)
        return stored_keys, stored_values

    def _claim_forward(self) -> None:
        """The first layer's update of a forward: refuse one whose model never announced it (another model)."""
        if not self._forward_announced:  # only the model this cache was made for runs its pre-hook
            raise ValueError(
                "this trikv cache was made for another model (its forward pre-hook did not run); make one cache "
                "per model (trikv.make_cache(model, ...) with the model you run)"
            )
        self._forward_announced = False

    def _refuse_missed_round(self) -> None:
        if self.schedule.due(self.length):
            raise RuntimeError(
                "a compression round is due but the trikv pre-hook did not run; "
                "use the cache with the model it was created for"
            )

    def _new_token_positions(self, batch: int, q: int, device) -> torch.Tensor:
        """[b, q] RoPE positions of the q tokens about to be appended: logical index minus the row's padding, -1 on pads."""
        logical = torch.arange(self.seen, self.seen + q, device=device)
        positions = logical[None, :] - self._pads(batch, device)[:, None]
        return positions.masked_fill(positions < 0, -1)

    def _begin_forward(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, q, d = key_states.shape
        self._claim_forward()
        self._refuse_missed_round()
        if self.keys is None:  # start small: a huge budget costs nothing until the sequence needs it
            self._allocate(b, key_states.dtype, key_states.device, max(q, min(self._target_capacity(), INITIAL_SLOTS)))
        elif self.length + q > self.capacity:
            self._grow(self.length + q)
        positions = self._new_token_positions(b, q, key_states.device)  # [b, q]
        self._new_positions = positions
        self.positions[:, :, :, self.length : self.length + q] = positions[None, :, None, :]
        if self.biases is not None:  # new tokens carry no bias
            self.biases[:, :, :, self.length : self.length + q] = 0
        if not self.decoding and q >= 1:
            self.prompt_length = self.seen + q
        self._write_at = self.length
        self.length += q
        self.seen += q
        self.peak_length = max(self.peak_length, self.length)
        if self.max_positions and self.seen > self.max_positions and not self._warned_positions:
            log.warning("the sequence passed %d tokens, the model's trained positions (max_position_embeddings); "
                        "its outputs past that point are not what it was trained for", self.max_positions)
            self._warned_positions = True
        self._has_dead_slots = self._dead_slots_after_append(q)  # any layer / head (no scan per decode step)

    def _pads(self, batch: int, device) -> torch.Tensor:
        if self.pad_lengths is None:
            return torch.zeros(batch, dtype=torch.long, device=device)
        return self.pad_lengths.to(device)

    def _target_capacity(self) -> int:
        return 256 if self.budget is None else self.schedule.capacity()

    def _allocate(self, batch: int, dtype, device, capacity: int) -> None:
        L, h, d = self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim
        self.keys = torch.zeros(L, batch, h, capacity, d, dtype=dtype, device=device)
        self.values = torch.zeros(L, batch, h, capacity, d, dtype=dtype, device=device)
        self.positions = torch.full((L, batch, h, capacity), -1, dtype=torch.long, device=device)
        if self.policy.compacts:
            self.biases = torch.zeros(L, batch, h, capacity, dtype=torch.float32, device=device)

    def _grow(self, needed: int) -> None:
        """Resize the buffers: double (never below `needed`); a bounded cache stops at budget + divide_length,
        the single allocation it then keeps (a longer prompt chunk may exceed it until the first round)."""
        capacity = max(needed, 2 * self.capacity)
        if self.budget is not None:
            capacity = max(needed, min(capacity, self._target_capacity()))
        keys, values, positions = self.keys, self.values, self.positions
        biases = self.biases
        self._allocate(keys.shape[1], keys.dtype, keys.device, capacity)
        if biases is not None:
            self.biases[:, :, :, : self.length] = biases[:, :, :, : self.length]
        self.keys[:, :, :, : self.length] = keys[:, :, :, : self.length]
        self.values[:, :, :, : self.length] = values[:, :, :, : self.length]
        self.positions[:, :, :, : self.length] = positions[:, :, :, : self.length]

    # ---- compression round --------------------------------------------------------------------
    def current_positions(self) -> torch.Tensor:
        """[b] tokens seen by each row, padding excluded (the RoPE position of the next token)."""
        return self.seen - self._pads(self.batch_size, self.device)

    def _protected(self, positions: torch.Tensor) -> torch.Tensor:
        """[L, b, Hkv, N] bool: prompt tokens (while protection holds) and the recent window."""
        t = self.current_positions()  # [b]
        window = self.policy.recent_window
        prompt_real = self.prompt_length - self._pads(t.shape[0], t.device)  # [b]
        protect_prompt = self.protect_prompt and self.prompt_length > 0
        if protect_prompt and not self._prompt_dropped_logged:
            if not bool(prompt_fits(prompt_real, self.budget, window, self.min_decode_room).all()):
                log.warning(
                    "prompt of %s tokens leaves fewer than %d of the %d budget slots for generated tokens: "
                    "the prompt competes for the budget too",
                    prompt_real.tolist(), self.min_decode_room, self.budget,
                )
                self._prompt_dropped_logged = True
        return protected_entries(positions, t, prompt_real, self.budget, window, self.min_decode_room, protect_prompt)

    def live_counts(self) -> torch.Tensor:
        """[b] live entries per row (mean over layers and KV heads: they differ only with variable budgets)."""
        L, _, h = self.positions.shape[:3]
        return (self.positions[:, :, :, : self.length] >= 0).sum(dim=(0, 2, 3)) // (L * h)

    @torch.no_grad()
    def compress(self) -> None:
        """Compress every row whose live entries reached budget + divide_length to the top-`budget`.

        Kept entries stay in original order. Rows not yet due keep everything; the physical length becomes
        the largest live count, so due rows carry dead slots until the others are compressed too.
        """
        started = time.perf_counter()
        n, budget = self.length, self.budget
        keys = self.keys[:, :, :, :n]
        values = self.values[:, :, :, :n]
        positions = self.positions[:, :, :, :n]
        dead = positions < 0
        live = self.live_counts()  # [b]
        due, base = self.schedule.rows_due(live)  # [b]
        if not bool(due.any()):
            return
        row_due = due[None, :, None, None]
        protected = self._protected(positions) & ~dead
        context = ScoringContext(
            keys=keys,
            values=values,
            positions=positions,
            candidates=~(dead | protected) & row_due,
            current_position=self.current_positions(),
            budget=budget,
            queries=None if self.query_window is None else self.query_window.queries,
            query_positions=None if self.query_window is None else self.query_window.positions,
            protected=protected,
            biases=None if self.biases is None else self.biases[:, :, :, :n],
            tokens=self._position_tokens(),
        )
        scores = self.policy.score(context).float()  # [L, b, Hkv, N]
        scores = scores.masked_fill(protected, float("inf")).masked_fill(dead, float("-inf"))
        counts = self.policy.allocate(scores, context) if self.policy.variable_budgets else None
        chosen = torch.zeros_like(dead)
        if counts is None and scores.shape[-1] - budget < budget:  # find the few to evict, not the many to keep
            chosen.fill_(True).scatter_(-1, scores.topk(scores.shape[-1] - budget, dim=-1, largest=False, sorted=False).indices, False)
        elif counts is None:
            chosen.scatter_(-1, scores.topk(budget, dim=-1, sorted=False).indices, True)
        else:  # per-(layer, row, head) budgets (PyramidKV, Ada-KV)
            chosen = _top_counts(scores, counts)
        keep = torch.where(row_due, chosen & ~dead, ~dead)  # rows not due keep all live entries
        new_length = int(torch.where(due, torch.full_like(live, budget), live).max())
        # top new_length of "keep" picks exactly the kept entries plus dead fillers; sorted = original order
        if counts is not None:  # the fullest (layer, head) sets the physical length; the others hold dead slots
            new_length = int(keep.sum(-1).max())
        if bool((keep.sum(-1) == new_length).all()):  # no fillers: the kept slots in order, no sort
            order = keep.nonzero()[:, -1].view(*keep.shape[:3], new_length)
        else:
            order = keep.float().topk(new_length, dim=-1, sorted=False).indices.sort(dim=-1).values  # [L, b, Hkv, P']
        self.policy.after_round(order)  # per-slot policy state follows the kept slots
        L, _, h = keep.shape[:3]
        live_after = keep.sum(dim=(0, 2, 3)) // (L * h)  # [b] mean live entries per (layer, head)
        self.schedule.after_round(due, base, live_after, new_length)
        kept_positions = positions.gather(3, order).masked_fill(~keep.gather(3, order), -1)
        gather_index = order[..., None].expand(*order.shape, keys.shape[-1])
        # compact the buffers in place, layer by layer (no fresh cache-sized allocations per round)
        in_place = self.biases is None and self.capacity == self._target_capacity()
        if in_place:
            compact_slots_(self.keys, order)
            compact_slots_(self.values, order)
        else:
            kept_keys = gather_slots(self.keys, order)  # row copies, not an expanded-index gather
            kept_values = gather_slots(self.values, order)
        if self.biases is not None:  # the policy may rewrite kept values and biases
            kept_values, kept_biases = self._compact(context, keep, order, gather_index, kept_values)
        if self.capacity != self._target_capacity():  # shrink once after a long prompt (or follow variable budgets)
            self._allocate(keys.shape[1], keys.dtype, keys.device, self._target_capacity())
        if not in_place:
            self.keys[:, :, :, :new_length] = kept_keys
            self.values[:, :, :, :new_length] = kept_values
        self.positions[:, :, :, :new_length] = kept_positions
        if self.biases is not None:
            self.biases[:, :, :, :new_length] = kept_biases
            self.biases[:, :, :, new_length:] = 0
            self._has_bias = bool(kept_biases.ne(0).any())
        self.length = new_length
        self.rounds += 1
        self.scoring_seconds += time.perf_counter() - started

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
        self._select_stored_rows(index)
        if self.tokens is not None:
            self.tokens = self.tokens.index_select(0, index.to(self.tokens.device))
        if self.pad_lengths is not None:
            self.pad_lengths = self.pad_lengths.to(index.device).index_select(0, index)
        if self.query_window is not None:
            self.query_window.select_rows(index)
        self.policy.select_rows(index)
        self.schedule.select_rows(index)

    def _select_stored_rows(self, index: torch.Tensor) -> None:
        self.keys = self.keys.index_select(1, index)
        self.values = self.values.index_select(1, index)
        self.positions = self.positions.index_select(1, index)
        if self.biases is not None:
            self.biases = self.biases.index_select(1, index)

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
            f"entries={self.length}, seen={self.seen}, rounds={self.rounds})"
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
        elif self.policy.observe_prefill:
            started = time.perf_counter()
            self.policy.observe(
                ObservationContext(
                    layers=slice(layer_idx, layer_idx + 1),
                    queries=query[None],
                    query_positions=new_positions,
                    keys=self.keys[layer_idx : layer_idx + 1, :, :, :end],
                    values=self.values[layer_idx : layer_idx + 1, :, :, :end],
                    positions=self.positions[:, :, :, :end],
                )
            )
            self.observe_seconds += time.perf_counter() - started

    @torch.no_grad()
    def _observe_last_token(self) -> None:
        started = time.perf_counter()
        self._observe_pending = False
        queries, query_positions = self.query_window.latest(1, self.seen)
        n = self.length
        self.policy.observe(
            ObservationContext(
                layers=slice(None),
                queries=queries,
                query_positions=query_positions,
                keys=self.keys[:, :, :, :n],
                values=self.values[:, :, :, :n],
                positions=self.positions[:, :, :, :n],
            )
        )
        self.observe_seconds += time.perf_counter() - started


    # ---- per-entry log-biases, token ids, the policy's compact hook ---------------
    def record_tokens(self, input_ids: torch.Tensor | None, query_length: int) -> None:
        """Remember the token ids of the forward about to run (logical indices seen .. seen + q)."""
        if input_ids is None or input_ids.dim() != 2:
            input_ids = None
        b = input_ids.shape[0] if input_ids is not None else (self.batch_size if self.keys is not None else 1)
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

    def _compact(self, context, keep, order, gather_index, kept_values):
        """Let a compacting policy rewrite the kept entries; returns (kept values, kept biases) in new-slot order."""
        biases = self.biases[:, :, :, : keep.shape[-1]]
        if self.policy.compacts:
            started = time.perf_counter()
            result = self.policy.compact(CompactionContext(scoring=context, keep=keep))
            if result is not None and result.values is not None:
                kept_values = result.values.to(kept_values.dtype).gather(3, gather_index)
            if result is not None and result.biases is not None:
                biases = result.biases.float()
            self.compaction_seconds += time.perf_counter() - started
        kept_biases = biases.gather(3, order).masked_fill(~keep.gather(3, order), 0.0)
        return kept_values, kept_biases

    # ---- dead-slot bookkeeping without a full scan (a host-device sync) per decode step ----
    def _dead_slots_after_append(self, q: int) -> bool:
        """Whether any stored slot is dead after appending q slots. Scans the positions only after a
        structural change (a round, new buffers, row selection); plain appends add dead slots only while
        a row's left padding is being written."""
        state = (self.rounds, id(self.positions), self.length - q)
        if getattr(self, "_dead_state", None) == state:
            dead = self._has_dead_slots or self.seen - q < self._max_pad()
        else:
            dead = bool((self.positions[:, :, :, : self.length] < 0).any())
        self._dead_state = (self.rounds, id(self.positions), self.length)
        return dead

    def reserve(self, entries: int, batch: int, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        """Preallocate `entries` slots per (layer, row, KV head), e.g. prompt + max_new_tokens for full attention,
        whose buffers otherwise double as they fill. Before the first forward (with its batch size), or to grow."""
        if self.keys is None:
            self._allocate(batch, dtype, device, max(entries, self._target_capacity()))
        elif entries > self.capacity:
            self._grow(entries)

    def _max_pad(self) -> int:
        if self.pad_lengths is None:
            return 0
        if getattr(self, "_max_pad_of", None) is not self.pad_lengths:
            self._max_pad_of, self._max_pad_value = self.pad_lengths, int(self.pad_lengths.max())
        return self._max_pad_value


def _variable_budgets(policy) -> bool:
    if isinstance(policy, str):
        from .policies import REGISTRY

        entry = REGISTRY.get(policy)
        policy = None if entry is None else entry.policy_class
    return bool(getattr(policy, "variable_budgets", False))


def _top_counts(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[L, b, Hkv, N] bool: the counts[l, b, h] highest scores of every (layer, row, KV head)."""
    k = min(int(counts.max()), scores.shape[-1])
    top = scores.topk(k, dim=-1).indices  # descending
    within = torch.arange(k, device=scores.device) < counts[..., None]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, within)


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


def _pre_forward_hook(module, args, kwargs):
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


def TriAttentionCache(model: torch.nn.Module, stats, budget: int = 2048, divide_length: int = 128, **options) -> CompressedCache:
    """A CompressedCache with the TriAttention policy. `options` go to the cache or the policy."""
    cache_options = {k: options.pop(k) for k in ("protect_prompt", "min_decode_room") if k in options}
    return CompressedCache(model, "triattention", budget=budget, divide_length=divide_length, stats=stats, **cache_options, **options)


def make_cache(model: torch.nn.Module, method: str = "triattention", budget: int | None = DEFAULT_BUDGET,
               divide_length: int = DEFAULT_DIVIDE_LENGTH, **options) -> CompressedCache:
    """A CompressedCache for any registered method (`trikv methods`)."""
    cache_options = {k: options.pop(k) for k in ("protect_prompt", "min_decode_room", "layout") if k in options}
    return CompressedCache(model, method, budget=budget, divide_length=divide_length, **cache_options, **options)
