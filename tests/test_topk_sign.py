"""TopK and SignSGD: exactness, error-feedback invariant, packing, cross-rank identity, errors.

Single-process tests drive N simulated ranks in lockstep through a fake Comm (each rank's
all-gather input is collected, then every output is filled), so the multi-rank arithmetic is
checked without processes; the gloo tests check the real thing on 2 and 4 ranks.
"""
import math

import pytest
import torch

import bitscom
from bitscom.cost import sent_bytes
from bitscom.compressors import BucketLayout, SignSGD, TopK, get, names
from bitscom.compressors.error_feedback import ErrorFeedback
from bitscom.compressors.signsgd import pack_signs, unpack_signs
from simranks import lockstep


def grads(world, numel, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(world)]


def layout_for(numel):
    return BucketLayout.for_tensor(torch.zeros(numel))


# ---------------------------------------------------------------- TopK

@pytest.mark.parametrize("world", [2, 3])
def test_topk_ratio_one_is_exact_average(world):
    numel = 1000
    gs = grads(world, numel)
    comp, layout = TopK(ratio=1.0), layout_for(numel)
    flats = [g.clone() for g in gs]
    states = [comp.init_state(layout) for _ in gs]
    lockstep(comp, flats, states, layout)
    ref = torch.stack([g.double() for g in gs]).mean(0)
    for f in flats:
        assert torch.equal(f, flats[0])
        torch.testing.assert_close(f.double(), ref, rtol=2e-7, atol=1e-7)
    if world == 2:          # one fp32 rounding of an exact sum, halving exact: bitwise
        assert torch.equal(flats[0], ref.float())
    for s in states:
        assert torch.count_nonzero(s.residual) == 0


@pytest.mark.parametrize("comp", [TopK(ratio=0.05), SignSGD(), SignSGD(majority_vote=False, block_size=None),
                                  SignSGD(majority_vote=True, error_feedback=True, block_size=100)])
def test_error_feedback_invariant(comp):
    numel, world = 777, 2
    layout = layout_for(numel)
    states = [comp.init_state(layout) for _ in range(world)]
    for step in range(4):
        gs = grads(world, numel, seed=step + 10)
        olds = [s.residual.clone() for s in states]
        inputs = [g + e for g, e in zip(gs, olds)]
        flats = [g.clone() for g in gs]
        lockstep(comp, flats, states, layout)
        for x, s in zip(inputs, states):
            sent = transmitted(comp, x)
            torch.testing.assert_close(sent + s.residual, x, rtol=1e-6, atol=1e-6)
            assert torch.count_nonzero(s.residual) > 0


def transmitted(comp, x):
    """D(C(x)) computed independently of the compressor's reduce()."""
    if isinstance(comp, TopK):
        k = comp.k_for(x.numel())
        idx = x.abs().topk(k).indices
        out = torch.zeros_like(x)
        out[idx] = x[idx]
        return out
    b = comp.block_size or x.numel()           # one scale per block (the default) or per tensor
    out = torch.empty_like(x)
    for s in range(0, x.numel(), b):
        chunk = x[s:s + b]
        out[s:s + b] = torch.where(chunk < 0, -1.0, 1.0) * chunk.abs().mean()
    return out


def test_topk_per_tensor_picks_within_each_tensor():
    """per_tensor: each tensor sends its own ceil(ratio·numel) largest, even a tensor whose
    entries are all smaller than every entry of another (the whole-bucket pick starves it)."""
    from bitscom.compressors import BucketLayout, TensorSlot
    shapes = [(30, 10), (7,), (64,)]
    slots, off = [], 0
    for i, shp in enumerate(shapes):
        n = int(torch.tensor(shp).prod())
        slots.append(TensorSlot(f"t{i}", off, n, shp))
        off += n
    layout = BucketLayout(0, tuple(slots), torch.float32, torch.device("cpu"))
    comp = TopK(ratio=0.1, per_tensor=True)
    gs = grads(2, off, seed=5)
    for g in gs:
        g[300:307] *= 1e-3                                  # the small tensor: never the largest
    flats = [g.clone() for g in gs]
    states = [comp.init_state(layout) for _ in gs]
    sent = lockstep(comp, flats, states, layout)
    assert comp.k_of(layout) == 30 + 1 + 7 == sent[0] // 8
    assert sent == [sent_bytes(comp, layout, 2)] * 2
    expect = torch.zeros(off, dtype=torch.float64)
    for g in gs:
        for sl in slots:
            part = g[sl.offset:sl.end].double()
            idx = part.abs().topk(comp.k_for(sl.numel)).indices + sl.offset
            expect[idx] += g.double()[idx]
    torch.testing.assert_close(flats[0].double(), expect / 2)
    assert torch.count_nonzero(flats[0][300:307]) >= 1
    whole = TopK(ratio=0.1).compress(gs[0], 38)[1]
    assert not bool(((whole >= 300) & (whole < 307)).any())  # what per_tensor fixes


