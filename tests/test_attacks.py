"""Adversarial tests, second red team: variants of the attack classes (tests/test_env.py has the first ones) that
the design let through, each shown end to end or at the build, and each refused by design now.

CPU only. Workspaces share the test build cache (tests/conftest.py); the scan-level cases include pybind11 alone,
so a case that is wrongly accepted costs one small build, and a refused one costs no compilation at all.
"""
import os
import sys
import time
from pathlib import Path

import pytest
import torch

import build as builder
import env
import protocol
import scan
import sandbox
from test_env import RELU, make_ws, model_new

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "attack_cases"
MODULE = "#include <pybind11/pybind11.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n"
FORK = 'extern "C" int fork(); int f() { return fork(); }\n'


# ------------------------------------------------------------------ 7. the scan: code it never read
# The scan attributes preprocessed text to files by the line markers in it, and scans only the workspace's. A source
# could make its own code look like a system header's (a #line directive, a GNU line marker, or text that reads as
# one), and a section name is copied verbatim into the assembler's input. Each of these built `fork()` (or raw
# assembly: a `syscall` instruction, `.incbin` of a host file) into the module.
HIDDEN_FROM_THE_SCAN = {
    "line_directive": '#line 1 "/usr/include/stdio.h"\n' + FORK,
    "gnu_line_marker": '# 1 "/usr/include/stdio.h" 1 3 4\n' + FORK,
    "line_directive_spliced_and_commented": '/*\n*/ %:/**/li\\\nne 1 "/usr/include/stdio.h"\n' + FORK,
    "line_directive_after_nul": '\0#line 1 "/usr/include/stdio.h"\n' + FORK,  # (GCC skips NULs as blanks)
    "line_directive_after_bom": '\ufeff#line 1 "/usr/include/stdio.h"\n' + FORK,
    "marker_text_in_raw_string": 'const char* s = R"x(\n# 1 "/usr/include/stdio.h" 1 3 4\n)x";\n' + FORK,
    "section_name_assembly": '__attribute__((used, section(".text\\n.globl evil\\nevil: mov $57, %eax\\nsyscall\\nret\\n'
                             '.section .data\\n#"))) int x = 1;\n',
    # A workspace macro named like a builtin that libstdc++ calls (`__builtin_expect`), expanded only inside <string>,
    # whose body spells `__asm__` by token pasting (the -dD scan of its #define reads `__as ## m__`), and whose
    # `syscall` hides inside a `movabs` immediate for a linear disassembler: it built, with 110 executed `syscall`s
    # in std::string's code. A #define with a body may not come before a header the workspace does not own.
    "macro_pasted_into_a_system_header": '// nonce a4-paste-2\n#define __builtin_expect(a, b) ({ __as##m__ volatile('
                                         '"jmp 1f\\n.byte 0x48,0xb8\\n1: syscall\\n.byte 0x90,0x90,0x90,0x90,0x90,0x90\\n"); '
                                         '(long)(a); })\n#include <string>\n'
                                         'std::string copy(const std::string& s) { std::string t; t = s; return t; }\n',
    "cxx11_section_incbin": '[[gnu::used, gnu::section(".rodata\\n.incbin \\"/etc/hostname\\"\\n#")]] char y = 1;\n',
}


@pytest.mark.parametrize("name", sorted(HIDDEN_FROM_THE_SCAN))
def test_attack_scan_reads_every_line_of_the_workspace(name):
    b = env.build({"kernels/x.cpp": MODULE, "kernels/y.cpp": HIDDEN_FROM_THE_SCAN[name]}, "cpu")
    assert not b.ok and b.violations and b.rebuilt == [], b.log


def test_attack_macro_expanded_only_inside_a_header_is_scanned():
    """A workspace macro that pybind11's inline code expands (PyErr_Occurred) put 29 `syscall` instructions into the
    module: its body was in no line the scan read. Its #define is scanned now (and the machine code is checked)."""
    b = env.build({"kernels/x.cpp": (CASES / "macro_in_header.cpp").read_text()}, "cpu")
    assert not b.ok and "__asm__" in b.log and b.rebuilt == [], b.log


def test_attack_system_call_instructions_are_refused(tmp_path):
    """However inline assembly got into the module, its system calls show in the machine code."""
    obj = tmp_path / "s.o"
    src = tmp_path / "s.cpp"
    src.write_text('extern "C" long raw(long n) { long r; __asm__ volatile("syscall" : "=a"(r) : "a"(n) : "rcx", "r11"); return r; }\n')
    import subprocess
    if subprocess.run(["g++", "-c", str(src), "-o", str(obj)]).returncode != 0 or os.uname().machine != "x86_64":
        pytest.skip("needs g++ on x86-64")
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True).stdout
    assert scan.check_instructions(dis) and "syscall" in scan.check_instructions(dis)[0]
    honest = env.build({"kernels/ops.cpp": (ROOT / "tests" / "env_cases" / "ops.cpp").read_text()}, "cpu")
    assert honest.ok, honest.log
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(honest.so_path)], capture_output=True, text=True).stdout
    assert "GOMP_parallel" in dis and scan.check_instructions(dis) == []


# A pragma is an instruction to the compiler, and the scan cannot know what a new one does: `#pragma GCC
# pch_preprocess "f.gch"` passes through the preprocessor and makes the compiler load f.gch (code no scan read) as if
# it were the text; `#pragma weak` declares aliases; `#pragma GCC system_header` marks the rest of a file as a
# system header. Only pragmas on an allow-list are accepted, in any spelling (_Pragma, inside a macro).
PRAGMAS = {
    "pch_preprocess": '#pragma GCC pch_preprocess "/tmp/x.gch"\nint f() { return 1; }\n',
    "pch_preprocess_operator": '_Pragma("GCC pch_preprocess \\"/tmp/x.gch\\"")\nint f() { return 1; }\n',
    "pch_preprocess_in_macro": '#define LOAD _Pragma("GCC pch_preprocess \\"/tmp/x.gch\\"")\nLOAD\nint f() { return 1; }\n',
    "weak_alias": 'extern "C" int g() { return 1; }\n#pragma weak h = g\n',
    "system_header": '#pragma GCC system_header\nint f() { return 1; }\n',
    "unknown": '#pragma whatever 1\nint f() { return 1; }\n',
}


@pytest.mark.parametrize("name", sorted(PRAGMAS))
def test_attack_pragmas_outside_the_allow_list_are_refused(name):
    b = env.build({"kernels/x.cpp": MODULE, "kernels/y.cpp": PRAGMAS[name]}, "cpu")
    assert not b.ok and b.violations and b.rebuilt == [] and "pragma" in b.log, b.log


def test_attack_pragma_allow_list_keeps_honest_pragmas():
    src = ("#pragma once\n#pragma GCC diagnostic push\n#pragma GCC diagnostic ignored \"-Wunused\"\n"
           "void f(float* x, int n) {\n#pragma omp parallel for\n  for (int i = 0; i < n; i++) x[i] += 1;\n"
           "#pragma GCC unroll 4\n  for (int i = 0; i < n; i++) x[i] *= 2;\n#pragma unroll\n  for (int i = 0; i < 4; i++) x[i] = 0;\n}\n"
           "#pragma GCC diagnostic pop\n")
    assert scan.check_tokens("x.cpp", scan.split_preprocessed(f'# 1 "/w/x.cpp"\n{src}', lambda p: p == "/w/x.cpp")[0]) == []


@pytest.mark.parametrize("src,ok", [
    ("void apply(pybind11::module& m);\nvoid apply2(pybind11::module_& m);\n", True),  # CUDA Agent's registry spelling
    ("void f() { pybind11::module::import(\"os\"); }\n", False),  # a door through the older name stays closed
    ("void f() { pybind11::module_::import(\"os\"); }\n", False),
])
def test_attack_pybind_module_names_allow_the_type_not_its_doors(src, ok):
    tokens = scan.split_preprocessed(f'# 1 "/w/x.cpp"\n{src}', lambda p: p == "/w/x.cpp")[0]
    assert (scan.check_tokens("x.cpp", tokens) == []) == ok, scan.check_tokens("x.cpp", tokens)


