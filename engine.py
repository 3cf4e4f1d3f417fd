"""engine.py: batched generation for Llama-family decoders (SmolLM2, Llama, Qwen2/3, Mistral, SmolLM3), the
rollout engine under agent.py's HFPolicy (like nanochat's engine.py under its chat scripts).

    eng = FastEngine(model, max_context=8192, n_slots=64)            # compile_layers=False: eager decode layers
    outs = eng.generate([prompt_ids, ...], max_new_tokens=1024, temperature=1.0, stop=[eos_id])

It keeps one static KV cache row ("slot") per sequence and reuses it across calls (a new turn of an episode only
prefills the tokens after the longest common prefix), captures each decode step in a CUDA graph, and keeps
sampling and stop detection on the device (one host sync every `check_every` tokens). It calls the model's own
modules (norms, projections, MLP; peft LoRA layers work) and only re-implements the attention/cache glue, so
greedy outputs match `model.generate`. FastEngine.unsupported(model, max_context) says
why a model cannot run here (HFPolicy then falls back to `model.generate`). bench/rollout_bench.py measures it.
"""
from __future__ import annotations

import functools

import numpy as np
import torch


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rms(x, ln):
    """RMSNorm with ln = (weight, eps) as F.rms_norm: one fused kernel on CUDA where HF's module launches eight
    (fp32 cast, pow, mean, add, rsqrt, mul, cast back, weight mul). Same math; bf16 may round the last bit apart."""
    return torch.nn.functional.rms_norm(x, ln[0].shape, ln[0], ln[1])


def _linear_weight(lin):
    """(weight, bias) of a Linear as the model applies it now. A peft LoRA layer gives a computed copy: the base
    weight plus its active adapters' scale * B @ A, summed in fp32 and rounded once."""
    base = getattr(lin, "base_layer", lin)
    if not hasattr(lin, "get_delta_weight"):
        return base.weight, base.bias
    w = base.weight.float()
    if not lin.disable_adapters and not lin.merged:
        for name in lin.active_adapters:
            if name in lin.lora_A:
                if lin.use_dora.get(name, False):
                    raise NotImplementedError("FastEngine cannot merge DoRA adapters; use engine='hf'")
                w = w + lin.get_delta_weight(name).float()
    return w.to(base.weight.dtype, copy=True), base.bias


def _layer_weights(layer) -> dict:
    """One decoder layer's projections as the engine computes them: q/k/v stacked into one matrix and gate/up
    into another (one GEMM each instead of three and two), active LoRA adapters merged in (unmerged, peft adds
    four kernels to each of the seven projections, every decode step). Plain parameters are returned as they
    are; everything else is a fresh tensor."""
    a, m = layer.self_attn, layer.mlp

    def stack(*lins):
        ws, bs = zip(*(_linear_weight(x) for x in lins))
        return torch.cat(ws), (None if bs[0] is None else torch.cat(bs))
    w = {}
    w["qkv"], w["qkv_b"] = stack(a.q_proj, a.k_proj, a.v_proj)
    w["gu"], w["gu_b"] = stack(m.gate_proj, m.up_proj)
    w["o"], w["o_b"] = _linear_weight(a.o_proj)
    w["down"], w["down_b"] = _linear_weight(m.down_proj)
    return w


def _layer_pre(x, ln, w, cos, sin, H: int, KV: int, hd: int, qk_norm=None, rope: bool = True):
    """Attention input of one layer: norm, the fused q/k/v projection, RoPE on q and k together (rope=False:
    SmolLM3's NoPE layers). x (b, S, D), cos/sin (b, 1, S, hd). Returns q and k (b, H+KV, S, hd), v (b, KV, S, hd)."""
    b, S = x.shape[:2]
    qkv = torch.nn.functional.linear(_rms(x, ln), w["qkv"], w["qkv_b"]).view(b, S, H + 2 * KV, hd)
    qk, v = qkv[:, :, :H + KV], qkv[:, :, H + KV:]
    if qk_norm is not None:  # Qwen3: RMSNorm over each head of q and of k
        qk = torch.cat([_rms(qk[:, :, :H], qk_norm[0]), _rms(qk[:, :, H:], qk_norm[1])], 2)
    qk, v = qk.transpose(1, 2), v.transpose(1, 2)
    return (qk * cos + _rotate_half(qk) * sin if rope else qk), v


