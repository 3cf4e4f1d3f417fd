"""evaluate.py: KernelBench-style evaluation of policies and of ready-made kernels, in env.py's hardened harness.

Tiny runs (CPU; the fixture bench of the tests: 3 problems, honest / wrong / cheating solutions; ~1-2 min each):
    python evaluate.py --solutions tests/fixtures_bench/solutions --bench-dir tests/fixtures_bench/bench --backend cpu --out runs/eval_fix
    python evaluate.py --solutions tests/fixtures_bench/solutions_bad --bench-dir tests/fixtures_bench/bench --backend cpu --out runs/eval_fix_bad
    python evaluate.py --bench-dir tests/fixtures_bench/bench --levels 2 --reference-only --backend cpu --out runs/ref_fix
    python evaluate.py --compare runs/eval_fix/results.json runs/eval_fix_bad/results.json
    python evaluate.py --bench-dir tests/fixtures_bench/bench --levels 2 --mode agent --max-turns 4 --backend cpu --out runs/eval_agent
Real runs (GPU; KernelBench from the hub when online, else a local copy with level1/ level2/ level3/ folders;
one scoring process per visible GPU, so an 8-GPU node scores 8 tasks at a time):
    python evaluate.py --bench kernelbench --levels 1,2,3 --policy hf --model runs/default/ppo --mode agent --out runs/eval_kb
    python evaluate.py --bench kernelbench --bench-dir KernelBench/KernelBench --policy openai --base-url http://localhost:8000/v1 --model M --mode single --out runs/eval_single
    python evaluate.py --bench synth --dataset data/ops6k --split test --policy hf --model runs/default/ppo --out runs/eval_synth
    python evaluate.py --solutions other_system/ --bench-dir KernelBench/KernelBench --backend cuda --out runs/eval_other
    python evaluate.py --bench-dir KernelBench/KernelBench --reference-only --backend cuda --out runs/ref_kb
    python evaluate.py --compare runs/eval_kb/results.json runs/eval_other/results.json

Modes (one per run; the output folder remembers it and a re-run resumes, skipping finished tasks)
  agent        the ReAct agent of agent.py solves each task in a workspace (up to --max-turns turns);
  single       one model answer per task, parsed into files and scored (the paper's "no agent loop");
  solutions    ready-made kernels from SOL_DIR, one per problem `N_Name.py`, either
                 SOL_DIR/N_Name/     a workspace in our layout (model_new.py + kernels/*.cpp|*.cu), or
                 SOL_DIR/N_Name.py   a KernelBench single-file ModelNew that builds with load_inline
                                     (CPU backend: cpp_sources only), converted by `convert_load_inline`;
               (SOL_DIR/levelK/... works too). A problem without a solution counts as a failure.
  reference    --reference-only: eager vs torch.compile per task, no candidate at all.

Every candidate is scored by env.evaluate (5 checks on fresh inputs, dispatch monitor, timing of candidate,
eager and torch.compile by the same function, the paper's 5% margin), so numbers from any system are
comparable. A crash, timeout, conversion failure or missing solution fails that task, never the run.
Outputs in --out: results.json (overall + per level), tasks.jsonl (one line per task: verdict, trajectory
path, final kernel files), run.json (the settings, for resuming), rates.png (when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch
from tqdm import tqdm

import agent
import elementwise
import env
from reward import beats, summarize
from scan import parse_python
from tasks import KERNELBENCH_HUB, load_bench_dir, load_hub, load_split, parse_levels

EVAL_PY = Path(__file__).resolve()

# The paper's CUDA Agent row on KernelBench (arXiv 2602.24286): rates, geomean speedup vs torch.compile.
PAPER = {
    "overall": {"pass_rate": 0.988, "faster_eager_rate": 0.984, "faster_compile_rate": 0.968, "geomean_speedup_compile": 2.11},
    "1": {"pass_rate": 1.00, "faster_eager_rate": 0.99, "faster_compile_rate": 0.97, "geomean_speedup_compile": 1.87},
    "2": {"pass_rate": 1.00, "faster_eager_rate": 1.00, "faster_compile_rate": 1.00, "geomean_speedup_compile": 2.80},
    "3": {"pass_rate": 0.94, "faster_eager_rate": 0.94, "faster_compile_rate": 0.90, "geomean_speedup_compile": 1.52},
}
# How often torch.compile beats eager on KernelBench, as reported on an H100, for --reference-only.
H100_COMPILE_WINS = {"1": "35-43%", "2": "81-84%", "3": "64-70%"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="KernelBench-style evaluation in env.py's harness",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    g = p.add_argument_group("what to evaluate on")
    g.add_argument("--bench", default="kernelbench", choices=["kernelbench", "synth"])
    g.add_argument("--bench-dir", help="folder of KernelBench-format problems N_Name.py (level subfolders level1/...)")
    g.add_argument("--levels", help="comma-separated levels, e.g. 1,2,3 (default: all found; a flat --bench-dir is one level)")
    g.add_argument("--dataset", help="--bench synth: a synth.py output folder or hub id")
    g.add_argument("--split", default="test")
    g.add_argument("--limit", type=int, help="only the first N tasks (smoke runs)")
    g = p.add_argument_group("who solves the tasks")
    g.add_argument("--solutions", metavar="SOL_DIR", help="score ready-made kernels instead of a policy")
    g.add_argument("--reference-only", action="store_true", help="time eager vs torch.compile per task; no candidate")
    g.add_argument("--policy", default="hf", help="agent.load_policy kind: hf (local model) | openai (any compatible server)")
    g.add_argument("--model", help="hf: model folder, hub id, .gguf, or a LoRA adapter folder (train.py's RUN/STAGE, e.g. runs/x/ppo, merged into its base); openai: model name (default: agent.py's embedded model)")
    g.add_argument("--base-url", help="OpenAI-compatible endpoint for --policy openai")
    g.add_argument("--mode", default="agent", choices=["agent", "single"])
    g.add_argument("--max-turns", type=int, default=200, help="agent turns per task (the paper evaluates with <= 200)")
    g.add_argument("--batch", type=int, default=8, help="tasks generated together (results are saved after each batch)")
    g.add_argument("--max-new-tokens", type=int, help="tokens per model turn (default: agent.py's 1024; single mode 2048)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy, for evaluation)")
    g = p.add_argument_group("how")
    g.add_argument("--backend", default="auto", help="auto | cuda | cpu")
    g.add_argument("--workers", type=int, help="parallel scoring processes (default: one per visible GPU; 1 on CPU)")
    g.add_argument("--timeout", type=float, default=env.Config.timeout, help="seconds per candidate run")
    g.add_argument("--compile-timeout", type=float, default=env.Config.compile_timeout, help="seconds per build")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="runs/eval", help="output folder (re-running with the same folder resumes)")
    g.add_argument("--json", action="store_true", help="the last stdout line is the overall result as JSON")
    g.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two results.json side by side")
    return p.parse_args(argv)


def summarize_reference(rows) -> dict:
    """--reference-only metrics: how often torch.compile beats eager, over the tasks that ran."""
    ran = [r for r in rows if r.get("eager_ms") and r.get("compile_ms")]
    ratios = [r["eager_ms"] / r["compile_ms"] for r in ran]
    return {
        "n": len(rows),
        "n_ran": len(ran),
        "compile_faster_rate": sum(x > 1.0 for x in ratios) / len(ran) if ran else None,
        "compile_faster_margin_rate": sum(beats(r["compile_ms"], r["eager_ms"]) for r in ran) / len(ran) if ran else None,
        "geomean_compile_speedup": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
        "median_eager_ms": sorted(r["eager_ms"] for r in ran)[len(ran) // 2] if ran else None,
        "task_s": sum(r.get("seconds") or 0.0 for r in rows),
    }


def by_level(rows, fn) -> dict:
    levels = sorted({str(r["level"]) for r in rows}, key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0, s))
    return {"overall": fn(rows), "levels": {lv: fn([r for r in rows if str(r["level"]) == lv]) for lv in levels}}


DEFINITIONS = """\
pass      correct / ALL tasks: 5 checks on fresh random inputs (atol = rtol = 1e-2), every timed run re-checked, no
          violation (PyTorch compute ops in ModelNew.forward, banned imports...). Crashes, timeouts, conversion
          failures and missing solutions count as failures.
