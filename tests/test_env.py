"""env.py on the CPU backend: honest kernels accepted, cheating kernels rejected, faults contained.

Every workspace here uses the same kernel source (tests/env_cases/ops.cpp, one function per case),
so the suite pays for one g++ build of a torch extension; the content-hash cache serves the rest.
"""
import contextlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import build as builder
import env
import protocol
import scan
import sandbox

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "env_cases"
OPS = (CASES / "ops.cpp").read_text()
RELU = (ROOT / "examples" / "relu.py").read_text()
PROBLEMS = {"relu": RELU, **{p: (CASES / f"{p}.py").read_text() for p in ("add", "softmax", "softmax_wide", "matmul", "tuple_out")}}
# (constructor signature, __init__ body, forward signature) per problem, as Model declares them
SIGS = {"relu": ("dim", "self.scale = nn.Parameter(torch.empty(dim))", "x"), "add": ("", "pass", "a, b"),
        "softmax": ("", "pass", "x"), "softmax_wide": ("", "pass", "x"), "matmul": ("", "pass", "a, b"),
        "tuple_out": ("", "pass", "x")}


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


def test_an_output_of_the_wrong_shape_is_named_in_the_error(tmp_path):
    """An output more than twice the reference's size is refused unread; the error says so and gives the reference's
    shape (what a policy needs to fix it), not "a malformed reply"."""
    src = model_new("softmax", "torch.empty(x.shape[0], x.shape[1] * 8)")
    v = env.evaluate(make_ws(tmp_path, "softmax", src), backend="cpu", stage="verify")
    assert v.reward == -1 and not v.correct, v.summary()
    assert "a reply of the candidate is 4,194,304 bytes, over the 2,097,152 it may send (its outputs may take about " \
        "twice the reference's, shape (256, 512) float32)" in v.error, v.error


# ------------------------------------------------------------------ cheats: each must get reward -1
CHEATS = {
    # PyTorch fallback: refused by model_new.py's allow-list, or seen by the run-time dispatch monitor
    "torch_add_in_python": ("add", model_new("add", "torch.add(a, b)"), "torch.add is not allowed"),
    "tensor_method_in_python": ("relu", model_new("relu", "(x * self.scale).relu()"), "aten.mul"),
    "functional_in_python": ("softmax", model_new("softmax", "F.softmax(x, -1)", "import torch.nn.functional as F"), "aten._softmax"),
    "decoy_kernel": ("relu", model_new("relu", "(cuda_extension.relu_scale(x, self.scale), (x * self.scale).relu())[1]"), "aten.mul"),
    "precision_downcast": ("relu", model_new("relu", "cuda_extension.relu_scale(x.half().float(), self.scale)"), "aten._to_copy"),
    # caching and skipped work, caught by re-checking every timed run with fresh values in the same buffers
    "pointer_keyed_cache": ("relu", model_new("relu", "cuda_extension.relu_scale_cached(x, self.scale)"), "values differ"),  # same buffers in every check
    "work_only_first_calls": ("relu", model_new("relu", "cuda_extension.relu_scale_first_calls(x, self.scale)"), "timed run"),
    # output tricks
    "mutates_inputs": ("relu", model_new("relu", "cuda_extension.relu_scale_inplace(x, self.scale)"), "mutated its inputs"),
    "lazy_tensor_subclass": ("relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale).as_subclass(Lazy)",
                                              "class Lazy(torch.Tensor):\n    pass"), "must derive from nn.Module"),
    "reuse_freed_reference_memory": ("relu", model_new("relu", "torch.empty_like(x)"), "values differ"),
    "hard_coded_test_inputs": ("relu", model_new(
        "relu", "cuda_extension.copy_of(self.answer)",
        init_extra="self.answer = torch.randn(64, 4096).clamp(min=0)"), "aten.clamp"),
    # certain cheats refused before anything is built
    "monkeypatch_allclose": ("relu", model_new("relu", "torch.empty_like(x)", "torch.allclose = lambda *a, **k: True"), "torch.allclose is not allowed"),
    "monkeypatch_timer": ("relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)",
                                            "import time\ntime.perf_counter = lambda: 0.0"), "import of time"),
    "numpy_compute": ("relu", model_new("relu", "torch.from_numpy(np.maximum(x.numpy() * 1, 0))", "import numpy as np"), "import of numpy"),
    "numpy_without_import": ("relu", model_new("relu", "cuda_extension.copy_of(x.new_tensor(x.numpy().clip(0)))"), ".numpy"),
    "introspection_via_os": ("relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)", "import os"), "import of os"),
    "dunder_import": ("relu", model_new("relu", "__import__('numpy')", ""), "__import__"),
}
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheats_are_rejected(tmp_path, name):
    problem, source, expect = CHEATS[name]
    v = env.evaluate(make_ws(tmp_path, problem, source), backend="cpu")
    assert v.reward == -1 and not v.correct, v.summary()
    said = " ".join(v.violations) + " " + (v.error or "")
    assert expect in said, v.summary()


TORCH_H = "#include <torch/extension.h>\n"
MODULE = "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"matmul\", &f); }\n"
CPP_CHEATS = {  # kernel sources that the preprocessed scan (or, once linked, the import check) refuses
    "cpp_torch_matmul": (TORCH_H + "torch::Tensor f(torch::Tensor a, torch::Tensor b) { return torch::matmul(a, b); }\n" + MODULE,
                         "torch::matmul is not allowed"),
    "cpp_side_thread": (TORCH_H + "#include <thread>\nvoid f() { std::thread t([]{}); t.detach(); }\n" + MODULE, "`thread` is not allowed"),
    "cpp_calls_python": (TORCH_H + "void f() { pybind11::module_::import(\"gc\"); }\n" + MODULE, "`import` is not allowed"),
    "cpp_reads_outside": ("#include </etc/passwd>\n" + MODULE, "`#include </etc/passwd>` is not allowed"),
    "torch_op_called_from_cpp": (TORCH_H + "torch::Tensor f(torch::Tensor a, torch::Tensor b) { return a.add(b); }\n" + MODULE,
                                 "aten.add"),
}


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


def test_a_hanging_run_is_stopped_at_its_own_deadline(tmp_path):
    """A kernel that never returns keeps the device (timed runs) or a live candidate (checks: every new task's
    baselines wait for it) until its child is stopped: one command's deadline, not the verdict's 300 s."""
    t0 = time.monotonic()
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.spin(x)")), backend="cpu",
                     stage="verify", run_timeout=3)
    assert v.reward == -1 and "timed out: one `run` took longer than 3 s" in (v.error or ""), v.summary()
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
    ws = make_ws(tmp_path, "relu", model_new("relu", "x"), {"ops.cpp": OPS, "bad.cpp": "int broken( {\n"}, name="broken")
    v = env.evaluate(ws, backend="cpu")
    assert not v.compiled and v.error == "compilation failed" and "error" in v.log and v.log.count("\n") < 20
    two = {"a.cpp": "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}", "b.cpp": "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}"}
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "x"), two, name="two"), backend="cpu")
    assert not v.compiled and "exactly one source must" in v.log


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


def test_a_source_compiles_as_soon_as_its_own_scan_passes(monkeypatch):
    """The binding files' compiles (seconds) do not wait for the slowest scan: slow.cpp's preprocessing waits until
    fast.cpp's compile has started (it never starts when every compile waits for every scan: the wait runs out)."""
    nonce = os.urandom(8).hex()
    files = {"kernels/fast.cpp": OPS + f"\n// nonce {nonce}\n", "kernels/slow.cpp": f"int slow_{nonce}() {{ return 1; }}\n"}
    started, real_pp, real_run = threading.Event(), builder.preprocess, builder.run_sandboxed

    def preprocess(tc, src, out, timeout, pch=None):
        if src.name == "slow.cpp":
            started.wait(60)
        return real_pp(tc, src, out, timeout, pch)

    def run_sandboxed(cmd, *a, **k):
        if "-c" in cmd and any(str(c).endswith(".ii") for c in cmd) and not started.is_set():
            started.set()  # (only fast.cpp has been scanned by now)
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(builder, "preprocess", preprocess)
    monkeypatch.setattr(builder, "run_sandboxed", run_sandboxed)
    t0 = time.monotonic()
    b = env.build(files, "cpu")
    assert b.ok and b.rebuilt == ["kernels/fast.cpp", "kernels/slow.cpp"], b.log
    assert started.is_set() and time.monotonic() - t0 < 60


def test_a_cu_include_resolves_in_the_compile_as_in_the_scan():
    """nvcc preprocesses a .cu again when it compiles it: with the include folders in another order, `#include
    <x.h>` was scanned as kernels/x.h and compiled as ./x.h, a file no scan had read."""
    if shutil.which(builder.toolchain("cuda")["nvcc"][0]) is None:
        pytest.skip("no nvcc")
    nonce = os.urandom(8).hex()
    files = {"kernels/x.h": f"inline int benign_{nonce}() {{ return 1; }}\n",
             "x.h": "int never_scanned_text(;\n",  # (a syntax error: the compile says so if it reads this file)
             "kernels/op.cu": f"#include <x.h>\nint use_{nonce}() {{ return benign_{nonce}(); }}\n",
             "binding.cpp": "#include <pybind11/pybind11.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n"}
    b = env.build(files, "cuda")  # (the link may fail without a CUDA build of torch: what matters is the compile)
    assert "never_scanned_text" not in b.log and "kernels/op.cu" in b.rebuilt, b.log


def test_a_cu_whose_compiled_text_differs_from_the_scanned_one_is_refused(monkeypatch):
    """What a directive sees may differ between the scan's preprocessing and nvcc's own (`__has_include` of a file
    that exists only while nvcc runs: its temporary files, a /proc entry): nvcc's host text, kept with --keep, must
    be the scanned text. Here the scan alone gets a -D flag, so an #ifdef picks code only the compile reads."""
    if shutil.which(builder.toolchain("cuda")["nvcc"][0]) is None:
        pytest.skip("no nvcc")
    real = builder.preprocess
    monkeypatch.setattr(builder, "preprocess", lambda tc, src, out, timeout, pch=None: real(
        dict(tc, nvcc_pp=[*tc["nvcc_pp"], "-DSCAN_ONLY"]) if src.suffix == ".cu" else tc, src, out, timeout, pch))
    nonce = os.urandom(8).hex()
    files = {"kernels/op.cu": f"#ifdef SCAN_ONLY\nint scanned_{nonce}() {{ return 1; }}\n#else\n"
                              f"int compiled_{nonce}() {{ return 2; }}\n#endif\n",
             "binding.cpp": "#include <pybind11/pybind11.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n"}
    b = env.build(files, "cuda")
    assert not b.ok and any("not the text that was scanned" in x for x in b.violations), b.log
    assert "kernels/op.cu" not in b.rebuilt, b.rebuilt


def test_a_build_says_where_its_time_went():
    """Build.steps (bench/env_bench.py's split of a cold build): each compiled source's scan and compile, the link and
    the module's checks, which run one after the other for one source; a cached build has none of them."""
    files = {"kernels/ops.cpp": OPS + f"\n// nonce {os.urandom(8).hex()}\n"}
    b = env.build(files, "cpu")
    assert b.ok and b.rebuilt == ["kernels/ops.cpp"], b.log
    chain = ("scan kernels/ops.cpp", "compile kernels/ops.cpp", "link", "module checks")
    assert set(chain) <= set(b.steps) and all(b.steps[k] > 0 for k in chain), b.steps
    assert sum(b.steps[k] for k in chain) <= b.seconds + 0.01, (b.steps, b.seconds)
    again = env.build(files, "cpu")
    assert again.ok and again.rebuilt == [] and not set(chain) & set(again.steps), again.steps


def test_a_refused_build_caches_none_of_its_objects():
    """Sources compile before every scan of the build is in, but an object enters the cache only once they all
    passed: a build that one source's violation refuses reports nothing compiled and leaves nothing to reuse."""
    nonce = os.urandom(8).hex()
    clean = {"kernels/ops.cpp": OPS + f"\n// nonce {nonce}\n"}
    b = env.build({**clean, "kernels/bad.cpp": 'int f() { return system("id"); }\n'}, "cpu")
    assert not b.ok and b.violations and b.rebuilt == [], b.log
    assert not list((env.CACHE_DIR / "obj").glob("*.part"))
    again = env.build(clean, "cpu")
    assert again.ok and again.rebuilt == ["kernels/ops.cpp"], again.log  # compiled afresh: nothing was cached


# ------------------------------------------------------------------ the sandbox itself
def sandboxed_python(way, code, cwd, timeout, **kw):
    """Python `code` in a sandboxed child, exec'ed (`python -c`) or forked from the fork server (as verdict children are)."""
    fork = {"preload": protocol.FORK_PRELOAD, "call": ["builtins", "exec", [code, {}]]} if way == "fork" else None
    return env.run_sandboxed([sys.executable, "-c", code], cwd, timeout=timeout, fork=fork, **kw)


@pytest.mark.parametrize("way", ["exec", "fork"])
def test_trusted_children_compile_in_their_own_process_with_the_shared_caches(tmp_path, way):
    """A reference child's torch.compile uses the shared inductor cache and no compile-worker pool (a process per
    core, each importing torch, for the one graph a child compiles): the settings env.py passes (run_sandboxed's
    env=) reach a child exec'ed, or forked from the fork server as verdict children are."""
    (tmp_path / "box").mkdir()
    extra, writable = env.compile_caches()
    probe = ("import torch._inductor.config as c, os\n"
             "print('threads', c.compile_threads, 'cache', os.environ.get('TORCHINDUCTOR_CACHE_DIR'))\n")
    r = sandboxed_python(way, probe, tmp_path / "box", 120, writable=writable, env=extra)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"threads 1 cache {env.CACHE_DIR / 'inductor'}" in r.stdout, r.stdout


@pytest.mark.parametrize("way", ["exec", "fork"])
def test_sandbox_contains_fork_bomb_network_and_writes(tmp_path, way):
    cwd = tmp_path / "box"
    cwd.mkdir()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = sandboxed_python(way, bomb, cwd, 5)
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
    r = sandboxed_python(way, probe, cwd, 30)
    server.close()
    assert "DONE" in r.stdout and (cwd / "inside.txt").read_text() == "ok"
    iso = env.isolation()
    if "--net" in iso.prefix:
        assert "NET BLOCKED" in r.stdout
    if iso.mount:  # (a write may land in the sandbox's own /tmp, never on the host)
        assert not outside.exists()


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


