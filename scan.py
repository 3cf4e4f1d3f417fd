"""scan.py: what a candidate's sources may contain. Both checks are allow-lists where one is possible.

model_new.py (`check_python`): an allow-list of Python. Imports from a fixed set; module-level constants;
top-level classes derived from nn.Module (no nested classes, no dunder methods but __init__); inside them plain
statements over names, literals, calls and attributes. Names come from an allow-list of builtins (the others may
not even be bound, so a method called `exec` cannot unlock the builtin), the file's own definitions and locals.
Every attribute chain that starts at an imported module is resolved at scan time and may not step into a module
outside the allowed set; `torch.X` only for X in an allow-list of constructors, dtypes and types, wherever torch
is reached; no attribute that starts with "_" or names a frame or code object (gi_, f_, co_...), so nothing
reaches torch.sys, torch.os, torch.utils, torch._C or a function's globals; no getattr/setattr/globals/vars/
eval/exec/open. What the allowed Python computes is judged at run time by the dispatch monitor.

C++/CUDA. First `check_directives` on every workspace file as written: only #include, #define, #undef, the
conditionals, #pragma, #error and #warning (after joining line splices, skipping comments, reading digraphs and
universal character names), and no `\u0023`. The scan below attributes the preprocessed text to files by its
line markers; a #line directive, a `# 1 "/usr/include/stdio.h" 1` marker, or text that prints as one (a raw
string line, a `\u0023`) would move the workspace's own code into a "system header" that is not scanned.
Then `check_tokens` on `split_preprocessed` output: the sources are run through the compiler's own
preprocessor with -dD, so macros, token pasting, digraphs, line continuations and computed includes are already
resolved, and a macro that a workspace file defines is scanned where it is defined (its body would otherwise be
read only where a header expands it: a `#define PyErr_Occurred()` expanded inside pybind11), and then:
  - every file a workspace file includes must be a workspace file, a torch/pybind11/Python/CUDA toolkit
    header, or a standard header from an allow-list (no <unistd.h>, <dlfcn.h>, <thread>, "/etc/passwd");
  - the tokens that come from workspace files (strings and comments removed) may not name the doors out of
    the process or around the monitor: processes, threads, signals, memory mapping, raw syscalls and inline
    assembly in host code, dynamic loading, files and the environment, the Python C API (its functions, and
    the object model's types and fields: `o->ob_type->tp_getattro` and `tp_call` reach exec) or pybind11
    beyond `m.def`, dispatch-key guards, thread pools, section names (copied verbatim into the assembler's
    input). `#pragma` lines are scanned too; symbol renaming
    (redefine_extname, weakref, alias, ifunc, symver) is refused, and a name with leading underscores or
    `__libc_` is checked without them (glibc's `__open`, `__libc_system`). Qualified names in
    torch/at/c10/pybind11 must be on an allow-list, so a namespace alias, `using` or a reopened `namespace at`
    cannot rename a compute op;
  - no header the workspace does not own is entered after a workspace #define with a body (`check_macro_order`):
    a macro expanded inside a system header is read nowhere, and its #define need not spell what it expands to
    (`__as ## m__`);
  - exactly one source contains the real expansion of PYBIND11_MODULE(TORCH_EXTENSION_NAME, m).
Finally the linked module, where spelling no longer matters: `check_imports` on its undefined symbols (no
PyTorch operator but allocation and views, on whatever thread it would run; no dispatcher by name, no thread
pool; no C function behind a closed door, under any of glibc's names, nor a thread: pthread_create,
thrd_create), and `check_instructions` on its machine code (no system call instruction).
"""
from __future__ import annotations

import ast
import builtins
import functools
import importlib
import os
import re
import threading
import types

# ---------------------------------------------------------------------------------------------- Python
# CPython 3.11 and 3.12 count the ast module's recursion depth per interpreter, not per thread: two threads building
# trees at once (one switched out inside ast.parse, say by a garbage collection that runs a finalizer) raise
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905). The parent's threads parse at
# once (agent.run_episodes: a teacher's episodes, every tool call's verdict), so every library parse takes one lock.
_AST_LOCK = threading.Lock()


def parse_python(source: str, mode: str = "exec") -> ast.AST:
    """ast.parse, one thread at a time (see _AST_LOCK)."""
    with _AST_LOCK:
        return ast.parse(source, mode=mode)


ALLOWED_IMPORTS = {"torch", "torch.nn", "torch.nn.functional", "math", "typing", "cuda_extension", "__future__"}
ALLOWED_BUILTINS = {"len", "range", "int", "float", "bool", "tuple", "list", "dict", "min", "max", "abs", "round", "zip",
                    "enumerate", "isinstance", "super", "print", "sum", "any", "all", "sorted", "reversed", "str", "divmod",
                    "pow", "slice", "None", "True", "False", "ValueError", "RuntimeError", "NotImplementedError",
                    "AssertionError", "TypeError", "self"}
TORCH_ATTRS = {  # torch.X that model_new.py may name: allocation, dtypes, types (compute is refused at run time)
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "randn",
    "rand", "randint", "arange", "Size", "device", "dtype", "Tensor", "nn", "cuda", "no_grad", "float32", "float16",
    "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool", "float", "half", "double", "long", "int",
    "contiguous_format", "channels_last", "is_tensor",
}
TORCH_CUDA_ATTRS = {"current_stream", "current_device", "is_available"}
ALLOWED_NODES = (
    ast.Module, ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Pass, ast.If, ast.For, ast.While,
    ast.Break, ast.Continue, ast.Assert, ast.Raise, ast.Delete, ast.FunctionDef, ast.ClassDef, ast.arguments, ast.arg,
    ast.Import, ast.ImportFrom, ast.alias, ast.Name, ast.Attribute, ast.Subscript, ast.Slice, ast.Starred, ast.Constant,
    ast.Tuple, ast.List, ast.Dict, ast.Call, ast.keyword, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp,
    ast.ListComp, ast.GeneratorExp, ast.comprehension, ast.JoinedStr, ast.FormattedValue, ast.Load, ast.Store, ast.Del,
    ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.expr_context,
)
# Modules whose attributes model_new.py may name (looked up here, at scan time: `nn.functional.importlib`,
# `typing.sys` or `nn.parallel` reach other modules, threads or eval); typing only for annotations.
ATTRIBUTE_MODULES = {"torch", "torch.nn", "torch.nn.functional", "torch.nn.init", "torch.cuda", "math"}
TYPING_ATTRS = {"Any", "List", "Tuple", "Dict", "Optional", "Union", "Sequence", "Callable", "Iterable", "Iterator",
                "Mapping", "Set", "FrozenSet", "Type", "Literal", "Final", "ClassVar", "TYPE_CHECKING"}
# A builtin outside the allow-list may not be bound either: `def exec(self)` in one method would otherwise make
# the builtin `exec` an "own definition" in every other. (`input` is a common argument name, and harmless.)
UNBINDABLE = set(dir(builtins)) - ALLOWED_BUILTINS - {"input"}
FRAME_ATTR_RE = re.compile(r"^(gi|cr|ag|f|tb|co)_")  # generator/frame/traceback/code internals: f_builtins, gi_frame
# An attribute of a value (not of an imported module, whose chains are resolved at scan time) is one of: the file's
# own (a method or attribute it defines), a tensor method that is an ATen operator (it goes through the dispatcher,
# where the monitor judges it at run time), a tensor's data attribute (shape, dtype: torch.Tensor's non-callable
# attributes), an nn layer's constant or parameter (in_features, weight), or one of these methods, which compute
# nothing: metadata, nn.Module's API, and Python containers' and strings' methods. Anything else (Tensor.map2_ runs a
# Python callable per element in C++ that never enters the dispatcher: reward +1 with no kernel) is refused, whatever
# its name, and the file's own names may not be another method of a tensor or a builtin type (`self.map2_ = ...`
# would make `out.map2_` "its own").
SAFE_METHODS = {
    "data_ptr", "float", "half", "double", "bfloat16", "int", "long", "bool", "type", "nelement", "ndimension",
    "is_floating_point", "is_complex", "dim_order", "parameters", "named_parameters", "buffers", "named_buffers",
    "children", "named_children", "modules", "named_modules", "register_buffer", "register_parameter",
    "register_module", "add_module", "state_dict", "load_state_dict", "eval", "train", "requires_grad_", "cpu",
    "extra_repr", "append", "extend", "insert", "pop", "index", "count", "keys", "values", "items", "get", "update",
    "setdefault", "copy", "join", "startswith", "endswith", "lower", "upper", "strip", "replace", "byte", "short",
    "char", "unique", "new_tensor", "is_shared", "const_data_ptr", "flatten_parameters", "cuda_stream",
}  # (not str.format: its field names, '{0.gi_frame.f_back}', walk attributes no scan reads)
LAYER_ATTRS = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked", "in_proj_weight", "in_proj_bias",
               "out_proj", "training", "num_heads", "embed_dim", "head_dim", "kdim", "vdim", "bias_k", "bias_v",
               "self_attn", "linear1", "linear2", "norm1", "norm2", "norm3", "dropout1", "dropout2", "dropout3",
               "activation", "layers", "transposed"}
