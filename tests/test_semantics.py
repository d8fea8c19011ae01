"""What holds between backward() and step(): every p.grad is reduced when backward returns.

Each loop shape users write (GradScaler, clipping, inspection, custom edits, accumulation) is
checked on gloo ranks against a float64 single-process reference, with replicas bitwise equal.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import bitscom
from helpers import global_batch, make_model, params_of, reference_run, shard


def _sgd(model, lr=0.1, momentum=0.9):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def _wrap(model, opt=None, **kw):
    return bitscom.DistributedOptimizer(opt or _sgd(model), named_parameters=model.named_parameters(), **kw)


def _loss(model, step, rank, world):
    x, y = global_batch(step, world)
    return nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world))


def _same_everywhere(tensors):
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _reference(model, steps, world, lr=0.1, momentum=0.9, skip=(), clip=None):
    """float64 single process on the concatenated batch; steps in ``skip`` do not update."""
    ref = copy.deepcopy(model).double()
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    out = []
    for step in range(steps):
        opt.zero_grad()
        x, y = global_batch(step, world)
        nn.functional.mse_loss(ref(x.double()), y.double()).backward()
        if step not in skip:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt.step()
        out.append([p.detach().clone() for p in ref.parameters()])
    return out


def _close(got, want, tol=2e-5):
    return all(torch.allclose(a.double(), b, atol=tol, rtol=tol) for a, b in zip(got, want))


# ------------------------------------------------------------------ GradScaler (issue 9 item 1)

def _grad_scaler(rank, world, threshold):
    model = make_model(seed=0)
    opt = _wrap(model, fusion_threshold_mb=threshold)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    history, scales, same = [], [], []
    for step in range(4):
        opt.zero_grad()
        scaler.scale(_loss(model, step, rank, world)).backward()
        same.append(_same_everywhere([p.grad for p in model.parameters()]))
        scaler.step(opt)
        scaler.update()
        history.append(params_of(model))
        scales.append(scaler.get_scale())
    return history, scales, same


def _grad_scaler_inf(rank, world, inf_step):
    """Rank ``world-1`` produces an Inf gradient at ``inf_step`` (an fp16-style overflow)."""
    model = make_model(seed=0)
    opt = _wrap(model, fusion_threshold_mb=0.0002)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    history, scales = [], []
    for step in range(4):
        opt.zero_grad()
        loss = _loss(model, step, rank, world)
        if step == inf_step and rank == world - 1:
            loss = loss + model.fc1.bias.sum() * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        history.append(params_of(model))
        scales.append(scaler.get_scale())
    return history, scales


@pytest.mark.parametrize("threshold", [25, 0.0002])
def test_grad_scaler_loop_matches_reference(pools, threshold):
    results = pools.run(2, _grad_scaler, threshold, timeout=120)
    ref = _reference(make_model(seed=0), 4, 2)
    for rank, (history, scales, same) in enumerate(results):
        assert all(same), "p.grad must be identical on every rank when backward returns"
        assert scales == [1024.0] * 4
        for step in range(4):
            assert _close(history[step], ref[step]), f"rank {rank} step {step}: update off (scaled?)"
            assert all(torch.equal(a, b) for a, b in zip(history[step], results[0][0][step]))


def test_grad_scaler_inf_on_one_rank_skips_everywhere(pools):
    results = pools.run(2, _grad_scaler_inf, 1, timeout=120)
    ref = _reference(make_model(seed=0), 4, 2, skip={1})
    for rank, (history, scales) in enumerate(results):
        assert scales == [1024.0, 512.0, 512.0, 512.0], f"rank {rank}: scales {scales}"
        assert all(torch.equal(a, b) for a, b in zip(history[1], history[0])), "step 1 must be skipped"
        for step in range(4):
            assert all(torch.isfinite(p).all() for p in history[step])
            assert _close(history[step], ref[step])
            assert all(torch.equal(a, b) for a, b in zip(history[step], results[0][0][step]))


# ------------------------------------------------------- clipping, inspection, edits (item 2)

def _clip_loop(rank, world):
    model = make_model(seed=0)
    opt = _wrap(model, fusion_threshold_mb=0.0002)
    history = []
    for step in range(3):
        opt.zero_grad()
        _loss(model, step, rank, world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        history.append(params_of(model))
    return history


def test_clipping_between_backward_and_step(pools):
    results = pools.run(2, _clip_loop, timeout=120)
    ref = reference_run(make_model(seed=0), 3, 2, clip=0.05)
    for history in results:
        for step in range(3):
            assert _close(history[step], ref[step])
            assert all(torch.equal(a, b) for a, b in zip(history[step], results[0][step]))


def _inspect_and_edit(rank, world, passes):
    model = make_model(seed=0)
    opt = _wrap(model, opt=_sgd(model, momentum=0.0), backward_passes_per_step=passes,
                fusion_threshold_mb=0.0002)
    grads, local_same = [], []
    for k in range(passes):
        _loss(model, k, rank, world).backward()
        if k < passes - 1:
            local_same.append(_same_everywhere([p.grad for p in model.parameters()]))
    grads = [p.grad.clone() for p in model.parameters()]
    before = model.fc2.weight.detach().clone()
    model.fc2.weight.grad.zero_()           # a custom edit between backward and step
    opt.step()
    return grads, local_same, torch.equal(model.fc2.weight, before)


@pytest.mark.parametrize("passes", [1, 2])
def test_grads_reduced_when_backward_returns(pools, passes):
    results = pools.run(2, _inspect_and_edit, passes, timeout=120)
    ref = make_model(seed=0).double()
    for k in range(passes):
        x, y = global_batch(k, 2)
        nn.functional.mse_loss(ref(x.double()), y.double()).backward()
    want = [p.grad for p in ref.parameters()]
    for grads, local_same, unmoved in results:
        assert _close(grads, want, tol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][0]))
        assert unmoved, "step() must use the edited p.grad, not a reduced copy"
        assert local_same == [False] * (passes - 1), "earlier passes stay local"


def _horovod_style(rank, world):
    model = make_model(seed=0)
    opt = _wrap(model)
    _loss(model, 0, rank, world).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.synchronize()                       # already done by backward: a no-op
    unchanged = all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    with opt.skip_synchronize():
        opt.step()
    return unchanged, _same_everywhere(params_of(model))


def test_synchronize_is_a_no_op_after_backward(pools):
    for unchanged, same in pools.run(2, _horovod_style, timeout=60):
        assert unchanged and same


# ----------------------------------------------------- built before init (item 3)

def test_optimizer_before_init_is_an_error(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = make_model()
    with pytest.raises(RuntimeError, match=r"before bitscom.init\(\).*2 processes"):
        bitscom.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())


# ----------------------------------------------------- requires_grad changes (item 4)

def _requires_grad_change(rank, world, change):
    model = make_model(seed=0, frozen=True)
    opt = bitscom.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    _loss(model, 0, rank, world).backward()
    opt.step()
    opt.zero_grad()
    target = model.fc1.weight if change == "freeze" else model.frozen.weight
    target.requires_grad_(change != "freeze")
    before = target.detach().clone()
    try:
        _loss(model, 1, rank, world).backward()
        opt.step()
        return None, torch.equal(before, target)
    except RuntimeError as err:
        return str(err), torch.equal(before, target)


@pytest.mark.parametrize("change,name,word", [("freeze", "fc1.weight", "frozen"),
                                              ("unfreeze", "frozen.weight", "unfrozen")])
def test_requires_grad_change_is_an_error(pools, change, name, word):
    results = pools.run(2, _requires_grad_change, change, timeout=60)
    for msg, unmoved in results:
        assert msg is not None and f"parameter {name!r} was {word}" in msg, msg
        assert unmoved
    assert results[0][0] == results[1][0]


# ------------------------------------------------------ broadcast mismatch (item 6)

def _broadcast_mismatch(rank, world, kind):
    model = make_model(seed=rank)
    if rank == 1 and kind == "dtype":
        model = model.double()
    extra = {"extra.weight": torch.zeros(3)} if (rank == 1 and kind == "count") else {}
    if rank == 1 and kind == "shape":
        model = make_model(seed=rank, hidden=9)
    before = params_of(model)
    try:
        bitscom.broadcast_parameters({**model.state_dict(), **extra}, root_rank=0)
        msg = None
    except RuntimeError as err:
        msg = str(err)
    return msg, all(torch.equal(a, b) for a, b in zip(before, params_of(model)))


@pytest.mark.parametrize("kind", ["dtype", "shape", "count"])
def test_broadcast_parameters_mismatch_same_error_no_data_moved(pools, kind):
    results = pools.run(2, _broadcast_mismatch, kind, timeout=60)
    for msg, unchanged in results:
        assert msg is not None and "ranks disagree on the tensors given to broadcast_parameters" in msg
        assert unchanged
    assert results[0][0] == results[1][0]


def _broadcast_optimizer_mismatch(rank, world):
    model = make_model(seed=0, extra_unused=(rank == 1))
    opt = torch.optim.Adam(model.parameters())
    try:
        bitscom.broadcast_optimizer_state(opt, root_rank=0)
    except RuntimeError as err:
        return str(err)
    return None


def test_broadcast_optimizer_state_mismatch(pools):
    msgs = pools.run(2, _broadcast_optimizer_mismatch, timeout=60)
    assert msgs[0] is not None and "broadcast_optimizer_state" in msgs[0] and msgs[0] == msgs[1]


# --------------------------------------------------------------------- join (item 7)

def _uneven(rank, world, compression):
    model = make_model(seed=0)
    opt = _wrap(model, opt=_sgd(model, momentum=0.0), compression=compression,
                fusion_threshold_mb=0.0002)
    batches = 3 if rank == 0 else 2
    for step in range(batches):
        opt.zero_grad()
        _loss(model, step, rank, world).backward()
        opt.step()
    last = bitscom.join()
    val = torch.tensor([float(rank + 1)])
    dist.all_reduce(val)                      # a collective after join lines up again
    return params_of(model), last, val.item()


@pytest.mark.parametrize("compression", ["none", "powersgd"])
def test_join_with_uneven_inputs(pools, compression):
    results = pools.run(2, _uneven, compression, timeout=120)
    for params, last, val in results:
        assert last == 0 and val == 3.0
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))
    if compression == "none":
        # Two full steps, then rank 0's gradient averaged with rank 1's zeros.
        ref = make_model(seed=0).double()
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            x, y = global_batch(step, 2)
            if step < 2:
                nn.functional.mse_loss(ref(x.double()), y.double()).backward()
            else:
                (nn.functional.mse_loss(ref(shard(x, 0, 2).double()), shard(y, 0, 2).double()) / 2).backward()
            opt.step()
        assert _close(results[0][0], [p.detach() for p in ref.parameters()])


# ---------------------------------------------------------- group leaks (item 9)

def _counts():
    import os
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _leak(rank, world, how, cycles):
    import gc
    model = make_model(seed=0)
    seen = []
    for i in range(cycles):
        opt = _wrap(model, compression="powersgd" if i % 2 else "none")
        opt.zero_grad()
        _loss(model, i, rank, world).backward()
        opt.step()
        if how == "close":
            opt.close()
        del opt
        gc.collect()
        seen.append(_counts())
    return seen


@pytest.mark.parametrize("how", ["close", "gc"])
def test_no_fd_or_thread_leak(pools, how):
    results = pools.run(2, _leak, how, 14, timeout=300)   # a leak of 1 per cycle shows as +9
    for seen in results:
        fds, threads = zip(*seen)
        # after a few cycles to warm up, nothing grows with the number of optimizers built
        assert max(fds[5:]) <= fds[4] + 2, f"fds grew: {fds}"
        assert max(threads[5:]) <= threads[4] + 2, f"threads grew: {threads}"


def _closed_step(rank, world):
    model = make_model(seed=0)
    opt = _wrap(model)
    opt.close()
    _loss(model, 0, rank, world).backward()   # hooks are gone: no collective
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)
    return None


def test_step_after_close_raises(pools):
    for msg in pools.run(2, _closed_step, timeout=60):
        assert msg is not None and "closed" in msg


# --------------------------------------------------- checkpoint agreement (item 10)

def _resume_mismatch(rank, world, name):
    kwargs = {"acpsgd": {"rank": 1}, "powersgd": {"rank": 1, "start_iter": 0}}[name]
    model = make_model(seed=0)
    opt = _wrap(model, compression=bitscom.compressors.get(name, **kwargs))
    saved = []
    for step in range(3):
        opt.zero_grad()
        _loss(model, step, rank, world).backward()
        opt.step()
        saved.append(opt.state_dict())
    model2 = make_model(seed=0)
    opt2 = _wrap(model2, compression=bitscom.compressors.get(name, **kwargs))
    opt2.load_state_dict(saved[rank])         # rank 0 resumes from step 1, rank 1 from step 2
    try:
        opt2.zero_grad()
        _loss(model2, 3, rank, world).backward()
        opt2.step()
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("name", ["acpsgd", "powersgd"])
def test_resume_from_different_steps_is_a_clear_error(pools, name):
    msgs = pools.run(2, _resume_mismatch, name, timeout=60)
    assert msgs[0] is not None and "ranks disagree" in msgs[0] and "compressor state" in msgs[0]
    assert msgs[0] == msgs[1]


def _lowbit_extra_layer(rank, world):
    model = make_model(seed=0)
    opt = _wrap(model, compression="lowbit")
    for step in range(2):
        opt.zero_grad()
        _loss(model, step, rank, world).backward()
        opt.step()
    saved = opt.state_dict()
    bigger = make_model(seed=0, extra_unused=True)
    opt2 = _wrap(bigger, compression="lowbit")
    opt2.zero_grad()
    nn.functional.mse_loss(bigger(torch.ones(2, 6), use_branch=True), torch.zeros(2, 3)).backward()
    opt2.step()
    before = opt2.state_dict()
    try:
        opt2.load_state_dict(saved)
        return None, True
    except ValueError as err:
        after = opt2.state_dict()
        same = repr(_strip(before)) == repr(_strip(after))
        return str(err), same


def _strip(obj):
    if isinstance(obj, torch.Tensor):
        return ("t", tuple(obj.shape), obj.double().sum().item())
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strip(v) for v in obj]
    return obj


def test_failed_load_replaces_nothing(pools):
    for msg, same in pools.run(2, _lowbit_extra_layer, timeout=60):
        assert msg is not None
        assert same, "a failed load must leave compressor and optimizer state as they were"


# --------------------------------------------------------- unclear errors

@pytest.mark.parametrize("kwargs,exc,words", [
    ({"fusion_threshold_mb": float("inf")}, ValueError, "fusion_threshold_mb must be a finite number >= 0, got inf"),
    ({"fusion_threshold_mb": "25"}, TypeError, "fusion_threshold_mb must be a number, got '25'"),
    ({"gradient_predivide_factor": float("inf")}, ValueError, "gradient_predivide_factor must be a finite number > 0"),
    ({"gradient_predivide_factor": "2"}, TypeError, "gradient_predivide_factor must be a number, got '2'"),
    ({"groups": -1}, ValueError, "groups must be an int >= 0, got -1"),
    ({"groups": "x"}, TypeError, "groups must be an int or a list of lists"),
])
def test_bad_settings_name_the_value(kwargs, exc, words):
    model = make_model()
    with pytest.raises(exc) as info:
        bitscom.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters(), **kwargs)
    assert words in str(info.value)


def test_meta_parameters_are_an_error():
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="'weight' is on the meta device"):
        bitscom.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())


def _not_member(rank, world):
    group = dist.new_group([0, 1])
    out = {}
    model = make_model()
    cases = {
        "optimizer": lambda: _wrap(model, process_group=group),
        "broadcast": lambda: bitscom.broadcast_parameters(model.state_dict(), process_group=group),
        "object": lambda: bitscom.broadcast_object(1, process_group=group),
    }
    if rank == 2:
        for key, fn in cases.items():
            try:
                fn()
                out[key] = None
            except ValueError as err:
                out[key] = str(err)
    else:
        bitscom.broadcast_parameters(model.state_dict(), process_group=group)
        out["object"] = bitscom.broadcast_object(rank, process_group=group)
    dist.destroy_process_group(group)
    return out


def test_rank_outside_process_group_is_a_clear_error(pools):
    results = pools.run(3, _not_member, timeout=60)
    for key in ("optimizer", "broadcast", "object"):
        assert "global rank 2) is not a member" in results[2][key], results[2][key]
    assert results[0]["object"] == 0 and results[1]["object"] == 0


# ------------------------------------------------------------ group timeouts (item 8)

def _stalled_peer(rank, world, port, queue, release):
    import datetime
    import os

    from distpool import worker_env
    os.environ.update(worker_env(rank, world, port, world))
    import bitscom as b
    b.init(timeout=datetime.timedelta(seconds=15))
    model = make_model()
    opt = b.DistributedOptimizer(_sgd(model), named_parameters=model.named_parameters())
    ddp_state, _ = b.ddp_comm_hook("fp16")
    groups = {"optimizer": opt._reducer.later_group, "ddp hook": ddp_state._reducer.later_group,
              "intra-node": b.intra_group()}
    out = {}
    if rank == 0:                         # rank 1 stalls: it never joins these collectives
        # all three start at once, so their timeouts run concurrently (15 s, not 45 s)
        works = {name: dist.all_reduce(torch.ones(1), group=group, async_op=True)
                 for name, group in groups.items()}
        for name, work in works.items():
            try:
                work.wait()
                out[name] = "completed"
            except RuntimeError as err:
                out[name] = f"failed: {str(err)[:160]}"
    queue.put((rank, out))
    queue.close()
    queue.join_thread()
    if rank == 1:
        release.wait(180)             # alive (not crashed) until rank 0 has seen every timeout
    os._exit(0)


def test_bitscom_groups_use_the_init_timeout():
    from distpool import run_spawned
    results = dict(run_spawned(_stalled_peer, 2))
    assert set(results[0]) == {"optimizer", "ddp hook", "intra-node"}
    for name, outcome in results[0].items():
        # the first work on a group times out; others on the same group then see the closed
        # pair ("Application timeout caused pair closure"): both are the init timeout's doing
        assert outcome.startswith("failed") and ("imed out" in outcome or "timeout" in outcome), \
            f"{name} group: {outcome} (should time out after init's 15 s, not torch's 30 min)"


def _ddp_leak(rank, world, cycles):
    import gc
    seen = []
    for i in range(cycles):
        state, _ = bitscom.ddp_comm_hook("none")
        if i % 2:
            state.close()
        del state
        gc.collect()
        seen.append(_counts())
    return seen


def test_ddp_hook_state_releases_its_group(pools):
    for seen in pools.run(2, _ddp_leak, 14, timeout=300):
        fds, threads = zip(*seen)
        assert max(fds[5:]) <= fds[4] + 2, f"fds grew: {fds}"
        assert max(threads[5:]) <= threads[4] + 2, f"threads grew: {threads}"
