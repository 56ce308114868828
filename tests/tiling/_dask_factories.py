"""Model factories for the Dask tests: picklable, importable by worker processes, no ``tiling`` import.

A worker process imports this module by name (``_dask_factories``), so it must be on the workers'
``sys.path``: ``LocalCluster`` workers are spawned with the parent's ``sys.path`` (pytest puts
``tests/tiling`` there); separately started ``dask worker`` processes get it through ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from _tiling_nets import ConvStack, TinyUNet
from torch import nn


class _Slow(nn.Module):
    """Wraps a network and sleeps ``delay_s`` per forward pass (to kill a worker mid-run)."""

    def __init__(self, net: nn.Module, delay_s: float) -> None:
        super().__init__()
        self.net = net
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.net(x)


@dataclass(frozen=True)
class NetFactory:
    """Builds a seeded random network; records each load as a file ``load-<pid>-<uuid>`` in ``record_dir``.

    ``kind`` is ``"conv"`` (:class:`ConvStack`, receptive radius ``sum(dilations)``) or ``"unet"``
    (:class:`TinyUNet`, alignment 4, radius 13).
    """

    kind: str = "conv"
    ndim: int = 3
    c_in: int = 1
    c_out: int = 3
    dilations: Sequence[int] = (1, 2, 1)
    seed: int = 0
    record_dir: str | None = None
    delay_s: float = 0.0
    device: str = "cpu"

    def build(self) -> nn.Module:
        """The network itself (the same weights in every process)."""
        if self.kind == "unet":
            return TinyUNet(self.ndim, self.c_in, self.c_out, seed=self.seed)
        return ConvStack(self.ndim, self.c_in, self.c_out, tuple(self.dilations), seed=self.seed)

    def __call__(self) -> nn.Module:
        torch.set_num_threads(1)
        # Full fp32 convolutions on a GPU too, so the result compares with the CPU reference.
        torch.backends.cudnn.allow_tf32 = False
        if self.record_dir is not None:
            (Path(self.record_dir) / f"load-{os.getpid()}-{uuid.uuid4().hex}").touch()
        net = self.build().to(self.device)
        return _Slow(net, self.delay_s) if self.delay_s else net


def loads_per_process(record_dir: str | Path) -> dict[int, int]:
    """How many times each process id loaded a model (from the files :class:`NetFactory` wrote)."""
    counts: dict[int, int] = {}
    for f in Path(record_dir).glob("load-*"):
        pid = int(f.name.split("-")[1])
        counts[pid] = counts.get(pid, 0) + 1
    return counts
