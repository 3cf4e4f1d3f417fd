"""checker.py: the worker processes of synth.py's execution filter, seen from the parent.

A Checker is one sandboxed child (env.run_sandboxed) that runs synth.py's check_task on one candidate at a time,
for as long as it is given some; synth.filter_by_execution runs one Checker per worker. What the child checks is
in synth.py (check_task); this module is the plumbing around it: the pipes, the device lock the child inherits,
the two deadlines, and ending a child that hangs.

    checker = Checker(cfg, "cpu", stop_fd, [sys.executable, "-E", "-B", "synth.py", "_filter"])
    verdict = checker.check({"key": ..., "code": ...})   # {"kept": bool, "drop": why, "eager_ms", "t", "turns", ...}
    checker.close()
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import env


class Checker:
    """One sandboxed child (env.run_sandboxed) that checks candidates one at a time, for as long as it is given
    some: the parent writes a candidate as one JSON line into a pipe, the child answers with one JSON line on
    another. Importing torch, setting up CUDA and inductor cost a child seconds, so one child serves many
    candidates. A crash ends it, and so does a hang: the parent kills its process group (a signal from inside
    would not do: in a PID namespace the child is init, which ignores the default actions, and a Python-level
    handler waits for a stuck C call). Either way the candidate it was checking gets the blame (after a retry
    in a fresh child, see synth.filter_by_execution)."""
    MAX_TASKS = 64  # candidates per child before a fresh one

    def __init__(self, cfg, backend: str, stop_fd: int, child: list[str]):
        """cfg: synth.Config; child: the command line of the child's loop, without its spec file (synth.py _filter)."""
        self.n, self.buf, self.sandbox, self.pid = 0, b"", None, None
        self.dir = tempfile.mkdtemp(prefix="synth-", dir=env.CACHE_DIR)
        lock = env.gpu_lock_path(backend)
        lock.parent.mkdir(parents=True, exist_ok=True)
        self.lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        (cand_r, self.cand_w), (self.res_r, res_w) = os.pipe(), os.pipe()
        self.fds = [self.lock_fd, cand_r, self.cand_w, self.res_r, res_w]
        self.child_fds = [self.lock_fd, cand_r, res_w]  # ours are closed once the child has them (started)
        extra, caches = env.compile_caches()  # shared by all children: each graph and jiterator kernel compiles once
        # (and in the child's own process: 12 children each starting inductor's pool of a process per core would swamp the CPUs)
        if cfg.composer == "llm":  # code an LLM wrote does not get to write caches that env.py's reference loads
            extra = {k: str(Path(self.dir, Path(v).name)) if k.endswith(("_DIR", "_PATH")) else v for k, v in extra.items()}
            caches = []
        # CPU: one thread per child (workers use the cores; OpenMP teams on a busy machine make timings erratic).
        threads = 1 if backend == "cpu" else max(1, (os.cpu_count() or 1) // max(1, cfg.workers))
        extra.update(OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="passive", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.timeout = cfg.task_timeout_s or (60 if backend == "cuda" else 150)
        self.lock_limit = min(15.0, self.timeout / 2)  # a legitimate task holds the lock for a second or three
        spec = {"dir": str(Path(self.dir).resolve()), "backend": backend, "window_ms": list(cfg.window_ms),
                "n_timed": cfg.n_timed, "min_timed_s": cfg.min_timed_s, "threads": threads,
                "lock_fd": self.lock_fd, "stop_fd": stop_fd, "in_fd": cand_r, "out_fd": res_w, "created": time.time()}
        Path(self.dir, "spec.json").write_text(json.dumps(spec))
        argv = [*child, str(Path(self.dir, "spec.json").resolve())]
        # (the wall-clock limit only backs up check()'s per-candidate one: importing torch, then MAX_TASKS candidates)
        kw = dict(timeout=300 + self.timeout * self.MAX_TASKS, writable=caches, mem_gb=16.0, env=extra,
                  pass_fds=[self.lock_fd, stop_fd, cand_r, res_w], kind=backend,  # kind: CUDA-safe namespaces
                  started=self._started)

        def run():
            self.sandbox = env.run_sandboxed(argv, self.dir, **kw)
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def _started(self, pid: int):
        """The child runs, with its copies of the pipe ends and the lock: drop ours, so that the lock goes with
        the child (a flock belongs to the open file, which we would otherwise keep open)."""
        self.pid = pid
        for fd in self.child_fds:
            os.close(fd)
            self.fds.remove(fd)

    def check(self, cand: dict) -> dict:
        """The child's verdict on `cand`, or a drop saying why the child died on it. Two deadlines: `timeout` s
        of work on the candidate, not counting the wait for the device lock (the other workers' turns), and
        `lock_limit` s under the lock at a time (every worker waits meanwhile). The child tells its lock state
        on the same pipe as its answers: {"state": "wait" | "hold" | "run"} lines."""
        os.write(self.cand_w, (json.dumps(cand) + "\n").encode())
        self.n += 1
        limit = self.timeout + (120 if self.n == 1 else 0)  # a child's first also waits for torch and CUDA to start
        state, since, used, killed = "run", time.monotonic(), 0.0, None  # used: seconds of work before `since`
        held_from = None  # wall clock, for the turn of a child killed under the lock (bench/synth_diag.py)
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue  # not ours (the child writes nothing else here)
                if "state" not in msg:
                    if killed:  # answered just as it was killed: wait until it is gone, so it is not reused
                        self.thread.join()
                    return msg
                now = time.monotonic()
                used += now - since if state != "wait" else 0.0
                state, since = msg["state"], now
                held_from = time.time() if state == "hold" else None
            alive = self.thread.is_alive()  # (read before the pipe: an answer written just before dying counts)
            if select.select([self.res_r], [], [], 0.2 if alive else 0)[0]:
                chunk = os.read(self.res_r, 1 << 16)
                if chunk:
                    self.buf += chunk
                    continue
                self.thread.join()  # end of the pipe: the child is gone; run_sandboxed is reaping it
                alive = False
            if not alive:
                r = self.sandbox
                # its last words about this candidate (the child marks where each one starts in stderr)
                said = r.stderr.split(f"synth: checking {cand['key']}\n")[-1].strip() if r else ""
                tail = said.splitlines()[-1][:200] if said else ""
                why = (r.crash if r else None) or f"exited with code {r.returncode if r else '?'}"
                held = [[held_from, held_from, time.time()]] if held_from else []  # it died holding the lock
                return {"key": cand["key"], "kept": False, "drop": killed or f"child process {why}" +
                        (f": {tail}" if tail else ""), "turns": held, "t": {"locked": held[0][2] - held_from if held else 0.0}}
            now = time.monotonic()
            if killed is None and self.pid:
                if state == "hold" and now - since > self.lock_limit:  # everyone waits: end it
                    killed = f"too slow: over {self.lock_limit:g} s under the device lock (its child was killed)"
                elif state != "wait" and used + now - since > limit:
                    killed = f"child process timed out: its checks took over {self.timeout} s"
                if killed:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.pid, signal.SIGKILL)

    @property
    def dead(self) -> bool:
        return not self.thread.is_alive()

    def close(self):
        os.close(self.cand_w)  # EOF: the child exits
        self.fds.remove(self.cand_w)
        self.thread.join(10)
        if self.thread.is_alive() and self.pid:  # stuck (in a C call, or after a Ctrl-C): end it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self.thread.join()
        for fd in self.fds:
            os.close(fd)
        shutil.rmtree(self.dir, ignore_errors=True)
