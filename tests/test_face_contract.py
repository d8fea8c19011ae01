"""The face contract: every face of bitscom, through the same checks, on 2 gloo ranks.

A face joins by one line in ``face_specs.SPECS``. What every face must do (DESIGN.md, "one
stack under every face"; issue 32):

* a setting or a parameter shape that differs on one rank: the same clear error on every rank;
* a model already wrapped in DDP: the same clear error on every rank;
* before ``bitscom.init()`` under a launcher: a clear error; one process after ``init()``: no
  warning telling the user to call ``init()``;
* after ``bitscom.shutdown()``, and after a new ``init()`` with the face still alive: a clear
  error on every rank (decided locally: nobody waits on a peer);
* another rank's checkpoint, or a stale one on one rank: the same clear error on every rank at
  the next step, or an exact resume;
* NaN on one rank is visible on every rank once the face communicated;
* replicas bitwise identical after training (``sync()`` first where a face has local steps);
* 20 build/step/close cycles leak no process groups, threads or file descriptors.
"""

from __future__ import annotations

import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import bitscom
from contract_tools import assert_no_growth, failed_builds_then_shutdown
from contract_tools import outcome as _outcome, resource_counts as _counts
from face_specs import SPECS, build, flat_parameters, train_step

NAMES = [s.name for s in SPECS]
BY_NAME = {s.name: s for s in SPECS}


def _train(spec, model, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        train_step(opt, model, rank, step)


def _finish(opt):
    if hasattr(opt, "sync"):
        opt.sync()


# -- mismatches: the same clear error on every rank --------------------------------------------

def _mismatch(rank, world, name, what):
    spec = BY_NAME[name]
    if what == "setting":
        setting = spec.mismatch if rank == 1 else {}
        return _outcome(lambda: build(spec, rank, **setting) and None)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8 + rank), torch.nn.Tanh(), torch.nn.Linear(8 + rank, 3))
    return _outcome(lambda: spec.build(model) and None)


@pytest.mark.parametrize("what", ["setting", "shape"])
@pytest.mark.parametrize("name", NAMES)
def test_a_mismatch_is_one_clear_error_on_every_rank(pools, name, what):
    results = pools.run(2, _mismatch, name, what)
    assert all(kind == "RuntimeError" and "disagree" in msg for kind, msg in results), results


def _ddp_wrapped(rank, world, name):
    spec = BY_NAME[name]
    model = torch.nn.Linear(6, 3)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    try:
        return _outcome(lambda: spec.build(model) and None)
    finally:
        del wrapped


@pytest.mark.parametrize("name", NAMES)
def test_a_ddp_wrapped_model_is_refused_on_every_rank(pools, name):
    results = pools.run(2, _ddp_wrapped, name)
    assert all(kind == "TypeError" and "DistributedDataParallel" in msg for kind, msg in results), results


# -- one process ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_before_init_under_a_launcher_is_a_clear_error(monkeypatch, name):
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"before bitscom.init\(\).*2 processes"):
        build(BY_NAME[name], 0)


@pytest.mark.parametrize("name", NAMES)
def test_one_process_after_init_does_not_ask_for_init(name):
    bitscom.init()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model, opt = build(BY_NAME[name], 0)
            _train(BY_NAME[name], model, opt, 0, 2)
    finally:
        bitscom.shutdown()
    assert not [w for w in seen if "bitscom.init()" in str(w.message)], [str(w.message) for w in seen]


# -- checkpoints --------------------------------------------------------------------------------

def _foreign_checkpoint(rank, world, name, stale):
    """Every rank loads rank 0's checkpoint (``stale=False``), or rank 1 loads its own from one
    step earlier (``stale=True``); then one more step."""
    spec = BY_NAME[name]
    model, opt = build(spec, rank)
    steps = spec.steps_to_communicate * 2
    _train(spec, model, opt, rank, steps - 1)
    early = opt.state_dict()
    _train(spec, model, opt, rank, 1, start=steps - 1)
    mine = opt.state_dict()
    shared = [mine]
    dist.broadcast_object_list(shared, src=0)
    chosen = (early if rank == 1 else mine) if stale else shared[0]
    loaded = _outcome(lambda: opt.load_state_dict(chosen))
    stepped = _outcome(lambda: (_train(spec, model, opt, rank, spec.steps_to_communicate, start=steps),
                                _finish(opt)))
    opt.close()
    return loaded, stepped, flat_parameters(model)


