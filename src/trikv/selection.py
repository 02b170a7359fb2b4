"""Which entries a compression round protects and keeps, shared by every cache trikv runs (transformers and vLLM).

Protected entries never compete for the budget: the recent window of the method, and the prompt while it
leaves at least `min_decode_room` of the budget to generated tokens (past that, the prompt competes too:
the authors' code drops every generated token instead, which trikv does not copy).
"""

from __future__ import annotations

import torch


def prompt_fits(prompt_lengths: torch.Tensor, budget: int, recent_window: int, min_decode_room: int) -> torch.Tensor:
    """[b] bool: the prompt (real tokens, padding excluded) plus the recent window leave room for generation."""
    return prompt_lengths + recent_window + min_decode_room <= budget


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
    protected = torch.zeros_like(positions, dtype=torch.bool)
    if recent_window > 0:
        protected |= positions >= (current_position - recent_window)[None, :, None, None]
    if protect_prompt:
        keep_prompt = prompt_fits(prompt_lengths, budget, recent_window, min_decode_room)  # [b]
        in_prompt = (positions >= 0) & (positions < prompt_lengths[None, :, None, None])
        protected |= in_prompt & keep_prompt[None, :, None, None]
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
