"""What the generated Markdown pages (docs/results.md, docs/speed.md, docs/serving*.md, docs/analysis.md,
docs/agent.md, docs/mlx.md) share: the header every page opens with, and the plots copied beside a page.

The header is the page's own title, one line that says how, when and from which commit the page was generated,
and a headline box (what was measured, the main figure, the targets met and not met). The generators compute
every part of the box from their run files; nothing in it is typed by hand.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[3]  # src/trikv/benchmarks/report_pages.py -> the checkout
SHORT = 7  # characters of a commit hash, as `git rev-parse --short` prints them
NO_TARGETS = "no targets checked on this page"

# (what the page checks, met): met is None where the data cannot judge it (not measured, not run yet, inconclusive)
Target = tuple[str, bool | None]


def embed_plot(png: Path, assets: Path, prefix: str, alt: str) -> list[str]:
    """Copy a run's plot into the page's assets folder (as `prefix_name.png`); the Markdown lines that show it."""
    target = assets / f"{prefix}_{png.name}"
    shutil.copyfile(png, target)
    return [f"![{alt}]({assets.name}/{target.name})", ""]


def format_commit(commit: str, changed: bool = False) -> str:
    """A commit as the pages print it: its short hash, marked when the code that ran was not that commit's."""
    return commit[:SHORT] + (" (with uncommitted changes)" if changed else "")


def repository_commit(root: Path = REPOSITORY) -> str | None:
    """`git rev-parse --short HEAD` of the checkout the package runs from, marked when the package's source (`src`)
    differs from it: changes elsewhere (docs, runs) do not change what a run or a page computes. None outside a
    git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=20)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True, text=True,
                                timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return format_commit(head.stdout.strip(), bool(status.stdout.strip()))


def commit_phrase(recorded: list) -> str:
    """Which commit the page's numbers come from. `recorded` holds one entry per run: the commit its files record
    (as `format_commit` prints it), a list of them (a run whose parts ran at several commits), or None. Where runs
    record commits, the page names the distinct ones; where none does, the repository's HEAD when the page is
    generated stands in, and the phrase says which of the two it is."""
    per_run = [[entry] if isinstance(entry, str) else list(entry or []) for entry in recorded]
    known = list(dict.fromkeys(commit for commits in per_run for commit in commits if commit))
    if known:
        missing = sum(not any(commits) for commits in per_run)
        return (f"from commit{'s' if len(known) > 1 else ''} {', '.join(known)}, as the run files record"
                + (f" ({missing} of {len(per_run)} runs record none)" if missing else ""))
    head = repository_commit()
    if head is None:
        return "from an unknown commit: the run files record none and the package is not a git checkout"
    return f"from commit {head}, the repository's HEAD when the page was generated: the run files record no commit"


def command_line(*parts) -> str:
    """The shell command that regenerates a page, from its words (paths included), quoted where needed."""
    return shlex.join(str(part) for part in parts)


def targets_summary(targets: list[Target]) -> str:
    """'targets: N met, M not met: <the ones not met>', with '; K not judged' where the data cannot judge some;
    NO_TARGETS where the page checks none."""
    if not targets:
        return NO_TARGETS
    met = [name for name, ok in targets if ok is True]
    failed = [name for name, ok in targets if ok is False]
    undecided = [name for name, ok in targets if ok is None]
    text = f"targets: {len(met)} met, {len(failed)} not met" + (f": {'; '.join(failed)}" if failed else "")
    return text + (f"; {len(undecided)} not judged" if undecided else "")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def headline_box(measured: str, figure: str, targets: list[Target]) -> list[str]:
    """Three lines of a Markdown blockquote: what was measured, the main figure, the targets met and not met."""
    return [f"> - measured: {_one_line(measured)}", f"> - main figure: {_one_line(figure)}",
            f"> - {_one_line(targets_summary(targets))}"]


def page_header(title: str, command: str, measured: str, figure: str, targets: list[Target],
                recorded_commits: list, date: str | None = None) -> list[str]:
    """The lines every generated page opens with: `# title`, 'Generated by `command` on DATE from commit ...; do not
    edit by hand.' and the headline box. `date` defaults to today (YYYY-MM-DD)."""
    date = date or time.strftime("%Y-%m-%d")
    return [f"# {title}", "",
            f"Generated by `{command}` on {date} {commit_phrase(recorded_commits)}; do not edit by hand.", "",
            *headline_box(measured, figure, targets), ""]
