"""Step time of OneBitAdam's compressed steps with and without overlap=True, on N gloo ranks
of this machine (no timing in tests; this prints a table).

Both variants run in the same world, interleaved block by block (A B A B ...), so a machine
that is busy with other work slows both alike. Loopback gloo is fast, so what overlap can hide
here is the 1-bit all-reduce's own compute and latency, not a slow link.

    PYTHONPATH=. python scripts/onebit_overlap_bench.py --ranks 2 --width 1024 --layers 6 --steps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def _worker(rank, world, port, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    import bitscom
    from bitscom.onebit import OneBitAdam
    bitscom.init()
    runs = {}
    for overlap in (False, True):
        model = _model(args.width, args.layers)
        opt = OneBitAdam(model.parameters(), lr=1e-4, freeze_step=1, overlap=overlap, bucket_mb=args.bucket_mb)
        runs[overlap] = (model, opt)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    times = {False: [], True: []}
    for block in range(args.blocks):
        for overlap in (False, True):
            model, opt = runs[overlap]
            for t in range(args.steps + (2 if block == 0 else 0)):   # block 0: warm-up + freeze step
                torch.distributed.barrier()
                start = time.perf_counter()
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if block or t >= 2:
                    times[overlap].append(time.perf_counter() - start)
    if rank == 0:
        queue.put(times)
    bitscom.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    args = ap.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    times = queue.get()
    for p in procs:
        p.join()
    params = args.layers * (args.width * args.width + args.width)
    print(f"OneBitAdam compressed steps, {args.ranks} gloo ranks, {params / 1e6:.1f} M parameters, "
          f"bucket_mb={args.bucket_mb}, {len(times[False])} steps each (interleaved)")
    print("| overlap | median step (ms) | mean (ms) | min (ms) |")
    print("|---|---|---|---|")
    for overlap in (False, True):
        t = [1e3 * v for v in times[overlap]]
        print(f"| {overlap} | {statistics.median(t):.1f} | {statistics.mean(t):.1f} | {min(t):.1f} |")


if __name__ == "__main__":
    main()
