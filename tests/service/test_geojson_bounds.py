"""GeoJSON objects stay bounded (review item 6): the union-find keeps only the components of
objects still open, not every object seen, and an image of more than ``max_objects`` objects is
refused with a clear error (422 ``over_budget``) and no half-written file.

Oracle: ``skimage.measure.label`` (8-connected) counts the objects.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from skimage.measure import label

import service.objects as objects_module
from service.errors import OverBudgetError
from service.objects import write_geojson


def _dots(rows: int, cols: int, step: int = 4) -> np.ndarray:
    """Isolated one-pixel objects every ``step`` pixels (labels 1..3), plus one tall snake that stays
    open across every slab."""
    labels = np.zeros((rows, cols), np.uint8)
    labels[::step, 2::step] = (np.arange(labels[::step, 2::step].size) % 3 + 1).reshape(
        labels[::step, 2::step].shape
    )
    labels[:, 0] = 1  # one object spanning every slab
    return labels


def test_union_find_keeps_only_open_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    labels = _dots(1031, 67)  # prime-ish sizes
    expected = int(label(labels, background=0, connectivity=2, return_num=True)[1])
    retained: list[int] = []
    original = objects_module._Objects

    class Counting(original):  # type: ignore[misc, valid-type]
        def add(self, g: int, value: int, area: int, piece: object) -> None:
            super().add(g, value, area, piece)
            retained.append(max(len(self.parent), len(self.value), len(getattr(self, "members", {}))))

    monkeypatch.setattr(objects_module, "_Objects", Counting)
    path = tmp_path / "dots.geojson"
    written = write_geojson(labels, path, slab_rows=16)
    assert written == expected > 3000
    per_slab = int(np.count_nonzero(label(labels[:16], background=0, connectivity=2) > 0))
    # at most two slabs' components (the open ones and the new slab's), never every object seen
    assert max(retained) <= 2 * per_slab + 2, (max(retained), per_slab, expected)
    features = json.loads(path.read_text())["features"]
    assert len(features) == expected and sum(f["properties"]["area"] for f in features) == int(
        np.count_nonzero(labels)
    )


def test_more_objects_than_the_cap_is_refused(tmp_path: Path) -> None:
    labels = _dots(257, 61)
    n = int(label(labels, background=0, connectivity=2, return_num=True)[1])
    path = tmp_path / "capped.geojson"
    with pytest.raises(OverBudgetError, match=rf"more than {n - 1} objects"):
        write_geojson(labels, path, slab_rows=16, max_objects=n - 1)
    assert not path.exists()
    assert write_geojson(labels, path, slab_rows=16, max_objects=n) == n
    assert objects_module.MAX_OBJECTS >= 100_000
