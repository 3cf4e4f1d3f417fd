"""compose.py: candidate tasks of the paper's family for synth.py, and the checks on their code that need no run.

A candidate chains 1..5 seed operators (ops.py) *sequentially*, as CUDA-Agent-Ops-6K does: the number of ops
follows the paper's mix (PAPER_MIX), each op is picked among the seeds that accept the current shape, shapes
propagate on meta tensors (ops.meta_run), and BATCH doubles until a roofline estimate of eager time reaches the
window (ops.grow_batch, shared with elementwise.py's family). The result is a self-contained KernelBench-format
module. Deterministic in (seed, index).

    seeds = ops.mine_seeds()
    c = compose_one(7, seeds, seed=0, backend="cuda", window_ms=(1.0, 100.0))   # {"ops", "code", "shape", ...}
    structure_key(c["code"])                    # the same for the same ops at any sizes (duplicates)
    most_similar(c["code"], load_kernelbench("KernelBench/KernelBench"), 0.9)   # (ratio, file) above 0.9, else (0.0, "")
"""
from __future__ import annotations

import ast
import difflib
import hashlib
import math
import random
from pathlib import Path

import datasets

import env
from ops import MEM_CAP, build_op, grow_batch, meta_run
from scan import parse_python
from tasks import KERNELBENCH_HUB

PAPER_MIX = {"torch#1": 3.4, "torch#2": 84.0, "torch#3": 7.6, "torch#4": 2.8, "torch#5": 1.2, "transformers": 1.2}
DIM_NAMES = {2: ["BATCH", "DIM"], 3: ["BATCH", "SEQ_LEN", "DIM"], 4: ["BATCH", "CHANNELS", "HEIGHT", "WIDTH"],
             5: ["BATCH", "CHANNELS", "DEPTH", "HEIGHT", "WIDTH"]}
# Base input shapes (BATCH = 1 here; compose_one grows BATCH): rank -> choices for the other dims.
BASE_DIMS = {2: [[256, 512, 1024, 2048, 4096]], 3: [[32, 64, 128, 256], [64, 128, 256, 512]],
             4: [[3, 8, 16, 32, 64], [16, 32, 64, 128]], 5: [[3, 8, 16], [8, 16], [16, 32]]}
RANK_WEIGHTS = {2: 0.35, 3: 0.2, 4: 0.35, 5: 0.1}


# ----------------------------------------------------------------------------------------------
# Compose
# ----------------------------------------------------------------------------------------------
def render(steps: list[dict], seeds_by_name: dict, shape: tuple) -> str:
    """The KernelBench-format module for a chain of steps and an input shape."""
    names = DIM_NAMES[len(shape)]
    imports = ["import torch", "import torch.nn as nn"]
    if any(st["expr"].startswith("F.") for st in steps):
        imports.append("import torch.nn.functional as F")
    for st in steps:
        for imp in seeds_by_name[st["name"]].get("imports", []):
            if imp not in imports:
                imports.append(imp)
    init, fwd = [], []
    for i, st in enumerate(steps):
        if seeds_by_name[st["name"]]["kind"] == "module":
            init.append(f"        self.op{i} = {st['expr']}")
            fwd.append(f"        x = self.op{i}(x)")
        else:
            fwd.append(f"        x = {st['expr']}")
    consts = "\n".join(f"{n} = {v}" for n, v in zip(names, shape))
    return (f"{chr(10).join(imports)}\n\n{consts}\n\n\n"
            f"class Model(nn.Module):\n"
            f"    \"\"\"{' -> '.join(st['name'] for st in steps)}\"\"\"\n\n"
            f"    def __init__(self):\n        super().__init__()\n" + "".join(line + "\n" for line in init) +
            f"\n    def forward(self, x):\n" + "".join(line + "\n" for line in fwd) + "        return x\n\n\n"
            f"def get_inputs():\n    return [torch.randn({', '.join(names)})]\n\n\n"
            f"def get_init_inputs():\n    return []\n")


