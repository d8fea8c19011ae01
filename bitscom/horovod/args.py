"""Argument checks shared by the Horovod face's calls (local: they raise before any collective)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..ops import Adasum, Average, ReduceOp, Sum
from ..validate import choice, instance
from .groups import face_group
from .negotiation import DTYPES, OPS

__all__ = ["resolve_op", "check_tensor", "check_name", "check_root", "label", "call_group"]


def resolve_op(op: Optional[ReduceOp], average: Optional[bool]) -> ReduceOp:
    """The reduce op from Horovod's ``op=`` or its deprecated ``average=``."""
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    op = Average if op is None else op
    if op is Adasum:
        raise NotImplementedError("hvd.Adasum is not supported by bitscom; use op=bitscom.Average "
                                  "(or a compressor to cut traffic)")
    return choice("op", op, tuple(OPS))


def check_tensor(fn: str, tensor: Any) -> None:
    """A dense tensor of a dtype the header can describe."""
    instance(f"bitscom.{fn} tensor", tensor, torch.Tensor, "a torch.Tensor")
    if tensor.is_sparse:
        raise TypeError(f"bitscom.{fn} reduces dense tensors; got a sparse tensor (call .to_dense())")
    if tensor.dtype not in DTYPES:
        raise TypeError(f"bitscom.{fn}: dtype {tensor.dtype} is not supported; supported: "
                        f"{[str(d).replace('torch.', '') for d in DTYPES]}")


def check_name(name: Any) -> None:
    """Horovod's ``name=``: a label for error messages."""
    instance("name", name, (str, type(None)), "a str or None")


def check_root(root_rank: Any) -> None:
    """``root_rank`` is a global rank (an int)."""
    instance("root_rank", root_rank, int, "an int (a global rank)")


def label(fn: str, name: Optional[str]) -> str:
    """How errors name a call: ``bitscom.allreduce 'loss'``."""
    return f"bitscom.{fn}" + ("" if name is None else f" {name!r}")


def call_group(fn: str, tensor: Any, name: Any, process_group: Any, process_set: Any) -> Optional[Any]:
    """The group call ``fn`` runs on, after checking its ``tensor`` and ``name``."""
    check_tensor(fn, tensor)
    check_name(name)
    return face_group(process_group, process_set, label(fn, name))