def test_attack_directives_check_keeps_honest_sources():
    """Every kernel source in the repository passes the directive check (pragmas, stringizing, comments with #).
    Hidden folders are not the repository's (.git; a virtual environment in .venv holds torch's headers)."""
    sources = [f for f in ROOT.rglob("*") if f.suffix in {".cpp", ".cu", ".h", ".cuh", ".hpp"} and f.is_file()
               and CASES not in f.parents and not any(p.startswith(".") for p in f.relative_to(ROOT).parts)]
    assert len(sources) > 5
    for f in sources:
        assert scan.check_directives(f.name, f.read_text()) == [], f
    assert scan.check_directives("x.cpp", '#define S(a) #a\n#  pragma omp parallel for\n# /* c */ include <cmath>\n'
                                 'int a = 1; // see #12\n') == []
    # Universal character names: `#l\u0069ne` is a #line and `\u0023 1 "f" 1` prints a line marker with compilers that
    # accept a UCN for a basic character (g++ 12 in C++20 mode refuses both itself).
    assert scan.check_directives("x.cpp", '#l\\u0069ne 1 "/usr/include/stdio.h"\n')
    assert scan.check_directives("x.cpp", '\\u0023 1 "/usr/include/stdio.h" 1 3 4\n')


# ------------------------------------------------------------------ 4. PyTorch where the monitor does not look
# The dispatch monitor watches the thread that runs forward(). A kernel that ran `(x * scale).relu()` in an OpenMP
# worker, or inside at::parallel_for (on the scan's allow-list), got reward 3 for a PyTorch fallback (CPU, relu:
# 1.2x and 2.3x "faster" than eager). A background thread needs no banned word either: libstdc++'s
# __gthread_create (inline in <mutex>) or C11's thrd_create. The linked module's imports are checked instead.
# The same for the other doors: `__open64_2` opens a file, and `pkey_mprotect(p, n, PROT_NONE, -1)` (mprotect) with a
# SIGSEGV handler from `__sysv_signal` brings back lazily computed pages (a timed run then computes only the pages
# its sampled elements fall in: a quarter of them for an output of 256M elements).
@pytest.mark.parametrize("fn", ["fallback_in_omp_worker", "fallback_in_parallel_for"])
def test_attack_pytorch_in_another_thread_is_refused(tmp_path, fn):
    src = (CASES / "hidden_fallback.cpp").read_text()
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", f"cuda_extension.{fn}(x, self.scale)"), {"ops.cpp": src}),
                     backend="cpu")
    assert v.reward == -1 and not v.correct and "aten.mul" in " ".join(v.violations), v.summary()


# Python from C++ with no C API function named: model_new.py passes objects and strings (allowed), the kernel reads
# their type slots (o->ob_type->tp_getattro, mp_subscript, tp_call) to reach exec, and the exec'd code replaced the
# dispatch monitor's __torch_dispatch__. forward() was plain PyTorch: reward 3 (2.5x "faster" than a cached eager).
UNLOCK = ("import gc\\nfor o in gc.get_objects():\\n    if isinstance(o, type) and o.__name__ == \\\"OpMonitor\\\":\\n"
          "        o.__torch_dispatch__ = lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {}))\\n")


def test_attack_python_through_type_slots_is_refused(tmp_path):
    init = f"cuda_extension.run_python(self, 'forward', '__func__', '__builtins__', 'exec', ('{UNLOCK}',))"
    src = model_new("relu", "(x * self.scale).relu()", init_extra=init)
    v = env.evaluate(make_ws(tmp_path, "relu", src, {"ops.cpp": (CASES / "python_by_slots.cpp").read_text()}), backend="cpu")
    assert v.reward == -1 and not v.compiled and "ob_type" in " ".join(v.violations), v.summary()


THREADS = {
    "gthread_create": '#include <mutex>\nstatic void* g(void*) { return nullptr; }\n'
                      'int f() { __gthread_t t; return __gthread_create(&t, g, nullptr); }\n',
    "c11_thrd_create": 'extern "C" int thrd_create(unsigned long*, int (*)(void*), void*);\n'
                       'static int g(void*) { return 0; }\nint f() { unsigned long t; return thrd_create(&t, g, nullptr); }\n',
    "lazy_pages_by_other_names": 'extern "C" int pkey_mprotect(void*, unsigned long, int, int);\n'
                                 'extern "C" void* __sysv_signal(int, void (*)(int));\nstatic void h(int) {}\n'
                                 'int f(void* p) { __sysv_signal(11, h); return pkey_mprotect(p, 4096, 0, -1); }\n',
    "glibc_alias_of_open": 'extern "C" int __open64_2(const char*, int);\nint f() { return __open64_2("/etc/hostname", 0); }\n',
}


# Doors the deny-lists did not name: stdio reaches every descriptor once a FILE's _fileno is set, vmsplice/preadv2/
# pwritev2 read and write one directly, and alarm/setitimer are signals (the child kills itself at a time of its
# choosing, while the parent is between two exchanges). Each built. A FILE's fields are refused as tokens, and the
# module's C imports come from an allow-list, so the next door that no list names is closed too.
DESCRIPTOR_DOORS = {
    "stdio_fileno_write": '#include <cstdio>\nint f(int fd) { stdout->_fileno = fd; return std::fputs("x", stdout) + std::fflush(stdout); }\n',
    "stdio_fileno_read": '#include <cstdio>\nint f(int fd) { char b[8]; stdin->_fileno = fd; return (int)std::fread(b, 1, 8, stdin); }\n',
    "stdio_fclose_any_descriptor": '#include <cstdio>\nint f(int fd) { stdin->_fileno = fd; return std::fclose(stdin); }\n',
    "vmsplice": 'struct io { void* b; unsigned long n; };\nextern "C" long vmsplice(int, const io*, unsigned long, unsigned);\n'
                'long f(int fd) { char c = 1; io v{&c, 1}; return vmsplice(fd, &v, 1, 0); }\n',
    "preadv2_pwritev2": 'struct io { void* b; unsigned long n; };\nextern "C" long pwritev2(int, const io*, int, long, int);\n'
                        'extern "C" long preadv2(int, const io*, int, long, int);\n'
                        'long f(int fd) { char c = 1; io v{&c, 1}; return pwritev2(fd, &v, 1, -1, 0) + preadv2(fd, &v, 1, -1, 0); }\n',
    "alarm": 'extern "C" unsigned alarm(unsigned);\nunsigned f() { return alarm(1); }\n',
    # (declared by the <sys/time.h> that Python.h includes)
    "setitimer": 'int f() { itimerval t{{0, 0}, {0, 1000}}; return setitimer(ITIMER_REAL, &t, nullptr); }\n',
}


@pytest.mark.parametrize("name", sorted({**THREADS, **DESCRIPTOR_DOORS}))
def test_attack_doors_under_other_names_are_refused(name):
    b = env.build({"kernels/x.cpp": MODULE + {**THREADS, **DESCRIPTOR_DOORS}[name]}, "cpu")
    assert not b.ok and b.violations, b.log


def test_attack_import_check_keeps_allocation_and_views():
    ok = ["__signbitf", "sinf", "sqrtf", "at::_ops::empty_like::call(at::Tensor const&)", "at::_ops::view::call(at::Tensor const&)", "memcpy",
          "at::_ops::reshape::call(at::Tensor const&)", "float* at::TensorBase::data_ptr<float>() const", "expf",
          "pthread_mutex_lock", "GOMP_parallel", "at::get_num_threads()", "PyObject_GetAttrString"]
    assert scan.check_imports(ok, env.IMPORT_OPS) == []
    bad = ["at::_ops::mm::call(at::Tensor const&, at::Tensor const&)", "at::cpu::relu(at::Tensor const&)",
           "at::native::add_out(at::Tensor const&, at::Tensor const&, c10::Scalar const&, at::Tensor&)",
           "torch::jit::getAllOperators()", "__sysv_signal@GLIBC_2.2.5", "pkey_mprotect", "sigaction", "execveat",
           "c10::Dispatcher::realSingleton()", "fork@GLIBC_2.2.5", "__libc_system"]
    assert len(scan.check_imports(bad, env.IMPORT_OPS)) == len(bad)


