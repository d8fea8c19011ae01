"""Handles of asynchronous Horovod-face calls, driven by the one round driver.

A :class:`Handle` wraps a :class:`bitscom.comm.Rounds` (the round driver every face uses):
the call's round generator issues its header round at call time; the payload round starts
once the header round completed — noticed on the next call into this face, in :func:`poll`
or in :func:`synchronize`.

In-call-order rule: unfinished handles wait in one queue and only the oldest is advanced, so
a handle issues its payload only when every earlier handle has finished. Every rank thus
issues payload rounds in the same order whatever the timing (the rule :mod:`bitscom.engine`
follows for buckets). A handle that fails keeps its error for :func:`synchronize` and does
not block the handles after it.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional

from ..comm import Comm, Rounds

__all__ = ["Handle", "submit", "progress", "synchronize", "poll"]


class Handle:
    """An asynchronous collective in flight: pass it to :func:`synchronize` or :func:`poll`.

    Example::

        h = bitscom.allreduce_async(grad, name="g")
        ...                                   # compute meanwhile
        avg = bitscom.synchronize(h)
    """

    def __init__(self, fn: str, name: Optional[str], rounds: Rounds):
        self.fn = fn
        self.name = name
        self._rounds = rounds
        self._error: Optional[BaseException] = None

    @property
    def done(self) -> bool:
        """Finished, with a result or an error (:func:`synchronize` will not block)."""
        return self._error is not None or self._rounds.done

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent for this call so far (counted by its :class:`Comm`)."""
        return self._rounds.bytes_sent

    def _drive(self, block: bool) -> bool:
        if not self.done:
            try:
                self._rounds.poll(block=block)
            except Exception as err:  # noqa: BLE001 — kept and raised by synchronize()
                self._error = err
        return self.done

    def __repr__(self) -> str:
        state = "done" if self.done else "in flight"
        return f"<bitscom.Handle {self.fn}{'' if self.name is None else ' ' + repr(self.name)} {state}>"


_queue: List[Handle] = []          # unfinished handles, in call order


def progress(until: Optional[Handle] = None) -> None:
    """Advance handles in call order; block for every handle up to ``until`` (inclusive).

    Example::

        progress()          # non-blocking: issue whatever payload rounds are due
    """
    blocking = until is not None and until in _queue
    while _queue:
        handle = _queue[0]
        if not handle._drive(block=blocking):
            return
        _queue.pop(0)
        if handle is until:
            return


def submit(fn: str, name: Optional[str], rounds: Iterator, comm: Optional[Comm]) -> Handle:
    """Start a call's round generator (its header round) and queue its handle.

    Errors found before any collective (bad arguments on a single process) raise here.

    Example::

        return submit("allgather", name, _allgather_rounds(label, tensor, comm), comm)
    """
    handle = Handle(fn, name, Rounds(rounds, [] if comm is None else [comm]))
    progress()
    try:
        handle._rounds.start()
    except Exception as err:  # noqa: BLE001
        handle._error = err
    if handle._error is not None:
        raise handle._error
    if not handle.done:
        _queue.append(handle)
    return handle


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result (the output tensor; for ``alltoall`` with
    ``splits`` the pair ``(output, received_splits)``).

    Example::

        h = bitscom.allgather_async(x)
        everything = bitscom.synchronize(h)
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize expects a bitscom.Handle, got {type(handle).__name__}")
    if not handle.done:
        progress(until=handle)
    if handle._error is not None:
        raise handle._error
    return handle._rounds.result


def poll(handle: Handle) -> bool:
    """True when ``handle`` finished (:func:`synchronize` will not block). Never blocks.

    Example::

        while not bitscom.poll(h):
            do_other_work()
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"poll expects a bitscom.Handle, got {type(handle).__name__}")
    progress()
    return handle.done
