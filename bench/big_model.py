"""bench/big_model.py: model folders with the exact configuration of Qwen2.5-Coder-7B-Instruct and
Qwen2.5-Coder-1.5B-Instruct and random bf16 weights, for `train.py --model DIR` on a machine that cannot download
them; and the table of such runs (peak memory, seconds and projected preset time per phase).

    # the models (on a GPU the weights are initialised there: seconds; then 15 GB / 3 GB are written)
    python bench/big_model.py --save /tmp/qwen7b --config qwen7b
    python bench/big_model.py --save /tmp/qwen1.5b --config qwen1.5b
    # a 2-layer model of the same family for CPU tests (vocabulary larger than the tokenizer, as the real ones)
    python bench/big_model.py --save /tmp/qwen-tiny --config tiny
    # a short run on one, then its table (bash bench/run_h200.sh big-7b OUT does both)
    python train.py --stage all --model /tmp/qwen7b --run-dir /tmp/run-big-7b ...
    python bench/big_model.py --report /tmp/run-big-1.5b /tmp/run-big-7b
    # what an update needs at each shape (rl.activation_gb, with and without activation checkpointing), and a CPU
    # measurement of the logits' share: peak RSS of one forward/backward on the tiny shape, 4,096 model tokens
    python bench/big_model.py --memory

Why the speed and memory are the real model's: they follow from the shapes (layers, widths, heads, KV heads,
vocabulary, tied or untied embeddings, bf16), which are Qwen's own (Qwen2Config, checked against the published
config.json: 7,615,616,512 and 1,543,714,304 parameters), and from the number of tokens that pass through,
never from the weights' values: the same GEMMs, KV slots, LoRA adapters, optimiser states and activations.
What random weights change: the model never writes a tool call or an end-of-turn token, so every turn runs to
max_new_tokens and episodes fill the context (generation and update times are upper bounds for the shape);
no kernel is ever built (tool and scoring time is a lower bound); RFT keeps no episode (its training is empty).
Tokenizer: the embedded SmolLM2 tokenizer (49,152 tokens, ChatML template), as train.py's tiny model uses, since
Qwen's cannot be downloaded either; the weights keep Qwen's vocabulary (152,064 / 151,936 rows), so embeddings,
lm_head and the softmax cost what Qwen's do. Sampled ids the tokenizer does not know decode to nothing (the
tokens themselves are kept, as generated). Prompts and tool output tokenise to other lengths than with Qwen's
tokenizer (its larger vocabulary usually needs fewer tokens); the responses, which fill every turn, do not.

--report: for each train.py run folder (metrics.jsonl, config.json; train.log beside it or in it, for the
error of a run that died), one row per phase: peak GPU memory (runs.gpu_peak: allocated; reserved in brackets),
measured seconds, and the phase projected to the default and paper presets by bench/preset_time.py; then the
PPO step split (generation / tools + scoring / update seconds, tokens/s) and how the run ended.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent  # noqa: E402  (the embedded tokenizer, as train.py's tiny model uses it)
import preset_time  # noqa: E402
import rl  # noqa: E402
import train  # noqa: E402
from runs import fmt_time  # noqa: E402

# Qwen2.5-Coder-{7B,1.5B}-Instruct's config.json (Qwen2ForCausalLM); what they share is in QWEN2_5
QWEN2_5 = dict(hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
               use_sliding_window=False, sliding_window=None, attention_dropout=0.0, initializer_range=0.02)
CONFIGS = {
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, max_window_layers=28),
    "qwen1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_window_layers=21),
    # CPU tests: the same family (q/k/v biases, GQA, untied lm_head) in 2 layers; 50,000 rows > the tokenizer's
    # 49,152, so ids the tokenizer does not know get sampled, as with the real vocabularies
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=50000, tie_word_embeddings=False, max_window_layers=2),
}
PARAMS = {"qwen7b": 7_615_616_512, "qwen1.5b": 1_543_714_304}  # the model cards' 7.61B and 1.54B


def qwen_config(name: str, tok):
    """The Qwen2Config of CONFIGS[name], with the tokenizer's end-of-turn token as end of sequence."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(**QWEN2_5, **CONFIGS[name], bos_token_id=tok.bos_token_id, eos_token_id=im_end)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", None)}
    if rope.get("rope_theta") != 1e6:  # transformers 4 keeps rope_theta, 5 moves it into rope_parameters
        raise SystemExit(f"big_model.py: error: this transformers version did not take rope_theta=1e6 ({rope})")
    return cfg


