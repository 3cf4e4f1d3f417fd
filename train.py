"""train.py: the CUDA Agent recipe, scaled to one node: single-turn PPO warm-up -> rejection fine-tuning
(RFT) -> critic pre-training -> multi-turn agentic PPO, all on LoRA adapters of one base model.

    # tiny: minutes on a 2-core CPU, CPU backend, a tiny randomly initialised model (this is what CI runs)
    python train.py --stage all --preset tiny --backend cpu --run-dir runs/tiny
    # default: one H200 with the embedded SmolLM2-135M-Instruct (~7 min of stages, projected from a short H200 run: README);
    # without a GPU the same command runs the CPU-sized preset "cpu" (the first line says so)
    python train.py --stage all --run-dir runs/default
    # one stage at a time (each needs its predecessor's checkpoint in --run-dir), resumable after kill -9
    python train.py --stage ppo --run-dir runs/default --resume
    # several GPUs (each rank rolls out and scores on its own GPU; --env-gpus K keeps K GPUs for timing)
    accelerate launch --multi_gpu --num_processes 4 train.py --stage all --run-dir runs/x4
    # the same on a CPU-only machine (gloo): accelerate launch --multi_gpu --num_processes 2 train.py ... --backend cpu

The algorithm, as differences from named baselines
  warmup  PPO as in the paper's single-turn warm-up (actor + critic, token-level GAE with gamma = 1, value
          clipping, token-mean loss) with DAPO's asymmetric clip (eps_low 0.2, eps_high 0.28) and two changes
          from VC-PPO / VAPO: decoupled lambdas (actor advantages lambda 0.95, critic targets lambda 1, i.e.
          Monte-Carlo returns that the critic's own errors cannot bias), and a batch whose rewards are all
          equal trains the critic only (its advantages would be the critic's errors, not information).
          Reward = env.py's milestone reward (-1/1/2/3) on the last response token. No KL penalty by default
          (--set kl_coef=...; the reference is the base with the adapter off); the KL to it is logged anyway.
  rft     plain SFT (next-token loss on model tokens only) on the warmed-up actor's own multi-turn
          episodes, kept only if reward > 0 and free of bad patterns, judged on behaviour: a malformed or
          unknown tool call; the same call on an unchanged workspace twice in a row (re-profiling until the
          noise looks good); such a call 3+ times (a loop). Each call is keyed by the workspace's content
          before it (agent.py records a hash per turn), so compile -> edit -> compile is debugging, and kept.
  critic  a scalar value head on the base model with its own LoRA adapter, regressed (MSE) on Monte-Carlo
          returns (gamma 1: the episode's reward at every model token) of ALL rolled-out episodes (the
          critic must also learn what failure looks like). The paper regresses on GAE(lambda 0.95) targets;
          computed from a zero critic those give a token d tokens before the end only R * 0.95^d, i.e.
          nothing for the thousands of tokens of an agent episode. Epochs run until the explained variance
          on held-out episodes has not improved for critic_patience epochs; the best epoch is kept, and the
          explained variance before and after the stage is printed.
  ppo     the warm-up's PPO over whole multi-turn episodes: GAE runs over the sequences' own layout, where
          tool-output tokens are gaps it skips (the value is carried across them); advantages whitened over
          the model tokens of the whole global batch.
  rollout/training mismatch: tokens are sampled by agent.py's engine (merged LoRA, fused projections,
          reused K/V; on a GPU bf16 and compiled layers), the PPO ratio is taken against log-probs that the
          training forward recomputes. The two differ (CPU, embedded model: docs/recipe.md). The engine
          records each sampled token's log-prob; every step logs mean and p99 |delta log p| and the share
          of ratios pi_train / pi_rollout outside [0.8, 1.2], and the PPO loss is weighted per token by the
          truncated importance weight min(pi_train / pi_rollout, tis_cap) (tis_cap 2; 0 turns it off).
  Harness failures (the task's reference does not run, the evaluation crashed) are not the policy's -1:
  those episodes are left out of training and of the reward statistics (harness_fail counts them).
  One base model in memory: the actor and the critic are two LoRA adapters of it ("actor", "critic"),
  the KL reference is the same base with adapters disabled. Multi-rank: no DDP wrapper (the model
  switches adapters and generates, which DDP dislikes); every loss is divided by the global token count
  of its minibatch and LoRA gradients are SUMMED over ranks by hand, so N ranks compute the 1-process
  token-mean gradient (also with uneven shares: no episode is dropped to even them out).

Per-step log (stdout and metrics.jsonl): rollout rates and reward, geometric-mean speedup vs torch.compile
of the correct kernels, turns, malformed-call rate, end reasons; losses, entropy, clip fraction; the
critic's explained variance against its targets, mean value, advantage std, KL to the reference, learning
rate; the mismatch statistics and the mean importance weight.

Run folder (--run-dir): config.json, metrics.jsonl (one JSON line per step), tb/ (TensorBoard, if
installed), data/ (the synthesised dataset when no --dataset), and warmup/ rft/ critic/ ppo/, each with
ckpt-NNNNNN/{actor,critic}/ (standard PEFT adapters: PeftModel.from_pretrained(base, ".../actor")),
value_head.pt, state.pt (optimisers, schedulers, step), latest.json (the newest complete checkpoint),
and rollouts/ (scored rollouts, reused on --resume so no kernel is scored twice).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import agent
import env
from reward import summarize
from tasks import load_data

ROOT = Path(__file__).resolve().parent
STAGES = ("warmup", "rft", "critic", "ppo")
PREDECESSOR = {"warmup": None, "rft": "warmup", "critic": "rft", "ppo": "critic"}


# ----------------------------------------------------------------------------------------------
# Configuration: one dataclass, three presets
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    preset: str = "default"
    model: str | None = None  # None = agent.DEFAULT_MODEL (the embedded SmolLM2-135M-Instruct)
    dataset: str | None = None  # None = synthesise one into run_dir/data
    backend: str = "auto"
    run_dir: str = "runs/default"
    seed: int = 0
    # data
    synth_tasks: int = 64  # tasks synthesised when no --dataset is given
    # rollouts
    tasks_per_step: int = 16  # prompts per rank per step
    max_new_tokens: int = 768  # per model turn
    max_turns: int = 6
    max_context: int = 8192
    temperature: float = 1.0
    # stage lengths
    warmup_steps: int = 10
    rft_tasks: int = 32  # tasks rolled out (per rank) to collect RFT/critic episodes
    rft_epochs: int = 3
    critic_epochs: int = 30  # at most; pre-training stops once held-out explained variance stops improving
    critic_patience: int = 3  # ... for this many epochs (the best epoch's critic is kept)
    ppo_steps: int = 10
    eval_tasks: int = 16
    # optimisation
    lora_r: int = 16
    lora_alpha: int = 32
    actor_lr: float = 1e-5
    critic_lr: float = 2e-5
    rft_lr: float = 5e-5
    lr_warmup: int = 2  # steps of linear lr warm-up (optimizer steps)
    ppo_epochs: int = 1  # passes over each rollout batch
    minibatches: int = 2  # optimizer steps per pass
    micro_batch: int = 4  # sequences per forward (gradient accumulation up to a minibatch)
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
    demos: str | None = None  # extra hand-written episodes (agent.save_episodes format) added to RFT


PRESETS = {
    # CI on a 2-core CPU: a 2-layer random model, 16-token turns, 2 tasks per step, a couple of steps.
    "tiny": dict(model="tiny-random", synth_tasks=3, tasks_per_step=2, max_new_tokens=16, max_turns=2,
                 max_context=4096, warmup_steps=2, rft_tasks=2, rft_epochs=1, critic_epochs=1, ppo_steps=2,
                 eval_tasks=1, lora_r=4, lora_alpha=8, minibatches=1, micro_batch=2, actor_lr=1e-3,
                 critic_lr=1e-3, rft_lr=1e-3, lr_warmup=0),
    # A machine without a GPU (what `--stage all` picks there unless --preset is given): the embedded 135M model,
    # 2 tasks per step, short turns. Every reward is -1 at this size: it shows the stages run, not that they learn.
    # TODO: not yet "minutes": each update is a forward/backward of 135M over ~1.2k-token prompts (SKILL.md), which
    # took 12 min (warm-up step) and 23 min (critic epoch) on a shared 2-core machine at load 10-70 (docs/recipe.md).
    "cpu": dict(synth_tasks=4, tasks_per_step=2, max_new_tokens=48, max_turns=2, max_context=4096, warmup_steps=1,
                rft_tasks=2, rft_epochs=1, critic_epochs=1, critic_patience=1, ppo_steps=1, eval_tasks=1, lora_r=4,
                lora_alpha=8, minibatches=1, micro_batch=2, lr_warmup=0),
    # One H200 with the embedded 135M model; meant for <= 30 minutes (not measured yet; bench/preset_time.py projects it).
    "default": dict(),
    # The paper's hyper-parameters (actor lr 3e-6, critic lr 6e-6, gamma 1, lambda 0.95, eps 0.2/0.28,
    # 150 PPO steps) with batch, context and turns scaled to one 8-GPU node (paper: batch 1024, 128k
    # context, 150 turns).
    "paper": dict(synth_tasks=6000, tasks_per_step=32, max_new_tokens=4096, max_turns=50, max_context=32768,
                  warmup_steps=50, rft_tasks=512, rft_epochs=2, critic_epochs=30, ppo_steps=150, eval_tasks=250,
                  lora_r=64, lora_alpha=128, actor_lr=3e-6, critic_lr=6e-6, rft_lr=1e-5, lr_warmup=5,
                  minibatches=4, micro_batch=1),
}


# ----------------------------------------------------------------------------------------------
# The math (pure functions on tensors; unit-tested in tests/test_train.py)
# ----------------------------------------------------------------------------------------------
def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """Generalised advantage estimation over the positions where mask == 1 only.

    rewards, values, mask: (B, T). Positions with mask == 0 (prompt, tool output, padding) are skipped:
    the recursion jumps straight from one model token to the next model token, carrying the value
    across the gap, and gets advantage 0 there. The value after the last model token is 0 (terminal).
    Returns (advantages, returns), both (B, T), zero where mask == 0."""
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)  # V of the next model token
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_value = torch.where(m, values[:, t], next_value)  # a gap keeps the carried value
        next_adv = torch.where(m, a, next_adv)
    returns = (adv + values) * (mask > 0)
    return adv, returns


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def all_sum(t):
    """Sum a tensor over ranks (identity on one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def masked_whiten(x, mask):
    """(x - mean) / std over the masked entries of the whole global batch (all ranks)."""
    s = all_sum(torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double())
    mean = s[0] / s[2].clamp(min=1)
    var = (s[1] / s[2].clamp(min=1) - mean * mean).clamp(min=0)
    return ((x - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + 1e-8)) * mask


def policy_loss(logp, old_logp, adv, eps_low=0.2, eps_high=0.28, weight=None):
    """Per-token PPO clipped surrogate with DAPO's asymmetric clip, times an optional per-token weight
    (the truncated importance weight, see tis_weight). All (N,) over model tokens.
    Returns (loss per token, clipped per token as float)."""
    ratio = torch.exp(logp - old_logp)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    return loss * weight if weight is not None else loss, (loss_clipped > loss_unclipped).float()


def tis_weight(train_logp, rollout_logp, cap):
    """Truncated importance weight min(pi_train / pi_rollout, cap) per token, (N,), no gradient. The tokens
    were sampled by the rollout engine (other kernels, merged LoRA, bf16), the PPO ratio is taken against the
    training forward's log-probs: this weight corrects for the difference, truncated so that a rare token the
    engine over-sampled cannot blow up the update (Yao et al. 2025, "truncated importance sampling").
    Tokens without a recorded rollout log-prob (NaN) get weight 1; cap <= 0 turns the weight off."""
    if cap <= 0:
        return torch.ones_like(train_logp)
    w = torch.exp(train_logp.detach() - rollout_logp).clamp(max=cap)
    return torch.where(torch.isnan(rollout_logp), torch.ones_like(w), w)


def value_loss(v, old_v, returns, clip=0.5):
    """Per-token clipped value loss 0.5 * max((v - R)^2, (v_clipped - R)^2). All (N,)."""
    v_clipped = old_v + torch.clamp(v - old_v, -clip, clip)
    return 0.5 * torch.maximum((v - returns) ** 2, (v_clipped - returns) ** 2)


def explained_variance(pred, target):
    """1 - Var(target - pred) / Var(target); None when the target is constant (nothing to explain)."""
    pred, target = torch.as_tensor(pred, dtype=torch.float64), torch.as_tensor(target, dtype=torch.float64)
    var = target.var(unbiased=False)
    if target.numel() < 2 or var < 1e-12:
        return None
    return float(1 - (target - pred).var(unbiased=False) / var)


def global_explained_variance(pred, target):
    """explained_variance over the tokens of all ranks, from five summed moments (no gather of tokens)."""
    p, t = pred.double().flatten(), target.double().flatten()
    d = t - p
    s = all_sum(torch.stack([torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device),
                             t.sum(), (t * t).sum(), d.sum(), (d * d).sum()]))
    n = float(s[0])
    if n < 2:
        return None
    var_t = float(s[2]) / n - (float(s[1]) / n) ** 2
    var_d = float(s[4]) / n - (float(s[3]) / n) ** 2
    return None if var_t < 1e-12 else 1 - var_d / var_t


