"""synth.py: synthesise CUDA-Agent-Ops-style training tasks (mine -> compose -> filter -> report).

    python synth.py --out data/tiny --num-tasks 8 --backend cpu --workers 2        # tiny run (CPU, minutes)
    python synth.py --out data/ops6k --num-tasks 6000 --backend cuda --workers 12  # the real run (one H200)
    python synth.py --out data/elem --num-tasks 64 --family elementwise --backend cpu --workers 2  # elementwise.py's family

The pipeline, one readable function per stage, in order:
  1. mine      introspect torch.nn modules, torch / torch.special / torch.linalg / torch.nn.functional
               functions and transformers' activations and normalisation layers; probe each on small
               tensors of rank 2..5 (and on meta tensors) to learn which input ranks it accepts, and
               keep it as a seed operator if it computes something deterministic from its input.
               ARG_RULES, a short table, gives constructor arguments that introspection cannot guess
               (in_channels = the input's dim 1, ...). Runs once in a sandboxed child, cached per
               torch/transformers version.
  2. compose   sample the number of ops K from the paper's mix, chain K seeds *sequentially*, propagating
               shapes by running on meta tensors, then double BATCH until a roofline estimate of eager
               time (bytes moved and FLOPs counted on meta tensors, plus each seed's mined CPU cost per
               element) reaches the target inside the time window. Emits a self-contained KernelBench-
               format module. Deterministic per --seed. `--composer llm` lets agent.py's policy rewrite
               each rule-composed plan (as the paper did); its answers go through the same filters.
  3. filter    cheap filters in this process (duplicates, AST similarity > 0.9 to --kernelbench-dir),
               then execution in --workers long-lived sandboxed children (env.run_sandboxed), fed one
               candidate at a time: eager must run, be deterministic, give finite outputs that depend on
               the input (not constant, not the input itself), eager time inside the window
               (env.time_callable), torch.compile must run and agree with eager. A task's runs, checks and
               timing hold one lock per device; compiling and small warm-up runs are outside it, in parallel.
               Compose and filter form one stream: a candidate is composed when a worker is free and
               the tasks kept so far (plus the expected yield of those being checked) fall short.
  4. report    funnel (in/out and top drop reasons of every stage) on screen and in DIR/funnel.json,
               diversity (op histogram, ops per task vs the paper's mix, input sizes, eager times).

Output: DIR holds a datasets.DatasetDict (train/test) saved with save_to_disk; columns ops, data_source,
code, eager_ms, compile_ms. `load_tasks(DIR or hub id, split)` reads it (train.py/evaluate.py use it).
DIR is written atomically at the end; per-candidate filter results are kept in DIR.partial/ so an
interrupted run, re-run with the same command, resumes where it stopped.

Honest limits: models run in eval mode, like env.py (so BatchNorm, the identity there, is skipped); the
default CPU window (0.1-10 ms, one thread per child) is a scaled stand-in for the paper's 1-100 ms on a GPU;
the roofline constants for CUDA are not calibrated yet (bench/synth_bench.py on an H200 shows the
too-fast/too-slow drops; --window-ms and --mem-cap-gb adjust); similarity uses --kernelbench-dir, or the
hub dataset with `--kernelbench-dir hub` when online, and is off otherwise.
"""
from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import dataclasses
import difflib
import fcntl
import hashlib
import json
import math
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import elementwise
import env

HUB_ID = "BytedTsinghua-SIA/CUDA-Agent-Ops-6K"  # the published dataset (same columns, no timings)
PAPER_MIX = {"torch#1": 3.4, "torch#2": 84.0, "torch#3": 7.6, "torch#4": 2.8, "torch#5": 1.2, "transformers": 1.2}
SEEDS_VERSION = 6  # bump when mining changes, to invalidate the seed cache


@dataclasses.dataclass
class Config:
    out: str = ""
    num_tasks: int = 50
    max_ops: int = 5
    backend: str = "auto"
    seed: int = 0
    workers: int = 1
    kernelbench_dir: str | None = None
    composer: str = "rule"  # rule | llm
    family: str = "paper"  # paper: the paper's mix of mined torch ops | elementwise: elementwise.py's chains
    model: str | None = None  # for --composer llm
    test_share: float = 0.05
    window_ms: tuple | None = None  # (lo, hi) eager-time window; None = 1-100 ms on CUDA, 0.1-10 ms on CPU
    similarity: float = 0.9  # drop if AST similarity to a KernelBench file is above this
    task_timeout_s: int = 0  # a candidate's check may take this long before its child is ended; 0 = 60 CUDA, 150 CPU
    max_candidates: int = 0  # give up after composing this many; 0 = 20 * num_tasks + 50
    # timed runs per measurement (env.time_callable; no warm-up: the checks already ran the task, the compile
    # check the compiled one): few, because timing holds the device lock (one task at a time), the H200's
    # bottleneck; a median of 5 is precise enough to place a task in a 1-100 ms window
    n_timed: int = 5
    min_timed_s: float = 0.0
    mem_cap_gb: float = 0.0  # bytes one task may touch (estimated); 0 = 4 GiB on CUDA, 0.25 GiB on CPU


# Constructor arguments introspection cannot guess, by parameter name: f(shape, rng) -> value.
# `shape` is the op's input shape. Only required parameters (and the None-default ones in NONE_DEFAULTS) use it.
ARG_RULES = {
    "in_features": lambda s, r: s[-1],
    "input_size": lambda s, r: s[-1],
    "hidden_size": lambda s, r: s[-1],
    "d_model": lambda s, r: s[-1],
    "out_features": lambda s, r: r.choice([64, 128, 256, 512, 1024]),
    "in_channels": lambda s, r: s[1],
    "num_features": lambda s, r: s[1],
    "num_channels": lambda s, r: s[1],
    "out_channels": lambda s, r: r.choice([8, 16, 32, 64]),
    "num_groups": lambda s, r: r.choice([g for g in (1, 2, 4, 8) if s[1] % g == 0]),
    "nhead": lambda s, r: r.choice([h for h in (1, 2, 4, 8) if s[-1] % h == 0]),
    "normalized_shape": lambda s, r: (s[-1],),
    "kernel_size": lambda s, r: r.choice([2, 3]),
    "output_size": lambda s, r: r.choice([2, 4]),
    "upscale_factor": lambda s, r: 2,
    "downscale_factor": lambda s, r: 2,
    "groups": lambda s, r: 2,
    "padding": lambda s, r: r.choice([1, 2]),
    "value": lambda s, r: 0.5,
    "threshold": lambda s, r: 0.25,
    "size": lambda s, r: 5,
    "norm_type": lambda s, r: 2.0,
    # optional parameters whose default (None) is useless or deprecated:
    "dim": lambda s, r: -1,
    "scale_factor": lambda s, r: 2.0,
}
NONE_DEFAULTS = {"dim", "scale_factor"}
# Mining skips these outright (reason given): state-changing, I/O, creation or random functions.
DENY_PREFIXES = ("set_", "get_", "is_", "use_", "save", "load", "manual_seed", "seed", "initial_seed", "compile", "export",
                 "from_", "as_", "empty", "zeros", "ones", "full", "rand", "normal", "bernoulli", "poisson", "multinomial",
                 "dropout", "alpha_dropout", "feature_", "fused_", "quantize", "dequantize", "q_", "sym_", "vmap", "cond",
                 "while_loop", "frombuffer", "asarray", "tensor", "scalar_tensor", "can_cast", "promote_types", "result_type",
                 "cuda", "mps", "xpu", "mkldnn", "miopen", "cudnn", "native_", "align", "autocast", "typename", "fork", "wait",
                 "chunk", "split", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit", "meshgrid", "broadcast_", "lobpcg",
                 "pca_", "svd_lowrank", "stft", "istft", "pdist", "cdist", "gumbel", "rrelu", "unique", "nonzero", "where",
                 "masked", "index", "gather", "scatter", "take", "put", "sparse", "to_", "resolve_", "conj", "imag", "real",
                 "view_as", "histogram", "bincount", "argwhere", "print", "no_grad", "enable_grad", "inference_mode")
CANON_SHAPES = {2: (4, 8), 3: (2, 4, 8), 4: (2, 4, 8, 8), 5: (2, 4, 4, 8, 8)}  # for probing seeds
DIM_NAMES = {2: ["BATCH", "DIM"], 3: ["BATCH", "SEQ_LEN", "DIM"], 4: ["BATCH", "CHANNELS", "HEIGHT", "WIDTH"],
             5: ["BATCH", "CHANNELS", "DEPTH", "HEIGHT", "WIDTH"]}
# Base input shapes (BATCH = 1 here; compose grows BATCH): rank -> choices for the other dims.
BASE_DIMS = {2: [[256, 512, 1024, 2048, 4096]], 3: [[32, 64, 128, 256], [64, 128, 256, 512]],
             4: [[3, 8, 16, 32, 64], [16, 32, 64, 128]], 5: [[3, 8, 16], [8, 16], [16, 32]]}
RANK_WEIGHTS = {2: 0.35, 3: 0.2, 4: 0.35, 5: 0.1}
# Roofline constants for the eager-time estimate used to size tasks: bytes/s, FLOP/s, per-op overhead (s).
ROOFLINE = {"cuda": (3.0e12, 4.0e13, 8e-6), "cpu": (4.0e9, 2.0e10, 1e-5)}
GPU_SPEEDUP = 1000.0  # an H200 vs one CPU core on compute-bound elementwise math (fp32 FLOP/s ratio, roughly)
MEM_CAP = {"cuda": 4 << 30, "cpu": 256 << 20}  # estimated bytes one task may touch (eager, all intermediates)


class UsageError(env.UsageError):
    pass


