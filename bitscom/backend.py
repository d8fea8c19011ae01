"""The ``lowbit`` torch.distributed backend: plain ``dist.all_reduce`` (and DDP) in low bit.
A ProcessGroup over inner gloo and NCCL backends; what it does and its errors: docs/lowbit.md."""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Generator, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions
from torch._C._distributed_c10d import Backend as C10dBackend  # ProcessGroupGloo/NCCL's base

from .lowbit import LowBitConfig, LowBitState, all_gather_rounds, all_reduce_rounds, reduce_scatter_rounds
from .channel import Channel
from .comm import Comm, Rounds, is_sum_or_avg
from .call_header import Call, agree_rounds
from .face import ByteLedger, dense_bytes, group_alive
from .validate import number

__all__ = ["register_lowbit_backend", "LowBitProcessGroup", "registered_config", "BACKEND_NAME",
           "FutureWork", "InnerTransport", "StateSlots", "MAX_STATES"]

BACKEND_NAME = "lowbit"
MAX_STATES = 256
"""How many compressed-collective states one lowbit group keeps (see :class:`StateSlots`)."""
_registered: dict = {}  # torch's backend registry is process-global; so is what we told it


def registered_config() -> Optional[LowBitConfig]:
    """The settings the ``lowbit`` backend was registered with (None before registration). Example::

        bitscom.register_lowbit_backend(bitwidth=4); registered_config().bitwidth   # 4
    """
    return _registered.get(BACKEND_NAME)


def register_lowbit_backend(config: Optional[LowBitConfig] = None, **settings) -> LowBitConfig:
    """Register the ``lowbit`` backend; again with other settings is an error (groups made
    earlier would silently keep the old ones). Example::

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


def _check_same_config(store, rank: int, size: int, config: LowBitConfig, timeout=None) -> None:
    """Ranks compare their settings through the store; rank 0 (its host) raises after all read."""
    mine = repr(config)
    store.set(str(rank), mine)
    seen = [store.get(str(r)).decode() for r in range(size)]
    differ = [r for r in range(size) if seen[r] != seen[0]]
    if not differ:
        return
    message = (f"bitscom lowbit backend: ranks registered different options; rank 0 has {seen[0]}, "
               f"rank {differ[0]} has {seen[differ[0]]}. Call register_lowbit_backend with the same "
               "settings on every rank")
    try:
        if rank == 0:
            store.wait([f"read/{r}" for r in range(1, size)], timeout or store.timeout)
        else:
            store.set(f"read/{rank}", "1")
    except RuntimeError:   # a peer gone, or rank 0 gone already: the message is what matters
        pass
    raise RuntimeError(message)


def _create(dist_opts, pg_options):
    cfg = pg_options if isinstance(pg_options, LowBitConfig) else registered_config()
    if cfg is None:
        raise RuntimeError("the 'lowbit' backend was used before bitscom.register_lowbit_backend()")
    return LowBitProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                              dist_opts.timeout, cfg)


_SLOT_BITS, _GEN_BITS = 16, 32
_LABEL = "bitscom lowbit backend"


class StateSlots:
    """At most ``capacity`` states, in slots every rank assigns alike: addresses differ per rank,
    so the slot this rank found travels in the header and is used only if every rank found it."""

    def __init__(self, capacity: int = MAX_STATES, warn: bool = False):
        self.capacity = number("capacity", capacity, minimum=1, maximum=(1 << _SLOT_BITS) - 1, integer=True)
        self.evicted = 0
        self._warn = warn
        self._lru: "OrderedDict[int, list]" = OrderedDict()   # slot -> states, least recent first
        self._gen = [0] * capacity
        self._where: dict = {}      # this rank's key -> slot
        self._owner: dict = {}      # slot -> this rank's key
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def code(self, key) -> int:
        """This rank's slot for ``key`` and the slot's generation, packed (0: none)."""
        with self._lock:
            slot = self._where.get(key)
            return 0 if slot is None else (slot + 1) | self._gen[slot] << _SLOT_BITS

    def resolve(self, key, codes, count: int) -> list:
        """The ``count`` states of ``key``: the agreed slot's, or fresh ones in a new slot."""
        with self._lock:
            code = codes[0]
            slot = (code & ((1 << _SLOT_BITS) - 1)) - 1
            if code and all(c == code for c in codes) and code >> _SLOT_BITS == self._gen[slot]:
                self._lru.move_to_end(slot)
                return self._lru[slot]
            return self._fresh(key, count)

    def _fresh(self, key, count: int) -> list:
        if len(self._lru) < self.capacity:
            slot = len(self._lru)
        else:
            slot, _ = self._lru.popitem(last=False)
            self._gen[slot] = (self._gen[slot] + 1) % (1 << _GEN_BITS)
            self.evicted += 1
            if self._warn and self.evicted == 1:
                warnings.warn(f"bitscom lowbit backend: more than {self.capacity} distinct buffers carried "
                              "error-feedback state; the least recently used one's residual was dropped. "
                              "Reuse buffers (DDP does) or use fewer, larger ones", RuntimeWarning)
        old = self._owner.pop(slot, None)
        if old is not None:
            self._where.pop(old, None)
        prev = self._where.pop(key, None)
        if prev is not None:
            self._owner.pop(prev, None)
        self._where[key], self._owner[slot] = slot, key
        self._lru[slot] = [LowBitState() for _ in range(count)]
        return self._lru[slot]


