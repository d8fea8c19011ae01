# Shared helpers for scripts/*.sh (sourced, not run). Reads envs.conf from the repo root.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=../envs.conf
source "${ENVS_CONF:-$ROOT/envs.conf}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

# ensure_deps MODULE... : make sure the project's virtual environment (scripts/venv.sh: ./.venv
# or $BITSCOM_VENV) has torch, bitscom (editable) and the modules named, and switch to it.
# Nothing is installed into the interpreter that created it.
ensure_deps() {
    # shellcheck source=venv.sh
    source "$ROOT/scripts/venv.sh" || return 1
    local extras=() mod
    for mod in "$@"; do
        case "$mod" in
            mlxtend|sklearn|matplotlib) extras+=(examples) ;;
            transformers) extras+=(bench) ;;
            *) echo "[setup] ensure_deps: no extra provides '$mod'" >&2; return 1 ;;
        esac
    done
    venv_install "$(printf '%s\n' "${extras[@]}" | sort -u | paste -sd, -)"
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
