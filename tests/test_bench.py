"""bench/: CPU smoke runs of the benchmark scripts the README documents, and preset_time.py's projection
checked against hand-computed numbers. (The figures themselves come from `bash bench/run_h200.sh` on a GPU.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import synth_diag  # noqa: E402
import agent  # noqa: E402
import protocol  # noqa: E402
import train  # noqa: E402
import test_train  # noqa: E402

elem_dataset = test_train.elem_dataset  # a fixture: the teacher's family (elementwise.py), 2 training tasks, 1 held out


def bench(script, *args, timeout=600, env=None):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=env)
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


def test_verdict_split_compares_exec_and_fork():
    """bench/verdict_split.py: the timeline of a cached verdict, children exec'ed and forked, stamped in both children."""
    out = bench("verdict_split.py", "--repeats", "1", "--no-components")
    for way in ("exec'ed", "forked from the fork server"):
        section = out.split(f"children {way}")[1].split("##")[0]
        assert "| cand | child: first message sent (ready) |" in section and "| parent | lap: timed runs |" in section, out
    assert "| verdict |" in out.split("cached verdict phases")[1], out


def test_big_verdict_prints_a_row_of_phases_per_verdict(tmp_path):
    """bench/big_verdict.py (run_h200.sh big-verdict): an elementwise task scored twice, under two input budgets,
    one table row per verdict with the phases of env.Verdict and the children its timed runs were shared out over
    (one where the sets outnumber the runs; SPLIT_CHILDREN under a budget of 2 sets); small here (--window), on the
    test session's build cache."""
    tmp = tmp_path / "tmp"  # (its TMPDIR: the bench's folders and its fork servers' are gone when it ends)
    tmp.mkdir()
    out = bench("big_verdict.py", "--backend", "cpu", "--window", "0.05", "0.5", "--tasks", "1", "--repeats", "2",
                "--budget-mb", "1024,0.001", "--split-warmup-ms", "0,100", env=dict(os.environ, TMPDIR=str(tmp)))
    assert not list(tmp.iterdir()), list(tmp.iterdir())
    head = next(line for line in out.splitlines() if line.startswith("| task |"))
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "M | " in line]
    # the settings take turns; the second warm-up only where the runs are shared out
    assert [r[2] for r in rows] == ["1"] * 3 + ["2"] * 3 and all(r[4] in ("+1", "+2", "+3") for r in rows), out
    assert [r[6] for r in rows] == ["1", str(protocol.SPLIT_CHILDREN), str(protocol.SPLIT_CHILDREN)] * 2, out
    assert [r[0].endswith("warm-up 100 ms") for r in rows] == [False, False, True] * 2, out
    timed = [float(r[head.strip("|").split("|").index(" timed runs ")].strip(" |")) for r in rows]
    assert timed[2] >= protocol.SPLIT_CHILDREN * 0.1 and timed[5] >= protocol.SPLIT_CHILDREN * 0.1, out
    medians = [line for line in out.splitlines() if line.startswith("| ") and line.count(" | ") == 4][1:]
    assert len(medians) == 3 and all(m.split(" | ")[1] == "1" for m in medians), out  # (one cached verdict each)
    assert all(f"| {p} |" in head for p in ("reference start", "reference outputs", "timed inputs", "checks", "timed runs")), out
    cols = [c.strip() for c in head.strip("|").split("|")]
    compare = [float(r[cols.index("compare")].strip(" |")) for r in rows]  # its 8 comparisons of whole outputs
    assert all(0 <= x < float(r[3]) for x, r in zip(compare, rows)), out  # (a few ms here: it may print 0.00)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "big_verdict.py"), "--tasks", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--tasks and --repeats must be >= 1" in r.stderr.strip().splitlines()[-1]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "big_verdict.py"), "--budget-mb", "8,lots"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--budget-mb and --split-warmup-ms take numbers" in r.stderr.strip().splitlines()[-1]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "big_verdict.py"), "--split-warmup-ms", "-5"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--split-warmup-ms >= 0" in r.stderr.strip().splitlines()[-1]


