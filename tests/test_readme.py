"""The README's commands: every script it names exists and accepts every flag it shows (read from the README
itself, so a renamed flag fails here), and the documented commands that no other test runs are run here, made
small: env.py on the example solution, teacher.py on one task, agent.py with the embedded model."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT))
import elementwise as E  # noqa: E402
from test_agent import tiny_tokenizer  # noqa: E402


def documented_commands() -> list[str]:
    """Every command line of the README's bash blocks, and every inline `python ...` / `bash ...` span."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        cmds += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    cmds += re.findall(r"`((?:[A-Z_]+=\S+ )*(?:python|bash) [^`]+)`", README)
    return cmds


def script_and_flags(cmd: str):
    """(script path, [--flags]) of each python script a command runs (after `&&` too); pip and pytest are skipped."""
    for part in cmd.split("&&"):
        words = shlex.split(part.replace("[", "").replace("]", ""))
        script = next((w for w in words if w.endswith(".py")), None)
        if script is None or "pytest" in words:
            continue
        rest = words[words.index(script) + 1:]
        yield script, sorted({w.split("=")[0] for w in rest if w.startswith("--")})


def test_every_documented_script_and_flag_exists():
    cmds = documented_commands()
    assert len(cmds) >= 20, cmds  # the parser found the blocks
    wanted = {}
    for cmd in cmds:
        for script, flags in script_and_flags(cmd):
            wanted.setdefault(script, set()).update(flags)
        for sh in re.findall(r"bash (\S+\.sh)", cmd):
            assert (ROOT / sh).is_file(), sh
    assert {"train.py", "synth.py", "env.py", "agent.py", "evaluate.py", "teacher.py"} <= set(wanted), wanted
    for script, flags in sorted(wanted.items()):
        assert (ROOT / script).is_file(), f"the README runs {script}, which does not exist"
        help_cmd = [sys.executable, str(ROOT / script)] + (["eval", "--help"] if script == "env.py" else ["--help"])
        r = subprocess.run(help_cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (script, r.stderr[-2000:])
        if script == "env.py":  # (two subcommands: `new` has --problem)
            r2 = subprocess.run([sys.executable, str(ROOT / script), "new", "--help"], capture_output=True, text=True)
            r.stdout += r2.stdout
        missing = [f for f in flags if f not in r.stdout]
        assert not missing, f"the README shows {script} {missing}, which its --help does not list"


def test_env_eval_of_the_example_solution():
    """`python env.py eval examples/relu_cpu --backend cpu`: the honest example is correct (and is left unchanged)."""
    before = sorted(p.relative_to(ROOT) for p in (ROOT / "examples" / "relu_cpu").rglob("*"))
    r = subprocess.run([sys.executable, str(ROOT / "env.py"), "eval", "examples/relu_cpu", "--backend", "cpu", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    v = json.loads(r.stdout.strip().splitlines()[-1])
    assert v["correct"] and v["reward"] >= 1, r.stdout[-3000:]
    assert sorted(p.relative_to(ROOT) for p in (ROOT / "examples" / "relu_cpu").rglob("*")) == before


@pytest.mark.slow
def test_teacher_cli_writes_demonstrations(tmp_path):
    """`python teacher.py --tasks ... --backend cpu --out ... --samples N` on one elementwise task."""
    task = next(c for c in (E.compose_one(i, 0, "cpu", (0.1, 10.0)) for i in range(200))
                if "drop" not in c and E.split(E.parse(c["code"]))[1] is None)  # no reduction: the shortest script
    (tmp_path / "task.py").write_text(task["code"])
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    r = subprocess.run([sys.executable, str(ROOT / "teacher.py"), "--tasks", str(tmp_path / "task.py"), "--backend", "cpu",
                        "--out", str(tmp_path / "demos"), "--samples", "1", "--model", str(tmp_path / "tok")],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "episodes 1 | demonstrations 1" in r.stdout, r.stdout[-3000:]
    demos = [json.loads(line) for line in (tmp_path / "demos" / "demos.jsonl").read_text().splitlines()]
    assert len(demos) == 1 and demos[0]["reward"] >= 1


@pytest.mark.slow
def test_agent_cli_with_the_embedded_model(tmp_path):
    """`python agent.py --problem examples/relu.py --backend cpu --max-turns 4`, with 1 turn of 8 tokens: the
    embedded model loads offline, generates, and the episode is scored and saved."""
    r = subprocess.run([sys.executable, str(ROOT / "agent.py"), "--problem", "examples/relu.py", "--backend", "cpu",
                        "--max-turns", "1", "--max-new-tokens", "8", "--out", str(tmp_path), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["turns"] == 1 and summary["reward"] == -1, summary  # 8 tokens write no kernel
    ep = json.loads((tmp_path / "trajectories.jsonl").read_text().splitlines()[0])
    assert ep["tokens"] and len(ep["loss_mask"]) == len(ep["tokens"]) and sum(ep["loss_mask"]) >= 1
