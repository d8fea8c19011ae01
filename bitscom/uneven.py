"""Uneven inputs: ``bitscom.join()``, Horovod's ``hvd.join()``. A rank's extra step would meet
whatever the others do next, so each step starts with a tiny all-reduce that joined ranks
answer (docs/design.md, reliability.md)."""

from __future__ import annotations

import weakref
from typing import Any, Dict

import torch
import torch.distributed as dist

from .agreement import check_agreement
from .comm import Comm, wait
from .face import require_group
from .runtime import group_device

__all__ = ["join", "register", "unregister", "notify"]

_live: "weakref.WeakSet" = weakref.WeakSet()
_notices: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # optimizer -> (template, buffer)


def register(optimizer) -> None:
    """Make ``optimizer`` (a multi-rank DistributedOptimizer) shadowable by :func:`join`."""
    _live.add(optimizer)


def unregister(optimizer) -> None:
    """Forget ``optimizer`` (it was closed)."""
    _live.discard(optimizer)


def notify(optimizer):
    """Issue the step's notice (a buffer refilled on the device: no blocking copy)."""
    buffers = _notices.get(optimizer)
    if buffers is None:
        template = torch.tensor([1, optimizer._uid], dtype=torch.int64,
                                device=group_device(optimizer.process_group))
        buffers = _notices[optimizer] = (template, torch.empty_like(template))
    template, notice = buffers
    notice.copy_(template)
    return Comm(optimizer.process_group).all_reduce(notice)


def _same_group(a, b) -> bool:
    return a is b or dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def _joining(group) -> Dict[int, Any]:
    mine: Dict[int, Any] = {}
    for opt in list(_live):
        if not opt._life.closed and _same_group(opt.process_group, group):
            if opt._mid_step():
                raise RuntimeError("bitscom.join() was called in the middle of an optimizer step "
                                   "(after backward, before step()); call it after the last step")
            mine.setdefault(opt._uid, opt)
    return mine


def join(process_group=None) -> int:
    """Wait for every rank to join, stepping with zero gradients meanwhile; returns the last. Example::

        for x, y in my_shard_of_the_data:          # ranks may have different counts
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        last = bitscom.join()                      # collectives after it line up again
    """
    group = require_group(process_group, "bitscom.join")
    if group is None:
        return 0
    if dist.get_world_size(group) == 1:
        return dist.get_rank()
    mine = _joining(group)
    device = group_device(group)
    comm = Comm(group)
    shadowed = 0
    while True:
        notice = torch.zeros(2, dtype=torch.int64, device=device)
        wait(comm.all_reduce(notice))
        count, ids = int(notice[0]), int(notice[1])
        if count == 0:
            break
        uid = ids // count
        opt = mine.get(uid) if ids % count == 0 else None
        if opt is None:
            raise RuntimeError(
                "bitscom.join(): the other ranks are stepping a bitscom optimizer this rank "
                "does not have (or several different ones at once); every rank must build the "
                "same optimizers on the same process group")
        opt.shadow_step()
        shadowed += 1
    everyone = torch.zeros(comm.size, dtype=torch.int64, device=device)
    wait(comm.all_gather(everyone, torch.tensor([shadowed], dtype=torch.int64, device=device)))
    counts = [int(c) for c in everyone]
    last = dist.get_global_rank(group, max(i for i, c in enumerate(counts) if c == min(counts)))
    if max(counts) > 0:
        # The joined ranks reduced but did not step: give them the last joiner's parameters and state.
        check_agreement({"optimizers": sorted(mine)}, group, "optimizers to synchronize after join")
        for uid in sorted(mine):
            mine[uid]._after_join(last, group)
    return last
