"""The model registry: built-ins plus one spec file per model in a folder; models load lazily.

One bad model never breaks the others: a spec file that fails to validate, a model that fails to
load, or one whose warm-up forward pass contradicts its spec (:mod:`models.measure.warmup`) is listed as
*unavailable* with a one-line reason naming the file and the field; its requests raise
:class:`~models.errors.ModelUnavailableError` (HTTP 503 ``model_unavailable``). ``strict=True``
(``TILEWISE_STRICT_MODELS``) makes any such failure raise instead.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from models.backends import BasePredictor, load_predictor
from models.errors import ModelError, ModelUnavailableError, RegistryError, UnknownModelError
from models.measure.measured import MeasurementStore
from models.measure.warmup import check_forward, reason
from models.model import Model
from models.names import SPEC_SUFFIXES, declared_name
from models.spec import ModelSpec, load_spec
from models.zoo.textdet import TEXT_DET_FILE, TEXT_DET_NAME, text_det_spec

__all__ = ["DEFAULT_MODELS_DIR", "ModelRepository"]

logger = logging.getLogger(__name__)

#: Model folder used when settings name none: ``~/.cache/tilewise/models`` (home expanded).
DEFAULT_MODELS_DIR = Path("~/.cache/tilewise/models").expanduser()
_BUILTIN_DIR = Path(__file__).parent / "builtin"


class ModelRepository:
    """Built-in models plus one spec file (``.yaml``, ``.yml``, ``.json``) per model in a folder.

    Built-ins: ``gaussian-2d/3d``, ``sobel-2d/3d``, ``log-2d/3d`` always; ``text-det-2d`` when its
    ONNX file is in ``models_dir`` (``tilewise setup-models`` puts it there). A spec in
    ``models_dir`` with a built-in's name replaces the built-in. Models load lazily on :meth:`get`
    (or all at once with :meth:`warmup`) and are cached.

    Args:
        models_dir: the model folder (default :data:`DEFAULT_MODELS_DIR`); may be missing.
        device: torch device for every model (``None``: CUDA when available, else CPU).
        providers: ONNX Runtime execution providers (default: TensorRT, CUDA, CPU as available).
        strict: raise on the first model that fails (else list it as unavailable).
        user_models_dir: the folder ``tilewise setup-models`` fills (default
            ``TILEWISE_USER_MODELS_DIR``, else :data:`DEFAULT_MODELS_DIR`): when ``models_dir`` is
            another folder, its models are added too (``models_dir`` wins a name); ``False``: not.
        measurements_dir: where warm-up measurements of built-in models (and of a read-only
            ``models_dir``) are kept (:mod:`models.measure.measured`; default ``TILEWISE_MEASUREMENTS_DIR``,
            else :data:`~models.measure.measured.DEFAULT_MEASUREMENTS_DIR`); ``False``: none are read or kept.

    Raises:
        SpecError, RegistryError: with ``strict``, an invalid spec file or a name defined twice in
            ``models_dir`` (the message names the files and the field).
    """

    def __init__(
        self,
        models_dir: Path | str | None = None,
        device: str | None = None,
        *,
        providers: Sequence[str] | None = None,
        strict: bool = False,
        measurements_dir: Path | str | bool | None = None,
        user_models_dir: Path | str | bool | None = None,
    ) -> None:
        self.models_dir = Path(models_dir if models_dir is not None else DEFAULT_MODELS_DIR).expanduser()
        if user_models_dir is None:
            user_models_dir = os.environ.get("TILEWISE_USER_MODELS_DIR") or DEFAULT_MODELS_DIR
        user = None if user_models_dir is False else Path(str(user_models_dir)).expanduser()
        if measurements_dir is None:
            measurements_dir = os.environ.get("TILEWISE_MEASUREMENTS_DIR") or None
        self.measurements = (
            None
            if measurements_dir is False
            else MeasurementStore(
                self.models_dir,
                None if measurements_dir is True else measurements_dir,
                also_beside=() if user is None else (user,),
            )
        )
        self._warm: set[str] = set()
        self.device = device
        self.providers = providers
        self.strict = strict
        self._specs: dict[str, ModelSpec] = {}
        self._unavailable: dict[str, str] = {}
        self._models: dict[str, Model] = {}
        self._lock = threading.Lock()
        for path in sorted(_BUILTIN_DIR.glob("*.yaml")):
            self.add(load_spec(path))
        builtins = set(self._specs)
        own: dict[str, Path] = {}
        if self.models_dir.is_dir():
            for path in sorted(p for p in self.models_dir.iterdir() if p.suffix in SPEC_SUFFIXES):
                self._add_file(path, own, builtins)
        if TEXT_DET_NAME not in self._specs and (self.models_dir / TEXT_DET_FILE).is_file():
            self.add(text_det_spec(self.models_dir))
        if user is not None and user.is_dir() and user.resolve() != self.models_dir.resolve():
            self._add_user_models(user, set(own) | set(self._specs) | set(self._unavailable))
        ready = [n for n in self.names() if n not in self._unavailable]
        logger.info("model repository %s: %s", self.models_dir, ", ".join(ready))
        for name, why in sorted(self._unavailable.items()):
            logger.error("model %s is unavailable: %s", name, why)

    def _add_user_models(self, user: Path, taken: set[str]) -> None:
        """Add the models of the user's folder (``tilewise setup-models``: brain-mask-3d,
        text-det-2d) whose names ``models_dir`` and the built-ins do not take."""
        own: dict[str, Path] = {}
        for path in sorted(p for p in user.iterdir() if p.suffix in SPEC_SUFFIXES):
            if declared_name(path) not in taken:
                self._add_file(path, own, set())
        free = TEXT_DET_NAME not in self._specs and TEXT_DET_NAME not in taken
        if free and (user / TEXT_DET_FILE).is_file():
            self.add(text_det_spec(user))
        if own:
            logger.info("model repository: %s from %s", ", ".join(sorted(own)), user)

    def _add_file(self, path: Path, own: dict[str, Path], builtins: set[str]) -> None:
        """Register one spec file of ``models_dir`` (or list its name as unavailable)."""
        name = declared_name(path)
        if name in own:
            error: ModelError = RegistryError(f"model {name!r} is defined twice: {own[name]} and {path}")
            self._fail(name, None, error)
            return
        own[name] = path
        try:
            spec = load_spec(path)
        except ModelError as exc:
            self._specs.pop(name, None)  # a broken spec with a built-in's name replaces it too
            self._fail(name, None, exc)
            return
        if spec.name in builtins:
            logger.info("model %s: %s replaces the built-in", spec.name, path)
            self._specs.pop(spec.name)
            builtins.discard(spec.name)
        self.add(spec)

    def _fail(self, name: str, spec: ModelSpec | None, exc: BaseException) -> None:
        """List ``name`` as unavailable (or raise, when strict)."""
        if self.strict:
            raise exc
        with self._lock:
            self._unavailable[name] = reason(spec, exc)
            self._models.pop(name, None)

    def add(self, spec: ModelSpec) -> None:
        """Register a spec.

        Raises:
            RegistryError: the name is taken (both sources are named).
        """
        if spec.name in self._specs:
            raise RegistryError(
                f"model {spec.name!r} is defined twice: {self._specs[spec.name].source} and {spec.source}"
            )
        self._specs[spec.name] = spec

    def names(self) -> list[str]:
        """Model names, sorted: the ready and the unavailable ones."""
        return sorted(set(self._specs) | set(self._unavailable))

    def unavailable(self) -> dict[str, str]:
        """Unavailable model names and the reason of each."""
        with self._lock:
            return dict(self._unavailable)

    def specs(self) -> list[ModelSpec]:
        """Specs of the available models, sorted by name (measured receptive fields: :meth:`spec`)."""
        gone = self.unavailable()
        return [self.spec(n) for n in sorted(self._specs) if n not in gone]

    def info(self, name: str) -> dict[str, Any]:
        """The ``GET /v1/models`` entry of ``name``: its spec with ``status`` ``ready``, or
        ``{"name", "status": "unavailable", "reason"}``.

        Raises:
            UnknownModelError: not registered; the message suggests close matches.
        """
        why = self.unavailable().get(name)
        if why is not None:
            return {"name": name, "status": "unavailable", "reason": why}
        return {**self.spec(name).info(), "status": "ready"}

    def infos(self) -> list[dict[str, Any]]:
        """Every model's :meth:`info`, sorted by name."""
        return [self.info(n) for n in self.names()]

    def spec(self, name: str) -> ModelSpec:
        """The spec of ``name`` without loading the model.

        When the spec gives no ``receptive_field`` (or no ``tile_dependent``) but the loaded model
        knows it (probed by :meth:`warmup` or by a ``halo="auto"`` run), the copy returned carries
        the measured value, so ``spec(name).info()`` (``/v1/models``, the one serializer) reports it.

        Raises:
            UnknownModelError: not registered; the message suggests close matches.
            ModelUnavailableError: listed as unavailable (the message gives the reason).
        """
        why = self.unavailable().get(name)
        if why is not None:
            raise ModelUnavailableError(f"model {name!r} is unavailable: {why}")
        if name not in self._specs:
            close = difflib.get_close_matches(name, self.names(), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise UnknownModelError(f"unknown model {name!r}{hint} (known: {', '.join(self.names())})")
        spec = self._specs[name]
        with self._lock:
            model = self._models.get(name)
        if model is not None:
            radius = model.known_receptive_field
            if radius is not None and radius != spec.receptive_field:
                spec = spec.with_receptive_field(radius)
            dependent = model.known_tile_dependent
            if spec.tile_dependent is None and dependent is not None:
                spec = spec.model_copy(update={"tile_dependent": dependent})
        return spec

    def get(self, name: str) -> Model:
        """The loaded model ``name`` (loaded on first use, then cached).

        Raises:
            UnknownModelError: not registered; the message suggests close matches.
            ModelUnavailableError: listed as unavailable.
            SpecError, WeightsError, BackendError: the loading fails now (the model is then listed
                as unavailable with the reason, unless ``strict``).
        """
        spec = self._specs[name] if name in self._specs and name not in self._unavailable else self.spec(name)
        with self._lock:
            model = self._models.get(name)
        if model is not None:
            return model
        try:
            loaded = Model(spec, _load(spec, self.device, self.providers))
        except ModelError as exc:
            self._fail(name, spec, exc)
            raise
        if self.measurements is not None:
            self.measurements.restore(loaded)
        with self._lock:
            return self._models.setdefault(name, loaded)

    def warming(self) -> list[str]:
        """Available models not warmed up yet (by :meth:`warmup`), sorted."""
        gone = self.unavailable()
        with self._lock:
            return sorted(n for n in self._specs if n not in gone and n not in self._warm)

    def store_measurements(self, name: str) -> None:
        """Keep what the loaded model ``name`` measured (:mod:`models.measure.measured`); no-op when it is
        not loaded or the repository keeps no measurements."""
        with self._lock:
            model = self._models.get(name)
        if model is not None and self.measurements is not None:
            self.measurements.store(model)

    def warmup(
        self,
        names: Sequence[str] | None = None,
        *,
        probe: bool = True,
        progress: Callable[[str, int, int], object] | None = None,
    ) -> None:
        """Load ``names`` (default all available) and check one small forward pass each.

        The pass checks the spec's ``out_channels``, ``alignment`` and ``scale``
        (:func:`models.measure.warmup.check_forward`); a model that fails to load or to pass is listed as
        unavailable (with ``strict``, the error is raised). With ``probe`` (default), a model whose
        spec does not say ``tile_dependent`` is probed for it now, once
        (:meth:`Model.is_tile_dependent`: two or three passes over one default tile), and a local
        model whose receptive field is unknown (no ``receptive_field`` in its spec, not analytic) is
        probed for its radius: ``halo="auto"`` needs both, so no request pays for them, and
        :meth:`spec` / ``/v1/models`` then report them (text-det-2d's radius: about 5 s on two CPU
        cores). A tile-dependent model needs no radius (``halo="auto"`` does not search). Each
        model's :meth:`~models.Model.footprint` (memory and time per voxel, for plans, the request
        budget and dry runs) is measured too, before any request runs beside it.

        Measurements stored by an earlier warm-up (same spec, weights, device, tilewise version;
        :mod:`models.measure.measured`) are read instead of measured again, and new ones are stored: a
        restart is ready in seconds. ``progress(name, i, n)`` is called before each model
        (``i`` from 1; the log says "warming up NAME (i/n)" too).
        """
        gone = self.unavailable()
        todo = list(names if names is not None else [n for n in self.names() if n not in gone])
        for i, name in enumerate(todo, 1):
            spec = self._specs.get(name)
            logger.info("warming up %s (%d/%d)", name, i, len(todo))
            if progress is not None:
                progress(name, i, len(todo))
            before = 0
            try:
                model = self.get(name)
                spec = model.spec
                before = model.measurements().count()
                check_forward(spec, model.predictor)
                if probe:
                    model.footprint()
                if probe and model.known_tile_dependent is None:
                    start = time.perf_counter()
                    dependent = model.is_tile_dependent()
                    seconds = time.perf_counter() - start
                    logger.info("model %s: tile-dependent %s, probed in %.1f s", name, dependent, seconds)
                if probe and model.known_receptive_field is None and not model.known_tile_dependent:
                    start = time.perf_counter()
                    radius = model.receptive_field()
                    seconds = time.perf_counter() - start
                    logger.info("model %s: receptive field %s probed in %.1f s", name, radius, seconds)
            except ModelUnavailableError:
                continue  # listed already
            except ModelError as exc:
                self._fail(name, spec, exc)
                logger.error("model %s is unavailable: %s", name, self._unavailable[name])
                continue
            if self.measurements is not None and model.measurements().count() > before:
                self.measurements.store(model)
            with self._lock:
                self._warm.add(name)
            logger.info("model %s: warm (%s)", name, model.predictor.describe())


def _load(spec: ModelSpec, device: str | None, providers: Sequence[str] | None) -> BasePredictor:
    predictor = load_predictor(spec, device, providers=providers)
    if spec.global_pooling and spec.backend == "onnx":
        from models.backends.ort import OrtPredictor
        from models.transforms.global_pool import GlobalPoolingPredictor

        assert isinstance(predictor, OrtPredictor)
        return GlobalPoolingPredictor.wrap(predictor, providers=providers)
    return predictor
