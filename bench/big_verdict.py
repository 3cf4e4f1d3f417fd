"""Verdicts of the curriculum's large tasks: where the time of one verdict goes when every output is large.

    python bench/big_verdict.py --backend cuda                 # on the H200: tasks sized for the 1-100 ms window
    python bench/big_verdict.py --backend cpu --window 5 50    # anywhere (the CPU window is scaled down)
    python bench/big_verdict.py --backend cpu --window 5 50 --budget-mb 1024,8   # the timed runs shared out or not
    python bench/big_verdict.py --backend cuda --window 0.3 3 --budget-mb 16384,1024 --split-warmup-ms 50,500

On CUDA an elementwise chain has to move 0.5-2 GB per tensor to last a millisecond, so a verdict (5 checks, 2
audits, the last run read in full, every reference output) moves gigabytes between the children and this process.
For each of --tasks elementwise tasks (synth.py's family, sized for --window), the teacher's first kernel variant
is scored --repeats times with env.evaluate (the first verdict times the baselines, the rest are cached), and one
table row per verdict gives the tensor size, the seconds, and env.Verdict.phases. --budget-mb scores each task under
each input budget in turn (env.Config.input_budget_mb): where fewer input sets than timed runs fit, the candidate's
runs are shared out over fresh children (the "children" column), and the rows side by side say what that costs;
--split-warmup-ms scores each task under each shortest warm-up of such a child in turn (protocol.SPLIT_WARMUP_MS):
does a fresh child's first timed run come out slower on this device? The settings take turns verdict by verdict
(drift on the machine falls on all of them), and the last table gives each setting's medians over its cached verdicts.
"""
import argparse
import atexit
import faulthandler
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
p = argparse.ArgumentParser()
p.add_argument("--backend", default="auto")
p.add_argument("--tasks", type=int, default=2, help="elementwise tasks to score")
p.add_argument("--repeats", type=int, default=3, help="verdicts per task (the first times the baselines)")
p.add_argument("--window", type=float, nargs=2, default=None, metavar=("LO", "HI"),
               help="eager-time window in ms the tasks are sized for (default synth.py's: 1 100 CUDA, 0.1 10 CPU)")
p.add_argument("--budget-mb", default="", help="input budgets in MB to score each task under, comma-separated "
               "(default env.Config's)")
p.add_argument("--split-warmup-ms", default="", help="shortest warm-ups in ms of a child the timed runs are shared "
               "out to, comma-separated (default protocol.SPLIT_WARMUP_MS)")
args = p.parse_args()
if args.tasks < 1 or args.repeats < 1:
    p.error("--tasks and --repeats must be >= 1")
try:
    budgets = [float(b) for b in args.budget_mb.split(",") if b.strip()] or [None]
    warmups = [float(w) for w in args.split_warmup_ms.split(",") if w.strip()] or [None]
except ValueError:
    p.error(f"--budget-mb and --split-warmup-ms take numbers, comma-separated: {args.budget_mb!r}, {args.split_warmup_ms!r}")
if any(b is not None and b <= 0 for b in budgets) or any(w is not None and w < 0 for w in warmups):
    p.error("--budget-mb must be > 0 and --split-warmup-ms >= 0")
work = Path(tempfile.mkdtemp(prefix="big-verdict-"))
atexit.register(shutil.rmtree, work, True)  # (also where the bench stops early)
os.environ.setdefault("CUDA_AGENT_CACHE", str(work / "cache"))  # a cache of its own unless one is given
import elementwise as E  # noqa: E402
import env  # noqa: E402
import protocol  # noqa: E402

faulthandler.dump_traceback_later(90, repeat=True)  # where this process is, every 90 s (a slow verdict says why)
backend = env.resolve_backend(args.backend)
window = tuple(args.window) if args.window else ((1.0, 100.0) if backend == "cuda" else (0.1, 10.0))
print(f"big_verdict | backend {backend} | window {window[0]:g}-{window[1]:g} ms | {args.tasks} tasks x {args.repeats} verdicts",
      flush=True)
