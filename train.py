"""train.py: the CUDA Agent recipe, scaled to one node: a supervised cold start from verified teacher
demonstrations (sft) -> single-turn PPO warm-up -> rejection fine-tuning (RFT) -> critic pre-training ->
multi-turn agentic PPO, all on LoRA adapters of one base model, with a held-out evaluation after every stage.

    # tiny: minutes on a 2-core CPU, CPU backend, a tiny randomly initialised model (this is what CI runs)
    python train.py --stage all --preset tiny --backend cpu --run-dir runs/tiny
    # default: one H200 with the embedded SmolLM2-135M-Instruct on the elementwise family (docs/curriculum.md);
    # without a GPU the same command runs the CPU-sized preset "cpu" (the first line says so)
    python train.py --stage all --run-dir runs/default
    # a 7B model on one H200: the updates checkpoint activations when they would not fit (--set grad_ckpt=auto|on|off)
    python train.py --stage all --run-dir runs/qwen7b --model Qwen/Qwen2.5-Coder-7B-Instruct
    # the paper's ablations in small: the same run without RFT, without critic pre-training
    python train.py --stage all --run-dir runs/no-rft --skip rft
    python train.py --stage all --run-dir runs/no-critic --skip critic
    # a large model behind any OpenAI-compatible server writes the demonstrations instead (distillation)
    python train.py --stage all --run-dir runs/distil --teacher-url http://localhost:8000/v1 --teacher-model Qwen/Qwen3-32B
    # one stage at a time (each needs its predecessor's checkpoint in --run-dir), resumable after kill -9
    python train.py --stage ppo --run-dir runs/default --resume
    # several GPUs (each rank rolls out and scores on its own GPU; --env-gpus K keeps K GPUs for timing)
    accelerate launch --multi_gpu --num_processes 4 train.py --stage all --run-dir runs/x4

The algorithm, as differences from named baselines
  sft     the paper starts RL from a model that already uses the tools; ours cannot, so the run creates that
          start: a teacher (teacher.py: a scripted solver of the elementwise family, or any OpenAI-compatible
          model) works the TRAINING tasks through the same ReAct tools, env.py scores every episode, and only
          those at reward >= 1 become demonstrations (RUN/demos.jsonl, reused on a rerun). Plain SFT on them:
          next-token loss on the teacher's tokens only (loss_mask), never on prompts or tool output. Each
          demonstration also goes in once more as a single-turn answer (its files, fenced) to the warm-up's prompt:
          the warm-up samples in a format the student has seen (--set sft_single_turn=false: tool calls only).
  warmup  PPO as in the paper's single-turn warm-up (actor + critic, token-level GAE with gamma = 1, value
          clipping, token-mean loss) with DAPO's asymmetric clip (eps_low 0.2, eps_high 0.28) and two changes
          from VC-PPO / VAPO: decoupled lambdas (actor advantages lambda 0.95, critic targets lambda 1, i.e.
          Monte-Carlo returns that the critic's own errors cannot bias), and a batch whose rewards are all
          equal trains the critic only (its advantages would be the critic's errors, not information).
          Reward = env.py's milestone reward (-1/1/2/3) on the last response token. No KL penalty by default
          (--set kl_coef=...; the reference is the base with the adapter off); the KL to it is logged anyway.
  rft     the same next-token loss on the warmed-up actor's own multi-turn episodes, kept only if reward > 0
          and free of bad patterns, judged on behaviour: a malformed or unknown tool call; the same call on an
          unchanged workspace twice in a row (re-profiling until the noise looks good); such a call 3+ times
          (a loop). Each call is keyed by the workspace's content before it (agent.py records a hash per
          turn), so compile -> edit -> compile is debugging, and kept.
  critic  a scalar value head on the base model with its own LoRA adapter, regressed (MSE) on Monte-Carlo
          returns (gamma 1: the episode's reward at every model token) of ALL the RFT episodes (the critic
          must also learn what failure looks like; with --skip rft it rolls out its own). The paper regresses
          on GAE(lambda 0.95) targets; computed from a zero critic those give a token d tokens before the end
          only R * 0.95^d, i.e. nothing for the thousands of tokens of an agent episode. Epochs run until the
          explained variance on held-out episodes has not improved for critic_patience epochs; the best
          epoch is kept. With --skip critic, PPO starts from a fresh critic (the paper's ablation).
  ppo     the warm-up's PPO over whole multi-turn episodes: GAE runs over the sequences' own layout, where
          tool-output tokens are gaps it skips (the value is carried across them); advantages whitened over
          the model tokens of the whole global batch.
  rollout/training mismatch: tokens are sampled by the rollout engine (merged LoRA, fused projections, reused
          K/V; on a GPU bf16 and compiled layers), the PPO ratio is taken against log-probs that the training
          forward recomputes. Every step logs mean and p99 |delta log p| and the share of ratios outside
          [0.8, 1.2], and weights the PPO loss per token by min(pi_train / pi_rollout, tis_cap) (truncated
          importance sampling; tis_cap 2; 0 turns it off).
  Harness failures (the task's reference does not run, the evaluation crashed) are not the policy's -1:
  those episodes are left out of training and of the reward statistics (harness_fail counts them).
  One base model in memory: the actor and the critic are two LoRA adapters of it ("actor", "critic"), the
  KL reference is the same base with adapters disabled. Multi-rank: no DDP wrapper; losses are divided by
  global token counts and LoRA gradients summed over ranks (rl.py), so N ranks compute the 1-process gradient.

The held-out evaluation: the test split of the dataset (tasks the teacher never sees), greedy agent episodes
scored by env.py, for the base model and after every stage; the run ends with one table (stage x well-formed
calls, built, pass rate, faster than eager, faster than torch.compile, mean reward, mean turns; docs/curriculum.md
says how to read it), also in RUN/stages.jsonl and RUN/stages.png.

Run folder (--run-dir): config.json, metrics.jsonl (one JSON line per step), stages.jsonl (the table), tb/
(TensorBoard, if installed), data/ (the synthesised dataset when no --dataset), demos.jsonl (the teacher's
demonstrations), eval/STAGE/ (held-out episodes), and sft/ warmup/ rft/ critic/ ppo/, each with
ckpt-NNNNNN/{actor,critic}/ (standard PEFT adapters: PeftModel.from_pretrained(base, ".../actor")),
value_head.pt, state.pt (optimisers, schedulers, step), latest.json (the newest complete checkpoint),
and rollouts/ (scored rollouts, reused on --resume so no kernel is scored twice).

This file holds the configuration, the stage driver and the stages. Under it: rl.py (GAE, losses, the LoRA
actor/critic, the PPO and supervised updates), rollouts.py (task splits, episode filters and statistics), runs.py
(the run's context, its cores and GPUs, checkpoints and --resume, the step log), stages.py (the held-out rows, the
table and the chart).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

import agent
import build
import env
import teacher
import tools
from rl import (adapter_params, add_adapters, barrier, choose_grad_ckpt, critic_epoch, critic_ev, dist_on, gather, ppo_update,
                sft_epoch, shard)
from rollouts import fit_context, harness_failed, rft_filter, rollout_stats, split_tasks, step_tasks, trainable
from runs import (Ctx, begin_stage, claim_devices, fmt_time, gpu_peak, latest, load_checkpoint, log_event, log_step, n_cores,
                  new_opts, open_tb, save_checkpoint, stage_done, stage_end, time_generate, workers, write_json)
from stages import (STAGES, all_rewards_minus_one, eval_row, minus_one_note, read_rows, stage_chart, stage_note,
                    stage_table)
from tasks import load_data

ROOT = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------
# Configuration: one dataclass, four presets
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    preset: str = "default"
    model: str | None = None  # None = agent.DEFAULT_MODEL (the embedded SmolLM2-135M-Instruct)
    dataset: str | None = None  # None = synthesise one into run_dir/data
    backend: str = "auto"
    run_dir: str = "runs/default"
    seed: int = 0
    # data: synthesised when no --dataset is given; the test split (eval_tasks of them) is held out
    synth_tasks: int = 96
    family: str = "elementwise"  # synth.py --family: elementwise (the teacher's family) | paper (the paper's mix)
    # synth.py --window-ms: the eager-time window tasks are sized for; 0 = synth.py's (1-100 ms on CUDA, 0.1-10 on CPU).
    # A memory-bound chain needs ~0.5-2 GB tensors to last 1-100 ms on an H200, and a verdict moves ~15 whole outputs
    # between processes (~1.6 s per GiB): smaller windows buy verdicts of seconds, at the price of a larger share of
    # the harness's fixed per-run overhead in every runtime (README, "What a runtime is").
    window_lo_ms: float = 0.0
    window_hi_ms: float = 0.0
    eval_tasks: int = 32  # held-out tasks scored after every stage (never given to the teacher)
    # sft: teacher demonstrations on the training tasks
    sft_tasks: int = 64  # training tasks the teacher works (0: all)
    sft_samples: int = 1  # teacher episodes per task (each draws its own second kernel variant, in half of them)
    sft_epochs: int = 8  # the teacher's fixed texts (binding, header) must be reproduced token for token: many steps
    sft_single_turn: bool = True  # every demonstration also in the warm-up's single-turn format (teacher.single_turn_demo)
    sft_lr: float = 5e-4  # LoRA on a 135M model; the paper's stages use lower rates on a 230B model
    sft_batch: int = 4  # sequences per optimizer step (64 demonstrations and their single-turn copies: 32 steps an epoch)
    teacher_url: str | None = None  # an OpenAI-compatible /v1 endpoint writes the demonstrations instead
    teacher_model: str | None = None
    # rollouts
    tasks_per_step: int = 16  # prompts per rank per step
    max_new_tokens: int = 1536  # per model turn (the teacher's longest CUDA turn is ~1,040 tokens)
    warmup_new_tokens: int = 2048  # the warm-up's one answer holds every file (the teacher's: median 1,125, max ~1,600)
    max_turns: int = 12  # the teacher's episodes take 6-9 turns (11 with two retries of a failed reference)
    max_context: int = 8192  # SmolLM2's trained context; a longer demonstration is cut (its files are written early)
    temperature: float = 1.0
    # stage lengths
    warmup_steps: int = 10
    rft_tasks: int = 32  # tasks rolled out (per rank) to collect RFT/critic episodes
    rft_epochs: int = 3
    critic_epochs: int = 30  # at most; pre-training stops once held-out explained variance stops improving
    critic_patience: int = 3  # ... for this many epochs (the best epoch's critic is kept)
    ppo_steps: int = 10
    # optimisation
    lora_r: int = 16
    lora_alpha: int = 32
    actor_lr: float = 1e-5
    critic_lr: float = 2e-5
    rft_lr: float = 5e-5
    lr_warmup: int = 2  # steps of linear lr warm-up (optimizer steps)
    ppo_epochs: int = 1  # passes over each rollout batch
    minibatches: int = 2  # optimizer steps per pass
    micro_batch: int = 4  # sequences per forward (gradient accumulation up to a minibatch); halved on out-of-memory
    grad_ckpt: str = "auto"  # activation checkpointing in the updates: auto (when the activations would not fit) | on | off
    eps_low: float = 0.2
    eps_high: float = 0.28
    value_clip: float = 0.5
    gamma: float = 1.0
    lam: float = 0.95  # GAE lambda of the actor's advantages
    critic_lam: float = 1.0  # ... of the critic's targets (1: Monte-Carlo returns, as VC-PPO / VAPO)
    tis_cap: float = 2.0  # truncated importance weight min(pi_train / pi_rollout, C) on the PPO loss; 0 = off
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    ckpt_every: int = 1  # steps between checkpoints (1: a kill -9 loses at most one step)
    env_gpus: int = 0  # GPUs kept apart for kernel timing (the last K visible ones)
    synth_workers: int = 0  # synth.py's sandboxed children; 0 = from the machine's cores (workers())
    tool_workers: int = 0  # tool calls (builds, verdicts) of different episodes in parallel; 0 = from the cores
    demos: str | None = None  # extra hand-written episodes (agent.save_episodes format) added to RFT


PRESETS = {
    # CI on a 2-core CPU: a 2-layer random model, 16-token turns, 2 tasks per step, a couple of steps; the teacher
    # works one training task (its build is cached after the first run), one held-out task.
    "tiny": dict(model="tiny-random", synth_tasks=4, eval_tasks=1, sft_tasks=1, sft_epochs=2, sft_batch=1, sft_lr=1e-3,
                 tasks_per_step=2, max_new_tokens=16, warmup_new_tokens=16, max_turns=2, max_context=4096,
                 warmup_steps=2, rft_tasks=2, rft_epochs=1, critic_epochs=1, ppo_steps=2, lora_r=4, lora_alpha=8,
                 minibatches=1, micro_batch=2, actor_lr=1e-3, critic_lr=1e-3, rft_lr=1e-3, lr_warmup=0),
    # A machine without a GPU (what `--stage all` picks there unless --preset is given): the embedded 135M model,
    # 2 tasks per step, short turns. It shows that the stages run end to end, not that they learn.
    # TODO: not yet "minutes": each update is a forward/backward of 135M over thousands of tokens, which took
    # 12 min (warm-up step) and 23 min (critic epoch) on a shared 2-core machine at load 10-70 (docs/recipe.md).
    "cpu": dict(synth_tasks=6, eval_tasks=2, sft_tasks=2, sft_epochs=1, sft_batch=2, tasks_per_step=2, max_new_tokens=48,
                warmup_new_tokens=48, max_turns=2, max_context=8192, warmup_steps=1, rft_tasks=2, rft_epochs=1,
                critic_epochs=1, critic_patience=1, ppo_steps=1, lora_r=4, lora_alpha=8, minibatches=1, micro_batch=1,
                lr_warmup=0),
    # One H200 with the embedded 135M model: 64 training tasks for the teacher, 32 held out, sized for 0.3-3 ms in
    # eager (0.5-2.4 ms measured): at synth.py's 1-100 ms a verdict moves GB-sized outputs (~50 s), and the
    # teacher's first 8 episodes took over 7 minutes; at this window 16 took 4 min 22 s (docs/results.md).
    # Rollouts at temperature 0.7: after sft on 40 demonstrations, PPO's sampled episodes at 1.0 were never correct
    # (0 of 20: equal rewards, no update), at 0.7 7 of 20 were (an H100, docs/results.md); the policy's log-probs are
    # taken at the same temperature (rl.action_logprobs), so the ratio and the KL are those of what was sampled.
    "default": dict(window_lo_ms=0.3, window_hi_ms=3.0, temperature=0.7),
    # The paper's hyper-parameters (actor lr 3e-6, critic lr 6e-6, gamma 1, lambda 0.95, eps 0.2/0.28,
    # 150 PPO steps) with batch, context and turns scaled to one 8-GPU node (paper: batch 1024, 128k
    # context, 150 turns), on the paper's task mix (the scripted teacher solves none of it: --teacher-url).
    "paper": dict(synth_tasks=6000, family="paper", eval_tasks=250, sft_tasks=512, sft_epochs=2, sft_lr=5e-5,
                  sft_batch=32, tasks_per_step=32, max_new_tokens=4096, warmup_new_tokens=4096, max_turns=50,
                  max_context=32768, warmup_steps=50, rft_tasks=512, rft_epochs=2, critic_epochs=30, ppo_steps=150,
                  lora_r=64, lora_alpha=128, actor_lr=3e-6, critic_lr=6e-6, rft_lr=1e-5, lr_warmup=5, minibatches=4,
                  micro_batch=1),
}


# ----------------------------------------------------------------------------------------------
# The stage driver: base evaluation, then each stage followed by its held-out evaluation
# ----------------------------------------------------------------------------------------------
def run(cfg: Config, a, stages: list, order: list, src: str | None) -> int:
    from accelerate import Accelerator
    t_start = time.time()
    cuda = torch.cuda.is_available()
    acc = Accelerator(cpu=not cuda)  # CPU: gloo across processes; GPU: NCCL
    rank, world = acc.process_index, acc.num_processes
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = env.resolve_backend(cfg.backend)
    cores = n_cores()
    cfg.synth_workers, cfg.tool_workers = (cfg.synth_workers or workers(cores, backend)[0],
                                           cfg.tool_workers or workers(cores // local_world, backend)[1])
    run_dir = Path(cfg.run_dir)
    if acc.is_main_process:  # the first line: what the machine gives the run
        print(f"train | {cores} cores: synthesis {cfg.synth_workers} workers, {cfg.tool_workers} tool calls in parallel "
              f"per rank | preset {cfg.preset} | stages {' -> '.join(stages)}"
              + (f" (skipped: {', '.join(a.skip)})" if a.skip else "") + f" | backend {backend} | run {run_dir}", flush=True)
    device = str(acc.device) if cuda else "cpu"
    claim_devices(cuda, cores, local_world, acc.local_process_index, cfg.env_gpus)  # threads, or training/timing GPUs
    run_dir.mkdir(parents=True, exist_ok=True)
    if src is None and a.stage == "all":
        if acc.is_main_process:
            src = synthesise(cfg, run_dir, backend)
        barrier()
        src = str(run_dir / "data")
        if not (Path(src) / "dataset_dict.json").is_file():
            raise env.UsageError("dataset synthesis failed on rank 0")
    train, test = load_data(src, True) if src else ([], [])
    teacher_tasks, heldout = split_tasks(train, test, cfg)
    # The compiler's once-per-machine set-up (precompiled header, probes, guard: 36 s on a fresh H100), beside the
    # model's loading and the base row, not in the first verdicts; after synthesis, whose filter times candidates.
    def prepare():  # (a failure here is the first build's to report, in its verdict)
        with contextlib.suppress(Exception):
            build.prepare(backend)
    prep = threading.Thread(target=prepare, daemon=True)
    prep.start()
    cfg.dataset = cfg.dataset or src
    if acc.is_main_process:
        write_json(run_dir / "config.json", {**dataclasses.asdict(cfg), "skip": list(a.skip)})
        print(f"model: loading {cfg.model or agent.DEFAULT_MODEL} on {device}", flush=True)
    policy = build_policy(cfg, run_dir, device, acc.is_main_process)
    barrier()
    pm, head = add_adapters(policy.model, cfg, device)
    policy.model = pm
    tb = open_tb(run_dir) if acc.is_main_process else None
    ctx = Ctx(cfg=cfg, run_dir=run_dir, rank=rank, world=world, device=device, backend=backend, policy=policy, pm=pm,
              head=head, train=train, teacher_tasks=teacher_tasks, heldout=heldout, tb=tb, known_tools=tuple(tools.TOOL_ARGS),
              prev={s: (order[i - 1] if i else None) for i, s in enumerate(order)})
    time_generate(ctx)  # ctx.gen_s: the generate / env / update split of each step
    n_params = sum(p.numel() for p in pm.parameters())
    ctx.say(f"train | model {cfg.model or agent.DEFAULT_MODEL} ({n_params / 1e6:.1f}M params, LoRA r={cfg.lora_r}) | tasks "
            f"{len(train)} train ({len(teacher_tasks)} for the teacher) / {len(heldout)} held-out | ranks {world} | device {device}")
    on, why = choose_grad_ckpt(cfg, pm, device)  # decided once, with the model loaded and no KV cache yet (rl.py says how)
    cfg.grad_ckpt = "on" if on else "off"
    ctx.say(f"train | activation checkpointing {cfg.grad_ckpt} in the updates: {why}")
    log_event(ctx, {"event": "start", "setup_s": round(time.time() - t_start, 1), "resume": a.resume,  # data, model
                    "grad_ckpt": cfg.grad_ckpt})
    if stages[0] == order[0]:  # a run from the start: the base model's row first
        heldout_eval(ctx, "base")
    for s in stages:
        if s == "sft":
            stage_sft(ctx, a.resume)
        elif s == "warmup":
            ppo_stage(ctx, "warmup", cfg.warmup_steps, a.resume)
        elif s == "rft":
            stage_rft(ctx, a.resume)
        elif s == "critic":
            stage_critic(ctx, a.resume)
        else:
            ppo_stage(ctx, "ppo", cfg.ppo_steps, a.resume)
        heldout_eval(ctx, s)
    if ctx.main:
        rows = read_rows(run_dir)
        print(stage_table(rows))
        print(f"chart: {run_dir / 'stages.png'}" if stage_chart(rows, run_dir / "stages.png")
              else "no chart (matplotlib is not installed: pip install matplotlib)")
        if all_rewards_minus_one(run_dir, rows):  # expected of a tiny or CPU run; said so, so nobody hunts a bug
            print(minus_one_note(run_dir, cfg.model == TINY, cfg.preset))
        print(f"done in {fmt_time(time.time() - t_start)} | checkpoints: " +
              " ".join(str(run_dir / s / latest(run_dir / s)["ckpt"]) for s in stages if latest(run_dir / s)) +
              f" | table: {run_dir / 'stages.jsonl'} | metrics: {run_dir / 'metrics.jsonl'}")
    if tb is not None:
        tb.close()
    prep.join()  # (a run that built nothing leaves no compiler behind)
    barrier()
    if dist_on():  # gloo and NCCL ask for it: a rank torn down at interpreter exit may abort with its threads running
        torch.distributed.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# Rollouts (scored, then cached in the run folder)
# ----------------------------------------------------------------------------------------------
def cached(path: Path, make):
    """Scored rollouts are saved before they are trained on; a resumed run reads them back instead of
    generating and scoring again (scoring kernels is the expensive part)."""
    if path.is_file():
        return agent.load_episodes(path), True
    eps = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    agent.save_episodes(tmp, eps)
    os.replace(tmp, path)
    return eps, False


def single_turn_rollouts(ctx: Ctx, tasks: list) -> list:
    """Warm-up rollouts: agent.run_single_turn (prompt = SKILL.md + task, one answer with fenced files, scored
    by env.py), with the engine's log-prob of each sampled token added for the importance weight."""
    cfg = ctx.cfg
    ctx.pm.set_adapter("actor")
    ctx.say(f"  generating {len(tasks)} answers of up to {cfg.warmup_new_tokens} tokens on each of {ctx.world} rank(s)")
    eps = agent.run_single_turn(ctx.policy, tasks, ctx.backend, cfg.warmup_new_tokens, cfg.temperature, progress=ctx.main)
    lps = getattr(ctx.policy, "last_logprobs", None) or [None] * len(eps)  # set by the one generate call above
    for ep, lp in zip(eps, lps):
        n_out = sum(ep["loss_mask"])
        ep["logprobs"] = [None] * (len(ep["tokens"]) - n_out) + (list(lp)[:n_out] if lp is not None else [None] * n_out)
    return eps


