"""Real handwritten digits on 2 ranks: every registered compressor, at its default, ends within
MARGIN test-accuracy points of S-SGD (plain fp32 all-reduce), averaged over the same seeds.

The task: scikit-learn's 1,797 real 8×8 handwritten digits (shipped with the package, no
download), a fixed split of 1,297 train / 500 test, a 64-128-128-10 MLP, SGD with momentum and cosine learning-rate decay,
2 ranks × 32 samples per step, 300 steps. Each seed fixes the initial weights and the data
order; compressor and S-SGD runs of the same seed see identical data, so the comparison is
paired. Long runs and harder tasks live in scripts/convergence.py, not in CI.

Why MARGIN is 0.85 points. Measured with ``python tests/test_accuracy.py --seeds 12 --names
none`` (S-SGD, seeds 0..11): test accuracy 96.37% mean, seed-to-seed standard deviation
σ = 0.34 points (500 test digits: one digit is 0.2 points). The test averages SEEDS = 3 paired
seeds, so two equally good methods differ by about σ·√(2/3) = 0.28 points (1σ, treating
their seeds as independent — pairing only makes it smaller); 3σ of that is 0.83, rounded up
to 0.85. The issue's 0.5-point target is checked on longer runs by the suite
(scripts/convergence.py, docs/convergence.md).

Sign-SGD once fell short here (majority vote: 92.7%, 3.6 points below S-SGD; EF-SignSGD with
one scale per tensor: 81% ± 14 over 12 seeds, diverging on some). Its default is now
EF-SignSGD with one scale per 16-entry block: 96.30% ± 0.52 over 12 seeds, 10.7× fewer bytes
(32-entry blocks: 96.23% ± 0.51, 16×, but 0.87 points below S-SGD on the suite's CNN;
docs/convergence.md).

Bytes are part of the claim: each compressor must also send at least its target fraction
fewer bytes than fp32 over the whole run, counted by the optimizer (``comm_stats()``), so an
accuracy pass cannot come from quietly not compressing.
"""
import pytest
import torch

import bitscom
from bitscom.compressors import get, names

pytest.importorskip("sklearn", reason="the digits ship with scikit-learn: pip install -e .[test]")

MARGIN = 0.85         # accuracy points; derivation in the module docstring
SEEDS = (0, 1, 2)
STEPS = 300
# Whole-run compression each registered compressor must reach at its default (issue 13).
BYTES_TARGET = {"none": 1.0, "fp16": 1.9, "bf16": 1.9, "lowbit": 3.5, "powersgd": 4.0,
                "acpsgd": 4.0, "topk": 8.0, "signsgd": 8.0}


def digits():
    """(train_x, train_y, test_x, test_y): sklearn's digits, scaled to [0, 1], fixed split."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[500:], y[500:], x[:500], y[:500]


def model(seed):
    torch.manual_seed(seed)      # identical init on every rank (the test process never trains)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _train(rank, world, name, settings, seeds=SEEDS, steps=STEPS):
    """Per seed: (test accuracy %, bytes sent, fp32 bytes, parameter checksum)."""
    tx, ty, vx, vy = digits()
    out = []
    for seed in seeds:
        net = model(seed)
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                           named_parameters=net.named_parameters(),
                                           compression=get(name, **settings))
        sent = dense = 0
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt.optimizer, steps)
        per_epoch = len(tx) // (32 * world)
        for step in range(steps):
            epoch, at = divmod(step, per_epoch)
            perm = torch.randperm(len(tx), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
            idx = perm[rank::world][at * 32:(at + 1) * 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(tx[idx]), ty[idx]).backward()
            opt.step()
            sched.step()
            sent += opt.comm_stats()["step_bytes_sent"]
            dense += opt.comm_stats()["step_dense_bytes"]
        with torch.no_grad():
            acc = (net(vx).argmax(1) == vy).float().mean().item() * 100
        checksum = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).double().sum().item()
        out.append((acc, sent, dense, checksum))
    return out


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def baseline(pools):
    return pools.run(2, _train, "none", {}, timeout=300)[0]


_RESULTS = {}


def _results(pools, name):
    """Per-rank results of ``name`` at its default, trained once per module."""
    if name not in _RESULTS:
        _RESULTS[name] = pools.run(2, _train, name, {}, timeout=300)
    return _RESULTS[name]


# wrappers: see their inner compressors ("dgc" also needs an SGD without momentum; its
# accuracy is measured by scripts/convergence.py --sets dgc, its arithmetic by
# tests/test_momentum_correction.py)
COMPRESSORS = [n for n in names() if n not in ("none", "exclude", "dgc")]
SHORTFALL: dict = {}    # name -> reason: a strict xfail, so a fix shows up (none at the moment)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", COMPRESSORS)
def test_replicas_identical_and_bytes_below_target(pools, name):
    results = _results(pools, name)
    if name == "auto":
        # rank 0 broadcasts each bucket's choice (8 bytes it alone sends); which compressor
        # wins depends on measured timings, so there is no byte target, only identity
        for (acc0, sent0, dense0, sum0), (acc1, sent1, dense1, sum1) in zip(*results):
            assert (acc0, dense0, sum0) == (acc1, dense1, sum1), "auto: replicas differ"
            assert 0 <= sent0 - sent1 <= 8 * 64, (sent0, sent1)
        return
    assert results[0] == results[1], f"{name}: replicas differ"           # bitwise-identical ranks
    ratio = sum(r[2] for r in results[0]) / sum(r[1] for r in results[0])
    assert ratio >= BYTES_TARGET[name], f"{name}: only {ratio:.2f}x fewer bytes than fp32"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=SHORTFALL[n])) if n in SHORTFALL else n
    for n in COMPRESSORS])
def test_accuracy_within_margin_of_ssgd(pools, baseline, name):
    results = _results(pools, name)
    acc = _mean([r[0] for r in results[0]])
    base = _mean([r[0] for r in baseline])
    assert acc >= base - MARGIN, (f"{name}: {acc:.2f}% vs S-SGD {base:.2f}% over seeds {SEEDS} "
                                  f"(margin {MARGIN} points)")


def test_baseline_learns(baseline):
    """The task is neither trivial nor broken: S-SGD lands where it was measured."""
    acc = _mean([r[0] for r in baseline])
    assert 95.0 <= acc <= 99.5, acc


if __name__ == "__main__":           # the table docs/convergence.md quotes, and MARGIN's σ
    import argparse
    import statistics
    import sys
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from distpool import Pools
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=len(SEEDS))
    ap.add_argument("--names", nargs="*", default=["none"] + COMPRESSORS,
                    help="registry names, or name:key=value,... (e.g. powersgd:rank=16)")
    a = ap.parse_args()

    def _spec(text):
        name, _, rest = text.partition(":")
        settings = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    pass
            settings[key] = {"None": None, "True": True, "False": False}.get(value, value) \
                if isinstance(value, str) else value
        return name, settings
    pools = Pools()
    try:
        print(f"| compressor | test accuracy % (mean ± σ over {a.seeds} seeds) | bytes vs fp32 |")
        print("|---|---|---|")
        for name in a.names:
            rows = pools.run(2, _train, *_spec(name), tuple(range(a.seeds)), timeout=3600)[0]
            accs = [r[0] for r in rows]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            ratio = sum(r[2] for r in rows) / sum(r[1] for r in rows)
            print(f"| {name} | {_mean(accs):.2f} ± {sd:.2f} | {ratio:.1f}× |", flush=True)
    finally:
        pools.close()
