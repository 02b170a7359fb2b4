"""trikv for MLX: bounded prompt caches for mlx-lm (Apple silicon; mlx's CPU build elsewhere).

    import mlx_lm, trikv.mlx
    model, tokenizer = trikv.mlx.load("smollm2-135m")   # mlx_lm.load, with the RoPE of transformers 5 configs
    cache = trikv.mlx.make_prompt_cache(model, method="triattention", budget=2048, stats="smollm2-135m")
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=8192, prompt_cache=cache,
                           prefill_step_size=trikv.mlx.prefill_step_size(cache))

The cache keeps at most budget + divide_length entries per (layer, KV head) while decoding, and at most one prefill
chunk more while mlx-lm feeds a prompt in chunks of `prefill_step_size` (a round runs after any forward that leaves
budget + divide_length entries): pass the cache's `prefill_chunk_size` (default 512, `prefill_step_size(cache)`)
as mlx-lm's `prefill_step_size` (its own default is 2,048). The same prompt cache continues a conversation:
mlx-lm's chat pattern (each turn's templated message through `stream_generate` with the same `prompt_cache`)
appends to what it holds (`trikv.mlx.Session` runs that pattern, as `trikv.Session` does on the transformers path). Rounds score in MLX with the same statistics files as the torch path. Methods: those that score stored keys only (`methods()`: TriAttention and its
ablations, StreamingLLM, Knorm). `kv_bits=8` or 4 stores the kept entries quantised (memory = budget x bits);
mlx-lm's own `kv_bits=` argument quantises a trikv cache the same way once `quantized_kv_start` is reached.
torch is used once, to read and validate the statistics; rounds run in MLX.
"""

from __future__ import annotations

from .cache import BoundedKV, LayerCache, QuantizedLayerCache
from .model import load
from .prompt_cache import DEFAULT_KV_GROUP_SIZE, bounded_cache, make_prompt_cache, methods, prefill_step_size
from .session import Session

__all__ = [
    "make_prompt_cache",
    "load",
    "methods",
    "bounded_cache",
    "prefill_step_size",
    "Session",
    "BoundedKV",
    "LayerCache",
    "QuantizedLayerCache",
    "DEFAULT_KV_GROUP_SIZE",
]
