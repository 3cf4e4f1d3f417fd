"""build.py: step 3 of a verdict (env.py): every kernel source of a workspace preprocessed by the compiler's own
preprocessor and scanned (scan.py), compiled on its own into a content-hash object cache, linked into one module
`cuda_extension`, whose imports and machine code are checked again. Builds run sandboxed (sandbox.py) and count
as candidates on their device (no baseline is timed while one runs).

A .cpp that includes <torch/extension.h> is preprocessed with that header precompiled (`-include` it first,
`-fpch-preprocess`): the text the scan reads and the compiler compiles is the workspace's code and one pragma that
names our .gch, in place of 17 MB of torch headers, which take half of a binding file's compile time to parse. A
workspace's own pragmas come from an allow-list that does not hold `pch_preprocess` (scan.py). The header offered
first is a lighter one under the same name (LIGHT_HEADER: the same macros, without most of the C++ frontend); a
source that fails under it in a way the whole header could undo is preprocessed, scanned and compiled again under
the whole one.

    b = build({"kernels/op.cu": src, "kernels/binding.cpp": binding}, "cuda")   # -> Build(ok, so_path, log, ...)
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension as ce

import scan
from sandbox import CACHE_DIR, candidate_alive, file_lock, run_sandboxed
from scan import IMPORT_OPS

SOURCE_EXT = {".cu", ".cpp"}
HEADER_EXT = {".h", ".cuh", ".hpp"}


@dataclasses.dataclass
class Build:
    ok: bool
    so_path: Path | None
    log: str
    seconds: float
    rebuilt: list  # sources that were compiled (not served from the cache)
    violations: list = dataclasses.field(default_factory=list)  # what the preprocessed scan refused
    pch: list = dataclasses.field(default_factory=list)  # sources compiled from a precompiled torch header
    # sources judged under the whole header: they include a header the light one (LIGHT_HEADER) leaves out, or failed
    # under it with an error that involves torch
    whole_header: list = dataclasses.field(default_factory=list)
    # seconds per step of a successful build: "scan P" (preprocess + scan) and "compile P" per source compiled (sources
    # run side by side, so they overlap; P's two run one after the other), "toolchain" and "precompiled header" (made
    # once per machine and torch), "link", "module checks"
    steps: dict = dataclasses.field(default_factory=dict)


_TOOLCHAIN: dict = {}
# Part of every object's and module's cache key: the text of the rules (scan.py, and this file's checks of the linked
# module), so that a build judged under older rules is never reused, with no version number to remember to raise.
SCAN_VERSION = hashlib.sha256(Path(scan.__file__).read_bytes() + Path(__file__).read_bytes()).hexdigest()[:16]


def toolchain(backend: str) -> dict:
    """Compiler commands and flags. Computed once per process (importing torch is the slow part)."""
    if backend in _TOOLCHAIN:
        return _TOOLCHAIN[backend]
    std = "-std=c++20" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 10) else "-std=c++17"
    roots = [*ce.include_paths(), sysconfig.get_paths()["include"]]
    inc = [f"-I{p}" for p in roots]
    defs = ["-DTORCH_EXTENSION_NAME=cuda_extension", "-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    cxx = os.environ.get("CXX", "g++")
    # On the CUDA backend g++ compiles host glue only (a binding file's checks, allocation and the launcher's call;
    # the GPU code is nvcc's, -O3): -O1 there compiles a binding file ~25% faster (an empty one under LIGHT_HEADER on
    # 2 cores: 3.9 s against 5.1 s) and its call costs the same (axpby's CPU binding: 1.16 us a call at either level).
    # The CPU backend's .cpp files hold the kernels themselves: -O3.
    opt = "-O1" if backend == "cuda" else "-O3"
    tc = {"cxx": [cxx, opt, "-fPIC", std, "-w", *defs, *inc], "ldflags": [], "roots": roots}
    libdir = ce.library_paths()[0]
    tc["ldflags"] = [*shared_cxx_runtime(cxx), f"-L{libdir}", f"-Wl,-rpath,{libdir}", "-lc10", "-ltorch", "-ltorch_cpu",
                     "-ltorch_python"]
    if backend == "cpu":
        # A kernel's math sets no errno and raises no floating-point trap (nothing reads either): -fno-math-errno
        # makes sqrtf an instruction, not a call a row's loop cannot vectorise (the norms), and -fno-trapping-math
        # lets g++ turn a select (a comparison, a clamp) into straight-line vector code on any x86-64, not only with
        # AVX-512's masks (tests/test_curriculum.py compiles every op both ways). The results do not change.
        tc["cxx"] += ["-fopenmp", "-march=native", "-fno-math-errno", "-fno-trapping-math"]
        tc["ldflags"] += ["-fopenmp"]
    else:
        cuda_home = ce.CUDA_HOME or "/usr/local/cuda"
        nvcc = str(Path(cuda_home) / "bin" / "nvcc") if Path(cuda_home, "bin", "nvcc").exists() else "nvcc"
        arch = os.environ.get("CUDA_AGENT_ARCH") or gpu_query("compute_cap").replace(".", "") or "90"
        tc["nvcc"] = [nvcc, "-O3", std, "-Xcompiler", "-fPIC", "-w", "--expt-relaxed-constexpr",
                      f"-gencode=arch=compute_{arch},code=sm_{arch}", *defs, *inc, f"-I{cuda_home}/include"]
        tc["cxx"] += [f"-I{cuda_home}/include", "-DWITH_CUDA"]
        tc["roots"] += [str(Path(cuda_home).resolve()), str(Path(cuda_home)), *map(str, Path(torch.__file__).parent.parent.glob("nvidia/*/include"))]
        libdirs = [Path(cuda_home) / "lib64", *Path(torch.__file__).parent.parent.glob("nvidia/*/lib")]
        tc["ldflags"] += ["-lc10_cuda", "-ltorch_cuda"] + [f"-L{d}" for d in libdirs if d.exists()] + \
                         [f"-Wl,-rpath,{d}" for d in libdirs if d.exists()] + [shared_cudart(libdirs, nvcc_major(nvcc))]
        tc["nvcc_pp"] = nvcc_host_preprocessor(tc["nvcc"])
    version = subprocess.run([tc["cxx"][0], "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    # the precompiled header depends on the compiler, its flags and torch, not on the scan's rules (790 MB each)
    tc["pch_id"] = hashlib.sha256(json.dumps([tc["cxx"], version, torch.__version__]).encode()).hexdigest()[:16]
    tc["id"] = hashlib.sha256(json.dumps([tc, version, torch.__version__, SCAN_VERSION]).encode()).hexdigest()[:16]
    _TOOLCHAIN[backend] = tc
    return tc


def shared_cxx_runtime(cxx: str) -> list:
    """The shared C++ runtime that torch itself runs on, by its path, first on the link line. `-lstdc++` (which g++
    adds) takes the first libstdc++.so or libstdc++.a on its search path: a folder that holds only the static one
    (a CUDA library folder beside torch; on one H200 host, the compiler's own folder, whose libstdc++.so is a dangling
    link) gives the module a second, static C++ runtime beside torch's, with its locale, file and random-device
    imports, which the import check refuses. With the shared library named first, nothing is left for the archive."""
    with contextlib.suppress(OSError):
        for line in open("/proc/self/maps"):  # Linux: what this process (which imported torch) has loaded
            if "/libstdc++.so" in line:
                return [line.split()[-1]]
    found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout.strip()
    return [str(Path(found).resolve())] if os.path.isabs(found) and Path(found).exists() else []


def shared_cudart(libdirs: list, major: str) -> str:
    """The CUDA runtime of nvcc's major version, as a shared library, by its path (`-lcudart` takes whichever
    libcudart.so or libcudart.a comes first on the -L folders)."""
    found = [f for d in libdirs for f in sorted(Path(d).glob("libcudart.so*"), key=lambda f: len(f.name))]
    for f in found:
        if f".so.{major}" in f.resolve().name:
            return str(f)
    return str(found[0]) if found else "-lcudart"  # none: the import check says what a static runtime brought in


def nvcc_major(nvcc: str) -> str:
    m = re.search(r"release (\d+)", subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout)
    return m.group(1) if m else ""


def nvcc_host_preprocessor(nvcc: list) -> list:
    """The host compiler's preprocessing command that nvcc itself runs on a .cu file (from `nvcc --dryrun`),
    with SRC and OUT placeholders: the scan reads exactly the host code nvcc compiles."""
    r = subprocess.run([*nvcc, "--dryrun", "-c", "SRC.cu", "-o", "OUT.o"], capture_output=True, text=True)
    for line in (r.stdout + r.stderr).splitlines():
        line = line.removeprefix("#$ ").strip()
        if " -E " in line and "SRC.cu" in line and "__CUDA_ARCH__=" not in line:
            argv = shlex.split(line)
            argv[argv.index("-o") + 1] = "OUT"
            return ["SRC" if a == "SRC.cu" else a for a in argv] + [f"-I{p}" for p in ce.include_paths()]
    raise RuntimeError(f"cannot find the host preprocessing step in `nvcc --dryrun`:\n{r.stderr[-2000:]}")


def preprocess(tc: dict, src: Path, out: Path, timeout: float, pch: Path | None = None):
    """Run the preprocessor (sandboxed) that the compiler itself will use; returns (SandboxResult, text).
    With `pch` (a .cpp that uses torch), <torch/extension.h> is included first, from the precompiled header: the
    text holds `#pragma GCC pch_preprocess "<pch>"` in place of its 17 MB, and compiling the text loads it."""
    if src.suffix == ".cu":
        cmd = [str(out) if a == "OUT" else str(src) if a == "SRC" else a for a in tc["nvcc_pp"]]
    elif pch:
        cmd = [tc["cxx"][0], f"-I{pch.parent.parent}", *tc["cxx"][1:], "-include", str(pch.with_suffix("")),
               "-fpch-preprocess", "-E", "-o", str(out), str(src)]
    else:
        cmd = [*tc["cxx"], "-E", "-o", str(out), str(src)]
    # -dD keeps every #define in the text, where it was written: the body of a macro that a workspace file defines is
    # scanned as its code, also when the macro is only ever expanded inside a system header (which is not scanned).
    cmd += ["-dD", *workspace_includes(src, out.parent)]
    r = run_sandboxed(cmd, out.parent, timeout, mem_gb=None, output_limit=40_000, readable=[pch.parent.parent] if pch else ())
    return r, (out.read_text(errors="replace") if r.returncode == 0 and out.exists() else "")


def workspace_includes(src: Path, root: Path) -> list:
    """The workspace's include folders, in the one order that both the scan's preprocessing and nvcc's compile of a
    .cu use: an `#include <x.h>` that resolved to kernels/x.h in the scan must not resolve to ./x.h in the compile."""
    return [f"-I{src.parent}", f"-I{root}", f"-I{root}/kernels"]


def same_host_text(compiled: Path, scanned: Path) -> bool:
    """Whether nvcc's own host preprocessing (kept with --keep) is the text the scan read. nvcc preprocesses a .cu
    again when it compiles it, and what a directive sees may differ by then: `__has_include` of a file that exists
    only while nvcc runs (its temporary files, another process's /proc entry) chose code no scan read. The scan's
    text has every #define and #undef in it (-dD): those lines, line markers and blank lines are set aside."""
    if not compiled.is_file() or not scanned.is_file():
        return False
    skip = re.compile(r'#\s*(\d+\s+"|define\s|undef\s)')
    text = lambda path: [l for l in path.read_text(errors="replace").split("\n") if l.strip() and not skip.match(l)]
    return text(compiled) == text(scanned)


_PCH_FAILED: set = set()

# What a binding file costs to compile is mostly per-file work that torch's headers cause even precompiled: GCC
# writes a precompiled header before it instantiates the templates that the header's inline functions use, so every
# file instantiates them again (-ftime-report's "phase lang. deferred"), and pybind11 3's headers define static type
# data whose functions every file compiles. An empty file on 2 cores, -O3: 7.4-8.7 s under the whole
# <torch/extension.h>, 4.6-5.1 s under this header (pybind11's headers alone 3.3 s, ATen's 0.9 s; at -O1, the CUDA
# backend's level (toolchain), 3.9 s, -O0 3.6 s), where the C++ frontend's modules, optimisers, data loaders and
# autograd functions (most of torch/all.h, which bindings rarely use) are left out. It holds torch/python.h
# (tensors, ATen, pybind11 and torch's casters), at::parallel_for, torch/utils.h (NoGradGuard, get_num_threads, and
# the profiler's global names), torch/mps.h (its global names), and the headers that define every other macro of the
# whole header. torch_pch checks that the macros are the same, name for name and value for
# value, so no `#if` of a workspace reads differently under it, and records the headers it leaves out: a source
# whose text enters one of them (included after the light header, it would be parsed under the workspace's macros,
# where the whole header has parsed it already), or whose compile fails with an error that involves torch
# (TORCH_ERROR_RE: a name the light header lacks), is preprocessed, scanned and compiled again under the whole one.
LIGHT_HEADER = """#pragma once
#include <torch/python.h>
#include <ATen/Parallel.h>
#include <torch/utils.h>
#include <torch/mps.h>
#include <ATen/Config.h>
#include <c10/util/ThreadLocal.h>
#include <c10/util/strong_type.h>
#include <torch/version.h>
#include <torch/enum.h>
#include <torch/nn/modules/common.h>
#include <torch/optim/serialize.h>
#include <torch/csrc/profiler/util.h>
#include <queue>
"""


# The dispatch monitor (protocol.py) sees PyTorch's operators through the thread's Python dispatch keys. The one door a
# module has to the thread's key set is c10's ExcludeDispatchKeyGuard (torch::empty's inline code makes one of
# autograd's keys; the rest of the key set's API is refused at link), so every module is linked with this in its
# place (`-Wl,--wrap`): a guard may exclude autograd's keys and ADInplaceOrView only, its destructor takes back only
# the keys its constructor added, and its bytes are zeros: what c10's guard keeps there (the key set's address, the
# saved set its destructor writes back) is kept in a side table the kernel cannot reach by the guard's address.
# c10's own constructor and destructor run only on a private guard of no keys, to find the thread's key set.
# (Named by their mangled symbols: the complete and base object variants.)
GUARD_SYMBOLS = ["_ZN3c104impl23ExcludeDispatchKeyGuardC1ENS_14DispatchKeySetE",
                 "_ZN3c104impl23ExcludeDispatchKeyGuardC2ENS_14DispatchKeySetE",
                 "_ZN3c104impl23ExcludeDispatchKeyGuardD1Ev", "_ZN3c104impl23ExcludeDispatchKeyGuardD2Ev"]
GUARD_SOURCE = r"""#include <c10/core/impl/LocalDispatchKeySet.h>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

using c10::DispatchKeySet;
using c10::impl::PODLocalDispatchKeySet;
namespace {
struct Guard { PODLocalDispatchKeySet* tls; DispatchKeySet saved; };  // (c10's layout)
static_assert(sizeof(Guard) == sizeof(c10::impl::ExcludeDispatchKeyGuard), "c10's guard changed its layout");
struct Made { PODLocalDispatchKeySet* tls; uint64_t added; };
std::mutex mu;
std::unordered_map<const void*, Made>& made() {  // guard -> what it did (never freed: no exit order)
  static auto* m = new std::unordered_map<const void*, Made>();
  return *m;
}
const uint64_t kAllowed = c10::autograd_dispatch_keyset_with_ADInplaceOrView.raw_repr();
}  // namespace

#define REAL(x) __real__ZN3c104impl23ExcludeDispatchKeyGuard##x
#define WRAP(x) __wrap__ZN3c104impl23ExcludeDispatchKeyGuard##x
extern "C" {
void REAL(C1ENS_14DispatchKeySetE)(Guard*, DispatchKeySet);
void REAL(D1Ev)(Guard*);

static PODLocalDispatchKeySet* key_set() {  // this thread's, found as c10's guard finds it (no keys: no change)
  Guard probe;
  REAL(C1ENS_14DispatchKeySetE)(&probe, DispatchKeySet());
  PODLocalDispatchKeySet* tls = probe.tls;
  REAL(D1Ev)(&probe);
  std::memset(static_cast<void*>(&probe), 0, sizeof probe);  // (no address left on the stack in it)
  return tls;
}
static void make(Guard* g, DispatchKeySet exclude) {
  std::memset(static_cast<void*>(g), 0, sizeof *g);
  if (exclude.raw_repr() & ~kAllowed)
    throw std::runtime_error("a kernel may exclude autograd's dispatch keys only (PyTorch's operators reach the "
                             "harness's dispatch monitor through the others)");
  PODLocalDispatchKeySet* tls = key_set();
  uint64_t before = tls->excluded().raw_repr();
  tls->set_excluded(DispatchKeySet(DispatchKeySet::RAW, before | exclude.raw_repr()));
  std::lock_guard<std::mutex> lock(mu);
  made()[g] = Made{tls, exclude.raw_repr() & ~before};
}
static void end(Guard* g) {
  Made m;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = made().find(g);
    if (it == made().end()) return;  // (not made by make, or ended already)
    m = it->second;
    made().erase(it);
  }
  m.tls->set_excluded(DispatchKeySet(DispatchKeySet::RAW, m.tls->excluded().raw_repr() & ~m.added));
}
void WRAP(C1ENS_14DispatchKeySetE)(Guard* g, DispatchKeySet k) { make(g, k); }
void WRAP(C2ENS_14DispatchKeySetE)(Guard* g, DispatchKeySet k) { make(g, k); }
void WRAP(D1Ev)(Guard* g) { end(g); }
void WRAP(D2Ev)(Guard* g) { end(g); }
}
"""


def guard_object(tc: dict, timeout: float) -> Path:
    """GUARD_SOURCE compiled with the toolchain, once (under a lock, renamed into place when complete)."""
    obj = CACHE_DIR / "obj" / f"guard-{tc['id']}.o"
    with file_lock(CACHE_DIR / "locks" / f"guard-{tc['id']}.lock"):
        if not obj.exists():
            obj.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="guard-", dir=CACHE_DIR) as t:
                (Path(t) / "guard.cpp").write_text(GUARD_SOURCE)
                r = run_sandboxed([*tc["cxx"], "-c", "guard.cpp", "-o", "guard.o"], t, timeout, mem_gb=None,
                                  output_limit=4000)
                if r.returncode != 0:
                    raise RuntimeError(f"the harness's guard did not compile:\n{error_excerpt(r.stderr + r.stdout)}")
                os.chmod(Path(t) / "guard.o", 0o644)
                os.replace(Path(t) / "guard.o", obj)
    return obj


