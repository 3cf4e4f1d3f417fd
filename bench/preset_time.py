"""bench/preset_time.py: how long would a train.py preset take, projected from a shorter run of it.

    # a short run of the default preset (2 warm-up steps, 2 PPO steps, 16 RFT tasks), then the projection
    python train.py --stage all --run-dir runs/short --set warmup_steps=2 --set ppo_steps=2 --set rft_tasks=16
    python bench/preset_time.py runs/short --preset default
    # the same run projected to the paper's preset (a different shape: see "shape" below)
    python bench/preset_time.py runs/short --preset paper
    # CPU smoke test
    python bench/preset_time.py runs/tiny --preset tiny

Reads RUN_DIR/metrics.jsonl and RUN_DIR/config.json and cuts the run into phases at its records' times (each
held-out evaluation is its own phase, so no stage's time includes one; the time between a kill and a --resume
is not counted). Each phase's seconds are scaled by the ratio of its size in the preset to its size in the run:
  sft teacher      the teacher's episodes (scripted or --teacher-url), by training tasks it works x samples
  sft training     by epochs x demonstrations (taken to grow with the teacher's tasks)
  warmup, ppo      by steps (the mean step time)
  rft rollouts     by RFT tasks; rft training by RFT tasks x epochs
  critic training  by RFT tasks x epochs: the epochs the run's early stopping took, or, when the run ran all
                   the epochs it was allowed (--set critic_epochs=2 in a short run), the preset's limit (at most)
  held-out evals   all of them; generation as it was (the held-out tasks are one engine batch, whose decode steps
                   cost about the same for more tasks: a lower bound), tool calls and scoring by eval tasks
Shape: when the preset's batch, turns or context differ from the run's (e.g. the paper preset from a default
run), rollout and update phases are also scaled by tokens: per episode, min(max_context, max_turns x
max_new_tokens) (warmup_new_tokens in the warm-up), and per step, tasks per step x that. Rough: a bigger batch costs
a decode step little more, a longer context costs attention more than linearly. For a real figure run the
short run with the preset's shape. Not included: dataset synthesis and model loading before the first
evaluation (the "start" record's setup_s; synth.py reports its own tasks/hour).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runs  # noqa: E402
import stages  # noqa: E402
import train  # noqa: E402


def read_run(run: Path) -> tuple[dict, list]:
    """(config.json, metrics.jsonl records) of a train.py run folder."""
    if not (run / "metrics.jsonl").is_file() or not (run / "config.json").is_file():
        raise SystemExit(f"preset_time.py: error: {run} has no metrics.jsonl and config.json (not a train.py run folder)")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return json.loads((run / "config.json").read_text()), recs


def preset(name: str) -> dict:
    return {**train.dataclasses.asdict(train.Config()), **train.PRESETS[name]}


def episode_tokens(c: dict, multi_turn: bool = True) -> int:
    """The tokens an episode can reach under config c (a random model reaches them; a trained one stops earlier)."""
    if not multi_turn:  # the warm-up's one answer (runs from before warmup_new_tokens had max_new_tokens)
        return min(c["max_context"], c.get("warmup_new_tokens", c["max_new_tokens"]))
    return min(c["max_context"], c["max_new_tokens"] * c["max_turns"])


def peak(recs: list, kind: str = "peak_gb") -> float | None:
    """The highest GPU peak (GiB) among records (runs.gpu_peak: a step's rollout and update peaks alike); kind
    "reserved_gb": the caching allocator's."""
    vals = [r[k] for r in recs for k in (kind, f"rollout_{kind}") if r.get(k) is not None]
    return max(vals) if vals else None


def project(cfg: dict, recs: list, target: dict) -> list[dict]:
    """The run's phases, in run order: {name, secs, have, want, shape, proj (projected seconds), peak_gb}.
    Phases the run did not reach (skipped, or it died before them) are left out. A resumed run (a "start"
    event after the first) does not count the time between its kill and its restart."""
    steps = {s: [r for r in recs if r.get("stage") == s and "event" not in r] for s in stages.STAGES}
    ends = {r["stage"]: r for r in recs if r.get("event") == "stage_end"}
    evals = {r["stage"]: r for r in recs if r.get("event") == "eval"}
    starts = [r["time"] for r in recs if r.get("event") == "start"]
    rft_filter = next((r for r in recs if r.get("event") == "rft_filter"), None)
    after = lambda s: (evals.get(s) or ends.get(s) or {}).get("time")  # the end of a stage and of its evaluation
    span = lambda t0, t1: t1 - max([t0] + [t for t in starts if t < t1])  # from t0 or the last restart before t1
    per_ep = episode_tokens(target) / episode_tokens(cfg)
    per_step = target["tasks_per_step"] * per_ep / cfg["tasks_per_step"]
    warm_step = target["tasks_per_step"] * episode_tokens(target, False) / (cfg["tasks_per_step"] * episode_tokens(cfg, False))
    rows = []

    def add(name, secs, have, want, shape, of, proj=None):
        rows.append({"name": name, "secs": secs, "have": have, "want": want, "shape": shape, "peak_gb": peak(of),
                     "reserved_gb": peak(of, "reserved_gb"),
                     "proj": secs * shape * want / max(have, 1e-9) if proj is None else proj})

    teacher_tasks = lambda c: (c["sft_tasks"] or max(c["synth_tasks"] - c["eval_tasks"], 1)) * c["sft_samples"]
    if "sft" in ends and after("base") is not None:
        first = steps["sft"][0] if steps["sft"] else None
        have = ends["sft"].get("tasks", 0) * cfg["sft_samples"]
        add("sft teacher", span(after("base"), first["time"] - first["s_step"] if first else ends["sft"]["time"]), have,
            teacher_tasks(target), 1.0, [])
        if steps["sft"]:
            add("sft training", sum(r["s_step"] for r in steps["sft"]), len(steps["sft"]) * have,
                target["sft_epochs"] * teacher_tasks(target), 1.0, steps["sft"] + [ends["sft"]])
    if steps["warmup"]:
        add("warmup (per step)", sum(r["s_step"] for r in steps["warmup"]), len(steps["warmup"]), target["warmup_steps"],
            warm_step, steps["warmup"])
    if rft_filter is not None and after("warmup") is not None:
        add("rft rollouts", span(after("warmup"), rft_filter["time"]), cfg["rft_tasks"], target["rft_tasks"], per_ep,
            [rft_filter])
        if "rft" in ends:
            add("rft training", span(rft_filter["time"], ends["rft"]["time"]), cfg["rft_tasks"] * cfg["rft_epochs"],
                target["rft_tasks"] * target["rft_epochs"], per_ep, steps["rft"] + [ends["rft"]])
    before = "rft" if "rft" in ends else "warmup"  # --skip rft: the critic stage rolls out its own episodes
    if "critic" in ends and after(before) is not None:
        # epochs: as many as the run's early stopping took, if it stopped before its limit; else the preset's limit
        ran = max(len(steps["critic"]), 1)
        epochs = ran if ran < cfg["critic_epochs"] else target["critic_epochs"]
        add("critic training", span(after(before), ends["critic"]["time"]), cfg["rft_tasks"] * ran,
            target["rft_tasks"] * epochs, per_ep, steps["critic"] + [ends["critic"]])
    if steps["ppo"]:
        add("ppo (per step)", sum(r["s_step"] for r in steps["ppo"]), len(steps["ppo"]), target["ppo_steps"], per_step,
            steps["ppo"])
    if evals:
        # all held-out tasks are one engine batch: generation time taken as independent of their number (a lower
        # bound: attention over more slots costs more), tool calls and scoring as proportional to it
        done = list(evals.values())
        have, secs = max(r.get("n") or 0 for r in done), sum(r.get("eval_s") or 0 for r in done)
        gen = sum(r.get("generate_s") or 0 for r in done)
        add(f"held-out evals ({len(done)})", secs, have, target["eval_tasks"], per_ep, done,
            proj=gen * per_ep + (secs - gen) * per_ep * target["eval_tasks"] / max(have, 1))
    return rows


def missing_stages(recs: list, cfg: dict) -> list:
    """The stages of the run that never logged their end (still running, killed, or out of memory)."""
    ends = {r["stage"] for r in recs if r.get("event") == "stage_end"}
    return [s for s in stages.STAGES if s not in ends and s not in cfg.get("skip", [])]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--preset", default="default", choices=list(train.PRESETS))
    a = ap.parse_args(argv)
    run = Path(a.run_dir)
    cfg, recs = read_run(run)
    target = preset(a.preset)
    rows = project(cfg, recs, target)
    if not rows:
        raise SystemExit(f"preset_time.py: error: {run} has no finished phase yet (the first is the base evaluation)")
    print(f"run {run} (preset {cfg['preset']}) -> preset {a.preset}")
    diff = [k for k in ("tasks_per_step", "max_new_tokens", "max_turns", "max_context") if cfg[k] != target[k]]
    if diff:
        print("shape differs (" + ", ".join(f"{k} {cfg[k]} -> {target[k]}" for k in diff) + "): rollout and update "
              "phases scaled by tokens per step as well (rough; see the docstring)")
    print(f"{'phase':<20} {'measured s':>10} {'run size':>9} {'preset':>7} {'shape':>6} {'projected s':>12}")
    for r in rows:
        print(f"{r['name']:<20} {r['secs']:>10.1f} {r['have']:>9} {r['want']:>7} {r['shape']:>6.2f} {r['proj']:>12.1f}")
    missing = missing_stages(recs, cfg)
    total = sum(r["proj"] for r in rows)
    print(f"{'total':<20} {sum(r['secs'] for r in rows):>10.1f} {'':>9} {'':>7} {'':>6} {total:>12.1f}  = {runs.fmt_time(total)}"
          + (f"  (incomplete: no end of {', '.join(missing)})" if missing else ""))
    print("not included: model loading and dataset synthesis before the first evaluation (see synth.py's own tasks/hour)")


if __name__ == "__main__":
    main()