def test_transfer_bench_moves_one_output_both_ways():
    """bench/transfer_bench.py (run_h200.sh transfer): one output moved from a child through the pipe (into fresh and
    into reused memory) and through a mapped memory file, each compared with the values the child drew (a wrong
    byte ends the bench with an error)."""
    out = bench("transfer_bench.py", "--backend", "cpu", "--gib", "0.01", "--repeats", "2")
    assert [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ") and " | " in line][1:] == [
        "| pipe", "| pipe, reused buffer", "| mapped area", "| fresh host memory"], out
    assert out.count("repeat 2 | move") == 3 and out.count("repeat 2 | allocate and touch") == 1, out
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer_bench.py"), "--gib", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--gib must be > 0" in r.stderr.strip().splitlines()[-1]


def test_env_bench_verdicts_in_flight(tmp_path):
    """--workers 2: the cached task's verdicts 1 and 2 at a time, and the first verdicts of new tasks, alone and 2
    together; the test session's build cache (--cache), so no cold build and no naive one."""
    out = bench("env_bench.py", "--backend", "cpu", "--no-naive", "--repeats", "1", "--workers", "2", "--verdicts", "2",
                "--cache", os.environ["CUDA_AGENT_CACHE"], env=dict(os.environ, OUT=str(tmp_path)))
    flight = json.loads((tmp_path / "env_bench_cpu.json").read_text())["in_flight"]
    assert [(r["what"], r["in_flight"], r["verdicts"]) for r in flight] == [
        ("cached task", 1, 2), ("cached task", 2, 2), ("first verdict of a new task", 1, 1), ("first verdicts of new tasks", 2, 2)]
    for r in flight:
        assert r["per_hour"] == pytest.approx(3600 * r["verdicts"] / r["wall_s"]) and r["wall_s"] >= r["p90_s"] >= r["median_s"] > 0
        assert r["wait_median_s"] <= r["median_s"] and r["wait_p90_s"] <= r["p90_s"]  # a verdict waits within its own time
    assert "| cached task | 2 | 2 | " in out and "| first verdicts of new tasks | 2 | 2 | " in out and "| wait device | " in out
    assert "cold build" not in out  # (the test cache may hold it: not measured)


def test_floor_diag_prints_its_table():
    """bench/floor_diag.py: one row per child / setting asked for (and the first), every column of the table; the verdict's run and
    its run exchange alone are nan where the parent may not read a child's memory (this machine), numbers elsewhere."""
    out = bench("floor_diag.py", "--runs", "4", "--only", "candidate, relu_scale kernel,in-process, 1 element")
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in out.splitlines() if line.startswith("| ")}
    assert "its run exchange alone (ms)" in out and len(rows["child / setting"]) == 10, out
    kernel = [float(x.strip(" |")) for x in rows["candidate, relu_scale kernel"]]
    assert len(kernel) == 10 and 0 < kernel[0] < kernel[2] and kernel[4] > 0, out  # run < run + sample; native clock
    assert float(rows["eager in-process (env.time_callable), 1 element"][0]) > 0, out
    # the first row runs whatever --only says: its reference child decides whether the parent reads (as a verdict's)
    assert "eager (reference child)" in rows and "matmul: eager" not in rows, out


def test_timing_spread_rows_per_setting():
    """One row per (warm-up, idle) setting of the kernel's verdicts and one of the floor task's, each from its own
    verdicts, interleaved round by round."""
    out = bench("timing_spread.py", "--backend", "cpu", "--verdicts", "2", "--warmup-ms", "0,5,5", "--idle-s", "0")
    assert out.count("| matmul | warmup 0 ms | idle 0 s |") == 2 and out.count("| matmul | warmup 5 ms | idle 0 s |") == 2
    assert out.count("| floor | warmup 0 ms | idle 0 s |") == 2 and "| events |" not in out  # (CUDA events: a GPU only)
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| matmul kernel, verdicts |", "| 1-element"))]
    assert [r[1:3] for r in rows] == [["0", "0"], ["5", "0"], ["0", "0"]], out
    assert all(float(r[3]) > 0 for r in rows), out
    order = [line.split(" | ")[1:3] for line in out.splitlines() if line.startswith("  round ")]
    assert order[3:] == order[1:3] + order[:1], order  # the second round starts one row later
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "timing_spread.py"), "--warmup-ms", "a"], capture_output=True, text=True)
    assert r.returncode == 2 and "comma-separated numbers" in r.stderr


