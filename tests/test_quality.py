"""Quality benchmarks (issue 7): metrics on constructed cases, DFS, grader, needle, feeding, end to end."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random

import pytest
import torch
from helpers import tiny_model
from stats_fixtures import tiny_stats

from trikv.benchmarks.quality import dfs, grader, needle
from trikv.benchmarks.quality.feeding import Feeder, needs_single_steps
from trikv.benchmarks.quality.fidelity import FidelityTask, horizon_labels
from trikv.cache import CompressedCache, make_cache
from trikv.policies import Policy, ScoringContext


class KeepOldest(Policy):
    """A deliberately bad method: keeps the oldest tokens, drops everything recent."""

    name = "keep-oldest"

    def score(self, context: ScoringContext) -> torch.Tensor:
        return -context.positions.float()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model()
    return model, tiny_stats(model)


@pytest.fixture(scope="module")
def fidelity_task(tiny):
    model, _ = tiny
    ids = torch.randint(1, 96, (2, 240), generator=torch.Generator().manual_seed(3))
    task = FidelityTask(model, ids, prompt_length=8, max_chunk=32, recall_stride=2, horizons=(32, 96))
    task.run_reference()
    return task


# ---- feeding ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["triattention", "snapkv-decode", "h2o", "rkv", "adakv"])
def test_chunked_feeding_matches_single_steps(tiny, method):
    model, stats = tiny
    options = {"stats": stats} if method == "triattention" else {}
    ids = torch.randint(1, 96, (2, 60), generator=torch.Generator().manual_seed(1))
    logits = {}
    for max_chunk in (1, 64):
        cache = make_cache(model, method, budget=12, divide_length=8, **options)
        feeder = Feeder(model, cache, max_chunk)
        feeder.feed(ids[:, :4], want_logits=False, prompt=True)
        logits[max_chunk] = feeder.feed(ids[:, 4:])
        rounds = cache.rounds
    assert rounds >= 5
    assert torch.allclose(logits[1], logits[64], atol=1e-4), (logits[1] - logits[64]).abs().max()


def test_feeding_uses_few_forwards_and_single_steps_when_needed(tiny):
    model, _ = tiny
    ids = torch.randint(1, 96, (1, 200), generator=torch.Generator().manual_seed(2))
    cache = make_cache(model, "streaming", budget=32, divide_length=16)
    feeder = Feeder(model, cache, 64)
    feeder.feed(ids[:, :8], want_logits=False, prompt=True)
    feeder.feed(ids[:, 8:], want_logits=False)
    assert len(feeder.log.spans) <= 2 + 200 // 16
    assert all(end - start <= 40 for start, end in feeder.log.spans[1:])
    lazy = make_cache(model, "lazyeviction", budget=160, divide_length=16)
    assert needs_single_steps(lazy) and not needs_single_steps(cache)


# ---- fidelity and recall ---------------------------------------------------------------------------
def test_keeping_everything_scores_perfectly(tiny, fidelity_task):
    model, _ = tiny
    metrics, log = fidelity_task.run_method(make_cache(model, "streaming", budget=4096))
    assert metrics["top1_agreement"] == 1.0
    assert metrics["kl"] < 1e-6
    assert metrics["perplexity"] == pytest.approx(metrics["perplexity_full"], rel=1e-5)
    recall = fidelity_task.recall({"all": log})["all"]
    assert recall["recall"] == 1.0 and recall["recall_min_head"] == 1.0


def test_keeping_nothing_useful_scores_low(tiny, fidelity_task):
    model, _ = tiny
    bad, log_bad = fidelity_task.run_method(CompressedCache(model, KeepOldest(), budget=16, divide_length=16))
    good, log_good = fidelity_task.run_method(make_cache(model, "streaming", budget=16, divide_length=16))
    recall = fidelity_task.recall({"bad": log_bad, "good": log_good})
    assert bad["top1_agreement"] < 0.6 and bad["kl"] > 0.05
    assert recall["bad"]["recall"] < 0.5
    assert recall["bad"]["recall"] < recall["good"]["recall"]
    assert recall["bad"]["recall_min_head"] <= recall["bad"]["recall"]


def test_recall_matches_a_direct_computation(tiny, fidelity_task):
    """The vectorised recall, overall and by horizon, against a loop over heads and queries: by horizon, each
    head's share of the attention mass (not of the pairs) its kept keys receive, averaged over the heads."""
    model, _ = tiny
    _, log = fidelity_task.run_method(make_cache(model, "snapkv-decode", budget=24, divide_length=16))
    result = fidelity_task.recall({"x": log})["x"]
    ref = fidelity_task.reference
    rounds = sorted(log["round_times"])
    edges = (32, 96)
    labels = horizon_labels(edges)
    L, Hq, Hkv = len(ref.keys), ref.queries[0].shape[1], ref.keys[0].shape[1]
    T = ref.keys[0].shape[2]
    judged = torch.tensor([next((r for r in rounds if r > j), 10**9) for j in range(T)])  # first round judging key j
    shares = {label: [] for label in labels}
    for layer in range(L):
        for head in range(Hq):
            kv = head // (Hq // Hkv)
            kept_total = mass_total = 0.0
            h_kept, h_mass = [0.0] * 3, [0.0] * 3
            for row in range(2):
                for qi, t in enumerate(ref.query_index.tolist()):
                    logits = (ref.keys[layer][row, kv, : t + 1] @ ref.queries[layer][row, head, qi]) * ref.scaling
                    probs = torch.softmax(logits, -1).double()
                    visible = (t < log["evict_time"][layer, row, kv, : t + 1].long()).double()
                    kept_total += float((probs * visible).sum())
                    mass_total += float(probs.sum())
                    horizon = t - judged[: t + 1]
                    for bucket in range(3):
                        inside = (horizon >= 0) & ((horizon >= (edges[bucket - 1] if bucket else 0)) &
                                                   ((horizon < edges[bucket]) if bucket < 2 else True))
                        h_mass[bucket] += float((probs * inside).sum())
                        h_kept[bucket] += float((probs * visible * inside).sum())
            assert result["recall_per_head"][layer][head] == pytest.approx(kept_total / mass_total, abs=1e-4)
            for bucket, label in enumerate(labels):
                if h_mass[bucket] > 1e-9:
                    shares[label].append(h_kept[bucket] / h_mass[bucket])
    assert any(shares.values())
    for label in labels:
        assert (label in result["by_horizon"]) == bool(shares[label])
        if shares[label]:
            assert result["by_horizon"][label]["recall"] == pytest.approx(sum(shares[label]) / len(shares[label]), abs=1e-4)
            assert result["by_horizon"][label]["recall_min_head"] == pytest.approx(min(shares[label]), abs=1e-4)


def test_oracle_keeps_the_keys_that_receive_the_most_future_attention(tiny, fidelity_task):
    """The oracle's selection against a direct loop: at each round, of the keys still held, the top-B by the
    attention (summed over the group's heads and every later sampled query) that each receives; its recall is
    the mass those keys receive, and it is at least that of a real method on the same schedule."""
    model, _ = tiny
    budget = 24
    _, log = fidelity_task.run_method(make_cache(model, "snapkv-decode", budget=budget, divide_length=16))
    rounds = sorted(log["round_times"])
    assert len(rounds) >= 5
    result = fidelity_task.recall({"snap": log}, oracles={"oracle": (rounds, budget)})
    ref = fidelity_task.reference
    L, Hq, Hkv = len(ref.keys), ref.queries[0].shape[1], ref.keys[0].shape[1]
    G, T = Hq // Hkv, ref.keys[0].shape[2]
    queries = ref.query_index.tolist()
    for layer in (0, L - 1):
        evict = fidelity_task.oracle_evictions(layer, rounds, budget)
        for row in range(2):
            for kv in range(Hkv):
                probs = {}  # query position -> attention of every key, summed over the group
                for qi, t in enumerate(queries):
                    total = torch.zeros(T, dtype=torch.float64)
                    for head in range(kv * G, (kv + 1) * G):
                        logits = (ref.keys[layer][row, kv, : t + 1] @ ref.queries[layer][row, head, qi]) * ref.scaling
                        total[: t + 1] += torch.softmax(logits, -1).double()
                    probs[t] = total
                held = set()
                expected = [T] * T
                next_key = 0
                for time in rounds:
                    held |= set(range(next_key, time))
                    next_key = time
                    if len(held) <= budget:
                        continue
                    future = {j: sum(float(p[j]) for t, p in probs.items() if t >= time) for j in held}
                    ranked = sorted(held, key=lambda j: -future[j])
                    cutoff = future[ranked[budget - 1]]
                    # ties at the cut may go either way; everything strictly above it must stay
                    for j in ranked[budget:]:
                        assert future[j] <= cutoff + 1e-9
                        if future[j] < cutoff - 1e-9:
                            expected[j] = time
                    dropped = {j for j in held if int(evict[row, kv, j]) == time}
                    assert len(held) - len(dropped) == budget
                    assert all(expected[j] == time for j in dropped if future[j] < cutoff - 1e-9)
                    assert all(int(evict[row, kv, j]) == time for j in held if expected[j] == time)
                    held -= dropped
    oracle, snap = result["oracle"], result["snap"]
    assert oracle["recall"] >= snap["recall"] - 1e-9
    assert 0.0 < oracle["recall"] < 1.0