def compose_one(index: int, seeds: list[dict], seed: int = 0, backend: str = "cpu", window_ms=(0.1, 10.0),
                max_ops: int = 5, mem_cap: float | None = None) -> dict:
    """Candidate number `index` of the stream (deterministic in (seed, index)): {"index", "ops", "data_source",
    "code", "shape", "est_ms"} or {"drop": reason}. mem_cap: bytes one task may touch (None: MEM_CAP)."""
    seeds_by_name = {s["name"]: s for s in seeds}
    rng = random.Random(f"{seed}-{index}")
    mix = {k: v for k, v in PAPER_MIX.items() if k == "transformers" or int(k.split("#")[1]) <= max_ops}
    source = rng.choices(list(mix), weights=list(mix.values()))[0]
    if source == "transformers":
        n_ops = rng.choices(range(1, max_ops + 1), weights=[PAPER_MIX[f"torch#{k}"] for k in range(1, max_ops + 1)])[0]
    else:
        n_ops = int(source.split("#")[1])
    rank = rng.choices(list(RANK_WEIGHTS), weights=list(RANK_WEIGHTS.values()))[0]
    shape = (1,) + tuple(rng.choice(c) for c in BASE_DIMS[rank])
    torch_seeds = [s for s in seeds if s["source"] != "transformers"]
    hf_seeds = [s for s in seeds if s["source"] == "transformers"]
    steps, cur = [], shape
    for i in range(n_ops):
        pool = hf_seeds if (source == "transformers" and i == 0) else torch_seeds
        for _ in range(30):  # a few tries to find an op that accepts the current shape
            op = rng.choice(pool)  # (a seed operator; `seed` is the random seed)
            if len(cur) not in op["ranks"]:
                continue
            try:
                expr = build_op(op, cur, rng)
                out, _, _ = meta_run(seeds_by_name, [{"name": op["name"], "expr": expr}], cur)
            except Exception:  # noqa: BLE001 - does not fit this shape: try another seed
                continue
            if len(out) < 2 and i < n_ops - 1:
                continue  # a scalar (or 1-d) output ends a chain; only allowed last
            if math.prod(out) < 1:
                continue
            steps.append({"name": op["name"], "expr": expr})
            cur = out
            break
        else:
            return {"drop": "no seed fits the intermediate shape"}
    # Size the task: double BATCH while the roofline estimate stays under the target and the memory cap
    # (an estimate that raises: a batch size changes a shape the chain depends on)
    best = grow_batch(lambda sh: meta_run(seeds_by_name, steps, sh, backend)[1:], shape, window_ms,
                      mem_cap or MEM_CAP[backend], max_doublings=20)
    if best is None:
        return {"drop": "too large even at BATCH=1 (memory cap or estimated time)"}
    shape, est = best
    ops = [st["name"] for st in steps]
    ds = "transformers" if any(o.startswith("transformers.") for o in ops) else f"torch#{len(ops)}"
    return {"index": index, "ops": ops, "data_source": ds, "code": render(steps, seeds_by_name, shape),
            "shape": list(shape), "est_ms": est}


# ----------------------------------------------------------------------------------------------
# Checks on the code alone: duplicates, similarity to KernelBench
# ----------------------------------------------------------------------------------------------
def structure_key(code: str) -> str:
    """Duplicate key: the AST with every numeric literal replaced by 0 (same ops, any sizes)."""
    tree = parse_python(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            node.value = 0
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def ast_tokens(code: str) -> list[str]:
    """Python-AST token sequence used for similarity: node types plus attribute/function names
    (literal values and local variable names ignored, so renaming or resizing does not hide a copy)."""
    toks = []
    for node in ast.walk(parse_python(code)):
        toks.append(type(node).__name__)
        if isinstance(node, ast.Attribute):
            toks.append(node.attr)
        elif isinstance(node, ast.Name) and node.id in ("torch", "nn", "F", "Model", "super"):
            toks.append(node.id)
    return toks


def load_kernelbench(path: str | None) -> list[tuple[str, list[str]]]:
    """[(name, tokens)] for every KernelBench-format .py under `path` ("hub": the public dataset)."""
    if not path:
        return []
    if path == "hub":
        try:
            ds = datasets.load_dataset(KERNELBENCH_HUB)
        except Exception as e:  # noqa: BLE001
            raise env.UsageError(f"cannot load the KernelBench dataset from the hub (offline?): {type(e).__name__}")
        files = [(f"{split}/{r['name']}", r["code"]) for split in ds for r in ds[split]]
    else:
        p = Path(path)
        if not p.is_dir():
            raise env.UsageError(f"--kernelbench-dir {path} is not a directory")
        files = [(str(f.relative_to(p)), f.read_text(errors="replace")) for f in sorted(p.rglob("*.py"))]
    out = []
    for name, code in files:
        try:
            out.append((name, ast_tokens(code)))
        except SyntaxError:
            continue
    if not out:
        raise env.UsageError(f"--kernelbench-dir {path} holds no parseable .py files")
    return out


def most_similar(code: str, kb: list[tuple[str, list[str]]], floor: float = 0.0) -> tuple[float, str]:
    """Highest difflib ratio of AST token sequences above `floor`, else (0.0, ""). Pairs whose upper bounds
    (real_quick_ratio: the lengths; quick_ratio: the token counts) cannot beat it are skipped: with the
    filter's floor of 0.9, ratio() (quadratic) runs on a few pairs instead of every KernelBench file."""
    toks, best = ast_tokens(code), (floor, "")
    for name, other in kb:
        sm = difflib.SequenceMatcher(None, toks, other, autojunk=False)
        if sm.real_quick_ratio() > best[0] and sm.quick_ratio() > best[0]:
            r = sm.ratio()
            if r > best[0]:
                best = (r, name)
    return best if best[1] else (0.0, "")
