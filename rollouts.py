"""rollouts.py: bookkeeping on scored episodes (the dicts agent.py writes: tokens, loss_mask, reward, verdict,
turns), for train.py: which tasks the teacher works and which are held out, which training tasks a step rolls
out, which -1s are the harness's and not the policy's, which episodes RFT may imitate, the per-step statistics,
and the cut to the model's context before an update.
Pure functions on dicts: no model, no files.
"""
from __future__ import annotations

import json
import math
import random


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


def split_tasks(train: list, test: list, cfg) -> tuple[list, list]:
    """(teacher's tasks, held-out tasks). The held-out tasks are the test split; the teacher gets training tasks
    only, and never one whose code is also held out (a hand-made dataset may repeat a task across splits)."""
    heldout = test[:cfg.eval_tasks]
    codes = {t["code"] for t in heldout}
    pool = [t for t in train if t["code"] not in codes]
    return pool[:cfg.sft_tasks] if cfg.sft_tasks else pool, heldout


HARNESS_ERRORS = ("the reference model.py failed", "final evaluation failed")


def harness_failed(ep) -> bool:
    """The -1 was the harness's (the task's reference does not run, the evaluation itself crashed), not the
    policy's: such episodes carry no reward signal and are neither trained on nor counted in the reward."""
    err = (ep.get("verdict") or {}).get("error") or ""
    return err.startswith(HARNESS_ERRORS)


def trainable(eps: list) -> list:
    """Episodes whose -1 was the harness's (harness_failed) keep their place in the batch with no model
    tokens: nothing is trained on them, and they do not enter the advantage statistics."""
    return [{**e, "loss_mask": [0] * len(e["loss_mask"])} if harness_failed(e) else e for e in eps]


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


def fit_context(eps: list, max_context: int) -> list:
    """Sequences longer than max_context are cut (the reward stays on the last kept model token)."""
    return [e if len(e["tokens"]) <= max_context else
            {**e, **{k: e[k][:max_context] for k in ("tokens", "loss_mask", "logprobs") if e.get(k) is not None}}
            for e in eps]