def test_diagnosis_rank_correlation():
    from trikv.benchmarks.quality.pages.verdicts import _spearman

    assert _spearman([0.1, 0.5, 0.9], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert _spearman([0.1, 0.5, 0.9, 0.7], [1.0, 2.0, 4.0, 3.0]) == pytest.approx(1.0)
    assert _spearman([1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]) == pytest.approx(0.8)


def test_diagnosis_reads_no_relation_from_fewer_than_eight_layers():
    from trikv.benchmarks.quality.pages.verdicts import diagnosis

    def record(layers):
        cell = lambda total, per_layer: {"64": {"recall": total, "recall_per_layer": per_layer}}
        own = [0.80 + 0.01 * i for i in range(layers)]
        leader = [value + 0.01 * (layers - i) for i, value in enumerate(own)]  # its lead shrinks as R grows
        return {"config": {"budgets": [64], "methods": ["triattention", "tova"], "horizons": [128]},
                "results": {"fidelity": {"methods": {m: {"64": {"kl": 0.1, "top1_agreement": 0.9}} for m in ("triattention", "tova")}},
                            "recall": {"meta": {"concentration_per_layer": [0.5 + 0.01 * i for i in range(layers)]},
                                       "methods": {"triattention": cell(0.80, own), "tova": cell(0.85, leader)}}}}

    (three,) = [line for line in diagnosis(record(3)) if "recalls more than" in line]
    assert "rank correlation -1.00, no reading from 3 layers (at least 8 needed)" in three, three
    (eight,) = [line for line in diagnosis(record(8)) if "recalls more than" in line]
    assert "rank correlation -1.00, the lead is larger where concentration is lower" in eight, eight


def test_diagnosis_names_the_methods_above_the_future_attention_selection_at_each_horizon():
    from trikv.benchmarks.quality.pages.verdicts import diagnosis

    def recall_cell(total, by_horizon):
        return {"recall": total, "by_horizon": {label: {"recall": value, "mass_share": 0.5}
                                                for label, value in by_horizon.items()}}

    fidelity = {"kl": 0.1, "top1_agreement": 0.9}
    record = {
        "config": {"budgets": [64], "methods": ["full", "triattention", "snapkv", "h2o"], "horizons": [128]},
        "results": {
            "fidelity": {"methods": {"triattention": {"64": fidelity}, "snapkv": {"64": dict(fidelity, kl=0.2)},
                                     "h2o": {"64": dict(fidelity, kl=0.3)}}},
            "recall": {"methods": {
                "triattention": {"64": recall_cell(0.90, {"0-128": 0.95, "128+": 0.85})},
                "snapkv": {"64": recall_cell(0.88, {"0-128": 0.99, "128+": 0.77})},
                # equal to the oracle as printed: not "above" it
                "h2o": {"64": recall_cell(0.87, {"0-128": 0.97, "128+": 0.8004})},
                "oracle": {"64": recall_cell(0.92, {"0-128": 0.96, "128+": 0.80})},
            }},
        },
    }
    lines = [line for line in diagnosis(record) if "above `future-attention`" in line]
    assert lines == ["B=64: methods above `future-attention` at a horizon (it ranks keys by the attention of all later "
                     "queries, not of one horizon's): 0-128 (future-attention 0.960): `snapkv` 0.990, `h2o` 0.970; "
                     "128+ (future-attention 0.800): `triattention` 0.850."]
    record["results"]["recall"]["methods"]["oracle"]["64"] = recall_cell(0.95, {"0-128": 1.0, "128+": 0.9})
    assert not [line for line in diagnosis(record) if "above `future-attention`" in line]


def test_recall_by_horizon_single_head_value(tiny):
    """A one-layer, one-head model makes the by-horizon figure equal to the direct ratio."""
    model = tiny_model(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, hidden_size=32)
    ids = torch.randint(1, 96, (1, 160), generator=torch.Generator().manual_seed(5))
    task = FidelityTask(model, ids, prompt_length=4, max_chunk=32, recall_stride=1, horizons=(40,))
    task.run_reference()
    _, log = task.run_method(make_cache(model, "streaming", budget=20, divide_length=10))
    result = task.recall({"x": log})["x"]
    ref = task.reference
    rounds = sorted(log["round_times"])
    kept = [0.0, 0.0]
    mass = [0.0, 0.0]
    for qi, t in enumerate(ref.query_index.tolist()):
        probs = torch.softmax((ref.keys[0][0, 0, : t + 1] @ ref.queries[0][0, 0, qi]) * ref.scaling, -1)
        for j in range(t + 1):
            judged = next((r for r in rounds if r > j), None)
            if judged is None or t < judged:
                continue
            bucket = int(t - judged >= 40)
            kept[bucket] += float(probs[j]) * (t < int(log["evict_time"][0, 0, 0, j]))
            mass[bucket] += float(probs[j])
    labels = horizon_labels((40,))
    for i in range(2):
        assert result["by_horizon"][labels[i]]["recall"] == pytest.approx(kept[i] / mass[i], abs=1e-4)


# ---- DFS -------------------------------------------------------------------------------------------------
def test_dfs_hand_worked_example():
    #   0 - 1 - 3
    #   |
    #   2
    states = dfs.dfs_trace(4, [(0, 1), (0, 2), (1, 3)])
    assert [(s.action, s.node, s.stack, s.visited) for s in states] == [
        ("start", 0, (0,), (0,)),
        ("visit", 1, (0, 1), (0, 1)),
        ("visit", 3, (0, 1, 3), (0, 1, 3)),
        ("back", 1, (0, 1), (0, 1, 3)),
        ("back", 0, (0,), (0, 1, 3)),
        ("visit", 2, (0, 2), (0, 1, 3, 2)),
        ("back", 0, (0,), (0, 1, 3, 2)),
    ]


def test_dfs_smallest_neighbour_with_cycle():
    # a square 0-1-2-3-0 with a chord 0-2: 0 -> 1 -> 2 -> 3, then back to 2, 1, 0
    states = dfs.dfs_trace(4, [(0, 1), (1, 2), (2, 3), (0, 3), (0, 2)])
    assert [s.node for s in states] == [0, 1, 2, 3, 2, 1, 0]
    assert states[3].stack == (0, 1, 2, 3)
    assert dfs.state_after(4, [(0, 1), (1, 2), (2, 3), (0, 3), (0, 2)], 5).stack == (0, 1)
    with pytest.raises(ValueError):
        dfs.state_after(4, [(0, 1)], 9)


def test_graph_generators():
    rng = random.Random(0)
    for n in (10, 17, 30):
        tree = dfs.random_tree(n, rng)
        assert len(tree) == n - 1 and dfs._connected(n, tree)
        small = dfs.watts_strogatz(n, 4, 0.1, rng)
        assert len(small) == 2 * n and dfs._connected(n, small)
        # a DFS of a connected graph visits every node
        assert len(dfs.dfs_trace(n, small)[-1].visited) == n
    graphs = dfs.make_graphs(4, seed=1, min_steps=8)
    assert [g.kind for g in graphs] == ["tree", "smallworld", "tree", "smallworld"]
    assert [g.edges for g in graphs] == [g.edges for g in dfs.make_graphs(4, seed=1, min_steps=8)]


def test_dfs_question_states_the_form_its_expected_answer_has():
    """The teacher-forced answer is scored token by token, so the question must announce exactly its form:
    substituting the true state into the announced form gives the expected answer."""
    import re

    graph = dfs.make_graphs(1, seed=3, min_steps=6)[0]
    for k in (1, 3, 5):
        form = re.search(r"in the form: (.*)$", dfs.question_text(k)).group(1)
        state = graph.states[k]
        filled = (form.replace(" N;", f" {state.node};", 1)
                  .replace("[A, B, ...]", "[" + ", ".join(map(str, state.stack)) + "]", 1)
                  .replace("[A, B, ...]", "[" + ", ".join(map(str, state.visited)) + "]", 1))
        assert filled == "".join(text for _, text in dfs.answer_fields(state, lead=""))
        assert " " + filled == "".join(text for _, text in dfs.answer_fields(state))


def test_dfs_prompt_frame_is_the_chat_templates_user_turn(tokenizer):
    assert tokenizer.chat_template  # the bundled model's tokenizer has one: the chat framing is exercised
    before, after = dfs.prompt_frame(tokenizer, "chat")
    user = "An undirected graph ..."
    assert before + user + after == tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    assert dfs.prompt_frame(tokenizer, "plain") == ("", "\nAnswer:")
    with pytest.raises(ValueError, match="DFS prompt must be one of chat, plain, got 'json'"):
        dfs.prompt_frame(tokenizer, "json")


@pytest.mark.real_model
@pytest.mark.parametrize("prompt", ["chat", "plain"])
def test_dfs_teacher_forced_feeds_the_framed_question_and_scores_the_answer_in_one_pass(tokenizer, prompt):
    """What the model is fed (prefix, trace lines, then question and answer on a fork) is, token for token,
    the framed question followed by the answer; the field scores equal those of one forward over that text."""
    from transformers import DynamicCache

    model = tiny_model(vocab_size=len(tokenizer))
    graph = dfs.make_graphs(1, seed=2, min_nodes=6, max_nodes=8, min_steps=5)[0]
    k = 5
    fed = []
    forward = model.forward
    model.forward = lambda *args, **kwargs: (fed.append(kwargs["input_ids"]), forward(*args, **kwargs))[1]
    try:
        [record] = dfs.run_teacher_forced(model, tokenizer, DynamicCache, [graph], [k], max_chunk=16, prompt=prompt)
    finally:
        del model.forward
    sequence = torch.cat(fed, dim=1)[0]
    state = graph.states[k]
    trace = "Trace:\nStep 0: start at 0\n" + "".join(dfs.step_line(i, graph.states[i]) for i in range(1, k + 1))
    user = dfs.graph_text(graph) + trace + dfs.question_text(k)
    answer = (f"current node {state.node}; stack [{', '.join(map(str, state.stack))}]; "
              f"visited [{', '.join(map(str, state.visited))}]")
    if prompt == "chat":
        expected = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                                 tokenize=False) + answer
    else:
        expected = user + "\nAnswer: " + answer
    assert tokenizer.decode(sequence) == expected
    # one forward over the whole text: the answer's fields are judged at the positions that predict them
    with torch.no_grad():
        logits = model(input_ids=sequence[None]).logits[0].float()  # [n, V]
    greedy_right = logits[:-1].argmax(-1) == sequence[1:]
    answer_text = ("" if prompt == "chat" else " ") + answer
    answer_ids = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
    assert sequence[-len(answer_ids):].tolist() == answer_ids  # tokenised as one text: "];" is one token
    # the stack field's tokens: those whose characters (found by decoding growing prefixes) overlap the list
    stack_low = answer_text.index(" [")
    stack_high = answer_text.index("];") + 1
    ends = [len(tokenizer.decode(answer_ids[: i + 1])) for i in range(len(answer_ids))]
    starts = [0] + ends[:-1]
    inside = [i for i in range(len(answer_ids)) if starts[i] < stack_high and ends[i] > stack_low]
    assert tokenizer.decode(answer_ids[inside[-1]]) == "];"
    start, end = sequence.numel() - len(answer_ids) + inside[0], sequence.numel() - len(answer_ids) + inside[-1] + 1
    assert record["stack"] == bool(greedy_right[start - 1:end - 1].all())
    assert record["stack_tokens"] == pytest.approx(float(greedy_right[start - 1:end - 1].float().mean()), abs=1e-6)


