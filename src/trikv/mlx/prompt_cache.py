"""trikv's MLX prompt caches: what `trikv.mlx.make_prompt_cache` builds for mlx-lm, and the two accessors that read
one back (`prefill_step_size`, `bounded_cache`). The statistics are validated against the mlx model as the torch path
validates them."""

from __future__ import annotations

from ..policies import key_only_methods
from ..settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH, DEFAULT_MIN_DECODE_ROOM, DEFAULT_PREFILL_CHUNK_SIZE, CacheSettings
from .cache import BoundedKV, LayerCache, QuantizedLayerCache, check_quantization
from .model import MlxRope, mlx_model_shape, read_rope, transformers_config, weight_signature
from .scoring import make_scorer

DEFAULT_KV_GROUP_SIZE = 64  # mlx-lm's default quantisation group


def methods() -> list[str]:
    """The methods trikv's MLX caches run: those that score stored keys only."""
    return key_only_methods()


def make_prompt_cache(
    model,
    method: str = "triattention",
    budget: int | None = DEFAULT_BUDGET,
    divide_length: int = DEFAULT_DIVIDE_LENGTH,
    stats=None,
    protect_prompt: bool = True,
    min_decode_room: int = DEFAULT_MIN_DECODE_ROOM,
    kv_bits: int | None = None,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE,
    **options,
) -> list:
    """The prompt cache (one object per decoder layer) to pass to `mlx_lm.generate(..., prompt_cache=...)`.

    method / budget / divide_length / protect_prompt / min_decode_room / options: as trikv's transformers caches
    (`trikv.settings.CacheSettings`); stats: a bundled name, a `trikv calibrate` file or a loaded `QueryStats`,
    validated against the model (shape, RoPE, q_proj weights). `method="full"` returns mlx-lm's own caches.
    kv_bits / kv_group_size: store the entries quantised (mlx-lm's `QuantizedKVCache` format).
    prefill_chunk_size: the prefill chunk the cache is bounded for (give it to mlx-lm as `prefill_step_size`); a
    longer forward still runs, holds all its tokens and warns once.
    """
    if method == "full":
        if budget is not None and budget is not DEFAULT_BUDGET:
            raise ValueError(f"method 'full' keeps every entry and takes no budget (got budget={budget!r})")
        from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

        caches = mlx_prompt_cache(model)
        if kv_bits is not None:
            caches = [cache.to_quantized(group_size=kv_group_size, bits=kv_bits) for cache in caches]
        return caches
    settings = CacheSettings(method, budget, divide_length, protect_prompt, min_decode_room, stats, options,
                             prefill_chunk_size)
    if not settings.keys_only:
        raise ValueError(f"method {method!r} needs observed queries or per-step statistics and has no MLX cache; "
                         f"trikv's MLX caches run: {', '.join(methods())}")
    if settings.budget is None:
        raise ValueError("a trikv MLX cache needs a budget (for no eviction use method='full', mlx-lm's own cache)")
    shape = mlx_model_shape(model)
    rope = read_rope(model, shape.head_dim)
    quantization = None
    if kv_bits is not None:
        check_quantization(shape.head_dim, kv_group_size, kv_bits)
        quantization = (kv_group_size, kv_bits)
    loaded = _load_stats(settings, model, shape, rope) if settings.needs_stats else None
    policy = settings.make_policy(loaded)
    if loaded is not None:
        policy.bind_geometry(_torch_geometry(rope), shape)
    bounded = BoundedKV(settings, policy, make_scorer(policy), shape, quantization)
    face = QuantizedLayerCache if quantization is not None else LayerCache
    return [face(bounded, layer) for layer in range(shape.num_layers)]


def prefill_step_size(prompt_cache: list) -> int:
    """The `prefill_step_size` to give mlx-lm with this prompt cache: a trikv cache's prefill chunk size (mlx-lm's
    own caches: trikv's default chunk, the same rule for every backend)."""
    first = prompt_cache[0] if prompt_cache else None
    if isinstance(first, LayerCache):
        return first.bounded.settings.prefill_chunk_size
    return DEFAULT_PREFILL_CHUNK_SIZE


def bounded_cache(prompt_cache: list) -> BoundedKV:
    """The `BoundedKV` behind a prompt cache from `make_prompt_cache` (rounds, memory, scoring time)."""
    first = prompt_cache[0] if prompt_cache else None
    if not isinstance(first, LayerCache):
        raise ValueError("not a trikv MLX prompt cache (make one with trikv.mlx.make_prompt_cache)")
    return first.bounded


def _torch_geometry(rope: MlxRope):
    """The torch path's `RopeGeometry` of the frequencies the mlx model applies (to build the scorer's constants)."""
    import torch

    from ..geometry import RopeGeometry

    inv_freq = torch.from_numpy(rope.omega[: rope.rotary_dim // 2].copy())
    return RopeGeometry.build(inv_freq, rope.head_dim, rope.layout, rope.attention_scaling)


def _load_stats(settings: CacheSettings, model, shape, rope: MlxRope):
    """The statistics, validated against the mlx model as the torch path validates them: shape, the RoPE of the
    model's config (checksum), the q_proj weights; and the RoPE the mlx model applies must be that one."""
    import numpy as np

    from ..architectures import UnsupportedModelError
    from ..calibration import QueryStats, StatsFileError, load_stats
    from ..geometry import RopeGeometry

    stats = settings.stats if isinstance(settings.stats, QueryStats) else load_stats(settings.stats)
    configured = RopeGeometry.from_config(transformers_config(model))
    if not (np.allclose(configured.omega.numpy(), rope.omega, rtol=1e-5, atol=1e-9)
            and abs(configured.attention_scaling - rope.attention_scaling) < 1e-6):
        raise UnsupportedModelError("the mlx model's rope modules apply other frequencies than its config describes; "
                                    "the statistics' RoPE check cannot vouch for them")
    source = "statistics" if isinstance(settings.stats, QueryStats) else f"statistics {settings.stats}"
    try:
        stats.check_against(shape, configured, lambda: weight_signature(model), source)
    except StatsFileError as error:
        if "rope_checksum" in str(error):
            raise StatsFileError(f"{error}; mlx-lm 0.32 reads `rope_theta` / `rope_scaling`, which transformers 5 saves "
                                 "inside `rope_parameters`: load the model with trikv.mlx.load(path), which passes them "
                                 "on") from None
        raise
    return stats
