"""``allgather`` (uneven first dimensions) and its async form and autograd function."""

from __future__ import annotations

import math
from typing import Any, Generator, Optional

import torch
import torch.distributed as dist

from ..comm import Comm
from ..ops import Sum
from .allreduce import allreduce
from .args import call_group, label
from .failures import guard
from .groups import face_comm
from .handles import Handle, submit, synchronize
from .negotiation import ERRORS, H_FIXED, KINDS, MAX_DIMS, negotiate

__all__ = ["allgather", "allgather_async"]


def _allgather_rounds(lbl: str, tensor: torch.Tensor, comm: Optional[Comm],
                      name: Optional[str] = None) -> Generator[Any, None, torch.Tensor]:
    err = 4 if tensor.dim() == 0 else (1 if tensor.dim() > MAX_DIMS else 0)
    if comm is None:
        if err:
            raise ValueError(f"{lbl}: {ERRORS[err]}")
        return tensor.detach().clone()
    rows = yield from negotiate(comm, lbl, tensor, KINDS["allgather"], err=err, name=name)
    dims = [row[H_FIXED] for row in rows]
    rest = math.prod(tensor.shape[1:])
    longest = max(dims)
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    even = len(set(dims)) == 1
    send = flat if even else torch.cat([flat, flat.new_zeros((longest - tensor.shape[0]) * rest)])
    recv = send.new_empty(comm.size * longest * rest)
    yield guard(comm.all_gather(recv, send.contiguous()), lbl)
    out = recv if even else torch.cat(
        [recv[r * longest * rest: (r * longest + dims[r]) * rest] for r in range(comm.size)])
    if tensor.dtype == torch.bool:
        out = out.view(torch.bool)
    return out.view(sum(dims), *tensor.shape[1:])


def _allgather_async(fn: str, tensor: torch.Tensor, name: Optional[str], group: Any) -> Handle:
    lbl = label("allgather", name)
    comm = face_comm(group, lbl)
    return submit(fn, name, _allgather_rounds(lbl, tensor, comm, name), comm)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None, *,
                    process_group: Any = None) -> Handle:
    """Start concatenating every rank's ``tensor`` along dimension 0 (sizes of dimension 0
    may differ between ranks; the other dimensions must agree).

    Example::

        h = bitscom.allgather_async(predictions)
        all_predictions = bitscom.synchronize(h)
    """
    group = call_group("allgather_async", tensor, name, process_group, process_set)
    return _allgather_async("allgather", tensor, name, group)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, group):
        ctx.group = group
        ctx.dim = tensor.shape[0]
        return synchronize(_allgather_async("allgather", tensor, name, group))

    @staticmethod
    def backward(ctx, grad):
        # Every rank's loss may use every slice: sum the gradients, keep this rank's slice.
        summed = allreduce(grad, op=Sum, process_group=ctx.group)
        dims = synchronize(_allgather_async("allgather", torch.tensor([ctx.dim]), None, ctx.group))
        me = dist.get_rank(ctx.group) if ctx.group is not None else 0
        offset = int(dims[:me].sum())
        return summed.narrow(0, offset, ctx.dim), None, None


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None, *,
              process_group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0; differentiable.

    Example::

        everyone = bitscom.allgather(torch.tensor([bitscom.rank()]))   # tensor([0, 1, ...])
    """
    group = call_group("allgather", tensor, name, process_group, process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _AllgatherFn.apply(tensor, name, group)
    return synchronize(_allgather_async("allgather", tensor, name, group))
