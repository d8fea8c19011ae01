"""FrozenVarianceAdamW, Exclude, the TopK/SignSGD warm-up (start_iter), and the convergence
suite's variant settings (opt.X, exclude=).

Single-process tests drive simulated ranks in lockstep through a fake Comm that completes
all-reduces and all-gathers in issue order (so a compressor that overlaps an exact all-reduce
with its inner compressor's rounds is checked without processes); the gloo tests check
DistributedOptimizer and the DDP comm hook on 2 real ranks.
"""
import io
import math
import os
import re
import sys

import pytest
import torch
import torch.nn as nn

import bitscom
from bitscom.cost import sent_bytes
from bitscom.compressors import BucketLayout, Exclude, SignSGD, TensorSlot, TopK, get
from bitscom.error_feedback import SteppedErrorFeedback
from simranks import lockstep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- simulated ranks

def randn(world, numel, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(world)]


def exact_average(gs):
    total = gs[0].clone()
    for g in gs[1:]:
        total += g
    return total / len(gs)


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ---------------------------------------------------------------- FrozenVarianceAdamW

BETAS, LR, EPS = (0.9, 0.95), 3e-3, 1e-8


def _adam_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in ((4, 3), (4,), (2, 4))]


def _groups(params):
    """Two groups of different weight decay, as text_lm uses them."""
    return [{"params": [params[0], params[2]], "weight_decay": 0.1},
            {"params": [params[1]], "weight_decay": 0.0}]


def _set_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_frozen_adamw_is_torch_adamw_until_freeze_then_frozen_variance():
    freeze = 3
    pa, pb = _adam_params(), _adam_params()
    ref = torch.optim.AdamW(_groups(pa), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    opt = bitscom.FrozenVarianceAdamW(_groups(pb), lr=LR, betas=BETAS, eps=EPS, freeze_step=freeze)
    for step in range(1, freeze + 1):
        _set_grads(pa, step)
        _set_grads(pb, step)
        ref.step()
        opt.step()
        for a, b in zip(pa, pb):
            assert torch.equal(a, b), f"step {step}: parameters differ from torch.optim.AdamW"
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(ref.state[a][key], opt.state[b][key]), (step, key)
    assert opt.variance_frozen()

    frozen = {id(p): opt.state[p]["exp_avg_sq"].clone() for p in pb}
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    bc2 = 1 - BETAS[1] ** freeze                      # the bias correction stays at freeze_step
    for step in range(freeze + 1, freeze + 4):
        old = {id(p): (p.detach().double().clone(), opt.state[p]["exp_avg"].double().clone()) for p in pb}
        _set_grads(pb, step)
        opt.step()
        for p in pb:
            v = opt.state[p]["exp_avg_sq"]
            assert torch.equal(v, frozen[id(p)]), f"step {step}: exp_avg_sq changed after freeze_step"
            p_old, m_old = old[id(p)]
            m = BETAS[0] * m_old + (1 - BETAS[0]) * p.grad.double()
            torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m, rtol=1e-6, atol=1e-7)
            bc1 = 1 - BETAS[0] ** step
            expect = p_old * (1 - LR * wd[id(p)]) - LR / bc1 * m / ((v.double() / bc2).sqrt() + EPS)
            torch.testing.assert_close(p.detach().double(), expect, rtol=1e-6, atol=1e-7)
            # the test tells the bias corrections apart: 1 - beta2**step would move p elsewhere
            other = p_old * (1 - LR * wd[id(p)]) - LR / bc1 * m / (
                (v.double() / (1 - BETAS[1] ** step)).sqrt() + EPS)
            assert (other - expect).abs().max() > 1e-5


