"""The face contract for the FSDP2 handle (``bitscom.fsdp.compress``), on 2 gloo ranks.

The items of tests/test_face_contract.py that apply to a face without an optimizer of its own:
a setting or a parameter shape that differs on one rank, another rank's or a stale handle
checkpoint, identical results, and a world that goes away. Each runs in two configurations:
``"rs"`` (the low-bit reduce-scatter over 2 shards) and ``"hsdp"`` (2 replicas x 1 shard: the
replicate all-reduce in low bit with error feedback, FSDP's own reduce-scatter).
"""

from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn

import bitscom
import bitscom.fsdp
from contract_tools import outcome as _outcome

pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.fsdp import fully_shard  # noqa: E402


CONFIGS = ["rs", "hsdp"]


def _sharded(world, hidden=30, mesh=None):
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, hidden), nn.Tanh(), nn.Linear(hidden, 5))
    mesh = mesh or init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _step(model, opt, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 12, generator=g)
    nn.functional.mse_loss(model(x), torch.sin(x[:, :5])).backward()
    opt.step()
    opt.zero_grad()


def _build(world, rank, gradients=None, hidden=30, config="rs"):
    if config == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        model = _sharded(world, hidden, mesh["shard"])
        handle = bitscom.fsdp.compress(model, replicate=gradients, replicate_group=mesh.get_group("replicate"))
        return model, handle, torch.optim.SGD(model.parameters(), lr=0.1)
    model = _sharded(world, hidden)
    handle = bitscom.fsdp.compress(model, gradients=gradients or bitscom.lowbit.LowBitConfig(
        bitwidth=4, error_feedback=True))
    return model, handle, torch.optim.SGD(model.parameters(), lr=0.1)


def _full(model):
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _mismatch(rank, world, what, config):
    if what == "setting":
        return _outcome(lambda: _build(world, rank, gradients=4 if rank == 0 else 8, config=config) and None)
    return _outcome(lambda: _build(world, rank, hidden=30 + rank, config=config) and None)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("what", ["setting", "shape"])
def test_a_mismatch_is_one_clear_error_on_every_rank(pools, what, config):
    results = pools.run(2, _mismatch, what, config)
    assert all(kind == "RuntimeError" and "disagree" in msg for kind, msg in results), results


def _checkpoint(rank, world, stale, config):
    import torch.distributed as dist
    model, handle, opt = _build(world, rank, config=config)
    _step(model, opt, rank, 0)
    early = handle.state_dict()
    _step(model, opt, rank, 1)
    mine = handle.state_dict()
    shared = [mine]
    dist.broadcast_object_list(shared, src=0)
    chosen = (early if rank == 1 else mine) if stale else shared[0]
    loaded = _outcome(lambda: handle.load_state_dict(chosen))
    stepped = _outcome(lambda: _step(model, opt, rank, 2))
    return loaded, stepped, _full(model) if stepped[0] == "ok" else None


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("stale", [False, True], ids=["rank0-everywhere", "stale-on-rank1"])
def test_a_foreign_or_stale_checkpoint_is_one_error_on_every_rank(pools, stale, config):
    results = pools.run(2, _checkpoint, stale, config)
    assert all(loaded[0] == "ok" for loaded, _, _ in results), results
    steps = [stepped for _, stepped, _ in results]
    assert {kind for kind, _ in steps} == {"RuntimeError"}, steps
    assert all("checkpoint" in msg or "reduce-scatters" in msg or "all-reduces" in msg for _, msg in steps), steps


def _identical(rank, world, config):
    model, handle, opt = _build(world, rank, config=config)
    for step in range(3):
        _step(model, opt, rank, step)
    return _full(model), handle.comm_stats()


@pytest.mark.parametrize("config", CONFIGS)
def test_results_identical_and_bytes_reported(pools, config):
    (p0, s0), (p1, s1) = pools.run(2, _identical, config)
    assert torch.equal(p0, p1)
    for s in (s0, s1):
        assert s["bytes_sent"] == s["total_bytes_sent"] > 0 and s["compression_ratio"] > 1, s


def _after_shutdown(rank, world, config):
    model, handle, opt = _build(world, rank, config=config)
    _step(model, opt, rank, 0)
    bitscom.shutdown()
    bitscom.init(timeout=datetime.timedelta(seconds=60))
    return _outcome(lambda: handle._before())      # what the next reduce-scatter runs first


@pytest.mark.parametrize("config", CONFIGS)
def test_a_handle_whose_world_is_gone_is_a_clear_error_on_every_rank(own_pool, config):
    for kind, msg in own_pool.run(_after_shutdown, config, timeout=150):
        assert kind == "RuntimeError" and "shut down" in msg, (kind, msg)
