"""Finished benchmark cells are reused only when what produced them is what the run would use now."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_model
from stats_fixtures import tiny_stats

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trikv.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


def _write_traces(folder, texts):
    rows = [{"name": f"math500-{400 + i}", "split": "evaluation", "prompt": f"Problem {i}: add the numbers.",
             "text": text, "tokens": 200, "seeds": [0], "source": "test"} for i, text in enumerate(texts)]
    (folder / "tiny.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def trace_run(tmp_path, tokenizer, monkeypatch):
    """A fidelity run on a tiny model's own (test-written) trace set, and the means to run it again."""
    from trikv.benchmarks.quality import traces
    from trikv.benchmarks.quality.runner import config_from_preset, run_quality

    monkeypatch.setattr(traces, "TRACES_DIR", tmp_path)
    words = "the cat sat on a mat while two dogs ran past the old barn and a bird sang".split()
    texts = [" ".join(words[(i * 7 + j) % len(words)] + f" {j % 9}" for j in range(180)) for i in range(2)]
    _write_traces(tmp_path, texts)
    model = tiny_model(vocab_size=len(tokenizer))
    stats = tiny_stats(model)
    config = config_from_preset("quick", tasks=["fidelity"], model="tiny", traces="evaluation", trace_tokens=80,
                                methods=["full", "triattention"], budgets=[48], divide_length=16)
    lines: list[str] = []

    def run(**options):
        lines.clear()
        kwargs = dict(model=model, tokenizer=tokenizer, stats=stats, progress=False, log=lines.append) | options
        return run_quality(config, tmp_path / "run", **kwargs)

    return run, lines, texts, tmp_path


def _statuses(record):
    return {key: cell["status"] for key, cell in record["cells"].items() if key.startswith(("fidelity/", "recall/"))}


def test_a_cell_made_from_other_trace_text_is_not_reused(trace_run):
    run, lines, texts, folder = trace_run
    first = run()
    assert set(_statuses(first).values()) == {"computed"}
    fingerprint = first["fingerprint"]
    assert fingerprint["threads"] == torch.get_num_threads() and fingerprint["dtype"] == "float32"
    assert len(fingerprint["code_sha256"]) == 64 and fingerprint["inputs"]["fidelity"]["texts_sha256"]
    again = run()
    assert set(_statuses(again).values()) == {"reused"}, _statuses(again)
    assert any(line.startswith("  reused fidelity/triattention/48: fingerprint matches") for line in lines), lines
    # the shipped traces are written again (one word changed): the run's configuration is the same, its cells are not
    _write_traces(folder, [texts[0].replace("cat", "dog", 1), texts[1]])
    changed = run()
    assert set(_statuses(changed).values()) == {"computed"}, _statuses(changed)
    assert any("not reused fidelity/triattention/48: its fingerprint differs in inputs_sha256, texts_sha256" in line
               for line in lines), lines
    assert changed["fingerprint"]["inputs"]["fidelity"] != first["fingerprint"]["inputs"]["fidelity"]


def test_threads_code_and_unrecorded_cells_are_not_reused(trace_run, monkeypatch):
    from trikv.benchmarks.quality import runner

    run, lines, _, folder = trace_run
    run()
    previous = torch.get_num_threads()
    torch.set_num_threads(previous + 1)
    try:
        assert set(_statuses(run()).values()) == {"computed"}
        assert any("differs in threads" in line for line in lines), lines
    finally:
        torch.set_num_threads(previous)
    monkeypatch.setattr(runner, "code_sha256", lambda files=None: "0" * 64)
    assert set(_statuses(run()).values()) == {"computed"}
    assert any("differs in code_sha256" in line for line in lines), lines
    # cells written before cells recorded a fingerprint: recomputed, unless the run is told to reuse them (and says so)
    for path in (folder / "run" / "units").glob("*.json"):
        if path.name != "timings.json":
            unit = json.loads(path.read_text())
            unit.pop("fingerprint", None)
            path.write_text(json.dumps(unit))
    assert set(_statuses(run(reuse_unrecorded=True)).values()) == {"reused, fingerprint not recorded"}
    assert any("written before cells recorded a fingerprint" in line for line in lines), lines
    assert set(_statuses(run()).values()) == {"computed"}


def test_code_files_leave_out_what_a_quality_run_never_imports():
    from trikv.benchmarks.quality.runner import PACKAGE_DIR, code_files

    names = {path.relative_to(PACKAGE_DIR).as_posix() for path in code_files()}
    assert {"cache.py", "policies/triattention.py", "benchmarks/quality/fidelity.py", "benchmarks/quality/runner.py"} <= names
    assert not any(name.startswith(("vllm/", "mlx/", "analysis/", "benchmarks/speed/")) for name in names)
    assert not {"benchmarks/quality/report.py", "cli.py", "demo.py"} & names
    assert not any(name.startswith("benchmarks/quality/pages/") for name in names)  # the page's sections format only
    assert "benchmarks/quality/cli.py" in names  # what turns the arguments into the run's configuration
