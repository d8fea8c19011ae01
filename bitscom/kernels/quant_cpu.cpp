// Fused CPU loops of the low-bit format (see bitscom/quantization.py for the format).
//
// Built on first use by bitscom/kernels/cpu_native.py with the system C++ compiler
// (-O3 -march=native -ffp-contract=off -fno-trapping-math) and loaded with ctypes. It must reproduce the bytes of
// the eager torch reference (torch_ref.py) exactly, so every float step mirrors it: IEEE division
// x / s, rintf (round half even) or floorf, the contiguous-halves tree for 1-bit sums, left-to-
// right peer sums, no FMA contraction. Each block is read once from memory and then worked on in
// L1, which is what makes it ~50x faster than a chain of eager torch ops.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

#if defined(__AVX2__)
// Round-to-nearest quantization of one block at 2, 4 or 8 bits, 32 elements per iteration:
// the same IEEE steps as the scalar loop below (max |x| bits, x / s by vdivps, rint by
// vroundps to nearest-even, clamp, + qmax), packed with maddubs (pairs) / madd (quads).
// Returns false, having written nothing, for the blocks the scalar loop handles (NaN/Inf or
// all-zero blocks), so their bytes come from that one implementation.
template <int B>
inline bool quant_block_rtn_avx2(const float* __restrict xb, int bs, uint8_t* out, uint16_t* scale) {
    using F = Fmt<B>;
    const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i vam = _mm256_setzero_si256();
    for (int i = 0; i < bs; i += 8)
        vam = _mm256_max_epu32(vam, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(xb + i)), absmask));
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(vam), _mm256_extracti128_si256(vam, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    const uint32_t am = (uint32_t)_mm_cvtsi128_si32(m);
    if (am >= 0x7F800000u) return false;
    const float raw = bitsf(am) / (float)F::QM;
    const uint32_t sb = stored_scale(raw, am, true);
    if (sb == 0) return false;
    *scale = (uint16_t)sb;
    const __m256 vs = _mm256_set1_ps(bitsf(sb << 16));
    const __m256 vqm = _mm256_set1_ps((float)F::QM), vnqm = _mm256_set1_ps(-(float)F::QM);
    const __m256i vQM = _mm256_set1_epi32(F::QM);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < bs; i += 32) {
        __m256i c[4];
        for (int k = 0; k < 4; ++k) {
            const __m256 y = _mm256_div_ps(_mm256_loadu_ps(xb + i + 8 * k), vs);
            __m256 q = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm256_min_ps(_mm256_max_ps(q, vnqm), vqm);
            c[k] = _mm256_add_epi32(_mm256_cvtps_epi32(q), vQM);
        }
        // 32 codes as bytes in element order (pack works per 128-bit lane; the permute undoes it).
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packus_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])), order);
        if (B == 8) {
            _mm256_storeu_si256((__m256i*)(out + i), bytes);
        } else if (B == 4) {   // byte = u0 | u1 << 4
            const __m256i w = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
            const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08);
            _mm_storeu_si128((__m128i*)(out + i / 2), _mm256_castsi256_si128(p));
        } else {               // B == 2: byte = u0 | u1 << 2 | u2 << 4 | u3 << 6
            const __m256i w = _mm256_madd_epi16(_mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x0401)),
                                                _mm256_set1_epi32(0x00100001));
            const __m256i p = _mm256_shuffle_epi8(w, _mm256_setr_epi8(
                0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
            const uint32_t lo = (uint32_t)_mm256_extract_epi32(p, 0), hi = (uint32_t)_mm256_extract_epi32(p, 4);
            std::memcpy(out + i / 4, &lo, 4);
            std::memcpy(out + i / 4 + 4, &hi, 4);
        }
    }
    return true;
}
#endif

