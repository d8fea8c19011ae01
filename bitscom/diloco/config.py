"""DiLoCo's hyper-parameters: one frozen dataclass, validated once, compared across ranks. What
each trades, and its measured sensitivity: docs/diloco.md, Hyper-parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ..validate import flag, number, real

__all__ = ["DiLoCoConfig"]


@dataclass(frozen=True)
class DiLoCoConfig:
    """The settings of one :class:`~bitscom.diloco.DiLoCo` (every rank must use the same).

    Example::

        cfg = DiLoCoConfig(sync_every=32, fragments=4)
        cfg.offsets()            # [0, 8, 16, 24]: fragment i syncs when (step - 8*i) % 32 == 0
    """

    sync_every: int = 16
    """H: local inner steps between two synchronizations of a fragment (>= 1)."""
    outer_lr: float = 0.7
    """Outer SGD learning rate (>= 0; 1 with momentum 0 = plain model averaging)."""
    outer_momentum: float = 0.9
    """Outer SGD momentum in [0, 1)."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD (DiLoCo's choice; needs outer_momentum > 0)."""
    fragments: int = 1
    """F: number of parameter fragments synchronized at staggered steps (Streaming DiLoCo)."""
    warmup_steps: int = 0
    """W: first steps that reduce the gradient every step (S-SGD through the compressor; >= 0)."""
    delay: int = 0
    """τ: inner steps a fragment's reduction overlaps before it lands (< sync_every; 0 = synchronous)."""
    mix: float = 0.0
    """α in [0, 1]: the share of θ_local kept when a delayed update lands (0 = replace; needs delay)."""

    def __post_init__(self):
        for name, low in (("sync_every", 1), ("fragments", 1), ("warmup_steps", 0), ("delay", 0)):
            number(name, getattr(self, name), minimum=low, integer=True)
        for name, high, closed in (("outer_lr", None, True), ("outer_momentum", 1.0, (True, False)),
                                   ("mix", 1.0, True)):
            value = real(name, getattr(self, name), minimum=0.0, maximum=high, inclusive=closed, finite=True)
            object.__setattr__(self, name, value)
        if flag("nesterov", self.nesterov) and self.outer_momentum == 0.0:
            raise ValueError("nesterov=True needs outer_momentum > 0 (torch's SGD rule); pass "
                             "nesterov=False for outer_momentum=0")
        if self.delay >= self.sync_every:
            raise ValueError(f"delay must be < sync_every={self.sync_every} (a fragment's reduction "
                             f"must land before its next one starts), got {self.delay}")
        if self.mix > 0.0 and self.delay == 0:
            raise ValueError(f"mix={self.mix:g} needs delay > 0: it keeps part of the local progress "
                             "made while a reduction was in flight, and with delay=0 there is none "
                             "(the local fragment is replaced, as in DiLoCo)")

    def same_as(self, saved: str) -> bool:
        """Whether ``saved`` (a checkpoint's config ``repr``) is these settings; older ones lack delay/mix."""
        if saved == repr(self):
            return True
        legacy = repr(self).replace(f", delay={self.delay!r}, mix={self.mix!r}", "")
        return self.delay == 0 and self.mix == 0.0 and saved == legacy

    def offsets(self) -> List[int]:
        """Fragment i syncs at the steps t > W with ``(t - W - offsets()[i]) % sync_every == 0``."""
        return [(i * self.sync_every) // self.fragments for i in range(self.fragments)]

    def in_warmup(self, step: int) -> bool:
        """Whether inner step ``step`` (1-based) reduces its gradient (the warm-up phase).

        Example::

            DiLoCoConfig(warmup_steps=3).in_warmup(3)    # True; step 4 is local
        """
        return 1 <= step <= self.warmup_steps

    def due(self, step: int) -> List[int]:
        """The fragments synchronized after inner step ``step`` (1-based), in index order
        (none during the warm-up; the local phase counts from step ``warmup_steps + 1``).

        Example::

            DiLoCoConfig(sync_every=4, fragments=2).due(2)    # [1]
            DiLoCoConfig(sync_every=4, warmup_steps=10).due(14)   # [0]
        """
        local = step - self.warmup_steps
        return [i for i, off in enumerate(self.offsets()) if local >= 1 and (local - off) % self.sync_every == 0]

    def lands(self, step: int) -> List[int]:
        """The fragments whose reduction, started ``delay`` steps earlier, lands after inner
        step ``step`` (their outer update is applied then); ``due(step)`` when ``delay=0``.

        Example::

            DiLoCoConfig(sync_every=4, fragments=2, delay=1).lands(5)    # [0]: started after 4
        """
        return self.due(step - self.delay)
