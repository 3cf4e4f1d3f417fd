"""protocol.py: steps 4 and 5 of a verdict (env.py): the sandboxed children and the exchanges by which the parent
checks and times them. The parent holds the clock and every secret; a child only ever learns the input of the run
it is about to make, and sends back what it is asked for, over pipes (JSON headers and raw tensor bytes, never
pickle). Every command carries a fresh nonce that its reply must echo: only the harness that read the command knows
it, so a message that native code in the child writes to the reply pipe itself is refused. A child is
`python env.py _child SPEC`, or (where it works) a fresh fork of sandbox.py's fork server, which imported torch before
any candidate existed; either runs _child_main here.

    ref = Child({"mode": "reference", ...}, run_dir, "cuda", cfg)     # the trusted task code
    times = timed_runs(ref, seeds, cfg)                               # milliseconds per run, by this process's clock
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import itertools
import json
import math
import os
import random
import secrets
import select
import signal
import struct
import sys
import threading
import time
import types
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from build import error_excerpt
from sandbox import kill_group, namespace_members, run_sandboxed
from scan import ALLOWED_OPS, INIT_OPS

ENV_PY = Path(__file__).resolve().parent / "env.py"  # a child is `python env.py _child SPEC`
# ... or, where the sandbox's fork server works, a fresh fork of an interpreter that imported these once (sandbox.py):
# torch (seconds), torch._dynamo (which the dispatch monitor's first operator imports: 1.5 s on 2 cores) and this module.
# An empty list: every child exec'ed (bench/verdict_split.py times both).
FORK_PRELOAD = ["torch", "torch._dynamo", "protocol"]


# ----------------------------------------------------------------------------------------------
# The run protocol. The PARENT holds the clock and every secret; a child only ever learns the input of
# the run it is about to make, and (where the parent can reach its memory: reads()) only as that run starts. One
# exchange per run:
#   parent: "flush" (GPU)   child: zeroes a buffer larger than the L2, synchronises, "ok"
#   parent: writes the run's input into the child's buffers (TimedInputs: process_vm_writev, every process of the
#           child stopped meanwhile (stop_processes); on a GPU a copy into buffers of the native helper's own that the
#           child opened through CUDA IPC), then at once:
#   parent: t0, (continues the child,) "run"
#                           child: out = fn(*buffers), made contiguous, device-wide sync, "ok" with each output
#                                  tensor's address and size
#   parent: reads READS random elements of each output from the child's memory itself (process_vm_readv; on a GPU
#           a gather through a CUDA IPC mapping of the output's allocation); t1
# Every command carries a fresh nonce that its reply echoes. The positions are drawn by the parent and never leave it:
# a kernel that takes its process over (it can reach the interpreter and answer for the harness: env.py, "does NOT
# protect") still cannot know which elements are checked, so it must compute all of them before the run's reply; and
# it never holds a run's input before the clock starts, so it cannot compute any of them earlier. The reads are
# inside [t0, t1]: work deferred past the reply (lazy pages, late kernels) is timed, or read unfinished. Where the
# parent may not reach a child's memory (reads()), the child is told each run's input and the sample's position:
#   parent: "load" (seed)   child: builds that input set once, copies it into the SAME buffers, flushes, "ok"
#   parent: t0, "run"       (as above)
#   parent: "sample" (o)    child: copies out[o::step] (every output) and sends it; parent: t1 at its last byte
# and a seed travels XORed with seed_pad(key, nonce). reads() says which, once per backend. [t0, t1] is one call of
# native code (timed_pair), which runs without the interpreter's lock: the trainer's other threads cannot add their
# turns to it.
# Check runs ask "full" after the run instead: every element, plus the input-mutation and type checks.
_clock = time.perf_counter  # the parent's clock; no candidate code ever runs in the parent
SAMPLE = 65536  # elements per output compared after a timed run (every element of smaller outputs)
READS = 64  # elements of each output tensor the parent reads after a timed run: a run that left a fraction f of its
# output unwritten passes with probability (1 - f) ** 64 (f = 5%: 4%), and there are n_timed runs
MAX_OUTPUTS = 64  # output tensors a timed run may list (the positions for them are drawn before the run)
SAMPLE_BYTES = 64 << 20  # what a timed run's sample reply may bring (sample_of keeps up to 2 * SAMPLE - 1 values of
# each output: 2 MiB of complex128; 32 such outputs)


STAGE_BYTES = 64 << 20  # a GPU output goes to the pipe in pieces of this size, through one pinned buffer per child
_stage = []  # that buffer, made at the child's first GPU reply


def _staging() -> torch.Tensor:
    """Copies from the GPU into pinned memory run at ~50 GB/s on an H200 host, into pageable memory at ~2 GB/s (a
    2 GiB output: 0.04 s against 1.0 s). Pageable where pinning is refused."""
    if not _stage:
        try:
            _stage.append(torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True))
        except RuntimeError:
            _stage.append(torch.empty(STAGE_BYTES, dtype=torch.uint8))
    return _stage[0]


def _write_all(fd: int, view: memoryview, deadline: float | None = None):
    """All of view into fd. On a non-blocking descriptor (the parent's end of a command pipe) a full pipe is waited
    for until `deadline` (time.monotonic()), then PastDeadline: a child that stops reading its commands, or fills
    its command pipe itself, holds the parent no longer than a child that stops answering."""
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise PastDeadline("a command could not be written before its deadline") from None
            p = select.poll()
            p.register(fd, select.POLLOUT)
            p.poll(60_000 if left is None else max(1, int(min(left, 60.0) * 1000)))  # (poll takes an int of ms)


# Waiting for a message spins before it sleeps. A process asleep in read() or select() is woken by the scheduler when
# the other side writes: tens of microseconds on 2 idle cores, more on a big host whose idle cores sit in deep sleep
# states, twice per timed run (the run's reply and the sample's) and once more on the child's side for each command.
# Polling instead takes no wake-up. A child polls for CHILD_SPIN_S after each reply (in a timed section the next
# command follows within microseconds), then sleeps. The parent polls for a timed exchange's reply only: for a run's
# only where the work runs on a GPU (PARENT_SPIN_S: on the CPU backend a polling parent would take a core from the
# candidate's OpenMP team while it runs), for a sample's on every backend (SAMPLE_SPIN_S: the run is over, the reply
# is a copy away). bench/floor_diag.py measures the floor with and without.
CHILD_SPIN_S = 0.002
PARENT_SPIN_S = {"cuda": 0.05, "cpu": 0.0}  # per backend; a longer run than this is waited for asleep
SAMPLE_SPIN_S = 0.002


def spin(fd: int, seconds: float) -> bool:
    """Polls fd for up to `seconds` without sleeping; True once it is readable (or at its end)."""
    if seconds <= 0:
        return False
    p, end = select.poll(), time.perf_counter() + seconds  # (poll: select refuses descriptors from 1024 on)
    p.register(fd, select.POLLIN)
    while not p.poll(0):
        if time.perf_counter() > end:
            return False
        # A pipe's reader is woken on its writer's core: a poller that never yields keeps a process it has just
        # answered waiting behind it for a time slice (echo round trips beside a busy thread: max 2.4 ms, 0.17 with it)
        os.sched_yield()
    return True


# One timed run is one call of native code. The parent's clock runs in the trainer's interpreter, whose other threads
# (train.py's generation loop, a tool call's scan) hold its lock while they run Python: a thread back from a system
# call waits up to the switch interval (5 ms) for it, and with the clock read in Python a 0.6 ms baseline timed 21 ms
# a run beside a busy thread. timed_pair writes the run's command, reads its whole reply (each message's prefix says
# its length), then reads the sampled elements from the child's memory (or writes the sample's command and reads that
# whole reply), with the clock read before the first write and after the last byte; ctypes runs it without the lock.
# The span ends only when the sample, data that only the finished work can produce, is in: a stamp at a reply's first
# byte would be one a child that took its reply pipe over could send early. The helper is compiled by each process
# that times (the system's C compiler, ~0.05 s) in a private folder and loaded from there: nothing a candidate can
# write is loaded into the parent.
TIMED_PAIR_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
static long long now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
/* poll()'s timeout until the deadline: whole ms, at most a minute (an int; the callers loop) */
static int wait_ms(long long deadline, long long t) {
    long long w = (deadline - t) / 1000000 + 1;
    return (int)(w < 60000 ? w : 60000);
}
/* All n bytes into fd (the parent's end of a command pipe, non-blocking): a full pipe is waited for until the
   deadline. Returns 0; -1 past the deadline; -4 a write error (the pipe's end). */
static long long write_all(int fd, const char *p, long long n, long long deadline) {
    while (n > 0) {
        long long k = write(fd, p, n);
        if (k > 0) { p += k; n -= k; continue; }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            long long t = now_ns();
            if (t > deadline) return -1;
            struct pollfd q = {fd, POLLOUT, 0};
            poll(&q, 1, wait_ms(deadline, t));
            continue;
        }
        return -4;
    }
    return 0;
}
/* One whole message into buf: its 16-byte prefix (header length, blobs' total; little-endian), then as many bytes
   as it says. Polls for spin_ns (yielding the core at each turn), then sleeps; gives up at deadline. Returns its
   length; -1 past the deadline; -2 at the pipe's end or a read error; -3 a header length out of range; -5 larger
   than cap (*need: its length). */
static long long read_msg(int fd, char *buf, long long cap, long long spin_ns, long long deadline, long long *need) {
    long long got = 0, want = 16, spin_end = now_ns() + spin_ns;
    while (got < want) {
        long long t = now_ns();
        if (t > deadline) return -1;
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, t < spin_end ? 0 : wait_ms(deadline, t));
        if (r < 0 && errno != EINTR) return -2;
        if (r <= 0) { if (t < spin_end) sched_yield(); continue; }
        long long k = read(fd, buf + got, want - got);
        if (k == 0) return -2;
        if (k < 0) { if (errno == EINTR || errno == EAGAIN) continue; return -2; }
        got += k;
        if (got == 16 && want == 16) {
            unsigned long long n = 0, total = 0;
            for (int i = 7; i >= 0; --i) {
                n = n << 8 | (unsigned char)buf[i];
                total = total << 8 | (unsigned char)buf[8 + i];
            }
            if (n == 0 || n >= (1ULL << 20)) return -3;
            if (total > (1ULL << 40) || 16 + n + total > (unsigned long long)cap) {  /* (no sum that wraps) */
                *need = (long long)(16 + n + (total > (1ULL << 62) ? (1ULL << 62) : total));
                return -5;
            }
            want = 16 + (long long)n + (long long)total;
        }
    }
    return got;
}
/* The device side of the reads: the child's output memory opened through CUDA IPC handles (cached per child:
   the caching allocator reuses its segments), the elements gathered by one kernel launch (one thread per byte,
   sources from a host-mapped list, results into host-mapped memory) in a CUDA context of this process's own, never
   the trainer's: an error there (a fault) is that context's alone. gpu_setup hands the driver's functions, made by
   Python (protocol._gpu), to this code. */
typedef struct { char bytes[64]; } Handle;
static struct {
    int (*push)(void *);
    int (*pop)(void **);
    int (*open)(unsigned long long *, Handle, unsigned);
    int (*range)(unsigned long long *, size_t *, unsigned long long);
    int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
    int (*query)(void *);
    int (*close)(unsigned long long);
    int (*alloc)(unsigned long long *, size_t);
    int (*free)(unsigned long long);
    int (*copy)(unsigned long long, unsigned long long, size_t, void *);
    int (*export)(Handle *, unsigned long long);
    void *ctx, *stream, *cstream, *kernel;  /* cstream: the inputs' copies (never behind a gather, nor it behind them) */
    unsigned long long *srcs;  /* host-mapped: byte addresses to gather */
    unsigned char *dst;        /* host-mapped: what they hold */
    long long cap;
} G;
#define MAPS 1024
#define MAPS_PER_CHILD 32  /* (a caching allocator's segments: a handful; a child listing more is refused) */
static struct { Handle h; unsigned long long ptr; size_t size; int owner; } maps[MAPS];
static int n_maps;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;  /* (verdicts' threads: one timed run at a time, closes any time) */
/* The timed inputs' memory (gpu_alloc ... gpu_free, write_inputs) has a lock of its own, so that a verdict copying in
   gigabytes of sets does not hold up another's timed reads; and a generation: memory of a context the helper has
   since dropped (a fault) is never freed or written to in the new one, whose addresses may be the same. */
static pthread_mutex_t copy_lock = PTHREAD_MUTEX_INITIALIZER;
static long long generation;
void gpu_setup(void **fns, void *ctx, void *stream, void *cstream, void *kernel, void *srcs, void *dst, long long cap) {
    pthread_mutex_lock(&lock);
    pthread_mutex_lock(&copy_lock);
    G.push = fns[0]; G.pop = fns[1]; G.open = fns[2]; G.range = fns[3]; G.launch = fns[4]; G.query = fns[5];
    G.close = fns[6]; G.alloc = fns[7]; G.free = fns[8]; G.copy = fns[9]; G.export = fns[10];
    G.ctx = ctx; G.stream = stream; G.cstream = cstream; G.kernel = kernel; G.srcs = srcs; G.dst = dst; G.cap = cap;
    n_maps = 0;
    ++generation;
    pthread_mutex_unlock(&copy_lock);
    pthread_mutex_unlock(&lock);
}
/* Closes the mappings opened for `owner` (a child that ended) and forgets them; -1: every child's. */
static void forget(int owner) {
    int k = 0;
    for (int i = 0; i < n_maps; ++i) {
        if (owner == -1 || maps[i].owner == owner) { G.close(maps[i].ptr); continue; }
        maps[k++] = maps[i];
    }
    n_maps = k;
}
void gpu_forget(int owner) {
    void *was;
    pthread_mutex_lock(&lock);
    if (G.push && !G.push(G.ctx)) { forget(owner); G.pop(&was); }
    pthread_mutex_unlock(&lock);
}
static int gpu_map(const Handle *h, int owner, unsigned long long *ptr, size_t *size) {
    int mine = 0;
    for (int i = 0; i < n_maps; ++i) {
        if (maps[i].owner != owner) continue;
        if (!memcmp(maps[i].h.bytes, h->bytes, 64)) { *ptr = maps[i].ptr; *size = maps[i].size; return 0; }
        ++mine;
    }
    if (mine >= MAPS_PER_CHILD || n_maps == MAPS) return -1;  /* (refused; nothing is closed mid-run) */
    unsigned long long base = 0;
    int r = G.open(ptr, *h, 1);  /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
    if (r) return r;
    r = G.range(&base, size, *ptr);  /* the allocation's true size, as this context sees it */
    if (r) { G.close(*ptr); return r; }
    maps[n_maps].h = *h; maps[n_maps].ptr = *ptr; maps[n_maps].size = *size; maps[n_maps].owner = owner; ++n_maps;
    return 0;
}
/* Reads of the child's memory, k random elements of each output the run's reply lists: its blob holds, per output
   tensor, (address, bytes, element size, its allocation's base) as little-endian u64s and the allocation's IPC
   handle (64 bytes; zeros for host memory). Element i of output j is rand[j * k + i] modulo the output's elements;
   what is read goes to got, in that order. where 1: host memory of process `who` (process_vm_readv); 2: device
   memory, through the mappings kept for child `who`. Returns the bytes read; -6 a malformed list (or more outputs
   than rand covers, more than got holds, an output outside its allocation, more allocations than a child may
   list); -7 a read refused (*err: errno, or the CUresult of opening a child's handle); -8 the gather failed (*err:
   its CUresult: the helper's context may be lost); -1 the gather not done by the deadline; -9 no device helper. */
#define ENTRY 96
static void entry(const unsigned char *t, long long j, unsigned long long f[4]) {
    for (int q = 0; q < 4; ++q) {
        f[q] = 0;
        for (int b = 7; b >= 0; --b) f[q] = f[q] << 8 | t[ENTRY * j + 8 * q + b];
    }
}
/* 0 once a stream of the helper's has done its work; -1 not by the deadline; else the CUresult of its failure */
static int wait_stream(void *stream, long long deadline) {
    int r;
    while ((r = G.query(stream)) == 600) {  /* CUDA_ERROR_NOT_READY: polled until the command's deadline */
        if (now_ns() > deadline) return -1;
        sched_yield();
    }
    return r;
}
static long long read_device(int who, const unsigned char *t, long long outputs, const unsigned long long *rand,
                             long long nrand, long long k, char *got, long long got_cap, long long deadline,
                             long long *err) {
    long long m = 0;
    for (long long j = 0; j < outputs; ++j) {
        unsigned long long f[4], mapped = 0;
        entry(t, j, f);
        unsigned long long addr = f[0], bytes = f[1], size = f[2], base = f[3];
        if (size == 0 || size > 16 || (size & (size - 1)) || bytes % size) return -6;
        if (bytes == 0) continue;
        if ((j + 1) * k > nrand || m + k * (long long)size > got_cap || m + k * (long long)size > G.cap) return -6;
        size_t extent = 0;
        int r = gpu_map((const Handle *)(t + ENTRY * j + 32), who, &mapped, &extent);
        if (r == -1) return -6;
        if (r) { *err = r; return -7; }  /* (a handle the child made up, or memory it freed: its run fails) */
        /* every byte gathered lies inside the mapping: the address and size are the child's word, the extent is not */
        if (addr < base || addr - base > extent || bytes > extent - (addr - base)) return -6;
        mapped += addr - base;
        for (long long i = 0; i < k; ++i) {
            unsigned long long off = (rand[j * k + i] % (bytes / size)) * size;
            for (unsigned long long b = 0; b < size; ++b) G.srcs[m++] = mapped + off + b;
        }
    }
    if (m) {
        unsigned threads = 256, blocks = (unsigned)((m + threads - 1) / threads);
        unsigned long long srcs = (unsigned long long)G.srcs, dst = (unsigned long long)G.dst, count = (unsigned long long)m;
        void *args[] = {&srcs, &dst, &count};
        int r = G.launch(G.kernel, blocks, 1, 1, threads, 1, 1, 0, G.stream, args, 0);
        if (!r && (r = wait_stream(G.stream, deadline)) == -1) return -1;
        if (r) { *err = r; return -8; }
        memcpy(got, G.dst, (size_t)m);
    }
    return m;
}
static long long read_host(int pid, const unsigned char *t, long long outputs, const unsigned long long *rand,
                           long long nrand, long long k, char *got, long long got_cap, long long *err) {
    long long at = 0;
    struct iovec local[256], remote[256];
    for (long long j = 0; j < outputs; ++j) {
        unsigned long long f[4];
        entry(t, j, f);
        unsigned long long addr = f[0], bytes = f[1], size = f[2];
        if (size == 0 || size > 16 || (size & (size - 1)) || bytes % size) return -6;
        if (bytes == 0) continue;
        if ((j + 1) * k > nrand || at + k * (long long)size > got_cap) return -6;
        for (long long i = 0; i < k; i += 256) {
            int batch = (int)(k - i < 256 ? k - i : 256);
            for (int q = 0; q < batch; ++q) {
                local[q].iov_base = got + at + q * (long long)size;
                remote[q].iov_base = (void *)(addr + (rand[j * k + i + q] % (bytes / size)) * size);
                local[q].iov_len = remote[q].iov_len = size;
            }
            long long want = batch * (long long)size, r = process_vm_readv(pid, local, batch, remote, batch, 0);
            if (r != want) { *err = r < 0 ? errno : 0; return -7; }
            at += want;
        }
    }
    return at;
}
long long read_outputs(int where, int who, const char *reply, long long len, const unsigned long long *rand,
                       long long nrand, long long k, char *got, long long got_cap, long long deadline, long long *err) {
    unsigned long long n = 0, total = 0;
    for (int i = 7; i >= 0; --i) { n = n << 8 | (unsigned char)reply[i]; total = total << 8 | (unsigned char)reply[8 + i]; }
    if (16 + n + total != (unsigned long long)len || total % ENTRY) return -6;
    const unsigned char *t = (const unsigned char *)reply + 16 + n;
    long long outputs = (long long)(total / ENTRY);
    if (where == 1)
        return read_host(who, t, outputs, rand, nrand, k, got, got_cap, err);
    pthread_mutex_lock(&lock);  /* the context is this thread's while it reads, and is taken off it again */
    void *was;
    long long r = -9;
    if (G.launch && (r = G.push(G.ctx)) != 0) { *err = r; r = -8; }
    else if (G.launch) {
        r = read_device(who, t, outputs, rand, nrand, k, got, got_cap, deadline, err);
        G.pop(&was);
    }
    pthread_mutex_unlock(&lock);
    return r;
}
/* The timed runs' inputs, written by this process just before each run's clock starts, so that no child holds a
   run's input before its run: n ranges src[i] -> dst[i] of len[i] bytes. where 1: from our host memory into process
   `who` (process_vm_writev: nothing outside that process can be written; the addresses are its buffers' as it
   listed them); 2: device copies, in the helper's context, from its own copies of the set into buffers it allocated
   itself and exported to the child (gpu_alloc): no address the child named is ever written to. Returns 0; -7 a
   write refused (*err: errno); -8 a copy failed (*err: its CUresult); -1 not done by the deadline; -9 no helper. */
long long write_inputs(int where, int who, const unsigned long long *dst, const unsigned long long *src,
                       const unsigned long long *len, long long n, long long gen, long long deadline, long long *err) {
    if (where == 1) {
        for (long long i = 0; i < n; ++i)  /* one range at a time, in pieces of 8 MiB, the deadline between them */
            for (unsigned long long at = 0; at < len[i]; ) {
                if (now_ns() > deadline) return -1;
                unsigned long long piece = len[i] - at < (8ULL << 20) ? len[i] - at : (8ULL << 20);
                struct iovec local = {(void *)(src[i] + at), piece}, remote = {(void *)(dst[i] + at), piece};
                long long r = process_vm_writev(who, &local, 1, &remote, 1, 0);
                if (r <= 0) { *err = r < 0 ? errno : 0; return -7; }
                at += (unsigned long long)r;
            }
        return 0;
    }
    pthread_mutex_lock(&copy_lock);
    void *was;
    long long r = -9;
    if (G.copy && gen != generation) r = -12;
    else if (G.copy && (r = G.push(G.ctx)) != 0) { *err = r; r = -8; }
    else if (G.copy) {
        int c = 0;
        for (long long i = 0; i < n && !c; ++i) if (len[i]) c = G.copy(dst[i], src[i], len[i], G.cstream);
        if (!c) c = wait_stream(G.cstream, deadline);
        r = c == -1 ? -1 : c ? (*err = c, -8) : 0;
        G.pop(&was);
    }
    pthread_mutex_unlock(&copy_lock);
    return r;
}
/* Device memory of the helper's own (its context): gpu_alloc makes n bytes and, with `handle`, exports them (a CUDA
   IPC handle the child opens), and says the helper's generation (*gen); gpu_copy_in copies a trusted child's tensor
   (an entry as a run reply lists it) into such memory, through a mapping opened and closed at once; gpu_free frees.
   Each returns 0 or a CUresult; -9 no helper; -12 memory of an older generation (the context it was in is gone);
   -6 an entry outside its allocation or larger than dst_len; -1 a copy not done by the deadline. */
long long gpu_alloc(unsigned long long n, unsigned long long *ptr, char *handle, long long *gen) {
    pthread_mutex_lock(&copy_lock);
    void *was;
    long long r = -9;
    if (G.alloc && !(r = G.push(G.ctx))) {
        r = G.alloc(ptr, n);
        if (!r && handle && (r = G.export((Handle *)handle, *ptr))) G.free(*ptr);
        *gen = generation;
        G.pop(&was);
    }
    pthread_mutex_unlock(&copy_lock);
    return r;
}
long long gpu_copy_in(const char *e, unsigned long long dst, unsigned long long dst_len, long long gen,
                      long long deadline) {
    pthread_mutex_lock(&copy_lock);
    void *was;
    long long r = -9;
    if (G.alloc && gen != generation) r = -12;
    else if (G.alloc && !(r = G.push(G.ctx))) {
        unsigned long long f[4], mapped = 0, base = 0;
        size_t extent = 0;
        entry((const unsigned char *)e, 0, f);
        if (!(r = G.open(&mapped, *(const Handle *)(e + 32), 1))) {
            if (!(r = G.range(&base, &extent, mapped))) {
                if (f[0] < f[3] || f[0] - f[3] > extent || f[1] > extent - (f[0] - f[3]) || f[1] > dst_len) r = -6;
                else if (f[1] && !(r = G.copy(dst, mapped + (f[0] - f[3]), f[1], G.cstream)))
                    r = wait_stream(G.cstream, deadline);
            }
            if (r != -1) G.close(mapped);  /* (a copy still running keeps its mapping: the caller drops the context) */
        }
        G.pop(&was);
    }
    pthread_mutex_unlock(&copy_lock);
    return r;
}
long long gpu_free(unsigned long long ptr, long long gen) {
    pthread_mutex_lock(&copy_lock);
    void *was;
    long long r = -9;
    if (G.free && gen != generation) r = -12;
    else if (G.free && !(r = G.push(G.ctx))) { r = G.free(ptr); G.pop(&was); }
    pthread_mutex_unlock(&copy_lock);
    return r;
}
/* A timed run: with nw > 0, first its inputs written (write_inputs; wwhere: how), just before the clock starts; then
   the run command and its reply (into buf1), then one of: nothing (sample NULL, where 0: an audited run); the sample
   command and its reply (into buf2); or (where 1, 2) the parent's own reads of the child's outputs (read_outputs,
   into buf2). Returns the ns from before the run command's first byte to after the last byte; or a code of
   read_msg's, write_all's, read_outputs' or write_inputs' (its -7 as -10), each command having timeout_ns to be
   written and answered. lens[0], lens[1]: the reply's and the sample's lengths (or what read_msg put in *need;
   errno after -7 or -10); lens[0] is 0 until the run's reply has been read. wgen: the inputs' memory's generation
   (gpu_alloc). cont: ncont processes continued (SIGCONT) as the clock starts, whatever the write's result. */
long long timed_pair(int cmd_fd, int rep_fd, const char *run, long long run_len, const char *sample,
                     long long sample_len, char *buf1, long long cap1, char *buf2, long long cap2,
                     long long spin_run, long long spin_sample, long long timeout_ns, long long *lens,
                     int where, int who, const unsigned long long *rand, long long nrand, long long k,
                     int wwhere, const unsigned long long *wdst, const unsigned long long *wsrc,
                     const unsigned long long *wlen, long long nw, long long wgen, const int *cont,
                     long long ncont) {
    long long r = nw ? write_inputs(wwhere, who, wdst, wsrc, wlen, nw, wgen, now_ns() + timeout_ns, &lens[1]) : 0;
    long long t0 = now_ns();
    for (long long i = 0; i < ncont; ++i) kill(cont[i], SIGCONT);  /* (stopped for the write: stop_processes) */
    if (r) return r == -7 ? -10 : r;  /* (-10: the write refused, told apart from a read's -7) */
    long long w = write_all(cmd_fd, run, run_len, t0 + timeout_ns);
    if (w) return w;
    long long a = read_msg(rep_fd, buf1, cap1, spin_run, t0 + timeout_ns, &lens[0]);
    if (a < 0) return a;
    lens[0] = a;
    if (where) {
        long long b = read_outputs(where, who, buf1, a, rand, nrand, k, buf2, cap2, now_ns() + timeout_ns, &lens[1]);
        if (b < 0) return b;
        lens[1] = b;
        return now_ns() - t0;
    }
    if (!sample) return now_ns() - t0;  /* an audited run: its output is read in full, untimed, by the caller */
    long long t1 = now_ns();
    if ((w = write_all(cmd_fd, sample, sample_len, t1 + timeout_ns))) return w;
    long long b = read_msg(rep_fd, buf2, cap2, spin_sample, t1 + timeout_ns, &lens[1]);
    if (b < 0) return b;
    lens[1] = b;
    return now_ns() - t0;
}
"""
_native = []  # [the loaded helper, or None where it could not be built]
_native_lock = threading.Lock()


def native():
    """The timed_pair helper (ctypes.CDLL: each call releases the interpreter's lock), or None without a compiler."""
    with _native_lock:
        if not _native:
            import subprocess
            import tempfile
            lib = None
            cc = next((c for c in ("/usr/bin/cc", "/usr/bin/gcc", "/usr/local/bin/cc") if os.access(c, os.X_OK)), None)
            with tempfile.TemporaryDirectory(prefix="cam-clock-") as d:  # (mode 0700; removed once loaded)
                src, so = Path(d) / "timed_pair.c", Path(d) / "timed_pair.so"
                src.write_text(TIMED_PAIR_C)
                try:
                    if cc is None:  # (by absolute path: a PATH entry is not something to trust here)
                        raise OSError("no C compiler in /usr/bin or /usr/local/bin")
                    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(so), str(src)], check=True,
                                   capture_output=True)
                    lib = ctypes.CDLL(str(so))
                except (OSError, subprocess.CalledProcessError) as e:
                    print(f"protocol.py: no native clock ({e}): timed runs read the clock in Python, where the "
                          "trainer's other threads can delay it", file=sys.stderr)
            if lib is not None:
                ll, p = ctypes.c_longlong, ctypes.c_char_p
                lib.timed_pair.restype = ll
                u64s, i = ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int
                lib.timed_pair.argtypes = [i, i, p, ll, p, ll, ctypes.c_void_p, ll, ctypes.c_void_p, ll, ll, ll, ll,
                                           ctypes.POINTER(ll), i, i, u64s, ll, ll, i, u64s, u64s, u64s, ll, ll,
                                           ctypes.POINTER(i), ll]
                lib.read_outputs.restype = ll
                lib.read_outputs.argtypes = [i, i, p, ll, u64s, ll, ll, ctypes.c_void_p, ll, ll, ctypes.POINTER(ll)]
                lib.gpu_setup.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_void_p] * 6 + [ll]
                lib.gpu_forget.argtypes = [i]
                lib.write_inputs.restype = lib.gpu_alloc.restype = lib.gpu_copy_in.restype = lib.gpu_free.restype = ll
                lib.write_inputs.argtypes = [i, i, u64s, u64s, u64s, ll, ll, ll, ctypes.POINTER(ll)]
                lib.gpu_alloc.argtypes = [ctypes.c_ulonglong, u64s, ctypes.c_void_p, ctypes.POINTER(ll)]
                lib.gpu_copy_in.argtypes = [p, ctypes.c_ulonglong, ctypes.c_ulonglong, ll, ll]
                lib.gpu_free.argtypes = [ctypes.c_ulonglong, ll]
            _native.append(lib)
        return _native[0]


