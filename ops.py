"""ops.py: the seed operators synth.py composes tasks from. Mining introspects torch.nn modules, torch /
torch.special / torch.linalg / torch.nn.functional functions and transformers' activations and norms, and probes
each on small tensors of rank 2..5 and on meta tensors (in a sandboxed child, cached per torch/transformers
version); a seed is kept if it computes something deterministic from its input. ARG_RULES, a short table, gives
constructor arguments that introspection cannot guess. meta_run runs a chain of ops on meta tensors: its output
shape and a roofline estimate of its eager time (bytes and FLOPs counted, plus each seed's mined CPU cost);
grow_batch sizes a task with such an estimate (compose.py's and elementwise.py's families).

    seeds = mine_seeds()                                   # [{"name", "source", "kind", "ranks", "ns_per_elem", ...}]
    expr = build_op(seed, (8, 64), random.Random(0))       # e.g. "nn.Linear(in_features=64, out_features=256)"
    shape, est_ms, nbytes = meta_run(by_name, [{"name": seed["name"], "expr": expr}], (8, 64), "cuda")
    shape, est_ms = grow_batch(lambda sh: meta_run(by_name, steps, sh, "cuda")[1:], (1, 64), (1.0, 100.0), MEM_CAP["cuda"])
"""
from __future__ import annotations

import collections
import hashlib
import importlib
import inspect
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import env

SEEDS_VERSION = 6  # bump when mining changes, to invalidate the seed cache
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
# Roofline constants for the eager-time estimate used to size tasks: bytes/s, FLOP/s, per-op overhead (s).
ROOFLINE = {"cuda": (3.0e12, 4.0e13, 8e-6), "cpu": (4.0e9, 2.0e10, 1e-5)}
GPU_SPEEDUP = 1000.0  # an H200 vs one CPU core on compute-bound elementwise math (fp32 FLOP/s ratio, roughly)
MEM_CAP = {"cuda": 4 << 30, "cpu": 256 << 20}  # estimated bytes one task may touch (eager, all intermediates)


# ----------------------------------------------------------------------------------------------
# Mining
# ----------------------------------------------------------------------------------------------
def mine_seeds(verbose: bool = True) -> list[dict]:
    """Seed operators, from the per-version cache or by probing in a sandboxed child (~1 min once)."""
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


def _probe(make, rank_shapes, max_growth=16):
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


def _cost_probe(make, rank) -> float:
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


def _namespace():
    return {"torch": torch, "nn": nn, "F": F}


def eval_op(seed: dict, expr: str, ns: dict, device: str):
    """A callable for one op expression (modules are constructed on `device`)."""
    if seed["kind"] == "call":
        return lambda x: eval(expr, ns, {"x": x})  # noqa: S307 - our own generated expression
    for imp in seed.get("imports", []):
        exec(imp, ns)  # noqa: S102
    with torch.device(device):
        return eval(expr, ns).eval()  # noqa: S307


def _mine_child(out_path: str):
    """Runs in a sandboxed child: probe every candidate operator, write {"seeds": [...], "skipped": [...]}."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    seeds, skipped = [], []
    ns = _namespace()

    def add(seed, rank_shapes=CANON_SHAPES):
        make = lambda shape, rng, dev: eval_op(seed, build_op(seed, shape, rng), dict(ns), dev)
        ranks, why = _probe(make, rank_shapes, max_growth=float("inf"))
        if ranks:
            seeds.append(dict(seed, ranks=ranks, ns_per_elem=_cost_probe(make, ranks[0])))
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
                ranks, why = _probe(lambda shape, rng, dev, e=form: (lambda x: eval(e, ns, {"x": x})), CANON_SHAPES)  # noqa: S307
                if ranks:
                    make = lambda shape, rng, dev, e=form: (lambda x: eval(e, ns, {"x": x}))  # noqa: S307
                    found = {"name": full, "source": src, "kind": "call", "expr": form, "ranks": ranks,
                             "ns_per_elem": _cost_probe(make, ranks[0])}
                    break
                first_why = first_why or why
            if found:
                seeds.append(found)
            else:
                skipped.append((full, first_why or "no single-tensor call form works"))

    # transformers: activations (ACT2FN) and normalisation layers of a few model families
    try:  # (transformers is imported here, inside the try: a version that fails to import is a skipped source)
        from transformers.activations import ACT2CLS
        for key, val in sorted(ACT2CLS.items()):
            cls = val[0] if isinstance(val, tuple) else val
            if not cls.__module__.startswith("transformers"):
                skipped.append((f"transformers.{key}", f"same module as torch's {cls.__name__}"))
                continue
            add({"name": f"transformers.{key}", "source": "transformers", "kind": "module", "instance": True,
                 "ctor": f'ACT2FN["{key}"]', "args": [], "imports": ["from transformers.activations import ACT2FN"]})
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


# ----------------------------------------------------------------------------------------------
# Running a chain of ops on meta tensors
# ----------------------------------------------------------------------------------------------
class _Cost:
    """Counts bytes moved, FLOPs, op count and bytes allocated while ops run on meta tensors."""

    def __init__(self):
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
    ns = _namespace()
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



def grow_batch(estimate, shape: tuple, window_ms, cap: float, max_doublings: int = 20):
    """Size a task: BATCH (shape[0]) = 1, 2, 4, ... while estimate(shape) -> (est. ms, bytes) stays within `cap`
    bytes and the window's top, up to the first size whose estimate reaches lo * (hi / lo) ** 0.3 (low in the
    window: the estimate is rough, and synth.py's filter measures). An estimate that raises ends the growth (a
    batch size the chain cannot take). Returns (shape, est. ms), or None when not even BATCH = 1 fits."""
    lo, hi = window_ms
    target = lo * (hi / lo) ** 0.3
    best = None
    for k in range(max_doublings + 1):
        sh = (2 ** k,) + tuple(shape[1:])
        try:
            est, nbytes = estimate(sh)
        except Exception:  # noqa: BLE001
            break
        if nbytes > cap or est > hi:
            break
        best = (sh, est)
        if est >= target:
            break
    return best


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_mine":
        _mine_child(sys.argv[2])
