"""What both optimizers' DCP checkpoints share: DCP calls over the optimizer's group, a checkpoint's key list, and
splitting a nested state into tensors (one DCP entry each) and a pickled *skeleton* (why: docs/checkpoints.md, "Key
layout"). Loading unpickles the skeletons, as ``torch.load(weights_only=False)`` does: load checkpoints you wrote.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Dict, List

import torch

from ..validate import instance

__all__ = ["blob", "unblob", "split_tensors", "join_tensors", "digest", "read_entries",
           "template", "save_dict", "load_dict"]

_MARK = "__bitscom_tensor__"


def _dcp():
    """``torch.distributed.checkpoint``, imported on first use: it pulls in DTensor and sympy
    (about 2 s of CPU) that every ``import bitscom`` would otherwise pay."""
    import torch.distributed.checkpoint as dcp
    return dcp


def blob(value: Any) -> bytes:
    """``value`` pickled: one opaque DCP entry (DCP would otherwise flatten a nested dict)."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def unblob(data: Any) -> Any:
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"expected a bitscom skeleton entry (bytes), got {type(data).__name__}")
    return pickle.loads(data)


def split_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``{_MARK: i}`` (appended to ``tensors``)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {_MARK: len(tensors) - 1}
    if isinstance(obj, dict):
        return {k: split_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(split_tensors(v, tensors) for v in obj)
    return obj


def join_tensors(skeleton: Any, tensors: Dict[int, torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_MARK}:
            return tensors[skeleton[_MARK]]
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(join_tensors(v, tensors) for v in skeleton)
    return skeleton


def digest(tensor: torch.Tensor) -> str:
    """A hash of a tensor's dtype, shape and bytes: tells after the fact, with no collective at save
    time, whether a state tensor was the same on every rank."""
    t = tensor.detach().cpu().contiguous().reshape(-1)
    h = hashlib.blake2b(f"{t.dtype}{tuple(tensor.shape)}".encode(), digest_size=16)
    if t.numel():
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def read_entries(path) -> Dict[str, Any]:
    """Key -> storage metadata of the DCP checkpoint in ``path`` (a file read, no collective)."""
    if not os.path.isdir(os.fspath(path)):
        raise FileNotFoundError(f"no DCP checkpoint directory at {os.fspath(path)!r}")
    return dict(_dcp().FileSystemReader(path).read_metadata().state_dict_metadata)


def template(meta: Any) -> Any:
    """An empty load target for one entry: a CPU tensor of its shape and dtype, or ``b""``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    if isinstance(meta, TensorStorageMetadata):
        return torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    if isinstance(meta, BytesStorageMetadata):
        return b""
    raise TypeError(f"unexpected DCP entry {type(meta).__name__}")


def _kwargs(group) -> dict:
    return {"process_group": group} if group is not None else {"no_dist": True}


def save_dict(state: dict, path, group) -> None:
    """``dcp.save`` by every rank of ``group`` (one process: no collectives)."""
    _dcp().save(state, checkpoint_id=os.fspath(path), **_kwargs(group))


def load_dict(state: dict, path, group) -> dict:
    """``dcp.load`` in place into ``state`` by every rank of ``group``; returns ``state``."""
    _dcp().load(state, checkpoint_id=os.fspath(path), **_kwargs(group))
    return state


def check_extra(extra) -> dict:
    """The user's own entries saved with the optimizer (e.g. ``{"model": model.state_dict()}``)."""
    if extra is None:
        return {}
    instance("extra", extra, dict, "a dict of DCP state (e.g. {'model': model.state_dict()})")
    bad = [k for k in extra if not isinstance(k, str) or k.startswith("bitscom")]
    if bad:
        raise ValueError(f"extra keys must be strings not starting with 'bitscom' (reserved), got {bad}")
    return extra
