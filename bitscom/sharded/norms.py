"""Global gradient norms over shards: what ``torch.nn.utils.clip_grad_norm_`` would compute on
the unsharded gradient, identical on every rank, mostly from a four-number summary that every
reduction all-gathers (why: docs/sharded.md, Internals).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch

from ..comm import Comm, wait
from ..validate import number

__all__ = ["norm_summary", "global_norm", "clip_coefficient"]

_SUMSQ, _SUMABS, _MAX, _NEGMIN = range(4)
_N = 4
_EMPTY = (0.0, 0.0, 0.0, -math.inf)     # the summary of no elements


def _combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two summaries as one: the sums add, the maxima take the larger (NaN stays NaN)."""
    return torch.cat([a[:_MAX] + b[:_MAX], torch.maximum(a[_MAX:], b[_MAX:])])


def _local_summary(grads: Sequence[torch.Tensor], device) -> torch.Tensor:
    out = torch.tensor(_EMPTY, dtype=torch.float64, device=device)
    for g in grads:
        if g.numel():
            a = g.detach().double().abs()
            out = _combine(out, torch.stack([(a ** 2.0).sum(), a.sum(), a.max(), -a.min()]))
    return out


def norm_summary(grads: Sequence[torch.Tensor], device, topo) -> torch.Tensor:
    """The summary of the whole reduced gradient (every rank's shard), identical on every rank."""
    mine = _local_summary(grads, device)
    if topo.world == 1:
        return mine
    everyone = torch.empty(topo.world * _N, dtype=torch.float64, device=device)
    wait(Comm(topo.group).all_gather(everyone, mine))
    return functools.reduce(_combine, everyone.view(topo.world, _N))     # in rank order


def _all_reduce(t: torch.Tensor, topo) -> torch.Tensor:
    if topo.world > 1:
        wait(Comm(topo.group).all_reduce(t))
    return t


def _nonzero_parameters(grads, owners: Sequence[int], n_params: int, device, topo) -> torch.Tensor:
    counts = torch.zeros(n_params, dtype=torch.float64, device=device)
    for g, owner in zip(grads, owners):
        if g.numel():
            counts[owner] += (g.detach() != 0).sum()
    return (_all_reduce(counts, topo) > 0).sum().double()


def global_norm(grads: Sequence[torch.Tensor], norm_type: float, summary: Optional[torch.Tensor],
                device, topo, owners: Sequence[int] = (), n_params: int = 0) -> torch.Tensor:
    """The norm of order ``norm_type`` of the whole gradient (float64; ``owners`` for order 0)."""
    number("norm_type", norm_type)
    if summary is not None:
        if norm_type == 2.0:
            return summary[_SUMSQ] ** 0.5
        if norm_type == 1.0:
            return summary[_SUMABS].clone()
        if norm_type == math.inf:
            return summary[_MAX].clone()
        if norm_type == -math.inf:
            if float(summary[_NEGMIN]) == -math.inf:        # no elements at all
                return torch.zeros((), dtype=torch.float64, device=device)
            return -summary[_NEGMIN]                         # NaN stays NaN
    if norm_type == 0.0:
        return _nonzero_parameters(grads, owners, n_params, device, topo)
    local = torch.zeros(1, dtype=torch.float64, device=device)
    local += sum((g.detach().double().abs() ** norm_type).sum() for g in grads if g.numel())
    return _all_reduce(local, topo).reshape(()) ** (1.0 / norm_type)


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """``min(1, max_norm / (total + 1e-6))``, torch's clipping factor."""
    return (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
