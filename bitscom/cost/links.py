"""Links and topologies: the alpha-beta description of the network a step runs on (numbers
only; :mod:`bitscom.cost.calibrate` measures them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..validate import choice, instance, number

__all__ = ["Link", "Topology"]


@dataclass(frozen=True)
class Link:
    """One rank's connection: ``alpha_s`` seconds per message plus ``beta_s_per_byte`` per byte.

    Example::

        Link.from_gbit(10, latency_s=50e-6).seconds(1 << 20)   # one 1 MiB message at 10 Gbit/s, 50 us each
    """

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self):
        for name in ("alpha_s", "beta_s_per_byte"):
            number(f"Link {name}", getattr(self, name), minimum=0, finite=True)

    @staticmethod
    def from_gbit(gbit: float, latency_s: float = 0.0) -> "Link":
        """A link of ``gbit`` Gbit/s (10**9 bits per second: 1 is 8e-9 s per byte) and ``latency_s`` per message."""
        number("Link.from_gbit gbit", gbit, minimum=0, inclusive=False, finite=True)
        return Link(latency_s, 8.0 / (gbit * 1e9))

    @property
    def gbit(self) -> float:
        """The bandwidth in Gbit/s (``inf`` for a link of zero cost per byte)."""
        return math.inf if self.beta_s_per_byte == 0 else 8.0 / (self.beta_s_per_byte * 1e9)

    def seconds(self, nbytes: float, messages: float = 1.0) -> float:
        """``messages`` latencies plus ``nbytes`` at this link's bandwidth (both finite, >= 0)."""
        number("Link.seconds nbytes", nbytes, minimum=0, finite=True)
        number("Link.seconds messages", messages, minimum=0, finite=True)
        return messages * self.alpha_s + nbytes * self.beta_s_per_byte


_FREE = Link(0.0, 0.0)


@dataclass(frozen=True)
class Topology:
    """``world`` ranks on ``world // local_size`` nodes; ``intra`` joins ranks of a node, ``inter`` the
    nodes (as one inter-node group sees them while every node's groups talk at once). Flat collectives
    across nodes run at ``world_link`` (probe the world group: one stream per node, up to ``local_size``
    times faster) when given, else at ``inter``.

    Example::

        Topology(4, local_size=2, intra=Link.from_gbit(100), inter=Link.from_gbit(1)).nodes   # 2
    """

    world: int
    local_size: int = 1
    intra: Link = field(default=_FREE)
    inter: Link = field(default=_FREE)
    world_link: Optional[Link] = None

    def __post_init__(self):
        for name in ("world", "local_size"):
            number(f"Topology {name}", getattr(self, name), minimum=1, integer=True)
        if self.world % self.local_size:
            raise ValueError(f"Topology world={self.world} is not a multiple of "
                             f"local_size={self.local_size}")
        for name in ("intra", "inter") + (("world_link",) if self.world_link is not None else ()):
            instance(f"Topology {name}", getattr(self, name), Link, "a bitscom.cost.Link")

    @staticmethod
    def flat(world: int, link: Link) -> "Topology":
        """``world`` ranks joined by one kind of link (every rank its own node)."""
        return Topology(world, 1, link, link)

    @property
    def nodes(self) -> int:
        return self.world // self.local_size

    def level(self, level: str) -> "tuple[int, Link]":
        """(ranks taking part, link) of a collective at ``level`` (flat, intra or inter)."""
        if level == "intra":
            return self.local_size, self.intra
        if level == "inter":
            return self.nodes, self.inter
        choice("level", level, ("flat", "intra", "inter"))
        if self.nodes == 1:
            return self.world, self.intra
        return self.world, (self.inter if self.world_link is None else self.world_link)
