"""Red-team findings against env.py on the CPU backend. Each test asserts that a cheat (or a fault) is handled; each
FAILS on the code it was written against, and passes once the hole is closed. Workspaces are built the way
tests/test_env.py builds them (make_ws, model_new), with tests/env_cases/ops.cpp as the (cached) kernel source."""
import time

import pytest

import env
from test_env import OPS, make_ws, model_new  # noqa: F401


# ------------------------------------------------------------------ 1. Python computes where the monitor cannot see
# Tensor.map2_(a, b, fn) calls a Python callable once per element, in C++ code that never enters the dispatcher: the
# dispatch monitor records no operator. scan.BANNED_METHODS has apply_ and map_, not map2_. A ModelNew whose forward
# computes relu(x * scale) element by element in a method of its own is correct, with no kernel doing any work:
# reward +1 (seen: runtime 69 ms, "correct": true, no violation).
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
# Child.cmd_timeout (Config.run_timeout) is set only once the candidate says "ready": model_new.py's import, ModelNew's
# __init__ and load_state_dict run under the verdict's wall clock alone (Config.timeout, 300 s). One line of allowed
# Python (`while True: pass` in __init__) keeps the candidate alive, and candidate_alive held, for 300 s: every new
# task's baseline waits for it, and while that baseline holds the gate, every other verdict on the device waits too
# (protocol.py's own reason for the per-command deadline). Seen: `--timeout 60` -> the verdict took 72 s, "ModelNew timed
# out (the whole process group was killed)". (A fork-served candidate is ready in ~2 s here.)
HANG_IN_INIT = model_new("relu", "cuda_extension.relu_scale(x, self.scale)", init_extra="while True:\n            pass")


def test_redteam_a_hang_while_loading_is_stopped_at_a_deadline(tmp_path):
    t0 = time.monotonic()
    v = env.evaluate(make_ws(tmp_path, "relu", HANG_IN_INIT), backend="cpu", stage="verify", run_timeout=3, timeout=120)
    took = time.monotonic() - t0
    assert v.reward == -1 and v.error, v.summary()
    assert took < 80, f"a candidate hanging in ModelNew.__init__ was alive (holding the device) for {took:.0f} s"


# ------------------------------------------------------------------ 3. a reply sent byte by byte is under no command deadline
# protocol._read_exact asks alive() (which carries Child.cmd_timeout's deadline) only when select() has waited 0.5 s
# with nothing to read. A child that writes one byte every 0.2 s (a header length of 1 MiB, then JSON blanks) is never
# past its deadline: the parent reads on until the verdict's wall clock kills the child. The kernel reaches the reply
# pipe through stdio (env.py's docstring: a FILE whose descriptor field it sets; here by its offset, no banned token),
# and needs no nonce: it never completes a message. Seen with run_timeout=3, timeout=45: "ModelNew timed out (the whole
# process group was killed)" after 45 s, in the first check run (in a timed run, the device's timing lock is held as long).
CASES = env.Path(__file__).resolve().parent / "redteam_cases"