RNN_PARAM_RE = re.compile(r"^(weight|bias)_(ih|hh|hr)_l\d+(_reverse)?$")  # nn.LSTM's weight_ih_l0, ...


@functools.lru_cache(maxsize=1)
def _value_attrs():
    """(attributes any value may name, names the file may not take for its own), built once."""
    import torch
    import torch.nn as nn
    tensor = {a for a in dir(torch.Tensor) if not a.startswith("_")}
    data = {a for a in tensor if not callable(getattr(torch.Tensor, a, None))} - {"grad_fn"}
    consts = {c for m in vars(nn).values() if isinstance(m, type) and issubclass(m, nn.Module)
              for c in (getattr(m, "__constants__", None) or [])}
    safe = data | consts | LAYER_ATTRS | SAFE_METHODS
    # names the file may not take for its own: another type's method that an own name would unlock on every value
    # (`def format(self)` would make '{0.gi_frame}'.format(...) "its own")
    kinds = (str, bytes, list, dict, tuple, set, frozenset, int, float, complex, object, type, types.FunctionType,
             types.MethodType, types.GeneratorType, torch.Tensor, torch.device, torch.dtype, torch.Size)  # (not nn.Module:
    # a ModelNew overrides its methods; they run Python of the file's own, which the monitor watches)
    # a tensor's methods that are ATen operators (dispatched: the monitor judges them when they run). Not every ATen
    # name: TorchScript's string and list builtins are ATen operators too (aten::format), and on a str they are Python's
    ops = {a for a in tensor if hasattr(torch.ops.aten, a)}
    shadow = {a for k in kinds for a in dir(k) if not a.startswith("_")} - safe - ops
    return safe | ops, shadow


BANNED_METHODS = {"numpy", "tolist", "as_subclass", "untyped_storage", "storage", "set_", "register_forward_hook",
                  "register_forward_pre_hook", "register_full_backward_hook", "apply_", "map_", "share_memory_", "backward"}


def check_python(source: str) -> list[str]:
    """Violations of the model_new.py allow-list (an empty list: the file is allowed)."""
    try:
        tree = parse_python(source)
    except SyntaxError as e:
        return [f"model_new.py line {e.lineno}: SyntaxError: {e.msg}"]
    out = []
    bad = lambda node, why: out.append(f"model_new.py line {getattr(node, 'lineno', '?')}: {why}")
    defined = set(ALLOWED_BUILTINS)
    nodes = list(ast.walk(tree))  # (walked once: the scan runs in the trainer's process, holding its GIL)
    for node in nodes:  # every name the file binds (imports, classes, functions, arguments, targets)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.alias):
            defined.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    torch_names = {a.asname or a.name for n in nodes if isinstance(n, ast.Import) for a in n.names
                   if a.name == "torch"} | {"torch"}
    aliases = _module_aliases(tree, bad)  # name -> the object an import binds it to
    ext_imports = {a.asname or a.name for n in nodes if isinstance(n, ast.Import) for a in n.names if a.name == "cuda_extension"}
    ext = set(ext_imports)
    # `X = cuda_extension` at the top level (evaluate.py's conversion of `X = load_inline(...)`) names it too, where X is
    # bound nowhere else (a local X = out would otherwise make out's attributes "the extension's")
    bound_by = lambda n: n.name if isinstance(n, (ast.FunctionDef, ast.ClassDef)) else n.arg if isinstance(n, ast.arg) \
        else n.id if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)) else None  # noqa: E731
    binds = {}
    for n in nodes:
        b = (n.asname or n.name).split(".")[0] if isinstance(n, ast.alias) else bound_by(n)
        binds[b] = binds.get(b, 0) + 1
    ext |= {n.targets[0].id for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Name) and n.value.id in ext
            and binds[n.targets[0].id] == 1}
    for node in nodes:
        bound = bound_by(node)
        if bound in UNBINDABLE:
            bad(node, f"the name {bound} is a builtin that model_new.py may not use; choose another name")
        elif bound in aliases or bound in ext_imports:
            bad(node, f"the name {bound} is an imported module's; choose another name")
    _check_module_attributes(nodes, aliases, bad)
    safe, shadow = _value_attrs()
    own = {n.name for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        n.attr for n in nodes if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    for name in sorted(own & shadow):
        bad(tree, f"the name {name} is a method of a tensor, module or builtin type; choose another name")

    memo = {}

    def module_of(node):  # the module an expression names (cuda_extension, nn.init), or None: a value, a class
        chain = []  # (iterative and memoised: a scan linear in the file, however deep its chains)
        while isinstance(node, ast.Attribute) and id(node) not in memo:
            chain.append(node)
            node = node.value
        if id(node) in memo:
            obj = memo[id(node)]
        elif isinstance(node, ast.Name):
            obj = node.id if node.id in ext else aliases.get(node.id)
        else:
            obj = None
        for n in reversed(chain):  # (an attribute of cuda_extension is a kernel's function, not a module)
            obj = getattr(obj, n.attr, None) if isinstance(obj, types.ModuleType) else None
            memo[id(n)] = obj
        return obj if isinstance(obj, (types.ModuleType, str)) else None

    for node in nodes:  # every class, nested ones too (a class in forward was not checked)
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            if node.keywords or node.decorator_list or not bases or any(b not in ("nn.Module", "torch.nn.Module") for b in bases):
                bad(node, f"class {node.name} must derive from nn.Module only (no decorators, metaclasses or other bases)")
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("__") and node.name != "__init__":
            bad(node, f"the method {node.name} is not allowed (__del__, __getattr__, __torch_function__... run "
                      "where nothing watches them)")
    for node in tree.body:  # the top level: docstring, imports, constants, classes
        if isinstance(node, ast.ClassDef):
            pass
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [("." * node.level) + (node.module or "")]
            for m in mods:
                if m not in ALLOWED_IMPORTS:
                    bad(node, f"import of {m} is not allowed (allowed: {', '.join(sorted(ALLOWED_IMPORTS))}); "
                              "only cuda_extension may compute")
        elif not (isinstance(node, (ast.Assign, ast.AnnAssign)) or
                  (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))):
            bad(node, f"only imports, constants and classes may appear at the top level, not {type(node).__name__}")
    for node in nodes:
        if not isinstance(node, ALLOWED_NODES):
            bad(node, f"{type(node).__name__} is not allowed in model_new.py")
        elif isinstance(node, ast.FunctionDef) and node.decorator_list:
            bad(node, "decorators are not allowed")
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and node not in tree.body:
            bad(node, "imports belong at the top of the file")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in defined:
            bad(node, f"the name {node.id} is not allowed")
        elif isinstance(node, ast.Name) and node.id.startswith("__") and node.id != "__future__":
            bad(node, f"the name {node.id} is not allowed")
        elif isinstance(node, ast.Attribute):
            if node.attr == "__init__" and ast.unparse(node.value) == "super()":
                continue  # super().__init__(...) is the one dunder a module needs
            if node.attr.startswith("_"):
                bad(node, f".{node.attr} is not allowed (no attribute that starts with an underscore)")
            elif node.attr in BANNED_METHODS or FRAME_ATTR_RE.match(node.attr):
                bad(node, f".{node.attr} is not allowed")
            elif isinstance(node.value, ast.Name) and node.value.id in torch_names and node.attr not in TORCH_ATTRS:
                bad(node, f"torch.{node.attr} is not allowed in model_new.py (allowed: allocation, dtypes, torch.nn); "
                          "write the computation as a kernel")
            elif (isinstance(node.value, ast.Attribute) and node.value.attr == "cuda" and isinstance(node.value.value, ast.Name)
                  and node.value.value.id in torch_names and node.attr not in TORCH_CUDA_ATTRS):  # (no unparse per
                # node: it made the scan quadratic in a chain's depth, minutes of the trainer's GIL for 1 MiB of chains)
                bad(node, f"torch.cuda.{node.attr} is not allowed")
            elif (isinstance(node.ctx, ast.Load) and node.attr not in own and node.attr not in safe
                  and not RNN_PARAM_RE.match(node.attr)
                  and module_of(node.value) is None):
                bad(node, f".{node.attr} is not allowed: an attribute of a value must be the file's own, a PyTorch "
                          "operator (judged when it runs), a tensor's data (shape, dtype...) or nn.Module API")
        elif isinstance(node, ast.Constant) and isinstance(node.value, bytes):
            bad(node, "bytes literals are not allowed")
    return list(dict.fromkeys(out))


