"""Gradient reduce-scatter of one bucket: exact, or SDP4Bit's two-level quantized scheme
(:mod:`bitscom.lowbit.levelwise`; rank ``r = node * L + local`` owns shard ``r``). Each group
carries one kind of round (intra: first rounds; inter: later ones; the process group: the
exact reduce-scatters), so the channel needs no later group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from .. import runtime
from ..comm import Comm, Rounds
from ..lowbit.codec import Codec
from ..lowbit.levelwise import levelwise_chunks, levelwise_wire_bytes
from ..ops import Average
from .config import ShardedConfig

__all__ = ["Topology", "GradientReducer", "gradient_wire_bytes"]


@dataclass(frozen=True)
class Topology:
    """The groups: ``group`` (all), ``intra`` (this node), ``inter`` (this local rank); ``None``: none."""

    group: Optional[object]
    intra: Optional[object]
    inter: Optional[object]
    world: int
    rank: int
    local_size: int

    @property
    def nodes(self) -> int:
        return self.world // self.local_size


def _codecs(cfg: ShardedConfig):
    """(intra, inter) stage codecs: stochastic rounding, the SDP4Bit widths and group sizes."""
    return (Codec(cfg.gradient_quantization_bits_intra, cfg.gq_group_size_intra, stochastic=True),
            Codec(cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter, stochastic=True))


def gradient_wire_bytes(cfg: ShardedConfig, topo: Topology, shard_numel: int) -> int:
    """Bytes this rank sends (each collective's input buffer) to reduce-scatter one bucket.

    Example::

        gradient_wire_bytes(ShardedConfig(quantized_gradients=True), topo, 4096)
    """
    if topo.world == 1:
        return 0
    if not cfg.quantized_gradients:
        return topo.world * shard_numel * 4
    intra, inter = _codecs(cfg)
    return levelwise_wire_bytes(shard_numel, [(topo.local_size, intra), (topo.nodes, inter)],
                                cfg.gradient_alltoall_pipeline)


def _comm(group, size: int, rank: int) -> Comm:
    """A Comm over ``group``; a missing group (a level of one rank) is a solo Comm."""
    return Comm(None, rank=0, size=1) if group is None else Comm(group, rank=rank, size=size)


def _exact_rounds(out: torch.Tensor, flat: torch.Tensor, comm: Comm, divide_by: Optional[int]):
    """Round generator: the exact reduce-scatter (float, the bucket's dtype)."""
    yield comm.reduce_scatter(out, flat)
    if divide_by is not None:
        out.div_(divide_by)


@dataclass
class GradientReducer:
    """Reduce-scatters buckets, launched in bucket order, without blocking backward."""

    cfg: ShardedConfig
    topo: Topology
    _flights: List[Rounds] = field(default_factory=list)
    _comms: List[Comm] = field(default_factory=list)
    channel: Any = None

    def __post_init__(self) -> None:
        self.channel = runtime.channel(self.topo.group if self.topo.world > 1 else None)

    @property
    def in_flight(self) -> bool:
        return any(not f.done for f in self._flights)

    def launch(self, bucket: int, flat: torch.Tensor, out: torch.Tensor, step: int) -> None:
        """Start reducing ``flat`` (``world * S`` elements) into ``out`` (``S``): its first rounds."""
        topo, cfg = self.topo, self.cfg
        if topo.world == 1:
            out.copy_(flat)
            return
        average = cfg.op is Average
        if not cfg.quantized_gradients:
            comm = Comm(topo.group, rank=topo.rank, size=topo.world)   # None: torch's default group
            self._comms.append(comm)
            self._start(_exact_rounds(out, flat, comm, topo.world if average else None), [comm], 1)
            return
        L, M = topo.local_size, topo.nodes
        node, local = divmod(topo.rank, L)
        intra, inter = _comm(topo.intra, L, local), _comm(topo.inter, M, node)
        c_intra, c_inter = _codecs(cfg)
        gens = levelwise_chunks(flat, out, [(intra, c_intra), (inter, c_inter)], chunks=cfg.gradient_alltoall_pipeline,
                                hadamard=cfg.hadamard_transform, alpha=1.0 / topo.world if average else 1.0,
                                seed_parts=(cfg.seed, step, topo.rank, bucket))
        self._comms += [intra, inter]
        for gen in gens:
            self._start(gen, [intra, inter], 2)

    def _start(self, gen, comms: List[Comm], total: int) -> None:
        self._flights.append(self.channel.submit(Rounds(gen, comms, total=total)))

    def poll(self) -> None:
        """Advance whatever completed."""
        self.channel.poll()

    def wait_all(self) -> int:
        """Finish every launched bucket; the bytes sent this step. Resets, also on failure."""
        try:
            if self._flights:
                self.channel.wait(self._flights[-1])
            failed = [f.error for f in self._flights if f.error is not None]
            if failed:
                raise failed[0]
            return sum(c.bytes_sent for c in self._comms)
        finally:
            self.abort()

    def abort(self) -> None:
        """Forget every launched bucket (after a failure); their work is not waited for."""
        self.channel.abort(self._flights)
        self._flights, self._comms = [], []
