"""`trikv bench ...`: a group of benchmark subcommands that several modules extend.

Each benchmark registers one subcommand with `register_bench(name, add_arguments, help)`; `add_bench_parser`
builds the `bench` group from the registry, so a new benchmark (quality, speed, ...) needs no change to the
main CLI. `add_arguments(parser)` adds the subcommand's options and sets `func` (called with the parsed args,
returns an exit code). Registration happens at import time of the modules listed in `BENCH_MODULES`; the
heavy imports (torch, transformers) stay inside the command functions.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class BenchCommand:
    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    help: str


BENCH_COMMANDS: dict[str, BenchCommand] = {}

# modules whose import registers bench subcommands; add yours here (one line)
BENCH_MODULES = [
    "trikv.benchmarks.quality.cli",
    "trikv.benchmarks.speed.cli",
    "trikv.benchmarks.speed_report",
    "trikv.benchmarks.serving",
    "trikv.benchmarks.serving_report",
    "trikv.benchmarks.soak",
    "trikv.benchmarks.agent.cli",
    "trikv.benchmarks.conversation",
    "trikv.benchmarks.conversation_report",
    "trikv.benchmarks.calibration_length",
    "trikv.benchmarks.calibration_length_report",
    "trikv.benchmarks.readme",
]


def register_bench(name: str, add_arguments: Callable[[argparse.ArgumentParser], None], help: str = "") -> None:
    """Register `trikv bench NAME`; `add_arguments(parser)` must set `func` on the parser."""
    BENCH_COMMANDS[name] = BenchCommand(name, add_arguments, help)


def _load_modules() -> None:
    for module in BENCH_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as error:  # a benchmark whose optional dependency is missing just does not appear
            if getattr(error, "name", None) and error.name.startswith("trikv"):
                raise


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` group (with every registered subcommand) to the main CLI's subparsers."""
    _load_modules()
    bench = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(sorted(BENCH_COMMANDS)) if BENCH_COMMANDS else "benchmarks")
    group = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name in BENCH_COMMANDS:
        command = BENCH_COMMANDS[name]
        command.add_arguments(group.add_parser(name, help=command.help, description=command.help))
    return bench
