"""A small classification task on 2 ranks: every registered compressor, at its recommended
setting, ends within MARGIN accuracy points of S-SGD (plain fp32 all-reduce).

The task: 8 Gaussian blobs in 32 dimensions with overlapping clouds (so accuracy saturates
below 100% and differences show), a 32-128-128-8 MLP, SGD with momentum, 2 ranks × 32
samples per step. Data and initial weights come from fixed generators, so the numbers are
reproducible; ``python tests/test_accuracy.py`` prints the table the README quotes.
"""
import pytest
import torch

import bitscom
from bitscom.compressors import get, names

MARGIN = 3.0          # accuracy points
STEPS = 150
# The recommended setting of each compressor is its default; list exceptions here.
RECOMMENDED = {}


def task(seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(8, 32, generator=g) * 0.5

    def sample(n, gen):
        y = torch.randint(0, 8, (n,), generator=gen)
        return centers[y] + torch.randn(n, 32, generator=gen), y
    return sample


def model():
    torch.manual_seed(0)      # identical init everywhere (the test process never trains)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 8))


def _train(rank, world, name, settings, steps=STEPS):
    sample = task()
    net = model()
    opt = bitscom.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=net.named_parameters(),
                                       compression=get(name, **settings))
    gen = torch.Generator().manual_seed(100 + rank)
    sent = 0
    for _ in range(steps):
        x, y = sample(32, gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        sent += opt.comm_stats()["bytes_sent"]
    x, y = sample(4000, torch.Generator().manual_seed(999))
    with torch.no_grad():
        acc = (net(x).argmax(1) == y).float().mean().item() * 100
    return acc, sent / steps, opt.comm_stats()["dense_bytes"]


@pytest.fixture(scope="module")
def baseline(pools):
    return pools.run(2, _train, "none", {})[0][0]


@pytest.mark.parametrize("name", names())
def test_accuracy_within_margin_of_ssgd(pools, baseline, name):
    results = pools.run(2, _train, name, RECOMMENDED.get(name, {}))
    acc = results[0][0]
    assert results[1][0] == acc                # replicas identical
    assert acc >= baseline - MARGIN, f"{name}: {acc:.1f}% vs S-SGD {baseline:.1f}%"


if __name__ == "__main__":           # the README's table
    import sys
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from distpool import Pools
    pools = Pools()
    try:
        print("| compressor | accuracy % | bytes/step/rank | fp32 bytes | ratio |")
        print("|---|---|---|---|---|")
        for name in names():
            acc, sent, dense = pools.run(2, _train, name, RECOMMENDED.get(name, {}))[0]
            print(f"| {name} | {acc:.1f} | {sent:.0f} | {dense} | {dense / sent:.1f}× |", flush=True)
    finally:
        pools.close()