>eager    share of ALL tasks that are correct AND more than 5% faster than eager PyTorch: (t_eager - t) / t_eager > 0.05,
>compile  ... and than torch.compile (default mode). The 5% is the reward's margin (reward.MARGIN); the paper's rates.
fast_1    KernelBench's fast_1: share of ALL tasks that are correct and faster than eager at all (speedup > 1).
geo       geometric mean of t_baseline / t_kernel over CORRECT tasks only (eager, torch.compile baselines).
turns     mean agent turns per task; tokens: mean trajectory length in tokens (prompt + generated), agent modes only.
time      summed seconds spent per task (scoring and, in agent modes, generation); wall: the run's wall clock."""

REF_DEFINITIONS = """\
compile>eager   share of the tasks that ran where torch.compile's median time is below eager's (any margin);
  >5%           ... where it is more than 5% faster (the reward's margin); geo: geometric mean of t_eager / t_compile.
Timing: env.time_callable (warm-up, median of >= 20 runs, fresh inputs copied into the same buffers, L2 flushed,
device synchronised), one timed section per device at a time."""


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def times(x):
    return "-" if x is None else f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def num(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def table(results: dict) -> str:
    """A markdown table of overall and per-level metrics."""
    groups = [("overall", results["overall"])] + [(f"level {k}" if k.isdigit() else k, v) for k, v in results["levels"].items()]
    if results.get("mode") == "reference":
        head = "| set | n | ran | compile>eager | >5% | geo eager/compile | median eager | time |\n|---|---|---|---|---|---|---|---|"
        lines = [f"| {name} | {m['n']} | {m['n_ran']} | {pct(m['compile_faster_rate'])} | {pct(m['compile_faster_margin_rate'])} | "
                 f"{times(m['geomean_compile_speedup'])} | {num(m['median_eager_ms'], '{:.3g} ms')} | {m['task_s']:.0f}s |"
                 for name, m in groups]
        return "\n".join([head, *lines])
    head = ("| set | n | pass | >eager | >compile | fast_1 | geo vs eager | geo vs compile | turns | tokens | time |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {name} | {m['n']} | {pct(m['pass_rate'])} | {pct(m['faster_eager_rate'])} | {pct(m['faster_compile_rate'])} | "
             f"{pct(m['fast_1'])} | {times(m['geomean_speedup_eager'])} | {times(m['geomean_speedup_compile'])} | "
             f"{num(m['mean_turns'])} | {num(m['mean_tokens'], '{:.0f}')} | {m['task_s']:.0f}s |" for name, m in groups]
    return "\n".join([head, *lines])


# ----------------------------------------------------------------------------------------------
# Tasks: KernelBench folders, the KernelBench hub dataset, or our synthetic split
# ----------------------------------------------------------------------------------------------
def load_tasks(a) -> list[dict]:
    levels = parse_levels(a.levels)
    if a.bench == "synth":
        if not a.dataset:
            raise env.UsageError("--bench synth needs --dataset PATH (a synth.py output folder or hub id)")
        tasks = load_split(a.dataset, a.split)
        if not tasks:
            raise env.UsageError(f"{a.dataset} has no tasks in split {a.split!r}")
    elif a.bench_dir:
        tasks = load_bench_dir(a.bench_dir, levels)
    else:
        tasks = load_hub(levels)
    return tasks[:a.limit] if a.limit else tasks


# ----------------------------------------------------------------------------------------------
# Ready-made solutions: find them, convert KernelBench single files into workspaces
# ----------------------------------------------------------------------------------------------
def find_solutions(sol_dir: str, tasks: list[dict], known_names: set) -> dict:
    """{task_id: Path} for SOL_DIR/[levelK/]N_Name.py or SOL_DIR/[levelK/]N_Name/. Errors on an empty set or on
    solutions that match no problem of the bench (a naming mistake would otherwise silently score 0)."""
    root = Path(sol_dir)
    if not root.is_dir():
        raise env.UsageError(f"no such solutions directory: {sol_dir}")
    entries = {}
    for d in [root] + [d for d in root.iterdir() if d.is_dir() and re.fullmatch(r"level_?\d+", d.name)]:
        for f in d.iterdir():
            if re.match(r"^\d+_", f.name) and (f.is_dir() or f.suffix == ".py"):
                key = f.name.removesuffix(".py")
                entries[(d.name if d != root else "", key)] = f
    if not entries:
        raise env.UsageError(f"no solutions in {sol_dir} (expected N_Name.py single files or N_Name/ workspaces)")
    unknown = sorted({k for _, k in entries} - known_names)
    if unknown:
        raise env.UsageError(f"{len(unknown)} solution(s) in {sol_dir} match no problem of the bench: "
                             f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}")
    out = {}
    for t in tasks:
        lvl_dirs = [f"level{t['level']}", f"level_{t['level']}"]
        hit = next((entries[(ld, t["name"])] for ld in lvl_dirs if (ld, t["name"]) in entries), None)
        out[t["task_id"]] = hit or entries.get(("", t["name"]))
    return out


class ConversionError(Exception):
    pass


def convert_load_inline(code: str, backend: str) -> tuple[str, dict, list]:
    """A KernelBench single-file solution -> (model_new.py text, {"kernels/X.cpp": source, ...}, notes).

    Supported: load_inline(name=..., cpp_sources=..., cuda_sources=..., functions=...) calls anywhere in the file
    (module level or inside __init__), whose arguments are string literals, module-level names bound to them,
    `+` concatenations or lists of those. Each call's sources become kernels/<name>.cpp and kernels/<name>_cuda.cu
    exactly as load_inline lays them out (it prepends <torch/extension.h> to the C++, which we skip when the
    source already includes it, and the CUDA runtime headers to the CUDA); `functions=` becomes pybind
    registrations in one generated PYBIND11_MODULE; every load_inline(...) expression becomes the one module
    `cuda_extension`, so `self.op = my_ext` / `my_ext.fn(x)` keep working.
    Not supported (the task fails with this message): sources computed at run time (f-strings, file reads),
    torch.utils.cpp_extension.load() of files, two hand-written PYBIND11_MODULEs. Extra compiler flags and
    libraries are ignored (env.py builds with fixed flags; cuBLAS/cuDNN are not linked)."""
    try:
        tree = parse_python(code)
    except SyntaxError as e:
        raise ConversionError(f"syntax error line {e.lineno}: {e.msg}")
    consts = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    used_consts: set = set()

    def const(node, depth=0):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, type(None))):
            return node.value
        if isinstance(node, ast.Name) and node.id in consts and depth < 20:
            used_consts.add(node.id)
            return const(consts[node.id], depth + 1)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [const(e, depth + 1) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {const(k, depth + 1): const(v, depth + 1) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            a, b = const(node.left, depth + 1), const(node.right, depth + 1)
            if type(a) is type(b) and isinstance(a, (str, list)):
                return a + b
        raise ConversionError(f"line {getattr(node, 'lineno', '?')}: cannot read `{ast.unparse(node)[:60]}` without "
                              "running the file (only literals, module-level names and + are supported)")

    def is_load_inline(node):
        return isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "load_inline"

    calls = [n for n in ast.walk(tree) if is_load_inline(n)]
    if not calls:
        if any(isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "load" for n in ast.walk(tree)):
            raise ConversionError("uses cpp_extension.load() of files on disk; only load_inline sources can be converted")
        raise ConversionError("no load_inline(...) call: a single-file solution must build its kernels with load_inline")
    files, notes, registers, modules = {}, [], [], []
    positional = ["name", "cpp_sources", "cuda_sources"]
    for i, call in enumerate(sorted(calls, key=lambda c: (c.lineno, c.col_offset))):
        kw = {positional[j]: a for j, a in enumerate(call.args[:3])}
        kw.update({k.arg: k.value for k in call.keywords if k.arg})
        ignored = sorted(k for k in kw if k not in {"name", "cpp_sources", "cuda_sources", "functions", "verbose",
                                                     "with_cuda", "is_python_module"})
        if ignored:
            notes.append(f"load_inline #{i + 1}: ignored {', '.join(ignored)} (env.py builds with fixed flags)")
        name = re.sub(r"\W", "_", str(const(kw["name"]) if "name" in kw else f"ext{i}")) or f"ext{i}"
        while f"kernels/{name}.cpp" in files or f"kernels/{name}_cuda.cu" in files:
            name += "_"
        listify = lambda x: [] if x is None else ([x] if isinstance(x, str) else list(x))  # noqa: E731
        cpp = listify(const(kw["cpp_sources"])) if "cpp_sources" in kw else []
        cuda = listify(const(kw["cuda_sources"])) if "cuda_sources" in kw else []
        funcs = const(kw["functions"]) if "functions" in kw else None
        funcs = {f: f for f in listify(funcs)} if not isinstance(funcs, dict) else funcs
        if cuda and backend != "cuda":
            raise ConversionError("uses cuda_sources; the CPU backend builds cpp_sources only")
        cpp_text = "\n".join(cpp)
        if "torch/extension.h" not in cpp_text:
            cpp_text = "#include <torch/extension.h>\n" + cpp_text
        if re.search(r"PYBIND11_MODULE\s*\(", cpp_text):
            modules.append(name)
        if funcs:
            defs = "".join(f'    m.def("{f}", &{f}, "{doc}");\n' for f, doc in funcs.items())
            cpp_text += f"\n\nvoid cuda_agent_register_{name}(pybind11::module_& m) {{\n{defs}}}\n"
            registers.append((name, f"kernels/{name}.cpp"))
        files[f"kernels/{name}.cpp"] = cpp_text
        if cuda:
            files[f"kernels/{name}_cuda.cu"] = "#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n" + "\n".join(cuda)
    if len(modules) + bool(registers) > 1:
        raise ConversionError("several PYBIND11_MODULEs (hand-written and/or from functions=); only one module can be built")
    if registers:  # one PYBIND11_MODULE, in the first file with functions=, calling every registration
        first = registers[0][1]
        files[first] += "".join(f"void cuda_agent_register_{n}(pybind11::module_& m);\n" for n, _ in registers[1:])
        files[first] += ("\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n"
                         + "".join(f"    cuda_agent_register_{n}(m);\n" for n, _ in registers) + "}\n")
    elif not modules:
        raise ConversionError("load_inline without functions= and without a PYBIND11_MODULE: nothing is exported")

    class Rewrite(ast.NodeTransformer):
        def visit_Call(self, node):
            return ast.copy_location(ast.Name("cuda_extension", ast.Load()), node) if is_load_inline(node) else self.generic_visit(node)

        def visit_ImportFrom(self, node):
            return None if (node.module or "").startswith("torch.utils.cpp_extension") else node

        def visit_Import(self, node):
            node.names = [a for a in node.names if not a.name.startswith("torch.utils.cpp_extension")]
            return node if node.names else None

    tree = Rewrite().visit(tree)
    # The module kept on an attribute (`self.op = my_ext`, then `self.op.fn(x)`): the scan resolves module-level names
    # bound to cuda_extension, not attributes of a value, so those calls are spelled `cuda_extension.fn(x)`.
    ext = {"cuda_extension"} | {t.id for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name)
                                and n.value.id == "cuda_extension" for t in n.targets if isinstance(t, ast.Name)}
    held = {t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name)
            and n.value.id in ext for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}

    class Unalias(ast.NodeTransformer):
        def visit_Attribute(self, node):
            v = node.value
            if isinstance(v, ast.Attribute) and v.attr in held and isinstance(v.value, ast.Name) and v.value.id == "self":
                return ast.copy_location(ast.Attribute(ast.Name("cuda_extension", ast.Load()), node.attr, node.ctx), node)
            return self.generic_visit(node)

    tree = Unalias().visit(tree)
    still_used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    tree.body = [n for n in tree.body if not (isinstance(n, ast.Assign) and len(n.targets) == 1
                 and isinstance(n.targets[0], ast.Name) and n.targets[0].id in used_consts - still_used)]
    last_import = max([i for i, n in enumerate(tree.body) if isinstance(n, (ast.Import, ast.ImportFrom))], default=-1)
    tree.body.insert(last_import + 1, ast.Import([ast.alias("cuda_extension")]))
    model_new = ("# Converted by evaluate.py from a KernelBench single-file solution: the load_inline sources are in\n"
                 "# kernels/, and every load_inline(...) is now the module cuda_extension built from them.\n"
                 + ast.unparse(ast.fix_missing_locations(tree)) + "\n")
    return model_new, files, notes