def test_a_function_declared_and_never_defined_is_named_as_such():
    """A kernel file without its launch(): the binding's call of it is an import, refused as any other, with a
    message that says what is missing (an sft model's held-out episode read "not on the list of C functions")."""
    out = scan.check_imports(["launch"], env.IMPORT_OPS, {"launch", "x"})
    assert len(out) == 1 and "no kernel source defines" in out[0], out
    assert "closed doors" in scan.check_imports(["system"], env.IMPORT_OPS, {"system"})[0]  # (a door stays a door)
    assert "not on the list" in scan.check_imports(["launch"], env.IMPORT_OPS)[0]


# ------------------------------------------------------------------ 6. slowing the baselines from outside the candidate
# Baselines were timed only while no candidate CHILD lived; the agent's bash tool (which can compile and run a
# program that spins every core, or the GPU) and a build (whose sources decide how long the compiler keeps the
# cores busy) were not counted. In training, many rollouts of one task run at once, and the first verdict's
# baselines are cached for all the others: a slowed eager/compile time is reward 3 for every later kernel.
def _record_alive(monkeypatch, module):
    """Replaces module.candidate_alive by one that records, and module.run_sandboxed by one that notes whether a
    candidate_alive was held when each sandboxed command started."""
    held, seen = [], []
    real_alive, real_run = module.candidate_alive, module.run_sandboxed

    @__import__("contextlib").contextmanager
    def alive(backend):
        with real_alive(backend):
            held.append(backend)
            try:
                yield
            finally:
                held.pop()

    def run(argv, *a, **k):
        seen.append((Path(argv[0]).name if argv else "", bool(held)))
        return real_run(argv, *a, **k)

    monkeypatch.setattr(module, "candidate_alive", alive)
    monkeypatch.setattr(module, "run_sandboxed", run)
    return seen


def test_attack_bash_tool_counts_as_a_candidate(tmp_path, monkeypatch):
    import agent
    seen = _record_alive(monkeypatch, env)
    ws = env.new_workspace(tmp_path / "ws", RELU, "cpu")
    obs, _, ok = agent.run_tool("bash", {"command": "echo spinning"}, ws, RELU, "cpu", agent.AgentConfig())
    assert ok and "spinning" in obs
    assert seen == [("bash", True)], seen


def test_attack_build_counts_as_a_candidate(monkeypatch):
    seen = _record_alive(monkeypatch, builder)
    b = env.build({"kernels/x.cpp": f"int x = {time.time_ns() % 10**9};\n" + MODULE}, "cpu")
    assert b.ok, b.log
    assert seen and all(h for _, h in seen), seen


# ------------------------------------------------------------------ the trusted parent's memory
def test_attack_huge_model_new_is_not_parsed(tmp_path):
    """The bash tool can leave a model_new.py of up to 1 GiB (its file size limit); the trainer read and parsed it
    whole (an AST of a gigabyte of statements does not fit in memory). It is capped at 256 KiB (its scan holds the
    trainer's GIL)."""
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    (ws / "model_new.py").write_text(model_new("relu", "cuda_extension.relu_scale(x, self.scale)") + "y = 1\n" * 400_000)
    v = env.evaluate(ws, backend="cpu", stage="compile")
    assert v.reward == -1 and "larger than 256 KiB" in (v.error or ""), v.summary()


# ------------------------------------------------------------------ 1. escape: what root may still write without capabilities
# Every capability is dropped, but a child that keeps uid 0 (where the interpreter is not reachable by an unprivileged
# uid) still OWNS the host's root-owned files. Mounts are read-only except /dev (left writable for the GPU's nodes)
# and /proc (CUDA needs it): a child created a file in the host's /dev (a devtmpfs here: it outlives every sandbox,
# a channel between verdicts), opened /dev/kvm, /dev/zram0 and /dev/cpu_dma_latency, and wrote host-wide knobs
# under /proc/irq. /dev is now a fresh read-only tmpfs with an allow-list of nodes, and /proc is read-only but for
# the processes' own entries.
DEV_PROBE = r"""
import glob, os, sys
found = []
try:
    open("/dev/" + sys.argv[1], "w").write("x"); found.append("created /dev/" + sys.argv[1])
except OSError:
    pass
for path in ("/dev/kvm", "/dev/cpu_dma_latency", "/dev/zram0", "/dev/loop0", "/dev/vda", "/dev/sda", "/dev/kmsg", "/dev/mem"):
    try:
        os.close(os.open(path, os.O_RDONLY)); found.append("opened " + path)
    except OSError:
        pass
for path in glob.glob("/proc/irq/*/smp_affinity") + glob.glob("/proc/irq/default_smp_affinity"):
    try:
        with open(path, "r+") as f:
            f.write(f.read())  # (the value it holds: nothing changes)
        found.append("wrote " + path)
    except OSError:
        pass
open("/dev/null", "w").write("still usable")
print("FOUND", found)
"""


def test_attack_root_without_capabilities_writes_no_host_device_or_knob(tmp_path):
    if not env.isolation().mount:
        pytest.skip("no mount namespace here")
    name = f"written-from-inside-{os.urandom(4).hex()}"
    (tmp_path / "box").mkdir()
    try:
        r = env.run_sandboxed([sys.executable, "-c", DEV_PROBE, name], tmp_path / "box", timeout=60)
        assert r.returncode == 0, r.stderr
        assert "FOUND []" in r.stdout, r.stdout
        assert not Path("/dev", name).exists()
    finally:
        Path("/dev", name).unlink(missing_ok=True)


def test_a_driver_that_refuses_the_private_dev_keeps_the_mount_namespace(monkeypatch):
    """The private /dev and read-only /proc knobs are probed like every layer: where a child (a CUDA context) does not
    start under them, the probe keeps the same namespaces without them before it gives up the mount namespace (which
    would leave the host's filesystem writable), and says so."""
    real = sandbox.run_sandboxed

    def picky(argv, cwd, timeout, **kw):  # a "driver" that fails under the strict jail only
        if kw["iso"].mount and kw["iso"].strict:
            return sandbox.SandboxResult(1, "", "cudaErrorOperatingSystem", False, 0.0)
        return real(argv, cwd, timeout, **kw)
    monkeypatch.setattr(sandbox, "run_sandboxed", picky)
    iso, _ = sandbox._probe_isolation("cpu")
    if "--mount" not in sandbox.isolation("cpu").prefix:
        pytest.skip("no mount namespace here")
    assert iso.mount and not iso.strict and iso.prefix == sandbox.isolation("cpu").prefix, iso
    assert "a private /dev and read-only /proc knobs" in iso.missing


def test_attack_many_sources_are_not_read(tmp_path):
    """Each source was capped at 1 MiB, but not their number: files the bash tool leaves in kernels/ (thousands of
    1 MiB headers in its 30 s) were all read into the trainer's memory. Their count and total size are capped."""
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"), {})
    for i in range(12):
        (ws / "kernels" / f"h{i}.h").write_text("// padding\n" * 70_000)  # 770 kB each, 9 MB in all
    v = env.evaluate(ws, backend="cpu", stage="compile")
    assert v.reward == -1 and "in all" in (v.error or ""), v.summary()


def test_attack_agent_file_tools_read_no_huge_file(tmp_path):
    """read_file and edit_file read a whole file into the trainer's memory, and the bash tool can leave one of up to
    1 GiB (its file size limit). Both refuse files larger than write_file may write (1 MiB)."""
    import agent
    ws = env.new_workspace(tmp_path / "ws", RELU, "cpu")
    (ws / "big.cpp").write_text("x" * (3 << 20))
    for tool, args in (("read_file", {"path": "big.cpp"}), ("edit_file", {"path": "big.cpp", "old": "x", "new": "y"})):
        obs, _, ok = agent.run_tool(tool, args, ws, RELU, "cpu", agent.AgentConfig())
        assert not ok and "1 MiB" in obs and len(obs) < 1000, (tool, len(obs))


# ------------------------------------------------------------------ 3. the pipe protocol: replies only the harness can give
# The scan closes open/read/write, but stdio reaches any descriptor: `stdin->_fileno = fd` and fread, `stderr->_fileno = fd`
# and fwrite (tests/attack_cases/forge_replies.cpp). A kernel answered the "run" the harness was serving, read the sample
# offset the parent drew next and computed only those elements (1 in 4 of the output: reward +1, correct, its reported
# time a fraction of its work); or answered "full" itself with "ops": [] for an output PyTorch computed in forward (reward
# +1 for a fallback). Two layers refuse it: the scan (a FILE's fields are refused tokens, fread/setvbuf are not on the C
# import allow-list), and the protocol: every command carries a fresh nonce that the harness read and the kernel never
# saw, and a reply that does not echo it is refused (a message the kernel adds puts every later reply out of step).
FORGED = {"sampled_only": "cuda_extension.sampled_only(x, self.scale)",
          "hide_ops": "cuda_extension.hide_ops((x * self.scale).relu())"}


