// Fused CPU loops of the low-bit format (see bitscom/quantization.py for the format).
//
// Built on first use by bitscom/kernels/cpu_native.py with the system C++ compiler
// (-O3 -march=native -ffp-contract=off -fno-trapping-math) and loaded with ctypes. It must reproduce the bytes of
// the eager torch reference (torch_ref.py) exactly, so every float step mirrors it: IEEE division
// x / s, rintf (round half even) or floorf, the contiguous-halves tree for 1-bit sums, left-to-
// right peer sums, no FMA contraction. Each block is read once from memory and then worked on in
// L1, which is what makes it ~50x faster than a chain of eager torch ops.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
    return h;
}

inline uint32_t fbits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bitsf(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

template <int B> struct Fmt {
    static constexpr int G = B <= 8 ? 8 / B : (B == 12 ? 2 : 1);   // codes per byte group
    static constexpr int GB = B <= 8 ? 1 : (B == 12 ? 3 : 2);      // bytes per byte group
    static constexpr int QM = B == 1 ? 1 : (1 << (B - 1)) - 1;
    using code_t = typename std::conditional<(B > 8), uint16_t, uint8_t>::type;
};

// fp32 scale -> bf16 bits, rounded up; see torch_ref._stored_scales.
inline uint32_t stored_scale(float raw, uint32_t amax_bits, bool finite) {
    if (!finite) return 0x7FC0u;
    uint32_t r = (fbits(raw) + 0xFFFFu) >> 16;
    if (r == 0 && amax_bits > 0) r = 1;
    if (r >= 0x7F80u) r = 0x7F7Fu;
    return r;
}

// Quantize one block of bs floats (already zero-padded), write bs*B/8 bytes and one scale.
template <int B, bool SR>
void quant_block(const float* __restrict xb, int bs, uint64_t gidx, uint32_t k1, uint32_t k2, uint8_t* out,
                 uint16_t* scale, typename Fmt<B>::code_t* __restrict codes, float* __restrict tmp) {
    using F = Fmt<B>;
    uint32_t am = 0;
    for (int i = 0; i < bs; ++i) { uint32_t u = fbits(xb[i]) & 0x7FFFFFFFu; am = u > am ? u : am; }
    const bool finite = am < 0x7F800000u;
    float raw;
    if (B == 1 && !SR) {
        for (int i = 0; i < bs; ++i) tmp[i] = std::fabs(xb[i]);
        for (int n = bs; n > 1; n >>= 1)
            for (int i = 0; i < n / 2; ++i) tmp[i] = tmp[2 * i] + tmp[2 * i + 1];
        raw = tmp[0] / (float)bs;
    } else {
        raw = bitsf(am) / (float)F::QM;
    }
    const uint32_t sb = stored_scale(raw, am, finite);
    *scale = (uint16_t)sb;
    const int zero = B == 1 ? 0 : F::QM;
    if (!finite || sb == 0) {
        for (int i = 0; i < bs; ++i) codes[i] = (typename F::code_t)zero;
    } else {
        const float s = bitsf(sb << 16);
        const float qm = (float)F::QM;
        if (SR) {  // random numbers first, in their own (vectorizable) loop, into tmp
            const uint32_t lo0 = (uint32_t)gidx, hi0 = (uint32_t)(gidx >> 32);
            if ((uint64_t)lo0 + (uint64_t)bs <= 0x100000000ull) {
                const uint32_t kh = hi0 ^ k2;
                for (int i = 0; i < bs; ++i) tmp[i] = (float)(fmix32(fmix32((lo0 + (uint32_t)i) ^ k1) ^ kh) >> 8);
            } else {  // block straddles a 2**32 index boundary
                for (int i = 0; i < bs; ++i) {
                    const uint64_t idx = gidx + (uint64_t)i;
                    tmp[i] = (float)(fmix32(fmix32((uint32_t)idx ^ k1) ^ (uint32_t)(idx >> 32) ^ k2) >> 8);
                }
            }
        }
        for (int i = 0; i < bs; ++i) {
            const float x = xb[i];
            int u;
            if (B == 1 && !SR) {
                u = x < 0.0f;
            } else {
                const float y = x / s;
                const float r = SR ? tmp[i] : 0.0f;
                if (B == 1) {
                    const float t = (1.0f - y) * 0.5f;
                    u = r < t * 16777216.0f;
                } else {
                    float q;
                    if (SR) {
                        const float fl = std::floor(y);
                        q = fl + (r < (y - fl) * 16777216.0f ? 1.0f : 0.0f);
                    } else {
                        q = std::rint(y);
                    }
                    q = q < -qm ? -qm : (q > qm ? qm : q);
                    u = (int)q + F::QM;
                }
            }
            codes[i] = (typename F::code_t)u;
        }
    }
    const int ngroups = bs / F::G;
    for (int g = 0; g < ngroups; ++g) {
        uint32_t w = 0;
        for (int t = 0; t < F::G; ++t) w |= (uint32_t)codes[g * F::G + t] << (t * B);
        for (int k = 0; k < F::GB; ++k) out[g * F::GB + k] = (uint8_t)(w >> (8 * k));
    }
}

// Decode one block: out[i] = v_i (ADD=false) or out[i] + v_i (ADD=true), v_i = level_i * s.
template <int B, bool ADD>
inline void dequant_block(const uint8_t* __restrict in, uint16_t scale_bits, int bs, float* __restrict out) {
    using F = Fmt<B>;
    const float s = bitsf((uint32_t)scale_bits << 16);
    constexpr uint32_t mask = (1u << B) - 1u;
    if (B <= 8) {
        for (int j = 0; j < bs / F::G; ++j) {
            const uint32_t w = in[j];
            for (int t = 0; t < F::G; ++t) {
                const int c = (int)((w >> (t * B)) & mask);
                const float v = (B == 1 ? (float)(1 - 2 * c) : (float)(c - F::QM)) * s;
                out[j * F::G + t] = ADD ? out[j * F::G + t] + v : v;
            }
        }
    } else {
        for (int g = 0; g < bs / F::G; ++g) {
            uint32_t w = 0;
            for (int k = 0; k < F::GB; ++k) w |= (uint32_t)in[g * F::GB + k] << (8 * k);
            for (int t = 0; t < F::G; ++t) {
                const float v = (float)((int)((w >> (t * B)) & mask) - F::QM) * s;
                out[g * F::G + t] = ADD ? out[g * F::G + t] + v : v;
            }
        }
    }
}

template <int B, bool SR>
void quantize_t(const float* x, int64_t n, int bs, uint32_t k1, uint32_t k2, uint64_t off,
                uint8_t* payload, uint16_t* scales) {
    const int64_t nb = (n + bs - 1) / bs;
    const int64_t bbytes = (int64_t)bs * B / 8;
    std::vector<float> pad(bs), tmp(bs);
    std::vector<typename Fmt<B>::code_t> codes(bs);
    for (int64_t k = 0; k < nb; ++k) {
        const float* xb = x + k * bs;
        const int64_t valid = n - k * bs;
        if (valid < bs) {
            std::memset(pad.data(), 0, sizeof(float) * bs);
            std::memcpy(pad.data(), xb, sizeof(float) * valid);
            xb = pad.data();
        }
        quant_block<B, SR>(xb, bs, off + (uint64_t)(k * bs), k1, k2, payload + k * bbytes, scales + k,
                           codes.data(), tmp.data());
    }
}

// acc[0:valid] = [acc +] sum_p v_p over block k, added left to right in p. v: bs floats scratch.
template <int B>
void accumulate_block(const uint8_t* payloads, int64_t pstride, const uint16_t* scales, int64_t sstride,
                      int P, int64_t k, int bs, int64_t valid, float* __restrict acc, bool accumulate,
                      float* __restrict v) {
    const int64_t bbytes = (int64_t)bs * B / 8;
    const bool full = valid == bs;
    for (int p = 0; p < P; ++p) {
        const uint8_t* in = payloads + p * pstride + k * bbytes;
        const uint16_t sb = scales[p * sstride + k];
        if (full) {
            if (p == 0 && !accumulate) dequant_block<B, false>(in, sb, bs, acc);
            else dequant_block<B, true>(in, sb, bs, acc);
        } else {
            dequant_block<B, false>(in, sb, bs, v);
            if (p == 0 && !accumulate) for (int64_t i = 0; i < valid; ++i) acc[i] = v[i];
            else for (int64_t i = 0; i < valid; ++i) acc[i] = acc[i] + v[i];
        }
    }
}

template <int B>
void dequant_acc_t(const uint8_t* payloads, int64_t pstride, const uint16_t* scales, int64_t sstride,
                   int P, int64_t n, int bs, float* out, bool accumulate) {
    const int64_t nb = (n + bs - 1) / bs;
    std::vector<float> v(bs);
    for (int64_t k = 0; k < nb; ++k) {
        const int64_t valid = n - k * bs < bs ? n - k * bs : bs;
        accumulate_block<B>(payloads, pstride, scales, sstride, P, k, bs, valid, out + k * bs, accumulate,
                            v.data());
    }
}

template <int B, int OB, bool SR>
void dsr_t(const uint8_t* payloads, int64_t pstride, const uint16_t* scales, int64_t sstride, int P,
           int64_t n, int bs, float alpha, uint32_t k1, uint32_t k2, uint64_t off, uint8_t* payload,
           uint16_t* out_scales, float* sum_out) {
    const int64_t nb = (n + bs - 1) / bs;
    const int64_t obytes = (int64_t)bs * OB / 8;
    std::vector<float> acc(bs), v(bs), tmp(bs);
    std::vector<typename Fmt<OB>::code_t> codes(bs);
    for (int64_t k = 0; k < nb; ++k) {
        const int64_t valid = n - k * bs < bs ? n - k * bs : bs;
        std::memset(acc.data(), 0, sizeof(float) * bs);
        accumulate_block<B>(payloads, pstride, scales, sstride, P, k, bs, valid, acc.data(), false, v.data());
        if (alpha != 1.0f)
            for (int64_t i = 0; i < valid; ++i) acc[i] = acc[i] * alpha;
        if (sum_out) std::memcpy(sum_out + k * bs, acc.data(), sizeof(float) * valid);
        quant_block<OB, SR>(acc.data(), bs, off + (uint64_t)(k * bs), k1, k2, payload + k * obytes,
                            out_scales + k, codes.data(), tmp.data());
    }
}

#define BQ_SWITCH(bits, MACRO) \
    switch (bits) { case 1: MACRO(1); case 2: MACRO(2); case 4: MACRO(4); case 8: MACRO(8); \
                    case 12: MACRO(12); case 16: MACRO(16); default: return -1; }

template <int B>
int dsr_ob(int out_bits, bool sr, const uint8_t* pl, int64_t ps, const uint16_t* sc, int64_t ss, int P,
           int64_t n, int bs, float alpha, uint32_t k1, uint32_t k2, uint64_t off, uint8_t* payload,
           uint16_t* out_scales, float* sum_out) {
#define BQ_DSR(OB) \
    if (sr) dsr_t<B, OB, true>(pl, ps, sc, ss, P, n, bs, alpha, k1, k2, off, payload, out_scales, sum_out); \
    else dsr_t<B, OB, false>(pl, ps, sc, ss, P, n, bs, alpha, k1, k2, off, payload, out_scales, sum_out); \
    return 0;
    BQ_SWITCH(out_bits, BQ_DSR)
#undef BQ_DSR
}

}  // namespace

