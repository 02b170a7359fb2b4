"""Eviction policies, one per file, selected by name through one registry.

`make_policy("rkv", budget=...)`-style lookups go through `REGISTRY`: name -> (class, preset options).
Ablations of a method are registry entries with presets, so benchmarks run them by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .base import Policy, ScoringContext
from .full import FullAttention
from .streaming import StreamingLLM
from .triattention import TriAttention


@dataclass(frozen=True)
class PolicyEntry:
    name: str
    policy_class: type[Policy]
    preset: dict = field(default_factory=dict)
    note: str = ""

    @property
    def rule(self) -> str:
        return self.note or self.policy_class.rule

    @property
    def needs_stats(self) -> bool:
        return any(f.name == "stats" for f in fields(self.policy_class))


REGISTRY: dict[str, PolicyEntry] = {}


def register(name: str, policy_class: type[Policy], note: str = "", **preset) -> None:
    REGISTRY[name] = PolicyEntry(name, policy_class, preset, note)


register("full", FullAttention)
register("triattention", TriAttention)
register("triattention-trig-only", TriAttention, "ablation: S_trig only (no norm term)", use_norm=False)
register("triattention-norm-only", TriAttention, "ablation: S_norm only (no trigonometric term)", use_trig=False)
register("triattention-unweighted-norm", TriAttention, "ablation: norm term A_f|k_f| without (1 - R_f)", weighted_norm=False)
register("triattention-linear-offsets", TriAttention, "ablation: 17 linearly spaced offsets 1..65536", offset_spacing="linear")
register("triattention-max-offsets", TriAttention, "ablation: max over offsets instead of the mean", offset_aggregation="max")
register("triattention-shared-layers", TriAttention, "reference-harness mode: one selection per KV head shared by all layers", shared_across_layers=True)
register("streaming", StreamingLLM)


def make_policy(name: str, **options) -> Policy:
    """Instantiate the policy registered under `name`, with `options` overriding its preset."""
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(REGISTRY)}")
    entry = REGISTRY[name]
    accepted = {f.name for f in fields(entry.policy_class)}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"method {name!r} has no option(s) {unknown}; it accepts {sorted(accepted)}")
    return entry.policy_class(**{**entry.preset, **options})


__all__ = ["Policy", "ScoringContext", "REGISTRY", "make_policy", "register", "FullAttention", "StreamingLLM", "TriAttention"]
