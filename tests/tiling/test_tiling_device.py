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
