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
        # 2 blocks of 32 8-bit codes + 2 bf16 scales (not 160 bytes of fp32), plus the 16-byte
        # size check (two int64) every LowBitGroup call makes
        assert ag_bytes == 64 + 4 + 16


def _simulate(rank, world):
    """simulate_quantization computes what the low-bit wire gives, for every setting, in fp32."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, kw in {"none": {}, "legacy": {"error_feedback": True},
                     "ef21": {"error_feedback_mode": "ef21"},
                     "ef21_plus": {"error_feedback_mode": "ef21_plus"},
                     "sr_hadamard": {"stochastic_rounding": True, "hadamard": True},
                     "stage2": {"bitwidth": 2, "stage2_error_feedback": True}}.items():
        real = bitscom.LowBitGroup(**dict({"bitwidth": 4}, **kw))
        sim = bitscom.LowBitGroup(**dict({"bitwidth": 4}, **kw), simulate_quantization=True)
        diffs = []
        for _ in range(3):          # EF state evolves the same way in both
            y, z = x.clone(), x.clone()
            real.all_reduce(y, op=dist.ReduceOp.AVG, key="w")
            w = sim.all_reduce(z, op=dist.ReduceOp.AVG, key="w", async_op=True)
            w.wait()
            diffs.append(float((y - z).abs().max()))
        out[name] = (max(diffs), w.bytes_sent, y.clone())
    # hierarchy through the groups, reduce_scatter and all_gather are simulated too
    inp = torch.randn(world * 300, generator=torch.Generator().manual_seed(10 + rank))
    rs = {}
    for flag in (False, True):
        g = bitscom.LowBitGroup(bitwidth=2, simulate_quantization=flag)
        o = torch.empty(300)
        g.reduce_scatter(o, inp)
        ag = torch.empty(world * 300)
        g.all_gather(ag, inp[:300])
        rs[flag] = (o, ag)
    return ({k: v[:2] for k, v in out.items()},
            float((out["none"][2] - out["ef21"][2]).abs().max()),
            float((rs[False][0] - rs[True][0]).abs().max()), float((rs[False][1] - rs[True][1]).abs().max()),
            float((rs[True][1].view(world, 300)[rank] - inp[:300]).abs().max()))


def test_simulate_quantization_honours_every_setting(pools):
    for per_mode, none_vs_ef21, rs_diff, ag_diff, ag_err in pools.run(2, _simulate):
        for name, (diff, sent) in per_mode.items():
            # the same arithmetic in the same order: equal up to float32 rounding of the sums
            assert diff < 1e-5, (name, diff)
            assert sent >= 1000 * 4, (name, sent)   # float32 on the wire, honestly counted
        assert none_vs_ef21 > 1e-3     # ef21 is not silently ignored (it was, before)
        assert rs_diff < 1e-5 and ag_diff < 1e-5
        assert ag_err > 1e-4           # the all-gather really is quantized (2 bits), not exact


def test_compress_decompress_round_trip():
    lb = bitscom.LowBitGroup(bitwidth=4)
    x = torch.randn(512)
    c = lb.compress(x)
    assert c.nbytes == 256 + 8 and lb.decompress(c).shape == x.shape
    assert torch.equal(lb.decompress(c), bitscom.quantization.dequantize_tensor(
        bitscom.quantization.quantize_tensor(x, 4)))


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
    with pytest.raises(ValueError, match=r"bitwidth must be one of \(1, 2, 4, 8, 12, 16, 32\), got 3"):
        bitscom.LowBitGroup(bitwidth=3)
    with pytest.raises(TypeError, match="error_feedback must be a bool.*'yes'"):
        bitscom.LowBitGroup(error_feedback="yes")
    with pytest.raises(ValueError, match="error_feedback_mode='yes'"):
        bitscom.LowBitGroup(error_feedback_mode="yes")
    with pytest.raises(TypeError, match="simulate_quantization"):
        bitscom.LowBitGroup(simulate_quantization="no")
    with pytest.raises(ValueError, match=r"block_size must be a power of two in \[32, 65536\] \(e.g. 128\), got 48"):
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


def _size_mismatch(rank, world, numel, op_name):
    lb = bitscom.LowBitGroup(bitwidth=4)
    x = torch.randn(numel[rank])
    try:
        if op_name == "all_reduce":
            lb.all_reduce(x, key="x")
        elif op_name == "reduce_scatter":
            lb.reduce_scatter(torch.empty(numel[rank]), torch.randn(world * numel[rank]))
        else:
            lb.all_gather(torch.empty(world * numel[rank]), x)
    except ValueError as err:
        msg = str(err)
    else:
        msg = None
    y = torch.ones(10)          # the group is still usable afterwards
    lb.all_reduce(y)
    return msg, float(y.sum())


@pytest.mark.parametrize("numel", [(100, 200), (100, 300)])
@pytest.mark.parametrize("op_name", ["all_reduce", "reduce_scatter", "all_gather"])
def test_different_sizes_per_rank_are_one_clear_error(pools, numel, op_name):
    """Issue 9 item 5: 100 vs 200 elements gave different results per rank, 100 vs 300 SIGABRT."""
    msgs = pools.run(2, _size_mismatch, numel, op_name, timeout=60)
    assert msgs[0][0] is not None and msgs[0][0] == msgs[1][0]
    assert f"rank 0: {numel[0]}, rank 1: {numel[1]}" in msgs[0][0] and op_name in msgs[0][0]
    assert all(abs(s - 20.0) < 0.2 for _, s in msgs)


def _int_avg(rank, world):
    lb = bitscom.LowBitGroup(bitwidth=4)
    try:
        lb.all_reduce(torch.tensor([rank, 1]), op=dist.ReduceOp.AVG)
    except TypeError as err:
        return str(err)
    return None


def test_integer_avg_is_a_clear_error(pools):
    for msg in pools.run(2, _int_avg, timeout=60):
        assert msg is not None and "op=AVG needs a floating tensor" in msg and "torch.int64" in msg


def _call_mismatch(rank, world, case):
    lb = bitscom.LowBitGroup(bitwidth=8)
    x = torch.ones(256)
    try:
        if case == "float_vs_int":
            lb.all_reduce(x if rank == 0 else x.long())
        elif case == "sum_vs_max":
            lb.all_reduce(x, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
        elif case == "fp32_vs_fp16":
            lb.all_reduce(x if rank == 0 else x.half())
        elif case == "int_avg_on_one_rank":      # rank 0's TypeError must not leave rank 1 waiting
            lb.all_reduce(x.long() if rank == 0 else x, op=dist.ReduceOp.AVG)
        elif case == "all_reduce_vs_broadcast":
            lb.all_reduce(x) if rank == 0 else lb.broadcast(x, src=0)
        else:
            raise AssertionError(case)
    except (RuntimeError, TypeError) as err:
        msg = f"{type(err).__name__}: {err}"
    else:
        msg = None
    y = torch.ones(256)          # the group is still usable afterwards
    lb.all_reduce(y)
    return msg, float(y.sum())


@pytest.mark.parametrize("case", ["float_vs_int", "sum_vs_max", "fp32_vs_fp16", "int_avg_on_one_rank",
                                  "all_reduce_vs_broadcast"])
def test_ranks_calling_different_collectives_get_one_clear_error_and_a_usable_group(pools, case):
    """A probe found LowBitGroup's header carried only the element count and SUM/AVG: float vs
    int or SUM vs MAX returned a wrong value on one rank, a timeout on the other and wrong sums
    on both from then on. Now the backend's call header (kind, op, dtype, count) runs first."""
    got = pools.run(2, _call_mismatch, case, timeout=90)
    assert got[0][0] is not None and got[0][0] == got[1][0], got
    assert got[0][0].startswith("RuntimeError: LowBitGroup: ranks called different collectives"), got
    assert all(abs(s - 512.0) < 2.0 for _, s in got), got


