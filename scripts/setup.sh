#!/usr/bin/env bash
# Create .venv and install eagle3-train's dependencies (CPU torch first, so nothing pulls a CUDA build).
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
pip install -q -r requirements.txt
# SGLang source, pinned, without its (GPU) dependencies: the capture patch is tested against it.
pip install -q --no-deps "sglang==0.5.23"
python -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
