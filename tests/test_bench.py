"""bench/: CPU smoke runs of the benchmark scripts the README documents, and preset_time.py's projection
checked against hand-computed numbers. (The figures themselves come from `bash bench/run_h200.sh` on a GPU.)"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import synth_diag  # noqa: E402
import train  # noqa: E402


def bench(script, *args, timeout=600):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_rollout_bench_tiny_with_profile(tmp_path):
    out = bench("rollout_bench.py", "--device", "cpu", "--tiny", "--batch", "1,2", "--prompt-len", "16", "--new-tokens", "8",
                "--baseline-tokens", "4", "--configs", "static,ours", "--profile", "--json", str(tmp_path / "r.json"))
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {(r["batch"], r["config"]) for r in rows} == {(1, "static"), (1, "ours"), (2, "static"), (2, "ours")}
    ours = [r for r in rows if r["config"] == "ours"]
    assert all(r["same_as_static"] == 1.0 and r["tok_s"] > 0 for r in ours), ours  # fp32: token-identical to HF...
    assert all(r["common_prefix"] == 4 for r in ours)  # ...over the 4 tokens HF generated (--baseline-tokens)
    assert all(r["ms_per_step"] * 4 == pytest.approx(r["seconds"] * 1e3) for r in rows if r["config"] == "static")
    assert "profile | batch 2 | ours" in out and "| static | " in out and "x static)" in out


def test_train_bench_tiny_update():
    out = bench("train_bench.py", "--device", "cpu", "--tiny", "--no-split", "--no-trl")
    row = next(json.loads(x) for x in out.splitlines() if x.startswith('{"impl": "train.py"'))
    assert row["model"] == "tiny" and row["tok_s"] > 0 and row["update_s"] > 0
    assert "PPO update (same batch, lengths, epochs, minibatches)" in out


def test_train_bench_saves_a_random_model_of_the_embedded_shape(tmp_path):
    """--save-random: what bash bench/run_h200.sh default-random trains (train.py --model DIR)."""
    out = bench("train_bench.py", "--save-random", str(tmp_path / "m"))
    assert "saved random-135m" in out
    cfg, tok = AutoConfig.from_pretrained(tmp_path / "m"), AutoTokenizer.from_pretrained(tmp_path / "m")
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert tok.chat_template and cfg.eos_token_id == tok.eos_token_id


def test_preset_time_projects_each_stage(tmp_path):
    """A made-up short run: 2 warm-up steps of 10 s and 20 s, 16 RFT tasks rolled out in 40 s, RFT training 8 s,
    critic 4 s, 2 PPO steps of 30 s, a 16-task evaluation in 12 s; projected to the default preset (10 warm-up
    steps, 32 RFT tasks, 10 PPO steps, 16 eval tasks)."""
    cfg = dict(train.dataclasses.asdict(train.Config()), warmup_steps=2, ppo_steps=2, rft_tasks=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t = 1000.0
    recs = [{"stage": "warmup", "step": 1, "s_step": 10.0, "time": t + 10}, {"stage": "warmup", "step": 2, "s_step": 20.0, "time": t + 30},
            {"event": "stage_end", "stage": "warmup", "time": t + 30}, {"event": "rft_filter", "time": t + 70},
            {"stage": "rft", "step": 1, "s_step": 8.0, "time": t + 78}, {"event": "stage_end", "stage": "rft", "time": t + 78},
            {"stage": "critic", "step": 1, "s_step": 4.0, "time": t + 82}, {"event": "stage_end", "stage": "critic", "time": t + 82},
            {"stage": "ppo", "step": 1, "s_step": 30.0, "time": t + 112}, {"stage": "ppo", "step": 2, "s_step": 30.0, "time": t + 142},
            {"event": "stage_end", "stage": "ppo", "time": t + 142}, {"event": "eval", "time": t + 154}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = bench("preset_time.py", str(tmp_path), "--preset", "default")
    proj = {line[:18].strip(): float(line.split()[-1]) for line in out.splitlines()
            if line[:18].strip() in ("warmup (per step)", "rft rollouts", "rft training", "critic training", "ppo (per step)", "held-out eval")}
    # warm-up: mean 15 s x 10; RFT and critic: x 32/16; PPO: 30 s x 10; eval: 16/16
    assert proj == {"warmup (per step)": 150.0, "rft rollouts": 80.0, "rft training": 16.0, "critic training": 8.0,
                    "ppo (per step)": 300.0, "held-out eval": 12.0}, out
    assert "566.0  = 9m26s" in out, out
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "preset_time.py"), str(tmp_path / "nope")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().startswith("preset_time.py: error:"), r.stderr


def test_synth_bench_tiny(tmp_path):
    out = bench("synth_bench.py", "--backend", "cpu", "--num-tasks", "2", "--workers", "2", "--window-ms", "0.05", "20",
                "--json", str(tmp_path / "s.json"))
    row = json.loads((tmp_path / "s.json").read_text())[0]
    assert row["kept"] == 2 and row["executed"] >= 2 and row["tasks_per_hour"] > 0, row
    assert row["lock_held_s"] >= 0 and row["lock_free_wait_s"] >= 0
    assert "| backend | workers |" in out and "execution drops" in out
    # the filter's diagnostics, summed from synth.py's candidates.jsonl (bench/synth_diag.py)
    assert "execution, seconds per candidate (2 workers, " in out and "longest turns under the lock: " in out
    assert "device lock: held " in out


def test_synth_diag_sums_candidate_records(tmp_path):
    """bench/synth_diag.py on made-up records: two candidates, one kept with an estimate twice its eager time."""
    t = lambda locked, **k: dict({p: 0.0 for p in synth_diag.PHASES}, locked=locked, **k)
    recs = [{"index": 0, "ops": ["torch.tanh"], "kept": True, "eager_ms": 1.0, "row_est_ms": 2.0,
             "t": t(2.0, start=3.0, compile=4.0), "turns": [[0.0, 0.0, 2.0]]},
            {"index": 1, "ops": ["nn.Conv2d", "torch.relu"], "kept": False, "drop": "too slow: eager 30 ms > 10 ms",
             "t": t(5.0), "turns": [[1.0, 2.0, 7.0]]}]
    (tmp_path / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "funnel.json").write_text(json.dumps({"config": {"workers": 2}}))
    d = synth_diag.diagnose(synth_diag.load(tmp_path)[0])
    assert d["child_seconds"] == {**{p: 0.0 for p in synth_diag.PHASES}, "start": 3.0, "locked": 7.0, "compile": 4.0}
    assert d["lock"] == {"span_s": 7.0, "held_s": 7.0, "waited_while_free_s": 0.0}
    assert d["row_estimate"] == {"n": 1, "median_ratio": 2.0, "p95_ratio": 2.0, "max_ratio": 2.0}
    assert [x["locked_s"] for x in d["longest_locked"]] == [5.0, 2.0] and d["longest_locked"][0]["verdict"].startswith("too slow")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "synth_diag.py"), str(tmp_path)], capture_output=True,
                         text=True).stdout
    assert "seconds per candidate (2 workers, 2 candidates): start 1.50 | setup 0.00 | warm 0.00 | wait 0.00 | locked 3.50" in out


def test_lock_use_finds_waits_while_nobody_held_the_lock():
    """The device-lock diagnostic: turns are (asked, got, released) wall-clock times (synth.py's candidates.jsonl)."""
    clean = [(0.0, 0.0, 1.0), (0.5, 1.0, 3.0), (2.0, 3.0, 3.5)]  # each waiter gets the lock as it is released
    assert synth_diag.lock_use(clean) == {"span_s": 3.5, "held_s": 3.5, "waited_while_free_s": 0.0}
    stalled = [(0.0, 0.0, 1.0), (0.5, 2.5, 3.0)]  # released at 1.0, but the waiter only got it at 2.5
    assert synth_diag.lock_use(stalled) == {"span_s": 3.0, "held_s": 1.5, "waited_while_free_s": 1.5}
    assert synth_diag.lock_use([]) == {"span_s": 0.0, "held_s": 0.0, "waited_while_free_s": 0.0}


def test_row_estimate_quality_compares_kept_tasks_only():
    checked = [{"kept": True, "row_est_ms": 2.0, "eager_ms": 1.0}, {"kept": True, "row_est_ms": 3.0, "eager_ms": 3.0},
               {"kept": False, "row_est_ms": 900.0, "eager_ms": 900.0, "drop": "too slow: eager about 900 ms"},
               {"kept": True, "eager_ms": 5.0}]  # (no estimate: a forward that needs the whole batch)
    assert synth_diag.row_estimate_quality(checked) == {"n": 2, "median_ratio": 2.0, "p95_ratio": 2.0, "max_ratio": 2.0}


def test_import_graph_libraries_import_no_script():
    """bench/import_graph.py reads who imports whom; the house rule it shows: library modules import no script
    (env.py, the scorer every part shares, aside), and no module imports train.py, evaluate.py or synth.py."""
    graph = {}
    for line in bench("import_graph.py").splitlines():
        name, n, _, deps = line.split(None, 3)
        graph[name] = {d.split()[0] for d in deps.split(", ")} - {"-"}
        assert int(n) > 0
    assert {"synth.py", "compose.py", "ops.py", "tools.py", "agent.py"} <= set(graph), graph
    assert {"compose", "ops", "checker"} <= graph["synth.py"] and "tools" in graph["agent.py"]
    scripts = {"synth", "agent", "train", "evaluate", "teacher"}
    libraries = {"engine", "tools", "tasks", "ops", "compose", "checker", "elementwise", "reward", "sandbox", "scan", "rl",
                 "rollouts", "runs", "stages", "build", "protocol"}
    for name, deps in graph.items():
        if name[:-3] in libraries:
            assert not deps & scripts, (name, deps)
        assert not deps & {"train", "evaluate", "synth"}, (name, deps)
