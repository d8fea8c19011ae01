#!/usr/bin/env python3
"""Exact vs compressed HSDP on a small GPT: held-out loss and inter-node bytes per step.

Groups (same init, same batches; only the inter-node hop differs):

* ``exact``: stock FSDP2 native HSDP (``fully_shard`` on the 2-D mesh, FSDP's own float32
  all-reduce across the replicate dimension);
* ``hsdp4ef``: ``fully_shard`` on ``mesh["shard"]`` + ``bitscom.fsdp.compress(replicate_group=...)``:
  the same exact reduce-scatter inside a node, the replicate all-reduce in 4 bits + error feedback;
* ``hsdp4``: the same without error feedback.

Inter-node bytes per step: for the bitscom groups what :class:`bitscom.comm.Comm` counted;
for ``exact`` the float32 baseline of the same all-reduces (4 bytes x the reduce-scattered
shard, bitscom's ``dense_bytes`` convention; a ring all-reduce puts about 2(R-1)/R times that
on the wire). Run under any launcher, e.g. the emulated cluster::

    python scripts/cluster.py run --nodes 2 --ranks-per-node 2 --bandwidth 1gbit -- \\
        python scripts/fsdp_bench.py --mesh 2x2 --dim 512 --layers 8 --steps 300 --out /tmp/hsdp_bench

or ``python -m torch.distributed.run --nproc_per_node 4 scripts/fsdp_bench.py --steps 5 --dim 32``
(a smoke run). ``--dim 512 --layers 8`` is about 25M parameters. Writes ``<out>/fsdp_bench.csv``
and prints one summary line per group.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import hsdp_gpt  # noqa: E402

import bitscom  # noqa: E402

GROUPS = {"exact": "exact", "hsdp4ef": "4", "hsdp4": "4"}


def _shard_numel(model, shards: int) -> int:
    """Elements of every module's reduce-scattered shard (dim 0 padded to the shard count)."""
    n = 0
    for p in model.parameters():
        rows = -(-p.shape[0] // shards) * shards
        n += rows * (p.numel() // p.shape[0]) // shards
    return n


def run_group(name: str, args) -> dict:
    argv = ["--mesh", args.mesh, "--replicate", GROUPS[name], "--dim", str(args.dim), "--layers", str(args.layers),
            "--steps", "0", "--lr", str(args.lr)] + (["--no-ef"] if name == "hsdp4" else [])
    opts = hsdp_gpt.parser().parse_args(argv)
    model, handle, opt = hsdp_gpt.build(opts)
    rank, shards = dist.get_rank(), hsdp_gpt.parse_mesh(args.mesh)[1]
    dist.barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = hsdp_gpt.batch(step, rank)
        nn.functional.cross_entropy(model(x).float().reshape(-1, hsdp_gpt.VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    seconds = (time.perf_counter() - start) / max(1, args.steps)
    loss = hsdp_gpt.held_out(model, rank)
    if handle is not None:
        s = handle.comm_stats()
        inter, inter_dense = s["inter_node_bytes"], s["inter_node_dense_bytes"]
    else:
        inter = inter_dense = 4 * _shard_numel(model, shards) * args.steps
    steps = max(1, args.steps)
    return {"group": name, "mesh": args.mesh, "params": sum(p.numel() for p in model.parameters()),
            "steps": args.steps, "held_out_loss": round(loss, 4), "inter_bytes_per_step": inter // steps,
            "inter_fp32_bytes_per_step": inter_dense // steps, "seconds_per_step": round(seconds, 4)}


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--groups", default="exact,hsdp4ef", help=f"comma-separated, of {sorted(GROUPS)}")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    groups = [g for g in args.groups.split(",") if g]
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise SystemExit(f"--groups: unknown {bad}; choose from {sorted(GROUPS)}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    bitscom.init()
    rows = [run_group(g, args) for g in groups]
    if dist.get_rank() == 0:
        for r in rows:
            print(" ".join(f"{k}={v}" for k, v in r.items()), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "fsdp_bench.csv"), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
    bitscom.shutdown()
