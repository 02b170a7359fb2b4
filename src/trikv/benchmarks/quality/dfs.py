"""Task 3: Recursive State Query (DFS), the paper's memory-retention benchmark.

Graphs: random labelled trees and connected Watts-Strogatz small-world graphs (k = 4, p = 0.1), 10-30
nodes, node labels randomly permuted (so the traversal is not the ring order), start node 0.
DFS: deterministic smallest-neighbour rule. A step either visits (the smallest unvisited neighbour of the
current node is pushed) or backtracks (the stack is popped); the walk ends when the root would be popped.
The state after step k: current node (top of the stack), the stack (root first) and the visited nodes
(in order of first visit).

Teacher-forced mode: the prompt lists the graph and the rules, then the correct trace of actions up to
step k ("Step 7: visit 12" / "Step 8: back to 5"), then asks for the state. The trace never states the
stack or the visited list, so answering needs the earlier lines: the current node is in the last line,
the stack needs the visits of all open ancestors, the visited list needs every visit line. The expected
answer is scored field by field under teacher forcing: a field is right when every token that overlaps it
is the model's greedy choice given the correct text before it (exactly what greedy decoding would write);
the answer is tokenised as one text, as the model writes it. With the "chat" prompt (the default where the
tokenizer has a chat template) graph, trace and question form the user's turn and the answer is the
assistant's reply: asked in plain text, Qwen2.5-Coder-1.5B-Instruct drifted from the answer's form
("current node 11 <11, 10, ...>"), failing fields whatever it remembered. The "plain" prompt is the same
text without turn markers, ending in "Answer:".
Cost sharing: one pass over the trace per graph; at each queried k the cache is forked and the question
+ answer fed to the fork.

Generative mode: the prompt asks the model to simulate the steps and end with "Answer:" and a JSON object
{"current_node", "stack", "visited_nodes"}; the last such object in the output is parsed and compared.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

import torch

from ...settings import DEFAULT_DIVIDE_LENGTH
from .feeding import Feeder


# ---- graphs -------------------------------------------------------------------------------------------
def random_tree(n: int, rng: random.Random) -> list[tuple[int, int]]:
    """A uniformly random labelled tree on n nodes (Pruefer sequence)."""
    if n < 2:
        return []
    sequence = [rng.randrange(n) for _ in range(n - 2)]
    degree = [1] * n
    for node in sequence:
        degree[node] += 1
    edges = []
    for node in sequence:
        leaf = min(i for i in range(n) if degree[i] == 1)
        edges.append((leaf, node))
        degree[leaf] -= 1
        degree[node] -= 1
    u, v = [i for i in range(n) if degree[i] == 1]
    edges.append((u, v))
    return _normalise(edges)


def watts_strogatz(n: int, k: int, p: float, rng: random.Random, tries: int = 100) -> list[tuple[int, int]]:
    """A connected Watts-Strogatz small-world graph: ring lattice of degree k, each edge rewired with prob p."""
    if k % 2 or k >= n:
        raise ValueError(f"k must be even and below n (got k={k}, n={n})")
    for _ in range(tries):
        edges = {tuple(sorted((i, (i + j) % n))) for i in range(n) for j in range(1, k // 2 + 1)}
        for j in range(1, k // 2 + 1):  # networkx order: per neighbour distance, per node
            for i in range(n):
                edge = tuple(sorted((i, (i + j) % n)))
                if edge in edges and rng.random() < p:
                    u = i
                    choices = [w for w in range(n) if w != u and tuple(sorted((u, w))) not in edges]
                    if choices:
                        w = rng.choice(choices)
                        edges.discard(edge)
                        edges.add(tuple(sorted((u, w))))
        if _connected(n, edges):
            return _normalise(edges)
    raise RuntimeError("could not draw a connected Watts-Strogatz graph")


def _connected(n: int, edges) -> bool:
    adjacency = _adjacency(n, edges)
    seen, todo = {0}, [0]
    while todo:
        for w in adjacency[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return len(seen) == n


def _normalise(edges) -> list[tuple[int, int]]:
    return sorted({tuple(sorted(e)) for e in edges})


def _adjacency(n: int, edges) -> list[list[int]]:
    adjacency = [[] for _ in range(n)]
    for u, v in edges:
        adjacency[u].append(v)
        adjacency[v].append(u)
    return [sorted(a) for a in adjacency]


def relabel(n: int, edges, rng: random.Random) -> list[tuple[int, int]]:
    """Random permutation of the labels (the start node 0 is then a random original node)."""
    perm = list(range(n))
    rng.shuffle(perm)
    return _normalise((perm[u], perm[v]) for u, v in edges)


# ---- DFS ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DfsState:
    action: str  # "start", "visit" or "back"
    node: int  # current node after the step (top of the stack)
    stack: tuple[int, ...]
    visited: tuple[int, ...]  # in order of first visit


def dfs_trace(n: int, edges, start: int = 0) -> list[DfsState]:
    """States [after step 0 (the start), after step 1, ...] of smallest-neighbour DFS from `start`."""
    adjacency = _adjacency(n, edges)
    stack, visited = [start], [start]
    seen = {start}
    states = [DfsState("start", start, tuple(stack), tuple(visited))]
    while stack:
        current = stack[-1]
        nxt = next((w for w in adjacency[current] if w not in seen), None)
        if nxt is not None:
            stack.append(nxt)
            visited.append(nxt)
            seen.add(nxt)
            states.append(DfsState("visit", nxt, tuple(stack), tuple(visited)))
        elif len(stack) > 1:
            stack.pop()
            states.append(DfsState("back", stack[-1], tuple(stack), tuple(visited)))
        else:
            break  # the root would be popped: the traversal is over
    return states


def state_after(n: int, edges, k: int) -> DfsState:
    states = dfs_trace(n, edges)
    if k >= len(states):
        raise ValueError(f"the traversal has only {len(states) - 1} steps, asked for step {k}")
    return states[k]


# ---- items -------------------------------------------------------------------------------------------
@dataclass
class DfsGraph:
    kind: str  # "tree" or "smallworld"
    n: int
    edges: list[tuple[int, int]]
    seed: int

    @property
    def states(self) -> list[DfsState]:
        return dfs_trace(self.n, self.edges)


def make_graphs(count: int, seed: int, min_nodes: int = 10, max_nodes: int = 30, min_steps: int = 0) -> list[DfsGraph]:
    """`count` graphs alternating tree / small-world, each with at least `min_steps` DFS steps."""
    graphs = []
    rng = random.Random(seed)
    while len(graphs) < count:
        kind = "tree" if len(graphs) % 2 == 0 else "smallworld"
        graph_seed = rng.randrange(2**31)
        g = random.Random(graph_seed)
        n = g.randint(min_nodes, max_nodes)
        edges = random_tree(n, g) if kind == "tree" else watts_strogatz(n, 4, 0.1, g)
        edges = relabel(n, edges, g)
        graph = DfsGraph(kind, n, edges, graph_seed)
        if len(graph.states) - 1 >= min_steps:
            graphs.append(graph)
    return graphs


RULES = (
    "Depth-first search rules: start at node 0 with the stack [0]. At each step, if the current node (the top "
    "of the stack) has unvisited neighbours, visit the smallest one and push it on the stack; otherwise go "
    "back: pop the stack, and the new top becomes the current node."
)


def graph_text(graph: DfsGraph) -> str:
    edges = ", ".join(f"{u}-{v}" for u, v in graph.edges)
    return f"An undirected graph has nodes 0 to {graph.n - 1} and these edges: {edges}.\n{RULES}\n"


def step_line(index: int, state: DfsState) -> str:
    if state.action == "visit":
        return f"Step {index}: visit {state.node}\n"
    return f"Step {index}: back to {state.node}\n"


def question_text(k: int) -> str:
    # The answer's form is stated with placeholders: without it a model's greedy choice after "current node" is
    # punctuation (":"), which fails the field on format alone. Letters, not angle brackets, as placeholders:
    # models copied "<" into their answer, and example numbers get copied too.
    return (
        f"Question: after step {k}, what is the current node, the stack (from the root) and the list of "
        f"visited nodes (in the order they were first visited)? Reply with one line only, in the form: "
        f"current node N; stack [A, B, ...]; visited [A, B, ...]"
    )


DFS_PROMPTS = ("chat", "plain")


def prompt_frame(tokenizer, prompt: str = "chat") -> tuple[str, str]:
    """(before, after) the user's text up to where the expected answer starts.

    "chat": the chat template's markers around one user turn, ending where the assistant's reply begins
    (falls back to "plain" where the tokenizer has no template); "plain": no markers, "\nAnswer:" after.
    """
    if prompt not in DFS_PROMPTS:
        raise ValueError(f"DFS prompt must be one of {', '.join(DFS_PROMPTS)}, got {prompt!r}")
    if prompt == "chat" and getattr(tokenizer, "chat_template", None):
        marker = "\x00DFS\x00"
        framed = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                               tokenize=False)
        before, after = framed.split(marker)
        return before, after
    return "", "\nAnswer:"


def answer_fields(state: DfsState, lead: str = " ") -> list[tuple[str, str]]:
    """(field, text) pieces of the expected answer, in order; the scored fields are node / stack / visited.
    `lead` starts the answer: a space after "Answer:", nothing at the start of the assistant's turn."""
    stack = ", ".join(map(str, state.stack))
    visited = ", ".join(map(str, state.visited))
    return [
        ("", f"{lead}current node"),
        ("node", f" {state.node}"),
        ("", "; stack"),
        ("stack", f" [{stack}]"),
        ("", "; visited"),
        ("visited", f" [{visited}]"),
    ]


