"""Long texts for the fidelity / attention-recall task, and the reproducible builder of the shipped ones.

Shipped texts live in `data/` beside this file (see its README for provenance and licenses):
real text (the Python language reference, CPython standard-library source, MATH-500 solutions) and
reasoning traces written by the bundled model with full attention, stored with their prompt and seed.
`python -m trikv.benchmarks.quality.texts` rebuilds every file (the traces take minutes on a CPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
TEXTS_FILE = DATA_DIR / "fidelity_texts.jsonl"

# the reasoning traces: sampled with full attention from the bundled model, then frozen in the data file
TRACE_MODEL = "smollm2-135m"
TRACE_SEED = 1234
TRACE_TOKENS = 4200
TRACE_PROBLEMS = (60, 80)  # MATH-500 rows (0-based)
TRACE_INSTRUCTION = (
    "Solve the following problem. Think step by step and write out every step of your reasoning in detail "
    "before giving the final answer in \\boxed{{}}.\n\nProblem: {problem}"
)


@dataclass
class FidelityText:
    name: str
    kind: str  # "real" or "trace"
    text: str  # plain text; for traces: the model's output only
    prompt: str | None = None  # traces: the user prompt the model answered (chat template applied at use)
    source: str = ""
    seed: int | None = None


def load_texts(path: str | Path | None = None) -> list[FidelityText]:
    """The shipped fidelity texts (or a JSONL file of {name, kind, text, ...} rows), in file order."""
    path = Path(path) if path else TEXTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"fidelity texts not found: {path}")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            rows.append(FidelityText(**{k: record.get(k) for k in ("name", "kind", "text", "prompt", "source", "seed")}))
    if not rows:
        raise ValueError(f"{path} holds no texts")
    return rows


def text_from_file(path: str | Path) -> FidelityText:
    """A user's own text (UTF-8), fed as it is; named after the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not text.strip():
        raise ValueError(f"{path} holds no text")
    return FidelityText(name=path.stem, kind="real", text=text, source=str(path))


def texts_sha256(texts: list[FidelityText]) -> str:
    """sha256 of the texts a run feeds, by what they say (name, prompt, text) in order: a run's record and a page can
    tell from it, without a tokenizer, whether a run fed the texts that ship now."""
    import hashlib

    rows = [[text.name, text.prompt, text.text] for text in texts]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode("utf-8")).hexdigest()


def text_token_ids(text: FidelityText, tokenizer) -> list[int]:
    """Token ids of a text as the benchmark feeds it: traces behind their own prompt (the chat template of an instruct
    model), real text from its start (after the model's BOS where it takes one)."""
    from ...prompts import continuation_ids, document_ids, prompt_ids

    if text.kind == "trace" and text.prompt:  # as `trikv.generate` prompted the model that wrote it
        return prompt_ids(tokenizer, text.prompt) + continuation_ids(tokenizer, text.text)
    return document_ids(tokenizer, text.text)


# ---- building the shipped file ------------------------------------------------------------------------
def _python_reference(min_chars: int) -> str:
    import pydoc_data.topics as topics

    names = ["compound", "function", "class", "exceptions", "execmodel", "naming", "typesseq", "numeric-types", "specialattrs"]
    parts = []
    for name in names:
        if name in topics.topics:
            parts.append(topics.topics[name].strip())
        if sum(len(p) for p in parts) >= min_chars:
            break
    return "\n\n".join(parts)


def _stdlib_source(min_chars: int) -> str:
    import inspect
    import importlib

    parts = []
    for module_name in ("textwrap", "heapq", "fractions", "shlex"):
        parts.append(inspect.getsource(importlib.import_module(module_name)))
        if sum(len(p) for p in parts) >= min_chars:
            break
    return "\n\n".join(parts)


def _math500_rows():
    path = Path(__file__).resolve().parents[2] / "data" / "datasets" / "math500.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _math_text(min_chars: int) -> str:
    parts = []
    for row in _math500_rows()[200:]:
        if "[asy]" in row["problem"] or "[asy]" in row["solution"]:
            continue
        parts.append(f"Problem: {row['problem'].strip()}\n\nSolution: {row['solution'].strip()}")
        if sum(len(p) for p in parts) >= min_chars:
            break
    return "\n\n".join(parts)


def _trim(text: str, max_chars: int) -> str:
    """At most max_chars characters, cut at the last paragraph break before the limit."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n\n", 0, max_chars)
    return text[: cut if cut > max_chars // 2 else max_chars]


def build_texts(path: str | Path | None = None, min_chars: int = 21000, max_chars: int = 24000, traces: bool = True) -> list[FidelityText]:
    """Rebuild the shipped texts: three real texts of min_chars..max_chars characters and two model-written traces."""
    from ... import __version__

    texts = [
        FidelityText("python-reference", "real", _python_reference(min_chars),
                     source=f"Python language reference (pydoc_data.topics), PSF license; trikv {__version__}"),
        FidelityText("stdlib-source", "real", _stdlib_source(min_chars),
                     source="CPython standard-library source (textwrap, heapq, fractions, shlex), PSF license"),
        FidelityText("math-solutions", "real", _math_text(min_chars),
                     source="MATH-500 problems and worked solutions from row 200 on, Asymptote rows skipped (MIT)"),
    ]
    for text in texts:
        text.text = _trim(text.text, max_chars)
    if traces:
        texts += generate_traces()
    path = Path(path) if path else TEXTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps(text.__dict__, ensure_ascii=False) + "\n")
    return texts


def generate_traces() -> list[FidelityText]:
    """Reasoning traces from the bundled model with full attention (sampled, T 0.6, top-p 0.95, fixed seed)."""
    from ...generation import generate
    from ...models import load_model

    model, tokenizer = load_model(TRACE_MODEL)
    rows = _math500_rows()
    prompts = [TRACE_INSTRUCTION.format(problem=rows[i]["problem"].strip()) for i in TRACE_PROBLEMS]
    result = generate(
        model, tokenizer, prompts, method="full", max_new_tokens=TRACE_TOKENS, min_new_tokens=TRACE_TOKENS,
        do_sample=True, temperature=0.6, top_p=0.95, seed=TRACE_SEED, progress=True,
    )
    return [
        FidelityText(
            f"trace-{i}", "trace", result.texts[j], prompt=prompts[j], seed=TRACE_SEED,
            source=f"{TRACE_MODEL} with full attention on MATH-500 row {i}: sampled (T 0.6, top-p 0.95, "
            f"seed {TRACE_SEED}, batch of rows {list(TRACE_PROBLEMS)}), {TRACE_TOKENS} new tokens, EOS suppressed",
        )
        for j, i in enumerate(TRACE_PROBLEMS)
    ]


if __name__ == "__main__":
    import sys

    built = build_texts(traces="--no-traces" not in sys.argv)
    for t in built:
        print(f"{t.name}: {len(t.text)} chars")
