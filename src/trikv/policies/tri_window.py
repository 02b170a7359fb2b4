"""TriAttention + recent-query attention: a horizon-aware blend (trikv's own method, not in the paper)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..architectures import ModelShape, attention_sinks
from ..scoring import zscore
from .attention_scores import attention_scaling
from .base import ScoringContext
from .snapkv import window_importance
from .triattention import TriAttention


@dataclass
class TriAttentionWindow(TriAttention):
    """Blend of TriAttention's score and SnapKV's window attention, per (layer, KV head).

    Why: the calibrated statistics predict which keys the *average* future query wants (long horizons);
    the attention of the last few queries predicts the next hundred or so tokens better, because it sees
    the current topic. A key kept by a round must serve both until the next round.
    Rule: z_tri = TriAttention's score (z-scored per query head, max over the group); z_win = the log of
    SnapKV's pooled window attention (the last `window_size` queries, group mean, average pooling with
    `kernel_size`), z-scored over the same candidates; score = (1 - window_weight) z_tri + window_weight z_win.
    The window's own tokens are kept (they have no window score), as SnapKV keeps them.
    Defaults: w = 32 (also the protected recent window), kernel 5, window_weight 0.25, log floor 1e-6; the rest
    as `triattention`. The weight was chosen by scripts/tune_window_weight.py on the statistics' own calibration
    text (no benchmark evaluates it); the sweep is in data/calibration/triattention-window-weight.json.
    `triattention-recent` is the ablation with the window protected and no attention term.
    Cost per round: TriAttention's scoring plus SnapKV's O(Hq·w·N·D) window logits; per step, recording each
    token's query (a ring of w queries per layer).
    """

    name = "triattention-window"
    rule = "0.75 x z-scored TriAttention score + 0.25 x z-scored log attention of the last 32 queries; + the window"
    paper = "trikv's own variant of TriAttention (not in a paper)"
    window_size: int = 32
    kernel_size: int = 5
    window_weight: float = 0.25
    log_floor: float = 1e-6
    recent_window: int | None = None  # default: the window

    def __post_init__(self):
        if self.recent_window is None:
            self.recent_window = self.window_size
        if not 0.0 <= self.window_weight <= 1.0:
            raise ValueError(f"window_weight must lie in [0, 1], got {self.window_weight}")
        if self.window_size <= 0:
            raise ValueError(f"window_size must be positive, got {self.window_size}")
        if self.recent_window < self.window_size:
            raise ValueError(f"recent_window ({self.recent_window}) must cover the window ({self.window_size}): "
                             "window tokens have no window score")

    @property
    def query_window(self) -> int:
        return self.window_size

    sinks = None  # [L, Hq] attention-sink logits (GPT-OSS), set by `bind`

    def bind(self, model: torch.nn.Module, shape: ModelShape) -> None:
        super().bind(model, shape)
        self.scaling = attention_scaling(model, shape.head_dim)
        self.sinks = attention_sinks(model, shape.cached_layers)

    def score(self, context: ScoringContext) -> torch.Tensor:
        tri = super().score(context)  # [L, b, Hkv, N], z-scored per query head then max over the group
        if context.queries is None or context.query_positions is None:
            raise RuntimeError(f"{self.name} scores with recent queries but the cache recorded none")
        attention = window_importance(context, self.scaling, self.window_size, self.kernel_size, "avg", "mean_prob", "all",
                                      sinks=self.sinks)
        window = zscore(attention.clamp_min(self.log_floor).log(), context.candidates)
        if self.normalize:
            tri = zscore(tri, context.candidates)  # max over the group shifts the scale; back to unit spread
        return (1.0 - self.window_weight) * tri + self.window_weight * window
