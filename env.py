"""env.py: the kernel workspace, sandbox and reward of cuda-agent-mini.

    python env.py new  ws/ --problem examples/relu.py --backend cpu   # scaffold a workspace
    python env.py eval ws/ --backend cpu --json                      # compile, verify, profile, reward
    python env.py eval ws/ --backend cuda                            # the real thing, on a GPU

Python API (one scorer everywhere): `evaluate(workspace, backend=...) -> Verdict`.

What one verdict does, in order (build.py has step 3, protocol.py the children and runs of steps 4-5)
  1. collect   only model_new.py and the kernel sources (*.cu *.cpp *.h *.cuh *.hpp in the root and in
               kernels/, no symbolic links; 1 MiB each, 256 files and 8 MiB in all) are taken; anything else
               is ignored.
  2. scan      model_new.py against an allow-list of Python (scan.py): allowed imports, nn.Module
               classes, plain statements; no underscore attributes, no getattr/eval/open, no torch.X
               outside allocation, dtypes and torch.nn; an attribute of a value is the file's own, a
               tensor method that is an ATen operator (the monitor judges it at run time), a tensor's
               data or a layer's constant, or nn.Module/container API (no Tensor.map2_, no str.format).
  3. build     every workspace file's directives are checked as written (no #line or line markers: the scan
               trusts the preprocessed text's markers; an #include names its header literally, with no absolute
               path and no `..`: a file the preprocessor opens is quoted back in its errors), every source is run through the compiler's own
               preprocessor (-dD: macro bodies stay where they were defined) and its tokens checked
               (scan.py: allowed includes and pragmas only, no doors out of the process, no compute ops by
               name, no Python object model, exactly one real PYBIND11_MODULE); then compiled on its own (nvcc
               -O3 for .cu; g++ for .cpp from the scanned text: -O3 and OpenMP on the CPU backend, whose .cpp
               files are the kernels, -O1 for the CUDA backend's host glue; <torch/extension.h>, or a lighter
               header by that name, precompiled: build.py) into a content-hash cache and linked
               into one module `cuda_extension`, whose imported symbols (C functions and C++ names from allow-lists; no
               PyTorch compute operator, thread, process, file, dynamic loader or dispatcher entry, whatever the
               source spelled) and machine code (no system call instruction) are checked. Editing one kernel rebuilds only that object. A build counts as a
               candidate on its device (step 5).
  4. verify    a trusted REFERENCE child computes the outputs of 5 check inputs and of the timing inputs
               (each drawn from a fresh secret seed, on the task's device) and sends them to this process
               over a pipe, and ends. The CANDIDATE child starts afterwards, knowing no seed (no candidate child of
               a verdict lives beside a reference child of it): it loads ModelNew under a dispatch
               monitor (module import, __init__, load_state_dict: only allocation, random
               initialisation and copies), then is told one input at a time. The extension's functions
               take only tensors, numbers, None and tuples of them (a list becomes a fresh tuple; no Python
               callable for native code to call, no list or string to write values into),
               may return only tensors (or None): no values handed to Python to compute on, and must leave the
               thread's dispatch key state, through which the monitor sees operators, as they found it (so must
               the extension's loading, ModelNew's building and each forward, and every run starts from the
               state the first one did: native code of the extension's may run outside its calls, a storage's
               deleter when a tensor is dropped): a change fails the verdict. A tensor's text holds no values
               there (str(t) runs with the dispatch modes off, and would hand them to Python unseen). Its
               whole outputs on the check inputs are compared here (on this process's GPU, where it has one, from
               GPU_COMPARE elements on), at atol = rtol = 1e-2 element by element AND by RMS error
               at the reference's own scale. While forward runs (every run, timed or not), any PyTorch
               operator that computes is a violation; inputs must not be mutated; outputs must be plain
               tensors on the right device.
  5. profile   candidate, eager and torch.compile are timed the same way, by THIS process's clock, around one
               exchange per run: "run" (forward, outputs made contiguous, device-wide sync; the reply lists each
               output's address, size and CUDA IPC handle), then this process reads 64 elements of each output from
               the child's memory itself, at positions it drew and never tells (process_vm_readv; on the GPU a
               gather through the IPC mapping; where neither is possible, see below, the child is asked for a
               "sample" out[o::step], o told after the run returned). Each run's input is written into the child's
               buffers by this process just before the clock starts: the child never holds it earlier
               (protocol.TimedInputs; where protocol.reads() holds and the sets share one structure, else below).
               On the CPU every process of the child's PID namespace is stopped while the write
               goes on, and continued as the clock starts; on the GPU the L2 is flushed first and the buffers are the native
               helper's, opened by the child through CUDA IPC, so inputs up to the L2's size start the run in it (the
               same for all three). Every sample is compared with the reference, so pointer-keyed caches, work
               skipped after the checks, and work deferred past the run are caught or timed. Two more runs, which
               ones told to the child after each run returned, are read in full and not timed (work skipped in a
               pattern a sample can miss); each timed child's last run is read in full too, after it was timed. Median
               of 20 runs, each on inputs of its own. Where input_budget_mb holds fewer sets than runs (the verdict
               draws 23), the candidate's runs are shared out (protocol.timing_shares) over the candidate child, on the
               first batch of sets, and fresh children of the same files after it, one after another (up to
               protocol.SPLIT_CHILDREN; with 2 sets, 10 runs of which 2 are audits), each later child on a fresh batch
               from a reference child of its own, ended before it starts; no child meets a set twice, and each warms up
               first on an input it loads itself.
               One timed section per device at a time (a lock this process holds). Every child gets the same
               threading settings (CHILD_ENV: one OpenMP thread per core but one, idle workers sleep). Baselines are
               timed while no candidate lives on the device, cached per reference with their spread, and measured
               again while noisy (3 measurements at most, the least noisy kept).
  6. reward    the paper's milestones: -1 incorrect; 3 if >5% faster than eager AND compile;
               2 if >5% faster than eager only; 1 otherwise (correct).

What the sandbox protects against (sandbox.py has the layers)
  - reading the answers: reference outputs and seeds never exist where the candidate can reach them, nor the
    positions its timed runs are checked at (they never leave this process; but see below); no candidate child
    of a verdict lives while a reference child of it does (on a GPU a reference exports each timed set to this
    process through a CUDA IPC handle); its filesystem view hides the cache root (other runs, baselines,
    references), /tmp and /dev/shm are its own, and a timed run's input arrives only as its clock starts (this
    process writes it; see below).
  - forging the verdict: only this process measures time and judges; a child's replies are validated
    field by field (a malformed one is reward -1, never a crash), and each must echo the nonce of the command it
    answers: a reply that native code writes to the pipe without reading the harness's memory is refused.
  - reaching the host: fresh PID namespace with its own /proc, read-only mounts (/sys, and /proc but for the
    processes' own entries), a /dev of its own with an allow-list of device nodes, no capabilities,
    no_new_privs, no network; a killed child takes all its descendants with it.
  - crashes, hangs, fork bombs, huge allocations, megabytes of output: fresh processes per verdict, wall
    clock timeouts (loading the candidate its own, load_timeout, and each command after it its own, run_timeout,
    checked at every read of a reply and every write of a command, so a trickled reply or a command pipe the child
    fills itself is no way past it: a hang frees the device in seconds),
    cgroups or rlimits, truncated logs.
  - reaching harness state: each child is a fresh process, forked (where sandbox.py's fork server works, else
    exec'ed) from a trusted interpreter that this process exec'ed, that imported torch before any candidate existed
    and never holds a secret (a child reads its key from its own spec file); it never initialises CUDA, so every
    child creates its own context. A forked child goes through the same layers as an exec'ed one, and keeps no
    descriptor but its stdio and its two pipes.
  - slowing the baselines: they are never timed while a candidate is alive on that device, and every process
    the policy controls counts as one: the candidate child, a build, the agent's bash tool; so does another
    verdict's reference child until its outputs are in (the policy decides when verdicts start). A task's first
    profile checks the candidate before its baselines (a wrong one costs none): that child is stopped first, and
    the timed runs get a fresh child in a fresh folder.
  - hiding a cheat from the scan: the scan reads the preprocessed tokens, so aliases, token pasting,
    digraphs, computed includes and comments change nothing; no directive can re-attribute lines to a system
    header (#line, line markers, text that reads as a marker), a workspace macro is scanned where it is
    defined even when only a header expands it, and what the linked module imports and executes is checked
    whatever the source looked like. What is compiled is what was scanned: a .cpp compiles from the scanned
    text; nvcc preprocesses a .cu again, and its host text (kept with --keep) must equal the scanned one, so a
    directive that sees a file existing only while compiling (`__has_include`) chooses nothing unscanned.
  - PyTorch from another thread (OpenMP workers, at::parallel_for, CUDA host callbacks): the module may import
    no PyTorch operator but allocation and views, so no thread has one to call.
  - caches keyed on input values: no input set is met twice by the candidate, warm-up included, in one process or
    across processes (a freed allocation's leftovers on the GPU could carry a cache from one child to the next; the
    kernel keyring, which the namespaces do not separate, is refused to every child by sandbox.py's seccomp filter).
    Where the input budget holds fewer sets than runs, each share of the runs after the first (the checked child's)
    gets a fresh process and a fresh batch of sets.

What it does NOT protect against (be honest; RL will look)
  - native code in the candidate's own process can write anything in that process's memory, including the
    harness's monitor and the nonce of the command the harness is serving. The scan closes the doors it would need
    by name (raw syscalls, I/O functions, signals, mmap, inline assembly in host code, the Python C API and the object
    model's fields, threads, PyTorch operators in its imports), but a module's own relocations hold the addresses of
    the Python API functions pybind11 imports, and its ELF header is a linker symbol away (__ehdr_start): from there
    it calls Python as the harness does: it can answer any command for the harness. What it cannot forge: the
    clock, the comparison, and the positions a timed run is checked at, which this process reads from the child's
    memory itself after the run's reply (tests/test_redteam.py, 12): host memory with process_vm_readv, device
    memory through a CUDA IPC handle of the output's allocation, gathered in a CUDA context of the native helper's
    own (protocol.py). That needs (protocol.reads(), decided on a reference child): the native helper, and on the
    CPU a PID namespace and a private /dev, leave to read children's memory, and vm.unprivileged_userfaultfd = 0
    (else a child could serve the pages read as they are read: 12b). Where it is missing the child is told the
    sample's position after its run, and such a kernel can compute only the sampled elements (reward +3 at 1/64 of
    the work, measured against that exchange on the CPU): the verdicts say so once on stderr.
  - on the GPU, work done alongside the write of a run's input by native code that takes its process over as above:
    the child holds no run's input before this process writes it, just before t0 (a kernel that loads its own input
    computes the whole output then and returns it at once: reward +3 at 0.28 ms against 12.4 ms honest;
    tests/test_redteam.py, 14), and on the CPU its processes are stopped during the write (a thread that follows the
    write page by page, or stalls it by holding the memory map, would win +3: tests/test_redteam.py, 15); on the GPU it
    is not stopped (TODO: stop it too, once measured on a GPU), and a thread or a persistent GPU kernel of its own
    could watch its buffers and compute on the part already copied: at most the copy's time (one pass over the inputs
    at the device's bandwidth) saved per run. Where the reads are not possible, and for a task whose timed sets differ
    in structure (a value drawn per set), the child loads each input itself, untimed, and such a kernel can compute the
    whole output then.
  - another child on the same GPU that guesses the CUDA IPC handle of a candidate's outputs or input buffers (the
    driver's handles are predictable) can open them: read them, or overwrite them before the parent reads them (a
    sibling episode's run would fail). Each buffer of the native helper's is in pages of its own, so no handle reaches
    the timed sets it holds. The same goes for a reference child's export of a timed set to this process: a candidate
    of another verdict on the device at that time could open it, and pass outputs computed from it to a candidate of
    this verdict through a channel between children (its own device memory, exported under a handle the other guesses;
    the page cache of a file both can read, read back with mincore; flock: the kernel keyring is refused to every
    child): collusion across two episodes, not tried. Closing it needs an export no other process can name (a VMM
    allocation shared by file descriptor) or the sets over the pipe. (This verdict's own candidate is not alive then.)
  - inputs mutated by a timed run: checked on the check runs only (this process writes every timed run's input
    afresh). Timed runs get contiguous copies of strided inputs.
  - a kernel that tells the audited runs from the sampled ones (by the time between its calls) knows when the
    n_audits are spent: the runs after that are checked by their samples only (and the last one in full).
  - an OpenMP worker still runs the kernel's own code outside the monitor's thread (it may call only the
    allocation and view operators the module imports). A kernel cannot exclude the Python dispatch keys, through
    which the monitor sees operators, even for the length of one call: every module is linked with the harness's
    ExcludeDispatchKeyGuard in place of c10's (build.GUARD_SOURCE; the guard's class is imported by PyTorch's own
    inline factories, and the key set's other API is refused at link), which refuses a key beyond autograd's,
    takes back on destruction only the keys it added, and keeps nothing in the guard's bytes (c10's keeps the key
    set's address and the saved set its destructor writes back: both were ways in). Red team: PyTorch computing
    through pybind11's object operators on a tensor's Python object, or the imported copy `to`, inside such a
    guard got +1 to +3 (tests/attack_cases/within_one_call.cpp).
    What is left is the first item's: native code that finds the thread's key set in memory and writes it, between
    the state checks. A third red team found it twice (+1 each, reproducers kept outside the repository): in the
    guard's own freed side-table node (malloc of its size on the same thread returns it) and in the stack words the
    guard's calls spill, confirmed by a legal guard flipping exactly its bits; clearing them only lengthens the
    search. Closing it needs a monitor that does not read the thread's key set (a global RecordFunction callback,
    which would also see workers). TODO.
  - on an OpenMP worker (no dispatch mode there) the imported operators that copy run unseen: `Tensor::to` casts
    (reward +1 on a trunc task, red team), contiguous/reshape/flatten copy a layout. TODO: take `to` off
    scan.IMPORT_OPS, or refuse these imports off forward's thread.
  - where input_budget_mb holds fewer sets than runs (above ~45 MB a set at the default budget: most tasks of
    synth.py's 1-100 ms window on a GPU), the candidate's runs are shared out: with 2, 3 or 4 sets its median is of
    8, 13 or 18 runs, not the baselines' 20 (which reuse their sets: trusted code); every child, the checked one
    included, warms up cfg.warmup + cfg.n_checks runs and protocol.SPLIT_WARMUP_MS at least (MAX_WARMUP runs at
    most; bench/big_verdict.py --budget-mb and --split-warmup-ms compare the paths), and each has its own limit
    (cfg.timeout), so a slow candidate holds the device up to SPLIT_CHILDREN limits (one more in a first profile).
  - reduced precision inside a kernel that stays within atol/rtol (and the RMS bound) passes, as in the paper.
  - the time includes making each output contiguous in row-major order, so an output that is a view (a
    transposed result) is copied whole inside the timed run, the reference's as much as the candidate's: eager's
    view pays a copy that KernelBench's timer would not charge, and a candidate that writes its result in that order
    saves it. Reading only the sampled elements through the view's strides would make a view free, and a candidate
    that returns a view of its input (x.t() for a task that transposes and copies) would do no work at all (reward
    3, tried).
  - the time includes a pipe round trip and the parent's reads (or two round trips and the sample's copy, where
    the child is told the sample): for tiny kernels the reward sees host
    overhead (bench/env_bench.py states this floor; bench/floor_diag.py splits it). Both sides poll for the timed
    messages instead of sleeping (the parent for a run's reply only on the GPU backend: on the CPU it would take a
    core from the kernel), so few scheduler wake-ups are on the clock's path. A timed run is one call of native code
    (protocol.timed_pair, through ctypes, which releases the interpreter's lock): from before the run's command is
    written to after the last sampled element has arrived, so the caller's other threads (train.py's generation loop,
    its tool calls) add no wait for the lock to it. It is the same for the candidate and both baselines, except the
    candidate's dispatch monitor (tens of microseconds a run).
  - a forked child shares the fork server's memory copy-on-write: the imported modules, and what the server read,
    the paths and environments of the children it forked (other verdicts' run folders by name, never their
    content, which the cache's cover hides); and its address-space layout and Python's hash secret, which only an
    exec draws again: every candidate forked from one server has the same addresses (libraries, heap, the objects
    the harness makes before ModelNew loads), so the in-process pointer arithmetic above needs no search once it
    has been learnt (random states are drawn again in each child).
  - where a layer is unavailable (no namespaces in some containers; an unprivileged uid only where the
    interpreter is reachable by it), isolation falls back to the rest; this is said once on stderr.
  - GPU memory is not capped per candidate on the CUDA backend (RLIMIT_AS breaks CUDA).
  - outputs whose RMS is below a tenth of the dtype's epsilon (1.2e-8 in float32: a softmax over ~80M columns):
    the floor that lets rounding noise around zero pass lets zeros pass too.
  - disk: the bash tool writes its workspace on the host's disk (1 GiB per file, any number of files, for
    its time limit); a child's stdout and stderr go to files of up to 1 GiB each.
  - the trainer's other threads still slow timed runs a little from outside their spans: the parent's work between
    runs (the next "load", the checks) waits for the interpreter's lock while they hold it, and a busy thread takes
    a core. Both pollers yield their core on every empty poll (a pipe's reader is woken on its writer's core, and a
    child polling on after its reply kept its woken parent waiting). On 2 cores, relu 64x4096: eager 0.6 ms quiet,
    0.9 ms beside a pure-Python loop (21 ms with the clock read in Python), 0.8 ms beside a thread that holds the
    lock 20 ms at a time (docs/results.md). Without a C compiler (/usr/bin/cc) the clock is read in Python and
    waits for the lock too (said on stderr; baselines are cached apart from the native clock's).
  - load from outside the policy's processes (other users of the machine) while a baseline is timed: a
    uniformly loaded machine gives a slow baseline with a small spread, and it is cached.
  - the device's state left by earlier work: a candidate (this verdict's checks on a task's first profile, or
    another verdict's) may keep the GPU busy for its time limits until just before a baseline is timed; a device
    that throttles for heat would give a slow, steady baseline, and it is cached.
  - a build sees the host's files read-only (the cache root hidden): `__has_include` tells it whether a file
    exists.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import math
import os
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

import protocol
import scan
from build import HEADER_EXT, SOURCE_EXT, build, error_excerpt, toolchain_id_light  # noqa: F401  (env.build: step 3)
from protocol import (CHILD_ENV, CHILD_THREADS, PIPE_BYTES, Child, ChildError, ChildTimeout, ReplyTooLarge,  # noqa: F401
                      _child_main, median, picks_of, recv, sample_of, send, spread, tensors_of, timed_runs,
                      unpack)  # steps 4-5 (env.Child ...)
from scan import ALLOWED_OPS, IMPORT_OPS, INIT_OPS  # noqa: F401  (env.IMPORT_OPS: what the module may import)
from reward import MARGIN, reward_for  # noqa: F401  (env.reward_for: the verdict's reward)
from sandbox import (CACHE_DIR, SandboxResult, candidate_alive, file_lock, gpu_lock_path, isolation, no_candidates,
                     run_sandboxed)


MAX_SOURCES, MAX_SOURCE_BYTES = 256, 8 << 20  # what one candidate's kernel sources may add up to
MODEL_NEW_BYTES = 256 << 10  # a ModelNew is a thin wrapper; its scan (linear, ~2 s at this size on a slow core) holds
# the trainer's GIL, and with it every pipe clock of the trainer's other threads


@dataclasses.dataclass
class Config:
    backend: str = "auto"  # auto | cuda | cpu
    timeout: float = 300.0  # wall clock for each child process of a verdict (a reference, a candidate)
    run_timeout: float = 30.0  # wall clock for one command of a loaded candidate (a run, a sample): a hang ends here
    load_timeout: float = 60.0  # wall clock for the candidate to load (model_new.py, ModelNew(), its weights)
    compile_timeout: float = 600.0  # wall clock for one build (nvcc with torch headers is slow)
    atol: float = 1e-2
    rtol: float = 1e-2
    n_checks: int = 5
    n_timed: int = 20  # timed runs, each on an input set of its own (unless the inputs exceed input_budget_mb)
    n_audits: int = 2  # extra runs among the timed ones whose WHOLE output is checked; their time is not counted
    warmup: int = 3  # untimed runs before the timed ones, at least ...
    warmup_ms: float = 0.0  # ... and until they add up to this many milliseconds (clocks leave their idle state)
    mem_gb: float = 16.0  # host memory limit of a candidate child
    stage: str = "profile"  # compile | verify | profile
    input_budget_mb: float = 1024.0  # distinct fresh input sets kept for timing


@dataclasses.dataclass
class Verdict:
    compiled: bool = False
    correct: bool = False
    reward: int = -1
    runtime_ms: float | None = None  # the median of the timed runs ...
    run_spread: float | None = None  # ... and their p90 / p10 (how noisy this measurement was)
    timed_children: int = 0  # candidate processes the timed runs were shared out over (protocol.timing_shares)
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
    phases: dict = dataclasses.field(default_factory=dict)  # seconds per step, in order (bench/env_bench.py's split)

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


def compile_caches(write: bool = True) -> tuple[dict, list[Path]]:
    """Environment and folders (to pass as writable) of the compile caches that trusted children (a task's
    reference, synth.py's filter) share and write: inductor's graphs, Triton's kernels, and the NVRTC kernels
    of jiterator ops (torch.special functions compile one on their first call, for seconds; without a shared
    folder every child compiles it again, because a child's HOME is its own folder). write=False (candidates):
    inductor's and Triton's to read, no folder to write, and no NVRTC one (torch warns on an unwritable one;
    the child's own HOME serves instead). Inductor compiles in the child's own process: a child compiles one
    graph, and inductor's default pool starts a process per core, each importing torch, in every reference
    child; with verdicts in flight that is expected to cost more than it saves (not measured in flight; an H100's
    fresh process: first compiled call 3.9 s with a pool of 16, 2.0 s without; a first verdict alone gains less
    than its noise; docs/results.md)."""
    dirs = {"TORCHINDUCTOR_CACHE_DIR": CACHE_DIR / "inductor", "TRITON_CACHE_DIR": CACHE_DIR / "triton"}
    if write:
        dirs["PYTORCH_KERNEL_CACHE_PATH"] = CACHE_DIR / "nvrtc"
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return {**{k: str(v) for k, v in dirs.items()}, "TORCHINDUCTOR_COMPILE_THREADS": "1"}, list(dirs.values()) if write else []



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
    tree = scan.parse_python(problem_code)  # raises SyntaxError on a broken problem file
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
    tree = scan.parse_python(problem_code)
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    model.name = "ModelNew"
    for fn in model.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
            args = [a.arg for a in fn.args.args[1:]]
            fn.body = [scan.parse_python(f"return cuda_extension.forward({', '.join(args + ['*self.parameters()'])})").body[0]]
    consts = [n for n in tree.body if isinstance(n, ast.Assign)]
    body = keep + [scan.parse_python("import cuda_extension").body[0]] + consts + [model]
    return STARTER_DOC + ast.unparse(ast.Module(body=body, type_ignores=[])) + "\n"


def collect(workspace: Path, backend: str) -> tuple[dict, list]:
    """The files that make up a candidate: {relative path: text}. Everything else is ignored."""
    files, notes = {}, []
    for d in (workspace, workspace / "kernels"):
        if d.is_symlink() or (d.exists() and d.resolve() != workspace.resolve() / d.relative_to(workspace)):
            raise ValueError(f"{d.relative_to(workspace)} is a symbolic link; kernels/ must be a folder inside the workspace")
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
            # In all, too: the bash tool can leave any number of files, and they are read here, in the trainer.
            if len(files) >= MAX_SOURCES or sum(map(len, files.values())) + f.stat().st_size > MAX_SOURCE_BYTES:
                raise ValueError(f"the kernel sources are more than {MAX_SOURCES} files or {MAX_SOURCE_BYTES >> 20} MiB in all")
            files[str(f.relative_to(workspace))] = f.read_text(errors="replace")
    return files, notes


def static_scan(files: dict, model_new: str) -> tuple[list, list]:
    """(violations, hints) of model_new.py against scan.py's allow-list. The kernel sources are checked after
    preprocessing, inside build(), where macros and includes are resolved."""
    return scan.check_python(model_new), []


# ----------------------------------------------------------------------------------------------
# Trusted in-process timing (synth.py's filter, evaluate.py's reference table); verdicts use protocol.py's
# pipe clock
# ----------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------
# Compare (in the parent, which never runs candidate code)
# ----------------------------------------------------------------------------------------------
RMS_FLOOR = 0.1  # x the output dtype's epsilon: an RMS error this small is rounding noise of values below 1


GPU_COMPARE = 1 << 24  # elements from which this process compares on its own GPU, where it has one, in chunks of 4M


def _compare_on() -> torch.device | None:
    """The GPU this process compares large outputs on (None: the CPU). On an H200 host the CPU's 32K-element chunks
    of a 537M-element output run on one core (such a verdict's checks take over 270 s);
    on the GPU a comparison takes about as long as copying the chunks there. Only outputs of at least GPU_COMPARE
    elements go there, so small verdicts (and processes that fork, like synth.py's workers) never start CUDA for it."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _close_and_rms(o, r, atol, rtol, chunk=1 << 15, count=True, device=None):
    """One pass over two flat tensors, in float64 (complex128) chunks that stay in cache, so that comparing GB-sized
    outputs costs a fraction of a second, not seconds and a float64 copy of both. A chunk is one ATen grain (32,768
    elements), so every op runs on this thread: on a loaded machine, ops split over the intra-op pool wait for a
    preempted worker at each of thousands of barriers (64M elements: 0.6 s in 32K chunks, 6-9 s in 64K chunks,
    2 cores under load). With `device` (a GPU), each chunk is copied there first: the same decisions, the same
    figures up to the order of the float64 sums. Returns (values not close as
    torch.isclose(equal_nan=True) decides, the largest |o - r| among those (NaN counts as inf), RMS of o - r and RMS
    of r over the elements finite in both (None when there is none)). count=False: stops at the first chunk with a
    value that is not close (the count and the figures then cover the chunks read so far)."""
    wide = torch.complex128 if r.is_complex() else torch.float64
    bad, diff, se, sr, nf = 0, 0.0, 0.0, 0.0, 0
    for i in range(0, r.numel(), chunk):
        a, b = o[i:i + chunk].to(device or "cpu").to(wide), r[i:i + chunk].to(device or "cpu").to(wide)
        d = a - b
        # (an infinite d, as from inf against -inf, would pass |d| <= inf: non-finite values take the exact test below)
        ok = (d.abs() <= b.abs() * rtol + atol) & d.isfinite()
        if not bool(ok.all()):
            ok |= torch.isclose(a, b, atol=atol, rtol=rtol, equal_nan=True)
            n_bad = int((~ok).sum())
            if n_bad:
                bad += n_bad
                diff = max(diff, d[~ok].abs().nan_to_num(float("inf")).max().item())
                if not count:
                    break
            fin = torch.isfinite(a) & torch.isfinite(b)
            d, b = d[fin], b[fin]
        nf += b.numel()
        se += float(d.abs().square().sum())
        sr += float(b.abs().square().sum())
    return bad, diff, (math.sqrt(se / nf) if nf else None), (math.sqrt(sr / nf) if nf else None)


def compare(out, ref, atol, rtol, what: str, count: bool = True) -> str | None:
    """None if `out` matches `ref` exactly in structure/shape/dtype and is close at two scales: every element
    within atol + rtol*|ref| (torch.isclose), AND the RMS error within rtol of the reference's own RMS (or
    RMS_FLOOR x the dtype's epsilon: 1.2e-8 in float32). The second check is what makes a check able to fail when
    every reference value is below atol (a softmax over 100k columns): an all-zero answer has an RMS error equal
    to the reference's RMS, which in float32 passes only below 1.2e-8 (a softmax over ~80M columns).
    count=False: the answer only (None or not), found at the first chunk that differs."""
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            return f"{what}: output structure differs (expected a sequence of {len(ref)})"
        for i, (o, r) in enumerate(zip(out, ref)):
            err = compare(o, r, atol, rtol, f"{what}[{i}]", count)
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
        gpu = _compare_on() if ref.numel() >= GPU_COMPARE else None
        bad, diff, err, scale = _close_and_rms(out.reshape(-1), ref.reshape(-1), atol, rtol, count=count,
                                               **(dict(chunk=1 << 22, device=gpu) if gpu else {}))
        if bad:
            return f"{what}: {bad}/{ref.numel()} values differ (max abs diff among them {diff:.3g}, atol={atol}, rtol={rtol})"
        if scale is not None and err > rtol * scale + RMS_FLOOR * torch.finfo(ref.dtype).eps:
            return (f"{what}: RMS error {err:.3g} is {err / max(scale, 1e-30):.0%} of the reference's RMS {scale:.3g} "
                    f"(allowed {rtol:.0%}): the values are at the wrong scale even where each is within atol")
        return None
    # a Python value (None, bool, int, float): the same type and value (`tensor == 3` is a tensor, and True == 1)
    same = type(out) is type(ref) and (out == ref or (isinstance(ref, float) and math.isnan(ref) and math.isnan(out)))
    return None if same else f"{what}: expected {ref!r}, got {'a tensor' if isinstance(out, torch.Tensor) else repr(out)[:80]}"



# ----------------------------------------------------------------------------------------------
# evaluate(): the one scorer used by agent.py, train.py, evaluate.py and synth.py
# ----------------------------------------------------------------------------------------------
NOISY = 1.10  # a cached baseline whose runs spread more than this (p90/p10) is measured again next time


def evaluate(workspace, backend: str = "auto", reference: str | None = None, cfg: Config | None = None, **overrides) -> Verdict:
    """Compile, verify, profile and reward one workspace. `reference` (the task's code) overrides
    the workspace's model.py, so an agent that edits model.py changes nothing but gets a violation."""
    cfg = dataclasses.replace(cfg or Config(), **overrides)
    t_start = time.monotonic()
    ws = Path(workspace)
    backend = resolve_backend(backend if backend != "auto" else cfg.backend)
    if not (math.isfinite(cfg.warmup_ms) and cfg.warmup_ms >= 0):
        raise UsageError(f"warmup_ms must be a finite number >= 0, not {cfg.warmup_ms}")
    if not ws.is_dir():
        raise UsageError(f"no such workspace: {ws}")
    if reference is None and not (ws / "model.py").is_file():
        raise UsageError(f"{ws} has no model.py")
    v = Verdict(backend=backend, stage="scan")
    lap = _lap_timer(v.phases)

    def done():
        v.seconds = round(time.monotonic() - t_start, 3)
        return v

    ref_code = reference if reference is not None else (ws / "model.py").read_text()
    if reference is not None and (ws / "model.py").is_file() and (ws / "model.py").read_text() != reference:
        v.violations.append("model.py was modified; the reference is read-only")
    if not (ws / "model_new.py").is_file():
        v.error = "model_new.py is missing"
        return done()
    if (ws / "model_new.py").is_symlink() or (ws / "model.py").is_symlink():  # (its target would be read, and quoted)
        v.error = "model_new.py and model.py must be files in the workspace, not symbolic links"
        return done()
    if (ws / "model_new.py").stat().st_size > MODEL_NEW_BYTES:  # (read, parsed and scanned here, in the trainer's GIL)
        v.error = f"model_new.py is larger than {MODEL_NEW_BYTES >> 10} KiB"
        return done()
    try:
        files, notes = collect(ws, backend)
    except (ValueError, UnicodeDecodeError) as e:
        v.error = str(e)
        return done()
    v.warnings += notes
    model_new = (ws / "model_new.py").read_text(errors="replace")
    try:
        scan.parse_python(model_new)
        bad, v.hints = static_scan(files, model_new)
    except SyntaxError as e:
        v.error = f"model_new.py line {e.lineno}: SyntaxError: {e.msg}"
        return done()
    except Exception as e:  # noqa: BLE001  (nested too deeply for the parser, ...): the policy's own -1, never a crash
        v.error = f"model_new.py could not be checked: {type(e).__name__}: {str(e)[:200]}"  # (which the trainer would
        return done()  # take for a harness failure and leave out of the batch: a way out of every -1)
    v.violations += bad
    lap("scan")
    if v.violations:
        return done()

    v.stage = "compile"
    b = build(files, backend, cfg.compile_timeout)
    lap("build")
    v.compiled, v.log = b.ok, b.log
    v.violations += b.violations
    if not b.ok:
        v.error = "the kernel sources use what is not allowed" if b.violations else "compilation failed"
        return done()
    if cfg.stage == "compile":
        return done()
    v.stage = "verify"
    try:
        _check_and_time(v, ref_code, model_new, b.so_path, backend, cfg, lap)
    except ChildError as e:  # noqa: PERF203
        v.error = str(e)
    if v.error or v.violations:
        v.correct, v.reward = False, -1
    return done()


def _lap_timer(phases: dict):
    """lap(name) records the seconds since the previous lap under `name`."""
    last = [time.monotonic()]

    def lap(name):
        now = time.monotonic()
        phases[name] = round(phases.get(name, 0.0) + now - last[0], 3)
        last[0] = now
    return lap


def _check_and_time(v: Verdict, ref_code: str, model_new: str, so_path: Path, backend: str, cfg: Config, lap):
    """Steps 4-6 of a verdict, filling `v`. A reference child computes every output and ends; then the candidate
    child starts, and gets nothing but its own inputs. Where the task's baselines are not cached (or are noisy, 3
    measurements at most), the candidate is checked, stopped, the baselines are timed with no candidate alive, and a
    fresh candidate child is timed. Where the budget holds fewer sets than runs, the timed runs are shared out
    (drive)."""
    timed = cfg.stage == "profile"
    rng = secrets.SystemRandom()
    seed0 = rng.randrange(2**31)
    check_seeds = [rng.randrange(2**31) for _ in range(cfg.n_checks)]
    # one set more than the timed runs: the warm-up's (protocol.timed_runs)
    timed_seeds = [rng.randrange(2**31) for _ in range(max(cfg.n_timed, 2) + cfg.n_audits + 1)] if timed else []
    common = dict(backend=backend, seed0=seed0)

    with tempfile.TemporaryDirectory(prefix="run-", dir=CACHE_DIR) as run, contextlib.ExitStack() as stack:
        run = Path(run)
        (run / "ref").mkdir()
        (run / "ref" / "model.py").write_text(ref_code)

        def candidate_folder(name):  # each candidate child gets a folder of its own, made from our copies
            (run / name / "ext").mkdir(parents=True)
            (run / name / "model.py").write_text(ref_code)  # the task itself, which the candidate may read
            (run / name / "model_new.py").write_text(model_new)
            shutil.copy(so_path, run / name / "ext" / "cuda_extension.so")
            return run / name

        extra, writable = compile_caches()
        # The reference's outputs load the device like a candidate does: no other verdict times a baseline meanwhile
        # (in training many rollouts of one task reach this together, and the first one's baselines are cached).
        ref_busy = stack.enter_context(contextlib.ExitStack())
        lap("reference start")  # (the run folder's set-up counts with the reference's start)
        ref_busy.enter_context(candidate_alive(backend))
        lap("wait device")  # every wait for a device lock or the baselines' gate: bench/env_bench.py --workers

        def start_reference(seeds, n_checks, outputs=True):
            spec = dict(common, mode="reference", reference=str(run / "ref" / "model.py"), seeds=seeds, n_checks=n_checks,
                        budget_mb=cfg.input_budget_mb, outputs=outputs)
            return stack.enter_context(_closing(Child(spec, run / "ref", backend, cfg, writable=writable, env=extra)))

        ref = start_reference(check_seeds + timed_seeds, len(check_seeds))

        def start_candidate(hold, within, folder="cand"):
            within.enter_context(hold)  # the device, held by us and released after the child is gone
            d = candidate_folder(folder)
            spec = dict(common, mode="candidate", reference=str(d / "model.py"),
                        model_new=str(d / "model_new.py"), ext_dir=str(d / "ext"), cand_dir=str(d))
            child = within.enter_context(_closing(Child(spec, d, backend, cfg)))  # no shared cache of any kind
            child.folder = d
            return child

        fresh = (f"cand{i}" for i in itertools.count(3))  # ("cand" and "cand2" are the first two children's)

        def drive(cand, checks: bool, timed: bool) -> bool:
            """Checks and/or timed runs of the candidate; False when the verdict is decided (v says how). Where the
            budget holds fewer sets than runs (protocol.timing_shares), the runs are shared out over `cand` and fresh
            children of the same files, one after another, each timed on a fresh batch of sets: no input set is met
            twice, by one process or by two (whatever channel they might share: env.py's docstring)."""
            shares = (protocol.timing_shares(cfg, len(timed_seeds)) or [None]) if timed else [None]
            seeds, outs, ins, times = timed_seeds, ref_timed, inputs, []
            for j, share in enumerate(shares):
                if j:  # the last child is gone, with its device memory and its folder, before the next one starts
                    cand.close()
                    shutil.rmtree(cand.folder, ignore_errors=True)
                    if ins is not None:
                        ins.close()
                    batch = fresh_batch(len(timed_seeds))
                    if batch is None:
                        return False
                    seeds, outs, ins = batch
                    # (each child has a time limit of its own, as the timed child of a first profile has: the waits
                    # for the device between them are the harness's, which no candidate may be charged for)
                    cand = start_candidate(contextlib.nullcontext(), stack, next(fresh))  # (the device is ours)
                # Every child warms up as many runs as the checked one had before its timed runs (its checks and
                # its warm-up), and for protocol.SPLIT_WARMUP_MS at least: fewer leave a fresh child's first timed
                # run slower
                share_cfg = cfg if share is None else dataclasses.replace(
                    cfg, n_timed=share[0], n_audits=share[1], warmup=cfg.warmup + cfg.n_checks,
                    warmup_ms=max(cfg.warmup_ms, protocol.SPLIT_WARMUP_MS))
                got = drive_one(cand, checks and not j, seeds if timed else [], outs, ins, share_cfg,
                                None if share is None else rng.randrange(2**31))
                if got is None:
                    return False
                times += got
            if timed:
                v.runtime_ms, v.run_spread, v.timed_children = median(times), spread(times), len(shares)
                lap("timed runs")
            return True

        def fresh_batch(n_sets: int):
            """(seeds, reference outputs, TimedInputs or None) of n_sets new input sets, from a reference child of their
            own that has ended before any candidate child of them starts; None when the verdict is decided."""
            seeds = [rng.randrange(2**31) for _ in range(n_sets)]
            batch_ref = start_reference(seeds, 0)
            try:
                if batch_ref.answer()[0]["timed_sets"] != n_sets:
                    raise ValueError("the reference drew another number of input sets")
                outs = [unpack(*batch_ref.answer()) for _ in seeds]
                ins = None
                if inputs is not None:  # (written by this process where the first batch's were)
                    ins = stack.enter_context(contextlib.closing(protocol.TimedInputs(backend)))
                    try:
                        ins.take(batch_ref, seeds)
                    except protocol.InputsDiffer:
                        ins = None
            except protocol.DeviceFull as e:
                v.error = f"{e}: the device is full"
                return None
            except (EOFError, ValueError, KeyError, TypeError, ChildError) as e:
                v.error = f"the reference model.py failed: {batch_ref.why_dead() if isinstance(e, EOFError) else e}"
                return None
            finally:
                batch_ref.close()
            lap("reference outputs")
            return seeds, outs, ins

        def drive_one(cand, checks: bool, seeds: list, outs: list, ins, share_cfg: Config, warm_seed) -> list | None:
            """One candidate child's checks and/or timed runs (on `seeds`, whose reference outputs are `outs` and
            inputs `ins`; as many as share_cfg says): their times, or None when the verdict is decided."""
            # a reply may not declare more than twice the largest reference output (a candidate cannot exhaust our memory)
            cand.reply_limit = 2 * max(sum(t.numel() * t.element_size() for t in tensors_of(o)) for o in ref_outs) + (1 << 20)
            try:
                times = _drive_candidate(v, cand, check_seeds if checks else [], ref_checks if checks else [],
                                         seeds, outs, share_cfg, backend, lap, ins, warm_seed)
            except ChildTimeout as e:
                v.error, v.log = f"ModelNew timed out: {e}", ""
            except ReplyTooLarge as e:  # (read no further: the reply is left unread)
                shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors_of(ref_outs[0]))
                v.error, v.log = (f"a reply of the candidate is {e.nbytes:,} bytes, over the {e.limit:,} it may send (its "
                                  f"outputs may take about twice the reference's, shape {shapes}): check the shape of "
                                  f"what forward returns"), ""
            except protocol.DeviceFull as e:
                v.error, v.log = f"{e}: the device is full", ""
            except (EOFError, ValueError, TypeError, KeyError, AttributeError) as e:
                dead = cand.why_dead() if not cand.thread.is_alive() or isinstance(e, EOFError) else None
                v.error = f"ModelNew {dead}" if dead else f"the candidate process sent a malformed reply ({type(e).__name__}: {e})"
                v.log = ""
            except protocol.HarnessError:
                raise  # (ours, not the candidate's)
            except Exception as e:  # noqa: BLE001 - whatever else a reply provokes while judged is the candidate's -1:
                # an exception out of evaluate() counts as the harness's failure, and its episode is left out of training
                v.error, v.log = f"the candidate's reply could not be judged ({type(e).__name__}: {str(e)[:300]})", ""
            return None if v.error or v.violations else times

        # the timed runs' inputs, held here and written into a child just before each run (freed after every child)
        inputs = stack.enter_context(contextlib.closing(protocol.TimedInputs(backend)))
        # The candidate child takes over the reference's hold of the device (`first`): a holder never waits for the
        # gate (a waiting baseline holds the gate and waits for every holder).
        first, first_msg = stack.enter_context(contextlib.ExitStack()), None
        try:
            if backend not in protocol._READS:  # decided once per process, before any candidate of it is alive (a
                with protocol.DECIDING:         # candidate filling the device must not choose the sample exchange)
                    first_msg = ref.answer()[0]
                    protocol.probe_reads(ref, first_msg.get("probe"))
        except (EOFError, ValueError, KeyError, TypeError, ChildError) as e:
            v.error = f"the reference model.py failed: {ref.why_dead() if isinstance(e, EOFError) else e}"
            return
        try:
            first_msg = first_msg or ref.answer()[0]
            lap("reference start")  # (its process, model and input sizes)
            n_sets = first_msg["timed_sets"]
            timed_seeds = timed_seeds[:n_sets]
            ref_outs = [unpack(*ref.answer()) for _ in check_seeds + timed_seeds]
            lap("reference outputs")  # (computed, and moved to this process)
            if timed and protocol.reads(backend):
                try:
                    inputs.take(ref, timed_seeds)
                except protocol.InputsDiffer:  # (each child loads each set itself: timed_runs)
                    inputs = None
                except protocol.DeviceFull as e:
                    v.error = f"{e}: the device is full"
                    return
            else:
                inputs = None
        except (EOFError, ValueError, KeyError, TypeError, ChildError) as e:
            v.error = f"the reference model.py failed: {ref.why_dead() if isinstance(e, EOFError) else e}"
            return
        ref_checks, ref_timed = ref_outs[:len(check_seeds)], ref_outs[len(check_seeds):]
        lap("timed inputs")  # (the timed runs' input sets, taken from the reference into buffers of ours)
        timing = (f"timing-{protocol.TIMING_VERSION}-{'native' if protocol.native() else 'python'}-"
                  f"{'reads' if protocol.reads(backend) else 'sample'}")  # (how the runs are driven, clocked, checked)
        base_key = hashlib.sha256(f"{ref_code}\0{backend}\0{toolchain_id_light(backend)}\0{cfg.n_timed}\0"
                                  f"{cfg.warmup}\0{float(cfg.warmup_ms)}\0{protocol.MAX_WARMUP}\0"
                                  f"{sorted(CHILD_ENV.items())}\0{timing}".encode()).hexdigest()[:24]
        base_file = CACHE_DIR / "baselines" / f"{base_key}.json"
        cached = json.loads(base_file.read_text()) if base_file.exists() else None
        # Re-measured while noisy, up to 3 times; the least noisy measurement is kept.
        need_baselines = timed and (cached is None or (max(cached["spread"]) > NOISY and cached["attempts"] < 3))
        ref.close()
        # The candidate starts only now: no candidate child lives beside a reference child of its verdict, which
        # holds every secret of it (on a GPU it has exported each timed set through a CUDA IPC handle, which a
        # process on the device may guess, and the candidate's native code runs from its import on)
        cand = start_candidate(ref_busy.pop_all(), first)
        if not need_baselines:  # the usual case: one child, checked and timed
            if not drive(cand, checks=True, timed=timed) or not timed:
                return
        else:
            # A task's first profile: the candidate is checked first, so a wrong one costs no baselines (torch.compile's
            # compile and ~40 timed runs: most of a first verdict). Baselines are timed while no candidate is alive,
            # so a correct candidate's child is stopped, and a fresh child of the same files serves the timed runs
            # (each sampled, two read in full at random, the last in full: the checks one child would get).
            if not drive(cand, checks=True, timed=False):
                return
            first.close()  # the candidate is gone, and our hold of the device with it
            try:
                # torch.compile compiles at its first run (seconds of CPU work): here, while the device is not held
                with candidate_alive(backend):  # for timing and no other verdict waits on us
                    lap("wait device")  # (and the checked candidate's exit)
                    # a reference child of its own for the baselines: no outputs, only the timed sets' inputs
                    ref = start_reference(timed_seeds, 0, outputs=False)
                    if ref.answer()[0]["timed_sets"] != len(timed_seeds):
                        raise ValueError("the baselines' reference drew other input sets")
                    ref.ask({"op": "use", "fn": "compile"})
                    ref.ask({"op": "load", "seed": timed_seeds[0]})
                    ref.ask({"op": "run"})
                lap("baseline compile")  # (the baselines' reference child and torch.compile's compile)
                with no_candidates(backend), file_lock(gpu_lock_path(backend)):
                    lap("wait device")
                    times = {}
                    for name in ("eager", "compile"):
                        ref.ask({"op": "use", "fn": name})
                        times[name] = timed_runs(ref, timed_seeds, cfg, inputs=inputs)
            except (EOFError, ValueError, KeyError, TypeError, ChildError) as e:
                v.error = f"the reference model.py failed while timed: {ref.why_dead() if isinstance(e, EOFError) else e}"
                return
            new = {"eager_ms": median(times["eager"]), "compile_ms": median(times["compile"]),
                   "spread": [round(spread(times["eager"]), 4), round(spread(times["compile"]), 4)]}
            if cached is not None and max(cached["spread"]) < max(new["spread"]):
                new = dict(cached)
            cached = dict(new, attempts=(cached or {}).get("attempts", 0) + 1)
            base_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = base_file.with_suffix(f".{uuid.uuid4().hex}.tmp")
            tmp.write_text(json.dumps(cached))
            os.replace(tmp, base_file)
            ref.close()
            lap("baselines")
            stack.enter_context(candidate_alive(backend))
            lap("wait device")
            cand = start_candidate(contextlib.nullcontext(), stack, "cand2")  # (the hold above is released after it)
            if not drive(cand, checks=False, timed=True):
                return
        v.eager_ms, v.compile_ms = cached["eager_ms"], cached["compile_ms"]
        v.speedup_eager, v.speedup_compile = v.eager_ms / v.runtime_ms, v.compile_ms / v.runtime_ms
        v.reward = reward_for(True, v.runtime_ms, v.eager_ms, v.compile_ms)


def _drive_candidate(v, cand, check_seeds, ref_checks, timed_seeds, ref_timed, cfg, backend, lap, inputs=None,
                     warm_seed=None) -> list | None:
    """Checks, then timed runs (cfg.n_timed, cfg.n_audits; warm_seed: timed_runs'): the runs' times, [] with no timed
    runs, None when the verdict is decided (v says how)."""
    cand.cmd_timeout = cfg.load_timeout  # (a hang in ModelNew.__init__ would otherwise hold the device for `timeout`)
    obj, _ = cand.answer()  # "ready", or the error that stopped model_new.py from loading
    cand.cmd_timeout = cfg.run_timeout  # (loading may take long; each command after it may not)
    lap("candidate start")
    if not isinstance(obj, dict) or obj.get("ready") is not True or not isinstance(obj.get("init_ops"), list) \
            or not isinstance(obj.get("state"), list):
        raise ValueError("no ready message")
    if obj["state"]:
        v.violations.append(_state_violation(obj["state"]))
        return None
    if obj["init_ops"]:
        v.violations.append("PyTorch compute ops ran while model_new.py loaded or ModelNew was built: " + ", ".join(
            f"aten.{n}" for n in map(str, obj["init_ops"][:8])) + " (only allocation, random initialisation and copies)")
        return None
    cand.ask({"op": "use", "fn": "candidate"})
    for i, seed in enumerate(check_seeds):
        cand.ask({"op": "load", "seed": seed})
        cand.ask({"op": "run"})
        bad, v.error = _judge_full(cand, ref_checks[i], cfg, backend, f"check {i + 1}/{cfg.n_checks}", lap, "checks")
        v.violations += bad
        if v.violations or v.error:
            return None
    if len(ref_checks) > 1 and all(compare(r, ref_checks[0], 0, 0, "", count=False) is None for r in ref_checks[1:]):
        v.warnings.append("the reference output is the same for every input: this task is degenerate")
    v.correct, v.reward = True, 1
    lap("checks")
    if not timed_seeds:
        return []
    v.stage = "profile"

    why = "outputs are wrong when inputs change in place (cached by pointer, or work skipped?)"

    def check(k, values, where):  # every timed run's sampled output, against the reference's full output
        try:
            err = compare(values, picks_of(ref_timed[k], where), cfg.atol, cfg.rtol, "a timed run")
        except ValueError as e:  # (a shape or dtype that is not the reference's)
            err = f"a timed run: {e}"
        if err:
            raise Rejected(f"{err}: {why}")

    def audit(k):  # a timed run read in full, with every check of the check runs
        bad, err = _judge_full(cand, ref_timed[k], cfg, backend, "a timed run (read in full)", lap, "timed runs")
        if bad or err:
            v.violations += bad
            raise Rejected(f"{err}: {why}" if err else "")

    try:
        with file_lock(gpu_lock_path(backend)):
            lap("wait device")
            times = timed_runs(cand, timed_seeds, cfg, check, audit, inputs, warm_seed=warm_seed)
    except Rejected as e:
        v.error = str(e) or None
        return None
    # the monitor's record of every timed run (and the last run's whole output, inputs and types)
    last = (cfg.n_timed + cfg.n_audits - 1) % len(timed_seeds)
    bad, v.error = _judge_full(cand, ref_timed[last], cfg, backend, "the timed runs", lap, "timed runs")
    v.violations += bad
    if v.violations or v.error:
        return None
    return times


def _state_violation(what: list) -> str:
    return (f"{', '.join(map(str, what[:4]))} changed PyTorch's dispatch state (the keys the dispatch monitor sees "
            "operators through); a kernel leaves it as it found it")


def _judge_full(cand: Child, ref, cfg: Config, backend: str, what: str, lap, phase: str) -> tuple[list, str | None]:
    """Asks for the last run's whole output and its monitor record; returns (violations, error). The comparison's
    seconds go to the phase "compare", the rest since the last lap to `phase` (a verdict of GB-sized outputs is
    mostly these two: moving the outputs and comparing them)."""
    obj, blobs = cand.ask({"op": "full"}, reuse=True)  # (judged here and dropped before its next full reply)
    if not isinstance(obj, dict) or not isinstance(obj.get("ops"), list) or not isinstance(obj.get("state"), list):
        raise ValueError("bad full reply")
    bad = [_state_violation(obj["state"])] if obj["state"] else []
    if obj["ops"]:
        bad.append(f"PyTorch compute ops ran inside ModelNew.forward ({what}): " + ", ".join(
            f"aten.{n}" for n in map(str, obj["ops"][:8])) + " (only allocation, views and cuda_extension may be used)")
    if obj.get("mutated") is not False:
        bad.append("ModelNew.forward mutated its inputs")
    if obj.get("types"):
        bad.append(f"output is a {obj['types'][0]}, not a plain torch.Tensor")
    if bad:
        return bad, None
    if obj.get("devices"):
        return [], f"output is on {obj['devices'][0]}, expected {backend}"
    out = unpack(obj.get("out"), blobs)
    lap(phase)
    err = compare(out, ref, cfg.atol, cfg.rtol, what)
    lap("compare")
    return [], err


class Rejected(Exception):
    """A timed run's output did not match."""


@contextlib.contextmanager
def _closing(child: Child):
    try:
        yield child
    finally:
        child.close()


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
    if len(sys.argv) == 3 and sys.argv[1] == "_child":
        _child_main(sys.argv[2])
    else:
        sys.exit(main())
