"""The harness of the vLLM tests: engines run outside the test process (`vllm_scenario.py`), one scenario spec each,
and the transformers-side replay that checks each round's kept set against trikv's own scores.

The kept set of a round is recomputed independently: the same token sequence is replayed through trikv's
transformers cache, whose policy scores each round itself; the vLLM round must keep the top-`budget` of those
scores (entries whose score is within `tie` of the cut-off may swap: floating-point ties, counted and reported).
The replay then keeps vLLM's set, so every round starts from the same state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import trikv
from trikv.compat import cache_kwargs

HERE = Path(__file__).parent
BUDGET, SLACK, BLOCK = 64, 32, 32


def run_engines(tmp_path: Path, specs: dict[str, dict]) -> dict[str, dict]:
    """Run one engine per spec, one after the other (two CPU-bound engines at once only slow each other): the
    in-process ones in one interpreter, the others (tensor parallelism, own environment, "alone": true) each in its own. A failed
    engine's result is {"error": traceback}."""
    pairs = {}
    for name, spec in specs.items():
        spec_path, result_path = tmp_path / f"{name}.json", tmp_path / f"{name}.result.json"
        spec_path.write_text(json.dumps({"model": "smollm2-135m", **spec}))
        result_path.unlink(missing_ok=True)
        pairs[name] = [str(spec_path), str(result_path)]
    shared = [name for name, spec in specs.items()
              if spec.get("in_process", True) and not spec.get("env") and not spec.get("alone")]
    groups = ([shared] if shared else []) + [[name] for name in specs if name not in shared]
    results = {}
    for group in groups:
        arguments = [path for name in group for path in pairs[name]]
        done = subprocess.run([sys.executable, str(HERE / "vllm_scenario.py"), *arguments], capture_output=True, text=True,
                              timeout=300 + 300 * len(group))
        for name in group:
            result_path = Path(pairs[name][1])
            results[name] = (json.loads(result_path.read_text()) if result_path.exists()
                             else {"error": f"the engine process exited with {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"})
            results[name]["spec"] = specs[name]
    return results


def engine_run(runs: dict[str, dict], name: str) -> dict:
    """The result of scenario `name`, or the test fails with the engine's error."""
    assert name in runs, f"scenario {name!r} did not run: mark the test with @pytest.mark.engines({name!r})"
    assert "error" not in runs[name], f"vLLM scenario {name} failed:\n{runs[name]['error'][-6000:]}"
    return runs[name]


SCENARIOS = {}  # name -> build(request, prompts) -> spec


def bundled_text_ids(tokenizer) -> list[int]:
    """Real text to build prompts from: the bundled prose, code and math texts, tokenized."""
    folder = Path(trikv.__file__).parent / "data" / "analysis_texts"
    return [token for name in ("prose", "code", "math") for token in tokenizer((folder / f"{name}.txt").read_text())["input_ids"]]


def module_engine_runs(request, engines_dir: Path, prompts) -> dict[str, dict]:
    """Every scenario the selected tests of the requesting module name (`@pytest.mark.engines`), run once."""
    wanted = list(dict.fromkeys(name for item in request.session.items if item.module is request.module
                                for marker in item.iter_markers("engines") for name in marker.args))
    return run_engines(engines_dir, {name: SCENARIOS[name](request, prompts) for name in wanted})


def scenario(name: str):
    """Register the spec builder of an engine run; the tests that read its result carry @pytest.mark.engines(name)."""
    def register(build):
        SCENARIOS[name] = build
        return build
    return register


def _trikv_settings(method="triattention", **extra):
    settings = {"method": method, "budget": BUDGET, "divide_length": SLACK, "record_rounds": True, **extra}
    if method.startswith("triattention"):
        settings["stats"] = "smollm2-135m"
    return settings



def _rounds_of(result: dict, request_id: str, rank: int = 0) -> list[dict]:
    return [r for r in result["rounds"][rank] if r["request_id"].split("-")[0] == request_id]


def _steps_of(result: dict, batch: int, request_id: str) -> list[list[int]]:
    """[first token computed, tokens scheduled, full-attention blocks held, offset] of each step that scheduled the
    request of batch `batch` (from the scheduler's own bookkeeping, `vllm_scenario.py`'s "schedule_records")."""
    steps = result["batches"][batch]["schedule"]
    return [chunk for step in steps for rid, chunk in step.items() if rid.split("-")[0] == request_id]


def _all_steps(result: dict) -> list[list[int]]:
    return [chunk for batch in result["batches"] for step in batch["schedule"] for chunk in step.values()]


def _prefill_chunks(steps: list[list[int]], prompt_length: int) -> list[tuple[int, int]]:
    """vLLM's prefill chunks of a request never preempted: [start, stop) of each step before its prompt was done."""
    chunks = [(start, start + count) for start, count, _, _ in steps if start < prompt_length]
    assert chunks and chunks[0][0] == 0 and chunks[-1][1] == prompt_length, chunks
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])), chunks
    return chunks


