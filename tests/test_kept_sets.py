"""Every round's kept set, recomputed independently of the cache's bookkeeping and of its scoring code.

At each round of a real generation the cache's stored keys and positions are read, and the set a method
must keep is rebuilt from the method's published rule with code written here: TriAttention from the
literal formula (pre-RoPE keys recovered by undoing the rotation at each entry's position, every offset
summed explicitly, float64), z-scored per query head over the candidates, max (or mean) over the group,
the prompt protected while it leaves room, top-B; triattention-dedup adds R-KV's
key redundancy from pairwise cosine similarities; StreamingLLM and Knorm from their rules. The cache's kept
set must equal it (entries within 1e-4 of the cut-off may swap: float ties).
"""

from __future__ import annotations

import pytest
import torch

import trikv
from trikv.geometry import RopeGeometry
from trikv.policies import REGISTRY
from trikv.scoring import offset_values

from helpers import tiny_model
from stats_fixtures import tiny_stats

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET, SLACK, PROMPT, NEW = 24, 8, 9, 60


class _Tok:
    pad_token_id, eos_token_id, chat_template = 0, None, None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def triattention_reference(stats, geometry, keys, positions, t, group, options) -> torch.Tensor:
    """Scores [L, Hkv, N] (before protection) of post-RoPE keys [L, Hkv, N, D] at positions [L, Hkv, N]."""
    L, Hkv, N, D = keys.shape
    spacing = "linear" if options.get("offset_spacing") == "linear" else "geometric"
    offsets = offset_values(options.get("max_offset", 65536), spacing).double()  # [O]
    omega = geometry.omega  # [F]
    scale = geometry.attention_scaling
    out = torch.zeros(L, Hkv, group, N, dtype=torch.float64)
    for layer in range(L):
        for g in range(Hkv):
            p = positions[layer, g].double()  # [N]
            # undo RoPE: rotate by -p, and divide the scaling out twice (rotate applies it once more)
            pre = geometry.rotate(keys[layer, g].double(), -positions[layer, g]).double() / scale**2
            k = geometry.to_complex(pre)  # [N, F]
            for j in range(group):
                h = g * group + j
                mu, A = stats.q_mean[layer, h], stats.q_abs_mean[layer, h]  # [F]
                phase = torch.angle(mu)[None, :] - torch.angle(k)  # [N, F]
                amplitude = mu.abs()[None, :] * k.abs()
                delta = t - p[:, None, None] + offsets[None, :, None]  # [N, O, 1]
                trig = (amplitude[:, None, :] * torch.cos(omega[None, None, :] * delta + phase[:, None, :])).sum(-1)  # [N, O]
                weight = (A - mu.abs()) if options.get("weighted_norm", True) else A
                norm = (weight[None, :] * k.abs()).sum(-1)  # [N]
                use_trig, use_norm = options.get("use_trig", True), options.get("use_norm", True)
                per_offset = (trig if use_trig else 0 * trig) + (norm[:, None] if use_norm else 0)
                if options.get("offset_aggregation") == "max":
                    out[layer, g, j] = per_offset.amax(-1)
                else:
                    out[layer, g, j] = per_offset.mean(-1)
    return out * scale  # the cache scores keys with their scaling in (a constant factor: z-scores ignore it)


def zscored(scores, candidates):
    """Population z-score per (layer, head, query head) over the candidates."""
    weight = candidates[:, :, None, :].double()
    count = weight.sum(-1, keepdim=True).clamp_min(1)
    mean = (scores * weight).sum(-1, keepdim=True) / count
    std = ((((scores - mean) ** 2) * weight).sum(-1, keepdim=True) / count).sqrt().clamp_min(1e-6)
    return (scores - mean) / std


def window_attention_reference(keys, positions, queries, query_positions, t, w, group, scaling) -> torch.Tensor:
    """[L, Hkv, N] SnapKV's (official rule) pooled window attention, one head and query at a time: softmax over
    every visible key, the window's own columns dropped, mean over queries and the group, average pooling
    (kernel 5, zero padding) over the older keys in position order; 0 for the window and dead slots."""
    L, Hkv, N, _ = keys.shape
    out = torch.zeros(L, Hkv, N, dtype=torch.float64)
    for layer in range(L):
        for g in range(Hkv):
            slots = sorted((int(p), n) for n, p in enumerate(positions[layer, g].tolist()) if 0 <= p < t - w)
            if not slots:
                continue
            live = positions[layer, g] >= 0
            score = torch.zeros(N, dtype=torch.float64)
            seen = 0
            for i, qp in enumerate(query_positions.tolist()):
                if qp < 0:
                    continue
                seen += 1
                for h in range(g * group, (g + 1) * group):
                    logits = (keys[layer, g].double() @ queries[layer, h, i].double()) * scaling
                    visible = live & (positions[layer, g] <= qp)
                    score += torch.softmax(logits.masked_fill(~visible, float("-inf")), -1).nan_to_num() / group
            ordered = torch.tensor([float(score[n]) / max(seen, 1) for _, n in slots])
            pooled = torch.nn.functional.avg_pool1d(ordered[None, None], 5, stride=1, padding=2)[0, 0]
            for (_, n), value in zip(slots, pooled.tolist()):
                out[layer, g, n] = value
    return out