def staged_pieces(v: torch.Tensor):
    """A GPU tensor's bytes as memoryviews of at most STAGE_BYTES, each copied out through the staging buffer (valid
    until the next piece is asked for)."""
    stage = _staging()
    for i in range(0, v.numel(), STAGE_BYTES):
        part = v[i:i + STAGE_BYTES]
        stage[:part.numel()].copy_(part)  # (synchronous: the copy waits for the work that made the output)
        yield memoryview(stage[:part.numel()].numpy())


def send(fd: int, obj, blobs=(), re: str | None = None, deadline: float | None = None):
    """One message: 8 bytes of header length, 8 of the blobs' total length, the JSON header, the raw blobs. `re`: the
    nonce of the command it answers; `deadline`: see _write_all.
    Blobs (bytes, arrays, or uint8 tensors on a GPU, as pack makes them) are written from their own memory: a GB-sized
    output is never copied whole to be sent; one on a GPU is copied out piece by piece through the staging buffer."""
    views = [b if isinstance(b, torch.Tensor) else memoryview(b).cast("B") for b in blobs]
    frame = _frame(obj, [v.numel() if isinstance(v, torch.Tensor) else v.nbytes for v in views], re)
    if all(isinstance(v, memoryview) for v in views) and sum(v.nbytes for v in views) <= ONE_WRITE:
        # a small message (a run's reply and its list of outputs) in one write: one wake-up of its reader, not two
        frame, views = b"".join([frame, *views]), []
    _write_all(fd, memoryview(frame), deadline)
    for v in views:
        if not isinstance(v, torch.Tensor):
            _write_all(fd, v, deadline)
            continue
        try:
            for piece in staged_pieces(v):
                _write_all(fd, piece)
        except BaseException:  # noqa: BLE001 - a device error half-way through a message: its framing is lost
            os._exit(3)


