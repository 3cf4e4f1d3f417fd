"""elementwise.py: the elementwise task family, a curriculum the embedded model can climb.

A task is a fused chain of 1-5 operators on one float32 input x of shape (BATCH, DIM) or (BATCH, SEQ_LEN, DIM):
unary activations, arithmetic with scalar constants or per-feature parameters (vectors of DIM), and at most one
reduction over the last dimension (softmax, layer norm, sum, ...). Every such chain is one pass over memory
(row by row when it holds a reduction), so one fused kernel solves it, and the fused kernel is short enough for
a small model to learn to write.

    python synth.py --family elementwise --out data/elem --num-tasks 64 --backend cpu   # tasks, synth.py's filters
    python agent.py --policy teacher --problem task.py --backend cpu                   # a demonstration (teacher.py)

What this module holds, top to bottom:
  1. the op table (data): per op, its PyTorch spelling in Model.forward and its C expression of `v`;
  2. compose_one(): sample a chain, pick a shape in the eager-time window, reject degenerate tasks, render the
     KernelBench-format module; synth.py runs its own filters on the result (--family elementwise);
  3. parse(): the chain back from a task's code (what the teacher reads);
  4. emitters: the op library a workspace of this family starts with (one function per op, so that a kernel's
     chain is a copy of Model.forward, a line and its C per op, and one row function per reduction, so that a
     reduction is a name too), the fixed binding, the kernel source (CUDA .cu or C++/OpenMP .cpp) in several
     variants, and model_new.py; teacher.py writes the last three through the tools.

Degenerate tasks are dropped at composition, because they would reward a wrong kernel at atol = rtol = 1e-2:
a task whose output a constant (zeros included) matches on more than 3/4 of the elements (softmax over
thousands of columns: every value is ~1e-4), and a task with an op that can be left out or replaced by a constant
per row (either changes under 5% of the outputs beyond tolerance: abs after relu; a softmax over 2,048 columns
followed by a parameter). Composition
tries smaller rows (DIM) before it gives up on a chain.
"""
from __future__ import annotations

import ast
import hashlib
import math
import random
import re
import textwrap

import torch
import torch.nn.functional as F

from ops import MEM_CAP, ROOFLINE, grow_batch
from scan import parse_python

# ----------------------------------------------------------------------------------------------
# 1. The op table. {a}, {b}: scalar constants (sampled from "consts"); {p}: a per-feature parameter of DIM values.
# torch: the line of Model.forward (x in, x out); c: the same math in C on float v (d: the feature index); cu: the
# CUDA library's, where it differs: the special function units' __expf / __logf / __fdividef and a tanh made of them
# (a few ulp, far inside atol = rtol = 1e-2), and a product for a division by 6. A fused chain is compute-bound on the
# accurate functions: tanh -> softplus -> mul -> add_param -> silu is 145 PTX instructions an element with them, 55
# without (nvcc -O3, sm_90), where an H200 streams an element (8 bytes at 4.8 TB/s) in the time of ~56 (33 T/s).
# cpu_ns: single-thread eager ns per element, roughly (measured at 1 MB; sizing only: synth.py's filter measures).
# ----------------------------------------------------------------------------------------------
OPS = {
    "relu":        dict(torch="torch.relu(x)", c="fmaxf(v, 0.f)", cpu_ns=0.25),
    "leaky_relu":  dict(torch="F.leaky_relu(x, {a})", c="(v > 0.f ? v : {a} * v)", consts=[(0.01,), (0.1,), (0.2,)], cpu_ns=0.25),
    "gelu":        dict(torch="F.gelu(x)", c="0.5f * v * (1.f + erff(v * 0.70710678f))", cpu_ns=1.5),
    "gelu_tanh":   dict(torch="F.gelu(x, approximate='tanh')",
                        c="0.5f * v * (1.f + tanhf(0.79788456f * (v + 0.044715f * v * v * v)))",
                        cu="0.5f * v * (1.f + lib_fast_tanh(0.79788456f * (v + 0.044715f * v * v * v)))", cpu_ns=2),
    "silu":        dict(torch="F.silu(x)", c="v / (1.f + expf(-v))", cu="__fdividef(v, 1.f + __expf(-v))", cpu_ns=2),
    "sigmoid":     dict(torch="torch.sigmoid(x)", c="1.f / (1.f + expf(-v))", cu="__fdividef(1.f, 1.f + __expf(-v))", cpu_ns=1),
    "tanh":        dict(torch="torch.tanh(x)", c="tanhf(v)", cu="lib_fast_tanh(v)", cpu_ns=2),
    "softplus":    dict(torch="F.softplus(x)", c="(v > 20.f ? v : log1pf(expf(v)))",
                        cu="(v > 20.f ? v : __logf(1.f + __expf(v)))", cpu_ns=3),
    "elu":         dict(torch="F.elu(x, {a})", c="(v > 0.f ? v : {a} * expm1f(v))",
                        cu="(v > 0.f ? v : {a} * (__expf(v) - 1.f))", consts=[(0.5,), (1.0,)], cpu_ns=2),
    "hardtanh":    dict(torch="F.hardtanh(x, {a}, {b})", c="fminf(fmaxf(v, {a}), {b})",
                        consts=[(-1.0, 1.0), (-0.5, 2.0), (-2.0, 0.5)], cpu_ns=0.25),
    "hardsigmoid": dict(torch="F.hardsigmoid(x)", c="fminf(fmaxf(v / 6.f + 0.5f, 0.f), 1.f)",
                        cu="fminf(fmaxf(v * 0.16666667f + 0.5f, 0.f), 1.f)", cpu_ns=0.25),
    "hardswish":   dict(torch="F.hardswish(x)", c="v * fminf(fmaxf(v + 3.f, 0.f), 6.f) / 6.f",
                        cu="v * fminf(fmaxf(v + 3.f, 0.f), 6.f) * 0.16666667f", cpu_ns=0.25),
    "mish":        dict(torch="F.mish(x)", c="v * tanhf(v > 20.f ? v : log1pf(expf(v)))",
                        cu="v * lib_fast_tanh(v > 20.f ? v : __logf(1.f + __expf(v)))", cpu_ns=6),
    "add":         dict(torch="x + {a}", c="v + {a}", consts=[(0.5,), (1.0,), (2.0,)], cpu_ns=0.25),
    "sub":         dict(torch="x - {a}", c="v - {a}", consts=[(0.5,), (1.0,), (0.25,)], cpu_ns=0.25),
    "mul":         dict(torch="x * {a}", c="v * {a}", consts=[(0.5,), (2.0,), (-1.5,), (3.0,)], cpu_ns=0.25),
    "div":         dict(torch="x / {a}", c="v / {a}", consts=[(2.0,), (4.0,), (0.5,)], cpu_ns=0.25),
    "square":      dict(torch="x * x", c="v * v", cpu_ns=0.25),
    "clamp":       dict(torch="torch.clamp(x, {a}, {b})", c="fminf(fmaxf(v, {a}), {b})",
                        consts=[(-1.0, 1.0), (0.0, 2.0), (-0.5, 0.5)], cpu_ns=0.25),
    "abs":         dict(torch="torch.abs(x)", c="fabsf(v)", cpu_ns=0.25),
    "exp":         dict(torch="torch.exp(x)", c="expf(v)", cu="__expf(v)", cpu_ns=1),
    # per-feature parameters (init: the nn.Parameter's initial value; DIM is the constructor's `dim`)
    "add_param":   dict(torch="x + self.{p}", c="v + {p}[d]", param="torch.randn(dim)", cpu_ns=0.25),
    "sub_param":   dict(torch="x - self.{p}", c="v - {p}[d]", param="torch.randn(dim)", cpu_ns=0.25),
    "mul_param":   dict(torch="x * self.{p}", c="v * {p}[d]", param="torch.randn(dim)", cpu_ns=0.25),
    "div_param":   dict(torch="x / self.{p}", c="v / {p}[d]", param="torch.rand(dim) + 0.5", cpu_ns=0.25),
}
# Reductions over the last dimension. stats: (name, "sum" | "max", C term accumulated over the row, final value),
# computed in order (a later term may use an earlier statistic). out: the C value of each element (the shape is
# kept; c: the column); result: the row's one value (the last dimension is reduced away). Norm affine parameters: {g}, {o}.
SOFTMAX_STATS = [("m", "max", "v", "m"), ("s", "sum", "expf(v - m)", "s")]
NORM_STATS = [("mu", "sum", "v", "mu / cols"), ("var", "sum", "(v - mu) * (v - mu)", "var / cols")]
RMS_STATS = [("ms", "sum", "v * v", "ms / cols")]
REDUCTIONS = {
    "softmax":     dict(torch="torch.softmax(x, dim=-1)", stats=SOFTMAX_STATS, out="expf(v - m) / s", cpu_ns=1),
    "log_softmax": dict(torch="torch.log_softmax(x, dim=-1)", stats=SOFTMAX_STATS, out="v - m - logf(s)", cpu_ns=1),
    "logsumexp":   dict(torch="torch.logsumexp(x, dim=-1)", stats=SOFTMAX_STATS, result="m + logf(s)", cpu_ns=1.5),
    "sum":         dict(torch="torch.sum(x, dim=-1)", stats=[("s", "sum", "v", "s")], result="s", cpu_ns=0.25),
    "mean":        dict(torch="torch.mean(x, dim=-1)", stats=[("s", "sum", "v", "s / cols")], result="s", cpu_ns=0.25),
    "max":         dict(torch="torch.amax(x, dim=-1)", stats=[("m", "max", "v", "m")], result="m", cpu_ns=0.25),
    "layer_norm":  dict(torch="F.layer_norm(x, (x.shape[-1],), eps=1e-5)", stats=NORM_STATS,
                        out="(v - mu) / sqrtf(var + 1e-5f)", cpu_ns=0.5),
    "layer_norm_affine": dict(torch="F.layer_norm(x, (x.shape[-1],), self.{g}, self.{o}, eps=1e-5)", stats=NORM_STATS,
                              out="(v - mu) / sqrtf(var + 1e-5f) * {g}[c] + {o}[c]", cpu_ns=0.5),
    "rms_norm":    dict(torch="F.rms_norm(x, (x.shape[-1],), eps=1e-6)", stats=RMS_STATS, out="v / sqrtf(ms + 1e-6f)", cpu_ns=0.5),
    "rms_norm_affine": dict(torch="F.rms_norm(x, (x.shape[-1],), self.{g}, eps=1e-6)", stats=RMS_STATS,
                            out="v / sqrtf(ms + 1e-6f) * {g}[c]", cpu_ns=0.5),
}
NORM_INIT = {"g": "torch.randn(dim) * 0.5 + 1.0", "o": "torch.randn(dim) * 0.5"}  # not 1 and 0: affine must matter
N_OPS_WEIGHTS = {1: 0.15, 2: 0.3, 3: 0.25, 4: 0.15, 5: 0.15}
P_REDUCTION = 0.5  # share of chains with a reduction
DIMS = [64, 128, 256, 512, 1024, 2048, 4096]  # the last dimension (a multiple of 4: float4 loads); 16, 32 on retries
SEQ_LENS = [16, 32, 64, 128]
ROOFLINE_CUDA = (ROOFLINE["cuda"][0], ROOFLINE["cuda"][2])  # bytes/s and per-kernel overhead (s), as the paper family
ATOL = RTOL = 1e-2  # env.py's tolerances


