"""The few array operations trikv's round rules need, for torch tensors and MLX arrays alike.

The rules of a round (`selection.py`: which entries are protected; `schedule.py`: when a round is due) are
written once, with operators (comparisons, `&`, `|`, `+`, `-`, indexing) and the helpers below, so the
transformers cache, the vLLM worker and the MLX cache run the same code. The library is chosen by the type of
the array given; MLX is imported only when an MLX array is passed, torch only for a torch tensor.
"""

from __future__ import annotations


def library(array):
    """The array library `array` belongs to: the `torch` module or `mlx.core`."""
    module = type(array).__module__
    if module.startswith("torch"):
        import torch

        return torch
    if module.startswith("mlx"):
        import mlx.core as mx

        return mx
    raise TypeError(f"expected a torch tensor or an MLX array, got {type(array).__name__}")


def where(condition, when_true, when_false):
    """Elementwise choice, in the library of `condition` (either branch may be a Python number)."""
    return library(condition).where(condition, when_true, when_false)


def full_like(array, value):
    """An array of `array`'s shape and dtype filled with `value`, in `array`'s library."""
    lib = library(array)
    if lib.__name__ == "torch":
        return lib.full_like(array, value)
    return lib.full(array.shape, value, dtype=array.dtype)


def on_device_of(array, like):
    """`array` on the device of `like` (torch); MLX arrays live in unified memory and are returned as they are."""
    return array.to(like.device) if hasattr(like, "device") and hasattr(array, "to") else array