@pytest.mark.parametrize("kwargs,shown,value", [
    ({"lr": -1}, "lr", -1), ({"freeze_step": 0}, "freeze_step", 0),
    ({"freeze_step": True}, "freeze_step", True), ({"freeze_step": 2.0}, "freeze_step", 2.0),
    ({"betas": (1.0, 0.9)}, "betas[0]", 1.0), ({"betas": (0.9, -0.1)}, "betas[1]", -0.1),
    ({"betas": (0.9,)}, "betas", (0.9,)), ({"eps": float("nan")}, "eps", float("nan")),
    ({"weight_decay": -0.1}, "weight_decay", -0.1)])
def test_frozen_adamw_bad_settings_name_the_value(kwargs, shown, value):
    pattern = re.escape(shown) + r" must be .*got " + re.escape(repr(value))
    with pytest.raises(ValueError, match=pattern):
        bitscom.FrozenVarianceAdamW(_adam_params(), **kwargs)
    opt = bitscom.FrozenVarianceAdamW([_adam_params()[0]])
    with pytest.raises(ValueError, match=pattern):          # a parameter group's own setting too
        opt.add_param_group({"params": [_adam_params()[1]], **kwargs})


def test_torch_adamw_checkpoint_loads_and_continues():
    freeze, k = 4, 2
    pa, pb = _adam_params(), _adam_params()
    torch_opt = torch.optim.AdamW(_groups(pa), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    straight = bitscom.FrozenVarianceAdamW(_groups(pb), lr=LR, betas=BETAS, eps=EPS, freeze_step=freeze)
    for step in range(1, k + 1):
        for ps, o in ((pa, torch_opt), (pb, straight)):
            _set_grads(ps, step)
            o.step()
    saved = roundtrip(torch_opt.state_dict())
    pc = [nn.Parameter(p.detach().clone()) for p in pa]
    resumed = bitscom.FrozenVarianceAdamW(_groups(pc), lr=1.0, betas=(0.5, 0.5), eps=1e-3,
                                          freeze_step=freeze)        # the checkpoint's settings win
    resumed.load_state_dict(saved)
    assert [g["freeze_step"] for g in resumed.param_groups] == [freeze, freeze]
    assert [g["weight_decay"] for g in resumed.param_groups] == [0.1, 0.0]
    for step in range(k + 1, freeze + 3):
        for ps, o in ((pb, straight), (pc, resumed)):
            _set_grads(ps, step)
            o.step()
    for b, c in zip(pb, pc):
        assert torch.equal(b, c)
        assert torch.equal(straight.state[b]["exp_avg_sq"], resumed.state[c]["exp_avg_sq"])
    assert resumed.variance_frozen()


def test_frozen_adamw_refuses_what_it_does_not_implement():
    emb = nn.Embedding(5, 3, sparse=True)
    opt = bitscom.FrozenVarianceAdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    p = _adam_params()
    amsgrad = torch.optim.AdamW(p, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        bitscom.FrozenVarianceAdamW(p).load_state_dict(amsgrad.state_dict())
    with pytest.raises(TypeError):
        bitscom.FrozenVarianceAdamW(p, amsgrad=True)


def test_variance_frozen_is_per_group():
    """Each parameter against its own group's freeze_step: p[0] (freeze 1) steps once, the
    others (freeze 3) three times; then every variance is frozen."""
    p = _adam_params()
    opt = bitscom.FrozenVarianceAdamW([{"params": [p[0]], "freeze_step": 1},
                                       {"params": [p[1], p[2]], "freeze_step": 3}])
    assert not opt.variance_frozen()                 # nothing stepped yet
    for step in range(1, 4):
        _set_grads(p, step)
        if step > 1:
            p[0].grad = None
        opt.step()
        assert opt.variance_frozen() == (step >= 3), step


# ---------------------------------------------------------------- Exclude (simulated ranks)

def _bucket():
    slots = [("fc.weight", (6, 5)), ("fc.bias", (6,)), ("ln.weight", (6,)), ("out.weight", (4, 6)),
             ("out.bias", (4,))]
    out, offset = [], 0
    for name, shape in slots:
        out.append(TensorSlot(name, offset, math.prod(shape), shape))
        offset += math.prod(shape)
    return BucketLayout(3, tuple(out), torch.float32, torch.device("cpu"))


PATTERNS = ("*.bias", "ln.*")


def _kept_layout():
    """The compressed slots packed densely: what the inner compressor alone sees."""
    return BucketLayout(3, (TensorSlot("fc.weight", 0, 30, (6, 5)), TensorSlot("out.weight", 30, 24, (4, 6))),
                        torch.float32, torch.device("cpu"))


def _split(flat, layout, names):
    return torch.cat([flat[s.offset:s.end] for s in layout.slots if s.name in names])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("inner", [TopK(ratio=0.2), SignSGD(majority_vote=False), SignSGD(),
                                   TopK(ratio=0.2, start_iter=1)])
def test_exclude_exact_on_matches_inner_on_the_rest(world, inner):
    layout, kept = _bucket(), _kept_layout()
    comp = Exclude(inner, PATTERNS)
    excluded = [s for s in layout.slots if s.name in ("fc.bias", "ln.weight", "out.bias")]
    kept_names = {"fc.weight", "out.weight"}
    states = [comp.init_state(layout) for _ in range(world)]
    ref_states = [inner.init_state(kept) for _ in range(world)]
    for step in range(3):
        gs = randn(world, layout.numel, seed=step)
        flats = [g.clone() for g in gs]
        sent = lockstep(comp, flats, states, layout)
        subs = [_split(g, layout, kept_names) for g in gs]
        ref_sent = lockstep(inner, subs, ref_states, kept)
        average = exact_average(gs)
        for f in flats:
            assert torch.equal(f, flats[0]), "ranks disagree"
            for s in excluded:
                torch.testing.assert_close(f[s.offset:s.end], average[s.offset:s.end], rtol=1e-6, atol=1e-7)
            assert torch.equal(_split(f, layout, kept_names), subs[0]), "kept slots differ from the inner alone"
        excluded_bytes = 4 * sum(s.numel for s in excluded)
        assert sent == [r + excluded_bytes for r in ref_sent]
        assert sent[0] == sent_bytes(comp, layout, world, step) == sent_bytes(inner, kept, world, step) + excluded_bytes
    assert sent_bytes(comp, layout, world) == sent_bytes(inner, kept, world) + 4 * 16


def test_exclude_everything_is_plain_average_and_nothing_is_inner_alone():
    layout, world = _bucket(), 2
    everything = Exclude(TopK(ratio=0.1), ("*",))
    states = [everything.init_state(layout) for _ in range(world)]
    assert states[0].inner is None
    gs = randn(world, layout.numel, seed=5)
    flats = [g.clone() for g in gs]
    sent = lockstep(everything, flats, states, layout)
    assert torch.equal(flats[0], exact_average(gs)) and torch.equal(flats[1], flats[0])
    assert sent == [4 * layout.numel] * world == [sent_bytes(everything, layout, world)] * world
    saved = roundtrip(states[0].state_dict())
    fresh = everything.init_state(layout)
    fresh.load_state_dict(saved)
    assert fresh.inner is None

    inner = TopK(ratio=0.1)
    nothing = Exclude(inner, ("emb.*",))
    states = [nothing.init_state(layout) for _ in range(world)]
    ref_states = [inner.init_state(layout) for _ in range(world)]
    for step in range(2):
        gs = randn(world, layout.numel, seed=10 + step)
        flats, refs = [g.clone() for g in gs], [g.clone() for g in gs]
        assert lockstep(nothing, flats, states, layout) == lockstep(inner, refs, ref_states, layout)
        assert all(torch.equal(f, r) for f, r in zip(flats, refs))
    assert sent_bytes(nothing, layout, world) == sent_bytes(inner, layout, world)


def test_exclude_state_checkpoint_resumes_bitwise():
    layout, world = _bucket(), 2
    comp = Exclude(TopK(ratio=0.2, start_iter=1), PATTERNS)
    straight = [comp.init_state(layout) for _ in range(world)]
    split = [comp.init_state(layout) for _ in range(world)]
    grads = [randn(world, layout.numel, seed=20 + s) for s in range(4)]
    outs = []
    for gs in grads:
        flats = [g.clone() for g in gs]
        lockstep(comp, flats, straight, layout)
        outs.append(flats[0])
    for gs in grads[:2]:
        lockstep(comp, [g.clone() for g in gs], split, layout)
    saved = [roundtrip(s.state_dict()) for s in split]
    assert saved[0]["inner"]["__state__"]["step"] == 2
    resumed = [comp.init_state(layout) for _ in range(world)]
    for r, d in zip(resumed, saved):
        r.load_state_dict(d)
    assert isinstance(resumed[0].inner, SteppedErrorFeedback) and resumed[0].inner.step == 2
    assert torch.equal(resumed[0].inner.residual, split[0].inner.residual)
    for gs, expect in zip(grads[2:], outs[2:]):
        flats = [g.clone() for g in gs]
        lockstep(comp, flats, resumed, layout)
        assert torch.equal(flats[0], expect)


@pytest.mark.parametrize("kwargs,error,shown", [
    ({"inner": "topk", "patterns": ""}, ValueError, "''"),
    ({"inner": "topk", "patterns": ()}, ValueError, "()"),
    ({"inner": "topk", "patterns": 3}, ValueError, "3"),
    ({"inner": "topk", "patterns": ("*.bias", "")}, ValueError, "('*.bias', '')"),
    ({"inner": None, "patterns": ("*.bias",)}, ValueError, "None"),
    ({"inner": 3, "patterns": ("*.bias",)}, TypeError, "3"),
    ({"inner": Exclude("topk", ("*.bias",)), "patterns": ("ln.*",)}, ValueError, "Exclude(inner=TopK("),
])
def test_exclude_bad_settings_name_the_value(kwargs, error, shown):
    with pytest.raises(error, match=r"Exclude.*got " + re.escape(shown)):
        Exclude(**kwargs)


def test_exclude_from_the_registry():
    comp = get("exclude", inner="topk", patterns=("*.bias",))
    assert comp == Exclude(TopK(), ("*.bias",)) and comp.inner == TopK()
    assert Exclude("signsgd", "*.bias").patterns == ("*.bias",)          # one pattern as a string
    assert Exclude("topk", ["a", "b"]).patterns == ("a", "b")
    assert "patterns=('*.bias',)" in comp.fingerprint() and "TopK(" in comp.fingerprint()
    assert comp.uses_names and not TopK().uses_names


def test_optimizer_refuses_exclude_without_names():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="named_parameters"):
        bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     compression=Exclude("topk", ("*.bias",)))