def registry_files(binding_extra: str = "") -> dict:
    """The CPU registry layout as a files dict for env.build, nothing of it cached (a fresh comment in every source);
    binding_extra: C++ added to kernels/axpby_binding.cpp before its REGISTER_BINDING line."""
    src, nonce = CASES / "registry", f"// nonce {os.urandom(8).hex()}\n"
    binding = (src / "axpby_binding_cpu.cpp").read_text()
    return {"binding.cpp": (src / "binding.cpp").read_text() + nonce, "binding_registry.h": (src / "binding_registry.h").read_text(),
            "kernels/axpby_binding.cpp": binding.replace("REGISTER_BINDING(axpby, axpby);",
                                                         binding_extra + "REGISTER_BINDING(axpby, axpby);") + nonce,
            "kernels/axpby.cpp": (src / "axpby.cpp").read_text() + nonce}


def spy_pch(monkeypatch) -> list:
    """The `light` argument of every builder.torch_pch call from here on."""
    wanted, real = [], builder.torch_pch
    monkeypatch.setattr(builder, "torch_pch", lambda tc, timeout, light=False: (wanted.append(light), real(tc, timeout, light))[1])
    return wanted


def test_binding_files_compile_from_the_precompiled_torch_header():
    """The files that include torch/extension.h (binding.cpp through binding_registry.h) are preprocessed with the
    header precompiled, and the text compiled is the one scanned plus our pragma; the pure kernel file is not
    given the header."""
    files = registry_files()
    b = env.build(files, "cpu")
    assert b.ok and b.pch == ["binding.cpp", "kernels/axpby_binding.cpp"], (b.pch, b.log)
    assert b.whole_header == [], b.whole_header  # (the light header holds what a binding uses)
    assert sorted(b.rebuilt) == sorted(files.keys() - {"binding_registry.h"})


def test_prepare_makes_what_a_first_build_would_wait_for(monkeypatch):
    """build.prepare (train.py runs it beside the model's loading) precompiles the light header and probes the
    module's expansion: the next build starts from both and makes neither."""
    monkeypatch.setattr(builder, "LIGHT_HEADER", builder.LIGHT_HEADER + f"// {os.urandom(4).hex()}\n")
    made = builder.prepare("cpu")
    assert made["precompiled header"] > 0.5, made  # (a light header never built before: made now)
    tc = builder.toolchain("cpu")
    assert (env.CACHE_DIR / "scan" / f"module-{tc['id']}.cpp.json").is_file()
    b = env.build(registry_files(), "cpu")
    assert b.ok and b.pch == ["binding.cpp", "kernels/axpby_binding.cpp"], (b.pch, b.log)
    assert b.steps["precompiled header"] < 0.1 and b.steps["toolchain"] < 0.1, b.steps
    assert builder.prepare("cpu")["precompiled header"] < 0.1  # (once per toolchain)


def test_the_cuda_backends_host_glue_compiles_at_O1_its_kernels_at_O3():
    """On the CUDA backend g++ compiles host glue only (.cpp: checks, allocation, the launcher's call), nvcc the GPU
    code: -O1 for the glue makes a binding file's compile ~25% shorter at no cost per call (build.toolchain). The CPU
    backend's .cpp files are its kernels: -O3."""
    if shutil.which(builder.toolchain("cuda")["nvcc"][0]) is None:
        pytest.skip("no nvcc")
    cu, cpu = builder.toolchain("cuda"), builder.toolchain("cpu")
    opt = lambda cmd: [a for a in cmd if a.startswith("-O")]
    assert opt(cu["cxx"]) == ["-O1"] and opt(cu["nvcc"]) == ["-O3"] and opt(cpu["cxx"]) == ["-O3"]


def test_the_light_header_defines_every_macro_of_the_whole_one():
    """A workspace's `#if` reads the same under the light header as under <torch/extension.h>: torch_pch offers it
    only where the macros are the same, and on this toolchain they are."""
    tc = builder.toolchain("cpu")
    light = builder.torch_pch(tc, 600, light=True)
    assert light is not None and light.parent.parent.name.startswith(f"{tc['pch_id']}-light-"), light
    assert builder._probe(tc, str(light.parent.parent), "-dM", 600) == builder._probe(tc, None, "-dM", 600)
    left_out = (light.parent.parent / "whole_only.txt").read_text().split()  # (recorded: a source entering one falls back)
    assert 100 < len(left_out) < 300 and any(h.endswith("/torch/nn/modules/linear.h") for h in left_out), left_out[:5]


def test_a_light_header_without_every_macro_is_not_offered(monkeypatch):
    """The check, failing: a light header that leaves out torch/version.h (TORCH_VERSION_MAJOR...) gives way to the
    whole header."""
    monkeypatch.setattr(builder, "LIGHT_HEADER", builder.LIGHT_HEADER.replace("#include <torch/version.h>\n", "")
                        + f"// {os.urandom(4).hex()}\n")
    tc = builder.toolchain("cpu")
    assert builder.torch_pch(tc, 600, light=True) == env.CACHE_DIR / "pch" / tc["pch_id"] / "torch" / "extension.h.gch"