def c_float(x: float) -> str:
    return f"{float(x)!r}f"


# ----------------------------------------------------------------------------------------------
# 2. Compose
# ----------------------------------------------------------------------------------------------
def sample_chain(rng: random.Random, n_ops: int) -> list[dict]:
    """Steps {"op", "a", "b", "p", "g", "o"}; at most one reduction, and no per-feature op after a reduction that
    removed the last dimension."""
    red_at = rng.randrange(n_ops) if rng.random() < P_REDUCTION else None
    steps, reduced = [], False
    for i in range(n_ops):
        if i == red_at:
            name = rng.choice(list(REDUCTIONS))
            st = {"op": name}
            if "{g}" in REDUCTIONS[name]["torch"]:
                st["g"] = f"gamma{i}"
            if "{o}" in REDUCTIONS[name]["torch"]:
                st["o"] = f"beta{i}"
            reduced = "result" in REDUCTIONS[name]
        else:
            names = [n for n in OPS if not (reduced and "param" in OPS[n])]
            name = rng.choice(names)
            st = {"op": name}
            if "consts" in OPS[name]:
                st.update(zip("ab", rng.choice(OPS[name]["consts"])))
            if "param" in OPS[name]:
                st["p"] = f"w{i}"
        steps.append(st)
    return steps


def torch_line(st: dict) -> str:
    spec = OPS.get(st["op"]) or REDUCTIONS[st["op"]]
    return spec["torch"].format(**{k: (repr(v) if isinstance(v, float) else v) for k, v in st.items() if k != "op"})


def render(steps: list[dict], shape: tuple) -> str:
    """The KernelBench-format module: class Model(dim), get_inputs(), get_init_inputs()."""
    names = ["BATCH", "DIM"] if len(shape) == 2 else ["BATCH", "SEQ_LEN", "DIM"]
    init = []
    for st in steps:
        if "p" in st:
            init.append(f"        self.{st['p']} = nn.Parameter({OPS[st['op']]['param']})")
        for k in ("g", "o"):
            if k in st:
                init.append(f"        self.{st[k]} = nn.Parameter({NORM_INIT[k]})")
    fwd = "".join(f"        x = {torch_line(st)}\n" for st in steps)
    return ("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"
            + "".join(f"{n} = {v}\n" for n, v in zip(names, shape)) + "\n\n"
            f"class Model(nn.Module):\n    \"\"\"{' -> '.join(st['op'] for st in steps)}\"\"\"\n\n"
            "    def __init__(self, dim):\n        super().__init__()\n" + "".join(l + "\n" for l in init) +
            f"\n    def forward(self, x):\n{fwd}        return x\n\n\n"
            f"def get_inputs():\n    return [torch.randn({', '.join(names)})]\n\n\n"
            "def get_init_inputs():\n    return [DIM]\n")


