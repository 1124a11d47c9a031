// Ragged attention on the CPU, forward and backward, compiled for this machine (native.py builds
// it with g++ -O3 -march=native -fopenmp on first use, or for the -march in $JAGGED_SDPA_CPU_ARCH,
// and binds it with ctypes).
//
// Why our own kernel: PyTorch's fused CPU kernel calls MKL sgemm, which on this AMD CPU runs its
// AVX2 path (89 GFLOP/s a core, where a register-only AVX-512 FMA loop reaches 335), and every
// torch-op engine pays Python and dispatch per sequence. Here one call walks a whole ragged batch
// on OpenMP threads (the same runtime as torch's), with register-tiled micro-kernels written with
// GCC vector extensions (a vector is one AVX-512 register here, two AVX2 or four SSE ones elsewhere)
// and an online softmax over blocks of 64 keys.
//
// Layout: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) with any token and head
// strides and a contiguous last dim, or k/v as a paged cache read through a block table (both
// directions: the backward's dK/dV are then cache-shaped, see "Backward");
// out (total_q, Hq, Dv); lse (Hq, total_q) float32, natural log, -inf for rows that see no key
// (sink_h with sinks).
// Scores follow docs/api.md's order: scale, softcap, ALiBi (-slope * |i' - j|), masks (causal,
// window, chunk; or the prefix, docs/api.md section 11) on the aligned position i' = i + shift. Sinks (docs/api.md section 11)
// are one more logit per head in each row's denominator, folded in when the row is written
// (finish_row): the lse includes them, so the backward's P = exp(S - lse) needs nothing more.
// Computation is float32 whatever the input dtype (fp16/bf16 are widened exactly on load), except
// bf16 products: where the CPU has AMX (and Linux grants its tile state) the forward and the
// backward multiply bf16 on AMX tiles (tdpbf16ps, 16 query rows a tile), where it has AVX512-BF16
// alone both use vdpbf16ps; products are exact and sums float32, but P (and the backward's dS) is
// rounded to bf16 for its product, as flash attention does on GPUs (js_bf16_tiles says which), and
// its exponentials are a 9-instruction polynomial (vexp_bf16) accurate well past that rounding.
//
// Key ranges: every row's visible keys come from key_range() alone, clamped to [0, Lk), so no
// loop reads outside its sequence whatever the window, alignment or lengths (tests/safety/test_sanitizers.py
// and tests/safety/test_guard_pages.py check every path). Non-finite inputs: a NaN or inf in a score or
// value a row sees reaches its out (and lse) as in dense attention; a row that sees no key, or
// only -inf scores, gives exactly 0 and lse -inf. Keys a row does not see are never read for it
// alone, but its tile multiplies their values by P = 0 (0 * NaN is NaN, as in dense SDPA).
// A row that sees no key with sinks: out 0, lse sink_h.
//
// Dropout follows keyed_dropout.py (the one definition, shared with MATH and TRITON): the
// probability of (sequence b, query head h, in-sequence row i, in-sequence key j) is multiplied by
// Z = keep / (1 - p), keep drawn by Philox4x32-10 from the counter (j, i, h, b) under the call's
// key, recomputed (never stored) in the backward; no thread count, work split or packing changes it.
//
// Sections: vector helpers; parameters; packing; dropout; forward tiles (fp32, bf16 vdpbf16ps,
// AMX); direct rows (decoding); forward driver; backward; C entry points.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <omp.h>
#if defined(__F16C__) || defined(__SSE4_1__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <utility>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define JS_AVX512 1
#else
#define JS_AVX512 0
#endif
// Key blocks are packed with AVX-512 transposes and masked loads, except under AddressSanitizer,
// which does not see intrinsic loads: there the element-by-element packing reads the same rows,
// so that a read past one is reported (tests/safety/test_sanitizers.py; the guard-page tests check the
// vector path).
#if JS_AVX512 && !defined(__SANITIZE_ADDRESS__)
#define JS_PACK512 1
#else
#define JS_PACK512 0
#endif
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define JS_BF16_DOT 1  // bf16 inputs multiply as bf16 pairs (vdpbf16ps), accumulating in float32
#else
#define JS_BF16_DOT 0
#endif
#if JS_BF16_DOT && JS_AVX512 && defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define JS_AMX 1  // bf16 forward tiles on AMX (tdpbf16ps) when Linux grants the tile state
#else
#define JS_AMX 0
#endif
// The bf16 backward on vdpbf16ps (where there is no AMX) transposes its dK/dV accumulators back
// with AVX-512 word transposes.
#if JS_BF16_DOT && JS_AVX512
#define JS_BF16_BWD 1
#else
#define JS_BF16_BWD 0
#endif

#if defined(__AVX__) && !JS_AVX512
#include <immintrin.h>  // lane_sums' horizontal adds, group_scores' FMAs
#endif
#if defined(__aarch64__)
#include <arm_neon.h>  // group_scores' FMAs
#endif

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

// exp(x) to ~1 ulp for x <= 88 (Cephes expf); exactly 0 below -87.33, so exp(-inf) = 0. With
// AVX-512 the result is scaled by 2^n with vscalefps (the same bits as the multiply by 2^n built in
// integer lanes, four instructions fewer: exponentials are a fifth of a float32 forward's softmax).
JS_VEXP_INLINE vf vexp(vf x) {
    const vf lo = splat(-87.33654f);
    const vi under = x < lo;
#if !JS_AVX512
    x = select(under, lo, x);  // AVX-512: lanes below lo are replaced by 0 at the end whatever they hold
#endif
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
#if JS_AVX512
    __m512 ym, nm;
    std::memcpy(&ym, &y, sizeof ym);
    std::memcpy(&nm, &n, sizeof nm);
    ym = _mm512_scalef_ps(ym, nm);
    std::memcpy(&y, &ym, sizeof y);
#else
    vi ni = as_int(t);
    ni -= 0x4B400000;  // the integer n in the low bits of t
    y = y * as_float((ni + 127) << 23);
#endif
    return select(under, splat(0.0f), y);
}

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
};
typedef FP8<true> E4M3;
typedef FP8<false> E5M2;

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

extern "C" {

// Mirrored field for field by _Params in native.py.
struct JsParams {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    float* lse;              // may be null
    const int32_t* cu_q;       // (batch + 1,) query offsets into q/out
    const int32_t* cu_k;       // (batch + 1,) key offsets into k/v
    const int32_t* seqused_k;  // (batch,) keys each sequence uses from its start, or null
    // A paged KV cache: k/v are (num_blocks, block_size, Hkv, D) with a block stride
    // k_block/v_block, key j of sequence b lives in block block_table[b * bt_stride + j / block_size];
    // cu_k is then null and seqused_k gives the lengths.
    const int32_t* block_table;
    int64_t bt_stride, block_size, k_block, v_block;
    const float* slopes;     // ALiBi slopes, null when off
    int64_t slopes_batch_stride;  // 0 for (Hq,), Hq for (B, Hq)
    int64_t batch, heads_q, heads_kv, head_dim, head_dim_v;
    int64_t q_tok, q_head, k_tok, k_head, v_tok, v_head, o_tok, o_head;
    int64_t lse_head, lse_tok;
    float scale, softcap;
    int32_t causal, bottom_right;
    int64_t window_left, window_right;
    int32_t dtype;           // 0 float32, 1 float16, 2 bfloat16; k/v fp8 (q and out float32): 3 e4m3fn, 4 e5m2
    int32_t threads;
    // Work split (tests shrink them to reach every path on small shapes): query rows per item
    // (capped by chunk_rows), sequences with at most direct_rows queries run as direct rows, whose keys
    // go in steps of direct_keys (at most DIRECT_KEYS).
    int32_t q_chunk, direct_rows, direct_keys;
    // Dropout (keyed_dropout.py): the call's key and p in [0, 1); p = 0 is off.
    uint32_t dropout_seed, dropout_offset;
    float dropout_p;
    // docs/api.md section 11: chunked attention (chunk_size C, 0 = off), prefix-LM (prefix_lens (batch,), null =
    // off) and sinks ((Hq,) float32 logits, null = off).
    int64_t chunk_size;
    const int32_t* prefix_lens;
    const float* sinks;
    // A dense cache read in place (docs/api.md section 12) is a paged cache of one block of S slots per sequence
    // (block_table[b] = b, block_size = S): sequence b's keys start at slot cache_leftpad[b] of its
    // block (null: at 0).
    const int32_t* cache_leftpad;
};

// The backward's tensors beside the forward's (whose out is read here): dout (total_q, Hq, Dv),
// dq like q, dk like k, dv like v (any token and head strides, contiguous last dim; with a paged
// cache dk/dv are cache-shaped with block strides dk_block/dv_block), lse as written by the
// forward. dq/dk/dv arrive zeroed; the kernel writes every row some sequence reads. dsinks (Hq,)
// float32 gets the sinks' gradient (null: not wanted).
struct JsGradParams {
    JsParams f;
    const void* dout;
    void* dq;
    void* dk;
    void* dv;
    int64_t do_tok, do_head, dq_tok, dq_head, dk_tok, dk_head, dv_tok, dv_head;
    int64_t dk_block, dv_block;
    float* dsinks;
};

}  // extern "C"

namespace {

// Element offset of key j of sequence b in k or v (tok and blk: that tensor's strides).
inline int64_t key_offset(const JsParams& p, int64_t b, int64_t j, int64_t tok, int64_t blk) {
    if (!p.block_table) return (p.cu_k[b] + j) * tok;
    if (p.cache_leftpad) j += p.cache_leftpad[b];
    return p.block_table[b * p.bt_stride + j / p.block_size] * blk + (j % p.block_size) * tok;
}
inline int64_t key_count(const JsParams& p, int64_t b) {
    return p.seqused_k ? p.seqused_k[b] : p.cu_k[b + 1] - p.cu_k[b];
}

// The rows of key block [kb, kb + nk) of sequence b in k or v (x, with that tensor's token, block
// and head strides), kv head hk.
template <class T>
struct KeyRows {
    const JsParams& p;
    const void* x;
    int64_t tok, blk, head, b, kb, hk;
    const T* operator()(int j) const {
        return static_cast<const T*>(x) + key_offset(p, b, kb + j, tok, blk) + hk * head;
    }
};
template <class T>
KeyRows<T> k_rows(const JsParams& p, int64_t b, int64_t kb, int64_t hk) {
    return {p, p.k, p.k_tok, p.k_block, p.k_head, b, kb, hk};
}
template <class T>
KeyRows<T> v_rows(const JsParams& p, int64_t b, int64_t kb, int64_t hk) {
    return {p, p.v, p.v_tok, p.v_block, p.v_head, b, kb, hk};
}

// Packing a key block for the tiles (rows: its nk rows of len elements). With AVX-512: 16 x 16
// word transposes of rows read with masked loads (nothing past a row is touched); otherwise
// element by element.
//
// Transposed: dst[e * BK + j] = 32-bit word e of key j, e < words, zero for keys j >= nk: floats
// widened from the input, or (Pairs) the input's bf16 as pairs of elements (words: the padded
// pair count, zero past len). K^T for q.k^T (and V^T for dO.v^T).
template <class IO, bool Pairs, class Rows>
void pack_transposed(const Rows& rows, int nk, int64_t len, int64_t words, uint32_t* dst) {
    typedef typename IO::T T;
#if JS_PACK512
    const int elems = Pairs ? 32 : 16;  // input elements per row of 16 words
    auto words_at = [&](const T* row, int64_t e0) {  // words e0 .. e0 + 16 of a row
        const int n = static_cast<int>(std::clamp<int64_t>(len - e0 * (Pairs ? 2 : 1), 0, elems));
        if (n == 0) return _mm512_setzero_si512();
        if constexpr (Pairs) return row_pairs(row + 2 * e0, n);
        else return row_words(IO{}, row + e0, n);
    };
    for (int j0 = 0; j0 < BK; j0 += 16) {
        if (j0 >= nk) {
            for (int64_t e = 0; e < words; ++e) std::fill(dst + e * BK + j0, dst + e * BK + BK, 0u);
            break;
        }
        const T* src[16];
        for (int j = 0; j < 16; ++j) src[j] = j0 + j < nk ? rows(j0 + j) : nullptr;
        for (int64_t e0 = 0; e0 < words; e0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j) r[j] = src[j] ? words_at(src[j], e0) : _mm512_setzero_si512();
            transpose16(r);
            for (int64_t i = 0; i < std::min<int64_t>(16, words - e0); ++i) _mm512_storeu_si512(dst + (e0 + i) * BK + j0, r[i]);
        }
    }
#else
#if JS_VEC_BYTES == 32 && defined(__AVX__)
    // 8 x 8 transposes of whole registers of 8 elements (IO::ldn: no read past a row's len); the
    // element-by-element loop below ran at a fifth of the speed (4% of an AVX2 W3 forward).
    if constexpr (!Pairs) {
        for (int j0 = 0; j0 < BK; j0 += NL) {
            if (j0 >= nk) {
                for (int64_t e = 0; e < words; ++e) std::fill(dst + e * BK + j0, dst + e * BK + BK, 0u);
                break;
            }
            const T* src[NL];
            for (int j = 0; j < NL; ++j) src[j] = j0 + j < nk ? rows(j0 + j) : nullptr;
            int64_t e0 = 0;
            for (; e0 + NL <= len; e0 += NL) {
                __m256 r[NL];
                for (int j = 0; j < NL; ++j) {
                    const nvf x = src[j] ? IO::ldn(src[j] + e0) : nvf{};
                    std::memcpy(&r[j], &x, sizeof x);
                }
                transpose8(r);
                for (int i = 0; i < NL; ++i) _mm256_storeu_ps(reinterpret_cast<float*>(dst + (e0 + i) * BK + j0), r[i]);
            }
            for (; e0 < words; ++e0)
                for (int j = 0; j < NL; ++j) {
                    const float x = e0 < len && src[j] ? IO::ld(src[j] + e0) : 0.f;
                    std::memcpy(dst + e0 * BK + j0 + j, &x, 4);
                }
        }
        return;
    }
#endif
    std::fill(dst, dst + words * BK, 0u);
    for (int j = 0; j < nk; ++j) {
        const T* src = rows(j);
        if constexpr (Pairs) {
            for (int64_t e = 0; e + 1 < len; e += 2) std::memcpy(dst + (e / 2) * BK + j, src + e, 4);
            if (len % 2) dst[(len / 2) * BK + j] = src[len - 1];
        } else {
            for (int64_t e = 0; e < len; ++e) {
                const float x = IO::ld(src + e);
                std::memcpy(dst + e * BK + j, &x, 4);
            }
        }
    }
#endif
}

// Row-major, width (a multiple of W) elements per key, zero past len: floats dst[j * width + e]
// (keys j >= nk left as they are), or (Pairs) bf16 pairs of keys dst[(j / 2) * 2 width + 2e + j % 2]
// (zero past nk). V for P.V (and K for dS.K).
template <class IO, bool Pairs, class Rows>
void pack_rows(const Rows& rows, int nk, int64_t len, int64_t width, void* dst) {
    typedef typename IO::T T;
#if JS_PACK512
    if constexpr (Pairs) {
        alignas(64) static constexpr uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
        const __m512i idx = _mm512_load_si512(interleave);
        uint16_t* vd = static_cast<uint16_t*>(dst);
        for (int j = 0; j < BK; j += 2) {
            uint16_t* out = vd + (j / 2) * width * 2;
            if (j >= nk) {
                std::fill(out, vd + BK * width, static_cast<uint16_t>(0));
                break;
            }
            const T* a = rows(j);
            const T* c = j + 1 < nk ? rows(j + 1) : nullptr;
            for (int64_t e0 = 0; e0 < width; e0 += 16) {
                const __mmask16 mask = lanes16(static_cast<int>(std::clamp<int64_t>(len - e0, 0, 16)));
                const __m256i lo = mask ? _mm256_maskz_loadu_epi16(mask, a + e0) : _mm256_setzero_si256();
                const __m256i hi = mask && c ? _mm256_maskz_loadu_epi16(mask, c + e0) : _mm256_setzero_si256();
                _mm512_storeu_si512(out + 2 * e0, _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)));
            }
        }
    } else {
        float* vd = static_cast<float*>(dst);
        for (int j = 0; j < nk; ++j) {
            const T* src = rows(j);
            for (int64_t e0 = 0; e0 < width; e0 += 16) {
                const int n = static_cast<int>(std::clamp<int64_t>(len - e0, 0, 16));
                _mm512_storeu_si512(vd + j * width + e0, n ? row_words(IO{}, src + e0, n) : _mm512_setzero_si512());
            }
        }
    }
#else
    if constexpr (Pairs) {
        uint16_t* vd = static_cast<uint16_t*>(dst);
        std::fill(vd, vd + BK * width, static_cast<uint16_t>(0));
        for (int j = 0; j < nk; ++j) {
            const T* src = rows(j);
            for (int64_t e = 0; e < len; ++e) vd[(j / 2) * width * 2 + 2 * e + j % 2] = src[e];
        }
    } else {
        float* vd = static_cast<float*>(dst);
        for (int j = 0; j < nk; ++j) {
            const T* src = rows(j);
            int64_t e = 0;
            for (; e + NL <= len; e += NL) store_n(vd + j * width + e, IO::ldn(src + e));  // whole registers
            for (; e < len; ++e) vd[j * width + e] = IO::ld(src + e);
            for (; e < width; ++e) vd[j * width + e] = 0.f;
        }
    }
#endif
}

// Query rows per work item: p.q_chunk, within the cap above.
inline int64_t chunk_rows(const JsParams& p) {
    const int64_t cap = std::clamp<int64_t>(65536 / std::max<int64_t>({p.head_dim, p.head_dim_v, 1}) / 16 * 16, 64, QCHUNK);
    return std::clamp<int64_t>(p.q_chunk, 1, cap);
}

