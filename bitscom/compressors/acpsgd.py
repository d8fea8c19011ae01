"""ACP-SGD: alternating compressed PowerSGD (Zhang et al., ICDCS 2023).

PowerSGD's two dependent all-reduces per step serialize communication; ACP-SGD sends *one* factor per step and
alternates, warm-starting from the factor reduced the step before, so a bucket costs one all-reduce and overlaps
backward as S-SGD does. One step of a bucket (the 1st, 3rd, … after ``start_iter`` are P steps):

1. With error feedback, M ← M + E.
2. P step: orthogonalize the last reduced Q (drawn from the bucket's generator at first),
   P = M Q; Q step: orthogonalize the last reduced P, Q = Mᵀ P.
3. E ← M − P Qᵀ from the *local* factors, before the reduction, as the paper does.
4. All-reduce one fused buffer (the factors, then the uncompressed tensors); divide by N.
5. M ≈ P Qᵀ with the reduced factor, which is kept as the next step's warm start.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import BucketLayout, Comm
from .lowrank import LowRankCompressor, LowRankState, forget_if_nonfinite, \
    orthogonalize, random_factors

__all__ = ["ACPSGD", "ACPSGDState"]


class ACPSGDState(LowRankState):
    """Per-bucket ACP-SGD memory: ``p`` and ``q`` each end with the uncompressed tail, so each is
    its step's fused buffer, all-reduced in place (the reduced factor stays as the warm start)."""

    q_tail = True


@dataclass(frozen=True)
class ACPSGD(LowRankCompressor[ACPSGDState]):
    """Rank-r ACP-SGD: one fused all-reduce per bucket per step, alternating P and Q (bytes: docs/compressors.md).

    Example::

        opt = bitscom.DistributedOptimizer(opt, model.named_parameters(), compression=bitscom.compressors.ACPSGD())
    """

    #: Rank r: bytes and accuracy grow with r (on the suite's ResNet 8 lost 3.2 pp, the paper's 4 lost 11).
    rank: int = 8
    #: Plain all-reduce steps first (0 as in the paper).
    start_iter: int = 0

    name = "acpsgd"

    def init_state(self, layout: BucketLayout) -> ACPSGDState:
        return ACPSGDState(layout, self.plan(layout), self.seed, self.error_feedback)

    def compressed(self, flat, layout, state: ACPSGDState, comm: Comm):
        plan, ef = state.plan, state.ef
        native = plan.native_compensate(ef, flat)    # the matrices' e + g is fused below
        fused = native is not None
        x = native if native is not None else ef.compensate(flat)    # else M + E, fp32
        p_all, q_all = state.p[:plan.p_numel], state.q[:plan.q_numel]
        send_p = (state.step - 1 - self.start_iter) % 2 == 0     # step counts this one already
        fresh = not state.ready or (send_p and not self.warm_start)     # first, after NaN, no warm start
        if fresh:
            which, buf = ("q", q_all) if send_p else ("p", p_all)
            random_factors(buf, plan.groups, which, state.generator, self.orthogonalization)
            state.ready = True
        wire = state.p if send_p else state.q
        tail = wire[wire.numel() - plan.uncompressed_numel:]
        plan.gather_uncompressed(x, tail)
        for g in plan.groups:
            factor, out = (g.q(q_all), g.p(p_all)) if send_p else (g.p(p_all), g.q(q_all))
            if not fresh:
                orthogonalize(factor, self.orthogonalization)
            g.project(x, factor, out, transpose=not send_p, grad=flat if fused else None, subtract=ef.enabled)
        if ef.enabled:                               # sent exactly: nothing left over
            plan.zero_uncompressed(x)
        yield comm.all_reduce(wire)

        wire.div_(comm.size)
        plan.scatter_uncompressed(tail, flat)
        for g in plan.groups:
            g.set_product(flat, g.p(p_all), g.q(q_all))
        forget_if_nonfinite(wire, state)
