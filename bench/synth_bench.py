"""bench/synth_bench.py: synth.py throughput (tasks kept per hour) and its funnel, per worker count.

    python bench/synth_bench.py --backend cpu --num-tasks 4 --workers 2             # tiny, CPU (minutes)
    python bench/synth_bench.py --backend cuda --num-tasks 300 --workers 8 16       # one H200 (~10 min)

Runs the real CLI (`python synth.py ...`) once per --workers value into a temporary folder and reads its
funnel.json and candidates.jsonl (the filter's time by phase and device-lock use: bench/synth_diag.py). Throughput excludes mining (cached per torch/transformers version; reported separately).
--cold uses a fresh cache folder (mining and torch.compile from scratch), as on a new machine.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import synth_diag  # (bench/, next to this script)

ROOT = Path(__file__).resolve().parents[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--num-tasks", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[2])
    p.add_argument("--max-ops", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-ms", type=float, nargs=2, default=None)
    p.add_argument("--cold", action="store_true", help="fresh cache: include mining and cold torch.compile")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args()
    rows = []
    for w in a.workers:
        with tempfile.TemporaryDirectory(prefix="synth-bench-") as d:
            env = dict(os.environ)
            if a.cold:
                env["CUDA_AGENT_CACHE"] = str(Path(d) / "cache")
            cmd = [sys.executable, str(ROOT / "synth.py"), "--out", str(Path(d) / "out"), "--num-tasks", str(a.num_tasks),
                   "--backend", a.backend, "--workers", str(w), "--max-ops", str(a.max_ops), "--seed", str(a.seed)]
            if a.window_ms:
                cmd += ["--window-ms", *map(str, a.window_ms)]
            t0 = time.time()
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            wall = time.time() - t0
            if r.returncode != 0:
                sys.exit(f"synth.py failed with workers={w}:\n{r.stderr[-3000:]}")
            records, f = synth_diag.load(Path(d) / "out")
        diag = synth_diag.diagnose(records)
        st, secs = f["stages"], f["stage_seconds"]
        work_s = max(wall - secs["mine"], 1e-9)
        rows.append({"backend": a.backend, "workers": w, "candidates": st["compose"]["in"], "executed": st["execution"]["in"],
                     "kept": f["kept"], "yield_pct": round(100 * st["execution"]["out"] / max(st["execution"]["in"], 1), 1),
                     "mine_s": secs["mine"], "compose_s": secs["compose"], "filter_s": secs["execution"], "wall_s": round(wall, 1),
                     "tasks_per_hour": round(f["kept"] / work_s * 3600), "drops": st["execution"]["drops"],
                     "eager_ms_median": f["diversity"]["eager_ms"]["median"], "lock_held_s": diag["lock"]["held_s"],
                     "lock_free_wait_s": diag["lock"]["waited_while_free_s"]})
        print("\n".join(r.stdout.strip().splitlines()[-8:] + synth_diag.lines(diag, w)), flush=True)
    cols = ["backend", "workers", "candidates", "executed", "kept", "yield_pct", "mine_s", "compose_s", "filter_s", "wall_s",
            "tasks_per_hour", "eager_ms_median", "lock_held_s", "lock_free_wait_s"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    for row in rows:
        top = sorted(row["drops"].items(), key=lambda kv: -kv[1])[:6]
        print(f"workers {row['workers']} execution drops: " + "; ".join(f"{k} ({v})" for k, v in top))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
