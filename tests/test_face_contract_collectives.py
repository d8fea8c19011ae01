"""The face contract for the collective faces: the DDP hook, LowBitGroup, the Horovod ops and the
``lowbit`` backend, on 2 gloo ranks (the optimizer faces are in tests/test_face_contract.py).

A face joins by one line in ``face_specs_collectives.SPECS``. What each must do (issue 32):

* a setting or a tensor/parameter shape that differs on one rank: the same clear error on every
  rank, within 10 s;
* after ``bitscom.shutdown()``, and after a new ``init()`` with the face still alive: a clear
  error on every rank (decided locally: nobody waits on a peer), never a reduction over a dead
  group;
* another rank's checkpoint, or a stale one on one rank (faces with state): the same clear
  error on every rank at the next call, or an exact resume;
* NaN on one rank is visible on every rank; results bitwise identical on every rank;
* ``comm_stats()`` (where a face counts bytes) has the keys of every face: the last step's
  ``bytes_sent`` / ``dense_bytes``, ``total_*`` since construction, ``compression_ratio``;
* 20 build/use/close cycles leak no process groups, threads or file descriptors.

The DDP-wrapped refusal does not apply: the DDP hook is how bitscom serves DDP models.
"""

from __future__ import annotations

import datetime
import re
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import bitscom
from contract_tools import assert_no_growth, failed_builds_then_shutdown
from contract_tools import outcome as _outcome, resource_counts as _counts
from face_specs_collectives import NUMEL, SPECS

NAMES = [s.name for s in SPECS]
BY_NAME = {s.name: s for s in SPECS}
STATEFUL = [s.name for s in SPECS if s.has_state]


# -- mismatches: the same clear error on every rank, within 10 s --------------------------------

def _mismatch(rank, world, name, what):
    spec = BY_NAME[name]
    kwargs = {}
    if rank == 1:
        kwargs = dict(spec.mismatch) if what == "setting" else {"width": NUMEL + 1}
    start = time.monotonic()
    built = []

    def use():
        built.append(spec.build(**kwargs))
        built[0].step(rank)

    outcome = _outcome(use)
    if built:
        built[0].close()
    return outcome, time.monotonic() - start


@pytest.mark.parametrize("what", ["setting", "shape"])
@pytest.mark.parametrize("name", NAMES)
def test_a_mismatch_is_one_clear_error_on_every_rank(pools, name, what):
    if what == "shape" and not BY_NAME[name].shapes:
        pytest.skip("DDP's constructor compares parameter shapes before the hook exists")
    results = pools.run(2, _mismatch, name, what)
    outcomes = [o for o, _ in results]
    kinds = {kind for kind, _ in outcomes}
    assert len(kinds) == 1 and kinds <= {"RuntimeError", "ValueError"}, outcomes
    assert all("rank" in msg for _, msg in outcomes), outcomes
    assert all(seconds < 10 for _, seconds in results), results


# -- checkpoints ---------------------------------------------------------------------------------

def _foreign_checkpoint(rank, world, name, stale):
    """Every rank loads rank 0's checkpoint (``stale=False``), or rank 1 loads its own from one
    step earlier (``stale=True``); then one more step."""
    face = BY_NAME[name].build()
    face.step(rank, 0)
    early = face.state_dict()
    face.step(rank, 1)
    mine = face.state_dict()
    shared = [mine]
    dist.broadcast_object_list(shared, src=0)
    chosen = (early if rank == 1 else mine) if stale else shared[0]
    loaded = _outcome(lambda: face.load_state_dict(chosen))
    stepped = _outcome(lambda: face.step(rank, 2))
    result = face.result()
    face.close()
    return loaded, stepped, result


@pytest.mark.parametrize("stale", [False, True], ids=["rank0-everywhere", "stale-on-rank1"])
@pytest.mark.parametrize("name", STATEFUL)
def test_a_foreign_or_stale_checkpoint_is_one_error_on_every_rank_or_an_exact_resume(pools, name, stale):
    results = pools.run(2, _foreign_checkpoint, name, stale)
    loads = [r[0] for r in results]
    steps = [r[1] for r in results]
    assert all(kind in ("ok", "ValueError") for kind, _ in loads), loads
    if all(kind == "ok" for kind, _ in steps):
        assert not stale, "a stale checkpoint on one rank resumed silently"
        assert torch.equal(results[0][2], results[1][2]), "resumed, but the ranks differ"
    else:
        assert {kind for kind, _ in steps} == {"RuntimeError"}, steps
        assert all("checkpoint" in msg for _, msg in steps), steps


