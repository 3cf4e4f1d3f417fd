"""CUDA Agent's released workspace scripts and env.py on the same workspace, side by side in one run. Prints a table.

    git clone https://github.com/BytedTsinghua-SIA/CUDA-Agent /tmp/CUDA-Agent   # their scripts, not part of this repo
    python bench/cuda_agent_bench.py --agent-workdir /tmp/CUDA-Agent/agent_workdir --repeats 3 --workers 12

CUDA only: their scripts need a GPU. Their workspace (model.py, model_new.py, binding.cpp, binding_registry.h,
kernels/, utils/) is copied as it is; both sides score the same files. Rows, median of --repeats seconds:
  build          theirs: `bash utils/compile.sh` (it deletes its build folder every time); env.py: a cold build
                 (empty cache), then a rebuild after editing one kernel
  check          theirs: `python -m utils.verification`; env.py: a verdict at --stage verify, build cached (after
                 one more, the process's first, whose one-time set-ups are reported on their own)
  profile        theirs: `python -m utils.profiling`; env.py: a verdict at --stage profile, build and baselines cached
  per hour       --workers verdicts in flight over copies of the workspace. Theirs: verification then profiling,
                 all on the GPU at once (nothing serialises their timing); env.py: profile verdicts (its own lock
                 serialises the timed runs per GPU, so concurrent verdicts do not time one another)
The figures each side reports for the kernel are printed too. They measure different things: their profiler sums
the CUDA kernel time of 10 runs under torch.profiler, in the candidate's own process; env.py's clock is the parent's,
around one pipe exchange per run (host overhead included: bench/env_bench.py's floor rows).
"""
import argparse
import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
work = Path(tempfile.mkdtemp(prefix="cuda-agent-bench-"))
atexit.register(shutil.rmtree, work, True)  # (also where the bench stops early)
os.environ["CUDA_AGENT_CACHE"] = str(work / "cache")  # a cold cache: env.py's first build is a cold one
import env  # noqa: E402
from protocol import median  # noqa: E402  (the verdict's own median)
from build import gpu_query  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--agent-workdir", required=True, help="CUDA Agent's agent_workdir folder (a clone of their repository)")
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--workers", type=int, default=12, help="verdicts in flight for the per-hour rows")
p.add_argument("--verdicts", type=int, default=0, help="verdicts per side in the per-hour rows (default 2 x workers)")
p.add_argument("--timeout", type=float, default=600, help="seconds any one of their scripts may take")
args = p.parse_args()
src = Path(args.agent_workdir)
if not (src / "utils" / "compile.sh").is_file() or not (src / "model.py").is_file():
    sys.exit(f"cuda_agent_bench.py: {src} is not CUDA Agent's agent_workdir (no utils/compile.sh or model.py)")
if args.repeats < 1 or args.workers < 1 or args.verdicts < 0:
    sys.exit("cuda_agent_bench.py: --repeats and --workers must be >= 1, --verdicts >= 0")
if env.resolve_backend("auto") != "cuda":
    sys.exit("cuda_agent_bench.py: needs a CUDA GPU (CUDA Agent's scripts run on one)")
n_verdicts = args.verdicts or 2 * args.workers
rows = []  # (what, theirs, ours, note)


def copy_ws(name: str) -> Path:
    dst = work / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("build", "__pycache__", "*.so"))
    return dst