# ---------------------------------------------------------------- TopK / SignSGD start_iter

WARM = [TopK(ratio=0.1, start_iter=2), SignSGD(start_iter=2), SignSGD(majority_vote=False, start_iter=2)]


@pytest.mark.parametrize("comp", WARM, ids=["topk", "signsgd-vote", "signsgd-ef"])
def test_warm_up_is_exact_then_compressed(comp):
    import dataclasses
    world, layout = 2, BucketLayout.for_tensor(torch.zeros(500))
    cold = dataclasses.replace(comp, start_iter=0)
    states = [comp.init_state(layout) for _ in range(world)]
    cold_states = [cold.init_state(layout) for _ in range(world)]
    for step in range(4):
        gs = randn(world, 500, seed=30 + step)
        flats = [g.clone() for g in gs]
        sent = lockstep(comp, flats, states, layout)
        assert sent == [sent_bytes(comp, layout, world, step)] * world
        if step < 2:
            assert sent == [4 * 500] * world
            assert torch.equal(flats[0], exact_average(gs)) and torch.equal(flats[1], flats[0])
            assert all(s.residual is None or torch.count_nonzero(s.residual) == 0 for s in states)
        else:       # compressed, as a compressor without warm-up from a fresh state
            colds = [g.clone() for g in gs]
            assert sent == lockstep(cold, colds, cold_states, layout) == [sent_bytes(comp, layout, world)] * world
            assert all(torch.equal(f, c) for f, c in zip(flats, colds))
            assert not torch.equal(flats[0], exact_average(gs))
        assert all(s.step == step + 1 for s in states)


