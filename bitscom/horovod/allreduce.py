"""``allreduce`` and its in-place, async and grouped forms, and its autograd function."""

from __future__ import annotations

from typing import Any, Generator, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import Comm
from ..compressors.casting import Compression
from ..ops import Average, Max, Min, Product, ReduceOp, Sum
from .args import call_group, check_tensor, label, resolve_op
from .codec import check_compression
from .failures import guard
from .groups import face_comm, face_group
from .handles import Handle, submit, synchronize
from .negotiation import ERROR_TYPES, ERRORS, KINDS, OPS, negotiate

__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce"]

_TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


def _reduce_error(tensor: torch.Tensor, op: ReduceOp, pre: float, post: float) -> int:
    """The header's error code for data this rank cannot reduce (0: none); every rank raises it."""
    if tensor.dtype == torch.bool:
        return 5
    integer = not (tensor.is_floating_point() or tensor.is_complex())
    if integer and (pre != 1.0 or post != 1.0):
        return 6
    if tensor.is_complex() and op in (Min, Max):
        return 7
    return 0


def _allreduce_rounds(lbl: str, tensor: torch.Tensor, out: torch.Tensor, op: ReduceOp, pre: float, post: float,
                      comm: Optional[Comm], name: Optional[str] = None) -> Generator[Any, None, torch.Tensor]:
    size = 1 if comm is None else comm.size
    # detach(): the in-place forms may get a leaf that requires grad; the view shares storage.
    contiguous = out.is_contiguous()
    buf = out.detach() if contiguous else out.detach().contiguous()
    err = _reduce_error(tensor, op, pre, post)
    if comm is None and err:
        raise ERROR_TYPES[err](f"{lbl}: {ERRORS[err]}")
    if comm is not None:
        yield from negotiate(comm, lbl, tensor, KINDS["allreduce"], OPS[op], pre=pre, post=post, err=err, name=name)
    if pre != 1.0:
        buf.mul_(pre)
    if comm is not None:
        yield guard(comm.all_reduce(buf, _TORCH_OPS[op]), lbl)
    if op is Average:
        buf.div_(size, rounding_mode=None if tensor.is_floating_point() or tensor.is_complex() else "trunc")
    if post != 1.0:
        buf.mul_(post)
    if not contiguous:
        out.detach().copy_(buf)
    return out


def _allreduce_async(fn: str, tensor: torch.Tensor, out: Optional[torch.Tensor], average, name,
                     op, pre, post, process_group, process_set) -> Handle:
    group = call_group(fn, tensor, name, process_group, process_set)
    op = resolve_op(op, average)
    lbl = label(fn, name)
    pre, post = float(pre), float(post)
    out = tensor.detach().clone() if out is None else out
    comm = face_comm(group, lbl)
    return submit(fn, name, _allreduce_rounds(lbl, tensor, out, op, pre, post, comm, name), comm)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None, *, process_group: Any = None) -> Handle:
    """Start reducing ``tensor`` over ranks; returns a :class:`Handle` (see :func:`synchronize`).
    ``op``: ``bitscom.Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.

    Example::

        h = bitscom.allreduce_async(metric, name="val_loss")
        avg = bitscom.synchronize(h)
    """
    return _allreduce_async("allreduce_async", tensor, None, average, name, op, prescale_factor,
                            postscale_factor, process_group, process_set)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = None, *, process_group: Any = None) -> Handle:
    """In-place :func:`allreduce_async`: ``tensor`` holds the result after :func:`synchronize`.

    Example::

        h = bitscom.allreduce_async_(buf, op=bitscom.Sum)
        bitscom.synchronize(h)      # buf now holds the sum
    """
    return _allreduce_async("allreduce_async_", tensor, tensor, average, name, op,
                            prescale_factor, postscale_factor, process_group, process_set)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None, *, process_group: Any = None) -> torch.Tensor:
    """In place: ``tensor`` becomes the average (or ``op``) over ranks; returns ``tensor``.

    Example::

        bitscom.allreduce_(counts, op=bitscom.Sum)
    """
    return synchronize(_allreduce_async("allreduce_", tensor, tensor, average, name, op,
                                        prescale_factor, postscale_factor, process_group,
                                        process_set))


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, group):
        ctx.args = (op, pre, post, group)
        return synchronize(_allreduce_async("allreduce", tensor, None, None, name, op, pre, post, group, None))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, group = ctx.args
        # d(out)/d(x_r) is pre*post (/size for Average) for every rank's output: reduce again.
        return allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post,
                         process_group=group), None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None, *, process_group: Any = None) -> torch.Tensor:
    """Return the average (or ``op``) of ``tensor`` over ranks; the input is not modified.

    Differentiable for ``Average``/``Sum``, like Horovod's. ``compression``:
    ``bitscom.Compression.none/fp16/bf16`` or a Horovod-style codec (the compressed tensor travels).

    Example::

        avg_loss = bitscom.allreduce(torch.tensor(loss), name="loss")
        total = bitscom.allreduce(correct, op=bitscom.Sum)
        half = bitscom.allreduce(grad, compression=bitscom.Compression.fp16)
    """
    check_tensor("allreduce", tensor)
    check_compression(compression)
    op = resolve_op(op, average)
    group = face_group(process_group, process_set, label("allreduce", name))
    wire, ctx = compression.compress(tensor)
    if torch.is_grad_enabled() and wire.requires_grad and op in (Average, Sum):
        out = _AllreduceFn.apply(wire, name, op, float(prescale_factor), float(postscale_factor), group)
    else:
        out = synchronize(_allreduce_async("allreduce", wire.detach(), None, None, name, op,
                                           prescale_factor, postscale_factor, group, None))
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      op: Optional[ReduceOp] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None, *, process_group: Any = None) -> List[torch.Tensor]:
    """Reduce a list of tensors (Horovod's ``grouped_allreduce``); returns new tensors.

    Example::

        avg_a, avg_b = bitscom.grouped_allreduce([a, b])
    """
    face_group(process_group, process_set, label("grouped_allreduce", name))
    handles = [allreduce_async(t, average, None if name is None else f"{name}.{i}", op,
                               prescale_factor, postscale_factor, process_set,
                               process_group=process_group) for i, t in enumerate(tensors)]
    return [synchronize(h) for h in handles]