rows, i = [], 0
for t in range(args.tasks):
    while "drop" in (c := E.compose_one(i, 0, backend, window)):
        i += 1
    i += 1
    steps = E.parse(c["code"])
    reducing = any(st["op"] in E.REDUCTIONS for st in steps)
    variant = E.VARIANTS_FOR[(backend, reducing)][0]
    ws = work / f"task{t}"
    (ws / "kernels").mkdir(parents=True)
    (ws / "model.py").write_text(c["code"])
    for path, text in {**E.provided_files(c["code"], backend), **E.solution_files(c["code"], backend, variant)}.items():
        (ws / path).write_text(text)
    n, one_child = math.prod(c["shape"]), {}
    print(f"  task {t}: {' -> '.join(c['ops'])}, shape {tuple(c['shape'])}, estimated eager {c['est_ms']:.2f} ms", flush=True)
    for r in range(args.repeats):
        for budget in budgets:
            for k, warm in enumerate(warmups):
                if k and one_child.get(budget):
                    continue  # (where the runs are not shared out, the warm-up of a shared-out child does not apply)
                if warm is not None:
                    protocol.SPLIT_WARMUP_MS = warm  # (env.py reads it at each shared-out child)
                t0 = time.perf_counter()
                v = env.evaluate(ws, backend=backend, **({} if budget is None else {"input_budget_mb": budget}))
                wall = time.perf_counter() - t0
                name = (f"{' -> '.join(c['ops'])} {variant}" + ("" if budget is None else f", budget {budget:g} MB")
                        + ("" if warm is None or v.timed_children < 2 else f", warm-up {warm:g} ms"))
                print(f"  {name} | {n / 1e6:.1f}M elements | verdict {r + 1} | {wall:.1f} s | reward {v.reward:+d} | "
                      f"runtime {v.runtime_ms} ms | eager {v.eager_ms} ms | children {v.timed_children} | "
                      + ", ".join(f"{k} {x:.1f}" for k, x in v.phases.items()) + (f" | error {v.error}" if v.error else ""),
                      flush=True)
                rows.append((name, n, r + 1, wall, v))
                one_child[budget] = v.timed_children < 2

phases = list(dict.fromkeys(k for *_, v in rows for k in v.phases))
print("\n| task | elements | verdict | seconds | reward | runtime ms | children | " + " | ".join(phases) + " |")
print("|---|---|---|---|---|---|---|" + "---|" * len(phases))
for name, n, r, wall, v in rows:
    ph = " | ".join(f"{v.phases.get(k, 0):.2f}" for k in phases)
    rt = "-" if v.runtime_ms is None else f"{v.runtime_ms:.3f}"
    print(f"| {name} | {n / 1e6:.1f}M | {r} | {wall:.1f} | {v.reward:+d} | {rt} | {v.timed_children} | {ph} |")
# each setting's medians over its cached verdicts (not a task's first, which times the baselines): runtime against
# the same task's one-child setting is the fairness question, seconds the cost
cached = {}
for name, n, r, wall, v in rows:
    if r > 1 and v.runtime_ms is not None:
        cached.setdefault(name, []).append((v.runtime_ms, wall, v.timed_children))
if cached:
    print("\n| setting | cached verdicts | children | runtime ms, median | seconds, median |\n|---|---|---|---|---|")
    for name, got in cached.items():
        print(f"| {name} | {len(got)} | {got[0][2]} | {statistics.median(g[0] for g in got):.4g} | "
              f"{statistics.median(g[1] for g in got):.1f} |")
bad = [v for *_, v in rows if not v.correct]
if bad:
    sys.exit(f"{len(bad)} of {len(rows)} verdicts were not correct: {bad[0].error or bad[0].violations}")
