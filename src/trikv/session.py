"""A multi-turn conversation on one KV cache: each turn appends to what the cache holds, nothing is re-read.

    session = trikv.Session(model, tokenizer, method="triattention", stats="smollm2-135m", budget=2048)
    reply = session.send("Here is a file: ...")          # a GenerationResult for this turn
    reply = session.send("What did the first file define?")
    session.turns[-1].held_bytes                          # K/V held after the turn

The first turn is the message framed by the model's chat template (with `system` when given); every later turn
is what the template puts after the last reply: the end of that reply's turn, the new user turn and the
assistant's generation prompt, found by rendering the conversation with a marker in place of the last reply and
taking the text after it. The token sampled last in a turn was never fed to the model; the next turn feeds it
first (an end-of-turn token then stands for the template's own end-of-turn text). A base model (no chat template,
or `chat=False`) gets each message as plain text.

With a bounded cache the conversation holds at most budget + divide_length + one prefill chunk entries per
(layer, KV head), however long it grows: a turn longer than the slack is prefilled in chunks with rounds between
them, and the earlier turns' kept entries stay where they are (logical positions keep counting).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .cache import CompressedCache, make_cache
from .calibration import load_stats
from .generation import GenerationResult, cache_bytes, cache_entries, generate
from .prompts import is_instruct, prompt_ids
from .settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH

REPLY_MARK = "TRIKV_REPLY_MARK_7f3a"  # stands for the last reply when the template renders the next turn


@dataclass
class Turn:
    """What one `send` fed and produced, and the cache after it."""

    message: str
    fed_tokens: int  # tokens appended before generating (the previous reply's last token, the template's frame)
    reply: str
    reply_tokens: int
    seconds_to_first_token: float  # the turn's prefill (its chunks and rounds) and first sampled token
    decode_tokens_per_second: float
    held_entries: int  # entries per (layer, KV head) after the turn
    held_bytes: int  # K/V bytes after the turn
    peak_bytes: int  # the most K/V bytes held during the turn
    tokens_seen: int  # logical tokens of the conversation so far
    rounds: int  # compression rounds so far


class Session:
    """One conversation with `model` on one cache (`method`, `budget`, `stats` and method options as for
    `trikv.make_cache`; "full" keeps everything, in transformers' DynamicCache on the transformers engine)."""

    def __init__(self, model, tokenizer, method: str = "triattention", budget: int | None = DEFAULT_BUDGET, stats=None,
                 divide_length: int = DEFAULT_DIVIDE_LENGTH, system: str | None = None, chat: bool = True,
                 engine: str = "transformers", **options):
        self.model, self.tokenizer, self.engine = model, tokenizer, engine
        self.method = method
        self.chat = chat and is_instruct(tokenizer)
        if system is not None and not self.chat:
            raise ValueError("a system message needs a chat template; this tokenizer has none (or chat=False)")
        self.system = system
        if method == "full" and engine == "transformers":
            if budget is not None and budget is not DEFAULT_BUDGET:
                raise ValueError(f"method 'full' keeps every entry and takes no budget (got budget={budget!r})")
            self.cache = DynamicCache(config=model.config)
        else:
            if stats is not None:  # a bundled name, a path or loaded statistics
                options["stats"] = load_stats(stats, model) if isinstance(stats, (str, os.PathLike)) else stats
            self.cache = make_cache(model, method, budget=budget, divide_length=divide_length, **options)
        self.messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]
        self.turns: list[Turn] = []

    @property
    def tokens_seen(self) -> int:
        return self.cache.get_seq_length()

    def reset(self) -> None:
        """Forget the conversation (the cache starts empty)."""
        if isinstance(self.cache, CompressedCache):
            self.cache.reset()
        else:
            self.cache = DynamicCache(config=self.model.config)
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self.turns = []

    def next_ids(self, message: str) -> list[int]:
        """The ids the next `send(message)` appends (the previous reply's last token, fed by `generate`, aside)."""
        if not self.turns:
            if not self.chat:
                return prompt_ids(self.tokenizer, message, chat=False)
            return list(self.tokenizer.apply_chat_template(self.messages + [{"role": "user", "content": message}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])
        if not self.chat:
            return list(self.tokenizer(message, add_special_tokens=False)["input_ids"])
        text = after_last_reply(self.tokenizer, self.messages, message)
        pending = getattr(self.cache, "pending_tokens", None)
        if pending is not None:  # an end-of-turn token sampled last stands for the template's end-of-turn text
            ending = self.tokenizer.decode([int(pending[0])], skip_special_tokens=False)
            if ending and text.startswith(ending):
                text = text[len(ending):]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def send(self, message: str, max_new_tokens: int = 256, **generate_options) -> GenerationResult:
        """Append `message` as the user's next turn and generate the reply (options as for `trikv.generate`:
        do_sample, temperature, top_p, progress, ...)."""
        if not isinstance(message, str) or not message:
            raise ValueError(f"a message must be a non-empty string, got {message!r}")
        ids = self.next_ids(message)
        result = generate(self.model, self.tokenizer, [ids], cache=self.cache, continue_cache=bool(self.turns),
                          max_new_tokens=max_new_tokens, engine=self.engine, **generate_options)
        reply = result.texts[0]
        self.messages += [{"role": "user", "content": message}, {"role": "assistant", "content": reply}]
        self.turns.append(Turn(
            message=message,
            fed_tokens=result.prompt_lengths[0],
            reply=reply,
            reply_tokens=len(result.tokens[0]),
            seconds_to_first_token=result.prefill_seconds,
            decode_tokens_per_second=result.decode_tokens_per_second,
            held_entries=cache_entries(self.cache),
            held_bytes=cache_bytes(self.cache),
            peak_bytes=result.peak_cache_bytes,
            tokens_seen=self.tokens_seen,
            rounds=getattr(self.cache, "rounds", 0),
        ))
        return result


def after_last_reply(tokenizer, messages: list[dict], message: str) -> str:
    """The text the chat template puts after the last assistant reply of `messages` when `message` is the next user
    turn and the assistant answers it: rendered with a marker in place of that reply."""
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("the conversation does not end with a reply")
    marked = messages[:-1] + [{"role": "assistant", "content": REPLY_MARK}, {"role": "user", "content": message}]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    if rendered.count(REPLY_MARK) != 1:
        raise RuntimeError("the chat template does not render the last reply verbatim; cannot continue the "
                           "conversation on the same cache (render it whole with a new Session)")
    return rendered.split(REPLY_MARK, 1)[1]


def full_attention_bytes(model, tokens: int) -> int:
    """K/V bytes full attention holds after `tokens` tokens (the model's dtype, every layer; a hybrid model's
    sliding layers at most their window)."""
    from .architectures import model_shape

    shape = model_shape(model)
    dtype = next(model.parameters()).dtype
    per_token = 2 * shape.num_kv_heads * shape.head_dim * torch.finfo(dtype).bits // 8
    sliding = shape.num_layers - len(shape.cached_layers)
    return per_token * (len(shape.cached_layers) * tokens + sliding * min(tokens, shape.sliding_window or tokens))
