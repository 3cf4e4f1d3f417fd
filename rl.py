"""rl.py: the learning half of train.py: losses, GAE, the LoRA actor/critic pair with its value head, and the
updates (PPO, and one supervised epoch helper shared by SFT/RFT and critic pre-training). Pure functions on
tensors and a peft model; train.py owns the stages and the rollouts, runs.py the run folder.

A `cfg` here is train.py's Config (read: micro_batch, minibatches, gamma, lam, critic_lam, eps_low, eps_high,
value_clip, tis_cap, kl_coef, max_grad_norm, temperature, seed, lora_r, lora_alpha, ppo_epochs, grad_ckpt,
max_context; written: micro_batch, halved when a micro-batch runs out of GPU memory, see halve_on_oom).
Every loss is divided by the token count of its GLOBAL minibatch and LoRA gradients are summed over ranks
(sync_grads), so N ranks compute the one-process token-mean gradient without a DDP wrapper.
"""
from __future__ import annotations

import contextlib
import math
import random

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


# ----------------------------------------------------------------------------------------------
# Distributed helpers (accelerate launches; plain `python train.py` is world size 1)
# ----------------------------------------------------------------------------------------------
def dist_on():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_sum(t):
    """Sum a tensor over ranks (identity on one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


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



# ----------------------------------------------------------------------------------------------
# Model: one base, two LoRA adapters ("actor", "critic") and a value head
# ----------------------------------------------------------------------------------------------
def add_adapters(model, cfg, device):
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


LOGITS_CHUNK = 1024  # model tokens whose fp32 logits exist at once: (1024, 152064) is 0.6 GB at Qwen's vocabulary


def _logp_entropy(lm_head, h, tok, temperature):
    """Log-probs of tokens tok (n,) and entropies, (n,) each, under softmax(lm_head(h) / temperature); h (n, H).
    The entropy is logged, never trained on: it carries no gradient. With a graph, the backward's recompute of a
    checkpointed chunk would rebuild the entropy's saved (n, V) tensors too and, since no gradient ever reaches
    them, keep them until the whole backward ends: two (N, V) fp32 tensors after all, 40 GB at Qwen-7B's shape."""
    logits = lm_head(h).float()  # (n, V)
    if temperature and temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, tok[:, None])[:, 0], entropy


def action_logprobs(pm, ids, attn, act, temperature=1.0, chunk=LOGITS_CHUNK):
    """Log-probs and entropies of the model tokens under softmax(logits / temperature), the distribution
    the rollouts sampled from (temperature <= 0, greedy: T = 1). act: (B, T) bool, True where token t was
    written by the model (t >= 1). Only those positions go through lm_head: prompts and tool output are
    usually most of the sequence and would cost (B, T, vocab) memory for nothing. Returns (N,), (N,) (the entropy
    without gradient).

    The logits are computed `chunk` tokens at a time: 4 sequences of 8k tokens at a 152k vocabulary are
    20 GB per fp32 (N, V) tensor, and log_softmax, exp and their gradients are several of them. With
    gradients on, each chunk is checkpointed: the backward recomputes its logits instead of keeping them, so
    at most one chunk's (chunk, V) tensors exist at any time, forward or backward."""
    h = hidden_states(pm, ids, attn)[:, :-1]  # (B, T-1, H): the state before token t+1
    sel = act[:, 1:]  # (B, T-1)
    h, tok = h[sel], ids[:, 1:][sel]  # (N, H), (N,)
    lm_head = pm.get_base_model().get_output_embeddings()
    recompute = torch.is_grad_enabled() and h.requires_grad
    parts = [checkpoint(_logp_entropy, lm_head, h[i:i + chunk], tok[i:i + chunk], temperature, use_reentrant=False)
             if recompute else _logp_entropy(lm_head, h[i:i + chunk], tok[i:i + chunk], temperature)
             for i in range(0, max(len(tok), 1), chunk)]  # N = 0: one empty chunk (a loss of 0 that backward accepts)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


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
# Memory: activation checkpointing when the activations would not fit, micro-batches halved on out-of-memory
# ----------------------------------------------------------------------------------------------
def activation_gb(model, tokens: int, checkpointed: bool = False) -> float:
    """Estimated GB that a forward with gradients keeps for the backward (the updates' peak beyond the weights),
    for `tokens` tokens in one micro-batch. Per token and decoder layer, measured with autograd's saved-tensor
    hooks on Qwen2 / Llama layers (bf16 base, peft LoRA on every linear layer, whose fp32 weights make fp32
    copies of each projection's input; tests/test_train.py checks the constants): about 37 * hidden + 10 *
    intermediate bytes. Checkpointed, a layer keeps only its bf16 input (2 * hidden bytes) and the backward
    recomputes one layer at a time: layers * 2 * hidden + one layer's full share. Qwen2.5-7B (28 layers,
    3584 / 18944) at 4 x 8192 tokens: 295 GB without, 17 GB with; SmolLM2-135M: 36 GB without."""
    c = model.config.get_text_config()
    layer = 37 * c.hidden_size + 10 * c.intermediate_size  # bytes per token
    per_token = c.num_hidden_layers * 2 * c.hidden_size + layer if checkpointed else c.num_hidden_layers * layer
    return tokens * per_token / 1e9


