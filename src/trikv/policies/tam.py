"""TAM, Thought-Aware Attention Matching (Thought-Aware Attention Matching paper), and the paper's baselines PAM and selector-window eviction.

One round (every P = 1024 generated tokens by default, on the shared cache):
  1. protect the last tau = 20 tokens (and the prompt, through the cache); the region is everything else,
     entries compacted in earlier rounds included (their log-bias b_j enters every score);
  2. reference queries: the post-RoPE queries of the last R = 64 tokens, the G query heads of a KV head
     pooled (n = 64·G probes per KV head);
  3. alpha_j(q): softmax over the whole live cache (prompt and tail included, biases included);
     abar_j = mean_q alpha_j (Eq. 7);
  4. pivotal tokens: region entries with abar_j > c · mean_region(abar), c = 3, kept verbatim (value and
     bias unchanged); if there are more pivots than slots, the highest abar win;
  5. segmentation: the row's logical token sequence is cut after every double newline (token ids; a "\\n"
     token followed by a "\\n"-initial one counts too), segments shorter than l_min = 32 tokens merged into
     the previous one; every entry belongs to the segment of its position;
  6. importance w_i = Σ_{j in S_i ∩ region} abar_j (Eq. 5); the t' = t - |P| remaining slots are split
     t_i ∝ sqrt(w_i n_i) (Eq. 6, floor, t_i >= 1, remainders by largest fraction, capped by the segment's
     non-pivotal entries with water-filling);
  7. inside each segment the t_i non-pivotal entries with the highest RMS attention are kept (AM
     HighestAttnKeys); `selection="omp"` uses OMP on the mass instead (globally, no per-segment split);
  8. one global NNLS per KV head for the biases of the kept non-pivots (box [e^-3, e^3], pivots fixed),
     then one global ridge least-squares fit of their values (compaction/matching.py).
Budget: fixed by default (the whole cache = B entries per (layer, KV head) after a round, t = B minus the
protected entries); `target_ratio=r` keeps min(ceil(r · region), t) instead: with B set to the length at
which to compact (rounds fire at B + P entries), that is the paper's one-shot ratio target.
PAM = the same with one segment and no pivots; selector-window eviction = PAM without fitting (beta = 0,
original values) and mean attention as the key score.
Proposals where the paper is silent are listed in compaction/matching.py; the probes see every entry
(no causal mask inside the selector window).
Cost per round: O(L·Hkv·n·N·D) for the scores, a sort per head, and per KV head an n x n ridge solve and
O(n·t) projected-gradient steps for the biases, the same for the values (n = 64·G).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..compaction.matching import MatchConfig, match_cache
from ..compaction.queries import window_queries
from ..compaction.segments import BoundaryTokens, allocate_batch, ranks_within_groups, segment_ids
from ..compaction.selection import highest_attention_keys, omp_keys
from .attention_scores import QueryAttentionPolicy, layer_chunks, masked_softmax
from .base import Compaction, CompactionContext, ScoringContext

log = logging.getLogger(__name__)

_BOUNDARY_CACHE: dict = {}


def resolve_boundaries(model, boundary_ids=None, tokenizer=None) -> BoundaryTokens:
    """Double-newline token ids: given ids, a given tokenizer, or the model's own tokenizer (decoded once)."""
    if boundary_ids is not None:
        return BoundaryTokens.from_ids(boundary_ids)
    if tokenizer is None:
        path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
        if path in _BOUNDARY_CACHE:
            return _BOUNDARY_CACHE[path]
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as error:  # noqa: BLE001 - any failure means: no tokenizer next to the model
            raise ValueError(
                f"TAM segments the sequence at double newlines and needs the model's tokenizer, but none loads "
                f"from {path!r} ({type(error).__name__}); pass tokenizer=..., boundary_ids=... or segmentation='none'"
            ) from None
        _BOUNDARY_CACHE[path] = BoundaryTokens.from_tokenizer(tokenizer)
        return _BOUNDARY_CACHE[path]
    return BoundaryTokens.from_tokenizer(tokenizer)