def mismatch_stats(train_logp, rollout_logp) -> dict:
    """How far the rollout engine's log-probs are from the training forward's on the same tokens, over all
    ranks: mean and p99 of |delta log p| and the share of ratios pi_train / pi_rollout outside [0.8, 1.2]
    (None when no token carries a rollout log-prob, e.g. episodes from an API model)."""
    known = ~torch.isnan(rollout_logp)
    d = torch.tensor(gather((train_logp[known] - rollout_logp[known]).double().cpu().tolist()), dtype=torch.float64)
    if d.numel() == 0:
        return {"mm_mean": None, "mm_p99": None, "mm_out": None}
    ratio = torch.exp(d)  # (N,) pi_train / pi_rollout
    return {"mm_mean": float(d.abs().mean()), "mm_p99": float(torch.quantile(d.abs(), 0.99)),
            "mm_out": float(((ratio < 0.8) | (ratio > 1.2)).double().mean())}


def call_keys(episode) -> list:
    """One key per tool call that says what the call did: (tool, arguments, workspace content before the call).
    The same call on unchanged files does the same thing again; the same call after an edit is new work.
    Episodes recorded without workspace hashes fall back to (tool, arguments, observation)."""
    keys, state = [], "start"
    for t in episode.get("turns", []):
        call = (t.get("tool"), json.dumps(t.get("args"), sort_keys=True, default=str))
        keys.append(call + ((state,) if "ws" in t else (t.get("observation"),)))
        state = t.get("ws", state)
    return keys


def bad_patterns(episode, known_tools=None) -> list[str]:
    """Why an episode must not be imitated (the paper's RFT filter, judged on behaviour). Empty list = clean.
    A repeated call is the same call on the same workspace twice in a row (re-profiling unchanged code until
    the timing noise looks good; compiling twice with nothing edited); a loop is such a call 3+ times
    anywhere in the episode. compile -> edit -> compile is debugging, and kept."""
    reasons = []
    if episode.get("malformed_calls", 0):
        reasons.append("malformed tool call")
    if known_tools is not None and any(t.get("tool") is not None and t.get("tool") not in known_tools
                                       for t in episode.get("turns", [])):
        reasons.append("unknown tool")
    keys = call_keys(episode)
    if any(a == b for a, b in zip(keys, keys[1:])):
        reasons.append("repeated identical tool call")
    if any(keys.count(k) >= 3 for k in set(keys)):
        reasons.append("loop")
    return reasons


HARNESS_ERRORS = ("the reference model.py failed", "final evaluation failed")


def harness_failed(ep) -> bool:
    """The -1 was the harness's (the task's reference does not run, the evaluation itself crashed), not the
    policy's: such episodes carry no reward signal and are neither trained on nor counted in the reward."""
    err = (ep.get("verdict") or {}).get("error") or ""
    return err.startswith(HARNESS_ERRORS)


