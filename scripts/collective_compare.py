#!/usr/bin/env python3
"""Low-bit collectives vs full precision: error and time per step, stage-2 widths, EF curves, training.

Launch with torchrun (or any launcher bitscom.init() understands)::

    torchrun --nproc_per_node 2 scripts/collective_compare.py --out-dir bench_out/collective_compare
    python -m torch.distributed.run --nproc_per_node 2 scripts/collective_compare.py

Writes CSVs (and PNGs when matplotlib is installed) into --out-dir and prints markdown tables:

1. ``steps.csv``: per step, relative error (vs the float64 sum) and time of the low-bit
   all_reduce / reduce_scatter at each width, and of the fp32 all_reduce / reduce_scatter;
2. ``stage2.csv``: the error of the two-stage all-reduce for each (stage-1, stage-2) width pair,
   and of stage 2 *alone* (stage 1 in float32), round-to-nearest and stochastic;
3. ``ef.csv``: error of the running average of outputs over steps, without/with error feedback;
4. ``train.csv``: loss per step of a small MLP trained with DistributedOptimizer + LowBit.

Inputs are gradient-like: a signal shared by all ranks plus per-rank noise, with block
magnitudes spread over four decades.
"""
from __future__ import annotations

import argparse
import csv
import os
import time

import torch
import torch.distributed as dist

import bitscom
from bitscom.collectives import (LowBitConfig, LowBitState, all_reduce_rounds, reduce_scatter_rounds)
from bitscom.compressors import LowBit
from bitscom.compressors.base import Comm, drive


