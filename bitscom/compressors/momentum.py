"""Momentum correction (Deep Gradient Compression, Lin et al. 2018): compress the velocity.

Why: with momentum *after* averaging, momentum turns each burst error feedback delivers into
a long, late push; DGC keeps it on each rank, *before* compression (docs/compressors.md):

1. ``u = m·u + g``, the local fp32 velocity (:class:`MomentumState`);
2. the inner compressor reduces ``u``; the average becomes ``p.grad`` (the update itself);
3. with ``masking`` (TopK only), ``u = 0`` where the inner compressor sent this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from ..validate import flag, number
from .base import BucketLayout, Comm, Compressor, State, Wrapper
from .topk import TopK

__all__ = ["MomentumCorrection", "MomentumState"]


class MomentumState(State):
    """One bucket's local velocity ``u`` (fp32) and the inner compressor's state."""

    def __init__(self, numel: int, device, inner: State):
        self.velocity = torch.zeros(int(numel), dtype=torch.float32, device=device)
        self.inner = inner


@dataclass(frozen=True)
class MomentumCorrection(Wrapper, Compressor[MomentumState]):
    """Apply SGD momentum on each rank before ``inner`` compresses; the optimizer runs with ``momentum=0``.

    Args:
        inner: the compressor of the velocity (default ``"topk"``); error-feedback ones.
        momentum: the SGD momentum ``m`` in [0, 1) applied here instead of in the optimizer.
        masking: zero the velocity where :class:`TopK` sent (off: at 5% it keeps wiping momentum).

    Example::

        opt = bitscom.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), compression=MomentumCorrection(TopK(0.01)))
    """

    inner: Union[Compressor, str, None] = None
    momentum: float = 0.9
    masking: bool = False

    name = "dgc"
    applies_momentum = True

    def __post_init__(self):
        from .registry import resolve
        inner = resolve("topk" if self.inner is None else self.inner, "MomentumCorrection inner")
        if _applies_momentum(inner):
            raise ValueError(f"MomentumCorrection inner must not apply momentum itself, got {inner!r}")
        object.__setattr__(self, "inner", inner)
        m = number("MomentumCorrection momentum", self.momentum, minimum=0, maximum=1, inclusive=(True, False))
        object.__setattr__(self, "momentum", float(m))
        masking = flag("MomentumCorrection masking", self.masking)
        if masking and not isinstance(inner, TopK):
            raise ValueError(f"MomentumCorrection masking=True needs a sparsifying inner compressor "
                             f"(TopK); {type(inner).__name__} sends every coordinate, so masking "
                             "would remove momentum altogether. Use masking=False")
        object.__setattr__(self, "masking", masking)

    def init_state(self, layout: BucketLayout) -> MomentumState:
        return MomentumState(layout.numel, layout.device, self._inner.init_state(layout))

    def reduce(self, flat, layout, state: MomentumState, comm: Comm):
        u = state.velocity
        u.mul_(self.momentum).add_(flat.reshape(-1))
        flat.copy_(u.view_as(flat))
        yield from self._inner.reduce(flat, layout, state.inner, comm)
        if self.masking:
            sent = getattr(state.inner, "last_sent", None)
            if sent is not None:                 # None on dense (warm-up) steps: keep momentum
                u.index_fill_(0, sent, 0.0)
        torch.nan_to_num_(u, nan=0.0, posinf=0.0, neginf=0.0)    # NaN/Inf reached the output already


def _applies_momentum(compressor) -> bool:
    """Whether ``compressor``, or a compressor it wraps (``inner``, recursively), applies momentum."""
    return isinstance(compressor, Compressor) and (compressor.applies_momentum
                                                   or _applies_momentum(getattr(compressor, "inner", None)))
