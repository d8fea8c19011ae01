"""The low-rank compressors' zero-copy hot path against the computation it replaced, bitwise.

PowerSGD and ACP-SGD used to build a stacked copy of every unevenly spaced group of
same-shaped matrices (``MatrixGroup.load``) before projecting, and to write ``P Qᵀ`` into a
temporary that was then copied into the bucket whenever the group's view was not contiguous
(same-shaped weights spaced by their biases, i.e. almost every transformer layer). Now both
run on zero-copy views, run by run (``MatrixGroup.views``), and ``bmm`` writes the product
straight into the bucket. The BLAS calls per matrix are the same, so the results must be the
same bits: this file keeps the old reduction (``_old_acpsgd`` / ``_old_powersgd``, copied from
the code before the change) and runs old and new side by side on 2 and 3 simulated ranks over
P and Q steps, with contiguous, strided-with-gaps and unevenly spaced groups, at sizes large
enough for the BLAS blocked kernels and at unaligned offsets, in fp32 and bf16 buckets. The
outputs, the residuals and the factor memories must be bitwise equal, and every rank must end
with the same bits.

On CPUs with fp32 buckets the native kernels (``bq_lr_*`` in ``quant_cpu.cpp``) now replace
those BLAS calls: they are checked against the same old computation to float rounding, against
float64 one matrix at a time, and for the fixed-order product that keeps replicas identical.
"""

from __future__ import annotations

import pytest
import torch

from bitscom.compressors import ACPSGD, PowerSGD
from bitscom.compressors.base import BucketLayout, TensorSlot, plain_average
from bitscom.compressors.lowrank import forget_if_nonfinite, orthogonalize, random_factors
from simranks import lockstep

# 3 same-shaped weights spaced by a bias each (strided, gaps), 3 more spaced unevenly (two
# different biases between them), two back-to-back (contiguous batch), a conv-like 4-D tensor,
# a matrix too small to compress and a 1-D tail; odd sizes in between so that views start at
# offsets that are not multiples of a cache line
SHAPES = [(3,), (96, 80), (96,), (96, 80), (96,), (96, 80),
          (160, 192), (160,), (160, 192), (7,), (5,), (160, 192),
          (40, 30), (40, 30), (20, 2, 3, 3), (6, 5), (11,)]
STEPS = 4      # P, Q, P, Q (ACP-SGD); warm-up, then 3 warm-started steps (PowerSGD)


def make_layout(dtype=torch.float32) -> BucketLayout:
    slots, offset = [], 0
    for i, shape in enumerate(SHAPES):
        numel = torch.Size(shape).numel()
        slots.append(TensorSlot(f"t{i}", offset, numel, shape))
        offset += numel
    return BucketLayout(0, tuple(slots), dtype, torch.device("cpu"))


def gradient(layout, rank, step) -> torch.Tensor:
    g = torch.Generator().manual_seed(1009 * step + 7 * rank + 3)
    flat = torch.cat([torch.randn(s.numel, generator=g) * (1 + i % 4) for i, s in enumerate(layout.slots)])
    flat[layout.slots[1].offset:layout.slots[1].offset + 80 * 10] = 0    # zero rows: signed zeros
    return flat.to(layout.dtype)


# ---- the computation before the change (kept verbatim, so the comparison cannot drift) ------
def _old_project(mat, factor, out, transpose):
    if transpose:
        out.copy_(torch.bmm(factor.transpose(1, 2), mat).transpose(1, 2))
    else:
        out.copy_(torch.bmm(factor.transpose(1, 2), mat.transpose(1, 2)).transpose(1, 2))


def _old_set_product(g, flat, p, q):
    view = g.load(flat) if g._stride is not None else None
    if view is not None and view.is_contiguous() and view.dtype == p.dtype:
        torch.bmm(p, q.transpose(1, 2), out=view)
    else:
        g.store(flat, torch.bmm(p, q.transpose(1, 2)))


def _old_sub_product(g, flat, p, q):
    if g._stride is not None:
        g.load(flat).baddbmm_(p, q.transpose(1, 2), alpha=-1)
    else:
        size = g.n * g.m
        for o, pi, qi in zip(g.offsets, p, q):
            flat[o:o + size].view(g.n, g.m).addmm_(pi, qi.t(), alpha=-1)


