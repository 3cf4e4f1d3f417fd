"""train.py: the CUDA Agent recipe, scaled to one node: single-turn PPO warm-up -> rejection fine-tuning
(RFT) -> critic pre-training -> multi-turn agentic PPO, all on LoRA adapters of one base model.

    # tiny: minutes on a 2-core CPU, CPU backend, a tiny randomly initialised model (this is what CI runs)
    python train.py --stage all --preset tiny --backend cpu --run-dir runs/tiny
    # default: one H200 with the embedded SmolLM2-135M-Instruct (~7 min of stages, projected from a short H200 run: README)
    python train.py --stage all --run-dir runs/default
    # one stage at a time (each needs its predecessor's checkpoint in --run-dir), resumable after kill -9
    python train.py --stage ppo --run-dir runs/default --resume
    # several GPUs (each rank rolls out and scores on its own GPU; --env-gpus K keeps K GPUs for timing)
    accelerate launch --multi_gpu --num_processes 4 train.py --stage all --run-dir runs/x4
    # the same on a CPU-only machine (gloo): accelerate launch --multi_gpu --num_processes 2 train.py ... --backend cpu

The algorithm, as differences from named baselines
  warmup  PPO as in the paper's single-turn warm-up (actor + critic, token-level GAE with gamma = 1,
          lambda = 0.95, value clipping, token-mean loss) with DAPO's asymmetric clip (eps_low 0.2,
          eps_high 0.28). Reward = env.py's milestone reward (-1/1/2/3) on the last response token.
          No KL penalty by default (--kl-coef turns it on; the reference is the base with the adapter off).
  rft     plain SFT (next-token loss on model tokens only) on the warmed-up actor's own multi-turn
          episodes, kept only if reward > 0 and free of bad patterns (malformed or unknown tool calls,
          the same call twice in a row, any call repeated 3+ times = a loop). Drop reasons are logged.
  critic  a scalar value head on the base model with its own LoRA adapter, regressed (MSE) on GAE
          targets (gamma 1, lambda 0.95) recomputed with the current critic every epoch, trained on ALL
          rolled-out episodes (the critic must also learn what failure looks like), explained variance
          against the episodes' returns reported on held-out episodes.
  ppo     the warm-up's PPO over whole multi-turn episodes: GAE runs over model tokens only, tool-output
          tokens are skipped and the value is carried across them; advantages whitened over model
          tokens of the whole global batch. Rollout log-probs are recomputed by the training forward
          (never taken from generation), so the first ratio is exactly 1 (the paper's bf16
          train/inference mismatch cannot creep in).
  One base model in memory: the actor and the critic are two LoRA adapters of it ("actor", "critic"),
  the KL reference is the same base with adapters disabled. Multi-rank: no DDP wrapper (the model
  switches adapters and generates, which DDP dislikes); LoRA gradients are all-reduced by hand.

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

import env

ROOT = Path(__file__).resolve().parent
STAGES = ("warmup", "rft", "critic", "ppo")
PREDECESSOR = {"warmup": None, "rft": "warmup", "critic": "rft", "ppo": "critic"}
REQUIRED_COLUMNS = ("code",)  # what training reads; ops / data_source are only reported


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
    critic_epochs: int = 3
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
    lam: float = 0.95
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
    # One H200 with the embedded 135M model; meant for <= 30 minutes (not measured yet; bench/preset_time.py projects it).
    "default": dict(),
    # The paper's hyper-parameters (actor lr 3e-6, critic lr 6e-6, gamma 1, lambda 0.95, eps 0.2/0.28,
    # 150 PPO steps) with batch, context and turns scaled to one 8-GPU node (paper: batch 1024, 128k
    # context, 150 turns).
    "paper": dict(synth_tasks=6000, tasks_per_step=32, max_new_tokens=4096, max_turns=50, max_context=32768,
                  warmup_steps=50, rft_tasks=512, rft_epochs=2, critic_epochs=2, ppo_steps=150, eval_tasks=250,
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
    import torch
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
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def masked_whiten(x, mask):
    """(x - mean) / std over the masked entries of the whole global batch (all ranks)."""
    import torch
    s = all_sum(torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double())
    mean = s[0] / s[2].clamp(min=1)
    var = (s[1] / s[2].clamp(min=1) - mean * mean).clamp(min=0)
    return ((x - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + 1e-8)) * mask


def policy_loss(logp, old_logp, adv, eps_low=0.2, eps_high=0.28):
    """Per-token PPO clipped surrogate with DAPO's asymmetric clip. All (N,) over model tokens.
    Returns (loss per token, clipped per token as float)."""
    import torch
    ratio = torch.exp(logp - old_logp)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(loss_unclipped, loss_clipped), (loss_clipped > loss_unclipped).float()


def value_loss(v, old_v, returns, clip=0.5):
    """Per-token clipped value loss 0.5 * max((v - R)^2, (v_clipped - R)^2). All (N,)."""
    import torch
    v_clipped = old_v + torch.clamp(v - old_v, -clip, clip)
    return 0.5 * torch.maximum((v - returns) ** 2, (v_clipped - returns) ** 2)


def explained_variance(pred, target):
    """1 - Var(target - pred) / Var(target); None when the target is constant (nothing to explain)."""
    import torch
    pred, target = torch.as_tensor(pred, dtype=torch.float64), torch.as_tensor(target, dtype=torch.float64)
    var = target.var(unbiased=False)
    if target.numel() < 2 or var < 1e-12:
        return None
    return float(1 - (target - pred).var(unbiased=False) / var)


def bad_patterns(episode, known_tools=None) -> list[str]:
    """Why an episode must not be imitated (the paper's RFT filter). Empty list = clean."""
    reasons = []
    if episode.get("malformed_calls", 0):
        reasons.append("malformed tool call")
    calls = [(t.get("tool"), json.dumps(t.get("args"), sort_keys=True, default=str)) for t in episode.get("turns", [])]
    if known_tools is not None and any(c[0] is not None and c[0] not in known_tools for c in calls):
        reasons.append("unknown tool")
    if any(a == b for a, b in zip(calls, calls[1:])):
        reasons.append("repeated identical tool call")
    if any(calls.count(c) >= 3 for c in set(calls)):
        reasons.append("loop")
    return reasons


def rft_filter(episodes, known_tools=None):
    """Split episodes into (kept, drop reason counts): keep reward > 0 and no bad pattern."""
    kept, dropped = [], {}
    for ep in episodes:
        reasons = ([] if ep["reward"] > 0 else ["reward <= 0"]) + bad_patterns(ep, known_tools)
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
    import torch
    lora = lambda: peft.LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                   target_modules="all-linear", task_type="CAUSAL_LM")
    pm = peft.get_peft_model(model, lora(), adapter_name="actor")
    pm.add_adapter("critic", lora())
    pm.set_adapter("actor")
    hidden = model.config.get_text_config().hidden_size
    head = torch.nn.Linear(hidden, 1).to(device=device, dtype=torch.float32)
    torch.nn.init.zeros_(head.weight)  # starts at V = 0: no made-up values before pre-training
    torch.nn.init.zeros_(head.bias)
    # peft draws LoRA A from the global RNG, whose state may differ per rank by now: start every rank
    # from rank 0's adapters, or the ranks drift apart from step one.
    import torch.distributed as dist
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


