"""Red-team cases against env.py on the CPU backend: a cheat or a fault per class, each of which must be rejected (or
handled) for the reason its comment gives. Workspaces are built the way tests/test_env.py builds them (make_ws,
model_new), with tests/env_cases/ops.cpp as the (cached) kernel source."""
import ctypes
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import pytest

import env
from test_env import OPS, PROBLEMS, make_ws, model_new  # noqa: F401


# ------------------------------------------------------------------ 1. Python computes where the monitor cannot see
# Tensor.map2_(a, b, fn) calls a Python callable once per element, in C++ code that never enters the dispatcher: the
# dispatch monitor records no operator. A ModelNew whose forward computes relu(x * scale) element by element in a
# method of its own would be correct with no kernel doing any work (reward +1, runtime 69 ms). A method called on a
# value must be the file's own, an ATen operator's name, or metadata/nn.Module API (scan.SAFE_METHODS).
MAP2 = model_new("relu", "out",
                 init_extra="pass\n\n    def f(self, o, a, b):\n        return max(a * b, 0.0)").replace(
    "        return out", "        out = torch.empty_like(x)\n"
                          "        out.map2_(x, self.scale.detach().expand_as(x), self.f)\n"
                          "        return out")


def test_redteam_python_fallback_through_map2_is_refused(tmp_path):
    assert "map2_" in MAP2 and "def f(self, o, a, b)" in MAP2, MAP2
    v = env.evaluate(make_ws(tmp_path, "relu", MAP2), backend="cpu", stage="verify")
    assert v.reward == -1 and not v.correct, v.summary()


# ------------------------------------------------------------------ 2. a hang while loading is under no command deadline
# One line of allowed Python (`while True: pass` in __init__) keeps the candidate alive, and candidate_alive held: every
# new task's baseline waits for it, and while that baseline holds the gate, every other verdict on the device waits
# too. Loading has a deadline of its own (Config.load_timeout), not only the verdict's wall clock (Config.timeout,
# 300 s). (A fork-served candidate is ready in ~2 s here.)
HANG_IN_INIT = model_new("relu", "cuda_extension.relu_scale(x, self.scale)", init_extra="while True:\n            pass")


def test_redteam_a_hang_while_loading_is_stopped_at_a_deadline(tmp_path):
    t0 = time.monotonic()
    v = env.evaluate(make_ws(tmp_path, "relu", HANG_IN_INIT), backend="cpu", stage="verify", run_timeout=3, timeout=120)
    took = time.monotonic() - t0
    assert v.reward == -1 and v.error, v.summary()
    assert took < 80, f"a candidate hanging in ModelNew.__init__ was alive (holding the device) for {took:.0f} s"


# ------------------------------------------------------------------ 3. a reply sent byte by byte is under no command deadline
# A child that writes one byte every 0.2 s (a header length of 1 MiB, then JSON blanks) is never quiet for 0.5 s: a
# deadline checked only when the pipe is quiet is never reached, and the parent reads on until the verdict's wall
# clock (in a timed run, holding the device's timing lock as long). protocol._read_exact asks alive(), which carries
# the command's deadline, before every read. The kernel reaches the reply pipe through stdio (env.py's docstring: a
# FILE whose descriptor field it sets; here by its offset, no banned token), and needs no nonce: it never completes a
# message.
CASES = env.Path(__file__).resolve().parent / "redteam_cases"
TAKEOVER = (CASES / "takeover.h").read_text()  # (how the kernels of 12-15 reach the harness's Python)


def test_redteam_recv_keeps_its_deadline_while_bytes_trickle():
    import os
    import threading
    import protocol
    r, w = os.pipe()
    stop = threading.Event()

    def trickle():
        os.write(w, ((1 << 20) - 1).to_bytes(8, "little") + (0).to_bytes(8, "little"))
        for _ in range(80):  # 8 s of it, then silence (past which even today's recv gives up)
            if stop.wait(0.1):
                break
            os.write(w, b" ")
    threading.Thread(target=trickle, daemon=True).start()
    deadline = time.monotonic() + 1.0
    t0 = time.monotonic()
    try:
        with pytest.raises(EOFError):
            protocol.recv(r, alive=lambda: True, expect="nonce", deadline=deadline)
    finally:
        stop.set()
        took = time.monotonic() - t0
        os.close(w)
        os.close(r)
    assert took < 5, f"recv ran {took:.0f} s past a 1 s deadline"


def test_redteam_a_kernel_trickling_bytes_is_stopped_at_the_run_deadline(tmp_path):
    src = model_new("relu", "cuda_extension.trickle(x)")
    ws = make_ws(tmp_path, "relu", src, {"ops.cpp": (CASES / "trickle.cpp").read_text()})
    t0 = time.monotonic()
    v = env.evaluate(ws, backend="cpu", stage="verify", run_timeout=3, timeout=60)
    took = time.monotonic() - t0 - v.phases.get("build", 0)
    assert v.compiled and v.reward == -1, v.summary()
    assert "took longer than 3 s" in (v.error or "") and took < 40, (took, v.summary())


