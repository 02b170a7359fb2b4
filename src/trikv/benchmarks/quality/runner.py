"""`trikv bench quality`: the grid of tasks x methods x budgets, resumable, reproducible.

Every (task, method, budget) cell is a unit of work written to `OUT/units/` as soon as it is done, with the
fingerprint of what produced it: the task's inputs (the texts' content and token ids, the problems), the model's
parameters, tokenizer and statistics, the code (`code_files`: by content, with the git commit it came from), dtype,
threads, device and library versions. A rerun with the same arguments reuses the units whose fingerprint matches
(an interrupted run resumes), a rerun that only adds or drops methods or budgets reuses the matching cells both
grids share, a cell whose fingerprint differs is computed again (the log says which cells were reused and why
the others were not), and `--fresh` recomputes them all. The
full-attention reference of the teacher-forced texts is computed once per run and shared by all methods;
the `full` method's fidelity/recall figures are the reference itself. At the end the run writes
`results.json` (every figure, the configuration, versions, model / stats fingerprints, seeds), `results.csv`,
one PNG per task and prints the tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...selection import prompt_fits
from ...settings import DEFAULT_DIVIDE_LENGTH, DEFAULT_MIN_DECODE_ROOM
from .hashing import file_sha256

TASKS = ("fidelity", "dfs", "needle", "math", "prefill")
FORMAT = "trikv-bench-quality/1"


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Warnings of `logger_name` held back (the caller has said it once for the whole run)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass
class QualityConfig:
    tasks: list[str] = field(default_factory=lambda: ["fidelity", "dfs", "needle"])
    model: str = "smollm2-135m"
    stats: str | None = None  # path; None = the bundled stats of `model`
    methods: list[str] = field(default_factory=lambda: ["full", "triattention", "snapkv", "streaming"])
    budgets: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    divide_length: int = int(DEFAULT_DIVIDE_LENGTH)
    # the prompt's entries are never evicted (while they leave room); the needle task always lets them compete
    protect_prompt: bool = True
    # one rule for every method: the prompt is protected while prompt + min_decode_room <= budget
    min_decode_room: int = DEFAULT_MIN_DECODE_ROOM
    seed: int = 0
    max_chunk: int = 128
    # fidelity + recall
    texts: list[str] = field(default_factory=lambda: ["python-reference", "math-solutions"])
    text_files: list[str] = field(default_factory=list)  # the user's own UTF-8 texts, fed as they are
    text_tokens: int = 1024
    prompt_tokens: int = 32
    # the model's own reasoning traces (shipped per model): "evaluation" or "design"; each fed behind its chat prompt
    traces: str | None = None
    trace_tokens: int = 2048  # tokens of each trace fed after its prompt
    recall_stride: int = 4
    horizons: list[int] = field(default_factory=lambda: [128, 512, 1024, 2048, 4096])
    # DFS state query
    dfs_mode: str = "teacher-forced"  # teacher-forced | generative | both
    dfs_graphs: int = 2
    dfs_ks: list[int] = field(default_factory=lambda: [4, 8, 16, 24, 32])
    dfs_min_nodes: int = 10
    dfs_max_nodes: int = 30
    dfs_prompt: str = "chat"  # teacher-forced framing: chat (a user turn, answered in the assistant's) | plain
    # needle
    needle_lengths: list[int] = field(default_factory=lambda: [768])
    needle_depths: list[float] = field(default_factory=lambda: [0.25, 0.75])
    needle_keys: int = 1
    # math
    math_datasets: list[str] = field(default_factory=lambda: ["math500"])
    math_limit: int | None = 20
    math_samples: int = 4
    math_max_new_tokens: int = 1024
    math_engine: str = "lean"  # decode loop of the math generations: "lean" (fastest here) or "transformers"
    math_temperature: float = 0.6  # 0 = greedy
    math_batch: int = 1  # problems per generation batch (each with math_samples rows)
    # chosen problems by id (e.g. "math500-7"), in dataset order, instead of the first math_limit ones
    math_problems: list[str] | None = None
    # weights and activations; bfloat16 halves the memory traffic of a decode step (and uses AMX on recent Xeons)
    dtype: str = "float32"
    # prefill: a long prompt (windows of the fidelity texts) compacted while it is prefilled, in chunks, against
    # the same prompt prefilled whole and compacted after; KL of the continuation that follows
    prefill_prompt_tokens: int = 1536
    prefill_continuation_tokens: int = 512
    prefill_chunk: int = 512

    def fingerprint(self, grid: bool = True) -> str:
        """What decides whether a folder's units can be reused; grid=False leaves out the methods and budgets,
        which only choose which units exist (each unit is one (method, budget) cell)."""
        # a text file's content, not only its path, decides whether earlier units can be reused
        contents = [file_sha256(path) if Path(path).is_file() else None for path in self.text_files]
        record = {**dataclasses.asdict(self), "text_file_sha256": contents}
        for name, default in ADDED_LATER.items():  # at their defaults, runs made before these fields existed resume
            if record[name] == default:
                del record[name]
        if "dfs" not in self.tasks:  # runs made before the field existed resume unless they hold DFS units
            del record["dfs_prompt"]
        if not grid:
            del record["methods"], record["budgets"]
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


ADDED_LATER = {"math_temperature": 0.6, "math_batch": 1, "dtype": "float32", "math_problems": None, "traces": None,
               "trace_tokens": 2048, "min_decode_room": DEFAULT_MIN_DECODE_ROOM, "prefill_prompt_tokens": 1536,
               "prefill_continuation_tokens": 512, "prefill_chunk": 512}
# the prompt-protection rule the units of a folder were computed under: the same for every method (prompt +
# min_decode_room <= budget); folders from before it (a method's recent window counted too) are refused
PROTECTION_RULE = "equal"
DTYPES = ("float32", "bfloat16", "float16")

PRESETS: dict[str, dict] = {
    # the default: all tasks but math on the bundled model, budgets 64-512, a handful of methods (< 20 min on 2 CPU cores)
    "quick": {},
    # longer texts and more items: the long-horizon view (hours on a CPU)
    "full": {
        "tasks": ["fidelity", "dfs", "needle", "math"],
        "methods": ["full", "triattention", "rkv", "snapkv", "h2o", "streaming", "tova", "knorm"],
        "budgets": [64, 128, 256, 512, 1024],
        "texts": ["python-reference", "stdlib-source", "math-solutions", "trace-60", "trace-80"],
        "text_tokens": 4096,
        "recall_stride": 2,
        "dfs_graphs": 12,
        "dfs_ks": [4, 8, 16, 24, 32, 40, 48],
        "dfs_mode": "both",
        "needle_lengths": [1024, 2048, 4096],
        "needle_depths": [0.0, 0.25, 0.5, 0.75, 1.0],
        "needle_keys": 2,
        "math_datasets": ["math500", "aime24", "aime25"],
        "math_limit": None,
        "math_samples": 8,
        "math_max_new_tokens": 4096,
    },
}


def config_from_preset(preset: str, **overrides) -> QualityConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; available: {', '.join(PRESETS)}")
    values = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    if values.get("math_problems") is not None and overrides.get("math_limit") is None:
        values["math_limit"] = None  # chosen ids replace the default "first N problems"
    if values.get("traces") is not None and overrides.get("texts") is None:
        values["texts"] = []  # the traces replace the default human texts
    unknown = set(values) - {f.name for f in dataclasses.fields(QualityConfig)}
    if unknown:
        raise ValueError(f"unknown configuration keys {sorted(unknown)}")
    config = QualityConfig(**values)
    validate(config)
    return config


def validate(config: QualityConfig) -> None:
    from ...policies import REGISTRY

    bad = [t for t in config.tasks if t not in TASKS]
    if bad:
        raise ValueError(f"unknown task(s) {bad}; available: {', '.join(TASKS)}")
    bad = [m for m in config.methods if m not in REGISTRY]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; available: {', '.join(REGISTRY)}")
    if not config.budgets or any(b <= 0 for b in config.budgets):
        raise ValueError("budgets must be positive integers")
    # a repeated name would run (or reuse) the same cell twice and print it as two rows
    for name in ("tasks", "methods", "budgets"):
        values = list(getattr(config, name))
        repeated = [value for index, value in enumerate(values) if value in values[:index]]
        if repeated:
            raise ValueError(f"{name} given more than once: {', '.join(map(str, dict.fromkeys(repeated)))}")
    if config.dfs_mode not in ("teacher-forced", "generative", "both"):
        raise ValueError("dfs_mode must be teacher-forced, generative or both")
    from .dfs import DFS_PROMPTS

    if config.dfs_prompt not in DFS_PROMPTS:
        raise ValueError(f"dfs_prompt must be {' or '.join(DFS_PROMPTS)}, got {config.dfs_prompt!r}")
    if config.math_engine not in ("lean", "transformers"):
        raise ValueError(f"math_engine must be 'lean' or 'transformers', got {config.math_engine!r}")
    if config.math_temperature < 0:
        raise ValueError(f"math_temperature must be >= 0 (0 = greedy), got {config.math_temperature}")
    if config.math_batch < 1:
        raise ValueError(f"math_batch must be >= 1 problem per batch, got {config.math_batch}")
    if config.math_problems is not None:
        from .math_task import check_problem_ids

        if config.math_limit is not None:
            raise ValueError("give either math problem ids or a problem limit, not both")
        check_problem_ids(config.math_problems, config.math_datasets)
    if config.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    if any(not 0.0 <= d <= 1.0 for d in config.needle_depths):
        raise ValueError("needle depths must lie in [0, 1]")
    for path in config.text_files:
        if not Path(path).is_file():
            raise FileNotFoundError(f"text file not found: {path}")
    if config.traces is not None:
        from .traces import SPLITS

        if config.traces not in SPLITS:
            raise ValueError(f"traces must be one of {', '.join(SPLITS)}, got {config.traces!r}")
    if config.trace_tokens < 2:
        raise ValueError(f"trace_tokens must be at least 2, got {config.trace_tokens}")
    if "fidelity" in config.tasks and not config.texts and not config.text_files and config.traces is None:
        raise ValueError("the fidelity task needs at least one text (--texts, --text-file or --traces)")
    if "prefill" in config.tasks:
        if not config.texts and not config.text_files:
            raise ValueError("the prefill task needs at least one text (--texts or --text-file)")
        for name in ("prefill_prompt_tokens", "prefill_continuation_tokens", "prefill_chunk"):
            if getattr(config, name) < 2:
                raise ValueError(f"{name} must be at least 2, got {getattr(config, name)}")
        small = [b for b in config.budgets if b + config.divide_length >= config.prefill_prompt_tokens]
        if small:
            raise ValueError(f"the prefill task compares compaction during and after a prompt longer than budget + "
                             f"divide_length; budgets {small} leave the {config.prefill_prompt_tokens}-token prompt "
                             "nothing to compact while it is prefilled")


# ---- fingerprints ---------------------------------------------------------------------------------
def model_fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---- what produced a cell ----------------------------------------------------------------------------
PACKAGE_DIR = Path(__file__).resolve().parents[2]
# package sources a quality run never imports (other engines and benchmarks, the analysis tools, the demo), that only
# dispatch commands (the command lines) or measure memory (the speed benchmark's machine module), or that only format
# the figures after they are computed (the report, its page sections, its provenance and concentration sections);
# every other .py file of the package is part of a cell's code
CODE_EXCLUDED = ("vllm/", "mlx/", "analysis/", "benchmarks/agent/", "benchmarks/mlx/", "benchmarks/serving",
                 "benchmarks/speed/", "benchmarks/soak.py", "benchmarks/gpu_check.py", "benchmarks/compaction_timing.py",
                 "benchmarks/speed_report.py", "benchmarks/report_pages.py", "benchmarks/quality/report.py",
                 "benchmarks/quality/pages/", "benchmarks/quality/provenance.py", "benchmarks/quality/concentration.py",
                 "demo.py", "cli.py", "__main__.py")
# the fingerprint fields a finished cell must share with the run to be reused (`commit` only says where the code
# came from: the code itself is compared by its content)
MATCHED = ("inputs_sha256", "texts_sha256", "model_sha256", "tokenizer_sha256", "stats_sha256", "code_sha256",
           "dtype", "threads", "device", "torch", "transformers")


def code_files() -> list[Path]:
    """The package's Python sources a quality cell's figures can depend on (all but `CODE_EXCLUDED`), sorted."""
    files = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        if not relative.startswith(CODE_EXCLUDED):
            files.append(path)
    return files


def code_sha256(files: list[Path] | None = None) -> str:
    """sha256 over the relative path and content of every file of `code_files()`."""
    digest = hashlib.sha256()
    for path in files if files is not None else code_files():
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def git_commit(files: list[Path] | None = None) -> dict | None:
    """{"commit": HEAD, "modified": the files of `code_files()` that differ from it} where the package is a git
    checkout, else None: which commit the code came from, and whether it was that commit's code."""
    import subprocess

    files = files if files is not None else code_files()
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE_DIR, capture_output=True, text=True, timeout=20)
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--", *[str(path) for path in files]], cwd=PACKAGE_DIR,
                                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    modified = sorted(line[3:].strip() for line in status.stdout.splitlines() if line.strip())
    return {"commit": head.stdout.strip(), "modified": modified}


