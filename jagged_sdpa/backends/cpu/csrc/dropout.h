// Keyed dropout: Philox4x32-10 keep decisions, recomputed identically by forward and backward.
//
// Part of attention.cpp, which includes its parts in order as one translation unit (the
// compiler inlines across them); not compiled on its own.
#pragma once

namespace {

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

}  // namespace
