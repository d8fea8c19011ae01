"""Channel: the one in-order queue of multi-round collectives, one per process group.

Why one per group and not one per face. Collectives on a group must be issued in the same
order on every rank. A multi-round collective (PowerSGD's P then Q, low-bit's all-to-all then
all-gather, a call header then its payload) issues its later rounds when earlier work
*completes*, which happens at different moments on different ranks. Two queues over one group
(an optimizer and a DDP hook, two LowBitGroups, a Horovod call and a LowBitGroup) would each
keep their own order and interleave differently per rank. So every face submits to the
group's Channel, made by :func:`bitscom.runtime.channel`, and the rule is kept once:

1. a work's first round is issued at :meth:`Channel.submit`, on ``group`` (submission order
   is program order, the same on every rank);
2. its later rounds go to ``later_group`` (see :class:`~bitscom.comm.Comm`), and there in
   submission order too: work ``k`` issues a later round only once every work before it is
   *released* — finished, or (when it declared ``total`` rounds) issued all of them;
3. a failed round fails its work (the error reaches whoever waits for it) and, unless the
   work is marked ``keep_going`` (call-header protocols, whose errors every rank raises in
   step), aborts every work queued behind it: their rounds would pair with the wrong peers.

The byte total is what every finished work sent. The ``lowbit`` backend, whose caller must not
block, runs the channel with a driver thread (``driver=True``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from typing import Any, Callable, List, Optional

import torch

from .comm import Comm, Rounds

__all__ = ["Channel"]


def _hold(group, weak: bool) -> Callable[[], Any]:
    if weak and group is not None and not isinstance(group, str):
        try:
            return weakref.ref(group)
        except TypeError:
            pass
    return lambda: group


class Channel:
    """The in-order queue of :class:`~bitscom.comm.Rounds` over one process group.

    Made by :func:`bitscom.runtime.channel` (one per group and world, shared by every face on
    that group). ``weak=True`` holds the groups weakly (torch's registry owns them, so a
    destroyed world really goes); the backend passes its inner backends with ``transport``.

    Example::

        ch = bitscom.runtime.channel(group, later=True)
        comm = ch.comm()
        work = ch.submit(Rounds(compressor.reduce(flat, layout, state, comm), [comm]))
        ...                                    # overlap: the first round is in flight
        ch.wait(work)
    """

    def __init__(self, group=None, later_group=None, *, transport=None, rank: Optional[int] = None,
                 size: Optional[int] = None, driver: bool = False, weak: bool = False):
        self._group, self._later = _hold(group, weak), _hold(later_group, weak)
        self._has_group, self._has_later = group is not None, later_group is not None
        self._transport, self._rank, self._size = transport, rank, size
        self._queue: List[Rounds] = []
        self.bytes_sent = 0
        self._submitted = 0
        self._lock = threading.Lock()
        self._jobs: Optional[queue.Queue] = None
        if driver:
            self._jobs = queue.Queue()
            threading.Thread(target=_run, args=(self._jobs, self._lock, weakref.ref(self)),
                             name="bitscom-channel-driver", daemon=True).start()
            weakref.finalize(self, self._jobs.put, None)      # no thread outlives its channel

    @property
    def group(self):
        """The group first rounds go to."""
        return self._live(self._group, self._has_group)

    @property
    def later_group(self):
        """The group later rounds go to (None: the face's comms choose their own groups)."""
        return self._live(self._later, self._has_later)

    @staticmethod
    def _live(ref, had: bool):
        group = ref()
        if had and group is None:
            raise RuntimeError("the process group of this bitscom channel was destroyed "
                               "(bitscom.shutdown() or dist.destroy_process_group()); build the "
                               "face again after bitscom.init()")
        return group

    def set_later_group(self, later_group, weak: bool = True) -> None:
        """Give the channel its later group (runtime does, once, when a face first needs it)."""
        self._later, self._has_later = _hold(later_group, weak), later_group is not None

    def comm(self) -> Comm:
        """A :class:`~bitscom.comm.Comm` for one work: first round on :attr:`group`, later
        rounds on :attr:`later_group`."""
        return Comm(self.group, self.later_group, transport=self._transport, rank=self._rank,
                    size=self._size)

    # -- the queue ------------------------------------------------------------------------------
    def submit(self, rounds: Rounds, on_done: Optional[Callable[[Rounds], None]] = None,
               stream=None) -> Rounds:
        """Issue ``rounds``' first round now and queue the rest; returns ``rounds`` (the work).

        An error raised up to the first round reaches the caller here and nothing is queued.
        With a driver thread, ``on_done(rounds)`` runs there once the work finished (its
        :attr:`~bitscom.comm.Rounds.error` set on failure), inside ``stream`` when given.
        """
        rounds._seq = self._submitted     # submission order, which wait(work) drives up to
        self._submitted += 1
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
        """Advance queued works whose rounds completed, in order (every work with ``block``);
        returns whether nothing is left in flight. Errors stay with their works."""
        self._drive(None, block)
        return not self._queue

    def wait(self, work: Optional[Rounds] = None) -> None:
        """Drive queued works in submission order until ``work`` (every work when None) and
        all works before it finished; raises ``work``'s error, if it failed."""
        if self._jobs is not None:
            raise RuntimeError("a driver-thread channel completes its works itself; wait on the "
                               "work's future instead")
        self._drive(work, True)
        if work is not None and work.error is not None:
            raise work.error

    def abort(self, works: Optional[List[Rounds]] = None, cause: Optional[BaseException] = None) -> None:
        """Forget ``works`` (every queued work when None) without waiting for them, after a
        failure; waiting for one of them raises instead of hanging."""
        drop = self._queue if works is None else [w for w in works if w in self._queue]
        for w in drop:
            if not w.done:
                w.done = True
                w.error = RuntimeError(f"bitscom: this collective was aborted after an earlier one "
                                       f"on its process group failed{': ' + str(cause) if cause else ''}")
            self._finished(w)
        self._queue = [w for w in self._queue if w not in drop]

    @property
    def in_flight(self) -> int:
        """How many submitted works are not finished yet."""
        return len(self._queue)

    # -- driving --------------------------------------------------------------------------------
    def _drive(self, until: Optional[Rounds], block: bool) -> None:
        limit = None if until is None else until._seq
        ahead: List[Rounds] = []
        for w in list(self._queue):
            if limit is not None and w._seq > limit:
                break
            if w.done:                      # aborted meanwhile
                continue
            self._step(w, block=False)
            while block and not w.released:
                self._step(w, block=True)
            ahead.append(w)
            if w.error is not None and not w.keep_going:
                self.abort(self._queue[self._queue.index(w) + 1:], cause=w.error)
                break
            if not w.released:
                break
        if block:
            for w in ahead:
                while not w.done:
                    self._step(w, block=True)
        for w in [w for w in self._queue if w.done]:
            self._finished(w)
        self._queue = [w for w in self._queue if not w.done]

    @staticmethod
    def _step(w: Rounds, block: bool) -> None:
        """Advance ``w`` over what completed; with ``block`` first wait for its current round."""
        try:
            if block:
                w.step()
            else:
                Rounds.poll(w)
        except Exception as err:  # noqa: BLE001 — the work's error, raised to whoever waits
            w.done, w.error = True, err

    def _finished(self, w: Rounds) -> None:
        if not w._counted:
            w._counted = True
            self.bytes_sent += w.bytes_sent


def _run(jobs: queue.Queue, lock: threading.Lock, channel: "weakref.ref") -> None:
    """The driver thread: finishes each work in submission order (holds the channel weakly)."""
    while True:
        item = jobs.get()
        if item is None:
            return
        rounds, on_done, stream = item
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        try:
            with ctx:
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
