"""evaluate.py: metrics exactly as hand-computed, the load_inline converter, end-to-end --solutions runs on the
fixture bench (tests/fixtures_bench: 3 CPU problems; known-good, known-wrong and cheating solutions in both
formats, all sharing examples/relu_cpu/kernels/relu.cpp byte-for-byte so the ~60 s build happens once), resume,
the JSON contract, bad inputs, and a smoke run of every documented command (agent and single modes against a
scripted OpenAI-compatible server on localhost, so no model is loaded)."""
import ast
import http.server
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import datasets
import pytest

import agent
import env
import evaluate
import reward
import tasks

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures_bench"
BENCH = FIX / "bench"
RELU_CPP = (ROOT / "examples" / "relu_cpu" / "kernels" / "relu.cpp").read_text()


def cli(*args, timeout=900):
    r = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), *map(str, args)], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    return r


def last_json(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("evaluate.py: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


# ----------------------------------------------------------------------------------------------
# Metrics (reward.py)
# ----------------------------------------------------------------------------------------------
def verdict(correct, runtime=None, eager=None, compile_=None):
    return {"correct": correct, "runtime_ms": runtime, "eager_ms": eager, "compile_ms": compile_,
            "speedup_eager": eager / runtime if runtime and eager else None,
            "speedup_compile": compile_ / runtime if runtime and compile_ else None,
            "reward": reward.reward_for(correct, runtime, eager, compile_)}


CRAFTED = [  # (level, verdict, n_turns, n_tokens, seconds)
    ("1", verdict(True, 1.0, 2.0, 1.5), 3, 100, 10.0),     # A: beats eager and compile
    ("1", verdict(True, 1.0, 1.04, 0.5), 5, 300, 20.0),    # B: 4% faster than eager (fast_1 yes, > 5% no), slower than compile
    ("2", verdict(True, 1.0, 1.0, 2.0), None, None, 5.0),  # C: same as eager (fast_1 no), beats compile
    ("2", verdict(True, 95.0, 100.0, 100.0), 1, 50, 1.0),  # D: exactly 5% faster: not MORE than the margin
    ("2", verdict(False, 0.001, 1.0, 1.0), 10, 1000, 2.0), # E: "fast" but wrong: counts 0 everywhere
    ("3", {}, None, None, 0.5),                            # F: crashed before any verdict field
]


def crafted_rows():
    return [{"task_id": f"t{i}", "level": lv, "verdict": v, "n_turns": nt, "n_tokens": ntok, "seconds": s}
            for i, (lv, v, nt, ntok, s) in enumerate(CRAFTED)]


def test_summarize_matches_hand_computation():
    assert reward.MARGIN == env.MARGIN  # env.py scores with the reward these metrics are defined by
    m = reward.summarize(crafted_rows())
    assert m["n"] == 6 and m["n_correct"] == 4
    assert m["pass_rate"] == 4 / 6
    assert m["faster_eager_rate"] == 1 / 6            # A only (B is 4%, C 0%, D exactly 5%)
    assert m["faster_compile_rate"] == 2 / 6          # A and C
    assert m["fast_1"] == 3 / 6                       # A (2.0x), B (1.04x), D (1.053x); C is 1.0x
    assert m["geomean_speedup_eager"] == pytest.approx((2.0 * 1.04 * 1.0 * (100 / 95)) ** 0.25, rel=1e-12)
    assert m["geomean_speedup_compile"] == pytest.approx((1.5 * 0.5 * 2.0 * (100 / 95)) ** 0.25, rel=1e-12)
    assert m["mean_turns"] == (3 + 5 + 1 + 10) / 4 and m["mean_tokens"] == (100 + 300 + 50 + 1000) / 4
    assert m["task_s"] == 38.5
    # the same decisions as the reward: >eager iff reward >= 2, >eager and >compile iff reward 3
    for lv, v, *_ in CRAFTED:
        if v.get("correct"):
            assert reward.beats(v["runtime_ms"], v["eager_ms"]) == (v["reward"] >= 2)
            assert (reward.beats(v["runtime_ms"], v["eager_ms"]) and reward.beats(v["runtime_ms"], v["compile_ms"])) == (v["reward"] == 3)


def test_summarize_per_level_and_empty():
    res = evaluate.by_level(crafted_rows(), reward.summarize)
    assert list(res["levels"]) == ["1", "2", "3"]
    l1, l2, l3 = (res["levels"][k] for k in "123")
    assert (l1["n"], l1["pass_rate"], l1["faster_eager_rate"], l1["faster_compile_rate"], l1["fast_1"]) == (2, 1.0, 0.5, 0.5, 1.0)
    assert (l2["n"], l2["pass_rate"], l2["faster_eager_rate"], l2["faster_compile_rate"]) == (3, 2 / 3, 0.0, 1 / 3)
    assert l2["geomean_speedup_compile"] == pytest.approx(math.sqrt(2.0 * 100 / 95))
    assert (l3["n"], l3["pass_rate"], l3["geomean_speedup_eager"], l3["mean_turns"]) == (1, 0.0, None, None)
    assert res["overall"] == reward.summarize(crafted_rows())
    e = reward.summarize([])
    assert e["n"] == 0 and e["pass_rate"] is None and e["geomean_speedup_compile"] is None
    # bare verdict dicts work too (train.py may pass env verdicts directly)
    assert reward.summarize([v for _, v, *_ in CRAFTED])["faster_compile_rate"] == 2 / 6
    assert reward.summarize([env.Verdict(**{**v, "speedup_eager": None}) for _, v, *_ in CRAFTED[:2]])["faster_eager_rate"] == 0.5
    table = evaluate.table(dict(res, mode="solutions"))
    assert "| level 2 | 3 | 66.7% | 0.0% | 33.3% |" in table


# ----------------------------------------------------------------------------------------------
# The load_inline converter
# ----------------------------------------------------------------------------------------------
def test_converter_on_fixture_keeps_the_cached_source_byte_for_byte():
    for f in [FIX / "solutions" / "2_ScaledReLUEye.py", FIX / "solutions_bad" / "1_ScaledReLU.py"]:
        model_new, files, notes = evaluate.convert_load_inline(f.read_text(), "cpu")
        assert files == {"kernels/relu.cpp": RELU_CPP}  # same bytes => same build cache entry as examples/relu_cpu
        names = {ast.unparse(n) for n in ast.walk(ast.parse(model_new)) if isinstance(n, (ast.Name, ast.Attribute, ast.alias))}
        assert not any("load_inline" in x or "cpp_extension" in x for x in names) and "import cuda_extension" in model_new
        assert "relu_source" not in model_new  # the consumed source string is dropped
        violations, _ = env.static_scan(files, model_new)
        assert violations == []
        assert any("extra_cflags" in n for n in notes)


KB_STYLE = '''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

twice_src = """
__global__ void k(const float* a, float* o, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) o[i] = 2 * a[i]; }
torch::Tensor twice(torch::Tensor a) { auto o = torch::empty_like(a); k<<<(a.numel() + 255) / 256, 256>>>(a.data_ptr<float>(), o.data_ptr<float>(), a.numel()); return o; }
"""
twice_cpp = "torch::Tensor twice(torch::Tensor a);"
twice = load_inline(name="twice_ext", cpp_sources=twice_cpp, cuda_sources=twice_src, functions=["twice"], verbose=True)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.neg = load_inline("neg", ["torch::Tensor neg(torch::Tensor a);"], "torch::Tensor neg(torch::Tensor a) { return a; }",
                               functions={"neg": "negate"})

    def forward(self, a):
        return self.neg.neg(twice.twice(a))
'''


def test_converter_functions_multiple_calls_and_errors():
    model_new, files, _ = evaluate.convert_load_inline(KB_STYLE, "cuda")
    assert sorted(files) == ["kernels/neg.cpp", "kernels/neg_cuda.cu", "kernels/twice_ext.cpp", "kernels/twice_ext_cuda.cu"]
    allsrc = "".join(files.values())
    assert allsrc.count("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)") == 1  # env.py needs exactly one
    assert 'm.def("twice", &twice, "twice");' in files["kernels/twice_ext.cpp"]
    assert 'm.def("neg", &neg, "negate");' in files["kernels/neg.cpp"]
    assert "cuda_agent_register_neg(m);" in files["kernels/twice_ext.cpp"]
    assert files["kernels/twice_ext_cuda.cu"].startswith("#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n")
    assert files["kernels/twice_ext.cpp"].startswith("#include <torch/extension.h>\n")
    assert "self.neg = cuda_extension" in model_new and "twice = cuda_extension" in model_new
    assert "cuda_extension.neg(twice.twice(a))" in model_new  # (the module held by self, spelled as the scan reads it)
    assert env.static_scan(files, model_new)[0] == []
    # a function whose name is no PyTorch operator, called through the module kept on self (KernelBench's usual form)
    held = KB_STYLE.replace("self.neg.neg(", "self.neg.negate_it(").replace('{"neg": "negate"}', '["negate_it"]').replace(
        "neg(torch::Tensor a)", "negate_it(torch::Tensor a)")
    model_new, files, _ = evaluate.convert_load_inline(held, "cuda")
    assert "cuda_extension.negate_it(" in model_new and env.static_scan(files, model_new)[0] == [], model_new
    with pytest.raises(evaluate.ConversionError, match="CPU backend builds cpp_sources only"):
        evaluate.convert_load_inline(KB_STYLE, "cpu")
    with pytest.raises(evaluate.ConversionError, match="without running the file"):
        evaluate.convert_load_inline(KB_STYLE.replace('twice_cpp = "', 'twice_cpp = f"'), "cuda")
    with pytest.raises(evaluate.ConversionError, match="no load_inline"):
        evaluate.convert_load_inline((BENCH / "level1" / "1_ScaledReLU.py").read_text(), "cpu")


# ----------------------------------------------------------------------------------------------
# End to end on the fixture bench (CPU). Expected outcomes are by construction:
#   solutions/1_ScaledReLU/      workspace, PyTorch fallback + a decoy kernel         -> fail (violation)
#   solutions/2_ScaledReLUEye.py single file, correct; the reference wastes ~1000x   -> pass, faster than both
#   solutions/1_ScaleThenReLU/   workspace, correct but calls the kernel 256x on a   -> pass, not faster
#                                problem eager runs in microseconds
#   solutions_bad/: a pointer-keyed output cache (single file), an operand bug (workspace), a layout bug
#   (single file)                                                                    -> all fail
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "a"
    r = cli("--solutions", FIX / "solutions", "--bench-dir", BENCH, "--backend", "cpu", "--out", out, "--json")
    return r, out


@pytest.mark.slow
def test_solutions_end_to_end(run_a):
    r, out = run_a
    o = last_json(r)
    for k in ("n", "pass_rate", "faster_eager_rate", "faster_compile_rate", "geomean_speedup_eager", "geomean_speedup_compile"):
        assert k in o  # the JSON contract
    assert (o["n"], o["n_correct"]) == (3, 2)
    assert o["pass_rate"] == 2 / 3 and o["faster_eager_rate"] == 1 / 3 and o["faster_compile_rate"] == 1 / 3
    assert o["fast_1"] == 1 / 3
    rows = {json.loads(l)["task_id"]: json.loads(l) for l in (out / "tasks.jsonl").read_text().splitlines()}
    assert sorted(rows) == ["level1/1_ScaledReLU", "level1/2_ScaledReLUEye", "level2/1_ScaleThenReLU"]
    cheat, fast, slow = rows["level1/1_ScaledReLU"], rows["level1/2_ScaledReLUEye"], rows["level2/1_ScaleThenReLU"]
    assert slow["verdict"]["reward"] == 1 and slow["verdict"]["speedup_eager"] < 0.5
    assert fast["verdict"]["reward"] == 3 and fast["verdict"]["speedup_compile"] > 2
    assert cheat["verdict"]["reward"] == -1 and "torch.relu is not allowed" in cheat["verdict"]["violations"][0]
    assert fast["files"]["kernels/relu.cpp"] == RELU_CPP and "cuda_extension" in fast["files"]["model_new.py"]
    # geomeans over the two correct tasks, from their own verdicts
    ok = [slow["verdict"], fast["verdict"]]
    assert o["geomean_speedup_eager"] == pytest.approx(math.sqrt(ok[0]["speedup_eager"] * ok[1]["speedup_eager"]))
    res = json.loads((out / "results.json").read_text())
    assert res["overall"]["pass_rate"] == o["pass_rate"]
    assert res["levels"]["1"]["pass_rate"] == 0.5 and res["levels"]["1"]["faster_compile_rate"] == 0.5
    assert res["levels"]["2"]["n"] == 1 and res["levels"]["2"]["pass_rate"] == 1.0 and res["levels"]["2"]["fast_1"] == 0.0
    assert "| level 1 | 2 | 50.0% | 50.0% | 50.0% |" in r.stdout and "fast_1" in r.stdout  # table + definitions


@pytest.mark.slow
def test_resume_skips_done_tasks(run_a):
    r, out = run_a
    before = last_json(r)
    again = cli("--solutions", FIX / "solutions", "--bench-dir", BENCH, "--backend", "cpu", "--out", out, "--json")
    assert "resuming" in again.stdout and "task 1/" not in again.stdout
    same = last_json(again)
    assert {k: same[k] for k in ("n", "pass_rate", "faster_compile_rate")} == {k: before[k] for k in ("n", "pass_rate", "faster_compile_rate")}
    # a different kind of run in the same folder is refused (no lost work)
    other = cli("--solutions", FIX / "solutions_bad", "--bench-dir", BENCH, "--backend", "cpu", "--out", out)
    one_line_error(other, "holds a different run")


@pytest.mark.slow
def test_a_solution_workspace_of_the_curriculum_holds_its_op_library(tmp_path):
    """--solutions: a task of the elementwise curriculum's workspace starts with the op library, as an episode's does,
    so a solution written for the prompt (binding, kernel, model_new.py) builds; the solution's own files win."""
    import elementwise
    code = next(c for i in range(50) if "drop" not in (c := elementwise.compose_one(i, 0, "cpu", (0.1, 10.0))))["code"]
    sol = tmp_path / "sol"
    for rel, text in {**elementwise.solution_files(code, "cpu"), "kernels/lib.h": "// mine\n"}.items():
        (sol / rel).parent.mkdir(parents=True, exist_ok=True)
        (sol / rel).write_text(text)
    evaluate.prepare_workspace({"code": code}, sol, tmp_path / "ws", "cpu")
    assert (tmp_path / "ws" / "kernels" / "lib.h").read_text() == "// mine\n"
    (sol / "kernels" / "lib.h").unlink()
    evaluate.prepare_workspace({"code": code}, sol, tmp_path / "ws", "cpu")
    assert (tmp_path / "ws" / "kernels" / "lib.h").read_text() == elementwise.header("cpu")
    relu = (ROOT / "examples" / "relu.py").read_text()
    evaluate.prepare_workspace({"code": relu}, sol, tmp_path / "ws2", "cpu")
    assert not (tmp_path / "ws2" / "kernels" / "lib.h").exists()


def test_wrong_and_cheating_solutions_all_fail(tmp_path):
    r = cli("--solutions", FIX / "solutions_bad", "--bench-dir", BENCH, "--backend", "cpu", "--out", tmp_path / "b", "--json")
    o = last_json(r)
    assert (o["n"], o["pass_rate"], o["faster_eager_rate"], o["faster_compile_rate"]) == (3, 0.0, 0.0, 0.0)
    assert o["geomean_speedup_eager"] is None
    rows = {json.loads(l)["task_id"]: json.loads(l)["verdict"] for l in (tmp_path / "b" / "tasks.jsonl").read_text().splitlines()}
    # every check reuses the same input buffers, so a pointer-keyed cache already fails the second check
    assert "check 2/5" in rows["level1/1_ScaledReLU"]["error"] and "values differ" in rows["level1/1_ScaledReLU"]["error"]
    assert "values differ" in rows["level1/2_ScaledReLUEye"]["error"]
    assert "expected shape (4, 64)" in rows["level2/1_ScaleThenReLU"]["error"]


@pytest.mark.slow
def test_reference_only(tmp_path):
    r = cli("--bench-dir", BENCH, "--levels", "2", "--reference-only", "--backend", "cpu", "--out", tmp_path / "ref", "--json")
    o = last_json(r)
    assert o["n"] == 1 and o["n_ran"] == 1 and o["compile_faster_rate"] in (0.0, 1.0)
    row = json.loads((tmp_path / "ref" / "tasks.jsonl").read_text())
    assert row["error"] is None and row["eager_ms"] > 0 and row["compile_ms"] > 0
    assert o["geomean_compile_speedup"] == pytest.approx(row["eager_ms"] / row["compile_ms"])
    assert "compile>eager" in r.stdout and "H100" in r.stdout


# ----------------------------------------------------------------------------------------------
# Agent and single-turn modes through the real CLI, against a scripted OpenAI-compatible server
# ----------------------------------------------------------------------------------------------
HONEST_MODEL_NEW = (ROOT / "examples" / "relu_cpu" / "model_new.py").read_text()


def tool_call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


AGENT_SCRIPT = [tool_call("write_file", path="kernels/relu.cpp", content=RELU_CPP),
                tool_call("write_file", path="model_new.py", content=HONEST_MODEL_NEW), tool_call("finish")]
SINGLE_ANSWER = f"Here it is.\n```python\n# file: model_new.py\n{HONEST_MODEL_NEW}```\n```cpp\n// file: kernels/relu.cpp\n{RELU_CPP}```\n"


@pytest.fixture()
def scripted_server():
    """Answers chat completions: agent requests (with tools) get AGENT_SCRIPT[turn], others SINGLE_ANSWER."""
    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            turn = sum(m["role"] == "assistant" for m in body["messages"])
            text = AGENT_SCRIPT[min(turn, 2)] if body.get("tools") else SINGLE_ANSWER
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("mode,turns", [("agent", 3), ("single", 1)])
def test_policy_modes_with_scripted_server(scripted_server, tmp_path, mode, turns):
    out = tmp_path / mode
    if mode == "agent":  # a KernelBench folder
        bench, task_id, level = ["--bench-dir", BENCH, "--levels", "2"], "level2/1_ScaleThenReLU", "2"
    else:  # our synthetic split (a synth.py output folder), holding the same problem
        code = (BENCH / "level2" / "1_ScaleThenReLU.py").read_text()
        row = {"code": [code], "ops": [["torch.mul", "torch.relu"]], "data_source": ["torch#2"]}
        datasets.DatasetDict({"train": datasets.Dataset.from_dict(row), "test": datasets.Dataset.from_dict(row)}).save_to_disk(tmp_path / "ds")
        bench, task_id, level = ["--bench", "synth", "--dataset", tmp_path / "ds", "--split", "test"], "test/00000", "torch#2"
    r = cli(*bench, "--mode", mode, "--policy", "openai", "--model", "scripted", "--base-url", scripted_server,
            "--backend", "cpu", "--out", out, "--json")
    o = last_json(r)
    assert (o["n"], o["pass_rate"], o["mean_turns"]) == (1, 1.0, turns)
    assert list(json.loads((out / "results.json").read_text())["levels"]) == [level]
    row = json.loads((out / "tasks.jsonl").read_text())
    assert row["task_id"] == task_id and row["files"]["kernels/relu.cpp"] == RELU_CPP
    path, line = row["trajectory"].rsplit(":", 1)
    ep = json.loads(Path(path).read_text().splitlines()[int(line) - 1])
    assert ep["task_id"] == task_id and ep["verdict"]["correct"]


class CharTokenizer:
    """A stand-in tokenizer (one token per character) so the hf code path runs without loading a model."""
    chat_template = ""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class ScriptedHFPolicy:
    kind, tokenizer, stop = "hf", CharTokenizer(), [0]

    def generate(self, prompts, max_new_tokens, temperature=0.0, stop=None):
        return [[ord(c) for c in SINGLE_ANSWER] for _ in prompts]


@pytest.mark.slow
def test_run_eval_api_single_mode_with_hf_style_policy(tmp_path):
    """The importable entry point train.py uses, on the hf code path (token ids in, token ids out)."""
    task = tasks.load_bench_dir(str(BENCH), ["2"])[0]
    res = evaluate.run_eval([task], mode="single", policy=ScriptedHFPolicy(), out_dir=tmp_path / "s", backend="cpu", quiet=True)
    assert (res["overall"]["n"], res["overall"]["pass_rate"], res["overall"]["mean_turns"]) == (1, 1.0, 1)
    row = json.loads((tmp_path / "s" / "tasks.jsonl").read_text())
    prompt = CharTokenizer().apply_chat_template(agent.single_turn_messages(task, "cpu"))
    assert row["n_tokens"] == len(prompt) + len(SINGLE_ANSWER)  # prompt + generated ids, kept as generated
    assert json.loads((tmp_path / "s" / "results.json").read_text())["overall"] == res["overall"]


# ----------------------------------------------------------------------------------------------
# Compare, chart, bad inputs
# ----------------------------------------------------------------------------------------------
def test_compare(tmp_path):
    rows = crafted_rows()
    for name, subset in (("runA", rows), ("runB", rows[:3])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(dict(evaluate.by_level(subset, reward.summarize), mode="solutions")))
    r = cli("--compare", tmp_path / "runA" / "results.json", tmp_path / "runB" / "results.json")
    assert r.returncode == 0, r.stderr
    assert "| runA | runB | CUDA Agent (paper) |" in r.stdout
    assert "| overall | n | 6 | 3 |" in r.stdout
    assert "|  | pass | 66.7% | 100.0% | 98.8% |" in r.stdout and "|  | >compile | 33.3% | 66.7% | 96.8% |" in r.stdout
    assert "| level 3 | n | 1 | - |" in r.stdout  # a level only run A has
    one_line_error(cli("--compare", tmp_path / "runA" / "results.json", tmp_path / "nope.json"), "no such results file")


def test_chart(tmp_path):
    pytest.importorskip("matplotlib")
    assert evaluate.chart(evaluate.by_level(crafted_rows(), reward.summarize), tmp_path / "rates.png")
    assert (tmp_path / "rates.png").stat().st_size > 1000


def test_bad_inputs_give_one_line(tmp_path):
    one_line_error(cli("--solutions", FIX / "solutions", "--bench-dir", tmp_path / "missing", "--out", tmp_path / "o"),
                   "no such bench directory")
    (tmp_path / "empty").mkdir()
    one_line_error(cli("--solutions", tmp_path / "empty", "--bench-dir", BENCH, "--backend", "cpu", "--out", tmp_path / "o"),
                   "no solutions in")
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "7_NoSuchProblem.py").write_text("pass\n")
    one_line_error(cli("--solutions", tmp_path / "wrong", "--bench-dir", BENCH, "--backend", "cpu", "--out", tmp_path / "o"),
                   "match no problem", "7_NoSuchProblem")
    one_line_error(cli("--bench-dir", BENCH, "--levels", "one", "--reference-only", "--out", tmp_path / "o"), "--levels")
    one_line_error(cli("--bench-dir", BENCH, "--levels", "7", "--reference-only", "--out", tmp_path / "o"), "no KernelBench-format problems")
    one_line_error(cli("--bench-dir", BENCH / "level1", "--levels", "1,2", "--reference-only", "--out", tmp_path / "o"), "single --levels")
    one_line_error(cli("--bench", "synth", "--reference-only", "--out", tmp_path / "o"), "--dataset")
    one_line_error(cli("--solutions", FIX / "solutions", "--bench-dir", BENCH, "--model", "M", "--out", tmp_path / "o"), "--model")
    one_line_error(cli("--bench-dir", BENCH, "--reference-only", "--model", "/nonexistent/model", "--out", tmp_path / "o"), "--model")
    one_line_error(cli("--bench-dir", BENCH, "--levels", "2", "--model", "/nonexistent/model", "--backend", "cpu", "--out", tmp_path / "o"),
                   "no such model folder or hub id: /nonexistent/model")
    one_line_error(cli("--solutions", FIX / "solutions", "--bench-dir", BENCH, "--backend", "tpu", "--out", tmp_path / "o"), "backend")
    assert not (tmp_path / "o").exists()  # nothing was started
    if not tasks.hub_reachable():
        one_line_error(cli("--bench", "kernelbench", "--levels", "1", "--reference-only", "--out", tmp_path / "o"),
                       "cannot load ScalingIntelligence/KernelBench", "--bench-dir")


def test_missing_solution_counts_as_failure(tmp_path):
    # one workspace solution for the level-2 problem only, and a level filter: nothing runs but the scan
    sol = tmp_path / "sol"
    (sol / "1_ScaleThenReLU" / "kernels").mkdir(parents=True)
    (sol / "1_ScaleThenReLU" / "model_new.py").write_text("import os\n")  # a banned import: fails in the static scan
    r = cli("--solutions", sol, "--bench-dir", BENCH, "--backend", "cpu", "--out", tmp_path / "o", "--json", "--workers", "2")
    o = last_json(r)  # (two worker processes: the parallel path)
    assert (o["n"], o["pass_rate"]) == (3, 0.0)
    assert "2 of 3 tasks have no solution" in r.stderr
    rows = [json.loads(l) for l in (tmp_path / "o" / "tasks.jsonl").read_text().splitlines()]
    assert sum("no solution for this task" in (x["verdict"]["error"] or "") for x in rows) == 2
    assert any("import of os" in " ".join(x["verdict"]["violations"]) for x in rows)
    # resume after a kill that cut the last line short: that task (only) runs again
    lines = (tmp_path / "o" / "tasks.jsonl").read_text().splitlines()
    keep = [l for l in lines if "level1/2_ScaledReLUEye" not in l]
    (tmp_path / "o" / "tasks.jsonl").write_text("\n".join(keep) + "\n" + '{"task_id": "level1/2_Sca')
    redo = cli("--solutions", sol, "--bench-dir", BENCH, "--backend", "cpu", "--out", tmp_path / "o", "--json")
    assert "task 1/1 | level1/2_ScaledReLUEye | reward -1" in redo.stdout and "task 2/" not in redo.stdout
    assert last_json(redo)["n"] == 3


@pytest.mark.gpu
def test_cuda_solutions_honest_pass_cheats_fail(tmp_path):
    """On a GPU: single files with load_inline(cuda_sources, functions=) and workspaces built from the env GPU
    tests' kernels (tests/env_cases/cuda). Honest ones pass; a Python and a C++ pointer cache, a PyTorch
    fallback and an operand bug fail."""
    o = last_json(cli("--solutions", FIX / "solutions_cuda", "--bench-dir", BENCH, "--backend", "cuda", "--out", tmp_path / "c", "--json"))
    rows = {json.loads(l)["task_id"]: json.loads(l)["verdict"] for l in (tmp_path / "c" / "tasks.jsonl").read_text().splitlines()}
    assert rows["level1/2_ScaledReLUEye"]["correct"] and rows["level2/1_ScaleThenReLU"]["correct"], rows
    # a pointer cache fails at the second check: every run reuses the same input buffers
    assert not rows["level1/1_ScaledReLU"]["correct"] and "values differ" in rows["level1/1_ScaledReLU"]["error"]
    assert o["pass_rate"] == 2 / 3
    r = cli("--solutions", FIX / "solutions_cuda_bad", "--bench-dir", BENCH, "--backend", "cuda", "--out", tmp_path / "d", "--json")
    assert last_json(r)["pass_rate"] == 0.0
    rows = {json.loads(l)["task_id"]: json.loads(l)["verdict"] for l in (tmp_path / "d" / "tasks.jsonl").read_text().splitlines()}
    assert "values differ" in rows["level1/1_ScaledReLU"]["error"]
    fallback = rows["level1/2_ScaledReLUEye"]["violations"][0]  # refused by the allow-list or by the monitor
    assert "aten." in fallback or "is not allowed" in fallback
    assert "values differ" in rows["level2/1_ScaleThenReLU"]["error"]


def test_fixture_kernel_copies_match_their_originals():
    """The fixture workspaces' kernels are copies (shared builds, complete sets: tests/fixtures_bench/README.md).
    Copies drift; this keeps them byte-identical to the sources they copy."""
    originals = {"relu.cpp": ROOT / "examples" / "relu_cpu" / "kernels" / "relu.cpp",
                 "ops.cu": ROOT / "tests" / "env_cases" / "cuda" / "ops.cu",
                 "ops_binding.cpp": ROOT / "tests" / "env_cases" / "cuda" / "ops_binding.cpp"}
    copies = sorted(FIX.glob("solutions*/*/kernels/*"))
    assert len(copies) == 11
    for c in copies:
        assert c.read_bytes() == originals[c.name].read_bytes(), f"{c} differs from {originals[c.name]}"