def test_dfs_answer_parsing_and_scoring():
    state = dfs.DfsState("visit", 5, (0, 2, 5), (0, 1, 2, 5))
    text = 'Step 1: visit 1\nAnswer: {"current_node": 5, "stack": [0, 2, 5], "visited_nodes": [0, 2, 1, 5]}'
    assert dfs.score_generated(text, state) == {"parsed": True, "node": True, "stack": True, "visited": True, "all": True}
    wrong = 'Answer: {"current_node": 2, "stack": [0, 5], "visited_nodes": [0, 5]}'
    assert dfs.score_generated(wrong, state)["all"] is False
    assert dfs.score_generated("no json here", state)["parsed"] is False
    logits = torch.full((4, 10), -5.0)
    targets = torch.tensor([1, 2, 3, 4])
    logits[torch.arange(4), targets] = 5.0
    logits[2, 7] = 9.0  # the third token (field "b") is not the greedy choice
    scored = dfs.score_fields(logits, targets, {"a": (0, 2), "b": (2, 4)})
    assert scored["a"] is True and scored["b"] is False and scored["all"] is False


# ---- grader -------------------------------------------------------------------------------------------
ACCEPT = [
    ("\\frac{1}{2}", "0.5"), ("\\dfrac{3}{4}", "\\frac34"), ("0.75", "3/4"), ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"), ("(1, 2)", "(1,2)"), ("[2, 5)", "[2,5)"), ("x = 5", "5"),
    ("10\\%", "10"), ("5 \\text{ cm}", "5"), ("90^\\circ", "90"), ("\\text{even}", "even"), ("\\pi/2", "\\frac{\\pi}{2}"),
    ("3+4i", "4i+3"), ("(-\\infty, 3]", "(-\\infty,3]"), ("1,000", "1000"), ("x^2+2x+1", "(x+1)^2"),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"), ("042", "42"), ("\\$5", "5"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"), ("-\\frac{1}{3}", "-1/3"), ("\\sqrt[3]{8}", "2"),
    ("\\text{(C)}", "C"), ("1, 2, 3", "1,2,3"), ("\\frac{9}{7}", "\\frac{18}{14}"), ("p(x) = x^2 - 1", "x^2-1"),
    ("6 \\text{ inches}", "6"), ("2.50", "2.5"), ("50\\%", "0.5"),
]
REJECT = [
    ("2", "3"), ("(1,2)", "(2,1)"), ("[2,5)", "(2,5)"), ("\\frac{1}{2}", "\\frac{1}{3}"), ("\\sqrt{2}", "2"),
    ("x^2", "x^3"), ("even", "odd"), ("1000", "100"), ("(1,2)", "(1,2,3)"), ("", "0"), ("3+4i", "3-4i"),
    ("\\pi", "3"), ("2x", "x"), ("\\text{(A)}", "B"),
]


def test_grader_accepts_half_and_rejects_two_vs_three():
    assert grader.math_equal("\\frac{1}{2}", "0.5")
    assert not grader.math_equal("2", "3")


def test_grader_compares_answers_with_commas_only_inside_brackets():
    # one top-level part each: compared whole (splitting them again recursed without end)
    assert not grader.math_equal("g(1,2)", "g(1, 3)")
    assert grader.math_equal("f(1,2)", "f(1, 2)")
    assert grader.math_equal("\\frac{1}{2},3", "0.5, 3")


def test_grader_tricky_pairs():
    wrong_accepts = [pair for pair in REJECT if grader.math_equal(*pair)]
    wrong_rejects = [pair for pair in ACCEPT if not grader.math_equal(*pair)]
    assert not wrong_accepts and not wrong_rejects


