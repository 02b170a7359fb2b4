"""Filling a cache with C tokens of the model's own keys (real keys tiled and re-rotated to their positions)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...compat import cache_kwargs


@dataclass
class SeedKV:
    keys: list[torch.Tensor]  # per layer [Hkv, S, D] post-RoPE at positions 0..S-1
    values: list[torch.Tensor]
    token_ids: list[int]  # the seed tokens (the first decode input is taken from them)
    queries: list[torch.Tensor] | None = None  # per layer [Hq, S, D] post-RoPE (for policies that read queries)

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]


def seed_text_ids(tokenizer, vocab_size: int, length: int) -> list[int]:
    """`length` token ids of a shipped English text (random ids when there is no tokenizer)."""
    if tokenizer is not None:
        text_dir = Path(__file__).resolve().parents[2] / "data" / "analysis_texts"
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(text_dir.glob("*.txt")))
        ids = tokenizer(text)["input_ids"]
        while len(ids) < length:
            ids = ids + ids
        return list(ids[:length])
    generator = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab_size, (length,), generator=generator).tolist()


@torch.no_grad()
def make_seed(model, tokenizer=None, length: int = 512) -> SeedKV:
    """A real prefill of `length` tokens: the model's own post-RoPE keys and values of every layer."""
    from transformers import DynamicCache

    from ...qk_capture import capture_pre_rope
    from ...geometry import RopeGeometry

    ids = seed_text_ids(tokenizer, model.config.vocab_size, length)
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    pre_rope: dict[int, torch.Tensor] = {}
    with capture_pre_rope(model, lambda layer, q, k: pre_rope.__setitem__(layer, q[0].detach().clone())):
        model(input_ids=torch.tensor([ids], device=device), **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    keys = [layer.keys[0].clone() for layer in cache.layers]
    values = [layer.values[0].clone() for layer in cache.layers]
    geometry = RopeGeometry.from_model(model)
    positions = torch.arange(length, device=device)
    queries = [geometry.rotate(pre_rope[layer], positions) for layer in range(len(keys))]
    return SeedKV(keys, values, ids, queries)


class Filler:
    """Tiles a seed to any positions, re-rotating each key from its seed position to its true one."""

    def __init__(self, model, seed: SeedKV):
        from ...geometry import RopeGeometry

        self.seed = seed
        self.geometry = RopeGeometry.from_model(model)

    def _rotated(self, seed: torch.Tensor, source: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """seed [H, S, D] post-RoPE rows `source`, rotated from their seed positions to `positions`."""
        x = seed.index_select(1, source).float()
        device = x.device
        delta = (positions - source).double().cpu()
        angle = delta[:, None] * self.geometry.omega[None, :]  # [count, F]
        cos, sin = angle.cos().float().to(device), angle.sin().float().to(device)
        ri, ii = self.geometry.real_index.to(device), self.geometry.imag_index.to(device)
        xr, xi = x.index_select(-1, ri), x.index_select(-1, ii)
        out = torch.empty_like(x)
        out[..., ri] = xr * cos - xi * sin
        out[..., ii] = xr * sin + xi * cos
        return out.to(seed.dtype)

    def block(self, layer: int, start: int, count: int, batch: int, with_queries: bool = False):
        """Keys and values [batch, Hkv, count, D] for positions start .. start+count-1 of `layer`
        (and queries [batch, Hq, count, D] when asked)."""
        seed_k, seed_v = self.seed.keys[layer], self.seed.values[layer]
        S = seed_k.shape[1]
        positions = torch.arange(start, start + count, device=seed_k.device)
        keys, values, queries = [], [], []
        for row in range(batch):
            source = (positions + 97 * row) % S
            keys.append(self._rotated(seed_k, source, positions))
            values.append(seed_v.index_select(1, source))
            if with_queries:
                queries.append(self._rotated(self.seed.queries[layer], source, positions))
        if with_queries:
            return torch.stack(keys), torch.stack(values), torch.stack(queries)
        return torch.stack(keys), torch.stack(values)


def fill_cache(cache, filler: Filler, context: int, batch: int, chunk: int | None = None) -> None:
    """Append `context` tokens of tiled seed keys/values to a trikv CompressedCache or a DynamicCache,
    through the caches' public update path (a bounded cache compresses between chunks as it fills)."""
    from ...cache import CompressedCache

    from ...query_capture import _Tap, want_queries

    num_layers = len(filler.seed.keys)
    compressed = isinstance(cache, CompressedCache)
    wants_queries = compressed and cache.query_window is not None  # policies that score with live queries
    if chunk is None:
        chunk = context
    start = 0
    try:
        while start < context:
            count = min(chunk, context - start)
            if compressed:
                cache.before_forward(count, None)
            for layer in range(num_layers):
                if wants_queries:
                    k, v, _Tap.query = filler.block(layer, start, count, batch, with_queries=True)
                else:
                    k, v = filler.block(layer, start, count, batch)
                cache.update(k, v, layer)
            start += count
    finally:
        if wants_queries:
            want_queries(False)
    if compressed and cache.schedule.due(cache.length):
        cache.compress()  # the round the next forward would run: do it now, so a filled cache holds ~budget entries
