"""`import acpsgd`: the ACP-SGD seed's usage pattern runs unchanged on bitscom (CPU, gloo)."""
import pytest
import torch

import acpsgd
import bitscom
from bitscom.compressors import names

pytestmark = pytest.mark.skipif("acpsgd" not in names(),
                                reason="the ACPSGD compressor is not registered in this checkout")


def _seed_pattern(rank, world):
    import torch.distributed as dist
    acpsgd.init()
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 3))
    acpsgd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = acpsgd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    acpsgd.broadcast_optimizer_state(optimizer, root_rank=0)
    criterion = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    centers = torch.randn(3, 20, generator=torch.Generator().manual_seed(7)) * 2
    train_loader = []
    for _ in range(20):
        target = torch.randint(0, 3, (16,), generator=g)
        train_loader.append((centers[target] + torch.randn(16, 20, generator=g), target))
    losses = []
    for _i, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(acpsgd.allreduce(loss.detach()).item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    stats = optimizer.comm_stats()
    return (acpsgd.rank(), acpsgd.size(), acpsgd.local_rank(), losses,
            all(torch.equal(t, gathered[0]) for t in gathered), stats,
            optimizer.compression.fingerprint())


def test_seed_usage_pattern_trains_with_identical_replicas(pools):
    results = pools.run(2, _seed_pattern)
    assert [r[:3] for r in results] == [(0, 2, 0), (1, 2, 1)]
    for _, _, _, losses, same, stats, fp in results:
        assert same
        assert losses == results[0][3]             # allreduce averages: same number everywhere
        assert sum(losses[-4:]) < 0.5 * sum(losses[:4])
        assert stats["compression_ratio"] > 1
        assert fp.startswith("ACPSGD(") and "rank=4" in fp


def _allreduce(rank, world):
    t = torch.tensor([float(rank), 2.0 * rank])
    avg = acpsgd.allreduce(t)
    i = torch.tensor([rank + 1])
    total = acpsgd.allreduce(i, average=False)
    j = torch.tensor([2 * rank + 1])
    int_avg = acpsgd.allreduce(j, "ints")
    return avg.tolist(), total.tolist(), t.tolist(), total is i, int_avg, j.tolist()


def test_allreduce_sums_in_place_and_returns_the_average(pools):
    # the reference code: dist.all_reduce(tensor); return tensor / world_size
    for avg, total, summed, same, int_avg, int_sum in pools.run(2, _allreduce):
        assert avg == [0.5, 1.0] and summed == [1.0, 2.0]
        assert total == [3] and same
        assert int_sum == [4] and int_avg.dtype == torch.float32 and int_avg.tolist() == [2.0]


def _wrapped(rank, world, threshold, r):
    model = torch.nn.Linear(8, 8)
    opt = acpsgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), rank=r,
                                      threshold=threshold)
    return opt.compression.rank, len(opt.bucket_layouts)


def test_rank_and_threshold_are_forwarded(pools):
    assert pools.run(2, _wrapped, 0, 2) == [(2, 2)] * 2          # 0 MB: one tensor per bucket
    assert pools.run(2, _wrapped, 25, 3) == [(3, 1)] * 2


def test_bad_input_is_rejected():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="rank"):
        acpsgd.DistributedOptimizer(opt, rank=0)
    with pytest.raises(TypeError, match="always uses ACP-SGD"):
        acpsgd.DistributedOptimizer(opt, compression=bitscom.Compression.fp16)
    with pytest.raises(TypeError, match="model.named_parameters"):
        acpsgd.DistributedOptimizer(opt, model=torch.nn.Linear(2, 2))
    assert acpsgd.allreduce(torch.tensor([1, 2])).tolist() == [1.0, 2.0]    # one process
    with pytest.raises(TypeError, match="torch.Tensor"):
        acpsgd.allreduce([1.0])
    assert torch.equal(acpsgd.allreduce(torch.tensor([1.5])), torch.tensor([1.5]))   # one process
