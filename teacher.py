"""teacher.py: teacher policies that write verified demonstrations for the cold start (train.py's sft stage).

    # one episode with a transcript (the built-in teacher, tokens of the embedded model's tokenizer)
    python agent.py --policy teacher --problem task.py --backend cpu
    # demonstrations for every task of a synth.py dataset: DIR/demos.jsonl and a table of rewards and speedups
    python teacher.py --tasks data/elem --backend cpu --out runs/demos --samples 2
    # a large model behind any OpenAI-compatible server as the teacher instead (distillation)
    python teacher.py --tasks data/elem --backend cuda --out runs/demos --teacher-url http://localhost:8000/v1 \\
        --teacher-model Qwen/Qwen3-32B

A teacher is a policy of agent.py like any other: run_episodes gives it the token ids of the conversation so
far, and it answers with token ids of the student's tokenizer, text in exactly the format the loop parses
(some reasoning, then one <tool_call>{...}</tool_call>). Its episodes are therefore token-exact trajectories,
trained on like the student's own (loss on the teacher's tokens, never on the observations).

ScriptedTeacher solves any task of the elementwise family (elementwise.py): it reads the chain from the task's
code, writes the fixed binding, a fused kernel that calls the op library the workspace starts with
(elementwise.provided_files) and model_new.py, compiles, profiles (a profile checks before it times: no verify
first). Its first kernel is one template per kind (choose_plan: a thread per element; a block per row for
reductions, a call of the library's row function; on CPU OpenMP over rows with a vectorised inner loop, or the row
function over each row); in half of the episodes
one other variant follows (grid-stride or float4, at a drawn block size; a warp per row or two kernels; one flat
OpenMP loop, or a row buffer) and the faster is kept, so demonstrations differ in speed and RL has something left
to find. In a share of the episodes (drawn at MISTAKES, played where the chain allows one: script) it plays one turn
wrong on purpose, a student's typical mistake, and the turns after it recover (Unlearned): that turn's tokens are
masked out of the demonstration, so the student learns the recovery, never the mistake.
Its memory of an episode is the conversation itself (recorded per token prefix): each turn replays the script
on the observations so far, and the plan is read back from its own first turn.

Only episodes that env.py scores at reward >= 1 (finished, no malformed call) are demonstrations.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import agent
import elementwise as E
import env
import tools
from tasks import load_problem, load_split

MARK = "<<OBSERVATION>>"


# ----------------------------------------------------------------------------------------------
# The conversation behind a token prompt
# ----------------------------------------------------------------------------------------------
class ToolTeacher:
    """Base of the teachers: maps the token prompt run_episodes gives to (task code, [(reply, observation)]),
    asks reply() for the next turn's text and returns it as token ids ending with the stop token."""
    kind = "hf"
    batched = False  # a reply per prompt: run_episodes gives each episode a thread of its own (no turn waits for the others)

    def __init__(self, tokenizer, backend: str):
        self.tokenizer, self.backend = tokenizer, env.resolve_backend(backend)
        self.stop = agent.stop_token_ids(tokenizer)
        self.sessions = {}  # hash of (prompt + reply tokens) -> (task code, history, reply text)
        self.cut = set()  # lengths of prompt + reply where a reply was cut at its token budget (no stop token)
        wrapped = tokenizer.decode(agent.observation_tokens(tokenizer, MARK, True, ""))
        self.wrap = [w.strip() for w in wrapped.split(MARK)]  # the template's text around an observation
        self.started = collections.Counter()  # episodes started per task (ScriptedTeacher's plans differ between them)

    def _state(self, prompt: list) -> tuple[str, list]:
        """A reply ends with a stop token (or was cut): the longest such prefix that is a recorded reply is this
        episode's last turn, and the tokens after it are the observation."""
        # (a copy of cut: other episodes' threads add to it)
        ends = [i + 1 for i, t in enumerate(prompt) if t in self.stop] + [n for n in tuple(self.cut) if n < len(prompt)]
        for n in sorted(ends, reverse=True):
            if (hit := self.sessions.get(hash(tuple(prompt[:n])))) is not None:
                code, history, text = hit
                rest = self.tokenizer.decode(prompt[n:])
                i, j = rest.find(self.wrap[0]), rest.rfind(self.wrap[1])
                obs = rest[i + len(self.wrap[0]):j].strip("\n") if 0 <= i < j else rest
                return code, history + [(text, obs)]
        text = self.tokenizer.decode(prompt)
        i = text.rfind("```python\n")
        j = text.find("\n```", i + 10)
        if i < 0 or j < 0:
            raise ValueError("the prompt holds no task code (```python block)")
        return text[i + 10:j + 1], []

    def generate(self, prompts, max_new_tokens, temperature=0.0, stop=None):
        budgets = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
        states = [self._state(p) for p in prompts]
        texts = self._replies(states, temperature)
        outs = []
        for p, (code, history), text, budget in zip(prompts, states, texts, budgets):
            ids = (agent.encode(self.tokenizer, text) + self.stop[:1])[:budget]  # over budget: cut, like a model
            key = hash(tuple(p) + tuple(ids))
            self.sessions[key] = (code, history, self.tokenizer.decode(ids[:-1] if ids[-1:] == self.stop[:1] else ids))
            if ids[-1:] != self.stop[:1]:
                self.cut.add(len(p) + len(ids))
            outs.append(ids)
        return outs

    def _replies(self, states, temperature):
        return [self.reply(code, history, temperature) for code, history in states]

    def reply(self, code: str, history: list, temperature: float) -> str:
        raise NotImplementedError

    def release(self):
        pass


