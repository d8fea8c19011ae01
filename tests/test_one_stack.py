"""One stack under every face: ShardedOptimizer and DistributedOptimizer share the lifecycle
(bitscom/lifecycle.py), so each safety net below holds for both. Each test reproduces a defect
of issue 20 that the sharded face had while it carried its own copies of the mechanisms.
"""

import datetime
import inspect
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import bitscom
from distpool import run_spawned, worker_env
from helpers import global_batch, make_model, shard


def _loss(model, step, rank, world, scale=1.0):
    x, y = global_batch(step, world)
    return nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)) * scale


def _sharded(model, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    return bitscom.ShardedOptimizer(opt, model.named_parameters(), **kw)


def _digest(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def _same_everywhere(t):
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(g, gathered[0]) for g in gathered)


# ------------------------------------------------------------- 1. a stalled peer, 2 x 2 nodes

def _stalled_sharded(rank, world, port, queue, release):
    os.environ.update(worker_env(rank, world, port, 2))
    torch.set_num_threads(1)
    import bitscom as b
    b.init(timeout=datetime.timedelta(seconds=5))
    model = make_model(seed=0)
    opt = b.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                             quantized_gradients=True, local_size=2)
    if rank == 3:
        queue.put((rank, "stalled", 0.0))
        release.wait(120)                 # stalls in "backward" until the others have failed
        os._exit(0)
    start = time.monotonic()
    try:
        _loss(model, 0, rank, world).backward()
        opt.step()
        outcome = "completed"
    except Exception as err:  # noqa: BLE001 — any error is the point; its time is checked
        outcome = f"failed: {type(err).__name__}: {str(err)[:120]}"
    queue.put((rank, outcome, time.monotonic() - start))
    release.wait(120)
    os._exit(0)


def test_sharded_two_level_fails_within_the_init_timeout_when_a_peer_stalls():
    results = {r: (o, t) for r, o, t in run_spawned(_stalled_sharded, 4)}
    for r in range(3):
        outcome, elapsed = results[r]
        assert outcome.startswith("failed"), (r, outcome)
        # init's 5 s timeout, not torch's 30 minutes: a wide margin for a loaded machine
        assert elapsed < 60, (r, outcome, elapsed)


# ------------------------------------------------------------------ 2. used before init()

def test_sharded_optimizer_and_join_before_init_are_errors(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = make_model()
    with pytest.raises(RuntimeError, match=r"ShardedOptimizer was used before bitscom.init\(\).*2 processes"):
        _sharded(model)
    with pytest.raises(RuntimeError, match=r"bitscom.join was used before bitscom.init\(\)"):
        bitscom.join()


# ------------------------------------------------------------ 4. requires_grad flipped later

def _flip(rank, world, change):
    model = make_model(seed=0, frozen=True)
    opt = _sharded(model)
    _loss(model, 0, rank, world).backward()
    opt.step()
    opt.zero_grad()
    target = model.fc1.weight if change == "freeze" else model.frozen.weight
    target.requires_grad_(change != "freeze")
    before = target.detach().clone()
    try:
        _loss(model, 1, rank, world).backward()
        opt.step()
        msg = None
    except RuntimeError as err:
        msg = str(err)
    unchanged = torch.equal(before, target)
    target.requires_grad_(change == "freeze")        # leave the pool's autograd state clean
    opt.close()
    return msg, unchanged


@pytest.mark.parametrize("change,name,word", [("freeze", "fc1.weight", "frozen"),
                                              ("unfreeze", "frozen.weight", "unfrozen")])
def test_sharded_requires_grad_change_is_an_error(pools, change, name, word):
    for msg, unchanged in pools.run(2, _flip, change, timeout=60):
        assert msg is not None and name in msg and word in msg and "close()" in msg, msg
        assert unchanged


# ------------------------------------------------- 5. resume from different steps per rank

def _stale_resume(rank, world, face):
    model = make_model(seed=0)
    if face == "sharded":
        opt = _sharded(model, quantized_weights=True)
    else:
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), compression=face)
    saved = []
    for step in range(3):
        opt.zero_grad()
        _loss(model, step, rank, world).backward()
        opt.step()
        saved.append(opt.state_dict())
    opt.load_state_dict(saved[rank])          # rank 0 resumes from step 1, rank 1 from step 2
    try:
        opt.zero_grad()
        _loss(model, 3, rank, world).backward()
        opt.step()
        msg = None
    except RuntimeError as err:
        msg = str(err)
    opt.close()
    return msg


@pytest.mark.parametrize("face", ["sharded", "none", "fp16"])
def test_resume_from_different_steps_is_a_clear_error_on_every_face(pools, face):
    msgs = pools.run(2, _stale_resume, face, timeout=60)
    assert msgs[0] is not None and "ranks disagree" in msgs[0] and "steps" in msgs[0], msgs
    assert msgs[0] == msgs[1]


# ---------------------------------------------------------------- 6. close() and no leak

