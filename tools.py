"""tools.py: the agent's tools: what the model sees (JSON schemas) and what runs (run_tool), and the parsing of
its output (parse_tool_call; parse_single_turn for answers without tools). agent.py's loop calls these.

    name, args, err = parse_tool_call('<tool_call>{"name": "read_file", "arguments": {"path": "model.py"}}</tool_call>')
    obs, verdict, ok = run_tool(name, args, Path("ws"), task_code, "cpu", agent.AgentConfig())

Tools (names and argument names are a contract with SKILL.md and trained models): bash(command), read_file(path),
write_file(path, content), edit_file(path, old, new), compile(), verify(), profile(), finish(). The model's input
is untrusted: every path is confined to the workspace, model.py is restored after every bash call, bash runs in
env.py's sandbox, and a bad call is an observation that says what to fix, never an exception.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import env


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


def restore_reference(ws: Path, task_code: str) -> bool:
    """Puts the task back as ws/model.py if it is not there as a plain file; True if it was changed. A model.py that
    the bash tool replaced by a symbolic link is removed, never written through (that wrote a host file as root)."""
    p = ws / "model.py"
    if not p.is_symlink() and p.is_file() and p.read_text(errors="replace") == task_code:
        return False
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)
    p.write_text(task_code)
    return True


def workspace_key(ws: Path) -> str:
    """Content hash of what env.evaluate scores (model_new.py and sources), to reuse a verdict."""
    h = hashlib.sha256()
    for d in (ws, ws / "kernels"):
        if d.is_dir():
            for f in sorted(d.iterdir()):
                # Never through a link (bash can point one at /proc/kcore or a host file) and never a huge file
                # (evaluate refuses both anyway): this runs in the trainer, unsandboxed.
                if f.is_symlink() or not f.is_file() or not (f.suffix in env.SOURCE_EXT | env.HEADER_EXT or f.name == "model_new.py"):
                    continue
                size = f.stat().st_size
                data = f.read_bytes() if size <= 1 << 20 else f"{size} {f.stat().st_mtime_ns}".encode()
                h.update(str(f.relative_to(ws)).encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def run_tool(name: str, args: dict, ws: Path, task_code: str, backend: str, cfg):
    """Executes one tool call. Returns (observation, verdict dict or None, ok). Never raises for model errors.
    cfg: agent.AgentConfig (bash_timeout, obs_chars, eval_timeout)."""
    ws = ws.resolve()
    try:
        if name == "bash":
            # kind: on a CUDA backend the shell gets the namespaces in which a CUDA context can start
            # and it counts as a candidate on the device: no baseline is timed while it runs (it could spin every
            # core, or a GPU, to slow the eager and compile timings that every later verdict of the task reuses)
            with env.candidate_alive(env.resolve_backend(backend)):
                r = env.run_sandboxed(["/bin/bash", "-c", args["command"]], ws, cfg.bash_timeout, mem_gb=8.0,
                                      output_limit=cfg.obs_chars, kind=env.resolve_backend(backend))
            out = (r.stdout + (("\n[stderr]\n" + r.stderr) if r.stderr.strip() else "")).strip()
            if restore_reference(ws, task_code):  # bash can write anything in the workspace
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
            if p.stat().st_size > 1 << 20:  # (the bash tool can leave a 1 GiB file; it is read here, in the trainer)
                return f"error: {args['path']!r} is larger than 1 MiB; read parts of it with bash (head, sed -n)", None, False
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
            if p.stat().st_size > 1 << 20:
                return "error: files are limited to 1 MiB", None, False
            text = p.read_text()
            n = text.count(old) if old else 0
            if n != 1:
                why = "`old` is empty" if not old else f"`old` occurs {n} times" + (
                    "" if n else " (it must match the file exactly, whitespace included; read_file first)")
                return f"error: {why}; it must occur exactly once", None, False
            p.write_text(text.replace(old, new, 1))
            return f"edited {p.relative_to(ws)}", None, True
        if name in ("compile", "verify", "profile"):
            restore_reference(ws, task_code)
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
# Parsing a model's call, and a single-turn answer's files
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