def agent_rollouts(ctx: Ctx, tasks: list, out_dir: Path, temperature=None) -> list:
    ctx.pm.set_adapter("actor")
    cfg = ctx.cfg
    return agent.run_episodes(ctx.policy, tasks, backend=ctx.backend, max_turns=cfg.max_turns, max_context=cfg.max_context,
                              out_dir=str(out_dir), max_new_tokens=cfg.max_new_tokens, progress=ctx.main,
                              temperature=cfg.temperature if temperature is None else temperature,
                              tool_workers=cfg.tool_workers)


# ----------------------------------------------------------------------------------------------
# Stages: each one is a visible loop
# ----------------------------------------------------------------------------------------------
def stage_sft(ctx: Ctx, resume: bool):
    """Cold start: teacher demonstrations on the training tasks (teacher_demos), then next-token loss on the
    teacher's tokens only, sft_batch demonstrations per optimizer step, sft_epochs epochs."""
    cfg = ctx.cfg
    opts = new_opts(ctx, ("actor",), actor_lr=cfg.sft_lr)
    start = begin_stage(ctx, "sft", opts, resume)
    if start is None:
        return
    demos, n_eps = teacher_demos(ctx)
    by_id = {t["task_id"]: t for t in ctx.train}
    single = [teacher.single_turn_demo(d, by_id[d["task_id"]], ctx.policy.tokenizer, ctx.backend, ctx.policy.stop[0])
              for d in (demos if cfg.sft_single_turn else []) if d["task_id"] in by_id]
    single = [d for d in single if d is not None]
    if cfg.sft_single_turn and len(single) < len(demos):
        ctx.say(f"sft: {len(demos) - len(single)} of {len(demos)} demonstrations have no single-turn copy (a task not in "
                "this run's training split, a bash call, or files the answer format cannot name)")
    data = fit_context(shard(demos + single, ctx.rank, ctx.world), cfg.max_context)
    n_mb = max(1, math.ceil(len(demos + single) / max(1, cfg.sft_batch)))
    if not demos:
        ctx.say("sft: no demonstrations to imitate; the actor stays the base model (the scripted teacher solves the "
                "elementwise family only: --set family=elementwise, or --teacher-url)")
    ctx.pm.set_adapter("actor")
    t_begin = time.time()
    for epoch in range(start, cfg.sft_epochs if demos else start):
        t0 = time.time()
        loss = sft_epoch(ctx.pm, opts["actor"], data, n_mb, cfg, ctx.device, epoch, stream=2)
        log_step(ctx, "sft", epoch, cfg.sft_epochs, {"loss": loss, "demos": len(demos), "single_turn": len(single),
                                                     "lr": opts["actor"][1].get_last_lr()[0]},
                 time.time() - t0, (time.time() - t_begin) / (epoch + 1 - start) * (cfg.sft_epochs - epoch - 1))
        save_checkpoint(ctx, "sft", epoch, opts, done=epoch + 1 == cfg.sft_epochs)
    if not latest(ctx.run_dir / "sft") or not latest(ctx.run_dir / "sft")["done"]:  # nothing trained: still a checkpoint
        save_checkpoint(ctx, "sft", max(start, cfg.sft_epochs - 1), opts, done=True)
    log_event(ctx, {"event": "stage_end", "stage": "sft", "demos": len(demos), "single_turn": len(single), "episodes": n_eps,
                    "tasks": len(ctx.teacher_tasks)})


