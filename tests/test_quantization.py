"""The low-bit format against float64 references: bounds, bit order, determinism, bad input."""
import math
import re

import pytest
import torch

from bitscom import quantization as Q
from bitscom.kernels import format as fmt

BITS = Q.SUPPORTED_BITS
MULTI = [b for b in BITS if b >= 2]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def stored_scales(q):
    return q.scales.to(torch.float64).repeat_interleave(q.block_size)[: q.numel]


def ref_scale(x64, bits, block_size, mean=False):
    """float64 per-element scale before bf16 rounding: max|x|/qmax (or mean|x| for 1-bit)."""
    n = x64.numel()
    nb = -(-n // block_size)
    xp = torch.nn.functional.pad(x64.abs(), (0, nb * block_size - n)).view(nb, block_size)
    s = xp.mean(1) if mean else xp.amax(1) / fmt.qmax(bits)
    return s.repeat_interleave(block_size)[:n]


# ---------------------------------------------------------------- packing

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 33, 1000])
def test_pack_unpack_roundtrip_exact(bits, count):
    codes = torch.randint(0, 1 << bits, (count,), generator=gen(count + bits))
    packed = Q.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == (count * bits + 7) // 8
    assert torch.equal(Q.unpack(packed, bits, count), codes.to(torch.int32))


@pytest.mark.parametrize("bits", BITS)
def test_bit_order_is_little_endian_stream(bits):
    codes = torch.randint(0, 1 << bits, (24,), generator=gen(bits))
    stream = "".join(format(int(c), f"0{bits}b")[::-1] for c in codes)  # LSB first per code
    expect = [int(stream[k:k + 8][::-1], 2) for k in range(0, len(stream), 8)]
    assert Q.pack(codes, bits).tolist() == expect


def test_documented_examples_of_bit_order():
    assert Q.pack(torch.tensor([1, 2, 3]), 4).tolist() == [0x21, 0x03]
    assert Q.pack(torch.tensor([0xABC, 0xDEF]), 12).tolist() == [0xBC, 0xFA, 0xDE]
    assert Q.pack(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1]), 1).tolist() == [0x81]
    assert Q.pack(torch.tensor([0x1234]), 16).tolist() == [0x34, 0x12]


# ---------------------------------------------------------------- rounding bounds

@pytest.mark.parametrize("bits", MULTI)
@pytest.mark.parametrize("block_size", [32, 128])
def test_rtn_error_within_half_step_of_stored_scale(bits, block_size):
    x = torch.randn(5000, generator=gen(bits)) * torch.logspace(-3, 2, 5000)
    q = Q.quantize(x, bits, block_size)
    s = stored_scales(q)
    x64 = x.double()
    err = (Q.dequantize(q).double() - x64).abs()
    assert torch.all(err <= s / 2 * (1 + 1e-6))
    # stored scale = float64 max|x|/qmax rounded up to bf16 (8-bit mantissa): within 2**-7 above
    r = ref_scale(x64, bits, block_size)
    assert torch.all(s >= r) and torch.all(s <= r * (1 + 2 ** -7))


@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_is_unbiased(bits):
    n, block = 128, 128
    x = torch.randn(n, generator=gen(100 + bits))
    x64 = x.double()
    for trials in (64, 1024):
        # each repetition gets distinct global indices, hence independent random numbers
        q = Q.quantize(x.repeat(trials), bits, block, stochastic_rounding=True, seed=5)
        assert torch.unique(q.scales).numel() == 1  # same block content -> same scale each trial
        s = float(q.scales[0])
        step = 2 * s if bits == 1 else s
        d = Q.dequantize(q).double().view(trials, n)
        # each draw lies on one of the two levels around x, so its std is <= step/2
        assert torch.all((d - x64).abs() <= step * (1 + 1e-6))
        mean_err = (d.mean(0) - x64).abs()
        bound = 5.0 * (step / 2) / math.sqrt(trials)  # 5 sigma per element
        assert torch.all(mean_err <= bound), (trials, float(mean_err.max()), bound)


def test_stochastic_rounding_error_shrinks_with_trials():
    x = torch.randn(128, generator=gen(3))
    errs = []
    for trials in (16, 1024):
        q = Q.quantize(x.repeat(trials), 2, 128, stochastic_rounding=True, seed=11)
        d = Q.dequantize(q).double().view(trials, -1)
        errs.append(float((d.mean(0) - x.double()).pow(2).mean().sqrt()))
    assert errs[1] < errs[0] / 4  # 1/sqrt(64) = 1/8 in expectation


def test_rtn_is_deterministic_and_ignores_seed():
    x = torch.randn(1000, generator=gen(0))
    a, b = Q.quantize(x, 4, seed=1), Q.quantize(x, 4, seed=2)
    assert torch.equal(a.payload, b.payload) and torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))