def torch_pch(tc: dict, timeout: float, light: bool = False) -> Path | None:
    """<torch/extension.h> precompiled with this toolchain's flags, built once (sandboxed, under a lock): parsing it
    is half of compiling a binding file. Returns the .gch path (next to the header it was made from, named
    torch/extension.h, as GCC looks for X.gch beside X), or None where it cannot be built (the build goes on without
    it). light=True: LIGHT_HEADER under that name, with `whole_only.txt` beside it (the headers the whole one
    includes and it does not), or the whole header where the two do not define the same macros."""
    deadline = time.monotonic() + timeout
    left = lambda: max(1.0, deadline - time.monotonic())
    name = tc["pch_id"] + (f"-light-{hashlib.sha256(LIGHT_HEADER.encode()).hexdigest()[:8]}" if light else "")
    gch = CACHE_DIR / "pch" / name / "torch" / "extension.h.gch"
    differs = CACHE_DIR / "pch" / f"{name}.differs"  # (the light header's macros are not the whole one's: checked once)
    built = name not in _PCH_FAILED and not differs.exists() and _build_pch(tc, name, gch, differs, light, left)
    if built:
        return gch
    return torch_pch(tc, left()) if light else None  # (outside the light header's lock)


def _build_pch(tc: dict, name: str, gch: Path, differs: Path, light: bool, left) -> bool:
    """torch_pch's work, under the header's lock: whether the .gch is there (made now, or before)."""
    with file_lock(CACHE_DIR / "locks" / f"pch-{name}.lock"):
        if gch.exists():
            return True
        header = next((Path(r) / "torch" / "extension.h" for r in tc["roots"] if (Path(r) / "torch" / "extension.h").exists()), None)
        if header is None or differs.exists():
            return False
        with tempfile.TemporaryDirectory(prefix="pch-", dir=CACHE_DIR) as t:
            (Path(t) / "torch").mkdir()
            if light:
                (Path(t) / "torch" / "extension.h").write_text(LIGHT_HEADER)
                for p in (t, Path(t) / "torch", Path(t) / "torch" / "extension.h"):  # readable by the probes' sandbox uid
                    os.chmod(p, 0o644 if Path(p).is_file() else 0o755)
                try:
                    mine, whole = _probe(tc, t, "-dM", left()), _probe(tc, None, "-dM", left())
                    mine_h, whole_h = _probe(tc, t, "-M", left()), _probe(tc, None, "-M", left())
                except TimeoutError:  # (this build's time ran out, not the header: a later build checks again)
                    return False
                if None in (mine, whole, mine_h, whole_h):  # (the preprocessor failed: this process does without)
                    _PCH_FAILED.add(name)
                    return False
                if mine != whole:
                    differs.parent.mkdir(parents=True, exist_ok=True)
                    differs.write_text("\n".join(sorted(set(whole) ^ set(mine))) + "\n")
                    return False
                (Path(t) / "whole_only.txt").write_text("\n".join(sorted(set(whole_h) - set(mine_h))) + "\n")
            else:
                (Path(t) / "torch" / "extension.h").symlink_to(header)
            r = run_sandboxed([*tc["cxx"], "-x", "c++-header", str(Path(t) / "torch" / "extension.h"), "-o",
                               f"{t}/torch/extension.h.gch"], t, left(), mem_gb=None, output_limit=4000)
            if r.returncode != 0:
                if not r.timed_out:  # (a timeout is the calling build's budget: a later build tries again)
                    _PCH_FAILED.add(name)
                return False
            for p in (t, *Path(t).iterdir(), *Path(t, "torch").iterdir()):  # readable by the sandbox's uid
                if not Path(p).is_symlink():
                    os.chmod(p, 0o755 if Path(p).is_dir() else 0o644)
            gch.parent.parent.parent.mkdir(parents=True, exist_ok=True)
            os.replace(t, gch.parent.parent)  # atomic: a half-written header never has the final name
            os.mkdir(t)  # (for TemporaryDirectory's cleanup)
        return True