# ------------------------------------------------------------------ 4. a model_new.py that crashes the scan: the harness's -1
# A deep attribute chain (`X = nn.b.b.b...`, 5000 deep) raises RecursionError in ast.parse itself, a 1000-deep one in
# the scan. Were the exception to leave env.evaluate, agent.py's final scoring would turn it into "final evaluation
# failed: RecursionError: ...", which rollouts.harness_failed counts as the HARNESS's failure: the episode neither
# trained on nor counted in the reward. A policy that expects a -1 could append one line to model_new.py and have its
# failure dropped from the batch instead of penalised. Any exception of the scan is the policy's own -1.
@pytest.mark.parametrize("depth", [1000, 5000])
def test_redteam_a_model_new_that_crashes_the_scan_is_the_policys_own_minus_one(tmp_path, depth):
    import rollouts
    src = model_new("relu", "cuda_extension.relu_scale(x, self.scale)") + "\nX = nn" + ".b" * depth + "\n"
    try:
        v = env.evaluate(make_ws(tmp_path, "relu", src), backend="cpu", stage="compile")
    except Exception as e:  # noqa: BLE001  - what agent.py's final() does with it
        v = env.Verdict(backend="cpu", error=f"final evaluation failed: {type(e).__name__}: {e}")
    assert v.reward == -1 and not rollouts.harness_failed({"verdict": v.to_dict()}), v.error


# ------------------------------------------------------------------ 5. the parent's scan holds the trainer's GIL for minutes
# The scan of model_new.py runs in the TRAINER's process (agent.py runs every tool call and every final verdict in a
# thread pool), outside every lock, and every other thread's pipe clock waits for the GIL at each exchange meanwhile.
# A scan quadratic in an attribute chain's depth (an unparse per Attribute node) took 154 s for 1 MiB of
# `Y = nn.b.b...b` lines, and a new task's baselines timed in another thread during it came out 25x slow (eager
# 0.68 -> 17.3 ms), cached, so a kernel 2x slower than eager got reward +3. The scan is linear (one walk, no unparse
# per node).
SLOW_SCAN = model_new("relu", "cuda_extension.relu_scale(x, self.scale)") + ("Y = nn" + ".b" * 250 + "\n") * 80


def test_redteam_the_python_scan_is_not_quadratic():
    import scan
    scan.check_python("import torch\n")  # (its first call imports torch's modules)
    t0 = time.thread_time()  # this thread's CPU time: what another job on the machine does not inflate
    scan.check_python(SLOW_SCAN)  # 42 KB; 1 MiB of it takes ~25x longer
    took = time.thread_time() - t0
    # quadratic: ~6 s of CPU (154 s for 1 MiB); linear: ~0.3 s on 2 cores
    assert took < 2.0, f"42 KB of model_new.py took {took:.1f} s of CPU to scan (1 MiB: ~25x that, in the trainer's GIL)"


def _baselines_beside(tmp_path, target, args=()):
    """The slowdown of a new task's baselines (eager and torch.compile) timed while `target` runs in another thread
    of this process, against the same baselines timed before it started."""
    import os
    import threading
    from test_env import RELU

    def verdict(name):
        ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"), name=name)
        (ws / "model.py").write_text(RELU + f"\n# baseline nonce {os.urandom(8).hex()}\n")  # baselines measured here
        return env.evaluate(ws, backend="cpu")
    quiet = verdict("quiet")
    other = threading.Thread(target=target, args=args, daemon=True)
    other.start()
    loaded = verdict("loaded")
    return quiet, loaded, other


def test_redteam_a_scan_in_another_thread_does_not_inflate_a_baseline(tmp_path):
    import scan
    slow = model_new("relu", "x") + ("Y = nn" + ".b" * 250 + "\n") * 1200  # (~80 s of scanning)
    quiet, loaded, scanner = _baselines_beside(tmp_path, scan.check_python, (slow,))
    scanner.join()
    assert quiet.eager_ms and loaded.eager_ms, (quiet.summary(), loaded.summary())
    ratio = max(loaded.eager_ms / quiet.eager_ms, loaded.compile_ms / quiet.compile_ms)
    assert ratio < 3, f"baselines timed beside a scan in another thread: {ratio:.1f}x slower ({loaded.summary()})"


# Any thread of the trainer that holds the interpreter's lock does the same, not only the scan: train.py generates in
# its main thread while its tool calls' verdicts time runs in others. With the clock read in Python, each timed run
# waited for the lock after its system calls: a pure-Python loop beside a verdict made a 0.6 ms baseline 21 ms a run
# (85-92x; the 5 ms switch interval each time), and a thread holding the lock 50 ms at a time (a call through
# ctypes.pydll keeps it; the cores stay free) made it 101 ms. A timed run is one call of native code that holds no
# lock (protocol.timed_pair), from the run's command to the sample's last byte.
def test_redteam_a_thread_holding_the_interpreter_lock_is_not_timed(tmp_path):
    import ctypes
    stop, usleep = [], ctypes.PyDLL(None).usleep

    def hold_the_lock():
        while not stop:
            usleep(50_000)
    try:
        quiet, loaded, _ = _baselines_beside(tmp_path, hold_the_lock)
    finally:
        stop.append(1)
    assert quiet.eager_ms and loaded.eager_ms, (quiet.summary(), loaded.summary())
    assert loaded.eager_ms < quiet.eager_ms + 10 and loaded.compile_ms < quiet.compile_ms + 10, \
        f"the lock's 50 ms holds were timed: {quiet.summary()} | beside them: {loaded.summary()}"