// Quantize one block of bs floats (already zero-padded), write bs*B/8 bytes and one scale.
template <int B, bool SR>
void quant_block(const float* __restrict xb, int bs, uint64_t gidx, uint32_t k1, uint32_t k2, uint8_t* out,
                 uint16_t* scale, typename Fmt<B>::code_t* __restrict codes, float* __restrict tmp) {
    using F = Fmt<B>;
#if defined(__AVX2__)
    if (!SR && (B == 2 || B == 4 || B == 8) && bs % 32 == 0 && quant_block_rtn_avx2<B>(xb, bs, out, scale))
        return;
#endif
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
// STREAM (with ADD=false, out 32-byte aligned): non-temporal stores, for a final decode into a
// bucket that is not read again soon: a normal store first reads the line it writes (the memory
// traffic of a copy), a streaming one does not. Same values; the caller fences.
template <int B, bool ADD, bool STREAM = false>
inline void dequant_block(const uint8_t* __restrict in, uint16_t scale_bits, int bs, float* __restrict out) {
    using F = Fmt<B>;
    const float s = bitsf((uint32_t)scale_bits << 16);
    constexpr uint32_t mask = (1u << B) - 1u;
#if defined(__AVX2__)
    if (B == 8 && bs % 32 == 0) {   // 8 codes per vector: the same (float)level * s (+ out) as below
        const __m256 vs = _mm256_set1_ps(s);
        for (int j = 0; j < bs; j += 8) {
            const __m256i c = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(in + j))),
                                               _mm256_set1_epi32(F::QM));
            const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(c), vs);
            if (STREAM) _mm256_stream_ps(out + j, v);
            else _mm256_storeu_ps(out + j, ADD ? _mm256_add_ps(_mm256_loadu_ps(out + j), v) : v);
        }
        return;
    }
    if (B < 8 && bs % 32 == 0) {
        constexpr int per = 32 / B;  // codes in one 32-bit word
        const __m256 vs = _mm256_set1_ps(s);
        const __m256i vm = _mm256_set1_epi32((int)mask);
        for (int j = 0; j < bs; j += per) {
            uint32_t w;
            std::memcpy(&w, in + j * B / 8, 4);
            for (int h = 0; h < per; h += 8) {
                const __m256i sh = _mm256_setr_epi32((h + 0) * B, (h + 1) * B, (h + 2) * B, (h + 3) * B,
                                                     (h + 4) * B, (h + 5) * B, (h + 6) * B, (h + 7) * B);
                __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh), vm);
                c = B == 1 ? _mm256_sub_epi32(_mm256_set1_epi32(1), _mm256_add_epi32(c, c))
                           : _mm256_sub_epi32(c, _mm256_set1_epi32(F::QM));
                const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(c), vs);
                float* o = out + j + h;
                if (STREAM) _mm256_stream_ps(o, v);
                else _mm256_storeu_ps(o, ADD ? _mm256_add_ps(_mm256_loadu_ps(o), v) : v);
            }
        }
        return;
    }
#endif
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

