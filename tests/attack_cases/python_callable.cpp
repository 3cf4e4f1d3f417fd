// Python handed to a kernel: model_new.py passes a bound method of its own, which computes with PyTorch; the kernel
// calls it inside a guard that excludes the Python dispatch keys (restored before it returns), or from an OpenMP
// worker (no dispatch mode there). The callable arrives as a pybind11::handle (decltype of module_::get_type()).
// (The test prepends `constexpr int kPython = N, kSnapshot = M;`: the keys' numbers in the installed torch.)
#include <torch/extension.h>
#include <utility>

using Guard = decltype(std::declval<at::AutoNonVariableTypeMode&>().autograd_guard_);  // ExcludeDispatchKeyGuard
using Keys = decltype(std::declval<at::Tensor&>().key_set());
using Key = decltype(std::declval<Keys&>().highestPriorityTypeId());
using Handle = decltype(std::declval<pybind11::module_&>().get_type());                 // pybind11::handle

static Keys python_keys() { return Keys(static_cast<Key>(kPython)) | Keys(static_cast<Key>(kSnapshot)); }

torch::Tensor unseen(Handle f, torch::Tensor x) {
    Guard g(python_keys());
    return f(x).cast<torch::Tensor>();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("unseen", &unseen);
}