def rft_filter(episodes, known_tools=None):
    """Split episodes into (kept, drop reason counts): keep reward > 0 and no bad pattern."""
    kept, dropped = [], {}
    for ep in episodes:
        reasons = (["harness failure"] if harness_failed(ep) else []) + \
            ([] if ep["reward"] > 0 else ["reward <= 0"]) + bad_patterns(ep, known_tools)
        if reasons:
            for r in reasons:
                dropped[r] = dropped.get(r, 0) + 1
        else:
            kept.append(ep)
    return kept, dropped


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


def step_tasks(n_tasks: int, step: int, per_rank: int, world: int, rank: int, seed: int) -> list[int]:
    """Task indices for (step, rank). All ranks compute the same global order (a fresh permutation per
    pass over the data, the remainder that does not fill a whole step dropped) and take disjoint slices
    of it; the same (step, rank) always gives the same tasks, which is what makes --resume and cached
    rollouts line up. With fewer tasks than one global batch, tasks repeat within a step."""
    G = per_rank * world
    steps_per_pass = max(1, n_tasks // G)
    epoch, s = divmod(step, steps_per_pass)
    perm = list(range(n_tasks))
    random.Random(seed * 1_000_003 + epoch).shuffle(perm)
    return [perm[(s * G + rank * per_rank + j) % n_tasks] for j in range(per_rank)]


# ----------------------------------------------------------------------------------------------
# Model: one base, two LoRA adapters ("actor", "critic") and a value head
# ----------------------------------------------------------------------------------------------
def add_adapters(model, cfg: Config, device):
    """Wrap the HF causal LM with peft: adapter "actor" (active) and "critic"; return (peft model, head)."""
    import peft
    lora = lambda: peft.LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                   target_modules="all-linear", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):  # LoRA A matrices follow --seed, without touching the caller's RNG
        torch.manual_seed(cfg.seed)
        pm = peft.get_peft_model(model, lora(), adapter_name="actor")
        pm.add_adapter("critic", lora())
    pm.set_adapter("actor")
    hidden = model.config.get_text_config().hidden_size
    head = torch.nn.Linear(hidden, 1).to(device=device, dtype=torch.float32)
    torch.nn.init.zeros_(head.weight)  # starts at V = 0: no made-up values before pre-training
    torch.nn.init.zeros_(head.bias)
    # every rank seeds the same way; broadcasting rank 0's adapters guards against any other difference
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for p in [p for n, p in pm.named_parameters() if "lora_" in n] + list(head.parameters()):
                dist.broadcast(p.data, src=0)
    return pm, head


def adapter_params(pm, name):
    return [p for n, p in pm.named_parameters() if f".{name}." in n and "lora_" in n]


def hidden_states(pm, ids, attn):
    """(B, T, H) last hidden states of the backbone with the currently active adapter (no lm_head)."""
    return pm.get_base_model().base_model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state


def action_logprobs(pm, ids, attn, act, temperature=1.0):
    """Log-probs and entropies of the model tokens under softmax(logits / temperature), the distribution
    the rollouts sampled from (temperature <= 0, greedy: T = 1). act: (B, T) bool, True where token t was
    written by the model (t >= 1). Only those positions go through lm_head: prompts and tool output are
    usually most of the sequence and would cost (B, T, vocab) memory for nothing. Returns (N,), (N,)."""
    h = hidden_states(pm, ids, attn)[:, :-1]  # (B, T-1, H): the state before token t+1
    sel = act[:, 1:]  # (B, T-1)
    logits = pm.get_base_model().get_output_embeddings()(h[sel]).float()  # (N, V)
    if temperature and temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:][sel][:, None])[:, 0]  # (N,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
    return logp, entropy


def action_values(pm, head, ids, attn, act):
    """Critic values V(state before each model token): (N,), with the critic adapter active."""
    h = hidden_states(pm, ids, attn)[:, :-1]
    return head(h[act[:, 1:]].float())[:, 0]


def collate(seqs, device):
    """Right-pad a list of {"tokens", "loss_mask"} into ids (B, T), attn (B, T), act (B, T) bool."""
    T = max(len(s["tokens"]) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    act = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s["tokens"])
        ids[i, :n] = torch.tensor(s["tokens"])
        attn[i, :n] = 1
        act[i, :n] = torch.tensor(s["loss_mask"], dtype=torch.bool)
    act[:, 0] = False  # the first token has no predecessor to be predicted from
    return ids.to(device), attn.to(device), act.to(device)


