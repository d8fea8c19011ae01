"""Start every rank from the same state: broadcast parameters, optimizer state, objects."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import runtime

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object"]


def _group(process_group):
    if process_group is not None:
        return process_group
    if runtime.is_initialized():
        return runtime.world_group()
    return None


def _active(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def broadcast_parameters(params, root_rank: int = 0, process_group=None) -> None:
    """Overwrite ``params`` on every rank with root's values, in place.

    ``params`` is a ``state_dict()`` (parameters and buffers), ``named_parameters()`` or
    any iterable of tensors or (name, tensor) pairs. ``root_rank`` is a global rank.

    Example::

        bitscom.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    group = _group(process_group)
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: kv[0])
    else:
        items = [(None, p) if isinstance(p, torch.Tensor) else p for p in params]
    if not _active(group):
        return
    works = []
    with torch.no_grad():
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"broadcast_parameters expects tensors; {name!r} is {type(tensor).__name__}")
            works.append(dist.broadcast(tensor.data, src=root_rank, group=group, async_op=True))
    for w in works:
        w.wait()


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def broadcast_object(obj: Any, root_rank: int = 0, process_group=None) -> Any:
    """Return root's ``obj`` (any picklable object) on every rank.

    Example::

        epoch = bitscom.broadcast_object(epoch, root_rank=0)
    """
    group = _group(process_group)
    if not _active(group):
        return obj
    box = [obj if dist.get_rank() == root_rank else None]
    device = None
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    dist.broadcast_object_list(box, src=root_rank, group=group, device=device)
    return box[0]


def broadcast_optimizer_state(optimizer, root_rank: int = 0, process_group=None) -> None:
    """Load root's optimizer state (moments, step counts, learning rates) on every rank.

    Accepts a ``torch.optim.Optimizer`` or a :class:`bitscom.DistributedOptimizer` (whose
    wrapped optimizer is synchronized; compressor state is per rank and is left alone).

    Example::

        bitscom.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state expects an optimizer, got {type(optimizer).__name__}")
    group = _group(process_group)
    if not _active(group):
        return
    state = _to_cpu(inner.state_dict()) if dist.get_rank() == root_rank else None
    state = broadcast_object(state, root_rank, group)
    inner.load_state_dict(state)