def call(thought: str, name: str, **args) -> str:
    return f"{thought}\n<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


# ----------------------------------------------------------------------------------------------
# The built-in teacher: a script per task of the elementwise family
# ----------------------------------------------------------------------------------------------
def profile_numbers(obs: str) -> dict | None:
    """reward, runtime and speedups from a profile observation (env.Verdict.summary), None when not correct."""
    if "correct True" not in obs:
        return None
    num = lambda rx: float(m.group(1)) if (m := re.search(rx, obs)) else None
    return {"reward": int(num(r"reward ([+-]?\d+)") or 1), "ms": num(r"runtime ([\d.e+-]+) ms"),
            "eager": num(r"vs eager ([\d.e+-]+)x"), "compile": num(r"vs compile ([\d.e+-]+)x")}


def plan_text(variants, backend) -> str:
    return ", ".join(f"{v}/{b}" if backend == "cuda" else v for v, b in variants)


def parse_plan(text: str) -> list:
    m = re.search(r"Variants to try, in order: ([\w/, ]+)\.", text)
    return [(p.split("/")[0], int(p.split("/")[1]) if "/" in p else 0) for p in m.group(1).split(", ")]


def choose_plan(code: str, backend: str, rng: random.Random) -> list:
    """An episode's variants, in order: the kind's first variant (E.VARIANTS_FOR: a short text, and on the CPU the
    one that vectorises; 256 threads on CUDA) in every episode, then, in half of them, one other variant at a block size
    drawn at random.
    One first kernel per kind gives a small student one template to learn per kind: after 40 demonstrations whose
    first kernels were drawn from 3 templates x 3 block sizes (18 of them reductions), the 135M model built none
    of 8 held-out reductions (6d42ee3's run, docs/results.md). The second variants keep demonstrations of
    different speeds: a faster kernel for RL to find."""
    red = E.split(E.parse(code))[1] is not None
    dim = re.search(r"^DIM = (\d+)$", code, re.M)
    # float4 needs rows of a multiple of 4 values (every composed task's DIM; not every task parse() accepts)
    names = [v for v in E.VARIANTS_FOR[(backend, red)] if v != "vec4" or (dim and int(dim.group(1)) % 4 == 0)]
    plan = [(names[0], 256 if backend == "cuda" else 0)]
    if len(names) > 1 and rng.random() < 0.5:
        plan.append((rng.choice(names[1:]), rng.choice(E.BLOCKS) if backend == "cuda" else 0))
    return plan


# A student that saw only correct turns does not recover: after 20 demonstrations the 135M model finished after
# its first compile error, and finished with a broken second variant that replaced a correct first kernel (H100,
# docs/results.md). Demonstrations need failures to recover from; the failures must not be learned.
MISTAKES = 0.25  # share of the teacher's episodes drawn for a mistake (played where the chain allows one: script)


