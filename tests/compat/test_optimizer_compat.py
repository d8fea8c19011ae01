"""DistributedOptimizer and the broadcast helpers as Horovod users drive them (issue 11).

Written in the manner of Horovod's test/parallel/test_torch.py: each test builds a small
model, runs the public API the way a script would, and checks the result against plain
torch (float64 where numbers matter) and across ranks.
"""

import copy
import pickle

import pytest
import torch
import torch.nn as nn

import bitscom as hvd

pytestmark = pytest.mark.filterwarnings("ignore:bitscom.DistributedOptimizer:UserWarning")


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.ReLU(), nn.Linear(7, 2))


def _data(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(model, opt, rank, steps, sched=None):
    for step in range(steps):
        opt.zero_grad()
        x, y = _data(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _reference(world, steps, make_opt, seed=0):
    """float64, one process: the mean of the ranks' losses on their own batches."""
    model = _net(seed).double()
    opt = make_opt(model)
    for step in range(steps):
        opt.zero_grad()
        for r in range(world):
            x, y = _data(r, step)
            (nn.functional.mse_loss(model(x.double()), y.double()) / world).backward()
        opt.step()
    return _flat(model)


# ------------------------------------------------------------------------ the class

@pytest.mark.parametrize("cls,kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                    (torch.optim.Adam, {"lr": 0.01}),
                                    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
                                    (torch.optim.RMSprop, {"lr": 0.01})])
def test_distributed_optimizer_is_the_wrapped_class(cls, kw):
    model = _net()
    opt = hvd.DistributedOptimizer(cls(model.parameters(), **kw), named_parameters=model.named_parameters())
    assert isinstance(opt, cls) and isinstance(opt, hvd.DistributedOptimizer)
    assert isinstance(opt, torch.optim.Optimizer)
    assert type(opt).__name__ == cls.__name__
    assert type(opt) is type(hvd.DistributedOptimizer(cls(_net().parameters(), **kw)))   # cached class
    assert opt.param_groups[0]["lr"] == kw["lr"]
    with pytest.raises(TypeError, match="wrap it only once"):
        hvd.DistributedOptimizer(opt)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(opt)
    with pytest.raises(TypeError, match="cannot be pickled"):
        copy.deepcopy(opt)


def _scheduled(rank, world, which):
    model = _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    make = {
        "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=3),
        "plateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
    }
    sched = make[which](opt)
    for step in range(3):
        opt.zero_grad()
        x, y = _data(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step(loss.item()) if which == "plateau" else sched.step()
    return opt.param_groups[0]["lr"], _flat(model)


@pytest.mark.parametrize("which", ["step", "onecycle", "plateau"])
def test_lr_schedulers_drive_the_distributed_optimizer(pools, which):
    res = pools.run(2, _scheduled, which, timeout=60)
    plain = torch.optim.SGD(_net().parameters(), lr=0.1, momentum=0.9)
    want = {"step": 0.1 * 0.5 ** 3, "onecycle": None, "plateau": 0.1}[which]
    if want is None:
        sched = torch.optim.lr_scheduler.OneCycleLR(plain, max_lr=0.2, total_steps=3)
        for _ in range(3):
            plain.step()
            sched.step()
        want = plain.param_groups[0]["lr"]
    for lr, params in res:
        assert lr == pytest.approx(want)
        assert torch.equal(params, res[0][1])


# -------------------------------------------------------------------- state dicts

def _state_dicts(rank, world):
    model = _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression="fp16")
    _train(model, opt, rank, 2)
    sd = opt.state_dict()
    keys = sorted(sd)
    # into a plain optimizer
    plain = torch.optim.SGD(_net().parameters(), lr=0.5, momentum=0.9)
    plain.load_state_dict(sd)
    plain_ok = plain.param_groups[0]["lr"] == 0.1 and torch.equal(
        plain.state_dict()["state"][0]["momentum_buffer"], sd["state"][0]["momentum_buffer"])
    # the three forms into a fresh DistributedOptimizer
    loaded = []
    for form in ("new", "old", "plain"):
        m2 = _net()
        o2 = hvd.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.5, momentum=0.9),
                                      named_parameters=m2.named_parameters(), compression="fp16")
        if form == "new":
            o2.load_state_dict(sd)
        elif form == "old":
            o2.load_state_dict({"optimizer": {k: v for k, v in sd.items() if k != "bitscom"},
                                "bitscom": sd["bitscom"]})
        else:
            o2.load_state_dict(plain.state_dict())
        loaded.append((o2.param_groups[0]["lr"],
                       torch.equal(o2.state[o2.param_groups[0]["params"][0]]["momentum_buffer"],
                                   sd["state"][0]["momentum_buffer"])))
    try:
        opt.load_state_dict({"weights": 1})
        bad = None
    except ValueError as err:
        bad = str(err)
    return keys, plain_ok, loaded, bad


