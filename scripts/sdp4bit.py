#!/usr/bin/env python3
"""SDP4Bit's five groups on a small byte-level GPT trained on real text, side by side.

Groups (the seed's table): Baseline (exact sharded DP), qWD (quantized weight differences only),
TLq (two-level gradient quantization only), TLq-HS (+ Hadamard smoothing), SDP4Bit (qWD + TLq-HS),
plus DistOpt (bitscom.DistributedOptimizer, exact all-reduce, unsharded state) for step time and
memory. Every group starts from the same random init and sees the same batches; only the
communication differs.

The text is Python's own standard library source (ships with every Python, no download):
byte-level tokens, the last 10% held out for evaluation.

Run (spawns the ranks itself on 127.0.0.1, ``--local-size`` ranks per emulated node)::

    nice -n 19 python scripts/sdp4bit.py --spawn 4 --local-size 2 --steps 300 --out sdp4bit_out

or under any launcher (torchrun, the emulated cluster)::

    python scripts/cluster.py run --nodes 2 --ranks-per-node 2 --bandwidth 1gbit -- \\
        python scripts/sdp4bit.py --steps 30 --out /tmp/sdp4bit_1g

Writes ``<out>/sdp4bit.csv`` (per group and step: train loss, held-out loss, bytes, step time),
``<out>/summary.csv`` and ``<out>/sdp4bit_loss.png``; prints the summary table.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import sysconfig
import time

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bitscom  # noqa: E402

GROUPS = {
    "DistOpt": None,
    "Baseline": {},
    "qWD": {"quantized_weights": True},
    "TLq": {"quantized_gradients": True},
    "TLq-HS": {"quantized_gradients": True, "hadamard_transform": True},
    "SDP4Bit": {"quantized_weights": True, "quantized_gradients": True, "hadamard_transform": True},
}

TEXT_MODULES = ("argparse.py", "collections/__init__.py", "typing.py", "inspect.py", "ast.py",
                "dataclasses.py", "functools.py", "pathlib.py", "subprocess.py", "threading.py",
                "logging/__init__.py", "json/decoder.py", "json/encoder.py", "enum.py", "tarfile.py",
                "zipfile/__init__.py", "zipfile.py", "shutil.py", "tempfile.py", "random.py")


def load_text() -> torch.Tensor:
    """Bytes of some standard-library modules (those this Python has), as a uint8 tensor."""
    lib = sysconfig.get_paths()["stdlib"]
    chunks = []
    for rel in TEXT_MODULES:
        path = os.path.join(lib, rel)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                chunks.append(f.read())
    data = b"\n".join(chunks)
    if len(data) < 100_000:
        raise RuntimeError(f"found only {len(data)} bytes of standard-library text under {lib}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT-2-style decoder over bytes (vocab 256), random init from code."""

    def __init__(self, d=128, layers=2, heads=4, seq=64):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(seq, d).normal_(0, 0.02))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1), persistent=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos[:T]
        for b in self.blocks:
            x = b(x, self.mask[:T, :T])
        return self.head(self.ln(x))


def batch(data, step, n, seq, seed=0):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (n,), generator=g)
    idx = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return idx[:, :-1], idx[:, 1:]


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


def state_bytes(opt) -> int:
    inner = getattr(opt, "optimizer", opt)
    return sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def run_group(name, settings, args, train, held, rank, world):
    torch.manual_seed(args.seed)
    model = GPT(args.d_model, args.layers, args.heads, args.seq)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if settings is None:
        bitscom.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = bitscom.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    else:
        extra = dict(settings)
        if extra.get("quantized_gradients"):
            extra["gradient_alltoall_pipeline"] = args.pipeline
        opt = bitscom.ShardedOptimizer(inner, model.named_parameters(), **extra)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        inner, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    ex, ey = batch(held, 0, args.eval_batches, args.seq, seed=99)
    rows, times = [], []
    for step in range(args.steps):
        x, y = batch(train, step, world * args.batch, args.seq, seed=args.seed)
        lo, hi = rank * args.batch, (rank + 1) * args.batch
        t0 = time.perf_counter()
        if settings is None:
            opt.zero_grad()
        loss = loss_of(model, x[lo:hi], y[lo:hi])
        loss.backward()
        if settings is None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.clip_grad_norm_(1.0)
            opt.step()
        times.append(time.perf_counter() - t0)
        sched.step()
        held_loss = float("nan")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with torch.no_grad():
                held_loss = loss_of(model, ex, ey).item()
        st = opt.comm_stats()
        grad_b = st.get("gradient_bytes", st.get("step_bytes_sent", 0))   # per step, like the sharded groups
        weight_b = st.get("weight_bytes", 0)
        rows.append([name, step, loss.item(), held_loss, grad_b, weight_b, times[-1]])
    digest = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if world > 1:
        gathered = [torch.empty_like(digest) for _ in range(world)]
        torch.distributed.all_gather(gathered, digest)
        identical = all(torch.equal(gathered[0], g) for g in gathered)
    else:
        identical = True
    skip = min(5, len(times) - 1)
    return rows, {"group": name, "final_heldout": rows[-1][3],
                  "train_last10": statistics.mean(r[2] for r in rows[-10:]),
                  "grad_bytes": rows[-1][4], "weight_bytes": rows[-1][5],
                  "opt_state_bytes": state_bytes(opt), "step_ms": 1000 * statistics.median(times[skip:]),
                  "replicas_identical": identical,
                  "params": sum(p.numel() for p in model.parameters())}


