"""sandbox.py: child processes that cannot touch the host, and the locks the timing relies on.

Used by env.py (builds, reference and candidate children), agent.py (the `bash` tool), synth.py and
evaluate.py (task children). One function, `run_sandboxed(argv, cwd, timeout, ...)`. With `fork=`, the child is not
exec'ed but forked from a fork server that imported torch once (ForkServer): the same layers, without the seconds of
`import torch` per child (env.py's verdict children).

Layers, each probed once per process (`isolation(kind)`) and reported once on stderr when missing. A layer is given
up only where the plans with it fail again after a weaker one started (a failure of the moment, such as a fork refused
while another process fills the host, drops nothing); where no child starts at all, nothing is kept and children run
with every layer until a probe succeeds:
  namespaces   net (no interfaces), pid (the child is init: killing it kills every descendant, setsid or
               not) with a FRESH /proc that shows only the sandbox's own processes, mount, ipc; a user
               namespace when not run by root. CUDA needs the fresh /proc to start inside a PID namespace.
  filesystem   every mount read-only (/sys included) except `cwd` and `writable`; /proc read-only but for the
               processes' own entries (its kernel knobs: sys, irq, bus...); a fresh read-only /dev that holds only
               null, zero, full, random, urandom, tty and the GPU's nodes (root owns the host's /dev: it could
               create files there or open kvm, zram, disks); fresh private tmpfs on /tmp, /var/tmp and /dev/shm;
               `hide` paths (by default the cache root, which holds reference outputs, baselines and other runs)
               covered by an empty tmpfs, with any writable folder inside them bound back. Where a child (a CUDA
               context) does not start under the private /dev and read-only /proc knobs, the probe keeps the
               namespaces without those two before it gives up any namespace, and says so.
  credentials  no_new_privs; every capability dropped (bounding set included), so root inside cannot
               remount, override file permissions, ptrace or write /proc/sys; when run by root and the
               interpreter is reachable by it, an unprivileged uid (65534) as well.
  seccomp      a filter, last: the system calls of SECCOMP_DENY answer EPERM (the kernel keyring, which no
               namespace separates; userfaultfd, perf_event_open, bpf, io_uring), and so does every call of
               another ABI (i386, x32). Where it holds, no child runs without it; where a child does not start
               under it (a GPU driver that would need one of those calls), it is the one layer given up.
  limits       own session and process group, a pids (and memory) cgroup where writable, RLIMIT_NPROC
               for ordinary users, RLIMIT_AS (CPU), RLIMIT_CPU, RLIMIT_FSIZE, no core files, a wall clock
               timeout that kills the process group, and the cgroup's leftovers.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import fcntl
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

SANDBOX_PY = Path(__file__).resolve()
CACHE_DIR = Path(os.environ.get("CUDA_AGENT_CACHE", Path.home() / ".cache" / "cuda-agent-mini"))
CACHE_DIR.mkdir(parents=True, exist_ok=True)  # (every run folder, build and lock is made inside it, on a fresh machine too)
NOBODY = 65534

_PASS_ENV = ("PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
             "NVIDIA_DRIVER_CAPABILITIES", "CC", "CXX", "NVCC_CCBIN", "TORCH_CUDA_ARCH_LIST", "CUDA_AGENT_CACHE",
             "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
_CUDA_PROBE = "import torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize()"


@dataclasses.dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def crash(self) -> str | None:
        """A readable cause when the child died abnormally."""
        if self.timed_out:
            return "timed out (the whole process group was killed)"
        if self.returncode < 0:
            sig = -self.returncode
            name = {11: "segmentation fault", 9: "killed (memory or CPU limit?)", 6: "aborted", 7: "bus error",
                    8: "floating point exception", 24: "CPU time limit exceeded", 25: "file size limit exceeded"}
            return f"crashed: {name.get(sig, signal.Signals(sig).name)} (signal {sig})"
        return None


# ----------------------------------------------------------------------------------------------
# Which layers work here (probed once per process and kind)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Isolation:
    prefix: tuple  # the unshare command prefix
    uid: int | None  # the uid to drop to (root only), None to keep the uid and drop capabilities
    missing: tuple  # layers not available here, for the one-line notice
    strict: bool = True  # a private /dev and read-only /proc knobs (see _jail); False only where they stop a child
    seccomp: bool | None = None  # the filter (_seccomp): None tries it (the probe's plans); True: a child without it
    # does not run (the probe found it holds here); False: not installed (it does not hold here)

    @property
    def mount(self) -> bool:
        return "--mount" in self.prefix


_ISOLATION: dict = {}
_PROBE_LOG: list = []  # (kind, isolation, stderr) of every failed try, for diagnosis
_ISOLATION_LOCK = threading.Lock()


def isolation(kind: str = "cpu") -> Isolation:
    """The strongest isolation under which a child (for kind="cuda": a CUDA context) still starts here. Where no child
    starts at all, not even without namespaces, the probe says nothing about this host's layers (a fork refused, the
    memory or the GPU full for a moment): the strongest set is returned, not kept, and the next child probes again."""
    with _ISOLATION_LOCK:  # evaluate() starts children from several threads; probe once, publish once
        if kind in _ISOLATION:
            return _ISOLATION[kind]
        found, strongest = _probe_isolation(kind)
        if found is None:
            print(f"sandbox.py: no child starts here now{' for CUDA' if kind == 'cuda' else ''}, under any isolation; "
                  "it runs with every layer (and fails), and the next one probes again", file=sys.stderr)
            return strongest
        _ISOLATION[kind] = found
    return found


def _probe_isolation(kind: str) -> tuple[Isolation | None, Isolation]:
    """(the strongest plan under which the probe child starts, with its missing layers, or None where none does;
    the strongest plan)."""
    root = os.geteuid() == 0
    user = () if root else ("--user", "--map-root-user")
    full = ("--net", "--ipc", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc")
    tries = [full, ("--net", "--ipc", "--mount"), ("--net", "--pid", "--fork", "--kill-child"), ("--net",), ()]
    if not shutil.which("unshare") or os.environ.get("CUDA_AGENT_NO_NAMESPACES") == "1":
        tries = [()]
    keyctl = SECCOMP_DENY.get(platform.machine(), (0, {}))[1].get("keyctl")
    code = _CUDA_PROBE if kind == "cuda" else "pass"
    if keyctl:  # (and whether the seccomp filter holds: keyctl refused with EPERM)
        code += (f"\nimport ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 f"print('keyctl', libc.syscall({keyctl}, 0, -4, 0), ctypes.get_errno())")
    probe = [sys.executable, "-c", code]
    said = {}
    # Before a weaker set of namespaces, the same set without the private /dev and read-only /proc knobs: a GPU driver
    # that needs a node or a /proc entry they leave out then keeps the mount namespace.
    plans = [Isolation(("unshare", *user, *flags) if flags else (), uid, (), strict)
             for flags in tries for strict in ((True, False) if "--mount" in flags else (True,))
             for uid in ([NOBODY, None] if root else [None])]
    # Last, the same plans without the seccomp filter: where a child (a GPU driver) does not start under it, it is the
    # one layer given up (and only if the plans with it fail again once one without it has started, as for any layer)
    plans += [dataclasses.replace(p, seccomp=False) for p in plans]
    found, failed = None, []
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o777)

        def starts(iso):
            r = run_sandboxed(probe, d, 120, mem_gb=None, kind=kind, iso=iso)
            said[iso] = r.stdout
            if r.returncode != 0:
                _PROBE_LOG.append((kind, iso, r.stderr[-600:]))
            return r.returncode == 0
        for iso in plans:
            if starts(iso):
                # A layer is given up only where the plans with it fail again once a weaker one has started: a failure
                # of the moment (which a process the policy controls can cause) drops nothing.
                found = next((f for f in failed if starts(f)), iso)
                break
            failed.append(iso)
    if found is None:
        return None, plans[0]
    missing = [name for name, flag in (("network", "--net"), ("pid", "--pid"), ("filesystem", "--mount"))
               if flag not in found.prefix]
    if found.mount and not found.strict:
        missing.append("a private /dev and read-only /proc knobs")
    if root and found.uid is None:
        missing.append(f"unprivileged uid ({sys.executable} is not reachable by uid {NOBODY})")
    filtered = bool(keyctl) and "keyctl -1 1\n" in said.get(found, "")
    if not filtered:
        missing.append("a seccomp filter")
    if missing:
        print(f"sandbox.py: not available here{' for CUDA' if kind == 'cuda' else ''}: {', '.join(missing)}; children run"
              " with the remaining layers (see sandbox.py's docstring)", file=sys.stderr)
    return dataclasses.replace(found, missing=tuple(missing), seccomp=filtered), plans[0]


# ----------------------------------------------------------------------------------------------
# The jail: runs inside the fresh namespaces, sets up mounts and credentials, then execs the command
# ----------------------------------------------------------------------------------------------
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # a fresh tmpfs each
KEEP_RW = ("/proc",)  # left writable: CUDA fails to start (error 304) on a read-only /proc; its /proc/sys is read-only
MNT_FLAGS = {"nodev": MS_NODEV, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4


def _jail(cfg: dict, argv: list[str] | None):
    """cfg: {"mount": bool, "writable": [...], "hide": [...], "visible": [...], "readable": [...], "uid": int | None}. Only ever
    changes mounts of a mount namespace of its own (never the host's). Then execs argv, or (argv None: a child of the fork
    server) returns, to run its function in this process."""
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(src, tgt, fstype, flags, data=None):
        enc = lambda s: s.encode() if s else None
        if libc.mount(enc(src), enc(tgt), enc(fstype), flags, enc(data)) != 0:
            raise OSError(ctypes.get_errno(), f"mount {tgt}: {os.strerror(ctypes.get_errno())}")

    cwd = os.getcwd()
    writable = [w for w in cfg["writable"] if os.path.isdir(w)]
    if cfg["mount"]:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        if cfg.get("strict", True):
            _private_dev(mount)
        under = lambda p, tops: any(p == t or p.startswith(t.rstrip("/") + "/") for t in tops)
        visible = [v for v in cfg.get("visible", []) if os.path.isdir(v)]
        readable = [r for r in cfg.get("readable", []) if os.path.isdir(r)]
        keep = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in writable + visible + readable}  # reachable after covers
        covers = []
        for d in sorted({*cfg.get("private", PRIVATE_DIRS), *cfg["hide"]}, key=len):
            if os.path.isdir(d) and not os.path.islink(d) and not under(d, covers):
                covers.append(d)  # (a folder under a covered one is hidden already)
        for d in covers:
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1g,mode=1777")
        rebound = []  # the code that runs here (this repository, the interpreter, site-packages), if a cover hid it
        for v in sorted(visible, key=len):
            if under(v, covers) and not under(v, rebound) and not under(v, cfg["hide"]):
                os.makedirs(v, exist_ok=True)
                mount(f"/proc/self/fd/{keep[v]}", v, None, MS_BIND | MS_REC)  # read-only: the loop below
                rebound.append(v)
        for h in cfg["hide"]:  # a hidden folder inside a rebound one stays hidden
            if under(h, rebound) and os.path.isdir(h):
                mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "size=1g,mode=1777")
                covers.append(h)
        for r in readable:  # a trusted folder inside a hidden one (read-only: the loop below)
            os.makedirs(r, exist_ok=True)
            mount(f"/proc/self/fd/{keep[r]}", r, None, MS_BIND | MS_REC)
        for w in sorted(writable, key=len):
            os.makedirs(w, exist_ok=True)
            mount(f"/proc/self/fd/{keep[w]}", w, None, MS_BIND | MS_REC)
        rw = set(writable) | set(covers)
        for line in open("/proc/self/mountinfo"):
            fields = line.split()
            mp = fields[4].replace("\\040", " ")
            if mp in rw or any(mp.startswith(w.rstrip("/") + "/") for w in writable):
                continue
            if mp == "/dev" or (mp.startswith("/dev/") and mp != "/dev/shm") or mp in cfg.get("keep_rw", KEEP_RW):
                continue  # device nodes (/dev/nvidia*) must stay openable for writing
            # A remount must repeat the mount's own flags: a user namespace may not clear locked ones.
            keep_flags = sum(f for name, f in MNT_FLAGS.items() if name in fields[5].split(","))
            with contextlib.suppress(OSError):  # best effort per mount point (some refuse remounts)
                mount(None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | keep_flags)
        # The kernel's knobs (/proc/sys, /proc/irq, /proc/bus, /proc/mtrr, /proc/pressure...) are read-only even for
        # root inside: everything in /proc but the processes' own entries (where CUDA writes) and their links.
        for name in sorted(os.listdir("/proc")) if cfg.get("strict", True) else ("sys", "sysrq-trigger"):
            d = f"/proc/{name}"
            if name.isdigit() or os.path.islink(d):
                continue
            with contextlib.suppress(OSError):
                mount(d, d, None, MS_BIND | MS_REC)
                mount(None, d, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | 8)
        for fd in keep.values():  # (an O_PATH descriptor of a folder leads past any cover mounted over it)
            with contextlib.suppress(OSError):
                os.close(fd)
        os.chdir(cwd)  # re-enter the cwd through its writable bind mount
    if cfg["uid"] is not None:  # its folders become the unprivileged uid's (only they are visible and writable)
        for i, w in enumerate(writable):
            if i == 0 or os.stat(w).st_uid != cfg["uid"]:  # the cwd always (the parent writes into it); caches once
                _chown_tree(w, cfg["uid"])
    _drop_privileges(libc, cfg["uid"])
    if cfg.get("seccomp") is not False and not _seccomp(libc) and cfg.get("seccomp"):
        sys.exit("sandbox: cannot install the seccomp filter")  # (it holds here: a child never runs without it)
    if cfg.get("kill_child"):  # (`unshare --kill-child` set it before us; the kernel clears it when the uid changes)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if argv is not None:
        os.execvp(argv[0], argv)


DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")  # and /dev/nvidia* (the GPU), nothing else


def _private_dev(mount):
    """A fresh, read-only /dev that holds only DEV_NODES and the GPU's nodes (bound from the host's /dev), the
    /proc/self/fd links, and a mount point for the private /dev/shm. The host's /dev may be a devtmpfs that root
    can write (a file created there outlives every sandbox) with nodes that root may open (kvm, zram, disks)."""
    names = [n for n in DEV_NODES if os.path.exists(f"/dev/{n}")]
    names += sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
    keep = {n: os.open(f"/dev/{n}", os.O_PATH) for n in names}  # reachable after the cover
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID, "size=64k,mode=755")
    for n, fd in keep.items():
        target = f"/dev/{n}"
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(target)
        else:
            open(target, "w").close()
        mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
        os.close(fd)
    for link, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2")):
        os.symlink(to, f"/dev/{link}")
    os.makedirs("/dev/shm")
    mount(None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID, "size=64k,mode=755")


# System calls no child may make (the filter answers EPERM), installed last, after the namespaces and credentials: the
# kernel keyring, which the namespaces do not separate (a value cached by one child could be read by the next, or by
# a child of another verdict); userfaultfd (a child serving its pages as they are read); perf_event_open and bpf
# (kernel surfaces no task needs); io_uring, whose operations no filter sees. System calls of another ABI (i386's
# int 0x80, x32) are refused whole: their numbers mean other calls. {machine: (audit arch, {name: number})}
SECCOMP_DENY = {
    "x86_64": (0xC000003E, {"add_key": 248, "request_key": 249, "keyctl": 250, "perf_event_open": 298, "bpf": 321,
                            "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
                            "io_uring_register": 427}),
    "aarch64": (0xC00000B7, {"add_key": 217, "request_key": 218, "keyctl": 219, "perf_event_open": 241, "bpf": 280,
                             "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
                             "io_uring_register": 427}),
}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, EPERM = 22, 2, 1


def seccomp_filter(machine: str) -> list[tuple[int, int, int, int]] | None:
    """The classic-BPF program (code, jt, jf, k) of SECCOMP_DENY on this machine; None where it has no entry."""
    if machine not in SECCOMP_DENY:
        return None
    arch, calls = SECCOMP_DENY[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | EPERM  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    nrs = sorted(calls.values())
    n = len(nrs)
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny),  # seccomp_data.arch: another ABI, refused
            (ld, 0, 0, 0), (jge, n + 1, 0, 0x40000000)]  # seccomp_data.nr: x32's numbers have this bit set
    prog += [(jeq, n - i, 0, nr) for i, nr in enumerate(nrs)]  # each jumps to the last instruction
    return prog + [(ret, 0, 0, allow), (ret, 0, 0, deny)]


def _seccomp(libc) -> bool:
    """Installs seccomp_filter (needs no_new_privs, set before); False where it cannot (another machine, a kernel
    without filters: isolation()'s probe finds that and says so once)."""
    prog = seccomp_filter(platform.machine())
    if prog is None:
        return False

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    insns = (Filter * len(prog))(*[Filter(*i) for i in prog])
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(Prog(len(prog), insns)), 0, 0) == 0


