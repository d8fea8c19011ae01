"""bitscom's Horovod module-level collectives, tested the way Horovod's test_torch.py tests its own.

Each multi-rank test runs on 2 gloo ranks of the shared pool; every rank builds its input from
a seed derived from its rank, so the parent can rebuild all inputs and compare each rank's
result with a float64 reference (exact for integers) and the ranks with each other.
"""
import pytest
import torch
import torch.distributed as dist

import bitscom as hvd

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.uint8, torch.int8, torch.int32, torch.int64]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _input(rank, dtype, shape=(3, 5), seed=0):
    """Rank-specific values that are exact in every dtype (small integers / 8)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    lo = 0 if dtype == torch.uint8 else -8
    vals = torch.randint(lo, 9, shape, generator=g)
    return (vals.to(torch.float64) / 8).to(dtype) if dtype.is_floating_point else vals.to(dtype)


def _all_inputs(world, dtype, shape=(3, 5), seed=0):
    return [_input(r, dtype, shape, seed).to(torch.float64) for r in range(world)]


def _check(results, expected, dtype):
    for r, out in enumerate(results):
        assert out.dtype == dtype, f"rank {r} returned {out.dtype}"
        if dtype.is_floating_point:
            torch.testing.assert_close(out.to(torch.float64), expected, rtol=TOL[dtype], atol=TOL[dtype])
        else:
            assert torch.equal(out.to(torch.float64), expected), f"rank {r}: {out} != {expected}"
        assert torch.equal(out, results[0]), "ranks differ"


# -- allreduce -----------------------------------------------------------------------------
def _allreduce_all(rank, world):
    out = {}
    for dtype in FLOATS + INTS:
        x = _input(rank, dtype)
        before = x.clone()
        out[(dtype, "avg")] = hvd.allreduce(x)
        out[(dtype, "sum")] = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}")
        out[(dtype, "min")] = hvd.allreduce(x, op=hvd.Min)
        out[(dtype, "max")] = hvd.allreduce(x, op=hvd.Max)
        out[(dtype, "prod")] = hvd.allreduce(x, op=hvd.Product)
        out[(dtype, "legacy_sum")] = hvd.allreduce(x, average=False)
        assert torch.equal(x, before), "allreduce modified its input"
    return out


def test_allreduce_ops_and_dtypes_match_float64_reference(pools):
    world = 2
    results = pools.run(world, _allreduce_all)
    for dtype in FLOATS + INTS:
        xs = torch.stack(_all_inputs(world, dtype))
        total = xs.sum(0)
        avg = total / world if dtype.is_floating_point else torch.trunc(total / world)
        for key, ref in [("avg", avg), ("sum", total), ("legacy_sum", total), ("min", xs.min(0).values),
                         ("max", xs.max(0).values), ("prod", xs.prod(0))]:
            if dtype == torch.uint8 and key == "prod":
                ref = torch.remainder(ref, 256)          # uint8 products wrap, as in torch
            if dtype == torch.int8 and key in ("sum", "legacy_sum", "avg", "prod"):
                ref = ((ref + 128) % 256) - 128 if key != "avg" else torch.trunc(
                    (((total + 128) % 256) - 128) / world)
            _check([r[(dtype, key)] for r in results], ref, dtype)


def _scaled(rank, world):
    x = _input(rank, torch.float64)
    return (hvd.allreduce(x, prescale_factor=0.5, postscale_factor=3.0),
            hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0),
            hvd.allreduce(x, op=hvd.Max, postscale_factor=-1.0))


def test_prescale_and_postscale_follow_horovods_definition(pools):
    results = pools.run(2, _scaled)
    xs = torch.stack(_all_inputs(2, torch.float64))
    _check([r[0] for r in results], 3.0 * (0.5 * xs).sum(0) / 2, torch.float64)
    _check([r[1] for r in results], (2.0 * xs).sum(0), torch.float64)
    _check([r[2] for r in results], -xs.max(0).values, torch.float64)


def _inplace(rank, world):
    x = _input(rank, torch.float32)
    same = hvd.allreduce_(x, op=hvd.Sum) is x
    t = _input(rank, torch.float32, shape=(5, 3)).t()           # non-contiguous view
    base = t
    hvd.allreduce_(t)
    h = hvd.allreduce_async_(y := _input(rank, torch.int64, seed=2), op=hvd.Sum)
    returned = hvd.synchronize(h)
    return same, x, base, y, returned is y


def test_inplace_variants_write_into_the_argument(pools):
    results = pools.run(2, _inplace)
    xs = _all_inputs(2, torch.float32)
    ts = [t.t() for t in _all_inputs(2, torch.float32, shape=(5, 3))]
    ys = _all_inputs(2, torch.int64, seed=2)
    assert all(r[0] and r[4] for r in results), "in-place forms must return their argument"
    _check([r[1] for r in results], xs[0] + xs[1], torch.float32)
    _check([r[2] for r in results], (ts[0] + ts[1]) / 2, torch.float32)
    _check([r[3] for r in results], ys[0] + ys[1], torch.int64)


def _async(rank, world):
    xs = [_input(rank, torch.float32, seed=s) for s in range(4)]
    handles = [hvd.allreduce_async(x, name=f"t{i}", op=hvd.Sum if i % 2 else hvd.Average)
               for i, x in enumerate(xs)]
    handles.append(hvd.allgather_async(torch.full((rank + 1, 2), float(rank))))
    handles.append(hvd.broadcast_async(_input(rank, torch.float32, seed=9), root_rank=1))
    out = [hvd.synchronize(h) for h in reversed(handles)][::-1]   # out of call order
    spins = 0
    h = hvd.allreduce_async(torch.ones(3))
    while not hvd.poll(h):
        spins += 1
    assert hvd.poll(h) and torch.equal(hvd.synchronize(h), torch.ones(3))
    assert torch.equal(hvd.synchronize(handles[0]), out[0])      # a finished handle stays readable
    return out, repr(handles[0])


def test_async_handles_complete_in_any_synchronize_order(pools):
    results = pools.run(2, _async)
    for s in range(4):
        xs = _all_inputs(2, torch.float32, seed=s)
        ref = xs[0] + xs[1] if s % 2 else (xs[0] + xs[1]) / 2
        _check([r[0][s] for r in results], ref, torch.float32)
    gathered = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    _check([r[0][4] for r in results], gathered, torch.float32)
    _check([r[0][5] for r in results], _all_inputs(2, torch.float32, seed=9)[1], torch.float32)
    assert "allreduce" in results[0][1] and "'t0'" in results[0][1]


def _grad(rank, world):
    x = _input(rank, torch.float64).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * (rank + 1)).sum().backward()
    g_sum = x.grad.clone()
    x.grad = None
    hvd.allreduce(x).sum().backward()
    g_avg = x.grad.clone()
    y = torch.ones(rank + 1, 2, dtype=torch.float64, requires_grad=True)
    (hvd.allgather(y) * (rank + 1)).sum().backward()
    z = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (hvd.broadcast(z, root_rank=1) * (rank + 1)).sum().backward()
    w = torch.arange(4.0, dtype=torch.float64).requires_grad_()
    out = hvd.alltoall(w)
    (out * (rank + 1)).sum().backward()
    return g_sum, g_avg, y.grad, z.grad, w.grad


def test_gradients_flow_through_collectives_like_horovods(pools):
    results = pools.run(2, _grad)
    for rank, (g_sum, g_avg, gy, gz, gw) in enumerate(results):
        assert torch.equal(g_sum, torch.full((3, 5), 3.0, dtype=torch.float64))   # 1 + 2
        assert torch.equal(g_avg, torch.ones(3, 5, dtype=torch.float64))
        assert torch.equal(gy, torch.full((rank + 1, 2), 3.0, dtype=torch.float64))
        assert torch.equal(gz, torch.full((3,), 3.0 if rank == 1 else 0.0, dtype=torch.float64))
        # rank r's rows [2j, 2j+1] went to rank j, whose loss weighs them by j + 1
        assert torch.equal(gw, torch.tensor([1.0, 1.0, 2.0, 2.0], dtype=torch.float64))


# -- allgather / broadcast / alltoall --------------------------------------------------------
def _allgather(rank, world):
    out = {}
    for dtype in FLOATS + INTS + [torch.bool]:
        x = _input(rank, torch.int64, shape=(rank + 2, 3)).to(dtype) if dtype != torch.bool else \
            torch.tensor([[rank == 0, True]] * (rank + 1))
        out[dtype] = hvd.allgather(x, name=f"g.{dtype}")
    out["object"] = hvd.allgather_object({"rank": rank})
    return out


def test_allgather_concatenates_uneven_first_dimensions(pools):
    results = pools.run(2, _allgather)
    for dtype in FLOATS + INTS:
        ref = torch.cat([_input(r, torch.int64, shape=(r + 2, 3)).to(dtype) for r in range(2)])
        _check([r[dtype] for r in results], ref.to(torch.float64), dtype)
    ref_bool = torch.tensor([[True, True], [False, True], [False, True]])
    assert all(torch.equal(r[torch.bool], ref_bool) for r in results)
    assert all(r["object"] == [{"rank": 0}, {"rank": 1}] for r in results)


def _broadcast(rank, world):
    out = {}
    for dtype in FLOATS + INTS + [torch.bool]:
        for root in range(world):
            x = _input(rank, torch.int64).to(dtype)
            keep = x.clone()
            out[(dtype, root)] = hvd.broadcast(x, root_rank=root)
            assert torch.equal(x, keep)
            y = _input(rank, torch.int64).to(dtype)
            assert hvd.broadcast_(y, root) is y
            out[(dtype, root, "_")] = y
    return out


def test_broadcast_and_broadcast_inplace_from_every_root(pools):
    results = pools.run(2, _broadcast)
    for dtype in FLOATS + INTS + [torch.bool]:
        for root in range(2):
            ref = _input(root, torch.int64).to(dtype)
            for r in results:
                assert torch.equal(r[(dtype, root)], ref) and torch.equal(r[(dtype, root, "_")], ref)


def _alltoall(rank, world):
    x = torch.arange(6.0).view(6, 1) + 10 * rank
    equal = hvd.alltoall(x)
    splits = torch.tensor([1, 5]) if rank == 0 else torch.tensor([4, 2])
    uneven, received = hvd.alltoall(x, splits=splits, name="uneven")
    return equal, uneven, received


def test_alltoall_equal_and_uneven_splits(pools):
    (e0, u0, r0), (e1, u1, r1) = pools.run(2, _alltoall)
    col = lambda *v: torch.tensor(v, dtype=torch.float32).view(-1, 1)  # noqa: E731
    assert torch.equal(e0, col(0, 1, 2, 10, 11, 12)) and torch.equal(e1, col(3, 4, 5, 13, 14, 15))
    assert torch.equal(u0, col(0, 10, 11, 12, 13)) and r0.tolist() == [1, 4] and r0.dtype == torch.int32
    assert torch.equal(u1, col(1, 2, 3, 4, 5, 14, 15)) and r1.tolist() == [5, 2]


def _groups(rank, world):
    sub = dist.new_group([0, 1])
    a = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_group=sub)
    b = hvd.grouped_allreduce([torch.tensor([1.0 + rank]), torch.tensor([4, 6]) * (rank + 1)], op=hvd.Sum)
    hvd.barrier()
    return a, b


def test_process_group_grouped_allreduce_and_barrier(pools):
    for a, b in pools.run(2, _groups):
        assert a.tolist() == [1.0] and b[0].tolist() == [3.0] and b[1].tolist() == [12, 18]


# -- errors: the same clear error on every rank, never a hang ------------------------------------
def _mismatch(rank, world, case):
    try:
        if case == "shape":
            hvd.allreduce(torch.ones(3 + rank))
        elif case == "dtype":
            hvd.allreduce(torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64))
        elif case == "op":
            hvd.allreduce(torch.ones(3), op=hvd.Sum if rank == 0 else hvd.Max)
        elif case == "root":
            hvd.broadcast(torch.ones(3), root_rank=rank)
        elif case == "kind":
            (hvd.allreduce if rank == 0 else hvd.allgather)(torch.ones(3))
        elif case == "gather_shape":
            hvd.allgather(torch.ones(2, 3 + rank))
        elif case == "splits":
            hvd.alltoall(torch.ones(4, 2), splits=[1, 3] if rank == 0 else [1, 1])
        elif case == "bad_root":
            hvd.broadcast(torch.ones(2), root_rank=5)
        elif case == "scalar_gather":
            hvd.allgather(torch.tensor(1.0) if rank == 0 else torch.ones(1))
        elif case == "postscale":
            hvd.allreduce(torch.ones(2), postscale_factor=1.0 + rank)
        elif case == "bool_on_one_rank":     # rank 0's error must not shift the pairing of later calls
            hvd.allreduce(torch.ones(2, dtype=torch.bool) if rank == 0 else torch.ones(2), op=hvd.Sum)
        elif case == "int_prescale_on_one_rank":
            hvd.allreduce(torch.ones(2, dtype=torch.int64) if rank == 0 else torch.ones(2), prescale_factor=0.5)
        elif case == "names":
            hvd.allreduce(torch.ones(2), name="a" if rank == 0 else "b")
    except (RuntimeError, ValueError, TypeError) as err:
        after = hvd.allreduce(torch.tensor([1.0 + rank]), op=hvd.Sum)   # the world still works
        return type(err).__name__, str(err), after.item()
    return None


@pytest.mark.parametrize("case, words", [
    ("shape", ["shape", "(3,)", "(4,)"]), ("dtype", ["dtype", "float32", "float64"]),
    ("op", ["op", "Sum", "Max"]), ("root", ["root_rank"]), ("kind", ["operation", "allgather"]),
    ("gather_shape", ["beyond the first dimension"]), ("splits", ["rank 1", "splits"]),
    ("bad_root", ["root_rank 5", "not a rank"]), ("scalar_gather", ["at least one dimension"]),
    ("postscale", ["postscale_factor"]), ("bool_on_one_rank", ["on rank 0", "bool"]),
    ("int_prescale_on_one_rank", ["on rank 0", "prescale_factor"]),
    ("names", ["differently named calls"])])
def test_cross_rank_mismatch_raises_on_every_rank(pools, case, words):
    results = pools.run(2, _mismatch, case)
    assert results[0] is not None and results[1] is not None, f"{case}: no error raised"
    for kind, msg, after in results:
        assert kind in ("RuntimeError", "ValueError", "TypeError")
        assert all(w in msg for w in words), msg
        assert after == 3.0


def _named_async_in_another_order(rank, world):
    a, b = torch.full((2,), 1.0 + rank), torch.full((2,), 100.0 * (rank + 1))
    order = [("a", a), ("b", b)] if rank == 0 else [("b", b), ("a", a)]
    handles = {name: hvd.allreduce_async(t, name=name, op=hvd.Sum) for name, t in order}
    errors = {}
    for name, h in handles.items():
        try:
            hvd.synchronize(h)
        except RuntimeError as err:
            errors[name] = str(err)
    after = hvd.allreduce(torch.tensor([1.0 + rank]), op=hvd.Sum)     # the world still works
    return errors, after.item()


def test_named_async_calls_submitted_in_another_order_are_an_error_not_a_mix(pools):
    """A probe found rank 0 submitting 'a' then 'b' and rank 1 'b' then 'a' reduced a with b on
    both ranks (102 for each, no error); Horovod pairs by name and gives 3 and 201. bitscom pairs
    by order, so the header carries the name and the mix is an error on every rank."""
    for errors, after in pools.run(2, _named_async_in_another_order):
        assert set(errors) == {"a", "b"}, errors
        assert all("differently named calls" in m and "same order" in m for m in errors.values()), errors
        assert after == 3.0


def test_local_argument_errors_are_clear():
    t = torch.ones(3)
    with pytest.raises(NotImplementedError, match="process sets"):
        hvd.allreduce(t, process_set=object())
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(t, op=hvd.Adasum)
    with pytest.raises(ValueError, match="op must be"):
        hvd.allreduce(t, op="sum")
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(t, average=True, op=hvd.Sum)
    with pytest.raises(TypeError, match="name must be"):
        hvd.allreduce_async(t, name=3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.allgather([1, 2])
    with pytest.raises(ValueError, match="prescale_factor"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), prescale_factor=0.5)
    with pytest.raises(TypeError, match="bool"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="sparse"):
        hvd.allreduce(torch.eye(2).to_sparse())
    with pytest.raises(TypeError, match="root_rank must be an int"):
        hvd.broadcast(t, root_rank="0")
    with pytest.raises(TypeError, match="Handle"):
        hvd.synchronize(3)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="Adasum is not supported"):
        hvd.DistributedOptimizer(opt, op=hvd.Adasum)      # Horovod's --use-adasum path


def test_single_process_semantics_without_torch_distributed():
    assert not dist.is_initialized()
    x = torch.tensor([1.0, -3.0])
    assert torch.equal(hvd.allreduce(x), x) and hvd.allreduce(x) is not x
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, postscale_factor=2.0), 2 * x)
    assert torch.equal(hvd.allgather(x), x)
    assert torch.equal(hvd.broadcast(x, 0), x)
    with pytest.raises(ValueError, match="root_rank 1"):
        hvd.broadcast(x, 1)
    assert hvd.synchronize(hvd.allreduce_async(x)).tolist() == [1.0, -3.0]
    assert hvd.allgather_object("a") == ["a"]
    out, received = hvd.alltoall(torch.arange(3.0), splits=[3])
    assert torch.equal(out, torch.arange(3.0)) and received.tolist() == [3]
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(torch.arange(3.0), splits=[2])


def _skewed(rank, world):
    """Ranks reach poll/synchronize at different moments: payload rounds must still pair up."""
    import time
    h1 = hvd.allgather_async(torch.full((rank + 1,), float(rank)))
    h2 = hvd.allreduce_async(torch.tensor([1.0 + rank]), op=hvd.Sum)
    bad = hvd.allreduce_async(torch.ones(2 + rank))          # shapes differ: fails at synchronize
    h3 = hvd.broadcast_async(torch.tensor([10.0 * (rank + 1)]), root_rank=1)
    if rank == 0:
        while not hvd.poll(h3):                              # drives every earlier handle
            pass
    else:
        time.sleep(0.3)
    out3, out2 = hvd.synchronize(h3), hvd.synchronize(h2)
    try:
        hvd.synchronize(bad)
        err = None
    except RuntimeError as e:
        err = str(e)
    return hvd.synchronize(h1), out2, out3, err


def test_async_handles_pair_up_when_ranks_poll_at_different_times(pools):
    for gathered, total, root, err in pools.run(2, _skewed):
        assert gathered.tolist() == [0.0, 1.0, 1.0] and total.tolist() == [3.0]
        assert root.tolist() == [20.0]
        assert err is not None and "shape" in err
