"""bitscom.ddp_comm_hook: every registered compressor trains under DDP with identical replicas;
Compression.none equals plain DDP bitwise; state survives DDP's bucket rebuild and checkpoints.
"""
import pytest
import torch
import torch.distributed as dist

import bitscom
from bitscom.compressors import get, names

# Test-only settings so multi-round/warm-up compressors reach their compressed phase in a few
# steps; anything not listed runs with its defaults.
FAST = {"powersgd": {"start_iter": 2}, "acpsgd": {"start_iter": 1}, "topk": {"ratio": 0.1},
        "exclude": {"inner": get("topk", ratio=0.1), "patterns": ("*.bias",)}}


class Net(torch.nn.Module):
    """Forward order differs from registration order, so DDP's rebuild changes the buckets."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(32, 4)
        self.body = torch.nn.Linear(32, 32)
        self.stem = torch.nn.Linear(16, 32)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))


def make_ddp(bucket_cap_mb=0.002, seed=0, **kwargs):
    torch.manual_seed(seed)     # same init on every rank; broadcast below makes it certain
    net = Net()
    return torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb, **kwargs)


def batches(rank, steps, start=0):
    out = []
    for s in range(start, steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(8, 16, generator=g)
        out.append((x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()))
    return out


def train(model, opt, data):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_all_ranks(t):
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(g, gathered[0]) for g in gathered)


# ---------------------------------------------------------------- every compressor trains

def _train_with(rank, world, name):
    model = make_ddp()
    comp = get(name, **FAST.get(name, {}))
    named = model.module.named_parameters() if comp.uses_names else None
    state, hook = bitscom.ddp_comm_hook(comp, named_parameters=named)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = train(model, opt, batches(rank, 12))
    stats = state.comm_stats()
    return same_on_all_ranks(flat_params(model)), losses, stats, len(state.bucket_states)


# "dgc" (MomentumCorrection) needs an SGD without momentum, which a hook cannot check: refused
# (tests/test_momentum_correction.py)
@pytest.mark.parametrize("name", [n for n in names() if n != "dgc"])
def test_ddp_hook_trains_with_every_compressor(pools, name):
    results = pools.run(2, _train_with, name)
    for same, losses, stats, nbuckets in results:
        assert same, f"{name}: replicas diverged"
        assert all(torch.isfinite(torch.tensor(losses)))
        assert sum(losses[-3:]) < sum(losses[:3]), f"{name}: loss did not go down: {losses}"
        assert stats["bytes_sent"] > 0 and stats["buckets"] == nbuckets >= 2
    if name in ("topk", "signsgd"):
        assert results[0][2]["compression_ratio"] > 1.5


@pytest.mark.parametrize("name", [n for n in ("powersgd", "lowbit") if n in names()])
def test_ddp_hook_multi_round_on_four_ranks(pools, name):
    # 4 ranks laid out as 2 nodes x 2: later rounds interleave across buckets and nodes
    results = pools.run(4, _train_with, name)
    assert all(same and nbuckets >= 2 for same, _, _, nbuckets in results)
    first = sum(sum(losses[:3]) for _, losses, _, _ in results)     # over ranks: less noisy
    last = sum(sum(losses[-3:]) for _, losses, _, _ in results)
    assert last < first


# ---------------------------------------------------------------- parity with plain DDP

def _none_vs_plain(rank, world):
    plain = make_ddp()
    hooked = make_ddp()
    state, hook = bitscom.ddp_comm_hook(bitscom.Compression.none)
    hooked.register_comm_hook(state, hook)
    data = batches(rank, 5)
    la = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), data)
    lb = train(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1, momentum=0.9), data)
    return la == lb and torch.equal(flat_params(plain), flat_params(hooked))


def test_none_hook_equals_plain_ddp_bitwise(pools):
    assert all(pools.run(2, _none_vs_plain))


# ---------------------------------------------------------------- rebuild and checkpoint

def _rebuild(rank, world):
    model = make_ddp()
    state, hook = bitscom.ddp_comm_hook(get("topk", ratio=0.1))
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(rank, 4)
    train(model, opt, data[:1])
    first = [(tuple(s.residual.shape), s) for s in state.bucket_states]
    train(model, opt, data[1:2])
    second = [(tuple(s.residual.shape), s) for s in state.bucket_states]
    train(model, opt, data[2:])
    third = list(state.bucket_states)
    return ([shape for shape, _ in first], [shape for shape, _ in second],
            all(a is b for (_, a), b in zip(second, third)),
            all(torch.count_nonzero(s.residual) > 0 for s in third))


def test_state_survives_bucket_rebuild(pools):
    for first, second, kept, nonzero in pools.run(2, _rebuild):
        assert first != second, "the test model should make DDP rebuild its buckets"
        assert sum(n for (n,) in first) == sum(n for (n,) in second)
        assert kept, "states after the rebuild must persist from step to step"
        assert nonzero


def _resume(rank, world, name, find_unused):
    kwargs = {"find_unused_parameters": find_unused}
    settings = FAST.get(name, {})
    data = batches(rank, 8)
    model = make_ddp(**kwargs)
    state, hook = bitscom.ddp_comm_hook(get(name, **settings))
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, data[:4])
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": opt.state_dict(), "comm": state.state_dict()}
    saved = _roundtrip(saved)
    train(model, opt, data[4:])
    reference = flat_params(model)

    resumed = make_ddp(seed=123, **kwargs)
    resumed.load_state_dict(saved["model"])
    state2, hook2 = bitscom.ddp_comm_hook(get(name, **settings))
    state2.load_state_dict(saved["comm"])
    resumed.register_comm_hook(state2, hook2)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved["opt"])
    train(resumed, opt2, data[4:])
    return torch.equal(reference, flat_params(resumed)), len(state2._loaded)


def _roundtrip(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("name", [n for n in ("topk", "signsgd", "powersgd", "acpsgd", "lowbit")
                                  if n in names()])
def test_checkpoint_resume_is_exact_without_rebuild(pools, name):
    # find_unused_parameters=True: DDP never rebuilds, so the resumed run sees the same buckets
    for exact, left in pools.run(2, _resume, name, True):
        assert exact and left == 0


def test_checkpoint_waits_for_rebuilt_buckets(pools):
    # Default DDP rebuilds after its first iteration: saved states apply once buckets of the
    # saved shapes appear (the first resumed iteration runs with fresh state).
    for _exact, left in pools.run(2, _resume, "topk", False):
        assert left == 0


# ---------------------------------------------------------------- errors

def test_bad_compressor_is_rejected():
    with pytest.raises(ValueError, match="unknown compressor 'nope'"):
        bitscom.ddp_comm_hook("nope")
    with pytest.raises(TypeError, match="compression must be"):
        bitscom.ddp_comm_hook(42)


def _mismatch(rank, world):
    try:
        bitscom.ddp_comm_hook(get("topk", ratio=0.1 if rank == 0 else 0.2))
    except RuntimeError as err:
        return str(err)
    return None


def test_ranks_with_different_settings_fail_clearly(pools):
    for msg in pools.run(2, _mismatch):
        assert msg is not None and "disagree" in msg and "ratio=0.2" in msg


def _bad_checkpoint(rank, world):
    state, _ = bitscom.ddp_comm_hook(get("topk", ratio=0.1))
    other, _ = bitscom.ddp_comm_hook(get("signsgd"))
    try:
        other.load_state_dict(state.state_dict())
    except ValueError as err:
        return str(err)


def test_checkpoint_of_another_compressor_is_rejected(pools):
    assert all("differs" in m for m in pools.run(2, _bad_checkpoint))
