"""Key selection for attention matching, batched over heads: highest-attention keys and OMP on the mass."""

from __future__ import annotations

import torch

from .solvers import box_lsq


def attention_key_scores(attn: torch.Tensor, method: str = "rms", query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-key score from attention probabilities attn [H, n, N] over n reference queries -> [H, N].

    "rms" = sqrt(mean_q A²) (AM-HighestAttnKeys default), "mean" = mean_q A (plain eviction), "max" = max_q A.
    Queries outside `query_mask` [H, n] are ignored.
    """
    if query_mask is not None:
        attn = attn * query_mask[:, :, None].to(attn.dtype)
        count = query_mask.sum(-1).clamp_min(1).to(attn.dtype)[:, None]
    else:
        count = torch.full((attn.shape[0], 1), float(max(attn.shape[1], 1)), dtype=attn.dtype, device=attn.device)
    if method == "rms":
        return ((attn * attn).sum(1) / count).sqrt()
    if method == "mean":
        return attn.sum(1) / count
    if method == "max":
        return attn.amax(1)
    raise ValueError(f"unknown key score {method!r}; expected 'rms', 'mean' or 'max'")


def highest_attention_keys(scores: torch.Tensor, candidates: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Boolean [H, N]: the counts[h] best-scoring candidates of each head (ties broken by lower index)."""
    H, N = scores.shape
    masked = scores.float().masked_fill(~candidates, float("-inf"))
    k = int(min(N, int(counts.max()) if counts.numel() else 0))
    chosen = torch.zeros(H, N, dtype=torch.bool, device=scores.device)
    if k == 0:
        return chosen
    top = masked.topk(k, dim=-1).indices
    within = torch.arange(k, device=scores.device)[None, :] < counts[:, None]
    chosen.scatter_(-1, top, within)
    return chosen & candidates


def omp_keys(
    E: torch.Tensor,
    target: torch.Tensor,
    candidates: torch.Tensor,
    counts: torch.Tensor,
    k_choice: int = 1,
    refit_interval: int = 1,
    lower: float = 1e-12,
    upper: float = float(torch.tensor(7.0).exp()),
    ridge: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthogonal matching pursuit on the attention mass (AM-OMP), batched over heads.

    E [H, n, N] exp-scores (row-normalised or not), target [H, n] the mass to reproduce, candidates [H, N],
    counts [H] keys wanted per head. Each iteration adds the `k_choice` candidates most correlated with
    the residual (Σ_q E_qj r_q), refits the weights on the selected set by box-constrained least squares
    (every `refit_interval` iterations) and updates the residual. Returns (chosen [H, N] bool,
    weights [H, N] float32, zero off the chosen set).
    """
    H, n, N = E.shape
    E64 = E.double()
    chosen = torch.zeros(H, N, dtype=torch.bool, device=E.device)
    weights = torch.zeros(H, N, dtype=torch.float64, device=E.device)
    residual = target.double().clone()
    counts = torch.minimum(counts.to(E.device), candidates.sum(-1))
    iteration = 0
    while bool((chosen.sum(-1) < counts).any()):
        need = counts - chosen.sum(-1)  # [H]
        corr = (E64 * residual[:, :, None]).sum(1)  # [H, N]
        corr = corr.masked_fill(~candidates | chosen, float("-inf"))
        k = int(min(k_choice, int(need.max())))
        top = corr.topk(k, dim=-1).indices  # [H, k]
        take = torch.arange(k, device=E.device)[None, :] < need[:, None]
        chosen.scatter_(-1, top, take | chosen.gather(-1, top))
        iteration += 1
        if iteration % refit_interval == 0 or not bool((chosen.sum(-1) < counts).any()):
            weights = _refit(E64, target, chosen, lower, upper, ridge)
            residual = target.double() - (E64 @ weights[..., None])[..., 0]
    return chosen, weights.float()


def _refit(E: torch.Tensor, target: torch.Tensor, chosen: torch.Tensor, lower, upper, ridge) -> torch.Tensor:
    H, n, N = E.shape
    t = int(chosen.sum(-1).max())
    if t == 0:
        return torch.zeros(H, N, dtype=E.dtype, device=E.device)
    index = chosen.double().topk(t, dim=-1).indices  # [H, t]
    valid = chosen.gather(-1, index)
    A = E.gather(2, index[:, None, :].expand(H, n, t))
    w = box_lsq(A, target, lower, upper, ridge=ridge, iters=20, col_mask=valid).double()
    out = torch.zeros(H, N, dtype=E.dtype, device=E.device)
    return out.scatter(-1, index, torch.where(valid, w, torch.zeros_like(w)))
