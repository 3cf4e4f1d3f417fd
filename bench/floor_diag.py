"""Where the timing floor goes: small tasks' runs, driven through env.py's own children and pipes.

    python bench/floor_diag.py                           # CPU backend, examples/relu.py at BATCH = DIM = 1
    python bench/floor_diag.py --backend cuda --runs 200  # on the GPU, steadier medians

Each row drives one sandboxed child (env.Child, the real harness) through the run protocol of env.timed_runs
("load" untimed; then "run" and "sample" on the parent's clock) and splits the medians per exchange. Rows vary
one thing at a time: which function runs (eager in the reference child, the candidate's extension
tests/env_cases/ops.cpp or cuda/ops.cu, a forward that computes nothing), the task (relu_scale at 1 element
and at 64x4096, the tests' matmul; matmul1k on cuda), the output's size, the reply pipe's
size (protocol.PIPE_BYTES), who polls for messages instead of sleeping (protocol.spin), and the OpenMP settings the child gets (protocol.CHILD_ENV: the harness's, or libgomp's default wait policy). Prints a table.
"""
import argparse
import atexit
import os
import secrets
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
work = Path(tempfile.mkdtemp(prefix="floor-diag-"))
atexit.register(shutil.rmtree, work, True)  # (also where the bench stops early)
os.environ.setdefault("CUDA_AGENT_CACHE", str(work / "cache"))
os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # the in-process timer, threaded as env.CHILD_ENV threads children
import env  # noqa: E402
import protocol  # noqa: E402
env.torch.set_num_threads(protocol.CHILD_THREADS)  # (and as many threads)

p = argparse.ArgumentParser()
p.add_argument("--backend", default="cpu")
p.add_argument("--runs", type=int, default=60)
p.add_argument("--only", default="", help="only the rows whose name contains one of these (comma-separated)")
args = p.parse_args()
backend = env.resolve_backend(args.backend)

CASES = ROOT / "tests" / "env_cases"
RELU = (ROOT / "examples" / "relu.py").read_text()
if backend == "cuda":
    files = {f"kernels/{f.name}": f.read_text() for f in (CASES / "cuda").glob("ops*")}
else:
    files = {"kernels/ops.cpp": (CASES / "ops.cpp").read_text()}  # relu_scale: an `omp parallel for` over rows
b = env.build(files, backend)
assert b.ok, b.log


def model_new(init, forward):
    """A ModelNew with relu's parameters (init=True) or none, whose forward returns `forward`."""
    params = ("self, dim):\n        super().__init__()\n        self.scale = nn.Parameter(torch.randn(dim))" if init
              else "self):\n        super().__init__()")
    args = "x" if init else "a, b"
    return ("import torch\nimport torch.nn as nn\nimport cuda_extension\n\n\nclass ModelNew(nn.Module):\n"
            f"    def __init__({params}\n\n    def forward(self, {args}):\n        return {forward}\n")


KERNEL = model_new(True, "cuda_extension.relu_scale(x, self.scale)")
NOTHING = model_new(True, "x")  # the monitor, no op
MATMUL, MATMUL_NOTHING = model_new(False, "cuda_extension.matmul(a, b)"), model_new(False, "a")
MM = (CASES / ("cuda/matmul1k.py" if backend == "cuda" else "matmul.py")).read_text()


def task(batch, dim):
    return RELU.replace("BATCH = 64", f"BATCH = {batch}").replace("DIM = 4096", f"DIM = {dim}")