ONE_WRITE = 1 << 16  # blobs up to this size go out with their message's header, in one write
PREFIX = 16  # a message's first bytes: its header's length and its blobs' total, so a reader knows its whole size


def _frame(obj, sizes=(), re: str | None = None) -> bytes:
    """A message up to its blobs (a command is only this)."""
    head = json.dumps({"obj": obj, "sizes": list(sizes), "re": re}).encode()
    return len(head).to_bytes(8, "little") + sum(sizes).to_bytes(8, "little") + head


def _lengths(prefix: bytes, limit: int) -> tuple[int, int]:
    n, total = int.from_bytes(prefix[:8], "little"), int.from_bytes(prefix[8:PREFIX], "little")
    if not 0 < n < 1 << 20:
        raise ValueError(f"malformed message header ({n} bytes)")
    if total > limit:
        raise ReplyTooLarge(total, limit)
    return n, total


def _head(raw, total: int, expect: str | None):
    """The checked header of a message: (obj, sizes)."""
    try:
        head = json.loads(raw)
    except RecursionError as e:
        raise ValueError("malformed message header (nested too deeply)") from e
    if expect is not None and (not isinstance(head, dict) or head.get("re") != expect):
        raise ValueError("a reply that answers no command of the parent's (written by something other than the "
                         "harness, or out of step)")
    sizes = head.get("sizes", []) if isinstance(head, dict) else None
    if not isinstance(sizes, list) or not all(isinstance(s, int) and 0 <= s for s in sizes) or sum(sizes) != total:
        raise ValueError("malformed message sizes")
    return head.get("obj"), sizes


def _read_exact(fd: int, n: int, alive=None, into=bytearray, deadline: float | None = None):
    """n bytes into a new buffer: a bytearray, or with into=torch.uint8 a tensor that unpack() views as is (no
    chunk list, no join, no zero-filling of GBs), or into a given uint8 tensor of n elements. PastDeadline once
    `deadline` (time.monotonic()) has passed, checked before every read: a child that trickles a byte every 0.2 s is
    never quiet for long. alive() is asked only while the pipe is quiet: a child that wrote its last reply and ended
    is still read. Any other EOFError is an end: the pipe closed, or the child's thread returned."""
    if isinstance(into, torch.Tensor):
        buf = into
    else:
        buf = torch.empty(n, dtype=torch.uint8) if into is torch.uint8 else bytearray(n)
    view, got = memoryview(buf.numpy() if isinstance(buf, torch.Tensor) else buf).cast("B"), 0
    while got < n:
        if deadline is not None and time.monotonic() > deadline:
            raise PastDeadline("the child is past its deadline")
        while alive is not None and not select.select([fd], [], [], 0.5)[0]:
            if deadline is not None and time.monotonic() > deadline:
                raise PastDeadline("the child is past its deadline")
            if not alive():
                raise EOFError("the child process ended")  # (something it left behind may still hold the pipe)
        k = os.readv(fd, [view[got:got + (1 << 24)]])
        if not k:
            raise EOFError("the other side closed the pipe")
        got += k
    return buf


class PastDeadline(EOFError):
    """A read (or a command's write) that found the deadline passed. Only this is a timeout: the pipe's end is a
    death, however early."""


class ReplyTooLarge(ValueError):
    """A reply that declares more bytes than the reader allows (for a candidate: an output of the wrong shape)."""

    def __init__(self, nbytes: int, limit: int):
        super().__init__(f"a reply of {nbytes} bytes, over the {limit} allowed")
        self.nbytes, self.limit = nbytes, limit


BLOB_ALIGN = 64  # where each blob starts in a reused buffer: a multiple of every dtype's size, as a fresh one is


def recv(fd: int, limit: int = 1 << 34, alive=None, expect: str | None = None, deadline: float | None = None,
         into=None, spin_s: float = 0.0):
    """(obj, blobs) of the next message. expect: the nonce of the command this must answer (ValueError otherwise);
    deadline: see _read_exact. into(nbytes) -> a uint8 tensor of at least nbytes, or None: the blobs are read into
    that memory (each at a multiple of BLOB_ALIGN) instead of fresh buffers, and are views of it, holding exactly
    the bytes this message brought. spin_s: poll that long for the message's start before sleeping (see spin)."""
    spin(fd, spin_s)
    n, total = _lengths(_read_exact(fd, PREFIX, alive, deadline=deadline), limit)
    obj, sizes = _head(_read_exact(fd, n, alive, deadline=deadline), total, expect)
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // BLOB_ALIGN) * BLOB_ALIGN)
    buf = into(starts[-1]) if into is not None and starts[-1] else None
    if buf is None:
        return obj, [_read_exact(fd, size, alive, into=torch.uint8, deadline=deadline) for size in sizes]
    blobs = [buf[at:at + size] for at, size in zip(starts, sizes)]
    for blob in blobs:
        _read_exact(fd, blob.numel(), alive, into=blob, deadline=deadline)
    return obj, blobs


def parse(msg: bytes, limit: int, expect: str | None = None):
    """(obj, blobs) of one whole message held in memory (what timed_pair read), checked as recv checks it."""
    if len(msg) < PREFIX:
        raise ValueError("malformed message (shorter than its prefix)")
    n, total = _lengths(msg[:PREFIX], limit)
    if len(msg) != PREFIX + n + total:
        raise ValueError("malformed message (its length is not what its prefix says)")
    obj, sizes = _head(msg[PREFIX:PREFIX + n], total, expect)
    blobs, at = [], PREFIX + n
    for size in sizes:
        blobs.append(torch.frombuffer(bytearray(msg[at:at + size]), dtype=torch.uint8) if size else
                     torch.empty(0, dtype=torch.uint8))
        at += size
    return obj, blobs


def seed_pad(key: str, nonce: str) -> int:
    """What a "load" command's seed is XORed with: only the harness, which read `key` from its spec file, undoes it. A
    kernel that took the protocol over (it can write to the pipes, and at import it need echo no nonce it has not read)
    could otherwise rebuild every input set from its seed with torch's public generator."""
    return int.from_bytes(hashlib.blake2b(nonce.encode(), key=bytes.fromhex(key), digest_size=4).digest(), "little")


