"""Bucket planning: which gradients travel together, and where each sits in the flat buffer.

Pure functions of the parameter list (names, shapes, dtypes, devices) and the fusion
threshold, so every rank computes the same plan and a test can check it without ranks.

Why reverse registration order: backward produces the gradients of the last layers first,
so packing parameters from the end of the model lets the first bucket become ready (and
start communicating) while backward still works on earlier layers — DDP and ACP-SGD do the
same. Parameters of different dtypes or devices never share a bucket.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from .compressors.base import BucketLayout, TensorSlot

__all__ = ["plan_buckets", "FlatBucket"]


def plan_buckets(params: Sequence[Tuple[str, torch.Tensor]], threshold_bytes: int) -> List[BucketLayout]:
    """Plan buckets for ``params`` (name, tensor) given in registration order.

    A bucket is closed when adding the next parameter would exceed ``threshold_bytes``
    (a single larger parameter gets a bucket of its own); ``threshold_bytes=0`` gives one
    parameter per bucket. Bucket indices follow the order in which buckets open, i.e. the
    order in which backward is expected to fill them.

    Example::

        layouts = plan_buckets(list(model.named_parameters()), 25 * 2**20)
    """
    if threshold_bytes < 0:
        raise ValueError(f"fusion threshold must be >= 0 bytes, got {threshold_bytes}")
    open_buckets: Dict[tuple, list] = {}
    used: Dict[tuple, int] = {}
    order: List[list] = []
    for name, p in reversed(list(params)):
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        current = open_buckets.get(key)
        if current is not None and (threshold_bytes == 0 or used[key] + nbytes > threshold_bytes):
            current = None
        if current is None:
            current = []
            open_buckets[key], used[key] = current, 0
            order.append(current)
        current.append((name, p))
        used[key] += nbytes
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
    """The preallocated flat buffer of one bucket plus views of each parameter's slot.

    Gradients are copied in when ready and the reduced result copied back out; the buffer is
    allocated once and reused every step.
    """

    def __init__(self, layout: BucketLayout, params: Sequence[torch.Tensor]):
        self.layout = layout
        self.params = list(params)
        self.flat = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
        self.views = [self.flat[s.offset:s.end].view(s.shape) for s in layout.slots]
        self.pending = len(self.params)

    def reset(self) -> None:
        self.pending = len(self.params)

    def fill(self, slot: int, grad) -> None:
        """Copy ``grad`` (or zeros for a parameter that got no gradient) into ``slot``."""
        if grad is None:
            self.views[slot].zero_()
        else:
            self.views[slot].copy_(grad)

    def write_back(self) -> None:
        """Copy the reduced gradients into ``p.grad``, creating it where backward did not."""
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view.detach().clone()
            else:
                p.grad.copy_(view)
