// CUDA kernels of the low-bit format (see bitscom/quantization.py for the format).
//
// Compiled at first use by NVRTC through CuPy (bitscom/kernels/cuda.py), with --fmad=false.
// They must reproduce the bytes of the eager torch reference (torch_ref.py): every float step
// uses an explicitly rounded intrinsic (__fdiv_rn, __fmul_rn, __fadd_rn, rintf, floorf), sums of
// |x| for 1-bit scales follow the contiguous-halves tree, and peer sums run left to right.
//
// Work split: a "group" of L lanes (L = min(32, block_size / codes-per-byte-group), a power of two,
// 32 / L groups per warp) owns one quantization block; lane l owns the contiguous elements
// [l*m, (l+1)*m), m = block_size / L, so it reads them, reduces with warp shuffles of width L and
// writes its m*bits/8 bytes. Every lane of a warp takes part in the shuffles, also past the end.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;
typedef unsigned char u8;

#define FULL_MASK 0xffffffffu
#define MAX_STACK 20

__device__ __forceinline__ u32 fmix32(u32 h) {
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
    return h;
}

__device__ __forceinline__ int codes_per_group(int bits) { return bits <= 8 ? 8 / bits : (bits == 12 ? 2 : 1); }
__device__ __forceinline__ int bytes_per_group(int bits) { return bits <= 8 ? 1 : (bits == 12 ? 3 : 2); }
__device__ __forceinline__ int qmax_of(int bits) { return bits == 1 ? 1 : (1 << (bits - 1)) - 1; }

// 24 uniform bits for global element index idx, as an exact float.
__device__ __forceinline__ float uniform24(u64 idx, u32 k1, u32 k2) {
    u32 h = fmix32((u32)idx ^ k1);
    h = fmix32(h ^ (u32)(idx >> 32) ^ k2);
    return (float)(h >> 8);
}

// fp32 scale -> bf16 bits rounded up (see torch_ref._stored_scales).
__device__ __forceinline__ u32 stored_scale(float raw, u32 amax_bits, bool finite) {
    if (!finite) return 0x7FC0u;
    u32 r = (__float_as_uint(raw) + 0xFFFFu) >> 16;
    if (r == 0u && amax_bits > 0u) r = 1u;
    if (r >= 0x7F80u) r = 0x7F7Fu;
    return r;
}

__device__ __forceinline__ float level(int c, int bits) {
    return bits == 1 ? (float)(1 - 2 * c) : (float)(c - qmax_of(bits));
}

// Code of one element, given the stored scale s > 0 (finite block).
__device__ __forceinline__ u32 encode(float x, float s, int bits, int sr, u64 idx, u32 k1, u32 k2) {
    if (bits == 1 && !sr) return x < 0.0f ? 1u : 0u;
    const float y = __fdiv_rn(x, s);
    const float r = sr ? uniform24(idx, k1, k2) : 0.0f;
    if (bits == 1) {
        const float t = __fmul_rn(__fsub_rn(1.0f, y), 0.5f);
        return r < __fmul_rn(t, 16777216.0f) ? 1u : 0u;
    }
    const int qm = qmax_of(bits);
    float q;
    if (sr) {
        const float fl = floorf(y);
        q = __fadd_rn(fl, r < __fmul_rn(__fsub_rn(y, fl), 16777216.0f) ? 1.0f : 0.0f);
    } else {
        q = rintf(y);
    }
    q = fminf(fmaxf(q, (float)-qm), (float)qm);
    return (u32)((int)q + qm);
}

// Quantize the block starting at element `base` of src (n valid elements in total; the rest is 0).
// All lanes of the warp must call it (inactive groups pass active=false).
__device__ void quantize_block(const float* __restrict__ src, long long n, long long base, int lane, int L,
                               int bs, int bits, int sr, u32 k1, u32 k2, u64 off, u8* __restrict__ out,
                               u16* __restrict__ scale_out, bool active) {
    const int m = bs / L;
    const long long e0 = base + (long long)lane * m;
    const bool mean = bits == 1 && !sr;
    u32 am = 0u;
    float stk[MAX_STACK];
    int top = 0;
    for (int t = 0; t < m; ++t) {
        const long long e = e0 + t;
        const float x = (active && e < n) ? src[e] : 0.0f;
        const u32 a = __float_as_uint(x) & 0x7FFFFFFFu;
        am = a > am ? a : am;
        if (mean) {  // streaming contiguous-halves tree over the lane's chunk
            float v = fabsf(x);
            for (int lvl = 0; (t >> lvl) & 1; ++lvl) v = __fadd_rn(stk[--top], v);
            stk[top++] = v;
        }
    }
    float tree = mean ? stk[0] : 0.0f;
    for (int o = 1; o < L; o <<= 1) {
        const u32 other = __shfl_xor_sync(FULL_MASK, am, o, L);
        am = other > am ? other : am;
        if (mean) tree = __fadd_rn(tree, __shfl_xor_sync(FULL_MASK, tree, o, L));
    }
    if (!active) return;
    const bool finite = am < 0x7F800000u;
    const float raw = mean ? __fdiv_rn(tree, (float)bs) : __fdiv_rn(__uint_as_float(am), (float)qmax_of(bits));
    const u32 sb = stored_scale(raw, am, finite);
    if (lane == 0) *scale_out = (u16)sb;
    const bool live = finite && sb != 0u;
    const float s = __uint_as_float(sb << 16);
    const u32 zero = bits == 1 ? 0u : (u32)qmax_of(bits);
    const int G = codes_per_group(bits), GB = bytes_per_group(bits);
    u8* o = out + (long long)lane * m / G * GB;
    for (int t = 0; t < m; t += G) {
        u32 w = 0u;
        for (int j = 0; j < G; ++j) {
            const long long e = e0 + t + j;
            const float x = e < n ? src[e] : 0.0f;
            const u32 u = live ? encode(x, s, bits, sr, off + (u64)e, k1, k2) : zero;
            w |= u << (j * bits);
        }
        for (int k = 0; k < GB; ++k) o[t / G * GB + k] = (u8)(w >> (8 * k));
    }
}

