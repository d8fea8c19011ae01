"""Shared pieces for multi-rank tests: a small model, data, and a float64 reference run."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, d_in=6, hidden=8, d_out=3, extra_unused=False, frozen=False):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)
        self.branch = nn.Linear(hidden, d_out) if extra_unused else None
        self.frozen = nn.Linear(d_in, d_in) if frozen else None
        if frozen:
            self.frozen.requires_grad_(False)

    def forward(self, x, use_branch=False):
        if self.frozen is not None:
            x = self.frozen(x)
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        out = self.fc3(h)
        if use_branch and self.branch is not None:
            out = out + self.branch(h)
        return out


def make_model(seed=0, **kw):
    torch.manual_seed(seed)
    return MLP(**kw)


def global_batch(step, world, per_rank=4, d_in=6, d_out=3, seed=1234):
    g = torch.Generator().manual_seed(seed + step)
    x = torch.randn(world * per_rank, d_in, generator=g)
    y = torch.randn(world * per_rank, d_out, generator=g)
    return x, y


def shard(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def reference_run(model, steps, world, lr=0.1, momentum=0.9, per_rank=4, passes=1, clip=None):
    """Single process, float64, concatenated batch: what data parallelism must equal."""
    ref = copy.deepcopy(model).double()
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    history = []
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = global_batch(step * passes + k, world, per_rank)
            # mean over ranks of per-rank mean losses == mean over the global batch
            loss = nn.functional.mse_loss(ref(x.double()), y.double())
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        history.append([p.detach().clone() for p in ref.parameters()])
    return history


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]