def _counts():
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _cycle(rank, world, cycles):
    import gc
    model = make_model(seed=0)
    seen = []
    for i in range(cycles):
        opt = _sharded(model, quantized_gradients=True, local_size=2)
        opt.zero_grad()
        _loss(model, i, rank, world).backward()
        opt.step()
        if i % 2:
            opt.close()
        del opt
        gc.collect()
        seen.append(_counts())
    closed = _sharded(model)
    closed.close()
    try:
        _loss(model, 0, rank, world).backward()
        closed.step()
        after_close = None
    except RuntimeError as err:
        after_close = str(err)
    return seen, after_close


def test_sharded_close_releases_and_instances_do_not_leak(pools):
    for seen, after_close in pools.run(4, _cycle, 8, timeout=180):
        fds, threads = zip(*seen)
        assert max(fds[2:]) <= fds[1] + 2, f"fds grew: {fds}"
        assert max(threads[2:]) <= threads[1] + 2, f"threads grew: {threads}"
        assert after_close is not None and "closed" in after_close


# ----------------------------------------------------- 7. a zero-size parameter in a checkpoint

class _WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.empty = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.fc(x) + self.empty.sum()


def _empty_param(rank, world):
    torch.manual_seed(0)
    model = _WithEmpty()
    opt = bitscom.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model.named_parameters())
    x, y = global_batch(0, world)
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()
    ckpt = opt.consolidated_state_dict()
    if rank == 0:
        assert tuple(ckpt["params"]["empty"]["master"].shape) == (0, 4)
    obj = [ckpt]
    dist.broadcast_object_list(obj, src=0)
    opt.load_consolidated_state_dict(obj[0])
    return _same_everywhere(_digest(model))


def test_consolidated_checkpoint_with_a_zero_size_parameter(pools):
    assert pools.run(2, _empty_param, timeout=60) == [True, True]


# ------------------------------------------------------------- 8. join() with uneven inputs

def _uneven(rank, world, quantized, with_join):
    model = make_model(seed=0)
    opt = _sharded(model, quantized_gradients=quantized, quantized_weights=quantized)
    steps = 3 if (rank == 0 or not with_join) else 2
    for step in range(steps):
        opt.zero_grad()
        # the reference run: the rank without data takes a zero-gradient step instead
        scale = 0.0 if (rank == 1 and step == 2) else 1.0
        _loss(model, step, rank, world, scale).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
    last = bitscom.join() if with_join else None
    return _digest(model), last, _same_everywhere(_digest(model))


@pytest.mark.parametrize("quantized", [False, True])
def test_sharded_join_with_uneven_inputs_equals_a_zero_gradient_step(pools, quantized):
    joined = pools.run(2, _uneven, quantized, True, timeout=120)
    reference = pools.run(2, _uneven, quantized, False, timeout=120)
    assert all(same for _, _, same in joined)
    assert [last for _, last, _ in joined] == [0, 0]
    assert torch.equal(joined[0][0], reference[0][0])


# ---------------------------------------------------- 9. different faces on different ranks

def _mixed(rank, world):
    model = make_model(seed=0)
    start = time.monotonic()
    try:
        if rank == 0:
            opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters())
        else:
            opt = _sharded(model)
        _loss(model, 0, rank, world).backward()
        opt.step()
        return None, time.monotonic() - start
    except RuntimeError as err:
        return str(err), time.monotonic() - start


def test_distributed_and_sharded_on_different_ranks_is_the_agreement_error(pools):
    (m0, t0), (m1, t1) = pools.run(2, _mixed, timeout=60)
    assert m0 is not None and m0 == m1, (m0, m1)
    assert "ranks disagree" in m0 and "DistributedOptimizer" in m0 and "ShardedOptimizer" in m0
    assert max(t0, t1) < 20          # the agreement, not a gloo/store timeout


# ------------------------------------------------------ 12. GradScaler refused, not wedged

def test_grad_scaler_refusal_leaves_the_optimizer_usable():
    model = make_model()
    opt = bitscom.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = global_batch(0, 1)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)
    opt.zero_grad()                                  # used to refuse: "being reduced"
    before = _digest(model)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()                                       # used to repeat the GradScaler error
    assert not torch.equal(before, _digest(model))


# ---------------------------------------------------------------------- 13. clear errors

@pytest.mark.parametrize("kw,match", [
    ({"fusion_threshold_mb": math.inf}, "fusion_threshold_mb must be a finite number >= 0, got inf"),
    ({"fusion_threshold_mb": math.nan}, "fusion_threshold_mb must be a finite number >= 0, got nan"),
    ({"local_size": 0}, "local_size must be an int >= 1, got 0"),
    ({"local_size": -1}, "local_size must be an int >= 1, got -1"),
    ({"local_size": 1.5}, "local_size must be an int >= 1, got 1.5"),
])
def test_sharded_bad_settings_name_the_value(kw, match):
    model = make_model()
    with pytest.raises(ValueError, match=match):
        _sharded(model, **kw)


def test_sharded_meta_parameters_are_an_error():
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ValueError, match="meta device"):
        _sharded(model)