def _probe(tc: dict, first: str | None, what: str, timeout: float) -> list | None:
    """What `#include <torch/extension.h>` brings, found in the folder `first` before torch's own: its macros with
    their values (what="-dM": sorted `#define` lines) or the headers it includes (what="-M": normalised paths);
    None where the preprocessor fails, TimeoutError where it ran out of time."""
    with tempfile.TemporaryDirectory(prefix="probe-", dir=CACHE_DIR) as d:
        (Path(d) / "probe.cpp").write_text("#include <torch/extension.h>\n")
        cmd = [tc["cxx"][0], *([f"-I{first}"] if first else []), *tc["cxx"][1:], "-E", what, "probe.cpp", "-o", "out.txt"]
        r = run_sandboxed(cmd, d, timeout, mem_gb=None, output_limit=4000, readable=[first] if first else ())
        if r.timed_out:
            raise TimeoutError
        if r.returncode != 0:
            return None
        text = Path(d, "out.txt").read_text()
        if what == "-M":  # "probe.o: probe.cpp /usr/include/c++/12/cstddef \\\n ..."
            return sorted({os.path.normpath(w) for w in text.replace("\\\n", " ").split()[1:] if w.startswith("/")})
        return sorted(text.splitlines())


# An error under the light header that the whole one could undo involves torch: a name it lacks ("'Linear' is not a
# member of 'torch::nn'"), or an overload or type of torch's in the message. Any other error (a type error in the
# workspace's own code, its own misspelt name) is the same under both headers, and is reported at once: compile
# errors are common in RL, and compiling them twice would cost ~60% more than the whole header alone.
TORCH_ERROR_RE = re.compile(r"error:[^\n]*\b(torch|at|c10|caffe2|pybind11|py)(::|[’'`])")


