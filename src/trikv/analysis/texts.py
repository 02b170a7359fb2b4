"""Texts to analyse: the shipped defaults (prose, code, math) or user files."""

from __future__ import annotations

from pathlib import Path

DEFAULT_TEXTS_DIR = Path(__file__).resolve().parent.parent / "data" / "analysis_texts"


def default_texts() -> dict[str, str]:
    """{name: text} of the texts shipped in trikv/data/analysis_texts (alphabetical)."""
    files = sorted(DEFAULT_TEXTS_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no default analysis texts in {DEFAULT_TEXTS_DIR}; pass --text-file FILE")
    return {path.stem: path.read_text(encoding="utf-8") for path in files}


def load_text_files(paths: list[str | Path]) -> dict[str, str]:
    """{name: text} for user files; the name is the file stem, made unique if two files share one."""
    texts: dict[str, str] = {}
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise FileNotFoundError(f"text file not found: {path}")
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise ValueError(f"text file is empty: {path}")
        name, i = path.stem, 2
        while name in texts:
            name, i = f"{path.stem}_{i}", i + 1
        texts[name] = text
    return texts