def estimate_ms(steps: list[dict], shape: tuple, backend: str) -> tuple[float, int]:
    """Eager time (a rough roofline: every op is one kernel that reads and writes its tensor) and bytes held
    (input and every intermediate), for sizing. synth.py's filter measures the real time."""
    n = math.prod(shape)
    t, held = 0.0, 4 * n
    for st in steps:
        spec = OPS.get(st["op"]) or REDUCTIONS[st["op"]]
        n_out = n // shape[-1] if "result" in spec else n
        if backend == "cuda":
            bw, overhead = ROOFLINE_CUDA
            t += 4 * (n + n_out) / bw + overhead
        else:
            t += n * spec["cpu_ns"] * 1e-9
        held += 4 * n_out
        n = n_out
    return t * 1e3, held


def degenerate(out, keeps_last_dim: bool) -> str | None:
    """Why a constant answer would pass env.py's check on this output, or None. The constant is the row's
    median (a row-constant kernel must fail too) or, for reduced outputs, the global median."""
    if not bool(torch.isfinite(out).all()):
        return "non-finite output"
    if out.numel() < 2:
        return "scalar output"
    c = out.median(dim=-1, keepdim=True).values if keeps_last_dim else out.flatten().median()
    off = (out - c).abs() > ATOL + RTOL * out.abs()
    if off.float().mean().item() < 0.25:
        return "degenerate: a constant matches most outputs at atol=1e-2"
    return None


def run_chain(code: str, shape: tuple, seed: int = 0, ablate: tuple | None = None):
    """Run a rendered task on CPU at `shape` (trusted code: this module wrote it). ablate=(k, "skip"): leave out
    step k; (k, "const"): replace step k's output by its row median. The parameters stay the same (the model is
    built as it is; its forward is replayed line by line)."""
    ns = {}
    exec(compile(code, "<elementwise task>", "exec"), ns)
    torch.manual_seed(seed)
    model = ns["Model"](*ns["get_init_inputs"]()).eval()
    torch.manual_seed(seed + 1)
    x = torch.randn(*shape)
    with torch.no_grad():
        if ablate is None:
            return model(x)
        for i, st in enumerate(parse(code)):
            if (i, "skip") != ablate:
                x = eval(torch_line(st), {"torch": torch, "F": F, "x": x, "self": model})
            if (i, "const") == ablate:
                x = x.median(dim=-1, keepdim=True).values.expand_as(x)
        return x


def every_op_matters(code: str, shape: tuple, out) -> str | None:
    """Why a kernel that gets one op wrong would pass, or None. Leaving an op out, and replacing its output by a
    constant per row, must each change at least 5% of the outputs beyond atol/rtol (abs after relu: leaving it out
    changes nothing; a softmax over 2,048 columns is ~5e-4 everywhere: as good as a constant). A reduction that
    removes the last dimension is not ablated."""
    for k, st in enumerate(parse(code)):
        if "result" in REDUCTIONS.get(st["op"], {}):
            continue
        for how in ("skip", "const"):
            alt = run_chain(code, shape, 0, ablate=(k, how))
            if alt.shape == out.shape and ((alt - out).abs() > ATOL + RTOL * out.abs()).float().mean().item() < 0.05:
                what = "leaving out" if how == "skip" else "a constant per row instead of"
                return f"degenerate: {what} {st['op']} changes under 5% of the outputs"
    return None


def compose_one(index: int, seed: int = 0, backend: str = "cpu", window_ms=(0.1, 10.0), max_ops: int = 5,
                mem_cap: int | None = None) -> dict:
    """Candidate number `index` (deterministic in (seed, index)): {"index", "ops", "data_source", "code", "shape",
    "est_ms"} or {"drop": reason}. The same shape as compose.compose_one's candidates, for synth.py's filters."""
    rng = random.Random(f"elementwise-{seed}-{index}")
    ks = [k for k in N_OPS_WEIGHTS if k <= max_ops]
    n_ops = rng.choices(ks, weights=[N_OPS_WEIGHTS[k] for k in ks])[0]
    steps = sample_chain(rng, n_ops)
    red = next((REDUCTIONS[st["op"]] for st in steps if st["op"] in REDUCTIONS), None)
    keeps = red is None or "out" in red
    lead = (rng.choice(SEQ_LENS),) if rng.random() < 0.3 else ()
    # rows of DIM: the sampled one, then smaller ones while the task is degenerate (softmax over many columns)
    d0 = rng.choice(DIMS)
    why = "no DIM tried"
    for dim in [d for d in [16, 32] + DIMS if d <= d0][::-1]:
        small = (4, dim)  # rows are independent: 4 of them show the chain (and stay single-threaded in torch)
        code = render(steps, small)
        try:
            outs = [run_chain(code, small, s) for s in (0, 1)]
        except Exception as e:  # noqa: BLE001 - a chain torch rejects
            return {"drop": f"chain fails in eager: {type(e).__name__}"}
        why = degenerate(outs[0], keeps) or degenerate(outs[1], keeps) or every_op_matters(code, small, outs[0])
        if why is None:
            break
    else:
        return {"drop": why}
    # size: double BATCH until the estimate reaches the window's target, under the memory cap (as compose.py)
    best = grow_batch(lambda sh: estimate_ms(steps, sh, backend), (1,) + lead + (dim,), window_ms,
                      mem_cap or MEM_CAP[backend], max_doublings=25)
    if best is None:
        return {"drop": "too large even at BATCH=1 (memory cap or estimated time)"}
    shape, est = best
    ops = [st["op"] for st in steps]
    return {"index": index, "ops": ops, "data_source": f"elementwise#{len(ops)}", "code": render(steps, shape),
            "shape": list(shape), "est_ms": est}


# ----------------------------------------------------------------------------------------------
# 3. Parse: the chain back from a task's code (the grammar is the op table's torch column)
# ----------------------------------------------------------------------------------------------
def _pattern(template: str) -> re.Pattern:
    """A regex of the template as ast.unparse spells it (1e-5 -> 1e-05): constants {a} {b}, names {p} {g} {o}."""
    text = ast.unparse(parse_python(re.sub(r"\{(\w)\}", r"PH_\1", template)))
    rx = re.escape(text)
    for k in "ab":
        rx = rx.replace(f"PH_{k}", rf"(?P<{k}>-?[\d.]+(?:e-?\d+)?)")
    for k in "pgo":
        rx = rx.replace(f"PH_{k}", rf"(?P<{k}>\w+)")
    return re.compile(rx + "$")


PATTERNS = [(name, _pattern(spec["torch"])) for name, spec in {**OPS, **REDUCTIONS}.items()]


