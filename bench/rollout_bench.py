"""bench/rollout_bench.py: rollout generation speed, side by side: HF generate (dynamic cache), HF generate
(static cache), and engine.py's FastEngine (static KV slots + CUDA-graph decode), same prompts, greedy.

    # the real run (H200): SmolLM2-135M architecture, random weights (same speed as the real ones), bf16
    python bench/rollout_bench.py --device cuda
    # with the embedded SmolLM2-135M-Instruct weights instead (also checks greedy agreement on a real model)
    python bench/rollout_bench.py --device cuda --gguf
    # any model folder, e.g. Qwen2.5-Coder-7B's shape at train.py's PPO batch (bench/big_model.py --save DIR)
    python bench/rollout_bench.py --device cuda --model /tmp/qwen7b --batch 16 --configs static,ours-compile
    # multi-turn rollouts (agent episodes): 4 turns, 64 "tool observation" tokens appended between turns;
    # HF generate re-reads the whole history every turn, FastEngine prefills only the new tokens
    python bench/rollout_bench.py --device cuda --turns 4
    # where a decode step goes: kernels per generated token and the top kernels by device time
    python bench/rollout_bench.py --device cuda --batch 64 --configs ours,ours-compile --profile
    # tiny smoke run on a CPU
    python bench/rollout_bench.py --device cpu --tiny --batch 1,4 --prompt-len 32 --new-tokens 16

Each configuration runs once to warm up (graph capture, kernels), then is timed with the device synchronised.
tok/s counts new tokens of all sequences (prefill included in the time). "same as HF" compares our greedy
tokens with HF static-cache greedy tokens: identical sequences / all (in bf16 the batched kernels of the two
implementations round differently, so long greedy continuations may drift apart; fp32 runs match exactly).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile as prof
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import agent  # noqa: E402
import engine  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
ap.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
ap.add_argument("--prompt-len", type=int, default=512)
ap.add_argument("--new-tokens", type=int, default=256)
ap.add_argument("--configs", default="dynamic,static,ours", help="subset of dynamic,static,ours,ours-eager,ours-compile")
ap.add_argument("--gguf", action="store_true", help="load the embedded SmolLM2-135M-Instruct weights")
ap.add_argument("--model", default=None, help="a model folder instead, e.g. bench/big_model.py's Qwen2.5-Coder-7B shape")
ap.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke test)")
ap.add_argument("--turns", type=int, default=1, help="generate, append --obs-tokens, generate again...")
ap.add_argument("--obs-tokens", type=int, default=64)
ap.add_argument("--baseline-tokens", type=int, default=None, help="new tokens per turn of the HF generate configs "
                "(default: --new-tokens); fewer saves time at batch 1, and a static cache's step costs the same throughout")
ap.add_argument("--warmup-tokens", type=int, default=None, help="new tokens of the warm-up run (default: --new-tokens)")
ap.add_argument("--json", default=None, help="also write the results here")
ap.add_argument("--profile", action="store_true", help="after timing, profile one run of each FastEngine config: "
                "kernels per decode step and the top kernels by device time (where does a step go?)")
args = ap.parse_args()
if args.baseline_tokens and args.turns > 1:
    ap.error("--baseline-tokens works with single-turn runs only (turn boundaries would not line up)")

dev = torch.device(args.device)
dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
torch.manual_seed(0)
if args.gguf or args.model:
    policy = agent.load_policy("hf", model=args.model, device=str(dev), dtype=dtype)
    model = policy.model
else:
    # SmolLM2-135M's architecture (its GGUF config), randomly initialised
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2)
    if args.tiny:
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads = 2, 128, 256, 4
        cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size = 2, 32, 1024
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # random weights with a wide spread: diverse greedy tokens, a meaningful agreement check
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3 if args.tiny else 0.05)
model.eval()
model.generation_config.eos_token_id = None  # every configuration generates exactly --new-tokens tokens
model.generation_config.pad_token_id = 0
V = model.config.vocab_size
T = args.prompt_len + args.turns * args.new_tokens + (args.turns - 1) * args.obs_tokens
N = args.new_tokens
W = args.warmup_tokens or N


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def hf_run(prompts, n, static):
    ids = torch.tensor(prompts, device=dev)
    kw = dict(cache_implementation="static") if static else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, **kw)
    return out[:, ids.shape[1]:].tolist()


engines = {}


def ours_run(prompts, n, mode):
    key = (mode, len(prompts))
    if key not in engines:
        engines.clear()  # one KV cache at a time
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        engines[key] = engine.FastEngine(model, T, len(prompts), use_graphs=(mode != "ours-eager") and dev.type == "cuda",
                                        compile_layers=mode == "ours-compile")
    return engines[key].generate(prompts, n, 0.0, [])


def episode(run, prompts, n):
    """--turns turns: each appends the outputs and --obs-tokens fixed "observation" tokens. Returns all outputs."""
    for e in engines.values():
        e.reset()  # a cold start every run: no prefix reuse between the warm-up and the timed run
    seqs, outs = [list(p) for p in prompts], []
    for t in range(args.turns):
        out = run(seqs, n)
        outs.append(out)
        seqs = [s + o + list(range(10, 10 + args.obs_tokens)) for s, o in zip(seqs, out)]
    return [sum((o[i] for o in outs), []) for i in range(len(prompts))]


def profile(name, B, fn):
    """torch.profiler over one run (kernels inside CUDA graph replays are traced too): kernel launches per
    decode step and the ten kernels that take the most device time."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with prof(activities=acts) as p:
        fn()
        sync()
    dev_time = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cpu_time_total", 0)
    events = [e for e in p.key_averages() if dev_time(e) > 0]
    kernels = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    total = sum(dev_time(e) for e in events) or 1
    print(f"profile | batch {B} | {name} | {kernels / (N * args.turns):.0f} device kernels per generated token "
          f"(prefill included)", flush=True)
    for e in sorted(events, key=dev_time, reverse=True)[:10]:
        print(f"  {dev_time(e) / total:6.1%} | {e.count:7d} calls | {e.key[:90]}", flush=True)


