"""synth.py: synthesise CUDA-Agent-Ops-style training tasks (mine -> compose -> filter -> report).

    python synth.py --out data/tiny --num-tasks 8 --backend cpu --workers 2        # tiny run (CPU, minutes)
    python synth.py --out data/ops6k --num-tasks 6000 --backend cuda --workers 12  # the real run (one H200)
    python synth.py --out data/elem --num-tasks 64 --family elementwise --backend cpu --workers 2  # elementwise.py's family

The pipeline, one readable function per stage, in order:
  1. mine      ops.mine_seeds: introspect torch.nn modules, torch / torch.special / torch.linalg /
               torch.nn.functional functions and transformers' activations and normalisation layers; probe
               each on small tensors of rank 2..5 (and on meta tensors) to learn which input ranks it
               accepts, and keep it as a seed operator if it computes something deterministic from its
               input. Runs once in a sandboxed child, cached per torch/transformers version (ops.py).
  2. compose   compose.compose_one: sample the number of ops K from the paper's mix, chain K seeds
               *sequentially*, propagating shapes by running on meta tensors (ops.meta_run), then double BATCH
               until a roofline estimate of eager time (bytes moved and FLOPs counted on meta tensors, plus each
               seed's mined CPU cost per element) reaches the target inside the time window (ops.grow_batch).
               Emits a self-contained KernelBench-format module. Deterministic per --seed. `--family
               elementwise` composes with elementwise.compose_one instead. `--composer llm` lets agent.py's
               policy rewrite each rule-composed plan (as the paper did); its answers go through the same filters.
  3. filter    cheap filters in this process (duplicates, AST similarity > 0.9 to --kernelbench-dir: compose.py),
               then execution in --workers long-lived sandboxed children (checker.py), fed one
               candidate at a time (check_task): eager must run, be deterministic, give finite outputs that depend on
               the input (not constant, not the input itself), eager time inside the window
               (env.time_callable), torch.compile must run and agree with eager. A task's runs, checks and
               timing hold one lock per device; compiling and small warm-up runs are outside it, in parallel.
               Compose and filter form one stream: a candidate is composed when a worker is free and
               the tasks kept so far (plus the expected yield of those being checked) fall short.
  4. report    funnel (in/out and top drop reasons of every stage) on screen and in DIR/funnel.json,
               every checked candidate's verdict and timings in DIR/candidates.jsonl (bench/synth_diag.py),
               diversity (op histogram, ops per task vs the paper's mix, input sizes, eager times).

Output: DIR holds a datasets.DatasetDict (train/test) saved with save_to_disk; columns ops, data_source,
code, eager_ms, compile_ms. tasks.py reads it (load_split: the tasks of a split; read_dataset: the Dataset).
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
import fcntl
import hashlib
import importlib
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import threading
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import datasets
import torch
from tqdm import tqdm

import agent
import elementwise
import env
from checker import Checker
from compose import PAPER_MIX, compose_one, load_kernelbench, most_similar, structure_key
from ops import mine_seeds
from scan import parse_python
from tasks import FEATURES

# the execution filter's child (checker.Checker starts one per worker, in a sandbox): _filter_child below
CHILD = [sys.executable, "-E", "-B", str(Path(__file__).resolve()), "_filter"]


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


# ==============================================================================================
# 2. Compose candidates
# ==============================================================================================
def compose(start: int, count: int, seeds: list[dict], cfg: Config, backend: str, seen: set, funnel: dict,
            policy=None) -> list[dict]:
    """Candidates number start..start+count-1, minus those that fail to compose or duplicate an earlier one."""
    cap = cfg.mem_cap_gb * 2**30 if cfg.mem_cap_gb else None
    if cfg.family == "elementwise":  # elementwise.py composes; the filters below and after are the same
        cands = [elementwise.compose_one(i, cfg.seed, backend, cfg.window_ms, cfg.max_ops, int(cap) if cap else None)
                 for i in range(start, start + count)]
    else:
        cands = [compose_one(i, seeds, cfg.seed, backend, cfg.window_ms, cfg.max_ops, cap) for i in range(start, start + count)]
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
        names = {n.name for n in parse_python(text).body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    except SyntaxError:
        return None
    return text.strip() + "\n" if {"Model", "get_inputs", "get_init_inputs"} <= names else None


def compose_llm(plans: list[dict], cfg: Config, policy) -> list[dict]:
    """--composer llm: the rule composer picks the operators and a shape that fits (a plan); an LLM, through
    agent.py's policy, writes the module (as the paper did). Its code goes through the same filters; an
    answer that is not KernelBench format, or leaves out a requested operator, is dropped here."""
    prompts = []
    for c in plans:
        msg = LLM_PROMPT.format(ops=", ".join(c["ops"]), shape=tuple(c["shape"]), code=c["code"])
        prompts.append(agent.encode(policy.tokenizer, agent.render(policy.tokenizer, [{"role": "user", "content": msg}], True)))
    answers = []
    for i in range(0, len(prompts), 64):  # batches of 64 bound the KV cache
        try:
            answers += policy.generate(prompts[i:i + 64], max_new_tokens=768, temperature=0.0)
        except Exception as e:  # noqa: BLE001 - agent.py is another component: say where it broke, in one line
            raise env.UsageError(f"--composer llm: agent.py's policy failed to generate ({type(e).__name__}: {str(e)[:150]})")
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
        return agent.load_policy("hf", model=cfg.model)
    except env.UsageError as e:
        raise env.UsageError(f"--composer llm: {e}")
    except Exception as e:  # noqa: BLE001
        raise env.UsageError(f"--composer llm needs agent.py's model backends, which failed: {type(e).__name__}: {str(e)[:200]}")


# ==============================================================================================
# 3. Filter
# ==============================================================================================
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
                checker = checker or Checker(cfg, backend, stop_r, CHILD)
                r = checker.check(c)
                if not r["kept"] and r["drop"].startswith("child process") and "timed out" not in r["drop"]:
                    # the child died on it: maybe of something an earlier candidate left behind (a thread, a
                    # memory limit). A fresh child tries once more; a crash that is the candidate's comes back.
                    checker.close()
                    checker = Checker(cfg, backend, stop_r, CHILD)
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


class MachineBroken(env.UsageError):
    pass


def machine_broken(results: list[dict]) -> bool:
    """Every one of these results failed before any filter could judge it: the machine is at fault, not the
    tasks (e.g. a machine where the sandboxed children cannot start CUDA)."""
    return bool(results) and all(not r["kept"] and _reason_class(r["drop"]) in ("eager failed", "child process")
                                 for r in results)


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
        spent.setdefault("turns", []).append((t0, t1, t2))  # wall clock: bench/synth_diag.py compares children


def check_task(code: str, spec: dict, lock_fd, spent: dict, tell=lambda state: None, facts=None) -> dict:
    """The execution filter for one task, inside the child. Returns {"kept": bool, "drop": why, ...}.
    Cheap checks first, torch.compile (seconds) last. Adds where the time went to `spent` (seconds: setup, the
    warm-up runs, lock wait, locked device work and the first run within it, compile), so the funnel can name the
    bottleneck; `facts` receives the estimate from a few rows ("row_est_ms": bench/synth_diag.py checks it)."""
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
    # window is dropped before it takes the lock from every other worker (a batched `linalg.svdvals` can hold it
    # for tens of seconds on a GPU). Launch-bound rows extrapolate flat, so only a real per-row
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
            # too slow for certain, so the timed runs are skipped (linalg ops such as one SVD of a 262,144 x 1,024
            # input would otherwise run into the task timeout)
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
    warnings.filterwarnings("ignore")
    spec = json.loads(Path(spec_path).read_text())

    def watchdog():  # EOF on the stop pipe: the parent is gone or stopping
        os.read(spec["stop_fd"], 1)
        os._exit(3)
    threading.Thread(target=watchdog, daemon=True).start()
    torch.set_num_threads(spec["threads"])
    env._SYNC = torch.cuda.synchronize
    if spec["backend"] == "cuda":  # create the CUDA context and the cuBLAS/cuDNN handles now, outside the device
        x = torch.randn(64, 64, device="cuda")  # lock: the first task's first run would pay for them under it
        float((x @ x).sum() + torch.nn.functional.conv2d(x[None, None], x[None, None, :3, :3]).sum())
    start = time.time() - spec["created"]  # the child's start (sandbox, imports, CUDA set-up): charged to the first candidate
    with os.fdopen(spec["in_fd"], "rb") as cands, os.fdopen(spec["out_fd"], "wb", buffering=0) as out:
        say = lambda msg: out.write((json.dumps(msg) + "\n").encode())
        while line := cands.readline():
            c = json.loads(line)
            print(f"synth: checking {c['key']}", file=sys.stderr, flush=True)  # (Checker.check: last words)
            spent = {"start": start, "setup": 0.0, "warm": 0.0, "wait": 0.0, "locked": 0.0, "first": 0.0, "compile": 0.0}
            facts = {}
            r = check_task(c["code"], spec, spec["lock_fd"], spent, lambda state: say({"state": state}), facts)
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
           secs: dict | None = None) -> str:
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
    mix = " | ".join(f"{k} {v['ours_pct']}% (paper {v['paper_pct']}%)" for k, v in div["mix"].items())
    lines += [f"mix: {mix}", "ops by source: " + ", ".join(f"{k} {v}" for k, v in sorted(div["ops_per_source"].items())),
              f"distinct ops {div['distinct_ops']}; top: " + ", ".join(f"{o} {c}" for o, c in div["top_ops"][:8]),
              f"input elements min/median/max {div['input_numel']['min']}/{div['input_numel']['median']}/{div['input_numel']['max']}"
              f" | ranks {div['input_rank']} | eager ms min/median/max {div['eager_ms']['min']}/{div['eager_ms']['median']}/"
              f"{div['eager_ms']['max']}"]
    return "\n".join(lines)


# ==============================================================================================
# Output: save
# ==============================================================================================
def save(rows: list[dict], out: Path, work: Path, cfg: Config, funnel_json: dict, records: list | None = None):
    """Split, save under work/, then swap into `out` (an interrupted run never leaves a half-written DIR).
    DIR/funnel.json gets funnel_json; DIR/candidates.jsonl one line per checked candidate (`records`)."""
    datasets.disable_progress_bars()
    rng = random.Random(cfg.seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    n_test = 0 if len(rows) < 2 else max(1, round(len(rows) * cfg.test_share))
    cols = lambda idx: [{k: rows[i][k] for k in ("ops", "data_source", "code", "eager_ms", "compile_ms")} for i in sorted(idx)]
    splits = {"train": order[n_test:], "test": order[:n_test]}
    # (an empty split is left out: datasets cannot load one back; tasks.read_dataset returns it empty)
    dd = datasets.DatasetDict({k: datasets.Dataset.from_list(cols(idx), features=FEATURES) for k, idx in splits.items() if idx})
    stage = work / "dataset"
    if stage.exists():
        shutil.rmtree(stage)
    dd.save_to_disk(str(stage))
    (stage / "funnel.json").write_text(json.dumps(funnel_json, indent=1))
    (stage / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records or []))
    old = out.with_name(out.name + f".old-{uuid.uuid4().hex[:6]}")
    if out.exists():
        os.replace(out, old)
    os.replace(stage, out)
    shutil.rmtree(old, ignore_errors=True)
    return len(rows) - n_test, n_test



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
    """Check every input before any work; raise env.UsageError with one readable line."""
    if cfg.num_tasks < 1:
        raise env.UsageError(f"--num-tasks must be >= 1 (got {cfg.num_tasks})")
    if not 1 <= cfg.max_ops <= 5:
        raise env.UsageError(f"--max-ops must be between 1 and 5 (got {cfg.max_ops})")
    if cfg.workers < 1:
        raise env.UsageError(f"--workers must be >= 1 (got {cfg.workers})")
    if not 0 <= cfg.test_share < 1:
        raise env.UsageError(f"--test-share must be in [0, 1) (got {cfg.test_share})")
    if cfg.family == "elementwise" and cfg.composer == "llm":
        raise env.UsageError("--composer llm rewrites the paper family's plans; use it without --family elementwise")
    if cfg.window_ms and not 0 < cfg.window_ms[0] < cfg.window_ms[1]:
        raise env.UsageError(f"--window-ms needs 0 < LO < HI (got {cfg.window_ms})")
    if cfg.kernelbench_dir and cfg.kernelbench_dir != "hub" and not Path(cfg.kernelbench_dir).is_dir():
        raise env.UsageError(f"--kernelbench-dir {cfg.kernelbench_dir} does not exist or is not a directory")
    out = Path(cfg.out).resolve()
    if out.exists() and not out.is_dir():
        raise env.UsageError(f"--out {cfg.out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not (out / "funnel.json").exists():
        raise env.UsageError(f"--out {cfg.out} is a non-empty folder that synth.py did not write; refusing to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".synth-write-test-{uuid.uuid4().hex[:6]}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise env.UsageError(f"--out {cfg.out} is not writable ({e.strerror or e})")
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
    except env.UsageError as e:
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
    except env.UsageError as e:
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
        raise env.UsageError(f"{e}; check that the {backend} backend works in env.py's sandbox on this machine")
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
    div = diversity(rows)
    # every checked candidate's verdict and where its time went (bench/synth_diag.py reads them)
    records = [dict(r, index=c["index"], ops=c["ops"], data_source=c["data_source"]) for c, r in zip(taken, checked)]
    funnel_json = {"config": {k: v for k, v in dataclasses.asdict(cfg).items()}, "backend": backend,
                   "seeds": len(seeds), "stages": {k: dict(v, drops=dict(v["drops"])) for k, v in funnel.items()},
                   "kept": len(rows), "seconds": round(time.time() - t0, 1),
                   "stage_seconds": {k: round(v, 1) for k, v in secs.items()}, "diversity": div}
    n_train, n_test = save(rows, out, work, cfg, funnel_json, records)        # 4. report
    shutil.rmtree(work, ignore_errors=True)
    print(report(funnel, div, len(seeds), len(rows), n_train, n_test, time.time() - t0, secs))
    print(f"saved {out} (train {n_train}, test {n_test}), {out / 'funnel.json'} and {out / 'candidates.jsonl'}")
    return 0


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
    if len(sys.argv) == 3 and sys.argv[1] == "_filter":
        _filter_child(sys.argv[2])
    else:
        sys.exit(main())
