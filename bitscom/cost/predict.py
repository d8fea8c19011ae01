"""Predicted step time with overlap: buckets become ready during backward and their rounds run
one bucket after another (the engine issues later rounds in bucket order)::

    end_i = max(ready_i, end_{i-1}) + codec_i + comm_i
    step  = forward + max(backward, end_last) + optimizer

With ``codec_overlaps=False`` every codec second is taken from backward (one core per rank).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..validate import flag, number, numbers
from .formulas import round_seconds
from .links import Topology
from .rounds import Round

__all__ = ["Prediction", "ready_times", "predict_step", "bucket_seconds"]


@dataclass(frozen=True)
class Prediction:
    """A predicted step: ``step_s`` total, ``exposed_s`` communication not hidden behind
    backward, ``comm_s`` and ``codec_s`` summed over buckets, ``bucket_end_s`` per bucket."""

    step_s: float
    exposed_s: float
    comm_s: float
    codec_s: float
    bucket_end_s: tuple


def bucket_seconds(rounds: Sequence[Round], topo: Topology) -> float:
    """Network seconds of one bucket's rounds, run one after the other."""
    return sum(round_seconds(r, topo) for r in rounds)


def ready_times(numels: Sequence[int], backward_s: float) -> List[float]:
    """When each bucket is ready, in plan order, if backward spends time in proportion to elements: bucket ``i`` is
    ready after its own and every earlier bucket's share (``ready_times([100, 300], 0.4) == [0.1, 0.4]``)."""
    numels = numbers("numels", numels, minimum=0, integer=True)
    number("backward_s", backward_s, minimum=0, finite=True)
    total = sum(numels)
    return [backward_s * acc / total if total else 0.0 for acc in itertools.accumulate(numels)]


def _timeline(k: int, backward_s, forward_s, optimizer_s, ready_s, codec_s, poll_s, codec_overlaps) -> tuple:
    """:func:`predict_step`'s times, checked (finite, >= 0, one per bucket): ``(ready, codec, polls)``."""
    for name, value in (("backward_s", backward_s), ("forward_s", forward_s), ("optimizer_s", optimizer_s)):
        number(name, value, minimum=0, finite=True)
    flag("codec_overlaps", codec_overlaps)
    ready = list(numbers("ready_s", ready_s, minimum=0, finite=True)) if ready_s is not None else [backward_s] * k
    codec = list(numbers("codec_s", codec_s, minimum=0, finite=True)) if codec_s is not None else [0.0] * k
    polls = None if poll_s is None else numbers("poll_s", poll_s, minimum=0, finite=True)
    if len(ready) != k or len(codec) != k:
        raise ValueError(f"ready_s and codec_s need one entry per bucket ({k}), got "
                         f"{len(ready)} and {len(codec)}")
    return ready, codec, polls


def predict_step(bucket_rounds: Sequence[Sequence[Round]], topo: Topology, *, backward_s: float = 0.0,
                 forward_s: float = 0.0, optimizer_s: float = 0.0,
                 ready_s: Optional[Sequence[float]] = None,
                 codec_s: Optional[Sequence[float]] = None, codec_overlaps: bool = True,
                 poll_s: Optional[Sequence[float]] = None) -> Prediction:
    """Predict one step from each bucket's rounds (plan order) on ``topo``.

    ``codec_overlaps``: True when the codec runs beside backward (a CUDA stream, spare cores), False when it takes its
    time from backward. ``poll_s``: the seconds into backward at which the engine advances buckets (its gradient hooks);
    a later round is issued at the first poll after the previous round finished. ``None``: continuous progress.

    Example::

        predict_step([rounds_for("lowbit", 1 << 22, 4)], Topology.flat(4, Link.from_gbit(1)), backward_s=0.2).step_s
    """
    k = len(bucket_rounds)
    ready, codec, poll_s = _timeline(k, backward_s, forward_s, optimizer_s, ready_s, codec_s, poll_s,
                                     codec_overlaps)
    # codec seconds taken from backward up to bucket i's codec
    taken = [0.0] * k if codec_overlaps else list(itertools.accumulate(codec))
    shift = [0.0] + taken[:-1]        # ... and before bucket i is ready
    backward_end = backward_s + (taken[-1] if k else 0.0)
    polls = None
    if poll_s is not None:            # into the same clock as the shifted ready times
        polls = sorted(p + max((taken[i] for i in range(k) if ready[i] < p), default=0.0) for p in poll_s)

    def issue(t: float) -> float:     # when a later round finished at t can be issued
        if polls is None or t >= backward_end:
            return t
        return next((p for p in polls if p >= t), backward_end)

    end, ends, comm_total = 0.0, [], 0.0
    for i, (rounds, r, c) in enumerate(zip(bucket_rounds, ready, codec)):
        t = max(r + shift[i], end) + c
        for j, rnd in enumerate(rounds):
            seconds = round_seconds(rnd, topo)
            comm_total += seconds
            t = (issue(t) if j else t) + seconds
        end = t
        ends.append(end)
    tail = max(backward_end, end)
    return Prediction(forward_s + tail + optimizer_s, tail - backward_s, comm_total, sum(codec),
                      tuple(ends))
