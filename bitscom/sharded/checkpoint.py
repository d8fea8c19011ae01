"""World-size-independent (*consolidated*) checkpoints of a sharded optimizer: every rank
loading one cuts out the pieces it owns under its own plan (the format: docs/sharded.md).
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch

__all__ = ["FORMAT", "piece_state", "join_pieces", "split_state"]

FORMAT = "bitscom.sharded/1"


def piece_state(name: str, key: str, value, numel: int):
    """Classify one state entry of a piece: ('scalar', v) or ('elements', 1-D tensor)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return "scalar", value.detach().clone()
        if value.numel() == numel:
            return "elements", value.detach().reshape(-1).clone()
        raise ValueError(f"optimizer state {key!r} of parameter {name!r} has shape {tuple(value.shape)}, "
                         f"neither a scalar nor one entry per element ({numel}); only elementwise "
                         "optimizers can be sharded")
    return "scalar", value


def _put_state(state: dict, elem_keys: set, piece: dict, start: int, stop: int, numel: int) -> None:
    """Add one piece's optimizer state: scalars once, per-element tensors into their full one."""
    for key, (kind, v) in piece.items():
        if kind == "scalar":
            state.setdefault(key, v)
        else:
            elem_keys.add(key)
            if key not in state:
                state[key] = torch.zeros(numel, dtype=v.dtype)
            state[key][start:stop] = v


def join_pieces(contributions: List[dict], shapes: Dict[str, tuple], dtype_of: Dict[str, torch.dtype]) -> dict:
    """Per-rank ``{name: [(start, stop, master, replica, state), ...]}`` joined into whole parameters."""
    out = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        master = torch.zeros(numel, dtype=torch.float64 if dtype_of[name] == torch.float64 else torch.float32)
        replica = torch.zeros(numel, dtype=dtype_of[name])
        state: dict = {}
        elem_keys: set = set()
        covered = 0
        for contrib in contributions:
            for start, stop, m, rep, st in contrib.get(name, []):
                master[start:stop] = m
                replica[start:stop] = rep
                covered += stop - start
                _put_state(state, elem_keys, st, start, stop, numel)
        if covered != numel:
            raise RuntimeError(f"parameter {name!r}: pieces cover {covered} of {numel} elements")
        out[name] = {"master": master.view(shape), "replica": replica.view(shape),
                     "state": {k: (v.view(shape) if k in elem_keys else v) for k, v in state.items()},
                     "element_keys": sorted(elem_keys)}
    return out


def split_state(entry: dict, start: int, stop: int) -> dict:
    """The optimizer state of elements ``[start, stop)`` of one parameter's consolidated entry."""
    numel = entry["master"].numel()
    out = {}
    elements = set(entry.get("element_keys", ()))
    for key, v in entry["state"].items():
        if key in elements:
            if v.numel() != numel:
                raise ValueError(f"checkpoint state {key!r} has {v.numel()} elements, the parameter {numel}")
            out[key] = v.reshape(-1)[start:stop].clone()
        else:
            out[key] = v.clone() if isinstance(v, torch.Tensor) else v
    return out