def drive(mode, model_new, extra, model, pipe_bytes, polls=(protocol.CHILD_SPIN_S, None, protocol.SAMPLE_SPIN_S)):
    """Medians (ms) of this process's clock (Python's) around "run", around "sample", both, their minimum, and the
    native clock's run + sample (protocol.timed_pair), the same run with the parent's own reads of the outputs
    instead of the sample, and with the input written by the parent just before the clock too (protocol.TimedInputs:
    the verdict's figure where protocol.reads() allows them; nan elsewhere), with its p90 / p10, and the same run's
    exchange alone (an audited run's span: no check on the clock) with its p90 / p10: the reads' share of the floor
    and of its jitter.
    polls: seconds the child polls for a command, this process for a run's reply (None: as timed_runs) and for a
    sample's."""
    sample_spin = polls[2]
    cfg = env.Config(backend=backend)
    run = Path(tempfile.mkdtemp(dir=env.CACHE_DIR))
    (run / "ext").mkdir()
    (run / "model.py").write_text(model)
    spec = dict(backend=backend, seed0=1, mode=mode, reference=str(run / "model.py"))
    seeds = [secrets.randbelow(2**31) for _ in range(4)]
    if mode == "reference":
        spec.update(seeds=seeds, n_checks=0, budget_mb=64)
    else:
        (run / "model_new.py").write_text(model_new)
        shutil.copy(b.so_path, run / "ext" / "cuda_extension.so")
        spec.update(model_new=str(run / "model_new.py"), ext_dir=str(run / "ext"), cand_dir=str(run))
    # (read by protocol.Child) this row's settings, for this child only
    protocol.CHILD_ENV, protocol.PIPE_BYTES, protocol.CHILD_SPIN_S = extra, pipe_bytes, polls[0]
    child = env.Child(spec, run, backend, cfg)
    child.spin_s = child.timed_spin_s if polls[1] is None else polls[1]
    try:
        if mode == "reference":
            first = child.answer()[0]
            protocol.probe_reads(child, first.get("probe"))  # (as a verdict decides it; the first row is a reference)
            n = first["timed_sets"]
            for _ in range(n):
                child.answer()
            child.ask({"op": "use", "fn": "eager"})
        else:
            assert child.answer()[0].get("ready"), "candidate did not load"
            child.ask({"op": "use", "fn": "candidate"})
        child.ask({"op": "load", "seed": seeds[0]})
        for _ in range(cfg.warmup):
            child.ask({"op": "run"})
        t_run, t_sample = [], []
        for i in range(args.runs):
            child.ask({"op": "load", "seed": seeds[i % 2]})
            t0 = protocol._clock()
            child.ask({"op": "run"})
            t1 = protocol._clock()
            run_spin, child.spin_s = child.spin_s, max(child.spin_s, sample_spin)
            child.ask({"op": "sample", "offset": secrets.randbelow(1 << 30)})
            child.spin_s = run_spin
            t2 = protocol._clock()
            t_run.append((t1 - t0) * 1e3)
            t_sample.append((t2 - t1) * 1e3)
        # the verdict's figure: one call of protocol.timed_pair per run (the split above is Python's clock), with the
        # sample exchange, and with the parent's own reads of the outputs (protocol.READS per output) where allowed
        native, reads, written, run_only, target = [], [], [], [], child.read_target()
        for i in range(args.runs):
            child.ask({"op": "load", "seed": seeds[i % 2]})
            timed = child.native_timed_run(("sample", secrets.randbelow(1 << 30)), child.spin_s,
                                           max(child.spin_s, sample_spin))
            native.append(timed[0] if timed else float("nan"))
            if target is not None:
                child.ask({"op": "load", "seed": seeds[i % 2]})
                rand = [secrets.randbits(64) for _ in range(protocol.READS * protocol.MAX_OUTPUTS)]
                timed = child.native_timed_run(("read", *target, rand), child.spin_s, max(child.spin_s, sample_spin))
                reads.append(timed[0] if timed else float("nan"))
        if target is not None:  # the inputs held here (two sets, from a reference child of this task), written
            inputs = protocol.TimedInputs(backend)
            src = child if mode == "reference" else env.Child(dict(spec, mode="reference", seeds=seeds, n_checks=0,
                                                                   budget_mb=64), run, backend, cfg)
            try:
                if src is not child:
                    for _ in range(src.answer()[0]["timed_sets"]):
                        src.answer()
                inputs.take(src, seeds[:2])
            finally:
                if src is not child:
                    src.close()
            writes = inputs.attach(child)
            for i in range(args.runs):
                if backend == "cuda":
                    child.ask({"op": "flush"})
                rand = [secrets.randbits(64) for _ in range(protocol.READS * protocol.MAX_OUTPUTS)]
                timed = child.native_timed_run(("read", *target, rand), child.spin_s, max(child.spin_s, sample_spin),
                                               writes[i % 2])
                written.append(timed[0])
                # the same run with no check on the clock (an audited run's span: the run exchange alone), so the
                # reads' share, and which of the two jitters, can be told apart
                if backend == "cuda":
                    child.ask({"op": "flush"})
                timed = child.native_timed_run(("audit", True), child.spin_s, max(child.spin_s, sample_spin),
                                               writes[(i + 1) % 2])
                run_only.append(timed[0])
            child.close()
            inputs.close()
        med, nan = statistics.median, float("nan")
        return (med(t_run), med(t_sample), med([a + s for a, s in zip(t_run, t_sample)]),
                min(a + s for a, s in zip(t_run, t_sample)), med(native), med(reads) if reads else nan,
                med(written) if written else nan, protocol.spread(written) if written else nan,
                med(run_only) if run_only else nan, protocol.spread(run_only) if run_only else nan)
    finally:
        protocol.CHILD_ENV, protocol.PIPE_BYTES, protocol.CHILD_SPIN_S = HARNESS, PIPE, SPIN
        child.spin_s = 0.0
        child.close()
        shutil.rmtree(run, ignore_errors=True)


