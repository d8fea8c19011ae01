"""The low-bit all-reduce, flat and hierarchical, as one round generator (:func:`all_reduce_rounds`;
the two-stage algorithm and its hierarchies: ``docs/lowbit.md``)."""

from __future__ import annotations

import functools
import math
from typing import Any, Generator, Iterator, Optional

import torch

from .config import LowBitConfig
from .error_feedback import ErrorFeedback
from .hadamard import hadamard
from .rounds import chunk_bounds, decode_sum_scaled, encode_with_feedback, leader_rounds, levels_rounds, pad, pipeline, world_rank
from .seeds import key_id, stage_seed
from .state import LowBitState

__all__ = ["all_reduce_rounds", "wire_bytes_all_reduce"]


def _route(cfg: LowBitConfig, comm, intra, inter):
    """What actually runs: (hierarchy, flat comm, level sizes, world size); ``"single_node"`` is
    one full-precision all-reduce over ``intra``, ``two_level`` with one rank per node flat."""
    hier = cfg.hierarchy
    if hier == "none":
        return hier, comm, [comm.size], comm.size
    if intra is None or inter is None:
        raise ValueError(f"hierarchy={hier!r} needs intra and inter groups")
    world = intra.size * inter.size
    if inter.size == 1:
        return "single_node", comm, [intra.size], world
    if hier == "two_level" and intra.size == 1:
        return "none", inter, [inter.size], world
    return hier, comm, [intra.size, inter.size], world


