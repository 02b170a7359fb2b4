"""sha256 of a file's bytes, read in blocks: how runs record the statistics and text files they read, and how
the results page checks them against the shipped ones."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()
