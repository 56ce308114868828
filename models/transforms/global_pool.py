"""Whole-image statistics for ONNX networks with global average pooling (squeeze-excitation).

A ``GlobalAveragePool`` makes every output depend on the whole input, so no halo reproduces the
whole-image result: a tile pools over itself. But the pooled values are plain means of feature
maps, and the sub-network that produces each feature map is local once the pools upstream of it
are known. So the graph is rewritten:

- the *final* graph takes every pool's output as an extra input (the pool nodes are removed);
- the *stage* ``k`` graph outputs the feature maps that the pools of depth ``k`` average, taking
  the pools of depth ``< k`` as inputs.

:meth:`GlobalPoolingPredictor.prepare_context` computes the means stage by stage with the same
tiles and halo as the main pass (cores partition the image, so every feature voxel is summed
once), then every tile runs the final graph with those means: tiled output equals whole-image
output up to the halo's truncation error.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from models.backends.ort import OrtPredictor, translate_ort_errors
from models.errors import BackendUnavailableError, WeightsError

__all__ = ["GlobalPoolingPredictor"]

logger = logging.getLogger(__name__)

Array = npt.NDArray[np.float32]


def _pool_stages(graph: Any) -> list[list[Any]]:
    """Global pool nodes grouped by depth (number of pools upstream on the longest path)."""
    producer = {out: node for node in graph.node for out in node.output}
    depth: dict[str, int] = {}

    def pools_above(tensor: str, seen: set[str]) -> int:
        node = producer.get(tensor)
        if node is None or tensor in seen:
            return -1
        seen.add(tensor)
        if node.op_type == "GlobalAveragePool":
            return max(depth_of(node), -1)
        return max((pools_above(t, seen) for t in node.input), default=-1)

    def depth_of(node: Any) -> int:
        key = node.output[0]
        if key not in depth:
            depth[key] = 1 + max((pools_above(t, set()) for t in node.input), default=-1)
        return depth[key]

    pools = [n for n in graph.node if n.op_type == "GlobalAveragePool"]
    stages: dict[int, list[Any]] = {}
    for node in pools:
        stages.setdefault(depth_of(node), []).append(node)
    return [stages[k] for k in sorted(stages)]


def _subgraph(model: Any, outputs: Sequence[str], pool_inputs: Sequence[Any]) -> bytes:
    """The model cut to ``outputs``, with the given pool nodes' outputs turned into inputs."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    fed = {n.output[0] for n in pool_inputs}
    producer = {out: node for node in g.node for out in node.output if out not in fed}
    needed: set[int] = set()
    stack = list(outputs)
    seen: set[str] = set()
    index = {id(n): i for i, n in enumerate(g.node)}
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        node = producer.get(tensor)
        if node is None:
            continue
        needed.add(index[id(node)])
        stack.extend(node.input)
    keep = [n for i, n in enumerate(g.node) if i in needed]
    del g.node[:]
    g.node.extend(keep)
    used = {t for n in keep for t in n.input}
    inits = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(inits)
    del g.output[:]
    for name in outputs:
        g.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    for name in sorted(fed & (used | set(outputs))):
        g.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    data: bytes = m.SerializeToString()
    return data


