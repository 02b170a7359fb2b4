"""A lean forward path for trikv caches: the supported families' decoder in plain PyTorch.

A decode step of a small model on CPU is the weight GEMVs (every weight read once per step) plus a fixed
per-step cost. In transformers' path that fixed cost is large (module calls, hooks, kwargs plumbing, mask
preparation, ~40 small ops per layer) and its GEMVs run in the [out, in] layout on one thread; the engine
check of `trikv bench speed --engines lean,transformers` measures both engines and their GEMM floors side by
side (docs/speed.md). `LeanEngine` runs the same math with the model's own weights, for llama, qwen2 (q/k/v
biases), qwen3 (q_norm / k_norm) and mistral:

- fused QKV and gate/up weights (one GEMM each), every weight stored transposed ([in, out] row-major):
  a decode GEMV x @ W^T then streams rows of W^T and accumulates along the long output axis, which
  CPU BLAS runs faster than the dot-product form over [out, in] rows. These are copies: the model is left
  exactly as it was (its parameters, `save_pretrained`), at the cost of a second copy of the weights.
  `share_weights=True` instead re-points the model's own parameters to (transposed, non-contiguous) views
  of the engine's buffers, so nothing is duplicated; the model then computes the same numbers but is changed
  (`save_pretrained` needs contiguous tensors: `stock_layout_copy` gives a model with the original layout);
- RoPE computed once per forward with the model's own rotary module (its `inv_freq`, scaling type and
  attention scaling), applied to q and k together as x*cos + roll(x)*sin' (sin' = sin with the first
  half negated, which equals rotate_half(x)*sin exactly);
- the trikv cache's preallocated buffers: `CompressedCache.before_forward` / `update` are called
  exactly as the transformers path calls them, so every policy, schedule, padding rule, per-slot
  validity and per-key bias is the same; attention uses the validity / bias the cache publishes;
- decode attention as two batched GEMMs per layer over the KV heads (keys [P, D] x [D, G] per KV head:
  the G query heads of a KV head share one read of its keys, no repeat_kv copy);
- PyramidKV / Ada-KV's packed regions through `attention.packed_attention`;
- residual adds fused into the output GEMMs (addmm);
- decode GEMVs split along the input axis over the threads (torch runs a GEMV on one thread).

Numerics: the same operations in (almost) the same order as transformers, in the model's dtype; logits
agree with the transformers path to float rounding in fp32 (tests/test_lean.py: 2e-4 on logits of ~10-40)
and greedy tokens are identical.

Use `trikv.generate(..., engine="lean")`, or `LeanEngine.for_model(model)(input_ids, cache, ...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .architectures import UnsupportedModelError, decoder, model_shape
from .attention import bias_mask, packed_attention, validity_mask
from .query_capture import _Tap, want_queries

LEAN_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class _Layer:
    ln1: torch.Tensor
    eps1: float
    ln2: torch.Tensor
    eps2: float
    qkv_wt: torch.Tensor  # [H, (Hq + 2 Hkv) D] contiguous (transposed, fused q/k/v)
    qkv_b: torch.Tensor | None
    qk_norm_w: torch.Tensor | None  # [Hq + Hkv, D] (qwen3: q_norm weight for the Hq heads, k_norm for the Hkv)
    qk_norm_eps: float
    o_wt: torch.Tensor  # [Hq D, H] contiguous
    o_b: torch.Tensor | None
    gate_up_wt: torch.Tensor  # [H, 2 I] contiguous
    gate_up_b: torch.Tensor | None
    down_wt: torch.Tensor  # [I, H] contiguous
    down_b: torch.Tensor | None
    act: object


def _norm_eps(module) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise UnsupportedModelError(f"cannot read the epsilon of {type(module).__name__}")


def _fuse(linears: list[torch.nn.Module], share: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One transposed weight [in, sum(out)] (contiguous) and bias for several Linear layers.

    With `share`, the layers' own parameters are re-pointed to views of the new buffers (`weight` becomes
    a non-contiguous [out, in] view, same values), so the old storage is freed and nothing is duplicated.
    """
    weight_t = torch.cat([lin.weight.detach().t() for lin in linears], dim=1).contiguous()
    biases = [getattr(lin, "bias", None) for lin in linears]
    if any(b is not None for b in biases):
        bias = torch.cat(
            [b.detach() if b is not None else weight_t.new_zeros(lin.weight.shape[0]) for b, lin in zip(biases, linears)]
        ).contiguous()
    else:
        bias = None
    if share:
        start = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight.data = weight_t[:, start : start + rows].t()
            if getattr(lin, "bias", None) is not None:
                lin.bias.data = bias[start : start + rows]
            start += rows
    return weight_t, bias