def prepare_workspace(task: dict, sol: Path, ws: Path, backend: str) -> list:
    """A fresh workspace at ws with the bench's model.py, what a task of the elementwise curriculum starts with (its op
    library, as agent.new_workspace gives a policy), and the solution's files over them. Returns notes."""
    if ws.exists():
        shutil.rmtree(ws)  # a half-written workspace of an interrupted run
    (ws / "kernels").mkdir(parents=True)
    (ws / "model.py").write_text(task["code"])
    for rel, text in elementwise.provided_files(task["code"], backend).items():
        (ws / rel).write_text(text)
    notes = []
    if sol.is_dir():
        for f in [*sol.iterdir(), *((sol / "kernels").iterdir() if (sol / "kernels").is_dir() else [])]:
            if f.is_file() and not f.is_symlink() and f.name != "model.py" and f.suffix in env.SOURCE_EXT | env.HEADER_EXT | {".py"}:
                dst = ws / f.relative_to(sol)
                shutil.copyfile(f, dst)
    else:
        model_new, files, notes = convert_load_inline(sol.read_text(), backend)
        (ws / "model_new.py").write_text(model_new)
        for rel, text in files.items():
            (ws / rel).write_text(text)
    return notes


def workspace_files(ws: Path) -> dict:
    """The final candidate files of a workspace (what env.evaluate scored), for tasks.jsonl."""
    out = {}
    for d in (ws, ws / "kernels"):
        for f in sorted(d.iterdir()) if d.is_dir() else []:
            if f.is_file() and f.name != "model.py" and f.suffix in env.SOURCE_EXT | env.HEADER_EXT | {".py"} and f.stat().st_size < 1 << 20:
                out[str(f.relative_to(ws))] = f.read_text(errors="replace")
    return out


