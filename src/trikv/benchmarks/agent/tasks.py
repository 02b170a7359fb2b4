"""Scripted agent sessions over a real codebase: the running Python's standard library sources.

A session is what a coding agent's conversation looks like: every step is a tool result (`read_file` of a chunk
of a real source file, about `chunk_tokens` tokens of whole lines) with a question about that chunk, then a
question about a chunk read several steps earlier. Each question has a checkable answer read from the file by
Python's own parser (`ast`), never written by hand, and a strict judge:

- "params": the named parameters of a function or method defined in the chunk (self / cls, *args and **kwargs left
  out, two to five); right when the answer's comma-separated names (read from its first line, defaults and
  annotations dropped, starred items skipped) are exactly that set: a missing or an extra name is wrong, and a
  sentence around the list is wrong;
- "value": the literal number or short string assigned to a module- or class-level name in the chunk; right when
  the answer's first line, parsed as a Python literal (a bare string as itself, `NAME = ` before it and a final
  full stop allowed), equals the value (a number equals a number, a string the same string).

Every question of a session asks a different fact: a question about an earlier chunk (a recall) never repeats the
question asked when the chunk was shown, nor an earlier recall, so an answer cannot be echoed from the
conversation. A chunk is used only when it defines at least `MIN_FACTS` facts (one asked when shown, the others
kept for recalls). A question's subject is defined in one chunk of the session only, so the question has one
answer. `distance` is the number of chunks read after the asked chunk (0: the chunk just shown). Sessions are
seeded: the same seed, Python version and files give the same session; every source file's sha256 is recorded.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Pure-Python standard library modules with many functions and constants (read as an agent would read a repo)
SOURCE_FILES = (
    "textwrap.py", "shlex.py", "calendar.py", "fractions.py", "heapq.py", "statistics.py", "difflib.py", "string.py",
    "base64.py", "uuid.py", "gzip.py", "tarfile.py", "zipfile.py", "imaplib.py", "ftplib.py", "smtplib.py",
    "poplib.py", "wave.py", "pprint.py", "optparse.py", "argparse.py", "configparser.py", "csv.py", "tokenize.py",
    "random.py", "ipaddress.py", "plistlib.py", "gettext.py", "mailbox.py", "shutil.py", "tempfile.py",
    "subprocess.py", "selectors.py", "socket.py", "codecs.py", "locale.py", "webbrowser.py", "trace.py", "timeit.py",
)
MIN_FACTS = 3  # facts a chunk must define: one asked when it is shown, two for recalls that repeat nothing

SYSTEM_MESSAGE = ("You are a coding agent exploring a Python code base through tools. Each tool result shows part "
                  "of a file. Answer each question briefly, using only the files shown in this conversation.")


@dataclass(frozen=True)
class Chunk:
    path: str  # the file's name inside the standard library
    first_line: int  # 1-based, inclusive
    last_line: int
    text: str


@dataclass(frozen=True)
class Question:
    kind: str  # "params" | "value"
    subject: str  # the function or the assigned name
    expected: tuple[str, ...]  # what a right answer contains (every item, as a word for names)
    chunk: int  # the step whose chunk holds the answer
    text: str

    def is_right(self, answer: str) -> bool:
        """The strict judge: the exact set of parameter names, or the literal's value (see the module's rule)."""
        if self.kind == "params":
            names = answer_names(answer)
            return names is not None and names - {"self", "cls"} == set(self.expected)
        return ast.literal_eval(self.expected[0]) in answer_values(answer)


_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def _first_line(answer: str) -> str:
    """The answer's first line with text, code fences and backticks removed, a final full stop dropped."""
    lines = [line for line in answer.replace("```python", "").replace("```", "").splitlines() if line.strip()]
    return lines[0].replace("`", "").strip().removesuffix(".").strip() if lines else ""


