"""The ``lowbit`` torch.distributed backend: plain ``dist.all_reduce`` (and DDP) in low bit.

``register_lowbit_backend(...)`` registers a Python :class:`torch.distributed.ProcessGroup`
subclass under the name ``"lowbit"``. Each group it creates wraps inner ProcessGroupGloo
backends (CPU tensors) and, where CUDA exists, ProcessGroupNCCL ones (CUDA tensors) built on
the same store. Float SUM/AVG all-reduces run :func:`bitscom.collectives.all_reduce_rounds`;
with ``backend_ops`` (see :class:`~bitscom.collectives.LowBitConfig`) the flat
reduce-scatter and all-gather (``dist.reduce_scatter_tensor`` / ``all_gather_into_tensor``,
``*_single`` on torch 2.13) run their low-bit versions too. Every other operation (integer or
MAX all-reduce, broadcast, list all-gather, all-to-all, barrier, point-to-point, ...) is handed
to the inner backend unchanged. Both torch's 2.11 method names (``_allgather_base``,
``_reduce_scatter_base``, ``alltoall_base``) and 2.13's (``all_gather_single``,
``reduce_scatter_single``, ``all_to_all_single``) are implemented.

Asynchronous: a compressed collective returns at once with its first round (a two-integer
size check) issued on the inner backend, in call order; a driver thread of the group runs
the remaining rounds on a second inner backend, one collective after another in call order
(the same on every rank), and completes the returned work's future. So DDP overlaps the
compressed all-reduce of a bucket with backward, as on NCCL. Ranks passing different element
counts get the same ``ValueError`` from ``wait()`` on every rank.

Error-feedback state is keyed by the tensor's storage (address, numel, dtype): DDP's bucket
buffers are persistent, so every bucket keeps its own residual across steps.
"""

from __future__ import annotations

import queue
import threading
import weakref
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from .collectives import (LowBitConfig, LowBitState, all_gather_rounds, all_reduce_rounds,
                          reduce_scatter_rounds, same_size_rounds)
from .comm import Comm, Rounds, is_sum_or_avg

__all__ = ["register_lowbit_backend", "LowBitProcessGroup", "registered_config", "BACKEND_NAME",
           "FutureWork", "InnerTransport"]

BACKEND_NAME = "lowbit"
_registered: dict = {}  # torch's backend registry is process-global; so is what we told it


def registered_config() -> Optional[LowBitConfig]:
    """The settings the ``lowbit`` backend was registered with (None before registration).

    Example::

        bitscom.register_lowbit_backend(bitwidth=4); registered_config().bitwidth   # 4
    """
    return _registered.get(BACKEND_NAME)


def register_lowbit_backend(config: Optional[LowBitConfig] = None, **settings) -> LowBitConfig:
    """Register the ``lowbit`` backend with a :class:`LowBitConfig` or its settings by name
    (the seed's ``bitwidth``, ``error_feedback``, ``error_feedback_mode``, ``block_size``,
    ``stage2_error_feedback``, ... ; see :class:`LowBitConfig`).

    Registering again with the same settings is a no-op; with different settings it raises,
    because groups created earlier would silently keep the old ones. A group may override the
    registered settings with ``pg_options=LowBitConfig(...)`` in ``new_group``. The backend
    runs the flat scheme (``hierarchy="none"``).

    Example::

        bitscom.register_lowbit_backend(bitwidth=4, error_feedback=True)
        dist.init_process_group("lowbit")          # or bitscom.init(bitwidth=4, error_feedback=True)
        dist.all_reduce(grad)                       # two-stage 4-bit all-reduce
    """
    cfg = LowBitConfig.build(config, **settings)
    _check_flat(cfg)
    old = _registered.get(BACKEND_NAME)
    if old is not None:
        if old != cfg:
            raise ValueError(f"the {BACKEND_NAME!r} backend is already registered with {old}; "
                             f"registering it again with {cfg} is not allowed (torch keeps one "
                             f"registration per process). Pass pg_options=LowBitConfig(...) to "
                             f"dist.new_group(backend='lowbit') for a group with other settings")
        return cfg
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    _registered[BACKEND_NAME] = cfg
    return cfg