def test_a_source_that_needs_the_whole_torch_header_compiles_under_it(monkeypatch):
    """torch::ExpandingArray (a type: the scan allows it) is in <torch/extension.h> and not in the light header: the
    source that uses it compiles again under the whole header, and works; the other binding file stays on the
    light one. A source that fails under both reports the whole header's error."""
    wanted = spy_pch(monkeypatch)
    expanded = ("int64_t expanded() {\n  torch::ExpandingArray<2> a(7);\n  return (*a)[0] + (*a)[1];\n}\n"
                "REGISTER_BINDING(expanded, expanded);\n")
    files = registry_files(expanded)
    b = env.build(files, "cpu")
    assert b.ok and b.whole_header == ["kernels/axpby_binding.cpp"], (b.whole_header, b.log)
    assert b.pch == ["binding.cpp", "kernels/axpby_binding.cpp"] and wanted == [True, False], (b.pch, wanted)
    r = subprocess.run([sys.executable, "-c", f"import torch, importlib.util as u; s = u.spec_from_file_location("
                        f"'cuda_extension', {str(b.so_path)!r}); m = u.module_from_spec(s); s.loader.exec_module(m); "
                        "print(m.expanded())"], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["14"], (r.stdout, r.stderr)

    wanted.clear()
    b = env.build(registry_files(expanded.replace("return (*a)[0] + (*a)[1];", "return torch::Tensor();")), "cpu")
    assert not b.ok and "at::Tensor" in b.log and wanted == [True, False], (b.log, wanted)


def test_an_error_that_does_not_involve_torch_is_not_compiled_twice(monkeypatch):
    """A type error in a workspace's own code is the same under both headers: reported from the light header's
    compile, without a second one under the whole header (compile errors are common in RL)."""
    wanted = spy_pch(monkeypatch)
    b = env.build(registry_files("int64_t broken() { int64_t s = \"0\"; return s; }\n"), "cpu")
    assert not b.ok and "invalid conversion" in b.log, b.log
    assert wanted == [True], wanted  # the light header only
    assert builder.TORCH_ERROR_RE.search("x.cpp:3:5: error: ‘Linear’ is not a member of ‘torch::nn’")
    assert builder.TORCH_ERROR_RE.search("x.cpp:3:5: error: no match for ‘operator+’ (operand types are ‘int64_t’ and ‘at::Tensor’)")
    assert not builder.TORCH_ERROR_RE.search("x.cpp:3:5: error: invalid conversion from ‘const char*’ to ‘int64_t’")
    assert not builder.TORCH_ERROR_RE.search("x.cpp:3:5: error: expected ‘;’ at end of member declaration")


@pytest.mark.parametrize("macro", ["#define SQR(x) ((x)*(x))", "#define scale 2"])
def test_a_header_the_light_one_leaves_out_is_judged_under_the_whole_header(macro):
    """<torch/all.h> after a workspace #define: under the whole header its headers are parsed already (before the
    macro: #pragma once skips them), under the light one the C++ frontend's would be parsed under it, where `scale`
    breaks torch/nn/functional/upsampling.h and SQR trips the macro-order check. The source is judged, built and
    compiled as the whole header would; a header that neither has included stays refused after SQR."""
    nonce = f"// nonce {os.urandom(8).hex()}\n"
    src = (f"#include <torch/extension.h>\n{macro}\n#include <torch/all.h>\n"
           "torch::Tensor f(torch::Tensor x) { TORCH_CHECK(x.dim() >= 0, \"rank\"); return x; }\n"
           "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"f\", &f); }\n" + nonce)
    b = env.build({"kernels/b.cpp": src}, "cpu")
    assert b.ok and b.whole_header == ["kernels/b.cpp"], (b.log, b.whole_header)
    if "SQR" in macro:
        b = env.build({"kernels/b.cpp": src.replace("#include <torch/all.h>", "#include <ATen/Dispatch_v2.h>")}, "cpu")
        assert not b.ok and "after the macro SQR" in b.log, b.log


def test_the_light_header_declares_what_a_workspace_may_name(tmp_path):
    """Every torch/at name the scan lets a workspace write resolves the same under the light header as under the
    whole one (a using-declaration per name and root, one per line: the same lines fail under both), and the global
    names of torch's profiler and MPS headers are declared (a workspace may use any name outside torch's roots)."""
    tc = builder.toolchain("cpu")
    light = builder.torch_pch(tc, 600, light=True)
    assert light is not None and light != env.CACHE_DIR / "pch" / tc["pch_id"] / "torch" / "extension.h.gch"
    lines = ["#include <torch/extension.h>"] + [f"namespace n_{root}_{name} {{ using {root}::{name}; }}"
                                               for name in sorted(scan.CPP_ALLOWED_TORCH) for root in ("torch", "at")]
    lines += ["static MTLCommandBuffer_t mtl = nullptr;", "static libkineto::ITraceActivity* act = nullptr;",
              "static CUevent_st* ev = nullptr;", "static DispatchQueue_t q = nullptr;"]
    work = tmp_path
    (work / "names.cpp").write_text("\n".join(lines) + "\n")
    failed = {}
    for kind, first in (("light", [f"-I{light.parent.parent}"]), ("whole", [])):
        r = subprocess.run([tc["cxx"][0], *first, *tc["cxx"][1:], "-fsyntax-only", "names.cpp"], cwd=work,
                           capture_output=True, text=True, timeout=600)
        failed[kind] = sorted({int(m) for m in re.findall(r"^names\.cpp:(\d+):\d+: error", r.stderr, re.M)})
    assert failed["light"] == failed["whole"], failed
    assert len(failed["whole"]) < len(lines) - 10 and not set(failed["whole"]) & set(range(len(lines) - 3, len(lines) + 1)), failed


def test_builds_under_the_whole_header_alone_are_cached_apart():
    """bench/env_bench.py's build under the whole header alone (light=False) is not served to a default build."""
    files = registry_files()
    whole = env.build(files, "cpu", light=False)
    assert whole.ok and len(whole.rebuilt) == 3, whole.log
    b = env.build(files, "cpu")
    assert b.ok and len(b.rebuilt) == 3 and b.pch == ["binding.cpp", "kernels/axpby_binding.cpp"], (b.rebuilt, b.pch)


def test_the_light_headers_probes_can_read_its_folder(monkeypatch):
    """The probes of a light header run sandboxed, where the sandbox drops to another uid (the H200's does): its
    folder and the header in it must be readable by others when they run (a fresh temporary folder is 0700)."""
    modes = []

    def probe(tc, first, what, timeout):
        if first is not None:
            modes.extend(os.stat(p).st_mode & 0o777 for p in (first, f"{first}/torch", f"{first}/torch/extension.h"))
        return None  # (as if the preprocessor failed: the build goes on with the whole header, nothing is built)
    monkeypatch.setattr(builder, "_probe", probe)
    monkeypatch.setattr(builder, "LIGHT_HEADER", builder.LIGHT_HEADER + f"// {os.urandom(4).hex()}\n")
    tc = builder.toolchain("cpu")
    builder.torch_pch(tc, 600, light=True)
    folder, torch_folder, header = modes[:3]  # (each probe of the light header sees the same three)
    assert folder & 0o005 == torch_folder & 0o005 == 0o005 and header & 0o004, [oct(m) for m in modes]


def test_a_precompiled_header_that_runs_out_of_time_is_tried_again():
    """A header build stopped by the calling build's deadline says nothing about the toolchain: the next build tries."""
    tc = dict(builder.toolchain("cpu"), pch_id=f"slow-{os.urandom(4).hex()}")
    assert builder.torch_pch(tc, 1) is None
    assert tc["pch_id"] not in builder._PCH_FAILED and not (env.CACHE_DIR / "pch" / tc["pch_id"]).exists()


def test_a_precompiled_header_that_fails_is_tried_once(monkeypatch):
    """Where the header cannot be precompiled, builds go on without it, and do not try again each time."""
    calls = []
    real = builder.run_sandboxed
    monkeypatch.setattr(builder, "run_sandboxed", lambda cmd, *a, **k: (calls.append(cmd), real(["false"], *a, **k))[1])
    tc = dict(builder.toolchain("cpu"), pch_id=f"fails-{os.urandom(4).hex()}")
    assert builder.torch_pch(tc, 60) is None and builder.torch_pch(tc, 60) is None
    assert len(calls) == 1 and not (env.CACHE_DIR / "pch" / tc["pch_id"]).exists()


@pytest.mark.parametrize("where", ["after", "before"])
def test_the_module_links_the_shared_cxx_runtime(monkeypatch, where):
    """A folder searched for -lstdc++ that holds only a libstdc++.a gives the module its own static copy of the C++
    runtime, beside torch's, with its locale, file and random-device imports (which the import check refuses). On
    the H200 there were two: a CUDA library folder beside torch (after the compiler's own folders) and the compiler's
    own folder, whose libstdc++.so is a dangling link (searched before any folder the link line could add)."""
    static = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(static):
        pytest.skip("no static libstdc++ to put on the link line")
    decoy = env.CACHE_DIR / "obj" / f"decoy-{os.urandom(4).hex()}"  # (the object cache is visible to the linker)
    decoy.mkdir(parents=True)
    (decoy / "libstdc++.a").symlink_to(static)
    (decoy / "libstdc++.so").symlink_to(decoy / "missing" / "libstdc++.so.6")  # dangling, as on the H200
    tc = builder.toolchain("cpu")
    flags = [f"-L{decoy}", *tc["ldflags"]] if where == "before" else [*tc["ldflags"], f"-L{decoy}"]
    monkeypatch.setitem(tc, "ldflags", flags)
    try:
        b = env.build({"kernels/ops.cpp": OPS + f"\n// nonce {os.urandom(8).hex()}\n"}, "cpu")
    finally:
        for f in decoy.iterdir():
            f.unlink()
        decoy.rmdir()
    assert b.ok, b.log
    needed = subprocess.run(["readelf", "-d", str(b.so_path)], capture_output=True, text=True).stdout
    assert "libstdc++.so" in needed, needed


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


# ------------------------------------------------------------------ attack classes: the design that closes each
# 1. Escape from the sandbox: every child (candidate, reference, build, the agent's bash) gets a fresh /proc,
#    read-only /sys, private /tmp and /dev/shm, no capabilities, the cache root hidden.
ESCAPE = r"""
import glob, os, subprocess
found = []
for root in glob.glob("/proc/[0-9]*/root"):  # any process's root that leads back to the host's filesystem
    try:
        open(os.path.join(root, MARK.lstrip("/")), "w").write("x"); found.append("proc-root " + root)
    except OSError:
        pass
for path in ("/sys/fs/cgroup/cgroup.procs", "/sys/fs/cgroup/escape"):
    try:
        open(path, "w").write(str(os.getpid())); found.append("sys " + path)
    except OSError:
        pass
try:
    os.listdir(CACHE) and found.append("cache " + ",".join(os.listdir(CACHE)))
except OSError:
    pass
open("/dev/shm/" + os.path.basename(MARK), "w").write("x")
subprocess.Popen(["setsid", "sleep", "123.456"])  # a survivor, if it could outlive the sandbox
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
if KEYCTL and libc.syscall(KEYCTL, 0, -4, 1) >= 0:  # the user keyring (made if need be): the namespaces share it
    found.append("keyring")
print("FOUND", found)
"""


def escape_probe(tmp_path):
    mark = tmp_path / "outside" / f"written-from-inside-{os.urandom(4).hex()}"
    mark.parent.mkdir()
    keyctl = sandbox.SECCOMP_DENY.get(platform.machine(), (0, {}))[1].get("keyctl")
    return mark, f"MARK = {str(mark)!r}\nCACHE = {str(env.CACHE_DIR)!r}\nKEYCTL = {keyctl}\n" + ESCAPE


def assert_nothing_escaped(mark, out):
    assert "FOUND []" in out, out
    assert not mark.exists() and not Path("/dev/shm", mark.name).exists()
    survivors = subprocess.run(["pgrep", "-f", "sleep 123.456"], capture_output=True, text=True).stdout.split()
    assert survivors == [], "a process outlived its sandbox"


def test_seccomp_refuses_what_the_namespaces_do_not_separate(tmp_path):
    """Every sandboxed child runs under sandbox.SECCOMP_DENY's filter: the kernel keyring (shared across the
    namespaces: a cache could pass from one child to the next), userfaultfd, perf_event_open, bpf and io_uring are
    refused with EPERM, which none of them returns for these arguments without the filter (EFAULT, EINVAL, or a
    keyring's id); and on x86_64 a system call of the x32 ABI (getpid's), so no other ABI's numbers get past it."""
    machine = platform.machine()
    if machine not in sandbox.SECCOMP_DENY:
        pytest.skip(f"no seccomp filter for {machine}")
    calls = sandbox.SECCOMP_DENY[machine][1]
    tries = {"keyctl": (0, -4, 1), "add_key": (b"user", b"k", b"v", 1, -4), "request_key": (b"user", b"k", None, -4),
             "userfaultfd": (0,), "perf_event_open": (None, 0, -1, -1, 0), "bpf": (0, None, 0),
             "io_uring_setup": (1, None), "io_uring_enter": (-1, 0, 0, 0, None, 0), "io_uring_register": (-1, 0, None, 0)}
    assert set(tries) == set(calls)
    each = [(n, calls[n], a) for n, a in tries.items()] + ([("x32 getpid", 0x40000000 | 39, ())] if machine == "x86_64" else [])
    code = ("import ctypes, json\nlibc = ctypes.CDLL(None, use_errno=True)\nout = {}\n"
            f"for name, nr, args in {each}:\n"
            "    ctypes.set_errno(0)\n    out[name] = [libc.syscall(nr, *args), ctypes.get_errno()]\nprint(json.dumps(out))\n")
    r = sandbox.run_sandboxed([sys.executable, "-c", code], tmp_path, 60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert all(v == [-1, 1] for v in got.values()), got
    assert "a seccomp filter" not in sandbox.isolation("cpu").missing


def test_a_child_that_cannot_start_under_the_seccomp_filter_keeps_every_other_layer(monkeypatch):
    """Where a child (here a stand-in GPU driver that needs the kernel keyring) does not start under the filter, the
    probe gives up that one layer, says so, and keeps the namespaces and the rest: children run without the filter
    rather than not at all."""
    machine = platform.machine()
    if machine not in sandbox.SECCOMP_DENY or "--pid" not in sandbox.isolation("cpu").prefix:
        pytest.skip("no seccomp filter or no PID namespace here")
    keyctl = sandbox.SECCOMP_DENY[machine][1]["keyctl"]
    monkeypatch.setattr(sandbox, "_CUDA_PROBE", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                                                f"assert libc.syscall({keyctl}, 0, -4, 1) >= 0")
    found, _ = sandbox._probe_isolation("cuda")
    assert found is not None and found.seccomp is False and "a seccomp filter" in found.missing, found
    assert "--pid" in found.prefix and found.prefix == sandbox.isolation("cpu").prefix, found
    assert sandbox.isolation("cpu").seccomp is True


LINGER = r"""
import mmap, os, sys, time
if os.fork() == 0:  # a process that leaves the killed process group and writes until it dies
    os.setsid()
    while True:
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])  # (whole: a kill between two writes leaves the last one)
        time.sleep(0.002)
big = mmap.mmap(-1, 2 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
open(sys.argv[1] + ".ready", "w").close()
time.sleep(600)  # its exit frees 2 GiB, which takes time: the namespace's other processes live on meanwhile
"""


@pytest.mark.parametrize("path", ["exec", "fork"])
def test_red_team_no_process_of_a_killed_child_outlives_its_run(tmp_path, monkeypatch, path):
    """run_sandboxed returns only when every process of the child's PID namespace is gone, also where it was killed
    and there is no cgroup to empty (an unprivileged trainer, most containers): one that called setsid() left the
    killed process group and lived on while the namespace's PID 1 freed its memory, beside the next child (a
    reference child that holds a verdict's secrets). Here: killed at its time limit, on both ways a child starts."""
    if "--pid" not in sandbox.isolation("cpu").prefix:
        pytest.skip("no PID namespace here")
    monkeypatch.setattr(sandbox, "_cgroup", lambda *a, **k: [])
    (tmp_path / "linger.py").write_text(LINGER)
    out = tmp_path / "alive"
    fork = {"preload": [], "call": ["runpy", "run_path", [str(tmp_path / "linger.py"), None, "__main__"]]} \
        if path == "fork" else None
    argv = [sys.executable, str(tmp_path / "linger.py"), str(out)]
    if fork:  # (runpy's child sees the same argv)
        (tmp_path / "linger.py").write_text(LINGER.replace("sys.argv[1]", repr(str(out))))
    r = sandbox.run_sandboxed(argv, tmp_path, 8, mem_gb=None, fork=fork)
    returned = time.time()
    assert r.timed_out and Path(str(out) + ".ready").exists(), (r.stdout, r.stderr)
    time.sleep(1.5)
    last = float(out.read_text())
    assert last < returned, f"a process of the child wrote {last - returned:.3f} s after run_sandboxed returned"


def test_torch_compile_compiles_before_the_device_is_held(tmp_path, monkeypatch):
    """A task's first profile times eager and torch.compile while no candidate is alive and the device is held: every
    other verdict waits meanwhile. torch.compile compiles at its first run (seconds of CPU work): that run comes before."""
    held, log = [False], []

    @contextlib.contextmanager
    def gate(backend):
        held[0] = True
        try:
            yield
        finally:
            held[0] = False
    monkeypatch.setattr(env, "no_candidates", gate)
    ask = protocol.Child.ask
    monkeypatch.setattr(protocol.Child, "ask", lambda self, cmd, **kw: (log.append((held[0], cmd.get("op"), cmd.get("fn"))),
                                                                        ask(self, cmd, **kw))[1])
    fresh = RELU + f"\n# a task never timed before: {os.urandom(8).hex()}\n"
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    (ws / "model.py").write_text(fresh)
    v = env.evaluate(ws, backend="cpu", stage="profile")
    assert v.correct and v.compile_ms > 0, v.summary()
    use_compile = [(op, fn) for _, op, fn in log].index(("use", "compile"))
    first_compiled_run = log[use_compile + 2]  # use compile, load, run
    assert first_compiled_run[1] == "run", log
    assert first_compiled_run[0] is False, "torch.compile's first run happened while the device was held"
    assert any(h and fn == "compile" for h, _, fn in log), "the compiled baseline was not timed under the gate"


@pytest.mark.parametrize("way", ["exec", "fork"])
def test_escape_sandboxed_child(tmp_path, way):
    mark, probe = escape_probe(tmp_path)
    (tmp_path / "box").mkdir()
    (env.CACHE_DIR / "baselines").mkdir(parents=True, exist_ok=True)
    r = sandboxed_python(way, probe, tmp_path / "box", 60)
    assert r.returncode == 0, r.stderr
    assert_nothing_escaped(mark, r.stdout)


def test_a_forked_child_holds_only_its_own_descriptors(tmp_path):
    """A child of the fork server holds its stdio and pass_fds, nothing of the server's (its socket to the harness,
    other children's pipes), and runs as a fresh process of its own (PID 1 of its namespace where there is one)."""
    (tmp_path / "box").mkdir()
    r_, w_ = os.pipe()
    try:
        code = "import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')), os.getpid())"
        r = sandboxed_python("fork", code, tmp_path / "box", 60, pass_fds=[w_])
    finally:
        os.close(r_)
        os.close(w_)
    assert r.returncode == 0, r.stderr
    fds, pid = r.stdout.split("]")
    fds = json.loads(fds + "]")
    assert {0, 1, 2, w_} <= set(fds) and len(fds) == 5, r.stdout  # and the descriptor listdir read the folder with
    if "--pid" in sandbox.isolation("cpu").prefix:
        assert int(pid) == 1, r.stdout


def test_children_are_exec_ed_where_the_fork_server_fails(tmp_path, monkeypatch, capfd):
    """A fork server that cannot start (here: a module it cannot import; on a GPU host, imports that initialised CUDA)
    fails its probe, once, and every child is exec'ed instead: the verdict is the same."""
    monkeypatch.setattr(protocol, "FORK_PRELOAD", ["torch", f"no_such_module_{os.urandom(4).hex()}"])
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    v = env.evaluate(ws, backend="cpu", stage="verify")
    assert v.correct, v.summary()
    assert capfd.readouterr().err.count("the fork server's probe child failed; children are exec'ed") == 2  # (2 envs)


def test_verdict_children_are_forked_fresh(tmp_path, monkeypatch):
    """Both children of a verdict are forked from the fork server (no `import torch` per child), each a new process."""
    calls, real = [], sandbox.ForkServer.run

    def spy(self, call, *a, **k):
        r = real(self, call, *a, **k)
        calls.append((call[:2], r))
        return r
    monkeypatch.setattr(sandbox.ForkServer, "run", spy)
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)")), backend="cpu")
    assert v.correct, v.summary()
    # reference and candidate; 4 where this verdict (re)measures the baselines (a child each for them and the timed runs)
    children = [c for c, _ in calls if c[0] == "protocol"]
    assert children in ([["protocol", "_child_main"]] * 2, [["protocol", "_child_main"]] * 4), calls
    assert all(r == (0, False) for c, r in calls if c[0] == "protocol"), calls


def test_fork_server_folder_goes_with_its_process(tmp_path):
    """A fork server's HOME/TMPDIR folder is removed when the process that started it ends (one per process that ran
    a verdict: CI and long runs would otherwise leave hundreds in /tmp)."""
    code = ("import sys, tempfile, sandbox; tempfile.tempdir = sys.argv[1]; "
            "s = sandbox.ForkServer([], {'PATH': '/usr/bin:/bin'}); print(s.home)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       cwd=Path(sandbox.__file__).parent)
    assert r.returncode == 0, r.stderr
    home = Path(r.stdout.strip())
    assert home.parent == tmp_path and home.name.startswith("forkserver-"), r.stdout
    assert not home.exists(), list(tmp_path.iterdir())
    # killed (no atexit runs): the server sees its socket close and removes the folder itself
    p = subprocess.Popen([sys.executable, "-c", code + "; import sys, time; sys.stdout.flush(); time.sleep(60)", str(tmp_path)],
                         stdout=subprocess.PIPE, text=True, cwd=Path(sandbox.__file__).parent)
    home = Path(p.stdout.readline().strip())
    assert home.name.startswith("forkserver-") and home.exists(), home
    p.kill()
    p.wait()
    deadline = time.monotonic() + 30
    while home.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not home.exists(), list(home.iterdir())


def test_readable_folder_inside_the_hidden_cache_is_read_only(tmp_path):
    """The compile sandbox sees the precompiled header's folder (`readable`), read-only, and nothing else of the cache."""
    if not sandbox.isolation("cpu").mount:
        pytest.skip("no mount namespace here")
    shown, hidden = env.CACHE_DIR / "pch" / f"t-{os.urandom(4).hex()}", env.CACHE_DIR / "baselines"
    shown.mkdir(parents=True)
    hidden.mkdir(parents=True, exist_ok=True)
    (shown / "h.gch").write_text("header")
    (tmp_path / "box").mkdir()
    probe = (f"import os\nprint(open({str(shown / 'h.gch')!r}).read(), os.path.exists({str(hidden)!r}))\n"
             f"try:\n    open({str(shown / 'x')!r}, 'w')\nexcept OSError as e:\n    print('refused', e.errno)\n")
    try:
        r = env.run_sandboxed([sys.executable, "-c", probe], tmp_path / "box", timeout=60, readable=[shown])
    finally:
        (shown / "h.gch").unlink()
        shown.rmdir()
    assert r.returncode == 0 and r.stdout.split() == ["header", "False", "refused", "30"], (r.stdout, r.stderr)  # EROFS
    assert not (shown / "x").exists()


def test_escape_agent_bash_tool(tmp_path):
    import agent
    mark, probe = escape_probe(tmp_path)
    ws = env.new_workspace(tmp_path / "ws", RELU, "cpu")
    (ws / "probe.py").write_text(probe)
    obs, _, ok = agent.run_tool("bash", {"command": f"{sys.executable} probe.py"}, ws, RELU, "cpu", agent.AgentConfig())
    assert ok, obs
    assert_nothing_escaped(mark, obs)


# 2. Nothing the candidate can read holds an answer; 3. only the parent writes the verdict;
# 4. harness state out of Python's reach: model_new.py is an allow-list.
PY_ATTACKS = {
    "read_reference_outputs": "cuda_extension.copy_of(torch.load(torch.os.path.join('..', 'ref', 'result.pt'))['checks'][0])",
    "read_spec_seeds": "cuda_extension.copy_of(x) if torch.sys.modules else x",
    "rebind_harness_clock": "(setattr(torch.sys.modules['__main__'], '_clock', lambda: 0.0), cuda_extension.relu_scale(x, self.scale))[1]",
    "grow_op_allow_list": "(torch.sys.modules['__main__'].ALLOWED_OPS.add('mul'), (x * self.scale).relu())[1]",
    "disable_dispatch_monitor": "(torch.utils._python_dispatch._disable_current_modes(), (x * self.scale).relu())[1]",
    "getattr_chain": "getattr(getattr(torch, 'sys'), 'modules')['__main__']",
    "class_walk": "x.__class__.__base__.__subclasses__()",
    "write_result_files": "(open('result.json', 'w').write('{\"runtime_ms\": 0.001}'), x)[1]",
    "lambda_and_vars": "(lambda: vars())()",
    "torch_ops_namespace": "torch.ops.aten.relu(x)",
    "torch_library": "torch.library.Library('aten', 'IMPL')",
}


@pytest.mark.parametrize("name", sorted(PY_ATTACKS))
def test_python_attacks_are_refused_by_the_allow_list(tmp_path, name):
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", PY_ATTACKS[name])), backend="cpu")
    assert v.reward == -1 and v.violations and not v.compiled, v.summary()


def test_candidate_spec_and_view_hold_no_secret(tmp_path, monkeypatch):
    """The candidate child's spec names no seed but its own model's, and the reference's folder is not in its view."""
    specs = []
    real = env.Child.__init__

    def spy(self, spec, run_dir, *a, **k):
        specs.append((dict(spec), run_dir))
        real(self, spec, run_dir, *a, **k)

    monkeypatch.setattr(env.Child, "__init__", spy)
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)")), backend="cpu")
    assert v.correct, v.summary()
    (cand, cand_dir), = [(s, d) for s, d in specs if s["mode"] == "candidate"]
    (ref, ref_dir), = [(s, d) for s, d in specs if s["mode"] == "reference"]
    assert set(cand) <= {"backend", "seed0", "mode", "reference", "model_new", "ext_dir", "cand_dir", "cmd_fd", "rep_fd", "key"}
    assert "seeds" in ref and not any(str(s) in json.dumps(cand) for s in ref["seeds"])
    assert env.CACHE_DIR in ref_dir.parents  # hidden from every sandboxed child (the default `hide`)


class FakeChild:
    """Speaks the parent's protocol from a script of replies: what a candidate that forges its results sends."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.thread = type("T", (), {"is_alive": staticmethod(lambda: True)})()

    def answer(self):
        r = self.replies.pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    def ask(self, obj, reuse=False):
        return self.answer()

    def why_dead(self):
        return "exited"


@pytest.mark.parametrize("replies,expect", [
    ([{"ready": True, "init_ops": [], "state": []}, ({}, []), ({}, []), ({}, []), ({"runtime_ms": "fast"}, [])], ValueError),
    ([{"ready": True, "init_ops": [], "state": []}, ({}, []), ({}, []), ({}, []),
      ({"out": {"t": 0, "dtype": "float32", "shape": [64, 4096]}, "ops": [], "state": [], "mutated": False}, [b"\0" * 8])], ValueError),
    ([{"ready": True, "init_ops": [], "state": []}, ({}, []), ({}, []), ({}, []),
      ({"out": {"t": 0, "dtype": "os.system", "shape": [1]}, "ops": [], "state": [], "mutated": False}, [b"\0" * 4])], ValueError),
    (["ready"], ValueError),
    ([EOFError("closed")], EOFError),
], ids=["result_json_fields", "short_tensor", "bad_dtype", "not_a_dict", "died"])
def test_forged_replies_are_rejected(replies, expect):
    v = env.Verdict()
    replies = [r if isinstance(r, (tuple, Exception)) else (r, []) for r in replies]
    with pytest.raises(expect):
        env._drive_candidate(v, FakeChild(replies), [1, 2], [torch_zeros()] * 2, [], [], env.Config(), "cpu", lambda name: None)
    assert v.reward == -1 and not v.correct


def torch_zeros():
    import torch
    return torch.zeros(64, 4096)


def test_timed_runs_are_rechecked_where_the_candidate_cannot_know(tmp_path):
    """After the checks, a kernel that computes every 4th element only (the sampled ones, if it knew which) fails."""
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale_strided_after_checks(x, self.scale)")),
                     backend="cpu")
    assert v.reward == -1 and "timed run" in (v.error or ""), v.summary()


def test_every_timed_run_may_be_read_in_full(tmp_path):
    """A kernel that, after the checks, leaves out the elements of one residue class of the sample's stride (1 in 64
    on a 4M-element output) escapes a run's random sample 63 times in 64, and all 20 with probability 0.73. Two of
    the timed runs, drawn after each run returned, are read in full: it fails every time."""
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale_skips_a_residue_after_checks(x, self.scale)"))
    (ws / "model.py").write_text(RELU.replace("BATCH = 64", "BATCH = 1024"))
    v = env.evaluate(ws, backend="cpu")
    assert v.reward == -1 and "values differ" in (v.error or ""), v.summary()


# 5. Work after the clock, 7. the scan: C/C++ checked after preprocessing, by token, with resolved includes.
SCAN_ATTACKS = {
    "namespace_alias": "namespace T = torch; void f() { T::Tensor a; }",
    "spaced_qualified_call": "torch::Tensor f(torch::Tensor a) { return torch :: matmul(a, a); }",
    "using_namespace_at": "using namespace at; void f() {}",
    "token_pasting": "#define CAT(a, b) a##b\nvoid f() { CAT(fo, rk)(); }",
    "posix_spawnp": "void f() { posix_spawnp(0, 0, 0, 0, 0, 0); }",
    "execve": "void f() { execve(0, 0, 0); }",
    "syscall_clone": "void f() { syscall(56); }",
    "std_spaced_thread": "void f() { std:: thread t; }",
    "timer_create": "void f() { timer_create(0, 0, 0); }",
    "import_through_alias": "namespace p = pybind11; void f() { p::module_::import(\"os\"); }",
    "environ": "extern char** environ; void f() { (void)environ; }",
    "std_fstream": "void f() { std::fstream s; }",
    "posix_open_read_write": "void f() { int fd = open(\"/etc/passwd\", 0); char b[8]; read(fd, b, 8); write(1, b, 8); }",
    "computed_include": "#define HDR </etc/passwd>\n#include HDR\nvoid f() {}",
    "digraph_include": "%:include </etc/passwd>\nvoid f() {}",
    "continued_include": "#inc\\\nlude </etc/passwd>\nvoid f() {}",
    "asm_incbin": "void f() { asm(\".incbin \\\"/etc/passwd\\\"\"); }",
    "hidden_between_strings": "const char* a = \"/*\"; void f() { fork(); } const char* b = \"*/\";",
    "lazy_pages": "void f() { mprotect(0, 4096, 0); sigaction(11, 0, 0); }",
    "dispatch_key_guard": "void f() { c10::impl::ExcludeDispatchKeyGuard g(c10::DispatchKeySet()); }",
    "python_c_api": "void f() { PyRun_SimpleString(\"import os\"); }",
    "at_native_call": "at::Tensor f(at::Tensor a) { return at::native::add(a, a, 1); }",
}


@pytest.mark.parametrize("name", sorted(SCAN_ATTACKS))
def test_scan_attacks_are_refused_after_preprocessing(tmp_path, name):
    # No torch header: the scan reads the preprocessed tokens before anything compiles, and this keeps it fast.
    src = SCAN_ATTACKS[name] + "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n"
    b = env.build({"kernels/x.cpp": src}, "cpu")
    assert not b.ok and b.violations and b.rebuilt == [], b.log


def test_included_host_file_never_reaches_the_log(tmp_path):
    secret = ROOT / "tests" / f".secret-{os.urandom(4).hex()}.txt"  # outside /tmp, which every sandbox has its own of
    secret.write_text("TOP-SECRET-LINE\n")
    try:
        src = f"%:include \"{secret}\"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{}}\n"
        ws = make_ws(tmp_path, "relu", model_new("relu", "x"), {"x.cpp": src})
        v = env.evaluate(ws, backend="cpu")
    finally:
        secret.unlink()
    assert v.reward == -1 and v.violations and "TOP-SECRET" not in v.summary() + v.log, v.summary()


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_included_host_file_never_reaches_the_log_when_preprocessing_fails(tmp_path, how):
    """A macro named as the file's first word makes every line of it a preprocessor error, and GCC quotes the line:
    the include must be refused as written, before the preprocessor opens the file (scan.check_directives)."""
    secret = ROOT / "tests" / f".secret-{os.urandom(4).hex()}.txt"
    secret.write_text("TOP SECRET LINE\n")
    try:
        ws = make_ws(tmp_path, "relu", model_new("relu", "x"), {})
        name = str(secret) if how == "absolute" else os.path.relpath(secret, ws / "kernels")
        src = f'#define TOP _Pragma\n#include "{name}"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{}}\n'
        (ws / "kernels" / "x.cpp").write_text(src)
        v = env.evaluate(ws, backend="cpu")
    finally:
        secret.unlink()
    assert v.reward == -1 and v.violations and "SECRET" not in v.summary() + v.log, v.summary() + v.log


def test_module_in_a_comment_is_not_a_module(tmp_path):
    b = env.build({"kernels/x.cpp": "#include <torch/extension.h>\n// PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)\nint x;\n"}, "cpu")
    assert not b.ok and "exactly one source must" in b.log, b.log


def test_kernels_symlink_out_of_the_workspace_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "ops.cpp").write_text(OPS)
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"), {})
    (ws / "kernels").rmdir()
    (ws / "kernels").symlink_to(outside)
    v = env.evaluate(ws, backend="cpu")
    assert v.reward == -1 and "symbolic link" in (v.error or ""), v.summary()


def test_fills_are_allocation_not_compute(tmp_path):
    src = ("#include <torch/extension.h>\ntorch::Tensor f(torch::Tensor x) { auto a = torch::full({2}, 1.0); "
           "auto b = torch::ones_like(x); auto c = torch::full_like(x, 2.0); auto d = torch::zeros_like(x); return b; }\n"
           "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"f\", &f); }\n")
    b = env.build({"kernels/fill.cpp": src}, "cpu")
    assert b.ok, b.log


# 6. Baselines are timed only while no candidate of this device is alive.
def spy_children(monkeypatch):
    """events: ("start", mode, child id), ("end", mode, child id) once its process is gone, ("time", mode)."""
    events = []
    real_init, real_close, real_timed = env.Child.__init__, env.Child.close, env.timed_runs

    def init(self, spec, *a, **k):
        real_init(self, spec, *a, **k)
        self.mode = spec["mode"]
        events.append(("start", self.mode, id(self)))

    def close(self):
        r = real_close(self)
        if self.thread.is_alive() is False and ("end", self.mode, id(self)) not in events:
            events.append(("end", self.mode, id(self)))
        return r

    def timed(child, *a, **k):
        events.append(("time", child.mode))
        return real_timed(child, *a, **k)

    def ask(self, cmd, **kw):
        events.append(("ask", self.mode, id(self)))
        return real_ask(self, cmd, **kw)

    real_ask = env.Child.ask
    monkeypatch.setattr(env.Child, "__init__", init)
    monkeypatch.setattr(env.Child, "close", close)
    monkeypatch.setattr(env.Child, "ask", ask)
    monkeypatch.setattr(env, "timed_runs", timed)
    return events


def test_baselines_are_timed_while_no_candidate_lives(tmp_path, monkeypatch):
    """A task's first profile checks the candidate, stops its child, times the baselines with no candidate alive,
    then times a fresh child of the candidate. No child that holds reference outputs lives while a candidate runs."""
    events = spy_children(monkeypatch)
    nonce = f"\n# baseline nonce {os.urandom(8).hex()}\n"  # a reference never seen: its baselines are measured now
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    (ws / "model.py").write_text(RELU + nonce)
    v = env.evaluate(ws, backend="cpu")
    assert v.correct and v.eager_ms and v.compile_ms and v.runtime_ms, v.summary()
    alive = {"candidate": set(), "reference": set()}
    for e in events:
        if e[0] == "start":
            alive[e[1]].add(e[2])
        elif e[0] == "end":
            alive[e[1]].discard(e[2])
        elif e == ("time", "reference"):
            assert not alive["candidate"], events
        elif e[:2] == ("ask", "candidate"):
            assert not alive["reference"], events
    ref_times = [i for i, e in enumerate(events) if e == ("time", "reference")]
    cand_times = [i for i, e in enumerate(events) if e == ("time", "candidate")]
    assert len(ref_times) == 2 and len(cand_times) == 1 and cand_times[0] > max(ref_times), events


def test_baselines_are_timed_as_the_candidate_is(tmp_path, monkeypatch):
    """A candidate's runs are compared with baselines timed under the same warm-up: baselines cached under one
    warm-up are not served to a verdict under another, which times and caches its own."""
    nonce = f"\n# baseline nonce {os.urandom(8).hex()}\n"
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    (ws / "model.py").write_text(RELU + nonce)
    written, real_replace = [], os.replace  # (the files this test writes: tests in parallel write there too)
    monkeypatch.setattr(env.os, "replace", lambda a, b: (written.append(Path(b)), real_replace(a, b))[1])
    files = []
    for warmup_ms in (0.0, 0.0, 5.0):
        written.clear()
        v = env.evaluate(ws, backend="cpu", warmup_ms=warmup_ms)
        assert v.correct and v.eager_ms, v.summary()
        files.append({p for p in written if p.parent.name == "baselines"})
    # measured and cached; served (or, if noisy, measured again into the same file); measured anew under another key
    assert len(files[0]) == 1 and files[1] <= files[0] and len(files[2]) == 1 and files[2] != files[0], files
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(env.UsageError, match="warmup_ms"):
            env.evaluate(ws, backend="cpu", warmup_ms=bad)


def test_a_wrong_candidate_costs_no_baselines(tmp_path, monkeypatch):
    """The first profile of a task checks the candidate before anything is timed: a wrong answer is -1 without
    torch.compile's compile and the baselines' runs (most of a first verdict), and caches no baselines."""
    events = spy_children(monkeypatch)
    nonce = f"\n# baseline nonce {os.urandom(8).hex()}\n"
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x[1:], self.scale)"))
    (ws / "model.py").write_text(RELU + nonce)
    v = env.evaluate(ws, backend="cpu")  # (one row short: a wrong answer, with no compute outside the kernel)
    assert v.compiled and not v.correct and v.reward == -1 and "check 1/5" in (v.error or ""), v.summary()
    assert not v.violations, v.summary()
    assert ("time", "reference") not in events and v.eager_ms is None, events
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"), name="ok")
    (ws / "model.py").write_text(RELU + nonce)
    v = env.evaluate(ws, backend="cpu")
    assert v.correct and v.eager_ms, v.summary()
    assert events.count(("time", "reference")) == 2, events  # measured now, by the first correct candidate


@pytest.mark.parametrize("mib", [16, 64, 256])
def test_children_allocate_large_blocks_the_same_way_whatever_came_before(mib):
    """A block of any size comes from a child's heap and stays there once freed (CHILD_ENV's allocator settings). By
    glibc's defaults a block is mapped and unmapped on every run or not, by what the process has freed before
    (relu 1024x4096 on 2 cores: eager 12 ms or 1.7 ms); and a block over the most its threshold takes (32 MiB) is
    mapped afresh every time: eager pays the page faults of a new output every run, while a candidate that keeps its
    output buffer pays none (a red team's relu 2048x4096, 32 MiB: 2.15 ms against eager's 14.2: reward 3)."""
    probe = ("import ctypes\n"
             "class M(ctypes.Structure):\n    _fields_ = [(n, ctypes.c_size_t) for n in ('arena ordblks smblks hblks hblkhd "
             "usmblks fsmblks uordblks fordblks keepcost'.split())]\n"
             "libc = ctypes.CDLL('libc.so.6'); libc.mallinfo2.restype = M; libc.malloc.restype = ctypes.c_void_p\n"
             f"before = libc.mallinfo2().hblks; p = libc.malloc({mib} << 20); mapped = libc.mallinfo2().hblks - before\n"
             f"libc.free(ctypes.c_void_p(p)); kept = libc.mallinfo2().fordblks\n"
             f"print(mapped, kept >= {mib} << 20)\n")
    run = lambda extra: subprocess.run([sys.executable, "-c", probe], env={**os.environ, **extra}, capture_output=True,
                                       text=True, check=True).stdout.split()
    assert run({}) == ["1", "False"]  # glibc's defaults: mapped, and given back when freed
    assert run(env.CHILD_ENV) == ["0", "True"]


def test_every_child_gets_the_same_threading_settings(tmp_path, monkeypatch):
    """Candidate and reference (eager, torch.compile) children run under the same harness settings, idle OpenMP
    workers sleeping (a spinning one, preempted on a busy host, made every candidate parallel region wait ~ms)."""
    seen = []
    real = protocol.run_sandboxed

    def spy(argv, *a, **k):
        if "_child" in argv:
            seen.append(dict(k.get("env") or {}))
        return real(argv, *a, **k)

    monkeypatch.setattr(protocol, "run_sandboxed", spy)
    v = env.evaluate(make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)")),
                     backend="cpu", stage="verify")
    assert v.correct, v.summary()
    assert len(seen) == 2 and env.CHILD_ENV["OMP_WAIT_POLICY"] == "passive"
    for e in seen:
        assert {k: e.get(k) for k in env.CHILD_ENV} == env.CHILD_ENV


def test_kernels_use_torchs_own_openmp_runtime(tmp_path):
    """The extension brings no OpenMP runtime of its own: loaded next to torch, the process maps the same OpenMP
    libraries as torch alone (two runtimes would mean two thread pools competing for the cores)."""
    b = env.build({"kernels/ops.cpp": OPS}, "cpu")
    assert b.ok, b.log
    probe = ("import importlib.util, sys, torch\n"
             "if sys.argv[1]:\n"
             "    s = importlib.util.spec_from_file_location('cuda_extension', sys.argv[1])\n"
             "    s.loader.exec_module(importlib.util.module_from_spec(s))\n"
             "torch.set_num_threads(2)\n"
             "print(*sorted({l.split()[-1] for l in open('/proc/self/maps') if 'omp' in l.split()[-1].rsplit('/', 1)[-1]}))\n")
    maps = [subprocess.run([sys.executable, "-c", probe, so], capture_output=True, text=True, check=True).stdout.split()
            for so in ("", str(b.so_path))]
    assert maps[0] == maps[1] and len(maps[1]) <= 1, maps  # (the paths of the OpenMP libraries mapped)


def test_no_candidates_waits_for_live_candidates(tmp_path):
    import fcntl
    with env.candidate_alive("cpu"):
        fd = os.open(sandbox._alive_path("cpu"), os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    with env.no_candidates("cpu"):
        pass


def test_a_verdict_records_its_wait_for_the_device(tmp_path, monkeypatch):
    """Verdict.phases["wait device"] (bench/env_bench.py --workers): the timing lock, held elsewhere until 1 s after
    the verdict asks for it, shows as at least 1 s of waiting."""
    import threading
    asked, real = threading.Event(), env.file_lock

    def spy(path, *a, **k):
        if path == env.gpu_lock_path("cpu"):
            asked.set()
        return real(path, *a, **k)

    monkeypatch.setattr(env, "file_lock", spy)
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    got = []
    with real(env.gpu_lock_path("cpu")):
        t = threading.Thread(target=lambda: got.append(env.evaluate(ws, backend="cpu")))
        t.start()
        assert asked.wait(300)
        time.sleep(1.0)
    t.join()
    assert got[0].correct and got[0].phases["wait device"] >= 1.0, got[0].summary()


# 8. Checks that can fail at the output's own scale.
def test_zeros_do_not_pass_a_wide_softmax(tmp_path):
    v = env.evaluate(make_ws(tmp_path, "softmax_wide", model_new("softmax_wide", "torch.zeros_like(x)")), backend="cpu",
                     stage="verify")
    assert v.reward == -1 and "RMS error" in (v.error or ""), v.summary()
    v = env.evaluate(make_ws(tmp_path, "softmax_wide", model_new("softmax_wide", "cuda_extension.softmax_lastdim(x)"), name="ok"),
                     backend="cpu", stage="verify")
    assert v.correct, v.summary()


def test_compare_scales():
    import torch
    ref = torch.softmax(torch.rand(4, 65536), -1)
    assert env.compare(torch.zeros_like(ref), ref, 1e-2, 1e-2, "x") is not None
    assert env.compare(ref * 1.001, ref, 1e-2, 1e-2, "x") is None
    noise = torch.randn(1000) * 1e-9  # outputs that are rounding noise around zero: any noise of that size is fine
    assert env.compare(torch.randn(1000) * 1e-9, noise, 1e-2, 1e-2, "x") is None
    for cols in (2**21, 2**22):  # zeros beside a softmax whose every value is far below atol, and below 1e-6 in RMS
        wide = torch.softmax(torch.rand(1, cols), -1)
        assert env.compare(torch.zeros_like(wide), wide, 1e-2, 1e-2, "x") is not None, cols
        assert env.compare(wide * 1.001, wide, 1e-2, 1e-2, "x") is None


def _compare_whole(out, ref, atol, rtol):
    """compare()'s definition on whole tensors in float64: (values not close, RMS error, RMS of the reference)."""
    import torch
    wide = torch.complex128 if ref.is_complex() else torch.float64
    o, r = out.to(wide).reshape(-1), ref.to(wide).reshape(-1)
    bad = int((~torch.isclose(o, r, atol=atol, rtol=rtol, equal_nan=True)).sum())
    fin = torch.isfinite(o) & torch.isfinite(r)
    rms = lambda x: x[fin].abs().pow(2).mean().sqrt().item() if bool(fin.any()) else None
    return bad, rms(o - r), rms(r)


