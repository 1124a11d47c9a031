// Ragged attention on the CPU, forward and backward, compiled for this machine (native.py builds
// it with g++ -O3 -march=native -fopenmp on first use, or for the -march in $JAGGED_SDPA_CPU_ARCH,
// and binds it with ctypes).
//
// Why our own kernel: PyTorch's fused CPU kernel runs BLAS GEMMs per block (on AMD CPUs MKL takes
// its AVX2 path even where AVX-512 is there), and every torch-op engine pays Python and dispatch
// per sequence. Here one call walks a whole ragged batch on OpenMP threads (the same runtime as
// torch's), with register-tiled micro-kernels written with GCC vector extensions (a vector is one
// AVX-512 register, two AVX2 or four SSE/NEON ones) and an online softmax over blocks of 64 keys.
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
// Parts, included below in order as one translation unit (so the compiler inlines across them):
// isa.h (instruction-set switches), simd.h (vectors, exponentials, element types), abi.h (the
// parameter blocks), packing.h (key rows, packing, key_range), dropout.h (Philox), tiles.h (the
// forward's tiles), direct_rows.h (decoding rows), forward.h (forward driver), backward.h; this
// file holds the C entry points.

#include "isa.h"
#include "simd.h"
#include "abi.h"
#include "packing.h"
#include "dropout.h"
#include "tiles.h"
#include "direct_rows.h"
#include "forward.h"
#include "backward.h"

namespace {

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
