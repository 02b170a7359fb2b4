"""Which entries a compression round protects and keeps, shared by every cache trikv runs (transformers and vLLM).

Protected entries never compete for the budget. One rule for every method: a row's prompt is protected while
prompt + `min_decode_room` <= budget, whatever the method's recent window (past that, the prompt competes too,
for every method alike: the authors' code drops every generated token instead, which trikv does not copy).
The method's recent window is protected too; while the prompt is protected, the window lives in what the prompt
leaves (at most budget - prompt tokens), so protected entries never exceed the budget.

`prompt_fits`, `protected_windows` and `protected_entries` take torch tensors or MLX arrays (`arrays.py`):
the MLX cache applies the same rule to its own arrays. `top_entries` is the torch selection.
"""

from __future__ import annotations

import torch

from .arrays import where


def prompt_fits(prompt_lengths: torch.Tensor, budget: int, min_decode_room: int) -> torch.Tensor:
    """[b] bool: the prompt (real tokens, padding excluded) leaves at least `min_decode_room` slots of the budget."""
    return prompt_lengths + min_decode_room <= budget


def protected_windows(prompt_lengths: torch.Tensor, prompt_kept: torch.Tensor, budget: int, recent_window: int) -> torch.Tensor:
    """[b] long: the recent tokens each row protects: the method's window, within what a protected prompt leaves."""
    left = budget - prompt_lengths  # [b] slots a protected prompt leaves
    return where(prompt_kept & (left < recent_window), left, recent_window)


def protected_entries(
    positions: torch.Tensor,  # [L, b, Hkv, N] long: RoPE position of each entry, -1 = dead slot
    current_position: torch.Tensor,  # [b] long: tokens seen (the next RoPE position)
    prompt_lengths: torch.Tensor,  # [b] long: real prompt tokens of each row
    budget: int,
    recent_window: int,
    min_decode_room: int,
    protect_prompt: bool = True,
) -> torch.Tensor:
    """[L, b, Hkv, N] bool: entries kept whatever their score (dead slots may be marked; callers mask them)."""
    prompt_kept = prompt_fits(prompt_lengths, budget, min_decode_room) & protect_prompt  # [b]
    in_prompt = (positions >= 0) & (positions < prompt_lengths[None, :, None, None])
    protected = in_prompt & prompt_kept[None, :, None, None]
    if recent_window > 0:
        window = protected_windows(prompt_lengths, prompt_kept, budget, recent_window)  # [b]
        protected = protected | (positions >= (current_position - window)[None, :, None, None])
    return protected


def top_entries(scores: torch.Tensor, budget: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    """[L, b, Hkv, N] bool: the `budget` highest scores of every (layer, row, KV head), or `counts[l, b, h]` of
    them when the policy allocates its own (PyramidKV, Ada-KV). Protected entries score +inf, dead ones -inf."""
    n = scores.shape[-1]
    if counts is not None:
        k = min(int(counts.max()), n)
        top = scores.topk(k, dim=-1).indices  # descending
        within = torch.arange(k, device=scores.device) < counts[..., None]
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, within)
    if budget >= n:
        return torch.ones_like(scores, dtype=torch.bool)
    if n - budget < budget:  # find the few to evict, not the many to keep
        evicted = scores.topk(n - budget, dim=-1, largest=False, sorted=False).indices
        return torch.ones_like(scores, dtype=torch.bool).scatter_(-1, evicted, False)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(budget, dim=-1, sorted=False).indices, True)
