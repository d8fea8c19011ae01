"""Fast codec paths (issue 22 item 4) against the paths they replace, bitwise.

Each fast path must send the same wire bytes, give the same averaged result and keep the same
residual as the general torch path, on every simulated rank, step after step. The ranks run in
one process, in lockstep, through a fake Comm that completes all-to-alls and all-gathers in
rank order and records every byte handed to the network.
"""
import pytest
import torch

import bitscom.kernels as K
import bitscom.lowbit.all_reduce as AR
from bitscom.buckets import plan_buckets
from bitscom.compressors import LowBit
from bitscom.kernels import cpu_native
from simranks import lockstep

native = pytest.mark.skipif(not cpu_native.available(), reason="no C++ compiler: no native path")


def _residuals(state):
    """The worker residual's bits, and the server (stage-2) residual's where the state has one."""
    feedbacks = [state.residual] + ([state.stage2_residual] if hasattr(state, "stage2_residual") else [])
    return tuple(None if r.residual is None else r.residual.view(torch.int32).clone() for r in feedbacks)


def _run(comp, sizes, P, steps=3, seed=0):
    """Every rank's outputs, wire bytes and residuals over ``steps`` steps."""
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    layout = plan_buckets(params, 1 << 30)[0]
    states = [comp.init_state(layout) for _ in range(P)]
    gen = torch.Generator().manual_seed(seed)
    outs, wire, sent = [], [[] for _ in range(P)], []
    for _ in range(steps):
        flats = [torch.randn(layout.numel, generator=gen) * 10 ** float(torch.randint(-3, 3, (1,),
                                                                                       generator=gen))
                 for _ in range(P)]
        for f in flats:
            f[3], f[4] = 0.0, -0.0
        sent.append(lockstep(comp, flats, states, layout, wire))
        outs.append([f.view(torch.int32).clone() for f in flats])
    res = [_residuals(s) for s in states]
    return outs, wire, res, sent


def _equal(a, b):
    (o1, w1, r1, s1), (o2, w2, r2, s2) = a, b
    assert s1 == s2
    assert len(w1[0]) == len(w2[0]) > 0
    for x, y in zip(sum(w1, []), sum(w2, [])):
        assert torch.equal(x, y)
    for step1, step2 in zip(o1, o2):
        for x, y in zip(step1, step2):
            assert torch.equal(x, y)
    def flat(rs):                                     # worker (and server) residuals
        return [t for r in rs for t in (r if isinstance(r, tuple) else (r,))]
    for x, y in zip(flat(r1), flat(r2)):
        assert (x is None and y is None) or torch.equal(x, y)


CASES = [
    dict(bitwidth=4),                                         # the default
    dict(bitwidth=4, error_feedback=True),
    dict(bitwidth=2, block_size=32),
    dict(bitwidth=8, stochastic_rounding=True),
    dict(bitwidth=1, error_feedback=True),
    dict(bitwidth=12, stage2_bitwidth=16, block_size=64),
    dict(bitwidth=4, stage2_bitwidth=8, stochastic_rounding=True, error_feedback=True),
    # 1-bit Adam's codec: worker and server error feedback (bitscom.onebit.config.momentum_codec)
    dict(bitwidth=1, stage2_bitwidth=1, block_size=64, error_feedback_mode="residual", stage2_error_feedback=True),
    dict(bitwidth=1, stage2_bitwidth=4, block_size=32, error_feedback_mode="residual", stage2_error_feedback=True),
    dict(bitwidth=4, stage2_error_feedback=True, stochastic_rounding=True),
]


