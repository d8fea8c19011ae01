"""``compression="auto"``: per bucket, the compressor the calibrated cost model predicts to be fastest on this group and
device, never one predicted slower than the plain all-reduce. The first ``probe_steps`` steps are plain all-reduces that
probe the link; then every rank times the codecs, rank 0 predicts and broadcasts the choice (docs/cost_model.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed

from ..compressors import (ACPSGD, BF16Compressor, FP16Compressor, LowBit, NoneCompressor, PowerSGD,
                           SignSGD, TopK, register)
from ..compressors.base import BucketLayout, Comm, Compressor, State
from ..validate import instance, number
from .calibrate import fit_link, time_codec
from .formulas import round_seconds
from .links import Link, Topology
from .rounds import rounds_for

__all__ = ["Auto", "AutoState", "decide", "labels", "candidates_for", "ADAM_SAFE", "SGD_SAFE", "SGD_ALL"]

log = logging.getLogger("bitscom")

#: Within 2% of S-SGD's loss with AdamW on the convergence suite (docs/convergence.md).
ADAM_SAFE = (NoneCompressor(), FP16Compressor(), BF16Compressor(), LowBit(), PowerSGD(rank=16, start_iter=0))
#: Within 0.5 pp of S-SGD on every SGD task of the convergence suite (docs/convergence.md).
SGD_SAFE = ADAM_SAFE + (PowerSGD(),)
#: Every compressor: ACP-SGD, Top-k and Sign-SGD lose 4-6 pp on the suite's narrow ResNet.
SGD_ALL = SGD_SAFE + (ACPSGD(), TopK(), SignSGD())


def candidates_for(optimizer) -> tuple:
    """The candidates ``compression="auto"`` may choose from with ``optimizer``:
    :data:`SGD_SAFE` for ``torch.optim.SGD``, :data:`ADAM_SAFE` for anything else."""
    return SGD_SAFE if isinstance(optimizer, torch.optim.SGD) else ADAM_SAFE


def labels(candidates: Sequence[Compressor]) -> list:
    """Short names for ``candidates``: the registry name, plus the settings that tell apart
    candidates sharing it (``'powersgd(rank=16, start_iter=0)'``)."""
    out = []
    for comp in candidates:
        twins = [c for c in candidates if c.name == comp.name]
        if len(twins) == 1 or not dataclasses.is_dataclass(comp):
            out.append(comp.name)
            continue
        differ = [f.name for f in dataclasses.fields(comp)
                  if len({repr(getattr(t, f.name, None)) for t in twins}) > 1]
        out.append(f"{comp.name}({', '.join(f'{k}={getattr(comp, k)!r}' for k in differ)})")
    return out


def decide(costs: Sequence[float]) -> int:
    """Index of the cheapest predicted cost; ties (and NaN) resolve to the earlier candidate."""
    return min(range(len(costs)), key=lambda i: costs[i], default=0)


class AutoState(State):
    """One bucket's probe samples, its choice (``-1`` until decided) and the chosen one's state."""

    def __init__(self, layout: BucketLayout, candidates: tuple):
        self._layout, self._candidates = layout, candidates
        self.step = 0
        self.choice = -1
        self.samples: list = []
        self.inner: Optional[State] = None

    def choose(self, index: int) -> State:
        self.choice = index
        self.inner = inner = self._candidates[index].init_state(self._layout)
        return inner

    def state_dict(self) -> dict:
        return {"step": self.step, "choice": self.choice, "samples": list(self.samples),
                "inner": None if self.inner is None else self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples = state["step"], list(state["samples"])
        self.choice, self.inner = -1, None
        if state["choice"] >= 0:
            inner = self.choose(state["choice"])
            if state["inner"] is not None:
                inner.load_state_dict(state["inner"])


def _completion_clock(work, clock) -> list:
    """A list that receives ``clock()`` when ``work``'s future completes (stays empty without one)."""
    cell: list = []
    get_future = getattr(work, "get_future", None)
    if get_future is not None:
        with contextlib.suppress(RuntimeError):      # a backend without futures: the caller falls back
            get_future().then(lambda _fut: cell.append(clock()))
    return cell


