"""bitscom.fsdp.compress(weights=...): FSDP2's parameter all-gather in low bit.

References: stock FSDP2 (its own exact all-gather), the blockwise-rounding error bound of the
format (half a quantization step of each block's absolute maximum), and the wire formula
written out here from docs/format.md (payload of whole blocks + one bfloat16 scale per block).
"""

import hashlib
import re

import pytest
import torch
from torch import nn

import bitscom.fsdp
from bitscom.fsdp import WeightConfig
from bitscom.lowbit import LowBitConfig

pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402

EXACT_GRADS = LowBitConfig(bitwidth=32)     # isolates the weight all-gather's effect
Q8 = WeightConfig(min_numel=64)             # weight shards (128..2048 elements) quantized, biases exact
QWD = WeightConfig(mode="difference", block_size=256, min_numel=64)
_MESH = {}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _shard(model, world, reshard=True):
    from torch.distributed.device_mesh import init_device_mesh
    if world not in _MESH:
        _MESH[world] = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=_MESH[world], reshard_after_forward=reshard)
    fully_shard(model, mesh=_MESH[world], reshard_after_forward=reshard)
    return model


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, torch.sin(x[:, :4]) + 0.1 * torch.randn(8, 4, generator=g)


def _loss(model, step, rank):
    x, y = _batch(step, rank)
    return nn.functional.mse_loss(model(x), y)