def theirs(ws: Path, *cmd) -> tuple[float, str]:
    """Seconds and output of one of their scripts, run as their SKILL.md says (from the workspace folder)."""
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ws, capture_output=True, text=True, timeout=args.timeout,
                       env=dict(os.environ, TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")))
    if r.returncode != 0:
        sys.exit(f"cuda_agent_bench.py: `{' '.join(cmd)}` failed in {ws}:\n{(r.stdout + r.stderr)[-2000:]}")
    return time.monotonic() - t0, r.stdout


# 1. builds: theirs from scratch each time; ours cold once, then a rebuild after editing one kernel
ws_t, ws_o = copy_ws("theirs"), copy_ws("ours")
t_build = [theirs(ws_t, "bash", "utils/compile.sh")[0] for _ in range(args.repeats)]
cold = env.build(env.collect(ws_o, "cuda")[0], "cuda")
if not cold.ok:
    sys.exit(f"cuda_agent_bench.py: env.py refused or failed to build their workspace:\n{cold.log[-2000:]}")
kernel = next(iter(sorted((ws_o / "kernels").glob("*.cu"))))
rebuilds = []
for i in range(args.repeats):
    kernel.write_text(kernel.read_text() + f"\n// edit {i}\n")
    rebuilds.append(env.build(env.collect(ws_o, "cuda")[0], "cuda").seconds)
rows.append(("build from scratch", median(t_build), cold.seconds, "env.py: empty cache (incl. its one-time toolchain set-up)"))
rows.append(("rebuild after editing one kernel", median(t_build), median(rebuilds), "theirs rebuilds everything"))

# 2. one check, one profile (build cached on both sides; env.py's first profile also times its baselines)
t_check = [theirs(ws_t, sys.executable, "-m", "utils.verification")[0] for _ in range(args.repeats)]
t_prof, their_out = zip(*[theirs(ws_t, sys.executable, "-m", "utils.profiling") for _ in range(args.repeats)])
first_check = env.evaluate(ws_o, backend="cuda", stage="verify")  # (this process's first verdict: one-time set-ups)
o_check = [env.evaluate(ws_o, backend="cuda", stage="verify") for _ in range(args.repeats)]
first = env.evaluate(ws_o, backend="cuda", stage="profile")
o_prof = [env.evaluate(ws_o, backend="cuda", stage="profile") for _ in range(args.repeats)]
for v in (first_check, *o_check, first, *o_prof):
    if not v.correct:
        sys.exit(f"cuda_agent_bench.py: env.py's verdict on their workspace: {v.summary()}")
rows.append(("check (correctness)", median(t_check), median([v.seconds for v in o_check]),
             f"env.py's first verdict in this process (its one-time set-ups): {first_check.seconds:.2f} s"))
rows.append(("profile, baselines cached", median(t_prof), median([v.seconds for v in o_prof]),
             f"env.py's first profile of the task (times its baselines): {first.seconds:.2f} s"))


# 3. verdicts per hour, --workers in flight, each on its own copy of the workspace
def per_hour(job, copies):
    t0 = time.monotonic()
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(job, [copies[i % len(copies)] for i in range(n_verdicts)]))
    return 3600 * n_verdicts / (time.monotonic() - t0)


t_copies, o_copies = [], []
for i in range(args.workers):
    t_copies.append(work / f"theirs-{i}")
    shutil.copytree(ws_t, t_copies[-1], ignore=shutil.ignore_patterns("build"))  # with their built module
    o_copies.append(work / f"ours-{i}")
    shutil.copytree(ws_o, o_copies[-1])
their_rate = per_hour(lambda ws: (theirs(ws, sys.executable, "-m", "utils.verification"),
                                  theirs(ws, sys.executable, "-m", "utils.profiling")), t_copies)
our_rate = per_hour(lambda ws: env.evaluate(ws, backend="cuda", stage="profile"), o_copies)
rows.append((f"verdicts per hour, {args.workers} in flight ({n_verdicts} verdicts)", their_rate, our_rate,
             "theirs: verification + profiling; env.py: profile"))

print(f"\nCUDA Agent's scripts vs env.py on {src} (GPU: {gpu_query('name') or 'cuda'}), medians of {args.repeats}\n")
print("| measure | CUDA Agent's scripts | env.py | env.py / theirs | note |\n|---|---|---|---|---|")
for what, a, b, note in rows:
    unit = "" if "per hour" in what else " s"
    print(f"| {what} | {a:.2f}{unit} | {b:.2f}{unit} | {b / a:.2f} | {note} |")
last = their_out[-1].strip().splitlines()[-1] if their_out[-1].strip() else "(no output)"
nums = dict(re.findall(r"(Torch Baseline|Torch Compile|CUDA Extension): ([\d.]+)us", last))
v = o_prof[len(o_prof) // 2]
print(f"\nthe kernel, as each side reports it: theirs (torch.profiler, CUDA time of forward) extension "
      f"{nums.get('CUDA Extension', '?')} us, eager {nums.get('Torch Baseline', '?')} us, compile "
      f"{nums.get('Torch Compile', '?')} us | env.py (parent's clock, one pipe exchange per run) candidate "
      f"{v.runtime_ms * 1e3:.1f} us, eager {v.eager_ms * 1e3:.1f} us, compile {v.compile_ms * 1e3:.1f} us, reward {v.reward}")
