"""synth.py: mining, composition, every filter (each proven by a crafted bad task), determinism, bad input,
interrupted runs, and a subprocess smoke run of the documented CLI. CPU only; ~3-4 minutes on 2 cores
(torch.compile on CPU costs seconds per distinct graph, so the runs are small)."""
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import compose  # noqa: E402
import env  # noqa: E402
import ops  # noqa: E402
import synth  # noqa: E402
import tasks  # noqa: E402

KB = ROOT / "tests" / "fixtures_synth" / "kernelbench"
# An eager-time window no machine load can push a task out of (0.1 ns to 100 s; candidates are sized for ~0.05 ms),
# and a task timeout no real check reaches: keep/drop never depends on timing, so a run's verdicts, and with them
# its dataset, depend only on the seed (the determinism test below); the timing filters have their own test with
# crafted tasks (test_each_execution_filter_drops_its_crafted_bad_task). The tiny tasks also keep the runs short.
WINDOW = (0.0001, 100000.0)
CLI = ["--num-tasks", "2", "--backend", "cpu", "--seed", "1", "--workers", "2", "--window-ms", *map(str, WINDOW),
       "--task-timeout", "600", "--kernelbench-dir", str(KB)]


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "synth.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def seeds():
    return ops.mine_seeds(verbose=False)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """The documented CLI, small: the dataset every other end-to-end test looks at."""
    out = tmp_path_factory.mktemp("synth") / "a"
    r = run_cli("--out", str(out), *CLI)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r


def rows_of(path):
    return [dict(r, split=s) for s in ("train", "test") for r in tasks.read_dataset(str(path), s)]


# ---------------------------------------------------------------------------------------------- mine
def test_mining_finds_hundreds_of_seeds_from_every_source(seeds):
    names = {s["name"] for s in seeds}
    sources = {s["source"] for s in seeds}
    assert len(seeds) >= 200, len(seeds)
    assert sources == {"torch", "torch.nn", "torch.nn.functional", "torch.special", "torch.linalg", "transformers"}
    assert {"nn.Conv2d", "nn.Linear", "nn.GroupNorm", "torch.tanh", "torch.cumsum", "transformers.gelu_new",
            "transformers.LlamaRMSNorm"} <= names
    # random, view and identity-in-eval-mode operators are skipped at mining time, with a reason
    assert not names & {"nn.Dropout", "torch.rand_like", "torch.t", "nn.BatchNorm2d", "nn.Identity"}
    assert all(s["ranks"] and set(s["ranks"]) <= {2, 3, 4, 5} for s in seeds)


# ---------------------------------------------------------------------------------------------- compose
def test_compose_is_deterministic_follows_the_mix_and_emits_kernelbench_format(seeds):
    a = [compose.compose_one(i, seeds, 3, "cpu", (0.1, 10.0)) for i in range(30)]
    b = [compose.compose_one(i, seeds, 3, "cpu", (0.1, 10.0)) for i in range(30)]
    assert a == b  # same seed, same candidates; another seed, other candidates
    assert a != [compose.compose_one(i, seeds, 4, "cpu", (0.1, 10.0)) for i in range(30)]
    ok = [c for c in a if "drop" not in c]
    assert len(ok) >= 20
    assert sum(c["data_source"] == "torch#2" for c in ok) > 0.6 * len(ok)  # the paper's mix: 84% torch#2
    for c in ok[:10]:
        assert c["data_source"] == "transformers" or c["data_source"] == f"torch#{len(c['ops'])}"
        mod = types.ModuleType("task")
        exec(c["code"], mod.__dict__)
        assert mod.BATCH == c["shape"][0]  # module-level size constants
        with torch.device("meta"):  # the emitted code runs as is (shapes only, meta tensors)
            out = mod.Model(*mod.get_init_inputs())(*[torch.empty(c["shape"], device="meta")])
        assert isinstance(out, torch.Tensor)
    # --max-ops bounds the chain length
    one_op = (compose.compose_one(i, seeds, 0, "cpu", (0.1, 10.0), max_ops=1) for i in range(10))
    assert all(len(c["ops"]) == 1 for c in one_op if "drop" not in c)


