// One CPU extension shared by every env test: honest kernels, kernels that cheat, and kernels that
// misbehave. Each test workspace calls one function from it, so the whole suite pays for one build.
#include <torch/extension.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

using torch::Tensor;

// ---------------- honest kernels ----------------
Tensor relu_scale(Tensor x, Tensor scale) {  // relu(x * scale), x: (B, D), scale: (D,)
    auto y = torch::empty_like(x);
    const float *px = x.data_ptr<float>(), *ps = scale.data_ptr<float>();
    float* py = y.data_ptr<float>();
    const int64_t D = scale.numel(), B = x.numel() / D;
#pragma omp parallel for
    for (int64_t b = 0; b < B; ++b)
        for (int64_t d = 0; d < D; ++d) {
            float v = px[b * D + d] * ps[d];
            py[b * D + d] = v > 0.f ? v : 0.f;
        }
    return y;
}

Tensor add(Tensor a, Tensor b) {
    auto y = torch::empty_like(a);
    const float *pa = a.data_ptr<float>(), *pb = b.data_ptr<float>();
    float* py = y.data_ptr<float>();
    const int64_t n = a.numel();
#pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) py[i] = pa[i] + pb[i];
    return y;
}

Tensor softmax_lastdim(Tensor x) {
    auto y = torch::empty_like(x);
    const int64_t D = x.size(-1), R = x.numel() / D;
    const float* px = x.data_ptr<float>();
    float* py = y.data_ptr<float>();
#pragma omp parallel for
    for (int64_t r = 0; r < R; ++r) {
        float m = -INFINITY, s = 0.f;
        for (int64_t d = 0; d < D; ++d) m = std::max(m, px[r * D + d]);
        for (int64_t d = 0; d < D; ++d) s += (py[r * D + d] = std::exp(px[r * D + d] - m));
        for (int64_t d = 0; d < D; ++d) py[r * D + d] /= s;
    }
    return y;
}

Tensor matmul(Tensor a, Tensor b) {  // (M, K) @ (K, N)
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    auto y = torch::zeros({M, N}, a.options());
    const float *pa = a.data_ptr<float>(), *pb = b.data_ptr<float>();
    float* py = y.data_ptr<float>();
#pragma omp parallel for
    for (int64_t i = 0; i < M; ++i)
        for (int64_t k = 0; k < K; ++k) {
            const float v = pa[i * K + k];
            for (int64_t j = 0; j < N; ++j) py[i * N + j] += v * pb[k * N + j];
        }
    return y;
}

std::vector<Tensor> double_and_rowsum(Tensor x) {  // (2x, x.sum(-1))
    const int64_t D = x.size(-1), R = x.numel() / D;
    auto y = torch::empty_like(x);
    auto s = torch::empty({R}, x.options());
    const float* px = x.data_ptr<float>();
    float *py = y.data_ptr<float>(), *ps = s.data_ptr<float>();
#pragma omp parallel for
    for (int64_t r = 0; r < R; ++r) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) { py[r * D + d] = 2.f * px[r * D + d]; acc += px[r * D + d]; }
        ps[r] = acc;
    }
    return {y, s};
}

// ---------------- cheats ----------------
Tensor relu_scale_cached(Tensor x, Tensor scale) {  // output cache keyed by the input pointer
    static std::unordered_map<const void*, Tensor> cache;
    auto it = cache.find(x.data_ptr());
    if (it != cache.end()) return it->second;
    return cache[x.data_ptr()] = relu_scale(x, scale);
}

Tensor relu_scale_first_calls(Tensor x, Tensor scale) {  // real work only during the first 8 calls
    static int calls = 0;
    static Tensor last;
    if (calls++ < 8) last = relu_scale(x, scale);
    return last;
}

Tensor relu_scale_inplace(Tensor x, Tensor scale) {  // writes the answer into its input
    auto y = relu_scale(x, scale);
    std::memcpy(x.data_ptr<float>(), y.data_ptr<float>(), x.numel() * sizeof(float));
    return x;
}