@pytest.mark.parametrize("name", sorted(FORGED))
def test_attack_kernel_speaking_the_pipe_protocol_is_refused(tmp_path, monkeypatch, name):
    src = (CASES / "forge_replies.cpp").read_text()
    ws = make_ws(tmp_path, "relu", model_new("relu", FORGED[name]), {"ops.cpp": src})
    v = env.evaluate(ws, backend="cpu", stage="compile")
    assert not v.compiled and "_fileno" in v.log, v.summary()
    # the protocol's layer alone, where a scan misses a door: the scan's token and import checks off, for a source
    # that only this test builds (its own cache key: the comment)
    monkeypatch.setattr(scan, "check_tokens", lambda path, tokens: [])
    monkeypatch.setattr(scan, "check_imports", lambda symbols, ops, own=(): [])
    (ws / "kernels" / "ops.cpp").write_text("// built with the scan off (tests/test_attacks.py)\n" + src)
    v = env.evaluate(ws, backend="cpu")
    assert v.compiled, v.log
    assert v.reward == -1 and not v.correct and "no command" in (v.error or ""), v.summary()


def test_honest_arithmetic_helpers_are_not_refused():
    """C++ that computes in the module itself may import the compiler's and libm's arithmetic helpers: complex
    functions (std::complex's exp, log, sqrt are libm's cexp, clog, csqrt; its product and quotient libgcc's
    __muldc3 / __divdc3) and 128-bit integer arithmetic and conversions (__divti3, __floatuntidf). They compute and
    return; refusing them gave an honest kernel -1."""
    src = MODULE + (
        "#include <complex>\n#include <cstdint>\n"
        "double honest(double x, double y, unsigned __int128 n, __int128 d) {\n"
        "  std::complex<double> z(x, y), w(y, x);\n"
        "  z = std::exp(z) * w / std::log(w) + std::sqrt(z);\n"
        "  __int128 q = d / (__int128)(y + 3), r = d % (__int128)(y + 3);  // (both: __divmodti4 at -O3)\n"
        "  return z.real() + (double)n + (double)q + (double)r + __builtin_popcountll((unsigned long long)n);\n}\n")
    b = env.build({"kernels/x.cpp": src}, "cpu")
    assert b.ok, b.log
    helpers = ["cexp", "cexpf", "clog", "csqrt", "cpow", "cabs", "carg", "__muldc3", "__mulsc3", "__divdc3", "__divsc3",
               "__divti3", "__udivti3", "__modti3", "__umodti3", "__floatuntidf", "__floattidf", "__fixdfti",
               "__fixunsdfti", "__divmodti4", "__udivmodti4", "__extendhfsf2", "__truncsfhf2", "__truncdfhf2",
               "__popcountdi2", "__clzdi2"]
    assert scan.check_imports(helpers, scan.IMPORT_OPS) == []
    assert len(scan.check_imports(["cexecve", "__divti3_door", "csystem", "__enable_execute_stack", "__clear_cache"],
                                  scan.IMPORT_OPS)) == 5  # (whole names, not prefixes; libgcc's other helpers stay out)


def test_attack_c_imports_come_from_an_allow_list():
    honest = ["memcpy", "strlen", "malloc", "free", "expf", "tanhf", "__expf_finite", "fprintf", "fflush", "stderr",
              "stdout", "snprintf", "__snprintf_chk", "__cxa_atexit", "_Unwind_Resume", "pthread_mutex_lock",
              "GOMP_parallel", "omp_get_thread_num", "cudaLaunchKernel", "__cudaRegisterFatBinary", "PyErr_Occurred",
              "_Py_Dealloc", "__tls_get_addr", "__assert_fail"]
    assert scan.check_imports(honest, scan.IMPORT_OPS) == []
    for name in ["setvbuf", "stdin", "fread", "alarm", "timerfd_create", "inotify_init1", "io_uring_setup", "socketpair",
                 "eventfd", "process_mrelease", "some_future_door",
                 # Python that runs code (pybind11's py::exec/eval and module_::import are inline wrappers of these)
                 "PyRun_SimpleString", "PyRun_StringFlags", "Py_CompileString", "PyEval_EvalCode", "PyImport_ImportModule",
                 "PyImport_Import", "PyMarshal_ReadObjectFromString", "PyOS_system"]:
        assert scan.check_imports([name], scan.IMPORT_OPS), name


# C++ imports come from an allow-list too (scan.CXX_IMPORTS_RE). Only C functions had one: a C++ symbol was judged
# against PyTorch's operators, the dispatcher and its thread pools, so at::DynamicLibrary (libtorch's dlopen/dlsym: any
# C function by name, system() ran a shell; a PyTorch operator's mangled name called from an OpenMP worker scored +1
# with no kernel) and std::basic_ifstream (a file read; the banned tokens were ifstream, fstream, filebuf) linked.
def test_attack_cxx_imports_come_from_an_allow_list():
    honest = (Path(__file__).parent / "env_cases" / "cxx_imports.txt").read_text().splitlines()  # the repository's kernels'
    assert len(honest) > 100 and scan.check_imports(honest, scan.IMPORT_OPS) == []
    refused = ["at::DynamicLibrary::sym(char const*)", "at::DynamicLibrary::DynamicLibrary(char const*, char const*, bool)",
               "vtable for std::basic_ifstream<char, std::char_traits<char> >",
               "std::basic_filebuf<char, std::char_traits<char> >::open(char const*, std::_Ios_Openmode)",
               "std::__basic_file<char>::~__basic_file()", "std::thread::_State::~_State()", "std::random_device::_M_getval()",
               "at::Tensor::index(c10::ArrayRef<at::indexing::TensorIndex>) const",  # computes out of line
               "at::Tensor::_backward(c10::ArrayRef<at::Tensor>, std::optional<at::Tensor> const&, std::optional<bool>, bool) const",
               "at::TensorBase::_register_hook(std::function<at::TensorBase (at::TensorBase const&)>) const",
               "caffe2::serialize::FileAdapter::FileAdapter(std::__cxx11::basic_string<char> const&)",
               "std::filesystem::__cxx11::directory_iterator::operator*() const", "torch::jit::load(std::string const&)",
               "c10::cuda::CUDACachingAllocator::shareIpcHandle(void*)", "c10::cuda::CUDACachingAllocator::get()",
               "pybind11::detail::type_caster<torch::jit::IValue, void>::load(pybind11::handle, bool)",
               "some::future::door()", "(anonymous namespace)::f()",
               # a TensorImpl subclass (its virtuals run the candidate's code later, outside the timed run)
               "vtable for c10::TensorImpl", "c10::TensorImpl::TensorImpl(c10::Storage&&, c10::DispatchKeySet, caffe2::TypeMeta)",
               # demangled forms whose stripped name would read as an allowed one
               "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > (*evil::get())()",
               "c10::TensorImpl::f()::{lambda(int)#1}::operator()(int) const", "X<(4)>(2)>::door()",
               # CUDA: host code the driver runs later on a thread of its own, loggers that open files, driver
               # function tables, memory shared with other processes
               "cudaLaunchHostFunc", "cuLaunchHostFunc", "cudaStreamAddCallback", "cudaGraphAddHostNode",
               "cublasLtLoggerOpenFile", "cusparseLoggerOpenFile", "cublasSetLoggerCallback", "cufftXtSetCallback",
               "cudaGetExportTable", "cuGetExportTable", "cuMemPoolExportToShareableHandle", "cudaMemPoolImportPointer",
               "cuMemGetHandleForAddressRange", "cuCoredumpSetAttributeGlobal", "cudaUserObjectCreate", "cudaGraphAddNode",
               "cudaLogsRegisterCallback", "cudaLogsDumpToFile", "cudaGraphDebugDotPrint", "cuCheckpointProcessLock",
               # a class of the module deriving from a library class (its virtuals run when the harness asks)
               "typeinfo for torch::autograd::AutogradMeta", "typeinfo for c10::AutogradMetaInterface"]
    assert scan.check_imports(["cudaLaunchKernel", "cudaGetLastError", "cudaMemcpyAsync", "cudaFuncSetAttribute",
                               "__cudaRegisterFunction", "cublasSgemm_v2"], scan.IMPORT_OPS) == []
    for name in refused:
        assert scan.check_imports([name], scan.IMPORT_OPS), name
    assert scan.cxx_name("float* at::TensorBase::data_ptr<float>() const") == "at::TensorBase::data_ptr"
    assert scan.cxx_name("std::ostream::operator<<(int)") == "std::ostream::operator_x"
    assert scan.cxx_name("operator delete(void*, unsigned long)") == "operator_delete"


