"""The agent benchmark's parts: sessions built from real source files with answers read by Python's parser, the
memory limit that ends full attention's session where its KV passes it while a bounded method completes under it,
and the page rendered from the cells (the full runs on Qwen2.5-Coder are benchmarks, docs/agent.md)."""

from __future__ import annotations

import ast
import json
import re

import pytest
import torch

import trikv
from trikv.benchmarks.agent import backends, tasks
from trikv.benchmarks.agent.cli import REFERENCE, Cells, _fingerprint
from trikv.benchmarks.agent.report import write_report

from helpers import tiny_model
from stats_fixtures import tiny_stats

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return trikv.load_model("smollm2-135m")[1]


def test_sessions_ask_what_their_chunks_hold_and_are_reproducible(tokenizer):
    session = tasks.make_session(3, tokenizer, steps=6, chunk_tokens=300)
    again = tasks.make_session(3, tokenizer, steps=6, chunk_tokens=300)
    assert session.to_json() == again.to_json()
    assert session.to_json() != tasks.make_session(4, tokenizer, steps=6, chunk_tokens=300).to_json()
    assert len(session.messages) == 2 * 6 - 1 and len({chunk.path for chunk in session.chunks}) == 6
    for chunk in session.chunks:  # whole lines of the file as it is on disk
        lines = (tasks.stdlib_dir() / chunk.path).read_text().splitlines(keepends=True)
        assert chunk.text == "".join(lines[chunk.first_line - 1 : chunk.last_line])
    for message in session.messages:
        question = message.question
        assert question.chunk == message.step - message.distance and 0 <= message.distance <= 5
        chunk = session.chunks[question.chunk]
        assert f"`{chunk.path}`" in question.text and f"`{question.subject}`" in question.text
        if message.distance == 0:
            assert message.text.startswith(f'Tool result of read_file("{chunk.path}", lines {chunk.first_line}-')
        # the answer is in the asked chunk: a def with those parameters, or the assignment of that literal
        if question.kind == "params":
            signature = re.search(rf"def {re.escape(question.subject)}\((.*?)\)\s*(->[^:]*)?:", chunk.text, re.S)
            assert signature and all(re.search(rf"\b{name}\b", signature.group(1)) for name in question.expected)
        else:
            assignment = re.search(rf"^\s*{re.escape(question.subject)}\s*=\s*(.+?)\s*(#.*)?$", chunk.text, re.M)
            assert assignment and ast.literal_eval(assignment.group(1)) == ast.literal_eval(question.expected[0])
    # a right answer names exactly the expected set; a partial, a longer or a different one is wrong
    params = next(m.question for m in session.messages if m.question.kind == "params")
    assert params.is_right(", ".join(reversed(params.expected)))
    assert not params.is_right(", ".join(params.expected[:-1]))
    assert not params.is_right(", ".join(params.expected + ("extra",)))
    assert not params.is_right(", ".join(name + "x" for name in params.expected))


def test_no_session_asks_a_fact_twice(tokenizer):
    """The bench's sessions (its default seeds, steps and chunk size): every question asks a fact no earlier question
    of the session asked, recalls included, so no answer can be echoed from the conversation; recalls still reach
    back 1 .. 8 chunks, and every chunk defines at least MIN_FACTS facts."""
    from trikv.benchmarks.agent.cli import add_arguments
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    for seed in range(defaults.sessions):
        session = tasks.make_session(seed, tokenizer, steps=defaults.steps, chunk_tokens=defaults.chunk_tokens)
        asked = [(m.question.chunk, m.question.subject) for m in session.messages]
        assert len(set(asked)) == len(asked), f"session {seed} asks a fact twice"
        recalls = [m for m in session.messages if m.distance > 0]
        assert len(recalls) == defaults.steps - 1 and all(1 <= m.distance <= 8 for m in recalls)
        for chunk in session.chunks:
            source = ast.parse((tasks.stdlib_dir() / chunk.path).read_text())
            inside = [fact for fact in tasks._facts(source) if chunk.first_line <= fact[3] <= chunk.last_line]
            assert len(inside) >= tasks.MIN_FACTS


