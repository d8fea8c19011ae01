"""A transport that runs a compressor's rounds without a network, as if every rank held the
same tensor: to time the codec alone and to record the rounds a compressor issues, which is
how the cost model learns them (:func:`bitscom.cost.rounds_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..comm import Comm
from ..validate import choice, instance, number
from ..compressors.base import BucketLayout, Compressor

__all__ = ["Round", "KINDS", "LEVELS", "LocalTransport", "local_comm", "recorded_rounds", "check_world"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
LEVELS = ("flat", "intra", "inter")


@dataclass(frozen=True)
class Round:
    """One collective: ``kind``, the ``nbytes`` this rank hands to it (Comm's count) and the
    ``level`` it runs at (``flat`` over the world, ``intra``-node, ``inter``-node)."""

    kind: str
    nbytes: int
    level: str = "flat"

    def __post_init__(self):
        choice("Round kind", self.kind, KINDS)
        choice("Round level", self.level, LEVELS)
        number("Round nbytes", self.nbytes, minimum=0, integer=True)


def check_world(world, local_size=1, names: Tuple[str, str] = ("world", "local_size")) -> None:
    """ValueError unless ``world`` is an int >= 1 and ``local_size`` an int >= 1 dividing it (the
    group sizes every function of the model takes, in one wording)."""
    number(names[0], world, minimum=1, integer=True)
    if number(names[1], local_size, minimum=1, integer=True) and world % local_size:
        raise ValueError(f"{names[1]} must be an int >= 1 dividing {names[0]}={world}, got {local_size!r}")


class _Done:
    """A finished work handle."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class LocalTransport:
    """Collectives of ``size`` identical ranks, computed locally (all-reduce leaves the buffer,
    all-gather repeats the input), each recorded in :attr:`log` as a :class:`Round` at ``level``.

    Example::

        comm = Comm(None, transport=LocalTransport(4), rank=0, size=4)
    """

    def __init__(self, size: int, local_size: int = 1, level: str = "flat",
                 log: Optional[List[Round]] = None):
        check_world(size, local_size, ("LocalTransport size", "LocalTransport local_size"))
        choice("LocalTransport level", level, LEVELS)
        self._size, self._local = size, local_size
        self._level = level
        self.log: List[Round] = [] if log is None else log

    def levels(self) -> Tuple[Comm, Comm]:
        """``(intra, inter)`` local Comms of ``local_size`` and ``size / local_size`` ranks, recording into this log."""
        nodes = self._size // self._local
        intra = LocalTransport(self._local, level="intra", log=self.log)
        inter = LocalTransport(nodes, level="inter" if self._local > 1 else "flat", log=self.log)
        return (Comm(None, transport=intra, rank=0, size=self._local),
                Comm(None, transport=inter, rank=0, size=nodes))

    def size(self, group) -> int:
        return self._size

    def rank(self, group) -> int:
        return 0

    def _record(self, kind: str, tensor: torch.Tensor) -> _Done:
        self.log.append(Round(kind, tensor.numel() * tensor.element_size(), self._level))
        return _Done()

    def all_reduce(self, group, tensor, op):
        return self._record("all_reduce", tensor)

    def all_gather(self, group, output, input):
        output.view(self._size, -1).copy_(input.reshape(1, -1))
        return self._record("all_gather", input)

    def all_to_all(self, group, output, input):
        output.copy_(input)
        return self._record("all_to_all", input)

    def reduce_scatter(self, group, output, input, op):
        output.view(-1).copy_(input.view(self._size, -1)[0])
        return self._record("reduce_scatter", input)

    def broadcast(self, group, tensor, src):
        return self._record("broadcast", tensor)

    def reduce(self, group, tensor, dst, op):
        raise NotImplementedError("the cost model has no formula for a rooted reduce (e.g. LowBit "
                                  "hierarchy='leader', whose bytes differ between leaders and the "
                                  "other ranks); use hierarchy 'none' or 'two_level'")


def local_comm(world: int, local_size: int = 1) -> "tuple[Comm, LocalTransport]":
    """A :class:`Comm` of ``world`` identical ranks over a fresh :class:`LocalTransport`."""
    transport = LocalTransport(world, local_size)
    return Comm(None, transport=transport, rank=0, size=world), transport


def recorded_rounds(compressor: Compressor, layout: BucketLayout, world: int, steps: int = 1,
                    grad=None, local_size: int = 1) -> List[List[Round]]:
    """The rounds ``compressor`` issues for ``steps`` consecutive steps of ``layout`` on
    ``world`` ranks (``local_size`` per node), recorded from a local run (group rank 0's view)."""
    instance("compressor", compressor, Compressor, "a bitscom compressor (bitscom.compressors.get(name))")
    instance("layout", layout, BucketLayout, "a BucketLayout (bitscom.cost.layout_of(numel))")
    check_world(world, local_size)
    number("steps", steps, minimum=1, integer=True)
    state = compressor.init_state(layout)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        flat = torch.randn(layout.numel, generator=gen).to(layout.dtype) if grad is None else grad.clone()
        comm, transport = local_comm(world, local_size)
        for _work in compressor.reduce(flat, layout, state, comm):
            pass
        out.append(list(transport.log))
    return out