def _clip(rank, world, norm_type):
    model = make_model(seed=0)
    opt = bitscom.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   fusion_threshold_mb=0.0002)
    _loss(model, 0, rank, world).backward()
    total = opt.clip_grad_norm_(0.05, norm_type=norm_type)
    opt.step()
    return float(total), _digest(model)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf, -math.inf, 0.0, 0.5])
def test_sharded_clip_grad_norm_matches_torch_for_every_order(pools, norm_type):
    results = pools.run(2, _clip, norm_type, timeout=60)
    ref = make_model(seed=0).double()
    x, y = global_batch(0, 2)
    nn.functional.mse_loss(ref(x.double()), y.double()).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type))
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for total, params in results:
        assert total == pytest.approx(expected, rel=1e-5, abs=1e-7), (norm_type, total, expected)
        assert torch.allclose(params, _digest(ref), atol=1e-6)
    assert torch.equal(results[0][1], results[1][1])


# ----------------------------------------------------- 15. silent traps a new user hit

def _ddp_wrapped(rank, world, face):
    model = make_model(seed=0)
    ddp = nn.parallel.DistributedDataParallel(model)
    try:
        if face == "distributed":
            bitscom.DistributedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1),
                                         named_parameters=ddp.named_parameters())
        else:
            _sharded(ddp)
        return None
    except TypeError as err:
        return str(err)
    finally:
        del ddp


@pytest.mark.parametrize("face", ["distributed", "sharded"])
def test_a_model_already_in_ddp_is_refused(pools, face):
    msgs = pools.run(2, _ddp_wrapped, face, timeout=60)
    assert msgs[0] is not None and "DistributedDataParallel" in msgs[0] and "never wrapped in DDP" in msgs[0]
    assert msgs[0] == msgs[1]


def _rank0_checkpoint(rank, world, compression):
    model = make_model(seed=0)
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=compression)
    opt.zero_grad()
    _loss(model, 0, rank, world).backward()
    opt.step()
    obj = [opt.state_dict()]
    dist.broadcast_object_list(obj, src=0)          # "save on rank 0, load on every rank"
    opt.load_state_dict(obj[0])                     # local: a foreign state waits for the next step
    try:
        opt.zero_grad()
        _loss(model, 1, rank, world).backward()     # the next step's agreement: every rank
        opt.step()
        msg = None
    except RuntimeError as err:
        msg = str(err)
    opt.close()
    return msg


def test_loading_another_ranks_compressor_state_is_refused_on_every_rank(pools):
    msgs = pools.run(2, _rank0_checkpoint, bitscom.compressors.get("powersgd", rank=1, start_iter=0),
                     timeout=60)
    for msg in msgs:                                 # rank 0 loaded its own state, and still raises
        assert "rank 1 was given the checkpoint of rank 0 of 2" in msg and "every rank" in msg, msgs
    # nothing per rank (no error feedback): another rank's checkpoint resumes exactly
    assert pools.run(2, _rank0_checkpoint, "lowbit", timeout=60) == [None, None]


# ------------------------------------------------------------------ help() shows the API

def test_help_shows_the_real_arguments():
    params = inspect.signature(bitscom.DistributedOptimizer).parameters
    assert list(params)[:4] == ["optimizer", "named_parameters", "compression", "backward_passes_per_step"]
    assert "fusion_threshold_mb" in params and "args" not in params


# ------------------------------------------- comm_stats: one meaning of the totals everywhere

def _totals_per_face(rank, world):
    out = {}
    faces = {
        "DistributedOptimizer": lambda m: bitscom.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), compression="lowbit"),
        "ShardedOptimizer": lambda m: _sharded(m, quantized_weights=True, quantized_gradients=True),
        "DiLoCo": lambda m: bitscom.DiLoCo(torch.optim.AdamW(m.parameters(), lr=0.01),
                                           m.named_parameters(), sync_every=2),
        "OneBitAdam": lambda m: bitscom.OneBitAdam(m.parameters(), lr=0.01, freeze_step=2),
    }
    for name, build in faces.items():
        model = make_model(seed=0)
        opt = build(model)
        per_step = []
        for step in range(5):
            opt.zero_grad()
            _loss(model, step, rank, world).backward()
            opt.step()
            s = opt.comm_stats()
            per_step.append((s["step_bytes_sent"], s["step_dense_bytes"]))
        s = opt.comm_stats()
        assert (s["bytes_sent"], s["dense_bytes"]) == (s["total_bytes_sent"], s["total_dense_bytes"])
        out[name] = (per_step, s["total_bytes_sent"], s["total_dense_bytes"])
        if hasattr(opt, "close"):
            opt.close()
    return out


def test_every_face_reports_whole_run_totals_with_one_meaning(pools):
    """``bytes_sent`` / ``dense_bytes`` (= ``total_*``) are since construction and ``step_*`` the
    last step, on every face, whether it communicates every step (the two gradient optimizers)
    or every few steps: a user summing the step values gets the whole-run ones."""
    for per_rank in pools.run(2, _totals_per_face, timeout=240):
        for name, (per_step, sent, dense) in per_rank.items():
            assert sent == sum(b for b, _ in per_step) > 0, name
            assert dense == sum(d for _, d in per_step) > 0, name   # (tiny model: sharded 4-bit pads)