@pytest.mark.parametrize("answer, right", [
    ("path, mode", True), ("mode, path", True), ("`path`, `mode`", True), ("path, mode.", True),
    ("path, mode=None", True), ("path: str, mode: int = 0", True), ("path, *, mode", True), ("path, mode, *args, **kwargs", True),
    ("open(path, mode)", True), ("self, path, mode", True), ("```\npath, mode\n```", True),
    ("path, mode\nThese are the parameters.", True),
    ("path", False), ("path, mode, names", False), ("The parameters are path and mode", False),
    ("The parameters are: path, mode", False), ("path mode", False), ("", False), ("paths, mode", False),
    ("Path, mode", False),
])
def test_the_params_judge_wants_the_exact_set(answer, right):
    question = tasks.Question("params", "open", ("path", "mode"), 0, "")
    assert question.is_right(answer) is right


@pytest.mark.parametrize("expected, answer, right", [
    (42, "42", True), (42, "X = 42", True), (42, "`42`.", True), (42, "0x2a", True), (42, "42.0", True),
    (0.5, ".5", True), ("utf-8", "utf-8", True), ("utf-8", "'utf-8'", True), ("utf-8", '"utf-8".', True),
    ("42", "42", True), ("...", "...", True),
    (42, "'42'", False), (42, "43", False), (42, "The value is 42", False), (42, "", False), (42, "420", False),
    ("utf-8", "utf8", False), ("utf-8", "'utf-8' (the default)", False), (2, "True", False),
])
def test_the_value_judge_wants_the_literal(expected, answer, right):
    question = tasks.Question("value", "X", (repr(expected),), 0, "")
    assert question.is_right(answer) is right


@pytest.fixture(scope="module")
def tiny_chat(tokenizer):
    """A tiny random llama over SmolLM2's vocabulary and chat template (its answers are noise, its memory is real)."""
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=32768)
    return model, tiny_stats(model, tokens=512)


def test_the_limit_ends_full_attention_and_a_bounded_method_completes_under_it(tokenizer, tiny_chat, tmp_path):
    model, stats = tiny_chat
    session = tasks.make_session(0, tokenizer, steps=4, chunk_tokens=200)
    per_token = 2 * 3 * 2 * 16 * 4  # K+V x layers x KV heads x head_dim x fp32
    limit_tokens = 600
    reference = backends.run_transformers(model, tokenizer, session, "full", None, None, max_new_tokens=4)
    assert reference["error"] is None and len(reference["records"]) == len(session.messages)
    answers = [record["answer"] for record in reference["records"]]
    full = backends.run_transformers(model, tokenizer, session, "full", None, limit_tokens * per_token, max_new_tokens=4,
                                     references=answers)
    failed_at = full["error"]["message"]
    # it fails at the first message whose prefill takes the conversation past the limit, not before
    assert reference["records"][failed_at - 1]["tokens"] <= limit_tokens < reference["records"][failed_at]["tokens"]
    assert "over the 0.44 MiB limit" in full["error"]["error"] and len(full["records"]) == failed_at
    assert all(record["agrees"] for record in full["records"])  # the same model and cache: the same answers
    bounded = backends.run_transformers(model, tokenizer, session, "triattention", 128, limit_tokens * per_token,
                                        stats=stats, max_new_tokens=4, references=answers)
    assert bounded["error"] is None and len(bounded["records"]) == len(session.messages)
    assert max(record["peak_bytes"] for record in bounded["records"]) <= (128 + 128 + 512) * per_token
    assert bounded["records"][-1]["rounds"] > 0
    # the page from these cells
    cells = Cells(tmp_path)
    settings = {"model": "tiny", "budget": 128, "limit_tokens": limit_tokens, "max_new_tokens": 4,
                "version": {"trikv": trikv.__version__, "commit": None}}
    for method, result in ((REFERENCE, reference), ("full", full), ("triattention", bounded)):
        cells.put("transformers", method, 0, _fingerprint({"method": method, **settings}), settings, result)
    assert cells.get("transformers", "full", 0, {"method": "other", **settings}) is None  # another fingerprint
    assert cells.get("transformers", "full", 0, {"method": "full", **settings}) == full and cells.reused == ["transformers-full-0.json"]
    # a cell of other code is reused only when asked for, and named with its commit
    later = {**settings, "version": {**settings["version"], "commit": "abc1234"}}
    assert cells.get("transformers", "full", 0, {"method": "full", **later}) is None
    lenient = Cells(tmp_path, reuse_other_code=True)
    assert lenient.get("transformers", "full", 0, {"method": "full", **later}) == full
    assert lenient.reused_other_code == {"transformers-full-0.json": None}
    assert lenient.get("transformers", "full", 0, {"method": "full", **{**later, "budget": 64}}) is None  # other settings
    (tmp_path / "agent.json").write_text(json.dumps({"config": {**settings, "sessions": 1, "steps": 4, "chunk_tokens": 200,
                                                                "kv_bytes_per_token": per_token,
                                                                "cap_bytes": limit_tokens * per_token}}))
    (tmp_path / "sessions.json").write_text(json.dumps([session.to_json()]))
    page = write_report([tmp_path], tmp_path / "agent.md").read_text()
    assert f"| transformers | full | 0/1 | at message {failed_at + 1} " in page
    assert "| transformers | triattention | 1/1 | - |" in page
    assert (tmp_path / "agent_files" / "kv_per_message.png").stat().st_size > 10_000