def _checked_cache(model, method: str, rounds: list[dict], tie: float, stats, budget: int,
                   chunks: list[tuple[int, int]] | None):
    """trikv's transformers cache with vLLM's budget whose policy, at every round, checks vLLM's kept set of that round
    against its own scores (the top-`budget` of them; entries within `tie` standard deviations of the cut-off may
    swap: float ties, counted) and then keeps exactly vLLM's set, so that every round starts from the same state.
    Returns the cache and its report (rounds, (layer, head) sets, tied sets, the largest tie)."""
    options = {"stats": stats} if stats else {}
    if chunks:  # the cache's own bound holds vLLM's chunks (it warns about a longer forward)
        options["prefill_chunk_size"] = max(2, *(stop - start for start, stop in chunks))
    cache = trikv.make_cache(model, method, budget=budget, divide_length=SLACK, **options)
    policy = cache.policy
    inner_score = policy.score
    report = {"rounds": 0, "heads": 0, "tied_heads": 0, "max_tie": 0.0}

    def score(context):
        scores = inner_score(context)  # [L, 1, Hkv, N]
        index = report["rounds"]
        assert index < len(rounds), "the transformers path ran more rounds than vLLM"
        expected = torch.tensor(rounds[index]["kept_positions"])  # [L, Hkv, B]
        assert rounds[index]["position"] == int(context.current_position[0]), "rounds at different positions"
        judged = scores.float().masked_fill(context.protected, float("inf")).masked_fill(context.positions < 0, float("-inf"))[:, 0]
        positions = context.positions[:, 0]  # [L, Hkv, N]
        in_expected = (positions[..., None] == expected[:, :, None, :]).any(-1)  # [L, Hkv, N]
        assert bool((in_expected.sum(-1) == budget).all()), "vLLM kept positions the cache does not hold"
        cut = judged.topk(budget, dim=-1).values[..., -1:]  # the B-th best score per (layer, head)
        finite = torch.isfinite(judged)
        count = finite.sum(-1, keepdim=True).clamp_min(1)
        mean = judged.masked_fill(~finite, 0).sum(-1, keepdim=True) / count
        spread = ((judged - mean).masked_fill(~finite, 0).pow(2).sum(-1, keepdim=True) / count).sqrt().clamp_min(1e-6)
        misplaced = (in_expected & (judged < cut)) | (~in_expected & (judged > cut))
        distance = ((judged - cut).abs() / spread).masked_fill(~misplaced, 0).nan_to_num(0)
        worst = float(distance.max())
        assert worst <= tie, f"round at {rounds[index]['position']}: vLLM kept an entry {worst:.4f} std away from the cut-off"
        report["rounds"] += 1
        report["heads"] += in_expected.shape[0] * in_expected.shape[1]
        report["tied_heads"] += int(misplaced.any(-1).sum())
        report["max_tie"] = max(report["max_tie"], worst)
        # keep exactly what vLLM kept, so that the next round starts from the same entries
        return torch.where(in_expected[:, None], torch.full_like(scores, 1e9), scores)

    policy.score = score
    return cache, report


def _forwards(request: dict, rounds: list[dict], chunks: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """[start, stop) of the forwards that replay a request as vLLM's steps ran it: the prompt in vLLM's prefill
    `chunks` (default one forward), the first generated token alone (it starts the decode: the cache takes its
    prompt's length from the forwards before it), then the generated tokens in spans that end where vLLM's rounds
    ran (a round runs before the forward that finds the cache at budget + slack, so the spans' rounds fall where one
    token a step puts them)."""
    prompt_length, last = len(request["prompt"]), len(request["prompt"]) + len(request["tokens"]) - 1
    starts = sorted({prompt_length, prompt_length + 1} | {r["position"] for r in rounds if r["position"] > prompt_length})
    decode = [(start, stop) for start, stop in zip(starts, starts[1:] + [last]) if start < stop]
    return list(chunks or [(0, prompt_length)]) + decode


def replay(model, method: str, request: dict, rounds: list[dict], tie: float, stats=None, budget: int = BUDGET,
           chunks: list[tuple[int, int]] | None = None) -> dict:
    """Feed the request's tokens through trikv's transformers cache with vLLM's budget, in the forwards vLLM's steps
    ran (`_forwards`), checking each round's vLLM kept set against the cache's own scores (`_checked_cache`); return
    the report with the teacher-forced greedy predictions and their top-2 logit margins."""
    cache, report = _checked_cache(model, method, rounds, tie, stats, budget, chunks)
    ids = torch.tensor([request["prompt"] + request["tokens"]])
    prompt_length = len(request["prompt"])
    predictions, margins = [], []
    with torch.no_grad():
        for start, stop in _forwards(request, rounds, chunks):
            logits = model(input_ids=ids[:, start:stop], **cache_kwargs(model, cache)).logits[0].float()  # [span, vocab]
            if stop <= prompt_length:  # a prefill chunk predicts the first generated token at its end
                predictions, margins = [int(logits[-1].argmax())], [float("inf")]
                continue
            top2 = logits.topk(2, dim=-1).values
            margins += (top2[:, 0] - top2[:, 1]).tolist()
            predictions += logits.argmax(dim=-1).tolist()
    report["predictions"] = predictions
    report["margins"] = margins
    assert report["rounds"] == len(rounds), f"vLLM ran {len(rounds)} rounds, the transformers path {report['rounds']}"
    return report


def feed_keys(model, method: str, request: dict, rounds: list[dict], keys: dict[int, torch.Tensor], tie: float,
              stats=None, budget: int = BUDGET) -> dict:
    """trikv's transformers cache fed vLLM's own keys (`keys`: layer -> [T, Hkv, D] by position, what vLLM's cache
    holds) in the forwards vLLM's steps ran, no model forward: its rounds score those very keys, and each round's
    vLLM kept set is checked against them (`_checked_cache`)."""
    cache, report = _checked_cache(model, method, rounds, tie, stats, budget, None)
    for start, stop in _forwards(request, rounds, None):
        cache.before_forward(stop - start, None)
        for layer in sorted(keys):
            part = keys[layer][start:stop].transpose(0, 1)[None]  # [1, Hkv, span, D]
            cache.update(part, torch.zeros_like(part), layer)
    assert report["rounds"] == len(rounds), f"vLLM ran {len(rounds)} rounds, the transformers path {report['rounds']}"
    return report


