"""The commands and snippets of README.md and the user guides (docs/guides/*.md), read from the pages themselves
(so the two cannot drift apart).

`shell_commands()` gives every command of the pages' ```bash blocks (continuation lines joined, comments dropped),
`python_snippets()` every ```python block, in page order (the README first); a command shown on two pages is
listed once.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs" / "guides").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(text: str | None = None) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of `text` (default: every page)."""
    texts = [text] if text is not None else [page.read_text() for page in PAGES]
    return [(language, code) for source in texts for language, code in FENCE.findall(source)]


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
    return list(dict.fromkeys(commands))


def python_snippets(text: str | None = None) -> list[str]:
    return [code for language, code in blocks(text) if language == "python"]