// Error feedback fused into the quantizer, one pass per block: x = e + g (compensate), quantize x,
// then e = x - D(C(x)) with NaN/Inf set to 0 (update and drop_nonfinite): the same fp32 steps,
// in the same order, as residual.add_(g), quantize_pack, unpack_dequantize, residual.sub_(sent)
// and nan_to_num_, without the decoded buffer or the four extra passes over the bucket.
template <int B, bool SR>
void quantize_ef_t(const float* g, float* e, int64_t n, int bs, uint32_t k1, uint32_t k2, uint64_t off,
                   uint8_t* payload, uint16_t* scales) {
    const int64_t nb = (n + bs - 1) / bs;
    const int64_t bbytes = (int64_t)bs * B / 8;
    std::vector<float> xb(bs), v(bs), tmp(bs);
    std::vector<typename Fmt<B>::code_t> codes(bs);
    for (int64_t k = 0; k < nb; ++k) {
        float* eb = e + k * bs;
        const float* gb = g + k * bs;
        const int64_t valid = n - k * bs < bs ? n - k * bs : bs;
        for (int64_t i = 0; i < valid; ++i) xb[i] = eb[i] + gb[i];
        for (int64_t i = valid; i < bs; ++i) xb[i] = 0.0f;
        uint8_t* out = payload + k * bbytes;
        quant_block<B, SR>(xb.data(), bs, off + (uint64_t)(k * bs), k1, k2, out, scales + k, codes.data(),
                           tmp.data());
        dequant_block<B, false>(out, scales[k], bs, v.data());
        for (int64_t i = 0; i < valid; ++i) {
            const float d = xb[i] - v[i];
            eb[i] = std::isfinite(d) ? d : 0.0f;
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
#if defined(__AVX2__)
            if (P == 1 && !accumulate && bs % 32 == 0 && B <= 8 && (reinterpret_cast<uintptr_t>(acc) & 31) == 0) {
                dequant_block<B, false, true>(in, sb, bs, acc);   // a single row's final decode
                continue;
            }
#endif
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
#if defined(__AVX2__)
    _mm_sfence();   // order the streaming stores before the caller reads ``out``
#endif
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
        if (valid < bs) std::memset(acc.data(), 0, sizeof(float) * bs);   // full: p = 0 writes it all
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

int bq_quantize_ef(const float* g, float* e, int64_t n, int bits, int bs, int sr, uint32_t k1, uint32_t k2,
                   uint64_t off, uint8_t* payload, uint16_t* scales) {
#define BQ_QE(B) \
    if (sr) quantize_ef_t<B, true>(g, e, n, bs, k1, k2, off, payload, scales); \
    else quantize_ef_t<B, false>(g, e, n, bs, k1, k2, off, payload, scales); \
    return 0;
    BQ_SWITCH(bits, BQ_QE)
#undef BQ_QE
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

}  // extern "C"

// Scaled-sign codec of SignSGD (bitscom/compressors/signsgd.py), one pass over x: when g is
// given, first x += g (error feedback's compensate: x is the residual, g the gradient); then per
// segment (counts[k] elements) the left-to-right fp32 sum of |x| (the order of torch's
// index_add_), the scale sum / count, the sign bits (bit i % 8 of byte i / 8 set for x < 0,
// bits pre-zeroed by the caller) and, when update is set (x is the residual),
// x -= (1 - 2 * neg) * scale. Eight consecutive 16-element segments (the default block) run
// interleaved: eight independent sum chains instead of one, each still added in its own
// left-to-right order, so the bits do not change.
namespace {

inline void sign_segment(float* x, const float* g, int64_t i, int64_t c, uint8_t* bits, uint8_t* scales,
                         int64_t k, int update) {
    if (g) for (int64_t j = i; j < i + c; ++j) x[j] = x[j] + g[j];
    float sum = 0.0f;
    for (int64_t j = i; j < i + c; ++j) sum += std::fabs(x[j]);
    const float s = sum / static_cast<float>(c < 1 ? 1 : c);
    std::memcpy(scales + 4 * k, &s, 4);
    for (int64_t j = i; j < i + c; ++j) {
        const uint32_t neg = x[j] < 0.0f;
        bits[j >> 3] |= static_cast<uint8_t>(neg << (j & 7));
        if (update) x[j] = x[j] - (1.0f - 2.0f * static_cast<float>(neg)) * s;
    }
}

// Eight segments of 16 elements at x[i..i+128).
inline void sign_group8x16(float* x, const float* g, int64_t i, uint8_t* bits, uint8_t* scales, int64_t k,
                           int update) {
    float* xb = x + i;
    if (g) {
        const float* gb = g + i;
        for (int t = 0; t < 128; ++t) xb[t] = xb[t] + gb[t];
    }
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = 0; j < 16; ++j)
        for (int q = 0; q < 8; ++q) acc[q] += std::fabs(xb[q * 16 + j]);
    for (int q = 0; q < 8; ++q) {
        const float s = acc[q] / 16.0f;
        std::memcpy(scales + 4 * (k + q), &s, 4);
        float* xs = xb + q * 16;
        uint32_t m = 0;
        for (int t = 0; t < 16; ++t) m |= static_cast<uint32_t>(xs[t] < 0.0f) << t;
        if (update)
            for (int t = 0; t < 16; ++t) {
                const float neg = static_cast<float>((m >> t) & 1u);
                xs[t] = xs[t] - (1.0f - 2.0f * neg) * s;
            }
        const int64_t b = i + q * 16;          // 16 bits at stream position b
        const uint32_t w = m << (b & 7);
        uint8_t* o = bits + (b >> 3);
        o[0] |= static_cast<uint8_t>(w);
        o[1] |= static_cast<uint8_t>(w >> 8);
        if (b & 7) o[2] |= static_cast<uint8_t>(w >> 16);
    }
}

}  // namespace

extern "C" {

int bq_sign_encode(float* x, const float* g, int64_t n, const int64_t* counts, int64_t nseg, uint8_t* bits,
                   uint8_t* scales, int update) {
    int64_t i = 0, k = 0;
    while (k < nseg) {
        if (k + 8 <= nseg && i + 128 <= n) {
            bool all16 = true;
            for (int q = 0; q < 8; ++q) all16 = all16 && counts[k + q] == 16;
            if (all16) {
                sign_group8x16(x, g, i, bits, scales, k, update);
                i += 128;
                k += 8;
                continue;
            }
        }
        const int64_t c = counts[k];
        if (c < 0 || i + c > n) return 2;
        sign_segment(x, g, i, c, bits, scales, k, update);
        i += c;
        ++k;
    }
    return i == n ? 0 : 2;
}

}  // extern "C"

namespace {

// One segment [i, e) of one record: out = op(out, v), v = neg where the sign bit is set, else pos;
// FIRST: 0 + v instead of out + v; LAST: the result divided by div. Whole bytes 8 lanes at a time.
template <bool FIRST, bool LAST>
inline void sign_decode_run(const uint8_t* bits, int64_t i, int64_t e, float pos, float neg, float div,
                            float* out) {
    auto one = [&](int64_t j) {
        const float v = (bits[j >> 3] >> (j & 7)) & 1u ? neg : pos;
        const float a = FIRST ? 0.0f + v : out[j] + v;
        out[j] = LAST ? a / div : a;
    };
    int64_t j = i;
    for (; j < e && (j & 7); ++j) one(j);
#if defined(__AVX2__)
    const __m256i sh = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 vp = _mm256_set1_ps(pos), vn = _mm256_set1_ps(neg), vd = _mm256_set1_ps(div);
    for (; j + 8 <= e; j += 8) {
        const __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits[j >> 3]), sh);
        const __m256 v = _mm256_blendv_ps(vp, vn, _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sh)));
        __m256 a = _mm256_add_ps(FIRST ? _mm256_setzero_ps() : _mm256_loadu_ps(out + j), v);
        if (LAST) a = _mm256_div_ps(a, vd);
        _mm256_storeu_ps(out + j, a);
    }
