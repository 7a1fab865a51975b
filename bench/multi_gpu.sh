#!/usr/bin/env bash
# Multi-GPU scaling of the Kimi-size training step (GitHub issue "Multi-GPU run"), one command.
#
# Usage: bash bench/multi_gpu.sh [N]      N = GPUs of the DDP run (default: every visible GPU)
#
#   (a) 1-GPU baseline, no compile:
#       python3 bench/train_throughput.py --kv-heads 64 --steps 10 --warmup 3 --json $OUT/tt1.json
#   (b) the same step under DDP on N GPUs (NCCL, one process per GPU, each with its own random batch):
#       python3 -m torch.distributed.run --standalone --nproc_per_node N bench/train_throughput.py \
#           --kv-heads 64 --steps 10 --warmup 3 --baseline-json $OUT/tt1.json --json $OUT/ttN.json
#       -> tokens/s per GPU (mean of the ranks' L / median step time), total tokens/s, and
#          scaling efficiency = per-GPU tokens/s / 1-GPU tokens/s (goal >= 0.9); the weights'
#          checksums must agree on all ranks after the timed steps (DDP kept them in sync).
#   (c) tests/train/test_ddp.py (trainer DDP == 1 process) on GPU: SKIPPED. It cannot run on CUDA/NCCL
#       through an environment switch: tests/_ddp_worker.py calls eagle3.stages.train.run(..., device="cpu")
#       and the test's 1-process reference also passes device="cpu", so it always trains on CPU/gloo.
#       (b)'s cross-rank weight checksum is the GPU-side DDP sync check instead.
#
# Output in ${OUT:-/tmp/mgpu}: tt1.json, ttN.json, tt1.log, ttN.log, multi_gpu.json, multi_gpu.md; the
# final Markdown table is printed. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc., exported here).
# pydantic comes from the repo's .whl/ when the image lacks it (installed under $SITE, default
# /tmp/eagle3_site; see the docstring of bench/train_throughput.py).
#
# Env knobs: OUT, KV_HEADS (64), STEPS (10), WARMUP (3), EXTRA_ARGS (added to both runs),
# T1 / TN (timeout of (a) / (b) in s; default 180 / 300), PYTHON (python3).
# CPU check of this script (gloo, tiny shape):
#   KV_HEADS=8 EXTRA_ARGS="--tiny --device cpu" OUT=/tmp/mgpu_cpu bash bench/multi_gpu.sh 2
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

OUT=${OUT:-/tmp/mgpu}
PY=${PYTHON:-python3}
KV_HEADS=${KV_HEADS:-64}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
T1=${T1:-180}
TN=${TN:-300}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
mkdir -p "$OUT"
t_start=$SECONDS

if ! "$PY" -c "import pydantic" 2>/dev/null; then
    SITE=${SITE:-/tmp/eagle3_site}
    echo "installing pydantic from .whl/ into $SITE" >&2
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .whl/pydantic*.whl .whl/annotated_types*.whl \
        .whl/typing_inspection*.whl .whl/typing_extensions*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ $# -ge 1 ]; then
    N=$1
else
    N=$("$PY" -c "import torch; print(torch.cuda.device_count())")
fi
if ! [[ "$N" =~ ^[0-9]+$ ]] || [ "$N" -lt 1 ]; then
    echo "multi_gpu.sh: N must be a positive number of GPUs (got '$N')" >&2
    exit 2
fi
[ "$N" -ge 2 ] || echo "multi_gpu.sh: N=$N; a DDP run needs N >= 2 to measure scaling" >&2

COMMON=(--kv-heads "$KV_HEADS" --steps "$STEPS" --warmup "$WARMUP" "${EXTRA[@]}")

run_logged() {  # run_logged NAME TIMEOUT CMD...: output to $OUT/NAME.log; on failure print its tail and exit
    local name=$1 limit=$2 t0=$SECONDS rc=0
    shift 2
    echo "[$name] $*" >&2
    timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "[$name] FAILED (exit $rc$( [ "$rc" -eq 124 ] && echo ", timed out after ${limit}s")); log tail:" >&2
        tail -n 40 "$OUT/$name.log" >&2
        exit "$rc"
    fi
    echo "[$name] done in $((SECONDS - t0)) s: $(grep -E '^seq [0-9]+ kv_heads' "$OUT/$name.log" | tail -n 1)" >&2
    sed -n '/^matmul ceiling/,/^{$/p' "$OUT/$name.log" | sed '$d'  # the benchmark's own tables
}

