"""env.py on the CPU backend: honest kernels accepted, cheating kernels rejected, faults contained.

Every workspace here uses the same kernel source (tests/env_cases/ops.cpp, one function per case),
so the suite pays for one g++ build of a torch extension; the content-hash cache serves the rest.
"""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import env

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "env_cases"
OPS = (CASES / "ops.cpp").read_text()
RELU = (ROOT / "examples" / "relu.py").read_text()
PROBLEMS = {"relu": RELU, **{p: (CASES / f"{p}.py").read_text() for p in ("add", "softmax", "matmul", "tuple_out")}}
# (constructor signature, __init__ body, forward signature) per problem, as Model declares them
SIGS = {"relu": ("dim", "self.scale = nn.Parameter(torch.empty(dim))", "x"), "add": ("", "pass", "a, b"),
        "softmax": ("", "pass", "x"), "matmul": ("", "pass", "a, b"), "tuple_out": ("", "pass", "x")}


def model_new(problem, body, header="", init_extra=""):
    """A ModelNew for `problem` whose forward returns `body`."""
    args, init, fwd = SIGS[problem]
    lines = ["import torch", "import torch.nn as nn", "import cuda_extension", header, "", "",
             "class ModelNew(nn.Module):",
             f"    def __init__(self{', ' + args if args else ''}):",
             "        super().__init__()",
             f"        {init}",
             f"        {init_extra}",
             "",
             f"    def forward(self, {fwd}):",
             f"        return {body}", ""]
    return "\n".join(lines)


def make_ws(tmp_path, problem, source, kernels=None, name="ws"):
    ws = tmp_path / name
    (ws / "kernels").mkdir(parents=True)
    (ws / "model.py").write_text(PROBLEMS[problem])
    (ws / "model_new.py").write_text(source)
    for rel, text in (kernels if kernels is not None else {"ops.cpp": OPS}).items():
        (ws / "kernels" / rel).write_text(text)
    return ws


# ------------------------------------------------------------------ honest kernels
HONEST = [
    ("relu", "cuda_extension.relu_scale(x, self.scale)", "profile"),
    ("add", "cuda_extension.add(a, b)", "verify"),
    ("softmax", "cuda_extension.softmax_lastdim(x)", "verify"),
    ("matmul", "cuda_extension.matmul(a, b)", "verify"),
    ("tuple_out", "tuple(cuda_extension.double_and_rowsum(x))", "profile"),
]


@pytest.mark.parametrize("problem,body,stage", HONEST, ids=[h[0] for h in HONEST])
def test_honest_kernels_are_accepted(tmp_path, problem, body, stage):
    v = env.evaluate(make_ws(tmp_path, problem, model_new(problem, body)), backend="cpu", stage=stage)
    assert v.compiled and v.correct and not v.violations and v.error is None, v.summary()
    assert v.reward >= 1
    if stage == "profile":
        assert v.runtime_ms > 0 and v.eager_ms > 0 and v.compile_ms > 0
        assert v.speedup_eager == pytest.approx(v.eager_ms / v.runtime_ms)
        assert v.reward == env.reward_for(True, v.runtime_ms, v.eager_ms, v.compile_ms)


