"""Horovod's module-level tensor collectives on torch.distributed, with async handles.

``allreduce``, ``allgather``, ``broadcast``, ``alltoall`` (and their in-place and ``_async``
forms), ``synchronize(handle)`` and ``poll(handle)`` behave like ``horovod.torch``'s, so
``import bitscom as hvd`` keeps such code working.

Why a negotiation round. Horovod's coordinator checks that every rank submitted the same
operation (same kind, dtype, shape, op, root) before any byte moves; torch.distributed does
not, and a mismatch there hangs or silently mixes bytes. So every call first all-gathers a
small header describing the call on this rank; every rank compares all headers and raises
the same ``RuntimeError`` on a mismatch, instead of hanging. Per-rank problems with the
arguments (bad ``splits``) travel in the header too, so all ranks fail together.

Async handles. An ``*_async`` call issues the header round and returns a :class:`Handle`
without blocking. The payload round starts once the header round completed: noticed on
the next call into this module, in :func:`poll` or in :func:`synchronize`. Payload rounds
go to a second process group and are issued in call order (a handle issues its payload
only when every earlier handle has finished), so every rank issues them in the same order
whatever the timing — the rule :mod:`bitscom.engine` follows for buckets. On NCCL the
rounds are ordinary torch ``Work`` objects on the NCCL stream.

Deliberate differences from Horovod: ``process_group=`` (a torch ProcessGroup) replaces
``process_set=`` (which raises); ``root_rank`` is a global rank; integer ``Average`` divides
with truncation toward zero; ``Adasum`` raises ``NotImplementedError``.
"""

from __future__ import annotations

import math
import struct
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from . import runtime
from .comm import resolve_group
from .compressors.base import is_completed, wait
from .compressors.casting import BF16Compressor, Compression, FP16Compressor, NoneCompressor
from .compressors.hvd_adapter import is_codec
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["Handle", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "grouped_allreduce", "allgather", "allgather_async", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "synchronize",
           "poll", "allgather_object", "barrier"]

_MAX_DIMS = 16
_KINDS = {"allreduce": 1, "allgather": 2, "broadcast": 3, "alltoall": 4}
_OPS = {Average: 1, Sum: 2, Min: 3, Max: 4, Product: 5}
_TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
# Per-rank argument problems, reported through the header so that every rank raises.
_ERRORS = {1: f"the tensor has more than {_MAX_DIMS} dimensions",
           2: "splits must have one non-negative entry per rank summing to tensor.shape[0]",
           3: "tensor.shape[0] is not divisible by the number of ranks (pass splits=)",
           4: "the tensor must have at least one dimension"}
# Header: kind, op, root, dtype, prescale bits, postscale bits, error, ndim, shape, extra.
_H_FIXED = 8


# -- arguments ---------------------------------------------------------------------------
def _resolve_op(op, average) -> ReduceOp:
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    op = Average if op is None else op
    if op is Adasum:
        raise NotImplementedError("hvd.Adasum is not supported by bitscom; use op=bitscom.Average "
                                  "(or a compressor to cut traffic)")
    if op not in _OPS:
        raise ValueError(f"op must be one of bitscom.Average, Sum, Min, Max, Product; got {op!r}")
    return op


def _resolve_group(process_group, process_set):
    if process_set is not None:
        raise NotImplementedError("Horovod process sets are not supported by bitscom; pass "
                                  "process_group=<a torch.distributed ProcessGroup> "
                                  "(e.g. torch.distributed.new_group(ranks)) instead")
    return resolve_group(process_group)


def _check_tensor(fn: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"bitscom.{fn} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"bitscom.{fn} reduces dense tensors; got a sparse tensor (call .to_dense())")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"bitscom.{fn}: dtype {tensor.dtype} is not supported; supported: "
                        f"{[str(d).replace('torch.', '') for d in _DTYPES]}")


def _check_name(name) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__}")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


