"""env.py on the CUDA backend (run on the H200; skipped without CUDA). Same cases as test_env.py,
with pure .cu kernels and one torch binding shared by every workspace (one build)."""
import sys
from pathlib import Path

import pytest

import env
from test_env import CASES, PROBLEMS, PY_ATTACKS, assert_nothing_escaped, compare_cases, escape_probe, make_ws, model_new

pytestmark = pytest.mark.gpu
CUDA = {p.name: p.read_text() for p in (CASES / "cuda").glob("ops*")}


def ws_for(tmp_path, problem, body, **kw):
    return make_ws(tmp_path, problem, model_new(problem, body, **kw), CUDA)


@pytest.mark.parametrize("problem,body", [
    ("relu", "cuda_extension.relu_scale(x, self.scale)"),
    ("add", "cuda_extension.add(a, b)"),
    ("matmul", "cuda_extension.matmul(a, b)"),
])
def test_honest_cuda_kernels(tmp_path, problem, body):
    v = env.evaluate(ws_for(tmp_path, problem, body), backend="cuda")
    assert v.correct and v.reward >= 1 and v.runtime_ms > 0, v.summary()


@pytest.mark.parametrize("problem,body,expect", [
    ("add", "torch.add(a, b)", "torch.add is not allowed"),  # the static allow-list refuses it before any run
    ("relu", "cuda_extension.relu_scale_cached(x, self.scale)", "values differ"),
    ("relu", "torch.empty_like(x)", "values differ"),
    ("relu", "cuda_extension.relu_scale_part_after_checks(x, self.scale)", "timed run"),
    ("softmax_wide", "torch.zeros_like(x)", "RMS error"),
], ids=["python_fallback", "pointer_cache", "freed_memory", "part_after_checks", "zeros_wide_softmax"])
def test_cuda_cheats_rejected(tmp_path, problem, body, expect):
    v = env.evaluate(ws_for(tmp_path, problem, body), backend="cuda")
    assert v.reward == -1 and expect in " ".join(v.violations) + (v.error or ""), v.summary()


def test_timed_runs_shared_out_over_fresh_children_on_the_gpu(tmp_path):
    """Where the input budget holds 2 sets (relu 64x4096: 1 MiB a set), the candidate's timed runs go to
    protocol.SPLIT_CHILDREN fresh children one after another, each warmed up on an input it loads itself and written
    its sets through buffers of its own (TimedInputs.attach / detach): an honest kernel is judged as ever."""
    import protocol
    v = env.evaluate(ws_for(tmp_path, "relu", "cuda_extension.relu_scale(x, self.scale)"), backend="cuda",
                     input_budget_mb=2.5)
    assert v.correct and v.reward >= 1 and v.runtime_ms > 0, v.summary()
    assert v.timed_children == protocol.SPLIT_CHILDREN, v


def test_side_stream_work_is_timed(tmp_path):
    """Work on a side stream is counted: the device-wide sync waits for it. On a 128 MB input one relu pass takes
    tens of microseconds, so the side stream's 20 launches stand well above the timing floor (two pipe round
    trips and the sample copy, ~0.5 ms on the H200), which the 1 MB example's would not."""
    big = PROBLEMS["relu"].replace("BATCH = 64", "BATCH = 4096").replace("DIM = 4096", "DIM = 8192")
    assert big != PROBLEMS["relu"]
    verdicts = []
    for d, body in (("a", "cuda_extension.relu_scale(x, self.scale)"), ("b", "cuda_extension.relu_scale_side_stream(x, self.scale)")):
        ws = make_ws(tmp_path / d, "relu", model_new("relu", body), CUDA)
        (ws / "model.py").write_text(big)
        verdicts.append(env.evaluate(ws, backend="cuda"))
    honest, side = verdicts
    assert honest.correct and side.correct, side.summary()
    assert side.runtime_ms > 1.5 * honest.runtime_ms, (honest.runtime_ms, side.runtime_ms)


def test_illegal_memory_access_is_contained(tmp_path):
    v = env.evaluate(ws_for(tmp_path / "a", "relu", "cuda_extension.oob(x)"), backend="cuda", stage="verify")
    assert v.reward == -1 and v.error, v.summary()
    ok = env.evaluate(ws_for(tmp_path / "b", "relu", "cuda_extension.relu_scale(x, self.scale)"), backend="cuda")
    assert ok.correct, ok.summary()


@pytest.mark.parametrize("name", ["read_reference_outputs", "read_spec_seeds", "write_result_files", "disable_dispatch_monitor",
                                  "rebind_harness_clock", "grow_op_allow_list"])
def test_python_attacks_on_cuda(tmp_path, name):
    v = env.evaluate(ws_for(tmp_path, "relu", PY_ATTACKS[name]), backend="cuda")
    assert v.reward == -1 and v.violations, v.summary()


def test_escape_from_a_cuda_child(tmp_path):
    """The isolation CUDA gets (a PID namespace with a fresh /proc where possible) holds as for the CPU."""
    mark, probe = escape_probe(tmp_path)
    (tmp_path / "box").mkdir()
    r = env.run_sandboxed([sys.executable, "-c", "import torch; torch.zeros(1, device='cuda')\n" + probe], tmp_path / "box",
                          timeout=120, kind="cuda")
    assert r.returncode == 0, r.stderr
    assert_nothing_escaped(mark, r.stdout)
    assert "--pid" in env.isolation("cuda").prefix, env.isolation("cuda")


