"""PowerSGD and ACP-SGD against an independent float64 reference of the published algorithms.

The reference below is written from the papers, not from bitscom's code (it imports nothing
of ``bitscom.compressors.lowrank``):

* PowerSGD (Vogels et al. 2019) as torch's ``powerSGD_hook`` runs it: M_i = G_i + E_i;
  Q̃ = orth(Q); P = orth(Σ_i M_i Q̃); Q_i = M_iᵀ P; Q = mean_i Q_i; output P Qᵀ; Q is kept
  (warm start). The residual is E_i = M_i − P Q_iᵀ (local Q_i, the paper's form and bitscom's);
  torch's hook keeps E_i = M_i − P Qᵀ (reduced Q). The two differ per rank but have the same
  sum, and only Σ_i M_i enters the factors, so their outputs agree in exact arithmetic
  (``test_residual_form_changes_residuals_not_outputs``).
* ACP-SGD (Zhang et al., ICDCS 2023; the authors' lzhangbv/acpsgd ``_alternative_compress``):
  the 1st, 3rd, … steps are P steps: Q̃ = orth(Q); P_i = M_i Q̃; E_i = M_i − P_i Q̃ᵀ;
  P = mean_i P_i; output P Q̃ᵀ; P is kept. The others are Q steps: P̃ = orth(P);
  Q_i = M_iᵀ P̃; E_i = M_i − P̃ Q_iᵀ; Q = mean_i Q_i; output P̃ Qᵀ; Q is kept.

Both start from the Q that bitscom draws: the bucket generator's state is captured before
the first step and replayed here (only that, and which slot a Q sits at, come from bitscom).
orth is float64 QR; outputs and residuals are functions of the factors' column spans only,
so the sign and method of the orthogonalization do not matter.

The simulated ranks run in one process: every rank's ``reduce`` generator is advanced in
lockstep and each round's all-reduce is completed by summing the ranks' buffers.

"The output is exact after one P and one Q step on rank ≤ r gradients" (a stale subspace
would break it) is checked in test_acpsgd.py (``test_exact_on_low_rank_without_error_feedback``,
and the cumulative check with error feedback), so it is not repeated here.
"""

from __future__ import annotations

import pytest
import torch

from bitscom.compressors import ACPSGD, PowerSGD
from bitscom.compressors.base import BucketLayout, TensorSlot
from simranks import lockstep

# two same-shaped matrices (a batch), a conv-like 4-D tensor (20 × 18), a matrix too small
# to shrink (sent uncompressed) and a bias, in one bucket
SHAPES = [(32, 24), (7,), (20, 2, 3, 3), (32, 24), (6, 5)]
STEPS = 8
EPS32 = torch.finfo(torch.float32).eps
# atol = SLACK · eps32 · max|M| per tensor. A float32 product with inner dimension k is off by
# ≲ k·eps·|M||Q| (k ≤ 36 here, |Q| ≤ 1), orthogonalization adds eps times the factor's
# condition number, and the residual carries each step's rounding into the next. The
# observed worst case is 19 (PowerSGD, r = 2, 3 ranks); 200 leaves a 10× margin and is still
# ≥ 10³ times below any algorithmic difference (asserted: the residual forms, compressed steps).
SLACK = 200


def make_layout() -> BucketLayout:
    slots, offset = [], 0
    for i, shape in enumerate(SHAPES):
        numel = torch.Size(shape).numel()
        slots.append(TensorSlot(f"t{i}", offset, numel, shape))
        offset += numel
    return BucketLayout(0, tuple(slots), torch.float32, torch.device("cpu"))


def gradient(layout, rank, step) -> torch.Tensor:
    """Full-rank Gaussian gradients, a different scale per tensor, float32."""
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 1)
    return torch.cat([torch.randn(s.numel, generator=g) * (1 + 3 * i)
                      for i, s in enumerate(layout.slots)])


# ---- the float64 reference ------------------------------------------------------------
def compressed(shape, rank, min_rate=2) -> bool:
    """torch's ``_should_compress`` on the (shape[0], -1) matrix view."""
    if len(shape) < 2:
        return False
    n = shape[0]
    m = torch.Size(shape).numel() // n
    return (n + m) * min(n, m, rank) * min_rate < n * m


