# Sourced by the GPU lease driver (bench/quality_session.sh): what its verbs share across
# device calls. A lease machine keeps its files only while it stays warm (given back 30 s after a call returns), so
# the work runs detached and each call `start`s it or `wait`s for it; these helpers keep those calls consistent.

lease_save_settings() {  # lease_save_settings W VAR...: $W/driver.env, one line per set VAR,
  # `[ -n "${VAR:-}" ] || VAR=value` (written whole, then renamed), so that settings given to `start` alone hold
  # for the later verbs (lease 2026-12-04: SEED given to `start` only, and every `wait` packed the seed back).
  # A later call's empty VAR counts as unset (lease 2026-12-04b: the finished driver's `wait` packed the seeded
  # prompts back although driver.env held SEED; an empty SEED in that call's environment is the one way found)
  local w=$1 v; shift
  mkdir -p "$w"
  # (an `if`, not `[ ] && printf`: the loop's status is its last command's, and an unset last VAR made it 1, so the
  # file was never renamed into place: lease 2026-12-05b's `pack` knew no PACK_DRAFTER and sent the prompts)
  # A VAR set but empty is recorded too (`VAR=''`): several settings mean something when empty (SETS7: no 7-step
  # run, BENCH_SETS: no --set for 05, NPROMPTS: every conversation, COMMON), and a later verb or a restart that found
  # nothing recorded took the default instead (BENCH_SETS= then gave the restarted chains an fp32 05 beside bf16 ones)
  for v in "$@"; do
    if [ -n "${!v+x}" ]; then printf '[ -n "${%s:-}" ] || %s=%q\n' "$v" "$v" "${!v}"; fi
  done > "$w/driver.env.tmp" && mv "$w/driver.env.tmp" "$w/driver.env"
}

lease_start_settings() {  # lease_start_settings W VAR...: `start`'s settings. Those recorded by an earlier `start` in
  # $W/driver.env that this call leaves unset or empty are kept (exported, so the driver `start` launches reads them;
  # named in one line), then the whole set is recorded again. A restart (`stop`, then `start` in a later device
  # call, which sources no plan) otherwise wrote a driver.env of nothing and ran the defaults on the same $W: another
  # CONFIG and RECIPES beside the phases already done (dry run 2026-12-05f: `ref_04: already done`, then v31 / lk /
  # ep16 training on the plan's data). A different plan: another W, or the settings changed given in that call
  local w=$1 v kept=(); shift
  if [ -e "$w/driver.env" ]; then
    local -A had=()
    for v in "$@"; do [ -n "${!v:-}" ] && had[$v]=1; done
    . "$w/driver.env"
    for v in "$@"; do  # (a value recorded empty: kept as set and empty, `VAR=` in the line)
      if [ -z "${had[$v]:-}" ] && [ -n "${!v+x}" ]; then
        export "${v?}"; if [ -n "${!v}" ]; then kept+=("$v"); else kept+=("$v="); fi
      fi
    done
    [ ${#kept[@]} -eq 0 ] || echo "== settings of the earlier start kept (from $w/driver.env): ${kept[*]}"
  fi
  lease_save_settings "$w" "$@"
}

lease_driver_alive() {  # lease_driver_alive W: true while the driver `start` launched ($W/run.pid) still runs
  [ -e "$1/run.pid" ] && kill -0 "$(cat "$1/run.pid")" 2>/dev/null
}

lease_load_settings() {  # lease_load_settings W: the settings `start` recorded; a variable already set (non-empty) wins
  [ -e "$1/driver.env" ] && . "$1/driver.env"
  return 0
}

lease_wait() {  # lease_wait W SECONDS: until the driver is done ($W/status/ALL.done), SECONDS have passed, or the
  # driver `start` launched is gone without finishing (stopped, killed, or dead of an error: `wait 560` slept all its 560 s
  # of device time on a driver that no longer ran; one line says so, then the caller packs what is there)
  local w=$1 lim=$2 t0=$SECONDS
  while [ ! -e "$w/status/ALL.done" ] && (( SECONDS - t0 < lim )); do
    if ! lease_driver_alive "$w"; then
      [ -e "$w/status/ALL.done" ] && break
      echo "== the driver is not running and did not finish (no $w/status/ALL.done; see $w/run.log):" \
        "packing what is there"
      break
    fi
    sleep "${LEASE_POLL_S:-5}"
  done
}

lease_large_ok() {  # lease_large_ok W: true when a pack may return large files (regenerated prompts, a drafter):
  # once the driver is done ($W/status/ALL.done) or with PACK_LARGE=1. A mid-run `wait` that copies ~35 MB back
  # returns late, and a machine idle 30 s after a call is given back with the run on it (lease 2026-12-04 lost
  # two machines right after such a wait)
  [ -e "$1/status/ALL.done" ] || [ "${PACK_LARGE:-0}" = 1 ]
}

lease_start() {  # lease_start W SCRIPT: launch `SCRIPT run` detached (its own session: `stop` ends the group), unless
  # a driver is still running; a finished driver's ALL.done is removed first, so `wait` waits for the new one
  # (lease 2026-12-05b: a second `start` while the first driver still ran its last phases; that one's ALL.done then
  # ended the next `wait` at once, and both drivers ran their phases side by side)
  local w=$1 script=$2
  if lease_driver_alive "$w"; then
    echo "error: a driver is still running (pid $(cat "$w/run.pid"), log $w/run.log): \`wait\` for it, or \`stop\` it first" >&2
    return 1
  fi
  rm -f "$w/status/ALL.done"
  setsid nohup bash "$script" run > "$w/run.log" 2>&1 < /dev/null &
  echo $! > "$w/run.pid"
  sleep 2; echo "started (pid $(cat "$w/run.pid")), log $w/run.log"
}

lease_cached() {  # lease_cached FILE INPUTS CMD...: print the value kept in FILE when FILE.inputs holds INPUTS (one line:
  # what the value was computed from), else run CMD, keep its output in FILE and INPUTS in FILE.inputs (each written
  # whole, then renamed; the inputs last, so a driver killed between the two recomputes) and print it. A restarted
  # driver so keeps a value whose inputs are unchanged and recomputes one whose inputs changed, with nothing to remove
  # by hand (quality_session's $W/main_steps was kept whatever it had been computed from). CMD failing: status 1,
  # FILE untouched
  local f=$1 inputs=$2; shift 2
  if [ -e "$f" ] && [ -e "$f.inputs" ] && [ "$(cat "$f.inputs")" = "$inputs" ]; then cat "$f"; return 0; fi
  rm -f "$f.inputs"
  "$@" > "$f.tmp" || { rm -f "$f.tmp"; return 1; }
  mv "$f.tmp" "$f" && printf '%s\n' "$inputs" > "$f.inputs.tmp" && mv "$f.inputs.tmp" "$f.inputs" && cat "$f"
}
