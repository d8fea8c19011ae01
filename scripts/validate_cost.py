#!/usr/bin/env python3
"""Predicted vs measured step time: does the calibrated cost model (bitscom.cost) hold?

Per compressor, on every rank of a running job (torchrun, or ``scripts/cluster.py launch``):

1. measure forward, backward and optimizer time of the model with no communication;
2. calibrate: a short all-reduce probe of the world group (flat) or of the intra- and
   inter-node groups (``--hier``), least-squares alpha/beta (bitscom.cost.calibrate_link);
3. time each bucket's codec on this device (bitscom.cost.time_codec);
4. predict the step (bitscom.cost.predict_step: buckets ready in proportion to their elements
   during backward, rounds one bucket after another);
5. measure the step (median of ``--steps`` steps after the compressor's warm-up, the slowest
   rank's median);

rank 0 prints a table and appends CSV rows (``--csv``). The sweep the lead re-runs on an idle
machine (root, iproute2), every cell of issue 22's table::

    for bw in 1gbit 10gbit; do for shape in "2 1" "4 1" "2 2" "8 1" "2 4"; do set -- $shape
      python scripts/cluster.py run --nodes $1 --ranks-per-node $2 --bandwidth $bw -- \\
        .venv/bin/python scripts/validate_cost.py --bandwidth $bw --csv validate_cost.csv \\
        $( [ $2 -gt 1 ] && echo --hier )
    done; done

Without a launcher, ``--spawn N`` starts N local ranks over loopback (a smoke test: loopback
is no network, so the model's fit is tested, not a cluster).
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bitscom  # noqa: E402
from bitscom.compressors import get  # noqa: E402
from bitscom.cost import (Topology, calibrate_link, predict_step, ready_times, rounds_for,  # noqa: E402
                          time_codec)

COMPRESSORS = ["none", "fp16", "bf16", "lowbit", "powersgd", "acpsgd", "topk", "signsgd"]


def model_for(args):
    torch.manual_seed(0)
    layers, d = [], args.width
    for _ in range(args.layers):
        layers += [torch.nn.Linear(d, d), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(d, 10))


def batch(args, step):
    g = torch.Generator().manual_seed(step * 7919 + dist.get_rank())
    return torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)


def compute_times(args):
    """(forward, backward, optimizer) seconds of one step with no communication, every rank
    computing at the same time (a barrier before each step) as they do in a real step: with
    more ranks than cores, ranks timed one after another measured half the 4-rank step."""
    model = model_for(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fw, bw, op = [], [], []
    for step in range(args.steps + 2):
        dist.barrier()
        x, y = batch(args, step)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if step >= 2:
            fw.append(t1 - t0), bw.append(t2 - t1), op.append(t3 - t2)
    return statistics.median(fw), statistics.median(bw), statistics.median(op)


def compressor_for(name, args):
    if name == "lowbit" and args.hier:
        return get("lowbit", hierarchy="two_level", intra_bitwidth=8, intra_group=bitscom.intra_group(),
                   inter_group=bitscom.inter_group())
    return get(name)


def cpu_busy():
    """(busy, total) jiffies of the whole machine (Linux /proc/stat; (0, 0) elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def measure(name, args):
    model = model_for(args)
    comp = compressor_for(name, args)
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                       compression=comp, fusion_threshold_mb=args.fusion_mb)
    warm = getattr(comp, "start_iter", 0) + 2
    times = []
    for step in range(warm + args.steps):
        if step == warm:
            dist.barrier()
        t0 = time.perf_counter()
        x, y = batch(args, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step >= warm:
            times.append(time.perf_counter() - t0)
    # each rank's median step (robust to one descheduled step), the slowest rank's reported
    measured = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    layouts = list(opt._layouts)
    opt.close()
    return comp, layouts, float(measured)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressors", default=",".join(COMPRESSORS))
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fusion-mb", type=float, default=4.0)
    p.add_argument("--hier", action="store_true", help="calibrate intra/inter links; lowbit two_level")
    p.add_argument("--bandwidth", default="", help="label for the table (the cluster's shaping)")
    p.add_argument("--csv", default=None)
    p.add_argument("--spawn", type=int, default=0, help="start N local ranks (no launcher)")
    p.add_argument("--codec-overlaps", choices=["auto", "yes", "no"], default="auto",
                   help="does the codec run beside backward? auto: yes on CUDA (its own stream), "
                        "no on CPU (backward's threads hold the cores)")
    args = p.parse_args(argv)
    if args.spawn and "RANK" not in os.environ:
        return spawn(args, argv)
    bitscom.init()
    world, rank, local = dist.get_world_size(), dist.get_rank(), bitscom.local_size()
    forward_s, backward_s, optimizer_s = compute_times(args)
    busy0, total0 = cpu_busy()
    if args.hier and local > 1:
        topo = Topology(world, local, calibrate_link(bitscom.intra_group()), calibrate_link(bitscom.inter_group()),
                        world_link=calibrate_link())
    else:
        link = calibrate_link()
        topo = Topology.flat(world, link) if not args.hier else Topology(world, local, link, link)
    busy1, total1 = cpu_busy()
    # how much of the machine the link probe alone kept busy: on the emulated cluster the
    # "network" is the kernel moving bytes between namespaces, on the cores that also compute
    probe_cpu = round((busy1 - busy0) / max(1, total1 - total0), 2)
    overlaps = {"yes": True, "no": False}.get(args.codec_overlaps, torch.cuda.is_available())
    rows = []
    for name in args.compressors.split(","):
        comp, layouts, measured = measure(name, args)
        rounds = [rounds_for(comp, lay.numel, world, local_size=local, dtype=lay.dtype,
                             shapes=[s.shape for s in lay.slots]) for lay in layouts]
        codec = []
        for lay in layouts:      # every rank at once, the median run: contention is part of the cost
            dist.barrier()
            codec.append(time_codec(comp, lay, world, with_copies=True, repeats=5,
                                    statistic=statistics.median))
        numels = [lay.numel for lay in layouts]
        slots = [s.numel for lay in layouts for s in lay.slots]      # one gradient hook per slot
        pred = predict_step(rounds, topo, forward_s=forward_s, backward_s=backward_s, optimizer_s=optimizer_s,
                            ready_s=ready_times(numels, backward_s), codec_s=codec, codec_overlaps=overlaps,
                            poll_s=ready_times(slots, backward_s))
        rows.append(dict(bandwidth=args.bandwidth, world=world, local_size=local, compressor=name,
                         predicted_ms=round(pred.step_s * 1e3, 2), measured_ms=round(measured * 1e3, 2),
                         error_pct=round(100 * (pred.step_s - measured) / measured, 1),
                         compute_ms=round((forward_s + backward_s + optimizer_s) * 1e3, 2),
                         comm_ms=round(pred.comm_s * 1e3, 2), codec_ms=round(pred.codec_s * 1e3, 2),
                         overlaps=overlaps, alpha_us=round(topo.inter.alpha_s * 1e6, 1), gbit=round(topo.inter.gbit, 3),
                         flat_gbit=round(topo.level("flat")[1].gbit, 3),
                         probe_cpu=probe_cpu, load=round(os.getloadavg()[0], 2)))
    if rank == 0:
        report(rows, args)
    bitscom.shutdown()
    return 0


def report(rows, args):
    keys = list(rows[0])
    print(" ".join(f"{k:>12}" for k in keys))
    for r in rows:
        print(" ".join(f"{str(r[k]):>12}" for k in keys))
    if args.csv:
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.DictWriter(f, keys)
            if new:
                w.writeheader()
            w.writerows(rows)
    print("re-run: " + " ".join([sys.executable] + sys.argv), flush=True)


def spawn(args, argv):
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(args.spawn):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.spawn), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(args.spawn), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)] + list(argv or sys.argv[1:]),
                                      env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
