"""How long the teacher's chunks take when its episodes play in lockstep and when each plays on a thread of its own,
replayed from the tool-call times its episodes recorded (no GPU, no verdicts: a list schedule of the recorded times).

    python bench/teacher_replay.py RUN/sft/teacher/rank0 [--workers 8]

Per chunk (chunk-N/trajectories.jsonl): lockstep, as agent.run_episodes plays a batched policy (every turn's calls of
the live episodes on `workers` threads, the turn over when the last one is; the final scores together at the end);
one thread per episode (agent.run_episodes for batched = False: each episode's calls one after another, `workers`
episodes at a time); and every chunk in one streamed call (teacher.make_demos). A call's time is what its observation
says (compile, verify, profile: "... | 12.3s" or "compiled OK (1.2s)"), the final score's its verdict's seconds; the
turns that write files count 0. An estimate: a verdict's time depends on how many run beside it.
"""
import argparse
import heapq
import json
import re
import sys
from pathlib import Path

TIMED = ("compile", "verify", "profile")


def call_times(ep: dict) -> list[float]:
    """Seconds of each turn's tool call, then of the final score."""
    out = []
    for t in ep["turns"]:
        head = (t.get("observation") or "").split("\n")[0]
        m = re.search(r"\| ([\d.]+)s$", head) or re.search(r"\(([\d.]+)s\)", head)
        out.append(float(m.group(1)) if m and t.get("tool") in TIMED else 0.0)
    return out + [float((ep.get("verdict") or {}).get("seconds") or 0.0)]


def makespan(jobs: list[float], workers: int) -> float:
    """Jobs started in order on `workers` threads, each as soon as one is free: when the last ends."""
    free, end = [0.0] * workers, 0.0
    for d in jobs:
        start = heapq.heappop(free)
        heapq.heappush(free, start + d)
        end = max(end, start + d)
    return end


def lockstep(episodes: list[list[float]], workers: int) -> float:
    turns = max(len(e) - 1 for e in episodes)
    return sum(makespan([e[k] for e in episodes if k < len(e) - 1], workers) for k in range(turns)) + \
        makespan([e[-1] for e in episodes], workers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("teacher_dir", help="a rank's teacher folder: RUN/sft/teacher/rank0 (its chunk-N/ folders)")
    p.add_argument("--workers", type=int, default=8, help="tool calls at once (train.py: tool_workers)")
    a = p.parse_args(argv)
    chunks = sorted(Path(a.teacher_dir).glob("chunk-*/trajectories.jsonl"))
    if not chunks or a.workers < 1:
        sys.exit(f"teacher_replay.py: no chunk-*/trajectories.jsonl in {a.teacher_dir}" if not chunks else
                 "teacher_replay.py: --workers must be >= 1")
    rows, every = [], []
    for f in chunks:
        eps = [call_times(json.loads(x)) for x in f.read_text().splitlines() if x.strip()]
        every += eps
        rows.append((f.parent.name, len(eps), lockstep(eps, a.workers), makespan([sum(e) for e in eps], a.workers)))
    print(f"teacher_replay | {a.teacher_dir} | {len(every)} episodes | {a.workers} tool calls at once\n")
    print("| chunk | episodes | lockstep | one thread per episode |\n|---|---|---|---|")
    for name, n, lock, own in rows:
        print(f"| {name} | {n} | {lock:.0f} s | {own:.0f} s |")
    lock, own = sum(r[2] for r in rows), sum(r[3] for r in rows)
    print(f"| all, chunk after chunk | {len(every)} | {lock:.0f} s | {own:.0f} s ({own / lock - 1:+.0%}) |")
    one = makespan([sum(e) for e in every], a.workers)
    print(f"| all, every chunk in one call | {len(every)} | | {one:.0f} s ({one / lock - 1:+.0%}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
