"""Benchmark env.py against the naive approach (load_inline with torch/extension.h, rebuilt from
scratch each time, as KernelBench does), side by side in one run. Prints a table.

    python bench/env_bench.py --backend cuda      # on the H200 (the numbers in docs/results.md)
    python bench/env_bench.py --backend cpu       # anywhere (slow: ~60 s per torch-header build on 2 cores)
    python bench/env_bench.py --backend cuda --no-naive --workers 12   # and verdicts per hour, 12 in flight

Measures: cold compile of a small kernel (CUDA-Agent layout: pure kernel + torch binding), rebuild after
editing one kernel (each split into its steps: env.Build.steps), full verdict time with the build cached (first with baselines to time, then steady
state), the spread (max/min) of runtime_ms over 5 repeated verdicts of the same >= 0.5 ms kernel, the timing floor
(a 1-element task's candidate and eager runtime by the verdict's protocol, and eager in-process; on a GPU also
eager by CUDA events, KernelBench's timer, for that task and the >= 0.5 ms one), and where a
verdict's time goes (env.Verdict.phases: scan, build, reference start, reference outputs, timed inputs, baseline
compile, baselines, candidate start, checks, timed runs, compare (the comparisons of whole outputs), waits for the
device's locks).

--workers N adds verdicts in flight, as train.py's rollouts run them (threads, one workspace copy per episode):
M = max(2N, 8) profile verdicts of the cached task from 1 thread, then from N threads (builds overlap, timing is
serialised per device by env.py's locks): verdicts per hour, median and p90 verdict seconds, and the seconds each
verdict waited for the device ("wait device" in Verdict.phases). Then the first verdicts of new tasks (a PPO or
teacher turn: baselines not cached, each task times eager and torch.compile while no candidate is alive, a gate
that serialises them): one alone, then N different tasks together.
"""
import argparse
import atexit
import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASES = ROOT / "tests" / "env_cases"
p = argparse.ArgumentParser()
p.add_argument("--backend", default="auto")
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--no-naive", action="store_true", help="skip the load_inline build (about a minute)")
p.add_argument("--workers", type=int, default=0, help="also measure N verdicts in flight (0: not measured)")
p.add_argument("--verdicts", type=int, default=0, help="verdicts per in-flight row (default max(2N, 8))")
p.add_argument("--cache", help="use this build cache, not a fresh one: the cold-build rows are skipped (tests)")
args = p.parse_args()
if args.workers < 0 or args.verdicts < 0:
    p.error("--workers and --verdicts must be >= 0")
work = Path(tempfile.mkdtemp(prefix="env-bench-"))
atexit.register(shutil.rmtree, work, True)  # (also where the bench stops early)
os.environ["CUDA_AGENT_CACHE"] = args.cache or str(work / "cache")  # by default a cold cache: nothing built before
os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # the in-process timer, threaded as env.CHILD_ENV threads children

import env  # noqa: E402
env.torch.set_num_threads(env.CHILD_THREADS)  # (and as many threads)
from workspaces import event_ms, floor_ws, matmul_ws  # noqa: E402  (bench/)

backend = env.resolve_backend(args.backend)
cuda = backend == "cuda"
rows = []


def row(name, value, unit, target=""):
    rows.append((name, value, unit, target))
    print(f"  {name}: {value:.3g} {unit}", flush=True)


def step_rows(what, b):
    """A build's split (env.Build.steps; the sources' scans and compiles run side by side), its non-zero steps."""
    for step, s in b.steps.items():
        if s:
            row(f"  {what}: {step}", s, "s")


# 1. naive: load_inline with torch/extension.h, from scratch
from torch.utils.cpp_extension import load_inline  # noqa: E402

reg = CASES / "registry"
kernel_src = (reg / ("axpby.cu" if cuda else "axpby.cpp")).read_text()
naive_wrapper = """
torch::Tensor axpby(torch::Tensor x, torch::Tensor y, double alpha, double beta) {
  auto out = torch::empty_like(x);
  axpby_launcher(x.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(), (float)alpha, (float)beta, x.numel(), 256, %s);
  return out;
}
"""
if args.no_naive:
    naive_s = float("nan")