_MISSING = object()


def _resolve(obj, attr: str, bad, node):
    """obj.attr for a trusted module object, or _MISSING with a violation when the step leaves the allow-list."""
    if isinstance(obj, types.ModuleType) and obj.__name__ == "typing" and attr not in TYPING_ATTRS:
        bad(node, f"typing.{attr} is not allowed (typing is for annotations: {', '.join(sorted(TYPING_ATTRS))})")
        return _MISSING
    name = obj.__name__ if isinstance(obj, types.ModuleType) else None
    if (name == "torch" and attr not in TORCH_ATTRS) or (name == "torch.cuda" and attr not in TORCH_CUDA_ATTRS):
        bad(node, f"{name}.{attr} is not allowed in model_new.py (reached through another module too)")
        return _MISSING
    value = getattr(obj, attr, _MISSING)
    if isinstance(value, types.ModuleType) and value.__name__ not in ATTRIBUTE_MODULES | ALLOWED_IMPORTS:
        bad(node, f"{attr} is the module {value.__name__}, which model_new.py may not reach")
        return _MISSING
    return value


def _module_aliases(tree, bad) -> dict:
    """{name: module} for every name an import binds to a module, resolved by importing the (allowed, trusted) module
    now; `from M import X` must name an allowed X."""
    aliases = {}
    trusted = ALLOWED_IMPORTS - {"cuda_extension", "__future__"}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in trusted:
                    name = a.asname or a.name.split(".")[0]
                    aliases[name] = importlib.import_module(a.name if a.asname else name)
        elif isinstance(node, ast.ImportFrom) and node.module in trusted and not node.level:
            mod = importlib.import_module(node.module)
            for a in node.names:
                if a.name == "*" or a.name.startswith("_") or (node.module == "torch" and a.name not in TORCH_ATTRS):
                    bad(node, f"from {node.module} import {a.name} is not allowed")
                    continue
                value = _resolve(mod, a.name, bad, node)
                if value is not _MISSING:
                    aliases[a.asname or a.name] = value
    return {k: v for k, v in aliases.items() if isinstance(v, types.ModuleType)}


def _check_module_attributes(nodes: list, aliases: dict, bad):
    """Every attribute chain that starts at an imported module is looked up now: it may not step into another module
    (importlib, sys, the threads of nn.parallel), and a module may only be used to name its attributes (no
    `m = nn.functional`, through which an unchecked chain could continue)."""
    parent = {c: n for n in nodes for c in ast.iter_child_nodes(n)}
    for node in nodes:
        if not (isinstance(node, ast.Name) and node.id in aliases and isinstance(node.ctx, ast.Load)):
            continue
        obj, cur = aliases[node.id], node
        while isinstance(parent.get(cur), ast.Attribute) and parent[cur].value is cur and obj is not _MISSING:
            cur = parent[cur]
            obj = _resolve(obj, cur.attr, bad, cur)
        if isinstance(obj, types.ModuleType) and not (isinstance(parent.get(cur), ast.Attribute) and parent[cur].value is cur):
            bad(cur, "a module may only be used to name its attributes (not assigned, passed or returned)")


