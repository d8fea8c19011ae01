"""Checkpoints through torch.distributed.checkpoint (bitscom.checkpointing): every rank saves in
one call; the same world size resumes bitwise; ShardedOptimizer reshards to another world size
exactly like the consolidated path; per-rank compressor state refuses another world size."""

import pytest
import torch
import torch.nn as nn

import bitscom
from bitscom import checkpointing
from distpool import RankError
from helpers import global_batch, make_model, shard

GLOBAL_BATCH = 8


def _step(model, opt, step, rank, world, sharded):
    x, y = global_batch(step, world, GLOBAL_BATCH // world)
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    if sharded:
        opt.clip_grad_norm_(0.5)
    opt.step()
    if not sharded:
        opt.zero_grad()


def _distributed(seed, compression):
    model = make_model(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, bitscom.DistributedOptimizer(opt, model.named_parameters(), compression=compression,
                                               fusion_threshold_mb=0.0005)


def _sharded(seed, **kw):
    model = make_model(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    return model, bitscom.ShardedOptimizer(opt, model.named_parameters(), fusion_threshold_mb=0.0005, **kw)


def _make(kind, seed, cfg):
    return _distributed(seed, **cfg) if kind == "distributed" else _sharded(seed, **cfg)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _save_then_resume(rank, world, path, kind, cfg, before=3, after=3):
    """Uninterrupted run vs. a fresh optimizer (other init) loaded from the DCP checkpoint."""
    sharded = kind == "sharded"
    model, opt = _make(kind, 0, cfg)
    for s in range(before):
        _step(model, opt, s, rank, world, sharded)
    checkpointing.save(opt, path, extra={"model": model.state_dict()})
    for s in range(before, before + after):
        _step(model, opt, s, rank, world, sharded)
    uninterrupted = _params(model)
    residuals = [st.state_dict() for st in opt.compressor_states] if not sharded else None
    opt.close()
    model2, opt2 = _make(kind, 123, cfg)
    opt2.load_dcp(path, extra={"model": model2.state_dict()})
    for s in range(before, before + after):
        _step(model2, opt2, s, rank, world, sharded)
    resumed = _params(model2)
    opt2.close()
    return uninterrupted, resumed, residuals


EF = {"compression": bitscom.compressors.get("powersgd", rank=1, start_iter=0)}       # per-rank residuals
SDP4BIT = dict(quantized_weights=True, quantized_gradients=True, hadamard_transform=True,
               gradient_alltoall_pipeline=2, local_size=1)


@pytest.mark.parametrize("kind,cfg", [("distributed", EF), ("sharded", SDP4BIT)])
def test_same_world_resume_is_bitwise(pools, tmp_path, kind, cfg):
    out = pools.run(2, _save_then_resume, str(tmp_path / "ckpt"), kind, cfg)
    for uninterrupted, resumed, _ in out:
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))
    assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0]))


def _train_and_save(rank, world, path, kind, cfg, steps=3):
    model, opt = _make(kind, 0, cfg)
    for s in range(steps):
        _step(model, opt, s, rank, world, kind == "sharded")
    opt.save_dcp(path)
    ckpt = opt.consolidated_state_dict() if kind == "sharded" else None
    info = None
    if kind == "distributed":
        info = {"momentum": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()],
                "compressor": [st.state_dict() for st in opt.compressor_states]}
    opt.close()
    return ckpt, info


def _sharded_state(opt):
    return [(name, start, stop, view.clone(),
             {k: (v.clone() if isinstance(v, torch.Tensor) else v)
              for k, v in opt.optimizer.state[view].items()})
            for name, start, stop, view in opt.shard_pieces]


def _load_both_ways(rank, world, path, ckpt):
    """DCP and consolidated loads give bitwise the same pieces, state and parameters."""
    model_a, opt_a = _sharded(11)
    opt_a.load_dcp(path)
    model_b, opt_b = _sharded(22)
    opt_b.load_consolidated_state_dict(ckpt)
    a, b = _sharded_state(opt_a), _sharded_state(opt_b)
    assert [x[:3] for x in a] == [x[:3] for x in b] and a
    for (_, _, _, ma, sa), (_, _, _, mb, sb) in zip(a, b):
        assert torch.equal(ma, mb) and sorted(sa) == sorted(sb) == ["exp_avg", "exp_avg_sq", "step"]
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))
    assert opt_a._step_count == opt_b._step_count == 3
    _step(model_a, opt_a, 3, rank, world, True)
    _step(model_b, opt_b, 3, rank, world, True)
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))
    opt_a.close()
    opt_b.close()
    return True


@pytest.mark.parametrize("saved,loaded", [(2, 4), (4, 2)])
def test_sharded_reshards_like_the_consolidated_path(pools, tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    ckpt, _ = pools.run(saved, _train_and_save, path, "sharded", {})[0]
    assert all(pools.run(loaded, _load_both_ways, path, ckpt))


def _load_on_other_world(rank, world, path, cfg):
    model, opt = _distributed(5, **cfg)
    try:
        opt.load_dcp(path)
        error = None
    except ValueError as e:
        error = str(e)
        opt.load_dcp(path, reset_compressor_state=True)
    out = {"error": error, "momentum": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()],
           "compressor": [st.state_dict() for st in opt.compressor_states]}
    _step(model, opt, 3, rank, world, False)          # trains on after the load
    opt.close()
    _, fresh = _distributed(6, **cfg)                  # a never-trained optimizer: the reference
    out["fresh"] = [st.state_dict() for st in fresh.compressor_states]
    fresh.close()
    return out


def _assert_nested_equal(a, b):
    if isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for k in a:
            _assert_nested_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_nested_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def test_per_rank_compressor_state_on_another_world_is_a_clear_error(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = pools.run(2, _train_and_save, path, "distributed", EF)
    r0, r1 = saved[0][1]["compressor"], saved[1][1]["compressor"]
    assert any(not torch.equal(a["ef"]["residual"], b["ef"]["residual"])     # really per rank
               for a, b in zip(r0, r1))
    out = pools.run(4, _load_on_other_world, path, EF)
    for o in out:
        assert "written by 2 ranks" in o["error"] and "reset_compressor_state=True" in o["error"]
        assert all(torch.equal(a, b) for a, b in zip(o["momentum"], saved[0][1]["momentum"]))
        _assert_nested_equal(o["compressor"], o["fresh"])


def test_rank_independent_compressor_state_loads_on_another_world(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    cfg = {"compression": bitscom.compressors.get("powersgd", rank=1, start_iter=0, error_feedback=False)}
    saved = pools.run(2, _train_and_save, path, "distributed", cfg)
    assert all(st["step"] == 3 and st["ready"] for st in saved[0][1]["compressor"])
    out = pools.run(4, _load_on_other_world, path, cfg)
    for o in out:
        assert o["error"] is None
        _assert_nested_equal(o["compressor"], saved[0][1]["compressor"])


def test_wrong_checkpoint_kind_is_refused(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    pools.run(2, _train_and_save, path, "sharded", {})
    with pytest.raises(RankError, match="not a bitscom DistributedOptimizer DCP checkpoint"):
        pools.run(2, _load_on_other_world, path, EF)
