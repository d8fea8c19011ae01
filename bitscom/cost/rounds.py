"""The rounds (collectives) one bucket costs with each compressor: kind, bytes, level.

Bytes are what :class:`bitscom.comm.Comm` counts (each collective's input buffer on this
rank), written as formulas from each compressor's own wire format, so the model and
``comm_stats()`` can be checked against each other (tests/test_cost_model.py does, for every
compressor on 2 and 4 gloo ranks, flat and hierarchical). What the wire carries is
:func:`bitscom.cost.formulas.wire_bytes` of these counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..compressors.acpsgd import ACPSGD
from ..compressors.base import BucketLayout, Compressor, TensorSlot
from ..compressors.casting import NoneCompressor, _CastCompressor
from ..compressors.lowbit import LowBit
from ..compressors.lowrank import LowRankCompressor
from ..compressors.momentum import MomentumCorrection
from ..compressors.powersgd import PowerSGD
from ..compressors.registry import resolve
from ..compressors.signsgd import SignSGD
from ..compressors.topk import TopK
from ..lowbit.rounds import chunk_bounds

__all__ = ["Round", "KINDS", "LEVELS", "rounds_for", "layout_of"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
LEVELS = ("flat", "intra", "inter")


@dataclass(frozen=True)
class Round:
    """One collective: ``kind``, the ``nbytes`` this rank hands to it (Comm's count) and the
    ``level`` it runs at (``flat`` over the world, ``intra``-node, ``inter``-node).

    Example::

        Round("all_reduce", 4000, "flat")
    """

    kind: str
    nbytes: int
    level: str = "flat"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Round kind must be one of {KINDS}, got {self.kind!r}")
        if self.level not in LEVELS:
            raise ValueError(f"Round level must be one of {LEVELS}, got {self.level!r}")
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"Round nbytes must be an int >= 0, got {self.nbytes!r}")


def _square(numel: int) -> tuple:
    d = max(1, math.isqrt(numel))
    while numel % d:
        d -= 1
    return (d, numel // d)


def layout_of(numel: int, dtype=torch.float32, shapes: Optional[Sequence[tuple]] = None,
              square: bool = False) -> BucketLayout:
    """A bucket layout of ``shapes`` (or one tensor of ``numel`` elements: 1-D, or the most
    nearly square matrix with ``square=True``), for the formulas that depend on shapes.

    Example::

        layout_of(1024, shapes=[(16, 32), (512,)])
    """
    if shapes is None:
        shapes = [_square(numel) if square else (numel,)]
    slots, off = [], 0
    for i, shape in enumerate(shapes):
        n = math.prod(shape)
        slots.append(TensorSlot(f"t{i}", off, n, tuple(shape)))
        off += n
    if off != numel:
        raise ValueError(f"shapes {list(shapes)} hold {off} elements, not numel={numel}")
    return BucketLayout(0, tuple(slots), dtype, torch.device("cpu"))


def _esize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dense(layout: BucketLayout) -> List[Round]:
    return [Round("all_reduce", layout.numel * _esize(layout.dtype), "flat")]


def _cast(comp: _CastCompressor, layout, world, local_size, step) -> List[Round]:
    return [Round("all_reduce", layout.numel * _esize(comp.wire_dtype), "flat")]


def _levels_rounds(N: int, sizes: Sequence[int], levels: Sequence[str], codecs, out_codec) -> List[Round]:
    """Reduce through the levels by all-to-all (outermost first), then all-gather back."""
    out, shard = [], N
    for p, level, codec in zip(sizes, levels, codecs):
        m = shard // p
        out.append(Round("all_to_all", p * codec.row_bytes(m), level))
        shard = m
    buf = out_codec.row_bytes(shard)
    for p, level in reversed(list(zip(sizes, levels))):
        out.append(Round("all_gather", buf, level))
        buf *= p
    return out


def _lowbit(comp: LowBit, layout, world, local_size, step) -> List[Round]:
    cfg = comp.config
    n = layout.numel
    if cfg.hierarchy == "none" or local_size == 1:
        sizes, levels, codecs = [world], ["flat"], [cfg.codec(cfg.bitwidth)]
    elif local_size == world:                       # one node: a full-precision all-reduce
        return [Round("all_reduce", n * _esize(layout.dtype), "intra")]
    elif cfg.hierarchy == "two_level":
        sizes, levels = [local_size, world // local_size], ["intra", "inter"]
        codecs = [cfg.codec(cfg.intra_bitwidth), cfg.codec(cfg.bitwidth)]
    else:
        raise ValueError(f"rounds_for does not model LowBit hierarchy={cfg.hierarchy!r} (its "
                         "bytes differ between node leaders and the other ranks); "
                         "use 'none' or 'two_level'")
    if n == 0 or world == 1:
        return []
    unit = math.prod(sizes) * cfg.block_size
    N = max(unit, -(-n // unit) * unit)
    out_codec = cfg.codec(cfg.resolved_stage2_bitwidth)
    rounds: List[Round] = []
    for s, t in chunk_bounds(N, unit, cfg.chunk_size):
        rounds += _levels_rounds(t - s, sizes, levels, codecs, out_codec)
    return rounds


def _powersgd(comp: PowerSGD, layout, world, local_size, step) -> List[Round]:
    plan = comp.plan(layout)
    return [Round("all_reduce", (plan.p_numel + plan.uncompressed_numel) * 4, "flat"),
            Round("all_reduce", plan.q_numel * 4, "flat")]


def _acpsgd(comp: ACPSGD, layout, world, local_size, step) -> List[Round]:
    plan = comp.plan(layout)
    p_bytes = (plan.p_numel + plan.uncompressed_numel) * 4
    q_bytes = (plan.q_numel + plan.uncompressed_numel) * 4
    if step is None:
        return [Round("all_reduce", (p_bytes + q_bytes) // 2, "flat")]
    even = (step - comp.start_iter) % 2 == 0
    return [Round("all_reduce", p_bytes if even else q_bytes, "flat")]


def _gather(comp: Compressor, layout, world, local_size, step) -> List[Round]:
    nbytes = comp.wire_bytes(layout, world)
    assert nbytes is not None, comp       # TopK and SignSGD always know theirs
    return [Round("all_gather", nbytes, "flat")]


_FORMULAS: Dict[type, Callable[..., List[Round]]] = {
    NoneCompressor: lambda comp, layout, *a: _dense(layout),
    _CastCompressor: _cast,
    LowBit: _lowbit,
    PowerSGD: _powersgd,
    ACPSGD: _acpsgd,
    TopK: _gather,
    SignSGD: _gather,
}


def _formula(comp: Compressor) -> Callable[..., List[Round]]:
    for cls in type(comp).__mro__:
        if cls in _FORMULAS:
            return _FORMULAS[cls]
    raise ValueError(f"rounds_for has no formula for {comp.fingerprint()}; modelled: "
                     f"{sorted(c.__name__ for c in _FORMULAS)} (and MomentumCorrection around them)")


def rounds_for(compressor, numel: int, world: int, *, local_size: int = 1, dtype=torch.float32,
               warm: bool = True, shapes: Optional[Sequence[tuple]] = None,
               step: Optional[int] = None) -> List[Round]:
    """The rounds one bucket of ``numel`` elements costs with ``compressor`` on ``world`` ranks.

    ``warm=True``: after the compressor's plain all-reduce warm-up (``start_iter``);
    ``warm=False``: a warm-up step. ``shapes`` (the bucket's tensor shapes) matter for the
    low-rank compressors; without them a bucket is one 1-D tensor, and for PowerSGD/ACP-SGD
    the most nearly square matrix of ``numel`` elements (their best case). ``step`` selects
    ACP-SGD's P (even) or Q (odd) step; ``None`` is their mean. ``local_size`` > 1 matters for
    hierarchical LowBit (``two_level``); every other compressor runs flat over the world.

    Example::

        rounds_for("lowbit", 1 << 20, 4)
        # [Round('all_to_all', 540672, 'flat'), Round('all_gather', 135168, 'flat')]
    """
    comp = resolve(compressor, "compressor")
    while isinstance(comp, MomentumCorrection):
        comp = comp._inner                 # inner, resolved to a compressor instance
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 \
            or world % local_size:
        raise ValueError(f"local_size must be an int >= 1 dividing world={world}, got {local_size!r}")
    formula = _formula(comp)
    layout = layout_of(numel, dtype, shapes, square=isinstance(comp, LowRankCompressor))
    if world == 1 or numel == 0:
        return []
    if not warm and getattr(comp, "start_iter", 0) > 0:
        return _dense(layout)
    if isinstance(comp, LowRankCompressor) and step is not None and step < comp.start_iter:
        return _dense(layout)
    return formula(comp, layout, world, local_size, step)
