"""Bucket planning, pure, so every rank computes the same plan. Why reverse registration order:
backward produces the last layers' gradients first, so the first bucket starts early (as DDP)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from .compressors.base import BucketLayout, TensorSlot
from .validate import number

__all__ = ["plan_buckets", "plan_groups", "FlatBucket"]


def plan_buckets(params: Sequence[Tuple[str, torch.Tensor]], threshold_bytes: int) -> List[BucketLayout]:
    """Buckets of ``params`` up to ``threshold_bytes`` each (0: one parameter each)."""
    number("threshold_bytes", threshold_bytes, minimum=0, integer=True)
    open_buckets: Dict[tuple, list] = {}
    used: Dict[tuple, int] = {}
    order: List[list] = []
    for name, p in reversed(list(params)):
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        if key not in open_buckets or threshold_bytes == 0 or used[key] + nbytes > threshold_bytes:
            open_buckets[key], used[key] = [], 0
            order.append(open_buckets[key])
        open_buckets[key].append((name, p))
        used[key] += nbytes
    return _layouts(order)


def plan_groups(params: Sequence[Tuple[str, torch.Tensor]], groups) -> List[BucketLayout]:
    """Horovod's ``groups=``: ``n`` runs of nearly equal count, or lists that travel together."""
    rev = list(reversed(list(params)))
    if isinstance(groups, int):
        n = min(groups, len(rev)) or 1
        cut = [len(rev) * i // n for i in range(n + 1)]
        chosen = [rev[cut[i]:cut[i + 1]] for i in range(n)]
    else:
        chosen = _listed_groups(rev, groups)
    order: List[list] = []
    for members in chosen:
        by_key: Dict[tuple, list] = {}
        for name, p in members:
            by_key.setdefault((p.dtype, p.device), []).append((name, p))
        order.extend(by_key.values())
    return _layouts(order)


def _listed_groups(rev: list, groups) -> List[list]:
    """``groups=`` lists travel together, others alone; earliest-ready bucket first."""
    position = {id(p): i for i, (_, p) in enumerate(rev)}
    chosen: List[list] = []
    taken: set = set()
    for g, members in enumerate(groups):
        picked = []
        for p in members:
            if id(p) not in position:
                raise ValueError(f"groups[{g}] holds a tensor of shape {tuple(p.shape)} that is "
                                 "not a trainable parameter of this optimizer")
            if id(p) in taken:
                raise ValueError(f"groups[{g}] repeats a parameter of shape {tuple(p.shape)}; "
                                 "each parameter may be in one group only")
            taken.add(id(p))
            picked.append(rev[position[id(p)]])
        if picked:
            chosen.append(sorted(picked, key=lambda item: position[id(item[1])]))
    chosen += [[item] for item in rev if id(item[1]) not in taken]
    chosen.sort(key=lambda members: max(position[id(p)] for _, p in members))
    return chosen


def _layouts(order: List[list]) -> List[BucketLayout]:
    layouts = []
    for index, members in enumerate(order):
        slots, offset = [], 0
        for name, p in members:
            slots.append(TensorSlot(name, offset, p.numel(), tuple(p.shape)))
            offset += p.numel()
        dtype, device = members[0][1].dtype, members[0][1].device
        layouts.append(BucketLayout(index, tuple(slots), dtype, device))
    return layouts


class FlatBucket:
    """One bucket's preallocated flat buffer, its slot views, and which slots this step filled."""

    def __init__(self, layout: BucketLayout, params: Sequence[torch.Tensor]):
        self.layout = layout
        self.params = list(params)
        self.flat = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
        self.views = [self.flat[s.offset:s.end].view(s.shape) for s in layout.slots]
        self.filled = [False] * len(self.params)
        self.pending = len(self.params)

    def reset(self) -> None:
        """Forget this step's fills (the buffer keeps its bytes; every slot is refilled)."""
        self.filled = [False] * len(self.params)
        self.pending = len(self.params)

    def fill(self, slot: int, grad) -> None:
        """Copy ``grad`` (or zeros for a parameter that got no gradient) into ``slot``."""
        if grad is None:
            self.views[slot].zero_()
        else:
            self.views[slot].copy_(grad)
        if not self.filled[slot]:
            self.filled[slot] = True
            self.pending -= 1

    def fill_missing(self) -> None:
        """Zeros for every slot not filled this step (parameters that got no gradient)."""
        for slot, done in enumerate(self.filled):
            if not done:
                self.fill(slot, self.params[slot].grad)

    def write_back(self) -> None:
        """Copy the reduced gradients into ``p.grad``, creating it where backward did not."""
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view.detach().clone()
            else:
                p.grad.copy_(view)
