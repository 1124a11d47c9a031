// The forward driver: per-thread scratch, one work item (tiles or direct rows), and the OpenMP
// schedule over a call's items.
//
// Part of attention.cpp, which includes its parts in order as one translation unit (the
// compiler inlines across them); not compiled on its own.
#pragma once

namespace {

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
        if (ROW_PREFETCH && r + PACK_AHEAD < rows) prefetch_row(src + PACK_AHEAD * p.q_tok, d * static_cast<int64_t>(sizeof(*src)));
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
    for (int r = 0; r < rows; ++r) {
        if (ROW_PREFETCH && r + PACK_AHEAD < rows)
            prefetch_row<true>(out + (q0 + r + PACK_AHEAD) * p.o_tok + it.h * p.o_head, dv * static_cast<int64_t>(sizeof(*out)));
        finish_row<QO>(o + r * dvp, m[r], hsum(lv[r]), sink_of(p, it.h), dv, out + (q0 + r) * p.o_tok + it.h * p.o_head,
                       p.lse ? p.lse + it.h * p.lse_head + (q0 + r) * p.lse_tok : nullptr);
    }
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

}  // namespace
