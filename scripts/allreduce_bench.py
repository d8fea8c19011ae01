#!/usr/bin/env python3
"""Raw torch.distributed all_reduce bandwidth, to check what a (emulated) network delivers.

Run it under any launcher that sets torchrun-style variables, e.g. on the emulated cluster::

    python scripts/cluster.py run --nodes 2 --bandwidth 1gbit -- python scripts/allreduce_bench.py

Reports, per message size, the mean time of one all_reduce, the algorithm bandwidth
(size / time) and the bus bandwidth (size * 2(n-1)/n / time, the bytes each rank pushes
through its link per second for a ring all-reduce; nccl-tests' definition). On a link of R bit/s
per direction the bus bandwidth should approach R.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="1,16,64", help="comma-separated message sizes in MB (fp32)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--expect-gbit", type=float, default=None,
                    help="fail (exit 3) unless the largest size's bus bandwidth is within --tol of this")
    ap.add_argument("--tol", type=float, default=0.25, help="relative tolerance for --expect-gbit")
    ap.add_argument("--json", default=None, help="rank 0 writes the results here")
    a = ap.parse_args(argv)

    dist.init_process_group(a.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for mb in [float(s) for s in a.sizes_mb.split(",")]:
        numel = int(mb * 1e6 / 4)
        x = torch.ones(numel)
        for _ in range(a.warmup):
            dist.all_reduce(x)
        dist.barrier()
        times = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        # the slowest rank sets the pace
        t = torch.tensor([sum(times) / len(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        t = t.item()
        nbytes = numel * 4
        algbw = nbytes / t
        busbw = algbw * 2 * (n - 1) / n
        rows.append({"size_mb": mb, "time_ms": t * 1e3, "algbw_gbit": algbw * 8 / 1e9,
                     "busbw_gbit": busbw * 8 / 1e9})
    if rank == 0:
        print(f"all_reduce ({a.backend}, world {n}): {os.environ.get('BITSCOM_CLUSTER', 'no emulated cluster')}")
        print(f"{'size MB':>8} {'time ms':>9} {'algbw Gbit/s':>13} {'busbw Gbit/s':>13}")
        for r in rows:
            print(f"{r['size_mb']:>8g} {r['time_ms']:>9.1f} {r['algbw_gbit']:>13.3f} {r['busbw_gbit']:>13.3f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"world_size": n, "rows": rows}, f, indent=1)
    rc = 0
    if a.expect_gbit is not None:
        got = rows[-1]["busbw_gbit"]
        if abs(got - a.expect_gbit) > a.tol * a.expect_gbit:
            if rank == 0:
                print(f"FAIL: bus bandwidth {got:.3f} Gbit/s, expected {a.expect_gbit:g} +/- {a.tol:.0%}")
            rc = 3
        elif rank == 0:
            print(f"OK: bus bandwidth {got:.3f} Gbit/s ~ {a.expect_gbit:g} Gbit/s")
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
