// The dispatch monitor is a Python dispatch mode: an operator reaches it through the Python dispatch keys of the
// thread's dispatch state. A guard that excludes them, outliving the kernel call that made it, hides the PyTorch
// operators forward() runs after the call. The guard's class is on the C++ import allow-list (torch::empty_like's
// inline code uses it), and decltype names it and its key set without a refused word written.
// (The test prepends `constexpr int kPython = N, kSnapshot = M;`: the keys' numbers in the installed torch.)
#include <torch/extension.h>
#include <utility>

using Guard = decltype(std::declval<at::AutoNonVariableTypeMode&>().autograd_guard_);  // ExcludeDispatchKeyGuard
using Keys = decltype(std::declval<at::Tensor&>().key_set());
using Key = decltype(std::declval<Keys&>().highestPriorityTypeId());

static Keys python_keys() { return Keys(static_cast<Key>(kPython)) | Keys(static_cast<Key>(kSnapshot)); }

static Guard* held = nullptr;

// the keys stay excluded until show() (forward's operators in between go unseen)
torch::Tensor hide(torch::Tensor x) { held = new Guard(python_keys()); return x; }
torch::Tensor show(torch::Tensor x) { delete held; held = nullptr; return x; }
// the keys stay excluded for good: every later operator on this thread, in this run and the next ones
torch::Tensor hide_for_good(torch::Tensor x) { new Guard(python_keys()); return x; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("hide", &hide);
    m.def("show", &show);
    m.def("hide_for_good", &hide_for_good);
}
// (the test appends `static Guard* at_load = new Guard(python_keys());`: the module's loading leaves the keys
// excluded before the first run)