def answer_tokens(tokenizer, state: DfsState, lead: str = " ") -> tuple[list[int], dict[str, tuple[int, int]]]:
    """The expected answer's token ids and each scored field's [start, end) token span.

    The answer is encoded as one text, so its tokens are the ones greedy decoding writes: a field's closing
    bracket and the separator after it can be one token ("];"), which a field encoded on its own never
    produces. A field's span is every token that overlaps its characters.
    """
    text, char_spans = "", {}
    for name, piece in answer_fields(state, lead):
        if name:
            char_spans[name] = (len(text), len(text) + len(piece))
        text += piece
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    spans = {}
    for name, (low, high) in char_spans.items():
        inside = [i for i, (start, end) in enumerate(offsets) if start < high and end > low]
        spans[name] = (inside[0], inside[-1] + 1)
    return list(encoded["input_ids"]), spans


def teacher_forced_prefix(graph: DfsGraph, before: str = "") -> str:
    return before + graph_text(graph) + "Trace:\nStep 0: start at 0\n"


# ---- teacher-forced scoring ------------------------------------------------------------------------
def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def score_fields(logits: torch.Tensor, targets: torch.Tensor, spans: dict[str, tuple[int, int]]) -> dict:
    """logits [n, V] predicting targets [n]; spans: field -> [start, end) in target positions."""
    greedy = logits.argmax(-1) == targets
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    out = {}
    for name, (start, end) in spans.items():
        out[name] = bool(greedy[start:end].all())
        out[f"{name}_tokens"] = float(greedy[start:end].float().mean())  # share of greedy-right tokens
        out[f"{name}_logprob"] = float(logp[start:end].mean())  # mean log-probability per token
    out["all"] = all(out[name] for name in spans)
    return out