def test_grow_batch_doubles_to_the_target_under_the_caps():
    """ops.grow_batch, which sizes both families: 1 ms per row, window 1-100 ms (target 1 * 100 ** 0.3 = 3.98 ms)."""
    per_row = lambda sh: (float(sh[0]), sh[0] * 10)  # (ms, bytes)
    assert ops.grow_batch(per_row, (1, 7), (1.0, 100.0), cap=1e9) == ((4, 7), 4.0)  # first size >= the target
    assert ops.grow_batch(per_row, (1, 7), (1.0, 100.0), cap=25) == ((2, 7), 2.0)  # 4 rows would hold 40 bytes
    assert ops.grow_batch(per_row, (1, 7), (1.0, 100.0), cap=1e9, max_doublings=1) == ((2, 7), 2.0)
    assert ops.grow_batch(lambda sh: (200.0, 1), (1, 7), (1.0, 100.0), cap=1e9) is None  # over the window at BATCH=1

    def rejects_4(sh):  # a batch size the chain cannot take ends the growth
        if sh[0] == 4:
            raise RuntimeError("shape")
        return per_row(sh)
    assert ops.grow_batch(rejects_4, (1, 7), (1.0, 100.0), cap=1e9) == ((2, 7), 2.0)


def test_duplicates_are_dropped(seeds):
    funnel, seen = synth.new_funnel(), set()
    cfg = synth.Config(window_ms=(0.1, 10.0))
    first = synth.compose(0, 15, seeds, cfg, "cpu", seen, funnel)
    again = synth.compose(0, 15, seeds, cfg, "cpu", seen, funnel)  # the same candidates once more
    assert first and not again
    assert funnel["compose"]["drops"]["duplicate of an earlier candidate"] == len(first)
    # same ops, different sizes: still a duplicate
    code = first[0]["code"]
    assert compose.structure_key(code) == compose.structure_key(code.replace(f"BATCH = {first[0]['shape'][0]}", "BATCH = 12345"))


def test_llm_composer_keeps_kernelbench_answers_and_drops_the_rest(seeds):
    """compose_llm's checks of LLM answers, with a scripted policy (the real one is agent.py's, tested there)."""
    plans = [c for c in (compose.compose_one(i, seeds, 0, "cpu", (0.1, 10.0)) for i in range(6))
             if "drop" not in c][:3]

    class Tok:
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
            return messages[-1]["content"]

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(ch) for ch in text]}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    class Policy:
        tokenizer = Tok()

        def generate(self, prompts, max_new_tokens, temperature=0.0):
            answers = ["```python\n" + plans[0]["code"].replace("x = ", "y = x = ") + "```",  # valid, restyled
                       "Sure! Here is the model: it applies the ops.",  # not code
                       "```python\n" + task("return x * 2") + "```"]  # code that leaves out the requested ops
            assert len(prompts) == 3 and all(plans[0]["ops"][0] in "".join(map(chr, prompts[0])) for _ in prompts)
            return [[ord(ch) for ch in a] for a in answers]

    out = synth.compose_llm(plans, synth.Config(composer="llm"), Policy())
    assert out[0]["ops"] == plans[0]["ops"] and "y = x = " in out[0]["code"]
    assert out[1] == {"drop": "llm answer is not a KernelBench-format module"}
    assert out[2] == {"drop": "llm answer leaves out a requested operator"}


# ---------------------------------------------------------------------------------------------- filters
def task(forward, inputs="torch.randn(256, 1024)", init=""):
    return (f"import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
            f"        super().__init__()\n{init}\n    def forward(self, x):\n        {forward}\n\n\n"
            f"def get_inputs():\n    return [{inputs}]\n\n\ndef get_init_inputs():\n    return []\n")