extern "C" __global__ void bq_quantize(const float* __restrict__ x, long long n, int bits, int bs, int L, int sr,
                                       u32 k1, u32 k2, u64 off, u8* __restrict__ payload,
                                       u16* __restrict__ scales, long long nblocks) {
    const int lane = threadIdx.x % L;
    const long long k = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / L;
    const bool active = k < nblocks;
    const long long kk = active ? k : 0;
    quantize_block(x, n, kk * bs, lane, L, bs, bits, sr, k1, k2, off, payload + kk * bs * bits / 8,
                   scales + kk, active);
}

// One thread per byte group: out = [out +] sum_p v_p, left to right in p.
extern "C" __global__ void bq_dequant_acc(const u8* __restrict__ payloads, long long pstride,
                                          const u16* __restrict__ scales, long long sstride, int P, long long n,
                                          int bits, int bs, float* __restrict__ out, int accumulate) {
    const int G = codes_per_group(bits), GB = bytes_per_group(bits);
    const long long gi = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long e0 = gi * G;
    if (e0 >= n) return;
    const long long k = e0 / bs;
    const u32 mask = (1u << bits) - 1u;
    float acc[8];
    for (int j = 0; j < G; ++j) acc[j] = (accumulate && e0 + j < n) ? out[e0 + j] : 0.0f;
    for (int p = 0; p < P; ++p) {
        const u8* in = payloads + p * pstride + gi * GB;
        u32 w = 0u;
        for (int b = 0; b < GB; ++b) w |= (u32)in[b] << (8 * b);
        const float s = __uint_as_float((u32)scales[p * sstride + k] << 16);
        for (int j = 0; j < G; ++j) {
            const float v = __fmul_rn(level((int)((w >> (j * bits)) & mask), bits), s);
            acc[j] = (p == 0 && !accumulate) ? v : __fadd_rn(acc[j], v);
        }
    }
    for (int j = 0; j < G; ++j)
        if (e0 + j < n) out[e0 + j] = acc[j];
}

// Fused reduce step: acc = sum_p v_p (left to right) * alpha -> sum_out, then quantize_block(sum_out).
// The lane that writes an element of sum_out is the lane that reads it back, so no barrier is needed.
extern "C" __global__ void bq_dsr(const u8* __restrict__ payloads, long long pstride, const u16* __restrict__ scales,
                                  long long sstride, int P, long long n, int bits, int bs, int out_bits, int L,
                                  float alpha, int sr, u32 k1, u32 k2, u64 off, u8* __restrict__ payload,
                                  u16* __restrict__ out_scales, float* __restrict__ sum_out, long long nblocks) {
    const int lane = threadIdx.x % L;
    const long long k = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / L;
    const bool active = k < nblocks;
    const long long kk = active ? k : 0;
    const int m = bs / L;
    const int G = codes_per_group(bits), GB = bytes_per_group(bits);
    const u32 mask = (1u << bits) - 1u;
    if (active) {
        const long long e0 = kk * bs + (long long)lane * m;
        for (int t = 0; t < m; t += G) {
            const long long gi = (e0 + t) / G;
            float acc[8];
            for (int p = 0; p < P; ++p) {
                const u8* in = payloads + p * pstride + gi * GB;
                u32 w = 0u;
                for (int b = 0; b < GB; ++b) w |= (u32)in[b] << (8 * b);
                const float s = __uint_as_float((u32)scales[p * sstride + kk] << 16);
                for (int j = 0; j < G; ++j) {
                    const float v = __fmul_rn(level((int)((w >> (j * bits)) & mask), bits), s);
                    acc[j] = p == 0 ? v : __fadd_rn(acc[j], v);
                }
            }
            for (int j = 0; j < G; ++j) {
                const long long e = e0 + t + j;
                if (e < n) sum_out[e] = alpha != 1.0f ? __fmul_rn(acc[j], alpha) : acc[j];
            }
        }
    }
    quantize_block(sum_out, n, kk * bs, lane, L, bs, out_bits, sr, k1, k2, off,
                   payload + kk * bs * out_bits / 8, out_scales + kk, active);
}
