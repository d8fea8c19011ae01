"""compression="auto": the decision logic with injected timings (deterministic), identical
plans and bitwise identical replicas on 2 ranks. No timing in any assertion."""

from __future__ import annotations

import logging

import pytest
import torch

import bitscom
from bitscom.compressors import get
from bitscom.cost.auto import ADAM_SAFE, SGD_SAFE, Auto, candidates_for, decide, labels
from bitscom.cost import Link, Topology, layout_of, round_seconds, rounds_for

SHAPES = [(64, 48), (48,)]
LAYOUT = layout_of(64 * 48 + 48, shapes=SHAPES)


def _codec(table):
    return lambda comp, layout, world: table.get(comp.name, 0.0)


def test_decide_prefers_the_earliest_of_equal_costs():
    assert decide([1.0, 0.5, 0.5]) == 1
    assert decide([1.0, 1.0]) == 0
    assert decide([1.0, float("nan")]) == 0


def test_costs_are_codec_plus_the_modelled_rounds():
    link = Link(1e-4, 1e-8)
    codec = {"fp16": 0.001, "bf16": 0.002, "lowbit": 0.003, "powersgd": 0.004}
    auto = Auto(link=link, codec_seconds=_codec(codec))
    costs = auto.costs(LAYOUT, 4, link)
    topo = Topology.flat(4, link)
    for comp, cost in zip(auto.candidates, costs):
        wire = sum(round_seconds(r, topo) for r in rounds_for(comp, LAYOUT.numel, 4, shapes=SHAPES))
        assert cost == pytest.approx(codec.get(comp.name, 0.0) + wire)


def test_free_network_keeps_the_plain_all_reduce_and_slow_one_compresses():
    codec = {"fp16": 1e-4, "bf16": 1e-4, "lowbit": 1e-4, "powersgd": 1e-4}
    auto = Auto(codec_seconds=_codec(codec))
    assert decide(auto.costs(LAYOUT, 2, Link(1e-5, 0.0))) == 0            # never slower
    slow = auto.costs(LAYOUT, 2, Link(1e-5, 1e-6))                        # ~1 MB/s: bytes win
    nbytes = [sum(r.nbytes for r in rounds_for(c, LAYOUT.numel, 2, shapes=SHAPES)) for c in auto.candidates]
    assert auto.candidates[decide(slow)].name == auto.candidates[nbytes.index(min(nbytes))].name


def test_expensive_codec_is_not_chosen_even_when_it_sends_less():
    link = Link(1e-5, 1e-9)                           # 8 Gbit/s: the 12 KB bucket costs ~20 us
    auto = Auto(codec_seconds=_codec({"fp16": 1.0, "bf16": 1.0, "lowbit": 1.0, "powersgd": 1.0}))
    assert decide(auto.costs(LAYOUT, 2, link)) == 0


def test_candidates_follow_the_wrapped_optimizer():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert candidates_for(torch.optim.SGD(p, lr=0.1)) == SGD_SAFE
    assert candidates_for(torch.optim.AdamW(p)) == ADAM_SAFE
    names = {c.name for c in ADAM_SAFE}
    assert names == {"none", "fp16", "bf16", "lowbit", "powersgd"}
    assert [c.rank for c in ADAM_SAFE if c.name == "powersgd"] == [16]


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match="probe_steps"):
        Auto(probe_steps=1)
    with pytest.raises(ValueError, match="candidates"):
        Auto(candidates=())
    assert isinstance(get("auto"), Auto)


def test_state_round_trip_keeps_the_choice_and_the_inner_state():
    auto = Auto()
    state = auto.init_state(LAYOUT)
    state.step, state.samples = 5, [(100, 0.1)]
    state.choose(3)                                   # lowbit
    saved = state.state_dict()
    fresh = auto.init_state(LAYOUT)
    fresh.load_state_dict(saved)
    assert fresh.choice == 3 and fresh.step == 5 and type(fresh.inner) is type(state.inner)
    assert Auto.plan([fresh, auto.init_state(LAYOUT)]) == ["lowbit", None]


