// The backward (FlashAttention-2 order, no atomics) and its tiles.
//
// Part of attention.cpp, which includes its parts in order as one translation unit (the
// compiler inlines across them); not compiled on its own.
#pragma once

namespace {

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
#pragma GCC unroll 4
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

// Rows with |lse| at least this get their lse's rounding corrected (GradItem::correct_lse).
constexpr float LSE_EXACT = 256.f;

inline bool lse_inexact(float lse) { return std::fabs(lse) >= LSE_EXACT && !std::isinf(lse); }

// One backward work item, (sequence b, kv head hk), in phases: its query heads' rows gathered into
// scratch (gather_rows), the lse corrections of rows with a large |lse| (correct_lse), the sinks'
// gradient (sink_grads), then per key block: the rows that see it (block_rows), its keys and
// values packed (pack_block), and per chunk of BQ_BWD rows S and dP (products), P and dS
// (probabilities), dV, dK and dQ (accumulate); dK/dV stored per block (store_block), dQ at the
// end (store_dq). Three product paths share the phases: float32 FMAs, AMX tiles (bf16 with AMX)
// and vdpbf16ps (dot16: bf16 with AVX512-BF16 alone).
template <class IO>
struct GradItem {
    typedef typename IO::T T;
    // bf16 without AMX: the five products on vdpbf16ps (dot16).
    static constexpr bool dot16_ok = JS_BF16_BWD && std::is_same<IO, BF16>::value;
    static_assert(!dot16_ok || direct_pairs<IO>, "dot16 keeps no float32 q: direct scores read bf16 q in place");

    const JsGradParams& g;
    const JsParams& p;
    GradScratch& w;
    const int64_t b, hk;
    const int64_t d, dv, dp, dvp, group, q0, len_q, len_k, shift;
    // The forward ran this sequence as direct rows (run_all): its scores are recomputed the same way.
    const bool direct;
    const bool amx, dot16;
    const int64_t pairs, vpairs;  // dot16: q.k and dO.v as pairs
    // Scratch rows: query head gi's row i at gi * lq + i. AMX tiles sum over rows 32 at a time, so
    // there each head's rows are padded to a multiple of 32 with zero rows (lse +inf: P = 0).
    const int64_t lq, rows;
    const int64_t dpad, dvpad;  // AMX: 16 pairs per tile

    GradItem(const JsGradParams& g_, int64_t b_, int64_t hk_, GradScratch& w_)
        : g(g_), p(g_.f), w(w_), b(b_), hk(hk_), d(p.head_dim), dv(p.head_dim_v), dp((d + W - 1) / W * W),
          dvp((dv + W - 1) / W * W), group(p.heads_q / p.heads_kv), q0(p.cu_q[b]), len_q(p.cu_q[b + 1] - q0),
          len_k(key_count(p, b)), shift(p.bottom_right ? len_k - len_q : 0), direct(len_q <= p.direct_rows),
#if JS_AMX
          amx(std::is_same<IO, BF16>::value && amx_ready()),
#else
          amx(false),
#endif
          dot16(dot16_ok && !amx), pairs((d + 1) / 2), vpairs((dv + 1) / 2),
          lq(amx ? (len_q + 31) / 32 * 32 : len_q), rows(group * lq), dpad((d + 31) / 32 * 32),
          dvpad((dv + 31) / 32 * 32) {}

    bool empty() const { return len_q == 0 || len_k == 0; }

    // q (scaled, float32; or bf16 as given for AMX and dot16), dO, lse and delta = dO.O of every
    // query head's rows into scratch.
    void gather_rows() {
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
    }

    // K^T of a key block as scores() reads it (none for a direct sequence).
    void pack_k(const KeyRows<T>& krows, int nk) {
        if (direct) return;
        if constexpr (dot16_ok)
            if (dot16) return pack_transposed<IO, true>(krows, nk, d, pairs, w.kt2.data());
        pack_transposed<IO, false>(krows, nk, d, d, reinterpret_cast<uint32_t*>(w.kt.data()));
    }

