#!/usr/bin/env bash
# Run the whole test suite (unit, tiny end-to-end, real SmolLM2 end-to-end). Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -ra tests "$@"