def test_cuda_agent_bench_says_what_it_needs(tmp_path):
    """bench/cuda_agent_bench.py (CUDA Agent's own scripts beside env.py) runs on a GPU only: elsewhere, and for a
    folder that is not their agent_workdir, one line says why (the GPU run: bash bench/run_h200.sh cuda-agent)."""
    run = lambda d: subprocess.run([sys.executable, str(ROOT / "bench" / "cuda_agent_bench.py"), "--agent-workdir", str(d)],
                                   capture_output=True, text=True, timeout=300)
    r = run(tmp_path)
    assert r.returncode == 1 and "is not CUDA Agent's agent_workdir" in r.stderr and "Traceback" not in r.stderr, r.stderr
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "compile.sh").write_text("exit 1\n")
    (tmp_path / "model.py").write_text("")
    r = run(tmp_path)
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU: the bench would run")
    assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr, r.stderr


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


BIG = dict(warmup_steps=2, ppo_steps=2, rft_tasks=16, sft_tasks=4, sft_epochs=2, critic_epochs=2, eval_tasks=4)  # run_h200.sh big-*


def made_up_run(path, until="ppo"):
    """metrics.jsonl of a short default-shaped run (run_h200.sh's big-* settings), killed during RFT's rollouts
    and resumed 240 s later; until="critic": it dies at the start of the critic stage."""
    cfg = dict(train.dataclasses.asdict(train.Config()), **BIG)
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    t, recs = 1000.0, []

    def rec(dt, **r):
        nonlocal t
        t += dt
        recs.append({**r, "time": t})
    ev = lambda stage: rec(20, event="eval", stage=stage, n=4, eval_s=20.0, generate_s=16.0, peak_gb=20.0, reserved_gb=22.0)
    rec(0, event="start", setup_s=30.0, peak_gb=15.2, reserved_gb=15.5)
    ev("base")  # 20 s, 16 of them generating
    rec(45, stage="sft", step=1, s_step=5.0, peak_gb=70.0, reserved_gb=80.0)  # the teacher: 40 s
    rec(5, stage="sft", step=2, s_step=5.0, peak_gb=71.0, reserved_gb=80.0)
    rec(0, event="stage_end", stage="sft", demos=4, episodes=4, tasks=4)
    ev("sft")
    rec(10, stage="warmup", step=1, s_step=10.0, generate_s=4.0, env_s=1.0, update_s=5.0, resp=1536, n=16, tokens=60000,
        rollout_peak_gb=30.0, rollout_reserved_gb=32.0, peak_gb=60.0, reserved_gb=70.0)
    rec(20, stage="warmup", step=2, s_step=20.0, generate_s=12.0, env_s=1.0, update_s=7.0, resp=1536, n=16, tokens=60000,
        rollout_peak_gb=30.0, rollout_reserved_gb=32.0, peak_gb=61.0, reserved_gb=70.0)
    rec(0, event="stage_end", stage="warmup")
    ev("warmup")
    rec(240 + 20, event="start", setup_s=30.0, resume=True)  # killed 20 s into the rollouts, restarted 240 s later
    rec(20, event="rft_filter", episodes=16, kept=0, peak_gb=40.0, reserved_gb=45.0)  # the rollouts: 20 s after the restart
    for k in range(3):
        rec(2, stage="rft", step=k + 1, s_step=2.0)
    rec(0, event="stage_end", stage="rft")
    ev("rft")
    if until != "critic":
        rec(5, stage="critic", step=1, s_step=5.0)
        rec(5, stage="critic", step=2, s_step=5.0)
        rec(0, event="stage_end", stage="critic")
        rec(0.1, event="eval", stage="critic", n=4, eval_s=0.0, generate_s=0.0)  # the rft row again: nothing generated
    if until == "ppo":
        for k in range(2):
            rec(30, stage="ppo", step=k + 1, s_step=30.0, generate_s=20.0, env_s=2.0, update_s=8.0, resp=6000, n=16,
                tokens=120000, rollout_peak_gb=50.0, peak_gb=90.0, reserved_gb=100.0)
        rec(0, event="stage_end", stage="ppo")
        ev("ppo")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_preset_time_projects_each_stage(tmp_path):
    """The made-up short run projected to the default preset (64 teacher tasks x 8 epochs, 10 warm-up steps, 32 RFT
    tasks x 3 epochs, at most 30 critic epochs, 10 PPO steps, 32 held-out tasks), each phase by hand."""
    made_up_run(tmp_path)
    out = bench("preset_time.py", str(tmp_path), "--preset", "default")
    proj = {line[:20].strip(): float(line.split()[-1]) for line in out.splitlines()[2:] if line[:20].strip() not in ("", "total")
            and not line.startswith("not included")}
    assert proj == {
        "sft teacher": 40 * 64 / 4,              # 40 s for 4 teacher tasks
        "sft training": 10 * (8 * 64) / (2 * 4),  # 2 epochs of 4 demonstrations in 10 s
        "warmup (per step)": 15 * 10,           # mean step 15 s
        "rft rollouts": 20 * 32 / 16,           # 20 s after the restart (the 20 s before the kill and the 240 s gap: not counted)
        "rft training": 6 * (32 * 3) / (16 * 3),
        "critic training": 10 * (32 * 30) / (16 * 2),  # ran all of its 2 epochs: the preset's 30 (at most)
        "ppo (per step)": 30 * 10,
        "held-out evals (6)": 80 + 20 * 32 / 4,  # generation as measured, the rest x 32/4
    }, out
    assert "shape differs" not in out and "2322.0  = 38m42s" in out and "incomplete" not in out, out
    # the paper preset from a default-shaped run: PPO steps scaled by tokens per step too (32 x 32768 / 16 x 8192 = 8)
    out = bench("preset_time.py", str(tmp_path), "--preset", "paper")
    assert "shape differs (tasks_per_step 16 -> 32, max_new_tokens 1536 -> 4096, max_turns 12 -> 50, max_context 8192 -> 32768)" in out
    ppo = next(x for x in out.splitlines() if x.startswith("ppo (per step)")).split()
    assert ppo[-2:] == ["8.00", f"{30 * 150 * 8:.1f}"], ppo
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "preset_time.py"), str(tmp_path / "nope")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().startswith("preset_time.py: error:"), r.stderr


