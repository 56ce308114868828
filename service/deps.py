"""``Annotated`` dependencies of the routes: what a handler needs, taken from the app state.

The lifespan (:mod:`service.app`) puts the settings, metrics, model repository and executor on
``app.state``; handlers declare ``settings: SettingsDep`` and so on instead of reaching into the
request. :data:`ParamsDep` validates the query into :class:`~models.planning.params.InferenceParams`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from service.errors import NotReadyError
from service.executor import DeviceExecutor
from service.metrics import Metrics
from service.settings import Settings

__all__ = [
    "ExecutorDep",
    "MetricsDep",
    "ReadyRepositoryDep",
    "RepositoryDep",
    "SettingsDep",
]


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


def _repository(request: Request) -> Any:
    return getattr(request.app.state, "repository", None)


def _ready_repository(request: Request) -> Any:
    """The model repository, once the models are loaded (else 503 ``not_ready``)."""
    if not getattr(request.app.state, "ready", False):
        raise NotReadyError("models are not loaded (starting or shutting down)")
    return request.app.state.repository


def _executor(request: Request) -> DeviceExecutor:
    executor: DeviceExecutor = request.app.state.executor
    return executor


SettingsDep = Annotated[Settings, Depends(_settings)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
RepositoryDep = Annotated[Any, Depends(_repository)]
ReadyRepositoryDep = Annotated[Any, Depends(_ready_repository)]
ExecutorDep = Annotated[DeviceExecutor, Depends(_executor)]
