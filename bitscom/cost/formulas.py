"""Alpha-beta time of one collective, from the bytes :class:`bitscom.comm.Comm` counts (this
rank's input buffer): the standard bandwidth-optimal algorithms (ring / pairwise exchange,
binomial-tree broadcast; Thakur, Rabenseifner & Gropp 2005), tabled in docs/cost_model.md.
"""

from __future__ import annotations

import math

from ..validate import choice, instance, number
from .links import Topology
from .rounds import KINDS, Round

__all__ = ["round_seconds", "wire_bytes", "messages"]


def messages(kind: str, p: int) -> float:
    """Sequential messages (latency terms) of one ``kind`` collective on ``p`` ranks (an int >= 1)."""
    choice("kind", kind, KINDS)
    if number("p", p, minimum=1, integer=True) == 1:
        return 0.0
    steps = {"all_reduce": 2.0 * (p - 1), "broadcast": float(math.ceil(math.log2(p)))}
    return steps.get(kind, float(p - 1))       # all_gather, reduce_scatter, all_to_all


def wire_bytes(kind: str, nbytes: int, p: int) -> float:
    """Bytes one rank puts on the wire (sequentially) for a collective whose Comm count is ``nbytes`` (an int >= 0) on
    ``p`` ranks (an int >= 1); all-to-all's count includes the chunk a rank keeps."""
    choice("kind", kind, KINDS)
    number("nbytes", nbytes, minimum=0, integer=True)
    if number("p", p, minimum=1, integer=True) == 1:
        return 0.0
    wire = {"all_reduce": 2.0 * (p - 1) / p * nbytes, "all_gather": float((p - 1) * nbytes),
            "broadcast": math.ceil(math.log2(p)) * float(nbytes)}
    return wire.get(kind, (p - 1) / p * nbytes)     # reduce_scatter, all_to_all


def round_seconds(round: Round, topo: Topology) -> float:
    """Alpha-beta time of ``round`` on ``topo`` (its level's ranks and link).

    Example::

        round_seconds(Round("all_reduce", 4 << 20, "flat"), Topology.flat(4, Link.from_gbit(1)))   # ~0.05 s
    """
    instance("round", round, Round, "a bitscom.cost.Round")
    instance("topo", topo, Topology, "a bitscom.cost.Topology")
    p, link = topo.level(round.level)
    return link.seconds(wire_bytes(round.kind, round.nbytes, p), messages(round.kind, p))