def test_topk_sparse_result_and_bytes():
    numel, world = 1000, 2
    comp, layout = TopK(ratio=0.01), layout_for(numel)
    gs = grads(world, numel, seed=3)
    flats = [g.clone() for g in gs]
    states = [comp.init_state(layout) for _ in gs]
    sent = lockstep(comp, flats, states, layout)
    assert comp.k_for(numel) == 10 and sent == [80, 80] == [sent_bytes(comp, layout, 2)] * 2
    expect = torch.zeros(numel)
    for g in gs:
        idx = g.abs().topk(10).indices
        expect[idx] += g[idx]
    torch.testing.assert_close(flats[0], expect / 2)


def test_topk_k_rounding():
    assert TopK(ratio=0.01).k_for(100) == 1
    assert TopK(ratio=0.01).k_for(101) == 2
    assert TopK(ratio=0.3).k_for(10) == 3
    assert TopK(ratio=1e-6).k_for(10) == 1
    assert TopK(ratio=1).k_for(7) == 7


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), "0.1", True])
def test_topk_ratio_validation_names_value(bad):
    with pytest.raises(ValueError, match=r"ratio.*\(0, 1\].*" + repr(bad).replace("(", r"\(")[:3]):
        TopK(ratio=bad)
    with pytest.raises(ValueError, match="ratio"):
        get("topk", ratio=bad)


def test_fp16_bucket_keeps_fp32_residual():
    numel, world = 300, 2
    comp, layout = TopK(ratio=0.1), BucketLayout.for_tensor(torch.zeros(numel, dtype=torch.float16))
    gs = [g.half() for g in grads(world, numel, seed=5)]
    flats = [g.clone() for g in gs]
    states = [comp.init_state(layout) for _ in gs]
    lockstep(comp, flats, states, layout)
    assert flats[0].dtype == torch.float16 and states[0].residual.dtype == torch.float32
    torch.testing.assert_close(states[0].residual + transmitted(comp, gs[0].float()), gs[0].float())


# ---------------------------------------------------------------- SignSGD

@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 63, 1001])
def test_sign_packing_roundtrip(count):
    x = torch.randn(count, generator=torch.Generator().manual_seed(count))
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(count / 8)
    assert torch.equal(unpack_signs(packed, count), torch.where(x < 0, -1.0, 1.0))


def test_sign_bit_order_documented():
    x = torch.tensor([-1., 2, 3, 4, 5, 6, 7, -8, 0.0, -0.0, -1])
    assert pack_signs(x).tolist() == [0x81, 0x04]       # LSB first; +0 and -0 read as +


def test_signsgd_average_and_bytes():
    numel, world = 100, 3
    comp, layout = SignSGD(majority_vote=False), layout_for(numel)
    gs = grads(world, numel, seed=7)
    flats = [g.clone() for g in gs]
    states = [comp.init_state(layout) for _ in gs]
    sent = lockstep(comp, flats, states, layout)
    blocks = math.ceil(numel / comp.block_size)                 # one fp32 scale per block_size entries
    assert sent == [math.ceil(numel / 8) + 4 * blocks] * world == [sent_bytes(comp, layout, world)] * world
    expect = sum(transmitted(comp, g) for g in gs) / world
    torch.testing.assert_close(flats[0], expect)
    assert all(torch.equal(f, flats[0]) for f in flats)


