"""Parameter all-gather after the shard update: exact, or quantized weight differences (qWD)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..comm import Comm, drive
from ..lowbit.codec import Codec
from ..lowbit.weight_delta import add_delta, delta_codec, encode_delta
from ..lowbit.seeds import mix_seed
from .config import ShardedConfig
from .gradients import Topology
from .layout import ShardPlan

__all__ = ["gather_parameters", "weight_wire_bytes", "replica_shard"]


def weight_wire_bytes(cfg: ShardedConfig, topo: Topology, shard_numel: int, param_dtype: torch.dtype) -> int:
    """Bytes this rank contributes to one bucket's parameter all-gather.

    Example::

        weight_wire_bytes(ShardedConfig(quantized_weights=True), topo, 4096, torch.float32)
    """
    if topo.world == 1:
        return 0
    if cfg.quantized_weights:
        return delta_codec(cfg.weight_quantization_bits, cfg.wq_group_size).row_bytes(shard_numel)
    return shard_numel * torch.empty((), dtype=param_dtype).element_size()


def replica_shard(plan: ShardPlan, bucket: int, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """This rank's shard of bucket ``bucket`` as it stands in the replicas (float32, zero-padded)."""
    b = plan.buckets[bucket]
    out = torch.zeros(b.shard_numel, dtype=torch.float32, device=params[0].device)
    lo = b.master_offset
    for piece in plan.pieces:
        if lo <= piece.master_offset < lo + b.shard_numel:
            a = piece.master_offset - lo
            out[a:a + piece.numel].copy_(params[piece.index].detach().reshape(-1)[piece.start:piece.stop])
    return out


def _encode(codec: Optional[Codec], cfg: ShardedConfig, topo: Topology, plan: ShardPlan, master: torch.Tensor,
            params: List[torch.Tensor], step: int, i: int) -> torch.Tensor:
    """What this rank sends for bucket ``i``: ``Q(master - replica)``, or its master shard."""
    b = plan.buckets[i]
    mine = master[b.master_offset:b.master_offset + b.shard_numel]
    if codec is not None:
        row = torch.empty(codec.row_bytes(b.shard_numel), dtype=torch.uint8, device=master.device)
        encode_delta(codec, mine, replica_shard(plan, i, params), row, mix_seed(cfg.seed, step, topo.rank, i, 0, 3))
        return row
    return mine.to(params[0].dtype).contiguous()


def _apply(codec: Optional[Codec], world: int, b, R: int, out: torch.Tensor, params: List[torch.Tensor]) -> None:
    """Bring bucket ``b``'s parameters up to date from the gathered rows ``out``."""
    if codec is not None:
        rows = out.view(world, R)
        full = torch.empty(world * b.shard_numel, dtype=torch.float32, device=out.device)
        for j in range(world):
            codec.decode(rows[j], b.shard_numel, full[j * b.shard_numel:(j + 1) * b.shard_numel])
    with torch.no_grad():
        for s in b.slots:
            p = params[s.index]
            new = out[s.offset:s.end] if codec is None else add_delta(p.detach().reshape(-1), full[s.offset:s.end])
            p.detach().copy_(new.view(p.shape))


def _gather_rounds(cfg, topo, plan, master, params, step, comm: Comm):
    """Round generator: every bucket's all-gather in one round (bucket order), then the updates."""
    quantized = cfg.quantized_weights and topo.world > 1
    codec = delta_codec(cfg.weight_quantization_bits, cfg.wq_group_size) if quantized else None
    launched, works = [], []
    for i, b in enumerate(plan.buckets):
        row = _encode(codec, cfg, topo, plan, master, params, step, i)
        out = torch.empty(topo.world * row.numel(), dtype=row.dtype, device=master.device)
        works.append(comm.all_gather(out, row))
        launched.append((b, row.numel(), out))
    yield works
    for b, R, out in launched:
        _apply(codec, topo.world, b, R, out, params)


def gather_parameters(cfg: ShardedConfig, topo: Topology, plan: ShardPlan, master: torch.Tensor,
                      params: List[torch.Tensor], step: int) -> int:
    """Bring every replica up to date from the owners' master shards; returns bytes sent."""
    comm = Comm(topo.group, rank=topo.rank, size=topo.world)
    drive(_gather_rounds(cfg, topo, plan, master, params, step, comm), comm)
    return comm.bytes_sent