@dataclass
class TAM(QueryAttentionPolicy):
    """Thought-aware attention matching: segments, sqrt(w·n) allocation, pivots, global NNLS + value fit."""

    name = "tam"
    rule = "segments at double newlines, t_i ∝ sqrt(w_i n_i), pivots kept, AM biases + values from the last 64 queries, every 1024 tokens"
    paper = 'Liu et al., Thought-Aware KV Cache Compaction for Reasoning via Adaptive Attention Matching (arXiv 2608.12331)'
    interval: int = 1024  # P
    protected_tail: int = 20  # tau
    selector_window: int = 64  # R
    segmentation: str = "newline"  # "newline" (paper), "fixed" (fixed_segment tokens), "none"
    min_segment: int = 32  # l_min
    fixed_segment: int = 256
    allocation: str = "sqrt"  # "sqrt" (Eq. 6) or "size" (t_i ∝ n_i: uniform density)
    pivot_multiplier: float = 3.0  # c; 0 disables pivots
    selection: str = "highest"  # "highest" (HighestAttnKeys per segment) or "omp" (global OMP)
    key_score: str = "rms"  # "rms", "mean" or "max" over the probes
    fit_beta: bool = True
    fit_values: bool = True
    beta_min: float = -3.0
    beta_max: float = 3.0
    nnls_iters: int = 30
    beta_ridge: float = 1e-3
    value_ridge: float = 1e-2
    target_ratio: float | None = None
    schedule: str = "paper"  # "paper": a round every `interval` tokens; "shared": the cache's slack
    boundary_ids: tuple | None = None
    tokenizer: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.segmentation not in ("newline", "fixed", "none"):
            raise ValueError(f"segmentation must be 'newline', 'fixed' or 'none', got {self.segmentation!r}")
        if self.allocation not in ("sqrt", "size"):
            raise ValueError(f"allocation must be 'sqrt' or 'size', got {self.allocation!r}")
        if self.selection not in ("highest", "omp"):
            raise ValueError(f"selection must be 'highest' or 'omp', got {self.selection!r}")
        if self.key_score not in ("rms", "mean", "max"):
            raise ValueError(f"key_score must be 'rms', 'mean' or 'max', got {self.key_score!r}")
        if self.selector_window < 1 or self.interval < 1 or self.protected_tail < 0 or self.min_segment < 1:
            raise ValueError("selector_window and interval must be >= 1, protected_tail >= 0, min_segment >= 1")
        if self.target_ratio is not None and not 0 < self.target_ratio <= 1:
            raise ValueError(f"target_ratio must be in (0, 1], got {self.target_ratio}")
        self.match_config = MatchConfig(
            fit_beta=self.fit_beta, fit_values=self.fit_values, beta_min=self.beta_min, beta_max=self.beta_max,
            nnls_iters=self.nnls_iters, beta_ridge=self.beta_ridge, value_ridge=self.value_ridge,
        )
        # instance-level switches of the policy interface
        self.compacts = self.fit_beta or self.fit_values
        self.needs_tokens = self.segmentation == "newline"
        self.variable_budgets = self.target_ratio is not None
        self.boundaries = BoundaryTokens()
        self.last_round: dict = {}
        self._round = None
        self._warned: list = []

    @property
    def query_window(self) -> int:
        return self.selector_window

    @property
    def recent_window(self) -> int:
        return self.protected_tail

    def bind(self, model, shape) -> None:
        super().bind(model, shape)
        if self.segmentation == "newline":
            self.boundaries = resolve_boundaries(model, self.boundary_ids, self.tokenizer)

    def configure(self, budget, divide_length: int) -> int:
        return self._scheduled(divide_length, self.interval)

    def reset(self) -> None:
        self._round = None

    # ---- selection -----------------------------------------------------------------------------
    def score(self, context: ScoringContext) -> torch.Tensor:
        self._require_queries(context)
        positions = context.positions
        L, b, Hkv, N = positions.shape
        live = positions >= 0
        region = context.candidates & live
        protected = (context.protected if context.protected is not None else torch.zeros_like(region)) & live
        biases = context.biases if context.biases is not None else torch.zeros(positions.shape, device=positions.device)
        queries, qmask = window_queries(context.queries, context.query_positions, Hkv)
        n = queries.shape[3]
        abar, kscore = self._attention_stats(queries, qmask, context.keys, biases, live)

        n_region = region.sum(-1)
        target = (context.budget - protected.sum(-1)).clamp_min(0)  # the whole cache = budget
        if self.target_ratio is not None:  # a ratio of the region, never above the budget
            target = torch.minimum(target, torch.ceil(self.target_ratio * n_region.double()).long())
        target = torch.minimum(target, n_region)

        H = L * b * Hkv
        flat = lambda x: x.reshape(H, *x.shape[3:])  # noqa: E731
        f_region, f_abar, f_kscore, f_target = flat(region), flat(abar), flat(kscore), target.reshape(H)
        pivots = torch.zeros_like(f_region)
        if self.pivot_multiplier > 0:
            mean = (f_abar * f_region).sum(-1) / f_region.sum(-1).clamp_min(1)
            pivots = f_region & (f_abar > self.pivot_multiplier * mean[:, None])
            too_many = pivots.sum(-1) > f_target
            if bool(too_many.any()):
                pivots = highest_attention_keys(f_abar, pivots, torch.minimum(pivots.sum(-1), f_target))
        remaining = (f_target - pivots.sum(-1)).clamp_min(0)
        selectable = f_region & ~pivots

        if self.selection == "omp":
            chosen = self._omp(queries, qmask, context.keys, biases, region, pivots.view(L, b, Hkv, N), remaining.view(L, b, Hkv))
            chosen = flat(chosen) & selectable
        else:
            seg = flat(self._segments(context))
            m = int(seg.max()) + 1 if seg.numel() else 1
            if m == 1:
                counts = remaining[:, None]
                seg = torch.zeros_like(seg)
            else:
                sizes = torch.zeros(H, m, dtype=torch.long, device=seg.device).scatter_add_(-1, seg, f_region.long())
                capacity = torch.zeros_like(sizes).scatter_add_(-1, seg, selectable.long())
                if self.allocation == "sqrt":
                    importance = torch.zeros(H, m, dtype=torch.float64, device=seg.device).scatter_add_(-1, seg, (f_abar * f_region).double())
                else:
                    importance = sizes.double()  # sqrt(n_i · n_i) = n_i
                counts = allocate_batch(importance, sizes, remaining, capacity)
            ranks = ranks_within_groups(f_kscore, seg, selectable)
            chosen = selectable & (ranks < counts.gather(-1, seg))
        keep = chosen | pivots
        self._round = {
            "queries": queries,
            "query_mask": qmask,
            "pivots": pivots.view(L, b, Hkv, N),
            "targets": (protected.sum(-1) + target),
            "probes": n,
        }
        scores = kscore.clone()
        return torch.where(keep.view(L, b, Hkv, N), 2.0 + scores, scores)

    def allocate(self, scores: torch.Tensor, context: ScoringContext):
        if self.target_ratio is None or self._round is None:
            return None
        return self._round["targets"]

    def _attention_stats(self, queries, qmask, keys, biases, live):
        """abar [L, b, Hkv, N] (mean attention of the probes) and the key score, softmax over every live entry."""
        L, b, Hkv, n, D = queries.shape
        N = keys.shape[3]
        abar = torch.zeros(L, b, Hkv, N, dtype=torch.float32, device=keys.device)
        kscore = torch.zeros_like(abar)
        count = qmask.sum(-1).clamp_min(1).float()  # [1, b, 1]
        for layers in layer_chunks(L, b * Hkv * n * N):
            logits = torch.matmul(queries[layers].to(keys.dtype), keys[layers].transpose(-1, -2)).float() * self.scaling
            logits = logits + biases[layers][:, :, :, None, :].float()
            mask = live[layers][:, :, :, None, :] & qmask[..., :, None]
            probs = masked_softmax(logits, mask)  # [l, b, Hkv, n, N]
            abar[layers] = probs.sum(3) / count[..., None]
            if self.key_score == "rms":
                kscore[layers] = ((probs * probs).sum(3) / count[..., None]).sqrt()
            elif self.key_score == "mean":
                kscore[layers] = abar[layers]
            else:
                kscore[layers] = probs.amax(3)
        return abar, kscore

    def _segments(self, context: ScoringContext) -> torch.Tensor:
        """[L, b, Hkv, N] segment index of every entry (0 everywhere without segmentation)."""
        positions = context.positions
        if self.segmentation == "none":
            return torch.zeros_like(positions)
        if self.segmentation == "fixed":
            return positions.clamp_min(0) // self.fixed_segment
        if context.tokens is None or not self.boundaries:
            if context.tokens is None and not self._warned:
                log.warning("TAM: the cache recorded no token ids (inputs_embeds?): one segment per round")
                self._warned.append(True)
            return torch.zeros_like(positions)
        tokens = context.tokens.to(positions.device)
        b, T = tokens.shape
        rows = []
        for r in range(b):
            length = int(context.current_position[r])
            ids = segment_ids(tokens[r, :length], self.boundaries, self.min_segment)
            row = torch.zeros(max(T, 1), dtype=torch.long, device=positions.device)
            if length:
                row[:length] = ids
                row[length:] = ids[-1]
            rows.append(row)
        by_position = torch.stack(rows)  # [b, T]
        L, _, Hkv, N = positions.shape
        index = positions.clamp(0, by_position.shape[1] - 1)
        return by_position[None, :, None, :].expand(L, b, Hkv, -1).gather(-1, index)

    def _omp(self, queries, qmask, keys, biases, region, pivots, remaining):
        """Global OMP on the relative region mass, pivots' share removed from the target."""
        L, b, Hkv, n, D = queries.shape
        N = keys.shape[3]
        chosen = torch.zeros(L, b, Hkv, N, dtype=torch.bool, device=keys.device)
        for layer in range(L):
            logits = torch.matmul(queries[layer].to(keys.dtype), keys[layer].transpose(-1, -2)).float() * self.scaling
            logits = (logits + biases[layer][:, :, None, :]).masked_fill(~region[layer][:, :, None, :], float("-inf"))
            m = logits.amax(-1, keepdim=True).clamp_min(-1e30)
            E = torch.exp(logits - m) * qmask[0][..., None]
            y = E.sum(-1, keepdim=True).clamp_min(1e-30)
            E = E / y
            target = 1.0 - (E * pivots[layer][:, :, None, :]).sum(-1)
            sel, _ = omp_keys(
                E.reshape(b * Hkv, n, N), target.reshape(b * Hkv, n), (region[layer] & ~pivots[layer]).reshape(b * Hkv, N),
                remaining[layer].reshape(b * Hkv), k_choice=4, refit_interval=2, lower=1e-12, upper=float(torch.tensor(7.0).exp()),
            )
            chosen[layer] = sel.view(b, Hkv, N)
        return chosen

    # ---- fitting -------------------------------------------------------------------------------
    def compact(self, context: CompactionContext) -> Compaction | None:
        if self._round is None:
            return None
        sc = context.scoring
        live = sc.positions >= 0
        region = sc.candidates & live
        kept = context.keep & region
        fixed = self._round["pivots"] & kept
        biases = sc.biases if sc.biases is not None else torch.zeros(sc.positions.shape, device=sc.positions.device)
        new_b, new_v, diag = match_cache(
            self._round["queries"], self._round["query_mask"], sc.keys, sc.values, biases, region, kept, fixed,
            self.scaling, self.match_config,
        )
        self.last_round = {
            "probes": self._round["probes"],
            "pivots": int(fixed.sum()),
            "kept_region": int(kept.sum()),
            "region": int(region.sum()),
            **{name: float(torch.nanmean(value)) if bool(torch.isfinite(value).any()) else float("nan") for name, value in diag.items()},
        }
        self._round = None
        return Compaction(values=new_v if self.fit_values else None, biases=new_b)


@dataclass
class PAM(TAM):
    """Prefix attention matching (the TAM paper's uniform baseline): TAM without segments or pivots."""

    name = "pam"
    rule = "AM with the last 64 queries: top RMS-attention keys globally, biases + values fitted, every 1024 tokens"
    segmentation: str = "none"
    pivot_multiplier: float = 0.0


@dataclass
class SelectorWindow(TAM):
    """Selector-window eviction (the TAM paper's eviction baseline, after RPC): no biases, original values."""

    name = "selector-window"
    rule = "keep the entries with the highest mean attention of the last 64 queries, every 1024 tokens; no fitting"
    segmentation: str = "none"
    pivot_multiplier: float = 0.0
    key_score: str = "mean"
    fit_beta: bool = False
    fit_values: bool = False