def _old_acpsgd(self, flat, layout, state, comm):
    step, state.step = state.step, state.step + 1
    if step < self.start_iter:
        yield from plain_average(flat, comm)
        return
    plan, ef = state.plan, state.ef
    x = ef.compensate(flat)
    p_all, q_all = state.p[:plan.p_numel], state.q[:plan.q_numel]
    send_p = (step - self.start_iter) % 2 == 0
    fresh = not state.ready or (send_p and not self.warm_start)
    if fresh:
        which, buf = ("q", q_all) if send_p else ("p", p_all)
        random_factors(buf, plan.groups, which, state.generator, self.orthogonalization)
        state.ready = True
    wire = state.p if send_p else state.q
    tail = wire[wire.numel() - plan.uncompressed_numel:]
    plan.gather_uncompressed(x, tail)
    for g in plan.groups:
        mat, p, q = g.load(x), g.p(p_all), g.q(q_all)
        if send_p:
            if not fresh:
                orthogonalize(q, self.orthogonalization)
            _old_project(mat, q, p, transpose=False)
        else:
            if not fresh:
                orthogonalize(p, self.orthogonalization)
            _old_project(mat, p, q, transpose=True)
        if ef.enabled:
            _old_sub_product(g, x, p, q)
    if ef.enabled:
        plan.zero_uncompressed(x)
    yield comm.all_reduce(wire)
    wire.div_(comm.size)
    plan.scatter_uncompressed(tail, flat)
    for g in plan.groups:
        _old_set_product(g, flat, g.p(p_all), g.q(q_all))
    forget_if_nonfinite(wire, state)


def _old_powersgd(self, flat, layout, state, comm):
    step, state.step = state.step, state.step + 1
    if step < self.start_iter:
        yield from plain_average(flat, comm)
        return
    plan, ef = state.plan, state.ef
    x = ef.compensate(flat)
    pbuf, tail = state.p[:plan.p_numel], state.p[plan.p_numel:]
    if not state.ready or not self.warm_start:
        random_factors(state.q, plan.groups, "q", state.generator, self.orthogonalization)
        state.ready = True
    else:
        for g in plan.groups:
            orthogonalize(g.q(state.q), self.orthogonalization)
    matrices = [g.load(x) for g in plan.groups]
    for g, mat in zip(plan.groups, matrices):
        _old_project(mat, g.q(state.q), g.p(pbuf), transpose=False)
    plan.gather_uncompressed(x, tail)
    yield comm.all_reduce(state.p)
    for g, mat in zip(plan.groups, matrices):
        p, q = g.p(pbuf), g.q(state.q)
        orthogonalize(p, self.orthogonalization)
        _old_project(mat, p, q, transpose=True)
        if ef.enabled:
            _old_sub_product(g, x, p, q)
    del matrices
    if ef.enabled:
        plan.zero_uncompressed(x)
    tail.div_(comm.size)
    plan.scatter_uncompressed(tail, flat)
    yield comm.all_reduce(state.q)
    state.q.div_(comm.size)
    for g in plan.groups:
        _old_set_product(g, flat, g.p(pbuf), g.q(state.q))
    forget_if_nonfinite(state.q, state)


class _Old:
    """The same compressor settings, reduced by the old code."""

    def __init__(self, comp, fn):
        self.comp, self.fn = comp, fn

    def reduce(self, flat, layout, state, comm):
        return self.fn(self.comp, flat, layout, state, comm)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def test_layout_has_every_kind_of_group():
    """The layout exercises what changed: strided-with-gaps, uneven and contiguous groups."""
    plan = PowerSGD(rank=4).plan(make_layout())
    kinds = {(g.n, g.m): (g._stride, g.batch, len(g._runs)) for g in plan.groups}
    assert kinds[(96, 80)] == (96 * 80 + 96, 3, 1)            # evenly spaced, not contiguous
    assert kinds[(160, 192)][0] is None and kinds[(160, 192)][2] == 2   # uneven: two runs
    assert kinds[(40, 30)] == (40 * 30, 2, 1)                  # contiguous batch
    assert plan.uncompressed_numel > 0