def test_a_model_without_16k_positions_is_refused():
    from trikv.cli import main

    with pytest.raises(SystemExit, match="smollm2-135m has 8192 trained positions; the agent case needs >= 16,384"):
        main(["bench", "agent", "--model", "smollm2-135m", "--out", "/tmp/trikv-agent-refused"])
    with pytest.raises(SystemExit, match=r"unknown backend\(s\) \['tpu'\]"):
        main(["bench", "agent", "--backends", "tpu"])
    torch.manual_seed(0)


def _agent_folder(root, bounded_right: bool, commit="c0ffee1+changes"):
    """A run folder of cells written here (no model): full attention ends at its second message, the bounded
    method and the uncapped reference answer both; the bounded method's answers are right or wrong."""
    def records(count, right):
        return [{"step": i, "distance": i, "right": right, "agrees": right, "peak_bytes": 2**20 * (i + 1),
                 "tokens": 500 * (i + 1), "ttft": 0.5} for i in range(count)]

    settings = {"model": "tiny", "budget": 128, "limit_tokens": 1000, "max_new_tokens": 4,
                "version": {"trikv": trikv.__version__, "commit": commit}}
    cells = root / "cells"
    cells.mkdir(parents=True, exist_ok=True)
    for method, result in (("full-unlimited", {"records": records(3, True), "error": None}),
                           ("full", {"records": records(1, True),
                                     "error": {"message": 1, "step": 1, "tokens": 1000, "error": "over the limit"}}),
                           ("triattention", {"records": records(3, bounded_right), "error": None})):
        (cells / f"transformers-{method}-0.json").write_text(json.dumps({"fingerprint": "f", "settings": settings,
                                                                          "result": result}))
    (root / "agent.json").write_text(json.dumps({"config": {**settings, "sessions": 1, "steps": 3, "chunk_tokens": 500,
                                                            "kv_bytes_per_token": 1024, "cap_bytes": 1000 * 1024}}))
    (root / "sessions.json").write_text(json.dumps([{"sources": {"python": "3.11"}, "messages": [{}, {}, {}]}]))
    return root


def test_agent_page_opens_with_its_title_commit_line_and_headline_box(tmp_path):
    """The title, 'Generated by ... from commit ...' (the cells' recorded commit), and a box computed from the cells:
    who completes under the limit and how many answers are right; the page checks no targets and says so."""
    folder = _agent_folder(tmp_path / "agent", bounded_right=True)
    lines = write_report([folder], tmp_path / "agent.md").read_text().splitlines()
    assert lines[0] == "# An agent session past a memory limit"
    assert re.fullmatch(r"Generated by `trikv bench agent-report \S+/agent --out \S+/agent\.md` on \d{4}-\d\d-\d\d from "
                        r"commit c0ffee1 \(with uncommitted changes\), as the run files record; do not edit by hand\.",
                        lines[2]), lines[2]
    assert lines[4] == ("> - measured: an agent session (tool results of source files, questions about them) past a KV "
                        "memory limit: tiny on transformers, limit 1,000 tokens, budget 128, 1 session")
    assert lines[5] == ("> - main figure: tiny, limit 1,000 tokens (transformers): full attention completes 0/1 sessions, "
                        "triattention completes 1/1 sessions, 100% of its answers right (uncapped full attention: 100%)")
    assert lines[6] == "> - no targets checked on this page"
    assert "MLX's matrix products ran on" not in "\n".join(lines)  # no MLX cells, no sentence about MLX's BLAS
    lines = write_report([_agent_folder(tmp_path / "agent", bounded_right=False)], tmp_path / "agent.md").read_text().splitlines()
    assert lines[5].endswith("triattention completes 1/1 sessions, 0% of its answers right (uncapped full attention: 100%)")


