"""What a user sets for a bounded KV cache inside vLLM, carried in vLLM's `additional_config["trikv"]`.

The settings travel as a plain dict through vLLM's own configuration (`LLM(additional_config=...)`,
`vllm serve --additional-config '{"trikv": {...}}'`), reach the scheduler and every worker process, and are
validated in each of them by `BoundedKVSettings.from_config`, so a bad value fails at engine start-up with a
message that names it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..policies import REGISTRY, Policy, scores_keys_only
from ..settings import (DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH, DEFAULT_METHOD, DEFAULT_MIN_DECODE_ROOM, DEFAULT_PREFILL_CHUNK_SIZE,
                        DEFAULT_ROUND_WORKSPACE_BYTES, CacheSettings, check_recent_window, peak_entries_bound)

CONFIG_KEY = "trikv"
# the per-request choice, in `SamplingParams.extra_args` (OpenAI API: `extra_body={"vllm_xargs": {...}}`)
REQUEST_BUDGET_KEY = "trikv_budget"
REQUEST_SESSION_KEY = "trikv_session"  # "off": the request neither continues a kept state nor leaves one
SESSION_CHOICES = ("on", "off")
REQUEST_KEY_PREFIX = "trikv"  # every extra_args key of trikv's starts with it; unknown ones are refused
# the smallest budget a server or a request may set: below it a round keeps fewer entries than StreamingLLM's 4
# attention sinks plus a dozen recent tokens, and generated text degrades to noise
MIN_BUDGET = 16
# The default cap on the rounds one step starts, from what a round costs next to a step. At 8B-model shapes (32
# layers, 8 KV heads, head_dim 128, bf16, B = 2048) one request's round is 3 chunks and about 2.4 ms of an H200
# (docs/vllm-cuda.md: 64 requests due plan 192 chunks, ~154 ms estimated), while a decode step of 64 such requests
# reads about 3.3 ms of weights and 3.8 ms of KV: 4 rounds cost about one decode step, so a step that starts them
# takes at most about twice as long as one without, where a wave of 64 due together would cost about 20 steps.
ROUNDS_PER_STEP = 4


class SettingsError(ValueError):
    """A trikv setting for vLLM is missing, unknown or out of range."""


class RequestSettingsError(ValueError):
    """A request's own trikv choice (`extra_args["trikv_budget"]`) is malformed or outside the server's limits."""


def serving_methods() -> list[str]:
    """Registered methods that run inside vLLM: they score stored keys only (no queries, per-step statistics,
    rewritten values or per-head budgets), so a round needs nothing but the request's keys and positions, and
    they declare that a request's scores depend on that request alone (`scores_rows_independently`): a round
    scores every request due in the step together."""
    return [name for name, entry in REGISTRY.items() if name != "full" and scores_keys_only(entry.policy_class)]


@dataclass
class BoundedKVSettings:
    """A bounded KV cache per request: when a request's KV reaches `budget + divide_length` entries, the top
    `budget` per (layer, KV head) under `method` are kept and the freed blocks return to vLLM's pool. A request
    whose prefill would take it past budget + divide_length is prefilled at most `prefill_chunk_size` tokens per
    step, with a round between chunks whenever it reaches budget + divide_length, so no request ever holds more
    than `peak_entries` entries, whatever its length (the rule of trikv's transformers and MLX caches).

    The cache settings (method, budget, divide_length, stats, prompt protection, options, prefill_chunk_size) are
    trikv's `CacheSettings`, with its defaults (`trikv.settings`), validated through it (`cache_settings`); the
    rest are serving limits.

    A request may choose its own budget with `extra_args["trikv_budget"]` (an integer, or "full" for full
    attention), within the server's limits: at least `MIN_BUDGET` (16) and above the method's recent window, at
    most `max_request_budget` (default: `budget`, so a request can shrink its cache but not grow it), and "full"
    only with `allow_full_requests`. Any other `trikv*` key of `extra_args` but `trikv_session` is refused, not
    ignored.

    Session reuse (`session_reuse`, on by default): a finished bounded request's compacted KV is kept, reclaimable,
    and a later request whose prompt continues its token ids starts from it instead of prefilling the whole
    conversation again (`sessions.py`). At most `max_kept_sessions` states are kept (default: max_num_seqs). A
    request opts out with `extra_args["trikv_session"] = "off"`.
    """

    method: str = DEFAULT_METHOD
    budget: int = int(DEFAULT_BUDGET)
    divide_length: int = int(DEFAULT_DIVIDE_LENGTH)
    stats: str | None = None  # bundled name or path of a `trikv calibrate` file (methods that need statistics)
    protect_prompt: bool = True
    min_decode_room: int = DEFAULT_MIN_DECODE_ROOM
    options: dict = field(default_factory=dict)  # method options (e.g. {"recent_window": 8})
    allow_untested_platform: bool = False  # run on a vLLM platform other than CPU (tested here: CPU only)
    record_rounds: bool = False  # keep every round's kept positions (for tests: `LLM.collective_rpc("trikv_rounds")`)
    # cap on a round's transient memory per worker (see `Compactor.chunk_bytes` for what it counts)
    round_workspace_bytes: int = DEFAULT_ROUND_WORKSPACE_BYTES
    max_request_budget: int | None = None  # largest budget a request may ask for (None: `budget`)
    allow_full_requests: bool = False  # a request may ask for full attention ("full")
    # at most this many rounds start in one step (None: trikv's default, `rounds_per_step`); a decoding request due
    # beyond the limit waits while it holds fewer than budget + divide_length + one block entries, then it is
    # compacted whatever the limit; a request still prefilling never waits (its next chunk needs the round first)
    max_rounds_per_step: int | None = None
    # the most tokens one step prefills of a request that would otherwise pass budget + divide_length
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE
    session_reuse: bool = True  # keep finished requests' KV for the next turn of their conversation
    max_kept_sessions: int | None = None  # the most states kept at once (None: max_num_seqs)

    def __post_init__(self) -> None:
        if self.method == "full":
            raise SettingsError("method 'full' needs no trikv settings: run vLLM without them")
        if self.method not in REGISTRY:
            raise SettingsError(f"unknown method {self.method!r}; methods that run inside vLLM: {', '.join(serving_methods())}")
        if self.method not in serving_methods():
            raise SettingsError(
                f"method {self.method!r} needs observed queries or per-step statistics and does not run inside vLLM; "
                f"methods that do: {', '.join(serving_methods())}"
            )
        for name in ("budget", "divide_length", "min_decode_room", "round_workspace_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "min_decode_room" else 1):
                raise SettingsError(f"{name} must be a positive integer, got {value!r}")
        if self.budget < MIN_BUDGET:
            raise SettingsError(f"budget must be at least {MIN_BUDGET} entries per (layer, KV head), got {self.budget}")
        if self.max_rounds_per_step is not None and (
                isinstance(self.max_rounds_per_step, bool) or not isinstance(self.max_rounds_per_step, int) or self.max_rounds_per_step < 1):
            raise SettingsError(f"max_rounds_per_step must be a positive integer or null, got {self.max_rounds_per_step!r}")
        if self.max_request_budget is not None and (
                isinstance(self.max_request_budget, bool) or not isinstance(self.max_request_budget, int) or self.max_request_budget < 1):
            raise SettingsError(f"max_request_budget must be a positive integer or null, got {self.max_request_budget!r}")
        if self.max_request_budget is not None and self.max_request_budget < MIN_BUDGET:
            raise SettingsError(f"max_request_budget must be at least {MIN_BUDGET}, got {self.max_request_budget}")
        if self.max_kept_sessions is not None and (
                isinstance(self.max_kept_sessions, bool) or not isinstance(self.max_kept_sessions, int) or self.max_kept_sessions < 1):
            raise SettingsError(f"max_kept_sessions must be a positive integer or null, got {self.max_kept_sessions!r}")
        for name in ("protect_prompt", "allow_untested_platform", "record_rounds", "allow_full_requests", "session_reuse"):
            if not isinstance(getattr(self, name), bool):
                raise SettingsError(f"{name} must be true or false, got {getattr(self, name)!r}")
        try:  # the settings every backend shares: method options, statistics, budget vs recent window
            self.cache_settings = CacheSettings(self.method, self.budget, self.divide_length, self.protect_prompt,
                                                self.min_decode_room, self.stats, self.options, self.prefill_chunk_size)
            self._recent_window = self.cache_settings.make_policy().recent_window
            if self.max_request_budget is not None:
                check_recent_window(self.method, self._recent_window, self.max_request_budget, "max_request_budget")
        except ValueError as error:
            raise SettingsError(str(error)) from None

    @property
    def needs_stats(self) -> bool:
        return REGISTRY[self.method].needs_stats

    def make_policy(self, stats=None) -> Policy:
        try:
            return self.cache_settings.make_policy(stats if self.needs_stats else None)
        except (TypeError, ValueError) as error:
            raise SettingsError(str(error)) from None

    @property
    def largest_request_budget(self) -> int:
        """The largest budget a request may have: `max_request_budget`, else `budget`."""
        return max(self.budget, self.max_request_budget or 0)

    def round_trigger(self, budget: int) -> int:
        """The physical length at which a request bounded at `budget` is compacted before its next step (and past
        which a prefill is cut into chunks): budget + divide_length, the first term of `peak_entries`."""
        return budget + self.divide_length

    def prefill_step_tokens(self, max_step_tokens: int) -> int:
        """The most tokens one step prefills of a bounded request: `prefill_chunk_size`, or vLLM's own per-step
        token cap (`max_step_tokens`) when that is smaller."""
        return min(self.prefill_chunk_size, max_step_tokens)

    def rounds_per_step(self, max_num_seqs: int) -> int:
        """The most rounds the scheduler starts in one step: `max_rounds_per_step`, else trikv's default: the
        round-cost cap `ROUNDS_PER_STEP` (4), raised to twice the average rate at which `max_num_seqs` running
        requests fall due (each every divide_length tokens) so that waiting rounds never pile up into a wave at
        their deadline: max(4, ceil(2 max_num_seqs / divide_length))."""
        if self.max_rounds_per_step is not None:
            return self.max_rounds_per_step
        return max(ROUNDS_PER_STEP, -(-2 * max_num_seqs // self.divide_length))

    def peak_entries(self, budget: int, block_size: int, max_step_tokens: int) -> int:
        """The most KV entries per (layer, KV head) a request bounded at `budget` ever holds inside vLLM.

        A round runs before a step that finds the request at budget + divide_length, and a step adds at most one
        prefill chunk (`prefill_step_tokens`): budget + divide_length + chunk (`trikv.settings.peak_entries_bound`,
        the transformers path's bound). A decoding request whose round waits for the step's limit
        (`rounds_per_step`) grows one token a step while it holds fewer than budget + divide_length + one block
        (`block_size`), so the bound is budget + divide_length + the larger of the chunk and the block. The
        scheduler's admission cap, its prefill chunks and the KV spec vLLM sizes its pool with at start-up all read
        this one bound."""
        step = max(self.prefill_step_tokens(max_step_tokens), block_size)
        return peak_entries_bound(budget, self.divide_length, step)

    @property
    def lowest_request_budget(self) -> int:
        """The smallest budget a request may choose: `MIN_BUDGET`, and above the method's recent window."""
        return max(MIN_BUDGET, self._recent_window + 1)

    def request_budget(self, extra_args: dict | None) -> int | None:
        """The budget of a request with these `SamplingParams.extra_args`: the server's `budget` when it chooses
        nothing, its own `trikv_budget` within the limits, None for full attention; RequestSettingsError otherwise
        (also for any other key starting with "trikv": a misspelt choice must not run silently with the default)."""
        if extra_args is not None and not isinstance(extra_args, dict):
            raise RequestSettingsError(f"extra_args must be a dict, got {type(extra_args).__name__}")
        unknown = sorted(key for key in (extra_args or {}) if isinstance(key, str) and key.startswith(REQUEST_KEY_PREFIX)
                         and key not in (REQUEST_BUDGET_KEY, REQUEST_SESSION_KEY))
        if unknown:
            raise RequestSettingsError(f"unknown trikv request setting(s) {unknown}: the only ones are "
                                       f"{REQUEST_BUDGET_KEY!r} and {REQUEST_SESSION_KEY!r}")
        self.request_session(extra_args)
        choice = (extra_args or {}).get(REQUEST_BUDGET_KEY)
        if choice is None:
            return self.budget
        if choice == "full":
            if not self.allow_full_requests:
                raise RequestSettingsError(f"{REQUEST_BUDGET_KEY}='full': this server does not run requests with full "
                                           "attention (start it with allow_full_requests=true)")
            return None
        if isinstance(choice, bool) or not isinstance(choice, int):
            raise RequestSettingsError(f"{REQUEST_BUDGET_KEY} must be an integer number of KV entries per (layer, KV head) "
                                       f"or 'full', got {choice!r}")
        lowest = self.lowest_request_budget
        highest = self.budget if self.max_request_budget is None else self.max_request_budget
        if not lowest <= choice <= highest:
            raise RequestSettingsError(f"{REQUEST_BUDGET_KEY}={choice} is outside this server's limits [{lowest}, {highest}] "
                                       f"(at least {MIN_BUDGET} and above {self.method}'s recent window of "
                                       f"{self._recent_window} tokens, at most "
                                       f"{'budget' if self.max_request_budget is None else 'max_request_budget'})")
        return choice

    def request_session(self, extra_args: dict | None) -> bool:
        """Whether a request with these `SamplingParams.extra_args` takes part in session reuse: the engine's switch,
        unless the request says `"trikv_session": "off"`; RequestSettingsError for any other value than "on"/"off"."""
        choice = (extra_args or {}).get(REQUEST_SESSION_KEY) if isinstance(extra_args, dict) else None
        if choice is not None and choice not in SESSION_CHOICES:
            raise RequestSettingsError(f"{REQUEST_SESSION_KEY} must be \"on\" or \"off\", got {choice!r}")
        return self.session_reuse and choice != "off"

    def kept_sessions(self, max_num_seqs: int) -> int:
        """The most states session reuse keeps at once: `max_kept_sessions`, else `max_num_seqs` (0 when off)."""
        if not self.session_reuse:
            return 0
        return self.max_kept_sessions or max_num_seqs

    def to_config(self) -> dict:
        """The dict for `additional_config[CONFIG_KEY]`."""
        return asdict(self)

    @classmethod
    def from_config(cls, additional_config: dict | None) -> "BoundedKVSettings | None":
        """Settings from vLLM's `additional_config`, or None when it holds no trikv entry."""
        raw = (additional_config or {}).get(CONFIG_KEY)
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise SettingsError(f"additional_config[{CONFIG_KEY!r}] must be a dict, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SettingsError(f"unknown trikv setting(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)
