"""The buckets of the overlapped 1-bit all-reduce (``overlap=True``): which gradients each one
waits for, and the cursor that launches them in one order on every rank.

Why block ranges, not parameters. 1-bit Adam reduces ONE flat momentum; the bits it gets
depend on the quantization blocks and on which rank owns (sums and requantizes) each block.
A bucket is therefore a run of whole blocks inside one owner's shard
(:func:`bitscom.lowbit.ranged.owner_ranges`), so reducing the buckets one by one gives the
bits of the whole-buffer all-reduce, and a bucket waits for every parameter that overlaps it.
Buckets are launched last-first (backward produces the last parameters' gradients first) and
strictly in that order, so every rank issues the same collectives in the same order however
its gradients arrive.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..comm import Rounds
from ..lowbit.ranged import owner_ranges

__all__ = ["OverlapBuckets"]


class OverlapBuckets:
    """A step's gradient buffer, bucket readiness and in-flight work (reset every step).

    ``kind`` is what the step sends from the hooks (``None`` until the step's first gradient;
    ``"none"`` when it sends nothing from them), ``lowbit_step`` the low-bit step counter of
    its all-reduce.

    Example::

        buckets = OverlapBuckets(sizes, numel=sum(sizes), world=2, block_size=32, max_elements=64)
        buckets.fill(0, p.grad)
        for start, stop, owner in buckets.ready(): ...
    """

    def __init__(self, sizes: Sequence[int], numel: int, world: int, block_size: int, max_elements: int,
                 device):
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
        """The buffer a step that reduces the gradient itself reduces in place (made on first
        use): a copy, so that :meth:`changed` can still compare ``p.grad`` with what was sent."""
        if self.work is None:
            self.work = torch.zeros_like(self.grad)
        return self.work

    def missing(self) -> List[int]:
        """Parameters not filled this step (no gradient from backward, or frozen)."""
        return [i for i, done in enumerate(self.filled) if not done]

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
