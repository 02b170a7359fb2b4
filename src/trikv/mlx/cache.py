"""A bounded KV cache for mlx-lm: one `BoundedKV` holds every layer's keys and values, and one `LayerCache` per
decoder layer gives mlx-lm its cache protocol (`offset`, `update_and_fetch`, `make_mask`, `trim`, `state`,
`to_quantized`, `nbytes`).

Schedule (the transformers cache's rules, `trikv.schedule` and `trikv.selection`): entries are appended in place;
when a forward leaves budget + divide_length entries per (layer, KV head), a round scores every layer at once in
MLX and keeps the top `budget` per (layer, row, KV head) in original order, before the next forward. The round
runs when the last layer of a forward has appended its keys (the attention of that layer reads the entries it was
handed, which the round does not change), so every forward sees the same number of entries in every layer.

Positions stay logical: `offset` counts every token seen and RoPE uses it; the stored length (at most
budget + divide_length) is what attention and the mask see. `make_mask` sizes the causal mask from the stored
length, so chunked prefill after a round masks correctly (the stored entries all precede the new tokens).

Prompt: mlx-lm's `generate_step` feeds the prompt in chunks and its last token alone, so the prompt is every
token up to and including the first single-token forward; it is protected while prompt + min_decode_room <=
budget (otherwise it competes). A chunked prefill longer than budget + divide_length is compacted between chunks,
so with chunks of at most `prefill_chunk_size` tokens (mlx-lm's `prefill_step_size`) the cache never holds more
than budget + divide_length + prefill_chunk_size entries; a longer forward warns once. A later turn of a
conversation (several tokens after decoding) is appended the same way, its tokens competing like generated ones.

Quantised KV (`kv_bits=8` or 4, or mlx-lm's `kv_bits=` through `to_quantized`): entries are stored as mlx-lm's
`QuantizedKVCache` stores them (packed words, scales and biases per group of `kv_group_size` dimensions), rounds
score the dequantised keys and move the packed entries (a token's groups are its own, so nothing is re-quantised),
and mlx-lm's quantised attention reads them: memory = budget x bits.
"""

from __future__ import annotations

import time
import warnings

import mlx.core as mx
import numpy as np

from ..schedule import RoundSchedule
from ..selection import protected_entries
from ..settings import peak_entries_bound
from .scoring import kept_indices


class SaveRefused:
    """Stands in a cache's `state` for what mlx-lm cannot save: `mlx_lm.save_prompt_cache` stops on it with this
    message (`mx.eval` ignores it)."""

    def __repr__(self) -> str:
        return ("a trikv bounded cache: mlx_lm.save_prompt_cache / load_prompt_cache rebuild mlx-lm's own cache "
                "classes only, and a bounded cache's evicted entries and round state are not theirs to restore; "
                "keep the cache object, or regenerate the prompt")