def action_logprobs(pm, ids, attn, act):
    """Log-probs and entropies of the model tokens. act: (B, T) bool, True where token t was written by
    the model (t >= 1). Only those positions go through lm_head: prompts and tool output are usually
    most of the sequence and would cost (B, T, vocab) memory for nothing. Returns (N,), (N,)."""
    import torch
    h = hidden_states(pm, ids, attn)[:, :-1]  # (B, T-1, H): the state before token t+1
    sel = act[:, 1:]  # (B, T-1)
    logits = pm.get_base_model().get_output_embeddings()(h[sel]).float()  # (N, V)
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
    import torch
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
    """Average gradients over ranks: one all-reduce of the flattened LoRA grads (no DDP wrapper)."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    i = 0
    for p, g in zip(params, grads):
        p.grad = flat[i:i + g.numel()].view_as(g).to(p.dtype)
        i += g.numel()


def make_optimizer(params, lr, warmup):
    import torch
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    return opt, sched


def optimizer_step(opt, sched, params, max_norm):
    import torch
    sync_grads(params)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


# ----------------------------------------------------------------------------------------------
# One PPO update (warm-up and multi-turn PPO share it; the learning test calls it directly)
# ----------------------------------------------------------------------------------------------
def ppo_update(pm, head, opts, seqs, cfg: Config, device, train_critic=True) -> dict:
    """seqs: list of {"tokens", "loss_mask", "reward"} (this rank's rollouts). opts: {"actor": (opt,
    sched), "critic": (opt, sched)}. Rewards sit on the last model token; with cfg.kl_coef > 0 every model
    token also pays kl_coef * (log pi - log pi_ref). Returns mean losses and statistics."""
    import torch
    B = len(seqs)
    n_mb = max(1, min(cfg.minibatches, B))
    # 1) no-grad pass: old log-probs (same forward as training), reference log-probs, old values
    old_logp, ref_logp, old_v = [], [], []
    with torch.no_grad():
        for i in range(0, B, cfg.micro_batch):
            ids, attn, act = collate(seqs[i:i + cfg.micro_batch], device)
            pm.set_adapter("actor")
            old_logp.append(action_logprobs(pm, ids, attn, act)[0])
            if cfg.kl_coef > 0:
                with pm.disable_adapter():
                    ref_logp.append(action_logprobs(pm, ids, attn, act)[0])
            pm.set_adapter("critic")
            old_v.append(action_values(pm, head, ids, attn, act))
    pm.set_adapter("actor")
    # 2) rewards, GAE over model tokens only, global advantage whitening. Work in a (B, L) layout where
    #    L = the longest number of model tokens: tool tokens carry no reward and are skipped by GAE
    #    anyway, so packing each sequence's model tokens left is equivalent and keeps tensors small.
    counts = [int(sum(s["loss_mask"][1:])) for s in seqs]
    L = max(max(counts), 1)
    mask = torch.zeros(B, L, device=device)
    values = torch.zeros(B, L, device=device)
    rewards = torch.zeros(B, L, device=device)
    flat_old = torch.cat(old_logp)
    flat_v = torch.cat(old_v)
    flat_ref = torch.cat(ref_logp) if ref_logp else None
    o = 0
    for b, n in enumerate(counts):
        mask[b, :n] = 1
        values[b, :n] = flat_v[o:o + n]
        if flat_ref is not None:
            rewards[b, :n] -= cfg.kl_coef * (flat_old[o:o + n] - flat_ref[o:o + n])
        if n:
            rewards[b, n - 1] += float(seqs[b]["reward"])
        o += n
    adv, ret = gae(rewards, values, mask, cfg.gamma, cfg.lam)
    adv = masked_whiten(adv, mask)
    sel = mask > 0
    flat_adv, flat_ret = adv[sel], ret[sel]  # (N,) in the same order as the flattened model tokens
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    # 3) epochs x minibatches, each minibatch accumulated over micro-batches; token-mean losses
    stats = {"pg_loss": [], "vf_loss": [], "entropy": [], "clipfrac": [], "approx_kl": [], "grad_norm": []}
    a_params, c_params = adapter_params(pm, "actor"), adapter_params(pm, "critic")
    order = list(range(B))
    for epoch in range(cfg.ppo_epochs):
        random.Random(cfg.seed + epoch + B).shuffle(order)
        for mb in range(n_mb):
            idx = order[mb::n_mb]
            n_tok = all_sum(torch.tensor(float(sum(counts[i] for i in idx)), device=device)).clamp(min=1)
            acc = {k: torch.zeros((), device=device) for k in ("pg_loss", "vf_loss", "entropy", "clipfrac", "approx_kl")}
            for j in range(0, len(idx), cfg.micro_batch):
                part = idx[j:j + cfg.micro_batch]
                ids, attn, act = collate([seqs[i] for i in part], device)
                take = lambda flat: torch.cat([flat[offsets[i]:offsets[i + 1]] for i in part])
                pm.set_adapter("actor")
                logp, ent = action_logprobs(pm, ids, attn, act)
                old = take(flat_old)
                pg, clipped = policy_loss(logp, old, take(flat_adv), cfg.eps_low, cfg.eps_high)
                (pg.sum() / n_tok).backward()
                acc["pg_loss"] += pg.detach().sum() / n_tok
                acc["entropy"] += ent.detach().sum() / n_tok
                acc["clipfrac"] += clipped.sum() / n_tok
                acc["approx_kl"] += (old - logp.detach()).sum() / n_tok
                if train_critic:
                    pm.set_adapter("critic")
                    v = action_values(pm, head, ids, attn, act)
                    vl = value_loss(v, take(flat_v), take(flat_ret), cfg.value_clip)
                    (vl.sum() / n_tok).backward()
                    acc["vf_loss"] += vl.detach().sum() / n_tok
            stats["grad_norm"].append(optimizer_step(*opts["actor"], a_params, cfg.max_grad_norm))
            if train_critic:
                optimizer_step(*opts["critic"], c_params + list(head.parameters()), cfg.max_grad_norm)
            for k, v in acc.items():
                stats[k].append(float(all_sum(v)))
    pm.set_adapter("actor")
    return {k: sum(v) / max(len(v), 1) for k, v in stats.items()}


def sft_loss(pm, ids, attn, act):
    """Next-token negative log-likelihood summed over model tokens, and their count."""
    logp, _ = action_logprobs(pm, ids, attn, act)
    return -logp.sum(), logp.numel()


# ----------------------------------------------------------------------------------------------
# Distributed helpers (accelerate launches; plain `python train.py` is world size 1)
# ----------------------------------------------------------------------------------------------
def dist_on():
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier():
    if dist_on():
        import torch.distributed as dist
        dist.barrier()


def gather(items: list) -> list:
    """Concatenate a list from every rank, in rank order (every rank gets the whole list)."""
    if not dist_on():
        return list(items)
    import torch.distributed as dist
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(items))
    return [x for part in out for x in part]


def shard(items: list, rank: int, world: int) -> list:
    """An equal share for each rank (the remainder is dropped so every rank does the same number of
    optimizer steps, which the gradient all-reduce needs)."""
    n = len(items) // world
    return items[rank * n:(rank + 1) * n]


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
            from tqdm import tqdm
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
    import torch
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
    import torch
    with torch.no_grad():
        s = float(sum(p.double().sum() for n, p in ctx.pm.named_parameters() if "lora_" in n)
                  + sum(p.double().sum() for p in ctx.head.parameters()))
    sums = gather([s])
    if max(sums) - min(sums) > 1e-6 * max(1.0, abs(sums[0])):
        raise RuntimeError(f"ranks hold different weights (checksums {sums}); refusing to checkpoint")


def load_checkpoint(ctx: Ctx, stage: str, adapters=("actor", "critic"), head=True, opts=None) -> dict:
    """Load adapters (and the value head, and optimiser/scheduler states) of a stage's latest checkpoint."""
    import peft
    import torch
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
    import torch
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
    import agent
    if path.is_file():
        return agent.load_episodes(path), True
    eps = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    agent.save_episodes(tmp, eps)
    os.replace(tmp, path)
    return eps, False


