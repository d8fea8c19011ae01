"""DiLoCo: parity with a float64 reference of the algorithm written here, the compressed path
against the compressor run directly, replicas, exact resume, accumulation, GradScaler with an
overflow on one rank, periodic model averaging, errors and cross-rank agreement."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import bitscom
from bitscom.cost import sent_bytes
from bitscom.compressors import get
from bitscom.compressors.base import Comm, drive
from bitscom.diloco import DiLoCo, DiLoCoConfig
from bitscom.diloco.fragments import split_fragments
from helpers import global_batch, make_model, shard


def _inner(kind, params, lr):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.5)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def _loss(model, step, rank, world, per_rank=4):
    x, y = global_batch(step, world, per_rank)
    x, y = shard(x, rank, world), shard(y, rank, world)
    dtype = next(model.parameters()).dtype
    return nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))


def _build(kind="adamw", dtype=torch.float32, lr=0.05, **kw):
    model = make_model(seed=0).to(dtype)
    opt = DiLoCo(_inner(kind, model.parameters(), lr), model.named_parameters(), **kw)
    return model, opt


def _train(rank, world, steps, kind="adamw", dtype=torch.float32, passes=1, **kw):
    """Run DiLoCo; per step: this rank's parameters and θ_global (names in registration order)."""
    model, opt = _build(kind, dtype, **kw)
    hist = []
    for t in range(steps):
        for k in range(passes):
            (_loss(model, t * passes + k, rank, world) / passes).backward()
        opt.step()
        opt.zero_grad()
        hist.append(([p.detach().clone() for p in model.parameters()],
                     [g.detach().clone() for g in opt.global_parameters]))
    frags = [[s.name for b in m for s in opt.bucket_layouts[b].slots] for m in opt.fragment_buckets]
    return hist, opt.comm_stats(), frags


