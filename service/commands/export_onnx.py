"""``tilewise export-onnx``: export an eager model of the repository to ONNX, with a parity check."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected ints separated by commas, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def register(subparsers: Any) -> None:
    """Add the ``export-onnx`` parser."""
    parser = subparsers.add_parser(
        "export-onnx",
        help="export an eager model to ONNX (dynamic batch and spatial axes) and check parity",
        description=(
            "Export MODEL (an eager or analytic model of the repository) to OUT with dynamic batch "
            "and spatial axes, then compare ONNX Runtime with eager PyTorch on a random input of "
            "another size. Prints the max abs difference and the sizes the file takes (a strided "
            "network's graph takes only sizes on its stride grid, the spec's alignment); exits 1 "
            "above --atol."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="model name")
    parser.add_argument("out", metavar="OUT", type=Path, help="the .onnx file to write")
    parser.add_argument(
        "--tile", type=_ints, default=None, help="export shape, e.g. 64 or 64,64,32 (default: spec)"
    )
    parser.add_argument("--atol", type=float, default=1e-4, help="parity tolerance (default: 1e-4)")
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset (default: 18)")
    parser.add_argument(
        "--models", type=Path, default=None, help="model folder (default: $TILEWISE_MODELS_DIR)"
    )
    parser.add_argument("--spec", action="store_true", help="also write OUT's spec YAML next to it")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import yaml

    from models import ExportError, ModelError, ModelRepository
    from models.export import alignment_note, export_onnx, onnx_spec_mapping
    from models.weights import sha256_file

    models_dir = args.models or os.environ.get("TILEWISE_MODELS_DIR")
    try:
        repo = ModelRepository(models_dir, device="cpu")
        model = repo.get(args.model)
        module = getattr(model.predictor, "module", None)
        if module is None:
            logger.error(
                "model %r has backend %r; export-onnx takes an eager model", args.model, model.spec.backend
            )
            return 2
        spec = model.spec
        tile = args.tile or model.plan([1] * spec.spatial_dims).tile  # the spec's default tile
        if len(tile) == 1:
            tile = tile * spec.spatial_dims
        if len(tile) != spec.spatial_dims:
            logger.error("--tile needs 1 or %d values, got %s", spec.spatial_dims, tile)
            return 2
        report = export_onnx(
            module,
            args.out,
            in_channels=spec.in_channels,
            export_shape=tile,
            alignment=spec.alignment_lcm,
            atol=args.atol,
            opset=args.opset,
            name=spec.name,
        )
    except ExportError as exc:
        logger.error("%s", exc)
        sys.stdout.write(f"FAILED {exc}\n")
        return 1
    except ModelError as exc:
        logger.error("export-onnx failed: %s", exc)
        return 2
    sys.stdout.write(
        f"{args.out}: max abs difference {report.max_abs_diff:.3g} (atol {report.atol:g}) "
        f"on input {report.parity_shape}\n"
        f"{args.out}: {alignment_note(spec.alignment, spec.spatial_dims)}\n"
    )
    if args.spec:
        spec_path = args.out.with_suffix(".yaml")
        mapping = onnx_spec_mapping(spec, args.out, sha256_file(args.out), name=f"{spec.name}-onnx")
        spec_path.write_text(yaml.safe_dump(mapping, sort_keys=False), encoding="utf-8")
        sys.stdout.write(f"spec: {spec_path}\n")
    return 0
