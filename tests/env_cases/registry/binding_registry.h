// A registry of pybind11 bindings: each kernels/*_binding.cpp registers its functions at static-init
// time, and binding.cpp applies them all inside the one PYBIND11_MODULE. Same layout as CUDA Agent's
// released workspace; written for this project.
#pragma once
#include <torch/extension.h>
#include <functional>
#include <vector>

class BindingRegistry {
 public:
  using Binder = std::function<void(pybind11::module_&)>;
  static BindingRegistry& getInstance() {
    static BindingRegistry registry;
    return registry;
  }
  void add(Binder binder) { binders_.push_back(std::move(binder)); }
  void applyBindings(pybind11::module_& m) {
    for (auto& b : binders_) b(m);
  }

 private:
  std::vector<Binder> binders_;
};

#define REGISTER_BINDING(NAME, FUNC)                                                   \
  static const bool registered_##NAME = (BindingRegistry::getInstance().add(           \
      [](pybind11::module_& m) { m.def(#NAME, &FUNC); }), true)