def rollout_stats(eps: list) -> dict:
    """Means over episodes: reward, compile/correct/faster rates, model tokens, turns."""
    n = max(len(eps), 1)
    v = [e.get("verdict") or {} for e in eps]
    return {"reward": sum(e["reward"] for e in eps) / n,
            "compile": sum(bool(x.get("compiled")) for x in v) / n,
            "correct": sum(bool(x.get("correct")) for x in v) / n,
            "faster": sum(e["reward"] >= 2 for e in eps) / n,  # > 5% faster than eager
            "faster_c": sum(e["reward"] >= 3 for e in eps) / n,  # ... and than torch.compile
            "resp": sum(sum(e["loss_mask"]) for e in eps) / n,
            "turns": sum(e.get("n_turns", 1) for e in eps) / n,
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
                             ("faster", "faster", ".2f"), ("faster_c", "faster_c", ".2f"), ("resp", "resp", ".0f"),
                             ("turns", "turns", ".1f"), ("pg_loss", "pg", "+.4f"), ("vf_loss", "vf", ".4f"),
                             ("loss", "loss", ".4f"), ("entropy", "ent", ".3f"), ("clipfrac", "clip", ".3f"),
                             ("ev", "ev", "+.3f")):
        if key in row:
            parts.append(f"{label} {f(key, spec)}")
    parts += [f"{t_step:.1f}s/step", f"ETA {fmt_time(eta)}"]
    ctx.say(" | ".join(parts))
    rec = {"stage": stage, "step": step + 1, "of": total, **row, "s_step": round(t_step, 3), "time": time.time()}
    with open(ctx.run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(rec, default=str) + "\n")
    if ctx.tb is not None:
        gstep = STAGES.index(stage) * 100_000 + step + 1 if stage in STAGES else step + 1
        for k, v in row.items():
            if isinstance(v, (int, float)) and v is not None:
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
    import agent
    from concurrent.futures import ThreadPoolExecutor
    from tqdm import tqdm
    cfg, tok = ctx.cfg, ctx.policy.tokenizer
    ctx.pm.set_adapter("actor")
    prompts = [agent.single_turn_prompt(t, tok, ctx.backend) for t in tasks]
    outs = ctx.policy.generate(prompts, cfg.max_new_tokens, temperature=cfg.temperature)

    def score(i):
        files = agent.parse_single_turn(tok.decode(outs[i], skip_special_tokens=True))
        if not files:  # nothing to build: the verdict is known without spending a sandbox on it
            return env.Verdict(backend=ctx.backend, stage="scan", error="no files in the answer").to_dict()
        return agent.score_files(files, tasks[i], ctx.backend).to_dict()

    with ThreadPoolExecutor(max(1, min(4, len(tasks)))) as pool:
        verdicts = list(tqdm(pool.map(score, range(len(tasks))), total=len(tasks), desc="score", unit="answer",
                             leave=False, disable=not ctx.main))
    return [{"task_id": t["task_id"], "tokens": list(p) + list(o), "loss_mask": [0] * len(p) + [1] * len(o),
             "turns": [], "reward": v["reward"], "verdict": v, "n_turns": 1, "finished": True, "malformed_calls": 0}
            for t, p, o, v in zip(tasks, prompts, outs, verdicts)]


