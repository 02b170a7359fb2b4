"""`trikv bench speed`: decode throughput, latency and memory vs context length, methods and budgets.

What is measured, per (engine, method, budget, batch size, context length):
  decode tokens/s, time per token p50 / p99 / max, the share of decode time spent in compression rounds
  (scoring + selection + compaction, `CompressedCache.scoring_seconds`, plus per-step observation for
  policies that have one), KV-cache bytes (final and peak over the measured steps), the process RSS, and
  the speed-up over full attention of the same engine, batch and context, measured side by side: the
  configurations of one (engine, batch, context) group decode in lockstep, one step each in turn, so
  machine noise hits them alike.

Next to every speed-up the memory-bound bound is printed: on a machine that streams B bytes/s, a decode
step cannot take less than (weight bytes + KV bytes read) / B; the bound on the speed-up of a bounded
cache over full attention is the ratio of these times. B is measured at the start of the run and again
before each group (best of a streaming reduction and a large fp32 GEMV, best over repeats; the bound uses
the higher of the two probes, so it is the most optimistic time this machine allows).

How the context is filled: decode speed does not depend on what the cached keys say, so instead of
generating C tokens the cache is filled directly: a real prefill of `seed_tokens` (default 512) tokens of a
shipped English text gives the model's own post-RoPE keys and values; they are tiled to C positions, each
key re-rotated to its true position (band f multiplied by e^{i w_f (p - p_src)}), row r of a batch starting
the tiling at a different offset. Bounded caches are filled in chunks, so their rounds run as the
context grows (the cache never holds more than budget + slack + one chunk); full attention gets one
preallocated buffer. The prompt is not protected (the filled context stands for generated text). Every
measured step is then a real model forward on the model's own greedy token.

Whole generations (`--whole-generation N,...`, `whole.py`): instead of the grid, a real prompt decoded to prompt + N
tokens with full attention and each bounded cache, interleaved in blocks of steps (`paired.py`: trikv.generate's
loop one step at a time), rounds included; the speed-up of each bounded cache with a bootstrap interval over the
paired blocks, the same without its rounds' time (it must not be below 1 beyond noise), and the context from which
the bound pays.

Engines: "lean" (trikv's plain-PyTorch decoder, `trikv.lean`) and "transformers" (the model's own forward;
full attention there is transformers' DynamicCache). llama.cpp (`llama-cpp-python`, optional) decodes the
bundled GGUF at the same context lengths with its full cache, batch 1, in the same run.
"""

from __future__ import annotations

from ...lazy import lazy_getattr

from . import cli  # registers `trikv bench speed` (light: the measuring modules load when a run starts)

# public name -> the submodule defining it, imported on first use so that `trikv --help` stays fast
_EXPORTS = {
    "DecodeRun": "decode", "RunResult": "decode",
    "Filler": "filling", "SeedKV": "filling", "fill_cache": "filling", "make_seed": "filling", "seed_text_ids": "filling",
    "kv_bytes_per_token": "machine", "measure_bandwidth": "machine", "weight_bytes_per_step": "machine",
    "format_table": "report", "plot": "report", "write_outputs": "report",
    "SpeedConfig": "config", "memory_run": "runner", "run_speed": "runner",
    "Decoding": "paired", "interleave": "paired", "paired_ratio": "paired", "break_even_context": "paired",
    "run_whole_generation": "whole", "whole_targets": "whole",
}
__all__ = [*_EXPORTS, "cli"]


__getattr__ = lazy_getattr(__name__, {name: (f".{module}", name) for name, module in _EXPORTS.items()})