else:
    print("naive load_inline build ...", flush=True)
    t0 = time.monotonic()
    if cuda:
        cuda_src = "#include <torch/extension.h>\n#include <ATen/cuda/CUDAContext.h>\n" + kernel_src + \
            naive_wrapper % "at::cuda::getCurrentCUDAStream()"
        load_inline("naive_axpby", cpp_sources="torch::Tensor axpby(torch::Tensor x, torch::Tensor y, double alpha, double beta);",
                    cuda_sources=cuda_src, functions=["axpby"], build_directory=str(Path(tempfile.mkdtemp(dir=work))),
                    extra_cuda_cflags=["-O3"], verbose=False)
    else:
        cpp_src = "#include <torch/extension.h>\n" + kernel_src + naive_wrapper % "nullptr"
        load_inline("naive_axpby", cpp_sources=cpp_src, functions=["axpby"], extra_cflags=["-O3", "-fopenmp"],
                    build_directory=str(Path(tempfile.mkdtemp(dir=work))), verbose=False)
    naive_s = time.monotonic() - t0
if not args.no_naive:
    row("naive load_inline build (torch headers everywhere)", naive_s, "s")

# 2. ours, cold: the CUDA-Agent layout (pure kernel file + torch binding), empty cache (not with --cache: it may hold them)
if not args.cache:
    files = {"binding.cpp": (reg / "binding.cpp").read_text(), "binding_registry.h": (reg / "binding_registry.h").read_text(),
             "kernels/axpby_binding.cpp": (reg / f"axpby_binding_{backend}.cpp").read_text(),
             f"kernels/axpby.{'cu' if cuda else 'cpp'}": kernel_src}
    # once per toolchain (torch install, compiler, flags), not per kernel: the precompiled torch header and the probe
    # of PYBIND11_MODULE's expansion; both are cached like objects
    import build  # noqa: E402

    print("toolchain set-up (precompiled torch headers, module probe) ...", flush=True)
    t0 = time.monotonic()
    build.prepare(backend, 600)  # (what train.py runs beside the model's loading)
    tc = build.toolchain(backend)
    pch = build.torch_pch(tc, 600, light=True)  # (prepare's: cached, its path)
    light = pch is not None and pch.parent.parent.name != tc["pch_id"]
    row("one-time toolchain set-up (precompiled light header, probe)", time.monotonic() - t0, "s",
        "per machine and torch install" + ("" if pch else "; NO precompiled header") +
        ("" if light else "; the light header is not offered here (its macros differ, or it failed to build)"))
    t0 = time.monotonic()
    build.torch_pch(tc, 600)
    row("  and the whole <torch/extension.h> (only for a source that needs it)", time.monotonic() - t0, "s")
    print("env.build, cold object cache ...", flush=True)
    b = env.build(files, backend)
    assert b.ok, b.log
    print(f"  compiled from the precompiled header: {', '.join(b.pch) or 'none'}", flush=True)
    row("env.py cold build (same kernel, CUDA-Agent layout)", b.seconds, "s",
        "" if args.no_naive else f"<= {naive_s / 3:.3g} s (1/3 of naive)")
    step_rows("cold build", b)  # (the toolchain and the precompiled header were made above: ~0 here)
    if not args.no_naive:
        row("  ratio to naive", b.seconds / naive_s, "x", "<= 0.33")
    # the same build, nothing cached (a comment changes every key), under the whole header alone
    whole = env.build({p: t + "\n// whole header\n" for p, t in files.items()}, backend, light=False)
    assert whole.ok, whole.log
    row("  the same cold build under the whole <torch/extension.h>", whole.seconds, "s", f"{whole.seconds / b.seconds:.2f}x")

    # 3. rebuild after editing one kernel
    kname = f"kernels/axpby.{'cu' if cuda else 'cpp'}"
    files[kname] = kernel_src.replace("alpha * x[i]", "x[i] * alpha")
    b2 = env.build(files, backend)
    assert b2.ok and b2.rebuilt == [kname], (b2.rebuilt, b2.log)
    row("rebuild after editing one kernel", b2.seconds, "s", "<= 3 s")
    step_rows("rebuild", b2)