def agent_rollouts(ctx: Ctx, tasks: list, out_dir: Path) -> list:
    import agent
    ctx.pm.set_adapter("actor")
    eps = agent.run_episodes(ctx.policy, tasks, backend=ctx.backend, max_turns=ctx.cfg.max_turns,
                             max_context=ctx.cfg.max_context, out_dir=str(out_dir), max_new_tokens=ctx.cfg.max_new_tokens,
                             temperature=ctx.cfg.temperature, progress=ctx.main)
    return eps


def fit_context(eps: list, max_context: int) -> list:
    """Sequences longer than max_context are cut (the reward stays on the last kept model token)."""
    return [e if len(e["tokens"]) <= max_context else
            {**e, "tokens": e["tokens"][:max_context], "loss_mask": e["loss_mask"][:max_context]} for e in eps]


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
        import torch
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
        upd = ppo_update(ctx.pm, ctx.head, opts, fit_context(eps, cfg.max_context), cfg, ctx.device)
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
    import torch
    from tqdm import tqdm
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
    data = shard(kept + demos, ctx.rank, ctx.world)
    log_event(ctx, {"event": "rft_filter", "episodes": len(episodes), "kept": len(kept), "demos": len(demos), "dropped": dropped})
    # 2) supervised epochs; a micro-batch's loss is its token sum over the minibatch's token count
    rows, t_begin = [], time.time()
    a_params = adapter_params(ctx.pm, "actor")
    data = fit_context(data, cfg.max_context)
    for epoch in range(start, cfg.rft_epochs):
        t0 = time.time()
        if not data:
            ctx.say("rft: nothing to imitate; the actor is kept as the warm-up left it")
        order = list(range(len(data)))
        random.Random(cfg.seed + epoch).shuffle(order)
        losses, n_mb = [], max(1, min(cfg.minibatches, len(order))) if order else 0
        ctx.pm.set_adapter("actor")
        for mb in range(n_mb):
            idx = order[mb::n_mb]
            n_tok = all_sum(torch.tensor(float(sum(sum(data[i]["loss_mask"][1:]) for i in idx)), device=ctx.device)).clamp(min=1)
            total = torch.zeros((), device=ctx.device)
            for j in range(0, len(idx), cfg.micro_batch):
                ids, attn, act = collate([data[i] for i in idx[j:j + cfg.micro_batch]], ctx.device)
                nll, _ = sft_loss(ctx.pm, ids, attn, act)
                (nll / n_tok).backward()
                total += nll.detach() / n_tok
            optimizer_step(*opts["actor"], a_params, cfg.max_grad_norm)
            losses.append(float(all_sum(total)))
        row = {"loss": sum(losses) / len(losses) if losses else None, "kept": len(kept), "n": len(episodes),
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
    import agent
    eps = []
    for f in sorted((run_dir / "rft" / "rollouts").glob("chunk-*.jsonl")):
        eps += agent.load_episodes(f)
    return eps


def load_demos(path) -> list:
    """Hand-written episodes (agent.save_episodes format) added to RFT's kept set (the overfit sanity)."""
    import agent
    if not path:
        return []
    return [{**e, "reward": e.get("reward", 1)} for e in agent.load_episodes(path)]


def stage_critic(ctx: Ctx, resume: bool):
    """Value pre-training: a fresh critic adapter + value head regressed on GAE targets (gamma 1,
    lambda 0.95) of the RFT episodes, targets recomputed with the current critic each epoch."""
    import torch
    cfg, sd = ctx.cfg, ctx.run_dir / "critic"
    opts = new_opts(ctx, ("critic",))
    if not (resume and latest(sd)):
        load_checkpoint(ctx, "rft", adapters=("actor",), head=False)
        reset_critic(ctx)
    start = begin_stage(ctx, "critic", opts, resume)
    if start is None:
        return
    episodes = fit_context(rft_episodes(ctx.run_dir) + load_demos(cfg.demos), cfg.max_context)
    held = [e for i, e in enumerate(episodes) if i % 5 == 4] or episodes[-1:]
    train = [e for i, e in enumerate(episodes) if i % 5 != 4] or episodes
    mine, mine_held = shard(train, ctx.rank, ctx.world), shard(held, ctx.rank, ctx.world)
    c_params = adapter_params(ctx.pm, "critic") + list(ctx.head.parameters())
    rows, t_begin = [], time.time()
    for epoch in range(start, cfg.critic_epochs):
        t0 = time.time()
        # targets with the current critic
        targets = [critic_targets(ctx, mine[i:i + cfg.micro_batch]) for i in range(0, len(mine), cfg.micro_batch)]
        ctx.pm.set_adapter("critic")
        order = list(range(len(targets)))
        random.Random(cfg.seed + epoch).shuffle(order)
        losses = []
        n_tok = all_sum(torch.tensor(float(sum(t[3].numel() for t in targets)), device=ctx.device)).clamp(min=1)
        n_mb = max(1, min(cfg.minibatches, len(order)))
        for mb in range(n_mb):
            total = torch.zeros((), device=ctx.device)
            for k in order[mb::n_mb]:
                ids, attn, act, ret = targets[k]
                v = action_values(ctx.pm, ctx.head, ids, attn, act)
                loss = 0.5 * ((v - ret) ** 2).sum() / n_tok * n_mb
                loss.backward()
                total += loss.detach()
            optimizer_step(*opts["critic"], c_params, cfg.max_grad_norm)
            losses.append(float(all_sum(total)))
        ev = held_out_ev(ctx, mine_held)
        row = {"vf_loss": sum(losses) / len(losses) if losses else None, "ev": ev, "n": len(episodes)}
        rows.append(row)
        log_step(ctx, "critic", epoch, cfg.critic_epochs, row, time.time() - t0,
                 (time.time() - t_begin) / (epoch + 1 - start) * (cfg.critic_epochs - epoch - 1))
        save_checkpoint(ctx, "critic", epoch, opts, done=epoch + 1 == cfg.critic_epochs)
    ctx.pm.set_adapter("actor")
    log_event(ctx, {"event": "stage_end", "stage": "critic", "steps": len(rows),
                    "ev": rows[-1]["ev"] if rows else None, "vf_loss": rows[-1]["vf_loss"] if rows else None})


def critic_targets(ctx: Ctx, eps: list):
    """(ids, attn, act, returns (N,)): GAE(gamma, lambda) returns over model tokens with the current critic."""
    import torch
    ids, attn, act = collate(eps, ctx.device)
    with torch.no_grad():
        ctx.pm.set_adapter("critic")
        v = action_values(ctx.pm, ctx.head, ids, attn, act)
    counts = [int(sum(e["loss_mask"][1:])) for e in eps]
    L = max(max(counts), 1)
    mask, values, rewards = (torch.zeros(len(eps), L, device=ctx.device) for _ in range(3))
    o = 0
    for b, n in enumerate(counts):
        mask[b, :n] = 1
        values[b, :n] = v[o:o + n]
        if n:
            rewards[b, n - 1] = float(eps[b]["reward"])
        o += n
    _, ret = gae(rewards, values, mask, ctx.cfg.gamma, ctx.cfg.lam)
    return ids, attn, act, ret[mask > 0]


def held_out_ev(ctx: Ctx, eps: list):
    """Explained variance of the critic's values against the episodes' returns (gamma = 1: the final
    reward at every model token), over the held-out episodes of all ranks."""
    import torch
    preds, targets = [], []
    ctx.pm.set_adapter("critic")
    with torch.no_grad():
        for i in range(0, len(eps), ctx.cfg.micro_batch):
            part = eps[i:i + ctx.cfg.micro_batch]
            ids, attn, act = collate(part, ctx.device)
            preds += action_values(ctx.pm, ctx.head, ids, attn, act).float().cpu().tolist()
            targets += [float(e["reward"]) for e in part for _ in range(int(sum(e["loss_mask"][1:])))]
    pairs = gather(list(zip(preds, targets)))
    if not pairs:
        return None
    return explained_variance([p for p, _ in pairs], [t for _, t in pairs])


# ----------------------------------------------------------------------------------------------
# Held-out evaluation and the final table
# ----------------------------------------------------------------------------------------------
def final_eval(ctx: Ctx) -> dict | None:
    """Greedy agent episodes of the final actor on the held-out split, scored by env.py; metrics from
    evaluate.summarize (the same definitions as evaluate.py). Cached per rank, so a resumed run does not redo it."""
    import evaluate
    tasks = ctx.test[:ctx.cfg.eval_tasks]
    if not tasks:
        ctx.say("eval: the dataset has no held-out tasks; skipped")
        return None
    mine = tasks[ctx.rank::ctx.world]
    out = ctx.run_dir / "eval"
    path = out / f"rank{ctx.rank}.jsonl"
    if mine:
        import agent
        ctx.pm.set_adapter("actor")
        cached(path, lambda: agent.run_episodes(ctx.policy, mine, backend=ctx.backend, max_turns=ctx.cfg.max_turns,
                                                max_context=ctx.cfg.max_context, out_dir=str(out / f"agent-rank{ctx.rank}"),
                                                max_new_tokens=ctx.cfg.max_new_tokens, temperature=0.0, progress=ctx.main))
    barrier()
    import agent
    eps = [e for f in sorted(out.glob("rank*.jsonl")) for e in agent.load_episodes(f)]
    rows = [{"verdict": e.get("verdict") or {}, "n_turns": e.get("n_turns"), "n_tokens": len(e["tokens"])} for e in eps]
    res = evaluate.summarize(rows)
    res["reward"] = sum(e["reward"] for e in eps) / max(len(eps), 1)
    res["compile"] = sum(bool((e.get("verdict") or {}).get("compiled")) for e in eps) / max(len(eps), 1)
    log_event(ctx, {"event": "eval", **res})
    return res


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
                f"held-out explained variance {num(r.get('ev'), '+.3f')}" if s == "critic" else "training rollouts")
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
    import agent
    if name == TINY:
        return
    if name in (None, agent.DEFAULT_MODEL):
        agent.default_model_path()  # raises a UsageError when the embedded model is not installed
        return
    p = Path(name)
    if str(name).endswith(".gguf"):
        if not p.is_file():
            raise env.UsageError(f"unknown model {name!r}: no such GGUF file")
        return
    if p.exists():
        if not (p / "config.json").is_file():
            raise env.UsageError(f"unknown model {name!r}: the folder has no config.json")
        return
    import socket
    from huggingface_hub import try_to_load_from_cache
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # in the local Hugging Face cache
    try:
        socket.getaddrinfo("huggingface.co", 443)  # offline: say so now instead of after the hub's retries
    except OSError:
        raise env.UsageError(f"unknown model {name!r}: not a local folder, a .gguf file, or in the Hugging Face cache "
                             "(and the hub is unreachable)")
    try:
        from transformers import AutoConfig
        AutoConfig.from_pretrained(name)
    except Exception as e:  # noqa: BLE001  (OSError, ValueError, HTTP errors: all mean "cannot use it")
        raise env.UsageError(f"unknown model {name!r}: not a local folder, a .gguf file, or a model on the Hugging Face "
                             f"hub ({type(e).__name__})")