# ------------------------------------------------------------------ 6. a thread from OpenMP's old entry points
# GOMP_parallel_start (libgomp's GOMP_1.0 ABI, exported by torch's libgomp and the system's) starts a team and returns
# to its caller; without GOMP_parallel_end the workers run on after the kernel returned: a thread of the kernel's own
# beside the harness's Python, the door that pthread_create/thrd_create/std::thread are refused for (the worker's
# counter went 28271 -> 214865450 in the 0.5 s after start_background() had returned). The import check allows
# OpenMP's entry points only as `#pragma omp` emits them: regions that join their team before they return.
def test_redteam_openmp_parallel_start_is_refused():
    b = env.build({"kernels/bg.cpp": (CASES / "background_thread.cpp").read_text()}, "cpu")
    assert not b.ok and b.violations, "GOMP_parallel_start (a worker that outlives the call) built: " + b.log


# ------------------------------------------------------------------ 7. `..` in an include path under an allowed root
# The preprocessor keeps `#include "<torch>/include/../../../../../../../../../etc/passwd"` as written in its line
# markers: a path that STARTS with a toolchain root (torch's include folder) but resolves outside it. Judged by its
# prefix, it would pass a host file, and the scan would attribute its text to a "system header" whose tokens are not
# read; scan.header_allowed judges a path where it resolves.
# (a) The host's files, as the compiler's diagnostics quote them: the build runs as root here (no unprivileged uid),
#     and its log goes back to the agent. Seen: "passwd:1:5: error: found ':' in nested-name-specifier /
#     1 | root:x:0:0:root:/root:/bin/bash" (env.py documents only `__has_include`, a file's existence).
# (b) Code the token scan never reads: a file of the workspace that is not a source (payload.txt: not collected, but
#     on the host's disk, where agent.py keeps out_dir/workspaces/), included by its absolute path through the root.
#     tests/attack_cases/python_by_slots.cpp's body (ob_type->tp_getattro ... tp_call: exec from C++, refused as
#     tokens) hidden there unhooked the dispatch monitor; forward() was plain PyTorch: reward +1, correct, no
#     violation (the same attack reached +3 on timing noise before the slots were refused).
def _through_root(path: str) -> str:
    import build as builder
    root = builder.toolchain("cpu")["roots"][0]
    return root + "/.." * root.count("/") + path


def test_redteam_a_host_file_through_an_allowed_root_is_not_included():
    src = ('#include <torch/extension.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n'
           f'#include "{_through_root("/etc/passwd")}"\n')
    b = env.build({"kernels/leak.cpp": src}, "cpu")
    assert not b.ok and b.violations and "root:x:" not in b.log, b.log


def test_redteam_a_payload_through_an_allowed_root_is_scanned():
    import shutil
    import tempfile
    from pathlib import Path
    from test_attacks import UNLOCK
    from test_env import RELU
    here = Path(__file__).resolve().parents[1] / ".redteam-tmp"  # (not under /tmp: a build's /tmp is its own)
    here.mkdir(exist_ok=True)
    ws = Path(tempfile.mkdtemp(prefix="ws-", dir=here))
    try:
        (ws / "kernels").mkdir()
        (ws / "model.py").write_text(RELU)
        slots = (Path(__file__).resolve().parent / "attack_cases" / "python_by_slots.cpp").read_text()
        (ws / "payload.txt").write_text(slots.split("PYBIND11_MODULE")[0].replace("#include <pybind11/pybind11.h>\n", ""))
        (ws / "kernels" / "ops.cpp").write_text(f'#include <pybind11/pybind11.h>\n#include "{_through_root(str(ws / "payload.txt"))}"\n'
                                                'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run_python", &run_python); }\n')
        init = f"cuda_extension.run_python(self, 'forward', '__func__', '__builtins__', 'exec', ('{UNLOCK}',))"
        (ws / "model_new.py").write_text(model_new("relu", "(x * self.scale).relu()", init_extra=init))
        v = env.evaluate(ws, backend="cpu")
        assert v.reward == -1 and not v.correct, v.summary()
    finally:
        shutil.rmtree(ws, ignore_errors=True)


# ------------------------------------------------------------------ 8. Python computes on values a copying kernel hands it
# The monitor refuses _local_scalar_dense (.item(), float(t)) because a value read into Python can be computed on there
# and written back. A kernel that only copies does the same reading in bulk: `values` returns a tensor's elements as a
# Python list (pybind11's std::vector<double> conversion), `from_values` writes a list back into a fresh tensor, and
# relu(x * scale) is a list comprehension in forward. No arithmetic in any kernel, no operator for the monitor to see:
# reward +1 (136 ms a run against eager's 2.3 ms), tried.
PY_IO_CPP = """#include <torch/extension.h>
#include <vector>

std::vector<double> values(torch::Tensor t) {
    const float* p = t.data_ptr<float>();
    return std::vector<double>(p, p + t.numel());
}
torch::Tensor from_values(torch::Tensor like, std::vector<double> v) {
    auto y = torch::empty_like(like);
    float* p = y.data_ptr<float>();
    for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<float>(v[i]);
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("values", &values);
    m.def("from_values", &from_values);
}
"""
PY_COMPUTES = model_new("relu", "cuda_extension.from_values(x, [max(a * s[i % len(s)], 0.0) for i, a in enumerate(v)])",
                        init_extra="pass").replace(
    "        return cuda_extension.from_values",
    "        s = cuda_extension.values(self.scale)\n        v = cuda_extension.values(x)\n"
    "        return cuda_extension.from_values")


