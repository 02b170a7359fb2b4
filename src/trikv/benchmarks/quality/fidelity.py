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


@dataclass
class FidelityAccumulator:
    """Sums over decode positions, overall and per position bucket."""

    bucket: int = 256
    sums: dict = field(default_factory=lambda: {"n": 0, "agree": 0.0, "kl": 0.0, "nll": 0.0, "nll_full": 0.0})
    buckets: dict = field(default_factory=dict)

    def add(self, start: int, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Positions start.. of [b, c, V] logits; targets [b, c] the true next tokens."""
        ref_logp = torch.log_softmax(ref_logits.float(), -1)
        logp = torch.log_softmax(logits.float(), -1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)  # [b, c]
        agree = (ref_logits.argmax(-1) == logits.argmax(-1)).float()
        nll = -logp.gather(-1, targets[..., None]).squeeze(-1)
        nll_full = -ref_logp.gather(-1, targets[..., None]).squeeze(-1)
        positions = torch.arange(start, start + logits.shape[1])
        for name, value in (("agree", agree), ("kl", kl), ("nll", nll), ("nll_full", nll_full)):
            self.sums[name] += float(value.double().sum())
            for index, total in _bucket_sums(positions, value, self.bucket).items():
                self.buckets.setdefault(index, {"n": 0, "agree": 0.0, "kl": 0.0, "nll": 0.0, "nll_full": 0.0})[name] += total
        self.sums["n"] += int(agree.numel())
        for index, count in _bucket_counts(positions, logits.shape[0], self.bucket).items():
            self.buckets.setdefault(index, {"n": 0, "agree": 0.0, "kl": 0.0, "nll": 0.0, "nll_full": 0.0})["n"] += count

    @staticmethod
    def _summary(s: dict) -> dict:
        n = max(s["n"], 1)
        return {
            "top1_agreement": s["agree"] / n,
            "kl": s["kl"] / n,
            "perplexity": math.exp(s["nll"] / n),
            "perplexity_full": math.exp(s["nll_full"] / n),
            "positions": s["n"],
        }

    def result(self) -> dict:
        out = self._summary(self.sums)
        out["by_position"] = {
            f"{i * self.bucket}-{(i + 1) * self.bucket}": self._summary(s) for i, s in sorted(self.buckets.items())
        }
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
    def run_method(self, cache, progress=None) -> tuple[dict, dict]:
        """Feed the texts through `cache`; returns (fidelity metrics, eviction log for recall)."""
        if self.reference is None:
            raise RuntimeError("run_reference() first")
        accumulator = FidelityAccumulator()
        T, P = self.length, self.prompt_length
        feeder = Feeder(self.model, cache, self.max_chunk, track_evictions=T)
        feeder.feed(self.ids[:, :P], want_logits=False, prompt=True)
        if progress is not None:
            progress(P)

        def on_logits(start: int, logits: torch.Tensor) -> None:
            end = start + logits.shape[1]
            ref = self.reference.logits(self.model, start, end)
            accumulator.add(start, ref, logits, self.ids[:, start + 1 : end + 1])

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
        result = accumulator.result()
        result.update(forwards=len(feeder.log.spans), rounds=evictions["rounds"], peak_entries=evictions["peak_entries"])
        return result, evictions

    def _probs_blocks(self, layer: int, block: int):
        """(query positions [n], causal attention probabilities [b, Hkv, G, n, T]) of the sampled queries, by block."""
        ref = self.reference
        K = ref.keys[layer]  # [b, Hkv, T, D]
        b, Hkv, T = K.shape[:3]
        Hq = ref.queries[layer].shape[1]
        G = Hq // Hkv
        keys_index = torch.arange(T)
        for s in range(0, len(ref.query_index), block):
            qpos = ref.query_index[s : s + block]
            n = len(qpos)
            Q = ref.queries[layer][:, :, s : s + block]  # [b, Hq, n, D]
            logits = torch.matmul(Q.reshape(b, Hkv, G * n, -1), K.transpose(-1, -2)) * ref.scaling
            logits = logits.view(b, Hkv, G, n, T)
            causal = keys_index[None, :] <= qpos[:, None]  # [n, T]
            yield qpos, torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)

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
            acc[key] = {
                "seg": seg,
                "round_of_seg": rounds,
                "kept": torch.zeros(L, Hq, dtype=torch.float64),
                "queries": torch.zeros(L, Hq, dtype=torch.float64),
                "h_mass": torch.zeros(L, Hq, nb, dtype=torch.float64),
                "h_kept": torch.zeros(L, Hq, nb, dtype=torch.float64),
            }
        for layer in range(L):
            for key, (round_times, budget) in oracles.items():
                if logs[key]["evict_time"] is None:
                    logs[key]["evict_time"] = torch.full((L, b, Hkv, T), T, dtype=torch.int32)
                logs[key]["evict_time"][layer] = self.oracle_evictions(layer, round_times, budget, block)
            for qpos, probs in self._probs_blocks(layer, block):
                n = len(qpos)
                for key, log in logs.items():
                    a = acc[key]
                    evict = log["evict_time"][layer].long()  # [b, Hkv, T]
                    visible = qpos[None, None, :, None] < evict[:, :, None, :]  # [b, Hkv, n, T]
                    kept = probs * visible[:, :, None]
                    a["kept"][layer] += kept.sum(-1).sum(dim=(0, 3)).reshape(Hq).double()
                    a["queries"][layer] += b * n
                    nseg = len(a["round_of_seg"])
                    seg_kept = torch.zeros(b, Hkv, G, n, nseg).index_add_(-1, a["seg"], kept)
                    seg_mass = torch.zeros(b, Hkv, G, n, nseg).index_add_(-1, a["seg"], probs)
                    horizon = qpos[:, None] - a["round_of_seg"][None, :]  # [n, nseg]
                    bucket = torch.bucketize(horizon, edges, right=True)  # 0..nb-1
                    onehot = torch.nn.functional.one_hot(bucket, nb).float() * (horizon >= 0)[..., None]  # [n, nseg, nb]
                    a["h_kept"][layer] += torch.einsum("bhgns,nsk->hgk", seg_kept, onehot).reshape(Hq, nb).double()
                    a["h_mass"][layer] += torch.einsum("bhgns,nsk->hgk", seg_mass, onehot).reshape(Hq, nb).double()
        results = {}
        for key, a in acc.items():
            per_head = a["kept"] / a["queries"].clamp_min(1)  # [L, Hq]
            by_horizon = {}
            total_mass = a["h_mass"].sum()
            for i, label in enumerate(labels):
                mass = a["h_mass"][..., i]
                valid = mass > 1e-9
                if not bool(valid.any()):
                    continue
                share = torch.where(valid, a["h_kept"][..., i] / mass.clamp_min(1e-30), torch.nan)
                by_horizon[label] = {
                    "recall": float(share[valid].mean()),
                    "recall_min_head": float(share[valid].min()),
                    "mass_share": float(mass.sum() / total_mass) if total_mass > 0 else 0.0,
                    "heads": int(valid.sum()),
                }
            results[key] = {
                "recall": float(per_head.mean()),
                "recall_min_head": float(per_head.min()),
                "recall_per_layer": [round(float(x), 6) for x in per_head.mean(-1)],
                "recall_per_head": [[round(float(x), 5) for x in row] for row in per_head],
                "by_horizon": by_horizon,
                "query_stride": self.recall_stride,
            }
        return results