def choose_grad_ckpt(cfg, model, device) -> tuple[bool, str]:
    """cfg.grad_ckpt: "on" | "off" | "auto". auto: checkpoint when the activations of one micro-batch of full-length
    sequences (cfg.micro_batch x cfg.max_context tokens, the worst case the preset allows) would take more than
    half of the GPU memory free once the model is loaded; the other half is for the logit chunks, the LoRA
    optimiser states and the allocator's fragmentation (the rollout engine's KV cache is released before every
    update). Checkpointing costs one more forward per update (~30% of its time), so a model that fits, like the
    135M default, runs without it. Without a GPU auto is off (the CPU presets' sequences are short).
    train.py asks once, at setup, and writes the answer ("on" / "off") into cfg.grad_ckpt: every update after
    that reads it back. Returns (on, the reason, for the log)."""
    if cfg.grad_ckpt not in ("auto", "on", "off"):
        raise ValueError(f"grad_ckpt {cfg.grad_ckpt!r}: expected auto, on or off")
    tokens = cfg.micro_batch * cfg.max_context
    need = activation_gb(model, tokens)
    what = f"activations of {cfg.micro_batch} x {cfg.max_context} tokens ~{need:.1f} GB without it, " \
           f"~{activation_gb(model, tokens, True):.1f} GB with it"
    if cfg.grad_ckpt != "auto":
        return cfg.grad_ckpt == "on", f"{what} (grad_ckpt={cfg.grad_ckpt})"
    if not (torch.cuda.is_available() and str(device).startswith("cuda")):
        return False, f"{what}; auto: off without a GPU"
    free = torch.cuda.mem_get_info(torch.device(device))[0] / 1e9
    return need > free / 2, f"{what}; auto: {'more' if need > free / 2 else 'less'} than half of the {free:.0f} GB free"


@contextlib.contextmanager
def grad_checkpointing(pm, on: bool):
    """Activation checkpointing of every decoder layer for the forward/backward passes inside the block (the
    updates), never outside it: rollouts (engine.py's own decode loop, or HF generate) and no-grad passes see the
    model as it was. transformers' incantation with use_reentrant=False: the non-reentrant checkpoint passes
    gradients to the LoRA weights inside a layer even though the layer's input (frozen embeddings) needs none,
    so the enable_input_require_grads hook is removed again. transformers checkpoints a layer only when the layer is in
    training mode: the layers' own flag is set, not their children's, so dropout (if a model had any) stays as
    the rest of the model is (the PPO ratio needs the forward the old log-probs were taken with)."""
    if not on:
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer
    lm = pm.get_base_model()
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.disable_input_require_grads()  # the hook it adds is for the reentrant variant: it would only cost a gradient
    layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    modes = [m.training for m in layers]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m, t in zip(layers, modes):
            m.training = t
        lm.gradient_checkpointing_disable()


def halve_on_oom(cfg, what: str, attempt, reset):
    """attempt(micro_batch) runs one whole unit of work (a minibatch's accumulation, a no-grad pass) with that
    micro-batch. Out of GPU memory: reset() (drop the gradients the failed attempt accumulated), halve
    cfg.micro_batch for the rest of the run, say so in one line, try again; at micro-batch 1, the error stands.
    The estimate in choose_grad_ckpt is for the worst case and rough; this is the guard when it is wrong (long
    episodes at a large vocabulary, another process on the GPU). attempt must hold no collective: ranks halve
    independently, and every loss is divided by the global token count, so the result is the same."""
    while True:
        try:
            return attempt(cfg.micro_batch)
        except torch.OutOfMemoryError:
            if cfg.micro_batch <= 1:
                raise
        # outside the except block: the traceback, and the activations its frames hold, are gone
        reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        old, cfg.micro_batch = cfg.micro_batch, cfg.micro_batch // 2
        who = f"rank {dist.get_rank()} " if dist_on() else ""
        print(f"memory | {who}{what}: out of GPU memory at micro_batch {old}: the pass starts again at micro_batch "
              f"{cfg.micro_batch} (kept for the rest of the run)", flush=True)


