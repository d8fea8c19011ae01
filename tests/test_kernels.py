"""Kernel API: byte parity of every implementation with the eager torch reference, sharding,
fused reduce step, counter hash, .cu compilation, and (with a GPU) CUDA parity."""
import pathlib
import shutil
import subprocess

import pytest
import torch

from bitscom import kernels as K
from bitscom.kernels import format as fmt
from bitscom.kernels import torch_ref

BITS = fmt.SUPPORTED_BITS
CU_FILES = sorted(pathlib.Path(K.__file__).parent.glob("*.cu"))


def native_ok():
    from bitscom.kernels import cpu_native
    return cpu_native.available()


def cuda_ok():
    if not torch.cuda.is_available():
        return False
    from bitscom.kernels import cuda
    return cuda.available()


needs_native = pytest.mark.skipif(not native_ok(), reason="no C++ compiler for the native CPU path")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def nasty(n, seed=0):
    """Mixed magnitudes 1e-12..1e4, a zero block, a NaN block (when long enough)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-12, 4, n) if n else torch.randn(0)
    if n > 600:
        x[128:256] = 0
        x[300] = float("nan")
        x[450] = float("-inf")
    return x


def same(a, b):
    """Bitwise equality of (payload, scales) pairs or float tensors."""
    if isinstance(a, tuple):
        return all(same(u, v) for u, v in zip(a, b))
    if a.dtype in (torch.bfloat16, torch.float32):
        a, b = a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32), \
            b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32)
    return a.shape == b.shape and torch.equal(a, b)


def clone(t):
    return tuple(x.clone() for x in t)


def check_parity(impl, device):
    for bits in BITS:
        for sr in (False, True):
            for n in (0, 1, 100, 1000, 4096 + 17):
                x = nasty(n, bits + n)
                ref = K.quantize_pack(x, bits, 128, stochastic=sr, seed=3, index_offset=5, impl="torch")
                got = clone(K.quantize_pack(x.to(device), bits, 128, stochastic=sr, seed=3, index_offset=5,
                                            impl=impl))
                assert same(ref, tuple(t.cpu() for t in got)), (bits, sr, n)
                P, S = torch.stack([ref[0], ref[0].flip(0), ref[0]]), torch.stack([ref[1]] * 3)
                d_ref = K.unpack_dequantize_accumulate(P, S, n, bits, impl="torch")
                d = K.unpack_dequantize_accumulate(P.to(device), S.to(device), n, bits, impl=impl)
                assert same(d_ref, d.cpu()), (bits, sr, n)
                r_ref = K.dequantize_sum_requantize(P, S, n, bits, out_bits=4, alpha=1 / 3, stochastic=sr,
                                                    seed=9, index_offset=77, impl="torch")
                r = K.dequantize_sum_requantize(P.to(device), S.to(device), n, bits, out_bits=4, alpha=1 / 3,
                                                stochastic=sr, seed=9, index_offset=77, impl=impl)
                assert same(r_ref, tuple(t.cpu() for t in r)), (bits, sr, n)


# ---------------------------------------------------------------- native CPU path

@needs_native
def test_native_matches_torch_bytes():
    check_parity("native", "cpu")


@needs_native
@pytest.mark.parametrize("bits", [1, 4, 12])
def test_native_matches_torch_across_2_32_index_boundary(bits):
    x = nasty(1024, 1)
    off = 2 ** 32 - 200  # one block straddles the boundary, later ones have hi = 1
    a = K.quantize_pack(x, bits, 128, stochastic=True, seed=2 ** 40 + 5, index_offset=off, impl="torch")
    b = K.quantize_pack(x, bits, 128, stochastic=True, seed=2 ** 40 + 5, index_offset=off, impl="native")
    assert same(a, b)


@needs_native
def test_native_strided_rows_and_accumulate():
    n, bits = 1000, 4
    pb, nb = K.payload_bytes(n, bits, 128), K.num_blocks(n, 128)
    recv = torch.zeros(3, pb + 10, dtype=torch.uint8)  # rows wider than the payload: views
    scl = torch.zeros(3, nb + 3, dtype=torch.bfloat16)
    xs = [nasty(n, s).nan_to_num(0.0) for s in range(3)]
    for i, x in enumerate(xs):
        K.quantize_pack(x, bits, payload=recv[i, :pb], scales=scl[i, :nb])
    base = torch.randn(n)
    for impl in ("torch", "native"):
        out = base.clone()
        K.unpack_dequantize_accumulate(recv, scl, n, bits, out=out, accumulate=True, impl=impl)
        if impl == "torch":
            ref = out
    assert same(ref, out)


# ---------------------------------------------------------------- API semantics (default impl)

@pytest.mark.parametrize("bits", [1, 4, 16])
def test_sharded_quantization_equals_whole(bits):
    """index_offset makes SR bytes independent of sharding (shards on block boundaries)."""
    x = torch.randn(4 * 512)
    whole = K.quantize_pack(x, bits, 128, stochastic=True, seed=7)
    parts = [K.quantize_pack(x[i * 512:(i + 1) * 512], bits, 128, stochastic=True, seed=7, index_offset=i * 512)
             for i in range(4)]
    assert same(whole, (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))


def test_shards_into_one_send_buffer():
    """payload_bytes/num_blocks lay W shards out in rows of one contiguous buffer."""
    W, shard, bits = 4, 1000, 4
    x = torch.randn(W * shard)
    pb, nb = K.payload_bytes(shard, bits, 128), K.num_blocks(shard, 128)
    assert pb % 2 == 0
    send = torch.empty(W, pb + 2 * nb, dtype=torch.uint8)
    for r in range(W):
        K.quantize_pack(x[r * shard:(r + 1) * shard], bits, payload=send[r, :pb],
                        scales=send[r, pb:].view(torch.bfloat16), index_offset=r * shard)
    y = K.unpack_dequantize(send[2, :pb], send[2, pb:].view(torch.bfloat16), shard, bits)
    s = send[2, pb:].view(torch.bfloat16).double().repeat_interleave(128)[:shard]
    assert torch.all((y.double() - x[2 * shard:3 * shard].double()).abs() <= s / 2 * (1 + 1e-6))
    assert send.numel() == W * K.wire_bytes(shard, bits, 128)


def test_dequantize_sum_requantize_against_float64():
    P, n, bits = 4, 1000, 8
    xs = torch.randn(P, n, dtype=torch.float64)
    qs = [K.quantize_pack(x.float(), bits) for x in xs]
    pay, scl = torch.stack([q[0] for q in qs]), torch.stack([q[1] for q in qs])
    deq = torch.stack([K.unpack_dequantize(q[0], q[1], n, bits) for q in qs]).double()
    sum_out = torch.empty(n)
    p, s = K.dequantize_sum_requantize(pay, scl, n, bits, out_bits=4, alpha=0.25, sum_out=sum_out)
    mean64 = deq.sum(0) * 0.25
    assert torch.allclose(sum_out.double(), mean64, rtol=0, atol=1e-6)
    out = K.unpack_dequantize(p, s, n, 4).double()
    step = s.double().repeat_interleave(128)[:n]
    assert torch.all((out - sum_out.double()).abs() <= step / 2 * (1 + 1e-6))
    # the stored scale is float64 max|acc|/7 rounded up to bf16
    ref = sum_out.double().abs().view(-1).split(128)
    ref = torch.stack([torch.nn.functional.pad(r, (0, 128 - r.numel())).max() for r in ref]) / 7
    assert torch.all(s.double() >= ref) and torch.all(s.double() <= ref * (1 + 2 ** -7))


def test_unpack_dequantize_accumulate_sums_peers():
    P, n = 3, 513
    xs = torch.randn(P, n)
    qs = [K.quantize_pack(x, 16) for x in xs]
    out = K.unpack_dequantize_accumulate(torch.stack([q[0] for q in qs]), torch.stack([q[1] for q in qs]), n, 16)
    assert torch.allclose(out, xs.sum(0), atol=1e-3)
    out2 = K.unpack_dequantize_accumulate(torch.stack([q[0] for q in qs]), torch.stack([q[1] for q in qs]), n, 16,
                                          out=torch.ones(n), accumulate=True)
    assert torch.allclose(out2, out + 1, atol=1e-5)


def test_counter_hash_matches_python_reference():
    idx = [0, 1, 2, 12345, 2 ** 32 - 1, 2 ** 32, 2 ** 33 + 7]
    for seed in (0, 1, 2 ** 63 + 11):
        k1, k2 = fmt.seed_keys(seed)
        for i in idx:
            expect = fmt.fmix32(fmt.fmix32((i & fmt.MASK32) ^ k1) ^ (i >> 32) ^ k2) >> 8
            assert torch_ref.uniform24(seed, i, 1, "cpu").item() == expect


def test_counter_hash_is_uniform():
    r = torch_ref.uniform24(3, 0, 1 << 16, "cpu") / 2 ** 24
    assert abs(r.mean().item() - 0.5) < 4 * (1 / 12) ** 0.5 / 2 ** 8
    hist = torch.histc(r, bins=16, min=0, max=1)
    assert hist.min() > 4096 * 0.9 and hist.max() < 4096 * 1.1


def test_kernel_bad_arguments():
    with pytest.raises(TypeError, match="float32"):
        K.quantize_pack(torch.randn(8, dtype=torch.float64), 4)
    with pytest.raises(TypeError, match="1-D"):
        K.quantize_pack(torch.randn(2, 8), 4)
    with pytest.raises(ValueError, match="payload must be"):
        K.quantize_pack(torch.randn(8), 4, payload=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"impl must be one of \('torch', 'native', 'cuda', None\), got 'fortran'"):
        K.quantize_pack(torch.randn(8), 4, impl="fortran")
    with pytest.raises(ValueError, match="index_offset"):
        K.quantize_pack(torch.randn(8), 4, index_offset=-1)
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 4, 8, 12, 16\), got 3"):
        K.dequantize_sum_requantize(torch.zeros(1, 64, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.bfloat16),
                                    128, 4, out_bits=3)
    with pytest.raises(TypeError, match="payloads"):
        K.unpack_dequantize_accumulate(torch.zeros(1, 10, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.bfloat16),
                                       128, 4)
    with pytest.raises(ValueError, match="impl='cuda' needs CUDA"):
        K.quantize_pack(torch.randn(8), 4, impl="cuda")


# ---------------------------------------------------------------- CUDA sources and GPU

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cu", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cu_files_compile(cu, arch, tmp_path):
    proc = subprocess.run(["nvcc", f"-arch={arch}", "--cubin", "-std=c++17", "--fmad=false", str(cu), "-o",
                           str(tmp_path / "k.cubin")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


def test_there_are_cu_files():
    assert CU_FILES, "bitscom/kernels/*.cu missing"


@needs_gpu
def test_cuda_matches_torch_bytes():
    assert cuda_ok(), "CuPy missing: pip install cupy-cuda13x"
    check_parity("cuda", "cuda")


@needs_gpu
def test_cuda_default_dispatch_and_stream():
    assert K.implementation("cuda") == "cuda"
    x = torch.randn(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        p, sc = K.quantize_pack(x, 4, stochastic=True, seed=1)
        y = K.unpack_dequantize(p, sc, x.numel(), 4)
    s.synchronize()
    ref = K.quantize_pack(x.cpu(), 4, stochastic=True, seed=1, impl="torch")
    assert same(ref, (p.cpu(), sc.cpu()))
    assert torch.all((y - x).abs() <= sc.float().repeat_interleave(128)[: x.numel()])


@needs_gpu
def test_cuda_speed_sanity():
    """Quantize+pack of 2**26 floats should take well under the time of 20 device copies."""
    x = torch.randn(1 << 26, device="cuda")
    y = torch.empty_like(x)
    p, s = K.quantize_pack(x, 4)
    out = torch.empty_like(x)

    def t(f):
        f()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            f()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / 5
    tc = t(lambda: y.copy_(x))
    assert t(lambda: K.quantize_pack(x, 4, payload=p, scales=s)) < 20 * tc
    assert t(lambda: K.unpack_dequantize(p, s, x.numel(), 4, out=out)) < 20 * tc


@pytest.mark.parametrize("bits,out_bits", [(1, 4), (2, 4), (4, 4), (8, 8), (12, 12), (16, 16), (4, 32)])
@pytest.mark.parametrize("sr", [False, True])
def test_collectives_fused_reduce_step_gives_the_unfused_bytes(bits, out_bits, sr):
    """The all-reduce's reduce step runs kernels.dequantize_sum_requantize (Codec.decode_sum_encode);
    it must put exactly the bytes of decode-sum, scale, encode on the wire."""
    from bitscom.quantization import Codec
    P, m = 3, 1000
    c1, c2 = Codec(bits, 128, sr), Codec(out_bits, 128, sr)
    rows = torch.empty(P, c1.row_bytes(m), dtype=torch.uint8)
    for j in range(P):
        c1.encode(torch.randn(m) * torch.logspace(-3, 1, m), rows[j], seed=j, offset=0)
    fused = torch.empty(c2.row_bytes(m), dtype=torch.uint8)
    c1.decode_sum_encode(rows, m, 1 / P, c2, fused, seed=7, offset=99)
    acc = torch.empty(m)
    c1.decode_sum(rows, m, acc)
    acc.mul_(1 / P)
    plain = torch.empty_like(fused)
    c2.encode(acc, plain, seed=7, offset=99)
    assert torch.equal(fused, plain)
