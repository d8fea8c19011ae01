"""The compressor protocol: how a lossy (or lossless) reduction of one bucket is written.

A compressor turns "this rank's flat gradient" into "the average over ranks". Compress /
decompress alone cannot express PowerSGD (two dependent all-reduces), ACP-SGD (alternating
factors) or two-stage low-bit all-reduce (all-to-all, then all-gather), so a compressor is
written as a *generator of rounds*: it launches one or more asynchronous collectives through
the :class:`Comm` it is handed, yields their work handle, and continues when the engine
resumes it after that work completed. The engine can therefore start round one from a
backward hook and chain later rounds without blocking backward.

Three kinds of object take part, each with one job:

* the compressor: frozen settings (a frozen dataclass), no mutable fields;
* a :class:`State` per bucket (error residuals, P/Q memory, step counters, RNG seeds):
  explicit, created by :meth:`Compressor.init_state`, checkpointable;
* :class:`Comm`: the process group plus byte accounting, the only way a compressor talks
  to other ranks.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names
# warn on every call); 2.11 and 2.12 only have the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["TensorSlot", "BucketLayout", "Comm", "State", "Compressor", "drive"]


@dataclass(frozen=True)
class TensorSlot:
    """Where one parameter's gradient lives inside its bucket's flat buffer.

    Example::

        for slot in layout.slots:
            grad = flat[slot.offset:slot.end].view(slot.shape)
    """

    name: str
    offset: int
    numel: int
    shape: tuple

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketLayout:
    """The identity and shape of one bucket: what per-bucket compressor state is built from.

    ``index`` is the bucket's position in the plan and keys every per-bucket state.

    Example::

        layout = BucketLayout.for_tensor(torch.zeros(1000))   # one slot, index 0
        state = compressor.init_state(layout)
    """

    index: int
    slots: tuple
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        return self.slots[-1].end if self.slots else 0

    def describe(self) -> str:
        """A deterministic text used by the cross-rank agreement check."""
        parts = ",".join(f"{s.name}:{tuple(s.shape)}@{s.offset}" for s in self.slots)
        return f"bucket{self.index}[{self.dtype}|{self.device.type}]({parts})"

    @staticmethod
    def for_tensor(tensor: torch.Tensor, index: int = 0, name: str = "tensor") -> "BucketLayout":
        """A one-slot layout for a flat tensor (used by the collective API and the DDP hook)."""
        return BucketLayout(index, (TensorSlot(name, 0, tensor.numel(), tuple(tensor.shape)),),
                            tensor.dtype, tensor.device)


class Comm:
    """Asynchronous collectives on behalf of one reduction, with byte accounting.

    ``bytes_sent`` counts the payload this rank hands to the network: the size of the input
    buffer of every collective (for all-reduce the whole buffer, for all-gather this rank's
    contribution, for all-to-all this rank's whole send buffer). It is the number a user
    compares against the fp32 cost of the same gradient, and it is what a ring algorithm's
    traffic scales with.

    Collectives issued before the compressor first yields go to ``group``; later ones go to
    ``later_group`` (when given). The engine uses that split to keep the order of collectives
    identical on every rank while later rounds of one bucket overlap first rounds of the next.

    Example::

        comm = Comm(group)
        work = comm.all_reduce(buf)     # asynchronous; counted in comm.bytes_sent
        work.wait()
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None,
                 later_group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self.later_group = later_group
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.bytes_sent = 0
        self._yielded = False

    def _pg(self):
        if self._yielded and self.later_group is not None:
            return self.later_group
        return self.group

    def _count(self, tensor: torch.Tensor) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()

    @property
    def _local(self) -> bool:
        """No process group at all: a single process, where every collective is an identity."""
        return self.group is None and not dist.is_initialized()

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM):
        """Sum (or ``op``) ``tensor`` in place over the group; returns the async work."""
        if self._local:
            return None
        self._count(tensor)
        return dist.all_reduce(tensor, op=op, group=self._pg(), async_op=True)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor):
        """``output`` (size × input.numel()) receives every rank's ``input``, in rank order."""
        if self._local:
            output.view(-1).copy_(input.view(-1))
            return None
        self._count(input)
        return _all_gather_flat(output, input, group=self._pg(), async_op=True)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor):
        """Equal splits: chunk j of ``input`` goes to rank j; chunk j of ``output`` comes from j."""
        if self._local:
            output.copy_(input)
            return None
        self._count(input)
        return dist.all_to_all_single(output, input, group=self._pg(), async_op=True)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM):
        if self._local:
            output.view(-1).copy_(input.view(-1))
            return None
        self._count(input)
        return _reduce_scatter_flat(output, input, op=op, group=self._pg(), async_op=True)

    def broadcast(self, tensor: torch.Tensor, group_src: int = 0):
        """Broadcast from the rank with *group* rank ``group_src``."""
        if self._local:
            return None
        if self.rank == group_src:
            self._count(tensor)
        src = dist.get_global_rank(self._pg(), group_src) if self._pg() is not None else group_src
        return dist.broadcast(tensor, src=src, group=self._pg(), async_op=True)

    def mark_yield(self) -> None:
        """Called by the driver each time the compressor yields."""
        self._yielded = True


