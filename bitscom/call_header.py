"""The call header every low-bit collective all-gathers first, and the one op/dtype table: two
int64 per call (docs/design.md) turn mismatched calls into one clear error on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, List

import torch
import torch.distributed as dist

from .ops import Average, Max, Min, Product, Sum

__all__ = ["Call", "check_calls", "agree_rounds", "DTYPES", "OPS"]

_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")     # 2 bits
_OPS = tuple(dist.ReduceOp.RedOpType.__members__)            # SUM, AVG, PRODUCT, MIN, MAX, ...
OPS = {op: int(getattr(dist.ReduceOp.RedOpType, name)) for op, name in
       ((Average, "AVG"), (Sum, "SUM"), (Min, "MIN"), (Max, "MAX"), (Product, "PRODUCT"))}
"""The Horovod-style ops (``bitscom.Average``, ...) as the ``RedOpType`` numbers headers carry."""
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
"""The dtypes a header names (and the Horovod face accepts)."""


@dataclass(frozen=True)
class Call:
    """What one rank called, as the header carries it: kind, op, dtype and element count. Example::

        call = Call.of("all_reduce", dist.ReduceOp.SUM, torch.float32, 1024)
        call.describe()          # 'all_reduce SUM of 1024 torch.float32'
    """

    kind: int
    op: int
    dtype: int
    numel: int

    @classmethod
    def of(cls, kind: str, op, dtype: torch.dtype, numel: int) -> "Call":
        code = DTYPES.index(dtype) + 1 if dtype in DTYPES else 0
        return cls(_KINDS.index(kind), int(getattr(op, "op", op)), code, int(numel))

    def header(self, slot_code: int = 0) -> List[int]:
        return [self.numel, self.kind | self.op << 2 | self.dtype << 6 | slot_code << 12]

    @classmethod
    def decode(cls, row) -> tuple:
        numel, packed = int(row[0]), int(row[1])
        return cls(packed & 3, (packed >> 2) & 15, (packed >> 6) & 63, numel), packed >> 12

    @property
    def name(self) -> str:
        return _KINDS[self.kind]

    def describe(self) -> str:
        op = _OPS[self.op] if self.op < len(_OPS) else f"op {self.op}"
        dtype = DTYPES[self.dtype - 1] if self.dtype else "tensors of another dtype"
        return f"{self.name} {op} of {self.numel} {dtype}"


def check_calls(calls, label: str) -> None:
    """The same error on every rank (they all see the same headers) unless all calls match."""
    if any((c.kind, c.op, c.dtype) != (calls[0].kind, calls[0].op, calls[0].dtype) for c in calls):
        listing = ", ".join(f"rank {r}: {c.describe()}" for r, c in enumerate(calls))
        raise RuntimeError(f"{label}: ranks called different collectives ({listing}); every rank must "
                           "call the same collective with the same reduce op and dtype, in the same order")
    if len({c.numel for c in calls}) > 1:
        listing = ", ".join(f"rank {r}: {c.numel}" for r, c in enumerate(calls))
        raise ValueError(f"low-bit {calls[0].name}: ranks passed tensors with different element counts "
                         f"({listing}); every rank must pass the same number of elements")


def agree_rounds(comm, call: Call, slot_code: int, device, label: str) -> Generator[Any, None, List[int]]:
    """Round generator: all-gather and check every rank's header; returns their slot codes."""
    if comm.size == 1:
        return [slot_code]
    mine = torch.tensor(call.header(slot_code), dtype=torch.int64, device=device)
    seen = torch.empty(comm.size * 2, dtype=torch.int64, device=mine.device)
    yield comm.all_gather(seen, mine)
    decoded = [Call.decode(row) for row in seen.view(comm.size, 2).tolist()]
    check_calls([c for c, _ in decoded], label)
    return [code for _, code in decoded]