def test_big_model_report_of_a_run_that_ran_out_of_memory(tmp_path):
    """--report: phases with their peak memory (allocated, reserved) and both presets, the step split, and where a
    run that died stopped, with the error line of its log."""
    made_up_run(tmp_path / "run-big-7b", until="critic")
    made_up_run(tmp_path / "run-big-1.5b")
    (tmp_path / "run-big-7b.log").write_text(  # a first attempt cut by the time limit, then a resumed one out of memory
        "train | 16 cores: synthesis 12 workers ...\nTraceback (most recent call last):\nKeyboardInterrupt\n"
        "train | 16 cores: synthesis 12 workers ...\ncritic: 13 training ...\nTraceback (most recent call last):\n  ...\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 18.56 GiB.\n")
    (tmp_path / "run-big-1.5b" / "train.log").write_text("train | 16 cores: ...\nKeyboardInterrupt\n")  # (complete: not read)
    made_up_run(tmp_path / "cut", until="critic")
    (tmp_path / "cut" / "train.log").write_text("train | 16 cores: ...\nTraceback (most recent call last):\nKeyboardInterrupt\n")
    out = bench("big_model.py", "--report", *(str(tmp_path / d) for d in ("run-big-7b", "run-big-1.5b", "cut", "x")))
    line = lambda run, phase: next((x for x in out.splitlines() if x.split()[0] == run and x[len(run):].strip().startswith(phase)), None)
    assert line("run-big-7b", "setup (data, load)").split()[-2:] == ["15.2", "30.0"], out
    assert line("run-big-7b", "sft teacher").split()[-3:] == ["40.0", "10m40s", "1h25m"], out  # paper: 512 teacher tasks
    assert line("run-big-7b", "sft training").split()[-5:] == ["71.0", "(80)", "10.0", "10m40s", "21m20s"], out
    assert line("run-big-7b", "ppo") is None and line("run-big-7b", "critic") is None, out
    assert line("run-big-7b", "stopped in critic: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 18.56 GiB."), out
    # 2 steps of 15 s: x 10 (default); paper: x 50 steps and x 32 x 4096 / (16 x 2048) tokens per step (the warm-up's
    # answer: warmup_new_tokens)
    assert line("run-big-1.5b", "warmup (per step)").split()[-5:] == ["61.0", "(70)", "30.0", "2m30s", "50m00s"], out
    assert line("run-big-1.5b", "ppo step") == ("run-big-1.5b ppo step (30, 30 s): generate 20.0 s | tools+scoring 2.0 s | update 8.0 s | "
                                                 "rollout 4,800 tok/s | update 15,000 tok/s | peak GB rollout 50.0, update 90.0"), out
    assert line("run-big-1.5b", "total").split()[-4:] == ["90.0", "276.0", "38m42s", "20h16m"], out  # (the warm-up 16 min less)
    assert line("run-big-1.5b", "complete") and line("x", "no metrics.jsonl in"), out
    assert line("cut", "stopped in critic: KeyboardInterrupt (SIGINT: run_h200.sh's time limit; the same part again"), out


