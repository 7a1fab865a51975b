#!/usr/bin/env bash
# Set everything up and run stages 01 -> 05 on the embedded default (SmolLM2-135M-Instruct, HumanEval).
# Usage: bash scripts/demo.sh [config]   (default configs/smollm2-135m.yaml)
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=${1:-configs/smollm2-135m.yaml}
bash scripts/setup.sh
. .venv/bin/activate
start=$(date +%s)
for stage in 01_prepare_prompts 02_extract_hidden 03_prepare_data 04_train 05_benchmark; do
  t0=$(date +%s)
  echo "=== $stage ==="
  python "$stage.py" --config "$CFG"
  echo "=== $stage done in $(( $(date +%s) - t0 )) s ==="
done
echo "=== demo finished in $(( $(date +%s) - start )) s; outputs under outputs/$(python -c "import yaml,sys;print(yaml.safe_load(open('$CFG'))['run_name'])")/ ==="