def grads(step: int, rank: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    signal = torch.randn(n, generator=g)
    spread = torch.logspace(-2, 2, max(1, n // 128))[torch.randperm(max(1, n // 128), generator=g)]
    spread = spread.repeat_interleave(128)[:n]
    if spread.numel() < n:
        spread = torch.nn.functional.pad(spread, (0, n - spread.numel()), value=1.0)
    noise = torch.randn(n, generator=torch.Generator().manual_seed(seed * 7919 + step * 131 + rank + 1))
    return (signal + noise) * spread


def exact_sum(x: torch.Tensor) -> torch.Tensor:
    e = x.double()
    dist.all_reduce(e)
    return e


def rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm().clamp(min=1e-300))


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def part_steps(args, world, rank, rows):
    n = args.numel
    for step in range(args.steps):
        x = grads(step, rank, n)
        ex = exact_sum(x)
        y = x.clone()
        t = timed(lambda: dist.all_reduce(y))
        rows.append(["all_reduce", 32, 32, step, rel(y, ex), t, n * 4])
        k = n // world
        out = torch.empty(k)
        t = timed(lambda: dist.reduce_scatter_tensor(out, x[:k * world].clone()))
        rows.append(["reduce_scatter", 32, 32, step, rel(out, ex[rank * k:(rank + 1) * k]), t, k * world * 4])
        for bits in args.bits:
            cfg = LowBitConfig(bitwidth=bits, block_size=args.block_size)
            y, comm = x.clone(), Comm(None)
            st = LowBitState()
            st.step = step
            t = timed(lambda: drive(all_reduce_rounds(y, comm, cfg, st, average=False), comm))
            rows.append(["all_reduce", bits, cfg.resolved_stage2_bitwidth, step, rel(y, ex), t, comm.bytes_sent])
            out, comm = torch.empty(k), Comm(None)
            t = timed(lambda: drive(reduce_scatter_rounds(out, x[:k * world].clone(), comm, cfg), comm))
            rows.append(["reduce_scatter", bits, "-", step, rel(out, ex[rank * k:(rank + 1) * k]), t,
                         comm.bytes_sent])


def part_stage2(args, world, rank, rows):
    n = args.numel
    x = grads(0, rank, n)
    ex = exact_sum(x)
    for sr in (False, True):
        for b1 in (32,) + tuple(args.bits):
            for b2 in (1, 2, 4, 8, 16):
                cfg = LowBitConfig(bitwidth=b1, stage2_bitwidth=b2, block_size=args.block_size,
                                   stochastic_rounding=sr)
                errs = []
                for rep in range(3):
                    y = x.clone()
                    st = LowBitState()
                    st.step = rep
                    drive(all_reduce_rounds(y, Comm(None), cfg, st, average=False))
                    errs.append(rel(y, ex))
                rows.append([b1, b2, "sr" if sr else "rtn", sum(errs) / len(errs)])


def part_ef(args, world, rank, rows):
    n = args.numel // 4
    modes = {"none": {}, "legacy": {"error_feedback_mode": "legacy"},
             "legacy+stage2": {"error_feedback_mode": "legacy", "stage2_error_feedback": True},
             "ef21_plus": {"error_feedback_mode": "ef21_plus"}}
    for bits in (1, 2, 4):
        for name, kw in modes.items():
            cfg = LowBitConfig(bitwidth=bits, block_size=args.block_size, **kw)
            st = LowBitState()
            acc_y = torch.zeros(n, dtype=torch.float64)
            acc_e = torch.zeros(n, dtype=torch.float64)
            for step in range(args.ef_steps):
                # slowly drifting gradients: mostly the same signal, a little new noise each step
                x = grads(0, rank, n) + 0.1 * grads(step + 1, rank, n)
                ex = exact_sum(x)
                y = x.clone()
                drive(all_reduce_rounds(y, Comm(None), cfg, st, average=False))
                acc_y += y.double()
                acc_e += ex
                rows.append([bits, name, step, rel(y, ex), rel(acc_y, acc_e)])


def part_train(args, world, rank, rows):
    torch.manual_seed(0)
    d_in, d_out = 32, 10
    teacher = torch.nn.Linear(d_in, d_out)
    runs = {"fp32": "none", "lowbit4": LowBit(bitwidth=4), "lowbit2": LowBit(bitwidth=2),
            "lowbit2+ef": LowBit(bitwidth=2, error_feedback=True, stage2_error_feedback=True),
            "lowbit1+ef": LowBit(bitwidth=1, error_feedback=True, stage2_error_feedback=True)}
    for name, comp in runs.items():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(d_in, 64), torch.nn.Tanh(), torch.nn.Linear(64, d_out))
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                           named_parameters=model.named_parameters(), compression=comp)
        for step in range(args.train_steps):
            g = torch.Generator().manual_seed(10_000 + step * world + rank)
            xb = torch.randn(32, d_in, generator=g)
            with torch.no_grad():
                yb = teacher(xb).argmax(1)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            lt = loss.detach().clone()
            dist.all_reduce(lt)
            rows.append([name, step, float(lt) / world, opt.comm_stats()["step_bytes_sent"]])


