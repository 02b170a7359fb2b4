"""The run's outputs: speed.json, speed.csv, speed.txt and speed.png."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .config import _label


CSV_FIELDS = [
    "engine", "method", "budget", "spread", "batch", "context", "steps", "tokens_per_second", "ms_p50", "ms_p99", "ms_max",
    "ms_mean", "p99_over_p50", "round_steps", "ms_round_step_mean", "scoring_share", "kv_bytes_final", "kv_bytes_peak",
    "kv_bytes_allocated", "entries_final", "entries_peak", "bound_ms", "bound_fraction", "rss_group_start_mb", "rss_peak_mb",
    "speedup_vs_full", "bound_speedup_vs_full", "efficiency_vs_bound",
]


def write_outputs(record: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps(record, indent=1))
    with (out / "speed.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS + ["source"], extrasaction="ignore")
        writer.writeheader()
        for row in record["results"]:
            writer.writerow({**row, "source": "trikv"})
        for row in (record.get("llama_cpp") or {}).get("results", []):
            writer.writerow({"engine": "llama.cpp", "method": "full", "batch": 1, "source": "llama.cpp", **{
                k: v for k, v in row.items() if k in CSV_FIELDS}})
    table = format_table(record)
    (out / "speed.txt").write_text(table + "\n")
    print(table)
    try:
        plot(record, out / "speed.png")
    except ImportError:
        print("(matplotlib is not installed: no PNG; pip install matplotlib)")


def format_table(record: dict) -> str:
    bw = record["machine"]["bandwidth"]["gbps"]
    model = record["model"]
    lines = [
        f"trikv bench speed - {model['name']} ({model['dtype']}), {record['machine']['threads']} threads, "
        f"bandwidth {bw} GB/s, weights {model['weight_bytes_per_step'] / 1e6:.0f} MB/step, "
        f"KV {model['kv_bytes_per_token'] / 1e3:.1f} kB/token",
        f"fill: {record['fill']}",
        "",
        f"{'engine':12s} {'b':>2s} {'context':>7s} {'method':24s} {'tok/s':>8s} {'p50 ms':>7s} {'p99 ms':>7s} {'max ms':>7s} "
        f"{'p99/p50':>7s} {'score%':>6s} {'KV MiB fin/peak':>16s} {'RSS MiB':>8s} {'bound ms':>8s} {'%bw':>5s} "
        f"{'xfull':>6s} {'bound':>6s} {'eff':>5s}",
    ]
    for r in record["results"]:
        label = _label(r)
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(
            f"{r['engine']:12s} {r['batch']:2d} {r['context']:7d} {label:24s} {r['tokens_per_second']:8.1f} "
            f"{r['ms_p50']:7.1f} {r['ms_p99']:7.1f} {r['ms_max']:7.1f} {r['p99_over_p50']:7.2f} "
            f"{100 * r['scoring_share']:6.2f} {r['kv_bytes_final'] / 2**20:7.1f}/{r['kv_bytes_peak'] / 2**20:<8.1f} "
            f"{r['rss_peak_mb']:8.0f} {r['bound_ms']:8.1f} {100 * r['bound_fraction']:5.0f} "
            f"{fmt(r['speedup_vs_full'], '6.2f')} {fmt(r['bound_speedup_vs_full'], '6.2f')} {fmt(r['efficiency_vs_bound'], '5.2f')}"
        )
    if record.get("skipped"):
        lines += ["", "skipped:"] + [f"  {s}" for s in record["skipped"]]
    check = record.get("engine_check")
    if check:
        lines += ["", f"lean vs transformers engine at context {check['context']}, batch 1, {check['steps']} steps:"]
        for method, row in check["methods"].items():
            lines.append(f"  {method:24s} mean: lean {row['lean_ms_mean']:.1f} ms, transformers {row['transformers_ms_mean']:.1f} ms "
                         f"-> x{row['speedup']:.2f} (p50: x{row['speedup_p50']:.2f}); identical greedy tokens: {row['identical_greedy_tokens']}; "
                         f"bound {row['bound_ms']:.1f} ms; weight GEMMs alone: lean layout {row['weight_gemm_floor_ms']:.1f} ms, "
                         f"transformers layout {row['stock_weight_gemm_floor_ms']:.1f} ms (time above them: lean "
                         f"{row['lean_overhead_ms']:.1f} ms, transformers {row['transformers_overhead_ms']:.1f} ms)")
    peer = record.get("llama_cpp") or {}
    if peer.get("skipped"):
        lines += ["", f"llama.cpp: {peer['skipped']}"]
    elif peer.get("results"):
        lines += ["", f"llama.cpp ({Path(peer['gguf']).name}, {peer['gguf_bytes'] / 1e6:.0f} MB, KV {peer['kv_cache_type']}, "
                      f"batch 1, {peer['n_threads']} threads): {peer['note']}"]
        lines.append(f"  {'context':>7s} {'tok/s':>8s} {'p50 ms':>7s} {'p99 ms':>7s} {'bound ms':>8s} {'%bw':>5s}  trikv tok/s / llama.cpp tok/s")
        for row in peer["results"]:
            ratios = ", ".join(f"{k} {v:.2f}" for k, v in (row.get("trikv_over_llama_cpp_tokens_per_second") or {}).items())
            lines.append(f"  {row['context']:7d} {row['tokens_per_second']:8.1f} {row['ms_p50']:7.1f} {row['ms_p99']:7.1f} "
                         f"{row['bound_ms']:8.1f} {100 * row['bound_fraction']:5.0f}  {ratios}")
    lines.append(f"\nprocess peak RSS {record['process_peak_rss_mb']:.0f} MiB")
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in record["results"]})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        lines: dict[str, list] = {}
        for r in record["results"]:
            if r["batch"] != batch:
                continue
            label = f"{r['engine']}: " + _label(r)
            lines.setdefault(label, []).append((r["context"], r["tokens_per_second"]))
        for label, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                    linestyle="--" if "full" in label else "-")
        peer = (record.get("llama_cpp") or {}).get("results") or []
        if batch == 1 and peer:
            ax.plot([r["context"] for r in peer], [r["tokens_per_second"] for r in peer], marker="s", color="black",
                    label="llama.cpp (Q4_1, f16 KV)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("decode tokens/s (all rows)")
        ax.set_title(f"{record['model']['name']}, batch {batch}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def memory_bytes_per_token(record: dict) -> tuple[float, str]:
    """K/V bytes one token costs full attention in a `--memory-run` record, and where the figure comes from: the
    record's `kv_bytes_per_token` where it has one, else the first sample's live bytes over its entries (before the
    first round the bounded cache holds every token, as full attention does)."""
    if record.get("kv_bytes_per_token"):
        return float(record["kv_bytes_per_token"]), "recorded by the run"
    first = next(s for s in record["samples"] if s["entries"] > 0)
    return first["kv_bytes"] / first["entries"], (f"computed: KV bytes / entries at token {first['tokens']:,}; "
                                                  "the run did not record it")


def plot_memory(record: dict, path: Path) -> None:
    """Process RSS and the bounded cache's live K/V over a `--memory-run` generation, beside what full attention
    would hold at each length (tokens x K/V bytes per token)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = record["samples"]
    tokens = [s["tokens"] for s in samples]
    per_token, source = memory_bytes_per_token(record)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tokens, [s["rss_mb"] for s in samples], label="process RSS")
    ax.plot(tokens, [t * per_token / 2**20 for t in tokens], color="black", ls="--",
            label=f"full attention's KV: tokens x {per_token:,.0f} bytes ({source})")
    ax.plot(tokens, [s["kv_bytes"] / 2**20 for s in samples], label=f"{record['method']} B={record['budget']}: live KV")
    ax.set_xlabel("tokens processed")
    ax.set_ylabel("MiB")
    ax.set_title(f"{record['method']} B={record['budget']}: memory over a {record['tokens']:,}-token generation")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