# ---------------------------------------------------------------------------------------------- C++ / CUDA
STD_HEADERS = {
    "algorithm", "array", "atomic", "bitset", "cassert", "cfloat", "climits", "cmath", "complex", "cstddef", "cstdint",
    "cstdio", "cstdlib", "cstring", "functional", "initializer_list", "iostream", "iomanip", "sstream", "string",
    "string_view", "iterator", "limits", "map", "set", "memory", "numeric", "optional", "stdexcept", "tuple",
    "type_traits", "unordered_map", "unordered_set", "utility", "vector", "deque", "random", "chrono", "mutex",
    "math.h", "stdint.h", "stdio.h", "stdlib.h", "string.h", "float.h", "limits.h", "assert.h", "stddef.h",
    "stdbool.h", "omp.h", "immintrin.h", "xmmintrin.h", "emmintrin.h", "pmmintrin.h", "smmintrin.h", "tmmintrin.h",
    "nmmintrin.h", "arm_neon.h", "cuda_runtime.h", "cuda_runtime_api.h", "cuda.h", "cuda_fp16.h", "cuda_bf16.h",
    "cuda_fp8.h", "cublas_v2.h", "cublasLt.h", "cudnn.h", "mma.h", "cooperative_groups.h", "device_launch_parameters.h",
    "vector_types.h", "math_constants.h",
}
SYSTEM_ROOTS = ("/usr/include/", "/usr/lib/gcc/", "/usr/local/include/", "/usr/lib/llvm")
BANNED_TOKENS = {
    # processes, threads, signals, memory mapping, raw syscalls, inline assembly (host code only is scanned)
    "fork", "vfork", "clone", "clone3", "execve", "execv", "execvp", "execvpe", "execl", "execlp", "execle", "fexecve",
    "system", "popen", "posix_spawn", "posix_spawnp", "daemon", "thread", "jthread", "async", "timer_create",
    "signal", "sigaction", "sigset", "raise", "kill", "mprotect", "mmap", "mmap64", "munmap", "mremap", "madvise",
    "userfaultfd", "syscall", "asm", "__asm__", "__asm", "ptrace", "prctl", "unshare", "setns", "mount",
    "process_vm_readv", "process_vm_writev", "setjmp", "longjmp",
    # dynamic loading, files, pipes, sockets, the environment
    "dlopen", "dlsym", "dlmopen", "dlvsym", "open", "open64", "openat", "creat", "fopen", "fopen64", "freopen", "fdopen",
    "open_memstream", "read", "write", "pread", "pwrite", "readv", "writev", "dup", "dup2", "dup3", "close", "ioctl",
    "fcntl", "socket", "connect", "sendfile", "splice", "pipe", "pipe2", "getenv", "secure_getenv", "setenv", "putenv",
    "environ", "__environ", "ifstream", "ofstream", "fstream", "filebuf", "unlink", "rename", "mkdir", "rmdir", "chdir",
    "chmod", "chown", "symlink", "link", "truncate", "ftruncate", "memfd_create", "shm_open", "filesystem", "tmpfile",
    "dprintf", "vdprintf", "mkstemp", "mkostemp", "mkstemps", "mkostemps", "mkdtemp", "tmpnam", "tempnam",
    "posix_openpt", "renameat", "renameat2", "unsetenv", "clearenv",  # (<cstdio>/<cstdlib> under _GNU_SOURCE)
    # a FILE's own fields: `stdout->_fileno = fd` points printf at any descriptor (a pipe to the parent)
    "fileno", "_chain", "_markers", "_wide_data", "_codecvt", "_shortbuf", "_vtable_offset", "_freeres_list",
    "_freeres_buf", "_flags2", "_old_offset", "_cur_column", "_unused2",
    # the same doors under glibc's other names: a signal handler (__sysv_signal, bsd_signal), mprotect
    # (pkey_mprotect with key -1 is mprotect), exec, the loader: with them, lazily computed pages come back
    "sysv_signal", "bsd_signal", "ssignal", "sigvec", "sigprocmask", "sigaltstack", "sigsetjmp", "siglongjmp",
    "signalfd", "sigwait", "sigwaitinfo", "sigtimedwait", "sigsuspend", "sigqueue", "pkey_mprotect", "pkey_alloc",
    "pkey_set", "posix_madvise", "remap_file_pages", "brk", "sbrk", "execveat", "wordexp", "dladdr", "dlinfo",
    "dl_iterate_phdr", "getauxval", "personality",
    # Python from C++, the dispatcher's thread-local state
    "import", "exec", "eval", "globals", "builtins", "attr", "getattr", "setattr", "hasattr", "delattr",
    "reinterpret_borrow", "reinterpret_steal",
    # pybind11's getattr under other names: `o.doc()` and `o.attr_with_type_hint(k)` return its attribute accessor,
    # whose type (`decltype(m.doc())`) constructs from any object and name; `eval_file` (found by argument-dependent
    # lookup, with no `pybind11::` written) runs a file
    "doc", "attr_with_type_hint", "accessor", "str_attr_accessor", "obj_attr_accessor", "accessor_policies", "str_attr",
    "obj_attr", "eval_file", "ExcludeDispatchKeyGuard", "IncludeDispatchKeyGuard",
    "ExcludeDispatchKeySetGuard", "IncludeDispatchKeySetGuard", "AutoDispatchBelowAutograd",
    "AutoDispatchBelowADInplaceOrView", "AutoDispatchSkipFunctionalize", "DispatchKeySet", "DispatchKey",
    "TorchDispatchModeTLS", "PythonTLSSnapshot", "ThreadLocalState", "ThreadLocalStateGuard", "tls_local_dispatch_key_set",
    "tls_set_dispatch_key_excluded", "tls_set_dispatch_key_included", "_force_tls_local_dispatch_key_set",
    "ThreadPool", "TaskThreadPool", "TaskThreadPoolBase", "PTThreadPool", "intraop_launch", "launch_no_thread_state",
    "ForceDispatchKeyGuard", "LocalDispatchKeySet", "PODLocalDispatchKeySet", "DisablePythonDispatcher",
    "PythonDispatcherTLS", "RestorePythonTLSSnapshot", "MaybeSetTLSOnEntryGuard",
    # symbol renaming: a declaration under another name that links to a closed door (`#pragma redefine_extname
    # my_open open`, `__attribute__((weakref("open")))`: the real name is a string or a pragma)
    "redefine_extname", "weakref", "__weakref__", "alias", "__alias__", "ifunc", "__ifunc__", "symver", "__symver__",
    # a section name is copied into the assembler's input verbatim: `section(".text\nsyscall")` is inline assembly
    "section", "__section__",
}
LIBC_ALIAS_RE = re.compile(r"^_+(libc_)?")
# The Python C API (functions, and the object model: PyObject, PyTypeObject and their fields, through which
# `o->ob_type->tp_getattro` and `tp_call` reach exec without naming a function), threads, raw syscall numbers, and
# the linker's names around a wrapped symbol (__real_X is c10's own ExcludeDispatchKeyGuard, build.GUARD_SOURCE).
BANNED_TOKEN_RE = re.compile(r"^(_?Py[A-Z_]\w*|pthread_\w+|__NR_\w+|THP\w+|(ob|tp)_\w+|_typeobject|_object|_IO_\w+|"
                             r"__(real|wrap)_\w*)$")
# Calls torch::X / at::X that allocate or describe tensors; anything else computes.
CPP_ALLOWED_TORCH = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
                     "full_like", "from_blob", "parallel_for", "get_num_threads", "device", "dtype", "elementSize",
                     "typeMetaToScalarType", "toString", "isFloatingType", "getCurrentCUDAStream", "check_dim_size",
                     "get_parallel_state", "cuda", "indexing", "irange", "scalarTypeToTypeMeta", "getCurrentCUDABlasHandle",
                     "getDefaultCUDAStream", "getStreamFromPool", "detail", "impl", "ScalarTypeToCPPTypeT",
                     "torchCheckFail", "torchCheckMsgImpl", "torchInternalAssertFail", "str", "toUnderlying"}
CPP_ALLOWED_PYBIND = {"module_", "module", "arg", "kw_only", "pos_only", "return_value_policy"}  # (module: module_'s older name, as CUDA Agent's registry writes it)
ROOT_NAMESPACES = {"torch", "at", "aten", "c10", "caffe2", "pybind11", "py"}
TOKEN_RE = re.compile(r'R"([^()\\\s]{0,16})\(.*?\)\1"|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|'
                      r"[A-Za-z_]\w*|\d[\w.]*|::|\S", re.S)
MARKER_RE = re.compile(r'^#\s*(\d+)\s+"((?:\\.|[^"\\])*)"((?:\s+\d+)*)\s*$')


# Directives a kernel source may use. Not `#line` nor GCC's `# 33 "file" 1` line markers: the scan attributes the
# preprocessed text to files by the line markers in it, and those two would let a source claim that its own code
# comes from a system header (which is not scanned).
ALLOWED_DIRECTIVES = {"", "include", "define", "undef", "if", "ifdef", "ifndef", "elif", "else", "endif", "pragma",
                      "error", "warning"}
# Pragmas a kernel source may use (`#pragma X` or `#pragma GCC X`): loops, OpenMP, diagnostics, packing. Any other is
# an instruction whose effect the scan cannot know (`GCC pch_preprocess "f"` loads f as a precompiled header, `weak`
# declares aliases, `GCC system_header` relabels the file). `_Pragma("...")` is refused: its text is a string, which
# the token scan does not read, and a macro may carry it into a system header, where no line is scanned.
ALLOWED_PRAGMAS = {"once", "unroll", "nounroll", "omp", "pack", "push_macro", "pop_macro", "message", "GCC unroll",
                   "GCC ivdep", "GCC novector", "GCC diagnostic", "GCC push_options", "GCC pop_options", "GCC optimize",
                   "GCC target", "GCC warning", "GCC error", "clang diagnostic", "clang loop", "STDC FP_CONTRACT",
                   "STDC FENV_ACCESS", "STDC CX_LIMITED_RANGE", "nv_diag_suppress", "nv_diag_default",
                   "nv_diag_warning", "nv_diag_once", "diag_suppress", "diag_default", "diag_warning",
                   "hd_warning_disable", "nv_exec_check_disable"}
_SPLICE_RE = re.compile(r"(?:\\|\?\?/)[ \t\f\v]*\n")  # backslash-newline (blanks between; ??/ where trigraphs are on)
_GAP = r"(?:[ \t\f\v\0\ufeff]|/\*.*?\*/)*"  # blanks (GCC skips NULs, and a byte order mark) and block comments
# A `#` (or `%:`, `??=`) that the preprocessor may take as a directive's: first on a line, or after a comment's end.
_DIRECTIVE_RE = re.compile(rf"(?:^|(?<=\*/)){_GAP}(?:#|%:|\?\?=){_GAP}([\w\\$]*)", re.M | re.S)
_UCN_HASH_RE = re.compile(r"\\(?:u0023|U00000023)")