class BoundedKV:
    """Keys and values of every layer, the round schedule and the statistics of a bounded cache.

    Per layer l: a buffer [b, Hkv, capacity, D] (or mlx-lm's quantised triple), `lengths[l]` stored entries and
    `offsets[l]` tokens seen. The first `kept` entries of every (layer, row, head) are those of the last round
    (their positions in `kept_positions` [L, b, Hkv, kept]); the entries after them are the tokens since, in order.
    """

    def __init__(self, settings, policy, scorer, shape, quantization: tuple[int, int] | None = None):
        self.settings, self.policy, self.scorer, self.shape = settings, policy, scorer, shape
        self.budget = settings.budget
        self.divide_length = settings.divide_length
        self.num_layers = shape.num_layers
        self.schedule = RoundSchedule(self.budget, self.divide_length)
        self.quantization = quantization  # (group_size, bits) or None
        self.reset()

    def reset(self) -> None:
        L = self.num_layers
        self.keys: list = [None] * L
        self.values: list = [None] * L
        self.lengths = [0] * L
        self.offsets = [0] * L
        self.kept = 0
        self.kept_positions: mx.array | None = None
        self.prompt_length = 0
        self.single_token_forwards = 0
        self.rounds = 0
        self.scoring_seconds = 0.0
        self.round_seconds = 0.0
        self.peak_length = 0
        self.arrived = 0  # layers that have appended the current forward's tokens
        self.last_forward = 1  # tokens of the last forward (a round keeps room for another such chunk)
        self.warned_long_forward = False
        self.schedule.reset()

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        """Tokens seen (the RoPE position of the next token) once a forward has run through every layer."""
        return self.offsets[-1]

    @property
    def length(self) -> int:
        """Entries per (layer, row, KV head) stored."""
        return self.lengths[-1]

    @property
    def decoding(self) -> bool:
        return self.single_token_forwards >= 2

    def _bytes_per_entry(self) -> int:
        """K + V bytes of one entry of one (layer, row, KV head)."""
        if self.keys[0] is None:
            return 0
        buffers = self.keys[0] if isinstance(self.keys[0], tuple) else (self.keys[0],)
        per_slot = sum(part.nbytes // (part.shape[0] * part.shape[1] * part.shape[2]) for part in buffers)
        return 2 * per_slot

    def memory_bytes(self) -> int:
        """Bytes of the stored entries of every layer (live entries x layers x rows x KV heads x entry bytes)."""
        if self.keys[0] is None:
            return 0
        rows = self._rows()
        return sum(self.lengths) * rows * self.shape.num_kv_heads * self._bytes_per_entry()

    def allocated_bytes(self) -> int:
        """Bytes the K/V buffers occupy, spare slots included."""
        total = 0
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                if buffer is not None:
                    total += sum(part.nbytes for part in (buffer if isinstance(buffer, tuple) else (buffer,)))
        return total

    def _rows(self) -> int:
        first = self.keys[0]
        return (first[0] if isinstance(first, tuple) else first).shape[0]

    # ---- writing ---------------------------------------------------------------------------
    @property
    def peak_bound(self) -> int:
        """budget + divide_length + prefill_chunk_size: the most entries the cache holds with chunks of at most
        `prefill_chunk_size` tokens."""
        return peak_entries_bound(self.budget, self.divide_length, self.settings.prefill_chunk_size)

    def forward_starts(self, layer: int, tokens: int) -> None:
        """Bookkeeping of a forward's first layer: the prompt grows until decoding starts."""
        self.last_forward = tokens
        chunk = self.settings.prefill_chunk_size
        if tokens > chunk and self.lengths[layer] + tokens > self.peak_bound and not self.warned_long_forward:
            self.warned_long_forward = True
            warnings.warn(
                f"a forward of {tokens} tokens on a trikv MLX cache bounded at budget {self.budget} + divide_length "
                f"{self.divide_length} holds all of them at once ({self.lengths[layer] + tokens} entries per (layer, KV "
                f"head), over the bound of {self.peak_bound} that chunks of {chunk} keep): pass "
                f"prefill_step_size={chunk} to mlx-lm (trikv.mlx.prefill_step_size(cache))", stacklevel=4)
        if tokens == 1:
            self.single_token_forwards += 1
        elif self.single_token_forwards:  # several tokens after single ones (a new turn): decoding from here on
            self.single_token_forwards = max(self.single_token_forwards, 2)
        if not self.decoding:
            self.prompt_length = self.offsets[layer] + tokens

    def append(self, layer: int, keys: mx.array, values: mx.array):
        """Store a forward's new keys / values [b, Hkv, n, D] (post-RoPE) of one layer; return what attention reads."""
        n = keys.shape[2]
        if self.arrived == 0:  # the first layer of this forward
            self.forward_starts(layer, n)
        start = self.lengths[layer]
        if self.quantization is not None:
            group_size, bits = self.quantization
            keys = tuple(mx.quantize(keys, group_size=group_size, bits=bits))
            values = tuple(mx.quantize(values, group_size=group_size, bits=bits))
        self._ensure_capacity(layer, start + n, keys, values)
        end = start + n
        self.keys[layer] = _write(self.keys[layer], keys, start, end)
        self.values[layer] = _write(self.values[layer], values, start, end)
        self.lengths[layer] = end
        self.offsets[layer] += n
        fetched = _slice(self.keys[layer], end), _slice(self.values[layer], end)
        self.arrived += 1
        if self.arrived == self.num_layers:  # every layer has this forward's tokens
            self.arrived = 0
            self.peak_length = max(self.peak_length, end)
            if self.schedule.due(end):
                self.compress()
        return fetched

    def _ensure_capacity(self, layer: int, needed: int, keys, values) -> None:
        buffer = self.keys[layer]
        capacity = 0 if buffer is None else _capacity(buffer)
        if needed <= capacity:
            return
        # a bounded cache needs budget + divide_length slots between rounds; more only inside a long prefill chunk
        target = max(needed, self.schedule.capacity() if self.budget is not None else 0)
        if self.budget is None:
            target = max(needed, 2 * capacity, 256)
        self.keys[layer] = _grow(buffer, keys, self.lengths[layer], target)
        self.values[layer] = _grow(self.values[layer], values, self.lengths[layer], target)

    # ---- rounds -----------------------------------------------------------------------------
    def positions(self) -> mx.array:
        """[L, b, Hkv, N] int32 RoPE position of every stored entry."""
        L, b, h, n = self.num_layers, self._rows(), self.shape.num_kv_heads, self.length
        recent = mx.arange(self.offset - (n - self.kept), self.offset, dtype=mx.int32)
        recent = mx.broadcast_to(recent, (L, b, h, n - self.kept))
        if self.kept == 0:
            return recent
        return mx.concatenate([self.kept_positions, recent], axis=-1)

    def stacked_keys(self) -> mx.array:
        """[L, b, Hkv, N, D] the stored keys of every layer (dequantised)."""
        n = self.length
        layers = [_slice(buffer, n) for buffer in self.keys]
        if self.quantization is not None:
            group_size, bits = self.quantization
            layers = [mx.dequantize(*parts, group_size=group_size, bits=bits) for parts in layers]
        return mx.stack(layers)

    def protected(self, positions: mx.array) -> mx.array:
        """[L, b, Hkv, N] bool: the prompt (while it fits) and the method's recent window (`trikv.selection`)."""
        b = positions.shape[1]
        current = mx.full((b,), self.offset, dtype=mx.int32)
        prompt = mx.full((b,), self.prompt_length, dtype=mx.int32)
        protect = self.settings.protect_prompt and self.prompt_length > 0
        return protected_entries(positions, current, prompt, self.budget, self.policy.recent_window,
                                 self.settings.min_decode_room, protect)

    def select(self) -> tuple[mx.array, mx.array]:
        """The round's kept slots [L, b, Hkv, B] (in slot order) and every entry's positions [L, b, Hkv, N]."""
        positions = self.positions()
        protected = self.protected(positions)
        keys = self.stacked_keys()
        t = np.full(positions.shape[1], self.offset, dtype=np.int64)
        scores = self.scorer.score(keys, positions, ~protected, t, self.budget)
        scores = mx.where(protected, mx.inf, scores)
        return kept_indices(scores, self.budget), positions

    def compress(self) -> None:
        """One round: every (layer, row, KV head) keeps its top `budget` entries, in original order."""
        # MLX is lazy: the entries are the forward's pending work; compute them first, so the round's time is its own
        mx.eval([part for buffer in self.keys + self.values for part in _parts(buffer)])
        started = time.perf_counter()
        b = self._rows()
        live = mx.full((b,), self.length, dtype=mx.int32)
        due, base = self.schedule.rows_due(live)
        keep, positions = self.select()
        mx.eval(keep)
        scored = time.perf_counter()
        budget = keep.shape[-1]
        capacity = self.budget + self.divide_length + max(self.last_forward - 1, 0)  # room for another such chunk
        for layer in range(self.num_layers):
            index = keep[layer][..., None]  # [b, Hkv, B, 1]
            self.keys[layer] = _compact(self.keys[layer], index, self.length, capacity)
            self.values[layer] = _compact(self.values[layer], index, self.length, capacity)
        self.kept_positions = mx.take_along_axis(positions, keep, axis=-1)
        self.kept = budget
        self.lengths = [budget] * self.num_layers
        self.schedule.after_round(due, base, mx.full((b,), budget, dtype=mx.int32), budget)
        mx.eval(self.kept_positions, *[part for buffer in self.keys + self.values
                                       for part in (buffer if isinstance(buffer, tuple) else (buffer,))])
        self.rounds += 1
        self.scoring_seconds += scored - started
        self.round_seconds += time.perf_counter() - started

    # ---- trim, quantisation -----------------------------------------------------------------------
    def trim(self, layer: int, n: int) -> int:
        """Forget the last n tokens of one layer (mlx-lm trims every layer); only tokens since the last round,
        whose entries are all still stored, can be forgotten exactly."""
        n = min(n, self.offsets[layer])
        since_round = self.lengths[layer] - self.kept
        if n > since_round:
            raise ValueError(
                f"cannot trim {n} tokens from a trikv cache: a compression round ran {since_round} tokens ago and "
                "chose its entries with the later tokens present (evicted entries are gone)"
            )
        self.lengths[layer] -= n
        self.offsets[layer] -= n
        if all(offset == self.offsets[layer] for offset in self.offsets):
            self.prompt_length = min(self.prompt_length, self.offset)
        return n

    def quantize(self, group_size: int, bits: int) -> None:
        """Store every layer's entries quantised from now on (those already stored are quantised once)."""
        if self.quantization is not None:
            if self.quantization != (group_size, bits):
                raise ValueError(f"this trikv cache is already quantised with {self.quantization[1]} bits in groups "
                                 f"of {self.quantization[0]}; cannot switch to {bits} bits in groups of {group_size}")
            return
        check_quantization(self.shape.head_dim, group_size, bits)
        for layer in range(self.num_layers):
            for buffers in (self.keys, self.values):
                if buffers[layer] is not None:
                    buffers[layer] = tuple(mx.quantize(buffers[layer], group_size=group_size, bits=bits))
        self.quantization = (group_size, bits)


def check_quantization(head_dim: int, group_size: int, bits: int) -> None:
    """mlx's quantisation needs the head dimension to be a multiple of the group size."""
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"kv_bits must be one of 2, 3, 4, 5, 6, 8 (mlx's quantisation), got {bits!r}")
    if group_size not in (32, 64, 128) or head_dim % group_size:
        raise ValueError(f"kv_group_size must be 32, 64 or 128 and divide the head dimension {head_dim}, got {group_size!r}")