struct Item {
    int32_t b, h, row0, rows;
    int64_t cost;
};

// Visible keys [lo, hi) of the query row at aligned position pos of sequence b (len_k keys):
// always 0 <= lo <= hi <= len_k, so every loop over a range stays inside the sequence (a window
// that starts past the last key, a position before the first key, len_k = 0: an empty range).
// This is the one place a row's keys are derived (as positions.visible_keys does for MATH):
// causal, window and chunk (j // C == pos // C, floor division: a negative pos is in chunk -1,
// which holds no key) narrow it; a prefix row (pos < P_b) sees [0, max(hi, P_b)), since its other
// keys start at or below pos. Both ends are non-decreasing in pos, so a run of rows sees
// [lo(first), hi(last)). Written without overflow for any window or chunk up to INT64_MAX (pos is
// bounded by the lengths; a chunk start past 0 is at most pos, and then C <= pos).
inline void key_range(const JsParams& p, int64_t b, int64_t pos, int64_t len_k, int64_t* lo, int64_t* hi) {
    int64_t a = 0, e = len_k;
    if (p.causal) e = std::min(e, pos + 1);
    if (p.window_left >= 0 && pos > p.window_left) a = pos - p.window_left;
    if (p.window_right >= 0 && p.window_right < len_k - pos) e = std::min(e, pos + p.window_right + 1);
    if (p.chunk_size > 0) {
        const int64_t c = pos / p.chunk_size - (pos % p.chunk_size < 0 ? 1 : 0);  // floor
        const int64_t start = c * p.chunk_size;
        a = std::max(a, start);
        e = std::min(e, start + p.chunk_size);
    }
    if (p.prefix_lens && pos < p.prefix_lens[b]) {
        a = 0;
        e = std::max<int64_t>(e, p.prefix_lens[b]);
    }
    *lo = std::min(a, len_k);
    *hi = std::clamp(e, *lo, len_k);
}

// Word 0 of Philox4x32-10 (Random123; Triton's tl.philox) of counter (c0..c3) under key (k0, k1).
inline uint32_t philox_word0(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; ++round) {
        const uint64_t a = uint64_t{0xD2511F53u} * c0, b = uint64_t{0xCD9E8D57u} * c2;
        const uint32_t n0 = static_cast<uint32_t>(b >> 32) ^ c1 ^ k0;
        const uint32_t n2 = static_cast<uint32_t>(a >> 32) ^ c3 ^ k1;
        c1 = static_cast<uint32_t>(b);
        c3 = static_cast<uint32_t>(a);
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

// Z = keep / (1 - p) for keys j0 .. j0 + n of row i (head h, sequence b): keep iff Triton's
// uint_to_uniform_float of the word (as int32, ~x where negative, times 0x1.fffffep-32, the
// float32 of its 4.6566127342e-10) is >= p. Integer ops only: the compiler vectorizes the loop.
inline void dropout_scale(const JsParams& p, int64_t b, int64_t h, int64_t i, int64_t j0, int n, float* z) {
    const float kept = 1.f / (1.f - p.dropout_p), threshold = p.dropout_p;
    const uint32_t ci = static_cast<uint32_t>(i), ch = static_cast<uint32_t>(h), cb = static_cast<uint32_t>(b);
    for (int j = 0; j < n; ++j) {
        const uint32_t x = philox_word0(static_cast<uint32_t>(j0 + j), ci, ch, cb, p.dropout_seed, p.dropout_offset);
        const int32_t w = static_cast<int32_t>(x >= 0x80000000u ? ~x : x);
        z[j] = static_cast<float>(w) * 0x1.fffffep-32f >= threshold ? kept : 0.f;
    }
}

// Multiplies probabilities s[0 .. n) of keys j0 .. of row i (head h, sequence b) by their Z.
inline void apply_dropout(const JsParams& p, int64_t b, int64_t h, int64_t i, int64_t j0, int n, float* s) {
    alignas(64) float z[BK];
    for (int c = 0; c < n; c += BK) {
        const int m = std::min(BK, n - c);
        dropout_scale(p, b, h, i, j0 + c, m, z);
        for (int j = 0; j < m; ++j) s[c + j] *= z[j];
    }
}

// What a score row of key block [kb, kb + nk) needs beyond q.k: softcap, ALiBi, masks (-inf),
// and, for its probabilities, dropout (row i = pos - shift of sequence b, query head h).
struct RowRule {
    const JsParams& p;
    int64_t kb, len_k;
    int nk;
    float slope;
    int64_t b, h, shift;

    void apply(float* s, int64_t pos) const {
        if (p.softcap > 0.f)
            for (int j = 0; j < nk; ++j) s[j] = p.softcap * std::tanh(s[j] / p.softcap);
        if (p.slopes)
            for (int j = 0; j < nk; ++j) s[j] -= slope * static_cast<float>(std::llabs(pos - (kb + j)));
        int64_t lo, hi;
        key_range(p, b, pos, len_k, &lo, &hi);
        const int64_t jlo = std::clamp<int64_t>(lo - kb, 0, BK);
        const int64_t jhi = std::clamp<int64_t>(hi - kb, jlo, nk);
        for (int64_t j = 0; j < jlo; ++j) s[j] = -INFINITY;
        for (int64_t j = jhi; j < BK; ++j) s[j] = -INFINITY;
    }

    void drop(float* probs, int64_t pos) const { apply_dropout(p, b, h, pos - shift, kb, nk, probs); }
};

// S[RR rows][BK] = A[RR][d] . Bt[d][BK] (A rows lda apart): q.k^T, and dO.v^T in the backward.
// Kept out of line (like pv_tile): inlined into the softmax code its 24 accumulators were
// spilled, at half the speed.
#if JS_VEC_BYTES == 64
template <int RR>
__attribute__((noinline)) void qk_tile(const float* qp, int64_t lda, int64_t d, const float* kt, float* s) {
    vf acc[RR][4];
    for (int r = 0; r < RR; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = splat(0.f);
    for (int64_t e = 0; e < d; ++e) {
        const float* krow = kt + e * BK;
        const vf k0 = loadu(krow), k1 = loadu(krow + W), k2 = loadu(krow + 2 * W), k3 = loadu(krow + 3 * W);
        for (int r = 0; r < RR; ++r) {
            const vf qv = splat(qp[r * lda + e]);
            acc[r][0] += qv * k0;
            acc[r][1] += qv * k1;
            acc[r][2] += qv * k2;
            acc[r][3] += qv * k3;
        }
    }
    for (int r = 0; r < RR; ++r)
        for (int c = 0; c < 4; ++c) storeu(s + r * BK + c * W, acc[r][c]);
}

// O[RR rows][NV*W chunk] = alpha * O + P[RR][nk] . Vp[nk][chunk]
template <int RR, int NV>
__attribute__((noinline)) void pv_tile(const float* pb, const float* alpha, int nk, const float* vp, int64_t dvp,
                                       float* o) {
    vf acc[RR][NV];
    for (int r = 0; r < RR; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = loadu(o + r * dvp + c * W) * splat(alpha[r]);
    for (int j = 0; j < nk; ++j) {
        vf vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = loadu(vp + j * dvp + c * W);
        for (int r = 0; r < RR; ++r) {
            const vf pj = splat(pb[r * BK + j]);
            for (int c = 0; c < NV; ++c) acc[r][c] += pj * vv[c];
        }
    }
    for (int r = 0; r < RR; ++r)
        for (int c = 0; c < NV; ++c) storeu(o + r * dvp + c * W, acc[r][c]);
}
#else
// Narrower registers (AVX2: 16 ymm; NEON: 32 q): a vector is 2 (4) registers, so the tiles above
// would want 48 (96) accumulators and spill. Here a tile is RR rows x one vector of columns (RR x 16
// floats: 12 ymm accumulators for RR = 6, two loads of B and a broadcast a step, the shape of
// BLIS's Haswell sgemm kernel; 24 q registers on NEON), repeated over the column chunks; A's rows
// are re-read from L1 per chunk.
// The accumulators are arrays of native registers (a vf per row kept GCC's SRA from keeping them in
// registers across the loop: they went to the stack and back around every pass).

template <int RR>
__attribute__((noinline)) void qk_tile(const float* qp, int64_t lda, int64_t d, const float* kt, float* s) {
    for (int c = 0; c < BK / W; ++c) {
        nvf acc[RR][NP];
        for (int r = 0; r < RR; ++r)
            for (int i = 0; i < NP; ++i) acc[r][i] = nvf{};
        for (int64_t e = 0; e < d; ++e) {
            nvf k[NP];
            for (int i = 0; i < NP; ++i) k[i] = load_n(kt + e * BK + c * W + i * NL);
            for (int r = 0; r < RR; ++r) {
                const nvf qv = splat_n(qp[r * lda + e]);
                for (int i = 0; i < NP; ++i) acc[r][i] += qv * k[i];
            }
        }
        for (int r = 0; r < RR; ++r)
            for (int i = 0; i < NP; ++i) store_n(s + r * BK + c * W + i * NL, acc[r][i]);
    }
}

template <int RR, int NV>
__attribute__((noinline)) void pv_tile(const float* pb, const float* alpha, int nk, const float* vp, int64_t dvp,
                                       float* o) {
    for (int c = 0; c < NV; ++c) {
        nvf acc[RR][NP];
        for (int r = 0; r < RR; ++r)
            for (int i = 0; i < NP; ++i) acc[r][i] = load_n(o + r * dvp + c * W + i * NL) * splat_n(alpha[r]);
        for (int j = 0; j < nk; ++j) {
            nvf vv[NP];
            for (int i = 0; i < NP; ++i) vv[i] = load_n(vp + j * dvp + c * W + i * NL);
            for (int r = 0; r < RR; ++r) {
                const nvf pj = splat_n(pb[r * BK + j]);
                for (int i = 0; i < NP; ++i) acc[r][i] += pj * vv[i];
            }
        }
        for (int r = 0; r < RR; ++r)
            for (int i = 0; i < NP; ++i) store_n(o + r * dvp + c * W + i * NL, acc[r][i]);
    }
}
#endif

// Calls f(NV, c) over a row of `width` floats (a multiple of W) in chunks of at most 4 vectors:
// NV (a std::integral_constant) is the chunk's vector count, c its first column.
template <class F>
inline void column_chunks(int64_t width, F&& f) {
    int64_t c = 0;
    for (; c + 4 * W <= width; c += 4 * W) f(std::integral_constant<int, 4>{}, c);
    switch ((width - c) / W) {
        case 3: f(std::integral_constant<int, 3>{}, c); break;
        case 2: f(std::integral_constant<int, 2>{}, c); break;
        case 1: f(std::integral_constant<int, 1>{}, c); break;
        default: break;
    }
}

// Whether a block whose score max is bm adds nothing to a row: every score is -inf (masked, or
// -inf itself). The max comparisons skip NaN, so a row whose only visible scores are NaN also has
// bm = -inf: it is not skipped, and its NaN reaches l and O as in dense attention.
inline bool adds_nothing(float bm, const float* s, int n) {
    if (bm != -INFINITY) return false;
    for (int j = 0; j < n; ++j)
        if (s[j] != s[j]) return false;
    return true;
}

// Writes a row's result from its online-softmax state (o unnormalised, max m, sum l): l = 0 only
// when it saw no key (or only -inf scores): out exactly 0 (o may hold 0 * NaN from values other
// rows of its tile see), lse = sink (-inf without sinks). A NaN l or o (a NaN score or value it
// saw) stays NaN. A sink (docs/api.md section 11; -inf: none, which changes no bit) is one more logit with no
// value: max and sum take it in (not dropped: dropout scaled O only), so O shrinks and lse grows.
template <class IO>
inline void finish_row(const float* o, float m, float l, float sink, int64_t dv, typename IO::T* dst, float* lse) {
    const bool empty = l == 0.f;
    float inv = 1.f / l;
    if (!empty && sink != -INFINITY) {
        const float mn = std::max(m, sink);  // a NaN m stays NaN
        const float a = m == mn ? 1.f : std::exp(m - mn);
        l = l * a + (sink == mn ? 1.f : std::exp(sink - mn));  // exact at a sink of +inf: out 0, lse inf
        inv = a / l;
        m = mn;
    }
    for (int64_t e = 0; e < dv; ++e) dst[e] = IO::st(empty ? 0.f : o[e] * inv);
    if (lse) *lse = empty ? sink : m + std::log(l);
}

inline float sink_of(const JsParams& p, int64_t h) { return p.sinks ? p.sinks[h] : -INFINITY; }

// The online-softmax update of `rows` (<= W) rows of raw scores in pb (rows x BK), in place, for
// scores S = pre * raw: P = exp(S - m_new), l = alpha * l + sum(P), alpha = exp(m_old - m_new) per
// row (O is rescaled by the caller). plain: every row sees the whole block and no softcap/ALiBi
// applies (no per-score rule), so pre (> 0) rides in the exponent; otherwise the row is scaled first.
// The alphas are one vexp for all rows (a scalar exp per row cost ~5% of a bf16 call).
template <class IO>
inline void softmax_rows(int rows, float* pb, float* m, vf* lv, float* alpha, bool plain, const RowRule& rule,
                         int64_t pos0, float pre) {
    alignas(64) float m_old[W], m_new[W];
    vf sums[W];
    for (int r = 0; r < rows; ++r) {
        float* row = pb + r * BK;
        float f = pre;
        if (!plain || !(pre > 0.f)) {
            if (pre != 1.f)
                for (int c = 0; c < 4; ++c) storeu(row + c * W, loadu(row + c * W) * splat(pre));
            f = 1.f;
            if (!plain) rule.apply(row, pos0 + r);
        }
        const float bm = hmax(vmax(vmax(loadu(row), loadu(row + W)), vmax(loadu(row + 2 * W), loadu(row + 3 * W))));
        if (adds_nothing(bm, row, BK)) {  // the row sees no key of this block: alpha 1, P 0
            m_old[r] = m_new[r] = 0.f;
            sums[r] = splat(0.f);
            for (int c = 0; c < 4; ++c) storeu(row + c * W, splat(0.f));
            continue;
        }
        const float mn = std::max(m[r], bm * f);
        m_old[r] = m[r];  // -inf before the row's first key: alpha 0 (O and l are still 0)
        m_new[r] = m[r] = mn;
        const vf fv = splat(f), mv = splat(mn);
        vf sum = splat(0.f);
        for (int c = 0; c < 4; ++c) {
            const vf e = prob_exp<IO>(loadu(row + c * W) * fv - mv);
            storeu(row + c * W, e);
            sum += e;
        }
        sums[r] = sum;
    }
    for (int r = rows; r < W; ++r) m_old[r] = m_new[r] = 0.f;
    storeu(alpha, vexp(loadu(m_old) - loadu(m_new)));
    for (int r = 0; r < rows; ++r) lv[r] = lv[r] * splat(alpha[r]) + sums[r];
}

// One micro-tile: RR query rows against one packed key block: S = Q.K^T, the online-softmax
// update of (m, l), then O = alpha * O + P.V.
template <int RR>
void tile(const float* qp, int64_t d, const float* kt, const float* vp, int64_t dvp, float* o, float* m, vf* lv,
          bool plain, const RowRule& rule, int64_t pos0) {
    alignas(64) float pb[RR * BK];
    qk_tile<RR>(qp, d, d, kt, pb);
    alignas(64) float alpha[W];  // softmax_rows writes W
    softmax_rows<F32>(RR, pb, m, lv, alpha, plain, rule, pos0, 1.f);  // as float32 (fp16, and bf16 without bf16 dot products)
    if (rule.p.dropout_p > 0.f)  // l (above) sums the probabilities before dropout, O after
        for (int r = 0; r < RR; ++r) rule.drop(pb + r * BK, pos0 + r);
    column_chunks(dvp, [&](auto nv, int64_t c) {
        pv_tile<RR, decltype(nv)::value>(pb, alpha, rule.nk, vp + c, dvp, o + c);
    });
}

#if JS_BF16_DOT
// bf16 tiles: products of bf16 pairs summed in float32 (vdpbf16ps), twice the FMA rate. Packed
// K^T holds 32-bit words (k[j][2e], k[j][2e+1]) at [e][j]; packed V holds (v[2j][c], v[2j+1][c])
// at [j][c]; q rows stay as given (unscaled: S is scaled in float32), P is rounded to bf16 for
// P.V as flash attention does on GPUs.
inline vf as_vf(__m512 x) { vf r; std::memcpy(&r, &x, sizeof r); return r; }
inline __m512 as_m512(vf x) { __m512 r; std::memcpy(&r, &x, sizeof r); return r; }
inline __m512bh load_bh(const void* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh bcast_pair(const uint16_t* p) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
}

template <int RR>
__attribute__((noinline)) void qk_tile_bf16(const uint16_t* qb, int64_t ldq, int64_t pairs, const uint32_t* kt2,
                                            float scale, float* s) {
    __m512 acc[RR][4];
    for (int r = 0; r < RR; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t e = 0; e < pairs; ++e) {
        const uint32_t* krow = kt2 + e * BK;
        const __m512bh k0 = load_bh(krow), k1 = load_bh(krow + W), k2 = load_bh(krow + 2 * W), k3 = load_bh(krow + 3 * W);
        for (int r = 0; r < RR; ++r) {
            const __m512bh qw = bcast_pair(qb + r * ldq + 2 * e);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qw, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qw, k1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qw, k2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qw, k3);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < RR; ++r)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * BK + c * W, _mm512_mul_ps(acc[r][c], sc));
}

template <int RR, int NV>
__attribute__((noinline)) void pv_tile_bf16(const uint16_t* pbh, const float* alpha, int pairs, const uint16_t* vp2,
                                            int64_t dvp, float* o) {
    __m512 acc[RR][NV];
    for (int r = 0; r < RR; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dvp + c * W), _mm512_set1_ps(alpha[r]));
    for (int j = 0; j < pairs; ++j) {
        __m512bh vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = load_bh(vp2 + (j * dvp + c * W) * 2);
        for (int r = 0; r < RR; ++r) {
            const __m512bh pw = bcast_pair(pbh + r * BK + 2 * j);
            for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pw, vv[c]);
        }
    }
    for (int r = 0; r < RR; ++r)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * dvp + c * W, acc[r][c]);
}