# ----------------------------------------------------------------------------------------------
# Per-task work (top-level functions: they run in worker processes, one per GPU)
# ----------------------------------------------------------------------------------------------
def failed_verdict(backend: str, error: str) -> dict:
    return env.Verdict(backend=backend, stage="scan", error=error).to_dict()


def score_solution(job: dict) -> dict:
    """Convert/copy one solution into a workspace and score it with env.evaluate. Never raises."""
    t0, task, backend = time.monotonic(), job["task"], job["backend"]
    row = {"task_id": task["task_id"], "level": task["level"], "name": task["name"], "solution": job["solution"],
           "trajectory": None, "n_turns": None, "n_tokens": None, "files": {}, "notes": []}
    try:
        ws = Path(job["ws"])
        if job["solution"] is None:
            raise ConversionError("no solution for this task in SOL_DIR")
        row["notes"] = prepare_workspace(task, Path(job["solution"]), ws, backend)
        row["files"] = workspace_files(ws)
        row["verdict"] = env.evaluate(ws, backend=backend, reference=task["code"], timeout=job["timeout"],
                                      compile_timeout=job["compile_timeout"]).to_dict()
    except ConversionError as e:
        row["verdict"] = failed_verdict(backend, str(e) if job["solution"] is None else f"solution not usable: {e}")
    except Exception as e:  # noqa: BLE001 - a task failure, never the run's
        row["verdict"] = failed_verdict(backend, f"{type(e).__name__}: {str(e)[:500]}")
    row["seconds"] = round(time.monotonic() - t0, 2)
    return row


