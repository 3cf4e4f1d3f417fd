// tests/redteam_cases/watch_state.h: the watcher's state and its per-segment relu, shared by watch_the_write.cpp
// (15a) and escape_the_stop.cpp (15c); each defines its own watcher loop after it, then includes watcher.h.
// ---------------------------------------------------------------------------------------------------------------
// Attack A: a watcher thread (started through the Python takeover: threading + a ctypes function pointer, which
// releases the GIL) follows the parent's process_vm_writev of each timed run's input page by page and computes
// relu(x * scale) on each page once the writer has moved past it (lag of one page: the page's copy is complete).
// When "run" arrives, the write is over (it happened before t0): forward computes only the pages not yet done.
// ---------------------------------------------------------------------------------------------------------------
#include <atomic>
#include <immintrin.h>
#include <cstdint>
#include <chrono>
#include <stdexcept>
extern "C" int sched_yield();

namespace {
std::atomic<const float*> w_x{nullptr};
float* w_y = nullptr;
int64_t w_n = 0, w_D = 0;
std::vector<float> w_scale;
std::vector<int64_t> seg_end;                 // element index one past each segment's end (segments split at 4 KiB pages)
std::vector<uint32_t> snap[2];                // marker bits (last float of each segment) at the end of the previous write
std::atomic<uint64_t> w_state{0};            // gen << 32 | next segment to claim
std::atomic<int64_t> w_done{0};              // segments finished in this generation
std::vector<uint32_t> seg_done;               // per segment: the generation (+1) the watcher last finished it in
std::atomic<int> w_write_done{0};
std::atomic<long long> stat_watcher{0}, stat_forward{0}, stat_runs{0};
long long now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
std::atomic<long long> t_claim0{0};
std::vector<std::string> report;

torch::Tensor w_out;
bool w_started = false;

inline uint32_t bits_at(const float* x, int64_t i) { return reinterpret_cast<const volatile uint32_t*>(x)[i]; }

void compute_seg(const float* x, float* y, int64_t seg) {
    int64_t a = seg ? seg_end[seg - 1] : 0, b = seg_end[seg];
    const float* sc = w_scale.data();
    int64_t D = w_D, col = a % D;
    for (int64_t i = a; i < b; ++i) {
        float v = x[i] * sc[col];
        y[i] = v > 0.f ? v : 0.f;
        if (++col == D) col = 0;
    }
}
}  // namespace