def sync_grads(params):
    """SUM gradients over ranks: one all-reduce of the flattened LoRA grads (no DDP wrapper). Every loss
    is divided by the token count of the whole global minibatch (all_sum), so the sum over ranks is the
    single-process token mean; DDP's average would be 1/world of it. A rank with no tokens in a minibatch
    contributes zeros and still receives the others' gradient (the ranks' weights stay identical)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    i = 0
    for p, g in zip(params, grads):
        p.grad = flat[i:i + g.numel()].view_as(g).to(p.dtype)
        i += g.numel()


def make_optimizer(params, lr, warmup):
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    return opt, sched


def optimizer_step(opt, sched, params, max_norm):
    sync_grads(params)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


# ----------------------------------------------------------------------------------------------
# The three updates (PPO, RFT's SFT epoch, the critic's pre-training epoch). Each takes this rank's
# sequences; minibatch counts and token counts are global, so N ranks compute the 1-process gradient.
# ----------------------------------------------------------------------------------------------
def minibatches(n_local: int, n_mb_wanted: int, seed: int, step: int, epoch: int, device="cpu") -> list[list[int]]:
    """This rank's sequence indices for each minibatch. The number of minibatches is the same on every rank
    (the optimizer steps must line up for the all-reduce); the order follows (seed, step, epoch), so it
    changes every step and every run seed. A rank may hold fewer sequences than minibatches: its share is
    empty there and it contributes zero gradient."""
    n_mb = max(1, min(n_mb_wanted, int(all_sum(_t(float(n_local), device)))))
    order = list(range(n_local))
    random.Random(seed * 1_000_003 + step * 1_009 + epoch).shuffle(order)
    return [order[mb::n_mb] for mb in range(n_mb)]


def _t(x, device="cpu"):
    return torch.tensor(x, dtype=torch.float64, device=device)


def rollout_logprobs(seq) -> list:
    """The engine's log-probs of a sequence's model tokens (after the first token), NaN where none was recorded."""
    lps = seq.get("logprobs") or [None] * len(seq["tokens"])
    return [float("nan") if lp is None else lp for lp, m in zip(lps[1:], seq["loss_mask"][1:]) if m]


def targets(seqs, flat_v, flat_kl, cfg: Config, device):
    """Rewards and GAE in the sequences' own (B, T) layout: tool-output tokens are gaps that GAE skips,
    carrying the value of the next model token across them (see gae). The actor's advantages use lambda =
    cfg.lam (0.95); the critic's targets use cfg.critic_lam (1: Monte-Carlo returns, unbiased by the
    critic's own errors; VC-PPO / VAPO's decoupled lambdas). flat_v: (N,) values of the model tokens in
    row-major order; flat_kl: (N,) log pi - log pi_ref, or None (no KL penalty).
    Returns (advantages (N,), returns (N,), act (B, T) bool)."""
    B, T = len(seqs), max([len(s["tokens"]) for s in seqs] + [2])
    act = torch.zeros(B, T, dtype=torch.bool, device=device)  # (B, T) model tokens (t >= 1)
    for b, sq in enumerate(seqs):
        act[b, 1:len(sq["tokens"])] = torch.tensor(sq["loss_mask"][1:], dtype=torch.bool, device=device)
    values = torch.zeros(B, T, device=device)
    values[act] = flat_v.float()
    rewards = torch.zeros(B, T, device=device)
    if flat_kl is not None:
        rewards[act] = -cfg.kl_coef * flat_kl.float()
    for b, sq in enumerate(seqs):
        if act[b].any():
            rewards[b, int(act[b].nonzero()[-1])] += float(sq["reward"])
    adv, _ = gae(rewards, values, act.float(), cfg.gamma, cfg.lam)
    _, ret = gae(rewards, values, act.float(), cfg.gamma, cfg.critic_lam)
    return adv[act], ret[act], act


def ppo_update(pm, head, opts, seqs, cfg: Config, device, step: int = 0) -> dict:
    """seqs: this rank's rollouts, {"tokens", "loss_mask", "reward", optional "logprobs"}. opts: {"actor":
    (opt, sched), "critic": (opt, sched)}. Rewards sit on the last model token; with cfg.kl_coef > 0 every
    model token also pays kl_coef * (log pi - log pi_ref). Returns mean losses and statistics."""
    B = len(seqs)
    # 1) no-grad pass over micro-batches: old log-probs (the training forward), reference log-probs (adapter
    #    off), old values. Flattened (N,) in row-major order of the model tokens of the whole batch.
    old_logp, ref_logp, old_v = [], [], []
    with torch.no_grad():
        for i in range(0, B, cfg.micro_batch):
            ids, attn, act = collate(seqs[i:i + cfg.micro_batch], device)
            pm.set_adapter("actor")
            old_logp.append(action_logprobs(pm, ids, attn, act, cfg.temperature)[0])
            with pm.disable_adapter():
                ref_logp.append(action_logprobs(pm, ids, attn, act, cfg.temperature)[0])
            pm.set_adapter("critic")
            old_v.append(action_values(pm, head, ids, attn, act))
    pm.set_adapter("actor")
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, device=device)
    flat_old, flat_ref, flat_v = cat(old_logp), cat(ref_logp), cat(old_v)  # (N,) each
    flat_roll = torch.tensor([lp for sq in seqs for lp in rollout_logprobs(sq)], dtype=torch.float32, device=device)
    # 2) advantages (actor) and returns (critic) over model tokens; advantages whitened over the global batch
    raw_adv, flat_ret, act_all = targets(seqs, flat_v, flat_old - flat_ref if cfg.kl_coef > 0 else None, cfg, device)
    flat_adv = masked_whiten(raw_adv, torch.ones_like(raw_adv))  # (N,) in the same order as flat_old
    counts = act_all.sum(1).tolist()
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    weight = tis_weight(flat_old, flat_roll, cfg.tis_cap)  # (N,)
    # A batch whose episodes all got the same reward says nothing about which actions were better: with an
    # imperfect critic its advantages are the critic's errors (e.g. all -1 and V = 0: after whitening the
    # early tokens of a failure get positive advantages). The actor skips it; the critic still learns.
    rs = gather([float(sq["reward"]) for sq, n in zip(seqs, counts) if n])  # harness failures carry no tokens
    train_actor = len(rs) > 0 and max(rs) > min(rs)
    n_all = all_sum(_t(float(len(flat_old)), device)).clamp(min=1)
    st = {"ev": global_explained_variance(flat_v, flat_ret),  # the old values against the critic's targets
          "v_mean": float(all_sum(flat_v.double().sum()) / n_all),
          "ret_mean": float(all_sum(flat_ret.double().sum()) / n_all),
          "adv_mean": float(all_sum(raw_adv.double().sum()) / n_all),
          "adv_std": float((all_sum((raw_adv.double() ** 2).sum()) / n_all - (all_sum(raw_adv.double().sum()) / n_all) ** 2)
                           .clamp(min=0).sqrt()),
          "kl_ref": float(all_sum((flat_old - flat_ref).double().sum()) / n_all),  # k1 estimate of KL(pi || ref)
          "tis_w": float(all_sum(weight.double().sum()) / n_all),
          "pg_skipped": 0.0 if train_actor else 1.0,
          "lr": opts["actor"][1].get_last_lr()[0],
          **mismatch_stats(flat_old, flat_roll)}
    # 3) epochs x minibatches, each minibatch accumulated over micro-batches; token-mean losses
    stats = {"pg_loss": [], "vf_loss": [], "entropy": [], "clipfrac": [], "approx_kl": [], "grad_norm": []}
    a_params, c_params = adapter_params(pm, "actor"), adapter_params(pm, "critic")
    for epoch in range(cfg.ppo_epochs):
        for idx in minibatches(B, cfg.minibatches, cfg.seed, step, epoch, device):
            n_tok = all_sum(_t(float(sum(counts[i] for i in idx)), device)).clamp(min=1)
            acc = {k: torch.zeros((), dtype=torch.float64, device=device)
                   for k in ("pg_loss", "vf_loss", "entropy", "clipfrac", "approx_kl")}
            for j in range(0, len(idx), cfg.micro_batch):
                part = idx[j:j + cfg.micro_batch]
                ids, attn, act = collate([seqs[i] for i in part], device)
                take = lambda flat: torch.cat([flat[offsets[i]:offsets[i + 1]] for i in part])
                pm.set_adapter("actor")
                logp, ent = action_logprobs(pm, ids, attn, act, cfg.temperature)
                old = take(flat_old)
                pg, clipped = policy_loss(logp, old, take(flat_adv), cfg.eps_low, cfg.eps_high, take(weight))
                if train_actor:
                    (pg.sum() / n_tok).backward()
                acc["pg_loss"] += pg.detach().sum() / n_tok
                acc["entropy"] += ent.detach().sum() / n_tok
                acc["clipfrac"] += clipped.sum() / n_tok
                acc["approx_kl"] += (old - logp.detach()).sum() / n_tok
                pm.set_adapter("critic")
                v = action_values(pm, head, ids, attn, act)
                vl = value_loss(v, take(flat_v), take(flat_ret), cfg.value_clip)
                (vl.sum() / n_tok).backward()
                acc["vf_loss"] += vl.detach().sum() / n_tok
            if train_actor:
                stats["grad_norm"].append(optimizer_step(*opts["actor"], a_params, cfg.max_grad_norm))
            optimizer_step(*opts["critic"], c_params + list(head.parameters()), cfg.max_grad_norm)
            for k, v in acc.items():
                stats[k].append(float(all_sum(v)))
    pm.set_adapter("actor")
    return {**st, **{k: sum(v) / len(v) if v else None for k, v in stats.items()}}


def sft_loss(pm, ids, attn, act):
    """Next-token negative log-likelihood summed over model tokens, and their count."""
    logp, _ = action_logprobs(pm, ids, attn, act)
    return -logp.sum(), logp.numel()


def sft_epoch(pm, opt, data: list, cfg: Config, device, epoch: int) -> float | None:
    """One RFT epoch over this rank's episodes: cfg.minibatches optimizer steps of next-token loss, each
    the token mean over the whole global minibatch. Returns the mean loss (None without data anywhere)."""
    a_params, losses = adapter_params(pm, "actor"), []
    pm.set_adapter("actor")
    for idx in minibatches(len(data), cfg.minibatches, cfg.seed, 0, epoch, device):
        n_tok = all_sum(_t(float(sum(sum(data[i]["loss_mask"][1:]) for i in idx)), device))
        if float(n_tok) == 0:
            return None
        total = torch.zeros((), dtype=torch.float64, device=device)
        for j in range(0, len(idx), cfg.micro_batch):
            ids, attn, act = collate([data[i] for i in idx[j:j + cfg.micro_batch]], device)
            nll, _ = sft_loss(pm, ids, attn, act)
            (nll / n_tok).backward()
            total += nll.detach() / n_tok
        optimizer_step(*opt, a_params, cfg.max_grad_norm)
        losses.append(float(all_sum(total)))
    return sum(losses) / len(losses) if losses else None


def mc_returns(eps: list, gamma: float, device):
    """Monte-Carlo returns (GAE with lambda = 1) at every model token, (N,): with the reward on the last
    model token, gamma^(tokens left) * R; gamma = 1 gives R everywhere. No critic in the target, so the
    targets are right from the first step (lambda = 0.95 targets from a zero critic give a token d tokens
    before the end only R * 0.95^d: nothing for tokens thousands of tokens before the end)."""
    out = []
    for e in eps:
        n = int(sum(e["loss_mask"][1:]))
        k = torch.arange(n - 1, -1, -1, dtype=torch.float32, device=device)  # model tokens after this one
        out.append(float(e["reward"]) * gamma ** k)
    return torch.cat(out) if out else torch.zeros(0, device=device)


def critic_epoch(pm, head, opt, data: list, cfg: Config, device, epoch: int) -> float | None:
    """One pre-training epoch of the critic (its LoRA adapter and the value head): MSE to Monte-Carlo returns,
    token mean over each global minibatch. Returns the mean loss."""
    c_params, losses = adapter_params(pm, "critic") + list(head.parameters()), []
    pm.set_adapter("critic")
    for idx in minibatches(len(data), cfg.minibatches, cfg.seed, 1, epoch, device):
        n_tok = all_sum(_t(float(sum(sum(data[i]["loss_mask"][1:]) for i in idx)), device))
        if float(n_tok) == 0:
            return None
        total = torch.zeros((), dtype=torch.float64, device=device)
        for j in range(0, len(idx), cfg.micro_batch):
            part = [data[i] for i in idx[j:j + cfg.micro_batch]]
            ids, attn, act = collate(part, device)
            v = action_values(pm, head, ids, attn, act)
            loss = 0.5 * ((v - mc_returns(part, cfg.gamma, device)) ** 2).sum() / n_tok
            loss.backward()
            total += loss.detach()
        optimizer_step(*opt, c_params, cfg.max_grad_norm)
        losses.append(float(all_sum(total)))
    pm.set_adapter("actor")
    return sum(losses) / len(losses) if losses else None


# ----------------------------------------------------------------------------------------------
# Distributed helpers (accelerate launches; plain `python train.py` is world size 1)
# ----------------------------------------------------------------------------------------------
def dist_on():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier():
    if dist_on():
        dist.barrier()


def gather(items: list) -> list:
    """Concatenate a list from every rank, in rank order (every rank gets the whole list)."""
    if not dist_on():
        return list(items)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(items))
    return [x for part in out for x in part]


def shard(items: list, rank: int, world: int) -> list:
    """Rank r's share: items r, r + world, ... Nothing is dropped: shares may differ by one (or be empty when
    there are fewer items than ranks); the updates count minibatches and tokens globally, so uneven shares
    give the same gradient as one process holding every item."""
    return items[rank::world]


@dataclasses.dataclass
class Ctx:
    """What every stage needs: config, run folder, ranks, the model and the scorer's backend."""
    cfg: Config
    run_dir: Path
    rank: int = 0
    world: int = 1
    device: str = "cpu"
    backend: str = "cpu"
    policy: object = None  # agent.HFPolicy; policy.model is the peft model
    pm: object = None
    head: object = None
    train: list = dataclasses.field(default_factory=list)
    test: list = dataclasses.field(default_factory=list)
    tb: object = None
    known_tools: tuple = ()
    gen_s: float = 0.0  # seconds spent in policy.generate (the rest of a rollout is tool/env time)

    @property
    def main(self):
        return self.rank == 0

    def say(self, text):
        if self.main:
            tqdm.write(text)
            sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# Run folder: checkpoints, cached rollouts, metrics
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
    import peft
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


