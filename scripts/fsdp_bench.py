#!/usr/bin/env python3
"""Exact vs compressed FSDP2 / HSDP on a small GPT: held-out loss and bytes per step.

Groups (same init, same batches; only what is compressed differs). On a 2-D mesh (HSDP, e.g.
``--mesh 2x2``):

* ``exact``: stock FSDP2 native HSDP (``fully_shard`` on the 2-D mesh, FSDP's own float32
  all-reduce across the replicate dimension);
* ``hsdp4ef``: ``fully_shard`` on ``mesh["shard"]`` + ``bitscom.fsdp.compress(replicate_group=...)``:
  the same exact reduce-scatter inside a node, the replicate all-reduce in 4 bits + error feedback;
* ``hsdp4``: the same without error feedback.

On a 1-D mesh (plain FSDP2, ``--mesh 1x2``): ``exact`` is stock FSDP2; ``w8`` sends the parameter
all-gather in 8-bit blocks (qwZ), ``wd4`` as 4-bit weight differences (SDP4Bit qWD), both with
FSDP's exact reduce-scatter; ``g4w8`` adds the 4-bit reduce-scatter with error feedback.

Bytes per step: ``inter_bytes`` is what :class:`bitscom.comm.Comm` counted for the replicate hop
(for ``exact`` the float32 baseline: 4 bytes x the reduce-scattered shard, bitscom's
``dense_bytes`` convention); ``all_gather_bytes`` the same for the weights. ``wire_tx_bytes`` is
an independent count: what each node's NIC transmitted (``/proc/net/dev``, on the emulated
cluster only), i.e. gloo's real traffic with TCP/IP headers. Run under any launcher::

    python scripts/cluster.py run --nodes 2 --ranks-per-node 2 --bandwidth 1gbit -- \\
        python scripts/fsdp_bench.py --mesh 2x2 --steps 300 --seed 0 --out /tmp/hsdp_bench
    python scripts/cluster.py run --nodes 2 --ranks-per-node 1 --bandwidth 1gbit -- \\
        python scripts/fsdp_bench.py --mesh 1x2 --groups exact,w8,wd4,g4w8 --steps 300 --out /tmp/fsdp_bench

or ``python -m torch.distributed.run --nproc_per_node 4 scripts/fsdp_bench.py --steps 5 --dim 32``
(a smoke run). ``--dim 512 --layers 8`` (default) is about 25M parameters. Writes
``<out>/fsdp_bench.csv`` and prints one summary line per group.
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

GROUPS = {"exact": ["--replicate", "exact"], "hsdp4ef": ["--replicate", "4"],
          "hsdp4": ["--replicate", "4", "--no-ef"],
          "w8": ["--weights", "blockwise"], "wd4": ["--weights", "difference"],
          "g4w8": ["--weights", "blockwise", "--grad-bits", "4"]}


def _shard_numel(model, shards: int) -> int:
    """Elements of every module's reduce-scattered shard (dim 0 padded to the shard count)."""
    n = 0
    for p in model.parameters():
        rows = -(-p.shape[0] // shards) * shards
        n += rows * (p.numel() // p.shape[0]) // shards
    return n


def _wire_tx_bytes() -> int:
    """Bytes this node's NIC has transmitted (the veth named by ``GLOO_SOCKET_IFNAME`` in
    ``/proc/net/dev``, read by local rank 0 only); 0 off the emulated cluster.

    An independent count of the inter-node traffic: it includes whatever the collectives
    really put on the wire (gloo's ring, TCP/IP headers), not bitscom's own bookkeeping."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if not ifname or os.environ.get("LOCAL_RANK", "0") != "0":
        return 0
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])
    return 0


def run_group(name: str, args) -> dict:
    argv = ["--mesh", args.mesh, "--dim", str(args.dim), "--layers", str(args.layers),
            "--steps", "0", "--lr", str(args.lr), "--seed", str(args.seed)] + GROUPS[name]
    opts = hsdp_gpt.parser().parse_args(argv)
    model, handle, opt = hsdp_gpt.build(opts)
    rank, shards = dist.get_rank(), hsdp_gpt.parse_mesh(args.mesh)[1]
    dist.barrier()
    tx0 = _wire_tx_bytes()
    start = time.perf_counter()
    curve = []
    for step in range(args.steps):
        x, y = hsdp_gpt.batch(step, rank)
        loss = nn.functional.cross_entropy(model(x).float().reshape(-1, hsdp_gpt.VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.curve_every and (step + 1) % args.curve_every == 0:
            mean = loss.detach().clone()
            dist.all_reduce(mean)                          # every rank's batch, as the held-out loss
            curve.append({"group": name, "seed": args.seed, "step": step + 1,
                          "train_loss": round(float(mean) / dist.get_world_size(), 5)})
    dist.barrier()
    seconds = (time.perf_counter() - start) / max(1, args.steps)
    wire = torch.tensor([_wire_tx_bytes() - tx0], dtype=torch.int64)
    dist.all_reduce(wire)                                  # summed over the nodes' NICs
    nodes = dist.get_world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    loss = hsdp_gpt.held_out(model, rank)
    s = handle.comm_stats() if handle is not None else {}
    if "inter_node_bytes" in s:
        inter, inter_dense = s["inter_node_bytes"], s["inter_node_dense_bytes"]
    elif hsdp_gpt.parse_mesh(args.mesh)[0] > 1:
        inter = inter_dense = 4 * _shard_numel(model, shards) * args.steps
    else:                                                  # plain FSDP2: no replicate hop
        inter = inter_dense = 0
    steps = max(1, args.steps)
    return {"group": name, "seed": args.seed, "mesh": args.mesh, "params": sum(p.numel() for p in model.parameters()),
            "steps": args.steps, "held_out_loss": round(loss, 4), "inter_bytes_per_step": inter // steps,
            "inter_fp32_bytes_per_step": inter_dense // steps,
            "all_gather_bytes_per_step": s.get("all_gather_bytes_sent", 0) // steps,
            "all_gather_fp_bytes_per_step": s.get("all_gather_dense_bytes", 0) // steps,
            "wire_tx_bytes_per_node_step": int(wire.item()) // nodes // steps, "seconds_per_step": round(seconds, 4),
            "curve": curve}


def _write_csv(path: str, rows: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0, help="model initialization seed (the batches do not depend on it)")
    ap.add_argument("--groups", default="exact,hsdp4ef", help=f"comma-separated, of {sorted(GROUPS)}")
    ap.add_argument("--curve-every", type=int, default=10,
                    help="record the mean training loss every this many steps (timed in; 0 = never)")
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
        curves = [point for r in rows for point in r.pop("curve")]
        for r in rows:
            print(" ".join(f"{k}={v}" for k, v in r.items()), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            _write_csv(os.path.join(args.out, "fsdp_bench.csv"), rows)
            if curves:
                _write_csv(os.path.join(args.out, "fsdp_curve.csv"), curves)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
    bitscom.shutdown()
