// Vectors of W = 16 floats over whatever registers the build has (one zmm, two ymm, four q or
// xmm), loads/stores, horizontal sums, the exponentials, and the element types (F32, F16, BF16,
// FP8) that widen inputs to float32 on load and round results on store.
//
// Part of attention.cpp, which includes its parts in order as one translation unit (the
// compiler inlines across them); not compiled on its own.
#pragma once

namespace {

constexpr int W = 16;        // floats per vector
constexpr int BK = 64;       // keys per block (4 vectors): packed K^T and V of a block stay in L1
// Most query rows per work item: each key block is packed once for them (1024 rows ran W1 5% faster
// than 256: a 300-token sequence packed its keys twice). Fewer for wide heads, so that a thread's
// rows of q and O stay near 256 KB each.
constexpr int QCHUNK = 1024;
constexpr int R = 6;         // query rows per micro-tile (AVX-512: 24 accumulators; AVX2: 12 a pass)
constexpr int TR = 16;       // query rows per AMX tile

// A vector is W = 16 floats. With AVX-512 it is one register. With narrower registers (AVX2,
// SSE, NEON) it is a struct of 64 / JS_VEC_BYTES native vectors: GCC has no register for a 64-byte
// vector type there and keeps it in memory, which ran the tiles of an x86-64-v3 build 24x slower
// (3 GFLOP/s on W1). The tile code sees the same type and operators either way.
#if defined(__AVX512F__)
#define JS_VEC_BYTES 64
#elif defined(__AVX__)
#define JS_VEC_BYTES 32
#else
#define JS_VEC_BYTES 16
#endif
template <class E, int Bytes>
struct Native {
    typedef E type __attribute__((vector_size(Bytes)));
};
typedef Native<float, JS_VEC_BYTES>::type nvf;    // one register of floats
typedef Native<int32_t, JS_VEC_BYTES>::type nvi;  // one register of int32
constexpr int NL = JS_VEC_BYTES / 4;                // lanes of a register
constexpr int NP = W / NL;                          // registers per vector

#if JS_VEC_BYTES == 64
typedef nvf vf;
typedef nvi vi;
template <class F>
inline vf build(F&& part) { return part(0); }
inline vf select(vi m, vf a, vf b) { return m ? a : b; }
inline vi as_int(vf x) { vi r; std::memcpy(&r, &x, sizeof r); return r; }
inline vf as_float(vi x) { vf r; std::memcpy(&r, &x, sizeof r); return r; }
#else
struct vf { nvf h[NP]; };
struct vi { nvi h[NP]; };
#define JS_PARTS(r, expr) \
    for (int i_ = 0; i_ < NP; ++i_) r.h[i_] = (expr)
template <class F>
inline vf build(F&& part) { vf r; JS_PARTS(r, part(i_)); return r; }
inline vf operator+(vf a, vf b) { JS_PARTS(a, a.h[i_] + b.h[i_]); return a; }
inline vf operator-(vf a, vf b) { JS_PARTS(a, a.h[i_] - b.h[i_]); return a; }
inline vf operator*(vf a, vf b) { JS_PARTS(a, a.h[i_] * b.h[i_]); return a; }
inline vf& operator+=(vf& a, vf b) { return a = a + b; }
inline vi operator<(vf a, vf b) { vi r; JS_PARTS(r, a.h[i_] < b.h[i_]); return r; }
inline vi operator>(vf a, vf b) { return b < a; }
inline vi operator+(vi a, int32_t b) { JS_PARTS(a, a.h[i_] + b); return a; }
inline vi operator-(vi a, int32_t b) { JS_PARTS(a, a.h[i_] - b); return a; }
inline vi& operator-=(vi& a, int32_t b) { return a = a - b; }
inline vi operator<<(vi a, int b) { JS_PARTS(a, a.h[i_] << b); return a; }
inline vf select(vi m, vf a, vf b) { vf r; JS_PARTS(r, m.h[i_] ? a.h[i_] : b.h[i_]); return r; }
inline vi as_int(vf x) { vi r; JS_PARTS(r, reinterpret_cast<nvi>(x.h[i_])); return r; }
inline vf as_float(vi x) { vf r; JS_PARTS(r, reinterpret_cast<nvf>(x.h[i_])); return r; }
#undef JS_PARTS
#endif

// x in every lane, as a list of NL copies: written `nvf{} + x` it was an add of +0 (which IEEE
// does not let the compiler drop) and a register broadcast, both on the FMA ports, per broadcast
// of the tiles' inner loops (the tiles ran at 70% of the FMA rate); this is one broadcast load.
template <size_t... I>
inline nvf lanes_of(float x, std::index_sequence<I...>) {
    return nvf{((void)I, x)...};
}
inline vf splat(float x) { return build([x](int) { return lanes_of(x, std::make_index_sequence<NL>{}); }); }
inline vf loadu(const float* p) {
    return build([p](int i) { nvf r; std::memcpy(&r, p + i * NL, sizeof r); return r; });
}
#if JS_VEC_BYTES == 64
inline void storeu(float* p, vf x) { std::memcpy(p, &x, sizeof x); }
#else
// Register by register: one memcpy of the whole struct went through the stack (the accumulators
// stored there, then copied out in 16-byte pieces), a tenth of an AVX2 tile's time.
inline void storeu(float* p, vf x) {
    for (int i = 0; i < NP; ++i) std::memcpy(p + i * NL, &x.h[i], sizeof x.h[i]);
}
#endif
inline vf vmax(vf a, vf b) { return select(a > b, a, b); }
// One native register (nvf) at a time.
inline nvf load_n(const float* p) { nvf r; std::memcpy(&r, p, sizeof r); return r; }
inline void store_n(float* p, nvf x) { std::memcpy(p, &x, sizeof x); }
inline nvf splat_n(float x) { return lanes_of(x, std::make_index_sequence<NL>{}); }

#if JS_VEC_BYTES == 64
// Horizontal max and sum as trees of shuffles (a chain of 16 scalar steps costs ~4x more).
inline float hmax(vf x) {
    x = vmax(x, __builtin_shuffle(x, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    x = vmax(x, __builtin_shuffle(x, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    x = vmax(x, __builtin_shuffle(x, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    x = vmax(x, __builtin_shuffle(x, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return x[0];
}
inline float hsum(vf x) {
    x += __builtin_shuffle(x, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}
#else
// The registers folded into one, then its lanes (8 or 4).
inline float hmax(vf x) {
    nvf m = x.h[0];
    for (int i = 1; i < NP; ++i) m = m > x.h[i] ? m : x.h[i];
    float r = m[0];
    for (int j = 1; j < NL; ++j) r = r > m[j] ? r : m[j];
    return r;
}
inline float hsum(vf x) {
    nvf s = x.h[0];
    for (int i = 1; i < NP; ++i) s += x.h[i];
    float r = s[0];
    for (int j = 1; j < NL; ++j) r += s[j];
    return r;
}
#endif

// With AVX-512 GCC inlines vexp where it is used; a struct vector (narrower registers) makes it
// look big enough to call, and a call passes the struct through memory (vexp ran at 2 ns a score
// on AVX2, as much as the whole tile's products), so there it is always inlined.
#if JS_VEC_BYTES == 64
#define JS_VEXP_INLINE inline
#else
#define JS_VEXP_INLINE inline __attribute__((always_inline))
#endif

#if JS_AVX512
// exp(x) to ~1 ulp for x <= 88 (Cephes expf); exactly 0 below -87.33, so exp(-inf) = 0. The result
// is scaled by 2^n with vscalefps (the same bits as the multiply by 2^n built in integer lanes,
// four instructions fewer: exponentials are a fifth of a float32 forward's softmax).
JS_VEXP_INLINE vf vexp(vf x) {
    const vf lo = splat(-87.33654f);
    const vi under = x < lo;
    const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    vf t = x * splat(1.44269504088896341f) + magic;
    vf n = t - magic;
    vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500E-4f);
    p = p * r + splat(1.3981999507E-3f);
    p = p * r + splat(8.3334519073E-3f);
    p = p * r + splat(4.1665795894E-2f);
    p = p * r + splat(1.6666665459E-1f);
    p = p * r + splat(5.0000001201E-1f);
    vf y = p * r * r + r + splat(1.0f);
    __m512 ym, nm;
    std::memcpy(&ym, &y, sizeof ym);
    std::memcpy(&nm, &n, sizeof nm);
    ym = _mm512_scalef_ps(ym, nm);
    std::memcpy(&y, &ym, sizeof y);
    return select(under, splat(0.0f), y);  // lanes below lo are replaced by 0 whatever they hold
}
#else
// exp(x) to ~1 ulp (max 1.05, mean 0.26 over [-87, 0], as Cephes expf) for x <= 88: n = round(x
// log2 e), r = x - n ln 2 in two steps, exp(r) by a degree-6 polynomial (Horner, p(0) = 1: exp(0)
// = 1 exactly), times 2^n whose bits are t << 23: the rounding constant carries the exponent bias,
// so t = x log2 e + 1.5 * 2^23 + 127 holds n + 127 in its low bits. x is clamped at -88, where
// n + 127 = 0 builds 2^n = 0: exactly 0 below about -87.7 (exp(-inf) = 0) with no select, and NaN
// stays NaN (the clamp keeps x when it is NaN). 13 instructions a register where the Cephes form
// with its selects took 19: the exponentials are a sixth of an AVX2 forward.
JS_VEXP_INLINE vf vexp(vf x) {
#if defined(__AVX__)
    x = build([&](int i) { return reinterpret_cast<nvf>(_mm256_max_ps(_mm256_set1_ps(-88.f), reinterpret_cast<__m256>(x.h[i]))); });
#else
    x = select(x < splat(-88.f), splat(-88.f), x);
#endif
    const vf magic = splat(12582912.0f + 127.f);  // 1.5 * 2^23 + 127: adding it rounds to an integer
    const vf t = x * splat(1.44269504088896341f) + magic;
    const vf n = t - magic;
    const vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf p = splat(1.3843653724e-3f);
    p = p * r + splat(8.3741554990e-3f);
    p = p * r + splat(4.1668001562e-2f);
    p = p * r + splat(1.6666431725e-1f);
    p = p * r + splat(4.9999994040e-1f);
    p = p * r + splat(1.0f);
    return (p * r + splat(1.0f)) * as_float(as_int(t) << 23);
}
#endif

// Two registers of floats (direct rows widen two at a time where one load serves both).
struct nvf2 {
    nvf a, b;
};

// Element access for the three input dtypes; computation is float32.
// ld16 widens 16 contiguous elements at once.
struct F32 {
    typedef float T;
    typedef F32 QO;  // q and out: in the input dtype, except beside an fp8 cache
    static float ld(const T* p) { return *p; }
    static vf ld16(const T* p) { return loadu(p); }
    static nvf ldn(const T* p) { nvf r; std::memcpy(&r, p, sizeof r); return r; }  // NL elements, one register
    static T st(float x) { return x; }
};
// Arm's half type is __fp16 (IEEE binary16 on aarch64; g++ before 13 has no _Float16 in C++ there).
#if defined(__aarch64__)
typedef __fp16 half_t;
#else
typedef _Float16 half_t;
#endif
// NL binary16 values (their bits) widened to one register of floats. GCC turns a vector conversion
// of _Float16 into one scalar vcvtph2ps per lane (fp16 decode rows ran 3x slower than bf16 on AVX2),
// so x86 with F16C converts a register at once with the intrinsic; Arm's fcvtl does it natively.
typedef Native<uint16_t, 2 * NL>::type nvh;  // NL half-precision bit patterns
inline nvf widen_halves(nvh bits) {
#if defined(__F16C__) && JS_VEC_BYTES == 64
    __m256i b;
    std::memcpy(&b, &bits, sizeof b);
    const __m512 f = _mm512_cvtph_ps(b);
#elif defined(__F16C__) && JS_VEC_BYTES == 32
    __m128i b;
    std::memcpy(&b, &bits, sizeof b);
    const __m256 f = _mm256_cvtph_ps(b);
#elif defined(__F16C__)
    __m128i b = _mm_setzero_si128();
    std::memcpy(&b, &bits, sizeof bits);
    const __m128 f = _mm_cvtph_ps(b);
#else
    typename Native<half_t, 2 * NL>::type h;
    std::memcpy(&h, &bits, sizeof h);
    const nvf f = __builtin_convertvector(h, nvf);
#endif
    nvf r;
    std::memcpy(&r, &f, sizeof r);
    return r;
}
// NL bytes zero-extended to 16-bit lanes (one instruction on x86; GCC's vector conversion went
// lane by lane).
inline nvh widen_bytes(const uint8_t* p) {
#if JS_VEC_BYTES == 64
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif JS_VEC_BYTES == 32 && defined(__SSE4_1__)
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
    typename Native<uint8_t, NL>::type b;
    std::memcpy(&b, p, sizeof b);
    const nvh w = __builtin_convertvector(b, nvh);
#endif
    nvh r;
    std::memcpy(&r, &w, sizeof r);
    return r;
}
struct F16 {
    typedef half_t T;
    typedef F16 QO;
    static float ld(const T* p) { return static_cast<float>(*p); }
    static nvf ldn(const T* p) {
        nvh h;
        std::memcpy(&h, p, sizeof h);
        return widen_halves(h);
    }
    static vf ld16(const T* p) { return build([p](int i) { return ldn(p + i * NL); }); }
    static T st(float x) { return static_cast<half_t>(x); }
};
struct BF16 {
    typedef uint16_t T;
    typedef BF16 QO;
    static float ld(const T* p) {
        uint32_t b = static_cast<uint32_t>(*p) << 16;
        float f;
        std::memcpy(&f, &b, 4);
        return f;
    }
    static nvf ldn(const T* p) {  // widened by a shift into the high half of each word
        typename Native<uint16_t, JS_VEC_BYTES / 2>::type h;
        std::memcpy(&h, p, sizeof h);
        return reinterpret_cast<nvf>(__builtin_convertvector(h, nvi) << 16);
    }
    static vf ld16(const T* p) { return build([p](int i) { return ldn(p + i * NL); }); }
    static T st(float x) {  // round to nearest even; NaN stays NaN
        uint32_t b;
        std::memcpy(&b, &x, 4);
        if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<T>((b >> 16) | 0x40);
        b += 0x7fffu + ((b >> 16) & 1u);
        return static_cast<T>(b >> 16);
    }
};

// An fp8 KV cache (docs/api.md section 13): K and V are bytes, widened exactly to float32 on load
// (the cache itself is never converted); q and out are float32 (QO), so that native.py folds
// k_scale into q and v_scale into out. Both formats widen through the half-precision conversion
// (F16C on x86, fcvt on Arm): an e5m2 byte is the high byte of its binary16; an e4m3fn magnitude
// shifted into binary16's exponent and mantissa fields is its value times 2^-8, subnormals
// included, and S.1111.111 is NaN (e4m3fn has no infinity).
template <bool E4M3>
struct FP8 {
    typedef uint8_t T;
    typedef F32 QO;
    static float ld(const T* p) {
        const uint16_t b = *p;
        uint16_t h = E4M3 ? static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)) : static_cast<uint16_t>(b << 8);
        half_t x;
        std::memcpy(&x, &h, 2);
        if (!E4M3) return static_cast<float>(x);
        return (b & 0x7fu) == 0x7fu ? NAN : static_cast<float>(x) * 256.f;
    }
    static nvf ldn(const T* p) {
        const nvh w = widen_bytes(p);
        if (!E4M3) return widen_halves(w << 8);
        // S.EEEE.MMM -> S.0EEEE.MMM0000000 (t + (t & 0x4000) moves the sign from bit 14 to 15);
        // S.1111.111 (NaN) gets binary16's all-ones exponent and a quiet mantissa bit.
        const nvh t = w << 7;
        const nvh nan = (w & 0x7f) == 0x7f;
        return widen_halves((t + (t & 0x4000)) | (nan & 0x7e00)) * 256.f;
    }
    static vf ld16(const T* p) { return build([p](int i) { return ldn(p + i * NL); }); }
    // 2 NL elements (direct rows' loads; e5m2 only, the e4m3 rows take E4M3x). x86: 16 bytes
    // interleaved with zeros are their binary16s, no shift.
    static nvf2 ld2n(const T* p) {
#if defined(__F16C__) && JS_VEC_BYTES == 32
        if constexpr (!E4M3) {
            const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
            return nvf2{reinterpret_cast<nvf>(_mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), x))),
                        reinterpret_cast<nvf>(_mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), x)))};
        }
#endif
        return nvf2{ldn(p), ldn(p + NL)};
    }
};
typedef FP8<true> E4M3;
typedef FP8<false> E5M2;

// e4m3fn bytes widened to their value times 2^-8: FP8<true>'s binary16 without its multiply by 256.
// Direct rows (decoding) fold the 2^8 into q and P instead, which leaves every product, and so
// every sum, bit for bit as FP8<true> gives them (a power of two scales exactly). NanLanes: S.1111.111
// gives NaN, as FP8<true>; without it such a byte reads as 1.875 and the caller must know there is
// none (E4M3NanScan), for 4 instructions fewer per register. x86: a byte interleaved above a zero
// byte and shifted right by 1 (arithmetically) holds S at bits 15 and 14 and the magnitude at bits
// 13-7; clearing bit 14 leaves the binary16: 3 instructions and the conversion a register, where
// FP8<true> takes 10 (the same with 32-byte registers ran 35% slower: their sign extension and
// extract compete with the conversions).
template <bool NanLanes>
struct E4M3x {
    typedef uint8_t T;
    static float ld(const T* p) {
        const uint16_t b = *p;
        const uint16_t h = static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
        half_t x;
        std::memcpy(&x, &h, 2);
        return NanLanes && (b & 0x7fu) == 0x7fu ? NAN : static_cast<float>(x);
    }
#if defined(__F16C__) && JS_VEC_BYTES == 32
    static nvf halves(__m128i hi_bytes) {  // 8 bytes in the high halves of 16-bit lanes
        __m128i h = _mm_and_si128(_mm_srai_epi16(hi_bytes, 1), _mm_set1_epi16(static_cast<short>(0xbf80)));
        if (NanLanes) {
            const __m128i mag = _mm_set1_epi16(0x3f80);
            const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, mag), mag);
            h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7e00)));
        }
        return reinterpret_cast<nvf>(_mm256_cvtph_ps(h));
    }
    static nvf ldn(const T* p) {
        return halves(_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    static nvf2 ld2n(const T* p) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return nvf2{halves(_mm_unpacklo_epi8(_mm_setzero_si128(), x)), halves(_mm_unpackhi_epi8(_mm_setzero_si128(), x))};
    }
#else
    static nvf ldn(const T* p) {
        const nvh w = widen_bytes(p);
        const nvh t = w << 7;
        nvh h = t + (t & 0x4000);
        if (NanLanes) {
            const nvh nan = (w & 0x7f) == 0x7f;
            h |= nan & 0x7e00;
        }
        return widen_halves(h);
    }
    static nvf2 ld2n(const T* p) { return nvf2{ldn(p), ldn(p + NL)}; }
#endif
};

