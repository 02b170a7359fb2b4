"""The full-attention reference pass, shared by every method: final hidden states and post-RoPE q / k.

The hidden states (after the final norm) are small ([b, T, hidden]); the reference logits of any span are
recomputed from them with the model's output head when a method is compared, so no [b, T, vocab] tensor
is ever held. Post-RoPE keys of every layer and the queries of the sampled positions are captured by
wrapping the modeling module's `apply_rotary_pos_emb` for the duration of the pass (the same place
`trikv.qk_capture` serves calibration and analysis).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...architectures import attention_modules, attention_sinks, decoder, model_shape
from ...compat import cache_kwargs
from ...qk_capture import capture_post_rope


@torch.no_grad()
def head_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [b, n, V] (float32) from final hidden states, as the causal LM's forward computes them."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@dataclass
class Reference:
    hidden: torch.Tensor  # [b, T, hidden] final-norm hidden states of every position
    keys: list[torch.Tensor] | None  # per layer [b, Hkv, T, D] post-RoPE keys
    queries: list[torch.Tensor] | None  # per layer [b, Hq, n_q, D] post-RoPE queries at `query_index`
    query_index: torch.Tensor | None  # [n_q] long: positions whose queries were kept
    scaling: float = 1.0
    layers: list[int] | None = None  # the model layers `keys` / `queries` hold (a hybrid model: its global ones)
    sinks: torch.Tensor | None = None  # [len(layers), Hq] attention-sink logits (GPT-OSS), None without

    def logits(self, model, start: int, end: int) -> torch.Tensor:
        return head_logits(model, self.hidden[:, start:end])


@torch.no_grad()
def reference_pass(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    prompt_length: int,
    max_chunk: int = 256,
    query_index: torch.Tensor | None = None,
    progress=None,
) -> Reference:
    """Full attention over input_ids [b, T] (prompt forward, then chunks), capturing what the comparisons need."""
    from transformers import DynamicCache

    b, T = input_ids.shape
    base = decoder(model)
    cache = DynamicCache(config=model.config)
    hidden = None
    layers = list(model_shape(model).cached_layers)  # the layers a trikv cache bounds (recall is about them)
    row_of = {layer: row for row, layer in enumerate(layers)}
    keys: list[torch.Tensor | None] = [None] * len(layers)
    queries: list[torch.Tensor | None] = [None] * len(layers)
    span = [0, 0]
    if query_index is not None:
        query_index = query_index.to(torch.long)

    def on_vectors(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        if layer not in row_of:
            return
        layer = row_of[layer]
        start, end = span
        if keys[layer] is None:
            keys[layer] = torch.zeros(b, k.shape[1], T, k.shape[-1], dtype=torch.float32)
            queries[layer] = torch.zeros(b, q.shape[1], len(query_index), q.shape[-1], dtype=torch.float32)
        keys[layer][:, :, start:end] = k.detach().float().cpu()
        inside = (query_index >= start) & (query_index < end)  # query_index lives on the CPU
        if bool(inside.any()):
            where = inside.nonzero().flatten()
            queries[layer][:, :, where] = q.detach().float().cpu()[:, :, query_index[where] - start]

    bounds = [(0, prompt_length)] + [(s, min(T, s + max_chunk)) for s in range(prompt_length, T, max_chunk)]
    context = capture_post_rope(model, on_vectors) if query_index is not None else contextlib.nullcontext()
    with context:
        for start, end in bounds:
            span[:] = [start, end]
            positions = torch.arange(start, end, device=input_ids.device)[None].expand(b, end - start)
            out = base(input_ids=input_ids[:, start:end], position_ids=positions, **cache_kwargs(base, cache), use_cache=True)
            h = out.last_hidden_state.detach()
            if hidden is None:
                hidden = torch.zeros(b, T, h.shape[-1], dtype=h.dtype, device=h.device)
            hidden[:, start:end] = h
            if progress is not None:
                progress(end - start)
    scaling = float(getattr(attention_modules(model)[0], "scaling", model_shape(model).head_dim**-0.5))
    return Reference(hidden, keys if query_index is not None else None, queries if query_index is not None else None, query_index,
                     scaling, layers, attention_sinks(model, layers))