@pytest.mark.parametrize("stale", [False, True], ids=["rank0-everywhere", "stale-on-rank1"])
@pytest.mark.parametrize("name", NAMES)
def test_a_foreign_or_stale_checkpoint_is_one_error_on_every_rank_or_an_exact_resume(pools, name, stale):
    results = pools.run(2, _foreign_checkpoint, name, stale)
    loads = [r[0] for r in results]
    steps = [r[1] for r in results]
    assert all(kind in ("ok", "ValueError") for kind, _ in loads), loads
    if all(kind == "ok" for kind, _ in steps):
        assert not stale, "a stale checkpoint on one rank resumed silently"
        assert torch.equal(results[0][2], results[1][2]), "resumed, but the replicas differ"
    else:
        kinds = {kind for kind, _ in steps}
        assert kinds == {"RuntimeError"}, steps
        assert all("checkpoint" in msg or "steps" in msg or "counters" in msg or "reduce-scatters" in msg
                   for _, msg in steps), steps


# Faces whose per-rank state is under per-rank keys (Face._envelope(own=...)): exact. The others
# keep per-rank torch optimizer state under shared keys (ShardedOptimizer's shard, DiLoCo's
# inner optimizer): the rank check, or DCP's own template check, on every rank.
PLAIN_DCP_RESUMES = {"DistributedOptimizer", "OneBitAdam", "ZeroOneAdam", "OneBitAdam-overlap",
                     "ZeroOneAdam-overlap"}


def _load_plainly(dcp, state, path, opt):
    try:
        dcp.load(state, checkpoint_id=path)
    except dcp.api.CheckpointException as err:     # a BaseException: re-raised as what it wraps
        raise RuntimeError(f"dcp.load: {err}") from None
    opt.load_state_dict(state["optim"])


def _plain_dcp(rank, world, name, path):
    """A framework checkpointer: dcp.save of the face's state_dict() by every rank, then dcp.load
    into another replica's (after one step, so torch's own state exists) and load_state_dict."""
    import torch.distributed.checkpoint as dcp
    spec = BY_NAME[name]
    model, opt = build(spec, rank)
    steps = spec.steps_to_communicate * 2
    _train(spec, model, opt, rank, steps)
    dcp.save({"optim": opt.state_dict(), "model": model.state_dict()}, checkpoint_id=path)
    _train(spec, model, opt, rank, spec.steps_to_communicate, start=steps)
    _finish(opt)
    uninterrupted = flat_parameters(model)
    opt.close()
    model2, opt2 = build(spec, rank, seed=1)
    _train(spec, model2, opt2, rank, 1, start=50)
    state = {"optim": opt2.state_dict(), "model": model2.state_dict()}
    loaded = _outcome(lambda: _load_plainly(dcp, state, path, opt2))
    stepped = _outcome(lambda: (_train(spec, model2, opt2, rank, spec.steps_to_communicate, start=steps),
                                _finish(opt2)))
    opt2.close()
    return loaded, stepped, torch.equal(uninterrupted, flat_parameters(model2))


@pytest.mark.parametrize("name", NAMES)
def test_plain_dcp_of_state_dict_is_an_exact_resume_or_one_clear_error(pools, tmp_path, name):
    """What Accelerate's / torchtitan's checkpointers do (docs/checkpoints.md): DCP keeps one copy
    of a key every rank saves, so per-rank state under shared keys would reach one rank only.
    Faces whose state sits under per-rank keys resume exactly; the others must fail alike on
    every rank, never resume silently wrong."""
    results = pools.run(2, _plain_dcp, name, str(tmp_path / "ckpt"))
    if all(r[0][0] == "ok" and r[1][0] == "ok" for r in results):
        assert all(r[2] for r in results), "resumed silently, but not to the uninterrupted run"
    else:
        assert name not in PLAIN_DCP_RESUMES, results
        outcomes = [r[0] if r[0][0] != "ok" else r[1] for r in results]
        assert outcomes[0] == outcomes[1] and outcomes[0][0] in ("RuntimeError", "ValueError"), outcomes


# -- NaN, replicas -------------------------------------------------------------------------------