def _chown_tree(top: str, uid: int):
    for root, dirs, files in os.walk(top):
        for name in [root, *(os.path.join(root, f) for f in dirs + files)]:
            with contextlib.suppress(OSError):
                os.lchown(name, uid, uid)


def _drop_privileges(libc, uid):
    """no_new_privs, an empty capability bounding set, no capabilities; then (root only) another uid."""
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        sys.exit("sandbox: cannot set no_new_privs")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(64):  # stops at the first capability this kernel does not know (EINVAL)
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:
            break
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # clears every capability set
        return

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    hdr, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3, all sets empty
    if libc.capset(ctypes.byref(hdr), data) != 0:
        sys.exit("sandbox: cannot drop capabilities")


# ----------------------------------------------------------------------------------------------
# cgroups and the sandboxed run
# ----------------------------------------------------------------------------------------------
def _cgroup(name: str, pids_max: int, mem_bytes: int | None) -> list[Path]:
    """Per-child pids (and memory) cgroups where the cgroup tree is writable (v1 or v2)."""
    made = []
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():  # cgroup v2: one directory holds both limits
        try:
            base = root / "cuda-agent-mini"
            base.mkdir(exist_ok=True)
            for d in (root, base):
                with contextlib.suppress(OSError):
                    (d / "cgroup.subtree_control").write_text("+pids +memory")
            d = base / name
            d.mkdir()
            made.append(d)
            (d / "pids.max").write_text(str(pids_max))
            if mem_bytes:
                (d / "memory.max").write_text(str(mem_bytes))
        except OSError:
            pass
        return made
    for ctrl, files in (("pids", {"pids.max": pids_max}), ("memory", {"memory.limit_in_bytes": mem_bytes})):
        if not (root / ctrl / "cgroup.procs").exists() or (ctrl == "memory" and mem_bytes is None):
            continue
        d = root / ctrl / "cuda-agent-mini" / name
        try:
            d.mkdir(parents=True, exist_ok=True)
            made.append(d)
            for f, v in files.items():
                (d / f).write_text(str(v))
        except OSError:
            pass
    return made


