"""RoPE geometry: how a head vector splits into complex frequency bands, and how fast each band rotates.

A head vector of dimension d splits into F = d/2 bands. In the "half" layout (HF `rotate_half`) band f pairs
dimension f (real part) with f + r/2 (imaginary part), r being the rotary dimension; in the "interleaved"
layout it pairs 2f with 2f+1. RoPE at position p multiplies band f by s * e^{i w_f p}, where w_f is the
model's own `inv_freq` (so every static scaling type is honoured: default, linear, llama3, yarn, ...) and s
its `attention_scaling` (YaRN's mscale). Dynamic types (dynamic NTK, longrope), whose frequencies change with
the sequence length, are refused: keys cached under one set of frequencies would be scored with another.
With partial rotary (r < d) the remaining dimensions are paired the same way and get w = 0: they do not
rotate, and Re(mu * conj(k)) still equals their dot product.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .architectures import FULL_ATTENTION, UnsupportedModelError, config_shape, model_shape, rotary_from_config, rotary_module

# RoPE types whose frequencies depend on the current sequence length (transformers recomputes them on the fly)
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def layer_frequencies(rotary: torch.nn.Module, layer_type: str = FULL_ATTENTION) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) of `layer_type`: the module's `<layer_type>_inv_freq` where it keeps one per
    layer type (Gemma-3), else its single `inv_freq`."""
    for prefix in (f"{layer_type}_", ""):
        inv_freq = getattr(rotary, f"{prefix}original_inv_freq", None)
        if inv_freq is None:
            inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        if inv_freq is not None:
            return inv_freq, float(getattr(rotary, f"{prefix}attention_scaling", getattr(rotary, "attention_scaling", 1.0)))
    raise UnsupportedModelError(f"the rotary embedding has no inverse frequencies for layer type {layer_type!r}")


@dataclass
class RopeGeometry:
    omega: torch.Tensor  # [F] float64, radians per token (0 for non-rotary bands)
    real_index: torch.Tensor  # [F] long, dimension holding the real part of band f
    imag_index: torch.Tensor  # [F] long, dimension holding the imaginary part of band f
    attention_scaling: float
    layout: str
    head_dim: int

    @property
    def num_bands(self) -> int:
        return self.head_dim // 2

    @classmethod
    def build(cls, inv_freq: torch.Tensor, head_dim: int, layout: str = "half", attention_scaling: float = 1.0):
        if layout not in ("half", "interleaved"):
            raise ValueError(f"unknown RoPE layout {layout!r}; expected 'half' or 'interleaved'")
        inv_freq = inv_freq.detach().double().cpu().flatten()
        rotary_dim = 2 * inv_freq.numel()
        if rotary_dim > head_dim or head_dim % 2:
            raise ValueError(f"rotary dimension {rotary_dim} does not fit head_dim {head_dim}")
        rest = head_dim - rotary_dim
        if layout == "half":
            real = torch.cat([torch.arange(rotary_dim // 2), rotary_dim + torch.arange(rest // 2)])
            imag = torch.cat([rotary_dim // 2 + torch.arange(rotary_dim // 2), rotary_dim + rest // 2 + torch.arange(rest // 2)])
        else:
            real = torch.arange(0, head_dim, 2)
            imag = torch.arange(1, head_dim, 2)
        omega = torch.cat([inv_freq, torch.zeros(rest // 2, dtype=torch.float64)])
        return cls(omega, real, imag, float(attention_scaling), layout, head_dim)

    @classmethod
    def from_model(cls, model: torch.nn.Module, layer_type: str = FULL_ATTENTION) -> "RopeGeometry":
        """Frequencies and scaling read from the instantiated rotary module, layout from the model family.
        Models with one RoPE per layer type (Gemma-3: base 10,000 for sliding layers, 1,000,000 for global
        ones) give the geometry of `layer_type`, by default that of the full-attention layers trikv bounds."""
        return cls.from_rotary(rotary_module(model), model_shape(model), layer_type)

    @classmethod
    def from_config(cls, config, layer_type: str = FULL_ATTENTION) -> "RopeGeometry":
        """The geometry a transformers model of `config` has, without building the model."""
        return cls.from_rotary(rotary_from_config(config), config_shape(config), layer_type)

    @classmethod
    def from_rotary(cls, rotary: torch.nn.Module, shape, layer_type: str = FULL_ATTENTION) -> "RopeGeometry":
        rope_type = getattr(rotary, "rope_type", "default")
        if isinstance(rope_type, dict):  # one RoPE per layer type
            rope_type = rope_type.get(layer_type, "default")
        if rope_type in DYNAMIC_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {rope_type!r} changes its frequencies with the sequence length, so keys cached before a "
                f"change no longer match the scoring geometry; trikv supports static RoPE types (default, linear, "
                f"llama3, yarn, ...), not {', '.join(DYNAMIC_ROPE_TYPES)}"
            )
        inv_freq, scaling = layer_frequencies(rotary, layer_type)
        return cls.build(inv_freq, shape.head_dim, shape.layout, scaling)

    def to_bands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Split [..., head_dim] into (real, imag) parts, each [..., F]."""
        real_index = self.real_index.to(x.device)
        imag_index = self.imag_index.to(x.device)
        return x.index_select(-1, real_index), x.index_select(-1, imag_index)

    def to_complex(self, x: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] real -> [..., F] complex (float64 in, complex128 out)."""
        real, imag = self.to_bands(x)
        return torch.complex(real, imag)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE to pre-RoPE vectors `x` [..., n, head_dim] at `positions` [n] (reference implementation)."""
        angle = positions.to(torch.float64)[:, None] * self.omega.to(x.device)  # [n, F]
        bands = self.to_complex(x.double()) * torch.polar(torch.ones_like(angle), angle) * self.attention_scaling
        out = torch.empty(x.shape, dtype=torch.float64, device=x.device)
        out[..., self.real_index] = bands.real
        out[..., self.imag_index] = bands.imag
        return out.to(x.dtype)

    def checksum(self) -> str:
        """Fingerprint of the frequencies and layout, stored with calibration statistics."""
        payload = torch.round(self.omega * 1e9).to(torch.int64).numpy().tobytes()
        payload += f"{self.layout}:{self.head_dim}:{self.attention_scaling:.9g}".encode()
        return hashlib.sha256(payload).hexdigest()[:16]
