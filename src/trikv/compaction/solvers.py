"""Batched least-squares solvers for attention matching (AM): ridge, box-constrained LS (NNLS), values.

Every function works on a batch of independent problems (one per (layer, row, KV head)), padded to a common
size with column masks, so one call solves all heads of a layer chunk with batched torch linear algebra.

The systems are usually under-determined: with the n = 64·G selector-window queries and t compact keys,
t > n as soon as the budget exceeds a few hundred entries. Every solve is therefore *ridge-regularised
towards a prior* (a uniform mass rescale for the weights, the original values for C2):

    min_x ||A x - b||^2 + lam ||x - x0||^2,   lam = ridge * ||A||_2^2   (spectral scaling, as AM's c2_ridge)

which is solved in whichever of the primal (t x t) or dual (n x n) forms is smaller:
    x = x0 + (AᵀA + lam I)^-1 Aᵀ r  =  x0 + Aᵀ (AAᵀ + lam I)^-1 r,   r = b - A x0.
With few informative queries the solution stays near the prior instead of exploding along the null space.
"""

from __future__ import annotations

import torch

# smallest relative ridge ever used: keeps rank-deficient systems (duplicate keys, zero queries) solvable
MIN_RIDGE = 1e-8


def spectral_norm_sq(A: torch.Tensor, iters: int = 30) -> torch.Tensor:
    """||A||_2² for a batch [H, n, t] by power iteration on AᵀA (float64, deterministic start). -> [H].

    Power iteration approaches from below; for the nonnegative matrices of attention matching the top
    singular value dominates and 30 steps land within a fraction of a percent. It only scales the ridge.
    (LAPACK's eigvalsh was tried: orders of magnitude slower on small batched matrices here.)
    """
    H, n, t = A.shape
    if n == 0 or t == 0:
        return A.new_zeros(H, dtype=torch.float64)
    A = torch.nan_to_num(A.double())
    v = A.abs().sum(1, keepdim=True).transpose(1, 2) + 1.0 / t  # [H, t, 1]: a positive start
    v = v / v.norm(dim=1, keepdim=True)
    value = torch.zeros(H, dtype=torch.float64, device=A.device)
    for _ in range(iters):
        w = A.transpose(1, 2) @ (A @ v)
        value = w.norm(dim=1)[:, 0]
        v = w / value.clamp_min(1e-300)[:, None, None]
    return value.clamp_min(0)


def ridge_solve(A: torch.Tensor, b: torch.Tensor, x0: torch.Tensor, ridge: float, col_mask: torch.Tensor | None = None):
    """Batched ridge towards a prior: argmin ||A x - b||^2 + lam ||x - x0||^2, lam = ridge ||A||_2^2.

    A [H, n, t], b [H, n, k], x0 [H, t, k]; masked-out columns (col_mask [H, t] False) keep x0.
    Solved in float64 in the smaller of the primal / dual forms; always finite (lam is floored).
    """
    dtype = A.dtype
    A64, b64, x064 = A.double(), b.double(), x0.double()
    if col_mask is not None:
        A64 = A64 * col_mask[:, None, :].to(A64.dtype)
    H, n, t = A64.shape
    if n == 0 or t == 0:
        return x0.clone()
    lam = ridge_lambda(A64, ridge)[:, None, None]  # [H, 1, 1]
    r = b64 - A64 @ x064
    if n <= t:  # dual: x = x0 + Aᵀ (AAᵀ + lam I)^-1 r
        gram = A64 @ A64.transpose(1, 2) + lam * torch.eye(n, dtype=A64.dtype, device=A64.device)
        delta = A64.transpose(1, 2) @ _spd_solve(gram, r)
    else:  # primal: x = x0 + (AᵀA + lam I)^-1 Aᵀ r
        gram = A64.transpose(1, 2) @ A64 + lam * torch.eye(t, dtype=A64.dtype, device=A64.device)
        delta = _spd_solve(gram, A64.transpose(1, 2) @ r)
    x = x064 + delta
    if col_mask is not None:
        x = torch.where(col_mask[:, :, None], x, x064)
    return x.to(dtype)


def ridge_lambda(A: torch.Tensor, ridge: float, norm_sq: torch.Tensor | None = None) -> torch.Tensor:
    """[H] the ridge weight ridge * ||A||_2^2 (floored at MIN_RIDGE relative and a tiny absolute value)."""
    floor = torch.finfo(torch.float64).tiny ** 0.5
    norm_sq = spectral_norm_sq(A) if norm_sq is None else norm_sq
    return (max(ridge, MIN_RIDGE) * norm_sq).clamp_min(floor)


