"""reward.py: the paper's reward and the metrics defined by it (arXiv 2602.24286, KernelBench's rates).

env.py scores a candidate with reward_for; evaluate.py and train.py report summarize() over verdicts, so that
training and evaluation count "faster" the same way: more than MARGIN faster than the baseline.
"""
from __future__ import annotations

import math

MARGIN = 0.05  # the paper's 5% speed margin


def reward_for(correct: bool, runtime_ms, eager_ms, compile_ms) -> int:
    """The paper's milestone reward. b(t, t0) = 1 if (t0 - t) / t0 > 5%."""
    if not correct:
        return -1
    if runtime_ms is None or eager_ms is None or compile_ms is None:
        return 1
    beats = lambda t0: (t0 - runtime_ms) / t0 > MARGIN
    if beats(eager_ms) and beats(compile_ms):
        return 3
    return 2 if beats(eager_ms) else 1


def beats(t_ms, t0_ms) -> bool:
    """True if runtime t beats baseline t0 by more than the reward's margin, decided by reward_for itself:
    with both baselines set to t0, reward >= 2 means (t0 - t) / t0 > MARGIN."""
    return t_ms is not None and t0_ms is not None and t0_ms > 0 and reward_for(True, t_ms, t0_ms, t0_ms) >= 2


def summarize(rows) -> dict:
    """Metrics over a list of task rows. A row is a tasks.jsonl record ({"verdict": {...}, "n_turns", "n_tokens",
    "seconds"}) or a bare env.Verdict (or its dict). Rates are over ALL rows (a failure counts 0); geomeans over
    correct rows."""
    rows = [r.to_dict() if hasattr(r, "to_dict") else r for r in rows]
    n = len(rows)
    verdicts = [(r.get("verdict", r) if isinstance(r, dict) else None) or {} for r in rows]
    ok = [v for v in verdicts if v.get("correct")]

    def rate(k):
        return k / n if n else None

    def geomean(key):
        xs = [v[key] for v in ok if v.get(key) is not None and v[key] > 0]
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

    def mean(key):
        xs = [r[key] for r in rows if isinstance(r, dict) and r.get(key) is not None]
        return sum(xs) / len(xs) if xs else None

    return {
        "n": n,
        "n_correct": len(ok),
        "pass_rate": rate(len(ok)),
        "faster_eager_rate": rate(sum(beats(v.get("runtime_ms"), v.get("eager_ms")) for v in ok)),
        "faster_compile_rate": rate(sum(beats(v.get("runtime_ms"), v.get("compile_ms")) for v in ok)),
        "fast_1": rate(sum((v.get("speedup_eager") or 0) > 1.0 for v in ok)),
        "geomean_speedup_eager": geomean("speedup_eager"),
        "geomean_speedup_compile": geomean("speedup_compile"),
        "mean_turns": mean("n_turns"),
        "mean_tokens": mean("n_tokens"),
        "task_s": sum(r.get("seconds") or 0.0 for r in rows if isinstance(r, dict)),
    }
