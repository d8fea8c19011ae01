"""ShardedOptimizer: checkpoints across world sizes, bad settings, cross-rank agreement, flags,
shard planning."""

import argparse

import pytest
import torch
import torch.nn as nn

import bitscom
from bitscom.quantization import hadamard
from bitscom.sharded import ShardedConfig, add_arguments, config_from_args, plan_shards
from bitscom.sharded.rotation import rotate
from helpers import global_batch, make_model, shard


def _step(model, opt, step, rank, world, per_rank):
    x, y = global_batch(step, world, per_rank)
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.clip_grad_norm_(0.5)
    opt.step()


def _make(seed=0, **kw):
    model = make_model(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    return model, bitscom.ShardedOptimizer(opt, model.named_parameters(), **kw)


def _run_and_save(rank, world, per_rank, before, after, **kw):
    """``before`` steps, consolidated checkpoint, ``after`` more steps (the uninterrupted run)."""
    model, opt = _make(**kw)
    for step in range(before):
        _step(model, opt, step, rank, world, per_rank)
    ckpt = opt.consolidated_state_dict(to_rank=0)
    assert (ckpt is None) == (rank != 0)
    for step in range(before, before + after):
        _step(model, opt, step, rank, world, per_rank)
    return ckpt, [p.detach().clone() for p in model.parameters()]


def _resume(rank, world, per_rank, ckpt, start, steps, **kw):
    model, opt = _make(seed=123, **kw)  # different init: everything must come from the checkpoint
    opt.load_state_dict(ckpt)
    for step in range(start, start + steps):
        _step(model, opt, step, rank, world, per_rank)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("saved,resumed", [(2, 4), (4, 2), (2, 1)])
def test_consolidated_checkpoint_resumes_on_another_world_size(pools, saved, resumed):
    global_batch_size = 8  # the same samples per step whatever the world size
    results = pools.run(saved, _run_and_save, global_batch_size // saved, 3, 2)
    ckpt, uninterrupted = results[0]
    assert ckpt["format"] == "bitscom.sharded/1" and ckpt["step"] == 3
    assert set(ckpt["params"]["fc1.weight"]["state"]) == {"step", "exp_avg", "exp_avg_sq"}
    if resumed == 1:
        out = [_resume(0, 1, global_batch_size, ckpt, 3, 2)]
    else:
        out = pools.run(resumed, _resume, global_batch_size // resumed, ckpt, 3, 2)
    for r in range(1, len(out)):
        assert all(torch.equal(a, b) for a, b in zip(out[0], out[r]))
    for a, b in zip(out[0], uninterrupted):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


SDP4BIT = dict(quantized_weights=True, quantized_gradients=True, hadamard_transform=True,
               gradient_alltoall_pipeline=2, local_size=1)


def test_quantized_resume_on_the_same_world_is_bitwise(pools):
    ckpt, uninterrupted = pools.run(2, _run_and_save, 4, 3, 2, **SDP4BIT)[0]
    out = pools.run(2, _resume, 4, ckpt, 3, 2, **SDP4BIT)
    for a, b in zip(out[0], uninterrupted):
        assert torch.equal(a, b)


def _per_rank_state_dict(rank, world):
    model, opt = _make()
    _step(model, opt, 0, rank, world, 4)
    sd = opt.state_dict()
    model2, opt2 = _make(seed=9)
    opt2.load_state_dict(sd)
    with torch.no_grad():  # replicas are the model's business with per-rank state dicts
        for p, q in zip(model.parameters(), model2.parameters()):
            q.copy_(p)
    _step(model, opt, 1, rank, world, 4)
    _step(model2, opt2, 1, rank, world, 4)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    return sd


def test_per_rank_state_dict_round_trip_and_refuses_other_layouts(pools):
    sds = pools.run(2, _per_rank_state_dict)
    assert sds[0]["sharded"]["rank"] == 0 and sds[1]["sharded"]["rank"] == 1
    model, opt = _make()
    with pytest.raises(ValueError, match="rank 0 of 2"):
        opt.load_state_dict(sds[0])
    with pytest.raises(ValueError, match="format"):
        opt.load_consolidated_state_dict({"format": "nope"})


# -- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    ({"weight_quantization_bits": 3}, r"weight_quantization_bits must be one of \(1, 2, 4, 8, 12, 16\), got 3"),
    ({"gradient_quantization_bits_intra": 5},
     r"gradient_quantization_bits_intra must be one of \(1, 2, 4, 8, 12, 16, 32\), got 5"),
    ({"gradient_quantization_bits_inter": 0},
     r"gradient_quantization_bits_inter must be one of \(1, 2, 4, 8, 12, 16, 32\), got 0"),
    ({"wq_group_size": 1000}, r"wq_group_size must be a power of two in \[32, 65536\].*got 1000"),
    ({"gq_group_size_intra": 16}, r"gq_group_size_intra must be an int in \[32, 65536\], got 16"),
    ({"gq_group_size_inter": 3}, r"gq_group_size_inter must be an int in \[32, 65536\], got 3"),
    ({"gradient_alltoall_pipeline": 0}, "gradient_alltoall_pipeline must be an int >= 1, got 0"),
    ({"fusion_threshold_mb": -1}, "fusion_threshold_mb must be a finite number >= 0, got -1"),
    ({"backward_passes_per_step": 0}, "backward_passes_per_step must be an int >= 1, got 0"),
    ({"hadamard_transform": True}, "quantized_gradients=True"),
    ({"op": "mean"}, r"op must be one of \(.*AVERAGE.*SUM.*\), got 'mean'"),
    ({"quantized_weights": 1}, r"quantized_weights must be a bool \(True or False\), got 1"),
])
def test_bad_settings_name_the_value(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _make(**kw)


def test_bad_inputs():
    model = make_model()
    with pytest.raises(TypeError, match="not known to be elementwise"):
        bitscom.ShardedOptimizer(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match="already a bitscom.ShardedOptimizer"):
        bitscom.ShardedOptimizer(_make()[1])
    mixed = make_model()
    mixed.fc1.half()
    with pytest.raises(TypeError, match="one dtype"):
        bitscom.ShardedOptimizer(torch.optim.SGD(mixed.parameters(), lr=0.1))
    model, opt = _make()
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
        with opt.skip_synchronize():
            pass
    with pytest.raises(RuntimeError, match="add every parameter group"):
        opt.add_param_group({"params": []})
    with pytest.raises(ValueError, match=r"to_rank must be an int in \[0, 0\], got 3"):
        opt.consolidated_state_dict(to_rank=3)
    x, y = global_batch(0, 1)
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="computed again after the step.s reduction"):
        nn.functional.mse_loss(model(x), y).backward()


def test_existing_state_is_sliced_and_lr_scheduler_works():
    model = make_model()
    inner = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = bitscom.ShardedOptimizer(inner, model.named_parameters())
    assert all(torch.all(st["sum"] == 0.5) for st in opt.state.values())
    x, y = global_batch(0, 1)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05


def test_grad_scaler_is_refused_loudly():
    """GradScaler would unscale and inf-check only a shard: a clear error, never a silent step."""
    model = make_model()
    opt = bitscom.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = global_batch(0, 1)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _mismatched(rank, world):
    model = make_model()
    bits = 4 if rank == 0 else 8
    try:
        bitscom.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                 quantized_weights=True, weight_quantization_bits=bits)
    except RuntimeError as e:
        return str(e)
    return None


