"""The level-wise low-bit reduce-scatter (SDP4Bit's gradient rounds) and the sharded driver on it.

Simulated ranks (one process, an all-to-all per group completed in lockstep) check the
generator against a float64 reduce-scatter and against an independent single-process
reference of the same quantization (bitwise); 4 gloo ranks (2 nodes x 2) check the
GradientReducer driver: exact path vs float64, bytes counted by Comm vs gradient_wire_bytes,
every rank's shard vs the reference, rank-dependent polling, abort."""

import pytest
import torch

import bitscom
from bitscom.comm import Comm, drive
from bitscom.lowbit import Codec, levelwise_chunks, levelwise_reduce_scatter_rounds, levelwise_wire_bytes, mix_seed
from bitscom.sharded.config import ShardedConfig
from bitscom.sharded.gradients import GradientReducer, Topology, gradient_wire_bytes
from bitscom.sharded.rotation import rotate


# ------------------------------------------------------------------ simulated ranks

class SimComm:
    """One simulated rank's Comm on one group: records all-to-alls, counts bytes like Comm."""

    def __init__(self, group, rank, size, log):
        self.group, self.rank, self.size, self.log, self.bytes_sent = group, rank, size, log, 0

    def all_to_all(self, output, input):
        self.bytes_sent += input.numel() * input.element_size()
        self.log.append((self.group, self.rank, output, input.clone()))

    def enter_later_rounds(self):
        pass


def _complete(log):
    """Complete one round's all-to-alls: per group, the i-th call of every member belongs together."""
    groups = {}
    for g, r, out, inp in log:
        groups.setdefault(g, {}).setdefault(r, []).append((out, inp))
    for members in groups.values():
        calls = list(members.values())
        assert len({len(c) for c in calls}) == 1, "members issued different numbers of collectives"
        size = len(members)
        for i in range(len(calls[0])):
            ins = {r: members[r][i][1].view(size, -1) for r in members}
            for r in members:
                members[r][i][0].view(size, -1).copy_(torch.stack([ins[p][r] for p in sorted(members)]))
    log.clear()


def _grid(L, M):
    """Per world rank r = node * L + local: its (intra, inter) SimComms and their log."""
    log = []
    comms = []
    for r in range(L * M):
        node, local = divmod(r, L)
        comms.append((SimComm(("intra", node), local, L, log), SimComm(("inter", local), node, M, log)))
    return comms, log


def _run(gens, log):
    live = list(gens)
    while live:
        still = []
        for g in live:
            try:
                next(g)
                still.append(g)
            except StopIteration:
                pass
        _complete(log)
        live = still


def _inputs(world, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(world * S, generator=g) * torch.logspace(-2, 1, world * S)[torch.randperm(world * S, generator=g)]
            for _ in range(world)]


def _simulate(xs, L, M, codecs, chunks=1, alpha=1.0, hadamard=False, order=None, step=0):
    comms, log = _grid(L, M)
    S = xs[0].numel() // (L * M)
    outs = [torch.zeros(S) for _ in xs]
    gens = [levelwise_reduce_scatter_rounds(x, o, [(ci, codecs[0]), (ce, codecs[1])], chunks=chunks, alpha=alpha,
                                            hadamard=hadamard, order=order, seed_parts=(7, step, r, 0))
            for r, (x, o, (ci, ce)) in enumerate(zip(xs, outs, comms))]
    _run(gens, log)
    return outs, [ci.bytes_sent + ce.bytes_sent for ci, ce in comms]


def _sim_seed(step):
    """The seeds _simulate's seed_parts give: rank ``src``'s stream for chunk k, level (1-based)."""
    return lambda src, k, level: mix_seed(7, step, src, 0, k, level)


