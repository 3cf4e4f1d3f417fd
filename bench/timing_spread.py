"""How much a kernel's runtime_ms moves between verdicts of the same workspace, under several warm-ups side by side
in one run, and how much of it the kernel's own time explains. Prints a table.

    python bench/timing_spread.py --backend cuda                       # on a GPU (docs/results.md)
    python bench/timing_spread.py --backend cpu --verdicts 3           # anywhere

The kernel is env_bench's ~1 ms naive matmul (bench/workspaces.py), built and its baselines timed once before the
rows. Each of its rows is one setting of env.Config.warmup_ms (untimed runs before the timed ones, until their
times by the parent's clock add up to it) and of the idle time before each verdict (a policy thinks between its
tool calls, and a device left idle lowers its clocks). Two more rows: the timing floor's 1-element task through
the same verdicts at the default warm-up (the protocol's own jitter, with no kernel time in it), and on a GPU the
same matmul kernel timed in this process by CUDA events, 3 untimed and 20 timed launches a round (the device's
own jitter, with no protocol in it). The rows are interleaved, a round of every row at a time and each round
starting one row later, so a drift of the machine reaches every row alike. Columns: the median runtime_ms, its
spread max / min over the row's rounds (what a reward sees from one verdict to the next), the median of the rounds'
own p90 / p10 over their runs, and the median verdict seconds (what a warm-up costs).
"""
import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
p = argparse.ArgumentParser()
p.add_argument("--backend", default="auto")
p.add_argument("--verdicts", type=int, default=6, help="rounds: verdicts per row")
p.add_argument("--warmup-ms", default="0,25,100", help="env.Config.warmup_ms values, comma-separated")
p.add_argument("--idle-s", default="0", help="seconds of idle before each verdict, comma-separated")
args = p.parse_args()
try:
    warmups = list(dict.fromkeys(float(x) for x in args.warmup_ms.split(",")))  # (a value given twice: one row)
    idles = list(dict.fromkeys(float(x) for x in args.idle_s.split(",")))
except ValueError:
    p.error("--warmup-ms and --idle-s take comma-separated numbers")
if args.verdicts < 2 or min(warmups + idles) < 0:
    p.error("--verdicts must be >= 2, and --warmup-ms and --idle-s >= 0")
work = Path(tempfile.mkdtemp(prefix="timing-spread-"))
atexit.register(shutil.rmtree, work, True)  # (also where the bench stops early)
os.environ.setdefault("CUDA_AGENT_CACHE", str(work / "cache"))

import env  # noqa: E402
from protocol import median, spread  # noqa: E402
from workspaces import event_times, floor_ws, load_extension, matmul_ws  # noqa: E402  (bench/)

backend = env.resolve_backend(args.backend)
ws = matmul_ws(work / "ws", backend == "cuda")
floor = floor_ws(work / "floor", ws)
print(f"building the kernel and timing its baselines ({backend}) ...", flush=True)
for w in (ws, floor):
    first = env.evaluate(w, backend=backend)
    if not first.correct:
        sys.exit(f"the bench's kernel failed: {first.summary()}")
rows = [("matmul", warm, idle) for idle in idles for warm in warmups] + [("floor", 0.0, 0.0)]
if backend == "cuda":  # the same kernel in this process, timed as KernelBench does
    ext = load_extension(env.build(env.collect(ws, backend)[0], backend).so_path)
    ns = {}
    exec((ws / "model.py").read_text(), ns)
    ab = [x.cuda() for x in ns["get_inputs"]()]
    rows.append(("events", None, None))
got = {k: [] for k in rows}  # (runtime_ms, runs' p90/p10, verdict seconds or None) per round
for r in range(args.verdicts):
    for k in rows[r % len(rows):] + rows[:r % len(rows)]:
        what, warm, idle = k
        if what == "events":
            ts = event_times(ext.matmul, ab, runs=20, warmup=3)
            got[k].append((median(ts), spread(ts), None))
        else:
            time.sleep(idle)
            v = env.evaluate(ws if what == "matmul" else floor, backend=backend, warmup_ms=warm)
            if not v.correct:
                sys.exit(f"verdict failed: {v.summary()}")
            got[k].append((v.runtime_ms, v.run_spread, v.seconds))
        ms, sp, sec = got[k][-1]
        print(f"  round {r} | {what} | warmup {'-' if warm is None else f'{warm:g} ms'} | idle "
              f"{'-' if idle is None else f'{idle:g} s'} | runtime {ms:.4f} ms | runs p90/p10 {sp:.3f} | "
              f"{'-' if sec is None else f'{sec:.2f} s'}", flush=True)

print(f"\n## runtime_ms from round to round ({backend}, {args.verdicts} rounds)\n")
print("| timed | warmup_ms | idle before (s) | runtime_ms, median | spread max/min | runs' p90/p10, median | verdict s, median |")
print("|---|---|---|---|---|---|---|")
names = {"matmul": "matmul kernel, verdicts", "floor": "1-element relu (the floor), verdicts",
         "events": "matmul kernel, CUDA events in this process"}
for (what, warm, idle), vs in got.items():
    rt, secs = [x[0] for x in vs], [x[2] for x in vs if x[2] is not None]
    print(f"| {names[what]} | {'-' if warm is None else f'{warm:g}'} | {'-' if idle is None else f'{idle:g}'} | "
          f"{median(rt):.4f} | {max(rt) / min(rt):.3f}x | {median([x[1] for x in vs]):.3f} | "
          f"{f'{median(secs):.2f}' if secs else '-'} |")
