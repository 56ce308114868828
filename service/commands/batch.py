"""``tilewise batch``: run every image or volume of a folder through a tilewise server.

The output tree mirrors the input tree, each output with the suffix of its format
(``a/b/scan.nii.gz`` -> ``a/b/scan.nii.gz``, ``x/page.jpg`` -> ``x/page.tiff`` or ``.png``), never
outside OUTPUT_DIR. Links to files are followed wherever they point; links to folders only when
their target stays inside INPUT_DIR. A refused connection or a 503 is retried ``--retries`` times
and then for ``--retry-for`` seconds (default 600: a server restart). Each
output appears under its final name only when complete, and is recorded (size, SHA-256) in
``OUTPUT_DIR/tilewise-manifest.jsonl``; a re-run skips inputs whose record verifies. At the end a
summary goes to stdout and ``OUTPUT_DIR/tilewise-report.json`` lists every input. Ctrl-C once:
finish the files in flight; twice: abort them.

With ``--jobs`` (and, without it, for files of at least ``--jobs-above`` bytes) a file goes as a
job (``POST /v1/jobs``): the bar shows its tiles done, and a replica that dies while it runs the
job costs nothing but time: another replica takes the job over and the client polls on.

Exit status: 0 when no file failed, 1 when some did, 2 when the run could not start (bad
arguments, unknown model, wrong API key, OUTPUT_DIR not writable), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from service.options import add_param_options, argparse_number, param_values

logger = logging.getLogger(__name__)

_positive_int = argparse_number(int, 1)
_non_negative_int = argparse_number(int, 0)
_positive_float = argparse_number(float, 0.0, strict=True)
_non_negative_float = argparse_number(float, 0.0)

#: ``--retry-for`` when neither it nor ``TILEWISE_RETRY_FOR_S`` is given: longer than a replica's
#: restart on a loaded machine (a cold warm-up took 7 minutes there; a measured one, seconds).
RETRY_FOR_S = 600.0
_RETRY_FOR_ENV = "TILEWISE_RETRY_FOR_S"

#: Files of at least this size go as jobs (``--jobs-above``): a synchronous request for a file that
#: large runs for minutes with no progress, and is lost with its replica.
JOBS_ABOVE_BYTES = 128 * 2**20


def _retry_for(given: float | None) -> float | None:
    """``--retry-for``, else ``None`` (the variable's) when ``TILEWISE_RETRY_FOR_S`` is set, else
    :data:`RETRY_FOR_S`."""
    if given is not None:
        return given
    return None if os.environ.get(_RETRY_FOR_ENV) else RETRY_FOR_S


def register(sub: Any) -> None:
    """Add the ``batch`` sub-command."""
    parser = sub.add_parser(
        "batch",
        help="run a folder of images/volumes through a tilewise server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "input_dir", type=Path, metavar="INPUT_DIR", help="folder of inputs (with --dicomweb: OUTPUT_DIR)"
    )
    parser.add_argument("output_dir", type=Path, nargs="?", metavar="OUTPUT_DIR", help="folder of outputs")
    conn = parser.add_argument_group("server")
    conn.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000 (env TILEWISE_URL)")
    conn.add_argument("--model", required=True, help="model name, e.g. gaussian-3d")
    conn.add_argument("--api-key", help="API key (env TILEWISE_API_KEY)")
    conn.add_argument("--concurrency", type=_positive_int, help="files in flight at once (default: 2)")
    conn.add_argument(
        "--retries",
        type=_non_negative_int,
        help="retries per file after a connection error, timeout or 429/502/503/504, with exponential "
        "backoff and jitter, honouring Retry-After (default: 5)",
    )
    conn.add_argument(
        "--retry-for",
        type=_non_negative_float,
        metavar="SECONDS",
        help="keep retrying a file this long (waits between attempts) after a connection error or "
        "503, beyond --retries: outlasts a server restart (default: 600; env TILEWISE_RETRY_FOR_S)",
    )
    conn.add_argument(
        "--jobs",
        action="store_true",
        help="send every file as a job (POST /v1/jobs): tile progress per file, and a file survives "
        "the server replica running it dying (another one takes the job over; polling goes on)",
    )
    conn.add_argument(
        "--jobs-above",
        type=_non_negative_int,
        default=JOBS_ABOVE_BYTES,
        metavar="BYTES",
        help=f"send files of at least BYTES bytes as jobs even without --jobs (default: {JOBS_ABOVE_BYTES}, "
        "128 MiB; 0: every file)",
    )
    conn.add_argument(
        "--timeout",
        type=_positive_float,
        help="seconds to wait for a connection, a send or the answer of one file (default: 300)",
    )
    pacs = parser.add_argument_group("DICOMweb (instead of INPUT_DIR: every image series of a study)")
    pacs.add_argument(
        "--dicomweb", metavar="URL", help="DICOMweb root of a PACS, e.g. http://pacs:8042/dicom-web"
    )
    pacs.add_argument(
        "--study", metavar="UID", help="StudyInstanceUID whose series are run (with --dicomweb)"
    )
    pacs.add_argument("--dicomweb-username", help="DICOMweb user (env TILEWISE_DICOMWEB_USERNAME)")
    pacs.add_argument("--dicomweb-password", help="DICOMweb password (env TILEWISE_DICOMWEB_PASSWORD)")
    sel = parser.add_argument_group("files")
    sel.add_argument(
        "--pattern",
        action="append",
        default=[],
        help="glob on the path relative to INPUT_DIR ('**' crosses folders; repeatable). Default: "
        "every file whose content (or name) is NIfTI, PNG, JPEG or TIFF",
    )
    sel.add_argument(
        "-r",
        "--recursive",
        action="store_true",
        help="walk subfolders (implied by a pattern with '/' or '**')",
    )
    sel.add_argument(
        "--overwrite", action="store_true", help="redo every output, even those the manifest verifies"
    )
    sel.add_argument(
        "--progress",
        choices=("auto", "bar", "log"),
        default="auto",
        help="a progress bar (on a terminal by default) or one log line per file",
    )
    add_param_options(parser.add_argument_group("inference (sent as query parameters; default: the model's)"))
    parser.set_defaults(run=_run)


def query_params(args: argparse.Namespace) -> dict[str, str]:
    """The inference options given on the command line, validated, as HTTP query parameters.

    Raises:
        ParamError: an invalid value (the message names the option and the value).
    """
    from models.planning.params import parse_params

    return parse_params(param_values(args)).to_query()


def _run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from service.client import (
        BatchOptions,
        ClientError,
        ClientSettings,
        Status,
        TilewiseClient,
        run_batch,
    )
    from service.client.progress import make_progress

    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # One line per file says it all; httpx's own INFO line per request would double it.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    given = {
        "url": args.url,
        "api_key": args.api_key,
        "concurrency": args.concurrency,
        "retries": args.retries,
        "retry_for_s": _retry_for(args.retry_for),
        "timeout_s": args.timeout,
    }
    try:
        settings = ClientSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            if err["type"] == "missing" and field == "url":
                logger.error("no server: pass --url URL or set TILEWISE_URL")
            else:
                logger.error("%s: %s", field, err["msg"])
        return 2
    try:
        params = query_params(args)
    except ValueError as exc:
        logger.error("batch not started: %s", exc)
        return 2
    if args.dicomweb or args.study:
        return _run_dicomweb(args, settings, params)
    if args.output_dir is None:
        logger.error(
            "batch not started: give INPUT_DIR and OUTPUT_DIR (or --dicomweb URL --study UID OUTPUT_DIR)"
        )
        return 2
    options = BatchOptions(
        input_dir=args.input_dir,
        output_dir=args.output_dir,
        model=args.model,
        params=params,
        patterns=tuple(args.pattern),
        recursive=args.recursive,
        overwrite=args.overwrite,
        jobs=args.jobs,
        jobs_min_bytes=args.jobs_above,
    )
    try:
        with TilewiseClient(settings) as client:
            outcome = run_batch(options, client, progress=make_progress(args.progress))
    except KeyboardInterrupt:
        logger.error("interrupted; the report lists what was done")
        return 130
    except (ClientError, NotADirectoryError, ValueError) as exc:
        logger.error("batch not started: %s", exc)
        return 2
    done, skipped, failed = (outcome.count(s) for s in (Status.DONE, Status.SKIPPED, Status.FAILED))
    for result in outcome.results:
        if result.status is Status.FAILED:
            logger.error("failed: %s: %s", result.input, result.error)
    sent = done + failed
    rate = sent / outcome.seconds if outcome.seconds > 0 else 0.0
    sys.stdout.write(
        f"done {done}, skipped {skipped}, failed {failed} in {outcome.seconds:.1f} s "
        f"({rate:.2f} files/s); report: {outcome.report_path}\n"
    )
    sys.stdout.flush()
    return 0 if outcome.ok else 1


def _run_dicomweb(args: argparse.Namespace, settings: Any, params: dict[str, str]) -> int:
    """``--dicomweb URL --study UID OUTPUT_DIR``: every image series of the study (exit 0, 1 or 2)."""
    import os

    from service.client import ClientError, TilewiseClient
    from service.client.dicomweb_batch import run_dicomweb_batch
    from service.dicomweb import DicomwebError

    if not (args.dicomweb and args.study) or args.output_dir is not None:
        logger.error("batch not started: give --dicomweb URL --study UID OUTPUT_DIR (no INPUT_DIR)")
        return 2
    username = args.dicomweb_username or os.environ.get("TILEWISE_DICOMWEB_USERNAME")
    password = args.dicomweb_password or os.environ.get("TILEWISE_DICOMWEB_PASSWORD")
    try:
        with TilewiseClient(settings) as client:
            results = run_dicomweb_batch(
                client, args.dicomweb, args.study, args.input_dir, args.model, params,
                username=username, password=password,
            )  # fmt: skip
    except KeyboardInterrupt:
        logger.error("interrupted")
        return 130
    except (ClientError, DicomwebError, ValueError) as exc:
        logger.error("batch not started: %s", exc)
        return 2
    failed = [r for r in results if r.error is not None]
    sys.stdout.write(f"series done {len(results) - len(failed)}, failed {len(failed)}\n")
    sys.stdout.flush()
    return 1 if failed else 0
