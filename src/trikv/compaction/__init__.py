"""Attention-matching compaction: the machinery behind TAM, PAM and the TriAttention + AM hybrid.

A compacting policy keeps a subset of the cached keys (with their true positions) and rewrites, for the
kept entries, their values and an additive per-key log-bias beta, stored by the cache next to the keys
(float32, [L, b, Hkv, capacity]) and added to the attention logits by trikv's attention functions.

Modules:
  solvers    batched ridge / box-constrained least squares (the NNLS of the mass fit), float64
  selection  highest-attention keys (rms / mean / max) and OMP on the attention mass
  segments   TAM's double-newline segmentation on token ids, short-segment merging, Eq. 6 allocation
  matching   the AM fit of biases (mass) and values (outputs) for many heads at once
  queries    reference queries: the selector window (TAM) or draws from calibrated statistics (hybrid)
The wall time of one compaction round is a benchmark: `python -m trikv.benchmarks.compaction_timing`.
"""

from .matching import MatchConfig, match_cache, match_heads
from .segments import BoundaryTokens, allocate, segment_ids
from .selection import attention_key_scores, highest_attention_keys, omp_keys
from .solvers import box_lsq, ridge_solve

__all__ = [
    "MatchConfig",
    "match_cache",
    "match_heads",
    "BoundaryTokens",
    "allocate",
    "segment_ids",
    "attention_key_scores",
    "highest_attention_keys",
    "omp_keys",
    "box_lsq",
    "ridge_solve",
]
