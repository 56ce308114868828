"""Admission: the one sequence that lets a request in, for every way a request arrives.

``POST /v1/models/{name}/infer``, ``POST /v1/jobs`` (and so the batch client's server side) and
``tilewise infer`` admit a request with the same two calls, so that one input and one model get
one answer whichever way they came (issue 20, the first stage of a request):

1. :func:`check_request` (before the body is read): parameters that no file can satisfy for this
   model, e.g. ``format=png`` for a 3D model (400 ``bad_parameter``).
2. :func:`admit` (once the file is on disk): the model loaded (a model that fails to load now is
   unavailable from here on: 503 ``model_unavailable``, on every route alike), the file's header
   checked against the limits and the model, and the plan made on the header's shape checked
   against the budget (:func:`service.precheck.precheck`).

What admission answers is an :class:`Admitted`: the loaded model and the header, handed to the
run, which probes nothing again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from service.errors import BadParameterError
from service.precheck import Limits, precheck

if TYPE_CHECKING:
    from models import InferenceParams, Model
    from service.codecs import Probe

__all__ = ["Admitted", "admit", "check_request", "load_model"]


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request let in: its loaded model, the file's checked header and its parameters."""

    model: Model
    header: Probe
    params: InferenceParams


class _Repository(Protocol):
    """What :func:`load_model` asks of a repository (:class:`models.ModelRepository`; its
    ``unavailable()`` is asked for when it has one)."""

    def get(self, name: str) -> Model: ...


def load_model(repository: _Repository, name: str) -> Model:
    """``repository.get(name)``; a model that fails to load now is unavailable (503) from here on.

    Raises:
        ModelUnavailableError: the model cannot be loaded (503 ``model_unavailable``, with the
            reason the repository recorded).
        ModelError: another model error (e.g. an unknown name: 404).
    """
    from models.errors import ModelError, ModelUnavailableError

    try:
        return repository.get(name)
    except ModelError as exc:
        if isinstance(exc, ModelUnavailableError) or not hasattr(repository, "unavailable"):
            raise
        why = repository.unavailable().get(name, str(exc))
        raise ModelUnavailableError(f"model {name!r} is unavailable: {why}") from exc


def check_request(spec: Any, params: InferenceParams) -> None:
    """Refuse parameters that no input can satisfy for the model of ``spec`` (before the upload).

    Raises:
        BadParameterError: ``format=png`` (asked, or the spec's default) for a model whose output
            is not 2D; an ``output_dtype`` the format cannot store.
    """
    from service.writers import check_output_dtype

    defaults = getattr(spec, "defaults", None)  # a stand-in repository's spec may have none
    fmt = params.format or (defaults.format if defaults is not None else None)
    if fmt is not None:
        check_output_dtype(str(fmt), params, spec)
    if fmt is not None and str(fmt) == "png" and int(spec.spatial_dims) != 2:
        raise BadParameterError(
            f"format=png needs a 2D output; model {spec.name!r} is 3D (use nii.gz or tiff)"
        )


def admit(repository: Any, name: str, source: Path, params: InferenceParams, limits: Limits) -> Admitted:
    """Let the request for model ``name`` on the file ``source`` in, or refuse it (see the module
    docstring); runs in a worker thread (it may load the model and reads the file's header).

    Raises:
        ModelUnavailableError: the model fails to load (503).
        BadParameterError: see :func:`check_request` (400).
        PayloadTooLargeError, UnusableInputError, EmptyBodyError, UnsupportedMediaTypeError,
        DecodeError, OverBudgetError, MemoryBudgetError, ParamError, GridError: see
            :func:`service.precheck.precheck`.
    """
    model = load_model(repository, name)
    check_request(model.spec, params)
    header = precheck(model, source, params, limits)
    return Admitted(model, header, params)
