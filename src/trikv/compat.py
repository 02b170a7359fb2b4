"""What differs between the transformers releases trikv supports.

transformers 5.24 renamed the cache argument of `model.forward()` / `model.generate()` from
`past_key_values=` to `cache=`. Every call that hands a cache to a model goes through `cache_kwargs`, which
picks the name the installed model class takes: passing the other name does not fail in transformers, the
model silently runs without the cache.
"""

from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=None)
def _cache_argument_of(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    raise TypeError(f"{model_class.__name__}.forward takes neither `cache` nor `past_key_values`")


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword under which `model` (a transformers model) takes its KV cache."""
    return _cache_argument_of(type(model))


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """`{"cache": cache}` or `{"past_key_values": cache}`, whichever the installed transformers understands."""
    return {cache_argument(model): cache}
