"""Moving one large output between two processes, leg by leg: what a verdict of GB-sized outputs pays per output.

    python bench/transfer_bench.py --backend cuda --gib 2     # on the H200: the curriculum's largest outputs
    python bench/transfer_bench.py --backend cpu --gib 0.25   # anywhere

A verdict of a 537M-element task moves 15 outputs of 2 GiB (7 reference outputs, 8 of the candidate's) from a
child to the parent and compares 8 of them (bench/big_verdict.py: ~3.3 s per output on the H200). This bench
takes one float32 output of --gib GiB on the child's device and times, --repeats times each:

  pipe                 protocol.send in a child (a GPU output through the pinned staging buffer), protocol.recv
                       here into a fresh buffer, as a verdict moves every output;
  pipe, reused buffer  the same, read into one buffer that stays (what the fresh memory costs);
  pipe, pinned buffer  (CUDA) the same, into pinned memory from torch's host cache (reused once freed; the
                       comparison's copies to the GPU run from pinned memory);
  mapped area          the child stores the output into a memory file this process made (the same staging pieces),
                       this process views it in place (no copy, no fresh buffer): a design env.py does not use;
  fresh host memory    no transfer: allocating and touching that many bytes here (on a machine whose memory grows
                       as it is used, as the H200's does, the first touch of new memory is slow);
  compare              env.compare of the received output against a copy of it held here (on this process's GPU
                       where it has one, from env.GPU_COMPARE elements on, as in a verdict).

One table row per way: seconds to move (child's copy out + transfer + our read; the first repeat and the median),
seconds to compare, GB/s.
Nothing here is timed by a test; the numbers are for reading (docs/results.md).
"""
import argparse
import contextlib
import fcntl
import json
import mmap
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

import protocol  # noqa: E402


