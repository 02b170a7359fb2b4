"""The Markdown page of an MLX run (`docs/mlx.md`), from its JSON; and the bandwidth-bound expectation.

Bandwidth bound: a decode step reads every weight once and the K/V entries it attends to, so on a machine with
memory bandwidth W a step takes at least (weight bytes + K/V bytes) / W. Apple silicon runs small-batch decoding
near that bound, so the bound's ratio between a full and a bounded cache is what a user there should expect; the
peak bandwidths are Apple's published figures (inputs, listed on the page).

The page opens with the shared header (`report_pages.page_header`): the run's command, date and commit, what it
measured and its main figure (the bounded cache's speed ratio at the longest context); it checks no targets.
"""

from __future__ import annotations

from ..report_pages import page_header

TITLE = "trikv on MLX (mlx-lm)"

# Apple's published unified-memory bandwidth, GB/s (inputs of the expectation)
APPLE_BANDWIDTH_GBPS = {"M1": 68.25, "M2 / M3": 100.0, "M4": 120.0, "M4 Pro": 273.0, "M1 / M2 / M3 Max": 400.0,
                        "M4 Max": 546.0, "M2 / M3 Ultra": 800.0}
# a larger model's shape (Llama-3.1-8B: 32 layers, 8 KV heads of 128 dims; 4-bit weights as mlx-community ships them,
# ~4.5 GB with their scales; fp16 K/V) for the expectation beside the bundled model
REFERENCE_SHAPES = {
    "Llama-3.1-8B (4-bit weights, fp16 KV)": {"weight_bytes": 4.5e9, "layers": 32, "kv_heads": 8, "head_dim": 128, "kv_bytes": 2},
}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_bytes: float) -> float:
    """K + V bytes of one token over every layer."""
    return 2 * layers * kv_heads * head_dim * element_bytes


def bound(weight_bytes: float, kv_token_bytes: float, context: int, budget: int | None, divide_length: int) -> float:
    """Bytes one decode step reads: the weights and the entries attended (a bounded cache holds budget +
    divide_length / 2 on average between rounds)."""
    entries = context if budget is None else min(context, budget + divide_length / 2)
    return weight_bytes + kv_token_bytes * entries


