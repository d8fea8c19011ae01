"""The ACP-SGD API (Zhang et al., ICDCS 2023) on top of bitscom: ``import acpsgd``.

Why a second name: scripts written for the ACP-SGD reference code (``acpsgd.init()``,
``acpsgd.DistributedOptimizer(optimizer, ..., rank=4, threshold=25)``) run unchanged. Every
function here forwards to bitscom; there is no second implementation. Unlike the reference
code it runs on CPU (gloo) as well as CUDA, supports ``backward_passes_per_step`` and
``synchronize()``, and keeps replicas identical without the user seeding anything.

Example::

    import acpsgd
    acpsgd.init()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * acpsgd.size(), momentum=0.9)
    optimizer = acpsgd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    acpsgd.broadcast_parameters(model.state_dict(), root_rank=0)
    acpsgd.broadcast_optimizer_state(optimizer, root_rank=0)
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = criterion(model(data), target)
        loss.backward()
        optimizer.step()
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import bitscom
from bitscom import (broadcast_object, broadcast_optimizer_state, broadcast_parameters, init,
                     local_rank, local_size, rank, size)
from bitscom.compressors import get as _get_compressor

__all__ = ["init", "rank", "size", "local_rank", "local_size", "DistributedOptimizer",
           "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allreduce"]


def DistributedOptimizer(optimizer, named_parameters=None, rank: int = 4, threshold: float = 25,
                         **kwargs) -> bitscom.DistributedOptimizer:
    """Wrap ``optimizer`` with ACP-SGD: bitscom's optimizer with the ``acpsgd`` compressor.

    Args:
        optimizer: the local ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()`` (readable errors and agreement checks).
        rank: ACP-SGD's low rank r: larger approximates the gradient better and sends more
            (r·(rows+cols) numbers per matrix, alternating P and Q sides).
        threshold: tensor-fusion bucket size in MB (the paper's default 25): larger buckets
            mean fewer all-reduces, smaller ones overlap with backward earlier.
        **kwargs: passed to :class:`bitscom.DistributedOptimizer` (e.g.
            ``backward_passes_per_step``, ``process_group``).

    Example::

        optimizer = acpsgd.DistributedOptimizer(optimizer, model.named_parameters(), rank=4)
    """
    if "compression" in kwargs:
        raise TypeError("acpsgd.DistributedOptimizer always uses ACP-SGD; for another compressor "
                        "use bitscom.DistributedOptimizer(optimizer, compression=...)")
    return bitscom.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                        compression=_get_compressor("acpsgd", rank=rank),
                                        fusion_threshold_mb=threshold, **kwargs)


def allreduce(tensor: torch.Tensor, average: bool = True, name=None, process_group=None) -> torch.Tensor:
    """Return a new tensor: ``tensor`` averaged (or summed) over ranks, like ``hvd.allreduce``.

    ``name`` is accepted for Horovod compatibility and ignored. Without a process group (one
    process) the result is a copy of ``tensor``.

    Example::

        val_loss = acpsgd.allreduce(torch.tensor(local_loss))
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce expects a torch.Tensor, got {type(tensor).__name__}")
    if average and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"averaging a {tensor.dtype} tensor would truncate; pass a floating-point "
                        "tensor or average=False for a sum")
    out = tensor.detach().clone()
    group = process_group
    if group is None and bitscom.is_initialized():
        group = bitscom.runtime.world_group()
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None or dist.get_world_size(group) == 1:
        return out
    dist.all_reduce(out, group=group)
    if average:
        out.div_(dist.get_world_size(group))
    return out
