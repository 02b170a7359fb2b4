"""How close trikv's MLX caches are to the torch path and to unquantised KV, on the bundled model.

- kept sets: SmolLM2's own keys (a prefill of a shipped text), one round scored by the MLX scorer and by the
  torch policy for every method the MLX caches run; the entries whose kept / evicted status differs are counted;
- greedy tokens: mlx_lm.stream_generate with a trikv cache against trikv.generate (transformers) with the same
  settings, per prompt: the tokens that agree before the first difference, and the transformers logit margin there;
- quantised KV: the same tokens forced through an 8- and a 4-bit bounded cache and an unquantised one: the overlap
  of their kept sets round by round, top-1 agreement and KL of the next-token distributions, and bytes held.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

PROMPTS = ["Prove that sqrt(2) is irrational.", "A train travels 120 km in 1.5 hours. What is its average speed? Explain."]


def model_keys(torch_model, ids: list[int]) -> np.ndarray:
    """[L, 1, Hkv, N, D] float32 post-RoPE keys of a prefill of `ids` (the transformers model: the same weights as
    the mlx one, and a prefill mlx's CPU build would spend minutes on)."""
    import torch
    from transformers import DynamicCache

    from trikv.compat import cache_kwargs

    cache = DynamicCache(config=torch_model.config)
    with torch.no_grad():
        torch_model(input_ids=torch.tensor([ids]), **cache_kwargs(torch_model, cache), use_cache=True, logits_to_keep=1)
    return np.stack([layer.keys.float().numpy() for layer in cache.layers])


def kept_set_equality(torch_model, mlx_model, stats_name: str, ids: list[int], budget: int) -> dict:
    """Per method: entries compared and entries kept by one side only, for one round over the model's own keys."""
    import torch

    import trikv
    import trikv.mlx
    from trikv.architectures import model_shape
    from trikv.mlx.scoring import kept_indices
    from trikv.policies import ScoringContext
    from trikv.selection import protected_entries, top_entries
    from trikv.settings import CacheSettings

    keys = model_keys(torch_model, ids)
    L, b, h, n, _ = keys.shape
    positions = np.broadcast_to(np.arange(n), (L, b, h, n)).astype(np.int64)
    stats = trikv.load_stats(stats_name, torch_model)
    shape = model_shape(torch_model)
    results = {}
    for method in trikv.mlx.methods():
        settings = CacheSettings(method, budget, stats=stats_name if trikv.METHODS[method].needs_stats else None)
        cache = trikv.mlx.make_prompt_cache(mlx_model, method, budget=budget, stats=settings.stats)
        scorer = trikv.mlx.bounded_cache(cache).scorer
        policy = settings.make_policy(stats if settings.needs_stats else None)
        policy.bind(torch_model, shape)
        positions_t = torch.from_numpy(positions.copy())
        protected = protected_entries(positions_t, torch.tensor([n]), torch.tensor([16]), budget, policy.recent_window,
                                      settings.min_decode_room)
        context = ScoringContext(keys=torch.from_numpy(keys), values=None, positions=positions_t, candidates=~protected,
                                 current_position=torch.tensor([n]), budget=budget, protected=protected)
        torch_scores = policy.score(context).float().masked_fill(protected, float("inf"))
        expected = top_entries(torch_scores, budget).numpy()
        mlx_protected = mx.array(protected.numpy())
        scores = scorer.score(mx.array(keys), mx.array(positions.astype(np.int32)), ~mlx_protected, np.array([n]), budget)
        kept = np.array(kept_indices(mx.where(mlx_protected, mx.inf, scores), budget))
        got = np.zeros(expected.shape, dtype=bool)
        np.put_along_axis(got, kept, True, axis=-1)
        differ = got != expected
        gap = None
        if differ.any():  # how close the swapped entries' torch scores are, relative to the spread of the scores
            values = torch_scores.numpy()
            finite = np.where(np.isfinite(values), values, np.nan)
            spread = np.nanstd(finite, axis=-1, keepdims=True)
            heads = differ.any(-1)
            swapped = np.where(differ, finite, np.nan)[heads]
            gap = float(np.nanmax((np.nanmax(swapped, -1) - np.nanmin(swapped, -1)) / spread[heads][..., 0]))
        results[method] = {"entries": int(expected.size), "differ": int(differ.sum()), "heads": int(L * b * h),
                           "relative_gap": gap}
    return results


def token_agreement(torch_model, tokenizer, mlx_model, mlx_tokenizer, stats_name: str, budget: int, divide_length: int,
                    new_tokens: int) -> list[dict]:
    """Per prompt: greedy tokens of mlx-lm + trikv cache vs trikv.generate (transformers), same settings."""
    import mlx_lm

    import trikv
    import trikv.mlx

    stats = trikv.load_stats(stats_name, torch_model)
    rows = []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        reference = trikv.generate(torch_model, tokenizer, [ids], stats=stats, budget=budget, divide_length=divide_length,
                                   max_new_tokens=new_tokens, return_logits=True)
        cache = trikv.mlx.make_prompt_cache(mlx_model, stats=stats_name, budget=budget, divide_length=divide_length)
        got = [r.token for r in mlx_lm.stream_generate(mlx_model, mlx_tokenizer, ids, max_tokens=new_tokens, prompt_cache=cache)]
        want = reference.tokens[0]
        same = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
        margin = None
        if same < min(len(got), len(want)):
            top2 = reference.logits[same][0].topk(2).values
            margin = float(top2[0] - top2[1])
        rows.append({"prompt": text, "prompt_tokens": len(ids), "compared": min(len(got), len(want)), "agree": same,
                     "margin_at_difference": margin, "rounds": trikv.mlx.bounded_cache(cache).rounds})
    return rows


def quantised_fidelity(mlx_model, mlx_tokenizer, stats_name: str, budget: int, divide_length: int, new_tokens: int,
                       bits_list=(8, 4), group_size: int = 64) -> dict:
    """Teacher-forced: the unquantised bounded cache's greedy tokens fed through 8- and 4-bit bounded caches."""
    import trikv.mlx

    ids = mlx_tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True)
    runs = {}
    for bits in (None, *bits_list):
        cache = trikv.mlx.make_prompt_cache(mlx_model, stats=stats_name, budget=budget, divide_length=divide_length,
                                            kv_bits=bits, kv_group_size=group_size)
        bounded = trikv.mlx.bounded_cache(cache)
        logits = mlx_model(mx.array(ids)[None], cache=cache)[0, -1]
        tokens = runs[None]["tokens"] if bits is not None else []
        distributions, kept = [], []
        for step in range(new_tokens):
            probabilities = mx.softmax(logits.astype(mx.float32))
            distributions.append(np.array(probabilities))
            token = tokens[step] if bits is not None else int(mx.argmax(logits))
            if bits is None:
                tokens.append(token)
            rounds = bounded.rounds
            logits = mlx_model(mx.array([[token]]), cache=cache)[0, -1]
            if bounded.rounds > rounds:
                kept.append(np.array(bounded.kept_positions))
        runs[bits] = {"tokens": tokens, "p": np.stack(distributions), "kept": kept, "bytes": bounded.memory_bytes(),
                      "allocated": bounded.allocated_bytes(), "entries": bounded.length, "rounds": bounded.rounds}
    base = runs[None]
    out = {"budget": budget, "divide_length": divide_length, "tokens": new_tokens, "group_size": group_size,
           "unquantised": {"bytes": base["bytes"], "allocated": base["allocated"], "rounds": base["rounds"]}}
    for bits in bits_list:
        run = runs[bits]
        overlaps = []
        for ours, theirs in zip(run["kept"], base["kept"]):  # [L, 1, Hkv, B] positions per round
            same = (np.sort(ours, -1)[..., :, None] == np.sort(theirs, -1)[..., None, :]).any(-1).mean()
            overlaps.append(float(same))
        p, q = base["p"], run["p"]
        kl = float(np.mean(np.sum(p * (np.log(np.maximum(p, 1e-30)) - np.log(np.maximum(q, 1e-30))), -1)))
        out[f"{bits}-bit"] = {"bytes": run["bytes"], "allocated": run["allocated"], "rounds": run["rounds"],
                              "kept_overlap_per_round": overlaps, "top1_agreement": float((p.argmax(-1) == q.argmax(-1)).mean()),
                              "mean_kl": kl}
    return out


def seed_ids(tokenizer, length: int) -> list[int]:
    """`length` token ids of the shipped analysis texts (the speed benchmark's seed text)."""
    from ..speed.filling import seed_text_ids

    return seed_text_ids(tokenizer, 0, length)
