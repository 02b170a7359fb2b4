"""Task 5: math accuracy (MATH-500, AIME 2024, AIME 2025) with sampled generation and pass@1.

Data: the JSONL copies in trikv/data/datasets (provenance in their README). Prompt: TriAttention's plain
template for MATH-500 problems ("You are given a math problem. ... Final answer: \\boxed{}"); the AIME
prompts already end with a boxed-answer instruction. An instruct model gets it through its chat template
(`chat=False` gives the reference harness's plain prompt); a base model gets the completion frame
`trikv.prompts.MATH_COMPLETION_PROMPT` instead. Sampling: T 0.6, top-p 0.95,
k samples per problem (seeded per problem), pass@1 = mean over samples, then over problems;
temperature 0 decodes greedily, and several problems can share one batch for throughput.
"""

from __future__ import annotations

import json
from pathlib import Path

from .grader import extract_answer, math_equal
from ...settings import DEFAULT_DIVIDE_LENGTH

DATASETS_DIR = Path(__file__).resolve().parents[2] / "data" / "datasets"
DATASETS = {"math500": "math500.jsonl", "aime24": "aime24.jsonl", "aime25": "aime25.jsonl"}
MATH_PROMPT = (
    "You are given a math problem.\n\nProblem: {question}\n\n You need to solve the problem step by step. First, you "
    "need to provide the chain-of-thought, then provide the final answer.\n\n Provide the final answer in the "
    "format: Final answer:  \\boxed{{}}"
)


CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "data" / "calibration"


def reserved_rows(name: str) -> set[int]:
    """Rows of a dataset that produced shipped calibration statistics (their provenance files say which):
    evaluating on them would score a model on the text its statistics came from."""
    rows: set[int] = set()
    for provenance in sorted(CALIBRATION_DIR.glob("*.json")):
        span = json.loads(provenance.read_text()).get(f"{name}_rows")
        if span:
            rows.update(range(span[0], span[1] + 1))
    return rows


def _rows(name: str) -> list[dict]:
    if name not in DATASETS:
        raise ValueError(f"unknown math dataset {name!r}; available: {', '.join(DATASETS)}")
    text = (DATASETS_DIR / DATASETS[name]).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def check_problem_ids(ids: list[str], datasets: list[str]) -> None:
    """Refuse problem ids that no evaluation may use: unknown datasets or rows, rows reserved for calibration,
    repeats, and a chosen dataset left without any id."""
    if not ids:
        raise ValueError("the list of math problem ids is empty")
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"math problem ids given more than once: {', '.join(repeated)}")
    sizes = {name: len(_rows(name)) for name in datasets}
    bad, reserved = [], []
    for problem_id in ids:
        name, _, row = problem_id.rpartition("-")
        if name not in sizes or not row.isdigit() or int(row) >= sizes[name]:
            bad.append(problem_id)
        elif int(row) in reserved_rows(name):
            reserved.append(problem_id)
    if bad:
        raise ValueError(f"unknown math problem id(s) {', '.join(bad)}: ids are DATASET-ROW (0-based) of the chosen "
                         f"datasets {', '.join(f'{n} (rows 0-{k - 1})' for n, k in sizes.items())}")
    if reserved:
        raise ValueError(f"math problem id(s) {', '.join(reserved)} are reserved: shipped statistics were calibrated on them")
    empty = [name for name in datasets if not any(i.rpartition("-")[0] == name for i in ids)]
    if empty:
        raise ValueError(f"no problem id of dataset(s) {', '.join(empty)}; drop them from the datasets or add ids")


def load_problems(name: str, limit: int | None = None, ids: list[str] | None = None) -> list[dict]:
    """[{id, prompt, answer}] of a shipped dataset: the first `limit` rows that no shipped statistics were
    calibrated on (`reserved_rows`), or the rows named by `ids` ("math500-7"), in dataset order; ids keep the
    dataset's row numbers."""
    rows = _rows(name)
    reserved = reserved_rows(name)
    chosen = [(index, row) for index, row in enumerate(rows) if index not in reserved]
    if ids is not None:
        wanted = set(ids)
        chosen = [(index, row) for index, row in chosen if f"{name}-{index}" in wanted]
    problems = []
    for index, row in chosen[:limit] if limit else chosen:
        question = row.get("problem", row.get("prompt"))
        prompt = MATH_PROMPT.format(question=row["problem"].strip()) if "problem" in row else row["prompt"]
        problems.append({"id": f"{name}-{index}", "prompt": prompt, "question": question, "answer": str(row["answer"])})
    return problems


