"""The negotiation round: every call first all-gathers a header describing it, so a mismatch
(or a data-dependent argument error) is the same error on every rank, not a hang.

Header layout (int64): kind, op, root, dtype index, prescale bits, postscale bits, error code,
number of dimensions, name hash, shape (padded to :data:`MAX_DIMS` with -1), then ``extra``
(one value per rank: alltoall's splits).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple

import torch

from ..call_header import DTYPES, OPS     # the one op/dtype table
from ..comm import Comm
from .failures import guard
from .groups import group_device

__all__ = ["MAX_DIMS", "H_FIXED", "KINDS", "OPS", "DTYPES", "ERRORS", "ERROR_TYPES", "negotiate", "float_bits",
           "name_hash"]

MAX_DIMS = 16
H_FIXED = 9
KINDS = {"allreduce": 1, "allgather": 2, "broadcast": 3, "alltoall": 4, "sparse_allreduce": 5}
ERRORS = {1: f"the tensor has more than {MAX_DIMS} dimensions",
          2: "splits must have one non-negative entry per rank summing to tensor.shape[0]",
          3: "tensor.shape[0] is not divisible by the number of ranks (pass splits=)",
          4: "the tensor must have at least one dimension",
          5: "bool tensors are not reduced; convert to uint8 (Max = any, Min = all)",
          6: "prescale_factor/postscale_factor apply to floating-point tensors, not integer ones",
          7: "op=Min/Max is undefined for complex tensors"}
ERROR_TYPES = {5: TypeError, 6: ValueError, 7: TypeError}
"""The exception an error code raises (on every rank alike; RuntimeError when not listed)."""
_ERROR, _NDIM, _NAME = 6, 7, 8


def name_hash(name: Optional[str]) -> int:
    """A stable 32-bit hash of Horovod's ``name=`` (0 for None), the same in every process."""
    return 0 if name is None else zlib.crc32(name.encode("utf-8")) + 1


def float_bits(x: float) -> int:
    """The IEEE-754 bits of ``x`` as an int64 (scale factors travel exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


# (header index, what it is, how to show it)
_FIELDS: List[Tuple[int, str, Callable[[List[int]], object]]] = [
    (0, "operation", lambda h: next((k for k, v in KINDS.items() if v == h[0]), "?")),
    (1, "op", lambda h: next((o.name.title() for o, v in OPS.items() if v == h[1]), "-")),
    (2, "root_rank", lambda h: h[2]),
    (3, "dtype", lambda h: DTYPES[h[3]]),
    (4, "prescale_factor", lambda h: _bits_float(h[4])),
    (5, "postscale_factor", lambda h: _bits_float(h[5])),
    (_NDIM, "number of dimensions", lambda h: h[_NDIM])]


def _header(tensor: torch.Tensor, world: int, kind: int, op: int, root: int, pre: float,
            post: float, err: int, extra: Sequence[int], name: Optional[str]) -> List[int]:
    if tensor.dim() > MAX_DIMS:
        err = err or 1
    shape = list(tensor.shape) if tensor.dim() <= MAX_DIMS else []
    header = [kind, op, root, DTYPES.index(tensor.dtype), float_bits(pre), float_bits(post), err,
              tensor.dim(), name_hash(name)] + shape + [-1] * (MAX_DIMS - len(shape))
    return header + list(extra) + [0] * (world - len(extra))


def _check_errors(label: str, rows: List[List[int]]) -> None:
    for r, row in enumerate(rows):
        if row[_ERROR]:
            raise ERROR_TYPES.get(row[_ERROR], RuntimeError)(
                f"{label}: on rank {r}, {ERRORS.get(row[_ERROR], row[_ERROR])}")


def _check_names(label: str, rows: List[List[int]], name: Optional[str]) -> None:
    if len({row[_NAME] for row in rows}) > 1:
        who = ", ".join(f"rank {r}: {'no name' if not row[_NAME] else 'name hash ' + format(row[_NAME] - 1, '08x')}"
                        for r, row in enumerate(rows))
        raise RuntimeError(f"{label}: ranks submitted differently named calls at the same position "
                           f"(this rank: {name!r}; {who}). bitscom pairs calls by the order they are "
                           "submitted in (Horovod pairs them by name): submit named calls in the same "
                           "order on every rank")


def _check_fields(label: str, rows: List[List[int]]) -> None:
    for index, what, show in _FIELDS:
        if len({row[index] for row in rows}) > 1:
            seen = ", ".join(f"rank {r}: {show(row)}" for r, row in enumerate(rows))
            raise RuntimeError(f"{label}: ranks disagree on the {what} ({seen}); every rank must "
                               "make the same collective calls in the same order")


def _check_shapes(label: str, rows: List[List[int]], kind: int) -> None:
    first_dim_free = kind in (KINDS["allgather"], KINDS["alltoall"])
    dims = rows[0][_NDIM]
    start = H_FIXED + (1 if first_dim_free else 0)
    if len({tuple(row[start:H_FIXED + dims]) for row in rows}) > 1:
        seen = ", ".join(f"rank {r}: {tuple(row[H_FIXED:H_FIXED + dims])}" for r, row in enumerate(rows))
        part = "shape (beyond the first dimension)" if first_dim_free else "shape"
        raise RuntimeError(f"{label}: ranks disagree on the tensor {part} ({seen})")


def negotiate(comm: Comm, label: str, tensor: torch.Tensor, kind: int, op: int = -1, root: int = -1, pre: float = 1.0,
              post: float = 1.0, err: int = 0, extra: Sequence[int] = (),
              name: Optional[str] = None) -> Generator[Any, None, List[List[int]]]:
    """Round generator: every rank's header (in rank order), checked to describe the same call."""
    values = _header(tensor, comm.size, kind, op, root, pre, post, err, extra, name)
    header = torch.tensor(values, dtype=torch.int64, device=group_device(comm.group, tensor))
    everyone = torch.empty(comm.size * header.numel(), dtype=torch.int64, device=header.device)
    yield guard(comm.all_gather(everyone, header), label)
    rows = [[int(x) for x in row] for row in everyone.view(comm.size, -1).cpu()]
    _check_errors(label, rows)
    _check_names(label, rows, name)
    _check_fields(label, rows)
    _check_shapes(label, rows, kind)
    return rows