def test_answer_extraction():
    assert grader.extract_answer("first \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert grader.extract_answer("nested \\boxed{\\frac{a}{\\sqrt{b}}}") == "\\frac{a}{\\sqrt{b}}"
    assert grader.extract_answer("<think>\\boxed{9}</think> so \\boxed{7}") == "7"
    assert grader.extract_answer("So the answer is 42.") == "42"
    assert grader.extract_answer("we get 3 and then 17") == "17"
    assert grader.last_boxed("no box") is None


def _sleep_forever(_):
    import time

    time.sleep(30)
    return True


def test_grader_timeout_counts_as_wrong():
    import time

    started = time.perf_counter()
    assert grader.call_with_timeout(_sleep_forever, (1,), timeout=0.5, default=False) is False
    assert time.perf_counter() - started < 5


# ---- needle -------------------------------------------------------------------------------------------------
class _DigitTokenizer:
    """Whitespace tokenizer with a growing vocabulary (enough to check item construction)."""

    bos_token_id = 0

    def __init__(self):
        self.vocab = {"<s>": 0}

    def __call__(self, text, add_special_tokens=False):
        ids = [self.vocab.setdefault(word, len(self.vocab)) for word in text.replace(".", " .").split()]
        return {"input_ids": ids}


def test_needle_items_have_exact_length_and_key_position():
    tok = _DigitTokenizer()
    items = needle.make_items(tok, [120, 300], [0.0, 0.5, 1.0], seed=0)
    for item in items:
        assert len(item.input_ids) == item.length
        assert item.input_ids[item.key_token] == item.answer_ids[0]
    positions = [it.key_token for it in items if it.length == 300]
    assert positions == sorted(positions) and positions[0] < positions[-1]


# ---- end to end ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trikv.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))  # installed by scripts/setup.sh


def _figures(value):
    """Results without the wall-clock timings (which differ between runs)."""
    if isinstance(value, dict):
        return {k: _figures(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_figures(v) for v in value]
    return value


@pytest.mark.extended  # a benchmark pipeline end to end (the README's quick-preset command runs in every run)
@pytest.mark.real_model
def test_quick_preset_end_to_end_and_resume(tmp_path, tokenizer):
    from trikv.benchmarks.quality.report import write_report
    from trikv.benchmarks.quality.runner import config_from_preset, run_quality

    model = tiny_model(vocab_size=len(tokenizer))
    stats = tiny_stats(model)
    config = config_from_preset(
        "quick", text_tokens=256, budgets=[40, 64], dfs_graphs=2, dfs_ks=[4, 8], needle_lengths=[160],
        max_chunk=64, divide_length=32,
    )
    assert config.tasks == ["fidelity", "dfs", "needle"]
    out = tmp_path / "run"
    record = run_quality(config, out, model=model, tokenizer=tokenizer, stats=stats, progress=False, log=lambda *a: None)
    for name in ("results.json", "results.csv", "fidelity.png", "recall.png", "recall-layers.png", "dfs-tf.png", "needle.png",
                 "tables.txt"):
        assert (out / name).is_file(), name
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["methods"] == config.methods and saved["model"]["sha256_parameters"]
    fidelity = saved["results"]["fidelity"]["methods"]
    assert fidelity["full"]["full"]["top1_agreement"] == 1.0
    assert set(fidelity["triattention"]) == {"40", "64"}
    recall = saved["results"]["recall"]["methods"]
    assert set(recall["oracle"]) == {"40", "64"}
    for budget in ("40", "64"):  # the oracle runs on triattention's schedule and keeps at least as much as it
        assert recall["oracle"][budget]["recall"] >= recall["triattention"][budget]["recall"] - 1e-9
    # a rerun resumes from the units (no recomputation) and reproduces every figure
    units = {p.name: p.stat().st_mtime_ns for p in (out / "units").iterdir() if p.name != "timings.json"}
    again = run_quality(config, out, model=model, tokenizer=tokenizer, stats=stats, progress=False, log=lambda *a: None)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "units").iterdir() if p.name != "timings.json"} == units
    assert again["results"] == record["results"]
    # a fresh run recomputes and gets the same numbers
    fresh = run_quality(config, out, model=model, tokenizer=tokenizer, stats=stats, fresh=True, progress=False, log=lambda *a: None)
    assert _figures(fresh["results"]) == _figures(record["results"])
    page = write_report([out], tmp_path / "results.md")
    text = page.read_text()
    assert "Fidelity" in text and "Attention recall by horizon" in text and ".png" in text
    assert "| future-attention |" in text and "| oracle |" not in text
    assert "Diagnosis" in text and "vs `future-attention`" in text and "rank correlation of recall with -KL" in text
    # the headline fidelity counts the compressed positions, with intervals over the texts and paired differences
    assert "Fidelity where compression acts" in text and "each method minus triattention" in text
    assert "## Summary: TriAttention against the published baselines" in text
    # the run fed the shipped texts and recorded its fingerprint: the page shows it and lists nothing as pending
    assert "- fingerprint: code sha256 `" in text and "the texts it fed are the ones that ship now" in text
    assert "## Pending" not in text and "superseded" not in text
    assert "This page replaces" not in text
    replacing = write_report([out], tmp_path / "new.md", replaces="docs/results-old.md").read_text()
    assert "This page replaces [results-old.md](results-old.md), kept for reference" in replacing
    cell = fidelity["snapkv"]["40"]
    assert cell["compressed"]["positions"] < cell["positions"]
    low, high = cell["ci"]["compressed"]["kl"]
    assert low <= cell["compressed"]["kl"] <= high
    assert "ci" in recall["snapkv"]["40"] and "vs_triattention" in recall["snapkv"]["40"]
    with pytest.raises(ValueError):
        other = config_from_preset("quick", text_tokens=300)
        run_quality(other, out, model=model, tokenizer=tokenizer, stats=stats, progress=False, log=lambda *a: None)


def test_prompt_protection_is_one_setting_for_every_method(tmp_path, tokenizer):
    """`--no-protect-prompt` reaches every cache the run makes (the needle task always lets the prompt compete)."""
    from trikv.benchmarks.quality.cli import add_quality_arguments, config_from_args
    from trikv.benchmarks.quality.runner import QualityRun
    import argparse

    parser = argparse.ArgumentParser()
    add_quality_arguments(parser)
    model = tiny_model(vocab_size=len(tokenizer))
    stats = tiny_stats(model)
    for flags, expected in (([], True), (["--no-protect-prompt"], False)):
        config = config_from_args(parser.parse_args(flags))
        assert config.protect_prompt is expected
        run = QualityRun(config, tmp_path / str(expected), model=model, tokenizer=tokenizer, stats=stats, progress=False)
        for method in ("triattention", "snapkv", "h2o", "streaming"):
            assert run.make_cache(method, 64).protect_prompt is expected
            assert run.generation_options(method)["protect_prompt"] is expected
        assert run.make_cache("snapkv", 64, protect_prompt=False).protect_prompt is False
        assert "protect_prompt" not in run.generation_options("full")


def test_dfs_graph_sizes_from_the_command_line():
    import argparse

    from trikv.benchmarks.quality.cli import add_quality_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_quality_arguments(parser)
    config = config_from_args(parser.parse_args(["--dfs-nodes", "8,16"]))
    assert (config.dfs_min_nodes, config.dfs_max_nodes) == (8, 16)
    assert (config_from_args(parser.parse_args([])).dfs_min_nodes, config_from_args(parser.parse_args([])).dfs_max_nodes) == (10, 30)
    for bad in ("9", "16,8", "2,5"):
        with pytest.raises(ValueError, match="--dfs-nodes takes MIN,MAX"):
            config_from_args(parser.parse_args(["--dfs-nodes", bad]))


def test_fidelity_on_the_users_own_text_files(tmp_path, tokenizer, caplog):
    """`--text-file`: the file's text is what the fidelity task feeds (named after the file), its content is part
    of the run's fingerprint, and a missing, empty, non-UTF-8 or too short file is refused by name."""
    from trikv.benchmarks.quality.cli import config_from_args
    from trikv.benchmarks.quality.runner import config_from_preset, run_quality
    from trikv.cli import build_parser

    model = tiny_model(vocab_size=len(tokenizer))
    stats = tiny_stats(model)
    story = tmp_path / "story.txt"
    story.write_text(" ".join(f"line {i}: the cat sat on mat number {i * 7 % 13}." for i in range(60)))
    args = build_parser().parse_args(["bench", "quality", "--task", "fidelity", "--text-file", str(story),
                                      "--methods", "full,triattention", "--budgets", "40", "--text-tokens", "320"])
    config = config_from_args(args)
    assert config.texts == [] and config.text_files == [str(story)]
    lines = []
    quiet = dict(model=model, tokenizer=tokenizer, stats=stats, progress=False, log=lines.append)
    record = run_quality(config, tmp_path / "run", **quiet)
    meta = record["results"]["fidelity"]["meta"]
    assert meta["texts"] == ["story"]
    # the 32-token prompt leaves fewer than 32 of 40 slots: said once for the run, not once per text's cache
    assert any("B=40: prompt protected in 0 of 1 texts" in line for line in lines), lines
    assert "competes for the budget" not in caplog.text
    quiet["log"] = lambda *a: None
    # the reference perplexity is that of the file's first 320 tokens under the model (computed here directly)
    ids = torch.tensor([tokenizer(story.read_text(), add_special_tokens=False)["input_ids"][:320]])
    with torch.no_grad():
        logits = model(ids).logits[0, config.prompt_tokens : -1].float()  # decoded positions predict the next token
    nll = torch.nn.functional.cross_entropy(logits, ids[0, config.prompt_tokens + 1 :])
    measured = record["results"]["fidelity"]["methods"]["full"]["full"]
    assert measured["perplexity"] == pytest.approx(float(torch.exp(nll)), rel=1e-3)
    # new content under the same name is another run: the folder refuses to mix them
    story.write_text(story.read_text().replace("cat", "dog"))
    with pytest.raises(ValueError):
        run_quality(config, tmp_path / "run", **quiet)
    # with --texts, the files add to the shipped texts
    both = config_from_args(build_parser().parse_args(["bench", "quality", "--texts", "python-reference", "--text-file", str(story)]))
    assert both.texts == ["python-reference"] and both.text_files == [str(story)]
    # bad files
    with pytest.raises(FileNotFoundError, match="text file not found: .*absent.txt"):
        config_from_preset("quick", tasks=["fidelity"], text_files=[str(tmp_path / "absent.txt")])
    for name, content, message in [("empty.txt", b"  \n", "holds no text"), ("binary.txt", b"\xff\xfe\x00abc", "is not UTF-8 text"),
                                   ("short.txt", b"just a few words", "short has")]:
        (tmp_path / name).write_bytes(content)
        config = config_from_preset("quick", tasks=["fidelity"], texts=[], text_files=[str(tmp_path / name)], text_tokens=160,
                                    methods=["full"], budgets=[40])
        with pytest.raises(ValueError, match=message):
            run_quality(config, tmp_path / f"run-{name}", **quiet)


def test_cli_bench_group():
    from trikv.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "quality", "--methods", "triattention,streaming", "--budgets", "64,128"])
    assert args.methods == ["triattention", "streaming"] and args.budgets == [64, 128]
    args = parser.parse_args(["bench", "report", "a", "b", "--out", "x.md"])
    assert args.folders == ["a", "b"]


