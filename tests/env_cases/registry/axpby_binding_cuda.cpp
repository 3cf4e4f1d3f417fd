#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include "binding_registry.h"

extern "C" void axpby_launcher(const float* x, const float* y, float* out, float alpha, float beta, int64_t n,
                               int config, cudaStream_t stream);

torch::Tensor axpby(torch::Tensor x, torch::Tensor y, double alpha, double beta) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && y.is_contiguous() && x.dtype() == torch::kFloat32,
              "contiguous float32 CUDA tensors expected");
  auto out = torch::empty_like(x);
  axpby_launcher(x.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(), (float)alpha, (float)beta, x.numel(),
                 256, at::cuda::getCurrentCUDAStream());
  return out;
}

REGISTER_BINDING(axpby, axpby);
