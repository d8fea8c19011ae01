#!/usr/bin/env bash
# Install bitscom with its test extras into ./.venv and run the whole test suite.
# This is the README's test command and exactly what CI (.ci/run) runs.
#   bash scripts/test.sh            # all tests
#   bash scripts/test.sh -k lowbit  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# A CPU build of torch keeps CI small; on a GPU machine install the CUDA build you want first.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,mpi,examples,bench]"
python -m ruff check bitscom acpsgd tests scripts examples   # errors and likely bugs (ruff.toml)
exec python -m pytest -q "$@"
