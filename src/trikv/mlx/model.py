"""What trikv reads from an mlx-lm model: its attention shape, its RoPE and its q_proj weights.

The shape and the refusals are those of the transformers path (`architectures.config_shape` on the transformers
config the model's arguments describe): the supported families (llama, qwen2, qwen3, mistral), GQA, and no model
without RoPE. Hybrid models (sliding-window layers next to full-attention ones) are refused: their mlx-lm caches
mix window and full layers, which this cache does not bound.

RoPE is read from the model's own rope modules (`nn.RoPE`: base, scale, traditional; mlx-lm's scaled ropes:
their `_freqs` and YaRN's `mscale`), so linear / llama3 / yarn scaling and both rotation layouts are honoured:
`traditional=True` rotates interleaved pairs (2f, 2f+1), otherwise half pairs (f, f + r/2). Types whose
frequencies change with the sequence length (dynamic NTK, longrope) are refused. The reading is checked by
rotating a probe vector with the module itself at a few positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..architectures import ModelShape, UnsupportedModelError, config_shape

# rope modules whose frequencies depend on the sequence length (the transformers path refuses them too)
DYNAMIC_ROPES = ("DynamicNTKScalingRoPE", "SuScaledRoPE")


@dataclass(frozen=True)
class MlxRope:
    """RoPE of an mlx model as band geometry: band f of a head vector is (x[real_index[f]], x[imag_index[f]]) and
    rotates by omega[f] radians per position, scaled by attention_scaling."""

    omega: np.ndarray  # [F] float64 radians per position (0 for the dimensions past the rotary ones)
    real_index: np.ndarray  # [F] int
    imag_index: np.ndarray  # [F] int
    attention_scaling: float
    layout: str  # "half" | "interleaved"
    head_dim: int
    rotary_dim: int

    def rotate(self, x: np.ndarray, position: int) -> np.ndarray:
        """Reference rotation of pre-RoPE vectors x [..., head_dim] at one position (float64)."""
        angle = position * self.omega
        real, imag = x[..., self.real_index], x[..., self.imag_index]
        out = np.array(x, dtype=np.float64)
        out[..., self.real_index] = (real * np.cos(angle) - imag * np.sin(angle)) * self.attention_scaling
        out[..., self.imag_index] = (real * np.sin(angle) + imag * np.cos(angle)) * self.attention_scaling
        return out


def attention_modules(model) -> list:
    """The attention module of every decoder layer."""
    layers = getattr(model, "layers", None)
    if not layers:
        raise UnsupportedModelError(f"{type(model).__name__} has no decoder layers; pass a model from mlx_lm.load")
    modules = [getattr(layer, "self_attn", None) for layer in layers]
    if any(module is None for module in modules):
        raise UnsupportedModelError(f"{type(model).__name__}: a decoder layer has no `self_attn`; trikv's MLX caches "
                                    "support the llama, qwen2, qwen3 and mistral families")
    return modules


def transformers_config(model):
    """The transformers config of the model's family, from the mlx model's arguments (`model.args`)."""
    from transformers import AutoConfig

    args = getattr(model, "args", None)
    if args is None or not dataclasses.is_dataclass(args):
        raise UnsupportedModelError(f"{type(model).__name__} has no `args`; pass a model from mlx_lm.load")
    fields = {key: value for key, value in dataclasses.asdict(args).items() if value is not None}
    model_type = fields.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as error:
        raise UnsupportedModelError(f"unsupported architecture {model_type!r}: {error}") from None


def mlx_model_shape(model) -> ModelShape:
    """The model's attention shape, by the transformers path's rules; hybrid models are refused."""
    if hasattr(model, "make_cache"):  # mlx-lm models with their own cache layout (sliding windows, SSM states)
        kinds = {type(cache).__name__ for cache in model.make_cache()}
        if kinds != {"KVCache"}:
            raise UnsupportedModelError(
                f"{type(model).__module__.rsplit('.', 1)[-1]!r} model mixes sliding-window and full-attention layers "
                f"(mlx-lm caches {sorted(kinds)}); trikv's MLX caches bound models whose every layer attends to the "
                "whole sequence (run hybrid models on the transformers or vLLM path)")
    shape = config_shape(transformers_config(model))
    if shape.layer_types is not None and set(shape.layer_types) != {"full_attention"}:
        raise UnsupportedModelError(
            f"{shape.model_type!r} model mixes sliding-window and full-attention layers; trikv's MLX caches bound "
            "models whose every layer attends to the whole sequence (run hybrid models on the transformers or vLLM path)"
        )
    modules = attention_modules(model)
    if len(modules) != shape.num_layers:
        raise UnsupportedModelError(f"the model has {len(modules)} decoder layers, its arguments say {shape.num_layers}")
    for module in modules:
        heads, kv_heads = getattr(module, "n_heads", None), getattr(module, "n_kv_heads", None)
        if (heads, kv_heads) != (shape.num_heads, shape.num_kv_heads):
            raise UnsupportedModelError(f"attention with {heads} query / {kv_heads} KV heads, the arguments say "
                                        f"{shape.num_heads} / {shape.num_kv_heads} (a sharded model is not supported)")
    return shape


def read_rope(model, head_dim: int) -> MlxRope:
    """The RoPE every layer applies (they must agree), read from the rope modules and checked with a probe."""
    readings = []
    for index, module in enumerate(attention_modules(model)):
        rope = getattr(module, "rope", None)
        if rope is None:
            raise UnsupportedModelError(f"layer {index} applies no rotary embedding (RoPE); trikv scores keys "
                                        "through their RoPE frequencies and needs it")
        readings.append(_read_module(rope, head_dim))
    first = readings[0]
    for reading in readings[1:]:
        if not (np.array_equal(reading.omega, first.omega) and reading.layout == first.layout
                and reading.attention_scaling == first.attention_scaling):
            raise UnsupportedModelError("the layers apply different RoPEs; trikv's MLX caches need one RoPE for all layers")
    _check_probe(getattr(attention_modules(model)[0], "rope"), first)
    return first


def _read_module(rope, head_dim: int) -> MlxRope:
    kind = type(rope).__name__
    if kind in DYNAMIC_ROPES:
        raise UnsupportedModelError(f"RoPE {kind} changes its frequencies with the sequence length, so keys cached "
                                    "before a change no longer match the scoring geometry; trikv supports static RoPE "
                                    "types (default, linear, llama3, yarn)")
    dims = getattr(rope, "dims", getattr(rope, "dim", None))
    if not isinstance(dims, int) or dims > head_dim or dims % 2:
        raise UnsupportedModelError(f"cannot read the rotary dimensions of {kind} (head_dim {head_dim})")
    freqs = getattr(rope, "_freqs", None)
    if freqs is not None:  # mlx-lm's scaled ropes: wavelengths, applied with scale 1
        inv_freq = 1.0 / np.array(freqs.astype(mx.float32), dtype=np.float64)
    elif getattr(rope, "base", None) is not None:  # mlx.nn.RoPE
        inv_freq = float(rope.scale) * float(rope.base) ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    else:
        raise UnsupportedModelError(f"cannot read the frequencies of the rope module {kind}")
    layout = "interleaved" if getattr(rope, "traditional", False) else "half"
    rest = head_dim - dims
    if layout == "half":
        real = np.concatenate([np.arange(dims // 2), dims + np.arange(rest // 2)])
        imag = np.concatenate([dims // 2 + np.arange(dims // 2), dims + rest // 2 + np.arange(rest // 2)])
    else:
        real, imag = np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)
    omega = np.concatenate([inv_freq, np.zeros(rest // 2)])
    scaling = float(getattr(rope, "mscale", 1.0))
    return MlxRope(omega, real, imag, scaling, layout, head_dim, dims)


def _check_probe(rope, reading: MlxRope) -> None:
    """The module rotates a probe vector as the reading says, at positions near and far (float32 tolerance)."""
    probe = np.random.default_rng(0).standard_normal((1, 1, 1, reading.head_dim)).astype(np.float32)
    for position in (1, 37, 4099):
        got = np.array(rope(mx.array(probe), offset=position).astype(mx.float32), dtype=np.float64)
        want = reading.rotate(probe.astype(np.float64), position)
        if not np.allclose(got, want, rtol=1e-3, atol=2e-3 * np.abs(want).max()):
            raise UnsupportedModelError(f"the rope module {type(rope).__name__} does not rotate as its parameters say "
                                        f"(position {position}); trikv cannot score keys for this model")


def weight_signature(model) -> list[float]:
    """`trikv.calibration.weight_signature` of an mlx model: mean, std and mean |w| of the first and last q_proj
    weights (dequantised for a quantised model), so statistics of another model of the same shape are refused."""
    modules = attention_modules(model)
    numbers = []
    for module in (modules[0], modules[-1]):
        projection = module.q_proj
        weight = projection.weight
        if hasattr(projection, "scales"):  # QuantizedLinear
            weight = mx.dequantize(weight, projection.scales, getattr(projection, "biases", None),
                                   projection.group_size, projection.bits)
        w = weight.astype(mx.float32)
        numbers += [w.mean().item(), mx.sqrt(mx.var(w, ddof=1)).item(), mx.abs(w).mean().item()]
    return numbers


def rope_overrides(config: dict) -> dict:
    """The top-level `rope_theta` / `rope_scaling` mlx-lm reads, from transformers 5's `rope_parameters` (mlx-lm 0.32
    ignores that key, so a folder saved by transformers 5 would run with mlx-lm's default base 10,000)."""
    parameters = config.get("rope_parameters")
    if not isinstance(parameters, dict) or "rope_theta" in config:
        return {}
    overrides = {"rope_theta": parameters["rope_theta"]} if "rope_theta" in parameters else {}
    scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    if scaling.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        overrides["rope_scaling"] = scaling
    return overrides


