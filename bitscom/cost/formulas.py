"""Alpha-beta time of one collective, from the bytes :class:`bitscom.comm.Comm` counts.

``Round.nbytes`` is what this rank hands to the collective (Comm's count: the input buffer).
What the wire carries per rank differs, and these are the standard bandwidth-optimal
algorithms (ring / pairwise exchange; Thakur, Rabenseifner & Gropp 2005) on ``p`` ranks:

* all_reduce of n bytes (ring: reduce-scatter + all-gather): ``2(p-1)`` messages,
  ``2(p-1)/p · n`` bytes;
* all_gather with an n-byte input per rank: ``p-1`` messages, ``(p-1) · n`` bytes;
* reduce_scatter of an n-byte input: ``p-1`` messages, ``(p-1)/p · n`` bytes;
* all_to_all of an n-byte send buffer: Comm counts the whole buffer, *including the chunk
  this rank keeps for itself*; the wire carries ``(p-1)/p · n`` in ``p-1`` messages;
* broadcast of n bytes (binomial tree): ``ceil(log2 p)`` steps of n bytes.
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
    if kind == "all_reduce":
        return 2.0 * (p - 1)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(p - 1)
    if kind == "broadcast":
        return float(math.ceil(math.log2(p)))
    raise ValueError(f"unknown collective kind {kind!r}")


def wire_bytes(kind: str, nbytes: int, p: int) -> float:
    """Bytes one rank puts on the wire (sequentially) for a collective whose Comm count is
    ``nbytes`` (an int >= 0) on ``p`` ranks (an int >= 1): what the link's bandwidth term is
    charged for."""
    choice("kind", kind, KINDS)
    number("nbytes", nbytes, minimum=0, integer=True)
    if number("p", p, minimum=1, integer=True) == 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (p - 1) / p * nbytes
    if kind == "all_gather":
        return float((p - 1) * nbytes)
    if kind in ("reduce_scatter", "all_to_all"):
        return (p - 1) / p * nbytes
    if kind == "broadcast":
        return math.ceil(math.log2(p)) * float(nbytes)
    raise ValueError(f"unknown collective kind {kind!r}")


def round_seconds(round: Round, topo: Topology) -> float:
    """Alpha-beta time of ``round`` on ``topo`` (its level's ranks and link).

    Example::

        topo = Topology.flat(4, Link.from_gbit(1))
        round_seconds(Round("all_reduce", 4 << 20, "flat"), topo)   # ~0.05 s
    """
    instance("round", round, Round, "a bitscom.cost.Round")
    instance("topo", topo, Topology, "a bitscom.cost.Topology")
    p, link = topo.level(round.level)
    return link.seconds(wire_bytes(round.kind, round.nbytes, p), messages(round.kind, p))
