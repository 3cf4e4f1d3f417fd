"""Where a CACHED verdict's time goes (build and baselines cached): env.evaluate's own code paths, timestamped in the
parent and in both children on one clock (CLOCK_MONOTONIC is system-wide, the children's PID namespace included).
Children exec'ed (`python env.py _child`, each importing torch) and forked from the sandbox's fork server
(protocol.FORK_PRELOAD) are compared in one run, verdicts alternating; prints a timeline per way (median ms over
--repeats verdicts), the verdict's phases side by side, and what the pieces cost on their own.

    python bench/verdict_split.py                         # CPU backend, the bench's 256x512x256 matmul
    python bench/verdict_split.py --backend cuda --repeats 8

How: the children run bench/_traced_child.py (exec'ed in place of env.py, or called in the forked child), which stamps
its start, `import torch`, `import protocol`, and messages on stderr, then runs the harness's own
protocol._child_main. The parent's side is stamped by wrapping protocol.run_sandboxed, protocol.Child's methods and
env.Verdict.phases (env._lap_timer). Nothing here is timed by a test; the numbers are for reading.
"""
import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
work = Path(tempfile.mkdtemp(prefix="verdict-split-"))
atexit.register(shutil.rmtree, work, True)  # (also where the bench stops early)
os.environ.setdefault("CUDA_AGENT_CACHE", str(work / "cache"))
import env  # noqa: E402
from workspaces import matmul_ws  # noqa: E402  (bench/)
import protocol  # noqa: E402
import sandbox  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--backend", default="cpu")
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--no-components", action="store_true", help="skip the rows that time the pieces on their own")
args = p.parse_args()
backend = env.resolve_backend(args.backend)
cuda = backend == "cuda"

# -- the workspace: env_bench.py's verdict task --------------------------------------------------
ws = matmul_ws(work / "ws", cuda)
print("building and timing the baselines once (not part of the split) ...", flush=True)
v = env.evaluate(ws, backend=backend)
assert v.correct, v.summary()

# -- stamps -------------------------------------------------------------------------------------
events = []  # (monotonic seconds, who, what)
sums = []  # (who, the child's per-command totals) of the last verdict


def stamp(who, what):
    events.append((time.monotonic(), who, what))


protocol.ENV_PY = ROOT / "bench" / "_traced_child.py"
_run_sandboxed, _init, _answer, _close = protocol.run_sandboxed, protocol.Child.__init__, protocol.Child.answer, protocol.Child.close


def traced_run_sandboxed(argv, *a, **k):
    if k.get("fork"):
        k["fork"] = dict(k["fork"], call=["bench._traced_child", "main", k["fork"]["call"][2]])
    who = "ref" if '"mode": "reference"' in Path(argv[-1]).read_text() else "cand"
    stamp(who, "spawn (run_sandboxed called)")
    r = _run_sandboxed(argv, *a, **k)
    stamp(who, "sandbox returned (child reaped, cgroup removed)")
    for line in r.stderr.splitlines():
        if line.startswith("TRACE "):
            _, t, what = line.split(" ", 2)
            if what.startswith("child: ms handling"):
                sums.append((who, what))
            else:
                events.append((float(t), who, what))
    return r


def traced_init(self, spec, *a, **k):
    self._who = "ref" if spec["mode"] == "reference" else "cand"
    stamp(self._who, "Child() called")
    _init(self, spec, *a, **k)
    stamp(self._who, "Child() returned")
    self._n = 0


def traced_answer(self, *a, **k):
    r = _answer(self, *a, **k)
    self._n += 1
    if self._n == 1:
        stamp(self._who, "parent has first reply")
    return r


def traced_close(self):
    stamp(self._who, "close() called")
    r = _close(self)
    stamp(self._who, "close() returned")
    return r


protocol.run_sandboxed, protocol.Child.__init__, protocol.Child.answer, protocol.Child.close = \
    traced_run_sandboxed, traced_init, traced_answer, traced_close
_lap_timer = env._lap_timer


def traced_lap_timer(phases):
    lap = _lap_timer(phases)

    def both(name):
        stamp("parent", f"lap: {name}")
        lap(name)
    return both


env._lap_timer = traced_lap_timer

