"""Can the parent read a sandboxed child's memory itself (process_vm_readv), and what do K scattered reads cost?

    python bench/sample_read_probe.py                 # CPU: a reference child of env.py, as verdicts start them
    python bench/sample_read_probe.py --repeats 200

Why: the parent checks each timed run by reading protocol.READS random elements of every output from the child's
memory itself, inside the timed span, so that a kernel that takes over its process is never told where it is
checked (protocol.reads(), tests/test_redteam.py 12). This probe says whether that read is allowed across the
sandbox's layers on this machine, and what K random reads cost (K per output and run sets how likely a skipped part
of the output is hit).
It starts one child the way env.py does (env.Child: fork server, namespaces, uid where available), finds its
process (protocol.harness_pid), and reads K random 4-byte words, or K random 64-byte lines,
from the child's largest writable mapping (standing in for an output tensor), --repeats times each. Prints a table.
"""
import argparse
import ctypes
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import env  # noqa: E402
import protocol  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=30)
args = p.parse_args()
if args.repeats < 1:
    sys.exit("sample_read_probe.py: --repeats must be >= 1")


IOVec = protocol.IOVec
libc = ctypes.CDLL(None, use_errno=True)
libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(IOVec), ctypes.c_ulong, ctypes.POINTER(IOVec),
                                  ctypes.c_ulong, ctypes.c_ulong]
libc.process_vm_readv.restype = ctypes.c_ssize_t


def read_cost(pid: int, base: int, size: int, k: int, width: int) -> float:
    """Median ms of one process_vm_readv of k random `width`-byte pieces of [base, base + size)."""
    buf = (ctypes.c_char * (k * width))()
    local = (IOVec * 1)(IOVec(ctypes.addressof(buf), k * width))
    times = []
    for _ in range(args.repeats):
        remote = (IOVec * k)(*[IOVec(base + random.randrange(size // width) * width, width) for _ in range(k)])
        t0 = time.perf_counter()
        got = libc.process_vm_readv(pid, local, 1, remote, k, 0)
        times.append((time.perf_counter() - t0) * 1e3)
        if got != k * width:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return statistics.median(times)


run = Path(tempfile.mkdtemp(dir=env.CACHE_DIR))
(run / "ext").mkdir()
(run / "model.py").write_text((ROOT / "examples" / "relu.py").read_text())
spec = dict(backend="cpu", seed0=1, mode="reference", reference=str(run / "model.py"),
            seeds=[secrets.randbelow(2**31) for _ in range(2)], n_checks=0, budget_mb=64)
child = env.Child(spec, run, "cpu", env.Config(backend="cpu"))
try:
    for _ in range(child.answer()[0]["timed_sets"]):  # (the child is idle, its outputs made, once these are read)
        child.answer()
    pid = protocol.harness_pid(child.pgid)  # (as the timed runs' reads find it)
    if pid is None:
        sys.exit("sample_read_probe.py: the child's process was not found (no PID namespace here?)")
    maps = [line.split() for line in open(f"/proc/{pid}/maps")]
    size, base = max((int(m[0].split("-")[1], 16) - int(m[0].split("-")[0], 16), int(m[0].split("-")[0], 16))
                     for m in maps if m[1].startswith("rw"))
    iso = env.isolation("cpu")
    print(f"child {pid} (process group {child.pgid}), parent uid {os.getuid()}; isolation: {' '.join(iso.prefix)}, "
          f"uid {iso.uid if iso.uid is not None else 'kept'}; reading its largest writable mapping, {size >> 20} MiB")
    try:
        rows = [(k, read_cost(pid, base, size, k, 4), read_cost(pid, base, size, k, 64)) for k in (1, 16, 64, 256, 1024)]
    except OSError as e:
        print(f"process_vm_readv of the child: refused here ({e.strerror}): the parent cannot read its memory")
        sys.exit(0)
    print("\n| K reads per call | 4-byte words, median ms | 64-byte lines, median ms |\n|---|---|---|")
    for k, words, lines in rows:
        print(f"| {k} | {words:.4f} | {lines:.4f} |")
finally:
    child.close()
