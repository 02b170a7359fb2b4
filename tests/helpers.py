"""Shared test helpers: tiny random models of every supported family, and the masked full-attention reference.

`masked_reference_logits` is the proof that eviction is exactly masking: it reruns the same tokens
through a full-attention model in which, at every forward, only the (position, layer, KV head) entries
that the compressed cache had visible are allowed, and returns the logits of each forward.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.modeling_utils import AttentionInterface

from trikv.cache import CompressedCache, decoder
from trikv.compat import cache_kwargs

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_config(family: str, **overrides):
    from transformers import AutoConfig

    options = dict(TINY)
    if family == "qwen3":
        options["head_dim"] = 16
    if family == "mistral":
        options["sliding_window"] = None
    options.update(overrides)
    return AutoConfig.for_model(family, **options)


def tiny_model(family: str = "llama", attn: str = "sdpa", seed: int = 0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    # larger weights make logits spread out, so greedy tokens are not decided by float noise
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.mul_(4.0)
    return model.eval()


class VisibleLog:
    """Decoder post-hook recording, after every forward, the positions the compressed cache had visible."""

    def __init__(self, model):
        self.visible: list[torch.Tensor] = []  # per forward: [L, b, Hkv, P] positions (-1 = pad)
        self.handle = decoder(model).register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, CompressedCache):
            self.visible.append(cache.visible_positions().clone())

    def close(self):
        self.handle.remove()


_STATE: dict = {}


def _masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Full attention over a DynamicCache where only the logged entries are allowed, per KV head."""
    # query [b, Hq, q, D]; key/value [b, Hkv, T, D] in logical order (pads included)
    allowed = _STATE["allowed"][module.layer_idx]  # [b, Hkv, q, T]
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    logits = (query @ key.transpose(-1, -2)) * scaling
    mask = allowed.repeat_interleave(group, dim=1)
    logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits.float(), dim=-1).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register("trikv_test_masked", _masked_attention)


@contextlib.contextmanager
def attention_implementation(model, name: str):
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def masked_reference_logits(model, input_ids, attention_mask, generated, visible):
    """Replay prompt + `generated` tokens [b, steps] through full attention masked to `visible` sets.

    visible[k]: [L, b, Hkv, P_k] RoPE positions the compressed cache held during forward k (prefill = 0).
    Returns the last-position logits of each forward, [steps, b, vocab].
    """
    b, prompt_len = input_ids.shape
    pads = (attention_mask == 0).long().sum(-1)  # left padding per row
    cache = DynamicCache(config=model.config)
    outputs = []
    seen = 0
    mask2d = attention_mask.clone()
    for step, positions in enumerate(visible):
        if step == 0:
            tokens = input_ids
        else:
            tokens = generated[:, step - 1 : step]
            mask2d = torch.cat([mask2d, mask2d.new_ones(b, 1)], dim=-1)
        q = tokens.shape[1]
        total = seen + q
        # logical index of each visible entry = position + pad
        logical = torch.where(positions >= 0, positions + pads[None, :, None, None], torch.full_like(positions, -1))
        L, _, Hkv, _ = positions.shape
        # dead slots scatter into a spare last column, which is dropped
        allowed_keys = torch.zeros(L, b, Hkv, total + 1, dtype=torch.bool)
        allowed_keys.scatter_(3, torch.where(logical >= 0, logical, total), True)
        allowed_keys = allowed_keys[..., :total]
        query_index = torch.arange(seen, total)
        key_index = torch.arange(total)
        causal = key_index[None, :] <= query_index[:, None]  # [q, T]
        _STATE["allowed"] = allowed_keys[:, :, :, None, :] & causal[None, None, None]
        position_ids = (mask2d.cumsum(-1) - 1).masked_fill(mask2d == 0, 0)[:, seen:total]
        with attention_implementation(model, "trikv_test_masked"):
            out = model(input_ids=tokens, position_ids=position_ids, **cache_kwargs(model, cache), use_cache=True)
        outputs.append(out.logits[:, -1].float())
        seen = total
    return torch.stack(outputs)