def digest(value) -> str:
    """sha256 of a JSON-able value (dataclasses as their fields), order of dict keys ignored."""
    def default(item):
        if dataclasses.is_dataclass(item):
            return dataclasses.asdict(item)
        if isinstance(item, torch.Tensor):
            return item.tolist()
        return repr(item)

    return hashlib.sha256(json.dumps(value, sort_keys=True, default=default).encode()).hexdigest()


def tokenizer_sha256(tokenizer) -> str | None:
    """sha256 of what turns the tasks' text into ids: the vocabulary, the special tokens and the chat template."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    return digest({"vocab": tokenizer.get_vocab(), "special": getattr(tokenizer, "all_special_tokens", None),
                   "bos": getattr(tokenizer, "bos_token_id", None), "template": getattr(tokenizer, "chat_template", None)})


def fingerprint_differences(recorded: dict | None, current: dict) -> list[str]:
    """The `MATCHED` fields in which a cell's recorded fingerprint differs from the run's (all of them when the
    cell recorded none)."""
    if not recorded:
        return ["not recorded"]
    return [name for name in MATCHED if recorded.get(name) != current.get(name)]


def task_family(task: str) -> str:
    """The inputs a unit's task reads: fidelity and recall the same texts, both prefill modes the same windows."""
    if task in ("fidelity", "recall"):
        return "fidelity"
    return task.split("-")[0] if task.startswith(("prefill-", "dfs-")) else task


