"""bench/preset_time.py: how long would a train.py preset take, projected from a shorter run of it.

    # a short run of the default preset (2 warm-up steps, 2 PPO steps, 16 RFT tasks), then the projection
    python train.py --stage all --run-dir runs/short --set warmup_steps=2 --set ppo_steps=2 --set rft_tasks=16
    python bench/preset_time.py runs/short --preset default
    # CPU smoke test
    python bench/preset_time.py runs/tiny --preset tiny

Reads RUN_DIR/metrics.jsonl and RUN_DIR/config.json. Each stage's measured seconds are scaled by the ratio of
its size in the preset to its size in the run: warm-up and PPO by steps (the mean step time), RFT rollouts and
the RFT/critic training by RFT tasks, the held-out evaluation by eval tasks. Not included: model loading
and dataset synthesis before the first step (synth.py reports its own tasks/hour). Only stage sizes are
scaled: run the short run with the preset's other settings (batch, turns, lengths) unchanged.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runs  # noqa: E402
import stages  # noqa: E402
import train  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("run_dir")
ap.add_argument("--preset", default="default", choices=list(train.PRESETS))
a = ap.parse_args()
run = Path(a.run_dir)
if not (run / "metrics.jsonl").is_file() or not (run / "config.json").is_file():
    sys.exit(f"preset_time.py: error: {run} has no metrics.jsonl and config.json (not a train.py run folder)")
cfg = json.loads((run / "config.json").read_text())
target = {**train.dataclasses.asdict(train.Config()), **train.PRESETS[a.preset]}
recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
steps = {s: [r for r in recs if r.get("stage") == s and "event" not in r] for s in stages.STAGES}
ends = {r["stage"]: r["time"] for r in recs if r.get("event") == "stage_end"}
events = {r["event"]: r for r in recs if "event" in r}
if not steps["warmup"]:
    sys.exit(f"preset_time.py: error: {run} has no finished warm-up step yet")

rows = []  # (stage, measured seconds, run size, preset size, projected seconds)


def add(name, secs, have, want):
    rows.append((name, secs, have, want, secs * want / max(have, 1)))


add("warmup (per step)", sum(r["s_step"] for r in steps["warmup"]), len(steps["warmup"]), target["warmup_steps"])
if "rft_filter" in events and "warmup" in ends:
    add("rft rollouts", events["rft_filter"]["time"] - ends["warmup"], cfg["rft_tasks"], target["rft_tasks"])
if "rft" in ends and "rft_filter" in events:
    add("rft training", ends["rft"] - events["rft_filter"]["time"], cfg["rft_tasks"], target["rft_tasks"])
if "critic" in ends and "rft" in ends:
    add("critic training", ends["critic"] - ends["rft"], cfg["rft_tasks"], target["rft_tasks"])
if steps["ppo"]:
    add("ppo (per step)", sum(r["s_step"] for r in steps["ppo"]), len(steps["ppo"]), target["ppo_steps"])
if "eval" in events and "ppo" in ends:
    add("held-out eval", events["eval"]["time"] - ends["ppo"], cfg["eval_tasks"], target["eval_tasks"])

print(f"run {run} (preset {cfg['preset']}) -> preset {a.preset}")
print(f"{'stage':<18} {'measured s':>10} {'run size':>9} {'preset':>7} {'projected s':>12}")
for name, secs, have, want, proj in rows:
    print(f"{name:<18} {secs:>10.1f} {have:>9} {want:>7} {proj:>12.1f}")
missing = [s for s in ("warmup", "rft", "critic", "ppo") if s not in ends]
total = sum(r[4] for r in rows)
print(f"{'total (stages)':<18} {sum(r[1] for r in rows):>10.1f} {'':>9} {'':>7} {total:>12.1f}  = {runs.fmt_time(total)}"
      + (f"  (incomplete: no end of {', '.join(missing)})" if missing else ""))
print("not included: model loading and dataset synthesis before the first step (see synth.py's own tasks/hour)")
