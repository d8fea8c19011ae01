"""ZeroOneAdam against an independent float64 reference of 0/1 Adam (DeepSpeed's schedule:
exponentially spaced variance updates, 1-bit steps, local steps with a growing interval),
on 2 and 4 gloo ranks; replicas identical after every synchronization; exact resume."""

from __future__ import annotations

import pytest
import torch

from bitscom.onebit import ZeroOneAdam
from helpers import make_model
from bitscom.onebit import OneBitAdam
from test_onebit_adam import (BS, LR, RefCompressedAllReduce, _loss, _resume, _train, flat_params,
                              local_grads, set_flat)

SET = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)


def reference_zero_one(steps, world, var_freeze_step, var_update_scaler, local_step_scaler,
                       local_step_clipper, lr=LR, betas=(0.9, 0.999), eps=1e-8, wd=0.0,
                       bias_correction=False, force_sync=()):
    """Per-rank float64 replicas (local steps make them differ between synchronizations).
    With ``bias_correction``: torch's Adam step ``lr/bc1 * m / (sqrt(v/bc2) + eps)``, ``bc2``
    counting the variance updates; in the local phase ``lr/bc1`` is the step size that both
    the parameters and the accumulated ``lrs`` see. ``force_sync``: steps after which a
    synchronization happens off the schedule (``opt.sync()``), counters unchanged."""
    models = [make_model(seed=0).double() for _ in range(world)]
    n = flat_params(models[0]).numel()
    b1, b2 = betas
    m = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    u = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    v = torch.zeros(n, dtype=torch.float64)
    car = RefCompressedAllReduce(n, world)
    var_interval, var_counter, local_interval, local_counter, lrs = 1, 0, 1, 0, 0.0
    updates = 0
    history, synced = [], []
    for t in range(1, steps + 1):
        gs = [local_grads(models[r], t - 1, world)[r] for r in range(world)]
        ps = [flat_params(mod).clone() for mod in models]
        sync = True
        if t <= var_freeze_step:
            if t % var_interval == 0:
                g = sum(gs) / world
                v = b2 * v + (1 - b2) * g * g
                updates += 1
                m = [b1 * m[0] + (1 - b1) * g for _ in range(world)]
            else:
                g = car(gs)
                m = [b1 * m[0] + (1 - b1) * g for _ in range(world)]
            bc1, bc2 = (1 - b1 ** t, 1 - b2 ** updates) if bias_correction else (1.0, 1.0)
            ps = [p - lr * (m[0] / bc1 / ((v / bc2).sqrt() + eps) + wd * p) for p in ps]
            if t % var_interval == 0:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            if t == var_freeze_step + 1:             # residuals now hold u's error
                car = RefCompressedAllReduce(n, world)
            bc1, bc2 = (1 - b1 ** t, 1 - b2 ** updates) if bias_correction else (1.0, 1.0)
            den = (v / bc2).sqrt() + eps
            lrs += lr / bc1
            for r in range(world):
                m[r] = b1 * m[r] + (1 - b1) * gs[r]
                d = lr * (m[r] / bc1 / den + wd * ps[r])
                ps[r] = ps[r] - d
                u[r] = u[r] - d
            sync = t % local_interval == 0 or t in force_sync
            if sync:
                ps = [ps[r] - u[r] for r in range(world)]
                avg = car([u[r] * den for r in range(world)])
                m = [-avg / lrs for _ in range(world)]
                ps = [p + avg / den for p in ps]
                u = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
                lrs = 0.0
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
        for mod, p in zip(models, ps):
            set_flat(mod, p)
        history.append([p.clone() for p in ps])
        synced.append(sync)
    return history, synced


def make_zero_one(model):
    return ZeroOneAdam(model.parameters(), lr=LR, block_size=BS, bias_correction=False, **SET)


def make_zero_one_bc(model):
    return ZeroOneAdam(model.parameters(), lr=LR, block_size=BS, bias_correction=True, **SET)


def _run(rank, world, steps, bias_correction=False):
    _, opt, hist = _train(rank, world, steps, make_zero_one_bc if bias_correction else make_zero_one)
    return hist, opt.comm_stats()