class Unlearned(str):
    """The text of a turn the teacher plays wrong on purpose: make_demos masks its tokens out of the demonstration,
    and the turns after it, which recover, are trained on as any other."""


def wrong_template(steps: list[dict], backend: str) -> str:
    """The elementwise template on a chain with a reduction, the reduction called on one value as an elementwise op,
    op_<name>(v) (the library's op_<name> takes a row): what the student writes when it takes a reduction for an
    elementwise op. It does not compile."""
    _, red, _ = E.split(steps)
    i, stand_in = steps.index(red), {"op": "relu"}  # a library op in the reduction's place, rendered, then replaced
    src = E.kernel_source(steps[:i] + [stand_in] + steps[i + 1:], backend)
    line = f"  // x = {E.torch_line(stand_in)}\n  v = op_relu(v);\n"
    parts = src.split(line)
    k = sum(st == stand_in for st in steps[:i])  # (the same op earlier in the chain: rendered the same)
    parts[k:k + 2] = [parts[k] + f"  // x = {E.torch_line(red)}\n  v = op_{red['op']}(v);\n" + parts[k + 1]]
    src = line.join(parts)
    named = lambda ops: " -> ".join(st["op"] for st in ops)
    return src.replace(named(steps[:i] + [stand_in] + steps[i + 1:]), named(steps), 1)  # (the first line's chain)


def script(code: str, backend: str, plan: list, mistake: bool = False):
    """The teacher's episode as a generator: yields the text of each turn, receives each observation. With
    `mistake`, one turn is played wrong (an Unlearned text): on a chain with a reduction, the first kernel is the
    elementwise template (wrong_template: a compile error, then the row kernel); on one without, with two
    variants and two ops or more, the second variant leaves out the chain's last op (wrong values at the profile's
    checks, then the first kernel written back)."""
    steps = E.parse(code)
    _, red, _ = E.split(steps)
    ext = "cu" if backend == "cuda" else "cpp"
    op_path = f"kernels/op.{ext}"
    # Every op is tagged with its kind where the chain names it, and the reduction named again where the template is
    # chosen: a small student decides the kind next to each op's own name. Untagged, the 135M model wrote "sum ->
    # silu ...: no reduction" and the elementwise template; with only the reduction tagged, "one reduction, clamp"
    # on silu -> silu -> clamp and the row template (docs/results.md).
    chain = " -> ".join(f"{st['op']} ({'reduction' if st is red else 'elementwise'})" for st in steps)
    shape = re.findall(r"^(BATCH|SEQ_LEN|DIM) = (\d+)$", code, re.M)
    how = (f"one reduction, {red['op']}, over the last dimension, so one fused kernel works row by row: the library's "
           f"op_{red['op']} over each row, the ops before it in pre and the ops after it in post" if red else "no reduction, so one fused kernel reads x once and writes y once")
    yield call(f"The reference computes {chain} on x of shape ({', '.join(f'{n}={v}' for n, v in shape)}): {how}. "
               f"Layout: a fixed binding (kernels/binding.cpp: checks, raw pointers, one call of launch) and the chain in "
               f"{op_path}, which includes the provided op library ({E.HEADER_PATH[backend]}): per op, its Model.forward "
               f"line and its C. Variants to try, in order: {plan_text(plan, backend)}.",
               "write_file", path="kernels/binding.cpp", content=E.binding(backend))
    wrong_first = mistake and red is not None
    wrong_second = mistake and red is None and len(plan) > 1 and len(steps) > 1
    best, current, current_ok = None, None, False  # best: (ms, name, source, numbers)
    for i, (v, block) in enumerate(plan):
        name = f"{v}/{block}" if backend == "cuda" else v
        src = E.kernel_source(steps, backend, v, block or 256)
        why = "" if i == 0 else f"Next variant, {name}: "
        if i == 0 and wrong_first:
            first = E.VARIANTS_FOR[(backend, False)][0]
            current = wrong_template(steps, backend)
            yield Unlearned(call(f"{E.VARIANTS[first]}.", "write_file", path=op_path, content=current))
        elif i == 1 and wrong_second:
            current = E.kernel_source(steps[:-1], backend, v, block or 256)
            yield Unlearned(call(f"{why}{E.VARIANTS[v]}.", "write_file", path=op_path, content=current))
        else:
            yield call(f"{why}{E.VARIANTS[v]}.", "write_file", path=op_path, content=src)
            current = src
        if i == 0:
            ps = E.params(steps)
            y_shape = "x's shape" if E.keeps_shape(red) else f"one value per row ({E.torch_line(red)} removes the last dimension)"
            yield call(f"model_new.py keeps Model's constructor and passes {', '.join(ps) if ps else 'no parameters'} to "
                       f"the kernel; it allocates y of {y_shape}{' and per-row statistics' if red else ''}.",
                       "write_file", path="model_new.py", content=E.model_new(code, steps, backend))
            obs = yield call("Compile.", "compile")
            if current != src and not obs.startswith("compiled OK"):  # the mistake's compile error: the row kernel
                yield call(f"op_{red['op']} works on a whole row, not on one value: {red['op']} is the reduction, so one "
                           f"fused kernel works row by row: {name}, {E.VARIANTS[v]}.", "write_file", path=op_path, content=src)
                current = src
                obs = yield call("Compile.", "compile")
            if not obs.startswith("compiled OK"):
                continue
            # no verify first: profile checks before it times (a wrong kernel's profile stops at the checks), and a
            # verify of a correct kernel is a whole verdict more per episode
            obs = yield call("It compiles. Profile it: the checks on fresh inputs, then timing against eager and "
                             "torch.compile.", "profile")
        else:
            obs = yield call("Profile it (profile also builds and verifies).", "profile")
        if "the reference model.py failed" in obs:  # the harness's side (e.g. a timeout on a loaded machine): once more
            obs = yield call("The reference failed, not my kernel: profile again.", "profile")
        got = profile_numbers(obs)
        current_ok = bool(got and got["ms"] is not None)
        if current_ok and current == src and (best is None or got["ms"] < best[0]):
            best = (got["ms"], name, src, got)
    if best is None:
        yield call("No variant is correct; stop here.", "finish")
        return
    ms, name, src, got = best
    if src != current:
        yield call(f"{name} was the fastest ({ms:.4g} ms): write it back." if current_ok else
                   f"That variant is wrong: write back {name}, the correct one ({ms:.4g} ms).",
                   "write_file", path=op_path, content=src)
    yield call(f"Done: {name} is correct, {ms:.4g} ms ({got['eager']}x eager, {got['compile']}x torch.compile).",
               "finish")


