// Pure CUDA kernel: no torch headers, so nvcc stays fast.
#include <cstdint>
#include <cuda_runtime.h>

__global__ void axpby_kernel(const float* __restrict__ x, const float* __restrict__ y, float* __restrict__ out,
                             float alpha, float beta, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) out[i] = alpha * x[i] + beta * y[i];
}

extern "C" void axpby_launcher(const float* x, const float* y, float* out, float alpha, float beta, int64_t n,
                               int config, cudaStream_t stream) {
  int threads = config > 0 ? config : 256;
  int64_t blocks = (n + threads - 1) / threads;
  axpby_kernel<<<blocks, threads, 0, stream>>>(x, y, out, alpha, beta, n);
}
