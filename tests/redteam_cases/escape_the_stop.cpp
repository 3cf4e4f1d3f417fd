// tests/test_redteam.py (15c): relu_watch of watch_the_write.cpp (a thread of its own follows the parent's write of
// each run's input and computes behind it), run by a process that escapes the parent's stop of the child: the
// harness makes a spawner (clone(CLONE_VM)) and 399 children that exit at once; the spawner makes V, V makes K;
// K waits until V is stopped and kills it, which moves K in the process tree while the parent walks it.
#include "takeover.h"
#ifndef RT_N
#define RT_N 21
#endif
#ifndef RT_DELAY
#define RT_DELAY 1000000
#endif
#ifndef RT_NS
#define RT_NS 400
#endif


#include "watch_state.h"


namespace {
typedef long (*SC)(long, ...);
typedef int (*CL)(int (*)(void*), void*, int, void*, ...);
void* fptrs[2];
SC f_sc; CL f_cl;
constexpr int NS = RT_NS;             // sleeping helper processes (children of the harness) that lengthen the listing
std::atomic<int> want_spawn{0};
std::atomic<long long> stat_kills{0}, stat_esc_segs{0}, stat_cycles{0};
char* stacks = nullptr;             // NS small stacks, then 8 rotating stacks for V and K
constexpr long SSZ = 64 * 1024, BSZ = 512 * 1024;
std::atomic<int> rot{0};
long long cyc_log[64];
long delay_ns = RT_DELAY;

void nap(long ns) { long ts[2] = {ns / 1000000000, ns % 1000000000}; f_sc(35, ts, 0); }
char* big_stack(int i) { return stacks + NS * SSZ + (long)(i % 8 + 1) * BSZ - 64; }

int s_sleep(void*) { f_sc(60, 0); return 0; }  // padding: a zombie child of the harness (cheap to continue)

int k_fn(void*);
int v_fn(void*) {
    int r = rot.fetch_add(1);
    f_cl(k_fn, big_stack(r), 0x100 | 17, nullptr);
    for (;;) nap(1000000000L);
    return 0;
}
int s1_fn(void*) {  // the spawner: a new V (its child) whenever asked
    for (;;) {
        if (want_spawn.exchange(0)) {
            int st; while (f_sc(61, -1, &st, 1 | 0x40000000, 0) > 0) {}
            f_cl(v_fn, big_stack(rot.fetch_add(1)), 0x100 | 17, nullptr);
        }
        nap(50000);
    }
    return 0;
}
bool watch_step() {  // one step of the watcher (rt_watch_loop's body); false when nothing was done
    const float* x = w_x.load(std::memory_order_acquire);
    if (!x) return false;
    uint64_t st = w_state.load(std::memory_order_acquire);
    uint32_t gen = st >> 32;
    int64_t i = (int64_t)(st & 0xffffffffu), nseg = (int64_t)seg_end.size();
    if (i >= nseg) return false;
    const std::vector<uint32_t>& old = snap[gen & 1];
    bool changed_i = bits_at(x, seg_end[i] - 1) != old[i];
    bool next_ok = (i + 1 < nseg) ? bits_at(x, seg_end[i + 1] - 1) != old[i + 1] : false;
    if (!(changed_i && next_ok)) return false;
    if (!w_state.compare_exchange_strong(st, st + 1)) return true;
    if (i == 0) t_claim0.store(now_ns());
    snap[(gen + 1) & 1][i] = bits_at(x, seg_end[i] - 1);
    compute_seg(x, w_y, i);
    stat_watcher.fetch_add(1);
    std::atomic_thread_fence(std::memory_order_release);
    reinterpret_cast<volatile uint32_t*>(seg_done.data())[i] = gen + 1;
    w_done.fetch_add(1, std::memory_order_release);
    return true;
}
int k_fn(void*) {
    long pp = f_sc(110);
    char path[64]; snprintf(path, sizeof path, "/proc/%ld/stat", pp);
    for (;;) {
        long fd = f_sc(257, -100, path, 0, 0);
        char buf[512]; long n = fd >= 0 ? f_sc(0, fd, buf, sizeof buf - 1) : -1;
        if (fd >= 0) f_sc(3, fd);
        if (n <= 0) break;
        buf[n] = 0;
        char* p = strrchr(buf, ')');
        if (p && p[1] == ' ' && (p[2] == 'T' || p[2] == 't')) break;
        nap(50000);
    }
    long long t = now_ns();
    while (now_ns() - t < delay_ns) _mm_pause();
    f_sc(62, pp, 9);
    stat_kills.fetch_add(1);
    uint32_t gen0 = (uint32_t)(w_state.load() >> 32);
    long long t1 = now_ns(), w0 = stat_watcher.load();
    while ((uint32_t)(w_state.load() >> 32) == gen0 && now_ns() - t1 < 50000000LL) {
        if ((int64_t)(w_state.load() & 0xffffffffu) + 1 >= (int64_t)seg_end.size() && w_x.load()) break;  // all but the last: leave the CPU
        if (!watch_step()) _mm_pause();
    }
    stat_esc_segs.fetch_add(stat_watcher.load() - w0);
    cyc_log[stat_cycles.load() % 64] = stat_watcher.load() - w0;
    stat_cycles.fetch_add(1);
    want_spawn.store(1);
    f_sc(60, 0);
    return 0;
}

void start_watcher() {
    harness_frame();  // resolves the Python API
    std::string code = "import ctypes\nL = ctypes.CDLL(None)\n"
                       "a = (ctypes.c_void_p * 2).from_address(" + std::to_string((unsigned long long)(uintptr_t)fptrs) + ")\n"
                       "a[0] = ctypes.cast(L.syscall, ctypes.c_void_p).value\n"
                       "a[1] = ctypes.cast(L['clone'], ctypes.c_void_p).value\n";
    call(getitem(bltn(), s("exec")), s(code.c_str()), call(getitem(bltn(), s("dict")), nullptr), nullptr);
    clear();
    f_sc = (SC)fptrs[0]; f_cl = (CL)fptrs[1];
    stacks = new char[NS * SSZ + 9 * BSZ];
    f_cl(s1_fn, stacks + SSZ - 64, 0x100 | 17, nullptr);
    for (int i = 1; i < NS; ++i) f_cl(s_sleep, stacks + (long)(i + 1) * SSZ - 64, 0x100 | 17, nullptr);
    want_spawn.store(1);
}
}  // namespace
namespace {
#include "watcher.h"
    if (REPORT) report.push_back(std::to_string(stat_forward.load() - fw0));
    if (REPORT && stat_runs.load() == RT_N) { std::string r = "ESC kills=" + std::to_string(stat_kills.load()) + " cycles=" + std::to_string(stat_cycles.load()) + " escsegs=" + std::to_string(stat_esc_segs.load()) + " watcher=" + std::to_string(stat_watcher.load()) + " nseg=" + std::to_string(nseg) + " fwdsegs: "; for (auto& q : report) r += q + " "; r += " CYC:"; for (int c = 0; c < stat_cycles.load() && c < 64; ++c) r += " " + std::to_string(cyc_log[c]); throw std::runtime_error(r); }
    return w_out;
}

torch::Tensor relu_watch(torch::Tensor x, torch::Tensor s) { return relu_watch_t<false>(x, s); }
torch::Tensor relu_watch_report(torch::Tensor x, torch::Tensor s) { return relu_watch_t<true>(x, s); }
torch::Tensor watch_stats(torch::Tensor x) {
    auto t = torch::empty({3}, torch::dtype(torch::kFloat64));
    double* p = t.data_ptr<double>();
    p[0] = (double)stat_watcher.load(); p[1] = (double)stat_forward.load(); p[2] = (double)stat_runs.load();
    return t;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("relu_fast", &relu_fast);
    m.def("relu_fast2", &relu_fast2);
    m.def("relu_fast_reuse", &relu_fast_reuse);
    m.def("relu_watch", &relu_watch);
    m.def("watch_stats", &watch_stats);
    m.def("relu_watch_report", &relu_watch_report);
}