# -- NaN, identical results -------------------------------------------------------------------------

def _nan_and_identity(rank, world, name):
    face = BY_NAME[name].build()
    for step in range(3):
        face.step(rank, step)
    clean = face.result()
    face.step(rank, 99, poison=(rank == 1))
    poisoned = face.result()
    face.close()
    return clean, bool(torch.isfinite(poisoned).all())


@pytest.mark.parametrize("name", NAMES)
def test_results_identical_and_nan_visible_on_every_rank(pools, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (clean0, finite0), (clean1, finite1) = pools.run(2, _nan_and_identity, name)
    assert torch.equal(clean0, clean1), "ranks hold different results"
    assert not finite0 and not finite1, "a NaN on rank 1 did not reach every rank"


# -- bytes ----------------------------------------------------------------------------------------------

KEYS = {"bytes_sent", "dense_bytes", "total_bytes_sent", "total_dense_bytes", "compression_ratio",
        "step_bytes_sent", "step_dense_bytes"}


def _stats(rank, world, name):
    face = BY_NAME[name].build()
    face.step(rank, 0)
    first = face.stats()
    face.step(rank, 1)
    second = face.stats()
    face.close()
    return first, second


@pytest.mark.parametrize("name", NAMES)
def test_comm_stats_has_the_keys_of_every_face(pools, name):
    for first, second in pools.run(2, _stats, name):
        if second is None:
            pytest.skip(f"{name} counts no bytes")
        assert KEYS <= set(second), second
        assert second["step_bytes_sent"] > 0 and second["step_dense_bytes"] > 0, second
        # one meaning on every face: bytes_sent is the whole run, step_* the last step
        assert (second["bytes_sent"], second["dense_bytes"]) == \
            (second["total_bytes_sent"], second["total_dense_bytes"]), second
        assert second["total_bytes_sent"] == first["total_bytes_sent"] + second["step_bytes_sent"], (first, second)
        assert second["total_dense_bytes"] == first["total_dense_bytes"] + second["step_dense_bytes"], (first, second)


# -- leaks -------------------------------------------------------------------------------------------


def _cycles(rank, world, name, n):
    seen = []
    for _ in range(n):
        face = BY_NAME[name].build()
        face.step(rank)
        face.close()
        del face
        seen.append(_counts())
    return seen[1], seen[-1]


@pytest.mark.parametrize("name", NAMES)
def test_twenty_cycles_leak_no_groups_threads_or_fds(pools, name):
    assert_no_growth(pools.run(2, _cycles, name, 20))


# -- the world goes away -------------------------------------------------------------------------------


def _failed_builds_then_shutdown(rank, world):
    return failed_builds_then_shutdown(SPECS, lambda spec: spec.build(**(dict(spec.mismatch) if rank == 1 else {}))
                                       .step(rank))


def test_a_face_that_failed_to_build_does_not_break_shutdown(own_pool):
    """A face registers before its constructor can fail; the world's end must still release it."""
    results = own_pool.run(_failed_builds_then_shutdown, timeout=150)
    assert results == [(len(SPECS), ("ok", None))] * 2, results


def _after_shutdown(rank, world, name, reinit):
    face = BY_NAME[name].build()
    face.step(rank)
    bitscom.shutdown()
    if reinit:
        bitscom.init(timeout=datetime.timedelta(seconds=60))
    start = time.monotonic()
    outcome = _outcome(lambda: face.step(rank, 1))
    seconds = time.monotonic() - start
    if not reinit:
        bitscom.init(timeout=datetime.timedelta(seconds=60))   # leave the pool a world
    probe = torch.ones(1)
    dist.all_reduce(probe)
    return outcome, seconds, probe.item()


@pytest.mark.parametrize("reinit", [False, True], ids=["after-shutdown", "after-re-init"])
@pytest.mark.parametrize("name", NAMES)
def test_a_face_whose_world_is_gone_is_a_clear_error_on_every_rank(own_pool, name, reinit):
    results = own_pool.run(_after_shutdown, name, reinit, timeout=150)
    for (kind, msg), seconds, total in results:
        assert kind in ("RuntimeError", "ValueError") and re.search(BY_NAME[name].gone, msg), (kind, msg)
        assert seconds < 10, seconds
        assert total == 2.0
