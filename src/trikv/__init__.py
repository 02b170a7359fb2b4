"""trikv: keep a long-reasoning LLM's KV cache inside a fixed budget while it generates.

The public names below are imported on first use (PEP 562), so `import trikv` and the `trikv` command's
`--help` do not pay for torch and transformers until something needs them.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> (module, attribute)
_EXPORTS = {
    "CompressedCache": ("cache", "CompressedCache"),
    "TriAttentionCache": ("cache", "TriAttentionCache"),
    "make_cache": ("cache", "make_cache"),
    "QueryStats": ("calibration", "QueryStats"),
    "StatsFileError": ("calibration", "StatsFileError"),
    "calibrate": ("calibration", "calibrate"),
    "load_stats": ("calibration", "load_stats"),
    "generate": ("generation", "generate"),
    "GenerationResult": ("generation", "GenerationResult"),
    "Session": ("session", "Session"),
    "load_model": ("models", "load_model"),
    "METHODS": ("policies", "REGISTRY"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trikv' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(f".{module}", __name__), attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
