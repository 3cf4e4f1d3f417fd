#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

extern "C" void launch_scale_relu(const float* x, const float* s, float* y, long long n, long long d, cudaStream_t stream);

torch::Tensor forward(torch::Tensor x, torch::Tensor scale) {
    TORCH_CHECK(x.is_cuda() && x.is_contiguous() && scale.is_contiguous(), "contiguous CUDA tensors expected");
    TORCH_CHECK(x.scalar_type() == torch::kFloat && scale.scalar_type() == torch::kFloat, "float32 expected");
    auto y = torch::empty_like(x);
    launch_scale_relu(x.data_ptr<float>(), scale.data_ptr<float>(), y.data_ptr<float>(), x.numel(), scale.numel(),
                      c10::cuda::getCurrentCUDAStream());
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
