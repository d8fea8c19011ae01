"""MomentumCorrection (DGC's momentum correction and momentum factor masking).

References are independent float64 versions of the algorithm (Lin et al. 2018, Alg. 1 with
momentum correction and factor masking); simulated ranks check the arithmetic, gloo ranks
check DistributedOptimizer: replicas identical, torch's momentum SGD reproduced when nothing
is dropped, checkpoints resume, and every misuse (momentum twice, Adam, a DDP hook, Exclude
around it) is a clear error.
"""
import io
import warnings

import pytest
import torch
import torch.nn as nn

import bitscom
from bitscom.cost import sent_bytes
from bitscom.compressors import (ACPSGD, BucketLayout, Exclude, MomentumCorrection, SignSGD, TopK,
                                 get)
from simranks import lockstep

M = 0.9


def grads_at(step, world, numel):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(numel, generator=g) * (1 + r) for r in range(world)]


# ---------------------------------------------------------------- simulated ranks, float64 refs

def test_nothing_dropped_is_momentum_sgd_of_the_average():
    """TopK(ratio=1) without masking: the average of the ranks' velocities is the velocity of
    the averaged gradient, step after step."""
    world, numel = 3, 50
    comp = MomentumCorrection(TopK(ratio=1.0), momentum=M, masking=False)
    layout = BucketLayout.for_tensor(torch.zeros(numel))
    states = [comp.init_state(layout) for _ in range(world)]
    buf = torch.zeros(numel, dtype=torch.float64)
    for step in range(8):
        gs = grads_at(step, world, numel)
        flats = [g.clone() for g in gs]
        lockstep(comp, flats, states, layout)
        buf = M * buf + sum(g.double() for g in gs) / world
        for f in flats:
            torch.testing.assert_close(f.double(), buf, rtol=1e-6, atol=1e-6)


def _dgc_reference(grads_per_step, k, masking):
    """DGC in float64: u = m·u + g; v = v + u; send top-k of |v|; v, and (masking) u, zeroed
    where sent; the output is the average of what the ranks sent."""
    world, numel = len(grads_per_step[0]), grads_per_step[0][0].numel()
    u = [torch.zeros(numel, dtype=torch.float64) for _ in range(world)]
    v = [torch.zeros(numel, dtype=torch.float64) for _ in range(world)]
    outs = []
    for gs in grads_per_step:
        total = torch.zeros(numel, dtype=torch.float64)
        for r in range(world):
            u[r] = M * u[r] + gs[r].double()
            v[r] = v[r] + u[r]
            idx = v[r].abs().topk(k).indices
            total[idx] += v[r][idx]
            v[r][idx] = 0
            if masking:
                u[r][idx] = 0
        outs.append(total / world)
    return outs


@pytest.mark.parametrize("masking", [True, False])
def test_topk_matches_float64_dgc(masking):
    world, numel, ratio, steps = 2, 200, 0.1, 10
    comp = MomentumCorrection(TopK(ratio=ratio), momentum=M, masking=masking)
    layout = BucketLayout.for_tensor(torch.zeros(numel))
    states = [comp.init_state(layout) for _ in range(world)]
    grads = [grads_at(s, world, numel) for s in range(steps)]
    ref = _dgc_reference(grads, TopK(ratio=ratio).k_for(numel), masking)
    for step in range(steps):
        flats = [g.clone() for g in grads[step]]
        lockstep(comp, flats, states, layout)
        assert torch.equal(flats[0], flats[1])
        torch.testing.assert_close(flats[0].double(), ref[step], rtol=1e-5, atol=1e-5)
    if masking:     # factor masking zeroed the velocity wherever the last step sent
        sent = states[0].inner.last_sent
        assert sent is not None and bool((states[0].velocity[sent] == 0).all())


def test_masking_defaults_and_warm_up_keeps_momentum():
    assert MomentumCorrection().masking is False and isinstance(MomentumCorrection().inner, TopK)
    # dense warm-up steps send everything: masking must not wipe the velocity there
    comp = MomentumCorrection(TopK(ratio=0.1, start_iter=2), momentum=M, masking=True)
    layout = BucketLayout.for_tensor(torch.zeros(30))
    states = [comp.init_state(layout) for _ in range(2)]
    buf = torch.zeros(30, dtype=torch.float64)
    for step in range(2):
        gs = grads_at(step, 2, 30)
        flats = [g.clone() for g in gs]
        lockstep(comp, flats, states, layout)
        buf = M * buf + (gs[0].double() + gs[1].double()) / 2
        torch.testing.assert_close(flats[0].double(), buf, rtol=1e-6, atol=1e-6)
        assert bool((states[0].velocity != 0).all())