@torch.no_grad()
def run_teacher_forced(model, tokenizer, cache_factory, graphs: list[DfsGraph], ks: list[int], max_chunk: int = 128,
                       progress=None, full_records: list[dict] | None = None,
                       eviction_threshold: int | None = None, prompt: str = "chat") -> list[dict]:
    """Teacher-forced state queries: for every graph, fork the cache after step k for each k in `ks`.

    `prompt` ("chat" or "plain") frames graph, trace and question (see `prompt_frame`).

    With `full_records` (the full-attention records of the same graphs) and the cache's `eviction_threshold`
    (budget + divide_length), a graph whose whole input fits below the threshold is never compressed: its
    records are the full-attention ones (marked `uncompressed`), and it is not recomputed.
    """
    from ...prompts import leading_ids

    before, after = prompt_frame(tokenizer, prompt)
    lead = "" if before else " "  # the assistant's reply starts its own line; after "Answer:" a space

    def ask(k: int) -> str:
        return question_text(k) + after

    records = []
    for graph_index, graph in enumerate(graphs):
        states = graph.states
        # a plain frame starts with the model's leading special tokens (BOS); a chat frame carries its own markers
        prefix = ([] if before else leading_ids(tokenizer)) + _encode(tokenizer, teacher_forced_prefix(graph, before))
        wanted = sorted(k for k in set(ks) if 1 <= k < len(states))
        if full_records is not None and eviction_threshold is not None and wanted:
            longest = len(prefix) + len(_encode(tokenizer, "".join(step_line(i, states[i]) for i in range(1, wanted[-1] + 1))))
            longest += max(len(_encode(tokenizer, ask(k))) + len(answer_tokens(tokenizer, states[k], lead)[0])
                           for k in wanted)
            if longest < eviction_threshold:
                records += [dict(r, uncompressed=True) for r in full_records if r["graph"] == graph_index]
                continue
        cache = cache_factory()
        feeder = Feeder(model, cache, max_chunk)
        feeder.feed(torch.tensor([prefix]), want_logits=False, prompt=True)
        tokens = len(prefix)
        step = 0
        for k in wanted:
            lines = "".join(step_line(i, states[i]) for i in range(step + 1, k + 1))
            if lines:
                ids = _encode(tokenizer, lines)
                feeder.feed(torch.tensor([ids]), want_logits=False)
                tokens += len(ids)
                if progress is not None:
                    progress(len(ids))
            step = k
            fork = feeder.fork()
            question = _encode(tokenizer, ask(k))
            answer, spans = answer_tokens(tokenizer, states[k], lead)
            sequence = torch.tensor([question + answer])
            # logits at positions predicting each answer token: the last question token .. the second-to-last answer token
            logits = fork.feed(sequence, want_logits=slice(len(question) - 1, len(question) + len(answer) - 1))[0]
            scored = score_fields(logits, torch.tensor(answer), spans)
            records.append({
                "graph": graph_index, "kind": graph.kind, "nodes": graph.n, "k": k,
                "context_tokens": tokens + len(question), **scored,
            })
            if progress is not None:
                progress(len(question) + len(answer))
    return records


