"""What the analysis can read from a model: its attention shape, each layer's RoPE geometry, and the q/k vectors.

The analysis is looser than the cache (`architectures.model_shape`): it only *reads* q and k, so it also
accepts models with sliding-window layers and per-layer RoPE bases (Gemma3: local layers rotate with base
10,000, global layers with 1,000,000). Every layer therefore gets its own `RopeGeometry`, read from the
instantiated rotary module (`inv_freq`, or `<layer_type>_inv_freq` where the model keeps one per layer
type), and its own logit scale (`attn.scaling`, e.g. Gemma3's query_pre_attn_scalar**-0.5).

`trikv.qk_capture.capture_qk` wraps the modeling module's `apply_rotary_pos_emb` and hands over both the exact pre-RoPE
vectors (after q_norm/k_norm and biases) and the model's own post-RoPE output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..architectures import (
    SUPPORTED_FAMILIES,
    UnsupportedModelError,
    attention_modules,
    modeling_module,
    rotary_module,
)
from ..geometry import RopeGeometry, layer_frequencies

# Families whose q/k the analysis can read (band layout of each). A superset of what the cache supports.
ANALYSIS_FAMILIES: dict[str, str] = dict(SUPPORTED_FAMILIES)


@dataclass
class AnalysisShape:
    """Attention geometry of a model as the analysis sees it: one RoPE geometry and logit scale per layer."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layout: str
    layer_types: list[str]  # "full_attention" | "sliding_attention" | ...
    sliding_windows: list[int | None]  # per layer; None = sees the whole context
    scaling: list[float]  # per layer: the factor the model multiplies q.k by
    geometries: list[RopeGeometry]  # per layer

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_bands(self) -> int:
        return self.head_dim // 2

    def rope_bases(self) -> list[str]:
        """Human-readable description of each layer's RoPE (type and slowest/fastest frequency)."""
        return [f"{t}: omega {float(g.omega.max()):.3g}..{float(g.omega[g.omega > 0].min()):.3g}" for t, g in zip(self.layer_types, self.geometries)]


def analysis_shape(model: torch.nn.Module) -> AnalysisShape:
    """Validate that the analysis can read `model`'s q/k and return its per-layer geometry."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no `config`; pass a transformers causal LM")
    config = getattr(config, "text_config", None) or config
    model_type = getattr(config, "model_type", None)
    if model_type not in ANALYSIS_FAMILIES:
        raise UnsupportedModelError(
            f"the analysis does not support architecture {model_type!r}; it supports {sorted(ANALYSIS_FAMILIES)}"
        )
    rotary = rotary_module(model)
    if rotary is None:
        raise UnsupportedModelError(f"model of type {model_type!r} has no rotary embedding (RoPE)")
    modeling_module(model)  # raises when q/k cannot be intercepted
    num_layers = config.num_hidden_layers
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    attns = attention_modules(model)
    layout = ANALYSIS_FAMILIES[model_type]
    geometries, scaling, windows = [], [], []
    cache: dict[str, RopeGeometry] = {}
    for layer, attn in enumerate(attns):
        kind = layer_types[layer]
        if kind not in cache:
            inv_freq, attention_scaling = layer_frequencies(rotary, kind)
            cache[kind] = RopeGeometry.build(inv_freq, head_dim, layout, attention_scaling)
        geometries.append(cache[kind])
        scaling.append(float(getattr(attn, "scaling", head_dim**-0.5)))
        if hasattr(attn, "sliding_window"):
            windows.append(attn.sliding_window)
        else:  # Mistral keeps it on the config only
            windows.append(getattr(config, "sliding_window", None))
    return AnalysisShape(
        model_type=model_type,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layout=layout,
        layer_types=layer_types,
        sliding_windows=[int(w) if w else None for w in windows],
        scaling=scaling,
        geometries=geometries,
    )