def _reference(xs, L, M, codecs, chunks, alpha=1.0, hadamard=False, seed_of=None):
    """Single process, no views or collectives: what rank r = node * L + local must hold."""
    seed_of = _sim_seed(0) if seed_of is None else seed_of
    world, S = L * M, xs[0].numel() // (L * M)
    C = S // chunks
    shards = [(rotate(x) if hadamard else x).view(world, S) for x in xs]

    def q(codec, v, seed):
        row = torch.empty(codec.row_bytes(v.numel()), dtype=torch.uint8)
        codec.encode(v.contiguous(), row, seed)
        return codec.decode(row, v.numel())

    outs = []
    for r in range(world):
        node, local = divmod(r, L)
        pieces = []
        for k in range(chunks):
            cols = slice(k * C, (k + 1) * C)

            def partial(n):   # what rank (n, local) holds after the intra level: [M, C]
                rows = []
                for p in range(L):
                    src = n * L + p
                    block = torch.stack([shards[src][m * L + local, cols] for m in range(M)]).reshape(-1)
                    rows.append(q(codecs[0], block, seed_of(src, k, 1)) if L > 1 else block)
                acc = rows[0].clone()
                for v in rows[1:]:
                    acc += v
                return acc.view(M, C)
            rows = [partial(n)[node] for n in range(M)]
            if M > 1:
                rows = [q(codecs[1], rows[n], seed_of(n * L + local, k, 2)) for n in range(M)]
            acc = rows[0].clone()
            for v in rows[1:]:
                acc += v
            if hadamard:
                acc = rotate(acc)
            pieces.append(acc * alpha if alpha != 1.0 else acc)
        outs.append(torch.cat(pieces))
    return outs


C8, C4 = Codec(8, 512, stochastic=True), Codec(4, 128, stochastic=True)
RAW = Codec(32, 128)


@pytest.mark.parametrize("L,M", [(2, 2), (4, 2), (1, 3), (3, 1)])
def test_full_precision_levels_equal_float64_reduce_scatter(L, M):
    world, S = L * M, 512
    xs = _inputs(world, S, seed=L * 10 + M)
    outs, _ = _simulate(xs, L, M, (RAW, RAW), chunks=2, alpha=1.0 / world)
    exact = (sum(x.double() for x in xs) / world).view(world, S)
    for r, o in enumerate(outs):
        assert torch.allclose(o.double(), exact[r], rtol=1e-6, atol=1e-6), f"rank {r} holds the wrong shard"


@pytest.mark.parametrize("L,M,chunks,hadamard", [(2, 2, 1, False), (2, 2, 4, True), (4, 2, 2, False),
                                                 (1, 4, 2, True), (4, 1, 1, False)])
def test_quantized_shards_are_bitwise_the_single_process_reference(L, M, chunks, hadamard):
    world, S = L * M, 1024
    xs = _inputs(world, S, seed=3)
    outs, sent = _simulate(xs, L, M, (C8, C4), chunks=chunks, alpha=1.0 / world, hadamard=hadamard)
    ref = _reference(xs, L, M, (C8, C4), chunks, alpha=1.0 / world, hadamard=hadamard)
    for r in range(world):
        assert torch.equal(outs[r], ref[r]), f"rank {r}"
    assert sent == [levelwise_wire_bytes(S, [(L, C8), (M, C4)], chunks)] * world


def test_quantized_path_is_unbiased_and_bounded():
    L, M, S = 2, 2, 256
    world = L * M
    xs = _inputs(world, S, seed=5)
    exact = (sum(x.double() for x in xs)).view(world, S)
    codecs = (Codec(4, 128, True), Codec(4, 128, True))
    # stochastic rounding is off by less than one step (bf16 scale rounded up: nothing clips):
    # intra, one step of each of the world's rows; inter, one step of each of M partial sums
    amax = max(x.abs().max().item() for x in xs)
    bound = 1.01 * (world * amax / 7 + M * (L * amax * (1 + 1 / 7)) / 7)
    steps = 64
    mean = torch.zeros(world, S, dtype=torch.float64)
    for step in range(steps):
        got = torch.stack(_simulate(xs, L, M, codecs, step=step)[0]).double()
        assert (got - exact).abs().max().item() <= bound
        mean += got / steps
    one = torch.stack(_simulate(xs, L, M, codecs, step=steps)[0]).double() - exact
    bias = (mean - exact).norm() / exact.norm()
    single = one.norm() / exact.norm()
    # averaging 64 independent roundings shrinks the error by ~8 if unbiased; a bias would stay
    assert bias < single / 4, f"mean error {bias:.4f} vs one step {single:.4f}"


