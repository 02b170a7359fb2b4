"""Analysis of a model's Q/K concentration and distance preferences (the paper's section 3, Figures 2-3).

Modules, one concept each: `capture` (what can be read from a model, per-layer RoPE geometry),
`measure` (streaming sums and real logits per distance), `concentration` (Mean Resultant Length, band
contributions), `reconstruction` (trigonometric series vs real logits), `stability` (agreement between
texts), `plots`, `report` (verdict and Markdown), `runner` (`run_analysis`), `cli` (`trikv analyze`),
`docs` (project results page from saved JSON).
"""

from ..qk_capture import capture_qk
from .capture import ANALYSIS_FAMILIES, AnalysisShape, analysis_shape
from .cli import add_analyze_arguments, analyze_main, load_for_analysis
from .runner import run_analysis
from .texts import default_texts, load_text_files

__all__ = [
    "ANALYSIS_FAMILIES",
    "AnalysisShape",
    "analysis_shape",
    "capture_qk",
    "add_analyze_arguments",
    "analyze_main",
    "load_for_analysis",
    "run_analysis",
    "default_texts",
    "load_text_files",
]
