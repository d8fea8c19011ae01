"""DistributedOptimizer: parity with a float64 single-process run, replicas, buckets, errors."""


import pytest
import torch
import torch.nn as nn

import bitscom
from helpers import global_batch, make_model, params_of, reference_run, shard


def _train(rank, world, steps, threshold, compression="none", passes=1, clip=None,
           lr=0.1, momentum=0.9, per_rank=4):
    model = make_model(seed=0)
    opt = bitscom.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        named_parameters=model.named_parameters(), compression=compression,
        backward_passes_per_step=passes, fusion_threshold_mb=threshold)
    history, stats = [], []
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = global_batch(step * passes + k, world, per_rank)
            loss = nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world))
            loss.backward()
        if clip is not None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        history.append(params_of(model))
        stats.append(opt.comm_stats())
    return history, stats, len(opt.bucket_layouts)


def _assert_replicas_identical(results):
    for step, params0 in enumerate(results[0][0]):
        for r in range(1, len(results)):
            for a, b in zip(params0, results[r][0][step]):
                assert torch.equal(a, b), f"rank {r} drifted from rank 0 at step {step}"


def _assert_matches_reference(results, world, steps, tol=2e-5, **kw):
    ref = reference_run(make_model(seed=0), steps, world, **kw)
    for step in range(steps):
        for got, want in zip(results[0][0][step], ref[step]):
            assert torch.allclose(got.double(), want, atol=tol, rtol=tol), \
                f"step {step}: max err {(got.double() - want).abs().max():.3g}"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("threshold,expect_buckets", [(25, 1), (0.0002, None), (0, 6)])
def test_parity_with_float64_reference(pools, world, threshold, expect_buckets):
    steps = 4
    results = pools.run(world, _train, steps, threshold)
    _assert_replicas_identical(results)
    _assert_matches_reference(results, world, steps)
    n_buckets = results[0][2]
    if expect_buckets is None:
        assert 1 < n_buckets < 6
    else:
        assert n_buckets == expect_buckets
    stats = results[0][1][-1]
    numel = sum(p.numel() for p in make_model().parameters())
    assert stats["step_dense_bytes"] == numel * 4
    assert stats["step_bytes_sent"] == numel * 4


@pytest.mark.parametrize("passes", [2, 3])
def test_accumulation_matches_reference(pools, passes):
    results = pools.run(2, _train, 3, 0.0002, passes=passes)
    _assert_replicas_identical(results)
    _assert_matches_reference(results, 2, 3, passes=passes)


def test_skip_synchronize_with_clipping(pools):
    results = pools.run(2, _train, 3, 25, clip=0.05)
    _assert_replicas_identical(results)
    _assert_matches_reference(results, 2, 3, clip=0.05)


@pytest.mark.parametrize("compression,tol", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_casting_compressors_within_precision(pools, compression, tol):
    results = pools.run(2, _train, 3, 25, compression=compression)
    _assert_replicas_identical(results)
    _assert_matches_reference(results, 2, 3, tol=tol)
    numel = sum(p.numel() for p in make_model().parameters())
    assert results[0][1][-1]["step_bytes_sent"] == numel * 2


def _unused_and_frozen(rank, world):
    model = make_model(seed=0, extra_unused=True, frozen=True)
    frozen_before = model.frozen.weight.detach().clone()
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       fusion_threshold_mb=0.0001)
    names = [s.name for l in opt.bucket_layouts for s in l.slots]
    assert not any(n.startswith("frozen") for n in names)
    out = []
    for step in range(3):
        opt.zero_grad()
        x, y = global_batch(step, world)
        # the branch is used by rank 0 only on step 1, by nobody otherwise
        use = (rank == 0 and step == 1)
        loss = nn.functional.mse_loss(model(shard(x, rank, world), use_branch=use), shard(y, rank, world))
        loss.backward()
        opt.step()
        out.append((params_of(model), model.branch.weight.grad.clone()))
    assert torch.equal(model.frozen.weight, frozen_before)
    return out


def test_unused_and_frozen_parameters(pools):
    results = pools.run(2, _unused_and_frozen)
    for step in range(3):
        for a, b in zip(results[0][step][0], results[1][step][0]):
            assert torch.equal(a, b)
        g0, g1 = results[0][step][1], results[1][step][1]
        assert torch.equal(g0, g1)
        if step == 1:
            assert g0.abs().sum() > 0, "rank 0's branch gradient must reach rank 1"
        else:
            assert g0.abs().sum() == 0