def test_attack_includes_name_their_header_as_written():
    """A file the preprocessor opens is quoted back in its errors, so what it may open is judged before it runs."""
    for src in ['#include "/etc/passwd"', "#include <../../etc/passwd>", '#include "kernels/../../x.h"',
                '#define H "x.h"\n#include H', '#include "a\\\\b.h"', '%:include "/etc/passwd"',
                '// ??/\n#include "/etc/passwd"',  # a splice only where trigraphs are on: either reading hides a line
                '#if __has_include("/etc/passwd")\n#endif', '#if __has_include /**/ ("/etc/passwd")\n#endif',
                '#define H __has_include\n#if H(</etc/passwd>)\n#endif']:
        assert scan.check_directives("kernels/x.cpp", src + "\n"), src
    for src in ['#include <torch/extension.h>', '#include "lib.h"  // ours', '#  include /* c */ <cstdint>',
                '#if __has_include(<cuda_runtime.h>)\n#endif']:
        assert scan.check_directives("kernels/x.cpp", src + "\n") == [], src


@pytest.mark.parametrize("case", ["dynamic_library.cpp", "file_stream.cpp"])
def test_attack_cxx_doors_do_not_link(case):
    b = env.build({"kernels/x.cpp": (CASES / case).read_text()}, "cpu")
    assert not b.ok and any("not on the list of C++ functions" in v for v in b.violations), b.log


# ------------------------------------------------------------------ the parent: a verdict and one line, never a hang or a traceback
def _evaluate_within(seconds, *args, **kwargs):
    """env.evaluate in a thread: (verdict or the exception it raised), or pytest.fail if it has not returned in time."""
    import threading
    box = []

    def go():
        try:
            box.append(env.evaluate(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001  (what the test reports)
            box.append(e)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"env.evaluate did not return within {seconds} s (the parent hangs)")
    return box[0]


def test_attack_a_child_that_cannot_start_is_a_verdict(tmp_path, monkeypatch):
    """run_sandboxed raised (fork refused: the uid's processes or the host's memory exhausted, which the bash tool of
    another rollout can do) before the child's process group was known: Child waited for it forever, and the trainer
    hung. A child that cannot start is now a child that died, with the reason."""
    def refuse(*a, **k):
        raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(protocol, "run_sandboxed", refuse)
    v = _evaluate_within(60, make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)")),
                         backend="cpu", stage="verify")
    assert isinstance(v, env.Verdict), repr(v)
    assert v.reward == -1 and "could not start" in (v.error or "") and "\n" not in v.error, v.summary()


def test_attack_a_command_to_a_dead_child_is_an_eof(tmp_path):
    """A child that died after its last reply (a signal it set itself with alarm(), its wall clock) made the parent's next
    command a BrokenPipeError, which no caller expected: a traceback out of env.evaluate. It reads as the child's end."""
    (tmp_path / "run").mkdir()
    spec = {"mode": "reference", "backend": "cpu", "seed0": 0, "reference": str(tmp_path / "missing.py"),
            "seeds": [1], "n_checks": 1, "budget_mb": 1}
    c = protocol.Child(spec, tmp_path / "run", "cpu", env.Config(timeout=60))
    c.thread.join(60)
    with pytest.raises(EOFError):
        c.ask({"op": "use", "fn": "eager"})
    assert "exited with code" in c.why_dead()
    c.close()


def test_attack_a_reference_that_dies_while_timed_is_a_verdict(tmp_path):
    """The baselines' timed runs were outside every handler: a reference child that died there (killed for memory while
    a rollout's bash tool filled the host) was an EOFError out of env.evaluate."""
    dies = RELU + (f"\nimport os\nCALLS = [0]  # {os.urandom(8).hex()}\n_forward = Model.forward\n\n\n"
                   "def forward(self, x):\n    CALLS[0] += 1\n    if CALLS[0] > 5 + 22:  # every output computed: now timed\n"
                   "        os._exit(3)\n    return _forward(self, x)\n\n\nModel.forward = forward\n")
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    (ws / "model.py").write_text(dies)
    v = _evaluate_within(300, ws, backend="cpu", reference=dies)
    assert isinstance(v, env.Verdict), repr(v)
    assert v.reward == -1 and "reference" in (v.error or ""), v.summary()


# ------------------------------------------------------------------ 1. the probe: a failure of the moment drops no layer
# isolation(kind) probes once per process and keeps the strongest set of layers under which a child started, for good.
# A child can fail to start for reasons of the moment that processes the policy controls can cause: the bash tool of
# another rollout (or of another rank's trainer) that fills the host's memory or the GPU's, or holds every process the
# uid may have. The strict jail then fell back to the non-strict one (the host's /dev writable by root, /proc's knobs),
# and a probe under which nothing started at all kept NO namespace: every later child of the process, candidates
# included, ran on the host's filesystem, where the cache (baselines) is writable.
def _flaky_probe(monkeypatch, fail_first):
    """sandbox.run_sandboxed whose first `fail_first` calls fail as a refused fork does; the rest run."""
    real, calls = sandbox.run_sandboxed, []

    def flaky(argv, cwd, timeout, **kw):
        calls.append(kw.get("iso"))
        if len(calls) <= fail_first:
            return sandbox.SandboxResult(1, "", "unshare: fork failed: Resource temporarily unavailable", False, 0.0)
        return real(argv, cwd, timeout, **kw)
    monkeypatch.setattr(sandbox, "run_sandboxed", flaky)
    monkeypatch.setattr(sandbox, "_ISOLATION", {})
    return calls


def test_attack_a_probe_that_fails_once_keeps_every_layer(monkeypatch):
    best = sandbox.isolation("cpu")  # (probed in this process before the patch: the layers this host has)
    _flaky_probe(monkeypatch, 2)  # the strongest set's tries, both uids
    iso = sandbox.isolation("cpu")
    assert (iso.prefix, iso.strict, iso.uid) == (best.prefix, best.strict, best.uid), (iso, best)


def test_attack_a_probe_under_which_nothing_starts_keeps_no_weaker_layers(monkeypatch):
    calls = _flaky_probe(monkeypatch, 10**6)
    iso = sandbox.isolation("cpu")
    if not calls[0].prefix:
        pytest.skip("no namespaces to probe here")
    assert iso.prefix == calls[0].prefix and iso.strict, iso  # the strongest set: the child fails, and says why
    assert "cpu" not in sandbox._ISOLATION  # and the next child probes again


# ------------------------------------------------------------------ 6. a view is not a free output
# The timed sample reads out[o::step] of the output flattened row-major, which copies a view (transposed, expanded)
# whole inside the timed run: eager's view pays for it. Gathering only the sampled elements (tried: take) made a view
# free for the candidate too, and `return x.t()` for a task whose reference is x.t().contiguous() got reward 3 (2048x2048:
# 2.9 ms against eager's 10 ms) with no kernel at all. A view pays for its elements in row-major order, as the
# reference's does.
def test_attack_a_view_of_the_input_is_not_a_free_output():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    x = torch.randn(512, 1024)
    largest = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            r = func(*args, **(kwargs or {}))
            if isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
                largest.append(r.numel())  # (a new tensor, not a view of x)
            return r
    with Spy():
        sample = protocol.sample_of(x.t(), 12345)
    assert torch.equal(sample, x.t().contiguous().reshape(-1)[12345 % 8::8])
    assert max(largest) == x.numel(), "the sample of a view did not pay for the view's elements"


