"""Accuracy heatmaps in the style of the needle-in-a-haystack charts: context length across, needle
depth down (0% at the top), red (0) to green (1), each cell annotated; one panel per task, in rows
of at most PANELS_PER_ROW.

Rendered with matplotlib's Agg canvas on a bare `Figure` (no pyplot: no global state, no display).
The PNG is exactly PANEL_INCHES x DPI per panel slot, since nothing trims it (no bbox_inches="tight").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PANEL_INCHES = (5.0, 4.0)  # width, height of one panel
DPI = 100
PANELS_PER_ROW = 4  # more tasks wrap to another row: a strip of seven panels is too wide to read
MISSING = "n/a"  # a cell with no finished case


@dataclass(frozen=True, slots=True)
class HeatmapPanel:
    title: str
    columns: tuple[str, ...]  # context lengths, left to right
    rows: tuple[str, ...]  # needle depths, top to bottom
    values: tuple[tuple[float | None, ...], ...]  # [row][column] accuracy in 0 .. 1; None: missing

    def __post_init__(self) -> None:
        if len(self.values) != len(self.rows) or any(len(r) != len(self.columns) for r in self.values):
            raise ValueError(f"values must be {len(self.rows)} rows of {len(self.columns)}")


def _slots(panels: int) -> tuple[int, int]:
    """(columns, rows) of panel slots."""
    return min(panels, PANELS_PER_ROW), math.ceil(panels / PANELS_PER_ROW)


def size_px(panels: int) -> tuple[int, int]:
    """(width, height) of the PNG for this many panels."""
    cols, rows = _slots(panels)
    return round(PANEL_INCHES[0] * cols * DPI), round(PANEL_INCHES[1] * rows * DPI)


def render_heatmap(path: Path, title: str, panels: Sequence[HeatmapPanel]) -> None:
    import matplotlib
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("a heatmap needs at least one panel")
    cols, rows = _slots(len(panels))
    fig = Figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="lightgrey")
    slots = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax in slots[len(panels) :]:  # the last row's empty slots
        ax.remove()
    axes = slots[: len(panels)]
    images = []
    for ax, p in zip(axes, panels, strict=True):
        grid = np.array([[np.nan if v is None else v for v in row] for row in p.values], dtype=float)
        images.append(ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto"))
        ax.set_xticks(range(len(p.columns)), labels=list(p.columns))
        ax.set_yticks(range(len(p.rows)), labels=list(p.rows))
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(p.title)
        for (i, j), v in np.ndenumerate(grid):
            label = MISSING if np.isnan(v) else f"{v:.0%}"
            dark = not np.isnan(v) and not 0.15 < v < 0.85  # the colour map's ends are dark
            ax.text(j, i, label, ha="center", va="center", fontsize=9, color="white" if dark else "black")
    fig.colorbar(images[0], ax=axes, label="retrieval accuracy")  # one scale, 0 .. 1, for all
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=DPI)
