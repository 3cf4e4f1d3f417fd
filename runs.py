"""runs.py: a train.py run's state and its folder, for train.py's stages: the context every stage reads (Ctx),
the machine it runs on (cores, which GPU trains and which times kernels), checkpoints and --resume
(ckpt-NNNNNN/{actor,critic}/, value_head.pt, state.pt, latest.json), and the log (one `|`-separated line per step
on rank 0, the same numbers in metrics.jsonl and TensorBoard).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import env
from rl import adapter_params, barrier, dist_on, gather, make_optimizer, reset_critic
from stages import STAGES


@dataclasses.dataclass
class Ctx:
    """What every stage needs: config, run folder, ranks, the model, the tasks and the scorer's backend."""
    cfg: object  # train.py's Config (read only)
    run_dir: Path
    rank: int = 0
    world: int = 1
    device: str = "cpu"
    backend: str = "cpu"
    policy: object = None  # agent.HFPolicy; policy.model is the peft model
    pm: object = None
    head: object = None
    train: list = dataclasses.field(default_factory=list)
    teacher_tasks: list = dataclasses.field(default_factory=list)  # training tasks the teacher works (sft)
    heldout: list = dataclasses.field(default_factory=list)  # test split: evaluated, never trained on or taught
    tb: object = None
    known_tools: tuple = ()
    prev: dict = dataclasses.field(default_factory=dict)  # stage -> the stage run before it (--skip leaves gaps)
    gen_s: float = 0.0  # seconds spent in policy.generate (the rest of a rollout is tool/env time)

    @property
    def main(self):
        return self.rank == 0

    def say(self, text):
        if self.main:
            tqdm.write(text)
            sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# The machine: cores for synthesis and tool calls, GPUs for training and timing
