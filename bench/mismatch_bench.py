"""bench/mismatch_bench.py: how far the rollout engine's log-probs are from the training forward's.

train.py samples tokens with agent.py's engine (FastEngine: LoRA merged into the weights, fused projections,
K/V reused across turns; on CUDA compiled layers in CUDA graphs; or HF generate) and takes the PPO ratio
against log-probs that its own training forward (rl.action_logprobs: peft, unmerged LoRA) recomputes on
the same tokens. This script samples multi-turn "episodes" from the embedded SmolLM2-135M-Instruct with a
LoRA actor, recomputes them with the training forward, and prints per configuration: mean and p99 of
|delta log p|, the largest |delta|, and the share of tokens whose ratio pi_train / pi_rollout lies outside
[0.8, 1.2] (the numbers train.py logs every step as dlogp, dlogp_p99, ratio_out).

    # the lead's H200 run: bf16 with the compiled engine (the default on CUDA), fp32 and the HF fallback beside it
    python bench/mismatch_bench.py --device cuda --dtypes bfloat16,float32 --engines fast,fast-eager,hf \\
        --batch 16 --turns 4 --new-tokens 256
    # CPU (minutes on 2 cores; what docs/recipe.md reports)
    python bench/mismatch_bench.py --device cpu --dtypes bfloat16,float32 --engines fast,hf --batch 4 --turns 2 \
        --new-tokens 64 --max-prompt 256

--lora-std gives the actor's LoRA B matrices random values (a trained adapter; 0 = a fresh one, which changes
nothing). Tokens are sampled at --temperature (1.0, as train.py's rollouts).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import agent  # noqa: E402
import rl  # noqa: E402
import train  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--dtypes", default="bfloat16,float32")
ap.add_argument("--engines", default="fast,hf", help="fast (compiled layers on CUDA), fast-eager (no torch.compile), hf")
ap.add_argument("--batch", type=int, default=4, help="episodes sampled together")
ap.add_argument("--turns", type=int, default=2, help="turns per episode (a fixed observation between turns)")
ap.add_argument("--new-tokens", type=int, default=64, help="tokens per turn")
ap.add_argument("--temperature", type=float, default=1.0)
ap.add_argument("--max-prompt", type=int, default=0, help="keep only the last N prompt tokens (0: the whole ~1.7k-token "
                "agent prompt; a CPU runs minutes faster with 256)")
ap.add_argument("--lora-r", type=int, default=16)
ap.add_argument("--lora-std", type=float, default=0.01)
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()
if args.device == "cpu":
    torch.set_num_threads(max(1, torch.get_num_threads()))

tasks = [{"task_id": p.stem, "code": p.read_text()} for p in sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))]
rows = []
for dtype_name in args.dtypes.split(","):
    dtype = getattr(torch, dtype_name)
    policy = agent.load_policy("hf", device=args.device, dtype=dtype, engine="hf")  # HFPolicy; engine chosen below
    tok = policy.tokenizer
    cfg = train.Config(lora_r=args.lora_r, lora_alpha=2 * args.lora_r, seed=args.seed, temperature=args.temperature)
    pm, _ = rl.add_adapters(policy.model, cfg, args.device)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".actor." in n and "lora_B" in n:
                p.copy_((torch.randn(p.shape, generator=g) * args.lora_std).to(p.dtype))
    pm.set_adapter("actor")
    stop = agent.stop_token_ids(tok, policy.model)
    obs = agent.observation_tokens(tok, "compiled OK (1.2s)\nreward -1 | correct False", False, "<|im_end|>")
    prompts = [agent.episode_prompt(tasks[i % len(tasks)], tok, "cuda")[-args.max_prompt:] for i in range(args.batch)]
    for engine in args.engines.split(","):
        kw = {"compile_layers": False} if engine == "fast-eager" else {}
        pol = agent.HFPolicy(pm, tok, max_context=max(len(p) for p in prompts) + args.turns * (args.new_tokens + len(obs)) + 8,
                             engine="hf" if engine == "hf" else "fast", engine_kw=kw)
        torch.manual_seed(args.seed)
        t0 = time.time()
        seqs = [{"tokens": list(p), "loss_mask": [0] * len(p), "logprobs": [None] * len(p)} for p in prompts]
        for turn in range(args.turns):
            outs = pol.generate([s["tokens"] for s in seqs], args.new_tokens, temperature=args.temperature, stop=stop)
            for s, o, lp in zip(seqs, outs, pol.last_logprobs):
                s["tokens"] += o
                s["loss_mask"] += [1] * len(o)
                s["logprobs"] += list(lp)
                if turn + 1 < args.turns:
                    s["tokens"] += obs
                    s["loss_mask"] += [0] * len(obs)
                    s["logprobs"] += [None] * len(obs)
        gen_s = time.time() - t0
        pol.release()
        train_lp = []
        with torch.no_grad():
            for s in seqs:  # one sequence per forward: no padding effects in the training numbers
                ids, attn, act = rl.collate([s], args.device)
                train_lp.append(rl.action_logprobs(pm, ids, attn, act, args.temperature)[0].float().cpu())
        train_lp = torch.cat(train_lp)
        roll = torch.tensor([lp for s in seqs for lp in rl.rollout_logprobs(s)], dtype=torch.float32)
        st = rl.mismatch_stats(train_lp, roll)
        d = (train_lp - roll).abs()
        rows.append((dtype_name, engine, len(d), st["mm_mean"], st["mm_p99"], float(d.max()), st["mm_out"],
                     max(len(s["tokens"]) for s in seqs), gen_s))
        print(f"  {dtype_name} {engine}: {len(d)} tokens in {gen_s:.1f}s | mean |dlogp| {st['mm_mean']:.4f} | p99 "
              f"{st['mm_p99']:.4f} | ratio outside [0.8, 1.2] {100 * st['mm_out']:.2f}%", file=sys.stderr, flush=True)
    del policy, pm

print(f"device {args.device} | {torch.cuda.get_device_name() if args.device.startswith('cuda') else 'CPU'} | torch "
      f"{torch.__version__} | batch {args.batch} x {args.turns} turns x {args.new_tokens} tokens | T {args.temperature} "
      f"| LoRA r {args.lora_r}, B ~ N(0, {args.lora_std}^2)")
print(f"{'dtype':<9} {'engine':<10} {'tokens':>6} {'mean|dlogp|':>11} {'p99|dlogp|':>10} {'max|dlogp|':>10} "
      f"{'ratio out [0.8,1.2]':>19} {'context':>7} {'gen s':>6}")
for r in rows:
    print(f"{r[0]:<9} {r[1]:<10} {r[2]:>6} {r[3]:>11.4f} {r[4]:>10.4f} {r[5]:>10.4f} {100 * r[6]:>18.2f}% {r[7]:>7} {r[8]:>6.1f}")
