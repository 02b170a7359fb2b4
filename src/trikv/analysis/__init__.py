"""Analysis of a model's Q/K concentration and distance preferences (the paper's section 3, Figures 2-3).

Modules, one concept each: `capture` (what can be read from a model, per-layer RoPE geometry),
`measure` (streaming sums and real logits per distance), `concentration` (Mean Resultant Length, band
contributions), `reconstruction` (trigonometric series vs real logits), `stability` (agreement between
texts), `plots`, `report` (verdict and Markdown), `runner` (`run_analysis`), `cli` (`trikv analyze`),
`docs` (project results page from saved JSON).
"""

from __future__ import annotations

import importlib

# public name -> (module, attribute), imported on first use (`trikv analyze --help` does not load torch)
_EXPORTS = {
    "capture_qk": ("..qk_capture", "capture_qk"),
    "ANALYSIS_FAMILIES": (".capture", "ANALYSIS_FAMILIES"),
    "AnalysisShape": (".capture", "AnalysisShape"),
    "analysis_shape": (".capture", "analysis_shape"),
    "add_analyze_arguments": (".cli", "add_analyze_arguments"),
    "analyze_main": (".cli", "analyze_main"),
    "load_for_analysis": (".cli", "load_for_analysis"),
    "run_analysis": (".runner", "run_analysis"),
    "default_texts": (".texts", "default_texts"),
    "load_text_files": (".texts", "load_text_files"),
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        try:  # a submodule (`speed.peers`), as after an eager import
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module, __name__), attribute)
    globals()[name] = value
    return value