def orth(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(x).Q


def reference_step(kind, t, ms, mem, local_residual=True):
    """One step on one tensor: ``ms`` the ranks' M_i = G_i + E_i as (n, m) float64 matrices,
    ``mem`` the factor memory {"p", "q"}; returns (output, [E_i])."""
    world = len(ms)
    if kind == "powersgd":
        q = orth(mem["q"])
        p = orth(sum(m @ q for m in ms))
        qs = [m.T @ p for m in ms]
        mem["q"] = sum(qs) / world
        out = p @ mem["q"].T
        res = [m - p @ qi.T for m, qi in zip(ms, qs)]
    elif t % 2 == 0:                                  # ACP-SGD P step
        q = orth(mem["q"])
        ps = [m @ q for m in ms]
        mem["p"] = sum(ps) / world
        out = mem["p"] @ q.T
        res = [m - pi @ q.T for m, pi in zip(ms, ps)]
    else:                                             # ACP-SGD Q step
        p = orth(mem["p"])
        qs = [m.T @ p for m in ms]
        mem["q"] = sum(qs) / world
        out = p @ mem["q"].T
        res = [m - p @ qi.T for m, qi in zip(ms, qs)]
    if not local_residual:                            # torch's hook: E_i = M_i − output
        res = [m - out for m in ms]
    return out, res


def reference_run(kind, layout, rank, grads, q0, local_residual=True):
    """``grads[t][i]`` rank i's flat gradient of step t; ``q0`` the initial Q per slot
    offset. Returns per step (output, [residual_i], [max|M_i| per slot]) as flat float64."""
    world = len(grads[0])
    res = [torch.zeros(layout.numel, dtype=torch.float64) for _ in range(world)]
    mem = {s.offset: {"q": q0[s.offset].double()} for s in layout.slots
           if compressed(s.shape, rank)}
    history = []
    for t, gs in enumerate(grads):
        xs = [g.double() + e for g, e in zip(gs, res)]
        out = torch.empty(layout.numel, dtype=torch.float64)
        res = [torch.zeros(layout.numel, dtype=torch.float64) for _ in range(world)]
        scale = torch.empty(layout.numel, dtype=torch.float64)
        for s in layout.slots:
            cut = slice(s.offset, s.end)
            scale[cut] = max(float(x[cut].abs().max()) for x in xs)
            if s.offset not in mem:                   # sent exactly, nothing left over
                out[cut] = sum(x[cut] for x in xs) / world
                continue
            ms = [x[cut].view(s.shape[0], -1) for x in xs]
            o, es = reference_step(kind, t, ms, mem[s.offset], local_residual)
            out[cut] = o.reshape(-1)
            for e, ei in zip(res, es):
                e[cut] = ei.reshape(-1)
        history.append((out, [e.clone() for e in res], scale))
    return history


def initial_q(state, rank) -> dict:
    """The Q bitscom draws on its first step (``randn`` of the fused Q size from the bucket
    generator), cut into one (m, r) matrix per compressed slot."""
    gen = torch.Generator()
    gen.set_state(state.generator.get_state())
    plan = state.plan
    draw = torch.randn(plan.q_numel, generator=gen, dtype=torch.float32)
    q0 = {}
    for g in plan.groups:
        for b, offset in enumerate(g.offsets):
            at = g.q_offset + b * g.m * g.r
            q0[offset] = draw[at:at + g.m * g.r].view(g.m, g.r)
    assert sorted(q0) == sorted(s.offset for s in make_layout().slots if compressed(s.shape, rank))
    return q0


# ---- bitscom's compressors, N ranks in one process ------------------------------------
def run_bitscom(comp, world):
    layout = make_layout()
    states = [comp.init_state(layout) for _ in range(world)]
    q0 = initial_q(states[0], comp.rank)
    grads, history = [], []
    for t in range(STEPS):
        gs = [gradient(layout, r, t) for r in range(world)]
        flats = [g.clone() for g in gs]
        lockstep(comp, flats, states, layout)
        for f in flats[1:]:
            assert torch.equal(f, flats[0]), f"ranks differ at step {t}"
        grads.append(gs)
        history.append((flats[0].double(), [s.ef.residual.double().clone() for s in states]))
    return layout, grads, q0, history


# ---- the tests --------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("rank", [2, 4])
@pytest.mark.parametrize("kind", ["powersgd", "acpsgd"])
def test_matches_float64_reference_every_step(kind, rank, world):
    cls = PowerSGD if kind == "powersgd" else ACPSGD
    comp = cls(rank=rank, start_iter=0, error_feedback=True, warm_start=True)
    layout, grads, q0, got = run_bitscom(comp, world)
    ref = reference_run(kind, layout, rank, grads, q0)
    worst = 0.0
    for t, ((out, res), (ref_out, ref_res, scale)) in enumerate(zip(got, ref)):
        atol = SLACK * EPS32 * scale
        worst = max(worst, float(((out - ref_out).abs() / (EPS32 * scale)).max()))
        assert torch.all((out - ref_out).abs() <= atol), f"output differs at step {t}"
        for i, (e, ref_e) in enumerate(zip(res, ref_res)):
            worst = max(worst, float(((e - ref_e).abs() / (EPS32 * scale)).max()))
            assert torch.all((e - ref_e).abs() <= atol), f"residual of rank {i} differs at step {t}"
        # the test has teeth: a compressed step is far from the plain average
        assert float((out - sum(g.double() for g in grads[t]) / world).abs().max()) > 1e3 * float(atol.max())
    print(f"{kind} r={rank} N={world}: worst |bitscom − ref| = {worst:.1f} eps32·max|M|")


@pytest.mark.parametrize("kind", ["powersgd", "acpsgd"])
def test_residual_form_changes_residuals_not_outputs(kind):
    """E_i from the local factor (paper, bitscom) or from the reduced output (torch's hook):
    the same outputs, so bitscom's PowerSGD runs torch's trajectory; different per-rank
    residuals, so the residual comparison above can tell the two forms apart."""
    world, rank = 2, 2
    layout = make_layout()
    state = (PowerSGD if kind == "powersgd" else ACPSGD)(rank=rank).init_state(layout)
    q0 = initial_q(state, rank)
    grads = [[gradient(layout, r, t) for r in range(world)] for t in range(STEPS)]
    local = reference_run(kind, layout, rank, grads, q0, local_residual=True)
    reduced = reference_run(kind, layout, rank, grads, q0, local_residual=False)
    for (out_l, res_l, scale), (out_r, res_r, _) in zip(local, reduced):
        assert torch.all((out_l - out_r).abs() <= 1e-9 * scale)
        assert torch.allclose(sum(res_l), sum(res_r), atol=1e-9 * float(scale.max()))
    assert (res_l[0] - res_r[0]).abs().max() > 1e3 * SLACK * EPS32 * scale.max()