    // S (unmasked) of scratch rows base .. base + n against key block kb, rounded as the forward
    // rounded it: direct_scores on the key rows for a direct sequence, else qk_tile on K^T packed in
    // w.kt (qk_tile_bf16 on K^T pairs in w.kt2 for dot16).
    void scores(int64_t base, int n, const KeyRows<T>& krows, int nk, float* pb) {
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
    }

    // The float32 lse is off by up to half an ulp of |lse|, so P = exp(S - lse) is too, relatively:
    // 2^-11 at |lse| ~ 1e4, where MATH's P is exact (a one-hot row's top key; dv 2e-3 off). For rows
    // whose |lse| is at least LSE_EXACT this sums P over the row's keys once more, with the forward's
    // scores (scores()): the sum is exp(L - lse) for the L = m + log(l) the forward rounded, and its
    // log goes to w.lse_lo, which the backward subtracts from S - lse. That pass costs about a
    // forward without P.V. Below LSE_EXACT the rounding moves P by < 7.6e-6 (relative; the float32
    // gradient floor is 1e-4), and rows of ordinary logits (even attention sinks) never pay for it.
    // Not on AMX (its S is computed unscaled in bf16 products; the rows there are bf16 anyway).
    void correct_lse() {
        if (amx) return;
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

    // The sinks' gradient (docs/api.md section 11): the sink's share of row i is P_sink = exp(sink_h - lse_i)
    // (lse includes the sink, corrected like P below), and d lse_i / d sink_h = P_sink, so
    // dsink_h = -sum_i P_sink,i * delta_i (delta_i = dO_i . O_i). A row that saw no key has O = 0.
    // sink_part: (batch, Hq) per-item sums, added up in order once every item is done (grad_all).
    void sink_grads(double* sink_part) {
        for (int64_t gi = 0; gi < group; ++gi) {
            const int64_t h = hk * group + gi;
            double sum = 0.0;
            for (int64_t i = 0; i < len_q; ++i) {
                const int64_t row = gi * lq + i;
                sum += static_cast<double>(std::exp((p.sinks[h] - w.lse[row]) - w.lse_lo[row])) * w.delta[row];
            }
            sink_part[b * p.heads_q + h] = sum;
        }
    }

    // The chunk rows [c_begin, c_end) that see any key of block [kb, kb + nk): a contiguous range
    // (both bounds of key_range are monotone); AMX chunks start and end on multiples of 32 (the rows
    // added see none of these keys: P = 0). False when no row sees the block (its dK/dV stay 0).
    bool block_rows(int64_t kb, int nk, int64_t& c_begin, int64_t& c_end) const {
        int64_t r_begin = len_q, r_end = 0;
        for (int64_t i = 0; i < len_q; ++i) {
            int64_t lo, hi;
            key_range(p, b, i + shift, len_k, &lo, &hi);
            if (hi > kb && lo < kb + nk && hi > lo) {
                r_begin = std::min(r_begin, i);
                r_end = i + 1;
            }
        }
        if (r_begin >= r_end) return false;
        c_begin = amx ? r_begin / 32 * 32 : r_begin;
        c_end = amx ? (r_end + 31) / 32 * 32 : r_end;
        return true;
    }

    // A key block packed for the products, its dK/dV accumulators zeroed.
    void pack_block(const KeyRows<T>& krows, const KeyRows<T>& vrows, int nk) {
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
    }

    // S = Q.K^T into pb and dP = dO.V^T into dsb for the n scratch rows from base.
    void products(int64_t base, int n, const KeyRows<T>& krows, int nk, float* pb, float* dsb) {
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
            return;
        }
#endif
        scores(base, n, krows, nk, pb);
#if JS_BF16_BWD
        if (dot16) {
#define JS_DP16(RR, r) qk_tile_bf16<RR>(w.dob.data() + (base + r) * 2 * vpairs, 2 * vpairs, vpairs, w.vt2.data(), 1.f, dsb + r * BK)
            JS_FOR_TILES(n, JS_DP16)
#undef JS_DP16
            return;
        }
#endif
#define JS_DP(RR, r) qk_tile<RR>(w.dout.data() + (base + r) * dvp, dvp, dv, w.vt.data(), dsb + r * BK)
        JS_FOR_TILES(n, JS_DP)
#undef JS_DP
    }