def pack(out, blobs: list, item=None):
    """A nested output as JSON-able structure + raw tensor bytes (no pickle crosses the boundary); with `item`, what
    item(tensor) makes instead of each tensor's bytes (layout)."""
    if isinstance(out, torch.Tensor):
        t = out.detach().contiguous()
        if item is not None:
            blobs.append(item(t))
        else:  # its own memory, sent as is (a GPU tensor is copied out by send, in pieces)
            flat = t.reshape(-1).view(torch.uint8)
            blobs.append(b"" if not t.numel() else flat if t.device.type == "cuda" else flat.cpu().numpy())
        return {"t": len(blobs) - 1, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if isinstance(out, (tuple, list)):
        return {"seq": [pack(o, blobs, item) for o in out], "tuple": isinstance(out, tuple)}
    if out is None or isinstance(out, (bool, int, float)):
        return {"v": out}
    raise TypeError(f"outputs must be tensors (or tuples of them), not {type(out).__name__}")


def contiguous(out):
    """`out` with every tensor contiguous (a copy where it is not): its elements are where its address and size say."""
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    if isinstance(out, (tuple, list)):
        return type(out)(contiguous(o) for o in out)
    return out


def layout(out, table: list):
    """pack's structure of a contiguous `out` without its bytes; `table` receives each tensor's entry (output_entry),
    which the parent reads its elements by."""
    return pack(out, table, output_entry)


def unpack(obj, blobs: list, depth: int = 0, used: set | None = None):
    """The inverse of pack, validating every field: a malformed reply raises ValueError. Each blob makes one tensor
    (as pack writes them): a reply cannot ask for more memory than it sent."""
    used = set() if used is None else used
    if not isinstance(obj, dict) or depth > 8:
        raise ValueError("malformed output")
    if "t" in obj:
        if not isinstance(obj["t"], int) or obj["t"] in used:
            raise ValueError("malformed tensor in output (two tensors of one reply name the same bytes?)")
        used.add(obj["t"])
        dtype = getattr(torch, str(obj.get("dtype")), None)
        shape = obj.get("shape")
        if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError("malformed tensor in output")
        raw = blobs[obj["t"]] if isinstance(obj["t"], int) and 0 <= obj["t"] < len(blobs) else None
        if isinstance(raw, (bytes, bytearray)):
            raw = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        n = math.prod(shape)
        if raw is None or raw.numel() != n * torch.empty((), dtype=dtype).element_size():
            raise ValueError("tensor bytes do not match the declared shape")
        try:  # (a zero-size shape whose strides overflow, say (0, 2**62, 4), exists in a child, not here)
            return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
        except (RuntimeError, OverflowError) as e:
            raise ValueError(f"malformed tensor in output ({e})") from None
    if "seq" in obj and isinstance(obj["seq"], list):
        seq = [unpack(o, blobs, depth + 1, used) for o in obj["seq"]]
        return tuple(seq) if obj.get("tuple") else seq
    if "v" in obj and (obj["v"] is None or isinstance(obj["v"], (bool, int, float))):
        return obj["v"]
    raise ValueError("malformed output")


def sample_of(out, offset: int):
    """out[offset % step :: step] of every output tensor, step = numel // SAMPLE (all of a small one)."""
    if isinstance(out, torch.Tensor):
        flat = out.detach().reshape(-1)
        step = max(1, flat.numel() // SAMPLE)
        return flat[offset % step::step]
    if isinstance(out, (tuple, list)):
        return type(out)(sample_of(o, offset) for o in out)
    return out


def _tensors_only(ext, changed: list):
    """The module model_new.py imports as cuda_extension: the extension's functions, each of which is handed only
    plain arguments (_plain), may return only tensors (or None, or sequences of them), and leaves the thread's
    dispatch state as it found it (_kept_state). A
    kernel that hands values to Python as numbers or lists (a std::vector<double> becomes a list) would let Python
    compute on them, out of the dispatch monitor's sight."""

    def wrap(name, f):
        def call(*args, **kwargs):
            try:
                args, kwargs = _plain(args), {k: _plain(v) for k, v in kwargs.items()}
            except TypeError as e:
                raise TypeError(f"cuda_extension.{name} takes tensors, numbers, None and lists or tuples of "
                                f"them, not {e}") from None
            with _kept_state(changed, f"cuda_extension.{name}"):
                out = f(*args, **kwargs)
            if not _only_tensors(out):
                raise TypeError(f"cuda_extension.{name} returned {type(out).__name__}: a kernel function returns tensors "
                                "(or None); values handed to Python would be computed on outside the kernels")
            return out
        return call
    shim = types.ModuleType("cuda_extension")
    for name in dir(ext):
        if not name.startswith("_") and callable(getattr(ext, name)):
            setattr(shim, name, wrap(name, getattr(ext, name)))
    return shim


def _dispatch_state():
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


def _same_state(changed: list, what: str, state) -> bool:
    """Whether the thread's dispatch key state is `state`. The dispatch monitor is a Python dispatch mode: an operator
    reaches it through the Python keys of that state, and native code that leaves them excluded (a guard it never
    destroys: the guard's class is one PyTorch's own inline code imports) hides every PyTorch operator run after
    it. A change is recorded in `changed`, which fails the verdict, and put back key by key (as far as the per-key
    setters reach: the verdict fails either way)."""
    if _dispatch_state() == state:
        return True
    changed.append(what)
    for k in torch._C.DispatchKey.__members__.values():
        torch._C._dispatch_tls_set_dispatch_key_included(k, state[0].has(k))
        torch._C._dispatch_tls_set_dispatch_key_excluded(k, state[1].has(k))
    return False


@contextlib.contextmanager
def _kept_state(changed: list, what: str):
    """Native code run inside (the extension's loading, one of its calls, ModelNew's building, one forward) must
    leave the thread's dispatch key state as it found it (_same_state)."""
    before = _dispatch_state()
    try:
        yield
    finally:
        if not _same_state(changed, what, before):
            raise RuntimeError(f"{what} changed PyTorch's dispatch state; a kernel leaves it as it found it")


def _tensor_text(t, *args, **kwargs):
    """A tensor's text in the candidate's child: its shape, dtype and device, never its values (torch._tensor_str
    formats them with the dispatch modes turned off). Error messages that show arguments (pybind11's "incompatible
    function arguments") still say what was passed."""
    return f"tensor(<values hidden>, shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"


def _plain(a, depth=0):
    """What a kernel function may be handed: tensors, numbers, None, and tuples of them (a list or a torch.Size
    becomes a fresh tuple, which native code cannot write values into for Python to read; nor a string, whose buffer
    the C API hands out). Any other Python object is something native code could call (a function or bound method:
    Python that computes where the monitor does not look, on an OpenMP worker or inside a guard that excludes its
    keys) or read attributes of."""
    if a is None or type(a) in (bool, int, float) or isinstance(a, torch.Tensor):
        return a
    if isinstance(a, (tuple, list)) and type(a) in (tuple, list, torch.Size) and depth < 4:
        return tuple(_plain(x, depth + 1) for x in a)
    raise TypeError(f"{type(a).__name__}")


def _only_tensors(out, depth=0) -> bool:
    if out is None or isinstance(out, torch.Tensor):
        return True
    return isinstance(out, (tuple, list)) and depth < 4 and all(_only_tensors(o, depth + 1) for o in out)


def draw_inputs(ref, seed: int, device: torch.device) -> list:
    """The task's get_inputs() for `seed`, on `device`: drawn there (torch's factory functions default to it), as
    torch.randn of 537M floats takes seconds on one CPU core and a millisecond on an H200, and a verdict of a large
    task draws a dozen sets in each child. The same seed gives the same values in every child on the device. A
    get_inputs that cannot run that way (a CPU generator of its own, say) is drawn on the CPU and copied. Running out
    of device memory is an error, not a reason to draw on the CPU: another child would draw other values."""
    for where in dict.fromkeys([device, torch.device("cpu")]):
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            with where:
                xs = ref.get_inputs()
        except torch.OutOfMemoryError:
            raise
        except Exception:  # noqa: BLE001 - the CPU, below, says what is wrong with get_inputs()
            if where.type == "cpu":
                raise
            continue
        return [x.to(device) if isinstance(x, torch.Tensor) else x for x in xs]


class _DeviceBytes:
    """n bytes of device memory at ptr, as the CUDA array interface describes them: torch.as_tensor views them."""
    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def input_buffers(structure, handles, device: torch.device):
    """A child's input buffers for the timed runs, made from pack's structure of one input set (its values as they
    are): on a GPU each tensor is memory of the parent's native helper, opened from the CUDA IPC handle it sent
    (handles[t]); elsewhere memory of the child's own, whose addresses its reply lists (layout). TimedInputs writes
    each run's input there. Tensors are contiguous (a get_inputs() that gives strided tensors is timed on
    contiguous copies of them)."""
    def make(o):
        if "t" in o:
            dtype, shape = getattr(torch, o["dtype"]), o["shape"]
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if handles is None or not n:
                return torch.empty(shape, dtype=dtype, device=device)
            cu, ptr = _cuda_driver(), ctypes.c_uint64()
            cu.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
            h = _IpcHandle()  # (its bytes copied in whole: a c_char array assigned from bytes stops at a NUL)
            ctypes.memmove(ctypes.byref(h), bytes.fromhex(handles[o["t"]]).ljust(64, b"\0")[:64], 64)
            r = cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, 1)
            if r:
                raise RuntimeError(f"the parent's input buffer could not be opened (CUDA error {r})")
            return torch.as_tensor(_DeviceBytes(ptr.value, n), device=device).view(dtype).view(shape)
        if "seq" in o:
            seq = [make(x) for x in o["seq"]]
            return tuple(seq) if o.get("tuple") else seq
        return o["v"]
    return make(structure)


def tensors_of(out) -> list:
    """The tensors of a nested output (or input set), in pack's order."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in tensors_of(o)] if isinstance(out, (tuple, list)) else []


def _unaliased(out, ranges):
    """`out` with each tensor whose memory lies in one of `ranges` (address, bytes) cloned."""
    if isinstance(out, torch.Tensor):
        at = out.data_ptr()
        return out.clone() if any(a <= at < a + n for a, n in ranges) else out
    if isinstance(out, (tuple, list)):
        return type(out)(_unaliased(o, ranges) for o in out)
    return out


def _child_main(spec_path: str):
    """A sandboxed child: mode "reference" (trusted task code; computes outputs and serves baseline runs) or
    "candidate" (loads ModelNew under the dispatch monitor and serves runs). Both obey the parent's commands."""
    spec = json.loads(Path(spec_path).read_text())
    cmd_fd, rep_fd = spec["cmd_fd"], spec["rep_fd"]
    device = torch.device("cuda" if spec["backend"] == "cuda" else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))  # CHILD_ENV, from the parent
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if device.type == "cuda" else None  # > 2x the L2

    def load(path, name):
        s = importlib.util.spec_from_file_location(name, path)
        m = importlib.util.module_from_spec(s)
        sys.modules[name] = m
        s.loader.exec_module(m)
        return m

    sets = {}  # seed -> input set, built when the parent first asks for it

    def inputs_for(seed):
        if seed not in sets:
            sets[seed] = draw_inputs(ref, seed, device)
        return sets[seed]

    ref = load(spec["reference"], "reference_model")
    init = ref.get_init_inputs()
    torch.manual_seed(spec["seed0"])
    model = ref.Model(*init).to(device).eval()

    bad = []  # aten ops outside the allow-list seen by the candidate's monitor
    changed = []  # native code that changed the dispatch state the monitor depends on (_kept_state)
    if spec["mode"] == "reference":
        seeds, n_checks = spec["seeds"], spec["n_checks"]
        per_set = sum(x.numel() * x.element_size() for x in inputs_for(seeds[0]) if isinstance(x, torch.Tensor)) + 1
        n_sets = int(max(2, min(len(seeds) - n_checks, spec["budget_mb"] * 2**20 // per_set))) if len(seeds) > n_checks else 0
        # distinct fresh input sets for timing, within the memory budget; and where the key's bytes are, for the
        # parent's one read that says whether it may read its children's memory here (reads())
        key = bytes.fromhex(spec["key"])
        probe = torch.frombuffer(bytearray(key), dtype=torch.uint8).to(device)
        send(rep_fd, {"timed_sets": n_sets, "probe": output_entry(probe).hex()})
        with torch.no_grad():  # every output the parent will compare against, before any candidate run
            for seed in seeds[:n_checks + n_sets] if spec.get("outputs", True) else []:  # (none: a baselines' child)
                blobs = []  # (on copies: a Model that changes its inputs in place leaves the sets as drawn, for "set")
                send(rep_fd, pack(model(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs_for(seed)]),
                                  blobs), blobs)
        fns = {"eager": model}
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model

        class OpMonitor(TorchDispatchMode):
            """Records every aten op outside `allowed` (from Python or C++ on this thread)."""
            def __init__(self, allowed):
                super().__init__()
                self.allowed = allowed

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name not in self.allowed and name not in bad:
                    bad.append(name)
                return func(*args, **(kwargs or {}))

        sys.path[:0] = [spec["ext_dir"], spec["cand_dir"]]
        # A tensor's text is made with the dispatch modes turned off (torch._tensor_str), so str(t), f"{t}" and
        # "%s" % t would hand its values to Python unseen, to compute on there: in this child they show no values.
        torch._tensor_str._str = _tensor_text
        try:
            with torch.no_grad(), OpMonitor(INIT_OPS), \
                    _kept_state(changed, "model_new.py's loading or ModelNew's construction"):  # (and native code
                # run meanwhile: a storage's deleter, when a tensor is dropped, runs the extension's code outside its calls)
                sys.modules["cuda_extension"] = _tensors_only(importlib.import_module("cuda_extension"), changed)
                cand_mod = load(spec["model_new"], "model_new")
                torch.manual_seed(spec["seed0"])
                cand = cand_mod.ModelNew(*init)
                missing, unexpected = cand.load_state_dict(state, strict=False)
                cand = cand.to(device).eval()
        except BaseException as e:  # noqa: BLE001  - the candidate's problem, reported to it
            send(rep_fd, {"error": f"model_new.py failed to load: {type(e).__name__}: {str(e)[:500]}"})
            os._exit(0)
        if missing or unexpected:
            send(rep_fd, {"error": f"ModelNew's parameters differ from Model's (missing {list(missing)[:5]}, "
                                   f"unexpected {list(unexpected)[:5]}): keep the same constructor and parameter names"})
            os._exit(0)
        monitor = OpMonitor(ALLOWED_OPS)

        base = _dispatch_state()  # (as every run starts: native code may also run between runs, e.g. a storage's
        # deleter when the harness drops the last run's output)

        def watched(*x):
            _same_state(changed, "native code between two runs", base)
            with monitor, _kept_state(changed, "ModelNew.forward"):  # (the extension's code run outside its calls)
                return cand(*x)

        fns = {"candidate": watched}
        send(rep_fd, {"ready": True, "init_ops": list(bad), "state": list(changed)})
        bad.clear()

    buffers, out, loaded, fn, spin_s, imported, held = None, None, None, None, spec["spin_s"], [], None
    written = False  # whether the parent writes the inputs ("buffers"): then no "load" is what they are compared with
    while True:  # serve the parent's commands until it says exit (or closes the pipe)
        try:
            cmd, _ = recv(cmd_fd, spin_s=spin_s)
        except (EOFError, ValueError):
            os._exit(0)
        nonce = cmd.get("nonce") if isinstance(cmd, dict) else None  # every reply echoes its command's nonce
        try:
            op = cmd["op"]
            reply, blobs = {"ok": True}, []
            spin_s = spec["spin_s"] if op != "run" or cmd.get("spin", True) else 0.0  # (run_command)
            if op == "exit":
                os._exit(0)
            elif op == "use":
                if cmd["fn"] == "compile" and "compile" not in fns:  # compiled at its first run, then kept
                    fns["compile"] = torch.compile(fns["eager"])
                fn = fns[cmd["fn"]]
            elif op == "set" and spec["mode"] == "reference":  # one timed input set, for the parent to hold
                xs = inputs_for(cmd["seed"] ^ seed_pad(spec["key"], nonce))  # (TimedInputs.take)
                if device.type == "cuda":  # (where it is: the parent copies it from here through CUDA IPC, before
                    table, held = [], contiguous(xs)  # its next command: `held` lives until then)
                    reply, blobs = {"ok": True, "out": layout(held, table)}, [b"".join(table)]
                    sync()
                else:
                    reply = {"ok": True, "out": pack(xs, blobs)}
            elif op == "buffers":  # where the parent writes each timed run's input (TimedInputs.attach)
                buffers, loaded, written = input_buffers(cmd["inputs"], cmd.get("handles"), device), None, True
                imported = [(b.data_ptr(), b.numel() * b.element_size()) for b in tensors_of(buffers)] \
                    if cmd.get("handles") else []
                table = []
                reply, blobs = {"ok": True, "out": layout(buffers, table)}, [b"".join(table)]
            elif op == "flush":  # (before the parent writes a timed run's input: TimedInputs)
                if flush is not None:
                    flush.zero_()
                sync()
            elif op == "load":
                loaded = inputs_for(cmd["seed"] ^ seed_pad(spec["key"], nonce))
                if buffers is None:
                    buffers = [x.clone() if isinstance(x, torch.Tensor) else x for x in loaded]
                for b, x in zip(buffers, loaded):
                    if isinstance(b, torch.Tensor):
                        b.copy_(x)
                if written:  # (a warm-up's input, in the parent's buffers: its writes follow)
                    loaded = None
                if flush is not None:
                    flush.zero_()
                sync()
            elif op == "run":
                with torch.no_grad():
                    out = contiguous(fn(*buffers))
                    if imported:  # an output in the parent's memory (a view of an input) cannot be exported to it
                        out = _unaliased(out, imported)
                sync()
                table = []
                reply = {"ok": True, "out": layout(out, table)}
                blobs = [b"".join(table)]
            elif op == "sample":
                reply = pack(sample_of(out, cmd["offset"]), blobs)
                sync()
            elif op == "full":
                if spec["mode"] != "reference":
                    _same_state(changed, "native code after the last run", base)
                outs = out if isinstance(out, (tuple, list)) else [out]
                reply = {"out": pack(out, blobs), "ops": list(bad), "state": list(changed),
                         "mutated": loaded is not None and any(isinstance(b, torch.Tensor) and not torch.equal(b, x)
                                                               for b, x in zip(buffers, loaded)),
                         "types": [type(o).__name__ for o in outs if isinstance(o, torch.Tensor) and type(o) is not torch.Tensor],
                         "devices": sorted({o.device.type for o in outs if isinstance(o, torch.Tensor)} - {device.type})}
            send(rep_fd, reply, blobs, re=nonce)
        except BaseException as e:  # noqa: BLE001
            send(rep_fd, {"error": f"{type(e).__name__}: {str(e)[:800]}"}, re=nonce)


# ----------------------------------------------------------------------------------------------
# The parent's side: children, their pipes, the clock
# ----------------------------------------------------------------------------------------------
# What every child gets, the reference (eager, torch.compile) and the candidate alike, so all three are timed under
# the same threading: one OpenMP thread per core this process may run on (a lent slice of a big host has fewer than
# os.cpu_count()) but one, which is left to the parent that drives and times the runs and to the trainer's other
# threads, and idle workers that sleep instead of spinning. A team as wide as the machine shares its cores with the
# parent: on 2 cores a 1 MiB relu timed 0.6 ms in one child and 2.5 ms in the next, by the draw (one thread:
# 0.56-0.71 ms over 8 verdicts). libgomp's default spins a worker for
# milliseconds after each parallel region: on a shared host such a worker is preempted, and the next barrier waits a
# scheduler slice for it (a 1-element `omp parallel for` took ~15 ms a run on 2 loaded cores, ~0.2 ms passive;
# eager's 1-element ops open no parallel region, so the spin fell on the candidate alone).
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # the cores we may use
CHILD_THREADS = max(1, CPUS - 1)
# glibc's allocator, one way for every block. By its defaults a freed block of >= 128 KiB raises the threshold under
# which blocks come from the heap, and the heap's free top goes back to the system, so whether a model's 16 MiB
# output costs page faults in every run (relu 1024x4096 on 2 cores: eager 12 ms against 1.7 ms) depends on what the
# child allocated and freed before (torch.compile's compile from a cold cache, or from a warm one); and a block over
# 32 MiB (the most that threshold takes) is mapped afresh on every allocation, so eager pays a new output's page
# faults every run where a candidate that keeps its output buffer pays none (relu 2048x4096 by those defaults: 14.2
# ms against 2.15, reward 3 for the same work). Here no block is mapped on its own (mmap_max=0: every size from the
# heap) and the heap keeps what is freed (the trim threshold: 2^62 bytes): a fresh block costs what a kept one does,
# after the first run. (The memory stays the child's, under its own limit.)
CHILD_ENV = {"OMP_NUM_THREADS": str(CHILD_THREADS), "OMP_WAIT_POLICY": "passive",
             "GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4611686018427387904"}
# Baselines are cached with this in their key: a change to how a timed run is driven or clocked (either side's polling,
# the clock, the messages) must not compare new candidates' times with baselines timed the old way.
TIMING_VERSION = 7
PIPE_BYTES = 1 << 20  # a pipe holds a whole sample (65536 elements of 8 bytes = 512 KiB): one write, one wake-up


# Whether this process checks timed runs by reading its children's memory (see "The run protocol"), per backend: decided
# once, on the first reference child (trusted code: a candidate could make a read fail on purpose, and must not
# thereby choose the sample exchange, whose positions it is told). Host memory is read only where nothing in a child
# can serve a page of its memory when the parent reads it: a userfaultfd handles the kernel's faults (the parent's
# reads are the kernel's) only with CAP_SYS_PTRACE, which every child drops, or where vm.unprivileged_userfaultfd is
# 1; the device node /dev/userfaultfd is left out of the sandbox's private /dev. Device memory exported through a CUDA
# IPC handle is plain device memory (managed and VMM memory cannot be exported that way).
_READS: dict = {}
DECIDING = threading.Lock()  # (env.py holds it while the first reference child is probed)
_numbers = itertools.count(1)


def reads(backend: str) -> bool:
    return _READS.get(backend, False)


def probe_reads(child: "Child", probe) -> bool:
    """Decides reads(child.backend) on a reference child, whose harness put its key's bytes where `probe` (an entry
    of a run reply's list of outputs) says, by reading them as a timed run would (and, for TimedInputs, writing them
    back on the CPU; on a GPU, making and exporting device memory of the helper's own); says once on stderr when
    the answer is no, and why."""
    from sandbox import isolation
    if child.backend in _READS:
        return _READS[child.backend]
    why, lib = None, native()
    try:
        knob = Path("/proc/sys/vm/unprivileged_userfaultfd").read_text().strip()
    except OSError:
        knob = "missing"
    iso = isolation(child.backend)
    if lib is None:
        why = "no C compiler for the native helper"
    elif child.backend == "cuda" and _gpu() is None:
        why = "no CUDA context of this process's own for the reads"
    elif child.backend == "cpu" and knob != "0":
        why = f"vm.unprivileged_userfaultfd is {knob}: a child could serve the reads itself"
    elif child.backend == "cpu" and (not iso.strict or "--pid" not in iso.prefix):
        why = "the sandbox here has no private /dev or no PID namespace"
    else:
        target = child.read_target(decided=True)
        if target is None or not isinstance(probe, str):
            return False  # (not decided: a reference child that ended early says nothing about this host)
        want, err, got = bytes.fromhex(child.key), ctypes.c_longlong(0), ctypes.create_string_buffer(16)
        table = bytes.fromhex(probe)
        msg = _frame({}, [len(table)]) + table
        rand = (ctypes.c_ulonglong * len(want))(*range(len(want)))  # (each byte once, in order)
        n = lib.read_outputs(*target, msg, len(msg), rand, len(want), len(want), got, len(want),
                             time.monotonic_ns() + 10**10, ctypes.byref(err))  # (CLOCK_MONOTONIC, as the helper's)
        if n != len(want) or got.raw != want:
            code = os.strerror(err.value) if n == -7 and child.backend == "cpu" else f"code {n}, error {err.value}"
            why = f"this process may not read its children's memory here ({code})"
        else:  # and write the inputs of timed runs (TimedInputs): the key's own bytes back where they are
            one = (ctypes.c_ulonglong * 1)
            if child.backend == "cpu" and child._pidfd is None:
                n = "no pidfd for the child's process"
            elif child.backend == "cpu":
                n = lib.write_inputs(1, target[1], one(struct.unpack_from("<Q", table)[0]),
                                     one(ctypes.addressof(got)), one(len(want)), 1, 0, time.monotonic_ns() + 10**10,
                                     ctypes.byref(err))
            else:
                ptr, gen = ctypes.c_ulonglong(), ctypes.c_longlong()
                n = lib.gpu_alloc(GRANULE, ctypes.byref(ptr), ctypes.create_string_buffer(64), ctypes.byref(gen))
                n = n or lib.gpu_free(ptr.value, gen.value)
            if n:
                why = f"this process may not write its children's inputs here (code {n}, error {err.value})"
    _READS[child.backend] = why is None
    if why:
        print(f"protocol.py: timed runs are loaded by the child before the clock and checked at positions told to it "
              f"({why}): a kernel that takes its process over can compute before the clock, or only those positions "
              "(env.py, does NOT protect)", file=sys.stderr)
    return why is None


# The device side of the reads: one kernel, one thread per byte gathered (each byte's address from a host-mapped list)
GATHER_PTX = b"""
.version 6.0
.target sm_50
.address_size 64
.visible .entry gather(.param .u64 srcs, .param .u64 dst, .param .u64 n)
{
    .reg .pred %p;
    .reg .b32 %r<4>;
    .reg .b64 %rd<9>;
    .reg .u16 %h;
    ld.param.u64 %rd1, [srcs];
    ld.param.u64 %rd2, [dst];
    ld.param.u64 %rd3, [n];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;
    setp.ge.u64 %p, %rd4, %rd3;
    @%p bra DONE;
    shl.b64 %rd6, %rd4, 3;
    add.u64 %rd6, %rd1, %rd6;
    ld.u64 %rd7, [%rd6];
    ld.u8 %h, [%rd7];
    add.u64 %rd8, %rd2, %rd4;
    st.u8 [%rd8], %h;
DONE:
    ret;
}
\0"""
_gpu_state: list = []
_gpu_lock = threading.Lock()
# the driver's functions the helper calls, in gpu_setup's order
DRIVER_FNS = ("cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuIpcOpenMemHandle_v2", "cuMemGetAddressRange_v2",
              "cuLaunchKernel", "cuStreamQuery", "cuIpcCloseMemHandle", "cuMemAlloc_v2", "cuMemFree_v2",
              "cuMemcpyDtoDAsync_v2", "cuIpcGetMemHandle")


def _gpu_reset():
    """Drops the helper's device state after a fault (a sticky error: that context takes no more work): its
    mappings die with the context, and the next read sets up a new one (_gpu)."""
    with _gpu_lock:
        if _gpu_state and _gpu_state[0]:
            cu, setup = _gpu_state[0]
            native().gpu_setup((ctypes.c_void_p * len(DRIVER_FNS))(), None, None, None, None, None, None, 0)  # (nothing
            cu.cuCtxDestroy_v2(setup[1])  # points at it now; its allocations die with it: the helper's generation)
        _gpu_state.clear()


def _gpu():
    """Sets up the native helper's device reads once: this process's own CUDA context (never the trainer's, which
    a fault while reading a child's memory would end), a stream, the gather kernel and host-mapped buffers. The
    context is made current only inside each read. None where this fails (no GPU, no driver)."""
    lib = native()  # (built first: native() takes its own lock)
    with _gpu_lock:
        if _gpu_state:
            return _gpu_state[0]
        state = None
        try:
            cu = ctypes.CDLL("libcuda.so.1")
            vp = ctypes.c_void_p
            ctx, mod, fn, stream, cstream, srcs, dst, was = vp(), vp(), vp(), vp(), vp(), vp(), vp(), vp()
            dev = ctypes.c_int()
            cap = MAX_OUTPUTS * READS * 16
            for call in (lambda: cu.cuInit(0), lambda: cu.cuDeviceGet(ctypes.byref(dev), 0),
                         lambda: cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)):  # (current to this thread until popped)
                if call():
                    raise OSError("a CUDA call failed")
            try:
                for call in (lambda: cu.cuModuleLoadData(ctypes.byref(mod), GATHER_PTX),
                             lambda: cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"gather"),
                             lambda: cu.cuStreamCreate(ctypes.byref(stream), 1),  # CU_STREAM_NON_BLOCKING
                             lambda: cu.cuStreamCreate(ctypes.byref(cstream), 1),
                             lambda: cu.cuMemHostAlloc(ctypes.byref(srcs), ctypes.c_size_t(8 * cap), 3),  # portable, mapped
                             lambda: cu.cuMemHostAlloc(ctypes.byref(dst), ctypes.c_size_t(cap), 3)):
                    if call():
                        raise OSError("a CUDA call failed")
            finally:
                cu.cuCtxPopCurrent_v2(ctypes.byref(was))
            fns = (vp * len(DRIVER_FNS))(*[ctypes.cast(getattr(cu, n), vp) for n in DRIVER_FNS])
            if lib is None:
                raise OSError("no native helper")
            setup = (fns, ctx, stream, cstream, fn, srcs, dst, cap)
            lib.gpu_setup(*setup)
            state = (cu, setup)  # (kept: what the helper points to lives as long as this process)
            _gpu_state.append(state)
        except (OSError, AttributeError):
            pass  # (not kept: the next call tries again)
        return state