#if defined(__AVX2__) && JS_VEC_BYTES == 32
// x & m with m read from memory by the instruction itself: as a register constant it cost group_pv's
// 12 accumulators a register, and GCC spilled one to the stack.
inline __m256i and_mem(__m256i x, const uint32_t (&m)[8]) {
    asm("vpand %1, %0, %0" : "+x"(x) : "m"(*reinterpret_cast<const __m256i*>(m)));
    return x;
}
alignas(32) constexpr uint32_t kE4M3wBits[8] = {0x87f00000u, 0x87f00000u, 0x87f00000u, 0x87f00000u,
                                                0x87f00000u, 0x87f00000u, 0x87f00000u, 0x87f00000u};
// e4m3fn bytes widened to their value times 2^-120 by integer instructions alone: a byte sign-extended
// to 32 bits and shifted left by 20 holds S at bit 31 and the magnitude in float32's low exponent and
// high mantissa bits (EEEE = 0 lands on float32's subnormals, the same 2^-120 apart). Two shuffle-port
// operations a register where E4M3x takes four (its conversion is two), which bounded the fp8 decode
// rows. Exact only while float32 subnormals are (no DAZ): the caller checks MXCSR. NanLanes as E4M3x.
template <bool NanLanes>
struct E4M3w {
    typedef uint8_t T;
    static float ld(const T* p) { return E4M3x<NanLanes>::ld(p) * 0x1p-112f; }
    static nvf ldn(const T* p) {
        const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        __m256i h = and_mem(_mm256_slli_epi32(x, 20), kE4M3wBits);
        if (NanLanes) {
            const __m256i mag = _mm256_set1_epi32(0x07f00000);
            const __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(h, mag), mag);
            h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi32(0x7fc00000)));
        }
        return reinterpret_cast<nvf>(_mm256_castsi256_ps(h));
    }
    static nvf2 ld2n(const T* p) { return nvf2{ldn(p), ldn(p + NL)}; }
};
// Whether the direct rows may widen fp8 with E4M3w / E5M2w now: not under DAZ.
inline bool e4m3_wide() { return !(_mm_getcsr() & 0x40); }
#else
template <bool NanLanes>
using E4M3w = E4M3x<NanLanes>;  // never taken (e4m3_wide): keeps the callers' branches compiling
inline bool e4m3_wide() { return false; }
#endif

