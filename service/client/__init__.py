"""Batch client of the tilewise HTTP API: httpx, tqdm and pydantic-settings only.

Importing this package pulls in neither torch, numpy nor FastAPI (a test checks it in a fresh
interpreter), so ``tilewise batch`` starts fast on a machine that only talks to a server.

Modules: :mod:`~service.client.settings` (flags and ``TILEWISE_*`` fallbacks),
:mod:`~service.client.api` (retrying httpx client), :mod:`~service.client.jobs` (its job methods:
submit, poll, download), :mod:`~service.client.retry` (backoff),
:mod:`~service.client.plan` (walk and output names; formats by magic bytes with
:mod:`service.sniff`, shared with the server), :mod:`~service.client.runner` (the run; with
:mod:`~service.client.batch_plan`, :mod:`~service.client.send`, :mod:`~service.client.outdir`),
:mod:`~service.client.progress` (bar or log lines), :mod:`~service.client.report`
(``tilewise-report.json``), :mod:`~service.client.manifest` (``tilewise-manifest.jsonl``: what was
completed, verified on resume), :mod:`~service.client.errors`.
"""

from __future__ import annotations

from service.client.api import InferAnswer, TilewiseClient
from service.client.errors import (
    ClientError,
    Interrupted,
    JobFailedError,
    OutputDirError,
    ServerError,
    TransportFailure,
    UnknownModelError,
)
from service.client.plan import Candidate, discover, output_format, output_relpath
from service.client.report import REPORT_NAME, FileResult, Status
from service.client.runner import BatchOptions, BatchOutcome, run_batch
from service.client.settings import ClientSettings
from service.sniff import sniff_file

__all__ = [
    "REPORT_NAME",
    "BatchOptions",
    "BatchOutcome",
    "Candidate",
    "ClientError",
    "ClientSettings",
    "FileResult",
    "InferAnswer",
    "Interrupted",
    "JobFailedError",
    "OutputDirError",
    "ServerError",
    "Status",
    "TilewiseClient",
    "TransportFailure",
    "UnknownModelError",
    "discover",
    "output_format",
    "output_relpath",
    "run_batch",
    "sniff_file",
]