def test_warm_up_counts_bucket_dtype_bytes():
    layout = BucketLayout.for_tensor(torch.zeros(100, dtype=torch.float16))
    comp = TopK(ratio=0.1, start_iter=1)
    gs = [g.half() for g in randn(2, 100, seed=1)]
    sent = lockstep(comp, [g.clone() for g in gs], [comp.init_state(layout) for _ in gs], layout)
    assert sent == [200, 200] == [sent_bytes(comp, layout, 2, 0)] * 2


@pytest.mark.parametrize("comp", WARM[:2], ids=["topk", "signsgd"])
def test_resume_in_the_middle_of_warm_up_continues_it(comp):
    import dataclasses
    comp = dataclasses.replace(comp, start_iter=3)
    world, layout = 2, BucketLayout.for_tensor(torch.zeros(300))
    straight = [comp.init_state(layout) for _ in range(world)]
    grads = [randn(world, 300, seed=40 + s) for s in range(5)]
    outs, sizes = [], []
    for gs in grads:
        flats = [g.clone() for g in gs]
        sizes.append(lockstep(comp, flats, straight, layout)[0])
        outs.append(flats[0])
    first = [comp.init_state(layout) for _ in range(world)]
    lockstep(comp, [g.clone() for g in grads[0]], first, layout)
    saved = [roundtrip(s.state_dict()) for s in first]
    assert saved[0]["step"] == 1
    resumed = [comp.init_state(layout) for _ in range(world)]
    for r, d in zip(resumed, saved):
        r.load_state_dict(d)
    for step, (gs, expect, size) in enumerate(zip(grads[1:], outs[1:], sizes[1:]), start=1):
        flats = [g.clone() for g in gs]
        assert lockstep(comp, flats, resumed, layout)[0] == size == sent_bytes(comp, layout, world, step)
        assert torch.equal(flats[0], expect)
    assert sizes[:3] == [1200] * 3 and sizes[3] < 1200