@native
@pytest.mark.parametrize("settings", CASES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("P,sizes", [(2, [1000, 24]), (3, [4096, 500, 7]), (2, [2048, 1024])])
def test_lowbit_flat_fast_path_matches_torch_path_bitwise(monkeypatch, settings, P, sizes):
    """The flat fast path (no padding copy, kept byte rows, decode into the bucket) with native
    kernels equals the general path with the eager torch kernels: wire bytes, results, residuals."""
    comp = LowBit(**settings)
    calls = []
    real = AR._flat_rounds
    monkeypatch.setattr(AR, "_flat_rounds", lambda *a: calls.append(1) or real(*a))
    fast = _run(comp, sizes, P)
    assert len(calls) == 3 * P, "the fast path was not taken"
    monkeypatch.setattr(AR, "_fast_flat", lambda *a: False)
    monkeypatch.setattr(K, "_native", lambda: None)
    assert K.implementation("cpu") == "torch"
    slow = _run(comp, sizes, P)
    _equal(fast, slow)
    for step in fast[0]:              # replicas identical
        assert all(torch.equal(step[0], o) for o in step[1:])


@native
def test_lowbit_fast_path_not_taken_where_it_does_not_apply(monkeypatch):
    """Hadamard, simulated quantization, a raw stage, EF21 and chunking keep the general path."""
    calls = []
    monkeypatch.setattr(AR, "_flat_rounds", lambda *a: calls.append(1))
    for settings in (dict(hadamard=True), dict(simulate_quantization=True), dict(stage2_bitwidth=32),
                     dict(error_feedback_mode="ef21"), dict(chunk_size=256)):
        _run(LowBit(**settings), [2048], 2, steps=1)
    assert calls == []


_SPECIALS = [
    lambda n, g: torch.randn(n, generator=g),
    lambda n, g: torch.randn(n, generator=g) * 1e-40,                 # subnormal
    lambda n, g: torch.randn(n, generator=g) * 3e38,                  # near float max
    lambda n, g: torch.randint(-40, 41, (n,), generator=g).float() * 0.5,   # rounding ties
    lambda n, g: torch.randn(n, generator=g) * torch.logspace(-30, 30, n),
    lambda n, g: torch.where(torch.arange(n) % 2 == 0, torch.tensor(-0.0), torch.tensor(0.0)),
]


@native
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("block", [32, 128, 1024])
def test_vectorized_quantize_matches_torch_reference(bits, block):
    """The AVX2 round-to-nearest block quantizer (2/4/8 bits) writes the reference's bytes, also
    for subnormals, huge values, ties, ±0, NaN/Inf blocks and a partial last block; and the fused
    dequantize-sum-requantize that uses it does too."""
    g = torch.Generator().manual_seed(bits * block)
    for make in _SPECIALS:
        for n in (3 * block, 3 * block - 5):
            x = make(n, g).float()
            if make is _SPECIALS[0]:
                x[block + 1] = float("nan")
                x[2 * block] = float("inf")
            p1, s1 = K.quantize_pack(x, bits, block, impl="native")
            p2, s2 = K.quantize_pack(x, bits, block, impl="torch")
            assert torch.equal(p1, p2) and torch.equal(s1.view(torch.int16), s2.view(torch.int16))
            rows, sc = torch.stack([p1, p1.roll(3)]), torch.stack([s1, s1.flip(0)])
            base = torch.randn(n, generator=g)
            for acc in (False, True):       # the vectorized decoder (1/2/4/8 bits), alone and summing
                d1 = K.unpack_dequantize_accumulate(rows, sc, n, bits, block, out=base.clone(),
                                                    accumulate=acc, impl="native")
                d2 = K.unpack_dequantize_accumulate(rows, sc, n, bits, block, out=base.clone(),
                                                    accumulate=acc, impl="torch")
                assert torch.equal(d1.view(torch.int32), d2.view(torch.int32))
            for ob in (2, 4, 8):
                a = K.dequantize_sum_requantize(rows, sc, n, bits, block, out_bits=ob, alpha=0.5, impl="native")
                b = K.dequantize_sum_requantize(rows, sc, n, bits, block, out_bits=ob, alpha=0.5, impl="torch")
                assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.int16), b[1].view(torch.int16))