def check_directives(path: str, text: str) -> list[str]:
    """Violations among the directives of one workspace file, read as the preprocessor reads them (line splices
    joined, comments skipped, digraphs, universal character names). Conservative: a line of a raw string that
    looks like a directive counts as one. `\\u0023` (a `#` the preprocessor does not take as a directive but
    prints at the start of a line, where it reads as a line marker) is refused anywhere."""
    out = []
    if "??/" in text:  # a splice only where trigraphs are on (-std=gnu++*, not c++17): read either way, it hides a line
        out.append(f"{path}: the trigraph `??/` is not allowed")
    text = _SPLICE_RE.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    if _UCN_HASH_RE.search(text):
        out.append(f"{path}: `\\u0023` (a universal character name for `#`) is not allowed")
    for m in _DIRECTIVE_RE.finditer(text):
        if m.group(1) not in ALLOWED_DIRECTIVES:
            out.append(f"{path}: the directive `#{m.group(1)}` is not allowed in kernel sources (allowed: "
                       + ", ".join(f"#{d}" for d in sorted(ALLOWED_DIRECTIVES) if d) + ")")
            continue
        rest = re.sub(r"/\*.*?\*/", " ", text[m.end():m.end() + 400], flags=re.S).split("\n")[0]  # (its operand)
        if m.group(1) == "include":
            out += _include_violation(path, rest)
        elif m.group(1) == "pragma":  # here too: the preprocessor consumes some (GCC system_header, poison)
            out += _pragma_violation(path, re.findall(r"[A-Za-z_]\w*", rest)[:2])
    for m in _HAS_INCLUDE_RE.finditer(text):  # every mention, whatever follows: an alias by macro, a comment
        rest = re.sub(r"/\*.*?\*/", " ", text[m.end():m.end() + 400], flags=re.S)
        arg = re.match(r"\s*\(([^)\n]*)\)", rest)
        out += _include_violation(path, arg.group(1) if arg else rest.split("\n")[0], "__has_include")
    return list(dict.fromkeys(out))


# An include names a header as written, inside the include roots: a literal "x" or <x> (a macro's include is
# computed: the preprocessor reads whatever file it expands to), no absolute path, no `..`. A file the preprocessor
# opens is quoted back in its errors: `#include "/etc/passwd"` after `#define root _Pragma` printed the file's lines in
# the build error (the include roots check after preprocessing never ran: preprocessing failed first).
_INCLUDE_OPERAND_RE = re.compile(r'\s*("([^"\n]*)"|<([^>\n]*)>)\s*(//.*)?$')
_HAS_INCLUDE_RE = re.compile(r"__has_include(?:_next)?\b")


def _include_violation(path: str, operand: str, what: str = "#include") -> list[str]:
    m = _INCLUDE_OPERAND_RE.match(operand)
    name = m and (m.group(2) if m.group(2) is not None else m.group(3))
    if not m or not name or name.startswith("/") or "\\" in name or ".." in re.split(r"/+", name):
        return [f"{path}: `{what} {operand.strip()[:80]}` is not allowed: name a header as written (\"file.h\" or "
                "<header>), with no absolute path, no `..` and no macro"]
    return []


def _pragma_violation(path: str, words: list) -> list[str]:
    """[] if the pragma whose first words these are is on ALLOWED_PRAGMAS, else its violation."""
    name = " ".join(words) if words and words[0] in ("GCC", "clang", "STDC") else "".join(words[:1])
    return [] if name in ALLOWED_PRAGMAS else [
        f"{path}: `#pragma {name}` is not allowed in kernel sources (allowed: {', '.join(sorted(ALLOWED_PRAGMAS))})"]


def split_preprocessed(text: str, is_user) -> tuple[list[str], list[tuple[str, str]]]:
    """(tokens from user files, [(includer, included)] for every include made by a user file)."""
    user_lines, includes = [], []
    current = None
    for line in text.split("\n"):
        m = MARKER_RE.match(line)
        if m:
            path, flags = m.group(2).replace('\\"', '"'), m.group(3).split()
            if "1" in flags and current is not None and is_user(current):
                includes.append((current, path))
            current = path
            continue
        if current is not None and is_user(current):  # #pragma lines too: `#pragma redefine_extname` renames symbols
            user_lines.append(line)
    tokens = []
    for m in TOKEN_RE.finditer("\n".join(user_lines)):
        t = m.group(0)
        if t[0] not in "\"'" and not t.startswith('R"'):
            tokens.append(t)
    return tokens, includes


def headers_entered(text: str) -> set[str]:
    """Every file the preprocessed text enters anywhere (line markers with flag 1), its path normalised."""
    found = set()
    for line in text.split("\n"):
        m = MARKER_RE.match(line)
        if m and "1" in m.group(3).split():
            found.add(os.path.normpath(m.group(2).replace('\\"', '"')))
    return found


_DEFINE_RE = re.compile(r"^\s*#\s*define\s+([A-Za-z_$][\w$]*)(\(?)(.*)$")


def check_macro_order(path: str, text: str, is_user) -> list[str]:
    """A workspace macro may not be expanded inside a header the workspace does not own: no line of it is scanned
    there, and its #define's tokens need not spell what it expands to (`__as ## m__`, or a header's own paste macro,
    is `__asm__`). So once a workspace file has defined a macro with a body (function-like, or more than one number),
    no other header may be entered. Include guards and flags (`#define MY_H`, `#define N 4`) may come first."""
    current, defined = None, None
    for line in text.split("\n"):
        m = MARKER_RE.match(line)
        if m:
            target = m.group(2).replace('\\"', '"')
            # (entered, or returned to: a system header may include a workspace file, `__has_include` finds one)
            if defined and current is not None and is_user(current) and not is_user(target):
                return [f"{path}: #include of {target} after the macro {defined} (a workspace macro may not reach a header "
                        "the workspace does not own: put every #include before the first #define with a body)"]
            current = target
            continue
        if current is not None and is_user(current) and defined is None:
            d = _DEFINE_RE.match(line)
            if d and (d.group(2) or not re.fullmatch(r"\s*(\d[\w.]*)?\s*", d.group(3))):
                defined = d.group(1)
    return []


def header_allowed(path: str, roots: list[str]) -> bool:
    """Whether an included file (as the preprocessor's line markers name it) is a toolchain or standard header. The
    path is judged as it resolves: `<root>/../../etc/passwd` starts with a root and is not under it."""
    path = os.path.normpath(path)
    if any(path.startswith(os.path.normpath(r) + "/") for r in roots):
        return True
    return path.startswith(SYSTEM_ROOTS) and any(path.endswith("/" + h) for h in STD_HEADERS)


def module_expansion(tokens: list[str]) -> list[str]:
    """The tokens of PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {} as preprocessed by this toolchain, from a probe
    file that holds nothing else (the empty body's braces dropped)."""
    assert tokens[-2:] == ["{", "}"], tokens[-4:]
    return tokens[:-2]


def find_seq(tokens: list[str], seq: list[str]) -> list[int]:
    n, first, hits = len(seq), seq[0], []
    i = 0
    while i <= len(tokens) - n:
        if tokens[i] == first and tokens[i:i + n] == seq:
            hits.append(i)
            i += n
        else:
            i += 1
    return hits