def test_signsgd_scale_per_tensor():
    from bitscom.compressors import TensorSlot
    layout = BucketLayout(0, (TensorSlot("w", 0, 12, (3, 4)), TensorSlot("b", 12, 3, (3,))),
                          torch.float32, torch.device("cpu"))
    gs = [torch.cat([torch.randn(12), 1e-3 * torch.randn(3)]) for _ in range(2)]
    comp = SignSGD(majority_vote=False)
    flats = [g.clone() for g in gs]
    sent = lockstep(comp, flats, [comp.init_state(layout) for _ in gs], layout)
    assert sent == [2 + 8] * 2 == [sent_bytes(comp, layout, 2)] * 2
    expect = sum(torch.cat([transmitted(comp, g[:12]), transmitted(comp, g[12:])]) for g in gs) / 2
    torch.testing.assert_close(flats[0], expect)
    assert flats[0][12:].abs().max() < 1e-2          # the bias keeps its own small scale


def test_signsgd_blocks_stay_inside_tensors():
    from bitscom.compressors import TensorSlot
    layout = BucketLayout(0, (TensorSlot("w", 0, 70, (7, 10)), TensorSlot("b", 70, 5, (5,))),
                          torch.float32, torch.device("cpu"))
    comp = SignSGD(block_size=32)
    assert comp._sizes(layout, 75) == (32, 32, 6, 5)            # w: 32+32+6, then b alone
    assert sent_bytes(comp, layout, 2) == math.ceil(75 / 8) + 4 * 4
    gs = [torch.cat([torch.randn(70), 1e-3 * torch.randn(5)]) for _ in range(2)]
    flats = [g.clone() for g in gs]
    lockstep(comp, flats, [comp.init_state(layout) for _ in gs], layout)
    expect = sum(torch.cat([transmitted(comp, g[:70]), transmitted(comp, g[70:])]) for g in gs) / 2
    torch.testing.assert_close(flats[0], expect)
    for bad in (0, -1, True, 2.5, "32"):
        with pytest.raises(ValueError, match="block_size.*" + repr(bad)[:2]):
            SignSGD(block_size=bad)


def test_signsgd_majority_vote():
    gs = [torch.tensor([1., -2, 3, -4]), torch.tensor([2., -1, -3, 4]), torch.tensor([3., 1, -1, -4])]
    comp, layout = SignSGD(majority_vote=True), layout_for(4)
    assert not comp.uses_error_feedback and SignSGD(majority_vote=False).uses_error_feedback
    flats = [g.clone() for g in gs]
    states = [comp.init_state(layout) for _ in gs]
    lockstep(comp, flats, states, layout)
    scale = sum(g.abs().mean() for g in gs) / 3
    torch.testing.assert_close(flats[1], torch.tensor([1., -1, -1, -1]) * scale)
    two = [gs[0].clone(), -gs[0].clone()]                # a tie gives 0
    lockstep(comp, two, [comp.init_state(layout)] * 2, layout)
    assert torch.count_nonzero(two[0]) == 0


def test_signsgd_nan_propagates():
    comp, layout = SignSGD(), layout_for(16)
    flats = [torch.ones(16), torch.ones(16)]
    flats[0][3] = float("nan")
    lockstep(comp, flats, [comp.init_state(layout) for _ in flats], layout)
    assert torch.isnan(flats[1]).all()


def test_sign_settings_validation():
    with pytest.raises(TypeError, match="majority_vote"):
        SignSGD(majority_vote="yes")
    with pytest.raises(TypeError, match="error_feedback"):
        SignSGD(error_feedback=1)


# ---------------------------------------------------------------- shared pieces

def test_registry_names_and_errors():
    assert {"none", "fp16", "bf16", "lowbit", "powersgd", "acpsgd", "topk", "signsgd"} <= set(names())
    assert get("acpsgd", rank=4).rank == 4
    assert get("topk", ratio=0.5) == TopK(ratio=0.5)
    assert get("signsgd", majority_vote=True) == SignSGD(majority_vote=True)
    with pytest.raises(ValueError, match=r"unknown compressor 'nope'.*topk"):
        get("nope")
    with pytest.raises(TypeError, match="bad settings for compressor 'topk'"):
        get("topk", ratoi=0.1)


