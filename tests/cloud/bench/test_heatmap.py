"""The accuracy heatmap is a PNG of the stated size, missing cells included."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from cloud.bench.heatmap import HeatmapPanel, render_heatmap, size_px


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    w, h = struct.unpack(">II", head[16:24])
    return w, h


@pytest.mark.parametrize("panels", [1, 2])
def test_heatmap_writes_a_png_of_its_stated_size(tmp_path: Path, panels: int) -> None:
    panel = HeatmapPanel(
        "passkey",
        ("2K", "4K", "16K\nYaRN x4"),
        ("0%", "50%", "100%"),
        ((1.0, 0.5, None), (0.0, 1.0, 0.25), (1, 1, 1)),
    )
    path = tmp_path / "heatmap.png"
    render_heatmap(path, "dense - accuracy 75%", [panel] * panels)
    assert _png_size(path) == size_px(panels)


def test_a_panel_whose_values_do_not_match_its_axes_is_refused() -> None:
    with pytest.raises(ValueError):
        HeatmapPanel("needle", ("2K",), ("0%", "100%"), ((1.0,),))
