"""What trikv relies on in vLLM 0.32's CUDA build, which this CPU-only machine never runs: read from vLLM's code and
pinned here without a GPU (no engine is started: configurations, vLLM's own config resolution and dispatch, and a
round on the meta device, which has shapes but no data and takes CUDA's code paths).

- CUDA graphs: trikv's engine arguments choose PIECEWISE graphs (attention and the KV writes run eagerly between
  the captured pieces, so they read each step's compacted lengths); every mode with FULL graphs is refused at
  start-up with the reason, also when vLLM turns the requested mode into one;
- the V2 model runner (0.32's CUDA default) is deselected in the environment the engine processes inherit;
- a round's host-device synchronisations: none, whatever the number of due requests and layers, and one queued
  upload;
- refusals at start-up (no chunked prefill, no front-end checks) and of malformed request settings;
- the per-request prefill cap sits in vLLM's last per-request cap on a step's tokens, which both of the scheduler's
  loops (running and waiting requests) call before allocating blocks.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

if os.environ.get("TRIKV_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (the test command installs it: a missing vLLM must fail, not skip)
else:
    vllm = pytest.importorskip("vllm")

from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode

from trikv.vllm import UnsupportedEngineError, engine_args, serve_flags
from trikv.vllm.settings import BoundedKVSettings, SettingsError
from trikv.vllm.support import check_engine_config

pytestmark = pytest.mark.vllm
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's own variable (vllm/envs.py)

FULL_MODES = [CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE]


def _engine_config(**overrides):
    from vllm import EngineArgs

    from trikv.models import resolve_model_path

    return EngineArgs(model=resolve_model_path("smollm2-135m"), max_model_len=1024, block_size=32, **overrides).create_engine_config()


@pytest.fixture
def no_runner_choice(monkeypatch):
    monkeypatch.delenv(V2_RUNNER_ENV, raising=False)


# ---- CUDA graphs -----------------------------------------------------------------------------------------
def test_engine_arguments_choose_piecewise_graphs_never_full(no_runner_choice):
    """`engine_args`, the `vllm serve` flags (`trikv vllm-args`) and `trikv serve` all carry cudagraph_mode PIECEWISE
    (vLLM 0.32's CUDA default is FULL_AND_PIECEWISE); a user's own compilation settings are merged, not dropped."""
    args = engine_args(method="streaming", budget=64)
    assert args["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert CUDAGraphMode[args["compilation_config"]["cudagraph_mode"]] == CUDAGraphMode.PIECEWISE
    flags = serve_flags(method="streaming", budget=64)
    at = flags.index("--compilation-config")
    assert json.loads(flags[at + 1]) == {"cudagraph_mode": "PIECEWISE"}
    assert not any("FULL" in flag for flag in flags)
    merged = engine_args(method="streaming", budget=64, compilation_config={"max_cudagraph_capture_size": 64})
    assert merged["compilation_config"] == {"cudagraph_mode": "PIECEWISE", "max_cudagraph_capture_size": 64}
    # vLLM takes them as they are
    config = _engine_config(**args)
    assert config.compilation_config.cudagraph_mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE)  # CPU: no graphs


def test_trikv_serve_and_vllm_args_select_piecewise_and_the_v1_runner(no_runner_choice, capsys):
    from trikv.vllm.cli import add_vllm_commands

    parser = argparse.ArgumentParser()
    add_vllm_commands(parser.add_subparsers())
    args = parser.parse_args(["serve", "--budget", "64", "--dry-run"])
    assert args.func(args) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{V2_RUNNER_ENV}=0 ")
    assert """--compilation-config '{"cudagraph_mode": "PIECEWISE"}'""" in line
    assert os.environ[V2_RUNNER_ENV] == "0"  # what `trikv serve` hands vLLM (os.execv keeps the environment)
    args = parser.parse_args(["vllm-args", "--method", "streaming", "--budget", "64"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert "PIECEWISE" in out and V2_RUNNER_ENV not in out and f"{V2_RUNNER_ENV}=0" in err


@pytest.mark.parametrize("mode", FULL_MODES, ids=lambda mode: mode.name)
def test_full_cuda_graph_modes_are_refused_at_start_up(mode):
    """A mode with FULL graphs replays attention with the sequence lengths it was captured with (vLLM's persistent
    buffer, the logical lengths): refused with the reason and the mode to use. PIECEWISE and no graphs pass."""
    args = engine_args(method="streaming", budget=64)
    settings = BoundedKVSettings.from_config(args["additional_config"])
    config = _engine_config(**args)
    config.compilation_config.cudagraph_mode = mode
    with pytest.raises(UnsupportedEngineError, match=f"CUDA graph mode {mode.name} replays attention") as refused:
        check_engine_config(config, settings)
    assert "cudagraph_mode=PIECEWISE" in str(refused.value) and "--enforce-eager" in str(refused.value)
    for allowed in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
        config.compilation_config.cudagraph_mode = allowed
        check_engine_config(config, settings)


def test_vllm_piecewise_graphs_leave_attention_and_kv_writes_outside():
    """vLLM 0.32's compilation of PIECEWISE graphs: attention and the KV cache write are splitting ops (they run
    eagerly, reading the step's metadata and slot mapping), the mode stays PIECEWISE whatever the attention
    backend supports, and decode batches dispatch to PIECEWISE graphs only. Where vLLM itself turns PIECEWISE into
    FULL (attention fused with quantisation), the resolved mode is what trikv's worker checks, and it is refused.
    Also pinned: why FULL graphs cannot run a compacted cache (the buffers they replay with)."""
    from vllm.v1.attention.backend import AttentionCGSupport

    from trikv.vllm.support import graph_mode_problem

    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert "vllm::unified_attention_with_output" in config.splitting_ops
    assert "vllm::unified_kv_cache_update" in config.splitting_ops
    for support in AttentionCGSupport:
        resolved = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE,
                                     cudagraph_capture_sizes=[1, 2, 4, 8])
        resolved.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
        mode = resolved.resolve_cudagraph_mode_and_sizes(support, "backend", max_num_reqs=8)
        assert not mode.has_full_cudagraphs() and graph_mode_problem(resolved) is None, support
    fused = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    fused.pass_config.fuse_attn_quant = True
    fused.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert fused.cudagraph_mode == CUDAGraphMode.FULL and "FULL replays attention" in graph_mode_problem(fused)

    # why FULL graphs are refused: the V1 runner hands attention its persistent `seq_lens` buffer, which
    # FlashAttention's metadata keeps as is (a FULL graph replays with that buffer: the logical lengths), while the
    # slot mapping and block table it hands over are the block table's persistent buffers (written in place by
    # trikv, so graph-safe)
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = inspect.getsource(GPUModelRunner._build_attention_metadata)
    assert "seq_lens=self.seq_lens[:num_reqs_padded]" in build
    assert "blk_table.get_device_tensor(num_reqs_padded)" in build
    assert "blk_table.slot_mapping.gpu[:num_tokens_padded]" in inspect.getsource(GPUModelRunner._get_slot_mappings)
    backends = os.path.join(os.path.dirname(vllm.__file__), "v1", "attention", "backends")
    with open(os.path.join(backends, "flash_attn.py")) as handle:
        flash = handle.read()
    assert "seq_lens = common_attn_metadata.seq_lens" in flash and "seq_lens=seq_lens," in flash
    # the KV write every CUDA backend offers is the one trikv learns its pages through, on the same page format
    for backend in ("flash_attn", "flashinfer", "triton_attn"):
        with open(os.path.join(backends, f"{backend}.py")) as handle:
            source = handle.read()
        assert "def do_kv_cache_update(" in source and "transpose(1, 2).split(" in source, backend




def test_rounds_run_before_vllm_zeroes_new_blocks():
    """vLLM 0.32 zeroes newly allocated blocks (`new_block_ids_to_zero`, where the backend needs it) in the runner's
    `_update_states`, inside `execute_model`; a round reads the blocks it gives back, which the scheduler may hand to
    another request in the same step, so trikv's rounds must run before vLLM's step begins."""
    import inspect
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from trikv.vllm.worker import BoundedKVRunner

    assert "self._zero_block_ids(scheduler_output.new_block_ids_to_zero)" in inspect.getsource(GPUModelRunner._update_states)
    assert "self._update_states(scheduler_output)" in inspect.getsource(GPUModelRunner.execute_model)
    order = []

    class Step:
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            order.append("vllm step (zeroes new blocks)")

    class Runner(BoundedKVRunner, Step):
        def _trikv_before_step(self, scheduler_output, plan):
            order.append("rounds")

    runner = Runner()
    runner.trikv_compactor = object()
    runner.execute_model(SimpleNamespace(trikv=None))
    assert order == ["rounds", "vllm step (zeroes new blocks)"]


# ---- the V2 model runner ----------------------------------------------------------------------------------
def test_engine_args_select_the_v1_runner_and_refuse_a_v2_choice(no_runner_choice, monkeypatch):
    """vLLM reads VLLM_USE_V2_MODEL_RUNNER in every engine process (they inherit the environment): engine_args sets
    it to 0 and vLLM then resolves the V1 runner; a value selecting V2 is refused, naming the variable, and an engine
    configured for V2 is refused at start-up with the variable named too."""
    import vllm.envs as envs

    engine_args(method="streaming", budget=64)
    assert os.environ[V2_RUNNER_ENV] == "0" and envs.VLLM_USE_V2_MODEL_RUNNER is False
    config = _engine_config(**engine_args(method="streaming", budget=64))
    assert config.use_v2_model_runner is False
    monkeypatch.setenv(V2_RUNNER_ENV, "1")
    with pytest.raises(UnsupportedEngineError, match=f"{V2_RUNNER_ENV}=1 selects vLLM's V2 model runner.*{V2_RUNNER_ENV}=0"):
        engine_args(method="streaming", budget=64)
    assert config.use_v2_model_runner is True  # vLLM's property reads the environment
    settings = BoundedKVSettings(method="streaming", budget=64)
    with pytest.raises(UnsupportedEngineError, match=f"V2 model runner is not supported: set {V2_RUNNER_ENV}=0"):
        check_engine_config(config, settings)


# ---- other start-up refusals ------------------------------------------------------------------------------
def test_an_engine_without_chunked_prefill_is_refused():
    """trikv prefills a long prompt (and a preempted request's history) in chunks compacted between them; vLLM
    without chunked prefill would run it in one prefill, which a bounded request would hold at once: refused with
    the reason (with it: test_long_prompt_on_a_pool_smaller_than_max_model_len,
    test_preempted_request_recomputes_within_its_bound_without_holding_others)."""
    args = engine_args(method="streaming", budget=64)
    settings = BoundedKVSettings.from_config(args["additional_config"])
    check_engine_config(_engine_config(**args), settings)  # vLLM's default: chunked prefill on
    with pytest.raises(UnsupportedEngineError, match="chunked prefill is off: trikv prefills a long prompt"):
        check_engine_config(_engine_config(**{**args, "enable_chunked_prefill": False}), settings)


def test_the_prefill_chunk_cap_sits_where_both_scheduling_loops_read_it():
    """trikv caps a bounded request's prefill per step in `Scheduler._reserve_prefill_lookahead`, vLLM 0.32's last cap
    on a request's new tokens: `schedule` calls it for the running and for the waiting requests, each time after every
    other cap (the long-prefill threshold, the token budget) and before the step's blocks are allocated, so the capped
    count is the one the request is allocated and scheduled for."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    from trikv.vllm.scheduler import TriKVScheduler

    source = inspect.getsource(Scheduler.schedule)
    calls = [index for index in range(len(source)) if source.startswith("num_new_tokens = self._reserve_prefill_lookahead(", index)]
    assert len(calls) == 2
    for call, end in zip(calls, calls[1:] + [len(source)]):
        before, after = source[:call], source[call:end]
        assert before.rfind("long_prefill_token_threshold < num_new_tokens") > before.rfind("self._reserve_prefill_lookahead(")
        assert "self.kv_cache_manager.allocate_slots(" in after
        assert "num_new_tokens = min(" not in after.split("allocate_slots(")[0]
    assert "_reserve_prefill_lookahead" in TriKVScheduler.__dict__


def test_async_scheduling_and_missing_front_end_checks_are_refused(monkeypatch):
    """Async scheduling (CUDA's default) is refused; so is an engine whose front end did not install trikv's request
    checks (no `trikv` plugin, trikv.vllm never imported): beam search would reach the engine as one-token requests."""
    import trikv.vllm.frontend as frontend

    args = engine_args(method="streaming", budget=64)
    settings = BoundedKVSettings.from_config(args["additional_config"])
    config = _engine_config(**args)
    config.scheduler_config.async_scheduling = True
    with pytest.raises(UnsupportedEngineError, match="async scheduling is not supported"):
        check_engine_config(config, settings)
    config.scheduler_config.async_scheduling = False
    monkeypatch.setattr(frontend, "_REGISTERED", False)
    monkeypatch.delenv(frontend.REQUEST_CHECKS_ENV, raising=False)
    with pytest.raises(UnsupportedEngineError, match="request checks are not installed in vLLM's front end"):
        check_engine_config(config, settings)
    monkeypatch.setenv(frontend.REQUEST_CHECKS_ENV, "1")  # inherited from the process that ran them
    check_engine_config(config, settings)


# ---- request settings -------------------------------------------------------------------------------------
def test_malformed_request_settings_are_refused_with_the_reason():
    """A boolean budget, an unknown trikv_* key, a budget under the documented minimum (16) are refused; over HTTP a
    top-level trikv field points to vllm_xargs and a JSON true is caught before vLLM turns it into 1."""
    from trikv.vllm import MIN_BUDGET, RequestSettingsError
    from trikv.vllm.frontend import http_refusal

    settings = BoundedKVSettings(method="knorm", budget=64)
    assert MIN_BUDGET == 16 and settings.request_budget({"trikv_budget": 16}) == 16
    for extra_args, reason in [({"trikv_budget": True}, "must be an integer"), ({"trikv_budget": 1}, r"limits \[16, 64\]"),
                               ({"trikv_budget": 15}, r"at least 16"), ({"trikv_budgett": 40}, "unknown trikv request setting"),
                               ({"trikv": {"budget": 40}}, "unknown trikv request setting"), ("full", "extra_args must be a dict")]:
        with pytest.raises(RequestSettingsError, match=reason):
            settings.request_budget(extra_args)
    assert settings.request_budget({"other_plugin": 1}) == 64  # other plugins' keys are theirs
    with pytest.raises(SettingsError, match="budget must be at least 16"):
        BoundedKVSettings(method="knorm", budget=8)
    with pytest.raises(SettingsError, match="max_request_budget must be at least 16"):
        BoundedKVSettings(method="knorm", budget=64, max_request_budget=4)

    class Parsed:  # an OpenAI request as vLLM parsed it: unknown fields kept in model_extra
        def __init__(self, **extra):
            self.model_extra = extra

    reason, parameter = http_refusal(Parsed(trikv={"budget": 40}), {"trikv": {"budget": 40}})
    assert parameter == "trikv" and "go inside vllm_xargs" in reason and '"vllm_xargs": {"trikv_budget": 512}' in reason
    assert http_refusal(Parsed(trikv_budget=40), {})[1] == "trikv_budget"
    reason, parameter = http_refusal(Parsed(), {"vllm_xargs": {"trikv_budget": True}})
    assert parameter == "trikv_budget" and "got true" in reason
    assert http_refusal(Parsed(), {"vllm_xargs": {"trikv_budget": 40}}) is None


# ---- a round's synchronisations -----------------------------------------------------------------------------
@pytest.mark.parametrize("due, layers", [(2, 2), (12, 6)])
def test_a_round_never_waits_for_the_device(due, layers):
    """A round run on the meta device (CUDA's code path; any value read back would raise there): no value read back
    and no copy that waits, whatever the number of due requests and layers; one queued upload (positions and block
    ids) per round once the scorer's weights are on the device. The chunks (requests, layers and KV heads under a
    small cap) are many; the count does not grow with them."""
    from transformers import LlamaConfig

    from trikv.benchmarks.gpu_check import RoundCase, RoundTrace, paged_round, serving_policy
    from trikv.vllm.compactor import Compactor

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096)
    case = RoundCase("mixed", [48] * (due - 1) + [600], 32, prompt_length=12)
    paged = paged_round(config, case, "meta", torch.float32)
    compactor = Compactor(serving_policy(config), True, 8, round_workspace_bytes=48 * 1024)
    traces = []
    for _ in range(2):
        compactor.kept_positions.clear()
        with RoundTrace() as trace:
            compactor.run(paged.rounds, paged.caches, paged.codecs, paged.block_ids)
        traces.append(trace)
    chunks = compactor.chunks // 2
    assert chunks >= due, "the cap did not cut this round into chunks"
    assert [t.reads for t in traces] == [0, 0] and [t.blocking_copies for t in traces] == [0, 0]
    assert traces[1].async_copies == 1  # the round's one upload
    assert set(compactor.kept_positions) == set(paged.block_ids)
    assert all(p.dtype == torch.int32 and p.shape == (layers, 2, 32) for p in compactor.kept_positions.values())