def compare_cases():
    """(name, output, reference, close?) over chunk boundaries, with NaN, inf and complex values (here and on the GPU)."""
    import torch
    g = torch.Generator().manual_seed(0)
    n = 3 * (1 << 16) + 123  # three chunks and a partial one
    ref = torch.randn(n, generator=g)
    cases = {"close": ref * 1.001, "far": ref + 0.5, "zeros": torch.zeros_like(ref), "few_far": ref.clone()}
    cases["few_far"][[5, 1 << 16, n - 1]] += 1.0
    special = ref.clone()
    special[[0, 70000, 140000]] = float("nan")
    special[[1, 70001]] = float("inf")
    cases["nan_inf_same"] = special
    ref_special = special.clone()
    other = special.clone()
    other[70001] = float("-inf")  # opposite infinities differ
    other[2] = float("nan")  # NaN against a number differs
    cases["nan_inf_other"] = other
    c = torch.randn(n, dtype=torch.complex64, generator=g)
    return [(name, out, ref_special if name.startswith("nan_inf") else ref, name in ("close", "nan_inf_same"))
            for name, out in cases.items()] + [("complex_close", c * 1.001, c, True), ("complex_far", c + 1, c, False)]


def test_chunked_compare_decides_as_the_whole_tensor_definition():
    """compare() goes over outputs in cache-sized chunks (a GB-sized output in a fraction of a second); its counts and
    RMS figures are those of the whole-tensor definition, across chunk boundaries, with NaN, inf and complex values."""
    import torch
    cases = compare_cases()
    for name, out, r, close in cases:
        bad, diff, err, scale = env._close_and_rms(out, r, 1e-2, 1e-2)
        w_bad, w_err, w_scale = _compare_whole(out, r, 1e-2, 1e-2)
        assert bad == w_bad, (name, bad, w_bad)
        assert err == pytest.approx(w_err, rel=1e-9) and scale == pytest.approx(w_scale, rel=1e-9), name
        assert (env.compare(out, r, 1e-2, 1e-2, "x") is None) == close, name
    ref, few_far = cases[0][2], next(out for name, out, _, _ in cases if name == "few_far")
    assert env._close_and_rms(torch.zeros(0), torch.zeros(0), 1e-2, 1e-2) == (0, 0.0, None, None)
    assert env._close_and_rms(ref + 0.5, ref, 1e-2, 1e-2, chunk=1000, count=False)[0] == 1000  # (stops after one chunk)
    assert env.compare(few_far, ref, 1e-2, 1e-2, "x", count=False) is not None