def test_each_execution_filter_drops_its_crafted_bad_task(tmp_path):
    """One child checks the crafted tasks one after another; the segfault and the hang end it, and the rest
    run in a fresh child."""
    crafted = {
        "random": task("return x + torch.rand_like(x)"),
        "constant": task("return x - x"),
        "identity": task("return torch.relu(x)", inputs="torch.rand(256, 1024)"),  # ReLU on U[0,1): output == input
        "nonfinite": task("return torch.log(x)"),
        "too_fast": task("return torch.tanh(x)", inputs="torch.randn(4, 4)"),
        "too_slow": task("for _ in range(8):\n            x = torch.tanh(x @ x)\n        return x", inputs="torch.randn(512, 512)"),
        "crash": task("import ctypes; return ctypes.string_at(0)"),  # a real segmentation fault
        # ends its child 1 s after its first run, when the child is checking the next candidate, which must not
        # take the blame for it (it is retried in a fresh child)
        "leftover": task("import os, threading; threading.Timer(1.0, os._exit, [7]).start(); return x - x"),
        "next": task("import time; time.sleep(0.6); return torch.tanh(x)"),
        "broken": task("return self.missing(x)"),
        "hang": task("while True:\n            pass"),  # its child is killed after task_timeout_s
        # hangs on the full batch only, i.e. under the device lock (the warm-up runs one row outside it)
        "hog": task("while x.shape[0] == 256:\n            pass\n        return x"),
        # a per-row cost that adds up (like a batched SVD looping over the batch): dropped from a few rows,
        # outside the lock, before one full run
        # (k = 64 of 4,096 rows: a few ms, under the 2x-window cut below, so the estimate is what drops it)
        "loop": task("return torch.stack([torch.linalg.svdvals(m) for m in x])", inputs="torch.randn(4096, 32, 32)"),
        # one SVD of a 16,384 x 1,024 input (seconds): 256 rows alone take over twice the window, so the timed
        # runs on a few rows are skipped too
        "one_svd": task("return torch.linalg.svdvals(x)", inputs="torch.randn(16384, 1024)"),
    }
    cands = [{"code": c, "name": n} for n, c in crafted.items()]
    cfg = synth.Config(window_ms=(0.05, 5.0), workers=1, task_timeout_s=10)
    res = synth.filter_by_execution(cands, cfg, "cpu", resume_file=tmp_path / "filtered.jsonl")
    got = {c["name"]: res[synth.result_key(c, cfg, "cpu")] for c in cands}
    # (tasks that pass every filter: see the end-to-end tests below; a compile costs ~10 s here)
    expect = {"random": "nondeterministic", "constant": "constant output", "identity": "output equals its input",
              "nonfinite": "non-finite", "too_fast": "too fast", "too_slow": "too slow", "crash": "child process crashed",
              "broken": "eager failed", "leftover": "constant output", "next": "too slow", "hang": "child process timed out: its checks took over 10 s",
              "hog": "too slow: over 5 s under the device lock", "loop": "too slow: eager about",
              "one_svd": "too slow: eager over 5 ms (256 of 16384 rows took"}
    for name, why in expect.items():
        assert not got[name]["kept"] and got[name]["drop"].startswith(why), (name, got[name])
    # the funnel counts drops decided from a few rows (estimate or 2x-window cut) apart from measured ones
    assert [synth._reason_class(got[n]["drop"]) for n in ("loop", "one_svd", "too_slow")] == \
        ["too slow (from a few rows)"] * 2 + ["too slow"]
    # the hog's turn under the lock is counted although its child was killed in it (lock_use, longest turns)
    (asked, held, released), = got["hog"]["turns"]
    assert released - held >= 5 and got["hog"]["t"]["locked"] >= 5
    # every result was recorded as it arrived; a re-run reads them back instead of re-running anything
    assert len((tmp_path / "filtered.jsonl").read_text().splitlines()) == len(cands)
    t0 = time.time()
    assert synth.filter_by_execution(cands, cfg, "cpu", resume_file=tmp_path / "filtered.jsonl") == res
    assert time.time() - t0 < 2


