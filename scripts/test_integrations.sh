#!/usr/bin/env bash
# The Accelerate, Lightning and Ray Train recipes of docs/integrations.md, on 2 gloo CPU ranks each.
# Not part of scripts/test.sh: installs the `integrations` extra (accelerate, lightning,
# ray[train]) into ./.venv first, pinned to the torch already there, then runs pytest on
# tests/integrations.
#   bash scripts/test_integrations.sh            # all of them
#   bash scripts/test_integrations.sh -k accel   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
# Pin torch to the installed build so that pip cannot swap it (e.g. a CUDA build for a CPU one).
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$PY" -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
PIP_CONSTRAINT="$constraints" venv_install "test,integrations"
if ! "$PY" -c "import accelerate, lightning, ray.train" 2>/dev/null; then
    echo "[integrations] accelerate / lightning / ray[train] missing after installing .[integrations]:" \
         "does setup.cfg define the 'integrations' extra?" >&2
    exit 1
fi
exec "$PY" -m pytest -q -p no:cacheprovider tests/integrations "$@"
