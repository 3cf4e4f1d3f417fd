"""env.py: the kernel workspace, sandbox and reward of cuda-agent-mini.

    python env.py new  ws/ --problem examples/relu.py --backend cpu   # scaffold a workspace
    python env.py eval ws/ --backend cpu --json                      # compile, verify, profile, reward
    python env.py eval ws/ --backend cuda                            # the real thing, on a GPU

Python API (one scorer everywhere): `evaluate(workspace, backend=...) -> Verdict`.

What one verdict does, in order
  1. collect   only model_new.py and the kernel sources (*.cu *.cpp *.h *.cuh *.hpp in the root and
               in kernels/) are copied into a fresh run directory; anything else is ignored.
  2. scan      a static scan of model_new.py and the C++ gives readable hints, and rejects what can
               only be a cheat (imports of numpy/ctypes/os..., monkey-patching torch, threads or
               processes or Python calls from C++). The run-time checks below are the judge.
  3. build     every source is compiled on its own (nvcc for .cu, g++ for .cpp, -O3, OpenMP on the
               CPU backend) into a content-hash cache and linked into one module `cuda_extension`.
               An unchanged source is never rebuilt; editing one kernel rebuilds only that object.
  4. verify    5 checks, each on inputs drawn with a fresh random seed; outputs compared at
               atol = rtol = 1e-2 in THIS process, against reference outputs computed in ANOTHER
               process that never loads candidate code. Structure, shape and dtype must match
               exactly, outputs must be plain tensors, inputs must not be mutated. While
               ModelNew.forward runs, a dispatch monitor flags every PyTorch operator that computes
               values (from Python or from C++); only allocation, views and metadata are allowed.
  5. profile   candidate, eager and torch.compile are timed by the same function: warm-up, then
               the median of >= 20 runs, device-wide synchronisation, L2 flushed, fresh random
               values copied into the SAME input buffers before every run, and every timed run's
               output re-checked (defeats pointer-keyed caches and "real work only on call 1").
               One timed section per GPU at a time (a file lock). Baseline timings are cached per
               reference source, so RL pays for torch.compile once per task.
  6. reward    the paper's milestones: -1 incorrect; 3 if >5% faster than eager AND compile;
               2 if >5% faster than eager only; 1 otherwise (correct).

What the sandbox protects against
  - crashes (segfault, illegal memory access, aborts), exceptions, syntax errors, missing files:
    every candidate runs in a fresh child process, so a poisoned CUDA context dies with it;
  - hangs and infinite loops: a wall-clock timeout kills the whole process group and, where
    Linux namespaces are available, the whole PID namespace (escaped grandchildren included);
  - fork bombs: a pids cgroup (where writable) caps the number of tasks, RLIMIT_NPROC otherwise;
  - huge allocations and CPU burn: RLIMIT_AS (CPU backend), a memory cgroup where writable,
    RLIMIT_CPU, RLIMIT_FSIZE; megabytes of output are truncated;
  - the network: a fresh network namespace (no interfaces but a down loopback);
  - writes outside the run directory: a mount namespace remounts every filesystem read-only
    except the run directory (and /dev, /proc, /sys);
  - stray files (torch.py, sitecustomize.py, ...): only the allowed files are copied, and the
    child runs with a scrubbed environment (`python -E`);
  - monkey-patching of timers, comparisons or torch itself: timers are bound before candidate
    code loads, and the comparison happens in the parent, which never imports candidate code.
  - killed builds: objects are written to a temporary name and renamed into the cache; locks are
    flock()s, which the kernel drops when the holder dies.

What it does NOT protect against (be honest; RL will look)
  - native code in the candidate process can, in principle, read or write anything in that
    process, including the harness's own timing results. The static scan bans the usual doors
    (threads, processes, dlopen/dlsym, Python calls from C++); a determined attacker with raw
    pointer arithmetic is not stopped.
  - PyTorch operators issued from a thread other than the one running forward() are invisible to
    the dispatch monitor (threads are banned statically, OpenMP regions are not).
  - reduced precision inside a kernel that stays within atol/rtol passes, as in the paper.
  - when no namespaces are available (e.g. some containers), isolation falls back to process
    groups and rlimits; this is said once on stderr.
  - GPU memory is not capped per candidate on the CUDA backend (RLIMIT_AS breaks CUDA).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ENV_PY = Path(__file__).resolve()
CACHE_DIR = Path(os.environ.get("CUDA_AGENT_CACHE", Path.home() / ".cache" / "cuda-agent-mini"))
MARGIN = 0.05  # the paper's 5% speed margin

SOURCE_EXT = {".cu", ".cpp"}
HEADER_EXT = {".h", ".cuh", ".hpp"}


@dataclasses.dataclass
class Config:
    backend: str = "auto"  # auto | cuda | cpu
    timeout: float = 300.0  # wall clock for one candidate run (verify + profile)
    compile_timeout: float = 600.0  # wall clock for one build (nvcc with torch headers is slow)
    atol: float = 1e-2
    rtol: float = 1e-2
    n_checks: int = 5
    n_timed: int = 20  # at least this many timed runs; more when runs are short
    min_timed_s: float = 0.25  # ...until this much time was spent timing (cap 200 runs)
    warmup: int = 3
    mem_gb: float = 16.0  # host memory limit of a candidate child
    stage: str = "profile"  # compile | verify | profile
    input_budget_mb: float = 1024.0  # distinct fresh input sets kept for timing


@dataclasses.dataclass
class Verdict:
    compiled: bool = False
    correct: bool = False
    reward: int = -1
    runtime_ms: float | None = None
    eager_ms: float | None = None
    compile_ms: float | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    violations: list = dataclasses.field(default_factory=list)
    error: str | None = None
    backend: str = ""
    stage: str = ""  # the last stage reached: scan | compile | verify | profile
    hints: list = dataclasses.field(default_factory=list)  # static-scan notes, not judged
    warnings: list = dataclasses.field(default_factory=list)
    log: str = ""  # a short, readable excerpt (first compiler errors, child stderr tail)
    seconds: float = 0.0

    def to_dict(self):
        return dataclasses.asdict(self)

    def summary(self) -> str:
        fmt = lambda x, u="": "-" if x is None else f"{x:.4g}{u}"
        lines = [
            f"reward {self.reward:+d} | compiled {self.compiled} | correct {self.correct} | backend {self.backend}"
            f" | stage {self.stage} | {self.seconds:.1f}s",
            f"runtime {fmt(self.runtime_ms, ' ms')} | eager {fmt(self.eager_ms, ' ms')} | compile {fmt(self.compile_ms, ' ms')}"
            f" | speedup vs eager {fmt(self.speedup_eager, 'x')} | vs compile {fmt(self.speedup_compile, 'x')}",
        ]
        lines += [f"VIOLATION: {v}" for v in self.violations]
        lines += [f"error: {self.error}"] if self.error else []
        lines += [f"hint: {h}" for h in self.hints] + [f"warning: {w}" for w in self.warnings]
        if self.log and not self.correct:
            lines.append(self.log)
        return "\n".join(lines)


class UsageError(Exception):
    """Bad input from the user: printed as one line, non-zero exit."""


def resolve_backend(backend: str) -> str:
    if backend not in ("auto", "cuda", "cpu"):
        raise UsageError(f"unknown backend {backend!r} (choose auto, cuda or cpu)")
    if backend != "auto":
        return backend
    if shutil.which("nvidia-smi") is None and not Path("/dev/nvidia0").exists():
        return "cpu"  # cheap test first: importing torch.cuda costs a second
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def reward_for(correct: bool, runtime_ms, eager_ms, compile_ms) -> int:
    """The paper's milestone reward. b(t, t0) = 1 if (t0 - t) / t0 > 5%."""
    if not correct:
        return -1
    if runtime_ms is None or eager_ms is None or compile_ms is None:
        return 1
    beats = lambda t0: (t0 - runtime_ms) / t0 > MARGIN
    if beats(eager_ms) and beats(compile_ms):
        return 3
    return 2 if beats(eager_ms) else 1


