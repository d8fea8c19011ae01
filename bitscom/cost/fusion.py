"""``fusion_threshold_mb="auto"``: the bucket size chosen once by the calibrated model (Horovod's autotune tunes by
trial). Each candidate threshold is planned as the optimizer would and the step predicted, assuming backward as long as
the uncompressed all-reduce (where overlap matters most); the smallest prediction wins (ties: the larger threshold).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from ..buckets import plan_buckets
from ..comm import Comm, resolve_group
from ..validate import instance, number, numbers
from .calibrate import calibrate_link
from .links import Link, Topology
from .predict import bucket_seconds, predict_step, ready_times
from .rounds import rounds_for

__all__ = ["CANDIDATE_MB", "choose_fusion_threshold_mb", "auto_fusion_threshold_mb"]

CANDIDATE_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 25, 32, 64)


def choose_fusion_threshold_mb(params: Sequence[Tuple[str, torch.Tensor]], topo: Topology,
                               compressor="none", candidates: Sequence[float] = CANDIDATE_MB,
                               backward_s: Optional[float] = None) -> float:
    """The candidate threshold (MiB) with the smallest predicted step for ``params`` (name, tensor) in registration
    order on ``topo``; ``backward_s``: the seconds of backward to overlap with (default: see the module).

    Example::

        mb = choose_fusion_threshold_mb(list(model.named_parameters()), Topology.flat(4, Link.from_gbit(10)))
    """
    candidates = numbers("candidates", candidates, nonempty=True, minimum=0, inclusive=False, finite=True)
    instance("topo", topo, Topology, "a bitscom.cost.Topology")
    if backward_s is not None:
        number("backward_s", backward_s, minimum=0, finite=True)
    params = list(params)
    if not params or topo.world == 1:
        return float(max(candidates))
    if backward_s is None:
        backward_s = bucket_seconds(rounds_for("none", sum(p.numel() for _, p in params), topo.world,
                                               dtype=params[0][1].dtype), topo)
    predicted: Dict[float, float] = {}       # larger thresholds first: min() keeps the first of a tie
    for mb in sorted(candidates, reverse=True):
        layouts = plan_buckets(params, int(mb * 2 ** 20))
        rounds = [rounds_for(compressor, l.numel, topo.world, local_size=topo.local_size, dtype=l.dtype,
                             shapes=[s.shape for s in l.slots]) for l in layouts]
        predicted[float(mb)] = predict_step(rounds, topo, backward_s=backward_s,
                                            ready_s=ready_times([l.numel for l in layouts], backward_s)).step_s
    return min(predicted, key=predicted.__getitem__)


def auto_fusion_threshold_mb(params: Sequence[Tuple[str, torch.Tensor]], group=None,
                             compressor="none", link: Optional[Link] = None) -> float:
    """Calibrate the link of ``group`` (unless ``link`` is given), choose on group rank 0 and
    broadcast: every rank gets the same threshold. Every rank of the group must call it."""
    if link is not None:
        instance("link", link, Link, "None (calibrate the group) or a bitscom.cost.Link")
    group = resolve_group(group)
    comm = Comm(group)
    if comm.solo:
        return float(max(CANDIDATE_MB))
    if link is None:
        link = calibrate_link(group)
    try:                         # ("auto" models as its probe steps: plain all-reduces)
        rounds_for(compressor, 1, comm.size)
    except NotImplementedError:  # rounds the model cannot count (a rooted reduce): plain
        compressor = "none"
    mb = choose_fusion_threshold_mb(params, Topology.flat(comm.size, link), compressor)
    value = torch.tensor([mb], dtype=torch.float64)
    comm.broadcast(value, 0).wait()
    return float(value[0])
