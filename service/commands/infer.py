"""``tilewise infer INPUT OUTPUT --model NAME``: one file through one model, in process.

Uses the same codecs and pipeline as the server, so the output is identical to what
``POST /v1/models/NAME/infer`` returns for the same file and options. The output format follows
``--format``, else OUTPUT's suffix (``.nii.gz``, ``.nii``, ``.png``, ``.tif``/``.tiff``, ``.npy``),
else the input (NIfTI in, ``nii.gz`` out; ``png`` for labels, ``tiff`` for probabilities). An
OUTPUT named for another image format (``.jpg``, ``.bmp``, ``.dcm`` ...) or for a format other than
``--format`` is refused (exit status 2): the bytes would not be what the name says. The output is
written under a temporary name and renamed into place when complete; ``--progress`` shows a bar of
tiles on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from service._options import FORMAT_SUFFIXES, add_param_options, argparse_number, param_values

logger = logging.getLogger(__name__)

#: Output suffixes and their formats (``.tif`` too); no suffix ends another, so order is free.
_SUFFIX_FORMATS = (*((suffix, fmt) for fmt, suffix in FORMAT_SUFFIXES.items()), (".tif", "tiff"))


def register(sub: Any) -> None:
    """Add the ``infer`` sub-command."""
    parser = sub.add_parser(
        "infer",
        help="run a model on one file in process (no server)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("input", type=Path, help="input file: NIfTI-1/2 (.nii, .nii.gz), PNG, JPEG or TIFF")
    parser.add_argument("output", type=Path, help="output file")
    parser.add_argument("--model", required=True, help="model name (see GET /v1/models)")
    add_param_options(
        parser.add_argument_group("inference (default: the model's; --format: OUTPUT's suffix)")
    )
    parser.add_argument(
        "--memory-budget",
        type=argparse_number(int, 1),
        default=None,
        help="bytes the run should fit: picks the tile and batch size not given (TILEWISE_MEMORY_BUDGET)",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: TILEWISE_DEVICE or auto)")
    parser.add_argument("--models", type=Path, default=None, help="model folder (TILEWISE_MODELS_DIR)")
    parser.add_argument("--progress", action="store_true", help="show a progress bar over tiles")
    parser.set_defaults(run=_run)


#: Suffixes of image and volume formats that tilewise reads or that viewers know, but never writes.
_FOREIGN_SUFFIXES = {".dcm", ".dicom", ".mha", ".mhd", ".nrrd", ".nhdr", ".mgz", ".mgh", ".hdr", ".img"}


def output_problem(path: Path, requested: str | None) -> str | None:
    """Why ``path`` cannot hold the output (format ``requested``, or the default), or ``None``."""
    from PIL import Image

    named = format_from_suffix(path)
    suffix = path.suffix.lower()
    writable = ".nii.gz, .nii, .png, .tif/.tiff or .npy"
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


def _run(args: argparse.Namespace) -> int:
    from models import ModelError, ModelRepository
    from models.params import parse_params
    from service.codecs import configure_pillow
    from service.errors import ServiceError
    from service.memory import fix_mmap_threshold
    from service.pipeline import Limits, run_file
    from service.settings import Settings
    from tiling import TilingError

    overrides = {"models_dir": args.models, "device": args.device, "memory_budget": args.memory_budget}
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    configure_pillow(settings.max_image_pixels)
    fix_mmap_threshold(settings.mmap_threshold_bytes)
    raw: dict[str, str | None] = {"format": format_from_suffix(args.output), **param_values(args)}
    problem = output_problem(args.output, param_values(args).get("format"))
    if problem is not None:
        sys.stderr.write(f"tilewise infer: error: {problem}\n")
        return 2
    if not args.input.is_file():
        logger.error("input %s is not a file", args.input)
        return 2
    target: Path = args.output
    stem = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        params = parse_params(raw)
        model = ModelRepository(
            settings.models_dir, device=settings.device, strict=settings.strict_models
        ).get(args.model)
        target.parent.mkdir(parents=True, exist_ok=True)
        limits = Limits(max_image_pixels=settings.max_image_pixels, memory_budget=settings.memory_budget)
        result = run_file(model, args.input, stem, params, limits=limits, progress=args.progress)
        os.replace(result.path, target)
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