def test_views_cover_the_group_without_copies():
    layout = make_layout()
    plan = ACPSGD(rank=4).plan(layout)
    flat = torch.arange(layout.numel, dtype=torch.float32)
    for g in plan.groups:
        views = g.views(flat)
        assert sum(v.shape[0] for _, v in views) == g.batch
        storage = flat.untyped_storage().data_ptr()
        assert all(v.untyped_storage().data_ptr() == storage for _, v in views)  # no copies
        assert torch.equal(torch.cat([v for _, v in views]), g.load(flat))
        assert [c.start for c, _ in views] == sorted(c.start for c, _ in views)
        for _, v in views:
            v.zero_()
        for o in g.offsets:
            assert not flat[o:o + g.n * g.m].any()


@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (3, torch.float32), (2, torch.bfloat16)],
                         ids=["2ranks-fp32", "3ranks-fp32", "2ranks-bf16"])
@pytest.mark.parametrize("kind", ["acpsgd", "powersgd"])
def test_new_path_bitwise_equals_old_computation(kind, world, dtype, monkeypatch):
    """The BLAS view path (what GPUs, bf16 buckets and CPUs without the native library run)."""
    from bitscom.compressors.lowrank import MatrixGroup
    monkeypatch.setattr(MatrixGroup, "_native", lambda self, flat, *factors: None)
    _compare_with_old(kind, world, dtype, exact_bits=True)


@pytest.mark.parametrize("world", [2, 3], ids=["2ranks", "3ranks"])
@pytest.mark.parametrize("kind", ["acpsgd", "powersgd"])
def test_native_path_matches_old_computation_and_keeps_replicas_identical(kind, world):
    """The native CPU kernels (fp32 buckets: the default there) against the same old
    computation: outputs and residuals agree to float rounding (the local projections sum in
    another order than BLAS; the factors themselves may differ by a column's sign, which QR
    takes from entries at rounding level, and P Qᵀ does not see), the uncompressed slots hold
    the exact average, and every rank ends with the same bits (P Qᵀ is formed in a fixed order)."""
    from bitscom.compressors.lowrank import MatrixGroup
    from bitscom.kernels import cpu_native
    assert cpu_native.has_lowrank()            # the source always has it; a compiler is on CI
    layout = make_layout(torch.float32)
    assert MatrixGroup._native(ACPSGD(rank=4).plan(layout).groups[0], torch.zeros(layout.numel),
                               torch.zeros(4)) is not None
    _compare_with_old(kind, world, torch.float32, exact_bits=False)


def _close(a, b):
    """Within fp32 rounding of sums of a few hundred terms, relative to the tensor's scale
    (elementwise tolerances fail on entries near 0, which are differences of large terms)."""
    return bool((a.double() - b.double()).abs().max() <= 1e-5 * max(1.0, b.double().abs().max()))