// Rows of x (floats, BK per row) as bf16 rows (round to nearest even).
inline void bf16_rows(const float* x, int nrows, uint16_t* dst) {
    for (int r = 0; r < nrows; ++r)
        for (int c = 0; c < BK; c += 2 * W)
            _mm512_storeu_si512(dst + r * BK + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * BK + c + W),
                                                                               _mm512_loadu_ps(x + r * BK + c)));
}

// Rows (r0, r0 + 1) of x (floats, rows BK apart) as bf16 pairs dst[(r0 / 2) * 2 BK + 2j + r % 2]:
// the B operand of a product over rows. nrows even.
inline void bf16_row_pairs(const float* x, int nrows, uint16_t* dst) {
    alignas(64) static constexpr uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                             8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i idx = _mm512_load_si512(interleave);
    for (int r = 0; r < nrows; r += 2)
        for (int c = 0; c < BK; c += W) {
            const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * BK + c));
            const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + (r + 1) * BK + c));
            _mm512_storeu_si512(dst + r * BK + 2 * c, _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)));
        }
}

template <int RR>
void tile_bf16(const uint16_t* qb, int64_t ldq, int64_t pairs, const uint32_t* kt2, const uint16_t* vp2, int64_t dvp,
               float* o, float* m, vf* lv, bool plain, const RowRule& rule, int64_t pos0, float scale) {
    alignas(64) float pb[RR * BK];
    alignas(64) uint16_t pbh[RR * BK];
    qk_tile_bf16<RR>(qb, ldq, pairs, kt2, scale, pb);
    alignas(64) float alpha[W];  // softmax_rows writes W
    softmax_rows<BF16>(RR, pb, m, lv, alpha, plain, rule, pos0, 1.f);
    if (rule.p.dropout_p > 0.f)
        for (int r = 0; r < RR; ++r) rule.drop(pb + r * BK, pos0 + r);
    bf16_rows(pb, RR, pbh);
    const int vpairs = (rule.nk + 1) / 2;
    column_chunks(dvp, [&](auto nv, int64_t c) {
        pv_tile_bf16<RR, decltype(nv)::value>(pbh, alpha, vpairs, vp2 + 2 * c, dvp, o + c);
    });
}
#endif

#if JS_AMX
// AMX tiles: tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one (stored as 16 rows of 16
// bf16 pairs) into 16 x 16 float32, 16x the work of one vdpbf16ps. The packed layouts are the bf16
// tiles' own: K^T pairs [pair][key] (a B tile: 16 pairs x 16 keys, rows BK words apart), V pairs
// [key pair][column] (16 key pairs x 16 columns, rows dvp pairs apart), q rows and P rows as A
// tiles (16 rows x 32 elements). The head dim is padded with zeros to a multiple of 32.
// Linux hands out the tile state only on request (arch_prctl, once per process); refused (an old
// kernel, a sandbox), bf16 tiles stay on vdpbf16ps.
inline bool amx_ready() {
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
}
// Every tile 16 rows of 64 bytes; loaded per work item, released after it (a thread that holds
// tile state makes every context switch save it).
inline void amx_configure() {
    struct alignas(64) {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = TR;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

// C (16 x 16 nc floats, nc <= 4; rows ldc bytes apart) = [C +] sum over t < kt of A_t . B_t: A_t
// a 16 x 32 bf16 tile at a + t * a_step bytes (rows lda apart), B_(t, c) a tile of 16 rows of 16
// pairs at b + t * b_step + c * 64 bytes (rows ldb apart). Tiles 0-3 accumulate, 4 holds A, 5-7 B.
inline void amx_mm(int nc, int64_t kt, bool acc, const void* a, int64_t lda, int64_t a_step, const void* b, int64_t ldb,
                   int64_t b_step, float* c, int64_t ldc) {
    const char* ab = static_cast<const char*>(a);
    const char* bb = static_cast<const char*>(b);
    if (acc) {
        _tile_loadd(0, c, ldc);
        if (nc > 1) _tile_loadd(1, c + W, ldc);
        if (nc > 2) _tile_loadd(2, c + 2 * W, ldc);
        if (nc > 3) _tile_loadd(3, c + 3 * W, ldc);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t t = 0; t < kt; ++t) {
        const char* bt = bb + t * b_step;
        _tile_loadd(4, ab + t * a_step, lda);
        _tile_loadd(5, bt, ldb);
        _tile_dpbf16ps(0, 4, 5);
        if (nc > 1) {
            _tile_loadd(6, bt + 64, ldb);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (nc > 2) {
            _tile_loadd(7, bt + 128, ldb);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (nc > 3) {
            _tile_loadd(5, bt + 192, ldb);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, c, ldc);
    if (nc > 1) _tile_stored(1, c + W, ldc);
    if (nc > 2) _tile_stored(2, c + 2 * W, ldc);
    if (nc > 3) _tile_stored(3, c + 3 * W, ldc);
}

// One AMX micro-tile: rows (<= TR) query rows against one packed key block, as tile_bf16. qb has
// TR rows (those past `rows` zero), ldq elements apart; dchunks = padded head dim / 32.
void tile_amx(int rows, const uint16_t* qb, int64_t ldq, int64_t dchunks, const uint32_t* kt2, const uint16_t* vp2,
              int64_t dvp, float* o, float* m, vf* lv, bool plain, const RowRule& rule, int64_t pos0, float scale) {
    alignas(64) float pb[TR * BK];
    alignas(64) uint16_t pbh[TR * BK];
    alignas(64) float pv[TR * 4 * W];
    amx_mm(4, dchunks, false, qb, ldq * 2, 64, kt2, BK * 4, 16 * BK * 4, pb, BK * 4);
    alignas(64) float alpha[W];
    softmax_rows<BF16>(rows, pb, m, lv, alpha, plain, rule, pos0, scale);
    if (rule.p.dropout_p > 0.f)
        for (int r = 0; r < rows; ++r) rule.drop(pb + r * BK, pos0 + r);
    bf16_rows(pb, rows, pbh);
    std::fill(pbh + rows * BK, pbh + TR * BK, static_cast<uint16_t>(0));
    const int kchunks = (rule.nk + 31) / 32;  // keys past nk have P = 0 and zero V rows
    for (int64_t c0 = 0; c0 < dvp; c0 += 4 * W) {
        const int nc = static_cast<int>(std::min<int64_t>(4, (dvp - c0) / W));
        amx_mm(nc, kchunks, false, pbh, BK * 2, 64, vp2 + 2 * c0, dvp * 4, 16 * dvp * 4, pv, 4 * W * 4);
        for (int r = 0; r < rows; ++r) {
            const vf a = splat(alpha[r]);
            float* orow = o + r * dvp + c0;
            for (int c = 0; c < nc; ++c) storeu(orow + c * W, loadu(orow + c * W) * a + loadu(pv + r * 4 * W + c * W));
        }
    }
}
#endif

constexpr int DIRECT_KEYS = 256;  // most keys per step of a direct row (scratch size)
constexpr int64_t DIRECT_STEP_BYTES = 256 * 1024;  // most bytes of K (or V) per step of a direct row

// Direct rows multiply bf16 as pairs (vdpbf16ps, as the bf16 tiles): q as given, S = scale * q.k
// in float32, P rounded to bf16 for P.V. Otherwise q is float32, pre-scaled.
template <class IO>
constexpr bool direct_pairs = JS_BF16_DOT && JS_AVX512 && std::is_same<IO, BF16>::value;
template <class IO>
using DirectQ = std::conditional_t<direct_pairs<IO>, uint16_t, float>;
// Columns of a head's O in the scratch: whole vectors, or whole 32-column chunks for pairs.
template <class IO>
inline int64_t direct_width(int64_t dv) { return direct_pairs<IO> ? (dv + 2 * W - 1) / (2 * W) * (2 * W) : (dv + W - 1) / W * W; }

#if JS_AVX512
// The first n (<= 16) elements of a row as floats, zero past n: a masked load, or under
// AddressSanitizer (which does not see intrinsic loads) element by element, so that a read past a
// row is reported.
template <class IO>
inline __m512 direct_load(const typename IO::T* x, int n) {
#if JS_PACK512
    return _mm512_castsi512_ps(row_words(IO{}, x, n));
#else
    alignas(64) float t[W] = {};
    for (int i = 0; i < n; ++i) t[i] = IO::ld(x + i);
    return _mm512_load_ps(t);
#endif
}
// The first n (<= 32) bf16 elements of a row, zero past n (as direct_load).
inline __m512i direct_load_pairs(const uint16_t* x, int n) {
#if JS_PACK512
    return row_pairs(x, n);
#else
    alignas(64) uint16_t t[2 * W] = {};
    for (int i = 0; i < n; ++i) t[i] = x[i];
    return _mm512_load_si512(t);
#endif
}

// Lane j of the result: the sum of the lanes of a[j]. One transposing tree for 16 sums (45 shuffles
// and adds, where 16 hsums take 128); every lane gets the same order of adds (e with e + 8, then
// + 4, + 2, + 1), so a score's bits do not depend on its key's slot in a block.
inline __m512 sum16(const __m512* a) {
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; ++i)  // a[2i] lanes e + (e + 8) in the low half, a[2i + 1]'s in the high
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; ++i)  // 128-bit lane c: a[4i + c]'s four partials
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; ++i)
        v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xee));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xdd));
    // Lane 4c + m holds the sum of a[4m + c].
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}
#endif

#if !JS_AVX512
// Direct rows on narrower registers (AVX2, NEON, SSE) take a kv head's query heads together: each
// key and value row is loaded once for all the heads that share it (where a head at a time loaded
// it once per head). A (query, key) score is one chain of FMAs per register lane over the head dim
// in order, the lanes summed pairwise (lane_sums), then the scalar tail in order: the same bits
// whatever the pair's slot or the heads beside it, so the backward (direct_scores) recomputes the
// forward's scores exactly.

// out[i] = the lanes of a[i] summed as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) (with 4
// lanes: (x0 + x1) + (x2 + x3)), for i < N <= 8. With AVX, eight registers at once by a transposing
// tree of horizontal adds (the same order of adds in every lane). Always inlined: called, the
// accumulators went through memory.
inline __attribute__((always_inline)) float lane_tree(nvf x) {
    float t[NL];
    std::memcpy(t, &x, sizeof t);
    for (int w = 1; w < NL; w *= 2)
        for (int i = 0; i < NL; i += 2 * w) t[i] += t[i + w];
    return t[0];
}
template <int N>
inline __attribute__((always_inline)) void lane_sums(const nvf* a, float* out) {
#if JS_VEC_BYTES == 32 && defined(__AVX__)
    __m256 x[8];
    for (int i = 0; i < 8; ++i) x[i] = i < N ? static_cast<__m256>(a[i]) : _mm256_setzero_ps();
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
    const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    alignas(32) float t[8];
    _mm256_store_ps(t, r);
    for (int i = 0; i < N; ++i) out[i] = t[i];
#else
    for (int i = 0; i < N; ++i) out[i] = lane_tree(a[i]);
#endif
}

// c + a * b, one rounding where the target has FMAs, whatever the code around it: left to the
// compiler's contraction, group_scores<2, 1> and <1, 1> rounded one head's score differently (the
// backward's scores must be the forward's bit for bit).
inline __attribute__((always_inline)) nvf fma_n(nvf a, nvf b, nvf c) {
#if defined(__FMA__) && JS_VEC_BYTES == 32
    return reinterpret_cast<nvf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
#elif defined(__aarch64__)
    return vfmaq_f32(c, a, b);
#else
    return c + a * b;  // no FMA instruction to contract into
#endif
}
inline __attribute__((always_inline)) float fma_1(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
    return __builtin_fmaf(a, b, c);
#else
    return c + a * b;
#endif
}

// NL elements of a key or value row widened to float32. bf16 on AVX2: one zero-extending load and a
// shift (GCC's vector conversion took five instructions, more than the FMAs they feed).
template <class IO>
inline __attribute__((always_inline)) nvf row_ldn(const typename IO::T* p) {
#if JS_VEC_BYTES == 32 && defined(__AVX2__)
    if constexpr (std::is_same<IO, BF16>::value) {
        const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
        nvf r;
        std::memcpy(&r, &w, sizeof r);
        return r;
    }
#endif
    return IO::ldn(p);
}

// s[h * ls + j] = q_h . k_j for h < NH query rows (float32, pre-scaled, qd apart) and j < NK key
// rows kr[j] + off, NH * NK <= 8 accumulators: each key register is loaded once for the NH heads.
template <class IO, int NH, int NK>
inline void group_scores(const float* q, int64_t qd, const typename IO::T* const* rows, int64_t off, int64_t d, float* s,
                         int64_t ls) {
    static_assert(NH * NK <= 8, "eight accumulators at most");
    const typename IO::T* kr[NK];
    for (int j = 0; j < NK; ++j) kr[j] = rows[j] + off;
    nvf acc[NH * NK];
    for (int i = 0; i < NH * NK; ++i) acc[i] = nvf{};
    int64_t e = 0;
    for (; e + NL <= d; e += NL) {
        nvf kv[NK];
        for (int j = 0; j < NK; ++j) kv[j] = row_ldn<IO>(kr[j] + e);
        for (int h = 0; h < NH; ++h) {
            nvf qq;
            std::memcpy(&qq, q + h * qd + e, sizeof qq);
            for (int j = 0; j < NK; ++j) acc[h * NK + j] = fma_n(qq, kv[j], acc[h * NK + j]);
        }
    }
    float r[NH * NK];
    lane_sums<NH * NK>(acc, r);
    if (e == d) {  // no scalar tail (D a multiple of NL): its setup per score cost as much as the FMAs
        for (int h = 0; h < NH; ++h)
            for (int j = 0; j < NK; ++j) s[h * ls + j] = r[h * NK + j];
        return;
    }
    for (int h = 0; h < NH; ++h)
        for (int j = 0; j < NK; ++j) {
            float tail = 0.f;
            for (int64_t t = e; t < d; ++t) tail = fma_1(q[h * qd + t], IO::ld(kr[j] + t), tail);
            s[h * ls + j] = r[h * NK + j] + tail;
        }
}

// Prefetches every line of `bytes` of rows[i] for i in [i0, min(i1, n)). Direct rows read key
// rows in a walk the hardware prefetchers start late on (each step's rows, then its value rows,
// per kv head): a row read from DRAM stalled the products. Issued a block of rows at a time: a
// test and a call per key row cost as many instructions as the products of a D64 row.
inline void prefetch_rows(const void* const* rows, int i0, int i1, int n, int64_t bytes) {
    for (int i = i0; i < std::min(i1, n); ++i) {
        const char* r = static_cast<const char*>(rows[i]);
        for (int64_t e = 0; e < bytes; e += 64) __builtin_prefetch(r + e);
    }
}
// Scores of nh query heads (rows qd apart) against n key rows kr[j] + off: s[h * ls + j]. Heads go
// four at a time, keys as many as eight accumulators take.
template <class IO>
inline void group_scores_all(const float* q, int64_t qd, int nh, const typename IO::T* const* kr, int64_t off, int n,
                             int64_t d, float* s, int64_t ls) {
    for (int h0 = 0; h0 < nh; h0 += 4) {
        const float* qh = q + h0 * qd;
        float* sh = s + h0 * ls;
        auto run = [&](auto heads) {
            constexpr int NH = decltype(heads)::value, NK = 8 / NH;
            int j = 0;
            for (; j + NK <= n; j += NK) group_scores<IO, NH, NK>(qh, qd, kr + j, off, d, sh + j, ls);
            for (; j < n; ++j) group_scores<IO, NH, 1>(qh, qd, kr + j, off, d, sh + j, ls);
        };
        switch (std::min(4, nh - h0)) {
            case 4: run(std::integral_constant<int, 4>{}); break;
            case 3: run(std::integral_constant<int, 3>{}); break;
            case 2: run(std::integral_constant<int, 2>{}); break;
            default: run(std::integral_constant<int, 1>{}); break;
        }
    }
}

// Vectors of O group_pv keeps in registers (heads x columns): 4 (8 ymm; 16 q on NEON), 2 on SSE's
// 16 registers; its heads a pass, PV_HEADS, as many.
#if JS_VEC_BYTES == 16 && !defined(__ARM_NEON)
constexpr int PV_VECTORS = 2;
#else
constexpr int PV_VECTORS = 4;
#endif
constexpr int PV_HEADS = PV_VECTORS;