SPLIT_K_MAX_ROWS = 4  # GEMMs with more rows (prefill) already use every thread


def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight_t [in, out] (+ bias) (+ residual).

    A decode GEMV (one row per sequence) runs on one thread in torch's CPU kernels, whatever
    `torch.set_num_threads` says. With T > 1 threads it is split along the input axis instead: the T row
    blocks of weight_t are free views, one batched matmul gives T partial products (one per thread) and
    a sum adds them, so every thread streams 1/T of the weights. The sum order differs from one GEMV by
    float rounding only.
    """
    threads = torch.get_num_threads()
    rows, inner = x.shape
    if threads > 1 and rows <= SPLIT_K_MAX_ROWS and inner % threads == 0 and x.device.type == "cpu":
        parts = torch.bmm(x.view(rows, threads, inner // threads).transpose(0, 1), weight_t.view(threads, inner // threads, -1))
        out = parts.sum(0)  # [rows, out]
        if bias is not None:
            out = out + bias
        return out if residual is None else residual + out
    if residual is not None:
        return torch.addmm(residual, x, weight_t) if bias is None else residual + torch.addmm(bias, x, weight_t)
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def stock_layout_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters are plain contiguous [out, in] tensors again (the layout
    transformers loads), e.g. to time the transformers path as users get it next to a lean-engine model."""
    import copy

    engine = model.__dict__.pop("_trikv_lean_engine", None)  # not copied along
    try:
        clone = copy.deepcopy(model)
    finally:
        if engine is not None:
            model.__dict__["_trikv_lean_engine"] = engine
    with torch.no_grad():
        for param in clone.parameters():
            param.data = param.data.contiguous()
    return clone