// Whether runs of e4m3fn bytes hold a NaN (S.1111.111): add() each run, then any(). x86 with AVX2:
// a running signed byte max (0x7f is the largest) and unsigned max (0xff), two instructions per 32
// bytes, where NaN lanes in E4M3x take four per 8.
struct E4M3NanScan {
#if defined(__AVX2__)
    __m256i smax = _mm256_set1_epi8(-128), umax = _mm256_setzero_si256();
#endif
    bool found = false;
    void add(const uint8_t* p, int64_t n) {
        int64_t i = 0;
#if defined(__AVX2__)
        for (; i + 32 <= n; i += 32) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
            smax = _mm256_max_epi8(smax, x);
            umax = _mm256_max_epu8(umax, x);
        }
#endif
        for (; i < n; ++i) found |= (p[i] & 0x7f) == 0x7f;
    }
    bool any() const {
#if defined(__AVX2__)
        const __m256i hit = _mm256_or_si256(_mm256_cmpeq_epi8(smax, _mm256_set1_epi8(0x7f)),
                                            _mm256_cmpeq_epi8(umax, _mm256_set1_epi8(-1)));
        if (_mm256_movemask_epi8(hit)) return true;
#endif
        return found;
    }
};

#if JS_BF16_DOT
// exp(x) for probabilities that are rounded to bf16 (8-bit mantissa) before their product: 2^f
// (f = x log2 e - n, |f| <= 1/2) by a degree-4 minimax polynomial with p(0) = 1, scaled by 2^n
// with vscalefps: 9 instructions where vexp takes 17, within 7e-6 relative (2.9e-6 the polynomial,
// the rest x log2 e's rounding at large |x|), 1/300 of bf16's rounding. The exponentials bound
// bf16 attention on AMX; FlashAttention-4 moves part of its own onto a polynomial for
// the same reason. exp(0) = 1 exactly (every row's top key); exp(-inf) = 0 (x is clamped to -110,
// where 2^n underflows to exactly 0); NaN stays NaN (vmaxps returns its second operand, x).
inline vf vexp_bf16(vf x) {
    __m512 v;
    std::memcpy(&v, &x, sizeof v);
    v = _mm512_max_ps(_mm512_set1_ps(-110.f), v);
    const __m512 t = _mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.582852944731712e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5906426161527634e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024099111557007e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931241750717163e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));  // exp(0) = 1 exactly: every row's top key
    v = _mm512_scalef_ps(p, n);
    vf r;
    std::memcpy(&r, &v, sizeof r);
    return r;
}
#endif