Tensor relu_scale_strided_after_checks(Tensor x, Tensor scale) {  // after 8 calls: every 4th element only
    static int calls = 0;
    if (calls++ < 8) return relu_scale(x, scale);
    auto y = torch::zeros_like(x);
    const float *px = x.data_ptr<float>(), *ps = scale.data_ptr<float>();
    float* py = y.data_ptr<float>();
    const int64_t D = scale.numel(), n = x.numel();
    for (int64_t i = 0; i < n; i += 4) py[i] = std::max(px[i] * ps[i % D], 0.f);
    return y;
}

Tensor relu_scale_skips_a_residue_after_checks(Tensor x, Tensor scale) {  // after 8 calls: one element in 64 is left out
    static int calls = 0;
    if (calls++ < 8) return relu_scale(x, scale);
    auto y = torch::zeros_like(x);
    const float *px = x.data_ptr<float>(), *ps = scale.data_ptr<float>();
    float* py = y.data_ptr<float>();
    const int64_t D = scale.numel(), n = x.numel(), step = std::max<int64_t>(1, n / 65536);  // env.py's sample stride
    for (int64_t i = 0; i < n; ++i)
        if (i % step != step - 1) py[i] = std::max(px[i] * ps[i % D], 0.f);  // a sample misses it unless its offset is step-1
    return y;
}

// A stand-in for any cache keyed on input values: right on an input its process has not met, wrong (+1) on one it
// has, where such a cache would answer without computing. Its input's first 64 values are the key.
Tensor relu_scale_met_before(Tensor x, Tensor scale) {
    static std::unordered_map<uint64_t, int> met;
    const float* px = x.data_ptr<float>();
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < std::min<int64_t>(x.numel(), 64); ++i) {
        uint32_t bits;
        std::memcpy(&bits, px + i, sizeof bits);
        h = (h ^ bits) * 1099511628211ull;
    }
    auto y = relu_scale(x, scale);
    if (met[h]++) {
        float* py = y.data_ptr<float>();
        for (int64_t i = 0; i < y.numel(); ++i) py[i] += 1.f;
    }
    return y;
}

Tensor copy_of(Tensor x) {  // an honest copy kernel (used to return precomputed answers)
    auto y = torch::empty_like(x);
    std::memcpy(y.data_ptr<float>(), x.data_ptr<float>(), x.numel() * sizeof(float));
    return y;
}

// ---------------- faults ----------------
Tensor segfault(Tensor x) { volatile float* p = nullptr; p[12345] = 1.f; return x; }
Tensor spin(Tensor x) { volatile uint64_t i = 0; while (true) ++i; return x; }
Tensor huge_alloc(Tensor x) {
    size_t n = (size_t)64 << 30;  // 64 GiB
    char* p = (char*)std::malloc(n);
    if (p == nullptr) throw std::runtime_error("malloc of 64 GiB failed");
    for (size_t i = 0; i < n; i += 4096) p[i] = 1;
    return x;
}
Tensor spew(Tensor x) {
    for (int i = 0; i < 200000; ++i) std::printf("spam spam spam spam spam spam spam spam spam spam %d\n", i);
    std::fflush(stdout);
    return x;
}
Tensor throws(Tensor x) { TORCH_CHECK(false, "this kernel always fails: shape mismatch in my kernel"); return x; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("relu_scale", &relu_scale);
    m.def("add", &add);
    m.def("softmax_lastdim", &softmax_lastdim);
    m.def("matmul", &matmul);
    m.def("double_and_rowsum", &double_and_rowsum);
    m.def("relu_scale_cached", &relu_scale_cached);
    m.def("relu_scale_first_calls", &relu_scale_first_calls);
    m.def("relu_scale_inplace", &relu_scale_inplace);
    m.def("relu_scale_strided_after_checks", &relu_scale_strided_after_checks);
    m.def("relu_scale_skips_a_residue_after_checks", &relu_scale_skips_a_residue_after_checks);
    m.def("relu_scale_met_before", &relu_scale_met_before);
    m.def("copy_of", &copy_of);
    m.def("segfault", &segfault);
    m.def("spin", &spin);
    m.def("huge_alloc", &huge_alloc);
    m.def("spew", &spew);
    m.def("throws", &throws);
}
