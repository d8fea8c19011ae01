"""Warm-up: the first ``start_iter`` steps of a bucket are a plain exact average (full bytes,
its own dtype), then the compressor runs.

Why: compressing from the first step hurts where the gradient changes fastest (PowerSGD, DGC and 1-bit Adam warm up).
Written once: :class:`WarmUp` around any compressor, :class:`StartIter` for the ``start_iter=`` settings (counted in the
compressor's own state). An empty bucket has no step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Union

import torch

from ..validate import number
from .base import BucketLayout, Comm, Compressor, State, Wrapper, plain_average

__all__ = ["WarmUp", "WarmUpState", "StartIter", "warm_up", "check_start_iter"]


def check_start_iter(owner: str, value) -> None:
    """``start_iter`` (plain all-reduce warm-up steps) must be an int >= 0 (ValueError naming it)."""
    number(f"{owner} start_iter", value, minimum=0, integer=True)


def warm_up(start_iter: int, state: Any, flat: torch.Tensor, comm: Comm,
            compressed: Iterator[Any]) -> Iterator[Any]:
    """Round generator: count the step in ``state.step``; before ``start_iter`` the plain
    average of ``flat``, then the ``compressed`` rounds (a generator not yet started)."""
    if flat.numel() > 0:
        step, state.step = state.step, state.step + 1
        if step < start_iter:
            yield from plain_average(flat, comm)
            return
    yield from compressed


class StartIter:
    """Mixin (before :class:`Compressor`) for a ``start_iter=`` setting: :func:`warm_up` around
    its ``compressed(flat, layout, state, comm)`` rounds, counted in its own ``state.step``."""

    start_iter: int
    compressed: Any

    def reduce(self, flat: torch.Tensor, layout: BucketLayout, state: Any, comm: Comm) -> Iterator[Any]:
        return warm_up(self.start_iter, state, flat, comm, self.compressed(flat, layout, state, comm))


class WarmUpState(State):
    """The bucket's step count and the inner compressor's state."""

    def __init__(self, inner: State):
        self.step = 0
        self.inner = inner


@dataclass(frozen=True)
class WarmUp(Wrapper, Compressor[WarmUpState]):
    """A plain exact average for the first ``start_iter`` steps of each bucket, then ``inner``.

    ``inner``: an instance or a registry name; ``start_iter``: warm-up steps, an int >= 0.

    Example::

        comp = bitscom.compressors.WarmUp("lowbit", start_iter=100)   # then compression=comp
    """

    inner: Union[Compressor, str, None] = None
    start_iter: int = 0

    name = "warmup"

    def __post_init__(self):
        from .registry import resolve
        if self.inner is None:
            raise ValueError("WarmUp needs an inner compressor (an instance or a registry name), got None")
        inner = resolve(self.inner, "WarmUp inner")
        if getattr(inner, "applies_momentum", False):
            raise ValueError(f"WarmUp inner must not be a MomentumCorrection: the warm-up steps would "
                             f"get no momentum. Put it outside: MomentumCorrection(WarmUp(...)), got {inner!r}")
        check_start_iter("WarmUp", self.start_iter)
        object.__setattr__(self, "inner", inner)

    def init_state(self, layout: BucketLayout) -> WarmUpState:
        return WarmUpState(self._inner.init_state(layout))

    def reduce(self, flat, layout, state: WarmUpState, comm: Comm) -> Iterator[Any]:
        return warm_up(self.start_iter, state, flat, comm,
                       self._inner.reduce(flat, layout, state.inner, comm))
