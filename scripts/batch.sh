#!/usr/bin/env bash
# Sweeps (the ACP-SGD seed's batch mode): compressor x bandwidth x world size x threshold x
# rank (x bits), one perf.sh run each, all rows in one CSV, then summary.md + PNG plots.
#
#   bash scripts/batch.sh                                 # default sweep (below)
#   opts="ssgd fp16 acpsgd" bandwidths="1gbit" nworkers_list="2" dnn=vgg16 bs=2 bash scripts/batch.sh
#   mode=mnist opts="ssgd fp16 acpsgd" bandwidths="1gbit" bash scripts/batch.sh   # loss vs time
#   mode=headline bash scripts/batch.sh                   # the README's headline table
#   mode=quick bash scripts/batch.sh                      # tiny model, seconds per run (smoke)
#   mode=convergence bash scripts/batch.sh                # accuracy suite: every compressor vs S-SGD
#   mode=convergence conv_args="--quick" bash scripts/batch.sh   # (args go to scripts/convergence.py)
#
# Lists (space-separated; defaults for mode=perf):
#   opts          "ssgd ddp_fp16 ddp_powersgd fp16 lowbit powersgd acpsgd"
#   bandwidths    "1gbit 10gbit"   ("none" = plain torchrun, no emulated cluster)
#   nworkers_list "2 4"            thresholds "25"
#   ranks         "4"   (swept for powersgd/acpsgd/ddp_powersgd only)
#   bits_list     "4 8" (swept for lowbit only)
# Scalars: dnn (bert_base) bs (1) seq_len (32) nsteps (10) warmup (3) ranks_per_node (1)
#   out (results/batch-<mode>-<date>)  timeout (900 s per run)  epochs (mnist mode, 8)
# mode=headline's opts add "onebitadam diloco" (bitscom.OneBitAdam; bitscom.DiLoCo, sync_every 8,
# 2 fragments, delay 2; scripts/perf_faces.py). Each run's batch.log lines: its step time, its
# codec time per step, the bound max(compute + codec, wire) and step / bound; summary.md (printed
# at the end) has them as columns.
# Runs that fail or whose compressor is missing are logged and skipped; the sweep goes on.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"
cd "$ROOT"

mode=${mode:-perf}
if [ "$mode" = convergence ]; then   # training quality, not speed: its own driver, own outputs
    out=${out:-$ROOT/results/batch-convergence-$(date +%Y%m%d-%H%M%S)}
    ensure_deps mlxtend matplotlib
    # shellcheck disable=SC2086
    exec "$PY" "$HERE/convergence.py" --out "$out" ${conv_args:-}
fi
case "$mode" in
  headline)
    opts=${opts:-"ssgd ddp_fp16 ddp_powersgd fp16 lowbit powersgd acpsgd onebitadam diloco"}
    bandwidths=${bandwidths:-"1gbit 10gbit"}; nworkers_list=${nworkers_list:-"2 4"}
    dnn=${dnn:-bert_base}; bs=${bs:-1}; seq_len=${seq_len:-32}; bits_list=${bits_list:-"4 8"}
    nsteps=${nsteps:-10}; warmup=${warmup:-3} ;;
  quick)
    opts=${opts:-"ssgd ddp_fp16 ddp_powersgd fp16"}; bandwidths=${bandwidths:-"none"}
    nworkers_list=${nworkers_list:-"2"}; dnn=${dnn:-tiny}; bs=${bs:-16}; nsteps=${nsteps:-3}
    warmup=${warmup:-2} ;;
  mnist)
    opts=${opts:-"ssgd fp16 lowbit powersgd acpsgd"}; bandwidths=${bandwidths:-"1gbit"}
    nworkers_list=${nworkers_list:-"2"} ;;
  perf) ;;
  *) echo "mode must be perf, mnist, headline, quick or convergence; got '$mode'" >&2; exit 2 ;;
esac
opts=${opts:-"ssgd ddp_fp16 ddp_powersgd fp16 lowbit powersgd acpsgd"}
bandwidths=${bandwidths:-"1gbit 10gbit"}; nworkers_list=${nworkers_list:-"2 4"}
thresholds=${thresholds:-25}; ranks=${ranks:-4}; bits_list=${bits_list:-"4 8"}
dnn=${dnn:-bert_base}; bs=${bs:-1}; seq_len=${seq_len:-32}; nsteps=${nsteps:-10}; warmup=${warmup:-3}
out=${out:-$ROOT/results/batch-$mode-$(date +%Y%m%d-%H%M%S)}
timeout=${timeout:-900}
mkdir -p "$out/logs"
csv="$out/perf.csv"; mnist_csv="$out/mnist.csv"
echo "[batch] mode=$mode -> $out" | tee "$out/batch.log"

n_ok=0; n_fail=0
run_one() {   # name, then env assignments for perf.sh / mnist.sh
    local name="$1"; shift
    local log="$out/logs/$name.log"
    echo "[batch] $name" | tee -a "$out/batch.log"
    if [ "$mode" = mnist ]; then
        env "$@" csv="$mnist_csv" epochs="${epochs:-8}" timeout "$timeout" bash "$HERE/mnist.sh" > "$log" 2>&1
    else
        env "$@" csv="$csv" dnn="$dnn" bs="$bs" seq_len="$seq_len" nsteps="$nsteps" warmup="$warmup" \
            timeout="$timeout" bash "$HERE/perf.sh" > "$log" 2>&1
    fi
    local rc=$?
    if [ $rc -eq 0 ]; then
        n_ok=$((n_ok + 1)); grep -E "^\[perf\] (iteration|codec)|^final test" "$log" | sed 's/^/    /' | tee -a "$out/batch.log"
    else
        n_fail=$((n_fail + 1)); echo "    FAILED (rc=$rc): $(grep -E 'error|Error' "$log" | tail -1 | cut -c1-200)" | tee -a "$out/batch.log"
    fi
}

for n in $nworkers_list; do
  for bw in $bandwidths; do
    for thr in $thresholds; do
      for o in $opts; do
        case "$o" in
          powersgd|acpsgd|ddp_powersgd|ddp_acpsgd|ddp_powersgd_bitscom) knob=rank; values=$ranks ;;
          lowbit|ddp_lowbit) knob=bits; values=$bits_list ;;
          *) knob=""; values="-" ;;
        esac
        for v in $values; do
          extra=(); tag=""
          [ -n "$knob" ] && { extra=("$knob=$v"); tag="-$knob$v"; }
          run_one "n$n-$bw-t$thr-$o$tag" opt="$o" nworkers="$n" bandwidth="$bw" threshold="$thr" "${extra[@]}"
        done
      done
    done
  done
done

echo "[batch] $n_ok run(s) ok, $n_fail failed" | tee -a "$out/batch.log"
plot_args=()
[ -s "$csv" ] && plot_args+=("$csv")
[ -s "$mnist_csv" ] && plot_args+=(--mnist "$mnist_csv")
if [ ${#plot_args[@]} -gt 0 ]; then
    ensure_deps matplotlib
    "$PY" "$HERE/plot_perf.py" "${plot_args[@]}" --out "$out" | tee -a "$out/batch.log"
fi
[ $n_ok -gt 0 ]
