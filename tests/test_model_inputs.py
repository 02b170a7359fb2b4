"""Every bundled model reads its input as its authors intend, loaded the way users load it.

The GGUF a bundled model ships in states how its text is framed (`tokenizer.ggml.add_bos_token`, the chat template);
transformers' GGUF conversion drops some of it, and a model fed malformed input still produces logits. For each
bundled model whose weights are on this machine (SmolLM2 always; Gemma-3 is fetched by the tests that use it;
`TRIKV_TEST_ALL_MODELS=1` fetches the Qwen models too, ~1.6 GB): the tokenizer's flags equal the GGUF's, read
here with `gguf` directly, the first input id is BOS exactly where the GGUF adds one, and a greedy continuation of
a known prompt (framed for the model's kind: chat template or plain completion) is right and sane.
"""

from __future__ import annotations

import os

import pytest
import torch

from trikv import models
from trikv.prompts import document_ids, is_instruct, leading_ids, prompt_ids
from trikv.sanity import ModelSanityError, check_model_answers, degenerate, known_answer

pytestmark = pytest.mark.real_model

ALWAYS = ("smollm2-135m", "gemma3-270m")  # the models the rest of the suite loads anyway


def _available(name: str) -> bool:
    if name in ALWAYS or os.environ.get("TRIKV_TEST_ALL_MODELS") == "1":
        return True
    return (models.converted_dir(name) / "config.json").exists()


def _gguf_fields(name: str) -> dict:
    """The tokenizer fields of the model's GGUF, read with the gguf package (not through trikv)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(models.REGISTRY[name].locate_gguf())).fields
    return {key: fields[key].contents() for key in fields if key.startswith("tokenizer.") and key not in (
        "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")}


# the bundled model in every run, the others with --full (`extended`)
@pytest.fixture(scope="module", params=[pytest.param(name, marks=[] if name == "smollm2-135m" else [pytest.mark.extended])
                                        for name in sorted(models.REGISTRY)])
def loaded(request):
    name = request.param
    if not _available(name):
        pytest.skip(f"{name}'s weights are not on this machine (TRIKV_TEST_ALL_MODELS=1 fetches them)")
    model, tokenizer = models.load_model(name)
    return name, model, tokenizer


def test_tokenizer_follows_the_gguf(loaded):
    name, _, tokenizer = loaded
    fields = _gguf_fields(name)
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", fields["tokenizer.ggml.model"] == "llama"))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id")
    ids = tokenizer("The capital of France is")["input_ids"]
    assert (ids[0] == bos) == add_bos, f"{name}: first id {ids[0]}, the GGUF's add_bos_token is {add_bos} (BOS {bos})"
    assert (ids[-1] == eos) == add_eos
    assert tokenizer.eos_token_id == eos
    assert is_instruct(tokenizer) == ("tokenizer.chat_template" in fields)
    assert models.REGISTRY[name].kind == ("instruct" if "tokenizer.chat_template" in fields else "base")
    # every way trikv frames text starts as the tokenizer does
    assert leading_ids(tokenizer) == ([bos] if add_bos else [])
    assert document_ids(tokenizer, "Some text.")[: 1 if add_bos else 0] == ([bos] if add_bos else [])
    framed = prompt_ids(tokenizer, "What is 2 + 2?")
    if not is_instruct(tokenizer):
        assert framed == ids[:1] * add_bos + tokenizer("What is 2 + 2?", add_special_tokens=False)["input_ids"]


def test_known_prompt_is_answered_sanely(loaded):
    name, model, tokenizer = loaded
    answer = check_model_answers(model, tokenizer, name)
    assert "Paris" in answer.continuation and not degenerate(answer.continuation)


@pytest.mark.extended  # another real model
def test_a_model_without_its_bos_is_caught():
    """Gemma-3 fed without BOS degenerates; the check says so (and so can fail on a broken framing)."""
    model, tokenizer = models.load_model("gemma3-270m")
    ids = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert degenerate(tokenizer.decode(out[0, len(ids):]))

    class NoBos:  # the tokenizer as transformers' GGUF conversion left it
        def __init__(self, inner):
            self.inner, self.chat_template = inner, None

        def __call__(self, text, add_special_tokens=True, **kwargs):
            return self.inner(text, add_special_tokens=False, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    broken = NoBos(tokenizer)
    assert known_answer(model, broken).prompt_ids[0] != tokenizer.bos_token_id
    with pytest.raises(ModelSanityError, match="does not answer a known completion prompt sanely"):
        check_model_answers(model, broken, "gemma3-270m without BOS")


@pytest.mark.extended  # another real model
def test_conversion_record_and_refresh_of_an_older_conversion(tmp_path, monkeypatch):
    """A folder converted before the tokenizer followed the GGUF (no conversion record) gets its tokenizer
    rewritten on first use, weights untouched."""
    import shutil

    source = models.converted_dir("gemma3-270m")
    models.resolve_model_path("gemma3-270m")
    home = tmp_path / "home"
    target = home / "models" / "gemma3-270m"
    target.mkdir(parents=True)
    (home / "gguf").symlink_to(models.trikv_home() / "gguf")  # the assembled GGUF, not fetched again
    for path in source.iterdir():
        if path.name == "model.safetensors":
            (target / path.name).symlink_to(path)
        elif path.name != models.CONVERSION_FILE:
            shutil.copy(path, target / path.name)
    from transformers import AutoTokenizer

    old = AutoTokenizer.from_pretrained(target)
    old.add_bos_token = False  # what the earlier conversion saved
    old.save_pretrained(target)
    assert AutoTokenizer.from_pretrained(target)("a")["input_ids"][0] != 2
    monkeypatch.setenv("TRIKV_HOME", str(home))
    assert models.resolve_model_path("gemma3-270m") == str(target)
    assert AutoTokenizer.from_pretrained(target)("a")["input_ids"][0] == 2
    assert models.conversion_record("gemma3-270m")["tokenizer"]["add_bos_token"] is True


def test_concurrent_first_uses_convert_once(tmp_path, monkeypatch):
    """Two processes that load a bundled model for the first time at once (two benchmark runs started together)
    take turns: one converts, the other finds the finished folder. Without the lock both convert into the same
    `.partial` folder and the slower one fails to rename it."""
    import threading
    import time

    monkeypatch.setenv("TRIKV_HOME", str(tmp_path))
    conversions = []

    def slow_convert(entry, target):
        conversions.append(entry.name)
        time.sleep(0.3)  # long enough for the other caller to arrive while this one works
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        models._write_conversion_record(target, entry, tmp_path / "x.gguf", models.GGUFTokenizerFlags(True, False, 1, 2, None))

    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    results, errors = [], []

    def first_use():
        try:
            results.append(models.resolve_model_path("smollm2-135m"))
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    callers = [threading.Thread(target=first_use) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert not errors and conversions == ["smollm2-135m"]
    assert results == [str(tmp_path / "models" / "smollm2-135m")] * 2
