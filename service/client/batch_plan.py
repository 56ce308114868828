"""Plan a batch run: which inputs to send, and which are known done, skipped or refused without the server.

One job: from the discovered candidates, the options, the model's defaults and the manifest, the
list of jobs to send and the results decided before sending (clashes, escapes, verified outputs).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from service.client.api import TilewiseClient
from service.client.batch_types import BatchOptions, _Job
from service.client.errors import TransportFailure
from service.client.manifest import Manifest
from service.client.outdir import _output_escape
from service.client.plan import Candidate, output_format, output_relpath
from service.client.report import FileResult, Status
from service.sniff import DICOM_ADVICE

__all__: list[str] = []

logger = logging.getLogger("service.client.runner")


def _model_defaults(client: TilewiseClient, model: str, *, reachable: bool) -> dict[str, Any] | None:
    """The model's ``defaults`` from the server.

    Args:
        reachable: when False, an unreachable server gives ``None`` instead of an error.

    Raises:
        ClientError: the server refused (unknown model, wrong API key ...) or, with ``reachable``,
            stayed unreachable through every retry.
    """
    try:
        info = client.model_info(model)
    except TransportFailure as exc:
        if reachable:
            raise
        logger.warning("cannot read the model list (%s); using the documented defaults", exc)
        return None
    defaults = info.get("defaults")
    return defaults if isinstance(defaults, dict) else {}


def _plan(
    candidates: Sequence[Candidate],
    options: BatchOptions,
    defaults: Mapping[str, Any] | None,
    manifest: Manifest,
    output_root: str,
) -> tuple[list[_Job], list[FileResult]]:
    """Split candidates into jobs to send and results known without the server."""
    jobs: list[_Job] = []
    known: list[FileResult] = []
    owners: dict[PurePosixPath, str] = {}
    for cand in candidates:
        rel = str(cand.rel)
        if cand.unreadable is not None:
            known.append(FileResult(rel, None, Status.FAILED, error=cand.unreadable))
            continue
        if not cand.sendable:
            if cand.skipped is not None:
                reason = cand.skipped
            elif cand.kind == "dicom":
                reason = f"DICOM: {DICOM_ADVICE}"
            else:
                reason = "not a format the server reads (content)"
            known.append(FileResult(rel, None, Status.SKIPPED, error=reason))
            continue
        fmt = output_format(
            cand.effective_kind,
            fmt=options.params.get("format"),
            output=options.params.get("output"),
            defaults=defaults,
        )
        out_rel = output_relpath(cand.rel, fmt)
        if out_rel in owners:
            clash = f"output {out_rel} is also that of {owners[out_rel]}"
            known.append(FileResult(rel, None, Status.FAILED, error=clash))
            continue
        owners[out_rel] = rel
        escape = _output_escape(output_root, out_rel)
        if escape:
            known.append(FileResult(rel, None, Status.FAILED, error=escape))
            continue
        if not options.overwrite:
            entry, why = manifest.verify(rel, cand.path, Path(output_root), options.model, options.params)
            if entry is not None and _output_escape(output_root, PurePosixPath(entry.output)) is None:
                known.append(FileResult(rel, entry.output, Status.SKIPPED, error="output exists (verified)"))
                continue
            if (Path(output_root) / out_rel).exists():
                logger.warning("%s: existing output %s is not trusted (%s); redoing it", rel, out_rel, why)
        if cand.slide is not None:
            logger.info("%s: a slide (%s), sent as a job", rel, cand.slide)
        jobs.append(_Job(cand, out_rel, fmt))
    return jobs, known