def parse(code: str) -> list[dict]:
    """The steps of a task of this family, from Model.forward: one `x = ...` line per op, then `return x`.
    ValueError for anything else (a forward that returns another expression computes more than its steps)."""
    tree = parse_python(code)
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)
    fwd = next((f for f in (model.body if model else []) if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
    if fwd is None:
        raise ValueError("no Model.forward")
    steps, returned = [], False
    for stmt in fwd.body:
        if isinstance(stmt, ast.Return):
            if stmt.value is None or ast.unparse(stmt.value) != "x":
                raise ValueError(f"forward returns {ast.unparse(stmt.value) if stmt.value else 'nothing'}, not x")
            returned = True
            break
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring
        if not (isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "x"):
            raise ValueError(f"not a chain step: {ast.unparse(stmt)}")
        text = ast.unparse(stmt.value)
        for name, rx in PATTERNS:
            m = rx.match(text)
            if m:
                st = {"op": name, **{k: (float(v) if k in "ab" else v) for k, v in m.groupdict().items()}}
                steps.append(st)
                break
        else:
            raise ValueError(f"not an op of the elementwise family: {text}")
    if not steps or not returned:
        raise ValueError("no chain of steps ending in `return x`")
    if sum(st["op"] in REDUCTIONS for st in steps) > 1:
        raise ValueError("more than one reduction")
    return steps


def params(steps: list[dict]) -> list[str]:
    """Parameter names in the order the kernel takes them."""
    return [st[k] for st in steps for k in ("p", "g", "o") if k in st]


# ----------------------------------------------------------------------------------------------
# 4. Emitters. One fixed binding and one fixed op library per backend (the same text for every task, so the binding's
# slow build is cached once: env.py's object cache keys a source by its text and every header's), one kernel source per
# (task, variant), one model_new.py per task.
#   launch(x, y, params, scratch, rows, cols, stream): y = chain(x) over rows of `cols` values; scratch holds
#   per-row statistics (the two-kernel variant) and is allocated by model_new.py.
# ----------------------------------------------------------------------------------------------
BINDING = """// kernels/binding.cpp: tensor checks, raw pointers and the one call of launch(); the math is in kernels/op.{ext}
#include <torch/extension.h>{include}
#include <vector>

extern "C" void launch(const float* x, float* y, const float* const* params, float* scratch, int64_t rows,
                       int64_t cols, void* stream);

static void check(const torch::Tensor& t, const char* what) {{
  TORCH_CHECK(t.{device_check} && t.scalar_type() == torch::kFloat && t.is_contiguous(), what,
              " must be a contiguous float32 {device} tensor");
}}

// x: (..., cols); y: x's shape, or x's shape without the last dimension; params: vectors of cols values
void forward(torch::Tensor x, torch::Tensor y, std::vector<torch::Tensor> params, torch::Tensor scratch) {{
  check(x, "x");
  check(y, "y");
  int64_t cols = x.size(-1), rows = x.numel() / cols;
  TORCH_CHECK(y.numel() == x.numel() || y.numel() == rows, "y must have x's shape, or one value per row");
  std::vector<const float*> p;
  for (auto& t : params) {{
    check(t, "a parameter");
    TORCH_CHECK(t.numel() == cols, "a parameter must have x.size(-1) values");
    p.push_back(t.data_ptr<float>());
  }}
  float* s = scratch.numel() ? scratch.data_ptr<float>() : nullptr;
  launch(x.data_ptr<float>(), y.data_ptr<float>(), p.data(), s, rows, cols, {stream});
}}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def("forward", &forward); }}
"""


def binding(backend: str) -> str:
    if backend == "cuda":
        return BINDING.format(ext="cu", include="\n#include <ATen/cuda/CUDAContext.h>", device_check="is_cuda()",
                              device="CUDA", stream="at::cuda::getCurrentCUDAStream().stream()")
    return BINDING.format(ext="cpp", include="", device_check="is_cpu()", device="CPU", stream="nullptr")


def _c(template: str, st: dict) -> str:
    return template.format(**{k: (c_float(v) if isinstance(v, float) else v) for k, v in st.items() if k != "op"})


def keeps_shape(red: dict | None) -> bool:
    """Whether the output has x's shape: no reduction, or one that keeps the last dimension (softmax, the norms)."""
    return red is None or "out" in REDUCTIONS[red["op"]]


def split(steps: list[dict]):
    """(ops before the reduction, the reduction step or None, ops after it)."""
    i = next((i for i, st in enumerate(steps) if st["op"] in REDUCTIONS), None)
    return (steps, None, []) if i is None else (steps[:i], steps[i], steps[i + 1:])


def model_new(code: str, steps: list[dict], backend: str) -> str:
    """model_new.py: Model's constructor with the same parameters, each only allocated (`torch.rand(dim) + 0.5`
    would be a PyTorch op that env.py refuses while ModelNew is built; the harness loads Model's values into them),
    and a forward that allocates and calls the kernel."""
    tree = parse_python(code)
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    init = next(f for f in model.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    for node in ast.walk(init):  # nn.Parameter(<any expression>) -> nn.Parameter(torch.empty(dim)): every family
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "nn.Parameter":  # parameter is per feature
            node.args = [parse_python("torch.empty(dim)", mode="eval").body]
    _, red, _ = split(steps)
    keeps = keeps_shape(red)
    n_stats = len(REDUCTIONS[red["op"]]["stats"]) if red else 0
    out = "torch.empty_like(x)" if keeps else "torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)"
    scratch = f"torch.empty(x.numel() // x.shape[-1] * {n_stats}, device=x.device)" if n_stats else \
        "torch.empty(0, device=x.device)"
    ps = ", ".join(f"self.{p}" for p in params(steps))
    return ('"""ModelNew: the same parameters as Model; the whole chain runs in one fused kernel (kernels/op.'
            f'{"cu" if backend == "cuda" else "cpp"})."""\nimport torch\nimport torch.nn as nn\n\nimport cuda_extension\n\n\n'
            f"class ModelNew(nn.Module):\n{textwrap.indent(ast.unparse(init), '    ')}\n\n" +
            "    def forward(self, x):\n"
            f"        y = {out}\n"
            f"        scratch = {scratch}  # per-row statistics (used by the two-kernel variant)\n"
            f"        cuda_extension.forward(x, y, [{ps}], scratch)\n"
            "        return y\n")


# The op library: every op that PyTorch spells as a function call (torch.X / F.X) is a function op_X of the same
# name in one fixed header that a workspace of this family starts with (provided_files; agent.py writes it beside
# env.py's scaffold); arithmetic (x + 0.5, x * self.w0) stays inline. A kernel's chain is then one pair of lines per
# op, a copy of Model.forward's line and its C:
#     // x = F.leaky_relu(x, 0.1)
#     v = op_leaky_relu(v, 0.1f);
# Why: a small model copies text from its context far better than it recalls a C expression per op (the embedded
# model, trained on 16 demonstrations, wrote the right op names with other ops' math: docs/curriculum.md), and a
# header the policy had to write itself would be 1,300 tokens to recall in every episode (its op functions alone).
LIBRARY = [name for name, spec in OPS.items() if not spec["torch"].startswith("x ")]
assert not any("param" in OPS[n] for n in LIBRARY), "a library function takes scalars only (_line passes no {p})"
HEADER_PATH = {"cuda": "kernels/lib.cuh", "cpu": "kernels/lib.h"}


def provided_files(code: str, backend: str) -> dict:
    """What a workspace of a task of this family starts with besides env.py's scaffold (path -> text): the op
    library. {} for a task outside the family."""
    try:
        parse(code)
    except (ValueError, SyntaxError):
        return {}
    return {HEADER_PATH[backend]: header(backend)}


def provided_note(backend: str) -> str:
    """The task message's line about the op library (agent.task_message, for a task of this family)."""
    fns = ", ".join(f"op_{n}({_signature(n).replace('float ', '')})" for n in LIBRARY)
    cuda = backend == "cuda"
    rows = (f"; the row reductions {', '.join(f'op_{n}' for n in REDUCTIONS)}: op_R<pre, post>(x, y, row, cols, "
            f"self) computes R over row `row` of x, pre and post being the kernel's chain before and after it, self its "
            f"Params (an affine norm's self.g, self.o before self)"
            f"{'; every thread of a block calls it (op_R_warp: of one warp)' if cuda else ''}")
    threads = "; and warp_sum, warp_max, block_sum, block_max (every thread gets the result)"
    return (f"{HEADER_PATH[backend]} (provided) defines {fns}: PyTorch's op of that name on one value "
            f"(F.gelu(x, approximate='tanh'): op_gelu_tanh){rows}{threads if cuda else ''}.")


def solution_files(code: str, backend: str, variant: str = "", block: int = 256) -> dict:
    """The files a solution of the task `code` writes (workspace path -> text): binding, kernel, model_new.py."""
    steps = parse(code)
    return {"kernels/binding.cpp": binding(backend),
            f"kernels/op.{'cu' if backend == 'cuda' else 'cpp'}": kernel_source(steps, backend, variant, block),
            "model_new.py": model_new(code, steps, backend)}


def _signature(name: str) -> str:
    return ", ".join(["float v"] + [f"float {k}" for k in "ab" if f"{{{k}}}" in OPS[name]["c"]])


def header(backend: str) -> str:
    """kernels/lib.cuh (CUDA: the library, then sums and maxima across a warp or a block) or kernels/lib.h (C++)."""
    cuda = backend == "cuda"
    qual = "__device__ __forceinline__" if cuda else "static inline"
    fns = "".join(f"{qual} float op_{n}({_signature(n)}) {{ return {_math(n, backend).format(a='a', b='b')}; }}\n"
                  for n in LIBRARY)
    return (f"// {HEADER_PATH[backend]}: op_X(v, ...) computes PyTorch's X (F.gelu(x, approximate='tanh'): op_gelu_tanh)"
            f"{'; reductions across threads, then' if cuda else '; then'} the row reductions. The same text for every task.\n"
            "#pragma once\n#include <math.h>\n" + ("\n" + TANH_FAST if cuda else CPU_FUNCTIONS) + fns
            + (REDUCE_FUNCTIONS if cuda else "") + ROW_NOTE + ROW_WHO[backend]
            + "".join(_row_function(r, backend, warp) for r in REDUCTIONS for warp in ([False, True] if cuda else [False])))


def _math(name: str, backend: str) -> str:
    return OPS[name].get("cu", OPS[name]["c"]) if backend == "cuda" else cpu_math(OPS[name]["c"])


TANH_FAST = ("// tanh(v) = 1 - 2 / (1 + e^(2v)) on the special function units (tanhf: ~20 instructions more)\n"
             "__device__ __forceinline__ float lib_fast_tanh(float v) { return 1.f - __fdividef(2.f, 1.f + __expf(2.f * v)); }\n\n")
# The reductions' math on the GPU, likewise: exp and log of the special function units, a reciprocal square root.
CUDA_MATH = [(r"\bexpf\(v - m\) / s$", "__fdividef(__expf(v - m), s)"), (r"\bexpf\(", "__expf("), (r"\blogf\(", "__logf("),
             (r" / sqrtf\(", " * rsqrtf(")]


def cuda_math(expr: str) -> str:
    for rx, to in CUDA_MATH:
        expr = re.sub(rx, to, expr)
    return expr


# The C++ library's math, likewise: libm's expf, logf, tanhf, erff are scalar calls and fminf / fmaxf keep a loop
# from vectorising (g++ -O3 -march=native without -ffast-math), so a chain written with them runs ~10x slower than
# eager's vectorised ops on the same core (bench/teacher_speed.py --backend cpu). In their place: exp and log from the
# float's bits and a polynomial (Cephes' coefficients, 1-2 ulp), tanh and erf made of exp, min and max as
# comparisons (NaN in, NaN out, as PyTorch's clamp), all branch-free, so that `#pragma omp simd` loops vectorise
# (with build.py's -fno-trapping-math on any x86-64: without it only AVX-512's masks vectorise their selects).
# log1p(e^v) and e^v - 1 lose relative precision in their tails (absolute error <= 1e-6: far inside atol = 1e-2).
CPU_FUNCTIONS = r"""#include <stdint.h>
#include <string.h>

// exp, log, tanh, erf, min, max without a libm call or a branch: a loop of them vectorises (1-2 ulp; erf 5e-7)
static inline float lib_min(float a, float b) { return b < a ? b : a; }
static inline float lib_max(float a, float b) { return a < b ? b : a; }
static inline float lib_expf(float v) {  // inf past 88.72, 0 below -103.9, as expf
  v = lib_min(lib_max(v, -104.f), 89.f);
  // n = round(v / ln2), as a float and in the bits of k: adding 1.5 * 2^23 rounds (floorf would not vectorise)
  float k = v * 1.44269504f + 12582912.f, n = k - 12582912.f, two_a, two_b;
  float r = v - n * 0.693359375f + n * 2.12194440e-4f;  // v = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts)
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  int32_t n_int, a, b;
  memcpy(&n_int, &k, 4);
  n_int -= 0x4b400000;
  a = ((n_int >> 1) + 127) << 23, b = (n_int - (n_int >> 1) + 127) << 23;  // 2^n in two normal factors (n: -150..128)
  memcpy(&two_a, &a, 4);
  memcpy(&two_b, &b, 4);
  return (p * r * r + r + 1.f) * two_a * two_b;
}
static inline float lib_logf(float v) {  // v > 0 (NaN in, NaN out; 0, inf and below 0 are not its values)
  int32_t i;
  memcpy(&i, &v, 4);
  int32_t big = (i & 0x007fffff) > 0x003504f3, j = 0x4b000000 | (((i >> 23) & 0xff) + big);
  float e, m;  // v = 2^e m, m in [sqrt(1/2), sqrt(2)); e made from the bits of 2^23 + e + 127, in integers as above
  memcpy(&e, &j, 4);
  e -= 8388608.f + 127.f;
  i = (i & 0x007fffff) | (0x3f800000 - (big << 23));
  memcpy(&m, &i, 4);
  float f = m - 1.f, z = f * f, p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f; p = p * f + 1.1676998740e-1f; p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f; p = p * f - 1.6668057665e-1f; p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f; p = p * f + 3.3333331174e-1f;
  float y = f * z * p - 0.5f * z + f + e * 0.693147182f;
  return v == v ? y : v;
}
static inline float lib_tanhf(float v) {  // a polynomial near 0, (1 - e^-2|v|) / (1 + e^-2|v|) beyond
  float z = v * v, t = lib_expf(-2.f * fabsf(v));
  float s = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z
             - 3.33332819422e-1f) * z * v + v;
  return fabsf(v) < 0.625f ? s : copysignf((1.f - t) / (1.f + t), v);
}
static inline float lib_erff(float v) {  // Abramowitz and Stegun 7.1.26
  float a = fabsf(v), t = 1.f / (1.f + 0.3275911f * a);
  float p = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t;
  return copysignf(1.f - p * lib_expf(-a * a), v);
}
static inline float lib_softplus(float v) { float s = lib_logf(1.f + lib_expf(v)); return v > 20.f ? v : s; }

"""
CPU_MATH = [(r"v > 20\.f \? v : log1pf\(expf\(v\)\)", "lib_softplus(v)"), (r"\bexpm1f\((\w+)\)", r"(lib_expf(\1) - 1.f)"),
            (r"\b(exp|log|tanh|erf)f\(", r"lib_\1f("), (r"\bfm(in|ax)f\(", r"lib_m\1(")]


def cpu_math(expr: str) -> str:
    for rx, to in CPU_MATH:
        expr = re.sub(rx, to, expr)
    return expr


def accurate_math(text: str) -> str:
    """The inverse: kernels/lib.cuh or a CUDA kernel with libm's functions and IEEE division in place of the special
    function units (bench/teacher_speed.py --accurate-math times both; a test checks that it inverts cuda_math)."""
    for n in LIBRARY:
        text = text.replace(f"{{ return {_math(n, 'cuda').format(a='a', b='b')}; }}",
                            f"{{ return {OPS[n]['c'].format(a='a', b='b')}; }}")
    text = text.replace("__fdividef(__expf(v - m), s)", "expf(v - m) / s").replace(" * rsqrtf(", " / sqrtf(")
    return text.replace("__expf(", "expf(").replace("__logf(", "logf(")


def _line(st: dict) -> str:
    """The C statement of one op: a call of the library, or the arithmetic inline (a parameter read as Model.forward
    reads it, self.w0[d]: kernel_source's Params)."""
    if st["op"] in LIBRARY:
        return f"op_{st['op']}(" + ", ".join(["v"] + [c_float(st[k]) for k in "ab" if k in st]) + ")"
    return _c(OPS[st["op"]]["c"], {**st, "p": f"self.{st['p']}"} if "p" in st else st)


def _fn(name: str, steps: list[dict], plist: str, qual: str) -> str:
    body = "".join(f"  // x = {torch_line(st)}\n  v = {_line(st)};\n" for st in steps)
    return f"{qual} float {name}(float v, int64_t d{plist}) {{\n{body}  return v;\n}}\n"


# Variants (name -> description). Which ones apply: VARIANTS_FOR[(backend, has reduction)].
VARIANTS = {
    "naive": "one thread per element",
    "grid_stride": "a grid-stride loop, a few blocks per SM",
    "vec4": "float4 loads and stores, grid-stride",
    "block_row": "one block per row, the library's op_R (warp shuffles + shared memory)",
    "warp_row": "one warp per row, the library's op_R_warp (warp shuffles only)",
    "two_kernels": "a statistics kernel (one block per row), then an elementwise kernel",
    "flat": "one OpenMP loop over all elements (index % cols for the feature)",
    "rows": "OpenMP over rows, a contiguous inner loop the compiler vectorises",
    "passes": "OpenMP over rows, the library's op_R: the chain recomputed in every pass over the row",
    "row_buffer": "OpenMP over rows, the chain computed once into a per-thread row buffer",
}
# The first variant of each kind is the teacher's first kernel (teacher.choose_plan), the template a student learns.
# On the CPU that is `rows`, not `flat`: flat's 64-bit `%` per element keeps g++ from vectorising the loop, and a
# chain with a per-feature parameter runs ~0.13x eager there, rows ~1x (bench/teacher_speed.py --backend cpu).
VARIANTS_FOR = {("cuda", False): ["naive", "grid_stride", "vec4"], ("cuda", True): ["block_row", "warp_row", "two_kernels"],
                ("cpu", False): ["rows", "flat"], ("cpu", True): ["passes", "row_buffer"]}
BLOCKS = [128, 256, 512]


def kernel_source(steps: list[dict], backend: str, variant: str = "", block: int = 256) -> str:
    """The kernel source (kernels/op.cu or kernels/op.cpp) of one variant; "" = the first that applies."""
    pre, red, post = split(steps)
    variant = variant or VARIANTS_FOR[(backend, red is not None)][0]
    if variant not in VARIANTS_FOR[(backend, red is not None)]:
        raise ValueError(f"variant {variant} does not apply here")
    # Model's parameters are one struct, declared once (its fields differ by task); every function's signature takes
    # `Params self` (plist) and passes it on (args), text that is the same for every task, and reads a parameter as
    # Model.forward does, self.w0[d]. A CUDA launch fills it where it launches a kernel (largs); the CPU's launch runs
    # the loops itself and fills one local self (local_self). With a pointer per parameter in every signature and call,
    # or a line per parameter to unpack it, the 135M student left one out or wrote the comment's `self.w0` into a
    # function that took none (docs/results.md).
    ps = params(steps)
    fill = "Params{" + ", ".join(f"params[{i}]" for i in range(len(ps))) + "}"
    plist, args = ", Params self", ", self"
    cuda = backend == "cuda"
    local_self = "" if cuda else f"  const Params self = {fill};\n"
    largs = f", {fill}"
    fields = "".join(f" const float* {p};" for p in ps)
    qual = "__device__ __forceinline__" if cuda else "static inline"
    chain = " -> ".join(st["op"] for st in steps)
    head = (f"// kernels/op.{'cu' if cuda else 'cpp'}: {chain}, fused into one pass. Variant {variant}"
            f"{f'/{block}' if cuda else ''}: {VARIANTS[variant]}.\n"
            + ('#include <cstdint>\n#include <cuda_runtime.h>\n#include "lib.cuh"\n\n' if cuda else
               '#include <cstdint>\n#include <vector>\n#include "lib.h"\n\n')
            + f"struct Params {{{fields} }};  // Model's parameters, in the order model_new.py passes them\n\n")
    launch_sig = ('extern "C" void launch(const float* x, float* y, const float* const* params, float* scratch, '
                  'int64_t rows, int64_t cols, void* stream) {\n')
    src = head + _fn("pre", pre, plist, qual) + (_fn("post", post, plist, qual) if red else "")
    if red is None:
        if variant == "naive":
            src += (f"\n__global__ void fused(const float* __restrict__ x, float* __restrict__ y{plist}, int64_t n, int64_t cols) {{\n"
                    "  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;\n"
                    f"  if (i < n) y[i] = pre(x[i], i % cols{args});\n}}\n\n" + launch_sig +
                    f"  int64_t n = rows * cols;\n  fused<<<(n + {block - 1}) / {block}, {block}, 0, (cudaStream_t)stream>>>(x, y{largs}, n, cols);\n}}\n")
        elif variant == "grid_stride":
            src += (f"\n__global__ void fused(const float* __restrict__ x, float* __restrict__ y{plist}, int64_t n, int64_t cols) {{\n"
                    + _stride(1) +
                    "  for (; i < n; i += stride) {\n"
                    f"    y[i] = pre(x[i], d{args});\n" + NEXT_D +
                    "  }\n}\n\n" + launch_sig + GRID.format(block=block, n="rows * cols") +
                    f"  fused<<<grid, {block}, 0, (cudaStream_t)stream>>>(x, y{largs}, rows * cols, cols);\n}}\n")
        elif variant == "vec4":  # cols % 4 == 0 (every DIM of the family): 4 consecutive values share one row
            src += (f"\n__global__ void fused(const float4* __restrict__ x, float4* __restrict__ y{plist}, int64_t n4, int64_t cols) {{\n"
                    + _stride(4) +
                    "  for (; i < n4; i += stride) {\n    float4 v = x[i];\n"
                    f"    v.x = pre(v.x, d{args});\n    v.y = pre(v.y, d + 1{args});\n"
                    f"    v.z = pre(v.z, d + 2{args});\n    v.w = pre(v.w, d + 3{args});\n    y[i] = v;\n" + NEXT_D +
                    "  }\n}\n\n" + launch_sig +
                    GRID.format(block=block, n="rows * cols / 4") +
                    f"  fused<<<grid, {block}, 0, (cudaStream_t)stream>>>((const float4*)x, (float4*)y{largs}, rows * cols / 4, cols);\n}}\n")
        elif variant == "flat":
            src += ("\n" + launch_sig + local_self + "  const int64_t n = rows * cols;\n  #pragma omp parallel for\n"
                    f"  for (int64_t i = 0; i < n; ++i) y[i] = pre(x[i], i % cols{args});\n}}\n")
        else:  # rows
            src += ("\n" + launch_sig + local_self + "  #pragma omp parallel for\n  for (int64_t r = 0; r < rows; ++r) {\n"
                    "    const float* xr = x + r * cols;\n    float* yr = y + r * cols;\n    #pragma omp simd\n"
                    f"    for (int64_t c = 0; c < cols; ++c) yr[c] = pre(xr[c], c{args});\n  }}\n}}\n")
        return src
    spec = REDUCTIONS[red["op"]]
    math = cuda_math if cuda else cpu_math
    stats = [(n, kind, math(term), math(fin)) for n, kind, term, fin in spec["stats"]]
    out = math(_c(spec.get("out") or spec["result"], {k: f"self.{red[k]}" for k in "go" if k in red}))
    keeps = "out" in spec
    note = f"x = {torch_line(red)}"  # the reduction's line of Model.forward: above its call, or its statistics
    # the library's row function (block_row, warp_row, passes): its name, the affine norm's weight and bias, then self
    # for pre and post
    call = (f"op_{red['op']}{'_warp' if variant == 'warp_row' else ''}<pre, post>(x, y, row, cols"
            + "".join(f", self.{red[k]}" for k in "go" if k in red) + f"{args});")
    if cuda:
        return src + _cuda_rows(variant, block, stats, out, keeps, plist, args, largs, launch_sig, note, call)
    return src + _cpu_rows(variant, stats, out, keeps, args, local_self, launch_sig, note, call)


# Grid-stride loops carry the feature index d (the column of element i) from one step to the next: a 64-bit `%` per
# element is a software division on a GPU, tens of instructions for one element of a memory-bound loop. (Unused
# when the chain has no per-feature parameter: the compiler drops it.) per: elements per index (4 for float4).
def _stride(per: int) -> str:
    times = "" if per == 1 else f" * {per}"
    return ("  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;\n"
            f"  int64_t d = i{times} % cols, step = stride{times} % cols;  // the column of element i, and its step\n")


NEXT_D = "    d += step;\n    if (d >= cols) d -= cols;\n"
GRID = ("  int64_t blocks = ({n} + {block} - 1) / {block};\n"
        "  int grid = (int)(blocks < 132 * 8 ? blocks : 132 * 8);  // a few waves of blocks over the SMs\n")
# The CUDA header's second half: reductions across the threads of a warp (shuffles) or of a block (shuffles, then one
# value per warp through shared memory); every thread gets the result.
REDUCE_FUNCTIONS = """
// sums and maxima across a warp or a block; every thread gets the result
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// blockDim.x: a multiple of 32
__device__ float block_sum(float v) {
  __shared__ float part[32];
  v = warp_sum(v);
  __syncthreads();  // part[] may still be read by the previous call
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  return warp_sum((threadIdx.x & 31) < (blockDim.x >> 5) ? part[threadIdx.x & 31] : 0.f);
}
__device__ float block_max(float v) {
  __shared__ float part[32];
  v = warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  return warp_max((threadIdx.x & 31) < (blockDim.x >> 5) ? part[threadIdx.x & 31] : -INFINITY);
}
"""
INIT = {"sum": "0.f", "max": "-INFINITY"}
ACC = {"sum": "{n} += {e};", "max": "{n} = fmaxf({n}, {e});"}


def _stat_code(stats, loop: str, load: str, reduce: str, args: str, ind: str, note: str, simd: bool = False) -> str:
    """Each statistic in turn: accumulate over the row, reduce across threads (reduce: "block"/"warp"/""), finalise.
    note: a comment line above them (the reduction's line of Model.forward). simd (C++): each loop a vectorised
    reduction (without the pragma a sum may not be reordered, so it stays one value at a time)."""
    code = f"{ind}// {note}: its statistics over the row\n"
    for name, kind, term, fin in stats:
        acc = ACC[kind].format(n=name, e=term)
        pragma = f"{ind}#pragma omp simd reduction({'+' if kind == 'sum' else 'max'}:{name})\n" if simd else ""
        code += (f"{ind}float {name} = {INIT[kind]};\n{pragma}{ind}{loop} {{\n{ind}  float v = pre({load}, c{args});\n"
                 f"{ind}  {cpu_math(acc) if simd else acc}\n{ind}}}\n")
        if reduce:
            code += f"{ind}{name} = {reduce}_{kind}({name});\n"
        if fin != name:
            code += f"{ind}{name} = {fin};\n"
    return code


# The library's row reductions: the statistics of every reduction written once, in the header, so that a kernel
# calls one by name as it calls op_gelu (a small student copies a name; it does not recall 8-12 lines of statistics
# per reduction: docs/curriculum.md). pre and post, the kernel's chain before and after the reduction, are template
# arguments: direct calls, inlined (no call is left in the PTX; every C++ row loop vectorises).
ROW_NOTE = """
// Row reductions: op_R<pre, post>(x, y, row, cols, self) computes PyTorch's R over the last dimension of row `row` of
// x (cols values), each value read as pre(x[...], c, self) (the chain before R) and each output written as
// post(value, c, self) (the chain after it) to y[row * cols + c], or to y[row] where R removes the last dimension;
// self: the kernel's Params. An affine norm takes its weight g (and bias o) first: op_layer_norm_affine<pre, post>(x,
// y, row, cols, self.g, self.o, self).
"""
ROW_WHO = {"cuda": "// Every thread of a block calls op_R (a block per row); every lane of one warp, op_R_warp (a warp per row).\n",
           "cpu": "// One thread calls it for a row; its loops are vectorised (omp simd).\n"}


def _row_function(name: str, backend: str, warp: bool = False) -> str:
    """op_<name> (op_<name>_warp) of the header: one row of the reduction; CUDA: every thread of the block (of one
    warp) calls it; C++: one thread, its loops vectorised."""
    spec, cuda = REDUCTIONS[name], backend == "cuda"
    math = cuda_math if cuda else cpu_math
    stats = [(n, kind, math(term), math(fin)) for n, kind, term, fin in spec["stats"]]
    affine = "".join(f", const float* __restrict__ {k}" for k in "go" if f"{{{k}}}" in spec["torch"])
    out = math(_c(spec.get("out") or spec["result"], {"g": "g", "o": "o"}))
    # which columns of the row this thread takes (from `first`), how its partial statistics are combined (reduce)
    if cuda:
        first, step, reduce = ("lane", "32", "warp") if warp else ("threadIdx.x", "blockDim.x", "block")
        loop, simd = f"for (int64_t c = {first}; c < cols; c += {step})", ""
    else:
        loop, reduce, simd = "for (int64_t c = 0; c < cols; ++c)", "", "  #pragma omp simd\n"
    body = ("  int lane = threadIdx.x & 31;\n" if warp else "") + "  const float* xr = x + row * cols;\n"
    body += _stat_code(stats, loop, "xr[c]", reduce, ", p...", "  ", f"x = {torch_line({'op': name, 'g': 'g', 'o': 'o'})}",
                       simd=not cuda)
    if "out" in spec:
        body += (f"{simd}  {loop} {{\n    float v = pre(xr[c], c, p...);\n    v = {out};\n"
                 "    y[row * cols + c] = post(v, c, p...);\n  }\n")
    else:  # (on CUDA every thread holds the result: one writes it)
        body += f"  {f'if ({first} == 0) ' if cuda else ''}y[row] = post({out}, 0, p...);\n"
    qual = "__device__ __forceinline__" if cuda else "static inline"
    return (f"template <auto pre, auto post, class... P>\n{qual} void op_{name}{'_warp' if warp else ''}(const float* "
            f"__restrict__ x, float* __restrict__ y, int64_t row, int64_t cols{affine}, P... p) {{\n{body}}}\n")


def _cuda_rows(variant, block, stats, out, keeps, plist, args, largs, launch_sig, note, call) -> str:
    if variant in ("block_row", "warp_row"):
        warp = variant == "warp_row"
        body = ("  int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;\n"
                "  if (row >= rows) return;  // the whole warp leaves: no shuffle is missing a lane\n") if warp else \
            "  int64_t row = blockIdx.x;\n"
        body += f"  // {note}\n  {call}\n"
        grid = f"(rows + {block // 32 - 1}) / {block // 32}" if warp else "rows"
        return (f"\n__global__ void fused_rows(const float* __restrict__ x, float* __restrict__ y{plist}, "
                f"int64_t rows, int64_t cols) {{\n{body}}}\n\n" + launch_sig +
                f"  fused_rows<<<{grid}, {block}, 0, (cudaStream_t)stream>>>(x, y{largs}, rows, cols);\n}}\n")
    # two kernels: statistics per row into scratch, then every element (or row) on its own
    names, ns = [s[0] for s in stats], len(stats)
    result = (f"    // {note}\n    float v = {out};\n    y[row] = post(v, 0{args});\n")
    body = "  int64_t row = blockIdx.x;\n  const float* xr = x + row * cols;\n" + _stat_code(
        stats, "for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)", "xr[c]", "block", args, "  ", note)
    body += "  if (threadIdx.x == 0) {\n" + "".join(f"    stats[row * {ns} + {i}] = {n};\n" for i, n in enumerate(names)) + "  }\n"
    load = "".join(f"    float {n} = stats[row * {ns} + {i}];\n" for i, n in enumerate(names))
    if keeps:
        second = (f"__global__ void apply(const float* __restrict__ x, float* __restrict__ y, const float* __restrict__ stats{plist}, "
                  "int64_t n, int64_t cols) {\n"
                  + _stride(1) + "  int64_t row = i / cols, rows_step = stride / cols;  // the row of element i, and its step\n"
                  "  for (; i < n; i += stride) {\n    const int64_t c = d;  // (the formulas' name for the column)\n" + load +
                  f"    float v = pre(x[i], c{args});\n    // {note}\n    v = {out};\n    y[i] = post(v, c{args});\n"
                  "    d += step;\n    row += rows_step;\n    if (d >= cols) {\n      d -= cols;\n      ++row;\n    }\n  }\n}\n")
        n = "rows * cols"
    else:
        second = (f"__global__ void apply(const float* __restrict__ x, float* __restrict__ y, const float* __restrict__ stats{plist}, "
                  "int64_t n, int64_t cols) {\n"
                  "  for (int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; row < n; row += (int64_t)gridDim.x * blockDim.x) {\n"
                  + load + result + "  }\n}\n")
        n = "rows"
    return (f"\n__global__ void row_stats(const float* __restrict__ x, float* __restrict__ stats{plist}, "
            f"int64_t rows, int64_t cols) {{\n{body}}}\n\n{second}\n" + launch_sig +
            f"  row_stats<<<rows, {block}, 0, (cudaStream_t)stream>>>(x, scratch{largs}, rows, cols);\n" +
            GRID.format(block=block, n=n) +
            f"  apply<<<grid, {block}, 0, (cudaStream_t)stream>>>(x, y, scratch{largs}, {n}, cols);\n}}\n")


def _cpu_rows(variant, stats, out, keeps, args, local_self, launch_sig, note, call) -> str:
    if variant == "passes":  # the library's row function: a pass over the row per statistic, the chain recomputed
        return ("\n" + launch_sig + local_self + "  #pragma omp parallel for\n  for (int64_t row = 0; row < rows; ++row) {\n"
                f"    // {note}\n    {call}\n  }}\n}}\n")
    # row_buffer, written out: the chain before the reduction runs once per element into a row buffer, then a pass
    # over the buffer per statistic
    ind, loop, simd = "      ", "for (int64_t c = 0; c < cols; ++c)", "      #pragma omp simd\n"
    body = (f"{ind}const float* xr = x + row * cols;\n{simd}{ind}{loop} buf[c] = pre(xr[c], c{args});\n"
            + _stat_code(stats, loop, "xr[c]", "", args, ind, note, simd=True).replace(f"pre(xr[c], c{args})", "buf[c]"))
    if keeps:
        body += (f"{simd}{ind}{loop} {{\n{ind}  float v = buf[c];\n{ind}  // {note}\n{ind}  v = {out};\n"
                 f"{ind}  y[row * cols + c] = post(v, c{args});\n{ind}}}\n")
    else:
        body += f"{ind}{{\n{ind}  // {note}\n{ind}  float v = {out};\n{ind}  y[row] = post(v, 0{args});\n{ind}}}\n"
    return ("\n" + launch_sig + local_self + "  #pragma omp parallel\n  {\n    std::vector<float> buf(cols);  // one per thread\n"
            "    #pragma omp for\n    for (int64_t row = 0; row < rows; ++row) {\n" + body + "    }\n  }\n}\n")


def task_hash(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()[:12]