// O_h += sum_j P[h][j] V_j for h < NH heads (P rows ls apart, O rows dvo apart) over n value rows
// vr[j] + off: NV vectors of columns of every head at a time, so each value register is loaded once for
// the heads, in NH x NV (<= PV_VECTORS) vectors of accumulators: independent chains enough to hide
// the FMAs' latency (one head alone takes 64 columns a pass).
template <class IO, int NH>
inline void group_pv(const float* pr, int64_t ls, const typename IO::T* const* vr, int64_t off, int n, int64_t dv,
                     float* o, int64_t dvo) {
    constexpr int NV = PV_VECTORS / NH > 1 ? PV_VECTORS / NH : 1;
    int64_t c = 0;
    // Accumulators as one flat array of registers: an array of vf (struct vectors on narrower
    // registers) was stored back to the stack after every FMA (8 stores a key on AVX2).
    auto pass = [&](auto vectors) {
        constexpr int nv = decltype(vectors)::value, nr = nv * NP;
        nvf acc[NH * nr];
        for (int h = 0; h < NH; ++h)
            for (int u = 0; u < nr; ++u) std::memcpy(&acc[h * nr + u], o + h * dvo + c + u * NL, sizeof(nvf));
        for (int j = 0; j < n; ++j) {
            const typename IO::T* x = vr[j] + off + c;
            nvf xv[nr];
            for (int u = 0; u < nr; ++u) xv[u] = row_ldn<IO>(x + u * NL);
            for (int h = 0; h < NH; ++h) {
                const nvf pj = splat(pr[h * ls + j]).h[0];
                for (int u = 0; u < nr; ++u) acc[h * nr + u] = fma_n(pj, xv[u], acc[h * nr + u]);
            }
        }
        for (int h = 0; h < NH; ++h)
            for (int u = 0; u < nr; ++u) std::memcpy(o + h * dvo + c + u * NL, &acc[h * nr + u], sizeof(nvf));
        c += nv * W;
    };
    while (c + NV * W <= dv) pass(std::integral_constant<int, NV>{});
    while (c + W <= dv) pass(std::integral_constant<int, 1>{});
    for (; c < dv; ++c)
        for (int h = 0; h < NH; ++h) {
            float a = o[h * dvo + c];
            for (int j = 0; j < n; ++j) a += pr[h * ls + j] * IO::ld(vr[j] + off + c);
            o[h * dvo + c] = a;
        }
}

#endif

// Rows of keys kb .. kb + n of sequence b in x (token and block strides tok, blk; head offset off
// added): dst[i]. One division per call where key_offset takes one per key.
template <class T>
inline void key_run(const JsParams& p, int64_t b, int64_t kb, int n, const T* x, int64_t tok, int64_t blk, int64_t off,
                    const T** dst) {
    if (!p.block_table) {
        const T* r = x + (p.cu_k[b] + kb) * tok + off;
        for (int i = 0; i < n; ++i) dst[i] = r + i * tok;
        return;
    }
    const int64_t j = kb + (p.cache_leftpad ? p.cache_leftpad[b] : 0);
    const int32_t* table = p.block_table + b * p.bt_stride + j / p.block_size;
    int64_t in = j % p.block_size;
    for (int i = 0; i < n; ++table, in = 0) {
        const T* base = x + *table * blk + off;
        const int run = static_cast<int>(std::min<int64_t>(n - i, p.block_size - in));
        for (int t = 0; t < run; ++t) dst[i + t] = base + (in + t) * tok;
        i += run;
    }
}

// Raw scores of n <= 16 (query, key) pairs (rows qp[i], kp[i]): s[i] = q.k, scaled for pairs.
// The forward's direct rows and the backward of a direct sequence (its `scores`) both call this,
// so their scores agree bit for bit (a one-hot row of huge logits shows a 1-ulp difference in its
// gradients). With AVX-512: one chain of FMAs (vdpbf16ps) per pair over the head dim in order,
// masked at the tail, then sum16; the same bits whatever a pair's slot.
// OneQ: every qp[i] is qp[0] (one query row against n keys), loaded once per chunk.
template <class IO, bool OneQ = false>
inline void direct_scores(const DirectQ<IO>* const* qp, const typename IO::T* const* kp, int n, int64_t d, float scale,
                          float* s) {
#if JS_AVX512
    __m512 acc[W];
    for (int i = 0; i < W; ++i) acc[i] = _mm512_setzero_ps();
    if constexpr (direct_pairs<IO>) {
        for (int64_t e = 0; e < d; e += 2 * W) {
            const int ne = static_cast<int>(std::min<int64_t>(2 * W, d - e));
            const __m512i q0 = OneQ ? direct_load_pairs(qp[0] + e, ne) : _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int i = 0; i < W; ++i)
                if (i < n)
                    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)(OneQ ? q0 : direct_load_pairs(qp[i] + e, ne)),
                                              (__m512bh)direct_load_pairs(kp[i] + e, ne));
        }
        _mm512_mask_storeu_ps(s, lanes16(n), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    } else {
        for (int64_t e = 0; e < d; e += W) {
            const int ne = static_cast<int>(std::min<int64_t>(W, d - e));
            const __mmask16 mk = lanes16(ne);
            const __m512 q0 = OneQ ? _mm512_maskz_loadu_ps(mk, qp[0] + e) : _mm512_setzero_ps();
#pragma GCC unroll 16
            for (int i = 0; i < W; ++i)
                if (i < n)
                    acc[i] = _mm512_fmadd_ps(OneQ ? q0 : _mm512_maskz_loadu_ps(mk, qp[i] + e), direct_load<IO>(kp[i] + e, ne),
                                             acc[i]);
        }
        _mm512_mask_storeu_ps(s, lanes16(n), sum16(acc));
    }
#else
    // Narrower registers: group_scores, whose bits direct_group's scores share. One query row
    // (OneQ) against its keys as one head; otherwise pair by pair.
    (void)scale;
    if (OneQ) {
        group_scores_all<IO>(qp[0], 0, 1, kp, 0, n, d, s, 0);
        return;
    }
    for (int i = 0; i < n; ++i) group_scores<IO, 1, 1>(qp[i], 0, kp + i, 0, d, s + i, 0);
#endif
}

// The online softmax of one block of a decode row's scores sh[0, n) (room to np, a whole number of
// vectors), bm their max: updates the row's running max m and sum l, rescales its O (dvo columns)
// and turns sh into probabilities, zero past n. False, with sh zeroed, when every score is -inf
// (exp(-inf - -inf) would be NaN). Both decode-row walks (direct_row, direct_heads) use it.
template <class IO>
inline bool softmax_block(float* sh, int n, int np, float bm, float& m, float& l, float* o, int64_t dvo) {
    if (adds_nothing(bm, sh, n)) {
        std::fill(sh, sh + np, 0.f);
        return false;
    }
    const float mn = std::max(m, bm);
    const float alpha = std::exp(m - mn);
    m = mn;
    std::fill(sh + n, sh + np, -INFINITY);
    vf sum = splat(0.f);
    for (int j = 0; j < np; j += W) {
        const vf e = prob_exp<IO>(loadu(sh + j) - splat(mn));
        storeu(sh + j, e);
        sum += e;
    }
    std::fill(sh + n, sh + np, 0.f);  // exp(-inf - mn) is NaN where mn is -inf (a NaN row)
    l = l * alpha + hsum(sum);
    if (alpha != 1.f)
        for (int64_t e = 0; e < dvo; e += W) storeu(o + e, loadu(o + e) * splat(alpha));
    return true;
}

#if JS_AVX512
// O[dvo] += P[nb] . V[nb keys][dv] for a block of nb <= 16 keys (rows vr[j] + off). Pairs: P in
// bf16 (zero past nb, nb rounded up to even), V rows interleaved two by two, and each 32-column
// chunk of O in the column order of the unpacks (direct_unpermute restores it).
template <class IO>
inline void direct_pv(const float* ph, const uint16_t* pbh, const typename IO::T* const* vr, int64_t off, int nb,
                      int64_t dv, float* o) {
    if constexpr (direct_pairs<IO>) {
#if JS_BF16_DOT  // (direct_pairs: never taken without it, where bcast_pair is not declared)
        (void)ph;
        for (int64_t c = 0; c < dv; c += 4 * W) {  // 64 columns: two chunks of 32 (low and high pairs)
            const int nc = static_cast<int>(std::min<int64_t>(4 * W, dv - c));
            __m512 acc[4];
            for (int i = 0; i < 4; ++i) acc[i] = i / 2 * 2 * W < nc ? _mm512_loadu_ps(o + c + i * W) : _mm512_setzero_ps();
            for (int j = 0; j < nb; j += 2) {
                const __m512bh pw = bcast_pair(pbh + j);
#pragma GCC unroll 2
                for (int h = 0; h < 2; ++h) {
                    if (h * 2 * W >= nc) break;
                    const int ne = std::min(2 * W, nc - h * 2 * W);
                    const __m512i a = direct_load_pairs(vr[j] + off + c + h * 2 * W, ne);
                    const __m512i b = j + 1 < nb ? direct_load_pairs(vr[j + 1] + off + c + h * 2 * W, ne) : _mm512_setzero_si512();
                    acc[2 * h] = _mm512_dpbf16_ps(acc[2 * h], pw, (__m512bh)_mm512_unpacklo_epi16(a, b));
                    acc[2 * h + 1] = _mm512_dpbf16_ps(acc[2 * h + 1], pw, (__m512bh)_mm512_unpackhi_epi16(a, b));
                }
            }
            for (int i = 0; i < 4; ++i)
                if (i / 2 * 2 * W < nc) _mm512_storeu_ps(o + c + i * W, acc[i]);
        }
#endif
    } else {
        (void)pbh;
        for (int64_t c = 0; c < dv; c += 4 * W) {
            const int nc = static_cast<int>(std::min<int64_t>(4 * W, dv - c));
            __m512 acc[4];
            for (int i = 0; i < 4; ++i) acc[i] = i * W < nc ? _mm512_loadu_ps(o + c + i * W) : _mm512_setzero_ps();
            for (int j = 0; j < nb; ++j) {
                const __m512 pj = _mm512_set1_ps(ph[j]);
                const typename IO::T* x = vr[j] + off + c;
#pragma GCC unroll 4
                for (int i = 0; i < 4; ++i)
                    if (i * W < nc) acc[i] = _mm512_fmadd_ps(pj, direct_load<IO>(x + i * W, std::min(W, nc - i * W)), acc[i]);
            }
            for (int i = 0; i < 4; ++i)
                if (i * W < nc) _mm512_storeu_ps(o + c + i * W, acc[i]);
        }
    }
}

// Pairs: each 32-column chunk of o holds columns 0-3, 8-11, 16-19, 24-27 (unpacklo), then 4-7,
// 12-15, 20-23, 28-31 (unpackhi); back to column order, in place.
template <class IO>
inline void direct_unpermute(float* o, int64_t dvo) {
    if constexpr (direct_pairs<IO>) {
        alignas(64) float t[2 * W];
        for (int64_t c = 0; c < dvo; c += 2 * W) {
            for (int i = 0; i < 2 * W; ++i) t[i] = o[c + i];
            for (int i = 0; i < 2 * W; ++i) o[c + (i % W) / 4 * 8 + (i / W) * 4 + i % 4] = t[i];
        }
    } else {
        (void)o;
        (void)dvo;
    }
}

// A row attended on its own (decode: one query, or a few) with AVX-512 (narrower registers take
// direct_heads below), all heads at once: no packing, since
// nothing would reuse it; keys go in steps of DIRECT_KEYS with an online softmax per head (per
// head over a whole sequence, a strided walk ran at a third of the speed). In a step: scores, then
// P.V, in blocks of 16 keys, each taken head by head (16 scores in one sum16; O loaded and stored
// once per block; the rows of a GQA group's heads come from L1). Its visible keys are one range,
// so masks are bounds.
// Scratch: qv (Hq x D), s (Hq x DIRECT_KEYS), o (Hq x direct_width), m and l (Hq), pbh (Hq x
// DIRECT_KEYS, pairs: P in bf16).
template <class IO>
void direct_row(const JsParams& p, int64_t b, int64_t r, float* qv, float* s, float* o, float* m, float* l,
                uint16_t* pbh) {
    typedef typename IO::T T;
    constexpr bool pairs = direct_pairs<IO>;
    const T* k = static_cast<const T*>(p.k);
    const T* v = static_cast<const T*>(p.v);
    const int64_t d = p.head_dim, dv = p.head_dim_v, heads = p.heads_q, group = p.heads_q / p.heads_kv;
    const int64_t dvo = direct_width<IO>(dv);
    const int64_t row = p.cu_q[b] + r;
    const int64_t len_q = p.cu_q[b + 1] - p.cu_q[b];
    const int64_t len_k = key_count(p, b);
    const int64_t pos = r + (p.bottom_right ? len_k - len_q : 0);
    const float* slopes = p.slopes ? p.slopes + b * p.slopes_batch_stride : nullptr;
    typedef typename IO::QO QO;
    const typename QO::T* q = static_cast<const typename QO::T*>(p.q) + row * p.q_tok;
    for (int64_t h = 0; h < heads; ++h) {
        if (!pairs)
            for (int64_t e = 0; e < d; ++e) qv[h * d + e] = QO::ld(q + h * p.q_head + e) * p.scale;
        m[h] = -INFINITY;
        l[h] = 0.f;
    }
    auto q_of = [&](int64_t h) -> const DirectQ<IO>* {  // pairs: the bf16 row in place
        if constexpr (pairs)
            return q + h * p.q_head;
        else
            return qv + h * d;
    };
    std::fill(o, o + heads * dvo, 0.f);
    int64_t lo, hi;
    key_range(p, b, pos, len_k, &lo, &hi);
    // A step's K (then its V) over all kv heads stays within DIRECT_STEP_BYTES, so the memory-order
    // read below leaves it in L2 for the head-by-head blocks (32 heads x D128 decode, 32 keys a
    // step instead of 256: bf16 -20..35%, fp32 -25%; W4 unchanged).
    const int64_t key_bytes = p.heads_kv * std::max(d, dv) * static_cast<int64_t>(sizeof(T));
    const int64_t step = std::clamp<int64_t>(std::min<int64_t>(p.direct_keys, std::max<int64_t>(W, DIRECT_STEP_BYTES / key_bytes)),
                                             1, DIRECT_KEYS);
    // Blocks walk their rows head by head, which the hardware prefetchers follow poorly (the loads
    // stalled most of the time; software prefetches of the next block helped fp32 only). So each
    // step's K, then its V, is first read in memory order, one byte a line (kept: volatile), into
    // L2 (W4 on one thread: bf16 -35%, fp32 -15%; touching a block ahead as the blocks ran was slower).
    auto touch = [&](const T* x, int64_t tok, int64_t blk, int64_t hstride, int64_t len, int64_t j0, int64_t j1) {
        const int64_t bytes = len * sizeof(T);
        for (int64_t j = j0; j < j1; ++j) {
            const char* c = reinterpret_cast<const char*>(x + key_offset(p, b, j, tok, blk));
            for (int64_t g = 0; g < p.heads_kv; ++g, c += hstride * sizeof(T))
                for (int64_t e = 0; e < bytes; e += 64) (void)*reinterpret_cast<const volatile char*>(c + e);
        }
    };
    const T* rows[W];
    for (int64_t kb = lo; kb < hi; kb += step) {
        const int n = static_cast<int>(std::min<int64_t>(step, hi - kb));
        const int np = (n + W - 1) / W * W;  // scores and P padded to whole vectors
        touch(k, p.k_tok, p.k_block, p.k_head, d, kb, kb + n);
        for (int j0 = 0; j0 < n; j0 += W) {
            const int nb = std::min(W, n - j0);
            const DirectQ<IO>* qs[W];
            const T* ks[W];
            for (int j = 0; j < nb; ++j) rows[j] = k + key_offset(p, b, kb + j0 + j, p.k_tok, p.k_block);
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t off = (h / group) * p.k_head;
                for (int j = 0; j < nb; ++j) {
                    qs[j] = q_of(h);
                    ks[j] = rows[j] + off;
                }
                direct_scores<IO, true>(qs, ks, nb, d, p.scale, s + h * DIRECT_KEYS + j0);
            }
        }
        for (int64_t h = 0; h < heads; ++h) {
            float* sh = s + h * DIRECT_KEYS;
            if (p.softcap > 0.f)
                for (int j = 0; j < n; ++j) sh[j] = p.softcap * std::tanh(sh[j] / p.softcap);
            if (slopes)
                for (int j = 0; j < n; ++j) sh[j] -= slopes[h] * static_cast<float>(std::llabs(pos - (kb + j)));
            float bm = -INFINITY;
            for (int j = 0; j < n; ++j) bm = std::max(bm, sh[j]);
            if (softmax_block<IO>(sh, n, np, bm, m[h], l[h], o + h * dvo, dvo) && p.dropout_p > 0.f)
                apply_dropout(p, b, h, r, kb, n, sh);  // l sums P before dropout
#if JS_BF16_DOT
            if constexpr (pairs)  // P rounded to bf16 for P.V, as the bf16 tiles round it
                for (int j = 0; j < np; j += 2 * W)
                    _mm512_storeu_si512(pbh + h * DIRECT_KEYS + j,
                                        (__m512i)_mm512_cvtne2ps_pbh(j + W < np ? _mm512_loadu_ps(sh + j + W) : _mm512_setzero_ps(),
                                                                     _mm512_loadu_ps(sh + j)));
#endif
        }
        touch(v, p.v_tok, p.v_block, p.v_head, dv, kb, kb + n);
        for (int j0 = 0; j0 < n; j0 += W) {
            const int nb = std::min(W, n - j0);
            for (int j = 0; j < nb; ++j) rows[j] = v + key_offset(p, b, kb + j0 + j, p.v_tok, p.v_block);
            for (int64_t h = 0; h < heads; ++h)
                direct_pv<IO>(s + h * DIRECT_KEYS + j0, pbh + h * DIRECT_KEYS + j0, rows, (h / group) * p.v_head, nb, dv,
                              o + h * dvo);
        }
    }
    typename QO::T* out = static_cast<typename QO::T*>(p.out) + row * p.o_tok;
    for (int64_t h = 0; h < heads; ++h) {
        direct_unpermute<IO>(o + h * dvo, dvo);
        finish_row<QO>(o + h * dvo, m[h], l[h], sink_of(p, h), dv, out + h * p.o_head,
                       p.lse ? p.lse + h * p.lse_head + row * p.lse_tok : nullptr);
    }
}
#endif

