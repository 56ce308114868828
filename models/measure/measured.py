"""Warm-up measurements kept on disk, so a restart (or a replica) does not measure again.

A model's warm-up measures its receptive field (:class:`~models.measure.receptive.ReceptiveField`), its
tile dependence (:class:`~models.measure.dependence.TileDependence`), its footprint
(:class:`~models.measure.footprint.Footprint`) and, on first need, calibrated halos
(:class:`~models.measure.receptive.HaloCalibration`): tens of seconds per model on two loaded cores.
:class:`MeasurementStore` writes them as one JSON file per model and reads them back when the
model loads.

Key: :func:`measurement_key`, a SHA-256 over the spec (its ``file`` path left out), the weights'
SHA-256 (the spec's ``sha256``, else the file's digest), the device (``cpu``, ``cuda:0``), torch's
thread count (the footprint's seconds depend on it), the tilewise version and :data:`FORMAT`. Any
change to one of them is another file: nothing stale is read.

Where: beside the model, ``<folder>/.tilewise-measured/<name>-<key16>.json``, for a spec of
the model folder or of the folder ``tilewise setup-models`` fills (whichever folder the server is
started on, so a restart with another ``--models`` keeps them) when that folder is writable;
else (built-in models, a read-only folder) in ``cache_dir`` (default
:data:`DEFAULT_MEASUREMENTS_DIR`, ``TILEWISE_MEASUREMENTS_DIR``). Both are read, beside first.
A file that cannot be read or parsed is ignored (measured again); a file that cannot be written
is logged and skipped: the cache never fails a start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.measure.dependence import TileDependence
from models.measure.footprint import Footprint
from models.measure.receptive import HaloCalibration, ReceptiveField
from models.spec import ModelSpec

if TYPE_CHECKING:
    from models.model import Model

__all__ = ["DEFAULT_MEASUREMENTS_DIR", "FORMAT", "MeasurementStore", "Measurements", "measurement_key"]

logger = logging.getLogger(__name__)

#: Measurement folder for built-in models and read-only model folders (``TILEWISE_MEASUREMENTS_DIR``).
DEFAULT_MEASUREMENTS_DIR = Path("~/.cache/tilewise/measurements").expanduser()
#: Version of the file's layout; part of the key.
FORMAT = 1
#: Folder beside the specs of a model folder.
BESIDE = ".tilewise-measured"


@dataclasses.dataclass
class Measurements:
    """What a loaded model has measured so far (``None``: not measured).

    Attributes:
        receptive_field: the impulse probe's result.
        tile_dependence: the tile-dependence probe's result.
        footprint: memory and time per voxel.
        halos: calibrated halos, ``((tile, tolerance, sample), calibration)``, oldest first.
    """

    receptive_field: ReceptiveField | None = None
    tile_dependence: TileDependence | None = None
    footprint: Footprint | None = None
    halos: list[tuple[tuple[tuple[int, ...], float, str], HaloCalibration]] = dataclasses.field(
        default_factory=list
    )

    def count(self) -> int:
        """How many measurements are held (a cheap "anything new?" check)."""
        held = (self.receptive_field, self.tile_dependence, self.footprint)
        return sum(m is not None for m in held) + len(self.halos)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready mapping (tuples become lists)."""

        def plain(value: Any) -> Any:
            return None if value is None else dataclasses.asdict(value)

        halos = []
        for (tile, tolerance, sample), calibration in self.halos:
            record = plain(calibration)
            record["errors"] = [[int(h), float(e)] for h, e in calibration.errors.items()]
            key = {"tile": list(tile), "tolerance": tolerance, "sample": sample}
            halos.append({**key, "calibration": record})
        return {
            "receptive_field": plain(self.receptive_field),
            "tile_dependence": plain(self.tile_dependence),
            "footprint": plain(self.footprint),
            "halos": halos,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurements:
        """The inverse of :meth:`to_json`.

        Raises:
            KeyError, TypeError, ValueError: not a mapping :meth:`to_json` wrote.
        """
        rf = data.get("receptive_field")
        td = data.get("tile_dependence")
        fp = data.get("footprint")
        receptive = None
        if rf is not None:
            receptive = ReceptiveField(
                tuple(int(r) for r in rf["radius"]), tuple(int(s) for s in rf["probe_shape"]),
                bool(rf["bounded"]), float(rf["seconds"]),
            )  # fmt: skip
        dependence = None
        if td is not None:
            dependence = TileDependence(**{
                **td,
                "radius": tuple(td["radius"]),
                "tile_shape": tuple(td["tile_shape"]),
                "central_box": tuple(tuple(b) for b in td["central_box"]),
            })  # fmt: skip
        footprint = None
        if fp is not None:
            runs = tuple((tuple(t), int(n), int(r), float(s)) for t, n, r, s in fp["measured"])
            footprint = Footprint(**{**fp, "measured": runs})
        halos = []
        for item in data.get("halos", []):
            record = dict(item["calibration"])
            record["errors"] = {int(h): float(e) for h, e in record["errors"]}
            key = (tuple(int(t) for t in item["tile"]), float(item["tolerance"]), str(item["sample"]))
            halos.append((key, HaloCalibration(**record)))
        return cls(receptive, dependence, footprint, halos)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tilewise")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _weights_digest(spec: ModelSpec) -> str:
    if spec.sha256:
        return spec.sha256
    if spec.file is None:
        return ""
    from models.weights import sha256_file

    try:
        return sha256_file(Path(spec.file))
    except OSError:
        return "unreadable"


def measurement_key(spec: ModelSpec, device: str) -> str:
    """The hex SHA-256 that names a model's measurements (see the module docstring)."""
    import torch

    described = spec.model_dump(mode="json", exclude={"file"})
    parts = {
        "spec": described,
        "weights": _weights_digest(spec),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "tilewise": _version(),
        "format": FORMAT,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class MeasurementStore:
    """Reads and writes models' :class:`Measurements` (see the module docstring).

    Args:
        models_dir: the model folder; measurements of its specs are kept beside them when writable.
        cache_dir: the folder for the others (default :data:`DEFAULT_MEASUREMENTS_DIR`).
        also_beside: further model folders whose specs keep theirs beside them (the folder
            ``tilewise setup-models`` fills).
    """

    def __init__(
        self, models_dir: Path | None, cache_dir: Path | str | None = None, also_beside: tuple[Path, ...] = ()
    ) -> None:
        self.models_dir = None if models_dir is None else Path(models_dir).resolve()
        self._beside = {Path(d).expanduser().resolve() for d in also_beside}
        if self.models_dir is not None:
            self._beside.add(self.models_dir)
        self.cache_dir = Path(cache_dir if cache_dir is not None else DEFAULT_MEASUREMENTS_DIR).expanduser()
        self._keys: dict[tuple[str, str], str] = {}

    def _key(self, spec: ModelSpec, device: str) -> str:
        ident = (spec.model_dump_json(), str(device))
        if ident not in self._keys:
            self._keys[ident] = measurement_key(spec, device)
        return self._keys[ident]

    def paths(self, spec: ModelSpec, device: str) -> list[Path]:
        """Where the measurements of ``spec`` on ``device`` are looked for, in order."""
        name = f"{spec.name}-{self._key(spec, device)[:16]}.json"
        found = []
        source = spec.source
        if source is not None and Path(source).resolve().parent in self._beside:
            found.append(Path(source).resolve().parent / BESIDE / name)
        found.append(self.cache_dir / name)
        return found

    def load(self, spec: ModelSpec, device: str) -> Measurements | None:
        """The stored measurements, or ``None`` (none stored, or unreadable: logged)."""
        for path in self.paths(spec, device):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                measured = Measurements.from_json(data)
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("model %s: measurements in %s ignored (%s)", spec.name, path, exc)
                continue
            logger.info("model %s: measurements read from %s", spec.name, path)
            return measured
        return None

    def save(self, spec: ModelSpec, device: str, measured: Measurements) -> Path | None:
        """Write ``measured`` (atomically) to the first writable place; its path, or ``None``."""
        text = json.dumps(measured.to_json(), indent=1)
        for path in self.paths(spec, device):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as fh:
                        fh.write(text)
                    os.replace(tmp, path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
            except OSError as exc:
                logger.info("model %s: measurements not written to %s (%s)", spec.name, path, exc)
                continue
            logger.info("model %s: measurements written to %s", spec.name, path)
            return path
        logger.warning("model %s: measurements could not be stored anywhere", spec.name)
        return None

    def restore(self, model: Model) -> bool:
        """Give ``model`` its stored measurements; whether any were found."""
        measured = self.load(model.spec, str(model.predictor.device))
        if measured is None:
            return False
        model.restore_measurements(measured)
        return True

    def store(self, model: Model) -> Path | None:
        """Write what ``model`` has measured (nothing when it measured nothing)."""
        measured = model.measurements()
        if not measured.count():
            return None
        return self.save(model.spec, str(model.predictor.device), measured)