class InnerTransport:
    """Issues collectives straight on inner torch backends (the "groups" a Comm passes)."""

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


def _delegated(name: str, arity: int, options: Optional[Callable[[], Any]] = None, which: int = 0):
    """A method handing ``name`` to the inner backend of argument ``which``; ``opts`` defaulted."""
    def method(self, *args):
        args = list(args) + [None] * (arity - len(args))
        if options is not None and args[-1] is None:
            args[-1] = options()
        return getattr(self._for(args[which]), name)(*args)

    method.__name__ = method.__qualname__ = name
    return method


class FutureWork(dist.Work):
    """The work of a compressed collective; ``wait()`` raises its error (torch's would drop it)."""

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


class LowBitProcessGroup(dist.ProcessGroup):
    """A process group whose float SUM/AVG collectives are low-bit (torch creates it). Example::

        pg = dist.new_group(backend="lowbit", pg_options=bitscom.collectives.LowBitConfig(bitwidth=8))
        dist.all_reduce(t, group=pg)
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta, config: LowBitConfig):
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's stub omits the (rank, size) overload
        _check_flat(config)
        self.config = config
        self._bytes = ByteLedger()                  # a step: one compressed call
        self._rank, self._size = rank, size
        _check_same_config(dist.PrefixStore("lowbit-config/", store), rank, size, config)
        # Two inner backends per device: first rounds from the caller, later ones from the driver.
        self._inner: dict[str, C10dBackend] = {}
        self._later: dict[str, C10dBackend] = {}
        for name, table in (("gloo/", self._inner), ("gloo-later/", self._later)):
            table["cpu"] = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timeout=timeout)
        if torch.cuda.is_available() and dist.is_nccl_available():
            for name, table in (("nccl/", self._inner), ("nccl-later/", self._later)):
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                table["cuda"] = dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, size, opts)
        self._slots = StateSlots(MAX_STATES, warn=config.error_feedback or config.stage2_error_feedback)
        self._channels: dict[str, Channel] = {}     # per device kind, made on first use
        self._lock = threading.Lock()
        self._registered = False                    # seen among torch's live groups

    def _check_live(self) -> None:
        """A clear error once torch dropped this group: the inner connections would go on working."""
        if group_alive(self):
            self._registered = True
        elif self._registered or not dist.is_initialized():
            raise RuntimeError("this lowbit process group belongs to a world that has since been shut down "
                               "(bitscom.shutdown() or dist.destroy_process_group()); make a new group "
                               "after bitscom.init()")

    def comm_stats(self) -> dict:
        """This rank's bytes of compressed collectives (headers included), as every face reports. Example::

            dist.all_reduce(t, group=pg); pg.comm_stats()["compression_ratio"]
        """
        return self._bytes.report()

    bytes_sent = property(lambda self: self._bytes.total_sent, doc="This rank's compressed bytes so far.")
    inner_groups = property(lambda self: dict(self._inner), doc="The wrapped backends by device type.")
    num_states = property(lambda self: len(self._slots), doc="States kept (the same on every rank).")
    max_states = property(lambda self: self._slots.capacity, doc="The most states kept (MAX_STATES).")

    def getBackendName(self) -> str:
        return BACKEND_NAME

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
        self._check_live()
        return self._inner[self._kind(*tensors)]

    def _channel(self, kind: str) -> Channel:
        with self._lock:
            if kind not in self._channels:
                self._channels[kind] = Channel(self._inner[kind], self._later[kind], transport=_INNER,
                                               rank=self._rank, size=self._size, driver=True)
            return self._channels[kind]

    def _rounds(self, comm: Comm, call: Call, key, body, device) -> Generator[Any, None, None]:
        """The header, then ``body(comm, states)``: ``states`` are ``key``'s (None: stateless)."""
        codes = yield from agree_rounds(comm, call, 0 if key is None else self._slots.code(key), device, _LABEL)
        states = None if key is None else self._slots.resolve(key, codes, len(key) - 1)
        yield from body(comm, states)

    def _launch(self, call: Call, tensors: list, key, body, result, counted: bool):
        """Issue the header now; the driver runs ``body`` after it and completes the returned Work."""
        self._check_live()
        kind = self._kind(tensors)
        channel = self._channel(kind)
        numel = sum(t.numel() for t in tensors)
        comm = channel.comm()
        device = tensors[0].device
        future: torch.futures.Future = torch.futures.Future()

        def finished(rounds: Rounds) -> None:
            if counted:
                self._bytes.add(rounds.bytes_sent, dense_bytes(numel))
                self._bytes.end_step()
            if rounds.error is not None:
                future.set_exception(rounds.error)
            else:
                future.set_result(result)

        stream = torch.cuda.current_stream(device) if kind == "cuda" else None
        channel.submit(Rounds(self._rounds(comm, call, key, body, device), [comm], keep_going=True),
                       finished, stream)
        return FutureWork(future)

    def _exact(self, call: Call, tensors: list, issue, result):
        """An op low bit cannot compute: after the header, ``issue(comm)`` runs it exactly."""
        def body(comm, _states):
            yield issue(comm)

        return self._launch(call, tensors, None, body, result, counted=False)

    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts or dist.AllreduceOptions()
        if "all_reduce" not in self.config.backend_ops or not tensors:
            return self._for(tensors).allreduce(tensors, opts)
        op = opts.reduceOp
        call = Call.of("all_reduce", op, tensors[0].dtype, sum(t.numel() for t in tensors))
        if not (is_sum_or_avg(op) and all(t.is_floating_point() for t in tensors)):
            return self._exact(call, tensors, lambda comm: self._exact_all_reduce(comm, tensors, op), list(tensors))
        average = op == dist.ReduceOp.AVG

        def body(comm, states):
            for t, st in zip(tensors, states):
                flat = t if t.is_contiguous() else t.contiguous()
                yield from all_reduce_rounds(flat, comm, self.config, st, average=average, key=t.numel())
                if flat is not t:
                    t.copy_(flat)

        key = ("all_reduce",) + tuple(_storage(t) for t in tensors)
        return self._launch(call, tensors, key, body, list(tensors), counted=True)

    @staticmethod
    def _exact_all_reduce(comm, tensors, op):
        t0 = tensors[0]
        if op == dist.ReduceOp.AVG and not t0.is_floating_point() and t0.device.type != "cuda":
            raise RuntimeError(f"bitscom lowbit backend: all_reduce with op=AVG of {t0.dtype} tensors: the "
                               "inner gloo backend cannot average integers (it divides in floating point "
                               "and cannot store the result). Use op=SUM and divide, e.g. "
                               "t.div_(world_size, rounding_mode='floor'), or pass a floating tensor")
        return [comm.all_reduce(t, op) for t in tensors]

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        if "reduce_scatter" not in self.config.backend_ops:
            return self._for(output)._reduce_scatter_base(output, input, opts)
        op = opts.reduceOp
        call = Call.of("reduce_scatter", op, input.dtype, output.numel())
        if not (output.is_floating_point() and input.is_floating_point() and is_sum_or_avg(op)):
            return self._exact(call, [output], lambda comm: comm.reduce_scatter(output, input, op), output)
        average = op == dist.ReduceOp.AVG

        def body(comm, states):
            yield from reduce_scatter_rounds(output, input, comm, self.config, states[0], average=average,
                                             key=output.numel())

        return self._launch(call, [output], ("reduce_scatter", _storage(input)), body, output, counted=True)

    reduce_scatter_single = _reduce_scatter_base       # torch >= 2.13's name

    def _allgather_base(self, output, input, opts=None):
        if "all_gather" not in self.config.backend_ops:
            return self._for(input)._allgather_base(output, input, opts or AllgatherOptions())
        call = Call.of("all_gather", dist.ReduceOp.SUM, input.dtype, input.numel())
        if not (output.is_floating_point() and input.is_floating_point()):
            return self._exact(call, [input], lambda comm: comm.all_gather(output, input), output)

        def body(comm, states):
            yield from all_gather_rounds(output, input, comm, self.config, states[0], key=input.numel())

        return self._launch(call, [input], ("all_gather", _storage(input)), body, output, counted=True)

    all_gather_single = _allgather_base       # torch >= 2.13's name

    # exact delegation to the inner backend (torch >= 2.13's names are aliases)
    allreduce_coalesced = _delegated("allreduce_coalesced", 2, dist.AllreduceCoalescedOptions)
    broadcast = _delegated("broadcast", 2, dist.BroadcastOptions)
    allgather = _delegated("allgather", 3, AllgatherOptions, which=1)
    allgather_coalesced = _delegated("allgather_coalesced", 3, AllgatherOptions, which=1)
    allgather_into_tensor_coalesced = _delegated("allgather_into_tensor_coalesced", 3, AllgatherOptions, which=1)
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    gather = _delegated("gather", 3, dist.GatherOptions, which=1)
    scatter = _delegated("scatter", 3, dist.ScatterOptions)
    reduce = _delegated("reduce", 2, dist.ReduceOptions)
    reduce_scatter = _delegated("reduce_scatter", 3, dist.ReduceScatterOptions)
    reduce_scatter_tensor_coalesced = _delegated("reduce_scatter_tensor_coalesced", 3, dist.ReduceScatterOptions)
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    alltoall_base = _delegated("alltoall_base", 5, dist.AllToAllOptions, which=1)
    all_to_all_single = alltoall_base
    alltoall = _delegated("alltoall", 3, dist.AllToAllOptions, which=1)
    send = _delegated("send", 3)
    recv = _delegated("recv", 3)
    recv_anysource = _delegated("recv_anysource", 2)

    def barrier(self, opts=None):
        self._check_live()
        return self._inner["cpu"].barrier(opts or dist.BarrierOptions())

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        self._check_live()
        return self._inner["cpu"].monitored_barrier(timeout, wait_all_ranks)


def _storage(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.numel(), t.dtype)
