"""Picklable objects over the face's :class:`Comm`: ``allgather_object``, ``barrier`` and the
object broadcast (receivers unpickle peers' bytes: the trust this assumes, docs/reliability.md).
"""

from __future__ import annotations

import pickle
from typing import Any, Generator, List, Optional

import torch

from ..comm import Comm, drive, wait
from .args import check_name, label
from .failures import guard
from .groups import face_group, group_device, group_size

__all__ = ["allgather_object", "barrier", "gather_object_rounds", "broadcast_object_rounds"]


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(data: torch.Tensor) -> Any:
    return pickle.loads(data.cpu().numpy().tobytes())


def gather_object_rounds(comm: Comm, obj: Any, device: torch.device, what: str) -> Generator[Any, None, List[Any]]:
    """Round generator: every rank's ``obj``, in group-rank order."""
    data = _to_bytes(obj, device)
    sizes = torch.empty(comm.size, dtype=torch.int64, device=device)
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    yield guard(comm.all_gather(sizes, mine), what)
    counts = sizes.tolist()
    longest = max(counts)
    send = torch.cat([data, data.new_zeros(longest - data.numel())])
    recv = data.new_empty(comm.size * longest)
    yield guard(comm.all_gather(recv, send), what)
    return [_from_bytes(recv[r * longest: r * longest + n]) for r, n in enumerate(counts)]


def broadcast_object_rounds(comm: Comm, obj: Any, group_root: int, device: torch.device,
                            what: str) -> Generator[Any, None, Any]:
    """Round generator: group rank ``group_root``'s ``obj`` on every rank (root keeps its own)."""
    root = comm.rank == group_root
    data: Optional[torch.Tensor] = _to_bytes(obj, device) if root else None    # None: not root
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    yield guard(comm.broadcast(size, group_root), what)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    yield guard(comm.broadcast(data, group_root), what)
    return obj if root else _from_bytes(data)


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = None, *,
                     process_group: Any = None) -> List[Any]:
    """Return the list of every rank's ``obj`` (any picklable object), in rank order.

    Example::

        counts = bitscom.allgather_object(len(local_dataset))
    """
    check_name(name)
    what = label("allgather_object", name)
    group = face_group(process_group, process_set, what)
    if group_size(group) == 1:
        return [obj]
    comm = Comm(group)
    return drive(gather_object_rounds(comm, obj, group_device(group), what), comm)


def barrier(process_set: Any = None, *, process_group: Any = None) -> None:
    """Block until every rank of the group reached this call (Horovod's ``hvd.barrier``).

    Example::

        if bitscom.rank() == 0:
            prepare_dataset()
        bitscom.barrier()
    """
    group = face_group(process_group, process_set, "bitscom.barrier")
    if group_size(group) > 1:
        wait(guard(Comm(group).all_reduce(torch.zeros(1, device=group_device(group))), "bitscom.barrier"))