def test_the_page_names_the_blas_the_mlx_cells_recorded(tmp_path):
    """MLX's times depend on the BLAS its float32 products ran on: the page names what the MLX cells recorded."""
    folder = _agent_folder(tmp_path / "agent", bounded_right=True)
    cell = json.loads((folder / "cells" / "transformers-triattention-0.json").read_text())
    cell["settings"] |= {"dtype": "float32", "blas": "libmkl_rt.so.3"}
    (folder / "cells" / "mlx-triattention-0.json").write_text(json.dumps(cell))
    page = write_report([folder], tmp_path / "agent.md").read_text()
    assert "MLX's matrix products ran on `libmkl_rt.so.3` (mlx's Linux CPU wheel bundles the reference BLAS" in page


def _paired_folder(root, commit: str):
    """Two sessions of four questions: TriAttention right on 5 of 8, H2O on 6 of 8, the no-context control on
    questions 0 of each session only (answers from training)."""
    right = {"triattention": [[1, 1, 0, 1], [1, 0, 1, 0]], "h2o": [[1, 1, 1, 1], [1, 0, 1, 0]],
             "random": [[0, 0, 0, 0], [0, 0, 0, 0]], "no-context": [[1, 0, 0, 0], [1, 0, 0, 0]],
             "full-unlimited": [[1, 1, 1, 1], [1, 1, 1, 1]], "full": [[1], [1]]}
    settings = {"model": "tiny", "budget": 128, "limit_tokens": 1000, "max_new_tokens": 4,
                "version": {"trikv": trikv.__version__, "commit": commit}}
    (root / "cells").mkdir(parents=True)
    for method, sessions in right.items():
        for seed, answers in enumerate(sessions):
            records = [{"step": i, "distance": i, "right": bool(r), "agrees": None, "peak_bytes": 2**20, "tokens": 500 * (i + 1),
                        "ttft": 0.5} for i, r in enumerate(answers)]
            error = {"message": 1, "step": 1, "tokens": 1000, "error": "over the limit"} if method == "full" else None
            (root / "cells" / f"transformers-{method}-{seed}.json").write_text(json.dumps(
                {"fingerprint": "f", "settings": settings, "result": {"records": records, "error": error}}))
    (root / "agent.json").write_text(json.dumps({"config": {**settings, "sessions": 2, "steps": 2, "chunk_tokens": 500,
                                                            "kv_bytes_per_token": 1024, "cap_bytes": 1000 * 1024}}))
    (root / "sessions.json").write_text(json.dumps([{"sources": {"python": "3.11"}, "messages": [{}] * 4}] * 2))
    return root


def test_the_page_pairs_methods_over_questions_and_subtracts_what_needs_no_context(tmp_path):
    from trikv.benchmarks.agent.report import load_cells, paired_difference

    folder = _paired_folder(tmp_path / "agent", commit="c0ffee1")
    runs = load_cells(folder)["transformers"]
    point, interval, count = paired_difference(runs["triattention"], runs["h2o"])
    assert count == 8 and point == pytest.approx(-1 / 8) and interval[0] < point <= interval[1] <= 0
    page = write_report([folder], tmp_path / "agent.md").read_text()
    # TriAttention is right on 3 of the 6 questions the no-context control misses; H2O on 4
    assert "| transformers | triattention | 2/2 | - | 1.0 MiB | 62% [" in page and "] of 8 | 50% [" in page
    assert "| transformers | h2o | 2/2 | - | 1.0 MiB | 75% [" in page and "] of 8 | 67% [" in page
    assert "| transformers | triattention − h2o | -12.5 [" in page and "| triattention − random | +62.5 [" in page
    assert "| transformers | no context (each question alone, full attention) |" in page