def loss_differences(rows, reference="Baseline", smooth=10):
    """Each group's loss minus the exact run's, step by step: ``{name: (train, held_out)}``.

    The groups' losses agree to 0.01-0.2%, so their raw curves draw on top of each other; the
    difference to the exact sharded run is what a reader needs to see. ``train`` is a list of
    (step, ``smooth``-step mean of the difference), ``held_out`` a list of (step, difference) at
    the evaluated steps. Rows are ``[group, step, train loss, held-out loss or nan, ...]``.
    """
    by_name = {name: [r for r in rows if r[0] == name] for name in dict.fromkeys(r[0] for r in rows)}
    if reference not in by_name:
        raise ValueError(f"reference group {reference!r} is not in this run; groups: {list(by_name)}")
    ref = {r[1]: r for r in by_name.pop(reference)}
    out = {}
    for name, mine in by_name.items():
        pairs = [(m, ref[m[1]]) for m in mine if m[1] in ref]
        diff = [m[2] - r[2] for m, r in pairs]
        train = [(m[1], statistics.mean(diff[max(0, i - smooth + 1):i + 1])) for i, (m, _) in enumerate(pairs)]
        held = [(m[1], m[3] - r[3]) for m, r in pairs if not (math.isnan(m[3]) or math.isnan(r[3]))]
        out[name] = (train, held)
    return out


def plot(rows, path, reference="Baseline"):
    """Two panels: training and held-out loss as differences to ``reference`` (see loss_differences)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    if reference not in {r[0] for r in rows}:
        print(f"no {reference!r} group in this run: no PNG (the plot is relative to it)")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, (train, held) in loss_differences(rows, reference).items():
        a.plot([t[0] for t in train], [t[1] for t in train], label=name)
        b.plot([h[0] for h in held], [h[1] for h in held], marker="o", ms=3, label=name)
    a.set(xlabel="step", ylabel=f"train loss − {reference} (10-step mean)",
          title=f"training loss, difference to exact ({reference})")
    b.set(xlabel="step", ylabel=f"held-out loss − {reference}",
          title=f"held-out loss, difference to exact ({reference})")
    for ax in (a, b):
        ax.axhline(0.0, color="black", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args):
    torch.set_num_threads(1)
    bitscom.init()
    rank, world = bitscom.rank(), bitscom.size()
    data = load_text()
    cut = int(0.9 * data.numel())
    train, held = data[:cut], data[cut:]
    names = args.groups.split(",")
    for n in names:
        if n not in GROUPS:
            raise SystemExit(f"--groups: unknown group {n!r}; choose from {list(GROUPS)}")
    all_rows, summary = [], []
    for name in names:
        rows, s = run_group(name, GROUPS[name], args, train, held, rank, world)
        all_rows += rows
        summary.append(s)
        if rank == 0:
            print(f"[{name}] held-out {s['final_heldout']:.4f}  step {s['step_ms']:.1f} ms", flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sdp4bit.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["group", "step", "train_loss", "heldout_loss", "gradient_bytes", "weight_bytes", "step_s"])
            w.writerows(all_rows)
        base = next((s for s in summary if s["group"] == "Baseline"), summary[0])
        with open(os.path.join(args.out, "summary.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(summary[0]))
            w.writeheader()
            w.writerows(summary)
        plot(all_rows, os.path.join(args.out, "sdp4bit_loss.png"))
        print(f"\nworld {world} ({bitscom.cross_size()} nodes x {bitscom.local_size()}), "
              f"{summary[0]['params']} parameters, {args.steps} steps, {args.batch}x{args.seq} bytes per rank")
        print("| group | held-out loss | vs Baseline | train loss (last 10) | gradient B/step/rank | "
              "weight B/step/rank | opt. state B/rank | step ms (median) | replicas identical |")
        print("|---|---|---|---|---|---|---|---|---|")
        for s in summary:
            rel = (s["final_heldout"] - base["final_heldout"]) / base["final_heldout"]
            print(f"| {s['group']} | {s['final_heldout']:.4f} | {100 * rel:+.2f}% | {s['train_last10']:.4f} | "
                  f"{s['grad_bytes']} | {s['weight_bytes']} | {s['opt_state_bytes']} | {s['step_ms']:.1f} | "
                  f"{s['replicas_identical']} |")
    bitscom.shutdown()


def spawn(args):
    import multiprocessing as mp
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(args.spawn):
        env = {"RANK": str(r), "WORLD_SIZE": str(args.spawn), "LOCAL_RANK": str(r % args.local_size),
               "LOCAL_WORLD_SIZE": str(args.local_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        p = ctx.Process(target=_child, args=(env, args))
        p.start()
        procs.append(p)
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise SystemExit(f"a rank failed (exit codes {bad})")


def _child(env, args):
    os.environ.update(env)
    main(args)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spawn", type=int, default=0, help="start this many local ranks (0: use the launcher's)")
    ap.add_argument("--local-size", type=int, default=2, help="with --spawn: ranks per emulated node")
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated subset of " + ",".join(GROUPS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--pipeline", type=int, default=2, help="--gradient-alltoall-pipeline for TLq groups")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=64, help="held-out sequences per evaluation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="sdp4bit_out")
    args = ap.parse_args(argv)
    if args.spawn and args.spawn % args.local_size:
        ap.error(f"--spawn {args.spawn} is not a multiple of --local-size {args.local_size}")
    return args


if __name__ == "__main__":
    a = parse()
    if a.spawn:
        spawn(a)
    else:
        main(a)