def reset_critic(ctx: Ctx):
    """A fresh critic: LoRA "critic" back to peft's initialisation (B = 0) and a zero value head."""
    for n, p in ctx.pm.named_parameters():
        if ".critic." in n and "lora_" in n:
            with torch.no_grad():
                if "lora_B" in n:
                    p.zero_()
                else:
                    torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5))
    torch.nn.init.zeros_(ctx.head.weight)
    torch.nn.init.zeros_(ctx.head.bias)


def begin_stage(ctx: Ctx, stage: str, opts: dict, resume: bool) -> int | None:
    """Returns the first step to run, or None when the stage is already complete. On --resume the stage's
    own latest checkpoint is loaded (weights, optimisers, schedulers) and the run continues after it."""
    info = latest(ctx.run_dir / stage)
    (ctx.run_dir / stage).mkdir(parents=True, exist_ok=True)
    if info is None:
        return 0
    if info.get("done"):
        ctx.say(f"{stage}: already complete in {ctx.run_dir / stage} (skipped)")
        return None
    load_checkpoint(ctx, stage, opts=opts)
    ctx.say(f"{stage}: resuming after step {info['step'] + 1} from {ctx.run_dir / stage / info['ckpt']}")
    return info["step"] + 1


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


def rollout_stats(eps: list) -> dict:
    """Means over episodes (harness failures excluded from the rates and counted apart): reward, compile /
    correct / faster rates, geometric-mean speedup vs torch.compile of the correct kernels, model tokens, turns,
    malformed-call rate (per tool call), end reasons (shares), harness failures."""
    ok = [e for e in eps if not harness_failed(e)]
    n = max(len(ok), 1)
    v = [e.get("verdict") or {} for e in ok]
    sp = [x["speedup_compile"] for x in v if x.get("correct") and (x.get("speedup_compile") or 0) > 0]
    calls = sum(e.get("n_turns", 1) for e in ok)
    ends = {}
    for e in ok:
        if e.get("end_reason"):
            ends[f"end_{e['end_reason'].split(':')[0]}"] = ends.get(f"end_{e['end_reason'].split(':')[0]}", 0) + 1 / n
    return {"reward": sum(e["reward"] for e in ok) / n,
            "compile": sum(bool(x.get("compiled")) for x in v) / n,
            "correct": sum(bool(x.get("correct")) for x in v) / n,
            "faster": sum(e["reward"] >= 2 for e in ok) / n,  # > 5% faster than eager
            "faster_c": sum(e["reward"] >= 3 for e in ok) / n,  # ... and than torch.compile
            "speedup": math.exp(sum(math.log(x) for x in sp) / len(sp)) if sp else None,
            "resp": sum(sum(e["loss_mask"]) for e in ok) / n,
            "turns": sum(e.get("n_turns", 1) for e in ok) / n,
            "malformed": sum(e.get("malformed_calls", 0) for e in ok) / calls if calls else None,
            **ends,
            "harness_fail": len(eps) - len(ok),
            "n": len(eps)}


def fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def log_step(ctx: Ctx, stage: str, step: int, total: int, row: dict, t_step: float, eta: float):
    """One `|`-separated line per step on rank 0, the same numbers in metrics.jsonl (and TensorBoard)."""
    if not ctx.main:
        return
    f = lambda k, spec: f"{row[k]:{spec}}" if row.get(k) is not None else "-"
    parts = [f"{stage} {step + 1}/{total}"]
    for key, label, spec in (("reward", "reward", "+.3f"), ("compile", "compile", ".2f"), ("correct", "correct", ".2f"),
                             ("faster", "faster", ".2f"), ("faster_c", "faster_c", ".2f"), ("speedup", "speedup", ".2f"),
                             ("resp", "resp", ".0f"), ("turns", "turns", ".1f"), ("malformed", "malformed", ".2f"),
                             ("pg_loss", "pg", "+.4f"), ("vf_loss", "vf", ".4f"), ("loss", "loss", ".4f"),
                             ("entropy", "ent", ".3f"), ("clipfrac", "clip", ".3f"), ("ev", "ev", "+.3f"),
                             ("v_mean", "V", "+.3f"), ("adv_std", "adv_std", ".3f"), ("kl_ref", "kl_ref", "+.4f"),
                             ("mm_mean", "dlogp", ".4f"), ("mm_p99", "dlogp_p99", ".3f"), ("mm_out", "ratio_out", ".3f"),
                             ("tis_w", "tis_w", ".3f"), ("lr", "lr", ".1e")):
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


def log_event(ctx: Ctx, rec: dict):
    if ctx.main:
        with open(ctx.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({**rec, "time": time.time()}, default=str) + "\n")


# ----------------------------------------------------------------------------------------------
# Rollouts
# ----------------------------------------------------------------------------------------------
def single_turn_rollouts(ctx: Ctx, tasks: list) -> list:
    """Warm-up rollouts: prompt = SKILL.md + task, one answer with fenced files, scored by env.py.
    Returned in the episode format of agent.py (prompt tokens mask 0, answer tokens mask 1)."""
    from concurrent.futures import ThreadPoolExecutor
    cfg, tok = ctx.cfg, ctx.policy.tokenizer
    ctx.pm.set_adapter("actor")
    prompts = [agent.single_turn_prompt(t, tok, ctx.backend) for t in tasks]
    ctx.say(f"  generating {len(prompts)} answers of up to {cfg.max_new_tokens} tokens on each of {ctx.world} rank(s)")
    outs = ctx.policy.generate(prompts, cfg.max_new_tokens, temperature=cfg.temperature)
    lps = getattr(ctx.policy, "last_logprobs", None) or [[None] * len(o) for o in outs]

    def score(i):
        files = agent.parse_single_turn(tok.decode(outs[i], skip_special_tokens=True))
        if not files:  # nothing to build: the verdict is known without spending a sandbox on it
            return env.Verdict(backend=ctx.backend, stage="scan", error="no files in the answer").to_dict()
        try:
            return agent.score_files(files, tasks[i], ctx.backend).to_dict()
        except Exception as e:  # noqa: BLE001  (the harness's failure, not the policy's: see harness_failed)
            return env.Verdict(backend=ctx.backend, error=f"final evaluation failed: {type(e).__name__}: {e}").to_dict()

    with ThreadPoolExecutor(max(1, min(4, len(tasks)))) as pool:
        verdicts = list(tqdm(pool.map(score, range(len(tasks))), total=len(tasks), desc="score", unit="answer",
                             leave=False, disable=not ctx.main))
    return [{"task_id": t["task_id"], "tokens": list(p) + list(o), "loss_mask": [0] * len(p) + [1] * len(o),
             "logprobs": [None] * len(p) + list(lp), "turns": [], "reward": v["reward"], "verdict": v, "n_turns": 1,
             "finished": True, "malformed_calls": 0, "end_reason": "answer"}
            for t, p, o, lp, v in zip(tasks, prompts, outs, lps, verdicts)]


