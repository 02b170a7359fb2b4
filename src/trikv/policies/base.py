"""What every eviction policy sees and returns.

A policy scores the cached entries of all layers at once; the cache then keeps the top `budget` entries
per (layer, row, KV head), after forcing padding out and protected entries (prompt, recent window) in.
Higher score = more worth keeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..architectures import ModelShape


@dataclass
class ScoringContext:
    keys: torch.Tensor  # [L, b, Hkv, N, D] post-RoPE, as attention sees them
    values: torch.Tensor | None  # [L, b, Hkv, N, D]; None where the cache scores keys only (inside vLLM)
    positions: torch.Tensor  # [L, b, Hkv, N] long: RoPE position of each entry, -1 for padding
    candidates: torch.Tensor  # [L, b, Hkv, N] bool: entries that compete (not padding, not protected)
    current_position: torch.Tensor  # [b] long: tokens seen so far by each row (= next RoPE position)
    budget: int
    # Recent post-RoPE queries, for policies that declare `query_window > 0` (None otherwise): a ring over
    # the last w tokens (slot = logical token index % w); `query_positions` gives each slot's RoPE position
    # per row (-1 = empty slot or padding).
    queries: torch.Tensor | None = None  # [L, b, Hq, w, D]
    query_positions: torch.Tensor | None = None  # [b, w] long
    protected: torch.Tensor | None = None  # [L, b, Hkv, N] bool: entries the cache keeps whatever the score
    # per-entry log-biases added to the attention logits (None while all are zero) and,
    # for policies with `needs_tokens`, the token id at each RoPE position of every row (-1 = unknown)
    biases: torch.Tensor | None = None  # [L, b, Hkv, N] float32
    tokens: torch.Tensor | None = None  # [b, T] long

    def rows(self, index: torch.Tensor) -> "ScoringContext":
        """The same context restricted to the batch rows `index` [r] (copies)."""

        def take(tensor: torch.Tensor | None, dim: int) -> torch.Tensor | None:
            return None if tensor is None else tensor.index_select(dim, index.to(tensor.device))

        return ScoringContext(
            keys=take(self.keys, 1), values=take(self.values, 1), positions=take(self.positions, 1),
            candidates=take(self.candidates, 1), current_position=take(self.current_position, 0), budget=self.budget,
            queries=take(self.queries, 1), query_positions=take(self.query_positions, 0),
            protected=take(self.protected, 1), biases=take(self.biases, 1), tokens=take(self.tokens, 0),
        )


@dataclass
class ObservationContext:
    """What `Policy.observe` sees after a forward: that forward's queries and every slot they attended.

    During decoding the cache observes once per token, for all layers at once (`layers = slice(None)`);
    a multi-token forward (prefill, a prompt chunk) is observed layer by layer as it runs, for policies
    with `observe_prefill = True`.
    """

    layers: slice  # the layers `queries`, `keys` and `values` cover
    queries: torch.Tensor  # [L', b, Hq, n, D] post-RoPE queries of one forward
    query_positions: torch.Tensor  # [b, n] long: RoPE position of each query, -1 for padding
    keys: torch.Tensor  # [L', b, Hkv, N, D]: every slot these queries attended (stored + new)
    values: torch.Tensor  # [L', b, Hkv, N, D]
    positions: torch.Tensor  # [L, b, Hkv, N] long for *all* layers (per-slot state), -1 = dead slot / padding


class Policy:
    """Base class. Subclasses set `name`, `rule` and implement `score`."""

    name: ClassVar[str] = "base"
    rule: ClassVar[str] = ""
    paper: ClassVar[str] = ""  # the publication whose rule this is (trikv's own variants say so)
    # a control, not a method to compare with: what any eviction at the same budget gives (results pages report it apart)
    control: ClassVar[bool] = False
    evicts: ClassVar[bool] = True
    recent_window: int = 0  # most recent tokens that are never evicted
    # True when a row's scores depend on that row of the context alone (no per-row state): the cache then
    # scores only the rows that are due, which in a batch whose rows reach the trigger at different steps
    # saves up to a factor of the batch size
    scores_rows_independently: ClassVar[bool] = False

    @property
    def scores_layers_independently(self) -> bool:
        """True when a layer's scores depend on that layer's keys alone, so a round may score a few layers at a
        time (`for_layers`); False for rules that share one selection across layers."""
        return False

    def for_layers(self, layers: slice) -> "Policy":
        """The policy restricted to the layers `layers` of its bound model (only when
        `scores_layers_independently`): its `score` then takes contexts that hold those layers alone."""
        if not self.scores_layers_independently:
            raise ValueError(f"{self.name} shares its selection across layers; it scores all layers at once")
        return self

    @property
    def scores_heads_independently(self) -> bool:
        """True when a KV head's scores depend on that head's keys alone, so a round may score a few KV heads at a
        time (`for_heads`); False for rules that mix heads (a union over heads, a head-shared selection)."""
        return False

    def for_heads(self, heads: slice) -> "Policy":
        """The policy restricted to the KV heads `heads` of its bound model (only when
        `scores_heads_independently`): its `score` then takes contexts that hold those KV heads alone."""
        if not self.scores_heads_independently:
            raise ValueError(f"{self.name} mixes KV heads in its selection; it scores all heads at once")
        return self

    def round_bytes_per_entry(self, head_dim: int, group: int, entries: int) -> int:
        """Transient bytes `score` allocates per scored entry (layer, row, KV head, slot) when each (layer, row,
        KV head) holds `entries` entries: what a round's memory cap is planned with."""
        return 4 * head_dim + 16

    def bind(self, model: torch.nn.Module, shape: ModelShape) -> None:
        """Called once by the cache; validate against the model and precompute what scoring needs."""

    def score(self, context: ScoringContext) -> torch.Tensor:
        """Return scores [L, b, Hkv, N]; only candidate entries matter."""
        raise NotImplementedError

    # ---- optional hooks (baselines that need live queries, per-step statistics or variable budgets) ----
    query_window: int = 0  # the cache keeps the post-RoPE queries of the last `query_window` tokens per layer
    observes: ClassVar[bool] = False  # call `observe` once per forward (H2O, TOVA-like per-step statistics)
    observe_prefill: ClassVar[bool] = False  # also observe every query of multi-token forwards (prefill)
    variable_budgets: ClassVar[bool] = False  # `allocate` returns per-(layer, row, head) budgets

    def configure(self, budget: int | None, divide_length: int) -> int:
        """Called once by the cache with its budget and slack; returns the slack to use.

        A policy whose paper uses another schedule (every step, every W tokens) returns that slack when the
        user asks for it; the default is the shared trigger.
        """
        return divide_length

    def observe(self, context: ObservationContext) -> None:
        """Update per-slot statistics with one forward's queries (only called when `observes`)."""

    def allocate(self, scores: torch.Tensor, context: ScoringContext) -> torch.Tensor | None:
        """Entries to keep per (layer, row, KV head), [L, b, Hkv] long, or None for `budget` everywhere.

        `scores` are this round's scores with protected entries at +inf and dead slots at -inf.
        """
        return None

    def after_round(self, order: torch.Tensor) -> None:
        """Slot map of a round: new slot i of (layer, row, head) holds old slot order[..., i] (per-slot state)."""

    def select_rows(self, index: torch.Tensor) -> None:
        """The cache kept/reordered batch rows (beam search, batch selection)."""

    def reset(self) -> None:
        """Forget per-sequence state (the cache was reset)."""

    # ---- policies that also rewrite the kept entries' values and biases ----
    compacts: ClassVar[bool] = False  # the cache calls `compact` after the selection of every round
    needs_tokens: ClassVar[bool] = False  # the cache records token ids (ScoringContext.tokens)

    def compact(self, context: "CompactionContext") -> "Compaction | None":
        """New values and log-biases for the entries a round keeps (only called when `compacts`)."""
        return None


@dataclass
class CompactionContext:
    """What `Policy.compact` sees: the round's scoring context and the old slots that survive it."""

    scoring: ScoringContext
    keep: torch.Tensor  # [L, b, Hkv, N] bool: old slots kept by the round (live entries only)


@dataclass
class Compaction:
    """A compaction result indexed by *old* slot; the cache reads it at the kept slots only.

    Keys are never rewritten (compact keys are a subset of the originals, with their true positions).
    """

    values: torch.Tensor | None = None  # [L, b, Hkv, N, D] (None: values unchanged)
    biases: torch.Tensor | None = None  # [L, b, Hkv, N] float32 log-biases (None: biases unchanged)
