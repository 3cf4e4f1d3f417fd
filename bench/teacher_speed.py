"""Why the teacher's fused kernels time slower than eager: the kernel, the Python around it, or the harness.

    python bench/teacher_speed.py --backend cpu --tasks 1 --variants 1   # anywhere (a smoke run: minutes)
    python bench/teacher_speed.py --backend cuda --tasks 4 --accurate-math  # on the H200 (run_h200.sh teacher-speed)

On the H200 the teacher's demonstrations timed at 0.6-0.9x eager (geomean 0.74x, docs/results.md), where one fused
pass over a chain of 2-5 ops should beat eager's pass per op and match torch.compile's. This bench takes tasks of
the elementwise family sized as train.py's default preset sizes them (0.3-3 ms in eager) and, for every kernel
variant the teacher writes, measures the same forward three ways, side by side:
  events  CUDA events around one run in this process (KernelBench's timer): the device's time for the kernels;
  host    this process's clock around one run and a device synchronisation (env.time_callable, no children);
  verdict env.evaluate(stage="profile"): the reward's clock, through sandboxed children and pipes.
for the teacher's kernel (ModelNew over the built extension, loaded here: our own code, trusted), eager and
torch.compile. Events minus host is the launch and Python around the kernels; host minus verdict the harness.
On the CPU there are no events: the host and verdict columns only. --accurate-math adds each CUDA variant again on
the accurate math functions (VARIANT+accurate), against the op library's special-function-unit math.
"""
import argparse
import atexit
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
work = Path(tempfile.mkdtemp(prefix="teacher-speed-"))
atexit.register(shutil.rmtree, work, True)  # (also where the bench stops early)
os.environ.setdefault("CUDA_AGENT_CACHE", str(work / "cache"))
os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # the in-process timer, threaded as env.CHILD_ENV threads children

p = argparse.ArgumentParser()
p.add_argument("--backend", default="auto")
p.add_argument("--tasks", type=int, default=4, help="elementwise tasks (half of them with a reduction)")
p.add_argument("--variants", type=int, default=3, help="kernel variants per task (the teacher's, in its order)")
p.add_argument("--window", type=float, nargs=2, default=(0.3, 3.0), metavar=("LO", "HI"),
               help="eager-time window the tasks are sized for, ms (train.py's default preset: 0.3 3)")
p.add_argument("--runs", type=int, default=20, help="timed runs per in-process measurement")
p.add_argument("--accurate-math", action="store_true",
               help="CUDA: each variant again with accurate exp, log, tanh and division (VARIANT+accurate)")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--kernel-of", nargs=2, metavar=("TASK", "VARIANT"), help=argparse.SUPPRESS)  # (a child: see below)
args = p.parse_args()
if args.tasks < 1 or args.variants < 1 or args.runs < 1 or not 0 < args.window[0] < args.window[1]:
    p.error("--tasks, --variants and --runs must be >= 1, and --window needs 0 < LO < HI")

import torch  # noqa: E402

import elementwise as E  # noqa: E402
import env  # noqa: E402
env.torch.set_num_threads(env.CHILD_THREADS)  # (and as many threads)
from workspaces import event_ms, load_extension  # noqa: E402  (bench/)

backend = env.resolve_backend(args.backend)
cuda = backend == "cuda"
dev = torch.device("cuda" if cuda else "cpu")


def pick_tasks(n: int) -> list[dict]:
    """n composed tasks, alternating without and with a reduction (the family's two kernel shapes)."""
    got, i = [], 0
    while len(got) < n and i < 2000:
        c = E.compose_one(i, args.seed, backend, tuple(args.window))
        i += 1
        if "drop" in c:
            continue
        reduces = E.split(E.parse(c["code"]))[1] is not None
        if reduces == (len(got) % 2 == 1):
            got.append(c)
    if len(got) < n:
        raise SystemExit(f"teacher_speed.py: only {len(got)} of {n} tasks composed in the window {args.window}")
    return got


def measure(fn, sets) -> tuple[float, float]:
    """(events ms or nan, host ms) of fn on the task's input sets."""
    host, _ = env.time_callable(fn, sets, n_timed=args.runs, min_s=0.2, warmup=2)
    return (event_ms(fn, sets[0], runs=args.runs, warmup=3) if cuda else math.nan), host


def task_inputs(c):
    """The task's Model (eager, seeded) and two input sets, on the device."""
    ns = {}
    exec(compile(c["code"], "model.py", "exec"), ns)
    torch.manual_seed(0)
    model = ns["Model"](*ns["get_init_inputs"]()).to(dev).eval()
    with torch.device(dev):
        sets = [ns["get_inputs"]() for _ in range(2)]
    return ns, model, sets


# The same kernels on the accurate math (--accurate-math): the CUDA library's op_X with the C functions of the CPU's
# (expf, log1pf, tanhf, IEEE division), and the reductions' without elementwise.cuda_math. Is the fused kernel
# compute-bound on the accurate functions, as the PTX instruction counts say (elementwise.OPS)?
def files_of(c, variant: str) -> dict:
    """The workspace files of one variant ("block_row", or "block_row+accurate")."""
    base = variant.removesuffix("+accurate")
    files = {**E.provided_files(c["code"], backend), **E.solution_files(c["code"], backend, base)}
    if variant != base:
        files = {p: E.accurate_math(t) if p.endswith((".cu", ".cuh")) else t for p, t in files.items()}
    return files


