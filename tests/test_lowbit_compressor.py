"""LowBit compressor under DistributedOptimizer: trains, replicas bitwise identical, checkpoints,
bytes as counted, hierarchical on 2 nodes x 2, clear errors."""

import copy

import pytest
import torch
import torch.nn as nn

import bitscom
from bitscom.cost import sent_bytes
from bitscom.compressors import LowBit, get
from helpers import global_batch, make_model, params_of, reference_run, shard


def _train(rank, world, steps, settings, threshold=25, hier=False, resume_at=None):
    if hier:
        settings = dict(settings, intra_group=bitscom.intra_group(), inter_group=bitscom.inter_group())
    model = make_model(seed=0)

    def make_opt(m):
        return bitscom.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                            named_parameters=m.named_parameters(),
                                            compression=LowBit(**settings),
                                            fusion_threshold_mb=threshold)

    opt = make_opt(model)
    history, stats, saved = [], [], None
    for step in range(steps):
        if resume_at is not None and step == resume_at:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))  # torch's are live views
        x, y = global_batch(step, world)
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
        history.append(params_of(model))
        stats.append(opt.comm_stats())
    resumed = None
    if saved is not None:  # a fresh optimizer loaded from the checkpoint replays the last steps
        model2 = make_model(seed=1)
        model2.load_state_dict(saved[0])
        opt2 = make_opt(model2)
        opt2.load_state_dict(saved[1])
        for step in range(resume_at, steps):
            x, y = global_batch(step, world)
            opt2.zero_grad()
            nn.functional.mse_loss(model2(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt2.step()
        resumed = params_of(model2)
    wire = [sent_bytes(opt.compression, l, world) for l in opt.bucket_layouts]
    return history, stats, resumed, wire


def _check(results, world, steps, tol):
    for step in range(steps):
        for r in range(1, len(results)):
            for a, b in zip(results[0][0][step], results[r][0][step]):
                assert torch.equal(a, b), f"rank {r} drifted from rank 0 at step {step}"
    ref = reference_run(make_model(seed=0), steps, world)
    err = max(float((g.double() - w).abs().max()) for g, w in zip(results[0][0][-1], ref[-1]))
    assert err < tol, f"max parameter error vs float64 reference {err:.3g}"


@pytest.mark.parametrize("settings,tol", [
    ({"bitwidth": 8}, 0.01),
    ({"bitwidth": 4, "error_feedback_mode": "legacy", "stochastic_rounding": True, "block_size": 32}, 0.06),
    ({"bitwidth": 2, "error_feedback_mode": "ef21", "stage2_error_feedback": True, "hadamard": True}, 0.2),
])
def test_trains_with_identical_replicas(pools, settings, tol):
    steps = 5
    results = pools.run(2, _train, steps, settings, 0.0002)   # several buckets
    _check(results, 2, steps, tol)


def test_bytes_match_wire_cost(pools):
    results = pools.run(2, _train, 2, {"bitwidth": 4})
    stats, wire = results[0][1][-1], results[0][3]
    assert stats["step_bytes_sent"] == sum(wire)
    assert stats["compression_ratio"] > 3


def test_checkpoint_resume_reproduces(pools):
    settings = {"bitwidth": 2, "error_feedback_mode": "legacy", "stage2_error_feedback": True,
                "stochastic_rounding": True}
    for history, _, resumed, _ in pools.run(2, _train, 5, settings, 0.0002, False, 2):
        for a, b in zip(history[-1], resumed):
            assert torch.equal(a, b), "resumed run differs from the uninterrupted one"


@pytest.mark.parametrize("settings", [
    {"bitwidth": 4, "hierarchy": "two_level"},
    {"bitwidth": 4, "hierarchy": "leader", "error_feedback_mode": "legacy", "chunk_size": 64},
])
def test_hierarchical_on_two_nodes(pools, settings):
    steps = 3
    results = pools.run(4, _train, steps, settings, 0.0002, True)
    _check(results, 4, steps, 0.06)
    assert results[0][1][-1]["step_bytes_sent"] > 0


def test_registry_and_bad_settings():
    assert get("lowbit", bitwidth=2) == LowBit(bitwidth=2)
    with pytest.raises(ValueError, match=r"bitwidth must be one of \(1, 2, 4, 8, 12, 16, 32\), got 3"):
        LowBit(bitwidth=3)
    with pytest.raises(ValueError, match="intra_group"):
        LowBit(hierarchy="two_level")
    with pytest.raises(ValueError, match="error_feedback_mode='sometimes'"):
        LowBit(error_feedback_mode="sometimes")
    assert "bitwidth=4" in LowBit().fingerprint()


def test_defaults_agree_with_the_collectives_config():
    """LowBit mirrors LowBitConfig's settings; their defaults must not drift apart."""
    from bitscom.collectives import LowBitConfig
    from bitscom.compressors import LowBit
    assert LowBit().config == LowBitConfig()
