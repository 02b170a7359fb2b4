"""Speed helpers: faster compression rounds for the trikv cache.

- `gather_slots`: keep a subset of slots of a [L, b, Hkv, capacity, D] buffer with one row-wise
  `index_select` (memcpy of D-element rows) instead of a `gather` with an expanded index;
  `compact_slots_` does the same in place, one layer at a time (no cache-sized allocation per round).
- `FastTriScorer`: the same TriAttention scores as `trikv.scoring.TriScorer.score` without the
  per-element `index_select` over the head dimension (the band magnitudes are one norm over a view of the
  key in its own layout), one layer at a time so intermediates stay small and cache-resident.
- `spread_step(cache)`: before each decode forward, score a slice of the cache ahead for the next round,
  so the token that triggers a round only selects and compacts (see `FastTriScorer`).
- `accelerate(policy)`: swap a bound TriAttention policy's scorer for the fast one (the cache calls it).
"""

from .rounds import FastTriScorer, accelerate, compact_slots_, gather_slots, spread_step

__all__ = ["FastTriScorer", "accelerate", "compact_slots_", "gather_slots", "spread_step"]