def test_state_without_step_loads_as_step_zero():
    """A residual-only checkpoint (before start_iter existed) resumes at step 0."""
    state = SteppedErrorFeedback(4)
    state.step = 5
    old = {"enabled": True, "residual": torch.ones(4)}
    state.load_state_dict(old)
    assert state.step == 0 and torch.equal(state.residual, torch.ones(4))


@pytest.mark.parametrize("cls", [TopK, SignSGD])
@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_bad_start_iter_names_the_value(cls, bad):
    with pytest.raises(ValueError, match=r"start_iter must be an int >= 0, got " + re.escape(repr(bad))):
        cls(start_iter=bad)


# ---------------------------------------------------------------- real ranks (gloo)

def _small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


EXCLUDED = ("*.bias", "1.*")          # the biases and the LayerNorm


def _local_grads(model, x, y):
    """This rank's own gradients, from a hook-free copy of ``model``."""
    twin = _small_model()
    twin.load_state_dict(model.state_dict())
    nn.functional.mse_loss(twin(x), y).backward()
    return {n: p.grad for n, p in twin.named_parameters()}


def _check_exact_average(rank, world, model, local):
    import fnmatch

    import torch.distributed as dist
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pat) for pat in EXCLUDED):
            avg = local[name].clone()
            dist.all_reduce(avg)
            torch.testing.assert_close(p.grad, avg / world, rtol=1e-6, atol=1e-8)


