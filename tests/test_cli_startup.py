"""The `trikv` command answers at once: its parser, and every subcommand's `--help`, load no torch, transformers,
vLLM or MLX, print nothing stray, and return within two seconds."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

HEAVY = ("torch", "transformers", "vllm", "mlx", "numpy", "matplotlib")


def _subcommands() -> list[list[str]]:
    from trikv.cli import build_parser

    commands = []

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    commands.append(prefix + [name])
                    walk(child, prefix + [name])

    walk(build_parser(), [])
    return commands


def test_building_the_parser_imports_nothing_heavy():
    code = ("import sys, json; from trikv.cli import build_parser; build_parser(); "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [] and result.stderr == "", (result.stdout, result.stderr)


def test_every_help_answers_within_two_seconds_without_stray_output():
    commands = _subcommands()
    assert ["bench", "quality"] in commands and ["serve"] in commands and len(commands) >= 12
    for command in [[]] + commands:
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "trikv.cli", *command, "--help"], capture_output=True, text=True,
                                timeout=60)
        elapsed = time.perf_counter() - started
        assert result.returncode == 0 and result.stdout.startswith("usage: trikv"), (command, result.stderr[-2000:])
        assert result.stderr == "", (command, result.stderr[-2000:])
        assert elapsed < 2.0, f"trikv {' '.join(command)} --help took {elapsed:.1f} s"