_EXPANSION: dict = {}


def module_expansion(tc: dict, suffix: str, timeout: float) -> list:
    """The tokens PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) expands to with this toolchain (probed once)."""
    key = (tc["id"], suffix)
    saved = CACHE_DIR / "scan" / f"module-{tc['id']}{suffix}.json"  # one probe per toolchain, not per process
    if key not in _EXPANSION and saved.exists():
        _EXPANSION[key] = json.loads(saved.read_text())
    if key not in _EXPANSION:
        with tempfile.TemporaryDirectory(prefix="probe-", dir=CACHE_DIR) as d:
            src = Path(d) / f"probe{suffix}"
            src.write_text("#include <torch/extension.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n")
            r, text = preprocess(tc, src, Path(d) / "probe.ii", timeout)
            if not text:
                raise RuntimeError(f"the preprocessor failed on a probe file:\n{error_excerpt(r.stderr)}")
            tokens, _ = scan.split_preprocessed(text, lambda p: p == str(src))
            _EXPANSION[key] = scan.module_expansion(tokens)
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = saved.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(_EXPANSION[key]))
        os.replace(tmp, saved)
    return _EXPANSION[key]


def error_excerpt(text: str, max_lines: int = 16) -> str:
    """The first compiler errors, not 400 lines of template noise."""
    lines = [l for l in text.splitlines() if l.strip()]
    picked = []
    for i, l in enumerate(lines):
        if re.search(r"\berror\b|undefined reference|fatal", l, re.I):
            picked += lines[i:i + 3]
        if len(picked) >= max_lines:
            break
    picked = list(dict.fromkeys(picked)) or lines[-max_lines:]
    return "\n".join(l if len(l) < 240 else l[:237] + "..." for l in picked[:max_lines])


