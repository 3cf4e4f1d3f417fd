"""What the env benches share: their verdict task, a naive matmul (tests/env_cases), ~1 ms on the H200 (1024^3 fp32)
and 256x512x256 on the CPU backend, with its kernel sources and a ModelNew that calls it; the timing floor's
1-element task; and KernelBench's timer."""
import importlib.machinery
import importlib.util
import shutil
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "env_cases"
MODEL_NEW = ("import torch\nimport torch.nn as nn\nimport cuda_extension\n\n\nclass ModelNew(nn.Module):\n"
             "    def __init__(self):\n        super().__init__()\n\n"
             "    def forward(self, a, b):\n        return cuda_extension.matmul(a, b)\n")


def matmul_ws(ws: Path, cuda: bool) -> Path:
    (ws / "kernels").mkdir(parents=True)
    if cuda:
        (ws / "model.py").write_text((CASES / "cuda" / "matmul1k.py").read_text())
        for f in (CASES / "cuda").glob("ops*"):
            (ws / "kernels" / f.name).write_text(f.read_text())
    else:
        (ws / "model.py").write_text((CASES / "matmul.py").read_text().replace("M, K, N = 64, 128, 96", "M, K, N = 256, 512, 256"))
        (ws / "kernels" / "ops.cpp").write_text((CASES / "ops.cpp").read_text())
    (ws / "model_new.py").write_text(MODEL_NEW)
    return ws


def floor_ws(ws: Path, matmul: Path) -> Path:
    """The timing floor's task: relu of one float (examples/relu.py at 1 x 1), with the matmul workspace's kernels
    (they hold relu_scale too): what every verdict's protocol costs around a kernel that does nothing."""
    shutil.copytree(matmul / "kernels", ws / "kernels")
    relu = (ROOT / "examples" / "relu.py").read_text()
    (ws / "model.py").write_text(relu.replace("BATCH = 64", "BATCH = 1").replace("DIM = 4096", "DIM = 1"))
    (ws / "model_new.py").write_text(
        "import torch\nimport torch.nn as nn\nimport cuda_extension\n\n\nclass ModelNew(nn.Module):\n"
        "    def __init__(self, dim):\n        super().__init__()\n        self.scale = nn.Parameter(torch.randn(dim))\n\n"
        "    def forward(self, x):\n        return cuda_extension.relu_scale(x, self.scale)\n")
    return ws


def load_extension(so_path: Path):
    """A built module under the name model_new.py imports, in this process (a bench's own kernels: trusted)."""
    loader = importlib.machinery.ExtensionFileLoader("cuda_extension", str(so_path))
    spec = importlib.util.spec_from_loader("cuda_extension", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def event_times(fn, inputs, runs: int = 100, warmup: int = 5) -> list:
    """KernelBench's timer: CUDA events recorded on the stream around each run, ms per run. The device's time for the
    kernels of one run, without launching them from the host or learning that they ended; not what the reward uses
    (README, "What a runtime is")."""
    import torch
    with torch.no_grad():
        for _ in range(warmup):
            fn(*inputs)
        torch.cuda.synchronize()
        ts = []
        for _ in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(*inputs)
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
    return ts


def event_ms(fn, inputs, runs: int = 100, warmup: int = 5) -> float:
    """The median of event_times."""
    return statistics.median(event_times(fn, inputs, runs, warmup))