@pytest.mark.parametrize("bits", BITS)
def test_seed_determinism(bits):
    x = torch.randn(3000, generator=gen(1))
    a = Q.quantize(x, bits, stochastic_rounding=True, seed=42)
    b = Q.quantize(x, bits, stochastic_rounding=True, seed=42)
    c = Q.quantize(x, bits, stochastic_rounding=True, seed=43)
    assert torch.equal(a.payload, b.payload)
    assert not torch.equal(a.payload, c.payload)


def test_sr_does_not_touch_global_rng():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    Q.quantize(torch.ones(100) * 0.3, 4, stochastic_rounding=True, seed=1)
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------- 1 bit

def test_one_bit_keeps_signs_and_uses_block_mean():
    x = torch.randn(1000, generator=gen(9))
    x[5] = 0.0
    q = Q.quantize(x, 1, 128)
    d = Q.dequantize(q).double()
    nz = x != 0
    assert torch.equal(torch.sign(d[nz]), torch.sign(x[nz].double()))
    assert d[5] > 0  # zero maps to +s
    r = ref_scale(x.double(), 1, 128, mean=True)
    assert torch.all(d.abs() >= r * (1 - 1e-6)) and torch.all(d.abs() <= r * (1 + 2 ** -7))


def test_one_bit_sr_keeps_sign_of_block_maximum():
    x = torch.tensor([-3.0] + [0.1] * 127)
    d = Q.dequantize(Q.quantize(x, 1, 128, stochastic_rounding=True, seed=0))
    assert d[0] == -3.0 and torch.all(d.abs() == 3.0)


# ---------------------------------------------------------------- ranges and special values

@pytest.mark.parametrize("bits", BITS)
def test_zero_blocks_decode_to_zero(bits):
    x = torch.randn(384, generator=gen(2))
    x[128:256] = 0
    d = Q.dequantize(Q.quantize(x, bits, 128, stochastic_rounding=bits == 1))
    assert torch.all(d[128:256] == 0)
    assert Q.dequantize(Q.quantize(torch.zeros(10), bits)).abs().sum() == 0


@pytest.mark.parametrize("bits", MULTI)
@pytest.mark.parametrize("mag", [1e-12, 1e-6, 1.0, 1e4])
def test_tiny_and_large_magnitudes_neither_underflow_nor_overflow(bits, mag):
    x = torch.randn(256, generator=gen(4)) * mag
    q = Q.quantize(x, bits, 128)
    assert torch.all(torch.isfinite(q.scales.float())) and torch.all(q.scales.float() > 0)
    err = (Q.dequantize(q).double() - x.double()).abs()
    amax = x.abs().max().item()
    assert err.max().item() <= amax / fmt.qmax(bits) * (1 + 2 ** -7) / 2 * (1 + 1e-6)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_poisons_exactly_its_block(bits, bad):
    x = torch.randn(384, generator=gen(6))
    x[200] = bad
    d = Q.dequantize(Q.quantize(x, bits, 128))
    assert torch.all(torch.isnan(d[128:256]))
    assert torch.all(torch.isfinite(d[:128])) and torch.all(torch.isfinite(d[256:]))


def test_subnormal_block_keeps_a_nonzero_scale():
    x = torch.full((32,), 1e-39)
    q = Q.quantize(x, 2, 32)
    assert float(q.scales[0]) > 0


def test_float32_max_does_not_overflow_scale():
    x = torch.tensor([3.4e38, -3.4e38] + [1.0] * 30)
    d = Q.dequantize(Q.quantize(x, 2, 32))
    assert torch.all(torch.isfinite(d)) and d[0] > 3e38 and d[1] < -3e38