#if !JS_AVX512
// The largest of s[0 .. n), skipping NaN (as std::max from -inf does): -inf when all are NaN or -inf.
inline float block_max(const float* s, int n) {
    vf vm = splat(-INFINITY);
    int j = 0;
    for (; j + W <= n; j += W) {
        const vf x = loadu(s + j);
        vm = select(x > vm, x, vm);
    }
    float bm = hmax(vm);
    for (; j < n; ++j) bm = std::max(bm, s[j]);
    return bm;
}

// Whether direct rows take each kv head as its own work item (direct_heads): where a kv head's keys
// lie apart from the other heads' (a dense cache, (B, Hkv, S, D)), so that an item reads one stretch
// of memory. Where a token's heads lie together (packed q/k/v, a paged cache), one item takes every
// kv head, key block by key block, and so reads each token's row of heads at once.
inline bool direct_per_kv_head(const JsParams& p) { return p.heads_kv > 1 && p.k_head >= p.k_tok && p.v_head >= p.v_tok; }

// A row attended on its own (decode: one query, or a few) on narrower registers: kv heads
// [g0, g1) and the query heads that share them, no packing (nothing would reuse it). Keys go in
// steps of p.direct_keys: their rows (one division a step, not a key), then, a block of keys at a
// time, each kv head's scores for all its query heads (group_scores: each key row loaded once for
// the group), the online softmax per head, then P.V the same way (group_pv: each value row loaded
// once for the group). Its visible keys are one range, so masks are bounds.
// Scratch: qv (Hq x D), s (Hq x DIRECT_KEYS), o (Hq x direct_width), m and l (Hq).
template <class IO>
void direct_heads(const JsParams& p, int64_t b, int64_t r, int64_t g0, int64_t g1, float* qv, float* s, float* o,
                  float* m, float* l) {
    typedef typename IO::T T;
    static_assert(!direct_pairs<IO>, "pairs are AVX-512 only");
    const T* k = static_cast<const T*>(p.k);
    const T* v = static_cast<const T*>(p.v);
    const int64_t d = p.head_dim, dv = p.head_dim_v, group = p.heads_q / p.heads_kv;
    const int64_t h0 = g0 * group, heads = (g1 - g0) * group;  // query heads h0 .. h0 + heads
    const int64_t dvo = direct_width<IO>(dv);
    const int64_t row = p.cu_q[b] + r;
    const int64_t len_q = p.cu_q[b + 1] - p.cu_q[b];
    const int64_t len_k = key_count(p, b);
    const int64_t pos = r + (p.bottom_right ? len_k - len_q : 0);
    const float* slopes = p.slopes ? p.slopes + b * p.slopes_batch_stride : nullptr;
    typedef typename IO::QO QO;
    const typename QO::T* q = static_cast<const typename QO::T*>(p.q) + row * p.q_tok;
    for (int64_t i = 0; i < heads; ++i) {
        for (int64_t e = 0; e < d; ++e) qv[i * d + e] = QO::ld(q + (h0 + i) * p.q_head + e) * p.scale;
        m[i] = -INFINITY;
        l[i] = 0.f;
    }
    std::fill(o, o + heads * dvo, 0.f);
    int64_t lo, hi;
    key_range(p, b, pos, len_k, &lo, &hi);
    const int64_t step = std::clamp<int64_t>(p.direct_keys, 1, DIRECT_KEYS);
    // Keys a block: 32 for one kv head (its O loaded and stored once per block and head; its rows'
    // prefetches, dist rows ahead, issued per block); 16 for several, so that a token's row of heads
    // is read at once.
    const int kblock = g1 - g0 == 1 ? 2 * W : W;
    // Row pointers (at kv head g0): this step's K rows, its V rows, the next step's K rows, walked in
    // that order with prefetches a few KB ahead of the loads (the hardware prefetchers start late on
    // rows of one head among others: a row read from DRAM stalled the products).
    const void* rows[3 * DIRECT_KEYS];
    const T** kr = reinterpret_cast<const T**>(rows);
    const int64_t span = std::max((g1 - g0 - 1) * p.k_head + d, (g1 - g0 - 1) * p.v_head + dv) * static_cast<int64_t>(sizeof(T));
    const int dist = static_cast<int>(std::clamp<int64_t>(4096 / std::max<int64_t>(span, 1), 2, 64));
    if (lo < hi) key_run(p, b, lo, static_cast<int>(std::min<int64_t>(step, hi - lo)), k, p.k_tok, p.k_block, g0 * p.k_head, kr);
    for (int64_t kb = lo; kb < hi; kb += step) {
        const int n = static_cast<int>(std::min<int64_t>(step, hi - kb));
        const int np = (n + W - 1) / W * W;  // scores and P padded to whole vectors
        const int next = static_cast<int>(std::clamp<int64_t>(hi - kb - n, 0, step));
        const T** vr = kr + n;
        key_run(p, b, kb, n, v, p.v_tok, p.v_block, g0 * p.v_head, vr);
        if (next) key_run(p, b, kb + n, next, k, p.k_tok, p.k_block, g0 * p.k_head, vr + n);
        if (kb == lo) prefetch_rows(rows, 0, dist, n, span);  // later steps': by the step before
        for (int j0 = 0; j0 < n; j0 += kblock) {
            const int nb = std::min(kblock, n - j0);
            prefetch_rows(rows, j0 + dist, j0 + nb + dist, 2 * n, span);
            for (int64_t g = g0; g < g1; ++g)
                group_scores_all<IO>(qv + (g - g0) * group * d, d, static_cast<int>(group), kr + j0, (g - g0) * p.k_head, nb,
                                     d, s + (g - g0) * group * DIRECT_KEYS + j0, DIRECT_KEYS);
        }
        for (int64_t i = 0; i < heads; ++i) {
            const int64_t h = h0 + i;
            float* sh = s + i * DIRECT_KEYS;
            if (p.softcap > 0.f)
                for (int j = 0; j < n; ++j) sh[j] = p.softcap * std::tanh(sh[j] / p.softcap);
            if (slopes)
                for (int j = 0; j < n; ++j) sh[j] -= slopes[h] * static_cast<float>(std::llabs(pos - (kb + j)));
            if (!softmax_block<IO>(sh, n, np, block_max(sh, n), m[i], l[i], o + i * dvo, dvo)) continue;
            if (p.dropout_p > 0.f) apply_dropout(p, b, h, r, kb, n, sh);  // l sums P before dropout
        }
        for (int j0 = 0; j0 < n; j0 += kblock) {
            const int nb = std::min(kblock, n - j0);
            prefetch_rows(rows + n, j0 + dist, j0 + nb + dist, n + next, span);
            for (int64_t i = 0, nh; i < heads; i += nh) {  // up to PV_HEADS query heads of one group
                nh = std::min<int64_t>(PV_HEADS, group - i % group);
                const int64_t off = (i / group) * p.v_head;
                const float* pr = s + i * DIRECT_KEYS + j0;
                float* oi = o + i * dvo;
                switch (nh) {
                    case 4: group_pv<IO, 4>(pr, DIRECT_KEYS, vr + j0, off, nb, dv, oi, dvo); break;
                    case 3: group_pv<IO, 3>(pr, DIRECT_KEYS, vr + j0, off, nb, dv, oi, dvo); break;
                    case 2: group_pv<IO, 2>(pr, DIRECT_KEYS, vr + j0, off, nb, dv, oi, dvo); break;
                    default: group_pv<IO, 1>(pr, DIRECT_KEYS, vr + j0, off, nb, dv, oi, dvo); break;
                }
            }
        }
        std::copy(vr + n, vr + n + next, kr);  // the next step's K rows
    }
    typename QO::T* out = static_cast<typename QO::T*>(p.out) + row * p.o_tok;
    for (int64_t i = 0; i < heads; ++i)
        finish_row<QO>(o + i * dvo, m[i], l[i], sink_of(p, h0 + i), dv, out + (h0 + i) * p.o_head,
                       p.lse ? p.lse + (h0 + i) * p.lse_head + row * p.lse_tok : nullptr);
}
#endif

// Per thread, sized for what its items need: a call of direct rows only (decoding) never
// allocates the tiled path's buffers.
struct Scratch {
    std::vector<float> q, kt, v, o, m, s, dl;
    std::vector<vf> l;
    std::vector<uint16_t> pbh;  // direct rows' P in bf16 (pairs)
    void fit_direct(int64_t d, int64_t dv, int64_t heads) {
        q.resize(std::max<size_t>(q.size(), heads * d));
        o.resize(std::max<size_t>(o.size(), heads * ((dv + 2 * W - 1) / (2 * W) * (2 * W))));  // >= direct_width
        pbh.resize(heads * DIRECT_KEYS);
        m.resize(std::max<size_t>(m.size(), heads));
        s.resize(heads * DIRECT_KEYS);
        dl.resize(heads);
    }
    std::vector<uint16_t> qb, vp2;  // bf16 tiles: q rows, V pairs
    std::vector<uint32_t> kt2;      // bf16 tiles: K^T pairs
    void fit_bf16(int64_t rows, int64_t pairs, int64_t dvp) {  // rows: a multiple of TR
        qb.resize(std::max<size_t>(qb.size(), rows * 2 * pairs));
        kt2.resize(pairs * BK);
        vp2.resize(BK * dvp);
    }
    void fit_tiled(int64_t rows, int64_t d, int64_t dvp) {
        q.resize(std::max<size_t>(q.size(), rows * d));
        o.resize(std::max<size_t>(o.size(), rows * dvp));
        m.resize(std::max<size_t>(m.size(), rows));
        kt.resize(d * BK);
        v.resize(BK * dvp);
        l.resize(std::max<size_t>(l.size(), rows));
    }
};

template <class IO>
void run_item(const JsParams& p, const Item& it, Scratch& w) {
    typedef typename IO::T T;
    if (it.h < 0) {  // direct rows: all heads (AVX-512), or kv head -h - 1 and its query heads
        w.fit_direct(p.head_dim, p.head_dim_v, p.heads_q);
        for (int r = 0; r < it.rows; ++r)
#if JS_AVX512
            direct_row<IO>(p, it.b, it.row0 + r, w.q.data(), w.s.data(), w.o.data(), w.m.data(), w.dl.data(),
                           w.pbh.data());
#else
        {
            const int64_t g0 = -1 - it.h, g1 = direct_per_kv_head(p) ? g0 + 1 : p.heads_kv;
            direct_heads<IO>(p, it.b, it.row0 + r, g0, g1, w.q.data(), w.s.data(), w.o.data(), w.m.data(), w.dl.data());
        }
#endif
        return;
    }
    typedef typename IO::QO QO;
    const typename QO::T* q = static_cast<const typename QO::T*>(p.q);
    typename QO::T* out = static_cast<typename QO::T*>(p.out);
    const int64_t d = p.head_dim, dv = p.head_dim_v, dvp = (dv + W - 1) / W * W;
    const int64_t hk = it.h / (p.heads_q / p.heads_kv);
    const int64_t q0 = p.cu_q[it.b] + it.row0;  // first packed query row of the item
    const int64_t len_q = p.cu_q[it.b + 1] - p.cu_q[it.b];
    const int64_t len_k = key_count(p, it.b);
    const int64_t pos0 = it.row0 + (p.bottom_right ? len_k - len_q : 0);  // aligned position of row 0
    const int rows = it.rows;
    const float slope = p.slopes ? p.slopes[it.b * p.slopes_batch_stride + it.h] : 0.f;
    const bool scored = p.softcap > 0.f || p.slopes;
    w.fit_tiled(rows, d, dvp);

    float* qp = w.q.data();
    float* kt = w.kt.data();
    float* vp = w.v.data();
    float* o = w.o.data();
    float* m = w.m.data();
    vf* lv = w.l.data();
    constexpr bool bf16_dot = JS_BF16_DOT && std::is_same<IO, BF16>::value;
#if JS_AMX
    const bool amx = bf16_dot && amx_ready();
#else
    constexpr bool amx = false;
#endif
    // bf16 tiles: q.k as pairs of elements; AMX tiles take them 16 pairs at a time.
    const int64_t pairs = amx ? (d + 31) / 32 * 16 : (d + 1) / 2;
    const int padded_rows = amx ? (rows + TR - 1) / TR * TR : rows;
    if (bf16_dot) w.fit_bf16(padded_rows, pairs, dvp);
    uint16_t* qb = w.qb.data();
    uint32_t* kt2 = w.kt2.data();
    uint16_t* vp2 = w.vp2.data();
    for (int r = 0; r < rows; ++r) {
        const typename QO::T* src = q + (q0 + r) * p.q_tok + it.h * p.q_head;
        if (bf16_dot) {
            std::memcpy(qb + r * 2 * pairs, src, d * sizeof(T));
            std::fill(qb + r * 2 * pairs + d, qb + (r + 1) * 2 * pairs, static_cast<uint16_t>(0));
        } else {
            for (int64_t e = 0; e < d; ++e) qp[r * d + e] = QO::ld(src + e) * p.scale;
        }
        m[r] = -INFINITY;
        lv[r] = splat(0.f);
    }
    if (bf16_dot) std::fill(qb + rows * 2 * pairs, qb + padded_rows * 2 * pairs, static_cast<uint16_t>(0));
#if JS_AMX
    if (amx) amx_configure();
#endif
    std::fill(o, o + rows * dvp, 0.f);

    int64_t lo_all, hi_first, lo_last, hi_all;
    key_range(p, it.b, pos0, len_k, &lo_all, &hi_first);
    key_range(p, it.b, pos0 + rows - 1, len_k, &lo_last, &hi_all);
    for (int64_t kb = lo_all; kb < hi_all; kb += BK) {
        const int nk = static_cast<int>(std::min<int64_t>(BK, hi_all - kb));
        // K^T (words x BK, zero past nk) and V (nk x dvp, zero past dv) of this block.
        if constexpr (bf16_dot) {
            pack_transposed<IO, true>(k_rows<T>(p, it.b, kb, hk), nk, d, pairs, kt2);
            pack_rows<IO, true>(v_rows<T>(p, it.b, kb, hk), nk, dv, dvp, vp2);
        } else {
            pack_transposed<IO, false>(k_rows<T>(p, it.b, kb, hk), nk, d, d, reinterpret_cast<uint32_t*>(kt));
            pack_rows<IO, false>(v_rows<T>(p, it.b, kb, hk), nk, dv, dvp, vp);
        }
        const RowRule rule{p, kb, len_k, nk, slope, it.b, it.h, pos0 - it.row0};
        const int tile_rows = amx ? TR : R;
        for (int r = 0; r < rows; r += tile_rows) {
            const int rr = std::min(tile_rows, rows - r);
            int64_t lo_f, hi_f, lo_l, hi_l;
            key_range(p, it.b, pos0 + r, len_k, &lo_f, &hi_f);
            key_range(p, it.b, pos0 + r + rr - 1, len_k, &lo_l, &hi_l);
            if (hi_l <= kb || lo_f >= kb + nk) continue;  // no row of the tile sees this block
            const bool plain = !scored && nk == BK && lo_l <= kb && hi_f >= kb + BK;
            float* const args_o = o + r * dvp;
#if JS_AMX
            if (amx) {
                tile_amx(rr, qb + r * 2 * pairs, 2 * pairs, pairs / 16, kt2, vp2, dvp, args_o, m + r, lv + r, plain, rule,
                         pos0 + r, p.scale);
                continue;
            }
#endif
#if JS_BF16_DOT
            if (bf16_dot) {
                switch (rr) {
#define JS_TILE(n) case n: tile_bf16<n>(qb + r * 2 * pairs, 2 * pairs, pairs, kt2, vp2, dvp, args_o, m + r, lv + r, plain, rule, pos0 + r, p.scale); break;
                    JS_TILE(6) JS_TILE(5) JS_TILE(4) JS_TILE(3) JS_TILE(2) JS_TILE(1)
#undef JS_TILE
                }
                continue;
            }
#endif
            switch (rr) {
#define JS_TILE(n) case n: tile<n>(qp + r * d, d, kt, vp, dvp, args_o, m + r, lv + r, plain, rule, pos0 + r); break;
                JS_TILE(6) JS_TILE(5) JS_TILE(4) JS_TILE(3) JS_TILE(2) JS_TILE(1)
#undef JS_TILE
            }
        }
    }

#if JS_AMX
    if (amx) _tile_release();
#endif
    for (int r = 0; r < rows; ++r)
        finish_row<QO>(o + r * dvp, m[r], hsum(lv[r]), sink_of(p, it.h), dv, out + (q0 + r) * p.o_tok + it.h * p.o_head,
                       p.lse ? p.lse + it.h * p.lse_head + (q0 + r) * p.lse_tok : nullptr);
}

// Orders work items longest first (dynamic scheduling then balances the threads: LPT) and
// returns the thread count: one when the whole call is under min_work (cost x head dim), where
// waking a second thread costs more than it saves.
template <class Work>
int schedule(std::vector<Work>& items, const JsParams& p, int64_t min_work) {
    std::stable_sort(items.begin(), items.end(), [](const Work& a, const Work& b) { return a.cost > b.cost; });
    int64_t total = 0;
    for (const Work& it : items) total += it.cost;
    if (total * p.head_dim < min_work || items.size() < 2) return 1;
    return std::max(1, p.threads);
}

