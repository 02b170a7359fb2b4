"""One settings object for every backend: the defaults live in trikv.settings alone, and CacheSettings validates."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trikv.policies import key_only_methods
from trikv.settings import (DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH, DEFAULT_MIN_DECODE_ROOM, DEFAULT_ROUND_WORKSPACE_BYTES,
                            CacheSettings, is_default)

SOURCE = Path(__file__).resolve().parents[1] / "src" / "trikv"
DEFAULTS = {"budget": int(DEFAULT_BUDGET), "divide_length": int(DEFAULT_DIVIDE_LENGTH),
            "min_decode_room": DEFAULT_MIN_DECODE_ROOM, "round_workspace_bytes": DEFAULT_ROUND_WORKSPACE_BYTES}


def restatements(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every place a module writes one of the defaults as a literal number for a setting of that
    name: a parameter default, a class field, a dict entry, an argparse `default=` of the matching flag, or the
    round workspace's 256 MiB as an expression."""
    found = []

    def literal(node) -> int | None:
        """The integer a constant expression of integer literals (+, *, **) spells, else None."""
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, int) and not isinstance(node.value, bool) else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult, ast.Pow)):
            left, right = literal(node.left), literal(node.right)
            if left is None or right is None or (isinstance(node.op, ast.Pow) and right > 64):
                return None
            return {ast.Add: left + right, ast.Mult: left * right}.get(type(node.op), left**right if isinstance(node.op, ast.Pow) else None)
        return None

    def check(name: str | None, value_node, line: int) -> None:
        if name in DEFAULTS and literal(value_node) == DEFAULTS[name]:
            found.append((line, f"{name} = {DEFAULTS[name]}"))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
                check(arg.arg, default, node.lineno)
            for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                if default is not None:
                    check(arg.arg, default, node.lineno)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            check(node.target.id, node.value, node.lineno)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    check(key.value, value, node.lineno)
        elif isinstance(node, ast.Call):
            flag = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            for keyword in node.keywords:
                if keyword.arg == "default" and isinstance(flag, str) and flag.startswith("--"):
                    check(flag[2:].replace("-", "_"), keyword.value, node.lineno)
                else:
                    check(keyword.arg, keyword.value, node.lineno)
        elif isinstance(node, ast.BinOp) and literal(node) == DEFAULT_ROUND_WORKSPACE_BYTES:
            found.append((node.lineno, "256 MiB round workspace"))
    return found


def test_no_module_restates_the_defaults():
    offenders = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path.name == "settings.py" and path.parent == SOURCE:
            continue
        for line, what in restatements(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(SOURCE)}:{line}: {what}")
    assert not offenders, "defaults restated outside trikv/settings.py:\n" + "\n".join(offenders)


def test_the_scan_finds_each_kind_of_restatement():
    code = '''
def make(model, budget=2048, *, divide_length=128): ...
class Config:
    min_decode_room: int = 32
options = {"divide_length": 128}
parser.add_argument("--budget", type=int, default=2048)
call(round_workspace_bytes=268435456)
workspace = 256 * 2**20
def fine(budget=256, divide_length=DEFAULT): ...
'''
    found = [what for _, what in restatements(ast.parse(code))]
    assert found == ["budget = 2048", "divide_length = 128", "min_decode_room = 32", "divide_length = 128",
                     "budget = 2048", "round_workspace_bytes = 268435456", "256 MiB round workspace"]


def test_cache_settings_defaults_and_validation():
    settings = CacheSettings(stats="smollm2-135m")
    assert (settings.method, settings.budget, settings.divide_length, settings.min_decode_room) == ("triattention", 2048, 128, 32)
    assert is_default(settings.budget) and is_default(settings.divide_length)
    assert not is_default(settings.replace(budget=2048).budget)  # given explicitly, even if the same number
    assert CacheSettings("full").budget is None
    for kwargs, message in [
        (dict(method="magic"), "unknown method 'magic'"),
        (dict(method="full", budget=64), "'full' keeps every entry and takes no budget"),
        (dict(method="streaming", budget=0), "budget must be an integer >= 1, got 0"),
        (dict(method="streaming", divide_length=2.5), "divide_length must be an integer >= 1"),
        (dict(method="streaming", min_decode_room=-1), "min_decode_room must be an integer >= 0"),
        (dict(method="streaming", protect_prompt="yes"), "protect_prompt must be True or False"),
        (dict(method="triattention"), "needs calibration statistics"),
        (dict(method="streaming", stats="smollm2-135m"), "uses no statistics"),
        (dict(method="streaming", options={"banana": 1}), "has no option"),
        (dict(method="streaming", options={"stats": "x"}), "give the statistics as `stats`"),
        (dict(method="triattention-recent", budget=32, stats="s"), "budget 32 is not larger than the protected recent window"),
    ]:
        with pytest.raises(ValueError, match=message):
            CacheSettings(**kwargs)


def test_every_backend_offers_the_key_only_methods():
    methods = key_only_methods()
    assert methods[0] == "triattention" and {"streaming", "knorm", "triattention-union", "triattention-dedup"} <= set(methods)
    assert not {"full", "h2o", "snapkv", "rkv", "pyramidkv", "tam", "triattention-window"} & set(methods)