# ------------------------------------------------------------------ cheats: each must get reward -1
CHEATS = {
    # PyTorch fallback, seen by the run-time dispatch monitor
    "torch_add_in_python": ("add", model_new("add", "torch.add(a, b)"), "aten.add"),
    "tensor_method_in_python": ("relu", model_new("relu", "(x * self.scale).relu()"), "aten.mul"),
    "functional_in_python": ("softmax", model_new("softmax", "F.softmax(x, -1)", "import torch.nn.functional as F"), "aten._softmax"),
    "torch_op_called_from_cpp": ("add", model_new("add", "cuda_extension.add_by_fallback(a, b)"), "aten.add"),
    "decoy_kernel": ("relu", model_new("relu", "(cuda_extension.relu_scale(x, self.scale), torch.relu(x * self.scale))[1]"), "aten.mul"),
    "precision_downcast": ("relu", model_new("relu", "cuda_extension.relu_scale(x.half().float(), self.scale)"), "aten._to_copy"),
    # caching and skipped work, caught by re-checking every timed run with fresh values in the same buffers
    "pointer_keyed_cache": ("relu", model_new("relu", "cuda_extension.relu_scale_cached(x, self.scale)"), "timed run"),
    "work_only_first_calls": ("relu", model_new("relu", "cuda_extension.relu_scale_first_calls(x, self.scale)"), "timed run"),
    # output tricks
    "mutates_inputs": ("relu", model_new("relu", "cuda_extension.relu_scale_inplace(x, self.scale)"), "mutated its inputs"),
    "lazy_tensor_subclass": ("relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale).as_subclass(Lazy)",
                                              "class Lazy(torch.Tensor):\n    pass"), "not a plain torch.Tensor"),
    "reuse_freed_reference_memory": ("relu", model_new("relu", "torch.empty_like(x)"), "values differ"),
    "hard_coded_test_inputs": ("relu", model_new(
        "relu", "cuda_extension.copy_of(self.answer)",
        init_extra="g = torch.Generator().manual_seed(0); self.answer = torch.relu(torch.randn(64, 4096, generator=g))"),
        "values differ"),
    # static: certain cheats rejected before anything is built
    "monkeypatch_allclose": ("relu", model_new("relu", "torch.empty_like(x)", "torch.allclose = lambda *a, **k: True"), "monkey-patching"),
    "monkeypatch_timer": ("relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)",
                                            "import time\ntime.perf_counter = lambda: 0.0"), "import of time"),
    "numpy_compute": ("relu", model_new("relu", "torch.from_numpy(np.maximum(x.numpy() * 1, 0))", "import numpy as np"), "imports numpy"),
    "numpy_without_import": ("relu", model_new("relu", "cuda_extension.copy_of(x.new_tensor(x.numpy().clip(0)))"), ".numpy"),
    "introspection_via_os": ("relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)", "import os"), "import of os"),
    "dunder_import": ("relu", model_new("relu", "__import__('numpy')", ""), "__import__"),
}
CPP_CHEATS = {  # kernel sources that the static scan rejects (no build needed)
    "cpp_torch_matmul": ("#include <torch/extension.h>\ntorch::Tensor f(torch::Tensor a, torch::Tensor b)"
                         " { return torch::matmul(a, b); }\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"matmul\", &f); }",
                         "PyTorch compute op"),
    "cpp_side_thread": ("#include <torch/extension.h>\n#include <thread>\nvoid go() { std::thread t([]{}); t.detach(); }\n"
                        "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"matmul\", &go); }", "threads are not allowed"),
    "cpp_calls_python": ("#include <torch/extension.h>\nvoid go() { pybind11::module_::import(\"gc\"); }\n"
                         "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"matmul\", &go); }", "calling Python from C++"),
    "cpp_reads_outside": ("#include </etc/passwd>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}", "reaches outside the workspace"),
}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheats_are_rejected(tmp_path, name):
    problem, source, expect = CHEATS[name]
    v = env.evaluate(make_ws(tmp_path, problem, source), backend="cpu")
    assert v.reward == -1 and not v.correct, v.summary()
    said = " ".join(v.violations) + " " + (v.error or "")
    assert expect in said, v.summary()


@pytest.mark.parametrize("name", sorted(CPP_CHEATS))
def test_cpp_cheats_are_rejected_before_building(tmp_path, name):
    source, expect = CPP_CHEATS[name]
    ws = make_ws(tmp_path, "matmul", model_new("matmul", "cuda_extension.matmul(a, b)"), {"ops.cpp": source})
    v = env.evaluate(ws, backend="cpu")
    assert v.reward == -1 and not v.compiled and expect in " ".join(v.violations), v.summary()


def test_editing_the_reference_is_a_violation(tmp_path):
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.copy_of(x)"))
    (ws / "model.py").write_text(RELU.replace("torch.relu(x * self.scale)", "x"))  # make the task trivial
    v = env.evaluate(ws, backend="cpu", reference=RELU)
    assert v.reward == -1 and any("model.py was modified" in x for x in v.violations)


def test_stray_files_have_no_effect(tmp_path):
    """A sitecustomize.py / torch.py that would make every comparison pass is never loaded."""
    ws = make_ws(tmp_path, "relu", model_new("relu", "torch.empty_like(x)"))
    patch = "import torch\ntorch.allclose = lambda *a, **k: True\ntorch.isclose = lambda a, b, **k: torch.ones_like(a, dtype=torch.bool)\n"
    for name in ("sitecustomize.py", "usercustomize.py", "torch.py", "kernels/sitecustomize.py"):
        (ws / name).write_text(patch)
    files, _ = env.collect(ws, "cpu")
    assert set(files) == {"kernels/ops.cpp"}
    v = env.evaluate(ws, backend="cpu", stage="verify")
    assert v.reward == -1 and "values differ" in (v.error or ""), v.summary()


