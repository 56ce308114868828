"""``device``: tiles move to the accelerator and back (``gpu`` marker: skipped unless CUDA is present).

Oracle: the same plan run on the CPU. Tolerance 1e-5: CUDA convolutions may use TF32 or other
summation orders; TF32 is disabled here so the difference stays at fp32 rounding (~1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _tiling_nets import ConvStack

from tiling import tiled_inference

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_numpy_input_predicted_on_cuda(rng):
    net = ConvStack(3, 1, 2)
    x = rng.standard_normal((1, 30, 27, 25), dtype=np.float32)
    cpu = tiled_inference(x, net, 12, halo=3, overlap=2, blend="gaussian")
    gpu = tiled_inference(x, net.cuda(), 12, halo=3, overlap=2, blend="gaussian", device="cuda", batch_size=4)
    assert isinstance(gpu, np.ndarray)
    assert np.abs(gpu - cpu).max() <= 1e-5


def test_cuda_tensor_input_stays_on_cuda(rng):
    net = ConvStack(2, 1, 2).cuda()
    x = torch.from_numpy(rng.standard_normal((2, 1, 40, 33), dtype=np.float32)).cuda()
    y = tiled_inference(x, net, 16, halo=3, overlap=2, blend="hann")
    assert y.is_cuda and y.shape == (2, 2, 40, 33)
    with torch.inference_mode():
        want = net(x)
    assert (y - want).abs().max().item() <= 1e-5


def test_pinned_buffers_and_async_copies_give_the_cpu_result(rng):
    # Host batch buffers are pinned once; predictions come back through pinned buffers on a side
    # stream (Transfers.lag == 1: batch i is merged after batch i + 1 was launched).
    from tiling import TileGrid
    from tiling.execute import TileReader, Transfers
    from tiling.geometry import PaddingMode

    x = rng.standard_normal((1, 41, 37, 29), dtype=np.float32)
    grid = TileGrid.plan(x.shape[1:], 16, 3)
    with TileReader(x, grid, PaddingMode.CONSTANT, 2, pin=True, prefetch=True) as reader:
        assert reader.pin and all(b.is_pinned() for b in reader._buffers)
    transfers = Transfers(torch.device("cuda"), torch.device("cpu"))
    assert transfers.lag == 1 and transfers.async_d2h
    net = ConvStack(3, 1, 2)
    cpu = tiled_inference(x, net, 16, halo=3, overlap=2, blend="hann")
    for prefetch in (True, False):
        gpu = tiled_inference(x, net.cuda(), 16, halo=3, overlap=2, blend="hann", device="cuda", batch_size=3,
                              prefetch=prefetch)  # fmt: skip
        assert np.abs(gpu - cpu).max() <= 1e-5
        net.cpu()


def test_half_precision_predictions_come_back_as_float32(rng):
    net = ConvStack(2, 1, 1).cuda().half()
    x = rng.standard_normal((1, 50, 45), dtype=np.float32)

    def predictor(t):
        return net(t.half())

    y = tiled_inference(x, predictor, 16, halo=3, device="cuda", batch_size=4)
    with torch.inference_mode():
        want = net(torch.from_numpy(x)[None].cuda().half())[0].float().cpu().numpy()
    assert y.dtype == np.float32
    assert np.abs(y - want).max() <= 1e-2  # fp16 convolutions on differently sized inputs
