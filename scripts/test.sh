#!/usr/bin/env bash
# Run the whole test suite (unit, tiny end-to-end, real SmolLM2 end-to-end). Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check --quiet . && ruff format --check --quiet .  # style first: seconds, before the 20-minute suite
# no "tests" here: pytest.ini's testpaths = tests is the default when no path is given, so
# `bash scripts/test.sh tests/train` runs that folder only (a path given here too ran the whole suite)
exec python -m pytest -q -ra "$@"
