"""Where a bounded cache keeps its keys and values: one store per layout.

A store knows tensors, not transformers or policies. Both layouts offer the same operations:

- `begin(new_positions, ...)` once per forward, then `append(layer, keys, values)` per layer, which returns
  what attention reads (the layer's stored keys and values and the state trikv's attention functions need);
- `scoring_view()`: every layer's entries as one [L, b, Hkv, N] view, so a policy always scores all layers
  together (per-layer statistics, cross-layer selections and allocations see the whole cache);
- `retain(...)`: keep the entries a round selected on that view;
- sizes (`length`, `entries()`, `memory_bytes()`, ...), `reserve`, `select_rows` (beam search, batch edits).

`UniformStore`: one [L, b, Hkv, capacity, D] buffer, the same physical length for every (layer, head).
`PackedStore`: per-layer regions without padding, for policies whose layers and heads keep different counts.
"""

from .base import StoreView
from .packed import PackedStore
from .uniform import INITIAL_SLOTS, UniformStore

__all__ = ["INITIAL_SLOTS", "PackedStore", "StoreView", "UniformStore"]