# ---- generative mode --------------------------------------------------------------------------------
def generative_prompt(graph: DfsGraph, k: int) -> str:
    return (
        graph_text(graph)
        + f"Simulate the search step by step, writing one line per step (\"Step i: visit X\" or \"Step i: back to X\"), "
        f"up to step {k}. Then write \"Answer:\" followed by a JSON object with the state after step {k}: "
        '{"current_node": ..., "stack": [...], "visited_nodes": [...]} (stack from the root, visited nodes in '
        "the order they were first visited)."
    )


_JSON = re.compile(r"\{[^{}]*\}")


def parse_answer(text: str) -> dict | None:
    """The last parseable {...} object after the last "Answer:" (or anywhere, if there is none)."""
    tail = text.rsplit("Answer:", 1)[-1]
    for candidate in reversed(_JSON.findall(tail) or _JSON.findall(text)):
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def score_generated(text: str, state: DfsState) -> dict:
    answer = parse_answer(text) or {}

    def ints(value):
        try:
            return [int(v) for v in value]
        except (TypeError, ValueError):
            return None

    try:
        node_ok = int(answer.get("current_node")) == state.node
    except (TypeError, ValueError):
        node_ok = False
    stack = ints(answer.get("stack"))
    visited = ints(answer.get("visited_nodes"))
    out = {
        "parsed": bool(answer),
        "node": node_ok,
        "stack": stack == list(state.stack),
        "visited": visited is not None and set(visited) == set(state.visited),
    }
    out["all"] = out["node"] and out["stack"] and out["visited"]
    return out


def run_generative(model, tokenizer, method: str, budget: int | None, method_options: dict, graphs: list[DfsGraph],
                   ks: list[int], tokens_per_step: int = 12, extra_tokens: int = 96, batch_size: int = 4,
                   divide_length: int = DEFAULT_DIVIDE_LENGTH) -> list[dict]:
    from ...generation import generate

    items = []
    for graph_index, graph in enumerate(graphs):
        states = graph.states
        for k in sorted(set(ks)):
            if 1 <= k < len(states):
                items.append((graph_index, graph, k))
    records = []
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        max_k = max(k for _, _, k in batch)
        result = generate(
            model, tokenizer, [generative_prompt(g, k) for _, g, k in batch], method=method, budget=budget,
            max_new_tokens=tokens_per_step * max_k + extra_tokens, do_sample=False, divide_length=divide_length,
            **method_options,
        )
        for (graph_index, graph, k), text in zip(batch, result.texts):
            records.append({"graph": graph_index, "kind": graph.kind, "nodes": graph.n, "k": k,
                            **score_generated(text, graph.states[k]), "output_tail": text[-200:]})
    return records


def summarise(records: list[dict], fields=("node", "stack", "visited", "all")) -> dict:
    """Accuracy per field overall and per k."""
    def mean(rows, name):
        return sum(float(r[name]) for r in rows) / len(rows) if rows else float("nan")

    out = {name: mean(records, name) for name in fields}
    for name in ("node", "stack", "visited"):
        for suffix in ("_tokens", "_logprob"):
            if records and name + suffix in records[0]:
                out[name + suffix] = sum(r[name + suffix] for r in records) / len(records)
    out["items"] = len(records)
    out["by_k"] = {}
    for k in sorted({r["k"] for r in records}):
        rows = [r for r in records if r["k"] == k]
        extra = [n + s for n in ("node", "stack", "visited") for s in ("_tokens", "_logprob") if n + s in rows[0]]
        out["by_k"][str(k)] = {name: mean(rows, name) for name in (*fields, *extra)} | {"items": len(rows)}
    return out
