"""A transport that runs a compressor's rounds without a network, as if every rank held the
same tensor: for timing the codec alone (:func:`bitscom.cost.calibrate.time_codec`) and for
recording the rounds a compressor issues (:func:`recorded_rounds`).
"""

from __future__ import annotations

from typing import List

import torch

from ..comm import Comm
from ..compressors.base import BucketLayout, Compressor
from .rounds import Round

__all__ = ["LocalTransport", "recorded_rounds"]


class _Done:
    """A finished work handle."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class LocalTransport:
    """Collectives of a group of ``size`` identical ranks, computed locally (no traffic):
    all-reduce leaves the buffer as it is, all-gather repeats the input, all-to-all copies.
    Every call is recorded in :attr:`log` as a :class:`~bitscom.cost.rounds.Round`.

    Example::

        comm = Comm(None, transport=LocalTransport(4), rank=0, size=4)
    """

    def __init__(self, size: int):
        self._size = size
        self.log: List[Round] = []

    def size(self, group) -> int:
        return self._size

    def rank(self, group) -> int:
        return 0

    def _record(self, kind: str, tensor: torch.Tensor) -> _Done:
        self.log.append(Round(kind, tensor.numel() * tensor.element_size(), "flat"))
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


def local_comm(world: int) -> "tuple[Comm, LocalTransport]":
    """A :class:`Comm` of ``world`` identical ranks over a fresh :class:`LocalTransport`."""
    transport = LocalTransport(world)
    return Comm(None, transport=transport, rank=0, size=world), transport


def recorded_rounds(compressor: Compressor, layout: BucketLayout, world: int, steps: int = 1,
                    grad=None) -> List[List[Round]]:
    """The rounds ``compressor`` issues for ``steps`` consecutive steps of ``layout``, recorded
    from a local run (flat compressors only: a hierarchical one talks to its own groups).

    Example::

        recorded_rounds(bitscom.compressors.get("fp16"), layout_of(100), 4)
    """
    state = compressor.init_state(layout)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        flat = torch.randn(layout.numel, generator=gen).to(layout.dtype) if grad is None else grad.clone()
        comm, transport = local_comm(world)
        for _work in compressor.reduce(flat, layout, state, comm):
            pass
        out.append(list(transport.log))
    return out