# (a) 1 GPU
run_logged tt1 "$T1" "$PY" bench/train_throughput.py "${COMMON[@]}" --json "$OUT/tt1.json"
# (b) N GPUs under DDP
run_logged "tt$N" "$TN" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$N" \
    bench/train_throughput.py "${COMMON[@]}" --baseline-json "$OUT/tt1.json" --json "$OUT/tt$N.json"
# (c) see the header: skipped
C_REASON='skipped: tests/_ddp_worker.py and tests/train/test_ddp.py hard-code eagle3.stages.train.run(device="cpu")'
C_REASON+=' (gloo); there is no env switch to CUDA/NCCL'
echo "[c] $C_REASON" >&2

"$PY" - "$OUT" "$N" "$C_REASON" "$((SECONDS - t_start))" <<'EOF'
"""Final summary of (a) + (b): JSON ($OUT/multi_gpu.json) and Markdown ($OUT/multi_gpu.md, printed)."""
import json
import sys
from pathlib import Path

out, n, c_reason, elapsed = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
one = json.loads((out / "tt1.json").read_text())
many = json.loads((out / f"tt{n}.json").read_text())
b, m = one["runs"][0], many["runs"][0]
q = m["ddp"]
summary = {
    "n_gpus": q["world_size"], "device_name": many["env"]["device_name"], "torch": many["env"]["torch"],
    "seq": m["seq"], "kv_heads": m["kv_heads"], "ttt": m["ttt"], "compile": m["compile"],
    "steps": m["steps"], "warmup": m["warmup"],
    "baseline_tokens_per_s": b["tokens_per_s"], "baseline_step_ms": b["step_ms"],
    "baseline_peak_mem_gib": b["peak_mem_gib"], "baseline_mfu": b["mfu"],
    "per_gpu_tokens_per_s": q["per_gpu_tokens_per_s"], "min_rank_tokens_per_s": q["min_rank_tokens_per_s"],
    "total_tokens_per_s": q["total_tokens_per_s"], "total_tokens_per_s_wall": q["total_tokens_per_s_wall"],
    "rank0_step_ms": m["step_ms"], "max_peak_mem_gib": max(r["peak_mem_gib"] for r in q["per_rank"]),
    "scaling_efficiency": q.get("scaling_efficiency"), "scaling_efficiency_wall": q.get("scaling_efficiency_wall"),
    "goal_efficiency": q.get("goal_efficiency"), "meets_goal": q.get("meets_goal"),
    "params_identical_across_ranks": q["params_identical_across_ranks"],
    "ddp_equivalence_test": c_reason, "elapsed_s": elapsed,
    "nccl_nvls_enable": many["env"].get("NCCL_NVLS_ENABLE"),
}


def f(x, spec):
    return "-" if x is None else format(x, spec)


rows = [
    "| run | GPUs | step ms | tokens/s per GPU | total tokens/s | total tokens/s (wall) | scaling efficiency "
    "| eff. (wall) | peak GiB | params in sync |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    f"| (a) 1 GPU, no DDP | 1 | {f(b['step_ms'], '.1f')} | {f(b['tokens_per_s'], '.0f')} | "
    f"{f(b['tokens_per_s'], '.0f')} | - | 1 (reference) | - | {f(b['peak_mem_gib'], '.2f')} | - |",
    f"| (b) DDP {q['backend']} | {q['world_size']} | {f(m['step_ms'], '.1f')} (rank 0) | "
    f"{f(q['per_gpu_tokens_per_s'], '.0f')} (min {f(q['min_rank_tokens_per_s'], '.0f')}) | "
    f"{f(q['total_tokens_per_s'], '.0f')} | {f(q['total_tokens_per_s_wall'], '.0f')} | "
    f"{f(q.get('scaling_efficiency'), '.3f')} | {f(q.get('scaling_efficiency_wall'), '.3f')} | "
    f"{f(summary['max_peak_mem_gib'], '.2f')} | {q['params_identical_across_ranks']} |",
    "| (c) tests/train/test_ddp.py on GPU | - | - | - | - | - | - | - | - | skipped (c) |",
]
head = (f"Multi-GPU run: {summary['device_name']}, torch {summary['torch']}; seq {m['seq']}, kv heads {m['kv_heads']}, "
        f"ttt {m['ttt']}, compile {m['compile']}, {m['steps']} timed steps after {m['warmup']} warm-up; "
        f"goal efficiency >= {summary['goal_efficiency']}: {'MET' if summary['meets_goal'] else 'NOT MET'}; "
        f"{elapsed} s total")
md = head + "\n\n" + "\n".join(rows) + f"\n\n(c) {c_reason}\n"
(out / "multi_gpu.json").write_text(json.dumps(summary, indent=2) + "\n")
(out / "multi_gpu.md").write_text(md)
print()
print(md)
print(json.dumps(summary, indent=2))
EOF