def _train(model, rank, steps, start=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(start, start + steps):
        opt.zero_grad()
        _loss(model, step, rank).backward()
        opt.step()


def _held_out(model):
    with torch.no_grad():
        loss = float(sum(_loss(model, 10_000, r) for r in range(4)) / 4)
    _reshard(model)
    return loss


def _digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _masters(model):
    return [p.detach().full_tensor().clone() for p in model.parameters()]


def _used(model, step, rank):
    """The unsharded parameters each Linear computed with in one forward (a pre-hook after FSDP's
    unshard)."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, i: seen.extend([mod.weight.detach().clone(),
                                                                     mod.bias.detach().clone()]))
             for m in model if isinstance(m, nn.Linear)]
    with torch.no_grad():
        _loss(model, step, rank)
    for h in hooks:
        h.remove()
    _reshard(model)
    return seen


def _reshard(model):
    """After a forward without backward, reshard_after_forward=False leaves the parameters
    unsharded; put the sharded ones back (as the next backward would)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _block_bound(master, world, block):
    """Largest round-to-nearest error the format allows for each element: half a step
    (absmax / (2^(b-1) - 1)) of its block, blocks taken per rank's padded shard; + bf16 scale slack."""
    rows = -(-master.shape[0] // world) * world
    flat = torch.zeros(rows * master[0].numel(), dtype=torch.float64)
    flat[:master.numel()] = master.double().reshape(-1)
    shards = flat.view(world, -1)
    n = shards.shape[1]
    nb = -(-n // block)
    padded = torch.zeros(world, nb * block, dtype=torch.float64)
    padded[:, :n] = shards
    amax = padded.view(world, nb, block).abs().amax(-1, keepdim=True).expand(world, nb, block)
    bound = amax.reshape(world, -1)[:, :n].reshape(-1)[:master.numel()] / 127 * 0.5 * 1.01
    return bound.view(master.shape)


def _wire(numel, bits, block):
    blocks = -(-numel // block)
    return blocks * block * bits // 8 + 2 * blocks


def _run(rank, world, cfg, steps, reshard):
    exact = _shard(_model(), world, reshard)
    bitscom.fsdp.compress(exact, gradients=EXACT_GRADS)
    _train(exact, rank, steps)
    model = _shard(_model(), world, reshard)
    handle = bitscom.fsdp.compress(model, gradients=EXACT_GRADS, weights=cfg)
    first = _used(model, 0, rank)
    first_master = _masters(model)
    stats0 = handle.comm_stats()
    handle.reset_stats()
    before = [s.gathers for s in handle.weights.states.values()]
    _train(model, rank, steps)
    stats = handle.comm_stats()
    counted = [s.gathers - b for s, b in zip(handle.weights.states.values(), before)]
    used, masters = _used(model, steps, rank), _masters(model)
    return {"exact": _held_out(exact), "compressed": _held_out(model), "initial": _held_out(_shard(_model(), world)),
            "used_digest": _digest(used), "master_digest": _digest(masters), "stats": stats, "stats0": stats0,
            "first": first, "first_master": first_master, "used": used, "masters": masters,
            "counted": counted}


def _expected(world, cfg, gathers):
    """Bytes this rank sends per the format, given each Linear's gathers: its weight shard
    quantized (payload of whole blocks + a bfloat16 scale per block, when that is smaller),
    its bias exact in float32; dense = FSDP's float32 all-gather of the same shards."""
    sent = dense = 0
    for (fan_in, fan_out), n in zip(((16, 64), (64, 64), (64, 4)), gathers):
        w, b = -(-fan_out // world) * fan_in, -(-fan_out // world)
        q = _wire(w, cfg.bitwidth, cfg.block_size) if w >= cfg.min_numel else 4 * w
        sent += n * (min(q, 4 * w) + 4 * b)
        dense += n * 4 * (w + b)
    return sent, dense


def test_8bit_weights_close_to_exact_fsdp2_and_same_on_every_rank(pools):
    steps, world = 20, 2
    results = pools.run(world, _run, Q8, steps, True, timeout=240)
    assert len({r["used_digest"] for r in results}) == 1       # every rank computes with the same model
    assert len({r["master_digest"] for r in results}) == 1
    for rank, r in enumerate(results):
        # what each rank computed with is within the format's rounding bound of the exact masters
        for u, m in zip(r["first"][0::2], r["first_master"][0::2]):
            err = (u.double() - m.double()).abs()
            assert (err <= _block_bound(m, world, 128)).all()
            assert err.max() > 0                                # quantized: not the exact value
            rows = -(-m.shape[0] // world)                       # this rank's own rows: dequantized too
            assert (err[rank * rows:(rank + 1) * rows].max()) > 0
        for u, m in zip(r["first"][1::2], r["first_master"][1::2]):
            assert torch.equal(u, m)                             # biases: exact fallback
        # tolerance derived from the quantization error: each of the steps perturbs the weights by
        # at most half a step of an 8-bit block (relative 1/254); first order in the loss
        tol = steps * r["initial"] / 254
        assert r["compressed"] < 0.6 * r["initial"], r["compressed"]
        assert abs(r["compressed"] - r["exact"]) <= tol, r
        # reshard_after_forward=True: a forward and a backward gather per step (FSDP keeps the
        # last layer unsharded once, so one module may count one more)
        assert all(2 * steps <= n <= 2 * steps + 1 for n in r["counted"]), r["counted"]
        sent, dense = _expected(world, Q8, r["counted"])
        assert r["stats"]["all_gather_bytes_sent"] == sent and r["stats"]["all_gather_dense_bytes"] == dense, r["stats"]
        assert r["stats"]["all_gathers"] == sum(r["counted"])
        assert 3.5 < r["stats"]["all_gather_compression_ratio"] < 4.0
        assert r["stats"]["reduce_scatters"] == 3 * steps     # the gradient report is still there


def test_difference_weights_4bit_close_to_exact(pools):
    steps, world = 20, 2
    results = pools.run(world, _run, QWD, steps, False, timeout=240)
    assert len({r["used_digest"] for r in results}) == 1
    for r in results:
        assert [torch.equal(u, m) for u, m in zip(r["first"], r["first_master"])] == [True] * 6   # first gather exact
        # after training: the copy differs from the master by less than one 4-bit step of the
        # last difference (the replica tracks the master; error does not accumulate)
        for u, m in zip(r["used"][0::2], r["masters"][0::2]):
            err = (u - m).abs().max()
            assert 0 < err < 0.01 * m.abs().max()
        assert abs(r["compressed"] - r["exact"]) <= steps * r["initial"] / 254, r
        # reshard_after_forward=False: one gather per forward; the first (in _used) was exact
        assert all(steps <= n <= steps + 1 for n in r["counted"]), r["counted"]
        sent, dense = _expected(world, QWD, r["counted"])
        assert r["stats"]["all_gather_bytes_sent"] == sent and r["stats"]["all_gather_dense_bytes"] == dense
        assert r["stats0"]["all_gather_bytes_sent"] == r["stats0"]["all_gather_dense_bytes"]   # exact first
        assert r["stats"]["all_gather_compression_ratio"] > 6


def _exact_fallback(rank, world):
    """Nothing quantized (min_numel above every shard): training bitwise equal to FSDP2's own
    all-gather (both with the same exact gradient path)."""
    out = {}
    for name, weights in (("stock", None), ("fallback", WeightConfig(min_numel=10**9))):
        model = _shard(_model(), world)
        bitscom.fsdp.compress(model, gradients=EXACT_GRADS, weights=weights)
        _train(model, rank, 5)
        out[name] = _digest(_masters(model))
    return out


def test_exact_fallback_for_small_tensors(pools):
    results = pools.run(2, _exact_fallback, timeout=240)
    for r in results:
        assert r["stock"] == r["fallback"]                     # lossless: bitwise FSDP2's own all-gather
    assert results[0]["stock"] == results[1]["stock"]


def _integer_parameter(rank, world):
    """An integer parameter in the group (FSDP then gathers uint8) comes through exactly."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 64)
    layer.register_parameter("ids", nn.Parameter(torch.arange(-50, 50, dtype=torch.int64) * 1_000_003,
                                                 requires_grad=False))
    model = _shard(nn.Sequential(layer), world)
    handle = bitscom.fsdp.compress(model, gradients=EXACT_GRADS, weights=Q8)
    seen = {}
    layer.register_forward_pre_hook(lambda m, i: seen.update(ids=m.ids.detach().clone(), w=m.weight.detach().clone(),
                                                            b=m.bias.detach().clone()))
    model(torch.randn(3, 64)).sum().backward()
    master = _masters(model)
    return {"ids": torch.equal(seen["ids"], torch.arange(-50, 50, dtype=torch.int64) * 1_000_003),
            "bias": torch.equal(seen["b"], master[1]), "weight_err": float((seen["w"] - master[0]).abs().max()),
            "bytes": handle.comm_stats()["all_gather_bytes_sent"]}


# torch 2.11's FSDPParam makes nn.Parameter(shard) (requires_grad=True) before copying the flag,
# which an integer tensor refuses; 2.12 passes requires_grad= to the constructor.
@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 12),
                    reason="fully_shard cannot shard an integer parameter before torch 2.12")
def test_integer_parameter_is_gathered_exactly(pools):
    for r in pools.run(2, _integer_parameter, timeout=240):
        assert r["ids"] and r["bias"] and 0 < r["weight_err"] < 0.01
        w, b, ids = 32 * 64, 32, 50                             # per-rank shard elements
        assert r["bytes"] == 2 * (_wire(w, 8, 128) + 4 * b + 8 * ids)   # forward + backward gather


def _bf16(rank, world):
    """Mixed precision: FSDP gathers bfloat16; the baseline is bfloat16 bytes, the quantized
    values are rounded to bfloat16 the same way on every rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.device_mesh import init_device_mesh
    model = _model()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = _MESH.setdefault(world, init_device_mesh("cpu", (world,)))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    handle = bitscom.fsdp.compress(model, gradients=EXACT_GRADS, weights=Q8)
    used = _used(model, 0, rank)
    return {"digest": _digest(used), "dtypes": {str(u.dtype) for u in used}, "stats": handle.comm_stats(),
            "err": max(float((u.double() - m.double()).abs().max()) for u, m in zip(used, _masters(model)))}


def test_bf16_mixed_precision_gathers_bf16(pools):
    results = pools.run(2, _bf16, timeout=120)
    assert results[0]["digest"] == results[1]["digest"]
    for r in results:
        assert r["dtypes"] == {"torch.bfloat16"} and 0 < r["err"] < 0.02
        dense = sum(2 * (-(-o // 2) * (i + 1)) for i, o in ((16, 64), (64, 64), (64, 4)))   # bf16 shards
        sent = sum(_wire(-(-o // 2) * i, 8, 128) + 2 * -(-o // 2) for i, o in ((16, 64), (64, 64), (64, 4)))
        assert r["stats"]["all_gather_dense_bytes"] == dense and r["stats"]["all_gather_bytes_sent"] == sent


def _nonfinite(rank, world, cfg):
    """A NaN in rank 0's shard and an Inf in rank 1's reach every rank's unsharded weight (the
    codec turns a block with an Inf into NaNs: non-finite either way, never a finite value)."""
    model = _shard(_model(), world, False)
    bitscom.fsdp.compress(model, gradients=EXACT_GRADS, weights=cfg)
    _train(model, rank, 1)                                     # difference: past the exact first gather
    with torch.no_grad():
        model[2].weight.to_local()[0, 0] = float("nan") if rank == 0 else float("inf")
    w = _used(model, 1, rank)[2]
    return not bool(w[0, 0].isfinite()), not bool(w[32, 0].isfinite()), bool(w[8:32].isfinite().all())   # other blocks stay finite


@pytest.mark.parametrize("cfg", [Q8, QWD], ids=["blockwise", "difference"])
def test_nonfinite_weights_propagate(pools, cfg):
    for from_rank0, from_rank1, other_rows in pools.run(2, _nonfinite, cfg, timeout=120):
        assert from_rank0 and from_rank1 and other_rows


def _resume(rank, world, load_state):
    """Train 4 steps, checkpoint (shards + handle), train 4 more; a new model that loads the
    checkpoint and trains the same 4 steps must end bitwise where the first did."""
    model = _shard(_model(), world, False)
    handle = bitscom.fsdp.compress(model, gradients=EXACT_GRADS, weights=QWD)
    _train(model, rank, 4)
    shards = [p.detach().to_local().clone() for p in model.parameters()]
    saved = handle.state_dict()
    _train(model, rank, 4, start=4)
    again = _shard(_model(), world, False)
    other = bitscom.fsdp.compress(again, gradients=EXACT_GRADS, weights=QWD)
    with torch.no_grad():
        for p, s in zip(again.parameters(), shards):
            p.to_local().copy_(s)
    if load_state:
        other.load_state_dict(saved)
    _train(again, rank, 4, start=4)
    return _digest(_masters(model)), _digest(_masters(again)), _digest(_used(again, 99, rank))


def test_resume_is_bitwise(pools):
    for first, resumed, _ in pools.run(2, _resume, True, timeout=240):
        assert first == resumed
    # the weight state matters: without it the resumed run starts a new reference and differs
    for first, resumed, _ in pools.run(2, _resume, False, timeout=240):
        assert first != resumed


def _stale(rank, world, case):
    """Rank 1 loads another step's state, or a replica that differs in one byte: the first
    collective after the load (an all-gather) is the same error on both ranks, not a silent
    divergence."""
    model = _shard(_model(), world, False)
    handle = bitscom.fsdp.compress(model, gradients=EXACT_GRADS, weights=QWD)
    _train(model, rank, 2)
    early = handle.state_dict()
    _train(model, rank, 2, start=2)
    state = handle.state_dict()
    if rank == 1 and case == "step":
        state = early
    if rank == 1 and case == "replica":
        state["weights"]["states"]["2"]["reference"][7] ^= 1
    handle.load_state_dict(state)
    try:
        _train(model, rank, 1, start=4)
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("case, words", [("step", "reduce-scatters: rank 0 vs rank 1: 12 vs 6"),
                                         ("replica", "weights")])
def test_stale_weight_state_on_one_rank_is_one_error(pools, case, words):
    msgs = pools.run(2, _stale, case, timeout=120)
    assert msgs[0] is not None and msgs[0] == msgs[1], msgs
    assert "bitscom.fsdp resumed state" in msgs[0] and words in msgs[0], msgs[0]


def _differ(rank, world):
    model = _shard(_model(), world)
    try:
        bitscom.fsdp.compress(model, gradients=EXACT_GRADS, weights=WeightConfig(bitwidth=8 if rank == 0 else 4))
    except RuntimeError as err:
        return str(err)
    return None


def test_ranks_with_different_weight_settings_get_one_error(pools):
    msgs = pools.run(2, _differ, timeout=120)
    assert msgs[0] is not None and msgs[0] == msgs[1] and "weights" in msgs[0], msgs


def _wrong_checkpoint(rank, world):
    model = _shard(_model(), world)
    handle = bitscom.fsdp.compress(model, gradients=EXACT_GRADS, weights=Q8)
    other = bitscom.fsdp.compress(_shard(_model(), world), gradients=EXACT_GRADS, weights=QWD)
    try:
        other.load_state_dict(handle.state_dict())
    except ValueError as err:
        return str(err)
    return None


def test_checkpoint_of_other_weight_settings_is_refused(pools):
    for msg in pools.run(2, _wrong_checkpoint, timeout=120):
        assert msg is not None and "parameter all-gather settings" in msg


def test_bad_weight_settings_are_clear():
    with pytest.raises(TypeError, match="WeightConfig or an int"):
        bitscom.fsdp.compress(nn.Linear(2, 2), weights="8bit")
    with pytest.raises(ValueError, match="bitwidth must be one of"):
        bitscom.fsdp.compress(nn.Linear(2, 2), weights=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        WeightConfig(mode="qwz")
    with pytest.raises(ValueError, match="power of two"):
        WeightConfig(block_size=100)
    with pytest.raises(ValueError, match="min_numel must be an int >= 0"):
        WeightConfig(min_numel=-1)
    with pytest.raises(RuntimeError, match="set_custom_all_gather.*torch " + re.escape(torch.__version__)):
        bitscom.fsdp.require_hook(object, "set_custom_all_gather")
    assert bitscom.fsdp.weight_config(8) == WeightConfig()
    assert WeightConfig(mode="difference").bitwidth == 4 and WeightConfig(mode="difference").block_size == 2048
    assert hasattr(FSDPModule, "set_custom_all_gather")