#endif
    for (; j < e; ++j) one(j);
}

}  // namespace

extern "C" {

// out = sum over the P gathered records (rank order) of (+-1) * scale, each record the sign bits
// (nbytes) followed by nseg fp32 scales (unaligned), then out /= div when div > 0 (fused into
// the last record's pass: the same fp32 steps as a separate division); returns 1 when a scale
// is not finite.
int bq_sign_decode_sum(const uint8_t* rows, int64_t stride, int P, int64_t n, int64_t nbytes,
                       const int64_t* counts, int64_t nseg, float* out, float div) {
    int nonfinite = 0;
    for (int r = 0; r < P; ++r) {
        const uint8_t* bits = rows + r * stride;
        const uint8_t* sc = bits + nbytes;
        const bool first = r == 0, last = r == P - 1 && div > 0.0f;
        int64_t i = 0;
        for (int64_t k = 0; k < nseg; ++k) {
            float s;
            std::memcpy(&s, sc + 4 * k, 4);
            if (!std::isfinite(s)) nonfinite = 1;
            // A real multiplication by -1 (the compiler would turn -1 * s into -s, which flips a NaN
            // scale's sign bit; torch's sign * scale keeps it).
            volatile float m1 = -1.0f;
            const float neg = m1 * s, pos = 1.0f * s;
            const int64_t e = i + counts[k];
            if (counts[k] < 0 || e > n) return 2;
            if (first && last) sign_decode_run<true, true>(bits, i, e, pos, neg, div, out);
            else if (first) sign_decode_run<true, false>(bits, i, e, pos, neg, div, out);
            else if (last) sign_decode_run<false, true>(bits, i, e, pos, neg, div, out);
            else sign_decode_run<false, false>(bits, i, e, pos, neg, div, out);
            i = e;
        }
    }
    return nonfinite;
}

}  // extern "C"