class ScriptedTeacher(ToolTeacher):
    ordered_samples = True  # a task's samples draw their plans in turn (started): run_episodes plays them in order

    def __init__(self, tokenizer, backend: str, seed: int = 0, mistakes: float = MISTAKES):
        super().__init__(tokenizer, backend)
        self.seed, self.mistakes = seed, mistakes
        self.unlearned = set()  # (task hash, content) of the files written wrong on purpose: make_demos masks them

    def reply(self, code, history, temperature=0.0):
        try:
            E.parse(code)
        except (ValueError, SyntaxError) as e:  # not a task of the family: say so and stop (no demonstration)
            return call(f"This task is outside the elementwise family ({e}); I cannot solve it.", "finish")
        if not history:
            k = self.started[code]
            self.started[code] += 1
            plan = choose_plan(code, self.backend, random.Random(f"{self.seed}-{E.task_hash(code)}-{k}"))
        else:
            plan = parse_plan(history[0][0])
        # drawn from what the replay knows (the task and the plan its first turn names): the same on every turn
        key = f"{self.seed}-mistake-{E.task_hash(code)}-{plan_text(plan, self.backend)}"
        gen = script(code, self.backend, plan, mistake=random.Random(key).random() < self.mistakes)
        text = next(gen)
        try:
            for _, obs in history:  # replay: the same script on the same observations reaches this turn
                text = gen.send(obs)
        except StopIteration:
            return call("The episode is over.", "finish")
        if isinstance(text, Unlearned):
            self.unlearned.add((E.task_hash(code), agent.parse_tool_call(text)[1]["content"]))
        return text


