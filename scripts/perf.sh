#!/usr/bin/env bash
# One benchmark run: knobs as environment variables (the ACP-SGD seed's style), e.g.
#
#   opt=acpsgd rank=4 dnn=resnet50 bs=64 nworkers=2 bash scripts/perf.sh
#   opt=ssgd dnn=bert_base bs=1 seq_len=32 nworkers=2 bandwidth=1gbit bash scripts/perf.sh
#   opt=fp16 dnn=tiny nsteps=5 bash scripts/perf.sh           # quick
#
# Knobs (default):
#   opt (ssgd)        ssgd | ddp_fp16 | ddp_powersgd | ddp_<bitscom name> | <bitscom name>:
#                     none fp16 bf16 lowbit powersgd acpsgd topk signsgd ... | onebitadam | diloco
#   sync_every (8)    diloco: inner steps per synchronization (Streaming: 2 fragments, delay 2)
#   rank (4)          PowerSGD / ACP-SGD rank          bits (4)    lowbit bits per element
#   ratio (0.01)      topk kept fraction               threshold (25) fusion / DDP bucket MB
#   dnn (resnet50)    resnet50 resnet152 vgg16 bert_base bert_large gpt2 | tiny bert_tiny
#   bs (32)           batch size per rank              seq_len (128) tokens (transformers)
#   nworkers (total slots in envs.conf hosts, i.e. 2 here)
#   bandwidth ()      e.g. 1gbit, 10gbit: run on the emulated cluster (root + iproute2),
#                     one namespace per node, links shaped with tc tbf; empty = no shaping
#   ranks_per_node (1) emulated cluster: ranks sharing a namespace (fast intra-node path)
#   cluster (0)       1 = use the emulated cluster even without shaping
#   nsteps (10) warmup (3) compute_steps (2)   timed / untimed / no-communication steps
#   csv (results/perf.csv)   the CSV a row is appended to      timeout (900) seconds
#   device (auto)     auto | cpu | cuda
# Extra arguments go to scripts/perf.py (see: python scripts/perf.py --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$ROOT"

opt=${opt:-ssgd}; dnn=${dnn:-resnet50}; bs=${bs:-32}; rank=${rank:-4}; bits=${bits:-4}
ratio=${ratio:-0.01}; threshold=${threshold:-25}; nsteps=${nsteps:-10}; warmup=${warmup:-3}
seq_len=${seq_len:-128}; compute_steps=${compute_steps:-2}; device=${device:-auto}
nworkers=${nworkers:-$(total_slots)}; bandwidth=${bandwidth:-}; ranks_per_node=${ranks_per_node:-1}
csv=${csv:-$ROOT/results/perf.csv}; timeout=${timeout:-900}; cluster=${cluster:-0}
sync_every=${sync_every:-8}
[ "$bandwidth" = none ] && bandwidth=""

case "$dnn" in bert*|gpt*) ensure_deps transformers ;; *) ensure_deps ;; esac

args=(--opt "$opt" --dnn "$dnn" --bs "$bs" --rank "$rank" --bits "$bits" --ratio "$ratio"
      --threshold "$threshold" --nsteps "$nsteps" --warmup "$warmup" --seq-len "$seq_len"
      --compute-steps "$compute_steps" --device "$device" --csv "$csv" --bandwidth "${bandwidth:-none}"
      --sync-every "$sync_every")

# fail fast (exit 2, a CSV row with status=unavailable) when this build lacks the compressor
"$PY" "$ROOT/scripts/perf.py" "${args[@]}" --check-only "$@"

if [ -n "$bandwidth" ] || [ "$cluster" = 1 ]; then
    if [ $((nworkers % ranks_per_node)) -ne 0 ]; then
        echo "nworkers=$nworkers is not a multiple of ranks_per_node=$ranks_per_node" >&2; exit 2
    fi
    exec "$PY" "$ROOT/scripts/cluster.py" run --nodes $((nworkers / ranks_per_node)) \
        --ranks-per-node "$ranks_per_node" --bandwidth "${bandwidth:-none}" --timeout "$timeout" -- \
        "$PY" "$ROOT/scripts/perf.py" "${args[@]}" "$@"
fi
launch "$nworkers" "$ROOT/scripts/perf.py" "${args[@]}" "$@"
