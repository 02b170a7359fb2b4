"""How many CPU threads a command computes with (`--threads`), the same rule for every command.

Default: torch's own choice, except on a CPU already busy with other work, where one thread is used (several
OpenMP threads on oversubscribed cores spin-wait against each other and run several times slower than one).
"""

from __future__ import annotations

import argparse
import os


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own choice, 1 when the machine is already busy)")


def machine_is_busy() -> bool:
    """The 1-minute load average exceeds the cores this process could use."""
    try:
        return os.getloadavg()[0] > max(1, (os.cpu_count() or 1) - 0.5)
    except OSError:
        return False


def apply_threads(threads: int | None, device: str = "cpu") -> int:
    """Set torch's CPU threads by the rule above; returns the count in use."""
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be a positive integer, got {threads}")
        torch.set_num_threads(threads)
    elif device == "cpu" and machine_is_busy():
        torch.set_num_threads(1)
    return torch.get_num_threads()
