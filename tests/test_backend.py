"""The "lowbit" torch.distributed backend: plain dist calls, exact delegation, DDP, registration."""

import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist

from bitscom.backend import register_lowbit_backend, registered_config
from bitscom.collectives import LowBitConfig
from distpool import free_port, worker_env

_GROUPS = {}


def _group(bits=None):
    """One lowbit group per worker and setting, created collectively on first use."""
    register_lowbit_backend(bitwidth=4)
    key = bits
    if key not in _GROUPS:
        opts = None if bits is None else LowBitConfig(bitwidth=bits)
        _GROUPS[key] = dist.new_group(backend="lowbit", pg_options=opts)
    return _GROUPS[key]


def _plain(rank, world):
    pg = _group()
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    exact = sum(torch.randn(3000, generator=torch.Generator().manual_seed(r)).double() for r in range(world))
    y = x.clone()
    dist.all_reduce(y, group=pg)
    raw = y.view(torch.uint8)
    outs = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(outs, raw, group=pg)                    # delegated, exact bytes
    same = all(torch.equal(o, outs[0]) for o in outs)
    avg = x.clone()
    dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=pg)
    ints = torch.tensor([rank * 3 + 1])
    dist.all_reduce(ints, op=dist.ReduceOp.SUM, group=pg)   # integer: exact
    mx = x.clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=pg)     # MAX: exact
    mx_ref = x.clone()
    dist.all_reduce(mx_ref, op=dist.ReduceOp.MAX)
    b = torch.full((5,), float(rank))
    dist.broadcast(b, src=dist.get_global_rank(pg, 1), group=pg)
    dist.barrier(group=pg)
    sent = pg.bytes_sent
    return (float((y.double() - exact).norm() / exact.norm()),
            float((avg.double() - exact / world).norm() / (exact / world).norm()), same,
            ints.item(), torch.equal(mx, mx_ref), b.tolist(), sent, pg.getBackendName())


def test_plain_dist_calls(pools):
    for rel, rel_avg, same, ints, max_ok, b, sent, name in pools.run(2, _plain):
        assert rel < 0.25 and rel_avg < 0.25 and same
        assert ints == 1 + 4 and max_ok and b == [1.0] * 5
        assert 0 < sent < 2 * 3000 * 4 / 4  # two 4-bit all-reduces cost < one fp32's quarter each
        assert name == "lowbit"


def _per_group_options(rank, world):
    return _group(bits=8).config.bitwidth, _group().config.bitwidth


def test_group_options_override_registration(pools):
    for b8, b4 in pools.run(2, _per_group_options):
        assert (b8, b4) == (8, 4)


def _ddp(rank, world, steps):
    from helpers import global_batch, make_model, shard
    results = {}
    for name, pg in (("lowbit", _group(bits=8)), ("gloo", None)):
        model = make_model(seed=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(steps):
            x, y = global_batch(step, world)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        results[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    flat = results["lowbit"]
    outs = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(outs, flat)
    return (all(torch.equal(o, outs[0]) for o in outs),
            float((results["lowbit"] - results["gloo"]).abs().max()), _group(bits=8).bytes_sent)


def test_ddp_trains_on_lowbit_backend(pools):
    for same, diff, sent in pools.run(2, _ddp, 4):
        assert same, "DDP replicas drifted apart on the lowbit backend"
        assert diff < 5e-3 and sent > 0


def test_reregistering_with_other_options_is_an_error():
    register_lowbit_backend(bitwidth=4)
    register_lowbit_backend(bitwidth=4)  # same settings: fine
    assert registered_config() == LowBitConfig(bitwidth=4)
    with pytest.raises(ValueError, match="already registered"):
        register_lowbit_backend(bitwidth=2)
    with pytest.raises(ValueError, match="bitwidth=5"):
        register_lowbit_backend(bitwidth=5)


def _init_child(rank, world, port, q, bits=(8, 8)):
    os.environ.update(worker_env(rank, world, port, world))
    torch.set_num_threads(1)
    import bitscom as bc
    try:
        bc.init(bitwidth=bits[rank], error_feedback=True)   # the seed's own call
        x = torch.full((300,), float(rank + 1))
        dist.all_reduce(x)
        q.put((rank, dist.get_backend(), float(x.mean())))
        bc.shutdown()
    except BaseException as err:  # noqa: BLE001
        q.put((rank, "error", repr(err)))


def test_bitscom_init_with_bitwidth_uses_lowbit():
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_init_child, args=(r, 2, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for _rank, backend, value in got:
        assert backend == "lowbit", value
        assert abs(value - 3.0) < 0.03


def test_ranks_with_different_options_fail_at_group_creation():
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_init_child, args=(r, 2, port, q, (4, 8)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    for _rank, status, message in got:
        assert status == "error", message
        assert "ranks registered different options" in message and "bitwidth=4" in message and "bitwidth=8" in message
    assert got[0][2] == got[1][2]
