#!/usr/bin/env bash
# One-shot GPU check of the low-bit kernels, for a session on a machine with an NVIDIA GPU:
# installs CuPy (with NVRTC from the CUDA wheels) if missing, runs the GPU tests (CUDA bytes ==
# torch bytes for RTN and SR, stream use, speed sanity), the quantize benchmark on the device,
# every compressor's compute on ResNet-50 buckets, a one-GPU NCCL training run (offline), and
# the newer faces' paths (scripts/gpu_paths_check.py: 1-bit overlap, streaming DiLoCo, FSDP2 hooks).
# Usage: bash scripts/gpu_check.sh [results-dir]     (from the repository root)
set -euo pipefail
out="${1:-results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_check_device.txt"
python -c "import cupy" 2>/dev/null || pip install "cupy-cuda13x[ctk]" || pip install cupy-cuda13x
python - <<'PY'
import torch, cupy
from bitscom import kernels as K
print("torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__,
      "impl", K.implementation("cuda"))
PY
python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_quantization.py \
    tests/test_quant_cuda_emulation.py 2>&1 | tee "$out/gpu_check_tests.txt"
python scripts/bench_quantize.py --device cuda --max-pow2 28 --repeat 20 --out "$out" 2>&1 \
    | tee "$out/gpu_check_bench.txt"
python scripts/bench_quantize.py --device cuda --min-pow2 20 --max-pow2 28 --repeat 20 --stochastic \
    --out "$out" 2>&1 | tee -a "$out/gpu_check_bench.txt"
# Every compressor's arithmetic on the GPU (CuPy kernels for lowbit), ResNet-50 buckets, vs a copy
python scripts/bench_compress.py --device cuda --dnn resnet50 --repeat 10 --csv "$out/bench_compress_cuda.csv" 2>&1 \
    | tee "$out/gpu_check_compress.txt"
# The NCCL path end to end on one GPU (world size 1: init, device placement, optimizer plumbing;
# synthetic data, since the GPU machine has no network)
python -m torch.distributed.run --standalone --nproc_per_node 1 scripts/perf.py --opt acpsgd --dnn resnet50 \
    --bs 32 --nsteps 5 --warmup 2 --device cuda --csv "$out/perf_cuda.csv" 2>&1 | tail -n 6 | tee "$out/gpu_check_perf.txt"
echo "GPU target: quant and dequant %copy >= 60 at 2^26..2^28 elements (README, 'Low-bit format and kernels')"
# AMP with CUDA fp16 autocast + GradScaler through DistributedOptimizer (issue 9), and the
# sharded path's kernels (ShardedOptimizer uses the same quantize/pack kernels tested above).
# One GPU hosts one NCCL rank; a multi-rank CUDA run needs >= 2 GPUs.
python -m torch.distributed.run --standalone --nproc_per_node 1 scripts/gpu_amp_check.py 2>&1 \
    | tail -n 3 | tee "$out/gpu_check_amp.txt"
# The newer faces on the device (issue 34): OneBitAdam/ZeroOneAdam overlap bitwise == no overlap,
# streaming DiLoCo (replicas identical, delayed rule, same bytes), FSDP2's reduce-scatter and
# all-gather hooks (float32 wire bitwise == stock FSDP2; 4-bit grads + 8-bit weights train).
# One rank per GPU: with one GPU the collectives are world-size-1, the kernels and hooks are real.
ngpu=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
python -m torch.distributed.run --standalone --nproc_per_node "$ngpu" scripts/gpu_paths_check.py --device cuda 2>&1 \
    | grep -v "^W[0-9]" | tee "$out/gpu_check_paths.txt"