def _sum_and_predivide(rank, world):
    out = {}
    for op, factor in [(bitscom.Sum, 1.0), (bitscom.Average, 4.0), (bitscom.Average, 1.0)]:
        model = nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(0.0)
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                           named_parameters=model.named_parameters(), op=op,
                                           gradient_predivide_factor=factor)
        x = torch.full((1, 3), float(rank + 1))
        model(x).sum().backward()
        opt.synchronize()
        out[(op.value, factor)] = model.weight.grad.clone()
        with opt.skip_synchronize():
            opt.step()
    return out


def test_sum_and_predivide_factor(pools):
    res = pools.run(3, _sum_and_predivide)[0]
    assert torch.allclose(res[("sum", 1.0)], torch.full((1, 3), 6.0))
    assert torch.allclose(res[("average", 4.0)], torch.full((1, 3), 2.0))
    assert torch.allclose(res[("average", 1.0)], torch.full((1, 3), 2.0))


def _checkpoint(rank, world, k, total):
    def build():
        model = make_model(seed=0)
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters(), compression="fp16")
        return model, opt

    def run(model, opt, steps):
        hist = []
        for step in steps:
            opt.zero_grad()
            x, y = global_batch(step, world)
            nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
            hist.append(params_of(model))
        return hist

    model, opt = build()
    straight = run(model, opt, range(total))
    model, opt = build()
    run(model, opt, range(k))
    saved = ({n: t.clone() for n, t in model.state_dict().items()}, opt.state_dict())
    model2, opt2 = build()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    resumed = run(model2, opt2, range(k, total))
    return all(torch.equal(a, b) for s, r in zip(straight[k:], resumed) for a, b in zip(s, r))


def test_checkpoint_resume_is_exact(pools):
    assert all(pools.run(2, _checkpoint, 2, 5))


def _errors(rank, world):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    msgs = {}
    cases = {
        "dup": lambda: bitscom.DistributedOptimizer(opt, named_parameters=[("a", model.fc1.weight), ("a", model.fc1.bias)]),
        "missing": lambda: bitscom.DistributedOptimizer(opt, named_parameters=list(model.named_parameters())[:2]),
        "bpps0": lambda: bitscom.DistributedOptimizer(opt, backward_passes_per_step=0),
        "notopt": lambda: bitscom.DistributedOptimizer(model),
        "predivide_sum": lambda: bitscom.DistributedOptimizer(opt, op=bitscom.Sum, gradient_predivide_factor=2.0),
        "badname": lambda: bitscom.DistributedOptimizer(opt, compression="nope"),
        "extra": lambda: bitscom.DistributedOptimizer(
            torch.optim.SGD(model.fc1.parameters(), lr=0.1), named_parameters=model.named_parameters()),
    }
    for key, fn in cases.items():
        try:
            fn()
            msgs[key] = None
        except (ValueError, TypeError) as err:
            msgs[key] = f"{type(err).__name__}: {err}"
    return msgs


def test_bad_input_errors(pools):
    msgs = pools.run(2, _errors)[0]
    assert "duplicate names ['a']" in msgs["dup"]
    assert "missing from named_parameters" in msgs["missing"]
    assert "backward_passes_per_step" in msgs["bpps0"] and "0" in msgs["bpps0"]
    assert msgs["notopt"].startswith("TypeError") and "MLP" in msgs["notopt"]
    assert "op=Sum" in msgs["predivide_sum"]
    assert "'nope'" in msgs["badname"] and "fp16" in msgs["badname"]
    assert "not in the optimizer" in msgs["extra"]


def _mismatch(rank, world):
    model = make_model(hidden=8 if rank == 0 else 9)
    x, y = global_batch(0, world)
    try:      # the plans are compared when the optimizer is built, before any gradient moves
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters())
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    except RuntimeError as err:
        return str(err)
    return None


def test_mismatched_plans_raise_on_every_rank(pools):
    msgs = pools.run(2, _mismatch, timeout=60)
    for m in msgs:
        assert m is not None and "ranks disagree" in m and "rank 1 differs from rank 0" in m, m
    assert msgs[0] == msgs[1]


def _settings_differ(rank, world, case):
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {}
    if case == "fusion_auto_on_one_rank":     # "auto" probes the link at construction
        kw["fusion_threshold_mb"] = "auto" if rank == 1 else 25
    elif case == "sgd_vs_adamw":
        base = base if rank == 0 else torch.optim.AdamW(model.parameters(), lr=0.1)
    try:
        bitscom.DistributedOptimizer(base, named_parameters=model.named_parameters(), **kw).close()
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("case, words", [
    ("fusion_auto_on_one_rank", "fusion_threshold_mb: rank 0 vs rank 1: 25.0 vs 'auto'"),
    ("sgd_vs_adamw", "wrapped optimizer: rank 0 vs rank 1: 'SGD' vs 'AdamW'")])