extern "C" {

int bq_quantize(const float* x, int64_t n, int bits, int bs, int sr, uint32_t k1, uint32_t k2,
                uint64_t off, uint8_t* payload, uint16_t* scales) {
#define BQ_Q(B) \
    if (sr) quantize_t<B, true>(x, n, bs, k1, k2, off, payload, scales); \
    else quantize_t<B, false>(x, n, bs, k1, k2, off, payload, scales); \
    return 0;
    BQ_SWITCH(bits, BQ_Q)
#undef BQ_Q
}

int bq_dequant_acc(const uint8_t* payloads, int64_t pstride, const uint16_t* scales, int64_t sstride,
                   int P, int64_t n, int bits, int bs, float* out, int accumulate) {
#define BQ_D(B) dequant_acc_t<B>(payloads, pstride, scales, sstride, P, n, bs, out, accumulate != 0); return 0;
    BQ_SWITCH(bits, BQ_D)
#undef BQ_D
}

int bq_dsr(const uint8_t* payloads, int64_t pstride, const uint16_t* scales, int64_t sstride, int P,
           int64_t n, int bits, int bs, int out_bits, float alpha, int sr, uint32_t k1, uint32_t k2,
           uint64_t off, uint8_t* payload, uint16_t* out_scales, float* sum_out) {
#define BQ_S(B) \
    return dsr_ob<B>(out_bits, sr != 0, payloads, pstride, scales, sstride, P, n, bs, alpha, k1, k2, off, \
                     payload, out_scales, sum_out);
    BQ_SWITCH(bits, BQ_S)
#undef BQ_S
}

// Scaled-sign codec of SignSGD (bitscom/compressors/signsgd.py), one pass over x: per segment
// (counts[k] elements) the left-to-right fp32 sum of |x| (the order of torch's index_add_), the
// scale sum / count, the sign bits (bit i % 8 of byte i / 8 set for x < 0, bits pre-zeroed by
// the caller) and, when residual is given (it is x itself), residual -= (+-1) * scale.
int bq_sign_encode(float* x, int64_t n, const int64_t* counts, int64_t nseg, uint8_t* bits,
                   uint8_t* scales, int update) {
    int64_t i = 0;
    for (int64_t k = 0; k < nseg; ++k) {
        const int64_t c = counts[k];
        if (c < 0 || i + c > n) return 2;
        float sum = 0.0f;
        for (int64_t j = i; j < i + c; ++j) sum += std::fabs(x[j]);
        const float s = sum / static_cast<float>(c < 1 ? 1 : c);
        std::memcpy(scales + 4 * k, &s, 4);
        if (update) {
            for (int64_t j = i; j < i + c; ++j) {
                const uint32_t neg = x[j] < 0.0f;
                bits[j >> 3] |= static_cast<uint8_t>(neg << (j & 7));
                x[j] = x[j] - (1.0f - 2.0f * static_cast<float>(neg)) * s;
            }
        } else {
            for (int64_t j = i; j < i + c; ++j)
                bits[j >> 3] |= static_cast<uint8_t>(static_cast<uint32_t>(x[j] < 0.0f) << (j & 7));
        }
        i += c;
    }
    return i == n ? 0 : 2;
}

// out = sum over the P gathered records (rank order) of (+-1) * scale, each record the sign bits
// (nbytes) followed by nseg fp32 scales (unaligned); returns 1 when a scale is not finite.
int bq_sign_decode_sum(const uint8_t* rows, int64_t stride, int P, int64_t n, int64_t nbytes,
                       const int64_t* counts, int64_t nseg, float* out) {
    int nonfinite = 0;
    for (int r = 0; r < P; ++r) {
        const uint8_t* bits = rows + r * stride;
        const uint8_t* sc = bits + nbytes;
        int64_t i = 0;
        for (int64_t k = 0; k < nseg; ++k) {
            float s;
            std::memcpy(&s, sc + 4 * k, 4);
            if (!std::isfinite(s)) nonfinite = 1;
            const float neg = -1.0f * s, pos = 1.0f * s;
            const int64_t e = i + counts[k];
            if (e > n) return 2;
            const float pm[2] = {pos, neg};
            if (r == 0) {
                for (int64_t j = i; j < e; ++j) out[j] = 0.0f + pm[(bits[j >> 3] >> (j & 7)) & 1u];
            } else {
                for (int64_t j = i; j < e; ++j) out[j] = out[j] + pm[(bits[j >> 3] >> (j & 7)) & 1u];
            }
            i = e;
        }
    }
    return nonfinite;
}

}  // extern "C"