class GlobalPoolingPredictor(OrtPredictor):
    """An ONNX predictor whose global pools read whole-image means set by :meth:`prepare_context`.

    Without a context it runs the original graph (each tile pools over itself).
    """

    _stage_sessions: list[tuple[Any, list[str], list[str]]]
    _means_session: Any
    plain: OrtPredictor
    pool_names: list[str]
    logits_name: str | None
    context: dict[str, Array] | None

    @classmethod
    def wrap(cls, plain: OrtPredictor, *, providers: Sequence[str] | None = None) -> OrtPredictor:
        """Rewrite ``plain``'s graph; returns ``plain`` unchanged when it has no global pools."""
        try:
            import onnx
        except ImportError as exc:
            raise BackendUnavailableError(
                f"model {plain.name!r}: global pooling needs the onnx package (tilewise[export])"
            ) from exc
        assert plain.spec.file is not None
        try:
            model = onnx.load(str(plain.spec.file))
        except Exception as exc:  # onnx raises DecodeError and others
            raise WeightsError(f"model {plain.name!r}: cannot parse {plain.spec.file}: {exc}") from exc
        stages = _pool_stages(model.graph)
        if not stages:
            return plain
        pools = [n for stage in stages for n in stage]
        outputs = [o.name for o in model.graph.output][:1]
        last = next((n for n in model.graph.node if outputs[0] in n.output), None)
        if last is not None and last.op_type in ("Sigmoid", "Softmax"):
            outputs.append(last.input[0])  # pre-activation, for the receptive-field probe
        final = _subgraph(model, outputs, pools)
        self = cls(plain.spec, plain.device, providers=providers, model_bytes=final)
        self.plain = plain
        self.pool_names = [n.output[0] for n in pools]
        self._stage_sessions = []
        for k, stage in enumerate(stages):
            upstream = [n for s in stages[:k] for n in s]
            features = [n.input[0] for n in stage]
            graph = _subgraph(model, features, upstream)
            session = OrtPredictor(plain.spec, plain.device, providers=providers, model_bytes=graph).session
            self._stage_sessions.append((session, features, [n.output[0] for n in stage]))
        # One pass of the original graph with every pool's output exposed: the exact means when
        # a single tile covers the image (calibration samples, frozen contexts), in ~1/3 the time
        # of the stage-by-stage passes.
        whole = onnx.ModelProto()
        whole.CopyFrom(model)
        for name in (n.output[0] for n in pools):
            whole.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
        self._means_session = OrtPredictor(
            plain.spec, plain.device, providers=providers, model_bytes=whole.SerializeToString()
        ).session
        self.context = None
        self.logits_name = outputs[1] if len(outputs) > 1 else None
        logger.info(
            "model %s: %d global pools in %d stages read whole-image means",
            self.name,
            len(pools),
            len(stages),
        )
        return self

    def _forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.context is None:
            out: torch.Tensor = self.plain._forward(batch)
            return out
        return super()._forward(batch)

    @staticmethod
    def _read(tile: Any, grid: Any) -> tuple[slice, ...]:
        return tuple(slice(s, s + t) for s, t in zip(tile.starts, grid.used_tile_shape, strict=True))

    def logit_view(self) -> Any:
        """A predictor returning the pre-activation output (same metadata), or ``self``.

        Saturated sigmoid outputs hide far, small dependencies from the impulse probe; their
        logits do not.
        """
        if self.logits_name is None or self.context is None:
            return self
        return _LogitView(self)

    def clear_context(self) -> None:
        """Forget the whole-image means (tiles pool over themselves again)."""
        self.context = None
        self.extra_feeds = {}

    @contextlib.contextmanager
    def frozen_context(self, x: Array) -> Iterator[None]:
        """Within the block, pools read the means of ``x`` (``(C, *spatial)``, one whole pass)."""
        self.prepare_context(x, tile=None, halo=None)
        try:
            yield
        finally:
            self.clear_context()

    def prepare_context(
        self,
        x: Array,
        *,
        tile: Sequence[int] | None,
        halo: Sequence[int] | None,
        batch_size: int = 1,
    ) -> dict[str, Array]:
        """Compute every pool's whole-image mean of ``x``, tile by tile, stage by stage.

        Args:
            x: preprocessed ``(C_in, *spatial)`` float32 image; it is zero-padded to a multiple of
                the alignment, as the tiling engine and a whole-image pass do.
            tile: tile shape (voxels); ``None``: one pass over the whole image.
            halo: halo per axis (voxels) used for the stage passes.
            batch_size: tiles per stage-graph call.

        Returns:
            Pool output name -> ``(1, C, 1, ...)`` mean, also used by later calls.
        """
        from tiling import TileGrid

        start = time.perf_counter()
        align = self.alignment
        spatial = x.shape[1:]
        extent = tuple(-(-s // align) * align for s in spatial)
        padded = np.zeros((x.shape[0], *extent), dtype=np.float32)
        padded[(slice(None), *(slice(0, s) for s in spatial))] = x
        tile_shape = (
            tuple(extent) if tile is None else tuple(min(t, e) for t, e in zip(tile, extent, strict=False))
        )
        grid = TileGrid.plan(extent, tile_shape, tuple(halo or (0,) * len(extent)), alignment=align)
        tiles = list(grid.tiles())
        feeds: dict[str, Array] = {}
        if len(tiles) == 1:  # one tile is the whole (padded) image: its own pools are the means
            with translate_ort_errors(self.name, "compute the pool means"):
                means = self._means_session.run(self.pool_names, {self.input_name: padded[None]})
            feeds = {n: np.asarray(m, dtype=np.float32) for n, m in zip(self.pool_names, means, strict=True)}
        for session, features, pooled in self._stage_sessions if len(tiles) > 1 else ():
            wanted = {i.name for i in session.get_inputs()}
            sums: dict[int, npt.NDArray[np.float64]] = {}
            counts: dict[int, int] = {}
            for b in range(0, len(tiles), batch_size):
                chunk = tiles[b : b + batch_size]
                batch = np.stack([padded[(slice(None), *self._read(tl, grid))] for tl in chunk])
                stage_feeds = {k: v for k, v in feeds.items() if k in wanted}
                with translate_ort_errors(self.name, "compute a pooling stage"):
                    maps = session.run(features, {self.input_name: batch, **stage_feeds})
                for j, fmap in enumerate(maps):
                    # feature stride per axis: tile voxels per feature voxel
                    strides = [t // m for t, m in zip(grid.used_tile_shape, fmap.shape[2:], strict=True)]
                    counts[j] = int(np.prod([e // s for e, s in zip(extent, strides, strict=True)]))
                    for k, tl in enumerate(chunk):
                        cut = tuple(
                            slice(c.start // s, c.stop // s) for c, s in zip(tl.crop, strides, strict=True)
                        )
                        axes = tuple(range(1, fmap.ndim - 1))
                        part = fmap[(k, slice(None), *cut)].sum(axis=axes, dtype=np.float64)
                        sums[j] = part if j not in sums else sums[j] + part
            for j, name in enumerate(pooled):
                mean = (sums[j] / counts[j]).astype(np.float32)
                feeds[name] = mean.reshape(1, -1, *([1] * len(extent)))
        self.context = feeds
        self.set_extra_feeds(feeds)
        logger.info(
            "model %s: whole-image pool means from %s in %.2f s",
            self.name,
            "one whole-image pass"
            if len(tiles) == 1
            else f"{len(tiles)} tiles x {len(self._stage_sessions)} stages",
            time.perf_counter() - start,
        )
        return feeds


class _LogitView:
    """Calls the final graph for its pre-activation output (needs a context)."""

    def __init__(self, owner: GlobalPoolingPredictor) -> None:
        self.owner = owner
        for key in ("spatial_dims", "in_channels", "out_channels", "alignment", "scale", "device"):
            setattr(self, key, getattr(owner, key))

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        feeds = {self.owner.input_name: batch.detach().cpu().float().numpy(), **self.owner.extra_feeds}
        with translate_ort_errors(self.owner.name, "run a batch for its logits"):
            out = self.owner.session.run([self.owner.logits_name], feeds)[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32))