def test_redteam_python_computing_on_values_a_kernel_copied_out_is_refused(tmp_path):
    assert "cuda_extension.values(x)" in PY_COMPUTES, PY_COMPUTES
    v = env.evaluate(make_ws(tmp_path, "relu", PY_COMPUTES, kernels={"io.cpp": PY_IO_CPP}), backend="cpu", stage="verify")
    assert v.reward == -1 and not v.correct, v.summary()


# ------------------------------------------------------------------ 9. a value named like the extension skips the allow-list
# An attribute of the extension's module is not checked (module_of: it is a kernel's function), and the extension's
# name is recognised by its name alone: rebinding `cuda_extension` to a tensor in forward (unlike an imported module's
# name, it may be bound) makes `cuda_extension.map2_` an "extension function", and case 1's cheat passes the scan
# again: reward +1 with no kernel, tried (140 ms a run).
MAP2_AS_EXTENSION = MAP2.replace("        out = torch.empty_like(x)\n        out.map2_(",
                                 "        cuda_extension = torch.empty_like(x)\n        cuda_extension.map2_(").replace(
    "        return out", "        return cuda_extension")


def test_redteam_a_value_named_cuda_extension_is_checked_like_any_value(tmp_path):
    assert "cuda_extension.map2_(x" in MAP2_AS_EXTENSION and "return cuda_extension\n" in MAP2_AS_EXTENSION, MAP2_AS_EXTENSION
    v = env.evaluate(make_ws(tmp_path, "relu", MAP2_AS_EXTENSION), backend="cpu", stage="verify")
    assert v.reward == -1 and not v.correct, v.summary()


# ------------------------------------------------------------------ 10. str.format walks the harness's frames
# A format string's field names are attribute and index lookups that the scan never sees (a string constant): `format`
# is in SAFE_METHODS, and a generator expression that formats itself reaches its frame, then f_back up the stack to
# protocol._child_main's locals. Raised as the error, the verdict carried the child's secret key and the nonce of the
# command being served, tried ("forward _call_impl _wrapped_call_impl watched _child_main key=142a... nonce=be3c...").
# The nonce is what keeps a kernel from speaking the protocol (env.py: "takes reading the interpreter's memory"); here
# Python reads it as text and can hand it to a kernel as a string argument. Any frame, module or global is readable.
FRAME = "0[0].gi_frame" + ".f_back" * 5
FORMAT_WALKS_FRAMES = model_new(
    "relu", "cuda_extension.relu_scale(x, self.scale)", init_extra="pass").replace(
    "        return cuda_extension",
    "        box = []\n"
    f"        g = ('key={{{FRAME}.f_locals[spec][key]}} nonce={{{FRAME}.f_locals[nonce]}}'.format(box) for i in range(1))\n"
    "        box.append(g)\n"
    "        raise ValueError(list(g)[0])\n"
    "        return cuda_extension")


def test_redteam_format_field_names_may_not_walk_the_interpreter():
    import scan
    assert ".f_locals[spec][key]" in FORMAT_WALKS_FRAMES, FORMAT_WALKS_FRAMES
    assert scan.check_python(FORMAT_WALKS_FRAMES), "a format string reads the harness's frames (key, nonce) as text"


# ------------------------------------------------------------------ a trainer killed mid-verdict leaves no candidate
# A forked candidate's parent is a process the fork server forked; were it not to die with the server, a trainer
# killed with -9 during a verdict would leave that candidate running (one spun for 18 minutes), on the GPU too.
def test_a_killed_trainer_leaves_no_candidate_running(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    ws = make_ws(tmp_path, "relu", HANG_IN_INIT)
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import env; "
            "env.evaluate(sys.argv[3], backend='cpu', stage='verify', load_timeout=600, timeout=600)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "-c", code, root, os.path.join(root, "tests"), str(ws)])
    try:
        before, t0 = set(), time.monotonic()
        while not before and time.monotonic() - t0 < 300:  # (a build and a child's start: seconds, more on a loaded machine)
            time.sleep(1)
            before = _spinning(p.pid)  # this trainer's own: other verdicts on the machine spin too
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        t0 = time.monotonic()  # (each death in the chain waits for a core on a loaded machine: up to 60 s, not
        while (after := _spinning() & before) and time.monotonic() - t0 < 60:  # the minutes a leaked one spins)
            time.sleep(1)
    finally:
        p.kill()
    assert before, "the candidate never started (nothing to test)"
    assert not (after & before), f"candidate processes outlived their trainer: {sorted(after & before)}"


def _spinning(root: int | None = None) -> set:
    """Pids of processes that run a sandboxed child and are busy on a CPU (state R); with root, only root's
    descendants (a pid that outlives root is then compared by itself: its parent has changed)."""
    import os
    out, parent = set(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(pid)] = int(fields[1])
        if (b"_forkserver" in cmd or b"_child" in cmd) and fields[0] == "R":
            out.add(int(pid))

    def under_root(pid):
        seen = set()
        while pid in parent and pid not in seen and pid > 1:
            if pid == root:
                return True
            seen.add(pid)
            pid = parent[pid]
        return False
    return out if root is None else {pid for pid in out if under_root(pid)}


# ------------------------------------------------------------------ 11. an output the parent cannot rebuild raised out of evaluate
# A pure-Python forward (scan-clean: torch.empty_strided is allocation, 2**62 a constant) returns a tensor with no
# elements whose contiguous strides overflow int64: torch.empty_strided((0, 2**62, 4), (1, 1, 1)) exists in the child
# (its strides are given) and packs as no bytes with shape [0, 2**62, 4]; the parent's unpack() rebuilt it with
# torch.empty(shape): RuntimeError "Stride calculation overflowed", which nothing caught, so env.evaluate raised
# instead of returning a verdict. agent.py turns that into "final evaluation failed", which rollouts.harness_failed
# counts as the HARNESS's failure: the episode left out of training, a way out of any -1 for one line of Python.
def test_redteam_an_output_the_parent_cannot_rebuild_is_a_verdict(tmp_path):
    ws = make_ws(tmp_path, "relu", model_new("relu", "torch.empty_strided((0, 2**62, 4), (1, 1, 1))"))
    try:
        v = env.evaluate(ws, backend="cpu", stage="verify")
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"env.evaluate raised {type(e).__name__}: {e}")
    assert v.reward == -1 and "malformed" in (v.error or ""), v.summary()