# ----------------------------------------------------------------------------------------------
# Any OpenAI-compatible server as the teacher
# ----------------------------------------------------------------------------------------------
class ChatTeacher(ToolTeacher):
    """Asks a chat-completions server (agent.OpenAIPolicy) for each turn; its answer (structured tool calls
    included) becomes text in the loop's format, tokenised by the student's tokenizer."""

    def __init__(self, tokenizer, backend: str, chat: agent.OpenAIPolicy, max_tokens: int = 4096, workers: int = 16):
        super().__init__(tokenizer, backend)
        self.chat, self.max_tokens, self.workers = chat, max_tokens, workers

    def _replies(self, states, temperature):
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(lambda s: self.reply(s[0], s[1], temperature), states))

    def reply(self, code, history, temperature=0.0):
        msgs = [{"role": "system", "content": agent.system_prompt(None, False)},
                {"role": "user", "content": agent.task_message({"task_id": E.task_hash(code), "code": code}, self.backend)}]
        for text, obs in history:
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"<tool_response>\n{obs}\n</tool_response>"}]
        try:
            msg = self.chat.chat(msgs, agent.TOOLS, self.max_tokens, temperature)
        except RuntimeError as e:
            return f"(the teacher server failed: {str(e)[:200]})"  # no call: the loop counts it as malformed
        text = (msg.get("content") or "").strip()
        for tc in (msg.get("tool_calls") or [])[:1]:
            f = tc.get("function", {})
            try:
                args = json.loads(f.get("arguments") or "{}", strict=False)
            except json.JSONDecodeError:
                args = f.get("arguments")
            text += f"\n<tool_call>{json.dumps({'name': f.get('name'), 'arguments': args})}</tool_call>"
        return text


# ----------------------------------------------------------------------------------------------
# Loading, demonstrations
# ----------------------------------------------------------------------------------------------
def load_tokenizer(model: str | None = None):
    """The student's tokenizer: the embedded SmolLM2 (model None), a folder or hub id, or a .gguf file."""
    from transformers import AutoTokenizer
    if model is None:
        return agent.embedded_tokenizer()
    path = Path(model)
    if str(path).endswith(".gguf"):
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if path.is_dir() and (adapter := agent.find_adapter(path)) is not None:  # a train.py run: its base's tokenizer
        return load_tokenizer(agent.adapter_base(adapter))
    return AutoTokenizer.from_pretrained(str(model))


def load_teacher(backend: str = "auto", model: str | None = None, url: str | None = None, teacher_model: str | None = None,
                 seed: int = 0, tokenizer=None, api_key: str | None = None):
    """The built-in ScriptedTeacher, or a ChatTeacher for `url` (an OpenAI-compatible /v1 endpoint)."""
    tok = tokenizer if tokenizer is not None else load_tokenizer(model)
    if url:
        if not teacher_model:
            raise env.UsageError("--teacher-url needs --teacher-model (the server's model name)")
        return ChatTeacher(tok, backend, agent.OpenAIPolicy(teacher_model, url, api_key=api_key))
    return ScriptedTeacher(tok, backend, seed)


def is_demonstration(ep: dict) -> bool:
    return ep["reward"] >= 1 and ep["finished"] and ep["malformed_calls"] == 0


def single_turn_demo(ep: dict, task: dict, tokenizer, backend: str, stop: int) -> dict | None:
    """A demonstration in the single-turn format (train.py's warm-up, evaluate.py --mode single): the files its episode
    wrote, as they ended (its accepted write_file and edit_file calls replayed in order), in fenced blocks whose first
    line names them (tools.parse_single_turn), after agent.single_turn_prompt; the answer and `stop` are the model's
    tokens. Without it the warm-up's prompt is one the student never saw: after sft on tool calls alone its answers
    held no files (reward -1 at every step). None where the files cannot be known from the calls (a bash command may
    have changed them) or would not read back as written (a path the answer format does not take)."""
    files = {}
    for t in ep["turns"]:
        args = t.get("args") or {}
        if t["tool"] == "bash":
            return None
        if not t.get("ok", True) or t["tool"] not in ("write_file", "edit_file"):
            continue
        if t["tool"] == "write_file":
            files[args["path"]] = args["content"]
        elif args["path"] in files:
            files[args["path"]] = files[args["path"]].replace(args["old"], args["new"], 1)
        else:
            return None  # an edit of a file the episode did not write (a provided one)
    text = "".join(f"```{'python' if path.endswith('.py') else 'cpp'}\n{'#' if path.endswith('.py') else '//'} file: "
                   f"{path}\n{content.rstrip()}\n```\n" for path, content in files.items())
    if not files or tools.parse_single_turn(text) != {p: c.rstrip() + "\n" for p, c in files.items()}:
        return None
    prompt = agent.single_turn_prompt(task, tokenizer, backend)
    answer = agent.encode(tokenizer, text) + [stop]
    return {"task_id": ep["task_id"], "tokens": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer),
            "text": text, "files": files, "reward": ep["reward"], "end_reason": "single_turn"}


