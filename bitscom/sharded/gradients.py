"""Gradient reduce-scatter of one bucket: exact, or SDP4Bit's two-level quantized scheme.

Ranks are laid out as ``M`` nodes x ``L`` ranks per node, process-group rank ``r = node * L +
local``, and rank ``r`` owns shard ``r`` (``S`` elements) of every bucket.

Exact: one float32 ``reduce_scatter_tensor`` over the process group.

Two-level (TLq), per pipeline chunk (``C = S / pipeline`` elements of every shard):

1. (optional, TLq-HS) the whole bucket is rotated by an orthonormal Hadamard transform over
   32-element runs; everything below happens in the rotated domain;
2. intra-node all-to-all: row ``l`` holds the chunk of every shard owned by local rank ``l``
   (``M * C`` elements), quantized at ``bits_intra`` with ``group_size_intra``; each rank sums
   the ``L`` rows it receives (float32, in peer order) -> partial sums of its ``M`` shards;
3. inter-node all-to-all: row ``n`` is the partial sum of the shard owned on node ``n``
   (``C`` elements) at ``bits_inter`` with ``group_size_inter``; the ``M`` received rows are
   summed -> this rank's shard, reduced over all ``L * M`` ranks;
4. inverse Hadamard on the reduced chunk, scale by ``1/world`` for an average.

A stage of size 1 (one node, or one rank per node) is skipped. Chunk ``k``'s inter-node round
is issued once its intra-node round completed and every earlier chunk's inter-node round was
issued, so the order of collectives on each group is the same on every rank while chunk
``k+1``'s intra-node all-to-all overlaps chunk ``k``'s inter-node one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from ..ops import Average
from ..quantization import Codec, mix_seed
from ..comm import reduce_scatter_flat
from .config import ShardedConfig
from .rotation import rotate

__all__ = ["Topology", "GradientReducer", "gradient_wire_bytes"]


@dataclass(frozen=True)
class Topology:
    """The groups of one sharded optimizer: ``group`` (all ranks), ``intra`` (this node's
    ``L`` ranks) and ``inter`` (the ``M`` ranks with this local rank); ``None`` = no group."""

    group: Optional[object]
    intra: Optional[object]
    inter: Optional[object]
    world: int
    rank: int
    local_size: int

    @property
    def nodes(self) -> int:
        return self.world // self.local_size


def gradient_wire_bytes(cfg: ShardedConfig, topo: Topology, shard_numel: int) -> int:
    """Bytes this rank hands to the network to reduce-scatter one bucket of ``world * S``
    elements (each collective's input buffer: all-to-all = the whole send buffer).

    Example::

        gradient_wire_bytes(ShardedConfig(quantized_gradients=True), topo, 4096)
    """
    if topo.world == 1:
        return 0
    if not cfg.quantized_gradients:
        return topo.world * shard_numel * 4
    L, M = topo.local_size, topo.nodes
    chunk = shard_numel // cfg.gradient_alltoall_pipeline
    total = 0
    for _ in range(cfg.gradient_alltoall_pipeline):
        if L > 1:
            total += L * Codec(cfg.gradient_quantization_bits_intra, cfg.gq_group_size_intra,
                               stochastic=True).row_bytes(M * chunk)
        if M > 1:
            total += M * Codec(cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter,
                               stochastic=True).row_bytes(chunk)
    return total


def _completed(work) -> bool:
    return work is None or work.is_completed()


def _wait(work) -> None:
    if work is not None:
        work.wait()


@dataclass
class _Chunk:
    """One chunk of one bucket moving through the two stages."""

    bucket: int
    index: int
    x: torch.Tensor          # [M, L, C] view of the (rotated) bucket
    out: torch.Tensor        # [C] slice of this rank's master gradient
    work: object = None
    recv: Optional[torch.Tensor] = None
    partial: Optional[torch.Tensor] = None
    stage: int = 1           # 1: intra in flight, 2: ready for / in inter, 3: done
    issued2: bool = False


@dataclass
class _Exact:
    bucket: int
    out: torch.Tensor
    work: object = None
    done: bool = False


@dataclass
class GradientReducer:
    """Reduce-scatters buckets, launched in bucket order, without blocking backward.

    Example::

        reducer = GradientReducer(cfg, topo)
        reducer.launch(0, bucket_flat, master_grad_slice, step=0)
        sent = reducer.wait_all()
    """

    cfg: ShardedConfig
    topo: Topology
    _exact: List[_Exact] = field(default_factory=list)
    _chunks: List[_Chunk] = field(default_factory=list)
    _next_inter: int = 0
    _sent: int = 0

    @property
    def in_flight(self) -> bool:
        return bool(self._exact or self._chunks)

    def launch(self, bucket: int, flat: torch.Tensor, out: torch.Tensor, step: int) -> None:
        """Start reducing ``flat`` (``world * S`` float elements) into ``out`` (``S``)."""
        topo, cfg = self.topo, self.cfg
        S = out.numel()
        if topo.world == 1:
            out.copy_(flat)
            return
        if not cfg.quantized_gradients:
            self._sent += flat.numel() * flat.element_size()
            work = reduce_scatter_flat(out, flat, group=topo.group, async_op=True)
            self._exact.append(_Exact(bucket, out, work))
            return
        x = rotate(flat) if cfg.hadamard_transform else flat
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        L, M = topo.local_size, topo.nodes
        x = x.view(M, L, S)
        C = S // cfg.gradient_alltoall_pipeline
        for c in range(cfg.gradient_alltoall_pipeline):
            ch = _Chunk(bucket, c, x[:, :, c * C:(c + 1) * C], out[c * C:(c + 1) * C])
            if L > 1:
                codec = Codec(cfg.gradient_quantization_bits_intra, cfg.gq_group_size_intra, stochastic=True)
                R = codec.row_bytes(M * C)
                send = torch.empty(L, R, dtype=torch.uint8, device=flat.device)
                for peer in range(L):
                    codec.encode(ch.x[:, peer, :].reshape(-1).contiguous(), send[peer],
                                 mix_seed(cfg.seed, step, topo.rank, bucket, c, 1))
                ch.recv = torch.empty_like(send)
                self._sent += send.numel()
                ch.work = dist.all_to_all_single(ch.recv.view(-1), send.view(-1), group=topo.intra,
                                                 async_op=True)
            else:
                ch.partial = ch.x[:, 0, :].reshape(-1).contiguous()
                ch.stage = 2
            self._chunks.append(ch)

    def _advance(self, ch: _Chunk, block: bool) -> None:
        cfg, topo = self.cfg, self.topo
        M = topo.nodes
        C = ch.out.numel()
        if ch.stage == 1 and (block or _completed(ch.work)):
            _wait(ch.work)
            codec = Codec(cfg.gradient_quantization_bits_intra, cfg.gq_group_size_intra, stochastic=True)
            ch.partial = codec.decode_sum(ch.recv, M * C, torch.empty(M * C, dtype=torch.float32,
                                                                       device=ch.out.device))
            ch.recv, ch.work, ch.stage = None, None, 2
        if ch.stage == 2 and ch.issued2 and (block or _completed(ch.work)):
            _wait(ch.work)
            if M > 1:
                codec = Codec(cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter, stochastic=True)
                red = codec.decode_sum(ch.recv, C, torch.empty(C, dtype=torch.float32, device=ch.out.device))
            else:
                red = ch.partial
            if cfg.hadamard_transform:
                red = rotate(red)
            if cfg.op is Average:
                red = red.mul_(1.0 / topo.world)
            ch.out.copy_(red)
            ch.recv = ch.partial = ch.work = None
            ch.stage = 3

    def _issue_inter(self, ch: _Chunk, step: int) -> None:
        cfg, topo = self.cfg, self.topo
        M = topo.nodes
        C = ch.out.numel()
        ch.issued2 = True
        if M == 1:
            return
        codec = Codec(cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter, stochastic=True)
        R = codec.row_bytes(C)
        send = torch.empty(M, R, dtype=torch.uint8, device=ch.out.device)
        for node in range(M):
            codec.encode(ch.partial[node * C:(node + 1) * C], send[node],
                         mix_seed(cfg.seed, step, topo.rank, ch.bucket, ch.index, 2))
        ch.recv = torch.empty_like(send)
        self._sent += send.numel()
        ch.work = dist.all_to_all_single(ch.recv.view(-1), send.view(-1), group=topo.inter, async_op=True)

    def poll(self, step: int, block: bool = False) -> None:
        """Advance whatever completed; issue inter-node rounds in chunk order."""
        for e in self._exact:
            if not e.done and (block or _completed(e.work)):
                _wait(e.work)
                if self.cfg.op is Average:
                    e.out.div_(self.topo.world)
                e.done = True
        for ch in self._chunks:
            self._advance(ch, block)
        while self._next_inter < len(self._chunks) and self._chunks[self._next_inter].stage == 2:
            self._issue_inter(self._chunks[self._next_inter], step)
            self._next_inter += 1

    def wait_all(self, step: int) -> int:
        """Finish every launched bucket; returns the bytes sent this step and resets."""
        try:
            self.poll(step, block=True)
            for ch in self._chunks:
                self._advance(ch, True)
            assert all(ch.stage == 3 for ch in self._chunks) and all(e.done for e in self._exact)
        finally:
            sent = self._sent
            self._exact, self._chunks, self._next_inter, self._sent = [], [], 0, 0
        return sent
