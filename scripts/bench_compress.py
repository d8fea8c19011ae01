#!/usr/bin/env python3
"""Compression compute per step, on one CPU thread (or a GPU), for a real model's buckets.

What a compressor costs in arithmetic, apart from the network: every registered compressor
at its default settings reduces the gradient buckets of a model (random gradients, the
bucket plan DistributedOptimizer would make) in a single process whose collectives *mirror*
a world of ``--world`` ranks that all hold the same data (an all-reduce multiplies by the
world size, an all-to-all returns its input, an all-gather repeats it), so every compressor
does exactly the arithmetic of a ``--world``-rank reduction and only the compute is timed.
The baseline, measured in the same run, is one copy of every bucket (the least any
reduction touches). Prints a table, writes CSV.

    python scripts/bench_compress.py --dnn bert_base --threads 1
    python scripts/bench_compress.py --dnn resnet50 --opts acpsgd powersgd lowbit
    python scripts/bench_compress.py --opts topk topk:selection=sampled   # non-default settings

Each timed step of a compressor is paired with a timed copy right before it, and ``× copy`` is
the median of the per-pair ratios: on a shared, loaded machine the load drifts between the
start of the run and the last compressor, and a single baseline measured once would carry
that drift into every ratio. ``--clock cpu`` times this process's CPU time instead of the wall
clock (one thread: what the codec itself costs, without other processes' time slices).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bitscom.buckets import plan_buckets  # noqa: E402
from bitscom.compressors import get, names  # noqa: E402
from bitscom.compressors.base import Comm, drive  # noqa: E402

DEFAULTS = {"powersgd": {"rank": 4, "start_iter": 0}, "acpsgd": {"rank": 4},
            "exclude": {"inner": "topk"}}     # a wrapper needs an inner compressor


class MirrorComm(Comm):
    """Collectives of ``world`` ranks that all hold this rank's data, computed locally.

    ``spent`` is the time (by ``clock``) of these stand-in transfers: a network does that work,
    not the codec, so the codec-only column subtracts it.
    """

    def __init__(self, world: int, clock=time.perf_counter):
        super().__init__()
        self.size, self.rank = world, 0
        self.clock, self.spent = clock, 0.0

    def _timed(self, fn):
        t = self.clock()
        fn()
        self.spent += self.clock() - t

    def all_reduce(self, tensor, op=None):
        self.count(tensor)
        self._timed(lambda: tensor.mul_(self.size))

    def all_gather(self, output, input):
        self.count(input)
        self._timed(lambda: output.view(self.size, -1).copy_(input.reshape(1, -1)))

    def all_to_all(self, output, input):
        self.count(input)
        self._timed(lambda: output.copy_(input))

    def reduce_scatter(self, output, input, op=None):
        self.count(input)
        self._timed(lambda: output.view(-1).copy_(input.view(self.size, -1)[0]).mul_(self.size))

    def broadcast(self, tensor, group_src=0):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dnn", default="bert_base", help="a model of scripts/models.py")
    ap.add_argument("--opts", nargs="*", default=None, help="compressors (default: all registered)")
    ap.add_argument("--threshold", type=float, default=25, help="fusion threshold, MB")
    ap.add_argument("--world", type=int, default=2, help="world size the collectives mirror")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall clock, or this process's CPU time (robust to other processes' load)")
    ap.add_argument("--csv", default="results/bench_compress.csv")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from models import build
    model = build(args.dnn, 1, 32).model.to(args.device)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layouts = plan_buckets(params, int(args.threshold * 2 ** 20))
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(l.numel, generator=gen).to(args.device) for l in layouts]
    flats = [g.clone() for g in grads]
    numel = sum(l.numel for l in layouts)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    clock = time.perf_counter if args.clock == "wall" else time.process_time

    def once(fn):
        sync()
        t = clock()
        fn()
        sync()
        return clock() - t

    def timed(fn, base_fn=None):
        """Median seconds of ``fn``; with ``base_fn``, also the median of the ratios of each
        timed ``fn`` to a ``base_fn`` timed right before it."""
        fn()  # warm-up (first steps allocate, compile native kernels, draw factors)
        fn()
        times, ratios = [], []
        for _ in range(args.repeat):
            b = once(base_fn) if base_fn is not None else None
            times.append(once(fn))
            if b:
                ratios.append(times[-1] / b)
        return statistics.median(times), (statistics.median(ratios) if ratios else None)

    def copy_all():
        for f, g in zip(flats, grads):
            f.copy_(g)

    base, _ = timed(copy_all)
    rows = [{"dnn": args.dnn, "world": args.world, "opt": "copy (baseline)", "ms": base * 1e3,
             "x_copy": 1.0, "params_M": numel / 1e6, "buckets": len(layouts), "clock": args.clock,
             "codec_ms": 0.0, "codec_x_copy": 0.0}]
    for name in args.opts or names():
        name, _, extra = name.partition(":")     # e.g. topk:selection=sampled
        settings = dict(DEFAULTS.get(name, {}))
        for item in filter(None, extra.split(",")):
            key, _, value = item.partition("=")
            settings[key] = float(value) if value.replace(".", "", 1).isdigit() else value
        comp = get(name, **settings)
        name += f":{extra}" if extra else ""
        states = [comp.init_state(l) for l in layouts]

        codec = []

        def step():
            """One step: the bucket copy, then the reduction; records the codec-only seconds
            (the reduction minus the stand-in transfers, which a network would do)."""
            spent = 0.0
            for l, f, g, s in zip(layouts, flats, grads, states):
                f.copy_(g)
                comm = MirrorComm(args.world, clock)
                t = clock()
                drive(comp.reduce(f, l, s, comm), comm)
                spent += clock() - t - comm.spent
            codec.append(spent)

        t, ratio = timed(step, copy_all)
        c = statistics.median(codec[2:])       # the timed steps, not the two warm-ups
        rows.append({"dnn": args.dnn, "world": args.world, "opt": name, "ms": t * 1e3,
                     "x_copy": ratio, "params_M": numel / 1e6, "buckets": len(layouts),
                     "clock": args.clock, "codec_ms": c * 1e3, "codec_x_copy": c / base})
    print(f"{args.dnn}: {numel / 1e6:.1f} M parameters in {len(layouts)} buckets of "
          f"≤{args.threshold:g} MB, world {args.world} (mirrored), {args.threads} thread(s), "
          f"device {args.device}, {args.clock} clock, median of {args.repeat} (ratios: per pair)")
    print(f"{'compressor':<18}{'ms/step':>10}{'× copy':>9}{'codec ms':>10}{'codec × copy':>14}")
    for r in rows:
        print(f"{r['opt']:<18}{r['ms']:>10.1f}{r['x_copy']:>9.1f}{r['codec_ms']:>10.1f}{r['codec_x_copy']:>14.2f}")
    os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
    new = not os.path.exists(args.csv)
    with open(args.csv, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)
    print(f"-> {args.csv}")


if __name__ == "__main__":
    main()