class LeanEngine:
    """Decoder forward for one model, reading its weights; run it with a trikv `CompressedCache`."""

    def __init__(self, model: torch.nn.Module, share_weights: bool = False):
        shape = model_shape(model)
        if shape.model_type not in LEAN_FAMILIES:
            raise UnsupportedModelError(
                f"the lean engine supports {LEAN_FAMILIES}, not {shape.model_type!r}"
                + (" (a hybrid sliding/global model: use engine='transformers', which bounds its global layers and keeps "
                   "transformers' own sliding-window layers)" if shape.is_hybrid else "")
            )
        self.model = model
        self.shape = shape
        self.share_weights = share_weights
        base = decoder(model)
        self.rotary = base.rotary_emb
        self.final_norm = base.norm.weight
        self.final_eps = _norm_eps(base.norm)
        self.lm_head = model.lm_head
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.group = shape.group_size
        self.layers: list[_Layer] = []
        with torch.no_grad():
            for layer in base.layers:
                attn, mlp = layer.self_attn, layer.mlp
                if getattr(attn, "sliding_window", None):
                    raise UnsupportedModelError("the lean engine supports full-attention layers only")
                qkv_wt, qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], share_weights)
                gate_up_wt, gate_up_b = _fuse([mlp.gate_proj, mlp.up_proj], share_weights)
                o_wt, o_b = _fuse([attn.o_proj], share_weights)
                down_wt, down_b = _fuse([mlp.down_proj], share_weights)
                qk_norm_w, qk_norm_eps = None, 0.0
                if hasattr(attn, "q_norm"):
                    qk_norm_w = torch.cat(
                        [
                            attn.q_norm.weight.detach()[None].expand(self.num_heads, -1),
                            attn.k_norm.weight.detach()[None].expand(self.num_kv_heads, -1),
                        ]
                    ).contiguous()
                    qk_norm_eps = _norm_eps(attn.q_norm)
                    if _norm_eps(attn.k_norm) != qk_norm_eps:
                        raise UnsupportedModelError("q_norm and k_norm with different epsilons")
                self.layers.append(
                    _Layer(
                        ln1=layer.input_layernorm.weight.detach(),
                        eps1=_norm_eps(layer.input_layernorm),
                        ln2=layer.post_attention_layernorm.weight.detach(),
                        eps2=_norm_eps(layer.post_attention_layernorm),
                        qkv_wt=qkv_wt,
                        qkv_b=qkv_b,
                        qk_norm_w=qk_norm_w,
                        qk_norm_eps=qk_norm_eps,
                        o_wt=o_wt,
                        o_b=o_b,
                        gate_up_wt=gate_up_wt,
                        gate_up_b=gate_up_b,
                        down_wt=down_wt,
                        down_b=down_b,
                        act=mlp.act_fn,
                    )
                )
            # lm_head (the embedding when tied): transposed too; the embedding lookup reads the strided view
            self.lm_head_wt, self.lm_head_b = _fuse([model.lm_head], share_weights)
            self.embed = base.embed_tokens.weight
            self.scaling = float(base.layers[0].self_attn.scaling)
            d = self.head_dim
            self._sign = torch.cat([-torch.ones(d // 2), torch.ones(d // 2)]).to(self.lm_head_wt.device, self.lm_head_wt.dtype)
        self._fingerprint = self._current_fingerprint()

    # ---- bookkeeping ------------------------------------------------------------------------------
    def _current_fingerprint(self):
        base = decoder(self.model)
        first = base.layers[0]
        return (
            first.self_attn.q_proj.weight.data_ptr(),
            first.mlp.gate_proj.weight.data_ptr(),
            first.self_attn.o_proj.weight.data_ptr(),
            self.model.lm_head.weight.data_ptr(),
            base.embed_tokens.weight.data_ptr(),
        )

    @classmethod
    def for_model(cls, model: torch.nn.Module, share_weights: bool = False) -> "LeanEngine":
        """The engine of `model`, built once and rebuilt if its parameters were moved or replaced."""
        engine = model.__dict__.get("_trikv_lean_engine")
        if engine is None or engine._fingerprint != engine._current_fingerprint() or engine.share_weights != share_weights:
            engine = cls(model, share_weights)
            model.__dict__["_trikv_lean_engine"] = engine
        return engine

    # ---- forward ----------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, input_ids, cache, position_ids=None, attention_mask=None, logits_to_keep: int = 1):
        return self.forward(input_ids, cache, position_ids, attention_mask, logits_to_keep)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 1,
    ) -> torch.Tensor:
        """input_ids [b, q] -> logits [b, logits_to_keep, vocab] (0 = all positions), through `cache`.

        `position_ids` [b, q] as transformers' generate() gives them (default: each row's tokens so far,
        left padding excluded, + arange); `attention_mask` is the 2D padding mask of the first forward (the
        cache reads each row's left padding from it, exactly as its transformers pre-hook does).
        """
        from .cache import CompressedCache

        if not isinstance(cache, CompressedCache):
            raise TypeError("the lean engine needs a trikv CompressedCache (trikv.make_cache(model, method, ...))")
        b, q = input_ids.shape
        cache.check_model(decoder(self.model))
        # what the decoder pre-hook does in the transformers path
        cache.before_forward(q, attention_mask)
        if position_ids is None:  # RoPE positions skip each row's left padding (pads get 0: they attend to nothing)
            logical = torch.arange(cache.get_seq_length(), cache.get_seq_length() + q, device=input_ids.device)
            position_ids = (logical[None, :] - cache._pads(b, input_ids.device)[:, None]).clamp_min(0)
        if cache.policy.needs_tokens:
            cache.record_tokens(input_ids, q)
        wants_queries = cache.query_window is not None
        try:
            x = F.embedding(input_ids, self.embed).reshape(b * q, -1)
            cos, sin = self.rotary(x, position_ids)  # [b, q, D], the model's own frequencies and scaling
            cos = cos.reshape(b, q, 1, -1)
            sin = (sin * self._sign).reshape(b, q, 1, -1)
            if cos.shape[-1] != self.head_dim:
                raise UnsupportedModelError("partial rotary embeddings are not supported by the lean engine")
            for index, layer in enumerate(self.layers):
                x = self._layer(index, layer, x, b, q, cos, sin, cache, wants_queries)
        finally:
            if wants_queries:
                want_queries(False)
        if logits_to_keep:
            x = x.view(b, q, -1)[:, -logits_to_keep:].reshape(-1, x.shape[-1])
        h = F.rms_norm(x, (x.shape[-1],), self.final_norm, self.final_eps)
        logits = _linear(h, self.lm_head_wt, self.lm_head_b)
        return logits.view(b, -1, logits.shape[-1])

    def _layer(self, index: int, layer: _Layer, x, b: int, q: int, cos, sin, cache, wants_queries: bool):
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        h = F.rms_norm(x, (x.shape[-1],), layer.ln1, layer.eps1)
        qkv = _linear(h, layer.qkv_wt, layer.qkv_b).view(b, q, Hq + 2 * Hkv, D)
        qk = qkv[:, :, : Hq + Hkv]
        if layer.qk_norm_w is not None:
            qk = F.rms_norm(qk, (D,), None, layer.qk_norm_eps) * layer.qk_norm_w
        rot = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin)  # [b, q, Hq + Hkv, D]
        query = rot[:, :, :Hq].transpose(1, 2)  # [b, Hq, q, D]
        key = rot[:, :, Hq:].transpose(1, 2)
        value = qkv[:, :, Hq + Hkv :].transpose(1, 2)
        if wants_queries and _Tap.wanted:
            _Tap.query = query  # the cache's query window takes it in update() (baselines that score with q.K)
        kwargs: dict = {}
        keys, values = cache.update(key, value, index, kwargs=kwargs)  # [b, Hkv, P, D] views of the buffer
        valid, bias = kwargs.get("trikv_valid"), kwargs.get("trikv_bias")
        if kwargs.get("trikv_packed") is not None:  # PyramidKV / Ada-KV regions (stores/packed.py)
            out = packed_attention(query, keys, values, kwargs["trikv_packed"], self.scaling).reshape(b * q, Hq * D)
        elif q == 1:
            out = self._decode_attention(query, keys, values, valid, bias)  # [b, Hq D]
        else:
            out = self._prefill_attention(query, keys, values, valid, bias)  # [b q, Hq D]
        x = _linear(out, layer.o_wt, layer.o_b, residual=x)
        h = F.rms_norm(x, (x.shape[-1],), layer.ln2, layer.eps2)
        gate_up = _linear(h, layer.gate_up_wt, layer.gate_up_b)
        inner = gate_up.shape[-1] // 2
        act = layer.act(gate_up[:, :inner]) * gate_up[:, inner:]
        return _linear(act, layer.down_wt, layer.down_b, residual=x)

    def _prefill_attention(self, query, keys, values, valid, bias):
        """Several new tokens (prefill, prompt chunks): SDPA with the cache's validity and causality."""
        b, Hq, q, D = query.shape
        if valid is None and bias is None and keys.shape[2] == q:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=self.scaling, enable_gqa=True)
        else:
            mask = validity_mask(query, keys, valid)
            if bias is not None:
                mask = bias_mask(query, mask, bias)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * q, Hq * D)

    def _decode_attention(self, query, keys, values, valid, bias):
        """One new token: [b, Hq, 1, D] against [b, Hkv, P, D], the G heads of a KV head in one GEMM."""
        b, Hkv, P, D = keys.shape
        G = self.group
        qg = (query * self.scaling).reshape(b, Hkv, G, D)
        # keys [P, D] times the G queries as a tall-skinny GEMM (rows of keys streamed in order, split over
        # threads along P), then viewed as [G, P]
        logits = torch.matmul(keys, qg.transpose(-1, -2)).transpose(-1, -2)  # [b, Hkv, G, P]
        if valid is not None or bias is not None:
            allowed = validity_mask(query, keys, valid)
            if bias is not None:
                logits = logits + bias_mask(query, allowed, bias).view(b, Hkv, G, P)
            else:
                logits = logits.masked_fill(~allowed.view(b, Hkv, G, P), torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits, dim=-1)
        return torch.matmul(probs, values).reshape(b, Hkv * G * D)


def lean_forward(model, input_ids, cache, position_ids=None, attention_mask=None, logits_to_keep: int = 1):
    """Convenience: `LeanEngine.for_model(model).forward(...)`."""
    return LeanEngine.for_model(model).forward(input_ids, cache, position_ids, attention_mask, logits_to_keep)