def test_the_readme_row_names_the_best_bounded_method_and_skips_uncommitted_cells(tmp_path, monkeypatch):
    from trikv.benchmarks import readme

    monkeypatch.setattr(readme, "RUNS", tmp_path)
    _paired_folder(tmp_path / "agent", commit="c0ffee1")
    (row,) = readme._agent_rows()
    assert "| fails at message 2 of 3 | completes 2/2 sessions; TriAttention 62% answers right; best bounded: h2o 75% " \
           "(TriAttention − h2o: -12.5 [" in row and "points, paired over questions); full attention without a limit: 100% |" in row
    for seed in (0, 1):  # H2O below TriAttention: the row names TriAttention best and the runner-up's difference
        cell = json.loads((tmp_path / "agent" / "cells" / f"transformers-h2o-{seed}.json").read_text())
        for record in cell["result"]["records"]:
            record["right"] = False
        (tmp_path / "agent" / "cells" / f"transformers-h2o-{seed}.json").write_text(json.dumps(cell))
    (row,) = readme._agent_rows()
    assert "TriAttention 62% answers right, the best bounded method here (next: h2o 0%; TriAttention − h2o: +62.5 [" in row
    _paired_folder(tmp_path / "dirty" / "agent", commit="c0ffee1+changes")
    monkeypatch.setattr(readme, "RUNS", tmp_path / "dirty")
    assert readme._agent_rows() == []  # cells from a tree with uncommitted changes feed no row


def test_the_no_context_control_asks_each_question_alone(tokenizer, tiny_chat, monkeypatch):
    """Every question in a fresh conversation of the system message and the question: no tool result is read."""
    model, _ = tiny_chat
    session = tasks.make_session(0, tokenizer, steps=3, chunk_tokens=200)
    sent = []
    send = trikv.Session.send

    def recording_send(self, message, **options):
        sent.append((message, len(self.turns)))
        return send(self, message, **options)

    monkeypatch.setattr(trikv.Session, "send", recording_send)
    result = backends.run_no_context(model, tokenizer, session, max_new_tokens=2)
    assert [message for message, _ in sent] == [m.question.text for m in session.messages]
    assert all(turns == 0 for _, turns in sent) and "Tool result" not in "".join(m for m, _ in sent)
    assert len(result["records"]) == len(session.messages) and result["error"] is None


def _timed_cell(ttfts: list[float], prompt_tokens: list[int] | None = None, cached: list[int] | None = None) -> dict:
    """A cell whose messages took `ttfts`; on vLLM each message also records the prompt tokens sent and cached."""
    records = []
    for index, ttft in enumerate(ttfts):
        record = {"ttft": ttft, "tokens": 100 * (index + 1), "right": True, "agrees": True, "distance": 0,
                  "peak_bytes": 1}
        if prompt_tokens is not None:
            record |= {"prompt_tokens": prompt_tokens[index], "cached_tokens": cached[index]}
        records.append(record)
    return {"records": records, "error": None}


def test_session_reuse_targets_compare_each_session_with_the_transformers_session():
    from trikv.benchmarks.agent.report import reuse_comparison, reuse_targets

    conversation = [100, 200, 300]  # the prompt each message sends: the whole conversation so far
    runs = {"transformers": {"triattention": {0: _timed_cell([1.0, 0.5, 0.4]), 1: _timed_cell([1.0, 0.5, 0.5])}},
            # reuse: only each message's new 100 tokens are computed (300 of a 300-token conversation)
            "vllm": {"triattention": {0: _timed_cell([1.2, 0.6, 0.7], conversation, [0, 100, 200]),
                                      1: _timed_cell([1.2, 0.6, 0.9], conversation, [0, 100, 200])}},
            # stateless: everything again (600 of 300)
            "vllm-stateless": {"triattention": {0: _timed_cell([1.2, 2.0, 3.0], conversation, [0, 0, 0])}}}
    rows = reuse_comparison(runs)
    assert [r["seed"] for r in rows] == [0, 1]
    assert rows[0]["reuse_last"] == 0.7 and rows[0]["transformers_last"] == 0.4 and rows[0]["stateless_last"] == 3.0
    assert rows[0]["reuse_prefill"] == pytest.approx(1.0) and rows[0]["stateless_prefill"] == pytest.approx(2.0)
    assert rows[1]["stateless_prefill"] != rows[1]["stateless_prefill"]  # not run: NaN
    assert [ok for _, ok in reuse_targets(rows)] == [True, True]  # 0.7 <= 2 x 0.4, 0.9 <= 2 x 0.5; 1.0 <= 1.5
    runs["vllm"]["triattention"][1] = _timed_cell([1.2, 0.6, 1.1], conversation, [0, 0, 0])  # 1.1 > 2 x 0.5; 2.0 > 1.5
    assert [ok for _, ok in reuse_targets(reuse_comparison(runs))] == [False, False]
    assert [ok for _, ok in reuse_targets(reuse_comparison({"transformers": runs["transformers"]}))] == [None, None]


