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
  loops (running and waiting requests) call before allocating blocks;
- microbatching: each microbatch's metadata takes the physical lengths of its own rows;
- the guards that only run on CUDA (the worker's refusals of FULL graphs and of the V2 runner, pinned uploads), made
  reachable with vLLM's own initialisation stubbed and the copy calls recorded.
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


# ---- microbatching (`--enable-dbo`, `ubatch_size > 1`: CUDA, with DeepEP / NIXL all2all backends) -------------
def test_each_microbatch_attends_over_its_own_rows_physical_lengths():
    """vLLM 0.32 builds a microbatch's attention metadata from a slice of the step's (`split_attn_metadata`, rows
    `request_slice`), passing the microbatch's index to `build_metadata`. Four requests (two compacted, at rows 1 and
    3, one of them split across the two microbatches by vLLM's own token-balanced cut) go through the worker's
    wrapper of the full-attention group, each microbatch on its own: every row's sequence length is its request's
    logical length in that microbatch less that request's offset (not the offset of the step's row 0 + i)."""
    import inspect
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices, split_attn_metadata

    from trikv.vllm.worker import BoundedKVRunner, _physical_metadata

    # where vLLM hands the slices over and how it calls the builder of each microbatch
    source = inspect.getsource(GPUModelRunner._build_attention_metadata)
    assert "split_attn_metadata(ubatch_slices, cm)" in source
    assert "attn_group.build_metadata(\n                    common_attn_metadata,\n                    ubid or 0," in source
    assert "ubatch_slices=ubatch_slices_attn," in inspect.getsource(GPUModelRunner.execute_model)

    query = np.array([1, 1, 6, 1])  # tokens scheduled per request: three decodes and a prefill chunk
    logical = torch.tensor([50, 140, 30, 200], dtype=torch.int32)  # logical lengths after the step
    offsets = {0: 0, 1: 76, 2: 0, 3: 136}  # request row -> logical - physical
    starts = torch.tensor([0, *np.cumsum(query)], dtype=torch.int32)
    tokens = int(query.sum())
    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=logical.clone(), num_reqs=4,
        num_actual_tokens=tokens, max_query_len=int(query.max()), max_seq_len=int(logical.max()),
        block_table_tensor=torch.arange(4 * 8, dtype=torch.int32).view(4, 8), slot_mapping=torch.arange(tokens),
        seq_lens_cpu_upper_bound=logical.clone())
    slices, _ = maybe_create_ubatch_slices(True, query, tokens, 4, 2)
    assert len(slices) == 2 and slices[1].request_slice.start > 0
    assert slices[0].request_slice.stop - 1 == slices[1].request_slice.start  # vLLM split request 2 across both

    class Runner(BoundedKVRunner):
        pass

    runner = Runner()
    runner._trikv_row_offsets = torch.tensor([offsets[row] for row in range(4)])
    runner._trikv_ubatch_slices = slices
    group = SimpleNamespace(build_metadata=lambda metadata, ubatch_idx=0, **kwargs: metadata)
    _physical_metadata(group, runner)
    for ubid, half in enumerate(split_attn_metadata(slices, common)):
        rows = range(slices[ubid].request_slice.start, slices[ubid].request_slice.stop)
        expected = [int(half.seq_lens[i]) - offsets[row] for i, row in enumerate(rows)]
        built = group.build_metadata(half, ubid)
        assert built.seq_lens.tolist() == expected, (ubid, list(rows))
        assert built.seq_lens_cpu_upper_bound.tolist() == expected and built.max_seq_len == max(expected)
    # the rows of the second microbatch carry offsets its row 0 + i would not: the old reading differs
    assert [offsets[row] for row in range(slices[1].request_slice.start, 4)] != [offsets[i] for i in range(4 - slices[1].request_slice.start)]

    # the runner keeps the step's slices while vLLM builds the metadata, and drops them after
    seen = []

    class Parent:
        def _build_attention_metadata(self, *args, **kwargs):
            seen.append(self._trikv_ubatch_slices)
            return "metadata"

    class Wrapped(BoundedKVRunner, Parent):
        pass

    wrapped = Wrapped()
    assert wrapped._build_attention_metadata(num_tokens=tokens, ubatch_slices=slices) == "metadata"
    assert seen == [slices] and wrapped._trikv_ubatch_slices is None