# ---- buffers: one array [b, Hkv, C, D] or mlx-lm's quantised triple (words, scales, biases) ------------------
def _parts(buffer):
    return buffer if isinstance(buffer, tuple) else (buffer,)


def _rebuild(like, parts):
    return tuple(parts) if isinstance(like, tuple) else parts[0]


def _capacity(buffer) -> int:
    return _parts(buffer)[0].shape[2]


def _slice(buffer, end: int):
    parts = [part[..., :end, :] if part.shape[2] != end else part for part in _parts(buffer)]
    return _rebuild(buffer, parts)


def _write(buffer, new, start: int, end: int):
    parts = _parts(buffer)
    for part, piece in zip(parts, _parts(new)):
        part[..., start:end, :] = piece
    return _rebuild(buffer, list(parts))


def _grow(buffer, like, length: int, capacity: int):
    """A buffer of `capacity` slots holding the first `length` entries of `buffer` (None: an empty one)."""
    parts = []
    for index, piece in enumerate(_parts(like)):
        b, h, _, width = piece.shape
        fresh = mx.zeros((b, h, capacity, width), dtype=piece.dtype)
        if buffer is not None and length:
            fresh[..., :length, :] = _parts(buffer)[index][..., :length, :]
        parts.append(fresh)
    return _rebuild(like, parts)


