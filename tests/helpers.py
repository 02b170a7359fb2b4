"""Shared test helpers: tiny random models of every supported family, and the masked full-attention reference.

`masked_reference_logits` is the proof that eviction is exactly masking: it reruns the same tokens
through a full-attention model in which, at every forward, only the (position, layer, KV head) entries
that the compressed cache had visible are allowed, and returns the logits of each forward.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from trikv.architectures import model_shape
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


# hybrid families: sliding-window layers (window 8) around full-attention ones, as Gemma-3 and GPT-OSS lay them out
HYBRID = {
    "gemma3_text": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    "gpt_oss": dict(head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
}
# GPT-OSS implements no SDPA attention (its sinks need eager or flash / flex kernels)
EAGER_ONLY = {"gpt_oss"}


def tiny_config(family: str, **overrides):
    from transformers import AutoConfig

    options = dict(TINY)
    if family == "qwen3":
        options["head_dim"] = 16
    if family == "mistral":
        options["sliding_window"] = None
    if family in HYBRID:
        options.update(HYBRID[family], num_hidden_layers=4)
    options.update(overrides)
    return AutoConfig.for_model(family, **options)


def tiny_model(family: str = "llama", attn: str = "sdpa", seed: int = 0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    if family in EAGER_ONLY:
        attn = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    # larger weights make logits spread out, so greedy tokens are not decided by float noise
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.mul_(4.0)
            if name.endswith("sinks"):  # sinks that take a real share of each softmax
                param.copy_(torch.randn(param.shape) * 2.0)
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


def _attend(module, query, key, value, allowed, scaling):
    """Plain attention: query [b, Hq, q, D] over key/value [b, Hkv, K, D] where `allowed` [b, Hq|1, q, K] is True,
    with the module's attention sinks (GPT-OSS) in the softmax denominator."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    logits = (query @ key.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min).float()
    sinks = getattr(module, "sinks", None)
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(logits, dim=-1)
    return (weights.to(query.dtype) @ value).transpose(1, 2).contiguous(), None


def _masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Full attention over a DynamicCache where only the logged entries are allowed, per KV head; a hybrid
    model's sliding layers attend as transformers makes them (their window's keys, its mask)."""
    # query [b, Hq, q, D]; key/value [b, Hkv, T, D] in logical order (pads included)
    row = _STATE["rows"].get(module.layer_idx)
    if row is None:  # a sliding layer: its own window and mask
        q, K = query.shape[2], key.shape[2]
        if attention_mask is None:
            allowed = torch.arange(K)[None, :] <= (K - q + torch.arange(q))[:, None]
        else:
            allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        return _attend(module, query, key, value, allowed, scaling)
    allowed = _STATE["allowed"][row]  # [b, Hkv, q, T]
    group = query.shape[1] // key.shape[1]
    return _attend(module, query, key, value, allowed.repeat_interleave(group, dim=1), scaling)


AttentionInterface.register("trikv_test_masked", _masked_attention)
AttentionMaskInterface.register("trikv_test_masked", sdpa_mask)  # the sliding layers' masks


@contextlib.contextmanager
def attention_implementation(model, name: str):
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def masked_reference_logits(model, input_ids, attention_mask, generated, visible, chunks=None):
    """Replay prompt + `generated` tokens [b, steps] through full attention masked to `visible` sets.

    visible[k]: [L, b, Hkv, P_k] RoPE positions the compressed cache held during forward k (the prompt's forwards
    first: one, or one per [start, stop) of `chunks`, then one per decode step).
    Returns the last-position logits of the prompt's last forward and of each decode step, [steps, b, vocab].
    """
    chunks = chunks or [(0, input_ids.shape[1])]
    forwards = [input_ids[:, start:stop] for start, stop in chunks]
    forwards += [generated[:, step : step + 1] for step in range(len(visible) - len(chunks))]
    return masked_reference_forwards(model, forwards, visible, attention_mask)[len(chunks) - 1 :]


@torch.no_grad()
def masked_reference_forwards(model, forwards, visible, attention_mask=None):
    """The last-position logits [len(forwards), b, vocab] of each forward of tokens `forwards[k]` [b, q_k], replayed
    through full attention masked to `visible[k]` ([L, b, Hkv, P_k] RoPE positions the compressed cache held during
    forward k); `attention_mask` [b, q_0] is the first forward's left padding (default none)."""
    b = forwards[0].shape[0]
    if attention_mask is None:
        attention_mask = torch.ones_like(forwards[0])
    pads = (attention_mask == 0).long().sum(-1)  # left padding per row
    cache = DynamicCache(config=model.config)
    outputs = []
    seen = 0
    mask2d = attention_mask.clone()
    for step, (tokens, positions) in enumerate(zip(forwards, visible)):
        q = tokens.shape[1]
        total = seen + q
        if mask2d.shape[1] < total:
            mask2d = torch.cat([mask2d, mask2d.new_ones(b, total - mask2d.shape[1])], dim=-1)
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
        _STATE["rows"] = {layer: row for row, layer in enumerate(model_shape(model).cached_layers)}
        position_ids = (mask2d[:, :total].cumsum(-1) - 1).masked_fill(mask2d[:, :total] == 0, 0)[:, seen:total]
        with attention_implementation(model, "trikv_test_masked"):
            out = model(input_ids=tokens, position_ids=position_ids, **cache_kwargs(model, cache), use_cache=True)
        outputs.append(out.logits[:, -1].float())
        seen = total
    return torch.stack(outputs)