def teacher_demos(ctx: Ctx) -> tuple[list, int]:
    """(demonstrations, teacher episodes). RUN/demos.jsonl when it exists (a rerun reuses it: scoring is the
    expensive part); otherwise each rank's teacher works its share of the training tasks (teacher.make_demos:
    episodes scored by env.py, only reward >= 1 kept), kept in chunks of tasks_per_step tasks in
    RUN/sft/teacher/rankR/chunk-N/, each episode as it finishes, so a killed run loses only the episodes in flight;
    rank 0 writes the union."""
    cfg, path = ctx.cfg, ctx.run_dir / "demos.jsonl"
    parts = ctx.run_dir / "sft" / "teacher"
    if not path.is_file():
        who = f"{cfg.teacher_model} at {cfg.teacher_url}" if cfg.teacher_url else "the scripted teacher (teacher.py)"
        ctx.say(f"sft: {who} works {len(ctx.teacher_tasks)} training task(s) x {cfg.sft_samples} episode(s) "
                f"(the {len(ctx.heldout)} held-out tasks are never shown to it); env.py scores each, reward >= 1 kept")
        policy = teacher.load_teacher(ctx.backend, url=cfg.teacher_url, teacher_model=cfg.teacher_model, seed=cfg.seed,
                                      tokenizer=ctx.policy.tokenizer)
        teacher.make_demos(policy, shard(ctx.teacher_tasks, ctx.rank, ctx.world), ctx.backend, parts / f"rank{ctx.rank}",
                           samples=cfg.sft_samples, chunk=max(1, cfg.tasks_per_step), progress=ctx.main,
                           tool_workers=cfg.tool_workers)
        barrier()
        if ctx.main:
            demos = [e for f in sorted(parts.glob("rank*/chunk-*/demos.jsonl")) for e in agent.load_episodes(f)]
            agent.save_episodes(path.with_name(path.name + ".tmp"), demos)
            os.replace(path.with_name(path.name + ".tmp"), path)
            eps = [e for f in sorted(parts.glob("rank*/chunk-*/trajectories.jsonl")) for e in agent.load_episodes(f)]
            ctx.say(f"sft: teacher | {teacher.summary(eps)} | written to {path}")
        barrier()
    else:
        ctx.say(f"sft: reusing the demonstrations in {path}")
    n_eps = sum(len(agent.load_episodes(f)) for f in parts.glob("rank*/chunk-*/trajectories.jsonl"))
    return agent.load_episodes(path), n_eps