def _same_on_all_ranks(t):
    import torch.distributed as dist
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _optimizer_exclude_frozen_adam(rank, world):
    comp = Exclude(TopK(ratio=0.2, start_iter=2), EXCLUDED)

    def build():
        model = _small_model()
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        base = bitscom.FrozenVarianceAdamW(groups, lr=1e-2, betas=(0.9, 0.95), freeze_step=2)
        opt = bitscom.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           compression=comp, fusion_threshold_mb=0.0005)
        return model, opt

    def run(model, opt, steps, check=False):
        flat = None
        for step in steps:
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if check:
                _check_exact_average(rank, world, model, _local_grads(model, x, y))
                sent = opt.comm_stats()["step_bytes_sent"]
                assert sent == sum(sent_bytes(comp, lay, world, step) for lay in opt.bucket_layouts), step
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            assert _same_on_all_ranks(flat), f"replicas differ after step {step}"
        return flat

    model, opt = build()
    layouts = opt.bucket_layouts
    kinds = sorted({(bool(st.inner is None), any(s.name.endswith(".bias") for s in lay.slots))
                    for lay, st in zip(layouts, opt.compressor_states)})
    straight = run(model, opt, range(6), check=True)
    assert opt.variance_frozen()
    resumed = []
    for k in (1, 3):                  # in the warm-up (TopK and the variance) and after it
        model, opt = build()
        run(model, opt, range(k))
        saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
        model2, opt2 = build()
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
        inner_steps = [st.inner.step for st in opt2.compressor_states if st.inner is not None]
        assert inner_steps and set(inner_steps) == {k}
        resumed.append(torch.equal(run(model2, opt2, range(k, 6)), straight))
    return len(layouts), kinds, resumed


def test_distributed_optimizer_exclude_topk_frozen_adam(pools):
    for nbuckets, kinds, resumed in pools.run(2, _optimizer_exclude_frozen_adam):
        assert nbuckets >= 2 and resumed == [True, True]
        # one bucket mixes kept and excluded slots, one is all excluded (a plain all-reduce)
        assert (False, True) in kinds and (True, True) in kinds, kinds


def _ddp_exclude(rank, world):
    from bitscom.compressors import names as registered
    comp = Exclude(TopK(ratio=0.2), EXCLUDED)
    net = _small_model()
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0005)
    with pytest.raises(ValueError, match="named_parameters"):
        bitscom.ddp_comm_hook(comp)
    state, hook = bitscom.ddp_comm_hook(comp, named_parameters=net.named_parameters())
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        _check_exact_average(rank, world, net, _local_grads(net, x, y))
        stats = state.comm_stats()
        layouts = state._reducer.layouts[:stats["buckets"]]
        assert {s.name for lay in layouts for s in lay.slots} == {n for n, _ in net.named_parameters()}
        assert stats["step_bytes_sent"] == sum(sent_bytes(comp, lay, world) for lay in layouts)
        opt.step()
        assert _same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    state.close()
    return stats["buckets"], "exclude" in registered()


def test_ddp_hook_exclude_needs_and_uses_parameter_names(pools):
    for nbuckets, registered in pools.run(2, _ddp_exclude):
        assert nbuckets >= 2 and registered


# ---------------------------------------------------------------- scripts/convergence.py

@pytest.fixture(scope="module")
def convergence():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import convergence
    return convergence


def test_every_convergence_variant_builds(convergence):
    for label, (name, settings) in convergence.VARIANTS.items():
        comp = convergence.build_compressor(name, settings)
        assert comp.fingerprint(), label
        if "exclude" in settings:
            assert isinstance(comp, Exclude), label
    for set_name, labels in convergence.SETS.items():
        assert set(labels) <= set(convergence.VARIANTS), set_name