# ---- the real model -----------------------------------------------------------------------------------------
@pytest.mark.real_model
def test_chunked_feeding_is_exact_on_the_real_model(real_model):
    """Chunks of the schedule give the logits of one-token steps on SmolLM2 (bounded: 2 x 48 single steps)."""
    from trikv.calibration import calibrate

    model, tokenizer = real_model
    text = "In the beginning the river carried salt from the hills down to the sea, and the people followed it. " * 8
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :56]
    stats = calibrate(model, ids[0], source="test", chunk_tokens=56, progress=False)
    for method, options in (("triattention", {"stats": stats}), ("snapkv-decode", {})):
        logits = {}
        for max_chunk in (1, 128):
            cache = make_cache(model, method, budget=16, divide_length=8, **options)
            feeder = Feeder(model, cache, max_chunk)
            feeder.feed(ids[:, :8], want_logits=False, prompt=True)
            logits[max_chunk] = feeder.feed(ids[:, 8:])
        assert cache.rounds >= 4
        assert (logits[1].argmax(-1) == logits[128].argmax(-1)).float().mean() == 1.0
        assert torch.allclose(logits[1], logits[128], atol=2e-3), (method, (logits[1] - logits[128]).abs().max())


@pytest.mark.real_model
def test_math_task_smoke(tokenizer):
    """Loading, sampling k answers per problem and pass@1 as the mean (tiny random model: answers are noise)."""
    from trikv.benchmarks.quality import math_task

    problems = math_task.load_problems("math500", limit=2)
    assert len(problems) == 2 and "\\boxed{}" in problems[0]["prompt"] and problems[0]["answer"]
    assert math_task.load_problems("aime24", limit=1)[0]["prompt"].rstrip().endswith("\\boxed{}.")
    with pytest.raises(ValueError):
        math_task.load_problems("gsm9k")
    model = tiny_model(vocab_size=len(tokenizer))
    records = math_task.run_math(model, tokenizer, "streaming", 32, {}, problems[:1], samples=2, max_new_tokens=4, seed=0)
    assert len(records) == 2 and {r["sample"] for r in records} == {0, 1}
    lean = math_task.run_math(model, tokenizer, "streaming", 32, {}, problems[:1], samples=2, max_new_tokens=4, seed=0,
                              engine="lean")
    assert [r["tokens"] for r in lean] == [r["tokens"] for r in records]
    from trikv.benchmarks.quality.runner import config_from_preset

    assert config_from_preset("quick").math_engine == "lean"
    with pytest.raises(ValueError, match="math_engine must be"):
        config_from_preset("quick", math_engine="vllm")
    with pytest.raises(ValueError, match="methods given more than once: full"):
        config_from_preset("quick", methods=["full", "streaming", "full"])
    with pytest.raises(ValueError, match="budgets given more than once: 64"):
        config_from_preset("quick", budgets=[64, 128, 64])
    with pytest.raises(ValueError, match="tasks given more than once: math"):
        config_from_preset("quick", tasks=["math", "math"])
    fake = [{"id": "a", "correct": True, "tokens": 3}, {"id": "a", "correct": False, "tokens": 5},
            {"id": "b", "correct": True, "tokens": 4}, {"id": "b", "correct": True, "tokens": 4}]
    assert math_task.summarise(fake)["pass@1"] == pytest.approx(0.75)


