"""How text is framed for a model, as its authors intend.

An instruct model (its tokenizer has a chat template) gets a user's text as one user turn of that template,
ending where the assistant's reply begins. A base model (no chat template) gets plain completion text, starting
with the special tokens its tokenizer adds to any text (Gemma-3: BOS). A base model without its BOS is
broken (Gemma-3-270M continues "The capital of France is" with " France. The The The ..."), so every piece of
trikv that builds a sequence by hand starts it with `leading_ids`.
"""

from __future__ import annotations

# A base model's frame for a math problem: plain text it can continue (no instruction-following assumed).
MATH_COMPLETION_PROMPT = "Problem:\n{question}\n\nSolution (step by step, the final answer in \\boxed{{}}):\n"


def is_instruct(tokenizer) -> bool:
    """True when the tokenizer carries a chat template (an instruct model); False for a base model."""
    return bool(getattr(tokenizer, "chat_template", None))


def leading_ids(tokenizer) -> list[int]:
    """The ids a plain encode puts before any text: the model's BOS where it takes one, [] otherwise."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    framed = tokenizer("a")["input_ids"]
    for start in range(len(framed) - len(plain) + 1):
        if framed[start : start + len(plain)] == plain:
            return list(framed[:start])
    raise ValueError(f"cannot find the text inside its own encoding ({framed} vs {plain})")


def prompt_ids(tokenizer, text: str, chat: bool = True) -> list[int]:
    """A user's prompt as the model expects it: one user turn of the chat template (instruct models, `chat`), or
    plain text after the leading special tokens (base models, or `chat=False`)."""
    if chat and is_instruct(tokenizer):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def document_ids(tokenizer, text: str) -> list[int]:
    """A document read from its start (a fidelity text, a calibration text): plain text after the leading special
    tokens, nothing appended."""
    return leading_ids(tokenizer) + list(tokenizer(text, add_special_tokens=False)["input_ids"])


def continuation_ids(tokenizer, text: str) -> list[int]:
    """Text that continues a sequence already started (a model's answer after its prompt): no special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def math_prompt(tokenizer, question: str, instruction_prompt: str) -> str:
    """The prompt text for a math problem: the instruction (`instruction_prompt`, with its boxed-answer request) for
    an instruct model, the completion frame `MATH_COMPLETION_PROMPT` for a base model."""
    return instruction_prompt if is_instruct(tokenizer) else MATH_COMPLETION_PROMPT.format(question=question.strip())
