"""The agent benchmark's parts: sessions built from real source files with answers read by Python's parser, the
memory limit that ends full attention's session where its KV passes it while a bounded method completes under it,
and the page rendered from the cells (the full runs on Qwen2.5-Coder are benchmarks, docs/agent.md)."""

from __future__ import annotations

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
            assert re.search(rf"^\s*{re.escape(question.subject)}\s*=\s*", chunk.text, re.M)
            assert all(literal in chunk.text for literal in question.expected)
    # a right answer names every expected item; a partial or a different one is wrong
    params = next(m.question for m in session.messages if m.question.kind == "params")
    assert params.is_right(", ".join(reversed(params.expected)))
    assert not params.is_right(", ".join(params.expected[:-1]))
    assert not params.is_right(", ".join(name + "x" for name in params.expected))


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
    lines = write_report([_agent_folder(tmp_path / "agent", bounded_right=False)], tmp_path / "agent.md").read_text().splitlines()
    assert lines[5].endswith("triattention completes 1/1 sessions, 0% of its answers right (uncapped full attention: 100%)")