def run_math(model, tokenizer, method: str, budget: int | None, method_options: dict, problems: list[dict], samples: int,
             max_new_tokens: int, seed: int, temperature: float = 0.6, top_p: float = 0.95, divide_length: int = DEFAULT_DIVIDE_LENGTH,
             chat: bool = True, timeout: float = 3.0, progress=None, engine: str = "transformers",
             problems_per_batch: int = 1, first_index: int = 0) -> list[dict]:
    """Answer each problem `samples` times and grade the answers.

    temperature 0 decodes greedily (then `top_p` is unused). `problems_per_batch` problems share one left-padded
    batch of `problems_per_batch * samples` rows (a decode step costs little more for more rows, so this is the
    throughput setting); the sampling seed is `seed` + the index of the batch's first problem, so with one
    problem per batch each problem has its own seed whatever else runs. `first_index` is the index of
    `problems[0]` in the whole problem list, for a run that continues one that answered the earlier problems.
    """
    from ...generation import generate
    from ...prompts import math_prompt

    if problems_per_batch < 1:
        raise ValueError(f"problems_per_batch must be >= 1, got {problems_per_batch}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    records = []
    for first in range(0, len(problems), problems_per_batch):
        group = problems[first:first + problems_per_batch]
        result = generate(
            model, tokenizer, [math_prompt(tokenizer, problem["question"], problem["prompt"]) for problem in group
                               for _ in range(samples)], method=method,
            budget=budget, max_new_tokens=max_new_tokens, seed=seed + first_index + first, chat=chat, divide_length=divide_length,
            engine=engine, **sampling, **method_options,
        )
        protected = prompt_protection(result.cache)
        for row, text in enumerate(result.texts):
            problem, sample = group[row // samples], row % samples
            predicted = extract_answer(text)
            records.append({
                "id": problem["id"], "sample": sample, "answer": problem["answer"], "predicted": predicted,
                "correct": math_equal(predicted, problem["answer"], timeout=timeout), "tokens": len(result.tokens[row]),
                "max_new_tokens": max_new_tokens, "prompt_protected": None if protected is None else protected[row],
            })
        if progress is not None:
            progress(len(group))
    return records


def prompt_protection(cache) -> list[bool] | None:
    """Per row: was the prompt kept out of the competition (None: the method never evicts)."""
    protected = cache.prompt_protected() if hasattr(cache, "prompt_protected") else None
    return None if protected is None else [bool(x) for x in protected.tolist()]


def protected_share(records: list[dict]) -> float | None:
    """Share of answers whose prompt was protected (None when no record says: full attention, older runs)."""
    flags = [r["prompt_protected"] for r in records if r.get("prompt_protected") is not None]
    return sum(flags) / len(flags) if flags else None


def summarise(records: list[dict]) -> dict:
    by_problem: dict[str, list[bool]] = {}
    for r in records:
        by_problem.setdefault(r["id"], []).append(bool(r["correct"]))
    per_problem = [sum(v) / len(v) for v in by_problem.values()]
    caps: dict[str, int] = {}  # answers per token cap they were generated under (greedy runs raise it in place)
    for r in records:
        if "max_new_tokens" in r:
            caps[str(r["max_new_tokens"])] = caps.get(str(r["max_new_tokens"]), 0) + 1
    return {
        "pass@1": sum(per_problem) / len(per_problem) if per_problem else float("nan"),
        "by_problem": {problem: sum(v) / len(v) for problem, v in by_problem.items()},  # for paired comparisons
        "problems": len(per_problem),
        "samples": len(records),
        "mean_tokens": sum(r["tokens"] for r in records) / len(records) if records else 0.0,
        "answers_by_cap": dict(sorted(caps.items(), key=lambda item: int(item[0]))),
        "prompt_protected": protected_share(records),
    }