def check_tokens(path: str, tokens: list[str]) -> list[str]:
    """Violations among the user tokens of one source (the PYBIND11_MODULE expansion already removed)."""
    out = []
    for i, t in enumerate(tokens):
        if t == "pragma" and i and tokens[i - 1] == "#":  # the preprocessed text prints every pragma as `#pragma`
            out += _pragma_violation(path, tokens[i + 1:i + 3])
            continue
        if t == "_Pragma":
            out.append(f"{path}: `_Pragma(...)` is not allowed in kernel sources; write the `#pragma` line itself")
            continue
        # (glibc exports its doors under other names too: __open, __read, __write, __fork, __libc_system)
        if t in BANNED_TOKENS or BANNED_TOKEN_RE.match(t) or (t[0] == "_" and LIBC_ALIAS_RE.sub("", t) in BANNED_TOKENS):
            out.append(f"{path}: `{t}` is not allowed in kernel sources (processes, threads, signals, files, the "
                       "environment, dynamic loading, inline assembly in host code, Python from C++ and dispatcher "
                       "state are closed doors; rename a variable that only shares the name)")
        elif t == "namespace" and i + 1 < len(tokens) and tokens[i + 1] in ROOT_NAMESPACES:  # inside, at::X is just X
            out.append(f"{path}: `namespace {tokens[i + 1]}` is not allowed; qualify the names you use")
        elif t == "namespace" and i + 2 < len(tokens) and tokens[i + 2] == "=":
            out.append(f"{path}: namespace aliases are not allowed (`namespace {tokens[i + 1]} = ...`)")
        elif t == "using" and i + 2 < len(tokens) and tokens[i + 1] == "namespace" and tokens[i + 2] in ROOT_NAMESPACES:
            out.append(f"{path}: `using namespace {tokens[i + 2]}` is not allowed; qualify the names you use")
        # (wherever it stands: `::torch::x` at the global scope, or after any word GCC keeps, such as __extension__)
        elif t in ROOT_NAMESPACES and i + 1 < len(tokens) and tokens[i + 1] == "::":
            segs, j = [], i + 1
            while j + 1 < len(tokens) and tokens[j] == "::" and re.match(r"[A-Za-z_]\w*$", tokens[j + 1]):
                segs.append(tokens[j + 1])
                j += 2
            allowed = CPP_ALLOWED_PYBIND if t in ("pybind11", "py") else CPP_ALLOWED_TORCH
            for s in segs:
                if s not in allowed and (t in ("pybind11", "py") or not (s[0].isupper() or re.match(r"k[A-Z]", s))):
                    out.append(f"{path}: {t}::{'::'.join(segs)} is not allowed "
                               + ("(only m.def and py::arg are)" if t in ("pybind11", "py") else
                                  "(a PyTorch compute op or internal; write the kernel yourself)"))
                    break
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------------------------- the linked module
# What the module imports from other libraries is what it can call, however the source spelled it (an alias, a
# wrapper inline in a system header such as libstdc++'s __gthread_create, an operator on tensors, a Tensor method).
# Checked on the linked module's undefined symbols (`nm -D --undefined-only -C`):
#   - PyTorch operators: `at::_ops::<op>_<overload>::call` (every Tensor method, operator and at::/torch:: function
#     ends there) and a backend's own functions (`at::cpu::add`) only for operators that allocate or view. The
#     dispatch monitor sees only the thread that runs forward(); this check holds for OpenMP workers and any thread;
#   - the dispatcher by name (c10::Dispatcher, OperatorHandle) and PyTorch's thread pools;
#   - C functions (unmangled symbols) from an allow-list: memory, strings, math, formatting into memory and onto the
#     standard streams, the C++ runtime, locks, OpenMP, CUDA's runtime and libraries, and the Python C API that
#     pybind11's inline code calls. Everything else (a file, a descriptor, a signal, a timer, a process, a new
#     system call's wrapper) is refused by not being on it; the doors below are named only for the message;
#   - every other C++ name from an allow-list as well (CXX_IMPORTS_RE).
# The Python C API that pybind11's inline code calls for a module, its functions, conversions and errors. Not the
# parts that run code, import, open files or reach the interpreter's state (PyRun_*, Py_CompileString, PyEval_Eval*,
# PyEval_GetGlobals, PyImport_*, _Py_fopen_obj, PySys_*, PyOS_*, PyFile_*, PyMarshal_*): pybind11's eval_file, found by
# argument-dependent lookup with no banned word written, ran a Python file from a kernel.
PYTHON_C_API = (
    r"_?Py(Err|Exc|Exception|Object|BaseObject|Type|Tuple|List|Dict|Set|FrozenSet|Unicode|Bytes|ByteArray|Long|Float|"
    r"Bool|Complex|Number|Sequence|Iter|Gen|Capsule|CFunction|CMethod|InstanceMethod|Method|Property|StaticMethod|"
    r"Module|ModuleDef|Mem|Weakref|GILState|ThreadState|Thread_tss|InterpreterState|Frame|Slice|MemoryView|Buffer|"
    r"Index|Mapping|Callable|Cell|Code|Vectorcall)_\w+|PyEval_(SaveThread|RestoreThread|AcquireThread|ReleaseThread|"
    r"GetBuiltins)|_Py_(Dealloc|NoneStruct|TrueStruct|FalseStruct|NotImplementedStruct|EllipsisObject|IncRef|DecRef)|"
    r"Py_(GetVersion|IsInitialized|IncRef|DecRef|XIncRef|XDecRef|IsNone|IsTrue|IsFalse|NewRef|XNewRef)|"
    r"_PyType_Lookup|_PyThreadState_UncheckedGet|_PyObject_\w+")
C_IMPORTS_RE = re.compile(
    r"^(__cxa_\w+|__gxx_personality_v0|_Unwind_\w+|__dynamic_cast|__tls_get_addr|__gmon_start__|_ITM_\w+|"
    r"__libc_single_threaded|__stack_chk_fail|__assert_fail|__errno_location|__dso_handle|__cxa_thread_atexit_impl|"
    r"(aligned_alloc|posix_memalign|malloc|calloc|realloc|free|memalign|malloc_usable_size)|"
    r"(__)?(mem(set|cpy|move|cmp|chr|rchr|mem|pcpy)|str(len|nlen|cmp|ncmp|chr|rchr|dup|ndup|str|cpy|ncpy|cat|ncat|spn|"
    r"cspn|pbrk|tok|tok_r|coll|error|error_r|xfrm)|wcs\w+|wmem\w+|ato[fil]|atoll|strto[a-z]+|abs|labs|llabs|qsort|bsearch|"
    r"rand|rand_r|srand|(f|v|vf|s|sn|vs|vsn)?printf|puts|putchar|fputc|fputs|fwrite|fflush|putc|"
    r"(s|vs)?scanf|setlocale|localeconv|nl_langinfo|uselocale|newlocale|freelocale|iswctype|wctype|btowc|wctob|mbrtowc|"
    r"wcrtomb|mbsrtowcs|wcsrtombs|towlower|towupper|tolower|toupper|__ctype_\w+|clock_gettime|clock|time|gettimeofday|"
    r"nanosleep|sched_yield|abort|exit|_exit|atexit|__cxa_at_quick_exit|at_quick_exit|quick_exit)(_chk)?|"
    r"stdout|stderr|"
    r"pthread_(mutex|cond|once|key|getspecific|setspecific|self|equal|rwlock|spin|mutexattr|condattr)\w*|"
    r"(__)?(a?(sin|cos|tan)h?|atan2|exp|exp2|exp10|expm1|log|log2|log10|log1p|logb|ilogb|pow|sqrt|rsqrt|cbrt|hypot|"
    r"erfc?|[lt]gamma|lgamma_r|fabs|fmin|fmax|fdim|fma|floor|ceil|round|lround|llround|trunc|rint|lrint|llrint|"
    r"nearbyint|fmod|remainder|remquo|copysign|nan|frexp|ldexp|modf|scalbl?n|nextafter|nexttoward|sincos|isinf|isnan|"
    r"finite|signbit|fpclassify|c(exp|log|log10|pow|sqrt|abs|arg|proj|a?(sin|cos|tan)h?|real|imag)|conj)[fl]?(_finite)?|"
    # the compiler's own arithmetic helpers (libgcc), which compute and return: complex products and quotients
    # (std::complex's * and /), 128-bit integer division and conversions, half-precision conversions, bit counts,
    # integer powers
    r"__(mul|div)[hsdxt]c3|__u?(div|mod)ti3|__u?divmodti4|__muloti4|__float(un)?ti[hsdxt]f|__fix(uns)?[hsdxt]fti|"
    r"__extendhf[sdxt]f2|__trunc[sdxt]fhf2|__(popcount|clz|ctz|ffs|parity)[sdt]i2|__powi[sdx]f2|"
    # OpenMP, as `#pragma omp` compiles: a region that joins its team before it returns (GOMP_parallel*, not the
    # GOMP_1.0 GOMP_parallel*_start, whose workers run on after the kernel returns: a thread of its own), and the
    # work-sharing, synchronisation and task calls made inside one
    r"GOMP_(parallel|parallel_loop_(nonmonotonic_|maybe_nonmonotonic_)?(static|dynamic|guided|runtime)|parallel_sections|"
    r"parallel_reductions|loop(_ull)?(_doacross)?_\w+|sections2?_\w+|barrier(_cancel)?|critical(_name)?_(start|end)|"
    r"atomic_(start|end)|single_(start|copy_start|copy_end)|ordered_(start|end|post|wait)|doacross(_ull)?_(post|wait)|"
    r"task|taskloop(_ull)?|taskwait(_depend)?|taskyield|taskgroup_(start|end|reduction_register|reduction_unregister)|"
    r"task_reduction_remap|workshare_task_reduction_unregister|cancel|cancellation_point|error|warning)|omp_\w+|"
    r"__cuda\w+|cuda\w+|cu[A-Z]\w+|cublas\w*|cublasLt\w*|cusparse\w*|cusolver\w*|cufft\w*|curand\w*|nvtx\w+|"
    + PYTHON_C_API + r")$")