# ---- guards that only run on CUDA, made reachable here ---------------------------------------------------------
def test_uploads_to_cuda_are_pinned_and_queued(monkeypatch):
    """A round's header and the step's offsets go up from pinned memory with non_blocking=True (from pageable memory
    CUDA's copy waits for the host); on CPU the tensor is used as it is. The copy calls are recorded, not run (this
    machine has no CUDA)."""
    from trikv.vllm.compactor import upload

    calls = []

    def pin_memory(self):
        calls.append("pin")
        return self

    def to(self, device, non_blocking=False):
        calls.append(("to", torch.device(device).type, non_blocking))
        return self

    host = torch.arange(6)
    assert upload(host, torch.device("cpu")) is host
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    upload(host, torch.device("cuda", 0))
    assert calls == ["pin", ("to", "cuda", True)]


def _worker(settings_args: dict, **config):
    """A TriKVWorker without its device: settings and a real engine configuration, vLLM's own start-up not run."""
    from trikv.vllm.worker import TriKVWorker

    worker = TriKVWorker.__new__(TriKVWorker)
    worker.vllm_config = _engine_config(**settings_args, **config)
    worker.trikv = BoundedKVSettings.from_config(worker.vllm_config.additional_config)
    return worker


@pytest.mark.parametrize("mode", FULL_MODES, ids=lambda mode: mode.name)
def test_the_worker_refuses_full_graphs_as_the_runner_resolved_them(monkeypatch, mode):
    """vLLM resolves the graph mode in the worker (after the scheduler's check: attention fused with quantisation
    turns PIECEWISE into FULL there); the worker refuses a resolved mode with FULL graphs before it learns its pages.
    vLLM's own initialisation is stubbed: what runs is trikv's check on the configuration it leaves."""
    from trikv.vllm import worker as worker_module

    monkeypatch.setattr(worker_module._PlatformWorker, "initialize_from_config", lambda self, *args, **kwargs: None)
    worker = _worker(engine_args(method="streaming", budget=64))
    worker.vllm_config.compilation_config.cudagraph_mode = mode
    with pytest.raises(UnsupportedEngineError, match=f"CUDA graph mode {mode.name} replays attention"):
        worker.initialize_from_config(None)

    class Learnt(Exception):
        pass

    def learn(*args):
        raise Learnt

    worker.vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    worker.model_runner = type("Runner", (), {"trikv_learn_pages": staticmethod(learn)})()
    monkeypatch.setattr(worker_module, "_tp", lambda: (0, 1))
    with pytest.raises(Learnt):  # PIECEWISE passes on to the page learning
        worker.initialize_from_config(None)


def test_the_worker_refuses_the_v2_runner_it_was_given(monkeypatch, no_runner_choice):
    """Where VLLM_USE_V2_MODEL_RUNNER reaches the worker anyway, vLLM builds its V2 `GPUModelRunner`
    (vllm.v1.worker.gpu.model_runner), which is not the V1 class trikv extends: the worker refuses it naming the
    variable. A V1 runner (the CPU build's CPUModelRunner derives from V1's GPUModelRunner) becomes trikv's."""
    import inspect

    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_worker import Worker

    from trikv.vllm import worker as worker_module
    from trikv.vllm.worker import BoundedKVRunner

    assert "from vllm.v1.worker.gpu.model_runner import" in inspect.getsource(Worker._make_model_runner)
    given = []
    monkeypatch.setattr(worker_module._PlatformWorker, "init_device", lambda self: setattr(self, "model_runner", given[-1]))
    monkeypatch.setattr(worker_module, "check_model", lambda *args: None)
    given.append(V2Runner.__new__(V2Runner))
    worker = _worker(engine_args(method="streaming", budget=64))
    with pytest.raises(RuntimeError, match=r"not vllm\.v1\.worker\.gpu\.model_runner\.GPUModelRunner; set VLLM_USE_V2_MODEL_RUNNER=0"):
        worker.init_device()
    given.append(CPUModelRunner.__new__(CPUModelRunner))
    worker.init_device()
    assert isinstance(worker.model_runner, BoundedKVRunner) and isinstance(worker.model_runner, CPUModelRunner)


