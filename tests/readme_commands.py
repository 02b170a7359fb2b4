"""The commands and snippets of README.md, read from the README itself (so the two cannot drift apart).

`shell_commands()` gives every command of the README's ```bash blocks (continuation lines joined, comments
dropped), `python_snippets()` every ```python block, in README order.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(text: str | None = None) -> list[tuple[str, str]]:
    """(language, code) of every fenced block."""
    return [(language, code) for language, code in FENCE.findall(text if text is not None else README.read_text())]


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` that lies outside quotes."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def shell_commands(text: str | None = None) -> list[str]:
    """Every command of the ```bash blocks: `\\`-continued lines joined, comments and blank lines dropped."""
    commands = []
    for language, code in blocks(text):
        if language not in ("bash", "sh", "shell"):
            continue
        pending = ""
        for raw in code.splitlines():
            line = _strip_comment(raw)
            if not line.strip():
                continue
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            commands.append((pending + line.strip()).strip())
            pending = ""
        if pending.strip():
            commands.append(pending.strip())
    return commands


def python_snippets(text: str | None = None) -> list[str]:
    return [code for language, code in blocks(text) if language == "python"]
