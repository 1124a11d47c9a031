// Direct rows: a query row (decoding: one query, or a few) attended on its own, reading its keys
// in place with every query head of a kv head together, without packing a key block.
//
// Part of attention.cpp, which includes its parts in order as one translation unit (the
// compiler inlines across them); not compiled on its own.
#pragma once

namespace {

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
// 2 NL elements: IO::ld2n where the type has one (fp8: one load for both), else two row_ldn.
template <class IO, class = void>
struct has_ld2n : std::false_type {};
template <class IO>
struct has_ld2n<IO, std::void_t<decltype(IO::ld2n(nullptr))>> : std::true_type {};
template <class IO>
inline __attribute__((always_inline)) nvf2 row_ld2n(const typename IO::T* p) {
    if constexpr (has_ld2n<IO>::value)
        return IO::ld2n(p);
    else
        return nvf2{row_ldn<IO>(p), row_ldn<IO>(p + NL)};
}

// NL floats at p in a register that its uses share: left to itself GCC folded the load into each
// FMA that reads it (one load per FMA, where group_scores shares q between NK keys), and the loads
// bounded the products (two 32-byte loads a cycle on Zen 3; 1 FMA a cycle where 2 is the peak).
template <int Uses>
inline __attribute__((always_inline)) nvf held_n(const float* p) {
    nvf r;
    std::memcpy(&r, p, sizeof r);
    if constexpr (Uses > 1) {
#if defined(__x86_64__) || defined(__i386__)
        asm("" : "+x"(r));
#elif defined(__aarch64__)
        asm("" : "+w"(r));
#endif
    }
    return r;
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
    if constexpr (has_ld2n<IO>::value)  // the same chains: register e, then e + NL
        for (; e + 2 * NL <= d; e += 2 * NL) {
            nvf2 kv[NK];
            for (int j = 0; j < NK; ++j) kv[j] = row_ld2n<IO>(kr[j] + e);
            for (int h = 0; h < NH; ++h) {
                const nvf qq = held_n<NK>(q + h * qd + e);
                for (int j = 0; j < NK; ++j) acc[h * NK + j] = fma_n(qq, kv[j].a, acc[h * NK + j]);
            }
            for (int h = 0; h < NH; ++h) {
                const nvf qq = held_n<NK>(q + h * qd + e + NL);
                for (int j = 0; j < NK; ++j) acc[h * NK + j] = fma_n(qq, kv[j].b, acc[h * NK + j]);
            }
        }
    for (; e + NL <= d; e += NL) {
        nvf kv[NK];
        for (int j = 0; j < NK; ++j) kv[j] = row_ldn<IO>(kr[j] + e);
        for (int h = 0; h < NH; ++h) {
            const nvf qq = held_n<NK>(q + h * qd + e);
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

// Prefetches a list of rows (`bytes` each from rows[i], i < n) line by line in order: direct rows
// walk their key rows in an order the hardware prefetchers follow poorly (a block's rows head by
// head, then its value rows), and on a paged cache every block of rows lies elsewhere; a row read
// from DRAM stalled the products. Its owner keeps it a distance ahead of the reads (until: every
// line up to a row, at each block) and paces it with the products (pace: a line per 64 bytes read),
// never past row `cap`: a burst of prefetches stalls as a load does once the misses in flight fill
// the core's buffers (a block's worth at a time spent a third of a bf16 decode on them).
struct RowPrefetch {
    const void* const* rows;
    int64_t bytes;
    int n = 0, i = 0, cap = 0;    // rows known, the next row to start, the last row pace may start
    uintptr_t at = 0, end = 0;    // the row being prefetched: its next line and its end
    int64_t credit = 0;           // bytes read that pace has not yet matched
    bool line() {                 // the next line, if there is one before row `limit`
        if (at >= end) {
            if (i >= std::min(cap, n)) return false;
            const uintptr_t a = reinterpret_cast<uintptr_t>(rows[i++]);
            at = a & ~uintptr_t{63};
            end = a + bytes;
        }
        __builtin_prefetch(reinterpret_cast<const void*>(at), 0, 2);  // to L2: L1 cannot hold the distance
        at += 64;
        return true;
    }
    void until(int row) {  // every line of rows [.., min(row, n)), then pace up to row + ahead
        const int keep = cap;
        cap = row;
        while (line()) {
        }
        cap = std::max(keep, row);
        credit = 0;
    }
    void pace(int64_t read) {
        for (credit += read; credit >= 64; credit -= 64)
            if (!line()) {
                credit = 0;
                return;
            }
    }
};
struct NoPace {
    void operator()(int) const {}
};
// Scores of nh query heads (rows qd apart) against n key rows kr[j] + off: s[h * ls + j]. Heads go
// four at a time, keys as many as eight accumulators take.
// between(keys) runs before each group of keys (direct_heads paces its prefetches there). Never
// inlined, nor group_pv: inlined into direct_heads, their accumulators went through the stack on
// every key (the e5m2 decode's P.V stored 8 registers a key).
template <class IO, class Between = NoPace>
__attribute__((noinline)) void group_scores_all(const float* q, int64_t qd, int nh, const typename IO::T* const* kr, int64_t off, int n,
                             int64_t d, float* s, int64_t ls, Between&& between = Between{}) {
    for (int h0 = 0; h0 < nh; h0 += 4) {
        const float* qh = q + h0 * qd;
        float* sh = s + h0 * ls;
        auto run = [&](auto heads) {
            constexpr int NH = decltype(heads)::value, NK = 8 / NH;
            int j = 0;
            for (; j + NK <= n; j += NK) {
                between(NK);
                group_scores<IO, NH, NK>(qh, qd, kr + j, off, d, sh + j, ls);
            }
            for (; j < n; ++j) {
                between(1);
                group_scores<IO, NH, 1>(qh, qd, kr + j, off, d, sh + j, ls);
            }
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
// between(columns) runs before each pass over the keys.
template <class IO, int NH, class Between = NoPace>
__attribute__((noinline)) void group_pv(const float* pr, int64_t ls, const typename IO::T* const* vr, int64_t off, int n, int64_t dv,
                     float* o, int64_t dvo, Between&& between = Between{}) {
    constexpr int NV = PV_VECTORS / NH > 1 ? PV_VECTORS / NH : 1;
    // Registers of columns a pass (NL each). AVX2, 3 or 4 heads: 12 accumulators, not 8, so that
    // more chains than the FMA latency times its issue rate are in flight (16 registers hold them).
    // Not e5m2, whose pairs of registers share one load and unpack (an odd third cost more).
    constexpr int NR = JS_VEC_BYTES == 32 && (NH == 3 || NH == 4) && !std::is_same<IO, E5M2>::value ? 12 / NH : NV * NP;
    int64_t c = 0;
    // Accumulators as one flat array of registers, loaded and stored by value: an array of vf
    // (struct vectors on narrower registers), or one whose address memcpy took, was stored back to
    // the stack after every FMA (8 stores a key on AVX2).
    auto pass = [&](auto regs) {
        constexpr int nr = decltype(regs)::value;
        between(nr * NL);
        nvf acc[NH * nr];
        for (int h = 0; h < NH; ++h)
            for (int u = 0; u < nr; ++u) acc[h * nr + u] = load_n(o + h * dvo + c + u * NL);
        for (int j = 0; j < n; ++j) {
            const typename IO::T* x = vr[j] + off + c;
            nvf xv[nr];
            int u = 0;
            for (; u + 2 <= nr; u += 2) {
                const nvf2 x2 = row_ld2n<IO>(x + u * NL);
                xv[u] = x2.a;
                xv[u + 1] = x2.b;
            }
            if (u < nr) xv[u] = row_ldn<IO>(x + u * NL);
            for (int h = 0; h < NH; ++h) {
                const nvf pj = splat(pr[h * ls + j]).h[0];
                for (int v = 0; v < nr; ++v) acc[h * nr + v] = fma_n(pj, xv[v], acc[h * nr + v]);
            }
        }
        for (int h = 0; h < NH; ++h)
            for (int v = 0; v < nr; ++v) store_n(o + h * dvo + c + v * NL, acc[h * nr + v]);
        c += nr * NL;
    };
    // Four registers left after passes of three: two of two, not three and one (one register a
    // head is 4 chains, too few for the FMA latency). Each column still sums its keys in order.
    while (c + NR * NL <= dv && !(NR == 3 && NP == 2 && dv - c == 4 * NL)) pass(std::integral_constant<int, NR>{});
    while (c + NP * NL <= dv) pass(std::integral_constant<int, NP>{});
    while (c + NL <= dv) pass(std::integral_constant<int, 1>{});
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

// What both decode-row walks (direct_row, direct_heads) share about query row r of sequence b:
// where it is, the aligned position its masks see, its visible keys [lo, hi) (one range, so masks
// are bounds) and its ALiBi slopes.
struct DirectRow {
    int64_t row, pos, lo, hi;
    const float* slopes;
    DirectRow(const JsParams& p, int64_t b, int64_t r) {
        row = p.cu_q[b] + r;
        const int64_t len_q = p.cu_q[b + 1] - p.cu_q[b], len_k = key_count(p, b);
        pos = r + (p.bottom_right ? len_k - len_q : 0);
        slopes = p.slopes ? p.slopes + b * p.slopes_batch_stride : nullptr;
        key_range(p, b, pos, len_k, &lo, &hi);
    }
    // Query heads h0 .. h0 + heads: float32 q rows scaled by `scale` into qv (D apart; pairs keep
    // their bf16 q in place: qv null), running max -inf and sum 0, O (dvo columns a head) zero.
    template <class IO>
    void start(const JsParams& p, int64_t h0, int64_t heads, float scale, float* qv, float* m, float* l, float* o,
               int64_t dvo) const {
        typedef typename IO::QO QO;
        const typename QO::T* q = static_cast<const typename QO::T*>(p.q) + row * p.q_tok;
        for (int64_t i = 0; i < heads; ++i) {
            if (qv)
                for (int64_t e = 0; e < p.head_dim; ++e) qv[i * p.head_dim + e] = QO::ld(q + (h0 + i) * p.q_head + e) * scale;
            m[i] = -INFINITY;
            l[i] = 0.f;
        }
        std::fill(o, o + heads * dvo, 0.f);
    }
    // Query head h's raw scores sh[0, n) of keys kb .. kb + n (room to np) to probabilities:
    // softcap, ALiBi, the online softmax (softmax_block) and dropout. False when the block adds
    // nothing (sh zero).
    template <class IO>
    bool probs(const JsParams& p, int64_t b, int64_t r, int64_t h, int64_t kb, int n, int np, float* sh, float& m, float& l,
               float* o, int64_t dvo) const {
        if (p.softcap > 0.f)
            for (int j = 0; j < n; ++j) sh[j] = p.softcap * std::tanh(sh[j] / p.softcap);
        if (slopes)
            for (int j = 0; j < n; ++j) sh[j] -= slopes[h] * static_cast<float>(std::llabs(pos - (kb + j)));
        if (!softmax_block<IO>(sh, n, np, block_max(sh, n), m, l, o, dvo)) return false;
        if (p.dropout_p > 0.f) apply_dropout(p, b, h, r, kb, n, sh);  // l sums P before dropout
        return true;
    }
    // Query heads h0 .. h0 + heads: out and lse from O, m, l (finish_row).
    template <class IO>
    void finish(const JsParams& p, int64_t h0, int64_t heads, const float* o, int64_t dvo, const float* m,
                const float* l) const {
        typedef typename IO::QO QO;
        typename QO::T* out = static_cast<typename QO::T*>(p.out) + row * p.o_tok;
        for (int64_t i = 0; i < heads; ++i)
            finish_row<QO>(o + i * dvo, m[i], l[i], sink_of(p, h0 + i), p.head_dim_v, out + (h0 + i) * p.o_head,
                           p.lse ? p.lse + (h0 + i) * p.lse_head + row * p.lse_tok : nullptr);
    }
};

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
    const DirectRow w(p, b, r);
    const int64_t lo = w.lo, hi = w.hi;
    w.start<IO>(p, 0, heads, p.scale, pairs ? nullptr : qv, m, l, o, dvo);
    typedef typename IO::QO QO;
    const typename QO::T* q = static_cast<const typename QO::T*>(p.q) + w.row * p.q_tok;
    auto q_of = [&](int64_t h) -> const DirectQ<IO>* {  // pairs: the bf16 row in place
        if constexpr (pairs)
            return q + h * p.q_head;
        else
            return qv + h * d;
    };
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
            w.probs<IO>(p, b, r, h, kb, n, np, sh, m[h], l[h], o + h * dvo, dvo);
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
    for (int64_t h = 0; h < heads; ++h) direct_unpermute<IO>(o + h * dvo, dvo);
    w.finish<IO>(p, 0, heads, o, dvo, m, l);
}
#endif

#if !JS_AVX512
// Whether direct rows take each kv head as its own work item (direct_heads): where a kv head's keys
// lie apart from the other heads' (a dense cache, (B, Hkv, S, D)), so that an item reads one stretch
// of memory. Where a token's heads lie together (packed q/k/v, a paged cache), one item takes every
// kv head, key block by key block, and so reads each token's row of heads at once.
inline bool direct_per_kv_head(const JsParams& p) { return p.heads_kv > 1 && p.k_head >= p.k_tok && p.v_head >= p.v_tok; }

// Whether an e4m3fn NaN lies in rows[j] + g * hs, len bytes each, for j < n and g < ng.
inline bool e4m3_nan_rows(const uint8_t* const* rows, int n, int64_t ng, int64_t hs, int64_t len) {
    if (hs == len) {  // a token's heads lie together: one run a row
        len *= ng;
        ng = 1;
    }
    E4M3NanScan scan;
    for (int j = 0; j < n; ++j)
        for (int64_t g = 0; g < ng; ++g) scan.add(rows[j] + g * hs, len);
    return scan.any();
}

// How far direct_heads' prefetches run ahead of its reads, in bytes of rows (and at least a block
// and a half of rows).
constexpr int64_t DIRECT_PREFETCH_BYTES = 32 * 1024;

// A row attended on its own (decode: one query, or a few) on narrower registers: kv heads
// [g0, g1) and the query heads that share them, no packing (nothing would reuse it). Keys go in
// steps of p.direct_keys: their rows (one division a step, not a key), then, a block of keys at a
// time, each kv head's scores for all its query heads (group_scores: each key row loaded once for
// the group), the online softmax per head, then P.V the same way (group_pv: each value row loaded
// once for the group). Every row is prefetched a fixed distance ahead, in the order the blocks read
// them (RowPrefetch).
// e4m3fn: K and V widen to their values times 2^-120 (E4M3w; AVX2, no DAZ) or 2^-8 (E4M3x) and q
// and P carry the power of two, exactly, so every product is FP8<true>'s; a block's rows are first
// scanned for NaN, and only a block that holds one widens with NaN lanes. (q over FLT_MAX / 2^120
// takes E4M3x's 2^8; over FLT_MAX / 256 none, and its keys widen as FP8<true>.)
// Scratch: qv (Hq x D), s (Hq x DIRECT_KEYS), o (Hq x direct_width), m and l (Hq).
template <class IO>
void direct_heads(const JsParams& p, int64_t b, int64_t r, int64_t g0, int64_t g1, float* qv, float* s, float* o,
                  float* m, float* l) {
    typedef typename IO::T T;
    static_assert(!direct_pairs<IO>, "pairs are AVX-512 only");
    constexpr bool e4m3 = std::is_same<IO, E4M3>::value;
    const T* k = static_cast<const T*>(p.k);
    const T* v = static_cast<const T*>(p.v);
    const int64_t d = p.head_dim, dv = p.head_dim_v, group = p.heads_q / p.heads_kv, ng = g1 - g0;
    const int64_t h0 = g0 * group, heads = ng * group;  // query heads h0 .. h0 + heads
    const int64_t dvo = direct_width<IO>(dv);
    const DirectRow w(p, b, r);
    w.start<IO>(p, h0, heads, p.scale, qv, m, l, o, dvo);
    // e4m3: q carries 2^120 (K as E4M3w), 2^8 (E4M3x) or nothing (E4M3), the largest it can;
    // P carries 2^120 or 2^8 (V as E4M3w or E4M3x).
    constexpr float wscale = 0x1p120f;
    bool q256 = false, qwide = false;
    const bool wide = e4m3 && e4m3_wide();
    const float pscale = wide ? wscale : 256.f;
    if constexpr (e4m3) {
        float big = 0.f;
        for (int64_t i = 0; i < heads * d; ++i) big = std::max(big, std::fabs(qv[i]));  // NaN: left out
        qwide = wide && big <= 0x1.fffffep+127f / wscale;
        q256 = !qwide && big <= 0x1.fffffep+119f;
        if (qwide || q256)
            for (int64_t i = 0; i < heads * d; ++i) qv[i] *= qwide ? wscale : 256.f;
    }
    const int64_t step = std::clamp<int64_t>(p.direct_keys, 1, DIRECT_KEYS);
    // Keys a block: 32 for one kv head (its O loaded and stored once per block and head); 16 for
    // several, so that a token's row of heads is read at once.
    const int kblock = ng == 1 ? 2 * W : W;
    // Row pointers (at kv head g0): this step's K rows, its V rows, the next step's K rows, the
    // order they are read in.
    const void* rows[3 * DIRECT_KEYS];
    const T** kr = reinterpret_cast<const T**>(rows);
    const int64_t span = std::max((ng - 1) * p.k_head + d, (ng - 1) * p.v_head + dv) * static_cast<int64_t>(sizeof(T));
    RowPrefetch pf{rows, span};
    const int64_t k_read = span / ng;  // prefetched bytes a key row and kv head stands for
    const int ahead = static_cast<int>(
        std::clamp<int64_t>(DIRECT_PREFETCH_BYTES / std::max<int64_t>(span, 1), kblock + kblock / 2, 2 * DIRECT_KEYS));
    if (w.lo < w.hi)
        key_run(p, b, w.lo, static_cast<int>(std::min<int64_t>(step, w.hi - w.lo)), k, p.k_tok, p.k_block, g0 * p.k_head, kr);
    for (int64_t kb = w.lo; kb < w.hi; kb += step) {
        const int n = static_cast<int>(std::min<int64_t>(step, w.hi - kb));
        const int np = (n + W - 1) / W * W;  // scores and P padded to whole vectors
        const int next = static_cast<int>(std::clamp<int64_t>(w.hi - kb - n, 0, step));
        const T** vr = kr + n;
        key_run(p, b, kb, n, v, p.v_tok, p.v_block, g0 * p.v_head, vr);
        if (next) key_run(p, b, kb + n, next, k, p.k_tok, p.k_block, g0 * p.k_head, vr + n);
        pf.n = 2 * n + next;
        for (int j0 = 0; j0 < n; j0 += kblock) {
            const int nb = std::min(kblock, n - j0);
            pf.until(j0 + ahead);
            auto scores = [&](auto io) {
                typedef decltype(io) LD;
                for (int64_t g = g0; g < g1; ++g)
                    group_scores_all<LD>(qv + (g - g0) * group * d, d, static_cast<int>(group), kr + j0, (g - g0) * p.k_head,
                                         nb, d, s + (g - g0) * group * DIRECT_KEYS + j0, DIRECT_KEYS,
                                         [&](int keys) { pf.pace(keys * k_read); });
            };
            if constexpr (e4m3) {
                if (!q256 && !qwide)
                    scores(E4M3{});
                else if (e4m3_nan_rows(kr + j0, nb, ng, p.k_head, d))
                    qwide ? scores(E4M3w<true>{}) : scores(E4M3x<true>{});
                else
                    qwide ? scores(E4M3w<false>{}) : scores(E4M3x<false>{});
            } else {
                scores(IO{});
            }
        }
        for (int64_t i = 0; i < heads; ++i) {
            float* sh = s + i * DIRECT_KEYS;
            w.probs<IO>(p, b, r, h0 + i, kb, n, np, sh, m[i], l[i], o + i * dvo, dvo);
            if constexpr (e4m3)  // P carries the power of two its values lack (E4M3w, E4M3x)
                for (int j = 0; j < np; ++j) sh[j] *= pscale;
        }
        for (int j0 = 0; j0 < n; j0 += kblock) {
            const int nb = std::min(kblock, n - j0);
            pf.until(n + j0 + ahead);
            auto pv = [&](auto io) {
                typedef decltype(io) LD;
                for (int64_t i = 0, nh; i < heads; i += nh) {  // up to PV_HEADS query heads of one group
                    nh = std::min<int64_t>(PV_HEADS, group - i % group);
                    const int64_t off = (i / group) * p.v_head;
                    const float* pr = s + i * DIRECT_KEYS + j0;
                    float* oi = o + i * dvo;
                    // A pass reads nb x columns of the group's V rows, shared by its group / nh passes.
                    auto between = [&, nh](int columns) { pf.pace(nb * columns * static_cast<int64_t>(sizeof(T)) * nh / group); };
                    switch (nh) {
                        case 4: group_pv<LD, 4>(pr, DIRECT_KEYS, vr + j0, off, nb, dv, oi, dvo, between); break;
                        case 3: group_pv<LD, 3>(pr, DIRECT_KEYS, vr + j0, off, nb, dv, oi, dvo, between); break;
                        case 2: group_pv<LD, 2>(pr, DIRECT_KEYS, vr + j0, off, nb, dv, oi, dvo, between); break;
                        default: group_pv<LD, 1>(pr, DIRECT_KEYS, vr + j0, off, nb, dv, oi, dvo, between); break;
                    }
                }
            };
            if constexpr (e4m3) {
                if (e4m3_nan_rows(vr + j0, nb, ng, p.v_head, dv))
                    wide ? pv(E4M3w<true>{}) : pv(E4M3x<true>{});
                else
                    wide ? pv(E4M3w<false>{}) : pv(E4M3x<false>{});
            } else {
                pv(IO{});
            }
        }
        std::copy(vr + n, vr + n + next, kr);  // the next step's K rows
        pf.i = std::max(pf.i - 2 * n, 0);
        pf.n = next;
    }
    w.finish<IO>(p, h0, heads, o, dvo, m, l);
}
#endif

}  // namespace
