// The compiled CPU kernel as a server on stdin/stdout, for running a build for another machine
// under an emulator (tests/backends/cpu/test_arm_build.py: an aarch64 build under qemu-aarch64). The python
// side (remote_kernel.py) sends each call's parameter struct and the memory it points into; this
// runs js_attention_forward or js_attention_backward on copies and sends every buffer back.
//
// Request:  u32 kind (1 forward, 2 backward, 0 quit), u32 buffers, per buffer u64 bytes and the
//           bytes, u64 struct bytes and the struct, u32 pointers, per pointer u32 offset in the
//           struct, u32 buffer, u64 offset in the buffer.
// Reply:    i32 the entry point's return code, then per buffer its bytes (same sizes).
// Both sides are LP64 little-endian (x86-64, aarch64), so the struct's layout is the same.
#include "../../jagged_sdpa/backends/cpu/csrc/attention.cpp"

#include <cstdio>
#include <cstdlib>

namespace {

bool read_all(void* p, size_t n) { return n == 0 || std::fread(p, 1, n, stdin) == n; }
void write_all(const void* p, size_t n) {
    if (n && std::fwrite(p, 1, n, stdout) != n) std::exit(3);
}
template <class T>
T read_val() {
    T x{};
    if (!read_all(&x, sizeof x)) std::exit(0);  // the python side closed the pipe
    return x;
}

}  // namespace

int main() {
    for (;;) {
        const uint32_t kind = read_val<uint32_t>();
        if (kind == 0) return 0;
        const uint32_t nbuf = read_val<uint32_t>();
        std::vector<std::vector<char>> bufs(nbuf);
        std::vector<char*> base(nbuf);
        for (uint32_t i = 0; i < nbuf; ++i) {
            const uint64_t n = read_val<uint64_t>();
            bufs[i].resize(n + 128);
            // 64-byte aligned, as torch's allocations are
            base[i] = bufs[i].data() + (64 - reinterpret_cast<uintptr_t>(bufs[i].data()) % 64) % 64;
            if (!read_all(base[i], n)) return 2;
        }
        const uint64_t sbytes = read_val<uint64_t>();
        const size_t want = kind == 1 ? sizeof(JsParams) : sizeof(JsGradParams);
        if (sbytes != want) {
            std::fprintf(stderr, "struct of %llu bytes, expected %zu\n", static_cast<unsigned long long>(sbytes), want);
            return 2;
        }
        alignas(16) char st[sizeof(JsGradParams)];
        if (!read_all(st, sbytes)) return 2;
        const uint32_t nptr = read_val<uint32_t>();
        for (uint32_t i = 0; i < nptr; ++i) {
            const uint32_t off = read_val<uint32_t>(), buf = read_val<uint32_t>();
            const uint64_t at = read_val<uint64_t>();
            if (buf >= nbuf || off + sizeof(void*) > sbytes) return 2;
            void* ptr = base[buf] + at;
            std::memcpy(st + off, &ptr, sizeof ptr);
        }
        int32_t code;
        if (kind == 1) {
            JsParams p;
            std::memcpy(&p, st, sizeof p);
            code = js_attention_forward(&p);
        } else {
            JsGradParams g;
            std::memcpy(&g, st, sizeof g);
            code = js_attention_backward(&g);
        }
        write_all(&code, sizeof code);
        for (uint32_t i = 0; i < nbuf; ++i) write_all(base[i], bufs[i].size() - 128);  // its n bytes
        std::fflush(stdout);
    }
}