def run_sandboxed(argv: list[str], cwd: str | Path, timeout: float, *, writable=(), hide=None, readable=(),
                  mem_gb: float | None = 16.0, cpu_s: float | None = None, env: dict | None = None, pass_fds=(),
                  output_limit: int = 20_000, max_tasks: int = 1024, kind: str = "cpu", iso: Isolation | None = None,
                  started=None, fork: dict | None = None) -> SandboxResult:
    """Run argv in a child process that cannot hurt us (see the module docstring). `cwd` and `writable` stay
    writable; everything else is read-only, and `hide` (default: the cache root) is empty but for the `readable`
    folders in it (read-only). stdout/stderr are kept to `output_limit` characters each (head and tail).
    kind="cuda" for children that use the GPU (no address-space limit, the layers CUDA tolerates here).
    started(pid): called with the child's process group once it runs, for a caller (another thread) that may need
    to kill it sooner.
    fork={"preload": [modules], "call": [module, function, args]}: the same child, but forked from a fork server that
    imported `preload` once (see ForkServer) and running module.function(*args) instead of exec'ing argv; argv is run
    where no fork server is available ("probe": True: the server's probe child, run before its probe has passed)."""
    cwd = str(Path(cwd).resolve())
    iso = isolation(kind) if iso is None else iso
    child_env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    child_env.update(HOME=cwd, TMPDIR=cwd, LANG="C.UTF-8", PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    cfg = {"mount": iso.mount, "writable": [cwd, *[str(Path(w).resolve()) for w in writable]], "uid": iso.uid,
           "hide": [str(Path(h).resolve()) for h in ([CACHE_DIR] if hide is None else hide)], "visible": _code_dirs(),
           "readable": [str(Path(r).resolve()) for r in readable],
           "strict": iso.strict, "kill_child": "--kill-child" in iso.prefix, "seccomp": iso.seccomp}
    cmd = [*iso.prefix, sys.executable, "-E", "-S", str(SANDBOX_PY), "_jail", json.dumps(cfg), *argv]
    groups = _cgroup(uuid.uuid4().hex, max_tasks, int(mem_gb * 2**30) if mem_gb else None)
    # RLIMIT_AS breaks CUDA's address-space reservations; a memory cgroup (where writable) is used instead.
    has_mem_cgroup = any((g / "memory.max").exists() or (g / "memory.limit_in_bytes").exists() for g in groups)
    mem_limit = int(mem_gb * 2**30) if mem_gb and not has_mem_cgroup and kind != "cuda" else None
    limits = {"groups": [str(g) for g in groups], "mem_limit": mem_limit, "cpu_s": cpu_s, "max_tasks": max_tasks}

    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        forked = None
        if fork is not None:
            server = fork_server(fork["preload"], child_env, iso, kind, probe=not fork.get("probe"))
            forked = server and server.run(fork["call"], iso, cfg, cwd, child_env, limits, [out.fileno(), err.fileno()],
                                           list(pass_fds), timeout, started)
        if forked:
            rc, timed_out = forked
        else:
            p = subprocess.Popen(cmd, cwd=cwd, env=child_env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 start_new_session=True, preexec_fn=lambda: _apply_limits(limits), pass_fds=tuple(pass_fds))
            if started:
                started(p.pid)
            timed_out = False
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:  # also when the caller is interrupted (Ctrl-C): never leave a child behind
                kill_group(p.pid)  # (unshare's group: stragglers that kept it, and its PID namespace)
                p.wait()
            # Under `unshare --fork --kill-child`, a signal that kills the child shows up as 128+sig.
            rc = p.returncode
            if rc > 128 and "--fork" in iso.prefix:
                rc = -(rc - 128)
        for g in groups:  # leftover tasks in the cgroup (escaped the group): kill, then remove it
            with contextlib.suppress(OSError, ValueError):
                if (g / "cgroup.kill").exists():
                    (g / "cgroup.kill").write_text("1")
                for pid in (g / "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
            for _ in range(50):
                try:
                    g.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
        texts = [_read_limited(f, output_limit) for f in (out, err)]
    return SandboxResult(rc, texts[0], texts[1], timed_out, time.monotonic() - t0)


def namespace_members(ns: str):
    """The processes of PID namespace `ns` (a /proc/PID/ns/pid link's text), by a scan of /proc: a process cannot
    leave its namespace, so none is missed (a zombie's links are gone with it)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{name}/ns/pid") == ns:
                    yield int(name)


def kill_group(pgid: int, wait_s: float = 60.0):
    """SIGKILL a child's process group, and every process of the PID namespace its leader made (unshare's, or the
    fork server's M's), then wait until that namespace is empty. A process that called setsid() has left the group,
    and the kernel kills it only once the namespace's PID 1 has finished exiting (which frees its memory first:
    seconds for gigabytes); meanwhile it would run beside the next child (the next verdict's reference, whose
    secrets a candidate must never share a moment with). Members are found by scanning /proc: no process leaves its
    namespace. Where the leader has ended already, its namespace's PID 1 has too, and took the namespace with it."""
    try:
        ns = os.readlink(f"/proc/{pgid}/ns/pid_for_children")
    except OSError:
        ns = None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    if ns is None or ns == os.readlink("/proc/self/ns/pid"):
        return
    deadline = time.monotonic() + wait_s
    while True:
        left = list(namespace_members(ns))
        if not left:
            return
        if time.monotonic() > deadline:
            print(f"sandbox.py: {len(left)} process(es) of a killed child did not end within {wait_s:g} s",
                  file=sys.stderr)
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def _apply_limits(limits: dict):
    """In the child, before anything of it runs (between fork and exec, or in the fork server's child)."""
    for g in limits["groups"]:
        with open(Path(g) / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    if limits["mem_limit"]:
        resource.setrlimit(resource.RLIMIT_AS, (limits["mem_limit"], limits["mem_limit"]))
    if limits["cpu_s"]:
        resource.setrlimit(resource.RLIMIT_CPU, (int(limits["cpu_s"]), int(limits["cpu_s"]) + 5))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, 1 << 30))  # stdout/stderr land in files on the host's /tmp
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() != 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_tasks"] * 4, limits["max_tasks"] * 4))