// Top-k's sparse updates (bitscom/compressors/topk.py): out[idx[j]] = out[idx[j]] + v[j]
// (sub = 0) or out[idx[j]] - v[j] (sub = 1), j in order; the indices must be unique, as top-k's
// are, so this is exactly torch's index_put_((idx,), out[idx] +- v). Returns 2 for an index
// outside [0, n), else (sub = 0) 1 when some v[j] is NaN or Inf (the caller's isfinite check,
// fused), 0 otherwise.
namespace {
template <typename I>
int scatter_t(float* out, int64_t n, const I* idx, const float* v, int64_t k, int sub) {
    for (int64_t j = 0; j < k; ++j)
        if (idx[j] < 0 || (int64_t)idx[j] >= n) return 2;
    bool finite = true;
    if (sub) for (int64_t j = 0; j < k; ++j) out[idx[j]] = out[idx[j]] - v[j];
    else for (int64_t j = 0; j < k; ++j) { out[idx[j]] = out[idx[j]] + v[j]; finite &= std::isfinite(v[j]); }
    return finite ? 0 : 1;
}
}  // namespace

extern "C" {

int bq_scatter(float* out, int64_t n, const void* idx, int idx64, const float* v, int64_t k, int sub) {
    return idx64 ? scatter_t(out, n, (const int64_t*)idx, v, k, sub) : scatter_t(out, n, (const int32_t*)idx, v, k, sub);
}

}  // extern "C"

// Top-k selection (bitscom/compressors/topk.py): the k entries of x with the largest |x|, as
// ascending indices (int64) and their values. Magnitudes are compared as the bits of |x| read as
// uint32, which orders NaN above Inf above every finite value, as torch.topk does; equal
// magnitudes go to the lower index (each key is (|x| bits, ~index, sign), unique), so the chosen set is
// a deterministic function of x. Strategy (DGC's sampled threshold, made exact): the
// ceil(1.25 k n_s / n)-th largest key of every stride-th entry is a threshold; every entry at or
// above it is a candidate (about 1.25 k of them, collected in index order in one pass); if at
// least k pass, the true top k are all among them (the k-th largest key is then >= the
// threshold), so the k-th largest candidate key T found by nth_element is the k-th largest overall
// and the candidates >= T, in index order, are the answer. Fewer than k candidates: all n are.
// With sub (may be x itself: x is not read once the candidates are known), sub[i] -= x[i] for
// the chosen i (error feedback's update_sparse, fused; same bits as index_put_).
// idx and vals need room for k + 1 entries (the branch-free output writes one past the last).
// Returns 2 for k outside [1, n] or n >= 2^31.
namespace {
// (|x| bits) << 32 | (2^31 - 1 - i) << 1 | sign: unique (i < 2^31), ordered by magnitude then
// lower index; the value is rebuilt from the key without reading x again.
inline uint64_t topk_key(uint32_t bits, int64_t i) {
    return ((uint64_t)(bits & 0x7fffffffu) << 32) | ((uint64_t)(0x7fffffffu - (uint32_t)i) << 1) | (bits >> 31);
}
inline int64_t topk_index(uint64_t key) { return (int64_t)(0x7fffffffu - ((uint32_t)key >> 1)); }
inline float topk_value(uint64_t key) { return bitsf((uint32_t)(key >> 32) | ((uint32_t)key << 31)); }
}  // namespace

