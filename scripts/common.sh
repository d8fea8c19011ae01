# Shared helpers for scripts/*.sh (sourced, not run). Reads envs.conf from the repo root.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=../envs.conf
source "${ENVS_CONF:-$ROOT/envs.conf}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

# ensure_deps MODULE... : install torch, bitscom (editable) and the modules named, if missing.
# Module names map to pip names below; nothing is installed when everything imports.
ensure_deps() {
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        echo "[setup] torch not found; pip install torch==$TORCH_VERSION" >&2
        "$PY" -m pip install "torch==$TORCH_VERSION" || return 1
    fi
    if ! (cd / && "$PY" -c "import bitscom" >/dev/null 2>&1); then
        echo "[setup] installing bitscom from $ROOT (pip install -e)" >&2
        "$PY" -m pip install -e "$ROOT" || return 1
    fi
    local missing=() mod
    for mod in "$@"; do
        "$PY" -c "import $mod" >/dev/null 2>&1 || missing+=("$mod")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "[setup] pip install ${missing[*]}" >&2
        "$PY" -m pip install "${missing[@]}" || return 1
    fi
}

# first host's name and the total slot count of envs.conf's hosts
master_host() { local h="${hosts[0]}"; echo "${h%%:*}"; }
total_slots() { local n=0 h; for h in "${hosts[@]}"; do n=$((n + ${h##*:})); done; echo "$n"; }
is_single_node() {
    [ ${#hosts[@]} -le 1 ] && return 0
    return 1
}
gpu_count() { "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0; }

# launch NPROC CMD... : run CMD as NPROC ranks: torchrun on one node, mpirun across envs.conf hosts.
launch() {
    local nproc="$1"; shift
    local ifname="${IB_INTERFACE:-$ETH_INTERFACE}"
    if [ -n "$ifname" ]; then export GLOO_SOCKET_IFNAME="$ifname" NCCL_SOCKET_IFNAME="$ifname"; fi
    if is_single_node; then
        "$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc" "$@"
    else
        local mpirun="mpirun" hostlist
        [ -n "$MPIPATH" ] && mpirun="$MPIPATH/bin/mpirun --prefix $MPIPATH"
        hostlist=$(IFS=,; echo "${hosts[*]}")
        # shellcheck disable=SC2086
        $mpirun -np "$nproc" -H "$hostlist" --map-by slot --bind-to none \
            ${ETH_INTERFACE:+--mca btl_tcp_if_include $ETH_INTERFACE} \
            -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH \
            -x MASTER_ADDR="$(master_host)" -x MASTER_PORT="$MASTER_PORT" \
            ${ifname:+-x GLOO_SOCKET_IFNAME -x NCCL_SOCKET_IFNAME} \
            "$PY" "$@"
    fi
}
