"""The cost model: formulas checked against what real runs count, calibration on synthetic
timings. No timing in any assertion."""

from __future__ import annotations

import math

import pytest
import torch

import bitscom
from bitscom.comm import Comm, Rounds, TorchTransport
from bitscom.compressors import get
from bitscom.cost import (Link, Round, Topology, fit_link, layout_of, parse_samples, predict_step,
                          ready_times, recorded_rounds, round_seconds, rounds_for,
                          choose_fusion_threshold_mb)

NAMES = ["none", "fp16", "bf16", "lowbit", "powersgd", "acpsgd", "topk", "signsgd"]
SHAPES = [(48, 40), (40,), (24, 48), (300,)]          # matrices and 1-D tails: 3612 elements
NUMEL = sum(math.prod(s) for s in SHAPES)


def test_link_and_topology_validate_and_convert():
    link = Link.from_gbit(1, latency_s=1e-4)
    assert link.beta_s_per_byte == pytest.approx(8e-9) and link.gbit == pytest.approx(1.0)
    with pytest.raises(ValueError, match="alpha_s"):
        Link(-1.0, 0.0)
    with pytest.raises(ValueError, match="gbit"):
        Link.from_gbit(0)
    with pytest.raises(ValueError, match="local_size=3"):
        Topology(4, 3)
    with pytest.raises(ValueError, match="kind"):
        Round("gather", 1, "flat")
    assert Topology(8, 4).nodes == 2


def test_round_seconds_matches_the_ring_formulas():
    a, b = 1e-4, 1e-8
    topo = Topology(8, 4, intra=Link(a / 10, b / 10), inter=Link(a, b))
    n = 1 << 20
    # independent float64 reference of each algorithm
    assert round_seconds(Round("all_reduce", n, "flat"), topo) == pytest.approx(14 * a + 14 / 8 * n * b)
    assert round_seconds(Round("all_gather", n, "inter"), topo) == pytest.approx(a + n * b)
    assert round_seconds(Round("all_to_all", n, "intra"), topo) == pytest.approx(3 * a / 10 + 0.75 * n * b / 10)
    assert round_seconds(Round("reduce_scatter", n, "flat"), topo) == pytest.approx(7 * a + 7 / 8 * n * b)
    assert round_seconds(Round("broadcast", n, "flat"), topo) == pytest.approx(3 * (a + n * b))
    assert round_seconds(Round("all_reduce", n, "flat"), Topology(1)) == 0.0


def test_fit_link_recovers_alpha_beta_from_synthetic_timings():
    alpha, beta, p = 2e-4, 4e-9, 4
    sizes = [1 << k for k in range(10, 24, 2)]
    exact = [(n, 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta) for n in sizes]
    fit = fit_link(exact, p)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9) and fit.beta_s_per_byte == pytest.approx(beta, rel=1e-9)
    # multiplicative noise of +-5% moves beta by at most ~5% (slope dominated by the big sizes)
    gen = torch.Generator().manual_seed(0)
    noisy = [(n, t * (1 + 0.1 * (float(torch.rand(1, generator=gen)) - 0.5))) for n, t in exact]
    assert fit_link(noisy, p).beta_s_per_byte == pytest.approx(beta, rel=0.06)
    assert fit_link([(100, 1e-3)], p).alpha_s == 0.0                 # one size: bandwidth only
    assert fit_link([(100, 2e-3), (200, 1e-3)], p).beta_s_per_byte == 0.0   # negative slope
    with pytest.raises(ValueError, match="at least one"):
        fit_link([], p)


def test_parse_samples_reads_the_probe_csv_and_names_bad_lines():
    text = "# probe\nnbytes,seconds\n4096,0.0002\n\n16384,0.0005\n"
    assert parse_samples(text) == [(4096, 0.0002), (16384, 0.0005)]
    with pytest.raises(ValueError, match="header"):
        parse_samples("bytes,s\n1,2\n")
    with pytest.raises(ValueError, match="line 3"):
        parse_samples("nbytes,seconds\n1,0.1\nx,0.2\n")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_formulas_equal_the_rounds_a_local_run_issues(name, world):
    comp = get(name)
    start = getattr(comp, "start_iter", 0)
    layout = layout_of(NUMEL, shapes=SHAPES)
    recorded = recorded_rounds(comp, layout, world, steps=start + 2)
    for step, rounds in enumerate(recorded):
        expect = rounds_for(comp, NUMEL, world, shapes=SHAPES, step=step, warm=step >= start)
        assert rounds == expect, (name, step)


def test_predict_step_overlap_and_ready_times():
    topo = Topology.flat(2, Link(0.0, 1e-6))
    r = [[Round("all_reduce", 1000, "flat")]] * 2          # 1 ms each on 2 ranks
    assert ready_times([1, 3], 0.004) == [0.001, 0.004]
    hidden = predict_step(r, topo, backward_s=0.01, ready_s=[0.001, 0.002])
    assert hidden.step_s == pytest.approx(0.01) and hidden.exposed_s == pytest.approx(0.0)
    late = predict_step(r, topo, backward_s=0.002, ready_s=[0.001, 0.002], codec_s=[0.0005, 0.0])
    assert late.step_s == pytest.approx(0.0035) and late.exposed_s == pytest.approx(0.0015)


