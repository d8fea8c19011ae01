"""The compressor protocol: how a lossy (or lossless) reduction of one bucket is written.

Compress/decompress cannot express PowerSGD's two dependent all-reduces or two-stage low-bit
all-reduce, so a compressor is a *generator of rounds*: it launches asynchronous collectives
through its :class:`Comm`, yields their work, and is resumed after that work completed (so
round one can start from a backward hook). Mutable per-bucket data lives in a :class:`State`.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, Generic, Iterator, TypeVar, cast

import torch

from ..comm import Comm, Rounds, drive, is_completed, wait

__all__ = ["TensorSlot", "BucketLayout", "Comm", "State", "Compressor", "Wrapper", "drive", "Rounds",
           "is_completed", "wait"]


def plain_average(flat: torch.Tensor, comm) -> Iterator[Any]:
    """Round generator: ``flat`` ← the average over ``comm``'s ranks by one plain all-reduce
    in its own dtype (a warm-up step, ``NoneCompressor``)."""
    yield comm.all_reduce(flat)
    flat.div_(comm.size)


@dataclass(frozen=True)
class TensorSlot:
    """Where one parameter's gradient lives inside its bucket's flat buffer (``flat[offset:end]``)."""

    name: str
    offset: int
    numel: int
    shape: tuple

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketLayout:
    """The identity and shape of one bucket (``index``: its position in the plan, which keys every per-bucket state)."""

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


class State:
    """Mutable per-bucket compressor state.

    ``state_dict`` saves every public attribute (tensors cloned, generators and nested states
    as their states), so subclasses need no code of their own. Loading copies *into* the
    existing tensors, so views into them stay valid; another shape is an error.

    Example::

        class MyState(State):
            def __init__(self, numel):
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
            elif isinstance(value, State) or _is_stateful(value):
                value = {"__state__": value.state_dict()}
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                value = [v.detach().clone() for v in value]
            out[key] = value
        return out

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            current = getattr(self, key, None)
            if isinstance(value, dict) and "__generator_state__" in value:
                _existing(key, current, "a generator state").set_state(value["__generator_state__"])
            elif isinstance(value, dict) and "__state__" in value:
                _existing(key, current, "a nested state").load_state_dict(value["__state__"])
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


def _existing(key: str, current: Any, what: str) -> Any:
    """``current`` (attribute ``key``) to load the checkpoint's ``what`` into; ValueError if None."""
    if current is None:
        raise ValueError(f"state {key!r}: the checkpoint holds {what}, this bucket's state has none")
    return current


def _is_stateful(value) -> bool:
    """A nested state object that saves itself (e.g. :class:`~bitscom.error_feedback.ErrorFeedback`)."""
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict") \
        and not isinstance(value, (torch.Tensor, torch.Generator))


def _copy_checked(key: str, current: torch.Tensor, value: torch.Tensor) -> None:
    if current.shape != value.shape:
        raise ValueError(f"state {key!r}: checkpoint tensor has shape {tuple(value.shape)}, this "
                         f"bucket's has {tuple(current.shape)}; was the model or plan changed?")
    current.copy_(value)


class Wrapper:
    """Mixin (listed before :class:`Compressor`) of a compressor around an ``inner`` one:
    ``_inner`` as ``__post_init__`` resolved it, and its need for names."""

    inner: Any

    @property
    def _inner(self) -> "Compressor":
        assert isinstance(self.inner, Compressor), "__post_init__ resolves inner to a compressor"
        return self.inner

    @property
    def uses_names(self) -> bool:       # Exclude inside needs parameter names too
        return self._inner.uses_names


StateT = TypeVar("StateT")     # a compressor's per-bucket state type


class Compressor(abc.ABC, Generic[StateT]):
    """Base class of every compressor: frozen settings + a round generator.

    Per-bucket state is what :meth:`init_state` returns (its type is the class parameter:
    ``Compressor[SteppedErrorFeedback]``). Contract of :meth:`reduce`: on entry ``flat`` holds
    this rank's gradient (any float dtype); on normal exit the *average* over ``comm``'s ranks,
    bitwise identical on every rank. Each ``yield`` hands back the work of collectives just
    issued through ``comm``; the generator is resumed only after that work completed.

    Example::

        @dataclass(frozen=True)
        class Plain(Compressor):
            name = "plain"
            def reduce(self, flat, layout, state, comm):
                yield comm.all_reduce(flat)
                flat.div_(comm.size)
    """

    name = "base"
    #: True for :class:`MomentumCorrection`: only :class:`bitscom.DistributedOptimizer` runs it.
    applies_momentum = False
    #: Whether the cost model may run large buckets on ``meta`` tensors (shapes only): cheaper where
    #: the local run grows with ranks × bucket, slower for many small operations (LowBit).
    models_on_meta = True

    @property
    def uses_names(self) -> bool:
        """True for compressors that act on parameter names (:class:`Exclude`): the faces refuse
        them where slots carry no names. A subclass may set a class attribute instead."""
        return False

    def init_state(self, layout: BucketLayout) -> StateT:
        """Per-bucket state. The default is stateless."""
        return cast(StateT, State())

    @abc.abstractmethod
    def reduce(self, flat: torch.Tensor, layout: BucketLayout, state: StateT,
               comm: Comm) -> Iterator[Any]:
        """Replace ``flat`` by the average over ranks; yield work handles between rounds."""

    def fingerprint(self) -> str:
        """Settings every rank must agree on (checked before the first reduction)."""
        if dataclasses.is_dataclass(self):
            fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
            return f"{type(self).__name__}({fields})"
        return repr(self)