def make_demos(policy, tasks: list[dict], backend: str, out_dir, samples: int = 1, chunk: int = 0,
               **run_kw) -> tuple[list, list]:
    """Runs `samples` teacher episodes per task; writes every episode to OUT/trajectories.jsonl (agent.py's
    format) and the demonstrations (is_demonstration) to OUT/demos.jsonl. Returns (demos, all episodes).
    chunk=N writes the tasks N at a time into OUT/chunk-0000/, OUT/chunk-0001/, ... (train.py's sft stage), so
    an interrupted run loses only the tasks in flight: a chunk with demos.jsonl is done (it must hold these tasks),
    and a task whose samples all finished in a chunk's trajectories.jsonl is not worked again. Every episode is kept
    as it finishes; all of them run in one agent.run_episodes call, so no chunk waits for the end of the one before."""
    out = Path(out_dir)
    run_kw = {"max_turns": 16, "max_context": 16384, "max_new_tokens": 4096, "temperature": 0.0, **run_kw}
    groups = [(out / f"chunk-{k // chunk:04d}", tasks[k:k + chunk]) for k in range(0, len(tasks), chunk)] if chunk \
        else [(out, tasks)]
    code_of, tasks_of = {t["task_id"]: t["code"] for t in tasks}, dict(groups)
    kept, jobs, left = {}, [], {}  # kept: chunk -> its finished episodes; jobs: (chunk, task) per episode to play
    for g, group in groups:
        if not chunk:  # one folder, played whole: what an earlier run left there is replaced
            for name in ("demos.jsonl", "trajectories.jsonl"):
                (g / name).unlink(missing_ok=True)
        finished = (g / "demos.jsonl").is_file()
        old = _load_kept(_episodes_file(g)) if _episodes_file(g).is_file() else []
        if not {chunk_key(e) for e in old} <= {chunk_key(t) for t in group}:
            raise env.UsageError(f"{g} holds teacher episodes of other tasks than this run's chunk (another dataset "
                                 f"or chunk size?): remove {out}, or run with the settings that made it")
        if finished:
            continue
        n = collections.Counter(chunk_key(e) for e in old)  # a task keeps its episodes only with all its samples
        kept[g] = [e for e in old if n[chunk_key(e)] >= samples]
        todo = [t for t in group if n[chunk_key(t)] < samples]
        jobs += [(g, t) for t in todo for _ in range(samples)]
        left[g] = samples * len(todo)
        if len(kept[g]) < len(old) or not todo:  # a task's unfinished samples go; or only demos.jsonl was missing
            _write_chunk(g, group, kept[g], final=not todo)
    new = {g: [] for g in left}
    lock = threading.Lock()

    def keep(i, ep):  # from the episode's thread: mask its mistakes, append it, and close its chunk when it is the last
        g = jobs[i][0]
        for t in ep["turns"]:  # the turns the teacher played wrong on purpose are not learned (Unlearned)
            args = t.get("args") if isinstance(t.get("args"), dict) else {}
            if t["tool"] == "write_file" and (E.task_hash(code_of[ep["task_id"]]), args.get("content")) in getattr(
                    policy, "unlearned", ()):
                ep["loss_mask"][t["start"]:t["end"]] = [0] * (t["end"] - t["start"])
        with lock:
            agent.save_episodes(g / "trajectories.jsonl", [ep], append=True)
            new[g].append((i, ep))
            left[g] -= 1
            if left[g] == 0:
                _write_chunk(g, tasks_of[g], kept[g] + [e for _, e in sorted(new[g], key=lambda x: x[0])])
    if jobs:
        agent.run_episodes(policy, [t for _, t in jobs], backend=backend, ws_dir=out / "workspaces", on_episode=keep,
                           **run_kw)
    eps = [e for g, _ in groups for e in agent.load_episodes(_episodes_file(g))]
    demos = [e for g, _ in groups for e in agent.load_episodes(g / "demos.jsonl")]
    return demos, eps


