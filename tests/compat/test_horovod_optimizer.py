"""Horovod/ACP-SGD drop-in behaviour of DistributedOptimizer and the broadcast helpers.

Issue 11 items 2-4, stated the way Horovod's test_torch.py states them. Each multi-rank test
first tries the API in this (single) process, so that a regression fails at once instead of
failing on the worker pool (which restarts the pool each time).
"""
import torch
import torch.nn as nn

import acpsgd
import bitscom as hvd


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank, step=0):
    g = torch.Generator().manual_seed(10 * rank + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def test_state_dict_is_in_torch_format_and_loads_into_a_plain_optimizer():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sd = opt.state_dict()
    assert {"state", "param_groups"} <= set(sd) and sd["param_groups"][0]["lr"] == 0.1
    plain = torch.optim.SGD(_model().parameters(), lr=0.5, momentum=0.9)
    plain.load_state_dict(sd)
    assert plain.param_groups[0]["lr"] == 0.1
    assert torch.equal(plain.state_dict()["state"][0]["momentum_buffer"],
                       opt.optimizer.state_dict()["state"][0]["momentum_buffer"])
    opt.load_state_dict(plain.state_dict())                 # the plain form loads back too


def test_wrapped_optimizer_is_an_instance_of_the_wrapped_class():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(opt, torch.optim.SGD)
    adam = acpsgd.DistributedOptimizer(torch.optim.Adam(model.parameters()), model.named_parameters())
    assert isinstance(adam, torch.optim.Adam)


def _broadcast_state(rank, world):
    model = _model(seed=rank)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1)),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    cfg = hvd.broadcast_object({"epoch": 3 + rank}, root_rank=0, name="cfg")
    return opt.state_dict()["param_groups"][0]["lr"], cfg


def test_broadcast_state_horovod_style(pools):
    model = _model()
    assert hvd.broadcast_object(7, root_rank=0, name="x") == 7
    hvd.broadcast_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1), root_rank=0, model=model)
    for lr, cfg in pools.run(2, _broadcast_state):
        assert lr == 0.01 and cfg == {"epoch": 3}


def _passes(rank, world):
    model = _model()
    ref = _model().double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    opt.set_backward_passes_per_step(2)
    opt.zero_grad()
    for step in range(2):
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    for r in range(world):                                   # float64: mean over ranks of the
        for step in range(2):                                # sum of each rank's two passes
            x, y = _batch(r, step)
            (nn.functional.mse_loss(ref(x.double()), y.double()) / world).backward()
    return grads, [p.grad for p in ref.parameters()]


def test_set_backward_passes_per_step_accumulates_locally(pools):
    hvd.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1)).set_backward_passes_per_step(2)
    for grads, ref in pools.run(2, _passes):
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-6)


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.out = nn.Linear(4, 1)

    def forward(self, idx):
        return self.out(self.emb(idx)).sum()


def _sparse(rank, world):
    model = _Embed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), sparse_as_dense=True)
    model(torch.tensor([rank, 5])).backward()
    opt.step()
    return model.emb.weight.detach().clone()


def test_sparse_as_dense_reduces_sparse_gradients(pools):
    hvd.DistributedOptimizer(torch.optim.SGD(_Embed().parameters(), lr=0.1), sparse_as_dense=True)
    w0, w1 = pools.run(2, _sparse)
    assert torch.equal(w0, w1)
    ref = _Embed()
    for r in range(2):
        (ref(torch.tensor([r, 5])) / 2).backward()
    expected = ref.emb.weight.detach() - 0.1 * ref.emb.weight.grad.to_dense()
    torch.testing.assert_close(w0, expected)


def _groups(rank, world, groups):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), groups=groups)
    for step in range(2):
        opt.zero_grad()
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_groups_argument_changes_fusion_not_results(pools):
    hvd.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), groups=2)
    a = pools.run(2, _groups, None)
    b = pools.run(2, _groups, 2)
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], b[0]) and torch.equal(b[0], b[1])


def _join(rank, world):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(3 if rank == 0 else 2):                # uneven inputs
        opt.zero_grad()
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return last, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_join_lets_ranks_with_fewer_batches_finish(pools):
    assert callable(getattr(hvd, "join", None))
    (j0, p0), (j1, p1) = pools.run(2, _join, timeout=60)
    assert j0 == j1 and j0 in (0, 1)
    assert torch.equal(p0, p1)


class _HalfCodec(hvd.compression.Compressor):
    @staticmethod
    def compress(tensor):
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def _codec_opt(rank, world, codec):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=_HalfCodec if codec else hvd.Compression.fp16)
    x, y = _batch(rank)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_users_horovod_codec_plugs_into_distributed_optimizer(pools):
    hvd.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), compression=_HalfCodec)
    ours = pools.run(2, _codec_opt, True)
    fp16 = pools.run(2, _codec_opt, False)
    # the adapter does what Compression.fp16 does (cast, divide, sum, cast back)
    assert torch.equal(ours[0], ours[1]) and torch.equal(ours[0], fp16[0])