    // In place: S -> P = exp(S - lse) (times dropout's Z) and dP -> dS = P * (dP o Z - delta)
    // (times the softcap derivative), for chunk rows c0 .. c0 + n of query head h (scratch rows from
    // base) against key block [kb, kb + nk); zero past nk.
    void probabilities(int64_t base, int n, int64_t c0, int64_t h, int64_t kb, int nk, const RowRule& rule,
                       float* pb, float* dsb) {
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
    }

    // dV += P^T.dO, dK += dS^T.Q (Q pre-scaled; transposed dK^T/dV^T on AMX and dot16) and
    // dQ += dS.K for the chunk's n scratch rows from base.
    void accumulate(int64_t base, int n, int nk, float* pb, float* dsb) {
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
            return;
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
            return;
        }
#endif
        tpv(pb, n, nk, w.dout.data() + base * dvp, w.dv.data(), dvp);
        tpv(dsb, n, nk, w.q.data() + base * dp, w.dk.data(), dp);
#define JS_DQ(RR, r) xb_rows<RR>(dsb + r * BK, nk, w.kr.data(), w.dq.data() + (base + r) * dp, dp)
        JS_FOR_TILES(n, JS_DQ)
#undef JS_DQ
    }

    // The block's dK/dV (transposed back on AMX and dot16, dK^T scaled) into its cache rows, or into
    // a shared block's accumulator rows.
    void store_block(int64_t kb, int nk, SharedBlocks* shared) {
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

    // dQ (scaled) of every query head's rows.
    void store_dq() {
        for (int64_t gi = 0; gi < group; ++gi) {
            const int64_t h = hk * group + gi;
            for (int64_t i = 0; i < len_q; ++i) {
                T* dqs = static_cast<T*>(g.dq) + (q0 + i) * g.dq_tok + h * g.dq_head;
                const float* src = w.dq.data() + (gi * lq + i) * dp;
                for (int64_t e = 0; e < d; ++e) dqs[e] = IO::st(src[e] * p.scale);
            }
        }
    }
};

// The backward of one work item (sequence b, kv head hk), phase by phase (GradItem). sink_part:
// with sinks and g.dsinks, where sink_grads puts this item's sums.
template <class IO>
void grad_item(const JsGradParams& g, int64_t b, int64_t hk, GradScratch& w, SharedBlocks* shared,
               double* sink_part) {
    typedef typename IO::T T;
    GradItem<IO> it(g, b, hk, w);
    if (it.empty()) return;
    const JsParams& p = g.f;
    it.gather_rows();
    it.correct_lse();
    if (sink_part) it.sink_grads(sink_part);
#if JS_AMX
    if (it.amx) amx_configure();
#endif
    for (int64_t kb = 0; kb < it.len_k; kb += BK) {
        const int nk = static_cast<int>(std::min<int64_t>(BK, it.len_k - kb));
        int64_t c_begin, c_end;
        if (!it.block_rows(kb, nk, c_begin, c_end)) continue;  // dK/dV rows of this block stay 0
        const KeyRows<T> krows = k_rows<T>(p, b, kb, hk), vrows = v_rows<T>(p, b, kb, hk);
        it.pack_block(krows, vrows, nk);
        for (int64_t gi = 0; gi < it.group; ++gi) {
            const int64_t h = hk * it.group + gi;
            const float slope = p.slopes ? p.slopes[b * p.slopes_batch_stride + h] : 0.f;
            const RowRule rule{p, kb, it.len_k, nk, slope, b, h, it.shift};
            for (int64_t c0 = c_begin; c0 < c_end; c0 += BQ_BWD) {
                const int n = static_cast<int>(std::min<int64_t>(BQ_BWD, c_end - c0));
                const int64_t base = gi * it.lq + c0;  // scratch row of the chunk's first row
                float* pb = w.p.data();
                float* dsb = w.ds.data();
                it.products(base, n, krows, nk, pb, dsb);
                it.probabilities(base, n, c0, h, kb, nk, rule, pb, dsb);
                it.accumulate(base, n, nk, pb, dsb);
            }
        }
        it.store_block(kb, nk, shared);
    }
#if JS_AMX
    if (it.amx) _tile_release();
#endif
    it.store_dq();
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

}  // namespace