@native
@pytest.mark.parametrize("bits", [1, 2, 4, 8, 12, 16])
@pytest.mark.parametrize("stochastic", [False, True])
def test_fused_error_feedback_quantizer_matches_separate_steps(bits, stochastic):
    """``quantize_ef`` (compensate + quantize + residual update + drop non-finite, one pass) gives
    the bytes, scales and residual of the separate steps with the eager torch kernels: also for
    the special values, NaN/Inf in the gradient or the residual, and a partial last block."""
    block = 32 if bits == 16 else 128
    g = torch.Generator().manual_seed(bits + 100 * stochastic)
    for make in _SPECIALS:
        for n in (3 * block, 3 * block - 5):
            grad, e0 = make(n, g).float(), make(n, g).float() * 0.25
            if make is _SPECIALS[0]:
                grad[block + 1], e0[2 * block], grad[3] = float("nan"), float("inf"), 3e38
                e0[3] = 3e38                      # x = e + g overflows to inf
            e_ref = e0.clone().add_(grad)         # ErrorFeedback.compensate
            p2, s2 = K.quantize_pack(e_ref, bits, block, stochastic=stochastic, seed=5, index_offset=77,
                                     impl="torch")
            e_ref.sub_(K.unpack_dequantize(p2, s2, n, bits, block, impl="torch"))
            torch.nan_to_num_(e_ref, nan=0.0, posinf=0.0, neginf=0.0)
            e1 = e0.clone()
            p1, s1 = torch.empty_like(p2), torch.empty_like(s2)
            cpu_native.quantize_ef(grad, e1, bits, block, stochastic, 5, 77, p1, s1)
            assert torch.equal(p1, p2) and torch.equal(s1.view(torch.int16), s2.view(torch.int16))
            assert torch.equal(e1.view(torch.int32), e_ref.view(torch.int32))
    with pytest.raises(ValueError, match="elements"):
        cpu_native.quantize_ef(torch.zeros(4), torch.zeros(5), 4, 128, False, 0, 0, p1, s1)


@native
def test_lowbit_residual_feedback_is_fused_on_the_fast_path(monkeypatch):
    """With residual error feedback the flat fast path runs one fused quantizer pass per row and
    no separate decode of what it sent (the ``sent`` buffer is gone); the bitwise equality with
    the torch path is the EF cases of the fast-path test above, plus a NaN step here."""
    from bitscom.lowbit.codec import Codec
    fused, decodes = [], []
    real_ef, real_dec = Codec.encode_feedback, Codec.decode
    monkeypatch.setattr(Codec, "encode_feedback", lambda *a, **k: fused.append(1) or real_ef(*a, **k))
    monkeypatch.setattr(Codec, "decode", lambda *a, **k: decodes.append(1) or real_dec(*a, **k))
    from bitscom.lowbit.state import LowBitState
    scratch, real_scratch = [], LowBitState.scratch
    monkeypatch.setattr(LowBitState, "scratch", lambda self, name, *a: scratch.append(name) or real_scratch(self, name, *a))
    comp = LowBit(bitwidth=4, error_feedback=True)
    fast = _run(comp, [3000, 72], 3, steps=2)
    assert len(fused) == 2 * 3 * 3 and decodes == []
    assert scratch and "sent" not in scratch
    # a NaN in one rank's gradient: the residual drops it, the same bits as the torch path
    params = [("p", torch.nn.Parameter(torch.zeros(4096)))]
    layout = plan_buckets(params, 1 << 30)[0]

    def run():
        states = [comp.init_state(layout) for _ in range(2)]
        outs = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            flats = [torch.randn(4096, generator=gen) for _ in range(2)]
            if step == 1:
                flats[1][100] = float("nan")
            lockstep(comp, flats, states, layout, [[], []])
            outs.append([f.view(torch.int32).clone() for f in flats])
        return outs, [s.residual.residual.view(torch.int32).clone() for s in states]

    a = run()
    monkeypatch.setattr(AR, "_fast_flat", lambda *a: False)
    monkeypatch.setattr(K, "_native", lambda: None)
    b = run()
    for x, y in zip(sum(a[0], []), sum(b[0], [])):
        assert torch.equal(x, y)
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)
    assert fast[2][0][0] is not None


@native
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("settings", [dict(), dict(error_feedback=False), dict(block_size=None),
                                      dict(block_size=7), dict(block_size=32)],
                         ids=["default", "no-ef", "per-tensor", "block7", "block32"])