# Red team (tests/test_attacks.py has the CPU side): PyTorch called from C++ on a thread the monitor does not watch,
# here CUDA's own host-callback thread, is refused when the module is linked (its imports name aten.mul).
HOST_CALLBACK = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
struct Job { torch::Tensor x, s, out; };
static void job(void* p) { auto* j = static_cast<Job*>(p); j->out = (j->x * j->s).relu(); }
torch::Tensor f(torch::Tensor x, torch::Tensor s) {
  Job j{x.cpu(), s.cpu(), {}};
  cudaLaunchHostFunc(0, job, &j);
  cudaDeviceSynchronize();
  return j.out.to(x.device());
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("f", &f); }
"""


def test_pytorch_in_a_cuda_host_callback_is_refused(tmp_path):
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.f(x, self.scale)"), {"ops_binding.cpp": HOST_CALLBACK}),
                     backend="cuda")
    assert v.reward == -1 and not v.compiled and "aten.mul" in " ".join(v.violations), v.summary()


def test_line_marker_in_a_cu_file_is_refused():
    cu = '#line 1 "/usr/include/stdio.h"\nextern "C" int fork(); int g() { return fork(); }\n__global__ void k() {}\n'
    b = env.build({"kernels/a.cu": cu, "kernels/b.cpp": "#include <torch/extension.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n"},
                  "cuda")
    assert not b.ok and "#line" in b.log, b.log


def test_large_outputs_are_compared_on_the_gpu_as_on_the_cpu():
    """From env.GPU_COMPARE elements on, the parent compares on its GPU: the same counts and RMS figures as the CPU's
    chunks (NaN, inf, complex, chunk boundaries), and a single wrong value at the end of a large output is found."""
    import torch
    for name, out, r, close in compare_cases():
        cpu = env._close_and_rms(out, r, 1e-2, 1e-2)
        gpu = env._close_and_rms(out, r, 1e-2, 1e-2, chunk=1 << 16, device=torch.device("cuda"))
        assert cpu[0] == gpu[0] and cpu[1] == pytest.approx(gpu[1]), name
        assert cpu[2] == pytest.approx(gpu[2], rel=1e-9) and cpu[3] == pytest.approx(gpu[3], rel=1e-9), name
    ref = torch.randn(env.GPU_COMPARE + 5)
    out = ref.clone()
    assert env.compare(out, ref, 1e-2, 1e-2, "x") is None and torch.cuda.is_initialized()
    out[-1] += 1
    assert "1/" in env.compare(out, ref, 1e-2, 1e-2, "x")
    assert "RMS error" in env.compare(ref * 1.2, ref, 1.0, 0.2 - 1e-3, "x")


def test_timed_runs_on_the_gpu_are_read_by_the_parent(tmp_path):
    """The parent reads a timed run's sampled elements from the child's device memory itself (CUDA IPC, the native
    helper's own context), so the child is never told where: an honest kernel passes, one that computes a quarter
    of its output after the checks does not."""
    import protocol
    ok = env.evaluate(ws_for(tmp_path / "a", "relu", "cuda_extension.relu_scale(x, self.scale)"), backend="cuda")
    assert ok.correct and ok.reward >= 1, ok.summary()
    assert protocol.reads("cuda"), "the parent cannot read its children's device memory here (see stderr)"
    v = env.evaluate(ws_for(tmp_path / "b", "relu", "cuda_extension.relu_scale_part_after_checks(x, self.scale)"),
                     backend="cuda")
    assert v.reward == -1 and "a timed run" in (v.error or ""), v.summary()


def test_a_device_read_outside_the_childs_allocation_is_refused(tmp_path):
    """The address and size in a run's list of outputs are the child's word; the mapping's extent is the driver's.
    An entry that reaches past its allocation is refused before anything is read (a fault in the gather would end
    the helper's context), and the helper still reads the child's real memory afterwards."""
    import ctypes
    import struct
    import time

    import protocol
    run = tmp_path / "ref"
    run.mkdir()
    (run / "model.py").write_text(PROBLEMS["relu"])
    spec = dict(backend="cuda", seed0=1, mode="reference", reference=str(run / "model.py"), seeds=[1, 2], n_checks=0,
                budget_mb=64, outputs=False)
    child = env.Child(spec, run, "cuda", env.Config(backend="cuda"))
    try:
        first = child.answer()[0]
        assert protocol.probe_reads(child, first["probe"]), "no device reads here"
        addr, nbytes, size, base = struct.unpack_from("<4Q", bytes.fromhex(first["probe"]))
        handle = bytes.fromhex(first["probe"])[32:]
        lib, target = protocol.native(), child.read_target()
        rand = (ctypes.c_ulonglong * 16)(*range(16))

        def read(a, n):
            table = struct.pack("<4Q", a, n, 1, base) + handle
            msg = protocol._frame({}, [len(table)]) + table
            got, err = ctypes.create_string_buffer(16), ctypes.c_longlong()
            return lib.read_outputs(*target, msg, len(msg), rand, 16, 16, got, 16, time.monotonic_ns() + 10**10,
                                    ctypes.byref(err)), got.raw
        assert read(addr, 16) == (16, bytes.fromhex(child.key))
        for a, n in ((addr, 1 << 40), (base + (1 << 40), 16), (base - 4096, 16), (addr, 2**64 - 1)):
            assert read(a, n)[0] == -6, (a - base, n)
        assert read(addr, 16) == (16, bytes.fromhex(child.key))  # (the helper's context is intact)
    finally:
        child.close()