template <class IO>
void run_all(const JsParams& p) {
    std::vector<Item> items;
    for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t len_q = p.cu_q[b + 1] - p.cu_q[b];
        const int64_t len_k = key_count(p, b);
        const int64_t shift = p.bottom_right ? len_k - len_q : 0;
        if (len_q <= p.direct_rows) {
            int64_t lo, hi;
            key_range(p, b, shift, len_k, &lo, &hi);
            // Narrower registers: an item per kv head where direct_heads takes them apart (which
            // also spreads one sequence's decode over threads).
#if JS_AVX512
            const int64_t parts = 1;
#else
            const int64_t parts = direct_per_kv_head(p) ? p.heads_kv : 1;
#endif
            for (int64_t g = 0; g < parts; ++g)
                items.push_back(Item{static_cast<int32_t>(b), static_cast<int32_t>(-1 - g), 0, static_cast<int32_t>(len_q),
                                     len_q * (p.heads_q / parts) * (hi - lo + 16)});
            continue;
        }
        const int64_t chunk = chunk_rows(p);
        for (int64_t r0 = 0; r0 < len_q; r0 += chunk) {
            const int rows = static_cast<int>(std::min<int64_t>(chunk, len_q - r0));
            int64_t lo1, hi1, lo2, hi2;
            key_range(p, b, r0 + shift, len_k, &lo1, &hi1);
            key_range(p, b, r0 + rows - 1 + shift, len_k, &lo2, &hi2);
            const int64_t keys = std::max(hi1, hi2) - std::min(lo1, lo2);
            for (int64_t h = 0; h < p.heads_q; ++h)
                items.push_back(Item{static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(r0), rows,
                                     rows * (keys + 16)});
        }
    }
    const int threads = schedule(items, p, int64_t(1) << 18);
    const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        // Kept per thread between calls (OpenMP's threads persist): a small call allocates nothing.
        static thread_local Scratch w;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) run_item<IO>(p, items[i], w);
    }
}

// ------------------------------------------------------------------------------------------
// Backward (FlashAttention-2 order, without atomics): a work item is one (sequence, kv head), so
// it owns its dK/dV rows outright and keeps dQ of its query heads in scratch. For each key block:
// for each of its query heads, for chunks of BQ_BWD rows, recompute S = Q.K^T and P = exp(S - lse),
// dP = dO.V^T, dS = P * (dP - delta) (times the softcap derivative); then dV += P^T.dO,
// dK += dS^T.Q (Q is pre-scaled) and dQ += dS.K (scaled at the end). With dropout, Z (the
// forward's mask, recomputed) gives dV += (P o Z)^T.dO and dS = P * (dP o Z - delta); delta =
// rowsum(dO o O) is unchanged (O is the dropped output). On AMX (bf16) the five products are tiles
// of 16 rows: dV and dK accumulate transposed (dV^T += dO^T.P over the chunk's rows, 32 at a time)
// and are transposed back once per key block. On vdpbf16ps (bf16, AVX512-BF16 without AMX) the
// same transposed layout in register tiles of R rows x BK keys (tacc_tile_bf16), S and dP on the
// forward's qk_tile_bf16, dQ on pv_tile_bf16: the backward of W5 (bf16) ran 1.5x faster than on
// float32 FMAs.
//
// A paged cache is read in place through the block table, and dK/dV are cache-shaped. Sequences
// may share cache blocks (prefix caching; a row may even list a block twice), so a block's dK/dV
// may have several contributions. A block read by one reference (sequence b, its idx-th block; the
// usual case) is written by the item that owns it, as packed keys are. Every reference to a block
// read more than once gets float32 accumulator rows of its own instead, and once every item is done
// each such block sums its references' rows in (b, idx) order and rounds once. So each float is
// written by one item and summed in a fixed order: the same bits whatever the thread count, with
// no atomics, and extra memory only for the shared blocks. The sinks' gradient is summed the same
// way: per (sequence, head) by the item that owns the rows, then over sequences in order.

constexpr int BQ_BWD = 64;  // query rows whose P and dS are kept for the transposed products
constexpr float kOnes[R] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f};  // pv_tile's alpha when nothing rescales

// Acc[RR keys][NV*W chunk] += X^T[RR keys][rows] . B[rows][chunk]: X is (rows x BK), keys j0..
#if JS_VEC_BYTES == 64
template <int RR, int NV>
__attribute__((noinline)) void tpv_tile(const float* x, int rows, int j0, const float* b, int64_t ldb, float* acc_out,
                                        int64_t ldo) {
    vf acc[RR][NV];
    for (int k = 0; k < RR; ++k)
        for (int c = 0; c < NV; ++c) acc[k][c] = loadu(acc_out + k * ldo + c * W);
    for (int r = 0; r < rows; ++r) {
        vf bb[NV];
        for (int c = 0; c < NV; ++c) bb[c] = loadu(b + r * ldb + c * W);
        for (int k = 0; k < RR; ++k) {
            const vf xk = splat(x[r * BK + j0 + k]);
            for (int c = 0; c < NV; ++c) acc[k][c] += xk * bb[c];
        }
    }
    for (int k = 0; k < RR; ++k)
        for (int c = 0; c < NV; ++c) storeu(acc_out + k * ldo + c * W, acc[k][c]);
}

#else
// As pv_tile: RR keys x one vector of columns a pass (12 ymm accumulators for RR = 6).
template <int RR, int NV>
__attribute__((noinline)) void tpv_tile(const float* x, int rows, int j0, const float* b, int64_t ldb, float* acc_out,
                                        int64_t ldo) {
    for (int c = 0; c < NV; ++c) {
        nvf acc[RR][NP];
        for (int k = 0; k < RR; ++k)
            for (int i = 0; i < NP; ++i) acc[k][i] = load_n(acc_out + k * ldo + c * W + i * NL);
        for (int r = 0; r < rows; ++r) {
            nvf bb[NP];
            for (int i = 0; i < NP; ++i) bb[i] = load_n(b + r * ldb + c * W + i * NL);
            for (int k = 0; k < RR; ++k) {
                const nvf xk = splat_n(x[r * BK + j0 + k]);
                for (int i = 0; i < NP; ++i) acc[k][i] += xk * bb[i];
            }
        }
        for (int k = 0; k < RR; ++k)
            for (int i = 0; i < NP; ++i) store_n(acc_out + k * ldo + c * W + i * NL, acc[k][i]);
    }
}
#endif

template <int RR>
void tpv_cols(const float* x, int rows, int j0, const float* b, int64_t ldb, float* acc_out, int64_t width) {
    column_chunks(width, [&](auto nv, int64_t c) {
        tpv_tile<RR, decltype(nv)::value>(x, rows, j0, b + c, ldb, acc_out + c, width);
    });
}

// Acc[nk keys][width] += X^T . B over rows (all widths are multiples of W, rows padded with 0).
void tpv(const float* x, int rows, int nk, const float* b, float* acc_out, int64_t width) {
    int j = 0;
    for (; j + R <= nk; j += R) tpv_cols<R>(x, rows, j, b, width, acc_out + j * width, width);
    switch (nk - j) {
        case 5: tpv_cols<5>(x, rows, j, b, width, acc_out + j * width, width); break;
        case 4: tpv_cols<4>(x, rows, j, b, width, acc_out + j * width, width); break;
        case 3: tpv_cols<3>(x, rows, j, b, width, acc_out + j * width, width); break;
        case 2: tpv_cols<2>(x, rows, j, b, width, acc_out + j * width, width); break;
        case 1: tpv_cols<1>(x, rows, j, b, width, acc_out + j * width, width); break;
        default: break;
    }
}

// O[RR rows][width] += X[RR][nk] . B[nk][width] (dQ += dS.K), in chunks of 4 vectors.
template <int RR>
void xb_rows(const float* x, int nk, const float* b, float* o, int64_t width) {
    column_chunks(width, [&](auto nv, int64_t c) {
        pv_tile<RR, decltype(nv)::value>(x, kOnes, nk, b + c, width, o + c);
    });
}

struct GradScratch {
    std::vector<float> q, dout, dq, lse, lse_lo, delta, kt, kr, vt, dk, dv, p, ds, raw;
    // bf16 products (fit_bf16): q and dO rows and transposed, K^T and V^T pairs, K pairs of rows,
    // P and dS as pairs of rows and dS as rows in bf16, dK^T and dV^T accumulators.
    std::vector<uint16_t> qb, dob, qT, doT, kp2, pvn, dsvn, ds16;
    std::vector<uint32_t> kt2, vt2;
    std::vector<float> dkT, dvT;
    void fit(int64_t rows, int64_t dp, int64_t dvp, bool bf16) {  // bf16: float32 q, dO and K^T unused
        if (!bf16) {
            q.assign(rows * dp, 0.f);
            dout.assign(rows * dvp, 0.f);
            kt.resize(dp * BK);
            vt.resize(dvp * BK);
            kr.resize(BK * dp);
        }
        dq.assign(rows * dp, 0.f);
        lse.resize(rows);
        lse_lo.resize(rows);
        delta.resize(rows);
        dk.resize(BK * dp);
        dv.resize(BK * dvp);
        p.resize(BQ_BWD * BK);
        ds.resize(BQ_BWD * BK);
        raw.resize(BQ_BWD * BK);
    }
    // bf16 products (AMX tiles, or vdpbf16ps without AMX): q and dO rows as given, qw and dow
    // elements apart (padded with zeros: to 32 for AMX tiles, to pairs for vdpbf16ps), and
    // transposed; K^T and V^T pairs, K pairs of rows, P and dS pairs of rows, dS rows, dK^T and dV^T
    // (dp, dvp rows: those past d, dv stay 0 for transpose_into).
    void fit_bf16(int64_t rows, int64_t dp, int64_t dvp, int64_t qw, int64_t dow) {
        qb.assign(rows * qw, 0);
        dob.assign(rows * dow, 0);
        qT.assign(dp * rows, 0);
        doT.assign(dvp * rows, 0);
        kt2.resize(qw / 2 * BK);
        vt2.resize(dow / 2 * BK);
        kp2.resize(BK * dp);
        pvn.resize(BQ_BWD * BK);
        dsvn.resize(BQ_BWD * BK);
        ds16.resize(BQ_BWD * BK);
        dkT.resize(dp * BK);
        dvT.resize(dvp * BK);
    }
};

#if JS_BF16_BWD
// dst[j * width + e] = scale * src[e * BK + j] for j < BK, e < width (a multiple of 16).
inline void transpose_into(const float* src, int64_t width, float scale, float* dst) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t e0 = 0; e0 < width; e0 += 16)
        for (int j0 = 0; j0 < BK; j0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (e0 + i) * BK + j0);
            transpose16(r);
            for (int i = 0; i < 16; ++i)
                _mm512_storeu_ps(dst + (j0 + i) * width + e0, _mm512_mul_ps(_mm512_castsi512_ps(r[i]), sc));
        }
}
#endif

#if JS_BF16_BWD
// The bf16 backward on vdpbf16ps (no AMX): S = Q.K^T and dP = dO.V^T are the forward's
// qk_tile_bf16 (S bit for bit the forward's), dQ += dS.K is pv_tile_bf16 over K as pairs of keys;
// dV and dK accumulate transposed, as on AMX, so that the sum over the chunk's rows is the pair
// dimension and each output row is one block of BK keys (R x 4 vectors, as the float32 tiles):
// C[RR][BK] += A[RR][n] . B[n][BK], A rows (dO^T, Q^T: bf16 over scratch rows, lda apart),
// B the chunk's P or dS as pairs of rows (bf16_row_pairs). An odd n ends on a half pair: A's
// element with a zero beside it (B's row n is zero), so nothing past the chunk's rows is read.
template <int RR>
__attribute__((noinline)) void tacc_tile_bf16(const uint16_t* a, int64_t lda, int n, const uint32_t* b2, float* c) {
    __m512 acc[RR][4];
    for (int r = 0; r < RR; ++r)
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_loadu_ps(c + r * BK + v * W);
    auto step = [&](const uint32_t* brow, auto&& a_word) {
        const __m512bh b0 = load_bh(brow), b1 = load_bh(brow + W), b2v = load_bh(brow + 2 * W), b3 = load_bh(brow + 3 * W);
        for (int r = 0; r < RR; ++r) {
            const __m512bh aw = a_word(r);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], aw, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], aw, b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], aw, b2v);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], aw, b3);
        }
    };
    const int pairs = n / 2;
    for (int e = 0; e < pairs; ++e) step(b2 + e * BK, [&](int r) { return bcast_pair(a + r * lda + 2 * e); });
    if (n % 2)
        step(b2 + pairs * BK, [&](int r) { return (__m512bh)_mm512_set1_epi32(a[r * lda + n - 1]); });
    for (int r = 0; r < RR; ++r)
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(c + r * BK + v * W, acc[r][v]);
}

// dst[c * rows + r] = src[r * ld + c] for r < rows, c < cols (bf16 scratch rows of at least cols
// elements): 16 rows by 32 columns a step, a word transpose then even and odd elements apart, with
// masked loads and stores (storing one element at a time, with stride rows, ran ~2% of a W5 call).
void transpose_bf16(const uint16_t* src, int64_t ld, int64_t rows, int64_t cols, uint16_t* dst) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int nr = static_cast<int>(std::min<int64_t>(16, rows - r0));
        const __mmask16 m = lanes16(nr);
        for (int64_t c0 = 0; c0 < cols; c0 += 32) {
            const int nc = static_cast<int>(std::min<int64_t>(32, cols - c0));
            __m512i r[16];
            for (int i = 0; i < 16; ++i) r[i] = i < nr ? row_pairs(src + (r0 + i) * ld + c0, nc) : _mm512_setzero_si512();
            transpose16(r);  // r[i]: elements c0 + 2i, c0 + 2i + 1 of the 16 rows
            for (int i = 0; 2 * i < nc; ++i) {
                _mm256_mask_storeu_epi16(dst + (c0 + 2 * i) * rows + r0, m, _mm512_cvtepi32_epi16(r[i]));
                if (2 * i + 1 < nc)
                    _mm256_mask_storeu_epi16(dst + (c0 + 2 * i + 1) * rows + r0, m,
                                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(r[i], 16)));
            }
        }
    }
}

// delta of the bf16 backward: dO_i . O_i summed exactly as qk_tile_bf16 sums dP = dO.V^T (one
// vdpbf16ps per pair of elements, from 0, in pair order), so that a one-hot row's dP - delta is
// exactly 0 as in row_deltas. Sixteen rows a vector, one per lane: 16 pairs of 16 rows read with
// masked loads and transposed (element-wise under AddressSanitizer, like packing).
void row_deltas_bf16(const JsGradParams& g, int64_t q0, int64_t n, int64_t h, float* delta) {
    const JsParams& p = g.f;
    const int64_t dv = p.head_dim_v, vpairs = (dv + 1) / 2;
    for (int64_t i0 = 0; i0 < n; i0 += W) {
        const int m = static_cast<int>(std::min<int64_t>(W, n - i0));
        __m512 acc = _mm512_setzero_ps();
#if JS_PACK512
        const uint16_t* os[W];
        const uint16_t* dos[W];
        for (int r = 0; r < m; ++r) {
            os[r] = static_cast<const uint16_t*>(p.out) + (q0 + i0 + r) * p.o_tok + h * p.o_head;
            dos[r] = static_cast<const uint16_t*>(g.dout) + (q0 + i0 + r) * g.do_tok + h * g.do_head;
        }
        for (int64_t e0 = 0; e0 < vpairs; e0 += W) {
            const int ne = static_cast<int>(std::min<int64_t>(32, dv - 2 * e0));
            __m512i a[W], o[W];
            for (int r = 0; r < W; ++r) {
                a[r] = r < m ? row_pairs(dos[r] + 2 * e0, ne) : _mm512_setzero_si512();
                o[r] = r < m ? row_pairs(os[r] + 2 * e0, ne) : _mm512_setzero_si512();
            }
            transpose16(a);  // a[i]: pair e0 + i of the 16 rows
            transpose16(o);
            for (int i = 0; i < std::min<int64_t>(W, vpairs - e0); ++i)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)a[i], (__m512bh)o[i]);
        }
#else
        for (int64_t e = 0; e < dv; e += 2) {
            alignas(64) uint16_t a[2 * W] = {}, o[2 * W] = {};
            for (int r = 0; r < m; ++r) {
                const int64_t row = q0 + i0 + r;
                const uint16_t* os = static_cast<const uint16_t*>(p.out) + row * p.o_tok + h * p.o_head;
                const uint16_t* dos = static_cast<const uint16_t*>(g.dout) + row * g.do_tok + h * g.do_head;
                a[2 * r] = dos[e];
                o[2 * r] = os[e];
                if (e + 1 < dv) {
                    a[2 * r + 1] = dos[e + 1];
                    o[2 * r + 1] = os[e + 1];
                }
            }
            acc = _mm512_dpbf16_ps(acc, load_bh(a), load_bh(o));
        }
#endif
        alignas(64) float out[W];
        _mm512_store_ps(out, acc);
        for (int r = 0; r < m; ++r) delta[i0 + r] = out[r];
    }
}
#endif

// Runs f<RR>(r) for RR = min(R, n - r) over r = 0, R, 2R, ... < n.
#define JS_FOR_TILES(n, CALL)                           \
    for (int r_ = 0; r_ < (n); r_ += R) {               \
        const int rr_ = std::min(R, (n) - r_);          \
        switch (rr_) {                                  \
            case 6: CALL(6, r_); break;                 \
            case 5: CALL(5, r_); break;                 \
            case 4: CALL(4, r_); break;                 \
            case 3: CALL(3, r_); break;                 \
            case 2: CALL(2, r_); break;                 \
            default: CALL(1, r_); break;                \
        }                                               \
    }

// The references of a paged call to its cache blocks, and accumulators for the shared ones.
struct SharedBlocks {
    int64_t block_size = 0, heads_kv = 0, d = 0, dv = 0;
    std::vector<int64_t> ref_base;  // (batch + 1,): sequence b's references are [ref_base[b], ref_base[b + 1])
    std::vector<int64_t> slot;      // per reference: its accumulator rows, or -1 (its block is read once)
    std::vector<int64_t> order;     // references of shared blocks, by (block, b, idx)
    std::vector<int64_t> group;     // shared block i's references: order[group[i], group[i + 1])
    std::vector<int64_t> block;     // shared block i's cache block
    std::vector<float> k, v;        // (slots, block_size, Hkv, D) and (slots, block_size, Hkv, Dv)

