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