def test_tensor_blobs_are_sent_in_pieces_through_the_staging_buffer(monkeypatch):
    """A child sends a GPU output piece by piece through one staging buffer (protocol.send; the GPU tests send real
    ones): the bytes arrive whole and in order across piece boundaries, beside ordinary blobs in one message."""
    import threading
    import torch
    import protocol
    monkeypatch.setattr(protocol, "STAGE_BYTES", 1000)
    monkeypatch.setattr(protocol, "_stage", [])
    big = torch.randint(0, 256, (3 * 1000 + 7,), dtype=torch.uint8)
    r, w = os.pipe()
    try:
        t = threading.Thread(target=protocol.send, args=(w, {"x": 1}, [b"head", big, big[:10]]))
        t.start()
        obj, blobs = protocol.recv(r)
        t.join()
    finally:
        os.close(r)
        os.close(w)
    assert obj == {"x": 1} and bytes(blobs[0].numpy()) == b"head"
    assert torch.equal(blobs[1], big) and torch.equal(blobs[2], big[:10])
    assert protocol._stage[0].numel() == 1000  # one buffer, made once


def test_replies_read_into_kept_memory_hold_only_their_own_bytes():
    """recv(into=...) (a candidate's whole outputs, Child.ask(reuse=True)): the blobs of a reply are views of the kept
    memory, each starting where any dtype may (a 3-byte bool output before a float32 one), holding exactly what this
    reply sent: a later, smaller reply in the same memory shows none of the earlier one's bytes."""
    import threading
    import torch
    import protocol
    kept = torch.empty(0, dtype=torch.uint8)

    def into(n):
        nonlocal kept
        kept = kept if kept.numel() >= n else torch.empty(n, dtype=torch.uint8)
        return kept

    def exchange(out):
        blobs = []
        head = protocol.pack(out, blobs)
        r, w = os.pipe()
        try:
            t = threading.Thread(target=protocol.send, args=(w, head, blobs))
            t.start()
            obj, got = protocol.recv(r, into=into)
            t.join()
        finally:
            os.close(r)
            os.close(w)
        return protocol.unpack(obj, got), got

    first = (torch.tensor([True, False, True]), torch.arange(1000, dtype=torch.float32), torch.arange(5, dtype=torch.int64))
    back, got = exchange(first)
    assert all(torch.equal(a, b) for a, b in zip(back, first))
    assert all(g.data_ptr() - kept.data_ptr() == at for g, at in zip(got, (0, 64, 4096)))  # each at a multiple of 64
    ptr = kept.data_ptr()
    second = torch.full((2,), 7.0)
    back, got = exchange(second)
    assert kept.data_ptr() == ptr and got[0].data_ptr() == ptr  # the same memory, read again
    assert torch.equal(back, second) and got[0].numel() == 8  # its 8 bytes, nothing of the 4,043 left behind