def _reference(world, steps, kind, H, frags, outer_lr, mom, nesterov, passes=1, lr=0.05, skip=(),
               warmup=0):
    """DiLoCo written out in float64: ``world`` replicas, inner steps, exact pseudo-gradient
    mean, outer (Nesterov) momentum by hand. ``skip``: (rank, step) inner steps not taken.
    ``warmup``: the first steps average the gradients over the replicas before every replica's
    inner step (post-local SGD); the local schedule counts from the step after."""
    base = make_model(seed=0).double()
    names = [n for n, _ in base.named_parameters()]
    models = [copy.deepcopy(base) for _ in range(world)]
    inners = [_inner(kind, m.parameters(), lr) for m in models]
    glob = {n: p.detach().clone() for n, p in base.named_parameters()}
    buf = {}
    offsets = [(i * H) // len(frags) for i in range(len(frags))]
    out = []
    for t in range(1, steps + 1):
        for r, (m, o) in enumerate(zip(models, inners)):
            o.zero_grad()
            for k in range(passes):
                (_loss(m, (t - 1) * passes + k, r, world) / passes).backward()
        if t <= warmup:
            for ps in zip(*(m.parameters() for m in models)):
                mean = sum(p.grad for p in ps) / world
                for p in ps:
                    p.grad = mean.clone()
        for r, o in enumerate(inners):
            if (r, t) not in skip:
                o.step()
        if t <= warmup:
            glob = {n: p.detach().clone() for n, p in models[0].named_parameters()}
            out.append([[dict(m.named_parameters())[n].detach().clone() for n in names]
                        for m in models])
            continue
        for f, members in enumerate(frags):
            if t - warmup < 1 or (t - warmup - offsets[f]) % H:
                continue
            for n in members:
                locs = [dict(m.named_parameters())[n] for m in models]
                delta = sum(glob[n] - p.detach() for p in locs) / world
                buf[n] = delta.clone() if n not in buf else mom * buf[n] + delta
                glob[n] = glob[n] - outer_lr * (delta + mom * buf[n] if nesterov else buf[n])
                with torch.no_grad():
                    for p in locs:
                        p.copy_(glob[n])
        out.append([[dict(m.named_parameters())[n].detach().clone() for n in names]
                    for m in models])
    return out


def _check_replicas(results, frags, names, H, steps):
    """θ_global identical on every rank at every step; a fragment's local parameters identical
    on every rank right after its outer step."""
    offsets = [(i * H) // len(frags) for i in range(len(frags))]
    for t in range(steps):
        for r in range(1, len(results)):
            for a, b in zip(results[0][0][t][1], results[r][0][t][1]):
                assert torch.equal(a, b), f"θ_global differs on rank {r} at step {t + 1}"
            for f, members in enumerate(frags):
                if (t + 1 - offsets[f]) % H:
                    continue
                for n in members:
                    i = names.index(n)
                    assert torch.equal(results[0][0][t][0][i], results[r][0][t][0][i]), \
                        f"{n} differs on rank {r} after the outer step at {t + 1}"


NAMES = [n for n, _ in make_model(seed=0).named_parameters()]


@pytest.mark.parametrize("world,kind,H,F,passes,outer", [
    (2, "adamw", 4, 1, 1, (0.7, 0.9, True)),
    (2, "sgd", 3, 1, 2, (0.7, 0.9, True)),            # gradient accumulation
    (2, "adamw", 4, 2, 1, (0.5, 0.8, False)),         # streaming, plain momentum
    (4, "adamw", 4, 3, 1, (0.7, 0.9, True)),
])
def test_exact_path_matches_float64_reference(pools, world, kind, H, F, passes, outer):
    steps = 3 * H + 1
    lr, mom, nest = outer
    res = pools.run(world, _train, steps, kind, torch.float64, passes, sync_every=H,
                    compression=None, outer_lr=lr, outer_momentum=mom, nesterov=nest, fragments=F,
                    timeout=150)
    frags = res[0][2]
    assert len(frags) == F and sorted(sum(frags, [])) == sorted(NAMES)
    ref = _reference(world, steps, kind, H, frags, lr, mom, nest, passes)
    for t in range(steps):
        for r in range(world):
            for n, got, want in zip(NAMES, res[r][0][t][0], ref[t][r]):
                assert torch.allclose(got, want, rtol=1e-11, atol=1e-13), \
                    f"rank {r} step {t + 1} {n}: max err {(got - want).abs().max():.3g}"
    _check_replicas(res, frags, NAMES, H, steps)
    stats = res[0][1]
    per_step = sum(p.numel() for p in make_model().parameters()) * 4
    assert stats["dense_bytes"] == steps * per_step
    assert stats["fragment_syncs"] == sum(len(DiLoCoConfig(H, fragments=F).due(t))
                                          for t in range(1, steps + 1))
    if F == 1:   # exact fp32-equivalent bytes: one model-sized all-reduce (float64: 2×) per H steps
        assert stats["bytes_sent"] == (steps // H) * per_step * 2


@pytest.mark.parametrize("world,kind,H,F,W,passes", [
    (2, "adamw", 4, 1, 3, 1),
    (2, "sgd", 3, 2, 4, 2),                           # streaming + accumulation after a warm-up
    (4, "adamw", 4, 2, 2, 1),
])
def test_warmup_matches_float64_reference(pools, world, kind, H, F, W, passes):
    """Post-local SGD: W steps of exact gradient averaging (every replica identical, θ_global
    = the parameters), then DiLoCo whose schedule starts after step W."""
    steps = W + 2 * H + 1
    res = pools.run(world, _train, steps, kind, torch.float64, passes, sync_every=H,
                    compression=None, fragments=F, warmup_steps=W, timeout=150)
    frags = res[0][2]
    ref = _reference(world, steps, kind, H, frags, 0.7, 0.9, True, passes, warmup=W)
    for t in range(steps):
        for r in range(world):
            for n, got, want in zip(NAMES, res[r][0][t][0], ref[t][r]):
                assert torch.allclose(got, want, rtol=1e-11, atol=1e-13), \
                    f"rank {r} step {t + 1} {n}: max err {(got - want).abs().max():.3g}"
            if t < W:     # S-SGD during the warm-up: parameters = θ_global, identical everywhere
                for p, q in zip(res[r][0][t][0], res[0][0][t][0]):
                    assert torch.equal(p, q), f"rank {r} differs from rank 0 in warm-up step {t + 1}"
    # without the warm-up the same run is different (the warm-up is not a no-op)
    plain = _reference(world, steps, kind, H, frags, 0.7, 0.9, True, passes)
    assert not torch.allclose(plain[-1][0][0], ref[-1][0][0], rtol=1e-6)
    stats = res[0][1]
    per_step = sum(p.numel() for p in make_model().parameters()) * 4
    assert stats["warmup_syncs"] == W and stats["inner_steps"] == steps
    assert stats["dense_bytes"] == steps * per_step
    if F == 1:   # float64 exact: a model-sized all-reduce per warm-up step and per H local steps
        assert stats["syncs"] == (steps - W) // H
        assert stats["bytes_sent"] == (W + (steps - W) // H) * per_step * 2


def _final_sync(rank, world, steps, H, F):
    model, opt = _build("adamw", torch.float64, sync_every=H, compression=None, outer_lr=1.0,
                        outer_momentum=0.0, nesterov=False, fragments=F)
    for t in range(steps):
        _loss(model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    syncs = opt.comm_stats()["syncs"]
    opt.sync()
    return before, [p.detach().clone() for p in model.parameters()], syncs, opt.comm_stats()


@pytest.mark.parametrize("F", [1, 2])
def test_sync_averages_the_partial_interval(pools, F):
    """opt.sync() after a step off the schedule: with plain averaging the model becomes the
    mean of the ranks' local models (computed here in float64), identical on every rank."""
    H, steps = 4, 7                   # past every fragment's last scheduled sync (F=2: 4 and 6)
    res = pools.run(2, _final_sync, steps, H, F)
    for i, n in enumerate(NAMES):
        mean = (res[0][0][i] + res[1][0][i]) / 2
        assert not torch.equal(res[0][0][i], res[1][0][i]), f"{n}: ranks had not drifted"
        for r in range(2):
            assert torch.allclose(res[r][1][i], mean, rtol=1e-12, atol=1e-14), f"rank {r} {n}"
            assert torch.equal(res[r][1][i], res[0][1][i])
    assert res[0][3]["syncs"] == res[0][2] + 1
    assert res[0][3]["bytes_sent"] > 0


def _sync_after_sync(rank, world, steps, F):
    """sync() right after a scheduled synchronization (4-bit lowbit, the default)."""
    model, opt = _build("adamw", sync_every=4, fragments=F)
    for t in range(steps):
        _loss(model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
    before, params = opt.comm_stats(), [p.detach().clone() for p in model.parameters()]
    glob = [g.clone() for g in opt.global_parameters]
    opt.sync()
    after = opt.comm_stats()
    moved = [n for (n, p), q in zip(model.named_parameters(), params) if not torch.equal(p, q)]
    glob_same = all(torch.equal(a, b) for a, b in zip(glob, opt.global_parameters))
    return before, after, moved, glob_same, [p.detach().clone() for p in model.parameters()]


def test_sync_right_after_a_synchronization_is_a_no_op(pools):
    """Issue 35: after step 8 with H=4 every parameter is θ_global already; sync() used to
    run a whole extra synchronization (an outer step on a zero pseudo-gradient, which the
    outer momentum still moves, and its bytes)."""
    for before, after, moved, glob_same, _ in pools.run(2, _sync_after_sync, 8, 1):
        for k in ("bytes_sent", "syncs", "fragment_syncs"):
            assert after[k] == before[k], (k, before[k], after[k])
        assert not moved and glob_same


def test_sync_after_a_fragment_synchronization_syncs_only_the_stale_fragment(pools):
    """F=2, H=4: fragment 0 synchronized after step 8, fragment 1 after step 6; sync() after
    step 8 synchronizes fragment 1 only (its bytes alone), fragment 0 stays as it was."""
    res = pools.run(2, _sync_after_sync, 8, 2)
    before, after, moved, _, _ = res[0]
    assert after["fragment_syncs"] == before["fragment_syncs"] + 1
    assert after["syncs"] == before["syncs"] + 1
    frag1 = [s.name for s in _single(fragments=2).bucket_layouts[-1].slots]
    assert moved and set(moved) <= set(frag1), moved
    f1_sync = pools.run(2, _sync_after_sync, 6, 2)[0][0]["step_bytes_sent"]   # step 6: fragment 1
    assert after["bytes_sent"] - before["bytes_sent"] == f1_sync > 0
    for a, b in zip(res[0][4], res[1][4]):
        assert torch.equal(a, b)


def _sync_out_of_step(rank, world):
    model, opt = _build("adamw", sync_every=4)
    for t in range(8 + rank):                   # rank 1 runs one step more (not a sync step)
        _loss(model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"DiLoCo.sync\(\) point.*inner steps") as err:
        opt.sync()
    return str(err.value)


def test_sync_after_different_steps_is_an_error_on_every_rank(pools):
    """Rank 0 would have nothing to do and rank 1 a reduction to run: without the check rank 1
    would wait forever; with it both raise the same error."""
    msgs = pools.run(2, _sync_out_of_step)
    assert msgs[0] == msgs[1] and "8" in msgs[0] and "9" in msgs[0], msgs


def _direct(rank, world, steps, H, F, settings):
    """DiLoCo with lowbit next to the same algorithm written with the compressor driven
    directly (own compressor states): the parameters must agree bitwise at every step."""
    comp = get("lowbit", **settings)
    model, opt = _build("adamw", sync_every=H, compression=comp, fragments=F)
    twin = make_model(seed=0)
    inner = _inner("adamw", twin.parameters(), 0.05)
    tw = dict(twin.named_parameters())
    layouts = opt.bucket_layouts
    states = [comp.init_state(l) for l in layouts]
    glob = [torch.cat([tw[s.name].detach().reshape(-1) for s in l.slots]) for l in layouts]
    buf = [None] * len(layouts)
    group = bitscom.runtime.world_group()
    hist = []
    for t in range(1, steps + 1):
        for m, o in ((model, opt), (twin, inner)):
            _loss(m, t - 1, rank, world).backward()
            o.step()
            o.zero_grad()
        for f in DiLoCoConfig(H, fragments=F).due(t):
            for b in opt.fragment_buckets[f]:
                l = layouts[b]
                flat = glob[b] - torch.cat([tw[s.name].detach().reshape(-1) for s in l.slots])
                comm = Comm(group)
                drive(comp.reduce(flat, l, states[b], comm), comm)
                buf[b] = flat.clone() if buf[b] is None else buf[b].mul(0.9).add(flat)
                glob[b] = glob[b].add(flat.add(buf[b], alpha=0.9), alpha=-0.7)
                with torch.no_grad():
                    for s in l.slots:
                        tw[s.name].copy_(glob[b][s.offset:s.end].view(s.shape))
        for (n, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), f"step {t}: {n} differs from the compressor run directly"
        hist.append(([p.detach().clone() for p in model.parameters()],
                     [g.detach().clone() for g in opt.global_parameters]))
    synced = [layouts[b] for t in range(1, steps + 1) for f in DiLoCoConfig(H, fragments=F).due(t)
              for b in opt.fragment_buckets[f]]
    wire = sum(sent_bytes(comp, l, world) for l in synced)
    frags = [[s.name for b in m for s in layouts[b].slots] for m in opt.fragment_buckets]
    return hist, opt.comm_stats(), wire, sum(l.numel * 4 for l in synced), frags


@pytest.mark.parametrize("world,F", [(2, 1), (2, 2), (4, 2)])
def test_lowbit_path_matches_compressor_run_directly(pools, world, F):
    H, steps = 4, 9
    res = pools.run(world, _direct, steps, H, F, {"bitwidth": 4, "error_feedback": True})
    stats = res[0][1]
    assert stats["syncs"] >= 2 and stats["bytes_sent"] == res[0][2], stats
    if world == 2:   # (on 4 ranks, shards of these 56/99-element buckets are padded to blocks)
        assert stats["bytes_sent"] < res[0][3], stats     # vs exact fp32 pseudo-gradients
    _check_replicas(res, res[0][4], NAMES, H, steps)
    exact = pools.run(world, _train, steps, "adamw", torch.float32, 1, sync_every=H,
                      compression=None, fragments=F)
    assert any(not torch.equal(a, b) for a, b in zip(res[0][0][-1][0], exact[0][0][-1][0])), \
        "4-bit pseudo-gradients gave the exact result: the compressor was not used"


def _resume(rank, world, total, cut, path, warmup=0):
    kw = dict(sync_every=4, fragments=2, compression=bitscom.compressors.LowBit(
        bitwidth=4, error_feedback=True), warmup_steps=warmup)
    model, opt = _build("adamw", **kw)
    for t in range(total):
        _loss(model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
        if t + 1 == cut:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}.{rank}")
    straight = [p.detach().clone() for p in model.parameters()], opt.comm_stats()
    model, opt = _build("adamw", lr=0.3, **kw)          # a different lr: the checkpoint restores it
    ckpt = torch.load(f"{path}.{rank}", weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    for t in range(cut, total):
        _loss(model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
    resumed = [p.detach().clone() for p in model.parameters()], opt.comm_stats()
    return straight, resumed, [g.clone() for g in opt.global_parameters]


@pytest.mark.parametrize("cut,warmup", [(5, 0), (8, 0),   # mid-interval (no sync at 5), after one
                                       (2, 3), (3, 3)])   # inside the warm-up, at its last step
def test_resume_is_bitwise(pools, tmp_path, cut, warmup):
    res = pools.run(2, _resume, 13, cut, str(tmp_path / "ckpt"), warmup)
    for r, (straight, resumed, _glob) in enumerate(res):
        for a, b in zip(straight[0], resumed[0]):
            assert torch.equal(a, b), f"rank {r}: resumed run differs"
        assert straight[1] == resumed[1], (straight[1], resumed[1])
    for a, b in zip(res[0][2], res[1][2]):
        assert torch.equal(a, b)


def _scaler(rank, world, steps, bad_step, bad_rank, unscale, warmup=0):
    model, opt = _build("sgd", sync_every=3, compression=None, warmup_steps=warmup)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for t in range(1, steps + 1):
        scaler.scale(_loss(model, t - 1, rank, world)).backward()
        if t == bad_step and rank == bad_rank:
            model.fc2.weight.grad[0, 0] = float("inf")        # an overflow on this rank only
        if unscale:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt.comm_stats(), scaler.get_scale()


@pytest.mark.parametrize("unscale", [False, True])
def test_grad_scaler_overflow_on_one_rank_keeps_ranks_in_step(pools, unscale):
    steps, bad = 8, 2
    res = pools.run(2, _scaler, steps, bad, 1, unscale, timeout=120)
    assert [r[1]["skipped_inner_steps"] for r in res] == [0, 1]
    assert res[0][1]["syncs"] == res[1][1]["syncs"] == steps // 3
    assert res[1][2] < res[0][2]                          # rank 1's scaler backed off
    ref = _reference(2, steps, "sgd", 3, [NAMES], 0.7, 0.9, True, lr=0.05, skip={(1, bad)})
    for r in range(2):
        for n, got, want in zip(NAMES, res[r][0], ref[-1][r]):
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6), \
                f"rank {r} {n}: max err {(got.double() - want).abs().max():.3g}"
    ok = _reference(2, steps, "sgd", 3, [NAMES], 0.7, 0.9, True, lr=0.05)
    assert not torch.allclose(ok[-1][1][0], ref[-1][1][0], rtol=1e-5, atol=1e-6)  # skip mattered


def test_grad_scaler_overflow_in_warmup_skips_on_every_rank(pools):
    """In the warm-up the gradients are averaged, so an overflow on one rank reaches every
    rank: all skip that step (as under DDP) and the replicas stay identical."""
    steps, bad, warmup = 8, 2, 3
    res = pools.run(2, _scaler, steps, bad, 1, False, warmup, timeout=120)
    assert [r[1]["skipped_inner_steps"] for r in res] == [1, 1]
    assert res[0][1]["syncs"] == res[1][1]["syncs"] == (steps - warmup) // 3
    ref = _reference(2, steps, "sgd", 3, [NAMES], 0.7, 0.9, True, lr=0.05,
                     skip={(0, bad), (1, bad)}, warmup=warmup)
    for r in range(2):
        for n, got, want in zip(NAMES, res[r][0], ref[-1][r]):
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6), \
                f"rank {r} {n}: max err {(got.double() - want).abs().max():.3g}"
    assert all(torch.isfinite(p).all() for r in res for p in r[0])


def _averager(rank, world, steps, H):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    model, opt = _build("sgd", torch.float64, sync_every=H, compression=None, outer_lr=1.0,
                        outer_momentum=0.0, nesterov=False)
    twin = make_model(seed=0).double()
    inner = _inner("sgd", twin.parameters(), 0.05)
    averager = PeriodicModelAverager(period=H, warmup_steps=H - 1)
    for t in range(steps):
        for m, o in ((model, opt), (twin, inner)):
            _loss(m, t, rank, world).backward()
            o.step()
        averager.average_parameters(twin.parameters())   # averages parameters that have grads
        opt.zero_grad()
        inner.zero_grad()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.allclose(p, q, rtol=1e-12, atol=1e-14), f"step {t + 1}"
    return True


def test_outer_lr_one_no_momentum_is_periodic_model_averaging(pools):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert all(pools.run(2, _averager, 9, 3))


def _nan(rank, world, comp):
    model, opt = _build("sgd", sync_every=2, compression=comp)
    caught = []
    for t in range(2):
        _loss(model, t, rank, world).backward()
        if t == 1 and rank == 0:
            with torch.no_grad():
                model.fc3.bias[0] = float("nan")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.step()
        caught += [str(x.message) for x in w]
        opt.zero_grad()
    return bool(torch.isnan(model.fc3.bias).any()), opt.comm_stats()["nonfinite_syncs"], caught


@pytest.mark.parametrize("comp", [None, "lowbit"])
def test_nan_is_visible_on_every_rank(pools, comp):
    for has_nan, count, caught in pools.run(2, _nan, comp):
        assert has_nan and count == 1
        assert any("NaN/Inf" in m for m in caught)


def _disagree(rank, world, which):
    kw = {"sync_every": 4}
    if rank == 1:
        kw = {"sync_every": 8} if which == "setting" else {"sync_every": 0}
    try:
        _build("adamw", **kw)
    except (RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("which", ["setting", "bad value"])
def test_settings_disagreement_errors_on_every_rank(pools, which):
    msgs = pools.run(2, _disagree, which)
    for m in msgs:
        assert "RuntimeError" in m and "DiLoCo settings" in m, m
        assert ("sync_every=8" in m) if which == "setting" else ("sync_every must be" in m), m


def _stale(rank, world, path):
    model, opt = _build("adamw", sync_every=2)
    for t in range(3):
        _loss(model, t, rank, world).backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 or t == 1:
            torch.save(opt.state_dict(), f"{path}.{rank}")   # rank 1's file is one step older
    opt.load_state_dict(torch.load(f"{path}.{rank}", weights_only=False))
    _loss(model, 3, rank, world).backward()
    with pytest.raises(RuntimeError, match="DiLoCo resumed state"):
        opt.step()
    return True


def test_stale_checkpoint_on_one_rank_is_an_error_everywhere(pools, tmp_path):
    assert all(pools.run(2, _stale, str(tmp_path / "s")))


# ---------------------------------------------------------------- no ranks needed

def test_schedule_and_fragment_split():
    cfg = DiLoCoConfig(sync_every=4, fragments=2)
    assert [t for t in range(1, 13) if cfg.due(t)] == [2, 4, 6, 8, 10, 12]
    assert cfg.due(4) == [0] and cfg.due(6) == [1]
    assert [t for t in range(1, 10) if DiLoCoConfig(sync_every=3).due(t)] == [3, 6, 9]
    warm = DiLoCoConfig(sync_every=4, fragments=2, warmup_steps=5)
    assert [t for t in range(1, 16) if warm.in_warmup(t)] == [1, 2, 3, 4, 5]
    assert [t for t in range(1, 16) if warm.due(t)] == [7, 9, 11, 13, 15]
    assert warm.due(9) == [0] and warm.due(7) == [1]
    named = list(make_model(seed=0).named_parameters())
    for F in range(1, len(named) + 1):
        runs = split_fragments(named, F)
        assert len(runs) == F and all(runs) and sum(runs, []) == named


def _single(**kw):
    model = make_model(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DiLoCo(torch.optim.AdamW(model.parameters()), model.named_parameters(), **kw)


@pytest.mark.parametrize("kw,err,match", [
    ({"sync_every": 0}, ValueError, "sync_every must be an int >= 1, got 0"),
    ({"fragments": 7}, ValueError, "fragments=7 is more than the 6 trainable"),
    ({"outer_lr": -0.1}, ValueError, "outer_lr must be a finite number >= 0, got -0.1"),
    ({"outer_momentum": 1.0}, ValueError, r"outer_momentum must be a finite number in \[0, 1\), got 1.0"),
    ({"outer_momentum": 0.0}, ValueError, "nesterov=True needs outer_momentum > 0"),
    ({"compression": "nope"}, ValueError, "unknown compressor"),
    ({"warmup_steps": -1}, ValueError, "warmup_steps must be an int >= 0, got -1"),
    ({"warmup_steps": 2.5}, ValueError, "warmup_steps must be an int >= 0, got 2.5"),
])
def test_bad_settings(kw, err, match):
    with pytest.raises(err, match=match):
        _single(**kw)


def test_wrapping_is_refused():
    model = make_model(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = _single()
        with pytest.raises(TypeError, match="cannot be wrapped in bitscom.DistributedOptimizer"):
            bitscom.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        dopt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
        with pytest.raises(TypeError, match="DiLoCo's inner steps are local"):
            DiLoCo(dopt, model.named_parameters())


def test_built_before_init_is_an_error(monkeypatch):
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"DiLoCo was used before bitscom.init\(\).*2 processes"):
        _single()


def test_single_process_runs_and_counts():
    opt = _single(sync_every=2, compression=None)
    model_params = opt.param_groups[0]["params"]
    for _ in range(4):
        for p in model_params:
            p.grad = torch.ones_like(p)
        opt.step()
    stats = opt.comm_stats()
    assert stats["syncs"] == 2 and stats["bytes_sent"] == 0 and stats["inner_steps"] == 4


def test_default_compression_and_checkpoint_ownership():
    from bitscom.diloco import DEFAULT_COMPRESSION
    opt = _single()
    assert opt.compression is DEFAULT_COMPRESSION
    assert DEFAULT_COMPRESSION.config.bitwidth == 4 and DEFAULT_COMPRESSION.config.error_feedback
    foreign = opt.state_dict()
    foreign["diloco"]["world"] = 2
    with pytest.raises(ValueError, match="over 2 ranks; this one has 1"):
        opt.load_state_dict(foreign)
    foreign["diloco"].update(world=1, rank=1)    # another rank's (one process: raised at once)
    foreign["diloco"]["reducer"]["states"] = [{"residual": torch.zeros(3)}]
    with pytest.raises(ValueError, match="checkpoint of rank 1"):
        opt.load_state_dict(foreign)
    with pytest.raises(ValueError, match="not a DiLoCo state dict"):
        opt.load_state_dict(opt.inner.state_dict())
    sd = opt.state_dict()
    other = _single(sync_every=3)
    with pytest.raises(ValueError, match="checkpoint was saved with"):
        other.load_state_dict(sd)