class _State:
    def __init__(self):
        self.later: Dict[int, tuple] = {}      # id(group) -> (group, payload group)
        self.queue: List["Handle"] = []        # unfinished handles, in call order


_state = _State()


def _payload_group(group):
    """The second group for payload rounds, created on first use.

    Called at the start of every operation, inside the user's call (never from poll or
    synchronize): creating a group synchronizes its ranks and numbers groups in creation
    order, so it must happen at the same point of the program on every rank.
    """
    entry = _state.later.get(id(group))
    if entry is None or entry[0] is not group:
        later = dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)
        entry = _state.later[id(group)] = (group, later)
    return entry[1]


# -- handles and the driver ----------------------------------------------------------------
class Handle:
    """An asynchronous collective in flight: pass it to :func:`synchronize` or :func:`poll`.

    Example::

        h = bitscom.allreduce_async(grad, name="g")
        ...                                   # compute meanwhile
        avg = bitscom.synchronize(h)
    """

    def __init__(self, fn: str, name: Optional[str], rounds: Iterator):
        self.fn = fn
        self.name = name
        self._rounds = rounds
        self._work = None
        self._done = False
        self._result = None
        self._error: Optional[BaseException] = None

    def _advance(self) -> None:
        try:
            self._work = next(self._rounds)
        except StopIteration as stop:
            self._work, self._done, self._result = None, True, stop.value
        except BaseException as err:   # noqa: BLE001 — kept and raised by synchronize()
            self._work, self._done, self._error = None, True, err

    def __repr__(self):
        state = "done" if self._done else "in flight"
        return f"<bitscom.Handle {self.fn}{'' if self.name is None else ' ' + repr(self.name)} {state}>"


def _submit(fn: str, name, rounds: Iterator) -> Handle:
    handle = Handle(fn, name, rounds)
    _progress()
    handle._advance()                  # issues the header round (or finishes, single process)
    if handle._error is not None:      # bad arguments found before any collective: raise now
        raise handle._error
    if not handle._done:
        _state.queue.append(handle)
    return handle


def _progress(until: Optional[Handle] = None) -> None:
    """Advance handles in call order; block for every handle up to ``until`` (inclusive)."""
    blocking = until is not None and until in _state.queue
    while _state.queue:
        handle = _state.queue[0]
        while not handle._done:
            if not blocking and not is_completed(handle._work):
                return
            try:
                wait(handle._work)
            except BaseException as err:  # noqa: BLE001
                handle._work, handle._done, handle._error = None, True, err
                break
            handle._advance()
        _state.queue.pop(0)
        if handle is until:
            return


def synchronize(handle: Handle):
    """Wait for ``handle`` and return its result (the output tensor; for ``alltoall`` with
    ``splits`` the pair ``(output, received_splits)``).

    Example::

        h = bitscom.allgather_async(x)
        everything = bitscom.synchronize(h)
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize expects a bitscom.Handle, got {type(handle).__name__}")
    if not handle._done:
        _progress(until=handle)
    if handle._error is not None:
        raise handle._error
    return handle._result


def poll(handle: Handle) -> bool:
    """True when ``handle`` finished (:func:`synchronize` will not block). Never blocks.

    Example::

        while not bitscom.poll(h):
            do_other_work()
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"poll expects a bitscom.Handle, got {type(handle).__name__}")
    _progress()
    return handle._done


# -- the negotiation round --------------------------------------------------------------------
def _device(group, tensor: torch.Tensor) -> torch.device:
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if backend == "gloo" else tensor.device