def test_replies_cannot_exhaust_the_parent():
    """A reply that declares more bytes than the parent expects, or nests without end, is malformed (no read, no crash)."""
    for blob_case in (True, False):
        r, w = os.pipe()
        try:
            if blob_case:
                env.send(w, {"out": 1}, [b"x" * 64])
            else:  # 40 kB of brackets: fits in the pipe, nests far deeper than any decoder allows
                head = ("[" * 20_000 + "]" * 20_000).encode()
                os.write(w, len(head).to_bytes(8, "little") + (0).to_bytes(8, "little") + head)
            with pytest.raises(ValueError):
                env.recv(r, limit=16)
        finally:
            os.close(r)
            os.close(w)
    nested = {"seq": [{"v": 1}]}
    for _ in range(20):
        nested = {"seq": [nested]}
    with pytest.raises(ValueError):
        env.unpack(nested, [])


# ------------------------------------------------------------------ red team
# Holes found by attacking the allow-list of model_new.py. Each source passed scan.check_python before the fix;
# the first one was shown end to end: `exec` switched the dispatch monitor off and `(x * s).relu()` got reward 1.
def red_team_source(header, methods, body):
    return "\n".join(["import torch", "import torch.nn as nn", "import cuda_extension", header, "", "",
                      "class ModelNew(nn.Module):", "    def __init__(self, dim):", "        super().__init__()",
                      "        self.scale = nn.Parameter(torch.empty(dim))", "", *methods,
                      "    def forward(self, x):", *[f"        {line}" for line in body.split("\n")], ""])


EXEC_OFF_MONITOR = ("ns = {'x': x, 's': self.scale}\n"
                    "exec('from torch.utils._python_dispatch import _disable_current_modes\\n'\n"
                    "     'with _disable_current_modes():\\n    out = (x * s).relu()', ns)\n"
                    "return ns['out']")
RED_TEAM_PY = {
    # a name bound in one scope (a method called `exec`, an argument called `getattr`) made the builtin of that
    # name "defined" in every other scope
    "builtin_shadowed_by_a_method": ("", ["    def exec(self):", "        pass", ""], EXEC_OFF_MONITOR),
    "builtin_shadowed_by_an_argument": ("", ["    def helper(self, getattr):", "        pass", ""],
                                        "return getattr(torch, 'sys').modules['builtins'].exec('pass')"),
    "builtin_shadowed_in_a_comprehension": ("", [], "[open for open in range(1)]\nreturn open('/etc/hostname').read()"),
    # generator and frame attributes have no underscore: f_builtins is the builtins dict
    "generator_frame_builtins": ("", [], "b = (i for i in range(1)).gi_frame.f_builtins\nb['exec']('pass')\nreturn x"),
    # `from M import X` names were not checked: torch.sys, torch.os
    "from_torch_import_sys": ("from torch import sys", [], "sys.modules['builtins'].exec('pass')\nreturn x"),
    "from_torch_import_underscore": ("from torch import _C", [], "return x"),
    # attribute chains from allowed modules other than `torch` were not checked
    "functional_importlib": ("", [], "nn.functional.importlib.import_module('os').system('true')\nreturn x"),
    "typing_sys": ("import typing", [], "typing.sys.modules['builtins'].exec('pass')\nreturn x"),
    "typing_get_type_hints_evals": ("import typing", ["    def helper(self, a: \"exec('pass')\"):", "        pass", ""],
                                    "typing.get_type_hints(self.helper)\nreturn x"),
    "nn_parallel_threads": ("", [], "return nn.parallel.parallel_apply([self], [(x,)])[0]"),
    "module_alias_then_chain": ("", [], "m = nn.functional\nreturn m.importlib.import_module('os')"),
    # classes inside a method were not checked (bases, metaclass), nor dunder method names anywhere: __del__ runs
    # whenever the garbage collector gets to it, outside the monitor and the clock
    "nested_tensor_subclass": ("", [], "class Lazy(torch.Tensor):\n    pass\nreturn Lazy(x)"),
    "dunder_del_method": ("", ["    def __del__(self):", "        pass", ""], "return x"),
    # torch's own allow-list held only for the name `torch`, not for torch reached through nn.functional.torch
    "torch_through_functional": ("", [], "nn.functional.torch.ops.load_library('/tmp/x.so')\nreturn x"),
    "torch_cuda_through_init": ("", [], "return nn.init.torch.cuda.set_sync_debug_mode(0)"),
    "torch_nn_chain": ("", [], "return torch.nn.modules.module.inspect.currentframe()"),
}


@pytest.mark.parametrize("name", sorted(RED_TEAM_PY))
def test_red_team_python_allow_list(name):
    header, methods, body = RED_TEAM_PY[name]
    assert scan.check_python(red_team_source(header, methods, body)), name


def test_red_team_honest_python_still_allowed():
    src = red_team_source("import typing\nimport torch.nn.functional as F\nfrom torch import nn as tnn",
                          ["    def helper(self, input: typing.Optional[torch.Tensor] = None) -> typing.List[int]:",
                           "        return [d for d in range(2)]", ""],
                          "y = torch.empty_like(x, dtype=torch.float32)\nn = sum(s for s in x.shape)\n"
                          "s = torch.cuda.is_available()\nreturn cuda_extension.relu_scale(x, self.scale)")
    assert scan.check_python(src) == []


def test_red_team_exec_switching_the_monitor_off_is_refused(tmp_path):
    """End to end: before the fix this was reward 1, correct, with (x * s).relu() computed by PyTorch."""
    src = red_team_source("", ["    def exec(self):", "        pass", ""], EXEC_OFF_MONITOR)
    v = env.evaluate(make_ws(tmp_path, "relu", src), backend="cpu", stage="verify")
    assert v.reward == -1 and any("exec" in x for x in v.violations), v.summary()


def test_red_team_python_arithmetic_on_item_values(tmp_path):
    """.item() read each value into Python, Python added them, fill_ wrote the sum back: only allowed ops ran
    (select, _local_scalar_dense, fill_), and the verdict was reward 1 for an answer no kernel computed."""
    src = "\n".join(["import torch", "import torch.nn as nn", "import cuda_extension", "", "",
                     "class ModelNew(nn.Module):", "    def __init__(self):", "        super().__init__()", "",
                     "    def forward(self, a, b):", "        out = torch.empty_like(a)",
                     "        for i in range(a.shape[0]):", "            out[i].fill_(a[i].item() + b[i].item())",
                     "        return out", ""])
    v = env.evaluate(make_ws(tmp_path, "add", src), backend="cpu", stage="verify")
    assert v.reward == -1 and "aten._local_scalar_dense" in " ".join(v.violations), v.summary()


RED_TEAM_CPP = {
    # a libc function declared under another name: the real name is in a pragma (dropped before the scan) or a string
    "pragma_redefine_extname": "#pragma redefine_extname my_open open\nextern \"C\" int my_open(const char*, int, ...);\n"
                               "int f() { return my_open(\"/etc/passwd\", 0); }",
    "pragma_operator_redefine_extname": "_Pragma(\"redefine_extname my_sys system\")\nextern \"C\" int my_sys(const char*);\n"
                                        "int f() { return my_sys(\"id\"); }",
    "weakref_attribute": "static int my_open(const char*, int, ...) __attribute__((weakref(\"open\")));\n"
                         "int f() { return my_open(\"/etc/passwd\", 0); }",
    # fd-level I/O that <cstdio>/<cstdlib> declare under _GNU_SOURCE: write to any fd (the reply pipe), make files
    "dprintf_to_a_pipe": "#include <cstdio>\nint f() { return dprintf(4, \"forged\"); }",
    "mkstemp_then_dprintf": "#include <cstdlib>\nint f() { char p[] = \"xXXXXXX\"; return mkstemp(p); }",
    # inside a re-opened `namespace at`, at::launch (a thread the monitor cannot see) is plain `launch`
    "reopened_namespace_at": "namespace at { void launch(int); }\nnamespace at { void g() { launch(0); } }",
    "c10_thread_pool": "namespace c10x { struct ThreadPool { ThreadPool(int) {} }; }\nvoid f() { c10x::ThreadPool p(2); }",
    # glibc's exported aliases of the doors
    "libc_alias_open_write": "extern \"C\" int __open(const char*, int, ...); extern \"C\" long __write(int, const void*, unsigned long);\n"
                             "int f() { return __write(__open(\"/etc/passwd\", 0), \"x\", 1); }",
    "libc_alias_system": "extern \"C\" int __libc_system(const char*);\nint f() { return __libc_system(\"id\"); }",
    # the dispatch key state, by a guard not on the list: hides Tensor methods from the monitor
    "force_dispatch_key_guard": "namespace c10 { namespace impl { struct ForceDispatchKeyGuard { ForceDispatchKeyGuard(int, int) {} }; } }\n"
                                "void f() { c10::impl::ForceDispatchKeyGuard g(0, 0); }",
}


@pytest.mark.parametrize("name", sorted(RED_TEAM_CPP))
def test_red_team_scan_symbol_renaming_and_dispatch_state(name):
    b = env.build({"kernels/x.cpp": RED_TEAM_CPP[name] + "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}\n"}, "cpu")
    assert not b.ok and b.violations and b.rebuilt == [], b.log


# The agent's bash tool and the files the trusted parent reads or writes after it.
def test_red_team_bash_symlinked_reference_is_not_written_through(tmp_path):
    """bash replaced model.py by a link to a host file; restoring the reference wrote the task's code INTO that host
    file, as the parent's user (root). The link must be removed instead."""
    import agent
    victim = tmp_path / "host" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text("HOST FILE\n")
    ws = env.new_workspace(tmp_path / "ws", RELU, "cpu")
    for tool, args in (("bash", {"command": f"ln -sf {victim} model.py"}), ("compile", {})):
        agent.run_tool(tool, args, ws, RELU, "cpu", agent.AgentConfig())
        assert victim.read_text() == "HOST FILE\n"
        assert not (ws / "model.py").is_symlink() and (ws / "model.py").read_text() == RELU
        if tool == "bash":
            (ws / "model.py").unlink()
            (ws / "model.py").symlink_to(victim)  # (as bash leaves it for the next tool)


def test_red_team_symlinked_model_new_is_not_read(tmp_path):
    """A model_new.py that links to a host file: the scan quoted the file's words in the verdict."""
    secret = tmp_path / "host" / "notes.txt"
    secret.parent.mkdir()
    secret.write_text("HostSecretWord\n")
    ws = make_ws(tmp_path, "relu", "x")
    (ws / "model_new.py").unlink()
    (ws / "model_new.py").symlink_to(secret)
    v = env.evaluate(ws, backend="cpu", reference=RELU)
    assert v.reward == -1 and "HostSecretWord" not in v.summary() and "symbolic link" in (v.error or ""), v.summary()


# A kernel that keys a cache on a few input elements must never meet the same input twice while timed: with more
# runs than distinct sets, >= 90% of the runs could be cache hits and the median a hit (reward 3, not faster).
def test_red_team_fast_runs_never_repeat_an_input_set(monkeypatch):
    ticks = iter(range(10**6))
    monkeypatch.setattr(protocol, "_clock", lambda: next(ticks) * 1e-6)  # a fast kernel: 1 us per clock reading
    loads = []

    class Recorder:
        def ask(self, obj):
            if obj["op"] == "load":
                loads.append(obj["seed"])
            return {}, []

    seeds = list(range(100, 121))  # (as many sets as runs, and one more: the warm-up's own)
    times = env.timed_runs(Recorder(), seeds, env.Config())
    assert len(times) >= env.Config().n_timed
    # the warm-up's runs included: a set they computed would be a cache hit in a timed run
    assert len(loads) == len(set(loads)), f"{len(loads)} loads over {len(set(loads))} input sets: {loads}"


def test_red_team_no_process_is_timed_on_an_input_it_has_met(tmp_path, monkeypatch):
    """Where fewer input sets than timed runs fit in input_budget_mb, sets repeated: a cache keyed on input values
    answered every repeat without computing (reward 3 for the work of two runs). No input set may be met twice, warm-up
    included, by one candidate process (the stand-in kernel is wrong on any input its process has met) or by two (a
    cache can reach the next process: the kernel keyring, a GPU allocation's leftovers): each share of the runs gets
    a fresh process and a fresh batch of sets, and as many untimed runs first as the checked child had (its checks
    and warm-up: a fresh process's first timed runs were slower)."""
    calls, warmups = [], []
    real_timed = env.timed_runs

    def timed(child, seeds, cfg, check=None, audit=None, inputs=None, **kw):
        if audit is not None:  # (the candidate's; the trusted baselines may repeat sets)
            calls.append((list(seeds), cfg.n_timed + cfg.n_audits, kw.get("warm_seed")))
            warmups.append((cfg.warmup, cfg.warmup_ms))
        return real_timed(child, seeds, cfg, check, audit, inputs, **kw)

    monkeypatch.setattr(env, "timed_runs", timed)
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale_met_before(x, self.scale)"))
    v = env.evaluate(ws, backend="cpu", input_budget_mb=2.5)  # relu 64x4096: 1 MiB a set, so 2 sets
    assert v.correct and v.reward >= 1 and v.runtime_ms, v.summary()
    assert v.timed_children == len(calls) == protocol.SPLIT_CHILDREN, calls
    assert all(len(seeds) == 2 and runs == 2 for seeds, runs, _ in calls), calls
    met = [s for seeds, _, warm in calls for s in [*seeds, warm]]  # every set any candidate process met, warm-ups too
    assert None not in met and len(met) == len(set(met)), calls
    assert set(warmups) == {(env.Config().warmup + env.Config().n_checks, protocol.SPLIT_WARMUP_MS)}, warmups


@pytest.mark.parametrize("budget", [None, 2.5], ids=["one_child", "shared_out"])
def test_red_team_no_candidate_is_alive_beside_a_reference(tmp_path, monkeypatch, budget):
    """A reference child holds a verdict's secrets: every input set and output, and on a GPU it exports each timed
    set to this process through a CUDA IPC handle, which a process on the same device may guess. A candidate child
    alive at that time (its native code runs from its import on) could take the timed inputs and answer its timed
    runs from outputs computed ahead. So no candidate child of a verdict lives while any reference child of it does:
    in a task's first profile (baselines timed) and a later one, in one child and with the runs shared out."""
    events, real = [], env.Child

    class Recorded(real):
        def __init__(self, spec, *a, **k):
            events.append(("start", spec["mode"], id(self)))
            super().__init__(spec, *a, **k)

        def close(self):
            alive = self.cmd_w is not None
            r = super().close()
            if alive:
                events.append(("end", None, id(self)))
            return r

    monkeypatch.setattr(env, "Child", Recorded)
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    (ws / "model.py").write_text(PROBLEMS["relu"] + f"\n# {os.urandom(8).hex()}\n")  # (no cached baselines)
    kw = {} if budget is None else {"input_budget_mb": budget}
    for _ in range(2):  # the first verdict of a new reference times its baselines
        v = env.evaluate(ws, backend="cpu", **kw)
        assert v.correct, v.summary()
    modes, alive = {}, set()
    for what, mode, key in events:
        if what == "start":
            modes[key] = mode
            others = {modes[k] for k in alive}
            assert not (mode == "candidate" and "reference" in others or mode == "reference" and "candidate" in others), \
                [(w, modes.get(k)) for w, _, k in events]
            alive.add(key)
        else:
            alive.discard(key)
    assert list(modes.values()).count("candidate") >= (3 if budget is None else 2 * protocol.SPLIT_CHILDREN), events
    assert not alive, events


