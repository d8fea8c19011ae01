"""The communicator under every compressed reduction: the torch-version shims, :class:`Comm`
(asynchronous collectives with byte counting) and :class:`Rounds` (the round driver)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat", "resolve_group", "is_sum_or_avg", "TorchTransport", "Comm",
           "Rounds", "drive", "wait", "is_completed", "gather_objects"]

# torch 2.13 renamed these (the old names warn there; 2.11/2.12 have only the old ones)
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_group(group=None):
    """``group``, or torch's world group for ``None`` (``None`` without torch.distributed)."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def is_sum_or_avg(op) -> bool:
    """Whether a reduce op is SUM or AVG, by ``==`` (torch's option ops are equal, not the same)."""
    return op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG


class TorchTransport:
    """Issues asynchronous collectives through ``torch.distributed`` on a registered group."""

    def size(self, group) -> int:
        return dist.get_world_size(group) if dist.is_initialized() else 1

    def rank(self, group) -> int:
        return dist.get_rank(group) if dist.is_initialized() else 0

    def all_reduce(self, group, tensor, op):
        return dist.all_reduce(tensor, op=op, group=group, async_op=True)

    def all_gather(self, group, output, input):
        return all_gather_flat(output, input, group=group, async_op=True)

    def all_to_all(self, group, output, input):
        return dist.all_to_all_single(output, input, group=group, async_op=True)

    def reduce_scatter(self, group, output, input, op):
        return reduce_scatter_flat(output, input, op=op, group=group, async_op=True)

    def all_to_all_v(self, group, output, input, output_splits, input_splits):
        return dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
                                      async_op=True)

    def broadcast(self, group, tensor, src):
        root = dist.get_global_rank(group, src) if group is not None else src
        return dist.broadcast(tensor, src=root, group=group, async_op=True)

    def reduce(self, group, tensor, dst, op):
        root = dist.get_global_rank(group, dst) if group is not None else dst
        return dist.reduce(tensor, dst=root, op=op, group=group, async_op=True)


TORCH = TorchTransport()


class Comm:
    """Asynchronous collectives of one reduction; ``bytes_sent`` is the input buffer of each (the
    root's for broadcast, the others' for reduce; nothing for one member). Example::

        comm = Comm(group)
        work = comm.all_reduce(buf)     # asynchronous; counted in comm.bytes_sent
        work.wait()
    """

    def __init__(self, group=None, later_group=None, *, transport=None,
                 rank: Optional[int] = None, size: Optional[int] = None):
        self.group = group
        self.later_group = later_group
        self.transport = TORCH if transport is None else transport
        self.size = self.transport.size(group) if size is None else size
        self.rank = self.transport.rank(group) if rank is None else rank
        self.bytes_sent = 0
        self.in_later_rounds = False

    @property
    def current_group(self):
        """The group the next collective goes to."""
        if self.in_later_rounds and self.later_group is not None:
            return self.later_group
        return self.group

    def enter_later_rounds(self) -> None:
        """From now on issue on ``later_group`` (when given). Called by the round driver."""
        self.in_later_rounds = True

    def count(self, tensor: torch.Tensor) -> None:
        """Add ``tensor``'s bytes to :attr:`bytes_sent`."""
        self.bytes_sent += tensor.numel() * tensor.element_size()

    solo = property(lambda self: self.size == 1, doc="A group of one member: every collective is local.")

    def _issue(self, sent: Optional[torch.Tensor], name: str, *args, local: Optional[Callable[[], Any]] = None):
        """Issue ``name`` on the current group counting ``sent``; one member runs ``local()`` instead."""
        if self.solo:
            if local is not None:
                local()
            return None
        if sent is not None:
            self.count(sent)
        return getattr(self.transport, name)(self.current_group, *args)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM):
        """Sum (or ``op``) ``tensor`` in place over the group; returns the async work."""
        return self._issue(tensor, "all_reduce", tensor, op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor):
        """``output`` (size × input.numel()) receives every rank's ``input``, in rank order."""
        return self._issue(input, "all_gather", output, input, local=lambda: output.view(-1).copy_(input.view(-1)))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor):
        """Equal splits: chunk j of ``input`` goes to rank j; chunk j of ``output`` comes from j."""
        return self._issue(input, "all_to_all", output, input, local=lambda: output.copy_(input))

    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor, output_splits, input_splits):
        """Uneven splits: ``input_splits[j]`` rows go to rank j, ``output_splits[j]`` come from it."""
        return self._issue(input, "all_to_all_v", output, input, list(output_splits), list(input_splits),
                           local=lambda: output.copy_(input))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM):
        """``output`` = this rank's chunk of the sum of every rank's ``input``."""
        return self._issue(input, "reduce_scatter", output, input, op,
                           local=lambda: output.view(-1).copy_(input.view(-1)))

    def broadcast(self, tensor: torch.Tensor, group_src: int = 0):
        """Broadcast from the rank with *group* rank ``group_src`` (only the root sends)."""
        return self._issue(tensor if self.rank == group_src else None, "broadcast", tensor, group_src)

    def reduce(self, tensor: torch.Tensor, group_dst: int = 0, op=dist.ReduceOp.SUM):
        """Sum ``tensor`` into the rank with group rank ``group_dst`` (others' buffers: undefined)."""
        return self._issue(None if self.rank == group_dst else tensor, "reduce", tensor, group_dst, op)