# C++ names (a demangled symbol's qualified name, its template and argument lists dropped: cxx_name) from an
# allow-list too: the C++ runtime (exceptions, strings, string streams, hashing, clocks, condition variables),
# PyTorch's tensor metadata, checks, errors and allocation, pybind11's tensor conversion, CUDA's current stream and
# device. Everything else is refused by not being on it, whatever the source spelled: a file stream
# (std::basic_filebuf and the streams on it), a thread, a dynamic loader (at::DynamicLibrary hands out any C
# function by name, and a PyTorch operator to call on a worker thread), a Tensor method that computes out of line
# (Tensor::index, _backward), hooks. tests/env_cases/cxx_imports.txt holds what the repository's own kernels import.
# A name followed by `(::|$)` admits the class (or namespace) and its members; one followed by `$` that name only.
CXX_IMPORTS_RE = re.compile(
    r"^(operator_(new|delete)|"
    r"std::((__cxx11::)?(basic_string|char_traits|allocator|basic_(o|i)?stringstream|basic_stringbuf|basic_ostream|"
    r"basic_istream|basic_iostream|basic_ios|basic_streambuf|ios_base|ios_base_library_init|locale|ctype|num_put|num_get|"
    r"numpunct|__ostream_insert|ostream|istream|cout|cerr|clog|endl|type_info|"
    r"exception|bad_\w+|logic_error|runtime_error|domain_error|invalid_argument|length_error|out_of_range|range_error|"
    r"overflow_error|underflow_error|system_error|nested_exception|__exception_ptr|exception_ptr|__throw_\w+|terminate|"
    r"current_exception|rethrow_exception|uncaught_exceptions?|__glibcxx_assert_fail|_Hash_bytes|_Fnv_hash_bytes|"
    r"__detail::_Prime_rehash_policy|_Rb_tree_\w+|__detail::_List_node_base|(_V2::)?(error_category|system_category|"
    r"generic_category)|chrono::(_V2::)?(steady_clock|system_clock|high_resolution_clock)|condition_variable|__condvar|"
    r"__once_callable|__once_call|__once_proxy)(::|$)|operator_x$)|"
    r"__cxxabiv1::__\w+|__gnu_cxx::__verbose_terminate_handler$|"
    r"c10::(detail::(torchCheckFail|torchInternalAssertFail|torchCheckMsgImpl|maybe_wrap_dim_slow)|\w*Error|Warning|"
    r"warn\w*|throwNullDataPtrError|TensorImpl::(?!TensorImpl$)\w+$|UndefinedTensorImpl::_singleton$|"
    r"StorageImpl::throw_data_ptr_access_error$|SymInt|SymBool|SymFloat|SymbolicShapeMeta|"
    r"AutogradMetaInterface|impl::getGlobalPyInterpreter|impl::ExcludeDispatchKeyGuard|impl::DeviceGuardImplInterface|"
    # (a mutable data pointer of a lazily copied storage copies it first: Tensor::mutable_data_ptr's inline code)
    r"impl::cow::is_cow_data_ptr$|impl::cow::materialize_cow_storage$|"
    r"Device|DeviceTypeName|Stream|toString|SmallVectorBase|"
    r"cuda::(getCurrentCUDAStream|getDefaultCUDAStream|getStreamFromPool|getStreamFromExternal|"
    r"c10_cuda_check_implementation|warp_size|"
    r"device_count|device_count_ensure_non_zero|current_device|set_device|ExchangeDevice|MaybeExchangeDevice|SetDevice|"
    r"GetDevice|CUDAStream|impl::CUDAGuardImpl))(::|$)|"
    r"at::(TensorBase::(data_ptr|mutable_data_ptr|const_data_ptr|__dispatch_contiguous|enforce_invariants|toString|print|"
    r"name|_version|is_leaf|output_nr|is_view|_base|fill_|zero_|to|data|tensor_data|variable_data)|"
    r"cuda::(getCurrentCUDAStream|getDefaultCUDAStream|getStreamFromPool|getCurrentDeviceProperties|getDeviceProperties|"
    r"getCurrentCUDABlasHandle|getCurrentCUDABlasLtHandle|"
    r"warp_size|getNumGPUs|is_available)|get_num_threads|get_thread_num|in_parallel_region)$|"
    r"caffe2::TypeMeta::\w+$|torch::autograd::AutogradMeta(::~?AutogradMeta)?$)")
# pybind11's conversion of a tensor (torch's own, out of line); other casters' templates are not looked through
_PYBIND_TENSOR_RE = re.compile(r"^pybind11::detail::type_caster<at::Tensor, void>::(load|cast)\(")
_CXX_KIND_RE = re.compile(r"^((construction )?vtable|VTT|typeinfo( name)?|guard variable|TLS (init|wrapper) function|"
                          r"reference temporary #\d+) for |^((non-|covariant return )?virtual|covariant return) thunk to ")
_CXX_OPERATOR_RE = re.compile(r"\boperator\s*(new\[\]|delete\[\]|new\b|delete\b|<<=?|>>=?|<=>|<=|>=|->\*?|<|>|\(\)|"
                              r"\[\]|[^\w\s(]+|\s+[\w:]+)")


def cxx_name(sym: str) -> str:
    """The qualified name a demangled C++ symbol stands for: `float* at::TensorBase::data_ptr<float>() const` ->
    at::TensorBase::data_ptr; `vtable for std::__cxx11::basic_ostringstream<char, ...>` ->
    std::__cxx11::basic_ostringstream; `operator new(unsigned long)` -> operator_new. "" where it cannot tell (refused)."""
    s = _CXX_KIND_RE.sub("", sym.strip())
    s = re.sub(r"\[abi:\w+\]", "", s)
    s = _CXX_OPERATOR_RE.sub(lambda m: "operator_" + ("new" if m.group(1).startswith("new") else
                                                      "delete" if m.group(1).startswith("delete") else "x"), s)
    while True:  # template arguments, innermost first
        t = re.sub(r"<[^<>]*>", "", s)
        if t == s:
            break
        s = t
    if "(*" in s or "{" in s or "<" in s or ">" in s:  # a function pointer's type, a lambda, an unbalanced bracket
        return ""
    s = s.split("(")[0].strip()
    return s.split()[-1] if s else ""


IMPORT_DOORS = BANNED_TOKENS | {
    "pthread_create", "thrd_create", "pthread_kill", "pthread_sigqueue", "tgkill", "tkill", "sigqueue", "rt_sigqueueinfo",
    "getauxval", "dl_iterate_phdr", "r_debug", "setcontext", "makecontext", "swapcontext", "process_madvise",
    "aio_read", "aio_write", "lio_listio", "mq_open", "sem_open", "sched_setaffinity", "setrlimit", "prlimit",
}
_IMPORT_SUFFIX_RE = re.compile(r"(_chk|_2|64)+$")
# CUDA's doors out of the process's own memory: code or data from a file (the rest of cu*/cuda* runs on the device or
# manages it), another process's memory or descriptors, and any driver function by name.
_CUDA_DOOR_RE = re.compile(r"^cu(da)?(ModuleLoad|LibraryLoadFromFile|LinkAddFile|GetProcAddress|GetDriverEntryPoint\w*|"
                           r"Ipc\w+|ImportExternal\w+|Mem(Import|Export)\w*ShareableHandle|DeviceGetByPCIBusId|"
                           r"GetExportTable|MemPool(Import|Export)\w*|MemGetHandleForAddressRange|Coredump\w*)(_v\d+)?$|"
                           # host code the driver runs later, on a thread of its own (after forward returned), and
                           # the libraries' loggers (a file by name) and callbacks
                           r"^cu(da)?\w*(HostFunc|AddCallback|HostNode\w*|SetCallback|RegisterCallback|UserObject|"
                           r"GraphAddNode|NodeSetParams|Logs|DebugDotPrint|Checkpoint)\w*$|"
                           r"^(cublas|cublasLt|cusparse|cusolver\w*|cufft\w*|curand)\w*(Logger|Callback)\w*$")