def tiny_tokenizer():
    """The embedded model's tokenizer (and chat template), converted from GGUF once and cached (the GGUF
    conversion takes ~20 s, the cached copy ~2 s)."""
    import agent
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
    import agent
    import torch
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


def load_split(src: str, split: str) -> list:
    """Tasks of one split as evaluate.py's task dicts; a missing column is a one-line error."""
    import synth
    state = Path(src) / split / "state.json"
    if state.is_file() and not json.loads(state.read_text()).get("_data_files"):
        return []  # a saved split with no rows (datasets cannot even load those back)
    ds = synth.load_tasks(src, split)
    cols = list(ds.column_names) if hasattr(ds, "column_names") else sorted({k for r in ds for k in r})
    missing = [c for c in REQUIRED_COLUMNS if c not in cols]
    if missing:
        raise env.UsageError(f"dataset {src} is missing column(s) {', '.join(missing)} in split {split!r} "
                             f"(has: {', '.join(cols) or 'none'}; training needs: {', '.join(REQUIRED_COLUMNS)})")
    return [{"task_id": f"{split}/{i:05d}", "level": str(r.get("data_source") or "synth"), "name": f"{i:05d}", "num": i,
             "code": r["code"], "ops": r.get("ops")} for i, r in enumerate(ds)]


def load_data(src: str, need_train: bool) -> tuple[list, list]:
    train = load_split(src, "train")
    try:
        test = load_split(src, "test")
    except env.UsageError as e:
        if "no split" not in str(e):
            raise
        test = []
    if need_train and not train:
        raise env.UsageError(f"dataset {src} is empty: no tasks in its train split")
    return train, test


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
    p.add_argument("--preset", default="default", choices=list(PRESETS))
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


def make_config(a) -> Config:
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
    import torch
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
    import agent
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
        print(f"done in {fmt_time(time.time() - t_start)} | checkpoints: " +
              " ".join(str(run_dir / s / latest(run_dir / s)["ckpt"]) for s in stages if latest(run_dir / s)) +
              f" | metrics: {run_dir / 'metrics.jsonl'}")
    if tb is not None:
        tb.close()
    barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
