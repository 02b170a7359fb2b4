"""Checks of user-given numbers, shared by the library entry points and the CLI.

An integer setting accepts any integral number (Python or NumPy), never a bool or a float, so that
`budget=True` or `divide_length=16.0` fail where they are given instead of somewhere later.
"""

from __future__ import annotations

import numbers


def integer(name: str, value, minimum: int = 1) -> int:
    """`value` as an int >= minimum, or ValueError naming the setting."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def probability(name: str, value) -> float:
    """A probability in (0, 1] (top-p)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def positive(name: str, value) -> float:
    """A real number > 0 (temperature)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0.0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)