@pytest.mark.parametrize("n_sets,children,runs", [(2, 5, 10), (3, 5, 15), (5, 5, 22), (11, 2, 22), (22, 1, 22),
                                                   (23, None, None)])
def test_timed_runs_are_shared_out_so_no_process_meets_a_set_twice(n_sets, children, runs):
    """protocol.timing_shares: where the sets do not outnumber the runs, (n_timed, n_audits) per child, each child's
    runs at most n_sets, the audits (n_audits of them, at random) among them; None where one child's warm-up has a
    set of its own (n_timed 20 + n_audits 2 runs, and a set more)."""
    cfg = env.Config()
    for _ in range(20):  # (the audits' places are drawn)
        shares = protocol.timing_shares(cfg, n_sets)
        if children is None:
            assert shares is None
            continue
        assert len(shares) == children and all(t >= 0 and a >= 0 and t + a <= n_sets for t, a in shares), shares
        assert sum(t + a for t, a in shares) == runs and sum(a for _, a in shares) == cfg.n_audits, shares


def test_a_warm_up_on_its_own_input_then_every_set_once(monkeypatch):
    """timed_runs(warm_seed=...): the warm-up loads that input (and no timed set) first, then each set is met once;
    more runs than sets is refused rather than repeating one."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(protocol, "_clock", lambda: next(ticks) * 1e-6)
    loads = []

    class Recorder:
        def ask(self, obj, reuse=False):
            if obj["op"] == "load":
                loads.append(obj["seed"])
            return {}, []

    cfg = env.Config(n_timed=3, n_audits=0)
    times = env.timed_runs(Recorder(), [11, 12, 13], cfg, warm_seed=7)
    assert len(times) == 3 and loads == [7, 11, 12, 13], loads  # (one load: the warm-up's runs reuse its input)
    with pytest.raises(ValueError, match="twice"):
        env.timed_runs(Recorder(), [11, 12], cfg, warm_seed=7)


def test_red_team_a_verdict_draws_a_set_for_the_warm_up(tmp_path, monkeypatch):
    """Every timed_runs of a verdict (the candidate's and the baselines') gets more input sets than timed runs: the
    warm-up runs on one no timed run meets again."""
    calls = []
    real_timed = env.timed_runs

    def timed(child, seeds, cfg, check=None, audit=None, inputs=None, **kw):
        calls.append((len(seeds), cfg.n_timed + (cfg.n_audits if audit is not None else 0)))
        return real_timed(child, seeds, cfg, check, audit, inputs, **kw)

    monkeypatch.setattr(env, "timed_runs", timed)
    nonce = f"\n# baseline nonce {os.urandom(8).hex()}\n"  # (its baselines are timed too)
    ws = make_ws(tmp_path, "relu", model_new("relu", "cuda_extension.relu_scale(x, self.scale)"))
    (ws / "model.py").write_text(RELU + nonce)
    v = env.evaluate(ws, backend="cpu")
    assert v.correct and v.runtime_ms, v.summary()
    assert len(calls) == 3 and all(n_sets > runs for n_sets, runs in calls), calls


def test_warm_up_runs_until_warmup_ms_of_work(monkeypatch):
    """warmup_ms: untimed runs until they add up to that much work (a device's clocks leave their idle state), never
    fewer than `warmup` and never more than MAX_WARMUP; the timed runs are as many as without it."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(protocol, "_clock", lambda: next(ticks) * 1e-3)  # every run takes 1 ms by the parent's clock
    runs = []

    class Recorder:
        def ask(self, obj, reuse=False):
            runs.append(obj["op"] == "run")
            return {}, []

    for warmup_ms, warm in [(0.0, 3), (9.5, 10), (2.5, 3), (1e9, protocol.MAX_WARMUP)]:
        runs.clear()
        times = env.timed_runs(Recorder(), list(range(20)), env.Config(warmup_ms=warmup_ms))
        assert len(times) == 20 and sum(runs) == warm + 20, (warmup_ms, sum(runs))


def test_timed_exchanges_poll_for_replies_and_only_they(monkeypatch):
    """While timed_runs drives a child, the parent polls for its replies (a sleeping reader's wake-up would be on the
    clock); before and after, it sleeps (other verdicts' threads share this process). A child polls for commands."""
    seen = []

    class Polled:
        timed_spin_s, spin_s = 0.05, 0.0

        def ask(self, obj, reuse=False):
            seen.append((obj["op"], self.spin_s))
            return {}, []

    child = Polled()
    env.timed_runs(child, list(range(30)), env.Config())
    assert seen and all(s == 0.05 for _, s in seen) and {"load", "run", "sample"} <= {op for op, _ in seen}, seen
    assert child.spin_s == 0.0
    seen.clear()
    child.timed_spin_s = 0.0  # the CPU backend: a run's reply is waited for asleep, a sample's polled for
    env.timed_runs(child, list(range(30)), env.Config())
    assert {(op, s) for op, s in seen} == {("load", 0.0), ("run", 0.0), ("sample", protocol.SAMPLE_SPIN_S)}, seen
    assert child.spin_s == 0.0
    r, w = os.pipe()
    try:
        t0 = time.perf_counter()
        assert protocol.spin(r, 0.01) is False and time.perf_counter() - t0 >= 0.01  # nothing came: gave up
        os.write(w, b"x")
        t0 = time.perf_counter()
        assert protocol.spin(r, 10.0) is True and time.perf_counter() - t0 < 1  # at once: it does not wait out the 10 s
        os.read(r, 1)
        os.close(w)
        w = None
        t0 = time.perf_counter()
        assert protocol.spin(r, 10.0) is True and time.perf_counter() - t0 < 1  # the other side's end: at once too
    finally:
        os.close(r)
        if w is not None:
            os.close(w)
    assert protocol.PARENT_SPIN_S["cpu"] == 0.0  # on the CPU a polling parent takes a core from the kernel


def test_red_team_workspace_key_reads_no_link(tmp_path):
    """agent.workspace_key (in the trainer, unsandboxed) read every source through links that bash can make:
    a link to /proc/kcore or to a huge host file hangs the trainer; a link to a host file reads it as root."""
    import agent
    ws = env.new_workspace(tmp_path / "ws", RELU, "cpu")
    host = tmp_path / "host.txt"
    host.write_text("one")
    (ws / "kernels" / "x.cpp").symlink_to(host)
    key = agent.workspace_key(ws)
    host.write_text("two")
    assert agent.workspace_key(ws) == key


def test_a_fresh_machine_has_no_cache_folder_yet(tmp_path):
    """The cache root is made when the harness is imported: on a fresh machine `python train.py --stage all` begins
    with synthesis, whose first mkdtemp(dir=CACHE_DIR) needs the folder to exist."""
    import subprocess
    import sys
    cache = tmp_path / "home" / ".cache" / "cuda-agent-mini"
    code = "import tempfile, checker, env; print(tempfile.mkdtemp(prefix='synth-', dir=env.CACHE_DIR))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                       env=dict(os.environ, CUDA_AGENT_CACHE=str(cache)), timeout=120)
    assert r.returncode == 0 and cache.is_dir(), r.stderr[-2000:]


def test_inputs_are_drawn_on_the_tasks_device_and_the_same_in_every_child():
    """protocol.draw_inputs: get_inputs() runs with torch's factory functions defaulting to the task's device (a GB of
    torch.randn in a millisecond on a GPU; "meta" stands in for it here); the same seed gives the same values; a
    get_inputs that cannot run there (a CPU generator of its own) is drawn on the CPU and copied; running out of
    device memory is raised, never a quiet redraw on the CPU (another child would have other values)."""
    import types
    import torch
    import protocol
    task = types.SimpleNamespace(get_inputs=lambda: [torch.randn(4, 8), 3])
    x = protocol.draw_inputs(task, 5, torch.device("meta"))
    assert x[0].device.type == "meta" and x[1] == 3
    a, b = (protocol.draw_inputs(task, 5, torch.device("cpu"))[0] for _ in range(2))
    assert torch.equal(a, b) and not torch.equal(a, protocol.draw_inputs(task, 6, torch.device("cpu"))[0])

    def own_generator():
        if torch.empty(0).device.type != "cpu":
            raise RuntimeError("Expected a 'cpu' device type for generator")
        return [torch.randn(4, generator=torch.Generator().manual_seed(1))]
    y = protocol.draw_inputs(types.SimpleNamespace(get_inputs=own_generator), 5, torch.device("meta"))
    assert y[0].device.type == "meta"

    def oom():
        if torch.empty(0).device.type != "cpu":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return [torch.randn(4)]
    with pytest.raises(torch.OutOfMemoryError):
        protocol.draw_inputs(types.SimpleNamespace(get_inputs=oom), 5, torch.device("meta"))


def test_kept_memory_counts_against_the_reply_limit(monkeypatch):
    """reply_limit bounds what a candidate's replies make the parent hold at once ("a candidate cannot exhaust our
    memory"). A judged whole output stays in the Child's kept memory through the timed runs (Child.ask(reuse=True)),
    so a "sample" reply (a tuple of many small outputs, each sampled whole, packed by the real harness with the right
    nonce) may bring only what the limit leaves beside it: more is refused before it is read (protocol.ReplyTooLarge; red
    team: it held reply_limit + one whole output). An honest sample still passes."""
    import threading
    import torch

    ref = torch.randn(16384)  # the reference output: 64 KiB
    cmd_r, cmd_w = os.pipe()
    rep_r, rep_w = os.pipe()

    def candidate():  # the child's harness, faithfully: every reply echoes its command's nonce
        while True:
            try:
                cmd, _ = protocol.recv(cmd_r)
            except (EOFError, ValueError):
                return
            if cmd["op"] == "full":
                blobs = []
                reply = {"out": protocol.pack(ref.clone(), blobs), "ops": [], "state": [], "mutated": False, "types": [], "devices": []}
            elif cmd["op"] == "sample" and cmd["offset"] == 1:  # an honest sample
                blobs = []
                reply = protocol.pack(protocol.sample_of(ref, 1), blobs)
            else:  # a timed run whose output is 18 tensors of 16384 floats: each sampled whole
                blobs = []
                reply = protocol.pack(tuple(torch.zeros(16384) for _ in range(18)), blobs)
            try:
                protocol.send(rep_w, reply, blobs, re=cmd["nonce"])
            except OSError:  # (the parent refused the reply and closed its end)
                return

    serving = threading.Thread(target=candidate, daemon=True)
    serving.start()
    c = object.__new__(protocol.Child)
    c.cmd_w, c.rep_r, c.key, c.thread, c.cmd_timeout = cmd_w, rep_r, "00" * 16, serving, None
    c.reply_limit = 2 * ref.numel() * ref.element_size() + (1 << 20)  # as evaluate() sets it

    held, peak = [0], [0]
    real_read = protocol._read_exact

    def counting_read(fd, n, alive=None, into=bytearray, deadline=None):  # the candidate's bytes this process holds
        if into is torch.uint8:
            held[0] += n
        kept = getattr(c, "_kept", None)
        kept = kept.numel() if kept is not None else 0
        peak[0] = max(peak[0], held[0] + kept)
        return real_read(fd, n, alive, into, deadline)

    monkeypatch.setattr(protocol, "_read_exact", counting_read)
    try:
        bad, err = env._judge_full(c, ref, env.Config(), "cpu", "check 1/1", lambda name: None, "checks")
        assert not bad and err is None  # an honest-looking check passes
        held[0] = 0
        obj, blobs = c.ask({"op": "sample", "offset": 1})
        assert torch.equal(protocol.unpack(obj, blobs), protocol.sample_of(ref, 1))
        with pytest.raises(ValueError, match="allowed"):  # 18 x 64 KiB: within reply_limit alone, not beside the kept 64 KiB
            c.ask({"op": "sample", "offset": 0})
    finally:
        os.close(cmd_w)
        os.close(rep_r)
        serving.join(5)
        os.close(rep_w)
        os.close(cmd_r)
    assert peak[0] <= c.reply_limit, f"the candidate's replies held {peak[0]} bytes at once, reply_limit is {c.reply_limit}"


def test_a_child_that_died_is_not_reported_as_timed_out():
    """The child's pipe closes before the thread that ran it ends (that thread closes the parent's copy of the write
    end and only then returns). An end of the pipe seen in that window, well before the command's deadline, is a
    death, not a timeout: a segfault must never be reported as `timed out`."""
    rep_r, rep_w = os.pipe()
    os.close(rep_w)  # the child has died: its reply pipe is at its end
    finishing = threading.Event()
    thread = threading.Thread(target=finishing.wait, daemon=True)  # the child's thread, not yet returned
    thread.start()
    c = object.__new__(protocol.Child)
    c.rep_r, c.thread, c.cmd_timeout, c.pgid = rep_r, thread, 30.0, None
    try:
        with pytest.raises(EOFError) as e:
            c.answer(expect="00", what="run")
        assert not isinstance(e.value, protocol.ChildTimeout), e.value
    finally:
        finishing.set()
        os.close(rep_r)


def test_a_child_past_its_deadline_is_stopped_and_reported_as_timed_out():
    rep_r, rep_w = os.pipe()  # a child that never answers: its pipe stays open and quiet
    finishing = threading.Event()
    thread = threading.Thread(target=finishing.wait, daemon=True)
    thread.start()
    c = object.__new__(protocol.Child)
    c.rep_r, c.thread, c.cmd_timeout, c.pgid = rep_r, thread, 0.3, None
    try:
        with pytest.raises(protocol.ChildTimeout, match="one `run` took longer than 0.3 s"):
            c.answer(expect="00", what="run")
    finally:
        finishing.set()
        os.close(rep_r)
        os.close(rep_w)


def test_device_reads_bookkeeping_with_a_stand_in_driver():
    """The native helper's device reads (protocol.TIMED_PAIR_C, read_device) against a stand-in CUDA driver whose
    "device memory" is a host buffer: the elements drawn are the ones gathered, an allocation is opened once and
    closed with its child, a gather not done at the first query is waited for, the helper's context is pushed and
    popped around each read, and an entry that reaches outside its allocation is refused before any gather (on a GPU
    a fault there would end the helper's context)."""
    import ctypes
    import random
    import struct
    lib = protocol.native()
    if lib is None:
        pytest.skip("no C compiler: no native helper")
    mem = (ctypes.c_uint8 * (1 << 16))(*[(i * 7 + 3) % 256 for i in range(1 << 16)])  # the child's allocation
    calls = {"open": 0, "close": 0, "push": 0, "pop": 0, "launch": 0}

    class Handle(ctypes.Structure):
        _fields_ = [("bytes", ctypes.c_char * 64)]
    u64p, vp = ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p

    def op(name, result=0):
        def f(*a):
            calls[name] += 1
            return result
        return f
    push = ctypes.CFUNCTYPE(ctypes.c_int, vp)(op("push"))

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(vp))
    def pop(was):
        calls["pop"] += 1
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, u64p, Handle, ctypes.c_uint)
    def open_(ptr, handle, flags):
        calls["open"] += 1
        ptr[0] = ctypes.addressof(mem)
        return 0 if handle.bytes.startswith(b"h") else 400  # (an unknown handle: CUDA_ERROR_INVALID_HANDLE)

    @ctypes.CFUNCTYPE(ctypes.c_int, u64p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64)
    def range_(base, size, ptr):
        base[0], size[0] = ctypes.addressof(mem), len(mem)
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, vp, *[ctypes.c_uint] * 7, vp, ctypes.POINTER(vp), ctypes.POINTER(vp))
    def launch(f, gx, gy, gz, bx, by, bz, shared, stream, args, extra):
        calls["launch"] += 1
        srcs, dst, n = (ctypes.cast(args[i], u64p)[0] for i in range(3))
        for i in range(n):  # the gather kernel: one byte per thread
            ctypes.memmove(dst + i, ctypes.cast(srcs, u64p)[i], 1)
        busy[0] = 2
        return 0
    faults, busy = [], [0]  # (what the next launch's end returns: 700 is CUDA_ERROR_ILLEGAL_ADDRESS)

    @ctypes.CFUNCTYPE(ctypes.c_int, vp)
    def query(stream):  # CUDA_ERROR_NOT_READY twice after each launch, as a real gather may be
        if busy[0]:
            busy[0] -= 1
            return 600
        return faults.pop() if faults else 0
    close = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)(op("close"))
    mine = {}  # the helper's own "device memory": address -> buffer

    @ctypes.CFUNCTYPE(ctypes.c_int, u64p, ctypes.c_size_t)
    def alloc(ptr, n):
        b = ctypes.create_string_buffer(n)
        mine[ctypes.addressof(b)] = b
        ptr[0] = ctypes.addressof(b)
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)
    def free(ptr):
        return 0 if mine.pop(ptr, None) is not None else 1

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, vp)
    def copy(dst, src, n, stream):
        calls["copy"] = calls.get("copy", 0) + 1
        calls.setdefault("streams", set()).add(stream)
        ctypes.memmove(dst, src, n)
        busy[0] = 2
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Handle), ctypes.c_uint64)
    def export(handle, ptr):
        ctypes.memmove(handle, b"e" + struct.pack("<Q", ptr) + b"e" * 55, 64)
        return 0
    fns = (vp * len(protocol.DRIVER_FNS))(*[ctypes.cast(f, vp) for f in (push, pop, open_, range_, launch, query, close,
                                                                          alloc, free, copy, export)])
    cap = protocol.MAX_OUTPUTS * protocol.READS * 16
    srcs, dst = ctypes.create_string_buffer(8 * cap), ctypes.create_string_buffer(cap)
    lib.gpu_setup(fns, 1, 1, 2, 1, ctypes.addressof(srcs), ctypes.addressof(dst), cap)
    try:
        base = 0x7F0000000000  # (the child's address of its allocation: any number; the mapping is ours)
        k, rand = protocol.READS, [random.getrandbits(64) for _ in range(protocol.READS * 2)]

        def read(entries, owner=1):
            table = b"".join(struct.pack("<4Q", a, n, size, base) + h for a, n, size, h in entries)
            msg = protocol._frame({}, [len(table)]) + table
            got, err = ctypes.create_string_buffer(1 << 16), ctypes.c_longlong()
            n = lib.read_outputs(2, owner, msg, len(msg), (ctypes.c_ulonglong * len(rand))(*rand), len(rand), k, got,
                                 len(got), time.monotonic_ns() + 10**10, ctypes.byref(err))
            return n, got.raw[:max(n, 0)], err.value
        h = b"h" * 64
        n, got, _ = read([(base + 4096, 4000 * 4, 4, h), (base + 100, 10, 2, h)])
        want = b"".join(bytes(mem[4096 + rand[i] % 4000 * 4:][:4]) for i in range(k))
        want += b"".join(bytes(mem[100 + rand[k + i] % 5 * 2:][:2]) for i in range(k))
        assert n == 6 * k and got == want
        assert calls["open"] == 1 and calls["launch"] == 1 and calls["push"] == calls["pop"] == 1
        for a, nbytes in ((base + len(mem) - 8, 16), (base - 4, 8), (base + 4096, 1 << 40), (base + (1 << 40), 4)):
            assert read([(a, nbytes, 4, h)])[0] == -6, (a - base, nbytes)
        assert calls["launch"] == 1  # (nothing gathered for them)
        assert read([(base, 16, 4, b"x" * 64)])[0] == -7  # a handle the driver refuses: the child's run fails
        faults.append(700)
        assert read([(base, 16, 4, h)]) == (-8, b"", 700)  # a fault in the gather: the helper's, not the child's
        assert calls["push"] == calls["pop"]
        opened = calls["open"]
        for i in range(40):  # a child listing ever new allocations: refused past its quota, nothing closed meanwhile
            n = read([(base, 16, 4, b"h%02d" % i + b"h" * 61)], owner=2)[0]
            assert n == (4 * k if i < 32 else -6), (i, n)
        assert calls["open"] == opened + 32 and calls["close"] == 0
        lib.gpu_forget(2)
        assert calls["close"] == 32 and read([(base + 4096, 4000 * 4, 4, h)])[0] == 4 * k
        assert calls["open"] == opened + 32  # (child 1's mapping kept)
        lib.gpu_forget(1)
        assert calls["close"] == 33
        # the timed runs' inputs (TimedInputs): a set copied out of a child's allocation into the helper's own memory
        # (the mapping closed at once), buffers of the helper's own exported, each run's set copied into them
        held, buf, handle = ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.create_string_buffer(64)
        gen, later = ctypes.c_longlong(), time.monotonic_ns() + 10**10
        assert lib.gpu_alloc(64, ctypes.byref(held), None, ctypes.byref(gen)) == 0
        assert lib.gpu_alloc(64, ctypes.byref(buf), handle, ctypes.byref(gen)) == 0
        assert handle.raw == b"e" + struct.pack("<Q", buf.value) + b"e" * 55
        e = struct.pack("<4Q", base + 1000, 64, 4, base) + h
        assert lib.gpu_copy_in(e, held.value, 64, gen.value, later) == 0
        assert ctypes.string_at(held.value, 64) == bytes(mem[1000:1064]) and calls["close"] == 34
        assert lib.gpu_copy_in(e, held.value, 32, gen.value, later) == -6  # (larger than where it goes)
        bad = struct.pack("<4Q", base + len(mem) - 32, 64, 4, base) + h
        assert lib.gpu_copy_in(bad, held.value, 64, gen.value, later) == -6  # (outside its allocation)
        one, err = ctypes.c_ulonglong * 1, ctypes.c_longlong()
        assert lib.write_inputs(2, 0, one(buf.value), one(held.value), one(64), 1, gen.value, later, ctypes.byref(err)) == 0
        assert ctypes.string_at(buf.value, 64) == bytes(mem[1000:1064]) and calls["push"] == calls["pop"]
        assert calls["streams"] == {2}  # (the inputs' own stream: never queued behind a gather, nor one behind them)
        # the helper's context made again (after a fault): memory of the old one is neither written nor freed
        lib.gpu_setup(fns, 1, 1, 2, 1, ctypes.addressof(srcs), ctypes.addressof(dst), cap)
        copies = calls["copy"]
        assert lib.write_inputs(2, 0, one(buf.value), one(held.value), one(64), 1, gen.value, later, ctypes.byref(err)) == -12
        assert lib.gpu_copy_in(e, held.value, 64, gen.value, later) == -12 and calls["copy"] == copies
        assert lib.gpu_free(held.value, gen.value) == -12 and len(mine) == 2
        assert lib.gpu_free(held.value, gen.value + 1) == 0 and lib.gpu_free(buf.value, gen.value + 1) == 0 and not mine
    finally:
        state = protocol._gpu_state[0] if protocol._gpu_state else None
        if state:
            lib.gpu_setup(*state[1])
        else:
            lib.gpu_setup((vp * len(protocol.DRIVER_FNS))(), None, None, None, None, None, None, 0)