def harness_pid(pgid) -> int | None:
    """The harness's process, as this process numbers it: PID 1 of the child's PID namespace, found below the leader
    of its process group (unshare, or the fork server's M). None where there is none (the child ended)."""
    def nspid(pid):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return line.split()[1:]
        return []

    try:
        depth, pid = len(nspid(os.getpid())), pgid
        for _ in range(4):
            ns = nspid(pid)
            if len(ns) > depth and ns[-1] == "1":
                return pid
            kids = [int(k) for t in os.listdir(f"/proc/{pid}/task")
                    for k in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
            if len(kids) != 1:
                return None
            pid = kids[0]
    except (OSError, TypeError):
        pass
    return None


def stop_processes(pid1: int, deadline: float) -> list:
    """Stops every process of a child's PID namespace (its harness is PID 1 there) for the parent's write of a run's
    input: SIGSTOP, which no process can block or handle and which reaches a namespace's PID 1 from its parent's
    namespace, then a wait until each of their threads is stopped (a thread in a system call stops when it returns:
    none holds its process's memory map meanwhile). Members are found by scanning /proc for the namespace, not by
    walking children: a process cannot leave its namespace, where a walk misses one that a kill moves in the tree
    while it reads (tests/test_redteam.py, 15c). Done when a whole scan finds no member that is new or running (one
    that another continued is stopped again). Returns their numbers (timed_pair continues them as the clock starts);
    ChildTimeout past `deadline` (time.monotonic()), EOFError if PID 1 is gone."""
    def each_thread(pid, name):  # (a file of each of its threads; none of a thread or process that is gone)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return
        for t in tids:
            with contextlib.suppress(OSError):
                yield Path(f"/proc/{pid}/task/{t}/{name}").read_text()

    def stopped(pid):  # every thread: stopped ("T", "t") or gone ("Z", "X", no such thread)
        return all(text.rsplit(")", 1)[-1].split()[:1] in ([], ["T"], ["t"], ["Z"], ["X"])
                   for text in each_thread(pid, "stat"))

    try:
        ns = os.readlink(f"/proc/{pid1}/ns/pid")
    except OSError:
        raise EOFError("the child process ended") from None
    if ns == os.readlink("/proc/self/ns/pid"):
        raise HarnessError("the child shares this process's PID namespace: its processes cannot be told apart")

    done = set()
    while True:
        found = list(namespace_members(ns))
        if pid1 not in found:
            raise EOFError("the child process ended")
        running = [pid for pid in found if pid not in done or not stopped(pid)]
        if not running:
            return sorted(done)
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        done.update(running)
        for pid in running:
            while not stopped(pid):
                if time.monotonic() > deadline:
                    for q in done:
                        with contextlib.suppress(OSError):
                            os.kill(q, signal.SIGCONT)
                    raise ChildTimeout("the child's processes did not stop for the input's write")
                os.sched_yield()


class Child:
    """A sandboxed child (run_sandboxed in a thread) and the two pipes the parent drives it through."""

    def __init__(self, spec: dict, run_dir: Path, backend: str, cfg, writable=(), env=None):  # cfg: env.Config
        self.cmd_r, self.cmd_w = os.pipe()
        os.set_blocking(self.cmd_w, False)  # (our end only: each write waits for room until the command's deadline)
        self.rep_r, self.rep_w = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # Linux; elsewhere the default size (more round trips)
            fcntl.fcntl(self.rep_w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.timed_spin_s = PARENT_SPIN_S.get(backend, 0.0)  # (timed_runs' polling for this child's replies)
        self.backend = backend
        self.number = next(_numbers)  # (names its device mappings in the native helper, closed with it)
        self.key = secrets.token_hex(16)  # the seed pad's (seed_pad); the child reads it from its spec file
        spec = dict(spec, cmd_fd=self.cmd_r, rep_fd=self.rep_w, key=self.key, spin_s=CHILD_SPIN_S)
        (run_dir / "spec.json").write_text(json.dumps(spec))
        argv = [sys.executable, "-E", "-B", str(ENV_PY), "_child", str(run_dir / "spec.json")]
        extra = dict(env or {}, **CHILD_ENV)
        self.result = None
        self.pgid = None
        self.failed = None  # why the child could not start (fork refused, no memory...), if it could not

        def go():
            try:
                self.result = run_sandboxed(argv, run_dir, cfg.timeout, writable=writable, mem_gb=cfg.mem_gb, env=extra,
                                            pass_fds=[self.cmd_r, self.rep_w], kind=backend, started=self._started,
                                            fork={"preload": FORK_PRELOAD, "call": ["protocol", "_child_main", [argv[-1]]]}
                                            if FORK_PRELOAD else None)
            except BaseException as e:  # noqa: BLE001  - a child that never ran is a child that ended, with its reason
                self.failed = f"{type(e).__name__}: {e}"
            finally:
                os.close(self.rep_w)  # our copy: the parent's next read sees the end of the pipe
                self._started_evt.set()
        self._started_evt = threading.Event()
        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()
        self._started_evt.wait()
        os.close(self.cmd_r)  # the child holds its own copies now

    def _started(self, pid):
        self.pgid = pid
        self._started_evt.set()

    reply_limit = 1 << 34  # bytes one reply may declare; the parent lowers it to what it expects
    # Seconds one command may take (None: only the verdict's wall-clock limit). A kernel that never returns holds the
    # device, or keeps a candidate alive that every new task's baselines wait for, until the child is stopped: the
    # parent stops it after one slow command, not at the verdict's limit (minutes).
    cmd_timeout: float | None = None
    spin_s = 0.0  # how long the parent polls for a reply before it sleeps (timed_runs sets it for its exchanges)
    _kept = None  # the memory that replies asked for with reuse=True are read into (grown to the largest)
    _pair_bufs = None  # native_timed_run's two reply buffers, made at its first call
    _pidfd = None  # a pidfd of the harness's process (read_target), for the host writes

    def _reuse(self, nbytes: int) -> torch.Tensor:
        if self._kept is None or self._kept.numel() < nbytes:
            self._kept = None  # (the old one is freed before the larger one is made)
            self._kept = torch.empty(nbytes, dtype=torch.uint8)
        return self._kept

    def ask(self, obj, reuse: bool = False):
        """Sends a command with a fresh nonce and returns the reply that echoes it. Only the harness, which read the
        command, knows the nonce: native code in the child can write to the reply pipe (nothing in-process stops a
        write to a descriptor), and a message it adds without the nonce is refused; code that reads the harness's
        memory can answer in its place (env.py, "does NOT protect").
        reuse=True: the reply's tensors are read into memory this child keeps for such replies, and are valid only
        until its next reply with reuse=True, and count against reply_limit for its other replies. For whole outputs
        that are judged and dropped (on 2 cores a 1 GiB output read into fresh memory costs about twice as much as
        into memory that is already there: bench/transfer_bench.py)."""
        nonce = secrets.token_hex(8)
        if "seed" in obj:
            obj = dict(obj, seed=obj["seed"] ^ seed_pad(self.key, nonce))
        deadline = None if self.cmd_timeout is None else time.monotonic() + self.cmd_timeout  # (to write and answer)
        try:
            send(self.cmd_w, dict(obj, nonce=nonce), deadline=deadline)
        except PastDeadline:  # (its command pipe full: it stopped reading, or filled the pipe itself)
            self._stop()
            raise ChildTimeout(f"one `{obj.get('op')}` could not be sent within {self.cmd_timeout:g} s") from None
        except OSError as e:  # (BrokenPipeError: the child died after its last reply)
            raise EOFError("the child process ended") from e
        return self.answer(expect=nonce, what=obj.get("op"), reuse=reuse, deadline=deadline)

    def answer(self, expect: str | None = None, what: str | None = None, reuse: bool = False, deadline=None):
        """The next reply (see ask); `deadline` (time.monotonic()): by default cmd_timeout from now."""
        if deadline is None and self.cmd_timeout is not None:
            deadline = time.monotonic() + self.cmd_timeout
        try:
            # reply_limit bounds what the child's replies make us hold at once: the kept memory counts against
            # any other reply (a timed run's sample is read while a judged whole output is kept)
            kept = 0 if reuse or self._kept is None else self._kept.numel()
            obj, blobs = recv(self.rep_r, limit=max(0, self.reply_limit - kept), alive=self.thread.is_alive, expect=expect,
                              deadline=deadline, into=self._reuse if reuse else None, spin_s=self.spin_s)
        except PastDeadline:
            # (an end of the pipe is never a timeout: a child's pipe closes before the thread that ran it returns, so
            # a crash may be seen while that thread is still alive)
            self._stop()
            raise ChildTimeout(f"one `{what}` took longer than {self.cmd_timeout:g} s" if what else
                               f"loading took longer than {self.cmd_timeout:g} s") from None
        _raise_error(obj)
        return obj, blobs

    def read_target(self, decided: bool = False):
        """Where a timed run's check reads this child's outputs, as the native helper's (where, who): (1, the
        harness's pid) for host memory, (2, this child's number) for device memory through its IPC mappings; None
        where this process reads none (reads(), or decided=True: as if it did)."""
        if not (decided or reads(self.backend)):
            return None
        if self.backend == "cuda":
            if _gpu() is None:  # (set up again after a fault: _gpu_reset)
                raise HarnessError("the native helper's CUDA context could not be made again")
            return 2, self.number
        if getattr(self, "_read_pid", None) is None:
            self._read_pid = harness_pid(self.pgid)
            if self._read_pid is None:
                if decided:
                    return None
                raise EOFError("the child process ended")
            with contextlib.suppress(OSError, AttributeError):  # (says when that process has ended: its number could
                self._pidfd = os.pidfd_open(self._read_pid)      # then be another's, which no write may reach)
        return 1, self._read_pid

    def native_timed_run(self, how, run_spin_s: float, sample_spin_s: float, write=None):
        """One timed run by the native clock (timed_pair): `write` first (the run's input, before the clock starts),
        then "run", then the check that `how` says (see timed_run).
        Returns (milliseconds, reply of the run, what the check read: its bytes, or the sample's (obj, blobs));
        None where there is no native helper. The replies' nonces, errors and limits are checked once the clock has
        stopped; a child that died while something else holds its pipe is found at the command's time limit, not by
        alive()."""
        import mmap
        lib = native()
        if lib is None:
            return None
        if self._pair_bufs is None:  # (anonymous maps: pages cost nothing until a reply fills them)
            maps = [mmap.mmap(-1, PREFIX + (1 << 20)), mmap.mmap(-1, PREFIX + (1 << 20) + SAMPLE_BYTES)]
            self._pair_bufs = [(m, ctypes.addressof(ctypes.c_char.from_buffer(m))) for m in maps]
        nonces = secrets.token_hex(8), secrets.token_hex(8)
        run = _frame(run_command(how, nonces[0]))
        sample = _frame({"op": "sample", "offset": how[1], "nonce": nonces[1]}) if how[0] == "sample" else None
        where, who, rand = how[1:] if how[0] == "read" else (0, 0, None)
        rand_c = (ctypes.c_ulonglong * len(rand))(*rand) if rand else None
        ((m1, a1), (_, a2)), lens = self._pair_bufs, (ctypes.c_longlong * 2)()
        cap2 = PREFIX + (1 << 20) + min(self.reply_limit, SAMPLE_BYTES)
        timeout = self.cmd_timeout if self.cmd_timeout is not None else 86400.0  # (else the verdict's limit ends it)
        wwhere, wdst, wsrc, wlen, wgen = write or (0, None, None, None, 0)
        if where == 0 and write is not None:  # (an audited run's write goes where its reads would)
            who = self.read_target()[1]
        conts = []
        if wwhere == 1:  # its processes stopped while this process writes into it (stop_processes): no thread of
            # the child's watches the input arrive, or holds its memory map to stall the write and compute meanwhile
            if self._pidfd is None or select.select([self._pidfd], [], [], 0)[0]:
                raise EOFError("the child process ended")  # (no pidfd, no writes: a number may name another process)
            conts = stop_processes(who, time.monotonic() + (self.cmd_timeout or 60.0))
        ns = lib.timed_pair(self.cmd_w, self.rep_r, run, len(run), sample, len(sample or b""), a1, len(m1), a2, cap2,
                            int(run_spin_s * 1e9), int(sample_spin_s * 1e9), int(timeout * 1e9), lens,
                            where, who, rand_c, len(rand or ()), READS, wwhere, wdst, wsrc, wlen, len(wlen or ()),
                            wgen, (ctypes.c_int * len(conts))(*conts), len(conts))
        if ns == -1:
            if where == 2 and lens[0] > 0:
                _gpu_reset()  # (a gather still queued in the helper's context: dropped with it)
            self._stop()
            raise ChildTimeout(f"one `{'sample' if lens[0] > 0 else 'run'}` took longer than {timeout:g} s")
        if ns in (-2, -4):
            raise EOFError("the child process ended")
        if ns == -3:
            raise ValueError("malformed message header")
        if ns == -5:
            raise ReplyTooLarge(lens[1] or lens[0], cap2 - PREFIX - (1 << 20))  # (lens: the sample's, or the run's)
        reply = parse(ctypes.string_at(a1, lens[0]), 1 << 20, nonces[0])
        _raise_error(reply[0])
        if ns == -6:
            raise ValueError("malformed run reply (its list of outputs)")
        if ns == -7:
            why = (os.strerror(lens[1]) if where == 1 else f"CUDA error {lens[1]}") if lens[1] else "in part"
            raise ValueError(f"the run's outputs could not be read ({why})")
        if ns in (-8, -9):  # the helper's own failure, not the child's: its context is made again for the next read
            _gpu_reset()
            raise HarnessError(f"the native helper's device {'read' if lens[0] else 'write'} failed (code {ns}, "
                               f"CUDA error {lens[1]})")
        if ns == -12:
            raise HarnessError("the native helper's device memory is gone (its context was dropped after a fault)")
        if ns == -10:  # (the child's own memory refused the write: its run fails)
            raise ValueError(f"the run's inputs could not be written ({os.strerror(lens[1]) if lens[1] else 'in part'})")
        if rand:
            return ns / 1e6, reply, ctypes.string_at(a2, lens[1])
        if sample is None:
            return ns / 1e6, reply, None
        obj, blobs = parse(ctypes.string_at(a2, lens[1]), self.reply_limit, nonces[1])
        _raise_error(obj)
        return ns / 1e6, reply, (obj, blobs)

    def _stop(self):
        if self.pgid:  # still running past its deadline: stopped (the device is free again)
            kill_group(self.pgid)

    def close(self):
        if self.cmd_w is None:
            return self.result
        with contextlib.suppress(OSError, PastDeadline):
            send(self.cmd_w, {"op": "exit"}, deadline=time.monotonic() + 1)
        os.close(self.cmd_w)
        self.cmd_w = None
        self.thread.join(5)
        if self.thread.is_alive() and self.pgid:  # did not exit when told: killed, its whole PID namespace with it
            kill_group(self.pgid)
            self.thread.join()
        os.close(self.rep_r)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self._kept = self._pair_bufs = None
        if self.backend == "cuda" and _gpu_state and _gpu_state[0]:
            native().gpu_forget(self.number)  # (its device memory is no longer mapped here)
        return self.result

    def why_dead(self) -> str:
        self.thread.join()
        if self.result is None:
            return f"could not start ({self.failed})"
        r = self.result
        tail = error_excerpt(r.stderr, 12) if r.stderr.strip() else ""
        return (r.crash or f"exited with code {r.returncode}") + (f"\n{tail}" if tail else "")


def _raise_error(obj):
    """A reply that reports the command failed (an exception in the child) raises it as ChildError."""
    if isinstance(obj, dict) and "error" in obj and isinstance(obj["error"], str) and len(obj) == 1:
        raise ChildError(obj["error"])


class HarnessError(RuntimeError):
    """A failure of this process's own machinery (the native helper's device reads, writes and memory), not of the
    child: a verdict
    that meets it raises out of env.evaluate(), which counts it as the harness's failure, never as a reward."""


class DeviceFull(ValueError):
    """The native helper could not allocate device memory for a verdict's timed inputs."""


class ChildTimeout(EOFError):
    """A command the child did not answer within Child.cmd_timeout; the child was stopped."""


class ChildError(Exception):
    """A command the child reported as failed (an exception in its code)."""


GRANULE = 2 << 20  # the helper's device allocations are whole multiples of this (the driver maps memory in pages of
# 2 MiB and packs smaller allocations into one: a child that opened one of them would see its neighbours)


class InputsDiffer(ValueError):
    """The timed sets of a task differ in structure (a shape, a dtype, a value that is not a tensor)."""


class TimedInputs:
    """The timed runs' input sets, held by this process and written into a child's input buffers just before each
    run's clock starts (timed_pair), so no child holds a run's input before its run: a kernel that takes its
    process over can do nothing with an input before [t0, t1] (env.py, "does NOT protect", says what is left). On the
    CPU the sets are host tensors of ours, written into the child's own buffers with process_vm_writev (into that
    process and no other, all of whose processes are stopped meanwhile: Child.native_timed_run); on a GPU they are
    device copies in the native helper's context, in memory no child can open, copied into buffers the helper
    allocated and exported to the child (CUDA IPC), each in pages of its own: the helper writes to no address a
    child named. A set's structure (shapes, dtypes, other values) must be every
    set's (InputsDiffer). Used where reads() holds (the same access to a child's memory); close() frees the device
    memory, after every child that opened it has ended."""

    def __init__(self, backend: str):
        self.backend, self.structure, self.sets, self.sizes, self._mine, self._attached = backend, None, [], [], [], {}
        self.gen, self._region = None, None

    def take(self, child: Child, seeds: list):
        """The input sets of `seeds`, in turn, from a trusted reference child ("set")."""
        for seed in seeds:
            obj, blobs = child.ask({"op": "set", "seed": seed})
            if self.structure is None:
                self.structure = obj["out"]
            elif obj["out"] != self.structure:
                raise InputsDiffer("the timed input sets differ in shape, dtype or value")
            if self.backend == "cuda":
                raw = blobs[0].numpy().tobytes() if len(blobs) == 1 else b"x"
                if len(raw) % ENTRY:
                    raise ValueError("malformed set reply")
                entries = [raw[at:at + ENTRY] for at in range(0, len(raw), ENTRY)]
                sizes = [struct.unpack_from("<Q", e, 8)[0] for e in entries]
                if self._region is None:  # every set in one allocation of ours, each tensor at a multiple of 512
                    self.sizes, self._offsets = sizes, [0]
                    for n in sizes:
                        self._offsets.append(self._offsets[-1] + -(-n // 512) * 512)
                    self._region = self._alloc(self._offsets[-1] * len(seeds))
                if sizes != self.sizes:
                    raise InputsDiffer("the timed input sets differ in size")
                base = self._region + len(self.sets) * self._offsets[-1]
                ptrs = [base + at for at in self._offsets[:-1]]
                for e, ptr, n in zip(entries, ptrs, sizes):
                    r = native().gpu_copy_in(e, ptr, n, self.gen, time.monotonic_ns() + 60 * 10**9) if n else 0
                    if r == -1:
                        _gpu_reset()  # (a copy still queued in the helper's context: dropped with it)
                    if r:
                        raise HarnessError(f"an input set could not be copied to the native helper (code {r})")
            else:
                tensors = tensors_of(unpack(obj["out"], blobs))
                self.sizes = [t.numel() * t.element_size() for t in tensors]
                ptrs = [t.data_ptr() for t in tensors]
                self._mine.append(tensors)  # (kept alive: their memory is what is written)
            self.sets.append(ptrs)
        return self

    def _alloc(self, n: int, handle=None) -> int:
        """Device memory of the helper's own: n bytes rounded up to whole GRANULEs; exported with `handle`."""
        ptr, gen = ctypes.c_ulonglong(), ctypes.c_longlong()
        r = native().gpu_alloc(max(1, -(-n // GRANULE)) * GRANULE, ctypes.byref(ptr), handle, ctypes.byref(gen))
        if r == 2:  # CUDA_ERROR_OUT_OF_MEMORY: the verdict's failure, as a reference child's own would be (a candidate
            # that fills the device must not turn its verdict into the harness's failure, which is not penalised)
            raise DeviceFull(f"no device memory for the timed runs' inputs ({n:,} bytes)")
        if r:
            raise HarnessError(f"the native helper could not allocate {n} bytes of device memory (CUDA error {r})")
        self._mine.append((ptr.value, gen.value))
        if self.gen is None:
            self.gen = gen.value
        if gen.value != self.gen:
            raise HarnessError("the native helper's device memory is gone (its context was dropped after a fault)")
        return ptr.value

    def attach(self, child: Child) -> list:
        """Makes `child`'s input buffers ("buffers"), once per child, and returns, per set, the native helper's write
        of that set into them: (where, dst, src, lengths, generation)."""
        if child.number in self._attached:
            return self._attached[child.number]
        u64s = ctypes.c_ulonglong * len(self.sizes)
        if self.backend == "cuda":
            dst, handles = [], []
            for n in self.sizes:
                h = ctypes.create_string_buffer(64)
                dst.append(self._alloc(n, h) if n else 0)
                handles.append(h.raw.hex() if n else None)
            child.ask({"op": "buffers", "inputs": self.structure, "handles": handles})
        else:
            table = _outputs(child.ask({"op": "buffers", "inputs": self.structure}))
            if [n for _, n, _ in table] != self.sizes:
                raise ValueError("the child's input buffers are not the size of the task's inputs")
            dst = [a for a, _, _ in table]
        where = 2 if self.backend == "cuda" else 1
        self._attached[child.number] = [(where, u64s(*dst), u64s(*ptrs), u64s(*self.sizes), self.gen or 0)
                                        for ptrs in self.sets]
        return self._attached[child.number]

    def close(self):
        if self.backend == "cuda":
            for ptr, gen in self._mine:
                native().gpu_free(ptr, gen)  # (-12, nothing freed, where the context it was in is gone)
        self._mine, self.sets, self._attached = [], [], {}


MAX_WARMUP = 200  # untimed runs at most before the timed ones (timed_runs): a kernel of microseconds makes no more
SPLIT_CHILDREN = 5  # candidate processes at most that share one verdict's timed runs (timing_shares)
# ... and the least each one's warm-up lasts (MAX_WARMUP runs at most). Each of them is timed twice or so where the
# baselines' one child is timed 20 times, so a fresh child still warming up moves the candidate's median and not the
# baselines'. 8 warm-up runs: relu 64x4096 on 2 cores 0.59 ms shared out, 0.50 in one child; mul_param 32768x256
# (~16 ms a run, whose first ~5 runs in a fresh child take ~29 ms): 50 ms shared out 4% slower than one child, 500
# ms the same (medians of 3 verdicts); on an H100, 50 ms: 7-10% slower (one verdict each; docs/results.md)
SPLIT_WARMUP_MS = 500.0


def timing_shares(cfg, n_sets: int) -> list | None:
    """How a candidate's timed runs are shared out so that no input set is met twice, warm-up included: None where
    there are more sets than runs (one child, warmed up on the set left over: timed_runs), else one (n_timed, n_audits)
    per child, each child's runs at most n_sets (each set of its batch at most once) after a warm-up on an input of its
    own (timed_runs' warm_seed). env.py gives the first share to the checked candidate child, on the verdict's first
    batch, and each later one a fresh process and a fresh batch of sets (a reference child's, ended before the
    candidate's starts): a cache keyed on input values has nothing to answer from, in its process or through any
    channel to another. At most SPLIT_CHILDREN children (each costs a reference's outputs, a process start and its
    warm-up), so with 2 sets 10 runs (2 of them audits), not n_timed + n_audits; the audits fall on runs drawn at
    random among them (a child learns its number of audits only as it is audited)."""
    runs = cfg.n_timed + cfg.n_audits
    if n_sets > runs:
        return None
    children = min(-(-runs // n_sets), SPLIT_CHILDREN)
    total = min(runs, children * n_sets)
    audited = set(secrets.SystemRandom().sample(range(total), min(cfg.n_audits, total - 1)))
    shares = []
    for start in range(0, total, n_sets):
        k = min(n_sets, total - start)
        a = sum(start <= i < start + k for i in audited)
        shares.append((k - a, a))
    return shares


def timed_runs(child: Child, seeds: list, cfg, check=None, audit=None, inputs: TimedInputs | None = None,
               warm_seed: int | None = None) -> list:
    """Times fn over the input sets `seeds` in turn with the parent's clock, after untimed runs (cfg.warmup,
    cfg.warmup_ms) on the last set: n_timed runs, and never more runs than there are sets besides the warm-up's unless
    fewer sets fit in input_budget_mb (a repeated set lets a cache keyed on its values answer without computing: where
    it matters, the candidate's, the caller shares the runs out over fresh children on fresh batches, timing_shares).
    With `warm_seed`, the warm-up runs on that input instead, loaded by the child itself before any timed set reaches
    it, and the runs (at most len(seeds)) meet each set at most once. check(k, values, where) sees each run's sampled
    elements (checked_values: picks_of(reference, where) gives the reference's elements they must match).
    With `audit`, n_audits more runs are made, and which of them are audits is told to the child only after each run
    has returned: audit(k) checks that run's whole output, and its time is not counted. A kernel that skips work on some timed
    runs, in a pattern the sample could miss, cannot know which runs are read in full. Milliseconds per run.
    The parent polls for the runs' replies (PARENT_SPIN_S) and the samples' (SAMPLE_SPIN_S) while it drives the runs:
    one timed section per device at a time.
    With `inputs` (TimedInputs of the same sets, in order) and reads(), each run's input is written into the child's
    buffers by this process just before the clock starts; otherwise the child is told the set's seed ("load"), and
    builds and copies it in itself, before the clock (a child that takes its process over can compute then:
    env.py, "does NOT protect")."""
    child.spin_s = getattr(child, "timed_spin_s", 0.0)  # (a stand-in for a Child may not say)
    try:
        return _timed_runs(child, seeds, cfg, check, audit, inputs, warm_seed)
    finally:
        child.spin_s = 0.0


def _timed_runs(child: Child, seeds: list, cfg, check, audit, inputs, warm_seed) -> list:
    target = child.read_target() if hasattr(child, "read_target") else None  # (a stand-in in the tests: the sample)
    writes = inputs.attach(child) if inputs is not None and target is not None else None

    def load(k):  # before run k: the input told by its seed; or, to be written before the clock, the L2 flushed
        if writes is None:
            child.ask({"op": "load", "seed": seeds[k]})
            return None
        if child.backend == "cuda":  # (before the write: the write leaves the input in the L2 as far as it fits)
            child.ask({"op": "flush"})
        return writes[k]

    def check_of_a_run():  # drawn before each run, told to the child (the sample's offset) only after it
        if target is not None:
            return ("read", *target, struct.unpack(f"<{READS * MAX_OUTPUTS}Q", os.urandom(8 * READS * MAX_OUTPUTS)))
        return "sample", secrets.randbelow(1 << 30)

    # Untimed runs, driven as the timed runs are (the reads' first mappings and pages are made here): at least
    # `warmup` of them, and more until their times by this clock (the protocol's included) add up to warmup_ms, so
    # that a short kernel meets a device (or core) that has left its idle clocks (MAX_WARMUP bounds the number of
    # runs for a kernel much shorter than warmup_ms; the child's time is bounded by cfg.timeout, as ever). They
    # run on the last set, which the timed runs reach only when there are no more sets than runs (the caller draws
    # one set more than it times), or on warm_seed's input: a cache keyed on input values meets no timed set it has
    # computed. (Where the sets repeat, the baselines', trusted, meet them again; the candidate's are shared out.)
    # With warm_seed, the child loads the warm-up's input itself, into the buffers the timed runs use (the parent's,
    # where it writes them): no timed set reaches it before the timed runs.
    if warm_seed is not None:
        child.ask({"op": "load", "seed": warm_seed})
    warm = len(seeds) - 1
    write = load(warm) if warm_seed is None else None
    i, spent = 0, 0.0
    while i < cfg.warmup or (spent < cfg.warmup_ms and i < MAX_WARMUP):
        if i and write is not None:
            load(warm)
        spent += timed_run(child, check_of_a_run(), child.spin_s, max(child.spin_s, SAMPLE_SPIN_S), write)[0]
        i += 1
    times = []
    audits = cfg.n_audits if audit is not None else 0
    runs = cfg.n_timed + audits
    if warm_seed is not None and runs > len(seeds):
        raise ValueError(f"{runs} runs over {len(seeds)} input sets would meet a set twice")
    for i in range(runs):
        k = i % len(seeds)
        write = load(k)
        # Both drawn here and never told to the child before its run has returned (an audit's "full" follows the run's
        # reply; the positions read are never told): a uniformly random subset of the runs is audited.
        audited = audits and secrets.randbelow(runs - i) < audits
        how = ("audit", target is not None) if audited else check_of_a_run()
        ms, reply, got = timed_run(child, how, child.spin_s, max(child.spin_s, SAMPLE_SPIN_S), write)
        if audited:
            audits -= 1
            audit(k)
            continue
        times.append(ms)
        if check is not None:
            check(k, *checked_values(how, reply, got))
    return times


def timed_run(child, how, run_spin_s: float, sample_spin_s: float, write=None):
    """(milliseconds, the run's reply, what its check got) of one timed run: "run", then, by `how`:
      ("audit", reading)        nothing (an audited run: the caller reads its whole output, untimed); `reading`:
                                whether the other runs are checked by reads (the child is told the same for both)
      ("read", where, who, rand)  the parent reads READS elements of each output from the child's memory (where,
                                who: Child.read_target), element i of output j at rand[j * READS + i] modulo its
                                size: their bytes
      ("sample", offset)        the "sample" exchange, at offset: its reply's (obj, blobs)
    `write`: the run's input, written just before the clock starts (TimedInputs.attach's, for this run's set).
    Child.native_timed_run's steps by its native clock; read in Python where there is none (a stand-in for a Child in
    the tests; a machine without a C compiler, where the trainer's other threads' holds on the interpreter's lock are
    timed too)."""
    native_run = getattr(child, "native_timed_run", None)
    timed = native_run(how, run_spin_s, sample_spin_s, write) if native_run is not None else None
    if timed is not None:
        return timed
    assert write is None, "the parent's input writes need the native helper"  # (as its reads do: reads())
    spin_s = child.spin_s
    try:
        child.spin_s = run_spin_s
        t0 = _clock()
        reply, got = child.ask(run_command(how)), None
        if how[0] == "sample":  # (never "read": reads need the native helper, and reads() is False without it)
            child.spin_s = sample_spin_s
            got = child.ask({"op": "sample", "offset": how[1]})
        return (_clock() - t0) * 1e3, reply, got
    finally:
        child.spin_s = spin_s


def run_command(how, nonce: str | None = None) -> dict:
    """A timed run's command. "spin": whether the child polls for its next command after the reply (see spin): a
    sample's command comes at once and is on the clock; after the parent's reads the next command is not, and a
    child that polls while they run slows them (relu 64x4096, 2 cores: 0.36 ms a run against 0.11). The same for
    every run of a child, audited or not, so it tells nothing of the run."""
    reading = how[0] == "read" or (how[0] == "audit" and how[1])
    return {"op": "run", "spin": not reading, **({"nonce": nonce} if nonce else {})}


def checked_values(how, reply, got):
    """(values, where) of a timed run (timed_run's reply and got): the elements its check got, in the structure of
    the run's output, and `where` for picks_of, which gives the reference's elements they must match."""
    if how[0] == "sample":
        return unpack(*got), ("offset", how[1])
    return read_values(reply, got, how[3])


ENTRY = 96  # bytes per output in a run reply's list: address, bytes, element size, allocation base, IPC handle


def _outputs(reply) -> list:
    """(address, bytes, element size) of each output tensor a run's reply lists."""
    obj, blobs = reply
    if not isinstance(obj, dict) or len(blobs) != 1 or blobs[0].numel() % ENTRY:
        raise ValueError("malformed run reply (its list of outputs)")
    raw = blobs[0].numpy().tobytes()
    return [struct.unpack_from("<3Q", raw, at) for at in range(0, len(raw), ENTRY)]


def output_entry(t: torch.Tensor) -> bytes:
    """A contiguous output's entry in a run reply's list (the child's side): where the parent reads it. A tensor on
    a GPU comes with its allocation's base and the CUDA IPC handle of that allocation (made by the driver each run:
    the caching allocator may have given it a new one)."""
    base, handle = 0, bytes(64)
    if t.device.type == "cuda" and t.numel():
        cu = _cuda_driver()
        b, size, h = ctypes.c_uint64(), ctypes.c_size_t(), (ctypes.c_char * 64)()
        if cu.cuMemGetAddressRange_v2(ctypes.byref(b), ctypes.byref(size), ctypes.c_uint64(t.data_ptr())) == 0 and \
                cu.cuIpcGetMemHandle(h, b) == 0:
            base, handle = b.value, bytes(h)
    return struct.pack("<4Q", t.data_ptr(), t.numel() * t.element_size(), t.element_size(), base) + handle


_driver: list = []


def _cuda_driver():
    if not _driver:
        _driver.append(ctypes.CDLL("libcuda.so.1"))
    return _driver[0]


class IOVec(ctypes.Structure):  # process_vm_readv's (for the probes and tests that read a child as the helper does)
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def read_values(reply, got: bytes, rand):
    """(values, where) from the bytes the parent read after a run: `values` has the structure of the run's output,
    with READS elements in place of each tensor (1-D); `where` says which elements of a reference they are, and the
    declared shapes that the reference must have (picks_of)."""
    obj = reply[0].get("out") if isinstance(reply[0], dict) else None
    table, picked, at = _outputs(reply), [], 0

    def walk(o, depth=0):
        nonlocal at
        if not isinstance(o, dict) or depth > 8:
            raise ValueError("malformed output")
        if "t" in o:
            dtype, shape = getattr(torch, str(o.get("dtype")), None), o.get("shape")
            if (not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or
                    not all(isinstance(d, int) and d >= 0 for d in shape) or o["t"] != len(picked)):
                raise ValueError("malformed tensor in output")
            size, n = torch.empty((), dtype=dtype).element_size(), math.prod(shape)
            if len(picked) >= len(table) or table[len(picked)][1:] != (n * size, size):
                raise ValueError("malformed tensor in output (its bytes are not its shape's)")
            j = len(picked)
            idx = torch.tensor([rand[j * READS + i] % n for i in range(READS)] if n else [], dtype=torch.long)
            vals = torch.frombuffer(bytearray(got[at:at + len(idx) * size]), dtype=dtype) if n else torch.empty(0, dtype=dtype)
            at += len(idx) * size
            picked.append((tuple(shape), dtype, idx))
            return vals
        if "seq" in o and isinstance(o["seq"], list):
            seq = [walk(x, depth + 1) for x in o["seq"]]
            return tuple(seq) if o.get("tuple") else seq
        if "v" in o and (o["v"] is None or isinstance(o["v"], (bool, int, float))):
            return o["v"]
        raise ValueError("malformed output")

    values = walk(obj)
    if len(picked) != len(table) or at != len(got):
        raise ValueError("malformed run reply (its list of outputs is not its output's)")
    return values, ("index", picked)


def picks_of(ref, where):
    """The elements of a reference output that a timed run's check read (see timed_run): out[o::step] of each
    tensor for a sample, the positions read for reads. ValueError where the run declared another shape or dtype."""
    if where[0] == "offset":
        return sample_of(ref, where[1])
    picked = iter(where[1])

    def walk(r):
        if isinstance(r, torch.Tensor):
            shape, dtype, idx = next(picked, (None, None, None))
            if shape != tuple(r.shape) or dtype != r.dtype:
                raise ValueError(f"expected shape {tuple(r.shape)} {r.dtype}, got "
                                 f"{'no tensor' if shape is None else f'{shape} {dtype}'}")
            return r.reshape(-1)[idx]
        if isinstance(r, (tuple, list)):
            return type(r)(walk(x) for x in r)
        return r

    return walk(ref)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def spread(xs):
    """p90 / p10 of a set of run times: how noisy the measurement was."""
    xs = sorted(xs)
    return xs[int(0.9 * (len(xs) - 1))] / max(xs[int(0.1 * (len(xs) - 1))], 1e-9)
