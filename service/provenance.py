"""Where an output came from, written into every output file.

A result found later on a disk or in a PACS says which model made it, with which weights, which
tilewise and which plan:

=============  ==========================================================================
Format         Where
=============  ==========================================================================
NIfTI          ``descrip`` = ``tilewise MODEL sha256:12HEX`` (80 bytes at most), and a header
               extension of code 6 ("comment", NIfTI-1's documented code for free text) holding
               the JSON of :meth:`Provenance.as_dict` under the key ``"tilewise"``
TIFF           tifffile's JSON ``ImageDescription`` (key ``tilewise``, next to ``shape``)
PNG            ``tEXt`` chunk of key ``tilewise`` (the JSON)
DICOM SEG      ``ContentCreatorName`` ``tilewise``, ``ManufacturerModelName`` (model),
               ``SoftwareVersions`` (tilewise), ``ContentDescription`` (the ``descrip`` line),
               and per segment ``SegmentAlgorithmName`` / ``SegmentAlgorithmVersion`` and the
               algorithm parameters ``weights_sha256`` and ``plan``
=============  ==========================================================================

``weights_sha256`` is the spec's ``sha256`` when given, else the hash of its weights file, else
(analytic models, which have no weights) the hash of the spec's canonical JSON.

Standard library only (plus :mod:`models.weights` for the file hash).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["NIFTI_EXTENSION_CODE", "Provenance", "provenance_of", "tilewise_version"]

#: NIfTI-1 extension code of the provenance JSON ("comment").
NIFTI_EXTENSION_CODE = 6


@functools.cache
def tilewise_version() -> str:
    """The installed tilewise's version (``0+unknown`` when not installed as a package)."""
    try:
        return metadata.version("tilewise")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:  # noqa: ARG001 - cache keys
    from models.weights import sha256_file

    return sha256_file(Path(path))


def _weights_sha256(spec: Any) -> str:
    if getattr(spec, "sha256", None):
        return str(spec.sha256).lower()
    file = getattr(spec, "file", None)
    if file is not None:
        path = Path(file)
        if path.is_file():
            stat = path.stat()
            return _file_sha256(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Provenance:
    """What made an output.

    Attributes:
        model: the model's name.
        weights_sha256: 64 hex digits (see the module docstring for models without weights).
        tilewise_version: the package version.
        plan: the plan line that ran (``X-Tilewise-Plan``).
        output: ``labels`` or ``probabilities``.
        labels: label index -> name, when the spec names them.
        activation: the output activation (``softmax``, ``sigmoid`` ...), to tell a background channel.
    """

    model: str
    weights_sha256: str
    tilewise_version: str
    plan: str
    output: str = "labels"
    labels: dict[int, str] = field(default_factory=dict)
    activation: str = "none"

    def descrip(self) -> str:
        """``tilewise MODEL sha256:12HEX`` (the NIfTI ``descrip``, at most 80 bytes)."""
        return f"tilewise {self.model} sha256:{self.weights_sha256[:12]}"[:79]

    def as_dict(self) -> dict[str, Any]:
        """``{"model", "weights_sha256", "tilewise_version", "plan", "output"}`` (JSON-ready)."""
        out = asdict(self)
        out.pop("labels")
        out.pop("activation")
        return out

    def json(self) -> str:
        """``{"tilewise": as_dict()}`` as compact JSON."""
        return json.dumps({"tilewise": self.as_dict()}, separators=(",", ":"), sort_keys=True)


def provenance_of(spec: Any, plan_line: str, output: str) -> Provenance:
    """The provenance of an output of model ``spec`` made by the plan ``plan_line``."""
    labels = {int(k): str(v) for k, v in (spec.labels or {}).items()}
    activation = getattr(getattr(spec, "output", None), "activation", "none")
    return Provenance(
        model=str(spec.name),
        weights_sha256=_weights_sha256(spec),
        tilewise_version=tilewise_version(),
        plan=plan_line,
        output=output,
        labels=labels,
        activation=str(getattr(activation, "value", activation)),
    )
