"""Attention matching (AM) of a compacted block, batched over (layer, row, KV head).

Given, per head, the entries of the region being compacted (keys K, values V, existing log-biases b from
earlier rounds), the subset that stays (`kept`), a subset of those held fixed (`fixed`: TAM's pivotal
tokens, kept verbatim with their bias) and reference queries Q, fit for every other kept entry j

  * a new log-bias beta_j (NNLS with box bounds on u_j = exp(beta_j)) so that the block's attention mass
    matches the region's for every reference query:
        Σ_{j kept} exp(q·k_j·s + beta_j)  ≈  Σ_{j in region} exp(q·k_j·s + b_j)
  * new values C2_j (least squares) so that the block's local attention output matches the region's:
        softmax_kept(q·K·s + beta) · C2  ≈  softmax_region(q·K·s + b) · V.

Mass and outputs matched, the compacted block mixes with every entry outside the region (prompt,
protected tail, future tokens) exactly as the original region would, for these queries.

Choices where the papers are silent:
  * masses are matched *relatively* (each query's equation divided by its region mass), so every
    reference query counts equally whatever its logit scale;
  * both fits are ridge-regularised towards a prior because the systems are under-determined: the
    biases towards "previous bias + one uniform rescale", the values towards the original values;
  * the reference queries are probes: they see every region entry (no causal mask), as in AM's code.
Softmax / exp work is float32, solves float64 (n x n with n the number of queries when t > n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .solvers import box_lsq, ridge_solve, uniform_scale

# elements of one [H, n, N] score block materialised at once
MAX_BLOCK = 1 << 23


@dataclass
class MatchConfig:
    fit_beta: bool = True  # False: biases stay (eviction-style mass deficit)
    fit_values: bool = True  # False: C2 = V[S] ("direct")
    beta_min: float = -3.0  # box for the total log-bias of a fitted key: u in [e^beta_min, e^beta_max]
    beta_max: float = 3.0
    nnls_iters: int = 30  # accelerated projected-gradient steps after the clamped ridge solution
    beta_ridge: float = 1e-3  # lam = beta_ridge * ||A||_2^2 towards the uniform-rescale prior
    value_ridge: float = 1e-2  # lam = value_ridge * ||X||_2^2 towards the original values
    relative_mass: bool = True

    def __post_init__(self):
        if not self.beta_min <= self.beta_max:
            raise ValueError(f"beta_min must be <= beta_max, got {self.beta_min} > {self.beta_max}")
        if self.beta_ridge < 0 or self.value_ridge < 0:
            raise ValueError("ridge coefficients must be >= 0")


def match_heads(
    queries: torch.Tensor,  # [H, n, D]
    query_mask: torch.Tensor,  # [H, n] bool
    keys: torch.Tensor,  # [H, N, D]
    values: torch.Tensor,  # [H, N, Dv]
    biases: torch.Tensor,  # [H, N] float32 (existing log-biases; 0 for fresh tokens)
    region: torch.Tensor,  # [H, N] bool: entries being compacted
    kept: torch.Tensor,  # [H, N] bool: entries that stay (only those inside the region are fitted)
    fixed: torch.Tensor,  # [H, N] bool: kept entries held verbatim (bias and value unchanged)
    scaling: float,
    config: MatchConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Fit biases and values of the kept region entries of H independent heads.

    Returns (biases [H, N] float32, values [H, N, Dv] in values' dtype, diagnostics). Entries outside
    kept & region & ~fixed are returned unchanged; heads that keep their whole region are untouched.
    Diagnostics: per-head mean relative mass error of plain eviction and after the fit, [H] each.
    """
    H, N, D = keys.shape
    n = queries.shape[1]
    new_biases = biases.float().clone()
    new_values = values.clone()
    nan = torch.full((H,), float("nan"))
    diag = {"mass_error_evict": nan.clone(), "mass_error": nan.clone(), "output_error_direct": nan.clone(), "output_error": nan.clone()}
    region = region.bool()
    variable = kept.bool() & region & ~fixed.bool()
    active = ((region & ~kept.bool()).any(-1)) & variable.any(-1) & query_mask.any(-1)  # something evicted, something to fit
    if n == 0 or not bool(active.any()) or not (config.fit_beta or config.fit_values):
        return new_biases, new_values, diag
    heads = torch.nonzero(active).flatten()
    step = max(1, MAX_BLOCK // max(1, n * N))
    for start in range(0, heads.numel(), step):
        index = heads[start : start + step]
        b, v, d = _match_block(
            queries[index].float(), query_mask[index], keys[index].float(), values[index], biases[index].float(),
            region[index], kept[index].bool() & region[index], fixed[index].bool() & kept[index].bool() & region[index],
            variable[index], scaling, config,
        )
        new_biases[index] = b
        new_values[index] = v
        for name, value in d.items():
            diag[name][index.cpu()] = value.cpu()
    return new_biases, new_values, diag


def _match_block(q, qmask, k, v, b, region, kept, fixed, variable, scaling, config: MatchConfig):
    H, n, _ = q.shape
    S = (q @ k.transpose(1, 2)) * scaling  # [H, n, N] logits without bias
    neg = torch.finfo(torch.float32).min
    Sb = (S + b[:, None, :]).masked_fill(~region[:, None, :], neg)
    m = Sb.amax(-1, keepdim=True)  # per-query max over the region
    Eb = torch.exp(Sb - m) * region[:, None, :]  # region weights with existing biases
    y = Eb.sum(-1)  # region mass (>= 1 where the query is valid)
    qvalid = qmask & (y > 0)
    row = torch.where(qvalid, 1.0 / y.clamp_min(1e-30), torch.zeros_like(y)) if config.relative_mass else qvalid.float()
    # unbiased weights of the variable keys: E_qj = exp(S_qj - m_q), the fitted u_j multiplies them
    E = torch.exp((S - m).clamp(max=80.0)) * variable[:, None, :]
    fixed_mass = (Eb * fixed[:, None, :]).sum(-1)
    target = (y - fixed_mass) * row
    t = int(variable.sum(-1).max())
    idx = variable.float().topk(t, dim=-1).indices.sort(-1).values  # [H, t]
    valid = variable.gather(-1, idx)
    E_var = E.gather(2, idx[:, None, :].expand(H, n, t))  # [H, n, t]
    A = E_var * row[..., None]
    u_old = torch.exp(b.gather(-1, idx)).masked_fill(~valid, 1.0)  # eviction: keep the old bias
    lo, hi = math.exp(config.beta_min), math.exp(config.beta_max)
    evict_fit = (A * u_old[:, None, :]).sum(-1)
    diag = {"mass_error_evict": _mean_abs(evict_fit - target, qvalid)}
    if config.fit_beta:
        scale = uniform_scale((A * u_old[:, None, :]).double(), target.double(), valid)[:, None].float()
        prior = (u_old * scale).clamp(lo, hi)
        u = box_lsq(A, target, lo, hi, prior=prior, ridge=config.beta_ridge, iters=config.nnls_iters, col_mask=valid)
        u = torch.where(valid, u, u_old)
    else:
        u = u_old
    diag["mass_error"] = _mean_abs((A * u[:, None, :]).sum(-1) - target, qvalid)
    beta = torch.log(u.clamp_min(1e-30))
    new_b = b.clone()
    new_b.scatter_(-1, idx, torch.where(valid, beta, b.gather(-1, idx)))
    new_b = torch.where(variable, new_b, b)

    # values: X = softmax over the kept entries with the new biases; Y = the region's original outputs
    Vf = v.float()
    Y = (Eb / y.clamp_min(1e-30)[..., None]) @ Vf  # [H, n, Dv]
    W_fixed = Eb * fixed[:, None, :]
    W_var = E_var * u[:, None, :] * qvalid[..., None]
    total = W_fixed.sum(-1) + W_var.sum(-1)
    inv = torch.where(total > 0, 1.0 / total.clamp_min(1e-30), torch.zeros_like(total))
    X_var = W_var * inv[..., None]  # [H, n, t]
    X_fixed = W_fixed * inv[..., None]  # [H, n, N]
    R = Y - X_fixed @ Vf
    V_var = Vf.gather(1, idx[..., None].expand(H, t, Vf.shape[-1]))
    rows = qvalid.float()[..., None]
    diag["output_error_direct"] = _mean_abs_rows(X_var @ V_var - R, qvalid)
    if config.fit_values:
        C2 = ridge_solve(X_var * rows, R * rows, V_var, config.value_ridge, valid)
        C2 = torch.where(valid[..., None], C2, V_var)
    else:
        C2 = V_var
    diag["output_error"] = _mean_abs_rows(X_var @ C2 - R, qvalid)
    new_v = v.clone()
    new_v.scatter_(1, idx[..., None].expand_as(C2), torch.where(valid[..., None], C2.to(v.dtype), v.gather(1, idx[..., None].expand_as(C2))))
    new_v = torch.where(variable[..., None], new_v, v)
    return new_b, new_v, diag


def _mean_abs(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    w = mask.float()
    return (x.abs() * w).sum(-1) / w.sum(-1).clamp_min(1)


def _mean_abs_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid rows of the row's RMS error."""
    per_row = x.pow(2).mean(-1).sqrt()
    return _mean_abs(per_row, mask)


def match_cache(
    queries: torch.Tensor,  # [L, b, Hkv, n, D]
    query_mask: torch.Tensor,  # [L|1, b, Hkv|1, n] bool
    keys: torch.Tensor,  # [L, b, Hkv, N, D]
    values: torch.Tensor,
    biases: torch.Tensor,  # [L, b, Hkv, N]
    region: torch.Tensor,
    kept: torch.Tensor,
    fixed: torch.Tensor,
    scaling: float,
    config: MatchConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """`match_heads` over every (layer, row, KV head) of a cache, layer by layer; full-size biases and values."""
    L, b, Hkv, N, D = keys.shape
    n, Dv = queries.shape[3], values.shape[-1]
    qmask = query_mask.expand(L, b, Hkv, n)
    new_b = biases.float().clone()
    new_v = values.clone()
    diag: dict = {}
    for layer in range(L):
        if not bool(region[layer].any()):
            continue
        lb, lv, ld = match_heads(
            queries[layer].reshape(b * Hkv, n, -1), qmask[layer].reshape(b * Hkv, n),
            keys[layer].reshape(b * Hkv, N, D), values[layer].reshape(b * Hkv, N, Dv), biases[layer].reshape(b * Hkv, N),
            region[layer].reshape(b * Hkv, N), kept[layer].reshape(b * Hkv, N), fixed[layer].reshape(b * Hkv, N),
            scaling, config,
        )
        new_b[layer] = lb.view(b, Hkv, N)
        new_v[layer] = lv.view(b, Hkv, N, Dv)
        for name, value in ld.items():
            diag.setdefault(name, torch.full((L, b, Hkv), float("nan")))[layer] = value.view(b, Hkv)
    return new_b, new_v, diag