# ------------------------------------------------------------------ the comparison itself
def test_attack_a_tensor_where_the_reference_has_a_number_is_a_mismatch_not_a_crash():
    """A reference that returns a number beside its tensors (KernelBench's format allows it; evaluate.py's tasks are not
    filtered like synth.py's) was compared by `out == ref`: a tensor there raised "Boolean value of Tensor with more
    than one value is ambiguous" in the parent (a traceback out of env.evaluate), and a one-element tensor, or True
    for 1, passed. A Python value must come back as the same type and value."""
    import torch
    ref = (torch.ones(3), 3)
    assert env.compare((torch.ones(3), torch.ones(4)), ref, 1e-2, 1e-2, "out") is not None
    assert env.compare((torch.ones(3), torch.tensor(3.0)), ref, 1e-2, 1e-2, "out") is not None
    assert env.compare((torch.ones(3), True), (torch.ones(3), 1), 1e-2, 1e-2, "out") is not None
    assert env.compare((torch.ones(3), 3), ref, 1e-2, 1e-2, "out") is None
    assert env.compare(None, None, 1e-2, 1e-2, "out") is None and env.compare(float("nan"), float("nan"), 0, 0, "o") is None


# Baselines are timed while no candidate lives on the device, but the reference children of other verdicts computed
# their outputs meanwhile (27 forward passes of the task, seconds of the device's time): in training, many rollouts of
# one task reach `profile` together, and the first verdict's eager and compile times, slowed uniformly by the others'
# reference work, were cached for every later verdict. A reference child loads the device like a candidate until its
# outputs are in, and counts as one.
def test_attack_reference_outputs_are_not_computed_while_a_baseline_is_timed(tmp_path, monkeypatch):
    import fcntl
    seen = []
    real_init = env.Child.__init__

    def init(self, spec, *a, **k):
        real_init(self, spec, *a, **k)
        if spec["mode"] == "reference":
            fd = os.open(sandbox._alive_path("cpu"), os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what no_candidates (a baseline) would take
                seen.append("a baseline could be timed")
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                seen.append("held")
            finally:
                os.close(fd)
    monkeypatch.setattr(env.Child, "__init__", init)
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    (ws / "model.py").write_text(RELU + f"\n# baseline nonce {os.urandom(8).hex()}\n")  # baselines measured in this verdict
    v = env.evaluate(ws, backend="cpu")
    assert v.correct and v.eager_ms, v.summary()
    assert seen and set(seen) == {"held"}, seen  # (a task's first profile starts two: outputs, then baselines)


# A kernel that takes the protocol over before the harness ever replies (at import: a forged "ready", then every command
# itself, never returning) needs no nonce it has not read. What it needed besides was each input set, which it could
# rebuild from the seed in the "load" command (the task's get_inputs under torch.manual_seed(seed): torch's CPU generator
# is public code). A command's seed is XORed with a pad that only the harness, which read its key from its spec file
# (no kernel can open a file), can compute from the command's nonce. (Where the parent writes the timed inputs itself,
# a candidate is told no timed seed at all: only the check runs' loads.)
def test_attack_no_command_carries_a_seed(tmp_path, monkeypatch):
    sent, specs = [], []
    real_send, real_init = protocol.send, protocol.Child.__init__

    def spy_send(fd, obj, *a, **k):
        sent.append(obj)
        return real_send(fd, obj, *a, **k)

    def spy_init(self, spec, *a, **k):
        specs.append(spec)
        real_init(self, spec, *a, **k)
    monkeypatch.setattr(protocol, "send", spy_send)
    monkeypatch.setattr(protocol.Child, "__init__", spy_init)
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)")), backend="cpu")
    assert v.correct and v.runtime_ms, v.summary()
    seeds = set(next(s for s in specs if s["mode"] == "reference")["seeds"])
    told = [c["seed"] for c in sent if isinstance(c, dict) and "seed" in c]  # ("load"s; the reference's "set"s)
    assert len(told) > 20 and not seeds & set(told), "a command names an input set's seed"


def test_attack_a_reply_cannot_use_one_blob_twice():
    """The harness packs each tensor into a blob of its own; unpack let any number of a reply's tensors name the same
    blob, each materialised anew: a 1 MiB header of 40k entries naming one 16 MiB blob asked the parent for 640 GiB
    (the reply limit bounds the bytes sent, not the bytes unpacked). A blob is used once."""
    entry = {"t": 0, "dtype": "float32", "shape": [4]}
    with pytest.raises(ValueError):
        protocol.unpack({"seq": [entry, entry]}, [b"\0" * 16])
    assert len(protocol.unpack({"seq": [entry, dict(entry, t=1)]}, [b"\0" * 16, b"\0" * 16])) == 2