def _negotiate(fn, name, group, tensor, kind, op=0, root=-1, pre=1.0, post=1.0, err=0,
               extra=()) -> Iterator:
    """All-gather this rank's header; return the (world, H) headers after checking them."""
    world = dist.get_world_size(group)
    if tensor.dim() > _MAX_DIMS:
        err = err or 1
    shape = list(tensor.shape) if tensor.dim() <= _MAX_DIMS else []
    header = [kind, op, root, _DTYPES.index(tensor.dtype), _float_bits(pre), _float_bits(post),
              err, tensor.dim()] + shape + [-1] * (_MAX_DIMS - len(shape))
    extra = list(extra) + [0] * (world - len(extra))
    header = torch.tensor(header + extra, dtype=torch.int64, device=_device(group, tensor))
    everyone = torch.empty(world * header.numel(), dtype=torch.int64, device=header.device)
    yield _all_gather_flat(everyone, header, group=group, async_op=True)
    headers = everyone.view(world, -1).cpu()
    label = f"bitscom.{fn}" + ("" if name is None else f" {name!r}")
    for r in range(world):
        code = int(headers[r, 6])
        if code:
            raise RuntimeError(f"{label}: on rank {r}, {_ERRORS.get(code, code)}")
    fields = [(0, "operation", lambda h: next((k for k, v in _KINDS.items() if v == h[0]), "?")),
              (1, "op", lambda h: next((o.name.title() for o, v in _OPS.items() if v == h[1]), "-")),
              (2, "root_rank", lambda h: h[2]),
              (3, "dtype", lambda h: _DTYPES[h[3]]),
              (4, "prescale_factor", lambda h: struct.unpack("<d", struct.pack("<q", h[4]))[0]),
              (5, "postscale_factor", lambda h: struct.unpack("<d", struct.pack("<q", h[5]))[0]),
              (7, "number of dimensions", lambda h: h[7])]
    rows = [[int(x) for x in headers[r]] for r in range(world)]
    for index, what, show in fields:
        values = [row[index] for row in rows]
        if len(set(values)) > 1:
            seen = ", ".join(f"rank {r}: {show(row)}" for r, row in enumerate(rows))
            raise RuntimeError(f"{label}: ranks disagree on the {what} ({seen}); every rank must "
                               "make the same collective calls in the same order")
    first_dim_free = kind in (_KINDS["allgather"], _KINDS["alltoall"])
    dims = rows[0][7]
    start = _H_FIXED + (1 if first_dim_free else 0)
    shapes = [tuple(row[start:_H_FIXED + dims]) for row in rows]
    if len(set(shapes)) > 1:
        seen = ", ".join(f"rank {r}: {tuple(row[_H_FIXED:_H_FIXED + dims])}" for r, row in enumerate(rows))
        part = "shape (beyond the first dimension)" if first_dim_free else "shape"
        raise RuntimeError(f"{label}: ranks disagree on the tensor {part} ({seen})")
    return rows


# -- allreduce ---------------------------------------------------------------------------------
def _allreduce_rounds(fn, name, tensor, out, op, pre, post, group) -> Iterator:
    integer = not (tensor.is_floating_point() or tensor.is_complex())
    if tensor.dtype == torch.bool:
        raise TypeError(f"bitscom.{fn} does not reduce bool tensors; convert to uint8 (Max = any, "
                        "Min = all)")
    if integer and (pre != 1.0 or post != 1.0):
        raise ValueError(f"prescale_factor/postscale_factor apply to floating-point tensors; got "
                         f"{pre}/{post} with a {tensor.dtype} tensor")
    if tensor.is_complex() and op in (Min, Max):
        raise TypeError(f"op={op.name.title()} is undefined for complex tensors")
    size = 1 if group is None else dist.get_world_size(group)
    # detach(): the in-place forms may get a leaf that requires grad; the view shares storage.
    buf = out.detach() if out.is_contiguous() else out.detach().contiguous()
    contiguous = out.is_contiguous()
    if size > 1:
        later = _payload_group(group)
        yield from _negotiate(fn, name, group, tensor, _KINDS["allreduce"], _OPS[op],
                              pre=pre, post=post)
    if pre != 1.0:
        buf.mul_(pre)
    if size > 1:
        yield dist.all_reduce(buf, op=_TORCH_OPS[op], group=later, async_op=True)
    if op is Average:
        if integer:
            buf.copy_(torch.div(buf, size, rounding_mode="trunc"))
        else:
            buf.div_(size)
    if post != 1.0:
        buf.mul_(post)
    if not contiguous:
        out.detach().copy_(buf)
    return out


