"""Red-team cases against the reply area (protocol.make_area / send(area=) / recv(area=)), CPU backend. Workspaces
as tests/test_env.py builds them (make_ws, model_new, tests/env_cases/ops.cpp). examples/relu.py's output is
64 x 4096 float32 = 1 MiB; here with BATCH 512 (8 MiB, over protocol.AREA_MIN) every whole output of it goes
through the area."""
import os
import time

import pytest

import env
import protocol
import sandbox
from test_env import make_ws, model_new  # noqa: F401

HONEST = model_new("relu", "cuda_extension.relu_scale(x, self.scale)")

BATCH = 512
assert BATCH * 4096 * 4 >= protocol.AREA_MIN


def big_relu_ws(tmp_path, source):
    ws = make_ws(tmp_path, "relu", source)
    (ws / "model.py").write_text((ws / "model.py").read_text().replace("BATCH = 64", f"BATCH = {BATCH}"))
    return ws


# ------------------------------------------------------------------ 1. the reference overwrites its area before it is read
# (Found against a reference child that sent every output back to back, each one written at offset 0 of the SAME
# area before its header went down the pipe, never waiting for the parent to read the previous one; each output is
# now asked for.) A parent
# that reads its first header a moment late (a GIL held by another verdict's scan in the trainer, a loaded host, a
# 2 GiB preadv into fresh pages while the GPU child computes and pwrites the next output) reads a later seed's
# output, or a torn mix, as the output of an earlier seed: every ref_out ends up the LAST set's output. An honest
# kernel is then judged wrong (and any verdict depends on scheduling). The sleep stands for that late read.
def _late_reference_reads(monkeypatch, seconds=2.0):
    answer = protocol.Child.answer

    def late(self, *a, **k):
        obj, blobs = answer(self, *a, **k)
        if isinstance(obj, dict) and "timed_sets" in obj:  # the reference's first message: its outputs follow
            time.sleep(seconds)
        return obj, blobs
    monkeypatch.setattr(protocol.Child, "answer", late)


def test_redteam_area_reference_outputs_read_late_are_still_their_seeds(tmp_path, monkeypatch):
    _late_reference_reads(monkeypatch)
    v = env.evaluate(big_relu_ws(tmp_path, HONEST), backend="cpu", stage="verify")
    assert v.correct and v.reward >= 1 and v.error is None, (
        "an honest kernel was judged wrong because the parent read the reference's outputs from an area the "
        "reference had since overwritten: " + v.summary())


def test_redteam_area_protocol_reference_outputs_match_their_seeds(tmp_path):
    """The same at the protocol layer: the outputs the parent reads are compared with Model(inputs(seed))."""
    import secrets

    import torch
    code = (env.Path(__file__).resolve().parents[1] / "examples" / "relu.py").read_text().replace("BATCH = 64", f"BATCH = {BATCH}")
    run = tmp_path / "run"
    (run / "ref").mkdir(parents=True)
    (run / "ref" / "model.py").write_text(code)
    seeds = [secrets.randbelow(2**31) for _ in range(5)]
    ref = protocol.Child(dict(backend="cpu", seed0=7, mode="reference", reference=str(run / "ref" / "model.py"),
                              seeds=seeds, n_checks=len(seeds), budget_mb=1024), run / "ref", "cpu", env.Config())
    try:
        ref.answer()
        time.sleep(2)  # the parent, late
        outs = [protocol.unpack(*ref.ask({"op": "output", "k": k})) for k in range(len(seeds))]
    finally:
        ref.close()
    ns = {}
    exec(code, ns)
    torch.manual_seed(7)
    model = ns["Model"](*ns["get_init_inputs"]()).eval()
    task = type("Task", (), {"get_inputs": staticmethod(ns["get_inputs"])})
    wrong = [i for i, s in enumerate(seeds)
             if not torch.equal(model(*protocol.draw_inputs(task, s, torch.device("cpu"))), outs[i])]
    assert not wrong, f"reference outputs {wrong} are not their seeds' outputs (each is the last seed's)"


# ------------------------------------------------------------------ 2. an output over 1 GiB cannot be sent at all
# Every child runs under RLIMIT_FSIZE = 1 GiB (sandbox._apply_limits, meant for stdout/stderr files), and the limit
# applies to pwrite on a memory file too: a reply whose area blobs ended past 1 GiB got EFBIG half-way, and every
# verdict of a task whose output is over 1 GiB (bench/big_verdict.py's 2 GiB outputs) was "the reference model.py
# failed". The area is written through a mapping (stores within the file's size are not writes).
BIG = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x.expand(288 << 20).clone()  # 1.125 GiB of float32


def get_inputs():
    return [torch.randn(1)]


def get_init_inputs():
    return []
"""


def test_redteam_area_reference_output_over_1gib_is_sent(tmp_path):
    run = tmp_path / "run"
    (run / "ref").mkdir(parents=True)
    (run / "ref" / "model.py").write_text(BIG)
    ref = protocol.Child(dict(backend="cpu", seed0=7, mode="reference", reference=str(run / "ref" / "model.py"),
                              seeds=[1], n_checks=1, budget_mb=1024), run / "ref", "cpu", env.Config())
    try:
        ref.answer()
        try:
            obj, blobs = ref.ask({"op": "output", "k": 0})
        except EOFError:
            pytest.fail("the reference child died sending a 1.125 GiB output: " + ref.why_dead()[-600:])
    finally:
        ref.close()
    assert [b.numel() for b in blobs] == [(288 << 20) * 4]


# ------------------------------------------------------------------ 3. area pages are memory outside RLIMIT_AS
# The harness writes every blob of a reply that fits into the area BEFORE the parent sees the header. A forward that
# returns the same 8 MiB output 200 times (pure Python, passes the scan) made the child's own harness fill the area:
# memory-file pages that RLIMIT_AS (the CPU children's limit where no memory cgroup is writable) never counts, held
# by the PARENT's descriptor until the verdict ends. Each command says how many bytes the parent accepts
# (reply_limit), and the harness refuses a larger reply before it writes a byte.
MANY = model_new("relu", "(cuda_extension.relu_scale(x, self.scale),) * 200")


def test_redteam_area_holds_no_more_than_the_parent_accepts(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "_cgroup", lambda *a, **k: [])  # a host without a writable cgroup: RLIMIT_AS
    peak = []
    answer = protocol.Child.answer

    def watch(self, *a, **k):
        try:
            return answer(self, *a, **k)
        finally:
            if self.area is not None:
                peak.append((os.fstat(self.area).st_blocks * 512, self.reply_limit))
    monkeypatch.setattr(protocol.Child, "answer", watch)
    v = env.evaluate(big_relu_ws(tmp_path, MANY), backend="cpu", stage="verify", mem_gb=4)
    assert v.reward == -1, v.summary()
    held, limit = max(peak, default=(0, 0))
    assert held <= limit, (f"the candidate's reply area held {held / 2**20:.0f} MiB of host memory outside RLIMIT_AS "
                           f"(reply_limit {limit / 2**20:.0f} MiB): {v.summary()}")
