"""bitscom.init() after the process group is gone: torch.distributed is started again, and
nothing bitscom recorded keeps the old groups alive.

Each test gets its own 2-rank pool (torchrun-style variables, ``bitscom.init()`` at start),
because it destroys and restarts the world that the shared pools keep for other tests.
"""

import datetime
import gc
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import bitscom
from distpool import WorkerPool

TIMEOUT = datetime.timedelta(seconds=60)
SUMS = (True, 2, 3.0, 3.0)               # 1 + 2 on every path


def _sums(rank, face=False):
    """What the world computes now: a raw all_reduce, the node group's (and bitscom's
    allreduce with ``face=True``: the Horovod face's payload groups are held weakly, so a
    destroyed world is really freed)."""
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    u = torch.tensor([rank + 1.0])
    dist.all_reduce(u, group=bitscom.intra_group())
    out = (dist.is_initialized(), bitscom.size(), t.item(), u.item())
    if face:
        assert bitscom.allreduce(torch.tensor([rank + 1.0]), op=bitscom.Sum).item() == 3.0
    return out


def _destroy_and_count_survivors():
    """``dist.destroy_process_group()``; how many of the groups bitscom knew are still alive.

    A gloo group that outlives it is torn down at interpreter exit instead, where its threads
    can abort the process ("terminate called without an active exception")."""
    refs = [weakref.ref(g) for g in (dist.group.WORLD, bitscom.intra_group(), bitscom.inter_group())]
    dist.destroy_process_group()
    gc.collect()
    return sum(r() is not None for r in refs)


def _raises(fn):
    try:
        fn()
    except RuntimeError as err:
        return "bitscom.init()" in str(err)
    return False


def _after_destroy(rank, world):
    before = _sums(rank)
    survivors = _destroy_and_count_survivors()
    gone = (bitscom.is_initialized(), _raises(bitscom.size))
    bitscom.init(timeout=TIMEOUT)          # must start torch.distributed again
    return before, survivors, gone, _sums(rank)


def _after_shutdown(rank, world):
    bitscom.shutdown()
    down = (dist.is_initialized(), bitscom.is_initialized())
    bitscom.init(timeout=TIMEOUT)
    return down, _sums(rank), bitscom.runtime.timeout() == TIMEOUT


def _shared(rank, world):
    a = bitscom.runtime.shared_group([0, 1], tag="test")
    same = bitscom.runtime.shared_group([0, 1], tag="test") is a
    other = bitscom.runtime.shared_group([0, 1], tag="other") is not a
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=a)
    ref = weakref.ref(a)
    del a
    survivors = _destroy_and_count_survivors()
    gc.collect()
    freed = ref() is None
    bitscom.init(timeout=TIMEOUT)
    b = bitscom.runtime.shared_group([0, 1], tag="test")
    u = torch.tensor([rank + 1.0])
    dist.all_reduce(u, group=b)
    return same, other, t.item(), survivors, freed, u.item()


def _rank0_leaves_late(rank, world, how):
    """Rank 1 restarts at once while rank 0 is still in the old world for 3 s: rank 1 must not
    rendezvous on the old world's store (seen under load: rank 0 then waited for a client that
    never came, "1/2 clients joined", and rank 1 died with "Connection reset by peer")."""
    _sums(rank)
    if rank == 0:
        time.sleep(3)
    if how == "shutdown":
        bitscom.shutdown()
    else:
        dist.destroy_process_group()
    bitscom.init(timeout=TIMEOUT)
    return _sums(rank)


def _face_then_destroy(rank, world):
    _sums(rank, face=True)
    return _destroy_and_count_survivors()   # no init() after: a surviving old world stalls it


@pytest.fixture(scope="module")
def pool():
    """One private pool for this module: its tests restart the world in turn."""
    p = WorkerPool(2)
    yield p
    p.close()


def test_init_after_destroy_process_group_starts_torch_distributed_again(pool):
    assert pool.run(_after_destroy, timeout=120) == [(SUMS, 0, (False, True), SUMS)] * 2


def test_init_after_shutdown_starts_again(pool):
    assert pool.run(_after_shutdown, timeout=120) == [((False, False), SUMS, True)] * 2


@pytest.mark.parametrize("how", ["shutdown", "destroy"])
def test_a_rank_restarting_before_rank_0_left_waits_for_the_new_world(pool, how):
    assert pool.run(_rank0_leaves_late, how, timeout=120) == [SUMS] * 2


def test_shared_group_is_made_once_per_world_and_released_by_destroy(pool):
    assert pool.run(_shared, timeout=120) == [(True, True, 3.0, 0, True, 3.0)] * 2


def test_destroy_releases_the_groups_after_the_horovod_face(pool):
    assert pool.run(_face_then_destroy, timeout=120) == [0, 0]


def _other_build(rank, world, port, queue, release):
    import os

    from distpool import worker_env
    os.environ.update(worker_env(rank, world, port, world))
    import bitscom as b
    if rank == 1:                         # this rank "has another checkout"
        b.runtime.build_fingerprint = lambda: 12345
    try:
        b.init(timeout=datetime.timedelta(seconds=60))
        queue.put((rank, "started"))
    except RuntimeError as err:
        queue.put((rank, str(err)))
    queue.close()
    queue.join_thread()
    os._exit(0)


def test_ranks_with_different_builds_refuse_to_start_on_every_rank():
    from distpool import run_spawned
    real = f"{bitscom.runtime.build_fingerprint():014x}"
    for rank, message in run_spawned(_other_build, 2):
        assert "different bitscom builds" in message, (rank, message)
        assert f"rank 0: {real}" in message and f"rank 1: {12345:014x}" in message, (rank, message)
