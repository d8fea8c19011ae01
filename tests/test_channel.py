"""The Channel: one in-order queue of multi-round collectives per process group, shared by
every face on that group (runtime makes it, with the one later-round group)."""

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import bitscom
from bitscom.comm import Rounds
from helpers import global_batch, make_model, shard


def _two_rounds(comm, x, fail=False):
    """A two-round collective: sum ``x`` (first round), then all-gather the sum (later round)."""
    yield comm.all_reduce(x)
    if fail:
        raise ValueError("second round refused")
    out = torch.empty(comm.size * x.numel())
    yield comm.all_gather(out, x)
    return out


def _submit(ch, x, fail=False):
    comm = ch.comm()
    return ch.submit(Rounds(_two_rounds(comm, x, fail), [comm]))


def _faces_share(rank, world):
    model = make_model(seed=0)
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression="powersgd")
    state, _ = bitscom.ddp_comm_hook("fp16")
    lb = bitscom.LowBitGroup(bitwidth=4)
    world_ch = bitscom.runtime.channel(dist.group.WORLD)
    shared = opt._reducer.channel is world_ch and state._reducer.channel is world_ch and lb._channel is world_ch
    later = world_ch.later_group
    one_later = later is not None and later is not dist.group.WORLD \
        and opt._reducer.later_group is later and state._reducer.later_group is later
    # LowBitGroup works, a Horovod call and the optimizer's buckets on one group, with a
    # non-blocking poll that finds different work completed on each rank: one order still.
    xs = [torch.full((512,), float(rank + 1 + i)) for i in range(3)]
    wa = lb.all_reduce(xs[0], async_op=True, key="a")
    wb = lb.all_reduce(xs[1], async_op=True, key="b")
    if rank == 0:
        time.sleep(0.3)
        wb.poll()
    h = bitscom.allreduce_async(xs[2], name="c", op=bitscom.Sum)
    x, y = global_batch(0, world)
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()
    out = bitscom.synchronize(h) if rank == 0 else None
    wb.wait()
    if rank == 1:
        out = bitscom.synchronize(h)
    wa.wait()
    opt.close()
    state.close()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(everyone, params)
    sums = [float(xs[0].mean()), float(xs[1].mean()), float(out.mean())]
    return shared, one_later, sums, all(torch.equal(e, everyone[0]) for e in everyone)


def test_faces_on_one_group_share_one_channel_and_one_order(pools):
    for shared, one_later, sums, same in pools.run(2, _faces_share, timeout=120):
        assert shared and one_later
        assert abs(sums[0] - 3.0) < 0.2 and abs(sums[1] - 5.0) < 0.3 and sums[2] == 7.0, sums
        assert same, "replicas differ"


def _out_of_order(rank, world):
    ch = bitscom.runtime.channel(dist.group.WORLD, later=True)
    works = [_submit(ch, torch.full((8,), float(rank + 10 * i))) for i in range(4)]
    order = [3, 0, 2, 1] if rank == 0 else [1, 2, 3, 0]
    if rank == 1:
        time.sleep(0.2)
        ch.poll()                    # non-blocking progress on one rank only
    for i in order:
        ch.wait(works[i])
    return [w.result[:1].item() for w in works], ch.poll(), ch.bytes_sent > 0


def test_works_waited_out_of_order_on_different_ranks(pools):
    for firsts, idle, counted in pools.run(2, _out_of_order, timeout=60):
        assert firsts == [1.0 + 20 * i for i in range(4)], firsts       # sum of rank + 10 i
        assert idle and counted


def _failure(rank, world):
    ch = bitscom.runtime.channel(dist.group.WORLD, later=True)
    bad = _submit(ch, torch.ones(4), fail=True)
    behind = _submit(ch, torch.ones(4))
    errors = []
    for w in (behind, bad):
        try:
            ch.wait(w)
            errors.append(None)
        except (ValueError, RuntimeError) as err:
            errors.append(str(err))
    after = _submit(ch, torch.full((4,), float(rank + 1)))
    ch.wait(after)
    return errors, after.result.tolist(), ch.poll()


def test_a_failed_round_aborts_the_queue_and_the_next_submit_works(pools):
    for errors, result, idle in pools.run(2, _failure, timeout=60):
        assert "aborted" in errors[0] and "second round refused" in errors[0], errors
        assert errors[1] == "second round refused"
        assert result == [3.0] * 8 and idle


def _counts():
    return (len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")),
            len(dist.distributed_c10d._world.pg_map))


def _cycles(rank, world, cycles):
    import gc
    model = make_model(seed=0)
    seen, channels = [], set()
    for i in range(cycles):
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), compression="powersgd")
        state, _ = bitscom.ddp_comm_hook("fp16")
        lb = bitscom.LowBitGroup(bitwidth=4)
        lb.all_reduce(torch.ones(64), key="x")
        bitscom.allreduce(torch.ones(4), name=f"cycle{i}")
        x, y = global_batch(i, world)
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
        channels.add(id(opt._reducer.channel))
        opt.close()
        state.close()
        del opt, state, lb
        gc.collect()
        seen.append(_counts())
    return seen, len(channels)


def test_twenty_build_close_cycles_leak_no_groups_threads_or_fds(pools):
    for seen, channels in pools.run(2, _cycles, 20, timeout=300):
        fds, threads, groups = zip(*seen)
        assert channels == 1
        assert len(set(groups)) == 1, f"process groups grew: {groups}"
        assert max(fds[3:]) <= fds[2] + 2, f"fds grew: {fds}"
        assert max(threads[3:]) <= threads[2] + 2, f"threads grew: {threads}"


def _after_shutdown(rank, world):
    import datetime
    import gc
    import weakref
    ch = bitscom.runtime.channel(dist.group.WORLD, later=True)
    ch.wait(_submit(ch, torch.ones(2)))
    later = weakref.ref(ch.later_group)
    bitscom.shutdown()
    gc.collect()
    try:
        ch.comm()
        stale = None
    except RuntimeError as err:
        stale = str(err)
    bitscom.init(timeout=datetime.timedelta(seconds=60))
    fresh = bitscom.runtime.channel(dist.group.WORLD, later=True)
    fresh.wait(_submit(fresh, torch.full((2,), float(rank + 1))))
    return later() is None, stale, fresh is not ch, fresh.poll()


def test_shutdown_drops_the_channels_of_its_world():
    from distpool import WorkerPool
    pool = WorkerPool(2)                  # private: it restarts the world the shared pools keep
    try:
        for freed, stale, fresh, idle in pool.run(_after_shutdown, timeout=120):
            assert freed and fresh and idle
            assert stale is not None and "destroyed" in stale
    finally:
        pool.close()


class _Handle:
    """A finished round's handle, weakly referenceable (torch's works are not)."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def _one_round(handle):
    yield handle


def test_channel_keeps_a_finished_works_last_handle_until_its_next_submit():
    # A gloo work whose last reference dies on torch's worker thread is destroyed there and
    # needs the GIL; when that happens while the interpreter exits, right after the last step,
    # the process aborts. So the channel, on the main thread, drops the last handle, and only
    # at its next submit (the previous step's works are long finished on the worker by then).
    import weakref
    from bitscom.channel import Channel
    ch = Channel(None)
    handle = _Handle()
    alive = weakref.ref(handle)
    ch.wait(ch.submit(Rounds(_one_round(handle))))
    del handle
    assert alive() is not None, "the channel dropped the finished work's last handle at once"
    ch.wait(ch.submit(Rounds(_one_round(_Handle()))))
    assert alive() is None, "the channel kept a handle past its next submit"
