"""LowBitGroup: the user-facing collective API over the shared round generators."""

import pytest
import torch
import torch.distributed as dist

import bitscom


def _basic(rank, world):
    lb = bitscom.LowBitGroup(bitwidth=8)
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1) / 1000
    s, a = x.clone(), x.clone()
    lb.all_reduce(s)                               # SUM
    lb.all_reduce(a, op=dist.ReduceOp.AVG)
    want = torch.arange(1000, dtype=torch.float64) / 1000 * world * (world + 1) / 2
    ints = torch.tensor([rank, 10 * rank], dtype=torch.int64)
    lb.all_reduce(ints)                            # exact collective
    mx = x.clone()
    lb.all_reduce(mx, op=dist.ReduceOp.MAX)        # exact collective
    return (float((s.double() - want).abs().max()), float((a.double() - want / world).abs().max()),
            ints.tolist(), torch.equal(mx, torch.arange(1000, dtype=torch.float32) * world / 1000))


def test_sum_avg_and_exact_fallbacks(pools):
    for s_err, a_err, ints, max_ok in pools.run(2, _basic):
        assert s_err < 0.03 and a_err < 0.015
        assert ints == [1, 10] and max_ok


def _async(rank, world):
    lb = bitscom.LowBitGroup(bitwidth=4)
    a, b = torch.randn(4096), torch.randn(4096)
    wa = lb.all_reduce(a, async_op=True, key="a")
    first_in_flight = wa.work is not None and not wa.is_completed()
    wb = lb.all_reduce(b, async_op=True, key="b")   # a second collective before waiting
    wb.wait()
    wa.wait()
    ok = wa.is_completed() and wb.is_completed()
    sync = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    sync_async = sync.clone()
    lb2 = bitscom.LowBitGroup(bitwidth=4)
    lb2.all_reduce(sync, key="s")
    bitscom.LowBitGroup(bitwidth=4).all_reduce(sync_async, async_op=True, key="s").wait()
    return first_in_flight, ok, torch.equal(sync, sync_async)


def test_async_first_round_in_flight_and_same_result(pools):
    for in_flight, ok, same in pools.run(2, _async):
        assert in_flight and ok and same


def _rs_ag(rank, world):
    lb = bitscom.LowBitGroup(bitwidth=8, block_size=32)
    inp = torch.arange(world * 40, dtype=torch.float32) + rank
    out = torch.empty(40)
    lb.reduce_scatter(out, inp)
    want = (torch.arange(world * 40, dtype=torch.float64) * world + sum(range(world)))[rank * 40:(rank + 1) * 40]
    g = torch.empty(world * 40)
    lb.all_gather(g, torch.linspace(-1, 1, 40) * (rank + 1))
    gw = torch.cat([torch.linspace(-1, 1, 40) * (r + 1) for r in range(world)]).double()
    sent = {}
    w = lb.all_gather(torch.empty(world * 40), torch.ones(40), async_op=True)
    w.wait()
    sent["ag"] = w.bytes_sent
    return float(((out.double() - want) / want.abs().clamp(min=1)).abs().max()), \
        float((g.double() - gw).abs().max()), sent["ag"]


def test_reduce_scatter_and_all_gather_are_low_bit(pools):
    for rs_err, ag_err, ag_bytes in pools.run(2, _rs_ag):
        assert rs_err < 0.02 and ag_err < 0.02
        assert ag_bytes == 64 + 4  # 2 blocks of 32 8-bit codes + 2 bf16 scales, not 160 bytes of fp32


def _simulate(rank, world):
    lb = bitscom.LowBitGroup(bitwidth=4, simulate_quantization=True)
    x = torch.randn(512, generator=torch.Generator().manual_seed(rank))
    y = x.clone()
    lb.all_reduce(y, op=dist.ReduceOp.AVG)
    want = sum(bitscom.LowBitGroup(bitwidth=4).decompress(bitscom.LowBitGroup(bitwidth=4).compress(
        torch.randn(512, generator=torch.Generator().manual_seed(r)))) for r in range(world)) / world
    c = lb.compress(x)
    return float((y - want).abs().max()), c.nbytes, lb.decompress(c).shape == x.shape


def test_simulate_quantization_and_compress(pools):
    for err, nbytes, shape_ok in pools.run(2, _simulate):
        assert err < 1e-5 and nbytes == 256 + 8 and shape_ok


def _ef_state(rank, world):
    lb = bitscom.LowBitGroup(bitwidth=2, error_feedback_mode="legacy", stage2_error_feedback=True)
    x = torch.randn(300, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        lb.all_reduce(x.clone(), key="w")
    saved = lb.state_dict()
    y1 = x.clone()
    lb.all_reduce(y1, key="w")
    lb2 = bitscom.LowBitGroup(bitwidth=2, error_feedback_mode="legacy", stage2_error_feedback=True)
    lb2.load_state_dict(saved)
    y2 = x.clone()
    lb2.all_reduce(y2, key="w")
    return torch.equal(y1, y2), sorted(str(k) for k in saved["states"])


def test_error_feedback_state_is_keyed_and_checkpointable(pools):
    for same, keys in pools.run(2, _ef_state):
        assert same and keys == ["('all_reduce', 'w')"]


def _hier(rank, world):
    lb = bitscom.LowBitGroup(bitwidth=4)
    x = torch.randn(2000, generator=torch.Generator().manual_seed(rank))
    exact = sum(torch.randn(2000, generator=torch.Generator().manual_seed(r)).double() for r in range(world))
    res = []
    for kw in ({}, {"local_quantize": True}, {"chunk_size": 600}):
        y = x.clone()
        lb.all_reduce(y, local_group=bitscom.intra_group(), inter_group=bitscom.inter_group(), **kw)
        res.append(float((y.double() - exact).norm() / exact.norm()))
    two = bitscom.LowBitGroup(bitwidth=4, hierarchy="two_level", intra_bitwidth=8)
    y = x.clone()
    work = two.all_reduce(y, async_op=True)
    work.wait()
    res.append(float((y.double() - exact).norm() / exact.norm()))
    return res


def test_hierarchical_through_the_group(pools):
    for rels in pools.run(4, _hier):
        assert max(rels) < 0.3, rels


def test_bad_options_raise_clear_errors():
    with pytest.raises(ValueError, match="bitwidth=3"):
        bitscom.LowBitGroup(bitwidth=3)
    with pytest.raises(TypeError, match="error_feedback must be a bool.*'yes'"):
        bitscom.LowBitGroup(error_feedback="yes")
    with pytest.raises(ValueError, match="error_feedback_mode='yes'"):
        bitscom.LowBitGroup(error_feedback_mode="yes")
    with pytest.raises(TypeError, match="simulate_quantization"):
        bitscom.LowBitGroup(simulate_quantization="no")
    with pytest.raises(ValueError, match="block_size=48"):
        bitscom.LowBitGroup(block_size=48)


def _mismatched(rank, world):
    try:
        bitscom.LowBitGroup(bitwidth=4 if rank == 0 else 8)
    except RuntimeError as err:
        return str(err)
    return None


def test_mismatched_settings_raise_on_every_rank(pools):
    msgs = pools.run(2, _mismatched, timeout=60)
    assert msgs[0] is not None and msgs[0] == msgs[1]
    assert "LowBitGroup settings" in msgs[0] and "bitwidth=4" in msgs[0] and "bitwidth=8" in msgs[0]
