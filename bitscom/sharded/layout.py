"""Shard planning: which bucket each parameter sits in and which slice of it each rank owns.
Pure functions of (names, shapes, world size, settings): every rank computes the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from ..buckets import plan_buckets
from ..compressors.base import TensorSlot
from ..lowbit.format import HADAMARD_BLOCK
from ..validate import number

__all__ = ["Slot", "Piece", "BucketShard", "ShardPlan", "plan_shards"]


@dataclass(frozen=True)
class Slot(TensorSlot):
    """The library's bucket slot plus the parameter's registration ``index``."""

    index: int = -1


@dataclass(frozen=True)
class Piece:
    """The part ``[start, stop)`` of parameter ``index`` this rank owns, at ``master_offset``."""

    index: int
    name: str
    start: int
    stop: int
    master_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BucketShard:
    """One bucket: its slots, padded size ``world * shard_numel``, this rank's master offset."""

    slots: Tuple[Slot, ...]
    numel: int
    shard_numel: int
    master_offset: int

    def describe(self) -> tuple:
        return tuple((s.name, s.shape, s.offset) for s in self.slots) + (self.numel, self.shard_numel)


@dataclass(frozen=True)
class ShardPlan:
    """The whole plan for one rank: buckets (in launch order) and this rank's pieces."""

    world: int
    rank: int
    buckets: Tuple[BucketShard, ...]
    pieces: Tuple[Piece, ...]

    @property
    def master_numel(self) -> int:
        return sum(b.shard_numel for b in self.buckets)

    def describe(self) -> list:
        return [b.describe() for b in self.buckets]


def plan_shards(params: Sequence[Tuple[str, Tuple[int, ...], int]], world: int, rank: int,
                threshold_bytes: int, pipeline: int = 1, element_size: int = 4) -> ShardPlan:
    """Plan buckets and this rank's pieces for ``params`` = [(name, shape, numel), ...] given in
    registration order.

    Example::

        plan = plan_shards([(n, tuple(p.shape), p.numel()) for n, p in model.named_parameters()],
                           world=4, rank=0, threshold_bytes=25 * 2**20)
    """
    number("world", world, minimum=1, integer=True)
    number("rank", rank, minimum=0, maximum=world - 1, integer=True)
    number("threshold_bytes", threshold_bytes, minimum=0, integer=True)
    unit = HADAMARD_BLOCK * pipeline
    # The one bucket planner (reverse registration order, closed at the threshold), on meta
    # stand-ins with the master dtype's element size: no memory, the same plan everywhere.
    dtype = {8: torch.float64, 4: torch.float32, 2: torch.float16}[element_size]
    index_of = {name: i for i, (name, _, _) in enumerate(params)}
    stand_ins = [(name, torch.empty(tuple(shape), dtype=dtype, device="meta")) for name, shape, _ in params]
    buckets, pieces, master_offset = [], [], 0
    for layout in plan_buckets(stand_ins, threshold_bytes):
        slots = [Slot(s.name, s.offset, s.numel, s.shape, index_of[s.name]) for s in layout.slots]
        shard = max(unit, -(-layout.numel // (world * unit)) * unit)
        lo, hi = rank * shard, (rank + 1) * shard
        for s in slots:
            a, b = max(lo, s.offset), min(hi, s.end)
            if a < b:
                pieces.append(Piece(s.index, s.name, a - s.offset, b - s.offset, master_offset + a - lo))
        buckets.append(BucketShard(tuple(slots), layout.numel, shard, master_offset))
        master_offset += shard
    return ShardPlan(world, rank, tuple(buckets), tuple(pieces))
