"""Scripted agent sessions over a real codebase: the running Python's standard library sources.

A session is what a coding agent's conversation looks like: every step is a tool result (`read_file` of a chunk
of a real source file, about `chunk_tokens` tokens of whole lines) with a question about that chunk, then a
question about a chunk read several steps earlier. Each question has a checkable answer read from the file by
Python's own parser (`ast`), never written by hand:

- "params": the parameter names of a function or method defined in the chunk (self / cls left out, at least
  two), right when every name appears in the answer as a word;
- "value": the literal number or short string assigned to a module- or class-level name in the chunk, right when
  the literal appears in the answer.

A question's subject (the function or name) is defined in one chunk of the session only, so the question has one
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
        """Every expected item appears in the answer (names as whole words, literals verbatim)."""
        if self.kind == "params":
            return all(re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", answer) for name in self.expected)
        return all(literal in answer for literal in self.expected)


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
                    facts.append(("value", node.targets[0].id, (value,), node.lineno))
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
    for index, line in enumerate(lines):
        size += tokens_of(line)
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

    def tokens_of(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    chunks: list[Chunk] = []
    facts: list[list] = []
    sources = {}
    for name in files:
        if len(chunks) == steps:
            break
        candidates = [(chunk, inside) for chunk, inside in _chunks(source_dir / name, tokens_of, chunk_tokens) if inside]
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
    messages = []
    for step, chunk in enumerate(chunks):
        header = (f"Tool result of read_file(\"{chunk.path}\", lines {chunk.first_line}-{chunk.last_line}):\n"
                  f"```python\n{chunk.text.rstrip()}\n```\n\n")
        kind, subject, expected, _ = rng.choice(askable[step])
        current = Question(kind, subject, expected, step, _question(kind, chunk.path, subject))
        messages.append(Message(step, header + current.text, current, 0))
        if step > 0:
            back = step - rng.randint(1, min(step, far))
            kind, subject, expected, _ = rng.choice(askable[back])
            earlier = Question(kind, subject, expected, back, _question(kind, chunks[back].path, subject))
            messages.append(Message(step, earlier.text, earlier, step - back))
    return AgentSession(seed, chunks, messages, sources | {"python": sys.version.split()[0]})