def test_redteam_any_error_judging_a_reply_is_the_candidates_minus_one(tmp_path, monkeypatch):
    """The class, not the instance: whatever a candidate's reply provokes in the parent while it is judged (here a
    RuntimeError from the comparison, standing for the next unpack/compare corner) is its reward -1 with the reason."""
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))

    def boom(*a, **k):
        raise RuntimeError("a corner of the comparison")
    monkeypatch.setattr(env, "compare", boom)
    v = env.evaluate(ws, backend="cpu", stage="verify")
    assert v.reward == -1 and "could not be judged (RuntimeError: a corner" in (v.error or ""), v.summary()


# ------------------------------------------------------------------ 12. the run answered by the kernel itself
# A kernel that passes the scan reaches the Python C API through its own module's relocations (pybind11's imports,
# found from the linker symbol __ehdr_start: no import, no refused token), reads the nonce of the "run" it serves from
# the harness's frame, answers that run itself while still inside forward, reads the sample's offset that the
# parent then sends, computes only the sampled 1/64 of the output and answers the sample; the harness's late "ok"
# is absorbed as an unused trailing blob, so no reply is out of step. Seen against the "sample" exchange: reward +3,
# 0.85 ms against the honest kernel's 12-14 ms (eager 7.8 ms). Nothing in the child's process is trusted, so the
# positions a timed run is checked at are never told to it: the parent reads them from the child's memory.
def _relu_ws(tmp_path, call, name="ws"):
    """relu on 1024 x 4096 (4M outputs: a timed run samples 1 in 64), the kernels of python_from_kernel.cpp."""
    from test_env import PROBLEMS
    ws = make_ws(tmp_path, "relu", model_new("relu", f"cuda_extension.{call}(x, self.scale)"),
                 {"ops.cpp": (CASES / "python_from_kernel.cpp").read_text(), "takeover.h": TAKEOVER}, name=name)
    (ws / "model.py").write_text(PROBLEMS["relu"].replace("BATCH = 64", "BATCH = 1024"))
    return ws


@pytest.mark.parametrize("cheat", ["relu_sampled", "relu_strided"])
def test_redteam_a_kernel_answering_the_run_itself_does_not_learn_the_sample(tmp_path, cheat):
    import protocol
    honest = env.evaluate(_relu_ws(tmp_path, "relu_full", "honest"), backend="cpu")
    assert honest.reward >= 1, honest.summary()
    if not protocol.reads("cpu"):
        pytest.skip("this machine's parent may not read its children's memory: runs are checked by the sample "
                    "exchange, whose positions the child is told (env.py, 'does NOT protect')")
    v = env.evaluate(_relu_ws(tmp_path, cheat, "cheat"), backend="cpu")
    assert v.compiled and not v.violations and v.reward == -1, (honest.summary(), v.summary(), v.log)
    if cheat == "relu_strided":  # the harness answers for it: caught by the reads alone
        assert "a timed run" in v.error and "values differ" in v.error, v.error
    else:  # its own replies are out of step with the reads' protocol (no sample command comes), or lack its fields
        assert any(w in v.error for w in ("answers no command", "malformed run reply", "malformed message header",
                                          "a timed run", "bad full reply")), v.error


# ------------------------------------------------------------------ 12b. memory served when it is read
# The parent's reads are worth something only if the child cannot make its memory when they come: a userfaultfd
# thread that computes each page as it is first touched would compute just the pages read. The kernel serves a
# userfaultfd's faults for the parent's reads (the kernel's own accesses) only to a holder of CAP_SYS_PTRACE, which
# every child drops, or where vm.unprivileged_userfaultfd is 1 (then protocol.reads() is False); /dev/userfaultfd
# is not in the sandbox's /dev, and sandbox.py's seccomp filter refuses userfaultfd(2) to every child. A sandboxed
# process (as children run: the class, not a kernel's way to get there) registers its memory with the best
# userfaultfd it can get (none, under the filter) and serves no fault; the parent's read must fail at once.
UFFD_CHILD = r"""
import ctypes, fcntl, json, mmap, os, struct, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
full = libc.syscall(323, os.O_CLOEXEC)  # userfaultfd(2) on x86_64: every fault, the kernel's too
full_errno = ctypes.get_errno()
fd = full if full >= 0 else libc.syscall(323, os.O_CLOEXEC | 1)  # UFFD_USER_MODE_ONLY
m = mmap.mmap(-1, 1 << 20)
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
registered = False
if fd >= 0:
    fcntl.ioctl(fd, 0xC018AA3F, bytearray(struct.pack("QQQ", 0xAA, 0, 0)))  # UFFDIO_API
    fcntl.ioctl(fd, 0xC020AA00, bytearray(struct.pack("QQQQ", addr, 1 << 20, 1, 0)))  # UFFDIO_REGISTER, missing pages
    registered = True
info = {"addr": addr, "full": full >= 0, "full_errno": full_errno, "registered": registered,
        "dev": os.path.exists("/dev/userfaultfd")}
open("info.tmp", "w").write(json.dumps(info))
os.rename("info.tmp", "info.json")
time.sleep(60)
"""


