// The forward's tiled path: score rules (softcap, ALiBi, masks), the float32 micro-tiles per
// register width, the online softmax, bf16 tiles on vdpbf16ps and AMX.
//
// Part of attention.cpp, which includes its parts in order as one translation unit (the
// compiler inlines across them); not compiled on its own.
#pragma once

namespace {

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
#pragma GCC unroll 4
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
#pragma GCC unroll 4
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
#if JS_VEC_BYTES == 64
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
#else
// With narrower registers (AVX2, NEON) the rows go in two passes, every row's maximum first, then
// the exponentials of all rows: row by row (as above), each row's exponentials waited on its
// maximum (a chain of scalar maxima) and the next row's maximum on them. Same results.
template <class IO>
inline void softmax_rows(int rows, float* pb, float* m, vf* lv, float* alpha, bool plain, const RowRule& rule,
                         int64_t pos0, float pre) {
    alignas(64) float m_old[W], m_new[W], bms[W];
    vf sums[W];
    const bool scaled = !plain || !(pre > 0.f);
    const float f = scaled ? 1.f : pre;
    for (int r = 0; r < rows; ++r) {
        float* row = pb + r * BK;
        if (scaled) {
            if (pre != 1.f)
                for (int c = 0; c < 4; ++c) storeu(row + c * W, loadu(row + c * W) * splat(pre));
            if (!plain) rule.apply(row, pos0 + r);
        }
        bms[r] = hmax(vmax(vmax(loadu(row), loadu(row + W)), vmax(loadu(row + 2 * W), loadu(row + 3 * W))));
    }
    for (int r = 0; r < rows; ++r) {
        float* row = pb + r * BK;
        m_old[r] = m_new[r] = 0.f;  // a row that sees no key of this block: alpha 1, P 0
        sums[r] = splat(0.f);
        if (adds_nothing(bms[r], row, BK)) {
            for (int c = 0; c < 4; ++c) storeu(row + c * W, splat(0.f));
            continue;
        }
        m_old[r] = m[r];  // -inf before the row's first key: alpha 0 (O and l are still 0)
        m_new[r] = m[r] = std::max(m[r], bms[r] * f);
        const vf fv = splat(f), mv = splat(m[r]);
        for (int c = 0; c < 4; ++c) {
            const vf e = prob_exp<IO>(loadu(row + c * W) * fv - mv);
            storeu(row + c * W, e);
            sums[r] += e;
        }
    }
    for (int r = rows; r < W; ++r) m_old[r] = m_new[r] = 0.f;
    storeu(alpha, vexp(loadu(m_old) - loadu(m_new)));
    for (int r = 0; r < rows; ++r) lv[r] = lv[r] * splat(alpha[r]) + sums[r];
}
#endif

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

}  // namespace
