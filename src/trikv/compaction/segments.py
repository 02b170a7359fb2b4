"""TAM's thought segmentation (double newlines on token ids) and segment budget allocation (Eq. 6)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BoundaryTokens:
    """Token ids that close a paragraph.

    `full`: ids whose text contains a blank line ("\\n\\n", ".\\n\\n", ")\\n\\n", "\\n\\n\\n", ...).
    `ends` / `starts`: ids whose text ends / starts with "\\n": a token of `ends` followed by one of `starts`
    is a split double newline (SmolLM2 writes "\\n\\n" after a full stop as two "\\n" tokens).
    """

    full: frozenset = frozenset()
    ends: frozenset = frozenset()
    starts: frozenset = frozenset()

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "BoundaryTokens":
        """Decode the vocabulary once (about a second for 50K ids)."""
        full, ends, starts = set(), set(), set()
        for token_id in range(len(tokenizer)):
            try:
                text = tokenizer.decode([token_id])
            except Exception:  # noqa: BLE001 - odd special ids
                continue
            if "\n\n" in text:
                full.add(token_id)
            if text.endswith("\n"):
                ends.add(token_id)
            if text.startswith("\n"):
                starts.add(token_id)
        return cls(frozenset(full), frozenset(ends), frozenset(starts))

    @classmethod
    def from_ids(cls, ids) -> "BoundaryTokens":
        return cls(frozenset(int(i) for i in ids))

    def __bool__(self) -> bool:
        return bool(self.full or (self.ends and self.starts))


def _lookup(ids: torch.Tensor, table: frozenset) -> torch.Tensor:
    if not table:
        return torch.zeros_like(ids, dtype=torch.bool)
    values = torch.tensor(sorted(table), dtype=ids.dtype, device=ids.device)
    return torch.isin(ids, values)


def boundary_flags(ids: torch.Tensor, boundaries: BoundaryTokens) -> torch.Tensor:
    """[T] bool: a paragraph ends after token i (ids [T] long; negative ids are unknown tokens)."""
    flags = _lookup(ids, boundaries.full)
    if boundaries.ends and boundaries.starts and ids.numel() > 1:
        split = _lookup(ids[:-1], boundaries.ends) & _lookup(ids[1:], boundaries.starts)
        flags[1:] |= split  # the boundary closes after the second newline
    return flags


def merge_short(lengths: list[int], min_length: int) -> list[int]:
    """Merge segments shorter than `min_length` into the previous one (the first into the next).

    Returns the merged lengths (same total). Every merged segment has >= min_length tokens unless the total
    is shorter.
    """
    merged: list[int] = []
    for length in lengths:
        if length <= 0:
            continue
        if merged and (length < min_length or merged[-1] < min_length):
            merged[-1] += length
        else:
            merged.append(length)
    return merged


def segment_ids(ids: torch.Tensor, boundaries: BoundaryTokens, min_length: int = 32) -> torch.Tensor:
    """[T] long segment index of every token of a logical sequence (ids [T]), after merging short segments."""
    T = ids.shape[0]
    if T == 0:
        return torch.zeros(0, dtype=torch.long, device=ids.device)
    flags = boundary_flags(ids, boundaries).cpu()
    ends = (torch.nonzero(flags).flatten() + 1).tolist()
    if not ends or ends[-1] != T:
        ends.append(T)
    lengths = np.diff(np.array([0] + ends)).tolist()
    merged = merge_short(lengths, min_length)
    return torch.repeat_interleave(torch.arange(len(merged)), torch.tensor(merged)).to(ids.device)


def allocate(importance, sizes, total: int, capacity=None) -> np.ndarray:
    """TAM's budget split (Eq. 6) for one head: t_i ∝ sqrt(w_i · n_i), Σ t_i = total, t_i <= capacity_i.

    importance w_i >= 0, sizes n_i >= 0 (entries of segment i) and capacity_i (entries that may still be
    selected there, default n_i: TAM passes the non-pivotal ones). Rule: shares proportional to
    sqrt(w_i n_i), water-filled so that no share exceeds n_i; t_i = max(1, floor(share_i)) for every non-empty
    segment; the residual goes one by one to the largest fractional remainders (an excess from the "at
    least one" rule is taken back from the smallest remainders among t_i >= 2). When total is smaller
    than the number of non-empty segments, the `total` segments with the largest sqrt(w n) get one each.
    If every weight is zero the shares fall back to the sizes (uniform density).
    """
    w = np.maximum(np.nan_to_num(np.asarray(importance, dtype=np.float64), nan=0.0, posinf=0.0), 0.0)
    size = np.maximum(np.asarray(sizes, dtype=np.int64), 0)
    n = size if capacity is None else np.minimum(np.maximum(np.asarray(capacity, dtype=np.int64), 0), size)
    total = int(min(max(total, 0), int(n.sum())))
    t = np.zeros_like(n)
    nonempty = n > 0
    if total == 0 or not nonempty.any():
        return t
    s = np.sqrt(w * size)
    if s[nonempty].sum() <= 0:
        s = size.astype(np.float64)
    s = np.where(nonempty, s, 0.0)
    if total < int(nonempty.sum()):  # not enough for one each: the most important segments first
        order = np.lexsort((np.arange(len(s)), -s))
        t[order[:total]] = 1
        return t
    share = _water_fill(s, n.astype(np.float64), float(total))
    t = np.where(nonempty, np.maximum(1, np.floor(share + 1e-9)).astype(np.int64), 0)
    t = np.minimum(t, n)
    frac = share - np.floor(share + 1e-9)
    deficit = total - int(t.sum())
    used = np.zeros(len(t), dtype=bool)
    while deficit > 0:  # largest fractional remainders first, one slot each per pass
        room = t < n
        if not room.any():
            break
        pick = room & ~used
        if not pick.any():
            used[:] = False
            pick = room
        i = int(np.argmax(np.where(pick, frac, -np.inf)))
        t[i] += 1
        used[i] = True
        deficit -= 1
    while deficit < 0:  # the "at least one" rule overshot: take back from the most over-allocated
        reducible = t >= 2
        if not reducible.any():
            break
        i = int(np.argmax(np.where(reducible, t - share, -np.inf)))
        t[i] -= 1
        deficit += 1
    return t


def _water_fill(s: np.ndarray, cap: np.ndarray, total: float) -> np.ndarray:
    """Shares proportional to s, none above cap, summing to total (total <= cap.sum())."""
    share = np.zeros_like(s)
    active = (cap > 0) & (s > 0)
    remaining = total
    for _ in range(len(s) + 1):
        if not active.any() or remaining <= 0:
            break
        proposal = remaining * s / s[active].sum()
        over = active & (proposal >= cap)
        if not over.any():
            share[active] = proposal[active]
            remaining = 0.0
            break
        share[over] = cap[over]
        remaining -= cap[over].sum()
        active &= ~over
    if remaining > 1e-9:  # weights were zero where room is left: fill by size
        room = cap - share
        if room.sum() > 0:
            share += remaining * room / room.sum()
    return share


def allocate_batch(importance: torch.Tensor, sizes: torch.Tensor, totals: torch.Tensor, capacity: torch.Tensor | None = None) -> torch.Tensor:
    """`allocate` for every head: importance/sizes/capacity [H, m], totals [H] -> [H, m] long."""
    w = importance.detach().double().cpu().numpy()
    n = sizes.detach().cpu().numpy()
    c = n if capacity is None else capacity.detach().cpu().numpy()
    T = totals.detach().cpu().numpy()
    out = np.stack([allocate(w[h], n[h], int(T[h]), c[h]) for h in range(w.shape[0])]) if w.shape[0] else np.zeros_like(n)
    return torch.from_numpy(out).to(sizes.device)


def ranks_within_groups(scores: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[H, N] rank (0 = best) of each valid entry's score inside its group; invalid entries get a huge rank."""
    H, N = scores.shape
    big = torch.iinfo(torch.long).max // 4
    key_scores = scores.float().masked_fill(~valid, float("-inf"))
    by_score = key_scores.argsort(dim=-1, descending=True, stable=True)
    grp = groups.masked_fill(~valid, big).gather(-1, by_score)
    by_group = grp.argsort(dim=-1, stable=True)
    order = by_score.gather(-1, by_group)  # entries sorted by (group, -score)
    sorted_groups = groups.masked_fill(~valid, big).gather(-1, order)
    position = torch.arange(N, device=scores.device).expand(H, N)
    is_start = torch.ones_like(sorted_groups, dtype=torch.bool)
    is_start[:, 1:] = sorted_groups[:, 1:] != sorted_groups[:, :-1]
    start = torch.where(is_start, position, torch.zeros_like(position)).cummax(-1).values
    rank_sorted = position - start
    ranks = torch.empty_like(rank_sorted).scatter_(-1, order, rank_sorted)
    return ranks.masked_fill(~valid, big)


def warn_once(flag: list, message: str, *args) -> None:
    if not flag:
        log.warning(message, *args)
        flag.append(True)


__all__ = [
    "BoundaryTokens",
    "boundary_flags",
    "merge_short",
    "segment_ids",
    "allocate",
    "allocate_batch",
    "ranks_within_groups",
]