def kernel_figures(c, variant) -> tuple[float, float]:
    """The teacher's kernel, in a process of its own: CPython keeps the first extension module it loads under a name,
    so a second cuda_extension in this process would run the first one's code."""
    ns, model, sets = task_inputs(c)
    files = files_of(c, variant)
    b = env.build({k: x for k, x in files.items() if k != "model_new.py"}, backend)
    if not b.ok:
        raise SystemExit(f"teacher_speed.py: the {variant} kernel of {c['ops']} did not build:\n{b.log[-2000:]}")
    sys.modules["cuda_extension"] = load_extension(b.so_path)
    mns = {}
    exec(compile(files["model_new.py"], "model_new.py", "exec"), mns)
    cand = mns["ModelNew"](*ns["get_init_inputs"]()).to(dev).eval()
    cand.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(cand(*sets[0]), model(*sets[0]), atol=1e-2, rtol=1e-2)
    return measure(cand, sets)


if args.kernel_of:  # the child: one line of JSON
    task, variant = int(args.kernel_of[0]), args.kernel_of[1]
    print(json.dumps(kernel_figures(pick_tasks(task + 1)[task], variant)))
    sys.exit(0)

rows = []
tasks = pick_tasks(args.tasks)
print(f"teacher_speed.py | {backend} | {len(tasks)} tasks sized for {args.window[0]:g}-{args.window[1]:g} ms | "
      f"up to {args.variants} variants each | {args.runs} timed runs per in-process figure", flush=True)
for t, c in enumerate(tasks):
    steps = E.parse(c["code"])
    ns, model, sets = task_inputs(c)
    eager = measure(model, sets)
    compiled = measure(torch.compile(model), sets)
    variants = E.VARIANTS_FOR[(backend, E.split(steps)[1] is not None)][:args.variants]
    variants += [v + "+accurate" for v in variants] if args.accurate_math and cuda else []
    for v in variants:
        r = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--kernel-of", str(t), v], capture_output=True,
                           text=True, env=dict(os.environ, CUDA_AGENT_CACHE=str(env.CACHE_DIR)))
        if r.returncode != 0:
            raise SystemExit(f"teacher_speed.py: measuring the {v} kernel of {c['ops']} failed:\n{r.stderr[-3000:]}")
        kernel = tuple(json.loads(r.stdout.strip().splitlines()[-1]))
        files = files_of(c, v)
        ws = work / f"t{t}-{v.replace('+', '-')}"
        env.new_workspace(ws, c["code"], backend)
        for path, text in files.items():
            (ws / path).write_text(text)
        vd = env.evaluate(ws, backend=backend, stage="profile")
        if not vd.correct:
            raise SystemExit(f"teacher_speed.py: the verdict on the {v} kernel of {c['ops']}: {vd.summary()}")
        rows.append(dict(task=" -> ".join(c["ops"]), elems=math.prod(c["shape"]), variant=v, kernel=kernel, eager=eager,
                         compile=compiled, verdict=(vd.runtime_ms, vd.eager_ms, vd.compile_ms)))
        r = rows[-1]
        print(f"  {r['task']} | {v} | events {kernel[0]:.3f} / {eager[0]:.3f} / {compiled[0]:.3f} ms | host "
              f"{kernel[1]:.3f} / {eager[1]:.3f} / {compiled[1]:.3f} ms | verdict {vd.runtime_ms:.3f} / {vd.eager_ms:.3f} / "
              f"{vd.compile_ms:.3f} ms", flush=True)
    torch._dynamo.reset()

print(f"\n## The teacher's kernels against eager and torch.compile ({backend}, torch {torch.__version__})\n")
print("ms per run, kernel / eager / torch.compile; events: CUDA events in this process; host: this process's clock "
      "(env.time_callable); verdict: env.evaluate's runtime_ms / eager_ms / compile_ms\n")
print("| task | elements | variant | events | host | verdict | kernel vs eager: events / host / verdict |")
print("|---|---|---|---|---|---|---|")
fmt = lambda x: "-" if math.isnan(x) else f"{x:.3f}"
for r in rows:
    k, e, c, vd = r["kernel"], r["eager"], r["compile"], r["verdict"]
    ratio = lambda a, b: "-" if math.isnan(a) or math.isnan(b) else f"{b / a:.2f}x"
    print(f"| {r['task']} | {r['elems']:,} | {r['variant']} | {fmt(k[0])} / {fmt(e[0])} / {fmt(c[0])} | "
          f"{fmt(k[1])} / {fmt(e[1])} / {fmt(c[1])} | {vd[0]:.3f} / {vd[1]:.3f} / {vd[2]:.3f} | "
          f"{ratio(k[0], e[0])} / {ratio(k[1], e[1])} / {ratio(vd[0], vd[1])} |")