def answer_names(answer: str) -> set[str] | None:
    """The parameter names a "params" answer lists: its first line split at commas, each item the identifier that
    starts it (`name: type = default` gives `name`); a line written as `f(a, b)` gives a, b. `*`, `/`, `*args` and
    `**kwargs` items are skipped (questions ask the named parameters only). None when an item is not a name
    (a sentence, not a list)."""
    line = _first_line(answer)
    call = re.fullmatch(r"[A-Za-z_][\w.]*\((.*)\)(\s*->.*)?:?", line)
    if call:
        line = call.group(1)
    names = set()
    for item in line.split(","):
        item = item.strip()
        if item in ("*", "/") or item.startswith("*") and _IDENTIFIER.fullmatch(item.lstrip("*").split(":")[0].strip()):
            continue  # the keyword-only and positional-only markers, *args and **kwargs: not asked, not penalised
        head = re.split(r"\s*[:=]", item, maxsplit=1)[0].strip()
        if not item or not _IDENTIFIER.fullmatch(head):
            return None
        names.add(head)
    return names


def answer_values(answer: str) -> list:
    """The values a "value" answer can be read as: its first line (`NAME = ` before it dropped), with and without a
    final full stop, each as a Python literal when it parses as one (a number or a string) and as the bare text.
    Empty for an empty answer."""
    lines = [line for line in answer.replace("```python", "").replace("```", "").splitlines() if line.strip()]
    line = lines[0].replace("`", "").strip() if lines else ""
    assignment = re.fullmatch(r"[A-Za-z_]\w*\s*=\s*(.+)", line)
    if assignment:
        line = assignment.group(1).strip()
    values = []
    for text in dict.fromkeys([line, line.removesuffix(".").strip()]):
        if not text:
            continue
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            value = text
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            values.append(value)
        values.append(text)  # a string written without quotes ("utf-8", or "42" for the string '42')
    return values


@dataclass
class Message:
    """One user message of the session and the question it ends with."""

    step: int
    text: str
    question: Question
    distance: int  # chunks read after the asked one


@dataclass
class AgentSession:
    seed: int
    chunks: list[Chunk]
    messages: list[Message]
    sources: dict[str, str] = field(default_factory=dict)  # file -> sha256

    def to_json(self) -> dict:
        return {"seed": self.seed, "sources": self.sources, "chunks": [asdict(c) for c in self.chunks],
                "messages": [{"step": m.step, "text": m.text, "distance": m.distance, "question": asdict(m.question)}
                             for m in self.messages]}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _facts(tree: ast.Module) -> list[tuple[str, str, tuple[str, ...], int]]:
    """(kind, subject, expected, line) of every question a file can answer."""
    facts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
            arguments = node.args
            names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs if a.arg not in ("self", "cls")]
            if 2 <= len(names) <= 5:
                facts.append(("params", node.name, tuple(names), node.lineno))
    for scope in [tree] + [node for node in tree.body if isinstance(node, ast.ClassDef)]:
        for node in scope.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Constant) and not isinstance(node.value.value, bool)):
                value = node.value.value
                if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= 2:
                    facts.append(("value", node.targets[0].id, (repr(value),), node.lineno))
                elif isinstance(value, str) and 3 <= len(value) <= 24 and value.isprintable() and "`" not in value:
                    facts.append(("value", node.targets[0].id, (repr(value),), node.lineno))
    return facts


def _question(kind: str, path: str, subject: str) -> str:
    if kind == "params":
        return (f"In `{path}`, what are the parameters of `{subject}`? Reply with the parameter names only, "
                "separated by commas.")
    return f"In `{path}`, what value is assigned to `{subject}`? Reply with the value only."


def _chunks(path: Path, tokens_of, chunk_tokens: int) -> list[tuple[Chunk, list]]:
    """The file in chunks of whole lines of about `chunk_tokens` tokens, each with the facts defined in it."""
    source = path.read_text(encoding="utf-8")
    facts = _facts(ast.parse(source))
    lines = source.splitlines(keepends=True)
    out, start, size = [], 0, 0
    for index, line_tokens in enumerate(tokens_of(lines)):
        size += line_tokens
        if size >= chunk_tokens or index == len(lines) - 1:
            first, last = start + 1, index + 1
            inside = [fact for fact in facts if first <= fact[3] <= last]
            out.append((Chunk(path.name, first, last, "".join(lines[start : index + 1])), inside))
            start, size = index + 1, 0
    return out


