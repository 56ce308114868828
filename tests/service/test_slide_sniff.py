"""The batch client finds slides by content (issue 21 item 6): SVS, NDPI, OME-TIFF and tiled TIFF
told apart from the first IFD that tifffile wrote, whatever the file's name; flat TIFFs and other
formats are no slides. Cross-checked against tifffile's own flags on the same files (all but the
NDPI stand-in: Hamamatsu's tag on a classic TIFF, which tifffile cannot open as NDPI)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tifffile

from service.client.plan import discover, output_relpath
from service.sniff import slide_kind

APERIO = "Aperio Image Library v12.0.15\n600x512 (256x256) JPEG/RGB Q=70|AppMag = 20|MPP = 0.499"


def _image() -> np.ndarray:
    from skimage import data

    return np.ascontiguousarray(data.immunohistochemistry()[:300, :257])  # odd sizes


def _write(folder: Path) -> dict[str, str | None]:
    """Files of every layout, named to mislead; the layout each is."""
    image = _image()
    tifffile.imwrite(
        folder / "a.svs", image, tile=(128, 128), photometric="rgb", description=APERIO, metadata=None
    )
    tifffile.imwrite(
        folder / "b.ndpi", image, photometric="rgb", extratags=[(65420, "I", 1, 1, True)], metadata=None
    )
    tifffile.imwrite(folder / "c.ome.tif", image, photometric="rgb", tile=(128, 128), ome=True)
    tifffile.imwrite(folder / "d.tif", image, photometric="rgb", tile=(64, 64), metadata=None)
    tifffile.imwrite(folder / "e.tif", image, photometric="rgb", metadata=None)  # strips: flat
    tifffile.imwrite(folder / "f.tiff", image, photometric="rgb", tile=(64, 64), bigtiff=True, ome=True)
    tifffile.imwrite(folder / "g.bin", image, photometric="rgb", tile=(64, 64), bigtiff=True, metadata=None)
    from PIL import Image

    Image.fromarray(image).save(folder / "h.svs", format="PNG")  # a PNG named .svs
    return {"a.svs": "svs", "b.ndpi": "ndpi", "c.ome.tif": "ome-tiff", "d.tif": "tiled-tiff", "e.tif": None,
            "f.tiff": "ome-tiff", "g.bin": "tiled-tiff", "h.svs": None}  # fmt: skip


def test_each_layout_is_told_apart_as_tifffile_reads_it(tmp_path: Path) -> None:
    expected = _write(tmp_path)
    for name, kind in expected.items():
        assert slide_kind(tmp_path / name) == kind, name
        if name in ("h.svs", "b.ndpi"):  # not TIFF; an NDPI tag on a classic TIFF (tifffile reads
            continue  # a real NDPI's offsets as 64-bit: it cannot open this stand-in)
        with tifffile.TiffFile(tmp_path / name) as tif:  # the oracle: tifffile's own flags
            page = tif.pages.first
            assert tif.is_svs == (kind == "svs"), name
            assert tif.is_ndpi == (kind == "ndpi"), name
            assert tif.is_ome == (kind == "ome-tiff"), name
            assert page.is_tiled == (kind in ("svs", "ome-tiff", "tiled-tiff")), name


def test_a_batch_sends_every_slide_by_content_and_names_its_output(tmp_path: Path) -> None:
    expected = _write(tmp_path)
    found = {str(c.rel): c for c in discover(tmp_path)}
    assert set(found) == set(expected)
    for name, kind in expected.items():
        cand = found[name]
        assert cand.slide == kind, name
        assert cand.sendable, name  # .svs, .ndpi and .bin: sent for their content
    assert found["h.svs"].kind == "png"
    assert str(output_relpath(found["a.svs"].rel, "tiff")) == "a.tiff"
    assert str(output_relpath(found["b.ndpi"].rel, "tiff")) == "b.tiff"


@pytest.mark.parametrize("head", [b"", b"II*\x00", b"II*\x00\xff\xff\xff\x7f", b"\x89PNG\r\n\x1a\n"])
def test_short_or_broken_files_are_no_slides(tmp_path: Path, head: bytes) -> None:
    path = tmp_path / "x.tif"
    path.write_bytes(head)
    assert slide_kind(path) is None