# whole families of C functions, whatever glibc version adds next: signals, page protection, exec and spawn, the
# dynamic loader, processes
_IMPORT_FAMILY_RE = re.compile(r"^(sig(?!nbit|nificand)|pkey_|mprotect|mmap|madvise|mremap|exec|posix_spawn|dl|clone|v?fork|"
                               r"_?Fork|pthread_(create|kill|sigqueue|sigmask)|thrd_create)")
_OPS_STRUCT_RE = re.compile(r"(?:^|[\s*&])at::_ops::(\w+)::")
_TORCH_FN_RE = re.compile(r"(?:^|[\s*&])at::(?:(?:native|cpu|cuda|meta|mps|composite\w*)::)?(\w+)\(")
_TORCH_DOOR_RE = re.compile(r"(?:^|[\s*&])(c10::Dispatcher::|c10::OperatorHandle|c10::KernelFunction|c10::impl::OperatorEntry|"
                            r"torch::jit::|at::launch\(|at::intraop_launch|at::internal::launch_no_thread_state|"
                            r"c10::\w*ThreadPool|at::\w*ThreadPool|std::thread::|std::jthread)")
_ATEN: dict = {}


def aten_structs() -> dict:
    """{"mul_Tensor": "mul", "empty_memory_format": "empty", ...}: the C++ struct of every aten overload, named as
    torchgen names it (name, then _overload), and the operator the dispatch monitor reports it as."""
    if not _ATEN:
        torch = importlib.import_module("torch")
        for s in torch._C._jit_get_all_schemas():
            if s.name.startswith("aten::"):
                name = s.name[len("aten::"):]
                _ATEN[f"{name}_{s.overload_name}" if s.overload_name else name] = name
    return _ATEN


def check_imports(symbols: list[str], allowed_ops, own_names=frozenset()) -> list[str]:
    """Violations among the undefined (imported) symbols of the linked module, demangled. own_names: the
    identifiers the workspace's sources write, so that a function they declare and never define is named as such
    (it is imported as much as a library's would be, and refused the same)."""
    structs = aten_structs()
    ops = set(structs.values())
    out = []
    for sym in symbols:
        name = sym.split("@")[0].strip()
        if not name:
            continue
        if re.fullmatch(r"[A-Za-z_]\w*", name):  # a C function or variable
            base = LIBC_ALIAS_RE.sub("", name)
            if name in IMPORT_DOORS or base in IMPORT_DOORS or _IMPORT_SUFFIX_RE.sub("", base) in IMPORT_DOORS \
                    or _IMPORT_FAMILY_RE.match(base) or _CUDA_DOOR_RE.match(name):
                out.append(f"the module calls `{name}` (processes, threads, files, signals and the like are closed doors)")
            elif not C_IMPORTS_RE.match(name) and name in own_names:
                out.append(f"the module calls `{name}`, which no kernel source defines (declared and never defined: "
                           "write its definition, or call a function of the allowed libraries)")
            elif not C_IMPORTS_RE.match(name):
                out.append(f"the module calls `{name}`, which is not on the list of C functions a kernel module may use "
                           "(memory, strings, math, formatting, the C++ runtime, locks, OpenMP, CUDA)")
            continue
        m = _OPS_STRUCT_RE.search(name) or _TORCH_FN_RE.search(name)
        fn = re.sub(r"(_outf?|_symint)+$", "", m.group(1)) if m else None  # (at::cpu::add_out computes too)
        op = (structs.get(m.group(1)) if m.re is _OPS_STRUCT_RE else fn if fn in ops else None) if m else None
        if m and m.re is _OPS_STRUCT_RE and op is None:
            op = m.group(1)  # an operator this torch does not list: not allowed either
        if op is not None and op not in allowed_ops:
            out.append(f"the module calls the PyTorch operator aten.{op} (`{name[:120]}`); only allocation and views "
                       "may come from PyTorch, on any thread: write the computation as a kernel")
        elif _TORCH_DOOR_RE.search(name):
            out.append(f"the module calls `{name[:120]}` (the dispatcher by name and PyTorch's threads are closed doors)")
        elif name.startswith("typeinfo") and not re.match(r"(std|__cxxabiv1|__gnu_cxx)::", cxx_name(name)):
            # a class of the module deriving from a library class (its virtuals run later, when the harness asks)
            out.append(f"the module derives from `{cxx_name(name)}` (`{name[:80]}`): library classes other than "
                       "the C++ runtime's exceptions may not be subclassed")
        elif op is None and not (CXX_IMPORTS_RE.match(cxx_name(name)) or _PYBIND_TENSOR_RE.match(name)):
            out.append(f"the module calls `{name[:120]}`, which is not on the list of C++ functions a kernel module may "
                       "use (the C++ runtime's exceptions, strings and string streams, tensor metadata and allocation, "
                       "CUDA's current stream)")
    return list(dict.fromkeys(out))


SYSCALL_INSN_RE = re.compile(r"^\s*[0-9a-f]+:\s+(syscall|sysenter|int\s+\$0x80|svc\s+#?0x0?\b|svc\s+#0\b)", re.M)


def check_instructions(disassembly: str) -> list[str]:
    """Violations in the linked module's machine code (`objdump -d`): a system call instruction, which only inline
    assembly can put there (however it got past the scan: a macro expanded inside a header, a section name)."""
    m = SYSCALL_INSN_RE.search(disassembly)
    return [f"the module's machine code makes a system call itself (`{m.group(1)}`); inline assembly in host code "
            "is not allowed"] if m else []


# PyTorch operators a candidate may use: in forward (the dispatch monitor), in the linked module's imports, and
# while model_new.py loads and ModelNew is built.
ALLOWED_OPS = frozenset({  # aten ops that allocate, view or describe; everything else computes
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "zero_", "view", "_unsafe_view", "_reshape_alias", "as_strided", "t", "transpose", "permute", "unsqueeze",
    "squeeze", "expand", "slice", "select", "split", "split_with_sizes", "unbind", "chunk", "narrow", "alias",
    "detach", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "dim", "is_contiguous",
    "resize_", "lift_fresh", "view_as_real", "view_as_complex", "record_stream",
    "is_same_size", "equal_size", "fill_", "full", "full_like", "ones", "ones_like", "new_full", "new_ones",
})
# What the linked module may import from PyTorch (scan.check_imports): the allowed operators and the composite ones
# that only view (a reshape that must copy shows up at run time as a clone, which the monitor refuses).
IMPORT_OPS = ALLOWED_OPS | {"reshape", "flatten", "contiguous", "view_as", "reshape_as", "expand_as", "unflatten",
                            "movedim", "moveaxis", "swapaxes", "swapdims", "tensor_split", "to"}
# Not allowed: _local_scalar_dense (.item(), float(t)): a value read into Python can be computed on there and written
# back with fill_, element by element.
# While the candidate's module loads and ModelNew is built: also random initialisation and copies (parameters
# are created, then overwritten by load_state_dict and moved to the device).
INIT_OPS = ALLOWED_OPS | {"normal_", "uniform_", "randn", "rand", "randint", "random_", "bernoulli_", "copy_", "_to_copy",
                          "arange", "kaiming_uniform_", "lift_fresh_copy", "clone", "_has_compatible_shallow_copy_type",
                          "set_", "bernoulli", "exponential_", "geometric_", "log_normal_", "cauchy_",
                          "mul_", "add_", "clamp_", "erfinv_",  # (in place: what nn.init.trunc_normal_ does)
                          "_local_scalar_dense"}