def _seed_usage(rank, world):
    """The seed's own LowBitGroup calls: default group, list all_gather/reduce_scatter, hierarchy."""
    group = bitscom.LowBitGroup(bitwidth=4)
    t = torch.full((1000,), float(rank + 1))
    group.all_reduce(t)
    outs = [torch.empty(64) for _ in range(world)]
    group.all_gather(outs, torch.full((64,), float(rank)))
    rs = torch.empty(64)
    group.reduce_scatter(rs, [torch.full((64,), 1.0) for _ in range(world)])
    h = torch.full((1000,), float(rank + 1))
    group.all_reduce(h, local_group=bitscom.intra_group(), inter_group=bitscom.inter_group(),
                     chunk_size=1 << 20, local_quantize=False)
    modes = []
    for mode in ("none", "legacy", "ef21", "ef21_plus"):
        g = bitscom.LowBitGroup(bitwidth=4, error_feedback_mode=mode)
        y = torch.full((500,), float(rank))
        g.all_reduce(y, key="y")
        modes.append(float(y.mean()))
    return (float(t.mean()), [float(o.mean()) for o in outs], float(rs.mean()), float(h.mean()), modes,
            group.rank, group.world_size)


def test_seed_usage_runs_as_written(pools):
    for rank, (t, outs, rs, h, modes, r, w) in enumerate(pools.run(4, _seed_usage)):
        assert abs(t - 10.0) < 0.1 and abs(h - 10.0) < 0.1
        assert [round(o) for o in outs] == [0, 1, 2, 3] and abs(rs - 4.0) < 0.05
        assert all(abs(m - 6.0) < 0.1 for m in modes), modes
        assert (r, w) == (rank, 4)