# ----------------------------------------------------------------------------------------------
# The fork server: a FRESH sandboxed process per child without paying `import torch` (seconds) in each
# ----------------------------------------------------------------------------------------------
# A trusted interpreter, exec'ed by the harness (never forked from it: it holds none of the harness's state), imports
# `preload` once and then forks on request. Each request forks M (the role `unshare --fork --kill-child` plays on the
# exec path): M takes the limits and the namespaces, forks C, waits for it and reports its exit status to the
# parent over a socket that only M holds. C is PID 1 of its new PID namespace, mounts its own /proc, goes through the
# same _jail (mounts, /dev, capabilities, uid) as an exec'ed child, and runs the requested function instead of exec'ing
# a new interpreter. What C inherits is the server's memory: imported modules and the requests' paths and environments,
# never a secret (a child reads its own from its spec file, as on the exec path); its address-space layout and hash
# secret (random states it draws again: _reseed); and no descriptor but its stdout/stderr and the pass_fds. The server
# never initialises CUDA (it does not serve where its imports did): on the CUDA backend every child creates its own
# context. Probed once per server (the isolation probe's code, forked): where it fails, children are exec'ed. The
# server is not dumpable (no process of its uid without CAP_SYS_PTRACE can trace it), and ends when the harness's end
# of its socket closes.
CLONE_FLAGS = {"--mount": 0x00020000, "--user": 0x10000000, "--pid": 0x20000000, "--net": 0x40000000, "--ipc": 0x08000000}
_SERVERS: dict = {}
_SERVERS_LOCK = threading.Lock()