def ppo_stage(ctx: Ctx, stage: str, n_steps: int, resume: bool):
    """warmup (single-turn) and ppo (multi-turn agent episodes): roll out, score, update, log, checkpoint."""
    cfg = ctx.cfg
    opts = new_opts(ctx)
    start = begin_stage(ctx, stage, opts, resume)
    if start is None:
        return
    t_begin, rows = time.time(), []
    for step in range(start, n_steps):
        t0, ctx.gen_s = time.time(), 0.0
        tasks = [ctx.train[i] for i in step_tasks(len(ctx.train), step, cfg.tasks_per_step, ctx.world, ctx.rank, cfg.seed)]
        torch.manual_seed(cfg.seed * 7919 + step * 101 + ctx.rank)  # sampling: reproducible per (step, rank)
        path = ctx.run_dir / stage / "rollouts" / f"step-{step:06d}-rank{ctx.rank}.jsonl"
        if stage == "warmup":
            eps, reused = cached(path, lambda: single_turn_rollouts(ctx, tasks))
        else:
            eps, reused = cached(path, lambda: agent_rollouts(ctx, tasks, ctx.run_dir / stage / "agent" / f"step-{step:06d}-rank{ctx.rank}"))
        if reused:
            ctx.say(f"{stage} {step + 1}/{n_steps}: reusing {len(eps)} scored rollouts from {path.parent}")
        ctx.policy.release()  # the engine's KV cache holds keys/values of the weights about to change
        t_roll, roll_peak = time.time() - t0, gpu_peak("rollout_")  # log_step records the update's peak
        ctx.say(f"{stage} {step + 1}/{n_steps}: update on {len(eps) * ctx.world} episodes "
                f"({sum(sum(e['loss_mask']) for e in eps)} model tokens on this rank)")
        upd = ppo_update(ctx.pm, ctx.head, opts, trainable(fit_context(eps, cfg.max_context)), cfg, ctx.device, step)
        row = {**rollout_stats(gather(eps)), **upd, "rollout_s": round(t_roll, 2), "generate_s": round(ctx.gen_s, 2),
               "env_s": round(t_roll - ctx.gen_s, 2), "update_s": round(time.time() - t0 - t_roll, 2), "reused": reused,
               "tokens": sum(min(len(e["tokens"]), cfg.max_context) for e in eps), **roll_peak}  # this rank's update batch
        rows.append(row)
        t_step = time.time() - t0
        done_here = step + 1 - start
        log_step(ctx, stage, step, n_steps, row, t_step, (time.time() - t_begin) / done_here * (n_steps - step - 1))
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == n_steps:
            save_checkpoint(ctx, stage, step, opts, done=step + 1 == n_steps)
    stage_end(ctx, stage, rows, steps=n_steps)


