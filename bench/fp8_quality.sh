#!/usr/bin/env bash
# fp8 vs bf16 shards on the GPU (issue 13 item 1): same shards, seed and config; only the storage differs.
# Takes a finished bf16 run (shards/ from 02), converts its shards to fp8 (convert_shards.py), runs
# 03 -> 04 -> 05 on the fp8 copy and, unless the bf16 run already has them, 03 -> 04 -> 05 on the bf16
# shards too; then prints bytes/token, tau per dataset at --steps 3 and training tokens/s of both.
# Usage: bash bench/fp8_quality.sh BF16_RUN_ROOT [OUT_DIR]
#   BF16_RUN_ROOT: output_root of a run whose 02 finished (e.g. outputs/h200-quality/main)
#   env: CONFIG (default configs/smollm2-135m-full.yaml), STEPS=3, EXTRA_SETS="key=value ..." (every stage)
set -euo pipefail
cd "$(dirname "$0")/.."
BF=${1:?usage: bash bench/fp8_quality.sh BF16_RUN_ROOT [OUT_DIR]}
OUT=${2:-${OUT:-outputs/fp8-quality}}
CONFIG=${CONFIG:-configs/smollm2-135m-full.yaml}
STEPS=${STEPS:-3}
PY=${PYTHON:-python3}
read -r -a EXTRA <<< "${EXTRA_SETS:-}"
X=(); for o in "${EXTRA[@]}"; do X+=(--set "$o"); done
mkdir -p "$OUT"
run_stages() {  # run_stages ROOT SHARDS_DIR
  local r=$1 s=$2
  local A=(--set "output_root=$r" --set "extract.output_dir=$s" "${X[@]}")
  "$PY" 03_prepare_data.py --config "$CONFIG" "${A[@]}" --no-plot
  t0=$SECONDS; "$PY" 04_train.py --config "$CONFIG" "${A[@]}"; echo "$r: 04 wall $(( SECONDS - t0 )) s"
  "$PY" 05_benchmark.py --config "$CONFIG" "${A[@]}" --steps "$STEPS"
}
t0=$SECONDS
"$PY" convert_shards.py --src "$BF/shards" --dst "$OUT/fp8/shards" --to float8_e4m3fn --json "$OUT/convert.json"
echo "convert wall $(( SECONDS - t0 )) s"
run_stages "$OUT/fp8" "$OUT/fp8/shards"
# the bf16 drafter: reuse the run's own (h200_quality.sh writes bench-steps$STEPS/), else train one here
BFB="$BF/bench-steps$STEPS/bench.json"; [ -f "$BFB" ] || BFB="$BF/bench/bench.json"
if [ ! -f "$BFB" ] || [ ! -f "$BF/train/train_report.json" ]; then
  run_stages "$OUT/bf16" "$(cd "$BF" && pwd)/shards"; BFR="$OUT/bf16"; BFB="$OUT/bf16/bench/bench.json"
else
  BFR="$BF"
fi
"$PY" - "$BFR" "$OUT/fp8" "$OUT/convert.json" "$BFB" <<'PYEOF'
import json, sys
from pathlib import Path
bf, f8, conv = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
bench_json = {bf: Path(sys.argv[4]), f8: f8 / "bench" / "bench.json"}
def tau(root):
    rep = json.loads(bench_json[root].read_text())
    out = {}
    for d in rep.get("datasets", []):
        name = d.get("name") or d.get("dataset")
        out[name] = d.get("tau") or d.get("acceptance_length")
    return out
def tps(root):
    r = json.loads((root / "train" / "train_report.json").read_text())
    return r.get("tokens_per_s")
tb, tf = tau(bf), tau(f8)
print(f"bytes/token: bf16 {conv['src_bytes_per_token']}, fp8 {conv['bytes_per_token']} "
      f"(format ratio {conv['bytes_per_token'] / conv['src_bytes_per_token']:.4f}; files {conv['ratio']})")
print(f"train tokens/s: bf16 {tps(bf)}, fp8 {tps(f8)}")
print("| dataset | tau bf16 | tau fp8 | fp8 - bf16 |\n|---|---:|---:|---:|")
for k in tb:
    a, b = tb[k], tf.get(k)
    print(f"| {k} | {a} | {b} | {None if a is None or b is None else round(b - a, 3)} |")
json.dump({"bf16_root": str(bf), "fp8_root": str(f8), "convert": conv, "tau_bf16": tb, "tau_fp8": tf,
           "train_tokens_per_s": {"bf16": tps(bf), "fp8": tps(f8)}},
          open(Path(sys.argv[2]).parent / "fp8_quality.json", "w"), indent=2)
PYEOF
