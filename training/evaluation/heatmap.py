"""The needle-in-a-haystack picture: accuracy by depth (rows) x context length (columns), one coloured cell each with
its value written in it and the step in the title, as a PNG and as the same image in TensorBoard."""
from __future__ import annotations

import numpy as np


def heatmap_figure(results: dict[tuple[int, float], float], title: str):
    """A matplotlib figure of {(context length, depth): accuracy} (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    lengths = sorted({n for n, _ in results})
    depths = sorted({d for _, d in results})
    grid = np.array([[results[(n, d)] for n in lengths] for d in depths]) * 100
    fig, ax = plt.subplots(figsize=(max(4.8, 2.2 + 0.9 * len(lengths)), 1.6 + 0.5 * len(depths)), dpi=110)
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=9,
                    color="black" if 25 < grid[i, j] < 85 else "white")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="exact answers (%)")
    fig.tight_layout()
    return fig


def write_heatmap(results: dict[tuple[int, float], float], title: str, png_path: str) -> np.ndarray:
    """Saves the PNG and returns the picture as an (H, W, 3) uint8 array (for TensorBoard)."""
    from matplotlib import pyplot as plt

    fig = heatmap_figure(results, title)
    fig.savefig(png_path)
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return pixels


def log_heatmap_image(tb_folder: str, tag: str, pixels: np.ndarray, step: int) -> None:
    """The picture as a TensorBoard image under `tag` (its own event file beside the scalars')."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(tb_folder, filename_suffix=".niah")
    writer.add_image(tag, pixels, step, dataformats="HWC")
    writer.close()
