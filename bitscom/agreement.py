"""Cross-rank agreement on the reduction plan, checked once before the first reduction.

Ranks that planned different buckets, shapes or compressor settings would exchange
misaligned bytes (silent corruption) or wait on collectives the others never issue (a
hang). One ``all_gather_object`` of each rank's description turns both into the same clear
error on every rank.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch.distributed as dist

__all__ = ["check_agreement"]


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
    """Raise the same ``RuntimeError`` on every rank unless all ranks pass equal descriptions.

    Example::

        check_agreement({"buckets": [l.describe() for l in layouts]}, group)
    """
    size = dist.get_world_size(group)
    gathered: List[Dict[str, Any]] = [None] * size
    dist.all_gather_object(gathered, description, group=group)
    reference = gathered[0]
    problems = []
    for r, desc in enumerate(gathered[1:], start=1):
        if desc == reference:
            continue
        for key in sorted(set(reference) | set(desc)):
            if reference.get(key) != desc.get(key):
                problems.append(f"rank {r} differs from rank 0 in {key}: "
                                f"rank 0 vs rank {r}: {_first_difference(reference.get(key), desc.get(key))}")
                break
    if problems:
        raise RuntimeError(f"bitscom: ranks disagree on the {what}; every rank must build the "
                           f"same model, optimizer and compressor settings. " + "; ".join(problems))
