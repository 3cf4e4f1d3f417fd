"""stages.py: the result of a train.py run: after every stage one row of held-out evaluation (well-formed tool
calls, built kernels, pass rate, faster than eager, faster than torch.compile, mean reward, mean turns, a note on
what the stage did) in RUN/stages.jsonl, printed as one table at the end and drawn in RUN/stages.png
(docs/curriculum.md says how to read it).
train.py runs the greedy episodes; this module turns them into rows and reads the rows back.
"""
from __future__ import annotations

import json
from pathlib import Path

from reward import summarize
from rollouts import harness_failed

STAGES = ("sft", "warmup", "rft", "critic", "ppo")  # train.py's stages, in run order


def eval_row(stage: str, eps: list, note: str) -> dict:
    """A stage's row from its held-out episodes, with metrics from reward.summarize (evaluate.py's definitions).
    A harness failure counts as a failure, as in evaluate.py; the note says how many there were.
    Two rates come before `pass`, because a small model learns them first: `calls`, the share of all turns that
    were a well-formed tool call (the rest are text the loop could not parse), and `built`, the share of tasks
    whose final workspace compiled (with an allowed extension)."""
    res = summarize([{"verdict": e.get("verdict") or {}, "n_turns": e.get("n_turns"), "n_tokens": len(e["tokens"])}
                     for e in eps])
    turns = sum(e.get("n_turns") or 0 for e in eps)
    row = {"stage": stage, "n": res["n"],
           "calls": (turns - sum(e.get("malformed_calls") or 0 for e in eps)) / turns if turns else None,
           "built": sum(bool((e.get("verdict") or {}).get("compiled")) for e in eps) / max(len(eps), 1),
           "pass": res["pass_rate"], "faster_eager": res["faster_eager_rate"],
           "faster_compile": res["faster_compile_rate"], "reward": sum(e["reward"] for e in eps) / max(len(eps), 1),
           "turns": res["mean_turns"], "geomean_compile": res["geomean_speedup_compile"],
           "harness_fail": sum(harness_failed(e) for e in eps),  # counted as failures, as in evaluate.py
           "note": note}
    if row["harness_fail"]:
        row["note"] += f" ({row['harness_fail']} harness failures counted as failures)"
    return row


def read_rows(run_dir: Path) -> list:
    f = run_dir / "stages.jsonl"
    rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []
    order = ("base",) + STAGES
    return sorted(rows, key=lambda r: order.index(r["stage"]) if r["stage"] in order else len(order))


def stage_note(run_dir: Path, stage: str) -> str:
    """What the stage did, from its metrics (the table's last column)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if (run_dir / "metrics.jsonl").is_file() else []
    end = next((r for r in reversed(recs) if r.get("event") == "stage_end" and r.get("stage") == stage), {})
    steps = [r for r in recs if r.get("stage") == stage and "event" not in r]
    num = lambda x: "-" if x is None else f"{x:+.3f}"
    if stage == "sft":
        losses = [r["loss"] for r in steps if r.get("loss") is not None]
        return (f"demonstrations {end.get('demos', 0)} of {end.get('episodes', 0)} teacher episodes ({end.get('tasks', 0)} tasks)"
                + (f"; loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} epochs" if len(losses) > 1 else
                   f"; loss {losses[0]:.3f} (1 epoch)" if losses else ""))
    if stage == "rft":
        return f"kept {end.get('kept')} of {end.get('episodes')} own episodes"
    if stage == "critic":
        return f"critic explained variance {num(end.get('ev_before'))} -> {num(end.get('ev'))}"
    note = f"{len(steps)} step{'' if len(steps) == 1 else 's'}; training reward {num(end.get('reward'))}"
    # (a batch without two different rewards leaves the actor as it was: rl.py. A row after a stage that never
    # updated it differs from the row before by the verdicts' noise only, and must not read as the stage's effect.)
    skipped = sum(bool(r.get("pg_skipped")) for r in steps)
    if steps and skipped == len(steps):
        note += "; the actor was not updated at any step (no batch had two different rewards)"
    elif skipped:
        note += f"; the actor was updated at {len(steps) - skipped} of {len(steps)} steps"
    return note


def stage_table(rows: list) -> str:
    """The run's result: one row per stage (held-out well-formed calls, built, pass rate, faster than eager /
    torch.compile, mean reward, mean turns)."""
    num = lambda x, spec, w: f"{'-':>{w}}" if x is None else f"{x:{spec}}"
    lines = [f"{'stage':<8} {'tasks':>5} {'calls':>6} {'built':>6} {'pass':>6} {'>eager':>7} {'>compile':>8} {'reward':>7} "
             f"{'turns':>6}  note", "-" * 110]
    for r in rows:
        lines.append(f"{r['stage']:<8} {r['n']:>5} {num(r.get('calls'), '6.2f', 6)} {num(r.get('built'), '6.2f', 6)} "
                     f"{num(r['pass'], '6.2f', 6)} {num(r['faster_eager'], '7.2f', 7)} "
                     f"{num(r['faster_compile'], '8.2f', 8)} {num(r['reward'], '+7.3f', 7)} {num(r['turns'], '6.1f', 6)}  "
                     f"{r.get('note', '')}")
    return "\n".join(["held-out evaluation (greedy, agent mode, scored by env.py), after each stage:"] + lines)


def stage_chart(rows: list, path: Path) -> bool:
    """RUN/stages.png: the rates per stage as bars (well-formed calls, built, pass, faster than eager / compile), the
    mean reward as a line. False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    bars = (("calls", "well-formed calls"), ("built", "built"), ("pass", "pass"), ("faster_eager", "faster than eager"),
            ("faster_compile", "faster than torch.compile"))
    for i, (k, label) in enumerate(bars):
        ax.bar([j + (i - 2) * 0.17 for j in x], [r.get(k) or 0 for r in rows], 0.17, label=label)
    ax.set_xticks(list(x), [r["stage"] for r in rows])
    ax.set_ylim(0, 1)
    ax.set_ylabel(f"share of {rows[0]['n'] if rows else 0} held-out tasks (calls: of turns)")
    ax2 = ax.twinx()
    ax2.plot(list(x), [r["reward"] for r in rows], "k.-", label="mean reward")
    ax2.set_ylim(-1.1, 3.1)
    ax2.set_ylabel("mean reward (-1 .. 3)")
    ax.set_title("held-out evaluation after each stage")
    fig.legend(loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def all_rewards_minus_one(run_dir: Path, rows: list) -> bool:
    """True when every logged training step and every held-out row had mean reward -1."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if (run_dir / "metrics.jsonl").is_file() else []
    rewards = [r["reward"] for r in recs if r.get("reward") is not None and "event" not in r] + [r["reward"] for r in rows]
    return bool(rewards) and all(x == -1 for x in rewards)


def minus_one_note(run_dir: Path, tiny: bool, preset: str) -> str:
    """What the end of a run says when every reward was -1 (all_rewards_minus_one): expected of a tiny random
    model or of the 135M model at the cpu preset; otherwise where to look."""
    return "note: every reward in this run was -1 (no kernel was both built and correct). " + (
        f"That is expected for {'a tiny random model' if tiny else 'the 135M model on a CPU'} at "
        f"preset {preset!r}: this run shows that every stage works end to end, not that the model learns"
        if tiny or preset == "cpu" else
        f"Look at the sft row (demonstrations, loss) and the held-out episodes in {run_dir / 'eval'}")