def test_splitting_ops_that_would_capture_attention_in_piecewise_graphs_are_refused():
    """vLLM adds its attention ops to `splitting_ops` only when the user gives none; a user's list without the
    attention op (merged by `engine_args`) puts attention inside PIECEWISE graphs, replayed with logical lengths:
    refused at start-up with the reason. A list with the attention op, none at all, or no graphs pass."""
    from trikv.vllm.support import ATTENTION_OP, graph_mode_problem

    args = engine_args(method="streaming", budget=64,
                       compilation_config={"splitting_ops": ["vllm::unified_kv_cache_update"]})
    assert args["compilation_config"] == {"cudagraph_mode": "PIECEWISE", "splitting_ops": ["vllm::unified_kv_cache_update"]}
    captured = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE,
                                 splitting_ops=["vllm::unified_kv_cache_update"])
    problem = graph_mode_problem(captured)
    assert problem is not None and ATTENTION_OP in problem and "capture attention" in problem
    settings = BoundedKVSettings.from_config(args["additional_config"])
    config = _engine_config(**{key: value for key, value in args.items() if key != "compilation_config"})
    config.compilation_config = captured
    with pytest.raises(UnsupportedEngineError, match="lacks 'vllm::unified_attention_with_output'"):
        check_engine_config(config, settings)
    for fine in (CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE,
                                   splitting_ops=[ATTENTION_OP, "vllm::unified_kv_cache_update"]),
                 CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE),
                 CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.NONE,
                                   splitting_ops=["vllm::unified_kv_cache_update"])):
        assert graph_mode_problem(fine) is None


def test_fp8_keys_are_read_with_per_head_scales():
    """An fp8 checkpoint with KV scales per attention head (compressed-tensors' "attn_head", which FlashAttention 3
    reads) gives each layer `_k_scale` [Hkv]: a round reads head h's keys as its bytes x scale[h] (and a chunk of heads
    with its heads' scales), never the layer's whole scale vector against every head (a broadcast error in the
    engine). The pages are learnt through a write that stores keys as fp8 bytes, as vLLM's kernels do."""
    from trikv.vllm.compactor import _heads_scale
    from trikv.vllm.pages import PageCodec

    fmt, heads, block, dim = torch.float8_e4m3fn, 2, 16, 8
    cache = torch.zeros(4, heads, block, 2 * dim, dtype=torch.uint8)  # [blocks, Hkv, N, keys | values] bytes

    def write(keys, values, scratch, slots):  # keys, values [n, Hkv, D] already divided by a scale of 1
        scratch[0, :, slots, :dim] = keys.transpose(0, 1).to(fmt).view(torch.uint8)
        scratch[0, :, slots, dim:] = values.transpose(0, 1).to(fmt).view(torch.uint8)

    codec = PageCodec.learn(write, cache, heads, block, dim, quantised=fmt, key_dtype=torch.float32)
    keys = torch.randn(2 * block, heads, dim) * 4  # two blocks of tokens
    for index, block_id in enumerate((1, 3)):
        write(keys[index * block : (index + 1) * block], keys[index * block : (index + 1) * block], cache[block_id : block_id + 1],
              torch.arange(block))
    table = torch.tensor([[1, 3]])
    scale = torch.tensor([0.5, 2.0])  # [Hkv]
    stored = keys.to(fmt).to(torch.float32).transpose(0, 1)[None]  # [1, Hkv, 2N, D] what the bytes decode to
    read = codec.read_keys(cache, codec.locate(table, cache), scale)
    assert torch.equal(read, stored * scale.view(1, -1, 1, 1))
    second = codec.read_keys(cache, codec.locate(table, cache, slice(1, 2)), _heads_scale(scale, slice(1, 2)))
    assert torch.equal(second, stored[:, 1:] * 2.0)
    assert torch.equal(codec.read_keys(cache, codec.locate(table, cache), torch.tensor(0.5)), stored * 0.5)  # per layer