def write(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def summarize(args, world, steps, stage2, ef, train):
    print(f"\n## Per-step error and time (world {world}, {args.numel} elements, block {args.block_size}, "
          f"{args.steps} steps, median time)\n")
    print("| op | bits | stage-2 bits | rel. error (mean) | time ms (median) | bytes sent/rank |")
    print("|---|---|---|---|---|---|")
    keys = sorted({(r[0], r[1], r[2]) for r in steps}, key=lambda k: (k[0], -k[1]))
    for op, b, b2 in keys:
        sel = [r for r in steps if (r[0], r[1], r[2]) == (op, b, b2)]
        times = sorted(r[5] for r in sel)
        print(f"| {op} | {'fp32' if b == 32 else b} | {'fp32' if b2 == 32 else b2} | "
              f"{sum(r[4] for r in sel) / len(sel):.4f} | {times[len(times) // 2]:.2f} | {sel[0][6]} |")
    print("\n## Stage-2 width: relative error of the all-reduce (rows: stage 1, columns: stage 2)\n")
    for mode in ("rtn", "sr"):
        print(f"\n{mode.upper()}:\n")
        print("| stage 1 \\ stage 2 | 1 | 2 | 4 | 8 | 16 |")
        print("|---|---|---|---|---|---|")
        for b1 in (32,) + tuple(args.bits):
            vals = {r[1]: r[3] for r in stage2 if r[0] == b1 and r[2] == mode}
            name = "fp32 (stage 2 alone)" if b1 == 32 else str(b1)
            print(f"| {name} | " + " | ".join(f"{vals[b]:.3f}" for b in (1, 2, 4, 8, 16)) + " |")
    print(f"\n## Error feedback: error of the running average after {args.ef_steps} steps "
          "(and of the last step alone)\n")
    print("| bits | mode | running-average error | last-step error |")
    print("|---|---|---|---|")
    last = {}
    for r in ef:
        last[(r[0], r[1])] = r
    for (b, mode), r in sorted(last.items()):
        print(f"| {b} | {mode} | {r[4]:.4f} | {r[3]:.4f} |")
    print(f"\n## Training loss (MLP, {args.train_steps} steps, mean of the last 10)\n")
    print("| run | final loss | bytes sent/rank/step |")
    print("|---|---|---|")
    for name in dict.fromkeys(r[0] for r in train):
        sel = [r for r in train if r[0] == name]
        print(f"| {name} | {sum(r[2] for r in sel[-10:]) / 10:.4f} | {sel[-1][3]} |")


def plot(out, steps, ef, train, bits):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: CSVs only")
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for b in (32,) + tuple(bits):
        sel = [r for r in steps if r[0] == "all_reduce" and r[1] == b]
        axes[0].plot([r[3] for r in sel], [max(r[4], 1e-9) for r in sel], label="fp32" if b == 32 else f"{b}-bit")
    axes[0].set(yscale="log", xlabel="step", ylabel="relative error", title="all_reduce error per step")
    axes[0].legend()
    for (b, mode) in sorted({(r[0], r[1]) for r in ef}):
        if b != 2:
            continue
        sel = [r for r in ef if (r[0], r[1]) == (b, mode)]
        axes[1].plot([r[2] for r in sel], [r[4] for r in sel], label=mode)
    axes[1].set(yscale="log", xlabel="step", ylabel="error of running average", title="2-bit: EF vs no EF")
    axes[1].legend()
    for name in dict.fromkeys(r[0] for r in train):
        sel = [r for r in train if r[0] == name]
        axes[2].plot([r[1] for r in sel], [r[2] for r in sel], label=name)
    axes[2].set(xlabel="step", ylabel="loss", title="training loss")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "collective_compare.png"), dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bits", default="1,2,4,8")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--ef-steps", type=int, default=40)
    ap.add_argument("--train-steps", type=int, default=120)
    ap.add_argument("--out-dir", default="bench_out/collective_compare")
    args = ap.parse_args(argv)
    args.bits = tuple(int(b) for b in args.bits.split(","))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    bitscom.init()
    world, rank = bitscom.size(), bitscom.rank()
    if world < 2:
        raise SystemExit("run with at least 2 ranks, e.g. torchrun --nproc_per_node 2 ...")
    steps, stage2, ef, train = [], [], [], []
    part_steps(args, world, rank, steps)
    part_stage2(args, world, rank, stage2)
    part_ef(args, world, rank, ef)
    part_train(args, world, rank, train)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        write(os.path.join(args.out_dir, "steps.csv"),
              ["op", "bits", "stage2_bits", "step", "rel_error", "time_ms", "bytes_sent"], steps)
        write(os.path.join(args.out_dir, "stage2.csv"), ["stage1_bits", "stage2_bits", "rounding", "rel_error"], stage2)
        write(os.path.join(args.out_dir, "ef.csv"),
              ["bits", "mode", "step", "step_rel_error", "running_avg_rel_error"], ef)
        write(os.path.join(args.out_dir, "train.csv"), ["run", "step", "loss", "bytes_sent"], train)
        summarize(args, world, steps, stage2, ef, train)
        plot(args.out_dir, steps, ef, train, args.bits)
    bitscom.shutdown()


if __name__ == "__main__":
    main()
