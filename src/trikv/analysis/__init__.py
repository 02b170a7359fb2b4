"""Analysis of a model's Q/K concentration and distance preferences (the paper's section 3, Figures 2-3).

Modules, one concept each: `capture` (what can be read from a model, per-layer RoPE geometry),
`measure` (streaming sums and real logits per distance), `concentration` (Mean Resultant Length, band
contributions), `reconstruction` (trigonometric series vs real logits), `stability` (agreement between
texts), `plots`, `report` (verdict and Markdown), `runner` (`run_analysis`), `cli` (`trikv analyze`),
`docs` (project results page from saved JSON).
"""

from __future__ import annotations

from ..lazy import lazy_getattr

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


__getattr__ = lazy_getattr(__name__, _EXPORTS)