def fork_server(preload: list, env: dict, iso: Isolation, kind: str, probe: bool = True) -> ForkServer | None:
    """The fork server for these modules, environment (but HOME and TMPDIR, each child's own) and layers, started on
    first use and probed once (probe=False: the probe's own child); None where it does not start or its probe fails."""
    key = (tuple(preload), kind, iso, tuple(sorted((k, v) for k, v in env.items() if k not in ("HOME", "TMPDIR"))))
    with _SERVERS_LOCK:
        if key not in _SERVERS:
            try:
                _SERVERS[key] = ForkServer(preload, env)
            except OSError as e:
                print(f"sandbox.py: no fork server ({e}); children are exec'ed", file=sys.stderr)
                _SERVERS[key] = None
        server = _SERVERS[key]
    if server is None or not probe:
        return server
    with server.probe_lock:  # one probe per server; a child of a server that failed it is exec'ed
        if server.ok is None:
            with tempfile.TemporaryDirectory() as d:
                os.chmod(d, 0o777)
                own = {k: v for k, v in env.items() if k not in ("HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE")}
                r = run_sandboxed(["false"], d, 120, mem_gb=None, kind=kind, iso=iso, env=own,
                                  fork={"preload": preload, "call": ["sandbox", "_fork_probe", [kind]], "probe": True})
            server.ok = r.returncode == 0 and r.stdout.strip() == "forked"
            if not server.ok:
                print(f"sandbox.py: the fork server's probe child failed; children are exec'ed\n{r.stderr[-600:]}",
                      file=sys.stderr)
    return server if server.ok else None


