"""bench/synth_diag.py: where synth.py's execution filter spent its time, from the records of a finished run.

    python bench/synth_diag.py data/tiny            # any synth.py output folder (DIR/candidates.jsonl, funnel.json)

synth.py writes one line per checked candidate to DIR/candidates.jsonl: its verdict, the seconds its child spent
per phase ("t"), its turns at the device lock ("turns": asked, got, released, wall clock) and the eager-time
estimate from a few rows ("row_est_ms"). This script sums them into the numbers that explain a throughput
measurement (bench/synth_bench.py prints them for every run):
  seconds per candidate   start (child start-up, charged to its first candidate), setup, warm (runs on a few
                          rows outside the lock), wait (for the lock), locked (eager/compile runs, checks,
                          timing), first (the first full run, within locked), compile;
  device lock             how long it was held, and how long a worker waited while nobody held it (should be ~0);
  row estimate            estimate / measured eager time on kept tasks (the filter drops a task estimated over
                          10x the window: ratios near 10 would mean false drops);
  longest turns           the longest turns under the lock (one long turn stalls every worker).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

PHASES = ("start", "setup", "warm", "wait", "locked", "first", "compile")


def lock_use(turns: list) -> dict:
    """From every turn at the device lock, (asked, got, released) wall-clock times: how long the lock was held
    (the union of turns), and how long someone waited while nobody held it (should be ~0)."""
    events = sorted([(a, 0) for a, b, c in turns] + [(b, 1) for a, b, c in turns] + [(b, 2) for a, b, c in turns] +
                    [(c, 3) for a, b, c in turns])
    held = free_wait = 0.0
    holding = waiting = 0
    last = events[0][0] if events else 0.0
    for t, kind in events:
        held += (t - last) if holding else 0.0
        free_wait += (t - last) if waiting and not holding else 0.0
        last = t
        waiting += {0: 1, 1: -1}.get(kind, 0)
        holding += {2: 1, 3: -1}.get(kind, 0)
    span = (events[-1][0] - events[0][0]) if events else 0.0
    return {"span_s": round(span, 1), "held_s": round(held, 1), "waited_while_free_s": round(free_wait, 1)}


def row_estimate_quality(records: list[dict]) -> dict:
    """Estimate from a few rows / measured eager time, on the kept tasks."""
    ratios = sorted(r["row_est_ms"] / r["eager_ms"] for r in records if r["kept"] and r.get("row_est_ms"))
    q = lambda p: round(ratios[min(len(ratios) - 1, int(p * len(ratios)))], 2) if ratios else None
    return {"n": len(ratios), "median_ratio": q(0.5), "p95_ratio": q(0.95), "max_ratio": q(1.0)}


def diagnose(records: list[dict]) -> dict:
    """The filter's time by phase (summed over candidates), the lock's use, the row estimate's quality and the
    eight longest turns under the lock."""
    secs = collections.Counter()
    for r in records:
        secs.update(r.get("t", {}))
    longest = sorted((r for r in records if r.get("t")), key=lambda r: -r["t"].get("locked", 0.0))[:8]
    return {"n": len(records), "child_seconds": {k: round(v, 1) for k, v in secs.items()},
            "lock": lock_use([t for r in records for t in r.get("turns", [])]),
            "row_estimate": row_estimate_quality(records),
            "longest_locked": [{"ops": r.get("ops", []), "locked_s": r["t"].get("locked", 0.0),
                                "first_run_s": r["t"].get("first", 0.0),
                                "verdict": "kept" if r["kept"] else r.get("drop", "")[:120]} for r in longest]}


def lines(diag: dict, workers: int) -> list[str]:
    n, cs, lock, est = max(1, diag["n"]), diag["child_seconds"], diag["lock"], diag["row_estimate"]
    out = [f"execution, seconds per candidate ({workers} workers, {diag['n']} candidates): "
           + " | ".join(f"{k} {cs.get(k, 0) / n:.2f}" for k in PHASES),
           f"device lock: held {lock['held_s']:.0f} s of {lock['span_s']:.0f} s; waited for while free "
           f"{lock['waited_while_free_s']:.1f} s"]
    if est["n"]:
        out.append(f"estimate from a few rows / measured eager time ({est['n']} tasks): median {est['median_ratio']}, "
                   f"p95 {est['p95_ratio']}, max {est['max_ratio']} (a task estimated over 10x the window is dropped)")
    out.append("longest turns under the lock: " + "; ".join(
        f"{x['locked_s']:.1f} s (first run {x['first_run_s']:.1f} s) {' -> '.join(x['ops'])}: {x['verdict'][:60]}"
        for x in diag["longest_locked"][:3]))
    return out


def load(out_dir) -> tuple[list[dict], dict]:
    """(records, funnel) of a synth.py output folder."""
    d = Path(out_dir)
    if not (d / "candidates.jsonl").is_file() or not (d / "funnel.json").is_file():
        raise SystemExit(f"synth_diag.py: error: {d} has no candidates.jsonl and funnel.json (not a synth.py output)")
    records = [json.loads(x) for x in (d / "candidates.jsonl").read_text().splitlines() if x.strip()]
    return records, json.loads((d / "funnel.json").read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="a synth.py output folder")
    p.add_argument("--json", action="store_true", help="print the diagnostics as JSON instead")
    a = p.parse_args(argv)
    records, funnel = load(a.out)
    diag = diagnose(records)
    print(json.dumps(diag) if a.json else "\n".join(lines(diag, funnel["config"]["workers"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
