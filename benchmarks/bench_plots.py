"""The plots of compare_triton.py: throughput against concurrency, latency against throughput."""

from __future__ import annotations

from pathlib import Path

from compare_triton import PROTOCOL_NAMES, Point, Results, median


def plot(results: Results, points: list[Point], images: Path) -> None:
    """Throughput against concurrency, and p50 / p99 latency against throughput, one panel per protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocols = sorted({p for p, _, _ in points}, key=["http", "grpc"].index)
    styles = {("triton", "on"): ("tab:green", "-"), ("triton", "off"): ("tab:green", ":"),
              ("rayinfer", "on"): ("tab:blue", "-"), ("rayinfer", "off"): ("tab:blue", ":")}
    images.mkdir(parents=True, exist_ok=True)
    for name, xlabel, ylabel in (("throughput", "concurrency", "infer/s"), ("latency", "infer/s", "latency (ms)")):
        fig, axes = plt.subplots(1, len(protocols), figsize=(6 * len(protocols), 4.2), squeeze=False)
        for ax, protocol in zip(axes[0], protocols):
            for (server, batching), (color, line) in styles.items():
                series = [pt for pt in points if pt[0] == protocol and pt[1] == batching]
                if not series:
                    continue
                label = f"{server}, batching {batching}"
                throughput = [median(results, server, pt, "infer_s") for pt in series]
                if name == "throughput":
                    ax.plot([pt[2] for pt in series], throughput, line, color=color, marker="o", label=label)
                    ax.set_xscale("log", base=2)
                    ax.set_xticks([pt[2] for pt in series], [str(pt[2]) for pt in series])
                else:
                    for key, marker in (("p50_us", "o"), ("p99_us", "^")):
                        latency = [median(results, server, pt, key) / 1000 for pt in series]
                        ax.plot(throughput, latency, line, color=color, marker=marker,
                                label=f"{label}, {key[:3]}")
            ax.set_title(f"{PROTOCOL_NAMES[protocol]}: mlp_onnx, batch 1 per request")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(images / f"bench_{name}.png", dpi=90)
        plt.close(fig)