@pytest.mark.real_model
def test_math_batches_problems_and_decodes_greedily(tokenizer):
    """Several problems in one left-padded batch: each record belongs to its own problem and sample, and greedy
    answers equal those of one problem per batch (padding changes nothing)."""
    from trikv.benchmarks.quality import math_task

    problems = math_task.load_problems("math500", limit=3)
    assert len({len(tokenizer(p["prompt"]).input_ids) for p in problems}) > 1  # the batch really is padded
    model = tiny_model(vocab_size=len(tokenizer))
    alone = math_task.run_math(model, tokenizer, "streaming", 32, {}, problems, samples=1, max_new_tokens=12, seed=0,
                               temperature=0, engine="lean")
    counted = []
    batched = math_task.run_math(model, tokenizer, "streaming", 32, {}, problems, samples=2, max_new_tokens=12, seed=0,
                                 temperature=0, engine="lean", problems_per_batch=2, progress=counted.append)
    assert counted == [2, 1]
    assert [(r["id"], r["sample"]) for r in batched] == [(p["id"], s) for p in problems for s in (0, 1)]
    by_problem = {r["id"]: r for r in alone}
    for record in batched:  # greedy: both samples of a problem are its unbatched answer
        assert (record["predicted"], record["tokens"]) == (by_problem[record["id"]]["predicted"], by_problem[record["id"]]["tokens"])
    with pytest.raises(ValueError, match="problems_per_batch must be >= 1"):
        math_task.run_math(model, tokenizer, "streaming", 32, {}, problems, samples=1, max_new_tokens=2, seed=0, problems_per_batch=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        math_task.run_math(model, tokenizer, "streaming", 32, {}, problems, samples=1, max_new_tokens=2, seed=0, temperature=-1)


@pytest.mark.real_model
def test_math_run_reports_its_decoding(tokenizer, tmp_path):
    """A math run through the runner: the report names greedy decoding, the batching, the dtype and each cell's
    mean answer length, and the records come from the math task's own grading."""
    from trikv.benchmarks.quality.pages.tables import text_tables
    from trikv.benchmarks.quality.runner import config_from_preset, run_quality

    model = tiny_model(vocab_size=len(tokenizer))
    config = config_from_preset("quick", tasks=["math"], methods=["full", "streaming"], budgets=[32], math_limit=2,
                                math_samples=1, math_max_new_tokens=5, math_temperature=0.0, math_batch=2)
    record = run_quality(config, tmp_path, model=model, tokenizer=tokenizer, progress=False, log=lambda *a: None)
    meta = record["results"]["math"]["meta"]
    assert (meta["temperature"], meta["top_p"], meta["problems_per_batch"]) == (0.0, None, 2)
    cell = record["results"]["math"]["math500"]["streaming"]["32"]
    assert cell["problems"] == 2 and cell["mean_tokens"] == 5.0
    tables = text_tables(record)
    assert "greedy, 5 new tokens, lean engine, float32, 2 problems per batch" in tables
    assert "(5 tok)" in tables
    # the paired table counts problem by problem: make full solve problem 0 only, streaming problem 1 only
    from trikv.benchmarks.quality import math_task

    math = record["results"]["math"]["math500"]
    ids = sorted(math["full"]["full"]["by_problem"])
    fake = lambda solved: math_task.summarise([{"id": q, "correct": q == solved, "tokens": 5} for q in ids])
    math["full"]["full"], math["streaming"]["32"] = fake(ids[0]), fake(ids[1])
    paired = [line for line in text_tables(record).splitlines() if line.lstrip().startswith("32")]
    assert paired and paired[-1].split() == ["32", "streaming", "0.500", "+0.0", "+1", "/", "-1", "1.00"]
    # a TriAttention variant is set against each baseline, problem by problem
    record["config"]["methods"].append("triattention-dedup")
    math["triattention-dedup"] = {"32": fake(ids[0])}
    against = text_tables(record).split("each TriAttention variant against each baseline")[1].splitlines()
    assert [line.split() for line in against if "triattention-dedup" in line] == [
        ["32", "triattention-dedup", "streaming", "+0.0", "[-100.0,", "+100.0]", "+1", "/", "-1", "1.00"]]


def test_report_says_when_a_run_reused_units_of_earlier_invocations():
    """A run computed in one invocation reports its wall time; a run whose last invocation reused finished units
    says that its wall time covers only part of the compute, instead of a bare near-zero wall time."""
    from trikv.benchmarks.quality.report import _time_line

    assert _time_line({"wall_seconds": 600.0, "compute_seconds": 540.0}) == "wall time 10.0 min (compute over all units 9.0 min)"
    reused = _time_line({"wall_seconds": 2.0, "compute_seconds": 5304.0})
    assert reused.startswith("compute over all units 88.4 min (this invocation's wall time 0.0 min;")
    assert "reused units" in reused
    assert _time_line({"wall_seconds": 90.0}) == "wall time 1.5 min (compute over all units 1.5 min)"


def test_full_attention_is_visible_whatever_the_number_of_budgets():
    """With one budget each method is a bar (full attention's among them, at its value, with the interval as an
    error bar); with several, full attention is a dashed line across the budgets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trikv.benchmarks.quality.pages.plots import _panel

    figure, ax = plt.subplots()
    _panel(ax, [128], {"full": ([0.43], [None]), "rkv": ([0.28], [[0.2, 0.35]])}, "pass@1", "math")
    bars = {label.get_text(): patch.get_width() for label, patch in zip(ax.get_yticklabels(), ax.patches)}
    assert bars == {"full": pytest.approx(0.43), "rkv": pytest.approx(0.28)}
    plt.close(figure)
    figure, ax = plt.subplots()
    _panel(ax, [64, 128], {"full": ([0.43, 0.43], [None, None]), "rkv": ([0.2, 0.28], [None, None])}, "pass@1", "math")
    full = next(line for line in ax.get_lines() if line.get_label() == "full")
    x_data, y_data = (list(map(float, data)) for data in full.get_data())
    assert set(y_data) == {0.43} and x_data == [64.0, 128.0]
    assert full.get_linestyle() == "--"
    plt.close(figure)


def test_sign_test_matches_counting_every_outcome():
    """The exact sign test against its definition: the share of all 2^n win/loss sequences whose split is at
    least as uneven as the observed one."""
    import itertools

    from trikv.benchmarks.quality.pages.verdicts import sign_test

    for wins, losses in ((0, 4), (2, 1), (1, 9), (5, 5), (7, 2), (0, 1), (3, 0)):
        n = wins + losses
        observed = abs(wins - n / 2)
        extreme = sum(abs(sum(signs) - n / 2) >= observed for signs in itertools.product((0, 1), repeat=n))
        assert sign_test(wins, losses) == pytest.approx(extreme / 2 ** n)
    assert sign_test(0, 0) == 1.0
    assert sign_test(0, 4) == pytest.approx(0.125)


@pytest.mark.real_model
def test_a_run_extends_its_grid_and_refuses_another_setup(tokenizer, tmp_path):
    """Another budget or method in the same folder reuses the finished cells (files untouched) and computes only
    the new ones, also for folders written before the grid-free fingerprint was stored; any other change is
    refused, naming the setting."""
    from trikv.benchmarks.quality.runner import config_from_preset, run_quality

    model = tiny_model(vocab_size=len(tokenizer))
    setup = dict(tasks=["math"], math_limit=1, math_samples=1, math_max_new_tokens=3, math_temperature=0.0)
    run = lambda config: run_quality(config, tmp_path, model=model, tokenizer=tokenizer, progress=False, log=lambda *a: None)
    run(config_from_preset("quick", methods=["full", "streaming"], budgets=[32], **setup))
    units = tmp_path / "units"
    first = {p.name: p.stat().st_mtime_ns for p in units.glob("math-*.json")}
    assert set(first) == {"math-math500__full__none.json", "math-math500__streaming__32.json"}
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["setup_fingerprint"]  # as a folder from before it was stored
    (tmp_path / "config.json").write_text(json.dumps(saved))
    record = run(config_from_preset("quick", methods=["full", "streaming", "h2o"], budgets=[32, 48], **setup))
    after = {p.name: p.stat().st_mtime_ns for p in units.glob("math-*.json")}
    assert {name: after[name] for name in first} == first
    assert set(after) - set(first) == {"math-math500__streaming__48.json", "math-math500__h2o__32.json", "math-math500__h2o__48.json"}
    assert set(record["results"]["math"]["math500"]["h2o"]) == {"32", "48"}
    with pytest.raises(ValueError, match="another configuration .*math_max_new_tokens.*only a greedy run may raise"):
        run(config_from_preset("quick", methods=["full", "streaming"], budgets=[32], **(setup | {"math_max_new_tokens": 2})))


@pytest.mark.real_model
def test_a_math_run_extends_to_more_problems_answering_only_the_new_ones(tokenizer, tmp_path, monkeypatch):
    """A larger --limit in the same folder answers only the problems the cells do not hold yet (with the seeds
    and batches a fresh run would give them) and reports the same as a fresh run; a smaller one answers nothing
    and reports the first problems only."""
    from trikv.benchmarks.quality import math_task
    from trikv.benchmarks.quality.runner import config_from_preset, run_quality

    model = tiny_model(vocab_size=len(tokenizer))
    answered, original = [], math_task.run_math
    def counting_run_math(*args, **kwargs):
        answered.append(([p["id"] for p in args[5]], kwargs["first_index"]))
        return original(*args, **kwargs)
    monkeypatch.setattr(math_task, "run_math", counting_run_math)
    # every computed cell hands its freed heap back before the next one starts
    from trikv.benchmarks.speed import machine
    released = []
    monkeypatch.setattr(machine, "release_free_memory", lambda: released.append(len(answered)))
    setup = dict(tasks=["math"], methods=["full", "streaming"], budgets=[32], math_samples=1, math_max_new_tokens=4,
                 math_temperature=0.0, math_batch=2)
    logged = []
    run = lambda folder, limit: run_quality(config_from_preset("quick", math_limit=limit, **setup), folder, model=model,
                                           tokenizer=tokenizer, progress=False, log=logged.append)
    ids = [p["id"] for p in math_task.load_problems("math500", limit=4)]
    run(tmp_path / "grown", 2)
    assert answered == [(ids[:2], 0)] * 2
    assert released == [1, 2]
    first = (tmp_path / "grown" / "units" / "math-math500__streaming__32.json").read_text()
    answered.clear()
    grown = run(tmp_path / "grown", 4)
    assert answered == [(ids[2:], 2)] * 2
    assert any("math problems 2 -> 4" in line for line in logged)
    records = json.loads((tmp_path / "grown" / "units" / "math-math500__streaming__32.json").read_text())["records"]
    assert records[:2] == json.loads(first)["records"] and [r["id"] for r in records] == ids
    # the compute time of a grown run counts each whole cell once, and only the cells of its grid
    cell_seconds = {m: json.loads((tmp_path / "grown" / "units" / f"math-math500__{m}__{b}.json").read_text())["seconds"]
                    for m, b in (("full", "none"), ("streaming", 32))}
    assert grown["compute_seconds"] == pytest.approx(sum(cell_seconds.values()))
    only_streaming = run_quality(config_from_preset("quick", math_limit=4, **(setup | {"methods": ["streaming"]})),
                                 tmp_path / "grown", model=model, tokenizer=tokenizer, progress=False, log=logged.append)
    assert only_streaming["compute_seconds"] == pytest.approx(cell_seconds["streaming"])
    fresh = run(tmp_path / "fresh", 4)
    assert grown["results"]["math"]["math500"] == fresh["results"]["math"]["math500"]
    answered.clear()
    shrunk = run(tmp_path / "grown", 1)
    assert answered == []
    assert shrunk["results"]["math"]["math500"]["streaming"]["32"]["by_problem"].keys() == {ids[0]}


@pytest.mark.real_model
def test_a_greedy_math_run_raises_its_token_cap_answering_again_only_the_answers_cut_short(tokenizer, tmp_path, monkeypatch):
    """A higher --max-new-tokens in a greedy run's folder generates again only the answers that reached the old
    cap; an answer that ended before it is kept as it is, and the cells then equal a fresh run's at the new cap.
    The report counts the answers per cap. Lowering the cap, or raising it under sampling, is refused."""
    from transformers import AutoTokenizer

    from trikv.benchmarks.quality import math_task
    from trikv.benchmarks.quality.pages.tables import text_tables
    from trikv.benchmarks.quality.runner import config_from_preset, run_quality
    from trikv.generation import generate
    from trikv.models import resolve_model_path

    model = tiny_model(vocab_size=len(tokenizer))
    problems = math_task.load_problems("math500", limit=3)
    ids = [p["id"] for p in problems]
    # an end-of-text token that the first problem's greedy answer emits early and the other two never emit in 8
    # tokens (under both methods): under a cap of 4 the first answer ends, the other two are cut short
    prompts = [p["prompt"] for p in problems]
    answers = [generate(model, tokenizer, prompts, method="full", max_new_tokens=8, engine="lean").tokens,
               generate(model, tokenizer, prompts, method="streaming", budget=32, divide_length=128, max_new_tokens=8,
                        engine="lean").tokens]
    position, stop = next((i, t) for i, t in enumerate(answers[0][0][:3])
                          if all(t not in a[0][:i] and t == a[0][i] and t not in a[1] + a[2] for a in answers))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))  # not the shared one
    tokenizer.eos_token_id = stop
    answered, original = [], math_task.run_math
    def counting_run_math(*args, **kwargs):
        answered.append((args[2], [p["id"] for p in args[5]]))
        return original(*args, **kwargs)
    monkeypatch.setattr(math_task, "run_math", counting_run_math)
    setup = dict(tasks=["math"], methods=["full", "streaming"], budgets=[32], math_limit=3, math_samples=1,
                 math_temperature=0.0, math_batch=2)
    logged = []
    run = lambda folder, cap, **extra: run_quality(config_from_preset("quick", math_max_new_tokens=cap, **(setup | extra)),
                                                   folder, model=model, tokenizer=tokenizer, progress=False, log=logged.append)
    run(tmp_path / "raised", 4)
    cell_path = tmp_path / "raised" / "units" / "math-math500__streaming__32.json"
    before = json.loads(cell_path.read_text())["records"]
    assert [r["tokens"] for r in before] == [position + 1, 4, 4]
    # a folder written before records named their cap: the cap comes from its configuration
    for path in (tmp_path / "raised" / "units").glob("math-*.json"):
        unit = json.loads(path.read_text())
        path.write_text(json.dumps(unit | {"records": [{k: v for k, v in r.items() if k != "max_new_tokens"} for r in unit["records"]]}))
    answered.clear()
    raised = run(tmp_path / "raised", 8)
    assert answered == [("full", ids[1:]), ("streaming", ids[1:])], [l for l in logged if "reused" in l]
    assert any("math token cap 4 -> 8: only the answers that reached 4 tokens are generated again" in line for line in logged)
    after = json.loads(cell_path.read_text())["records"]
    assert [r["id"] for r in after] == ids and after[0] == before[0] | {"max_new_tokens": 4}
    assert [(r["tokens"], r["max_new_tokens"]) for r in after[1:]] == [(8, 8), (8, 8)]
    fresh = run(tmp_path / "fresh", 8)
    for method, budget in (("full", "full"), ("streaming", "32")):
        raised_cell = raised["results"]["math"]["math500"][method][budget]
        fresh_cell = fresh["results"]["math"]["math500"][method][budget]
        assert raised_cell["answers_by_cap"] == {"4": 1, "8": 2} and fresh_cell["answers_by_cap"] == {"8": 3}
        assert {k: v for k, v in raised_cell.items() if k != "answers_by_cap"} == {k: v for k, v in fresh_cell.items() if k != "answers_by_cap"}
    tables = text_tables(raised)
    assert "answers by the token cap they were generated under" in tables and "1 @ 4, 2 @ 8" in tables
    assert "answers by the token cap" not in text_tables(fresh)
    # the same cap again answers nothing; an answer cut short at 8 is not mistaken for one that ended after a cap raise
    answered.clear()
    run(tmp_path / "raised", 8)
    assert answered == []
    with pytest.raises(ValueError, match="differs in math_max_new_tokens.*only a greedy run may raise"):
        run(tmp_path / "raised", 6)
    run(tmp_path / "sampled", 4, math_temperature=0.6)
    with pytest.raises(ValueError, match="differs in math_max_new_tokens.*only a greedy run may raise"):
        run(tmp_path / "sampled", 8, math_temperature=0.6)


@pytest.mark.real_model
def test_a_stopped_run_keeps_the_compute_time_of_its_finished_cells(tokenizer, tmp_path, monkeypatch):
    """A run stopped after its first cell, then resumed: the resumed run's compute time counts the finished cell's
    time (saved after that cell, or else read from the cell) as well as the cell computed on resuming."""
    from trikv.benchmarks.quality import math_task
    from trikv.benchmarks.quality.runner import config_from_preset, run_quality

    model = tiny_model(vocab_size=len(tokenizer))
    original = math_task.run_math
    def stopping_after_full(*args, **kwargs):
        if args[2] != "full":
            raise KeyboardInterrupt
        return original(*args, **kwargs)
    config = config_from_preset("quick", tasks=["math"], methods=["full", "streaming"], budgets=[32], math_limit=2,
                                math_samples=1, math_max_new_tokens=3, math_temperature=0.0)
    run = lambda: run_quality(config, tmp_path, model=model, tokenizer=tokenizer, progress=False, log=lambda *a: None)
    monkeypatch.setattr(math_task, "run_math", stopping_after_full)
    with pytest.raises(KeyboardInterrupt):
        run()
    assert not (tmp_path / "results.json").exists()
    monkeypatch.setattr(math_task, "run_math", original)
    record = run()
    seconds = {m: json.loads((tmp_path / "units" / f"math-math500__{m}__{b}.json").read_text())["seconds"]
               for m, b in (("full", "none"), ("streaming", 32))}
    assert record["compute_seconds"] == pytest.approx(sum(seconds.values()))
    # a folder stopped before the timings were saved after each cell: the cells' own times stand in
    (tmp_path / "units" / "timings.json").unlink()
    assert run()["compute_seconds"] == pytest.approx(sum(seconds.values()))


def test_math_and_dtype_settings_are_checked_and_fingerprinted():
    from trikv.benchmarks.quality.runner import QualityConfig, config_from_preset

    for key, value, message in (("math_temperature", -0.5, "math_temperature must be >= 0"),
                                ("math_batch", 0, "math_batch must be >= 1"), ("dtype", "int8", "dtype must be one of")):
        with pytest.raises(ValueError, match=message):
            config_from_preset("quick", **{key: value})
    # at their defaults the later settings leave the fingerprint of an older run unchanged; set, they change it
    base = QualityConfig()
    later = ("math_temperature", "math_batch", "dtype", "math_problems", "traces", "trace_tokens", "min_decode_room",
             "prefill_prompt_tokens", "prefill_continuation_tokens", "prefill_chunk")
    record = {k: v for k, v in dataclasses.asdict(base).items() if k not in later}
    older = hashlib.sha256(json.dumps({**record, "text_file_sha256": []}, sort_keys=True).encode()).hexdigest()[:16]
    assert base.fingerprint() == older
    assert len({base.fingerprint(), QualityConfig(dtype="bfloat16").fingerprint(), QualityConfig(math_batch=4).fingerprint(),
                QualityConfig(math_temperature=0.0).fingerprint(), QualityConfig(math_problems=["math500-7"]).fingerprint()}) == 5


def test_dfs_prompt_is_checked_and_fingerprinted_only_where_dfs_runs():
    """Folders without DFS units, written before the prompt choice existed, still resume; DFS folders do not
    (their units were scored under the plain prompt)."""
    from trikv.benchmarks.quality.runner import QualityConfig, config_from_preset

    with pytest.raises(ValueError, match="dfs_prompt must be chat or plain, got 'json'"):
        config_from_preset("quick", dfs_prompt="json")
    later = ("math_temperature", "math_batch", "dtype", "math_problems", "traces", "trace_tokens",
             "min_decode_room", "prefill_prompt_tokens", "prefill_continuation_tokens",
             "prefill_chunk")  # left out at their defaults

    def older(config):  # the fingerprint of the same run before the prompt choice existed
        record = {k: v for k, v in dataclasses.asdict(config).items() if k not in (*later, "dfs_prompt")}
        return hashlib.sha256(json.dumps({**record, "text_file_sha256": []}, sort_keys=True).encode()).hexdigest()[:16]

    math_only = QualityConfig(tasks=["math"])
    assert math_only.fingerprint() == older(math_only)
    with_dfs = QualityConfig(tasks=["dfs"])
    assert with_dfs.fingerprint() != older(with_dfs)
    assert with_dfs.fingerprint() != QualityConfig(tasks=["dfs"], dfs_prompt="plain").fingerprint()


@pytest.mark.real_model
def test_math_problems_chosen_by_id_are_answered_in_dataset_order(tokenizer, tmp_path):
    """--problems answers exactly the named rows (their own problem and answer from the dataset file), in dataset
    order, instead of the first --limit ones, and the report names them."""
    import argparse

    from trikv.benchmarks.quality.cli import add_quality_arguments, config_from_args
    from trikv.benchmarks.quality.math_task import DATASETS_DIR
    from trikv.benchmarks.quality.pages.tables import text_tables
    from trikv.benchmarks.quality.runner import run_quality

    parser = argparse.ArgumentParser()
    add_quality_arguments(parser)
    args = parser.parse_args(["--task", "math", "--methods", "full,streaming", "--budgets", "32", "--problems",
                              "math500-7,math500-3", "--samples", "1", "--max-new-tokens", "3", "--temperature", "0"])
    config = config_from_args(args)
    assert (config.math_problems, config.math_limit) == (["math500-7", "math500-3"], None)
    model = tiny_model(vocab_size=len(tokenizer))
    record = run_quality(config, tmp_path, model=model, tokenizer=tokenizer, progress=False, log=lambda *a: None)
    rows = [json.loads(line) for line in (DATASETS_DIR / "math500.jsonl").read_text().splitlines() if line.strip()]
    for method, budget in (("full", "none"), ("streaming", "32")):
        records = json.loads((tmp_path / "units" / f"math-math500__{method}__{budget}.json").read_text())["records"]
        assert [(r["id"], r["answer"]) for r in records] == [("math500-3", str(rows[3]["answer"])), ("math500-7", str(rows[7]["answer"]))]
    assert "2 problems, chosen by id: math500-7, math500-3;" in text_tables(record)


def test_consecutive_problem_ids_are_written_as_ranges():
    from trikv.benchmarks.quality.pages.tables import _id_ranges

    ids = [f"math500-{i}" for i in range(300, 400)] + ["math500-7", "math500-3", "aime25-2", "aime25-3", "aime24-4"]
    assert _id_ranges(ids) == "math500-300..math500-399, math500-7, math500-3, aime25-2..aime25-3, aime24-4"
    assert _id_ranges(["math500-9"]) == "math500-9"


def test_problems_chosen_by_id_extend_a_run_in_chunks(tokenizer, tmp_path):
    """A run split into chunks: a later list of ids that starts with the folder's list reuses its answers and
    answers only the new problems; a list the folder's list starts with reuses its answers; any other list is
    refused."""
    from trikv.benchmarks.quality.runner import config_from_preset, run_quality

    model = tiny_model(vocab_size=len(tokenizer))
    setup = dict(tasks=["math"], methods=["streaming"], budgets=[32], math_samples=1, math_max_new_tokens=3, math_temperature=0.0)
    messages = []
    run_quality(config_from_preset("quick", math_problems=["math500-3"], **setup), tmp_path, model=model,
                tokenizer=tokenizer, progress=False, log=lambda *a: None)
    unit = tmp_path / "units" / "math-math500__streaming__32.json"
    first = json.loads(unit.read_text())["records"]
    run_quality(config_from_preset("quick", math_problems=["math500-3", "math500-7"], **setup), tmp_path, model=model,
                tokenizer=tokenizer, progress=False, log=messages.append)
    records = json.loads(unit.read_text())["records"]
    assert [r["id"] for r in records] == ["math500-3", "math500-7"] and records[0] == first[0]
    assert any("math problems by id 1 -> 2" in m for m in messages) and any("(1 of 2 problems answered now" in m for m in messages)
    # a list the folder's starts with: the same run at a smaller extent (another method's chunks may follow it)
    messages.clear()
    record = run_quality(config_from_preset("quick", math_problems=["math500-3"], **setup), tmp_path, model=model,
                         tokenizer=tokenizer, progress=False, log=messages.append)
    assert any("math problems by id 2 -> 1" in m for m in messages) and not any("answered now" in m for m in messages)
    assert json.loads(unit.read_text())["records"] == records
    assert record["results"]["math"]["math500"]["streaming"]["32"]["problems"] == 1
    with pytest.raises(ValueError, match="differs in math_problems"):
        run_quality(config_from_preset("quick", math_problems=["math500-9"], **setup), tmp_path, model=model,
                    tokenizer=tokenizer, progress=False, log=lambda *a: None)


def test_bad_math_problem_ids_are_refused_with_the_reason():
    from trikv.benchmarks.quality.runner import config_from_preset

    setup = dict(tasks=["math"])
    for ids, extra, message in (
            (["math500-9999"], {}, r"unknown math problem id\(s\) math500-9999: ids are DATASET-ROW .*math500 \(rows 0-499\)"),
            (["gsm8k-1"], {}, r"unknown math problem id\(s\) gsm8k-1"),
            (["math500-x"], {}, r"unknown math problem id\(s\) math500-x"),
            (["math500-260"], {}, r"math500-260 are reserved: shipped statistics were calibrated on them"),
            (["math500-1", "math500-1"], {}, "given more than once: math500-1"),
            ([], {}, "list of math problem ids is empty"),
            (["math500-1"], {"math_datasets": ["math500", "aime24"]}, r"no problem id of dataset\(s\) aime24"),
            (["math500-1"], {"math_limit": 5}, "either math problem ids or a problem limit")):
        with pytest.raises(ValueError, match=message):
            config_from_preset("quick", math_problems=ids, **setup, **extra)


@pytest.mark.real_model
def test_dfs_generative_mode_smoke(tokenizer):
    model = tiny_model(vocab_size=len(tokenizer))
    graphs = dfs.make_graphs(1, seed=0, min_steps=4)
    records = dfs.run_generative(model, tokenizer, "streaming", 32, {}, graphs, [2, 4], tokens_per_step=1, extra_tokens=4)
    assert [r["k"] for r in records] == [2, 4]
    assert all(set(r) >= {"node", "stack", "visited", "all", "parsed"} for r in records)
    summary = dfs.summarise(records)
    assert summary["items"] == 2 and set(summary["by_k"]) == {"2", "4"}


def test_math_evaluation_skips_the_rows_the_shipped_statistics_were_calibrated_on():
    from trikv.benchmarks.quality import math_task

    reserved = math_task.reserved_rows("math500")
    assert reserved == set(range(250, 298))  # the bundled SmolLM2 statistics' provenance
    problems = math_task.load_problems("math500")
    ids = {int(p["id"].split("-")[1]) for p in problems}
    assert len(problems) == 500 - len(reserved) and not ids & reserved
    assert [p["id"] for p in math_task.load_problems("math500", limit=252)][-2:] == ["math500-298", "math500-299"]
    assert math_task.reserved_rows("aime24") == set()


def test_prefill_task_compares_compaction_while_prefilling_with_compaction_after(tmp_path, tokenizer):
    """`--task prefill`: windows of the texts, each prompt compacted while prefilled in chunks (peak budget + slack +
    chunk, rounds inside the prompt) and prefilled whole (peak the prompt, the first round after it); the page's
    paired difference is the difference of the two pooled KLs, read by its interval."""
    from trikv.benchmarks.quality.intervals import paired_fidelity_difference
    from trikv.benchmarks.quality.pages.tables import sections
    from trikv.benchmarks.quality.runner import config_from_preset, run_quality

    model = tiny_model(vocab_size=len(tokenizer))
    stats = tiny_stats(model)
    config = config_from_preset("quick", tasks=["prefill"], methods=["triattention", "streaming"], budgets=[48],
                                divide_length=16, texts=["python-reference"], prefill_prompt_tokens=200,
                                prefill_continuation_tokens=64, prefill_chunk=40)
    record = run_quality(config, tmp_path / "run", model=model, tokenizer=tokenizer, stats=stats, progress=False,
                         log=lambda *a: None)
    prefill = record["results"]["prefill"]
    assert len(prefill["meta"]["windows"]) >= 2 and prefill["meta"]["windows"][0] == "python-reference#0"
    for method in ("triattention", "streaming"):
        during, after = prefill["during"][method]["48"], prefill["after"][method]["48"]
        assert during["peak_entries"] <= 48 + 16 + 40 < after["peak_entries"] == 200
        assert min(during["first_round"]) < 200 <= min(after["first_round"])  # rounds inside the prompt, or after it
        assert during["positions"] == after["positions"] == 63 * len(prefill["meta"]["windows"])
        difference = prefill["during_minus_after"][method]["48"]["kl"]
        assert difference["difference"] == pytest.approx(during["kl"] - after["kl"])
        low, high = difference["ci"]
        assert low <= difference["difference"] <= high
        assert paired_fidelity_difference(during, during)["kl"] == {"difference": 0.0, "ci": [0.0, 0.0]}
    title, table = next((t, x) for t, x in sections(record, markdown=True) if t.startswith("Compaction while prefilling"))
    assert "windows of 200 prompt + 64 teacher-forced tokens" in title and "| 48 | triattention |" in table
    with pytest.raises(ValueError, match=r"budgets \[256\] leave the 200-token prompt nothing to compact"):
        config_from_preset("quick", tasks=["prefill"], budgets=[256], prefill_prompt_tokens=200)


def test_the_fidelity_page_counts_protected_prompts_and_h2o_without_heavy_hitters():
    """At B = 128 with 32 slots of decode room: prompts of 10, 64, 70 and 96 tokens are protected, 97 and 200 are
    not; H2O's window is 64, so the protected prompts of 64 tokens or more leave it no heavy hitter (64, 70, 96)."""
    from trikv.benchmarks.quality.pages.summary import protected_prompts
    from trikv.benchmarks.quality.pages.tables import _compressed_share

    cell = {"positions": 100, "compressed": {"positions": 90}}
    record = {"config": {"protect_prompt": True, "min_decode_room": 32, "budgets": [128], "methods": ["full", "h2o"]},
              "results": {"fidelity": {"meta": {"prompt_lengths": [10, 64, 70, 96, 97, 200]},
                                       "methods": {"full": {"None": cell}, "h2o": {"128": cell}}}}}
    assert protected_prompts(record, 128) == (4, 6)
    (row,) = _compressed_share(record, record["results"]["fidelity"]["methods"])
    assert row[2:] == ["4 / 6", "3 / 6"]
    record["config"]["protect_prompt"] = False
    assert protected_prompts(record, 128) == (0, 6)
    assert _compressed_share(record, record["results"]["fidelity"]["methods"])[0][2:] == ["0 / 6", "0 / 6"]


def test_sign_flip_p_and_holm_against_direct_counts():
    """The sign-flip p-value equals a count over every sign pattern written out with itertools; Holm's rule on a
    hand example (m = 4, alpha 5%: thresholds 0.0125, 0.0167, 0.025, 0.05)."""
    import itertools

    from trikv.benchmarks.quality.pages.verdicts import holm_survivors, sign_flip_p

    differences = [0.5, 1.25, -0.25, 2.0, 0.75, -1.0, 1.5]
    observed = abs(sum(differences))
    patterns = list(itertools.product((-1, 1), repeat=len(differences)))
    direct = sum(abs(sum(s * d for s, d in zip(signs, differences))) >= observed for signs in patterns) / len(patterns)
    assert sign_flip_p(differences) == pytest.approx(direct) and 0 < direct < 1
    assert sign_flip_p([1.0] * 8) == pytest.approx(2 / 256)  # the smallest an 8-text test can give
    assert holm_survivors([0.01, 0.04, 0.012, 0.2]) == [True, False, True, False]  # 0.04 > 0.025 stops the rest
    assert holm_survivors([0.02, 0.001]) == [True, True]  # 0.001 <= 0.025, then 0.02 <= 0.05
    assert holm_survivors([0.03, 0.03]) == [False, False]  # 0.03 > 0.025: nothing passes