def agent_rollouts(ctx: Ctx, tasks: list, out_dir: Path) -> list:
    ctx.pm.set_adapter("actor")
    eps = agent.run_episodes(ctx.policy, tasks, backend=ctx.backend, max_turns=ctx.cfg.max_turns,
                             max_context=ctx.cfg.max_context, out_dir=str(out_dir), max_new_tokens=ctx.cfg.max_new_tokens,
                             temperature=ctx.cfg.temperature, progress=ctx.main)
    return eps


def trainable(eps: list) -> list:
    """Episodes whose -1 was the harness's (harness_failed) keep their place in the batch with no model
    tokens: nothing is trained on them, and they do not enter the advantage statistics."""
    return [{**e, "loss_mask": [0] * len(e["loss_mask"])} if harness_failed(e) else e for e in eps]


def fit_context(eps: list, max_context: int) -> list:
    """Sequences longer than max_context are cut (the reward stays on the last kept model token)."""
    return [e if len(e["tokens"]) <= max_context else
            {**e, **{k: e[k][:max_context] for k in ("tokens", "loss_mask", "logprobs") if e.get(k) is not None}}
            for e in eps]


# ----------------------------------------------------------------------------------------------
# Stages: each one is a visible loop
# ----------------------------------------------------------------------------------------------
def new_opts(ctx: Ctx, which=("actor", "critic"), actor_lr=None):
    cfg, out = ctx.cfg, {}
    if "actor" in which:
        out["actor"] = make_optimizer(adapter_params(ctx.pm, "actor"), actor_lr or cfg.actor_lr, cfg.lr_warmup)
    if "critic" in which:
        out["critic"] = make_optimizer(adapter_params(ctx.pm, "critic") + list(ctx.head.parameters()), cfg.critic_lr, cfg.lr_warmup)
    return out


def ppo_stage(ctx: Ctx, stage: str, n_steps: int, resume: bool):
    """warmup (single-turn) and ppo (multi-turn agent episodes): roll out, score, update, log, checkpoint."""
    cfg = ctx.cfg
    opts = new_opts(ctx)
    if not (resume and latest(ctx.run_dir / stage)):
        if stage == "ppo":  # the RFT actor and the pre-trained critic
            load_checkpoint(ctx, "critic")
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
        t_roll = time.time() - t0
        ctx.say(f"{stage} {step + 1}/{n_steps}: update on {len(eps) * ctx.world} episodes "
                f"({sum(sum(e['loss_mask']) for e in eps)} model tokens on this rank)")
        upd = ppo_update(ctx.pm, ctx.head, opts, trainable(fit_context(eps, cfg.max_context)), cfg, ctx.device, step)
        row = {**rollout_stats(gather(eps)), **upd, "rollout_s": round(t_roll, 2), "generate_s": round(ctx.gen_s, 2),
               "env_s": round(t_roll - ctx.gen_s, 2), "update_s": round(time.time() - t0 - t_roll, 2), "reused": reused}
        rows.append(row)
        t_step = time.time() - t0
        done_here = step + 1 - start
        log_step(ctx, stage, step, n_steps, row, t_step, (time.time() - t_begin) / done_here * (n_steps - step - 1))
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == n_steps:
            save_checkpoint(ctx, stage, step, opts, done=step + 1 == n_steps)
    stage_end(ctx, stage, rows, steps=n_steps)