def _timed_plain(flat: torch.Tensor, comm: Comm, pieces: int, samples: Optional[list],
                 clock=time.perf_counter):
    """Round generator: the plain average of ``flat`` in ``pieces`` all-reduces, each timed
    from its issue to its completion (or, without a future, to the resume: an upper bound);
    never waited on here, so ranks whose buckets are ready later cannot deadlock it."""
    bounds = [flat.numel() * i // pieces for i in range(pieces + 1)]
    for s, t in zip(bounds, bounds[1:]):
        if t == s:
            continue
        piece = flat[s:t]
        t0 = clock()
        work = comm.all_reduce(piece)
        done = _completion_clock(work, clock) if samples is not None else []
        yield work
        if samples is not None:
            samples.append((piece.numel() * piece.element_size(), (done[0] if done else clock()) - t0))
    flat.div_(comm.size)


@dataclass(frozen=True)
class Auto(Compressor):
    """Choose per bucket among ``candidates`` with the calibrated cost model (see the module).

    Example::

        comp = Auto(candidates=candidates_for(opt))      # or compression="auto"
    """

    #: Compressors to choose from, ``none`` first (ties and doubt resolve to it).
    candidates: tuple = ADAM_SAFE
    #: Plain all-reduce steps that probe the link before the decision (>= 2: step 0 warms up).
    probe_steps: int = 3
    #: A :class:`bitscom.cost.Link` to use instead of the probe's fit (tests, known clusters).
    link: Any = field(default=None)
    #: ``callable(compressor, layout, world) -> seconds`` instead of timing the codec (tests).
    codec_seconds: Any = field(default=None, compare=False, repr=False)

    name = "auto"

    def __post_init__(self):
        cands = self.candidates     # checked here on every rank, not at the decision on rank 0 alone
        if not isinstance(cands, (tuple, list)) or not cands \
                or not all(isinstance(c, Compressor) for c in cands):
            raise ValueError(f"Auto candidates must be a non-empty tuple of compressors, got {cands!r}")
        if any(isinstance(c, Auto) for c in cands):
            raise ValueError("Auto candidates cannot contain Auto itself")
        number("Auto probe_steps", self.probe_steps, minimum=2, integer=True)
        instance("Auto link", self.link, (type(None), Link),
                 "None (fit the probe) or a bitscom.cost.Link, e.g. Link.from_gbit(10, latency_s=5e-5)")
        if self.codec_seconds is not None and not callable(self.codec_seconds):
            raise TypeError(f"Auto codec_seconds must be None (time the codecs) or a callable "
                            f"(compressor, layout, world) -> seconds; got {self.codec_seconds!r}")
        object.__setattr__(self, "candidates", tuple(cands))

    def init_state(self, layout: BucketLayout) -> AutoState:
        return AutoState(layout, self.candidates)

    def codec_times(self, layout: BucketLayout, world: int, grad: Optional[torch.Tensor] = None) -> list:
        """Seconds of each candidate's codec for one bucket on this rank (``none``: 0), the median
        of a few runs: every rank runs this at once, so contention for shared cores counts."""
        out = []
        for comp in self.candidates:
            if isinstance(comp, NoneCompressor):
                out.append(0.0)
            elif self.codec_seconds is not None:
                out.append(float(self.codec_seconds(comp, layout, world)))
            else:
                out.append(time_codec(comp, layout, world, grad, statistic=statistics.median))
        return out

    def costs(self, layout: BucketLayout, world: int, link, grad: Optional[torch.Tensor] = None,
              codec: Optional[Sequence[float]] = None) -> list:
        """Predicted seconds per candidate for one bucket: codec time (``codec``, or
        :meth:`codec_times`) + the alpha-beta time of its rounds."""
        topo = Topology.flat(world, link)
        shapes = [s.shape for s in layout.slots]
        if codec is None:
            codec = self.codec_times(layout, world, grad)
        return [seconds + sum(round_seconds(r, topo) for r in
                              rounds_for(comp, layout.numel, world, dtype=layout.dtype, shapes=shapes))
                for comp, seconds in zip(self.candidates, codec)]

    def _decide_rounds(self, flat, layout, state: AutoState, comm: Comm):
        """Rounds: every rank times the codecs at once, the slowest rank's times count, rank 0
        decides and broadcasts. A failure reaches every rank through the same two collectives
        (+inf times, choice -1), so every rank raises instead of waiting on a dead peer."""
        error: Optional[BaseException] = None
        try:
            times = self.codec_times(layout, comm.size, flat.detach().clone())
        except Exception as err:      # noqa: BLE001 (re-raised below, on every rank)
            error, times = err, [float("inf")] * len(self.candidates)
        codec = torch.tensor(times, dtype=torch.float64)
        yield comm.all_reduce(codec, op=torch.distributed.ReduceOp.MAX)
        choice = torch.full((1,), -1, dtype=torch.int64)
        costs = None
        failed = bool(torch.isinf(codec).all())
        if comm.rank == 0 and not failed:
            try:
                link = self.link if self.link is not None else fit_link(state.samples, comm.size)
                costs = self.costs(layout, comm.size, link, codec=codec.tolist())
                choice[0] = decide(costs)
            except Exception as err:  # noqa: BLE001
                error = err
        yield comm.broadcast(choice, 0)
        if failed or int(choice[0]) < 0:
            where = "this rank" if error is not None else \
                ("another rank" if failed else "group rank 0")
            raise RuntimeError(f"compression='auto' could not decide bucket {layout.index}: it failed "
                               f"on {where}" + (f": {error!r}" if error is not None else
                                                " (that rank's error says why)")) from error
        state.choose(int(choice[0]))
        if costs is not None:
            names = labels(self.candidates)
            log.info("auto: bucket %d (%d elements) -> %s; predicted seconds %s", layout.index,
                     layout.numel, names[state.choice],
                     {n: round(s, 6) for n, s in zip(names, costs)})
            log.debug("auto: bucket %d runs %s", layout.index, self.candidates[state.choice].fingerprint())

    def reduce(self, flat, layout, state, comm: Comm):
        step, state.step = state.step, state.step + 1
        if state.choice < 0 and comm.size > 1:
            if step < self.probe_steps:
                yield from _timed_plain(flat, comm, 2 ** step, state.samples if step else None)
                return
            yield from self._decide_rounds(flat, layout, state, comm)
        elif state.choice < 0:
            return                   # one rank: nothing to reduce, nothing to decide
        yield from self.candidates[state.choice].reduce(flat, layout, state.inner, comm)

    def fingerprint(self) -> str:
        names = ", ".join(c.fingerprint() for c in self.candidates)
        return f"Auto(candidates=({names}), probe_steps={self.probe_steps}, link={self.link!r})"

    @staticmethod
    def plan(states: Sequence[Any]) -> list:
        """The chosen compressor's name per bucket (``None`` while undecided), from the
        optimizer's per-bucket states (``comm_stats()["auto_plan"]``, e.g. ``['lowbit', 'fp16', None]``)."""
        return [labels(s._candidates)[s.choice] if isinstance(s, AutoState) and s.choice >= 0 else None
                for s in states]


register("auto", Auto)      # here, not in the registry: Auto builds on the cost model above it
