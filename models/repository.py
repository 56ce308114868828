"""The model registry: built-ins plus one spec file per model in a folder; models load lazily."""

from __future__ import annotations

import difflib
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from models.backends import BasePredictor, load_predictor
from models.errors import RegistryError, UnknownModelError
from models.model import Model
from models.spec import ModelSpec, load_spec
from models.textdet import TEXT_DET_FILE, TEXT_DET_NAME, text_det_spec

__all__ = ["DEFAULT_MODELS_DIR", "ModelRepository"]

logger = logging.getLogger(__name__)

#: Model folder used when settings name none: ``~/.cache/tilewise/models`` (home expanded).
DEFAULT_MODELS_DIR = Path("~/.cache/tilewise/models").expanduser()
_BUILTIN_DIR = Path(__file__).parent / "builtin"
_SPEC_SUFFIXES = (".yaml", ".yml", ".json")


class ModelRepository:
    """Built-in models plus one spec file (``.yaml``, ``.yml``, ``.json``) per model in a folder.

    Built-ins: ``gaussian-2d/3d``, ``sobel-2d/3d``, ``log-2d/3d`` always; ``text-det-2d`` when its
    ONNX file is in ``models_dir`` (``tilewise setup-models`` puts it there). Models load lazily
    on :meth:`get` (or all at once with :meth:`warmup`) and are cached.

    Args:
        models_dir: the model folder (default :data:`DEFAULT_MODELS_DIR`); may be missing.
        device: torch device for every model (``None``: CUDA when available, else CPU).
        providers: ONNX Runtime execution providers (default: TensorRT, CUDA, CPU as available).

    Raises:
        SpecError: a spec file is invalid (the message names the file and the field).
        RegistryError: two specs define the same model name.
    """

    def __init__(
        self,
        models_dir: Path | str | None = None,
        device: str | None = None,
        *,
        providers: Sequence[str] | None = None,
    ) -> None:
        self.models_dir = Path(models_dir if models_dir is not None else DEFAULT_MODELS_DIR).expanduser()
        self.device = device
        self.providers = providers
        self._specs: dict[str, ModelSpec] = {}
        self._models: dict[str, Model] = {}
        self._lock = threading.Lock()
        for path in sorted(_BUILTIN_DIR.glob("*.yaml")):
            self.add(load_spec(path))
        if self.models_dir.is_dir():
            for path in sorted(p for p in self.models_dir.iterdir() if p.suffix in _SPEC_SUFFIXES):
                self.add(load_spec(path))
        if TEXT_DET_NAME not in self._specs and (self.models_dir / TEXT_DET_FILE).is_file():
            self.add(text_det_spec(self.models_dir))
        logger.info("model repository %s: %s", self.models_dir, ", ".join(self.names()))

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
        """Registered model names, sorted."""
        return sorted(self._specs)

    def specs(self) -> list[ModelSpec]:
        """Registered specs, sorted by name (with measured receptive fields, see :meth:`spec`)."""
        return [self.spec(n) for n in self.names()]

    def spec(self, name: str) -> ModelSpec:
        """The spec of ``name`` without loading the model (raises :class:`UnknownModelError`).

        When the spec gives no ``receptive_field`` but the loaded model knows it (probed by
        :meth:`warmup` or by a ``halo="auto"`` run), the copy returned carries the measured radius,
        so ``spec(name).info()`` (``/v1/models``, the one serializer) reports it.
        """
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
                return spec.with_receptive_field(radius)
        return spec

    def get(self, name: str) -> Model:
        """The loaded model ``name`` (loaded on first use, then cached).

        Raises:
            UnknownModelError: not registered; the message suggests close matches.
            WeightsError, BackendError: the model cannot be loaded.
        """
        spec = self._specs[name] if name in self._specs else self.spec(name)
        with self._lock:
            model = self._models.get(name)
            if model is None:
                model = Model(spec, _load(spec, self.device, self.providers))
                self._models[name] = model
        return model

    def warmup(self, names: Sequence[str] | None = None, *, probe: bool = True) -> None:
        """Load ``names`` (default all) and run one small forward pass each.

        With ``probe`` (default), a model whose receptive field is unknown (no ``receptive_field``
        in its spec, not analytic) is probed now, once: ``halo="auto"`` needs the radius, and
        :meth:`spec` / ``/v1/models`` then report it (text-det-2d: about 5 s on two CPU cores).
        Each model's :meth:`~models.Model.footprint` (memory and time per voxel, for plans, the
        request budget and dry runs) is measured too, before any request runs beside it.
        """
        import torch

        for name in names if names is not None else self.names():
            model = self.get(name)
            spec = model.spec
            size = max(spec.alignment, 8)
            batch = torch.zeros((1, spec.in_channels, *([size] * spec.spatial_dims)))
            model.predictor(batch)
            if probe:
                model.footprint()
            if probe and model.known_receptive_field is None:
                start = time.perf_counter()
                radius = model.receptive_field()
                logger.info(
                    "model %s: receptive field %s probed in %.1f s", name, radius, time.perf_counter() - start
                )
            logger.info("model %s: warm (%s)", name, model.predictor.describe())


def _load(spec: ModelSpec, device: str | None, providers: Sequence[str] | None) -> BasePredictor:
    predictor = load_predictor(spec, device, providers=providers)
    if spec.global_pooling and spec.backend == "onnx":
        from models.backends.ort import OrtPredictor
        from models.global_pool import GlobalPoolingPredictor

        assert isinstance(predictor, OrtPredictor)
        return GlobalPoolingPredictor.wrap(predictor, providers=providers)
    return predictor