def _layer_post(x, o, ln, w, act):
    """The rest of one layer: output projection, residual, norm, fused gate/up projection, MLP, residual."""
    F = torch.nn.functional
    x = x + F.linear(o, w["o"], w["o_b"])
    gate, up = F.linear(_rms(x, ln), w["gu"], w["gu_b"]).chunk(2, dim=-1)
    return x + F.linear(act(gate) * up, w["down"], w["down_b"])


def _decode_layer(x, ln, w, kc, vc, rows, P, cos, sin, bias, scale: float, H: int, KV: int, hd: int, Tb: int, act,
                  qk_norm=None, rope: bool = True):
    """One layer of a decode step, for all B slots: the same math as FastEngine._forward with fewer kernels
    (it is replayed 10^5 times): scale and causal mask fused into the score GEMM (baddbmm), RoPE on q and k
    together. x (B, 1, D); kc/vc (B, KV, T+1, hd) get the new K/V row of slot rows[i] at position P[i]
    (index_put: torch.compile updates the cache in place, where it copies the whole cache for a scatter_);
    attention reads their first Tb positions with bias (B*KV, 1, Tb). Returns (B, 1, D)."""
    B, g = x.shape[0], H // KV
    qk, v = _layer_pre(x, ln[0], w, cos, sin, H, KV, hd, qk_norm, rope)  # (B, H+KV, 1, hd), (B, KV, 1, hd)
    kc[rows, :, P] = qk[:, H:, 0]  # (B, KV, hd)
    vc[rows, :, P] = v[:, :, 0]
    qg = qk[:, :H].reshape(B * KV, g, hd)  # head h uses kv head h // g, as HF's repeat_kv
    s = torch.baddbmm(bias, qg, kc[:, :, :Tb].reshape(B * KV, Tb, hd).transpose(1, 2), alpha=scale)  # (B*KV, g, Tb)
    o = torch.bmm(torch.softmax(s, dim=-1), vc[:, :, :Tb].reshape(B * KV, Tb, hd))  # (B*KV, g, hd)
    return _layer_post(x, o.view(B, 1, H * hd), ln[1], w, act)


