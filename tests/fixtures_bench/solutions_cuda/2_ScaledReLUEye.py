"""CUDA, known-good, KernelBench single-file format with functions= (the converter generates the
pybind registration). Expected on the GPU: pass."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

scale_relu_cuda = r'''__global__ void scale_relu_kernel(const float* __restrict__ x, const float* __restrict__ s, float* __restrict__ y,
                                  long long n, long long d) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i] * s[i % d];
        y[i] = v > 0.f ? v : 0.f;
    }
}

torch::Tensor scale_relu(torch::Tensor x, torch::Tensor scale) {
    TORCH_CHECK(x.is_cuda() && x.is_contiguous() && scale.is_contiguous(), "contiguous CUDA tensors expected");
    auto y = torch::empty_like(x);
    const long long n = x.numel(), d = scale.numel();
    const int threads = 256;
    scale_relu_kernel<<<(n + threads - 1) / threads, threads>>>(x.data_ptr<float>(), scale.data_ptr<float>(),
                                                                y.data_ptr<float>(), n, d);
    return y;
}
'''
scale_relu_cpp = "torch::Tensor scale_relu(torch::Tensor x, torch::Tensor scale);"

scale_relu = load_inline(name="scale_relu", cpp_sources=scale_relu_cpp, cuda_sources=scale_relu_cuda,
                         functions=["scale_relu"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))
        self.op = scale_relu

    def forward(self, x):
        return self.op.scale_relu(x, self.scale)
