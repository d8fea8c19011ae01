"""The ACP-SGD API (Zhang et al., ICDCS 2023) on top of bitscom: ``import acpsgd``.

Why a second name: scripts written for the ACP-SGD reference code (``acpsgd.init()``,
``acpsgd.DistributedOptimizer(optimizer, ..., rank=4, threshold=25)``) run unchanged. Every
function here forwards to bitscom; there is no second implementation. Unlike the reference
code it runs on CPU (gloo) as well as CUDA, supports ``backward_passes_per_step`` and
``synchronize()``, and keeps replicas identical without the user seeding anything.

Like the reference code, ``acpsgd.init()`` is optional: a script that starts
``torch.distributed.init_process_group`` itself and then calls ``acpsgd.size()`` works, the
process group is adopted on first use.

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
                     is_initialized, local_rank, local_size, nccl_built, rank, size)
from bitscom.comm import Comm
from bitscom.compressors import get as _get_compressor
from bitscom.face import require_group

__all__ = ["init", "is_initialized", "rank", "size", "local_rank", "local_size", "nccl_built",
           "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
           "broadcast_object", "allreduce"]


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
        optimizer = acpsgd.DistributedOptimizer(optimizer, model.named_parameters(), 4, 25)
    """
    if "model" in kwargs:
        raise TypeError("acpsgd.DistributedOptimizer takes the model's parameters, not the model: "
                        "pass named_parameters=model.named_parameters() instead of model=")
    if "compression" in kwargs:
        raise TypeError("acpsgd.DistributedOptimizer always uses ACP-SGD; for another compressor "
                        "use bitscom.DistributedOptimizer(optimizer, compression=...)")
    return bitscom.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                        compression=_get_compressor("acpsgd", rank=rank),
                                        fusion_threshold_mb=threshold, **kwargs)


def allreduce(tensor: torch.Tensor, name=None, *, average: bool = True,
              process_group=None) -> torch.Tensor:
    """Sum ``tensor`` over ranks *in place* and return the average as a new tensor — what the
    ACP-SGD reference code's ``allreduce`` does.

    Integer tensors are allowed: the sum stays in ``tensor`` (exact) and the returned average
    is a floating-point tensor (true division, as ``tensor / size`` is in torch). With
    ``average=False`` the summed ``tensor`` itself is returned. ``name`` is accepted for
    compatibility and ignored. Without a process group (one process) nothing is summed and
    the average is ``tensor / 1``.

    Example::

        correct = torch.tensor([local_correct])
        mean_correct = acpsgd.allreduce(correct)      # correct now holds the sum over ranks
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce expects a torch.Tensor, got {type(tensor).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__}")
    # the one stack: the group check every face makes (a launcher without init is an error,
    # not a silent local sum; a user-started torch.distributed group is adopted) and Comm
    group = require_group(process_group, "acpsgd.allreduce")
    world = 1 if group is None else dist.get_world_size(group)
    if world > 1:
        with torch.no_grad():
            Comm(group).all_reduce(tensor).wait()
    if not average:
        return tensor
    return tensor.detach() / world