def test_redteam_memory_a_child_would_serve_on_demand_is_not_read(tmp_path):
    import ctypes
    import json
    import platform
    import threading

    import protocol
    import sandbox
    if platform.machine() != "x86_64":
        pytest.skip("the probe calls userfaultfd(2) by its x86_64 number")
    if Path("/proc/sys/vm/unprivileged_userfaultfd").read_text().strip() != "0":
        pytest.skip("vm.unprivileged_userfaultfd is not 0 here: protocol.reads() is False, no memory is read")
    iso = sandbox.isolation("cpu")
    if not iso.strict or "--pid" not in iso.prefix:
        pytest.skip("no private /dev or PID namespace here: protocol.reads() is False, no memory is read")
    (tmp_path / "child.py").write_text(UFFD_CHILD)
    started = {}
    th = threading.Thread(target=lambda: sandbox.run_sandboxed(
        [sys.executable, "-E", str(tmp_path / "child.py")], tmp_path, 90, started=lambda pid: started.setdefault("pgid", pid)))
    th.start()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "info.json").exists():
            assert th.is_alive() and time.monotonic() < deadline, "the sandboxed child did not start"
            time.sleep(0.05)
        info = json.loads((tmp_path / "info.json").read_text())
        assert not info["full"] and info["full_errno"] == 1 and not info["dev"], info  # (EPERM; no device node)
        if "a seccomp filter" not in iso.missing:  # userfaultfd is refused whole: the attack cannot be put in place
            assert not info["registered"], info
            return
        assert info["registered"], info  # the user-mode-only one: the attack is in place
        pid = protocol.harness_pid(started["pgid"])
        assert pid is not None
        got = {}

        def read():
            buf = ctypes.create_string_buffer(64)
            libc = ctypes.CDLL(None, use_errno=True)
            local, remote = protocol.IOVec(ctypes.addressof(buf), 64), protocol.IOVec(info["addr"] + 4096 * 7, 64)
            got["n"] = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            got["errno"] = ctypes.get_errno()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "the parent's read waited for the child to serve the page"
        assert got["n"] == -1 and got["errno"] == 14, got  # EFAULT: the read fails; a verdict rejects the run
    finally:
        if started.get("pgid"):
            os.killpg(started["pgid"], 9)
        th.join(30)


# ------------------------------------------------------------------ 13. a full command pipe
# The same kernel's way to the Python API, then: the command pipe reopened for writing through /proc/self/fd and
# filled, the run answered, and sleep. The parent's next command had no deadline: it blocked in write() until the
# verdict's wall clock killed the child (43.6 s at run_timeout=3, timeout=40), holding the device meanwhile. Every
# write to a child is under the command's deadline, as every read is.
def test_redteam_a_full_command_pipe_is_under_the_command_deadline(tmp_path):
    ws = _relu_ws(tmp_path, "fill_and_stall")
    t0 = time.monotonic()
    v = env.evaluate(ws, backend="cpu", stage="verify", run_timeout=3, timeout=40)
    took = time.monotonic() - t0 - v.phases.get("build", 0)
    assert v.compiled and v.reward == -1 and "could not be sent within" in (v.error or ""), v.summary()
    assert took < 20, f"a child that filled its command pipe held the parent for {took:.0f} s (run_timeout 3 s)"


# ------------------------------------------------------------------ 14. work done before the clock starts
# Found by a red-team helper against the parent's reads: the same way to the Python API, then a wrapper around the
# harness's `send` that computes the whole output while the harness serves a command between runs (the "load" that
# drew and copied a run's input in, untimed), and a forward that returns it at once. Every element was right; the work
# was outside [t0, t1]: reward +3 at 0.28 ms against the honest kernel's 12.4 ms (eager 7.3, compile 0.83). The class:
# a child that holds a run's input before t0. Where the parent can reach its children's memory (protocol.reads()), it
# holds the timed inputs and writes each into the child's buffers just before the clock starts (TimedInputs); the
# kernel here precomputes on every command but "run" and keeps a fingerprint of the input it used, so it would win on
# any input it could see early.
def test_redteam_work_done_before_the_clock_starts_is_timed(tmp_path):
    import protocol
    honest = env.evaluate(_relu_ws(tmp_path, "relu_full", "honest"), backend="cpu")
    assert honest.reward >= 1, honest.summary()
    if not protocol.reads("cpu"):
        pytest.skip("this machine's parent may not write its children's memory: each run's input is loaded by the "
                    "child before the clock (env.py, 'does NOT protect')")
    v = env.evaluate(_relu_ws(tmp_path, "relu_precomputed", "cheat"), backend="cpu")
    assert v.compiled and not v.violations and v.reward >= 1, (v.summary(), v.log)
    assert v.reward <= honest.reward and v.runtime_ms > 0.5 * honest.runtime_ms, (honest.summary(), v.summary())