def same_config(folder: Path, cfg) -> bool:
    """Does folder already hold a model of this configuration (a rerun on the same machine keeps it)?"""
    f = folder / "config.json"
    if not f.is_file() or not (folder / "tokenizer.json").is_file():
        return False
    old = json.loads(f.read_text())
    return all(old.get(k) == getattr(cfg, k, None) for k in ("model_type", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings"))


def save(out: Path, name: str, seed: int = 0) -> int:
    tok = agent.embedded_tokenizer()
    cfg = qwen_config(name, tok)
    if same_config(out, cfg):
        print(f"big_model | {out} already holds {name} (kept)")
        return 0
    if out.exists():
        raise SystemExit(f"big_model.py: error: {out} exists and is not a {name} model folder: remove it or choose another --save")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # a 7B init on the host takes minutes; on a GPU, seconds
    t0 = time.time()
    torch.manual_seed(seed)
    with torch.device(dev):
        lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device=dev, dtype=torch.bfloat16)  # (no-op)
    w = lm.get_output_embeddings().weight.detach().float()
    if not bool(torch.isfinite(w).all()) or float(w.std()) < 1e-3:  # uninitialised memory would sample NaNs
        raise SystemExit(f"big_model.py: error: the initialised weights look wrong (lm_head std {float(w.std())})")
    del w
    lm.generation_config.eos_token_id = cfg.eos_token_id
    n = sum(p.numel() for p in lm.parameters())
    t1 = time.time()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    lm.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    os.replace(tmp, out)  # a killed save leaves no half-written model folder behind
    gb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e9
    print(f"big_model | saved {name} to {out}: {n / 1e6:,.0f}M parameters, bf16, {gb:.1f} GB | initialised on {dev} "
          f"in {t1 - t0:.1f} s, written in {time.time() - t1:.1f} s")
    return 0


# ----------------------------------------------------------------------------------------------
# --report: the table of train.py runs
# ----------------------------------------------------------------------------------------------
def ended(run: Path, recs: list, cfg: dict) -> str:
    """How the run ended: complete, or where it stopped and the error line of its log (e.g. CUDA out of memory)."""
    missing = preset_time.missing_stages(recs, cfg)
    if not missing:
        return "complete"
    log = next((p for p in (run / "train.log", run.parent / f"{run.name}.log") if p.is_file()), None)
    lines = log.read_text(errors="replace").splitlines() if log else []
    starts = [i for i, x in enumerate(lines) if x.startswith("train | ") and " cores: " in x]  # train.py's first line
    lines = lines[starts[-1]:] if starts else lines  # the last attempt (run_h200.sh appends a resumed run's log)
    err = next((x for x in reversed(lines) if re.match(r"^[\w.]*(Error|Exception|KeyboardInterrupt)\b", x)), None)
    oom = next((x for x in reversed(lines) if "out of memory" in x.lower()), None)
    why = "no log found" if log is None else oom or err or "no error in the log (killed?)"
    if why.startswith("KeyboardInterrupt"):
        why += " (SIGINT: run_h200.sh's time limit; the same part again continues the run)"
    return f"stopped in {missing[0]}: {why[:300]}"


def fmt(x, spec="", none="-"):
    return none if x is None else f"{x:{spec}}"


def report(dirs: list) -> int:
    presets = {p: preset_time.preset(p) for p in ("default", "paper")}
    w = max([len(Path(d).name) for d in dirs] + [3])
    print(f"{'run':<{w}} {'phase':<20} {'peak GB':>14} {'measured s':>10} {'default':>9} {'paper':>9}")
    for d in map(Path, dirs):
        if not (d / "metrics.jsonl").is_file():
            print(f"{d.name:<{w}} no metrics.jsonl in {d} (the run did not start)")
            continue
        cfg, recs = preset_time.read_run(d)
        proj = {p: preset_time.project(cfg, recs, t) for p, t in presets.items()}
        start = next((r for r in recs if r.get("event") == "start"), {})
        print(f"{d.name:<{w}} {'setup (data, load)':<20} {fmt(start.get('peak_gb'), '>14.1f'):>14} "
              f"{fmt(start.get('setup_s'), '>10.1f'):>10}")
        for i, r in enumerate(proj["default"]):
            mem = f"{r['peak_gb']:.1f} ({r['reserved_gb']:.0f})" if r["peak_gb"] is not None else "-"
            print(f"{d.name:<{w}} {r['name']:<20} {mem:>14} {r['secs']:>10.1f} {fmt_time(r['proj']):>9} "
                  f"{fmt_time(proj['paper'][i]['proj']):>9}")
        tot = {p: sum(r["proj"] for r in rows) for p, rows in proj.items()}
        print(f"{d.name:<{w}} {'total':<20} {fmt(preset_time.peak(recs), '>14.1f'):>14} "
              f"{sum(r['secs'] for r in proj['default']):>10.1f} {fmt_time(tot['default']):>9} {fmt_time(tot['paper']):>9}")
        for stage in ("warmup", "ppo"):
            st = [r for r in recs if r.get("stage") == stage and "event" not in r and "generate_s" in r]
            if not st:
                continue
            mean = lambda k: sum(r.get(k) or 0 for r in st) / len(st)
            gen_tok = sum((r.get("resp") or 0) * (r.get("n") or 0) for r in st) / max(sum(r["generate_s"] for r in st), 1e-9)
            upd_tok = sum(r.get("tokens") or 0 for r in st) / max(sum(r["update_s"] for r in st), 1e-9)
            each = ", ".join(f"{r['s_step']:.0f}" for r in st)
            print(f"{d.name:<{w}} {stage} step ({each} s): generate {mean('generate_s'):.1f} s | "
                  f"tools+scoring {mean('env_s'):.1f} s | "
                  f"update {mean('update_s'):.1f} s | rollout {gen_tok:,.0f} tok/s | update {upd_tok:,.0f} tok/s | peak GB "
                  f"rollout {fmt(preset_time.peak([{'peak_gb': r.get('rollout_peak_gb')} for r in st]), '.1f')}, "
                  f"update {fmt(preset_time.peak([{'peak_gb': r.get('peak_gb')} for r in st]), '.1f')}")
        print(f"{d.name:<{w}} {ended(d, recs, cfg)}")
    print("peak GB: torch.cuda.max_memory_allocated (reserved by the caching allocator in brackets); default / paper: "
          "the phase projected to that preset by bench/preset_time.py (paper: a different shape, rough); totals without setup")
    return 0


# ----------------------------------------------------------------------------------------------
# --memory: the update's memory at each shape
# ----------------------------------------------------------------------------------------------
MEASURE = r"""
import resource, sys, torch
sys.path.insert(0, sys.argv[1])
import agent, big_model, rl, train
torch.set_num_threads(1)
ckpt, chunk, T = sys.argv[2] == "on", int(sys.argv[3]), int(sys.argv[4])
from transformers import AutoModelForCausalLM
lm = AutoModelForCausalLM.from_config(big_model.qwen_config("tiny", agent.embedded_tokenizer()), dtype=torch.float32)
pm, head = rl.add_adapters(lm, train.Config(lora_r=16, lora_alpha=32), "cpu")
ids, attn, act = rl.collate([{"tokens": torch.randint(0, 49152, (T,)).tolist(), "loss_mask": [1] * T}], "cpu")
base = int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize() / 1024  # resident now, KiB (ru_maxrss's unit)
with rl.grad_checkpointing(pm, ckpt):
    logp, _ = rl.action_logprobs(pm, ids, attn, act, chunk=chunk)
    logp.sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20)
"""


def memory(tokens: int) -> int:
    """The estimate at the default preset's worst micro-batch for each shape, then the CPU measurement."""
    import subprocess
    import types
    cfg = train.Config()
    n = cfg.micro_batch * cfg.max_context
    smol = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152)  # SmolLM2-135M
    print(f"update memory beyond the weights, one micro-batch of {cfg.micro_batch} x {cfg.max_context} tokens (the default "
          "preset's worst case; rl.activation_gb)")
    print(f"{'shape':<10} {'weights GB':>10} {'activations GB':>15} {'checkpointed GB':>16} {'logits (N, V) fp32 GB':>22} "
          f"{'one chunk GB':>12}")
    for name, c in (("smollm135", smol), ("qwen1.5b", CONFIGS["qwen1.5b"]), ("qwen7b", CONFIGS["qwen7b"])):
        m = types.SimpleNamespace(config=Qwen2Config(**c))
        w = PARAMS.get(name, 134_515_008) * 2 / 1e9
        print(f"{name:<10} {w:>10.1f} {rl.activation_gb(m, n):>15.0f} {rl.activation_gb(m, n, True):>16.0f} "
              f"{n * c['vocab_size'] * 4 / 1e9:>22.1f} {rl.LOGITS_CHUNK * c['vocab_size'] * 4 / 1e9:>12.2f}")
    print(f"\nmeasured on this CPU (Linux): peak RSS growth of one forward + backward of rl.action_logprobs, the tiny shape "
          f"(vocabulary 50,000), {tokens} model tokens, fp32")
    root = str(Path(__file__).resolve().parent)
    for ckpt, chunk in (("off", 10**9), ("off", rl.LOGITS_CHUNK), ("on", rl.LOGITS_CHUNK)):
        r = subprocess.run([sys.executable, "-c", MEASURE, root, ckpt, str(chunk), str(tokens)], capture_output=True, text=True,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        got = f"{float(r.stdout.split()[-1]):.2f} GB" if r.returncode == 0 else f"failed: {r.stderr.strip().splitlines()[-1:]}"
        print(f"  checkpointing {ckpt:<3} | logits {'in one chunk' if chunk > tokens else f'in chunks of {chunk}':<17} | {got}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n")[1])
    ap.add_argument("--save", metavar="DIR", help="write a model folder (config, random bf16 weights, tokenizer) to DIR")
    ap.add_argument("--config", choices=list(CONFIGS), default="qwen7b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", nargs="+", metavar="RUN_DIR", help="the table of these train.py run folders")
    ap.add_argument("--memory", action="store_true", help="the update's memory at each shape (estimate; CPU measurement)")
    ap.add_argument("--tokens", type=int, default=4096, help="--memory: model tokens of the CPU measurement")
    a = ap.parse_args(argv)
    if a.memory:
        return memory(a.tokens)
    if bool(a.save) == bool(a.report):
        ap.error("give either --save DIR or --report RUN_DIR ... (or --memory)")
    return save(Path(a.save), a.config, a.seed) if a.save else report(a.report)


if __name__ == "__main__":
    sys.exit(main())
