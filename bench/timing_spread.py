"""How much a kernel's runtime_ms moves between verdicts of the same workspace, under several warm-ups side by side
in one run. Prints a table.

    python bench/timing_spread.py --backend cuda                       # on a GPU (docs/results.md)
    python bench/timing_spread.py --backend cpu --verdicts 3           # anywhere

The kernel is env_bench's ~1 ms naive matmul (bench/workspaces.py), built and its baselines timed once before the
rows. Each row is one setting of env.Config.warmup_ms (untimed runs before the timed ones, in milliseconds of work)
and of the idle time before each verdict (a policy thinks between its tool calls, and a device left idle lowers its
clocks); the rows' verdicts are interleaved, a round of every setting at a time, so a drift of the machine reaches
every row alike. Columns: the median runtime_ms, its spread max / min over the row's verdicts (what a reward sees
from one verdict to the next), the median of the verdicts' own p90 / p10 over their timed runs, and the median
verdict seconds (what the warm-up costs).
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
p.add_argument("--verdicts", type=int, default=6, help="verdicts per row")
p.add_argument("--warmup-ms", default="0,25,100", help="env.Config.warmup_ms values, comma-separated")
p.add_argument("--idle-s", default="0,2", help="seconds of idle before each verdict, comma-separated")
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
from workspaces import matmul_ws  # noqa: E402  (bench/)

backend = env.resolve_backend(args.backend)
ws = matmul_ws(work / "ws", backend == "cuda")
print(f"building the kernel and timing its baselines ({backend}) ...", flush=True)
first = env.evaluate(ws, backend=backend)
if not first.correct:
    sys.exit(f"the bench's kernel failed: {first.summary()}")
settings = [(w, s) for s in idles for w in warmups]
got = {k: [] for k in settings}  # (runtime_ms, run_spread, seconds) per verdict
for r in range(args.verdicts):
    for k in settings[r % len(settings):] + settings[:r % len(settings)]:  # (each round starts one setting later)
        time.sleep(k[1])
        v = env.evaluate(ws, backend=backend, warmup_ms=k[0])
        if not v.correct:
            sys.exit(f"verdict failed: {v.summary()}")
        got[k].append((v.runtime_ms, v.run_spread, v.seconds))
        print(f"  round {r} | warmup {k[0]:g} ms | idle {k[1]:g} s | runtime {v.runtime_ms:.4f} ms | "
              f"runs p90/p10 {v.run_spread:.3f} | {v.seconds:.2f} s", flush=True)


def med(xs):
    return sorted(xs)[len(xs) // 2]


print(f"\n## runtime_ms from verdict to verdict ({backend}, {args.verdicts} verdicts a row, "
      f"first verdict {first.runtime_ms:.4f} ms)\n")
print("| warmup_ms | idle before (s) | runtime_ms, median | spread max/min | runs' p90/p10, median | verdict s, median |")
print("|---|---|---|---|---|---|")
for (w, s), vs in got.items():
    rt = [x[0] for x in vs]
    print(f"| {w:g} | {s:g} | {med(rt):.4f} | {max(rt) / min(rt):.3f}x | {med([x[1] for x in vs]):.3f} | "
          f"{med([x[2] for x in vs]):.2f} |")