def prepare(backend: str, timeout: float = 600.0) -> dict:
    """What a machine's first build does before its own sources, once per toolchain: the toolchain, the precompiled
    light header, the probes of PYBIND11_MODULE's expansion and the harness's guard (GUARD_SOURCE; 36 s in all on a
    fresh H100). train.py runs it beside the model's loading, so the teacher's first verdicts do not wait for it.
    Held as a candidate, as a build is (the compiler keeps a core busy: no baseline is timed meanwhile). Returns the
    seconds of each part (~0 when cached)."""
    with candidate_alive(backend):
        t = time.monotonic()
        tc = toolchain(backend)
        took = {"toolchain": time.monotonic() - t}
        t = time.monotonic()
        torch_pch(tc, timeout, light=True)
        took["precompiled header"] = time.monotonic() - t
        t = time.monotonic()
        for suffix in (".cpp", ".cu") if backend == "cuda" else (".cpp",):
            module_expansion(tc, suffix, timeout)
        guard_object(tc, timeout)
        took["probes and guard"] = time.monotonic() - t
    return took


def build(files: dict, backend: str, timeout: float = 600.0, light: bool = True) -> Build:
    """Preprocess, scan and compile every source into the object cache, then link the module. Killed builds
    leave nothing behind: objects are renamed into place only when complete, locks are flocks. A cached object
    passed the same scan (the scan's version is part of its key); its metadata says whether it holds the module.
    A build counts as a candidate on its device: the sources decide how long the compiler keeps every core busy,
    so no baseline is timed meanwhile. light=False: the whole <torch/extension.h> only (bench/env_bench.py's
    comparison)."""
    with candidate_alive(backend):
        return _build(files, backend, timeout, light)