def _load_kept(path: Path) -> list:
    """A chunk's episodes, less a last line that a killed run left half written."""
    lines = path.read_text().splitlines()
    try:
        json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        lines = lines[:-1]
    return [json.loads(x) for x in lines if x.strip()]


def _episodes_file(g: Path) -> Path:
    """A chunk's episodes: trajectories.jsonl (a finished chunk carried without it: its demos.jsonl)."""
    t = g / "trajectories.jsonl"
    return t if t.is_file() or not (g / "demos.jsonl").is_file() else g / "demos.jsonl"


def _write_chunk(g: Path, tasks: list, eps: list, final: bool = True):
    """A chunk's episodes in its tasks' order, and (final) its demonstrations: each file whole (tmp, then rename),
    demos.jsonl last, so a chunk with demos.jsonl is a finished one."""
    pos = {chunk_key(t): k for k, t in enumerate(tasks)}
    eps = sorted(eps, key=lambda e: pos[chunk_key(e)])  # (stable: a task's samples keep their order)
    for name, part in (("trajectories.jsonl", eps), ("demos.jsonl", [e for e in eps if is_demonstration(e)]))[:1 + final]:
        agent.save_episodes(g / (name + ".tmp"), part)
        os.replace(g / (name + ".tmp"), g / name)


def chunk_key(x: dict) -> tuple:
    """What ties a teacher episode to its task (a task, or an episode of it): its id and its chain of operators."""
    return x["task_id"], tuple(x.get("ops") or ())


def summary(eps: list) -> str:
    rewards = collections.Counter(ep["reward"] for ep in eps)
    ok = [ep for ep in eps if is_demonstration(ep)]
    sp = lambda k: [ep["verdict"][k] for ep in ok if ep["verdict"].get(k)]
    gm = lambda xs: f"{statistics.geometric_mean(xs):.2f}x" if xs else "-"
    turns = [len(ep["tokens"][t["start"]:t["end"]]) for ep in ok for t in ep["turns"]]
    return (f"episodes {len(eps)} | demonstrations {len(ok)} | reward " +
            " ".join(f"{r:+d}:{rewards[r]}" for r in sorted(rewards)) +
            f" | speedup vs eager geomean {gm(sp('speedup_eager'))} | vs compile {gm(sp('speedup_compile'))}"
            f" | tokens per episode max {max((len(ep['tokens']) for ep in ok), default=0)}"
            f" | per turn max {max(turns, default=0)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Teacher demonstrations for the elementwise family (train.py's sft stage).")
    ap.add_argument("--tasks", required=True, help="a synth.py output folder (--family elementwise) or one task .py file")
    ap.add_argument("--split", default="train")
    ap.add_argument("--limit", type=int, default=0, help="use the first N tasks (0: all)")
    ap.add_argument("--samples", type=int, default=1, help="episodes per task (each draws its own second variant, in half of them)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="the student, whose tokenizer the demonstrations use (default: embedded)")
    ap.add_argument("--teacher-url", default=None)
    ap.add_argument("--teacher-model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        src = Path(a.tasks)
        tasks = [load_problem(str(src))] if src.is_file() else load_split(a.tasks, a.split)
        tasks = tasks[:a.limit] if a.limit else tasks
        if not tasks:
            raise env.UsageError(f"no tasks in {a.tasks} ({a.split})")
        policy = load_teacher(a.backend, a.model, a.teacher_url, a.teacher_model, a.seed)
        t0 = time.time()
        demos, eps = make_demos(policy, tasks, a.backend, a.out, a.samples)
    except (env.UsageError, ValueError) as e:
        print(f"teacher.py: error: {e}", file=sys.stderr)
        return 2
    print(summary(eps) + f" | {time.time() - t0:.0f}s")
    print(f"wrote {Path(a.out) / 'demos.jsonl'} ({len(demos)} demonstrations) and {Path(a.out) / 'trajectories.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