def test_kernelbench_near_duplicate_is_dropped_and_others_kept(seeds):
    kb = compose.load_kernelbench(str(KB))
    copy = (KB / "19_ReLU.py").read_text()
    near = copy.replace("batch_size", "N").replace("dim", "D").replace("16384", "512").replace("(x", "(inp") \
        .replace("relu(x)", "relu(inp)").replace('"""Applies', '"""Computes')
    assert near != copy
    gen = [c for c in (compose.compose_one(i, seeds, 0, "cpu", (0.1, 10.0)) for i in range(10))
           if "drop" not in c]
    funnel = synth.new_funnel()
    kept = synth.filter_similar([{"code": near}] + gen, kb, synth.Config(), funnel)
    assert len(kept) == len(gen) and funnel["similarity"]["out"] == len(gen)
    assert compose.most_similar(near, kb)[1] == "19_ReLU.py"
    # the filter's floor skips pairs that cannot beat it: the same answer above it, (0.0, "") below it
    sim, name = compose.most_similar(near, kb, 0.9)
    assert name == "19_ReLU.py" and sim == compose.most_similar(near, kb)[0] > 0.9
    assert all(compose.most_similar(c["code"], kb, 0.9) == (0.0, "") for c in gen)


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_cli_smoke_writes_dataset_funnel_and_report(run_a):
    out, r = run_a
    rows = rows_of(out)
    assert len(rows) == 2 and {x["split"] for x in rows} == {"train", "test"}
    funnel = json.loads((out / "funnel.json").read_text())
    st = funnel["stages"]
    assert st["compose"]["in"] >= st["compose"]["out"] >= st["execution"]["in"] >= st["execution"]["out"] >= 2
    assert funnel["kept"] == 2 and funnel["diversity"]["mix"]["torch#2"]["paper_pct"] == 84.0
    for line in ("mine: ", "stage", "execution", "mix: torch#1", "saved"):
        assert line in r.stdout, line
    assert not Path(str(out) + ".partial").exists()
    # every checked candidate's verdict and where its time went (bench/synth_diag.py sums them; tests/test_bench.py)
    records = [json.loads(x) for x in (out / "candidates.jsonl").read_text().splitlines()]
    assert len(records) == st["execution"]["in"] and sum(x["kept"] for x in records) == st["execution"]["out"]
    assert [x["index"] for x in records] == sorted(x["index"] for x in records)  # in stream order
    for x in records:
        assert set(x["t"]) == {"start", "setup", "warm", "wait", "locked", "first", "compile"} and x["ops"], x
        assert all(a <= b <= c for a, b, c in x["turns"])  # (asked, got, released)
    assert sum(x["t"]["start"] for x in records) > 0 and any(x["t"]["compile"] > 0 for x in records if x["kept"])
    grouped = ("too fast", "too slow", "too slow (from a few rows)", "eager failed", "torch.compile failed", "child process")
    for why, n in st["execution"]["drops"].items():  # grouped reasons keep full example messages
        if why in grouped:
            assert 1 <= len(st["execution"]["examples"][why]) <= min(n, 3), st["execution"]
    for x in rows:
        assert set(x) >= {"ops", "data_source", "code", "eager_ms", "compile_ms"}
        assert x["data_source"] in ("transformers", f"torch#{len(x['ops'])}")
        assert WINDOW[0] <= x["eager_ms"] <= WINDOW[1] and x["compile_ms"] > 0


def test_every_row_runs_and_compile_agrees_with_eager(run_a, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(env.CACHE_DIR / "inductor"))  # the filter's compiled graphs
    for x in rows_of(run_a[0]):
        mod = types.ModuleType("task")
        exec(x["code"], mod.__dict__)
        assert {"Model", "get_inputs", "get_init_inputs", "BATCH"} <= set(vars(mod))
        torch.manual_seed(0)
        model = mod.Model(*mod.get_init_inputs()).eval()
        a, b = mod.get_inputs(), mod.get_inputs()
        with torch.no_grad():
            ya, yb, yc = model(*a), model(*b), torch.compile(model)(*a)
        torch.testing.assert_close(yc, ya, atol=1e-2, rtol=1e-2)
        # depends on its input (exactly as env.py calls a task degenerate: a mean over many elements of two random
        # inputs may differ by well under 1%)
        assert not torch.equal(ya, yb)