# ==============================================================================================
# 1. Mine seed operators
# ==============================================================================================
def mine_seeds(verbose: bool = True) -> list[dict]:
    """Seed operators, from the per-version cache or by probing in a sandboxed child (~1 min once)."""
    from importlib.metadata import version
    key = f"seeds-v{SEEDS_VERSION}-torch{version('torch')}-transformers{version('transformers')}.json"
    cache = env.CACHE_DIR / "synth" / key
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        if verbose:
            print("mine: probing torch and transformers operators in a sandboxed child (once per version)...", flush=True)
        with tempfile.TemporaryDirectory(prefix="mine-", dir=env.CACHE_DIR) as d:
            r = env.run_sandboxed([sys.executable, "-E", "-B", str(Path(__file__).resolve()), "_mine", str(Path(d) / "mined.json")], d,
                                  timeout=900, mem_gb=8.0, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
            if not (Path(d) / "mined.json").exists():
                raise RuntimeError(f"mining failed: {r.crash or r.returncode}\n{r.stderr[-3000:]}")
            tmp = cache.with_suffix(f".{uuid.uuid4().hex}.tmp")
            shutil.copy(Path(d) / "mined.json", tmp)
            os.replace(tmp, cache)
    mined = json.loads(cache.read_text())
    if verbose:
        by_src = collections.Counter(s["source"] for s in mined["seeds"])
        print(f"mine: {len(mined['seeds'])} seed operators | " + " | ".join(f"{k} {v}" for k, v in sorted(by_src.items())))
        reasons = collections.defaultdict(list)
        for name, why in mined["skipped"]:
            reasons[why.split(":")[0][:70]].append(name)
        print(f"mine: skipped {len(mined['skipped'])} candidates:")
        for why, names in sorted(reasons.items(), key=lambda kv: -len(kv[1]))[:12]:
            print(f"  {len(names):4d}  {why}  (e.g. {', '.join(names[:4])})")
    return mined["seeds"]


def _probe(make, rank_shapes, torch, max_growth=16):
    """Try an op on a random tensor of each rank. Returns (ranks where it works, why it failed first)."""
    ranks, why = [], None
    for rank, shape in rank_shapes.items():
        try:
            torch.manual_seed(0)
            x1, x2 = torch.randn(shape), torch.randn(shape)
            xa = x1.clone()
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                op = make(shape, random.Random(0), "cpu")
                y1, y1b, y2 = op(xa), op(x1.clone()), op(x2.clone())
            if caught:  # deprecated, implicit dim, or a shape it misreads (InstanceNorm1d on 2-d input...)
                raise ValueError(f"warns: {str(caught[0].message).splitlines()[0][:50]}")
            if isinstance(y1, (tuple, list)):
                raise ValueError("returns a tuple")
            if not isinstance(y1, torch.Tensor) or not y1.is_floating_point():
                raise ValueError("output is not a float tensor")
            if y1.untyped_storage().data_ptr() == xa.untyped_storage().data_ptr():
                raise ValueError("a view of its input (no computation)")
            if not torch.isfinite(y1).all():
                raise ValueError("non-finite output on randn inputs")
            if not torch.equal(y1, y1b):
                raise ValueError("random (two runs differ)")
            if y1.shape == x1.shape and torch.allclose(y1, x1, atol=1e-2, rtol=1e-2):
                raise ValueError("the identity within 1e-2 (in eval mode)")
            if y1.shape == y2.shape and torch.allclose(y1, y2):
                raise ValueError("output does not depend on the input values")
            if y1.numel() > max_growth * x1.numel():  # (module sizes come from ARG_RULES: not checked here)
                raise ValueError("output much larger than input")
            with torch.no_grad():  # compose propagates shapes on meta tensors: the op must support them
                ym = make(shape, random.Random(0), "meta")(torch.empty(shape, device="meta"))
            if tuple(ym.shape) != tuple(y1.shape):
                raise ValueError("meta tensors give a different shape")
            ranks.append(rank)
        except ValueError as e:
            why = why or (str(e) if len(str(e)) < 70 else f"ValueError: {str(e).splitlines()[0][:60]}")
        except Exception as e:  # noqa: BLE001 - any failure means "not this rank"
            why = why or f"{type(e).__name__} on a rank-{rank} input: {str(e).strip().splitlines()[0][:60] if str(e).strip() else ''}"
    return ranks, why


def _cost_probe(make, rank, torch) -> float:
    """Single-thread CPU nanoseconds per input element (best of 3 runs, ~64k elements). Bytes and FLOPs
    miss the cost of transcendental functions (erf, i0, airy_ai...): compose uses this as a lower bound."""
    shape = CANON_SHAPES[rank]
    shape = (max(1, 65536 // math.prod(shape[1:])),) + shape[1:]
    try:
        with torch.no_grad():  # first on meta: never allocate a huge output for real
            out = make(shape, random.Random(0), "meta")(torch.empty(shape, device="meta"))
        if out.numel() > 4 * math.prod(shape):
            return 0.0
        op, x = make(shape, random.Random(0), "cpu"), torch.randn(shape)
        best = float("inf")
        with torch.no_grad():
            for _ in range(3):
                t0 = time.perf_counter()
                op(x)
                best = min(best, time.perf_counter() - t0)
        return round(best * 1e9 / x.numel(), 3)
    except Exception:  # noqa: BLE001 - a size the op dislikes: no extra cost information
        return 0.0


def build_op(seed: dict, shape, rng: random.Random):
    """Expression for one op at input `shape`: ("nn.Conv2d(in_channels=3, ...)" | "torch.tanh(x)")."""
    if seed["kind"] == "call":
        return seed["expr"]
    if seed.get("instance"):  # e.g. ACT2FN["gelu_new"]: already an instance
        return seed["ctor"]
    args = []
    for name in seed["args"]:
        if name == "__first_dim_last":  # transformers norms: first positional = hidden size
            args.append(repr(shape[-1]))
        else:
            args.append(f"{name}={ARG_RULES[name](shape, rng)!r}")
    return f"{seed['ctor']}({', '.join(args)})"


def _namespace(torch):
    import torch.nn as nn
    import torch.nn.functional as F
    return {"torch": torch, "nn": nn, "F": F}


def eval_op(seed: dict, expr: str, ns: dict, device: str):
    """A callable for one op expression (modules are constructed on `device`)."""
    import torch
    if seed["kind"] == "call":
        return lambda x: eval(expr, ns, {"x": x})  # noqa: S307 - our own generated expression
    for imp in seed.get("imports", []):
        exec(imp, ns)  # noqa: S102
    with torch.device(device):
        return eval(expr, ns).eval()  # noqa: S307


def _mine_child(out_path: str):
    """Runs in a sandboxed child: probe every candidate operator, write {"seeds": [...], "skipped": [...]}."""
    import inspect
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    torch.set_num_threads(1)
    seeds, skipped = [], []
    ns = _namespace(torch)

    def add(seed, rank_shapes=CANON_SHAPES):
        make = lambda shape, rng, dev: eval_op(seed, build_op(seed, shape, rng), dict(ns), dev)
        ranks, why = _probe(make, rank_shapes, torch, max_growth=float("inf"))
        if ranks:
            seeds.append(dict(seed, ranks=ranks, ns_per_elem=_cost_probe(make, ranks[0], torch)))
        else:
            skipped.append((seed["name"], why or "fails on every rank"))

    # torch.nn modules: every nn.Module subclass exported by torch.nn
    skip_mod = {"Module": "base class", "Sequential": "container", "ModuleList": "container", "ModuleDict": "container",
                "ParameterList": "container", "ParameterDict": "container", "Container": "container", "Identity": "identity"}
    for name in sorted(dir(nn)):
        cls = getattr(nn, name)
        if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
            continue
        if name in skip_mod:
            skipped.append((f"nn.{name}", skip_mod[name]))
            continue
        if name.startswith("Lazy"):
            skipped.append((f"nn.{name}", "lazy module (same op as its eager twin)"))
            continue
        if "Dropout" in name:
            skipped.append((f"nn.{name}", "random (and the identity in eval mode)"))
            continue
        if name.endswith("Loss"):
            skipped.append((f"nn.{name}", "loss: forward needs a target tensor"))
            continue
        try:
            fwd = [p for p in inspect.signature(cls.forward).parameters.values()
                   if p.name != "self" and p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            init = inspect.signature(cls.__init__).parameters.values()
        except (TypeError, ValueError):
            skipped.append((f"nn.{name}", "no signature"))
            continue
        if len(fwd) != 1:
            skipped.append((f"nn.{name}", f"forward needs {len(fwd)} tensors"))
            continue
        args, bad = [], None
        for p in init:
            if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.default is p.empty or (p.default is None and p.name in NONE_DEFAULTS):
                if p.name not in ARG_RULES:
                    bad = f"cannot infer constructor argument {p.name!r}"
                    break
                args.append(p.name)
        if bad:
            skipped.append((f"nn.{name}", bad))
            continue
        add({"name": f"nn.{name}", "source": "torch.nn", "kind": "module", "ctor": f"nn.{name}", "args": args})

    # functions: torch.*, torch.special.*, torch.linalg.*, torch.nn.functional.*
    seen_fns = {}
    for prefix, module, src in (("torch", torch, "torch"), ("torch.special", torch.special, "torch.special"),
                                ("torch.linalg", torch.linalg, "torch.linalg"), ("F", F, "torch.nn.functional")):
        for name in sorted(dir(module)):
            fn = getattr(module, name, None)
            full = f"{prefix}.{name}"
            if name.startswith("_") or name.endswith("_") or not callable(fn) or inspect.isclass(fn) or inspect.ismodule(fn):
                continue
            if not name.islower():
                continue
            if name.startswith(DENY_PREFIXES) or "loss" in name:
                skipped.append((full, "denied: state, I/O, creation, random or data-dependent shape"))
                continue
            if id(fn) in seen_fns:
                skipped.append((full, f"same function as {seen_fns[id(fn)]}"))
                continue
            seen_fns[id(fn)] = full
            found, first_why = None, None
            for form in (f"{full}(x)", f"{full}(x, -1)"):  # a single tensor, or a tensor and a dim
                ranks, why = _probe(lambda shape, rng, dev, e=form: (lambda x: eval(e, ns, {"x": x})), CANON_SHAPES, torch)  # noqa: S307
                if ranks:
                    make = lambda shape, rng, dev, e=form: (lambda x: eval(e, ns, {"x": x}))  # noqa: S307
                    found = {"name": full, "source": src, "kind": "call", "expr": form, "ranks": ranks,
                             "ns_per_elem": _cost_probe(make, ranks[0], torch)}
                    break
                first_why = first_why or why
            if found:
                seeds.append(found)
            else:
                skipped.append((full, first_why or "no single-tensor call form works"))

    # transformers: activations (ACT2FN) and normalisation layers of a few model families
    try:
        from transformers.activations import ACT2CLS
        for key, val in sorted(ACT2CLS.items()):
            cls = val[0] if isinstance(val, tuple) else val
            if not cls.__module__.startswith("transformers"):
                skipped.append((f"transformers.{key}", f"same module as torch's {cls.__name__}"))
                continue
            add({"name": f"transformers.{key}", "source": "transformers", "kind": "module", "instance": True,
                 "ctor": f'ACT2FN["{key}"]', "args": [], "imports": ["from transformers.activations import ACT2FN"]})
        import importlib
        seen_src = set()
        for fam in ("llama", "gemma", "t5", "olmo", "cohere", "mamba", "qwen2", "mistral", "phi3", "qwen3"):
            mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
            for name, cls in sorted(vars(mod).items()):
                if not (inspect.isclass(cls) and cls.__module__ == mod.__name__ and name.endswith(("RMSNorm", "LayerNorm"))):
                    continue
                src_hash = hashlib.sha256(inspect.getsource(cls).replace(name, "X").encode()).hexdigest()
                if src_hash in seen_src:
                    skipped.append((f"transformers.{name}", "same code as another transformers norm"))
                    continue
                seen_src.add(src_hash)
                add({"name": f"transformers.{name}", "source": "transformers", "kind": "module", "ctor": name,
                     "args": ["__first_dim_last"], "imports": [f"from {mod.__name__} import {name}"]})
    except Exception as e:  # noqa: BLE001
        skipped.append(("transformers", f"import failed: {type(e).__name__}: {e}"))
    Path(out_path).write_text(json.dumps({"seeds": seeds, "skipped": skipped}))


# ==============================================================================================
# 2. Compose candidates
# ==============================================================================================
class _Cost:
    """Counts bytes moved, FLOPs, op count and bytes allocated while ops run on meta tensors."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import FlopCounterMode
        cost = self

        class Bytes(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.overloadpacket.__name__ not in env.ALLOWED_OPS:
                    ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                    outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
                    nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)
                    cost.bytes += nb(ins) + nb(outs)
                    cost.alloc += nb(outs)
                    cost.ops += 1
                return out

        self.bytes = self.alloc = self.ops = 0
        self.flop_mode = FlopCounterMode(display=False)
        self.modes = (self.flop_mode, Bytes())


def meta_run(seeds_by_name: dict, steps: list[dict], shape: tuple, backend: str | None = None):
    """Run the chain on a meta tensor of `shape`. Returns (output shape, est. eager ms, est. bytes touched).
    Per op: max(bytes / bandwidth, FLOPs / peak, elements x the op's mined CPU ns/element [/ GPU_SPEEDUP])
    plus a launch overhead per aten op: a rough roofline, good enough to aim inside a 100x window."""
    import torch
    ns = _namespace(torch)
    x = torch.empty(shape, device="meta")
    cost = _Cost() if backend else None
    est = 0.0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if cost:
            for m in cost.modes:
                m.__enter__()
        try:
            for st in steps:
                seed = seeds_by_name[st["name"]]
                if cost:
                    b0, f0, o0, n_in = cost.bytes, cost.flop_mode.get_total_flops(), cost.ops, x.numel()
                x = eval_op(seed, st["expr"], ns, "meta")(x)
                if cost:
                    bw, peak, overhead = ROOFLINE[backend]
                    per_elem = seed.get("ns_per_elem", 0.0) * 1e-9 / (GPU_SPEEDUP if backend == "cuda" else 1)
                    est += max((cost.bytes - b0) / bw, (cost.flop_mode.get_total_flops() - f0) / peak, n_in * per_elem)
                    est += (cost.ops - o0) * overhead
        finally:
            if cost:
                for m in reversed(cost.modes):
                    m.__exit__(None, None, None)
    if not isinstance(x, torch.Tensor):
        raise ValueError("chain output is not a tensor")
    if not cost:
        return tuple(x.shape), None, None
    nbytes = math.prod(shape) * 4 + cost.alloc
    return tuple(x.shape), est * 1e3, nbytes


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


def compose_one(index: int, seeds: list[dict], seeds_by_name: dict, cfg: Config, backend: str) -> dict:
    """Candidate number `index` of the stream (deterministic in (seed, index)). Returns a candidate dict,
    or {"drop": reason}."""
    rng = random.Random(f"{cfg.seed}-{index}")
    mix = {k: v for k, v in PAPER_MIX.items() if k == "transformers" or int(k.split("#")[1]) <= cfg.max_ops}
    source = rng.choices(list(mix), weights=list(mix.values()))[0]
    if source == "transformers":
        n_ops = rng.choices(range(1, cfg.max_ops + 1), weights=[PAPER_MIX[f"torch#{k}"] for k in range(1, cfg.max_ops + 1)])[0]
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
            seed = rng.choice(pool)
            if len(cur) not in seed["ranks"]:
                continue
            try:
                expr = build_op(seed, cur, rng)
                out, _, _ = meta_run(seeds_by_name, [{"name": seed["name"], "expr": expr}], cur)
            except Exception:  # noqa: BLE001 - does not fit this shape: try another seed
                continue
            if len(out) < 2 and i < n_ops - 1:
                continue  # a scalar (or 1-d) output ends a chain; only allowed last
            if math.prod(out) < 1:
                continue
            steps.append({"name": seed["name"], "expr": expr})
            cur = out
            break
        else:
            return {"drop": "no seed fits the intermediate shape"}
    # Size the task: double BATCH while the roofline estimate stays under the target and memory cap.
    lo, hi = cfg.window_ms
    target = lo * (hi / lo) ** 0.3
    best = None
    for k in range(0, 21):
        sh = (2 ** k,) + shape[1:]
        try:
            _, est, nbytes = meta_run(seeds_by_name, steps, sh, backend)
        except Exception:  # noqa: BLE001 - batch size changes a shape the chain depends on
            break
        if nbytes > (cfg.mem_cap_gb * 2**30 if cfg.mem_cap_gb else MEM_CAP[backend]) or est > hi:
            break
        best = (sh, est)
        if est >= target:
            break
    if best is None:
        return {"drop": "too large even at BATCH=1 (memory cap or estimated time)"}
    shape, est = best
    ops = [st["name"] for st in steps]
    ds = "transformers" if any(o.startswith("transformers.") for o in ops) else f"torch#{len(ops)}"
    return {"index": index, "ops": ops, "data_source": ds, "code": render(steps, seeds_by_name, shape),
            "shape": list(shape), "est_ms": est}


LLM_PROMPT = """Write a self-contained Python module in KernelBench format that applies these PyTorch operators \
in sequence, each to the previous one's output: {ops}.
The input is one float32 tensor of shape {shape}. Requirements: `import torch` and `import torch.nn as nn` at the top \
(and any other import an operator needs); module-level integer size constants; `class Model(nn.Module)` with \
`__init__` and `forward(self, x)`; `get_inputs()` returning a list with one `torch.randn(...)` tensor built from the \
constants; `get_init_inputs()` returning the constructor arguments (a list). Here is a correct example you may \
rewrite in your own style:
```python
{code}```
Answer with one ```python code block and nothing else."""


def _llm_code(text: str) -> str | None:
    """The first ```python block (or the whole text) if it parses and has the KernelBench names."""
    if "```" in text:
        part = text.split("```", 2)[1]
        text = part[len("python"):] if part.startswith("python") else part
    try:
        names = {n.name for n in ast.parse(text).body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    except SyntaxError:
        return None
    return text.strip() + "\n" if {"Model", "get_inputs", "get_init_inputs"} <= names else None


def compose_llm(plans: list[dict], cfg: Config, policy) -> list[dict]:
    """--composer llm: the rule composer picks the operators and a shape that fits (a plan); an LLM, through
    agent.py's policy, writes the module (as the paper did). Its code goes through the same filters; an
    answer that is not KernelBench format, or leaves out a requested operator, is dropped here."""
    import agent
    prompts = []
    for c in plans:
        msg = LLM_PROMPT.format(ops=", ".join(c["ops"]), shape=tuple(c["shape"]), code=c["code"])
        prompts.append(agent.encode(policy.tokenizer, agent.render(policy.tokenizer, [{"role": "user", "content": msg}], True)))
    answers = []
    for i in range(0, len(prompts), 64):  # batches of 64 bound the KV cache
        try:
            answers += policy.generate(prompts[i:i + 64], max_new_tokens=768, temperature=0.0)
        except Exception as e:  # noqa: BLE001 - agent.py is another component: say where it broke, in one line
            raise UsageError(f"--composer llm: agent.py's policy failed to generate ({type(e).__name__}: {str(e)[:150]})")
    out = []
    for c, ids in zip(plans, answers):
        code = _llm_code(policy.tokenizer.decode(ids, skip_special_tokens=True))
        if code is None:
            out.append({"drop": "llm answer is not a KernelBench-format module"})
        elif not all(o.split(".")[-1].split("[")[0] in code for o in c["ops"]):
            out.append({"drop": "llm answer leaves out a requested operator"})
        else:
            out.append(dict(c, code=code))
    return out


def load_composer_policy(cfg: Config):
    """agent.py's policy for --composer llm (None for the rule composer). One clear error if unusable."""
    if cfg.composer != "llm":
        return None
    try:
        import agent
        return agent.load_policy("hf", model=cfg.model)
    except env.UsageError as e:
        raise UsageError(f"--composer llm: {e}")
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"--composer llm needs agent.py's model backends, which failed: {type(e).__name__}: {str(e)[:200]}")


def compose(start: int, count: int, seeds: list[dict], cfg: Config, backend: str, seen: set, funnel: dict,
            policy=None) -> list[dict]:
    """Candidates number start..start+count-1, minus those that fail to compose or duplicate an earlier one."""
    by_name = {s["name"]: s for s in seeds}
    if cfg.family == "elementwise":  # elementwise.py composes; the filters below and after are the same
        cap = int(cfg.mem_cap_gb * 2**30) if cfg.mem_cap_gb else None
        cands = [elementwise.compose_one(i, cfg.seed, backend, cfg.window_ms, cfg.max_ops, cap) for i in range(start, start + count)]
    else:
        cands = [compose_one(i, seeds, by_name, cfg, backend) for i in range(start, start + count)]
    if policy is not None:
        plans = [c for c in cands if "drop" not in c]
        written = iter(compose_llm(plans, cfg, policy))
        cands = [c if "drop" in c else next(written) for c in cands]
    out = []
    for c in cands:
        funnel["compose"]["in"] += 1
        if "drop" in c:
            funnel["compose"]["drops"][c["drop"]] += 1
            continue
        key = structure_key(c["code"])
        if key in seen:  # same ops and structure as an earlier candidate (sizes may differ)
            funnel["compose"]["drops"]["duplicate of an earlier candidate"] += 1
            continue
        seen.add(key)
        funnel["compose"]["out"] += 1
        out.append(c)
    return out


# ==============================================================================================
# 3. Filter
# ==============================================================================================
def structure_key(code: str) -> str:
    """Duplicate key: the AST with every numeric literal replaced by 0 (same ops, any sizes)."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            node.value = 0
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def ast_tokens(code: str) -> list[str]:
    """Python-AST token sequence used for similarity: node types plus attribute/function names
    (literal values and local variable names ignored, so renaming or resizing does not hide a copy)."""
    toks = []
    for node in ast.walk(ast.parse(code)):
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
        import datasets
        try:
            ds = datasets.load_dataset("ScalingIntelligence/KernelBench")
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"cannot load the KernelBench dataset from the hub (offline?): {type(e).__name__}")
        files = [(f"{split}/{r['name']}", r["code"]) for split in ds for r in ds[split]]
    else:
        p = Path(path)
        if not p.is_dir():
            raise UsageError(f"--kernelbench-dir {path} is not a directory")
        files = [(str(f.relative_to(p)), f.read_text(errors="replace")) for f in sorted(p.rglob("*.py"))]
    out = []
    for name, code in files:
        try:
            out.append((name, ast_tokens(code)))
        except SyntaxError:
            continue
    if not out:
        raise UsageError(f"--kernelbench-dir {path} holds no parseable .py files")
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


def filter_similar(cands: list[dict], kb, cfg: Config, funnel: dict) -> list[dict]:
    keep = []
    for c in cands:
        funnel["similarity"]["in"] += 1
        sim, name = most_similar(c["code"], kb, cfg.similarity) if kb else (0.0, "")
        if sim > cfg.similarity:
            funnel["similarity"]["drops"]["AST similarity > %.2f to a KernelBench file" % cfg.similarity] += 1
            c["drop"] = f"AST similarity {sim:.2f} to KernelBench {name}"
            continue
        funnel["similarity"]["out"] += 1
        keep.append(c)
    return keep


def result_key(c: dict, cfg: Config, backend: str) -> str:
    blob = json.dumps([c["code"], backend, list(cfg.window_ms), cfg.n_timed, cfg.task_timeout_s])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def filter_by_execution(stream, cfg: Config, backend: str, resume_file: Path | None = None, need: int = 0) -> dict:
    """Check candidates from `stream` (any iterable, read in order) in `workers` sandboxed children (Checker),
    one candidate at a time each. Returns {result_key: result}.
    With `need`, a candidate is taken only while the tasks kept so far plus the expected yield of those being
    checked fall short of `need`: the run stops within a few candidates of `need` kept tasks, and composing
    the next candidate overlaps the checks of the earlier ones. Every candidate taken is finished, so the results
    cover a prefix of the stream: which of a seed's candidates are the first `need` kept does not depend on
    scheduling or workers, given the same verdicts. Results are appended to `resume_file` as they arrive and
    read back from it on a re-run. Raises MachineBroken when the first 20 results all failed to run."""
    from tqdm import tqdm
    done = {}
    if resume_file and resume_file.exists():
        for line in resume_file.read_text().splitlines():
            try:
                r = json.loads(line)
                done[r["key"]] = r
            except (json.JSONDecodeError, KeyError):
                continue  # a line cut short by an interruption
    total = need or (len(stream) if hasattr(stream, "__len__") else None)
    stream = iter(stream)
    bar = tqdm(total=total, desc="filter", unit="task" if need else "cand", file=sys.stderr)
    sink = open(resume_file, "a") if resume_file else None
    stop_r, stop_w = os.pipe()  # children exit when the write end closes: we finished, were interrupted or killed
    stopping = threading.Event()
    cond, pulling = threading.Condition(), threading.Lock()
    n = {"kept": 0, "finished": 0, "running": 0, "end": False}  # running: taken, not yet finished
    results = []  # this run's, in the order they finished (for the broken-machine check)
    rate = lambda: (n["kept"] + 3) / (n["finished"] + 5)  # the yield so far, from a prior of 60%

    def record(r, fresh=True):
        with cond:
            if fresh:
                done[r["key"]] = r
                n["running"] -= 1
                if sink:
                    sink.write(json.dumps(r) + "\n")
                    sink.flush()
            results.append(r)
            n["finished"] += 1
            n["kept"] += bool(r["kept"])
            if len(results) == 20 and machine_broken(results):
                n["end"] = True
            bar.update(int(r["kept"]) if need else 1)
            bar.set_postfix_str(f"{n['finished']} checked, yield {100 * rate():.0f}%", refresh=False)
            cond.notify_all()

    def take() -> dict | None:
        """The next candidate to check, None when there is nothing left to do."""
        with cond:
            while True:
                if n["end"] or stopping.is_set() or (need and n["kept"] >= need):
                    return None
                if not need or n["running"] == 0 or n["kept"] + rate() * n["running"] < need:
                    break
                cond.wait()  # enough are being checked, if they keep the yield: wait for a result
            n["running"] += 1
        enough = lambda: n["end"] or stopping.is_set() or (need and n["kept"] >= need)
        with pulling:  # (a generator: one thread at a time; while this one waited, enough may have come)
            while not enough():
                c = next(stream, None)
                if c is None:  # the stream ran out
                    n["end"] = True
                    break
                k = result_key(c, cfg, backend)
                if k not in done:
                    return dict(c, key=k)
                record(done[k], fresh=False)  # checked by an earlier, interrupted run
        with cond:
            n["running"] -= 1
            cond.notify_all()
        return None

    def worker():
        checker = None
        try:
            while (c := take()) is not None:
                checker = checker or Checker(cfg, backend, stop_r)
                r = checker.check(c)
                if not r["kept"] and r["drop"].startswith("child process") and "timed out" not in r["drop"]:
                    # the child died on it: maybe of something an earlier candidate left behind (a thread, a
                    # memory limit). A fresh child tries once more; a crash that is the candidate's comes back.
                    checker.close()
                    checker = Checker(cfg, backend, stop_r)
                    r = checker.check(c)
                if stopping.is_set():
                    return  # killed by us: nothing to blame on the candidate
                record(r)
                # a fresh child after a crash, after a CUDA error (it can leave the context unusable), and now and
                # then (what a long-lived process accumulates is not worth finding out)
                if checker.dead or "CUDA error" in r.get("drop", "") or checker.n >= Checker.MAX_TASKS:
                    checker.close()
                    checker = None
        finally:
            if checker:
                checker.close()

    try:
        with ThreadPoolExecutor(max(1, cfg.workers)) as pool:
            try:
                for f in as_completed([pool.submit(worker) for _ in range(max(1, cfg.workers))]):
                    f.result()
                if len(results) >= 20 and machine_broken(results[:20]):
                    raise MachineBroken(f"all of the first 20 candidates checked failed to run (e.g. "
                                        f"{results[0]['drop'][:300]})")
            except MachineBroken:
                raise
            except BaseException:  # Ctrl-C (or a bug): stop the children now, keep what was recorded
                stopping.set()
                with cond:
                    cond.notify_all()
                os.close(stop_w)
                stop_w = None
                raise
    finally:
        bar.close()
        for fd in (stop_r, stop_w):
            if fd is not None:
                os.close(fd)
        if sink:
            sink.close()
    return done


class MachineBroken(UsageError):
    pass


def machine_broken(results: list[dict]) -> bool:
    """Every one of these results failed before any filter could judge it: the machine is at fault, not the
    tasks (on the H200, children once could not start CUDA at all)."""
    return bool(results) and all(not r["kept"] and _reason_class(r["drop"]) in ("eager failed", "child process")
                                 for r in results)


class Checker:
    """One sandboxed child (env.run_sandboxed) that checks candidates one at a time, for as long as it is given
    some: the parent writes a candidate as one JSON line into a pipe, the child answers with one JSON line on
    another. Importing torch, setting up CUDA and inductor cost a child seconds, so one child serves many
    candidates. A crash ends it, and so does a hang: the parent kills its process group (a signal from inside
    would not do: in a PID namespace the child is init, which ignores the default actions, and a Python-level
    handler waits for a stuck C call). Either way the candidate it was checking gets the blame (after a retry
    in a fresh child, see filter_by_execution)."""
    MAX_TASKS = 64  # candidates per child before a fresh one

    def __init__(self, cfg: Config, backend: str, stop_fd: int):
        self.n, self.buf, self.sandbox, self.pid = 0, b"", None, None
        self.dir = tempfile.mkdtemp(prefix="synth-", dir=env.CACHE_DIR)
        lock = env.gpu_lock_path(backend)
        lock.parent.mkdir(parents=True, exist_ok=True)
        self.lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        (cand_r, self.cand_w), (self.res_r, res_w) = os.pipe(), os.pipe()
        self.fds = [self.lock_fd, cand_r, self.cand_w, self.res_r, res_w]
        self.child_fds = [self.lock_fd, cand_r, res_w]  # ours are closed once the child has them (started)
        extra, caches = env.compile_caches()  # shared by all children: each graph and jiterator kernel compiles once
        if cfg.composer == "llm":  # code an LLM wrote does not get to write caches that env.py's reference loads
            extra = {k: str(Path(self.dir, Path(v).name)) for k, v in extra.items()}
            caches = []
        # CPU: one thread per child (workers use the cores; OpenMP teams on a busy machine make timings erratic).
        threads = 1 if backend == "cpu" else max(1, (os.cpu_count() or 1) // max(1, cfg.workers))
        extra.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        # no inductor compile-worker pool per child: the workers already compile in parallel, and 12 children
        # each starting a pool of one process per core (each importing torch) would swamp the CPUs
        extra["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        if backend == "cuda":
            extra["CUDA_AGENT_NO_AS"] = "1"  # RLIMIT_AS breaks CUDA's address-space reservations
        self.timeout = cfg.task_timeout_s or (60 if backend == "cuda" else 150)
        self.lock_limit = min(15.0, self.timeout / 2)  # a legitimate task holds the lock for a second or three
        spec = {"dir": str(Path(self.dir).resolve()), "backend": backend, "window_ms": list(cfg.window_ms),
                "n_timed": cfg.n_timed, "min_timed_s": cfg.min_timed_s, "threads": threads,
                "lock_fd": self.lock_fd, "stop_fd": stop_fd, "in_fd": cand_r, "out_fd": res_w}
        Path(self.dir, "spec.json").write_text(json.dumps(spec))
        argv = [sys.executable, "-E", "-B", str(Path(__file__).resolve()), "_filter", str(Path(self.dir, "spec.json").resolve())]
        # (the wall-clock limit only backs up check()'s per-candidate one: importing torch, then MAX_TASKS candidates)
        kw = dict(timeout=300 + self.timeout * self.MAX_TASKS, writable=caches, mem_gb=16.0, env=extra,
                  pass_fds=[self.lock_fd, stop_fd, cand_r, res_w], kind=backend,  # kind: CUDA-safe namespaces
                  started=self._started)

        def run():
            self.sandbox = env.run_sandboxed(argv, self.dir, **kw)
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def _started(self, pid: int):
        """The child runs, with its copies of the pipe ends and the lock: drop ours, so that the lock goes with
        the child (a flock belongs to the open file, which we would otherwise keep open)."""
        self.pid = pid
        for fd in self.child_fds:
            os.close(fd)
            self.fds.remove(fd)

    def check(self, cand: dict) -> dict:
        """The child's verdict on `cand`, or a drop saying why the child died on it. Two deadlines: `timeout` s
        of work on the candidate, not counting the wait for the device lock (the other workers' turns), and
        `lock_limit` s under the lock at a time (every worker waits meanwhile). The child tells its lock state
        on the same pipe as its answers: {"state": "wait" | "hold" | "run"} lines."""
        os.write(self.cand_w, (json.dumps(cand) + "\n").encode())
        self.n += 1
        limit = self.timeout + (120 if self.n == 1 else 0)  # a child's first also waits for torch and CUDA to start
        state, since, used, killed = "run", time.monotonic(), 0.0, None  # used: seconds of work before `since`
        held_from = None  # wall clock, for the turn of a child killed under the lock (lock_use)
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue  # not ours (the child writes nothing else here)
                if "state" not in msg:
                    if killed:  # answered just as it was killed: wait until it is gone, so it is not reused
                        self.thread.join()
                    return msg
                now = time.monotonic()
                used += now - since if state != "wait" else 0.0
                state, since = msg["state"], now
                held_from = time.time() if state == "hold" else None
            alive = self.thread.is_alive()  # (read before the pipe: an answer written just before dying counts)
            if select.select([self.res_r], [], [], 0.2 if alive else 0)[0]:
                chunk = os.read(self.res_r, 1 << 16)
                if chunk:
                    self.buf += chunk
                    continue
                self.thread.join()  # end of the pipe: the child is gone; run_sandboxed is reaping it
                alive = False
            if not alive:
                r = self.sandbox
                # its last words about this candidate (the child marks where each one starts in stderr)
                said = r.stderr.split(f"synth: checking {cand['key']}\n")[-1].strip() if r else ""
                tail = said.splitlines()[-1][:200] if said else ""
                why = (r.crash if r else None) or f"exited with code {r.returncode if r else '?'}"
                held = [[held_from, held_from, time.time()]] if held_from else []  # it died holding the lock
                return {"key": cand["key"], "kept": False, "drop": killed or f"child process {why}" +
                        (f": {tail}" if tail else ""), "turns": held, "t": {"locked": held[0][2] - held_from if held else 0.0}}
            now = time.monotonic()
            if killed is None and self.pid:
                if state == "hold" and now - since > self.lock_limit:  # everyone waits: end it
                    killed = f"too slow: over {self.lock_limit:g} s under the device lock (its child was killed)"
                elif state != "wait" and used + now - since > limit:
                    killed = f"child process timed out: its checks took over {self.timeout} s"
                if killed:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.pid, signal.SIGKILL)

    @property
    def dead(self) -> bool:
        return not self.thread.is_alive()

    def close(self):
        os.close(self.cand_w)  # EOF: the child exits
        self.fds.remove(self.cand_w)
        self.thread.join(10)
        if self.thread.is_alive() and self.pid:  # stuck (in a C call, or after a Ctrl-C): end it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self.thread.join()
        for fd in self.fds:
            os.close(fd)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def _locked(fd, spent: dict, tell=lambda state: None):
    """Holds the device lock; adds the seconds spent waiting for it and holding it to spent["wait"] and
    spent["locked"]; tell(state) says so to the parent (Checker.check's deadlines)."""
    tell("wait")
    t0 = time.time()
    fcntl.flock(fd, fcntl.LOCK_EX)
    t1 = time.time()
    tell("hold")
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        tell("run")
        t2 = time.time()
        spent["wait"] += t1 - t0
        spent["locked"] += t2 - t1
        spent.setdefault("turns", []).append((t0, t1, t2))  # wall clock: lock_use() compares children


def check_task(code: str, spec: dict, torch, lock_fd, spent: dict, tell=lambda state: None, facts=None) -> dict:
    """The execution filter for one task, inside the child. Returns {"kept": bool, "drop": why, ...}.
    Cheap checks first, torch.compile (seconds) last. Adds where the time went to `spent` (seconds: setup, the
    warm-up runs, lock wait, locked device work and the first run within it, compile), so the funnel can name the
    bottleneck; `facts` receives the estimate from a few rows ("row_est_ms"), which the funnel checks."""
    import importlib.util
    t0 = time.perf_counter()
    device = torch.device("cuda" if spec["backend"] == "cuda" else "cpu")
    lo, hi = spec["window_ms"]
    path = Path(spec["dir"]) / f"task_{uuid.uuid4().hex[:8]}.py"  # absolute: the sandbox re-mounts the cwd
    path.write_text(code)
    try:
        s = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
        with torch.device(device):
            torch.manual_seed(0)
            model = mod.Model(*mod.get_init_inputs()).eval()

            def inputs(seed):  # created on the device directly (CPU randn of GBs is slow)
                torch.manual_seed(seed)
                return [x.to(device) if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]
            sets = [inputs(s) for s in (1, 2, 3)]
    except Exception as e:  # noqa: BLE001
        return {"kept": False, "drop": f"eager failed: {type(e).__name__}: {str(e)[:120]}"}
    finally:
        spent["setup"] = time.perf_counter() - t0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    leaves = lambda o: [t for t in (o if isinstance(o, (tuple, list)) else [o])]

    def close(a, b, tol, full=False):
        """allclose of every output in float32 (no copy for float32 outputs: CUDA tasks are GBs, and the
        tolerances 1e-2 and 1e-5 are far above float32's precision). Unless full, on a strided sample of about
        2^20 elements (a view; an odd step, so that power-of-two rows do not alias to one column): the checks
        under the device lock would otherwise take longer than the runs."""
        pick = lambda x: x if full else x.reshape(-1)[::max(1, x.numel() >> 20) | 1]
        return all(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and
                   torch.allclose(pick(x).float(), pick(y).float(), atol=tol, rtol=tol, equal_nan=True)
                   for x, y in zip(leaves(a), leaves(b)))
    # Outside the device lock, runs on the first rows of the batch (BATCH, the size compose grows, is free).
    # A first run on one row and on k rows compiles the task's jiterator kernels (torch.special functions: seconds
    # each), loads its CUDA modules and picks its algorithms, so that the locked section runs kernels, not
    # compilers. Timed runs on 1 and k rows then extrapolate to the whole batch: a task far too slow for the
    # window is dropped before it takes the lock from every other worker (on the H200, a task ending in
    # `linalg.svdvals` held it for 27 s). Launch-bound rows extrapolate flat, so only a real per-row
    # cost adds up; k >= BATCH/64 bounds how much a timing error is magnified, k <= BATCH/4 keeps these runs a
    # fraction of the task's device work (they are not under the lock), and the fastest of three runs keeps
    # other processes' device work out of the timing. Best effort: a forward that needs the whole batch skips
    # the estimate.
    t0, est, warmed, t_first = time.perf_counter(), None, False, 0.0
    if all(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] > 1 for x in sets[0]):
        batch = min(x.shape[0] for x in sets[0])
        k = min(max(64, batch // 64), max(2, batch // 4))

        def rows(n):  # seconds for one run on the first n rows
            sync()
            t = time.perf_counter()
            model(*[x[:n] for x in sets[0]])
            sync()
            return time.perf_counter() - t
        with contextlib.suppress(Exception), torch.no_grad():
            rows(1)
            warmed = True
            # k <= a quarter of the batch already over twice the window (2x: room for a first call's set-up) is
            # too slow for certain, so the timed runs are skipped: on the H200, 14 of 1,295 candidates (linalg
            # ops such as one SVD of a 262,144 x 1,024 input) ran into the 60 s task timeout
            if batch >= 4 and (t_first := rows(k)) * 1e3 <= 2 * hi:  # (batch < 4: k rows would be most of it)
                t1, tk = min(rows(1) for _ in range(3)), min(rows(k) for _ in range(3))
                est = (t1 + (tk - t1) * (batch - 1) / (k - 1)) * 1e3
                if facts is not None:
                    facts["row_est_ms"] = round(est, 4)
    if not warmed:  # a batch of one row, or a forward that needs the whole batch: one untimed run of the whole
        with contextlib.suppress(Exception), torch.no_grad():  # task outside the lock still keeps compilers out
            model(*sets[0])
            sync()
    spent["warm"] = time.perf_counter() - t0
    if t_first * 1e3 > 2 * hi:
        return {"kept": False, "drop": f"too slow: eager over {hi:g} ms ({k} of {batch} rows took {t_first * 1e3:.3g} ms)",
                "eager_ms": t_first * 1e3}
    if est is not None and est > 10 * hi:
        return {"kept": False, "drop": f"too slow: eager about {est:.3g} ms (from {k} rows) > {hi:g} ms", "eager_ms": est}
    try:
        with _locked(lock_fd, spent, tell):  # all timed/measured device work of this task, one task at a time
            with torch.no_grad():
                t0 = time.perf_counter()
                outs = [model(*sets[0])]  # untimed: a first call may still set things up
                sync()
                t_once = time.perf_counter()
                spent["first"] = t_once - t0
                again = model(*sets[0])
                sync()
                t_once = (time.perf_counter() - t_once) * 1e3  # one run: skips everything else when far outside
                if t_once > 3 * hi:
                    return {"kept": False, "drop": f"too slow: eager {t_once:.3g} ms (one run) > {hi:g} ms", "eager_ms": t_once}
                if t_once < lo / 4:  # (the timed runs below start from a flushed L2, so they may be slower, not 4x)
                    return {"kept": False, "drop": f"too fast: eager {t_once:.3g} ms (one run) < {lo:g} ms", "eager_ms": t_once}
                outs += [model(*x) for x in sets[1:]]
            if not all(isinstance(t, torch.Tensor) for o in outs for t in leaves(o)):
                return {"kept": False, "drop": "output is not a tensor"}
            if not close(outs[0], again, 1e-5):
                return {"kept": False, "drop": "nondeterministic: the same input gives different outputs"}
            if not all(bool(torch.isfinite(t).all()) for o in outs for t in leaves(o) if t.is_floating_point()):
                return {"kept": False, "drop": "non-finite output (nan/inf)"}
            if close(outs[0], outs[1], 1e-2) and close(outs[0], outs[2], 1e-2):
                return {"kept": False, "drop": "constant output: the same for different inputs"}
            if all(any(close(o, xi, 1e-2) for xi in x if isinstance(xi, torch.Tensor)) for o, x in zip(outs, sets)):
                return {"kept": False, "drop": "output equals its input (the op is the identity on these inputs)"}
            del sets[2], outs[2], again  # device memory: keep only what the compile check needs
            eager_ms, _ = env.time_callable(model, sets[:2], n_timed=spec["n_timed"], min_s=spec["min_timed_s"], warmup=0)
        if eager_ms < lo:
            return {"kept": False, "drop": f"too fast: eager {eager_ms:.3g} ms < {lo:g} ms", "eager_ms": eager_ms}
        if eager_ms > hi:
            return {"kept": False, "drop": f"too slow: eager {eager_ms:.3g} ms > {hi:g} ms", "eager_ms": eager_ms}
    except Exception as e:  # noqa: BLE001
        return {"kept": False, "drop": f"eager failed: {type(e).__name__}: {str(e)[:120]}"}
    try:
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        with torch.no_grad():
            c_outs = [compiled(*x) for x in sets[:2]]  # the first call compiles (outside the lock: CPU work)
            sync()
        spent["compile"] = time.perf_counter() - t0
        for i in range(2):
            if not close(c_outs[i], outs[i], 1e-2, full=True):
                return {"kept": False, "drop": "torch.compile disagrees with eager", "eager_ms": eager_ms}
        with _locked(lock_fd, spent, tell):
            compile_ms, _ = env.time_callable(compiled, sets[:2], n_timed=spec["n_timed"], min_s=spec["min_timed_s"], warmup=0)
    except Exception as e:  # noqa: BLE001
        return {"kept": False, "drop": f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}",
                "eager_ms": eager_ms}
    finally:
        torch._dynamo.reset()  # forget this graph: one child checks many tasks
    return {"kept": True, "eager_ms": round(eager_ms, 4), "compile_ms": round(compile_ms, 4)}


def _filter_child(spec_path: str):
    """Runs in a sandboxed child (Checker): check each candidate read from the input pipe, answer each with
    one JSON line, until the pipe closes."""
    import warnings
    warnings.filterwarnings("ignore")
    spec = json.loads(Path(spec_path).read_text())

    def watchdog():  # EOF on the stop pipe: the parent is gone or stopping
        os.read(spec["stop_fd"], 1)
        os._exit(3)
    threading.Thread(target=watchdog, daemon=True).start()
    t0 = time.perf_counter()
    import torch
    torch.set_num_threads(spec["threads"])
    env._SYNC = torch.cuda.synchronize
    if spec["backend"] == "cuda":  # create the CUDA context and the cuBLAS/cuDNN handles now, outside the device
        x = torch.randn(64, 64, device="cuda")  # lock: the first task's first run would pay for them under it
        float((x @ x).sum() + torch.nn.functional.conv2d(x[None, None], x[None, None, :3, :3]).sum())
    start = time.perf_counter() - t0  # importing torch (and CUDA set-up): charged to the first candidate
    with os.fdopen(spec["in_fd"], "rb") as cands, os.fdopen(spec["out_fd"], "wb", buffering=0) as out:
        say = lambda msg: out.write((json.dumps(msg) + "\n").encode())
        while line := cands.readline():
            c = json.loads(line)
            print(f"synth: checking {c['key']}", file=sys.stderr, flush=True)  # (Checker.check: last words)
            spent = {"start": start, "setup": 0.0, "warm": 0.0, "wait": 0.0, "locked": 0.0, "first": 0.0, "compile": 0.0}
            facts = {}
            r = check_task(c["code"], spec, torch, spec["lock_fd"], spent, lambda state: say({"state": state}), facts)
            start = 0.0
            turns = spent.pop("turns", [])  # (asked, got, released) wall-clock times of its lock turns
            say(dict(r, **facts, key=c["key"], t={k: round(v, 3) for k, v in spent.items()}, turns=turns))
            if spec["backend"] == "cuda":
                torch.cuda.empty_cache()
    sys.stdout.flush()
    os._exit(0)  # skip teardown (inductor worker pools, CUDA context)


# ==============================================================================================
# 4. Report
# ==============================================================================================
def new_funnel() -> dict:
    stage = lambda: {"in": 0, "out": 0, "drops": collections.Counter()}
    return {"compose": stage(), "similarity": stage(), "execution": stage()}


def op_source(name: str) -> str:
    """"nn.Conv2d" -> "torch.nn", "F.gelu" -> "torch.nn.functional", "torch.special.i0e" -> "torch.special"..."""
    head = name.split(".")[0]
    if head in ("nn", "F"):
        return {"nn": "torch.nn", "F": "torch.nn.functional"}[head]
    return name.rsplit(".", 1)[0] if head == "torch" else head


def diversity(rows: list[dict]) -> dict:
    """Operator histogram, ops-per-task mix next to the paper's, input sizes and eager times."""
    ops = collections.Counter(o for r in rows for o in r["ops"])
    mix = collections.Counter(r["data_source"] for r in rows)
    n = max(1, len(rows))
    numel = sorted(math.prod(r["input_shape"]) for r in rows) if rows else []
    eager = sorted(r["eager_ms"] for r in rows)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None
    return {"distinct_ops": len(ops), "top_ops": ops.most_common(20),
            "ops_per_source": dict(collections.Counter(op_source(o) for r in rows for o in r["ops"])),
            "mix": {k: {"ours_pct": round(100 * mix.get(k, 0) / n, 1), "paper_pct": v} for k, v in PAPER_MIX.items()},
            "input_numel": {"min": q(numel, 0), "median": q(numel, 0.5), "max": q(numel, 1.0)},
            "input_rank": dict(collections.Counter(len(r["input_shape"]) for r in rows)),
            "eager_ms": {"min": q(eager, 0), "median": q(eager, 0.5), "max": q(eager, 1.0)}}


def report(funnel: dict, div: dict, n_seeds: int, kept: int, n_train: int, n_test: int, seconds: float,
           workers: int = 1, secs: dict | None = None, diag: dict | None = None) -> str:
    lines = [f"{'stage':<12}{'in':>8}{'out':>8}  top drop reasons", f"{'mine':<12}{'':>8}{n_seeds:>8}  (seed operators)"]
    for name in ("compose", "similarity", "execution"):
        st = funnel[name]
        top = "; ".join(f"{why} ({k})" for why, k in collections.Counter(st["drops"]).most_common(4))
        lines.append(f"{name:<12}{st['in']:>8}{st['out']:>8}  {top}")
        lines += [f"{'':<28}e.g. {ex[0]}" for ex in st.get("examples", {}).values() if ex]
    lines.append(f"{'dataset':<12}{funnel['execution']['out']:>8}{kept:>8}  train {n_train} | test {n_test} | "
                 f"{seconds:.0f} s | {kept / max(seconds, 1e-9) * 3600:.0f} tasks/hour")
    if secs:
        lines.append("seconds: " + " | ".join(f"{k} {v:.1f}" for k, v in secs.items()) +
                     " (compose and similarity run inside execution, as the filter takes candidates)")
    if diag and diag["child_seconds"]:  # the bottleneck: CPU work runs `workers` at a time, device work one at a time
        n, cs = max(1, funnel["execution"]["in"]), diag["child_seconds"]
        lines.append(f"execution, seconds per candidate ({workers} workers): " + " | ".join(
            f"{k} {cs.get(k, 0) / n:.2f}" for k in ("start", "setup", "warm", "wait", "locked", "first", "compile")) +
            " (start: importing torch and CUDA set-up; warm: runs on a few rows outside the lock; wait: for the device"
            " lock; locked: eager/compile runs, checks, timing; first: the first full run, within locked)")
        lock, est = diag["lock"], diag["row_estimate"]
        lines.append(f"device lock: held {lock['held_s']:.0f} s of {lock['span_s']:.0f} s; waited for while free "
                     f"{lock['waited_while_free_s']:.1f} s")
        if est["n"]:
            lines.append(f"estimate from a few rows / measured eager time ({est['n']} tasks): median "
                         f"{est['median_ratio']}, p95 {est['p95_ratio']}, max {est['max_ratio']} (a task estimated over"
                         f" 10x the window is dropped)")
        lines.append("longest turns under the lock: " + "; ".join(
            f"{x['locked_s']:.1f} s (first run {x['first_run_s']:.1f} s) {' -> '.join(x['ops'])}: {x['verdict'][:60]}"
            for x in diag["longest_locked"][:3]))
    mix = " | ".join(f"{k} {v['ours_pct']}% (paper {v['paper_pct']}%)" for k, v in div["mix"].items())
    lines += [f"mix: {mix}", "ops by source: " + ", ".join(f"{k} {v}" for k, v in sorted(div["ops_per_source"].items())),
              f"distinct ops {div['distinct_ops']}; top: " + ", ".join(f"{o} {c}" for o, c in div["top_ops"][:8]),
              f"input elements min/median/max {div['input_numel']['min']}/{div['input_numel']['median']}/{div['input_numel']['max']}"
              f" | ranks {div['input_rank']} | eager ms min/median/max {div['eager_ms']['min']}/{div['eager_ms']['median']}/"
              f"{div['eager_ms']['max']}"]
    return "\n".join(lines)


# ==============================================================================================
# Output: save and load
# ==============================================================================================
def _features():
    import datasets
    return datasets.Features({"ops": datasets.List(datasets.Value("string")), "data_source": datasets.Value("string"),
                              "code": datasets.Value("string"), "eager_ms": datasets.Value("float64"),
                              "compile_ms": datasets.Value("float64")})


def save(rows: list[dict], out: Path, work: Path, cfg: Config, funnel_json: dict):
    """Split, save under work/, then swap into `out` (an interrupted run never leaves a half-written DIR)."""
    import datasets
    datasets.disable_progress_bars()
    rng = random.Random(cfg.seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    n_test = 0 if len(rows) < 2 else max(1, round(len(rows) * cfg.test_share))
    cols = lambda idx: [{k: rows[i][k] for k in ("ops", "data_source", "code", "eager_ms", "compile_ms")} for i in sorted(idx)]
    splits = {"train": order[n_test:], "test": order[:n_test]}
    # (an empty split is left out: datasets cannot load one back; load_tasks returns it empty)
    dd = datasets.DatasetDict({k: datasets.Dataset.from_list(cols(idx), features=_features()) for k, idx in splits.items() if idx})
    stage = work / "dataset"
    if stage.exists():
        shutil.rmtree(stage)
    dd.save_to_disk(str(stage))
    (stage / "funnel.json").write_text(json.dumps(funnel_json, indent=1))
    old = out.with_name(out.name + f".old-{uuid.uuid4().hex[:6]}")
    if out.exists():
        os.replace(out, old)
    os.replace(stage, out)
    shutil.rmtree(old, ignore_errors=True)
    return len(rows) - n_test, n_test


def load_tasks(path_or_hub_id: str, split: str = "train"):
    """A `datasets.Dataset` of tasks (columns ops, data_source, code, eager_ms, compile_ms) from a synth.py
    output folder or from the hub (e.g. HUB_ID, needs network; it has one split, so "test" is a fixed 5% of it)."""
    import datasets
    p = Path(path_or_hub_id)
    if p.exists():
        if not (p / "dataset_dict.json").exists():
            raise UsageError(f"{p} is not a synth.py output (no dataset_dict.json)")
        dd = datasets.load_from_disk(str(p))
        if split not in dd and split in ("train", "test"):  # saved without rows (see save())
            return datasets.Dataset.from_dict({k: [] for k in _features()}, features=_features())
        if split not in dd:
            raise UsageError(f"{p} has no split {split!r} (has {', '.join(dd)})")
        return dd[split]
    try:
        dd = datasets.load_dataset(path_or_hub_id)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"cannot load {path_or_hub_id!r}: not a folder, and the hub failed ({type(e).__name__})")
    if split not in dd:
        parts = dd["train"].train_test_split(test_size=0.05, seed=0)
        dd = {"train": parts["train"], "test": parts["test"]}
        if split not in dd:
            raise UsageError(f"{path_or_hub_id} has no split {split!r}")
    ds = dd[split]
    if "ops" in ds.column_names and ds.features["ops"].dtype == "string":  # a list stored as text
        ds = ds.map(lambda r: {"ops": list(ast.literal_eval(r["ops"])) if r["ops"].startswith("[") else [r["ops"]]})
    for col in ("eager_ms", "compile_ms"):
        if col not in ds.column_names:
            ds = ds.add_column(col, [None] * len(ds))
    return ds


# ==============================================================================================
# Command line
# ==============================================================================================
def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description="synthesise KernelBench-format training tasks (CUDA-Agent-Ops style)",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[0])
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, help="output folder (a datasets.DatasetDict)")
    g.add_argument("--num-tasks", type=int, default=Config.num_tasks)
    g.add_argument("--test-share", type=float, default=Config.test_share)
    g = p.add_argument_group("composition")
    g.add_argument("--max-ops", type=int, default=Config.max_ops)
    g.add_argument("--seed", type=int, default=Config.seed)
    g.add_argument("--family", default="paper", choices=["paper", "elementwise"],
                   help="paper: chains of mined torch ops (the paper's mix); elementwise: elementwise.py's fused chains")
    g.add_argument("--composer", default="rule", choices=["rule", "llm"])
    g.add_argument("--model", default=None, help="model for --composer llm")
    g = p.add_argument_group("filters")
    g.add_argument("--backend", default="auto")
    g.add_argument("--workers", type=int, default=1)
    g.add_argument("--kernelbench-dir", default=None, help="folder of KernelBench-format .py files (or 'hub')")
    g.add_argument("--window-ms", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="eager-time window (default 1 100 on CUDA, 0.1 10 on CPU)")
    g.add_argument("--similarity", type=float, default=Config.similarity)
    g.add_argument("--task-timeout", type=int, default=0, help="seconds one candidate's checks may take (0: 60 CUDA, 150 CPU)")
    g.add_argument("--max-candidates", type=int, default=0)
    g.add_argument("--mem-cap-gb", type=float, default=0.0,
                   help="memory one task may touch, which bounds sizes (0: 4 on CUDA, 0.25 on CPU; each worker holds ~3x)")
    a = p.parse_args(argv)
    cfg = Config(out=a.out, num_tasks=a.num_tasks, max_ops=a.max_ops, backend=a.backend, seed=a.seed, workers=a.workers,
                 kernelbench_dir=a.kernelbench_dir, composer=a.composer, family=a.family, model=a.model, test_share=a.test_share,
                 window_ms=tuple(a.window_ms) if a.window_ms else None, similarity=a.similarity, task_timeout_s=a.task_timeout,
                 max_candidates=a.max_candidates, mem_cap_gb=a.mem_cap_gb)
    return cfg


def validate(cfg: Config) -> tuple[Path, str]:
    """Check every input before any work; raise UsageError with one readable line."""
    if cfg.num_tasks < 1:
        raise UsageError(f"--num-tasks must be >= 1 (got {cfg.num_tasks})")
    if not 1 <= cfg.max_ops <= 5:
        raise UsageError(f"--max-ops must be between 1 and 5 (got {cfg.max_ops})")
    if cfg.workers < 1:
        raise UsageError(f"--workers must be >= 1 (got {cfg.workers})")
    if not 0 <= cfg.test_share < 1:
        raise UsageError(f"--test-share must be in [0, 1) (got {cfg.test_share})")
    if cfg.family == "elementwise" and cfg.composer == "llm":
        raise UsageError("--composer llm rewrites the paper family's plans; use it without --family elementwise")
    if cfg.window_ms and not 0 < cfg.window_ms[0] < cfg.window_ms[1]:
        raise UsageError(f"--window-ms needs 0 < LO < HI (got {cfg.window_ms})")
    if cfg.kernelbench_dir and cfg.kernelbench_dir != "hub" and not Path(cfg.kernelbench_dir).is_dir():
        raise UsageError(f"--kernelbench-dir {cfg.kernelbench_dir} does not exist or is not a directory")
    out = Path(cfg.out).resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {cfg.out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not (out / "funnel.json").exists():
        raise UsageError(f"--out {cfg.out} is a non-empty folder that synth.py did not write; refusing to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".synth-write-test-{uuid.uuid4().hex[:6]}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out {cfg.out} is not writable ({e.strerror or e})")
    backend = env.resolve_backend(cfg.backend)
    if cfg.window_ms is None:
        cfg.window_ms = (1.0, 100.0) if backend == "cuda" else (0.1, 10.0)
    return out, backend


def main(argv=None) -> int:
    t0 = time.time()
    try:
        cfg = parse_args(argv)
        out, backend = validate(cfg)
        kb = load_kernelbench(cfg.kernelbench_dir)
        policy = load_composer_policy(cfg)
    except UsageError as e:
        print(f"synth.py: error: {e}", file=sys.stderr)
        return 2
    work = out.with_name(out.name + ".partial")  # resumable state; removed after a successful run
    work.mkdir(exist_ok=True)
    print(f"synth | out {out} | family {cfg.family} | tasks {cfg.num_tasks} | max ops {cfg.max_ops} | backend {backend} | workers {cfg.workers}"
          f" | window {cfg.window_ms[0]:g}-{cfg.window_ms[1]:g} ms | seed {cfg.seed} | kernelbench files {len(kb)}", flush=True)
    if not kb:
        print("filter: no --kernelbench-dir given: the KernelBench similarity filter is off", flush=True)

    try:
        return run(cfg, out, backend, kb, work, t0, policy)
    except UsageError as e:
        print(f"synth.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        n = len((work / "filtered.jsonl").read_text().splitlines()) if (work / "filtered.jsonl").exists() else 0
        print(f"synth.py: interrupted; {n} filter results kept in {work}; {out} untouched. Re-run the same command to resume.",
              file=sys.stderr)
        return 130


def candidate_stream(seeds: list[dict], cfg: Config, backend: str, kb, funnel: dict, secs: dict, taken: list,
                     policy=None):
    """Candidates in index order, composed as the filter takes them, minus compose failures, duplicates and
    KernelBench look-alikes (counted in `funnel`, their seconds added to `secs`). Appends each one it yields
    to `taken`."""
    max_cands = cfg.max_candidates or 20 * cfg.num_tasks + 50
    seen, chunk = set(), 16 if policy is not None else 1  # the LLM composer answers a batch of plans at a time
    for start in range(0, max_cands, chunk):
        t0 = time.time()
        cands = compose(start, min(chunk, max_cands - start), seeds, cfg, backend, seen, funnel, policy)
        t1 = time.time()
        cands = filter_similar(cands, kb, cfg, funnel)
        secs["compose"] += t1 - t0
        secs["similarity"] += time.time() - t1
        for c in cands:
            taken.append(c)
            yield c


def run(cfg: Config, out: Path, backend: str, kb: list, work: Path, t0: float, policy=None) -> int:
    """mine -> compose -> filter (one stream: composing overlaps the checks) -> save + report."""
    seeds = mine_seeds() if cfg.family == "paper" else []                       # 1. mine (elementwise: its op table)
    funnel, taken, kept_rows = new_funnel(), [], {}
    secs = {"mine": round(time.time() - t0, 1), "compose": 0.0, "similarity": 0.0, "execution": 0.0}
    stream = candidate_stream(seeds, cfg, backend, kb, funnel, secs, taken, policy)  # 2. compose, 3a. cheap filters
    t = time.time()
    try:
        results = filter_by_execution(stream, cfg, backend, work / "filtered.jsonl", need=cfg.num_tasks)  # 3b. execution
    except MachineBroken as e:
        shutil.rmtree(work, ignore_errors=True)  # these verdicts blame the machine: a re-run must not reuse them
        raise UsageError(f"{e}; check that the {backend} backend works in env.py's sandbox on this machine")
    secs["execution"] = time.time() - t  # (composing and the cheap filters run inside it, as candidates are taken)
    checked = [results[result_key(c, cfg, backend)] for c in taken]
    for c, r in zip(taken, checked):
        funnel["execution"]["in"] += 1
        if r["kept"]:
            funnel["execution"]["out"] += 1
            kept_rows[c["index"]] = dict(ops=c["ops"], data_source=c["data_source"], code=c["code"],
                                         eager_ms=r["eager_ms"], compile_ms=r["compile_ms"], input_shape=c["shape"])
        else:
            why = _reason_class(r["drop"])
            funnel["execution"]["drops"][why] += 1
            examples = funnel["execution"].setdefault("examples", {}).setdefault(why, [])
            if why != r["drop"] and len(examples) < 3:  # grouped reasons keep a few full messages for debugging
                examples.append(f"{' -> '.join(c['ops'])}: {r['drop'][:240]}")
    rows = [kept_rows[i] for i in sorted(kept_rows)][:cfg.num_tasks]  # first N by stream index: same seed, same set
    if len(rows) < cfg.num_tasks:
        print(f"synth.py: warning: only {len(rows)} of {cfg.num_tasks} tasks after {len(taken)} candidates", file=sys.stderr)
    div, diag = diversity(rows), filter_diagnostics(taken, checked)
    funnel_json = {"config": {k: v for k, v in dataclasses.asdict(cfg).items()}, "backend": backend,
                   "seeds": len(seeds), "stages": {k: dict(v, drops=dict(v["drops"])) for k, v in funnel.items()},
                   "kept": len(rows), "seconds": round(time.time() - t0, 1),
                   "stage_seconds": {k: round(v, 1) for k, v in secs.items()}, **diag, "diversity": div}
    n_train, n_test = save(rows, out, work, cfg, funnel_json)                 # 4. report
    shutil.rmtree(work, ignore_errors=True)
    print(report(funnel, div, len(seeds), len(rows), n_train, n_test, time.time() - t0, cfg.workers, secs, diag))
    print(f"saved {out} (train {n_train}, test {n_test}) and {out / 'funnel.json'}")
    return 0


def lock_use(turns: list) -> dict:
    """From every turn at the device lock, (asked, got, released) wall-clock times: how long the lock was held
    (the union of turns), and how long someone waited while nobody held it (should be ~0)."""
    events = sorted([(a, 0) for a, b, c in turns] + [(b, 1) for a, b, c in turns] + [(b, 2) for a, b, c in turns] +
                    [(c, 3) for a, b, c in turns])
    held = free_wait = 0.0
    holding = waiting = 0
    last = events[0][0] if events else 0.0
    for t, kind in events:
        held += (t - last) if holding else 0.0
        free_wait += (t - last) if waiting and not holding else 0.0
        last = t
        waiting += {0: 1, 1: -1}.get(kind, 0)
        holding += {2: 1, 3: -1}.get(kind, 0)
    span = (events[-1][0] - events[0][0]) if events else 0.0
    return {"span_s": round(span, 1), "held_s": round(held, 1), "waited_while_free_s": round(free_wait, 1)}


def row_estimate_quality(checked: list[dict]) -> dict:
    """How the estimate from a few rows compares with the measured eager time, on the kept tasks: the filter
    drops a task whose estimate exceeds 10x the window, so ratios near 10 would mean false drops."""
    ratios = sorted(r["row_est_ms"] / r["eager_ms"] for r in checked if r["kept"] and r.get("row_est_ms"))
    q = lambda p: round(ratios[min(len(ratios) - 1, int(p * len(ratios)))], 2) if ratios else None
    return {"n": len(ratios), "median_ratio": q(0.5), "p95_ratio": q(0.95), "max_ratio": q(1.0)}


def filter_diagnostics(taken: list, checked: list[dict]) -> dict:
    """Where the filter's time went (funnel.json and the report): seconds summed over candidates by phase,
    the device lock's use, the quality of the estimate from a few rows, and the longest turns under the lock
    (one long turn stalls every worker)."""
    secs = collections.Counter()
    for r in checked:
        secs.update(r.get("t", {}))
    longest = sorted(zip(checked, taken), key=lambda rc: -rc[0].get("t", {}).get("locked", 0.0))[:8]
    return {"child_seconds": {k: round(v, 1) for k, v in secs.items()},
            "lock": lock_use([t for r in checked for t in r.get("turns", [])]),
            "row_estimate": row_estimate_quality(checked),
            "longest_locked": [{"ops": c["ops"], "locked_s": r["t"]["locked"], "first_run_s": r["t"].get("first", 0.0),
                                "verdict": "kept" if r["kept"] else r["drop"][:120]} for r, c in longest if r.get("t")]}


def _reason_class(why: str) -> str:
    """Group drop reasons for the funnel (numbers removed). Drops decided from a few rows, before one full run,
    are counted apart: the estimate is a guess, and the funnel should show how many tasks it cost."""
    if why.startswith(("too slow: eager about", "too slow: eager over")):
        return "too slow (from a few rows)"
    for prefix in ("too fast", "too slow", "eager failed", "torch.compile failed", "child process"):
        if why.startswith(prefix):
            return prefix
    return why


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_mine":
        _mine_child(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "_filter":
        _filter_child(sys.argv[2])
    else:
        sys.exit(main())