# ------------------------------------------------------------------ faults: contained, with a useful error
FAULTS = {
    "segfault": ("cuda_extension.segfault(x)", {}, "segmentation fault"),
    "infinite_loop": ("cuda_extension.spin(x)", {"timeout": 20}, "timed out"),
    "huge_allocation": ("cuda_extension.huge_alloc(x)", {"mem_gb": 2}, ""),
    "exception_in_kernel": ("cuda_extension.throws(x)", {}, "this kernel always fails"),
    "megabytes_of_output": ("cuda_extension.spew(x)", {}, ""),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_faults_are_contained(tmp_path, name):
    body, kw, expect = FAULTS[name]
    t0 = time.monotonic()
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", body)), backend="cpu", stage="verify", **kw)
    assert v.reward == -1 and v.error and expect in v.error, v.summary()
    assert len(v.log) < 5000  # megabytes of output never reach the agent
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("source,expect", [
    ("import torch\nclass ModelNew(torch.nn.Module:\n    pass\n", "SyntaxError"),
    ("import torch\nimport torch.nn as nn\nimport cuda_extension\nclass ModelNew(nn.Module):\n"
     "    def __init__(self, dim):\n        super().__init__()\n        raise ValueError('boom in init')\n", "boom in init"),
    ("import torch\nimport torch.nn as nn\nimport cuda_extension\nclass ModelNew(nn.Module):\n"
     "    def __init__(self, dim):\n        super().__init__()\n    def forward(self, x):\n        return x\n", "parameters differ"),
], ids=["syntax_error", "exception_in_init", "wrong_parameters"])
def test_python_faults(tmp_path, source, expect):
    v = env.evaluate(make_ws(tmp_path, "relu", source), backend="cpu", stage="verify")
    assert v.reward == -1 and expect in (v.error or "") + " ".join(v.hints), v.summary()


def test_missing_files_and_compile_errors(tmp_path):
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"), {}, name="empty")
    v = env.evaluate(ws, backend="cpu")
    assert v.reward == -1 and not v.compiled and "no kernel sources" in v.log
    (ws / "model_new.py").unlink()
    assert env.evaluate(ws, backend="cpu").error == "model_new.py is missing"
    broken = "int broken( {\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n"
    ws = make_ws(tmp_path, "relu", model_new("relu", "x"), {"bad.cpp": broken}, name="broken")
    v = env.evaluate(ws, backend="cpu")
    assert not v.compiled and v.error == "compilation failed" and "error" in v.log and v.log.count("\n") < 20
    two = {"a.cpp": "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}", "b.cpp": "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}"}
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "x"), two, name="two"), backend="cpu")
    assert not v.compiled and "exactly one must" in v.log


def test_a_killed_build_leaves_nothing_behind(tmp_path):
    """A build stopped half-way (compile timeout) leaves no lock or half-built object: the next build of
    the same source starts from scratch and is not blocked."""
    files = {"kernels/ops.cpp": OPS + f"\n// nonce {os.urandom(8).hex()}\n"}
    for _ in range(2):
        t0 = time.monotonic()
        b = env.build(files, "cpu", timeout=3)
        assert not b.ok and "timed out" in b.log and time.monotonic() - t0 < 30
    assert not list((env.CACHE_DIR / "obj").glob("*.part"))


def test_editing_one_kernel_rebuilds_only_that_file(tmp_path):
    helper = 'extern "C" float helper_value() { return %s; }\n'
    stamp = time.time()
    b1 = env.build({"kernels/ops.cpp": OPS, "kernels/helper.cpp": helper % f"{stamp}f"}, "cpu")
    assert b1.ok and "kernels/helper.cpp" in b1.rebuilt, b1.log
    edited = {"kernels/ops.cpp": OPS, "kernels/helper.cpp": helper % f"{stamp + 1}f"}
    b2 = env.build(edited, "cpu")
    assert b2.ok and b2.rebuilt == ["kernels/helper.cpp"] and b2.so_path != b1.so_path
    b3 = env.build(edited, "cpu")  # unchanged sources: nothing is rebuilt, the same module is served
    assert b3.ok and b3.rebuilt == [] and b3.so_path == b2.so_path


