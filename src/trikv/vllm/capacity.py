"""What one request can hold in vLLM's KV pool with trikv, and the KV spec that tells vLLM so at start-up.

A bounded request never holds more than `request_bound` tokens of KV in the full-attention group, whatever its
length: budget + divide_length + one prefill chunk (`BoundedKVSettings.peak_entries`), and never more than
max_model_len. vLLM sizes its pool at start-up for one request of max_model_len (`_check_enough_kv_cache_memory`,
through each layer's `KVCacheSpec.max_memory_usage_bytes`); `BoundedFullAttentionSpec` counts a request of the
full-attention layers at the bound instead, so an engine whose pool is smaller than max_model_len starts when it
holds one request at the largest budget a request may have. The scheduler caps admission and prefill chunks at
the same bound (`scheduler.py`), so what vLLM checked at start-up is what every bounded request needs.

Full-attention requests (`trikv_budget: "full"`, with `allow_full_requests`) are not bounded: one holds its whole
sequence, so the pool's usable blocks (all but vLLM's null block) are its limit, as max_model_len is every
request's limit in plain vLLM (`full_request_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.v1.kv_cache_interface import FullAttentionSpec

from .settings import REQUEST_BUDGET_KEY, BoundedKVSettings


def max_step_tokens(vllm_config) -> int:
    """The most tokens vLLM's scheduler gives one step (its `max_num_scheduled_tokens`)."""
    scheduler_config = vllm_config.scheduler_config
    return scheduler_config.max_num_scheduled_tokens or scheduler_config.max_num_batched_tokens


def request_bound(settings: BoundedKVSettings, budget: int, block_size: int, vllm_config) -> int:
    """The most KV entries per (layer, KV head) a request bounded at `budget` holds in this engine: trikv's bound
    (`BoundedKVSettings.peak_entries`), at most max_model_len."""
    peak = settings.peak_entries(budget, block_size, max_step_tokens(vllm_config))
    return min(vllm_config.model_config.max_model_len, peak)


@dataclass(frozen=True, kw_only=True)
class BoundedFullAttentionSpec(FullAttentionSpec):
    """vLLM's full-attention KV spec, counting one request at trikv's bound instead of max_model_len.

    The only difference is `max_memory_usage_bytes`, which vLLM reads at start-up to check that the pool holds
    one request and to report its capacity: blocks for `request_bound` at the largest budget a request may have.
    No field is added: vLLM rebuilds merged specs from FullAttentionSpec's fields (`FullAttentionSpec.merge`)
    and compares specs field by field, and the spec travels between vLLM's processes by pickle, so the class
    (importable by its module path) is the whole difference. vLLM finds its block manager through the class
    hierarchy (FullAttentionManager) and groups it with the other full-attention layers."""

    def max_memory_usage_bytes(self, vllm_config) -> int:
        settings = BoundedKVSettings.from_config(vllm_config.additional_config)
        if settings is None:  # an engine without trikv settings: vLLM's own count
            return super().max_memory_usage_bytes(vllm_config)
        tokens = request_bound(settings, settings.largest_request_budget, self.block_size, vllm_config)
        return -(-tokens // self.block_size) * self.page_size_bytes


def bounded_kv_cache_specs(specs: dict) -> dict:
    """The layers' KV specs with every plain full-attention spec counted at trikv's bound (the same fields in a
    `BoundedFullAttentionSpec`); other kinds (sliding windows, vLLM's own subclasses such as MLA) stay as they are."""
    bounded = {}
    for name, spec in specs.items():
        if type(spec) is FullAttentionSpec:
            spec = BoundedFullAttentionSpec(**{f.name: getattr(spec, f.name) for f in fields(spec) if f.init})
        bounded[name] = spec
    return bounded


def full_request_refusal(prompt_tokens: int, capacity: int) -> str | None:
    """Why a full-attention request with `prompt_tokens` cannot run on a pool that holds at most `capacity` tokens
    of one full-attention request (None when it can): its prompt and first generated token must fit. Its later
    tokens stop at the capacity with finish_reason "length", as plain vLLM stops every request at max_model_len."""
    if prompt_tokens + 1 <= capacity:
        return None
    return (f"a full-attention request ({REQUEST_BUDGET_KEY}='full') of {prompt_tokens} prompt tokens does not fit this "
            f"server's KV pool, which holds at most {capacity} tokens of one full-attention request (prompt, then "
            f"generated tokens): shorten the prompt to at most {capacity - 1} tokens or send it with a bounded budget "
            f"(no {REQUEST_BUDGET_KEY}, or a number)")