// The exponential of a call's probabilities, forward and backward alike (the backward's P must be
// the forward's): bf16 calls where the CPU multiplies bf16 (their P is rounded to bf16 for its
// products) take vexp_bf16; every other call vexp.
template <class IO>
JS_VEXP_INLINE vf prob_exp(vf x) {
#if JS_BF16_DOT
    if constexpr (std::is_same<IO, BF16>::value) return vexp_bf16(x);
#endif
    return vexp(x);
}

#if JS_VEC_BYTES == 32 && defined(__AVX__)
// 8 x 8 transpose of floats in registers: r[i] becomes column i of the rows r[0..8).
inline void transpose8(__m256* r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
#endif

#if JS_AVX512
// 16 x 16 transpose of 32-bit words in registers: r[i] becomes column i of the rows r[0..16).
inline void transpose16(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; ++i) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

// The first n (0..16) elements of a row as float32 words, the rest zero and never read (masked
// loads do not touch memory past the row).
inline __mmask16 lanes16(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
inline __m512i row_words(F32, const float* p, int n) { return _mm512_castps_si512(_mm512_maskz_loadu_ps(lanes16(n), p)); }
inline __m512i row_words(F16, const _Float16* p, int n) {
    return _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes16(n), p)));
}
inline __m512i row_words(BF16, const uint16_t* p, int n) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes16(n), p)), 16);
}
template <bool E4M3>
inline __m512i row_words(FP8<E4M3>, const uint8_t* p, int n) {  // n bytes copied: nothing past the row is read
    alignas(64) uint8_t t[16] = {};
    std::memcpy(t, p, n);
    const vf x = FP8<E4M3>::ld16(t);
    __m512i r;
    std::memcpy(&r, &x, sizeof r);
    return r;
}
// The first n (0..32) bf16 elements of a row as 16 words of pairs, the rest zero.
inline __m512i row_pairs(const void* p, int n) {  // p: bf16 elements
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>(n >= 32 ? ~0u : (1u << n) - 1u), p);
}
#endif

}  // namespace
