"""The model repository (built-ins plus one spec file per model) and :class:`Model.run`."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from models.backends import BasePredictor, load_predictor
from models.errors import RegistryError, UnknownModelError
from models.options import InferenceOptions, ResolvedOptions
from models.preprocess import make_reduce, preprocess
from models.receptive import (
    HaloCalibration,
    ReceptiveField,
    calibrate_halo,
    probe_input,
    probe_receptive_field,
)
from models.spec import ModelSpec, load_spec
from models.textdet import TEXT_DET_FILE, TEXT_DET_NAME, text_det_spec

__all__ = ["DEFAULT_MODELS_DIR", "Model", "ModelRepository", "sample_fingerprint"]

logger = logging.getLogger(__name__)

#: Model folder used when settings name none: ``~/.cache/tilewise/models`` (home expanded).
DEFAULT_MODELS_DIR = Path("~/.cache/tilewise/models").expanduser()
_BUILTIN_DIR = Path(__file__).parent / "builtin"
_SPEC_SUFFIXES = (".yaml", ".yml", ".json")
#: Largest probe input per spatial_dims when the receptive field keeps reaching the probe's edge.
_MAX_PROBE = {1: 8192, 2: 1024, 3: 96}
#: Calibrated halos kept per model (one per tile, tolerance and sample fingerprint), LRU.
_HALO_CACHE_SIZE = 64
#: Points per axis of the strided subsample that a sample's fingerprint hashes.
_FINGERPRINT_POINTS = 64


def sample_fingerprint(x: npt.NDArray[Any]) -> str:
    """A cheap fingerprint of a ``(C, *spatial)`` sample: shape, whole sum, strided subsample hash.

    The subsample takes about 64 points per axis; the float64 sum reads every value once, so two
    images that differ anywhere almost surely differ here (cost: one pass, far below a forward).
    """
    steps = [max(1, s // _FINGERPRINT_POINTS) for s in x.shape[1:]]
    sub = np.ascontiguousarray(x[(slice(None), *(slice(None, None, k) for k in steps))], dtype=np.float32)
    digest = hashlib.blake2b(sub.tobytes(), digest_size=8)
    digest.update(repr((x.shape, float(np.sum(x, dtype=np.float64)))).encode())
    return f"{'x'.join(str(s) for s in x.shape)}-{digest.hexdigest()}"


class Model:
    """A loaded model: its spec, its predictor, and tiled inference over whole images.

    Attributes:
        spec: the :class:`ModelSpec`.
        predictor: the backend's :class:`~models.Predictor`.
    """

    #: The calibrated halo must meet ``tolerance * CALIBRATION_SAFETY`` on the sample tiles: the
    #: sample covers a few tile placements, a whole image has seams everywhere.
    CALIBRATION_SAFETY = 0.25
    #: Global-pooling models: images of at most this many tiles' voxels get their pool means from
    #: one whole-image pass (exact and fastest; memory up to this many tiles' worth).
    CONTEXT_WHOLE_FACTOR = 4

    def __init__(self, spec: ModelSpec, predictor: BasePredictor) -> None:
        self.spec = spec
        self.predictor = predictor
        self._lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._probe: ReceptiveField | None = None
        self._halos: OrderedDict[tuple[tuple[int, ...], float, str], HaloCalibration] = OrderedDict()

    def __repr__(self) -> str:
        return f"Model({self.spec.name!r}, backend={self.spec.backend!r}, device={self.predictor.device})"

    @property
    def known_receptive_field(self) -> tuple[int, ...] | None:
        """The radius per axis when known (spec, analytic net or a probe already run), else ``None``.

        Never probes: :meth:`receptive_field` does (once, cached), as :meth:`ModelRepository.warmup`.
        """
        if self.predictor.receptive_field is not None:
            return tuple(int(r) for r in self.predictor.receptive_field)
        with self._lock:
            return None if self._probe is None else self._probe.radius

    def info(self) -> dict[str, Any]:
        """The ``/v1/models`` entry: :meth:`ModelSpec.info` with the measured receptive field."""
        info = self.spec.info()
        radius = self.known_receptive_field
        if radius is not None:
            info["receptive_field"] = list(radius)
        return info

    def receptive_field(self) -> tuple[int, ...]:
        """Theoretical receptive-field radius per axis (voxels): from the spec, else probed once.

        The probe grows its input while the response reaches the probe's edge, up to 1024 voxels
        per axis in 2-D (96 in 3-D); a network with global pooling reports that bound.
        """
        if self.predictor.receptive_field is not None:
            return tuple(self.predictor.receptive_field)
        with self._lock:
            if self._probe is None:
                ndim = self.spec.spatial_dims
                size = {1: 1024, 2: 128, 3: 40}[ndim]
                while True:
                    self._probe = self._probe_once(size)
                    if self._probe.bounded or size >= _MAX_PROBE[ndim]:
                        break
                    size = min(2 * size, _MAX_PROBE[ndim])
                logger.info(
                    "model %s: receptive field %s (bounded %s)",
                    self.spec.name,
                    self._probe.radius,
                    self._probe.bounded,
                )
            return self._probe.radius

    def _probe_once(self, size: int) -> ReceptiveField:
        """Probe each axis with an input long on it (``size``) and narrow on the others.

        A conv stack's reach along one axis does not need width on the others (the straight
        path exists), so a band costs a fraction of a square probe; in 3-D, far less.
        """
        ndim, align = self.spec.spatial_dims, self.spec.alignment
        long = -(-size // align) * align
        narrow = -(-min(size, max(32, 4 * align)) // align) * align
        radius, bounded, seconds = [], True, 0.0
        for axis in range(ndim):
            shape = [long if a == axis else narrow for a in range(ndim)]
            base = probe_input(self.predictor, shape)
            frozen = getattr(self.predictor, "frozen_context", None)
            with frozen(base[0]) if frozen is not None else contextlib.nullcontext():
                view = getattr(self.predictor, "logit_view", None)
                target = view() if view is not None else self.predictor
                result = probe_receptive_field(target, base=base, batch_size=5, quiet=True)
            radius.append(result.radius[axis])
            # the band's own narrow axes always look unbounded; only the long axis counts
            bounded = bounded and result.radius[axis] < min(shape[axis] // 2 - 1, size // 2 - 1)
            seconds += result.seconds
        return ReceptiveField(tuple(radius), (long,) * ndim, bounded, seconds)

    def calibrate(
        self, tile: Sequence[int], tolerance: float, sample: npt.NDArray[np.float32] | None = None
    ) -> HaloCalibration:
        """Calibrated halo for ``tile`` and ``tolerance`` on ``sample``.

        Results are cached per tile, tolerance and sample: the sample (its central crop of about
        ``tile + 2 * radius``, what calibration reads) is identified by :func:`sample_fingerprint`,
        so a new image calibrates anew and the same image reuses its halo. The result's
        ``sample`` names the sample it came from.

        Args:
            tile: tile shape per axis (voxels).
            tolerance: max abs truncation error accepted, after the output activation.
            sample: preprocessed ``(C_in, *spatial)`` data; default a synthetic sample.
        """
        tile_t = tuple(int(t) for t in tile)
        radius = self.receptive_field()
        max_halo = min(max(radius), min(tile_t) // 2 - 1)
        if sample is not None:
            sample = _central_crop(sample, [t + 2 * max_halo for t in tile_t], self.spec.alignment)
            source = f"sample {sample_fingerprint(sample)}"
        else:
            source = "synthetic sample"
        key = (tile_t, float(tolerance), source)
        with self._lock:
            cached = self._halos.get(key)
            if cached is not None:
                self._halos.move_to_end(key)
        if cached is not None:
            logger.debug("model %s: cached halo %d (%s)", self.spec.name, cached.halo, source)
            return cached
        activation = make_reduce(self.spec.activation, "probabilities")
        frozen = getattr(self.predictor, "frozen_context", None)
        with frozen(sample) if (frozen is not None and sample is not None) else contextlib.nullcontext():
            result = calibrate_halo(
                self.predictor,
                tile_t,
                tolerance=tolerance * self.CALIBRATION_SAFETY,
                sample=sample,
                max_halo=max_halo,
                activation=activation,
                n_tiles=2,
            )
        result = dataclasses.replace(result, sample=source)
        with self._lock:
            self._halos[key] = result
            while len(self._halos) > _HALO_CACHE_SIZE:
                self._halos.popitem(last=False)
        logger.info(
            "model %s: tile %s tolerance %g -> calibrated halo %d (error %.3g, from %s)",
            self.spec.name,
            tile_t,
            tolerance,
            result.halo,
            result.error,
            source,
        )
        return result

    def resolve_halo(
        self, halo: tuple[int, ...] | str, tile: tuple[int, ...], tolerance: float, x: npt.NDArray[np.float32]
    ) -> tuple[int, ...]:
        """Per-axis halo: explicit, or ``"auto"``: calibrated on ``x``, capped by the radius."""
        if halo != "auto":
            return tuple(int(h) for h in halo)
        align = self.spec.alignment
        extent = [-(-s // align) * align for s in x.shape[1:]]
        if all(e <= t for e, t in zip(extent, tile, strict=True)):
            return (0,) * len(tile)  # one tile covers the image: no seam to protect
        radius = self.receptive_field()
        # the image itself is the sample, zero-padded (as tiling pads) where smaller than a tile
        grow = [(0, 0)] + [(0, max(0, t - s)) for s, t in zip(x.shape[1:], tile, strict=True)]
        sample = np.pad(x, grow) if any(g[1] for g in grow) else x
        calibrated = self.calibrate(tile, tolerance, sample).halo
        # The halo must leave a stride of at least one alignment step: tile - 2 * halo >= align.
        return tuple(min(calibrated, r, max(0, (t - align) // 2)) for r, t in zip(radius, tile, strict=False))

    def run(
        self,
        data: npt.NDArray[Any],
        options: InferenceOptions | None = None,
        *,
        out: npt.NDArray[Any] | None = None,
        progress: bool = False,
    ) -> npt.NDArray[Any]:
        """Tiled inference over a whole image or volume.

        Args:
            data: ``(C, *spatial)`` array of any numeric dtype with ``len(spatial) ==
                spec.spatial_dims``; the spec's preprocessing (normalization, grey to RGB, ...)
                runs on the whole image first.
            options: tile, halo, overlap, blend, batch size and output kind (``None``: defaults).
            out: optional array to fill: ``(C_out, *spatial)`` float32 for probabilities,
                ``(*spatial)`` uint8 for labels.
            progress: show a progress bar over tiles.

        Returns:
            ``(C_out, *spatial * scale)`` probabilities after the activation (float32, or float16
            when the spec's output dtype says so), or
            ``(*spatial * scale)`` uint8 labels (argmax over channels; ``p > 0.5`` for one channel).

        Raises:
            InputError: wrong number of spatial axes or channels.
            GridError: an invalid tile, halo, overlap, blend or batch size.
            InferenceError: the backend failed (``DeviceOutOfMemoryError`` when out of memory).
        """
        spec = self.spec
        resolved = (options or InferenceOptions()).resolve(spec)
        x = preprocess(data, spec)
        start = time.perf_counter()
        context = getattr(self.predictor, "prepare_context", None) if spec.global_pooling else None
        # Whole-image pool means are state on the predictor: one global-pooling run at a time.
        with self._run_lock if context is not None else contextlib.nullcontext():
            result, halo = self._run(x, resolved, context, target=out, progress=progress)
        logger.info(
            "model %s: %s -> %s in %.2f s (tile %s, halo %s)",
            spec.name,
            tuple(np.shape(data)),
            tuple(result.shape),
            time.perf_counter() - start,
            resolved.tile,
            halo,
        )
        if resolved.output == "labels":
            return out if out is not None else np.asarray(result)[0]
        if out is not None:
            return out
        return np.asarray(result, dtype=np.float16 if spec.output_dtype == "float16" else np.float32)

    def _prepare_context(
        self, context: Any, x: npt.NDArray[np.float32], resolved: ResolvedOptions, halo: tuple[int, ...]
    ) -> None:
        """Whole-image pool means for a global-pooling model, before the tiled pass.

        Pool means average feature maps whose reach is the whole receptive field: a halo
        calibrated for the output truncates them (text-det-2d, halo 188: the neck's pool means
        2 % off, the output 0.43 off). So an image of at most :attr:`CONTEXT_WHOLE_FACTOR` tiles'
        voxels gets one whole-image pass (exact), and a larger one tile-by-tile passes with the
        radius as halo (exact once tile > 2 * radius; else the largest halo the tile allows).
        """
        align = self.spec.alignment
        voxels = int(np.prod([-(-s // align) * align for s in x.shape[1:]]))
        if voxels <= self.CONTEXT_WHOLE_FACTOR * int(np.prod(resolved.tile)):
            context(x, tile=None, halo=None)
            return
        radius = self.receptive_field()
        context_halo = tuple(
            max(h, min(r, t // 2 - 1)) for h, r, t in zip(halo, radius, resolved.tile, strict=False)
        )
        context(x, tile=resolved.tile, halo=context_halo, batch_size=resolved.batch_size)

    def _run(
        self,
        x: npt.NDArray[np.float32],
        resolved: ResolvedOptions,
        context: Any,
        *,
        target: Any,
        progress: bool,
    ) -> tuple[Any, tuple[int, ...]]:
        from tiling import tiled_inference

        spec = self.spec
        halo = self.resolve_halo(resolved.halo, resolved.tile, resolved.halo_tolerance, x)
        reduce = make_reduce(spec.activation, resolved.output)
        if target is not None and resolved.output == "labels":
            target = target[None]
        try:
            if context is not None:
                self._prepare_context(context, x, resolved, halo)
            result = tiled_inference(
                x,
                self.predictor,
                tile_shape=resolved.tile,
                halo=halo,
                overlap=resolved.overlap,
                blend=resolved.blend,
                alignment=spec.alignment,
                scale=spec.scale,
                batch_size=resolved.batch_size,
                device=self.predictor.device,
                out=target,
                reduce=reduce,
                progress=progress,
                # Stopgap (tiling v2): a calibrated halo is an estimate from two sampled tiles, and
                # tiles sized to the grid keep margins close to it; the fixed-shape plan keeps the
                # margins it had (text-det-2d's calibrated halo 61 errs by 0.023 with sized tiles).
                fixed_tile_shape=isinstance(resolved.halo, str),
            )
        finally:
            if context is not None:
                self.predictor.clear_context()  # type: ignore[attr-defined]
        return result, halo


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
        so ``spec(name).info()`` (``/v1/models``) reports it.
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

    def info(self, name: str) -> dict[str, Any]:
        """The ``/v1/models`` entry of ``name`` (receptive field included once known)."""
        return self.spec(name).info()

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
        """
        import torch

        for name in names if names is not None else self.names():
            model = self.get(name)
            spec = model.spec
            size = max(spec.alignment, 8)
            batch = torch.zeros((1, spec.in_channels, *([size] * spec.spatial_dims)))
            model.predictor(batch)
            if probe and model.known_receptive_field is None:
                start = time.perf_counter()
                radius = model.receptive_field()
                logger.info(
                    "model %s: receptive field %s probed in %.1f s", name, radius, time.perf_counter() - start
                )
            logger.info("model %s: warm (%s)", name, model.predictor.describe())


def _central_crop(
    x: npt.NDArray[np.float32], shape: Sequence[int], alignment: int
) -> npt.NDArray[np.float32]:
    """The centre of ``x`` ``(C, *spatial)``, at most ``shape`` (rounded up to ``alignment``)."""
    cut = []
    for s, want in zip(x.shape[1:], shape, strict=False):
        want = -(-want // alignment) * alignment
        if want >= s:
            cut.append(slice(None))
        else:
            lo = (s - want) // 2 // alignment * alignment
            cut.append(slice(lo, lo + want))
    return np.ascontiguousarray(x[(slice(None), *cut)])


def _load(spec: ModelSpec, device: str | None, providers: Sequence[str] | None) -> BasePredictor:
    predictor = load_predictor(spec, device, providers=providers)
    if spec.global_pooling and spec.backend == "onnx":
        from models.backends.ort import OrtPredictor
        from models.global_pool import GlobalPoolingPredictor

        assert isinstance(predictor, OrtPredictor)
        return GlobalPoolingPredictor.wrap(predictor, providers=providers)
    return predictor