def child(backend: str, n: int, cmd_fd: int, rep_fd: int, area_fd: int):
    """Serves "pipe" and "area" requests (one byte each) with the same output until the command pipe closes."""
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    out = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)  # (N,) float32
    flat = out.view(torch.uint8)
    blob = flat if device.type == "cuda" else flat.numpy()
    while (req := os.read(cmd_fd, 1)) in (b"p", b"a"):
        if req == b"p":
            protocol.send(rep_fd, {"shape": [n]}, [blob])
            continue
        with mmap.mmap(area_fd, flat.numel(), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            at = 0
            for piece in protocol.staged_pieces(flat) if device.type == "cuda" else [memoryview(blob)]:
                mm[at:at + piece.nbytes] = piece  # (the same pieces send writes to the pipe)
                at += piece.nbytes
        protocol.send(rep_fd, {"shape": [n]})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="auto")
    p.add_argument("--gib", type=float, default=None, help="output size in GiB (default: 2 on CUDA, 0.25 on the CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        backend, n, cmd_fd, rep_fd = a.child[0], *map(int, a.child[1:])
        return child(backend, n, cmd_fd, rep_fd, int(os.environ["TRANSFER_AREA_FD"]))
    import env
    backend = env.resolve_backend(a.backend)
    gib = a.gib if a.gib is not None else (2.0 if backend == "cuda" else 0.25)
    if gib <= 0 or a.repeats < 1:
        p.error("--gib must be > 0 and --repeats >= 1")
    n = int(gib * 2**30) // 4
    ref = torch.randn(n, generator=torch.Generator().manual_seed(0))  # the child's values, held here as a verdict does
    print(f"transfer_bench | backend {backend} | one float32 output of {n * 4 / 2**30:.2f} GiB ({n / 1e6:.0f}M elements) "
          f"| {a.repeats} repeats | compare on {'this process GPU' if backend == 'cuda' and n >= env.GPU_COMPARE else 'the CPU'}",
          flush=True)
    cmd_r, cmd_w = os.pipe()
    rep_r, rep_w = os.pipe()
    with contextlib.suppress(OSError):  # the verdict's pipe size
        fcntl.fcntl(rep_w, fcntl.F_SETPIPE_SZ, protocol.PIPE_BYTES)
    area = os.memfd_create("transfer-bench", 0)  # (inherited: not close-on-exec)
    os.ftruncate(area, n * 4)
    proc = subprocess.Popen([sys.executable, __file__, "--child", backend, str(n), str(cmd_r), str(rep_w)],
                            pass_fds=[cmd_r, rep_w, area], env=dict(os.environ, TRANSFER_AREA_FD=str(area)))
    os.close(cmd_r)
    os.close(rep_w)
    view = mmap.mmap(area, n * 4, mmap.MAP_SHARED, mmap.PROT_READ)
    keep = torch.empty(n * 4, dtype=torch.uint8)  # the reused buffer, touched once here
    keep.numpy().fill(0)
    ways = (("pipe", b"p"), ("pipe, reused buffer", b"p")) + ((("pipe, pinned buffer", b"p"),) if backend == "cuda" else ()) \
        + (("mapped area", b"a"), ("fresh host memory", None))
    rows = {way: [] for way, _ in ways}
    try:
        for r in range(a.repeats):
            for way, req in ways:
                t0 = time.perf_counter()
                if req is None:  # no transfer: what allocating and touching the bytes costs on this machine
                    fresh = torch.empty(n * 4, dtype=torch.uint8)
                    fresh.numpy().fill(1)
                    rows[way].append((time.perf_counter() - t0, None))
                    print(f"  {way:<19} | repeat {r + 1} | allocate and touch {rows[way][-1][0]:.3f} s", flush=True)
                    del fresh
                    continue
                os.write(cmd_w, req)
                if way == "pipe":  # as a verdict receives every output: a fresh buffer per reply
                    obj, blobs = protocol.recv(rep_r)
                    out = blobs[0].view(torch.float32)
                elif way.startswith("pipe, "):  # the same bytes into memory that is already there
                    if way == "pipe, pinned buffer":  # (torch's host cache: freed pinned blocks are reused)
                        into = torch.empty(n * 4, dtype=torch.uint8, pin_memory=True)
                    else:
                        into = keep
                    n_head = int.from_bytes(protocol._read_exact(rep_r, protocol.PREFIX)[:8], "little")  # (+ blobs' total)
                    head = json.loads(protocol._read_exact(rep_r, n_head))
                    mv, got = memoryview(into.numpy()), 0
                    while got < head["sizes"][0]:
                        got += os.readv(rep_r, [mv[got:got + (1 << 24)]])
                    out = into.view(torch.float32)
                else:  # (read only: torch warns that it cannot mark the tensor so; nothing here writes to it)
                    protocol.recv(rep_r)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)
                        out = torch.frombuffer(memoryview(view), dtype=torch.float32, count=n)
                t1 = time.perf_counter()
                err = env.compare(out, ref, 1e-2, 1e-2, way)
                t2 = time.perf_counter()
                if err:
                    raise SystemExit(f"transfer_bench: the {way} output differs: {err}")
                rows[way].append((t1 - t0, t2 - t1))
                print(f"  {way:<19} | repeat {r + 1} | move {t1 - t0:.3f} s | compare {t2 - t1:.3f} s", flush=True)
                out = into = blobs = None  # (a pinned block goes back to torch's host cache for the next repeat)
    finally:
        os.close(cmd_w)
        proc.wait()
    med = lambda xs: sorted(xs)[len(xs) // 2]
    print(f"\n| way ({backend}, {n * 4 / 2**30:.2f} GiB) | move s, first | move s (median) | compare s (median) | move GB/s |")
    print("|---|---|---|---|---|")
    for way, xs in rows.items():
        mv, cp = med([x[0] for x in xs]), None if xs[0][1] is None else med([x[1] for x in xs])
        print(f"| {way} | {xs[0][0]:.3f} | {mv:.3f} | {'-' if cp is None else f'{cp:.3f}'} | {n * 4 / mv / 1e9:.2f} |")
    out = os.environ.get("OUT")
    if out:
        Path(out, f"transfer_bench_{backend}.json").write_text(json.dumps({"n": n, "rows": rows}))


if __name__ == "__main__":
    main()
