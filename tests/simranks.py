"""Simulated ranks in one process: a fake Comm per rank and a driver that runs every rank's
compressor rounds in lockstep, completing each round's collectives (all-reduce: the sum in
rank order; all-gather: the inputs concatenated in rank order). Multi-rank arithmetic is then
checked without processes; the gloo tests check the real thing."""

from __future__ import annotations

import torch


class SimComm:
    """One simulated rank's Comm: records all-reduces, all-gathers and all-to-alls for
    :func:`lockstep`; with a ``wire`` list, also a copy of every tensor handed to the network."""

    def __init__(self, rank, size, log, wire=None):
        self.rank, self.size, self.log, self.wire, self.bytes_sent = rank, size, log, wire, 0

    def _issue(self, kind, output, input):
        self.bytes_sent += input.numel() * input.element_size()
        if self.wire is not None:
            self.wire.append(input.clone())
        self.log.append((self.rank, kind, output, input.clone()))

    def all_reduce(self, tensor, op=None):
        self._issue("reduce", tensor, tensor)

    def all_gather(self, output, input):
        self._issue("gather", output, input)

    def all_to_all(self, output, input):
        self._issue("a2a", output, input)

    def enter_later_rounds(self):
        pass


def _complete(log, world):
    """Complete the collectives of one round: the i-th of every rank belong together."""
    per_rank = [[e for e in log if e[0] == r] for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1, "ranks issued different collectives"
    for entries in zip(*per_rank):
        assert len({e[1] for e in entries}) == 1
        if entries[0][1] == "gather":
            joined = torch.cat([e[3] for e in entries])
            for e in entries:
                e[2].copy_(joined)
        elif entries[0][1] == "a2a":   # rank r receives chunk r of every rank, in rank order
            for r, e in enumerate(entries):
                e[2].copy_(torch.cat([src[3].view(world, -1)[r] for src in entries]))
        else:
            total = entries[0][3].clone()
            for e in entries[1:]:
                total += e[3]
            for e in entries:
                e[2].copy_(total)


def lockstep(compressor, flats, states, layout, wires=None):
    """Run ``compressor.reduce`` on every simulated rank; returns the bytes each rank sent
    (``wires``: one list per rank that receives a copy of everything that rank sent)."""
    world, log = len(flats), []
    comms = [SimComm(r, world, log, None if wires is None else wires[r]) for r in range(world)]
    gens = [compressor.reduce(f, layout, s, c) for f, s, c in zip(flats, states, comms)]
    live = list(range(world))
    while live:
        log.clear()
        still = []
        for r in live:
            try:
                next(gens[r])
                still.append(r)
            except StopIteration:
                pass
        _complete(log, world)
        live = still
    return [c.bytes_sent for c in comms]
