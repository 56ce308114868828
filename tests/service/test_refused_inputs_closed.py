"""A request refused after its input was opened for region reads (a plan the tile cannot hold)
leaves no file open: the TIFF reader is closed at once, not by the garbage collector (a
``ResourceWarning: unclosed file`` then, issue 25 item 17)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tifffile

from models import ModelRepository
from models.planning.params import parse_params
from service.pipeline import Limits, run_file
from tiling import GridError


def _open_fds_on(path: Path) -> list[str]:
    """This process's descriptors open on ``path`` (``/proc/self/fd``)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                found.append(fd)
        except OSError:
            continue
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_tiff_refused_at_planning_is_closed_at_once(tmp_path: Path) -> None:
    source = tmp_path / "in.tif"
    image = np.random.default_rng(0).random((131, 97), dtype=np.float32)  # odd sizes, tiled TIFF
    tifffile.imwrite(source, image, tile=(32, 32))
    model = ModelRepository("/nonexistent", device="cpu").get("gaussian-2d")
    out = tmp_path / "out"
    with pytest.raises(GridError, match="empty core"):
        run_file(model, source, out, parse_params({"tile": "64", "halo": "40"}), limits=Limits())
    assert _open_fds_on(source.resolve()) == []  # before any garbage collection
    done = run_file(model, source, out, parse_params({"tile": "64", "halo": "8"}), limits=Limits())
    assert done.output_shape[-2:] == (131, 97) and _open_fds_on(source.resolve()) == []