    // Sequences that contribute a gradient (queries and keys) reference their first
    // ceil(len_k / block_size) blocks; no other table entry is read.
    explicit SharedBlocks(const JsParams& p)
        : block_size(p.block_size), heads_kv(p.heads_kv), d(p.head_dim), dv(p.head_dim_v), ref_base(p.batch + 1, 0) {
        std::vector<int64_t> ids;
        for (int64_t b = 0; b < p.batch; ++b) {
            ref_base[b] = static_cast<int64_t>(ids.size());
            const int64_t len_k = key_count(p, b);
            if (p.cu_q[b + 1] == p.cu_q[b] || len_k == 0) continue;
            for (int64_t i = 0; i < (len_k + block_size - 1) / block_size; ++i)
                ids.push_back(p.block_table[b * p.bt_stride + i]);
        }
        ref_base[p.batch] = static_cast<int64_t>(ids.size());
        std::vector<int64_t> by_block(ids.size());
        for (size_t r = 0; r < ids.size(); ++r) by_block[r] = static_cast<int64_t>(r);
        std::stable_sort(by_block.begin(), by_block.end(), [&](int64_t a, int64_t c) { return ids[a] < ids[c]; });
        slot.assign(ids.size(), -1);
        int64_t slots = 0;
        for (size_t i = 0; i < by_block.size();) {
            size_t end = i + 1;
            while (end < by_block.size() && ids[by_block[end]] == ids[by_block[i]]) ++end;
            if (end - i > 1) {
                group.push_back(static_cast<int64_t>(order.size()));
                block.push_back(ids[by_block[i]]);
                for (size_t r = i; r < end; ++r) {
                    order.push_back(by_block[r]);
                    slot[by_block[r]] = slots++;
                }
            }
            i = end;
        }
        group.push_back(static_cast<int64_t>(order.size()));
        k.assign(slots * block_size * heads_kv * d, 0.f);
        v.assign(slots * block_size * heads_kv * dv, 0.f);
    }

    // Accumulator rows (dK, dV) of key j of sequence b, kv head hk; null when its block is read once.
    float* k_row(int64_t b, int64_t j, int64_t hk) {
        const int64_t s = slot[ref_base[b] + j / block_size];
        return s < 0 ? nullptr : k.data() + ((s * block_size + j % block_size) * heads_kv + hk) * d;
    }
    float* v_row(int64_t b, int64_t j, int64_t hk) {
        const int64_t s = slot[ref_base[b] + j / block_size];
        return v.data() + ((s * block_size + j % block_size) * heads_kv + hk) * dv;
    }

    // Sums every shared block's accumulators into the cache-shaped dK/dV, in (b, idx) order. Rows a
    // reference does not cover (past its sequence's keys) stay 0 and add nothing.
    template <class IO>
    void reduce(const JsGradParams& g, int threads) const {
        typedef typename IO::T T;
        const int64_t n = static_cast<int64_t>(block.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && n > 1)
        for (int64_t i = 0; i < n; ++i) {
            for (int64_t o = 0; o < block_size; ++o)
                for (int64_t hk = 0; hk < heads_kv; ++hk) {
                    T* dks = static_cast<T*>(g.dk) + block[i] * g.dk_block + o * g.dk_tok + hk * g.dk_head;
                    T* dvs = static_cast<T*>(g.dv) + block[i] * g.dv_block + o * g.dv_tok + hk * g.dv_head;
                    const int64_t row = o * heads_kv + hk;
                    for (int64_t e = 0; e < d; ++e) {
                        float sum = 0.f;
                        for (int64_t r = group[i]; r < group[i + 1]; ++r)
                            sum += k[(slot[order[r]] * block_size * heads_kv + row) * d + e];
                        dks[e] = IO::st(sum);
                    }
                    for (int64_t e = 0; e < dv; ++e) {
                        float sum = 0.f;
                        for (int64_t r = group[i]; r < group[i + 1]; ++r)
                            sum += v[(slot[order[r]] * block_size * heads_kv + row) * dv + e];
                        dvs[e] = IO::st(sum);
                    }
                }
        }
    }
};

// delta[i] = dO_i . O_i of query head h's rows q0 .. q0 + n, rounded exactly as dP = dO.V^T is
// (qk_tile: one FMA chain from 0 in e order; plain multiply-adds where the target has no FMA):
// in a row whose P is one-hot, O is that key's value row and dP - delta is exactly 0 (MATH's dS
// is exactly 0 there too). Eight rows' chains at a time: one chain alone waits on each FMA.
template <class IO>
void row_deltas(const JsGradParams& g, int64_t q0, int64_t n, int64_t h, float* delta) {
    typedef typename IO::T T;
    const JsParams& p = g.f;
    constexpr int G = 8;
    for (int64_t i0 = 0; i0 < n; i0 += G) {
        const int m = static_cast<int>(std::min<int64_t>(G, n - i0));
        const T* os[G];
        const T* dos[G];
        float acc[G];
        for (int r = 0; r < G; ++r) {  // rows past n repeat the last one (computed, not stored)
            const int64_t row = q0 + i0 + std::min(r, m - 1);
            os[r] = static_cast<const T*>(p.out) + row * p.o_tok + h * p.o_head;
            dos[r] = static_cast<const T*>(g.dout) + row * g.do_tok + h * g.do_head;
            acc[r] = 0.f;
        }
        for (int64_t e = 0; e < p.head_dim_v; ++e)
            for (int r = 0; r < G; ++r)
#if defined(__FMA__)
                acc[r] = std::fma(IO::ld(dos[r] + e), IO::ld(os[r] + e), acc[r]);
#else
                acc[r] += IO::ld(dos[r] + e) * IO::ld(os[r] + e);
#endif
        for (int r = 0; r < m; ++r) delta[i0 + r] = acc[r];
    }
}

// The float32 lse is off by up to half an ulp of |lse|, so P = exp(S - lse) is too, relatively:
// 2^-11 at |lse| ~ 1e4, where MATH's P is exact (a one-hot row's top key; dv 2e-3 off). For rows
// whose |lse| is at least LSE_EXACT this sums P over the row's keys once more, with the forward's
// scores (``scores``): the sum is exp(L - lse) for the L = m + log(l) the forward rounded, and its
// log goes to w.lse_lo, which the backward subtracts from S - lse (``pack_k`` packs a key block
// as ``scores`` reads it: the bf16 backward's scores are the forward's vdpbf16ps ones). That pass costs about a forward
// without P.V (+40% on a backward whose every row needs it). Below LSE_EXACT the rounding moves P
// by < 7.6e-6 (relative; the float32 gradient floor is 1e-4), and rows of ordinary logits (even
// attention sinks) never pay for it.
constexpr float LSE_EXACT = 256.f;

inline bool lse_inexact(float lse) { return std::fabs(lse) >= LSE_EXACT && !std::isinf(lse); }

template <class IO, class Pack, class Scores>
void lse_corrections(const JsGradParams& g, int64_t b, int64_t hk, int64_t lq, GradScratch& w, Pack&& pack_k,
                     Scores&& scores) {
    typedef typename IO::T T;
    const JsParams& p = g.f;
    const int64_t group = p.heads_q / p.heads_kv, len_q = p.cu_q[b + 1] - p.cu_q[b];
    const int64_t len_k = key_count(p, b), shift = p.bottom_right ? len_k - len_q : 0;
    bool any = false;
    for (int64_t row = 0; row < group * lq; ++row) any |= lse_inexact(w.lse[row]);
    if (!any) return;
    float* pb = w.p.data();
    for (int64_t kb = 0; kb < len_k; kb += BK) {
        const int nk = static_cast<int>(std::min<int64_t>(BK, len_k - kb));
        const KeyRows<T> krows = k_rows<T>(p, b, kb, hk);
        pack_k(krows, nk);
        for (int64_t gi = 0; gi < group; ++gi) {
            const int64_t h = hk * group + gi;
            const float slope = p.slopes ? p.slopes[b * p.slopes_batch_stride + h] : 0.f;
            const RowRule rule{p, kb, len_k, nk, slope, b, h, shift};
            for (int64_t c0 = 0; c0 < len_q; c0 += BQ_BWD) {
                const int n = static_cast<int>(std::min<int64_t>(BQ_BWD, len_q - c0));
                const int64_t base = gi * lq + c0;
                bool need = false;
                for (int r = 0; r < n; ++r) need |= lse_inexact(w.lse[base + r]);
                if (!need) continue;
                scores(base, n, krows, nk, pb);
                for (int r = 0; r < n; ++r) {
                    const float lse = w.lse[base + r];
                    if (!lse_inexact(lse)) continue;
                    float* srow = pb + r * BK;
                    rule.apply(srow, c0 + r + shift);
                    vf sum = splat(0.f);
                    for (int c = 0; c < BK / W; ++c) sum += prob_exp<IO>(loadu(srow + c * W) - splat(lse));
                    w.lse_lo[base + r] += hsum(sum);
                }
            }
        }
    }
    for (int64_t row = 0; row < group * lq; ++row)
        if (lse_inexact(w.lse[row])) w.lse_lo[row] = std::log(w.lse_lo[row]);
}