def own_episodes(ctx: Ctx, stage: str) -> list:
    """Multi-turn episodes of the current actor on rft_tasks training tasks per rank, cached per chunk in
    RUN/STAGE/rollouts (a resumed run does not score them again); every rank's, in a fixed order."""
    cfg, sd = ctx.cfg, ctx.run_dir / stage
    n_chunks = max(1, math.ceil(cfg.rft_tasks / cfg.tasks_per_step))
    for c in tqdm(range(n_chunks), desc=f"{stage} rollouts", unit="chunk", disable=not ctx.main or n_chunks == 1):
        tasks = [ctx.train[i] for i in step_tasks(len(ctx.train), c, cfg.tasks_per_step, ctx.world, ctx.rank, cfg.seed + 1)]
        torch.manual_seed(cfg.seed * 7919 + 50_000 + c * 101 + ctx.rank)
        cached(sd / "rollouts" / f"chunk-{c:06d}-rank{ctx.rank}.jsonl",
               lambda: agent_rollouts(ctx, tasks, sd / "agent" / f"chunk-{c:06d}-rank{ctx.rank}"))
    ctx.policy.release()
    barrier()
    return [e for f in sorted((sd / "rollouts").glob("chunk-*.jsonl")) for e in agent.load_episodes(f)]


def stage_rft(ctx: Ctx, resume: bool):
    """Roll out the warmed-up actor's multi-turn episodes, keep the clean successful ones, and fine-tune the
    actor on them with next-token loss over model tokens only."""
    cfg = ctx.cfg
    opts = new_opts(ctx, ("actor",), actor_lr=cfg.rft_lr)
    start = begin_stage(ctx, "rft", opts, resume)
    if start is None:
        return
    episodes = own_episodes(ctx, "rft")
    kept, dropped = rft_filter(episodes, ctx.known_tools)
    demos = load_demos(ctx.cfg.demos)
    why = ", ".join(f"{k} x{v}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1])) or "none"
    ctx.say(f"rft: kept {len(kept)} of {len(episodes)} episodes" + (f" (+{len(demos)} demos)" if demos else "")
            + f" | dropped: {why}")
    data = fit_context(shard(kept + demos, ctx.rank, ctx.world), cfg.max_context)
    log_event(ctx, {"event": "rft_filter", "episodes": len(episodes), "kept": len(kept), "demos": len(demos), "dropped": dropped})
    rows, t_begin = [], time.time()
    if not kept + demos:
        ctx.say("rft: nothing to imitate; the actor is kept as the warm-up left it")
    ctx.pm.set_adapter("actor")
    for epoch in range(start, cfg.rft_epochs):
        t0 = time.time()
        loss = sft_epoch(ctx.pm, opts["actor"], data, cfg.minibatches, cfg, ctx.device, epoch)
        row = {"loss": loss, "kept": len(kept), "n": len(episodes),
               **{k: v for k, v in rollout_stats(episodes).items() if k != "n"}}
        rows.append(row)
        log_step(ctx, "rft", epoch, cfg.rft_epochs, row, time.time() - t0,
                 (time.time() - t_begin) / (epoch + 1 - start) * (cfg.rft_epochs - epoch - 1))
        save_checkpoint(ctx, "rft", epoch, opts, done=epoch + 1 == cfg.rft_epochs)
    if start >= cfg.rft_epochs:  # rft_epochs = 0: the stage still leaves a checkpoint for its successors
        save_checkpoint(ctx, "rft", 0, opts, done=True)
    stage_end(ctx, "rft", [{**rollout_stats(episodes)}], kept=len(kept), episodes=len(episodes))


def load_demos(path) -> list:
    """Hand-written episodes (agent.save_episodes format) added to RFT's kept set (the overfit sanity)."""
    if not path:
        return []
    return [{**e, "reward": e.get("reward", 1)} for e in agent.load_episodes(path)]


def stage_critic(ctx: Ctx, resume: bool):
    """Value pre-training: a fresh critic adapter + value head regressed (MSE) on Monte-Carlo returns of ALL
    the RFT episodes (its own rollouts with --skip rft), one epoch after another until the explained variance
    on held-out episodes (every 5th) has not improved for cfg.critic_patience epochs (at most
    cfg.critic_epochs); the best epoch's critic is kept. Explained variance before and after is logged."""
    cfg, sd = ctx.cfg, ctx.run_dir / "critic"
    opts = new_opts(ctx, ("critic",))
    start = begin_stage(ctx, "critic", opts, resume)
    if start is None:
        return
    source = "rft" if ctx.prev.get("critic") == "rft" else "critic"  # --skip rft: roll out here
    episodes = fit_context([e for e in own_episodes(ctx, source) + load_demos(cfg.demos) if not harness_failed(e)],
                           cfg.max_context)
    held = [e for i, e in enumerate(episodes) if i % 5 == 4] or episodes[-1:]
    train = [e for i, e in enumerate(episodes) if i % 5 != 4] or episodes
    mine, mine_held = shard(train, ctx.rank, ctx.world), shard(held, ctx.rank, ctx.world)
    c_params = adapter_params(ctx.pm, "critic") + list(ctx.head.parameters())
    state = torch.load(sd / latest(sd)["ckpt"] / "state.pt", weights_only=False) if start else {}
    ev0, mse0 = critic_ev(ctx.pm, ctx.head, mine_held, cfg, ctx.device)
    ev_before = state.get("ev_before", ev0)
    score = lambda ev, mse: ev if ev is not None else -mse  # constant held-out returns: nothing to explain, use MSE
    best, since = state.get("best", score(ev0, mse0)), state.get("since", 0)
    snapshot = [p.detach().clone() for p in c_params]
    ctx.say(f"critic: {len(train)} training / {len(held)} held-out episodes | held-out explained variance before: "
            + (f"{ev_before:+.3f}" if ev_before is not None else "- (constant returns)")
            + f" | up to {cfg.critic_epochs} epochs, stops after {cfg.critic_patience} without improvement")
    rows, t_begin, epoch = [], time.time(), start - 1
    for epoch in range(start, cfg.critic_epochs):
        t0 = time.time()
        loss = critic_epoch(ctx.pm, ctx.head, opts["critic"], mine, cfg, ctx.device, epoch)
        ev, mse = critic_ev(ctx.pm, ctx.head, mine_held, cfg, ctx.device)
        if score(ev, mse) > best + 1e-4:
            best, since = score(ev, mse), 0
            snapshot = [p.detach().clone() for p in c_params]
        else:
            since += 1
        stop = since >= cfg.critic_patience or epoch + 1 == cfg.critic_epochs
        row = {"vf_loss": loss, "ev": ev, "held_mse": mse, "n": len(episodes), "lr": opts["critic"][1].get_last_lr()[0]}
        rows.append(row)
        log_step(ctx, "critic", epoch, cfg.critic_epochs, row, time.time() - t0,
                 (time.time() - t_begin) / (epoch + 1 - start) * (cfg.critic_epochs - epoch - 1))
        if stop:
            with torch.no_grad():
                for p, b in zip(c_params, snapshot):
                    p.copy_(b)
        save_checkpoint(ctx, "critic", epoch, opts, done=stop, extra={"ev_before": ev_before, "best": best, "since": since})
        if stop:
            break
    if start >= cfg.critic_epochs:
        save_checkpoint(ctx, "critic", 0, opts, done=True)
    ev_after, _ = critic_ev(ctx.pm, ctx.head, mine_held, cfg, ctx.device)
    fmt = lambda x: "- (constant returns)" if x is None else f"{x:+.3f}"
    ctx.say(f"critic: held-out explained variance {fmt(ev_before)} before, {fmt(ev_after)} after "
            f"{epoch + 1} epoch(s) (the best epoch is kept)")
    ctx.pm.set_adapter("actor")
    log_event(ctx, {"event": "stage_end", "stage": "critic", "steps": len(rows), "ev_before": ev_before, "ev": ev_after,
                    "vf_loss": rows[-1]["vf_loss"] if rows else None})


# ----------------------------------------------------------------------------------------------
# Held-out evaluation after every stage (stages.py: its rows, the table, the chart)
# ----------------------------------------------------------------------------------------------
def heldout_eval(ctx: Ctx, label: str):
    """Greedy agent episodes of the actor after `label` ("base": before training) on the held-out tasks, scored
    by env.py; metrics from reward.summarize (evaluate.py's definitions). One row per label in RUN/stages.jsonl:
    a row already there is not recomputed (--resume). The critic stage leaves the actor as it found it, so its
    row repeats the previous row's numbers instead of scoring the same greedy kernels again."""
    barrier()  # every rank reads the rows rank 0 has written so far
    if label in {r["stage"] for r in read_rows(ctx.run_dir)}:
        ctx.say(f"eval | after {label}: already in {ctx.run_dir / 'stages.jsonl'} (kept)")
        return
    if not ctx.heldout:
        ctx.say(f"eval | after {label}: the dataset has no held-out tasks (test split); no row")
        return
    t0, same = time.time(), ctx.prev.get(label) if label == "critic" else None
    ctx.gen_s = 0.0  # the evaluation's generation seconds (the rest is tool calls and scoring)
    rows = {r["stage"]: r for r in read_rows(ctx.run_dir)}
    if same in rows:
        row = {**rows[same], "note": f"actor as after {same} (its evaluation); {stage_note(ctx.run_dir, label)}"}
    else:
        if label != "base":  # the stage's saved actor (a stage completed before a resume is not in memory)
            load_checkpoint(ctx, label, adapters=("actor",), head=False)
        mine, out = shard(ctx.heldout, ctx.rank, ctx.world), ctx.run_dir / "eval" / label
        ctx.say(f"eval | after {label}: {len(ctx.heldout)} held-out tasks, greedy, up to {ctx.cfg.max_turns} turns")
        if mine:
            cached(out / f"rank{ctx.rank}.jsonl", lambda: agent_rollouts(ctx, mine, out / f"agent-rank{ctx.rank}", 0.0))
        ctx.policy.release()
        barrier()
        eps = [e for f in sorted(out.glob("rank*.jsonl")) for e in agent.load_episodes(f)]
        row = eval_row(label, eps, "the base model, before training" if label == "base" else stage_note(ctx.run_dir, label))
    row.update(stage=label, eval_s=round(time.time() - t0, 1), generate_s=round(ctx.gen_s, 1), time=time.time())
    if ctx.main:
        with open(ctx.run_dir / "stages.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
    log_event(ctx, {"event": "eval", **row})
    f = lambda k: "-" if row.get(k) is None else f"{row[k]:.2f}"
    ctx.say(f"eval | after {label} | {row['n']} held-out tasks | calls {f('calls')} | built {f('built')} | pass {f('pass')} | "
            f"faster than eager {f('faster_eager')} | "
            f"faster than compile {f('faster_compile')} | reward {row['reward']:+.3f} | turns {f('turns')} | "
            f"{fmt_time(row['eval_s'])}")
    ctx.pm.set_adapter("actor")


# ----------------------------------------------------------------------------------------------
# Inputs: model, dataset, run folder (all checked before any heavy work)
# ----------------------------------------------------------------------------------------------
TINY = "tiny-random"


def check_model(name: str | None):
    """Cheap existence check (config only, no weights), so a typo fails in a second, not after a load."""
    if name == TINY:
        return
    if name in (None, agent.DEFAULT_MODEL):
        agent.default_model_path()  # raises a UsageError when the embedded model is not installed
        return
    p = Path(name).expanduser()
    missing = f"unknown model {name!r}: no such model folder or hub id"
    if str(name).endswith(".gguf"):
        if not p.is_file():
            raise env.UsageError(f"unknown model {name!r}: no such GGUF file")
        return
    if p.exists():
        if not (p / "config.json").is_file():
            raise env.UsageError(f"unknown model {name!r}: the folder has no config.json")
        return
    if p.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1:  # a path, and not there (hub ids are org/name)
        raise env.UsageError(missing)
    import socket
    from huggingface_hub import try_to_load_from_cache
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return  # in the local Hugging Face cache
    except ValueError:  # huggingface_hub's HFValidationError: not even a well-formed hub id
        raise env.UsageError(missing)
    try:
        socket.getaddrinfo("huggingface.co", 443)  # offline: say so now instead of after the hub's retries
    except OSError:
        raise env.UsageError(f"{missing} (not a local folder, a .gguf file, or in the Hugging Face cache, "
                             "and the hub is unreachable)")
    try:
        from transformers import AutoConfig
        AutoConfig.from_pretrained(name)
    except Exception as e:  # noqa: BLE001  (OSError, ValueError, HTTP errors: all mean "cannot use it")
        raise env.UsageError(f"{missing} (not a local folder, a .gguf file, or a model on the Hugging Face hub: "
                             f"{type(e).__name__})")


def build_policy(cfg: Config, run_dir: Path, device: str, main_rank: bool):
    """agent.HFPolicy around the base model. "tiny-random" is a 2-layer Llama with the embedded model's
    tokenizer, initialised from cfg.seed and saved to run_dir/base (so adapters have a base to load onto)."""
    if cfg.model != TINY:
        return agent.load_policy("hf", model=cfg.model, device=device, max_context=cfg.max_context)
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    base = run_dir / "base"
    tok = agent.embedded_tokenizer()
    if (base / "config.json").is_file():  # a resumed run: the same random base as before
        lm = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).to(device)
    else:
        torch.manual_seed(cfg.seed)  # identical on every rank
        lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=cfg.max_context + 64,
                                          tie_word_embeddings=True, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                                          bos_token_id=tok.bos_token_id)).to(device)
        if main_rank:
            tmp = run_dir / ".tmp-base"
            lm.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
            os.replace(tmp, base)
    return agent.HFPolicy(lm, tok, max_context=cfg.max_context)