def _fork_probe(kind: str):
    if kind == "cuda":
        exec(_CUDA_PROBE, {})
    print("forked")


class ForkServer:
    def __init__(self, preload: list, env: dict):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.home = tempfile.mkdtemp(prefix="forkserver-")  # its HOME and TMPDIR (a child gets its own)
        try:
            self.proc = subprocess.Popen([sys.executable, "-E", "-B", str(SANDBOX_PY), "_forkserver", str(theirs.fileno()),
                                          json.dumps(preload)], env=dict(env, HOME=self.home, TMPDIR=self.home,
                                                                   PYTORCH_NVML_BASED_CUDA_CHECK="1"),
                                         cwd=self.home, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         pass_fds=[theirs.fileno()], start_new_session=True)
        except BaseException:
            shutil.rmtree(self.home, ignore_errors=True)
            raise
        finally:
            theirs.close()
        atexit.register(self.close)
        self.lock, self.probe_lock, self.ok = threading.Lock(), threading.Lock(), None

    def close(self):
        """Stop the server and remove its folder (at this process's exit: the server would outlive the `atexit` of a
        process that only closed its socket, and write into its folder after it was removed)."""
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.home, ignore_errors=True)

    def run(self, call, iso, cfg, cwd, env, limits, stdio, pass_fds, timeout, started):
        """(returncode, timed_out) of call run in a forked child, or None where it could not be forked (set-up failed:
        then nothing of the child ran)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        req = {"call": call, "prefix": list(iso.prefix), "cfg": cfg, "cwd": cwd, "env": env, "limits": limits,
               "targets": [1, 2, *pass_fds]}
        pid = None
        try:
            try:
                with self.lock:
                    socket.send_fds(self.sock, [json.dumps(req).encode()], [theirs.fileno(), *stdio, *pass_fds])
            finally:
                theirs.close()
            deadline = time.monotonic() + timeout
            first = _recv_json(mine, deadline)
            if not isinstance(first, dict) or "error" in first or not isinstance(first.get("pid"), int):
                return None
            pid = first["pid"]
            if started:
                started(pid)
            last = _recv_json(mine, deadline)
            if last == "timeout":
                return -signal.SIGKILL, True
            if isinstance(last, dict) and "error" in last:  # M's set-up failed: nothing of the child ran
                print(f"sandbox.py: a forked child could not be set up ({last['error']}); it is exec'ed", file=sys.stderr)
                return None
            return (last["rc"] if isinstance(last, dict) and isinstance(last.get("rc"), int) else -signal.SIGKILL), False
        except OSError:  # the server is gone (killed for memory?): exec'ed from now on
            self.ok = False
            return None
        finally:  # also when the caller is interrupted: never leave a child behind
            if pid:
                kill_group(pid)
            mine.close()


def _recv_json(sock, deadline):
    """The next message (a dict), None at the end of the socket, "timeout" past the deadline."""
    sock.settimeout(max(0.0, deadline - time.monotonic()))
    try:
        data = sock.recv(1 << 16)
    except TimeoutError:
        return "timeout"
    return json.loads(data) if data else None


def _serve_forks(sock_fd: int, preload: list):
    """The fork server's loop (`python sandbox.py _forkserver FD PRELOAD`): one fork per request; ends with the parent."""
    libc = ctypes.CDLL(None, use_errno=True)  # (no PR_SET_PDEATHSIG: it fires when the parent's THREAD that started us ends)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no process of its uid may ptrace it or read its memory (no CAP_SYS_PTRACE)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its children (M) are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is for the parent
    import importlib
    for name in preload:
        importlib.import_module(name)
    if _cuda_initialised():
        sys.exit("sandbox.py: the fork server's imports initialised CUDA; it does not fork")  # (children are exec'ed)
    sock = socket.socket(fileno=sock_fd)

    def end():  # the parent is gone (also killed: no atexit of its ran), and the server's folder goes with it
        if Path(os.environ.get("HOME", "")).name.startswith("forkserver-"):
            shutil.rmtree(os.environ["HOME"], ignore_errors=True)
        os._exit(0)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 64)
        except OSError:
            end()
        if not msg:
            end()
        server = os.getpid()
        if os.fork() == 0:
            sock.close()
            _forked(dict(json.loads(msg), server=server), fds, libc)  # never returns
        for fd in fds:
            os.close(fd)