def time_reference(job: dict) -> dict:
    """Eager vs torch.compile for one task, timed by env.time_callable inside an env.run_sandboxed child."""
    t0, task, backend = time.monotonic(), job["task"], job["backend"]
    row = {"task_id": task["task_id"], "level": task["level"], "name": task["name"], "eager_ms": None,
           "compile_ms": None, "error": None}
    lock = env.gpu_lock_path(backend)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        with tempfile.TemporaryDirectory(prefix="ref-", dir=env.CACHE_DIR) as run:
            Path(run, "model.py").write_text(task["code"])
            run = str(Path(run).resolve())  # absolute paths: in the child, only the bind-mounted run dir is writable
            Path(run, "spec.json").write_text(json.dumps({"backend": backend, "lock_fd": fd, "n_timed": env.Config.n_timed,
                                                          "dir": run}))
            extra, writable = env.compile_caches()
            extra.update(env.CHILD_ENV)  # the threading a verdict's baselines get (OpenMP workers sleep when idle)
            # kind=backend: CUDA children get the namespaces in which a CUDA context works (env.isolation)
            r = env.run_sandboxed([sys.executable, "-E", "-B", str(EVAL_PY), "_reference", f"{run}/spec.json"], run, job["timeout"],
                                  writable=writable, env=extra, pass_fds=[fd], kind=backend)
            res = Path(run, "result.json")
            if r.crash or not res.exists():
                tail = env.error_excerpt(r.stderr, 6) if r.stderr.strip() else ""
                row["error"] = (r.crash or f"exited with code {r.returncode} without a result") + (f": {tail}" if tail else "")
            else:
                row.update(json.loads(res.read_text()))
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    finally:
        os.close(fd)
    row["seconds"] = round(time.monotonic() - t0, 2)
    return row