def _allreduce_async(fn, tensor, out, average, name, op, pre, post, process_group,
                     process_set) -> Handle:
    _check_tensor(fn, tensor)
    _check_name(name)
    op = _resolve_op(op, average)
    group = _resolve_group(process_group, process_set)
    if out is None:
        out = tensor.detach().clone()
    return _submit(fn, name, _allreduce_rounds(fn, name, tensor, out, op, float(pre), float(post),
                                               group))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None, *, process_group=None) -> Handle:
    """Start averaging (or ``op``-reducing) ``tensor`` over ranks; the input is not modified.

    Args:
        tensor: any dense tensor, same dtype and shape on every rank.
        average: deprecated Horovod flag (``True`` = Average, ``False`` = Sum).
        name: a label for error messages (Horovod keys operations by it; here order does).
        op: ``bitscom.Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor, postscale_factor: multiply each rank's tensor before, and the
            result after, the reduction (floating-point tensors only).
        process_group: the torch ProcessGroup to reduce over (default: the world).

    Example::

        h = bitscom.allreduce_async(metric, name="val_loss")
        avg = bitscom.synchronize(h)
    """
    return _allreduce_async("allreduce_async", tensor, None, average, name, op, prescale_factor,
                            postscale_factor, process_group, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None, *, process_group=None) -> Handle:
    """In-place :func:`allreduce_async`: ``tensor`` holds the result after :func:`synchronize`.

    Example::

        h = bitscom.allreduce_async_(buf, op=bitscom.Sum)
        bitscom.synchronize(h)      # buf now holds the sum
    """
    _check_tensor("allreduce_async_", tensor)
    return _allreduce_async("allreduce_async_", tensor, tensor, average, name, op,
                            prescale_factor, postscale_factor, process_group, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None, *, process_group=None) -> torch.Tensor:
    """In place: ``tensor`` becomes the average (or ``op``) over ranks; returns ``tensor``.

    Example::

        bitscom.allreduce_(counts, op=bitscom.Sum)
    """
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set,
                                        process_group=process_group))


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, group):
        ctx.args = (op, pre, post, group)
        return synchronize(_allreduce_async("allreduce", tensor, None, None, name, op, pre, post,
                                            group, None))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, group = ctx.args
        # d(out)/d(x_r) is pre*post (/size for Average) for every rank's output: reduce again.
        return allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post,
                         process_group=group), None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None, *,
              process_group=None) -> torch.Tensor:
    """Return the average (or ``op``) of ``tensor`` over ranks; the input is not modified.

    Differentiable for ``Average``/``Sum`` (the gradient is reduced the same way), like
    Horovod's. ``compression`` takes ``bitscom.Compression.none/fp16/bf16`` or a Horovod-style
    codec (``compress(t) -> (t, ctx)``, ``decompress(t, ctx)``): the compressed tensor is what
    travels and is reduced. Other arguments as in :func:`allreduce_async`.

    Example::

        avg_loss = bitscom.allreduce(torch.tensor(loss), name="loss")
        total = bitscom.allreduce(correct, op=bitscom.Sum)
        half = bitscom.allreduce(grad, compression=bitscom.Compression.fp16)
    """
    _check_tensor("allreduce", tensor)
    if not (is_codec(compression) or isinstance(compression, (NoneCompressor, FP16Compressor,
                                                              BF16Compressor))):
        raise TypeError("compression must be bitscom.Compression.none/fp16/bf16 or a Horovod-style "
                        f"codec with compress/decompress; got {compression!r} (for low-bit "
                        "collectives use bitscom.LowBitGroup)")
    op = _resolve_op(op, average)
    group = _resolve_group(process_group, process_set)
    wire, ctx = compression.compress(tensor)
    if torch.is_grad_enabled() and wire.requires_grad and op in (Average, Sum):
        out = _AllreduceFn.apply(wire, name, op, float(prescale_factor), float(postscale_factor),
                                 group)
    else:
        out = synchronize(_allreduce_async("allreduce", wire.detach(), None, None, name, op,
                                           prescale_factor, postscale_factor, group, None))
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None, *, process_group=None) -> list:
    """Reduce a list of tensors (Horovod's ``grouped_allreduce``); returns new tensors.

    Example::

        avg_a, avg_b = bitscom.grouped_allreduce([a, b])
    """
    handles = [allreduce_async(t, average, None if name is None else f"{name}.{i}", op,
                               prescale_factor, postscale_factor, process_set,
                               process_group=process_group) for i, t in enumerate(tensors)]
    return [synchronize(h) for h in handles]


