#!/usr/bin/env bash
# GPU benchmark (issue 15): tilewise against the whole-volume pass and MONAI, fp32 and AMP, eager and
# ONNX Runtime CUDA, on MONAI's BasicUNet and the MNI152 volume (1 mm, and 2x upsampled). Under
# 10 minutes on one modern GPU; see benchmarks/gpu.py for what is measured.
#
# Needs an environment with a CUDA build of torch and the extras gpu, export and bench, e.g.
#   python3 -m venv .venv-gpu && .venv-gpu/bin/pip install torch          # a CUDA wheel
#   .venv-gpu/bin/pip install -e ".[gpu,export,bench]"
# then:  PYTHON=.venv-gpu/bin/python benchmarks/gpu.sh [--quick] [--repeats N] [--no-onnx]
# Results: benchmarks/out-gpu/gpu.md and gpu.json (also printed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: install a CUDA build of torch")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", file=sys.stderr)
try:
    import onnxruntime as ort
    providers = ort.get_available_providers()
    print(f"onnxruntime {ort.__version__}: {providers}", file=sys.stderr)
    if "CUDAExecutionProvider" not in providers:
        print("onnxruntime has no CUDA provider (install the gpu extra): its rows run on the CPU", file=sys.stderr)
except ImportError:
    print("onnxruntime is not installed: pass --no-onnx", file=sys.stderr)
PY
exec timeout 590 "$PYTHON" -W ignore -m benchmarks.gpu "$@"