def make_session(seed: int, tokenizer, steps: int = 10, chunk_tokens: int = 400, far: int = 8,
                 source_dir: Path | None = None) -> AgentSession:
    """A session of `steps` tool results from files drawn with `seed`: step k shows chunk k with a question about it
    (distance 0), then asks about an earlier chunk, at a distance drawn from 1 .. min(k, `far`)."""
    source_dir = source_dir or stdlib_dir()
    rng = random.Random(seed)
    files = [name for name in SOURCE_FILES if (source_dir / name).is_file()]
    rng.shuffle(files)

    def tokens_of(lines: list[str]) -> list[int]:  # each line's own token count, in one batched call
        return [len(ids) for ids in tokenizer(lines, add_special_tokens=False)["input_ids"]] if lines else []

    def once(step_facts: list) -> list:  # a subject defined twice in a chunk (two classes' methods) has two answers
        subjects = [fact[1] for fact in step_facts]
        return [fact for fact in step_facts if subjects.count(fact[1]) == 1]

    chunks: list[Chunk] = []
    facts: list[list] = []
    sources = {}
    for name in files:
        if len(chunks) == steps:
            break
        candidates = [(chunk, once(inside)) for chunk, inside in _chunks(source_dir / name, tokens_of, chunk_tokens)
                      if len(once(inside)) >= MIN_FACTS]
        if not candidates:
            continue
        chunk, inside = rng.choice(candidates)  # one chunk per file: an agent reading around a code base
        chunks.append(chunk)
        facts.append(inside)
        sources[name] = hashlib.sha256((source_dir / name).read_bytes()).hexdigest()
    if len(chunks) < steps:
        raise ValueError(f"only {len(chunks)} source files with questions found in {source_dir}, {steps} steps asked")
    # a subject named in one chunk only, and its name must not appear in the other chunks' text either
    def unique(step: int, fact) -> bool:
        word = re.compile(rf"(?<![\w]){re.escape(fact[1])}(?![\w])")
        return all(not word.search(other.text) for index, other in enumerate(chunks) if index != step)

    askable = [[fact for fact in step_facts if unique(step, fact)] or step_facts for step, step_facts in enumerate(facts)]
    unasked = [list(step_facts) for step_facts in askable]  # facts no question of the session has asked yet
    messages = []
    for step, chunk in enumerate(chunks):
        header = (f"Tool result of read_file(\"{chunk.path}\", lines {chunk.first_line}-{chunk.last_line}):\n"
                  f"```python\n{chunk.text.rstrip()}\n```\n\n")
        current = _ask(rng, unasked, chunks, step)
        messages.append(Message(step, header + current.text, current, 0))
        if step > 0:
            # a distance in 1 .. min(step, far) whose chunk still holds a fact nobody asked
            distances = [d for d in range(1, min(step, far) + 1) if unasked[step - d]]
            if not distances:
                raise ValueError(f"session {seed}: no chunk within {far} steps of step {step} holds a fact not asked "
                                 f"yet; raise MIN_FACTS or lower the steps")
            back = step - rng.choice(distances)
            earlier = _ask(rng, unasked, chunks, back)
            messages.append(Message(step, earlier.text, earlier, step - back))
    return AgentSession(seed, chunks, messages, sources | {"python": sys.version.split()[0]})


def _ask(rng: random.Random, unasked: list[list], chunks: list[Chunk], chunk_index: int) -> Question:
    """A question about a fact of chunk `chunk_index` that no question of the session asked before (removed from
    `unasked`)."""
    options = unasked[chunk_index]
    kind, subject, expected, _ = options.pop(rng.randrange(len(options)))
    return Question(kind, subject, expected, chunk_index, _question(kind, chunks[chunk_index].path, subject))


def no_context_messages(session: AgentSession) -> list[str]:
    """Each question of the session as it would be asked with no tool result before it (the no-context control:
    what the model answers from training alone)."""
    return [message.question.text for message in session.messages]
