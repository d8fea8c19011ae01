"""The buckets of the overlapped 1-bit all-reduce (``overlap=True``).

Why block ranges, not parameters: the bits 1-bit Adam gets depend on the quantization blocks
and on which rank owns each block, so a bucket is a run of whole blocks inside one owner's
shard (:func:`bitscom.lowbit.ranged.owner_ranges`) and reducing the buckets one by one gives
the whole-buffer all-reduce's bits. Buckets launch last-first, strictly in order, so every rank
issues the same collectives whatever order its gradients arrive in.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..comm import Rounds
from ..lowbit.ranged import owner_ranges

__all__ = ["OverlapBuckets"]


class OverlapBuckets:
    """A step's gradient buffer, bucket readiness and in-flight work (reset every step).

    ``kind`` is what the step sends from the hooks (``None`` until the step's first gradient),
    ``lowbit_step`` the low-bit step counter of its all-reduce.
    """

    def __init__(self, sizes: Sequence[int], numel: int, world: int, block_size: int, max_elements: int, device):
        self.grad = torch.zeros(numel, dtype=torch.float32, device=device)
        self.ranges = owner_ranges(numel, world, block_size, max_elements)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.views = [self.grad[o:o + s] for o, s in zip(offsets, sizes)]
        self.touches: List[List[int]] = [[b for b, (s, t, _) in enumerate(self.ranges) if o < t and o + size > s]
                                         for o, size in zip(offsets, sizes)]
        self.need = [sum(b in t for t in self.touches) for b in range(len(self.ranges))]
        self.work: Optional[torch.Tensor] = None     # what a "gradient" step reduces (p.grad's copy stays)
        self.kind: Optional[str] = None
        self.lowbit_step = 0
        self.flights: List[Rounds] = []
        self.reset()

    def reset(self) -> None:
        """Forget this step (fills, cursor, work); the buffer keeps its bytes."""
        self.kind = None
        self.pending = list(self.need)
        self.filled = [False] * len(self.views)
        self.next = 0
        self.flights = []

    def fill(self, index: int, grad: Optional[torch.Tensor]) -> None:
        """Copy parameter ``index``'s gradient (zeros for None) into the buffer, once."""
        if self.filled[index]:
            return
        view = self.views[index]
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad.reshape(-1))
        self.filled[index] = True
        for b in self.touches[index]:
            self.pending[b] -= 1

    def reduced(self) -> torch.Tensor:
        """What a "gradient" step reduces in place: a copy, so :meth:`changed` can compare."""
        if self.work is None:
            self.work = torch.zeros_like(self.grad)
        return self.work

    def ready(self) -> List[Tuple[int, int, int]]:
        """The buckets to launch now, in order (advances the cursor)."""
        out = []
        while self.next < len(self.ranges) and self.pending[self.next] == 0:
            out.append(self.ranges[self.next])
            self.next += 1
        return out

    def changed(self, grads: Sequence[Optional[torch.Tensor]]) -> List[int]:
        """Parameters whose ``p.grad`` is no longer what the hooks sent (None reads as zeros)."""
        out = []
        for i, (g, view) in enumerate(zip(grads, self.views)):
            same = not bool(view.any()) if g is None else (    # bits, so NaN equals NaN
                not g.is_sparse and g.dtype == view.dtype and g.numel() == view.numel()
                and torch.equal(g.reshape(-1).contiguous().view(torch.int32), view.view(torch.int32)))
            if not same:
                out.append(i)
        return out