def test_settings_a_probe_found_unchecked_are_one_clear_error(pools, case, words):
    """Found by a probe: fusion_threshold_mb="auto" on one rank hung (its link probe met the
    other rank's first step); SGD on one rank and AdamW on the other trained apart silently."""
    msgs = pools.run(2, _settings_differ, case, timeout=90)
    assert msgs[0] is not None and msgs[0] == msgs[1], msgs
    assert "ranks disagree on the optimizer plan" in msgs[0] and words in msgs[0], msgs[0]


def _misuse(rank, world):
    model = make_model()
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), fusion_threshold_mb=0)
    x, y = global_batch(0, world)
    before = params_of(model)
    nn.functional.mse_loss(model(x), y).backward()
    opt.zero_grad()          # discards a reduced step (what GradScaler's skipped steps need)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, params_of(model)))
    nn.functional.mse_loss(model(x), y).backward()
    out = {"unchanged": unchanged}
    try:
        nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as err:
        out["too_many"] = str(err)
    opt.step()
    opt.zero_grad()
    return out


def test_zero_grad_after_backward_and_too_many_passes(pools):
    out = pools.run(2, _misuse)[0]
    assert out["unchanged"]
    assert "backward_passes_per_step=1" in out["too_many"]
    assert "computed again" in out["too_many"]


def _overlap(rank, world):
    """The first bucket's reduction starts while backward is still running."""
    model = make_model()
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), fusion_threshold_mb=0)
    seen = []
    x, y = global_batch(0, world)
    x = x.clone().requires_grad_(True)
    x.register_hook(lambda g: seen.append(opt._next_launch))  # runs last in backward
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return seen[0], len(opt.bucket_layouts)


def test_buckets_launch_during_backward(pools):
    launched, total = pools.run(2, _overlap)[0]
    # The input's gradient is produced by fc1's backward node, alongside (and before the
    # accumulation of) fc1.weight's gradient: every other bucket must already be on the wire.
    assert launched == total - 1, f"only {launched} of {total} buckets had started before backward ended"


def _scheduler(rank, world):
    model = make_model()
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = global_batch(0, world)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


def _replaced(rank, world):
    """A second optimizer built for the same model replaces the first one once it is dropped."""
    import gc
    model = make_model(seed=0)
    first = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    del first
    gc.collect()
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
    history = []
    for step in range(2):
        opt.zero_grad()
        x, y = global_batch(step, world)
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
        history.append(params_of(model))
    return history, [], 1


def test_replaced_optimizer_stops_reducing(pools):
    results = pools.run(2, _replaced)
    _assert_replicas_identical(results)
    _assert_matches_reference(results, 2, 2)


def test_lr_scheduler_works(pools):
    assert pools.run(2, _scheduler)[0] == 0.25


def test_world_size_one_is_plain_optimizer():
    """No process group at all: DistributedOptimizer is the wrapped optimizer."""
    model = make_model()
    ref = make_model()
    with pytest.warns(UserWarning, match="plain single-process optimizer"):
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters(), compression="fp16")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = global_batch(step, 1)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    bitscom.broadcast_parameters(model.state_dict())
    assert bitscom.broadcast_object({"a": 1}) == {"a": 1}


def _broadcasts(rank, world):
    torch.manual_seed(rank)
    model = make_model(seed=rank)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    bitscom.broadcast_parameters(model.state_dict(), root_rank=1)
    bitscom.broadcast_optimizer_state(opt, root_rank=1)
    obj = bitscom.broadcast_object({"rank": rank, "t": torch.tensor([rank])}, root_rank=1)
    return params_of(model), opt.state_dict(), obj


def test_broadcasts_from_root(pools):
    res = pools.run(3, _broadcasts)
    for r in range(3):
        for a, b in zip(res[r][0], res[1][0]):
            assert torch.equal(a, b)
        assert res[r][1]["param_groups"][0]["lr"] == pytest.approx(0.02)
        st_r, st_1 = res[r][1]["state"][0], res[1][1]["state"][0]
        assert torch.equal(st_r["exp_avg"], st_1["exp_avg"])
        assert res[r][2]["rank"] == 1 and res[r][2]["t"].item() == 1
