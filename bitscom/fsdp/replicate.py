"""HSDP: the all-reduce across the replicate dimension (the slow inter-node hop), in low bit,
through FSDP's ``set_all_reduce_hook`` on a model sharded over ``mesh["shard"]`` (native 2-D
HSDP's own all-reduce has no hook that replaces it; docs/fsdp.md, HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import runtime
from ..comm import Rounds
from ..lowbit.all_reduce import all_reduce_rounds
from ..lowbit.config import LowBitConfig
from ..lowbit.state import LowBitState
from ..validate import instance
from .settings import LOWBIT_WIDTHS

__all__ = ["HSDPBytes", "ReplicateAllReduce", "replicate_config", "check_replicate_group", "native_hsdp"]


@dataclass
class HSDPBytes:
    """Bytes of the two HSDP hops, this rank, since construction, and their float32 baselines.

    Example::

        bitscom.fsdp.handle(model).hsdp.inter_sent     # bytes of the replicate all-reduces
    """

    intra_sent: int = 0
    intra_dense: int = 0
    inter_sent: int = 0
    inter_dense: int = 0
    all_reduces: int = 0


def replicate_config(replicate) -> LowBitConfig:
    """The settings of the replicate-dimension all-reduce: a :class:`~bitscom.lowbit.LowBitConfig`,
    an int bit width, or ``None`` for the default 4 bits with residual error feedback.
    ``bitwidth=32`` sends float32 (exact: the same result as native HSDP for two replicas).

    Example::

        replicate_config(None).bitwidth          # 4 (with error feedback)
        replicate_config(LowBitConfig(bitwidth=8, stochastic_rounding=True))
    """
    if replicate is None:
        return LowBitConfig(bitwidth=4, error_feedback=True)
    if isinstance(replicate, int) and not isinstance(replicate, bool):
        replicate = LowBitConfig(bitwidth=replicate, error_feedback=replicate < 32)
    instance("replicate", replicate, LowBitConfig, "a bitscom.lowbit.LowBitConfig, an int bit width or None "
             f"(4 bits with error feedback); bit widths: {LOWBIT_WIDTHS}")
    if replicate.hierarchy != "none":
        raise ValueError(f"replicate: hierarchy={replicate.hierarchy!r} is not available for the HSDP "
                         "all-reduce (it runs over the one replicate group); use hierarchy='none'")
    return replicate


def native_hsdp(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters were ``fully_shard``-ed on a 2-D mesh (native HSDP)."""
    return any(getattr(getattr(p, "device_mesh", None), "ndim", 1) > 1 for p in module.parameters())


def check_replicate_group(replicate_group, shard_group) -> None:
    """The replicate group must meet FSDP's shard group in this rank only (else shards would mix)."""
    mine = dist.get_rank()
    replicas = dist.get_process_group_ranks(replicate_group)
    shards = dist.get_process_group_ranks(shard_group)
    if set(replicas) & set(shards) != {mine}:
        raise ValueError(f"replicate_group has ranks {replicas} and FSDP shards over ranks {shards}: "
                         "they must share this rank only (pass mesh.get_group('replicate') of the "
                         "2-D mesh whose mesh['shard'] you gave fully_shard)")


class ReplicateAllReduce:
    """FSDP2's all-reduce hook for one parameter group: the replica average in low bit.
    ``count_reduce_scatter``: the reduce-scatter is FSDP's own, so its bytes are counted here.

    Example::

        hook = ReplicateAllReduce(cfg, "blocks.0", LowBitState(), HSDPBytes(), replicate_pg, shard_pg)
        fsdp_module.set_all_reduce_hook(hook)
    """

    def __init__(self, cfg: LowBitConfig, key: str, state: LowBitState, counter: HSDPBytes, group, shard_group,
                 divide_factor: Optional[Callable[[], Optional[float]]] = None, count_reduce_scatter: bool = True,
                 before: Optional[Callable[[], None]] = None, requires_all_reduce: Optional[Callable[[], bool]] = None):
        self.cfg, self.key, self.state, self.counter = cfg, key, state, counter
        self.group, self.shard_group, self.divide_factor = group, shard_group, divide_factor
        self.count_reduce_scatter, self.before = count_reduce_scatter, before
        self.requires_all_reduce = requires_all_reduce
        self.pending: Optional[torch.Tensor] = None   # accumulated shards awaiting one all-reduce
        self._checked = False

    def __call__(self, reduce_output: torch.Tensor) -> None:
        """Replace ``reduce_output`` in place by its average (or sum, after a divide factor) over replicas."""
        if self.before is not None:
            self.before()
        if self.group is None:
            raise RuntimeError("this bitscom.fsdp handle's process groups are gone (bitscom.shutdown()); "
                               "build the model and compress it again after bitscom.init()")
        if not self._checked:
            check_replicate_group(self.group, self.shard_group)
            self._checked = True
        if self.count_reduce_scatter:              # FSDP's own reduce-scatter of P shards
            shards = dist.get_world_size(self.shard_group)
            self.counter.intra_sent += reduce_output.element_size() * reduce_output.numel() * shards
            self.counter.intra_dense += 4 * reduce_output.numel() * shards
        if not self._accumulate(reduce_output):
            self._all_reduce(reduce_output)

    def _accumulate(self, reduce_output: torch.Tensor) -> bool:
        """Accumulation: keep the shard and give FSDP zeros, or add what was kept; whether to stop."""
        if self.requires_all_reduce is not None and not self.requires_all_reduce():
            if self.pending is None:
                self.pending = reduce_output.detach().clone()
            else:
                self.pending += reduce_output
            reduce_output.zero_()
            return True
        if self.pending is not None:
            reduce_output += self.pending
            self.pending = None
        return False

    def _all_reduce(self, reduce_output: torch.Tensor) -> None:
        flat = reduce_output.view(-1) if reduce_output.dtype == torch.float32 and reduce_output.is_contiguous() \
            else reduce_output.detach().reshape(-1).to(torch.float32)
        average = self.divide_factor is None or self.divide_factor() is None
        channel = runtime.channel(self.group)          # one order with every face on the group
        comm = channel.comm()
        channel.wait(channel.submit(Rounds(all_reduce_rounds(flat, comm, self.cfg, self.state,
                                                             average=average, key=self.key), [comm])))
        if flat.data_ptr() != reduce_output.data_ptr():
            reduce_output.copy_(flat.view(reduce_output.shape))
        c = self.counter
        c.inter_sent += comm.bytes_sent
        c.inter_dense += 4 * reduce_output.numel()
        c.all_reduces += 1