@functools.cache
def _compiled_decode_layer():
    """One torch.compile wrapper per process: train.py rebuilds the engine after every optimiser step, and a
    new wrapper would compile again. Each (slots, attention bucket) shape is one compiled graph."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(_decode_layer, dynamic=False)


class FastEngine:
    """Batched generation for Llama-family decoders with a static KV cache of `n_slots` rows. A call
    to generate() gives each prompt the slot holding its longest cached prefix, prefills only the new
    tokens (batched, padded), then runs decode steps. On CUDA each decode step is one CUDA graph replay
    (captured per attention-length bucket) of torch.compile'd layers; sampling, stop detection and the
    per-sequence budget live on the device, so the host syncs once every `check_every` steps."""

    SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "smollm3"}

    @classmethod
    def unsupported(cls, model, max_context: int):
        """Why this engine cannot reproduce the model's own forward pass exactly, or None when it can."""
        cfg = getattr(model, "config", None)
        mt = getattr(cfg, "model_type", None)
        if mt not in cls.SUPPORTED:
            return f"model_type {mt!r}"
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        if window and window < max_context:  # attention would reach further back than the model's window
            return f"sliding-window attention ({window} tokens < max_context {max_context})"
        return None

    def __init__(self, model, max_context: int, n_slots: int, use_graphs=None, check_every: int = 32,
                 prefill_chunk: int | None = None, prefill_elems: int | None = None,
                 compile_layers: bool | None = None):
        self.model = model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        dec = base.model
        cfg = base.config
        self.layers, self.embed, self.norm, self.lm_head = dec.layers, dec.embed_tokens, dec.norm, base.lm_head
        self.H, self.KV = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.scale = self.layers[0].self_attn.scaling
        p = self.embed.weight  # the base weights' dtype (peft keeps LoRA adapters in float32)
        self.device, self.dtype = p.device, p.dtype
        self.T, self.B = int(max_context), int(n_slots)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.check_every = check_every
        # what the layers compute, as plain tensors: norms as (weight, eps), the activation, Qwen3's q/k norms,
        # and self.w, the fused projections (static buffers refreshed in place when the weights change: captured
        # CUDA graphs keep reading the same addresses). The fused stacks and merged LoRA layers are copies: one
        # extra copy of the layer weights at most (135M model: ~0.2 GB; a 7B model with LoRA on all linears: ~13 GB)
        norm = lambda n: (n.weight, n.variance_epsilon)
        self.ln = [(norm(x.input_layernorm), norm(x.post_attention_layernorm)) for x in self.layers]
        self.final_ln = norm(self.norm)
        self.qk_norm = [(norm(x.self_attn.q_norm), norm(x.self_attn.k_norm)) if hasattr(x.self_attn, "q_norm") else None
                        for x in self.layers]
        self.rope = [bool(getattr(x.self_attn, "use_rope", True)) for x in self.layers]  # SmolLM3: every 4th is NoPE
        self.act = torch.nn.functional.silu if cfg.hidden_act == "silu" else self.layers[0].mlp.act_fn
        self.w, self.weights_key = [], None
        # compile_layers (default: on CUDA): torch.compile fuses a decode layer's
        # elementwise work (norms, RoPE with the cache writes, softmax, residuals, SiLU*up) into a few kernels
        # around the GEMMs: 29% fewer kernels per step, 1.44x the tokens/s at batch 64 on the H200 (docs/results.md).
        # One compiled graph per attention bucket serves every layer (weights and caches are arguments).
        # Numerics differ from the eager path in the last bits (greedy tokens can differ in bf16).
        if compile_layers is None:
            compile_layers = self.device.type == "cuda"
        self._layer = _compiled_decode_layer() if compile_layers else _decode_layer
        cuda = self.device.type == "cuda"
        self.prefill_chunk = prefill_chunk or (1024 if cuda else 256)  # tokens per sequence per prefill forward
        self.prefill_elems = prefill_elems or (2**30 if cuda else 2**25)  # attention scores per prefill forward
        dev = self.device
        with torch.no_grad():  # RoPE table for every position, computed by the model's own rotary module
            cos, sin = dec.rotary_emb(torch.zeros(1, device=dev, dtype=torch.float32),
                                      torch.arange(self.T + 1, device=dev)[None])
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # (T+1, hd); HF casts the same way
        L = len(self.layers)
        # (L, B, KV, T+1, hd); position T is a trash row for writes past the end (never attended)
        self.k = torch.zeros(L, self.B, self.KV, self.T + 1, self.hd, device=dev, dtype=self.dtype)
        self.v = torch.zeros_like(self.k)
        self.slot_tokens = [[] for _ in range(self.B)]  # tokens whose K/V are valid in each slot
        self.ar = torch.arange(self.B, device=dev)
        self.arT = torch.arange(self.T + 1, device=dev)
        # decode state: static buffers read and written by the captured graphs
        self.tok = torch.zeros(self.B, dtype=torch.long, device=dev)  # (B,) token to feed
        self.pos = torch.zeros(self.B, dtype=torch.long, device=dev)  # (B,) its position
        self.done = torch.ones(self.B, dtype=torch.bool, device=dev)
        self.step = torch.zeros((), dtype=torch.long, device=dev)  # tokens produced so far in this call
        self.max_new = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.inv_temp = torch.ones((), dtype=torch.float32, device=dev)
        self.stop = torch.full((8,), -1, dtype=torch.long, device=dev)
        self.out = torch.zeros(self.B, self.T + 1, dtype=torch.long, device=dev)  # (B, T+1) generated ids
        self.out_lp = torch.zeros(self.B, self.T + 1, dtype=torch.float32, device=dev)  # (B, T+1) their log-probs
        self.last_logprobs = []  # generate(): the sampled tokens' log-probs, one list per prompt
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    # -- the transformer, on the static cache --------------------------------------------------
    def _forward(self, ids, P, idx, Tb):
        """Prefill: ids (b, S) tokens at positions P (b, S) of slots idx (b,). Writes their K/V into the
        cache, attends over cache[:, :Tb] with the fused SDPA kernel, returns hidden states (b, S, D)."""
        b, S = ids.shape
        Pc = P.clamp(max=self.T)
        cos, sin = self.cos[Pc][:, None], self.sin[Pc][:, None]  # (b, 1, S, hd)
        rows = idx[:, None]  # (b, 1)
        valid = self.arT[:Tb][None, None, None, :] <= P[:, None, :, None]  # (b, 1, S, Tb) causal mask
        x = self.embed(ids)
        for l in range(len(self.layers)):
            # the uncompiled layer functions: prefill shapes vary from call to call
            qk, v = _layer_pre(x, self.ln[l][0], self.w[l], cos, sin, self.H, self.KV, self.hd, self.qk_norm[l], self.rope[l])
            q, k = qk[:, :self.H], qk[:, self.H:]  # (b, H, S, hd), (b, KV, S, hd)
            kc, vc = self.k[l], self.v[l]  # (B, KV, T+1, hd)
            kc[rows, :, Pc] = k.transpose(1, 2)  # index_put with (b, S) indices: (b, S, KV, hd)
            vc[rows, :, Pc] = v.transpose(1, 2)
            K, V = kc[idx, :, :Tb], vc[idx, :, :Tb]  # (b, KV, Tb, hd)
            o = torch.nn.functional.scaled_dot_product_attention(q, K, V, attn_mask=valid,
                                                                 scale=self.scale, enable_gqa=True)  # (b, H, S, hd)
            o = o.transpose(1, 2).reshape(b, S, self.H * self.hd)
            x = _layer_post(x, o, self.ln[l][1], self.w[l], self.act)
        return x

    def _pick(self, h, sampled):
        """Next token from final hidden states h (b, D): argmax, or Gumbel-max sampling at temperature
        1/inv_temp (exactly softmax sampling, and free of host syncs unlike torch.multinomial). Returns
        (token (b,), its log-prob (b,) under the distribution it was drawn from: softmax(logits / T), T = 1 greedy)."""
        logits = self.lm_head(_rms(h, self.final_ln)).float()  # (b, V)
        if sampled:
            logits = logits * self.inv_temp
            u = torch.rand_like(logits).clamp_(1e-20, 1.0)
            nxt = (logits - torch.log(-torch.log(u))).argmax(-1)
        else:
            nxt = logits.argmax(-1)
        return nxt, torch.log_softmax(logits, -1).gather(-1, nxt[:, None])[:, 0]

    def _decode_forward(self, Tb):
        """One decode step for all B slots: token self.tok at position self.pos, each layer by _decode_layer
        (compiled with compile_layers). Returns (B, 1, D)."""
        B, KV, H, hd = self.B, self.KV, self.H, self.hd
        P = self.pos.clamp(max=self.T)  # (B,)
        cos, sin = self.cos[P][:, None, None], self.sin[P][:, None, None]  # (B, 1, 1, hd)
        bias = torch.zeros(B, 1, Tb, dtype=self.dtype, device=self.device).masked_fill_(
            self.arT[:Tb][None, None] > self.pos[:, None, None], float("-inf"))
        bias = bias[:, None].expand(B, KV, 1, Tb).reshape(B * KV, 1, Tb)  # additive causal mask
        x = self.embed(self.tok[:, None])  # (B, 1, D)
        for l in range(len(self.layers)):
            x = self._layer(x, self.ln[l], self.w[l], self.k[l], self.v[l], self.ar, P, cos, sin, bias, self.scale,
                            H, KV, hd, Tb, self.act, self.qk_norm[l], self.rope[l])
        return x

    def _decode_step(self, Tb, sampled):
        x = self._decode_forward(Tb)
        nxt, lp = self._pick(x[:, -1], sampled)  # (B,), (B,)
        self.out.index_copy_(1, self.step.clamp(max=self.T).view(1), nxt[:, None])
        self.out_lp.index_copy_(1, self.step.clamp(max=self.T).view(1), lp[:, None])
        self.tok.copy_(nxt)
        self.step += 1
        hit = (nxt[:, None] == self.stop[None, :]).any(-1)
        self.done |= hit | (self.step >= self.max_new)
        self.pos += 1

    def _replay(self, Tb, sampled):
        if not self.use_graphs:
            return self._decode_step(Tb, sampled)
        key = (Tb, sampled)
        if key not in self.graphs:
            saved = [t.clone() for t in (self.tok, self.pos, self.done, self.step)]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up before capture (it recomputes the same first step)
                for _ in range(2):
                    self._decode_step(Tb, sampled)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._decode_step(Tb, sampled)
            for t, sv in zip((self.tok, self.pos, self.done, self.step), saved):
                t.copy_(sv)
            self.graphs[key] = graph
        self.graphs[key].replay()

    def bucket(self, n):
        """Attention-length buckets (graphs are captured per bucket): multiples of 256 up to 1024, then powers of 2."""
        b = 256
        while b < n and b < 1024:
            b += 256
        while b < n:
            b *= 2
        return min(b, self.T)

    # -- slots ---------------------------------------------------------------------------------
    def _assign(self, prompts):
        """Give each prompt the free slot with the longest common prefix. Returns [(slot, reuse)]."""
        cached = [np.asarray(t, dtype=np.int64) for t in self.slot_tokens]
        free, res = set(range(self.B)), []
        for i, p in enumerate(prompts):
            pa = np.asarray(p, dtype=np.int64)
            best, best_n = None, -1
            for s in sorted(free, key=lambda s: s != i):  # ties: keep the same slot as last time
                n = min(len(pa), len(cached[s]))
                neq = np.flatnonzero(pa[:n] != cached[s][:n])
                lcp = int(neq[0]) if len(neq) else n
                if lcp > best_n:
                    best, best_n = s, lcp
            free.discard(best)
            res.append((best, min(best_n, len(p) - 1)))  # prefill at least one token: we need its logits
        return res

    def _prefill(self, items, sampled):
        """items: [(slot, start, new_tokens)], each slot's tokens before `start` are cached. Long inputs
        go in pieces of `prefill_chunk` tokens (piece k of every item in round k); a round is batched in
        groups whose attention scores stay under `prefill_elems`. Returns {slot: first generated token}."""
        firsts, C, dev = {}, self.prefill_chunk, self.device
        pending = list(items)
        while pending:
            rnd = sorted(((s, st, t[:C], len(t) <= C) for s, st, t in pending), key=lambda it: len(it[2]))
            pending = [(s, st + C, t[C:]) for s, st, t in pending if len(t) > C]
            i = 0
            while i < len(rnd):
                j = i + 1
                while j < len(rnd) and (j + 1 - i) * len(rnd[j][2]) * self.H * self.bucket(
                        max(st + len(t) for _, st, t, _ in rnd[i:j + 1])) <= self.prefill_elems:
                    j += 1
                chunk, i = rnd[i:j], j
                S = len(chunk[-1][2])
                ids = torch.zeros(len(chunk), S, dtype=torch.long)
                for r, (_, _, t, _) in enumerate(chunk):
                    ids[r, :len(t)] = torch.tensor(t, dtype=torch.long)
                starts = torch.tensor([st for _, st, _, _ in chunk])
                lens = torch.tensor([len(t) for _, _, t, _ in chunk])
                P = starts[:, None] + torch.arange(S)[None]  # (b, S); pads sit past each input's end
                idx = torch.tensor([s for s, _, _, _ in chunk])
                x = self._forward(ids.to(dev), P.to(dev), idx.to(dev), self.bucket(int((starts + lens).max())))
                last = x[torch.arange(len(chunk), device=dev), (lens - 1).to(dev)]  # (b, D)
                nxt, lp = self._pick(last, sampled)
                for r, (s, _, _, final) in enumerate(chunk):
                    if final:
                        firsts[s] = (nxt[r], lp[r])
        return firsts

    def generate(self, prompts, max_new_tokens, temperature=0.0, stop=(), progress=None):
        """prompts: list of token-id lists (len <= n_slots). Returns the new token ids of each, ending
        with the stop token when one was produced. progress(n), if given, is called at each host sync with
        the tokens generated so far per sequence."""
        if not prompts:
            return []
        # cached K/V and fused weights are only valid for the weights that computed them: any in-place update
        # (an optimizer step, load_state_dict) bumps a parameter's version counter, and HFPolicy sets .adapters
        # to the active LoRA adapters; a change drops every cached prefix and refreshes the fused weights
        key = (sum(p._version for p in self.model.parameters()), getattr(self, "adapters", None))
        if key != self.weights_key:
            self.reset()
            self._load_weights()
            self.weights_key = key
        if len(prompts) > self.B:
            raise ValueError(f"{len(prompts)} prompts but the engine has {self.B} slots")
        budgets = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
        budgets = [max(0, min(int(m), self.T - len(p))) for m, p in zip(budgets, prompts)]
        sampled = temperature is not None and temperature > 0
        stop = list(stop)[:8]
        with torch.no_grad():
            self.stop.fill_(-1)
            if stop:
                self.stop[:len(stop)] = torch.tensor(stop, device=self.device)
            if sampled:
                self.inv_temp.fill_(1.0 / temperature)
            assign = self._assign(prompts)
            live = [(i, s, r) for i, ((s, r), m) in enumerate(zip(assign, budgets)) if m > 0]
            firsts = self._prefill([(s, r, prompts[i][r:]) for i, s, r in live], sampled)
            # decode state: finished rows keep computing (masked out), their K/V writes land past their valid prefix
            pos, done, max_new = [len(t) for t in self.slot_tokens], [True] * self.B, [0] * self.B
            tok = torch.zeros(self.B, dtype=torch.long, device=self.device)
            for i, s, r in live:
                pos[s], done[s], max_new[s] = len(prompts[i]), False, budgets[i]
                tok[s], self.out_lp[s, 0] = firsts[s]
            self.tok.copy_(tok)
            self.pos.copy_(torch.tensor(pos).clamp(max=self.T))
            self.max_new.copy_(torch.tensor(max_new))
            self.out[:, 0] = tok
            self.step.fill_(1)
            self.done.copy_(torch.tensor(done, device=self.device) | (self.max_new <= 1) |
                            (tok[:, None] == self.stop[None]).any(-1))
            n_steps = max(max_new) - 1 if live else 0
            longest = max((len(prompts[i]) for i, _, _ in live), default=0)
            for t in range(n_steps):
                if t % self.check_every == 0:
                    if bool(self.done.all()):  # the only host sync in the loop
                        break
                    if progress is not None:
                        progress(t + 1)
                self._replay(self.bucket(longest + t + 1), sampled)
            out = self.out[:, :max(1, n_steps + 1)].tolist()
            out_lp = self.out_lp[:, :max(1, n_steps + 1)].tolist()
        results, self.last_logprobs = [], []
        stops = set(stop)
        for i, (s, r) in enumerate(assign):
            m = budgets[i]
            gen = out[s][:m] if m > 0 else []
            for j, t in enumerate(gen):
                if t in stops:
                    gen = gen[:j + 1]
                    break
            results.append(gen)
            self.last_logprobs.append(out_lp[s][:len(gen)])
            # valid K/V now: the prompt plus every generated token but the last (it was never fed)
            self.slot_tokens[s] = list(prompts[i]) + gen[:-1] if gen else list(prompts[i][:r])
        return results

    def _load_weights(self):
        """Computes the fused projections (_layer_weights) into self.w: the first time as they come (plain
        parameters are referenced, not copied), afterwards copied into the same buffers."""
        with torch.no_grad():
            for l, layer in enumerate(self.layers):
                new = _layer_weights(layer)
                if l == len(self.w):
                    self.w.append(new)
                    continue
                for name, t in new.items():
                    old = self.w[l][name]
                    if t is old:
                        continue
                    if t is None or old is None or isinstance(old, torch.nn.Parameter) or old.shape != t.shape:
                        # the model changed shape (an adapter was added to a plain layer): never write into a
                        # parameter; take the new tensor, and recapture graphs (they read the old addresses)
                        self.w[l][name] = t
                        self.graphs.clear()
                    else:
                        old.copy_(t)

    def reset(self):
        """Forget every cached prefix (benchmarks: time a cold prefill)."""
        self.slot_tokens = [[] for _ in range(self.B)]

    def release(self):
        self.graphs.clear()
        self.k = self.v = None
        self.w, self.weights_key = [], None