rows = []
for B in [int(b) for b in args.batch.split(",")]:
    g = torch.Generator().manual_seed(B)
    prompts = torch.randint(3, V, (B, args.prompt_len), generator=g).tolist()
    ref = None
    for name in args.configs.split(","):
        run = {"dynamic": lambda p, n: hf_run(p, n, False), "static": lambda p, n: hf_run(p, n, True)}.get(
            name, lambda p, n, name=name: ours_run(p, n, name))
        n = min(N, args.baseline_tokens or N) if name in ("dynamic", "static") else N
        try:
            episode(run, prompts, min(W, n))  # warm-up: kernels, autotuning, graph capture
            sync()
            t0 = time.perf_counter()
            out = episode(run, prompts, n)
            sync()
            dt = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001  (one failing configuration must not hide the others)
            rows.append({"batch": B, "config": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"batch {B:3d} | {name:12s} | FAILED {rows[-1]['error']}", flush=True)
            continue
        if args.profile and name.startswith("ours"):
            profile(name, B, lambda: episode(run, prompts, N))
        N_all = n * args.turns
        assert all(len(o) == N_all for o in out), "every configuration must produce exactly its tokens per turn"
        if name == "static":
            ref = out
        # agreement over the tokens both produced (single-turn runs: the baseline's first n)
        m = None if ref is None else min(N_all, len(ref[0]))
        same = None if ref is None else sum(a[:m] == b[:m] for a, b in zip(out, ref)) / B
        prefix = None if ref is None else sum(next((i for i, (x, y) in enumerate(zip(a[:m], b[:m])) if x != y), m)
                                              for a, b in zip(out, ref)) / B
        rows.append({"batch": B, "config": name, "seconds": dt, "tok_s": B * N_all / dt, "ms_per_step": dt / N_all * 1e3,
                     "same_as_static": same, "common_prefix": prefix})
        print(f"batch {B:3d} | {name:12s} | {B * N_all / dt:10.1f} tok/s | {dt / N_all * 1e3:8.2f} ms/step | "
              f"same as HF static {'-' if same is None else f'{same:.0%}'} | mean common prefix "
              f"{'-' if prefix is None else f'{prefix:.0f}/{m}'}", flush=True)

print(f"\n{'device':>8}: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'} | dtype {dtype} | prompt "
      f"{args.prompt_len} | new {N} x {args.turns} turn(s) | model {args.model or ('SmolLM2-135M-Instruct (GGUF)' if args.gguf else 'SmolLM2-135M arch, random')}"
      f"{' (tiny)' if args.tiny else ''} | torch {torch.__version__}")
print("| configuration | " + " | ".join(f"batch {b}" for b in args.batch.split(",")) + " |")
print("|---|" + "---|" * len(args.batch.split(",")))
for name in args.configs.split(","):
    cells = []
    for b in args.batch.split(","):
        r = next((r for r in rows if r["batch"] == int(b) and r["config"] == name), None)
        if r is None or "error" in r:
            cells.append("failed")
            continue
        base = next((x for x in rows if x["batch"] == int(b) and x["config"] == "static" and "error" not in x), None)
        speed = f" ({r['tok_s'] / base['tok_s']:.1f}x static)" if base and name != "static" else ""
        cells.append(f"{r['tok_s']:.0f} tok/s, {r['ms_per_step']:.2f} ms/step{speed}")
    print(f"| {name} | " + " | ".join(cells) + " |")
if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=1))
