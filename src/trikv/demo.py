"""The main job: generate a long answer with full attention and with TriAttention, and compare them."""

from __future__ import annotations

import time

import torch

from .architectures import model_shape
from .calibration import load_stats
from .lean import LEAN_FAMILIES
from .generation import GenerationResult, generate
from .models import DEFAULT_MODEL, load_model
from .settings import DEFAULT_DIVIDE_LENGTH

DEFAULT_PROMPT = (
    "Solve step by step, explaining every step in detail, then check the answer: "
    "How many positive whole-number divisors does 196 have? Afterwards, list all of them and verify "
    "each one by division, then explain how the formula for the number of divisors works in general."
)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def agreement(reference: list[int], other: list[int], first: int) -> tuple[int, int, float]:
    """(tokens compared, length of the common prefix, share of equal tokens position by position)."""
    n = min(first, len(reference), len(other))
    prefix = next((i for i in range(n) if reference[i] != other[i]), n)
    same = sum(reference[i] == other[i] for i in range(n))
    return n, prefix, same / max(n, 1)


def comparison_table(full: GenerationResult, tri: GenerationResult, full_wall: float, tri_wall: float, budget: int, beta: int,
                     first: int, layers: str = "layer") -> str:
    """`layers`: what the entry counts are per ("layer"; "global layer" for a hybrid model, whose sliding-window
    layers hold at most their window and are counted in the bytes)."""
    n, prefix, share = agreement(full.tokens[0], tri.tokens[0], first)
    rows = [
        ("", "full attention", f"TriAttention (B={budget}, beta={beta})"),
        ("generated tokens", str(len(full.tokens[0])), str(len(tri.tokens[0]))),
        (f"KV entries / ({layers}, head), final", str(full.final_entries), str(tri.final_entries)),
        (f"KV entries / ({layers}, head), peak", str(full.peak_entries), str(tri.peak_entries)),
        ("KV cache bytes, final", _mib(full.final_cache_bytes), _mib(tri.final_cache_bytes)),
        ("KV cache bytes, peak", _mib(full.peak_cache_bytes), _mib(tri.peak_cache_bytes)),
        ("decode tokens/s", f"{full.decode_tokens_per_second:.1f}", f"{tri.decode_tokens_per_second:.1f}"),
        ("compression rounds", "0", str(tri.compression_rounds)),
        ("time in scoring + selection", "-", f"{tri.scoring_seconds:.2f} s ({100 * tri.scoring_seconds / max(tri.decode_seconds, 1e-9):.1f}%)"),
        ("wall time", f"{full_wall:.1f} s", f"{tri_wall:.1f} s"),
        (f"agreement, first {n} tokens", "-", f"{share:.1%} positionwise, identical prefix {prefix}"),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [" | ".join(cell.ljust(width[i]) for i, cell in enumerate(row)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in width))
    ratio = full.peak_cache_bytes / max(tri.peak_cache_bytes, 1)
    speed = tri.decode_tokens_per_second / max(full.decode_tokens_per_second, 1e-9)
    lines.append(f"peak KV memory {ratio:.1f}x smaller, decode speed ratio {speed:.2f}x (TriAttention / full)")
    return "\n".join(lines)


def run_demo(
    model_name: str = DEFAULT_MODEL,
    stats_path: str | None = None,
    budget: int = 256,
    divide_length: int = DEFAULT_DIVIDE_LENGTH,
    new_tokens: int = 1500,
    prompt: str = DEFAULT_PROMPT,
    compare_first: int | None = None,
    progress: bool = True,
    engine: str = "auto",
) -> str:
    if engine == "mlx":
        return run_demo_mlx(model_name, stats_path, budget, divide_length, new_tokens, prompt, compare_first, progress)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"[trikv demo] loading {model_name} ...", flush=True)
    model, tokenizer = load_model(model_name)
    if engine == "auto":  # the lean engine where it runs the model; transformers' forward for hybrid models
        engine = "lean" if model_shape(model).model_type in LEAN_FAMILIES and not model_shape(model).is_hybrid else "transformers"
    stats = load_stats(stats_path or model_name, model)
    print(f"[trikv demo] stats: {stats.metadata.get('calibration_source')} ({stats.metadata.get('token_count')} tokens)")
    print(f"[trikv demo] engine: {engine}, {torch.get_num_threads()} threads", flush=True)
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, progress=progress, engine=engine)
    started = time.perf_counter()
    full = generate(model, tokenizer, prompt, method="full", **common)
    full_wall = time.perf_counter() - started
    started = time.perf_counter()
    tri = generate(model, tokenizer, prompt, method="triattention", stats=stats, budget=budget, divide_length=divide_length, **common)
    tri_wall = time.perf_counter() - started
    shape = model_shape(model)
    table = comparison_table(full, tri, full_wall, tri_wall, budget, divide_length, compare_first or new_tokens,
                             "global layer" if shape.is_hybrid else "layer")
    if shape.is_hybrid:
        table += (f"\n(KV bytes include the {shape.num_layers - len(shape.cached_layers)} sliding-window layers, "
                  f"{shape.sliding_window} tokens each, for both runs)")
    print()
    print(f"prompt ({full.prompt_lengths[0]} tokens): {prompt}")
    print()
    print(table)
    for label, result in (("full attention", full), ("TriAttention", tri)):
        head = "\n    ".join(result.texts[0].strip().splitlines()[:6])
        print(f"\n--- {label}, first lines ---\n    {head}")
    return table


def run_demo_mlx(model_name: str, stats_path: str | None, budget: int, divide_length: int, new_tokens: int, prompt: str,
                 compare_first: int | None, progress: bool) -> str:
    """The demo through mlx-lm: mlx-lm's full `KVCache` vs trikv's bounded MLX cache (TriAttention)."""
    import trikv.mlx
    from trikv.mlx.generation import generate as mlx_generate

    print(f"[trikv demo] loading {model_name} with mlx-lm ...", flush=True)
    model, tokenizer = trikv.mlx.load(model_name)
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, progress=progress)
    started = time.perf_counter()
    full = mlx_generate(model, tokenizer, prompt, method="full", **common)
    full_wall = time.perf_counter() - started
    started = time.perf_counter()
    tri = mlx_generate(model, tokenizer, prompt, method="triattention", stats=stats_path or model_name, budget=budget,
                       divide_length=divide_length, **common)
    tri_wall = time.perf_counter() - started
    table = comparison_table(full, tri, full_wall, tri_wall, budget, divide_length, compare_first or new_tokens)
    print()
    print(f"prompt ({full.prompt_lengths[0]} tokens): {prompt}")
    print()
    print(table)
    for label, result in (("full attention (mlx-lm KVCache)", full), ("TriAttention (trikv MLX cache)", tri)):
        head = "\n    ".join(result.texts[0].strip().splitlines()[:6])
        print(f"\n--- {label}, first lines ---\n    {head}")
    return table