def test_signsgd_fused_native_path_matches_torch_path_bitwise(monkeypatch, P, settings):
    """Sign-SGD's fused native path (compensate inside the encode, eight 16-element segments
    interleaved, vectorized decode with the division by the world size fused, kept buffers)
    equals the torch path on distinct per-rank data: wire bytes, results, residuals, and NaN
    handling (a NaN step resets the residual on both paths)."""
    import bitscom.compressors.signsgd as S
    comp = S.SignSGD(**settings)
    sizes = [4096, 768, 13, 2048, 5, 1000, 256]        # whole 16-blocks, then unaligned ones
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    layout = plan_buckets(params, 1 << 30)[0]

    def run():
        states = [comp.init_state(layout) for _ in range(P)]
        gen = torch.Generator().manual_seed(P)
        outs, wire = [], [[] for _ in range(P)]
        for step in range(4):
            flats = [torch.randn(layout.numel, generator=gen) for _ in range(P)]
            for f in flats:
                f[7], f[8], f[4100] = 0.0, -0.0, -0.0
            if step == 2:
                flats[1][50] = float("nan")
            lockstep(comp, flats, states, layout, wire)
            outs.append([f.view(torch.int32).clone() for f in flats])
        res = [None if s.residual is None else s.residual.view(torch.int32).clone() for s in states]
        return outs, wire, res, []

    fast = run()
    monkeypatch.setattr(S, "_native_for", lambda x: None)
    slow = run()
    _equal(fast, slow)
    for step in fast[0][:2]:
        assert all(torch.equal(step[0], o) for o in step[1:])


@pytest.mark.parametrize("settings", [dict(), dict(ratio=0.01), dict(per_tensor=True),
                                      dict(error_feedback=False, ratio=0.2)],
                         ids=["default", "ratio0.01", "per-tensor", "no-ef"])