# 4./5. full verdicts of a ~1 ms kernel (naive fp32 matmul 1024^3 on the H200), build cached
ws = matmul_ws(work / "ws", cuda)
env.evaluate(ws, backend=backend, stage="compile")  # build once (not part of the verdict timing)
verdicts = []
for i in range(args.repeats + 1):
    t0 = time.monotonic()
    v = env.evaluate(ws, backend=backend)
    assert v.correct, v.summary()
    verdicts.append((time.monotonic() - t0, v.runtime_ms, v.phases, v.eager_ms))
    print(f"  verdict {i}: {verdicts[-1][0]:.2f} s, runtime {v.runtime_ms:.4f} ms (eager {v.eager_ms:.4f}, compile {v.compile_ms:.4f})", flush=True)
# 6. the timing floor: a 1-element task (relu of one float) through the same protocol, candidate and eager alike.
# Every verdict pays it (two pipe round trips, the sample copy, the candidate's dispatch monitor); the trusted
# in-process timer (env.time_callable, no pipes) on the same eager model says how much of it is the protocol.
floor = floor_ws(work / "floor", ws)
relu_1 = (floor / "model.py").read_text()
floors = []
for i in range(3):
    v = env.evaluate(floor, backend=backend)
    assert v.correct, v.summary()
    floors.append((v.runtime_ms, v.eager_ms))
    print(f"  floor verdict {i}: runtime {v.runtime_ms:.4f} ms (eager {v.eager_ms:.4f})", flush=True)
dev = "cuda" if cuda else "cpu"


def task_model(code):
    """The task's eager Model and one input set, in this process."""
    ns = {}
    exec(compile(code, "task", "exec"), ns)
    return ns["Model"](*ns["get_init_inputs"]()).to(dev).eval(), [x.to(dev) for x in ns["get_inputs"]()], ns


eager_1, x_1, ns = task_model(relu_1)
inproc, _ = env.time_callable(eager_1, [[x.to(dev) for x in ns["get_inputs"]()] for _ in range(4)])
events = {}
if cuda:
    events["floor"] = event_ms(eager_1, x_1)
    events["task"] = event_ms(*task_model((ws / "model.py").read_text())[:2])


# 7. verdicts in flight (--workers N), as train.py's rollouts run them: threads, each verdict on its own copy of the
# workspace. The cached task's verdicts 1 and N at a time; then the first verdicts of new tasks (relu, each its own
# size: no baseline or torch.compile graph cached), one alone and N together.
def pct(xs, q):
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def in_flight(what, n, workspaces):
    def one(w):
        t0 = time.monotonic()
        v = env.evaluate(w, backend=backend)
        assert v.correct, v.summary()
        return time.monotonic() - t0, v.phases.get("wait device", 0.0)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        secs, waits = zip(*pool.map(one, workspaces))
    wall = time.monotonic() - t0
    r = dict(what=what, in_flight=n, verdicts=len(secs), wall_s=wall, per_hour=3600 * len(secs) / wall,
             median_s=pct(secs, 0.5), p90_s=pct(secs, 0.9), wait_median_s=pct(waits, 0.5), wait_p90_s=pct(waits, 0.9))
    print(f"  {what}, {n} in flight: {len(secs)} verdicts in {wall:.1f} s ({r['per_hour']:.0f}/hour), "
          f"median {r['median_s']:.2f} s, waited for the device {r['wait_median_s']:.2f} s (median)", flush=True)
    return r


def copies(src, tag, k):
    for i in range(k):
        shutil.copytree(src, work / f"{tag}{i}")
    return [work / f"{tag}{i}" for i in range(k)]


