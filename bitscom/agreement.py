"""Cross-rank agreement on the reduction plan: different plans would exchange misaligned bytes
or hang, so one ``all_gather_object`` (peer data: docs/reliability.md) makes them one error."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist

__all__ = ["check_agreement", "describe_state", "require_member", "PROBLEM"]

PROBLEM = "checkpoint problem"
"""The description entry of a rank's refused checkpoint: the error every rank raises first."""


def require_member(group, what: str) -> None:
    """Raise a clear error on a rank that is not in ``group`` (torch would fail obscurely)."""
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"{what}: this process (global rank {dist.get_rank()}) is not a member of "
                         f"the process group (ranks {dist.get_process_group_ranks(group)}); call it "
                         "on member ranks only")


def describe_state(state: Any) -> Any:
    """What must agree in a compressor state: counters, flags, shapes (residuals differ by design)."""
    if hasattr(state, "state_dict") and not isinstance(state, dict):
        state = state.state_dict()
    if isinstance(state, dict):
        return {str(k): describe_state(v) for k, v in sorted(state.items(), key=lambda kv: str(kv[0]))}
    if isinstance(state, torch.Tensor):
        return ("tensor", tuple(state.shape), str(state.dtype))
    if isinstance(state, (list, tuple)):
        return [describe_state(v) for v in state]
    if state is None or isinstance(state, (bool, int, str)):
        return state
    return type(state).__name__


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{len(a)} entries vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"entry {i}: {_short(x)} vs {_short(y)}"
    return f"{_short(a)} vs {_short(b)}"


def check_agreement(description: Dict[str, Any], group=None, what: str = "reduction plan") -> None:
    """Raise the same ``RuntimeError`` on every rank unless all ranks pass equal descriptions."""
    require_member(group, f"the {what} check")
    size = dist.get_world_size(group)
    gathered: List[Any] = [None] * size
    dist.all_gather_object(gathered, description, group=group)
    reported = [d.get(PROBLEM) for d in gathered if isinstance(d, dict) and d.get(PROBLEM)]
    if reported:                 # the cause: a refused load also makes the resumed states differ
        raise RuntimeError(reported[0])
    reference = gathered[0]
    problems = []
    for r, desc in enumerate(gathered[1:], start=1):
        if desc == reference:
            continue
        # rank 0's order (a description leads with what matters most), then the other rank's keys
        for key in list(reference) + sorted(set(desc) - set(reference), key=str):
            if reference.get(key) != desc.get(key):
                problems.append(f"rank {r} differs from rank 0 in {key}: "
                                f"rank 0 vs rank {r}: {_first_difference(reference.get(key), desc.get(key))}")
                break
    if problems:
        raise RuntimeError(f"bitscom: ranks disagree on the {what}; every rank must build the "
                           f"same model, optimizer and compressor settings. " + "; ".join(problems))
