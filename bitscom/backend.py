"""The ``lowbit`` torch.distributed backend: plain ``dist.all_reduce`` (and DDP) in low bit.

``register_lowbit_backend(...)`` registers a Python :class:`torch.distributed.ProcessGroup`
subclass under the name ``"lowbit"``. Each group it creates wraps an inner ProcessGroupGloo
(CPU tensors) and, where CUDA exists, a ProcessGroupNCCL (CUDA tensors) built on the same
store. Float SUM/AVG all-reduces run :func:`bitscom.collectives.all_reduce_rounds` on the
inner group; every other operation (integer or MAX all-reduce, broadcast, all-gather,
all-to-all, barrier, point-to-point, ...) is handed to the inner group unchanged.

Why synchronous: a Python process group cannot learn when its caller waits, so the rounds
of a compressed all-reduce are driven inside ``allreduce()`` and a completed work is
returned (DDP still works; its bucket overlap is lost for compressed buckets). For
overlap, use :class:`bitscom.LowBitGroup` (``async_op=True``) or the optimizer.

Error-feedback state is keyed by the tensor's storage (address, numel, dtype): DDP's bucket
buffers are persistent, so every bucket keeps its own residual across steps.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, _create_work_from_future

from .collectives import LowBitConfig, LowBitState, all_reduce_rounds
from .compressors.base import Comm, drive

__all__ = ["register_lowbit_backend", "LowBitProcessGroup", "registered_config"]

BACKEND_NAME = "lowbit"
_registered: dict = {}  # torch's backend registry is process-global; so is what we told it


def registered_config() -> Optional[LowBitConfig]:
    """The settings the ``lowbit`` backend was registered with (None before registration)."""
    return _registered.get(BACKEND_NAME)


def register_lowbit_backend(bitwidth: int = 4, error_feedback: str = "none", block_size: int = 128,
                            stage2_error_feedback: bool = False, stage2_bits: Optional[int] = None,
                            stochastic_rounding: bool = False, hadamard: bool = False,
                            chunk_size: Optional[int] = None, seed: int = 0) -> LowBitConfig:
    """Register the ``lowbit`` backend with these settings (see :class:`LowBitConfig`).

    Registering again with the same settings is a no-op; with different settings it raises,
    because groups created earlier would silently keep the old ones. A group may override the
    registered settings with ``pg_options=LowBitConfig(...)`` in ``new_group``.

    Example::

        bitscom.register_lowbit_backend(bitwidth=4, error_feedback="ef")
        dist.init_process_group("lowbit")          # or bitscom.init(bitwidth=4, error_feedback="ef")
        dist.all_reduce(grad)                       # two-stage 4-bit all-reduce
    """
    cfg = LowBitConfig(bits=bitwidth, error_feedback=error_feedback, block_size=block_size,
                       stage2_error_feedback=stage2_error_feedback, stage2_bits=stage2_bits,
                       stochastic_rounding=stochastic_rounding, hadamard=hadamard,
                       chunk_size=chunk_size, seed=seed)
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


class _InnerComm(Comm):
    """A :class:`Comm` that issues straight on an inner backend (not a registered group)."""

    def __init__(self, inner, rank: int, size: int):
        self.inner, self.rank, self.size = inner, rank, size
        self.group = self.later_group = None
        self.bytes_sent = 0
        self._yielded = False

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM):
        self._count(tensor)
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.inner.allreduce([tensor], opts)

    def all_gather(self, output, input):
        self._count(input)
        return self.inner._allgather_base(output, input, AllgatherOptions())

    def all_to_all(self, output, input):
        self._count(input)
        return self.inner.alltoall_base(output, input, [], [], dist.AllToAllOptions())

    def reduce_scatter(self, output, input, op=dist.ReduceOp.SUM):
        self._count(input)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = op
        return self.inner._reduce_scatter_base(output, input, opts)

    def broadcast(self, tensor, group_src: int = 0):
        if self.rank == group_src:
            self._count(tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = group_src
        return self.inner.broadcast([tensor], opts)


def _done_work(result):
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class LowBitProcessGroup(dist.ProcessGroup):
    """A process group whose float SUM/AVG all-reduce is low-bit; everything else is exact.

    Created by torch through the registered backend (``init_process_group("lowbit")``,
    ``new_group(backend="lowbit")``), not by users. ``bytes_sent`` counts the payload of
    compressed all-reduces.

    Example::

        pg = dist.new_group(backend="lowbit", pg_options=bitscom.collectives.LowBitConfig(bits=8))
        dist.all_reduce(t, group=pg)
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta, config: LowBitConfig):
        super().__init__(rank, size)
        if config.hierarchy != "none":
            raise ValueError("the lowbit backend runs the flat scheme; hierarchy="
                             f"{config.hierarchy!r} is available through LowBitGroup and LowBit")
        self.config = config
        self.bytes_sent = 0
        self._rank, self._size = rank, size
        _check_same_config(dist.PrefixStore("lowbit-config/", store), rank, size, config)
        self._inner = {"cpu": dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size,
                                                    timeout=timeout)}
        if torch.cuda.is_available() and dist.is_nccl_available():
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._inner["cuda"] = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank,
                                                        size, opts)
        self._states = {}

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def inner_groups(self) -> dict:
        """The wrapped backends by device type ("cpu": gloo, "cuda": nccl)."""
        return dict(self._inner)

    def _for(self, *tensors):
        for t in tensors:
            if isinstance(t, (list, tuple)):
                if t:
                    return self._for(*t)
                continue
            if isinstance(t, torch.Tensor):
                kind = t.device.type
                if kind not in self._inner:
                    raise RuntimeError(f"the lowbit backend has no inner group for {kind} tensors")
                return self._inner[kind]
        return self._inner["cuda" if "cuda" in self._inner else "cpu"]

    def _state(self, t: torch.Tensor) -> LowBitState:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in self._states:
            self._states[key] = LowBitState()
        return self._states[key]

    # -- the compressed op ---------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None:
            opts = dist.AllreduceOptions()
        op = opts.reduceOp
        compress = (op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG) and \
            all(t.is_floating_point() for t in tensors)
        if not compress:
            return self._for(tensors).allreduce(tensors, opts)
        inner = self._for(tensors)
        for t in tensors:
            comm = _InnerComm(inner, self._rank, self._size)
            flat = t if t.is_contiguous() else t.contiguous()
            drive(all_reduce_rounds(flat, comm, self.config, self._state(t),
                                    average=(op == dist.ReduceOp.AVG), key=t.numel()), comm)
            if flat is not t:
                t.copy_(flat)
            self.bytes_sent += comm.bytes_sent
        return _done_work(list(tensors))

    # -- exact delegation ----------------------------------------------------------------------
    def allreduce_coalesced(self, tensors, opts=None):
        return self._for(tensors).allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions())

    def broadcast(self, tensors, opts=None):
        return self._for(tensors).broadcast(tensors, opts or dist.BroadcastOptions())

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._for(input_tensors).allgather(output_tensors, input_tensors,
                                                  opts or AllgatherOptions())

    def _allgather_base(self, output, input, opts=None):
        return self._for(input)._allgather_base(output, input, opts or AllgatherOptions())

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._for(input_list).allgather_coalesced(output_lists, input_list,
                                                         opts or AllgatherOptions())

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._for(inputs).allgather_into_tensor_coalesced(outputs, inputs,
                                                                 opts or AllgatherOptions())

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

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._for(output)._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._for(outputs).reduce_scatter_tensor_coalesced(outputs, inputs,
                                                                  opts or dist.ReduceScatterOptions())

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._for(input).alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                              opts or dist.AllToAllOptions())

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