def require_mlx_lm():
    """The mlx_lm module, or ImportError saying why it is missing: mlx-lm 0.32 needs Python >= 3.11, and on 3.10
    `pip install "trikv[mlx]"` installs MLX alone (the extra's marker skips mlx-lm rather than failing)."""
    import sys

    try:
        import mlx_lm
    except ModuleNotFoundError as error:
        if error.name != "mlx_lm":
            raise
        if sys.version_info < (3, 11):
            raise ImportError(f"trikv's MLX path needs mlx-lm, which needs Python >= 3.11 (this is Python "
                              f"{sys.version_info.major}.{sys.version_info.minor}): `pip install \"trikv[mlx]\"` "
                              "installed MLX without it; use Python 3.11 or newer", name="mlx_lm") from None
        raise ImportError("trikv's MLX path needs mlx-lm: pip install \"trikv[mlx]\"", name="mlx_lm") from None
    return mlx_lm


MLX_DTYPES = ("float32", "bfloat16", "float16")


def load(name_or_path: str, dtype: str | None = None):
    """`(model, tokenizer)` from mlx_lm.load, by trikv's bundled name (its converted folder), a local folder or a
    hub id; the RoPE settings of a transformers 5 config are passed on (`rope_overrides`). `dtype` (one of
    `MLX_DTYPES`) casts the weights after loading; None keeps the checkpoint's dtype, as mlx_lm.load does."""
    import json
    from pathlib import Path

    if dtype is not None and dtype not in MLX_DTYPES:
        raise ValueError(f"trikv.mlx.load: dtype must be one of {', '.join(MLX_DTYPES)} or None, got {dtype!r}")
    mlx_lm = require_mlx_lm()

    from ..models import resolve_model_path

    path = resolve_model_path(name_or_path)
    config_file = Path(path) / "config.json"
    overrides = rope_overrides(json.loads(config_file.read_text())) if config_file.is_file() else {}
    model, tokenizer = mlx_lm.load(path, model_config=overrides or None)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    return model, tokenizer
