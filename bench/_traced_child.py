"""bench/verdict_split.py's child: env.py's `_child` entry point with timestamps on stderr (`TRACE <monotonic> <what>`).
Runs the harness's own protocol._child_main; only stamps are added."""
import time

T0 = time.monotonic()
import sys  # noqa: E402


def stamp(what):
    print(f"TRACE {time.monotonic():.6f} {what}", file=sys.stderr, flush=True)


stamp("child: interpreter up")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import torch  # noqa: E402,F401

stamp("child: import torch done")
import protocol  # noqa: E402

stamp("child: import protocol (build, scan, sandbox) done")
_send, n = protocol.send, [0]


def send(fd, obj, blobs=(), re=None):
    _send(fd, obj, blobs, re)
    n[0] += 1
    if n[0] % 1000 == 1:
        stamp(f"child: first message sent ({next(iter(obj), '') if isinstance(obj, dict) else ''})")


_recv = protocol.recv


def recv(fd, *a, **k):
    obj, blobs = _recv(fd, *a, **k)
    n[0] += 1000
    if n[0] < 20000:
        stamp(f"child: command {n[0] // 1000} received ({obj.get('op') if isinstance(obj, dict) else ''})")
    if isinstance(obj, dict) and obj.get("op") == "exit":
        stamp("child: exit received")
    return obj, blobs


protocol.send, protocol.recv = send, recv
protocol._child_main(sys.argv[2])
