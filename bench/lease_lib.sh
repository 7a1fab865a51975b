# Sourced by the GPU lease drivers (bench/quality_session.sh, bench/gpu_session.sh): what their verbs share across
# device calls. A lease machine keeps its files only while it stays warm (given back 30 s after a call returns), so
# the work runs detached and each call `start`s it or `wait`s for it; these helpers keep those calls consistent.

lease_save_settings() {  # lease_save_settings W VAR...: $W/driver.env, one line per set VAR,
  # `[ -n "${VAR:-}" ] || VAR=value` (written whole, then renamed), so that settings given to `start` alone hold
  # for the later verbs (lease 2026-12-04: SEED given to `start` only, and every `wait` packed the seed back).
  # A later call's empty VAR counts as unset (lease 2026-12-04b: the finished driver's `wait` packed the seeded
  # prompts back although driver.env held SEED; an empty SEED in that call's environment is the one way found)
  local w=$1 v; shift
  mkdir -p "$w"
  for v in "$@"; do
    [ -n "${!v:-}" ] && printf '[ -n "${%s:-}" ] || %s=%q\n' "$v" "$v" "${!v}"
  done > "$w/driver.env.tmp" && mv "$w/driver.env.tmp" "$w/driver.env"
}

lease_load_settings() {  # lease_load_settings W: the settings `start` recorded; a variable already set (non-empty) wins
  [ -e "$1/driver.env" ] && . "$1/driver.env"
  return 0
}

lease_large_ok() {  # lease_large_ok W: true when a pack may return large files (regenerated prompts, a drafter):
  # once the driver is done ($W/status/ALL.done) or with PACK_LARGE=1. A mid-run `wait` that copies ~35 MB back
  # returns late, and a machine idle 30 s after a call is given back with the run on it (lease 2026-12-04 lost
  # two machines right after such a wait)
  [ -e "$1/status/ALL.done" ] || [ "${PACK_LARGE:-0}" = 1 ]
}
