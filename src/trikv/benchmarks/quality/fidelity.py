"""Task 1 + 2: teacher-forced fidelity and attention recall over long texts, one batch, every method.

Fidelity (per decode position t, predicting token t + 1, compared with full attention):
  top-1 agreement, KL(full || compressed) in nats, and the perplexity of the true next token.
Attention recall: the share of the *full-attention* probability mass of query t that falls on the keys
the method still holds when t is computed (1 - mu(q) of TAM's Prop. 4.1), per (layer, query head), then
averaged over heads (and its minimum over heads). By horizon: each (query t, key j) pair is bucketed by
how long ago key j was first judged, t - r(j), with r(j) the first compression round after j entered the
cache; within a bucket the share is (kept mass) / (mass) per head. Pairs whose key was never judged yet
(it arrived after the last round) count only in the overall figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .feeding import Feeder
from .reference import Reference, reference_pass

DEFAULT_HORIZONS = (128, 512, 1024, 2048, 4096)


def horizon_labels(edges=DEFAULT_HORIZONS) -> list[str]:
    def short(n):
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)

    labels, low = [], 0
    for edge in edges:
        labels.append(f"{short(low)}-{short(edge)}")
        low = edge
    labels.append(f"{short(low)}+")
    return labels


def build_batch(token_lists: list[list[int]], length: int) -> torch.Tensor:
    """[b, length] ids: every text truncated to the same length (no padding: one schedule for all rows)."""
    short = [len(t) for t in token_lists if len(t) < length]
    if short:
        raise ValueError(f"fidelity texts must hold at least {length} tokens; got a text of {min(short)}")
    return torch.tensor([t[:length] for t in token_lists], dtype=torch.long)


FIDELITY_SUMS = ("agree", "kl", "nll", "nll_full")


@dataclass
class FidelityAccumulator:
    """Sums over decode positions, per text (row), over all positions and over the compressed ones (after the
    row's first compression round, where a method can differ from full attention), plus pooled sums per
    position bucket."""

    rows: int
    bucket: int = 256
    per_row: dict = field(default_factory=dict)  # {"all" | "compressed": {"n" | metric: [rows] float64}}
    buckets: dict = field(default_factory=dict)

    def __post_init__(self):
        for part in ("all", "compressed"):
            self.per_row[part] = {name: torch.zeros(self.rows, dtype=torch.float64) for name in ("n",) + FIDELITY_SUMS}

    def add(self, start: int, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
            compressed: bool = False, rows: torch.Tensor | None = None) -> None:
        """Positions start.. of [b, c, V] logits; targets [b, c] the true next tokens; `compressed`: these
        positions come after the rows' first compression round; `rows` [b]: the texts they belong to
        (default 0..b-1)."""
        ref_logp = torch.log_softmax(ref_logits.float(), -1)
        logp = torch.log_softmax(logits.float(), -1)
        values = {
            "kl": (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0),  # [b, c]
            "agree": (ref_logits.argmax(-1) == logits.argmax(-1)).float(),
            "nll": -logp.gather(-1, targets[..., None]).squeeze(-1),
            "nll_full": -ref_logp.gather(-1, targets[..., None]).squeeze(-1),
        }
        rows = torch.arange(logits.shape[0]) if rows is None else rows
        parts = ("all", "compressed") if compressed else ("all",)
        for part in parts:
            sums = self.per_row[part]
            sums["n"].index_add_(0, rows, torch.full((len(rows),), float(logits.shape[1]), dtype=torch.float64))
            for name, value in values.items():
                sums[name].index_add_(0, rows, value.double().sum(-1).cpu())
        positions = torch.arange(start, start + logits.shape[1])
        for name, value in values.items():
            for index, total in _bucket_sums(positions, value, self.bucket).items():
                self.buckets.setdefault(index, {"n": 0, **{k: 0.0 for k in FIDELITY_SUMS}})[name] += total
        for index, count in _bucket_counts(positions, logits.shape[0], self.bucket).items():
            self.buckets.setdefault(index, {"n": 0, **{k: 0.0 for k in FIDELITY_SUMS}})["n"] += count

    def result(self) -> dict:
        return fidelity_summary(self.per_row, self.buckets, self.bucket)


def _summary(sums: dict) -> dict:
    n = max(sums["n"], 1)
    return {
        "top1_agreement": sums["agree"] / n,
        "kl": sums["kl"] / n,
        "perplexity": math.exp(sums["nll"] / n),
        "perplexity_full": math.exp(sums["nll_full"] / n),
        "perplexity_ratio": math.exp((sums["nll"] - sums["nll_full"]) / n),
        "positions": int(sums["n"]),
    }


def fidelity_summary(per_row: dict, buckets: dict | None = None, bucket: int = 256) -> dict:
    """The pooled figures (every position of every text weighs the same) over all positions, the same over
    the compressed positions (`compressed`), and the per-text sums (`per_text`, for intervals)."""
    pooled = {part: {name: float(torch.as_tensor(v, dtype=torch.float64).sum()) for name, v in sums.items()}
              for part, sums in per_row.items()}
    out = _summary(pooled["all"])
    out["compressed"] = _summary(pooled["compressed"])
    out["per_text"] = {part: {name: [float(x) for x in torch.as_tensor(v, dtype=torch.float64).tolist()]
                              for name, v in sums.items()} for part, sums in per_row.items()}
    if buckets is not None:
        out["by_position"] = {f"{i * bucket}-{(i + 1) * bucket}": _summary(s) for i, s in sorted(buckets.items())}
    return out


def _bucket_sums(positions: torch.Tensor, value: torch.Tensor, bucket: int) -> dict[int, float]:
    index = (positions // bucket).to(value.device)
    out = {}
    for i in index.unique().tolist():
        out[i] = float(value[:, index == i].double().sum())
    return out


def _bucket_counts(positions: torch.Tensor, rows: int, bucket: int) -> dict[int, int]:
    index = positions // bucket
    return {i: int((index == i).sum()) * rows for i in index.unique().tolist()}


KEY_KINDS = ("prompt", "repeated", "other")
REPEAT_NGRAM = 8


def key_kinds(ids: torch.Tensor, prompt_length: int, ngram: int = REPEAT_NGRAM) -> torch.Tensor:
    """[b, T] kind of every key position: 0 prompt, 1 repeated (part of a run of `ngram` token ids that already
    occurred earlier in the text: a line the model writes again), 2 other."""
    kinds = torch.full(ids.shape, 2, dtype=torch.long)
    kinds[:, :prompt_length] = 0
    for row, tokens in enumerate(ids.tolist()):
        seen: set[tuple] = set()
        for end in range(ngram, len(tokens) + 1):
            gram = tuple(tokens[end - ngram : end])
            if gram in seen:
                start = max(end - ngram, prompt_length)
                if start < end:
                    kinds[row, start:end] = 1
            seen.add(gram)
    return kinds


COMPOSITION = ("prompt", "repeated", "age<128", "age 128-1K", "age>=1K")


def kept_composition(evict_time: torch.Tensor, round_times: list[int], kinds: torch.Tensor) -> dict[str, list[float]]:
    """Entries held right after each round, summed over rounds, layers and KV heads, per row (text), by what they
    are: prompt, repeated text (see `key_kinds`), else by age (tokens between the key and the round)."""
    L, b, Hkv, T = evict_time.shape
    counts = {name: torch.zeros(b, dtype=torch.float64) for name in COMPOSITION}
    keys_index = torch.arange(T)
    for time in round_times:
        held = (keys_index < time) & (evict_time > time)  # [L, b, Hkv, T]
        per_key = held.sum(dim=(0, 2)).double()  # [b, T] (layers x heads holding each key)
        age = time - keys_index
        masks = {"prompt": kinds == 0, "repeated": kinds == 1}
        other = kinds == 2
        masks["age<128"] = other & (age < 128)
        masks["age 128-1K"] = other & (age >= 128) & (age < 1024)
        masks["age>=1K"] = other & (age >= 1024)
        for name, mask in masks.items():
            counts[name] += (per_key * mask).sum(-1)
    return {name: values.tolist() for name, values in counts.items()}


class FidelityTask:
    """One batch of texts; the reference pass is made once and every method is compared with it."""

    def __init__(self, model, input_ids: torch.Tensor, prompt_length: int, max_chunk: int = 128,
                 recall_stride: int = 4, horizons=DEFAULT_HORIZONS):
        if not 0 < prompt_length < input_ids.shape[1] - 1:
            raise ValueError(f"prompt length {prompt_length} must leave tokens to decode")
        self.model, self.prompt_length = model, prompt_length
        self.ids = input_ids.to(next(model.parameters()).device)
        self.max_chunk, self.recall_stride, self.horizons = max_chunk, recall_stride, tuple(horizons)
        self.reference: Reference | None = None

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    def run_reference(self, progress=None, recall: bool = True) -> Reference:
        query_index = torch.arange(self.prompt_length, self.length, self.recall_stride) if recall else None
        self.reference = reference_pass(self.model, self.ids, self.prompt_length, self.max_chunk, query_index, progress)
        return self.reference

    @torch.no_grad()
    def run_method(self, cache, progress=None, accumulator: "FidelityAccumulator | None" = None,
                   rows: torch.Tensor | None = None, prompt_chunks: bool = False) -> tuple[dict, dict]:
        """Feed the texts through `cache`; returns (fidelity metrics, eviction log for recall). With an
        `accumulator`, the sums go into it at `rows` (the texts' indices in a larger set). `prompt_chunks`: the
        prompt in the cache's prefill chunks with rounds between them, instead of one forward."""
        if self.reference is None:
            raise RuntimeError("run_reference() first")
        accumulator = FidelityAccumulator(rows=self.ids.shape[0]) if accumulator is None else accumulator
        T, P = self.length, self.prompt_length
        feeder = Feeder(self.model, cache, self.max_chunk, track_evictions=T)
        feeder.feed(self.ids[:, :P], want_logits=False, prompt=True, prompt_chunks=prompt_chunks)
        if progress is not None:
            progress(P)

        def on_logits(start: int, logits: torch.Tensor) -> None:
            end = start + logits.shape[1]
            ref = self.reference.logits(self.model, start, end)
            # rounds run only before a forward (the feeder never crosses a trigger inside one), and every row of
            # the batch follows the same schedule: a chunk is compressed when a round ran at or before its start
            rounds = feeder.log.round_times
            accumulator.add(start, ref, logits, self.ids[:, start + 1 : end + 1], compressed=bool(rounds) and rounds[0] <= start,
                            rows=rows)

        remaining = T - P
        done = [P]

        def counted(start, logits):
            on_logits(start, logits)
            if progress is not None:
                progress(start + logits.shape[1] - done[0])
                done[0] = start + logits.shape[1]

        feeder.feed(self.ids[:, P:], want_logits=slice(0, remaining - 1), on_logits=counted)
        if progress is not None and done[0] < T:
            progress(T - done[0])
        evictions = {
            "evict_time": feeder.log.evict_time,
            "round_times": list(feeder.log.round_times),
            "forwards": len(feeder.log.spans),
            "peak_entries": int(getattr(cache, "peak_length", 0)),
            "rounds": int(getattr(cache, "rounds", 0)),
        }
        if feeder.log.evict_time is not None:
            kinds = key_kinds(self.ids.cpu(), P)
            evictions["composition"] = kept_composition(feeder.log.evict_time, feeder.log.round_times, kinds)
        result = accumulator.result()
        result.update(forwards=len(feeder.log.spans), rounds=evictions["rounds"], peak_entries=evictions["peak_entries"],
                      first_round=feeder.log.round_times[0] if feeder.log.round_times else None)
        return result, evictions

    def _probs_blocks(self, layer: int, block: int):
        """(query positions [n], causal attention probabilities [b, Hkv, G, n, T]) of the sampled queries, by block.

        With attention sinks (GPT-OSS) the sink logit joins each softmax denominator, as in the model: the keys'
        probabilities then sum to less than 1."""
        ref = self.reference
        K = ref.keys[layer]  # [b, Hkv, T, D]
        b, Hkv, T = K.shape[:3]
        Hq = ref.queries[layer].shape[1]
        G = Hq // Hkv
        keys_index = torch.arange(T)
        sink = None if ref.sinks is None else ref.sinks[layer].view(1, Hkv, G, 1, 1)
        for s in range(0, len(ref.query_index), block):
            qpos = ref.query_index[s : s + block]
            n = len(qpos)
            Q = ref.queries[layer][:, :, s : s + block]  # [b, Hq, n, D]
            logits = torch.matmul(Q.reshape(b, Hkv, G * n, -1), K.transpose(-1, -2)) * ref.scaling
            logits = logits.view(b, Hkv, G, n, T).masked_fill(~(keys_index[None, :] <= qpos[:, None]), float("-inf"))
            if sink is None:
                yield qpos, torch.softmax(logits, dim=-1)
            else:
                with_sink = torch.cat([logits, sink.expand(b, Hkv, G, n, 1)], dim=-1)
                yield qpos, torch.softmax(with_sink, dim=-1)[..., :T]

    def oracle_evictions(self, layer: int, round_times: list[int], budget: int, block: int = 256) -> torch.Tensor:
        """[b, Hkv, T] eviction times of the oracle on `layer`: at each round it keeps, of the keys it still
        holds, the `budget` that receive the most attention (summed over the group's query heads) from the
        sampled queries still to come; the keys it drops are gone for every later query, as in a real cache.
        An upper reference for a selection made on the same schedule, not a bound on every schedule."""
        ref = self.reference
        b, Hkv, T = ref.keys[layer].shape[:3]
        rounds = torch.tensor(sorted(round_times), dtype=torch.long)
        # attention mass each key receives from the queries between consecutive rounds
        mass = torch.zeros(b, Hkv, len(rounds) + 1, T, dtype=torch.float64)  # [b, Hkv, segment, T]
        for qpos, probs in self._probs_blocks(layer, block):
            segment = torch.searchsorted(rounds, qpos, right=True)  # rounds already run before query q
            mass.index_add_(2, segment, probs.sum(2).double())
        future = mass.flip(2).cumsum(2).flip(2)  # [b, Hkv, segment, T]: mass from queries at or after the segment
        evict = torch.full((b, Hkv, T), T, dtype=torch.int32)
        keys_index = torch.arange(T)
        for index, time in enumerate(rounds.tolist()):
            held = (evict == T) & (keys_index < time)  # [b, Hkv, T]
            if int(held.sum(-1).max()) <= budget:
                continue
            ranked = future[:, :, index + 1].masked_fill(~held, -1.0)
            kept = torch.zeros_like(held)
            kept.scatter_(-1, ranked.topk(budget, dim=-1).indices, True)
            evict[held & ~kept] = time
        return evict

    @torch.no_grad()
    def recall(self, logs: dict, block: int = 256, oracles: dict | None = None) -> dict:
        """Attention recall for every eviction log in `logs` ({key: log from run_method}); one pass over layers.

        oracles: {key: (round_times, budget)}: also the recall of the oracle selection on that schedule
        (`oracle_evictions`), computed layer by layer (a second pass over the layer's queries).
        """
        ref = self.reference
        if ref is None or ref.queries is None:
            raise RuntimeError("the reference pass was run without recall capture")
        oracles = oracles or {}
        logs = dict(logs)
        for key, (round_times, _) in oracles.items():
            logs[key] = {"round_times": list(round_times), "evict_time": None}
        edges = torch.tensor(self.horizons, dtype=torch.long)
        nb = len(self.horizons) + 1
        labels = horizon_labels(self.horizons)
        T = self.length
        L = len(ref.keys)
        b, Hkv = ref.keys[0].shape[:2]
        Hq = ref.queries[0].shape[1]
        G = Hq // Hkv
        keys_index = torch.arange(T)
        acc = {}
        for key, log in logs.items():
            rounds = torch.tensor(sorted(log["round_times"]) + [10**12], dtype=torch.long)
            seg = torch.searchsorted(rounds, keys_index, right=True)  # round index that first judges key j
            acc[key] = {"seg": seg, "round_of_seg": rounds, "rows": empty_recall_rows(b, L, Hq, nb)}
        kinds = torch.nn.functional.one_hot(key_kinds(self.ids.cpu(), self.prompt_length), len(KEY_KINDS)).float()  # [b, T, K]
        for layer in range(L):
            for key, (round_times, budget) in oracles.items():
                if logs[key]["evict_time"] is None:
                    logs[key]["evict_time"] = torch.full((L, b, Hkv, T), T, dtype=torch.int32)
                logs[key]["evict_time"][layer] = self.oracle_evictions(layer, round_times, budget, block)
            for qpos, probs in self._probs_blocks(layer, block):
                n = len(qpos)
                for key, log in logs.items():
                    a, rows = acc[key], acc[key]["rows"]
                    evict = log["evict_time"][layer].long()  # [b, Hkv, T]
                    visible = qpos[None, None, :, None] < evict[:, :, None, :]  # [b, Hkv, n, T]
                    kept = probs * visible[:, :, None]
                    rows["kept"][:, layer] += kept.sum(-1).sum(-1).reshape(b, Hq).double()
                    rows["mass"][:, layer] += probs.sum(-1).sum(-1).reshape(b, Hq).double()
                    if layer == 0:
                        rows["queries"] += n
                    nseg = len(a["round_of_seg"])
                    seg_kept = torch.zeros(b, Hkv, G, n, nseg).index_add_(-1, a["seg"], kept)
                    seg_mass = torch.zeros(b, Hkv, G, n, nseg).index_add_(-1, a["seg"], probs)
                    horizon = qpos[:, None] - a["round_of_seg"][None, :]  # [n, nseg]
                    bucket = torch.bucketize(horizon, edges, right=True)  # 0..nb-1
                    onehot = torch.nn.functional.one_hot(bucket, nb).float() * (horizon >= 0)[..., None]  # [n, nseg, nb]
                    rows["h_kept"][:, layer] += torch.einsum("bhgns,nsk->bhgk", seg_kept, onehot).reshape(b, Hq, nb).double()
                    rows["h_mass"][:, layer] += torch.einsum("bhgns,nsk->bhgk", seg_mass, onehot).reshape(b, Hq, nb).double()
                    # by key kind, over keys already judged by a round (the others are held by every method)
                    judged = (qpos[:, None] >= a["round_of_seg"][a["seg"]][None, :]).float()  # [n, T]
                    rows["k_kept"][:, layer] += torch.einsum("bhgnt,nt,btk->bhgk", kept, judged, kinds).reshape(b, Hq, -1).double()
                    rows["k_mass"][:, layer] += torch.einsum("bhgnt,nt,btk->bhgk", probs, judged, kinds).reshape(b, Hq, -1).double()
        return {key: recall_summary(a["rows"], labels) | {"query_stride": self.recall_stride, "rows": a["rows"]}
                for key, a in acc.items()}


def empty_recall_rows(rows: int, layers: int, query_heads: int, buckets: int) -> dict:
    """Per-text sums behind attention recall: kept mass per (layer, query head) over the sampled queries, the
    number of those queries, and the kept / total mass per horizon bucket."""
    return {
        "kept": torch.zeros(rows, layers, query_heads, dtype=torch.float64),
        "mass": torch.zeros(rows, layers, query_heads, dtype=torch.float64),  # all keys' mass (< 1 a query with sinks)
        "queries": torch.zeros(rows, dtype=torch.float64),
        "h_kept": torch.zeros(rows, layers, query_heads, buckets, dtype=torch.float64),
        "h_mass": torch.zeros(rows, layers, query_heads, buckets, dtype=torch.float64),
        "k_kept": torch.zeros(rows, layers, query_heads, len(KEY_KINDS), dtype=torch.float64),
        "k_mass": torch.zeros(rows, layers, query_heads, len(KEY_KINDS), dtype=torch.float64),
    }


def concat_recall_rows(parts: list[dict]) -> dict:
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


def recall_summary(rows: dict, labels: list[str]) -> dict:
    """Attention recall pooled over the texts `rows` holds: per (layer, query head) the kept share of the
    sampled queries' attention on keys (with attention sinks the keys get less than all of it; the share is of
    what they get), averaged over heads (and its minimum); by horizon, each head's kept share of the mass in the
    bucket, averaged over the heads that have mass there."""
    per_head = rows["kept"].sum(0) / rows["mass"].sum(0).clamp_min(1e-30)  # [L, Hq]
    h_kept, h_mass = rows["h_kept"].sum(0), rows["h_mass"].sum(0)  # [L, Hq, nb]
    total_mass = h_mass.sum()
    by_horizon = {}
    for i, label in enumerate(labels):
        mass = h_mass[..., i]
        valid = mass > 1e-9
        if not bool(valid.any()):
            continue
        share = torch.where(valid, h_kept[..., i] / mass.clamp_min(1e-30), torch.nan)
        by_horizon[label] = {
            "recall": float(share[valid].mean()),
            "recall_min_head": float(share[valid].min()),
            "mass_share": float(mass.sum() / total_mass) if total_mass > 0 else 0.0,
            "heads": int(valid.sum()),
        }
    by_kind = {}
    if "k_mass" in rows:
        k_kept, k_mass = rows["k_kept"].sum(0), rows["k_mass"].sum(0)  # [L, Hq, K]
        kind_total = k_mass.sum()
        for i, kind in enumerate(KEY_KINDS):
            mass = k_mass[..., i]
            valid = mass > 1e-9
            if bool(valid.any()):
                share = torch.where(valid, k_kept[..., i] / mass.clamp_min(1e-30), torch.nan)
                by_kind[kind] = {"recall": float(share[valid].mean()),
                                 "mass_share": float(mass.sum() / kind_total) if kind_total > 0 else 0.0}
    return {
        "recall": float(per_head.mean()),
        "recall_min_head": float(per_head.min()),
        "by_kind": by_kind,
        "recall_per_layer": [round(float(x), 6) for x in per_head.mean(-1)],
        "recall_per_head": [[round(float(x), 5) for x in row] for row in per_head],
        "by_horizon": by_horizon,
    }


class FidelitySuite:
    """Texts of any prompt length: fed in batches of equal prompt and total length (the rows of a batch share
    one schedule), each batch against its own full-attention reference; figures are per text, pooled.

    texts: token ids per text; prompt_lengths: the prompt of each (a reasoning trace's own chat prompt, or the
    first tokens of a real text), protected as a generation's prompt would be.
    """

    def __init__(self, model, texts: list[list[int]], prompt_lengths: list[int], max_chunk: int = 128,
                 recall_stride: int = 4, horizons=DEFAULT_HORIZONS):
        if len(texts) != len(prompt_lengths) or not texts:
            raise ValueError("give one prompt length per text, and at least one text")
        groups: dict[tuple[int, int], list[int]] = {}
        for row, (ids, prompt) in enumerate(zip(texts, prompt_lengths)):
            groups.setdefault((prompt, len(ids)), []).append(row)
        self.rows = len(texts)
        self.horizons = tuple(horizons)
        self.batches = [
            (torch.tensor(rows), FidelityTask(model, torch.tensor([texts[r] for r in rows], dtype=torch.long), prompt,
                                              max_chunk, recall_stride, horizons))
            for (prompt, _), rows in groups.items()
        ]

    @property
    def tokens(self) -> int:
        return sum(task.ids.numel() for _, task in self.batches)

    def run_reference(self, progress=None, recall: bool = True) -> None:
        for _, task in self.batches:
            task.run_reference(progress=progress, recall=recall)

    @torch.no_grad()
    def run_method(self, make_cache, progress=None, prompt_chunks: bool = False) -> tuple[dict, dict]:
        """Feed every batch through a new cache from `make_cache()`; returns (metrics, log). The log holds each
        batch's eviction times and round times (`batches`). `prompt_chunks`: see `FidelityTask.run_method`."""
        accumulator = FidelityAccumulator(rows=self.rows)
        logs, first_round = [], [None] * self.rows
        for rows, task in self.batches:
            result, log = task.run_method(make_cache(), progress, accumulator=accumulator, rows=rows,
                                          prompt_chunks=prompt_chunks)
            logs.append(log)
            for row in rows.tolist():
                first_round[row] = result["first_round"]
        metrics = accumulator.result()
        metrics.update(forwards=sum(log["forwards"] for log in logs), rounds=sum(log["rounds"] for log in logs),
                       peak_entries=max(log["peak_entries"] for log in logs), first_round=first_round)
        per_text = {name: [0.0] * self.rows for name in COMPOSITION}  # held entries of each kind, per text
        for (rows, _), log in zip(self.batches, logs):
            for name, values in log.get("composition", {}).items():
                for row, value in zip(rows.tolist(), values):
                    per_text[name][row] = value
        total = sum(sum(values) for values in per_text.values())
        if total > 0:
            metrics["kept_composition"] = {name: sum(values) / total for name, values in per_text.items()}
            metrics["kept_composition_per_text"] = per_text
        return metrics, {"batches": logs}

    def full_fidelity(self) -> dict:
        """Full attention's own figures (the reference against itself: agreement 1, KL 0, its perplexity)."""
        accumulator = FidelityAccumulator(rows=self.rows)
        for rows, task in self.batches:
            P, T = task.prompt_length, task.length
            for start in range(P, T - 1, 256):
                end = min(T - 1, start + 256)
                logits = task.reference.logits(task.model, start, end)
                accumulator.add(start, logits, logits, task.ids[:, start + 1 : end + 1], compressed=True, rows=rows)
        return accumulator.result()

    @torch.no_grad()
    def recall(self, logs: dict, oracles: dict | None = None, block: int = 256) -> dict:
        """Attention recall of every suite log in `logs`; oracles: {key: (round_times per batch, budget)}."""
        oracles = oracles or {}
        parts: dict[str, list[tuple[torch.Tensor, dict]]] = {}
        for index, (rows, task) in enumerate(self.batches):
            batch_logs = {key: log["batches"][index] for key, log in logs.items()}
            batch_oracles = {key: (times[index], budget) for key, (times, budget) in oracles.items()}
            for key, value in task.recall(batch_logs, block=block, oracles=batch_oracles).items():
                parts.setdefault(key, []).append((rows, value["rows"]))
        labels = horizon_labels(self.horizons)
        out = {}
        for key, pieces in parts.items():
            merged = {name: torch.zeros(self.rows, *tensor.shape[1:], dtype=tensor.dtype) for name, tensor in pieces[0][1].items()}
            for rows, value in pieces:
                for name, tensor in value.items():
                    merged[name][rows] = tensor
            out[key] = recall_summary(merged, labels) | {"query_stride": self.batches[0][1].recall_stride, "rows": merged}
        return out
