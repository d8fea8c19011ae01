"""ShardedOptimizer on CPU/gloo: parity with a float64 reference, identical replicas, sharded
memory, SDP4Bit quantization (accuracy, bytes), checkpoints across world sizes."""

import copy

import pytest
import torch
import torch.nn as nn

import bitscom
from helpers import global_batch, make_model, shard

STEPS = 4


def _opt_factory(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.95))
    if kind == "adamw-groups":  # two groups with different weight decay
        params = list(params)
        return torch.optim.AdamW([{"params": params[::2], "weight_decay": 0.1},
                                  {"params": params[1::2], "weight_decay": 0.0}], lr=0.01)
    raise ValueError(kind)


def _reference(steps, world, per_rank=4, kind="sgd", clip=None, passes=1, start=0, model=None):
    """Single process, float64, concatenated global batch."""
    ref = copy.deepcopy(model if model is not None else make_model(seed=0)).double()
    opt = _opt_factory(kind, ref.parameters())
    history = []
    for step in range(start, start + steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = global_batch(step * passes + k, world, per_rank)
            nn.functional.mse_loss(ref(x.double()), y.double()).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        history.append([p.detach().clone() for p in ref.parameters()])
    return history


def _train(rank, world, steps, kind="sgd", clip=None, passes=1, per_rank=4, **kw):
    model = make_model(seed=0)
    opt = bitscom.ShardedOptimizer(_opt_factory(kind, model.parameters()), model.named_parameters(),
                                   backward_passes_per_step=passes, **kw)
    history, stats = [], []
    for step in range(steps):
        for k in range(passes):
            x, y = global_batch(step * passes + k, world, per_rank)
            nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        assert all(p.grad is None for p in model.parameters())
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
        stats.append(opt.comm_stats())
    return history, stats, opt.memory_stats(), [b.shard_numel for b in opt.plan.buckets]


def _assert_replicas_identical(results):
    for step, params0 in enumerate(results[0][0]):
        for r in range(1, len(results)):
            for a, b in zip(params0, results[r][0][step]):
                assert torch.equal(a, b), f"rank {r} drifted from rank 0 at step {step}"


def _assert_close(history, ref, tol=2e-5):
    for step, (got, want) in enumerate(zip(history, ref)):
        for g, w in zip(got, want):
            err = (g.double() - w).abs().max().item()
            assert err <= tol * (1 + w.abs().max().item()), f"step {step}: max err {err:.3g}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("threshold", [25, 0])
@pytest.mark.parametrize("kind", ["sgd", "adamw-groups"])
def test_exact_matches_float64_reference(pools, world, threshold, kind):
    results = pools.run(world, _train, STEPS, kind=kind, fusion_threshold_mb=threshold)
    _assert_replicas_identical(results)
    _assert_close(results[0][0], _reference(STEPS, world, kind=kind))
    if threshold == 0:
        assert len(results[0][3]) == len(list(make_model().parameters()))


def test_clipping_and_accumulation_match_reference(pools):
    results = pools.run(2, _train, 3, kind="adam", clip=0.05, passes=2)
    _assert_replicas_identical(results)
    _assert_close(results[0][0], _reference(3, 2, kind="adam", clip=0.05, passes=2))


def test_world_size_one_is_the_plain_optimizer():
    history, stats, _, _ = _train(0, 1, 3, kind="adam", clip=0.1)
    _assert_close(history, _reference(3, 1, kind="adam", clip=0.1))
    assert stats[-1]["bytes_sent"] == 0


def _wide_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 8))


def _memory(rank, world):
    model = _wide_model()
    opt = bitscom.ShardedOptimizer(torch.optim.Adam(model.parameters()), model.named_parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    elementwise = sum(v.numel() * v.element_size() for st in opt.optimizer.state.values()
                      for v in st.values() if v.dim() > 0)
    padding = sum(world * b.shard_numel - b.numel for b in opt.plan.buckets)
    return opt.memory_stats()["optimizer_state_bytes"], elementwise, padding


@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_state_is_sharded(pools, world):
    model = _wide_model()
    full = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    full.step()
    full_bytes = sum(v.numel() * v.element_size() for st in full.state.values() for v in st.values())
    full_elementwise = sum(v.numel() * v.element_size() for st in full.state.values()
                           for v in st.values() if v.dim() > 0)
    results = pools.run(world, _memory)
    # The pieces partition the parameters: elementwise state adds up to the unsharded one's.
    assert sum(r[1] for r in results) == full_elementwise
    for total, _, padding in results:
        # Each rank holds its shard (at most S elements x 2 Adam buffers) plus scalar steps.
        assert total <= full_bytes / world + 8 * padding + 4 * 6
        assert total >= 0.9 * full_elementwise / world
    print(f"Adam state per rank, world {world}: {[r[0] for r in results]} bytes vs {full_bytes} unsharded")


# -- SDP4Bit quantization ------------------------------------------------------------------

class Teacher(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)


def _teacher_batch(step, world, per_rank=16):
    g = torch.Generator().manual_seed(77 + step)
    x = torch.randn(world * per_rank, 16, generator=g)
    torch.manual_seed(5)
    with torch.no_grad():
        y = Teacher()(x) * 3
    return x, y


def _train_teacher(rank, world, steps, **kw):
    torch.manual_seed(0)
    model = Teacher()
    opt = bitscom.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3), model.named_parameters(),
                                   fusion_threshold_mb=0.01, **kw)
    losses, identical = [], []
    for step in range(steps):
        x, y = _teacher_batch(step, world)
        loss = nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        identical.append(flat)
    x, y = _teacher_batch(10_000, world)
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x), y).item()
    return final, identical[-1], opt.comm_stats(), [(b.numel, b.shard_numel) for b in opt.plan.buckets]


