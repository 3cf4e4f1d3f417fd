"""How much a kernel's runtime_ms moves between verdicts of the same workspace, under several warm-ups side by side
in one run, and how much of it the kernel's own time explains. Prints a table.

    python bench/timing_spread.py --backend cuda                       # on a GPU (docs/results.md)
    python bench/timing_spread.py --backend cpu --verdicts 3           # anywhere

The kernel is env_bench's ~1 ms naive matmul (bench/workspaces.py), built and its baselines timed once before the
rows. Each of its rows is one setting of env.Config.warmup_ms (untimed runs before the timed ones, in milliseconds
of work) and of the idle time before each verdict (a policy thinks between its tool calls, and a device left idle
lowers its clocks). Two more rows, at the default warm-up: the timing floor's 1-element task through the same
verdicts (the protocol's own jitter, with no kernel time in it), and on a GPU the same matmul kernel timed in this
process by CUDA events, 20 runs a round (the device's own jitter, with no protocol in it). The rows are interleaved,
a round of every row at a time, so a drift of the machine reaches every row alike. Columns: the median runtime_ms,
its spread max / min over the row's rounds (what a reward sees from one verdict to the next), the median of the
rounds' own p90 / p10 over their runs, and the median verdict seconds (what a warm-up costs).
"""
import argparse
import os
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
    warmups = [float(x) for x in args.warmup_ms.split(",")]
    idles = [float(x) for x in args.idle_s.split(",")]
except ValueError:
    p.error("--warmup-ms and --idle-s take comma-separated numbers")
if args.verdicts < 2 or min(warmups + idles) < 0:
    p.error("--verdicts must be >= 2, and --warmup-ms and --idle-s >= 0")
work = Path(tempfile.mkdtemp(prefix="timing-spread-"))
os.environ.setdefault("CUDA_AGENT_CACHE", str(work / "cache"))

import env  # noqa: E402
from protocol import spread  # noqa: E402
from workspaces import floor_ws, matmul_ws  # noqa: E402  (bench/)

backend = env.resolve_backend(args.backend)
ws = matmul_ws(work / "ws", backend == "cuda")
floor = floor_ws(work / "floor", ws)
print(f"building the kernel and timing its baselines ({backend}) ...", flush=True)
for w in (ws, floor):
    first = env.evaluate(w, backend=backend)
    if not first.correct:
        sys.exit(f"the bench's kernel failed: {first.summary()}")
rows = [("matmul", w, s) for s in idles for w in warmups] + [("floor", 0.0, 0.0)]
if backend == "cuda":  # the same kernel in this process, timed as KernelBench does (a trusted bench may load it)
    import importlib.machinery
    import importlib.util
    import torch
    so = env.build(env.collect(ws, backend)[0], backend).so_path
    spec = importlib.util.spec_from_file_location("cuda_extension", so, loader=importlib.machinery.ExtensionFileLoader("cuda_extension", str(so)))
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    ns = {}
    exec((ws / "model.py").read_text(), ns)
    a, b = [x.cuda() for x in ns["get_inputs"]()]

    def events(runs=20, warmup=3):
        for _ in range(warmup):
            ext.matmul(a, b)
        ts = []
        for _ in range(runs):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            ext.matmul(a, b)
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1))
        return ts
    rows.append(("events", 0.0, 0.0))
got = {k: [] for k in rows}  # (runtime_ms, runs' p90/p10, seconds) per round
for r in range(args.verdicts):
    for k in rows[r % len(rows):] + rows[:r % len(rows)]:  # (each round starts one row later)
        what, w, idle = k
        time.sleep(idle)
        if what == "events":
            ts = events()
            got[k].append((sorted(ts)[len(ts) // 2], spread(ts), 0.0))
        else:
            v = env.evaluate(ws if what == "matmul" else floor, backend=backend, warmup_ms=w)
            if not v.correct:
                sys.exit(f"verdict failed: {v.summary()}")
            got[k].append((v.runtime_ms, v.run_spread, v.seconds))
        print(f"  round {r} | {what} | warmup {w:g} ms | idle {idle:g} s | runtime {got[k][-1][0]:.4f} ms | "
              f"runs p90/p10 {got[k][-1][1]:.3f} | {got[k][-1][2]:.2f} s", flush=True)


def med(xs):
    return sorted(xs)[len(xs) // 2]


print(f"\n## runtime_ms from round to round ({backend}, {args.verdicts} rounds)\n")
print("| timed | warmup_ms | idle before (s) | runtime_ms, median | spread max/min | runs' p90/p10, median | verdict s, median |")
print("|---|---|---|---|---|---|---|")
names = {"matmul": "matmul kernel, verdicts", "floor": "1-element relu (the floor), verdicts",
         "events": "matmul kernel, CUDA events in this process"}
for (what, w, idle), vs in got.items():
    rt = [x[0] for x in vs]
    print(f"| {names[what]} | {w:g} | {idle:g} | {med(rt):.4f} | {max(rt) / min(rt):.3f}x | {med([x[1] for x in vs]):.3f} | "
          f"{med([x[2] for x in vs]):.2f} |")