# -- allgather ---------------------------------------------------------------------------------
def _allgather_rounds(name, tensor, group) -> Iterator:
    err = 4 if tensor.dim() == 0 else (1 if tensor.dim() > _MAX_DIMS else 0)
    if group is None or dist.get_world_size(group) == 1:
        if err:
            raise ValueError(f"bitscom.allgather: {_ERRORS[err]}")
        return tensor.detach().clone()
    later = _payload_group(group)
    rows = yield from _negotiate("allgather", name, group, tensor, _KINDS["allgather"], err=err)
    world = len(rows)
    dims = [row[_H_FIXED] for row in rows]
    rest = math.prod(tensor.shape[1:])
    longest = max(dims)
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    send = flat if dims[0] == longest and len(set(dims)) == 1 else \
        torch.cat([flat, flat.new_zeros((longest - tensor.shape[0]) * rest)])
    recv = send.new_empty(world * longest * rest)
    yield _all_gather_flat(recv, send.contiguous(), group=later, async_op=True)
    parts = [recv[r * longest * rest: (r * longest + dims[r]) * rest] for r in range(world)]
    out = torch.cat(parts) if len(set(dims)) > 1 else recv
    if tensor.dtype == torch.bool:
        out = out.view(torch.bool)
    return out.view(sum(dims), *tensor.shape[1:])


def allgather_async(tensor, name=None, process_set=None, *, process_group=None) -> Handle:
    """Start concatenating every rank's ``tensor`` along dimension 0 (sizes of dimension 0
    may differ between ranks; the other dimensions must agree).

    Example::

        h = bitscom.allgather_async(predictions)
        all_predictions = bitscom.synchronize(h)
    """
    _check_tensor("allgather_async", tensor)
    _check_name(name)
    group = _resolve_group(process_group, process_set)
    return _submit("allgather", name, _allgather_rounds(name, tensor, group))


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, group):
        ctx.group = group
        ctx.dim = tensor.shape[0]
        return synchronize(allgather_async(tensor, name, process_group=group))

    @staticmethod
    def backward(ctx, grad):
        # Every rank's loss may use every slice: sum the gradients, keep this rank's slice.
        summed = allreduce(grad, op=Sum, process_group=ctx.group)
        dims = synchronize(allgather_async(torch.tensor([ctx.dim]), process_group=ctx.group))
        me = dist.get_rank(ctx.group) if ctx.group is not None else 0
        offset = int(dims[:me].sum())
        return summed.narrow(0, offset, ctx.dim), None, None