def test_a_wrapping_prefix_is_refused_with_its_real_size():
    """A reply prefix whose blobs' total is 2**64 - 1 is refused; the error states a size over the limit (16 + n +
    total computed in 64 bits read 24 bytes)."""
    import struct

    import protocol
    c = object.__new__(protocol.Child)
    c.cmd_r, c.cmd_w = os.pipe()
    c.rep_r, c.rep_w = os.pipe()
    c.reply_limit, c.cmd_timeout = 1 << 20, 2.0
    if protocol.native() is None:
        pytest.skip("no C compiler: no native clock")
    try:
        os.write(c.rep_w, struct.pack("<QQ", 9, 2**64 - 1))
        with pytest.raises(protocol.ReplyTooLarge) as e:
            c.native_timed_run(("sample", 5), 0.0, 0.001)
        assert e.value.nbytes > 1 << 40, str(e.value)
    finally:
        for fd in (c.cmd_r, c.cmd_w, c.rep_r, c.rep_w):
            os.close(fd)


@pytest.mark.parametrize("way", ["native clock", "ask"])
def test_a_command_to_a_child_whose_pipe_stays_full_ends_at_its_deadline(way):
    """Both ways the parent writes commands (timed_pair's C, Child.ask's Python) wait for room in a full command pipe
    only until the command's deadline, then stop the child (ChildTimeout), as a read does."""
    import protocol
    c = object.__new__(protocol.Child)
    c.cmd_r, c.cmd_w = os.pipe()
    c.rep_r, c.rep_w = os.pipe()
    os.set_blocking(c.cmd_w, False)  # (as Child.__init__ makes it)
    c.reply_limit, c.cmd_timeout, c.pgid = 1 << 20, 0.5, None
    try:
        with pytest.raises(BlockingIOError):
            while True:
                os.write(c.cmd_w, b" " * 4096)
        t0 = time.monotonic()
        with pytest.raises(protocol.ChildTimeout):
            if way == "ask":
                c.ask({"op": "run"})
            else:
                if protocol.native() is None:
                    pytest.skip("no C compiler: no native clock")
                c.native_timed_run(("sample", 5), 0.0, 0.001)
        assert time.monotonic() - t0 < 5
    finally:
        for fd in (c.cmd_r, c.cmd_w, c.rep_r, c.rep_w):
            os.close(fd)


# ------------------------------------------------------------------ 15. work alongside the parent's write of an input
# Found by a red-team helper against the parent's writes (14): both kernels take the process over as 12-14 do, then
# start threads of their own (threading, and a ctypes pointer into the module: a ctypes call releases the GIL).
# (a) watch_the_write.cpp: a thread follows process_vm_writev page by page (a page's last float against the previous
#     write's) and computes each page the writer has passed; forward finishes the last ~5%. Seen (relu 1024x4096,
#     2 cores): +3 at 0.18-0.46 ms against the honest +2 at 1.05-1.24 (eager 1.66, compile 0.90).
# (b) stall_the_write.cpp: process_vm_writev takes the child's mmap lock (read) for each batch of 1024 pages; a thread
#     that calls mprotect on a populated region of its own holds it for writing ~20 ms a GiB a call, and stalls the
#     parent as long as it likes: the kernel computes a @ b meanwhile. Seen (matmul 128x1024x1024): +3 at 0.29-0.56 ms
#     against the honest +1 at 4.5 ms (eager 2.48, compile 2.53).
# The write was before the clock, and the child ran during it. Every process of the child's PID namespace is stopped
# (SIGSTOP, which no process can block) until the write is done, and continued as the clock starts.
def _ws(tmp_path, problem, body, source, name, sizes):
    ws = make_ws(tmp_path, problem, model_new(problem, body), {"ops.cpp": (CASES / source).read_text(),
                                                               "takeover.h": TAKEOVER,
                                                               "watch_state.h": (CASES / "watch_state.h").read_text(),
                                                               "watcher.h": (CASES / "watcher.h").read_text()}, name=name)
    code = PROBLEMS[problem]
    for a, b in sizes:
        code = code.replace(a, b)
    (ws / "model.py").write_text(code)
    return ws


def test_redteam_a_thread_computing_while_the_input_is_written_is_timed(tmp_path):
    import protocol
    sizes = [("BATCH = 64", "BATCH = 1024")]  # 16 MiB in, 16 MiB out
    honest = env.evaluate(_ws(tmp_path, "relu", "cuda_extension.relu_fast(x, self.scale)", "watch_the_write.cpp", "honest",
                              sizes), backend="cpu")
    assert honest.reward >= 1, honest.summary()
    if not protocol.reads("cpu"):
        pytest.skip("the child loads each input itself here (env.py, 'does NOT protect')")
    v = env.evaluate(_ws(tmp_path, "relu", "cuda_extension.relu_watch(x, self.scale)", "watch_the_write.cpp", "cheat",
                         sizes), backend="cpu")
    assert v.compiled and v.correct, v.summary()
    # seen on 2 cores (quiet): honest +2 at 0.87-1.10 ms (its output buffer reused: 0.74-0.96 ms, +2 or +3); the watcher
    # +3 at 0.18-0.46 ms (eager 1.66, compile 0.90). With the child stopped during the write, the watcher starts with
    # the clock and works beside forward, a second thread (1.5 ms seen): compared with eager, not with the honest
    # kernel, whose fresh 16 MiB output costs it 1-6 ms a run by where the allocator puts it.
    assert v.runtime_ms > 0.5 * v.eager_ms, (honest.summary(), v.summary())


