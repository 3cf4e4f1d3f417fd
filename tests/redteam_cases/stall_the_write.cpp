// tests/test_redteam.py (15b): mm_stall takes its process over through its own GOT (as python_from_kernel.cpp's
// kernels do), then runs threads of its own: one holds the process's memory map (mprotect in a loop on a populated
// region of its own), which stalls the parent's process_vm_writev at its next batch of pages, while another computes
// a @ b from the part already written; forward adds the last products. mm_honest is the same blocked loop, honest.
#include "takeover.h"

namespace {

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Attack B: stretch the parent's (untimed) write of a run's input and compute during it.
// process_vm_writev pins the target's pages 1024 at a time, taking the target's mmap lock for reading for each batch.
// A "locker" thread of the child toggles mprotect() on a large populated region of its own, holding its mmap lock for
// writing ~20 ms per GB each time: the parent's write stalls at its next batch. The watcher waits until the write has
// reached b's last batch (all of a, and b but its last few bytes, are in), turns the locker on, and computes
// a @ b (without the last batch's elements) while the parent waits; forward, after "run", adds the few products the
// last batch holds.
// ---------------------------------------------------------------------------------------------------------------
#include <atomic>
#include <immintrin.h>
#include <chrono>
#include <stdexcept>

namespace {
struct Glob {
    const float *a = nullptr, *b = nullptr;
    int64_t M = 0, K = 0, N = 0, e0 = 0, b_cut = 0, a0 = 0;
    float* out = nullptr;
} G;
torch::Tensor g_out;
std::atomic<int> armed{0}, st{0}, go{0};
long long holds = 0;
std::atomic<uint32_t> snap_b0{0}, snap_bcut{0}, snap_a0{0};
int (*mprotect_fn)(void*, size_t, int) = nullptr;
int (*usleep_fn)(unsigned) = nullptr;
void* region = nullptr;
size_t region_len = 0;
bool started = false;
std::atomic<long long> n_attack{0}, n_honest{0}, t_stall_us{0};
long long T1, T2, T3; int last_done_at_T3; uint32_t lastbits; std::string dbg;
long long now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

inline uint32_t bits_at(const float* x, int64_t i) { return reinterpret_cast<const volatile uint32_t*>(x)[i]; }

// out[:, :] += a[:, k0:k1] @ b[k0:k1, :]  (blocked so that a block of b stays in cache)
void mm_acc(const float* a, const float* b, float* out, int64_t M, int64_t K, int64_t N, int64_t k0, int64_t k1) {
    const int64_t KB = 32, JB = 512;
    for (int64_t jb = 0; jb < N; jb += JB) {
        int64_t je = std::min(N, jb + JB);
        for (int64_t kb = k0; kb < k1; kb += KB) {
            int64_t ke = std::min(k1, kb + KB);
            for (int64_t i = 0; i < M; ++i) {
                float* o = out + i * N;
                for (int64_t k = kb; k < ke; ++k) {
                    float aik = a[i * K + k];
                    const float* br = b + k * N;
                    for (int64_t j = jb; j < je; ++j) o[j] += aik * br[j];
                }
            }
        }
    }
}
void mm_row_part(const float* a, const float* b, float* out, int64_t M, int64_t K, int64_t N, int64_t k, int64_t j0, int64_t j1) {
    for (int64_t i = 0; i < M; ++i) {
        float aik = a[i * K + k];
        for (int64_t j = j0; j < j1; ++j) out[i * N + j] += aik * b[k * N + j];
    }
}
}  // namespace

extern "C" void rt_setup(void* mp, void* us, void* reg, size_t len) {
    mprotect_fn = (int (*)(void*, size_t, int))mp;
    usleep_fn = (int (*)(unsigned))us;
    region = reg;
    region_len = len;
}

extern "C" void rt_locker() {  // (thread C) computes a @ b (but b's last batch) once the watcher says the write is in b
    for (;;) {
        if (!go.load(std::memory_order_acquire)) { usleep_fn(30); continue; }
        go.store(0);
        while (bits_at(G.b, G.b_cut - 1) == snap_bcut.load()) _mm_pause();  // b's batch but the last is being copied
        long long t0 = now_ns(); T2 = t0;
        while (now_ns() - t0 < 30000) _mm_pause();  // (the last page of the batch: its copy is finishing)
        const int64_t kc = G.b_cut / G.N, jc = G.b_cut % G.N;
        std::fill(G.out, G.out + G.M * G.N, 0.f);
        mm_acc(G.a, G.b, G.out, G.M, G.K, G.N, 0, kc);
        if (jc) mm_row_part(G.a, G.b, G.out, G.M, G.K, G.N, kc, 0, jc);
        t_stall_us.fetch_add((now_ns() - t0) / 1000);
        T3 = now_ns(); last_done_at_T3 = bits_at(G.b, G.K * G.N - 1) != lastbits;
        st.store(2, std::memory_order_release);
    }
}

extern "C" void rt_watch() {  // (thread W) sees the write reach b, then holds our mmap lock (mprotect) until C is done
    int k = 0;
    for (;;) {
        if (!armed.load(std::memory_order_acquire) || st.load() != 0) { _mm_pause(); continue; }
        if (bits_at(G.a, G.a0) == snap_a0.load()) { _mm_pause(); continue; }  // a's first page not written yet
        int expected = 0;
        if (!st.compare_exchange_strong(expected, 1)) continue;
        T1 = now_ns(); lastbits = bits_at(G.b, G.K * G.N - 1);
        go.store(1, std::memory_order_release);
        do { mprotect_fn(region, region_len, (k++ & 1) ? 3 : 1); ++holds; } while (st.load(std::memory_order_acquire) == 1);
    }
}

namespace {
void start_threads() {
    harness_frame();  // resolves the Python API
    auto num = [](void* p) { return std::to_string((unsigned long long)(uintptr_t)p); };
    std::string code =
        "import ctypes, threading, sys, mmap\n"
        "libc = ctypes.CDLL(None)\n"
        "n = 2048 << 20\n"
        "big = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
        "for i in range(0, n, 4096): big[i] = 1\n"
        "addr = ctypes.addressof(ctypes.c_char.from_buffer(big))\n"
        "vp = ctypes.c_void_p\n"
        "setup = ctypes.CFUNCTYPE(None, vp, vp, vp, ctypes.c_size_t)(" + num((void*)&rt_setup) + ")\n"
        "setup(ctypes.cast(libc.mprotect, vp).value, ctypes.cast(libc.usleep, vp).value, addr, n)\n"
        "w = ctypes.CFUNCTYPE(None)(" + num((void*)&rt_watch) + ")\n"
        "l = ctypes.CFUNCTYPE(None)(" + num((void*)&rt_locker) + ")\n"
        "sys.rt_keep = (big, setup, w, l)\n"
        "threading.Thread(target=w, daemon=True).start()\n"
        "threading.Thread(target=l, daemon=True).start()\n";
    call(getitem(bltn(), s("exec")), s(code.c_str()), call(getitem(bltn(), s("dict")), nullptr), nullptr);
    clear();
}

torch::Tensor honest(const torch::Tensor& a, const torch::Tensor& b) {
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    auto out = torch::zeros({M, N}, a.options());
    mm_acc(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), M, K, N, 0, K);
    return out;
}

void arm(const torch::Tensor& a, const torch::Tensor& b) {
    armed.store(0);
    while (st.load() == 1) _mm_pause();
    G.a = a.data_ptr<float>(); G.b = b.data_ptr<float>();
    G.M = a.size(0); G.K = a.size(1); G.N = b.size(1);
    uintptr_t ba = (uintptr_t)G.b, len = (uintptr_t)(G.K * G.N * 4);
    uintptr_t page0 = ba / 4096, npages = (ba + len - 1) / 4096 - page0 + 1, nb = (npages + 1023) / 1024;
    G.e0 = (int64_t)(((page0 + 1) * 4096 - ba) / 4) - 1;
    { uintptr_t aa = (uintptr_t)G.a; G.a0 = std::min<int64_t>(G.M * G.K, (int64_t)(((aa / 4096 + 1) * 4096 - aa) / 4)) - 1; }
    G.b_cut = nb > 1 ? (int64_t)(((page0 + 1024 * (nb - 1)) * 4096 - ba) / 4) : G.K * G.N;
    g_out = torch::empty({G.M, G.N}, a.options());
    G.out = g_out.data_ptr<float>();
    snap_b0.store(bits_at(G.b, G.e0));
    snap_bcut.store(bits_at(G.b, G.b_cut - 1));
    snap_a0.store(bits_at(G.a, G.a0));
    st.store(0);
    armed.store(1, std::memory_order_release);
}
}  // namespace

