"""TriAttention scoring against a direct, per-offset, per-key implementation of SPEC section 4."""

from __future__ import annotations

import math

import pytest
import torch

from trikv.geometry import RopeGeometry
from trikv.scoring import TriScorer, folded_offset_constant, offset_values, zscore


def direct_scores(q_mean, q_abs, geometry, pre_rope_keys, key_positions, t, offsets, use_trig=True, use_norm=True,
                  weighted_norm=True, aggregation="mean"):
    """Literal formula: mean_o sum_f |mu||k| cos(w (t - p + o) + phi) + sum_f (A - |mu|)|k|, one key at a time."""
    num_heads, F = q_mean.shape
    n = pre_rope_keys.shape[0]
    out = torch.zeros(num_heads, n, dtype=torch.float64)
    for h in range(num_heads):
        for j in range(n):
            k = geometry.to_complex(pre_rope_keys[j].double())
            phi = torch.angle(q_mean[h]) - torch.angle(k)
            amp = q_mean[h].abs() * k.abs()
            norm = ((q_abs[h] - q_mean[h].abs()) if weighted_norm else q_abs[h]) * k.abs()
            per_offset = []
            for o in offsets.tolist():
                delta = t - key_positions[j] + o
                trig = (amp * torch.cos(geometry.omega * delta + phi)).sum() if use_trig else 0.0
                per_offset.append(trig + (norm.sum() if use_norm else 0.0))
            out[h, j] = max(per_offset) if aggregation == "max" else sum(per_offset) / len(per_offset)
    return out


def _setup(scaling=1.0, layout="half", head_dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    F = head_dim // 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    geometry = RopeGeometry.build(inv_freq, head_dim, layout, attention_scaling=scaling)
    num_heads, num_kv = 4, 2
    q_mean = torch.complex(torch.randn(1, num_heads, F, generator=generator, dtype=torch.float64),
                           torch.randn(1, num_heads, F, generator=generator, dtype=torch.float64))
    q_abs = q_mean.abs() * (1.0 + torch.rand(1, num_heads, F, generator=generator, dtype=torch.float64))
    keys_pre = torch.randn(num_kv, 12, head_dim, generator=generator, dtype=torch.float64)
    positions = torch.randint(0, 500, (12,), generator=generator)
    keys_post = geometry.rotate(keys_pre, positions)  # [Hkv, n, D], scaled by `scaling` like HF
    return geometry, q_mean, q_abs, keys_pre, keys_post, positions


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("scaling", [1.0, 1.37])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"use_norm": False},
        {"use_trig": False},
        {"weighted_norm": False},
        {"offset_aggregation": "max"},
        {"spacing": "linear"},
        {"max_offset": 4096},
    ],
)
def test_fast_scores_equal_direct_formula(layout, scaling, options):
    options = dict(options)
    spacing = options.pop("spacing", "geometric")
    max_offset = options.pop("max_offset", 65536)
    geometry, q_mean, q_abs, keys_pre, keys_post, positions = _setup(scaling, layout)
    offsets = offset_values(max_offset, spacing)
    scorer = TriScorer(q_mean, q_abs, geometry, num_kv_heads=2, offsets=offsets, **options)
    t = 731
    fast = scorer.score(keys_post[None, None].float(), torch.tensor([t]))  # [1, 1, Hkv, G, N]
    for kv in range(2):
        heads = slice(2 * kv, 2 * kv + 2)
        direct = direct_scores(
            q_mean[0, heads], q_abs[0, heads], geometry, keys_pre[kv], positions, t, offsets,
            use_trig=options.get("use_trig", True), use_norm=options.get("use_norm", True),
            weighted_norm=options.get("weighted_norm", True), aggregation=options.get("offset_aggregation", "mean"),
        )
        torch.testing.assert_close(fast[0, 0, kv].double(), direct, rtol=2e-4, atol=2e-4 * direct.abs().max().item())


def test_folded_constant_equals_explicit_mean():
    omega = torch.tensor([1.0, 0.3, 0.01, 1e-4, 0.0], dtype=torch.float64)
    offsets = offset_values()
    assert offsets.tolist() == [2.0**i for i in range(17)]
    folded = folded_offset_constant(omega, offsets)
    explicit = torch.stack([torch.complex(torch.cos(omega * o), torch.sin(omega * o)) for o in offsets.tolist()]).mean(0)
    torch.testing.assert_close(folded, explicit)
    # and Re(mu conj(k) e^{iwt} c) equals the mean over offsets of Re(mu conj(k) e^{iw(t+o)})
    mu, k, t = complex(0.3, -1.2), complex(-0.7, 0.4), 977.0
    lhs = (mu * k.conjugate() * torch.polar(torch.ones(5, dtype=torch.float64), omega * t) * folded).real
    rhs = torch.stack([(mu * k.conjugate() * torch.polar(torch.ones(5, dtype=torch.float64), omega * (t + o))).real for o in offsets.tolist()]).mean(0)
    torch.testing.assert_close(lhs, rhs)


def test_offset_spacings():
    assert offset_values(16).tolist() == [1, 2, 4, 8, 16]
    linear = offset_values(65536, "linear")
    assert linear.numel() == 17 and linear[0] == 1 and linear[-1] == 65536
    with pytest.raises(ValueError, match="spacing"):
        offset_values(16, "cubic")


def test_zscore_uses_only_candidates():
    scores = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    candidates = torch.tensor([[True, True, True, False]])
    z = zscore(scores, candidates)
    expected = (torch.tensor([1.0, 2.0, 3.0]) - 2.0) / math.sqrt(2.0 / 3.0)
    torch.testing.assert_close(z[0, :3], expected)
    # constant scores: std clamped, no NaN
    assert torch.isfinite(zscore(torch.ones(1, 5), torch.ones(1, 5, dtype=torch.bool))).all()


def test_trig_score_prefers_keys_the_mean_query_attends_to():
    """With R = 1 (queries constant), S_trig is exactly the future attention logit of that query."""
    geometry, _, _, _, _, _ = _setup()
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(16, generator=generator, dtype=torch.float64)
    mu = geometry.to_complex(query)[None, None].repeat(1, 2, 1)  # 2 heads, 1 KV head
    scorer = TriScorer(mu, mu.abs(), geometry, num_kv_heads=1, offsets=torch.tensor([5.0]), use_norm=False)
    keys_pre = torch.randn(1, 20, 16, generator=generator, dtype=torch.float64)
    positions = torch.arange(20) * 3
    keys_post = geometry.rotate(keys_pre, positions)
    t = 100
    fast = scorer.score(keys_post[None, None].float(), torch.tensor([t]))[0, 0, 0, 0]
    future_query = geometry.rotate(query[None], torch.tensor([t + 5]))[0]
    logits = keys_post[0] @ future_query
    torch.testing.assert_close(fast.double(), logits, rtol=1e-4, atol=1e-4)