# ---- units -------------------------------------------------------------------------------------------
class UnitStore:
    """One JSON file per finished (task, method, budget) cell, plus tensors the recall pass needs.

    Each cell is written with the fingerprint of what produced it (`expect`: the run's model, tokenizer, statistics,
    code, dtype, threads, versions and the task's inputs); a finished cell is reused only when its fingerprint
    matches the run's in every `MATCHED` field, and otherwise computed again. A cell that recorded no fingerprint
    (written before cells did) is reused only with `reuse_unrecorded`, and then marked so. What was reused and what
    was not is logged once per cell and kept in `status`."""

    def __init__(self, out: Path, fresh: bool, reuse_unrecorded: bool = False, log=print):
        self.dir = out / "units"
        self.dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for path in self.dir.iterdir():
                path.unlink()
        self.reuse_unrecorded, self.log = reuse_unrecorded, log
        self.identity: dict | None = None  # the run's fingerprint fields shared by every task
        self.inputs: dict[str, dict] = {}  # task family -> {"inputs_sha256", "texts_sha256"}
        self.status: dict[str, dict] = {}  # "task/method/budget" -> {"status", "fingerprint", "differs"}

    def expect(self, family: str, inputs_sha256: str, texts_sha256: str | None = None) -> None:
        """The inputs of a task family's cells in this run (set before its cells are looked up)."""
        self.inputs[family] = {"inputs_sha256": inputs_sha256, "texts_sha256": texts_sha256}

    def fingerprint(self, task: str) -> dict | None:
        if self.identity is None:
            return None
        return {**self.identity, **self.inputs.get(task_family(task), {"inputs_sha256": None, "texts_sha256": None})}

    def _path(self, task: str, method: str, budget, suffix: str = "json") -> Path:
        return self.dir / f"{task}__{method}__{budget if budget is not None else 'none'}.{suffix}"

    @staticmethod
    def key(task, method, budget) -> str:
        return f"{task}/{method}/{budget}"

    def get(self, task, method, budget):
        """The finished cell, or None when there is none or it was produced by something else than this run."""
        path = self._path(task, method, budget)
        if not path.exists():
            return None
        unit = json.loads(path.read_text())
        recorded = unit.pop("fingerprint", None)
        current = self.fingerprint(task)
        key = self.key(task, method, budget)
        if current is None:  # a store used without a run (tools that only read units)
            return unit
        if recorded is None:
            if self.reuse_unrecorded:
                if key not in self.status:
                    self.log(f"  reused {key}: written before cells recorded a fingerprint (--reuse-unrecorded)")
                    self.status[key] = {"status": "reused, fingerprint not recorded", "fingerprint": None}
                return unit
            if key not in self.status:
                self.log(f"  not reused {key}: it recorded no fingerprint (--reuse-unrecorded reuses such cells)")
                self.status[key] = {"status": "not reused", "differs": ["not recorded"]}
            return None
        differs = fingerprint_differences(recorded, current)
        if differs:
            if key not in self.status:
                self.log(f"  not reused {key}: its fingerprint differs in {', '.join(differs)}")
                self.status[key] = {"status": "not reused", "differs": differs}
            return None
        if key not in self.status:  # (a cell computed by this run is looked up again when the tables are built)
            self.log(f"  reused {key}: fingerprint matches (code {recorded['code_sha256'][:12]}, "
                     f"{recorded['threads']} thread(s), {recorded['dtype']})")
            self.status[key] = {"status": "reused", "fingerprint": recorded}
        return unit

    def put(self, task, method, budget, value) -> None:
        fingerprint = self.fingerprint(task)
        key = self.key(task, method, budget)
        if fingerprint is not None:
            earlier = self.status.get(key, {})
            if earlier.get("status") == "reused, fingerprint not recorded" or (earlier.get("fingerprint") or {}).get(
                    "includes_unrecorded"):
                # a cell continued from one that recorded no fingerprint keeps saying so
                fingerprint = {**fingerprint, "includes_unrecorded": True}
            value = {**value, "fingerprint": fingerprint}
            self.status[key] = {"status": "computed", "fingerprint": fingerprint}
        self.write(self._path(task, method, budget), value)

    def write(self, path: Path, value) -> None:
        """Replace a unit file in one step: a run stopped mid-write leaves the old unit, never half a new one."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value, indent=1, default=_json_default))
        tmp.replace(path)

    def get_tensor(self, task, method, budget):
        path = self._path(task, method, budget, "pt")
        return torch.load(path) if path.exists() else None

    def drop_tensor(self, task, method, budget) -> None:
        self._path(task, method, budget, "pt").unlink(missing_ok=True)

    def put_tensor(self, task, method, budget, value) -> None:
        path = self._path(task, method, budget, "pt")
        tmp = path.with_suffix(".pt.tmp")
        torch.save(value, tmp)
        tmp.replace(path)


def _json_default(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")


def budget_key(method: str, budget: int | None) -> str:
    return "full" if method == "full" else str(budget)


# ---- the run -------------------------------------------------------------------------------------------
class QualityRun:
    def __init__(self, config: QualityConfig, out: str | Path, model=None, tokenizer=None, stats=None,
                 fresh: bool = False, progress: bool = True, log=print, reuse_unrecorded: bool = False):
        self.config, self.out = config, Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model, self.tokenizer, self.stats = model, tokenizer, stats
        self.progress, self.log = progress, log
        self.earlier_cap = config.math_max_new_tokens  # the token cap of math answers that do not name theirs
        self._check_config(fresh)
        self.units = UnitStore(self.out, fresh, reuse_unrecorded=reuse_unrecorded, log=log)
        self._model_sha256: str | None = None
        self.fed_texts_sha256: str | None = None  # the fidelity texts' content (`texts.texts_sha256`)
        self.prefill_texts_sha256: str | None = None
        self._stamp_math_caps()
        self.stats_path = None
        self.unit_seconds: dict[str, float] = {}
        self.trace_validity: dict[str, dict | None] = {}  # every shipped trace of the split -> its validity figures

    def _check_config(self, fresh: bool) -> None:
        path = self.out / "config.json"
        current = dataclasses.asdict(self.config)
        if path.exists() and not fresh:
            previous = json.loads(path.read_text())
            if previous.get("protection_rule") != PROTECTION_RULE and any(self.out.glob("units/*__*.json")):
                raise ValueError(
                    f"{self.out} holds units computed under trikv's earlier prompt-protection rule (a method's recent "
                    "window counted against the prompt, so methods protected different prompts); use another --out "
                    "folder or --fresh to start over")
            # the number of math problems, like the methods and budgets, only says how far a run goes; so does a
            # higher token cap under greedy decoding: an answer that ended before the old cap ends there again
            previous_limit = previous.get("config", {}).get("math_limit", self.config.math_limit)
            previous_cap = previous.get("config", {}).get("math_max_new_tokens", self.config.math_max_new_tokens)
            raised_cap = self.config.math_temperature == 0 and previous_cap < self.config.math_max_new_tokens
            # problems chosen by id extend a folder's run when the earlier list is where the new one starts (a run
            # split into chunks): the earlier answers are the new run's first ones; a list the earlier one starts
            # with is the same run at a smaller extent, like a smaller --limit
            previous_ids = previous.get("config", {}).get("math_problems", self.config.math_problems)
            ids = self.config.math_problems
            extends = (previous_ids is not None and ids is not None
                       and (list(ids[: len(previous_ids)]) == list(previous_ids) or list(previous_ids[: len(ids)]) == list(ids)))
            same_extent = dataclasses.replace(self.config, math_limit=previous_limit,
                                              math_problems=previous_ids if extends else ids,
                                              math_max_new_tokens=previous_cap if raised_cap else self.config.math_max_new_tokens)
            if previous.get("fingerprint") != same_extent.fingerprint() or same_extent != self.config:
                if self._previous_setup(previous) != same_extent.fingerprint(grid=False):
                    changed = sorted(k for k in current if previous.get("config", {}).get(k) != current[k])
                    hint = (" (only a greedy run may raise --max-new-tokens in place)" if "math_max_new_tokens" in changed
                            else "")
                    raise ValueError(
                        f"{self.out} holds a run with another configuration (differs in {', '.join(changed)}){hint}; "
                        "use another --out folder or --fresh to start over"
                    )
                # same setup, other methods or budgets: the cells both grids share are reused, the rest computed
                problems = (f"; math problems {previous_limit or 'all'} -> {self.config.math_limit or 'all'}"
                            if previous_limit != self.config.math_limit else "")
                if extends and len(ids) != len(previous_ids):
                    problems += f"; math problems by id {len(previous_ids)} -> {len(ids)}"
                if raised_cap:
                    problems += (f"; math token cap {previous_cap} -> {self.config.math_max_new_tokens}: only the answers "
                                 f"that reached {previous_cap} tokens are generated again")
                self.log(f"{self.out}: running another grid in this folder (methods {', '.join(self.config.methods)}; budgets "
                         f"{', '.join(map(str, self.config.budgets))}{problems}); its finished cells and answers are reused")
            self.earlier_cap = previous_cap
        path.write_text(json.dumps({"fingerprint": self.config.fingerprint(), "setup_fingerprint": self.config.fingerprint(grid=False),
                                    "protection_rule": PROTECTION_RULE, "config": current}, indent=1))

    def _stamp_math_caps(self) -> None:
        """Math answers from before each record named its token cap were all generated under the folder's previous
        cap: write it into them before this run's cap replaces it in config.json, so that an answer that reached
        it is still known as cut short after any later run."""
        for path in sorted(self.units.dir.glob("math-*.json")):
            unit = json.loads(path.read_text())
            unnamed = [record for record in unit["records"] if "max_new_tokens" not in record]
            if unnamed:
                for record in unnamed:
                    record["max_new_tokens"] = self.earlier_cap
                self.units.write(path, unit)

    def _previous_setup(self, previous: dict) -> str | None:
        """The grid-free fingerprint of the run in the folder. Folders written before it was stored are
        fingerprinted from their saved configuration, which is only possible when no text file (whose content
        was not saved) was part of the run."""
        if "setup_fingerprint" in previous:
            return previous["setup_fingerprint"]
        config = previous.get("config", {})
        names = {f.name for f in dataclasses.fields(QualityConfig)}
        if config.get("text_files") or not set(config) <= names:
            return None
        return QualityConfig(**config).fingerprint(grid=False)

    # ---- setup
    def _load(self) -> None:
        from ...calibration import bundled_stats_path, load_stats
        from ...models import load_model
        from ...policies import REGISTRY

        if self.model is None:
            from ...sanity import check_model_answers

            self.model, self.tokenizer = load_model(self.config.model, dtype=getattr(torch, self.config.dtype))
            answer = check_model_answers(self.model, self.tokenizer, self.config.model)  # before measuring anything
            self.log(f"{self.config.model} answers a known prompt sanely: {answer.continuation.strip()!r}")
        needs_stats = any(REGISTRY[m].needs_stats for m in self.config.methods)
        if needs_stats and self.stats is None:
            source = self.config.stats or self.config.model
            self.stats = load_stats(source, self.model)
            path = Path(source)
            self.stats_path = path if path.is_file() else bundled_stats_path(source)
        elif self.config.stats:
            self.stats_path = Path(self.config.stats)

    def method_options(self, method: str) -> dict:
        from ...policies import REGISTRY

        return {"stats": self.stats} if REGISTRY[method].needs_stats else {}

    def generation_options(self, method: str) -> dict:
        """Options of `generate()` for `method`: its statistics and the run's prompt protection."""
        protection = {} if method == "full" else {"protect_prompt": self.config.protect_prompt,
                                                   "min_decode_room": self.config.min_decode_room}
        return self.method_options(method) | protection

    def make_cache(self, method: str, budget: int | None, protect_prompt: bool | None = None):
        from ...cache import make_cache

        protect = self.config.protect_prompt if protect_prompt is None else protect_prompt
        return make_cache(self.model, method, budget=budget, divide_length=self.config.divide_length,
                          protect_prompt=protect, min_decode_room=self.config.min_decode_room, **self.method_options(method))

    def cells(self) -> list[tuple[str, int | None]]:
        cells = [("full", None)] if "full" in self.config.methods else []  # first: others may reuse its records
        for method in self.config.methods:
            if method != "full":
                cells += [(method, b) for b in self.config.budgets]
        return cells

    def _full_records(self, task: str):
        """Records of the full-attention cell of `task` (None when full is not in the grid or not done yet)."""
        unit = self.units.get(task, "full", None) if "full" in self.config.methods else None
        return None if unit is None else unit["records"]

    def _threshold(self, budget: int | None) -> int | None:
        return None if budget is None else budget + self.config.divide_length

    def _bar(self, total: int, desc: str, unit: str = "tok"):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, disable=not self.progress, leave=False, dynamic_ncols=True)

    def model_sha256(self) -> str:
        if self._model_sha256 is None:
            self._model_sha256 = model_fingerprint(self.model)
        return self._model_sha256

    def _stats_sha256(self) -> str | None:
        if self.stats_path is not None and Path(self.stats_path).is_file():
            return file_sha256(self.stats_path)
        if self.stats is not None:  # statistics passed in memory: their tensors
            hashed = hashlib.sha256()
            for tensor in (self.stats.q_mean.real, self.stats.q_mean.imag, self.stats.q_abs_mean):
                hashed.update(tensor.detach().double().cpu().contiguous().numpy().tobytes())
            return hashed.hexdigest()
        return None

    def identity(self) -> dict:
        """The fingerprint fields every cell of this run shares: what the model, tokenizer, statistics and code
        were, and the dtype, threads, device and versions it ran on (`commit`: where the code came from)."""
        import transformers

        files = code_files()
        return {"model_sha256": self.model_sha256(), "tokenizer_sha256": tokenizer_sha256(self.tokenizer),
                "stats_sha256": self._stats_sha256(), "code_sha256": code_sha256(files), "commit": git_commit(files),
                "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
                "threads": torch.get_num_threads(), "device": str(next(self.model.parameters()).device),
                "torch": torch.__version__, "transformers": transformers.__version__}

    # ---- tasks
    def run(self) -> dict:
        started = time.perf_counter()
        torch.manual_seed(self.config.seed)
        self._load()
        self.units.identity = self.identity()
        results = {}
        for task in self.config.tasks:
            task_started = time.perf_counter()
            results.update(getattr(self, f"_run_{task}")())
            self.log(f"[{task}] done in {time.perf_counter() - task_started:.0f} s")
        self.unit_seconds = self._save_timings()
        record = self._record(results, time.perf_counter() - started)
        write_outputs(record, self.out)
        return record

    def _grid_seconds(self) -> float:
        """Compute time of every unit of this run's grid, over all invocations (cells the folder holds for other
        methods or budgets are left out)."""
        budgets = {str(b) for b in self.config.budgets} | {"None"}
        def in_grid(key: str) -> bool:
            parts = key.split("/")
            return len(parts) < 3 or (parts[-2] in self.config.methods and parts[-1] in budgets)
        return sum(seconds for key, seconds in self.unit_seconds.items() if in_grid(key))

    def _save_timings(self) -> dict[str, float]:
        """Merge this invocation's unit times into units/timings.json (seconds per unit over every invocation of
        the run); saved after every cell, so a run stopped midway keeps the times of the cells it finished."""
        timings = self.out / "units" / "timings.json"
        merged = json.loads(timings.read_text()) if timings.exists() else {}
        merged.update(self.unit_seconds)
        timings.parent.mkdir(parents=True, exist_ok=True)
        timings.write_text(json.dumps(merged, indent=1))
        return merged

    def _timed(self, key: str, fn):
        from ..speed.machine import release_free_memory

        started = time.perf_counter()
        value = fn()
        self.unit_seconds[key] = time.perf_counter() - started
        self._save_timings()
        # a cell's caches (batch-sized, a different size for every method) are garbage now; handing their pages
        # back keeps the next cell from growing the heap further when many cells run in one process
        release_free_memory()
        return value

    def _fidelity_texts(self) -> tuple[list[str], list[list[int]], list[int]]:
        """(names, token ids, prompt lengths) of the run's texts: shipped and own texts cut to --text-tokens with
        the first --prompt-tokens as the prompt; the model's reasoning traces behind their own chat prompt, each
        with --trace-tokens tokens of the model's text after it."""
        from .texts import load_texts, text_from_file, text_token_ids
        from .traces import load_traces

        c = self.config
        shipped = {t.name: t for t in load_texts()}
        missing = [name for name in c.texts if name not in shipped]
        if missing:
            raise ValueError(f"unknown fidelity text(s) {missing}; shipped: {', '.join(shipped)}")
        texts = [shipped[name] for name in c.texts] + [text_from_file(path) for path in c.text_files]
        shipped_traces = load_traces(c.model, c.traces) if c.traces else []
        # only the traces that pass the validity rule are fed (all of them in files written before the rule)
        self.trace_validity = {trace.name: trace.validity for trace in shipped_traces}
        traces = [trace.as_text() for trace in shipped_traces if trace.valid or trace.validity is None]
        if shipped_traces and not traces:
            raise ValueError(f"none of {c.model}'s {c.traces} traces passes the validity rule; write them again "
                             "(python -m trikv.benchmarks.quality.traces)")
        names = [text.name for text in texts + traces]
        from .texts import texts_sha256

        self.fed_texts_sha256 = texts_sha256(texts + traces)
        if len(set(names)) != len(names):
            raise ValueError(f"two fidelity texts share a name ({', '.join(names)}); rename the file")
        token_lists = [text_token_ids(text, self.tokenizer) for text in texts]
        short = [(text.name, len(ids)) for text, ids in zip(texts, token_lists) if len(ids) < c.text_tokens]
        if short:
            raise ValueError(f"fidelity texts must hold at least --text-tokens {c.text_tokens} tokens; "
                             + ", ".join(f"{name} has {count}" for name, count in short))
        ids = [tokens[: c.text_tokens] for tokens in token_lists]
        prompts = [c.prompt_tokens] * len(ids)
        for trace in traces:
            prompt = len(text_token_ids(dataclasses.replace(trace, text=""), self.tokenizer))
            tokens = text_token_ids(trace, self.tokenizer)
            if len(tokens) - prompt < c.trace_tokens:
                raise ValueError(f"trace {trace.name} holds {len(tokens) - prompt} tokens after its prompt, fewer than "
                                 f"--trace-tokens {c.trace_tokens}")
            ids.append(tokens[: prompt + c.trace_tokens])
            prompts.append(prompt)
        return names, ids, prompts

    def _run_fidelity(self) -> dict:
        from .fidelity import FidelitySuite
        from ...prompts import is_instruct
        from .intervals import add_composition_intervals, add_fidelity_intervals, add_recall_intervals

        c = self.config
        names, ids, prompts = self._fidelity_texts()
        self.units.expect("fidelity", digest([names, ids, prompts]), self.fed_texts_sha256)
        suite = FidelitySuite(self.model, ids, prompts, c.max_chunk, c.recall_stride, c.horizons)
        cells = [cell for cell in self.cells() if cell[0] != "full"]
        recall_todo = [cell for cell in cells if self.units.get("recall", *cell) is None]
        todo = [cell for cell in cells if self.units.get("fidelity", *cell) is None
                or (cell in recall_todo and self.units.get_tensor("fidelity", *cell) is None)]
        fidelity, recall = {}, {}
        oracle_todo = bool(self._oracle_schedules())  # an earlier run wrote every method but not the oracle
        if todo or recall_todo or oracle_todo or self.units.get("fidelity", "full", None) is None:
            bar = self._bar(suite.tokens, "reference (full attention)")
            self._timed("reference", lambda: suite.run_reference(progress=bar.update, recall=bool(recall_todo or oracle_todo)))
            bar.close()
            self.units.put("fidelity", "full", None, suite.full_fidelity())
            self.units.put("recall", "full", None, {"recall": 1.0, "recall_min_head": 1.0, "by_horizon": {}})
        for budget in sorted({budget for _, budget in todo}):
            fits = prompt_fits(torch.tensor(prompts), budget, c.min_decode_room) & c.protect_prompt
            self.log(f"  B={budget}: prompt protected in {int(fits.sum())} of {len(prompts)} texts "
                     f"(prompt + {c.min_decode_room} <= budget; the others' prompts compete for the budget)")
        for method, budget in todo:
            bar = self._bar(suite.tokens, f"fidelity {method} B={budget}")
            torch.manual_seed(c.seed)
            with _quiet("trikv.cache"):  # each text's cache would repeat the protection line above
                metrics, log = self._timed(f"fidelity/{method}/{budget}",
                                           lambda: suite.run_method(lambda: self.make_cache(method, budget), progress=bar.update))
            bar.close()
            metrics["seconds"] = self.unit_seconds[f"fidelity/{method}/{budget}"]
            metrics["round_times"] = [list(batch["round_times"]) for batch in log["batches"]]
            self.units.put_tensor("fidelity", method, budget, {"batches": [
                {"evict_time": batch["evict_time"], "round_times": batch["round_times"]} for batch in log["batches"]]})
            self.units.put("fidelity", method, budget, metrics)
            compressed = metrics["compressed"]
            self.log(f"  fidelity {method:>14} B={budget:<5} compressed positions: agreement {compressed['top1_agreement']:.3f}  "
                     f"KL {compressed['kl']:.4f}  ppl ratio {compressed['perplexity_ratio']:.3f}  {metrics['seconds']:.0f} s")
        oracles = self._oracle_schedules()
        if recall_todo or oracles:
            logs = {cell: self.units.get_tensor("fidelity", *cell) for cell in recall_todo}
            started = time.perf_counter()
            values = suite.recall(logs, oracles=oracles)
            self.unit_seconds["recall"] = time.perf_counter() - started
            for cell, value in values.items():
                self.units.put_tensor("recall-rows", *cell, value.pop("rows"))
                self.units.put("recall", *cell, value)
                self.units.drop_tensor("fidelity", *cell)  # the eviction log is only needed until recall is written
        for method, budget in self.cells():
            fidelity.setdefault(method, {})[budget_key(method, budget)] = self.units.get("fidelity", method, budget)
            recall.setdefault(method, {})[budget_key(method, budget)] = self.units.get("recall", method, budget)
        for budget in c.budgets:
            oracle = self.units.get("recall", "oracle", budget)
            if oracle is not None:
                recall.setdefault("oracle", {})[str(budget)] = oracle
        add_fidelity_intervals(fidelity, seed=c.seed)
        add_composition_intervals(fidelity, seed=c.seed)
        add_recall_intervals(recall, {(method, budget): self.units.get_tensor("recall-rows", method, budget)
                                      for method, budget in self.cells() + [("oracle", b) for b in c.budgets]},
                             horizons=c.horizons, seed=c.seed)
        meta = {"texts": names, "tokens_per_text": c.text_tokens, "prompt_tokens": c.prompt_tokens,
                "prompt_lengths": prompts, "text_lengths": [len(tokens) for tokens in ids],
                "traces": c.traces, "trace_tokens": c.trace_tokens if c.traces else None}
        if c.traces:
            meta["trace_validity"] = self.trace_validity
            meta["trace_frame"] = "chat template" if is_instruct(self.tokenizer) else "plain completion prompt"
        if self.stats is not None:  # the statistics' query concentration (mean R over bands and heads) per layer
            meta["concentration_per_layer"] = [round(float(x), 5) for x in self.stats.head_concentration().mean(-1)]
            meta["concentration_per_head"] = [[round(float(x), 5) for x in row] for row in self.stats.head_concentration()]
        return {"fidelity": {"meta": meta, "methods": fidelity}, "recall": {"meta": meta | {"horizons": c.horizons, "query_stride": c.recall_stride}, "methods": recall}}

    def _prefill_windows(self) -> tuple[list[str], list[list[int]]]:
        """(names, token ids) of non-overlapping windows of prompt + continuation tokens cut from the run's texts."""
        from .texts import load_texts, text_from_file, text_token_ids

        c = self.config
        shipped = {t.name: t for t in load_texts()}
        missing = [name for name in c.texts if name not in shipped]
        if missing:
            raise ValueError(f"unknown text(s) {missing}; shipped: {', '.join(shipped)}")
        width = c.prefill_prompt_tokens + c.prefill_continuation_tokens
        names, windows = [], []
        sources = [shipped[name] for name in c.texts] + [text_from_file(path) for path in c.text_files]
        from .texts import texts_sha256

        self.prefill_texts_sha256 = texts_sha256(sources)
        for text in sources:
            ids = text_token_ids(text, self.tokenizer)
            for index, start in enumerate(range(0, len(ids) - width + 1, width)):
                names.append(f"{text.name}#{index}")
                windows.append(ids[start : start + width])
        if len(windows) < 2:
            raise ValueError(f"the texts hold {len(windows)} window(s) of {width} tokens; the prefill task's intervals "
                             "need at least 2 (more texts, or a shorter --prefill-prompt-tokens)")
        return names, windows

    def _run_prefill(self) -> dict:
        """Per (method, budget): the continuation's fidelity when the prompt was compacted while it was prefilled
        (the cache's prefill chunks, a round between chunks) and when it was prefilled whole and compacted at the
        first decode step; paired per window."""
        from .fidelity import FidelitySuite
        from .intervals import add_fidelity_intervals, paired_fidelity_difference

        c = self.config
        names, windows = self._prefill_windows()
        self.units.expect("prefill", digest([names, windows]), self.prefill_texts_sha256)
        suite = FidelitySuite(self.model, windows, [c.prefill_prompt_tokens] * len(windows), c.max_chunk)
        cells = [cell for cell in self.cells() if cell[0] != "full"]
        todo = [(mode, cell) for cell in cells for mode in ("during", "after")
                if self.units.get(f"prefill-{mode}", *cell) is None]
        if todo:
            bar = self._bar(suite.tokens, "prefill reference (full attention)")
            self._timed("prefill-reference", lambda: suite.run_reference(progress=bar.update, recall=False))
            bar.close()

        def make(method, budget):
            from ...cache import make_cache

            return make_cache(self.model, method, budget=budget, divide_length=c.divide_length,
                              protect_prompt=c.protect_prompt, min_decode_room=c.min_decode_room,
                              prefill_chunk_size=c.prefill_chunk, **self.method_options(method))

        for mode, (method, budget) in todo:
            bar = self._bar(suite.tokens, f"prefill {mode} {method} B={budget}")
            torch.manual_seed(c.seed)
            with _quiet("trikv.cache"), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "after" feeds the long prompt whole on purpose
                metrics, _ = self._timed(f"prefill-{mode}/{method}/{budget}", lambda: suite.run_method(
                    lambda: make(method, budget), progress=bar.update, prompt_chunks=mode == "during"))
            bar.close()
            metrics["seconds"] = self.unit_seconds[f"prefill-{mode}/{method}/{budget}"]
            self.units.put(f"prefill-{mode}", method, budget, metrics)
            self.log(f"  prefill {mode:>6} {method:>14} B={budget:<5} KL {metrics['kl']:.4f}  agreement "
                     f"{metrics['top1_agreement']:.3f}  peak entries {metrics['peak_entries']}  {metrics['seconds']:.0f} s")
        table = {}
        for method, budget in cells:
            key = budget_key(method, budget)
            modes = {mode: self.units.get(f"prefill-{mode}", method, budget) for mode in ("during", "after")}
            for mode, metrics in modes.items():
                table.setdefault(mode, {}).setdefault(method, {})[key] = metrics
        for mode in table:
            add_fidelity_intervals(table[mode], seed=c.seed)
        differences = {method: {key: paired_fidelity_difference(table["during"][method][key], table["after"][method][key],
                                                                seed=c.seed)
                                for key in table["during"][method]} for method in table.get("during", {})}
        meta = {"windows": names, "prompt_tokens": c.prefill_prompt_tokens,
                "continuation_tokens": c.prefill_continuation_tokens, "prefill_chunk": c.prefill_chunk}
        return {"prefill": {"meta": meta, "during": table.get("during", {}), "after": table.get("after", {}),
                            "during_minus_after": differences}}

    def _oracle_schedules(self) -> dict:
        """{("oracle", budget): (round times per batch of texts, budget)} for budgets whose oracle recall is not
        written yet.

        The oracle (future-attention selection) follows the compression schedule of triattention at that budget
        (every method on the shared trigger has the same one), else of the first method that has a recorded
        schedule."""
        schedules = {}
        for budget in self.config.budgets:
            if self.units.get("recall", "oracle", budget) is not None:
                continue
            order = sorted((m for m in self.config.methods if m != "full"), key=lambda m: m != "triattention")
            for method in order:
                unit = self.units.get("fidelity", method, budget)
                if unit is not None and any(unit.get("round_times") or []):
                    schedules[("oracle", budget)] = (unit["round_times"], budget)
                    break
        return schedules

    def _run_dfs(self) -> dict:
        from . import dfs

        c = self.config
        graphs = dfs.make_graphs(c.dfs_graphs, c.seed, c.dfs_min_nodes, c.dfs_max_nodes, min_steps=max(c.dfs_ks))
        self.units.expect("dfs", digest([graphs, c.dfs_ks, c.dfs_prompt]))
        out = {"meta": {"graphs": [{"kind": g.kind, "nodes": g.n, "edges": len(g.edges), "steps": len(g.states) - 1,
                                    "seed": g.seed} for g in graphs], "ks": c.dfs_ks, "mode": c.dfs_mode}}
        modes = ["teacher-forced", "generative"] if c.dfs_mode == "both" else [c.dfs_mode]
        for mode in modes:
            task = "dfs-tf" if mode == "teacher-forced" else "dfs-gen"
            table = {}
            for method, budget in self.cells():
                unit = self.units.get(task, method, budget)
                if unit is None:
                    torch.manual_seed(c.seed)
                    if mode == "teacher-forced":
                        total = sum(len(g.states) * 8 + 300 for g in graphs)
                        bar = self._bar(total, f"dfs {method} B={budget}")
                        records = self._timed(f"{task}/{method}/{budget}", lambda: dfs.run_teacher_forced(
                            self.model, self.tokenizer, lambda: self.make_cache(method, budget), graphs, c.dfs_ks,
                            c.max_chunk, progress=bar.update, full_records=self._full_records(task),
                            eviction_threshold=self._threshold(budget), prompt=c.dfs_prompt))
                        bar.close()
                    else:
                        records = self._timed(f"{task}/{method}/{budget}", lambda: dfs.run_generative(
                            self.model, self.tokenizer, method, budget, self.generation_options(method), graphs, c.dfs_ks,
                            divide_length=c.divide_length))
                    unit = {"summary": dfs.summarise(records), "records": records,
                            "seconds": self.unit_seconds[f"{task}/{method}/{budget}"]}
                    self.units.put(task, method, budget, unit)
                    s = unit["summary"]
                    self.log(f"  {task} {method:>14} B={budget}  node {s['node']:.2f} stack {s['stack']:.2f} "
                             f"visited {s['visited']:.2f} all {s['all']:.2f}  {unit['seconds']:.0f} s")
                table.setdefault(method, {})[budget_key(method, budget)] = unit["summary"]
            out[task] = table
        return {"dfs": out}

    def _run_needle(self) -> dict:
        from . import needle

        c = self.config
        items = needle.make_items(self.tokenizer, c.needle_lengths, c.needle_depths, c.seed, c.needle_keys)
        self.units.expect("needle", digest([[list(item.input_ids), list(item.answer_ids)] for item in items]))
        table = {}
        for method, budget in self.cells():
            unit = self.units.get("needle", method, budget)
            if unit is None:
                bar = self._bar(sum(len(i.input_ids) + len(i.answer_ids) for i in items), f"needle {method} B={budget}")
                records = self._timed(f"needle/{method}/{budget}", lambda: needle.run_needle(
                    self.model, lambda: self.make_cache(method, budget, protect_prompt=False), items, c.max_chunk,
                    progress=bar.update, full_records=self._full_records("needle"), eviction_threshold=self._threshold(budget)))
                bar.close()
                unit = {"summary": needle.summarise(records), "records": records, "seconds": self.unit_seconds[f"needle/{method}/{budget}"]}
                self.units.put("needle", method, budget, unit)
                self.log(f"  needle {method:>14} B={budget}  accuracy {unit['summary']['accuracy']:.2f}  "
                         f"needle kept {unit['summary']['needle_in_cache']:.2f}  {unit['seconds']:.0f} s")
            table.setdefault(method, {})[budget_key(method, budget)] = unit["summary"]
        return {"needle": {"meta": {"lengths": c.needle_lengths, "depths": c.needle_depths, "keys_per_cell": c.needle_keys},
                           "methods": table}}

    def _run_math(self) -> dict:
        from ..speed.machine import current_rss
        from . import math_task
        from .intervals import add_math_intervals

        c = self.config
        out = {"meta": {"datasets": c.math_datasets, "limit": c.math_limit, "problems": c.math_problems, "samples": c.math_samples,
                        "max_new_tokens": c.math_max_new_tokens, "temperature": c.math_temperature,
                        "top_p": 0.95 if c.math_temperature > 0 else None, "engine": c.math_engine,
                        "problems_per_batch": c.math_batch, "dtype": c.dtype, "min_decode_room": c.min_decode_room,
                        "excluded_rows": {d: sorted(math_task.reserved_rows(d)) for d in c.math_datasets}}}
        for dataset in c.math_datasets:
            problems = math_task.load_problems(dataset, c.math_limit, ids=c.math_problems)
            # a cell holds answers by problem id and a run may extend it with more problems: the whole dataset's
            # prompts and answers, not which of them this run asks, decide whether its answers can be reused
            self.units.expect(f"math-{dataset}", digest([(p["id"], p["prompt"], p["answer"])
                                                         for p in math_task.load_problems(dataset)]))
            table = {}
            for method, budget in self.cells():
                name = f"math-{dataset}"
                unit = self.units.get(name, method, budget)
                done = [] if unit is None else unit["records"]
                if c.math_temperature == 0:
                    # greedy: a problem is answered again only when it is missing or its answer was cut short by a
                    # lower cap than this run's. Greedy needs no seed; in a new batch a reduced-precision answer can
                    # still change (sums run in another order), which is why the report counts answers per cap
                    cut_short = {r["id"] for r in done
                                 if r["max_new_tokens"] < c.math_max_new_tokens and r["tokens"] >= r["max_new_tokens"]}
                    answered = {r["id"] for r in done} - cut_short
                    done = [r for r in done if r["id"] in answered]
                    todo = [p for p in problems if p["id"] not in answered]
                    start = problems.index(todo[0]) if todo else len(problems)
                else:
                    answered = {r["id"] for r in done}
                    # a run with more problems than the cell holds answers only the missing ones when they follow
                    # the answered ones (as after a smaller --limit): their seeds then match a fresh run's
                    start = next((i for i, p in enumerate(problems) if p["id"] not in answered), len(problems))
                    if any(p["id"] in answered for p in problems[start:]):
                        done, start = [], 0
                    todo = problems[start:]
                if todo:
                    bar = self._bar(len(todo), f"{name} {method} B={budget}", unit="problem")
                    records = self._timed(f"{name}/{method}/{budget}", lambda: math_task.run_math(
                        self.model, self.tokenizer, method, budget, self.generation_options(method), todo, c.math_samples,
                        c.math_max_new_tokens, c.seed, temperature=c.math_temperature, divide_length=c.divide_length,
                        engine=c.math_engine, problems_per_batch=c.math_batch, progress=bar.update, first_index=start))
                    bar.close()
                    order = {p["id"]: i for i, p in enumerate(problems)}
                    records = sorted(done + records, key=lambda r: order.get(r["id"], len(order)))
                    earlier_seconds = unit["seconds"] if done else 0.0
                    unit = {"summary": math_task.summarise(records), "records": records,
                            "seconds": earlier_seconds + self.unit_seconds[f"{name}/{method}/{budget}"]}
                    self.unit_seconds[f"{name}/{method}/{budget}"] = unit["seconds"]  # the whole cell, not this part
                    self._save_timings()
                    self.units.put(name, method, budget, unit)
                    self.log(f"  {name} {method:>14} B={budget}  pass@1 {unit['summary']['pass@1']:.3f}"
                             f" ({len(todo)} of {len(problems)} problems answered now; resident {current_rss() / 2**30:.1f} GiB)")
                elif "seconds" in unit:  # a finished cell holds its own time, also when the timings file does not
                    self.unit_seconds.setdefault(f"{name}/{method}/{budget}", unit["seconds"])
                wanted = {p["id"] for p in problems}
                table.setdefault(method, {})[budget_key(method, budget)] = math_task.summarise(
                    [r for r in unit["records"] if r["id"] in wanted])
            add_math_intervals(table, seed=c.seed)
            out[dataset] = table
        return {"math": out}

    # ---- record
    def _record(self, results: dict, seconds: float) -> dict:
        import transformers

        from ... import __version__

        model_info = {"name": self.config.model, "sha256_parameters": self.model_sha256(),
                      "class": type(self.model).__name__, "dtype": str(next(self.model.parameters()).dtype),
                      "parameters": sum(p.numel() for p in self.model.parameters())}
        stats_info = None
        if self.stats_path is not None and Path(self.stats_path).is_file():
            stats_info = {"path": str(self.stats_path), "sha256": file_sha256(self.stats_path)}
        elif self.stats is not None:
            stats_info = {"path": None, "note": "statistics passed in memory", "tokens": self.stats.metadata.get("token_count")}
        return {
            "format": FORMAT,
            "benchmark": "quality",
            "trikv_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["trikv"] + sys.argv[1:]) if Path(sys.argv[0]).name in ("trikv", "__main__.py") else None,
            "config": dataclasses.asdict(self.config),
            "config_fingerprint": self.config.fingerprint(),
            "model": model_info,
            "stats": stats_info,
            "seeds": {"seed": self.config.seed, "dfs_graphs": self.config.seed, "needle_keys": self.config.seed,
                      "math_sampling": f"{self.config.seed} + problem index"},
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "threads": torch.get_num_threads(),
                            "device": str(next(self.model.parameters()).device), "platform": platform.platform()},
            "fingerprint": {**(self.units.identity or {}), "inputs": self.units.inputs},
            "cells": self.units.status,  # "task/method/budget" -> computed now / reused (with its fingerprint) / not reused
            "wall_seconds": seconds,  # this invocation (a resumed run reuses earlier units)
            "compute_seconds": self._grid_seconds(),
            "unit_seconds": self.unit_seconds,
            "results": results,
        }


def write_outputs(record: dict, out: Path) -> None:
    from .pages.plots import plot_run
    from .pages.tables import csv_rows, text_tables

    out = Path(out)
    (out / "results.json").write_text(json.dumps(record, indent=1, default=_json_default))
    rows = csv_rows(record)
    with (out / "results.csv").open("w") as handle:
        handle.write("task,method,budget,metric,group,value\n")
        for row in rows:
            handle.write(",".join(str(x) for x in row) + "\n")
    plot_run(record, out)
    (out / "tables.txt").write_text(text_tables(record))


def run_quality(config: QualityConfig, out: str | Path, **kwargs) -> dict:
    return QualityRun(config, out, **kwargs).run()