def test_mismatched_settings_raise_the_same_error_on_every_rank(pools):
    errors = pools.run(2, _mismatched, timeout=60)
    assert errors[0] is not None and errors[0] == errors[1]
    assert "settings" in errors[0] and "weight_quantization_bits" in errors[0]


def _zero_after_backward(rank, world):
    model = make_model()
    opt = bitscom.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x, y = global_batch(0, world)
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    reduced = opt.comm_stats().get("gradient_bytes", 0) > 0      # done when backward returned
    opt.zero_grad()                      # discards the reduced step, like a plain optimizer
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()                           # nothing left to apply: SGD without momentum is a no-op
    return reduced, all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_reduction_completes_in_backward_and_zero_grad_discards_it(pools):
    """One lifecycle with DistributedOptimizer: the backward pass that completes a step
    finishes the reduce-scatter, and zero_grad() afterwards drops it (no wedged state)."""
    assert pools.run(2, _zero_after_backward, timeout=60) == [(True, True), (True, True)]


# -- flags and planning -------------------------------------------------------------------------

SEED_LINE = ("--use-distributed-optimizer --quantized-weights --weight-quantization-bits 4 --wq-group-size 2048 "
             "--quantized-gradients --gradient-quantization-bits-intra 8 --gq-group-size-intra 512 "
             "--gradient-quantization-bits-inter 4 --gq-group-size-inter 128 --hadamard-transform "
             "--gradient-alltoall-pipeline 8")


def test_megatron_flags_parse_into_settings():
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(SEED_LINE.split())
    assert args.use_distributed_optimizer
    assert config_from_args(args) == ShardedConfig(
        quantized_weights=True, quantized_gradients=True, hadamard_transform=True,
        gradient_alltoall_pipeline=8)
    assert config_from_args(parser.parse_args([])) == ShardedConfig()
    model = make_model()
    opt = bitscom.ShardedOptimizer.from_args(torch.optim.SGD(model.parameters(), lr=0.1), args,
                                             model.named_parameters())
    assert opt.config.gradient_alltoall_pipeline == 8
    with pytest.raises(ValueError, match="add_arguments"):
        config_from_args(argparse.Namespace())


def test_rotation_is_the_library_hadamard_and_its_own_inverse():
    x = torch.randn(32 * 37, dtype=torch.float64)
    y = rotate(x)
    assert torch.allclose(y.double(), hadamard(x), atol=1e-5)
    assert torch.allclose(rotate(y).double(), x, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 32"):
        rotate(torch.randn(40))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("threshold", [0, 100, 10 ** 9])
@pytest.mark.parametrize("pipeline", [1, 3])
def test_pieces_partition_every_parameter(world, threshold, pipeline):
    params = [(f"p{i}", (n,), n) for i, n in enumerate([5, 0, 300, 17, 1, 64])]
    covered = {name: torch.zeros(n, dtype=torch.int64) for name, _, n in params}
    masters = []
    for rank in range(world):
        plan = plan_shards(params, world, rank, threshold, pipeline)
        for b in plan.buckets:
            assert b.shard_numel % (32 * pipeline) == 0 and world * b.shard_numel >= b.numel
        used = torch.zeros(plan.master_numel, dtype=torch.int64)
        for piece in plan.pieces:
            covered[piece.name][piece.start:piece.stop] += 1
            used[piece.master_offset:piece.master_offset + piece.numel] += 1
        assert used.numel() == 0 or int(used.max()) <= 1  # pieces never overlap in the master shard
        masters.append(plan.master_numel)
    for name, c in covered.items():
        assert torch.all(c == 1), name  # every element owned by exactly one rank
    assert len(set(masters)) == 1
