#!/usr/bin/env bash
# The serve gate end to end (CI runs it before the suite): vLLM's CPU build in its own venv (scripts/setup_vllm.sh,
# reused when present), a small drafter trained by 01 -> 04 on the demo verifier (32 HumanEval prompts, fp32),
# then scripts/serve_gate.py: vLLM serves the export (method eagle3) and three controls; exit 1 unless the
# export passes and every control fails. Usage: bash scripts/serve_gate.sh [output folder] [llama|mla|eagle3.1]
# (default runs/serve-gate, llama; mla: an MLA draft layer, sized against the Llama-style one by eagle3.drafter.mla;
# eagle3.1: the Llama-style layer as EAGLE 3.1, fc_norm / norm_output in its config.json)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/serve-gate}
bash scripts/setup.sh       # the project's .venv (idempotent)
bash scripts/setup_vllm.sh  # vLLM's own venv, reused when present
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false
SETS=(--set "output_root=$OUT" --set verifier.dtype=float32 --set prompts.max_new_tokens=96
      --set prompts.gen_batch_size=32 --set extract.max_length=512 --set train.epochs=4
      --set train.warmup_ratio=0.1 --set export.engine=vllm)
case "${2:-llama}" in
  llama) ;;
  eagle3.1) SETS+=(--set drafter.variant=eagle3.1) ;;
  mla)  # vLLM's CPU MLA kernels take DeepSeek-V3's latent sizes (kv_lora_rank 512, qk_rope_head_dim 64)
    SETS+=(--set drafter.attention=mla --set drafter.mla.q_lora_rank=128 --set drafter.mla.kv_lora_rank=512
           --set drafter.mla.qk_nope_head_dim=32 --set drafter.mla.qk_rope_head_dim=64 --set drafter.mla.v_head_dim=32) ;;
  *) echo "error: serve_gate.sh's second argument is the draft layer: llama, mla or eagle3.1, got '$2'" >&2; exit 2 ;;
esac
CFG=(--config configs/smollm2-135m.yaml "${SETS[@]}")
if [ ! -f "$OUT/drafter-vllm/config.json" ]; then
  python 01_prepare_prompts.py "${CFG[@]}" --limit 32
  for stage in 02_extract_hidden 03_prepare_data 04_train; do python "$stage.py" "${CFG[@]}"; done
fi
python scripts/serve_gate.py "${CFG[@]}" --num-prompts 4 --max-new-tokens 64