def _check_flat(cfg: LowBitConfig) -> None:
    if cfg.hierarchy != "none":
        raise ValueError("the lowbit backend runs the flat scheme; hierarchy="
                         f"{cfg.hierarchy!r} is available through LowBitGroup and LowBit")


def _check_same_config(store, rank: int, size: int, config: LowBitConfig) -> None:
    """Every rank publishes its settings in the group's store and compares them with all
    others', so ranks registered with different options fail at group creation, each with
    the same message, instead of exchanging bytes of different formats."""
    mine = repr(config)
    store.set(str(rank), mine)
    seen = [store.get(str(r)).decode() for r in range(size)]
    differ = [r for r in range(size) if seen[r] != seen[0]]
    if differ:
        raise RuntimeError(f"bitscom lowbit backend: ranks registered different options; rank 0 has "
                           f"{seen[0]}, rank {differ[0]} has {seen[differ[0]]}. Call "
                           "register_lowbit_backend with the same settings on every rank")


def _create(dist_opts, pg_options):
    cfg = pg_options if isinstance(pg_options, LowBitConfig) else registered_config()
    if cfg is None:
        raise RuntimeError("the 'lowbit' backend was used before bitscom.register_lowbit_backend()")
    return LowBitProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                              dist_opts.timeout, cfg)


class InnerTransport:
    """Issues collectives straight on inner torch backends (ProcessGroupGloo/NCCL objects).

    The "groups" a :class:`~bitscom.comm.Comm` passes are those backend objects.

    Example::

        comm = Comm(main_backend, later_backend, transport=InnerTransport(), rank=r, size=n)
    """

    def size(self, group) -> int:
        return group.size()

    def rank(self, group) -> int:
        return group.rank()

    def all_reduce(self, group, tensor, op):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return group.allreduce([tensor], opts)

    def all_gather(self, group, output, input):
        return group._allgather_base(output, input, AllgatherOptions())

    def all_to_all(self, group, output, input):
        return group.alltoall_base(output, input, [], [], dist.AllToAllOptions())

    def reduce_scatter(self, group, output, input, op):
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = op
        return group._reduce_scatter_base(output, input, opts)

    def broadcast(self, group, tensor, src):
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return group.broadcast([tensor], opts)

    def reduce(self, group, tensor, dst, op):
        opts = dist.ReduceOptions()
        opts.rootRank = dst
        opts.reduceOp = op
        return group.reduce([tensor], opts)


_INNER = InnerTransport()


class FutureWork(dist.Work):
    """The work handle of a compressed collective: done when the driver thread completed its
    future; ``wait()`` raises the collective's error (torch's future-backed work would drop it).

    Example::

        work = dist.all_reduce(t, group=lowbit_group, async_op=True); work.wait()
    """

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.wait()
        except Exception:  # noqa: BLE001
            return False
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self):
        return self._future.wait()


