"""Before measuring on a model: does it answer a known prompt sanely, with its input framed as its authors intend?

A model fed malformed input (Gemma-3 without its BOS token, a base model behind an instruction it cannot follow)
still produces logits, so every figure computed on it looks like data. `check_model_answers` asks one question
whose answer any working model of its kind knows, greedily, and raises `ModelSanityError` with what the model
said when the answer is wrong or the text degenerates; the benchmarks and the trace, calibration and analysis
commands run it before they measure anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .prompts import is_instruct, leading_ids, prompt_ids

INSTRUCT_QUESTION = "What is the capital of France? Answer in one sentence."
BASE_PROMPT = "The Eiffel Tower is located in the city of"
ANSWER = "Paris"
NEW_TOKENS = 16


class ModelSanityError(RuntimeError):
    """The model does not answer the known prompt: its input is framed wrongly, or the model is broken."""


@dataclass
class SanityAnswer:
    prompt_ids: list[int]
    continuation: str
    instruct: bool


@torch.no_grad()
def known_answer(model, tokenizer) -> SanityAnswer:
    """The model's greedy continuation of the known prompt, framed for its kind (chat template or plain text)."""
    instruct = is_instruct(tokenizer)
    ids = prompt_ids(tokenizer, INSTRUCT_QUESTION if instruct else BASE_PROMPT)
    device = next(model.parameters()).device
    out = model.generate(torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                         max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return SanityAnswer(ids, tokenizer.decode(out[0, len(ids):], skip_special_tokens=True), instruct)


def degenerate(text: str) -> bool:
    """One word written four times in a row ("The The The The"): the mark of a model fed input it cannot read."""
    words = text.split()
    return any(len(set(words[i : i + 4])) == 1 for i in range(len(words) - 3))


def check_model_answers(model, tokenizer, name: str = "the model") -> SanityAnswer:
    """Raise ModelSanityError unless the model starts its input as its tokenizer does (BOS where it takes one) and
    names the capital of France in a sane continuation."""
    answer = known_answer(model, tokenizer)
    start = leading_ids(tokenizer)
    if answer.prompt_ids[: len(start)] != start:
        raise ModelSanityError(f"{name}: its prompts do not start with the tokens its tokenizer adds ({start})")
    if ANSWER not in answer.continuation or degenerate(answer.continuation):
        kind = "chat prompt" if answer.instruct else "completion prompt"
        raise ModelSanityError(f"{name} does not answer a known {kind} sanely: asked "
                               f"{INSTRUCT_QUESTION if answer.instruct else BASE_PROMPT!r}, it wrote {answer.continuation!r}; "
                               "check its tokenizer (BOS / EOS flags, chat template) and weights before measuring on it")
    return answer