@pytest.mark.parametrize("world,bias_correction", [(2, False), (4, False), (2, True), (4, True)])
def test_zero_one_adam_matches_the_float64_reference(pools, world, bias_correction):
    steps = 16
    results = pools.run(world, _run, steps, bias_correction, timeout=200)
    ref, synced = reference_zero_one(steps, world, bias_correction=bias_correction, **SET)
    assert not all(synced) and sum(synced) > steps // 2 - 2     # local steps happened
    for t in range(steps):
        for r in range(world):
            torch.testing.assert_close(results[r][0][t].double(), ref[t][r], rtol=1e-4, atol=2e-5,
                                       msg=f"step {t + 1} rank {r}")
            if synced[t]:
                assert torch.equal(results[r][0][t], results[0][0][t]), (t, r)
    stats = results[0][1]
    # variance updates at steps 1, 2 (interval 1), 4, 6 (interval 2): exact; 3, 5: 1-bit
    assert stats["exact_steps"] == 4
    assert stats["compressed_steps"] == 2 + sum(synced[6:])
    assert stats["compression_ratio"] > 1


@pytest.mark.parametrize("cut", [3, 6, 9])     # variance phase, boundary, between local steps
def test_zero_one_resume_is_bitwise_exact(pools, cut):
    results = pools.run(2, _resume, 13, cut, make_zero_one, timeout=150)
    assert all(ok for ok, _ in results)



@pytest.mark.parametrize("cut", [6, 9])
def test_bias_corrected_zero_one_resumes_bitwise(pools, cut):
    results = pools.run(2, _resume, 13, cut, make_zero_one_bc, timeout=150)
    assert all(ok for ok, _ in results)


def _run_with_sync(rank, world, bias_correction):
    """Steps 1-14; ``opt.sync()`` after step 4 (variance phase), 9 (between local-step
    synchronizations) and 10 (right after a scheduled one)."""
    model = make_model(seed=0)
    opt = (make_zero_one_bc if bias_correction else make_zero_one)(model)
    hist, before, noop = [], {}, {}
    for t in range(14):
        _loss(model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
        if t + 1 in (4, 9, 10):
            before[t + 1] = flat_params(model).clone()
            sent = opt.comm_stats()["bytes_sent"]
            opt.sync()
            noop[t + 1] = opt.comm_stats()["bytes_sent"] == sent
        hist.append(flat_params(model).clone())
    return hist, before, noop


@pytest.mark.parametrize("bias_correction", [False, True])
def test_sync_makes_replicas_identical_between_local_synchronizations(pools, bias_correction):
    """After the last step of a run that ends between 0/1 Adam's synchronizations the ranks
    hold different parameters (local steps); ``opt.sync()`` performs the synchronization
    early, equal to the float64 reference with one more synchronization there, and the
    schedule after it is unchanged."""
    results = pools.run(2, _run_with_sync, bias_correction, timeout=150)
    ref, synced = reference_zero_one(14, 2, bias_correction=bias_correction, force_sync=(9,), **SET)
    plain, plain_synced = reference_zero_one(14, 2, bias_correction=bias_correction, **SET)
    assert not plain_synced[8] and plain_synced[9]       # step 9 local, step 10 scheduled
    (h0, b0, n0), (h1, b1, n1) = results
    assert not torch.equal(b0[9], b1[9])                 # apart before sync()
    for t in range(14):
        assert torch.equal(h0[t], h1[t]) or not synced[t], t
        for r, h in enumerate((h0, h1)):
            torch.testing.assert_close(h[t].double(), ref[t][r], rtol=1e-4, atol=2e-5,
                                       msg=f"step {t + 1} rank {r}")
    assert torch.equal(h0[8], h1[8])                     # identical right after sync()
    # no-ops: in the variance phase and right after a scheduled synchronization
    for b, h, n in ((b0, h0, n0), (b1, h1, n1)):
        assert torch.equal(b[4], h[3]) and torch.equal(b[10], h[9])
        assert n[4] and n[10] and not n[9]


def test_onebit_adam_sync_is_a_no_op(pools):
    results = pools.run(2, _train_onebit_sync, timeout=100)
    assert all(results)


def _train_onebit_sync(rank, world):
    model = make_model(seed=0)
    opt = OneBitAdam(model.parameters(), lr=LR, freeze_step=2, block_size=BS)
    ok = True
    for t in range(5):
        _loss(model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
        p, sent = flat_params(model).clone(), opt.comm_stats()["bytes_sent"]
        opt.sync()
        ok &= torch.equal(p, flat_params(model)) and opt.comm_stats()["bytes_sent"] == sent
    return ok