HARNESS, PIPE, SPIN = dict(protocol.CHILD_ENV), protocol.PIPE_BYTES, protocol.CHILD_SPIN_S  # what env.Child gives every child
ASLEEP, BOTH_POLL = (0.0, 0.0, 0.0), (SPIN, 0.05, 0.05)  # nobody polls (every message wakes a sleeper); both sides poll
DEFAULT_WAIT = {k: v for k, v in HARNESS.items() if k != "OMP_WAIT_POLICY"}  # libgomp's default: spin, then sleep
ONE, BIG = task(1, 1), task(64, 4096)  # 1 element; 262144 elements (the sample: 65536 floats, 256 KiB)
ROWS = [  # (name, child, model_new, child env, task, reply pipe bytes)
    ("eager (reference child)", "reference", None, HARNESS, ONE, PIPE),
    ("eager, nobody polls (sleeping reads on both sides)", "reference", None, HARNESS, ONE, PIPE, ASLEEP),
    ("eager, this process polls too (the CUDA backend's setting)", "reference", None, HARNESS, ONE, PIPE, BOTH_POLL),
    ("candidate, forward computes nothing (monitor only)", "candidate", NOTHING, HARNESS, ONE, PIPE),
    ("candidate, relu_scale kernel", "candidate", KERNEL, HARNESS, ONE, PIPE),
    ("candidate relu_scale, nobody polls", "candidate", KERNEL, HARNESS, ONE, PIPE, ASLEEP),
    ("candidate relu_scale, this process polls too", "candidate", KERNEL, HARNESS, ONE, PIPE, BOTH_POLL),
    ("candidate relu_scale, OMP_NUM_THREADS=1 (no thread team)", "candidate", KERNEL, dict(HARNESS, OMP_NUM_THREADS="1"), ONE, PIPE),
    ("eager, libgomp default wait policy", "reference", None, DEFAULT_WAIT, ONE, PIPE),
    ("candidate relu_scale, libgomp default wait policy", "candidate", KERNEL, DEFAULT_WAIT, ONE, PIPE),
    ("64x4096: eager", "reference", None, HARNESS, BIG, PIPE),
    ("64x4096: candidate relu_scale", "candidate", KERNEL, HARNESS, BIG, PIPE),
    ("64x4096: eager, this process polls too", "reference", None, HARNESS, BIG, PIPE, BOTH_POLL),
    ("64x4096: candidate relu_scale, this process polls too", "candidate", KERNEL, HARNESS, BIG, PIPE, BOTH_POLL),
    ("64x4096: candidate relu_scale, 64 KiB pipe", "candidate", KERNEL, HARNESS, BIG, 1 << 16),
    ("matmul: eager", "reference", None, HARNESS, MM, PIPE),
    ("matmul: candidate, forward computes nothing (returns a)", "candidate", MATMUL_NOTHING, HARNESS, MM, PIPE),
    ("matmul: candidate cuda_extension.matmul", "candidate", MATMUL, HARNESS, MM, PIPE),
]
out = []
for i, (name, *how) in enumerate(ROWS):
    if i > 0 and not any(w in name for w in args.only.split(",")):
        continue  # (the first row always runs: a reference child decides protocol.reads(), as a verdict's does)
    r = drive(*how)
    out.append((name, *r))
    print(f"  {name}: run {r[0]:.4f} ms, sample {r[1]:.4f} ms, total {r[2]:.4f} ms (min {r[3]:.4f}), native {r[4]:.4f}, "
          f"native with reads {r[5]:.4f}, inputs written too {r[6]:.4f} (p90/p10 {r[7]:.3f}), its run exchange alone "
          f"{r[8]:.4f} (p90/p10 {r[9]:.3f})", flush=True)
# The trusted in-process timer (env.time_callable: no pipes, no monitor, this process's threads) on eager, per task.
dev = "cuda" if backend == "cuda" else "cpu"
for name, code in (("eager in-process (env.time_callable), 1 element", ONE), ("eager in-process, 64x4096", BIG),
                   ("eager in-process, matmul", MM)):
    if not any(w in name for w in args.only.split(",")):
        continue
    ns = {}
    exec(compile(code, name, "exec"), ns)
    m = ns["Model"](*ns["get_init_inputs"]()).to(dev).eval()
    t, _ = env.time_callable(m, [[x.to(dev) for x in ns["get_inputs"]()] for _ in range(4)], n_timed=args.runs)
    out.append((name, t, float("nan"), t, *[float("nan")] * 7))
    print(f"  {name}: {t:.4f} ms", flush=True)
print(f"\n## timing floor, relu_scale, 1 element unless said ({backend}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}, "
      f"{args.runs} runs each)\n")
print("| child / setting | run (ms) | sample (ms) | run + sample, median (ms) | min (ms) | native clock, median (ms) | "
      "native clock, parent reads (ms) | the same, inputs written by the parent: the verdict's run (ms) | its p90/p10 | "
      "its run exchange alone (ms) | p90/p10 |\n|---|---|---|---|---|---|---|---|---|---|---|")
for name, a, s, t, m, n, r, w, ws, o, os_ in out:
    print(f"| {name} | {a:.4f} | {s:.4f} | {t:.4f} | {m:.4f} | {n:.4f} | {r:.4f} | {w:.4f} | {ws:.3f} | {o:.4f} | {os_:.3f} |")
