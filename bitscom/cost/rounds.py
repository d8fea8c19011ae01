"""The rounds (collectives) one bucket costs with a compressor: kind, bytes, level. Learned, not written down: the
compressor's own ``reduce`` runs on a :class:`~bitscom.cost.local.LocalTransport` recording what
:class:`bitscom.comm.Comm` counts, so the model and ``comm_stats()`` agree by construction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from ..compressors.base import BucketLayout, Compressor, TensorSlot
from ..compressors.registry import resolve
from ..validate import flag, instance, number, numbers
from .local import KINDS, LEVELS, Round, check_world, recorded_rounds

__all__ = ["Round", "KINDS", "LEVELS", "rounds_for", "rounds_of", "sent_bytes", "layout_of", "warm_up_steps"]


def _square(numel: int) -> tuple:
    d = max(1, math.isqrt(numel))
    while numel % d:
        d -= 1
    return (d, numel // d)


def layout_of(numel: int, dtype=torch.float32, shapes: Optional[Sequence[tuple]] = None,
              square: bool = False) -> BucketLayout:
    """A bucket layout of ``shapes`` (or one tensor of ``numel`` elements: 1-D, or the most
    nearly square matrix with ``square=True``).

    Example::

        layout_of(1024, shapes=[(16, 32), (512,)])
    """
    number("numel", numel, minimum=0, integer=True)
    if shapes is None:
        shapes = [_square(numel) if flag("square", square) else (numel,)]
    slots, off = [], 0
    for i, shape in enumerate(instance("shapes", shapes, (list, tuple), "a list of shapes (tuples of ints >= 0)")):
        shape = numbers(f"shapes[{i}]", shape, minimum=0, integer=True)
        n = math.prod(shape)
        slots.append(TensorSlot(f"t{i}", off, n, tuple(shape)))
        off += n
    if off != numel:
        raise ValueError(f"shapes {list(shapes)} hold {off} elements, not numel={numel}")
    return BucketLayout(0, tuple(slots), dtype, torch.device("cpu"))


def _chain(comp) -> Iterator[Compressor]:
    """``comp`` and the compressors it wraps (``inner``, as Exclude/MomentumCorrection/WarmUp hold it)."""
    while isinstance(comp, Compressor):
        yield comp
        comp = getattr(comp, "inner", None)


def warm_up_steps(compressor) -> int:
    """Plain all-reduce steps before ``compressor`` compresses: its and its inner ones' ``start_iter``."""
    return sum(int(getattr(c, "start_iter", 0) or 0) for c in _chain(compressor))


def _mean(first: List[Round], second: List[Round]) -> List[Round]:
    """Two consecutive steps as one: each round of the mean bytes (rounded down) where the steps
    differ in bytes only (ACP-SGD alternates P and Q)."""
    if [(r.kind, r.level) for r in first] != [(r.kind, r.level) for r in second]:
        return first
    return [Round(a.kind, (a.nbytes + b.nbytes) // 2, a.level) for a, b in zip(first, second)]


_CACHE: Dict[tuple, List[Round]] = {}


def rounds_of(compressor, layout: BucketLayout, world: int, *, local_size: int = 1,
              step: Optional[int] = None, warm: bool = True) -> List[Round]:
    """The rounds ``compressor`` issues for one step of ``layout`` on ``world`` ranks (``local_size`` per node), learned
    from a local run of its ``reduce``: step ``step`` (0-based, warm-up included), or the steady state after the warm-up
    (the mean of two steps); ``warm=False`` asks for a warm-up step instead.

    Example::

        rounds_of("topk", layout_of(1000), 4)   # [Round('all_gather', 400, 'flat')]
    """
    comp = resolve(compressor, "compressor")
    instance("layout", layout, BucketLayout, "a BucketLayout (bitscom.cost.layout_of(numel))")
    check_world(world, local_size)
    if step is not None:
        number("step", step, minimum=0, integer=True)
    flag("warm", warm)
    if world == 1 or layout.numel == 0:
        return []
    start = warm_up_steps(comp)
    if step is None and not warm and start > 0:
        step = 0
    key: tuple = (comp, layout, world, local_size, step)
    try:
        return list(_CACHE[key])
    except TypeError:                 # an unhashable compressor: not cached
        key = ()
    except KeyError:
        pass
    steps = (step + 1) if step is not None else start + 2
    out = _record(comp, layout, world, steps, local_size)
    out = out[step] if step is not None else _mean(*out[start:])
    if key:
        if len(_CACHE) > 512:
            _CACHE.clear()
        _CACHE[key] = out
    return list(out)


META_FROM = 1 << 20     # buckets of at least this many elements × ranks run on meta tensors


def _record(comp: Compressor, layout: BucketLayout, world: int, steps: int, local_size: int) -> list:
    """:func:`recorded_rounds`, first on ``meta`` tensors for a large bucket unless a compressor
    of the chain says no (``models_on_meta``) or fails there (it needs values)."""
    if layout.numel * world >= META_FROM and all(c.models_on_meta for c in _chain(comp)):
        meta = dataclasses.replace(layout, device=torch.device("meta"))
        try:
            return recorded_rounds(comp, meta, world, steps, local_size=local_size,
                                   grad=torch.empty(layout.numel, dtype=layout.dtype, device="meta"))
        except Exception:   # noqa: BLE001 (the real run below raises what is really wrong)
            pass
    return recorded_rounds(comp, layout, world, steps, local_size=local_size)


def sent_bytes(compressor, layout: BucketLayout, world: int, step: Optional[int] = None) -> int:
    """Bytes one rank hands to the network (``comm_stats()["bytes_sent"]``) for one step of
    ``layout``: the sum of :func:`rounds_of`.

    Example::

        sent_bytes("fp16", BucketLayout.for_tensor(torch.zeros(1000)), 4)     # 2000
    """
    return sum(r.nbytes for r in rounds_of(compressor, layout, world, step=step))


def rounds_for(compressor, numel: int, world: int, *, local_size: int = 1, dtype=torch.float32,
               warm: bool = True, shapes: Optional[Sequence[tuple]] = None,
               step: Optional[int] = None) -> List[Round]:
    """:func:`rounds_of` one bucket of ``numel`` elements of ``shapes`` (:func:`layout_of`;
    without them one 1-D tensor, or the most nearly square matrix for ``matrix_buckets``
    compressors: their best case). ``local_size`` > 1 matters for hierarchical LowBit.

    Example::

        rounds_for("lowbit", 1 << 20, 4)
        # [Round('all_to_all', 540672, 'flat'), Round('all_gather', 135168, 'flat')]
    """
    comp = resolve(compressor, "compressor")
    square = any(getattr(c, "matrix_buckets", False) for c in _chain(comp))
    layout = layout_of(numel, dtype, shapes, square=square)
    return rounds_of(comp, layout, world, local_size=local_size, step=step, warm=warm)