def _spd_solve(gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve symmetric positive (semi)definite systems; Cholesky first, least squares where it fails."""
    factor, info = torch.linalg.cholesky_ex(gram)
    out = torch.cholesky_solve(rhs, factor)
    bad = (info != 0) | ~torch.isfinite(out).flatten(1).all(1)
    if bool(bad.any()):
        out[bad] = torch.linalg.lstsq(gram[bad], rhs[bad], driver="gelsd" if gram.device.type == "cpu" else None).solution
    return torch.nan_to_num(out)


def box_lsq(
    A: torch.Tensor,
    b: torch.Tensor,
    lower: float,
    upper: float,
    prior: torch.Tensor | None = None,
    ridge: float = 1e-3,
    iters: int = 30,
    col_mask: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    tol: float = 1e-10,
) -> torch.Tensor:
    """Batched box-constrained (ridge) least squares: the NNLS of AM's mass fit, with bounds.

        min_w f(w) = ½||A w - b||² + ½ lam ||w - p||²   s.t.  lower <= w <= upper,   lam = ridge ||A||_2²

    A [H, n, t], b [H, n], prior p [H, t] (default: the best single scale c·1, clamped), col_mask [H, t].
    Method: Bertsekas' projected Newton. The variables within eps of a bound with the gradient pushing
    outwards (epsilon-active set) take a diagonally scaled gradient step (onto the bound), the free ones
    the Newton step d_F = -(A_FᵀA_F + lam I)^-1 g_F (through the n x n Woodbury form when n < t), with
    warm-started continuation from larger ridges when `ridge` is tiny; each step backtracks along
    the projection arc clamp(w + s d) until Armijo's condition f(w_s) <= f(w) + 1e-4 gᵀ(w_s - w) holds.
    The active set is identified in finitely many steps, after which convergence is quadratic; it stops
    when the projected gradient is below `tol` (relative) or after `iters` steps. Cost per step:
    O(n·t·min(n, t) + min(n, t)³) per head. The result always lies in [lower, upper]; masked columns
    return the prior (clamped); everything stays finite.
    """
    if not lower <= upper:
        raise ValueError(f"box bounds must satisfy lower <= upper, got [{lower}, {upper}]")
    H, n, t = A.shape
    A = A.double()
    b = b.double()
    if row_weight is not None:
        A = A * row_weight.double()[:, :, None]
        b = b * row_weight.double()
    mask = torch.ones(H, t, dtype=torch.bool, device=A.device) if col_mask is None else col_mask.bool()
    A = torch.nan_to_num(A * mask[:, None, :].to(A.dtype))
    b = torch.nan_to_num(b)
    if prior is None:
        prior = uniform_scale(A, b, mask)[:, None].expand(H, t)
    prior = torch.nan_to_num(prior.double(), nan=1.0).clamp(lower, upper)
    if n == 0 or t == 0:
        return prior.to(torch.float32)
    At = A.transpose(1, 2)
    w = prior.clone()
    # continuation: tiny ridges make the problem degenerate; solve a chain of larger ridges first (warm starts)
    ridges = [r for r in (1e-2, 1e-4) if r > 10 * ridge] + [ridge]
    norm_sq = spectral_norm_sq(A)
    for stage, stage_ridge in enumerate(ridges):
        last = stage == len(ridges) - 1
        w = _projected_newton(A, At, b, w, prior, mask, lower, upper, ridge_lambda(A, stage_ridge, norm_sq)[:, None],
                              iters if last else max(5, iters // 3), tol)
    w = torch.where(mask, w, prior)
    return torch.nan_to_num(w, nan=1.0).clamp(lower, upper).to(torch.float32)


def _projected_newton(A, At, b, w, prior, mask, lower, upper, lam, iters, tol):
    H, n, t = A.shape

    def objective(w):
        r = (A @ w[..., None])[..., 0] - b
        return 0.5 * (r * r).sum(-1) + 0.5 * lam[:, 0] * ((w - prior) ** 2).sum(-1), r

    def gradient(r, w):
        return torch.where(mask, (At @ r[..., None])[..., 0] + lam * (w - prior), torch.zeros_like(w))

    value, r = objective(w)
    g = gradient(r, w)
    scale = (At.abs() @ b.abs()[..., None])[..., 0].amax(-1).clamp_min(1e-300) + lam[:, 0] * prior.abs().amax(-1)
    diagonal = (A * A).sum(1) + lam  # [H, t]: the Hessian's diagonal
    eye_n = torch.eye(n, dtype=A.dtype, device=A.device)
    eye_t = torch.eye(t, dtype=A.dtype, device=A.device)
    for _ in range(iters):
        projected = (w - (w - g).clamp(lower, upper)).abs().amax(-1)  # [H]
        active = projected > tol * scale
        if not bool(active.any()):
            break
        eps = torch.minimum(projected, torch.full_like(projected, 1e-3 * (upper - lower) if upper < float("inf") else 1e-3))[:, None]
        binding = ((w <= lower + eps) & (g > 0)) | ((w >= upper - eps) & (g < 0))
        free = mask & ~binding
        Af = A * free[:, None, :].to(A.dtype)
        gf = torch.where(free, g, torch.zeros_like(g))
        if n < t:  # Woodbury: (lam I + A_FᵀA_F)^-1 v = (v - A_Fᵀ (lam I + A_F A_Fᵀ)^-1 A_F v) / lam
            inner = _spd_solve(Af @ Af.transpose(1, 2) + lam[:, :, None] * eye_n, (Af @ gf[..., None]))
            d = -(gf - (Af.transpose(1, 2) @ inner)[..., 0]) / lam
        else:
            system = Af.transpose(1, 2) @ Af + lam[:, :, None] * eye_t
            system = system + torch.diag_embed((~free).to(A.dtype))  # fixed variables: identity rows
            d = -_spd_solve(system, gf[..., None])[..., 0]
        # variables held at (or within eps of) a bound take a diagonally scaled gradient step onto it
        d = torch.where(free, d, torch.where(mask, -g / diagonal, torch.zeros_like(d)))
        step = torch.ones(H, 1, dtype=A.dtype, device=A.device)
        accepted = ~active
        new_w, new_value, new_r = w, value, r
        for _ in range(40):
            trial = (w + step * d).clamp(lower, upper)
            trial = torch.where(mask, trial, prior)
            trial_value, trial_r = objective(trial)
            decrease = (g * (trial - w)).sum(-1)
            ok = ~accepted & (trial_value <= value + 1e-4 * decrease + 1e-14 * value.abs())
            new_w = torch.where(ok[:, None], trial, new_w)
            new_value = torch.where(ok, trial_value, new_value)
            new_r = torch.where(ok[:, None], trial_r, new_r)
            accepted |= ok
            if bool(accepted.all()):
                break
            step = torch.where(accepted[:, None], step, step * 0.5)
        moved = accepted & active
        if not bool(moved.any()):
            break  # at the float limit
        w, value, r = new_w, new_value, new_r
        g = gradient(r, w)
    return w


def uniform_scale(A: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[H] the single factor c minimising ||c·A·1 - b||: "every kept key stands for c tokens" (1 if undefined)."""
    ones = torch.ones(A.shape[0], A.shape[2], 1, dtype=A.dtype, device=A.device)
    if mask is not None:
        ones = ones * mask[..., None].to(A.dtype)
    m = (A @ ones)[..., 0]  # [H, n]
    num = (m * b).sum(-1)
    den = (m * m).sum(-1)
    c = num / den.clamp_min(torch.finfo(A.dtype).tiny)
    return torch.where(den > 0, c, torch.ones_like(c))


def nnls_pgd(A: torch.Tensor, b: torch.Tensor, lower: float = 0.0, upper: float = float("inf"), iters: int = 500) -> torch.Tensor:
    """Plain batched projected-gradient NNLS (no ridge), AM's `nnls_iters` step: a slow reference and a polish."""
    A = A.double()
    b = b.double()
    scale = spectral_norm_sq(A).clamp_min(torch.finfo(torch.float64).tiny)[:, None]
    w = torch.linalg.lstsq(A, b[..., None]).solution[..., 0].nan_to_num().clamp(lower, upper)
    At = A.transpose(1, 2)
    for _ in range(iters):
        grad = (At @ (A @ w[..., None] - b[..., None]))[..., 0]
        w = (w - grad / scale).clamp(lower, upper)
    return w
