"""Eviction policies, one per file, selected by name through one registry.

`make_policy("rkv", budget=...)`-style lookups go through `REGISTRY`: name -> (class, preset options).
Ablations of a method are registry entries with presets, so benchmarks run them by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .adakv import AdaKV
from .base import ObservationContext, Policy, ScoringContext
from .full import FullAttention
from .h2o import H2O
from .knorm import KnormPress
from .lazy_eviction import LazyEviction
from .pyramidkv import PyramidKV
from .raas import RaaS
from .random_eviction import RandomEviction
from .rkv import RKV
from .rpc import RPC
from .snapkv import DECODE_PORT, SnapKV
from .streaming import StreamingLLM
from .tova import TOVA
from .triattention import TriAttention
from .vatp import VATP
from .tam import PAM, TAM, SelectorWindow
from .hybrid import TriAttentionAM
from .tri_window import TriAttentionWindow
from .tri_dedup import TriAttentionDedup


@dataclass(frozen=True)
class PolicyEntry:
    name: str
    policy_class: type[Policy]
    preset: dict = field(default_factory=dict)
    note: str = ""
    source: str = ""  # where the rule comes from, where that is not its class's paper (a variant of trikv's own)

    @property
    def rule(self) -> str:
        return self.note or self.policy_class.rule

    @property
    def needs_stats(self) -> bool:
        return any(f.name == "stats" for f in fields(self.policy_class))


REGISTRY: dict[str, PolicyEntry] = {}


def register(name: str, policy_class: type[Policy], note: str = "", source: str = "", **preset) -> None:
    REGISTRY[name] = PolicyEntry(name, policy_class, preset, note, source)


register("full", FullAttention)
register("triattention", TriAttention)
register("triattention-trig-only", TriAttention, "ablation: S_trig only (no norm term)", use_norm=False)
register("triattention-norm-only", TriAttention, "ablation: S_norm only (no trigonometric term)", use_trig=False)
register("triattention-unweighted-norm", TriAttention, "ablation: norm term A_f|k_f| without (1 - R_f)", weighted_norm=False)
register("triattention-linear-offsets", TriAttention, "ablation: 17 linearly spaced offsets 1..65536", offset_spacing="linear")
register("triattention-max-offsets", TriAttention, "ablation: max over offsets instead of the mean", offset_aggregation="max")
register("triattention-shared-layers", TriAttention, "reference-harness mode: one selection per KV head shared by all layers", shared_across_layers=True)
register("triattention-union", TriAttention, "reference global mode: union of every head's top-B, one token set for all layers and heads", union_selection=True)
# beyond the paper: statistics for long horizons + the recent queries' attention for short ones
register("triattention-window", TriAttentionWindow)
register("triattention-recent", TriAttention, "triattention + the 32 most recent tokens protected (triattention-window's "
         "window without its attention term)", source="trikv's own variant of TriAttention (the paper protects no recent "
         "window)", recent_window=32)
# beyond the paper: the statistics' ranking + R-KV's penalty on near-duplicate keys (repeated lines)
register("triattention-dedup", TriAttentionDedup)
register("triattention-dedup-only", TriAttentionDedup, "ablation: triattention-dedup's redundancy term without its recent window",
         recent_window=0)
register("streaming", StreamingLLM)
# decode-time versions on the same cache, budget, trigger and prompt protection
register("h2o", H2O)
register("snapkv", SnapKV)
register("snapkv-decode", SnapKV, "SnapKV's decode-time port in the R-KV / TriAttention papers (their \"SnapKV\"): "
         "w = 8, kernel 7, max pooling, max over the group's logits, softmax over non-window keys", **DECODE_PORT)
register("pyramidkv", PyramidKV)
register("adakv", AdaKV)
register("tova", TOVA)
register("knorm", KnormPress)
# the control: what any eviction at the same budget keeps
register("random", RandomEviction)
register("rkv", RKV)
register("rkv-importance-only", RKV, "ablation: R-KV's pooled window attention alone (λ = 1, no redundancy term); "
         "the same rule as snapkv-decode", mix_lambda=1.0)
register("lazyeviction", LazyEviction)
register("raas", RaaS)
register("rpc", RPC)
register("vatp", VATP)
# attention matching changes values and per-key biases, not only the selection
register("tam", TAM)
register("tam-alloc-only", TAM, "TAM ablation: segments and sqrt(w n) allocation, no pivots", pivot_multiplier=0.0)
register("tam-pivots-only", TAM, "TAM ablation: pivots, one segment (PAM + pivots)", segmentation="none")
register("tam-omp", TAM, "TAM with OMP key selection on the mass (global, after the pivots)", selection="omp")
register("pam", PAM)
register("selector-window", SelectorWindow)
register("tam-shared", TAM, "TAM on the shared trigger (rounds at budget + divide_length, not every 1024 tokens)", schedule="shared")
register("pam-shared", PAM, "PAM on the shared trigger (rounds at budget + divide_length)", schedule="shared")
register("selector-window-shared", SelectorWindow, "selector-window eviction on the shared trigger", schedule="shared")
register("tri-am", TriAttentionAM)
register("tri-am-recent", TriAttentionAM, "hybrid, reference queries also include the last 64 post-RoPE queries", recent_queries=64)


def make_policy(name: str, **options) -> Policy:
    """Instantiate the policy registered under `name`, with `options` overriding its preset."""
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(REGISTRY)}")
    entry = REGISTRY[name]
    accepted = {f.name for f in fields(entry.policy_class)}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"method {name!r} has no option(s) {unknown}; it accepts {sorted(accepted)}")
    policy = entry.policy_class(**{**entry.preset, **options})
    policy.name = name  # a registry variant reports its own name (snapkv-decode, triattention-trig-only, ...)
    return policy


def scores_keys_only(policy_class) -> bool:
    """A method whose round needs nothing but the stored keys and their positions: no observed queries, per-step
    statistics, rewritten values, per-head budgets or token ids, and a row's scores depend on that row alone.
    These run in every backend (transformers, vLLM, MLX)."""
    return (
        policy_class.evicts
        and getattr(policy_class, "query_window", 0) == 0
        and not policy_class.observes
        and not policy_class.compacts
        and not policy_class.variable_budgets
        and not policy_class.needs_tokens
        and policy_class.scores_rows_independently
    )


def key_only_methods() -> list[str]:
    """Registered methods that score stored keys only (`scores_keys_only`), in registry order."""
    return [name for name, entry in REGISTRY.items() if scores_keys_only(entry.policy_class)]


def describe_methods() -> list[tuple[str, str]]:
    """(name, rule) of every registered method, in registry order (`trikv methods`)."""
    return [(entry.name, entry.rule) for entry in REGISTRY.values()]


def methods_markdown() -> str:
    """A Markdown table of every registered method: its rule, the publication it comes from, whether it needs
    calibration statistics and which backends run it (vLLM and MLX run the methods that score stored keys only)."""
    everywhere = set(key_only_methods())
    lines = ["# Methods", "",
             "Generated by `trikv methods --markdown` from the method registry (`src/trikv/policies/`); do not edit by "
             "hand. A method's name promises its published rule; trikv's own variants and the ablations have names of "
             "their own. Every method runs on the same cache, trigger (a round at budget + divide_length), budget "
             "accounting and prompt protection. vLLM and MLX run the methods that score stored keys only (no queries, "
             "per-step statistics or rewritten values).", "",
             "| method | rule | from | statistics | backends |", "|---|---|---|---|---|"]
    for name, entry in REGISTRY.items():
        paper = entry.policy_class.paper or "-"
        if entry.source:
            paper = entry.source
        elif entry.preset and entry.policy_class.paper and not entry.policy_class.paper.startswith("trikv"):
            paper = f"variant of {paper.split(',')[0]}'s method" if entry.note.startswith(("ablation", "reference", "SnapKV's")) else paper
        backends = ("transformers, vLLM, MLX" if name in everywhere else
                    "every backend (its own cache)" if not entry.policy_class.evicts else "transformers")
        needs = "yes" if entry.needs_stats else "no"
        lines.append(f"| `{name}` | {entry.rule.replace('|', chr(92) + '|')} | {paper} | {needs} | {backends} |")
    return "\n".join(lines) + "\n"


def list_methods_table() -> str:
    """A printable two-column table of the registered methods and their rules."""
    rows = describe_methods()
    width = max(len("method"), *(len(name) for name, _ in rows))
    lines = [f"{'method':<{width}}  rule", f"{'-' * width}  {'-' * 4}"]
    lines += [f"{name:<{width}}  {rule}" for name, rule in rows]
    return "\n".join(lines)


__all__ = [
    "Policy",
    "ScoringContext",
    "ObservationContext",
    "REGISTRY",
    "make_policy",
    "register",
    "describe_methods",
    "list_methods_table",
    "methods_markdown",
    "FullAttention",
    "StreamingLLM",
    "TriAttention",
    "H2O",
    "SnapKV",
    "PyramidKV",
    "AdaKV",
    "TOVA",
    "KnormPress",
    "RandomEviction",
    "RKV",
    "LazyEviction",
    "RaaS",
    "RPC",
    "VATP",
    "TAM",
    "PAM",
    "SelectorWindow",
    "TriAttentionAM",
    "TriAttentionWindow",
    "TriAttentionDedup",
]
