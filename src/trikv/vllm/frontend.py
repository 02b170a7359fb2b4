"""Request checks in vLLM's frontend: what a bounded server refuses with HTTP 400 instead of serving wrongly.

vLLM validates every request in its `InputProcessor` (in the API server process, or in `LLM`'s), and turns a
`VLLMValidationError` raised there into an HTTP 400 with its message. On an engine with trikv settings, trikv
adds three checks there:

- a request's own budget, `SamplingParams.extra_args["trikv_budget"]` (OpenAI API:
  `extra_body={"vllm_xargs": {"trikv_budget": 1024}}`, or `"full"`), must be within the server's limits
  (`BoundedKVSettings.request_budget`);
- beam search is refused: vLLM runs it as a new one-token request per step whose prompt is the whole beam, so
  no request ever reaches a round and the beams run with full attention;
- streaming-input sessions (resumable requests) are refused: their prompt grows after the request started,
  which the rounds' bookkeeping (prompt length, logical offset) does not follow.

`register()` installs the checks. It runs as a vLLM general plugin (the `vllm.general_plugins` entry point, so
also in the API server of a plain `vllm serve` with trikv's flags) and when `trikv.vllm` is imported; engines
without trikv settings are not affected.
"""

from __future__ import annotations

import functools

from .settings import BoundedKVSettings, RequestSettingsError, REQUEST_BUDGET_KEY

_REGISTERED = False


def register() -> None:
    """Wrap vLLM's `InputProcessor` with trikv's request checks (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:  # vLLM absent or another release: `check_vllm_version` says so where it matters
        return
    _REGISTERED = True
    process_inputs = InputProcessor.process_inputs
    resolve_watermarking = InputProcessor.resolve_watermarking

    @functools.wraps(process_inputs)
    def checked_process_inputs(self, request_id, prompt, params, *args, **kwargs):
        settings = _settings(self)
        if settings is not None:
            check_request(settings, params, resumable=bool(kwargs.get("resumable", False)))
        return process_inputs(self, request_id, prompt, params, *args, **kwargs)

    @functools.wraps(resolve_watermarking)
    def checked_resolve_watermarking(self, params):
        from vllm.sampling_params import BeamSearchParams

        if isinstance(params, BeamSearchParams) and _settings(self) is not None:
            _refuse("beam search is not supported with a bounded KV cache: vLLM runs every beam step as a new "
                    "request over the whole beam, which is never compacted; run it on a server without trikv")
        return resolve_watermarking(self, params)

    InputProcessor.process_inputs = checked_process_inputs
    InputProcessor.resolve_watermarking = checked_resolve_watermarking


def check_request(settings: BoundedKVSettings, params, resumable: bool = False) -> None:
    """Raise vLLM's validation error (HTTP 400) for a request this bounded server cannot serve as asked."""
    if resumable:
        _refuse("streaming-input sessions are not supported with a bounded KV cache: the prompt would grow after "
                "the request's cache was compacted")
    extra_args = getattr(params, "extra_args", None)
    try:
        settings.request_budget(extra_args)
    except RequestSettingsError as error:
        _refuse(str(error), parameter=REQUEST_BUDGET_KEY, value=(extra_args or {}).get(REQUEST_BUDGET_KEY))


def _settings(processor) -> BoundedKVSettings | None:
    if not hasattr(processor, "_trikv_settings"):
        processor._trikv_settings = BoundedKVSettings.from_config(processor.vllm_config.additional_config)
    return processor._trikv_settings


def _refuse(message: str, **details) -> None:
    from vllm.exceptions import VLLMValidationError

    raise VLLMValidationError(message, **details)
