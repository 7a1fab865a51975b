#!/usr/bin/env bash
# Drafter quality on one GPU (SmolLM2-135M-Instruct verifier): the pipeline's own five stages on
# configs/smollm2-135m-full.yaml, then the ablations of the issue, each evaluated with 05_benchmark.py:
#   - aux layers [2,15,27] (trained) served as a one-layer shift [3,16,28]  (--serve-aux-layers)
#   - ttt_length 1 vs 7                                                      (retrain, same data)
#   - draft vocab 8000 vs 32000 vs the full 49152                            (03 + retrain)
# and prints wall time per stage, shard bytes/token, and every tau table.
# Usage: bash bench/h200_quality.sh [OUT_DIR]
#   env: CONFIG, STEPS_LIST="3 7", EPOCHS_ABLATION=2, SHIFT="3 16 28", EXTRA_SETS="key=value ..." (extra --set for every stage)
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/smollm2-135m-full.yaml}
OUT=${1:-${OUT:-outputs/h200-quality}}
STEPS_LIST=${STEPS_LIST:-"3 7"}
EP_ABL=${EPOCHS_ABLATION:-2}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
ROOT="$OUT/main"
read -r -a EXTRA <<< "${EXTRA_SETS:-}"
SHIFT=${SHIFT:-"3 16 28"}
X=(); for o in "${EXTRA[@]}"; do X+=(--set "$o"); done
S=(--set "output_root=$ROOT" "${X[@]}")
declare -A T
for stage in 01_prepare_prompts 02_extract_hidden 03_prepare_data 04_train; do
  t0=$SECONDS; "$PY" "$stage.py" --config "$CONFIG" "${S[@]}"; T[$stage]=$(( SECONDS - t0 ))
done
for k in $STEPS_LIST; do
  t0=$SECONDS
  "$PY" 05_benchmark.py --config "$CONFIG" "${S[@]}" --set "benchmark.output_dir=$ROOT/bench-steps$k" --steps "$k"
  T[05_benchmark_steps$k]=$(( SECONDS - t0 ))
done
# serving-side layer shift of the same drafter
"$PY" 05_benchmark.py --config "$CONFIG" "${S[@]}" --set "benchmark.output_dir=$ROOT/bench-shift" --serve-aux-layers $SHIFT
# retrained ablations on the same shards (symlinked prompts/shards, own data/train/export folders)
abl() {  # abl NAME OVERRIDES...
  local name=$1; shift
  local r="$OUT/$name"; mkdir -p "$r"
  ln -sfn "$(cd "$ROOT" && pwd)/shards" "$r/shards"
  local A=(--set "output_root=$r" --set "train.epochs=$EP_ABL" "${X[@]}")
  for o in "$@"; do A+=(--set "$o"); done
  "$PY" 03_prepare_data.py --config "$CONFIG" "${A[@]}"
  "$PY" 04_train.py --config "$CONFIG" "${A[@]}"
  "$PY" 05_benchmark.py --config "$CONFIG" "${A[@]}"
}
abl ttt1 train.ttt_length=1
abl ttt7 train.ttt_length=7
abl vocab8k data.draft_vocab_size=8000
abl vocab32k data.draft_vocab_size=32000
abl vocab49k data.draft_vocab_size=49152
echo "## stage wall times (s)"; for k in "${!T[@]}"; do echo "| $k | ${T[$k]} |"; done | sort
"$PY" - "$ROOT" <<'PYEOF'
import json, sys
from pathlib import Path
meta = json.loads((Path(sys.argv[1]) / "shards" / "data_config.json").read_text())
print(f"shards: {meta.get('num_samples')} samples, {meta.get('num_tokens')} tokens, "
      f"{meta.get('num_loss_tokens')} loss tokens, {meta.get('bytes_per_token')} bytes/token")
PYEOF
find "$OUT" -name bench.md -print -exec cat {} \;