extern "C" {

int bq_topk(const float* x, int64_t n, int64_t k, int64_t* idx, float* vals, float* sub) {
    if (k < 1 || k > n || n >= ((int64_t)1 << 31)) return 2;
    std::vector<uint64_t> cand;
    const int64_t want = std::max<int64_t>(4096, (n + 99) / 100);
    const int64_t stride = std::max<int64_t>(1, n / want);
    if (stride > 1 && (double)k * 1.25 < (double)n) {
        std::vector<uint32_t> sample;
        sample.reserve(n / stride + 1);
        for (int64_t i = 0; i < n; i += stride) sample.push_back(fbits(x[i]) & 0x7fffffffu);
        const int64_t ns = (int64_t)sample.size();
        int64_t j = (int64_t)std::ceil((double)ns * 1.25 * (double)k / (double)n);
        j = std::min<int64_t>(ns, std::max<int64_t>(1, j));
        std::nth_element(sample.begin(), sample.begin() + (j - 1), sample.end(), std::greater<uint32_t>());
        const uint32_t threshold = sample[j - 1];
        // Branch-free collection (the test is true for ~1.25 k/n of the entries, unpredictably):
        // every key is written, the count advances only past candidates; room for one more
        // block is ensured before each block.
        const int64_t block = 4096;
        size_t count = 0;
        cand.resize((size_t)(k + k / 2 + block));
        for (int64_t b = 0; b < n; b += block) {
            if (cand.size() < count + (size_t)block) cand.resize(2 * cand.size() + (size_t)block);
            uint64_t* c = cand.data();
            const int64_t e = std::min(n, b + block);
            int64_t i = b;
#if defined(__AVX2__)
            // Eight at a time: most groups of eight hold no candidate and cost one compare.
            const __m256i lowbits = _mm256_set1_epi32(0x7fffffff);
            const __m256i t = _mm256_set1_epi32((int)threshold);
            for (; i + 8 <= e; i += 8) {
                const __m256i u = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + i)), lowbits);
                const __m256i ge = _mm256_cmpeq_epi32(_mm256_max_epu32(u, t), u);   // u >= t, unsigned
                const unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(ge));
                if (!mask) continue;
                for (int j = 0; j < 8; ++j) {          // branch-free within the group
                    c[count] = topk_key(fbits(x[i + j]), i + j);
                    count += (mask >> j) & 1u;
                }
            }
#endif
            for (; i < e; ++i) {
                const uint32_t u = fbits(x[i]);
                c[count] = topk_key(u, i);
                count += ((u & 0x7fffffffu) >= threshold);
            }
        }
        cand.resize(count);
    }
    if ((int64_t)cand.size() < k) {
        cand.resize(n);
        for (int64_t i = 0; i < n; ++i) cand[i] = topk_key(fbits(x[i]), i);
    }
    std::vector<uint64_t> work(cand);
    std::nth_element(work.begin(), work.begin() + (k - 1), work.end(), std::greater<uint64_t>());
    const uint64_t kth = work[k - 1];
    int64_t out = 0;                     // branch-free: idx/vals have room for k + 1 entries
    for (uint64_t key : cand) {
        const int64_t i = topk_index(key);
        const float v = topk_value(key);
        const bool chosen = key >= kth;
        idx[out] = i;
        vals[out] = v;
        if (sub) sub[i] = sub[i] - (chosen ? v : 0.0f);   // x - 0 is x, -0 and NaN included
        out += chosen;
        if (out > k) break;              // never: exactly k keys are >= the k-th largest
    }
    return out == k ? 0 : 3;
}

}  // extern "C"

