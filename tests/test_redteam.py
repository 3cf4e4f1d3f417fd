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