def test_convergence_compressor_seed_follows_the_training_seed(convergence):
    build = convergence.build_compressor
    assert [build("acpsgd", {}, s).seed for s in range(3)] == [0, 1, 2]
    assert [build("powersgd", {}, s).seed for s in range(3)] == [0, 1, 2]
    assert build("acpsgd", {"seed": 5}, 2).seed == 5                   # the variant's own seed wins
    assert build("topk", {}, 2) == build("topk", {})                   # no seed of its own: unchanged


def test_convergence_run_key_tells_optimizer_settings_apart(convergence):
    c = convergence
    assert c.split_settings({"start_iter": 30, "opt.freeze_step": 30}) == ({"start_iter": 30}, {"freeze_step": 30})
    for plain, frozen in (("topk-warm30", "topk-warm30-fv30"), ("ssgd", "ssgd-fv30"),
                          ("signsgd-warm30", "signsgd-warm30-fv30")):
        assert c.run_key(*c.VARIANTS[plain]) != c.run_key(*c.VARIANTS[frozen])
        assert c.build_compressor(*c.VARIANTS[plain]) == c.build_compressor(*c.VARIANTS[frozen])


def test_convergence_parse_variant_with_exclude(convergence):
    label, name, settings = convergence.parse_variant("x=topk:exclude=*.bias|*ln*,start_iter=3")
    assert (label, name, settings) == ("x", "topk", {"exclude": "*.bias|*ln*", "start_iter": 3})
    assert convergence.build_compressor(name, settings) == Exclude(TopK(start_iter=3), ("*.bias", "*ln*"))


@pytest.mark.parametrize("task", ["digits_cnn", "digits_resnet"])   # none, or other options
def test_convergence_refuses_optimizer_settings_on_classification(convergence, tmp_path, monkeypatch, task):
    def no_spawn(*args, **kwargs):
        raise AssertionError("the suite spawned training runs")
    monkeypatch.setattr(convergence.mp, "spawn", no_spawn)
    with pytest.raises(SystemExit, match=f"freeze_step.*{task}"):
        convergence.main(["--tasks", task, "--variants", "topk-warm30-fv30", "--out", str(tmp_path)])


def test_study_local_adam_matches_float64(convergence):
    """The study-only LocalAdam (scripts/conv_local_adam.py) delivers the average over ranks of
    each rank's bias-corrected Adam update of its own gradients (float64 reference, 2 ranks,
    5 steps), and with TopK inside, what TopK makes of those updates."""
    from conv_local_adam import LocalAdam
    b1, b2, eps, world, numel = 0.9, 0.95, 1e-8, 2, 40
    layout = BucketLayout(0, (TensorSlot("w", 0, numel, (numel,)),), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    comp = LocalAdam(get("none"))
    states = [comp.init_state(layout) for _ in range(world)]
    m = [torch.zeros(numel, dtype=torch.float64) for _ in range(world)]
    v = [torch.zeros(numel, dtype=torch.float64) for _ in range(world)]
    for t in range(1, 6):
        gs = [torch.randn(numel, generator=gen) * (r + 1) for r in range(world)]
        flats = [g.clone() for g in gs]
        lockstep(comp, flats, states, layout)
        expect = torch.zeros(numel, dtype=torch.float64)
        for r in range(world):
            g = gs[r].double()
            m[r] = b1 * m[r] + (1 - b1) * g
            v[r] = b2 * v[r] + (1 - b2) * g * g
            expect += (m[r] / (1 - b1 ** t)) / ((v[r] / (1 - b2 ** t)).sqrt() + eps) / world
        assert all(torch.equal(f, flats[0]) for f in flats)
        torch.testing.assert_close(flats[0].double(), expect, rtol=1e-5, atol=1e-6)
    assert sent_bytes(LocalAdam(TopK(ratio=0.1)), layout, 2) == sent_bytes(TopK(ratio=0.1), layout, 2)
