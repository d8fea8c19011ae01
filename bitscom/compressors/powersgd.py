"""PowerSGD (Vogels et al., NeurIPS 2019) as PyTorch's ``powerSGD_hook`` runs it.

One step of a bucket, after ``start_iter`` plain all-reduce steps:

1. With error feedback, M ← M + E.
2. Orthogonalize Q (drawn from the bucket's generator on the first step or without warm start).
3. P = M Q into a fused buffer whose tail carries the uncompressed tensors; all-reduce it.
4. Average the tail into place; orthogonalize the summed P (its scale does not matter).
5. Q = Mᵀ P, and E = M − P Qᵀ from the *local* Q (as the paper; only Σ(M + E) enters the
   factors, so torch's averaged Q gives the same trajectory); all-reduce Q.
6. M ≈ P Qᵀ / N: the average, identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import BucketLayout, Comm
from .lowrank import LowRankCompressor, LowRankState, forget_if_nonfinite, \
    orthogonalize, random_factors

__all__ = ["PowerSGD", "PowerSGDState"]


class PowerSGDState(LowRankState):
    """Per-bucket PowerSGD memory (:class:`LowRankState`): ``p`` is round 1's fused buffer, ``q`` round 2's."""


@dataclass(frozen=True)
class PowerSGD(LowRankCompressor[PowerSGDState]):
    """Rank-r PowerSGD, error feedback and warm start: two fused all-reduces per bucket (bytes: docs/compressors.md).

    Example::

        comp = bitscom.compressors.PowerSGD(rank=2, start_iter=100)   # then compression=comp
    """

    #: Approximation rank r: bytes and accuracy grow linearly with r; with AdamW prefer 16 (docs/convergence.md).
    rank: int = 8
    #: Plain all-reduce steps first (torch's hook counts the same way).
    start_iter: int = 10

    name = "powersgd"

    def init_state(self, layout: BucketLayout) -> PowerSGDState:
        return PowerSGDState(layout, self.plan(layout), self.seed, self.error_feedback)

    def compressed(self, flat, layout, state: PowerSGDState, comm: Comm):
        plan, ef = state.plan, state.ef
        native = plan.native_compensate(ef, flat)    # the matrices' e + g is fused below
        fused = native is not None
        x = native if native is not None else ef.compensate(flat)    # else M + E, fp32
        pbuf, tail = state.p[:plan.p_numel], state.p[plan.p_numel:]
        if not state.ready or not self.warm_start:
            random_factors(state.q, plan.groups, "q", state.generator, self.orthogonalization)
            state.ready = True
        else:
            for g in plan.groups:
                orthogonalize(g.q(state.q), self.orthogonalization)
        for g in plan.groups:
            g.project(x, g.q(state.q), g.p(pbuf), transpose=False, grad=flat if fused else None)
        plan.gather_uncompressed(x, tail)
        yield comm.all_reduce(state.p)

        for g in plan.groups:                        # x is unchanged since round 1
            p, q = g.p(pbuf), g.q(state.q)
            orthogonalize(p, self.orthogonalization)
            g.project(x, p, q, transpose=True, subtract=ef.enabled)    # with EF: E = x − P Qᵀ (local Q)
        if ef.enabled:                               # sent exactly: nothing left over
            plan.zero_uncompressed(x)
        tail.div_(comm.size)
        plan.scatter_uncompressed(tail, flat)
        yield comm.all_reduce(state.q)

        state.q.div_(comm.size)
        for g in plan.groups:
            g.set_product(flat, g.p(pbuf), g.q(state.q))
        forget_if_nonfinite(state.q, state)
