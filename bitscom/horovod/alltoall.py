"""``alltoall`` (equal or uneven splits), its async form and its autograd function."""

from __future__ import annotations

import math
from typing import Any, Generator, List, Optional, Sequence, Tuple, Union

import torch

from ..comm import Comm
from .args import call_group, label
from .failures import guard
from .groups import face_comm
from .handles import Handle, submit, synchronize
from .negotiation import ERRORS, H_FIXED, KINDS, MAX_DIMS, negotiate

__all__ = ["alltoall", "alltoall_async"]

Splits = Optional[Union[torch.Tensor, Sequence[int]]]


def _split_list(splits: Splits, tensor: torch.Tensor, world: int) -> Tuple[List[int], int]:
    """(splits as a list, error code) — the error travels in the header."""
    if tensor.dim() == 0:
        return [0] * world, 4
    rows = tensor.shape[0]
    if splits is None:
        return ([rows // world] * world, 0) if rows % world == 0 else ([0] * world, 3)
    values = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(values) != world or any(v < 0 for v in values) or sum(values) != rows:
        return [0] * world, 2
    return values, 0


def _alltoall_rounds(lbl: str, tensor: torch.Tensor, splits: Splits, comm: Optional[Comm], want_splits: bool,
                     name: Optional[str] = None) -> Generator[Any, None, Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]]:
    world = 1 if comm is None else comm.size
    values, err = _split_list(splits, tensor, world)
    if err == 0 and tensor.dim() > MAX_DIMS:
        err = 1
    if comm is None:
        if err:
            raise ValueError(f"{lbl}: {ERRORS[err]}")
        out = tensor.detach().clone()
        counts = torch.tensor(values, dtype=torch.int32)
        return (out, counts) if want_splits else out
    rows = yield from negotiate(comm, lbl, tensor, KINDS["alltoall"], err=err, extra=values, name=name)
    matrix = [row[H_FIXED + MAX_DIMS:] for row in rows]           # matrix[r][j]: r sends to j
    received = [matrix[r][comm.rank] for r in range(world)]
    rest = math.prod(tensor.shape[1:])
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    out = flat.new_empty(sum(received) * rest)
    # Flat buffers: the splits count elements (rows × the size of one row).
    yield guard(comm.all_to_all_v(out, flat, [n * rest for n in received], [n * rest for n in values]), lbl)
    if tensor.dtype == torch.bool:
        out = out.view(torch.bool)
    out = out.view(sum(received), *tensor.shape[1:])
    return (out, torch.tensor(received, dtype=torch.int32)) if want_splits else out


def _alltoall_async(fn: str, tensor: torch.Tensor, splits: Splits, name: Optional[str], group: Any,
                    want_splits: bool) -> Handle:
    lbl = label("alltoall", name)
    comm = face_comm(group, lbl)
    return submit(fn, name, _alltoall_rounds(lbl, tensor, splits, comm, want_splits, name), comm)


def alltoall_async(tensor: torch.Tensor, splits: Splits = None, name: Optional[str] = None,
                   process_set: Any = None, *, process_group: Any = None) -> Handle:
    """Start an all-to-all: rows ``splits[j]`` of ``tensor`` (dimension 0, in order) go to rank
    ``j``; without ``splits`` dimension 0 is cut into equal parts. :func:`synchronize` returns
    the received rows, and with ``splits`` also the received split sizes (int32).

    Example::

        out, received = bitscom.synchronize(bitscom.alltoall_async(x, splits=[1, 3]))
    """
    group = call_group("alltoall_async", tensor, name, process_group, process_set)
    return _alltoall_async("alltoall", tensor, splits, name, group, splits is not None)


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, group):
        ctx.group = group
        out, received = synchronize(_alltoall_async("alltoall", tensor, splits, name, group, True))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _unused):
        # The adjoint of an all-to-all sends every received row back where it came from.
        back, _ = synchronize(_alltoall_async("alltoall", grad.contiguous(), ctx.received, None, ctx.group, True))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Splits = None, name: Optional[str] = None, process_set: Any = None, *,
             process_group: Any = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """All-to-all (see :func:`alltoall_async`); returns the received tensor, or
    ``(tensor, received_splits)`` when ``splits`` is given. Differentiable.

    Example::

        shards = bitscom.alltoall(torch.arange(4.0))          # 2 ranks: 2 rows to each
        rows, received = bitscom.alltoall(x, splits=torch.tensor([3, 1]))
    """
    group = call_group("alltoall", tensor, name, process_group, process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        out, received = _AlltoallFn.apply(tensor, splits, name, group)
        return out if splits is None else (out, received)
    return synchronize(_alltoall_async("alltoall", tensor, splits, name, group, splits is not None))