def test_shard_order_argument_picks_the_owner():
    L, M, S = 2, 3, 128
    world = L * M
    xs = _inputs(world, S, seed=9)
    outs, _ = _simulate(xs, L, M, (RAW, RAW), order=(0, 1))   # intra digit most significant
    exact = sum(x.double() for x in xs).view(world, S)
    for r in range(world):
        node, local = divmod(r, L)
        assert torch.allclose(outs[r].double(), exact[local * M + node], rtol=1e-6, atol=1e-6)


def test_bad_arguments_are_named():
    comm = Comm(None, rank=0, size=1)
    x, out = torch.zeros(64), torch.zeros(64)
    with pytest.raises(ValueError, match="chunks=3"):
        levelwise_chunks(x, out, [(comm, C8)], chunks=3)
    with pytest.raises(ValueError, match="order=\\(1,\\)"):
        levelwise_chunks(x, out, [(comm, C8)], order=(1,))
    with pytest.raises(ValueError, match="need 64"):
        levelwise_chunks(torch.zeros(65), out, [(comm, C8)])
    with pytest.raises(ValueError, match=r"hadamard_backend must be one of \('butterfly', 'gemm'\), got 'fft'"):
        levelwise_chunks(x, out, [(comm, C8)], hadamard=True, hadamard_backend="fft")
    with pytest.raises(TypeError, match="Codec"):
        levelwise_chunks(x, out, [(comm, 8)])


def test_solo_levels_copy_the_input_and_send_nothing():
    comm = Comm(None, rank=0, size=1)
    x = torch.randn(256)
    out = torch.empty(256)
    drive(levelwise_reduce_scatter_rounds(x, out, [(comm, C8), (comm, C4)], chunks=2, alpha=0.5), comm)
    assert torch.equal(out, x * 0.5) and comm.bytes_sent == 0


# ------------------------------------------------------------------ the driver on 4 gloo ranks (2 x 2)

def _topology(rank, world, quantized):
    L = 2
    if not quantized:
        return Topology(None, None, None, world, rank, L)
    return Topology(None, bitscom.intra_group(), bitscom.inter_group(), world, rank, L)


def _rank_inputs(rank, world, sizes, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(world * s, generator=g) for s in sizes]


def _driver_case(rank, world, settings, sizes, steps, poll_every):
    cfg = ShardedConfig(**settings)
    topo = _topology(rank, world, cfg.quantized_gradients)
    reducer = GradientReducer(cfg, topo)
    results = []
    for step in range(steps):
        flats = _rank_inputs(rank, world, sizes, step)
        outs = [torch.zeros(s) for s in sizes]
        for b, (f, o) in enumerate(zip(flats, outs)):
            reducer.launch(b, f, o, step)
            if poll_every and b % poll_every == 0:   # rank-dependent polling: order must not depend on it
                reducer.poll()
        sent = reducer.wait_all()
        results.append((outs, sent, sum(gradient_wire_bytes(cfg, topo, s) for s in sizes)))
        assert not reducer.in_flight
    return results


SIZES = [32 * 4 * 6, 32 * 4, 32 * 4 * 3]