def test_error_feedback_checkpoint_and_mismatch():
    ef = ErrorFeedback(5)
    ef.compensate(torch.arange(5.))
    ef.update(torch.ones(5))
    saved = ef.state_dict()
    other = ErrorFeedback(5)
    other.load_state_dict(saved)
    assert torch.equal(other.residual, torch.arange(5.) - 1)
    with pytest.raises(ValueError, match="6 elements"):
        ErrorFeedback(6).load_state_dict(saved)
    with pytest.raises(ValueError, match="error_feedback"):
        ErrorFeedback(5, enabled=False).load_state_dict(saved)
    with pytest.raises(RuntimeError, match="layout changed"):
        ErrorFeedback(5).compensate(torch.zeros(4))


# ---------------------------------------------------------------- real ranks (gloo)

def _identical_across_ranks(rank, world, name, settings):
    import torch.distributed as dist
    from bitscom.compressors.base import Comm, drive
    comp = get(name, **settings)
    layout = BucketLayout.for_tensor(torch.zeros(4099))
    state = comp.init_state(layout)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        flat = torch.randn(4099, generator=g)
        comm = Comm(dist.group.WORLD)
        drive(comp.reduce(flat, layout, state, comm), comm)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(t, gathered[0]) for t in gathered), comm.bytes_sent


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name,settings", [("topk", {"ratio": 0.01}), ("signsgd", {}),
                                           ("signsgd", {"majority_vote": True})])
def test_bitwise_identical_across_ranks(pools, world, name, settings):
    results = pools.run(world, _identical_across_ranks, name, settings)
    comp, layout = get(name, **settings), BucketLayout.for_tensor(torch.zeros(4099))
    assert all(same for same, _ in results)
    assert all(sent == sent_bytes(comp, layout, world) for _, sent in results)


def test_distributed_optimizer_runs_topk_and_sign(pools):
    assert all(pools.run(2, _optimizer_steps))


def _optimizer_steps(rank, world):
    import torch.distributed as dist
    for comp in (TopK(ratio=0.1), SignSGD()):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        bitscom.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = bitscom.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), compression=comp)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
        assert opt.comm_stats()["step_bytes_sent"] == sum(sent_bytes(comp, l, world) for l in opt.bucket_layouts)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert torch.equal(gathered[0], gathered[1])
    return True


def test_signsgd_native_path_matches_torch_path_bitwise(monkeypatch):
    """The fused native CPU kernels give the torch path's exact wire bytes, results and residual."""
    import bitscom.compressors.signsgd as S
    from bitscom.buckets import plan_buckets
    from bitscom.compressors.base import Comm, drive
    from bitscom.kernels import cpu_native
    if not cpu_native.available():
        pytest.skip("no C++ compiler: the native path is not used")

    class Mirror(Comm):
        def __init__(self):
            super().__init__()
            self.size, self.rank, self.sent = 3, 0, []

        def all_gather(self, output, input):
            self.count(input)
            self.sent.append(input.clone())
            output.view(self.size, -1).copy_(input.reshape(1, -1))

    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([1003, 17, 5, 409])]
    layout = plan_buckets(params, 1 << 30)[0]
    for block, ef in ((16, None), (None, None), (7, False)):
        comp = S.SignSGD(block_size=block, error_feedback=ef)
        runs = []
        for native in (True, False):
            if not native:
                monkeypatch.setattr(S, "_native_for", lambda x: None)
            state, gen, outs, comm = comp.init_state(layout), torch.Generator().manual_seed(1), [], Mirror()
            for _ in range(3):
                flat = torch.randn(layout.numel, generator=gen)
                flat[5], flat[6] = 0.0, -0.0
                drive(comp.reduce(flat, layout, state, comm), comm)
                outs.append(flat.view(torch.int32).clone())
            runs.append((outs, comm.sent, None if state.residual is None else state.residual.view(torch.int32)))
            monkeypatch.undo()
        (o1, s1, r1), (o2, s2, r2) = runs
        assert all(torch.equal(a, b) for a, b in zip(o1, o2))
        assert all(torch.equal(a, b) for a, b in zip(s1, s2)) and len(s1) == 3
        assert (r1 is None and r2 is None) or torch.equal(r1, r2)