def test_redteam_recv_keeps_its_deadline_while_bytes_trickle():
    import os
    import threading
    import protocol
    r, w = os.pipe()
    stop = threading.Event()

    def trickle():
        os.write(w, ((1 << 20) - 1).to_bytes(8, "little"))
        for _ in range(80):  # 8 s of it, then silence (past which even today's recv gives up)
            if stop.wait(0.1):
                break
            os.write(w, b" ")
    threading.Thread(target=trickle, daemon=True).start()
    deadline = time.monotonic() + 1.0
    t0 = time.monotonic()
    try:
        with pytest.raises(EOFError):
            protocol.recv(r, alive=lambda: time.monotonic() < deadline, expect="nonce")
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
# evaluate() catches SyntaxError around ast.parse, but a deep attribute chain (`X = nn.b.b.b...`, 5000 deep) raises
# RecursionError in ast.parse itself, and a 1000-deep one passes ast.parse and raises RecursionError in
# scan.check_python (ast.unparse). The exception leaves env.evaluate; agent.py's final scoring turns it into
# "final evaluation failed: RecursionError: ...", which rollouts.harness_failed counts as the HARNESS's failure: the
# episode is neither trained on nor counted in the reward. A policy that expects a -1 can append one line to
# model_new.py and have its failure dropped from the batch instead of penalised (the CLI prints a traceback).
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
# scan.check_python calls ast.unparse(node.value) for every Attribute node: quadratic in an attribute chain's depth.
# A model_new.py of 1 MiB made of `Y = nn.b.b...b` lines (320 deep, below the recursion limit; no violation: a missing
# attribute of a module resolves to nothing) takes 154 s of pure Python in the TRAINER's process (agent.py runs every
# tool call and every final verdict in a thread pool), outside every lock: the build's and the candidate's holds come
# later. Meanwhile every other thread's pipe clock waits for the GIL at each exchange. Seen: a new task's baselines
# timed in another thread while such a scan ran: eager 0.68 -> 17.3 ms, compile 0.58 -> 11.3 ms, cached (spread 2.4 and
# 14: measured again while noisy, but only up to 3 times, and the least noisy kept; a policy whose rollouts of one task
# keep scanning through the first three verdicts leaves the inflated value for good), and that verdict's own candidate,
# 2x slower than eager when quiet, got reward +3.
SLOW_SCAN = model_new("relu", "cuda_extension.relu_scale(x, self.scale)") + ("Y = nn" + ".b" * 250 + "\n") * 80


def test_redteam_the_python_scan_is_not_quadratic():
    import scan
    scan.check_python("import torch\n")  # (its first call imports torch's modules)
    t0 = time.monotonic()
    scan.check_python(SLOW_SCAN)  # 42 KB; 1 MiB of it takes ~25x longer
    took = time.monotonic() - t0
    assert took < 1.0, f"42 KB of model_new.py took {took:.1f} s to scan (1 MiB: ~25x that, in the trainer's GIL)"


def test_redteam_a_scan_in_another_thread_does_not_inflate_a_baseline(tmp_path):
    import os
    import threading
    import scan
    from test_env import RELU

    def verdict(name):
        ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"), name=name)
        (ws / "model.py").write_text(RELU + f"\n# baseline nonce {os.urandom(8).hex()}\n")  # baselines measured here
        return env.evaluate(ws, backend="cpu")
    quiet = verdict("quiet")
    slow = model_new("relu", "x") + ("Y = nn" + ".b" * 250 + "\n") * 1200  # (~80 s of scanning)
    scanner = threading.Thread(target=scan.check_python, args=(slow,), daemon=True)
    scanner.start()
    loaded = verdict("loaded")
    scanner.join()
    assert quiet.eager_ms and loaded.eager_ms, (quiet.summary(), loaded.summary())
    ratio = max(loaded.eager_ms / quiet.eager_ms, loaded.compile_ms / quiet.compile_ms)
    assert ratio < 3, f"baselines timed beside a scan in another thread: {ratio:.1f}x slower ({loaded.summary()})"


# ------------------------------------------------------------------ 6. a thread from OpenMP's old entry points
# The import check allows every GOMP_* symbol. GOMP_parallel_start (libgomp's GOMP_1.0 ABI, exported by torch's libgomp
# and the system's) starts a team and returns to its caller; without GOMP_parallel_end the workers run on after the
# kernel returned: a thread of the kernel's own beside the harness's Python, the door that pthread_create/thrd_create/
# std::thread are refused for (work overlapped with the harness's "load" and its Python between runs, unwatched
# forever). Seen: built with no violation; loaded in a Python process, the worker's counter went 28271 -> 214865450 in the
# 0.5 s after start_background() had returned.
def test_redteam_openmp_parallel_start_is_refused():
    b = env.build({"kernels/bg.cpp": (CASES / "background_thread.cpp").read_text()}, "cpu")
    assert not b.ok and b.violations, "GOMP_parallel_start (a worker that outlives the call) built: " + b.log


# ------------------------------------------------------------------ 7. `..` in an include path under an allowed root
# scan.header_allowed accepts any path that STARTS with a toolchain root (torch's include folder): the preprocessor
# keeps `#include "<torch>/include/../../../../../../../../../etc/passwd"` as written in its line markers, so the
# include check passes a host file, and the scan attributes its text to a "system header" whose tokens are not read.
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
