"""``tilewise infer INPUT OUTPUT --model NAME``: one file through one model, in process.

Uses the same codecs and pipeline as the server, so the output is identical to what
``POST /v1/models/NAME/infer`` returns for the same file and options. The output format follows
``--format``, else OUTPUT's suffix (``.nii.gz``, ``.nii``, ``.png``, ``.tif``/``.tiff``, ``.npy``),
else the input (NIfTI in, ``nii.gz`` out; ``png`` for labels, ``tiff`` for probabilities). An
OUTPUT named for another image format (``.jpg``, ``.bmp``, ``.dcm`` ...) or for a format other than
``--format`` is refused (exit status 2): the bytes would not be what the name says. The output is
written under a temporary name and renamed into place when complete; ``--progress`` shows a bar of
tiles on stderr.

``--dask ADDRESS`` runs the network's tiled passes on a Dask cluster instead of in this process:
``local`` (2 worker processes, one thread each), ``local:N`` (N processes), or a scheduler address
such as ``tcp://host:8786``. Everything else (decoding, spacing and orientation, preprocessing,
TTA, labels, encoding) runs here as without ``--dask``, so the output is the same to float
rounding. The preprocessed volume is copied to a zarr array in a temporary folder under
``--dask-workdir`` (default: OUTPUT's folder), which every worker must see at the same path, as
it must see ``--models``. Each chunk (``--dask-chunk``; default: tile minus twice the halo) plus
the halo on each side runs on a worker, where the model is loaded once. ``--progress`` shows Dask's
progress bar on stderr. Tile-dependent networks (instance norm, attention, global pooling) are
refused (exit status 1, "not distributable") when the volume is more than one chunk: chunks are
never blended, so every chunk border would be a seam. Needs the ``distributed`` extra.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.options import FORMAT_SUFFIXES, INPUT_HELP, add_param_options, argparse_bytes, param_values

logger = logging.getLogger(__name__)

#: Output suffixes and their formats (``.tif``, ``.ome.tif`` too), longest first (``.ome.tiff``
#: before ``.tiff``).
_SUFFIXES = (
    *((suffix, fmt) for fmt, suffix in FORMAT_SUFFIXES.items()),
    (".tif", "tiff"),
    (".ome.tif", "ome.tiff"),
)
_SUFFIX_FORMATS = tuple(sorted(_SUFFIXES, key=lambda pair: -len(pair[0])))


def register(sub: Any) -> None:
    """Add the ``infer`` sub-command."""
    parser = sub.add_parser(
        "infer",
        help="run a model on one file in process (no server)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("input", type=Path, help=INPUT_HELP)
    parser.add_argument("output", type=Path, help="output file")
    parser.add_argument("--model", required=True, help="model name (see GET /v1/models)")
    add_param_options(
        parser.add_argument_group("inference (default: the model's; --format: OUTPUT's suffix)")
    )
    parser.add_argument(
        "--memory-budget",
        type=argparse_bytes,
        default=None,
        help="memory the run should fit, bytes or with a unit (300MB, 2GiB): picks the tile and batch "
        "size not given; when no plan fits, the smallest is run with a warning (default: "
        "TILEWISE_MEMORY_BUDGET, else unset)",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: TILEWISE_DEVICE or auto)")
    parser.add_argument("--models", type=Path, default=None, help="model folder (TILEWISE_MODELS_DIR)")
    parser.add_argument("--progress", action="store_true", help="show a progress bar over tiles")
    cluster = parser.add_argument_group("Dask cluster (the distributed extra)")
    cluster.add_argument(
        "--dask",
        metavar="ADDRESS",
        default=None,
        help="run the tiled network passes on a Dask cluster: local (2 worker processes), local:N, "
        "or a scheduler address tcp://host:8786; tile-dependent networks are refused unless the "
        "volume is one chunk",
    )
    cluster.add_argument(
        "--dask-workdir",
        type=Path,
        default=None,
        help="folder every worker sees at the same path, for the zarr copies (default: OUTPUT's folder)",
    )
    cluster.add_argument(
        "--dask-chunk",
        type=_positive_int,
        default=None,
        metavar="N",
        help="chunk size per axis in voxels (default: the tile minus twice the halo)",
    )
    parser.set_defaults(run=_run)


#: Suffixes of image and volume formats that tilewise reads or that viewers know, but never writes.
_FOREIGN_SUFFIXES = {".dcm", ".dicom", ".mha", ".mhd", ".nrrd", ".nhdr", ".mgz", ".mgh", ".hdr", ".img"}


def output_problem(path: Path, requested: str | None) -> str | None:
    """Why ``path`` cannot hold the output (format ``requested``, or the default), or ``None``."""
    from PIL import Image

    named = format_from_suffix(path)
    suffix = path.suffix.lower()
    writable = ".nii.gz, .nii, .png, .tif/.tiff, .ome.tiff, .geojson or .npy"
    if named is None and (suffix in Image.registered_extensions() or suffix in _FOREIGN_SUFFIXES):
        return f"cannot write {path.name!r}: tilewise does not write {suffix} files; name it {writable}"
    if named is not None and requested is not None and named != requested:
        return (
            f"--format {requested} does not match {path.name!r} (a {named} name); drop one or make them agree"
        )
    return None


def format_from_suffix(path: Path) -> str | None:
    """The output format named by ``path``'s suffix, or ``None``."""
    name = path.name.lower()
    return next((fmt for suffix, fmt in _SUFFIX_FORMATS if name.endswith(suffix)), None)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def input_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as an input file (no such file, a folder, ...), or ``None``."""
    if not path.exists():
        return f"{path}: no such file" + (" (a dangling link)" if path.is_symlink() else "")
    if path.is_dir():  # a folder is a DICOM series (service.codecs.dicom_files)
        if not os.access(path, os.R_OK | os.X_OK):
            return f"{path}: permission denied"
        if not any(p.is_file() for p in path.rglob("*")):
            return f"{path} is a folder, not a file (nor a DICOM series folder: it holds no file)"
        return None
    if not path.is_file():
        return f"{path} is not a regular file"
    if not os.access(path, os.R_OK):
        return f"{path}: permission denied"
    return None


def check_cheap(command: str, input_path: Path, model: str, models_dir: Path | None) -> int:
    """The checks that need neither torch nor a loaded model (a fraction of a second): the input
    file and the model name (with "did you mean"). 0, or the exit status 2 after saying why."""
    from models.errors import UnknownModelError
    from models.names import check_model_name
    from service.settings import Settings

    problem = input_problem(input_path)
    if problem is not None:
        sys.stderr.write(f"tilewise {command}: error: {problem}\n")
        return 2
    try:
        check_model_name(model, models_dir or Settings().models_dir)
    except UnknownModelError as exc:
        sys.stderr.write(f"tilewise {command}: error: {exc}\n")
        return 2
    return 0


def _run(args: argparse.Namespace) -> int:
    problem = output_problem(args.output, param_values(args).get("format"))
    if problem is not None:
        sys.stderr.write(f"tilewise infer: error: {problem}\n")
        return 2
    status = check_cheap("infer", args.input, args.model, args.models)
    if status:
        return status
    from models import ModelError
    from models.planning.params import parse_params
    from service.admission import admit
    from service.codecs import configure_pillow
    from service.errors import ServiceError
    from service.memory import fix_mmap_threshold
    from service.pipeline import Limits, run_file
    from service.settings import Settings, open_repository
    from service.stages import RunOptions
    from tiling import TilingError

    overrides = {"models_dir": args.models, "device": args.device, "memory_budget": args.memory_budget}
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    configure_pillow(settings.max_image_pixels)
    fix_mmap_threshold(settings.mmap_threshold_bytes)
    raw: dict[str, str | None] = {"format": format_from_suffix(args.output), **param_values(args)}
    target: Path = args.output
    stem = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        params = parse_params(raw)
        repository = open_repository(settings)
        limits = Limits(max_image_pixels=settings.max_image_pixels, memory_budget=settings.memory_budget)
        model = admit(repository, args.model, args.input, params, limits).model  # as the server admits
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            tiled = None if args.dask is None else stack.enter_context(_dask_pass(args, settings, target))
            options = RunOptions(progress=args.progress, tiled=tiled)
            result = run_file(model, args.input, stem, params, limits=limits, options=options)
        os.replace(result.path, target)
        repository.store_measurements(args.model)  # a later `tilewise plan` plans this halo
    except (ServiceError, ModelError, TilingError) as exc:
        logger.error("infer failed: %s", exc)
        return 1
    finally:
        for suffix in FORMAT_SUFFIXES.values():  # a failed write leaves no partial output behind
            stem.with_name(stem.name + suffix).unlink(missing_ok=True)
    logger.info(
        "wrote %s (%s, %s %s, shape %s; plan %s%s) in %.2f s",
        target,
        result.format,
        result.output_kind,
        result.output_dtype,
        result.output_shape,
        result.plan.header(),
        "" if result.seam is None else f"; seam {result.seam.header()}",
        result.seconds,
    )
    return 0


@contextlib.contextmanager
def _dask_pass(args: argparse.Namespace, settings: Any, target: Path) -> Iterator[Any]:
    """The cluster's :class:`~service.cluster.DaskPass` for ``--dask``, closed with the run."""
    from service.cluster import DaskPass, dask_client, local_torch_threads

    workdir = (args.dask_workdir or target.parent).resolve()
    with dask_client(args.dask) as (client, n_local):
        threads = None if n_local is None else local_torch_threads(n_local)
        models_dir = None if settings.models_dir is None else Path(settings.models_dir).resolve()
        with DaskPass(
            client, workdir, models_dir=models_dir, device=settings.device, strict=settings.strict_models,
            torch_threads=threads, chunk=args.dask_chunk,
        ) as tiled:  # fmt: skip
            yield tiled
