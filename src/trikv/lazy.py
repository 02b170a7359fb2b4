"""Package attributes imported on first use (PEP 562), so that `trikv --help` does not import torch."""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_getattr(package: str, exports: dict[str, tuple[str, str]]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: a name of `exports` (name -> (module relative to the package,
    attribute)) is imported on first use and cached in the package; any other name is tried as a submodule
    (`speed.peers`, as after an eager import)."""

    def __getattr__(name: str):
        namespace = importlib.import_module(package).__dict__
        if name not in exports:
            try:
                return importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as error:
                if error.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module, attribute = exports[name]
        value = getattr(importlib.import_module(module, package), attribute)
        namespace[name] = value  # later lookups skip this function
        return value

    return __getattr__
