#!/usr/bin/env bash
# Set everything up and run stages 01 -> 05 on the embedded default (SmolLM2-135M-Instruct, HumanEval).
# Ends with a summary table (per stage: wall time and headline figure), the report and export paths, and
# {output_root}/demo_summary.json (README's demo table: python scripts/demo_table.py <that file>).
# Usage: bash scripts/demo.sh [config]   (default configs/smollm2-135m.yaml)
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=${1:-configs/smollm2-135m.yaml}
t0=$(date +%s)
bash scripts/setup.sh
. .venv/bin/activate
SECONDS_ARGS=("setup=$(( $(date +%s) - t0 ))")
for stage in 01_prepare_prompts 02_extract_hidden 03_prepare_data 04_train 05_benchmark; do
  t0=$(date +%s)
  echo "=== $stage ==="
  python "$stage.py" --config "$CFG"
  dt=$(( $(date +%s) - t0 ))
  SECONDS_ARGS+=("$stage=$dt")
  echo "=== $stage done in $dt s ==="
done
echo "=== demo finished ==="
python scripts/demo_summary.py --config "$CFG" --seconds "${SECONDS_ARGS[@]}"