def stage_end(ctx: Ctx, stage: str, rows: list, **extra):
    """A summary record per stage (the rollouts of its last steps; read back by the final table)."""
    last = rows[-max(1, len(rows) // 2):] if rows else []
    keys = ("reward", "compile", "correct", "faster", "faster_c")
    rec = {"event": "stage_end", "stage": stage, "steps": len(rows),
           **{k: sum(r[k] for r in last) / len(last) for k in keys if last and all(k in r for r in last)}}
    rec.update(extra)
    log_event(ctx, rec)


def stage_rft(ctx: Ctx, resume: bool):
    """Roll out the warmed-up actor's multi-turn episodes, keep the clean successful ones, and fine-tune the
    actor on them with next-token loss over model tokens only."""
    cfg, sd = ctx.cfg, ctx.run_dir / "rft"
    opts = new_opts(ctx, ("actor",), actor_lr=cfg.rft_lr)
    if not (resume and latest(sd)):
        load_checkpoint(ctx, "warmup", adapters=("actor",), head=False)
    start = begin_stage(ctx, "rft", opts, resume)
    if start is None:
        return
    # 1) episodes (cached per chunk, so a resumed run does not score them again)
    n_chunks = max(1, math.ceil(cfg.rft_tasks / cfg.tasks_per_step))
    for c in tqdm(range(n_chunks), desc="rft rollouts", unit="chunk", disable=not ctx.main or n_chunks == 1):
        tasks = [ctx.train[i] for i in step_tasks(len(ctx.train), c, cfg.tasks_per_step, ctx.world, ctx.rank, cfg.seed + 1)]
        torch.manual_seed(cfg.seed * 7919 + 50_000 + c * 101 + ctx.rank)
        cached(sd / "rollouts" / f"chunk-{c:06d}-rank{ctx.rank}.jsonl",
               lambda: agent_rollouts(ctx, tasks, sd / "agent" / f"chunk-{c:06d}-rank{ctx.rank}"))
    ctx.policy.release()
    barrier()
    episodes = rft_episodes(ctx.run_dir)
    kept, dropped = rft_filter(episodes, ctx.known_tools)
    demos = load_demos(ctx.cfg.demos)
    why = ", ".join(f"{k} x{v}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1])) or "none"
    ctx.say(f"rft: kept {len(kept)} of {len(episodes)} episodes" + (f" (+{len(demos)} demos)" if demos else "")
            + f" | dropped: {why}")
    data = fit_context(shard(kept + demos, ctx.rank, ctx.world), cfg.max_context)
    log_event(ctx, {"event": "rft_filter", "episodes": len(episodes), "kept": len(kept), "demos": len(demos), "dropped": dropped})
    # 2) supervised epochs (sft_epoch: token mean over each global minibatch)
    rows, t_begin = [], time.time()
    if not kept + demos:
        ctx.say("rft: nothing to imitate; the actor is kept as the warm-up left it")
    for epoch in range(start, cfg.rft_epochs):
        t0 = time.time()
        loss = sft_epoch(ctx.pm, opts["actor"], data, cfg, ctx.device, epoch)
        row = {"loss": loss, "kept": len(kept), "n": len(episodes),
               **{k: v for k, v in rollout_stats(episodes).items() if k != "n"}}
        rows.append(row)
        log_step(ctx, "rft", epoch, cfg.rft_epochs, row, time.time() - t0,
                 (time.time() - t_begin) / (epoch + 1 - start) * (cfg.rft_epochs - epoch - 1))
        save_checkpoint(ctx, "rft", epoch, opts, done=epoch + 1 == cfg.rft_epochs)
    if start >= cfg.rft_epochs:  # rft_epochs = 0: the stage still leaves a checkpoint for its successors
        save_checkpoint(ctx, "rft", 0, opts, done=True)
    stage_end(ctx, "rft", [{**rollout_stats(episodes)}], kept=len(kept), episodes=len(episodes))


def rft_episodes(run_dir: Path) -> list:
    """Every rank's RFT episodes, in a fixed order (so all ranks see the same list)."""
    eps = []
    for f in sorted((run_dir / "rft" / "rollouts").glob("chunk-*.jsonl")):
        eps += agent.load_episodes(f)
    return eps


def load_demos(path) -> list:
    """Hand-written episodes (agent.save_episodes format) added to RFT's kept set (the overfit sanity)."""
    if not path:
        return []
    return [{**e, "reward": e.get("reward", 1)} for e in agent.load_episodes(path)]


def stage_critic(ctx: Ctx, resume: bool):
    """Value pre-training: a fresh critic adapter + value head regressed (MSE) on Monte-Carlo returns of ALL
    the RFT episodes (mc_returns), one epoch after another until the explained variance on held-out episodes
    (every 5th) has not improved for cfg.critic_patience epochs (at most cfg.critic_epochs); the best epoch's
    critic is kept. Explained variance before the first epoch and of the kept critic are logged."""
    cfg, sd = ctx.cfg, ctx.run_dir / "critic"
    opts = new_opts(ctx, ("critic",))
    if not (resume and latest(sd)):
        load_checkpoint(ctx, "rft", adapters=("actor",), head=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed + 1)
            reset_critic(ctx)
    start = begin_stage(ctx, "critic", opts, resume)
    if start is None:
        return
    episodes = fit_context([e for e in rft_episodes(ctx.run_dir) + load_demos(cfg.demos) if not harness_failed(e)],
                           cfg.max_context)
    held = [e for i, e in enumerate(episodes) if i % 5 == 4] or episodes[-1:]
    train = [e for i, e in enumerate(episodes) if i % 5 != 4] or episodes
    mine, mine_held = shard(train, ctx.rank, ctx.world), shard(held, ctx.rank, ctx.world)
    c_params = adapter_params(ctx.pm, "critic") + list(ctx.head.parameters())
    state = torch.load(ctx.run_dir / "critic" / latest(sd)["ckpt"] / "state.pt", weights_only=False) if start else {}
    ev0, mse0 = held_out_ev(ctx, mine_held)
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
        ev, mse = held_out_ev(ctx, mine_held)
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
    ev_after, _ = held_out_ev(ctx, mine_held)
    fmt = lambda x: "- (constant returns)" if x is None else f"{x:+.3f}"
    ctx.say(f"critic: held-out explained variance {fmt(ev_before)} before, {fmt(ev_after)} after "
            f"{epoch + 1} epoch(s) (the best epoch is kept)")
    ctx.pm.set_adapter("actor")
    log_event(ctx, {"event": "stage_end", "stage": "critic", "steps": len(rows), "ev_before": ev_before, "ev": ev_after,
                    "vf_loss": rows[-1]["vf_loss"] if rows else None})


def held_out_ev(ctx: Ctx, eps: list):
    """(explained variance, MSE) of the critic's values against the Monte-Carlo returns, over the held-out
    episodes of all ranks."""
    preds, targets = [], []
    ctx.pm.set_adapter("critic")
    with torch.no_grad():
        for i in range(0, len(eps), ctx.cfg.micro_batch):
            part = eps[i:i + ctx.cfg.micro_batch]
            ids, attn, act = collate(part, ctx.device)
            preds.append(action_values(ctx.pm, ctx.head, ids, attn, act).float())
            targets.append(mc_returns(part, ctx.cfg.gamma, ctx.device))
    p = torch.cat(preds) if preds else torch.zeros(0, device=ctx.device)
    t = torch.cat(targets) if targets else torch.zeros(0, device=ctx.device)
    s = all_sum(torch.stack([_t(float(p.numel()), ctx.device), ((p - t).double() ** 2).sum()]))
    return global_explained_variance(p, t), float(s[1] / s[0].clamp(min=1))


# ----------------------------------------------------------------------------------------------
# Held-out evaluation and the final table
# ----------------------------------------------------------------------------------------------
def final_eval(ctx: Ctx) -> dict | None:
    """Greedy agent episodes of the final actor on the held-out split, scored by env.py; metrics from
    reward.summarize (the same definitions as evaluate.py). Cached per rank, so a resumed run does not redo it."""
    tasks = ctx.test[:ctx.cfg.eval_tasks]
    if not tasks:
        ctx.say("eval: the dataset has no held-out tasks; skipped")
        return None
    mine = tasks[ctx.rank::ctx.world]
    out = ctx.run_dir / "eval"
    path = out / f"rank{ctx.rank}.jsonl"
    if mine:
        ctx.pm.set_adapter("actor")
        cached(path, lambda: agent.run_episodes(ctx.policy, mine, backend=ctx.backend, max_turns=ctx.cfg.max_turns,
                                                max_context=ctx.cfg.max_context, out_dir=str(out / f"agent-rank{ctx.rank}"),
                                                max_new_tokens=ctx.cfg.max_new_tokens, temperature=0.0, progress=ctx.main))
    barrier()
    eps = [e for f in sorted(out.glob("rank*.jsonl")) for e in agent.load_episodes(f)]
    rows = [{"verdict": e.get("verdict") or {}, "n_turns": e.get("n_turns"), "n_tokens": len(e["tokens"])} for e in eps]
    res = summarize(rows)
    res["reward"] = sum(e["reward"] for e in eps) / max(len(eps), 1)
    res["compile"] = sum(bool((e.get("verdict") or {}).get("compiled")) for e in eps) / max(len(eps), 1)
    log_event(ctx, {"event": "eval", **res})
    return res


def all_rewards_minus_one(run_dir: Path, ev: dict | None) -> bool:
    """True when every logged training step and the final evaluation had mean reward -1."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if (run_dir / "metrics.jsonl").is_file() else []
    rewards = [r["reward"] for r in rows if r.get("reward") is not None] + ([ev["reward"]] if ev else [])
    return bool(rewards) and all(x == -1 for x in rewards)


def summary_table(run_dir: Path, ev: dict | None) -> str:
    """Reward, pass and faster rates per stage (its last rollouts) and on the held-out split."""
    ends = {}
    if (run_dir / "metrics.jsonl").is_file():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r.get("event") == "stage_end":
                ends[r["stage"]] = r
    def num(x, spec):  # "-" padded to the column width when there is no number
        width = spec.lstrip("+").split(".")[0]
        return f"{'-':>{width or 1}}" if x is None else f"{x:{spec}}"
    lines = [f"{'stage':<10} {'steps':>5} {'reward':>7} {'compile':>7} {'correct':>7} {'>eager':>7} {'>compile':>8}  note",
             "-" * 72]
    for s in STAGES:
        r = ends.get(s)
        if r is None:
            continue
        note = (f"kept {r.get('kept')}/{r.get('episodes')} episodes" if s == "rft" else
                f"held-out explained variance {num(r.get('ev_before'), '+.3f')} -> {num(r.get('ev'), '+.3f')}" if s == "critic"
                else "training rollouts")
        lines.append(f"{s:<10} {r.get('steps', 0):>5} {num(r.get('reward'), '+7.3f')} {num(r.get('compile'), '7.2f')} "
                     f"{num(r.get('correct'), '7.2f')} {num(r.get('faster'), '7.2f')} {num(r.get('faster_c'), '8.2f')}  {note}")
    if ev:
        lines.append(f"{'held-out':<10} {ev['n']:>5} {num(ev.get('reward'), '+7.3f')} {num(ev.get('compile'), '7.2f')} "
                     f"{num(ev.get('pass_rate'), '7.2f')} {num(ev.get('faster_eager_rate'), '7.2f')} "
                     f"{num(ev.get('faster_compile_rate'), '8.2f')}  final actor, greedy, {ev['n']} tasks")
    return "\n".join(lines)


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


def tiny_tokenizer():
    """The embedded model's tokenizer (and chat template), converted from GGUF once and cached (the GGUF
    conversion takes ~20 s, the cached copy ~2 s)."""
    from transformers import AutoTokenizer
    cache = env.CACHE_DIR / "tokenizer-smollm2-135m-instruct"
    if not (cache / "tokenizer.json").is_file():
        src = agent.default_model_path()
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, cache)
        except OSError:  # another rank won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(cache))


def build_policy(cfg: Config, run_dir: Path, device: str, main_rank: bool):
    """agent.HFPolicy around the base model. "tiny-random" is a 2-layer Llama with the embedded model's
    tokenizer, initialised from cfg.seed and saved to run_dir/base (so adapters have a base to load onto)."""
    if cfg.model != TINY:
        return agent.load_policy("hf", model=cfg.model, device=device, max_context=cfg.max_context)
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    base = run_dir / "base"
    tok = tiny_tokenizer()
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
    """--stage all without --dataset: synth.py writes run_dir/data (resumable; skipped when it exists)."""
    out = run_dir / "data"
    if (out / "dataset_dict.json").is_file():
        return str(out)
    print(f"data: no --dataset given: synthesising {cfg.synth_tasks} tasks into {out}", flush=True)
    r = subprocess.run([sys.executable, str(ROOT / "synth.py"), "--out", str(out), "--num-tasks", str(cfg.synth_tasks),
                        "--backend", backend, "--seed", str(cfg.seed)])
    if r.returncode != 0 or not (out / "dataset_dict.json").is_file():
        raise env.UsageError(f"dataset synthesis failed (synth.py exit code {r.returncode}); pass --dataset to use an existing one")
    return str(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="staged agentic RL for CUDA kernels (warmup -> rft -> critic -> ppo)",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    p.add_argument("--stage", required=True, choices=[*STAGES, "all"])
    p.add_argument("--preset", choices=list(PRESETS), help="default: 'default' with a GPU, 'cpu' without one")
    p.add_argument("--model", help=f"base model: HF folder/hub id, .gguf file, or {TINY!r} (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", help="synth.py output folder or hub id (default with --stage all: synthesise one)")
    p.add_argument("--backend", default="auto", help="kernel scoring: auto | cuda | cpu")
    p.add_argument("--run-dir", help="run folder (default runs/PRESET)")
    p.add_argument("--resume", action="store_true", help="continue the stages found in --run-dir")
    p.add_argument("--env-gpus", type=int, default=0, help="GPUs (the last K visible) used only for kernel timing")
    p.add_argument("--demos", help="extra hand-written episodes (JSONL, agent.save_episodes format) for RFT")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any Config field, e.g. --set warmup_steps=5 --set kl_coef=0.01")
    return p.parse_args(argv)


def gpu_available() -> bool:
    return torch.cuda.is_available()


def make_config(a) -> Config:
    if a.preset is None:
        a.preset = "default" if gpu_available() else "cpu"
        if a.preset == "cpu":  # the first line a user sees: the default preset would take hours on a CPU
            print("train.py: no GPU found: running the CPU-sized preset 'cpu' (the embedded 135M model, 2 tasks per step, "
                  "1 step per stage); pass --preset default (or tiny, paper) to choose another", flush=True)
    cfg = Config(preset=a.preset, **PRESETS[a.preset])
    for field, value in (("model", a.model), ("dataset", a.dataset), ("demos", a.demos)):
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


def check_inputs(cfg: Config, a) -> tuple[list, str | None]:
    """Everything that can be wrong with the command line, checked before any model or GPU work."""
    run_dir = Path(cfg.run_dir)
    stages = list(STAGES) if a.stage == "all" else [a.stage]
    backend = env.resolve_backend(cfg.backend)
    if cfg.env_gpus and backend != "cuda":
        raise env.UsageError("--env-gpus needs the cuda backend (it dedicates GPUs to kernel timing)")
    if not a.resume:
        for s in stages:
            if latest(run_dir / s):
                raise env.UsageError(f"{run_dir / s} already holds a checkpoint: pass --resume to continue it, or choose another --run-dir")
    prev = PREDECESSOR[stages[0]]
    if prev and not stage_done(run_dir, prev):
        raise env.UsageError(f"--stage {stages[0]} needs a finished {prev} stage in {run_dir / prev}/ "
                             f"(run --stage {prev} --run-dir {run_dir} first, or --stage all)")
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
    needs_tasks = any(s in ("warmup", "rft", "ppo") for s in stages) or a.stage == "all"
    if src is not None:
        load_data(src, needs_tasks)  # validates columns and emptiness now
    elif needs_tasks and a.stage != "all":
        raise env.UsageError(f"--stage {a.stage} needs tasks: pass --dataset, or run --stage all (which synthesises them)")
    return stages, src


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        cfg = make_config(a)
        stages, src = check_inputs(cfg, a)
        return run(cfg, a, stages, src)
    except env.UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2


def run(cfg: Config, a, stages: list, src: str | None) -> int:
    from accelerate import Accelerator
    t_start = time.time()
    cuda = torch.cuda.is_available()
    acc = Accelerator(cpu=not cuda)  # CPU: gloo across processes; GPU: NCCL
    rank, world = acc.process_index, acc.num_processes
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = env.resolve_backend(cfg.backend)
    device = str(acc.device) if cuda else "cpu"
    if not cuda:  # leave cores to env.py's sandboxes (they score concurrently); tiny ops on busy cores
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // (2 * local_world)))  # crawl with spinning threads
    if cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(torch.cuda.device_count()))).split(",")
        plan = gpu_plan([v for v in visible if v], local_world, acc.local_process_index, cfg.env_gpus)
        torch.cuda.init()  # our own context is on the training GPU; from here on the variable only steers children
        os.environ["CUDA_VISIBLE_DEVICES"] = plan["env"]  # env.py's sandboxes time kernels there (and lock it)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if src is None and a.stage == "all":
        if acc.is_main_process:
            src = synthesise(cfg, run_dir, backend)
        barrier()
        src = str(run_dir / "data")
        if not (Path(src) / "dataset_dict.json").is_file():
            raise env.UsageError("dataset synthesis failed on rank 0")
    train, test = load_data(src, True) if src else ([], [])
    cfg.dataset = cfg.dataset or src
    if acc.is_main_process:
        write_json(run_dir / "config.json", dataclasses.asdict(cfg))
    if acc.is_main_process:
        print(f"model: loading {cfg.model or agent.DEFAULT_MODEL} on {device}", flush=True)
    policy = build_policy(cfg, run_dir, device, acc.is_main_process)
    barrier()
    pm, head = add_adapters(policy.model, cfg, device)
    policy.model = pm
    tb = None
    if acc.is_main_process:
        try:
            from torch.utils.tensorboard import SummaryWriter
            tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:
            pass
    ctx = Ctx(cfg=cfg, run_dir=run_dir, rank=rank, world=world, device=device, backend=backend, policy=policy, pm=pm,
              head=head, train=train, test=test, tb=tb, known_tools=tuple(agent.TOOL_ARGS))
    generate = policy.generate

    def timed_generate(*args, **kw):  # what the time split (generate / env / update) is measured with
        t = time.time()
        try:
            return generate(*args, **kw)
        finally:
            ctx.gen_s += time.time() - t
    policy.generate = timed_generate
    n_params = sum(p.numel() for p in pm.parameters())
    ctx.say(f"train | stages {' '.join(stages)} | preset {cfg.preset} | model {cfg.model or agent.DEFAULT_MODEL} "
            f"({n_params / 1e6:.1f}M params, LoRA r={cfg.lora_r}) | tasks {len(train)} train / {len(test)} held-out | "
            f"backend {backend} | ranks {world} | device {device} | run {run_dir}")
    for s in stages:
        if s == "warmup":
            ppo_stage(ctx, "warmup", cfg.warmup_steps, a.resume)
        elif s == "rft":
            stage_rft(ctx, a.resume)
        elif s == "critic":
            stage_critic(ctx, a.resume)
        else:
            ppo_stage(ctx, "ppo", cfg.ppo_steps, a.resume)
    ev = final_eval(ctx) if a.stage == "all" else None
    if ctx.main:
        print(summary_table(run_dir, ev))
        if all_rewards_minus_one(run_dir, ev):
            print(f"note: every reward in this run was -1 (no kernel was both built and correct). That is expected for "
                  f"{'a tiny random model' if cfg.model == TINY else 'the embedded 135M model'} at preset {cfg.preset!r}: "
                  "this run shows that every stage works end to end, not that the model learns; a model that can write "
                  "C++/CUDA (--model) on a GPU is where rewards appear")
        print(f"done in {fmt_time(time.time() - t_start)} | checkpoints: " +
              " ".join(str(run_dir / s / latest(run_dir / s)["ckpt"]) for s in stages if latest(run_dir / s)) +
              f" | metrics: {run_dir / 'metrics.jsonl'}")
    if tb is not None:
        tb.close()
    barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