def _build(files: dict, backend: str, timeout: float, light: bool) -> Build:
    t0 = time.monotonic()
    tc = toolchain(backend)
    steps = {"toolchain": time.monotonic() - t0}
    sources = sorted(p for p in files if Path(p).suffix in SOURCE_EXT)
    if not sources:
        return Build(False, None, "no kernel sources: write kernels/*.cpp" + (" or *.cu" if backend == "cuda" else ""), 0, [])
    headers = "".join(f"{p}\0{files[p]}\0" for p in sorted(files) if Path(p).suffix in HEADER_EXT)
    objdir = CACHE_DIR / "obj"
    objdir.mkdir(parents=True, exist_ok=True)
    keys = {p: hashlib.sha256(f"{tc['id']}\0{light}\0{p}\0{files[p]}\0{headers}".encode()).hexdigest()[:32] for p in sources}
    rebuilt, errors, violations, has_module, pch_of, fell_back = [], [], [], {}, {}, []
    deadline = time.monotonic() + timeout
    left = lambda: max(1.0, deadline - time.monotonic())
    # Directives first, on the text as written: the scan below trusts the line markers of the preprocessed text.
    bad = [v for p in sorted(files) for v in scan.check_directives(p, files[p])]
    if bad:
        return Build(False, None, "\n".join(bad), time.monotonic() - t0, [], bad)

    # A .cpp that includes torch/extension.h (itself or through workspace headers) starts from the precompiled light
    # header (LIGHT_HEADER), and is judged under the whole one where the two could differ for it (scan_first, compile_one).
    uses_pch = {p for p in sources if p.endswith(".cpp") and includes_torch(p, files)
                and not (objdir / f"{keys[p]}.json").exists()}  # (a cached object needs no compiling)
    t = time.monotonic()
    pch = torch_pch(tc, left(), light=light) if uses_pch else None
    steps["precompiled header"] = time.monotonic() - t
    whole_gch = CACHE_DIR / "pch" / tc["pch_id"] / "torch" / "extension.h.gch"  # (built only when a source needs it)
    # (the folders of our headers named torch/extension.h, if GCC passes a .gch by)
    roots = tc["roots"] + [str(whole_gch.parent.parent), *([str(pch.parent.parent)] if pch else [])]
    whole_only = set()  # the headers the whole header includes and the light one does not (torch_pch)
    if pch is not None and pch != whole_gch:
        whole_only = set((pch.parent.parent / "whole_only.txt").read_text().split())

    with tempfile.TemporaryDirectory(prefix="build-", dir=CACHE_DIR) as tmp:
        tmp = Path(tmp).resolve()
        for p, text in files.items():  # sources and headers, laid out as in the workspace
            (tmp / p).parent.mkdir(parents=True, exist_ok=True)
            (tmp / p).write_text(text)
        is_user = lambda path: path.startswith("/") and os.path.normpath(path).startswith(str(tmp) + "/")

        def scan_one(p, mine=None):  # preprocess and check (skipped for a cached object: it passed the same scan);
            obj, meta = objdir / f"{keys[p]}.o", objdir / f"{keys[p]}.json"  # -> errors, violations, whole-only headers
            if obj.exists() and meta.exists():
                with contextlib.suppress(ValueError, KeyError, TypeError):  # (unreadable: scanned and built again)
                    has_module[p] = json.loads(meta.read_text())["module"]
                    return [], [], []
            src, pre = tmp / p, tmp / f"{keys[p]}.ii"
            r, text = preprocess(tc, src, pre, left(), mine)
            if not text:
                why = f"preprocessing of {p} {r.crash}" if r.crash else f"{p} failed to preprocess"
                return [f"{why}:\n{error_excerpt(r.stderr + r.stdout)}"], [], []
            # The one pragma that loads the precompiled header is ours, once (a workspace's own is refused below).
            ours = f'#pragma GCC pch_preprocess "{mine}"\n'
            pch_of.pop(p, None)
            if mine and text.count(ours) == 1:
                text = text.replace(ours, "\n", 1)
                pch_of[p] = mine
            tokens, includes = scan.split_preprocessed(text, is_user)
            bad = [f"{p}: #include of {inc} is not allowed (workspace files, torch/CUDA headers and standard headers only)"
                   for _, inc in includes if not is_user(inc) and (inc.endswith(".gch") or not scan.header_allowed(inc, roots))]
            expansion = module_expansion(tc, src.suffix, left())
            hits = scan.find_seq(tokens, expansion)
            for h in reversed(hits):
                del tokens[h:h + len(expansion)]
            has_module[p] = len(hits)
            return [], bad + scan.check_macro_order(p, text, is_user) + scan.check_tokens(p, tokens), \
                scan.headers_entered(text) & whole_only if mine is not None and mine != whole_gch else set()

        def scan_first(p):
            errs, bad, missing = scan_one(p, pch if p in uses_pch else None)
            if missing:  # a header the light one leaves out, parsed here under the workspace's macros: the whole one
                fell_back.append(p)  # has parsed it already (before them), and #pragma once skips it
                errs, bad, _ = scan_one(p, torch_pch(tc, left()))
            return errs, bad

        def compile_one(p):
            obj, meta = objdir / f"{keys[p]}.o", objdir / f"{keys[p]}.json"
            with file_lock(CACHE_DIR / "locks" / f"{keys[p]}.lock"):
                if obj.exists() and meta.exists():
                    return
                src, pre, part = tmp / p, tmp / f"{keys[p]}.ii", tmp / f"{keys[p]}.o.part"
                # A .cpp compiles from the text just scanned (no second preprocessing); nvcc runs its own passes.
                keep = tmp / f"{keys[p]}.keep"  # nvcc's intermediate files, its host pass's text among them
                cmd = [*tc["nvcc"], *workspace_includes(src, tmp), "--keep", "--keep-dir", str(keep), "-c", str(src)] \
                    if p.endswith(".cu") else [*tc["cxx"], "-x", "c++-cpp-output", "-c", str(pre)]
                if p.endswith(".cu"):
                    keep.mkdir()

                def run():
                    return run_sandboxed([*cmd, "-o", str(part)], tmp, left(), mem_gb=None,
                                         output_limit=40_000, readable=[pch_of[p].parent.parent] if p in pch_of else ())
                r = run()
                if r.returncode != 0 and not r.crash and pch_of.get(p) not in (None, whole_gch) and \
                        TORCH_ERROR_RE.search(r.stderr + r.stdout):
                    # Under the light header, an error that involves torch: maybe the light header lacks what p
                    # uses. The whole header's text, scanned again, and compiled.
                    errs, bad, _ = scan_one(p, torch_pch(tc, left()))
                    if errs or bad:
                        errors.extend(errs)
                        violations.extend(bad)
                        return
                    fell_back.append(p)
                    r = run()
                if r.returncode != 0 or not part.exists():
                    why = f"compilation of {p} {r.crash}" if r.crash else f"{p} failed to compile"
                    errors.append(f"{why}:\n{error_excerpt(r.stderr + r.stdout)}")
                    return
                if p.endswith(".cu") and not same_host_text(keep / f"{src.stem}.cpp4.ii", pre):
                    violations.append(f"{p}: the host code nvcc compiled is not the text that was scanned (it reads a "
                                      "file that exists only while compiling, or one that changed)")
                    return
                with state:  # into the cache now if every scan of the build has passed (the usual case: a binding
                    if scanned.is_set() and accepted():  # file's compile outlasts every scan), else at the end
                        commit(p)
                    else:
                        pending.append(p)

        def commit(p):  # (holding p's lock)
            obj, meta = objdir / f"{keys[p]}.o", objdir / f"{keys[p]}.json"
            if not (obj.exists() and meta.exists()):  # (another build of the same source may have committed it)
                part = meta.with_suffix(f".{uuid.uuid4().hex}.part")
                part.write_text(json.dumps({"module": has_module[p]}))
                os.replace(part, meta)  # atomic, like the object: a half-written file never has the final name
                os.replace(tmp / f"{keys[p]}.o.part", obj)
            rebuilt.append(p)

        def accepted():  # every scan has passed and exactly one source defines the module: objects may be cached
            modules = [n for n in has_module.values() if n]
            return not violations and not scan_errors and modules == [1]

        def module_error():
            modules = [p for p in sources if has_module.get(p)]
            if not scan_errors and (len(modules) != 1 or has_module[modules[0]] != 1):  # (before compile errors)
                msg = "no source defines" if not modules else f"{', '.join(modules)} define{'s' if len(modules) == 1 else ''}"
                return (f"{msg} PYBIND11_MODULE(TORCH_EXTENSION_NAME, m){' more than once' if modules else ''}; "
                        "exactly one source must, once, with exactly that spelling")

        # Each source compiles as soon as its own scan passes, so the binding files' compiles (seconds) do not wait
        # for the slowest scan (a .cu's host preprocessing). Only text that passed its scan is compiled, and an
        # object enters the cache only once every scan of the build has passed: a refused build leaves nothing
        # behind and reports nothing compiled (its objects stay in the build's temporary folder).
        state, scanned, pending, scan_errors, n_scanned = threading.Lock(), threading.Event(), [], [], [0]

        def scan_and_compile(p):
            t = time.monotonic()
            errs, bad = scan_first(p)
            steps[f"scan {p}"] = time.monotonic() - t
            with state:
                scan_errors.extend(errs)
                violations.extend(bad)
                n_scanned[0] += 1
                if n_scanned[0] == len(sources):
                    scanned.set()
            if not errs and not bad:
                t = time.monotonic()
                compile_one(p)
                steps[f"compile {p}"] = time.monotonic() - t

        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            list(pool.map(scan_and_compile, sources))
        errors[:0] = scan_errors
        if accepted():
            for p in pending:
                with file_lock(CACHE_DIR / "locks" / f"{keys[p]}.lock"):
                    commit(p)
        rebuilt.sort()
        if violations:  # (a scan's, or found in a source scanned again under the whole header)
            return Build(False, None, "\n".join(violations), time.monotonic() - t0, rebuilt, violations)
        if msg := module_error():
            return Build(False, None, msg, time.monotonic() - t0, rebuilt)
        if errors:
            return Build(False, None, "\n".join(errors), time.monotonic() - t0, rebuilt)
        link_key = hashlib.sha256("".join(keys[p] for p in sources).encode() + tc["id"].encode()).hexdigest()[:32]
        so = CACHE_DIR / "so" / link_key / "cuda_extension.so"
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            part, t = tmp / "cuda_extension.so", time.monotonic()
            cmd = [tc["cxx"][0], "-shared", *[str(objdir / f"{keys[p]}.o") for p in sources], str(guard_object(tc, left())),
                   *[f"-Wl,--wrap={sym}" for sym in GUARD_SYMBOLS], "-o", str(part), *tc["ldflags"]]
            r = run_sandboxed(cmd, tmp, left(), mem_gb=None, writable=[objdir])
            if r.returncode != 0:
                return Build(False, None, "link failed:\n" + error_excerpt(r.stderr + r.stdout), time.monotonic() - t0, rebuilt)
            steps["link"], t = time.monotonic() - t, time.monotonic()
            # What the module imports is what it can call, whatever the sources spelled (scan.check_imports).
            # and a system call needs no import: only an instruction, which no compiler emits for C++ or CUDA code
            # (the two reads of the module run side by side)
            with ThreadPoolExecutor(max_workers=2) as pool:
                nm = pool.submit(run_sandboxed, ["nm", "-D", "--undefined-only", "-C", str(part)], tmp, 120, mem_gb=None,
                                 output_limit=1 << 24)
                dis = pool.submit(run_sandboxed, ["objdump", "-d", "--no-show-raw-insn", str(part)], tmp, 120, mem_gb=None,
                                  output_limit=1 << 28)
                r, rd = nm.result(), dis.result()
            own = {w for p in sources for w in re.findall(r"[A-Za-z_]\w*", files[p])}
            bad = scan.check_imports([l.split(None, 1)[-1] for l in r.stdout.splitlines() if l.strip()], IMPORT_OPS, own) \
                if r.returncode == 0 else [f"the linked module cannot be read by nm: {error_excerpt(r.stderr)}"]
            bad += scan.check_instructions(rd.stdout) if rd.returncode == 0 else ["the linked module cannot be disassembled"]
            steps["module checks"] = time.monotonic() - t
            if bad:
                return Build(False, None, "\n".join(bad), time.monotonic() - t0, rebuilt, bad)
            mine = so.with_suffix(f".{uuid.uuid4().hex}.part")  # builds of the same sources may link at the same time
            shutil.copy(part, mine)
            os.replace(mine, so)
    return Build(True, so, "", time.monotonic() - t0, rebuilt, pch=sorted(pch_of), whole_header=sorted(fell_back),
                 steps={k: round(v, 3) for k, v in steps.items()  # (a cached source was neither scanned nor compiled)
                        if not k.startswith(("scan ", "compile ")) or k.split(" ", 1)[1] in rebuilt})


_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def includes_torch(path: str, files: dict) -> bool:
    """Whether `path` includes <torch/extension.h>, itself or through workspace headers (by name; a guess that
    only decides whether the precompiled header is offered: the scan reads what the preprocessor really did)."""
    seen, todo = set(), [path]
    while todo:
        p = todo.pop()
        for name in _INCLUDE_RE.findall(files.get(p, "")):
            if name == "torch/extension.h":
                return True
            todo += [h for h in files if Path(h).suffix in HEADER_EXT and h not in seen and
                     (h == name or h.endswith("/" + name))]
            seen.update(todo)
    return False


def gpu_query(field: str) -> str:
    """Ask nvidia-smi (the parent never creates a CUDA context of its own)."""
    if not shutil.which("nvidia-smi"):
        return ""
    dev = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader", "-i", dev], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def toolchain_id_light(backend: str) -> str:
    """What baseline timings depend on: device and torch version (without building flags)."""
    import torch
    dev = gpu_query("name") if backend == "cuda" else os.uname().machine
    return f"{torch.__version__}/{dev}/{os.cpu_count()}"
