// Where a sequence's keys are (contiguous or through a block table), packing a key block for the
// tiles, the split of query rows into work items, and key_range: the one place a row's visible
// keys are derived.
//
// Part of attention.cpp, which includes its parts in order as one translation unit (the
// compiler inlines across them); not compiled on its own.
#pragma once

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

// Prefetches the first `bytes` of a key row, a line at a time. The packers below (narrower
// registers) ask for the rows a few ahead of the one they read: a head's rows are a token stride
// apart (2 KB for 8 heads of D 64: two rows a 4 KB page, which the hardware prefetchers do not
// cross), and packing waited on each row (perf: 9% of a one-thread AVX2 W1 forward).
// The forward's q rows (read) and out rows (written, Write) are asked for the same way.
template <bool Write = false, class T>
inline void prefetch_row(const T* row, int64_t bytes) {
    for (int64_t e = 0; e < bytes; e += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + e, Write);
}
constexpr int PACK_AHEAD = 16;  // rows
constexpr bool ROW_PREFETCH = JS_VEC_BYTES != 64;  // AVX-512 builds keep the code they were timed with

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
            for (int j = j0 + PACK_AHEAD; j < std::min(j0 + PACK_AHEAD + NL, nk); ++j)
                prefetch_row(rows(j), len * static_cast<int64_t>(sizeof(T)));
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
        for (int j = 0; j < std::min(PACK_AHEAD, nk); ++j) prefetch_row(rows(j), len * static_cast<int64_t>(sizeof(T)));
        for (int j = 0; j < nk; ++j) {
            const T* src = rows(j);
            if (j + PACK_AHEAD < nk) prefetch_row(rows(j + PACK_AHEAD), len * static_cast<int64_t>(sizeof(T)));
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

}  // namespace
