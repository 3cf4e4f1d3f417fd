// tests/test_redteam.py (15a): relu_watch takes its process over through its own GOT (as python_from_kernel.cpp's
// kernels do), then runs a thread of its own (Python's threading, calling into this module through a ctypes pointer,
// which releases the GIL) that follows the parent's write of each run's input page by page and computes relu(x *
// scale) on every page the writer has passed; forward finishes the rest. relu_fast is the honest kernel.
#include "takeover.h"

#include "watch_state.h"

extern "C" void rt_watch_loop() {
    for (;;) {
        const float* x = w_x.load(std::memory_order_acquire);
        if (!x) { _mm_pause(); continue; }
        uint64_t st = w_state.load(std::memory_order_acquire);
        uint32_t gen = st >> 32;
        int64_t i = (int64_t)(st & 0xffffffffu), nseg = (int64_t)seg_end.size();
        if (i >= nseg) { _mm_pause(); continue; }
        const std::vector<uint32_t>& old = snap[gen & 1];
        // segment i is complete once the writer has changed segment i+1's marker (or i is the last and forward says so)
        bool changed_i = bits_at(x, seg_end[i] - 1) != old[i];
        bool next_ok = (i + 1 < nseg) ? bits_at(x, seg_end[i + 1] - 1) != old[i + 1] : false;
        if (!(changed_i && next_ok)) { _mm_pause(); continue; }
        if (!w_state.compare_exchange_strong(st, st + 1)) continue;  // claimed by forward (or a new generation)
        if (i == 0) t_claim0.store(now_ns());
        snap[(gen + 1) & 1][i] = bits_at(x, seg_end[i] - 1);
        compute_seg(x, w_y, i);
        stat_watcher.fetch_add(1);
        std::atomic_thread_fence(std::memory_order_release);
        reinterpret_cast<volatile uint32_t*>(seg_done.data())[i] = gen + 1;
        w_done.fetch_add(1, std::memory_order_release);
    }
}

namespace {
void start_watcher() {
    harness_frame();  // resolves the Python API
    std::string code = "import ctypes, threading, sys\n"
                       "f = ctypes.CFUNCTYPE(None)(" + std::to_string((unsigned long long)(uintptr_t)&rt_watch_loop) + ")\n"
                       "sys.rt_keep = f\n"
                       "threading.Thread(target=f, daemon=True).start()\n";
    call(getitem(bltn(), s("exec")), s(code.c_str()), call(getitem(bltn(), s("dict")), nullptr), nullptr);
    clear();
}

#include "watcher.h"
    if (REPORT) report.push_back(std::to_string((t_in - t_claim0.load()) / 1000) + "/" + std::to_string((t_out - t_in) / 1000) + "/" + std::to_string(stat_forward.load() - fw0));
    if (REPORT && stat_runs.load() == 21) { std::string r = "WATCH us(claim0->run)/us(in forward)/segs_by_forward nseg=" + std::to_string(nseg) + ": "; for (auto& q : report) r += q + " "; throw std::runtime_error(r); }
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