def test_big_model_configs_are_the_published_ones():
    """The shapes of Qwen2.5-Coder-7B-Instruct and -1.5B-Instruct's config.json, and their parameter counts, built on
    the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM
    import big_model
    tok = agent.embedded_tokenizer()
    want = {"qwen7b": (3584, 18944, 28, 28, 4, 152064, False, 7_615_616_512),
            "qwen1.5b": (1536, 8960, 28, 12, 2, 151936, True, 1_543_714_304)}
    for name, (h, i, n, heads, kv, vocab, tied, params) in want.items():
        c = big_model.qwen_config(name, tok)
        assert (c.model_type, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                c.num_key_value_heads, c.vocab_size, c.tie_word_embeddings) == ("qwen2", h, i, n, heads, kv, vocab, tied)
        assert (c.max_position_embeddings, c.rms_norm_eps, c.rope_parameters["rope_theta"], c.use_sliding_window) == \
            (32768, 1e-6, 1e6, False)
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(c, dtype=torch.bfloat16)
        assert sum(p.numel() for p in m.parameters()) == params == big_model.PARAMS[name]
        assert m.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v biases
        assert c.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_big_model_saves_a_model_that_train_loads(tmp_path):
    """--save --config tiny: a Qwen2 folder (bf16 weights, the embedded tokenizer) that train.py's loader runs on the
    rollout engine; its vocabulary is larger than the tokenizer's, as the real ones, and sampled ids beyond the
    tokenizer are kept and decode to nothing. A second --save keeps it; another model's folder is refused."""
    import torch
    d = tmp_path / "m"
    out = bench("big_model.py", "--save", str(d), "--config", "tiny")
    assert f"saved tiny to {d}: 6M parameters, bf16" in out and "initialised on cpu" in out, out
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    pol = train.build_policy(train.Config(preset="tiny", model=str(d), max_context=256), tmp_path, "cpu", True)
    assert type(pol.model).__name__ == "Qwen2ForCausalLM" and pol.engine_kind == "fast"
    assert pol.stop == [pol.tokenizer.convert_tokens_to_ids("<|im_end|>")] and pol.model.config.vocab_size > len(pol.tokenizer)
    torch.manual_seed(0)
    prompt = pol.tokenizer.encode("write a kernel")
    toks = pol.generate([prompt] * 4, 200, temperature=1.0)
    unknown = [t for o in toks for t in o if t >= len(pol.tokenizer)]
    assert unknown and pol.tokenizer.decode(unknown) == "", unknown  # ~2% of 800 samples are ids the tokenizer lacks
    assert "already holds tiny (kept)" in bench("big_model.py", "--save", str(d), "--config", "tiny")
    # bench/rollout_bench.py --model DIR (run_h200.sh big-rollout): the engine against HF generate on the folder
    out = bench("rollout_bench.py", "--device", "cpu", "--model", str(d), "--batch", "2", "--prompt-len", "16",
                "--new-tokens", "8", "--baseline-tokens", "4", "--configs", "static,ours", "--json", str(tmp_path / "r.json"))
    assert f"model {d}" in out and all(r["tok_s"] > 0 for r in json.loads((tmp_path / "r.json").read_text())), out
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "big_model.py"), "--save", str(d), "--config", "qwen7b"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "is not a qwen7b model folder" in r.stderr, r.stderr