def test_state_dict_is_torch_format_and_loads_every_way(pools):
    for keys, plain_ok, loaded, bad in pools.run(2, _state_dicts, timeout=60):
        assert keys == ["bitscom", "param_groups", "state"]
        assert plain_ok
        assert loaded == [(0.1, True)] * 3
        assert "expected the keys 'state' and 'param_groups'" in bad


# ------------------------------------------------------------------ new arguments

def _grouped(rank, world, groups):
    model = _net()
    if groups == "explicit":
        groups = [[model[0].weight, model[4].weight], [model[2].bias]]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), groups=groups)
    _train(model, opt, rank, 3)
    return [[s.name for s in layout.slots] for layout in opt.bucket_layouts], _flat(model)


@pytest.mark.parametrize("groups,expect", [
    (None, [["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]]),
    (2, [["4.bias", "4.weight", "2.bias"], ["2.weight", "0.bias", "0.weight"]]),
    (6, [["4.bias"], ["4.weight"], ["2.bias"], ["2.weight"], ["0.bias"], ["0.weight"]]),
    ("explicit", [["4.bias"], ["2.bias"], ["2.weight"], ["0.bias"], ["4.weight", "0.weight"]]),
])
def test_groups_choose_the_buckets_not_the_result(pools, groups, expect):
    res = pools.run(2, _grouped, groups, timeout=60)
    want = _reference(2, 3, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    for layouts, params in res:
        assert layouts == expect
        assert torch.equal(params, res[0][1])
        torch.testing.assert_close(params.double(), want, rtol=1e-5, atol=1e-6)


def test_groups_reject_foreign_or_repeated_parameters():
    model = _net()
    with pytest.raises(ValueError, match="not a trainable parameter"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 groups=[[torch.zeros(3, requires_grad=True)]])
    with pytest.raises(ValueError, match="one group only"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 groups=[[model[0].weight], [model[0].weight]])


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(12, 3, sparse=True)
        self.head = nn.Linear(3, 1)

    def forward(self, idx):
        return self.head(self.emb(idx)).square().mean()


def _sparse(rank, world, as_dense):
    model = _Bag()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), sparse_as_dense=as_dense)
    try:
        model(torch.tensor([rank, 7, 2 * rank + 3])).backward()
        opt.step()
    except TypeError as err:
        return str(err)
    return _flat(model)


def test_sparse_as_dense(pools):
    got = pools.run(2, _sparse, True, timeout=60)
    ref = _Bag().double()
    for r in range(2):
        (ref(torch.tensor([r, 7, 2 * r + 3])) / 2).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * (p.grad.to_dense() if p.grad.is_sparse else p.grad)
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0].double(), _flat(ref), rtol=1e-6, atol=1e-7)
    # Horovod's default (sparse_as_dense=False) reduces the sparse gradient as sparse: same step
    sparse = pools.run(2, _sparse, False, timeout=60)
    assert torch.equal(sparse[0], sparse[1])
    torch.testing.assert_close(sparse[0].double(), _flat(ref), rtol=1e-6, atol=1e-7)


def _set_passes(rank, world):
    model = _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    _train(model, opt, rank, 1)
    opt.set_backward_passes_per_step(3)
    opt.zero_grad()
    for k in range(3):
        x, y = _data(rank, 10 + k)
        nn.functional.mse_loss(model(x), y).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    opt.step()
    try:
        opt.set_backward_passes_per_step(0)
        bad = None
    except ValueError as err:
        bad = str(err)
    return grads, bad


def test_set_backward_passes_per_step(pools):
    res = pools.run(2, _set_passes, timeout=60)
    model = _net().double()
    ref_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt.zero_grad()
    for r in range(2):
        x, y = _data(r, 0)
        (nn.functional.mse_loss(model(x.double()), y.double()) / 2).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    for r in range(2):
        for k in range(3):
            x, y = _data(r, 10 + k)
            (nn.functional.mse_loss(model(x.double()), y.double()) / 2).backward()
    want = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    for grads, bad in res:
        torch.testing.assert_close(grads.double(), want, rtol=1e-5, atol=1e-6)
        assert "backward_passes_per_step must be an int >= 1, got 0" in bad


# ----------------------------------------------------------------------- broadcasts

def _bcast(rank, world):
    model = _net(seed=rank)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.001 * (rank + 1)),
                                   named_parameters=model.named_parameters(), compression="powersgd")
    _train(model, opt, rank, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=1)
    hvd.broadcast_optimizer_state(opt, root_rank=1, model=model)
    obj = hvd.broadcast_object({"rank": rank, "tensor": torch.arange(3) + rank}, root_rank=1, name="meta")
    return _flat(model), opt.state_dict(), obj


def test_broadcast_helpers_horovod_signatures(pools):
    res = pools.run(3, _bcast, timeout=90)
    for params, sd, obj in res:
        assert torch.equal(params, res[1][0])
        assert sd["param_groups"][0]["lr"] == pytest.approx(0.002)
        assert torch.equal(sd["state"][0]["exp_avg"], res[1][1]["state"][0]["exp_avg"])
        assert obj["rank"] == 1 and torch.equal(obj["tensor"], torch.arange(3) + 1)
