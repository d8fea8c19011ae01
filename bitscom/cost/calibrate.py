"""Calibration: the link from a short probe of the real group (:func:`probe_link`, fitted to
the ring formula by :func:`fit_link`, broadcast by :func:`calibrate_link`), the codec from
timings on the device in use with the network taken out (:func:`time_codec`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..comm import Comm, resolve_group, wait
from ..compressors.base import BucketLayout, Compressor
from ..validate import choice, flag, instance, number, numbers
from .formulas import messages, wire_bytes
from .links import Link
from .local import KINDS, check_world, local_comm
from .rounds import warm_up_steps

__all__ = ["probe_link", "fit_link", "calibrate_link", "time_codec", "parse_samples"]

DEFAULT_SIZES = tuple(1 << k for k in range(12, 23, 2))   # 4 KiB … 4 MiB


def _samples(samples) -> List[Tuple[float, float]]:
    """``samples`` as float pairs, checked: at least one, each ``(nbytes, seconds)`` with an int
    nbytes >= 0 and a finite seconds >= 0."""
    pts = list(instance("samples", samples, Iterable, "a list of (nbytes, seconds) pairs"))
    if not pts:
        raise ValueError(f"fit_link samples must hold at least one (nbytes, seconds) pair, got {samples!r}")
    for i, pair in enumerate(pts):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"samples[{i}] must be an (nbytes, seconds) pair, got {pair!r}")
        number(f"samples[{i}] nbytes", pair[0], minimum=0, integer=True)
        number(f"samples[{i}] seconds", pair[1], minimum=0, finite=True)
    return [(float(n), float(t)) for n, t in pts]


def _probe_settings(sizes, repeats) -> None:
    numbers("sizes", sizes, nonempty=True, minimum=1, integer=True)
    number("repeats", repeats, minimum=1, integer=True)


def fit_link(samples: Iterable[Tuple[float, float]], world: int, kind: str = "all_reduce") -> Link:
    """Least-squares ``Link`` from ``(nbytes, seconds)`` samples of ``kind`` collectives on
    ``world`` ranks (nbytes as Comm counts them); one distinct size is charged to bandwidth.

    Example::

        fit_link([(1000, 1.1e-3), (2000, 2.1e-3)], world=2)   # alpha 5e-5, beta 1e-6
    """
    pts = _samples(samples)
    check_world(world)
    choice("kind", kind, KINDS)
    if world < 2:
        return Link(0.0, 0.0)
    a = messages(kind, world)
    xs = [wire_bytes(kind, int(n), world) for n, _ in pts]
    ts = [t for _, t in pts]
    k = len(pts)
    mx, mt = sum(xs) / k, sum(ts) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return Link(0.0, max(0.0, mt / mx) if mx else 0.0)
    beta = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx
    if beta < 0:                        # noise on a fast link: latency only
        return Link(max(0.0, mt / a), 0.0)
    alpha = (mt - beta * mx) / a
    if alpha < 0:                       # refit through the origin
        return Link(0.0, sum(x * t for x, t in zip(xs, ts)) / sum(x * x for x in xs))
    return Link(alpha, beta)


def parse_samples(text: str) -> List[Tuple[int, float]]:
    """``(nbytes, seconds)`` samples from CSV text with a ``nbytes,seconds`` header
    (``scripts/validate_cost.py --probe-out``); blank lines and ``#`` comments skipped.

    Example::

        parse_samples("nbytes,seconds\\n4096,0.0002\\n")   # [(4096, 0.0002)]
    """
    out = []
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not lines or [h.strip() for h in lines[0].split(",")] != ["nbytes", "seconds"]:
        raise ValueError(f"probe CSV must start with the header 'nbytes,seconds', got "
                         f"{lines[0] if lines else '(empty)'!r}")
    for i, ln in enumerate(lines[1:], start=2):
        parts = ln.split(",")
        try:
            n, t = int(parts[0]), float(parts[1])
        except (ValueError, IndexError):
            raise ValueError(f"probe CSV line {i}: expected 'nbytes,seconds', got {ln!r}") from None
        if n < 0 or not t >= 0:
            raise ValueError(f"probe CSV line {i}: nbytes and seconds must be >= 0, got {ln!r}")
        out.append((n, t))
    return out


def probe_link(group=None, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 3,
               clock: Callable[[], float] = time.perf_counter) -> List[Tuple[int, float]]:
    """``(nbytes, seconds)`` of all-reduces of ``sizes`` bytes on ``group``: the minimum of
    ``repeats`` timed runs after one warm-up. Every rank of the group must call it."""
    _probe_settings(sizes, repeats)
    comm = Comm(resolve_group(group))
    out = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4))
        wait(comm.all_reduce(buf))        # warm-up (one rank: no work to wait for)
        best = float("inf")
        for _ in range(repeats):
            t0 = clock()
            wait(comm.all_reduce(buf))
            best = min(best, clock() - t0)
        out.append((buf.numel() * 4, best))
    return out


def calibrate_link(group=None, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 3) -> Link:
    """Probe ``group``, fit on group rank 0 and broadcast: the same :class:`Link` on every rank.

    Example::

        topo = Topology.flat(dist.get_world_size(group), calibrate_link(group))
    """
    _probe_settings(sizes, repeats)
    group = resolve_group(group)
    comm = Comm(group)
    if comm.solo:
        return Link(0.0, 0.0)
    fit = fit_link(probe_link(group, sizes, repeats), comm.size)
    values = torch.tensor([fit.alpha_s, fit.beta_s_per_byte], dtype=torch.float64)
    comm.broadcast(values, 0).wait()
    return Link(float(values[0]), float(values[1]))


def time_codec(compressor: Compressor, layout: BucketLayout, world: int, grad: Optional[torch.Tensor] = None,
               repeats: int = 3, warmup: int = 2, clock: Callable[[], float] = time.perf_counter,
               with_copies: bool = False, statistic: Callable[[List[float]], float] = min) -> float:
    """Seconds of ``compressor``'s compute for one bucket on ``world`` ranks, network excluded (a
    :class:`~bitscom.cost.local.LocalTransport` on this device): ``statistic`` of ``repeats`` timed steps after
    ``warmup`` untimed ones and the compressor's own ``start_iter`` steps. A hierarchical compressor is timed flat.
    ``with_copies`` adds the two copies the optimizer makes around every compressor (bucket fill, write-back).

    Example::

        time_codec(bitscom.compressors.get("lowbit"), layout_of(1 << 20), world=4)
    """
    from ..compressors.lowbit import LowBit
    instance("compressor", compressor, Compressor, "a bitscom compressor (bitscom.compressors.get(name))")
    instance("layout", layout, BucketLayout, "a BucketLayout (bitscom.cost.layout_of(numel))")
    check_world(world)
    number("repeats", repeats, minimum=1, integer=True)
    number("warmup", warmup, minimum=0, integer=True)
    flag("with_copies", with_copies)
    if isinstance(compressor, LowBit) and compressor.config.hierarchy != "none":
        compressor = LowBit(dataclasses.replace(compressor.config, hierarchy="none", chunk_size=None))
    if grad is None:
        grad = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0)).to(layout.dtype)
    state = compressor.init_state(layout)
    warmup += warm_up_steps(compressor)
    work = torch.empty_like(grad)
    out = torch.empty_like(grad) if with_copies else None     # the write-back's target
    times: List[float] = []
    for i in range(warmup + repeats):
        if not with_copies:           # else the fill is part of the timed work
            work.copy_(grad)
        comm, _ = local_comm(world)
        if grad.is_cuda:
            torch.cuda.synchronize(grad.device)
        t0 = clock()
        if with_copies:
            work.copy_(grad)
        for _ in compressor.reduce(work, layout, state, comm):
            pass
        if out is not None:
            out.copy_(work)
        if grad.is_cuda:
            torch.cuda.synchronize(grad.device)
        if i >= warmup:
            times.append(clock() - t0)
    return float(statistic(times))
