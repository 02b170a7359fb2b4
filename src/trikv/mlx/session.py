"""A multi-turn conversation on one MLX prompt cache, as `trikv.Session` keeps one on the transformers path.

    model, tokenizer = trikv.mlx.load("smollm2-135m")
    session = trikv.mlx.Session(model, tokenizer, method="triattention", stats="smollm2-135m", budget=2048)
    turn = session.send("Here is a file: ...")            # a `trikv.session.Turn`: reply, KV held, time to first token
    turn = session.send("What did the first file define?")

mlx-lm's chat pattern: every turn goes through `mlx_lm.stream_generate` with the same prompt cache, which appends
to what the cache holds (nothing is read again). mlx-lm feeds every token it yields, the last one included, so a
later turn is what the chat template puts after the last reply, less the end-of-turn text when the reply ended
with that token. The first turn is the message framed by the chat template (with `system` when given). Long
messages are prefilled in chunks of the cache's prefill chunk, compacted between them.
"""

from __future__ import annotations

import time

from ..session import Turn, after_last_reply
from ..settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH


class Session:
    """One conversation with an mlx-lm model on one prompt cache (`method`, `budget`, `stats` and options as for
    `trikv.mlx.make_prompt_cache`; "full" keeps everything, in mlx-lm's own caches)."""

    def __init__(self, model, tokenizer, method: str = "triattention", budget: int | None = DEFAULT_BUDGET, stats=None,
                 divide_length: int = DEFAULT_DIVIDE_LENGTH, system: str | None = None, **options):
        from .prompt_cache import bounded_cache, make_prompt_cache

        self.model, self.tokenizer, self.method, self.system = model, tokenizer, method, system
        if stats is not None:
            options["stats"] = stats
        if method != "full":
            options.update(budget=budget, divide_length=divide_length)
        elif budget is not None and budget is not DEFAULT_BUDGET:
            raise ValueError(f"method 'full' keeps every entry and takes no budget (got budget={budget!r})")
        self._options = options
        self.cache = make_prompt_cache(model, method, **options)
        self.bounded = bounded_cache(self.cache) if method != "full" else None
        self.eos = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        self.messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]
        self.turns: list[Turn] = []
        self.reply_ids: list[int] = []  # the last reply's token ids, as sampled
        self._last_token: int | None = None

    @property
    def tokens_seen(self) -> int:
        return self.cache[0].offset

    def full_attention_bytes(self, tokens: int) -> int:
        """K/V bytes mlx-lm's own cache would hold for `tokens` tokens (every layer, the model's dtype)."""
        from mlx.utils import tree_flatten

        from .model import mlx_model_shape

        shape = mlx_model_shape(self.model)
        itemsize = tree_flatten(self.model.parameters())[0][1].dtype.size
        return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * itemsize * tokens

    def reset(self) -> None:
        """Forget the conversation (a new, empty cache)."""
        from .prompt_cache import bounded_cache, make_prompt_cache

        self.cache = make_prompt_cache(self.model, self.method, **self._options)
        self.bounded = bounded_cache(self.cache) if self.method != "full" else None
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self.turns, self._last_token = [], None

    def next_ids(self, message: str) -> list[int]:
        """The ids the next `send(message)` feeds."""
        if not self.turns:
            return list(self.tokenizer.apply_chat_template(self.messages + [{"role": "user", "content": message}],
                                                           add_generation_prompt=True))
        text = after_last_reply(self.tokenizer, self.messages, message)
        ending = self.tokenizer.decode([self._last_token]) if self._last_token in self.eos else ""
        if ending and text.startswith(ending):
            text = text[len(ending):]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def send(self, message: str, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             after_prefill=None) -> Turn:
        """Append `message` as the user's next turn and generate the reply. `after_prefill(tokens)`, when given, is
        called once the message is prefilled (the first token out; `tokens`: the conversation's length), before
        decoding goes on: it may raise to end the turn there (a memory limit the caller enforces)."""
        from .model import require_mlx_lm

        mlx_lm = require_mlx_lm()
        from mlx_lm.sample_utils import make_sampler

        from .prompt_cache import prefill_step_size
        from .generation import held_bytes

        if not isinstance(message, str) or not message:
            raise ValueError(f"a message must be a non-empty string, got {message!r}")
        ids = self.next_ids(message)
        started = time.perf_counter()
        ttft, reply_tokens, peak = None, [], 0
        if self.bounded is not None:
            self.bounded.peak_length = self.bounded.length  # this turn's peak starts from what is held now
        for response in mlx_lm.stream_generate(self.model, self.tokenizer, ids, max_tokens=max_new_tokens,
                                               sampler=make_sampler(temp=temperature, top_p=top_p, top_k=top_k),
                                               prompt_cache=self.cache, prefill_step_size=prefill_step_size(self.cache)):
            if ttft is None:
                ttft = time.perf_counter() - started
                held, _ = held_bytes(self.cache)
                peak = held if self.bounded is None else self.bounded.peak_length * held // max(self.bounded.length, 1)
                if after_prefill is not None:
                    after_prefill(self.tokens_seen)
            reply_tokens.append(response.token)
        seconds = time.perf_counter() - started
        self.reply_ids = reply_tokens
        self._last_token = reply_tokens[-1] if reply_tokens else None
        reply = self.tokenizer.decode([token for token in reply_tokens if token not in self.eos])
        self.messages += [{"role": "user", "content": message}, {"role": "assistant", "content": reply}]
        held, entries = held_bytes(self.cache)
        decode = max(seconds - (ttft or seconds), 1e-9)
        self.turns.append(Turn(
            message=message, fed_tokens=len(ids), reply=reply, reply_tokens=len(reply_tokens),
            seconds_to_first_token=ttft or seconds, decode_tokens_per_second=max(len(reply_tokens) - 1, 0) / decode,
            held_entries=entries, held_bytes=held, peak_bytes=max(peak, held), tokens_seen=self.tokens_seen,
            rounds=0 if self.bounded is None else self.bounded.rounds))
        return self.turns[-1]