@pytest.mark.slow
def test_big_model_tiny_stage_all_and_report(tmp_path, elem_dataset):
    """bash bench/run_h200.sh big-* in small: train.py --stage all on a saved tiny Qwen2 (tiny preset, CPU), then
    --report: every phase measured and projected, the step splits, and "complete"."""
    d = tmp_path / "m"
    bench("big_model.py", "--save", str(d), "--config", "tiny")
    rd = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--stage", "all", "--preset", "tiny", "--backend", "cpu",
                        "--model", str(d), "--dataset", str(elem_dataset), "--run-dir", str(rd)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["event"] == "start" and recs[0]["setup_s"] > 0 and "peak_gb" not in recs[0]  # CPU: no GPU peaks
    ppo = [x for x in recs if x.get("stage") == "ppo" and "event" not in x]
    assert all(x["tokens"] > 0 and x["generate_s"] > 0 for x in ppo), ppo
    assert all(x["generate_s"] > 0 for x in recs if x.get("event") == "eval" and x["stage"] != "critic")
    out = bench("big_model.py", "--report", str(rd))
    phases = [x.split()[1] for x in out.splitlines()[1:] if x.startswith("run ")]
    assert phases[:10] == ["setup", "sft", "sft", "warmup", "rft", "rft", "critic", "ppo", "held-out", "total"], out
    assert "run warmup step (" in out and "run ppo step (" in out and "run complete" in out, out


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


def test_teacher_speed_times_the_kernel_three_ways():
    """bench/teacher_speed.py (run_h200.sh teacher-speed): one task, one variant of the teacher's kernel, its in-process
    figure measured in a child process of its own, then the verdict; a row per variant with host and verdict times."""
    out = bench("teacher_speed.py", "--backend", "cpu", "--tasks", "1", "--variants", "1", "--runs", "3", "--window", "0.1", "1")
    rows = [r.split(" | ") for r in out.splitlines() if r.startswith("| ") and " / " in r and "events" not in r]
    assert len(rows) == 1 and rows[0][2] == "rows", out
    host = [float(x) for x in rows[0][4].split(" / ")]  # kernel / eager / compile, this process's clock
    verdict = [float(x) for x in rows[0][5].split(" / ")]
    assert all(x > 0 for x in host + verdict) and rows[0][3] == "- / - / -", out  # no CUDA events on the CPU


def test_ipc_probe_says_when_there_is_nothing_to_probe():
    """bench/ipc_probe.py (run_h200.sh ipc) needs a GPU: here it says so and exits 0; a bad argument is one line."""
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU: the probe runs for real (run_h200.sh ipc)")
    assert "no CUDA GPU here" in bench("ipc_probe.py", "--gib", "0.01")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ipc_probe.py"), "--gib", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--gib must be > 0" in r.stderr


def test_sample_read_probe_reads_a_sandboxed_child():
    """bench/sample_read_probe.py: the parent's own read of a child's memory, allowed here or said to be refused."""
    out = bench("sample_read_probe.py", "--repeats", "3")
    assert "| 1024 |" in out or "refused here" in out, out
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sample_read_probe.py"), "--repeats", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "--repeats must be >= 1" in r.stderr