def gather_objects(obj: Any, group, group_dst: int = 0) -> Optional[list]:
    """Every rank's picklable ``obj`` on group rank ``group_dst`` (unpickles peer data)."""
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    me = dist.get_rank(group)
    out = [None] * dist.get_world_size(group) if me == group_dst else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, group_dst), group=group)
    return out


def is_completed(work) -> bool:
    """True when every handle in ``work`` (one, a list/tuple, or None) finished."""
    if work is None:
        return True
    if isinstance(work, (list, tuple)):
        return all(is_completed(w) for w in work)
    if isinstance(work, torch.futures.Future):
        return work.done()
    return work.is_completed()


def wait(work) -> None:
    """Block until every handle in ``work`` (one, a list/tuple, or None) finished."""
    if isinstance(work, (list, tuple)):
        for w in work:
            wait(w)
    elif work is not None:
        work.wait()


class Rounds:
    """The one driver of a round generator (yields its collectives' work; returns :attr:`result`). Example::

        comm = Comm(group)
        r = Rounds(compressor.reduce(flat, layout, state, comm), [comm]).start()
        ...                                  # overlap: the first round is in flight
        r.wait()
    """

    def __init__(self, rounds: Iterator[Any], comms: Iterable[Comm] = (), *, total: Optional[int] = None,
                 keep_going: bool = False):
        self._rounds = rounds
        self.comms = [c for c in comms if c is not None]
        self.work = None
        self.done = False
        self.result = None
        self.error: Optional[BaseException] = None
        self.started = False
        self.issued = 0
        self.total = total              # rounds it issues, when known (see ``released``)
        self.keep_going = keep_going    # its errors leave the group in step (a call header's)
        self._seq = -1                  # its place on a Channel, and whether the channel counted it
        self._counted = False
        self._last_work: Any = None     # its final round's handle (Channel._finished keeps it)

    @property
    def released(self) -> bool:
        """Finished, or issued all of its ``total`` rounds: works queued behind it may go on."""
        return self.done or (self.total is not None and self.issued >= self.total)

    def start(self) -> "Rounds":
        """Issue the first round (idempotent)."""
        if not self.started:
            self.started = True
            self._advance()
            for c in self.comms:
                c.enter_later_rounds()
        return self

    def _advance(self) -> None:
        try:
            self.work = next(self._rounds)
            self.issued += 1
        except StopIteration as stop:
            self._last_work, self.work, self.done, self.result = self.work, None, True, stop.value
        except BaseException:
            self.work, self.done = None, True
            raise

    def poll(self, block: bool = False) -> bool:
        """Advance through completed rounds; returns :attr:`done`."""
        self.start()
        while not self.done and (block or is_completed(self.work)):
            self.step()
        return self.done

    def step(self) -> None:
        """Wait for the current round and issue the next (without asking whether it completed)."""
        self.start()
        if not self.done:
            wait(self.work)
            self._advance()

    def wait(self, timeout=None) -> bool:
        """Drive every remaining round to completion (``timeout`` unused: groups have theirs)."""
        self.poll(block=True)
        return True

    def is_completed(self) -> bool:
        return self.done

    bytes_sent = property(lambda self: sum(c.bytes_sent for c in self.comms))


def drive(rounds: Iterator[Any], comm: Optional[Comm] = None) -> Any:
    """Run a round generator to completion, synchronously; returns its result."""
    r = Rounds(rounds, [comm] if comm is not None else [])
    r.wait()
    return r.result
