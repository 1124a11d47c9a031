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

}  // namespace