def test_verdict_phases_splits_first_and_later_profiles(tmp_path):
    """bench/verdict_phases.py on two made-up episodes (verdicts as env.Verdict serialises them): an episode's first
    profile is counted apart from its later ones, the final score apart from its tool calls, a phase a verdict did
    not reach counts as 0 s for it, and an episode that a second file holds too (a chunk's demos.jsonl) counts once."""
    import env
    v = lambda s, **ph: env.Verdict(backend="cpu", seconds=s, phases=ph).to_dict()
    turn = lambda tool, verdict: {"tool": tool, "verdict": verdict}
    eps = [{"workspace": "/w/0", "turns": ["not a turn", turn("write_file", None), turn("compile", v(4.0, build=4.0)),
                      turn("profile", v(30.0, **{"reference outputs": 20.0, "baselines": 1.0})),
                      turn("profile", v(6.0, **{"reference outputs": 4.0}))], "verdict": v(8.0, **{"reference outputs": 5.0})},
           {"workspace": "/w/1", "turns": [turn("profile", v(10.0, **{"reference outputs": 6.0, "baselines": 3.0}))],
            "verdict": v(12.0)}]
    (tmp_path / "chunk").mkdir()
    (tmp_path / "chunk" / "trajectories.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps) + "not json\n")
    (tmp_path / "chunk" / "demos.jsonl").write_text(json.dumps(eps[1]) + "\n")  # (the same episode again)
    out = bench("verdict_phases.py", str(tmp_path), "--json", str(tmp_path / "m.json"))
    assert "verdicts of 6 tool calls and final scores, from 2 file(s)" in out
    assert "| verdicts | 1 | 1 | 2 | 2 | 1 | 1 | 2 | 2 |" in out  # compile, profile first, profile later, final
    assert "| whole verdict | 4.00 | 4.00 | 20.00 | 20.00 | 6.00 | 6.00 | 10.00 | 10.00 |" in out
    assert "| baselines | 0.00 | 0.00 | 2.00 | 2.00 | 0.00 | 0.00 | 0.00 | 0.00 |" in out  # (not reached: 0 s)
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["profile, first"]["reference outputs"] == 13.0 and m["final score"]["reference outputs"] == 2.5
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "verdict_phases.py"), str(tmp_path / "chunk" / "none.jsonl")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_teacher_replay_schedules_recorded_call_times(tmp_path):
    """bench/teacher_replay.py on three made-up episodes of one chunk, 2 tool calls at once, against a schedule worked
    by hand: lockstep 7 (compiles 2, 1, 6) + 10 (profiles 10, 4, 1) + 5 (final scores 5, 3, 1) = 22 s; one thread per
    episode (17, 8 and 8 s of calls) 17 s; the turns that write files count 0."""
    def ep(compile_s, profile_s, final_s):
        turns = [{"tool": "write_file", "observation": "wrote kernels/op.cpp (10 characters, 1 lines)"},
                 {"tool": "compile", "observation": f"compiled OK ({compile_s}s)"},
                 {"tool": "profile", "observation": f"reward +1 | compiled True | correct True | stage profile | {profile_s}s\nmore"},
                 {"tool": "finish", "observation": "finished"}]
        return {"turns": turns, "verdict": {"seconds": final_s}}
    chunk = tmp_path / "chunk-0000"
    chunk.mkdir()
    (chunk / "trajectories.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (ep(2.0, 10.0, 5.0), ep(1.0, 4.0, 3.0),
                                                                                       ep(6.0, 1.0, 1.0))))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "teacher_replay.py"), str(tmp_path), "--workers", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| chunk-0000 | 3 | 22 s | 17 s |" in r.stdout, r.stdout
    assert "| all, every chunk in one call | 3 | | 17 s (-23%) |" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "teacher_replay.py"), str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "no chunk-*/trajectories.jsonl" in r.stderr


def test_episodes_says_where_each_episode_went(tmp_path):
    """bench/episodes.py: one line per episode (ops, reward, how far it got, its calls, the verdict's error); --failed
    keeps those below +1; a missing file is a one-line error."""
    passed = {"task_id": "test/00001", "ops": ["silu", "add"], "reward": 2, "end_reason": "finish",
              "verdict": {"compiled": True, "correct": True, "speedup_eager": 1.5},
              "turns": [{"tool": "write_file", "ok": True}, {"tool": "finish", "ok": True}]}
    failed = {"task_id": "test/00002", "ops": ["softmax"], "reward": -1, "end_reason": "max_turns",
              "verdict": {"compiled": True, "correct": False, "error": "output mismatch: 37% beyond tolerance\nmore"},
              "turns": [{"tool": "compile", "ok": True}, {"tool": None, "ok": False}]}
    f = tmp_path / "rank0.jsonl"
    f.write_text(json.dumps(passed) + "\n" + json.dumps(failed) + "\n")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "episodes.py"), str(f)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "2 episodes, 1 pass" in r.stdout
    assert "test/00001 | silu -> add | reward +2 | correct 1.50x eager | end finish | calls: write_file finish" in r.stdout
    assert ("test/00002 | softmax | reward -1 | built | end max_turns | calls: compile (malformed)! | "
            "error: output mismatch: 37% beyond tolerance") in r.stdout.splitlines()
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "episodes.py"), str(f), "--failed"], capture_output=True,
                       text=True, timeout=120)
    assert "test/00002" in r.stdout and "test/00001" not in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "episodes.py"), str(tmp_path / "none.jsonl")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
