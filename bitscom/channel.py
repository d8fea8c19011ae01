"""Channel: the one in-order queue of multi-round collectives per process group. Later rounds go
out when earlier work *completes*, at different moments per rank, so two queues over one group
would interleave differently (the rule: docs/design.md)."""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from typing import Callable, List, Optional, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend  # the lowbit backend's inner groups

from .comm import Comm, Rounds

__all__ = ["Channel"]
W = TypeVar("W", bound=Rounds)


class Channel:
    """The in-order queue of works over one group (held weakly); ``bytes_sent``: what they sent. Example::

        ch = bitscom.runtime.channel(group, later=True)
        comm = ch.comm()
        work = ch.submit(Rounds(compressor.reduce(flat, layout, state, comm), [comm]))
        ch.wait(work)
    """

    def __init__(self, group=None, later_group=None, *, transport=None, rank: Optional[int] = None,
                 size: Optional[int] = None, driver: bool = False):
        self._groups = [self._hold(group), self._hold(later_group)]
        self._comm_args = dict(transport=transport, rank=rank, size=size)
        self._queue: List[Rounds] = []
        self.bytes_sent = 0
        self._submitted = 0
        self._retired: List[object] = []   # see _finished
        self._lock = threading.Lock()
        self._jobs: Optional[queue.Queue] = None
        if driver:
            self._jobs = queue.Queue()
            threading.Thread(target=_run, args=(self._jobs, self._lock, weakref.ref(self)),
                             name="bitscom-channel-driver", daemon=True).start()
            weakref.finalize(self, self._jobs.put, None)      # no thread outlives its channel

    @staticmethod
    def _hold(group):
        if isinstance(group, (dist.ProcessGroup, C10dBackend)):
            return True, weakref.ref(group)
        return group is not None, lambda: group          # None, or torch's NON_GROUP_MEMBER

    def _get(self, which: int):
        had, ref = self._groups[which]
        if had and ref() is None:
            raise RuntimeError("the process group of this bitscom channel was destroyed (bitscom.shutdown() "
                               "or dist.destroy_process_group()); build the face again after bitscom.init()")
        return ref()

    group = property(lambda self: self._get(0), doc="The group first rounds go to.")
    later_group = property(lambda self: self._get(1), doc="The group later rounds go to (None: the comms choose).")

    def set_later_group(self, later_group) -> None:
        """Give the channel its later group (runtime does, once, when a face first needs one)."""
        self._groups[1] = self._hold(later_group)

    def comm(self) -> Comm:
        """A :class:`~bitscom.comm.Comm` for one work, on :attr:`group` then :attr:`later_group`."""
        return Comm(self.group, self.later_group, **self._comm_args)

    def submit(self, rounds: W, on_done: Optional[Callable[[Rounds], None]] = None, stream=None) -> W:
        """Issue ``rounds``' first round now, queue the rest (a driver thread then calls ``on_done``)."""
        rounds._seq, self._submitted = self._submitted, self._submitted + 1
        self._retired = []
        try:
            rounds.start()
        except BaseException:
            self._finished(rounds)
            raise
        if self._jobs is not None:
            self._jobs.put((rounds, on_done, stream))
        elif rounds.done:
            self._finished(rounds)
        else:
            self._queue.append(rounds)
        return rounds

    def poll(self, block: bool = False) -> bool:
        """Advance queued works over completed rounds, in order; returns whether none is left."""
        self._drive(None, block)
        return not self._queue

    def wait(self, work: Optional[Rounds] = None) -> None:
        """Finish ``work`` and every work before it (every work when None); raise ``work``'s error."""
        if self._jobs is not None:
            raise RuntimeError("a driver-thread channel finishes its works itself; wait on the work's future")
        self._drive(work, True)
        if work is not None and work.error is not None:
            raise work.error

    def abort(self, works: Optional[List[Rounds]] = None, cause: Optional[BaseException] = None) -> None:
        """Forget ``works`` (every queued work when None) after a failure; waiting on one raises."""
        drop = list(self._queue) if works is None else [w for w in works if w in self._queue]
        for w in drop:
            if not w.done:
                w.done = True
                w.error = RuntimeError("bitscom: this collective was aborted after an earlier one on its "
                                       f"process group failed{': ' + str(cause) if cause else ''}")
            self._finished(w)
        self._queue = [w for w in self._queue if w not in drop]

    def _drive(self, until: Optional[Rounds], block: bool) -> None:
        ahead = self._advance(None if until is None else until._seq, block)
        for w in ahead if block else ():
            while not w.done:
                _step(w, block=True)
        for w in [w for w in self._queue if w.done]:
            self._finished(w)
        self._queue = [w for w in self._queue if not w.done]

    def _advance(self, limit: Optional[int], block: bool) -> List[Rounds]:
        """Step queued works in order up to ``limit`` while each has released the group."""
        ahead: List[Rounds] = []
        for w in list(self._queue):
            if limit is not None and w._seq > limit:
                break
            if w.done:
                continue
            _step(w, block=False)
            while block and not w.released:
                _step(w, block=True)
            ahead.append(w)
            if w.error is not None and not w.keep_going:
                self.abort(self._queue[self._queue.index(w) + 1:], cause=w.error)
                break
            if not w.released:
                break
        return ahead

    def _finished(self, w: Rounds) -> None:
        if not w._counted:
            w._counted = True
            self.bytes_sent += w.bytes_sent
            # Keep a finished work's last handle until the next submit: dropped on torch's
            # worker thread at interpreter exit, it aborts the process (docs/reliability.md).
            self._retired.append(w._last_work)


def _step(w: Rounds, block: bool) -> None:
    try:
        w.step() if block else Rounds.poll(w)
    except Exception as err:  # noqa: BLE001 — the work's error, raised to whoever waits for it
        w.done, w.error = True, err


def _run(jobs: queue.Queue, lock: threading.Lock, channel: "weakref.ref") -> None:
    while (item := jobs.get()) is not None:
        rounds, on_done, stream = item
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                Rounds.poll(rounds, block=True)
                if stream is not None:
                    stream.synchronize()
        except BaseException as err:  # noqa: BLE001 — handed to whoever waits on the work
            rounds.done, rounds.error = True, err
        ch = channel()
        if ch is not None:
            with lock:
                ch._finished(rounds)
        if on_done is not None:
            on_done(rounds)