def mean_similarity_reference(keys, positions, threshold) -> torch.Tensor:
    """[L, Hkv, N] R-KV's redundancy before its softmax, one key row at a time in float64: each live key's
    cosine similarity to every other live key; in the row of key i, the most recent key above `threshold`
    counts 0; the column mean over the live rows."""
    L, Hkv, N, _ = keys.shape
    out = torch.zeros(L, Hkv, N, dtype=torch.float64)
    for layer in range(L):
        for g in range(Hkv):
            live = [n for n in range(N) if positions[layer, g, n] >= 0]
            k = keys[layer, g].double()
            unit = k / k.norm(dim=-1, keepdim=True)  # [N, D]
            cosine = (unit @ unit.T).tolist()  # [N, N]: the pairs the rows below read
            for i in live:
                row = {j: cosine[i][j] for j in live if j != i}
                near = [j for j, similarity in row.items() if similarity > threshold]
                if near:
                    row[max(near, key=lambda j: int(positions[layer, g, j]))] = 0.0
                for j, similarity in row.items():
                    out[layer, g, j] += similarity / len(live)
    return out


def random_reference(positions, seed: int) -> torch.Tensor:
    """[L, Hkv, N] random eviction's scores, one entry at a time in Python integers: the position permuted within
    [0, 2^24) by three rounds of (multiply by an odd constant, xor-shift) after an xor with the (seed, layer, KV
    head) key, the key being the same permutation of seed * 65537 + layer * 953 + head * 97 + 6017513."""
    mask = (1 << 24) - 1

    def permute(x: int) -> int:
        for multiplier, shift in ((10368885, 12), (2890557, 11), (3837701, 13)):
            x = (x * multiplier) % (1 << 24)
            x ^= x >> shift
        return x

    L, Hkv, N = positions.shape
    out = torch.zeros(L, Hkv, N, dtype=torch.float64)
    for layer in range(L):
        for head in range(Hkv):
            key = permute((seed * 65537 + layer * 953 + head * 97 + 6017513) & mask)
            for n in range(N):
                out[layer, head, n] = permute((max(int(positions[layer, head, n]), 0) & mask) ^ key)
    return out


def expected_scores(method, options, cache, stats, geometry, keys, positions, t, prompt_length, queries=None,
                    query_positions=None):
    """[L, Hkv, N] the method's ranking of the stored entries: protected +inf, dead -inf; keep the top-B."""
    L, Hkv, N = positions.shape
    live = positions >= 0
    window = getattr(cache.policy, "recent_window", 0)
    # one rule for every method: the prompt is protected while it leaves min_decode_room slots, and the
    # method's window then lives in what the prompt leaves
    protect = prompt_length + cache.min_decode_room <= BUDGET
    if protect:
        window = min(window, BUDGET - prompt_length)
    protected = live & (((positions < prompt_length) & protect) | (positions >= t - window))
    candidates = live & ~protected
    if REGISTRY[method].policy_class.__name__ == "TriAttentionWindow":
        group = cache.shape.group_size
        tri = zscored(triattention_reference(stats, geometry, keys, positions, t, group, options), candidates).amax(2)
        tri = zscored(tri[:, :, None], candidates)[:, :, 0]
        window = window_attention_reference(keys, positions, queries, query_positions, t, options["window_size"], group,
                                            cache.policy.scaling)
        window = zscored(window.clamp_min(1e-6).log()[:, :, None], candidates)[:, :, 0]
        weight = options.get("window_weight", 0.25)  # the documented default
        score = (1 - weight) * tri + weight * window
    elif REGISTRY[method].policy_class.__name__ == "TriAttentionDedup":
        group = cache.shape.group_size
        tri = zscored(triattention_reference(stats, geometry, keys, positions, t, group, options), candidates).amax(2)
        tri = zscored(tri[:, :, None], candidates)[:, :, 0]
        similar = zscored(mean_similarity_reference(keys, positions, 0.5)[:, :, None], candidates)[:, :, 0]
        score = tri - options.get("redundancy_weight", 0.5) * similar  # the documented defaults
    elif REGISTRY[method].policy_class.__name__ == "TriAttention":
        group = cache.shape.group_size
        raw = triattention_reference(stats, geometry, keys, positions, t, group, options)
        z = zscored(raw, candidates)
        if options.get("union_selection"):
            return _union(z, candidates, protected, live)
        score = z.mean(2) if options.get("group_aggregation") == "mean" else z.amax(2)
        if options.get("shared_across_layers"):
            score = score.mean(0, keepdim=True).expand_as(score)
    elif method == "streaming":
        score = positions.double().masked_fill(positions < 4, float("inf"))
    elif method == "knorm":
        score = -keys.double().norm(dim=-1)
    elif method == "random":
        score = random_reference(positions, seed=0)
    else:
        raise AssertionError(method)
    score = score.masked_fill(protected, float("inf")).masked_fill(~live, float("-inf"))
    return score


