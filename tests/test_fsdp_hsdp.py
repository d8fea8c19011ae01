"""bitscom.fsdp under HSDP: the replicate (inter-node) all-reduce in low bit, and bitscom's
state through torch's own checkpoint flow (get_state_dict / dcp.save / dcp.load).

References: stock FSDP2 native HSDP (``fully_shard`` on the 2-D mesh, FSDP's own float32
reduce-scatter and all-reduce) and an uninterrupted run for the resume.
"""

import hashlib

import pytest
import torch
from torch import nn

import bitscom.fsdp
from bitscom.lowbit import LowBitConfig, wire_bytes_all_reduce

pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402

_MESH = {}


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh
    if shape not in _MESH:
        _MESH[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return _MESH[shape]


def _model(seed=0):
    torch.manual_seed(seed)    # dim 0 of 30 and 5: padded for 2 shards
    return nn.Sequential(nn.Linear(12, 30), nn.Tanh(), nn.Linear(30, 5))


def _shard(model, mesh):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _hsdp(shape, seed=0, **kw):
    """Our HSDP: FSDP over mesh['shard'], the replicate all-reduce through bitscom."""
    mesh = _mesh(shape)
    model = _shard(_model(seed), mesh["shard"])
    handle = bitscom.fsdp.compress(model, replicate_group=mesh.get_group("replicate"), **kw)
    return model, handle


def _loss(model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 12, generator=g)
    return nn.functional.mse_loss(model(x), torch.sin(x[:, :5]))


def _train(model, rank, steps, opt=None, start=0):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(start, start + steps):
        _loss(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _digest(model):
    model.reshard()
    return hashlib.sha256(b"".join(p.detach().full_tensor().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def _held_out(model):
    with torch.no_grad():
        return float(sum(_loss(model, 10_000, r) for r in range(4)) / 4)


def _outcome(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test compares kinds and messages
        return type(err).__name__, str(err)
    return "ok", ""


def _inter_bytes_per_step(model, shards, replicas, cfg):
    """The wire formula: each sharded module's reduce-scatter output (its padded input / S),
    all-reduced over the replicas."""
    total = 0
    for sub in model.modules():
        params = list(sub.parameters(recurse=False))
        if isinstance(sub, FSDPModule) and params:
            n = sum(-(-p.shape[0] // shards) * shards * (p.numel() // p.shape[0]) for p in params)
            total += wire_bytes_all_reduce(n // shards, replicas, cfg)
    return total


def _accumulating(model, rank, steps=3):
    """Two micro-batches per step, the replicate all-reduce only after the second."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(steps):
        for micro in range(2):
            model.set_requires_all_reduce(micro == 1)
            _loss(model, 2 * step + micro, rank).backward()
        opt.step()
        opt.zero_grad()
    return _digest(model)


def _parity(rank, world, shape):
    steps = 20
    native = _shard(_model(), _mesh(shape))            # stock FSDP2 native HSDP on the 2-D mesh
    _train(native, rank, steps)
    exact_loss, exact_digest = _held_out(native), _digest(native)
    lossless, handle32 = _hsdp(shape, replicate=32)
    _train(lossless, rank, steps)
    model, handle = _hsdp(shape)                       # default: exact reduce-scatter, 4-bit + EF across
    _train(model, rank, steps)
    acc_model, acc_handle = _hsdp(shape, replicate=32)
    accumulated = (_accumulating(_shard(_model(), _mesh(shape)), rank), _accumulating(acc_model, rank),
                   acc_handle.comm_stats()["all_reduces"])
    refused = _outcome(lambda: bitscom.fsdp.compress(_shard(_model(), _mesh(shape)),
                                                     replicate_group=_mesh(shape).get_group("replicate")))
    wrong = None
    if shape[1] > 1:          # the shard group passed as the replicate group: caught at the first backward
        bad = _shard(_model(), _mesh(shape)["shard"])
        bitscom.fsdp.compress(bad, replicate_group=_mesh(shape).get_group("shard"))
        wrong = _outcome(lambda: _loss(bad, 0, rank).backward())
    return {"exact_digest": exact_digest, "wrong_group": wrong, "lossless_digest": _digest(lossless), "digest": _digest(model),
            "exact": exact_loss, "compressed": _held_out(model), "initial": _held_out(_model()),
            "stats": handle.comm_stats(), "stats32": handle32.comm_stats(), "refused": refused, "accumulated": accumulated,
            "expected_inter": steps * _inter_bytes_per_step(model, shape[1], shape[0], handle.replicate),
            "steps": sorted({s.step for s in handle.replicate_states.values()})}


@pytest.mark.parametrize("world,shape", [(2, (2, 1)), (4, (2, 2))], ids=["2x1", "2x2"])
def test_hsdp_replicate_all_reduce(pools, world, shape):
    """float32 on the replicate hop = native HSDP bitwise (two replicas: x0 + x1 is one rounding
    in either order, and *0.5 / AVG's /2 are exact), also with gradient accumulation through
    set_requires_all_reduce(False), 4-bit + EF within 2% of the initial loss
    of exact, replicas bitwise identical, inter-node bytes = the all-reduce's wire formula."""
    results = pools.run(world, _parity, shape, timeout=240)
    assert len({r["digest"] for r in results}) == 1             # every rank: the same parameters
    for r in results:
        assert r["lossless_digest"] == r["exact_digest"], "float32 replicate hop != native HSDP"
        assert r["accumulated"][0] == r["accumulated"][1], "set_requires_all_reduce(False) != native HSDP"
        assert r["accumulated"][2] == 3 * 2                      # once per step and module, not per micro-batch
        assert r["compressed"] < 0.5 * r["initial"]
        assert abs(r["compressed"] - r["exact"]) <= 0.02 * r["initial"], r
        s = r["stats"]
        assert s["inter_node_bytes"] == r["expected_inter"], s
        assert s["inter_node_ratio"] > 2.5 and s["all_reduces"] == 2 * 20, s
        assert s["intra_node_bytes"] == s["intra_node_dense_bytes"] > 0, s        # exact by default
        assert s["bytes_sent"] == s["intra_node_bytes"] + s["inter_node_bytes"]
        assert r["stats32"]["inter_node_ratio"] <= 1.0
        assert r["steps"] == [20]
        kind, msg = r["refused"]
        assert kind == "ValueError" and "mesh['shard']" in msg and "2-D mesh" in msg, r["refused"]
        if shape[1] > 1:
            kind, msg = r["wrong_group"]
            assert kind == "ValueError" and "must share this rank only" in msg, r["wrong_group"]


# -- checkpoints through torch's own flow ------------------------------------------------------

def _save(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "bitscom": bitscom.fsdp.checkpoint_state(model)},
             checkpoint_id=path)


def _load(model, opt, path, **kw):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "bitscom": bitscom.fsdp.checkpoint_state(model, **kw)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def _resume(rank, world, path, shape, other_shape):
    cfg = dict(gradients=LowBitConfig(bitwidth=4, error_feedback=True))   # EF on both hops
    model, handle = _hsdp(shape, **cfg)
    opt = _train(model, rank, 3, _adamw(model))
    _save(model, opt, path)
    saved = _digest(model)
    _train(model, rank, 3, opt, start=3)
    again, h2 = _hsdp(shape, seed=1, **cfg)                 # other init: everything must come from disk
    opt2 = _adamw(again)
    _load(again, opt2, path)
    _train(again, rank, 3, opt2, start=3)
    # another mesh, same world: bitscom's per-rank state does not reshard
    other, _ = _hsdp(other_shape, seed=2, **cfg)
    opt3 = _adamw(other)
    refused = _outcome(lambda: _load(other, opt3, path))
    reset = _outcome(lambda: _load(other, opt3, path, reset_compressor_state=True))
    return {"uninterrupted": _digest(model), "resumed": _digest(again), "refused": refused, "reset": reset,
            "saved": saved, "other": _digest(other), "residual": float(sum(s.residual.residual.abs().sum() for s in handle.replicate_states.values()))}


@pytest.mark.parametrize("world,shape,other", [(2, (2, 1), (1, 2)), (4, (2, 2), (4, 1))], ids=["2x1", "2x2"])
def test_dcp_resume_is_bitwise_and_another_mesh_is_a_clear_error(pools, tmp_path, world, shape, other):
    """Without bitscom's state the resumed run differs (checked by loading with
    reset_compressor_state=True: the bitwise assertion fails)."""
    results = pools.run(world, _resume, str(tmp_path / "ckpt"), shape, other, timeout=300)
    assert len({r["uninterrupted"] for r in results}) == 1
    for r in results:
        assert r["residual"] > 0                                 # the residuals were real state
        assert r["resumed"] == r["uninterrupted"], "resume through dcp.load is not bitwise"
        kind, msg = r["refused"]
        assert kind == "ValueError" and "reset_compressor_state=True" in msg and f"replicate={shape[0]}" in msg, r["refused"]
        assert r["reset"] == ("ok", "") and r["other"] == r["saved"], r      # the model resharded


def test_hsdp_settings_are_clear():
    with pytest.raises(ValueError, match="replicate_group"):
        bitscom.fsdp.compress(nn.Linear(2, 2), replicate=4)
    with pytest.raises(ValueError, match="hierarchy='two_level'.*replicate group"):
        bitscom.fsdp.replicate_config(LowBitConfig(hierarchy="two_level"))
    with pytest.raises(TypeError, match="LowBitConfig, an int bit width or None"):
        bitscom.fsdp.replicate_config("4")
    assert bitscom.fsdp.replicate_config(None) == LowBitConfig(bitwidth=4, error_feedback=True)
    assert not bitscom.fsdp.replicate_config(32).error_feedback
    with pytest.raises(TypeError, match="bitscom.fsdp handle"):
        bitscom.fsdp.FSDPCheckpointState(object())


# -- the recipe: examples/hsdp_gpt.py on 4 gloo ranks (2 x 2) -----------------------------------

def _recipe(rank, world, path):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import hsdp_gpt
    common = ["--mesh", "2x2", "--dim", "32", "--log-every", "1000", "--ckpt", path]
    full = hsdp_gpt.main(common + ["--steps", "4", "--save-at", "2"])
    resumed = hsdp_gpt.main(common + ["--steps", "4", "--resume"])
    return full, resumed


def test_hsdp_gpt_recipe_trains_checkpoints_and_resumes_bitwise(pools, tmp_path):
    """The example (bf16 parameters, AdamW, DCP) runs on a 2x2 mesh; resuming from its step-2
    checkpoint ends on the very parameters of the uninterrupted run, the same on every rank."""
    results = pools.run(4, _recipe, str(tmp_path / "ckpt"), timeout=300)
    assert len({full["digest"] for full, _ in results}) == 1
    for full, resumed in results:
        assert resumed["steps"] == 2 and resumed["digest"] == full["digest"]
        assert full["loss"] < 4.16                       # below ln(64): it learns in 4 steps
        assert full["stats"]["inter_node_ratio"] > 2.5, full["stats"]
