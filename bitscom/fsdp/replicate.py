"""HSDP: the all-reduce across the replicate dimension, sent in low bit with error feedback.

HSDP (hybrid sharding) reduce-scatters a module's gradients inside a shard group (a node: fast
links) and then all-reduces each shard across the replicas (one rank per node: the slow
inter-node network). The second hop is the expensive one, so that is the one to compress.

How it plugs into FSDP2 (read from torch's ``_fully_shard`` source, 2.13):

* ``fully_shard(mesh=<2-D mesh>)`` (native HSDP) runs ``dist.all_reduce`` over the replicate
  group itself, in the reduce dtype. No public hook replaces it:
  ``set_requires_all_reduce(False)`` skips the all-reduce *and* leaves the gradient unset (it
  only accumulates for gradient accumulation), and ``set_all_reduce_hook`` runs *after* the
  native all-reduce. So a natively 2-D-sharded model is refused with a clear error.
* ``fully_shard(mesh=mesh["shard"])`` (a 1-D mesh: FSDP over the shard group only) plus
  ``set_all_reduce_hook(hook)``: FSDP calls ``hook(reduce_output)`` with the reduce-scatter
  output, before its post-division and before the shard is written into ``param.grad``. That
  is torchft's HSDP (torchtitan's fault-tolerant path uses exactly this hook), and it is what
  :class:`ReplicateAllReduce` implements: ``reduce_output`` becomes the low-bit average over
  the replicate group, bitwise identical on every replica.

Gradient accumulation matches native HSDP too: after ``set_requires_all_reduce(False)`` (which
on a 1-D mesh FSDP itself ignores) the hook keeps the shard in a pending sum and hands FSDP
zeros; the next backward with all-reduce on adds the pending sum and all-reduces once, as
native HSDP does with its ``partial_reduce_output``.

Averaging matches native HSDP: FSDP over the shard group divides by the shard size (``AVG``,
or its pre/post factors for fp16 or ``set_force_sum_reduction_for_comms``), so the hook divides
the replica sum by the replica count; after ``set_gradient_divide_factor(f)`` FSDP already
divides by ``f`` (native HSDP then all-reduces with ``SUM``), so the hook only sums.

Example::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    bitscom.fsdp.compress(model, replicate_group=mesh.get_group("replicate"))
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
    """Bytes of the two HSDP hops, this rank, since construction: sent and what float32 would
    have sent (the reduce-scatter's input, the all-reduce's input, 4 bytes an element).

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
    """Whether ``module``'s parameters were ``fully_shard``-ed on a 2-D mesh (native HSDP):
    DTensors whose mesh has two dimensions.

    Example::

        native_hsdp(model)   # False after fully_shard(model, mesh=mesh["shard"])
    """
    for p in module.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and mesh.ndim > 1:
            return True
    return False


def check_replicate_group(replicate_group, shard_group) -> None:
    """The replicate group must meet FSDP's shard group in this rank only (one rank per shard
    index and replica): otherwise the 'replicas' would average different shards.

    Example::

        check_replicate_group(mesh.get_group("replicate"), mesh.get_group("shard"))
    """
    mine = dist.get_rank()
    replicas = dist.get_process_group_ranks(replicate_group)
    shards = dist.get_process_group_ranks(shard_group)
    if set(replicas) & set(shards) != {mine}:
        raise ValueError(f"replicate_group has ranks {replicas} and FSDP shards over ranks {shards}: "
                         "they must share this rank only (pass mesh.get_group('replicate') of the "
                         "2-D mesh whose mesh['shard'] you gave fully_shard)")


class ReplicateAllReduce:
    """FSDP2's all-reduce hook for one parameter group: the replica average in low bit.

    Args:
        cfg: the replicate all-reduce settings (:func:`replicate_config`).
        key: the module's name; keys the stochastic-rounding seeds.
        state: this group's :class:`~bitscom.lowbit.LowBitState` (step, error-feedback residual).
        counter: where the bytes of both hops are added (:class:`HSDPBytes`).
        group: the replicate process group.
        shard_group: FSDP's shard group (checked against ``group`` on first use).
        divide_factor: callable returning the module's ``set_gradient_divide_factor`` (or None).
        requires_all_reduce: callable returning the module's ``set_requires_all_reduce`` flag.
        count_reduce_scatter: the reduce-scatter is FSDP's own exact one: count its bytes here.
        before: called first (the handle's liveness and resume checks).

    Example::

        hook = ReplicateAllReduce(cfg, "blocks.0", LowBitState(), HSDPBytes(), replicate_pg, shard_pg)
        fsdp_module.set_all_reduce_hook(hook)
    """

    def __init__(self, cfg: LowBitConfig, key: str, state: LowBitState, counter: HSDPBytes, group,
                 shard_group, divide_factor: Optional[Callable[[], Optional[float]]] = None,
                 count_reduce_scatter: bool = True, before: Optional[Callable[[], None]] = None,
                 requires_all_reduce: Optional[Callable[[], bool]] = None):
        self.cfg, self.key, self.state, self.counter = cfg, key, state, counter
        self.group, self.shard_group, self.divide_factor = group, shard_group, divide_factor
        self.count_reduce_scatter, self.before = count_reduce_scatter, before
        self.requires_all_reduce = requires_all_reduce
        self.pending: Optional[torch.Tensor] = None   # accumulated shards awaiting one all-reduce
        self._checked = False

    def __call__(self, reduce_output: torch.Tensor) -> None:
        """Replace ``reduce_output`` (this rank's reduce-scattered shard) by its average (or,
        after ``set_gradient_divide_factor``, its sum) over the replicas, in place."""
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
        if self._accumulate(reduce_output):
            return
        self._all_reduce(reduce_output)

    def _accumulate(self, reduce_output: torch.Tensor) -> bool:
        """Gradient accumulation without all-reduce: keep the shard, give FSDP zeros. Otherwise
        add what was kept (then ``reduce_output`` is all-reduced); returns whether to stop."""
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
        n = reduce_output.numel()
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
        c.inter_dense += 4 * n
        c.all_reduces += 1