def _nan_and_replicas(rank, world, name):
    spec = BY_NAME[name]
    model, opt = build(spec, rank)
    _train(spec, model, opt, rank, 2 * spec.steps_to_communicate + 1)
    _finish(opt)
    clean = flat_parameters(model)
    train_step(opt, model, rank, 99, poison=(rank == 1))
    for step in range(1, spec.steps_to_communicate):
        train_step(opt, model, rank, 99 + step)
    opt.close()
    return clean, bool(torch.isfinite(flat_parameters(model)).all())


@pytest.mark.parametrize("name", NAMES)
def test_replicas_identical_and_nan_visible_on_every_rank(pools, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (clean0, finite0), (clean1, finite1) = pools.run(2, _nan_and_replicas, name)
    assert torch.equal(clean0, clean1), "replicas differ"
    assert not finite0 and not finite1, "a NaN on rank 1 did not reach every rank"


# -- leaks ----------------------------------------------------------------------------------------


def _cycles(rank, world, name, n):
    spec = BY_NAME[name]
    seen = []
    for _ in range(n):
        model, opt = build(spec, rank)
        _train(spec, model, opt, rank, spec.steps_to_communicate)
        opt.close()
        del model, opt
        seen.append(_counts())
    return seen[1], seen[-1]


@pytest.mark.parametrize("name", NAMES)
def test_twenty_cycles_leak_no_groups_threads_or_fds(pools, name):
    assert_no_growth(pools.run(2, _cycles, name, 20))


# -- the world goes away ---------------------------------------------------------------------------


def _after_shutdown(rank, world, name, reinit):
    spec = BY_NAME[name]
    model, opt = build(spec, rank)
    _train(spec, model, opt, rank, spec.steps_to_communicate)
    bitscom.shutdown()
    if reinit:
        bitscom.init(timeout=datetime.timedelta(seconds=60))
    outcome = _outcome(lambda: _train(spec, model, opt, rank, spec.steps_to_communicate, start=10))
    if not reinit:
        bitscom.init(timeout=datetime.timedelta(seconds=60))   # leave the pool a world
    probe = torch.ones(1)
    dist.all_reduce(probe)
    return outcome, probe.item()


@pytest.mark.parametrize("reinit", [False, True], ids=["after-shutdown", "after-re-init"])
@pytest.mark.parametrize("name", NAMES)
def test_a_face_whose_world_is_gone_is_a_clear_error_on_every_rank(own_pool, name, reinit):
    results = own_pool.run(_after_shutdown, name, reinit, timeout=150)
    for (kind, msg), total in results:
        assert kind == "RuntimeError" and "shut down" in msg and "bitscom.init()" in msg, (kind, msg)
        assert total == 2.0


def _failed_builds_then_shutdown(rank, world):
    return failed_builds_then_shutdown(SPECS, lambda spec: build(spec, rank, **(spec.mismatch if rank == 1 else {})))


def test_a_face_that_failed_to_build_does_not_break_shutdown(own_pool):
    """A face registers before its constructor can fail; the world's end must still release it."""
    results = own_pool.run(_failed_builds_then_shutdown, timeout=150)
    assert results == [(len(SPECS), ("ok", None))] * 2, results


# -- a stalled peer: an error within init's timeout, never a hang ----------------------------------

def _stalled_peer(rank, world, port, queue, release):
    from distpool import worker_env
    os.environ.update(worker_env(rank, world, port, world))
    bitscom.init(timeout=datetime.timedelta(seconds=5))
    faces = {spec.name: build(spec, rank) for spec in SPECS}     # construction: both ranks
    out = {}
    if rank == 0:                              # rank 1 stalls: it never steps
        for spec in SPECS:
            model, opt = faces[spec.name]
            out[spec.name] = _outcome(lambda: _train(spec, model, opt, rank, spec.steps_to_communicate))
    queue.put((rank, out))
    queue.close()
    queue.join_thread()
    if rank == 1:
        release.wait(300)                      # alive (not crashed) until rank 0 is done
    os._exit(0)


def test_a_stalled_peer_is_an_error_within_the_init_timeout_on_every_face():
    from distpool import run_spawned
    results = dict(run_spawned(_stalled_peer, 2, timeout=240))
    assert set(results[0]) == set(NAMES)
    for name, (kind, msg) in results[0].items():
        text = msg.lower()
        assert kind != "ok" and any(w in text for w in ("timeout", "timed out", "connection", "peer")), \
            (name, kind, msg[:300])