def test_the_readme_vllm_row_adds_what_session_reuse_buys(tmp_path, monkeypatch):
    """The vLLM row: the transformers row's figures for vLLM's cells, plus the last message's time to first token
    with reuse, stateless and on the transformers path (medians over sessions); a stateless cell from a dirty tree
    drops that part."""
    from trikv.benchmarks import readme

    monkeypatch.setattr(readme, "RUNS", tmp_path)
    folder = _paired_folder(tmp_path / "agent", commit="c0ffee1")
    conversation = [100, 200, 300, 400]
    for backend, method, ttfts, cached in (("vllm", "full", [0.5], [0]), ("vllm", "triattention", [1.0, 0.5, 0.5, 0.6], [0, 100, 200, 300]),
                                           ("vllm-stateless", "triattention", [1.0, 2.0, 3.0, 4.0], [0, 0, 0, 0])):
        for seed in (0, 1):
            cell = json.loads((folder / "cells" / f"transformers-{method}-{seed}.json").read_text())
            for record, ttft, sent, hit in zip(cell["result"]["records"], ttfts, conversation, cached):
                record.update(ttft=ttft, prompt_tokens=sent, cached_tokens=hit)
            (folder / "cells" / f"{backend}-{method}-{seed}.json").write_text(json.dumps(cell))
    rows = readme._agent_rows()
    assert len(rows) == 2 and "(tiny, vllm)" in rows[1]
    assert rows[1].endswith("; last message's time to first token 0.60 s with session reuse (stateless: 4.00 s, 62% "
                            "answers right), 0.50 s on the transformers path | [agent.md](docs/agent.md) |")
    cell = json.loads((folder / "cells" / "vllm-stateless-triattention-0.json").read_text())
    cell["settings"]["version"]["commit"] = "c0ffee1+changes"
    (folder / "cells" / "vllm-stateless-triattention-0.json").write_text(json.dumps(cell))
    assert "time to first token" not in readme._agent_rows()[1]


def test_the_page_compares_session_reuse_with_the_session_and_with_stateless(tmp_path):
    """The reuse section: same answers as the transformers session counted word for word, and reuse minus stateless
    paired over questions."""
    folder = _paired_folder(tmp_path / "agent", commit="c0ffee1")
    conversation = [100, 200, 300, 400]
    session = {seed: json.loads((folder / "cells" / f"transformers-triattention-{seed}.json").read_text()) for seed in (0, 1)}
    for seed, cell in session.items():  # the session's answers: "a0", "a1", ...
        for index, record in enumerate(cell["result"]["records"]):
            record["answer"] = f"a{index}"
        (folder / "cells" / f"transformers-triattention-{seed}.json").write_text(json.dumps(cell))
    for backend, right, answer in (("vllm", None, lambda i: f"a{i}" if i else "other"),
                                   ("vllm-stateless", [1, 1, 1, 1], lambda i: "s")):
        for seed, cell in session.items():
            cell = json.loads(json.dumps(cell))
            for index, (record, sent) in enumerate(zip(cell["result"]["records"], conversation)):
                record.update(prompt_tokens=sent, cached_tokens=0 if backend == "vllm-stateless" else sent - 100,
                              answer=answer(index), **({"right": bool(right[index])} if right else {}))
            (folder / "cells" / f"{backend}-triattention-{seed}.json").write_text(json.dumps(cell))
    page = write_report([folder], tmp_path / "agent.md").read_text()
    # reuse: the session's answers but the first of each session (6 of 8 the same); right on 5 of 8, stateless 8 of 8
    assert "vLLM gives the transformers session's answer, word for word, on 6 of 8 questions" in page
    assert "Reuse minus stateless, answers right: -37.5 [" in page and "] points over 8 questions" in page
    assert "> - targets: 2 met, 0 not met" in page