def _compact(buffer, index: mx.array, length: int, capacity: int):
    """The kept entries (slots `index` [b, Hkv, B, 1] of the first `length`) first, in a buffer of `capacity` slots."""
    parts = []
    for part in _parts(buffer):
        kept = mx.take_along_axis(part[..., :length, :], index, axis=2)
        b, h, _, width = part.shape
        fresh = mx.zeros((b, h, max(capacity, kept.shape[2]), width), dtype=part.dtype)
        fresh[..., : kept.shape[2], :] = kept
        parts.append(fresh)
    return _rebuild(buffer, parts)


class LayerCache:
    """mlx-lm's cache protocol for one decoder layer of a `BoundedKV` (what `make_prompt_cache` returns per layer).

    `offset` is the layer's logical position (RoPE); `update_and_fetch` appends and returns the stored entries;
    `make_mask` sizes the causal mask from the stored length. Saving with mlx-lm's `save_prompt_cache` is refused
    with a message; `trim` is exact for tokens since the last round and refused past it.
    """

    def __init__(self, bounded: BoundedKV, layer: int):
        self.bounded, self.layer = bounded, layer

    @property
    def offset(self) -> int:
        return self.bounded.offsets[self.layer]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self.bounded.append(self.layer, keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("a trikv cache bounds full-attention layers; sliding-window attention is not supported")
        if N == 1:
            return None
        if return_array:
            from mlx_lm.models.base import create_causal_mask

            return create_causal_mask(N, self.bounded.lengths[self.layer])
        return "causal"  # bottom-right aligned: every stored entry precedes the new tokens

    def size(self) -> int:
        return self.bounded.lengths[self.layer]

    def empty(self) -> bool:
        return self.bounded.keys[self.layer] is None

    @property
    def keys(self):
        buffer = self.bounded.keys[self.layer]
        return None if buffer is None else _slice(buffer, self.bounded.lengths[self.layer])

    @property
    def values(self):
        buffer = self.bounded.values[self.layer]
        return None if buffer is None else _slice(buffer, self.bounded.lengths[self.layer])

    @property
    def nbytes(self) -> int:
        """Bytes this layer's buffers occupy."""
        total = 0
        for buffer in (self.bounded.keys[self.layer], self.bounded.values[self.layer]):
            if buffer is not None:
                total += sum(part.nbytes for part in _parts(buffer))
        return total

    @property
    def state(self):
        """The stored arrays (mlx-lm evaluates them after each prefill chunk) and a marker that stops
        `mlx_lm.save_prompt_cache` with the reason."""
        if self.empty():
            return [SaveRefused()]
        return [self.keys, self.values, SaveRefused()]

    @state.setter
    def state(self, value):
        raise ValueError(repr(SaveRefused()))

    @classmethod
    def from_state(cls, state):
        raise ValueError(repr(SaveRefused()))

    @property
    def meta_state(self):
        return ""

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return self.bounded.trim(self.layer, n)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedLayerCache":
        """This layer's face of the cache, quantised (all layers switch together); what mlx-lm's `kv_bits` calls."""
        self.bounded.quantize(group_size, bits)
        return QuantizedLayerCache(self.bounded, self.layer)

    @classmethod
    def merge(cls, caches):
        raise ValueError("trikv's MLX caches hold one sequence at a time (mlx_lm.generate / stream_generate); "
                         "mlx-lm's batch generation is not supported")

    def __repr__(self) -> str:
        bounded = self.bounded
        return (f"{type(self).__name__}(layer={self.layer}, method={bounded.policy.name}, budget={bounded.budget}, "
                f"divide_length={bounded.divide_length}, entries={self.size()}, offset={self.offset}, rounds={bounded.rounds})")


class QuantizedLayerCache(LayerCache):
    """A quantised layer: mlx-lm's attention sees `bits` / `group_size` and runs its quantised kernel."""

    @property
    def bits(self) -> int:
        return self.bounded.quantization[1]

    @property
    def group_size(self) -> int:
        return self.bounded.quantization[0]

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedLayerCache":
        self.bounded.quantize(group_size, bits)
        return self