def allgather(tensor, name=None, process_set=None, *, process_group=None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0; differentiable.

    Example::

        everyone = bitscom.allgather(torch.tensor([bitscom.rank()]))   # tensor([0, 1, ...])
    """
    _check_tensor("allgather", tensor)
    group = _resolve_group(process_group, process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _AllgatherFn.apply(tensor, name, group)
    return synchronize(allgather_async(tensor, name, process_group=group))


# -- broadcast ---------------------------------------------------------------------------------
def _broadcast_rounds(fn, name, out, root_rank, group) -> Iterator:
    if group is None or dist.get_world_size(group) == 1:
        if root_rank not in (0, runtime.rank() if runtime.is_initialized() else 0):
            raise ValueError(f"bitscom.{fn}: root_rank {root_rank} is not a rank of the group")
        return out
    later = _payload_group(group)
    yield from _negotiate(fn, name, group, out, _KINDS["broadcast"], root=root_rank)
    ranks = dist.get_process_group_ranks(group)
    if root_rank not in ranks:
        raise ValueError(f"bitscom.{fn}: root_rank {root_rank} is not a rank of the group "
                         f"(its global ranks are {ranks})")
    buf = out.detach() if out.is_contiguous() else out.detach().contiguous()
    wire = buf.view(torch.uint8) if buf.dtype == torch.bool else buf
    yield dist.broadcast(wire, src=root_rank, group=later, async_op=True)
    if not out.is_contiguous():
        out.detach().copy_(buf)
    return out


def _broadcast_async(fn, tensor, out, root_rank, name, process_group, process_set) -> Handle:
    _check_tensor(fn, tensor)
    _check_name(name)
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"root_rank must be an int (a global rank), got {root_rank!r}")
    group = _resolve_group(process_group, process_set)
    out = tensor.detach().clone() if out is None else out
    return _submit(fn, name, _broadcast_rounds(fn, name, out, root_rank, group))


def broadcast_async(tensor, root_rank, name=None, process_set=None, *,
                    process_group=None) -> Handle:
    """Start copying ``root_rank``'s ``tensor`` to every rank into a new tensor.

    ``root_rank`` is a global rank (torch's convention), also with ``process_group``.

    Example::

        h = bitscom.broadcast_async(seed, root_rank=0)
        seed = bitscom.synchronize(h)
    """
    return _broadcast_async("broadcast_async", tensor, None, root_rank, name, process_group,
                            process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None, *,
                     process_group=None) -> Handle:
    """In-place :func:`broadcast_async`.

    Example::

        bitscom.synchronize(bitscom.broadcast_async_(weights, root_rank=0))
    """
    _check_tensor("broadcast_async_", tensor)
    return _broadcast_async("broadcast_async_", tensor, tensor, root_rank, name,
                            process_group, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=None, *,
               process_group=None) -> torch.Tensor:
    """In place: ``tensor`` becomes ``root_rank``'s; returns ``tensor``.

    Example::

        bitscom.broadcast_(model.fc.weight.data, root_rank=0)
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set,
                                        process_group=process_group))


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, group):
        ctx.args = (root_rank, group)
        return synchronize(_broadcast_async("broadcast", tensor, None, root_rank, name, group,
                                            None))

    @staticmethod
    def backward(ctx, grad):
        root_rank, group = ctx.args
        # Only root's tensor reaches the outputs: it gets the sum of every rank's gradient.
        summed = allreduce(grad, op=Sum, process_group=group)
        me = dist.get_rank() if dist.is_initialized() else 0
        if me != root_rank:
            summed.zero_()
        return summed, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=None, *,
              process_group=None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank (a new tensor); differentiable.

    Example::

        start = bitscom.broadcast(torch.randn(10), root_rank=0)
    """
    _check_tensor("broadcast", tensor)
    group = _resolve_group(process_group, process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _BroadcastFn.apply(tensor, root_rank, name, group)
    return synchronize(_broadcast_async("broadcast", tensor, None, root_rank, name, group, None))


# -- alltoall ----------------------------------------------------------------------------------
def _split_list(splits, tensor, world) -> tuple:
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


def _alltoall_rounds(name, tensor, splits, group, want_splits) -> Iterator:
    world = 1 if group is None else dist.get_world_size(group)
    values, err = _split_list(splits, tensor, world)
    if err == 0 and tensor.dim() > _MAX_DIMS:
        err = 1
    if world == 1:
        if err:
            raise ValueError(f"bitscom.alltoall: {_ERRORS[err]}")
        out = tensor.detach().clone()
        received = torch.tensor(values, dtype=torch.int32)
        return (out, received) if want_splits else out
    later = _payload_group(group)
    rows = yield from _negotiate("alltoall", name, group, tensor, _KINDS["alltoall"], err=err,
                                 extra=values)
    me = dist.get_rank(group)
    matrix = [row[_H_FIXED + _MAX_DIMS:] for row in rows]           # matrix[r][j]: r sends to j
    received = [matrix[r][me] for r in range(world)]
    rest = math.prod(tensor.shape[1:])
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    out = flat.new_empty(sum(received) * rest)
    yield dist.all_to_all_single(out, flat, [n * rest for n in received],
                                 [n * rest for n in values], group=later,
                                 async_op=True)
    if tensor.dtype == torch.bool:
        out = out.view(torch.bool)
    out = out.view(sum(received), *tensor.shape[1:])
    return (out, torch.tensor(received, dtype=torch.int32)) if want_splits else out


def alltoall_async(tensor, splits=None, name=None, process_set=None, *,
                   process_group=None) -> Handle:
    """Start an all-to-all: rows ``splits[j]`` of ``tensor`` (dimension 0, in order) go to rank
    ``j``; without ``splits`` dimension 0 is cut into equal parts. :func:`synchronize` returns
    the received rows, and with ``splits`` also the received split sizes (int32).

    Example::

        out, received = bitscom.synchronize(bitscom.alltoall_async(x, splits=[1, 3]))
    """
    _check_tensor("alltoall_async", tensor)
    _check_name(name)
    group = _resolve_group(process_group, process_set)
    return _submit("alltoall", name, _alltoall_rounds(name, tensor, splits, group,
                                                      splits is not None))


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, group):
        ctx.group = group
        out, received = synchronize(_submit("alltoall", name, _alltoall_rounds(
            name, tensor, splits, group, True)))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _unused):
        # The adjoint of an all-to-all sends every received row back where it came from.
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received,
                                             process_group=ctx.group))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=None, *, process_group=None):
    """All-to-all (see :func:`alltoall_async`); returns the received tensor, or
    ``(tensor, received_splits)`` when ``splits`` is given. Differentiable.

    Example::

        shards = bitscom.alltoall(torch.arange(4.0))          # 2 ranks: 2 rows to each
        rows, received = bitscom.alltoall(x, splits=torch.tensor([3, 1]))
    """
    _check_tensor("alltoall", tensor)
    _check_name(name)
    group = _resolve_group(process_group, process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        out, received = _AlltoallFn.apply(tensor, splits, name, group)
        return out if splits is None else (out, received)
    return synchronize(alltoall_async(tensor, splits, name, process_group=group))


# -- objects and barrier -----------------------------------------------------------------------
def allgather_object(obj, name=None, process_set=None, *, process_group=None) -> list:
    """Return the list of every rank's ``obj`` (any picklable object), in rank order.

    Example::

        counts = bitscom.allgather_object(len(local_dataset))
    """
    _check_name(name)
    group = _resolve_group(process_group, process_set)
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    _progress()
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)    # NCCL: uses the current CUDA device
    return out


def barrier(process_set=None, *, process_group=None) -> None:
    """Block until every rank of the group reached this call (Horovod's ``hvd.barrier``).

    Example::

        if bitscom.rank() == 0:
            prepare_dataset()
        bitscom.barrier()
    """
    group = _resolve_group(process_group, process_set)
    if group is not None and dist.get_world_size(group) > 1:
        dist.barrier(group=group)