# ----------------------------------------------------------------------------------------------
# The updates: PPO, and fit_epoch (SFT / RFT next-token loss, critic pre-training). Each takes this rank's
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


def targets(seqs, flat_v, flat_kl, cfg, device):
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


def ppo_update(pm, head, opts, seqs, cfg, device, step: int = 0) -> dict:
    """seqs: this rank's rollouts, {"tokens", "loss_mask", "reward", optional "logprobs"}. opts: {"actor":
    (opt, sched), "critic": (opt, sched)}. Rewards sit on the last model token; with cfg.kl_coef > 0 every
    model token also pays kl_coef * (log pi - log pi_ref). Returns mean losses and statistics."""
    B = len(seqs)
    # 1) no-grad pass over micro-batches: old log-probs (the training forward), reference log-probs (adapter
    #    off), old values. Flattened (N,) in row-major order of the model tokens of the whole batch.
    def old_pass(mb):
        old_logp, ref_logp, old_v = [], [], []
        with torch.no_grad():
            for i in range(0, B, mb):
                ids, attn, act = collate(seqs[i:i + mb], device)
                pm.set_adapter("actor")
                old_logp.append(action_logprobs(pm, ids, attn, act, cfg.temperature)[0])
                with pm.disable_adapter():
                    ref_logp.append(action_logprobs(pm, ids, attn, act, cfg.temperature)[0])
                pm.set_adapter("critic")
                old_v.append(action_values(pm, head, ids, attn, act))
        return old_logp, ref_logp, old_v

    old_logp, ref_logp, old_v = halve_on_oom(cfg, "ppo old log-probs", old_pass, lambda: None)
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

    def accumulate(idx, n_tok, mb):  # one minibatch's gradients, mb sequences per forward
        acc = {k: torch.zeros((), dtype=torch.float64, device=device)
               for k in ("pg_loss", "vf_loss", "entropy", "clipfrac", "approx_kl")}
        for j in range(0, len(idx), mb):
            part = idx[j:j + mb]
            ids, attn, act = collate([seqs[i] for i in part], device)
            take = lambda flat: torch.cat([flat[offsets[i]:offsets[i + 1]] for i in part])
            pm.set_adapter("actor")
            # a skipped actor's forward builds no graph: one left alive through the critic's pass below would hold
            # a second micro-batch of activations (the default preset's skipped step on an H100: 77 GiB allocated,
            # where one pass's activations are estimated at 36 GB)
            with torch.set_grad_enabled(train_actor):
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
        return acc

    zero_grads = lambda: [opt.zero_grad(set_to_none=True) for opt, _ in opts.values()]
    with grad_checkpointing(pm, choose_grad_ckpt(cfg, pm, device)[0]):
        for epoch in range(cfg.ppo_epochs):
            for idx in minibatches(B, cfg.minibatches, cfg.seed, step, epoch, device):
                n_tok = all_sum(_t(float(sum(counts[i] for i in idx)), device)).clamp(min=1)
                acc = halve_on_oom(cfg, "ppo update", lambda mb: accumulate(idx, n_tok, mb), zero_grads)
                if train_actor:
                    stats["grad_norm"].append(optimizer_step(*opts["actor"], a_params, cfg.max_grad_norm))
                optimizer_step(*opts["critic"], c_params + list(head.parameters()), cfg.max_grad_norm)
                for k, v in acc.items():
                    stats[k].append(float(all_sum(v)))
    pm.set_adapter("actor")
    return {**st, **{k: sum(v) / len(v) if v else None for k, v in stats.items()}}


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



def sft_loss(pm, ids, attn, act):
    """Next-token negative log-likelihood summed over model tokens (act), and their count. The actor adapter
    must be active. Tokens with act == False (prompt, tool output, padding) are never scored: action_logprobs
    takes the logits of the act positions only."""
    logp, _ = action_logprobs(pm, ids, attn, act)
    return -logp.sum(), logp.numel()


def value_sse(pm, head, seqs, ids, attn, act, gamma: float = 1.0):
    """Critic pre-training loss: 0.5 * squared error of V to the Monte-Carlo returns, summed over model tokens
    (the critic adapter must be active)."""
    v = action_values(pm, head, ids, attn, act)
    return 0.5 * ((v - mc_returns(seqs, gamma, v.device)) ** 2).sum()