# -- cached verdicts, the two ways alternating -------------------------------------------------
FORK = protocol.FORK_PRELOAD
runs = {"exec": [], "fork": []}
secs = {"exec": [], "fork": []}
phases = {"exec": [], "fork": []}
per_op = {"exec": [], "fork": []}
t0 = time.monotonic()
env.evaluate(ws, backend=backend)  # starts the fork servers (once per trainer process): not counted below
print(f"  first forked verdict (starts the fork servers): {time.monotonic() - t0:.3f} s", flush=True)
for i in range(args.repeats):
    for way in ("exec", "fork"):
        protocol.FORK_PRELOAD = FORK if way == "fork" else []
        events.clear()
        t0 = time.monotonic()
        stamp("parent", "evaluate() called")
        v = env.evaluate(ws, backend=backend)
        stamp("parent", "evaluate() returned")
        assert v.correct, v.summary()
        secs[way].append(time.monotonic() - t0)
        phases[way].append(dict(v.phases, rest=secs[way][-1] - sum(v.phases.values())))
        runs[way].append({(who, what): (t - t0) * 1e3 for t, who, what in events})
        per_op[way].append(list(sums))
        sums.clear()
        print(f"  verdict {i} ({way}): {secs[way][-1]:.3f} s, runtime {v.runtime_ms:.4f} ms", flush=True)

med = lambda xs: statistics.median(xs) if xs else float("nan")
for way in ("exec", "fork"):
    keys = list(dict.fromkeys(k for r in runs[way] for k in r))
    at = {k: med([r[k] for r in runs[way] if k in r]) for k in keys}
    keys.sort(key=at.get)
    label = {"exec": "exec'ed", "fork": "forked from the fork server"}[way]
    print(f"\n## cached verdict timeline, children {label} ({backend}, {os.cpu_count()} cpus, "
          f"load {os.getloadavg()[0]:.1f}, median of {len(runs[way])} verdicts; ms since evaluate() was called; the children "
          "run concurrently)\n")
    print("| t (ms) | process | event | since this process's previous event (ms) |\n|---|---|---|---|")
    last = {}
    for k in keys:
        who, what = k
        print(f"| {at[k]:.0f} | {who} | {what} | {at[k] - last.get(who, 0.0):.0f} |")
        last[who] = at[k]
    print("\n(the children's own time per command, in the verdict of median length)")
    mid = sorted(range(len(secs[way])), key=lambda i: secs[way][i])[len(secs[way]) // 2]
    for who, what in per_op[way][mid]:
        print(f"- {who}: {what}")
names = list(dict.fromkeys(n for w in phases.values() for ph in w for n in ph))
print(f"\n## cached verdict phases (env.Verdict.phases, median ms of {args.repeats} verdicts each)\n")
print("| phase | children exec'ed | children forked | forked / exec'ed |\n|---|---|---|---|")
for n in [*names, "verdict"]:
    e, f = ((med(secs[w]) if n == "verdict" else med([ph.get(n, 0.0) for ph in phases[w]])) * 1e3 for w in ("exec", "fork"))
    print(f"| {n} | {e:.0f} | {f:.0f} | {f / e if e else float('nan'):.2f} |")

# -- the pieces on their own (for scale) --------------------------------------------------------
if not args.no_components:
    def t_cmd(cmd, n=3, **kw):
        ts = []
        for _ in range(n):
            t = time.monotonic()
            subprocess.run(cmd, check=True, **kw)
            ts.append((time.monotonic() - t) * 1e3)
        return med(ts)
    py = [sys.executable, "-E", "-B"]
    rows = [
        ("python -c pass (interpreter start)", t_cmd([*py, "-c", "pass"])),
        ("python -c 'import torch'", t_cmd([*py, "-c", "import torch"])),
        ("python -c 'import env' (what a child imports)", t_cmd([*py, "-c", "import env"], cwd=ROOT)),
    ]
    box = Path(tempfile.mkdtemp(dir=work))

    def t_box(code, n=3):
        ts = []
        for _ in range(n):
            r = sandbox.run_sandboxed([*py, "-c", code], box, 60, kind=backend)
            assert r.returncode == 0, r.stderr
            ts.append(r.seconds * 1e3)
        return med(ts)
    rows += [("sandboxed python -c pass (namespaces, jail, limits)", t_box("pass")),
             ("sandboxed python -c 'import torch'", t_box("import torch"))]
    print("\n| piece on its own | median ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.0f} |")