def test_timed_inputs_are_one_structure_and_refuse_buffers_of_other_sizes():
    """TimedInputs holds each timed set's tensors and writes them into the buffers a child lists: a child listing
    buffers of other sizes is refused (its run would read past what was written), and sets of different shapes
    cannot share one child's buffers."""
    import ctypes

    import torch

    import protocol

    class Ref:
        number, shapes = 1, iter([(4, 3), (4, 3), (5, 3)])

        def ask(self, obj, reuse=False):
            assert obj["op"] == "set"
            blobs = []
            out = protocol.pack([torch.full(next(self.shapes), float(obj["seed"])), 2], blobs)
            return {"ok": True, "out": out}, [torch.from_numpy(b) for b in blobs]  # (as recv gives them)

    class Cand:
        def __init__(self, number, shape):
            self.number, self.shape = number, shape

        def ask(self, obj, reuse=False):
            assert obj["op"] == "buffers" and obj["inputs"]["seq"][1] == {"v": 2}
            self.buffers, table = [torch.empty(self.shape), 2], []
            out = protocol.layout(self.buffers, table)
            return {"ok": True, "out": out}, [torch.frombuffer(bytearray(b"".join(table)), dtype=torch.uint8)]

    ti = protocol.TimedInputs("cpu").take(Ref(), [7, 8])
    with pytest.raises(ValueError, match="not the size"):
        ti.attach(Cand(2, (4, 2)))
    good = Cand(3, (4, 3))
    writes = ti.attach(good)
    assert len(writes) == 2 and list(writes[1][3]) == [48] and writes[1][1][0] == good.buffers[0].data_ptr()
    assert ctypes.string_at(writes[1][2][0], 48) == torch.full((4, 3), 8.0).numpy().tobytes()
    assert ti.attach(good) is writes  # (once per child)
    with pytest.raises(ValueError, match="differ"):
        ti.take(Ref(), [9])


@pytest.mark.parametrize("task", ["changes its input", "draws a value per set"])
def test_timed_inputs_of_a_task_that_changes_or_varies_them(tmp_path, task):
    """The timed sets the parent holds are the inputs as drawn, not as a Model that changes them in place left them;
    a task whose inputs include a value drawn per set cannot share one set of buffers, and its children load each
    set themselves (as where no writes are possible). An honest kernel is correct for both, in seconds."""
    import time
    code, new = RELU, model_new("relu", "cuda_extension.relu_scale(x, self.scale)")
    if task == "changes its input":
        code = code.replace("return torch.relu(x * self.scale)", "x.mul_(self.scale)\n        return torch.relu(x)")
    else:
        code = code.replace("return [torch.randn(BATCH, DIM)]", "return [torch.randn(BATCH, DIM), float(torch.rand(()))]")
        code = code.replace("def forward(self, x):", "def forward(self, x, t):")
        new = new.replace("def forward(self, x):", "def forward(self, x, t):")
    assert code != RELU and "def forward(self, x" in new
    ws = make_ws(tmp_path, "relu", new)
    (ws / "model.py").write_text(code)
    t0 = time.monotonic()
    v = env.evaluate(ws, backend="cpu", timeout=120)
    assert v.correct and v.runtime_ms and v.reward >= 1, v.summary()
    assert time.monotonic() - t0 < 60, v.summary()


def test_stop_processes_stops_every_thread_of_every_process_of_the_namespace():
    """protocol.stop_processes (the parent's writes of timed inputs): in a PID namespace of its own, a process, its
    threads, its child and that child's child are all stopped, thread by thread, when it returns, and continue on
    SIGCONT; a child in this process's own namespace is refused (its processes could not be told from ours)."""
    import shutil
    import signal
    import protocol
    code = ("import os, threading, time\n"
            "for _ in range(3):\n    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "if os.fork() == 0:\n    os.fork()\n    time.sleep(60)\n    os._exit(0)\n"
            "time.sleep(60)\n")
    with pytest.raises(protocol.HarnessError):
        protocol.stop_processes(os.getpid(), time.monotonic() + 1)
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--pid", "--fork", "true"], capture_output=True).returncode:
        pytest.skip("no PID namespace here")
    p = subprocess.Popen([unshare, "--pid", "--fork", sys.executable, "-c", code])

    def kids(pid):
        return [int(k) for t in os.listdir(f"/proc/{pid}/task")
                for k in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]

    def states(pid):
        return {Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[-1].split()[0]
                for t in os.listdir(f"/proc/{pid}/task")}
    try:
        deadline, family = time.monotonic() + 10, []
        while time.monotonic() < deadline and len(family) < 3:
            family = [p.pid]
            while kids(family[-1]) and len(family) < 4:
                family.append(kids(family[-1])[0])
            family = family[1:]  # (unshare's own process stays outside the namespace)
            time.sleep(0.05)
        done = protocol.stop_processes(family[0], time.monotonic() + 10)
        assert sorted(done) == sorted(family) and len(os.listdir(f"/proc/{family[0]}/task")) == 4, (done, family)
        assert all(states(pid) == {"T"} for pid in family)
        for pid in done:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.2)
        assert all("T" not in states(pid) for pid in family)
    finally:
        p.kill()
        for pid in family:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        p.wait()