def fit_epoch(loss_fn, opt, params, data: list, n_minibatches: int, cfg, device, epoch: int, stream: int = 0):
    """One supervised epoch over this rank's sequences, shared by SFT / RFT (loss_fn = next-token NLL on model
    tokens) and critic pre-training (loss_fn = squared value error): n_minibatches optimizer steps (the same
    count on every rank), each the token mean over its whole GLOBAL minibatch, accumulated over micro-batches.
    loss_fn(part, ids, attn, act) -> loss summed over the model tokens of `part`. stream separates the
    shuffles of different uses. Returns the mean minibatch loss (None when no rank holds a model token)."""
    losses = []
    for idx in minibatches(len(data), n_minibatches, cfg.seed, stream, epoch, device):
        n_tok = all_sum(_t(float(sum(sum(data[i]["loss_mask"][1:]) for i in idx)), device))
        if float(n_tok) == 0:
            continue  # every rank sees the same global count: they all skip this step together

        def accumulate(mb):  # this minibatch's gradients, mb sequences per forward
            total = torch.zeros((), dtype=torch.float64, device=device)
            for j in range(0, len(idx), mb):
                part = [data[i] for i in idx[j:j + mb]]
                ids, attn, act = collate(part, device)
                loss = loss_fn(part, ids, attn, act) / n_tok
                loss.backward()
                total += loss.detach()
            return total

        total = halve_on_oom(cfg, "update", accumulate, lambda: opt[0].zero_grad(set_to_none=True))
        optimizer_step(*opt, params, cfg.max_grad_norm)
        losses.append(float(all_sum(total)))
    return sum(losses) / len(losses) if losses else None


def sft_epoch(pm, opt, data: list, n_minibatches: int, cfg, device, epoch: int, stream: int = 0):
    """One epoch of next-token loss on model tokens (sft: teacher demonstrations; rft: kept own episodes)."""
    pm.set_adapter("actor")
    with grad_checkpointing(pm, choose_grad_ckpt(cfg, pm, device)[0]):
        return fit_epoch(lambda part, ids, attn, act: sft_loss(pm, ids, attn, act)[0], opt, adapter_params(pm, "actor"),
                         data, n_minibatches, cfg, device, epoch, stream)


def critic_epoch(pm, head, opt, data: list, cfg, device, epoch: int):
    """One epoch of critic pre-training (its LoRA adapter and the value head): MSE to Monte-Carlo returns."""
    pm.set_adapter("critic")
    with grad_checkpointing(pm, choose_grad_ckpt(cfg, pm, device)[0]):
        loss = fit_epoch(lambda part, ids, attn, act: value_sse(pm, head, part, ids, attn, act, cfg.gamma), opt,
                         adapter_params(pm, "critic") + list(head.parameters()), data, cfg.minibatches, cfg, device, epoch, 1)
    pm.set_adapter("actor")
    return loss


def critic_ev(pm, head, eps: list, cfg, device):
    """(explained variance, MSE) of the critic's values against the Monte-Carlo returns, over the episodes of
    all ranks (critic pre-training's held-out score). Leaves the critic adapter active."""
    def values(mb):
        preds, targets = [], []
        with torch.no_grad():
            for i in range(0, len(eps), mb):
                part = eps[i:i + mb]
                ids, attn, act = collate(part, device)
                preds.append(action_values(pm, head, ids, attn, act).float())
                targets.append(mc_returns(part, cfg.gamma, device))
        return preds, targets

    pm.set_adapter("critic")
    preds, targets = halve_on_oom(cfg, "critic values", values, lambda: None)
    p = torch.cat(preds) if preds else torch.zeros(0, device=device)
    t = torch.cat(targets) if targets else torch.zeros(0, device=device)
    s = all_sum(torch.stack([torch.tensor(float(p.numel()), dtype=torch.float64, device=device),
                             ((p - t).double() ** 2).sum()]))
    return global_explained_variance(p, t), float(s[1] / s[0].clamp(min=1))


def reset_critic(pm, head):
    """A fresh critic: LoRA "critic" back to peft's initialisation (B = 0) and a zero value head."""
    for n, p in pm.named_parameters():
        if ".critic." in n and "lora_" in n:
            with torch.no_grad():
                if "lora_B" in n:
                    p.zero_()
                else:
                    torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5))
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
