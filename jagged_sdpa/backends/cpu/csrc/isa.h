// Instruction sets: the headers and JS_* switches chosen from what -march enables (AVX-512,
// AVX512-BF16, AMX, AVX2/F16C, NEON), read by every part below.
//
// Part of attention.cpp, which includes its parts in order as one translation unit (the
// compiler inlines across them); not compiled on its own.
#pragma once

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
