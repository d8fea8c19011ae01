#!/usr/bin/env bash
# Install bitscom with its test extras into ./.venv and run the whole test suite.
# This is the README's test command and exactly what CI (.ci/run) runs.
#   bash scripts/test.sh            # all tests
#   bash scripts/test.sh -k lowbit  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
# ./.venv (or $BITSCOM_VENV), torch in it (a CPU build keeps CI small; on a GPU machine install
# the CUDA build you want first), activated; PY=its python. Shared with mnist.sh / perf.sh.
source scripts/venv.sh
python -m pip install -q --upgrade pip >/dev/null
venv_install "test,mpi,examples,bench"
python -m ruff check bitscom acpsgd tests scripts examples   # errors, likely bugs, complexity (ruff.toml)
lint-imports                                                 # layers, no cycles, no shim imports (.importlinter)
python scripts/complexity.py                                 # no function above 15, and/or counted (radon)
python -m mypy -p bitscom                                    # types ([mypy] in setup.cfg)
exec python -m pytest -q "$@"