def test_topk_sampled_selection_matches_exact(monkeypatch, settings):
    """On the torch path TopK(selection="sampled") sends the same (value, index) records as the
    exact default (in another order) and gives bitwise the same average and residual, step after
    step; the threshold really prunes (topk runs over about 1.25 k candidates, never the bucket); a
    bucket with NaN still sends its NaN, as the exact path does. The native selection and scatter
    (the CPU default for either setting) send the same records as torch.topk (ascending index
    order) and give bitwise the torch path's average and residual."""
    from bitscom.compressors import TopK
    import bitscom.compressors.topk as TK
    sizes, P = [60000, 3000, 40000, 77], 2
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    layout = plan_buckets(params, 1 << 30)[0]
    seen = []
    real_topk = torch.Tensor.topk

    def run(selection):
        comp = TopK(selection=selection, **settings)
        states = [comp.init_state(layout) for _ in range(P)]
        gen = torch.Generator().manual_seed(5)
        outs, wire = [], [[] for _ in range(P)]
        for step in range(4):
            flats = [torch.randn(layout.numel, generator=gen) * (1 + 10 * (step == 1)) for _ in range(P)]
            if step == 3:
                flats[0][123] = float("nan")
            lockstep(comp, flats, states, layout, wire)
            outs.append([f.view(torch.int32).clone() for f in flats])
        res = [None if s.residual is None else s.residual.view(torch.int32).clone() for s in states]
        return outs, wire, res

    assert cpu_native.has_topk()                 # the source always has it; a compiler is on CI
    native = run("exact")
    monkeypatch.setattr(TK, "_native_topk", lambda x: None)    # the torch selection paths
    monkeypatch.setattr(torch.Tensor, "topk", lambda t, k, **kw: seen.append(t.numel()) or real_topk(t, k, **kw))
    sampled = run("sampled")
    k_total = TopK(**settings).k_of(layout)
    assert max(seen) < min(layout.numel // 2, 2 * k_total + 5000)   # topk over candidates only
    exact = run("exact")
    for a, b in zip(sampled[0], exact[0]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for x, y in zip(sampled[2], exact[2]):
        assert (x is None and y is None) or torch.equal(x, y)
    _same_records(sampled[1], exact[1])
    with pytest.raises(ValueError, match="selection"):
        TopK(selection="approx")
    monkeypatch.setattr(TK, "_native_for", lambda x: None)     # the torch scatter path too
    torch_path = run("exact")
    _equal((exact[0], exact[1], exact[2], []), (torch_path[0], torch_path[1], torch_path[2], []))
    _same_records(native[1], torch_path[1])
    for a, b in zip(native[0], torch_path[0]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for x, y in zip(native[2], torch_path[2]):
        assert (x is None and y is None) or torch.equal(x, y)
    for wire in native[1]:                        # native records: ascending indices
        for r in wire:
            k = r.numel() // 2
            if not settings.get("per_tensor"):
                assert bool((r[k + 1:] > r[k:-1]).all())


def _same_records(wire_a, wire_b):
    """Each rank sent the same (index, value) records in both runs, in any order."""
    for wa, wb in zip(wire_a, wire_b):
        for ra, rb in zip(wa, wb):
            assert ra.shape == rb.shape           # the same bytes on the wire
            k = ra.numel() // 2
            pa = sorted(zip(ra[k:].tolist(), ra[:k].tolist()))
            pb = sorted(zip(rb[k:].tolist(), rb[:k].tolist()))
            assert pa == pb                        # the same (index, value) records


def test_native_topk_is_torch_topk_with_nan_inf_ties_and_fallback():
    """cpu_native.topk picks a set of the same magnitudes as torch.topk (NaN the largest, then
    Inf), values equal to x at unique ascending indices, lower index first among equal
    magnitudes; also when the sampled threshold lets fewer than k entries through (entries large
    exactly at the sampled positions) and for k = 1, k = n and tiny inputs. Bad k is refused."""
    gen = torch.Generator().manual_seed(11)

    def check(x, k):
        v, i = cpu_native.topk(x, k)
        assert i.dtype == torch.int64 and v.dtype == torch.float32 and i.numel() == k
        assert bool((i[1:] > i[:-1]).all())                      # unique, ascending
        assert torch.equal(x[i].view(torch.int32), v.view(torch.int32))
        want = x.abs().topk(k).values.sort().values
        assert torch.equal(v.abs().sort().values.view(torch.int32), want.view(torch.int32))
        return i

    for n, k in [(1, 1), (10, 1), (10, 10), (5000, 4999), (200_000, 10_000), (1_000_000, 2_000)]:
        x = torch.randn(n, generator=gen)
        if n > 8:
            x[3], x[7], x[n - 1] = float("nan"), float("-inf"), -float("nan")
        check(x, k)
    ties = torch.randint(-3, 4, (100_000,), generator=gen).float()
    i = check(ties, 40_000)
    threes = (ties.abs() == 3).nonzero().flatten()
    twos = (ties.abs() == 2).nonzero().flatten()
    assert threes.numel() < 40_000
    assert torch.equal(i, torch.cat([threes, twos[:40_000 - threes.numel()]]).sort().values)
    spiky = torch.rand(1_000_000, generator=gen) * 1e-3
    spiky[::100] = 1.0                  # every sampled entry is 1: only 10,000 pass the threshold
    check(spiky, 50_000)
    for bad in (0, 11):
        with pytest.raises(RuntimeError, match="native"):
            cpu_native.topk(torch.randn(10), bad)
    # The fused error-feedback update: residual[indices] -= values, into another buffer or x itself.
    x = torch.randn(300_000, generator=gen)
    x[5], x[9] = float("inf"), -0.0
    other = torch.randn(300_000, generator=gen)
    want = other.clone()
    v, i = cpu_native.topk(x, 15_000)
    want.index_put_((i,), want[i] - v)
    got = other.clone()
    v2, i2 = cpu_native.topk(x, 15_000, subtract_from=got)
    assert torch.equal(i2, i) and torch.equal(got.view(torch.int32), want.view(torch.int32))
    own = x.clone()
    ref = x.clone()
    ref.index_put_((i,), ref[i] - v)                 # chosen entries become 0 (Inf - Inf: NaN)
    cpu_native.topk(own, 15_000, subtract_from=own)
    assert torch.equal(own.view(torch.int32), ref.view(torch.int32))
    with pytest.raises(ValueError, match="subtract_from"):
        cpu_native.topk(x, 10, subtract_from=torch.zeros(3))