SDP4BIT = dict(quantized_weights=True, quantized_gradients=True, hadamard_transform=True,
               gradient_alltoall_pipeline=2)


@pytest.mark.parametrize("world,extra", [(4, {}), (2, {"local_size": 1}), (4, {"local_size": 4}),
                                         (4, {"local_size": 1})])
def test_sdp4bit_replicas_identical_and_loss_close(pools, world, extra):
    steps = 40
    exact = pools.run(world, _train_teacher, steps, **extra)
    quant = pools.run(world, _train_teacher, steps, **SDP4BIT, **extra)
    for results in (exact, quant):
        for r in range(1, world):
            assert torch.equal(results[0][1], results[r][1]), f"rank {r} replica differs"
    exact_loss, quant_loss = exact[0][0], quant[0][0]
    start = _start_loss(world)
    assert exact_loss < 0.5 * start  # the run learns something
    # Stated margin: full SDP4Bit's held-out loss within 10% of the exact run's after 40 steps.
    assert abs(quant_loss - exact_loss) <= 0.10 * exact_loss, (quant_loss, exact_loss)


def _start_loss(world):
    torch.manual_seed(0)
    model = Teacher()
    x, y = _teacher_batch(10_000, world)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def _row(numel, bits, group):
    if bits == 32:
        return 4 * numel
    return -(-numel // group) * (group * bits // 8 + 2)


@pytest.mark.parametrize("world,local", [(4, 2), (2, 1), (2, 2)])
def test_bytes_on_the_wire_match_the_analytic_count(pools, world, local):
    cfg = dict(quantized_weights=True, quantized_gradients=True, hadamard_transform=True,
               gradient_alltoall_pipeline=2, local_size=local)
    _, _, stats, buckets = pools.run(world, _train_teacher, 1, **cfg)[0]
    L, M, pipe = local, world // local, 2
    grad = weight = 0
    for numel, S in buckets:
        assert S % (32 * pipe) == 0 and world * S >= numel
        C = S // pipe
        for _ in range(pipe):
            grad += (L * _row(M * C, 8, 512) if L > 1 else 0) + (M * _row(C, 4, 128) if M > 1 else 0)
        weight += _row(S, 4, 2048)
    assert stats["gradient_bytes"] == grad
    assert stats["weight_bytes"] == weight
    S_total = sum(S for _, S in buckets)
    assert stats["dense_weight_bytes"] == 4 * S_total
    assert stats["dense_gradient_bytes"] == 4 * world * S_total
    # about 4 bits per weight element plus scales (groups are partly padding on tiny buckets)
    assert 8 * weight / S_total >= 4 + 16 / 2048
    _, _, exact, buckets = pools.run(world, _train_teacher, 1, local_size=local)[0]
    S_total = sum(S for _, S in buckets)
    assert exact["gradient_bytes"] == 4 * world * S_total and exact["weight_bytes"] == 4 * S_total


def _reduced_gradient(rank, world, **kw):
    torch.manual_seed(0)
    model = Teacher()
    opt = bitscom.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(),
                                   fusion_threshold_mb=0.01, **kw)
    x, y = _teacher_batch(0, world)
    g = torch.Generator().manual_seed(1)
    heavy = torch.randn(y.shape, generator=g) ** 3  # heavy-tailed targets -> outliers in gradients
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y + heavy, rank, world)).backward()
    opt.synchronize()
    return [(name, start, stop, t.grad.clone()) for name, start, stop, t in opt.shard_pieces]


def _gradient_error(pieces_per_rank, world):
    torch.manual_seed(0)
    model = Teacher().double()
    x, y = _teacher_batch(0, world)
    g = torch.Generator().manual_seed(1)
    heavy = torch.randn(y.shape, generator=g) ** 3
    nn.functional.mse_loss(model(x.double()), (y + heavy).double()).backward()
    full = {n: p.grad.reshape(-1) for n, p in model.named_parameters()}
    got = {n: torch.full_like(v, float("nan")) for n, v in full.items()}
    for pieces in pieces_per_rank:
        for name, start, stop, grad in pieces:
            got[name][start:stop] = grad.double()
    diff = torch.cat([got[n] - full[n] for n in full])
    ref = torch.cat(list(full.values()))
    assert not torch.isnan(diff).any(), "some gradient elements are owned by no rank"
    return (diff.norm() / ref.norm()).item()


@pytest.mark.parametrize("world,local", [(4, 2), (2, 1)])
def test_two_level_gradient_reaches_the_owner(pools, world, local):
    exact = _gradient_error(pools.run(world, _reduced_gradient, local_size=local), world)
    assert exact < 1e-6
    wide = _gradient_error(pools.run(world, _reduced_gradient, local_size=local, quantized_gradients=True,
                                     gradient_quantization_bits_intra=16, gradient_quantization_bits_inter=16,
                                     gradient_alltoall_pipeline=2), world)
    assert wide < 1e-3  # 16-bit stages: only rounding error, so every chunk landed on its owner
    tlq = _gradient_error(pools.run(world, _reduced_gradient, local_size=local, quantized_gradients=True),
                          world)
    hs = _gradient_error(pools.run(world, _reduced_gradient, local_size=local, quantized_gradients=True,
                                   hadamard_transform=True), world)
    print(f"relative gradient error world {world} local {local}: TLq {tlq:.4f}, TLq-HS {hs:.4f}")
    # 8-bit intra + 4-bit inter on heavy-tailed (cubed normal) targets: a loose sanity bound;
    # Hadamard smoothing spreads the outliers, so its error is lower on this input.
    assert tlq < 0.35 and hs < tlq
