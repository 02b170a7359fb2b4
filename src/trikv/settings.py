"""What a bounded KV cache is set with, in one validated object, whatever the backend.

`CacheSettings` holds the method, its budget and slack, the prompt protection, the statistics and the method
options. The transformers cache (`cache.py`), the vLLM settings (`vllm/settings.py`, which add the serving
limits), the MLX cache (`trikv.mlx`) and the benchmarks' configs take their defaults from here and validate
through it; no other module restates them.

Defaults: budget B = 2048 entries per (layer, KV head) after a round, divide_length (beta) = 128 (a round runs
when the cache reaches B + beta), the prompt protected while it leaves `min_decode_room` = 32 slots of the
budget for generated tokens, prompts longer than B + beta prefilled in chunks of `prefill_chunk_size` = 512
tokens with a round between chunks (so a request never holds more than B + beta + 512 entries per (layer, KV
head), whatever its prompt's length), and at most 256 MiB of transient memory per vLLM worker in a round.
Beside them, the calibration length `trikv calibrate` reads by default (measured: docs/calibration.md).
"""

from __future__ import annotations

from os import PathLike
from dataclasses import dataclass, field, fields
from typing import Any

from .validation import integer


class Default(int):
    """A default setting, distinguishable from the same number given explicitly, so that a method can refuse a
    setting it would otherwise silently ignore (`full` and a budget, a paper schedule and divide_length)."""

    def __repr__(self) -> str:
        return f"{int(self)} (default)"


DEFAULT_METHOD = "triattention"
DEFAULT_BUDGET = Default(2048)
DEFAULT_DIVIDE_LENGTH = Default(128)
DEFAULT_MIN_DECODE_ROOM = 32
DEFAULT_PREFILL_CHUNK_SIZE = 512
DEMO_SAMPLING = (0.9, 0.95, 0)  # `trikv demo`'s temperature, top-p and seed (why: trikv/demo.py, DEFAULT_PROMPT)
DEFAULT_ROUND_WORKSPACE_BYTES = 256 * 2**20
# The calibration length docs/calibration.md finds enough on every model it measured (`trikv bench
# calibration-length-report` computes it from docs/runs/calibration; a test keeps this number equal to it):
# `trikv calibrate` reads this many tokens of its text by default and warns below it.
RECOMMENDED_CALIBRATION_TOKENS = 5120


def is_default(value) -> bool:
    """The value is a default left in place, not a number the user gave."""
    return isinstance(value, Default)


def check_recent_window(method: str, recent_window: int, budget: int | None, name: str = "budget") -> None:
    """ValueError unless `budget` (the setting called `name`) is larger than the method's protected recent window:
    a round must be able to keep the window and still choose."""
    if budget is not None and recent_window >= budget:
        raise ValueError(
            f"{name} {budget} is not larger than the protected recent window of {method} ({recent_window} tokens); "
            "raise the budget or shrink the window"
        )


def check_prefill_chunk_size(value) -> int:
    """The prefill chunk size as an int (ValueError naming the setting unless it is an integer >= 2: a one-token
    chunk would be taken for a decode step)."""
    return integer("prefill_chunk_size", value, minimum=2)


def peak_entries_bound(budget: int, divide_length: int, prefill_chunk_size: int) -> int:
    """The most entries per (layer, KV head) a bounded cache ever holds: a round runs whenever it reaches
    budget + divide_length before a forward, and a forward appends at most one prefill chunk."""
    return budget + divide_length + prefill_chunk_size


@dataclass(frozen=True)
class CacheSettings:
    """One bounded cache's settings, validated when made (ValueError naming the setting).

    method: a registered method (`trikv methods`); budget: entries per (layer, KV head) right after a round
    (None: never evict; a method that keeps everything, `full`, takes none); divide_length: the slack beta, a
    round runs at budget + beta; protect_prompt / min_decode_room: the prompt stays out of the competition while
    prompt + min_decode_room <= budget; stats: calibration statistics (a `QueryStats`, a bundled name or a path)
    for methods that need them; options: the method's own options (e.g. {"recent_window": 8});
    prefill_chunk_size: tokens per prefill forward when a prompt (or a session's new turn) would take the cache past
    budget + divide_length, with a round between chunks whenever the cache reaches budget + divide_length, so the
    cache never holds more than budget + divide_length + prefill_chunk_size entries per (layer, KV head).
    """

    method: str = DEFAULT_METHOD
    budget: int | None = DEFAULT_BUDGET
    divide_length: int = DEFAULT_DIVIDE_LENGTH
    protect_prompt: bool = True
    min_decode_room: int = DEFAULT_MIN_DECODE_ROOM
    stats: Any = None
    options: dict = field(default_factory=dict)
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE

    def __post_init__(self) -> None:
        from .policies import REGISTRY

        if self.method not in REGISTRY:
            raise ValueError(f"unknown method {self.method!r}; available: {', '.join(REGISTRY)}")
        policy_class = REGISTRY[self.method].policy_class
        if not policy_class.evicts:
            if self.budget is not None and not is_default(self.budget):
                raise ValueError(f"method {self.method!r} keeps every entry and takes no budget (got budget={self.budget!r})")
            object.__setattr__(self, "budget", None)
        if self.budget is not None:
            object.__setattr__(self, "budget", _keep_default(self.budget, integer("budget", self.budget)))
        object.__setattr__(self, "divide_length", _keep_default(self.divide_length, integer("divide_length", self.divide_length)))
        object.__setattr__(self, "min_decode_room", integer("min_decode_room", self.min_decode_room, minimum=0))
        object.__setattr__(self, "prefill_chunk_size", check_prefill_chunk_size(self.prefill_chunk_size))
        if not isinstance(self.protect_prompt, bool):
            raise ValueError(f"protect_prompt must be True or False, got {self.protect_prompt!r}")
        if not isinstance(self.options, dict):
            raise ValueError(f"options must be a dict of method options, got {self.options!r}")
        if "stats" in self.options:
            raise ValueError("give the statistics as `stats`, not inside `options`")
        if self.needs_stats and self.stats is None:
            raise ValueError(
                f"method {self.method!r} needs calibration statistics: pass stats= a bundled name (e.g. 'smollm2-135m'), "
                "the path of a `trikv calibrate` file or trikv.load_stats(...)"
            )
        if self.stats is not None and not self.needs_stats:
            raise ValueError(f"method {self.method!r} uses no statistics; remove stats")
        check_recent_window(self.method, self.make_policy().recent_window, self.budget)
        # a bundled name or a file: loaded once the settings are valid, checked against the model at bind
        if isinstance(self.stats, (str, PathLike)):
            from .calibration import load_stats

            object.__setattr__(self, "stats", load_stats(self.stats))

    @property
    def needs_stats(self) -> bool:
        from .policies import REGISTRY

        return REGISTRY[self.method].needs_stats

    @property
    def keys_only(self) -> bool:
        """The method scores stored keys only (it runs in every backend)."""
        from .policies import REGISTRY, scores_keys_only

        return scores_keys_only(REGISTRY[self.method].policy_class)

    def make_policy(self, stats=None):
        """The method's policy with these options (and `stats`, a loaded `QueryStats`, when given)."""
        from .policies import make_policy

        options = dict(self.options)
        if stats is not None:
            options["stats"] = stats
        return make_policy(self.method, **options)

    def replace(self, **changes) -> "CacheSettings":
        """A copy with some settings changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return CacheSettings(**(values | changes))


def _keep_default(given, checked: int) -> int:
    """`checked`, still marked as a default when `given` was one."""
    return given if is_default(given) else checked
