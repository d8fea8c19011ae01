#!/usr/bin/env python3
"""The newer faces' paths on one device: 1-bit overlap, streaming DiLoCo, the FSDP2 hooks.

``scripts/gpu_check.sh`` runs it on a lent GPU (one NCCL rank per GPU); CI runs the same checks
on 2 gloo CPU ranks (tests/test_gpu_paths_check.py), so what a GPU session checks is the code CI
keeps green. Every check compares against a reference computed in the same run on the same
device, never against a stored number:

* ``onebit``: OneBitAdam and ZeroOneAdam with ``overlap=True`` (the 1-bit all-reduce leaves from
  the gradient hooks) give bitwise the parameters of ``overlap=False``.
* ``diloco``: streaming DiLoCo (``fragments=2, delay=1``) keeps replicas bitwise identical,
  sends the bytes of ``delay=0`` and applies the delayed rule (a result other than ``delay=0``'s).
* ``fsdp``: ``bitscom.fsdp.compress(gradients=32)`` (float32 on the wire) gives bitwise stock
  FSDP2's parameters; 4-bit gradients with 8-bit weights train (finite loss) with replicas
  identical.

Prints one line per check with its median step time, and exits non-zero on the first failure::

    python -m torch.distributed.run --standalone --nproc_per_node 1 scripts/gpu_paths_check.py
    python -m torch.distributed.run --standalone --nproc_per_node 2 scripts/gpu_paths_check.py --device cpu
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import bitscom

STEPS = 12


def _model(dev, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(dev)


def _batch(step, dev):
    g = torch.Generator().manual_seed(1000 * step + bitscom.rank())
    x = torch.randn(16, 32, generator=g)
    return x.to(dev), torch.sin(x[:, :8]).to(dev)


def _train(model, opt, dev, steps=STEPS, zero_first=True):
    """Plain loop; returns the median step time (s) and the last loss."""
    times, loss = [], torch.tensor(0.0)
    for step in range(steps):
        x, y = _batch(step, dev)
        t = time.perf_counter()
        if zero_first:
            opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), float(loss.detach())


def _params(model):
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def _replicas_identical(vec):
    """Every rank's vector equals rank 0's, bit for bit."""
    ref = vec.clone().to(bitscom.runtime.device())
    dist.broadcast(ref, 0)
    same = torch.tensor([int(torch.equal(ref.cpu(), vec))], device=ref.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def _report(name, ok, step_s, detail=""):
    if bitscom.rank() == 0:
        print(f"{name:<28} {'ok' if ok else 'FAILED':<7} median step {step_s * 1e3:8.2f} ms  {detail}", flush=True)
    if not ok:
        raise SystemExit(f"gpu_paths_check: {name} failed {detail}")


def check_onebit(dev):
    for cls, kw in ((bitscom.OneBitAdam, dict(freeze_step=3)),
                    (bitscom.ZeroOneAdam, dict(var_freeze_step=4, local_step_scaler=4))):
        out = {}
        for overlap in (False, True):
            model = _model(dev)
            opt = cls(model.parameters(), lr=1e-2, overlap=overlap, bucket_mb=0.01, **kw)
            step_s, _ = _train(model, opt, dev)
            out[overlap] = (_params(model), step_s)
            opt.close()
        same = torch.equal(out[False][0], out[True][0])
        _report(f"{cls.__name__} overlap", same and _replicas_identical(out[True][0]), out[True][1],
                f"(overlap=False {out[False][1] * 1e3:.2f} ms)")


def check_diloco(dev):
    runs = {}
    for delay in (0, 1):
        model = _model(dev)
        opt = bitscom.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), model.named_parameters(),
                             sync_every=4, fragments=2, delay=delay, outer_lr=1.0, outer_momentum=0.0,
                             nesterov=False)
        step_s, loss = _train(model, opt, dev, zero_first=False)
        opt.sync()
        stats = opt.comm_stats()
        runs[delay] = (_params(model), step_s, loss, stats["bytes_sent"], stats["compression_ratio"])
        opt.close()
    vec, step_s, loss, sent, ratio = runs[1]
    # the delayed rule is applied (another result than delay=0), on the same bytes, the same on every rank
    ok = (_replicas_identical(vec) and bool(torch.isfinite(vec).all()) and sent == runs[0][3]
          and not torch.equal(vec, runs[0][0]))
    _report("DiLoCo streaming", ok, step_s, f"loss {loss:.4f}, {ratio:.1f}x fewer bytes (delay=0 {runs[0][1] * 1e3:.2f} ms)")


def _sharded(dev, mesh):
    from torch.distributed.fsdp import fully_shard
    model = _model(dev)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full_params(model):
    return torch.cat([p.full_tensor().detach().reshape(-1).float().cpu() for p in model.parameters()])


def check_fsdp(dev):
    import bitscom.fsdp
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(dev.type, (bitscom.size(),))
    stock = _sharded(dev, mesh)
    _train(stock, torch.optim.SGD(stock.parameters(), lr=0.1), dev)
    exact = _sharded(dev, mesh)
    bitscom.fsdp.compress(exact, gradients=32)
    step_s, _ = _train(exact, torch.optim.SGD(exact.parameters(), lr=0.1), dev)
    _report("FSDP2 gradients=32", torch.equal(_full_params(stock), _full_params(exact)), step_s)
    low = _sharded(dev, mesh)
    bitscom.fsdp.compress(low, gradients=4, weights=bitscom.fsdp.WeightConfig())
    step_s, loss = _train(low, torch.optim.AdamW(low.parameters(), lr=1e-2), dev)
    vec = _full_params(low)
    ok = bool(torch.isfinite(vec).all()) and _replicas_identical(vec)
    _report("FSDP2 4-bit grads, 8-bit w", ok, step_s, f"loss {loss:.4f}")


CHECKS = {"onebit": check_onebit, "diloco": check_diloco, "fsdp": check_fsdp}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--checks", default=",".join(CHECKS),
                    help=f"comma-separated subset of {','.join(CHECKS)}")
    args = ap.parse_args(argv)
    names = [c for c in args.checks.split(",") if c]
    bad = [c for c in names if c not in CHECKS]
    if bad:
        ap.error(f"--checks: unknown {bad}; choose from {list(CHECKS)}")
    bitscom.init(device=None if args.device == "auto" else args.device)
    dev = bitscom.runtime.device()
    if bitscom.rank() == 0:
        print(f"gpu_paths_check: {bitscom.size()} rank(s) on {dev} ({dist.get_backend()}), torch {torch.__version__}")
    for name in names:
        CHECKS[name](dev)
    bitscom.shutdown()


if __name__ == "__main__":
    main()
