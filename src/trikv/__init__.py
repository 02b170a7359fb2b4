"""trikv: keep a long-reasoning LLM's KV cache inside a fixed budget while it generates."""

__version__ = "0.1.0"

from .cache import CompressedCache, TriAttentionCache, make_cache  # noqa: E402
from .calibration import QueryStats, StatsFileError, calibrate, load_stats  # noqa: E402
from .generation import GenerationResult, generate  # noqa: E402
from .models import load_model  # noqa: E402
from .policies import REGISTRY as METHODS  # noqa: E402

__all__ = [
    "CompressedCache",
    "TriAttentionCache",
    "make_cache",
    "QueryStats",
    "StatsFileError",
    "calibrate",
    "load_stats",
    "generate",
    "GenerationResult",
    "load_model",
    "METHODS",
]
