"""``tilewise plan INPUT --model NAME``: the plan of a request as JSON, without running the network.

The command line's dry run: the same JSON object as ``POST /v1/models/NAME/infer?dry_run=true``
(tile, halo, overlap, blend, batch_size, tiles, work, peak_bytes, eta_s, ...), from INPUT's header
alone. The model is loaded with the measurements a server's warm-up (or an earlier ``plan`` or
``infer``) stored (:mod:`models.measure.measured`): its footprint is measured only the first time (a few
forward passes of synthetic tiles). ``halo=auto`` takes the halo last calibrated for this tile
(by ``infer`` or a server on this machine, same weights and device), else the receptive-field
radius; ``halo_source`` says which. ``--memory-budget`` (``TILEWISE_MEMORY_BUDGET``) picks the tile and batch
size that the options do not give.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from service.options import INPUT_HELP, add_param_options, argparse_bytes, param_values

logger = logging.getLogger(__name__)


def register(sub: Any) -> None:
    """Add the ``plan`` sub-command."""
    parser = sub.add_parser(
        "plan",
        help="print the plan of a request as JSON (no network run)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("input", type=Path, help=INPUT_HELP)
    parser.add_argument("--model", required=True, help="model name (see GET /v1/models)")
    add_param_options(parser.add_argument_group("inference (default: the model's)"))
    parser.add_argument(
        "--memory-budget",
        type=argparse_bytes,
        default=None,
        help="memory the plan should fit, bytes or with a unit (300MB, 2GiB); when no plan fits, the "
        "smallest is planned and `warning` says so (default: TILEWISE_MEMORY_BUDGET, else unset)",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: TILEWISE_DEVICE or auto)")
    parser.add_argument("--models", type=Path, default=None, help="model folder (TILEWISE_MODELS_DIR)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from service.commands.infer import check_cheap

    status = check_cheap("plan", args.input, args.model, args.models)
    if status:
        return status
    from models import ModelError
    from models.planning.params import parse_params
    from service.codecs import configure_pillow
    from service.errors import ServiceError
    from service.memory import fix_mmap_threshold
    from service.pipeline import Limits
    from service.settings import Settings, open_repository
    from tiling import TilingError

    overrides = {"models_dir": args.models, "device": args.device, "memory_budget": args.memory_budget}
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    configure_pillow(settings.max_image_pixels)
    fix_mmap_threshold(settings.mmap_threshold_bytes)
    try:
        from service.dryrun import dry_run

        params = parse_params(param_values(args))
        repository = open_repository(settings)
        model = repository.get(args.model)
        answer = dry_run(model, args.input, params, Limits.from_settings(settings))
        repository.store_measurements(args.model)  # the footprint, when measured now
    except (ServiceError, ModelError, TilingError) as exc:
        logger.error("plan failed: %s", exc)
        return 1
    sys.stdout.write(json.dumps(answer, indent=2) + "\n")
    return 0
