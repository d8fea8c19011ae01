"""Sparse all-reduce (Horovod's ``sparse_allreduce_async``, DistributedOptimizer's sparse path):
every rank's indices and values are all-gathered and summed in rank order into one coalesced
tensor, the same bits on every rank (docs/horovod.md, Sparse tensors).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Generator, List, Optional, Sequence, Set, Tuple, cast

import torch

from ..face import live_objects
from ..comm import Comm, drive
from ..ops import Average, ReduceOp, Sum
from ..validate import choice, instance
from .args import check_name, label, resolve_op
from .failures import guard
from .groups import face_comm, face_group
from .handles import Handle, submit, synchronize
from .negotiation import DTYPES, H_FIXED, KINDS, MAX_DIMS, OPS, negotiate

__all__ = ["SparseHandle", "sparse_allreduce_async", "sparse_allreduce", "sparse_embedding_weights", "SparseGradients"]

KIND = KINDS["sparse_allreduce"]
NONE, SPARSE, DENSE = 0, 1, 2
"""A rank's layout in the header: no gradient, a sparse one, a dense one (the optimizer's)."""
_NNZ = H_FIXED + MAX_DIMS           # the header's first extra field: nnz; the second: layout code
_LAYOUT_NAMES = {NONE: "no gradient", SPARSE: "sparse", DENSE: "dense"}


def _check_sparse(fn: str, tensor: Any) -> None:
    instance(f"bitscom.{fn} tensor", tensor, torch.Tensor, "a torch.Tensor")
    if tensor.layout != torch.sparse_coo:
        raise TypeError(f"bitscom.{fn} reduces sparse COO tensors; got layout {tensor.layout} "
                        "(use bitscom.allreduce for dense tensors, or .to_sparse())")
    if tensor.dtype not in DTYPES or tensor.dtype == torch.bool:
        raise TypeError(f"bitscom.{fn}: dtype {tensor.dtype} is not supported; supported: "
                        f"{[str(d).replace('torch.', '') for d in DTYPES if d != torch.bool]}")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"bitscom.{fn}: the tensor has {tensor.dim()} dimensions; at most "
                         f"{MAX_DIMS} are supported")


def _check_rows(lbl: str, rows: List[List[int]]) -> Optional[Tuple[List[int], int]]:
    """(every rank's nnz, the common sparse_dim), or ``None`` when no rank is sparse."""
    layouts = [row[_NNZ + 1] % 4 for row in rows]
    if SPARSE not in layouts:
        return None
    if DENSE in layouts:
        seen = ", ".join(f"rank {r}: {_LAYOUT_NAMES[x]}" for r, x in enumerate(layouts))
        raise RuntimeError(f"{lbl}: the gradient is sparse on some ranks and dense on others "
                           f"({seen}); every rank must compute it the same way, or pass "
                           "sparse_as_dense=True to reduce it as a dense tensor everywhere")
    dims = {row[_NNZ + 1] // 4 for row, x in zip(rows, layouts) if x == SPARSE}
    if len(dims) > 1:
        seen = ", ".join(f"rank {r}: {row[_NNZ + 1] // 4}" for r, row in enumerate(rows))
        raise RuntimeError(f"{lbl}: ranks disagree on sparse_dim ({seen})")
    return [row[_NNZ] for row in rows], dims.pop()


def _combine(parts: Sequence[Tuple[torch.Tensor, torch.Tensor]], shape: torch.Size, sparse_dim: int) -> torch.Tensor:
    """Sum every rank's (unique-index) rows in rank order into one coalesced sparse tensor."""
    indices = torch.cat([i for i, _ in parts], dim=1)
    values = parts[0][1]
    if sparse_dim == 1:
        uniq, inverse = torch.unique(indices[0], sorted=True, return_inverse=True)
        uniq = uniq.unsqueeze(0)
    else:
        uniq, inverse = torch.unique(indices, dim=1, sorted=True, return_inverse=True)
    out = values.new_zeros((uniq.shape[1],) + tuple(values.shape[1:]))
    offset = 0
    for i, v in parts:             # positions are unique within a rank: exact, in rank order
        n = i.shape[1]
        out.index_add_(0, inverse[offset:offset + n], v)
        offset += n
    return torch.sparse_coo_tensor(uniq, out, shape, is_coalesced=True)


def _apply_op(result: torch.Tensor, op: ReduceOp, size: int) -> torch.Tensor:
    if op is Average and size > 1:
        values = result.values()
        values.div_(size, rounding_mode=None if values.is_floating_point() or values.is_complex() else "trunc")
    return result


def _gather(lbl: str, comm: Comm, local: Tuple[torch.Tensor, torch.Tensor], counts: List[int],
            sparse_dim: int, dense: Tuple[int, ...],
            dtype: torch.dtype) -> Generator[Any, None, List[Tuple[torch.Tensor, torch.Tensor]]]:
    """Round: all-gather the padded indices and values; returns every rank's (indices, values)."""
    longest, row = max(counts), math.prod(dense)
    indices, values = local
    device = values.device
    send_i = torch.zeros(sparse_dim, longest, dtype=torch.int64, device=device)
    send_v = torch.zeros(longest * row, dtype=dtype, device=device)
    send_i[:, :indices.shape[1]] = indices
    send_v[:values.numel()] = values.reshape(-1)
    recv_i = send_i.new_empty(comm.size * send_i.numel())
    recv_v = send_v.new_empty(comm.size * send_v.numel())
    yield [guard(comm.all_gather(recv_i, send_i.view(-1)), lbl), guard(comm.all_gather(recv_v, send_v), lbl)]
    recv_i = recv_i.view(comm.size, sparse_dim, longest)
    recv_v = recv_v.view((comm.size, longest) + dense)
    return [(recv_i[r, :, :n], recv_v[r, :n]) for r, n in enumerate(counts)]


def reduce_rounds(lbl: str, template: torch.Tensor, local: Optional[torch.Tensor], layout: int,
                  op: ReduceOp, comm: Optional[Comm]) -> Generator[Any, None, Optional[torch.Tensor]]:
    """Round generator: the sum (or average) of every rank's sparse ``local`` as a coalesced
    sparse tensor shaped like ``template``; ``None`` when no rank holds a sparse tensor.

    ``layout`` says what this rank holds (:data:`SPARSE`, or for the optimizer :data:`NONE` or
    :data:`DENSE`, an error when another rank is sparse).
    """
    shape = template.shape
    if layout == SPARSE:
        if local is None:
            raise ValueError(f"{lbl}: layout SPARSE needs this rank's sparse tensor, got None")
        coalesced = local.detach().coalesce()          # unique indices
        indices, values, sparse_dim = coalesced.indices(), coalesced.values(), local.sparse_dim()
    else:
        sparse_dim = 0
        indices = torch.zeros(0, 0, dtype=torch.int64, device=template.device)
        values = torch.zeros(0, dtype=template.dtype, device=template.device)
    if comm is None:                                   # one rank: nothing to average
        return _combine([(indices, values)], shape, sparse_dim) if layout == SPARSE else None
    rows = yield from negotiate(comm, lbl, template, KIND, OPS[op], extra=[indices.shape[1], layout + 4 * sparse_dim])
    checked = _check_rows(lbl, rows)
    if checked is None:
        return None
    counts, sparse_dim = checked
    dense = tuple(shape[sparse_dim:])
    if max(counts) == 0:
        empty = torch.sparse_coo_tensor(torch.zeros(sparse_dim, 0, dtype=torch.int64),
                                        torch.zeros((0,) + dense, dtype=template.dtype), shape, device=template.device)
        return empty.coalesce()
    if layout != SPARSE:
        indices = indices.new_zeros(sparse_dim, 0)
    parts = yield from _gather(lbl, comm, (indices, values), counts, sparse_dim, dense, template.dtype)
    return _apply_op(_combine(parts, shape, sparse_dim), op, comm.size)


class SparseHandle(Handle):
    """The handle of :func:`sparse_allreduce_async`: pass it to :func:`bitscom.synchronize`,
    or call it as Horovod's is called (``handle()`` returns the result).

    Example::

        avg = bitscom.sparse_allreduce_async(grad, name="emb")()
    """

    def __call__(self) -> torch.Tensor:
        return synchronize(self)


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None, op: Optional[ReduceOp] = Average,
                           process_set: Any = None, *, process_group: Any = None) -> SparseHandle:
    """Start reducing a sparse COO ``tensor`` over ranks (Horovod's ``sparse_allreduce_async``).

    The result is coalesced and bitwise the same on every rank (nnz may differ between ranks;
    shape, dtype and ``sparse_dim`` must agree); ``op``: ``bitscom.Average`` or ``Sum``.

    Example::

        h = bitscom.sparse_allreduce_async(emb.weight.grad, name="emb", op=bitscom.Average)
        avg = bitscom.synchronize(h)          # or h(), as in Horovod
    """
    _check_sparse("sparse_allreduce_async", tensor)
    check_name(name)
    op = choice("sparse_allreduce op", resolve_op(op, None), (Average, Sum))
    lbl = label("sparse_allreduce_async", name)
    group = face_group(process_group, process_set, lbl)
    comm = face_comm(group, lbl)
    handle = submit("sparse_allreduce_async", name, reduce_rounds(lbl, tensor, tensor, SPARSE, op, comm), comm)
    handle.__class__ = SparseHandle         # same object: it stays in the call-order queue
    return cast(SparseHandle, handle)       # the class assignment above, which mypy does not follow


def sparse_allreduce(tensor: torch.Tensor, name: Optional[str] = None, op: Optional[ReduceOp] = Average,
                     process_set: Any = None, *, process_group: Any = None) -> torch.Tensor:
    """Return the average (or sum) of a sparse COO ``tensor`` over ranks, coalesced; see
    :func:`sparse_allreduce_async`.

    Example::

        avg = bitscom.sparse_allreduce(emb.weight.grad)
    """
    return synchronize(sparse_allreduce_async(tensor, name, op, process_set, process_group=process_group))


def sparse_embedding_weights(params: Sequence[torch.Tensor], objects: Optional[list] = None) -> Set[int]:
    """The ids of those ``params`` that are the weight of an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` built with ``sparse=True``: known up front on every rank, also on one
    whose batch made no gradient (why by module: docs/horovod.md)."""
    ours = {id(p) for p in params}
    found: Set[int] = set()
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    for obj in (live_objects(kinds) if objects is None else objects):
        if isinstance(obj, kinds) and obj.sparse:
            weight = getattr(obj, "weight", None)
            if weight is not None and id(weight) in ours:
                found.add(id(weight))
    return found


class SparseGradients:
    """DistributedOptimizer's sparse path (``sparse_as_dense=False``): state of one optimizer."""

    def __init__(self, trainable: Sequence[Tuple[str, torch.Tensor]], objects: Optional[list] = None):
        ids = sparse_embedding_weights([p for _, p in trainable], objects)
        self.params: List[Tuple[str, torch.Tensor]] = [(n, p) for n, p in trainable if id(p) in ids]
        self.ids = {id(p) for _, p in self.params}
        self.stash: Dict[int, torch.Tensor] = {}
        self.dense: Set[int] = set()
        self.armed_task: Optional[int] = None

    def on_gradient(self, opt, p: torch.Tensor, last_pass: bool) -> bool:
        """Whether ``p`` is on the sparse path (then the caller zeros its slot on the last pass)."""
        grad = p.grad
        sparse_grad = grad if grad is not None and grad.is_sparse else None
        sparse = sparse_grad is not None
        if id(p) not in self.ids:
            if sparse:
                raise TypeError(
                    f"parameter {opt._name_of(p)!r} has a sparse gradient but is not the weight of "
                    "an nn.Embedding/nn.EmbeddingBag(sparse=True), so the other ranks cannot know "
                    "to reduce it as sparse; pass sparse_as_dense=True")
            if last_pass and self.ids:
                self._arm(opt)           # also where this rank's sparse-path gradients are None
            return False
        if last_pass:
            self._arm(opt)
            if sparse_grad is None:
                self.dense.add(id(p))
                return False
            self.stash[id(p)] = sparse_grad
            p.grad = None
        return sparse

    def _arm(self, opt) -> None:
        """Start this step's record on the completing pass's first sparse-path event."""
        task = torch._C._current_graph_task_id()
        if task == self.armed_task:
            return
        self.armed_task = task
        self.stash, self.dense = {}, set()

    def finish(self, opt) -> None:
        """Reduce every sparse-path gradient (every rank, plan order) into ``p.grad``."""
        stash, dense = self.stash, self.dense
        self.stash, self.dense, self.armed_task = {}, set(), None
        if opt is None or not opt._life.completed or opt._life.closed:
            return                       # the dense reduction did not complete: nothing to add
        comm = Comm(opt.process_group)
        for name, p in self.params:
            grad = stash.get(id(p))
            layout = SPARSE if grad is not None else (DENSE if id(p) in dense else NONE)
            lbl = f"bitscom.DistributedOptimizer sparse gradient {name!r}"
            result = drive(reduce_rounds(lbl, p.detach(), grad, layout, opt.op, comm), comm)
            if result is not None:
                p.grad = result
        opt._bytes.add(comm.bytes_sent, 0)