def test_a_backend_that_splits_blocks_into_kernel_blocks_is_learnt_and_compacted_in_kernel_blocks():
    """Where the attention backend needs blocks smaller than the KV cache manager's (FlashInfer off Blackwell at
    --block-size 128), vLLM views each layer as kernel blocks ([blocks x k, H, N / k, 2D]: kernel block j of block b
    at b x k + j, a slot's token where vLLM's KV write puts it). The worker learns the page of one kernel block (not a
    manager block, which would write past the one-block scratch copy), and a round reads a request's manager blocks as
    their kernel blocks: with blocks of 32 split in two, a request of 3 blocks (5, 2, 7; 90 tokens) compacted by Knorm
    (no protection) to 40 keeps the 40 lowest-norm keys of each head, in order, in its first slots, read back through
    vLLM's own slot arithmetic."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from trikv.policies import make_policy
    from trikv.vllm.compactor import CompactionOp, Compactor
    from trikv.vllm.worker import BoundedKVRunner

    from paged import LAYOUTS, layer_views, reference_write

    heads, dim, block, kernel, blocks = 2, 8, 32, 16, 8
    views = layer_views(LAYOUTS["LBHNC"], 2, blocks * (block // kernel), heads, kernel, dim)
    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=dim, dtype=torch.float32)
    names = [f"model.layers.{index}.self_attn.attn" for index in range(2)]
    layers = {name: SimpleNamespace(kv_cache=view, impl=SimpleNamespace(
        do_kv_cache_update=lambda layer, keys, values, cache, slots: reference_write(keys, values, cache, slots)))
        for name, view in zip(names, views)}
    groups = [SimpleNamespace(kernel_block_size=kernel, kernel_block_stride=0, build_metadata=lambda m, ubatch_idx=0, **kw: m)]
    runner = SimpleNamespace(
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=names)]),
        attn_groups=[groups], compilation_config=SimpleNamespace(static_forward_context=layers), kv_caches=views,
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout=None), model_config=SimpleNamespace(dtype=torch.float32))
    BoundedKVRunner.trikv_learn_pages(runner, (0, 1), heads, dim)
    assert runner._trikv_kernel_blocks == (2, 2) and all(codec.block_size == kernel for codec in runner._trikv_codecs)

    table, length, budget = [5, 2, 7], 90, 40
    torch.manual_seed(0)
    keys = torch.randn(2, length, heads, dim)
    slots = torch.tensor([table[t // block] * block + t % block for t in range(length)])  # vLLM's slots, manager blocks
    for layer, view in enumerate(views):
        reference_write(keys[layer], keys[layer], view, slots)
    runner.trikv_compactor = Compactor(make_policy("knorm"), protect_prompt=False, min_decode_room=0)
    runner.requests = {"r": SimpleNamespace(block_ids=(list(table),))}
    runner._trikv_copy_on_write = lambda rounds: None
    runner.input_batch = SimpleNamespace(req_id_to_index={})  # the request is not in this step's batch
    op = CompactionOp(request_id="r", position=length, length=length, budget=budget, prompt_length=0, kept_blocks=2,
                      freed_blocks=1, free_blocks=0, held_blocks=3)
    BoundedKVRunner._trikv_rounds(runner, [op])
    for layer, view in enumerate(views):
        for head in range(heads):
            expected = keys[layer, :, head].norm(dim=-1).topk(budget, largest=False).indices.sort().values
            stored = torch.stack([view[table[slot // block] * 2 + (slot % block) // kernel, head, slot % kernel, :dim]
                                  for slot in range(budget)])
            assert torch.equal(stored, keys[layer, expected, head]), (layer, head)


def test_vllm_builds_each_microbatchs_metadata_through_the_physical_wrapper():
    """vLLM 0.32's real `_build_attention_metadata`, on a runner stubbed around it, with two microbatches and a
    metadata builder that supports `update_block_table` (FlashAttention's does): vLLM caches microbatch 0's metadata
    under (spec, builder type) and would hand microbatch 1 a copy of it (microbatch 0's sequence lengths) through
    `update_block_table`. With the full-attention group made physical, each microbatch's metadata is built through
    trikv's wrapper: its rows' physical lengths (logical less each request's offset)."""
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices

    from trikv.vllm.worker import BoundedKVRunner, _physical_metadata

    class FlashLikeBuilder:
        supports_update_block_table = True

        def build(self, common_prefix_len, common, **kwargs):
            return SimpleNamespace(seq_lens=common.seq_lens.clone(), block_table=common.block_table_tensor)

        def update_block_table(self, metadata, block_table, slot_mapping):  # FlashAttention's: the cached lengths stay
            return SimpleNamespace(seq_lens=metadata.seq_lens, block_table=block_table)

    builders = [FlashLikeBuilder(), FlashLikeBuilder()]
    group = SimpleNamespace(layer_names=["model.layers.0.self_attn.attn"], metadata_builders=builders,
                            get_metadata_builder=lambda ubid=0: builders[ubid],
                            map_to_kernel_block_table=lambda table, ubid=0: table)
    group.build_metadata = lambda common, ubid=0, **kwargs: group.get_metadata_builder(ubid).build(0, common)

    query = np.array([1, 1, 6, 1])
    logical = torch.tensor([50, 140, 30, 200], dtype=torch.int32)
    offsets = torch.tensor([0, 76, 0, 136])
    tokens = int(query.sum())
    starts = torch.tensor([0, *np.cumsum(query)], dtype=torch.int32)
    slices, _ = maybe_create_ubatch_slices(True, query, tokens, 4, 2)
    assert len(slices) == 2

    class Runner(BoundedKVRunner, GPUModelRunner):
        def _get_encoder_seq_lens(self, *args, **kwargs):
            return None, None

    runner = Runner.__new__(Runner)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    table = SimpleNamespace(get_device_tensor=lambda n: torch.arange(4 * 8, dtype=torch.int32).view(4, 8)[:n])
    runner.__dict__.update(
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=group.layer_names)]),
        optimistic_seq_lens_cpu=logical.clone(), device=torch.device("cpu"), is_mm_prefix_lm=False,
        input_batch=SimpleNamespace(block_table=[table], num_computed_tokens_cpu_tensor=logical - torch.tensor(query),
                                    num_prompt_tokens_cpu_tensor=torch.ones(4, dtype=torch.int32)),
        model_config=SimpleNamespace(rswa_window=None), cache_config=SimpleNamespace(use_replayssm=False, kv_sharing_fast_prefill=False),
        query_start_loc=SimpleNamespace(gpu=starts, cpu=starts.clone()), seq_lens=logical.clone(), positions=torch.arange(tokens),
        dcp_world_size=1, speculative_config=None, attn_groups=[[group]], _trikv_row_offsets=offsets)

    def build():
        metadata, _ = runner._build_attention_metadata(tokens, 4, int(query.max()), ubatch_slices=slices,
                                                       slot_mappings={0: torch.arange(tokens)})
        return [metadata[ubid][group.layer_names[0]].seq_lens.tolist() for ubid in range(2)]

    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.ubatch_utils import split_attn_metadata

    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=logical.clone(), num_reqs=4,
        num_actual_tokens=tokens, max_query_len=int(query.max()), max_seq_len=int(logical.max()),
        block_table_tensor=torch.arange(4 * 8, dtype=torch.int32).view(4, 8), slot_mapping=torch.arange(tokens),
        seq_lens_cpu_upper_bound=logical.clone())
    halves = split_attn_metadata(slices, common)  # each microbatch's logical lengths, as vLLM cuts them
    expected = [[int(half.seq_lens[i]) - int(offsets[row])
                 for i, row in enumerate(range(cut.request_slice.start, cut.request_slice.stop))]
                for half, cut in zip(halves, slices)]

    untouched = build()  # vLLM alone: microbatch 1 gets microbatch 0's metadata back through update_block_table
    assert untouched[1] == untouched[0] and untouched[1] != [int(half) for half in halves[1].seq_lens]
    _physical_metadata(group, runner)
    assert not any(builder.supports_update_block_table for builder in builders)
    assert build() == expected