def test_flat_rounds_across_nodes_use_the_probed_world_link():
    """A flat ring on 2 nodes x 2 crosses each node link with one stream, while the inter
    fit is one of two concurrent inter groups (half the link on the emulated cluster)."""
    inter, whole = Link(1e-4, 2e-8), Link(1e-4, 1e-8)
    r = Round("all_reduce", 1 << 20, "flat")
    assert round_seconds(r, Topology(4, 2, Link(0.0, 0.0), inter)) == pytest.approx(
        6 * 1e-4 + 1.5 * (1 << 20) * 2e-8)
    assert round_seconds(r, Topology(4, 2, Link(0.0, 0.0), inter, world_link=whole)) == pytest.approx(
        6 * 1e-4 + 1.5 * (1 << 20) * 1e-8)
    # an inter round keeps the inter link; one node ignores world_link (no crossing)
    assert round_seconds(Round("all_reduce", 1 << 20, "inter"), Topology(4, 2, inter=inter, world_link=whole)) \
        == pytest.approx(2 * 1e-4 + (1 << 20) * 2e-8)
    assert Topology(2, 2, intra=Link(0.0, 1e-9), world_link=whole).level("flat")[1] == Link(0.0, 1e-9)
    with pytest.raises(TypeError, match="world_link"):
        Topology(4, 2, world_link=1.0)


def test_predict_step_charges_a_shared_core_codec_to_backward():
    """codec_overlaps=False: codec seconds are taken from backward (one core per rank), so
    later buckets become ready later and backward itself ends later."""
    topo = Topology.flat(2, Link(0.0, 1e-6))
    r = [[Round("all_reduce", 1000, "flat")]] * 2          # 1 ms each on 2 ranks
    args = dict(backward_s=0.01, ready_s=[0.001, 0.01], codec_s=[0.002, 0.003])
    beside = predict_step(r, topo, **args)
    shared = predict_step(r, topo, codec_overlaps=False, **args)
    # beside: bucket 1 starts at its ready time 10 ms, + 3 ms codec + 1 ms comm = 14 ms
    assert beside.step_s == pytest.approx(0.014)
    # shared: bucket 1 is ready 2 ms later (bucket 0's codec ran on backward's core): 12 + 3 + 1
    assert shared.step_s == pytest.approx(0.016) and shared.bucket_end_s[0] == pytest.approx(0.004)
    # with no communication at all the step is backward plus every codec second
    quiet = predict_step([[], []], topo, codec_overlaps=False, **args)
    assert quiet.step_s == pytest.approx(0.01 + 0.002 + 0.003)


def test_predict_step_issues_later_rounds_at_the_engines_polls():
    """The engine advances a bucket's later rounds at its gradient hooks (poll_s) and
    continuously after backward: a second round waits for the next hook."""
    topo = Topology.flat(2, Link(0.0, 1e-6))
    two = [Round("all_reduce", 1000, "flat")] * 2           # two 1 ms rounds per bucket
    args = dict(backward_s=0.01, ready_s=[0.001, 0.004])
    free = predict_step([two, two], topo, **args)
    assert free.bucket_end_s == pytest.approx((0.003, 0.006)) and free.step_s == pytest.approx(0.01)
    hooked = predict_step([two, two], topo, poll_s=[0.001, 0.005, 0.01], **args)
    # bucket 0: round 1 at 1-2 ms, round 2 at the 5 ms hook (the 1 ms hook passed before round 1 ended);
    # bucket 1: round 1 after bucket 0 (6-7 ms), round 2 at the 10 ms hook: ends at 11 ms
    assert hooked.bucket_end_s == pytest.approx((0.006, 0.011)) and hooked.step_s == pytest.approx(0.011)
    # one-round compressors never wait for a hook
    one = [[Round("all_reduce", 1000, "flat")]] * 2
    assert predict_step(one, topo, poll_s=[0.01], **args).bucket_end_s == pytest.approx((0.002, 0.005))


def test_time_codec_times_past_the_compressors_plain_warm_up(monkeypatch):
    """PowerSGD's first start_iter steps are plain all-reduces; timing those instead of the
    compressed step measured 0.9 ms for a bucket whose compressed step costs ~20 ms."""
    from bitscom.cost import time_codec
    comp = get("powersgd", rank=2, start_iter=4)
    lay = layout_of(NUMEL, shapes=SHAPES)
    seen = []
    original = type(comp).reduce

    def spy(self, flat, layout, state, comm):
        seen.append(int(state.step) if hasattr(state, "step") else None)
        return original(self, flat, layout, state, comm)

    monkeypatch.setattr(type(comp), "reduce", spy)
    ticks = iter(range(1000))
    time_codec(comp, lay, 2, repeats=2, warmup=1, clock=lambda: float(next(ticks)))
    # 1 warm-up + 4 plain steps untimed (steps 0-4), then the two timed steps are compressed
    assert seen == [0, 1, 2, 3, 4, 5, 6]