def test_attack_no_verdict_waits_for_the_gate_while_it_holds_the_device(tmp_path, monkeypatch):
    """Holders of the device (candidate_alive) never wait for the gate: a baseline waiting for the device holds the
    gate. A verdict whose reference held the device while its candidate started (cached baselines) waited for the gate
    with the device held, while another verdict's baseline held the gate waiting for the device: both hung for good."""
    import fcntl
    import threading
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    assert env.evaluate(ws, backend="cpu").eager_ms  # the baselines are cached: the candidate starts beside the reference
    baseline = threading.Event()

    def other_verdicts_baseline():
        with env.no_candidates("cpu"):  # (takes the gate, then waits for the device)
            baseline.set()
    real_init = env.Child.__init__

    def init(self, spec, *a, **k):
        if spec["mode"] == "reference":  # the device is held for the reference: another verdict's baseline comes now
            threading.Thread(target=other_verdicts_baseline, daemon=True).start()
            gate = os.open(env.CACHE_DIR / "locks" / "gate-cpu.lock", os.O_RDWR | os.O_CREAT)
            try:
                for _ in range(500):  # until it holds the gate
                    try:
                        fcntl.flock(gate, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        fcntl.flock(gate, fcntl.LOCK_UN)
                        time.sleep(0.01)
                    except BlockingIOError:
                        break
            finally:
                os.close(gate)
        real_init(self, spec, *a, **k)
    monkeypatch.setattr(env.Child, "__init__", init)
    v = _evaluate_within(120, ws, backend="cpu")
    assert isinstance(v, env.Verdict) and v.correct, v
    assert baseline.wait(60)


# ------------------------------------------------------------------ Python from C++ through pybind11's free functions
# pybind11's `eval_file` is found by argument-dependent lookup with no `pybind11::` written: an argument of a pybind11
# type (`decltype(m())`, the type a call of the module object returns, is pybind11::object) makes the unqualified
# name resolve there. The module built (PCH path) and `run("/tmp/payload.py")` ran the file's Python in the candidate's
# process; its imports (PyRun_FileExFlags, _Py_fopen_obj) matched `_?Py\w+`. The name is refused, and the module's
# Python C API imports come from an allow-list (objects, conversions, errors, the GIL: no running code, no import,
# no files).
PYTHON_BY_ADL = {
    # (pybind11's getattr by another member name; the accessor case below is the end-to-end one)
    "attr_with_type_hint": '// nonce a4-hint3\nusing H = decltype(std::declval<pybind11::module_&>().get_type());\n'
                           'int run(H o, H k) { o.attr_with_type_hint<int>(k.cast<std::string>().c_str())(); return 1; }\n',
    "eval_file": '#include <pybind11/eval.h>\n// nonce a4-evalfile\n'
                 'using O = decltype(std::declval<pybind11::module_&>()());\nvoid run(O path) { eval_file(path); }\n',
}


@pytest.mark.parametrize("name", sorted(PYTHON_BY_ADL))
def test_attack_python_by_argument_dependent_lookup_is_refused(name):
    b = env.build({"kernels/x.cpp": MODULE + PYTHON_BY_ADL[name]}, "cpu")
    assert not b.ok and b.violations and b.rebuilt == [], b.log


def test_attack_python_c_api_imports_come_from_an_allow_list():
    honest = ["PyErr_Occurred", "_Py_Dealloc", "PyObject_GetAttrString", "PyEval_GetBuiltins", "PyEval_SaveThread",
              "PyObject_Vectorcall", "PyTuple_Size", "_Py_TrueStruct", "PyModuleDef_Init", "PyCapsule_New",
              "PyThread_tss_get", "PyGILState_Ensure", "_PyType_Lookup", "_PyThreadState_UncheckedGet", "Py_GetVersion",
              "PyFrame_GetCode", "PyExc_RuntimeError", "PyUnicode_AsUTF8AndSize", "PyLong_FromSsize_t", "PyFloat_AsDouble",
              "cuModuleLoadData", "cuLaunchKernel", "cudaLaunchKernel", "cudaMemcpyAsync", "cuGetErrorString"]
    assert scan.check_imports(honest, scan.IMPORT_OPS) == []
    for name in ["PyRun_FileExFlags", "PyRun_SimpleString", "_Py_fopen_obj", "Py_fopen", "PyImport_ImportModule",
                 "PyImport_AddModule", "PyEval_GetGlobals", "PyEval_EvalCode", "Py_CompileString", "Py_CompileStringObject",
                 "PySys_GetObject", "PyFile_FromFd", "PyOS_setsig", "PyMarshal_ReadObjectFromString", "Py_Exit",
                 "PyCodec_Decode", "Py_SomeFutureRunner", "cuModuleLoad", "cuLibraryLoadFromFile", "cudaLibraryLoadFromFile",
                 "cuLinkAddFile_v2", "cuGetProcAddress_v2", "cudaGetDriverEntryPoint", "cudaIpcOpenMemHandle",
                 "cuImportExternalMemory", "cuMemImportFromShareableHandle"]:
        assert scan.check_imports([name], scan.IMPORT_OPS), name


def test_attack_python_through_pybind11_accessors_is_refused(tmp_path):
    """The same exec as above, with pybind11's own getattr: `decltype(m.doc())` is its attribute accessor, whose
    constructor takes any object and name. forward() is plain PyTorch once the monitor is unhooked."""
    init = f"cuda_extension.run_python(self, 'forward', '__func__', '__builtins__', 'exec', ('{UNLOCK}',))"
    src = model_new("relu", "(x * self.scale).relu()", init_extra=init)
    v = env.evaluate(make_ws(tmp_path, "relu", src, {"ops.cpp": (CASES / "python_by_accessor.cpp").read_text()}), backend="cpu")
    assert v.reward <= 0 and not v.compiled, v.summary()


def test_attack_macro_order_reads_returns_into_system_headers_and_keeps_guards():
    """A workspace file that a system header includes (found by `__has_include` or on the -I path) may define a
    macro that the rest of that header expands: returning into it counts as entering it. Guards and flags may come
    before any include, and any macro after the last one."""
    user = lambda p: p.startswith("/w/")
    returned = ('# 1 "/w/x.cpp"\n# 1 "/usr/include/a.h" 1 3\n# 1 "/w/kernels/version" 1\n'
                '#define __builtin_expect(a, b) x\n# 5 "/usr/include/a.h" 2 3\nint a;\n')
    assert scan.check_macro_order("x.cpp", returned, user)
    honest = ('# 1 "/w/x.cpp"\n#define MY_H\n#define N 4\n# 1 "/usr/include/c++/12/string" 1 3\nint a;\n# 4 "/w/x.cpp" 2\n'
              '#define F(x) x\n# 1 "/w/kernels/h.h" 1\n#define G(x) x\n# 9 "/w/x.cpp" 2\nint b;\n')
    assert scan.check_macro_order("x.cpp", honest, user) == []


# ------------------------------------------------------------------ the fork server: what a forked child inherits
# A verdict child is forked from a fork server (sandbox.py) that imported torch once. An exec'ed interpreter draws its
# own random states; a forked one copies the server's: numpy's and torch's global generators were the same in every
# child (the same "random" tensor in every candidate and in every reference child, across verdicts: a task whose
# model.py, get_init_inputs or get_inputs draws outside the harness's seeding had the same values in every verdict).
# And the credentials' change of the jail (an unprivileged uid) cleared the parent-death signal, so a child under
# that uid outlived the process that waits for it.
from test_env import sandboxed_python  # noqa: E402

DRAWS = ("import json, random, numpy, torch\n"
         "print(json.dumps([float(numpy.random.rand()), float(torch.rand(1)), random.random()]))\n")


@pytest.mark.parametrize("way", ["exec", "fork"])
def test_attack_forked_children_draw_random_states_of_their_own(tmp_path, way):
    (tmp_path / "box").mkdir()
    draws = []
    for _ in range(2):
        r = sandboxed_python(way, DRAWS, tmp_path / "box", 120)
        assert r.returncode == 0, r.stderr
        draws.append(__import__("json").loads(r.stdout.splitlines()[-1]))
    for name, a, b in zip(("numpy", "torch", "random"), *draws):
        assert a != b, f"two {way}ed children drew the same {name} value {a}: a random state copied from the server"


PDEATHSIG = ("import ctypes, os\nv = ctypes.c_int(-1)\nctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0)\n"
             "print('pdeathsig', v.value, 'uid', os.getuid())\n")


def test_attack_a_forked_child_under_an_unprivileged_uid_dies_with_its_parent(tmp_path):
    """`--kill-child` (the parent-death signal) is set before the jail; a change of uid clears it (the kernel does, on
    any change of effective uid). Re-armed after the jail. Run where the fork server can take the unprivileged uid
    (it needs no exec of the interpreter as that uid)."""
    import dataclasses
    iso = sandbox.isolation("cpu")
    if os.geteuid() != 0 or "--kill-child" not in iso.prefix:
        pytest.skip("needs root (to take another uid) and a PID namespace")
    (tmp_path / "box").mkdir()
    r = sandboxed_python("fork", PDEATHSIG, tmp_path / "box", 60, iso=dataclasses.replace(iso, uid=sandbox.NOBODY))
    assert r.returncode == 0, r.stderr
    assert f"pdeathsig 9 uid {sandbox.NOBODY}" in r.stdout, r.stdout


ADDRESSES = "import ctypes\nprint(id(object()), hash('cuda-agent'), ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value)\n"


@pytest.mark.xfail(strict=True, reason="a fork cannot re-randomise its address space or Python's hash secret: every child "
                   "of one fork server has the same layout (env.py's docstring: in-process pointer arithmetic is open)")
def test_attack_forked_children_do_not_share_their_address_layout(tmp_path):
    (tmp_path / "box").mkdir()
    outs = [sandboxed_python("fork", ADDRESSES, tmp_path / "box", 60).stdout.split() for _ in range(2)]
    assert all(len(o) == 3 for o in outs), outs
    assert all(a != b for a, b in zip(*outs)), outs


# ------------------------------------------------------------------ the monitor's own state
# The dispatch monitor sees an operator through the Python dispatch keys of forward's thread. A kernel that leaves
# them excluded when it returns (an ExcludeDispatchKeyGuard it never destroys, named through decltype: the class is
# on the C++ import allow-list) would hide forward's own PyTorch operators from it (tests/attack_cases/dispatch_keys.cpp;
# reward +1 without the check): between two kernel calls, for good, or from the module's loading on. The harness
# records the change, which fails the verdict (the error it raises cannot be caught: model_new.py may not `try`).
HIDDEN_BY_KEYS = {"between_calls": ("cuda_extension.show((cuda_extension.hide(x) * self.scale).relu())", ""),
                  "for_good": ("(cuda_extension.hide_for_good(x) * self.scale).relu()", ""),
                  "at_load": ("(x * self.scale).relu()", "static Guard* at_load = new Guard(python_keys());\n")}


# The Python dispatch keys' numbers in the installed torch, prepended to the cases that name them
KEYS = f"constexpr int kPython = {int(torch._C.DispatchKey.Python)}, kSnapshot = {int(torch._C.DispatchKey.PythonTLSSnapshot)};\n"


def keys_kept(text: str) -> bool:
    """Whether a verdict's error says the dispatch keys were defended: the harness's guard refused to exclude them
    (build.GUARD_SOURCE; from a storage deleter, where no exception may leave, that ends the process), or the
    state checks found them changed."""
    return "dispatch state" in text or "exclude autograd's dispatch keys only" in text


@pytest.mark.parametrize("name", sorted(HIDDEN_BY_KEYS))
def test_attack_kernel_changing_the_dispatch_state_is_refused(tmp_path, name):
    body, extra = HIDDEN_BY_KEYS[name]
    src = KEYS + (CASES / "dispatch_keys.cpp").read_text() + extra
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", body), {"ops.cpp": src}), backend="cpu")
    assert v.reward == -1 and not v.correct and keys_kept(f"{v.error} {v.violations}"), v.summary()


# Within one call (tests/attack_cases/within_one_call.cpp): PyTorch computes while a scoped guard excludes the
# Python keys, restored before the call returns (reward without the fix: +3 add, +1 relu, +3 trunc, +1 poked; against
# a guard that checked only its keys, +1 each: a rewritten saved set, an address left in a dead guard's bytes)
TRUNC = ("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
         "        return torch.trunc(x)\n\n\ndef get_inputs():\n    return [torch.randn(1 << 16) * 100]\n\n\n"
         "def get_init_inputs():\n    return []\n")
WITHIN_ONE_CALL = {
    "python_operators": ("add", model_new("add", "cuda_extension.unseen_add(a, b)")),
    "python_operators_relu": ("relu", model_new("relu", "cuda_extension.unseen_relu_scale(x, self.scale)")),
    "copy_operator": (TRUNC, "import torch\nimport torch.nn as nn\nimport cuda_extension\n\n\nclass ModelNew(nn.Module):\n"
                             "    def forward(self, x):\n        return cuda_extension.unseen_trunc(x)\n"),
    "poked_key_set": ("relu", model_new("relu", "cuda_extension.poked_relu_scale(x, self.scale)")),
    "rewritten_saved_set": ("relu", model_new("relu", "cuda_extension.saved_state_relu_scale(x, self.scale)")),
    "address_left_by_a_dead_guard": ("relu", model_new("relu", "cuda_extension.leaked_address_relu_scale(x, self.scale)")),
}


@pytest.mark.parametrize("name", sorted(WITHIN_ONE_CALL))
def test_attack_pytorch_computing_inside_a_kernels_guard_is_refused(tmp_path, name):
    """A kernel may exclude only autograd's dispatch keys (what torch::empty's inline code does), and a guard's bytes
    hold neither the thread's key set's address nor a set its destructor writes back (env.py's docstring names what
    is still open: the key set found elsewhere in memory)."""
    problem, source = WITHIN_ONE_CALL[name]
    ws = make_ws(tmp_path, "relu" if problem == TRUNC else problem, source,
                 {"ops.cpp": KEYS + (CASES / "within_one_call.cpp").read_text()})
    if problem == TRUNC:
        (ws / "model.py").write_text(TRUNC)
    v = env.evaluate(ws, backend="cpu")
    assert v.reward == -1 and not v.correct, v.summary()


def test_an_honest_kernel_allocating_on_openmp_workers_passes(tmp_path):
    """torch::empty's inline code makes an autograd guard (the harness's, build.GUARD_SOURCE) on whichever thread
    allocates: on every OpenMP worker at once, each its own key set (tests/env_cases/omp_empty.cpp)."""
    src = (Path(__file__).parent / "env_cases" / "omp_empty.cpp").read_text()
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"),
                             {"ops.cpp": src}), backend="cpu", stage="verify")
    assert v.correct and v.reward >= 1 and not v.violations, v.summary()