class _Feedback:
    """The error-feedback side of one all-reduce: its buffers, per chunk, and the final update."""

    def __init__(self, cfg: LowBitConfig, state: LowBitState, x: torch.Tensor, div: int):
        N, dev = x.numel(), x.device
        self.cfg, self.state, self.div, self.N = cfg, state, div, N
        self.send = x
        if cfg.residual:
            state.residual.ensure(N, dev)
            self.send = state.residual.compensate(x)     # x + e, in the residual buffer
        elif cfg.ef21:
            self.send = x.sub_(state.estimate("local_estimate", N, dev))
        self.sent = torch.empty_like(self.send) if cfg.residual or cfg.ef21 else None   # gets D(C(send))
        self.e2 = state.stage2_residual.ensure(N // div, dev) if cfg.stage2_error_feedback else None
        # EF21 without stage-2 feedback: the shard owners keep g exactly and requantize g itself;
        # adding requantized increments instead lets g drift (docs/lowbit.md, "EF21").
        self.anchors = state.estimate("global_shard", N // div, dev) \
            if cfg.error_feedback_mode == "ef21" else None
        self.pending: list = []

    def chunk(self, s: int, t: int):
        """(send, sent, stage-2 feedback, anchor) of elements ``[s, t)``."""
        d = self.div
        sv = None if self.sent is None else self.sent[s:t]
        ev = None if self.e2 is None else ErrorFeedback.over(self.e2[s // d:t // d])
        av = None if self.anchors is None else self.anchors[s // d:t // d]
        return self.send[s:t], sv, ev, av

    def finish(self, out: torch.Tensor, follower: bool) -> torch.Tensor:
        """Update residuals / estimates from this step; returns the output (EF21+: the estimate)."""
        cfg, state = self.cfg, self.state
        if cfg.residual:
            if follower:           # a leader-hierarchy follower sends nothing across nodes
                state.residual.reset()
            else:
                state.residual.update(self.sent)
                state.residual.drop_nonfinite()
            return out
        if not cfg.ef21:
            return out
        # ``out`` is the same on every rank, so all agree whether the step was finite; a NaN/Inf step
        # (AMP skips it) shows in the result but moves no estimate, keeping g the mean of the g_i.
        finite = bool(torch.isfinite(out).all())
        if finite and not follower:
            state.local_estimate.add_(self.sent)
        if self.anchors is not None:     # ef21: ``out`` already is the (requantized) estimate g
            if finite:
                for anchor, shard in self.pending:
                    anchor.add_(shard)
            return out
        g = state.estimate("global_estimate", self.N, out.device)   # ef21_plus: g += increment
        return g.add_(out) if finite else g + out


def _chunk_rounds(hier, comm, intra, inter, cfg, fb: _Feedback, alpha, seeds, s, t
                  ) -> Generator[Any, None, torch.Tensor]:
    send, sent, stage2_ef, anchor = fb.chunk(s, t)
    if hier == "leader":
        return leader_rounds(send, intra, inter, cfg, alpha, seeds, s, sent, stage2_ef, anchor, fb.pending)
    c1 = cfg.codec(cfg.bitwidth)
    levels = [(comm, c1)] if hier == "none" else [(intra, cfg.codec(cfg.intra_bitwidth)), (inter, c1)]
    c2 = cfg.codec(cfg.resolved_stage2_bitwidth)
    return levels_rounds(send, levels, c2, alpha, seeds, s, sent, stage2_ef, anchor, fb.pending)


def _fast_flat(cfg: LowBitConfig, hier: str, flat: torch.Tensor, N: int, unit: int) -> bool:
    """Whether this is the common flat case :func:`_flat_rounds` runs."""
    return (hier == "none" and not cfg.hadamard and not cfg.simulate_quantization
            and cfg.error_feedback_mode in ("none", "residual")
            and not cfg.codec(cfg.bitwidth).raw and not cfg.codec(cfg.resolved_stage2_bitwidth).raw
            and flat.device.type == "cpu" and flat.dtype == torch.float32 and flat.is_contiguous()
            and len(chunk_bounds(N, unit, cfg.chunk_size)) == 1)


def _flat_rounds(flat: torch.Tensor, comm, cfg: LowBitConfig, state: LowBitState, alpha: float,
                 seeds, unit: int) -> Iterator:
    """The flat two-stage all-reduce of :func:`levels_rounds` with one level, minus its copies
    (no padding copy, byte rows in ``state``'s buffers, decoding straight into ``flat``): the
    same collectives, bytes, result and residual as the general path (tested bitwise)."""
    n, P = flat.numel(), comm.size
    N = max(unit, -(-n // unit) * unit)
    x = flat.view(-1) if N == n else pad(flat, unit, cfg, state)
    m, dev = N // P, flat.device
    c1, c2 = cfg.codec(cfg.bitwidth), cfg.codec(cfg.resolved_stage2_bitwidth)
    r1, r2 = c1.row_bytes(m), c2.row_bytes(m)
    e = state.residual.ensure(N, dev) if cfg.residual else None
    send = state.scratch("send", (P, r1), torch.uint8, dev)
    recv = state.scratch("recv", (P, r1), torch.uint8, dev)
    for j in range(P):                            # with EF: e = x + e - D(C(x + e)), NaN/Inf -> 0
        ef = None if e is None else ErrorFeedback.over(e[j * m:(j + 1) * m])
        encode_with_feedback(x[j * m:(j + 1) * m], c1, send[j], seeds(0), j * m, ef)
    yield comm.all_to_all(recv.view(-1), send.view(-1))
    buf = state.scratch("row", (r2,), torch.uint8, dev)
    if cfg.stage2_error_feedback:                 # server error feedback (1-bit Adam's stage 2)
        shard = decode_sum_scaled(c1, recv, m, alpha, state.scratch("stage2", (m,), torch.float32, dev))
        state.stage2_residual.ensure(m, dev)
        encode_with_feedback(shard, c2, buf, seeds(1), comm.rank * m, state.stage2_residual)
    else:
        c1.decode_sum_encode(recv, m, alpha, c2, buf, seeds(1), comm.rank * m)
    gathered = state.scratch("gathered", (P * r2,), torch.uint8, dev)
    yield comm.all_gather(gathered, buf)
    rows, out = gathered.view(P, r2), flat.view(-1)
    for i in range(P):
        s, t = i * m, min(n, (i + 1) * m)
        if t > s:
            c2.decode_prefix(rows[i], m, out[s:t])


def all_reduce_rounds(flat: torch.Tensor, comm, cfg: LowBitConfig, state: Optional[LowBitState] = None,
                      *, average: bool = True, key=0, intra=None, inter=None) -> Iterator:
    """Round generator: replace ``flat`` by the low-bit sum (or average) over ranks, in place,
    bitwise identical on every rank. ``comm`` is the flat group, ``intra``/``inter`` the
    hierarchies'; ``state`` (needed for error feedback) advances one step per call.

    Example::

        drive(all_reduce_rounds(grad, Comm(group), LowBitConfig(bitwidth=4), LowBitState()))
    """
    if not flat.is_floating_point():
        raise TypeError(f"low-bit all_reduce needs a floating tensor, got {flat.dtype}")
    if state is None:
        if cfg.error_feedback or cfg.stage2_error_feedback:
            raise ValueError("error feedback needs a LowBitState (pass state=...)")
        state = LowBitState()
    hier, comm, sizes, world = _route(cfg, comm, intra, inter)
    n = flat.numel()
    if n == 0 or world == 1:
        return
    alpha = 1.0 / world if average else 1.0
    if hier == "single_node":   # intra-node links are not the bottleneck: full precision
        yield intra.all_reduce(flat)
        if average:
            flat.div_(world)
        return
    state.bind(n)
    unit = math.prod(sizes) * cfg.block_size
    rank = world_rank(comm if hier == "none" else intra)
    seeds = functools.partial(stage_seed, cfg.seed, key_id(key), state.step, rank)   # seeds(stage)
    state.step += 1
    if _fast_flat(cfg, hier, flat, max(unit, -(-n // unit) * unit), unit):
        yield from _flat_rounds(flat, comm, cfg, state, alpha, seeds, unit)
        return
    x = pad(flat, unit, cfg, state)
    out = yield from _pipelined(x, hier, (comm, intra, inter), cfg, state, alpha, seeds, unit, sizes)
    if cfg.hadamard:
        out = hadamard(out)
    flat.copy_(out[:n].view(flat.shape))


def _pipelined(x, hier, comms, cfg, state, alpha, seeds, unit, sizes) -> Generator[Any, Any, torch.Tensor]:
    """Round generator: the padded ``x``'s chunks, pipelined; returns the result, feedback applied."""
    comm, intra, inter = comms
    div = inter.size if hier == "leader" else math.prod(sizes)  # elements per final shard: N/div
    fb = _Feedback(cfg, state, x, div)
    gens = [_chunk_rounds(hier, comm, intra, inter, cfg, fb, alpha, seeds, s, t)
            for s, t in chunk_bounds(x.numel(), unit, cfg.chunk_size)]
    parts = yield from pipeline(gens)
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    leader = hier == "leader"
    if leader and len(parts) == 1:
        out = out.clone()   # a follower's result is the broadcast into ``send``, which EF reuses
    return fb.finish(out, follower=leader and intra.rank != 0)


def wire_bytes_all_reduce(numel: int, world: int, cfg: LowBitConfig) -> int:
    """Bytes one rank hands to the network for a flat low-bit all_reduce of ``numel`` elements:
    the all-to-all's P rows plus the all-gather's one (what :class:`~bitscom.comm.Comm` counts)."""
    unit = world * cfg.block_size
    m = max(unit, -(-numel // unit) * unit) // world
    return world * cfg.codec(cfg.bitwidth).row_bytes(m) + cfg.codec(cfg.resolved_stage2_bitwidth).row_bytes(m)