flight = []
if args.workers:
    n, m = args.workers, args.verdicts or max(2 * args.workers, 8)
    print(f"verdicts in flight: {m} of the cached task, 1 then {n} at a time; first verdicts of {n + 1} new tasks ...", flush=True)
    flight.append(in_flight("cached task", 1, copies(ws, "one-", m)))
    flight.append(in_flight("cached task", n, copies(ws, "many-", m)))
    relu = (ROOT / "examples" / "relu.py").read_text()
    new = []
    for k in range(n + 1):
        (work / f"new-{k}").mkdir()
        shutil.copytree(floor / "kernels", work / f"new-{k}" / "kernels")
        shutil.copy(floor / "model_new.py", work / f"new-{k}")
        code = f"# {work.name}, task {k}\n" + relu.replace("BATCH = 64", f"BATCH = {64 + k}")  # (a new task each run)
        (work / f"new-{k}" / "model.py").write_text(code)
    flight.append(in_flight("first verdict of a new task", 1, [work / "new-0"]))
    flight.append(in_flight("first verdicts of new tasks", n, [work / f"new-{k}" for k in range(1, n + 1)]))

row("full verdict, build cached, baselines timed (first)", verdicts[0][0], "s")
steady = sorted(t for t, *_ in verdicts[1:])
row("full verdict, build + baselines cached (median)", steady[len(steady) // 2], "s", "<= 10 s")
rt = [r for _, r, *_ in verdicts]
row(f"kernel runtime_ms (median of {len(rt)} verdicts)", sorted(rt)[len(rt) // 2], "ms", ">= 0.5 ms")
row(f"spread max/min of runtime_ms over {len(rt)} verdicts", max(rt) / min(rt), "x", "<= 1.03")
row("timing floor: 1-element relu, candidate (pipe clock, median of 3 verdicts)", sorted(f[0] for f in floors)[1], "ms")
row("timing floor: 1-element relu, eager (pipe clock, same protocol)", floors[0][1], "ms")
row("timing floor: 1-element relu, eager in-process (env.time_callable, no pipes)", inproc, "ms")
if events:  # the same two eager models by KernelBench's timer: what the pipe clock adds to each
    row("timing floor: 1-element relu, eager by CUDA events (KernelBench's timer)", events["floor"], "ms")
    row("the >= 0.5 ms kernel's task: eager by the pipe clock (verdict)", verdicts[0][3], "ms")
    row("the >= 0.5 ms kernel's task: eager by CUDA events (KernelBench's timer)", events["task"], "ms")

print(f"\n## env.py benchmark ({backend}, {env.toolchain_id_light(backend)})\n")
print("| measure | value | target |\n|---|---|---|")
for name, value, unit, target in rows:
    print(f"| {name.strip()} | {value:.3g} {unit} | {target} |")
# where a verdict's time goes (env.Verdict.phases), the first verdict and the median of the steady ones
for t, _, ph, _ in verdicts:
    ph["rest (child exits, cleanup)"] = t - sum(ph.values())
names = list(dict.fromkeys(k for _, _, ph, _ in verdicts for k in ph))
print("\n| verdict phase | first (s) | steady median (s) |\n|---|---|---|")
for n in names:
    first = verdicts[0][2].get(n, 0.0)
    later = sorted(ph.get(n, 0.0) for _, _, ph, _ in verdicts[1:])
    print(f"| {n} | {first:.3f} | {later[len(later) // 2]:.3f} |")
if flight:
    print("\n| verdicts | in flight | verdicts | wall (s) | verdicts/hour | median (s) | p90 (s) | waited for the device, "
          "median / p90 (s) |\n|---|---|---|---|---|---|---|---|")
    for r in flight:
        print(f"| {r['what']} | {r['in_flight']} | {r['verdicts']} | {r['wall_s']:.1f} | {r['per_hour']:.0f} | "
              f"{r['median_s']:.2f} | {r['p90_s']:.2f} | {r['wait_median_s']:.2f} / {r['wait_p90_s']:.2f} |")
if os.environ.get("OUT"):
    Path(os.environ["OUT"], f"env_bench_{backend}.json").write_text(json.dumps(dict(rows=rows, in_flight=flight), indent=1))