def _union(z, candidates, protected, live):
    """Reference global mode: each query head nominates its top-B candidates; one token set for all layers
    and heads, nominated tokens first, ranked by the max z-score over every head."""
    L, Hkv, G, N = z.shape
    masked = z.masked_fill(~candidates[:, :, None, :], float("-inf")).reshape(L * Hkv * G, N)
    nominated = torch.zeros(N, dtype=torch.bool)
    for row in masked:
        nominated[row.topk(min(BUDGET, N)).indices] = True
    combined = masked.amax(0)
    ranking = torch.where(nominated & torch.isfinite(combined), combined + 1e6, combined)
    score = ranking[None, None].expand(L, Hkv, N).clone()
    return score.masked_fill(protected, float("inf")).masked_fill(~live, float("-inf"))


METHODS = [name for name in REGISTRY if name.startswith("triattention")] + ["streaming", "knorm", "random"]
# windows that leave room for selection within the budget of 24
SMALL_WINDOW = {"triattention-window": {"window_size": 6}, "triattention-recent": {"recent_window": 6},
                "triattention-dedup": {"recent_window": 6}}


@pytest.mark.parametrize("method", METHODS)
def test_kept_sets_equal_an_independent_reference(method):
    _check_kept_sets(tiny_model("qwen2", seed=2), method)  # q/k biases, GQA 2:1


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("method", ["triattention", "triattention-dedup", "streaming", "knorm"])
def test_hybrid_models_keep_the_reference_sets_in_their_global_layers(family, method):
    """Gemma-3 (q/k norms, a RoPE base of its own for global layers) and GPT-OSS (YaRN with attention scaling,
    sinks): the cache bounds the global layers only, each with the statistics and geometry of those layers,
    and keeps exactly the reference's sets there."""
    model = tiny_model(family, seed=2)
    shape = trikv.architectures.model_shape(model)
    assert shape.cached_layers == (1, 3)
    _check_kept_sets(model, method)


@pytest.mark.parametrize("method", METHODS)
def test_kept_sets_after_a_chunked_prefill_equal_an_independent_reference(method):
    """A prompt of ten times the budget, prefilled in chunks of 20 tokens: every round at a chunk boundary (the
    scores at that boundary's position, the attention-based variants with the chunk's last queries) and every
    decode round after it keeps the reference's set, and the prompt competes (it leaves no room)."""
    _check_kept_sets(tiny_model("qwen2", seed=2), method, prompt_length=10 * BUDGET, chunk=20)


def _check_kept_sets(model, method, prompt_length: int = PROMPT, chunk: int | None = None):
    stats = tiny_stats(model)
    extra = SMALL_WINDOW.get(method, {})
    options = dict(REGISTRY[method].preset) | extra
    cache = trikv.make_cache(model, method, budget=BUDGET, divide_length=SLACK, **extra,
                             **({"stats": stats} if REGISTRY[method].needs_stats else {}),
                             **({"prefill_chunk_size": chunk} if chunk else {}))
    geometry = RopeGeometry.from_model(model)
    checked = []
    original = cache.compress

    def compress():
        n = cache.length
        keys, positions = cache.store.keys[:, 0, :, :n].clone(), cache.store.positions[:, 0, :, :n].clone()
        window = cache.query_window
        queries = window.queries[:, 0].clone() if window is not None else None
        query_positions = window.positions[0].clone() if window is not None else None
        t = int(cache.current_positions()[0])
        rounds = cache.rounds
        original()
        if cache.rounds == rounds:
            return
        score = expected_scores(method, options, cache, stats, geometry, keys, positions, t, prompt_length, queries,
                                query_positions)
        cut = score.topk(BUDGET, dim=-1).values[..., -1:]
        after = cache.visible_positions()[:, 0]
        for layer in range(positions.shape[0]):
            for g in range(positions.shape[1]):
                kept = set(p for p in after[layer, g].tolist() if p >= 0)
                threshold = float(cut[layer, g, 0])
                for slot, position in enumerate(positions[layer, g].tolist()):
                    value = float(score[layer, g, slot])
                    if position < 0 or value == threshold or abs(value - threshold) <= 1e-4:
                        continue  # dead slot, or a float tie at the cut-off
                    assert (position in kept) == (value > threshold), (method, t, layer, g, position, value, threshold)
                assert len(kept) == BUDGET
        checked.append(t)

    cache.compress = compress
    prompt = torch.randint(1, 96, (prompt_length,), generator=torch.Generator().manual_seed(4)).tolist()
    trikv.generate(model, _Tok(), [prompt], cache=cache, max_new_tokens=NEW, min_new_tokens=NEW)
    assert len(checked) >= 5
    if chunk:  # rounds at chunk boundaries (every chunk after the first two), then while decoding
        boundaries = [t for t in checked if t < prompt_length]
        assert len(boundaries) >= prompt_length // chunk - 2 and all(t % chunk == 0 for t in boundaries)
        assert any(t > prompt_length for t in checked)


