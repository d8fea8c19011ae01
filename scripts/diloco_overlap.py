"""Step time of DiLoCo, synchronous vs Streaming DiLoCo's overlap (``delay``), on N CPU ranks.

Each configuration trains the same MLP with AdamW on random data for ``--steps`` inner steps
on every rank (gloo, loopback, one thread per rank) and reports rank 0's median wall time of
a step, of the steps that start or land a synchronization, and of the others (medians: a
shared machine's noise is one-sided), plus the bytes sent (``sync()`` at the end included).
Loopback is fast and the ranks share the machine's cores with gloo's threads, so this shows
what overlapping costs or saves here, not on a slow network (see scripts/cluster.sh for that).

    python scripts/diloco_overlap.py --steps 96 --hidden 1024
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn


def _configs(args):
    out = []
    for comp in args.compression:
        for frags, delay in ((1, 0), (args.fragments, 0), (args.fragments, args.delay)):
            out.append((comp, frags, delay))
    return out


def _model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 256))


def _run(rank: int, world: int, comp: str, frags: int, delay: int, args) -> dict:
    from bitscom.diloco import DiLoCo, DiLoCoConfig
    model = _model(args.hidden)
    opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-3), model.named_parameters(),
                 sync_every=args.sync_every, fragments=frags, delay=delay,
                 compression=None if comp == "none" else comp)
    cfg = DiLoCoConfig(args.sync_every, fragments=frags, delay=delay)
    g = torch.Generator().manual_seed(rank)
    busy, quiet = [], []
    for t in range(1, args.steps + 1):
        x = torch.randn(args.batch, 256, generator=g)
        start = time.perf_counter()
        nn.functional.mse_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
        took = time.perf_counter() - start
        if t > args.sync_every:                     # the first interval warms caches up
            (busy if cfg.due(t) or cfg.lands(t) else quiet).append(took)
    opt.sync()
    return {"step": statistics.median(busy + quiet), "busy": statistics.median(busy) if busy else 0.0,
            "quiet": statistics.median(quiet) if quiet else 0.0,
            "bytes": opt.comm_stats()["bytes_sent"]}


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import bitscom
    bitscom.init()
    try:
        for comp, frags, delay in _configs(args):
            res = _run(rank, world, comp, frags, delay, args)
            if rank == 0:
                queue.put((comp, frags, delay, res))
    finally:
        bitscom.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sync-every", type=int, default=8)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--delay", type=int, default=2)
    p.add_argument("--compression", nargs="+", default=["none", "lowbit"])
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    rows = [queue.get(timeout=1800) for _ in _configs(args)]
    for proc in procs:
        proc.join()
    params = sum(q.numel() for q in _model(args.hidden).parameters())
    print(f"{args.world} ranks, {params / 1e6:.2f}M parameters, H={args.sync_every}, {args.steps} steps, "
          f"batch {args.batch}; ms per step (median over the steps after the first interval)")
    print(f"{'compression':>11} {'F':>2} {'delay':>5} {'all':>8} {'sync steps':>10} {'other':>8} {'bytes':>12}")
    for comp, frags, delay, r in rows:
        print(f"{comp:>11} {frags:>2} {delay:>5} {r['step'] * 1e3:8.2f} {r['busy'] * 1e3:10.2f} "
              f"{r['quiet'] * 1e3:8.2f} {r['bytes']:12d}")
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