class State:
    """Mutable per-bucket compressor state.

    The default ``state_dict`` copies every public attribute (tensors cloned, a
    ``torch.Generator`` saved as its state, a nested :class:`State` as its own state dict)
    so subclasses that only hold tensors, numbers, generators and states need no code of
    their own. Loading copies *into* the existing tensors, so views into them stay valid;
    a saved tensor of another shape is an error, not a silent replacement.

    Example::

        class MyState(State):
            def __init__(self, numel):
                self.step = 0
                self.residual = torch.zeros(numel)   # saved and restored automatically
    """

    def state_dict(self) -> dict:
        out = {}
        for key, value in vars(self).items():
            if key.startswith("_"):
                continue
            if isinstance(value, torch.Tensor):
                value = value.detach().clone()
            elif isinstance(value, torch.Generator):
                value = {"__generator_state__": value.get_state()}
            elif isinstance(value, State):
                value = {"__state__": value.state_dict()}
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                value = [v.detach().clone() for v in value]
            out[key] = value
        return out

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            current = getattr(self, key, None)
            if isinstance(value, dict) and "__generator_state__" in value:
                current.set_state(value["__generator_state__"])
            elif isinstance(value, dict) and "__state__" in value:
                current.load_state_dict(value["__state__"])
            elif isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                _copy_checked(key, current, value)
            elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor) \
                    and isinstance(current, list):
                if len(current) != len(value):
                    raise ValueError(f"state {key!r}: checkpoint has {len(value)} tensors, "
                                     f"this bucket has {len(current)}")
                for i, (c, v) in enumerate(zip(current, value)):
                    _copy_checked(f"{key}[{i}]", c, v)
            else:
                setattr(self, key, value)


def _copy_checked(key: str, current: torch.Tensor, value: torch.Tensor) -> None:
    if current.shape != value.shape:
        raise ValueError(f"state {key!r}: checkpoint tensor has shape {tuple(value.shape)}, this "
                         f"bucket's has {tuple(current.shape)}; was the model or plan changed?")
    current.copy_(value)


class Compressor(abc.ABC):
    """Base class of every compressor: frozen settings + a round generator.

    Subclasses are frozen dataclasses holding only hyper-parameters. Per-bucket mutable
    data lives in the object :meth:`init_state` returns.

    Contract of :meth:`reduce`: on entry ``flat`` holds this rank's gradient (any float
    dtype); on normal exit it holds the *average* over the ranks of ``comm``, bitwise
    identical on every rank. Each ``yield`` hands back the work of collectives just issued
    through ``comm``; the generator is resumed only after that work completed.

    Example::

        @dataclass(frozen=True)
        class Plain(Compressor):
            name = "plain"
            def reduce(self, flat, layout, state, comm):
                yield comm.all_reduce(flat)
                flat.div_(comm.size)
    """

    name = "base"

    def init_state(self, layout: BucketLayout) -> State:
        """Per-bucket state. The default is stateless."""
        return State()

    @abc.abstractmethod
    def reduce(self, flat: torch.Tensor, layout: BucketLayout, state: State,
               comm: Comm) -> Iterator[Any]:
        """Replace ``flat`` by the average over ranks; yield work handles between rounds."""

    def fingerprint(self) -> str:
        """Settings every rank must agree on (checked before the first reduction)."""
        if dataclasses.is_dataclass(self):
            fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
            return f"{type(self).__name__}({fields})"
        return repr(self)

    def wire_bytes(self, layout: BucketLayout, world_size: int, step: Optional[int] = None) -> Optional[int]:
        """Analytic bytes one reduction of ``layout`` sends from one rank, if known.

        ``step`` matters for compressors whose traffic changes over time (warm-up steps,
        ACP-SGD's alternating factors); ``None`` asks for the steady-state average."""
        return None


def drive(rounds: Iterator[Any], comm: Optional[Comm] = None) -> None:
    """Run a compressor's rounds to completion, waiting on each yielded work in turn.

    The synchronous driver: used by the collective API, tests and the engine's blocking
    paths. Example::

        comm = Comm(group)
        drive(compressor.reduce(flat, layout, state, comm), comm)
    """
    for work in rounds:
        if comm is not None:
            comm.mark_yield()
        if work is not None:
            _wait(work)


def _wait(work) -> None:
    if isinstance(work, (list, tuple)):
        for w in work:
            _wait(w)
    else:
        work.wait()


def is_completed(work) -> bool:
    """True when every handle in ``work`` finished (a list/tuple of handles is allowed)."""
    if work is None:
        return True
    if isinstance(work, (list, tuple)):
        return all(is_completed(w) for w in work)
    if isinstance(work, torch.futures.Future):
        return work.done()
    return work.is_completed()


def wait(work) -> None:
    """Block until every handle in ``work`` finished, raising its error if any."""
    if work is not None:
        _wait(work)
