"""bench/verdict_split.py's child: the harness's own protocol._child_main with timestamps on stderr
(`TRACE <monotonic> <what>`). Exec'ed as `python _traced_child.py _child SPEC` (stamps the interpreter's start and
its imports), or called as main(SPEC) in a child of the sandbox's fork server (which imported them already)."""
import time

T0 = time.monotonic()
import sys  # noqa: E402


def stamp(what, t=None):
    print(f"TRACE {time.monotonic() if t is None else t:.6f} {what}", file=sys.stderr, flush=True)


def main(spec_path):
    stamp("child: running (interpreter up, or forked)")
    __import__("torch")
    stamp("child: import torch done")
    import protocol
    stamp("child: import protocol (build, scan, sandbox) done")
    _send, _recv, n = protocol.send, protocol.recv, [0, 0]
    busy, idle, last = {}, {}, {"op": None, "recv": 0.0, "sent": None}  # per op: ms handling it, ms waiting after it

    def send(fd, obj, blobs=(), re=None):
        _send(fd, obj, blobs, re)
        if last["op"]:
            busy[last["op"]] = busy.get(last["op"], 0.0) + (time.monotonic() - last["recv"]) * 1e3
        last["sent"] = time.monotonic()
        n[0] += 1
        if n[0] == 1:
            stamp(f"child: first message sent ({next(iter(obj), '') if isinstance(obj, dict) else ''})")

    def recv(fd, *a, **k):
        obj, blobs = _recv(fd, *a, **k)
        n[1] += 1
        op = obj.get("op") if isinstance(obj, dict) else ""
        if last["op"] and last["sent"]:
            idle[last["op"]] = idle.get(last["op"], 0.0) + (time.monotonic() - last["sent"]) * 1e3
        last.update(op=op, recv=time.monotonic(), sent=None)
        if op == "exit":
            for o in busy:
                stamp(f"child: ms handling {o!r} commands (sum {busy[o]:.0f}), waiting for the next command after them "
                      f"(sum {idle.get(o, 0.0):.0f})")
        if n[1] < 20 or op == "exit":
            stamp(f"child: command {n[1]} received ({op})")
        return obj, blobs

    protocol.send, protocol.recv = send, recv
    protocol._child_main(spec_path)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    main(sys.argv[2])