// Low-rank factor products (bitscom/compressors/lowrank.py) for one row-major n x m matrix M
// (a slot of the bucket) and fp32 factors P (n x r) and Q (m x r), row-major, 1 <= r <= 64.
// The products P Q^T (the output every rank writes from the same reduced factors) are formed
// element by element as p_i0 q_k0 + p_i1 q_k1 + ... left to right, each multiply and each add
// rounded (no FMA), vectorized across k only: the same bits from the AVX2 and the scalar loop,
// so ranks agree whatever their CPUs. The projections M Q and M^T P are local (each rank's own,
// summed afterwards), so they use FMA and vector partial sums. Each row of M is read once
// while it is in cache, where the BLAS path made one pass per call (project, residual update).
namespace {
constexpr int LR_MAX_RANK = 64;

void lr_transpose(const float* q, int64_t m, int r, float* qt) {   // (m x r) -> (r x m)
    for (int64_t k = 0; k < m; ++k)
        for (int j = 0; j < r; ++j) qt[(int64_t)j * m + k] = q[k * r + j];
}

// row[k] = sum_j p[j] * qt[j][k] (sub = false) or row[k] -= that sum (sub = true). STREAM (row
// 32-byte aligned, not SUB): non-temporal stores, as in dequant_block; the caller fences.
template <bool SUB, bool STREAM = false>
inline void lr_row_product(float* __restrict row, int64_t m, const float* __restrict p, int r,
                           const float* __restrict qt) {
    int64_t k = 0;
#if defined(__AVX2__)
    for (; k + 8 <= m; k += 8) {
        __m256 acc = _mm256_mul_ps(_mm256_set1_ps(p[0]), _mm256_loadu_ps(qt + k));
        for (int j = 1; j < r; ++j)
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(qt + (int64_t)j * m + k)));
        if (STREAM) _mm256_stream_ps(row + k, acc);
        else _mm256_storeu_ps(row + k, SUB ? _mm256_sub_ps(_mm256_loadu_ps(row + k), acc) : acc);
    }
#endif
    for (; k < m; ++k) {
        float acc = p[0] * qt[k];
        for (int j = 1; j < r; ++j) acc = acc + p[j] * qt[(int64_t)j * m + k];
        row[k] = SUB ? row[k] - acc : acc;
    }
}

// out[j] = sum_k row[k] * qt[j][k] for j < r (a row of M Q).
inline void lr_row_dots(const float* __restrict row, int64_t m, const float* __restrict qt, int r,
                        float* __restrict out) {
    for (int j0 = 0; j0 < r; j0 += 8) {
        const int jn = r - j0 < 8 ? r - j0 : 8;
        int64_t k = 0;
        float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#if defined(__AVX2__)
        __m256 acc[8];
        for (int jj = 0; jj < 8; ++jj) acc[jj] = _mm256_setzero_ps();
        for (; k + 8 <= m; k += 8) {
            const __m256 xv = _mm256_loadu_ps(row + k);
            for (int jj = 0; jj < jn; ++jj) {
                const __m256 qv = _mm256_loadu_ps(qt + (int64_t)(j0 + jj) * m + k);
#if defined(__FMA__)
                acc[jj] = _mm256_fmadd_ps(xv, qv, acc[jj]);
#else
                acc[jj] = _mm256_add_ps(acc[jj], _mm256_mul_ps(xv, qv));
#endif
            }
        }
        for (int jj = 0; jj < jn; ++jj) {
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, acc[jj]);
            tail[jj] = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        }
#endif
        for (; k < m; ++k)
            for (int jj = 0; jj < jn; ++jj) tail[jj] += row[k] * qt[(int64_t)(j0 + jj) * m + k];
        for (int jj = 0; jj < jn; ++jj) out[j0 + jj] = tail[jj];
    }
}
}  // namespace

