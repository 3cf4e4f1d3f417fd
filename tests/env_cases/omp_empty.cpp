// Honest: relu(x * scale) computed by the kernel; each OpenMP thread allocates its own scratch row with torch::empty
// (whose inline code makes an autograd ExcludeDispatchKeyGuard on that worker thread), and the output is allocated
// inside the parallel region too (by thread 0).
#include <torch/extension.h>
#include <omp.h>

torch::Tensor relu_scale(torch::Tensor x, torch::Tensor scale) {
    TORCH_CHECK(x.is_contiguous() && scale.is_contiguous());
    const int64_t rows = x.size(0), cols = x.size(1);
    torch::Tensor out;
    const float* xp = x.data_ptr<float>();
    const float* sp = scale.data_ptr<float>();
    #pragma omp parallel
    {
        #pragma omp single
        out = torch::empty({rows, cols}, x.options());
        torch::Tensor scratch = torch::empty({cols}, x.options());  // per-thread, made and freed on a worker
        float* t = scratch.data_ptr<float>();
        float* op = out.data_ptr<float>();
        #pragma omp for
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t c = 0; c < cols; ++c) {
                float v = xp[r * cols + c] * sp[c];
                t[c] = v > 0.f ? v : 0.f;
            }
            for (int64_t c = 0; c < cols; ++c) op[r * cols + c] = t[c];
        }
    }
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("relu_scale", &relu_scale);
}
