"""Which model families trikv supports, and the shape facts every other module needs.

A family is supported when its attention (1) applies RoPE through the module-level function
`apply_rotary_pos_emb(q, k, cos, sin)` of its modeling file, (2) hands post-RoPE keys to
`cache.update(...)`, and (3) uses the `rotate_half` ("half") band layout. Calibration relies on (1) to
see the exact pre-RoPE query (after q_norm, where the model has one); the cache relies on (2).

Hybrid models (Gemma-3, GPT-OSS) mix sliding-window layers with full-attention ones (`config.layer_types`):
only the full-attention layers grow with the sequence, so only they are bounded (`ModelShape.cached_layers`);
the sliding layers keep transformers' own sliding-window cache. GPT-OSS adds a learned sink logit per query
head to every softmax denominator (`attention_sinks`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

# model_type -> band layout of its rotary embedding. Every HF family listed here uses rotate_half.
SUPPORTED_FAMILIES: dict[str, str] = {
    "llama": "half",
    "qwen2": "half",
    "qwen3": "half",
    "mistral": "half",
    "gemma3_text": "half",  # hybrid: 5 sliding layers per global one, q_norm / k_norm, own RoPE base per layer type
    "gpt_oss": "half",  # hybrid: sliding and global layers alternate, YaRN, attention sinks (its own _apply_rotary_emb)
}
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class UnsupportedModelError(ValueError):
    """The model cannot be used with a trikv cache or calibration (no RoPE, unknown family, ...)."""


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry of a supported model."""

    model_type: str
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    layout: str  # "half" | "interleaved"
    # per layer "full_attention" | "sliding_attention" (None: every layer attends to the whole sequence)
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # tokens a sliding layer sees (hybrid models)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def cached_layers(self) -> tuple[int, ...]:
        """The layers whose KV a trikv cache bounds: every layer, or the full-attention layers of a hybrid model."""
        if self.layer_types is None:
            return tuple(range(self.num_layers))
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return self.layer_types is not None and len(self.cached_layers) < self.num_layers


SHAPE_KEYS = ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "layout")


def shape_metadata(shape) -> dict:
    """The attention-shape facts stored with statistics and analysis results (any object with SHAPE_KEYS)."""
    return {key: getattr(shape, key) for key in SHAPE_KEYS}


def model_shape(model: torch.nn.Module) -> ModelShape:
    """Validate `model` and return its attention shape; raise `UnsupportedModelError` naming the problem."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no `config`; pass a transformers causal LM")
    shape = config_shape(config)
    rotary = rotary_module(model)
    has_frequencies = rotary is not None and (hasattr(rotary, "inv_freq") or hasattr(rotary, f"{FULL_ATTENTION}_inv_freq"))
    if not has_frequencies:
        raise UnsupportedModelError(f"model of type {shape.model_type!r} has no rotary embedding (RoPE); trikv needs RoPE")
    return shape


def config_shape(config) -> ModelShape:
    """The attention shape of a supported model from its transformers config alone (serving engines hold
    the config but not a transformers model); raise `UnsupportedModelError` naming the problem."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r}; trikv supports {sorted(SUPPORTED_FAMILIES)}"
        )
    layer_types = None
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if sliding:
        kinds = tuple(getattr(config, "layer_types", None) or ())
        if model_type == "mistral" or not kinds:  # every layer slides: nothing grows to bound
            raise UnsupportedModelError(
                f"{model_type!r} model uses sliding-window attention in every layer (sliding_window={sliding}); "
                "trikv bounds full-attention layers, so it supports models with full-attention layers only "
                "(set config.sliding_window=None)"
            )
        unknown = sorted(set(kinds) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise UnsupportedModelError(f"{model_type!r} model has layer types {unknown} that trikv does not know")
        if FULL_ATTENTION not in kinds:
            raise UnsupportedModelError(
                f"{model_type!r} model has no full-attention layer (layer_types are all sliding, window {sliding}): "
                "its KV is already bounded by the window, there is nothing for trikv to bound")
        if SLIDING_ATTENTION in kinds:
            layer_types = kinds
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return ModelShape(
        model_type=model_type,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layout=SUPPORTED_FAMILIES[model_type],
        layer_types=layer_types,
        sliding_window=int(sliding) if layer_types is not None else None,
    )


def attention_sinks(model: torch.nn.Module, layers=None) -> torch.Tensor | None:
    """[L', Hq] float32 sink logits of the given layers (GPT-OSS: a learned logit per query head added to every
    softmax denominator), or None when the model has none."""
    modules = attention_modules(model)
    if getattr(modules[0], "sinks", None) is None:
        return None
    layers = range(len(modules)) if layers is None else layers
    return torch.stack([modules[i].sinks.detach().float().cpu() for i in layers])


def rotary_from_config(config) -> torch.nn.Module:
    """The family's own transformers rotary-embedding module built from `config` (no weights are loaded), so
    that frequencies and scaling are exactly those a transformers model of this config uses."""
    import importlib

    shape = config_shape(config)
    package = {"gemma3_text": "gemma3"}.get(shape.model_type, shape.model_type)  # the text config lives in its family
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    classes = [getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding") and not name.startswith("_")]
    if len(classes) != 1:
        raise UnsupportedModelError(f"cannot find the rotary embedding of {shape.model_type!r} in {module.__name__}")
    return classes[0](config=config)


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The base decoder (`model.model` for a ForCausalLM)."""
    return getattr(model, "model", model)


def rotary_module(model: torch.nn.Module) -> torch.nn.Module | None:
    return getattr(decoder(model), "rotary_emb", None)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `self_attn` module of every decoder layer, in layer order."""
    return [layer.self_attn for layer in decoder(model).layers]


def modeling_module(model: torch.nn.Module):
    """The Python module that defines the model's attention (where `apply_rotary_pos_emb` lives)."""
    attention = attention_modules(model)[0]
    module = sys.modules[type(attention).__module__]
    if not hasattr(module, "apply_rotary_pos_emb"):
        raise UnsupportedModelError(f"{module.__name__} has no apply_rotary_pos_emb; cannot capture pre-RoPE vectors")
    return module