def _cuda_initialised() -> bool:
    """Whether this process initialised CUDA: torch's lazy init, or the driver's cuInit by anyone (cuCtxGetCurrent
    answers CUDA_ERROR_NOT_INITIALIZED = 3 before it, and has no effect). A forked child of an initialised process
    cannot use the GPU."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver: nothing to initialise
        return False
    ctx = ctypes.c_void_p()
    return cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 3


def _forked(req: dict, fds: list, libc):
    """M: limits, namespaces, then C; reports C's exit status. Never returns."""
    report = fds[0]
    try:
        # M dies with the server (whose one thread forked it), and C with M: a trainer killed with -9 closes the
        # server's socket, the server exits, and no candidate it served runs on (one spun for 18 minutes without this)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != req.get("server", os.getppid()):  # (the server ended before the line above)
            os._exit(1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        os.write(report, json.dumps({"pid": os.getpid()}).encode())
        # The child's descriptors at the numbers it expects: stdin /dev/null, stdout, stderr, pass_fds; nothing else.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1 << 12) for fd in fds]
        report = high[0]
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in high:
                with contextlib.suppress(OSError):
                    os.close(fd)
        high = high[1:]
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, target in zip(high, req["targets"]):
            os.dup2(fd, target)  # (dup2's copy is inheritable)
            os.close(fd)
        _apply_limits(req["limits"])
        prefix = req["prefix"]
        flags = sum(f for name, f in CLONE_FLAGS.items() if name in prefix)
        uid, gid = os.getuid(), os.getgid()
        if flags and libc.unshare(flags) != 0:
            raise OSError(ctypes.get_errno(), f"unshare: {os.strerror(ctypes.get_errno())}")
        if "--map-root-user" in prefix:
            for f, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{f}", "w") as fh:
                    fh.write(text)
        pid = os.fork()
    except BaseException as e:  # noqa: BLE001
        with contextlib.suppress(OSError):
            os.write(report, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        os._exit(0)
    if pid == 0:
        os.close(report)
        _forked_child(req, libc)
    for fd in req["targets"][2:]:  # M keeps only its report socket (the pipes' ends now belong to C alone)
        with contextlib.suppress(OSError):
            os.close(fd)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        os.write(report, json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode())
    os._exit(0)


def _forked_child(req: dict, libc):
    """C: PID 1 of its namespace (where --pid), its own /proc, the jail, then the function. Never returns."""
    code = 1
    try:
        if "--kill-child" in req["prefix"]:  # (and again after the jail's change of uid, which clears it)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _reseed()
        if "--mount-proc" in req["prefix"]:  # as `unshare --mount-proc` does
            for args in ((None, "/", None, MS_REC | MS_PRIVATE, None), ("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | 8, None)):
                if libc.mount(*(a.encode() if isinstance(a, str) else a for a in args)) != 0:
                    raise OSError(ctypes.get_errno(), f"mount {args[1]}: {os.strerror(ctypes.get_errno())}")
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        tempfile.tempdir = None  # (cached from the server's TMPDIR)
        _jail(req["cfg"], None)
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # as after an exec: its /proc/self is its own uid's (CUDA writes there)
        # Nothing but stdio and pass_fds (on the exec path, exec closes the rest: Python opens its files close-on-exec).
        keep = {0, *req["targets"]}
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        module, function, args = req["call"]
        import importlib
        getattr(importlib.import_module(module), function)(*args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        import traceback
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reseed():
    """Random states of the child's own, as an exec'ed interpreter draws them: a fork copies the server's, and numpy's
    and torch's global generators would be the same in every child (the same values in every candidate and in every
    reference child, for the server's life). `random` reseeds itself at fork (os.register_at_fork); the hash secret
    and the address space's layout cannot be drawn again without an exec (env.py's docstring)."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()  # (from the OS's entropy)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()  # (the CPU's: a GPU's generator is made in the child, with its own context)


def _code_dirs() -> list[str]:
    """Folders a child needs to see even when they live under /tmp: this repository, the interpreter, sys.path."""
    dirs = [SANDBOX_PY.parent, Path(sys.prefix), Path(sys.base_prefix), *(Path(p) for p in sys.path if p)]
    return sorted({str(d.resolve()) for d in dirs if d.is_dir()})


def _read_limited(f, limit: int) -> str:
    size = f.seek(0, 2)
    f.seek(0)
    if size <= limit:
        return f.read().decode(errors="replace")
    head = f.read(limit // 2).decode(errors="replace")
    f.seek(size - limit // 2)
    return f"{head}\n... [{size - limit} bytes of output truncated] ...\n{f.read().decode(errors='replace')}"


# ----------------------------------------------------------------------------------------------
# Locks (flock: the kernel drops them when the holder dies, so a killed process leaves no stale lock)
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def file_lock(path: Path, shared: bool = False):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def device_name(backend: str) -> str:
    return f"{backend}-{os.environ.get('CUDA_VISIBLE_DEVICES', '0').split(',')[0]}" if backend == "cuda" else "cpu"


def gpu_lock_path(backend: str) -> Path:
    """One timed section per GPU (or per CPU host) at a time, across all processes of this user."""
    return CACHE_DIR / "locks" / f"timing-{device_name(backend)}.lock"


@contextlib.contextmanager
def candidate_alive(backend: str):
    """Held (shared) by the PARENT for as long as a candidate child lives on this device; the candidate cannot
    release it. Baselines are timed under `no_candidates` (exclusive), so a candidate can never slow them. The
    gate keeps a stream of candidates from starving a waiting baseline; so a holder never takes a second hold (it would
    wait for the gate, which a waiting baseline holds while it waits for the holder)."""
    locks = CACHE_DIR / "locks"
    with file_lock(locks / f"gate-{device_name(backend)}.lock", shared=True):
        fd = os.open(_alive_path(backend), os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def no_candidates(backend: str):
    locks = CACHE_DIR / "locks"
    with file_lock(locks / f"gate-{device_name(backend)}.lock"), file_lock(_alive_path(backend)):
        yield


def _alive_path(backend: str) -> Path:
    path = CACHE_DIR / "locks" / f"alive-{device_name(backend)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "_jail":
        _jail(json.loads(sys.argv[2]), sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "_forkserver":
        _serve_forks(int(sys.argv[2]), json.loads(sys.argv[3]))