def test_exact_path_equals_float64_reduce_scatter(pools):
    world = 4
    res = pools.run(world, _driver_case, {}, SIZES, 1, 1)
    for rank, ((outs, sent, wire),) in enumerate(res):
        assert sent == wire == 4 * world * sum(SIZES)
        for b, s in enumerate(SIZES):
            exact = sum(_rank_inputs(r, world, SIZES, 0)[b].double() for r in range(world)) / world
            assert torch.allclose(outs[b].double(), exact.view(world, s)[rank], rtol=1e-6, atol=1e-7)


def _poll_pattern(rank, world, settings, sizes, steps):
    """The driver with a rank-dependent polling pattern, next to this rank's reference shard
    (computed here: the GEMM Hadamard's last bits depend on the process's BLAS threads)."""
    res = _driver_case(rank, world, settings, sizes, steps, poll_every=[1, 0, 2, 1][rank])
    cfg = ShardedConfig(**settings)
    codecs = (Codec(cfg.gradient_quantization_bits_intra, cfg.gq_group_size_intra, stochastic=True),
              Codec(cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter, stochastic=True))
    refs = [[_reference_for([_rank_inputs(r, world, sizes, step)[b] for r in range(world)], 2, world // 2,
                            codecs, cfg, step, b)[rank] for b in range(len(sizes))] for step in range(steps)]
    return res, refs


@pytest.mark.parametrize("settings", [
    {"quantized_gradients": True, "gradient_alltoall_pipeline": 2},
    {"quantized_gradients": True, "hadamard_transform": True, "gradient_alltoall_pipeline": 4,
     "gradient_quantization_bits_inter": 2, "gq_group_size_inter": 32},
])
def test_two_level_driver_matches_the_reference_and_counts_bytes(pools, settings):
    world, L, M, steps = 4, 2, 2, 2
    cfg = ShardedConfig(**settings)
    intra = Codec(cfg.gradient_quantization_bits_intra, cfg.gq_group_size_intra, stochastic=True)
    inter = Codec(cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter, stochastic=True)
    wire = sum(levelwise_wire_bytes(s, [(L, intra), (M, inter)], cfg.gradient_alltoall_pipeline) for s in SIZES)
    for rank, (res, refs) in enumerate(pools.run(world, _poll_pattern, settings, SIZES, steps)):
        for step in range(steps):
            outs, sent, analytic = res[step]
            assert sent == analytic == wire
            for b in range(len(SIZES)):
                assert torch.equal(outs[b], refs[step][b]), f"step {step} bucket {b} rank {rank}"


def _reference_for(xs, L, M, codecs, cfg, step, bucket):
    """:func:`_reference` with the sharded optimizer's seed parts (seed, step, rank, bucket)."""
    def seed_of(src, k, level):
        return mix_seed(cfg.seed, step, src, bucket, k, level)
    return _reference(xs, L, M, codecs, cfg.gradient_alltoall_pipeline, alpha=1.0 / (L * M),
                      hadamard=cfg.hadamard_transform, seed_of=seed_of)


def _abort_case(rank, world):
    cfg = ShardedConfig(quantized_gradients=True, gradient_alltoall_pipeline=2)
    topo = _topology(rank, world, True)
    reducer = GradientReducer(cfg, topo)
    flats = _rank_inputs(rank, world, SIZES, 0)
    for b, f in enumerate(flats):
        reducer.launch(b, f, torch.zeros(SIZES[b]), 0)
    assert reducer.in_flight
    reducer.abort()                      # every rank forgets the same work
    assert not reducer.in_flight and reducer.wait_all() == 0
    torch.distributed.barrier()
    return _driver_case(rank, world, {"quantized_gradients": True}, SIZES, 1, 0)


def test_abort_forgets_in_flight_work_and_the_next_step_is_clean(pools):
    after = pools.run(4, _abort_case)
    fresh = pools.run(4, _driver_case, {"quantized_gradients": True}, SIZES, 1, 0)
    for a, f in zip(after, fresh):
        assert all(torch.equal(x, y) for x, y in zip(a[0][0], f[0][0]))
