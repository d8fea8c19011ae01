#!/usr/bin/env bash
# CI on a loaded machine, N times in a row (issue 20): `.ci/run` on a fresh clone of HEAD while
# stress-ng keeps the cores busy; stops at the first failure. One row per run in runs.csv (with
# the 15-minute load average at its end), each run's whole output in run<i>.log.
#
#   bash scripts/ci_under_load.sh                      # 10 runs, one CPU hog per core
#   runs=3 hogs=4 out=/tmp/cil bash scripts/ci_under_load.sh
#   # two loops at once load each other (a second test suite is the load):
#   runs=5 hogs=1 out=/tmp/a bash scripts/ci_under_load.sh & runs=5 hogs=0 out=/tmp/b bash scripts/ci_under_load.sh
#
# runs (10)   how many runs; the script stops at the first one that fails
# hogs (nproc) stress-ng CPU workers running beside every run (0 = no load: a plain repeat)
# venv (shared) "shared": every clone installs into one environment ($out/venv, made by the first
#             run), so a run times the tests, ruff and mypy rather than pip; "fresh": a new .venv
#             in each clone, exactly as CI does (adds the install's minutes to every run)
# out         where the clones, logs and runs.csv go (default results/ci-under-load-<date>)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs=${runs:-10}; hogs=${hogs:-$(nproc)}; venv=${venv:-shared}
out=${out:-$ROOT/results/ci-under-load-$(date +%Y%m%d-%H%M%S)}
case "$venv" in shared|fresh) ;; *) echo "venv must be shared or fresh, got '$venv'" >&2; exit 2 ;; esac
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "runs must be a positive integer, got '$runs'" >&2; exit 2; }
[[ "$hogs" =~ ^[0-9]+$ ]] || { echo "hogs must be an integer >= 0, got '$hogs'" >&2; exit 2; }
if [ "$hogs" -gt 0 ] && ! command -v stress-ng >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq stress-ng >/dev/null) \
        || { echo "stress-ng is needed for hogs=$hogs (apt-get install stress-ng)" >&2; exit 2; }
fi
mkdir -p "$out"
commit=$(git -C "$ROOT" rev-parse --short HEAD)     # every run tests this commit, whatever lands meanwhile
csv="$out/runs.csv"
[ -f "$csv" ] || echo "run,commit,hogs,venv,rc,seconds,loadavg_15min,summary" > "$csv"
stress_pid=
stop_load() { [ -n "$stress_pid" ] && kill "$stress_pid" 2>/dev/null; wait 2>/dev/null; }
trap stop_load EXIT
if [ "$hogs" -gt 0 ]; then
    stress-ng --cpu "$hogs" --quiet >/dev/null 2>&1 &
    stress_pid=$!
fi
echo "[ci-under-load] $runs runs of .ci/run at $commit, $hogs CPU hogs, venv=$venv -> $out"
for i in $(seq 1 "$runs"); do
    clone="$out/clone$i"
    rm -rf "$clone"
    git clone -q "$ROOT" "$clone" && git -C "$clone" checkout -q "$commit"
    env_args=(CI=true)
    [ "$venv" = shared ] && env_args+=(BITSCOM_VENV="$out/venv")
    t0=$(date +%s)
    (cd "$clone" && env "${env_args[@]}" bash .ci/run) > "$out/run$i.log" 2>&1 < /dev/null
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$out/run$i.log" | tail -1 | tr -d '=,' | xargs)
    load=$(cut -d' ' -f3 /proc/loadavg)    # the machine's load over (about) the run
    echo "$i,$commit,$hogs,$venv,$rc,$secs,$load,$summary" >> "$csv"
    echo "[ci-under-load] run $i: rc=$rc in ${secs}s (15-min load average $load): $summary"
    rm -rf "$clone/.venv"
    if [ $rc -ne 0 ]; then
        echo "[ci-under-load] run $i FAILED; log: $out/run$i.log" >&2
        exit 1
    fi
done
echo "[ci-under-load] $runs of $runs passed"
