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