def _compare_with_old(kind, world, dtype, exact_bits):
    same = _same_bits if exact_bits else _close
    layout = make_layout(dtype)
    if kind == "acpsgd":
        comp = ACPSGD(rank=4)
        old = _Old(comp, _old_acpsgd)
    else:
        comp = PowerSGD(rank=4, start_iter=1)
        old = _Old(comp, _old_powersgd)
    new_states = [comp.init_state(layout) for _ in range(world)]
    old_states = [comp.init_state(layout) for _ in range(world)]
    for t in range(STEPS):
        grads = [gradient(layout, r, t) for r in range(world)]
        new_flats = [g.clone() for g in grads]
        old_flats = [g.clone() for g in grads]
        lockstep(comp, new_flats, new_states, layout)
        lockstep(old, old_flats, old_states, layout)
        for r in range(world):
            assert same(new_flats[r], old_flats[r]), f"output differs, rank {r}, step {t}"
            assert same(new_states[r].ef.residual, old_states[r].ef.residual), \
                f"residual differs, rank {r}, step {t}"
            if exact_bits:   # (else a column's sign may flip: QR's sign follows entries ~1e-8)
                assert same(new_states[r].p, old_states[r].p), f"P differs, rank {r}, step {t}"
                assert same(new_states[r].q, old_states[r].q), f"Q differs, rank {r}, step {t}"
            assert _same_bits(new_flats[r], new_flats[0]), f"replicas differ at step {t}"
        # a real reduction happened (not a no-op that trivially matches): the uncompressed
        # slots hold the average, the compressed ones an approximation that is not the input
        exact = torch.stack([g.double() for g in grads]).mean(0)
        plan = new_states[0].plan
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        for offset, numel in plan.runs:
            cut = slice(offset, offset + numel)
            assert torch.allclose(new_flats[0][cut].double(), exact[cut], rtol=tol, atol=tol)
        if t < comp.start_iter:
            continue
        g0 = plan.groups[0]
        cut = slice(g0.offsets[0], g0.offsets[0] + g0.n * g0.m)
        assert not torch.allclose(new_flats[0][cut].double(), exact[cut], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n,m,r", [(1, 1, 1), (37, 5, 3), (64, 203, 4), (130, 96, 9), (17, 40, 64)])
def test_native_lowrank_kernels_against_float64_and_a_fixed_order(n, m, r):
    """The native kernels one matrix at a time: P = M Q and Q = Mᵀ P within fp32 rounding of a
    float64 reference, the fused residual update equal to M − P Qᵀ likewise, and the product
    P Qᵀ bitwise equal to torch's own left-to-right ``p_i0·q_k0 + p_i1·q_k1 + …`` (separate
    multiplies and adds), which is what makes it the same on every CPU. NaN propagates; a rank
    above 64 or a zero size is refused."""
    from bitscom.kernels import cpu_native
    gen = torch.Generator().manual_seed(n * m + r)
    M = torch.randn(n, m, generator=gen)
    Q, P = torch.randn(m, r, generator=gen), torch.randn(n, r, generator=gen)
    bound = 1e-5 * max(1.0, float(m) ** 0.5, float(n) ** 0.5) * 4

    def close(a, b):
        return float((a.double() - b).abs().max()) <= bound * max(1.0, float(b.abs().max()))

    for transpose, factor in ((False, Q), (True, P)):
        want = (M.double().T if transpose else M.double()) @ factor.double()
        for subtract in (False, True):
            X, out = M.clone(), torch.empty(m if transpose else n, r)
            cpu_native.lowrank_project(X.data_ptr(), n, m, factor, out, transpose, subtract)
            assert close(out, want)
            p, q = (factor, out) if transpose else (out, factor)
            left = M.double() - p.double() @ q.double().T if subtract else M.double()
            assert close(X, left)
    out = torch.empty(n, m)
    cpu_native.lowrank_product(out.data_ptr(), n, m, P, Q)
    ordered = P[:, :1] * Q[:, 0][None]
    for j in range(1, r):
        ordered = ordered + P[:, j:j + 1] * Q[:, j][None]
    assert torch.equal(out.view(torch.int32), ordered.view(torch.int32))
    P[0, 0] = float("nan")
    cpu_native.lowrank_product(out.data_ptr(), n, m, P, Q)
    assert bool(out[0].isnan().all()) and (n == 1 or bool(out[1:].isfinite().all()))
    with pytest.raises(RuntimeError, match="native"):
        cpu_native.lowrank_product(out.data_ptr(), n, m, torch.zeros(n, 65), torch.zeros(m, 65))


@pytest.mark.parametrize("kind", ["acpsgd", "powersgd"])
def test_fused_compensate_gives_the_bits_of_the_separate_add(kind, monkeypatch):
    """With the native kernels, error feedback's ``x = e + g`` is added inside the projection
    pass for the matrices and separately everywhere else (uncompressed runs, gaps): outputs,
    residuals and factors are bitwise those of compensating the whole bucket first."""
    from bitscom.compressors.lowrank import LowRankPlan
    layout = make_layout(torch.float32)
    comp = ACPSGD(rank=4) if kind == "acpsgd" else PowerSGD(rank=4, start_iter=1)
    assert comp.plan(layout).native_compensate(comp.init_state(layout).ef,
                                               torch.zeros(layout.numel)) is not None

    def run():
        states = [comp.init_state(layout) for _ in range(2)]
        outs = []
        for t in range(STEPS):
            flats = [gradient(layout, r, t) for r in range(2)]
            lockstep(comp, flats, states, layout)
            outs.append([f.clone() for f in flats] + [s.ef.residual.clone() for s in states]
                        + [s.p.clone() for s in states] + [s.q.clone() for s in states])
        return outs

    fused = run()
    monkeypatch.setattr(LowRankPlan, "native_compensate", lambda self, ef, grad: None)
    separate = run()
    for a, b in zip(fused, separate):
        for x, y in zip(a, b):
            assert _same_bits(x, y)
