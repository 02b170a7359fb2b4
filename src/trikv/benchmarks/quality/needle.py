"""Task 4: passkey retrieval with prompt compression (the needle may be evicted while the prompt is read).

Haystack: the classic passkey filler ("The grass is green. The sky is blue. ...", Mohtashami & Jaggi 2023),
written for the task, no copyrighted essays. The needle "The pass key is NNNNN. Remember it. NNNNN is the
pass key." is inserted at a depth of 0-100 % of the haystack (at a sentence boundary); the question at the
end asks for the key. The whole input is prompt, fed through the cache in chunks with the prompt *not*
protected, so the cache compresses as it fills (chunk boundaries follow the schedule, as in `feeding`).
Score: the key is right when every one of its answer tokens is the greedy choice under teacher forcing
(= greedy decoding writes exactly the key); the log-probability of the key is reported too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .feeding import Feeder

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"


def needle_text(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


@dataclass
class NeedleItem:
    length: int  # target context tokens (intro + haystack + needle + question)
    depth: float  # 0..1: where the needle sits in the haystack
    key: str
    input_ids: list[int]
    answer_ids: list[int]
    key_token: int  # index of the key's first token (inside the needle) in input_ids


def make_item(tokenizer, length: int, depth: float, key: str) -> NeedleItem:
    """An input of exactly `length` tokens: the model's leading special tokens (BOS where it takes one), intro,
    filler with the needle at `depth`, question."""
    from ...prompts import leading_ids

    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = leading_ids(tokenizer) + encode(INTRO)
    needle = encode(needle_text(key))
    question = encode(QUESTION)
    sentences = [s.strip() + "." for s in FILLER.split(".") if s.strip()]
    first = encode(sentences[0])  # the haystack's first sentence; later ones (and later cycles) follow a space
    pieces = [encode(" " + s) for s in sentences]
    room = length - len(head) - len(needle) - len(question)
    if room < 16:
        raise ValueError(f"needle context length {length} is too short for the prompt")
    hay: list[list[int]] = []
    total = 0
    while total < room:
        piece = pieces[len(hay) % len(pieces)] if hay else first
        hay.append(piece)
        total += len(piece)
    insert_at = round(depth * len(hay))
    before = [t for piece in hay[:insert_at] for t in piece]
    after = [t for piece in hay[insert_at:] for t in piece]
    extra = len(before) + len(after) - room
    if len(after) >= extra:  # trim the surplus from the end of the filler (from the start if there is none after)
        after = after[: len(after) - extra]
    else:
        before = before[extra - len(after):]
        after = []
    ids = head + before + needle + after + question
    assert len(ids) == length, (len(ids), length)
    key_token = len(head) + len(before) + len(encode(" The pass key is"))
    return NeedleItem(length, depth, key, ids, encode(" " + key), key_token)


def make_items(tokenizer, lengths, depths, seed: int, keys_per_cell: int = 1) -> list[NeedleItem]:
    rng = random.Random(seed)
    items = []
    for length in lengths:
        for depth in depths:
            for _ in range(keys_per_cell):
                key = str(rng.randrange(10000, 100000))
                items.append(make_item(tokenizer, length, depth, key))
    return items


@torch.no_grad()
def run_needle(model, cache_factory, items: list[NeedleItem], max_chunk: int = 128, batch_size: int = 4, progress=None,
               full_records: list[dict] | None = None, eviction_threshold: int | None = None) -> list[dict]:
    """Score every item; items of the same length are batched (same length, so one schedule per batch).

    Items whose whole input stays below `eviction_threshold` (budget + divide_length) are never compressed:
    with `full_records` given (same items, full attention) their records are reused, marked `uncompressed`.
    """
    if full_records is not None and eviction_threshold is not None:
        short = [i for i, item in enumerate(items) if len(item.input_ids) + len(item.answer_ids) < eviction_threshold]
        if short:
            rest = [item for i, item in enumerate(items) if i not in set(short)]
            computed = iter(run_needle(model, cache_factory, rest, max_chunk, batch_size, progress) if rest else [])
            records = []
            for i in range(len(items)):
                records.append(dict(full_records[i], uncompressed=True) if i in set(short) else next(computed))
            return records
    records: list[dict | None] = [None] * len(items)
    groups: dict[tuple[int, int], list[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault((len(item.input_ids), len(item.answer_ids)), []).append(index)
    for indices in groups.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            batch = [items[i] for i in chunk]
            cache = cache_factory()
            feeder = Feeder(model, cache, max_chunk)
            prompt = torch.tensor([it.input_ids for it in batch])
            answers = torch.tensor([it.answer_ids for it in batch])
            # the intro is the "prompt" forward; the rest of the input is fed in schedule-sized chunks
            first = min(32, prompt.shape[1] - 1)
            feeder.feed(prompt[:, :first], want_logits=False, prompt=True)
            n_rest = prompt.shape[1] - first
            sequence = torch.cat([prompt[:, first:], answers], dim=1)
            logits = feeder.feed(sequence, want_logits=slice(n_rest - 1, n_rest - 1 + answers.shape[1]))
            greedy = logits.argmax(-1) == answers
            logp = torch.log_softmax(logits, -1).gather(-1, answers[..., None]).squeeze(-1)
            needle_kept = _needle_kept(cache, batch)
            for row, (index, item) in enumerate(zip(chunk, batch)):
                records[index] = {
                    "length": item.length, "depth": item.depth, "key": item.key,
                    "correct": bool(greedy[row].all()), "digits_correct": float(greedy[row].float().mean()),
                    "logprob": float(logp[row].sum()), "needle_in_cache": needle_kept[row],
                }
            if progress is not None:
                progress(sequence.numel() + prompt[:, :first].numel())
    return records


def _needle_kept(cache, batch: list[NeedleItem]) -> list[float]:
    """Share of (layer, KV head) that still hold the needle's first key digit at the end (1.0 without eviction)."""
    if not hasattr(cache, "visible_positions") or cache.budget is None or cache.batch_size < 0:
        return [1.0] * len(batch)
    P = cache.visible_positions()  # [L, b, Hkv, P]
    out = []
    for row, item in enumerate(batch):
        out.append(float((P[:, row] == item.key_token).any(-1).float().mean()))
    return out


def summarise(records: list[dict]) -> dict:
    def mean(rows, name):
        return sum(float(r[name]) for r in rows) / len(rows) if rows else float("nan")

    out = {"accuracy": mean(records, "correct"), "digits": mean(records, "digits_correct"),
           "needle_in_cache": mean(records, "needle_in_cache"), "items": len(records), "by_length": {}, "by_depth": {}}
    for length in sorted({r["length"] for r in records}):
        rows = [r for r in records if r["length"] == length]
        out["by_length"][str(length)] = {"accuracy": mean(rows, "correct"), "items": len(rows)}
    for depth in sorted({r["depth"] for r in records}):
        rows = [r for r in records if r["depth"] == depth]
        out["by_depth"][f"{depth:g}"] = {"accuracy": mean(rows, "correct"), "items": len(rows)}
    return out
