"""What the generated Markdown pages (docs/results.md, docs/speed.md, docs/serving.md) share."""

from __future__ import annotations

import shutil
from pathlib import Path


def embed_plot(png: Path, assets: Path, prefix: str, alt: str) -> list[str]:
    """Copy a run's plot into the page's assets folder (as `prefix_name.png`); the Markdown lines that show it."""
    target = assets / f"{prefix}_{png.name}"
    shutil.copyfile(png, target)
    return [f"![{alt}]({assets.name}/{target.name})", ""]
