"""Request checks in vLLM's frontend: what a bounded server refuses with HTTP 400 instead of serving wrongly.

vLLM validates every request in its `InputProcessor` (in the API server process, or in `LLM`'s), and turns a
`VLLMValidationError` raised there into an HTTP 400 with its message. On an engine with trikv settings, trikv
adds these checks there:

- a request's own budget, `SamplingParams.extra_args["trikv_budget"]` (OpenAI API:
  `extra_body={"vllm_xargs": {"trikv_budget": 1024}}`, or `"full"`), must be within the server's limits
  (`BoundedKVSettings.request_budget`: at least `MIN_BUDGET`), its session choice `"trikv_session"` "on" or "off",
  and no other `trikv*` key;
- beam search is refused: vLLM runs it as a new one-token request per step whose prompt is the whole beam, so
  no request ever reaches a round and the beams run with full attention;
- streaming-input sessions (resumable requests) are refused: their prompt grows after the request started,
  which the rounds' bookkeeping (prompt length, logical offset) does not follow;
- a full-attention request (`"full"`, with `allow_full_requests`) whose prompt and first generated token need more
  blocks than the KV pool's usable ones is refused (`capacity.full_request_refusal`): a bounded engine may run
  with a pool smaller than max_model_len, which vLLM's own check (prompt within max_model_len) does not see. The
  front end counts the full-attention blocks of one engine's pool (known once the engine started; with data
  parallelism the engines' pools are summed here, so the check is left to each engine's scheduler), the
  scheduler the blocks of every KV cache group (a hybrid model's sliding windows too) and refuses the rest.

Over HTTP, before a request is turned into sampling parameters (where a JSON `true` has already become 1 and
unknown top-level fields are dropped), the raw body is checked too: a boolean `trikv*` value in `vllm_xargs`,
and a top-level `trikv*` field (settings sent beside `vllm_xargs` instead of inside it), get HTTP 400.

`register()` installs the checks. It runs as a vLLM general plugin (the `vllm.general_plugins` entry point, so
also in the API server of a plain `vllm serve` with trikv's flags) and when `trikv.vllm.engine_args` is called; engines
without trikv settings are not affected. It also marks the process environment (`REQUEST_CHECKS_ENV`), which
vLLM's engine processes inherit: the scheduler refuses to start without the mark, since a front end without
these checks would let beam search through unseen (the engine cannot tell a beam step from an ordinary
one-token request). The engine refuses the rest itself (`TriKVScheduler.add_request`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys

from .settings import REQUEST_BUDGET_KEY, REQUEST_KEY_PREFIX, REQUEST_SESSION_KEY, BoundedKVSettings, RequestSettingsError

REQUEST_CHECKS_ENV = "TRIKV_REQUEST_CHECKS"  # set where the checks run; vLLM's engine processes inherit it
_HTTP_MODULE = "vllm.entrypoints.generate.base.serving"  # chat, completions and responses all pass through it
_REGISTERED = False


def register() -> None:
    """Wrap vLLM's `InputProcessor` (and, once the API server imports it, its OpenAI serving base) with trikv's
    request checks (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:  # vLLM absent or another release: `check_vllm_version` says so where it matters
        return
    _REGISTERED = True
    os.environ[REQUEST_CHECKS_ENV] = "1"
    _when_imported(_HTTP_MODULE, _check_http_bodies)
    process_inputs = InputProcessor.process_inputs
    resolve_watermarking = InputProcessor.resolve_watermarking

    @functools.wraps(process_inputs)
    def checked_process_inputs(self, request_id, prompt, params, *args, **kwargs):
        settings = _settings(self)
        if settings is not None:
            check_request(settings, params, resumable=bool(kwargs.get("resumable", False)))
        request = process_inputs(self, request_id, prompt, params, *args, **kwargs)
        if settings is not None:  # the prompt's length is known once vLLM has rendered it
            check_full_request_fits(settings, self.vllm_config, params, _prompt_length(request))
        return request

    @functools.wraps(resolve_watermarking)
    def checked_resolve_watermarking(self, params):
        from vllm.sampling_params import BeamSearchParams

        if isinstance(params, BeamSearchParams) and _settings(self) is not None:
            _refuse("beam search is not supported with a bounded KV cache: vLLM runs every beam step as a new "
                    "request over the whole beam, which is never compacted; run it on a server without trikv")
        return resolve_watermarking(self, params)

    InputProcessor.process_inputs = checked_process_inputs
    InputProcessor.resolve_watermarking = checked_resolve_watermarking


def checks_installed() -> bool:
    """True where trikv's front-end checks run in this process or in the one that started it."""
    return _REGISTERED or os.environ.get(REQUEST_CHECKS_ENV) == "1"


def check_request(settings: BoundedKVSettings, params, resumable: bool = False) -> None:
    """Raise vLLM's validation error (HTTP 400) for a request this bounded server cannot serve as asked."""
    if resumable:
        _refuse("streaming-input sessions are not supported with a bounded KV cache: the prompt would grow after "
                "the request's cache was compacted")
    extra_args = getattr(params, "extra_args", None)
    try:
        settings.request_session(extra_args)
    except RequestSettingsError as error:
        _refuse(str(error), parameter=REQUEST_SESSION_KEY, value=(extra_args or {}).get(REQUEST_SESSION_KEY))
    try:
        settings.request_budget(extra_args)
    except RequestSettingsError as error:
        _refuse(str(error), parameter=REQUEST_BUDGET_KEY, value=(extra_args or {}).get(REQUEST_BUDGET_KEY))


def check_full_request_fits(settings: BoundedKVSettings, vllm_config, params, prompt_tokens: int | None) -> None:
    """Raise vLLM's validation error (HTTP 400) for a full-attention request whose prompt and first generated token
    need more blocks than one engine's usable pool holds (nothing to check before the engine reported its pool,
    with data parallelism, or for a bounded request)."""
    from .capacity import full_request_refusal

    cache_config = vllm_config.cache_config
    if (prompt_tokens is None or not cache_config.num_gpu_blocks or not cache_config.block_size
            or vllm_config.parallel_config.data_parallel_size != 1):
        return
    try:
        if settings.request_budget(getattr(params, "extra_args", None)) is not None:
            return
    except RequestSettingsError:
        return  # refused by check_request already
    capacity = (cache_config.num_gpu_blocks - 1) * cache_config.block_size  # vLLM keeps one block back (its null block)
    reason = full_request_refusal(prompt_tokens, capacity)
    if reason is not None:
        _refuse(reason, parameter=REQUEST_BUDGET_KEY, value="full")


def _prompt_length(request) -> int | None:
    ids = getattr(request, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    embeds = getattr(request, "prompt_embeds", None)
    return None if embeds is None else len(embeds)


def http_refusal(request, body) -> tuple[str, str] | None:
    """(reason, parameter) for an OpenAI API request a bounded server refuses before vLLM reads it, else None:
    `request` the parsed request (its `model_extra`: fields vLLM does not know), `body` the raw JSON object."""
    extra = getattr(request, "model_extra", None) or {}
    beside = sorted(key for key in extra if isinstance(key, str) and key.startswith(REQUEST_KEY_PREFIX))
    if beside:
        return (f"{beside} is not a request field: trikv's request settings go inside vllm_xargs, e.g. "
                f'extra_body={{"vllm_xargs": {{"{REQUEST_BUDGET_KEY}": 512}}}}', beside[0])
    xargs = body.get("vllm_xargs") if isinstance(body, dict) else None
    for key, value in (xargs.items() if isinstance(xargs, dict) else ()):
        if isinstance(key, str) and key.startswith(REQUEST_KEY_PREFIX) and isinstance(value, bool):
            if key == REQUEST_SESSION_KEY:
                return f'{key} must be "on" or "off", got {json.dumps(value)}', key
            return (f"{key} must be an integer number of KV entries per (layer, KV head) or 'full', got "
                    f"{json.dumps(value)}", key)
    return None


def _check_http_bodies(module) -> None:
    """Wrap the OpenAI serving base's per-request entry (every create_* passes its request and raw HTTP request
    through it) with `http_refusal`: a refused request gets an HTTP 400 and never reaches the engine."""
    serving = module.GenerateBaseServing
    original = serving._with_kv_transfer_rejection_cleanup

    @functools.wraps(original)
    async def checked(self, awaitable, request, raw_request):
        settings = _settings(self.input_processor)
        if settings is not None:
            try:
                body = await raw_request.json() if raw_request is not None else None
            except Exception:  # not JSON: vLLM answers that itself
                body = None
            refusal = http_refusal(request, body)
            if refusal is not None:
                if hasattr(awaitable, "close"):
                    awaitable.close()  # the create_* coroutine never runs
                return self.create_error_response(refusal[0], param=refusal[1])
        return await original(self, awaitable, request, raw_request)

    serving._with_kv_transfer_rejection_cleanup = checked


def _when_imported(name: str, patch) -> None:
    """Call `patch(module)` once module `name` is imported (now if it is): vLLM's HTTP modules are imported by the
    API server alone, so a process that never serves HTTP never pays for them."""
    if name in sys.modules:
        patch(sys.modules[name])
        return

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module):
                    run(module)
                    patch(module)

                spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AfterImport())


def _settings(processor) -> BoundedKVSettings | None:
    if not hasattr(processor, "_trikv_settings"):
        processor._trikv_settings = BoundedKVSettings.from_config(processor.vllm_config.additional_config)
    return processor._trikv_settings


def _refuse(message: str, **details) -> None:
    from vllm.exceptions import VLLMValidationError

    raise VLLMValidationError(message, **details)