def test_config_vocabulary_and_aliases():
    from bitscom.collectives import LowBitConfig
    assert LowBitConfig(error_feedback=True) == LowBitConfig(error_feedback_mode="legacy")
    assert LowBitConfig(error_feedback=True).error_feedback_mode == "residual"
    assert LowBitConfig(error_feedback_mode="ef21").error_feedback is True
    plus = LowBitConfig(error_feedback_mode="ef21_plus")
    assert plus.stage2_error_feedback and plus == LowBitConfig(error_feedback_mode="ef21",
                                                               stage2_error_feedback=True)
    assert LowBitConfig.build(bits=2, hierarchical="none", stage2_bits=8) == \
        LowBitConfig(bitwidth=2, stage2_bitwidth=8)
    assert bitscom.LowBitGroup(bitwidth=2).config == bitscom.compressors.LowBit(bitwidth=2).config
    assert LowBitConfig.build(LowBitConfig(error_feedback=True), error_feedback_mode="ef21").ef21
    with pytest.raises(ValueError, match="contradicts"):
        LowBitConfig(error_feedback=True, error_feedback_mode="none")
    with pytest.raises(ValueError, match="'ef' is now called 'legacy'"):
        LowBitConfig(error_feedback_mode="ef")
    with pytest.raises(TypeError, match="unknown low-bit setting 'bitz'"):
        LowBitConfig.build(bitz=4)
    with pytest.raises(ValueError, match="backend_ops"):
        LowBitConfig(backend_ops=("broadcast",))
    with pytest.raises(ValueError, match="all_reduce only"):
        LowBitConfig(error_feedback_mode="ef21", backend_ops=("all_reduce", "all_gather"))


def _exact(world, seeds, n):
    return sum(torch.randn(n, generator=torch.Generator().manual_seed(s)).double() for s in seeds)


def _wait_order(rank, world):
    """Async works waited in a different order on each rank (issue 20 item 11): each work's
    rounds used to be issued in wait order, so the ranks paired different works' payloads."""
    lb = bitscom.LowBitGroup(bitwidth=4)
    other = bitscom.LowBitGroup(bitwidth=4)        # a second object on the same process group
    names = "abc"
    xs = {n: torch.randn(2048, generator=torch.Generator().manual_seed(10 * i + rank)) for i, n in enumerate(names)}
    ws = {"bad": lb.all_reduce(torch.randn(100 + 100 * rank), async_op=True)}   # sizes differ
    ws["a"] = lb.all_reduce(xs["a"], async_op=True, key="a")
    ws["b"] = other.all_reduce(xs["b"], async_op=True, key="b")
    ws["c"] = lb.all_reduce(xs["c"], async_op=True, key="c")
    errors = {}
    for name in (["c", "a", "bad", "b"] if rank == 0 else ["bad", "b", "a", "c"]):
        try:
            ws[name].wait()
        except ValueError as err:
            errors[name] = str(err)
    flat = torch.cat([xs[n] for n in names])
    outs = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(outs, flat)
    rel = {n: float((xs[n].double() - _exact(world, [10 * i + r for r in range(world)], 2048)).norm()
                    / _exact(world, [10 * i + r for r in range(world)], 2048).norm()) for i, n in enumerate(names)}
    return rel, all(torch.equal(o, outs[0]) for o in outs), errors


def test_async_works_waited_in_any_order_are_correct(pools):
    for rel, same, errors in pools.run(2, _wait_order, timeout=60):
        assert same, "the ranks ended with different results"
        assert max(rel.values()) < 0.3, rel       # each result is its own tensor's sum
        assert list(errors) == ["bad"] and "rank 0: 100, rank 1: 200" in errors["bad"]


def _wait_position(rank, world):
    """Waits at different places relative to later calls and exact collectives."""
    lb = bitscom.LowBitGroup(bitwidth=4)
    xs = {n: torch.randn(1024, generator=torch.Generator().manual_seed(20 + 10 * i + rank)) for i, n in enumerate("cd")}
    wc = lb.all_reduce(xs["c"], async_op=True, key="c")
    if rank == 0:
        wc.wait()
    ints = torch.tensor([rank + 1])
    lb.all_reduce(ints)                  # exact: before the wait on rank 1, after it on rank 0
    wd = lb.all_reduce(xs["d"], async_op=True, key="d")
    wd.poll()                            # non-blocking progress keeps the order too
    wd.wait()
    if rank == 1:
        wc.wait()
    rel = {n: float((xs[n].double() - _exact(world, [20 + 10 * i + r for r in range(world)], 1024)).norm()
                    / _exact(world, [20 + 10 * i + r for r in range(world)], 1024).norm()) for i, n in enumerate("cd")}
    return rel, ints.item()


def test_async_works_waited_at_different_places_are_correct(pools):
    for rel, ints in pools.run(2, _wait_position, timeout=60):
        assert max(rel.values()) < 0.3, rel
        assert ints == 3
