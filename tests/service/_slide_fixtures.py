"""Real slide files for the tests: openslide-python's own test fixtures, from its sdist on PyPI.

``python tests/service/_slide_fixtures.py fetch`` (run by ``.ci/run`` at setup, never by a test)
downloads ``openslide-python==1.4.7``'s source distribution with pip and keeps its
``tests/fixtures/`` (``small.svs``: Aperio, 16 x 16, 1 level, 0.499 um/px; ``boxes.tiff``: a generic
tiled pyramidal TIFF, 300 x 250, 4 levels, resolution tags of 72 dpi; ``boxes_0.dcm`` /
``boxes_1.dcm``: a DICOM-WSI pair) under ``tests/.data/openslide/``. :func:`fixtures` gives that
folder, or ``None`` when it was not fetched (the tests then skip, saying so).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "1.4.7"
FOLDER = Path(__file__).resolve().parents[1] / ".data" / "openslide"
NAMES = ("small.svs", "boxes.tiff", "boxes_0.dcm", "boxes_1.dcm", "unopenable.tiff")


def fixtures() -> Path | None:
    """The folder of the fetched fixtures, or ``None``."""
    return FOLDER if all((FOLDER / n).is_file() for n in NAMES) else None


def fetch() -> Path:
    """Download the sdist (pip, PyPI) and extract its fixtures into :data:`FOLDER`."""
    FOLDER.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"openslide-python=={VERSION}", "-d", tmp],
            check=True,
        )  # fmt: skip
        (sdist,) = Path(tmp).glob("openslide_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if "/tests/fixtures/" in member.name and name in NAMES and member.isfile():
                    source = tar.extractfile(member)
                    assert source is not None
                    (FOLDER / name).write_bytes(source.read())
    return FOLDER


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch"]:
        sys.exit("usage: _slide_fixtures.py fetch")
    sys.stdout.write(f"{fetch()}\n")
