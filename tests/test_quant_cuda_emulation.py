"""Runs the real ``quant.cu`` kernels on the CPU, one std::thread per CUDA thread, and checks their
bytes against the torch reference, so the CUDA indexing/shuffle logic is tested without a GPU.

The harness maps CUDA intrinsics to host code: ``__f*_rn`` to plain IEEE float ops (built with
-ffp-contract=off), ``__shfl_xor_sync`` to a per-warp exchange array between two barriers. It
emulates semantics, not speed; the GPU tests in test_kernels.py check the real device.
"""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from bitscom import kernels as K
from bitscom.kernels import cuda as kcuda
from bitscom.kernels import format as fmt

HARNESS = r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>
struct Dim { unsigned x; };
thread_local Dim threadIdx, blockIdx;
thread_local Dim blockDim;
thread_local int warp_id;
static std::vector<std::unique_ptr<std::barrier<>>> g_bar;
static std::vector<std::vector<unsigned>> g_slot;
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static unsigned shfl_bits(unsigned v, int o) {
    int lane = threadIdx.x % 32;
    g_slot[warp_id][lane] = v;
    g_bar[warp_id]->arrive_and_wait();
    unsigned r = g_slot[warp_id][lane ^ o];
    g_bar[warp_id]->arrive_and_wait();
    return r;
}
static inline unsigned __shfl_xor_sync(unsigned, unsigned v, int o, int) { return shfl_bits(v, o); }
static inline float __shfl_xor_sync(unsigned, float v, int o, int) { return __uint_as_float(shfl_bits(__float_as_uint(v), o)); }
#include "quant.cu"
static void launch(unsigned grid, unsigned block, std::function<void()> body) {
    for (unsigned b = 0; b < grid; ++b) {
        g_bar.clear(); g_slot.assign(block / 32, std::vector<unsigned>(32));
        for (unsigned w = 0; w < block / 32; ++w) g_bar.emplace_back(new std::barrier<>(32));
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; ++t)
            ts.emplace_back([=] { threadIdx.x = t; blockIdx.x = b; blockDim.x = block; warp_id = t / 32; body(); });
        for (auto& th : ts) th.join();
    }
}
extern "C" {
void emu_quantize(unsigned grid, const float* x, long long n, int bits, int bs, int L, int sr, u32 k1, u32 k2,
                  u64 off, u8* payload, u16* scales, long long nb) {
    launch(grid, 256, [=] { bq_quantize(x, n, bits, bs, L, sr, k1, k2, off, payload, scales, nb); });
}
void emu_dequant_acc(unsigned grid, const u8* p, long long ps, const u16* s, long long ss, int P, long long n,
                     int bits, int bs, float* out, int acc) {
    launch(grid, 256, [=] { bq_dequant_acc(p, ps, s, ss, P, n, bits, bs, out, acc); });
}
void emu_dsr(unsigned grid, const u8* p, long long ps, const u16* s, long long ss, int P, long long n, int bits,
             int bs, int ob, int L, float alpha, int sr, u32 k1, u32 k2, u64 off, u8* payload, u16* os,
             float* sum_out, long long nb) {
    launch(grid, 256, [=] { bq_dsr(p, ps, s, ss, P, n, bits, bs, ob, L, alpha, sr, k1, k2, off, payload, os,
                                   sum_out, nb); });
}
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("cuemu")
    (d / "harness.cpp").write_text(HARNESS)
    lib = d / "emu.so"
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-pthread",
                           f"-I{kcuda.SOURCE.parent}", str(d / "harness.cpp"), "-o", str(lib)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        pytest.skip("cannot build the emulation harness (needs C++20 <barrier>):\n" + proc.stderr[-1500:])
    return ctypes.CDLL(str(lib))


def P(t):
    return ctypes.c_void_p(t.data_ptr())


def emu_quantize(lib, x, bits, bs, sr, seed, off):
    n = x.numel()
    nb = fmt.num_blocks(n, bs)
    payload = torch.zeros(fmt.payload_bytes(n, bits, bs), dtype=torch.uint8)
    scales = torch.zeros(nb, dtype=torch.int16)
    k1, k2 = fmt.seed_keys(seed)
    L = kcuda._lanes(bs, bits)
    lib.emu_quantize(ctypes.c_uint(-(-nb * L // 256)), P(x), ctypes.c_longlong(n), bits, bs, L, int(sr),
                     ctypes.c_uint32(k1), ctypes.c_uint32(k2), ctypes.c_uint64(off), P(payload), P(scales),
                     ctypes.c_longlong(nb))
    return payload, scales.view(torch.bfloat16)


def nasty(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-12, 4, n)
    if n > 600:
        x[128:256] = 0
        x[300] = float("nan")
    return x


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("bs", [32, 128])
def test_cuda_kernels_emulated_match_torch(emu, bits, bs):
    n = 700
    x = nasty(n, bits)
    for sr in (False, True):
        ref = K.quantize_pack(x, bits, bs, stochastic=sr, seed=3, index_offset=5, impl="torch")
        got = emu_quantize(emu, x, bits, bs, sr, 3, 5)
        assert torch.equal(ref[0], got[0]), ("quantize payload", sr)
        assert torch.equal(ref[1].view(torch.int16), got[1].view(torch.int16)), ("quantize scales", sr)
    # peers: rows of a wider buffer
    pb, nb = fmt.payload_bytes(n, bits, bs), fmt.num_blocks(n, bs)
    pay = torch.zeros(3, pb + 6, dtype=torch.uint8)
    scl = torch.zeros(3, nb + 1, dtype=torch.bfloat16)
    for i in range(3):
        K.quantize_pack(nasty(n, 10 + i).nan_to_num(0.0), bits, bs, payload=pay[i, :pb], scales=scl[i, :nb],
                        impl="torch")
    base = torch.randn(n)
    for acc in (False, True):
        ref = K.unpack_dequantize_accumulate(pay, scl, n, bits, bs, out=base.clone(), accumulate=acc, impl="torch")
        out = base.clone()
        groups = -(-n // fmt.group(bits)[0])     # ceil-divisions: thread groups, then blocks
        emu.emu_dequant_acc(ctypes.c_uint(-(-groups // 256)), P(pay), ctypes.c_longlong(pay.stride(0)),
                            P(scl), ctypes.c_longlong(scl.stride(0)), 3, ctypes.c_longlong(n), bits, bs, P(out),
                            int(acc))
        assert torch.equal(ref.view(torch.int32), out.view(torch.int32)), ("dequant", acc)
    for ob in (1, 4, 12):
        for sr in (False, True):
            sum_ref = torch.empty(n)
            ref = K.dequantize_sum_requantize(pay, scl, n, bits, bs, out_bits=ob, alpha=1 / 3, stochastic=sr,
                                              seed=9, index_offset=77, sum_out=sum_ref, impl="torch")
            op = torch.zeros(fmt.payload_bytes(n, ob, bs), dtype=torch.uint8)
            os_ = torch.zeros(nb, dtype=torch.int16)
            so = torch.zeros(n)
            k1, k2 = fmt.seed_keys(9)
            L = kcuda._lanes(bs, bits, ob)
            emu.emu_dsr(ctypes.c_uint(-(-nb * L // 256)), P(pay), ctypes.c_longlong(pay.stride(0)), P(scl),
                        ctypes.c_longlong(scl.stride(0)), 3, ctypes.c_longlong(n), bits, bs, ob, L,
                        ctypes.c_float(np.float32(1 / 3)), int(sr), ctypes.c_uint32(k1), ctypes.c_uint32(k2),
                        ctypes.c_uint64(77), P(op), P(os_), P(so), ctypes.c_longlong(nb))
            assert torch.equal(sum_ref.view(torch.int32), so.view(torch.int32)), ("dsr sum", ob, sr)
            assert torch.equal(ref[0], op), ("dsr payload", ob, sr)
            assert torch.equal(ref[1].view(torch.int16), os_), ("dsr scales", ob, sr)
