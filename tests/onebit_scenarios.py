"""Training scenarios of OneBitAdam / ZeroOneAdam whose outputs were recorded with the
implementation before the overlap (issue 34): ``tests/data/onebit_reference.pt``, written by
``python tests/onebit_scenarios.py``. The overlapped optimizer must reproduce them bitwise,
and must load the checkpoints recorded there (made by the old code).

Each scenario: a small model with several 1-bit blocks per owner shard (block_size 32), a
frozen parameter (no hook, no gradient), an unused parameter (gradient None), two parameter
groups with their own lr / weight decay, the warm-up (exact) and the compressed phase."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from helpers import global_batch, shard

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "onebit_reference.pt")

SCENARIOS = {
    # name: (optimizer, constructor settings, steps, backward passes per step, clip, checkpoint after)
    "onebit": ("OneBitAdam", dict(lr=0.01, freeze_step=3, weight_decay=0.01, block_size=32), 8, 1, None, 4),
    "onebit_accumulate": ("OneBitAdam", dict(lr=0.01, freeze_step=2, block_size=32, stage2_bits=4,
                                             bias_correction=False), 6, 2, None, 3),
    "onebit_clip": ("OneBitAdam", dict(lr=0.01, freeze_step=2, block_size=32), 5, 1, 0.05, None),
    "zero_one": ("ZeroOneAdam", dict(lr=0.01, var_freeze_step=6, var_update_scaler=2, local_step_scaler=2,
                                     local_step_clipper=2, weight_decay=0.01, block_size=32), 12, 1, None, 7),
    "zero_one_accumulate": ("ZeroOneAdam", dict(lr=0.01, var_freeze_step=4, var_update_scaler=1,
                                                local_step_scaler=1, local_step_clipper=4, block_size=32,
                                                bias_correction=False), 9, 2, None, None),
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(6, 24)
        self.fc2 = nn.Linear(24, 16)
        self.unused = nn.Linear(4, 5)
        self.fc3 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(self.frozen(x))))))


def param_groups(model):
    return [{"params": [model.frozen.weight, model.fc1.weight, model.fc1.bias], "weight_decay": 0.0},
            {"params": [model.fc2.weight, model.fc2.bias, model.unused.weight, model.frozen.bias,
                        model.fc3.weight, model.fc3.bias], "lr": 0.02}]


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def build(name, model, **extra):
    import bitscom.onebit as onebit
    kind, settings, _, _, _, _ = SCENARIOS[name]
    return getattr(onebit, kind)(param_groups(model), **settings, **extra)


def train(model, opt, name, rank, world, start, stop, checkpoint_at=None):
    """Steps ``start..stop-1``; returns the state dict (and params) after ``checkpoint_at``."""
    _, _, _, passes, clip, _ = SCENARIOS[name]
    saved = None
    for t in range(start, stop):
        for k in range(passes):
            x, y = global_batch(t * passes + k, world, per_rank=4)
            nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if checkpoint_at is not None and t + 1 == checkpoint_at:
            saved = {"state_dict": opt.state_dict(), "params": flat(model)}
    return saved


def run(rank, world, name, **extra):
    """The scenario on this rank: final parameters, momentum, bytes, mid-run checkpoint."""
    _, _, steps, _, _, cut = SCENARIOS[name]
    model = Net()
    opt = build(name, model, **extra)
    saved = train(model, opt, name, rank, world, 0, steps, cut)
    return {"params": flat(model), "exp_avg": opt.exp_avg.clone(),
            "bytes_sent": opt.comm_stats()["bytes_sent"], "checkpoint": saved}


def resume(rank, world, name, checkpoint, **extra):
    """Load a recorded checkpoint (made by the code before the overlap) and finish the run."""
    _, _, steps, _, _, cut = SCENARIOS[name]
    model = Net()
    with torch.no_grad():
        off = 0
        for p in model.parameters():
            p.copy_(checkpoint["params"][off:off + p.numel()].view(p.shape))
            off += p.numel()
    opt = build(name, model, **extra)
    opt.load_state_dict(checkpoint["state_dict"])
    train(model, opt, name, rank, world, cut, steps)
    return flat(model)


if __name__ == "__main__":      # record the reference (run once, with the pre-overlap code)
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from distpool import WorkerPool
    out = {}
    for world in (2, 4):
        pool = WorkerPool(world)
        try:
            for name in SCENARIOS:
                out[f"{name}/{world}"] = pool.run(run, name, timeout=300)
        finally:
            pool.close()
    torch.save(out, DATA)
    print("wrote", DATA, sorted(out))
