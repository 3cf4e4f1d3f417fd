// tests/redteam_cases/watcher.h: the part of relu_watch that watch_the_write.cpp (15a) and escape_the_stop.cpp
// (15c) share, included where each defines it (after its watcher thread and its state).
void arm(const torch::Tensor& x, const torch::Tensor& scale) {
    w_x.store(nullptr);
    // (wait for the watcher to be idle: it only touches w_x's memory after loading it non-null; give it a moment)
    for (int k = 0; k < 100000; ++k) _mm_pause();
    const float* px = x.data_ptr<float>();
    w_n = x.numel(); w_D = scale.numel();
    w_scale.assign(scale.data_ptr<float>(), scale.data_ptr<float>() + w_D);
    seg_end.clear();
    uintptr_t base = (uintptr_t)px;
    for (int64_t i = 0; i < w_n;) {
        uintptr_t page_end = ((base + 4 * i) / 4096 + 1) * 4096;
        int64_t e = std::min<int64_t>(w_n, (int64_t)((page_end - base) / 4));
        seg_end.push_back(e);
        i = e;
    }
    w_out = torch::empty_like(x);
    w_y = w_out.data_ptr<float>();
    for (int k = 0; k < 2; ++k) snap[k].assign(seg_end.size(), 0);
    seg_done.assign(seg_end.size(), 0);
    uint32_t gen = (uint32_t)(w_state.load() >> 32) + 1;
    for (size_t j = 0; j < seg_end.size(); ++j) snap[gen & 1][j] = bits_at(px, seg_end[j] - 1);
    w_done.store(0);
    w_state.store((uint64_t)gen << 32);
    w_x.store(px, std::memory_order_release);
}
}  // namespace

torch::Tensor relu_fast(torch::Tensor x, torch::Tensor scale) {  // honest, vectorisable, one thread
    const int64_t n = x.numel(), D = scale.numel();
    const float *px = x.data_ptr<float>(), *ps = scale.data_ptr<float>();
    auto y = torch::empty_like(x);
    float* py = y.data_ptr<float>();
    for (int64_t r = 0; r < n / D; ++r)
        for (int64_t j = 0; j < D; ++j) { float v = px[r * D + j] * ps[j]; py[r * D + j] = v > 0.f ? v : 0.f; }
    return y;
}

torch::Tensor reuse_out;
torch::Tensor relu_fast_reuse(torch::Tensor x, torch::Tensor scale) {  // honest, one thread, its output buffer reused
    const int64_t n = x.numel(), D = scale.numel();
    const float *px = x.data_ptr<float>(), *ps = scale.data_ptr<float>();
    if (!reuse_out.defined() || reuse_out.sizes() != x.sizes()) reuse_out = torch::empty_like(x);
    float* py = reuse_out.data_ptr<float>();
    for (int64_t r = 0; r < n / D; ++r)
        for (int64_t j = 0; j < D; ++j) { float v = px[r * D + j] * ps[j]; py[r * D + j] = v > 0.f ? v : 0.f; }
    return reuse_out;
}

torch::Tensor relu_fast2(torch::Tensor x, torch::Tensor scale) {  // the same on 2 threads (num_threads clause)
    const int64_t n = x.numel(), D = scale.numel();
    const float *px = x.data_ptr<float>(), *ps = scale.data_ptr<float>();
    auto y = torch::empty_like(x);
    float* py = y.data_ptr<float>();
#pragma omp parallel for num_threads(2) schedule(static)
    for (int64_t r = 0; r < n / D; ++r)
        for (int64_t j = 0; j < D; ++j) { float v = px[r * D + j] * ps[j]; py[r * D + j] = v > 0.f ? v : 0.f; }
    return y;
}

template <bool REPORT>
torch::Tensor relu_watch_t(torch::Tensor x, torch::Tensor scale) {
    if (!w_started) { w_started = true; start_watcher(); }
    const float* px = x.data_ptr<float>();
    if (w_x.load() != px || w_n != x.numel()) {  // a new input buffer: compute honestly, watch it from now on
        auto y = relu_fast(x, scale);
        arm(x, scale);
        return y;
    }
    stat_runs.fetch_add(1);
    long long t_in = now_ns(); long long fw0 = stat_forward.load();
    // the write is complete (it ended before the clock started): take every segment the watcher has not claimed
    int64_t nseg = (int64_t)seg_end.size();
    uint64_t st = w_state.load();
    uint32_t gen = st >> 32;
    for (;;) {
        int64_t i = (int64_t)(st & 0xffffffffu);
        if (i >= nseg) break;
        if (!w_state.compare_exchange_weak(st, st + 1)) continue;
        snap[(gen + 1) & 1][i] = bits_at(px, seg_end[i] - 1);
        compute_seg(px, w_y, i);
        seg_done[i] = gen + 1;
        stat_forward.fetch_add(1);
        w_done.fetch_add(1);
        st = w_state.load();
    }
    // a segment the watcher claimed but has not finished (it may have been preempted): computed here too (the same
    // values; the watcher's late stores write them again)
    if (w_done.load(std::memory_order_acquire) < nseg) {
        int64_t upto = (int64_t)(w_state.load() & 0xffffffffu);
        for (int64_t i = 0; i < upto && i < nseg; ++i)
            if (reinterpret_cast<volatile uint32_t*>(seg_done.data())[i] != gen + 1) { compute_seg(px, w_y, i); stat_forward.fetch_add(1); }
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    // segments whose marker did not change were claimed above by forward (same values, or a repeated set)
    w_done.store(0);
    w_state.store((uint64_t)(gen + 1) << 32);  // next generation compares against this write's markers
    long long t_out = now_ns();
