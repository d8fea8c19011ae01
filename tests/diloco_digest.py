"""Digests of synchronous DiLoCo runs (tests/data/diloco_sync_digest.json): the parameters,
θ_global and byte counts after a few steps, recorded from the code before Streaming DiLoCo's
overlap (issue 34) so that ``delay=0`` is checked bitwise against what shipped."""

import hashlib

import torch
import torch.nn as nn

import bitscom
from bitscom.diloco import DiLoCo
from helpers import global_batch, make_model, shard

# name -> (steps, inner kind, dtype, DiLoCo keyword arguments, call sync() at the end)
CASES = {
    "lowbit_H4_F1": (13, "adamw", "float32", {"sync_every": 4}, False),
    "lowbit_H4_F2": (13, "adamw", "float32", {"sync_every": 4, "fragments": 2}, False),
    "exact_H3_F3_sgd": (10, "sgd", "float64", {"sync_every": 3, "fragments": 3, "compression": None}, False),
    "lowbit_H4_F2_W3": (14, "adamw", "float32", {"sync_every": 4, "fragments": 2, "warmup_steps": 3}, False),
    "exact_H2_F3_together": (9, "adamw", "float64", {"sync_every": 2, "fragments": 3, "compression": None,
                                                     "outer_lr": 0.5, "outer_momentum": 0.8,
                                                     "nesterov": False}, False),
    "lowbit2_H4_F2_sync": (7, "adamw", "float32", {"sync_every": 4, "fragments": 2,
                                                    "compression": "lowbit:bitwidth=2"}, True),
}


def _sha(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digest_run(rank, world, name, **extra):
    """Run case ``name`` (with ``extra`` DiLoCo arguments); the digest of what it ends with."""
    steps, kind, dtype, kw, final_sync = CASES[name]
    dtype = getattr(torch, dtype)
    model = make_model(seed=0).to(dtype)
    if kind == "sgd":
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    kw = dict(kw)
    if isinstance(kw.get("compression"), str):
        comp, _, arg = kw["compression"].partition(":bitwidth=")
        kw["compression"] = bitscom.compressors.get(comp, bitwidth=int(arg), error_feedback=True)
    opt = DiLoCo(inner, model.named_parameters(), **kw, **extra)
    for t in range(steps):
        x, y = global_batch(t, world, 4)
        x, y = shard(x, rank, world).to(dtype), shard(y, rank, world).to(dtype)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if final_sync:
        opt.sync()
    stats = opt.comm_stats()
    return {"params": _sha(model.parameters()), "global": _sha(opt.global_parameters),
            "stats": {k: stats[k] for k in ("bytes_sent", "syncs", "fragment_syncs", "inner_steps")}}
