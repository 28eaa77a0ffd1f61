"""Bar charts of a bench_cp_variants.py --json file: time and peak memory of every CP variant relative to our ring.

    .venv/bin/python bench/plot_cp_variants.py results.json docs/cp_variants.png

Needs matplotlib (requirements.txt); the benchmark itself does not.
"""
from __future__ import annotations

import json
import sys

COLUMNS = (("CPU time / ring (busiest rank)", 1), ("wall time / ring (slowest rank)", 0), ("peak memory / ring", 2))


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(results["variants"], key=int)
    fig, axes = plt.subplots(len(sizes), len(COLUMNS), figsize=(5.2 * len(COLUMNS), 3.6 * len(sizes)), squeeze=False)
    for row, size in enumerate(sizes):
        shapes = results["variants"][size]
        names = list(shapes[0]["rows"])
        width = 0.8 / len(names)
        for col, (title, index) in enumerate(COLUMNS):
            ax = axes[row][col]
            for i, name in enumerate(names):
                ratios = [s["rows"][name][index] / s["rows"]["ring"][index] for s in shapes]
                ax.bar([x + i * width for x in range(len(shapes))], ratios, width, label=name)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(shapes))])
            ax.set_xticklabels(["B{} H{}/{} S{} D{}".format(*s["shape"]) for s in shapes], fontsize=7)
            ax.set_title(f"CP={size}: {title}", fontsize=9)
            if col == 0:
                ax.legend(fontsize=7)
    fig.suptitle("causal attention fwd+bwd, fp32, ratios to our ring (lower is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