def _train(rank, world, injected):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    if injected:       # slow link, only fp16 cheap: the choice is determined, fp16 everywhere
        comp = Auto(link=Link(0.0, 1e-3), codec_seconds=lambda c, l, w: 0.0 if c.name == "fp16" else 10.0)
    else:              # probed link and measured codecs: whatever rank 0 picks, everyone runs it
        comp = "auto"  # the string users write: candidates follow the wrapped optimizer (SGD)
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                       compression=comp, fusion_threshold_mb=0.01)
    assert injected or opt.compression.candidates == SGD_SAFE
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("bitscom")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        for step in range(6):
            x = torch.randn(8, 48, generator=torch.Generator().manual_seed(step * world + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    plan = Auto.plan(opt._reducer.states)
    assert opt.comm_stats()["auto_plan"] == plan           # what users read
    params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return plan, params, [m for m in records if m.startswith("auto:")]


@pytest.mark.parametrize("injected", [True, False])
def test_auto_plans_and_replicas_are_identical_on_2_ranks(pools, injected):
    (plan0, params0, logs0), (plan1, params1, logs1) = pools.run(2, _train, injected, timeout=180)
    assert plan0 == plan1 and None not in plan0
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)
    assert len(logs0) == len(plan0) and logs1 == []          # logged once, by the deciding rank
    if injected:
        assert plan0 == ["fp16"] * len(plan0)


def _auto_fusion(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                       fusion_threshold_mb="auto")
    x = torch.randn(8, 48, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    out = (opt.fusion_threshold_mb, [l.describe() for l in opt._layouts],
           [p.detach().clone() for p in model.parameters()])
    opt.close()
    return out


def test_fusion_threshold_auto_is_one_of_the_candidates_and_the_same_on_every_rank(pools):
    from bitscom.cost import CANDIDATE_MB
    (mb0, plan0, p0), (mb1, plan1, p1) = pools.run(2, _auto_fusion, timeout=120)
    assert mb0 == mb1 and mb0 in CANDIDATE_MB and plan0 == plan1
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def _slowest_rank_decides(rank, world):
    # lowbit's codec is free on rank 0 and 10 s on rank 1; every other codec costs 1 s. On this
    # 1 kB/s link lowbit would win on rank 0's timings alone; the step waits for rank 1.
    seconds = {"none": 0.0, "lowbit": 0.0 if rank == 0 else 10.0}
    link = Link(0.0, 1e-3)
    comp = Auto(candidates=ADAM_SAFE, link=link, codec_seconds=lambda c, l, w: seconds.get(c.name, 1.0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                       compression=comp, fusion_threshold_mb=0.01)
    for step in range(comp.probe_steps + 1):
        torch.manual_seed(step * world + rank)
        model(torch.randn(8, 48)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    plan, layouts = opt.comm_stats()["auto_plan"], list(opt._layouts)
    opt.close()
    return plan, layouts


def test_the_slowest_ranks_codec_time_decides(pools):
    (plan0, layouts), (plan1, _) = pools.run(2, _slowest_rank_decides, timeout=120)
    assert plan0 == plan1 and None not in plan0
    slowest = {"none": 0.0, "lowbit": 10.0}
    auto = Auto(candidates=ADAM_SAFE, link=Link(0.0, 1e-3))
    for layout, chosen in zip(layouts, plan0):
        codec = [slowest.get(c.name, 1.0) for c in auto.candidates]
        expected = auto.candidates[decide(auto.costs(layout, 2, auto.link, codec=codec))].name
        rank0_only = [0.0 if c.name == "lowbit" else s for c, s in zip(auto.candidates, codec)]
        assert auto.candidates[decide(auto.costs(layout, 2, auto.link, codec=rank0_only))].name == "lowbit"
        assert chosen == expected != "lowbit"


def test_labels_tell_apart_candidates_that_share_a_name():
    assert labels(ADAM_SAFE) == ["none", "fp16", "bf16", "lowbit", "powersgd"]
    names = labels(SGD_SAFE)                     # two PowerSGDs: rank 16 and the default rank 8
    assert len(set(names)) == len(names) == len(SGD_SAFE)
    assert names[-2:] == ["powersgd(rank=16, start_iter=0)", "powersgd(rank=8, start_iter=10)"]
    auto = Auto(candidates=SGD_SAFE)
    states = [auto.init_state(LAYOUT) for _ in range(3)]
    states[0].choose(4)
    states[1].choose(5)
    assert Auto.plan(states) == [names[4], names[5], None]     # what comm_stats()["auto_plan"] shows


def _unused_on_one_rank(rank, world):
    # A branch used on rank 0 only (its bucket is ready during backward there, at the end of
    # backward on rank 1), one tensor per bucket. The probe used to wait on each piece inside its
    # round: rank 0 blocked on bucket k's first piece, rank 1 on bucket j's second: a deadlock.
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    head, branch = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)
    named = [(f"{m}.{n}", p) for m, mod in (("trunk", trunk), ("head", head), ("branch", branch))
             for n, p in mod.named_parameters()]
    comp = Auto(candidates=ADAM_SAFE, codec_seconds=lambda c, l, w: 0.0 if c.name == "none" else 1.0)
    opt = bitscom.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.05), named,
                                       compression=comp, fusion_threshold_mb=0)
    for step in range(comp.probe_steps + 2):
        torch.manual_seed(100 * step + rank)
        h = trunk(torch.randn(4, 8))
        y = head(h) + (branch(h) if rank == 0 else 0)
        y.sum().backward()
        opt.step()
        opt.zero_grad()
    samples = [s for st in opt._reducer.states for s in st.samples]
    plan = opt.comm_stats()["auto_plan"]
    params = [p.detach().clone() for _, p in named]
    opt.close()
    return plan, params, samples


def test_probe_with_a_parameter_unused_on_one_rank_does_not_deadlock(pools):
    (plan0, p0, s0), (plan1, p1, _) = pools.run(2, _unused_on_one_rank, timeout=120)
    assert plan0 == plan1 and len(plan0) == 8 and set(plan0) == {"none"}   # codec costs 1 s otherwise
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    # probe steps 1 and 2: 2 + 4 timed pieces per bucket (pieces of at least one element)
    assert s0 and all(nbytes > 0 and 0.0 < seconds < 60.0 for nbytes, seconds in s0)