def _mb(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def _figure(record: dict) -> str:
    """trikv's decode speed over mlx-lm's full cache at the longest context where both ran."""
    meta = record["meta"]
    rows = {(row["context"], row["cache"]): row for row in record["speed"]}
    bounded = f"trikv B={meta['budget']}"
    contexts = [context for context, cache in rows if cache == bounded and (context, "full") in rows]
    if not contexts:
        return "no context where both the full and the bounded cache were timed"
    context = max(contexts)
    tri, full = rows[context, bounded]["tokens_per_second"], rows[context, "full"]["tokens_per_second"]
    return (f"{bounded} decodes x{tri / full:.2f} as fast as mlx-lm's full cache at {context:,} tokens of context "
            f"({tri:.2f} vs {full:.2f} tokens/s on this CPU)")


def render(record: dict, command: str | None = None) -> str:
    """The page of one run: the shared header, then speed, the bandwidth bound, quantised caches and agreement.

    The header names the command that wrote the page and its date: the run's own (its command and date, as the run
    recorded them) unless `command` is given, the command that rendered the page from the run's file later (dated
    today); the body then names the run's command and date."""
    meta = record["meta"]
    contexts = sorted({row["context"] for row in record["speed"]})
    measured = (f"decode speed of mlx-lm's full cache and trikv's bounded cache (B={meta['budget']}) on {meta['model']} "
                f"({meta['dtype']}) at {', '.join(f'{c:,}' for c in contexts)} tokens of context; quantised bounded "
                "caches; kept sets and greedy tokens against the torch path")
    lines = [
        *page_header(TITLE, command or meta["command"], measured, _figure(record), [], [meta.get("commit")],
                     date=None if command else meta["date"]),
        f"Run on {meta['machine']} (mlx {meta['mlx']}, mlx-lm {meta['mlx_lm']})"
        + (f" by `{meta['command']}` on {meta['date']}" if command else "") + "; every number below is from that run. "
        f"Model: {meta['model']} ({meta['dtype']} weights, {_mb(meta['weight_bytes'])} MB), TriAttention with its "
        f"bundled statistics, divide_length {meta['divide_length']}.",
        "",
        "## Decode speed: full attention (mlx-lm `KVCache`) vs trikv, measured side by side",
        "",
        f"Each cache is filled with the context (random keys and values through the caches' own `update_and_fetch` in "
        f"chunks of 2,048, so the bounded cache compacts as a chunked prefill does), then decodes {meta['steps']} greedy "
        f"steps after {meta['warmup']} warm-up steps; a bounded cache's window holds exactly one round, so its scoring "
        "share is the steady state's. Ratios compare rows of the same context from this one run.",
        "",
        "| context | cache | tok/s | ratio vs full | p50 ms | p99 ms | share in rounds | rounds | K/V held MB | K/V allocated MB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    full = {row["context"]: row for row in record["speed"] if row["cache"] == "full"}
    for row in record["speed"]:
        ratio = row["tokens_per_second"] / full[row["context"]]["tokens_per_second"] if row["context"] in full else None
        lines.append(f"| {row['context']:,} | {row['cache']} | {row['tokens_per_second']:.2f} | "
                     f"{'' if ratio is None else f'x{ratio:.2f}'} | {row['ms_p50']:.1f} | {row['ms_p99']:.1f} | "
                     f"{100 * row['scoring_share']:.1f}% | {row['rounds']} | {_mb(row['kv_bytes'])} | {_mb(row['kv_allocated_bytes'])} |")
    lines += [
        "",
        f"This machine: {meta['cpu']}; mlx's CPU build here multiplies matrices with the reference BLAS it bundles, "
        f"so a step is compute bound ({meta['gflops']:.1f} GFLOP/s measured on a 1,024 x 576 x 1,536 product) and the "
        "absolute rates say nothing about Apple silicon; the ratios show what a bounded cache saves where the step's "
        "attention is the cost.",
        "",
        "## What to expect on Apple silicon (bandwidth bound, computed)",
        "",
        "A decode step reads every weight and the K/V entries it attends, so it takes at least (weight bytes + K/V bytes) / "
        "bandwidth; Apple silicon decodes small batches near that bound. A bounded cache attends budget + divide_length / 2 "
        "entries on average. Bandwidths: Apple's published figures (inputs); shapes: the bundled model as run here, and "
        "Llama-3.1-8B's (32 layers, 8 KV heads of 128 dims, 4-bit weights of ~4.5 GB, fp16 K/V).",
        "",
        "| model | context | full MB / step | trikv B=" + str(meta["budget"]) + " MB / step | expected speed-up | "
        + " | ".join(f"{chip} full / trikv tok/s" for chip in APPLE_BANDWIDTH_GBPS) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(APPLE_BANDWIDTH_GBPS),
    ]
    shapes = {f"{meta['model']} ({meta['dtype']})": {"weight_bytes": meta["weight_bytes"], "layers": meta["layers"],
                                                     "kv_heads": meta["kv_heads"], "head_dim": meta["head_dim"],
                                                     "kv_bytes": meta["kv_element_bytes"]}} | REFERENCE_SHAPES
    for name, shape in shapes.items():
        token = kv_bytes_per_token(shape["layers"], shape["kv_heads"], shape["head_dim"], shape["kv_bytes"])
        for context in meta["bound_contexts"]:
            full_bytes = bound(shape["weight_bytes"], token, context, None, meta["divide_length"])
            tri_bytes = bound(shape["weight_bytes"], token, context, meta["budget"], meta["divide_length"])
            rates = " | ".join(f"{gbps * 1e9 / full_bytes:,.0f} / {gbps * 1e9 / tri_bytes:,.0f}" for gbps in APPLE_BANDWIDTH_GBPS.values())
            lines.append(f"| {name} | {context:,} | {_mb(full_bytes)} | {_mb(tri_bytes)} | x{full_bytes / tri_bytes:.2f} | {rates} |")
    here = []
    for context in sorted(full):
        token = kv_bytes_per_token(meta["layers"], meta["kv_heads"], meta["head_dim"], meta["kv_element_bytes"])
        expected = bound(meta["weight_bytes"], token, context, None, meta["divide_length"]) / bound(
            meta["weight_bytes"], token, context, meta["budget"], meta["divide_length"])
        tri = [r for r in record["speed"] if r["context"] == context and r["cache"] == f"trikv B={meta['budget']}"]
        if tri:
            here.append(f"{context:,}: bound x{expected:.2f}, measured x{tri[0]['tokens_per_second'] / full[context]['tokens_per_second']:.2f}")
    lines += ["", f"On this CPU (MLX read bandwidth {meta['bandwidth_gbps']:.1f} GB/s, measured) the same bound gives: "
              + "; ".join(here) + ". Here neither the weight products nor the attention run near the bandwidth, so the "
              "measured ratio follows what each costs in this build, not the bound.", ""]
    q = record["quantised"]
    lines += [
        "## Quantised and bounded: memory = budget x bits",
        "",
        f"trikv's bounded cache with mlx-lm's KV quantisation (groups of {q['group_size']} dimensions), B={q['budget']}, "
        f"divide_length {q['divide_length']}: {q['tokens']} tokens of the unquantised run's greedy text forced through "
        "each cache. Kept-set overlap: the share of each round's kept entries the unquantised cache kept too (mean over "
        "rounds); agreement and KL compare the next-token distributions with the unquantised cache's.",
        "",
        "| K/V | bytes held | allocated | rounds | kept-set overlap | top-1 agreement | mean KL |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| {meta['dtype']} | {q['unquantised']['bytes']:,} | {q['unquantised']['allocated']:,} | {q['unquantised']['rounds']} | 1 | 1 | 0 |",
    ]
    for key in ("8-bit", "4-bit"):
        row = q[key]
        overlap = sum(row["kept_overlap_per_round"]) / max(len(row["kept_overlap_per_round"]), 1)
        lines.append(f"| {key} | {row['bytes']:,} | {row['allocated']:,} | {row['rounds']} | {overlap:.3f} | "
                     f"{row['top1_agreement']:.3f} | {row['mean_kl']:.4f} |")
    memory = record["memory"]
    lines += ["", "K/V bytes held after filling each context (full attention holds every token; the bounded caches "
              "budget + what arrived since the last round):", "",
              "| context | " + " | ".join(memory["labels"]) + " |", "|---:|" + "---:|" * len(memory["labels"])]
    for context, values in memory["rows"].items():
        lines.append(f"| {int(context):,} | " + " | ".join(f"{_mb(v)} MB" for v in values) + " |")
    lines += ["", "## Agreement with the torch path", "",
              f"Kept sets: one round over {meta['model']}'s own keys ({record['kept_sets_tokens']} tokens of a shipped text, "
              f"B={record['kept_sets_budget']}), scored by the MLX scorer and by the torch policy; entries whose kept / "
              "evicted status differs, and where some do, the largest torch-score gap between the entries swapped in "
              "one head, in units of that head's score spread (a near-tie that float32 rounding of two libraries "
              "decides either way):", "", "| method | entries | differ | score gap of the swapped entries |",
              "|---|---:|---:|---:|"]
    for method, row in record["kept_sets"].items():
        gap = "" if row.get("relative_gap") is None else f"{row['relative_gap']:.1e}"
        lines.append(f"| {method} | {row['entries']:,} | {row['differ']} | {gap} |")
    lines += ["", f"Greedy tokens: mlx_lm.stream_generate with a trikv cache vs trikv.generate (transformers), "
              f"B={record['agreement_budget']}, divide_length {record['agreement_divide_length']}:", "",
              "| prompt | prompt tokens | rounds | tokens compared | agree before the first difference | transformers top-2 margin there |",
              "|---|---:|---:|---:|---:|---:|"]
    for row in record["agreement"]:
        margin = "" if row["margin_at_difference"] is None else f"{row['margin_at_difference']:.3f}"
        lines.append(f"| {row['prompt']} | {row['prompt_tokens']} | {row['rounds']} | {row['compared']} | {row['agree']} | {margin} |")
    return "\n".join(lines) + "\n"
