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


def _pyramid(path: Path, image: np.ndarray, *, subifds: bool = True, **kw) -> None:
    """``image`` and its 2x reduction, tiled: in SubIFDs or as a reduced-resolution next page."""
    photometric = kw.pop("photometric", "rgb")
    with tifffile.TiffWriter(path, ome=kw.pop("ome", False), bigtiff=kw.pop("bigtiff", False)) as tw:
        tw.write(image, tile=(64, 64), photometric=photometric, subifds=1 if subifds else 0, **kw)
        half = image[..., ::2, ::2] if photometric != "rgb" else image[::2, ::2]
        tw.write(half, tile=(64, 64), photometric=photometric, subfiletype=1)


def _write(folder: Path) -> dict[str, str | None]:
    """Files of every layout, named to mislead; the layout each is."""
    image = _image()
    tifffile.imwrite(
        folder / "a.svs", image, tile=(128, 128), photometric="rgb", description=APERIO, metadata=None
    )
    tifffile.imwrite(
        folder / "b.ndpi", image, photometric="rgb", extratags=[(65420, "I", 1, 1, True)], metadata=None
    )
    _pyramid(folder / "c.ome.tif", image, ome=True)
    _pyramid(folder / "d.tif", image, metadata=None)
    tifffile.imwrite(folder / "e.tif", image, photometric="rgb", metadata=None)  # strips: flat
    _pyramid(folder / "f.tiff", image, ome=True, bigtiff=True)
    _pyramid(folder / "g.bin", image, subifds=False, bigtiff=True, metadata=None)  # reduced next page
    from PIL import Image

    Image.fromarray(image).save(folder / "h.svs", format="PNG")  # a PNG named .svs
    # single-level tiled, channel-first and 16-bit pyramids: no slides (review item 14)
    tifffile.imwrite(folder / "i.ome.tif", image, photometric="rgb", tile=(128, 128), ome=True)
    tifffile.imwrite(folder / "j.tif", image, photometric="rgb", tile=(64, 64), metadata=None)
    cyx = np.ascontiguousarray(np.moveaxis(image[..., :2], -1, 0))
    _pyramid(folder / "k.ome.tif", cyx, ome=True, photometric="minisblack", metadata={"axes": "CYX"})
    _pyramid(folder / "l.tif", image.astype(np.uint16) * 257, metadata=None)
    return {"a.svs": "svs", "b.ndpi": "ndpi", "c.ome.tif": "ome-tiff", "d.tif": "tiled-tiff", "e.tif": None,
            "f.tiff": "ome-tiff", "g.bin": "tiled-tiff", "h.svs": None, "i.ome.tif": None, "j.tif": None,
            "k.ome.tif": None, "l.tif": None}  # fmt: skip


def test_each_layout_is_told_apart_as_tifffile_reads_it(tmp_path: Path) -> None:
    expected = _write(tmp_path)
    for name, kind in expected.items():
        assert slide_kind(tmp_path / name) == kind, name
        if name in ("h.svs", "b.ndpi"):  # not TIFF; an NDPI tag on a classic TIFF (tifffile reads
            continue  # a real NDPI's offsets as 64-bit: it cannot open this stand-in)
        with tifffile.TiffFile(tmp_path / name) as tif:  # the oracle: tifffile's own flags
            series = tif.series[0]
            assert tif.is_svs == (kind == "svs"), name
            assert tif.is_ndpi == (kind == "ndpi"), name
            if kind is not None:
                assert tif.is_ome == (kind == "ome-tiff"), name
                assert tif.pages.first.is_tiled, name
            if kind in ("ome-tiff", "tiled-tiff"):
                assert len(series.levels) == 2 and series.axes in ("YX", "YXS"), name


def test_the_client_and_the_server_agree_on_what_a_slide_is(tmp_path: Path) -> None:
    """Review item 14: a single-level tiled TIFF was a slide to the client, not to the server."""
    pytest.importorskip("tiffslide")
    from service.slides import is_slide_tiff

    for name in _write(tmp_path):
        if name == "b.ndpi":  # the stand-in tifffile cannot open as NDPI (above)
            continue
        assert (slide_kind(tmp_path / name) is not None) == is_slide_tiff(tmp_path / name), name


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
