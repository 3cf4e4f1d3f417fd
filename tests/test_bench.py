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
    assert "| backend | workers |" in out and "execution drops" in out