extern "C" {

// With grad (may be null), each row of M first becomes M + grad, stored (error feedback's
// compensate x = e + g, fused: the same bits as residual.add_(grad)).
inline void lr_add_row(float* __restrict row, const float* __restrict g, int64_t m) {
    for (int64_t k = 0; k < m; ++k) row[k] = row[k] + g[k];
}

// P = M Q; with sub, then M -= P Q^T (this P, before any reduction), row by row.
int bq_lr_project_p(float* M, int64_t n, int64_t m, const float* Q, int r, float* P, int sub,
                    const float* grad) {
    if (r < 1 || r > LR_MAX_RANK || n < 1 || m < 1) return 2;
    std::vector<float> qt((size_t)r * (size_t)m);
    lr_transpose(Q, m, r, qt.data());
    for (int64_t i = 0; i < n; ++i) {
        float* row = M + i * m;
        if (grad) lr_add_row(row, grad + i * m, m);
        lr_row_dots(row, m, qt.data(), r, P + i * r);
        if (sub) lr_row_product<true>(row, m, P + i * r, r, qt.data());
    }
    return 0;
}

// Q = M^T P (rows of M added in order into r accumulator rows); with sub, then M -= P Q^T.
// grad as for bq_lr_project_p.
int bq_lr_project_q(float* M, int64_t n, int64_t m, const float* P, int r, float* Q, int sub,
                    const float* grad) {
    if (r < 1 || r > LR_MAX_RANK || n < 1 || m < 1) return 2;
    std::vector<float> qt((size_t)r * (size_t)m, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
        float* row = M + i * m;
        if (grad) lr_add_row(row, grad + i * m, m);
        for (int j = 0; j < r; ++j) {
            const float pij = P[i * r + j];
            float* acc = qt.data() + (int64_t)j * m;
            int64_t k = 0;
#if defined(__AVX2__)
            const __m256 pv = _mm256_set1_ps(pij);
            for (; k + 8 <= m; k += 8) {
#if defined(__FMA__)
                _mm256_storeu_ps(acc + k, _mm256_fmadd_ps(pv, _mm256_loadu_ps(row + k), _mm256_loadu_ps(acc + k)));
#else
                _mm256_storeu_ps(acc + k, _mm256_add_ps(_mm256_loadu_ps(acc + k), _mm256_mul_ps(pv, _mm256_loadu_ps(row + k))));
#endif
            }
#endif
            for (; k < m; ++k) acc[k] += pij * row[k];
        }
    }
    for (int64_t k = 0; k < m; ++k)
        for (int j = 0; j < r; ++j) Q[k * r + j] = qt[(int64_t)j * m + k];
    if (sub)
        for (int64_t i = 0; i < n; ++i) lr_row_product<true>(M + i * m, m, P + i * r, r, qt.data());
    return 0;
}

// out = P Q^T in the order described above (the same bits on every CPU).
int bq_lr_product(float* out, int64_t n, int64_t m, const float* P, const float* Q, int r) {
    if (r < 1 || r > LR_MAX_RANK || n < 1 || m < 1) return 2;
    std::vector<float> qt((size_t)r * (size_t)m);
    lr_transpose(Q, m, r, qt.data());
#if defined(__AVX2__)
    if (m % 8 == 0 && (reinterpret_cast<uintptr_t>(out) & 31) == 0) {   // every row aligned: stream
        for (int64_t i = 0; i < n; ++i) lr_row_product<false, true>(out + i * m, m, P + i * r, r, qt.data());
        _mm_sfence();
        return 0;
    }
#endif
    for (int64_t i = 0; i < n; ++i) lr_row_product<false>(out + i * m, m, P + i * r, r, qt.data());
    return 0;
}

}  // extern "C"