def _reference_child(spec_path: str):
    """Runs inside the sandbox: build Model, time it eager and compiled with env.time_callable."""
    spec = json.loads(Path(spec_path).read_text())
    result = {"error": None}
    try:
        device = torch.device("cuda" if spec["backend"] == "cuda" else "cpu")
        torch.set_num_threads(os.cpu_count() or 1)
        s = importlib.util.spec_from_file_location("reference_model", Path(spec["dir"]) / "model.py")
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
        torch.manual_seed(0)
        model = mod.Model(*mod.get_init_inputs()).to(device).eval()
        sets = []
        for seed in range(4):  # distinct input sets, copied in turn into the same buffers (as env.py does)
            torch.manual_seed(1000 + seed)
            sets.append([x.to(device) if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()])
        result["eager_ms"], _ = env.time_callable(model, sets, n_timed=spec["n_timed"], lock_fd=spec["lock_fd"])
        compiled = torch.compile(model)
        result["compile_ms"], _ = env.time_callable(compiled, sets, n_timed=spec["n_timed"], lock_fd=spec["lock_fd"])
    except BaseException as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    Path(spec["dir"], "result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def _pin_worker(gpu_queue):
    """Worker process initialiser: one GPU per worker, so env.py's per-GPU timing lock and
    CUDA_VISIBLE_DEVICES agree (one timed evaluation per GPU at a time)."""
    gpu = gpu_queue.get()
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu


def visible_gpus() -> list[str]:
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        return [str(i) for i, l in enumerate(r.stdout.splitlines()) if l.startswith("GPU ")]
    return []


def run_jobs(fn, jobs: list, backend: str, workers: int):
    """Yield fn(job) for every job as it finishes: in this process with one worker, else one process per GPU."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield fn(job)
        return
    ctx = mp.get_context("spawn")  # no forked copies of torch/CUDA state
    q = ctx.Queue()
    gpus = visible_gpus() if backend == "cuda" else []
    for i in range(workers):
        q.put(gpus[i % len(gpus)] if gpus else None)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_pin_worker, initargs=(q,)) as pool:
        futures = {pool.submit(fn, job): job for job in jobs}
        for fut in as_completed(futures):
            try:
                yield fut.result()
            except BrokenProcessPool:  # a worker was killed (out of host memory?); candidates never run in it
                raise RuntimeError("a worker process died; finished tasks are saved")


# ----------------------------------------------------------------------------------------------
# Policies (agent.py): the ReAct agent, or one answer per task
# ----------------------------------------------------------------------------------------------
def run_policy(policy, chunk: list, mode: str, backend: str, out: Path, gen: dict) -> list[dict]:
    """Episodes for a chunk of tasks -> task rows. gen: max_turns, max_new_tokens, temperature, timeout.
    Trajectories (agent.py's episode dicts) are appended to out/episodes/trajectories.jsonl; each row points to
    its line. Workspaces stay in out/episodes/workspaces/."""
    t0 = time.monotonic()
    ep_dir = out / "episodes"
    ep_dir.mkdir(parents=True, exist_ok=True)
    traj = ep_dir / "trajectories.jsonl"
    first_line = 1 + (sum(1 for _ in open(traj)) if traj.exists() else 0)
    if mode == "agent":
        kw = {k: gen[k] for k in ("max_new_tokens", "temperature") if gen.get(k) is not None}
        episodes = agent.run_episodes(policy, chunk, backend=backend, max_turns=gen["max_turns"], out_dir=str(ep_dir),
                                      eval_timeout=gen["timeout"], **kw)
    else:
        episodes = agent.run_single_turn(policy, chunk, backend, max_new_tokens=gen.get("max_new_tokens") or 2048,
                                         temperature=gen.get("temperature") or 0.0, out_dir=ep_dir,
                                         eval_timeout=gen["timeout"])
        agent.save_episodes(traj, episodes, append=True)
    per_task = (time.monotonic() - t0) / max(1, len(chunk))
    rows = []
    for i, (task, ep) in enumerate(zip(chunk, episodes)):
        tokens = ep.get("tokens")
        ws = Path(ep["workspace"]) if ep.get("workspace") else None
        rows.append({"task_id": task["task_id"], "level": task["level"], "name": task["name"], "solution": None,
                     "verdict": ep.get("verdict") or failed_verdict(backend, "the episode produced no verdict"),
                     "n_turns": ep.get("n_turns"), "n_tokens": len(tokens) if tokens else None,
                     "trajectory": f"{traj}:{first_line + i}", "workspace": str(ws) if ws else None,
                     "files": workspace_files(ws) if ws and ws.is_dir() else {}, "finished": ep.get("finished"),
                     "end_reason": ep.get("end_reason"), "seconds": round(per_task, 2)})
    return rows


# ----------------------------------------------------------------------------------------------
# The run: importable for train.py
# ----------------------------------------------------------------------------------------------
def run_eval(tasks: list[dict], *, mode: str, out_dir, backend: str = "auto", policy=None, solutions: dict | None = None,
             max_turns: int = 200, batch: int = 8, max_new_tokens: int | None = None, temperature: float = 0.0,
             timeout: float = env.Config.timeout, compile_timeout: float = env.Config.compile_timeout, workers: int | None = None,
             settings: dict | None = None, quiet: bool = False) -> dict:
    """Evaluate tasks and write out_dir/{run.json, tasks.jsonl, results.json}; returns the results dict
    ({"overall": summarize(...), "levels": {...}, ...}). mode: agent | single | solutions | reference.
    Resumable: tasks already in tasks.jsonl are skipped; a folder holding another kind of run is refused."""
    t_start = time.monotonic()
    backend = env.resolve_backend(backend)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_file, tasks_file = out / "run.json", out / "tasks.jsonl"
    settings = {"mode": mode, "backend": backend, **(settings or {})}
    prev = json.loads(run_file.read_text()) if run_file.exists() else None
    if prev is not None:
        diff = [k for k in settings if k != "wall_s" and prev.get(k) != settings[k]]
        if diff:
            raise env.UsageError(f"{out} holds a different run ({', '.join(f'{k}={prev.get(k)!r}' for k in diff)}); "
                                 "use another --out to start a new one")
    done = {}
    if tasks_file.exists():
        for line in tasks_file.read_text().splitlines():
            try:
                r = json.loads(line)
                done[r["task_id"]] = r
            except (json.JSONDecodeError, KeyError):
                pass  # a line cut short by a kill: that task runs again
    run_file.write_text(json.dumps({**settings, "wall_s": (prev or {}).get("wall_s", 0.0)}, indent=1))
    todo = [t for t in tasks if t["task_id"] not in done]
    say = (lambda s: None) if quiet else tqdm.write
    if done and not quiet:
        say(f"resuming {out}: {len([t for t in tasks if t['task_id'] in done])} of {len(tasks)} tasks already done")
    if workers is None:
        workers = max(1, len(visible_gpus())) if backend == "cuda" else 1

    def rows_iter():
        if mode == "reference":
            jobs = [{"task": t, "backend": backend, "timeout": timeout} for t in todo]
            yield from run_jobs(time_reference, jobs, backend, workers)
        elif mode == "solutions":
            jobs = [{"task": t, "backend": backend, "solution": str(solutions[t["task_id"]]) if solutions.get(t["task_id"]) else None,
                     "ws": str(out / "workspaces" / t["task_id"]), "timeout": timeout, "compile_timeout": compile_timeout}
                    for t in todo]
            yield from run_jobs(score_solution, jobs, backend, workers)
        else:
            for i in range(0, len(todo), batch):  # results are saved after every batch
                yield from run_policy(policy, todo[i:i + batch], mode, backend, out, dict(
                    max_turns=max_turns, max_new_tokens=max_new_tokens, temperature=temperature, timeout=timeout))

    bar = tqdm(total=len(todo), desc=f"eval {mode}", unit="task", disable=quiet or not todo, file=sys.stderr)
    with open(tasks_file, "a") as f:
        for step, row in enumerate(rows_iter(), 1):
            row["mode"] = mode
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()  # a killed run loses at most the task in flight
            done[row["task_id"]] = row
            bar.update(1)
            say(log_line(step, len(todo), row, mode))
    bar.close()
    rows = [done[t["task_id"]] for t in tasks if t["task_id"] in done]
    results = by_level(rows, summarize_reference if mode == "reference" else summarize)
    wall = (prev or {}).get("wall_s", 0.0) + (time.monotonic() - t_start)
    results["overall"]["wall_s"] = round(wall, 1)
    results.update(mode=mode, backend=backend, settings=settings, finished=len(rows) == len(tasks))
    run_file.write_text(json.dumps({**settings, "wall_s": round(wall, 1)}, indent=1))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def log_line(step: int, total: int, row: dict, mode: str) -> str:
    """One `|`-separated line per finished task."""
    if mode == "reference":
        e, c = row.get("eager_ms"), row.get("compile_ms")
        return (f"task {step}/{total} | {row['task_id']} | eager {num(e, '{:.4g}')} ms | compile {num(c, '{:.4g}')} ms | "
                f"compile/eager {times(e / c if e and c else None)} | {row['seconds']:.1f}s" + (f" | error {row['error'][:120]}" if row.get("error") else ""))
    v = row["verdict"]
    why = (v.get("violations") or [None])[0] or v.get("error")
    return (f"task {step}/{total} | {row['task_id']} | reward {v.get('reward', -1):+d} | correct {bool(v.get('correct'))} | "
            f"{num(v.get('runtime_ms'), '{:.4g}')} ms | vs eager {times(v.get('speedup_eager'))} | vs compile "
            f"{times(v.get('speedup_compile'))} | {row.get('seconds', 0):.1f}s" + (f" | {str(why)[:140]}" if why and not v.get("correct") else ""))


# ----------------------------------------------------------------------------------------------
# Reports: side-by-side comparison, chart
# ----------------------------------------------------------------------------------------------
def compare(path_a: str, path_b: str) -> str:
    """Two results.json side by side, with the paper's CUDA Agent row where it applies (KernelBench levels 1-3)."""
    res = []
    for p in (path_a, path_b):
        if not Path(p).is_file():
            raise env.UsageError(f"no such results file: {p}")
        try:
            r = json.loads(Path(p).read_text())
            r["overall"], r["levels"]  # noqa: B018 - the shape check
        except (json.JSONDecodeError, KeyError, TypeError):
            raise env.UsageError(f"{p} is not an evaluate.py results.json")
        if r.get("mode") == "reference":
            raise env.UsageError(f"{p} is a --reference-only run; compare scoring runs")
        res.append(r)
    names = [Path(p).parent.name or p for p in (path_a, path_b)]
    if names[0] == names[1]:
        names = [str(Path(p).parent) for p in (path_a, path_b)]
    metrics = [("n", "n", str), ("pass", "pass_rate", pct), (">eager", "faster_eager_rate", pct),
               (">compile", "faster_compile_rate", pct), ("fast_1", "fast_1", pct), ("geo vs eager", "geomean_speedup_eager", times),
               ("geo vs compile", "geomean_speedup_compile", times), ("turns", "mean_turns", num), ("tokens", "mean_tokens", num)]
    groups = ["overall"] + sorted(set(res[0]["levels"]) | set(res[1]["levels"]), key=lambda s: (not s.isdigit(), s.zfill(4)))
    lines = [f"| set | metric | {names[0]} | {names[1]} | CUDA Agent (paper) |", "|---|---|---|---|---|"]
    for g in groups:
        ms = [r["overall"] if g == "overall" else r["levels"].get(g, {}) for r in res]
        for label, key, fmt in metrics:
            cells = [fmt(m.get(key)) if m else "-" for m in ms]
            paper = PAPER.get(g, {}).get(key)
            name = "" if label != "n" else f"level {g}" if g.isdigit() else g
            lines.append(f"| {name} | {label} | {cells[0]} | {cells[1]} | {fmt(paper) if paper is not None else ''} |")
    return "\n".join(lines) + "\n\nPaper: CUDA Agent (Seed1.6 230B MoE, RL-trained) on KernelBench L1/L2/L3 = 100/100/50 tasks, its GPUs."


def chart(results: dict, path: Path) -> bool:
    """A bar chart of the per-level rates; False when matplotlib is not installed."""
    try:
        import matplotlib  # (optional, in requirements.txt; pyplot takes a second to import: only for the chart)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = [("overall", results["overall"])] + list(results["levels"].items())
    keys = [("pass_rate", "pass"), ("faster_eager_rate", "> eager"), ("faster_compile_rate", "> compile")]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(groups), 3.2))
    w = 0.8 / len(keys)
    for j, (k, label) in enumerate(keys):
        ax.bar([i + j * w for i in range(len(groups))], [100 * (m.get(k) or 0) for _, m in groups], w, label=label)
    ax.set_xticks([i + w for i in range(len(groups))], [g if g == "overall" else f"level {g}" for g, _ in groups])
    ax.set_ylabel("% of tasks")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        if a.compare:
            print(compare(*a.compare))
            return 0
        if a.solutions and a.reference_only:
            raise env.UsageError("--solutions and --reference-only are different runs; pick one")
        if (a.solutions or a.reference_only) and (a.model or a.base_url):
            raise env.UsageError(f"--model/--base-url choose a policy; {'--solutions' if a.solutions else '--reference-only'}"
                                 " runs none (drop them, or drop --solutions/--reference-only to evaluate the model)")
        tasks = load_tasks(a)
        backend = env.resolve_backend(a.backend)
        bench_src = a.dataset if a.bench == "synth" else (str(Path(a.bench_dir).resolve()) if a.bench_dir else KERNELBENCH_HUB)
        settings = {"bench": a.bench, "bench_source": bench_src}
        policy, solutions = None, None
        if a.reference_only:
            mode = "reference"
        elif a.solutions:
            mode = "solutions"
            known = {t["name"] for t in load_bench_dir(a.bench_dir, None)} if a.bench_dir and a.bench != "synth" else {t["name"] for t in tasks}
            solutions = find_solutions(a.solutions, tasks, known)
            settings["solutions"] = str(Path(a.solutions).resolve())
            missing = [tid for tid, p in solutions.items() if p is None]
            if missing:
                print(f"evaluate.py: note: {len(missing)} of {len(tasks)} tasks have no solution in {a.solutions}; "
                      "they count as failures", file=sys.stderr)
        else:
            mode = a.mode
            settings.update(policy=a.policy, model=a.model, max_turns=a.max_turns if mode == "agent" else 1, temperature=a.temperature)
            policy = agent.load_policy(a.policy, model=a.model, base_url=a.base_url)
        results = run_eval(tasks, mode=mode, out_dir=a.out, backend=backend, policy=policy, solutions=solutions,
                           max_turns=a.max_turns, batch=a.batch, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                           timeout=a.timeout, compile_timeout=a.compile_timeout,
                           workers=a.workers, settings=settings)
    except env.UsageError as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # e.g. the policy's server stopped answering: finished tasks are kept
        print(f"evaluate.py: error: {str(e).splitlines()[0][:300]}; finished tasks are saved in {a.out}, re-run to resume",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"evaluate.py: interrupted; finished tasks are saved in {a.out}/tasks.jsonl, re-run to resume", file=sys.stderr)
        return 130
    print()
    print(table(results))
    print()
    print(REF_DEFINITIONS if mode == "reference" else DEFINITIONS)
    if mode == "reference" and any(k in H100_COMPILE_WINS for k in results["levels"]):
        print("For comparison, torch.compile beats eager on KernelBench (reported on an H100): "
              + ", ".join(f"L{k} {v}" for k, v in H100_COMPILE_WINS.items()))
    o = results["overall"]
    png = Path(a.out) / "rates.png"
    drew = mode != "reference" and chart(results, png)
    print(f"\n{'done' if results['finished'] else 'INCOMPLETE'}: {o['n']} tasks | wall {o['wall_s']:.0f}s | "
          f"{Path(a.out) / 'results.json'} | {Path(a.out) / 'tasks.jsonl'}"
          + (f" | {png}" if drew else " | no chart (matplotlib not installed)" if mode != "reference" else ""))
    if a.json:
        print(json.dumps(o))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_reference":
        _reference_child(sys.argv[2])
    else:
        sys.exit(main())
