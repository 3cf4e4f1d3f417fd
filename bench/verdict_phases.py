"""Where a run's verdicts spent their time: every verdict that episodes saved (env.Verdict.phases of each `compile`,
`verify` and `profile` tool call, and of the episode's final score), read back from the episode files of a
train.py run (trajectories, demonstrations, rollouts, held-out episodes). Prints one table: per kind of verdict,
how many, and the median and mean seconds of each phase.

    python bench/verdict_phases.py runs/default/sft/teacher      # the teacher's chunks (every *.jsonl under it)
    python bench/verdict_phases.py runs/default/eval             # the held-out episodes of every stage
    python bench/verdict_phases.py a.jsonl b.jsonl --json phases.json

An episode is counted once, however many files hold it (a run keeps each episode in more than one: a chunk's
trajectories and demonstrations, an evaluation's rows and its agent's trajectories), by its workspace. An
episode's first profile call is counted apart from its later ones: it times the task's baselines (eager,
torch.compile) unless they are cached, after every live candidate has finished. Verdicts run side by side in
training (train.py's tool_workers per rank): the phases include waiting for the device and the CPU, which a
verdict alone (bench/env_bench.py) does not.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

TOOLS = ("compile", "verify", "profile")


def episode_files(paths):
    """Every .jsonl file named, or found under a folder named (sorted); a line that is not an episode is skipped."""
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(p.rglob("*.jsonl"))
        elif p.is_file():
            yield p
        else:
            raise SystemExit(f"verdict_phases.py: error: {p}: no such file or folder")


def verdicts(path, seen: set):
    """(kind, verdict dict) for every timed verdict of every episode in one .jsonl file that is not in `seen` (the
    workspaces of the episodes read so far; this file's are added)."""
    for line in path.read_text().splitlines():
        try:
            ep = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(ep, dict) or not isinstance(ep.get("turns"), list):
            continue
        if ep.get("workspace"):  # (an episode's workspace folder is its own: the key of its copies)
            if ep["workspace"] in seen:
                continue
            seen.add(ep["workspace"])
        profiles = 0
        for t in ep["turns"]:
            if not isinstance(t, dict):
                continue
            v = t.get("verdict")
            if t.get("tool") in TOOLS and isinstance(v, dict) and isinstance(v.get("phases"), dict):
                kind = t["tool"]
                if kind == "profile":
                    kind, profiles = ("profile, first" if profiles == 0 else "profile, later"), profiles + 1
                yield kind, v
        if isinstance(ep.get("verdict"), dict) and isinstance(ep["verdict"].get("phases"), dict):
            yield "final score", ep["verdict"]


def table(rows_by_kind):
    """{kind: [verdict]} -> the printed table's lines: one column pair (median, mean) per kind."""
    kinds = [k for k in ("compile", "verify", "profile, first", "profile, later", "final score") if rows_by_kind.get(k)]
    phases = []
    for k in kinds:
        for v in rows_by_kind[k]:
            phases += [p for p in v["phases"] if p not in phases]
    head = "| phase (s) | " + " | ".join(f"{k}: median | mean" for k in kinds) + " |"
    lines = [head, "|---|" + "---|---|" * len(kinds)]
    lines.append("| verdicts | " + " | ".join(f"{len(rows_by_kind[k])} | {len(rows_by_kind[k])}" for k in kinds) + " |")

    def cells(get):
        out = []
        for k in kinds:
            xs = [get(v) for v in rows_by_kind[k]]
            xs = [x for x in xs if isinstance(x, (int, float))]
            out.append(f"{statistics.median(xs):.2f} | {statistics.mean(xs):.2f}" if xs else "- | -")
        return out
    lines.append("| whole verdict | " + " | ".join(cells(lambda v: v.get("seconds"))) + " |")
    for p in phases:  # (a phase a verdict never reached counts as 0 s for it)
        lines.append(f"| {p} | " + " | ".join(cells(lambda v: v["phases"].get(p, 0.0))) + " |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="trajectories / evaluation .jsonl files, or folders holding them")
    ap.add_argument("--json", help="also write {kind: {phase: median}} here")
    a = ap.parse_args(argv)
    by_kind, files, seen = {}, 0, set()
    for f in episode_files(a.paths):
        files += 1
        for kind, v in verdicts(f, seen):
            by_kind.setdefault(kind, []).append(v)
    if not by_kind:
        print(f"verdict_phases.py: error: no verdict with phases in {files} file(s)", file=sys.stderr)
        return 2
    print(f"verdicts of {sum(map(len, by_kind.values()))} tool calls and final scores, from {files} file(s)\n")
    print("\n".join(table(by_kind)))
    if a.json:
        med = {k: {p: statistics.median(v["phases"].get(p, 0.0) for v in vs) for p in {p for v in vs for p in v["phases"]}}
               for k, vs in by_kind.items()}
        Path(a.json).write_text(json.dumps(med, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