# ----------------------------------------------------------------------------------------------
# Sandboxed child processes (also used by synth.py and agent.py's bash tool)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def crash(self) -> str | None:
        """A readable cause when the child died abnormally."""
        if self.timed_out:
            return "timed out (the whole process group was killed)"
        if self.returncode < 0:
            sig = -self.returncode
            name = {11: "segmentation fault", 9: "killed (memory or CPU limit?)", 6: "aborted", 7: "bus error",
                    8: "floating point exception", 24: "CPU time limit exceeded", 25: "file size limit exceeded"}
            return f"crashed: {name.get(sig, signal.Signals(sig).name)} (signal {sig})"
        return None


_ISOLATION: dict = {}  # {"cpu"|"cuda": the unshare prefix that worked here}, probed once per process
_PASS_ENV = ("PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
             "NVIDIA_DRIVER_CAPABILITIES", "CC", "CXX", "NVCC_CCBIN", "TORCH_CUDA_ARCH_LIST", "CUDA_AGENT_CACHE",
             "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
_ISOLATION_LOCK = threading.Lock()
_CUDA_PROBE = "import torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize()"


def isolation(kind: str = "cpu") -> list:
    """Probe once which Linux namespaces we may create (for CUDA: in which a CUDA context still works;
    some GPU VMs refuse CUDA inside a PID or mount namespace). Returns the command prefix."""
    with _ISOLATION_LOCK:  # evaluate() starts two children at once; probe once, publish once
        if kind not in _ISOLATION:
            _ISOLATION[kind] = _probe_isolation(kind)
    return _ISOLATION[kind]


def _probe_isolation(kind: str) -> list:
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    tries = [["--net", "--pid", "--fork", "--kill-child", "--mount"], ["--net", "--mount"],
             ["--net", "--pid", "--fork", "--kill-child"], ["--net"], []]
    probe = [sys.executable, "-c", _CUDA_PROBE if kind == "cuda" else "pass"]
    if not shutil.which("unshare") or os.environ.get("CUDA_AGENT_NO_NAMESPACES") == "1":
        tries = [[]]
    with tempfile.TemporaryDirectory() as d:
        for flags in tries:
            prefix = ["unshare", *user, *flags] if flags else []
            if run_sandboxed(probe, d, 120, mem_gb=None, kind=kind, prefix=prefix).returncode == 0:
                break
    lost = [k for k, f in {"network": "--net", "pid": "--pid", "filesystem": "--mount"}.items() if f not in prefix]
    if lost:
        print(f"env.py: cannot create Linux {'/'.join(lost)} namespaces here{' for CUDA' if kind == 'cuda' else ''};"
              " candidates run with the remaining isolation, process groups and rlimits (see env.py's docstring)",
              file=sys.stderr)
    return prefix


def _jail(new_mount_ns: bool, writable: list[str], argv: list[str]):
    """Runs as root inside fresh namespaces: make every filesystem read-only except `writable`, then exec.
    Only ever touches mounts inside a mount namespace of its own (never the host's)."""
    if new_mount_ns:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18

        def mount(src, tgt, flags):
            return libc.mount(src and src.encode(), tgt.encode(), None, flags, None) == 0

        if mount(None, "/", MS_REC | MS_PRIVATE):
            for w in writable:
                if not mount(w, w, MS_BIND | MS_REC):
                    sys.exit(f"_jail: cannot bind {w}")
            for line in open("/proc/self/mountinfo"):
                mp = line.split()[4].replace("\\040", " ")
                if mp.startswith(("/proc", "/sys", "/dev")) or any(mp == w or mp.startswith(w + "/") for w in writable):
                    continue
                mount(None, mp, MS_REMOUNT | MS_BIND | MS_RDONLY)  # best effort per mount point
            os.chdir(os.getcwd())  # re-enter the cwd through the new writable bind mount
    os.execvp(argv[0], argv)


def _cgroup(name: str, pids_max: int, mem_bytes: int | None) -> list[Path]:
    """Per-child pids (and memory) cgroups where the cgroup tree is writable (v1 or v2)."""
    made = []
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():  # cgroup v2: one directory holds both limits
        try:
            base = root / "cuda-agent-mini"
            base.mkdir(exist_ok=True)
            for d in (root, base):
                with contextlib.suppress(OSError):
                    (d / "cgroup.subtree_control").write_text("+pids +memory")
            d = base / name
            d.mkdir()
            made.append(d)
            (d / "pids.max").write_text(str(pids_max))
            if mem_bytes:
                (d / "memory.max").write_text(str(mem_bytes))
        except OSError:
            pass
        return made
    for ctrl, files in (("pids", {"pids.max": pids_max}), ("memory", {"memory.limit_in_bytes": mem_bytes})):
        if not (root / ctrl / "cgroup.procs").exists() or (ctrl == "memory" and mem_bytes is None):
            continue
        d = root / ctrl / "cuda-agent-mini" / name
        try:
            d.mkdir(parents=True, exist_ok=True)
            made.append(d)
            for f, v in files.items():
                (d / f).write_text(str(v))
        except OSError:
            pass
    return made


def run_sandboxed(argv: list[str], cwd: str | Path, timeout: float, *, writable=(), mem_gb: float | None = 16.0,
                  cpu_s: float | None = None, env: dict | None = None, pass_fds=(), output_limit: int = 20_000,
                  max_tasks: int = 1024, kind: str = "cpu", prefix: list | None = None, started=None) -> SandboxResult:
    """Run argv in a child process that cannot hurt us: own session and process group, PID/net/mount
    namespaces where available, cgroup or rlimit caps, scrubbed environment, wall-clock timeout.
    `cwd` and `writable` stay writable; everything else is read-only where the OS allows it.
    stdout/stderr are kept to `output_limit` characters each (head and tail). kind="cuda" for children
    that use the GPU (no address-space limit, namespaces that CUDA tolerates here). started(pid): called with
    the child's process group once it runs, for a caller (another thread) that may need to kill it sooner."""
    cwd = str(Path(cwd).resolve())
    prefix = isolation(kind) if prefix is None else prefix
    child_env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    child_env.update(HOME=cwd, TMPDIR=cwd, LANG="C.UTF-8", PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    cmd = list(argv)
    if prefix:
        ws = [cwd, *[str(Path(w).resolve()) for w in writable]]
        cmd = [*prefix, sys.executable, "-E", str(ENV_PY), "_jail", str(int("--mount" in prefix)), *ws, "--", *argv]
    groups = _cgroup(uuid.uuid4().hex, max_tasks, int(mem_gb * 2**30) if mem_gb else None)
    # RLIMIT_AS breaks CUDA's address-space reservations; a memory cgroup (where writable) is used instead.
    has_mem_cgroup = any((g / "memory.max").exists() or (g / "memory.limit_in_bytes").exists() for g in groups)
    mem_limit = int(mem_gb * 2**30) if mem_gb and not has_mem_cgroup and kind != "cuda" else None

    def limits():  # runs in the child between fork and exec
        for g in groups:
            with open(g / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        if mem_limit:
            resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
        if cpu_s:
            resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_s), int(cpu_s) + 5))
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 30, 4 << 30))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.geteuid() != 0:
            resource.setrlimit(resource.RLIMIT_NPROC, (max_tasks * 4, max_tasks * 4))

    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, cwd=cwd, env=child_env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                             start_new_session=True, preexec_fn=limits, pass_fds=tuple(pass_fds))
        if started:
            started(p.pid)
        timed_out = False
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also when the caller is interrupted (Ctrl-C): never leave a child behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # also reaps stragglers that kept our process group
            p.wait()
        for g in groups:  # leftover tasks in the cgroup (escaped the group): kill, then remove it
            with contextlib.suppress(OSError, ValueError):
                if (g / "cgroup.kill").exists():
                    (g / "cgroup.kill").write_text("1")
                for pid in (g / "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
            for _ in range(50):
                try:
                    g.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
        texts = []
        for f in (out, err):
            size = f.seek(0, 2)
            f.seek(0)
            if size <= output_limit:
                texts.append(f.read().decode(errors="replace"))
            else:
                head = f.read(output_limit // 2).decode(errors="replace")
                f.seek(size - output_limit // 2)
                tail = f.read().decode(errors="replace")
                texts.append(f"{head}\n... [{size - output_limit} bytes of output truncated] ...\n{tail}")
    # Under `unshare --fork --kill-child`, a signal that kills the child shows up as 128+sig.
    rc = p.returncode
    if prefix and rc > 128 and "--fork" in prefix:
        rc = -(rc - 128)
    return SandboxResult(rc, texts[0], texts[1], timed_out, time.monotonic() - t0)


@contextlib.contextmanager
def file_lock(path: Path):
    """An flock: the kernel releases it when the holder dies, so a killed process leaves no stale lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def compile_caches(write: bool = True) -> tuple[dict, list[Path]]:
    """Environment and folders (to pass as writable) of the compile caches that trusted children (a task's
    reference, synth.py's filter) share and write: inductor's graphs, Triton's kernels, and the NVRTC kernels
    of jiterator ops (torch.special functions compile one on their first call, for seconds; without a shared
    folder every child compiles it again, because a child's HOME is its own folder). write=False (candidates):
    inductor's and Triton's to read, no folder to write, and no NVRTC one (torch warns on an unwritable one;
    the child's own HOME serves instead)."""
    dirs = {"TORCHINDUCTOR_CACHE_DIR": CACHE_DIR / "inductor", "TRITON_CACHE_DIR": CACHE_DIR / "triton"}
    if write:
        dirs["PYTORCH_KERNEL_CACHE_PATH"] = CACHE_DIR / "nvrtc"
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return {k: str(v) for k, v in dirs.items()}, list(dirs.values()) if write else []


def gpu_lock_path(backend: str) -> Path:
    """One timed section per GPU (or per CPU host) at a time, across all processes of this user."""
    dev = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] if backend == "cuda" else "cpu"
    return CACHE_DIR / "locks" / f"timing-{backend}-{dev}.lock"


# ----------------------------------------------------------------------------------------------
# Workspace: scaffold, collect, static scan
# ----------------------------------------------------------------------------------------------
STARTER_DOC = '''"""model_new.py: write ModelNew here. Same constructor and parameters as Model (model.py), so
load_state_dict works. All computation happens in the compiled extension `cuda_extension`, built
from every .cu/.cpp in this folder and in kernels/; exactly one source defines
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m). Python may only allocate (torch.empty...), reshape/view
and call the extension."""
'''


def new_workspace(path: str | Path, problem_code: str, backend: str = "auto") -> Path:
    """Scaffold a workspace: model.py (the reference), a starter model_new.py, an empty kernels/."""
    path = Path(path)
    tree = ast.parse(problem_code)  # raises SyntaxError on a broken problem file
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    missing = {"Model", "get_inputs", "get_init_inputs"} - names
    if missing:
        raise UsageError(f"problem is not in KernelBench format: missing {', '.join(sorted(missing))}")
    if path.exists() and any(path.iterdir()):
        raise UsageError(f"workspace {path} exists and is not empty")
    (path / "kernels").mkdir(parents=True, exist_ok=True)
    (path / "model.py").write_text(problem_code)
    (path / "model_new.py").write_text(starter_model_new(problem_code))
    (path / ".backend").write_text(resolve_backend(backend) + "\n")
    return path


def starter_model_new(problem_code: str) -> str:
    """Model's imports, a ModelNew with Model's __init__, and a forward that calls the extension."""
    tree = ast.parse(problem_code)
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    model.name = "ModelNew"
    for fn in model.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
            args = [a.arg for a in fn.args.args[1:]]
            fn.body = [ast.parse(f"return cuda_extension.forward({', '.join(args + ['*self.parameters()'])})").body[0]]
    consts = [n for n in tree.body if isinstance(n, ast.Assign)]
    body = keep + [ast.parse("import cuda_extension").body[0]] + consts + [model]
    return STARTER_DOC + ast.unparse(ast.Module(body=body, type_ignores=[])) + "\n"


def collect(workspace: Path, backend: str) -> tuple[dict, list]:
    """The files that make up a candidate: {relative path: text}. Everything else is ignored."""
    files, notes = {}, []
    for d in (workspace, workspace / "kernels"):
        if not d.is_dir():
            continue
        for f in sorted(d.iterdir()):
            if f.is_symlink() or not f.is_file() or f.suffix not in SOURCE_EXT | HEADER_EXT:
                continue
            if backend == "cpu" and f.suffix in (".cu", ".cuh"):
                notes.append(f"{f.relative_to(workspace)} ignored: the CPU backend builds .cpp only")
                continue
            if f.stat().st_size > 1 << 20:
                raise ValueError(f"{f.relative_to(workspace)} is larger than 1 MiB")
            files[str(f.relative_to(workspace))] = f.read_text(errors="replace")
    return files, notes


ALLOWED_IMPORTS = {"torch", "torch.nn", "torch.nn.functional", "math", "typing", "cuda_extension", "__future__",
                   "functools", "collections", "itertools", "dataclasses", "numbers", "enum"}
NUMERIC_LIBS = {"numpy", "cupy", "triton", "scipy", "jax", "numba", "tensorflow", "pycuda", "cuda", "tvm", "taichi"}
BANNED_NAMES = {"__import__", "eval", "exec", "compile", "open", "globals", "vars", "setattr", "delattr", "breakpoint"}
BANNED_ATTRS = {"__dict__", "__globals__", "__code__", "__builtins__", "__subclasses__", "__class__", "__bases__",
                "__mro__", "__closure__", "numpy", "tolist", "__array__", "_C", "f_globals", "f_locals", "f_back"}
CPP_BANNED = [
    (r"\bstd::thread\b|\bpthread_create\b|\bstd::async\b|\bstd::jthread\b", "threads are not allowed (use OpenMP or CUDA)"),
    (r"\b(fork|vfork|system|popen|execv|execvp|execl|execlp|posix_spawn)\s*\(", "starting processes is not allowed"),
    (r"\bdlopen\b|\bdlsym\b", "dynamic loading is not allowed"),
    (r"(py|pybind11)::module_?::import|\bPyImport_|\bPyRun_|(py|pybind11)::(exec|eval|globals)\b", "calling Python from C++ is not allowed"),
    (r"\bgetenv\b|\bfopen\b|std::ifstream|std::ofstream", "file and environment access is not allowed"),
]
# Calls torch::X(...) / at::X(...) that allocate or describe tensors; anything else computes.
CPP_ALLOWED_TORCH = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "from_blob", "parallel_for",
                     "get_num_threads", "device", "dtype", "elementSize", "typeMetaToScalarType", "toString",
                     "isFloatingType", "kCUDA", "kCPU", "getCurrentCUDAStream", "check_dim_size", "get_parallel_state"}


def static_scan(files: dict, model_new: str) -> tuple[list, list]:
    """Returns (violations, hints). Violations are certain cheats; hints are advice, the run-time
    dispatch monitor is the judge for PyTorch fallbacks."""
    violations, hints = [], []
    try:
        tree = ast.parse(model_new)
    except SyntaxError as e:
        return [], [f"model_new.py: syntax error line {e.lineno}: {e.msg}"]
    forward_calls = {id(c) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "forward"
                     for c in ast.walk(f) if isinstance(c, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level:
                mods = ["." + (node.module or "")]
            for m in mods:
                if m.split(".")[0] in NUMERIC_LIBS:
                    violations.append(f"model_new.py line {node.lineno}: imports {m}; only cuda_extension may compute")
                elif m not in ALLOWED_IMPORTS:
                    violations.append(f"model_new.py line {node.lineno}: import of {m} is not allowed "
                                      f"(allowed: {', '.join(sorted(ALLOWED_IMPORTS))})")
        elif isinstance(node, ast.Name) and node.id in BANNED_NAMES:
            violations.append(f"model_new.py line {node.lineno}: {node.id} is not allowed")
        elif isinstance(node, ast.Attribute) and node.attr in BANNED_ATTRS:
            violations.append(f"model_new.py line {node.lineno}: .{node.attr} is not allowed")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                root = t
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                if isinstance(t, ast.Attribute) and isinstance(root, ast.Name) and root.id in {"torch", "nn", "F", "math"}:
                    violations.append(f"model_new.py line {node.lineno}: monkey-patching {ast.unparse(t)} is not allowed")
        elif isinstance(node, ast.Call) and id(node) in forward_calls:
            name = ast.unparse(node.func)
            if name.startswith(("torch.", "F.", "nn.functional.")) and not re.match(
                    r"(torch\.(empty|zeros|nn\.|Size|device|cuda\.current_stream|cuda\.current_device|float|int|bool)"
                    r"|torch\.(empty_like|zeros_like))", name):
                hints.append(f"model_new.py line {node.lineno}: {name}(...) looks like a PyTorch compute op;"
                             " those are rejected at run time")
    for path, text in files.items():
        code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)  # comments don't count
        for pattern, why in CPP_BANNED:
            m = re.search(pattern, code)
            if m:
                violations.append(f"{path} line {code[:m.start()].count(chr(10)) + 1}: {why} ({m.group(0).strip()})")
        for m in re.finditer(r'#\s*include\s*([<"])([^>"]+)[>"]', code):  # no reading files outside the workspace
            inc, quoted = m.group(2), m.group(1) == '"'
            inside = os.path.normpath(os.path.join(os.path.dirname(path), inc))
            if inc.startswith("/") or (".." in inc.split("/") and (not quoted or inside.startswith(".."))):
                violations.append(f"{path} line {code[:m.start()].count(chr(10)) + 1}: {m.group(0)} reaches outside the workspace")
        for m in re.finditer(r"\b(?:torch|at)::(\w+)\s*\(", code):
            if m.group(1) not in CPP_ALLOWED_TORCH and not m.group(1)[0].isupper():
                violations.append(f"{path} line {code[:m.start()].count(chr(10)) + 1}: {m.group(0)}...) is a PyTorch "
                                  "compute op; write the kernel yourself")
    return violations, hints


# ----------------------------------------------------------------------------------------------
# Build: per-object content-hash cache, one shared module `cuda_extension`
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Build:
    ok: bool
    so_path: Path | None
    log: str
    seconds: float
    rebuilt: list  # sources that were compiled (not served from the cache)


_TOOLCHAIN: dict = {}


def toolchain(backend: str) -> dict:
    """Compiler commands and flags. Computed once per process (importing torch is the slow part)."""
    if backend in _TOOLCHAIN:
        return _TOOLCHAIN[backend]
    import sysconfig
    import torch
    from torch.utils import cpp_extension as ce
    std = "-std=c++20" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 10) else "-std=c++17"
    inc = [f"-I{p}" for p in ce.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    defs = ["-DTORCH_EXTENSION_NAME=cuda_extension", "-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    cxx = os.environ.get("CXX", "g++")
    tc = {"cxx": [cxx, "-O3", "-fPIC", std, "-w", *defs, *inc], "ldflags": []}
    libdir = ce.library_paths()[0]
    tc["ldflags"] = [f"-L{libdir}", f"-Wl,-rpath,{libdir}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    if backend == "cpu":
        tc["cxx"] += ["-fopenmp", "-march=native"]
        tc["ldflags"] += ["-fopenmp"]
    else:
        cuda_home = ce.CUDA_HOME or "/usr/local/cuda"
        nvcc = str(Path(cuda_home) / "bin" / "nvcc") if Path(cuda_home, "bin", "nvcc").exists() else "nvcc"
        arch = os.environ.get("CUDA_AGENT_ARCH") or gpu_query("compute_cap").replace(".", "") or "90"
        tc["nvcc"] = [nvcc, "-O3", std, "-Xcompiler", "-fPIC", "-w", "--expt-relaxed-constexpr",
                      f"-gencode=arch=compute_{arch},code=sm_{arch}", *defs, *inc, f"-I{cuda_home}/include"]
        tc["cxx"] += [f"-I{cuda_home}/include", "-DWITH_CUDA"]
        libdirs = [Path(cuda_home) / "lib64", *Path(torch.__file__).parent.parent.glob("nvidia/*/lib")]
        tc["ldflags"] += ["-lc10_cuda", "-ltorch_cuda"] + [f"-L{d}" for d in libdirs if d.exists()] + \
                         [f"-Wl,-rpath,{d}" for d in libdirs if d.exists()] + ["-lcudart"]
    version = subprocess.run([tc["cxx"][0], "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    tc["id"] = hashlib.sha256(json.dumps([tc, version, torch.__version__]).encode()).hexdigest()[:16]
    _TOOLCHAIN[backend] = tc
    return tc


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


def build(files: dict, backend: str, timeout: float = 600.0) -> Build:
    """Compile every source into the object cache, then link the module. Killed builds leave
    nothing behind: objects are renamed into place only when complete, locks are flocks."""
    t0 = time.monotonic()
    tc = toolchain(backend)
    sources = sorted(p for p in files if Path(p).suffix in SOURCE_EXT)
    if not sources:
        return Build(False, None, "no kernel sources: write kernels/*.cpp" + (" or *.cu" if backend == "cuda" else ""), 0, [])
    modules = [p for p in sources if re.search(r"PYBIND11_MODULE\s*\(", files[p])]
    if len(modules) != 1:
        msg = "no source defines" if not modules else f"{len(modules)} sources ({', '.join(modules)}) define"
        return Build(False, None, f"{msg} PYBIND11_MODULE(TORCH_EXTENSION_NAME, m); exactly one must", 0, [])
    headers = "".join(f"{p}\0{files[p]}\0" for p in sorted(files) if Path(p).suffix in HEADER_EXT)
    objdir = CACHE_DIR / "obj"
    objdir.mkdir(parents=True, exist_ok=True)
    keys = {p: hashlib.sha256(f"{tc['id']}\0{p}\0{files[p]}\0{headers}".encode()).hexdigest()[:32] for p in sources}
    rebuilt, errors = [], []
    deadline = time.monotonic() + timeout

    with tempfile.TemporaryDirectory(prefix="build-", dir=CACHE_DIR) as tmp:
        for p, text in files.items():  # sources and headers, laid out as in the workspace
            (Path(tmp) / p).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / p).write_text(text)

        def compile_one(p):
            obj = objdir / f"{keys[p]}.o"
            with file_lock(CACHE_DIR / "locks" / f"{keys[p]}.lock"):
                if obj.exists():
                    return
                tool = tc["nvcc"] if p.endswith(".cu") else tc["cxx"]
                part = Path(tmp) / f"{keys[p]}.o.part"
                cmd = [*tool, f"-I{tmp}", f"-I{tmp}/kernels", "-c", str(Path(tmp) / p), "-o", str(part)]
                r = run_sandboxed(cmd, tmp, max(1.0, deadline - time.monotonic()), mem_gb=None, output_limit=40_000)
                if r.returncode != 0 or not part.exists():
                    why = f"compilation of {p} {r.crash}" if r.crash else f"{p} failed to compile"
                    errors.append(f"{why}:\n{error_excerpt(r.stderr + r.stdout)}")
                    return
                os.replace(part, obj)  # atomic: a half-written object never has the final name
                rebuilt.append(p)

        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            list(pool.map(compile_one, sources))
        if errors:
            return Build(False, None, "\n".join(errors), time.monotonic() - t0, rebuilt)
        link_key = hashlib.sha256("".join(keys[p] for p in sources).encode() + tc["id"].encode()).hexdigest()[:32]
        so = CACHE_DIR / "so" / link_key / "cuda_extension.so"
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            part = Path(tmp) / "cuda_extension.so"
            cmd = [tc["cxx"][0], "-shared", *[str(objdir / f"{keys[p]}.o") for p in sources], "-o", str(part), *tc["ldflags"]]
            r = run_sandboxed(cmd, tmp, max(1.0, deadline - time.monotonic()), mem_gb=None)
            if r.returncode != 0:
                return Build(False, None, "link failed:\n" + error_excerpt(r.stderr + r.stdout), time.monotonic() - t0, rebuilt)
            shutil.copy(part, so.with_suffix(".part"))
            os.replace(so.with_suffix(".part"), so)
    return Build(True, so, "", time.monotonic() - t0, rebuilt)


# ----------------------------------------------------------------------------------------------
# The child harness: runs inside the sandbox. "reference" computes outputs and baseline timings;
# "candidate" loads ModelNew and the extension. The parent compares.
# ----------------------------------------------------------------------------------------------
ALLOWED_OPS = {  # aten ops that allocate, view or describe; everything else computes
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "zero_", "view", "_unsafe_view", "_reshape_alias", "as_strided", "t", "transpose", "permute", "unsqueeze",
    "squeeze", "expand", "slice", "select", "split", "split_with_sizes", "unbind", "chunk", "narrow", "alias",
    "detach", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "dim", "is_contiguous",
    "resize_", "_local_scalar_dense", "lift_fresh", "set_", "view_as_real", "view_as_complex", "_unsafe_view",
    "record_stream", "is_same_size", "equal_size",
}


_perf_counter = time.perf_counter  # bound at import, before any candidate code can patch `time`
_SYNC = None  # torch.cuda.synchronize, bound by the child harness before candidate code loads


def time_callable(fn, input_sets, *, n_timed=20, min_s=0.25, warmup=3, lock_fd=None, on_output=None, max_runs=200):
    """Median milliseconds of fn(*inputs) over >= n_timed runs; the one timing function used for the
    candidate, eager and torch.compile alike (and by synth.py).
    Before each run: fresh values copied into the SAME input buffers (input_sets[k] in turn), the
    L2 flushed, a device-wide synchronisation (work on side streams or threads counts).
    After each run: synchronise, stop the clock, then `on_output(k, out)` (outside the timed region).
    lock_fd: an open file whose flock serialises timed sections per device."""
    import torch
    cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in input_sets[0])
    sync = (_SYNC or torch.cuda.synchronize) if cuda else (lambda: None)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") if cuda else None  # > 2x H200's 60 MB L2
    buffers = [x.clone() if isinstance(x, torch.Tensor) else x for x in input_sets[0]]
    times, outs = [], []
    with torch.no_grad():
        for _ in range(warmup):
            fn(*buffers)
        sync()
        if lock_fd is not None:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            i, t_start = 0, _perf_counter()
            while i < n_timed or (_perf_counter() - t_start < min_s and i < max_runs):
                k = i % len(input_sets)
                for b, x in zip(buffers, input_sets[k]):
                    if isinstance(b, torch.Tensor):
                        b.copy_(x)
                if flush is not None:
                    flush.zero_()
                sync()
                t0 = _perf_counter()
                out = fn(*buffers)
                sync()
                times.append((_perf_counter() - t0) * 1e3)
                if on_output is not None:
                    outs.append((k, on_output(k, out)))
                i += 1
        finally:
            if lock_fd is not None:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
    times.sort()
    return times[len(times) // 2], outs


def _child_main(spec_path: str):
    spec = json.loads(Path(spec_path).read_text())
    import importlib.util
    import random
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    global _SYNC
    device = torch.device("cuda" if spec["backend"] == "cuda" else "cpu")
    _SYNC = torch.cuda.synchronize
    sync = _SYNC if device.type == "cuda" else (lambda: None)
    torch.set_num_threads(os.cpu_count() or 1)
    result = {"violations": [], "error": None, "warnings": []}
    saved = {"checks": [], "timed": []}

    def finish():
        if result["violations"] or result["error"]:
            saved.clear()  # outputs of a rejected candidate are never read back
        torch.save(saved, spec["out"] + ".pt")
        Path(spec["out"] + ".json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown: candidate atexit hooks and destructors don't run

    def load(path, name):
        s = importlib.util.spec_from_file_location(name, path)
        m = importlib.util.module_from_spec(s)
        sys.modules[name] = m
        s.loader.exec_module(m)
        return m

    def to_dev(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    def inputs_for(seed):
        torch.manual_seed(seed)
        random.seed(seed)
        return [to_dev(x) for x in ref.get_inputs()]

    def snapshot(out, offset=None):
        """Outputs as CPU tensors. For timed runs, a strided sample (cheap) at a secret offset."""
        def one(t):
            if not isinstance(t, torch.Tensor):
                return t
            t = t.detach()
            if offset is not None and t.numel() > 65536:
                step = t.numel() // 65536
                return t.reshape(-1)[offset % step::step].cpu().clone()
            return t.cpu().clone()
        return tuple(one(t) for t in out) if isinstance(out, (tuple, list)) else one(out)

    ref = load(spec["reference"], "reference_model")
    init = ref.get_init_inputs()
    torch.manual_seed(spec["seed0"])
    model = ref.Model(*init).to(device).eval()
    check_inputs = [inputs_for(s) for s in spec["check_seeds"]]
    # Fresh input sets for timing, drawn now: candidate code cannot see them coming.
    per_set = sum(x.numel() * x.element_size() for x in check_inputs[0] if isinstance(x, torch.Tensor)) + 1
    n_sets = int(max(2, min(len(spec["timed_seeds"]), spec["input_budget_mb"] * 2**20 // per_set)))
    timed_sets = [inputs_for(s) for s in spec["timed_seeds"][:n_sets]]

    def time_forward(fn, lock_fd):
        return time_callable(fn, timed_sets, n_timed=spec["n_timed"], min_s=spec["min_timed_s"], warmup=spec["warmup"],
                             lock_fd=lock_fd, on_output=lambda k, out: snapshot(out, spec["offsets"][k]))

    if spec["mode"] == "reference":
        # The reference holds the timing lock for all its work, so that nothing it computes
        # overlaps a candidate's timed runs on the same device.
        fcntl.flock(spec["lock_fd"], fcntl.LOCK_EX)
        with torch.no_grad():
            saved["checks"] = [snapshot(model(*x)) for x in check_inputs]
            saved["timed"] = [snapshot(model(*x), spec["offsets"][k]) for k, x in enumerate(timed_sets)]
        if spec["time_baselines"]:
            result["eager_ms"], _ = time_forward(model, None)
            compiled = torch.compile(model)
            result["compile_ms"], _ = time_forward(compiled, None)
        finish()

    # ---------------- candidate ----------------
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    sys.path[:0] = [spec["ext_dir"], spec["cand_dir"]]
    try:
        cand_mod = load(spec["model_new"], "model_new")
        torch.manual_seed(spec["seed0"])
        cand = cand_mod.ModelNew(*init)
        missing, unexpected = cand.load_state_dict(state, strict=False)
        if missing or unexpected:
            result["error"] = (f"ModelNew's parameters differ from Model's (missing {list(missing)[:5]}, "
                               f"unexpected {list(unexpected)[:5]}): keep the same constructor and parameter names")
            finish()
        cand = cand.to(device).eval()
    except BaseException as e:  # noqa: BLE001  - the candidate's problem, reported to it
        result["error"] = f"model_new.py failed to load: {type(e).__name__}: {str(e)[:500]}"
        finish()

    class OpMonitor(TorchDispatchMode):
        """Records every aten op that computes values while ModelNew.forward runs (Python or C++)."""
        def __init__(self):
            super().__init__()
            self.bad = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in ALLOWED_OPS and name not in self.bad:
                self.bad.append(name)
            return func(*args, **(kwargs or {}))

    def no_numpy(*a, **k):
        raise RuntimeError("converting tensors to numpy/lists inside forward is not allowed")

    def monitored(x):
        mon = OpMonitor()
        patched = {n: getattr(torch.Tensor, n) for n in ("numpy", "tolist", "__array__")}
        for n in patched:
            setattr(torch.Tensor, n, no_numpy)
        try:
            with torch.no_grad(), mon:
                out = cand(*x)
            sync()
        finally:
            for n, f in patched.items():
                setattr(torch.Tensor, n, f)
        if mon.bad:
            result["violations"].append("PyTorch compute ops ran inside ModelNew.forward: " + ", ".join(
                f"aten.{n}" for n in mon.bad[:8]) + " (only allocation, views and cuda_extension may be used)")
        return out

    def check_types(out):
        outs = out if isinstance(out, (tuple, list)) else [out]
        for o in outs:
            if isinstance(o, torch.Tensor) and type(o) is not torch.Tensor:
                result["violations"].append(f"output is a {type(o).__name__}, not a plain torch.Tensor")
            elif isinstance(o, torch.Tensor) and o.device.type != device.type:
                result["error"] = f"output is on {o.device}, expected {device.type}"

    try:
        for x in check_inputs:
            before = [t.clone() if isinstance(t, torch.Tensor) else t for t in x]
            out = monitored(x)
            check_types(out)
            for a, b in zip(x, before):
                if isinstance(a, torch.Tensor) and not torch.equal(a, b):
                    result["violations"].append("ModelNew.forward mutated its inputs")
                    break
            saved["checks"].append(snapshot(out))
            if result["violations"] or result["error"]:
                finish()
        if spec["time_candidate"]:
            result["runtime_ms"], saved["timed"] = time_forward(cand, spec["lock_fd"])
    except BaseException as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {str(e)[:800]}"
    finish()


# ----------------------------------------------------------------------------------------------
# Compare (in the parent, which never runs candidate code)
# ----------------------------------------------------------------------------------------------
def compare(out, ref, atol, rtol, what: str) -> str | None:
    """None if `out` matches `ref` exactly in structure/shape/dtype and within tolerance."""
    import torch
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            return f"{what}: output structure differs (expected a sequence of {len(ref)})"
        for i, (o, r) in enumerate(zip(out, ref)):
            err = compare(o, r, atol, rtol, f"{what}[{i}]")
            if err:
                return err
        return None
    if isinstance(ref, torch.Tensor):
        if not isinstance(out, torch.Tensor):
            return f"{what}: expected a tensor, got {type(out).__name__}"
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return f"{what}: expected shape {tuple(ref.shape)} {ref.dtype}, got {tuple(out.shape)} {out.dtype}"
        if ref.dtype == torch.bool or not (ref.is_floating_point() or ref.is_complex()):
            ok = torch.equal(out, ref)
            return None if ok else f"{what}: integer/bool output differs"
        close = torch.isclose(out.double(), ref.double(), atol=atol, rtol=rtol, equal_nan=True)
        if bool(close.all()):
            return None
        bad = (~close).sum().item()
        diff = (out.double() - ref.double()).abs().nan_to_num(float("inf")).max().item()
        return f"{what}: {bad}/{ref.numel()} values differ (max abs diff {diff:.3g}, atol={atol}, rtol={rtol})"
    return None if out == ref else f"{what}: expected {ref!r}, got {out!r}"


# ----------------------------------------------------------------------------------------------
# evaluate(): the one scorer used by agent.py, train.py, evaluate.py and synth.py
# ----------------------------------------------------------------------------------------------
def evaluate(workspace, backend: str = "auto", reference: str | None = None, cfg: Config | None = None, **overrides) -> Verdict:
    """Compile, verify, profile and reward one workspace. `reference` (the task's code) overrides
    the workspace's model.py, so an agent that edits model.py changes nothing but gets a violation."""
    cfg = dataclasses.replace(cfg or Config(), **overrides)
    t_start = time.monotonic()
    ws = Path(workspace)
    backend = resolve_backend(backend if backend != "auto" else cfg.backend)
    if not ws.is_dir():
        raise UsageError(f"no such workspace: {ws}")
    if reference is None and not (ws / "model.py").is_file():
        raise UsageError(f"{ws} has no model.py")
    v = Verdict(backend=backend, stage="scan")

    def done():
        v.seconds = round(time.monotonic() - t_start, 3)
        return v

    ref_code = reference if reference is not None else (ws / "model.py").read_text()
    if reference is not None and (ws / "model.py").is_file() and (ws / "model.py").read_text() != reference:
        v.violations.append("model.py was modified; the reference is read-only")
    if not (ws / "model_new.py").is_file():
        v.error = "model_new.py is missing"
        return done()
    try:
        files, notes = collect(ws, backend)
    except (ValueError, UnicodeDecodeError) as e:
        v.error = str(e)
        return done()
    v.warnings += notes
    model_new = (ws / "model_new.py").read_text(errors="replace")
    try:
        ast.parse(model_new)
    except SyntaxError as e:
        v.error = f"model_new.py line {e.lineno}: SyntaxError: {e.msg}"
        return done()
    bad, v.hints = static_scan(files, model_new)
    v.violations += bad
    if v.violations:
        return done()

    v.stage = "compile"
    b = build(files, backend, cfg.compile_timeout)
    v.compiled, v.log = b.ok, b.log
    if not b.ok:
        v.error = "compilation failed"
        return done()
    if cfg.stage == "compile":
        return done()

    v.stage = "verify"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="run-", dir=CACHE_DIR) as run:
        run = Path(run)
        for d in ("ref", "cand", "ext", "inductor"):
            (run / d).mkdir()
        (run / "ref" / "model.py").write_text(ref_code)
        (run / "cand" / "model_new.py").write_text(model_new)
        shutil.copy(b.so_path, run / "ext" / "cuda_extension.so")
        rng = int.from_bytes(os.urandom(4), "little")
        import random
        rnd = random.Random(rng)
        timed = cfg.stage == "profile"
        n_timed_seeds = max(cfg.n_timed, 2)
        base_key = hashlib.sha256(f"{ref_code}\0{backend}\0{toolchain_id_light(backend)}\0{cfg.n_timed}".encode()).hexdigest()[:24]
        base_file = CACHE_DIR / "baselines" / f"{base_key}.json"
        cached = json.loads(base_file.read_text()) if base_file.exists() else None
        common = dict(backend=backend, reference=str(run / "ref" / "model.py"), seed0=rnd.randrange(2**31),
                      check_seeds=[rnd.randrange(2**31) for _ in range(cfg.n_checks)],
                      timed_seeds=[rnd.randrange(2**31) for _ in range(n_timed_seeds)],
                      offsets=[rnd.randrange(2**20) for _ in range(n_timed_seeds)], warmup=cfg.warmup, n_timed=cfg.n_timed,
                      min_timed_s=cfg.min_timed_s, input_budget_mb=cfg.input_budget_mb)
        specs = {
            "ref": dict(common, mode="reference", out=str(run / "ref" / "result"), time_baselines=timed and cached is None),
            "cand": dict(common, mode="candidate", out=str(run / "cand" / "result"), time_candidate=timed,
                         model_new=str(run / "cand" / "model_new.py"), ext_dir=str(run / "ext"), cand_dir=str(run / "cand")),
        }
        lock = gpu_lock_path(backend)
        lock.parent.mkdir(parents=True, exist_ok=True)
        results = {}

        def run_child(name):
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)  # own open file description per child
            try:
                spec = dict(specs[name], lock_fd=fd)
                (run / name / "spec.json").write_text(json.dumps(spec))
                # a candidate must not plant entries in shared caches: it only reads them
                extra, writable = compile_caches(write=name == "ref")
                extra["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
                results[name] = run_sandboxed([sys.executable, "-E", "-B", str(ENV_PY), "_child", str(run / name / "spec.json")],
                                              run / name, cfg.timeout, writable=writable, mem_gb=cfg.mem_gb, env=extra, pass_fds=[fd],
                                              kind=backend)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(2) as pool:  # reference and candidate run side by side
            list(pool.map(run_child, ["ref", "cand"]))

        def child_output(name):
            r = results[name]
            res_file = run / name / "result.json"
            if r.crash or not res_file.exists():
                tail = error_excerpt(r.stderr, 12) if r.stderr.strip() else ""
                return None, None, (r.crash or f"exited with code {r.returncode} without a result"), tail
            import torch
            res = json.loads(res_file.read_text())
            try:  # weights_only: a candidate-written pickle cannot run code in this process
                data = torch.load(run / name / "result.pt", weights_only=True)
            except Exception as e:  # noqa: BLE001
                return res, None, f"returned outputs that are not plain tensors ({str(e).splitlines()[-1][:200]})", ""
            return res, data, None, ""

        ref_res, ref_data, ref_err, ref_tail = child_output("ref")
        if ref_err or ref_res.get("error"):
            v.error = f"the reference model.py failed: {ref_err or ref_res['error']}"
            v.log = ref_tail
            return done()
        cand_res, cand_data, cand_err, cand_tail = child_output("cand")
        if cand_err:
            v.error = f"ModelNew {cand_err}"
            v.log = cand_tail
            return done()
        v.violations += cand_res["violations"]
        if cand_res["error"]:
            v.error = cand_res["error"]
            v.log = cand_tail
        if v.violations or v.error:
            return done()
        for i, (o, r) in enumerate(zip(cand_data["checks"], ref_data["checks"])):
            err = compare(o, r, cfg.atol, cfg.rtol, f"check {i + 1}/{cfg.n_checks}")
            if err:
                v.error = err
                return done()
        if len(cand_data["checks"]) != len(ref_data["checks"]):
            v.error = "ModelNew did not produce every check's output"
            return done()
        import torch
        if len(ref_data["checks"]) > 1 and all(
                compare(r, ref_data["checks"][0], 0, 0, "") is None for r in ref_data["checks"][1:]):
            v.warnings.append("the reference output is the same for every input: this task is degenerate")
        v.correct, v.reward = True, 1
        if not timed:
            return done()

        v.stage = "profile"
        for k, out in cand_data["timed"]:  # every timed run's output, re-checked
            err = compare(out, ref_data["timed"][k], cfg.atol, cfg.rtol, "a timed run")
            if err:
                v.correct, v.reward = False, -1
                v.error = f"{err}: outputs are wrong when inputs change in place (cached by pointer, or work skipped?)"
                return done()
        if cached is None:
            cached = {"eager_ms": ref_res["eager_ms"], "compile_ms": ref_res["compile_ms"]}
            base_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = base_file.with_suffix(f".{uuid.uuid4().hex}.tmp")
            tmp.write_text(json.dumps(cached))
            os.replace(tmp, base_file)
        v.runtime_ms, v.eager_ms, v.compile_ms = cand_res["runtime_ms"], cached["eager_ms"], cached["compile_ms"]
        v.speedup_eager = v.eager_ms / v.runtime_ms if v.runtime_ms > 0 else None
        v.speedup_compile = v.compile_ms / v.runtime_ms if v.runtime_ms > 0 else None
        if v.runtime_ms <= 0:
            v.error = "runtime measured as 0 ms"
            v.correct, v.reward = False, -1
            return done()
        v.reward = reward_for(True, v.runtime_ms, v.eager_ms, v.compile_ms)
    return done()


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


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description="cuda-agent-mini kernel sandbox", formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eval", help="compile, verify, profile and reward a workspace")
    e.add_argument("workspace")
    e.add_argument("--backend", default="auto")
    e.add_argument("--timeout", type=float, default=Config.timeout)
    e.add_argument("--compile-timeout", type=float, default=Config.compile_timeout)
    e.add_argument("--stage", default="profile", choices=["compile", "verify", "profile"])
    e.add_argument("--json", action="store_true", help="last stdout line is the verdict as JSON")
    n = sub.add_parser("new", help="scaffold a workspace for a KernelBench-format problem")
    n.add_argument("workspace")
    n.add_argument("--problem", required=True)
    n.add_argument("--backend", default="auto")
    a = p.parse_args(argv)
    try:
        if a.cmd == "new":
            if not Path(a.problem).is_file():
                raise UsageError(f"no such problem file: {a.problem}")
            ws = new_workspace(a.workspace, Path(a.problem).read_text(), a.backend)
            print(f"workspace {ws}: model.py, model_new.py (starter), kernels/ (empty)")
            print(f"next: write kernels/*.cpp{' or *.cu' if (ws / '.backend').read_text().strip() == 'cuda' else ''} "
                  f"and model_new.py, then: python env.py eval {ws}")
            return 0
        backend = a.backend
        if backend == "auto" and Path(a.workspace, ".backend").is_file():
            backend = Path(a.workspace, ".backend").read_text().strip()
        v = evaluate(a.workspace, backend=backend, timeout=a.timeout, compile_timeout=a.compile_timeout, stage=a.stage)
    except UsageError as err:
        print(f"env.py: error: {err}", file=sys.stderr)
        return 2
    except SyntaxError as err:
        print(f"env.py: error: problem file does not parse: {err}", file=sys.stderr)
        return 2
    print(v.summary())
    if a.json:
        print(json.dumps(v.to_dict()))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_jail":
        i = sys.argv.index("--")
        _jail(sys.argv[2] == "1", sys.argv[3:i], sys.argv[i + 1:])
    elif len(sys.argv) == 3 and sys.argv[1] == "_child":
        _child_main(sys.argv[2])
    else:
        sys.exit(main())
