"""Node groups for a process group: this node's ranks (intra) and the ranks with this local
rank (inter), made once per layout and shared by every face that asks.

Why shared. A face that builds its own intra/inter groups per instance leaks two process
groups (sockets, threads) each time it is built, and a sub-group named by its ranks cannot be
destroyed and made again safely (the new one meets the old one's rendezvous keys). So groups
are made once per rank list and world by :func:`bitscom.runtime.shared_group` (init's
timeout; held weakly, so a destroyed world frees them) and reused; the groups
:func:`bitscom.init` built are used whenever they are the ones asked for.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist

from . import runtime

__all__ = ["node_groups"]

def _runtime_group(which: str, ranks: list) -> Optional[object]:
    if not (runtime.is_initialized() and runtime.size() == dist.get_world_size()):
        return None
    try:
        group = runtime.intra_group() if which == "intra" else runtime.inter_group()
    except RuntimeError:                 # adopted group: init() built no node groups
        return None
    if group is not None and dist.get_process_group_ranks(group) == ranks:
        return group
    return None


def _group(which: str, ranks: list):
    found = _runtime_group(which, ranks)
    if found is not None:
        return found
    return runtime.shared_group(ranks, tag="node")


def node_groups(group, local_size: int) -> Tuple[object, object]:
    """(intra, inter) for this rank of ``group`` laid out as contiguous nodes of
    ``local_size`` ranks. Only members call it (each creates the two groups it is in).

    Example::

        intra, inter = node_groups(dist.group.WORLD, 2)     # 4 ranks as 2 nodes x 2
    """
    ranks = dist.get_process_group_ranks(group)
    world, rank = len(ranks), dist.get_rank(group)
    if local_size < 1 or world % local_size:
        raise ValueError(f"local_size={local_size} must divide the group size {world}")
    nodes = world // local_size
    node, local = divmod(rank, local_size)
    intra = group if nodes == 1 else _group("intra", [ranks[node * local_size + i] for i in range(local_size)])
    inter = group if local_size == 1 else _group("inter", [ranks[n * local_size + local] for n in range(nodes)])
    return intra, inter