// sink_part (with sinks and g.dsinks): (batch, Hq) per-item sums of the sinks' gradient, added
// up in order once every item is done (grad_all).
template <class IO>
void grad_item(const JsGradParams& g, int64_t b, int64_t hk, GradScratch& w, SharedBlocks* shared,
               double* sink_part) {
    typedef typename IO::T T;
    const JsParams& p = g.f;
    const int64_t d = p.head_dim, dv = p.head_dim_v, dp = (d + W - 1) / W * W, dvp = (dv + W - 1) / W * W;
    const int64_t group = p.heads_q / p.heads_kv;
    const int64_t q0 = p.cu_q[b], len_q = p.cu_q[b + 1] - q0;
    const int64_t len_k = key_count(p, b);
    const int64_t shift = p.bottom_right ? len_k - len_q : 0;
    if (len_q == 0 || len_k == 0) return;
    // The forward ran this sequence as direct rows (run_all): recompute its scores the same way.
    const bool direct = len_q <= p.direct_rows;
#if JS_AMX
    const bool amx = std::is_same<IO, BF16>::value && amx_ready();
#else
    constexpr bool amx = false;
#endif
    // bf16 without AMX: the five products on vdpbf16ps (dot16).
    constexpr bool dot16_ok = JS_BF16_BWD && std::is_same<IO, BF16>::value;
    const bool dot16 = dot16_ok && !amx;
    static_assert(!dot16_ok || direct_pairs<IO>, "dot16 keeps no float32 q: direct scores read bf16 q in place");
    const int64_t pairs = (d + 1) / 2, vpairs = (dv + 1) / 2;  // dot16: q.k and dO.v as pairs
    // Scratch rows: query head gi's row i at gi * lq + i. AMX tiles sum over rows 32 at a time, so
    // there each head's rows are padded to a multiple of 32 with zero rows (lse +inf: P = 0).
    const int64_t lq = amx ? (len_q + 31) / 32 * 32 : len_q;
    const int64_t rows = group * lq;
    const int64_t dpad = (d + 31) / 32 * 32, dvpad = (dv + 31) / 32 * 32;  // AMX: 16 pairs per tile
    w.fit(rows, dp, dvp, amx || dot16);
    if (amx) w.fit_bf16(rows, dp, dvp, dpad, dvpad);
    if (dot16) w.fit_bf16(rows, dp, dvp, 2 * pairs, 2 * vpairs);  // direct scores read bf16 q in place (direct_pairs)
    for (int64_t gi = 0; gi < group; ++gi) {
        const int64_t h = hk * group + gi;
        for (int64_t i = 0; i < lq; ++i) {
            const int64_t row = gi * lq + i;
            if (i >= len_q) {  // AMX padding
                w.delta[row] = 0.f;
                w.lse[row] = INFINITY;
                w.lse_lo[row] = 0.f;
                continue;
            }
            const T* qs = static_cast<const T*>(p.q) + (q0 + i) * p.q_tok + h * p.q_head;
            const T* dos = static_cast<const T*>(g.dout) + (q0 + i) * g.do_tok + h * g.do_head;
            if (amx) {  // bf16 as given: q unscaled (S and dK are scaled in float32)
                std::memcpy(w.qb.data() + row * dpad, qs, d * sizeof(T));
                std::memcpy(w.dob.data() + row * dvpad, dos, dv * sizeof(T));
                for (int64_t e = 0; e < d; ++e) std::memcpy(&w.qT[e * rows + row], qs + e, 2);
                for (int64_t e = 0; e < dv; ++e) std::memcpy(&w.doT[e * rows + row], dos + e, 2);
            } else if (dot16) {  // bf16 as given, as the forward's tiles take q
                std::memcpy(w.qb.data() + row * 2 * pairs, qs, d * sizeof(T));
                std::memcpy(w.dob.data() + row * 2 * vpairs, dos, dv * sizeof(T));
            } else {
                for (int64_t e = 0; e < d; ++e) w.q[row * dp + e] = IO::ld(qs + e) * p.scale;
                for (int64_t e = 0; e < dv; ++e) w.dout[row * dvp + e] = IO::ld(dos + e);
            }
            const float l = p.lse[h * p.lse_head + (q0 + i) * p.lse_tok];
            w.lse[row] = l == -INFINITY ? INFINITY : l;  // a row that saw no key: P = exp(-inf) = 0
            w.lse_lo[row] = 0.f;
        }
#if JS_BF16_BWD
        if (dot16) {
            row_deltas_bf16(g, q0, len_q, h, w.delta.data() + gi * lq);
            continue;
        }
#endif
        row_deltas<IO>(g, q0, len_q, h, w.delta.data() + gi * lq);
    }
#if JS_BF16_BWD
    if (dot16) {  // Q^T and dO^T: the A operands of dK^T and dV^T
        transpose_bf16(w.qb.data(), 2 * pairs, rows, d, w.qT.data());
        transpose_bf16(w.dob.data(), 2 * vpairs, rows, dv, w.doT.data());
    }
#endif
    // K^T of a key block as the scores below read it (none for a direct sequence).
    auto pack_k = [&](const KeyRows<T>& krows, int nk) {
        if (direct) return;
        if constexpr (dot16_ok)
            if (dot16) return pack_transposed<IO, true>(krows, nk, d, pairs, w.kt2.data());
        pack_transposed<IO, false>(krows, nk, d, d, reinterpret_cast<uint32_t*>(w.kt.data()));
    };
    // S (unmasked) of scratch rows base .. base + n against key block kb, rounded as the forward
    // rounded it: direct_scores on the key rows for a direct sequence, else qk_tile on K^T packed in
    // w.kt (qk_tile_bf16 on K^T pairs in w.kt2 for dot16).
    auto scores = [&](int64_t base, int n, const KeyRows<T>& krows, int nk, float* pb) {
        if (direct) {  // direct_scores, as direct_row: pairs take the bf16 q rows in place
            for (int r = 0; r < n; ++r) {
                const int64_t row = base + r;
                const DirectQ<IO>* qr;
                if constexpr (direct_pairs<IO>)
                    qr = static_cast<const T*>(p.q) + (q0 + row % lq) * p.q_tok + (hk * group + row / lq) * p.q_head;
                else
                    qr = w.q.data() + row * dp;
                const DirectQ<IO>* qs[W];
                const T* ks[W];
                for (int j0 = 0; j0 < nk; j0 += W) {
                    const int nb = std::min(W, nk - j0);
                    for (int j = 0; j < nb; ++j) {
                        qs[j] = qr;
                        ks[j] = krows(j0 + j);
                    }
                    direct_scores<IO, true>(qs, ks, nb, d, p.scale, pb + r * BK + j0);
                }
                std::fill(pb + r * BK + nk, pb + (r + 1) * BK, 0.f);
            }
            return;
        }
#if JS_BF16_BWD
        if (dot16) {
#define JS_QK16(RR, r) qk_tile_bf16<RR>(w.qb.data() + (base + r) * 2 * pairs, 2 * pairs, pairs, w.kt2.data(), p.scale, pb + r * BK)
            JS_FOR_TILES(n, JS_QK16)
#undef JS_QK16
            return;
        }
#endif
#define JS_QK(RR, r) qk_tile<RR>(w.q.data() + (base + r) * dp, dp, d, w.kt.data(), pb + r * BK)
        JS_FOR_TILES(n, JS_QK)
#undef JS_QK
    };
    if (!amx) lse_corrections<IO>(g, b, hk, lq, w, pack_k, scores);
    // The sinks' gradient (docs/api.md section 11): the sink's share of row i is P_sink = exp(sink_h - lse_i)
    // (lse includes the sink, corrected like P below), and d lse_i / d sink_h = P_sink, so
    // dsink_h = -sum_i P_sink,i * delta_i (delta_i = dO_i . O_i). A row that saw no key has O = 0.
    if (sink_part)
        for (int64_t gi = 0; gi < group; ++gi) {
            const int64_t h = hk * group + gi;
            double sum = 0.0;
            for (int64_t i = 0; i < len_q; ++i) {
                const int64_t row = gi * lq + i;
                sum += static_cast<double>(std::exp((p.sinks[h] - w.lse[row]) - w.lse_lo[row])) * w.delta[row];
            }
            sink_part[b * p.heads_q + h] = sum;
        }
#if JS_AMX
    if (amx) amx_configure();
#endif
    for (int64_t kb = 0; kb < len_k; kb += BK) {
        const int nk = static_cast<int>(std::min<int64_t>(BK, len_k - kb));
        // Rows that see any key of this block: a contiguous range (both bounds are monotone).
        int64_t r_begin = len_q, r_end = 0;
        for (int64_t i = 0; i < len_q; ++i) {
            int64_t lo, hi;
            key_range(p, b, i + shift, len_k, &lo, &hi);
            if (hi > kb && lo < kb + nk && hi > lo) {
                r_begin = std::min(r_begin, i);
                r_end = i + 1;
            }
        }
        if (r_begin >= r_end) continue;  // dK/dV rows of this block stay 0
        // Rows in chunks of BQ_BWD from r_begin; AMX chunks start and end on multiples of 32 (the
        // rows added see none of these keys: P = 0).
        const int64_t c_begin = amx ? r_begin / 32 * 32 : r_begin, c_end = amx ? (r_end + 31) / 32 * 32 : r_end;
        const KeyRows<T> krows = k_rows<T>(p, b, kb, hk), vrows = v_rows<T>(p, b, kb, hk);
        if (amx) {  // K^T and V^T as pairs, K as pairs of rows; dK^T, dV^T accumulate
            pack_transposed<IO, true>(krows, nk, d, dpad / 2, w.kt2.data());
            pack_transposed<IO, true>(vrows, nk, dv, dvpad / 2, w.vt2.data());
            pack_rows<IO, true>(krows, nk, d, dp, w.kp2.data());
            std::fill(w.dkT.begin(), w.dkT.end(), 0.f);
            std::fill(w.dvT.begin(), w.dvT.end(), 0.f);
        } else if (dot16) {  // K^T and V^T pairs, K as pairs of keys; dK^T, dV^T accumulate
            pack_k(krows, nk);
            pack_transposed<IO, true>(vrows, nk, dv, vpairs, w.vt2.data());
            pack_rows<IO, true>(krows, nk, d, dp, w.kp2.data());
            std::fill(w.dkT.begin(), w.dkT.end(), 0.f);
            std::fill(w.dvT.begin(), w.dvT.end(), 0.f);
        } else {  // K^T, V^T and K rows (zero past nk)
            std::fill(w.kr.begin(), w.kr.end(), 0.f);
            pack_k(krows, nk);  // direct sequences' scores read the key rows in place (direct_scores)
            pack_transposed<IO, false>(vrows, nk, dv, dv, reinterpret_cast<uint32_t*>(w.vt.data()));
            pack_rows<IO, false>(krows, nk, d, dp, w.kr.data());
            std::fill(w.dk.begin(), w.dk.end(), 0.f);
            std::fill(w.dv.begin(), w.dv.end(), 0.f);
        }
        for (int64_t gi = 0; gi < group; ++gi) {
            const int64_t h = hk * group + gi;
            const float slope = p.slopes ? p.slopes[b * p.slopes_batch_stride + h] : 0.f;
            const RowRule rule{p, kb, len_k, nk, slope, b, h, shift};
            for (int64_t c0 = c_begin; c0 < c_end; c0 += BQ_BWD) {
                const int n = static_cast<int>(std::min<int64_t>(BQ_BWD, c_end - c0));
                const int64_t base = gi * lq + c0;  // scratch row of the chunk's first row
                float* pb = w.p.data();
                float* dsb = w.ds.data();
#if JS_AMX
                if (amx) {
                    for (int r = 0; r < n; r += TR) {  // S = Q.K^T (unscaled), dP = dO.V^T
                        amx_mm(4, dpad / 32, false, w.qb.data() + (base + r) * dpad, dpad * 2, 64, w.kt2.data(), BK * 4,
                               16 * BK * 4, pb + r * BK, BK * 4);
                        amx_mm(4, dvpad / 32, false, w.dob.data() + (base + r) * dvpad, dvpad * 2, 64, w.vt2.data(),
                               BK * 4, 16 * BK * 4, dsb + r * BK, BK * 4);
                    }
                    for (int r = 0; r < n; ++r)
                        for (int c = 0; c < BK; c += W) storeu(pb + r * BK + c, loadu(pb + r * BK + c) * splat(p.scale));
                }
#endif
#if JS_BF16_BWD
                if (dot16) {
                    scores(base, n, krows, nk, pb);
#define JS_DP16(RR, r) qk_tile_bf16<RR>(w.dob.data() + (base + r) * 2 * vpairs, 2 * vpairs, vpairs, w.vt2.data(), 1.f, dsb + r * BK)
                    JS_FOR_TILES(n, JS_DP16)
#undef JS_DP16
                }
#endif
                if (!amx && !dot16) {
                    scores(base, n, krows, nk, pb);
#define JS_DP(RR, r) qk_tile<RR>(w.dout.data() + (base + r) * dvp, dvp, dv, w.vt.data(), dsb + r * BK)
                    JS_FOR_TILES(n, JS_DP)
#undef JS_DP
                }
                for (int r = 0; r < n; ++r) {
                    float* srow = pb + r * BK;
                    float* dsrow = dsb + r * BK;
                    const int64_t pos = c0 + r + shift;
                    float* rawrow = w.raw.data() + r * BK;
                    if (p.softcap > 0.f) std::copy(srow, srow + BK, rawrow);
                    rule.apply(srow, pos);  // scores as the forward saw them; -inf where masked
                    const vf lse = splat(w.lse[base + r]), lse_lo = splat(w.lse_lo[base + r]);
                    const vf delta = splat(w.delta[base + r]);
                    if (p.dropout_p > 0.f) {
                        alignas(64) float z[BK] = {};
                        dropout_scale(p, b, h, c0 + r, kb, nk, z);
                        for (int c = 0; c < BK / W; ++c) {
                            const vf pr = prob_exp<IO>((loadu(srow + c * W) - lse) - lse_lo), zc = loadu(z + c * W);
                            storeu(srow + c * W, pr * zc);
                            storeu(dsrow + c * W, pr * (loadu(dsrow + c * W) * zc - delta));
                        }
                    } else {
                        for (int c = 0; c < BK / W; ++c) {
                            const vf pr = prob_exp<IO>((loadu(srow + c * W) - lse) - lse_lo);
                            storeu(srow + c * W, pr);
                            storeu(dsrow + c * W, pr * (loadu(dsrow + c * W) - delta));
                        }
                    }
                    if (p.softcap > 0.f)
                        for (int j = 0; j < nk; ++j) {
                            const float t = std::tanh(rawrow[j] / p.softcap);
                            dsrow[j] *= 1.f - t * t;
                        }
                    for (int j = nk; j < BK; ++j) srow[j] = dsrow[j] = 0.f;
                }
#if JS_AMX
                if (amx) {  // P and dS rounded to bf16, as flash attention's bf16 backward does
                    bf16_row_pairs(pb, n, w.pvn.data());
                    bf16_row_pairs(dsb, n, w.dsvn.data());
                    bf16_rows(dsb, n, w.ds16.data());
                    for (int64_t e = 0; e < dvp; e += 16)  // dV^T += dO^T.P
                        amx_mm(4, n / 32, true, w.doT.data() + e * rows + base, rows * 2, 64, w.pvn.data(), BK * 4,
                               16 * BK * 4, w.dvT.data() + e * BK, BK * 4);
                    for (int64_t e = 0; e < dp; e += 16)  // dK^T += Q^T.dS (unscaled)
                        amx_mm(4, n / 32, true, w.qT.data() + e * rows + base, rows * 2, 64, w.dsvn.data(), BK * 4,
                               16 * BK * 4, w.dkT.data() + e * BK, BK * 4);
                    for (int r = 0; r < n; r += TR)  // dQ += dS.K
                        for (int64_t c = 0; c < dp; c += 4 * W)
                            amx_mm(static_cast<int>(std::min<int64_t>(4, (dp - c) / W)), BK / 32, true, w.ds16.data() + r * BK,
                                   BK * 2, 64, w.kp2.data() + 2 * c, dp * 4, 16 * dp * 4, w.dq.data() + (base + r) * dp + c,
                                   dp * 4);
                    continue;
                }
#endif
#if JS_BF16_BWD
                if (dot16) {  // P and dS rounded to bf16 for their products, as on AMX
                    if (n % 2) {  // the half pair's zero row
                        std::fill(pb + n * BK, pb + (n + 1) * BK, 0.f);
                        std::fill(dsb + n * BK, dsb + (n + 1) * BK, 0.f);
                    }
                    bf16_row_pairs(pb, n + n % 2, w.pvn.data());
                    bf16_row_pairs(dsb, n + n % 2, w.dsvn.data());
                    bf16_rows(dsb, n, w.ds16.data());
#define JS_DV16(RR, e) tacc_tile_bf16<RR>(w.doT.data() + (e) * rows + base, rows, n, reinterpret_cast<const uint32_t*>(w.pvn.data()), w.dvT.data() + (e) * BK)
                    JS_FOR_TILES(static_cast<int>(dv), JS_DV16)  // dV^T += dO^T.P
#undef JS_DV16
#define JS_DK16(RR, e) tacc_tile_bf16<RR>(w.qT.data() + (e) * rows + base, rows, n, reinterpret_cast<const uint32_t*>(w.dsvn.data()), w.dkT.data() + (e) * BK)
                    JS_FOR_TILES(static_cast<int>(d), JS_DK16)  // dK^T += Q^T.dS (unscaled)
#undef JS_DK16
                    const int kpairs = (nk + 1) / 2;  // dS is 0 past nk, K pairs are 0 past nk
#define JS_DQ16(RR, r)                                                                                             \
    column_chunks(dp, [&](auto nv, int64_t c) {                                                                   \
        pv_tile_bf16<RR, decltype(nv)::value>(w.ds16.data() + (r) * BK, kOnes, kpairs, w.kp2.data() + 2 * c, dp,  \
                                              w.dq.data() + (base + (r)) * dp + c);                                \
    })
                    JS_FOR_TILES(n, JS_DQ16)  // dQ += dS.K
#undef JS_DQ16
                    continue;
                }
#endif
                tpv(pb, n, nk, w.dout.data() + base * dvp, w.dv.data(), dvp);
                tpv(dsb, n, nk, w.q.data() + base * dp, w.dk.data(), dp);
#define JS_DQ(RR, r) xb_rows<RR>(dsb + r * BK, nk, w.kr.data(), w.dq.data() + (base + r) * dp, dp)
                JS_FOR_TILES(n, JS_DQ)
#undef JS_DQ
            }
        }
#if JS_BF16_BWD
        if (amx || dot16) {  // dK^T (scaled) and dV^T into key rows
            transpose_into(w.dkT.data(), dp, p.scale, w.dk.data());
            transpose_into(w.dvT.data(), dvp, 1.f, w.dv.data());
        }
#endif
        for (int j = 0; j < nk; ++j) {
            if (float* ak = shared ? shared->k_row(b, kb + j, hk) : nullptr) {  // a shared cache block
                std::copy(w.dk.data() + j * dp, w.dk.data() + j * dp + d, ak);
                std::copy(w.dv.data() + j * dvp, w.dv.data() + j * dvp + dv, shared->v_row(b, kb + j, hk));
                continue;
            }
            T* dks = static_cast<T*>(g.dk) + key_offset(p, b, kb + j, g.dk_tok, g.dk_block) + hk * g.dk_head;
            T* dvs = static_cast<T*>(g.dv) + key_offset(p, b, kb + j, g.dv_tok, g.dv_block) + hk * g.dv_head;
            for (int64_t e = 0; e < d; ++e) dks[e] = IO::st(w.dk[j * dp + e]);
            for (int64_t e = 0; e < dv; ++e) dvs[e] = IO::st(w.dv[j * dvp + e]);
        }
    }
#if JS_AMX
    if (amx) _tile_release();
#endif
    for (int64_t gi = 0; gi < group; ++gi) {
        const int64_t h = hk * group + gi;
        for (int64_t i = 0; i < len_q; ++i) {
            T* dqs = static_cast<T*>(g.dq) + (q0 + i) * g.dq_tok + h * g.dq_head;
            const float* src = w.dq.data() + (gi * lq + i) * dp;
            for (int64_t e = 0; e < d; ++e) dqs[e] = IO::st(src[e] * p.scale);
        }
    }
}

template <class IO>
void grad_all(const JsGradParams& g) {
    const JsParams& p = g.f;
    struct Work {
        int64_t b, hk, cost;
    };
    std::vector<Work> items;
    for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t len_q = p.cu_q[b + 1] - p.cu_q[b];
        if (len_q == 0 || key_count(p, b) == 0) continue;
        for (int64_t hk = 0; hk < p.heads_kv; ++hk) items.push_back(Work{b, hk, len_q * (key_count(p, b) + 16)});
    }
    const int threads = schedule(items, p, int64_t(1) << 17);
    const int64_t n = static_cast<int64_t>(items.size());
    std::unique_ptr<SharedBlocks> shared;
    if (p.block_table) {
        shared = std::make_unique<SharedBlocks>(p);
        if (shared->block.empty()) shared.reset();  // every block read once: written in place
    }
    // The sinks' gradient: one partial sum per (sequence, head), summed in sequence order below,
    // so its bits do not depend on the thread count (items with no query or no key add 0).
    std::vector<double> sink_part(g.dsinks && p.sinks ? p.batch * p.heads_q : 0, 0.0);
    double* const parts = sink_part.empty() ? nullptr : sink_part.data();
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        GradScratch w;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) grad_item<IO>(g, items[i].b, items[i].hk, w, shared.get(), parts);
    }
    if (shared) shared->reduce<IO>(g, std::max(1, p.threads));
    if (g.dsinks)
        for (int64_t h = 0; h < p.heads_q; ++h) {
            double sum = 0.0;
            for (int64_t b = 0; parts && b < p.batch; ++b) sum += parts[b * p.heads_q + h];
            g.dsinks[h] = static_cast<float>(-sum);
        }
}

// 0 when the parameters are usable; 1 bad heads, 4 dropout_p outside [0, 1), 5 a negative
// chunk_size (2 bad dtype and 3 paged backward come from the entry points).
int check(const JsParams& p) {
    if (p.heads_kv <= 0 || p.heads_q % p.heads_kv) return 1;
    if (!(p.dropout_p >= 0.f && p.dropout_p < 1.f)) return 4;
    if (p.chunk_size < 0) return 5;
    return 0;
}

}  // namespace

extern "C" int js_attention_forward(const JsParams* p) {
    if (const int bad = check(*p)) return bad;
    switch (p->dtype) {
        case 0: run_all<F32>(*p); return 0;
        case 1: run_all<F16>(*p); return 0;
        case 2: run_all<BF16>(*p); return 0;
        case 3: run_all<E4M3>(*p); return 0;
        case 4: run_all<E5M2>(*p); return 0;
        default: return 2;
    }
}

extern "C" int js_attention_backward(const JsGradParams* g) {
    if (const int bad = check(g->f)) return bad;
    switch (g->f.dtype) {
        case 0: grad_all<F32>(*g); return 0;
        case 1: grad_all<F16>(*g); return 0;
        case 2: grad_all<BF16>(*g); return 0;
        default: return 2;
    }
}

extern "C" int js_abi_version() { return 10; }

// What bf16 tiles run on in this process, forward and backward: 2 AMX (tdpbf16ps), 1 AVX512-BF16
// (vdpbf16ps), 0 float32 FMAs on widened values. Tests and the benchmark read it.
extern "C" int js_bf16_tiles() {
#if JS_AMX
    if (amx_ready()) return 2;
#endif
    return JS_BF16_DOT;
}

// The float32 micro-tile this build multiplies with (query rows x columns a pass, in registers of
// the build's width): bench_cpu.py prints it per row beside the instruction set.
extern "C" const char* js_tile_shape() {
#if JS_VEC_BYTES == 64
    return "AVX-512: 6 rows x 64 columns (24 zmm accumulators)";
#elif defined(__AVX2__) && defined(__FMA__)
    return "AVX2+FMA: 6 rows x 16 columns (12 ymm accumulators)";
#elif defined(__AVX__)
    return "AVX: 6 rows x 16 columns (12 ymm accumulators, no FMA)";
#elif defined(__ARM_NEON)
    return "NEON: 6 rows x 16 columns (24 q accumulators)";
#else
    return "128-bit vectors: 6 rows x 16 columns (24 accumulators)";
#endif
}

// The instruction sets the compiler was allowed to use here (-march), named as in /proc/cpuinfo:
// native.py refuses to load a library whose target this CPU cannot run, and reports the list.
extern "C" const char* js_build_isa() {
    return ""
#if defined(__SSE4_2__)
        " sse4_2"
#endif
#if defined(__POPCNT__)
        " popcnt"
#endif
#if defined(__SSE4A__)
        " sse4a"
#endif
#if defined(__AVX__)
        " avx"
#endif
#if defined(__AVX2__)
        " avx2"
#endif
#if defined(__FMA__)
        " fma"
#endif
#if defined(__FMA4__)
        " fma4"
#endif
#if defined(__F16C__)
        " f16c"
#endif
#if defined(__BMI__)
        " bmi1"
#endif
#if defined(__BMI2__)
        " bmi2"
#endif
#if defined(__AVX512F__)
        " avx512f"
#endif
#if defined(__ARM_NEON)
        " asimd"
#endif
#if defined(__AVX512DQ__)
        " avx512dq"
#endif
#if defined(__AVX512CD__)
        " avx512cd"
#endif
#if defined(__AVX512BW__)
        " avx512bw"
#endif
#if defined(__AVX512VL__)
        " avx512vl"
#endif
#if defined(__AVX512VNNI__)
        " avx512_vnni"
#endif
#if defined(__AVX512VBMI__)
        " avx512vbmi"
#endif
#if defined(__AVX512BF16__)
        " avx512_bf16"
#endif
#if defined(__AVX512FP16__)
        " avx512_fp16"
#endif
#if defined(__AMX_TILE__)
        " amx_tile"
#endif
#if defined(__AMX_BF16__)
        " amx_bf16"
#endif
        ;
}
