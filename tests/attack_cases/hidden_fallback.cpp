// PyTorch operators issued where the dispatch monitor does not look: threads other than the one running forward().
// Each returns relu(x * scale) computed by PyTorch, not by a kernel.
#include <torch/extension.h>
#include <omp.h>

torch::Tensor fallback_in_omp_worker(torch::Tensor x, torch::Tensor scale) {
    torch::Tensor out;
#pragma omp parallel num_threads(2)
    {
        if (omp_get_thread_num() == omp_get_num_threads() - 1) out = (x * scale).relu();
    }
    return out;
}

torch::Tensor fallback_in_parallel_for(torch::Tensor x, torch::Tensor scale) {
    torch::Tensor out;
    at::parallel_for(0, 2, 1, [&](int64_t b, int64_t e) { if (e == 2) out = x.mul(scale).clamp_min(0); });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("fallback_in_omp_worker", &fallback_in_omp_worker);
    m.def("fallback_in_parallel_for", &fallback_in_parallel_for);
}