@pytest.mark.slow
def test_interrupted_run_resumes_and_same_seed_gives_same_dataset(run_a, tmp_path):
    out = tmp_path / "b"
    partial = Path(str(out) + ".partial")
    # One child checks every candidate; results reach the resume file one at a time; Ctrl-C after the first.
    # (SIGINT back to its default in the child: a shell's background job, e.g. CI's, starts with it ignored)
    p = subprocess.Popen([sys.executable, "synth.py", "--out", str(out), *CLI, "--workers", "1"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        f = partial / "filtered.jsonl"
        if f.exists() and f.read_text().strip():
            break
        time.sleep(0.2)
    assert p.poll() is None, "the run ended before it could be interrupted"
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "Re-run the same command to resume" in stderr
    assert not out.exists()  # DIR is only ever written complete
    n_done = len((partial / "filtered.jsonl").read_text().splitlines())
    assert n_done >= 1
    # resume: reuses the recorded results, filters the rest (one worker: on 2 cores a second child only costs)
    r = run_cli("--out", str(out), *CLI, "--workers", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not partial.exists()
    # same seed, same dataset (run_a used 2 workers: batching, workers, interruption and machine load do not matter)
    strip = lambda rows: [(x["split"], x["ops"], x["data_source"], x["code"]) for x in rows]
    assert strip(rows_of(run_a[0])) == strip(rows_of(out))


@pytest.mark.parametrize("args, msg", [
    (["--max-ops", "0"], "--max-ops"),
    (["--num-tasks", "0"], "--num-tasks"),
    (["--kernelbench-dir", "/nonexistent/kb"], "--kernelbench-dir"),
    (["--window-ms", "5", "1"], "--window-ms"),
])
def test_bad_input_gives_one_clear_line(args, msg, tmp_path):
    r = run_cli("--out", str(tmp_path / "o"), "--backend", "cpu", *args, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("synth.py: error:") and msg in lines[0], r.stderr
    assert not (tmp_path / "o").exists()


def test_unwritable_or_foreign_out_gives_one_clear_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    for out in (f / "sub" / "o", foreign):
        r = run_cli("--out", str(out), "--backend", "cpu", timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("synth.py: error: --out"), r.stderr
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_load_tasks_rejects_a_folder_that_is_not_ours_and_reads_empty_splits(tmp_path):
    with pytest.raises(env.UsageError):
        tasks.read_dataset(str(tmp_path), "train")
    row = dict(ops=["torch.tanh"], data_source="torch#1", code=task("return torch.tanh(x)"), eager_ms=1.0, compile_ms=2.0,
               input_shape=[256, 1024])
    (tmp_path / "work").mkdir()
    assert synth.save([row], tmp_path / "one", tmp_path / "work", synth.Config(), {}) == (1, 0)  # one task: no test row
    assert len(tasks.read_dataset(str(tmp_path / "one"), "train")) == 1
    test = tasks.read_dataset(str(tmp_path / "one"), "test")
    assert len(test) == 0 and set(test.column_names) == {"ops", "data_source", "code", "eager_ms", "compile_ms"}
    with pytest.raises(env.UsageError):
        tasks.read_dataset(str(tmp_path / "one"), "validation")


def test_a_machine_where_nothing_runs_stops_soon_with_one_line(tmp_path, monkeypatch, capsys):
    """A machine where the sandboxed children cannot run anything (e.g. cannot start CUDA): every candidate
    'fails eager'. synth.py must stop after the first 20 results (and those already running) and say why, in one
    line, instead of composing thousands more."""
    calls = []
    class BrokenChecker:  # what the sandboxed children answered there
        def __init__(self, cfg, backend, stop_fd, child):
            self.n, self.dead = 0, False

        def check(self, c):
            calls.append(c["key"])
            return {"key": c["key"], "kept": False, "drop": "eager failed: RuntimeError: CUDA error: OS call failed"}

        def close(self):
            pass
    monkeypatch.setattr(synth, "Checker", BrokenChecker)
    rc = synth.main(["--out", str(tmp_path / "o"), "--num-tasks", "20", "--backend", "cpu", "--workers", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("synth.py: error: all ") and "CUDA error: OS call failed" in err[-1], err[-3:]
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()  # nothing stale to resume from
    assert 20 <= len(calls) <= 21, calls  # the first 20 results, and the one the other worker was checking


@pytest.mark.parametrize("composer", ["llm", "rule"])
def test_filter_children_of_llm_written_tasks_get_private_caches(monkeypatch, composer):
    """Tasks an LLM composed run with caches of their own (the shared inductor, Triton and NVRTC caches feed env.py's
    reference children), and nothing shared to write; every other compile setting is kept (one compile process)."""
    import checker
    seen = {}
    monkeypatch.setattr(checker.env, "run_sandboxed", lambda argv, cwd, **kw: seen.update(kw, cwd=cwd))
    r, w = os.pipe()
    c = checker.Checker(synth.Config(composer=composer, window_ms=(0.1, 10.0)), "cpu", r, [sys.executable, "-c", "pass"])
    c.thread.join(10)
    try:
        shared, _ = env.compile_caches()
        assert seen["env"]["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
        for key, value in shared.items():
            if key.endswith(("_DIR", "_PATH")):
                if composer == "llm":
                    assert Path(seen["env"][key]).parent == Path(c.dir), (key, seen["env"][key])
                else:
                    assert seen["env"][key] == value
        assert (seen["writable"] == []) == (composer == "llm"), seen["writable"]
    finally:
        c.close()
        os.close(r)
        os.close(w)
