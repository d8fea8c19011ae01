"""Simulated ranks in one process: a fake Comm per rank and a driver that runs every rank's
compressor rounds in lockstep, completing each round's collectives (all-reduce: the sum in
rank order; all-gather: the inputs concatenated in rank order). Multi-rank arithmetic is then
checked without processes; the gloo tests check the real thing."""

from __future__ import annotations

import torch


class SimComm:
    """One simulated rank's Comm: records all-reduces and all-gathers for :func:`lockstep`."""

    def __init__(self, rank, size, log):
        self.rank, self.size, self.log, self.bytes_sent = rank, size, log, 0

    def all_reduce(self, tensor, op=None):
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.log.append((self.rank, "reduce", tensor, tensor.clone()))

    def all_gather(self, output, input):
        self.bytes_sent += input.numel() * input.element_size()
        self.log.append((self.rank, "gather", output, input.clone()))

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
        else:
            total = entries[0][3].clone()
            for e in entries[1:]:
                total += e[3]
            for e in entries:
                e[2].copy_(total)


def lockstep(compressor, flats, states, layout):
    """Run ``compressor.reduce`` on every simulated rank; returns the bytes each rank sent."""
    world, log = len(flats), []
    comms = [SimComm(r, world, log) for r in range(world)]
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
