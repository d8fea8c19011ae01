"""The process groups of the Horovod face: which group a call uses, and its comm, whose payload
rounds go in call order to the channel's later group (asked for inside the user's call)."""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from .. import runtime
from ..comm import Comm
from ..runtime import group_device   # the face's name for it (one device rule)
from ..face import require_group    # the library's one group/membership check
from .failures import peer_failure

__all__ = ["require_group", "face_group", "group_size", "group_device", "face_comm"]


def face_group(process_group: Optional[Any], process_set: Optional[Any], what: str) -> Optional[Any]:
    """:func:`require_group` for a Horovod call, refusing Horovod's ``process_set=``."""
    if process_set is not None:
        raise NotImplementedError("Horovod process sets are not supported by bitscom; pass "
                                  "process_group=<a torch.distributed ProcessGroup> "
                                  "(e.g. torch.distributed.new_group(ranks)) instead")
    return require_group(process_group, what)


def group_size(group: Optional[Any]) -> int:
    """Members of ``group`` (1 for ``None``: a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def face_comm(group: Optional[Any], what: str) -> Optional[Comm]:
    """The :class:`Comm` of one call on ``group``'s channel; ``None`` for a single process."""
    if group_size(group) == 1:
        return None
    try:
        return runtime.channel(group, later=True).comm()
    except RuntimeError as err:
        raise peer_failure(what, err, "creating its payload process group") from err
