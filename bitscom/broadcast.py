"""Start every rank from the same state: broadcast parameters, optimizer state, objects, after
checking that the ranks describe the same thing (peers' pickles: docs/reliability.md)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .agreement import check_agreement
from .comm import Comm, drive, wait
from .face import require_group
from .horovod.failures import guard
from .horovod.objects import broadcast_object_rounds
from .runtime import group_device
from .validate import instance

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object"]


def _check_root(root_rank, group) -> None:
    instance("root_rank", root_rank, int, "an int (a global rank)")
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    if root_rank not in ranks:
        raise ValueError(f"root_rank {root_rank} is not a rank of the process group (ranks {list(ranks)})")


def broadcast_parameters(params: Any, root_rank: int = 0, process_group: Optional[Any] = None) -> None:
    """Overwrite ``params`` (tensors, pairs or a state dict) in place with ``root_rank``'s. Example::

        bitscom.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    group = require_group(process_group, "bitscom.broadcast_parameters")
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: kv[0])
    else:
        items = [(i, p) if isinstance(p, torch.Tensor) else p for i, p in enumerate(params)]
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError("broadcast_parameters expects tensors or (name, tensor) pairs, got "
                            f"{type(item).__name__} {repr(item)[:80]}")
    if group is None or dist.get_world_size(group) == 1:     # require_group checked membership
        return
    _check_root(root_rank, group)
    check_agreement({"tensors": [(str(n), tuple(t.shape), str(t.dtype)) for n, t in items]}, group,
                    "tensors given to broadcast_parameters")
    comm = Comm(group)
    src = dist.get_group_rank(group, root_rank)
    with torch.no_grad():
        works = [guard(comm.broadcast(tensor.data, src), "bitscom.broadcast_parameters")
                 for _, tensor in items]
    wait(works)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_group: Optional[Any] = None) -> Any:
    """Root's picklable ``obj`` on every rank (unpickled: trust your peers; ``name`` unused). Example::

        epoch = bitscom.broadcast_object(epoch, root_rank=0)
    """
    group = require_group(process_group, "bitscom.broadcast_object")
    if group is None or dist.get_world_size(group) == 1:
        return obj
    _check_root(root_rank, group)
    comm = Comm(group)
    rounds = broadcast_object_rounds(comm, obj, dist.get_group_rank(group, root_rank),
                                     group_device(group), "bitscom.broadcast_object")
    return drive(rounds, comm)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, model: Any = None,
                              process_group: Optional[Any] = None) -> None:
    """Load root's optimizer state everywhere (one pickle; per-rank compressor state left). Example::

        bitscom.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    instance("broadcast_optimizer_state optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
    group = require_group(process_group, "bitscom.broadcast_optimizer_state")
    if group is None or dist.get_world_size(group) == 1:
        return
    _check_root(root_rank, group)
    layout = [[(tuple(p.shape), str(p.dtype)) for p in g["params"]] for g in optimizer.param_groups]
    check_agreement({"optimizer": type(optimizer).__name__, "param_groups": layout}, group,
                    "optimizers given to broadcast_optimizer_state")
    state = None
    if dist.get_rank() == root_rank:
        state = _to_cpu({k: v for k, v in optimizer.state_dict().items() if k != "bitscom"})
    state = broadcast_object(state, root_rank, process_group=group)
    optimizer.load_state_dict(state)