def test_redteam_a_write_the_child_stalls_is_no_time_for_free_work(tmp_path):
    import protocol
    sizes = [("M, K, N = 64, 128, 96", "M, K, N = 128, 1024, 1024")]  # b: 4 MiB (two batches of the parent's write)
    honest = env.evaluate(_ws(tmp_path, "matmul", "cuda_extension.mm_honest(a, b)", "stall_the_write.cpp", "honest",
                              sizes), backend="cpu")
    assert honest.reward >= 1, honest.summary()
    if not protocol.reads("cpu"):
        pytest.skip("the child loads each input itself here (env.py, 'does NOT protect')")
    v = env.evaluate(_ws(tmp_path, "matmul", "cuda_extension.mm_stall(a, b)", "stall_the_write.cpp", "cheat", sizes),
                     backend="cpu")
    assert v.compiled and v.correct, v.summary()
    # seen on 2 cores: honest +1 at 4.5-4.6 ms (eager 2.48, compile 2.53); stalled +3 at 0.29-0.56 ms (M=512: honest 18.1-18.8
    # ms, stalled 0.57-0.58 ms, eager 9.96, compile 9.45); the kernel's region: 2 GiB (holds of ~40 ms)
    assert v.reward <= honest.reward and v.runtime_ms > 0.6 * honest.runtime_ms, (honest.summary(), v.summary())


def test_redteam_the_input_write_keeps_its_deadline():
    """A child that holds its own mmap lock (mprotect in a loop) stalls process_vm_writev at each batch of pages; the
    write looks at its deadline between pieces of 8 MiB, so it cannot keep the parent (and the device's timing lock)
    past run_timeout. (64 MiB, a 1 GiB region: ~0.6 s against a 1 ms deadline when the deadline was not looked at.)
    In a verdict the child's processes are stopped during the write (protocol.stop_processes): none runs to stall it."""
    import protocol
    lib = protocol.native()
    if lib is None:
        pytest.skip("no C compiler: no native helper")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n = 64 << 20
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the "child": a buffer, and a thread that holds its mmap lock
        try:
            buf = mmap.mmap(-1, n)
            big = mmap.mmap(-1, 1 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            at = ctypes.addressof(ctypes.c_char.from_buffer(big))
            for i in range(0, len(big), 4096):
                big[i] = 1
            buf[:] = b"\0" * n

            def hold():
                k = 0
                while True:
                    libc.mprotect(at, len(big), 1 if k % 2 else 3)
                    k += 1
            threading.Thread(target=hold, daemon=True).start()
            os.write(w, str(ctypes.addressof(ctypes.c_char.from_buffer(buf))).encode().ljust(32))
            os.read(r2, 1)
        finally:
            os._exit(0)
    try:
        addr = int(os.read(r, 32))
        src = ctypes.create_string_buffer(n)
        one, err = ctypes.c_ulonglong * 1, ctypes.c_longlong(0)
        t0 = time.monotonic_ns()
        rc = lib.write_inputs(1, pid, one(addr), one(ctypes.addressof(src)), one(n), 1, 0, t0 + 10**6, ctypes.byref(err))
        took = (time.monotonic_ns() - t0) / 1e9
    finally:
        os.write(w2, b"x")
        os.waitpid(pid, 0)
    assert rc != 0 or took < 0.1, f"a write with a 1 ms deadline returned {rc} after {took:.2f} s"


# 15c. A walk of /proc's children lists one process at a time: a process that kills its stopped parent while the
# walk goes on moves to the end of the harness's list after the walk read it, and is never listed. escape_the_stop.cpp
# (a red-team helper's): the harness makes a spawner (clone(CLONE_VM)) and 399 children that exit at once (they pad the
# walk); the spawner makes V, V makes K; K waits until V is stopped, kills it, and follows the write as watch_the_write
# does. Seen (relu 1024x4096, 2 cores): +3 at 0.80 ms, forward doing 1 of 4097 pieces in every timed run (honest
# relu_fast +1 at 5.65 ms, with its output reused +3 at 0.76; eager 1.68). The stop finds the namespace's members by
# scanning /proc for its PID namespace (no process leaves it) until a whole scan finds none new or running.
def test_redteam_a_process_that_moves_in_the_tree_is_stopped_too(tmp_path):
    import protocol
    sizes = [("BATCH = 64", "BATCH = 1024")]
    v = env.evaluate(_ws(tmp_path, "relu", "cuda_extension.relu_watch(x, self.scale)", "escape_the_stop.cpp", "cheat",
                         sizes), backend="cpu")
    if not protocol.reads("cpu"):
        pytest.skip("the child loads each input itself here (env.py, 'does NOT protect')")
    assert v.compiled and v.correct, v.summary()
    assert v.runtime_ms > 0.6 * v.eager_ms, v.summary()
