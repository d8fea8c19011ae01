"""Handles of asynchronous Horovod-face calls, on the group's Channel (one order for every face)."""

from __future__ import annotations

from typing import Any, Iterator, Optional

from .. import runtime
from ..channel import Channel
from ..comm import Comm, Rounds
from ..validate import instance

__all__ = ["Handle", "submit", "synchronize", "poll"]


class Handle(Rounds):
    """An asynchronous collective in flight (a :class:`~bitscom.comm.Rounds` on its group's
    channel): pass it to :func:`synchronize` or :func:`poll`. ``done``: finished, with a result
    or an error; ``bytes_sent``: what this rank sent for it so far.

    Example::

        h = bitscom.allreduce_async(grad, name="g")
        ...                                   # compute meanwhile
        avg = bitscom.synchronize(h)
    """

    def __init__(self, fn: str, name: Optional[str], rounds: Iterator, comm: Optional[Comm], channel: Channel):
        super().__init__(rounds, [] if comm is None else [comm], keep_going=True)
        self.fn, self.name, self._channel = fn, name, channel

    def __repr__(self) -> str:
        state = "done" if self.done else "in flight"
        return f"<bitscom.Handle {self.fn}{'' if self.name is None else ' ' + repr(self.name)} {state}>"


def submit(fn: str, name: Optional[str], rounds: Iterator, comm: Optional[Comm]) -> Handle:
    """Start a call's rounds (its header round) on its group's channel; local errors raise here."""
    channel = runtime.channel(comm.group) if comm is not None else Channel()
    return channel.submit(Handle(fn, name, rounds, comm, channel))


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result (the output tensor; for ``alltoall`` with
    ``splits`` the pair ``(output, received_splits)``).

    Example::

        h = bitscom.allgather_async(x)
        everything = bitscom.synchronize(h)
    """
    instance("synchronize handle", handle, Handle, "a bitscom.Handle")
    handle._channel.wait(handle)
    return handle.result


def poll(handle: Handle) -> bool:
    """True when ``handle`` finished (:func:`synchronize` will not block). Never blocks.

    Example::

        while not bitscom.poll(h):
            do_other_work()
    """
    instance("poll handle", handle, Handle, "a bitscom.Handle")
    handle._channel.poll()
    return handle.done
