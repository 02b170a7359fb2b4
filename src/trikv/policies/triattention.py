"""TriAttention (Mao et al. 2026): keys scored from calibrated pre-RoPE query statistics."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..architectures import ModelShape
from ..calibration import QueryStats
from ..geometry import RopeGeometry
from ..scoring import TriScorer, offset_values, zscore
from .base import Policy, ScoringContext


@dataclass
class TriAttention(Policy):
    """Score = S_trig + S_norm from calibrated query statistics; keep the top-B.

    Rule: per query head, S_trig predicts the mean attention logit over future offsets
    D = {1, 2, 4, ..., 2^16} from mu = E[q_f] and the key; S_norm = sum_f (1 - R_f) A_f |k_f| covers the
    part of the query that is not concentrated. Scores are z-scored per query head over the candidates,
    max-pooled over the G query heads of a KV head, and the top-B kept per (layer, KV head).
    Defaults follow the paper: 17 geometric offsets up to 65536, mean over offsets, weighted norm, z-score,
    max over the group, no recent window, prompt protected (by the cache). Cost: two batched matmuls of
    [N, D] x [D, G] per (layer, KV head) every `divide_length` tokens; nothing per decode step.

    Ablations: `use_trig=False` (norm only), `use_norm=False` (trig only), `weighted_norm=False`
    (A_f |k_f|), `offset_spacing="linear"`, `max_offset`, `offset_aggregation="max"`,
    `group_aggregation="mean"`, `shared_across_layers=True` (the reference harness's mode: one selection
    per KV-head index, from the mean z-score over layers), `union_selection=True` (the reference's global
    mode: every query head nominates its top-B, and one token set, ranked by the max z-score over all heads
    with nominated tokens first, is kept by every layer and head).
    """

    name = "triattention"
    rule = "trigonometric series of calibrated pre-RoPE query centres + norm term; top-B per (layer, KV head)"
    paper = 'Mao et al., TriAttention: Efficient Long Reasoning with Trigonometric KV Compression, arXiv 2604.04921 (2026)'
    scores_rows_independently = True
    stats: QueryStats | None = None
    max_offset: int = 65536
    offset_spacing: str = "geometric"
    use_trig: bool = True
    use_norm: bool = True
    weighted_norm: bool = True
    offset_aggregation: str = "mean"
    group_aggregation: str = "max"
    normalize: bool = True
    shared_across_layers: bool = False
    union_selection: bool = False
    recent_window: int = 0

    def bind(self, model: torch.nn.Module, shape: ModelShape) -> None:
        self._require_stats()
        self.stats.check_matches(model)
        self.bind_geometry(RopeGeometry.from_model(model), shape)

    def _require_stats(self) -> None:
        if self.stats is None:
            raise ValueError(
                "TriAttention needs calibration statistics: pass stats=trikv.load_stats(name_or_path, model)"
            )
        if self.group_aggregation not in ("max", "mean"):
            raise ValueError(f"group_aggregation must be 'max' or 'mean', got {self.group_aggregation!r}")

    def bind_geometry(self, geometry: RopeGeometry, shape: ModelShape, query_heads: torch.Tensor | None = None) -> None:
        """Build the scorer for keys of `shape.num_kv_heads` KV heads (stats already validated).

        query_heads: the statistics' query heads, grouped by KV head, that the scored KV heads serve (a
        tensor-parallel rank holds a slice of the KV heads); default all of them.
        """
        self._require_stats()
        q_mean, q_abs_mean = self.stats.rows(shape.cached_layers)  # the layers the cache bounds
        if query_heads is not None:
            q_mean, q_abs_mean = q_mean[:, query_heads], q_abs_mean[:, query_heads]
        self.scorer = TriScorer(
            q_mean,
            q_abs_mean,
            geometry,
            shape.num_kv_heads,
            offset_values(self.max_offset, self.offset_spacing),
            use_trig=self.use_trig,
            use_norm=self.use_norm,
            weighted_norm=self.weighted_norm,
            offset_aggregation=self.offset_aggregation,
        )

    @property
    def scores_layers_independently(self) -> bool:
        return not (self.shared_across_layers or self.union_selection)

    def for_layers(self, layers: slice) -> "TriAttention":
        super().for_layers(layers)  # refuses the modes that share a selection across layers
        part = copy.copy(self)
        part.scorer = self.scorer.for_layers(layers)
        return part

    @property
    def scores_heads_independently(self) -> bool:
        return not self.union_selection

    def for_heads(self, heads: slice) -> "TriAttention":
        super().for_heads(heads)  # refuses the union mode, which ranks tokens over every head
        part = copy.copy(self)
        part.scorer = self.scorer.for_heads(heads)
        return part

    def round_bytes_per_entry(self, head_dim: int, group: int, entries: int) -> int:
        # float32 keys, band magnitudes, G scores per query head, their z-scores and the max over the group
        return 4 * head_dim + 2 * head_dim + 12 * group + 16

    def score(self, context: ScoringContext) -> torch.Tensor:
        per_query_head = self.scorer.score(context.keys, context.current_position)  # [L, b, Hkv, G, N]
        if self.normalize:
            per_query_head = zscore(per_query_head, context.candidates[:, :, :, None, :])
        if self.union_selection:
            return self._union_scores(per_query_head, context)
        if self.group_aggregation == "max":
            scores = per_query_head.amax(3)
        else:
            scores = per_query_head.mean(3)  # [L, b, Hkv, N]
        if self.shared_across_layers:
            # Slots hold different tokens per layer after a per-layer round; this mode therefore keeps
            # layers aligned by always sharing the selection (slots then match across layers).
            scores = scores.mean(0, keepdim=True).expand_as(scores)
        return scores

    def _union_scores(self, per_query_head: torch.Tensor, context: ScoringContext) -> torch.Tensor:
        L, b, Hkv, G, N = per_query_head.shape
        masked = per_query_head.masked_fill(~context.candidates[:, :, :, None, :], float("-inf"))
        by_row = masked.permute(1, 0, 2, 3, 4).reshape(b, L * Hkv * G, N)  # every head of a row
        k = min(context.budget, N)
        nominated = torch.zeros(b, L * Hkv * G, N, dtype=torch.bool, device=masked.device)
        nominated.scatter_(-1, by_row.topk(k, dim=-1).indices, True)
        combined = by_row.amax(1)  # [b, N]
        in_union = nominated.any(1) & torch.isfinite(combined)
        # nominated tokens first (ranked by combined score), the rest fill in by combined score: integer ranks, exact
        # in float32 (an offset such as combined + 1e6 would round nearby scores into ties)
        order = combined.argsort(-1, descending=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(N, device=order.device).expand_as(order))  # 0 = best
        ranking = torch.where(in_union, 2 * N - rank, N - rank).float().masked_fill(~torch.isfinite(combined), float("-inf"))
        return ranking[None, :, None, :].expand(L, b, Hkv, N)
