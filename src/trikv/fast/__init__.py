"""Speed helpers (issue 6): faster compression rounds for the trikv cache.

- `gather_slots`: keep a subset of slots of a [L, b, Hkv, capacity, D] buffer with one row-wise
  `index_select` (memcpy of D-element rows) instead of a `gather` with an expanded index.
- `FastTriScorer`: the same TriAttention scores as `trikv.scoring.TriScorer.score` without the
  per-element `index_select` over the head dimension (the band magnitudes are one norm over a view of the
  key in its own layout) and with the two terms summed by one batched GEMM each.
- `accelerate(policy)`: swap a bound TriAttention policy's scorer for the fast one (the cache calls it).
"""

from .rounds import FastTriScorer, accelerate, gather_slots

__all__ = ["FastTriScorer", "accelerate", "gather_slots"]
