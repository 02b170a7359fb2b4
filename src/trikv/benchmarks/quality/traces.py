"""The bundled models' own reasoning traces: the text a bounded cache exists for.

Each bundled model answers math problems with full attention, sampled as the paper samples (T 0.6, top-p 0.95;
Gemma-3-270M, a base model that loops at that setting, with its authors' recommended T 1.0, top-k 64, top-p 0.95),
the math prompt in the chat template, or as plain text for a model without one), and its answers are frozen in `data/traces/<model>.jsonl` with their
seeds and the command that wrote them. A trace is one problem's answer, 2,048+ tokens long: where the model
stops earlier, further sampled attempts at the same problem are appended (separated by a blank line) until the
trace is long enough. Fidelity and recall then feed a trace behind its own chat prompt (the problem), which a
compressed cache protects as it protects a generation's prompt.

Problems come from rows no other part of trikv uses: MATH-500 level-5 rows 400-499 and AIME 2025 for the
`evaluation` traces, MATH-500 level-5 rows 100-249 for the `design` traces (the ones a method may be tuned or
diagnosed on). Rows 0-99 (math evaluation), 250-297 (calibration) and 300-399 (the held-out math test) are never
used. `python -m trikv.benchmarks.quality.traces --model M --split S` writes a split again.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .texts import FidelityText
from .validity import MAX_REPEAT_SHARE, RULE_TEXT, attempt_is_loop, mask_digits, longest_text_repeat, trace_validity

TRACES_DIR = Path(__file__).resolve().parent / "data" / "traces"
SPLITS = ("evaluation", "design")
TEMPERATURE, TOP_P = 0.6, 0.95
MIN_TOKENS = 2048
MAX_ATTEMPTS = 32  # a model that answers some problem in ~100 tokens needs 20-odd attempts
# evaluation problems, in the order a smaller set takes them: 6 MATH-500 rows then 2 AIME 2025 problems per 8
EVALUATION_PROBLEMS = (
    "math500-400", "math500-401", "math500-408", "math500-415", "math500-417", "math500-418", "aime25-0", "aime25-1",
    "math500-421", "math500-422", "math500-423", "math500-424", "math500-425", "math500-432", "aime25-2", "aime25-3",
)
DESIGN_PROBLEMS = (
    "math500-100", "math500-101", "math500-103", "math500-109", "math500-118", "math500-129", "math500-135", "math500-136",
)
# traces per split and model (the 1.5B is the slowest to sample on a CPU); design traces exist for the model whose
# gap to R-KV is diagnosed
COUNTS = {"smollm2-135m": {"evaluation": 16, "design": 0}, "qwen2.5-coder-0.5b": {"evaluation": 16, "design": 0},
          "qwen2.5-coder-1.5b": {"evaluation": 8, "design": 8}, "gemma3-270m": {"evaluation": 16, "design": 0}}


@dataclass
class Trace:
    name: str  # the problem id, e.g. "math500-400"
    split: str
    prompt: str  # the user turn of an instruct model (the chat template is applied where it is fed), a base model's text
    text: str  # the model's answers, attempts separated by a blank line
    tokens: int  # tokens of `text` as the model wrote them
    seeds: list[int]  # the sampling seed of each attempt kept
    source: str
    rejected_seeds: list[int] = field(default_factory=list)  # attempts rejected as loops (`validity.attempt_is_loop`)
    validity: dict | None = None  # `validity.Validity` figures of `text` (None in files written before the rule)
    sampling: dict | None = None  # {"temperature", "top_p", "top_k"} (None in files written before it was recorded)

    def as_text(self) -> FidelityText:
        return FidelityText(self.name, "trace", self.text, prompt=self.prompt, source=self.source, seed=self.seeds[0])

    @property
    def valid(self) -> bool:
        return bool(self.validity and self.validity["valid"])

    def as_row(self) -> dict:
        """The trace as a row of its file (a row written before sampling settings were recorded stays as it was)."""
        row = dict(self.__dict__)
        if row["sampling"] is None:
            del row["sampling"]
        return row

    def sampling_settings(self) -> dict | None:
        """How the trace was sampled: the recorded settings, or those its `source` line states (files written
        before the settings were recorded), or None when neither says."""
        if self.sampling:
            return dict(self.sampling)
        found = re.search(r"T ([0-9.]+), top-p ([0-9.]+)(?:, top-k ([0-9]+))?", self.source or "")
        if not found:
            return None
        return {"temperature": float(found.group(1)), "top_p": float(found.group(2)),
                "top_k": int(found.group(3)) if found.group(3) else 0}


def sampling_label(sampling: dict | None) -> str:
    """'T 0.6, top-p 0.95' (with ', top-k 64' where top-k sampling was on), or 'not recorded'."""
    if not sampling:
        return "not recorded"
    return (f"T {float(sampling['temperature'])}, top-p {float(sampling['top_p'])}"
            + (f", top-k {sampling['top_k']}" if sampling.get("top_k") else ""))


def trace_file(model: str) -> Path:
    return TRACES_DIR / f"{model}.jsonl"


def load_traces(model: str, split: str, valid_only: bool = False) -> list[Trace]:
    """The shipped traces of `model` in `split` (evaluation | design), in problem order (`valid_only`: those that
    pass the validity rule)."""
    if split not in SPLITS:
        raise ValueError(f"trace split must be one of {', '.join(SPLITS)}, got {split!r}")
    path = trace_file(model)
    if not path.is_file():
        shipped = sorted(p.stem for p in TRACES_DIR.glob("*.jsonl"))
        raise FileNotFoundError(f"no reasoning traces ship for model {model!r} (traces ship for: {', '.join(shipped) or 'none'}); "
                                "use --texts or --text-file, or write them with `python -m trikv.benchmarks.quality.traces`")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    traces = [Trace(**{k: row[k] for k in Trace.__dataclass_fields__ if k in row}) for row in rows if row["split"] == split]
    if not traces:
        raise ValueError(f"{path} holds no {split} traces")
    if valid_only:
        traces = [trace for trace in traces if trace.valid]
        if not traces:
            raise ValueError(f"none of {model}'s {split} traces passes the validity rule ({RULE_TEXT})")
    return traces


def problems_for(model: str, split: str) -> list[str]:
    count = COUNTS.get(model, {"evaluation": 16, "design": 8})[split]
    return list((EVALUATION_PROBLEMS if split == "evaluation" else DESIGN_PROBLEMS)[:count])


def write_traces(model_name: str, split: str, seed: int = 0, dtype: str = "float32", engine: str = "lean",
                 batch: int = 16, min_tokens: int = MIN_TOKENS, command: str | None = None, log=print,
                 extend: bool = False, temperature: float = TEMPERATURE, top_p: float = TOP_P,
                 top_k: int = 0, out: str | Path | None = None, progress: bool = True,
                 redo_invalid: bool = False) -> list[Trace]:
    """Sample `split`'s traces of `model_name` with full attention and write them into its trace file (the other
    split's rows are kept). Attempt a (0-based) of every problem still short is sampled in one batch with seed
    `seed + a`; an attempt may write up to the tokens its problem still lacks (+ 64). An attempt that loops
    (`validity.attempt_is_loop`) is stopped as soon as it does and rejected. Each trace carries its validity
    figures. `extend` keeps the split's shipped traces and continues the attempts of those still short of
    `min_tokens`. `redo_invalid` keeps the split's shipped traces that pass the validity rule as they are and writes
    the others again from fresh seeds (after every seed the split has used; the old ones count as rejected).
    `out`: the file to write (default: the shipped trace file of the model)."""
    import torch

    from ...generation import generate
    from ...models import load_model
    from ...prompts import continuation_ids, is_instruct, math_prompt
    from .math_task import load_problems

    problem_ids = problems_for(model_name, split)
    if not problem_ids:
        raise ValueError(f"no {split} traces are planned for {model_name} (traces.COUNTS)")
    from ...sanity import check_model_answers

    model, tokenizer = load_model(model_name, dtype=getattr(torch, dtype))
    check_model_answers(model, tokenizer, model_name)
    by_dataset: dict[str, list[str]] = {}
    for problem_id in problem_ids:
        by_dataset.setdefault(problem_id.rpartition("-")[0], []).append(problem_id)
    prompts = {}
    for dataset, ids in by_dataset.items():
        prompts |= {p["id"]: math_prompt(tokenizer, p["question"], p["prompt"]) for p in load_problems(dataset, ids=ids)}
    pieces: dict[str, list[list[int]]] = {pid: [] for pid in problem_ids}
    seeds: dict[str, list[int]] = {pid: [] for pid in problem_ids}
    rejected: dict[str, list[int]] = {pid: [] for pid in problem_ids}
    separator = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    if extend and redo_invalid:
        raise ValueError("give either extend or redo_invalid")
    first_attempt = 0
    kept_traces: dict[str, Trace] = {}  # redo_invalid: the valid shipped traces, left exactly as they are
    if redo_invalid:
        for trace in load_traces(model_name, split):
            used = trace.seeds + trace.rejected_seeds
            first_attempt = max(first_attempt, max(used) - seed + 1)
            if trace.valid:
                kept_traces[trace.name] = trace
                pieces[trace.name] = [continuation_ids(tokenizer, trace.text)]  # long enough: never sampled again
            else:
                rejected[trace.name] = used
        log(f"{len(kept_traces)} valid traces kept; writing again: "
            + (", ".join(pid for pid in problem_ids if pid not in kept_traces) or "none"))
    if extend:  # the shipped attempts stand as they are (their text re-tokenised)
        for trace in load_traces(model_name, split):
            pieces[trace.name] = [continuation_ids(tokenizer, trace.text)]
            seeds[trace.name] = list(trace.seeds)
            rejected[trace.name] = list(trace.rejected_seeds)
            first_attempt = max(first_attempt, len(trace.seeds) + len(trace.rejected_seeds))
    eos = set([tokenizer.eos_token_id] if isinstance(tokenizer.eos_token_id, int) else tokenizer.eos_token_id or [])

    def loops(generated: "torch.Tensor") -> list[bool]:  # [rows, steps]: stop an attempt once it is a loop
        # the rejection rule's repeat test on the text written so far, digits masked (a counting loop is caught
        # while it is written, not after it has used up the attempt); a row that wrote EOS has finished
        halted = []
        for row in generated.tolist():
            if eos.intersection(row):
                halted.append(False)
                continue
            masked = mask_digits(tokenizer.decode(row, skip_special_tokens=True))
            whole_trace_chars = min_tokens * len(masked) / max(1, len(row))
            halted.append(longest_text_repeat(masked) > MAX_REPEAT_SHARE * whole_trace_chars)
        return halted

    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    for attempt in range(first_attempt, first_attempt + MAX_ATTEMPTS if redo_invalid else MAX_ATTEMPTS):
        short = [pid for pid in problem_ids if _length(pieces[pid], separator) < min_tokens]
        if not short:
            break
        for first in range(0, len(short), batch):
            group = short[first:first + batch]
            missing = max(min_tokens - _length(pieces[pid], separator) for pid in group)
            result = generate(model, tokenizer, [prompts[pid] for pid in group], method="full", max_new_tokens=missing + 64,
                              do_sample=True, seed=seed + attempt, engine=engine, halt_rows=loops, progress=progress,
                              **sampling)
            kept = 0
            for pid, tokens in zip(group, result.tokens):
                tokens = [t for t in tokens if t not in eos]
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                if not tokens:
                    continue
                if attempt_is_loop(text, tokens, min_tokens):
                    rejected[pid].append(seed + attempt)
                    continue
                pieces[pid].append(tokens)
                seeds[pid].append(seed + attempt)
                kept += 1
            log(f"attempt {attempt}: {len(group)} problems, {kept} answers kept, {len(group) - kept} rejected or empty, "
                f"longest {max(len(t) for t in result.tokens)} tokens")
    traces = []
    frame = "chat template" if is_instruct(tokenizer) else "plain completion prompt (base model)"
    for pid in problem_ids:
        if pid in kept_traces:
            traces.append(kept_traces[pid])
            continue
        texts = [tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens in pieces[pid]]
        texts = [text for text in texts if text]
        text = "\n\n".join(texts)
        length = _length(pieces[pid], separator)
        validity = trace_validity(text, continuation_ids(tokenizer, text), attempts=len(texts), rejected=len(rejected[pid]),
                                  min_tokens=min_tokens)
        traces.append(Trace(
            name=pid, split=split, prompt=prompts[pid], text=text, tokens=length, seeds=seeds[pid],
            source=(f"{model_name} ({dtype}, {engine} engine) with full attention on {pid}, {frame}: "
                    f"{len(seeds[pid])} sampled attempt(s) kept, {len(rejected[pid])} rejected as loops, T {temperature}, "
                    f"top-p {top_p}" + (f", top-k {top_k}" if top_k else "") + f", seeds {seeds[pid]}"
                    + (f"; command: {command}" if command else "")),
            rejected_seeds=rejected[pid], validity=validity.as_dict(),
            sampling={"temperature": temperature, "top_p": top_p, "top_k": top_k},
        ))
    path = Path(out) if out is not None else trace_file(model_name)
    kept_rows = []
    if path.is_file():
        kept_rows = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip() and json.loads(line)["split"] != split]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(kept_rows + [json.dumps(trace.as_row(), ensure_ascii=False) for trace in traces]) + "\n", encoding="utf-8")
    return traces


def assess_traces(model_name: str, split: str) -> list[Trace]:
    """Judge `model_name`'s shipped `split` traces again under the current validity rule and write the figures into
    the trace file; the text is left as it is. The rule's figures are read from the text; the token count is the
    one recorded with the earlier figures (the text has not changed, nor has its tokenizer), and only traces that
    carry none are counted with the model's tokenizer."""
    traces = load_traces(model_name, split)
    tokenizer = None
    for trace in traces:
        counted = (trace.validity or {}).get("tokens")
        if counted is None:
            if tokenizer is None:
                from transformers import AutoTokenizer

                from ...models import resolve_model_path

                tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model_name))
            from ...prompts import continuation_ids

            counted = len(continuation_ids(tokenizer, trace.text))
        trace.validity = trace_validity(trace.text, [], attempts=len(trace.seeds), rejected=len(trace.rejected_seeds),
                                        min_tokens=MIN_TOKENS, tokens=counted).as_dict()
    path = trace_file(model_name)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    updated = {trace.name: trace for trace in traces}
    lines = [json.dumps(updated[row["name"]].as_row() if row["split"] == split else row, ensure_ascii=False) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return traces


def _length(pieces: list[list[int]], separator: list[int]) -> int:
    return sum(len(p) for p in pieces) + len(separator) * max(len(pieces) - 1, 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trikv.benchmarks.quality.traces", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--split", choices=SPLITS, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--engine", default="lean", choices=("lean", "transformers"),
                        help="decode loop (the lean engine runs full-attention models; hybrid ones need transformers)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=TEMPERATURE, help="sampling temperature (default: the paper's 0.6)")
    parser.add_argument("--top-p", type=float, default=TOP_P, help="nucleus sampling (default: the paper's 0.95)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0: off)")
    parser.add_argument("--ship", action="store_true",
                        help="write into the trace file trikv ships (what `trikv bench quality --traces` reads)")
    parser.add_argument("--out", help="trace file to write without --ship (default runs/traces/MODEL.jsonl)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (the per-attempt lines stay)")
    parser.add_argument("--redo-invalid", action="store_true",
                        help="keep the split's shipped traces that pass the validity rule and write the others again from fresh seeds")
    parser.add_argument("--assess", action="store_true",
                        help="only recompute the validity figures of the shipped traces (no sampling)")
    parser.add_argument("--extend", action="store_true",
                        help="keep the split's shipped traces and continue the attempts of those short of 2,048 tokens")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    command = "python -m trikv.benchmarks.quality.traces " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.ship and args.out:
        parser.error("give either --ship or --out")
    if args.extend and args.redo_invalid:
        parser.error("give either --extend or --redo-invalid")
    if args.assess and not args.ship:
        parser.error("--assess rewrites the shipped trace file: add --ship")
    out = None if args.ship else Path(args.out or Path("runs") / "traces" / f"{args.model}.jsonl")
    traces = (assess_traces(args.model, args.split) if args.assess else
              write_traces(args.model, args.split, args.seed, args.dtype, engine=args.engine, batch=args.batch, command=command,
                           extend=args.extend, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, out=out,
                           progress=not args.no_progress, redo_invalid=args.redo_invalid))
    for trace in traces:
        figures = trace.validity
        print(f"{trace.name}: {trace.tokens} tokens in {len(trace.seeds)} attempt(s) ({len(trace.rejected_seeds)} rejected); "
              f"masked compression {figures['masked_compression']:.3f}, longest masked repeat {figures['repeat_share']:.1%}, "
              f"least line variety {figures['line_variety']:.1%}, "
              f"repeated line templates {figures['template_share']:.1%}: " + ("valid" if figures["valid"] else "NOT valid"))
    print(f"{sum(t.valid for t in traces)} of {len(traces)} valid ({RULE_TEXT})")
    if out is not None:
        print(f"wrote {out}; `trikv bench quality --traces` reads the shipped file: write it with --ship")


if __name__ == "__main__":
    main()
