// A thread that outlives the call that started it, from OpenMP's old entry points (libgomp's GOMP_1.0 ABI): the master
// starts a team and returns without GOMP_parallel_end; the worker runs on, beside the harness's Python.
#include <torch/extension.h>
#include <omp.h>

extern "C" void GOMP_parallel_start(void (*fn)(void*), void* data, unsigned num_threads);

static volatile long ticks = 0;

static void background(void*) {
    if (omp_get_thread_num() == 0) return;  // (the master never calls it)
    for (;;) ticks = ticks + 1;
}

long start_background() { GOMP_parallel_start(background, nullptr, 2); return 0; }
long background_ticks() { return ticks; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("start_background", &start_background);
    m.def("background_ticks", &background_ticks);
}