# Python from a kernel, and native code outside the extension's calls (tests/attack_cases/; the reward each gets
# without the check that refuses it):
# - python_by_leading_colons.cpp: `::pybind11::...` at the global scope, for a scan that checks a root namespace only
#   at a name's start; pybind11's inline pickling helper hands the kernel builtins.eval, and exec'd Python leaves the
#   monitor (+1);
# - python_callable.cpp: model_new.py hands the kernel a bound method computing with PyTorch, called inside a scoped
#   guard that excludes the Python keys (+1; from an OpenMP worker too, where no mode is);
# - deleter.cpp: a storage's deleter, run when forward drops a tensor, leaks the guard outside every extension call
#   (+2); deleter_between_runs.py: the same when the harness drops a run's output (+1);
# - no kernel at all: str(t) formats a tensor with the dispatch modes off, and Python parses the digits (+1).
FROM_PYTHON = {
    "leading_colons": ("python_by_leading_colons.cpp", "cuda_extension.run(x, self.scale)", "", "pybind11::"),
    "callable": ("python_callable.cpp", "cuda_extension.unseen(self.compute, x)",
                 "def compute(self, x):\n        return (x * self.scale).relu()\n", "takes tensors, numbers"),
    "deleter": ("deleter.cpp", "(x * self.scale).relu() if self.drop() else x",
                "def drop(self):\n        self.tok = None\n        return True\n", "dispatch state"),
}


@pytest.mark.parametrize("name", sorted(FROM_PYTHON))
def test_attack_python_from_a_kernel_or_code_outside_its_calls_is_refused(tmp_path, name):
    case, body, method, expect = FROM_PYTHON[name]
    src = (CASES / case).read_text()
    src = KEYS + src if "kPython" in src else src
    init_extra = "self.tok = cuda_extension.arm(torch.empty(1))" if name == "deleter" else ""
    source = model_new("relu", body, init_extra=init_extra).replace("    def forward", f"    {method}\n    def forward") \
        if method else model_new("relu", body)
    v = env.evaluate(make_ws(tmp_path, "relu", source, {"ops.cpp": src}), backend="cpu")
    text = f"{v.error} {v.violations}"
    assert v.reward == -1 and not v.correct and (keys_kept(text) if expect == "dispatch state" else expect in text), v.summary()


def test_attack_deleter_between_runs_is_refused(tmp_path):
    """The same deleter armed in the first run's output, which the harness drops after the run: the keys are
    excluded before the next forward starts (and stay so to its end), so every later run is compared with the state
    runs start from, not only with its own start."""
    src = KEYS + (CASES / "deleter.cpp").read_text()
    v = env.evaluate(make_ws(tmp_path, "relu", (CASES / "deleter_between_runs.py").read_text(), {"ops.cpp": src}),
                     backend="cpu")
    assert v.reward == -1 and not v.correct and keys_kept(f"{v.error} {v.violations}"), v.summary()


def test_attack_tensor_text_is_refused(tmp_path):
    """A tensor's values turned into text reach Python unseen: in the candidate's process the text holds none."""
    v = env.evaluate(make_ws(tmp_path, "relu", (CASES / "tensor_text.py").read_text()), backend="cpu", stage="verify")
    assert v.reward == -1 and not v.correct and "values hidden" in f"{v.error} {v.violations}", v.summary()


def test_an_argument_error_shows_shapes_not_values(tmp_path):
    """pybind11's "incompatible function arguments" prints each argument's text: a tensor shows its shape, dtype and
    device, so the message still says what was passed, and no value."""
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale, x)")),
                     backend="cpu", stage="verify")
    assert v.reward == -1 and "incompatible function arguments" in v.error, v.summary()
    assert "tensor(<values hidden>, shape=(" in v.error and "dtype=torch.float32" in v.error, v.error


@pytest.mark.parametrize("src,ok", [
    ("static ::pybind11::handle h;", False), ("return ::c10::impl::getGlobalPyInterpreter();", False),
    ("bool b = 1 > ::pybind11::detail::f();", False), ("auto g = (::pybind11::gil_scoped_release());", False),
    ("auto o = __extension__ ::pybind11::detail::f();", False), ("int v = mine::torch::x;", False),
    ("auto t = ::torch::empty_like(y);", True),
])
def test_attack_global_scope_names_are_checked_as_names(src, ok):
    """`::torch::x` names the same thing as `torch::x`, and the scan checks it the same way: a root namespace
    followed by `::` is checked wherever it stands."""
    tokens = scan.split_preprocessed(f'# 1 "/w/x.cpp"\n{src}\n', lambda p: p == "/w/x.cpp")[0]
    assert (scan.check_tokens("x.cpp", tokens) == []) == ok, scan.check_tokens("x.cpp", tokens)


def test_kernel_arguments_are_tensors_numbers_and_fresh_tuples():
    """What native code is handed holds nothing it could call, read attributes of, or write values into for Python
    to read back: a list (or torch.Size) arrives as a fresh tuple; a string, a function, a dtype are refused."""
    x, xs = torch.zeros(2), [1, 2.0]
    out = protocol._plain([xs, (None, torch.Size([3])), x, True])
    assert out[0] == (1, 2.0) and type(out[0]) is tuple and out[1] == (None, (3,)) and out[2] is x and out[3] is True
    for bad in ["0.5", print, torch.float32, [lambda: 0], [[[[[1]]]]]]:
        with pytest.raises(TypeError):
            protocol._plain(bad)