def test_random_eviction_is_a_seeded_uniform_permutation_and_scores_the_same_in_parts():
    """Random eviction's scores of one (layer, KV head) are distinct (a permutation of positions: no ties), its kept half
    sits at mean position about N/2 and two heads keep about half the same entries (uniform and independent), another
    seed keeps other entries; a part of the model (the layers and KV heads a vLLM round scores at a time) scores its
    entries as the whole model does."""
    from trikv.policies import make_policy
    from trikv.policies.base import ScoringContext

    N = 4096
    positions = torch.arange(N).expand(4, 1, 3, N)  # [L, b, Hkv, N]
    context = ScoringContext(keys=torch.zeros(4, 1, 3, N, 2), values=None, positions=positions,
                             candidates=torch.ones(4, 1, 3, N, dtype=torch.bool), current_position=torch.tensor([N]),
                             budget=N // 2)
    policy = make_policy("random")
    scores = policy.score(context)
    assert all(scores[l, 0, h].unique().numel() == N for l in range(4) for h in range(3))
    kept = scores.topk(N // 2, dim=-1).indices  # [L, 1, Hkv, N/2]
    assert abs(kept.float().mean().item() - N / 2) < 0.02 * N
    halves = [set(kept[l, 0, h].tolist()) for l in range(4) for h in range(3)]
    overlaps = [len(a & b) / (N // 2) for i, a in enumerate(halves) for b in halves[i + 1:]]
    assert all(0.45 < overlap < 0.55 for overlap in overlaps), overlaps
    other = make_policy("random", seed=1).score(context)
    assert 0.45 < len(set(other.topk(N // 2, dim=-1).indices[0, 0, 0].tolist()) & halves[0]) / (N // 2) < 0.55
    part = policy.for_layers(slice(1, 3)).for_heads(slice(2, 3))
    sub = ScoringContext(keys=context.keys[1:3, :, 2:3], values=None, positions=positions[1:3, :, 2:3],
                         candidates=context.candidates[1:3, :, 2:3], current_position=context.current_position, budget=N // 2)
    assert torch.equal(part.score(sub), scores[1:3, :, 2:3])


@pytest.mark.parametrize("prompt_length, same", [(8, False), (14, True)])
def test_h2o_keeps_streamings_entries_when_a_protected_prompt_fills_the_other_half(prompt_length, same):
    """At B = 24 (H2O's window 12, 4 slots of decode room): a protected prompt of 14 tokens leaves no slot beside the
    window, so H2O keeps the prompt and the newest tokens, StreamingLLM's set (the results page counts these texts
    as 'h2o without heavy hitters'); a prompt of 8 leaves 4 heavy-hitter slots and the sets differ."""
    model = tiny_model("llama")
    prompt = torch.randint(1, 96, (prompt_length,), generator=torch.Generator().manual_seed(4)).tolist()
    held = {}
    for method in ("h2o", "streaming"):
        cache = trikv.make_cache(model, method, budget=BUDGET, divide_length=SLACK, min_decode_room=4)
        trikv.generate(model, _Tok(), [prompt], cache=cache, max_new_tokens=NEW, min_new_tokens=NEW)
        held[method] = cache.visible_positions()[:, 0]
        assert cache.rounds >= 5
    assert torch.equal(held["h2o"], held["streaming"]) is same
    if same:  # the whole prompt, then one unbroken run of the newest tokens, in every layer and KV head
        for row in held["h2o"].flatten(0, -2).tolist():
            kept = sorted(p for p in row if p >= 0)
            newest = [p for p in kept if p >= prompt_length]
            assert kept[:prompt_length] == list(range(prompt_length)) and newest == list(range(newest[0], newest[-1] + 1))
