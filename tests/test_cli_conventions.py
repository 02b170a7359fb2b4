"""The `trikv` command's conventions: `--version`; one name per setting across subcommands; every command's help
shows an example and the defaults of its options."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import defaultdict

import trikv
from trikv.cli import _command_tree, build_parser

# names a setting must not go by: each maps to the one the commands use
RETIRED = {
    "--new-tokens": "--max-new-tokens",
    "--max-tokens": "--max-new-tokens (an output length) or --text-tokens (tokens of a text)",
    "--no-prompt-protection": "--no-protect-prompt",
    "--sample": "--temperature (0 = greedy)",
    "--greedy": "--temperature 0",
    "--text": "--text-file (a text file; --texts names shipped texts)",
}


def _options():
    """(command, action) of every option of every command."""
    for path, parser in _command_tree(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.dest not in ("help", "version"):
                yield " ".join(path), action


def test_version():
    result = subprocess.run([sys.executable, "-m", "trikv.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"trikv {trikv.__version__}"


def test_one_name_per_setting_across_subcommands():
    flags_by_setting = defaultdict(lambda: defaultdict(list))  # dest -> flags -> commands
    problems = []
    for command, action in _options():
        flags_by_setting[action.dest][tuple(action.option_strings)].append(command)
        for flag in action.option_strings:
            if flag in RETIRED:
                problems.append(f"`trikv {command}` names {flag}; the commands say {RETIRED[flag]}")
    for dest, spellings in flags_by_setting.items():
        if len(spellings) > 1:
            problems.append(f"setting {dest!r} is spelled {dict(spellings)}")
    assert not problems, "\n".join(problems)


def test_the_same_setting_has_one_name_even_under_two_dests():
    """A check of the check: it sees a setting under two names in two subcommands."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    sub.add_parser("a").add_argument("--new-tokens", type=int)
    sub.add_parser("b").add_argument("--max-new-tokens", type=int)
    seen = {flag for _, p in _command_tree(parser) for action in p._actions for flag in action.option_strings}
    assert "--new-tokens" in seen and "--new-tokens" in RETIRED


def test_every_command_shows_an_example_and_its_defaults():
    problems = []
    for path, parser in _command_tree(build_parser()):
        text = parser.format_help()
        if path and "example: trikv " not in text and "example: printf" not in text:
            problems.append(f"`trikv {' '.join(path)} --help` shows no example")
        for action in parser._actions:
            default = action.default
            if (action.option_strings and action.nargs != 0 and default not in (None, False, argparse.SUPPRESS)
                    and action.dest not in ("help", "version") and "default" not in parser._get_formatter()._get_help_string(action)):
                problems.append(f"`trikv {' '.join(path)}` {action.option_strings[0]} hides its default {default!r}")
    assert not problems, "\n".join(problems)


GENERATING = ("generate", "chat", "demo")
# what every command that generates takes, under these names
GENERATION_OPTIONS = {"--model", "--device", "--dtype", "--stats", "--budget", "--divide-length", "--prefill-chunk-size",
                      "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--engine", "--threads"}
LOADING = ("calibrate", "analyze", "bench quality", *GENERATING)  # commands that load a model: where and in what dtype


def test_every_command_that_generates_takes_the_same_options():
    """The option sets, not only their names: generate, chat and demo all take the model's placement, the cache's
    settings and the same sampling options; every command that loads a model takes --device and --dtype; and
    --engine offers mlx wherever it generates."""
    options = defaultdict(dict)
    for command, action in _options():
        for flag in action.option_strings:
            options[command][flag] = action
    problems = []
    for command in GENERATING:
        missing = GENERATION_OPTIONS - set(options[command])
        if missing:
            problems.append(f"`trikv {command}` lacks {sorted(missing)}")
        elif "mlx" not in (options[command]["--engine"].choices or ()):
            problems.append(f"`trikv {command} --engine` offers no mlx")
    for command in LOADING:
        for flag in ("--model", "--device", "--dtype"):
            if flag not in options[command]:
                problems.append(f"`trikv {command}` lacks {flag}")
        if "--dtype" in options[command] and set(options[command]["--dtype"].choices or ()) != {"float32", "bfloat16", "float16"}:
            problems.append(f"`trikv {command} --dtype` offers {options[command]['--dtype'].choices}")
    assert not problems, "\n".join(problems)
