"""Execution plumbing: batch buffers, a prefetch thread, and host/device transfers.

- :class:`TileReader` reads the tiles of a grid, in grid order, straight into reusable
  ``(batch_size, C, *tile)`` float32 buffers (one copy per voxel, see :func:`tiling.io.read_into`);
  on CUDA the host buffers are pinned once, when allocated. With ``prefetch`` a background thread
  reads and pads the next batch while the network runs on the current one; the buffers go round a
  small pool, and a buffer is overwritten only after its batch was released (and, on CUDA, after
  its host-to-device copy finished).
- :class:`Transfers` moves a batch to the predictor's device (``non_blocking`` from pinned memory,
  with an event that frees the host buffer when the copy is done) and its prediction back to where
  the output is merged: on CUDA into pinned host buffers with ``non_blocking`` copies and an event,
  so the engine merges batch ``i`` only after batch ``i + 1`` was launched (:attr:`Transfers.lag`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tiling.geometry import PaddingMode
from tiling.grid import Tile, TileGrid
from tiling.io import read_into
from tiling.reuse import TileReuse, read_box

logger = logging.getLogger(__name__)

__all__ = ["Batch", "Staged", "TileReader", "Transfers"]


def _cuda_ready(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


@dataclass
class Batch:
    """Up to ``batch_size`` consecutive tiles of a grid, read into one buffer slot.

    Attributes:
        tiles: the tiles, in grid order.
        data: ``(len(tiles), C, *tile)`` float32 view of the slot's buffer.
        slot: index of the buffer in the reader's pool.
        released: whether the slot went back to the pool.
        filled: per tile, whether it was fed as a skip rule's fill values instead of being read.
    """

    tiles: list[Tile]
    data: torch.Tensor
    slot: int
    released: bool = False
    filled: list[bool] = field(default_factory=list)


@dataclass
class _Done:
    error: BaseException


class TileReader:
    """Iterate over a grid's tiles as batches read into reusable (pinned) buffers.

    Args:
        source: ``(C, *spatial)`` numpy array, memmap, torch tensor or array-like.
        grid: the plan; tiles are read in its C order.
        pad_mode: padding beyond the image (see :class:`~tiling.geometry.PaddingMode`).
        batch_size: tiles per batch.
        pin: allocate the buffers in page-locked memory (for non-blocking copies to CUDA).
        prefetch: read the next batch in a background thread while the current one is used.
        first: index (C order) of the first tile read; batches hold ``batch_size`` tiles from it.
        reuse: its ``skip`` rule decides which tiles are fed as a constant instead of being read.

    Every batch must be handed back with :meth:`release` once its data is no longer needed (after
    its outputs are merged: a predictor may return a view of its input). Use it as a context manager
    (or call :meth:`close`) so the thread stops even when the consumer fails.

    >>> import numpy as np
    >>> grid = TileGrid.plan((5,), 2, fixed_tile_shape=True)
    >>> with TileReader(np.arange(5.0)[None], grid, PaddingMode.CONSTANT, 2) as reader:
    ...     for batch in reader:
    ...         print(batch.data[:, 0].tolist())
    ...         reader.release(batch)
    [[0.0, 1.0], [2.0, 3.0]]
    [[3.0, 4.0]]
    """

    def __init__(
        self,
        source: Any,
        grid: TileGrid,
        pad_mode: PaddingMode,
        batch_size: int,
        *,
        pin: bool = False,
        prefetch: bool = False,
        first: int = 0,
        reuse: TileReuse | None = None,
    ) -> None:
        self.source = source
        self.reuse = reuse
        self.grid = grid
        self.pad_mode = pad_mode
        self.batch_size = batch_size
        on_device = isinstance(source, torch.Tensor) and source.device.type != "cpu"
        # Reading from a device tensor is a device copy already queued behind the network: no thread.
        self.prefetch = prefetch and not on_device
        self.device = source.device if on_device else torch.device("cpu")
        self.pin = pin and not on_device and torch.cuda.is_available()
        n_slots = 2 if self.prefetch or self.pin else 1
        tiles = list(grid.tiles())[first:]
        self._batches = [tiles[i : i + batch_size] for i in range(0, len(tiles), batch_size)]
        n_slots = min(n_slots, len(self._batches))
        channels = int(source.shape[0])
        shape = (min(batch_size, len(tiles)), channels, *grid.used_tile_shape)
        self._buffers = [
            torch.empty(shape, dtype=torch.float32, device=self.device, pin_memory=self.pin)
            for _ in range(n_slots)
        ]
        self._free: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        for slot in range(n_slots):
            self._free.put((slot, None))
        self._ready: queue.Queue[Batch | _Done] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def n_batches(self) -> int:
        """Number of batches."""
        return len(self._batches)

    @property
    def n_slots(self) -> int:
        """Number of batch buffers in the pool."""
        return len(self._buffers)

    def __enter__(self) -> TileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Batch]:
        if not self.prefetch:
            for tiles in self._batches:
                batch = self._read(tiles)
                if batch is None:
                    return  # pragma: no cover - closed while iterating
                yield batch
            return
        self._thread = threading.Thread(target=self._produce, name="tilewise-prefetch", daemon=True)
        self._thread.start()
        for _ in self._batches:
            item = self._ready.get()
            if isinstance(item, _Done):
                raise item.error
            yield item

    def release(self, batch: Batch, event: Any = None) -> None:
        """Hand ``batch``'s buffer back; with a CUDA ``event``, it is reused once the event completed."""
        if not batch.released:
            batch.released = True
            self._free.put((batch.slot, event))

    def close(self) -> None:
        """Stop the prefetch thread (if any) and wait for it."""
        self._stop.set()
        self._free.put(None)  # wakes a producer waiting for a free buffer
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _read(self, tiles: list[Tile]) -> Batch | None:
        """Read ``tiles`` into a free buffer (waiting for one); ``None`` once the reader is closed."""
        item = self._free.get()
        if item is None or self._stop.is_set():
            return None
        slot, event = item
        if event is not None:
            event.synchronize()  # the host-to-device copy out of this buffer has finished
        buffer = self._buffers[slot]
        data = buffer[: len(tiles)]
        grid = self.grid
        # Buffers allocated under the caller's inference mode are inference tensors: writing them
        # in place (from this or the prefetch thread) needs inference mode too.
        filled = []
        with torch.inference_mode(buffer.is_inference()):
            for k, tile in enumerate(tiles):
                values = None if self.reuse is None else self.reuse.fill(tile)
                filled.append(values is not None)
                if values is not None:  # not read: fed as the skip rule's constant
                    fill = torch.as_tensor(values, dtype=torch.float32, device=data.device)
                    data[k].copy_(fill.reshape(-1, *([1] * (data.ndim - 2))).expand_as(data[k]))
                    continue
                starts, stops = read_box(grid, tile)
                read_into(self.source, starts, stops, grid.spatial_shape, self.pad_mode, data[k])
        return Batch(tiles, data, slot, filled=filled)

    def _produce(self) -> None:
        try:
            for tiles in self._batches:
                batch = self._read(tiles)
                if batch is None:
                    return
                self._ready.put(batch)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._ready.put(_Done(exc))