class _Driver:
    """One thread per group that runs compressed collectives' later rounds in call order."""

    def __init__(self):
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="bitscom-lowbit-driver", daemon=True)
        self._thread.start()

    def submit(self, rounds: Rounds, future: torch.futures.Future, result, stream=None) -> None:
        self._queue.put((rounds, future, result, stream))

    def close(self) -> None:
        """Let the thread end once the queued collectives finished (the group was dropped)."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            rounds, future, result, stream = item
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        rounds.wait()
                        stream.synchronize()
                else:
                    rounds.wait()
            except BaseException as err:  # noqa: BLE001 — handed to whoever waits on the work
                future.set_exception(err)
            else:
                future.set_result(result)


class LowBitProcessGroup(dist.ProcessGroup):
    """A process group whose float SUM/AVG all-reduce (and, with ``backend_ops``, flat
    reduce-scatter / all-gather) is low-bit; everything else is exact.

    Created by torch through the registered backend (``init_process_group("lowbit")``,
    ``new_group(backend="lowbit")``), not by users. ``bytes_sent`` counts the payload of
    compressed collectives (after they completed).

    Example::

        pg = dist.new_group(backend="lowbit", pg_options=bitscom.collectives.LowBitConfig(bitwidth=8))
        dist.all_reduce(t, group=pg)
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta, config: LowBitConfig):
        super().__init__(rank, size)
        _check_flat(config)
        self.config = config
        self.bytes_sent = 0
        self._rank, self._size = rank, size
        _check_same_config(dist.PrefixStore("lowbit-config/", store), rank, size, config)
        # Two inner backends per device: first rounds are issued by the caller in call order;
        # later rounds by the driver thread, also in call order, on the second one.
        self._inner, self._later = {}, {}
        for name, table in (("gloo/", self._inner), ("gloo-later/", self._later)):
            table["cpu"] = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timeout=timeout)
        if torch.cuda.is_available() and dist.is_nccl_available():
            for name, table in (("nccl/", self._inner), ("nccl-later/", self._later)):
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                table["cuda"] = dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, size, opts)
        self._states = {}
        self._driver = None
        self._lock = threading.Lock()

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def inner_groups(self) -> dict:
        """The wrapped backends by device type ("cpu": gloo, "cuda": nccl)."""
        return dict(self._inner)

    def _kind(self, *tensors) -> str:
        for t in tensors:
            if isinstance(t, (list, tuple)):
                if t:
                    return self._kind(*t)
                continue
            if isinstance(t, torch.Tensor):
                kind = t.device.type
                if kind not in self._inner:
                    raise RuntimeError(f"the lowbit backend has no inner group for {kind} tensors")
                return kind
        return "cuda" if "cuda" in self._inner else "cpu"

    def _for(self, *tensors):
        return self._inner[self._kind(*tensors)]

    def _state(self, op: str, t: torch.Tensor) -> LowBitState:
        key = (op, t.data_ptr(), t.numel(), t.dtype)
        if key not in self._states:
            self._states[key] = LowBitState()
        return self._states[key]

    # -- the compressed ops --------------------------------------------------------------------
    def _comm(self, kind: str) -> Comm:
        return Comm(self._inner[kind], self._later[kind], transport=_INNER, rank=self._rank,
                    size=self._size)

    def _launch(self, kind: str, what: str, numel: int, average: bool, device, body, result):
        """Start ``body(comm)`` after the size check; returns a Work completed by the driver."""
        comm = self._comm(kind)
        rounds = Rounds(_then(same_size_rounds(comm, what, numel, average, device), body, comm), [comm])
        rounds.start()                 # the size check, issued now, in call order
        future = torch.futures.Future()
        stream = torch.cuda.current_stream(device) if kind == "cuda" else None
        with self._lock:
            if self._driver is None:
                self._driver = _Driver()
                weakref.finalize(self, self._driver.close)   # no thread outlives its group
        self._driver.submit(_Counted(rounds, self), future, result, stream)
        return FutureWork(future)

    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None:
            opts = dist.AllreduceOptions()
        op = opts.reduceOp
        compress = is_sum_or_avg(op) and \
            all(t.is_floating_point() for t in tensors) and "all_reduce" in self.config.backend_ops
        if not compress:
            return self._for(tensors).allreduce(tensors, opts)
        kind = self._kind(tensors)
        average = op == dist.ReduceOp.AVG
        states = [self._state("all_reduce", t) for t in tensors]

        def body(comm):
            for t, st in zip(tensors, states):
                flat = t if t.is_contiguous() else t.contiguous()
                yield from all_reduce_rounds(flat, comm, self.config, st, average=average, key=t.numel())
                if flat is not t:
                    t.copy_(flat)

        numel = sum(t.numel() for t in tensors)
        return self._launch(kind, "all_reduce", numel, average, tensors[0].device, body, list(tensors))

    def _lowbit_reduce_scatter(self, output, input, opts):
        op = opts.reduceOp
        if not ("reduce_scatter" in self.config.backend_ops and output.is_floating_point()
                and input.is_floating_point() and is_sum_or_avg(op)):
            return None
        average = op == dist.ReduceOp.AVG
        st = self._state("reduce_scatter", input)

        def body(comm):
            yield from reduce_scatter_rounds(output, input, comm, self.config, st, average=average,
                                             key=output.numel())

        return self._launch(self._kind(output), "reduce_scatter", output.numel(), average,
                            output.device, body, output)

    def _lowbit_all_gather(self, output, input):
        if not ("all_gather" in self.config.backend_ops and output.is_floating_point()
                and input.is_floating_point()):
            return None
        st = self._state("all_gather", input)

        def body(comm):
            yield from all_gather_rounds(output, input, comm, self.config, st, key=input.numel())

        return self._launch(self._kind(input), "all_gather", input.numel(), False, input.device,
                            body, output)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        work = self._lowbit_reduce_scatter(output, input, opts)
        return work if work is not None else self._for(output)._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        """torch >= 2.13's name of :meth:`_reduce_scatter_base`."""
        return self._reduce_scatter_base(output, input, opts)

    def _allgather_base(self, output, input, opts=None):
        opts = opts or AllgatherOptions()
        work = self._lowbit_all_gather(output, input)
        return work if work is not None else self._for(input)._allgather_base(output, input, opts)

    def all_gather_single(self, output, input, opts=None):
        """torch >= 2.13's name of :meth:`_allgather_base`."""
        return self._allgather_base(output, input, opts)

    # -- exact delegation ----------------------------------------------------------------------
    def allreduce_coalesced(self, tensors, opts=None):
        return self._for(tensors).allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions())

    def broadcast(self, tensors, opts=None):
        return self._for(tensors).broadcast(tensors, opts or dist.BroadcastOptions())

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._for(input_tensors).allgather(output_tensors, input_tensors,
                                                  opts or AllgatherOptions())

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._for(input_list).allgather_coalesced(output_lists, input_list,
                                                         opts or AllgatherOptions())

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._for(inputs).allgather_into_tensor_coalesced(outputs, inputs,
                                                                 opts or AllgatherOptions())

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """torch >= 2.13's name of :meth:`allgather_into_tensor_coalesced` (exact)."""
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def gather(self, output_lists, input_tensors, opts=None):
        return self._for(input_tensors).gather(output_lists, input_tensors, opts or dist.GatherOptions())

    def scatter(self, output_tensors, input_lists, opts=None):
        return self._for(output_tensors).scatter(output_tensors, input_lists,
                                                 opts or dist.ScatterOptions())

    def reduce(self, tensors, opts=None):
        return self._for(tensors).reduce(tensors, opts or dist.ReduceOptions())

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        return self._for(output_tensors).reduce_scatter(output_tensors, input_lists,
                                                        opts or dist.ReduceScatterOptions())

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._for(outputs).reduce_scatter_tensor_coalesced(outputs, inputs,
                                                                  opts or dist.ReduceScatterOptions())

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """torch >= 2.13's name of :meth:`reduce_scatter_tensor_coalesced` (exact)."""
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._for(input).alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                              opts or dist.AllToAllOptions())

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """torch >= 2.13's name of :meth:`alltoall_base` (exact)."""
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._for(input_tensors).alltoall(output_tensors, input_tensors,
                                                 opts or dist.AllToAllOptions())

    def send(self, tensors, dst_rank, tag):
        return self._for(tensors).send(tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag):
        return self._for(tensors).recv(tensors, src_rank, tag)

    def recv_anysource(self, tensors, tag):
        return self._for(tensors).recv_anysource(tensors, tag)

    def barrier(self, opts=None):
        return self._inner["cpu"].barrier(opts or dist.BarrierOptions())

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self._inner["cpu"].monitored_barrier(timeout, wait_all_ranks)


def _then(check, body, comm):
    yield from check
    yield from body(comm)


class _Counted:
    """Rounds whose bytes are added to the group's ``bytes_sent`` once they finished."""

    def __init__(self, rounds: Rounds, group: LowBitProcessGroup):
        self._rounds, self._group = rounds, group

    def wait(self) -> None:
        try:
            self._rounds.wait()
        finally:
            self._group.bytes_sent += self._rounds.bytes_sent
