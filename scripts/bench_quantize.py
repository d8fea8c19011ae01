#!/usr/bin/env python
"""Throughput of quantize+pack and unpack+dequantize against the machine's own copy bandwidth.

For each size 2**10 .. 2**max_pow2 and each width, times (best of --repeat, interleaved) a preallocated
``y.copy_(x)`` of float32, ``kernels.quantize_pack`` into preallocated outputs and
``kernels.unpack_dequantize`` into a preallocated float32 output, and reports GB/s of float32
data (4 bytes/element, both directions) and the percentage of copy bandwidth at that size.
Prints a table and writes CSV and PNG (if matplotlib is installed) into --out.

    python scripts/bench_quantize.py --device cpu --threads 1 --max-pow2 24
    python scripts/bench_quantize.py --device cuda
"""
from __future__ import annotations

import argparse
import csv
import pathlib
import sys
import time

import torch

try:
    from bitscom import kernels as K
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from bitscom import kernels as K


def timer(device):
    """Returns run(fns, repeat) -> best seconds of each fn, the fns timed in turn on every repeat.

    Interleaving the copy reference with the kernels keeps their ratio honest on a machine whose
    load changes during the run (shared CI boxes)."""
    if device.type == "cuda":
        def once(fn):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            return e0.elapsed_time(e1) / 1e3
    else:
        def once(fn):
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t

    def run(fns, repeat):
        for fn in fns:
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = [float("inf")] * len(fns)
        for _ in range(repeat):
            for i, fn in enumerate(fns):
                best[i] = min(best[i], once(fn))
        return best
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--impl", default=None, choices=K.IMPLEMENTATIONS, help="default: fastest for the device")
    ap.add_argument("--bits", default="1,2,4,8")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--min-pow2", type=int, default=10)
    ap.add_argument("--max-pow2", type=int, default=26)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for the copy reference")
    ap.add_argument("--stochastic", action="store_true", help="stochastic rounding instead of RTN")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    impl = args.impl or K.implementation(device)
    bits_list = [int(b) for b in args.bits.split(",")]
    run = timer(device)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"device={device} impl={impl} block_size={args.block_size} stochastic={args.stochastic} "
          f"copy threads={args.threads if device.type == 'cpu' else '-'}")
    print(f"{'numel':>10} {'bits':>4} {'copy GB/s':>10} {'quant GB/s':>11} {'%copy':>6} {'dequant GB/s':>13} {'%copy':>6}")
    for p in range(args.min_pow2, args.max_pow2 + 1):
        n = 1 << p
        x = torch.randn(n, device=device)
        y = torch.empty_like(x)
        gb = 4 * n / 1e9
        for bits in bits_list:
            pay, scl = K.quantize_pack(x, bits, args.block_size, impl=impl)
            t_copy, t_q, t_d = run([
                lambda: y.copy_(x),
                lambda: K.quantize_pack(x, bits, args.block_size, stochastic=args.stochastic, seed=1,
                                        payload=pay, scales=scl, impl=impl),
                lambda: K.unpack_dequantize(pay, scl, n, bits, args.block_size, out=y, impl=impl)], args.repeat)
            row = dict(numel=n, bits=bits, impl=impl, copy_gbps=gb / t_copy, quant_gbps=gb / t_q,
                       dequant_gbps=gb / t_d, quant_pct_copy=100 * t_copy / t_q, dequant_pct_copy=100 * t_copy / t_d,
                       wire_bytes=K.wire_bytes(n, bits, args.block_size))
            rows.append(row)
            print(f"{n:>10} {bits:>4} {row['copy_gbps']:>10.2f} {row['quant_gbps']:>11.2f} "
                  f"{row['quant_pct_copy']:>5.0f}% {row['dequant_gbps']:>13.2f} {row['dequant_pct_copy']:>5.0f}%")
    tag = f"bench_quantize_{device.type}_{impl}{'_sr' if args.stochastic else ''}"
    csv_path = out_dir / f"{tag}.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {csv_path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the PNG (pip install matplotlib)")
        return rows
    fig, ax = plt.subplots(figsize=(8, 5))
    sizes = sorted({r["numel"] for r in rows})
    ax.plot(sizes, [next(r["copy_gbps"] for r in rows if r["numel"] == s) for s in sizes], "k--", label="copy")
    for bits in bits_list:
        rs = [r for r in rows if r["bits"] == bits]
        ax.plot([r["numel"] for r in rs], [r["quant_gbps"] for r in rs], "-o", ms=3, label=f"quantize+pack {bits}b")
        ax.plot([r["numel"] for r in rs], [r["dequant_gbps"] for r in rs], ":s", ms=3, label=f"unpack+dequant {bits}b")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("elements (float32)")
    ax.set_ylabel("GB/s of float32 data")
    ax.set_title(f"bitscom kernels on {device.type} ({impl}), block {args.block_size}")
    ax.legend(fontsize=7, ncol=2)
    png = out_dir / f"{tag}.png"
    fig.savefig(png, dpi=120, bbox_inches="tight")
    print(f"wrote {png}")
    return rows


if __name__ == "__main__":
    main()
