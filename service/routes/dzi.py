"""Deep Zoom views of a job's input and result: ``GET /v1/jobs/{id}/dzi/{input|result}.dzi`` and
``GET /v1/jobs/{id}/dzi/{input|result}_files/{level}/{col}_{row}.{jpeg|png}``.

The layout OpenSeadragon reads (:mod:`service.dzi`): the input as JPEG tiles, the result as PNG
tiles coloured like the page's legend (``?channel=K`` picks a probability channel; OpenSeadragon
passes the ``.dzi`` URL's query on to the tiles). A job is seen only by the key that submitted it
(404 otherwise, as every job route); the input is kept after a job ends only for 2D images
(TIFF, PNG, JPEG), for this view. Bad level, column or row: 400 when not an integer, 404 when
past the image.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from service.dzi import DeepZoom, display_window, dzi_xml, encode_tile, opened, render_tile
from service.errors import BadParameterError, JobNotFoundError, JobStateError
from service.jobs import JobState
from service.jobs.store import INPUT_FILE
from service.routes.docs import error_doc
from service.routes.jobs import JobsDep, PrincipalDep, _read_own

__all__ = ["router"]

router = APIRouter(tags=["jobs"])

_FORMATS = {"input": "jpeg", "result": "png"}
_MEDIA = {"jpeg": "image/jpeg", "png": "image/png"}
_HEADERS = {"Cache-Control": "private, max-age=3600"}
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: error_doc("bad_parameter", "Level, column, row or channel not an integer, or a wrong format."),
    404: error_doc("unknown_job", "No job of this id, no such tile (`not_found`), or no input kept."),
    409: error_doc("job_not_done", "The result of a job that is not done."),
    415: error_doc("unsupported_media_type", "The job's file is no 2D image (a volume)."),
}
ChannelQuery = Annotated[int, Query(ge=0, le=4096, description="Probability channel shown (result only).")]


def _role(name: str, suffix: str) -> str:
    role = name.removesuffix(suffix)
    if role not in _FORMATS or not name.endswith(suffix):
        raise HTTPException(404, f"no deep-zoom image {name!r}: input{suffix} or result{suffix}")
    return role


def _file_of(service: JobsDep, job_id: str, principal: PrincipalDep, role: str) -> tuple[Path, str]:
    """The file the view reads and the result's kind (``labels`` or ``probabilities``)."""
    record = _read_own(service, job_id, principal)
    folder = service.store.folder(job_id)
    kind = "labels"
    if role == "input":
        path = folder / INPUT_FILE
        if not path.is_file():
            raise JobNotFoundError(f"job {job_id} keeps no 2D input to view (gone, or a volume)")
        return path, kind
    result = record.result
    if record.state is not JobState.DONE or result is None:
        raise JobStateError(f"job {job_id} is {record.state.value}; its result exists once it is done")
    path = folder / result.file
    if not path.is_file():
        raise JobNotFoundError(f"the result of job {job_id} has expired")
    headers = {k.lower(): v for k, v in result.headers.items()}
    kind = "labels" if headers.get("x-tilewise-output", "labels") == "labels" else "probabilities"
    return path, kind


def _descriptor(
    service: JobsDep, job_id: str, principal: PrincipalDep, role: str
) -> tuple[str, dict[str, str]]:
    """The XML and the headers that say how the tiles are drawn: ``X-Tilewise-Output`` (the
    result's kind) and, for probabilities, ``X-Tilewise-Range: LO,HI`` (the ramp's ends)."""
    path, kind = _file_of(service, job_id, principal, role)
    headers = dict(_HEADERS)
    with opened(path) as pyramid:
        width, height = pyramid.levels[0]
        if role == "result":
            headers["X-Tilewise-Output"] = kind
            window = display_window(path, pyramid, role, kind)
            if window is not None:
                headers["X-Tilewise-Range"] = f"{window[0]:.6g},{window[1]:.6g}"
    return dzi_xml(width, height, _FORMATS[role]), headers


def _tile(
    service: JobsDep, job_id: str, principal: PrincipalDep, role: str, level: str, name: str, channel: int
) -> bytes:
    stem, dot, fmt = name.rpartition(".")
    if not dot or fmt != _FORMATS[role]:
        raise BadParameterError(f"{role} tiles are {_FORMATS[role]}: {{col}}_{{row}}.{_FORMATS[role]}")
    col, sep, row = stem.partition("_")
    if not sep:
        raise BadParameterError(f"a tile is named {{col}}_{{row}}.{fmt}, got {name[:40]!r}")
    path, kind = _file_of(service, job_id, principal, role)
    with opened(path) as pyramid:
        width, height = pyramid.levels[0]
        try:
            box = DeepZoom(width, height).box(level, col, row)
            window = display_window(path, pyramid, role, kind)
            tile = render_tile(pyramid, box, role=role, kind=kind, channel=channel, window=window)
        except LookupError as exc:
            raise HTTPException(404, str(exc)) from exc
    return encode_tile(tile, fmt)


@router.get(
    "/jobs/{job_id}/dzi/{name}",
    responses={200: {"content": {"application/xml": {}}}, **_ERRORS},
)
async def job_dzi(job_id: str, name: str, service: JobsDep, principal: PrincipalDep) -> Response:
    """The Deep Zoom descriptor of the job's input or result (``input.dzi``, ``result.dzi``)."""
    role = _role(name, ".dzi")
    call = functools.partial(_descriptor, service, job_id, principal, role)
    xml, headers = await anyio.to_thread.run_sync(call)
    return Response(xml, media_type="application/xml", headers=headers)


@router.get(
    "/jobs/{job_id}/dzi/{folder}/{level}/{name}",
    responses={200: {"content": {"image/jpeg": {}, "image/png": {}}}, **_ERRORS},
)
async def job_dzi_tile(
    job_id: str,
    folder: str,
    level: str,
    name: str,
    service: JobsDep,
    principal: PrincipalDep,
    channel: ChannelQuery = 0,
) -> Response:
    """One Deep Zoom tile: ``{input|result}_files/{level}/{col}_{row}.{jpeg|png}``."""
    role = _role(folder, "_files")
    call = functools.partial(_tile, service, job_id, principal, role, level, name, channel)
    body = await anyio.to_thread.run_sync(call)
    return Response(body, media_type=_MEDIA[_FORMATS[role]], headers=_HEADERS)
