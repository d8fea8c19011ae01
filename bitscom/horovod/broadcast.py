"""``broadcast`` and its in-place and async forms, and its autograd function (tensors; the
``broadcast_parameters`` family is :mod:`bitscom.broadcast`)."""

from __future__ import annotations

from typing import Any, Generator, Optional

import torch
import torch.distributed as dist

from .. import runtime
from ..comm import Comm
from ..ops import Sum
from .allreduce import allreduce
from .args import call_group, check_root, label
from .failures import guard
from .groups import face_comm
from .handles import Handle, submit, synchronize
from .negotiation import KINDS, negotiate

__all__ = ["broadcast", "broadcast_", "broadcast_async", "broadcast_async_"]


def _broadcast_rounds(lbl: str, out: torch.Tensor, root_rank: int, comm: Optional[Comm],
                      name: Optional[str] = None) -> Generator[Any, None, torch.Tensor]:
    if comm is None:
        if root_rank not in (0, runtime.rank() if runtime.is_initialized() else 0):
            raise ValueError(f"{lbl}: root_rank {root_rank} is not a rank of the group")
        return out
    yield from negotiate(comm, lbl, out, KINDS["broadcast"], root=root_rank, name=name)
    ranks = dist.get_process_group_ranks(comm.group)
    if root_rank not in ranks:
        raise ValueError(f"{lbl}: root_rank {root_rank} is not a rank of the group "
                         f"(its global ranks are {ranks})")
    buf = out.detach() if out.is_contiguous() else out.detach().contiguous()
    wire = buf.view(torch.uint8) if buf.dtype == torch.bool else buf
    yield guard(comm.broadcast(wire, ranks.index(root_rank)), lbl)
    if not out.is_contiguous():
        out.detach().copy_(buf)
    return out


def _broadcast_async(fn: str, tensor: torch.Tensor, out: Optional[torch.Tensor], root_rank: int,
                     name: Optional[str], process_group: Any, process_set: Any) -> Handle:
    group = call_group(fn, tensor, name, process_group, process_set)
    check_root(root_rank)
    lbl = label(fn, name)
    out = tensor.detach().clone() if out is None else out
    comm = face_comm(group, lbl)
    return submit(fn, name, _broadcast_rounds(lbl, out, root_rank, comm, name), comm)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = None, *, process_group: Any = None) -> Handle:
    """Start copying ``root_rank``'s ``tensor`` to every rank into a new tensor.

    ``root_rank`` is a global rank (torch's convention), also with ``process_group``.

    Example::

        h = bitscom.broadcast_async(seed, root_rank=0)
        seed = bitscom.synchronize(h)
    """
    return _broadcast_async("broadcast_async", tensor, None, root_rank, name, process_group, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = None, *, process_group: Any = None) -> Handle:
    """In-place :func:`broadcast_async`.

    Example::

        bitscom.synchronize(bitscom.broadcast_async_(weights, root_rank=0))
    """
    return _broadcast_async("broadcast_async_", tensor, tensor, root_rank, name, process_group, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = None, *, process_group: Any = None) -> torch.Tensor:
    """In place: ``tensor`` becomes ``root_rank``'s; returns ``tensor``.

    Example::

        bitscom.broadcast_(model.fc.weight.data, root_rank=0)
    """
    return synchronize(_broadcast_async("broadcast_", tensor, tensor, root_rank, name, process_group, process_set))


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, group):
        ctx.args = (root_rank, group)
        return synchronize(_broadcast_async("broadcast", tensor, None, root_rank, name, group, None))

    @staticmethod
    def backward(ctx, grad):
        root_rank, group = ctx.args
        # Only root's tensor reaches the outputs: it gets the sum of every rank's gradient.
        summed = allreduce(grad, op=Sum, process_group=group)
        me = dist.get_rank() if dist.is_initialized() else 0
        if me != root_rank:
            summed.zero_()
        return summed, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = None, *, process_group: Any = None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank (a new tensor); differentiable.

    Example::

        start = bitscom.broadcast(torch.randn(10), root_rank=0)
    """
    group = call_group("broadcast", tensor, name, process_group, process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _BroadcastFn.apply(tensor, root_rank, name, group)
    return synchronize(_broadcast_async("broadcast", tensor, None, root_rank, name, group, None))
