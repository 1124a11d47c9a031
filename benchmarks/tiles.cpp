// Micro-benchmark of the compiled kernel's forward micro-tiles (issues 14 and 22): one packed key
// block of 64 keys against 1024 query rows, D = Dv = 64, data in L1/L2, one thread; the fp32 tile
// (6 rows, softmax included), where built with AVX512-BF16 the bf16 vdpbf16ps tile (6 rows) and
// the exponentials' throughput (vexp, vexp_bf16), and where built with AMX the bf16 AMX tile. It includes the
// kernel's source, so it measures exactly the shipped tiles; set against the GEMM rate bench_cpu.py
// prints, it shows what the tiles alone reach before packing and scheduling.
//
//   g++ -O3 -march=native -fopenmp -std=c++17 -fno-math-errno benchmarks/tiles.cpp -o /tmp/tiles && /tmp/tiles
#include "../jagged_sdpa/backends/cpu/csrc/attention.cpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

int main(int argc, char** argv) {
    const int64_t d = 64, dvp = 64, rows = 1024, iters = argc > 1 ? std::atoi(argv[1]) : 300;
    JsParams p{};
    p.scale = 0.125f;
    p.heads_q = p.heads_kv = 1;
    p.head_dim = d;
    p.head_dim_v = dvp;
    p.window_left = p.window_right = -1;
    std::mt19937 gen(0);
    std::normal_distribution<float> normal;
    std::vector<float> q(rows * d), kt(d * BK), vp(BK * dvp), o(rows * dvp), m(rows);
    std::vector<vf> lv(rows);
    for (float& x : q) x = normal(gen) * p.scale;
    for (float& x : kt) x = normal(gen);
    for (float& x : vp) x = normal(gen);
    const RowRule rule{p, 0, int64_t{1} << 20, BK, 0.f, 0, 0, 0};
    auto reset = [&] {
        std::fill(o.begin(), o.end(), 0.f);
        std::fill(m.begin(), m.end(), -INFINITY);
        for (vf& x : lv) x = splat(0.f);
    };
    auto rate = [&](int64_t tile_rows, auto&& run) {  // GFLOP/s of 4 D flops per (row, key)
        reset();
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t it = 0; it < iters; ++it)
            for (int64_t r = 0; r + tile_rows <= rows; r += tile_rows) run(r);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return 4.0 * d * BK * (rows / tile_rows * tile_rows) * iters / s / 1e9;
    };
#if JS_BF16_DOT
    std::vector<uint16_t> qb(rows * d), vp2(BK * dvp);
    std::vector<uint32_t> kt2(d / 2 * BK);
    for (uint16_t& x : qb) x = BF16::st(normal(gen));
    for (uint16_t& x : vp2) x = BF16::st(normal(gen));
    for (uint32_t& x : kt2) x = BF16::st(normal(gen)) | (uint32_t{BF16::st(normal(gen))} << 16);
    // ns per vector of 16 exponentials of softmax-like arguments (<= 0), summed so none is dropped.
    auto exp_ns = [&](auto&& f) {
        alignas(64) float x[4096];
        for (int i = 0; i < 4096; ++i) x[i] = -static_cast<float>(i % 97) * 0.37f;
        vf acc = splat(0.f);
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t it = 0; it < 50 * iters; ++it)
            for (int i = 0; i < 4096; i += W) acc += f(loadu(x + i));
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        volatile float keep = hsum(acc);
        (void)keep;
        return s / (50.0 * iters * 4096 / W) * 1e9;
    };
#endif
#if JS_AMX
    const bool amx = amx_ready();
#endif
    for (int round = 0; round < 3; ++round) {
        const double fp32 = rate(R, [&](int64_t r) {
            tile<R>(q.data() + r * d, d, kt.data(), vp.data(), dvp, o.data() + r * dvp, m.data() + r, lv.data() + r,
                    true, rule, r);
        });
        std::printf("fp32 tile<%d>: %.0f GFLOP/s", R, fp32);
#if JS_BF16_DOT
        const double bf16_dot = rate(R, [&](int64_t r) {
            tile_bf16<R>(qb.data() + r * d, d, d / 2, kt2.data(), vp2.data(), dvp, o.data() + r * dvp, m.data() + r,
                         lv.data() + r, true, rule, r, p.scale);
        });
        std::printf("   bf16 tile_bf16<%d>: %.0f GFLOP/s   exp ns/16 lanes: vexp %.2f, vexp_bf16 %.2f", R, bf16_dot,
                    exp_ns([](vf x) { return vexp(x); }), exp_ns([](vf x) { return vexp_bf16(x); }));
#endif
#if JS_AMX
        if (amx) {
            amx_configure();
            const double bf16 = rate(TR, [&](int64_t r) {
                tile_amx(TR, qb.data() + r * d, d, d / 32, kt2.data(), vp2.data(), dvp, o.data() + r * dvp, m.data() + r,
                         lv.data() + r, true, rule, r, p.scale);
            });
            _tile_release();
            std::printf("   bf16 AMX tile: %.0f GFLOP/s", bf16);
        }
#endif
        std::printf("\n");
    }
    return 0;
}