# ------------------------------------------------------------------ the sandbox itself
def test_sandbox_contains_fork_bomb_network_and_writes(tmp_path):
    cwd = tmp_path / "box"
    cwd.mkdir()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = env.run_sandboxed([sys.executable, "-c", bomb], cwd, timeout=5)
    assert r.timed_out
    # the parent survives and can still start processes
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True).stdout == "1\n"

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    outside = tmp_path / "outside.txt"
    probe = textwrap.dedent(f"""\
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2); print("NET OPEN")
        except OSError as e:
            print("NET BLOCKED")
        try:
            open({str(outside)!r}, "w").write("x"); print("WRITE OPEN")
        except OSError:
            print("WRITE BLOCKED")
        open("inside.txt", "w").write("ok")
        print("DONE")
        """)
    r = env.run_sandboxed([sys.executable, "-c", probe], cwd, timeout=30)
    server.close()
    assert "DONE" in r.stdout and (cwd / "inside.txt").read_text() == "ok"
    iso = env.isolation()
    if "--net" in iso:
        assert "NET BLOCKED" in r.stdout
    if "--mount" in iso:
        assert "WRITE BLOCKED" in r.stdout and not outside.exists()


def test_a_normal_evaluation_still_succeeds_after_the_faults(tmp_path):
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)")), backend="cpu")
    assert v.correct and v.reward >= 1, v.summary()


# ------------------------------------------------------------------ the CUDA-Agent workspace layout (CPU flavour)
def registry_ws(tmp_path, backend):
    src = CASES / "registry"
    ws = tmp_path / "registry_ws"
    (ws / "kernels").mkdir(parents=True)
    for f in ("binding.cpp", "binding_registry.h", "model.py"):
        (ws / f).write_text((src / f).read_text())
    (ws / "model_new.py").write_text((src / "model_new.py").read_text())
    (ws / "kernels" / "axpby_binding.cpp").write_text((src / f"axpby_binding_{backend}.cpp").read_text())
    kernel = "axpby.cu" if backend == "cuda" else "axpby.cpp"
    (ws / "kernels" / kernel).write_text((src / kernel).read_text())
    return ws


def test_cuda_agent_layout_cpu(tmp_path):
    v = env.evaluate(registry_ws(tmp_path, "cpu"), backend="cpu")
    assert v.compiled and v.correct and v.reward >= 1, v.summary()


@pytest.mark.gpu
def test_cuda_agent_layout_gpu(tmp_path):
    v = env.evaluate(registry_ws(tmp_path, "cuda"), backend="cuda")
    assert v.compiled and v.correct and v.reward >= 1, v.summary()


# ------------------------------------------------------------------ command line
def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "env.py"), *args], capture_output=True, text=True, timeout=900)


def test_cli_new_then_eval(tmp_path):
    ws = tmp_path / "cli_ws"
    r = run_cli("new", str(ws), "--problem", str(ROOT / "examples" / "relu.py"), "--backend", "cpu")
    assert r.returncode == 0 and (ws / "model.py").exists() and (ws / "model_new.py").exists()
    assert list((ws / "kernels").iterdir()) == []
    # the starter compiles nothing yet: a verdict, not a crash
    r = run_cli("eval", str(ws), "--json")
    assert r.returncode == 0
    v = json.loads(r.stdout.strip().splitlines()[-1])
    assert v["reward"] == -1 and v["compiled"] is False
    # the example solution, copied in, is correct
    for f in (ROOT / "examples" / "relu_cpu").rglob("*"):
        if f.is_file() and f.name != "model.py":
            (ws / f.relative_to(ROOT / "examples" / "relu_cpu")).write_text(f.read_text())
    r = run_cli("eval", str(ws), "--json", "--backend", "cpu")
    v = json.loads(r.stdout.strip().splitlines()[-1])
    keys = {"compiled", "correct", "reward", "runtime_ms", "eager_ms", "compile_ms", "speedup_eager", "speedup_compile",
            "violations", "error"}
    assert keys <= set(v) and v["correct"] and v["reward"] >= 1, r.stdout


@pytest.mark.parametrize("args,expect", [
    (["eval", "/nonexistent/ws"], "no such workspace"),
    (["eval", "{tmp}", "--backend", "tpu"], "unknown backend"),
    (["eval", "{tmp}"], "has no model.py"),
    (["new", "{tmp}/x", "--problem", "/nonexistent.py"], "no such problem file"),
])
def test_cli_usage_errors(tmp_path, args, expect):
    r = run_cli(*[a.format(tmp=tmp_path) for a in args])
    assert r.returncode != 0 and expect in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_reward_milestones():
    assert env.reward_for(False, 1.0, 2.0, 2.0) == -1
    assert env.reward_for(True, 1.0, 2.0, 2.0) == 3
    assert env.reward_for(True, 1.0, 2.0, 1.0) == 2
    assert env.reward_for(True, 1.0, 1.04, 1.04) == 1  # within the 5% margin is not faster
    assert env.reward_for(True, 0.94, 1.0, 1.0) == 3
    assert env.reward_for(True, 1.0, 1.0, 2.0) == 1  # beating compile but not eager gives no bonus