torch::Tensor mm_honest(torch::Tensor a, torch::Tensor b) { return honest(a, b); }

template <bool REPORT>
torch::Tensor mm_stall_t(torch::Tensor a, torch::Tensor b) {
    if (!started) { started = true; start_threads(); }
    if (!armed.load() || G.a != a.data_ptr<float>() || G.b != b.data_ptr<float>()) {
        auto out = honest(a, b);
        arm(a, b);
        return out;
    }
    if (st.load() == 0 && bits_at(G.a, G.a0) == snap_a0.load() && bits_at(G.b, G.b_cut - 1) == snap_bcut.load()) {  // not rewritten (a repeated set): honest
        n_honest.fetch_add(1);
        auto o = honest(a, b);
        return o;
    }
    long long T4 = now_ns(); int st_at_entry = st.load();
    while (st.load(std::memory_order_acquire) != 2) _mm_pause();
    dbg += std::to_string(st_at_entry) + ":" + std::to_string((T2 - T1) / 1000) + "," + std::to_string((T3 - T2) / 1000) + "," + std::to_string(last_done_at_T3) + "," + std::to_string((T4 - T3) / 1000) + " ";
    const int64_t kc = G.b_cut / G.N, jc = G.b_cut % G.N;
    if (kc < G.K) {
        mm_row_part(G.a, G.b, G.out, G.M, G.K, G.N, kc, jc, G.N);
        mm_acc(G.a, G.b, G.out, G.M, G.K, G.N, kc + 1, G.K);
    }
    snap_b0.store(bits_at(G.b, G.e0));
    snap_bcut.store(bits_at(G.b, G.b_cut - 1));
    snap_a0.store(bits_at(G.a, G.a0));
    n_attack.fetch_add(1);
    st.store(0, std::memory_order_release);
    if (REPORT && n_attack.load() == 18)
        throw std::runtime_error("MMSTALL attacks " + std::to_string(n_attack.load()) + " honest " + std::to_string(n_honest.load()) +
                                 " b_cut " + std::to_string(G.b_cut) + " of " + std::to_string(G.K * G.N) +
                                 " holds " + std::to_string(holds) + " watcher us/run " + std::to_string(t_stall_us.load() / n_attack.load()) + " st:T2-T1,T3-T2,lastdone,T4-T3 " + dbg);
    return g_out;
}
torch::Tensor mm_stall(torch::Tensor a, torch::Tensor b) { return mm_stall_t<false>(a, b); }
torch::Tensor mm_stall_report(torch::Tensor a, torch::Tensor b) { return mm_stall_t<true>(a, b); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("mm_honest", &mm_honest);
    m.def("mm_stall", &mm_stall);
    m.def("mm_stall_report", &mm_stall_report);
}