@pytest.mark.parametrize("shape", [(), (0,), (1,), (127,), (129,), (3, 5, 7), (2, 0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shapes_and_dtypes_roundtrip(shape, dtype):
    x = torch.randn(shape, generator=gen(7)).to(dtype)
    q = Q.quantize(x, 8, 32)
    d = Q.dequantize(q)
    assert d.shape == x.shape and d.dtype == dtype
    assert q.numel == x.numel()
    if x.numel():
        tol = x.float().abs().max() / 127 * 0.51 + x.float().abs().max() * 2 ** -7
        assert torch.all((d.float() - x.float()).abs() <= tol)


def test_sixteen_bit_is_near_lossless_for_half():
    x = torch.randn(1000, generator=gen(8)).half()
    d = Q.dequantize(Q.quantize(x, 16, 32))
    assert torch.allclose(d.float(), x.float(), atol=float(x.abs().max()) * 2e-5)


def test_dequantize_into_out():
    x = torch.randn(4, 50, generator=gen(9))
    q = Q.quantize(x, 8)
    out = torch.empty(4, 50)
    assert Q.dequantize(q, out=out) is out
    assert torch.equal(out, Q.dequantize(q))


# ---------------------------------------------------------------- wire size

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel", [0, 1, 128, 1000])
def test_nbytes_counts_payload_and_scales(bits, numel):
    q = Q.quantize(torch.randn(numel), bits, 128)
    actual = q.payload.numel() * q.payload.element_size() + q.scales.numel() * q.scales.element_size()
    assert q.payload.dtype == torch.uint8 and q.payload.dim() == 1
    assert q.nbytes == actual == Q.wire_bytes(numel, bits, 128)
    assert q.nbytes == -(-numel // 128) * (128 * bits // 8 + 2)


def test_bits_per_element():
    assert Q.bits_per_element(4, 128) == 4.125
    assert Q.wire_bytes(1 << 20, 4, 128) * 8 / (1 << 20) == 4.125


# ---------------------------------------------------------------- Hadamard

def sylvester(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@pytest.mark.parametrize("block", [1, 2, 8, 32])
def test_hadamard_matches_matrix_and_inverts(block):
    x = torch.randn(4, 64, generator=gen(10))
    y = Q.hadamard(x, block)
    ref = (x.double().view(-1, block) @ sylvester(block)).view(4, 64)
    assert torch.allclose(y.double(), ref, atol=1e-5)
    assert torch.allclose(Q.inverse_hadamard(y, block), x, atol=1e-5)
    assert torch.allclose(y.double().norm(), x.double().norm(), rtol=1e-6)


def test_quantize_with_hadamard_roundtrips_and_smooths_outliers():
    x = torch.randn(1000, generator=gen(11))
    x[::128] = 50.0  # one outlier per block dominates its scale unless rotated away
    plain = (Q.dequantize(Q.quantize(x, 4, 128)) - x).norm()
    q = Q.quantize(x, 4, 128, hadamard=True)
    assert q.hadamard and q.nbytes == Q.wire_bytes(1000, 4, 128)
    rot = (Q.dequantize(q) - x).norm()
    assert rot < plain
    assert Q.dequantize(q).shape == x.shape


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("bits", [0, 3, 5, 32, 4.0, True, "4"])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 4, 8, 12, 16\), got " + re.escape(repr(bits))):
        Q.quantize(torch.randn(8), bits)


@pytest.mark.parametrize("block_size", [0, -128, 16, 100, 96, 1 << 17, 128.0])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match=r"block_size must be (an int|a power of two) in \[32, 65536\].*got "
                       + re.escape(repr(block_size))):
        Q.quantize(torch.randn(8), 4, block_size)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_tensor_rejected(dtype):
    with pytest.raises(TypeError, match=str(dtype)):
        Q.quantize(torch.zeros(8, dtype=dtype), 4)


def test_other_bad_inputs():
    with pytest.raises(TypeError, match="torch.Tensor"):
        Q.quantize([1.0, 2.0], 4)
    with pytest.raises(ValueError, match="seed"):
        Q.quantize(torch.randn(8), 4, seed=-1)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 15\]"):
        Q.pack(torch.tensor([16]), 4)
    with pytest.raises(TypeError, match="integer"):
        Q.pack(torch.tensor([1.0]), 4)
    with pytest.raises(ValueError, match="need 2"):
        Q.unpack(torch.zeros(1, dtype=torch.uint8), 4, 3)
    with pytest.raises(ValueError, match="multiple of block"):
        Q.hadamard(torch.randn(33), 32)
    with pytest.raises(ValueError, match=r"block must be a power of two \(e.g. 32\), got 24"):
        Q.hadamard(torch.randn(24), 24)
    with pytest.raises(TypeError, match="dense"):
        Q.quantize(torch.randn(4, 4).to_sparse(), 4)


def test_seed_names_quantize_tensor_and_sign_packing():
    x = torch.randn(1000)
    q = Q.quantize_tensor(x, 4, stochastic_rounding=True, seed=3)
    ref = Q.quantize(x, 4, stochastic_rounding=True, seed=3)
    assert torch.equal(q.payload, ref.payload) and torch.equal(q.scales, ref.scales)
    assert torch.equal(Q.dequantize_tensor(q), Q.dequantize(ref))
    # 1-bit signs are the format's 1-bit codes (1 = negative), packed by the format's packer
    s = torch.tensor([-1.0, 2.0, 0.0, -0.0, float("nan"), -3.0, 5.0, -8.0, -1.0])
    assert Q.pack_signs(s).tolist() == Q.pack((s < 0).long(), 1).tolist() == [0b10100001, 1]
    assert Q.unpack_signs(Q.pack_signs(s), 9).tolist() == [-1, 1, 1, 1, 1, -1, 1, -1, -1]