def test_nonfinite_gradient_is_visible_then_forgotten():
    comp = MomentumCorrection(SignSGD(), momentum=M)
    layout = BucketLayout.for_tensor(torch.zeros(64))
    states = [comp.init_state(layout) for _ in range(2)]
    gs = grads_at(0, 2, 64)
    gs[1][5] = float("inf")
    flats = [g.clone() for g in gs]
    lockstep(comp, flats, states, layout)
    assert not bool(torch.isfinite(flats[0]).all())          # AMP's GradScaler sees it
    assert all(bool(torch.isfinite(s.velocity).all()) for s in states)
    flats = [g.clone() for g in grads_at(1, 2, 64)]
    lockstep(comp, flats, states, layout)
    assert bool(torch.isfinite(flats[0]).all())


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"momentum.*\[0, 1\).*1\.0"):
        MomentumCorrection(momentum=1.0)
    with pytest.raises(ValueError, match="momentum"):
        MomentumCorrection(momentum=float("nan"))
    with pytest.raises(ValueError, match="masking=True.*SignSGD"):
        MomentumCorrection(SignSGD(), masking=True)
    with pytest.raises(ValueError, match="must not apply momentum"):
        MomentumCorrection(MomentumCorrection())
    with pytest.raises(ValueError, match="MomentumCorrection.*outside"):
        Exclude(MomentumCorrection(), patterns=("*.bias",))
    with pytest.raises(TypeError, match="masking"):
        MomentumCorrection(masking="yes")
    assert get("dgc") == MomentumCorrection(TopK())
    inner = Exclude(TopK(), patterns=("*.bias",))
    assert MomentumCorrection(inner).uses_names and not MomentumCorrection().uses_names
    layout = BucketLayout.for_tensor(torch.zeros(1000))
    assert sent_bytes(MomentumCorrection(ACPSGD()), layout, 2) == sent_bytes(ACPSGD(), layout, 2)


# ---------------------------------------------------------------- DistributedOptimizer, 1 process

def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step, rank=0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _train(model, opt, steps):
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_one_process_is_torch_momentum_sgd_and_checkpoints():
    """One process sends nothing, so nothing is compressed — but the momentum the SGD was
    built without must still be applied (bitwise torch's SGD with momentum, weight decay 0)."""
    ref_model = _net()
    ref = _train(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=M), range(6))

    def build():
        model = _net()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                               compression=MomentumCorrection(momentum=M))
        return model, opt

    model, opt = build()
    assert torch.equal(_train(model, opt, range(6)), ref)
    model, opt = build()
    _train(model, opt, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert torch.equal(_train(model, opt, range(3, 6)), ref)


def test_optimizer_misuse_is_refused():
    model = _net()
    comp = MomentumCorrection(momentum=M)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"momentum=0.*param group 0 has momentum=0\.9"):
            bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         compression=comp)
        with pytest.raises(TypeError, match="torch.optim.SGD.*Adam"):
            bitscom.DistributedOptimizer(torch.optim.Adam(model.parameters()), compression=comp)
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           compression=comp)
    # a scheduler (OneCycleLR cycles momentum) turning the SGD's momentum back on is caught
    opt.param_groups[0]["momentum"] = 0.85
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match="momentum=0.85"):
        opt.step()


# ---------------------------------------------------------------- gloo ranks

def _same_on_all_ranks(t):
    import torch.distributed as dist
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out)


def _gloo_dgc(rank, world):
    def run(comp, momentum, weight_decay, steps, model=None, opt=None):
        if model is None:
            model = _net()
            base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum,
                                   weight_decay=weight_decay)
            opt = bitscom.DistributedOptimizer(base, model.named_parameters(), compression=comp,
                                               fusion_threshold_mb=0.0005)
        flat = None
        for step in steps:
            x, y = _batch(step, rank)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            assert _same_on_all_ranks(flat), f"replicas differ after step {step}"
        return model, opt, flat

    # nothing dropped: momentum on each rank == momentum after the average (to fp32 rounding)
    _, _, exact = run("none", M, 0.0, range(8))
    _, _, mc = run(MomentumCorrection(TopK(ratio=1.0), masking=False), 0.0, 0.0, range(8))
    # weight decay λ' is applied outside the velocity: p -= lr·(avg u + λ'·p)
    _, _, mc_wd = run(MomentumCorrection(TopK(ratio=1.0), masking=False), 0.0, 0.05, range(8))
    model = _net()
    u = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    ps = [p.detach().double() for p in model.parameters()]
    for step in range(8):
        grads = []
        for r in range(world):
            m64 = _net()
            with torch.no_grad():
                for dst, src in zip(m64.parameters(), ps):
                    dst.copy_(src)
            x, y = _batch(step, r)
            nn.functional.mse_loss(m64(x), y).backward()
            grads.append([p.grad.double() for p in m64.parameters()])
        for i in range(len(ps)):
            u[i] = M * u[i] + sum(g[i] for g in grads) / world
            ps[i] = ps[i] - 0.05 * (u[i] + 0.05 * ps[i])
    ref_wd = torch.cat([p.reshape(-1) for p in ps])
    # DGC (top-k 20% with masking): bytes as promised, checkpoint resume bitwise
    comp = MomentumCorrection(TopK(ratio=0.2), masking=True)
    model, opt, straight = run(comp, 0.0, 0.01, range(6))
    sent = opt.comm_stats()["step_bytes_sent"]
    promised = sum(sent_bytes(comp, lay, world) for lay in opt.bucket_layouts)
    model, opt, _ = run(comp, 0.0, 0.01, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model2, opt2, _ = run(comp, 0.0, 0.01, [])
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _, _, resumed = run(comp, 0.0, 0.01, range(3, 6), model2, opt2)
    with pytest.raises(ValueError, match="DistributedOptimizer"):
        bitscom.ddp_comm_hook(comp)
    return ((mc - exact).abs().max().item(), (mc_wd.double() - ref_wd).abs().max().item(),
            sent == promised, torch.equal(resumed, straight))


def test_distributed_optimizer_dgc_on_gloo(pools):
    for diff, diff_wd, bytes_ok, resumed in pools.run(2, _gloo_dgc):
        assert diff < 1e-5, diff
        assert diff_wd < 1e-5, diff_wd
        assert bytes_ok and resumed