def test_fusion_threshold_follows_latency():
    params = [(f"w{i}", torch.zeros(512, 512)) for i in range(8)]    # 8 MiB in 1 MiB tensors
    slow_msgs = Topology.flat(4, Link(1.0, 1e-9))                     # latency dominates
    assert choose_fusion_threshold_mb(params, slow_msgs) == 64
    free_msgs = Topology.flat(4, Link(0.0, 1e-9))                     # overlap dominates
    assert choose_fusion_threshold_mb(params, free_msgs) <= 1


class Recording(TorchTransport):
    """torch's collectives, each recorded as the Round the model should have predicted."""

    def __init__(self, level):
        self.level, self.log = level, []

    def _rec(self, kind, t):
        self.log.append(Round(kind, t.numel() * t.element_size(), self.level))

    def all_reduce(self, group, tensor, op):
        self._rec("all_reduce", tensor)
        return super().all_reduce(group, tensor, op)

    def all_gather(self, group, output, input):
        self._rec("all_gather", input)
        return super().all_gather(group, output, input)

    def all_to_all(self, group, output, input):
        self._rec("all_to_all", input)
        return super().all_to_all(group, output, input)


def _real_rounds(rank, world, name, steps):
    comp = get(name)
    layout = layout_of(NUMEL, shapes=SHAPES)
    state = comp.init_state(layout)
    out = []
    for step in range(steps):
        flat = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank * 100 + step))
        transport = Recording("flat")
        comm = Comm(None, transport=transport)
        Rounds(comp.reduce(flat, layout, state, comm), [comm]).wait()
        assert comm.bytes_sent == sum(r.nbytes for r in transport.log)
        out.append(transport.log)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_formulas_equal_what_real_gloo_runs_count(pools, world):
    for name in NAMES:
        start = getattr(get(name), "start_iter", 0)
        per_rank = pools.run(world, _real_rounds, name, start + 2, timeout=120)
        for rounds in per_rank:
            for step, seen in enumerate(rounds):
                assert seen == rounds_for(name, NUMEL, world, shapes=SHAPES, step=step,
                                          warm=step >= start), (name, world, step)


def _hier_rounds(rank, world, chunk):
    intra_t, inter_t = Recording("intra"), Recording("inter")
    intra = Comm(bitscom.intra_group(), transport=intra_t)
    inter = Comm(bitscom.inter_group(), transport=inter_t)
    from bitscom.collectives import LowBitConfig, LowBitState, all_reduce_rounds
    from bitscom.comm import drive
    cfg = LowBitConfig(bitwidth=4, intra_bitwidth=8, hierarchy="two_level", chunk_size=chunk)
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    drive(all_reduce_rounds(x, None, cfg, LowBitState(), intra=intra, inter=inter))
    return intra_t.log, inter_t.log, intra.bytes_sent + inter.bytes_sent


@pytest.mark.parametrize("chunk", [None, 1024])
def test_hierarchical_formulas_equal_real_counts_on_2_nodes_by_2(pools, chunk):
    comp = get("lowbit", bitwidth=4, intra_bitwidth=8, hierarchy="two_level", chunk_size=chunk,
               intra_group=object(), inter_group=object())
    expect = rounds_for(comp, NUMEL, 4, local_size=2)
    for intra_log, inter_log, total in pools.run(4, _hier_rounds, chunk, timeout=120):
        # chunks are pipelined (chunk k+1's intra round with chunk k's inter round): same rounds,
        # interleaved
        assert sorted(intra_log, key=repr) == sorted([r for r in expect if r.level == "intra"], key=repr)
        assert sorted(inter_log, key=repr) == sorted([r for r in expect if r.level == "inter"], key=repr)
        assert total == sum(r.nbytes for r in expect)


def _optimizer_bytes(rank, world, name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 48), torch.nn.Tanh(), torch.nn.Linear(48, 24))
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       model.named_parameters(), compression=get(name),
                                       fusion_threshold_mb=0.004)
    seen = []
    for step in range(3):
        x = torch.randn(8, 40, generator=torch.Generator().manual_seed(step * world + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        seen.append(opt.comm_stats()["step_bytes_sent"])
    layouts = [[s.shape for s in lay.slots] for lay in opt._layouts]
    opt.close()
    return seen, layouts


@pytest.mark.parametrize("name", ["none", "fp16", "lowbit", "acpsgd", "topk"])
def test_formulas_equal_the_optimizers_comm_stats(pools, name):
    for seen, layouts in pools.run(2, _optimizer_bytes, name, timeout=120):
        for step, sent in enumerate(seen):
            expect = sum(r.nbytes for shapes in layouts for r in rounds_for(
                name, sum(math.prod(s) for s in shapes), 2, shapes=shapes, step=step))
            assert sent == expect, (name, step)
