#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <unordered_map>

using torch::Tensor;
extern "C" void relu_scale_launcher(const float*, const float*, float*, int64_t, int64_t, cudaStream_t);
extern "C" void add_launcher(const float*, const float*, float*, int64_t, cudaStream_t);
extern "C" void matmul_launcher(const float*, const float*, float*, int, int, int, cudaStream_t);
extern "C" void side_stream_relu_scale_launcher(const float*, const float*, float*, int64_t, int64_t);
extern "C" void oob_launcher(float*, cudaStream_t);

static cudaStream_t cur() { return at::cuda::getCurrentCUDAStream(); }

Tensor relu_scale(Tensor x, Tensor s) {
  auto y = torch::empty_like(x);
  relu_scale_launcher(x.data_ptr<float>(), s.data_ptr<float>(), y.data_ptr<float>(), x.numel(), s.numel(), cur());
  return y;
}
Tensor add(Tensor a, Tensor b) {
  auto y = torch::empty_like(a);
  add_launcher(a.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(), a.numel(), cur());
  return y;
}
Tensor matmul(Tensor a, Tensor b) {
  auto c = torch::empty({a.size(0), b.size(1)}, a.options());
  matmul_launcher(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), a.size(0), a.size(1), b.size(1), cur());
  return c;
}
// cheats
Tensor relu_scale_cached(Tensor x, Tensor s) {
  static std::unordered_map<const void*, Tensor> cache;
  auto it = cache.find(x.data_ptr());
  if (it != cache.end()) return it->second;
  return cache[x.data_ptr()] = relu_scale(x, s);
}
Tensor relu_scale_side_stream(Tensor x, Tensor s) {
  auto y = torch::empty_like(x);
  side_stream_relu_scale_launcher(x.data_ptr<float>(), s.data_ptr<float>(), y.data_ptr<float>(), x.numel(), s.numel());
  return y;
}
Tensor relu_scale_part_after_checks(Tensor x, Tensor s) {  // after 8 calls: the first quarter only
  static int calls = 0;
  auto y = torch::zeros_like(x);
  relu_scale_launcher(x.data_ptr<float>(), s.data_ptr<float>(), y.data_ptr<float>(), calls++ < 8 ? x.numel() : x.numel() / 4,
                      s.numel(), cur());
  return y;
}
Tensor oob(Tensor x) { oob_launcher(x.data_ptr<float>(), cur()); return x; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("relu_scale", &relu_scale);
  m.def("add", &add);
  m.def("matmul", &matmul);
  m.def("relu_scale_cached", &relu_scale_cached);
  m.def("relu_scale_side_stream", &relu_scale_side_stream);
  m.def("oob", &oob);
  m.def("relu_scale_part_after_checks", &relu_scale_part_after_checks);
}
