"""Can a sandboxed child hand a CUDA output to the parent on the device (CUDA IPC), and how fast is that?

    python bench/ipc_probe.py --gib 1        # on the H200 (run_h200.sh part ipc); without a GPU it says so, exit 0

A verdict moves every whole output from a child to the parent through a pipe and host memory: ~0.7 s a GiB on the
H200 after the first touch of fresh host memory (6.5 s for the first GiB), most of a large task's verdict
(docs/results.md, bench/transfer_bench.py). With CUDA IPC the parent can copy a child's output on the device
instead, and protocol.py reads each timed run's sampled elements that way. Whether IPC works across the sandbox's
layers (its own PID, IPC and mount namespaces and another uid: sandbox.isolation("cuda")) depends on the host; this
probe answers it and times the copy.

A child fills a tensor of --gib GiB with a known pattern, writes the driver's IPC handle for it (cuIpcGetMemHandle)
into a file of its run folder, and waits for the parent's "done" file. The parent opens the handle
(cuIpcOpenMemHandle), copies the bytes into a tensor of its own (cuMemcpyDtoD), checks the pattern, closes the
handle and writes "done". Rows: a plain child (no sandbox), then a child in the sandbox as env.py runs candidates.
"""
import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import ctypes, json, os, sys, time
import torch
run, n = sys.argv[1], int(sys.argv[2])
x = torch.arange(n // 4, dtype=torch.int32, device="cuda")  # the pattern: element i holds i
torch.cuda.synchronize()
cuda = ctypes.CDLL("libcuda.so.1")
handle = (ctypes.c_char * 64)()
err = cuda.cuIpcGetMemHandle(handle, ctypes.c_uint64(x.data_ptr()))
with open(os.path.join(run, "handle.json.tmp"), "w") as f:  # (renamed when whole: the parent reads it at once)
    json.dump({"err": err, "handle": bytes(handle).hex(), "bytes": x.numel() * 4}, f)
os.replace(os.path.join(run, "handle.json.tmp"), os.path.join(run, "handle.json"))
deadline = time.time() + 120
while not os.path.exists(os.path.join(run, "done")) and time.time() < deadline:
    time.sleep(0.01)
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.gib <= 0 or args.repeats < 1:
        p.error("--gib must be > 0 and --repeats >= 1")
    import torch
    if not torch.cuda.is_available():
        print("ipc_probe.py: no CUDA GPU here: nothing to probe")
        return 0
    import sandbox
    n = int(args.gib * 2**30) // 4 * 4
    torch.cuda.init()
    dst = torch.empty(n // 4, dtype=torch.int32, device="cuda")
    want = torch.arange(n // 4, dtype=torch.int32, device="cuda")
    cuda = ctypes.CDLL("libcuda.so.1")

    class Handle(ctypes.Structure):  # CUipcMemHandle: 64 opaque bytes, passed by value to cuIpcOpenMemHandle
        _fields_ = [("reserved", ctypes.c_char * 64)]
    open_handle = cuda.cuIpcOpenMemHandle_v2  # (the names cuda.h maps cuIpcOpenMemHandle and cuMemcpyDtoD to)
    open_handle.argtypes = [ctypes.POINTER(ctypes.c_uint64), Handle, ctypes.c_uint]
    copy = cuda.cuMemcpyDtoD_v2
    copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t]
    rows = []
    for where in ("plain child", "sandboxed child (env.py's CUDA layers)"):
        for r in range(args.repeats):
            run = Path(tempfile.mkdtemp(prefix="ipc-", dir=sandbox.CACHE_DIR if "sandbox" in where else None))
            os.chmod(run, 0o777)  # (the sandbox's uid writes the handle file here)
            (run / "child.py").write_text(CHILD)
            argv = [sys.executable, "-E", str(run / "child.py"), str(run), str(n)]
            done = {}
            if "sandbox" in where:
                t = threading.Thread(target=lambda: done.update(r=sandbox.run_sandboxed(argv, run, 180, kind="cuda", mem_gb=None)))
            else:
                t = threading.Thread(target=lambda: done.update(r=subprocess.run(argv, capture_output=True, text=True, timeout=180)))
            t.start()
            t0 = time.monotonic()
            while not (run / "handle.json").exists() and t.is_alive() and time.monotonic() - t0 < 150:
                time.sleep(0.01)
            row = {"where": where, "repeat": r + 1}
            try:
                info = json.loads((run / "handle.json").read_text())
            except (OSError, ValueError):
                row["result"] = "the child wrote no handle"
            else:
                row["export"] = info["err"]
                if info["err"] == 0:
                    ptr = ctypes.c_uint64()
                    handle = Handle.from_buffer_copy(bytes.fromhex(info["handle"]))
                    t1 = time.perf_counter()
                    row["open"] = open_handle(ctypes.byref(ptr), handle, 1)  # 1: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                    if row["open"] == 0:
                        torch.cuda.synchronize()
                        t2 = time.perf_counter()
                        row["copy_err"] = copy(dst.data_ptr(), ptr.value, n)
                        torch.cuda.synchronize()
                        t3 = time.perf_counter()
                        row["open_s"], row["copy_s"] = t2 - t1, t3 - t2
                        row["same"] = bool(torch.equal(dst, want))
                        cuda.cuIpcCloseMemHandle(ptr)
                        dst.zero_()
                row["result"] = "ok" if row.get("same") else "failed"
            (run / "done").write_text("1")
            t.join()
            res = done.get("r")
            if row["result"] != "ok" and res is not None:
                row["child"] = (getattr(res, "stderr", "") or "")[-300:].strip().replace("\n", " / ").replace("|", "/")
            shutil.rmtree(run, ignore_errors=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n## CUDA IPC from a child to the parent, {args.gib:g} GiB (torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()})\n")
    print("GB/s: the bytes copied per second (each is read and written once on the device); CUresult 0 is success\n")
    print("| child | repeat | result | export / open / copy (CUresult) | open s | copy s | GB/s | the child's last words |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        gbs = f"{n / row['copy_s'] / 1e9:.0f}" if row["result"] == "ok" else "-"
        codes = " / ".join(str(row.get(k, "-")) for k in ("export", "open", "copy_err"))
        fmt = lambda k: f"{row[k]:.4f}" if k in row else "-"
        print(f"| {row['where']} | {row['repeat']} | {row['result']} | {codes} | {fmt('open_s')} | {fmt('copy_s')} | "
              f"{gbs} | {row.get('child', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