def synthesise(cfg: Config, run_dir: Path, backend: str):
    """--stage all without --dataset: synth.py writes run_dir/data (resumable; skipped when it exists), with
    eval_tasks of the tasks in its test split (the held-out tasks)."""
    out = run_dir / "data"
    if (out / "dataset_dict.json").is_file():
        return str(out)
    share = min(0.5, cfg.eval_tasks / max(cfg.synth_tasks, 1))
    print(f"data: no --dataset given: synthesising {cfg.synth_tasks} tasks of the {cfg.family} family into {out} "
          f"({cfg.synth_workers} workers, test share {share:.2f})", flush=True)
    window = ["--window-ms", str(cfg.window_lo_ms), str(cfg.window_hi_ms)] if cfg.window_hi_ms else []
    r = subprocess.run([sys.executable, str(ROOT / "synth.py"), "--out", str(out), "--num-tasks", str(cfg.synth_tasks),
                        "--family", cfg.family, "--backend", backend, "--seed", str(cfg.seed),
                        "--workers", str(cfg.synth_workers), "--test-share", f"{share:.6f}", *window])
    if r.returncode != 0 or not (out / "dataset_dict.json").is_file():
        raise env.UsageError(f"dataset synthesis failed (synth.py exit code {r.returncode}); pass --dataset to use an existing one")
    return str(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="staged agentic RL for CUDA kernels (sft -> warmup -> rft -> critic -> ppo)",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    p.add_argument("--stage", required=True, choices=[*STAGES, "all"])
    p.add_argument("--skip", action="append", default=[], metavar="STAGE",
                   help=f"leave a stage out of --stage all (repeatable or a comma list: --skip rft,critic); one of {', '.join(STAGES)}")
    p.add_argument("--preset", choices=list(PRESETS), help="default: 'default' with a GPU, 'cpu' without one")
    p.add_argument("--model", help=f"base model: HF folder/hub id, .gguf file, or {TINY!r} (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", help="synth.py output folder or hub id; its test split is held out (default with --stage all: synthesise one)")
    p.add_argument("--backend", default="auto", help="kernel scoring: auto | cuda | cpu")
    p.add_argument("--run-dir", help="run folder (default runs/PRESET)")
    p.add_argument("--resume", action="store_true", help="continue the stages found in --run-dir")
    p.add_argument("--teacher-url", help="sft: an OpenAI-compatible /v1 endpoint writes the demonstrations (default: teacher.py's scripted teacher)")
    p.add_argument("--teacher-model", help="sft: the model name on --teacher-url")
    p.add_argument("--env-gpus", type=int, default=0, help="GPUs (the last K visible) used only for kernel timing")
    p.add_argument("--demos", help="extra hand-written episodes (JSONL, agent.save_episodes format) for RFT")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any Config field, e.g. --set warmup_steps=5 --set kl_coef=0.01")
    return p.parse_args(argv)


def parse_skip(values: list) -> tuple:
    """--skip rft --skip critic, or --skip rft,critic -> ("rft", "critic"); an unknown name is a one-line error."""
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    for n in names:
        if n not in STAGES:
            raise env.UsageError(f"--skip {n}: no such stage (stages: {', '.join(STAGES)})")
    return tuple(s for s in STAGES if s in names)


def make_config(a) -> Config:
    if a.preset is None:
        a.preset = "default" if torch.cuda.is_available() else "cpu"
        if a.preset == "cpu":  # the first line a user sees: the default preset would take hours on a CPU
            print("train.py: no GPU found: running the CPU-sized preset 'cpu' (the embedded 135M model, 2 tasks per step, "
                  "1 step per stage); pass --preset default (or tiny, paper) to choose another", flush=True)
    cfg = Config(preset=a.preset, **PRESETS[a.preset])
    for field, value in (("model", a.model), ("dataset", a.dataset), ("demos", a.demos), ("teacher_url", a.teacher_url),
                         ("teacher_model", a.teacher_model)):
        if value is not None:
            setattr(cfg, field, value)
    cfg.backend, cfg.env_gpus = a.backend, a.env_gpus
    cfg.run_dir = a.run_dir or f"runs/{a.preset}"
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for kv in a.set:
        key, _, value = kv.partition("=")
        if key not in fields or not _:
            raise env.UsageError(f"--set {kv!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}")
        cur = getattr(cfg, key)
        try:
            setattr(cfg, key, type(cur)(value) if cur is not None and not isinstance(cur, bool) else
                    (value.lower() in ("1", "true", "yes") if isinstance(cur, bool) else value))
        except ValueError:
            raise env.UsageError(f"--set {kv!r}: {value!r} is not a valid {type(cur).__name__}")
    return cfg


def check_inputs(cfg: Config, a) -> tuple[list, list, str | None]:
    """Everything that can be wrong with the command line, checked before any model or GPU work.
    Returns (stages to run, the run's stage order after --skip, dataset source)."""
    run_dir = Path(cfg.run_dir)
    a.skip = parse_skip(a.skip)
    order = [s for s in STAGES if s not in a.skip]
    if a.stage != "all" and a.stage in a.skip:
        raise env.UsageError(f"--stage {a.stage} is also in --skip")
    if not order:
        raise env.UsageError("--skip leaves no stage to run")
    stages = order if a.stage == "all" else [a.stage]
    backend = env.resolve_backend(cfg.backend)
    if cfg.env_gpus and backend != "cuda":
        raise env.UsageError("--env-gpus needs the cuda backend (it dedicates GPUs to kernel timing)")
    if cfg.teacher_url and not cfg.teacher_model:
        raise env.UsageError("--teacher-url needs --teacher-model (the server's model name)")
    if cfg.grad_ckpt not in ("auto", "on", "off"):
        raise env.UsageError(f"grad_ckpt {cfg.grad_ckpt!r}: expected auto, on or off")
    if cfg.family not in ("elementwise", "paper"):
        raise env.UsageError(f"family {cfg.family!r}: expected elementwise or paper")
    if (cfg.window_lo_ms or cfg.window_hi_ms) and not 0 < cfg.window_lo_ms < cfg.window_hi_ms:
        raise env.UsageError(f"window_lo_ms {cfg.window_lo_ms:g}, window_hi_ms {cfg.window_hi_ms:g}: expected 0 < LO < HI "
                             "(or both 0: synth.py's window)")
    if not a.resume:
        for s in stages:
            if latest(run_dir / s):
                raise env.UsageError(f"{run_dir / s} already holds a checkpoint: pass --resume to continue it, or choose another --run-dir")
    prev = order[order.index(stages[0]) - 1] if stages[0] != order[0] else None
    if prev and not stage_done(run_dir, prev):
        raise env.UsageError(f"--stage {stages[0]} needs a finished {prev} stage in {run_dir / prev}/ "
                             f"(run --stage {prev} --run-dir {run_dir} first, or --stage all, or --skip {prev})")
    saved = run_dir / "config.json"
    if saved.is_file():
        old = json.loads(saved.read_text())
        if old.get("model") != cfg.model:
            raise env.UsageError(f"{run_dir} was trained with --model {old.get('model')!r}, not {cfg.model!r}: "
                                 "adapters only fit their own base model; choose another --run-dir")
        if a.resume and old.get("preset") != cfg.preset:
            raise env.UsageError(f"{run_dir} was started with --preset {old.get('preset')}: resume it with the same preset")
    check_model(cfg.model)
    if cfg.demos and not Path(cfg.demos).is_file():
        raise env.UsageError(f"--demos {cfg.demos}: no such file")
    src = cfg.dataset or (str(run_dir / "data") if (run_dir / "data" / "dataset_dict.json").is_file() else None)
    needs_tasks = any(s in ("sft", "warmup", "rft", "ppo") for s in stages) or a.stage == "all"
    if src is not None:
        load_data(src, needs_tasks)  # validates columns and emptiness now
    elif needs_tasks and a.stage != "all":
        raise env.UsageError(f"--stage {a.stage} needs tasks: pass --dataset, or run --stage all (which synthesises them)")
    return stages, order, src


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        cfg = make_config(a)
        stages, order, src = check_inputs(cfg, a)
        return run(cfg, a, stages, order, src)
    except env.UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
