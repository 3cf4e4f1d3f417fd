// A DataPtr deleter (a function pointer held in data) runs the kernel's code outside every extension call. `arm`
// (called from ModelNew.__init__) returns a tensor whose storage's DataPtr has a deleter of ours; forward drops that
// tensor (self.tok = None), and the deleter, run there, leaks an ExcludeDispatchKeyGuard of the Python keys (as in
// tests/attack_cases/dispatch_keys.cpp): every later PyTorch operator on that thread is hidden from the monitor, and
// no extension call sees the change.
#include <torch/extension.h>
#include <utility>
// (The test prepends `constexpr int kPython = N, kSnapshot = M;`: the keys' numbers in the installed torch.)
using Guard = decltype(std::declval<at::AutoNonVariableTypeMode&>().autograd_guard_);
using Keys = decltype(std::declval<at::Tensor&>().key_set());
using Key = decltype(std::declval<Keys&>().highestPriorityTypeId());

static float cell[4];
static void on_free(void*) { new Guard(Keys(static_cast<Key>(kPython)) | Keys(static_cast<Key>(kSnapshot))); }

torch::Tensor arm(torch::Tensor x) {
    auto t = torch::empty({1}, x.options());
    t.storage().set_data_ptr_noswap(c10::DataPtr(cell, cell, &on_free, t.device()));
    return t;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("arm", &arm); }