# ----------------------------------------------------------------------------------------------
def n_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use (a container's share)
    except AttributeError:
        return os.cpu_count() or 1


def workers(cores: int, backend: str) -> tuple[int, int]:
    """(synthesis workers, parallel tool calls) for a machine with `cores` cores. Synthesis: one sandboxed child
    per core on a CPU (each single-threaded); on a GPU 4 cores stay with the parent and the device's timing lock
    is the bottleneck beyond ~12 children. Tool calls (g++/nvcc builds, verdicts): half the cores, at least 2."""
    synth = max(1, min(16, cores - 4 if backend == "cuda" else cores))
    return synth, max(2, min(16, cores // 2))


def gpu_plan(visible: list[str], local_world: int, local_rank: int, env_gpus: int = 0) -> dict:
    """Which physical GPU this rank trains/rolls out on, and which one times its kernels.

    visible: the node's visible GPU ids (CUDA_VISIBLE_DEVICES order); local_world: processes on this node.
    env_gpus = 0: each rank trains AND times kernels on its own GPU. env_gpus = K > 0: the last K
    visible GPUs only time kernels; rank r times on env GPU r mod K (env.py's per-GPU file lock keeps one
    timed section per GPU), and trains on GPU r. Returns {"train": id, "env": id} (ids as strings)."""
    n = len(visible)
    if env_gpus < 0:
        raise env.UsageError(f"--env-gpus must be >= 0, got {env_gpus}")
    if n == 0:
        if env_gpus:
            raise env.UsageError("--env-gpus needs GPUs, and none are visible")
        return {"train": None, "env": None}
    if local_world + env_gpus > n:
        raise env.UsageError(f"{local_world} training processes + --env-gpus {env_gpus} need "
                             f"{local_world + env_gpus} GPUs on this node, only {n} visible")
    train = visible[local_rank]
    if env_gpus == 0:
        return {"train": train, "env": train}
    pool = visible[n - env_gpus:]
    return {"train": train, "env": pool[local_rank % env_gpus]}



def time_generate(ctx: Ctx):
    """Wrap ctx.policy.generate so that the seconds spent in it add up in ctx.gen_s: a step's rollout time
    minus gen_s is its tool and env.py time (the generate / env / update split of the step log)."""
    generate = ctx.policy.generate

    def timed_generate(*args, **kw):
        t = time.time()
        try:
            return generate(*args, **kw)
        finally:
            ctx.gen_s += time.time() - t
    ctx.policy.generate = timed_generate

def claim_devices(cuda: bool, cores: int, local_world: int, local_rank: int, env_gpus: int = 0):
    """Before the model loads. Without a GPU, torch keeps to a share of the cores and leaves the rest to env.py's
    sandboxes, which score concurrently (tiny ops on busy cores crawl with spinning threads). With GPUs, this
    rank opens its own CUDA context on its training GPU, then points CUDA_VISIBLE_DEVICES at the GPU that times
    its kernels (gpu_plan): from then on the variable only steers children (env.py's sandboxes, which lock it)."""
    if not cuda:
        torch.set_num_threads(max(1, cores // (2 * local_world)))
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(torch.cuda.device_count()))).split(",")
    plan = gpu_plan([v for v in visible if v], local_world, local_rank, env_gpus)
    torch.cuda.init()
    os.environ["CUDA_VISIBLE_DEVICES"] = plan["env"]



# ----------------------------------------------------------------------------------------------
# Run folder: checkpoints, --resume
# ----------------------------------------------------------------------------------------------
def write_json(path: Path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)  # atomic: a kill -9 leaves the old file or the new one, never half of one


def latest(stage_dir: Path) -> dict | None:
    f = stage_dir / "latest.json"
    return json.loads(f.read_text()) if f.is_file() else None


def stage_done(run_dir: Path, stage: str) -> bool:
    info = latest(run_dir / stage)
    return bool(info and info.get("done"))


def save_checkpoint(ctx: Ctx, stage: str, step: int, opts: dict, done: bool, extra: dict | None = None):
    """ckpt-NNNNNN/{actor,critic}/ (PEFT adapters), value_head.pt, state.pt; then latest.json points at it.
    Rank 0 writes (the ranks' weights and optimiser states are identical: gradients are all-reduced)."""
    sd = ctx.run_dir / stage
    check_in_sync(ctx)
    if ctx.main:
        name = f"ckpt-{step:06d}"
        tmp = sd / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        ctx.pm.save_pretrained(str(tmp))  # tmp/actor/ and tmp/critic/
        torch.save(ctx.head.state_dict(), tmp / "value_head.pt")
        torch.save({"step": step, "opts": {k: (o.state_dict(), s.state_dict()) for k, (o, s) in opts.items()},
                    **(extra or {})}, tmp / "state.pt")
        shutil.rmtree(sd / name, ignore_errors=True)
        os.replace(tmp, sd / name)
        write_json(sd / "latest.json", {"step": step, "ckpt": name, "done": done})
        for old in sd.glob("ckpt-*"):  # keep only the newest checkpoint
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    barrier()


def check_in_sync(ctx: Ctx):
    """Ranks must hold identical weights (same init, all-reduced gradients); a checksum catches a bug
    before rank 0's checkpoint silently stands for diverged ranks."""
    if not dist_on():
        return
    with torch.no_grad():
        s = float(sum(p.double().sum() for n, p in ctx.pm.named_parameters() if "lora_" in n)
                  + sum(p.double().sum() for p in ctx.head.parameters()))
    sums = gather([s])
    if max(sums) - min(sums) > 1e-6 * max(1.0, abs(sums[0])):
        raise RuntimeError(f"ranks hold different weights (checksums {sums}); refusing to checkpoint")


def load_checkpoint(ctx: Ctx, stage: str, adapters=("actor", "critic"), head=True, opts=None) -> dict:
    """Load adapters (and the value head, and optimiser/scheduler states) of a stage's latest checkpoint."""
    import peft  # (slow import, as in rl.add_adapters: only when a checkpoint is loaded)
    info = latest(ctx.run_dir / stage)
    ck = ctx.run_dir / stage / info["ckpt"]
    for name in adapters:
        weights = peft.load_peft_weights(str(ck / name), device=str(ctx.device))
        peft.set_peft_model_state_dict(ctx.pm, weights, adapter_name=name)
    if head:
        ctx.head.load_state_dict(torch.load(ck / "value_head.pt", map_location=ctx.device))
    state = torch.load(ck / "state.pt", map_location="cpu", weights_only=False)
    for k, (o, s) in (opts or {}).items():
        o.load_state_dict(state["opts"][k][0])
        s.load_state_dict(state["opts"][k][1])
    ctx.pm.set_adapter("actor")
    return state


def new_opts(ctx: Ctx, which=("actor", "critic"), actor_lr=None) -> dict:
    """A stage's optimisers and schedulers, {"actor" | "critic": (optimizer, scheduler)} (the critic's also
    trains the value head); begin_stage restores them on --resume, save_checkpoint saves them."""
    cfg, out = ctx.cfg, {}
    if "actor" in which:
        out["actor"] = make_optimizer(adapter_params(ctx.pm, "actor"), actor_lr or cfg.actor_lr, cfg.lr_warmup)
    if "critic" in which:
        out["critic"] = make_optimizer(adapter_params(ctx.pm, "critic") + list(ctx.head.parameters()), cfg.critic_lr, cfg.lr_warmup)
    return out


def begin_stage(ctx: Ctx, stage: str, opts: dict, resume: bool) -> int | None:
    """Returns the first step to run, or None when the stage is already complete. A stage that has not started
    begins from its predecessor's weights (start_from); on --resume the stage's own latest checkpoint is loaded
    (weights, optimisers, schedulers) and the run continues after it."""
    info = latest(ctx.run_dir / stage)
    (ctx.run_dir / stage).mkdir(parents=True, exist_ok=True)
    if info is None:
        start_from(ctx, stage)
        return 0
    if info.get("done"):
        ctx.say(f"{stage}: already complete in {ctx.run_dir / stage} (skipped)")
        return None
    load_checkpoint(ctx, stage, opts=opts)
    ctx.say(f"{stage}: resuming after step {info['step'] + 1} from {ctx.run_dir / stage / info['ckpt']}")
    return info["step"] + 1


def start_from(ctx: Ctx, stage: str):
    """The weights a fresh stage starts from: the actor of the stage run before it (none before the first stage:
    the base model). PPO also takes the pre-trained critic; the critic stage, and PPO without one (--skip
    critic, the paper's ablation), start from a fresh critic."""
    prev = ctx.prev.get(stage)
    with_critic = stage == "ppo" and prev == "critic"
    if prev is not None:
        load_checkpoint(ctx, prev, adapters=("actor", "critic") if with_critic else ("actor",), head=with_critic)
    if stage in ("critic", "ppo") and not with_critic:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.cfg.seed + 1)
            reset_critic(ctx.pm, ctx.head)


# ----------------------------------------------------------------------------------------------
# Log: one line per step, metrics.jsonl, TensorBoard
# ----------------------------------------------------------------------------------------------
def fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def gpu_peak(prefix: str = "") -> dict:
    """This process's peak GPU memory since the previous call (which starts the next interval), in GiB:
    {"peak_gb": tensors (torch.cuda.max_memory_allocated), "reserved_gb": held by the caching allocator, what
    nvidia-smi sees and what runs out}; {} without CUDA. Every metrics.jsonl record carries them (the peak of
    the step, the evaluation, or whatever ran since the record before): a stage's peak is the max of its
    records', and a run that dies of OOM still shows how close the stages before it came."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    out = {f"{prefix}peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           f"{prefix}reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 2)}
    torch.cuda.reset_peak_memory_stats()
    return out


def log_step(ctx: Ctx, stage: str, step: int, total: int, row: dict, t_step: float, eta: float):
    """One `|`-separated line per step on rank 0, the same numbers in metrics.jsonl (and TensorBoard)."""
    if not ctx.main:
        return
    row = {**row, **gpu_peak()}
    f = lambda k, spec: f"{row[k]:{spec}}" if row.get(k) is not None else "-"
    parts = [f"{stage} {step + 1}/{total}"]
    for key, label, spec in (("reward", "reward", "+.3f"), ("compile", "compile", ".2f"), ("correct", "correct", ".2f"),
                             ("faster", "faster", ".2f"), ("faster_c", "faster_c", ".2f"), ("speedup", "speedup", ".2f"),
                             ("resp", "resp", ".0f"), ("turns", "turns", ".1f"), ("malformed", "malformed", ".2f"),
                             ("pg_loss", "pg", "+.4f"), ("vf_loss", "vf", ".4f"), ("loss", "loss", ".4f"),
                             ("entropy", "ent", ".3f"), ("clipfrac", "clip", ".3f"), ("ev", "ev", "+.3f"),
                             ("v_mean", "V", "+.3f"), ("adv_std", "adv_std", ".3f"), ("kl_ref", "kl_ref", "+.4f"),
                             ("mm_mean", "dlogp", ".4f"), ("mm_p99", "dlogp_p99", ".3f"), ("mm_out", "ratio_out", ".3f"),
                             ("tis_w", "tis_w", ".3f"), ("lr", "lr", ".1e"), ("peak_gb", "peak_gb", ".1f")):
        if key in row:
            parts.append(f"{label} {f(key, spec)}")
    ends = [f"{k[4:]} {row[k]:.2f}" for k in sorted(row) if k.startswith("end_")]
    if ends:
        parts.append("end " + " ".join(ends))
    if row.get("pg_skipped"):
        parts.append("actor skipped (equal rewards)")
    if row.get("harness_fail"):
        parts.append(f"harness failures {row['harness_fail']}")
    parts += [f"{t_step:.1f}s/step", f"ETA {fmt_time(eta)}"]
    ctx.say(" | ".join(parts))
    rec = {"stage": stage, "step": step + 1, "of": total, **row, "s_step": round(t_step, 3), "time": time.time()}
    with open(ctx.run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(rec, default=str) + "\n")
    if ctx.tb is not None:
        gstep = STAGES.index(stage) * 100_000 + step + 1 if stage in STAGES else step + 1
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                ctx.tb.add_scalar(f"{stage}/{k}", v, gstep)


def open_tb(run_dir: Path):
    """A TensorBoard writer into RUN/tb (rank 0 only), or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
        return SummaryWriter(str(run_dir / "tb"))
    except ImportError:
        return None


def log_event(ctx: Ctx, rec: dict):
    if ctx.main:
        rec = {**rec, **gpu_peak()}
        with open(ctx.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({**rec, "time": time.time()}, default=str) + "\n")


def stage_end(ctx: Ctx, stage: str, rows: list, **extra):
    """A summary record per stage (the rollouts of its last steps; the table's note reads it back)."""
    last = rows[-max(1, len(rows) // 2):] if rows else []
    keys = ("reward", "compile", "correct", "faster", "faster_c")
    rec = {"event": "stage_end", "stage": stage, "steps": len(rows),
           **{k: sum(r[k] for r in last) / len(last) for k in keys if last and all(k in r for r in last)}}
    rec.update(extra)
    log_event(ctx, rec)