@dataclass
class Staged:
    """A prediction on its way to the merge device; :meth:`wait` returns it once it has arrived."""

    values: torch.Tensor
    event: Any = field(default=None)

    def wait(self) -> torch.Tensor:
        """Block until the copy finished (CUDA) and return ``(B, C_out, *out_tile)`` float32."""
        if self.event is not None:
            self.event.synchronize()
        return self.values


class Transfers:
    """Moves batches to the predictor's device and predictions to the merge device.

    Args:
        run_device: where the predictor runs.
        merge_device: where outputs are merged (the accumulator and the sink).

    On CUDA with a host merge device, a prediction is copied into one of two pinned host buffers on
    a side stream (``non_blocking``; the stream first waits for the network's stream, and the
    prediction's memory is kept from the allocator until the copy is done), and an event marks its
    arrival: the network's stream never waits for the copy, and the host waits only when it merges.
    ``lag`` is how many batches the engine keeps in flight before merging the oldest: 1 then, else 0.
    """

    def __init__(self, run_device: torch.device, merge_device: torch.device) -> None:
        self.run_device = run_device
        self.merge_device = merge_device
        self.async_d2h = _cuda_ready(run_device) and merge_device.type == "cpu"
        self.lag = 1 if self.async_d2h else 0
        self._host: list[torch.Tensor] = []
        self._next = 0
        self._stream: Any = None

    def to_device(self, batch: Batch, reader: TileReader) -> torch.Tensor:
        """The batch on the run device; a host buffer copied to CUDA is released once the copy is done."""
        data = batch.data
        if data.device.type == self.run_device.type and (
            self.run_device.index is None or data.device.index == self.run_device.index
        ):
            return data
        moved = data.to(self.run_device, non_blocking=True)
        if data.device.type == "cpu" and _cuda_ready(self.run_device):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            reader.release(batch, event)  # the predictor reads the device copy, not the buffer
        return moved

    def from_device(self, pred: torch.Tensor) -> Staged:
        """Start moving ``pred`` (as float32) to the merge device."""
        if not (self.async_d2h and pred.device.type == "cuda"):
            return Staged(pred.to(self.merge_device, torch.float32))
        pred = pred.float()
        shape = tuple(pred.shape)
        if not self._host or tuple(self._host[0].shape[1:]) != shape[1:] or self._host[0].shape[0] < shape[0]:
            self._host = [
                torch.empty(shape, dtype=torch.float32, pin_memory=True) for _ in range(self.lag + 1)
            ]
        host = self._host[self._next][: shape[0]]
        self._next = (self._next + 1) % len(self._host)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=pred.device)  # type: ignore[no-untyped-call]
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(pred.device))  # the prediction is computed
        with torch.cuda.stream(stream):
            host.copy_(pred, non_blocking=True)
            pred.record_stream(stream)  # not reused by the allocator before the copy is done
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return Staged(host, event)
