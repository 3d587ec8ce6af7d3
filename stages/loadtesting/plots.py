"""Load-test plots rendered offline (matplotlib, Agg) to PNG and SVG; no CDN, no browser."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from schemas.loadresults import Measured


def plot_results(results: Measured, out: Path) -> list[str]:
    """Latency-throughput curve with the knee marked; TTFT/ITL vs concurrency (causal-lm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "shipyard"  # stable element ids in the SVG
    written = []
    ramp = results.ramp
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p.throughput_rps for p in ramp.points]
    ys = [p.p95_latency_ms or 0 for p in ramp.points]
    ax.plot(xs, ys, marker="o", label="p95 latency")
    for p, x, y in zip(ramp.points, xs, ys, strict=True):
        ax.annotate(f"c={p.concurrency}", (x, y), textcoords="offset points", xytext=(4, 4))
    k = ramp.knee_point
    ax.scatter(
        [k.throughput_rps],
        [k.p95_latency_ms or 0],
        s=160,
        facecolors="none",
        edgecolors="red",
        label=f"knee (c={ramp.knee})",
    )
    ax.set(xlabel="throughput (req/s)", ylabel="p95 latency (ms)", title="Latency vs throughput")
    ax.legend()
    written += _save(fig, out / "latency_throughput")
    stream = results.streaming.points if results.streaming else []
    if stream:
        fig, ax = plt.subplots(figsize=(6, 4))
        cs = [p.concurrency for p in stream]
        ttft = [p.p95_ttft_ms if p.p95_ttft_ms is not None else 0 for p in stream]
        itl = [p.p95_itl_ms if p.p95_itl_ms is not None else 0 for p in stream]
        for values, label in ((ttft, "TTFT p95"), (itl, "inter-token p95")):
            ax.plot(cs, values, marker="o", label=label)
        ax.set(xlabel="concurrency", ylabel="ms", xscale="log", title="Streaming latency")
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.legend()
        written += _save(fig, out / "ttft_itl")
    return written


def _save(fig: Any, stem: Path) -> list[str]:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    names = []
    for ext in ("png", "svg"):
        fig.savefig(
            stem.with_suffix(f".{ext}"),
            dpi=100,
            metadata={"Date": None} if ext == "svg" else {"Software": None},
        )
        names.append(stem.with_suffix(f".{ext}").name)
    plt.close(fig)
    return names
