"""Whether a reasoning trace is text a bounded cache should be judged on, and not a loop.

Small models sampled for 2,000 tokens often fall into a loop (`\\boxed{}` written 500 times, one line over and
over); a cache that keeps the loop's last lines then looks perfect, whatever it evicted. The rule below was fixed
before the shipped traces were regenerated under it:

- compression: zlib (level 9) compressed bytes / UTF-8 bytes of the trace >= `MIN_COMPRESSION` (0.12; the
  1.5B's non-looping traces measure 0.20-0.30, looping ones 0.01-0.10);
- repetition: the longest run of tokens that occurs twice in the trace (overlaps allowed) is at most
  `MAX_REPEAT_SHARE` (10%) of its tokens (non-looping traces: 1-5%; loops: 30-99%);
- length: the trace reaches the length it was written for (2,048 tokens).

While traces are written, a sampled attempt is rejected, and another seed drawn, when its longest repeat exceeds
`MAX_REPEAT_SHARE` of a whole trace (`MIN_TOKENS`), or when it is at least `COMPRESSION_MIN_TOKENS` long and
compresses below `MIN_COMPRESSION`. A model's trace set enters a page's headline only when at least
`MIN_VALID_SHARE` (75%) of its traces are valid, and only the valid traces are fed; a model that cannot write them
is reported as such.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import numpy as np

MIN_COMPRESSION = 0.12
MAX_REPEAT_SHARE = 0.10
COMPRESSION_MIN_TOKENS = 512  # shorter texts compress too little for the ratio to say anything
MIN_VALID_SHARE = 0.75


@dataclass
class Validity:
    """A trace's validity figures and the rule's verdict."""

    tokens: int
    compression: float  # zlib compressed / raw bytes
    longest_repeat: int  # tokens of the longest run occurring twice
    repeat_share: float  # longest_repeat / tokens
    attempts: int  # sampled answers glued together (separated by a blank line)
    rejected: int  # sampled attempts rejected as loops while the trace was written
    valid: bool

    def as_dict(self) -> dict:
        return asdict(self)


def compression_ratio(text: str) -> float:
    raw = text.encode("utf-8")
    return len(zlib.compress(raw, 9)) / max(1, len(raw))


def suffix_array(ids) -> np.ndarray:
    """Start positions of the suffixes of `ids` in sorted order (prefix doubling: O(n log^2 n), also for loops)."""
    array = np.asarray(ids, dtype=np.int64)
    n = len(array)
    rank = np.unique(array, return_inverse=True)[1].astype(np.int64)
    order = np.argsort(rank, kind="stable")
    step = 1
    while step < n:
        second = np.full(n, -1, dtype=np.int64)
        second[: n - step] = rank[step:]
        order = np.lexsort((second, rank))
        changed = np.ones(n, dtype=np.int64)
        changed[1:] = (rank[order[1:]] != rank[order[:-1]]) | (second[order[1:]] != second[order[:-1]])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(changed) - 1
        if rank.max() == n - 1:
            break
        step *= 2
    return order


def longest_repeat(ids: list[int]) -> int:
    """Length of the longest run of tokens that occurs at least twice in `ids` (overlapping occurrences count): the
    longest common prefix of two neighbouring suffixes in sorted order (Kasai's LCP walk, linear)."""
    n = len(ids)
    if n < 2:
        return 0
    order = suffix_array(ids)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    best = common = 0
    for start in range(n):
        if rank[start] == 0:
            common = 0
            continue
        other = int(order[rank[start] - 1])
        while start + common < n and other + common < n and ids[start + common] == ids[other + common]:
            common += 1
        best = max(best, common)
        common = max(common - 1, 0)
    return best


def attempt_is_loop(text: str, ids: list[int], trace_tokens: int) -> bool:
    """The rejection test for one sampled attempt (see the module docstring)."""
    if longest_repeat(ids) > MAX_REPEAT_SHARE * trace_tokens:
        return True
    return len(ids) >= COMPRESSION_MIN_TOKENS and compression_ratio(text) < MIN_COMPRESSION


def trace_validity(text: str, ids: list[int], attempts: int, rejected: int = 0, min_tokens: int = 0) -> Validity:
    """The figures of one trace (`ids`: its tokens) and the verdict; a trace shorter than `min_tokens` (what it
    was written to reach) is not valid either."""
    repeat = longest_repeat(ids)
    ratio = compression_ratio(text)
    share = repeat / max(1, len(ids))
    valid = ratio >= MIN_COMPRESSION and share <= MAX_REPEAT_SHARE and len(ids) >= min_tokens
    return Validity(tokens=len(ids), compression=ratio, longest_repeat=repeat, repeat_share=share, attempts=attempts,
                    rejected=rejected, valid=valid)


def set_is_usable(validities: list[Validity]) -> bool:
    """A model's trace set enters the headline when at least `MIN_VALID_SHARE` of its traces are valid."""
    return bool(validities) and sum(v.valid for v in validities) >= MIN_VALID_SHARE * len(validities)


RULE_TEXT = (f"valid when zlib compression >= {MIN_COMPRESSION}, the longest repeated token run <= "
             f"{MAX_REPEAT_SHARE:.0%} of the trace and it reaches its length; attempts that loop are rejected while writing (another seed); a "
             f"model's set enters the headline with >= {MIN_VALID_SHARE:.0%} valid traces, and only valid traces are fed")
