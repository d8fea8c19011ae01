#!/usr/bin/env bash
# Emulated bandwidth-limited cluster on one machine (network namespaces + veth + tc tbf).
# Thin wrapper over scripts/cluster.py; needs root and iproute2 (apt-get install -y iproute2).
#
#   scripts/cluster.sh up     [--nodes 2] [--ranks-per-node 1] [--bandwidth 1gbit]
#   scripts/cluster.sh status
#   scripts/cluster.sh launch -- CMD...        # every rank of the cluster that is up runs CMD
#   scripts/cluster.sh down                    # removes every namespace with the prefix
#   scripts/cluster.sh run    [--nodes ..] [--bandwidth ..] -- CMD...   # up, run, always down
#   scripts/cluster.sh check  [--bandwidth 1gbit]   # raw gloo all_reduce vs. the shaping
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PY:-python3}"
case "${1:-}" in
  up|down|status|launch|run)
    exec "$PY" "$HERE/cluster.py" "$@" ;;
  check)
    shift
    bw=1gbit; args=()
    while [ $# -gt 0 ]; do
      case "$1" in
        --bandwidth) bw="$2"; shift 2 ;;
        *) args+=("$1"); shift ;;
      esac
    done
    gbit=$("$PY" -c "import sys; sys.path.insert(0, '$HERE'); import cluster; print(cluster.parse_rate('$bw') / 1e9)")
    exec "$PY" "$HERE/cluster.py" run --bandwidth "$bw" "${args[@]}" --timeout 300 -- \
      "$PY" "$HERE/allreduce_bench.py" --sizes-mb 1,16,64 --iters 3 --expect-gbit "$gbit" ;;
  *)
    sed -n '2,11p' "$0"; exit 2 ;;
esac
